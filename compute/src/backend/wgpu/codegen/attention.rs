//! The attention kernels: the portable flash-attention form (up to 64 queries a
//! workgroup, online softmax over staged key blocks) and the cooperative
//! (tensor-core) forms, single- and two-pass, as WGSL generated from
//! their shapes.

use super::units::{unit_writes, unit_zero};
use super::*;

/// Attention with online softmax (flash-attention style, no sq×skv
/// buffer): a workgroup takes 64 queries of one (batch, head), or 16 or
/// 32 where the sequence is that short, a thread each; blocks of keys
/// and values are staged in workgroup memory once for all of them, and
/// each key is folded into the
/// thread's running max, sum and output as it is scored (a per-block
/// score array spills to local memory on NVIDIA and ran slower).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    bh: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    scale: f32,
    masked: bool,
    caps: &Caps,
    units: Units,
) -> (String, [u32; 3]) {
    // Every form scores in base 2: log2(e) folded into the queries' scale
    // (and into the mask's term) makes each exp(x) an exp2, the GPU's
    // native instruction, with no multiply before it.
    let scale = scale * std::f32::consts::LOG2_E;
    if let Some(c) = caps.coop {
        let single = if caps.two_pass_attention {
            None
        } else {
            attention_coop_single(bh, sq, skv, d, dv, scale, masked, c, caps, units)
        };
        if let Some(code) =
            single.or_else(|| attention_coop(bh, sq, skv, d, dv, scale, masked, c, caps, units))
        {
            return code;
        }
    }
    // Queries per workgroup: 64, or as few as 16 for shorter sequences
    // (every thread runs the whole key loop, in bounds or not).
    let q = sq.next_power_of_two().clamp(16, 64);
    // Keys per block: K and V blocks together within the workgroup memory
    // (at most 24 KiB, leaving room on 32 KiB adapters), and no more
    // keys than threads, so a thread's staging loop runs at most `d`
    // trips, as with 64 of each.
    let room = (caps.workgroup_memory as usize).min(24576);
    let mut kb = 64;
    while kb > 1 && (kb * (d + dv) * 4 > room || kb > q) {
        kb /= 2;
    }
    let mask = if masked {
        format!(
            "s = s + rd3(qi * {skv}u + j0 + jj) * {};",
            lit(std::f32::consts::LOG2_E)
        )
    } else {
        String::new()
    };
    let qblocks = sq.div_ceil(q);
    let blocks = bh * qblocks;
    // Copies the block of keys from `j0` of input `j` (rows `width`
    // wide) into `array`, zeros past the last key: in 16-byte units
    // where the input allows ([`Units`]).
    let stage = |array: &str, j: usize, offset: &str, width: usize| {
        if let Some(w) = units[j] {
            let per_row = width / w;
            return strided(
                "        ",
                "lid.x",
                kb * per_row,
                q,
                &format!(
                    "            let jj = e / {per_row}u; let t = (e % {per_row}u) * {w}u;
            var v = {zero};
            if (j0 + jj < {skv}u) {{ v = vld{j}({offset}(bh, j0 + jj, t) / {w}u); }}
            {write}
",
                    zero = unit_zero(w),
                    write = unit_writes(array, &format!("jj * {width}u + t"), "v", "", w, 1),
                ),
            );
        }
        let input = format!("rd{j}");
        strided(
            "        ",
            "lid.x",
            kb * width,
            q,
            &format!(
                "            let jj = e / {width}u; var v = 0.0;
            if (j0 + jj < {skv}u) {{ v = {input}({offset}(bh, j0 + jj, e % {width}u)); }}
            {array}[e] = v;
"
            ),
        )
    };
    let code = format!(
        "var<workgroup> Ks: array<f32, {kl}>;
var<workgroup> Vs: array<f32, {vl}>;
@compute @workgroup_size({q})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {{
    let blk = wg.x + wg.y * 65535u;
    if (blk >= {blocks}u) {{ return; }}
    let bh = blk / {qblocks}u;
    let i = (blk % {qblocks}u) * {q}u + lid.x;
    let qi = min(i, {sqm}u);
    var qr: array<f32, {d}>;
    for (var t = 0u; t < {d}u; t++) {{ qr[t] = rd0(q_off(bh, qi, t)) * {sc}; }}
    var acc: array<f32, {dv}>;
    var m = -3.4028235e38; var l = 0.0;
    for (var j0 = 0u; j0 < {skv}u; j0 += {kb}u) {{
{stage_k}{stage_v}        workgroupBarrier();
        let cnt = min({kb}u, {skv}u - j0);
        for (var jj = 0u; jj < cnt; jj++) {{
            var s = 0.0;
            for (var t = 0u; t < {d}u; t++) {{ s = s + qr[t] * Ks[jj * {d}u + t]; }}
            {mask}
            let mn = max(m, s);
            let corr = exp2(m - mn);
            let p = exp2(s - mn);
            l = l * corr + p;
            for (var t = 0u; t < {dv}u; t++) {{ acc[t] = acc[t] * corr + p * Vs[jj * {dv}u + t]; }}
            m = mn;
        }}
        workgroupBarrier();
    }}
    if (i < {sq}u) {{
        let row = bh * {sq}u + i;
        for (var t = 0u; t < {dv}u; t++) {{ let oi = row * {dv}u + t; wr(oi, epi(acc[t] / l, oi)); }}
    }}
}}
",
        kl = kb * d,
        vl = kb * dv,
        sqm = sq.saturating_sub(1),
        sc = lit(scale),
        stage_k = stage("Ks", 1, "k_off", d),
        stage_v = stage("Vs", 2, "v_off", dv),
    );
    let groups = [blocks.min(65535) as u32, blocks.div_ceil(65535) as u32, 1];
    (code, groups)
}

