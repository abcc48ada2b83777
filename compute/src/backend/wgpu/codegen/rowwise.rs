//! The row-wise kernels as data and their WGSL: workgroup reductions (a
//! tree in workgroup memory, or subgroup operations), layer, RMS and
//! group norms ([`RowNorm`], the split form for few long rows
//! [`SplitNorm`]) and softmax ([`Softmax`]).

use super::lit;

/// Threads of a row-wise kernel's workgroup for rows of `len`: 256, or
/// fewer (at least 32) for shorter rows, whose other threads would only
/// join the reductions. On lavapipe a workgroup costs in proportion to
/// its threads whether they work or not: a layer norm over rows of 32
/// took ~6.5 ms at 256 threads.
fn row_threads(len: usize) -> usize {
    len.next_power_of_two().clamp(32, MAX_THREADS)
}

/// Threads of the widest row-wise workgroup, and of a split group
/// norm's (its rows are long by construction).
const MAX_THREADS: usize = 256;

/// Workgroup-wide sum and max of one value per thread (`threads` of
/// them, a power of two up to 256). The portable form reduces a tree in
/// workgroup memory; the subgroup form reduces within each subgroup in
/// registers, then across subgroups.
fn reduce_tree(threads: usize) -> String {
    let half = threads / 2;
    format!(
        r#"
var<workgroup> red: array<f32, {threads}>;
fn wg_sum(v: f32, t: u32) -> f32 {{
    red[t] = v;
    workgroupBarrier();
    for (var s = {half}u; s > 0u; s = s >> 1u) {{
        if (t < s) {{ red[t] = red[t] + red[t + s]; }}
        workgroupBarrier();
    }}
    let r = red[0];
    workgroupBarrier();
    return r;
}}
fn wg_max(v: f32, t: u32) -> f32 {{
    red[t] = v;
    workgroupBarrier();
    for (var s = {half}u; s > 0u; s = s >> 1u) {{
        if (t < s) {{ red[t] = max(red[t], red[t + s]); }}
        workgroupBarrier();
    }}
    let r = red[0];
    workgroupBarrier();
    return r;
}}
"#
    )
}

pub(super) const REDUCE_SUBGROUP: &str = r#"
var<workgroup> red: array<f32, 256>;
var<private> sg_lane: u32;
var<private> sg_index: u32;
var<private> sg_count: u32;
fn wg_sum(v: f32, t: u32) -> f32 {
    let s = subgroupAdd(v);
    if (sg_lane == 0u) { red[sg_index] = s; }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < sg_count; i++) { total = total + red[i]; }
    workgroupBarrier();
    return total;
}
fn wg_max(v: f32, t: u32) -> f32 {
    let s = subgroupMax(v);
    if (sg_lane == 0u) { red[sg_index] = s; }
    workgroupBarrier();
    var m = -3.4028235e38;
    for (var i = 0u; i < sg_count; i++) { m = max(m, red[i]); }
    workgroupBarrier();
    return m;
}
"#;

/// Entry-point parameters and setup for the subgroup reductions.
const SG_PARAMS: &str = ", @builtin(subgroup_invocation_id) sgi: u32, @builtin(subgroup_id) sgid: u32, @builtin(num_subgroups) nsg: u32";
const SG_SETUP: &str = "sg_lane = sgi; sg_index = sgid; sg_count = nsg;";

/// The setup line the subgroup reductions need at the top of `main`.
fn setup_line(subgroups: bool) -> &'static str {
    if subgroups {
        SG_SETUP
    } else {
        ""
    }
}

