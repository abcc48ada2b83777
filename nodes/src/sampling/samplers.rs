//! k-diffusion's samplers as ComfyUI runs them, over any denoiser (noisy
//! latent and sigma → denoised estimate) and noise source.
//!
//! Scalar maths is f32, as k-diffusion does it on 0-d float32 tensors, and
//! every tensor expression keeps PyTorch's evaluation order, so results
//! follow ComfyUI's to float rounding (tests/reference: samplers.py).
//! Ancestral samplers draw noise from `noise()`, which ComfyUI backs with a
//! generator seeded with the seed (k-diffusion's `default_noise_sampler`),
//! fresh for each sampling call; on the CPU that is torch's MT19937, which
//! `crate::noise` reproduces. (ComfyUI on a GPU draws from the GPU's
//! generator, a different stream.)

use super::discrete::{linspace_f32, DiscreteSchedule};
use std::borrow::Cow;

/// What sigma means to the samplers that ask (ComfyUI tests the model
/// sampling for CONST): the variance-exploding σ of eps/v models
/// (x = x₀ + σ·n), or the rectified-flow σ of SD3/Flux
/// (x = (1 − σ)·x₀ + σ·n). It changes the half-logSNR λ the SDE and
/// exponential-integrator samplers step in, and switches the ancestral
/// samplers to their RF forms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Space {
    pub flow: bool,
    /// percent_to_sigma(1e-4): replaces a first sigma ≥ 1 of a flow model
    /// for the samplers that take its logit (ComfyUI's
    /// `offset_first_sigma_for_snr`).
    pub flow_start: f32,
    /// percent_to_sigma(0.2) and (0.8): SA-Solver's stochastic interval.
    pub sa_interval: (f64, f64),
}

impl Space {
    pub fn of(schedule: &DiscreteSchedule) -> Space {
        Space {
            flow: schedule.is_flow(),
            flow_start: schedule.percent_to_sigma(1e-4) as f32,
            sa_interval: (
                schedule.percent_to_sigma(0.2),
                schedule.percent_to_sigma(0.8),
            ),
        }
    }

    /// Half-logSNR log(α/σ): −log σ, or −logit σ for flow.
    pub fn lambda(self, sigma: f32) -> f32 {
        if self.flow {
            -(sigma / (1.0 - sigma)).ln()
        } else {
            -sigma.ln()
        }
    }

    /// The inverse of [`Space::lambda`].
    pub fn sigma(self, lambda: f32) -> f32 {
        if self.flow {
            1.0 / (1.0 + lambda.exp())
        } else {
            (-lambda).exp()
        }
    }

    fn offset_first<'a>(self, sigmas: &'a [f32]) -> Cow<'a, [f32]> {
        if self.flow && sigmas.len() > 1 && sigmas[0] >= 1.0 {
            let mut v = sigmas.to_vec();
            v[0] = self.flow_start;
            Cow::Owned(v)
        } else {
            Cow::Borrowed(sigmas)
        }
    }
}

impl Default for Space {
    /// SD1's eps schedule.
    fn default() -> Self {
        Space::of(&DiscreteSchedule::sd1())
    }
}

/// A sampler by ComfyUI name (`_gpu` names alias their base).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampler {
    Euler,
    /// ComfyUI's `ddim`: Euler, except that inpainting blends in fresh
    /// noise (seed + 1) rather than the initial noise.
    Ddim,
    EulerAncestral,
    Heun,
    Dpm2,
    Dpm2Ancestral,
    DpmPp2sAncestral,
    DpmPp2m,
    Ddpm,
    Lcm,
    Ipndm,
    Lms,
    HeunPp2,
    IpndmV,
    ResMultistep,
    ResMultistepAncestral,
    EulerCfgPp,
    EulerAncestralCfgPp,
    DpmPp2mCfgPp,
    DpmPp2sAncestralCfgPp,
    ResMultistepCfgPp,
    ResMultistepAncestralCfgPp,
    DpmPp2mSde,
    DpmPp2mSdeHeun,
    DpmPp3mSde,
    DpmPpSde,
    GradientEstimation,
    GradientEstimationCfgPp,
    Deis,
    ErSde,
    Seeds2,
    Seeds3,
    DpmFast,
    DpmAdaptive,
    SaSolver,
    SaSolverPece,
    UniPc,
    UniPcBh2,
}

impl Sampler {
    pub fn from_name(name: &str) -> Option<Sampler> {
        Some(match name.strip_suffix("_gpu").unwrap_or(name) {
            "euler" => Sampler::Euler,
            "ddim" => Sampler::Ddim,
            "euler_ancestral" => Sampler::EulerAncestral,
            "heun" => Sampler::Heun,
            "dpm_2" => Sampler::Dpm2,
            "dpm_2_ancestral" => Sampler::Dpm2Ancestral,
            "dpmpp_2s_ancestral" => Sampler::DpmPp2sAncestral,
            "dpmpp_2m" => Sampler::DpmPp2m,
            "ddpm" => Sampler::Ddpm,
            "lcm" => Sampler::Lcm,
            "ipndm" => Sampler::Ipndm,
            "lms" => Sampler::Lms,
            "heunpp2" => Sampler::HeunPp2,
            "ipndm_v" => Sampler::IpndmV,
            "res_multistep" => Sampler::ResMultistep,
            "res_multistep_ancestral" => Sampler::ResMultistepAncestral,
            "euler_cfg_pp" => Sampler::EulerCfgPp,
            "euler_ancestral_cfg_pp" => Sampler::EulerAncestralCfgPp,
            "dpmpp_2m_cfg_pp" => Sampler::DpmPp2mCfgPp,
            "dpmpp_2s_ancestral_cfg_pp" => Sampler::DpmPp2sAncestralCfgPp,
            "res_multistep_cfg_pp" => Sampler::ResMultistepCfgPp,
            "res_multistep_ancestral_cfg_pp" => Sampler::ResMultistepAncestralCfgPp,
            "dpmpp_2m_sde" => Sampler::DpmPp2mSde,
            "dpmpp_2m_sde_heun" => Sampler::DpmPp2mSdeHeun,
            "dpmpp_3m_sde" => Sampler::DpmPp3mSde,
            "dpmpp_sde" => Sampler::DpmPpSde,
            "gradient_estimation" => Sampler::GradientEstimation,
            "gradient_estimation_cfg_pp" => Sampler::GradientEstimationCfgPp,
            "deis" => Sampler::Deis,
            "er_sde" => Sampler::ErSde,
            "seeds_2" => Sampler::Seeds2,
            "seeds_3" => Sampler::Seeds3,
            "dpm_fast" => Sampler::DpmFast,
            "dpm_adaptive" => Sampler::DpmAdaptive,
            "sa_solver" => Sampler::SaSolver,
            "sa_solver_pece" => Sampler::SaSolverPece,
            "uni_pc" => Sampler::UniPc,
            "uni_pc_bh2" => Sampler::UniPcBh2,
            _ => return None,
        })
    }

