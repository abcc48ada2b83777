//! Row-wise CPU kernels (softmax, layer/RMS/group norm), resampling and
//! half-precision conversions against naive references computed in f64.
//!
//! Tolerances:
//! * softmax_rows: |got - want| ≤ 1e-6 · (1 + |x - rowmax|) · |want| + 1e-30
//!   (the |x - rowmax| term is that difference's own f32 rounding).
//! * layer_norm, rms_norm, group_norm: |got - want| ≤ 1e-6 · (1 + |want|).
//! * upsample_nearest2d: exact; upsample_bilinear2d: |got - want| ≤
//!   5e-7 · (1 + |want|).
//! * f16/bf16 conversion: bit-exact, all 65 536 patterns.
//!
//! Observed maxima when written were 3-7× below each bound.

mod common;

use common::{config, max_err, random};
use proptest::prelude::*;
use sdkit_compute::backend::cpu::kernels::{
    bf16_to_f32, f16_to_f32, group_norm, layer_norm, rms_norm, softmax_rows, upsample_bilinear2d,
    upsample_nearest2d, KernelError,
};

// ---------------------------------------------------------------------------
// softmax and normalizations
// ---------------------------------------------------------------------------

fn softmax_ref(x: &[f32], cols: usize) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|row| {
            let max = row
                .iter()
                .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
            let e: Vec<f64> = row.iter().map(|&v| (f64::from(v) - max).exp()).collect();
            let total: f64 = e.iter().sum();
            e.into_iter().map(move |v| v / total)
        })
        .collect()
}

/// `(x - mean) / sqrt(var + eps)` over `x`, biased variance, in f64.
fn normalize_ref(x: &[f32], eps: f32) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = x
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    x.iter()
        .map(|&v| (f64::from(v) - mean) / (var + f64::from(eps)).sqrt())
        .collect()
}

/// Inputs with an offset (so the mean is far from 0) and a spread.
fn shifted(seed: u64, len: usize, offset: f32, spread: f32) -> Vec<f32> {
    random(seed, len)
        .iter()
        .map(|x| offset + spread * x)
        .collect()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn softmax_matches_reference(rows in 1usize..40, cols in 1usize..300, spread in 0.1f32..30.0, seed: u64) {
        let x = shifted(seed, rows * cols, 0.0, spread);
        let mut out = vec![f32::NAN; x.len()];
        softmax_rows(&x, rows, cols, &mut out).expect("softmax");
        let want = softmax_ref(&x, cols);
        // x - max is rounded to f32 before exponentiating (in any f32
        // softmax), which costs a relative ulp/2 of |x - max| in the result.
        let maxes: Vec<f64> = x.chunks(cols).map(|r| f64::from(r.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)))).collect();
        let err = max_err(&out, &want, |i| {
            let arg = (f64::from(x[i]) - maxes[i / cols]).abs();
            (1.0 + arg) * want[i].abs() + 1e-24
        });
        prop_assert!(err <= 1e-6, "softmax err {err:e}");
    }

    #[test]
    fn layer_and_rms_norm_match_reference(
        rows in 1usize..40, cols in 1usize..700, offset in -100.0f32..100.0, spread in 0.01f32..10.0,
        affine: bool, seed: u64,
    ) {
        let x = shifted(seed, rows * cols, offset, spread);
        let weight = affine.then(|| random(seed ^ 1, cols));
        let bias = affine.then(|| random(seed ^ 2, cols));
        let eps = 1e-5;
        let mut out = vec![f32::NAN; x.len()];
        layer_norm(&x, rows, cols, eps, weight.as_deref(), bias.as_deref(), &mut out).expect("layer_norm");
        let want: Vec<f64> = x
            .chunks(cols)
            .flat_map(|row| normalize_ref(row, eps).into_iter().enumerate().map(|(j, y)| {
                y * weight.as_ref().map_or(1.0, |w| f64::from(w[j])) + bias.as_ref().map_or(0.0, |b| f64::from(b[j]))
            }).collect::<Vec<_>>())
            .collect();
        let err = max_err(&out, &want, |i| 1.0 + want[i].abs());
        prop_assert!(err <= 1e-6, "layer_norm err {err:e}");

        rms_norm(&x, rows, cols, eps, weight.as_deref(), &mut out).expect("rms_norm");
        let want: Vec<f64> = x
            .chunks(cols)
            .flat_map(|row| {
                let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / cols as f64;
                let r = 1.0 / (ms + f64::from(eps)).sqrt();
                row.iter().enumerate().map(|(j, &v)| f64::from(v) * r * weight.as_ref().map_or(1.0, |w| f64::from(w[j]))).collect::<Vec<_>>()
            })
            .collect();
        let err = max_err(&out, &want, |i| 1.0 + want[i].abs());
        prop_assert!(err <= 1e-6, "rms_norm err {err:e}");
    }

    #[test]
    fn group_norm_matches_reference(
        n in 1usize..3, groups in 1usize..5, cg in 1usize..5, spatial in 1usize..300,
        offset in -100.0f32..100.0, affine: bool, seed: u64,
    ) {
        let c = groups * cg;
        let x = shifted(seed, n * c * spatial, offset, 2.0);
        let weight = affine.then(|| random(seed ^ 1, c));
        let bias = affine.then(|| random(seed ^ 2, c));
        let eps = 1e-6;
        let mut out = vec![f32::NAN; x.len()];
        group_norm(&x, n, c, spatial, groups, eps, weight.as_deref(), bias.as_deref(), &mut out).expect("group_norm");
        let mut want = Vec::with_capacity(x.len());
        for (j, grp) in x.chunks(cg * spatial).enumerate() {
            for (e, y) in normalize_ref(grp, eps).into_iter().enumerate() {
                let ch = (j % groups) * cg + e / spatial;
                want.push(y * weight.as_ref().map_or(1.0, |w| f64::from(w[ch])) + bias.as_ref().map_or(0.0, |b| f64::from(b[ch])));
            }
        }
        let err = max_err(&out, &want, |i| 1.0 + want[i].abs());
        prop_assert!(err <= 1e-6, "group_norm err {err:e}");
    }
}

