//! bf16 matrix products on Intel AMX tiles (Sapphire Rapids and later):
//! bf16 operands, f32 accumulation, as PyTorch's bf16 CPU path.
//!
//! Why this module exists and allows `unsafe`: on the CPUs that have AMX a
//! tile multiply (`tdpbf16ps`) does 16 384 flops, and one core reaches
//! ~3 TFLOP/s against ~0.23 TFLOP/s for AVX-512 f32 FMAs; AVX512-BF16's
//! `vdpbf16ps` issues at half the FMA rate there, so it is no faster than
//! f32. No crate offers AMX on stable Rust (the intrinsics are unstable),
//! so the few instructions are written as inline assembly. Everything
//! unsafe is here and small:
//! * [`available`] asks CPUID and, on Linux, the kernel (which hands out
//!   the 8 KiB of tile state per process only on request);
//! * [`gemm`] runs the tile instructions on buffers this module packed, and
//!   checks every size before the first instruction.
//!
//! Layouts (what the tile loads read, 64 bytes per tile row):
//! * [`PackedA`], the left operand `[m, k]`: tiles of 16 rows × 32 k,
//!   stored `[m/16][k/32][16 rows][32]`.
//! * [`PackedB`], the right operand `[k, n]`: tiles of 16 k-pairs × 16
//!   columns, a row holding `(b[2r, j], b[2r+1, j])` for 16 columns `j`
//!   ("VNNI" order), stored `[n/16][k/32][16][16 × 2]`.
//!
//! Both are zero-padded to whole 32 × 32 blocks, so the kernel has no edge
//! cases; the padding adds zeros to the products and is never written out.

use rayon::prelude::*;
use std::sync::OnceLock;

/// Rows (or k-pairs) per tile.
const TR: usize = 16;
/// bf16 values per 64-byte tile row.
const TK: usize = 32;
/// The kernel computes 32 × 32 blocks of the output: 2 × 2 tiles.
pub const BLOCK: usize = 32;
/// Bytes of one tile in the packed layouts.
const TILE_BYTES: usize = TR * 64;
/// Bytes of packed B worth keeping in L2 while 32-row blocks of A stream
/// past it.
const B_PANEL_BYTES: usize = 1 << 20;
/// Packed A up to this size stays in L1 while B streams past it.
const A_L1_BYTES: usize = 32 << 10;

/// One 64-byte tile row, aligned so tile loads never split cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u16; TK]);

const ZERO_LINE: Line = Line([0; TK]);

/// Whether this CPU (and OS) runs AMX bf16 tile products. Checked once.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 7 exists only when leaf 0 says so; EDX bits 22 and 24 are
    // AMX-BF16 and AMX-TILE.
    #[allow(unused_unsafe)]
    let (max_leaf, edx) = unsafe {
        let max = __cpuid(0).eax;
        (max, if max >= 7 { __cpuid_count(7, 0).edx } else { 0 })
    };
    if max_leaf < 7 || edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
        return false;
    }
    // Linux enables the tile data state per process on request
    // (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without it the
    // first tile instruction faults. A kernel too old to know AMX says no.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with this request only changes which register
    // state the kernel lets this process use; it reads no user memory.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// f32 → bf16, rounding to nearest even, as `torch.Tensor.bfloat16()`;
/// NaN stays NaN.
#[inline(always)]
pub fn bf16(x: f32) -> u16 {
    crate::weights::f32_to_bf16_bits(x)
}

/// bf16 → f32 (exact): the weight loader's conversion.
pub use crate::weights::bf16_to_f32;

/// `dst[i] = bf16(src[i])` for the common length, vectorised where the
/// packing code is (what tests compare against [`bf16`]).
pub fn to_bf16(src: &[f32], dst: &mut [u16]) {
    convert(src, dst)
}

/// `dst[i] = bf16(src[i])`.
#[inline]
fn convert(src: &[f32], dst: &mut [u16]) {
    if vector_ok() {
        // SAFETY: the CPU has AVX-512 F and BW (`vector_ok`).
        unsafe { convert_avx512(src, dst) }
    } else {
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d = bf16(s));
    }
}

/// `dst[2i] = bf16(even[i])`, `dst[2i + 1] = bf16(odd[i])`: two rows of B
/// in VNNI order.
#[inline]
fn interleave(even: &[f32], odd: &[f32], dst: &mut [u16]) {
    if vector_ok() {
        // SAFETY: the CPU has AVX-512 F and BW (`vector_ok`).
        unsafe { interleave_avx512(even, odd, dst) }
    } else {
        for ((d, &e), &o) in dst.chunks_exact_mut(2).zip(even).zip(odd) {
            d[0] = bf16(e);
            d[1] = bf16(o);
        }
    }
}

