//! ComfyUI's stochastic rounding of a LoRA-patched weight back to fp8
//! (`comfy.float.stochastic_rounding`), bit for bit: a model held in fp8
//! (UNETLoader's fp8 `weight_dtype`) gets its patched weights rounded up
//! or down at random, in proportion to the distance, with the CPU
//! generator seeded from the weight's name (`string_to_seed`).
//!
//! ComfyUI computes it in float16 tensors; torch's CPU half arithmetic
//! computes each operation in f32 and rounds the result to f16, which is
//! what every step below does ([`h`]).

use crate::noise::Mt19937;
use sdkit_compute::weights::{round_f16, round_f8_e4m3, round_f8_e5m2, DType};

/// ComfyUI's `string_to_seed`: a CRC-32 (reflected, 0xEDB88320) over the
/// key's characters, each XORed in whole (`crc ^= ord(c)`): the CRC-32 of
/// the bytes for ASCII keys, as model keys are.
pub fn string_to_seed(key: &str) -> u64 {
    let mut crc = 0xFFFF_FFFFu32;
    for c in key.chars() {
        crc ^= u32::from(c);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    u64::from(crc ^ 0xFFFF_FFFF)
}

/// One f16 operation's result: computed in f32, rounded to f16.
fn h(x: f32) -> f32 {
    round_f16(x)
}

/// torch's CPU `rand` of float16 (torch 2.x): the low 24 bits of one
/// 32-bit draw over 2^24, rounded to f16; a draw that rounds up to 1
/// becomes 0.
pub fn rand_f16(gen: &mut Mt19937) -> f32 {
    let v = h((gen.next_u32() & 0xff_ffff) as f32 / 16_777_216.0);
    if v >= 1.0 {
        0.0
    } else {
        v
    }
}

/// `values` rounded to `dtype` (F8E4M3 or F8E5M2) as
/// `comfy.float.stochastic_rounding(values, dtype, seed)` does, in
/// place; the results are fp8 values held in f32. Other dtypes round to
/// nearest, as ComfyUI's cast.
pub fn stochastic_round(values: &mut [f32], dtype: DType, seed: u64) {
    let (exp_bits, man_bits, bias, to_fp8): (i32, i32, i32, fn(f32) -> f32) = match dtype {
        DType::F8E4M3 => (4, 3, 7, round_f8_e4m3),
        DType::F8E5M2 => (5, 2, 15, round_f8_e5m2),
        _ => {
            if let Some(round) = sdkit_compute::weights::rounding(dtype) {
                values.iter_mut().for_each(|v| *v = round(*v));
            }
            return;
        }
    };
    // finfo(dtype).max: the clamp before the cast.
    let max = match dtype {
        DType::F8E4M3 => 448.0f32,
        _ => 57344.0,
    };
    let man_scale = (1i32 << man_bits) as f32;
    let top = ((1i32 << exp_bits) - 1) as f32;
    // 2.0 ** (-bias + 1 - man_bits) and 2.0 ** (-bias + 1): Python floats,
    // exact powers of two.
    let sub_unit = 2f32.powi(-bias + 1 - man_bits);
    let sub_scale = 2f32.powi(-bias + 1);
    // One draw per element, in order (the slices ComfyUI cuts large
    // weights into are consecutive rows, so the order is the same).
    let mut gen = Mt19937::new(seed);
    for v in values.iter_mut() {
        let x = h(*v);
        let a = x.abs();
        let sign = if a == 0.0 { 0.0 } else { x.signum() };
        // exponent = clamp(floor(log2(|x|)) + bias, 0, 2^e − 1), in f16.
        let exponent = (h(h(a.log2()).floor() + bias as f32)).clamp(0.0, top);
        let normal = exponent != 0.0;
        // 2.0 ** (exponent − bias) as torch.pow of a half tensor.
        let p = h(2f32.powf(h(exponent - bias as f32)));
        let scaled = if normal {
            h(h(h(a / p) - 1.0) * man_scale)
        } else {
            h(a / sub_unit)
        };
        let r = rand_f16(&mut gen);
        let m = h(h(scaled + r).floor() / man_scale);
        let magnitude = if normal {
            h(p * h(1.0 + m))
        } else {
            h(sub_scale * m)
        };
        let out = h(sign * magnitude).clamp(-max, max);
        *v = to_fp8(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys with a known seed (the reference script's values).
    #[test]
    fn seeds_are_comfyuis() {
        assert_eq!(string_to_seed(""), 0);
        assert_eq!(string_to_seed("a"), 3_904_355_907);
        assert_eq!(
            string_to_seed("diffusion_model.double_blocks.0.img_attn.qkv.weight"),
            2_934_867_767
        );
        assert_eq!(string_to_seed("café.日本語.😀.weight"), 994_108_858);
    }
}