/// WGSL loading a subgroup's query fragments (its T rows of the staged,
/// scaled Q tile `KQ`, rows `ks` apart) into registers `qa0…`.
pub(super) fn coop_q_fragments(t: usize, qfrags: usize, ks: usize) -> String {
    let mut out = String::new();
    for f in 0..qfrags {
        let _ = writeln!(
            out,
            "    let qa{f} = coopLoadT<coop_mat{t}x{t}<f16, A>>(&KQ[sg * {}u + {}u], {ks}u);",
            t * ks,
            f * t
        );
    }
    out
}

/// WGSL scoring the subgroup's query fragments against a staged block of
/// `bk` keys (`KQ`, row-major by key, rows `ks` apart): f32 fragments
/// stored into the subgroup's rows of `Ss` (rows `ss` apart).
pub(super) fn coop_scores(t: usize, qfrags: usize, ks: usize, bk: usize, ss: usize) -> String {
    let mut out = String::new();
    for jf in 0..bk / t {
        let _ = writeln!(
            out,
            "        {{\n            var sacc = coop_mat{t}x{t}<f32, C>();"
        );
        for f in 0..qfrags {
            let _ = writeln!(
                out,
                "            sacc = coopMultiplyAdd(qa{f}, coopLoad<coop_mat{t}x{t}<f16, B>>(&KQ[{}u], {ks}u), sacc);",
                jf * t * ks + f * t
            );
        }
        let _ = writeln!(
            out,
            "            coopStoreT(sacc, &Ss[sg * {}u + {}u], {ss}u);\n        }}",
            t * ss,
            jf * t
        );
    }
    out
}

/// What both cooperative attention forms share: 4 subgroups of T query
/// rows per workgroup, the head padded to a multiple of T, key blocks of
/// `bk` staged as f16, and the prologue that stages the scaled queries and
/// loads them into fragments.
pub(super) struct CoopAttention {
    t: usize,
    bq: usize,
    dp: usize,
    dvp: usize,
    bk: usize,
    /// Row strides (elements) of `KQ`, `Vs`, `Ss` and `Ps`: each row
    /// padded by 16 bytes ([`SMEM_PAD`]).
    ks: usize,
    vs: usize,
    ss: usize,
    ps: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    scale: f32,
    threads: usize,
    qblocks: usize,
    blocks: usize,
    units: Units,
    /// The next key block's K and V load into registers while this
    /// block is scored and accumulated ([`Caps::prefetch`]): where both
    /// are staged in 16-byte units, a whole number per thread.
    prefetch: bool,
}

/// Elements per 16-byte unit in which K (`[1]`) and V (`[2]`) may be
/// read when staged, by every attention form (`[0]`, Q, is read once per
/// workgroup, element by element): views of whole-unit bindings with the head contiguous and
/// every other stride, the offset and the head's width whole units.
pub(super) type Units = [Option<usize>; 3];

