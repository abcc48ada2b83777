//! f32 CPU kernels: pure functions over flat slices.
//!
//! These are both the CPU fallback device and the numerical reference that
//! every GPU kernel is checked against, so each function documents its exact
//! layout and semantics (PyTorch's, where PyTorch has the op). They know
//! nothing of the tensor IR: callers pass row-major slices plus sizes.
//!
//! Conventions shared by every kernel:
//! * All sizes are validated before any work starts. Inconsistent sizes return
//!   a [`KernelError`] naming the op and its sizes; nothing here panics on them.
//! * Contiguous inputs and every output must have exactly the length their
//!   shape implies. Outputs are overwritten, never accumulated into.
//! * Parallel work runs on rayon's current pool, so a caller picks the thread
//!   count by installing a pool (`ThreadPool::install`).
//! * The only `unsafe` is the call into the `gemm` crate, inside
//!   `gemm_into`, which first checks every index the product can touch.

use super::amx;
use gemm::Parallelism;
use rayon::prelude::*;

/// Why a kernel refused its arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A contiguous operand's length differs from what its shape implies.
    #[error("{op}: `{operand}` has {len} elements, but {shape} needs {needed}")]
    Length {
        op: &'static str,
        operand: &'static str,
        len: usize,
        needed: usize,
        shape: String,
    },
    /// A strided view reaches past the end of its buffer.
    #[error("{op}: `{operand}` view reaches element {reach} but has only {len} ({shape})")]
    OutOfBounds {
        op: &'static str,
        operand: &'static str,
        reach: usize,
        len: usize,
        shape: String,
    },
    /// A parameter is out of range, or the sizes overflow `usize`.
    #[error("{op}: {reason} ({shape})")]
    Invalid {
        op: &'static str,
        reason: String,
        shape: String,
    },
}

type Result<T = ()> = std::result::Result<T, KernelError>;

/// Products with at least this many multiply-adds are worth splitting across
/// threads; below it the fork/join cost is a noticeable share of the work.
const PAR_WORK: usize = 1 << 20;

/// Element-wise and row-wise kernels hand rayon pieces of at least this many
/// elements, so small tensors run on one thread.
const PAR_ELEMS: usize = 1 << 15;

/// The arithmetic of matrix products (matmul, convolution, attention).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Products {
    /// f32 operands and accumulation: the reference results.
    #[default]
    F32,
    /// bf16 operands, f32 accumulation, on CPUs with AMX tiles (see
    /// [`super::amx`]); f32 on the others.
    Bf16,
}

impl Products {
    /// Whether an `m × k` by `k × n` product runs on AMX tiles. Tiny ones
    /// stay f32: padding to 32 × 32 blocks would cost more than it saves.
    pub fn uses_amx(self, m: usize, n: usize, k: usize) -> bool {
        self == Products::Bf16
            && k >= 8
            && m.saturating_mul(n).saturating_mul(k) >= 1 << 15
            && super::amx::available()
    }

    /// Whether [`attention`] with these sizes runs on AMX tiles.
    pub fn attention_uses_amx(self, sq: usize, skv: usize, d: usize) -> bool {
        self.uses_amx(ATTN_QB.min(sq), ATTN_KB.min(skv), d)
    }
}

/// Rows per band when an AMX product is split across threads: whole
/// 32-row blocks, about two bands per thread.
fn amx_band(m: usize) -> usize {
    let blocks = m.div_ceil(super::amx::BLOCK);
    let bands = (BANDS_PER_THREAD * rayon::current_num_threads()).clamp(1, blocks.max(1));
    blocks.div_ceil(bands) * super::amx::BLOCK
}

fn amx_error<'s>(
    op: &'static str,
    shape: &'s (dyn Fn() -> String + Sync),
) -> impl Fn(super::amx::AmxError) -> KernelError + 's {
    move |e| invalid(op, e.to_string(), shape)
}

fn length(
    op: &'static str,
    operand: &'static str,
    len: usize,
    needed: usize,
    shape: &dyn Fn() -> String,
) -> Result {
    if len == needed {
        Ok(())
    } else {
        Err(KernelError::Length {
            op,
            operand,
            len,
            needed,
            shape: shape(),
        })
    }
}

fn invalid(op: &'static str, reason: impl Into<String>, shape: &dyn Fn() -> String) -> KernelError {
    KernelError::Invalid {
        op,
        reason: reason.into(),
        shape: shape(),
    }
}

/// Product of `dims`, or an error when it overflows `usize`.
fn product(op: &'static str, dims: &[usize], shape: &dyn Fn() -> String) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| invalid(op, "sizes overflow usize", shape))
}

/// Rows per rayon piece for a row-wise kernel, so each piece has about
/// [`PAR_ELEMS`] elements.
fn rows_per_piece(cols: usize) -> usize {
    (PAR_ELEMS / cols.max(1)).max(1)
}

// ---------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------

