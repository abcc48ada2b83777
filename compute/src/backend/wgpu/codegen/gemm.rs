//! The matrix products: the portable register-tiled GEMM and the
//! cooperative-matrix (tensor-core) GEMM with its tilings, staging,
//! direct fragment loads, prefetch and split-K, over the `load_a` /
//! `load_b` / `store` functions each kernel kind supplies.

use super::units::{unit_writes, unit_zero, Vector};
use super::*;

/// The portable kernel's tile edge for a dimension of `len`: 64, or 32
/// or 16 for smaller ones, so a small product (the UNet's deepest levels,
/// a few tokens) does not compute a 64-wide tile of which a quarter is
/// kept: every lane of a workgroup runs its whole loop whatever part of
/// the tile is in bounds.
fn portable_tile(len: usize) -> usize {
    match len {
        0..=16 => 16,
        17..=32 => 32,
        _ => 64,
    }
}

/// A register-tiled GEMM: `tm`×`tn` output tiles ([`portable_tile`]),
/// (`tn`/4)×(`tm`/4) threads with 4x4 outputs each, K-steps of 16 through
/// workgroup memory, over `load_a(z, row, k)`, `load_b(z, k0, kr, col)`
/// (depth k0 + kr, k0 the step's start) and `store(z, row, col, v)`,
/// which precede it in the shader. Workgroup (x, y, z) = (col tile, row
/// tile, batch).
pub(super) fn gemm(m: usize, n: usize, k: usize, units: [Option<Vector>; 2]) -> String {
    let (tm, tn) = (portable_tile(m), portable_tile(n));
    let (tx, ty) = (tn / 4, tm / 4);
    let threads = tx * ty;
    // Each thread stages 16·tm/threads elements of A and 16·tn/threads
    // of B per depth step (whole numbers: tm, tn ≥ 16).
    let (qa, qb) = (16 * tm / threads, 16 * tn / threads);
    // Operands of whole 16-byte units are staged a unit at a time: the
    // tile (16 × `cols`, rows `cols` apart in `array`) in units along the
    // operand's contiguous axis (along the tile's columns or its rows),
    // the unit at tile position (r, c) being operand element (`row`,
    // `col`).
    let by_units = |v: Vector,
                    array: &str,
                    cols: usize,
                    along_cols: bool,
                    (row, col): (&str, &str),
                    tests: &str| {
        let w = v.width;
        // Units per tile row (along the columns) or per tile column (16
        // deep, along the rows); a unit's elements are `step` apart.
        let per = if along_cols { cols / w } else { 16 / w };
        let (index, first) = (format!("u / {per}u"), format!("(u % {per}u) * {w}u"));
        let (r, c, step) = if along_cols {
            (index, first, 1)
        } else {
            (first, index, cols)
        };
        strided_as(
            "        ",
            "u",
            "su",
            "tid",
            16 * cols / w,
            threads,
            &format!(
                "            let r = {}; let c = {};
            var v = {zero};
            if ({tests}) {{ {load} }}
            {write}
",
                r,
                c,
                zero = unit_zero(w),
                load = v.load(row, col),
                write = unit_writes(array, &format!("r * {cols}u + c"), "v", "", w, step),
            ),
        )
    };
    // A's tile is stored depth-major (element (row, depth) at depth·tm +
    // row), B's row-major (depth·tn + column).
    let stage_a = match units[0] {
        Some(v) => by_units(
            v,
            "As",
            tm,
            !v.along_cols(),
            ("row0 + c", "k0 + r"),
            &format!("row0 + c < {m}u && k0 + r < {k}u"),
        ),
        None => format!(
            "        for (var q = 0u; q < {qa}u; q++) {{
            let e = tid + q * {threads}u;
            let ka = e % 16u; let ma = e / 16u;
            var va = 0.0;
            if (row0 + ma < {m}u && k0 + ka < {k}u) {{ va = load_a(z, row0 + ma, k0 + ka); }}
            As[ka * {tm}u + ma] = va;
        }}
"
        ),
    };
    let stage_b = match units[1] {
        Some(v) => by_units(
            v,
            "Bs",
            tn,
            v.along_cols(),
            ("k0 + r", "col0 + c"),
            &format!("k0 + r < {k}u && col0 + c < {n}u"),
        ),
        None => format!(
            "        for (var q = 0u; q < {qb}u; q++) {{
            let e = tid + q * {threads}u;
            let nb = e % {tn}u; let kb = e / {tn}u;
            var vb = 0.0;
            if (col0 + nb < {n}u && k0 + kb < {k}u) {{ vb = load_b(z, k0, kb, col0 + nb); }}
            Bs[kb * {tn}u + nb] = vb;
        }}