// The same loops compiled for AVX-512, which the compiler vectorises (the
// baseline x86-64 target has only SSE2). Every AMX CPU has AVX-512; the
// check keeps the module sound if it is ever called without AMX.
fn vector_ok() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// 16 f32 → their bf16 patterns (nearest even, NaN quieted) in the high
/// halves of 32-bit lanes, low halves zero: [`bf16`] on 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn bf16_high(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let b = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let rounded = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
    let quiet = _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    let r = _mm512_mask_blend_epi32(nan, rounded, quiet);
    _mm512_and_si512(r, _mm512_set1_epi32(0xffff_0000_u32 as i32))
}

/// Loads up to 16 f32 (zeros past the end of `x`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn load16(x: &[f32]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let n = x.len().min(16);
    let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
    // SAFETY: the mask limits the load to the first n elements, all in x.
    _mm512_maskz_loadu_ps(mask, x.as_ptr())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn convert_avx512(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    for (s, d) in src.chunks(16).zip(dst.chunks_mut(16)) {
        // The high halves shifted down, narrowed to 16 bits per lane.
        let v = _mm512_srli_epi32::<16>(bf16_high(load16(s)));
        let packed = _mm512_cvtepi32_epi16(v);
        if d.len() == 16 {
            // SAFETY: d holds 16 u16 (32 bytes).
            _mm256_storeu_si256(d.as_mut_ptr().cast(), packed);
        } else {
            let mut buf = [0u16; 16];
            // SAFETY: buf holds 16 u16.
            _mm256_storeu_si256(buf.as_mut_ptr().cast(), packed);
            d.copy_from_slice(&buf[..d.len()]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn interleave_avx512(even: &[f32], odd: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    // As u32 words (little-endian): the even row's bf16 low, the odd high.
    let n = (dst.len() / 2).min(even.len()).min(odd.len());
    for (i, d) in dst[..2 * n].chunks_mut(32).enumerate() {
        let cols = d.len() / 2;
        let (e, o) = (&even[16 * i..][..cols], &odd[16 * i..][..cols]);
        let lo = _mm512_srli_epi32::<16>(bf16_high(load16(e)));
        let words = _mm512_or_si512(lo, bf16_high(load16(o)));
        if cols == 16 {
            // SAFETY: d holds 32 u16 (64 bytes).
            _mm512_storeu_si512(d.as_mut_ptr().cast(), words);
        } else {
            let mut buf = [0u16; 32];
            // SAFETY: buf holds 32 u16.
            _mm512_storeu_si512(buf.as_mut_ptr().cast(), words);
            d.copy_from_slice(&buf[..d.len()]);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn convert_avx512(src: &[f32], dst: &mut [u16]) {
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = bf16(s));
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn interleave_avx512(even: &[f32], odd: &[f32], dst: &mut [u16]) {
    for ((d, &e), &o) in dst.chunks_exact_mut(2).zip(even).zip(odd) {
        d[0] = bf16(e);
        d[1] = bf16(o);
    }
}

/// The first half of an online-softmax step on the bf16 attention path,
/// for raw scores `row` that are to be `row·scale + mask`: returns the
/// largest of those (NaNs ignored; `-inf` for an empty or all-`-inf` row)
/// and the factor [`exp_sum_into`] must still apply to `row`. Without a
/// mask and with `scale > 0` the row is left raw (max(row)·scale is the
/// max of the scaled row; the exponentials fold the scale in for free);
/// otherwise it is scaled and masked in place and the factor is 1. The max
/// is vectorised with AVX-512 (the compiler does not vectorise it).
pub fn scaled_max(row: &mut [f32], scale: f32, mask: Option<&[f32]>) -> (f32, f32) {
    let fold = mask.is_none() && scale > 0.0;
    if !fold {
        match mask {
            Some(m) => row.iter_mut().zip(m).for_each(|(s, m)| *s = *s * scale + m),
            None => row.iter_mut().for_each(|s| *s *= scale),
        }
    }
    let max = if vector_ok() {
        // SAFETY: the CPU has AVX-512 F (`vector_ok`).
        unsafe { max_avx512(row) }
    } else {
        row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
    };
    if fold {
        (max * scale, scale)
    } else {
        (max, 1.0)
    }
}

/// `e^(row·scale − shift)` rounded to bf16 into row `i` of `p` (a
/// [`PackedA::reset`] matrix as wide as `row`): the softmax
/// numerators of the bf16 attention, ready to multiply the values without
/// another pass. Returns Σ of the f32 values.
pub fn exp_sum_into(row: &[f32], scale: f32, shift: f32, p: &mut PackedA, i: usize) -> f32 {
    if vector_ok() {
        // SAFETY: the CPU has AVX-512 F (`vector_ok`).
        return unsafe { exp_sum_into_avx512(row, scale, shift, p.row_lines(i)) };
    }
    let mut sum = 0.0;
    let mut buf = [0f32; TK];
    for (chunk, line) in row.chunks(TK).zip(p.row_lines(i)) {
        for (b, &v) in buf.iter_mut().zip(chunk) {
            *b = super::kernels::exp_approx(v * scale - shift);
            sum += *b;
        }
        convert(&buf[..chunk.len()], &mut line.0[..chunk.len()]);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_into_avx512<'a>(
    row: &[f32],
    scale: f32,
    shift: f32,
    lines: impl Iterator<Item = &'a mut Line>,
) -> f32 {
    use std::arch::x86_64::*;
    let (sc, sh) = (_mm512_set1_ps(scale), _mm512_set1_ps(shift));
    let mut acc = _mm512_setzero_ps();
    for (chunk, line) in row.chunks(TK).zip(lines) {
        for (h, part) in chunk.chunks(16).enumerate() {
            let n = part.len();
            let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
            // Lanes past the row's end are zero and stay out of the sum.
            let e = _mm512_maskz_mov_ps(mask, exp16(_mm512_fmsub_ps(load16(part), sc, sh)));
            acc = _mm512_add_ps(acc, e);
            let bf = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(bf16_high(e)));
            // SAFETY: the line half holds 16 u16 (32 bytes); zero lanes
            // past the row's end keep the padding zero.
            _mm256_storeu_si256(line.0[16 * h..].as_mut_ptr().cast(), bf);
        }
    }
    _mm512_reduce_add_ps(acc)
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn exp_sum_into_avx512<'a>(
    _: &[f32],
    _: f32,
    _: f32,
    _: impl Iterator<Item = &'a mut Line>,
) -> f32 {
    0.0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn max_avx512(row: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        // SAFETY: `c` holds 16 f32; unaligned loads are allowed.
        let v = _mm512_loadu_ps(c.as_ptr());
        // max(v, acc) returns acc where v is NaN: NaNs are skipped.
        acc = _mm512_max_ps(v, acc);
    }
    chunks
        .remainder()
        .iter()
        .fold(_mm512_reduce_max_ps(acc), |a, &b| a.max(b))
}

/// e^x on 16 lanes, for x ≤ 88 (every caller passes x ≤ 0): the kernels'
/// `exp_approx` with FMAs, except that below -86 it gives e^-86 (~4e-38)
/// rather than 0, a weight too small to count; NaN stays NaN.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let s = _mm512_set1_ps;
    // max(-86, x) returns x where x is NaN, so NaN flows through.
    let xc = _mm512_max_ps(s(-86.0), x);
    // Round x·log2(e) to the integer n (kept in t's low mantissa bits).
    let t = _mm512_fmadd_ps(xc, s(std::f32::consts::LOG2_E), s(12_582_912.0));
    let n = _mm512_sub_ps(t, s(12_582_912.0));
    let r = _mm512_fnmadd_ps(n, s(0.693_359_4), xc);
    let r = _mm512_fnmadd_ps(n, s(-2.121_944_4e-4), r);
    let mut p = s(1.987_569_2e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = _mm512_fmadd_ps(p, r, s(c));
    }
    let er = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), s(1.0));
    let ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B40_0000));
    let pow2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        ni,
        _mm512_set1_epi32(127),
    )));
    _mm512_mul_ps(er, pow2)
}

