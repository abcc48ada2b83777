//! Helpers the benchmark binaries share.

/// Normalised mean squared error of `got` against `want`
/// (Σ(got − want)² / Σ want²): how far a fast path's output is from the
/// reference path's in the same run.
pub fn nmse(got: &[f32], want: &[f32]) -> f64 {
    let (mut e, mut w) = (0.0f64, 0.0f64);
    for (g, x) in got.iter().zip(want) {
        e += f64::from(g - x).powi(2);
        w += f64::from(*x).powi(2);
    }
    e / w.max(1e-30)
}