#[test]
fn group_norm_large_group_with_large_mean_stays_accurate() {
    // One group of 2^20 values around 1000: a naive f32 E[x²] - E[x]² would
    // lose every digit of the variance here.
    let (c, spatial) = (4, 1 << 18);
    let x = shifted(11, c * spatial, 1000.0, 0.5);
    let mut out = vec![0.0; x.len()];
    group_norm(&x, 1, c, spatial, 1, 1e-5, None, None, &mut out).expect("group_norm");
    let want = normalize_ref(&x, 1e-5);
    let err = max_err(&out, &want, |i| 1.0 + want[i].abs());
    assert!(err <= 1e-6, "group_norm err {err:e}");
}

#[test]
fn softmax_handles_infinities_and_bad_sizes() {
    let x = [
        0.0,
        f32::NEG_INFINITY,
        1000.0,
        1000.0,
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
    ];
    let mut out = [0.0; 6];
    softmax_rows(&x, 3, 2, &mut out).expect("softmax");
    assert_eq!(&out[..4], &[1.0, 0.0, 0.5, 0.5]);
    assert!(out[4].is_nan() && out[5].is_nan());
    let err = softmax_rows(&x, 2, 2, &mut out);
    assert!(
        matches!(err, Err(KernelError::Length { operand: "x", .. })),
        "{err:?}"
    );
    let err = group_norm(&x, 1, 3, 2, 2, 1e-5, None, None, &mut out);
    assert!(matches!(err, Err(KernelError::Invalid { .. })), "{err:?}");
    let err = layer_norm(&x, 3, 2, 1e-5, Some(&[1.0]), None, &mut out);
    assert!(
        matches!(
            err,
            Err(KernelError::Length {
                operand: "weight",
                ..
            })
        ),
        "{err:?}"
    );
}

// ---------------------------------------------------------------------------
// upsampling
// ---------------------------------------------------------------------------

/// PyTorch's nearest rule, written from its definition: the ratio in/out and
/// its product with the output index are f32, floored, clamped.
fn nearest_src(dst: usize, input: usize, output: usize) -> usize {
    if output == input {
        return dst;
    }
    if output == 2 * input {
        return dst / 2;
    }
    let ratio = input as f32 / output as f32;
    ((dst as f32 * ratio).floor() as usize).min(input - 1)
}

/// PyTorch's bilinear source coordinate for one axis (f32, as for f32
/// tensors): returns the two taps and the weight of the second.
fn bilinear_src(
    dst: usize,
    input: usize,
    output: usize,
    align_corners: bool,
) -> (usize, usize, f64) {
    if input == output {
        return (dst, dst, 0.0);
    }
    let src = if align_corners {
        let ratio = if output > 1 {
            (input - 1) as f32 / (output - 1) as f32
        } else {
            0.0
        };
        ratio * dst as f32
    } else {
        let ratio = input as f32 / output as f32;
        (ratio * (dst as f32 + 0.5) - 0.5).max(0.0)
    };
    let i0 = (src.floor() as usize).min(input - 1);
    let i1 = (i0 + 1).min(input - 1);
    (i0, i1, f64::from((src - i0 as f32).clamp(0.0, 1.0)))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn upsampling_matches_reference(
        n in 1usize..3, c in 1usize..3, h in 1usize..20, w in 1usize..20, oh in 1usize..45, ow in 1usize..45,
        align_corners: bool, seed: u64,
    ) {
        let x = random(seed, n * c * h * w);
        let mut out = vec![f32::NAN; n * c * oh * ow];
        upsample_nearest2d(&x, [n, c, h, w], oh, ow, &mut out).expect("nearest");
        let mut want = Vec::with_capacity(out.len());
        for p in 0..n * c {
            for y in 0..oh {
                for xo in 0..ow {
                    want.push(f64::from(x[(p * h + nearest_src(y, h, oh)) * w + nearest_src(xo, w, ow)]));
                }
            }
        }
        prop_assert!(max_err(&out, &want, |_| 1.0) == 0.0, "nearest differs");

        upsample_bilinear2d(&x, [n, c, h, w], oh, ow, align_corners, &mut out).expect("bilinear");
        let mut want = Vec::with_capacity(out.len());
        for p in 0..n * c {
            for y in 0..oh {
                let (y0, y1, ly) = bilinear_src(y, h, oh, align_corners);
                for xo in 0..ow {
                    let (x0, x1, lx) = bilinear_src(xo, w, ow, align_corners);
                    let at = |yy: usize, xx: usize| f64::from(x[(p * h + yy) * w + xx]);
                    want.push(
                        (1.0 - ly) * ((1.0 - lx) * at(y0, x0) + lx * at(y0, x1))
                            + ly * ((1.0 - lx) * at(y1, x0) + lx * at(y1, x1)),
                    );
                }
            }
        }
        let err = max_err(&out, &want, |i| 1.0 + want[i].abs());
        prop_assert!(err <= 5e-7, "bilinear err {err:e}");
    }
}