/// `x = 0.5·x·(1 + erf(x/√2))` (GELU, erf form) in place where AVX-512
/// is, returning whether it did; otherwise the caller runs its own loop.
///
/// 1 + erf(x/√2) is 2 − erfc(z) or erfc(z), z = |x|/√2, with erfc from
/// Numerical Recipes' fit `t·e^(−z² + P(t))`, t = 1/(1 + z/2), whose
/// relative error is below 1.2e-7 everywhere (so also where GELU's value is
/// tiny, for x ≪ 0). The reference erf sums an f64 series per value, about
/// 100 ns each; GEGLU layers spent ~0.5 s of a UNet step in it.
pub fn gelu_erf(x: &mut [f32]) -> bool {
    if !vector_ok() {
        return false;
    }
    // SAFETY: the CPU has AVX-512 F (`vector_ok`).
    unsafe { gelu_erf_avx512(x) };
    true
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let s = _mm512_set1_ps;
    let z = _mm512_mul_ps(_mm512_abs_ps(x), s(std::f32::consts::FRAC_1_SQRT_2));
    let t = _mm512_div_ps(s(1.0), _mm512_fmadd_ps(z, s(0.5), s(1.0)));
    let mut p = s(0.170_872_77);
    for c in [
        -0.822_152_23,
        1.488_515_9,
        -1.135_204,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_7,
        -1.265_512_2,
    ] {
        p = _mm512_fmadd_ps(p, t, s(c));
    }
    // erfc(z) = t·e^(p − z²)
    let c = _mm512_mul_ps(t, exp16(_mm512_fnmadd_ps(z, z, p)));
    let neg = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_setzero_ps());
    let one_plus_erf = _mm512_mask_blend_ps(neg, _mm512_sub_ps(s(2.0), c), c);
    _mm512_mul_ps(_mm512_mul_ps(s(0.5), x), one_plus_erf)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_erf_avx512(x: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        // SAFETY: `c` holds 16 f32; unaligned loads and stores are allowed.
        _mm512_storeu_ps(c.as_mut_ptr(), gelu16(_mm512_loadu_ps(c.as_ptr())));
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let mut buf = [0f32; 16];
        buf[..rest.len()].copy_from_slice(rest);
        // SAFETY: buf holds 16 f32.
        _mm512_storeu_ps(buf.as_mut_ptr(), gelu16(_mm512_loadu_ps(buf.as_ptr())));
        rest.copy_from_slice(&buf[..rest.len()]);
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn gelu_erf_avx512(_: &mut [f32]) {}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn max_avx512(row: &[f32]) -> f32 {
    row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// A strided f32 matrix: element `(i, j)` is `data[offset + i*rs + j*cs]`.
/// The caller guarantees every element of the `rows × cols` view is in
/// `data` (the kernels' `check_view` does).
#[derive(Clone, Copy)]
pub struct Src<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

impl Src<'_> {
    #[inline(always)]
    fn at(&self, i: usize, j: usize) -> f32 {
        self.data[self.offset + i * self.rs + j * self.cs]
    }
}

/// The left operand `[m, k]` in tile order (see the module docs).
pub struct PackedA {
    m: usize,
    k: usize,
    /// 16-row tiles, always even (whole 32-row blocks).
    mt: usize,
    lines: Vec<Line>,
}

/// The right operand `[k, n]` in tile order (see the module docs).
pub struct PackedB {
    k: usize,
    n: usize,
    nt: usize,
    kt: usize,
    lines: Vec<Line>,
}

fn tiles(len: usize, per: usize) -> usize {
    len.div_ceil(per).div_ceil(2) * 2
}

/// Fills one 16-row tile of A across all of k (`band`: kt tiles of 16
/// lines, zeroed beforehand) with rows `i0..i0 + 16` of the `m × k` source;
/// rows past `m` stay zero.
fn fill_a_tile(src: Src<'_>, i0: usize, m: usize, k: usize, band: &mut [Line]) {
    for r in 0..TR.min(m.saturating_sub(i0)) {
        let i = i0 + r;
        if src.cs == 1 {
            let row = &src.data[src.offset + i * src.rs..][..k];
            for (kb, chunk) in row.chunks(TK).enumerate() {
                convert(chunk, &mut band[kb * TR + r].0);
            }
        } else {
            for p in 0..k {
                band[(p / TK) * TR + r].0[p % TK] = bf16(src.at(i, p));
            }
        }
    }
}

impl PackedA {
    /// Packs `src` as an `m × k` matrix, in parallel when `parallel`.
    pub fn pack(src: Src<'_>, m: usize, k: usize, parallel: bool) -> PackedA {
        let (mt, kt) = (tiles(m, TR), k.div_ceil(TK).max(1));
        let mut lines = vec![ZERO_LINE; mt * kt * TR];
        // One 16-row tile of A, across all of k, per piece of work.
        let fill = |ti: usize, band: &mut [Line]| fill_a_tile(src, ti * TR, m, k, band);
        let band = kt * TR;
        if parallel {
            lines
                .par_chunks_mut(band)
                .enumerate()
                .for_each(|(ti, b)| fill(ti, b));
        } else {
            lines
                .chunks_mut(band)
                .enumerate()
                .for_each(|(ti, b)| fill(ti, b));
        }
        PackedA { m, k, mt, lines }
    }

    /// An empty matrix, to [`PackedA::reset`].
    pub fn empty() -> PackedA {
        PackedA {
            m: 0,
            k: 0,
            mt: 0,
            lines: Vec::new(),
        }
    }

    /// An `m × k` matrix of zeros, to fill row by row
    /// ([`exp_sum_into`]); reuses this one's memory.
    pub fn reset(&mut self, m: usize, k: usize) {
        let (mt, kt) = (tiles(m, TR), k.div_ceil(TK).max(1));
        self.lines.clear();
        self.lines.resize(mt * kt * TR, ZERO_LINE);
        (self.m, self.k, self.mt) = (m, k, mt);
    }

    /// Row `i` (< rows) as its k-chunks of 32: chunk `kb` is line
    /// `(i/16 · kt + kb)·16 + i%16`.
    fn row_lines(&mut self, i: usize) -> impl Iterator<Item = &mut Line> {
        let kt = self.k.div_ceil(TK).max(1);
        let (ti, r) = (i / TR, i % TR);
        self.lines[ti * kt * TR..(ti + 1) * kt * TR]
            .iter_mut()
            .skip(r)
            .step_by(TR)
    }

    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        self.m
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(&self.lines[..])
    }

    /// 32-row blocks (the unit [`gemm`] splits rows by).
    pub fn blocks(&self) -> usize {
        self.mt / 2
    }
}