/// A strided view of one batch of matmul operands, in elements.
///
/// Element `(b, i, j)` of the view is
/// `data[offset + b * batch_stride + i * row_stride + j * col_stride]`.
/// A transposed operand swaps the two strides; a stride of 0 broadcasts
/// (for example `batch_stride: 0` shares one weight matrix across the batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatView {
    pub offset: usize,
    pub batch_stride: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl MatView {
    /// A contiguous row-major `[batch, rows, cols]` operand starting at 0.
    pub fn row_major(rows: usize, cols: usize) -> Self {
        Self {
            offset: 0,
            batch_stride: rows.saturating_mul(cols),
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a contiguous row-major `[batch, cols, rows]` operand,
    /// seen as `[batch, rows, cols]` without copying.
    pub fn transposed(rows: usize, cols: usize) -> Self {
        Self {
            offset: 0,
            batch_stride: rows.saturating_mul(cols),
            row_stride: 1,
            col_stride: rows,
        }
    }
}

/// One index past the last element a `[batch, rows, cols]` strided view can
/// touch (0 when it touches none), or `None` on overflow.
fn view_end(
    offset: usize,
    batch: usize,
    bs: usize,
    rows: usize,
    rs: usize,
    cols: usize,
    cs: usize,
) -> Option<usize> {
    if batch == 0 || rows == 0 || cols == 0 {
        return Some(0);
    }
    let last = (batch - 1)
        .checked_mul(bs)?
        .checked_add((rows - 1).checked_mul(rs)?)?
        .checked_add((cols - 1).checked_mul(cs)?)?;
    offset.checked_add(last)?.checked_add(1)
}

#[allow(clippy::too_many_arguments)]
fn check_view(
    op: &'static str,
    operand: &'static str,
    len: usize,
    offset: usize,
    batch: usize,
    bs: usize,
    rows: usize,
    rs: usize,
    cols: usize,
    cs: usize,
    shape: &dyn Fn() -> String,
) -> Result {
    let end = view_end(offset, batch, bs, rows, rs, cols, cs).ok_or_else(|| {
        invalid(
            op,
            format!("`{operand}` view offsets overflow usize"),
            shape,
        )
    })?;
    if end > len {
        return Err(KernelError::OutOfBounds {
            op,
            operand,
            reach: end - 1,
            len,
            shape: shape(),
        });
    }
    Ok(())
}

/// A read-only strided matrix operand of one product.
#[derive(Clone, Copy)]
struct Operand<'a> {
    data: &'a [f32],
    offset: usize,
    rs: usize,
    cs: usize,
}

/// `dst[offset + i*dst_rs + j] (+)= scale * Σ_p lhs(i, p) * rhs(p, j)` for an
/// `m × n` destination with `k`-long dot products; with `accumulate` the
/// product is added to what `dst` holds, otherwise it replaces it.
///
/// The destination's columns are unit-stride and its rows must not overlap
/// (`dst_rs >= n`), because `gemm` writes from several threads and two
/// threads writing one element would be a data race.
#[allow(unsafe_code, clippy::too_many_arguments)]
fn gemm_into(
    op: &'static str,
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_offset: usize,
    dst_rs: usize,
    accumulate: bool,
    lhs: Operand<'_>,
    rhs: Operand<'_>,
    scale: f32,
    par: Parallelism,
) -> Result {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let shape = || format!("m={m} n={n} k={k}");
    if m > 1 && dst_rs < n {
        return Err(invalid(
            op,
            format!("destination row stride {dst_rs} overlaps rows of {n}"),
            &shape,
        ));
    }
    check_view(
        op,
        "dst",
        dst.len(),
        dst_offset,
        1,
        0,
        m,
        dst_rs,
        n,
        1,
        &shape,
    )?;
    if k == 0 {
        // An empty sum is zero; gemm is not asked to handle this corner.
        if !accumulate {
            for i in 0..m {
                let start = dst_offset + i * dst_rs;
                dst[start..start + n].fill(0.0);
            }
        }
        return Ok(());
    }
    check_view(
        op,
        "lhs",
        lhs.data.len(),
        lhs.offset,
        1,
        0,
        m,
        lhs.rs,
        k,
        lhs.cs,
        &shape,
    )?;
    check_view(
        op,
        "rhs",
        rhs.data.len(),
        rhs.offset,
        1,
        0,
        k,
        rhs.rs,
        n,
        rhs.cs,
        &shape,
    )?;
    // A stride whose dimension is > 1 fits isize (it is below a slice length);
    // one whose dimension is 1 is never multiplied by anything but 0.
    let st = |s: usize| isize::try_from(s).unwrap_or(0);
    // SAFETY: the checks above prove that every element gemm reads,
    // `lhs.data[lhs.offset + i*rs + p*cs]` for i < m, p < k (and likewise for
    // rhs), and every element it writes, `dst[dst_offset + i*dst_rs + j]` for
    // i < m, j < n, lies inside its slice; the offsets themselves are in
    // bounds because each view touches at least one element. Destination
    // elements are pairwise distinct (`dst_rs >= n`), so gemm's threads never
    // write the same element, and `dst` cannot alias `lhs`/`rhs` because it is
    // borrowed mutably. With `read_dst == false` gemm never reads `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(dst_offset),
            1,
            st(dst_rs),
            accumulate,
            lhs.data.as_ptr().add(lhs.offset),
            st(lhs.cs),
            st(lhs.rs),
            rhs.data.as_ptr().add(rhs.offset),
            st(rhs.cs),
            st(rhs.rs),
            1.0,
            scale,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

/// Rows per band, at least, when [`gemm_auto`] splits a product.
const MIN_BAND_ROWS: usize = 32;
/// Bands per thread when [`gemm_auto`] splits a product: more than one lets
/// rayon even out a core that another process slows down.
const BANDS_PER_THREAD: usize = 2;

/// `dst` (contiguous row-major `[m, n]`) = (or, with `accumulate`, +=)
/// `scale · lhs · rhs`, on the threads the caller is not already using.
///
/// A large product is cut into bands of rows, a few per thread, each an
/// independent single-threaded gemm sharing `rhs`: one fork for the whole
/// product, and rayon's stealing evens out a core that other processes slow
/// down, where gemm's own threading splits each cache block evenly and waits
/// for the slowest thread. (On an idle machine both run at the same speed.)
/// Each band packs its own copy of `rhs`, `k·n` work against `2·rows·n·k`.
#[allow(clippy::too_many_arguments)]
fn gemm_auto(
    op: &'static str,
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    accumulate: bool,
    lhs: Operand<'_>,
    rhs: Operand<'_>,
    scale: f32,
    outer_parallel: bool,
) -> Result {
    let work = m.saturating_mul(n).saturating_mul(k);
    let threads = rayon::current_num_threads();
    let bands = (BANDS_PER_THREAD * threads).min(m / MIN_BAND_ROWS);
    if outer_parallel || threads < 2 || work < PAR_WORK || bands < 2 || n == 0 {
        let par = if outer_parallel || threads < 2 || work < PAR_WORK {
            Parallelism::None
        } else {
            Parallelism::Rayon(0)
        };
        return gemm_into(op, m, n, k, dst, 0, n, accumulate, lhs, rhs, scale, par);
    }
    let shape = || format!("m={m} n={n} k={k}");
    check_view(op, "dst", dst.len(), 0, 1, 0, m, n, n, 1, &shape)?;
    let band = m.div_ceil(bands);
    dst[..m * n]
        .par_chunks_mut(band * n)
        .enumerate()
        .try_for_each(|(i, d)| {
            // Out-of-range offsets saturate and are then rejected by gemm_into.
            let offset = lhs.offset.saturating_add((i * band).saturating_mul(lhs.rs));
            let band_lhs = Operand { offset, ..lhs };
            gemm_into(
                op,
                d.len() / n,
                n,
                k,
                d,
                0,
                n,
                accumulate,
                band_lhs,
                rhs,
                scale,
                Parallelism::None,
            )
        })
}

/// Batched matrix product `c[b] = a[b] · b[b]` for `b < batch`.
///
/// * `a` is read through `av` as `[batch, m, k]`, `b` through `bv` as
///   `[batch, k, n]` (see [`MatView`]: transposes and broadcasts need no copy).
/// * `c` is contiguous row-major `[batch, m, n]` and is overwritten.
/// * `k == 0` gives zeros.
///
/// Small products run one per thread across the batch; large ones are cut
/// into bands of rows spread over the threads.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    a: &[f32],
    av: MatView,
    b: &[f32],
    bv: MatView,
    c: &mut [f32],
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    products: Products,
) -> Result {
    const OP: &str = "matmul";
    let shape = || format!("batch={batch} m={m} n={n} k={k} a={av:?} b={bv:?}");
    let mn = product(OP, &[m, n], &shape)?;
    length(OP, "c", c.len(), product(OP, &[batch, mn], &shape)?, &shape)?;
    check_view(
        OP,
        "a",
        a.len(),
        av.offset,
        batch,
        av.batch_stride,
        m,
        av.row_stride,
        k,
        av.col_stride,
        &shape,
    )?;
    check_view(
        OP,
        "b",
        b.len(),
        bv.offset,
        batch,
        bv.batch_stride,
        k,
        bv.row_stride,
        n,
        bv.col_stride,
        &shape,
    )?;
    if mn == 0 || batch == 0 {
        return Ok(());
    }
    if products.uses_amx(m, n, k) {
        return matmul_amx(a, av, Rhs::View(b, bv), c, batch, m, n, k);
    }
    let work = mn.saturating_mul(k);
    // Each batch offset was covered by check_view, so these cannot overflow.
    let one = |i: usize, ci: &mut [f32], outer: bool| {
        let lhs = Operand {
            data: a,
            offset: av.offset + i * av.batch_stride,
            rs: av.row_stride,
            cs: av.col_stride,
        };
        let rhs = Operand {
            data: b,
            offset: bv.offset + i * bv.batch_stride,
            rs: bv.row_stride,
            cs: bv.col_stride,
        };
        gemm_auto(OP, m, n, k, ci, false, lhs, rhs, 1.0, outer)
    };
    let threads = rayon::current_num_threads();
    if batch > 1 && (batch >= threads || work < PAR_WORK) {
        c.par_chunks_mut(mn)
            .enumerate()
            .try_for_each(|(i, ci)| one(i, ci, true))
    } else {
        c.chunks_mut(mn)
            .enumerate()
            .try_for_each(|(i, ci)| one(i, ci, false))
    }
}

/// The right operand of a matmul shared by the whole batch (a Linear
/// layer's weight), in the AMX kernels' tile order ([`pack_matmul_rhs`]),
/// packed once and used by every call ([`matmul_packed`]).
pub struct PackedRhs(amx::PackedB);

impl PackedRhs {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.0.bytes()
    }
}

/// Packs the `[k, n]` matrix `b` (read through `bv`; its batch stride is
/// ignored) for [`matmul_packed`]; an error where AMX is not available.
pub fn pack_matmul_rhs(b: &[f32], bv: MatView, k: usize, n: usize) -> Result<PackedRhs> {
    const OP: &str = "matmul";
    let shape = || format!("k={k} n={n} b={bv:?}");
    if !amx::available() {
        return Err(invalid(OP, "AMX tiles are not available", &shape));
    }
    check_view(
        OP,
        "b",
        b.len(),
        bv.offset,
        1,
        0,
        k,
        bv.row_stride,
        n,
        bv.col_stride,
        &shape,
    )?;
    let src = amx::Src {
        data: b,
        offset: bv.offset,
        rs: bv.row_stride,
        cs: bv.col_stride,
    };
    Ok(PackedRhs(amx::PackedB::pack(src, k, n, true)))
}

/// [`matmul`] with B packed by [`pack_matmul_rhs`] (bf16 products), the
/// same B for every batch entry.
pub fn matmul_packed(
    a: &[f32],
    av: MatView,
    b: &PackedRhs,
    c: &mut [f32],
    batch: usize,
    m: usize,
) -> Result {
    const OP: &str = "matmul";
    let (k, n) = (b.0.depth(), b.0.cols());
    let shape = || format!("batch={batch} m={m} n={n} k={k} a={av:?} (B packed)");
    let mn = product(OP, &[m, n], &shape)?;
    length(OP, "c", c.len(), product(OP, &[batch, mn], &shape)?, &shape)?;
    check_view(
        OP,
        "a",
        a.len(),
        av.offset,
        batch,
        av.batch_stride,
        m,
        av.row_stride,
        k,
        av.col_stride,
        &shape,
    )?;
    if mn == 0 || batch == 0 {
        return Ok(());
    }
    matmul_amx(a, av, Rhs::Packed(&b.0), c, batch, m, n, k)
}

