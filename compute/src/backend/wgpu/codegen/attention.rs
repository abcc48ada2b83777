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
        // The single pass with the query tiles asked for, else with one
        // (two need twice the score rows: wide heads do not fit).
        let single =
            |caps: &Caps| attention_coop_single(bh, sq, skv, d, dv, scale, masked, c, caps, units);
        let single = if caps.two_pass_attention {
            None
        } else {
            single(caps).or_else(|| {
                let one = Caps {
                    attention_tiles: 1,
                    ..*caps
                };
                (caps.attention_tiles > 1).then(|| single(&one)).flatten()
            })
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

/// WGSL loading a subgroup's query fragments (its `tiles`·T rows of the
/// staged, scaled Q tile `KQ`, rows `ks` apart) into registers: `qa{i}`,
/// i = tile·`qfrags` + fragment.
pub(super) fn coop_q_fragments(t: usize, qfrags: usize, ks: usize, tiles: usize) -> String {
    let mut out = String::new();
    for r in 0..tiles {
        for f in 0..qfrags {
            let _ = writeln!(
                out,
                "    let qa{} = coopLoadT<coop_mat{t}x{t}<f16, A>>(&KQ[sg * {}u + {}u], {ks}u);",
                r * qfrags + f,
                tiles * t * ks,
                r * t * ks + f * t
            );
        }
    }
    out
}

/// WGSL scoring the subgroup's query fragments against a staged block of
/// `bk` keys (`KQ`, row-major by key, rows `ks` apart): f32 fragments
/// stored into the subgroup's `tiles`·T rows of `Ss` (rows `ss` apart).
pub(super) fn coop_scores(
    t: usize,
    qfrags: usize,
    ks: usize,
    bk: usize,
    ss: usize,
    tiles: usize,
) -> String {
    let mut out = String::new();
    for r in 0..tiles {
        for jf in 0..bk / t {
            let _ = writeln!(
                out,
                "        {{\n            var sacc = coop_mat{t}x{t}<f32, C>();"
            );
            for f in 0..qfrags {
                let _ = writeln!(
                    out,
                    "            sacc = coopMultiplyAdd(qa{}, coopLoad<coop_mat{t}x{t}<f16, B>>(&KQ[{}u], {ks}u), sacc);",
                    r * qfrags + f,
                    jf * t * ks + f * t
                );
            }
            let _ = writeln!(
                out,
                "            coopStoreT(sacc, &Ss[sg * {}u + {}u], {ss}u);\n        }}",
                tiles * t * ss,
                r * t * ss + jf * t
            );
        }
    }
    out
}

/// What both cooperative attention forms share: 4 subgroups of T query
/// rows (or T·tiles) per workgroup, the head padded to a multiple of T, key blocks of
/// `bk` staged as f16, and the prologue that stages the scaled queries and
/// loads them into fragments.
pub(super) struct CoopAttention {
    t: usize,
    /// Query tiles (T rows each) per subgroup: `rows` = tiles·T.
    tiles: usize,
    rows: usize,
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
    /// `lanes_per_row`) whose workgroup arrays, plus `extra_bytes`, fit,
    /// for subgroups of `tiles` query tiles; None when none does.
    #[allow(clippy::too_many_arguments)]
    fn new(
        bh: usize,
        (sq, skv, d, dv): (usize, usize, usize, usize),
        scale: f32,
        c: Coop,
        caps: &Caps,
        (tiles, lanes_per_row): (usize, usize),
        extra_bytes: usize,
        units: Units,
    ) -> Option<Self> {
        const NS: usize = COOP_ATTN_SUBGROUPS;
        let t = c.tile as usize;
        let lanes = c.subgroup as usize;
        let rows = tiles * t;
        let bq = NS * rows;
        let dp = d.div_ceil(t) * t;
        let dvp = dv.div_ceil(t) * t;
        let (ks, vs) = (dp + SMEM_PAD, dvp + SMEM_PAD);
        // f32 score rows pad by 4 elements, f16 rows by 8: 16 bytes each.
        let ss = |bk: usize| bk + SMEM_PAD / 2;
        let ps = |bk: usize| bk + SMEM_PAD;
        let bytes = |bk: usize| {
            bk.max(bq) * ks * 2
                + bk * vs * 2
                + NS * rows * ss(bk) * 4
                + NS * rows * ps(bk) * 2
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
            tiles,
            rows,
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
            sl = COOP_ATTN_SUBGROUPS * self.rows * self.ss,
            pl = COOP_ATTN_SUBGROUPS * self.rows * self.ps,
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
            qload = coop_q_fragments(t, dp / t, self.ks, self.tiles),
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
        coop_scores(
            self.t,
            self.dp / self.t,
            self.ks,
            self.bk,
            self.ss,
            self.tiles,
        )
    }

    /// The additive mask's term for score `s` of key `j0 + j`, for the
    /// query whose index `qi` names.
    fn mask(&self, masked: bool, qi: &str) -> String {
        if masked {
            format!(
                "s = s + rd3({qi} * {}u + j0 + j) * {};",
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
/// online softmax): a workgroup of 4 subgroups takes 4·T·tiles queries
/// of one (batch, head), each subgroup T·tiles of them
/// ([`Caps::attention_tiles`]), with the head padded to a multiple of T.
/// Per block of keys: K and V are staged as f16, the scores come from
/// fragments (Q held in registers) into workgroup memory, then every lane
/// takes a query row (or several, where the subgroup has more rows than
/// lanes) and a share of the keys (rows' maxima and sums combined across
/// lanes by subgroup shuffles) and writes the probabilities as f16, and
/// P·V accumulates straight into the output fragments, each V fragment
/// loaded once for all of the subgroup's tiles.
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
    let tiles = caps.attention_tiles.max(1);
    // The subgroup's query rows, lanes per row (sharing its keys) and
    // rows per lane (each lane's rows `lanes` apart).
    let rows = tiles * t;
    let (lpr, rpl) = if lanes >= rows {
        (lanes / rows, 1)
    } else {
        (1, rows / lanes)
    };
    // Every lane has its rows and every row its lanes: one count divides
    // the other.
    if lanes * rpl != rows * lpr {
        return None;
    }
    // Output columns per lane per fragment.
    if !t.is_multiple_of(lpr) {
        return None;
    }
    let cpl = t / lpr;
    let a = CoopAttention::new(bh, (sq, skv, d, dv), scale, c, caps, (tiles, lpr), 4, units)?;
    let (bk, dvp) = (a.bk, a.dvp);
    let kpl = bk / lpr;
    let ofrags = dvp / t;
    // Output fragment columns per round trip: as many as the subgroup's
    // score rows hold (each column is `tiles` fragments stacked).
    let per_trip = (bk / t).max(1);
    // Subgroup all-reduce over the lanes sharing a row (lane = part·rows
    // + row).
    let reduce = |v: &str, combine: &dyn Fn(&str, &str) -> String| -> String {
        let mut out = String::new();
        let mut mask = rows;
        while mask < lanes {
            let other = format!("subgroupShuffleXor({v}, {mask}u)");
            let _ = write!(out, " {v} = {};", combine(v, &other));
            mask *= 2;
        }
        out
    };
    // A lane's rows, unrolled here: names carry the row's number where a
    // lane has several (`m1`, `srow1`, …).
    let sfx = |p: usize| {
        if rpl == 1 {
            String::new()
        } else {
            p.to_string()
        }
    };
    let rowset: Vec<String> = (0..rpl).map(sfx).collect();
    let tt = t * t;
    // Each subgroup's share of `Ss` and of `Ps`, and one stacked column of
    // output fragments (`rows` × T).
    let sub = rows * a.ss;
    let psub = rows * a.ps;
    let stack = rows * t;
    // The output fragment of query tile r, column f.
    let o = |r: usize, f: usize| {
        if tiles == 1 {
            format!("o{f}")
        } else {
            format!("o{}", r * ofrags + f)
        }
    };
    let mut o_decl = String::new();
    let mut pv_mac = String::new();
    let mut rescale = String::new();
    let mut store = String::new();
    for r in 0..tiles {
        for f in 0..ofrags {
            let _ = writeln!(o_decl, "    var {} = {}();", o(r, f), a.ty("C", "f32"));
        }
    }
    if tiles == 1 {
        for f in 0..ofrags {
            let _ = writeln!(pv_mac, "{}", a.pv_line(&o(0, f), f));
        }
    } else {
        // Each V fragment loaded once for every query tile.
        for f in 0..ofrags {
            let _ = writeln!(
                pv_mac,
                "            let vb{f} = coopLoadT<{}>(&Vs[kf * {}u + {}u], {}u);",
                a.ty("B", "f16"),
                t * a.vs,
                f * t,
                a.vs
            );
            for r in 0..tiles {
                let _ = writeln!(
                    pv_mac,
                    "            {acc} = coopMultiplyAdd(pa{r}, vb{f}, {acc});",
                    acc = o(r, f)
                );
            }
        }
    }
    // `tiles` fragments of column f stored stacked at `base`: row r·T + i
    // of the stack is row i of tile r's fragment.
    let store_column = |out: &mut String, f: usize, base: Option<usize>| {
        for r in 0..tiles {
            let at = match base {
                Some(b) => format!(" + {}u", b + r * tt),
                None if r == 0 => String::new(),
                None => format!(" + {}u", r * tt),
            };
            let _ = writeln!(
                out,
                "            coopStoreT({}, &Ss[sg * {sub}u{at}], {t}u);",
                o(r, f),
            );
        }
    };
    // Round trips of up to `per_trip` fragment columns through the
    // subgroup's score rows: store, scale the lane's share of its rows,
    // load back.
    for first in (0..ofrags).step_by(per_trip) {
        let trip: Vec<usize> = (first..(first + per_trip).min(ofrags)).collect();
        for (i, f) in trip.iter().enumerate() {
            store_column(&mut rescale, *f, Some(i * stack));
        }
        let _ = writeln!(rescale, "            workgroupBarrier();");
        for i in 0..trip.len() {
            for s in &rowset {
                let _ = writeln!(
                    rescale,
                    "            for (var e = 0u; e < {cpl}u; e++) {{ let at = sg * {sub}u + {}u + r{s} * {t}u + part * {cpl}u + e; Ss[at] = Ss[at] * corr{s}; }}",
                    i * stack
                );
            }
        }
        let _ = writeln!(rescale, "            workgroupBarrier();");
        for (i, f) in trip.iter().enumerate() {
            for r in 0..tiles {
                let _ = writeln!(
                    rescale,
                    "            {} = coopLoadT<{}>(&Ss[sg * {sub}u + {}u], {t}u);",
                    o(r, *f),
                    a.ty("C", "f32"),
                    i * stack + r * tt
                );
            }
        }
        let _ = writeln!(rescale, "            workgroupBarrier();");
    }
    // The epilogue: each fragment column through workgroup memory, divided
    // by the row sums.
    for f in 0..ofrags {
        let mut column = String::new();
        store_column(&mut column, f, None);
        // The stores at the epilogue's indent.
        for line in column.lines() {
            let _ = writeln!(store, "{}", &line[8..]);
        }
        let _ = writeln!(store, "    workgroupBarrier();");
        // A loop, not one line per column: the same code once unrolled
        // by a GPU's compiler, and a third of the source lavapipe
        // compiles lane by lane (its loops are kept, `software.rs`).
        for s in &rowset {
            let _ = writeln!(
                store,
                "    for (var i = 0u; i < {cpl}u; i++) {{ let col = {}u + part * {cpl}u + i; if (qrow{s} < {sq}u && col < {dv}u) {{ let oi = (bh * {sq}u + qrow{s}) * {dv}u + col; wr(oi, epi(Ss[sg * {sub}u + r{s} * {t}u + part * {cpl}u + i] / l{s}, oi)); }} }}",
                f * t,
            );
        }
        let _ = writeln!(store, "    workgroupBarrier();");
    }
    // Each lane walks its keys from its own starting point, (jj + lane)
    // mod kpl: walked in step, the lanes' score rows (`ss` apart) would
    // meet in the same bank at every step, a 32-way conflict when rows
    // are 64 floats apart; staggered, with 16-byte padded rows, the 32
    // lanes of a 16×16 tile's rows touch 32 different banks.
    let mut maxima = String::new();
    let mut flags = String::new();
    let mut moves = String::new();
    let mut probs = String::new();
    for s in &rowset {
        let _ = write!(
            maxima,
            "        var bm{s} = -3.4028235e38;
        for (var jj = 0u; jj < {kpl}u; jj++) {{
            let jr = (jj + lane) % {kpl}u;
            let j = part * {kpl}u + jr;
            if (j0 + j < {skv}u) {{ var s = Ss[srow{s} + jr]; {mask} Ss[srow{s} + jr] = s; bm{s} = max(bm{s}, s); }}
        }}
       {red_max}
",
            mask = a.mask(masked, &format!("qi{s}")),
            red_max = reduce(&format!("bm{s}"), &|a, b| format!("max({a}, {b})")),
        );
        let _ = writeln!(
            flags,
            "        if (bm{s} > m{s} + {margin}) {{ atomicOr(&rescale, 1u); }}",
            margin = lit(ATTN_RESCALE_MARGIN * std::f32::consts::LOG2_E),
        );
        let _ = write!(
            moves,
            "        var corr{s} = 1.0;
        if (moved != 0u) {{
            let mn = max(m{s}, bm{s});
            corr{s} = exp2(m{s} - mn);
            m{s} = mn;
        }}
"
        );
        let _ = write!(
            probs,
            "        var ps{s} = 0.0;
        for (var jj = 0u; jj < {kpl}u; jj++) {{
            let jr = (jj + lane) % {kpl}u;
            let j = part * {kpl}u + jr;
            var p = 0.0;
            if (j0 + j < {skv}u) {{ p = exp2(Ss[srow{s} + jr] - m{s}); }}
            ps{s} = ps{s} + p;
            Ps[prow{s} + jr] = f16(p);
        }}
       {red_sum}
        l{s} = l{s} * corr{s} + ps{s};
",
            red_sum = reduce(&format!("ps{s}"), &|a, b| format!("{a} + {b}")),
        );
    }
    // The probabilities of each query tile as an A fragment.
    let mut pa = String::new();
    for r in 0..tiles {
        let (name, at) = if tiles == 1 {
            ("pa".to_string(), String::new())
        } else {
            (format!("pa{r}"), format!("{}u + ", r * t * a.ps))
        };
        let _ = writeln!(
            pa,
            "            let {name} = coopLoadT<{}>(&Ps[sg * {psub}u + {at}kf * {t}u], {}u);",
            a.ty("A", "f16"),
            a.ps
        );
    }
    let block = format!(
        "{scores}        workgroupBarrier();
{maxima}{flags}        let moved = workgroupUniformLoad(&rescale);
        if (tid == 0u) {{ atomicStore(&rescale, 0u); }}
{moves}{probs}        workgroupBarrier();
        if (moved != 0u) {{
{rescale}        }}
        for (var kf = 0u; kf < {kfs}u; kf++) {{
{pa}{pv_mac}        }}
",
        scores = a.scores(),
        kfs = bk / t,
    );
    let mut rows_decl = String::new();
    for (p, s) in rowset.iter().enumerate() {
        let at = if rpl == 1 {
            String::new()
        } else {
            format!(" + {}u", p * lanes)
        };
        let part = if p == 0 {
            format!("    let part = lane / {rows}u;\n")
        } else {
            String::new()
        };
        let _ = write!(
            rows_decl,
            "    let r{s} = lane % {rows}u{at};
{part}    let qrow{s} = q0 + sg * {rows}u + r{s};
    let qi{s} = min(qrow{s}, {sqm}u);
    let srow{s} = sg * {sub}u + r{s} * {ss}u + part * {kpl}u;
    let prow{s} = sg * {psub}u + r{s} * {ps}u + part * {kpl}u;
",
            sqm = sq.saturating_sub(1),
            ss = a.ss,
            ps = a.ps,
        );
    }
    let mut state = o_decl;
    for s in &rowset {
        let _ = write!(
            state,
            "    var m{s} = -3.4028235e38;\n    var l{s} = 0.0;\n"
        );
    }
    let code = format!(
        "{head}{rows_decl}{state}{keys}{store}}}
",
        head = a.head("var<workgroup> rescale: atomic<u32>;\n"),
        keys = a.key_loop(true, &block),
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
    let a = CoopAttention::new(bh, (sq, skv, d, dv), scale, c, caps, (1, 1), ll * 4, units)?;
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
        mask = a.mask(masked, "qi"),
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
        mask = a.mask(masked, "qi"),
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