impl PackedB {
    /// Packs `src` as a `k × n` matrix, in parallel when `parallel`.
    pub fn pack(src: Src<'_>, k: usize, n: usize, parallel: bool) -> PackedB {
        let mut b = PackedB::empty();
        b.repack(src, k, n, parallel);
        b
    }

    /// An empty matrix, to [`PackedB::repack`] into.
    pub fn empty() -> PackedB {
        PackedB {
            k: 0,
            n: 0,
            nt: 0,
            kt: 0,
            lines: Vec::new(),
        }
    }

    /// [`PackedB::pack`] into this buffer, reusing its memory (fresh pages
    /// cost a fault each; a convolution packs one tile after another).
    pub fn repack(&mut self, src: Src<'_>, k: usize, n: usize, parallel: bool) {
        let (nt, kt) = (tiles(n, TR), k.div_ceil(TK).max(1));
        let mut lines = std::mem::take(&mut self.lines);
        lines.clear();
        lines.resize(nt * kt * TR, ZERO_LINE);
        // One 16-column tile of B, across all of k, per piece of work.
        let fill = |tj: usize, band: &mut [Line]| {
            let cols = TR.min(n.saturating_sub(tj * TR));
            if cols == 0 {
                return; // a padding tile
            }
            if src.rs == 1 {
                // Columns are contiguous along k (a transposed weight, or
                // keys for q·kᵀ): each pair is two neighbours.
                // Converted a column at a time, then transposed into lines.
                let mut col = [0u16; TK];
                for c in 0..cols {
                    let j = tj * TR + c;
                    let whole = &src.data[src.offset + j * src.cs..][..k];
                    for (kb, chunk) in whole.chunks(TK).enumerate() {
                        col.fill(0);
                        convert(chunk, &mut col[..chunk.len()]);
                        let tile = &mut band[kb * TR..(kb + 1) * TR];
                        for (line, pair) in tile.iter_mut().zip(col.chunks_exact(2)) {
                            line.0[2 * c..2 * c + 2].copy_from_slice(pair);
                        }
                    }
                }
            } else if src.cs == 1 {
                // Rows are contiguous along n (im2col patches, values):
                // interleave two rows at a time.
                let row = |p: usize| &src.data[src.offset + p * src.rs + tj * TR..][..cols];
                const NONE: [f32; TR] = [0.0; TR];
                for p in (0..k).step_by(2) {
                    let odd = if p + 1 < k { row(p + 1) } else { &NONE[..cols] };
                    let line = &mut band[(p / TK) * TR + (p % TK) / 2].0;
                    interleave(row(p), odd, &mut line[..2 * cols]);
                }
            } else {
                for p in 0..k {
                    let line = &mut band[(p / TK) * TR + (p % TK) / 2].0;
                    for c in 0..cols {
                        line[2 * c + p % 2] = bf16(src.at(p, tj * TR + c));
                    }
                }
            }
        };
        let band = kt * TR;
        if parallel {
            lines
                .par_chunks_mut(band)
                .enumerate()
                .for_each(|(tj, b)| fill(tj, b));
        } else {
            lines
                .chunks_mut(band)
                .enumerate()
                .for_each(|(tj, b)| fill(tj, b));
        }
        *self = PackedB {
            k,
            n,
            nt,
            kt,
            lines,
        };
    }