"
        ),
    };
    format!(
        "var<workgroup> As: array<f32, {sa}>;
var<workgroup> Bs: array<f32, {sb}>;
@compute @workgroup_size({tx}, {ty}, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {{
    let z = wg.z;
    let row0 = wg.y * {tm}u;
    let col0 = wg.x * {tn}u;
    let tid = lid.y * {tx}u + lid.x;
    var acc0 = vec4<f32>(); var acc1 = vec4<f32>(); var acc2 = vec4<f32>(); var acc3 = vec4<f32>();
    for (var k0 = 0u; k0 < {k}u; k0 = k0 + 16u) {{
{stage_a}{stage_b}        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {{
            let ai = kk * {tm}u + lid.y * 4u;
            let bi = kk * {tn}u + lid.x * 4u;
            let b = vec4<f32>(Bs[bi], Bs[bi + 1u], Bs[bi + 2u], Bs[bi + 3u]);
            acc0 = acc0 + As[ai] * b;
            acc1 = acc1 + As[ai + 1u] * b;
            acc2 = acc2 + As[ai + 2u] * b;
            acc3 = acc3 + As[ai + 3u] * b;
        }}
        workgroupBarrier();
    }}
    // Rows picked by `select`, not by indexing an array: the tile stays
    // in registers however the loops are compiled (unrolled on GPUs;
    // kept as loops on software adapters, where one copy of the
    // epilogue instead of sixteen took lavapipe's compile of a 3x3 conv
    // from ~270 to ~150 ms).
    for (var i = 0u; i < 4u; i++) {{
        let acc = select(select(select(acc0, acc1, i == 1u), acc2, i == 2u), acc3, i == 3u);
        for (var j = 0u; j < 4u; j++) {{
            let r = row0 + lid.y * 4u + i;
            let c = col0 + lid.x * 4u + j;
            if (r < {m}u && c < {n}u) {{ store(z, r, c, acc[j]); }}
        }}
    }}
}}
",
        sa = 16 * tm,
        sb = 16 * tn,
    )
}

/// One (batched) matrix product as the kernels see it: `m`×`k` by
/// `k`×`n`, `batch` times, through `load_a`/`load_b`/`store`.
pub(super) struct Gemm {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) batch: usize,
    /// Consecutive depth indices of A are adjacent in memory (else
    /// consecutive rows are): decides which index neighbouring threads
    /// walk when staging a tile, so their reads coalesce.
    pub(super) a_k_contiguous: bool,
    /// Consecutive columns of B are adjacent in memory (else consecutive
    /// depth indices are).
    pub(super) b_n_contiguous: bool,
    /// A's rows read straight from its f16 binding, where possible.
    pub(super) direct_a: Option<Direct>,
    /// B's columns read straight from its f16 binding, where possible.
    pub(super) direct_b: Option<Direct>,
    /// A staged in 16-byte units, where its layout allows.
    pub(super) vector_a: Option<Vector>,
    /// B staged in 16-byte units, where its layout allows.
    pub(super) vector_b: Option<Vector>,
    /// The output is a plain dense f32 binding with no epilogue: whole
    /// blocks may store their fragments into it directly.
    pub(super) store_fragments: bool,
}

/// An operand stored as f16 in one binding with its depth index
/// contiguous: cooperative loads can read its fragments from the buffer,
/// skipping the workgroup-memory staging.
#[derive(Clone, Copy, Debug)]
pub(super) struct Direct {
    /// The input whose binding (its only range) holds it.
    pub(super) input: usize,
    /// Element offset of row/column 0, depth 0, in batch 0.
    pub(super) offset: usize,
    /// Elements between consecutive batch entries.
    pub(super) z_stride: usize,
    /// Elements between consecutive rows (A) or columns (B).
    pub(super) stride: usize,
}

impl Direct {
    /// For operand `j` bound as `op`, with element offset `offset +
    /// z·z_stride` of its first row/column, when its depth stride is 1 and
    /// every fragment starts 16-byte aligned (cooperative loads from
    /// buffers may require it; fragments start at multiples of 8 along the
    /// depth).
    pub(super) fn of(
        j: usize,
        op: &Operand,
        depth_stride: usize,
        (offset, z_stride): (usize, usize),
        stride: usize,
    ) -> Option<Self> {
        let aligned = offset % 8 == 0 && z_stride % 8 == 0 && stride.is_multiple_of(8);
        (op.f16 && op.chunks == 1 && depth_stride == 1 && aligned).then_some(Direct {
            input: j,
            offset,
            z_stride,
            stride,
        })
    }
}

/// f16 elements (16 bytes) added to each row of a tile staged in
/// workgroup memory for cooperative loads. Unpadded, a tile's rows are
/// 64–256 bytes apart, so the rows of one fragment start in the same few
/// of the 32 four-byte banks and a fragment load serialises 4–8 ways; 16
/// more bytes per row spread 8 consecutive rows over all 32 banks. 16
/// bytes keep every row start as aligned as cooperative loads want.
/// `sdkit devices --probe` times fragment loads at both strides.
pub(super) const SMEM_PAD: usize = 8;

/// Workgroups a split-K product aims for: about two per SM of a large GPU.
pub(super) const SPLIT_TARGET: usize = 256;
/// Depth steps each split keeps at least, so the partial sums' extra
/// traffic stays small beside the product.
pub(super) const SPLIT_MIN_STEPS: usize = 8;
/// Partial-sum elements a split may write (64 MiB of f32).
pub(super) const SPLIT_MAX_SCRATCH: usize = 16 << 20;

