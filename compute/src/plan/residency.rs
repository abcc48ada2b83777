//! Weight residency under a device-memory budget: which of a program's
//! weights stay on the device and which stream from host memory each run.
//!
//! Pure planning: the input is a [`ModelUse`] (the program's weights with
//! the kernel range reading each, its activation bytes and how many times
//! it runs in a row), the output a [`ResidencyPlan`] a backend executes.
//!
//! A denoiser runs the same program every step, so its weight accesses are
//! cyclic; for cyclic access the optimum (Belady) is a fixed resident set,
//! moving exactly (model bytes − resident bytes) per run. The planner
//! keeps as many bytes resident as fit and streams the rest through a ring
//! buffer (the *stream arena*): each streamed weight is copied in one kernel
//! ahead of its first reader and its slot is reused once its last reader
//! ran.
//!
//! Guarantees (property-tested in `engine/tests/residency.rs`):
//! - activations + resident weights + stream arena ≤ budget;
//! - every streamed weight is in its slot, not overwritten, from its upload
//!   to its last reader;
//! - bytes moved per run = streamed bytes = model bytes − resident bytes;
//! - a larger budget never moves more bytes.
//!
//! Monotonicity comes from the selection rule: the stream arena is
//! reserved for the worst case (every streamable weight streamed) before
//! resident weights are chosen, largest first, into the fixed remainder;
//! first-fit in a fixed order into a larger capacity never keeps fewer
//! bytes. The reservation is at most the two largest kernels' weights,
//! a few percent of a UNet.

use std::collections::HashMap;

/// A weight a program reads.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightUse {
    pub name: String,
    /// Bytes on the device (after the backend's storage conversion).
    pub bytes: u64,
    /// First and last kernel (dispatch index) that read it.
    pub first: usize,
    pub last: usize,
    /// Must stay resident: it is already on the device and in use by a
    /// program still prepared (another of the same model's programs).
    pub keep: bool,
}

/// One model's program, run `runs` times in a row.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelUse {
    pub weights: Vec<WeightUse>,
    pub kernels: usize,
    /// Activation memory (the planned arena plus inputs/outputs).
    pub activation_bytes: u64,
    pub runs: usize,
}

/// A streamed weight's slot.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamSlot {
    /// Index into `ModelUse::weights`.
    pub weight: usize,
    /// Byte offset in the stream arena.
    pub offset: u64,
    /// The copy is recorded before this kernel (one ahead of the first
    /// reader, so it can overlap the previous kernel).
    pub upload_before: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ResidencyPlan {
    /// Indices into `ModelUse::weights` that stay on the device.
    pub resident: Vec<usize>,
    pub streamed: Vec<StreamSlot>,
    pub stream_arena_bytes: u64,
    pub resident_bytes: u64,
    /// Bytes copied host → device every run.
    pub streamed_bytes_per_run: u64,
    /// Activations + resident weights + stream arena.
    pub device_bytes: u64,
    /// No plan can move fewer bytes per run under this budget: at most
    /// (budget − activations) bytes of weights fit on the device.
    pub lower_bound_per_run: u64,
}

impl ResidencyPlan {
    /// Bytes moved over `runs` runs, counting the resident weights' first
    /// upload.
    pub fn bytes_moved(&self, runs: usize) -> u64 {
        self.resident_bytes + self.streamed_bytes_per_run * runs as u64
    }
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ResidencyError {
    #[error(
        "the device memory budget ({budget} bytes) cannot hold this model's activations \
         ({activations} bytes)"
    )]
    Activations { budget: u64, activations: u64 },
    #[error(
        "the device memory budget ({budget} bytes) cannot hold activations ({activations} \
         bytes) plus the weights that must stay resident ({pinned} bytes) and one layer's \
         streaming working set ({stream} bytes)"
    )]
    TooSmall {
        budget: u64,
        activations: u64,
        pinned: u64,
        stream: u64,
    },
    #[error(
        "the device memory budget ({budget} bytes) cannot hold this model use ({needed} bytes) \
         beside the weights programs still prepared are using ({held} bytes)"
    )]
    InUse { budget: u64, needed: u64, held: u64 },
}

fn align_up(v: u64, align: u64) -> u64 {
    v.div_ceil(align) * align
}