    /// The names built so far, for error messages.
    pub const BUILT: &'static [&'static str] = &[
        "euler",
        "ddim",
        "euler_ancestral",
        "heun",
        "dpm_2",
        "dpm_2_ancestral",
        "dpmpp_2s_ancestral",
        "dpmpp_2m",
        "ddpm",
        "lcm",
        "ipndm",
        "lms",
        "heunpp2",
        "ipndm_v",
        "res_multistep",
        "res_multistep_ancestral",
        "euler_cfg_pp",
        "euler_ancestral_cfg_pp",
        "dpmpp_2m_cfg_pp",
        "dpmpp_2s_ancestral_cfg_pp",
        "res_multistep_cfg_pp",
        "res_multistep_ancestral_cfg_pp",
        "dpmpp_2m_sde",
        "dpmpp_2m_sde_heun",
        "dpmpp_3m_sde",
        "dpmpp_sde",
        "gradient_estimation",
        "gradient_estimation_cfg_pp",
        "deis",
        "er_sde",
        "seeds_2",
        "seeds_3",
        "dpm_fast",
        "dpm_adaptive",
        "sa_solver",
        "sa_solver_pece",
        "uni_pc",
        "uni_pc_bh2",
    ];

    /// CFG++ samplers read the unconditional prediction of each model call
    /// too (ComfyUI's post-CFG hook; the negative runs even at cfg 1).
    pub fn needs_uncond(self) -> bool {
        matches!(
            self,
            Sampler::EulerCfgPp
                | Sampler::EulerAncestralCfgPp
                | Sampler::DpmPp2mCfgPp
                | Sampler::DpmPp2sAncestralCfgPp
                | Sampler::ResMultistepCfgPp
                | Sampler::ResMultistepAncestralCfgPp
                | Sampler::GradientEstimationCfgPp
        )
    }

    /// SDE samplers: ComfyUI draws their noise from torchsde's Brownian
    /// tree; sdkit from the same generator as ancestral samplers. Each
    /// step queries one interval, consecutive and disjoint, so the tree's
    /// normalized increments are independent standard normals too: the
    /// same distribution, not the same numbers.
    pub fn brownian(self) -> bool {
        matches!(
            self,
            Sampler::DpmPp2mSde | Sampler::DpmPp2mSdeHeun | Sampler::DpmPp3mSde | Sampler::DpmPpSde
        )
    }

    /// ComfyUI schedules one extra step and drops the penultimate sigma
    /// for these (`DISCARD_PENULTIMATE_SIGMA_SAMPLERS`).
    pub fn discards_penultimate_sigma(self) -> bool {
        matches!(
            self,
            Sampler::Dpm2 | Sampler::Dpm2Ancestral | Sampler::UniPc | Sampler::UniPcBh2
        )
    }

    /// Runs the sampler. `denoise(x, sigma)` is the model; `noise()`
    /// returns a fresh standard-normal draw of x's size; `step(i, total)`
    /// reports progress after each step and may stop the run.
    pub fn run<E>(
        self,
        x: Vec<f32>,
        sigmas: &[f32],
        denoise: impl FnMut(&[f32], f32) -> Result<Vec<f32>, E>,
        noise: impl FnMut() -> Vec<f32>,
        step: impl FnMut(usize, usize) -> Result<(), E>,
    ) -> Result<Vec<f32>, E> {
        let space = Space::default();
        self.run_with_uncond(space, x, sigmas, denoise, || None, noise, step)
    }

    /// Samplers that step in half-logSNR and so move a flow model's first
    /// sigma of 1 (infinite logit) just below it.
    fn offsets_first_sigma(self) -> bool {
        matches!(
            self,
            Sampler::DpmPpSde
                | Sampler::DpmPp2mSde
                | Sampler::DpmPp2mSdeHeun
                | Sampler::DpmPp3mSde
                | Sampler::ErSde
                | Sampler::Seeds2
                | Sampler::Seeds3
                | Sampler::SaSolver
                | Sampler::SaSolverPece
        )
    }

    /// [`Sampler::run`] in a model's sigma `space`, for CFG++ samplers
    /// too: `uncond()` returns the unconditional prediction of the latest
    /// `denoise` call (zeros where the caller has none).
    #[allow(clippy::too_many_arguments)]
    pub fn run_with_uncond<E>(
        self,
        space: Space,
        x: Vec<f32>,
        sigmas: &[f32],
        mut denoise: impl FnMut(&[f32], f32) -> Result<Vec<f32>, E>,
        uncond: impl Fn() -> Option<Vec<f32>>,
        mut noise: impl FnMut() -> Vec<f32>,
        mut step: impl FnMut(usize, usize) -> Result<(), E>,
    ) -> Result<Vec<f32>, E> {
        if self == Sampler::Ddim {
            return Sampler::Euler.run_with_uncond(space, x, sigmas, denoise, uncond, noise, step);
        }
        let len = x.len();
        let uncond = || uncond().unwrap_or_else(|| vec![0.0; len]);
        if self == Sampler::DpmFast {
            return dpm_fast(x, sigmas, denoise, step);
        }
        if self == Sampler::DpmAdaptive {
            return dpm_adaptive(x, sigmas, denoise, step);
        }
        if matches!(self, Sampler::UniPc | Sampler::UniPcBh2) {
            return uni_pc(x, sigmas, self == Sampler::UniPcBh2, denoise, step);
        }
        let sigmas: &[f32] = &if self.offsets_first_sigma() {
            space.offset_first(sigmas)
        } else {
            Cow::Borrowed(sigmas)
        };
        if matches!(self, Sampler::SaSolver | Sampler::SaSolverPece) {
            let pece = self == Sampler::SaSolverPece;
            return sa_solver(space, x, sigmas, pece, denoise, noise, step);
        }
        let n = sigmas.len().saturating_sub(1);
        let mut x = x;
        // Multistep history.
        let mut old_denoised: Option<Vec<f32>> = None;
        let mut old_sigma_down = 0f32;
        // SDE multistep history: the last two step sizes in half-logSNR.
        let (mut h_1, mut h_2): (Option<f32>, Option<f32>) = (None, None);
        let mut denoised_2: Option<Vec<f32>> = None;
        let deis = if self == Sampler::Deis {
            deis_coeffs(sigmas, 3)
        } else {
            Vec::new()
        };
        let mut buffer: Vec<Vec<f32>> = Vec::new();
        for i in 0..n {
            let (s, s_next) = (sigmas[i], sigmas[i + 1]);
            let denoised = denoise(&x, s)?;
            match self {
                Sampler::EulerAncestral | Sampler::Dpm2Ancestral | Sampler::DpmPp2sAncestral
                    if space.flow =>
                {
                    x = self.rf_ancestral_step(x, denoised, s, s_next, &mut denoise, &mut noise)?;
                }
                // Ddim runs as Euler (redirected above).
                Sampler::Euler | Sampler::Ddim => {
                    let dt = s_next - s;
                    for (xv, dv) in x.iter_mut().zip(&denoised) {
                        *xv += to_d(*xv, s, *dv) * dt;
                    }
                }
                Sampler::EulerAncestral => {
                    let (down, up) = ancestral_step(s, s_next);
                    if down == 0.0 {
                        x = denoised;
                    } else {
                        let dt = down - s;
                        let z = noise();
                        for ((xv, dv), zv) in x.iter_mut().zip(&denoised).zip(&z) {
                            *xv = *xv + to_d(*xv, s, *dv) * dt + *zv * up;
                        }
                    }
                }
                Sampler::Heun | Sampler::Dpm2 => {
                    let d: Vec<f32> = x
                        .iter()
                        .zip(&denoised)
                        .map(|(a, b)| to_d(*a, s, *b))
                        .collect();
                    if s_next == 0.0 {
                        let dt = s_next - s;
                        axpy(&mut x, &d, dt);
                    } else if self == Sampler::Heun {
                        let dt = s_next - s;
                        let x2: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b * dt).collect();
                        let den2 = denoise(&x2, s_next)?;
                        for (((xv, dv), x2v), e2) in x.iter_mut().zip(&d).zip(&x2).zip(&den2) {
                            let d2 = to_d(*x2v, s_next, *e2);
                            *xv += (dv + d2) / 2.0 * dt;
                        }
                    } else {
                        let mid = log_mid(s, s_next);
                        let (dt1, dt2) = (mid - s, s_next - s);
                        let x2: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b * dt1).collect();
                        let den2 = denoise(&x2, mid)?;
                        for ((xv, x2v), e2) in x.iter_mut().zip(&x2).zip(&den2) {
                            *xv += to_d(*x2v, mid, *e2) * dt2;
                        }
                    }
                }
                Sampler::Dpm2Ancestral => {
                    let (down, up) = ancestral_step(s, s_next);
                    let d: Vec<f32> = x
                        .iter()
                        .zip(&denoised)
                        .map(|(a, b)| to_d(*a, s, *b))
                        .collect();
                    if down == 0.0 {
                        axpy(&mut x, &d, down - s);
                    } else {
                        let mid = log_mid(s, down);
                        let (dt1, dt2) = (mid - s, down - s);
                        let x2: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b * dt1).collect();
                        let den2 = denoise(&x2, mid)?;
                        for ((xv, x2v), e2) in x.iter_mut().zip(&x2).zip(&den2) {
                            *xv += to_d(*x2v, mid, *e2) * dt2;
                        }
                        let z = noise();
                        axpy(&mut x, &z, up);
                    }
                }
                Sampler::DpmPp2sAncestral => {
                    let (down, up) = ancestral_step(s, s_next);
                    if down == 0.0 {
                        let dt = down - s;
                        for (xv, dv) in x.iter_mut().zip(&denoised) {
                            *xv += to_d(*xv, s, *dv) * dt;
                        }
                    } else {
                        // t = −log σ; σ(t) = exp(−t).
                        let (t, t_next) = (-s.ln(), -down.ln());
                        let h = t_next - t;
                        let sm = t + 0.5 * h;
                        let sig = |t: f32| (-t).exp();
                        let (a, b) = (sig(sm) / sig(t), (-h * 0.5).exp_m1());
                        let x2: Vec<f32> = x
                            .iter()
                            .zip(&denoised)
                            .map(|(xv, dv)| a * xv - b * dv)
                            .collect();
                        let den2 = denoise(&x2, sig(sm))?;
                        let (a, b) = (sig(t_next) / sig(t), (-h).exp_m1());
                        for (xv, dv) in x.iter_mut().zip(&den2) {
                            *xv = a * *xv - b * dv;
                        }
                    }
                    if s_next > 0.0 {
                        let z = noise();
                        axpy(&mut x, &z, up);
                    }
                }
                Sampler::DpmPp2m => {
                    let (t, t_next) = (-s.ln(), -s_next.ln());
                    let h = t_next - t;
                    let sig = |t: f32| (-t).exp();
                    let (a, b) = (sig(t_next) / sig(t), (-h).exp_m1());
                    match old_denoised.as_ref().filter(|_| s_next != 0.0) {
                        None => {
                            for (xv, dv) in x.iter_mut().zip(&denoised) {
                                *xv = a * *xv - b * dv;
                            }
                        }
                        Some(old) => {
                            let h_last = t - (-sigmas[i - 1].ln());
                            let r = h_last / h;
                            let c = 1.0 / (2.0 * r);
                            let c1 = 1.0 + c;
                            for ((xv, dv), ov) in x.iter_mut().zip(&denoised).zip(old) {
                                let dd = c1 * dv - c * ov;
                                *xv = a * *xv - b * dd;
                            }
                        }
                    }
                    old_denoised = Some(denoised);
                }
                Sampler::Ddpm => {
                    let k = (1.0f32 + s * s).sqrt();
                    let ac = 1.0 / ((s * s) + 1.0);
                    let acp = 1.0 / ((s_next * s_next) + 1.0);
                    let alpha = ac / acp;
                    let c0 = (1.0 / alpha).sqrt();
                    let c1 = 1.0 - alpha;
                    let c2 = (1.0 - ac).sqrt();
                    let z = (s_next > 0.0).then(&mut noise);
                    let c3 = ((1.0 - alpha) * (1.0 - acp) / (1.0 - ac)).sqrt();
                    let k_next = (1.0f32 + s_next * s_next).sqrt();
                    for (j, (xv, dv)) in x.iter_mut().zip(&denoised).enumerate() {
                        let eps = (*xv - dv) / s;
                        let xs = *xv / k;
                        let mut mu = c0 * (xs - c1 * eps / c2);
                        if let Some(z) = &z {
                            mu += c3 * z[j];
                        }
                        *xv = if s_next != 0.0 { mu * k_next } else { mu };
                    }
                }
                Sampler::Lcm => {
                    x = denoised;
                    if s_next > 0.0 {
                        // The model's noise_scaling: noise · σ + x, or for
                        // flow σ · noise + (1 − σ) · x.
                        let z = noise();
                        for (xv, zv) in x.iter_mut().zip(&z) {
                            *xv = if space.flow {
                                s_next * zv + (1.0 - s_next) * *xv
                            } else {
                                *xv + zv * s_next
                            };
                        }
                    }
                }
                Sampler::Lms => {
                    let d: Vec<f32> = x
                        .iter()
                        .zip(&denoised)
                        .map(|(a, b)| to_d(*a, s, *b))
                        .collect();
                    buffer.push(d);
                    if buffer.len() > 4 {
                        buffer.remove(0);
                    }
                    if s_next == 0.0 {
                        x = denoised;
                    } else {
                        let order = (i + 1).min(4);
                        let coeffs: Vec<f32> = (0..order)
                            .map(|j| lms_coeff(order, sigmas, i, j) as f32)
                            .collect();
                        for (k, xv) in x.iter_mut().enumerate() {
                            // sum(coeff * d for coeff, d in zip(coeffs, reversed(ds)))
                            let mut acc = 0f32;
                            for (c, d) in coeffs.iter().zip(buffer.iter().rev()) {
                                acc += c * d[k];
                            }
                            *xv += acc;
                        }
                    }
                }
                Sampler::HeunPp2 => {
                    let s_end = sigmas[n];
                    let dt = s_next - s;
                    let d: Vec<f32> = x
                        .iter()
                        .zip(&denoised)
                        .map(|(a, b)| to_d(*a, s, *b))
                        .collect();
                    if s_next == s_end {
                        axpy(&mut x, &d, dt);
                    } else {
                        let x2: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b * dt).collect();
                        let den2 = denoise(&x2, s_next)?;
                        let d2: Vec<f32> = x2
                            .iter()
                            .zip(&den2)
                            .map(|(a, b)| to_d(*a, s_next, *b))
                            .collect();
                        let s2 = sigmas[i + 2];
                        if s2 == s_end {
                            let w2 = s_next / (2.0 * sigmas[0]);
                            let w1 = 1.0 - w2;
                            for ((xv, dv), d2v) in x.iter_mut().zip(&d).zip(&d2) {
                                *xv += (dv * w1 + d2v * w2) * dt;
                            }
                        } else {
                            let dt2 = s2 - s_next;
                            let x3: Vec<f32> =
                                x2.iter().zip(&d2).map(|(a, b)| a + b * dt2).collect();
                            let den3 = denoise(&x3, s2)?;
                            let w = 3.0 * sigmas[0];
                            let (w2, w3) = (s_next / w, s2 / w);
                            let w1 = 1.0 - w2 - w3;
                            for (j, xv) in x.iter_mut().enumerate() {
                                let d3 = to_d(x3[j], s2, den3[j]);
                                *xv += (w1 * d[j] + w2 * d2[j] + w3 * d3) * dt;
                            }
                        }
                    }
                }
                Sampler::ResMultistep
                | Sampler::ResMultistepAncestral
                | Sampler::ResMultistepCfgPp
                | Sampler::ResMultistepAncestralCfgPp => {
                    let cfg_pp = matches!(
                        self,
                        Sampler::ResMultistepCfgPp | Sampler::ResMultistepAncestralCfgPp
                    );
                    let ancestral = matches!(
                        self,
                        Sampler::ResMultistepAncestral | Sampler::ResMultistepAncestralCfgPp
                    );
                    // CFG++ steps from the unconditional prediction.
                    let u = if cfg_pp { uncond() } else { Vec::new() };
                    let (down, up) = if ancestral {
                        ancestral_step(s, s_next)
                    } else {
                        (s_next, 0.0)
                    };
                    match old_denoised.as_ref().filter(|_| down != 0.0) {
                        None if cfg_pp => {
                            for (j, xv) in x.iter_mut().enumerate() {
                                *xv = denoised[j] + to_d(*xv, s, u[j]) * down;
                            }
                        }
                        None => {
                            let dt = down - s;
                            for (xv, dv) in x.iter_mut().zip(&denoised) {
                                *xv += to_d(*xv, s, *dv) * dt;
                            }
                        }
                        Some(old) => {
                            let (e, h, b1, b2) = res_coeffs(s, old_sigma_down, down, sigmas[i - 1]);
                            for (j, xv) in x.iter_mut().enumerate() {
                                *xv = if cfg_pp {
                                    let xs = *xv + (denoised[j] - u[j]);
                                    e * xs + h * (b1 * u[j] + b2 * old[j])
                                } else {
                                    e * *xv + h * (b1 * denoised[j] + b2 * old[j])
                                };
                            }
                        }
                    }
                    if s_next > 0.0 && up != 0.0 {
                        let z = noise();
                        axpy(&mut x, &z, up);
                    }
                    old_denoised = Some(if cfg_pp { u } else { denoised });
                    old_sigma_down = down;
                }
                Sampler::DpmPp2mSde | Sampler::DpmPp2mSdeHeun | Sampler::DpmPp3mSde => {
                    // eta = 1, s_noise = 1.
                    let mut h = None;
                    if s_next == 0.0 {
                        x = denoised.clone();
                    } else {
                        let (ls, lt) = (space.lambda(s), space.lambda(s_next));
                        let hv = lt - ls;
                        h = Some(hv);
                        let h_eta = hv * 2.0;
                        let alpha_t = s_next * lt.exp();
                        let a = s_next / s * (-hv).exp();
                        let em = -(-h_eta).exp_m1();
                        let b = alpha_t * em;
                        for (xv, dv) in x.iter_mut().zip(&denoised) {
                            *xv = a * *xv + b * dv;
                        }
                        let phi_2 = (-h_eta).exp_m1() / h_eta + 1.0;
                        match (self, old_denoised.as_ref(), h_1, denoised_2.as_ref(), h_2) {
                            (Sampler::DpmPp3mSde, Some(d1v), Some(h1), Some(d2v), Some(h2)) => {
                                let (r0, r1) = (h1 / hv, h2 / hv);
                                let phi_3 = phi_2 / h_eta - 0.5;
                                let (c1, c2) = (alpha_t * phi_2, alpha_t * phi_3);
                                for (j, xv) in x.iter_mut().enumerate() {
                                    let d1_0 = (denoised[j] - d1v[j]) / r0;
                                    let d1_1 = (d1v[j] - d2v[j]) / r1;
                                    let d1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1);
                                    let d2 = (d1_0 - d1_1) / (r0 + r1);
                                    *xv = *xv + c1 * d1 - c2 * d2;
                                }
                            }
                            (Sampler::DpmPp3mSde, Some(d1v), Some(h1), _, _) => {
                                let r = h1 / hv;
                                let c = alpha_t * phi_2;
                                for (j, xv) in x.iter_mut().enumerate() {
                                    *xv += c * ((denoised[j] - d1v[j]) / r);
                                }
                            }
                            (Sampler::DpmPp3mSde, ..) => {}
                            (_, Some(old), Some(h_last), _, _) => {
                                let r = h_last / hv;
                                let c = if self == Sampler::DpmPp2mSdeHeun {
                                    alpha_t * (em / -h_eta + 1.0) * (1.0 / r)
                                } else {
                                    0.5 * alpha_t * em * (1.0 / r)
                                };
                                for (j, xv) in x.iter_mut().enumerate() {
                                    *xv += c * (denoised[j] - old[j]);
                                }
                            }
                            _ => {}
                        }
                        let z = noise();
                        let k = (-(-2.0 * hv).exp_m1()).sqrt();
                        for (xv, zv) in x.iter_mut().zip(&z) {
                            *xv += zv * s_next * k;
                        }
                    }
                    denoised_2 = old_denoised.take();
                    old_denoised = Some(denoised);
                    h_2 = h_1;
                    h_1 = h;
                }
                Sampler::GradientEstimation | Sampler::GradientEstimationCfgPp => {
                    let cfg_pp = self == Sampler::GradientEstimationCfgPp;
                    let base = if cfg_pp { uncond() } else { denoised.clone() };
                    let d: Vec<f32> = x.iter().zip(&base).map(|(a, b)| to_d(*a, s, *b)).collect();
                    let dt = s_next - s;
                    if s_next == 0.0 {
                        x = denoised;
                    } else {
                        for (j, xv) in x.iter_mut().enumerate() {
                            *xv = if cfg_pp {
                                denoised[j] + d[j] * s_next
                            } else {
                                *xv + d[j] * dt
                            };
                        }
                        if let Some(old) = old_denoised.as_ref().filter(|_| i >= 1) {
                            // ge_gamma = 2: d_bar = (2 − 1)·(d − d_old).
                            for (j, xv) in x.iter_mut().enumerate() {
                                *xv += (1.0 * (d[j] - old[j])) * dt;
                            }
                        }
                    }
                    // Here `old_denoised` holds the previous derivative.
                    old_denoised = Some(d);
                }
                Sampler::DpmPpSde => {
                    if s_next == 0.0 {
                        x = denoised;
                    } else {
                        // r = 1/2, eta = 1.
                        let (ls, lt) = (space.lambda(s), space.lambda(s_next));
                        let h = lt - ls;
                        let ls1 = ls + 0.5 * h;
                        // fac = 1 / (2r) = 1 for r = 1/2.
                        let fac = 1.0f32;
                        let s1 = space.sigma(ls1);
                        let alpha_s = s * ls.exp();
                        let alpha_s1 = s1 * ls1.exp();
                        let alpha_t = s_next * lt.exp();
                        // Brownian increments over [s1, s] and [s_next, s1]:
                        // the second query's interval contains the first's.
                        let (za, zb) = (noise(), noise());
                        let (w1, w2) = (f64::from(s - s1), f64::from(s1 - s_next));
                        let (ka, kb) = (
                            (w1 / (w1 + w2)).sqrt() as f32,
                            (w2 / (w1 + w2)).sqrt() as f32,
                        );
                        let (sd, su) = ancestral_step((-ls).exp(), (-ls1).exp());
                        let h_ = -sd.ln() - ls;
                        let (a, b) = (
                            (alpha_s1 / alpha_s) * (-h_).exp(),
                            alpha_s1 * (-h_).exp_m1(),
                        );
                        let x2: Vec<f32> = (0..x.len())
                            .map(|j| a * x[j] - b * denoised[j] + alpha_s1 * za[j] * su)
                            .collect();
                        let den2 = denoise(&x2, s1)?;
                        let (sd, su) = ancestral_step((-ls).exp(), (-lt).exp());
                        let h_ = -sd.ln() - ls;
                        let (a, b) = ((alpha_t / alpha_s) * (-h_).exp(), alpha_t * (-h_).exp_m1());
                        for (j, xv) in x.iter_mut().enumerate() {
                            let dd = (1.0 - fac) * denoised[j] + fac * den2[j];
                            let z = ka * za[j] + kb * zb[j];
                            *xv = a * *xv - b * dd + alpha_t * z * su;
                        }
                    }
                }
                Sampler::ErSde => {
                    // VP ER-SDE-Solver-3 (arXiv 2309.06169), s_noise 1.
                    // er_lambda = σ/α = exp(−half-logSNR).
                    let lam = |k: usize| (-space.lambda(sigmas[k])).exp();
                    let scaler = |v: f32| v * ((v.powf(0.3)).exp() + 10.0);
                    if s_next == 0.0 {
                        x = denoised.clone();
                    } else {
                        let stage = (i + 1).min(3);
                        let (ls, lt) = (lam(i), lam(i + 1));
                        let (alpha_s, alpha_t) = (s / ls, s_next / lt);
                        let r_alpha = alpha_t / alpha_s;
                        let r = scaler(lt) / scaler(ls);
                        let (a, b) = (r_alpha * r, alpha_t * (1.0 - r));
                        for (xv, dv) in x.iter_mut().zip(&denoised) {
                            *xv = a * *xv + b * dv;
                        }
                        if let (true, Some(old)) = (stage >= 2, old_denoised.as_ref()) {
                            let dt = lt - ls;
                            let step = -dt / 200.0;
                            let pos: Vec<f32> = (0..200).map(|k| lt + k as f32 * step).collect();
                            let scaled: Vec<f32> = pos.iter().map(|&p| scaler(p)).collect();
                            let sum = |f: &dyn Fn(usize) -> f32| -> f32 {
                                (0..200).map(|k| f64::from(f(k))).sum::<f64>() as f32
                            };
                            let s1 = sum(&|k| 1.0 / scaled[k]) * step;
                            let c2 = alpha_t * (dt + s1 * scaler(lt));
                            let den_d: Vec<f32> = denoised
                                .iter()
                                .zip(old)
                                .map(|(d, o)| (d - o) / (ls - lam(i - 1)))
                                .collect();
                            for (xv, dd) in x.iter_mut().zip(&den_d) {
                                *xv += c2 * dd;
                            }
                            if let (true, Some(old_d)) = (stage >= 3, denoised_2.as_ref()) {
                                let su = sum(&|k| (pos[k] - ls) / scaled[k]) * step;
                                let c3 = alpha_t * ((dt * dt) / 2.0 + su * scaler(lt));
                                let half = (ls - lam(i - 2)) / 2.0;
                                for ((xv, dd), od) in x.iter_mut().zip(&den_d).zip(old_d) {
                                    *xv += c3 * ((dd - od) / half);
                                }
                            }
                            // Here `denoised_2` keeps the previous difference
                            // quotient (k-diffusion's old_denoised_d).
                            denoised_2 = Some(den_d);
                        }
                        let k = nan_to_num((lt * lt - (ls * ls) * (r * r)).sqrt());
                        let z = noise();
                        for (xv, zv) in x.iter_mut().zip(&z) {
                            *xv += alpha_t * zv * k;
                        }
                    }
                    old_denoised = Some(denoised);
                }
                // Run whole before the loop.
                Sampler::DpmFast
                | Sampler::DpmAdaptive
                | Sampler::SaSolver
                | Sampler::SaSolverPece
                | Sampler::UniPc
                | Sampler::UniPcBh2 => {}
                Sampler::Seeds2 | Sampler::Seeds3 if s_next == 0.0 => {
                    x = denoised;
                }
                Sampler::Seeds2 | Sampler::Seeds3 => {
                    // SEEDS (arXiv 2305.14267), eta = 1, s_noise = 1.
                    let (ls, lt) = (space.lambda(s), space.lambda(s_next));
                    let h = lt - ls;
                    let h_eta = h * 2.0;
                    let phi1 = |v: f32| v.exp_m1();
                    let phi2 = |v: f32| (v.exp_m1() - v) / v;
                    let alpha_t = s_next * lt.exp();
                    // Intermediate point at fraction r: (σ, α, x) after a
                    // first-order step from x with `den`.
                    let (r1, r2) = if self == Sampler::Seeds2 {
                        (0.5f64, 1.0f64)
                    } else {
                        (1.0 / 3.0, 2.0 / 3.0)
                    };
                    let at = |r: f64| -> (f32, f32) {
                        let l = torch_lerp(ls, lt, r as f32);
                        let sig = space.sigma(l);
                        (sig, sig * l.exp())
                    };
                    let (s1, a1) = at(r1);
                    let (rf1, rf2) = (r1 as f32, r2 as f32);
                    let c_x = s1 / s * (-rf1 * h * 1.0).exp();
                    let c_d = a1 * phi1(-rf1 * h_eta);
                    let k1 = (-((-2.0 * r1) as f32 * h * 1.0).exp_m1()).sqrt();
                    let z1 = noise();
                    let mut sde: Vec<f32> = z1.iter().map(|z| k1 * z).collect();
                    let x2: Vec<f32> = (0..x.len())
                        .map(|j| c_x * x[j] - c_d * denoised[j] + sde[j] * s1 * 1.0)
                        .collect();
                    let den2 = denoise(&x2, s1)?;
                    let mut renoise = |sde: &mut Vec<f32>, r_from: f64, r_to: f64| {
                        let sf = ((r_from - r_to) as f32) * h * 1.0;
                        let (e, k) = (sf.exp(), (-(sf * 2.0).exp_m1()).sqrt());
                        let z = noise();
                        for (v, zv) in sde.iter_mut().zip(&z) {
                            *v = *v * e + k * zv;
                        }
                    };
                    let c_x = s_next / s * (-h * 1.0).exp();
                    if self == Sampler::Seeds2 {
                        // denoised_d = lerp(denoised, denoised_2, 1/(2r) = 1).
                        let c_d = alpha_t * phi1(-h_eta);
                        for j in 0..x.len() {
                            let dd = torch_lerp(denoised[j], den2[j], 1.0);
                            x[j] = c_x * x[j] - c_d * dd;
                        }
                        renoise(&mut sde, r1, 1.0);
                    } else {
                        let (s2, a2) = at(r2);
                        let a3_2 = (r2 / r1) as f32 * phi2(-rf2 * h_eta);
                        let a3_1 = phi1(-rf2 * h_eta) - a3_2;
                        let c_x3 = s2 / s * (-rf2 * h * 1.0).exp();
                        renoise(&mut sde, r1, r2);
                        let x3: Vec<f32> = (0..x.len())
                            .map(|j| {
                                c_x3 * x[j] - a2 * (a3_1 * denoised[j] + a3_2 * den2[j])
                                    + sde[j] * s2 * 1.0
                            })
                            .collect();
                        let den3 = denoise(&x3, s2)?;
                        let b3 = phi2(-h_eta) / rf2;
                        let b1 = phi1(-h_eta) - b3;
                        for j in 0..x.len() {
                            x[j] = c_x * x[j] - alpha_t * (b1 * denoised[j] + b3 * den3[j]);
                        }
                        renoise(&mut sde, r2, 1.0);
                    }
                    for (xv, v) in x.iter_mut().zip(&sde) {
                        *xv += v * s_next * 1.0;
                    }
                }
                Sampler::Deis => {
                    let d: Vec<f32> = x.iter().zip(&denoised).map(|(a, b)| (a - b) / s).collect();
                    let order = if s_next <= 0.0 { 1 } else { (i + 1).min(3) };
                    let b = &buffer;
                    let l = b.len();
                    if order == 1 {
                        let dt = s_next - s;
                        for (xv, dv) in x.iter_mut().zip(&d) {
                            *xv += dt * dv;
                        }
                    } else {
                        let c = &deis[i];
                        for (j, xv) in x.iter_mut().enumerate() {
                            let mut v = *xv + c[0] * d[j];
                            for (k, ck) in c.iter().enumerate().skip(1) {
                                v += ck * b[l - k][j];
                            }
                            *xv = v;
                        }
                    }
                    if buffer.len() == 2 {
                        buffer.remove(0);
                    }
                    buffer.push(d);
                }
                Sampler::IpndmV => {
                    let d: Vec<f32> = x.iter().zip(&denoised).map(|(a, b)| (a - b) / s).collect();
                    let order = (i + 1).min(4);
                    if s_next == 0.0 {
                        x = denoised;
                    } else {
                        let c = ipndm_v_coeffs(order, sigmas, i);
                        let dt = s_next - s;
                        let b = &buffer;
                        let l = b.len();
                        for (j, xv) in x.iter_mut().enumerate() {
                            let mut acc = c[0] * d[j];
                            for (k, ck) in c.iter().enumerate().skip(1) {
                                acc += ck * b[l - k][j];
                            }
                            *xv += dt * acc;
                        }
                    }
                    if buffer.len() == 3 {
                        buffer.remove(0);
                    }
                    buffer.push(d);
                }
                Sampler::EulerCfgPp | Sampler::EulerAncestralCfgPp => {
                    if s_next == 0.0 {
                        x = denoised;
                    } else {
                        let u = uncond();
                        // alpha = σ·exp(half-logSNR) (1 up to rounding for eps).
                        let alpha_s = s * space.lambda(s).exp();
                        let alpha_t = s_next * space.lambda(s_next).exp();
                        let ancestral = self == Sampler::EulerAncestralCfgPp;
                        let (down, up) = if ancestral {
                            ancestral_step(s / alpha_s, s_next / alpha_t)
                        } else {
                            (s_next / alpha_t, 0.0)
                        };
                        let down = alpha_t * down;
                        let z = ancestral.then(&mut noise);
                        for (j, xv) in x.iter_mut().enumerate() {
                            let d = to_d(*xv, s, alpha_s * u[j]);
                            let mut v = alpha_t * denoised[j] + down * d;
                            if let Some(z) = &z {
                                v += alpha_t * z[j] * up;
                            }
                            *xv = v;
                        }
                    }
                }
                Sampler::DpmPp2mCfgPp => {
                    let u = uncond();
                    let (t, t_next) = (-s.ln(), -s_next.ln());
                    let h = t_next - t;
                    let e = (-h).exp();
                    let em1 = (-h).exp_m1();
                    let old = old_denoised.as_ref().filter(|_| s_next != 0.0);
                    let c = old.map(|_| {
                        let h_last = t - (-sigmas[i - 1].ln());
                        1.0 / (2.0 * (h_last / h))
                    });
                    for (j, xv) in x.iter_mut().enumerate() {
                        let mut mix = -e * u[j];
                        if let (Some(o), Some(c)) = (old, c) {
                            mix -= em1 * c * (denoised[j] - o[j]);
                        }
                        *xv = denoised[j] + mix + e * *xv;
                    }
                    old_denoised = Some(u);
                }
                Sampler::DpmPp2sAncestralCfgPp => {
                    let u = uncond();
                    let (down, up) = ancestral_step(s, s_next);
                    if down == 0.0 {
                        for (j, xv) in x.iter_mut().enumerate() {
                            *xv = denoised[j] + to_d(*xv, s, u[j]) * down;
                        }
                    } else {
                        let (t, t_next) = (-s.ln(), -down.ln());
                        let h = t_next - t;
                        let sm = t + 0.5 * h;
                        let sig = |t: f32| (-t).exp();
                        let (a, b) = (sig(sm) / sig(t), (-h * 0.5).exp_m1());
                        let x2: Vec<f32> = (0..x.len())
                            .map(|j| a * (x[j] + (denoised[j] - u[j])) - b * denoised[j])
                            .collect();
                        let den2 = denoise(&x2, sig(sm))?;
                        // ComfyUI's hook has replaced the unconditional
                        // prediction with the midpoint call's by now.
                        let u = uncond();
                        let (a, b) = (sig(t_next) / sig(t), (-h).exp_m1());
                        for (j, xv) in x.iter_mut().enumerate() {
                            *xv = a * (*xv + (denoised[j] - u[j])) - b * den2[j];
                        }
                    }
                    if s_next > 0.0 {
                        let z = noise();
                        axpy(&mut x, &z, up);
                    }
                }
                Sampler::Ipndm => {
                    let d: Vec<f32> = x.iter().zip(&denoised).map(|(a, b)| (a - b) / s).collect();
                    let order = (i + 1).min(4);
                    let dt = s_next - s;
                    if s_next == 0.0 {
                        x = denoised;
                    } else {
                        let b = &buffer;
                        let l = b.len();
                        for (j, xv) in x.iter_mut().enumerate() {
                            let dc = d[j];
                            let inc = match order {
                                1 => dt * dc,
                                2 => dt * (3.0 * dc - b[l - 1][j]) / 2.0,
                                3 => {
                                    dt * (23.0 * dc - 16.0 * b[l - 1][j] + 5.0 * b[l - 2][j]) / 12.0
                                }
                                _ => {
                                    dt * (55.0 * dc - 59.0 * b[l - 1][j] + 37.0 * b[l - 2][j]
                                        - 9.0 * b[l - 3][j])
                                        / 24.0
                                }
                            };
                            *xv += inc;
                        }
                    }
                    if buffer.len() == 3 {
                        buffer.remove(0);
                    }
                    buffer.push(d);
                }
            }
            step(i + 1, n)?;
        }
        Ok(x)
    }
}