#[test]
fn upsampling_known_values_and_bad_sizes() {
    // 2× nearest repeats each pixel; bilinear without align_corners puts the
    // output pixel centres at 1/4 and 3/4 of each input pixel.
    let x = [0.0, 1.0];
    let mut out = [0.0; 4];
    upsample_nearest2d(&x, [1, 1, 1, 2], 1, 4, &mut out).expect("nearest");
    assert_eq!(out, [0.0, 0.0, 1.0, 1.0]);
    upsample_bilinear2d(&x, [1, 1, 1, 2], 1, 4, false, &mut out).expect("bilinear");
    assert_eq!(out, [0.0, 0.25, 0.75, 1.0]);
    upsample_bilinear2d(&x, [1, 1, 1, 2], 1, 4, true, &mut out).expect("bilinear");
    assert!(
        (out[1] - 1.0 / 3.0).abs() < 1e-7 && out[3] == 1.0,
        "{out:?}"
    );
    let err = upsample_nearest2d(&x, [1, 1, 1, 2], 2, 4, &mut out);
    assert!(
        matches!(err, Err(KernelError::Length { operand: "out", .. })),
        "{err:?}"
    );
    let err = upsample_bilinear2d(&[], [1, 1, 0, 2], 1, 4, false, &mut out);
    assert!(matches!(err, Err(KernelError::Invalid { .. })), "{err:?}");
}

// ---------------------------------------------------------------------------
// half-precision conversion
// ---------------------------------------------------------------------------

/// binary16 decoded from its definition: sign, 5-bit exponent (bias 15),
/// 10-bit fraction; exponent 0 is subnormal, 31 is inf/NaN (NaN keeps its
/// payload in the top fraction bits, as a widening conversion does).
fn f16_ref(bits: u16) -> f32 {
    let sign = if bits & 0x8000 != 0 { -1.0f64 } else { 1.0 };
    let exp = i32::from((bits >> 10) & 0x1f);
    let frac = f64::from(bits & 0x3ff);
    match exp {
        0 => (sign * frac * 2f64.powi(-24)) as f32,
        31 if frac == 0.0 => (sign * f64::INFINITY) as f32,
        31 => f32::from_bits(
            (u32::from(bits & 0x8000) << 16) | 0x7f80_0000 | (u32::from(bits & 0x3ff) << 13),
        ),
        _ => (sign * (1.0 + frac / 1024.0) * 2f64.powi(exp - 15)) as f32,
    }
}

#[test]
fn half_conversions_are_exact_for_every_pattern() {
    // Repeated so the slice is long enough to take the parallel path.
    let all: Vec<u16> = (0..8).flat_map(|_| 0..=u16::MAX).collect();
    let mut out = vec![0.0f32; all.len()];
    f16_to_f32(&all, &mut out).expect("f16");
    for (&b, &f) in all.iter().zip(&out) {
        assert_eq!(f.to_bits(), f16_ref(b).to_bits(), "f16 {b:#06x}");
    }
    bf16_to_f32(&all, &mut out).expect("bf16");
    for (&b, &f) in all.iter().zip(&out) {
        // bf16 is the top half of an f32 by definition.
        let sign = if b & 0x8000 != 0 { -1.0f64 } else { 1.0 };
        let exp = i32::from((b >> 7) & 0xff);
        let frac = f64::from(b & 0x7f);
        let want = match exp {
            0 => (sign * frac * 2f64.powi(-133)) as f32,
            255 if frac == 0.0 => (sign * f64::INFINITY) as f32,
            255 => f32::from_bits(u32::from(b) << 16),
            _ => (sign * (1.0 + frac / 128.0) * 2f64.powi(exp - 127)) as f32,
        };
        assert_eq!(f.to_bits(), want.to_bits(), "bf16 {b:#06x}");
    }
    let err = f16_to_f32(&all[..3], &mut out[..2]);
    assert!(
        matches!(err, Err(KernelError::Length { operand: "dst", .. })),
        "{err:?}"
    );
}