/// How a cooperative-matrix GEMM workgroup divides its tile:
/// `sg_rows`×`sg_cols` subgroups, each owning `rows`×`cols` outputs
/// (multiples of the fragment size), over depth steps of `bk`; `direct`
/// lets f16 operands skip staging ([`Direct`]). Chosen by size unless
/// [`Caps::gemm_tiles`] fixes it (for tuning).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CoopTiles {
    pub sg_rows: usize,
    pub sg_cols: usize,
    pub rows: usize,
    pub cols: usize,
    pub bk: usize,
    pub direct: bool,
}

/// The cooperative GEMM tilings worth comparing on a new adapter
/// (`SDKIT_BENCH_TILINGS=1 cargo bench --bench wgpu_ops`); the default
/// choice, `Gemm::tiles_for`, picks among them.
pub fn tilings() -> Vec<CoopTiles> {
    let t = |sg_rows, sg_cols, rows, cols, bk, direct| CoopTiles {
        sg_rows,
        sg_cols,
        rows,
        cols,
        bk,
        direct,
    };
    vec![
        t(2, 4, 64, 32, 32, true),
        t(2, 2, 32, 32, 32, true),
        t(2, 4, 64, 32, 32, false),
        t(2, 4, 64, 32, 64, true),
        t(2, 2, 64, 64, 32, true),
        t(2, 2, 64, 64, 64, true),
        t(4, 2, 32, 64, 32, true),
        t(4, 2, 32, 32, 32, true),
        t(2, 4, 32, 32, 32, true),
        t(4, 4, 32, 32, 32, true),
        t(4, 4, 32, 16, 32, true),
    ]
}