/// B of [`matmul_amx`].
#[derive(Clone, Copy)]
enum Rhs<'a> {
    View(&'a [f32], MatView),
    Packed(&'a amx::PackedB),
}

/// [`matmul`] on AMX tiles; the views are already checked. B is packed
/// once per distinct matrix (once for a weight shared across the batch)
/// unless it comes packed; A is packed 32 rows at a time as the bands
/// reach it.
#[allow(clippy::too_many_arguments)]
fn matmul_amx(
    a: &[f32],
    av: MatView,
    rhs: Rhs<'_>,
    c: &mut [f32],
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Result {
    use super::amx::{gemm, Lhs, PackedB, Src};
    const OP: &str = "matmul";
    let shape = || format!("batch={batch} m={m} n={n} k={k}");
    let (b, bv) = match rhs {
        Rhs::View(b, bv) => (b, bv),
        Rhs::Packed(_) => (&[][..], MatView::row_major(k, n)),
    };
    let pack_b = |i: usize, parallel: bool| {
        let src = Src {
            data: b,
            offset: bv.offset + i * bv.batch_stride,
            rs: bv.row_stride,
            cs: bv.col_stride,
        };
        PackedB::pack(src, k, n, parallel)
    };
    let a_rows = |i: usize, r0: usize, rows: usize| {
        let src = Src {
            data: a,
            offset: av.offset + i * av.batch_stride + r0 * av.row_stride,
            rs: av.row_stride,
            cs: av.col_stride,
        };
        Lhs::Rows(src, rows, k)
    };
    let mn = m * n;
    let prepacked = match rhs {
        Rhs::Packed(pb) => Some(pb),
        Rhs::View(..) => None,
    };
    let shared = prepacked.is_some() || bv.batch_stride == 0 || batch == 1;
    if !shared && batch >= rayon::current_num_threads() {
        // Many distinct products (batched attention scores): one per task.
        return c.par_chunks_mut(mn).enumerate().try_for_each(|(i, ci)| {
            let pb = pack_b(i, false);
            gemm(a_rows(i, 0, m), &pb, ci, n, false, 1.0).map_err(amx_error(OP, &shape))
        });
    }
    let shared_b = (shared && prepacked.is_none()).then(|| pack_b(0, true));
    let band = amx_band(m);
    for (i, ci) in c.chunks_mut(mn).enumerate() {
        let own;
        let pb = match (prepacked, &shared_b) {
            (Some(pb), _) | (None, Some(pb)) => pb,
            (None, None) => {
                own = pack_b(i, true);
                &own
            }
        };
        ci.par_chunks_mut(band * n)
            .enumerate()
            .try_for_each(|(t, d)| {
                let rows = d.len() / n;
                gemm(a_rows(i, t * band, rows), pb, d, n, false, 1.0).map_err(amx_error(OP, &shape))
            })?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Convolution
// ---------------------------------------------------------------------------

/// im2col tiles are capped at this many floats (8 MiB) per thread, so memory
/// stays bounded for large images; gemm blocks for cache on its own.
const COL_BUDGET: usize = 1 << 21;

/// Fewest output positions per tile worth a gemm call of its own.
const MIN_TILE_COLS: usize = 128;
/// Tile widths are rounded down to a multiple of this.
const TILE_ALIGN: usize = 64;

/// Geometry of one convolution, as im2col needs it.
#[derive(Clone, Copy, Debug)]
struct ConvGeom {
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    ow: usize,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
}

impl ConvGeom {
    /// Fills `col`, laid out `[cg*kh*kw, cols]`, with the input values under
    /// each kernel tap for output positions `p0..p0 + cols` (flattened
    /// `oy*ow + ox`), zero where the tap falls in the padding. `xg` is the
    /// group's input, `[cg, h, w]`.
    fn im2col(&self, xg: &[f32], p0: usize, cols: usize, col: &mut [f32], parallel: bool) {
        let fill = |r: usize, dst: &mut [f32]| self.im2col_row(xg, r, p0, dst);
        if cols == 0 {
            return;
        }
        if parallel {
            col.par_chunks_mut(cols)
                .enumerate()
                .for_each(|(r, dst)| fill(r, dst));
        } else {
            col.chunks_mut(cols)
                .enumerate()
                .for_each(|(r, dst)| fill(r, dst));
        }
    }

    /// One im2col row: kernel tap `r = (ci*kh + ky)*kw + kx`.
    fn im2col_row(&self, xg: &[f32], r: usize, p0: usize, dst: &mut [f32]) {
        let (ci, ky, kx) = (
            r / (self.kh * self.kw),
            (r / self.kw) % self.kh,
            r % self.kw,
        );
        let plane = &xg[ci * self.h * self.w..(ci + 1) * self.h * self.w];
        let (w, ow) = (self.w as isize, self.ow);
        let mut done = 0;
        let mut pos = p0;
        while done < dst.len() {
            let (oy, ox0) = (pos / ow, pos % ow);
            let run = (ow - ox0).min(dst.len() - done);
            let seg = &mut dst[done..done + run];
            let iy =
                (oy * self.stride[0] + ky * self.dilation[0]) as isize - self.padding[0] as isize;
            if iy < 0 || iy >= self.h as isize {
                seg.fill(0.0);
            } else {
                let row = &plane[iy as usize * self.w..(iy as usize + 1) * self.w];
                // Input column for output column ox is ox*stride + base.
                let base = (kx * self.dilation[1]) as isize - self.padding[1] as isize;
                if self.stride[1] == 1 {
                    // Unit stride: one contiguous copy between zeroed edges.
                    let (start, end) = (ox0 as isize, (ox0 + run) as isize);
                    let lo = (-base).clamp(start, end);
                    let hi = (w - base).clamp(lo, end);
                    if hi <= lo {
                        // The tap reads only padding for this whole run
                        // (lo may then sit outside the row).
                        seg.fill(0.0);
                    } else {
                        let (lo_i, hi_i) = ((lo - start) as usize, (hi - start) as usize);
                        seg[..lo_i].fill(0.0);
                        seg[lo_i..hi_i]
                            .copy_from_slice(&row[(lo + base) as usize..(hi + base) as usize]);
                        seg[hi_i..].fill(0.0);
                    }
                } else {
                    let sw = self.stride[1] as isize;
                    for (t, v) in seg.iter_mut().enumerate() {
                        let ix = (ox0 + t) as isize * sw + base;
                        *v = if (0..w).contains(&ix) {
                            row[ix as usize]
                        } else {
                            0.0
                        };
                    }
                }
            }
            done += run;
            pos += run;
        }
    }
}

/// The output positions `p0..p0 + cols` of one (image, group) pair, as one
/// mutable segment per output channel of the group.
struct ConvTile<'o> {
    job: usize,
    p0: usize,
    cols: usize,
    rows: Vec<&'o mut [f32]>,
}

/// 2-D convolution (cross-correlation, as `torch.nn.functional.conv2d`).
///
/// * `x`: `[n, c, h, w]` (`x_shape`), NCHW contiguous.
/// * `weight`: `[o, c / groups, kh, kw]` (`w_shape`).
/// * `bias`: `[o]` or `None`.
/// * `out`: `[n, o, oh, ow]` with
///   `oh = (h + 2*padding[0] - dilation[0]*(kh - 1) - 1) / stride[0] + 1`
///   (likewise `ow`); index 0 of `stride`/`padding`/`dilation` is height.
///
/// Output channel block `g` (of `o / groups`) sees only input channel block
/// `g`. 1×1 stride-1 unpadded convolutions are a plain GEMM on the input; the
/// rest are im2col tiles times the weight matrix, one tile per task, tiles
/// spread over threads.
#[allow(clippy::too_many_arguments)]
pub fn conv2d(
    x: &[f32],
    x_shape: [usize; 4],
    weight: &[f32],
    w_shape: [usize; 4],
    bias: Option<&[f32]>,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
    out: &mut [f32],
    products: Products,
) -> Result {
    conv2d_with(
        x,
        x_shape,
        ConvWeight::Plain(weight, products),
        w_shape,
        bias,
        stride,
        padding,
        dilation,
        groups,
        out,
    )
}

/// A convolution weight in the AMX kernels' tile order ([`pack_conv_weight`]),
/// packed once and used by every call ([`conv2d_packed`]).
pub struct PackedConvWeight {
    w_shape: [usize; 4],
    groups: usize,
    per_group: Vec<amx::PackedA>,
}

impl PackedConvWeight {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.per_group.iter().map(amx::PackedA::bytes).sum()
    }
}

/// Packs a `[o, c / groups, kh, kw]` weight for [`conv2d_packed`]; an
/// error where AMX is not available.
pub fn pack_conv_weight(
    weight: &[f32],
    w_shape: [usize; 4],
    groups: usize,
) -> Result<PackedConvWeight> {
    const OP: &str = "conv2d";
    let shape = || format!("weight={w_shape:?} groups={groups}");
    if !amx::available() {
        return Err(invalid(OP, "AMX tiles are not available", &shape));
    }
    let [o, cg, kh, kw] = w_shape;
    if groups == 0 || !o.is_multiple_of(groups) {
        return Err(invalid(
            OP,
            "output channels must split into groups",
            &shape,
        ));
    }
    length(
        OP,
        "weight",
        weight.len(),
        product(OP, &w_shape, &shape)?,
        &shape,
    )?;
    let (og, kk) = (o / groups, cg * kh * kw);
    let per_group = (0..groups)
        .map(|g| {
            let src = amx::Src {
                data: weight,
                offset: g * og * kk,
                rs: kk,
                cs: 1,
            };
            amx::PackedA::pack(src, og, kk, true)
        })
        .collect();
    Ok(PackedConvWeight {
        w_shape,
        groups,
        per_group,
    })
}

/// [`conv2d`] with a weight packed by [`pack_conv_weight`] (bf16 products).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_packed(
    x: &[f32],
    x_shape: [usize; 4],
    weight: &PackedConvWeight,
    bias: Option<&[f32]>,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    out: &mut [f32],
) -> Result {
    conv2d_with(
        x,
        x_shape,
        ConvWeight::Packed(&weight.per_group),
        weight.w_shape,
        bias,
        stride,
        padding,
        dilation,
        weight.groups,
        out,
    )
}

/// Where [`conv2d_with`] takes its weight from.
enum ConvWeight<'a> {
    /// f32 values, multiplied in this arithmetic.
    Plain(&'a [f32], Products),
    /// Packed for AMX, one matrix per group.
    Packed(&'a [amx::PackedA]),
}

#[allow(clippy::too_many_arguments)]
fn conv2d_with(
    x: &[f32],
    x_shape: [usize; 4],
    src: ConvWeight<'_>,
    w_shape: [usize; 4],
    bias: Option<&[f32]>,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
    out: &mut [f32],
) -> Result {
    const OP: &str = "conv2d";
    let [n, c, h, w] = x_shape;
    let [o, cg, kh, kw] = w_shape;
    let shape = || {
        format!(
            "x={x_shape:?} weight={w_shape:?} stride={stride:?} padding={padding:?} dilation={dilation:?} groups={groups}"
        )
    };
    if groups == 0 || stride.contains(&0) || dilation.contains(&0) {
        return Err(invalid(
            OP,
            "groups, stride and dilation must be positive",
            &shape,
        ));
    }
    if kh == 0 || kw == 0 {
        return Err(invalid(OP, "empty kernel", &shape));
    }
    if !c.is_multiple_of(groups) || !o.is_multiple_of(groups) || cg != c / groups {
        return Err(invalid(
            OP,
            "channels must split into groups: c % groups == 0, o % groups == 0, weight dim 1 == c / groups",
            &shape,
        ));
    }
    let out_dim = |size: usize, k: usize, axis: usize| -> Result<usize> {
        let padded = padding[axis]
            .checked_mul(2)
            .and_then(|p| p.checked_add(size))
            .ok_or_else(|| invalid(OP, "sizes overflow usize", &shape))?;
        let extent = dilation[axis]
            .checked_mul(k - 1)
            .and_then(|e| e.checked_add(1))
            .ok_or_else(|| invalid(OP, "sizes overflow usize", &shape))?;
        if extent > padded {
            return Err(invalid(
                OP,
                "dilated kernel is larger than the padded input",
                &shape,
            ));
        }
        Ok((padded - extent) / stride[axis] + 1)
    };
    let (oh, ow) = (out_dim(h, kh, 0)?, out_dim(w, kw, 1)?);
    length(OP, "x", x.len(), product(OP, &x_shape, &shape)?, &shape)?;
    let (weight, products, prepacked) = match src {
        ConvWeight::Plain(weight, products) => {
            length(
                OP,
                "weight",
                weight.len(),
                product(OP, &w_shape, &shape)?,
                &shape,
            )?;
            (weight, products, None)
        }
        // Packed and checked by pack_conv_weight; the f32 path is not taken.
        ConvWeight::Packed(groups) => (&[][..], Products::Bf16, Some(groups)),
    };
    if let Some(bias) = bias {
        length(OP, "bias", bias.len(), o, &shape)?;
    }
    length(
        OP,
        "out",
        out.len(),
        product(OP, &[n, o, oh, ow], &shape)?,
        &shape,
    )?;

    let og = o / groups;
    let p = oh * ow;
    let kk = cg * kh * kw;
    let plane = h * w;
    if og * p == 0 || n == 0 {
        return Ok(());
    }
    let jobs = n * groups;
    let threads = rayon::current_num_threads();
    let weight_of = |g: usize| Operand {
        data: weight,
        offset: g * og * kk,
        rs: kk,
        cs: 1,
    };

    // On AMX the weight is packed (once per call unless the caller packed
    // it for good), shared by every tile.
    let owned;
    let packed: Option<&[amx::PackedA]> = match prepacked {
        Some(p) => Some(p),
        None if products.uses_amx(og, p, kk) => {
            owned = pack_conv_weight(weight, w_shape, groups)?;
            Some(&owned.per_group)
        }
        None => None,
    };
    let amx_err = amx_error(OP, &shape);

    if kh == 1 && kw == 1 && stride == [1, 1] && padding == [0, 0] {
        if let Some(packed) = packed {
            // Pointwise on tiles: pack each image's input once, then bands
            // of output channels (whole 32-row blocks) in parallel.
            let mut input = amx::PackedB::empty();
            for (j, dst) in out.chunks_mut(og * p).enumerate() {
                let (b, g) = (j / groups, j % groups);
                let src = amx::Src {
                    data: x,
                    offset: (b * c + g * cg) * plane,
                    rs: plane,
                    cs: 1,
                };
                input.repack(src, cg, p, true);
                let a = &packed[g];
                let band = amx_band(og) / amx::BLOCK;
                dst.par_chunks_mut(band * amx::BLOCK * p)
                    .enumerate()
                    .try_for_each(|(t, d)| {
                        let accumulate = fill_bias(d, bias, g * og + t * band * amx::BLOCK, p);
                        let blocks = t * band..((t + 1) * band).min(a.blocks());
                        amx::gemm(amx::Lhs::Packed(a, blocks), &input, d, p, accumulate, 1.0)
                            .map_err(&amx_err)
                    })?;
            }
            return Ok(());
        }
        // Pointwise: the group's input [cg, h*w] already is the im2col matrix,
        // and each job's output [og, h*w] is one contiguous block.
        let outer = jobs >= 2 * threads;
        return out
            .par_chunks_mut(og * p)
            .enumerate()
            .try_for_each(|(j, dst)| {
                let (b, g) = (j / groups, j % groups);
                let accumulate = fill_bias(dst, bias, g * og, p);
                let input = Operand {
                    data: x,
                    offset: (b * c + g * cg) * plane,
                    rs: plane,
                    cs: 1,
                };
                gemm_auto(
                    OP,
                    og,
                    p,
                    cg,
                    dst,
                    accumulate,
                    weight_of(g),
                    input,
                    1.0,
                    outer,
                )
            });
    }

    let geom = ConvGeom {
        h,
        w,
        kh,
        kw,
        ow,
        stride,
        padding,
        dilation,
    };
    // Enough tiles for every thread to get several (load balance), each wide
    // enough for an efficient gemm, with the im2col buffer within budget.
    let tiles_per_job = (4 * threads).div_ceil(jobs).max(1);
    let budget_cols = (COL_BUDGET / kk.max(1)).max(MIN_TILE_COLS);
    let tile = p
        .div_ceil(tiles_per_job)
        .max(MIN_TILE_COLS)
        .min(budget_cols);
    // A multiple of gemm's widest AVX-512 micro-kernel (64 columns of the
    // output, which it computes transposed) leaves no ragged edge blocks.
    let tile = if tile > TILE_ALIGN {
        tile / TILE_ALIGN * TILE_ALIGN
    } else {
        tile
    }
    .min(p);

    let mut tiles = Vec::with_capacity(jobs * p.div_ceil(tile));
    for (job, job_out) in out.chunks_mut(og * p).enumerate() {
        let first = tiles.len();
        for p0 in (0..p).step_by(tile) {
            tiles.push(ConvTile {
                job,
                p0,
                cols: tile.min(p - p0),
                rows: Vec::with_capacity(og),
            });
        }
        for row in job_out.chunks_mut(p) {
            for (t, seg) in row.chunks_mut(tile).enumerate() {
                tiles[first + t].rows.push(seg);
            }
        }
    }
    // With fewer tiles than threads, each tile's im2col and gemm go parallel.
    let outer = tiles.len() >= threads;
    tiles.into_par_iter().try_for_each_init(
        || (Vec::new(), Vec::new(), amx::PackedB::empty()),
        |(col, prod, packed_col): &mut (Vec<f32>, Vec<f32>, amx::PackedB), tile| {
            let (b, g) = (tile.job / groups, tile.job % groups);
            let cols = tile.cols;
            prod.resize(og * cols, 0.0);
            let xg = &x[(b * c + g * cg) * plane..(b * c + (g + 1) * cg) * plane];
            let prod = &mut prod[..og * cols];
            if let Some(packed) = &packed {
                // im2col rows straight into tile order, two at a time.
                packed_col.repack_rows(kk, cols, |r, dst| geom.im2col_row(xg, r, tile.p0, dst));
                let a = &packed[g];
                amx::gemm(
                    amx::Lhs::Packed(a, 0..a.blocks()),
                    packed_col,
                    prod,
                    cols,
                    false,
                    1.0,
                )
                .map_err(&amx_err)?;
            } else {
                col.resize(kk * cols, 0.0);
                geom.im2col(xg, tile.p0, cols, &mut col[..kk * cols], !outer);
                let patches = Operand {
                    data: &col[..kk * cols],
                    offset: 0,
                    rs: cols,
                    cs: 1,
                };
                gemm_auto(
                    OP,
                    og,
                    cols,
                    kk,
                    prod,
                    false,
                    weight_of(g),
                    patches,
                    1.0,
                    outer,
                )?;
            }
            for (r, (seg, src)) in tile.rows.into_iter().zip(prod.chunks(cols)).enumerate() {
                match bias {
                    Some(bias) => {
                        let bv = bias[g * og + r];
                        seg.iter_mut().zip(src).for_each(|(d, s)| *d = s + bv);
                    }
                    None => seg.copy_from_slice(src),
                }
            }
            Ok(())
        },
    )
}

/// Fills each `cols`-long row `r` of `dst` with `bias[first + r]`; returns
/// whether it did (and so whether a following gemm must accumulate).
fn fill_bias(dst: &mut [f32], bias: Option<&[f32]>, first: usize, cols: usize) -> bool {
    match bias {
        Some(bias) => {
            for (row, &bv) in dst.chunks_mut(cols).zip(&bias[first..]) {
                row.fill(bv);
            }
            true
        }
        None => false,
    }
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

/// Query rows per attention task.
const ATTN_QB: usize = 64;
/// Keys per online-softmax step: the score block is `ATTN_QB × ATTN_KB`
/// floats (128 KiB), small enough to stay in L2 between its two gemms.
const ATTN_KB: usize = 512;

/// Scaled dot-product attention, `softmax(q·kᵀ·scale + mask)·v` per head.
///
/// * `q`: `[bh, sq, d]`, `k`: `[bh, skv, d]`, `v`: `[bh, skv, dv]`.
/// * `mask`: additive, `[sq, skv]`, shared by every head (`-inf` hides a key).
/// * `out`: `[bh, sq, dv]`.
///
/// Never holds a full `sq × skv` score matrix: each task takes up to 64 query
/// rows of one head and walks the keys in blocks of 512 with an online
/// softmax (a running row max and sum, rescaling the partial output when the
/// max grows). A row whose keys are all masked gives NaN, as the plain
/// softmax would; `skv == 0` gives zeros, as PyTorch does.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    bh: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    scale: f32,
    out: &mut [f32],
    products: Products,
) -> Result {
    const OP: &str = "attention";
    let shape = || format!("bh={bh} sq={sq} skv={skv} d={d} dv={dv}");
    length(OP, "q", q.len(), product(OP, &[bh, sq, d], &shape)?, &shape)?;
    length(
        OP,
        "k",
        k.len(),
        product(OP, &[bh, skv, d], &shape)?,
        &shape,
    )?;
    length(
        OP,
        "v",
        v.len(),
        product(OP, &[bh, skv, dv], &shape)?,
        &shape,
    )?;
    if let Some(mask) = mask {
        length(
            OP,
            "mask",
            mask.len(),
            product(OP, &[sq, skv], &shape)?,
            &shape,
        )?;
    }
    length(
        OP,
        "out",
        out.len(),
        product(OP, &[bh, sq, dv], &shape)?,
        &shape,
    )?;
    if out.is_empty() {
        return Ok(());
    }
    if skv == 0 {
        out.fill(0.0);
        return Ok(());
    }

    // One task per (head, query block); each owns its rows of `out`, which
    // double as the running (unnormalized) output.
    let tasks: Vec<(usize, usize, &mut [f32])> = out
        .chunks_mut(sq * dv)
        .enumerate()
        .flat_map(|(head, o)| {
            o.chunks_mut(ATTN_QB * dv)
                .enumerate()
                .map(move |(i, block)| (head, i * ATTN_QB, block))
        })
        .collect();
    let kb_max = ATTN_KB.min(skv);
    let arch = pulp::Arch::new();
    if products.attention_uses_amx(sq, skv, d) {
        return attention_amx(q, k, v, mask, (bh, sq, skv, d, dv), scale, tasks);
    }
    tasks.into_par_iter().try_for_each_init(
        || OnlineSoftmax {
            scores: vec![0.0; ATTN_QB * kb_max],
            row_max: [0.0; ATTN_QB],
            row_sum: [0.0; ATTN_QB],
        },
        |state, (head, q0, acc)| {
            let rows = acc.len() / dv;
            acc.fill(0.0);
            state.row_max[..rows].fill(f32::NEG_INFINITY);
            state.row_sum[..rows].fill(0.0);
            let queries = Operand {
                data: q,
                offset: (head * sq + q0) * d,
                rs: d,
                cs: 1,
            };
            for j0 in (0..skv).step_by(kb_max) {
                let kb = kb_max.min(skv - j0);
                let s = &mut state.scores[..rows * kb];
                // kᵀ block: element (p, j) is k[head, j0 + j, p].
                let keys_t = Operand {
                    data: k,
                    offset: (head * skv + j0) * d,
                    rs: 1,
                    cs: d,
                };
                gemm_into(
                    OP,
                    rows,
                    kb,
                    d,
                    s,
                    0,
                    kb,
                    false,
                    queries,
                    keys_t,
                    scale,
                    Parallelism::None,
                )?;
                let mask_block = mask.map(|m| (m, q0 * skv + j0, skv));
                let (row_max, row_sum) = (&mut state.row_max[..rows], &mut state.row_sum[..rows]);
                arch.dispatch(SoftmaxStep {
                    s,
                    kb,
                    mask: mask_block,
                    row_max,
                    row_sum,
                    acc,
                    dv,
                });
                let values = Operand {
                    data: v,
                    offset: (head * skv + j0) * dv,
                    rs: dv,
                    cs: 1,
                };
                let weights = Operand {
                    data: s,
                    offset: 0,
                    rs: kb,
                    cs: 1,
                };
                gemm_into(
                    OP,
                    rows,
                    dv,
                    kb,
                    acc,
                    0,
                    dv,
                    true,
                    weights,
                    values,
                    1.0,
                    Parallelism::None,
                )?;
            }
            for (arow, &l) in acc.chunks_mut(dv).zip(state.row_sum.iter()) {
                let inv = 1.0 / l;
                arow.iter_mut().for_each(|a| *a *= inv);
            }
            Ok(())
        },
    )
}

/// [`attention`] on AMX tiles: the same blocked online softmax, with both
/// products in bf16. Keys and values are packed once per (head, key
/// block) up front, shared by every query block of the head.
fn attention_amx(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    (bh, sq, skv, d, dv): (usize, usize, usize, usize, usize),
    scale: f32,
    tasks: Vec<(usize, usize, &mut [f32])>,
) -> Result {
    use amx::{gemm, Lhs, PackedA, PackedB, Src};
    const OP: &str = "attention";
    let shape = || format!("bh={bh} sq={sq} skv={skv} d={d} dv={dv}");
    let err = amx_error(OP, &shape);
    let kb_max = ATTN_KB.min(skv);
    let per_head = skv.div_ceil(kb_max);
    // Block (head, j) of keys as B = kᵀ ([d, kb]) and of values ([kb, dv]).
    let packed: Vec<(PackedB, PackedB)> = (0..bh * per_head)
        .into_par_iter()
        .map(|i| {
            let (head, j0) = (i / per_head, (i % per_head) * kb_max);
            let kb = kb_max.min(skv - j0);
            let keys = Src {
                data: k,
                offset: (head * skv + j0) * d,
                rs: 1,
                cs: d,
            };
            let values = Src {
                data: v,
                offset: (head * skv + j0) * dv,
                rs: dv,
                cs: 1,
            };
            (
                PackedB::pack(keys, d, kb, false),
                PackedB::pack(values, kb, dv, false),
            )
        })
        .collect();
    tasks.into_par_iter().try_for_each_init(
        || {
            let state = OnlineSoftmax {
                scores: vec![0.0; ATTN_QB * kb_max],
                row_max: [0.0; ATTN_QB],
                row_sum: [0.0; ATTN_QB],
            };
            (state, PackedA::empty())
        },
        |(state, p), (head, q0, acc)| {
            let rows = acc.len() / dv;
            acc.fill(0.0);
            state.row_max[..rows].fill(f32::NEG_INFINITY);
            state.row_sum[..rows].fill(0.0);
            let queries = Src {
                data: q,
                offset: (head * sq + q0) * d,
                rs: d,
                cs: 1,
            };
            let qa = PackedA::pack(queries, rows, d, false);
            for (jb, (keys, values)) in packed[head * per_head..(head + 1) * per_head]
                .iter()
                .enumerate()
            {
                let (j0, kb) = (jb * kb_max, keys.cols());
                let s = &mut state.scores[..rows * kb];
                // Raw scores: the scale is folded into the exponentials.
                gemm(Lhs::Packed(&qa, 0..qa.blocks()), keys, s, kb, false, 1.0).map_err(&err)?;
                // The online-softmax step of `online_softmax_step`, its
                // loops in AVX-512 (amx::scaled_max, amx::exp_sum_into), the
                // numerators going straight into bf16 tiles `p`.
                p.reset(rows, kb);
                for (i, srow) in s.chunks_mut(kb).enumerate() {
                    let mrow = mask.map(|m| &m[(q0 + i) * skv + j0..][..kb]);
                    let (max, row_scale) = amx::scaled_max(srow, scale, mrow);
                    let new_max = state.row_max[i].max(max);
                    if new_max == f32::NEG_INFINITY {
                        continue; // every key so far is masked: p's row stays 0
                    }
                    let rescale = exp_approx(state.row_max[i] - new_max);
                    let sum = amx::exp_sum_into(srow, row_scale, new_max, p, i);
                    state.row_sum[i] = state.row_sum[i] * rescale + sum;
                    state.row_max[i] = new_max;
                    if rescale != 1.0 {
                        acc[i * dv..(i + 1) * dv]
                            .iter_mut()
                            .for_each(|a| *a *= rescale);
                    }
                }
                gemm(Lhs::Packed(p, 0..p.blocks()), values, acc, dv, true, 1.0).map_err(&err)?;
            }
            for (arow, &l) in acc.chunks_mut(dv).zip(state.row_sum.iter()) {
                let inv = 1.0 / l;
                arow.iter_mut().for_each(|a| *a *= inv);
            }
            Ok(())
        },
    )
}

/// Per-thread scratch of [`attention`].
struct OnlineSoftmax {
    /// One block of scores, then of softmax numerators: `[rows, kb]`.
    scores: Vec<f32>,
    /// Running max of each query row's scores so far.
    row_max: [f32; ATTN_QB],
    /// Running Σ e^(score - row_max) of each query row.
    row_sum: [f32; ATTN_QB],
}

/// One online-softmax step over a `[rows, kb]` block of scores `s`: adds the
/// mask (`(mask, start, stride)`: row `i` of the block is
/// `mask[start + i*stride..][..kb]`), raises each row's running max, turns
/// the scores into `e^(score - max)`, and rescales the running sums and the
/// partial outputs `acc` (`[rows, dv]`) by `e^(old max - new max)`.
///
/// Run through [`pulp::Arch::dispatch`] so its loops are compiled for
/// AVX-512 or AVX2 when the CPU has them: the exponentials are a large share
/// of attention's time, and the x86-64 baseline only has 4-wide SSE. (A
/// struct rather than a closure, because only a `#[inline(always)]` method
/// is reliably inlined into the dispatcher's target-feature function.)
struct SoftmaxStep<'a> {
    s: &'a mut [f32],
    kb: usize,
    mask: Option<(&'a [f32], usize, usize)>,
    row_max: &'a mut [f32],
    row_sum: &'a mut [f32],
    acc: &'a mut [f32],
    dv: usize,
}

impl pulp::WithSimd for SoftmaxStep<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        let SoftmaxStep {
            s,
            kb,
            mask,
            row_max,
            row_sum,
            acc,
            dv,
        } = self;
        online_softmax_step(s, kb, mask, row_max, row_sum, acc, dv);
    }
}