impl Sampler {
    /// One step of the rectified-flow ancestral samplers ComfyUI runs for
    /// CONST models (`sample_euler_ancestral_RF`, `sample_dpm_2_ancestral_RF`,
    /// `sample_dpmpp_2s_ancestral_RF`; eta 1): step down to σ_down =
    /// σ_next²/σ, then rescale by α_next/α_down and renoise.
    fn rf_ancestral_step<E>(
        self,
        mut x: Vec<f32>,
        denoised: Vec<f32>,
        s: f32,
        s_next: f32,
        denoise: &mut impl FnMut(&[f32], f32) -> Result<Vec<f32>, E>,
        noise: &mut impl FnMut() -> Vec<f32>,
    ) -> Result<Vec<f32>, E> {
        let ratio = 1.0 + (s_next / s - 1.0);
        let down = s_next * ratio;
        let (a_next, a_down) = (1.0 - s_next, 1.0 - down);
        let renoise =
            (s_next * s_next - down * down * (a_next * a_next) / (a_down * a_down)).sqrt();
        // x ← r·x + (1 − r)·D with r = σ_target/σ (an Euler step in flow).
        let blend = |x: &mut [f32], d: &[f32], target: f32| {
            let r = target / s;
            for (xv, dv) in x.iter_mut().zip(d) {
                *xv = r * *xv + (1.0 - r) * dv;
            }
        };
        let mut renoised = true;
        match self {
            Sampler::EulerAncestral => {
                if s_next == 0.0 {
                    return Ok(denoised);
                }
                blend(&mut x, &denoised, down);
            }
            Sampler::Dpm2Ancestral => {
                let d: Vec<f32> = x
                    .iter()
                    .zip(&denoised)
                    .map(|(a, b)| to_d(*a, s, *b))
                    .collect();
                if down == 0.0 {
                    axpy(&mut x, &d, down - s);
                    renoised = false;
                } else {
                    let mid = log_mid(s, down);
                    let x2: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b * (mid - s)).collect();
                    let den2 = denoise(&x2, mid)?;
                    let dt2 = down - s;
                    for ((xv, x2v), e2) in x.iter_mut().zip(&x2).zip(&den2) {
                        *xv += to_d(*x2v, mid, *e2) * dt2;
                    }
                }
            }
            _ => {
                if s_next == 0.0 {
                    let dt = down - s;
                    for (xv, dv) in x.iter_mut().zip(&denoised) {
                        *xv += to_d(*xv, s, *dv) * dt;
                    }
                    return Ok(x);
                }
                let mid = if s == 1.0 {
                    0.9999
                } else {
                    // λ = log((1 − σ)/σ), σ(λ) = (e^λ + 1)⁻¹, midway to σ_down.
                    let lam = |v: f32| ((1.0 - v) / v).ln();
                    let (t, t_down) = (lam(s), lam(down));
                    let sm = t + 0.5 * (t_down - t);
                    1.0 / (sm.exp() + 1.0)
                };
                let mut u = x.clone();
                blend(&mut u, &denoised, mid);
                let d_mid = denoise(&u, mid)?;
                blend(&mut x, &d_mid, down);
            }
        }
        if renoised {
            let z = noise();
            let a = a_next / a_down;
            for (xv, zv) in x.iter_mut().zip(&z) {
                *xv = a * *xv + zv * renoise;
            }
        }
        Ok(x)
    }
}