impl Gemm {
    /// The shader body and launch grid: cooperative matrices where the
    /// adapter has them, else the portable register-tiled kernel; with a
    /// split-K product's second pass.
    #[allow(clippy::type_complexity)]
    pub(super) fn emit(
        &self,
        caps: &Caps,
        load_a: &str,
        load_b: &str,
        store: &str,
    ) -> (String, [u32; 3], Option<(String, [u32; 3], usize)>) {
        let funcs = format!("{load_a}\n{load_b}\n{store}\n");
        let Some(desc) = self.describe(caps) else {
            return (
                funcs + &gemm(self.m, self.n, self.k, self.staged_units(caps)),
                [
                    self.n.div_ceil(portable_tile(self.n)) as u32,
                    self.m.div_ceil(portable_tile(self.m)) as u32,
                    self.batch as u32,
                ],
                None,
            );
        };
        let code = funcs.clone() + &desc.wgsl();
        let finish = desc.split.map(|(splits, _)| {
            let total = self.batch * self.m * self.n;
            let body = format!(
                "{funcs}@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{
    {LINEAR_ID}
    if (gi >= {total}u) {{ return; }}
    var v = 0.0;
    for (var p = 0u; p < {splits}u; p++) {{ v = v + part_ld(p * {total}u + gi); }}
    let rc = gi % {mn}u;
    store(gi / {mn}u, rc / {n}u, rc % {n}u, v);
}}
",
                mn = self.m * self.n,
                n = self.n,
            );
            (body, grid(total), splits * total)
        });
        (code, desc.grid(), finish)
    }

    /// The operands staged in 16-byte units (when staged): views of
    /// whole units whose extent along the unit is whole units (a unit
    /// starting in range is then wholly in range).
    fn staged_units(&self, caps: &Caps) -> [Option<Vector>; 2] {
        let whole = |v: Option<Vector>, [rows, cols]: [usize; 2]| {
            v.filter(|v| {
                caps.vector_staging
                    && if v.along_cols() { cols } else { rows }.is_multiple_of(v.width)
            })
        };
        [
            whole(self.vector_a, [self.m, self.k]),
            whole(self.vector_b, [self.k, self.n]),
        ]
    }

    /// The cooperative kernel for this product as data (None without
    /// cooperative matrices): the tiling (chosen by size, or fixed by
    /// `caps`), how each operand reaches the fragments, split-K and
    /// prefetch.
    pub(super) fn describe(&self, caps: &Caps) -> Option<CoopGemm> {
        let c = caps.coop?;
        let t = c.tile as usize;
        let tiles = self.coop_tiles(c, caps);
        let (bm, bn, bk) = (
            tiles.sg_rows * tiles.rows,
            tiles.sg_cols * tiles.cols,
            tiles.bk,
        );
        let threads = tiles.sg_rows * tiles.sg_cols * c.subgroup as usize;
        let gx = self.n.div_ceil(bn);
        let gy = self.m.div_ceil(bm);
        let split = if caps.split_k {
            self.split(gx * gy * self.batch, bk)
        } else {
            None
        };
        // Direct reads need whole fragments along the depth and along the
        // rows/columns: a fragment past the end is then wholly outside the
        // output, so clamping it inside the operand only reads values that
        // are never stored.
        let usable = |d: Option<Direct>, dim: usize| {
            d.filter(|_| tiles.direct && self.k.is_multiple_of(t) && dim.is_multiple_of(t))
        };
        let [unit_a, unit_b] = self.staged_units(caps);
        // Staged tiles' rows are padded (see [`SMEM_PAD`]); neighbouring
        // threads walk the operand's contiguous axis.
        let a = match usable(self.direct_a, self.m) {
            Some(d) => Feed::Direct(d),
            None => Feed::Staged(Staging {
                rows: bm,
                cols: bk,
                stride: bk + SMEM_PAD,
                along_cols: self.a_k_contiguous,
                vector: unit_a,
            }),
        };
        let b = match usable(self.direct_b, self.n) {
            Some(d) => Feed::Direct(d),
            None => Feed::Staged(Staging {
                rows: bk,
                cols: bn,
                stride: bn + SMEM_PAD,
                along_cols: self.b_n_contiguous,
                vector: unit_b,
            }),
        };
        // Register prefetch needs whole units (elements or 16-byte
        // vectors) per thread.
        let staged = [&a, &b].into_iter().filter_map(|f| match f {
            Feed::Staged(s) => Some(s.rows * s.cols / s.vector.map_or(1, |v| v.width)),
            Feed::Direct(_) => None,
        });
        let prefetch = caps.prefetch
            && staged.clone().count() > 0
            && staged.clone().all(|len| len.is_multiple_of(threads));
        // Two stages where asked, without prefetch, and where they fit
        // beside the epilogue's scratch fragments.
        let stage_bytes: usize = [&a, &b]
            .into_iter()
            .map(|f| match f {
                Feed::Staged(s) => s.rows * s.stride * 2,
                Feed::Direct(_) => 0,
            })
            .sum();
        let scratch = tiles.sg_rows * tiles.sg_cols * t * t * 4;
        let stages = if caps.double_buffer
            && !prefetch
            && stage_bytes > 0
            && 2 * stage_bytes + scratch <= caps.workgroup_memory as usize
        {
            2
        } else {
            1
        };
        // Grouped workgroup order where the grid is tall and wide enough
        // for it to matter.
        let raster = (caps.raster && gy > RASTER_ROWS && gx > 1).then_some(RASTER_ROWS);
        // Fragments stored straight to the output: whole blocks only (no
        // bounds to test), not split (partial sums go to the scratch).
        let store_direct = self.store_fragments
            && split.is_none()
            && self.m.is_multiple_of(bm)
            && self.n.is_multiple_of(bn);
        Some(CoopGemm {
            shape: [self.m, self.n, self.k, self.batch],
            frag: t,
            lanes: c.subgroup as usize,
            tiles,
            a,
            b,
            split,
            prefetch,
            stages,
            raster,
            store_direct,
        })
    }

    /// The cooperative tiling `emit` uses, in this configuration's
    /// elements.
    pub(super) fn coop_tiles(&self, c: Coop, caps: &Caps) -> CoopTiles {
        let tiles = caps.gemm_tiles.unwrap_or_else(|| self.tiles_for(c));
        CoopTiles {
            rows: c.extent(tiles.rows),
            cols: c.extent(tiles.cols),
            bk: c.extent(tiles.bk),
            ..tiles
        }
    }

    /// The depth step of the cooperative kernel; None on the portable one.
    pub(super) fn coop_depth_step(&self, caps: &Caps) -> Option<usize> {
        caps.coop.map(|c| self.coop_tiles(c, caps).bk)
    }

    /// Split-K for a grid of `workgroups` over depth steps of `bk`: None
    /// when the grid already fills a large GPU (an H200 has 132 SMs), else
    /// (splits, depth per split) so that about [`SPLIT_TARGET`] workgroups
    /// run, each split keeping at least [`SPLIT_MIN_STEPS`] steps and the
    /// partial sums within [`SPLIT_MAX_SCRATCH`] elements.
    pub(super) fn split(&self, workgroups: usize, bk: usize) -> Option<(usize, usize)> {
        if workgroups >= SPLIT_TARGET / 2 {
            return None;
        }
        let steps = self.k.div_ceil(bk);
        let outputs = self.batch * self.m * self.n;
        let want = SPLIT_TARGET
            .div_ceil(workgroups)
            .min(steps / SPLIT_MIN_STEPS)
            .min(SPLIT_MAX_SCRATCH / outputs.max(1));
        if want < 2 {
            return None;
        }
        let per = steps.div_ceil(want);
        Some((steps.div_ceil(per), per * bk))
    }

    /// The tiling by operand kind and size, from the tiling table measured
    /// on an H200 (benches/gpu/RESULTS.md): with A read directly (conv
    /// weights) 4×2 subgroups of 32×32 led at every conv size measured;
    /// with only B direct (linear weights) 2×2 of 32×32; with both staged,
    /// 128×128 tiles (2×4 of 64×32) where the grid stays large, else 64×64.
    pub(super) fn tiles_for(&self, c: Coop) -> CoopTiles {
        let t = c.tile as usize;
        let whole = |dim: usize| self.k.is_multiple_of(t) && dim.is_multiple_of(t);
        let a_direct = self.direct_a.is_some() && whole(self.m);
        let b_direct = self.direct_b.is_some() && whole(self.n);
        let tiles = |sg_rows, sg_cols, rows, cols| CoopTiles {
            sg_rows,
            sg_cols,
            rows,
            cols,
            bk: 32,
            direct: true,
        };
        let big = c.extent(128);
        let big_tiles = self.m.div_ceil(big) * self.n.div_ceil(big) * self.batch;
        match (a_direct, b_direct) {
            (true, false) => tiles(4, 2, 32, 32),
            (false, true) => tiles(2, 2, 32, 32),
            _ if self.m >= big && self.n >= big && big_tiles >= 128 => tiles(2, 4, 64, 32),
            _ => tiles(2, 2, 32, 32),
        }
    }
}