/// The entry point of a row-wise kernel of `threads` threads, after the
/// reduction helpers of the chosen form (with their parameters).
fn entry(subgroups: bool, threads: usize) -> String {
    let (reduce, params) = if subgroups {
        (REDUCE_SUBGROUP.to_string(), SG_PARAMS)
    } else {
        (reduce_tree(threads), "")
    };
    format!(
        "
{reduce}
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>{params}) {{
"
    )
}

/// The affine step after normalising element `j` of a row (at `base +
/// j`), into `y`.
#[derive(Clone, Copy, Debug)]
pub(super) enum Affine {
    None,
    /// Per column: weight `in1[j]`, and bias `in2[j]` where `bias`.
    Columns {
        bias: bool,
    },
    /// A group norm's per-channel weight and bias, channels of `spatial`
    /// elements, `channels` of them.
    Channels {
        spatial: usize,
        channels: usize,
    },
}

impl Affine {
    fn wgsl(self) -> String {
        match self {
            Affine::None => String::new(),
            Affine::Columns { bias: true } => "y = y * rd1(j) + rd2(j);".into(),
            Affine::Columns { bias: false } => "y = y * rd1(j);".into(),
            Affine::Channels { spatial, channels } => format!(
                "let ch = (base + j) / {spatial}u % {channels}u; y = y * rd1(ch) + rd2(ch);"
            ),
        }
    }
}

/// A normalisation with a workgroup per row of `len` elements: mean
/// (where `center`) and variance in two passes for accuracy, then
/// normalise, the affine step and the epilogue.
#[derive(Clone, Copy, Debug)]
pub(super) struct RowNorm {
    pub rows: usize,
    pub len: usize,
    /// Elements read through `off0` (a strided view), else dense.
    pub viewed: bool,
    pub center: bool,
    pub eps: f32,
    pub affine: Affine,
}

impl RowNorm {
    pub(super) fn wgsl(&self, subgroups: bool) -> String {
        let RowNorm {
            rows, len, center, ..
        } = *self;
        let threads = row_threads(len);
        let setup = setup_line(subgroups);
        let read = if self.viewed {
            "rd0(off0(base + j))"
        } else {
            "rd0(base + j)"
        };
        format!(
            "{entry}    {setup}
    let row = wg.x + wg.y * 65535u;
    if (row >= {rows}u) {{ return; }}
    let t = lid.x;
    let base = row * {len}u;
    var mean = 0.0;
    if ({center}) {{
        var s = 0.0;
        for (var j = t; j < {len}u; j = j + {threads}u) {{ s = s + {read}; }}
        mean = wg_sum(s, t) / f32({len}u);
    }}
    var q = 0.0;
    for (var j = t; j < {len}u; j = j + {threads}u) {{ let d = {read} - mean; q = q + d * d; }}
    let rstd = inverseSqrt(wg_sum(q, t) / f32({len}u) + {eps});
    for (var j = t; j < {len}u; j = j + {threads}u) {{
        var y = ({read} - mean) * rstd;
        {affine}
        let oi = base + j;
        wr(oi, epi(y, oi));
    }}
}}
",
            entry = entry(subgroups, threads),
            eps = lit(self.eps),
            affine = self.affine.wgsl(),
        )
    }
}

/// Workgroups a split group norm aims for: several per SM of a large GPU,
/// so the loads of enough warps are in flight to hide memory latency.
pub(super) const NORM_SPLIT_TARGET: usize = 1024;
/// Elements a split group norm's workgroup keeps at least (16 per thread).
pub(super) const NORM_MIN_CHUNK: usize = 4096;

/// How a group norm of `rows` rows of `per` elements splits each row:
/// (chunks per row, elements per chunk), or None where the rows alone
/// give enough workgroups or are too short to split.
pub(super) fn norm_split(rows: usize, per: usize) -> Option<(usize, usize)> {
    if rows >= NORM_SPLIT_TARGET / 2 {
        return None;
    }
    // At most one chunk per thread of the combining workgroup.
    let want = NORM_SPLIT_TARGET
        .div_ceil(rows)
        .min(per / NORM_MIN_CHUNK)
        .min(MAX_THREADS);
    if want < 2 {
        return None;
    }
    let clen = per.div_ceil(want);
    Some((per.div_ceil(clen), clen))
}

/// A group norm whose few long rows are split into `chunks` chunks of
/// `clen` elements, a workgroup each, in two passes on one grid
/// ([`norm_split`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct SplitNorm {
    pub rows: usize,
    pub per: usize,
    pub chunks: usize,
    pub clen: usize,
    pub eps: f32,
    pub affine: Affine,
}