/// One staged tile of a key block: K (into `KQ`) or V (into `Vs`), from
/// input `input` addressed by `offset`, `width` wide, padded with zeros
/// to `padded` columns, rows `stride` apart.
#[derive(Clone, Copy)]
struct Tile {
    array: &'static str,
    input: usize,
    offset: &'static str,
    padded: usize,
    stride: usize,
    width: usize,
}

/// Where [`CoopAttention::stage`] puts a block: straight into the tile,
/// into the thread's registers (`p` + the tile's name, a prefetch), or
/// from those registers into the tile.
enum Dest {
    Tile,
    Registers,
    Commit,
}

/// `code` with every line indented `by` more spaces.
fn indent(code: &str, by: usize) -> String {
    let pad = " ".repeat(by);
    code.lines().map(|l| format!("{pad}{l}\n")).collect()
}

/// Subgroups per cooperative attention workgroup.
pub(super) const COOP_ATTN_SUBGROUPS: usize = 4;

impl CoopAttention {
    /// The largest key block (64, 32 or 16, at least T, a multiple of
    /// `lanes_per_row`) whose workgroup arrays, plus `extra_bytes`, fit;
    /// None when none does.
    #[allow(clippy::too_many_arguments)]
    fn new(
        bh: usize,
        (sq, skv, d, dv): (usize, usize, usize, usize),
        scale: f32,
        c: Coop,
        caps: &Caps,
        lanes_per_row: usize,
        extra_bytes: usize,
        units: Units,
    ) -> Option<Self> {
        const NS: usize = COOP_ATTN_SUBGROUPS;
        let t = c.tile as usize;
        let lanes = c.subgroup as usize;
        let bq = NS * t;
        let dp = d.div_ceil(t) * t;
        let dvp = dv.div_ceil(t) * t;
        let (ks, vs) = (dp + SMEM_PAD, dvp + SMEM_PAD);
        // f32 score rows pad by 4 elements, f16 rows by 8: 16 bytes each.
        let ss = |bk: usize| bk + SMEM_PAD / 2;
        let ps = |bk: usize| bk + SMEM_PAD;
        let bytes = |bk: usize| {
            bk.max(bq) * ks * 2
                + bk * vs * 2
                + NS * t * ss(bk) * 4
                + NS * t * ps(bk) * 2
                + extra_bytes
        };
        let bk = [64, 32, 16]
            .into_iter()
            .map(|b| c.extent(b))
            .filter(|&b| b >= t && b % lanes_per_row == 0)
            .find(|&b| bytes(b) <= caps.workgroup_memory as usize)?;
        let qblocks = sq.div_ceil(bq);
        let threads = NS * lanes;
        let whole = |u: Option<usize>, padded: usize| {
            u.is_some_and(|w| (bk * padded / w).is_multiple_of(threads))
        };
        let prefetch = caps.prefetch && whole(units[1], dp) && whole(units[2], dvp);
        Some(CoopAttention {
            t,
            bq,
            dp,
            dvp,
            bk,
            ks,
            vs,
            ss: ss(bk),
            ps: ps(bk),
            sq,
            skv,
            d,
            dv,
            scale,
            threads,
            qblocks,
            blocks: bh * qblocks,
            units,
            prefetch,
        })
    }

    /// `coop_mat` type of role A/B/C with scalar f16/f32.
    fn ty(&self, role: &str, scalar: &str) -> String {
        format!("coop_mat{0}x{0}<{scalar}, {role}>", self.t)
    }

    /// `acc += pa · V[kf-th key fragment, f-th value fragment]`, with V
    /// staged as f16 in `Vs` (rows `vs` apart).
    fn pv_line(&self, acc: &str, f: usize) -> String {
        let (t, vs) = (self.t, self.vs);
        format!(
            "            {acc} = coopMultiplyAdd(pa, coopLoadT<{}>(&Vs[kf * {}u + {}u], {vs}u), {acc});",
            self.ty("B", "f16"),
            t * vs,
            f * t
        )
    }