#[inline(always)]
fn online_softmax_step(
    s: &mut [f32],
    kb: usize,
    mask: Option<(&[f32], usize, usize)>,
    row_max: &mut [f32],
    row_sum: &mut [f32],
    acc: &mut [f32],
    dv: usize,
) {
    for (i, srow) in s.chunks_mut(kb).enumerate() {
        if let Some((mask, start, stride)) = mask {
            let mrow = &mask[start + i * stride..][..kb];
            srow.iter_mut().zip(mrow).for_each(|(s, m)| *s += m);
        }
        let new_max = row_max[i].max(max_f32(srow));
        if new_max == f32::NEG_INFINITY {
            // Every key so far is masked: they weigh nothing, and
            // e^(-inf - -inf) would be NaN.
            srow.fill(0.0);
            continue;
        }
        let rescale = exp_approx(row_max[i] - new_max);
        row_sum[i] = row_sum[i] * rescale + exp_shifted_sum(srow, new_max);
        row_max[i] = new_max;
        if rescale != 1.0 {
            acc[i * dv..(i + 1) * dv]
                .iter_mut()
                .for_each(|a| *a *= rescale);
        }
    }
}

// ---------------------------------------------------------------------------
// Reductions and exp
// ---------------------------------------------------------------------------

/// Independent accumulators per reduction: floating-point sums may not be
/// reordered by the compiler, so splitting them by hand is what lets it use
/// SIMD lanes.
const LANES: usize = 16;