/// k-diffusion's `linear_multistep_coeff`: the integral over
/// [σ_i, σ_{i+1}] of the Lagrange basis polynomial j on the last `order`
/// sigmas, in f64. The integrand is a polynomial of degree < 4, which
/// 4-point Gauss–Legendre integrates exactly (scipy's quad agrees to
/// rounding).
fn lms_coeff(order: usize, t: &[f32], i: usize, j: usize) -> f64 {
    let basis = |tau: f64| -> f64 {
        let mut prod = 1.0;
        for k in 0..order {
            if k != j {
                let (tk, tj) = (f64::from(t[i - k]), f64::from(t[i - j]));
                prod *= (tau - tk) / (tj - tk);
            }
        }
        prod
    };
    const NODES: [(f64, f64); 4] = [
        (-0.861_136_311_594_052_6, 0.347_854_845_137_453_85),
        (-0.339_981_043_584_856_26, 0.652_145_154_862_546_1),
        (0.339_981_043_584_856_26, 0.652_145_154_862_546_1),
        (0.861_136_311_594_052_6, 0.347_854_845_137_453_85),
    ];
    let (a, b) = (f64::from(t[i]), f64::from(t[i + 1]));
    let (half, mid) = ((b - a) / 2.0, (a + b) / 2.0);
    NODES
        .iter()
        .map(|(x, w)| w * basis(mid + half * x))
        .sum::<f64>()
        * half
}

