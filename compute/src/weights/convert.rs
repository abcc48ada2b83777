//! Conversions between storage dtypes and f32: exact widening of every
//! float format, and the rounding casts (f32 → f16, f8) that PyTorch makes.

use super::DType;

/// Exact f16 → f32: every f16 is representable in f32, so this only moves
/// the fields, renormalizing subnormals.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: man · 2^-24. Shift the leading one up to bit 10
            // (the implicit bit's place); each shift lowers the exponent.
            let shift = man.leading_zeros() - 21;
            let man = (man << shift) & 0x3ff;
            sign | ((113 - shift) << 23) | (man << 13)
        }
        // Infinity, or NaN with its payload (and quiet bit) kept in place.
        (0x1f, _) => sign | 0x7f80_0000 | (man << 13),
        // Normal: rebias the exponent from 15 to 127.
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Exact bf16 → f32: bf16 is the top half of an f32.
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 → bf16, rounding to nearest even, as `torch.Tensor.bfloat16()`;
/// NaN stays NaN.
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        ((b >> 16) | 0x40) as u16
    } else {
        // Cannot overflow: the largest finite pattern plus 0x8000 fits u32.
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }
}

/// Exact f8 E5M2 → f32: E5M2 is the top byte of an f16.
pub fn f8_e5m2_to_f32(b: u8) -> f32 {
    f16_to_f32(u16::from(b) << 8)
}

/// f32 rounded to the nearest f16 (ties to even, as PyTorch's cast).
pub fn round_f16(x: f32) -> f32 {
    f16_to_f32(f32_to_f16_bits(x))
}

/// f32 rounded to the nearest bf16 (ties to even, as PyTorch's cast).
pub fn round_bf16(x: f32) -> f32 {
    bf16_to_f32(f32_to_bf16_bits(x))
}

/// The f32 → `dtype` → f32 rounding of a float storage dtype, if it
/// rounds.
pub fn rounding(dtype: DType) -> Option<fn(f32) -> f32> {
    match dtype {
        DType::F16 => Some(round_f16),
        DType::BF16 => Some(round_bf16),
        DType::F8E4M3 => Some(round_f8_e4m3),
        DType::F8E5M2 => Some(round_f8_e5m2),
        _ => None,
    }
}

/// f32 rounded to the nearest `float8_e4m3fn` value (ties to even), as
/// PyTorch casts: the format has no infinities, and larger magnitudes
/// (infinities included) saturate at ±448; the sign of zero kept.
pub fn round_f8_e4m3(x: f32) -> f32 {
    round_f8(x, 3, -6, 448.0, 448.0)
}

/// f32 rounded to the nearest `float8_e5m2` value (ties to even), as
/// PyTorch casts: magnitudes that round past 57344 become infinite.
pub fn round_f8_e5m2(x: f32) -> f32 {
    round_f8(x, 2, -14, 57344.0, f32::INFINITY)
}

/// Round to a float with `man` mantissa bits, smallest normal exponent
/// `min_exp` (subnormals below it), largest finite value `max`; `over`
/// for magnitudes that round beyond it. Exact: f64 holds every step.
fn round_f8(x: f32, man: i32, min_exp: i32, max: f64, over: f32) -> f32 {
    if x.is_nan() || x == 0.0 {
        return x;
    }
    if x.is_infinite() {
        return over.copysign(x);
    }
    let a = f64::from(x.abs());
    // The f32's own binary exponent (subnormal f32s are far below min_exp).
    let e = ((((x.to_bits() >> 23) & 0xff) as i32) - 127).max(min_exp);
    let ulp = (2f64).powi(e - man);
    let q = (a / ulp).round_ties_even() * ulp;
    let r = if q > max { over } else { q as f32 };
    if x < 0.0 {
        -r
    } else {
        r
    }
}