#[inline(always)]
fn max_f32(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for c in chunks {
        acc.iter_mut().zip(c).for_each(|(a, &v)| *a = a.max(v));
    }
    acc.iter().fold(tail, |m, &v| m.max(v))
}

/// `x[i] = e^(x[i] - shift)` in place; returns Σ of the new values.
#[inline(always)]
fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        c.iter_mut().zip(acc.iter_mut()).for_each(|(v, a)| {
            *v = exp_approx(*v - shift);
            *a += *v;
        });
    }
    let mut tail = 0.0;
    for v in chunks.into_remainder() {
        *v = exp_approx(*v - shift);
        tail += *v;
    }
    acc.iter().sum::<f32>() + tail
}

/// Σx in f64, so sums over millions of elements keep f32 precision.
#[inline(always)]
fn sum_f64(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(v)).sum();
    for c in chunks {
        acc.iter_mut().zip(c).for_each(|(a, &v)| *a += f64::from(v));
    }
    acc.iter().sum::<f64>() + tail
}

/// Σ(x - mean)² in f64: the second pass of a two-pass variance, which unlike
/// E[x²] - E[x]² does not cancel catastrophically when |mean| ≫ std.
#[inline(always)]
fn sum_sq_dev_f64(x: &[f32], mean: f64) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum();
    for c in chunks {
        acc.iter_mut().zip(c).for_each(|(a, &v)| {
            let dv = f64::from(v) - mean;
            *a += dv * dv;
        });
    }
    acc.iter().sum::<f64>() + tail
}