/// res_multistep's second-order step (arXiv 2308.02157) from σ to σ_down,
/// given the previous step's σ and σ_down: (exp(−h), h, b1, b2).
fn res_coeffs(s: f32, old_down: f32, down: f32, prev: f32) -> (f32, f32, f32, f32) {
    let t_fn = |sigma: f32| -sigma.ln();
    let (t, t_old, t_next, t_prev) = (t_fn(s), t_fn(old_down), t_fn(down), t_fn(prev));
    let h = t_next - t;
    let c2 = (t_prev - t_old) / h;
    let phi1 = (-h).exp_m1() / -h;
    let phi2 = (phi1 - 1.0) / -h;
    let b1 = nan_to_num(phi1 - phi2 / c2);
    let b2 = nan_to_num(phi2 / c2);
    ((-h).exp(), h, b1, b2)
}

/// DEIS ("tab" mode) coefficients per step, as ComfyUI's deis.py computes
/// them in f32: sigmas mapped to VP time with EDM's constants, then for
/// each step of order > 1 a 10000-point Riemann sum of the exponential
/// integrand times each Lagrange basis polynomial on the last `order`
/// times (sums accumulated in f64).
fn deis_coeffs(sigmas: &[f32], max_order: usize) -> Vec<Vec<f32>> {
    let (eps_s, smin, smax) = (1e-3f32, 0.002f32, 80f32);
    let beta_d =
        2.0 * ((smin * smin + 1.0).ln() / eps_s - (smax * smax + 1.0).ln()) / (eps_s - 1.0);
    let beta_min = (smax * smax + 1.0).ln() - 0.5 * beta_d;
    let (b0, b1) = (beta_min, beta_d + beta_min);
    let t: Vec<f32> = sigmas
        .iter()
        .map(|&s| {
            ((beta_min * beta_min + 2.0 * beta_d * (s * s + 1.0).ln()).sqrt() - beta_min) / beta_d
        })
        .collect();
    const N: usize = 10_000;
    let mut out = Vec::new();
    for i in 0..t.len().saturating_sub(1) {
        let order = (i + 1).min(max_order);
        if order == 1 {
            out.push(Vec::new());
            continue;
        }
        let (tc, tn) = (t[i], t[i + 1]);
        let dtau = (tn - tc) / N as f32;
        let taus = linspace_f32(tc, tn, N);
        let prev: Vec<f32> = (0..order).map(|k| t[i - k]).collect();
        let integrand: Vec<f32> = taus
            .iter()
            .map(|&tau| {
                let alpha = (-0.5 * (tau * tau) * (b1 - b0) - tau * b0).exp();
                // d/dτ log α, as autograd finds it.
                let dlog = -(tau * (b1 - b0)) - b0;
                -0.5 * dlog / (alpha * (1.0 - alpha)).sqrt()
            })
            .collect();
        let coeffs = (0..order)
            .map(|j| {
                let sum: f64 = taus
                    .iter()
                    .zip(&integrand)
                    .map(|(&tau, &g)| {
                        let mut poly = 1f32;
                        for (k, &pk) in prev.iter().enumerate() {
                            if k != j {
                                poly *= (tau - pk) / (prev[j] - pk);
                            }
                        }
                        f64::from(g * poly)
                    })
                    .sum();
                sum as f32 * dtau
            })
            .collect();
        out.push(coeffs);
    }
    out
}