/// Exact f8 E4M3 (`float8_e4m3fn`) → f32: bias 7, no infinities, and only
/// `S.1111.111` is NaN, so exponent 15 still holds finite values (up to 448).
pub fn f8_e4m3_to_f32(b: u8) -> f32 {
    let sign = u32::from(b & 0x80) << 24;
    let exp = u32::from((b >> 3) & 0xf);
    let man = u32::from(b & 0x7);
    let bits = match (exp, man) {
        (0xf, 0x7) => sign | 0x7fc0_0000,
        (0, _) => {
            // Subnormal: man · 2^-9, exact in f32 (small integer times a
            // power of two); `sign` keeps -0.
            return f32::from_bits(sign | ((man as f32) * (1.0 / 512.0)).to_bits());
        }
        _ => sign | ((exp + 120) << 23) | (man << 20),
    };
    f32::from_bits(bits)
}

/// Converts elements of `N` little-endian bytes; reads byte by byte, so the
/// slice need not be aligned. Large tensors convert on every core: the CPU
/// backend reads each weight from the file at every use.
fn decode_with<const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> f32 + Sync) -> Vec<f32> {
    use rayon::prelude::*;
    let one = |c: &[u8]| {
        let mut a = [0u8; N];
        a.copy_from_slice(c);
        f(a)
    };
    if bytes.len() < (1 << 20) {
        bytes.chunks_exact(N).map(one).collect()
    } else {
        bytes.par_chunks_exact(N).map(one).collect()
    }
}

/// f16 → f32 for every bit pattern (256 KiB), so a conversion is one
/// load: weights are converted at every use on the CPU.
fn f16_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(f16_to_f32).collect())
}

/// Converts a tensor's bytes to f32 (see [`SafeTensors::to_f32`]).
pub(super) fn decode_f32(dtype: DType, bytes: &[u8], dequant: super::Dequant) -> Vec<f32> {
    match dtype {
        DType::Bool => decode_with(bytes, |[b]: [u8; 1]| if b != 0 { 1.0 } else { 0.0 }),
        DType::U8 => decode_with(bytes, |[b]: [u8; 1]| f32::from(b)),
        DType::I8 => decode_with(bytes, |b: [u8; 1]| f32::from(i8::from_le_bytes(b))),
        DType::F8E4M3 => decode_with(bytes, |[b]: [u8; 1]| f8_e4m3_to_f32(b)),
        DType::F8E5M2 => decode_with(bytes, |[b]: [u8; 1]| f8_e5m2_to_f32(b)),
        DType::I16 => decode_with(bytes, |b| f32::from(i16::from_le_bytes(b))),
        DType::U16 => decode_with(bytes, |b| f32::from(u16::from_le_bytes(b))),
        DType::F16 => {
            let table = f16_table();
            decode_with(bytes, |b| table[usize::from(u16::from_le_bytes(b))])
        }
        DType::BF16 => decode_with(bytes, |b| bf16_to_f32(u16::from_le_bytes(b))),
        // Wider integers round to nearest, which `as` does.
        DType::I32 => decode_with(bytes, |b| i32::from_le_bytes(b) as f32),
        DType::U32 => decode_with(bytes, |b| u32::from_le_bytes(b) as f32),
        DType::F32 => decode_with(bytes, f32::from_le_bytes),
        DType::I64 => decode_with(bytes, |b| i64::from_le_bytes(b) as f32),
        DType::U64 => decode_with(bytes, |b| u64::from_le_bytes(b) as f32),
        DType::F64 => decode_with(bytes, |b| f64::from_le_bytes(b) as f32),
        DType::Q8_0
        | DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q2K
        | DType::Q3K
        | DType::Q4K
        | DType::Q5K
        | DType::Q6K => super::gguf::decode_blocks(dtype, bytes, dequant),
    }
}

/// Converts f32 to IEEE half, rounding to nearest even (weights stored as
/// f16 on a GPU, and ComfyUI's f16 text encoders).
pub fn f32_to_f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rest = m & ((1u32 << shift) - 1);
        let mut v = m >> shift;
        if rest > half || (rest == half && v & 1 == 1) {
            v += 1;
        }
        return sign | v as u16;
    }
    let mut v = ((e as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && v & 1 == 1) {
        v += 1;
    }
    sign | v as u16
}