/// `e^x` in f32, within about 2 ulp of the exact value for x in [-86, 88].
/// Below -86 (including -inf) it returns 0, above 88 it saturates near
/// 1.6e38, and NaN stays NaN. Branch-free so loops over it vectorize, which
/// libm's `expf` calls do not; softmax spends most of its time here.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so n*LN2_HI is exact for the n that occur.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2^23 rounds to the nearest integer and leaves it in the low
    // mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    let xc = x.clamp(-86.0, 88.0);
    let t = xc * LOG2E + SHIFTER;
    let n = t - SHIFTER;
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Minimax polynomial for e^r on |r| <= ln2/2 (Cephes' coefficients).
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // 2^n built directly in the exponent field; n is in [-125, 127] here.
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let pow2 = f32::from_bits(((ni + 127) as u32) << 23);
    if x < -86.0 {
        0.0
    } else {
        er * pow2
    }
}

// ---------------------------------------------------------------------------
// Softmax and normalizations
// ---------------------------------------------------------------------------

/// Softmax over each row of `x`, `[rows, cols]` → `out` `[rows, cols]`:
/// `out[r, j] = e^(x[r, j] - max_r) / Σ_j e^(x[r, j] - max_r)`.
/// Subtracting the row max keeps every exponent ≤ 0, so nothing overflows; a
/// row of all `-inf` gives NaN, as in PyTorch.
pub fn softmax_rows(x: &[f32], rows: usize, cols: usize, out: &mut [f32]) -> Result {
    const OP: &str = "softmax_rows";
    let shape = || format!("rows={rows} cols={cols}");
    let total = product(OP, &[rows, cols], &shape)?;
    length(OP, "x", x.len(), total, &shape)?;
    length(OP, "out", out.len(), total, &shape)?;
    if total == 0 {
        return Ok(());
    }
    let arch = pulp::Arch::new();
    let piece = rows_per_piece(cols) * cols;
    out.par_chunks_mut(piece)
        .zip(x.par_chunks(piece))
        .for_each(|(out, x)| arch.dispatch(SoftmaxPiece { x, out, cols }));
    Ok(())
}