/// Live interval of a streamed weight, in kernel indices: from the kernel
/// its copy precedes to its last reader.
fn interval(w: &WeightUse) -> (usize, usize) {
    (w.first.saturating_sub(1), w.last)
}

/// Peak of live streamed bytes plus the largest streamed weight: a ring
/// buffer of this size always has room (see `ring`), given first-in
/// first-out lifetimes.
fn ring_bound(weights: &[WeightUse], set: &[usize], align: u64) -> u64 {
    if set.is_empty() {
        return 0;
    }
    let mut events: Vec<(usize, i8, u64)> = Vec::new();
    let mut max = 0;
    for &i in set {
        let (s, e) = interval(&weights[i]);
        let b = align_up(weights[i].bytes, align);
        max = max.max(b);
        events.push((s, 1, b));
        events.push((e + 1, -1, b));
    }
    // Releases at a point come before allocations at it.
    events.sort_by_key(|&(t, kind, _)| (t, kind));
    let (mut live, mut peak) = (0u64, 0u64);
    for (_, kind, b) in events {
        if kind > 0 {
            live += b;
            peak = peak.max(live);
        } else {
            live -= b;
        }
    }
    peak + max
}

/// Places streamed weights in a ring of `capacity` bytes, in upload order;
/// a slot is freed after its last reader. Returns None if some weight finds
/// no contiguous room.
fn ring(
    weights: &[WeightUse],
    set: &[usize],
    capacity: u64,
    align: u64,
) -> Option<Vec<StreamSlot>> {
    let mut order: Vec<usize> = set.to_vec();
    order.sort_by_key(|&i| (interval(&weights[i]), i));
    // Live slots in allocation order: (offset, size, end).
    let mut live: std::collections::VecDeque<(u64, u64, usize)> = Default::default();
    let mut head = 0u64;
    let mut slots = Vec::new();
    for i in order {
        let (start, end) = interval(&weights[i]);
        let size = align_up(weights[i].bytes, align);
        // Free slots whose last reader ran before this upload, oldest
        // first (a slot behind a still-live older one waits for it).
        while live.front().is_some_and(|&(_, _, e)| e < start) {
            live.pop_front();
        }
        if size > capacity {
            return None;
        }
        let offset = match live.front() {
            None => 0,
            Some(&(tail, _, _)) if head > tail => {
                // Live bytes are [tail, head): room after head, or at 0.
                if capacity - head >= size {
                    head
                } else if tail >= size {
                    0
                } else {
                    return None;
                }
            }
            // Wrapped: live bytes are [tail, capacity) and [0, head).
            Some(&(tail, _, _)) => {
                if tail - head >= size {
                    head
                } else {
                    return None;
                }
            }
        };
        head = offset + size;
        live.push_back((offset, size, end));
        slots.push(StreamSlot {
            weight: i,
            offset,
            upload_before: start,
        });
    }
    Some(slots)
}