/// DPM-Solver-Fast (eta 0), as ComfyUI's `dpm_fast` runs it: from the
/// first sigma to the last nonzero one in `len − 1` model evaluations,
/// evenly spaced in t = −log σ, third-order steps with a final second- or
/// first-order one.
fn dpm_fast<E>(
    mut x: Vec<f32>,
    sigmas: &[f32],
    mut denoise: impl FnMut(&[f32], f32) -> Result<Vec<f32>, E>,
    mut step: impl FnMut(usize, usize) -> Result<(), E>,
) -> Result<Vec<f32>, E> {
    if sigmas.len() <= 1 {
        return Ok(x);
    }
    let nfe = sigmas.len() - 1;
    let (t_start, t_end) = dpm_range(sigmas);
    let m = nfe / 3 + 1;
    let ts = linspace_f32(t_start, t_end, m + 1);
    let mut orders = if nfe.is_multiple_of(3) {
        let mut o = vec![3; m.saturating_sub(2)];
        o.extend([2, 1]);
        o
    } else {
        let mut o = vec![3; m - 1];
        o.push(nfe % 3);
        o
    };
    orders.truncate(ts.len() - 1);
    let sig = |t: f32| (-t).exp();
    let mut eps_at = |x: &[f32], t: f32| -> Result<Vec<f32>, E> {
        let s = sig(t);
        let d = denoise(x, s)?;
        Ok(x.iter().zip(&d).map(|(a, b)| (a - b) / s).collect())
    };
    let total = orders.len();
    for (i, &order) in orders.iter().enumerate() {
        let (t, tn) = (ts[i], ts[i + 1]);
        let h = tn - t;
        let (sn, em) = (sig(tn), h.exp_m1());
        let eps = eps_at(&x, t)?;
        match order {
            1 => {
                for (xv, e) in x.iter_mut().zip(&eps) {
                    *xv -= sn * em * e;
                }
            }
            2 => {
                let r1 = 0.5f32;
                let s1 = t + r1 * h;
                let c1 = sig(s1) * (r1 * h).exp_m1();
                let u1: Vec<f32> = x.iter().zip(&eps).map(|(a, e)| a - c1 * e).collect();
                let e1 = eps_at(&u1, s1)?;
                let c = sn / (2.0 * r1) * em;
                for ((xv, e), f) in x.iter_mut().zip(&eps).zip(&e1) {
                    *xv = *xv - sn * em * e - c * (f - e);
                }
            }
            _ => {
                let (r1, r2) = ((1.0f64 / 3.0) as f32, (2.0f64 / 3.0) as f32);
                let (s1, s2) = (t + r1 * h, t + r2 * h);
                let c1 = sig(s1) * (r1 * h).exp_m1();
                let u1: Vec<f32> = x.iter().zip(&eps).map(|(a, e)| a - c1 * e).collect();
                let e1 = eps_at(&u1, s1)?;
                let (ca, cb) = (
                    sig(s2) * (r2 * h).exp_m1(),
                    sig(s2) * (2.0f64 as f32) * ((r2 * h).exp_m1() / (r2 * h) - 1.0),
                );
                let u2: Vec<f32> = (0..x.len())
                    .map(|j| x[j] - ca * eps[j] - cb * (e1[j] - eps[j]))
                    .collect();
                let e2 = eps_at(&u2, s2)?;
                let c = sn / r2 * (em / h - 1.0);
                for ((xv, e), f) in x.iter_mut().zip(&eps).zip(&e2) {
                    *xv = *xv - sn * em * e - c * (f - e);
                }
            }
        }
        step(i + 1, total)?;
    }
    Ok(x)
}

/// The sigma range ComfyUI's DPM-Solver wrappers use: first sigma to the
/// last nonzero one, as t = −log σ.
fn dpm_range(sigmas: &[f32]) -> (f32, f32) {
    let n = sigmas.len() - 1;
    let mut smin = sigmas[n];
    if smin == 0.0 {
        smin = sigmas[n - 1];
    }
    (-sigmas[0].ln(), -smin.ln())
}

/// A DPM-Solver step's scalars: h = t_next − t, σ(t_next), expm1(h).
struct DpmStep {
    h: f32,
    sn: f32,
    em: f32,
}

/// DPM-Solver-23 with adaptive step size (eta 0; rtol 0.05, atol 0.0078,
/// h_init 0.05, PID with integral gain 1, accept safety 0.81), as
/// ComfyUI's `dpm_adaptive` runs it. The step controller works in f64 and
/// the error norm in f32, as there; the step callback reports accepted
/// steps (their count is not known ahead).
fn dpm_adaptive<E>(
    mut x: Vec<f32>,
    sigmas: &[f32],
    mut denoise: impl FnMut(&[f32], f32) -> Result<Vec<f32>, E>,
    mut step: impl FnMut(usize, usize) -> Result<(), E>,
) -> Result<Vec<f32>, E> {
    if sigmas.len() <= 1 {
        return Ok(x);
    }
    let (t_start, t_end) = dpm_range(sigmas);
    let sig = |t: f32| (-t).exp();
    let mut eps_at = |x: &[f32], t: f32| -> Result<Vec<f32>, E> {
        let s = sig(t);
        let d = denoise(x, s)?;
        Ok(x.iter().zip(&d).map(|(a, b)| (a - b) / s).collect())
    };
    let (atol, rtol) = (0.0078f32, 0.05f32);
    // PID: b1 = 1/order, b2 = b3 = 0; errs as k-diffusion keeps them.
    let (b1, b2, b3) = (1.0 / 3.0, -0.0, 0.0);
    let mut h = 0.05f64;
    let mut errs: Vec<f64> = Vec::new();
    let mut s = t_start;
    let mut x_prev = x.clone();
    let mut accepted = 0;
    let n = x.len();
    while s < t_end - 1e-5 {
        let t = t_end.min(s + h as f32);
        let st = DpmStep {
            h: t - s,
            sn: sig(t),
            em: (t - s).exp_m1(),
        };
        let eps = eps_at(&x, s)?;
        let (r1, r2) = ((1.0f64 / 3.0) as f32, (2.0f64 / 3.0) as f32);
        let (s1, s2) = (s + r1 * st.h, s + r2 * st.h);
        let c1 = sig(s1) * (r1 * st.h).exp_m1();
        let u1: Vec<f32> = x.iter().zip(&eps).map(|(a, e)| a - c1 * e).collect();
        let e1 = eps_at(&u1, s1)?;
        // Low order: the 2-step with r1 = 1/3.
        let c_low = st.sn / ((2.0 * (1.0f64 / 3.0)) as f32) * st.em;
        let x_low: Vec<f32> = (0..n)
            .map(|j| x[j] - st.sn * st.em * eps[j] - c_low * (e1[j] - eps[j]))
            .collect();
        // High order: the 3-step.
        let (ca, cb) = (
            sig(s2) * (r2 * st.h).exp_m1(),
            sig(s2) * (2.0f64 as f32) * ((r2 * st.h).exp_m1() / (r2 * st.h) - 1.0),
        );
        let u2: Vec<f32> = (0..n)
            .map(|j| x[j] - ca * eps[j] - cb * (e1[j] - eps[j]))
            .collect();
        let e2 = eps_at(&u2, s2)?;
        let c_high = st.sn / r2 * (st.em / st.h - 1.0);
        let x_high: Vec<f32> = (0..n)
            .map(|j| x[j] - st.sn * st.em * eps[j] - c_high * (e2[j] - eps[j]))
            .collect();
        let sq: f64 = (0..n)
            .map(|j| {
                let delta = atol.max(rtol * x_low[j].abs().max(x_prev[j].abs()));
                let v = (x_low[j] - x_high[j]) / delta;
                f64::from(v * v)
            })
            .sum();
        let error = f64::from((sq.sqrt() as f32) / (n as f32).sqrt());
        let inv = 1.0 / (error + 1e-8);
        if errs.is_empty() {
            errs = vec![inv; 3];
        }
        errs[0] = inv;
        let factor = errs[0].powf(b1) * errs[1].powf(b2) * errs[2].powf(b3);
        let factor = 1.0 + (factor - 1.0).atan();
        let accept = factor >= 0.81;
        if accept {
            errs[2] = errs[1];
            errs[1] = errs[0];
        }
        h *= factor;
        if accept {
            x_prev = x_low;
            x = x_high;
            s = t;
            accepted += 1;
            step(accepted, accepted)?;
        }
    }
    Ok(x)
}