/// [`softmax_rows`] over whole rows, for a SIMD dispatch (see [`SoftmaxStep`]).
struct SoftmaxPiece<'a> {
    x: &'a [f32],
    out: &'a mut [f32],
    cols: usize,
}

impl pulp::WithSimd for SoftmaxPiece<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        softmax_piece(self.x, self.out, self.cols);
    }
}

#[inline(always)]
fn softmax_piece(x: &[f32], out: &mut [f32], cols: usize) {
    for (orow, xrow) in out.chunks_mut(cols).zip(x.chunks(cols)) {
        let max = max_f32(xrow);
        orow.copy_from_slice(xrow);
        let inv = 1.0 / exp_shifted_sum(orow, max);
        orow.iter_mut().for_each(|o| *o *= inv);
    }
}

fn check_affine(
    op: &'static str,
    name: &'static str,
    p: Option<&[f32]>,
    needed: usize,
    shape: &dyn Fn() -> String,
) -> Result {
    match p {
        Some(p) => length(op, name, p.len(), needed, shape),
        None => Ok(()),
    }
}

/// Statistics of one normalized slice.
#[derive(Clone, Copy)]
struct Moments {
    /// The mean rounded to f32 ...
    mean_hi: f32,
    /// ... and what that rounding lost. `(v - mean_hi) - mean_lo` is then
    /// accurate even when |mean| ≫ std, where `v - mean as f32` would carry
    /// the mean's rounding error (ulp(mean)/2) into every output.
    mean_lo: f32,
    /// 1 / sqrt(var + eps).
    rstd: f32,
}

/// Mean and 1/sqrt(var + eps) of `x`, with the biased variance (divided by
/// the count, as PyTorch's normalizations use), in two f64 passes, compiled
/// for the CPU's widest SIMD (f64 lanes are narrow on the SSE2 baseline).
fn moments(x: &[f32], eps: f32) -> Moments {
    pulp::Arch::new().dispatch(MomentsOp { x, eps })
}

/// [`moments`] for a SIMD dispatch (see [`SoftmaxStep`] on why a struct).
struct MomentsOp<'a> {
    x: &'a [f32],
    eps: f32,
}

impl pulp::WithSimd for MomentsOp<'_> {
    type Output = Moments;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) -> Moments {
        let count = self.x.len() as f64;
        let mean = sum_f64(self.x) / count;
        let var = sum_sq_dev_f64(self.x, mean) / count;
        let mean_hi = mean as f32;
        Moments {
            mean_hi,
            mean_lo: (mean - f64::from(mean_hi)) as f32,
            rstd: (1.0 / (var + f64::from(self.eps)).sqrt()) as f32,
        }
    }
}

/// mean(x²) in f64, SIMD-dispatched like [`moments`].
fn mean_square(x: &[f32]) -> f64 {
    pulp::Arch::new().dispatch(MeanSquareOp { x })
}

struct MeanSquareOp<'a> {
    x: &'a [f32],
}

impl pulp::WithSimd for MeanSquareOp<'_> {
    type Output = f64;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) -> f64 {
        sum_sq_dev_f64(self.x, 0.0) / self.x.len() as f64
    }
}