/// How one operand of a cooperative GEMM reaches its fragments.
#[derive(Clone, Copy, Debug)]
pub(super) enum Feed {
    /// Loaded straight from its f16 binding.
    Direct(Direct),
    /// Staged through a workgroup tile each depth step.
    Staged(Staging),
}

/// An operand tile staged in workgroup memory as f16 each depth step (A:
/// `rows` = the block's rows × `cols` = the depth step; B: depth step ×
/// the block's columns).
#[derive(Clone, Copy, Debug)]
pub(super) struct Staging {
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Row stride in workgroup memory, padded past `cols`.
    pub(super) stride: usize,
    /// Neighbouring threads take neighbouring columns (the operand's
    /// contiguous axis), else neighbouring rows: their reads coalesce.
    pub(super) along_cols: bool,
    /// Read in 16-byte units rather than element by element.
    pub(super) vector: Option<Vector>,
}

/// How a thread stages its units (elements, or 16-byte vectors) of one
/// operand tile: its position in the tile (`r`, `c`), the value `v` read
/// at a depth step (after `let v = zero`), the register form `keep` of
/// it (prefetch holds `reg_ty`s) and the statements writing such a value
/// into the tile.
struct Stager<'a> {
    reg: &'static str,
    units: usize,
    position: String,
    zero: &'static str,
    reg_ty: &'static str,
    keep: &'static str,
    value: Box<dyn Fn(&str) -> String + 'a>,
    write: Box<dyn Fn(&str) -> String + 'a>,
}

/// A cooperative-matrix (tensor-core) GEMM kernel as data: each workgroup
/// computes a `bm`×`bn` block of the output over depth steps of `bk`,
/// its `sg_rows`×`sg_cols` subgroups each multiplying `rows`×`cols` of it
/// as `frag`×`frag` fragments into f32 accumulators; the epilogue goes
/// through a per-subgroup f32 scratch fragment to `store`.
#[derive(Clone, Copy, Debug)]
pub(super) struct CoopGemm {
    /// m, n, k, batch.
    pub(super) shape: [usize; 4],
    pub(super) frag: usize,
    /// Lanes per subgroup.
    pub(super) lanes: usize,
    pub(super) tiles: CoopTiles,
    pub(super) a: Feed,
    pub(super) b: Feed,
    /// (splits, depth per split): each split of the depth writes partial
    /// sums, which a second pass adds.
    pub(super) split: Option<(usize, usize)>,
    /// Staged operands' next depth step loads into registers while this
    /// step multiplies.
    pub(super) prefetch: bool,
    /// Workgroup stages of the staged operands: 2 stages the next depth
    /// step into one while the other is multiplied.
    pub(super) stages: usize,
    /// Workgroups take their output blocks in groups of this many block
    /// rows, column by column within a group, instead of row by row, so
    /// workgroups running together share A's and B's blocks in L2.
    pub(super) raster: Option<usize>,
    /// Accumulators stored as fragments straight into the f32 output
    /// (`dst_0`), skipping the copy through workgroup memory.
    pub(super) store_direct: bool,
}

/// Block rows per group of a rasterised cooperative GEMM grid
/// ([`CoopGemm::raster`]).
pub(super) const RASTER_ROWS: usize = 8;

impl CoopGemm {
    fn block(&self) -> (usize, usize, usize) {
        let t = &self.tiles;
        (t.sg_rows * t.rows, t.sg_cols * t.cols, t.bk)
    }

    fn threads(&self) -> usize {
        self.tiles.sg_rows * self.tiles.sg_cols * self.lanes
    }

    /// WGSL: `row0`, `col0`, the first output row and column of this
    /// workgroup's block. Rasterised, workgroup (x, y) is taken as the
    /// linear index y·gx + x and walks groups of `raster` block rows, a
    /// column of the group at a time (the last group may be shorter): a
    /// one-to-one map of the grid onto the blocks.
    fn blocks_wgsl(&self) -> String {
        let [gx, gy, _] = self.grid();
        let (bm, bn, _) = self.block();
        match self.raster {
            None => format!("    let row0 = wg.y * {bm}u;\n    let col0 = wg.x * {bn}u;\n"),
            Some(g) => format!(
                "    let lin = wg.y * {gx}u + wg.x;
    let first = (lin / {span}u) * {g}u;
    let rows = min({gy}u - first, {g}u);
    let within = lin % {span}u;
    let row0 = (first + within % rows) * {bm}u;
    let col0 = (within / rows) * {bn}u;
",
                span = g as u32 * gx,
            ),
        }
    }

