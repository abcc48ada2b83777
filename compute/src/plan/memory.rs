//! Activation memory: offsets in one arena from buffer lifetimes.

/// A buffer's size in bytes and the first and last kernel (inclusive)
/// that touch it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    pub size: usize,
    pub first: usize,
    pub last: usize,
}

impl Lifetime {
    fn overlaps(&self, o: &Lifetime) -> bool {
        self.first <= o.last && o.first <= self.last
    }
}

/// Byte alignment of every offset (enough for f32x16 loads and for GPU
/// storage-buffer offset alignment).
pub const ALIGN: usize = 256;

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Greedy by size, best fit: place the largest buffers first; each goes in
/// the smallest gap between already-placed buffers whose lifetimes overlap
/// its own, or above them all. Returns byte offsets, in input order. Two
/// buffers that are live at the same time never overlap.
pub fn assign_offsets(bufs: &[Lifetime]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..bufs.len()).collect();
    order.sort_by(|&a, &b| {
        bufs[b]
            .size
            .cmp(&bufs[a].size)
            .then(bufs[a].first.cmp(&bufs[b].first))
    });
    let mut offsets = vec![0usize; bufs.len()];
    let mut placed: Vec<usize> = Vec::new();
    for &i in &order {
        let me = bufs[i];
        let need = align(me.size);
        // Occupied ranges of conflicting buffers, sorted by offset.
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&j| bufs[j].overlaps(&me))
            .map(|&j| (offsets[j], offsets[j] + align(bufs[j].size)))
            .collect();
        busy.sort_unstable();
        let mut best: Option<(usize, usize)> = None; // (gap size, offset)
        let mut cursor = 0;
        for &(start, end) in &busy {
            if start >= cursor + need {
                let gap = start - cursor;
                if best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, cursor));
                }
            }
            cursor = cursor.max(end);
        }
        offsets[i] = best.map_or(cursor, |(_, off)| off);
        placed.push(i);
    }
    offsets
}

/// The most bytes live at any one kernel: no placement can use less.
pub fn lower_bound(bufs: &[Lifetime]) -> usize {
    let end = bufs.iter().map(|b| b.last).max().map_or(0, |m| m + 1);
    // Difference array of live bytes over time.
    let mut delta = vec![0i128; end + 1];
    for b in bufs {
        delta[b.first] += align(b.size) as i128;
        delta[b.last + 1] -= align(b.size) as i128;
    }
    let mut cur = 0i128;
    let mut best = 0i128;
    for d in delta {
        cur += d;
        best = best.max(cur);
    }
    best as usize
}
