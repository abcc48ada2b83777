//! k-diffusion's Euler sampler (Karras et al. 2022, Algorithm 2, without
//! churn), as ComfyUI runs it, over any denoiser: a function from the
//! noisy latent and sigma to the denoised estimate. The arithmetic is f32
//! and in k-diffusion's order, so results follow PyTorch's.

/// Runs Euler steps over `sigmas` (descending, usually ending in 0).
/// `denoise(x, sigma)` returns the denoised latent; `step(i, total)` is
/// called after each step (progress, cancellation) and may stop the run by
/// returning an error.
pub fn sample_euler<E>(
    x: Vec<f32>,
    sigmas: &[f32],
    denoise: impl FnMut(&[f32], f32) -> Result<Vec<f32>, E>,
    step: impl FnMut(usize, usize) -> Result<(), E>,
) -> Result<Vec<f32>, E> {
    super::samplers::Sampler::Euler.run(x, sigmas, denoise, Vec::new, step)
}

/// Classifier-free guidance as ComfyUI combines it:
/// `uncond + (cond - uncond) * cfg`.
pub fn cfg_combine(cond: &[f32], uncond: &[f32], cfg: f32) -> Vec<f32> {
    cond.iter()
        .zip(uncond)
        .map(|(c, u)| u + (c - u) * cfg)
        .collect()
}