    /// The workgroup arrays (`extra_decls` after them) and the entry
    /// point up to the query fragments `qa0…` in registers.
    fn head(&self, extra_decls: &str) -> String {
        let (t, bk, dp, threads) = (self.t, self.bk, self.dp, self.threads);
        let (bq, sq, d) = (self.bq, self.sq, self.d);
        format!(
            "var<workgroup> KQ: array<f16, {kql}>;
var<workgroup> Vs: array<f16, {vl}>;
var<workgroup> Ss: array<f32, {sl}>;
var<workgroup> Ps: array<f16, {pl}>;
{extra_decls}@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32, @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {{
    let blk = wg.x + wg.y * 65535u;
    if (blk >= {blocks}u) {{ return; }}
    let bh = blk / {qblocks}u;
    let q0 = (blk % {qblocks}u) * {bq}u;
{stage_q}    workgroupBarrier();
{qload}    workgroupBarrier();
",
            kql = bk.max(bq) * self.ks,
            vl = bk * self.vs,
            sl = COOP_ATTN_SUBGROUPS * t * self.ss,
            pl = COOP_ATTN_SUBGROUPS * t * self.ps,
            blocks = self.blocks,
            qblocks = self.qblocks,
            stage_q = self.by_rows(
                "    ",
                bq,
                dp,
                &format!(
                    "        var v = 0.0;
        if (q0 + kr < {sq}u && t < {d}u) {{ v = rd0(q_off(bh, q0 + kr, t)) * {}; }}
        KQ[kr * {ks}u + t] = f16(v);
",
                    lit(self.scale),
                    ks = self.ks,
                )
            ),
            qload = coop_q_fragments(t, dp / t, self.ks),
        )
    }

    fn k_tile(&self) -> Tile {
        Tile {
            array: "KQ",
            input: 1,
            offset: "k_off",
            padded: self.dp,
            stride: self.ks,
            width: self.d,
        }
    }

    fn v_tile(&self) -> Tile {
        Tile {
            array: "Vs",
            input: 2,
            offset: "v_off",
            padded: self.dvp,
            stride: self.vs,
            width: self.dv,
        }
    }

    /// Copies `bk` rows (keys from `from`) of the tile's input into its
    /// array as f16 rows `padded` wide, `stride` apart (or, prefetching,
    /// into the thread's registers): in 16-byte units where the input
    /// allows ([`Units`]), neighbouring threads taking neighbouring units.
    fn stage(&self, tile: &Tile, from: &str, into: &Dest) -> String {
        let Tile {
            array,
            input: j,
            offset,
            padded,
            stride,
            width,
        } = *tile;
        if let Some(w) = self.units[j] {
            // Units per padded row (the head's width is whole units, so a
            // unit is wholly in the head or wholly padding).
            let per_row = padded / w;
            let slot = format!("kr * {stride}u + t");
            let load = format!(
                "            var v = {zero};
            if ({from} + kr < {skv}u && t < {width}u) {{ v = vld{j}({offset}(bh, {from} + kr, t) / {w}u); }}
",
                zero = unit_zero(w),
                skv = self.skv,
            );
            let body = match into {
                Dest::Tile => format!(
                    "{load}            {}\n",
                    unit_writes(array, &slot, "v", "f16", w, 1)
                ),
                Dest::Registers => format!("{load}            p{array}[se] = v;\n"),
                Dest::Commit => format!(
                    "            {}\n",
                    unit_writes(array, &slot, &format!("p{array}[se]"), "f16", w, 1)
                ),
            };
            return strided(
                "        ",
                "tid",
                self.bk * per_row,
                self.threads,
                &format!(
                    "            let kr = e / {per_row}u; let t = (e % {per_row}u) * {w}u;\n{body}"
                ),
            );
        }
        // Element by element only straight into the tile: prefetch needs
        // units (`CoopAttention::new`).
        debug_assert!(matches!(into, Dest::Tile));
        let input = format!("rd{j}");
        self.by_rows(
            "        ",
            self.bk,
            padded,
            &format!(
                "            var v = 0.0;
            if ({from} + kr < {skv}u && t < {width}u) {{ v = {input}({offset}(bh, {from} + kr, t)); }}
            {array}[kr * {stride}u + t] = f16(v);
",
                skv = self.skv,
            ),
        )
    }

    /// The loop over key blocks: each block of K (and of V where
    /// `with_v`) staged, then `body` (which starts after a barrier and
    /// ends before one). Prefetching, the first block is staged before
    /// the loop and each block's `body` runs while the thread's share of
    /// the next block loads into registers, written to the tiles once
    /// every subgroup is done with them: the same barrier count, with
    /// the loads' latency behind the block's products.
    fn key_loop(&self, with_v: bool, body: &str) -> String {
        let (skv, bk) = (self.skv, self.bk);
        let tiles = if with_v {
            vec![self.k_tile(), self.v_tile()]
        } else {
            vec![self.k_tile()]
        };
        let all = |from: &str, into: &Dest| -> String {
            tiles.iter().map(|t| self.stage(t, from, into)).collect()
        };
        if !self.prefetch {
            return format!(
                "    for (var j0 = 0u; j0 < {skv}u; j0 += {bk}u) {{
{stage}        workgroupBarrier();
{body}        workgroupBarrier();
    }}
",
                stage = all("j0", &Dest::Tile),
            );
        }
        let mut regs = String::new();
        for t in &tiles {
            let w = self.units[t.input].unwrap_or(1);
            let _ = writeln!(
                regs,
                "        var p{}: array<{}, {}>;",
                t.array,
                unit_zero(w).trim_end_matches("()"),
                self.bk * t.padded / w / self.threads
            );
        }
        format!(
            "    {{
{regs}        {{
            let j0 = 0u;
{first}        }}
        workgroupBarrier();
        for (var j0 = 0u; j0 < {skv}u; j0 += {bk}u) {{
            let jn = j0 + {bk}u;
{fetch}{body}            workgroupBarrier();
{commit}            workgroupBarrier();
        }}
    }}
",
            first = indent(&all("j0", &Dest::Tile), 4),
            fetch = indent(&all("jn", &Dest::Registers), 4),
            body = indent(body, 4),
            commit = indent(&all("jn", &Dest::Commit), 4),
        )
    }

    /// WGSL: `body` for every element (row `kr`, column `t`) of a tile of
    /// `rows` rows `padded` wide: subgroup `sg` takes rows sg, sg + 4, …
    /// and each lane a fixed set of columns, in loops of fixed trip count.
    /// A lane's columns never change, so the driver computes their
    /// addressing once and unrolls the rest; neighbouring lanes read
    /// neighbouring elements of a row.
    fn by_rows(&self, indent: &str, rows: usize, padded: usize, body: &str) -> String {
        const NS: usize = COOP_ATTN_SUBGROUPS;
        let lanes = self.threads / NS;
        let inner: String = body.lines().map(|l| format!("    {l}\n")).collect();
        let columns = strided_as(
            &format!("{indent}    "),
            "t",
            "sc",
            "lane",
            padded,
            lanes,
            &inner,
        );
        strided_as(indent, "kr", "sr", "sg", rows, NS, &columns)
    }

    /// Scores of the subgroup's rows against the staged key block.
    fn scores(&self) -> String {
        coop_scores(self.t, self.dp / self.t, self.ks, self.bk, self.ss)
    }

    /// The additive mask's term for score `s` of key `j0 + j`.
    fn mask(&self, masked: bool) -> String {
        if masked {
            format!(
                "s = s + rd3(qi * {}u + j0 + j) * {};",
                self.skv,
                lit(std::f32::consts::LOG2_E)
            )
        } else {
            String::new()
        }
    }

    fn groups(&self) -> [u32; 3] {
        [
            self.blocks.min(65535) as u32,
            self.blocks.div_ceil(65535) as u32,
            1,
        ]
    }
}

