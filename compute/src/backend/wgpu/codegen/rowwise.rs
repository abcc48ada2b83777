//! The row-wise kernels' templates: workgroup reductions (a tree in
//! workgroup memory, or subgroup operations), layer and group norms (with
//! the split form for few long rows) and softmax.

/// Workgroup-wide sum and max of one value per thread (256 threads). The
/// portable form reduces a tree in workgroup memory; the subgroup form
/// reduces within each subgroup in registers, then across subgroups.
pub(super) const REDUCE_TREE: &str = r#"
var<workgroup> red: array<f32, 256>;
fn wg_sum(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { red[t] = red[t] + red[t + s]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}
fn wg_max(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { red[t] = max(red[t], red[t + s]); }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}
"#;

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
pub(super) const SG_PARAMS: &str = ", @builtin(subgroup_invocation_id) sgi: u32, @builtin(subgroup_id) sgid: u32, @builtin(num_subgroups) nsg: u32";
pub(super) const SG_SETUP: &str = "sg_lane = sgi; sg_index = sgid; sg_count = nsg;";

/// Fills a reduction kernel template for the chosen reduction form.
pub(super) fn with_reductions(template: &str, subgroups: bool) -> String {
    if subgroups {
        template
            .replace("REDUCE", REDUCE_SUBGROUP)
            .replace("MAIN_PARAMS", SG_PARAMS)
            .replace("MAIN_SETUP", SG_SETUP)
    } else {
        template
            .replace("REDUCE", REDUCE_TREE)
            .replace("MAIN_PARAMS", "")
            .replace("MAIN_SETUP", "")
    }
}

/// A workgroup per row: mean (if CENTER) and variance in two passes for
/// accuracy, then normalise and store.
pub(super) const ROW_NORM: &str = r#"
REDUCE
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>MAIN_PARAMS) {
    MAIN_SETUP
    let row = wg.x + wg.y * 65535u;
    if (row >= ROWS) { return; }
    let t = lid.x;
    let base = BASE;
    var mean = 0.0;
    if (CENTER) {
        var s = 0.0;
        for (var j = t; j < ROW_LEN; j = j + 256u) { s = s + READ(j); }
        mean = wg_sum(s, t) / f32(ROW_LEN);
    }
    var q = 0.0;
    for (var j = t; j < ROW_LEN; j = j + 256u) { let d = READ(j) - mean; q = q + d * d; }
    let rstd = inverseSqrt(wg_sum(q, t) / f32(ROW_LEN) + EPS);
    for (var j = t; j < ROW_LEN; j = j + 256u) {
        var y = (READ(j) - mean) * rstd;
        AFFINE
        let oi = base + j;
        dst[oi] = epi(y, oi);
    }
}
"#;

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
        .min(256);
    if want < 2 {
        return None;
    }
    let clen = per.div_ceil(want);
    Some((per.div_ceil(clen), clen))
}

/// The start of both split group norm passes: the workgroup's (row,
/// chunk), its thread, and the chunk's element range within the row.
pub(super) const NORM_CHUNK_SETUP: &str = "MAIN_SETUP
    let id = wg.x + wg.y * 65535u;
    if (id >= TOTAL) { return; }
    let row = id / CHUNKS;
    let t = lid.x;
    let base = row * PER;
    let lo = id % CHUNKS * CLEN;
    let hi = min(lo + CLEN, PER);";

/// Split group norm, first pass: a workgroup per (row, chunk) writes the
/// chunk's mean and sum of squared deviations (two passes over the chunk,
/// as `ROW_NORM`, for accuracy) to `part`.
pub(super) const NORM_STATS: &str = r#"
REDUCE
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>MAIN_PARAMS) {
    CHUNK_SETUP
    var s = 0.0;
    for (var j = lo + t; j < hi; j = j + 256u) { s = s + in0[base + j]; }
    let mean = wg_sum(s, t) / f32(hi - lo);
    var q = 0.0;
    for (var j = lo + t; j < hi; j = j + 256u) { let d = in0[base + j] - mean; q = q + d * d; }
    let m2 = wg_sum(q, t);
    if (t == 0u) { part[id * 2u] = mean; part[id * 2u + 1u] = m2; }
}
"#;

/// Split group norm, second pass (same grid): each workgroup combines its
/// row's chunk statistics (Chan et al.'s pairwise update: the row's sum
/// of squared deviations is the chunks' plus each chunk's count times its
/// mean's squared distance from the row's) and normalises its chunk.
pub(super) const NORM_APPLY: &str = r#"
REDUCE
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>MAIN_PARAMS) {
    CHUNK_SETUP
    var cnt = 0.0;
    var cm = 0.0;
    var cq = 0.0;
    if (t < CHUNKS) {
        cnt = f32(min((t + 1u) * CLEN, PER) - t * CLEN);
        cm = part[(row * CHUNKS + t) * 2u];
        cq = part[(row * CHUNKS + t) * 2u + 1u];
    }
    let mean = wg_sum(cnt * cm, t) / f32(PER);
    let dm = cm - mean;
    let rstd = inverseSqrt(wg_sum(cq + cnt * dm * dm, t) / f32(PER) + EPS);
    for (var j = lo + t; j < hi; j = j + 256u) {
        var y = (in0[base + j] - mean) * rstd;
        AFFINE
        let oi = base + j;
        dst[oi] = epi(y, oi);
    }
}
"#;

/// A workgroup per softmax row (stride INNER between elements).
pub(super) const SOFTMAX: &str = r#"
REDUCE
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>MAIN_PARAMS) {
    MAIN_SETUP
    let row = wg.x + wg.y * 65535u;
    if (row >= ROWS) { return; }
    let t = lid.x;
    let o = row / INNER; let i = row % INNER;
    let base = o * LEN * INNER + i;
    var m = -3.4028235e38;
    for (var j = t; j < LEN; j = j + 256u) { m = max(m, in0[base + j * INNER]); }
    m = wg_max(m, t);
    var sum = 0.0;
    for (var j = t; j < LEN; j = j + 256u) { sum = sum + exp(in0[base + j * INNER] - m); }
    sum = wg_sum(sum, t);
    for (var j = t; j < LEN; j = j + 256u) {
        let oi = base + j * INNER;
        dst[oi] = epi(exp(in0[oi] - m) / sum, oi);
    }
}
"#;