    /// [`PackedB::repack`] from a matrix given row by row: `row(p, dst)`
    /// fills row `p` (`n` values). Two rows at a time are made and
    /// interleaved straight into tile order, so a convolution's im2col
    /// patches never exist as a whole f32 matrix.
    pub fn repack_rows(&mut self, k: usize, n: usize, mut row: impl FnMut(usize, &mut [f32])) {
        let (nt, kt) = (tiles(n, TR), k.div_ceil(TK).max(1));
        let mut lines = std::mem::take(&mut self.lines);
        lines.clear();
        lines.resize(nt * kt * TR, ZERO_LINE);
        let (mut even, mut odd) = (vec![0f32; n], vec![0f32; n]);
        for p in (0..k).step_by(2) {
            row(p, &mut even);
            if p + 1 < k {
                row(p + 1, &mut odd);
            } else {
                odd.fill(0.0);
            }
            let (kb, r) = (p / TK, (p % TK) / 2);
            for (tj, (e, o)) in even.chunks(TR).zip(odd.chunks(TR)).enumerate() {
                let line = &mut lines[(tj * kt + kb) * TR + r].0;
                interleave(e, o, &mut line[..2 * e.len()]);
            }
        }
        *self = PackedB {
            k,
            n,
            nt,
            kt,
            lines,
        };
    }