/// Attention on cooperative matrices in one pass (flash-attention's
/// online softmax): a workgroup of 4 subgroups takes 4·T queries of one
/// (batch, head), each subgroup T of them, with the head padded to a
/// multiple of T. Per block of keys: K and V are staged as f16, the
/// scores come from fragments (Q held in registers) into workgroup
/// memory, then every lane takes one query row and a share of the keys
/// (rows' maxima and sums combined across lanes by subgroup shuffles) and
/// writes the probabilities as f16, and P·V accumulates straight into the
/// output fragments.
///
/// Fragments cannot be scaled per row, so the output is rescaled lazily:
/// each row's probabilities are exp(s − m) against a reference maximum m
/// that only moves when a block's maximum exceeds it by more than
/// [`ATTN_RESCALE_MARGIN`] (probabilities stay ≤ e^8, well inside f16).
/// Only then (on the first block, and rarely after) do the workgroup's
/// output fragments take a round trip through workgroup memory to be
/// multiplied by exp(m_old − m_new) row by row; the decision is one
/// workgroup-uniform flag. None when the workgroup memory cannot hold the
/// smallest block.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_coop_single(
    bh: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    scale: f32,
    masked: bool,
    c: Coop,
    caps: &Caps,
    units: Units,
) -> Option<(String, [u32; 3])> {
    let t = c.tile as usize;
    let lanes = c.subgroup as usize;
    if lanes < t || !lanes.is_multiple_of(t) {
        return None;
    }
    // Lanes per query row, and output columns per lane per fragment.
    let lpr = lanes / t;
    if !t.is_multiple_of(lpr) {
        return None;
    }
    let cpl = t / lpr;
    let a = CoopAttention::new(bh, (sq, skv, d, dv), scale, c, caps, lpr, 4, units)?;
    let (bk, dvp) = (a.bk, a.dvp);
    let kpl = bk / lpr;
    let ofrags = dvp / t;
    // Output fragments per round trip: as many as the subgroup's score
    // rows hold.
    let per_trip = (bk / t).max(1);
    // Subgroup all-reduce over the lanes sharing a row (lane = part·T + row).
    let reduce = |v: &str, combine: &dyn Fn(&str, &str) -> String| -> String {
        let mut out = String::new();
        let mut mask = t;
        while mask < lanes {
            let other = format!("subgroupShuffleXor({v}, {mask}u)");
            let _ = write!(out, " {v} = {};", combine(v, &other));
            mask *= 2;
        }
        out
    };
    let tt = t * t;
    // Each subgroup's share of `Ss` and of `Ps`.
    let sub = t * a.ss;
    let psub = t * a.ps;
    let mut o_decl = String::new();
    let mut pv_mac = String::new();
    let mut rescale = String::new();
    let mut store = String::new();
    for f in 0..ofrags {
        let _ = writeln!(o_decl, "    var o{f} = {}();", a.ty("C", "f32"));
        let _ = writeln!(pv_mac, "{}", a.pv_line(&format!("o{f}"), f));
    }
    // Round trips of up to `per_trip` fragments through the subgroup's
    // score rows: store, scale the lane's share of its row, load back.
    for first in (0..ofrags).step_by(per_trip) {
        let trip: Vec<usize> = (first..(first + per_trip).min(ofrags)).collect();
        for (i, f) in trip.iter().enumerate() {
            let _ = writeln!(
                rescale,
                "            coopStoreT(o{f}, &Ss[sg * {sub}u + {}u], {t}u);",
                i * tt
            );
        }
        let _ = writeln!(rescale, "            workgroupBarrier();");
        for i in 0..trip.len() {
            let _ = writeln!(
                rescale,
                "            for (var e = 0u; e < {cpl}u; e++) {{ let at = sg * {sub}u + {}u + r * {t}u + part * {cpl}u + e; Ss[at] = Ss[at] * corr; }}",
                i * tt
            );
        }
        let _ = writeln!(rescale, "            workgroupBarrier();");
        for (i, f) in trip.iter().enumerate() {
            let _ = writeln!(
                rescale,
                "            o{f} = coopLoadT<{}>(&Ss[sg * {sub}u + {}u], {t}u);",
                a.ty("C", "f32"),
                i * tt
            );
        }
        let _ = writeln!(rescale, "            workgroupBarrier();");
    }
    // The epilogue: each fragment through workgroup memory, divided by the
    // row sums.
    for f in 0..ofrags {
        let _ = writeln!(
            store,
            "    coopStoreT(o{f}, &Ss[sg * {sub}u], {t}u);\n    workgroupBarrier();"
        );
        // A loop, not one line per column: the same code once unrolled
        // by a GPU's compiler, and a third of the source lavapipe
        // compiles lane by lane (its loops are kept, `software.rs`).
        let _ = writeln!(
            store,
            "    for (var i = 0u; i < {cpl}u; i++) {{ let col = {}u + part * {cpl}u + i; if (qrow < {sq}u && col < {dv}u) {{ let oi = (bh * {sq}u + qrow) * {dv}u + col; wr(oi, epi(Ss[sg * {sub}u + r * {t}u + part * {cpl}u + i] / l, oi)); }} }}",
            f * t,
        );
        let _ = writeln!(store, "    workgroupBarrier();");
    }
    // Each lane walks its keys from its own starting point, (jj + lane)
    // mod kpl: walked in step, the lanes' score rows (`ss` apart) would
    // meet in the same bank at every step, a 32-way conflict when rows
    // are 64 floats apart; staggered, with 16-byte padded rows, the 32
    // lanes of a 16×16 tile's rows touch 32 different banks.
    let block = format!(
        "{scores}        workgroupBarrier();
        var bm = -3.4028235e38;
        for (var jj = 0u; jj < {kpl}u; jj++) {{
            let jr = (jj + lane) % {kpl}u;
            let j = part * {kpl}u + jr;
            if (j0 + j < {skv}u) {{ var s = Ss[srow + jr]; {mask} Ss[srow + jr] = s; bm = max(bm, s); }}
        }}
       {red_max}
        if (bm > m + {margin}) {{ atomicOr(&rescale, 1u); }}
        let moved = workgroupUniformLoad(&rescale);
        if (tid == 0u) {{ atomicStore(&rescale, 0u); }}
        var corr = 1.0;
        if (moved != 0u) {{
            let mn = max(m, bm);
            corr = exp2(m - mn);
            m = mn;
        }}
        var ps = 0.0;
        for (var jj = 0u; jj < {kpl}u; jj++) {{
            let jr = (jj + lane) % {kpl}u;
            let j = part * {kpl}u + jr;
            var p = 0.0;
            if (j0 + j < {skv}u) {{ p = exp2(Ss[srow + jr] - m); }}
            ps = ps + p;
            Ps[prow + jr] = f16(p);
        }}
       {red_sum}
        l = l * corr + ps;
        workgroupBarrier();
        if (moved != 0u) {{
{rescale}        }}
        for (var kf = 0u; kf < {kfs}u; kf++) {{
            let pa = coopLoadT<{pty}>(&Ps[sg * {psub}u + kf * {t}u], {ps}u);
{pv_mac}        }}
",
        scores = a.scores(),
        mask = a.mask(masked),
        kfs = bk / t,
        pty = a.ty("A", "f16"),
        margin = lit(ATTN_RESCALE_MARGIN * std::f32::consts::LOG2_E),
        ps = a.ps,
        red_max = reduce("bm", &|a, b| format!("max({a}, {b})")),
        red_sum = reduce("ps", &|a, b| format!("{a} + {b}")),
    );
    let code = format!(
        "{head}    let r = lane % {t}u;
    let part = lane / {t}u;
    let qrow = q0 + sg * {t}u + r;
    let qi = min(qrow, {sqm}u);
    let srow = sg * {sub}u + r * {ss}u + part * {kpl}u;
    let prow = sg * {psub}u + r * {ps}u + part * {kpl}u;
{o_decl}    var m = -3.4028235e38;
    var l = 0.0;
{keys}{store}}}
",
        head = a.head("var<workgroup> rescale: atomic<u32>;\n"),
        keys = a.key_loop(true, &block),
        sqm = sq.saturating_sub(1),
        ss = a.ss,
        ps = a.ps,
    );
    Some((code, a.groups()))
}