/// SA-Solver's b coefficients (eqs. 15 and 18 of the paper): the
/// exponential integrals of the Lagrange basis on `lambdas`, from
/// `lambda_s` to `lambda_t`, times α_t. f32 as ComfyUI computes them,
/// except the small Vandermonde solve (f64 Gaussian elimination where
/// torch calls LAPACK in f32).
fn sa_coeffs(sigma_next: f32, lambdas: &[f32], lambda_s: f32, lambda_t: f32, tau: f64) -> Vec<f32> {
    let n = lambdas.len();
    let tau_mul = 1.0 + tau * tau;
    let h = lambda_t - lambda_s;
    let e = (-(tau_mul as f32) * h).exp();
    let product: Vec<f32> = (0..n)
        .map(|p| lambda_t.powf(p as f32) - lambda_s.powf(p as f32) * e)
        .collect();
    // log p! via lgamma(p + 1), exact for these small p.
    let log_fact: Vec<f32> = (0..n)
        .map(|p| (1..=p).map(|k| (k as f64).ln()).sum::<f64>() as f32)
        .collect();
    let exp_coeffs: Vec<f32> = (0..n)
        .map(|i| {
            let mut acc = 0f32;
            for j in 0..=i {
                let depth = (i - j) as f32;
                let mut c = log_fact[i] - log_fact[j];
                if tau > 0.0 {
                    c -= depth * (tau_mul.ln() as f32);
                }
                let sign = if (i - j) % 2 == 0 { 1.0 } else { -1.0 };
                acc += c.exp() * sign * product[j];
            }
            acc
        })
        .collect();
    // Solve Vᵀ a = exp_coeffs with V the Vandermonde matrix of `lambdas`.
    let vt: Vec<Vec<f64>> = (0..n)
        .map(|k| {
            lambdas
                .iter()
                .map(|&l| f64::from(l).powi(k as i32))
                .collect()
        })
        .collect();
    let rhs: Vec<f64> = exp_coeffs.iter().map(|&v| f64::from(v)).collect();
    let a = solve_small(&vt, &rhs);
    let alpha_t = sigma_next * lambda_t.exp();
    a.iter().map(|&v| alpha_t * v as f32).collect()
}

/// SA-Solver (NeurIPS 2023) as ComfyUI runs it: predictor order 3,
/// corrector order 4, stochastic (tau 1) between the sigmas at 20% and 80%
/// of the schedule, lower orders at the end; PECE re-evaluates the
/// corrected state.
fn sa_solver<E>(
    space: Space,
    x: Vec<f32>,
    sigmas: &[f32],
    pece: bool,
    mut denoise: impl FnMut(&[f32], f32) -> Result<Vec<f32>, E>,
    mut noise: impl FnMut() -> Vec<f32>,
    mut step: impl FnMut(usize, usize) -> Result<(), E>,
) -> Result<Vec<f32>, E> {
    if sigmas.len() <= 1 {
        return Ok(x);
    }
    // The stochastic interval from the model's percent_to_sigma.
    let (start, end) = space.sa_interval;
    let tau_of = |s: f32| {
        if start >= f64::from(s) && f64::from(s) >= end {
            1.0
        } else {
            0.0
        }
    };
    let lambdas: Vec<f32> = sigmas.iter().map(|&s| space.lambda(s)).collect();
    let n_sig = sigmas.len();
    let to_end = sigmas[n_sig - 1] == 0.0;
    let mut x = x;
    let mut x_pred = x.clone();
    let (mut h, mut tau) = (0f32, 0f64);
    let mut noise_v: Option<Vec<f32>> = None;
    let mut preds: Vec<Vec<f32>> = Vec::new();
    let total = n_sig - 1;
    let combine = |preds: &[Vec<f32>], b: &[f32]| -> Vec<f32> {
        let k = b.len();
        let tail = &preds[preds.len() - k..];
        (0..tail[0].len())
            .map(|j| tail.iter().zip(b).fold(0f32, |acc, (p, c)| acc + p[j] * c))
            .collect()
    };
    for i in 0..total {
        let mut den = denoise(&x_pred, sigmas[i])?;
        preds.push(den.clone());
        if preds.len() > 4 {
            preds.remove(0);
        }
        let mut p_ord = preds.len().min(3);
        let mut c_ord = if i == 0 || (sigmas[i + 1] == 0.0 && !pece) {
            0
        } else {
            preds.len().min(4)
        };
        if to_end {
            p_ord = p_ord.min(n_sig - 2 - i);
            c_ord = c_ord.min(n_sig - 1 - i);
        }
        if c_ord == 0 {
            x = x_pred.clone();
        } else {
            let b = sa_coeffs(
                sigmas[i],
                &lambdas[i + 1 - c_ord..=i],
                lambdas[i - 1],
                lambdas[i],
                tau,
            );
            let res = combine(&preds, &b);
            let a = sigmas[i] / sigmas[i - 1] * (-((tau * tau) as f32) * h).exp();
            for (j, xv) in x.iter_mut().enumerate() {
                *xv = a * *xv + res[j];
            }
            if let Some(nv) = noise_v.as_ref().filter(|_| tau > 0.0) {
                for (xv, v) in x.iter_mut().zip(nv) {
                    *xv += v;
                }
            }
            if pece {
                den = denoise(&x, sigmas[i])?;
                if let Some(last) = preds.last_mut() {
                    *last = den.clone();
                }
            }
        }
        if sigmas[i + 1] == 0.0 {
            x = den;
        } else {
            tau = tau_of(sigmas[i + 1]);
            let b = sa_coeffs(
                sigmas[i + 1],
                &lambdas[i + 1 - p_ord..=i],
                lambdas[i],
                lambdas[i + 1],
                tau,
            );
            let res = combine(&preds, &b);
            h = lambdas[i + 1] - lambdas[i];
            let a = sigmas[i + 1] / sigmas[i] * (-((tau * tau) as f32) * h).exp();
            x_pred = x.iter().zip(&res).map(|(xv, r)| a * xv + r).collect();
            if tau > 0.0 {
                let k = (-((-2.0 * tau * tau) as f32 * h).exp_m1()).sqrt();
                let z = noise();
                let nv: Vec<f32> = z.iter().map(|zv| zv * sigmas[i + 1] * k * 1.0).collect();
                for (xv, v) in x_pred.iter_mut().zip(&nv) {
                    *xv += v;
                }
                noise_v = Some(nv);
            }
        }
        step(i + 1, total)?;
    }
    Ok(x)
}

/// Solves a small dense system in f64 by Gauss–Jordan elimination with
/// partial pivoting (torch solves these in f32 with LAPACK).
fn solve_small(a: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let n = b.len();
    let mut m: Vec<Vec<f64>> = (0..n)
        .map(|r| {
            let mut row = a[r].clone();
            row.push(b[r]);
            row
        })
        .collect();
    for col in 0..n {
        let piv = (col..n)
            .max_by(|&x, &y| m[x][col].abs().total_cmp(&m[y][col].abs()))
            .unwrap_or(col);
        m.swap(col, piv);
        for r in 0..n {
            if r != col && m[col][col] != 0.0 {
                let f = m[r][col] / m[col][col];
                let pivot_row = m[col].clone();
                for (v, p) in m[r][col..].iter_mut().zip(&pivot_row[col..]) {
                    *v -= f * p;
                }
            }
        }
    }
    (0..n).map(|i| m[i][n] / m[i][i]).collect()
}

/// [`solve_small`] for f32 systems (UniPC's rho coefficients).
fn solve_small_f32(a: &[Vec<f32>], b: &[f32]) -> Vec<f32> {
    let a: Vec<Vec<f64>> = a
        .iter()
        .map(|r| r.iter().map(|&v| f64::from(v)).collect())
        .collect();
    let b: Vec<f64> = b.iter().map(|&v| f64::from(v)).collect();
    solve_small(&a, &b).into_iter().map(|v| v as f32).collect()
}

/// A model call inside a sampler: x and sigma to a prediction.
type ModelFn<'a, E> = dyn FnMut(&[f32], f32) -> Result<Vec<f32>, E> + 'a;

