//! Helpers the CPU kernel test files share.

use proptest::prelude::*;

/// Deterministic values in [-1, 1) from a seed (splitmix64), so proptest only
/// has to shrink shapes and a seed.
pub fn random(seed: u64, len: usize) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Largest `|got - want| / scale` over all elements, failing on length or
/// NaN mismatches.
pub fn max_err(got: &[f32], want: &[f64], scale: impl Fn(usize) -> f64) -> f64 {
    assert_eq!(got.len(), want.len(), "output length");
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.is_nan(), w.is_nan(), "element {i}: got {g}, want {w}");
        if w.is_nan() {
            continue;
        }
        worst = worst.max((f64::from(g) - w).abs() / scale(i));
    }
    worst
}

pub fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 24,
        ..ProptestConfig::default()
    }
}