impl SplitNorm {
    /// The start of both passes: the workgroup's (row, chunk), its thread,
    /// and the chunk's element range within the row.
    fn setup(&self, subgroups: bool) -> String {
        let setup = setup_line(subgroups);
        let SplitNorm {
            rows,
            per,
            chunks,
            clen,
            ..
        } = *self;
        format!(
            "{setup}
    let id = wg.x + wg.y * 65535u;
    if (id >= {total}u) {{ return; }}
    let row = id / {chunks}u;
    let t = lid.x;
    let base = row * {per}u;
    let lo = id % {chunks}u * {clen}u;
    let hi = min(lo + {clen}u, {per}u);",
            total = rows * chunks
        )
    }

    /// First pass: a workgroup per (row, chunk) writes the chunk's mean
    /// and sum of squared deviations (two passes over the chunk, as
    /// [`RowNorm`], for accuracy) to `part`.
    pub(super) fn stats_wgsl(&self, subgroups: bool) -> String {
        format!(
            "{}    {}
    var s = 0.0;
    for (var j = lo + t; j < hi; j = j + {MAX_THREADS}u) {{ s = s + rd0(base + j); }}
    let mean = wg_sum(s, t) / f32(hi - lo);
    var q = 0.0;
    for (var j = lo + t; j < hi; j = j + {MAX_THREADS}u) {{ let d = rd0(base + j) - mean; q = q + d * d; }}
    let m2 = wg_sum(q, t);
    if (t == 0u) {{ part[id * 2u] = mean; part[id * 2u + 1u] = m2; }}
}}
",
            entry(subgroups, MAX_THREADS),
            self.setup(subgroups)
        )
    }

    /// Second pass (same grid): each workgroup combines its row's chunk
    /// statistics (Chan et al.'s pairwise update: the row's sum of
    /// squared deviations is the chunks' plus each chunk's count times its
    /// mean's squared distance from the row's) and normalises its chunk.
    pub(super) fn apply_wgsl(&self, subgroups: bool) -> String {
        let SplitNorm {
            per, chunks, clen, ..
        } = *self;
        format!(
            "{entry}    {setup}
    var cnt = 0.0;
    var cm = 0.0;
    var cq = 0.0;
    if (t < {chunks}u) {{
        cnt = f32(min((t + 1u) * {clen}u, {per}u) - t * {clen}u);
        cm = part[(row * {chunks}u + t) * 2u];
        cq = part[(row * {chunks}u + t) * 2u + 1u];
    }}
    let mean = wg_sum(cnt * cm, t) / f32({per}u);
    let dm = cm - mean;
    let rstd = inverseSqrt(wg_sum(cq + cnt * dm * dm, t) / f32({per}u) + {eps});
    for (var j = lo + t; j < hi; j = j + {MAX_THREADS}u) {{
        var y = (rd0(base + j) - mean) * rstd;
        {affine}
        let oi = base + j;
        wr(oi, epi(y, oi));
    }}
}}
",
            entry = entry(subgroups, MAX_THREADS),
            setup = self.setup(subgroups),
            eps = lit(self.eps),
            affine = self.affine.wgsl(),
        )
    }
}

/// Softmax with a workgroup per row of `len` elements, `inner` apart.
#[derive(Clone, Copy, Debug)]
pub(super) struct Softmax {
    pub rows: usize,
    pub len: usize,
    pub inner: usize,
}

impl Softmax {
    pub(super) fn wgsl(&self, subgroups: bool) -> String {
        let Softmax { rows, len, inner } = *self;
        let threads = row_threads(len);
        let setup = setup_line(subgroups);
        format!(
            "{entry}    {setup}
    let row = wg.x + wg.y * 65535u;
    if (row >= {rows}u) {{ return; }}
    let t = lid.x;
    let o = row / {inner}u; let i = row % {inner}u;
    let base = o * {len}u * {inner}u + i;
    var m = -3.4028235e38;
    for (var j = t; j < {len}u; j = j + {threads}u) {{ m = max(m, rd0(base + j * {inner}u)); }}
    m = wg_max(m, t);
    var sum = 0.0;
    for (var j = t; j < {len}u; j = j + {threads}u) {{ sum = sum + exp(rd0(base + j * {inner}u) - m); }}
    sum = wg_sum(sum, t);
    for (var j = t; j < {len}u; j = j + {threads}u) {{
        let oi = base + j * {inner}u;
        wr(oi, epi(exp(rd0(oi) - m) / sum, oi));
    }}
}}
",
            entry = entry(subgroups, threads),
        )
    }
}