/// UniPC (bh1 or bh2 variant), as ComfyUI's `uni_pc` runs it: data
/// prediction in VP form over sigmas as times (the last 0 replaced by
/// 0.001), multistep order min(3, steps − 1) with lower orders at the end,
/// corrector on every step but the last.
fn uni_pc<E>(
    x: Vec<f32>,
    sigmas: &[f32],
    bh2: bool,
    mut denoise: impl FnMut(&[f32], f32) -> Result<Vec<f32>, E>,
    mut step: impl FnMut(usize, usize) -> Result<(), E>,
) -> Result<Vec<f32>, E> {
    let mut ts = sigmas.to_vec();
    if ts.len() < 2 {
        return Ok(x);
    }
    if let Some(last) = ts.last_mut().filter(|v| **v == 0.0) {
        *last = 0.001;
    }
    // SigmaConvert: VP coefficients for a sigma used as time.
    let lmc = |s: f32| 0.5 * (1.0 / ((s * s) + 1.0)).ln();
    let alpha = |s: f32| lmc(s).exp();
    let std = |s: f32| (1.0 - (2.0 * lmc(s)).exp()).sqrt();
    let lambda = |s: f32| {
        let l = lmc(s);
        l - 0.5 * (1.0 - (2.0 * l).exp()).ln()
    };
    // data_prediction_fn over predict_eps_sigma.
    let mut model_fn = |x: &[f32], s: f32| -> Result<Vec<f32>, E> {
        let k = ((s * s) + 1.0).sqrt();
        let input: Vec<f32> = x.iter().map(|v| v * k).collect();
        let den = denoise(&input, s)?;
        let (a, sd) = (alpha(s), std(s));
        Ok(x.iter()
            .zip(&input)
            .zip(&den)
            .map(|((xv, iv), dv)| {
                let eps = (iv - dv) / s;
                (xv - sd * eps) / a
            })
            .collect())
    };
    let steps = ts.len() - 1;
    // With one step this is 0: ComfyUI then only rescales (no update).
    let order = 3.min(ts.len() - 2);
    let n = x.len();
    let k0 = (1.0f32 + ts[0] * ts[0]).sqrt();
    let mut x: Vec<f32> = x.iter().map(|v| v / k0).collect();
    // One multistep update to t; returns the new x and the model output
    // at it (when the corrector ran).
    let update = |x: &[f32],
                  models: &[Vec<f32>],
                  t_prev: &[f32],
                  t: f32,
                  order: usize,
                  corrector: bool,
                  model_fn: &mut ModelFn<'_, E>|
     -> Result<(Vec<f32>, Option<Vec<f32>>), E> {
        let tp0 = t_prev[t_prev.len() - 1];
        let (lp0, lt) = (lambda(tp0), lambda(t));
        let m0 = &models[models.len() - 1];
        let (sp0, st) = (std(tp0), std(t));
        let alpha_t = lmc(t).exp();
        let h = lt - lp0;
        let mut rks = Vec::new();
        let mut d1s: Vec<Vec<f32>> = Vec::new();
        for i in 1..order {
            let tpi = t_prev[t_prev.len() - 1 - i];
            let mi = &models[models.len() - 1 - i];
            let rk = (lambda(tpi) - lp0) / h;
            rks.push(rk);
            d1s.push(mi.iter().zip(m0).map(|(a, b)| (a - b) / rk).collect());
        }
        rks.push(1.0);
        let hh = -h;
        let h_phi_1 = hh.exp_m1();
        let mut h_phi_k = h_phi_1 / hh - 1.0;
        let mut fact = 1i64;
        let b_h = if bh2 { hh.exp_m1() } else { hh };
        let mut r_mat: Vec<Vec<f32>> = Vec::new();
        let mut b = Vec::new();
        for i in 1..=order {
            r_mat.push(rks.iter().map(|&r| torch_pow_int(r, i - 1)).collect());
            b.push(h_phi_k * fact as f32 / b_h);
            fact *= i as i64 + 1;
            h_phi_k = h_phi_k / hh - 1.0 / fact as f32;
        }
        let rhos_p: Vec<f32> = if d1s.is_empty() {
            Vec::new()
        } else if order == 2 {
            vec![0.5]
        } else {
            let sub: Vec<Vec<f32>> = r_mat[..order - 1]
                .iter()
                .map(|r| r[..order - 1].to_vec())
                .collect();
            solve_small_f32(&sub, &b[..order - 1])
        };
        let c_x = st / sp0;
        let c_m = alpha_t * h_phi_1;
        let x_t_: Vec<f32> = (0..n).map(|j| c_x * x[j] - c_m * m0[j]).collect();
        let c_b = alpha_t * b_h;
        let x_t: Vec<f32> = if d1s.is_empty() {
            x_t_.iter().map(|v| v - c_b * 0.0).collect()
        } else {
            (0..n)
                .map(|j| {
                    let pred = d1s
                        .iter()
                        .zip(&rhos_p)
                        .fold(0f32, |acc, (d, r)| acc + d[j] * r);
                    x_t_[j] - c_b * pred
                })
                .collect()
        };
        if !corrector {
            return Ok((x_t, None));
        }
        let rhos_c: Vec<f32> = if order == 1 {
            vec![0.5]
        } else {
            solve_small_f32(&r_mat, &b)
        };
        let model_t = model_fn(&x_t, t)?;
        let rc_last = rhos_c[rhos_c.len() - 1];
        let out: Vec<f32> = (0..n)
            .map(|j| {
                let corr = d1s
                    .iter()
                    .zip(&rhos_c)
                    .fold(0f32, |acc, (d, r)| acc + d[j] * r);
                let d1_t = model_t[j] - m0[j];
                x_t_[j] - c_b * (corr + rc_last * d1_t)
            })
            .collect();
        Ok((out, Some(model_t)))
    };
    let mut models = vec![model_fn(&x, ts[0])?];
    let mut t_prev = vec![ts[0]];
    for si in 0..steps {
        if si == 0 {
            // The first model call happened above.
        } else if si < order {
            let (nx, mx) = update(&x, &models, &t_prev, ts[si], si, true, &mut model_fn)?;
            x = nx;
            let mx = match mx {
                Some(m) => m,
                None => model_fn(&x, ts[si])?,
            };
            models.push(mx);
            t_prev.push(ts[si]);
        } else {
            let extra = usize::from(si == steps - 1);
            for (st, &t_st) in ts.iter().enumerate().take(si + extra + 1).skip(si) {
                let step_order = order.min(steps + 1 - st);
                let corrector = st != steps;
                let (nx, mx) = update(
                    &x,
                    &models,
                    &t_prev,
                    t_st,
                    step_order,
                    corrector,
                    &mut model_fn,
                )?;
                x = nx;
                models.rotate_left(1);
                t_prev.rotate_left(1);
                if let Some(last) = t_prev.last_mut() {
                    *last = t_st;
                }
                if st < steps {
                    let mx = match mx {
                        Some(m) => m,
                        None => model_fn(&x, t_st)?,
                    };
                    if let Some(last) = models.last_mut() {
                        *last = mx;
                    }
                }
            }
        }
        step(si + 1, steps)?;
    }
    let a_end = alpha(ts[steps]);
    Ok(x.iter().map(|v| v / a_end).collect())
}

/// torch.pow with a small integer exponent, as its fast paths compute it.
fn torch_pow_int(x: f32, e: usize) -> f32 {
    match e {
        0 => 1.0,
        1 => x,
        2 => x * x,
        3 => x * x * x,
        _ => x.powi(e as i32),
    }
}

/// torch.lerp for f32: from the start below weight 0.5, else from the end.
fn torch_lerp(a: f32, b: f32, w: f32) -> f32 {
    let diff = b - a;
    if w.abs() < 0.5 {
        a + w * diff
    } else {
        b - diff * (1.0 - w)
    }
}

/// torch.nan_to_num with nan = 0: NaN → 0, ±inf → the largest finite.
fn nan_to_num(v: f32) -> f32 {
    if v.is_nan() {
        0.0
    } else if v == f32::INFINITY {
        f32::MAX
    } else if v == f32::NEG_INFINITY {
        f32::MIN
    } else {
        v
    }
}

/// ipndm_v's variable-step Adams–Bashforth coefficients for `order`
/// (1–4), on the current and up to three earlier derivatives; f32 in the
/// reference's evaluation order.
fn ipndm_v_coeffs(order: usize, t: &[f32], i: usize) -> Vec<f32> {
    let hn = t[i + 1] - t[i];
    if order == 1 {
        return vec![1.0];
    }
    let hn1 = t[i] - t[i - 1];
    let r = hn / hn1;
    let base1 = (2.0 + r) / 2.0;
    let base2 = -r / 2.0;
    if order == 2 {
        return vec![base1, base2];
    }
    let hn2 = t[i - 1] - t[i - 2];
    let temp1 = (1.0 - hn / (3.0 * (hn + hn1)) * (hn * (hn + hn1)) / (hn1 * (hn1 + hn2))) / 2.0;
    if order == 3 {
        return vec![
            base1 + temp1,
            base2 - (1.0 + hn1 / hn2) * temp1,
            temp1 * hn1 / hn2,
        ];
    }
    let hn3 = t[i - 2] - t[i - 3];
    let temp2 = ((1.0 - hn / (3.0 * (hn + hn1))) / 2.0
        + (1.0 - hn / (2.0 * (hn + hn1))) * hn / (6.0 * (hn + hn1 + hn2)))
        * (hn * (hn + hn1) * (hn + hn1 + hn2))
        / (hn1 * (hn1 + hn2) * (hn1 + hn2 + hn3));
    let q = hn1 * (hn1 + hn2) / (hn2 * (hn2 + hn3));
    vec![
        base1 + temp1 + temp2,
        base2 - (1.0 + hn1 / hn2) * temp1 - (1.0 + (hn1 / hn2) + q) * temp2,
        temp1 * hn1 / hn2 + ((hn1 / hn2) + q * (1.0 + hn2 / hn3)) * temp2,
        -temp2 * q * hn1 / hn2,
    ]
}

/// k-diffusion's `to_d`: (x − denoised) / σ.
fn to_d(x: f32, sigma: f32, denoised: f32) -> f32 {
    (x - denoised) / sigma
}

fn axpy(x: &mut [f32], d: &[f32], a: f32) {
    for (xv, dv) in x.iter_mut().zip(d) {
        *xv += dv * a;
    }
}

/// exp(lerp(log a, log b, 0.5)), with torch's lerp (weight ≥ 0.5 computes
/// from the end: b − (b − a)·(1 − w)).
fn log_mid(a: f32, b: f32) -> f32 {
    let (la, lb) = (a.ln(), b.ln());
    (lb - (lb - la) * 0.5).exp()
}

/// k-diffusion's `get_ancestral_step` with eta 1: (σ_down, σ_up).
pub fn ancestral_step(from: f32, to: f32) -> (f32, f32) {
    let up = (to * to * (from * from - to * to) / (from * from)).sqrt();
    let up = if to < up { to } else { up };
    let down = (to * to - up * up).sqrt();
    (down, up)
}
