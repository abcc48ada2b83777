//! CPU kernels: pure functions over flat slices, in f32, with bf16
//! products on AMX tiles where asked ([`Products`]). Convolution,
//! attention and resampling have their own files.
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
use gemm_common::Parallelism;
use rayon::prelude::*;

mod attention;
mod conv;
mod resample;
mod rows;

pub use attention::attention;
pub use conv::{conv2d, conv2d_packed, pack_conv_weight, PackedConvWeight};
pub use resample::{upsample_bilinear2d, upsample_nearest2d};
pub use rows::{matmul_rows, DecodeRows};

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
        self.uses_amx(attention::ATTN_QB.min(sq), attention::ATTN_KB.min(skv), d)
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
    //
    // The kernels prefer a column-major destination: a row-major one is
    // computed as its transpose, `dstᵀ = rhsᵀ · lhsᵀ`, by swapping the
    // operands and every row stride with its column stride (the reordering
    // the `gemm` front crate does, which we do not build).
    let (m, n, dst_cs, dst_rs, a, a_cs, a_rs, b, b_cs, b_rs) = if dst_rs > 1 {
        (n, m, dst_rs, 1, rhs, rhs.rs, rhs.cs, lhs, lhs.rs, lhs.cs)
    } else {
        (m, n, 1, dst_rs, lhs, lhs.cs, lhs.rs, rhs, rhs.cs, rhs.rs)
    };
    unsafe {
        gemm_f32::gemm::f32::get_gemm_fn()(
            m,
            n,
            k,
            dst.as_mut_ptr().add(dst_offset),
            st(dst_cs),
            st(dst_rs),
            accumulate,
            a.data.as_ptr().add(a.offset),
            st(a_cs),
            st(a_rs),
            b.data.as_ptr().add(b.offset),
            st(b_cs),
            st(b_rs),
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

/// The checks every matrix product makes of its A and C: `c` holds
/// `batch·m·n` values and `a`'s view fits `[batch, m, k]`. Returns `m·n`.
fn check_lhs_and_out(
    op: &'static str,
    a: &[f32],
    av: MatView,
    c_len: usize,
    [batch, m, n, k]: [usize; 4],
    shape: &dyn Fn() -> String,
) -> Result<usize> {
    let mn = product(op, &[m, n], shape)?;
    length(op, "c", c_len, product(op, &[batch, mn], shape)?, shape)?;
    check_view(
        op,
        "a",
        a.len(),
        av.offset,
        batch,
        av.batch_stride,
        m,
        av.row_stride,
        k,
        av.col_stride,
        shape,
    )?;
    Ok(mn)
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
    let mn = check_lhs_and_out(OP, a, av, c.len(), [batch, m, n, k], &shape)?;
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
    let mn = check_lhs_and_out(OP, a, av, c.len(), [batch, m, n, k], &shape)?;
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