    /// Workgroups along x (column blocks), y (row blocks), z (batch ×
    /// splits).
    pub(super) fn grid(&self) -> [u32; 3] {
        let [m, n, _, batch] = self.shape;
        let (bm, bn, _) = self.block();
        [
            n.div_ceil(bn) as u32,
            m.div_ceil(bm) as u32,
            (batch * self.split.map_or(1, |(s, _)| s)) as u32,
        ]
    }

    /// The kernel in WGSL, after the `load_a`/`load_b`/`store` functions.
    pub(super) fn wgsl(&self) -> String {
        let t = self.frag;
        let s = self.lanes;
        let sh = self.tiles;
        let (fm, fnn) = (sh.rows / t, sh.cols / t);
        let (bm, bn, bk) = self.block();
        let nsg = sh.sg_rows * sh.sg_cols;
        let threads = self.threads();
        let [m, n, k, batch] = self.shape;
        let ty = |role: &str, scalar: &str| format!("coop_mat{t}x{t}<{scalar}, {role}>");
        // Where the workgroup's depth range starts and ends, and where its
        // results go: the epilogue, or its split's partial sums.
        let (prologue, k_begin, k_end, result) = match self.split {
            None => (
                "    let z = wg.z;\n".to_string(),
                "0u".to_string(),
                format!("{k}u"),
                format!("store(z, r, col, Cs[sg * {}u + e])", t * t),
            ),
            Some((splits, per)) => (
                format!(
                    "    let z = wg.z / {splits}u;\n    let k_begin = (wg.z % {splits}u) * {per}u;\n    let k_end = min(k_begin + {per}u, {k}u);\n"
                ),
                "k_begin".to_string(),
                "k_end".to_string(),
                format!(
                    "part_st((((wg.z % {splits}u) * {batch}u + z) * {m}u + r) * {n}u + col, Cs[sg * {tt}u + e])",
                    tt = t * t
                ),
            ),
        };
        // `if (…) ` testing each index against its extent, leaving out
        // extents that are whole blocks (every block of them in range:
        // SD's convs and linears), so full tiles run no bounds tests.
        let guard = |tests: &[(&str, usize, usize)]| {
            let live: Vec<String> = tests
                .iter()
                .filter(|(_, extent, block)| !extent.is_multiple_of(*block))
                .map(|(index, extent, _)| format!("{index} < {extent}u"))
                .collect();
            if live.is_empty() {
                String::new()
            } else {
                format!("if ({}) ", live.join(" && "))
            }
        };
        // With two stages, the stage a step multiplies (`cur`) and the one
        // it fills (`so`) start this far into a staged tile's array.
        let double = self.stages == 2;
        let current = |st: &Staging| {
            if double {
                format!("cur * {}u + ", st.rows * st.stride)
            } else {
                String::new()
            }
        };
        let filling = |st: &Staging| {
            if double {
                format!("so * {}u + ", st.rows * st.stride)
            } else {
                String::new()
            }
        };
        let mut decl = String::new();
        let mut mac = String::new();
        let mut epi = String::new();
        for i in 0..fm {
            let load = match self.a {
                Feed::Direct(d) => format!(
                    "coopLoadT<{}>(&in{}_0[{}u + z * {}u + min(row0 + sm * {}u + {}u, {}u) * {}u + k0 + kk], {}u)",
                    ty("A", "f16"),
                    d.input,
                    d.offset,
                    d.z_stride,
                    sh.rows,
                    i * t,
                    m - t,
                    d.stride,
                    d.stride
                ),
                Feed::Staged(st) => format!(
                    "coopLoadT<{}>(&As[{}(sm * {}u + {}u) * {sa}u + kk], {sa}u)",
                    ty("A", "f16"),
                    current(&st),
                    sh.rows,
                    i * t,
                    sa = st.stride,
                ),
            };
            let _ = writeln!(mac, "            let a{i} = {load};");
        }
        for j in 0..fnn {
            let load = match self.b {
                Feed::Direct(d) => format!(
                    "coopLoad<{}>(&in{}_0[{}u + z * {}u + min(col0 + sn * {}u + {}u, {}u) * {}u + k0 + kk], {}u)",
                    ty("B", "f16"),
                    d.input,
                    d.offset,
                    d.z_stride,
                    sh.cols,
                    j * t,
                    n - t,
                    d.stride,
                    d.stride
                ),
                Feed::Staged(st) => format!(
                    "coopLoadT<{}>(&Bs[{}kk * {sb}u + sn * {}u + {}u], {sb}u)",
                    ty("B", "f16"),
                    current(&st),
                    sh.cols,
                    j * t,
                    sb = st.stride,
                ),
            };
            let _ = writeln!(mac, "            let b{j} = {load};");
        }
        for i in 0..fm {
            for j in 0..fnn {
                let _ = writeln!(decl, "    var c{i}_{j} = {}();", ty("C", "f32"));
                let _ = writeln!(
                    mac,
                    "            c{i}_{j} = coopMultiplyAdd(a{i}, b{j}, c{i}_{j});"
                );
                if self.store_direct {
                    let _ = writeln!(
                        epi,
                        "    coopStoreT(c{i}_{j}, &dst_0[z * {mn}u + (row0 + sm * {rows}u + {ri}u) * {n}u + col0 + sn * {cols}u + {ci}u], {n}u);",
                        mn = m * n,
                        rows = sh.rows,
                        cols = sh.cols,
                        ri = i * t,
                        ci = j * t,
                    );
                    continue;
                }
                let _ = write!(
                    epi,
                    "    coopStoreT(c{i}_{j}, &Cs[sg * {tt}u], {t}u);
    workgroupBarrier();
{copy}    workgroupBarrier();
",
                    tt = t * t,
                    copy = strided(
                        "    ",
                        "lane",
                        t * t,
                        s,
                        &format!(
                            "        let r = row0 + sm * {rows}u + {ri}u + e / {t}u;
        let col = col0 + sn * {cols}u + {ci}u + e % {t}u;
        {guard}{{ {result}; }}
",
                            rows = sh.rows,
                            cols = sh.cols,
                            ri = i * t,
                            ci = j * t,
                            guard = guard(&[("r", m, bm), ("col", n, bn)]),
                        )
                    ),
                );
            }
        }
        // Staging: neighbouring threads take neighbouring memory. Unit
        // (element, or 16-byte vector) e = tid + se·threads of a tile
        // `width` units wide is at (e / width, e % width); where the
        // threads are a multiple of the width each thread keeps one
        // position along it for all its units, said so, so the driver
        // computes what depends on it once (a conv's output pixel, from
        // its column).
        let across = |width: usize| {
            if threads.is_multiple_of(width) {
                (
                    format!("tid / {width}u + se * {}u", threads / width),
                    format!("tid % {width}u"),
                )
            } else {
                (format!("e / {width}u"), format!("e % {width}u"))
            }
        };
        let mut staged: Vec<Stager> = Vec::new();
        let mut shared = String::new();
        for (name, feed) in [("A", self.a), ("B", self.b)] {
            let Feed::Staged(st) = feed else { continue };
            let _ = writeln!(
                shared,
                "var<workgroup> {name}s: array<f16, {}>;",
                self.stages * st.rows * st.stride
            );
            // The tile's element (r, c) is the operand's (row, depth) for
            // A, (depth, column) for B, at depth step `kv`.
            let a = name == "A";
            let global = move |kv: &str| -> (String, String) {
                if a {
                    ("row0 + r".to_string(), format!("{kv} + c"))
                } else {
                    (format!("{kv} + r"), "col0 + c".to_string())
                }
            };
            let (rows_extent, cols_extent, rows_block, cols_block) =
                if a { (m, k, bm, bk) } else { (k, n, bk, bn) };
            let guard_at = move |kv: &str| {
                let (gr, gc) = global(kv);
                guard(&[
                    (&gr, rows_extent, rows_block),
                    (&gc, cols_extent, cols_block),
                ])
            };
            // The tile index of position (r, c).
            let slot = format!("{}r * {}u + c", filling(&st), st.stride);
            // Units along the contiguous axis: (units per row or column,
            // which index is scaled by the width).
            let stager = match st.vector {
                None => {
                    let (r, c) = if st.along_cols {
                        across(st.cols)
                    } else {
                        let (q, rem) = across(st.rows);
                        (rem, q)
                    };
                    let load = if a {
                        |kv: &str| format!("v = load_a(z, row0 + r, {kv} + c);")
                    } else {
                        |kv: &str| format!("v = load_b(z, {kv}, r, col0 + c);")
                    };
                    Stager {
                        reg: name,
                        units: st.rows * st.cols,
                        position: format!("let r = {r}; let c = {c};"),
                        zero: "0.0",
                        reg_ty: "f16",
                        keep: "f16(v)",
                        value: Box::new(move |kv| format!("{}{{ {} }}", guard_at(kv), load(kv))),
                        write: Box::new(move |x| format!("{name}s[{slot}] = {x};")),
                    }
                }
                Some(vec) => {
                    let w = vec.width;
                    let (r, c) = if vec.along_cols() {
                        let (q, rem) = across(st.cols / w);
                        (q, format!("({rem}) * {w}u"))
                    } else {
                        let (q, rem) = across(st.rows / w);
                        (format!("({rem}) * {w}u"), q)
                    };
                    let zero = unit_zero(w);
                    let value = move |kv: &str| {
                        let (gr, gc) = global(kv);
                        format!("{}{{ {} }}", guard_at(kv), vec.load(&gr, &gc))
                    };
                    // Element i of the unit goes `i·step` past its first.
                    let step = if vec.along_cols() { 1 } else { st.stride };
                    let tile = format!("{name}s");
                    let write = move |x: &str| unit_writes(&tile, &slot, x, "f16", w, step);
                    Stager {
                        reg: name,
                        units: st.rows * st.cols / w,
                        position: format!("let r = {r}; let c = {c};"),
                        zero,
                        reg_ty: zero.trim_end_matches("()"),
                        keep: "v",
                        value: Box::new(value),
                        write: Box::new(write),
                    }
                }
            };
            staged.push(stager);
        }
        // Register prefetch: each thread's units of the next step load
        // into registers before this step's products, so global latency
        // overlaps them; written to workgroup memory after.
        let prefetch = self.prefetch;
        let (mut stage, mut fetch, mut commit, mut regs, mut next) = (
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
        );
        for st in &staged {
            let Stager {
                reg,
                units,
                position,
                zero,
                reg_ty,
                keep,
                value,
                write,
            } = st;
            // This thread's units at depth step `kv`, into the tile or
            // into registers.
            let load = |kv: &str, into: &dyn Fn(&str) -> String| {
                strided(
                    "        ",
                    "tid",
                    *units,
                    threads,
                    &format!(
                        "            {position}
            var v = {zero};
            {}
            {}
",
                        value(kv),
                        into(keep)
                    ),
                )
            };
            stage.push_str(&load("k0", write));
            if double {
                next.push_str(&load("kn", write));
            }
            if prefetch {
                let per = units / threads;
                let _ = writeln!(regs, "    var p{reg}: array<{reg_ty}, {per}>;");
                fetch.push_str(&load("kn", &|x| format!("p{reg}[se] = {x};")));
                commit.push_str(&strided(
                    "        ",
                    "tid",
                    *units,
                    threads,
                    &format!(
                        "            {position}
            {}
",
                        write(&format!("p{reg}[se]"))
                    ),
                ));
            }
        }
        let barrier = if !staged.is_empty() {
            "        workgroupBarrier();\n"
        } else {
            ""
        };
        // With a direct operand the depth may end inside a step: stop at
        // it rather than read past the row (k is then a multiple of the
        // fragment). A loop bound, not an `if`: naga treats branches on
        // local variables as non-uniform, which cooperative ops forbid.
        // Where every step is whole (SD's convs and linears: depths are
        // multiples of 32), the bound stays a constant, so the driver can
        // unroll the loop and issue the direct fragment loads together.
        let any_direct = matches!(self.a, Feed::Direct(_)) || matches!(self.b, Feed::Direct(_));
        let depth_end = if any_direct && !k.is_multiple_of(bk) {
            format!("min({bk}u, {k_end} - k0)")
        } else {
            format!("{bk}u")
        };
        let main_loop = if double {
            // The first step staged into stage 0; then each step stages
            // the next into the other stage before multiplying this one.
            // A stage is refilled only after the barrier that ends the
            // step which read it.
            format!(
                "    {{
        let k0 = {k_begin};
        let so = 0u;
{stage}    }}
    workgroupBarrier();
    for (var k0 = {k_begin}; k0 < {k_end}; k0 += {bk}u) {{
        let cur = ((k0 - {k_begin}) / {bk}u) % 2u;
        let kn = k0 + {bk}u;
        if (kn < {k_end}) {{
            let so = 1u - cur;
{next}        }}
        for (var kk = 0u; kk < {depth_end}; kk += {t}u) {{
{mac}        }}
        workgroupBarrier();
    }}
"
            )
        } else if prefetch {
            // The first step staged as usual, then each step fetches the
            // next before multiplying.
            format!(
                "{regs}    {{
        let k0 = {k_begin};
{stage}    }}
    workgroupBarrier();
    for (var k0 = {k_begin}; k0 < {k_end}; k0 += {bk}u) {{
        let kn = k0 + {bk}u;
{fetch}        for (var kk = 0u; kk < {depth_end}; kk += {t}u) {{
{mac}        }}
        workgroupBarrier();
{commit}        workgroupBarrier();
    }}
"
            )
        } else {
            format!(
                "    for (var k0 = {k_begin}; k0 < {k_end}; k0 += {bk}u) {{
{stage}{barrier}        for (var kk = 0u; kk < {depth_end}; kk += {t}u) {{
{mac}        }}
{barrier}    }}
"
            )
        };
        format!(
            "{shared}{cs}@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32, @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {{
{prologue}{blocks}    let sm = sg / {sgc}u;
    let sn = sg % {sgc}u;
{decl}{main_loop}{epi}}}
",
            // The epilogue's per-subgroup fragment, unless fragments go
            // straight to the output.
            cs = if self.store_direct {
                String::new()
            } else {
                format!("var<workgroup> Cs: array<f32, {}>;\n", nsg * t * t)
            },
            sgc = sh.sg_cols,
            blocks = self.blocks_wgsl(),
        )
    }
}
