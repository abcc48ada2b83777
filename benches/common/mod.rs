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

/// Seconds one replay of `p` takes: one timed replay sizes a batch of
/// about `target` seconds (between `min` and `max` replays); returns its
/// mean and the batch size.
pub fn seconds_per_step(
    p: &sdkit_compute::backend::wgpu::Prepared<'_>,
    target: f64,
    min: usize,
    max: usize,
) -> (f64, usize) {
    let t = std::time::Instant::now();
    let _ = p.dispatch_only(1);
    let once = t.elapsed().as_secs_f64().max(1e-6);
    let iters = ((target / once) as usize).clamp(min, max);
    let t = std::time::Instant::now();
    let _ = p.dispatch_only(iters);
    (t.elapsed().as_secs_f64() / iters as f64, iters)
}