/// Layer normalization over the last `cols` of `x` (`[rows, cols]`):
/// `out = (x - mean) / sqrt(var + eps) * weight + bias`, var biased;
/// `weight` and `bias` are `[cols]`, absent meaning 1 and 0.
pub fn layer_norm(
    x: &[f32],
    rows: usize,
    cols: usize,
    eps: f32,
    weight: Option<&[f32]>,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result {
    const OP: &str = "layer_norm";
    let shape = || format!("rows={rows} cols={cols}");
    let total = product(OP, &[rows, cols], &shape)?;
    length(OP, "x", x.len(), total, &shape)?;
    length(OP, "out", out.len(), total, &shape)?;
    check_affine(OP, "weight", weight, cols, &shape)?;
    check_affine(OP, "bias", bias, cols, &shape)?;
    if total == 0 {
        return Ok(());
    }
    out.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .with_min_len(rows_per_piece(cols))
        .for_each(|(orow, xrow)| {
            let Moments {
                mean_hi,
                mean_lo,
                rstd,
            } = moments(xrow, eps);
            orow.iter_mut()
                .zip(xrow)
                .for_each(|(o, &v)| *o = ((v - mean_hi) - mean_lo) * rstd);
            if let Some(w) = weight {
                orow.iter_mut().zip(w).for_each(|(o, &w)| *o *= w);
            }
            if let Some(b) = bias {
                orow.iter_mut().zip(b).for_each(|(o, &b)| *o += b);
            }
        });
    Ok(())
}

/// RMS normalization over the last `cols` of `x` (`[rows, cols]`):
/// `out = x / sqrt(mean(x²) + eps) * weight`, `weight` `[cols]` or 1.
pub fn rms_norm(
    x: &[f32],
    rows: usize,
    cols: usize,
    eps: f32,
    weight: Option<&[f32]>,
    out: &mut [f32],
) -> Result {
    const OP: &str = "rms_norm";
    let shape = || format!("rows={rows} cols={cols}");
    let total = product(OP, &[rows, cols], &shape)?;
    length(OP, "x", x.len(), total, &shape)?;
    length(OP, "out", out.len(), total, &shape)?;
    check_affine(OP, "weight", weight, cols, &shape)?;
    if total == 0 {
        return Ok(());
    }
    out.par_chunks_mut(cols)
        .zip(x.par_chunks(cols))
        .with_min_len(rows_per_piece(cols))
        .for_each(|(orow, xrow)| {
            let ms = mean_square(xrow);
            let rrms = (1.0 / (ms + f64::from(eps)).sqrt()) as f32;
            match weight {
                Some(w) => orow
                    .iter_mut()
                    .zip(xrow.iter().zip(w))
                    .for_each(|(o, (&v, &w))| *o = v * rrms * w),
                None => orow.iter_mut().zip(xrow).for_each(|(o, &v)| *o = v * rrms),
            }
        });
    Ok(())
}

/// Group normalization (`torch.nn.functional.group_norm`): `x` is
/// `[n, c, spatial]` (NCHW with H·W flattened); the `c / groups` channels of
/// each group are normalized together over all their spatial positions,
/// `out = (x - mean) / sqrt(var + eps) * weight[ch] + bias[ch]`, var biased;
/// `weight` and `bias` are per channel, `[c]`.
#[allow(clippy::too_many_arguments)]
pub fn group_norm(
    x: &[f32],
    n: usize,
    c: usize,
    spatial: usize,
    groups: usize,
    eps: f32,
    weight: Option<&[f32]>,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result {
    const OP: &str = "group_norm";
    let shape = || format!("n={n} c={c} spatial={spatial} groups={groups}");
    if groups == 0 || !c.is_multiple_of(groups) {
        return Err(invalid(OP, "groups must be positive and divide c", &shape));
    }
    let total = product(OP, &[n, c, spatial], &shape)?;
    length(OP, "x", x.len(), total, &shape)?;
    length(OP, "out", out.len(), total, &shape)?;
    check_affine(OP, "weight", weight, c, &shape)?;
    check_affine(OP, "bias", bias, c, &shape)?;
    let cg = c / groups;
    let group_len = cg * spatial;
    if total == 0 {
        return Ok(());
    }
    // One task per (image, group); channels of a group are contiguous.
    out.par_chunks_mut(group_len)
        .zip(x.par_chunks(group_len))
        .enumerate()
        .for_each(|(j, (og, xg))| {
            let Moments {
                mean_hi,
                mean_lo,
                rstd,
            } = moments(xg, eps);
            let ch0 = (j % groups) * cg;
            for (ci, (orow, xrow)) in og.chunks_mut(spatial).zip(xg.chunks(spatial)).enumerate() {
                let w = weight.map_or(1.0, |w| w[ch0 + ci]) * rstd;
                let b = bias.map_or(0.0, |b| b[ch0 + ci]);
                orow.iter_mut()
                    .zip(xrow)
                    .for_each(|(o, &v)| *o = ((v - mean_hi) - mean_lo) * w + b);
            }
        });
    Ok(())
}

// ---------------------------------------------------------------------------
// Resampling
// ---------------------------------------------------------------------------

fn check_resample(
    op: &'static str,
    x: &[f32],
    x_shape: [usize; 4],
    oh: usize,
    ow: usize,
    out: &[f32],
) -> Result<bool> {
    let [n, c, h, w] = x_shape;
    let shape = || format!("x={x_shape:?} out=[{oh}, {ow}]");
    length(op, "x", x.len(), product(op, &x_shape, &shape)?, &shape)?;
    length(
        op,
        "out",
        out.len(),
        product(op, &[n, c, oh, ow], &shape)?,
        &shape,
    )?;
    if (h == 0 || w == 0) && oh * ow * n * c != 0 {
        return Err(invalid(
            op,
            "cannot resample an empty image to a non-empty one",
            &shape,
        ));
    }
    Ok(out.is_empty())
}

/// PyTorch's `nearest` source index: `min(floor(dst * (in / out)), in - 1)`,
/// with the ratio and product in f32 as PyTorch computes them (which decides
/// the rounding at exact boundaries).
fn nearest_index(dst: usize, input: usize, output: usize) -> usize {
    if output == input {
        dst
    } else if output == 2 * input {
        dst >> 1
    } else {
        let scale = input as f32 / output as f32;
        ((dst as f32 * scale).floor() as usize).min(input - 1)
    }
}

/// Nearest-neighbour resize of `x` `[n, c, h, w]` to `out` `[n, c, oh, ow]`
/// with `torch.nn.functional.interpolate(mode="nearest")` semantics:
/// `src = min(floor(dst * in / out), in - 1)` per axis.
pub fn upsample_nearest2d(
    x: &[f32],
    x_shape: [usize; 4],
    oh: usize,
    ow: usize,
    out: &mut [f32],
) -> Result {
    if check_resample("upsample_nearest2d", x, x_shape, oh, ow, out)? {
        return Ok(());
    }
    let [_, _, h, w] = x_shape;
    let sy: Vec<usize> = (0..oh).map(|i| nearest_index(i, h, oh)).collect();
    let sx: Vec<usize> = (0..ow).map(|i| nearest_index(i, w, ow)).collect();
    out.par_chunks_mut(oh * ow)
        .zip(x.par_chunks(h * w))
        .with_min_len(rows_per_piece(oh * ow))
        .for_each(|(op, xp)| {
            for (orow, &y) in op.chunks_mut(ow).zip(&sy) {
                let xrow = &xp[y * w..(y + 1) * w];
                orow.iter_mut().zip(&sx).for_each(|(o, &xi)| *o = xrow[xi]);
            }
        });
    Ok(())
}

/// Source taps of one output coordinate of a linear resize.
#[derive(Clone, Copy, Debug)]
struct LinearTap {
    i0: usize,
    i1: usize,
    w0: f32,
    w1: f32,
}

/// PyTorch's bilinear source coordinate and weights for one axis, in f32 as
/// PyTorch computes them for f32 tensors.
fn linear_taps(input: usize, output: usize, align_corners: bool) -> Vec<LinearTap> {
    let scale = if align_corners {
        if output > 1 {
            (input - 1) as f32 / (output - 1) as f32
        } else {
            0.0
        }
    } else {
        input as f32 / output as f32
    };
    (0..output)
        .map(|dst| {
            if input == output {
                return LinearTap {
                    i0: dst,
                    i1: dst,
                    w0: 1.0,
                    w1: 0.0,
                };
            }
            let src = if align_corners {
                scale * dst as f32
            } else {
                (scale * (dst as f32 + 0.5) - 0.5).max(0.0)
            };
            let i0 = (src.floor() as usize).min(input - 1);
            let w1 = (src - i0 as f32).clamp(0.0, 1.0);
            let i1 = if i0 < input - 1 { i0 + 1 } else { i0 };
            LinearTap {
                i0,
                i1,
                w0: 1.0 - w1,
                w1,
            }
        })
        .collect()
}

/// Bilinear resize of `x` `[n, c, h, w]` to `out` `[n, c, oh, ow]` with
/// `torch.nn.functional.interpolate(mode="bilinear", align_corners=...)`
/// semantics: with `align_corners` the corner pixels' centres map onto each
/// other (`src = dst * (in - 1) / (out - 1)`); without, pixel areas do
/// (`src = max((dst + 0.5) * in / out - 0.5, 0)`). Edges clamp.
pub fn upsample_bilinear2d(
    x: &[f32],
    x_shape: [usize; 4],
    oh: usize,
    ow: usize,
    align_corners: bool,
    out: &mut [f32],
) -> Result {
    if check_resample("upsample_bilinear2d", x, x_shape, oh, ow, out)? {
        return Ok(());
    }
    let [_, _, h, w] = x_shape;
    let ty = linear_taps(h, oh, align_corners);
    let tx = linear_taps(w, ow, align_corners);
    out.par_chunks_mut(oh * ow)
        .zip(x.par_chunks(h * w))
        .with_min_len(rows_per_piece(oh * ow))
        .for_each(|(op, xp)| {
            for (orow, y) in op.chunks_mut(ow).zip(&ty) {
                let r0 = &xp[y.i0 * w..(y.i0 + 1) * w];
                let r1 = &xp[y.i1 * w..(y.i1 + 1) * w];
                for (o, t) in orow.iter_mut().zip(&tx) {
                    let top = t.w0 * r0[t.i0] + t.w1 * r0[t.i1];
                    let bottom = t.w0 * r1[t.i0] + t.w1 * r1[t.i1];
                    *o = y.w0 * top + y.w1 * bottom;
                }
            }
        });
    Ok(())
}

// ---------------------------------------------------------------------------
// Half-precision conversion
// ---------------------------------------------------------------------------

/// Conversions split into pieces of this many elements across threads.
const CONVERT_PIECE: usize = 1 << 16;

// The per-value conversions are `crate::weights`'s, where the dtypes
// live; these are the parallel slice forms.

// Generic over the converter (not a fn pointer) so it inlines and the loop
// vectorizes.
fn convert(
    op: &'static str,
    src: &[u16],
    dst: &mut [f32],
    f: impl Fn(u16) -> f32 + Sync,
) -> Result {
    length(op, "dst", dst.len(), src.len(), &|| {
        format!("src.len()={}", src.len())
    })?;
    let run = |d: &mut [f32], s: &[u16]| d.iter_mut().zip(s).for_each(|(d, &s)| *d = f(s));
    if src.len() < 4 * CONVERT_PIECE {
        run(dst, src);
    } else {
        dst.par_chunks_mut(CONVERT_PIECE)
            .zip(src.par_chunks(CONVERT_PIECE))
            .for_each(|(d, s)| run(d, s));
    }
    Ok(())
}

/// Converts IEEE half-precision values (given as their bit patterns, e.g. a
/// safetensors F16 buffer read as little-endian `u16`s) to f32, exactly.
/// `dst.len()` must equal `src.len()`.
pub fn f16_to_f32(src: &[u16], dst: &mut [f32]) -> Result {
    convert("f16_to_f32", src, dst, crate::weights::f16_to_f32)
}

/// Converts bfloat16 values (as bit patterns) to f32, exactly.
/// `dst.len()` must equal `src.len()`.
pub fn bf16_to_f32(src: &[u16], dst: &mut [f32]) -> Result {
    convert("bf16_to_f32", src, dst, crate::weights::bf16_to_f32)
}