    /// Columns of the matrix.
    pub fn cols(&self) -> usize {
        self.n
    }

    /// Depth (rows) of the matrix.
    pub fn depth(&self) -> usize {
        self.k
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(&self.lines[..])
    }
}

/// Why [`gemm`] refused its operands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmxError {
    #[error("AMX is not available on this CPU")]
    Unavailable,
    #[error("operands disagree: A is {m}×{ka}, B is {kb}×{n}")]
    Shapes {
        m: usize,
        ka: usize,
        kb: usize,
        n: usize,
    },
    #[error("blocks {start}..{end} of A's {blocks}")]
    Blocks {
        start: usize,
        end: usize,
        blocks: usize,
    },
    #[error(
        "destination of {len} elements cannot hold {rows} rows of {cols} with row stride {rs}"
    )]
    Destination {
        len: usize,
        rows: usize,
        cols: usize,
        rs: usize,
    },
}

/// The tile configuration: palette 1, all eight tiles 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn full() -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
            c[48 + t] = TR as u8; // rows
        }
        TileConfig(c)
    }
}

/// The left operand of [`gemm`].
#[derive(Clone)]
pub enum Lhs<'a> {
    /// Packed beforehand (a weight used many times); only its 32-row
    /// blocks in the range take part.
    Packed(&'a PackedA, std::ops::Range<usize>),
    /// An `m × k` f32 matrix, packed 32 rows at a time into a small
    /// per-thread buffer as the product reaches them (activations: one
    /// pass over them, no large allocation).
    Rows(Src<'a>, usize, usize),
}

thread_local! {
    /// Whether this thread has loaded the tile configuration.
    static TILES_CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// A's current 32-row block for [`Lhs::Rows`], kept between calls so
    /// the pages are not faulted in again.
    static A_BLOCK: std::cell::RefCell<Vec<Line>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `dst[i*dst_rs + j] = scale · (A·B)[i, j]` (with `accumulate`, added to
/// what `dst` holds) for the rows of `lhs` and every column of B; `dst`
/// starts at the first row `lhs` covers. Runs on the calling thread.
pub fn gemm(
    lhs: Lhs<'_>,
    b: &PackedB,
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    scale: f32,
) -> Result<(), AmxError> {
    if !available() {
        return Err(AmxError::Unavailable);
    }
    let (m, k, blocks) = match &lhs {
        Lhs::Packed(a, blocks) => {
            if blocks.start > blocks.end || blocks.end > a.blocks() {
                return Err(AmxError::Blocks {
                    start: blocks.start,
                    end: blocks.end,
                    blocks: a.blocks(),
                });
            }
            (a.m, a.k, blocks.clone())
        }
        Lhs::Rows(_, m, k) => (*m, *k, 0..m.div_ceil(BLOCK)),
    };
    if k != b.k {
        return Err(AmxError::Shapes {
            m,
            ka: k,
            kb: b.k,
            n: b.n,
        });
    }
    let first = blocks.start * BLOCK;
    let rows = m.min(blocks.end * BLOCK).saturating_sub(first);
    let n = b.n;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let needed = (rows - 1)
        .checked_mul(dst_rs)
        .and_then(|x| x.checked_add(n));
    if (rows > 1 && dst_rs < n) || needed.is_none_or(|x| x > dst.len()) {
        return Err(AmxError::Destination {
            len: dst.len(),
            rows,
            cols: n,
            rs: dst_rs,
        });
    }
    let kt = b.kt;
    A_BLOCK.with_borrow_mut(|scratch| {
        // Columns of B per panel: as many 32-column blocks as fit the L2
        // budget. (Rows packed on the fly would be packed once per panel:
        // they take all of B at once.)
        let panel = match lhs {
            Lhs::Packed(..) => (B_PANEL_BYTES / (2 * kt * TILE_BYTES)).max(1) * 2,
            Lhs::Rows(..) => b.nt,
        };
        let mut c = [0f32; BLOCK * BLOCK];
        // The tile configuration is per thread and loading it (and
        // releasing the tiles after) costs microseconds, which small
        // products (attention's blocks) would pay on every call; so each
        // thread loads it once and keeps it. Nothing else in the process
        // uses the tile registers.
        if !TILES_CONFIGURED.get() {
            // SAFETY: the CPU has AMX and the process may use it
            // (`available`); the configuration is a valid palette-1 layout.
            unsafe { load_config(&TileConfig::full()) };
            TILES_CONFIGURED.set(true);
        }
        // One 32 × 32 block of the output from A's block `mb` (its two row
        // tiles, kt tiles each) and B's column tiles `tj`, `tj + 1`.
        let mut one = |mb: usize, tj: usize, a_block: &[Line]| {
            let i0 = mb * BLOCK - first;
            let bi = BLOCK.min(rows - i0);
            let b_block = &b.lines[tj * kt * TR..(tj + 2) * kt * TR];
            let (a_ptr, b_ptr) = (a_block.as_ptr(), b_block.as_ptr());
            let j0 = tj * TR;
            let bj = BLOCK.min(n - j0);
            if !accumulate && scale == 1.0 && bi == BLOCK && bj == BLOCK {
                // A whole block that needs no epilogue: the tiles go
                // straight to the destination.
                let d = &mut dst[i0 * dst_rs + j0..(i0 + BLOCK - 1) * dst_rs + j0 + BLOCK];
                // SAFETY: as below, and `d` holds rows r < 32 of 32 f32 at
                // stride dst_rs (the slicing checked it).
                unsafe { block(a_ptr, b_ptr, kt, d.as_mut_ptr(), dst_rs) };
                return;
            }
            // SAFETY: both slices hold two runs of kt tiles (A's by
            // construction; B's by the slicing above, nt being even); `c`
            // holds 32 × 32 f32.
            unsafe { block(a_ptr, b_ptr, kt, c.as_mut_ptr(), BLOCK) };
            for (r, crow) in c.chunks(BLOCK).take(bi).enumerate() {
                let d = &mut dst[(i0 + r) * dst_rs + j0..][..bj];
                store_row(d, &crow[..bj], accumulate, scale);
            }
        };
        if let (Lhs::Packed(a, _), true) = (&lhs, blocks.len() * 2 * kt * TILE_BYTES <= A_L1_BYTES)
        {
            // A fits L1 (attention's query blocks): walk B once, each of
            // its blocks meeting every row block while it is in L1.
            for tj in (0..b.nt).step_by(2) {
                for mb in blocks.clone() {
                    one(mb, tj, &a.lines[2 * mb * kt * TR..2 * (mb + 1) * kt * TR]);
                }
            }
            return;
        }
        for nt0 in (0..b.nt).step_by(panel) {
            for mb in blocks.clone() {
                let a_block: &[Line] = match &lhs {
                    Lhs::Packed(a, _) => &a.lines[2 * mb * kt * TR..2 * (mb + 1) * kt * TR],
                    Lhs::Rows(src, ..) => {
                        scratch.clear();
                        scratch.resize(2 * kt * TR, ZERO_LINE);
                        let (t0, t1) = scratch.split_at_mut(kt * TR);
                        fill_a_tile(*src, mb * BLOCK, m, k, t0);
                        fill_a_tile(*src, mb * BLOCK + TR, m, k, t1);
                        scratch
                    }
                };
                for tj in (nt0..(nt0 + panel).min(b.nt)).step_by(2) {
                    one(mb, tj, a_block);
                }
            }
        }
    });
    Ok(())
}

/// `d = scale·c` or `d += scale·c`, vectorised where AVX-512 is.
#[inline]
fn store_row(d: &mut [f32], c: &[f32], accumulate: bool, scale: f32) {
    if vector_ok() {
        // SAFETY: the CPU has AVX-512 F and BW (`vector_ok`).
        unsafe { store_row_avx512(d, c, accumulate, scale) }
    } else {
        store_row_plain(d, c, accumulate, scale)
    }
}

#[inline(always)]
fn store_row_plain(d: &mut [f32], c: &[f32], accumulate: bool, scale: f32) {
    if accumulate {
        d.iter_mut().zip(c).for_each(|(d, &s)| *d += scale * s);
    } else {
        d.iter_mut().zip(c).for_each(|(d, &s)| *d = scale * s);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn store_row_avx512(d: &mut [f32], c: &[f32], accumulate: bool, scale: f32) {
    store_row_plain(d, c, accumulate, scale)
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn store_row_avx512(d: &mut [f32], c: &[f32], accumulate: bool, scale: f32) {
    store_row_plain(d, c, accumulate, scale)
}

/// # Safety
/// AMX must be available and enabled for the process.
#[cfg(target_arch = "x86_64")]
unsafe fn load_config(cfg: &TileConfig) {
    std::arch::asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
}

/// One 32 × 32 block: `c = Σ_kb A(0..2, kb) · B(kb, 0..2)`, row `r` of the
/// block at `c + r·cs`.
///
/// # Safety
/// The tile configuration of [`TileConfig::full`] is loaded; `a` and `b`
/// each point at `2 * kt` tiles (two runs of `kt` consecutive 1 KiB tiles),
/// `kt >= 1`; `c + r·cs .. c + r·cs + 32` is writable f32 for r < 32.
#[cfg(target_arch = "x86_64")]
unsafe fn block(a: *const Line, b: *const Line, kt: usize, c: *mut f32, cs: usize) {
    // The second row tile of A (column tile of B) is kt tiles further.
    let run = kt * TR;
    // In a tile load `[base + index]`, the index register is the row
    // stride (64 bytes here), not an offset.
    std::arch::asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        "2:",
        "tileloadd tmm4, [{a0} + {s}*1]",
        "tileloadd tmm6, [{b0} + {s}*1]",
        "tileloadd tmm5, [{a1} + {s}*1]",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "tileloadd tmm7, [{b1} + {s}*1]",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "add {a0}, {t}",
        "add {a1}, {t}",
        "add {b0}, {t}",
        "add {b1}, {t}",
        "dec {kt}",
        "jnz 2b",
        a0 = inout(reg) a => _,
        a1 = inout(reg) a.add(run) => _,
        b0 = inout(reg) b => _,
        b1 = inout(reg) b.add(run) => _,
        kt = inout(reg) kt => _,
        s = in(reg) 64usize,
        t = in(reg) TILE_BYTES,
        options(nostack, readonly),
    );
    // The accumulators stay in the tile registers between the two blocks
    // (the compiler never allocates tiles).
    std::arch::asm!(
        "tilestored [{c0} + {cs}*1], tmm0",
        "tilestored [{c1} + {cs}*1], tmm1",
        "tilestored [{c2} + {cs}*1], tmm2",
        "tilestored [{c3} + {cs}*1], tmm3",
        c0 = in(reg) c,
        c1 = in(reg) c.add(TR),
        c2 = in(reg) c.add(TR * cs),
        c3 = in(reg) c.add(TR * cs + TR),
        cs = in(reg) cs * 4,
        options(nostack),
    );
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn load_config(_: &TileConfig) {}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn block(_: *const Line, _: *const Line, _: usize, _: *mut f32, _: usize) {}