/// Plans residency for `u` under `budget` bytes. `align` is the device's
/// storage-binding offset alignment (slots start on it). Weights read by
/// kernels more than one apart are pinned resident (streaming them would
/// hold a slot across the gap); so are weights larger than `max_stream`
/// and those marked `keep`.
pub fn plan_residency(
    u: &ModelUse,
    budget: u64,
    align: u64,
    max_stream: u64,
) -> Result<ResidencyPlan, ResidencyError> {
    let align = align.max(4);
    let total: u64 = u.weights.iter().map(|w| w.bytes).sum();
    let act = u.activation_bytes;
    if act > budget {
        return Err(ResidencyError::Activations {
            budget,
            activations: act,
        });
    }
    let lower_bound_per_run = total.saturating_sub(budget - act);
    let all: Vec<usize> = (0..u.weights.len()).collect();
    if act + total <= budget {
        return Ok(ResidencyPlan {
            resident: all,
            streamed: Vec::new(),
            stream_arena_bytes: 0,
            resident_bytes: total,
            streamed_bytes_per_run: 0,
            device_bytes: act + total,
            lower_bound_per_run,
        });
    }
    let (pinned, streamable): (Vec<usize>, Vec<usize>) = all.iter().partition(|&&i| {
        let w = &u.weights[i];
        w.keep || w.last > w.first + 1 || w.bytes > max_stream
    });
    let pinned_bytes: u64 = pinned.iter().map(|&i| u.weights[i].bytes).sum();
    let reserve = ring_bound(&u.weights, &streamable, align);
    let room = budget - act;
    if pinned_bytes + reserve > room {
        return Err(ResidencyError::TooSmall {
            budget,
            activations: act,
            pinned: pinned_bytes,
            stream: reserve,
        });
    }
    // Largest first into the room left after the worst-case stream arena.
    let mut order = streamable.clone();
    order.sort_by(|&a, &b| {
        u.weights[b]
            .bytes
            .cmp(&u.weights[a].bytes)
            .then_with(|| u.weights[a].name.cmp(&u.weights[b].name))
    });
    let cap = room - reserve;
    let mut resident_bytes = pinned_bytes;
    let mut resident = pinned;
    let mut keep = vec![false; u.weights.len()];
    for i in order {
        let b = u.weights[i].bytes;
        if resident_bytes + b <= cap {
            resident_bytes += b;
            keep[i] = true;
            resident.push(i);
        }
    }
    let streamed_set: Vec<usize> = streamable.into_iter().filter(|&i| !keep[i]).collect();
    let stream_arena_bytes = ring_bound(&u.weights, &streamed_set, align);
    let streamed = ring(&u.weights, &streamed_set, stream_arena_bytes, align).ok_or(
        ResidencyError::TooSmall {
            budget,
            activations: act,
            pinned: pinned_bytes,
            stream: stream_arena_bytes,
        },
    )?;
    resident.sort_unstable();
    let streamed_bytes_per_run = streamed_set.iter().map(|&i| u.weights[i].bytes).sum();
    Ok(ResidencyPlan {
        resident,
        streamed,
        stream_arena_bytes,
        resident_bytes,
        streamed_bytes_per_run,
        device_bytes: act + resident_bytes + stream_arena_bytes,
        lower_bound_per_run,
    })
}

/// The most stream arena a plan of `u` can need (every weight that may
/// stream, streamed): what to leave free for a program prepared later
/// beside others of the same model.
pub fn stream_reserve(u: &ModelUse, align: u64, max_stream: u64) -> u64 {
    let set: Vec<usize> = (0..u.weights.len())
        .filter(|&i| {
            let w = &u.weights[i];
            !(w.keep || w.last > w.first + 1 || w.bytes > max_stream)
        })
        .collect();
    ring_bound(&u.weights, &set, align.max(4))
}

/// The weights a program reads, with the dispatch range reading each, in
/// bytes of `elem_bytes` per element (the backend's weight storage).
pub fn weight_uses(prog: &super::Program, elem_bytes: u64) -> Vec<WeightUse> {
    weight_uses_sized(prog, |_, len| len as u64 * elem_bytes)
}

/// [`weight_uses`] with each weight's device bytes given by `bytes(name,
/// elements)`: a backend that keeps some weights quantized sizes them by
/// their blocks.
pub fn weight_uses_sized(
    prog: &super::Program,
    bytes: impl Fn(&str, usize) -> u64,
) -> Vec<WeightUse> {
    use super::{BufferKind, Command};
    let mut by_buffer: HashMap<u32, usize> = HashMap::new();
    let mut out: Vec<WeightUse> = Vec::new();
    for c in &prog.commands {
        if let Command::Upload { buffer, name } = c {
            by_buffer.insert(buffer.0, out.len());
            out.push(WeightUse {
                name: name.clone(),
                bytes: align_up(bytes(name, prog.buffer(*buffer).len), 4),
                first: usize::MAX,
                last: 0,
                keep: false,
            });
        }
    }
    let mut index = 0;
    for c in &prog.commands {
        let Command::Dispatch { kernel } = c else {
            continue;
        };
        let k = &prog.kernels[kernel.0 as usize];
        for v in &k.inputs {
            if let BufferKind::Weight(_) = prog.buffer(v.buffer).kind {
                if let Some(&w) = by_buffer.get(&v.buffer.0) {
                    out[w].first = out[w].first.min(index);
                    out[w].last = out[w].last.max(index);
                }
            }
        }
        index += 1;
    }
    // A weight no kernel reads (a graph output) counts as read at the end.
    for w in &mut out {
        if w.first == usize::MAX {
            w.first = index.saturating_sub(1);
            w.last = w.first;
        }
    }
    out
}