/// How far (natural log) a row's block maximum may exceed its reference
/// maximum before the output is rescaled: probabilities stay ≤ e^8 ≈
/// 2981, exact enough in f16 (max 65504) and summed in f32. The kernels
/// score in base 2, so they compare against this times log2(e).
pub(super) const ATTN_RESCALE_MARGIN: f32 = 8.0;

/// Attention on cooperative matrices: a workgroup of 4 subgroups takes
/// 4·T queries of one (batch, head), each subgroup T of them, with the
/// head padded to a multiple of T. Scores for a block of keys come from
/// f16 fragments (Q held in registers, K staged in workgroup memory); the
/// subgroup's first T lanes own one query row each for the softmax. Two
/// passes over the keys: the first finds each row's maximum, the second
/// accumulates exp(s − max)·V into f32 fragments and the row sums, so no
/// accumulator ever needs rescaling (which fragments cannot do per row).
/// None when the workgroup memory cannot hold the smallest block.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_coop(
    bh: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    scale: f32,
    masked: bool,
    c: Coop,
    caps: &Caps,
    units: Units,
) -> Option<(String, [u32; 3])> {
    let t = c.tile as usize;
    let lanes = c.subgroup as usize;
    if lanes < t {
        return None;
    }
    // The row sums, for the epilogue.
    let ll = COOP_ATTN_SUBGROUPS * t;
    let a = CoopAttention::new(bh, (sq, skv, d, dv), scale, c, caps, 1, ll * 4, units)?;
    let (bk, dvp) = (a.bk, a.dvp);
    let ofrags = dvp / t;
    let mut odecl = String::new();
    let mut pv = String::new();
    let mut out = String::new();
    for f in 0..ofrags {
        let _ = writeln!(odecl, "    var o{f} = {}();", a.ty("C", "f32"));
        let _ = writeln!(pv, "{}", a.pv_line(&format!("o{f}"), f));
        let _ = write!(
            out,
            "    coopStoreT(o{f}, &Ss[sg * {sub}u], {t}u);
    workgroupBarrier();
{copy}    workgroupBarrier();
",
            copy = strided(
                "    ",
                "lane",
                t * t,
                lanes,
                &format!(
                    "        let r = e / {t}u; let col = {c0}u + e % {t}u;
        let qrow = q0 + sg * {t}u + r;
        if (qrow < {sq}u && col < {dv}u) {{
            let oi = (bh * {sq}u + qrow) * {dv}u + col;
            wr(oi, epi(Ss[sg * {sub}u + e] / Ls[sg * {t}u + r], oi));
        }}
",
                    sub = t * a.ss,
                    c0 = f * t,
                )
            ),
            sub = t * a.ss,
        );
    }
    // Lanes stagger their keys as in the single-pass form. The first
    // pass over the keys finds the rows' maxima, the second accumulates.
    let maxima = format!(
        "{scores}        workgroupBarrier();
        if (lane < {t}u) {{
            for (var jj = 0u; jj < {bk}u; jj++) {{
                let j = (jj + lane) % {bk}u;
                if (j0 + j < {skv}u) {{ var s = Ss[srow + j]; {mask} m = max(m, s); }}
            }}
        }}
",
        scores = a.scores(),
        mask = a.mask(masked),
    );
    let sums = format!(
        "{scores}        workgroupBarrier();
        if (lane < {t}u) {{
            for (var jj = 0u; jj < {bk}u; jj++) {{
                let j = (jj + lane) % {bk}u;
                var p = 0.0;
                if (j0 + j < {skv}u) {{ var s = Ss[srow + j]; {mask} p = exp2(s - m); }}
                l = l + p;
                Ps[prow + j] = f16(p);
            }}
        }}
        workgroupBarrier();
        for (var kf = 0u; kf < {kfs}u; kf++) {{
            let pa = coopLoadT<{pty}>(&Ps[sg * {tps}u + kf * {t}u], {ps}u);
{pv}        }}
",
        scores = a.scores(),
        mask = a.mask(masked),
        tps = t * a.ps,
        ps = a.ps,
        kfs = bk / t,
        pty = a.ty("A", "f16"),
    );
    let code = format!(
        "{head}    let srow = sg * {tss}u + min(lane, {tm}u) * {ss}u;
    let prow = sg * {tps}u + min(lane, {tm}u) * {ps}u;
    let qi = min(q0 + sg * {t}u + min(lane, {tm}u), {sqm}u);
    var m = -3.4028235e38;
    var l = 0.0;
{first}{odecl}{second}    if (lane < {t}u) {{ Ls[sg * {t}u + lane] = l; }}
    workgroupBarrier();
{out}}}
",
        head = a.head(&format!("var<workgroup> Ls: array<f32, {ll}>;\n")),
        first = a.key_loop(false, &maxima),
        second = a.key_loop(true, &sums),
        tss = t * a.ss,
        tps = t * a.ps,
        ss = a.ss,
        ps = a.ps,
        tm = t - 1,
        sqm = sq.saturating_sub(1),
    );
    Some((code, a.groups()))
}
