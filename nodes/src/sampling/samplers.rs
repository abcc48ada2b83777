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

use super::discrete::DiscreteSchedule;
use super::solvers::*;
use super::unipc::uni_pc;
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

    pub(crate) fn offset_first<'a>(self, sigmas: &'a [f32]) -> Cow<'a, [f32]> {
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
    pub(crate) fn offsets_first_sigma(self) -> bool {
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
                        let (mid, (a, b), second) = super::steps::dpmpp_2s(s, down);
                        let x2: Vec<f32> = x
                            .iter()
                            .zip(&denoised)
                            .map(|(xv, dv)| a * xv - b * dv)
                            .collect();
                        let den2 = denoise(&x2, mid)?;
                        let (a, b) = second;
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
                    let st = super::steps::ddpm(s, s_next);
                    let z = (s_next > 0.0).then(&mut noise);
                    for (j, (xv, dv)) in x.iter_mut().zip(&denoised).enumerate() {
                        let eps = (*xv - dv) / s;
                        let xs = *xv / st.k;
                        let mut mu = st.c0 * (xs - st.c1 * eps / st.c2);
                        if let Some(z) = &z {
                            mu += st.c3 * z[j];
                        }
                        *xv = mu * st.kn;
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
                Sampler::DpmPp2mSde | Sampler::DpmPp2mSdeHeun => {
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
                        if let (Some(old), Some(h_last)) = (old_denoised.as_ref(), h_1) {
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
                        let z = noise();
                        let k = (-(-2.0 * hv).exp_m1()).sqrt();
                        for (xv, zv) in x.iter_mut().zip(&z) {
                            *xv += zv * s_next * k;
                        }
                    }
                    old_denoised = Some(denoised);
                    h_1 = h;
                }
                Sampler::DpmPp3mSde => {
                    // eta = 1, s_noise = 1.
                    let mut h = None;
                    if s_next == 0.0 {
                        x = denoised.clone();
                    } else {
                        use super::steps::Corr3;
                        let st = super::steps::dpmpp_3m_sde(space, s, s_next, h_1, h_2);
                        h = Some(st.h);
                        for (xv, dv) in x.iter_mut().zip(&denoised) {
                            *xv = st.a * *xv + st.b * dv;
                        }
                        match (st.corr, old_denoised.as_ref(), denoised_2.as_ref()) {
                            (Corr3::Two { r0, r1, c1, c2 }, Some(d1v), Some(d2v)) => {
                                for (j, xv) in x.iter_mut().enumerate() {
                                    let d1_0 = (denoised[j] - d1v[j]) / r0;
                                    let d1_1 = (d1v[j] - d2v[j]) / r1;
                                    let d1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1);
                                    let d2 = (d1_0 - d1_1) / (r0 + r1);
                                    *xv = *xv + c1 * d1 - c2 * d2;
                                }
                            }
                            (Corr3::One { r, c }, Some(d1v), _) => {
                                for (j, xv) in x.iter_mut().enumerate() {
                                    *xv += c * ((denoised[j] - d1v[j]) / r);
                                }
                            }
                            _ => {}
                        }
                        let z = noise();
                        for (xv, zv) in x.iter_mut().zip(&z) {
                            *xv += zv * s_next * st.k;
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
                        // fac = 1 / (2r) = 1 for r = 1/2.
                        let fac = 1.0f32;
                        let st = super::steps::dpmpp_sde(space, s, s_next);
                        let (za, zb) = (noise(), noise());
                        let e = st.first;
                        let x2: Vec<f32> = (0..x.len())
                            .map(|j| e.a * x[j] - e.b * denoised[j] + e.alpha * za[j] * e.su)
                            .collect();
                        let den2 = denoise(&x2, st.s1)?;
                        let e = st.second;
                        for (j, xv) in x.iter_mut().enumerate() {
                            let dd = (1.0 - fac) * denoised[j] + fac * den2[j];
                            let z = st.ka * za[j] + st.kb * zb[j];
                            *xv = e.a * *xv - e.b * dd + e.alpha * z * e.su;
                        }
                    }
                }
                Sampler::ErSde => {
                    if s_next == 0.0 {
                        x = denoised.clone();
                    } else {
                        let st = super::steps::er_sde(space, sigmas, i);
                        for (xv, dv) in x.iter_mut().zip(&denoised) {
                            *xv = st.a * *xv + st.b * dv;
                        }
                        if let (true, Some(old)) = (st.stage >= 2, old_denoised.as_ref()) {
                            let den_d: Vec<f32> = denoised
                                .iter()
                                .zip(old)
                                .map(|(d, o)| (d - o) / st.q)
                                .collect();
                            for (xv, dd) in x.iter_mut().zip(&den_d) {
                                *xv += st.c2 * dd;
                            }
                            if let (true, Some(old_d)) = (st.stage >= 3, denoised_2.as_ref()) {
                                for ((xv, dd), od) in x.iter_mut().zip(&den_d).zip(old_d) {
                                    *xv += st.c3 * ((dd - od) / st.half);
                                }
                            }
                            // Here `denoised_2` keeps the previous difference
                            // quotient (k-diffusion's old_denoised_d).
                            denoised_2 = Some(den_d);
                        }
                        let z = noise();
                        for (xv, zv) in x.iter_mut().zip(&z) {
                            *xv += st.at * zv * st.k;
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
                    let calls = super::steps::seeds(space, s, s_next, self == Sampler::Seeds3);
                    let start = x.clone();
                    let mut sde = vec![0.0f32; x.len()];
                    let mut pred = Vec::new();
                    for (k, c) in calls.iter().enumerate() {
                        if k > 0 {
                            pred = denoise(&x, c.sigma)?;
                        }
                        let here = if k > 0 { &pred } else { &denoised };
                        let z = noise();
                        for (j, v) in sde.iter_mut().enumerate() {
                            *v = *v * c.e + c.k * z[j];
                            let mix = c.p1 * denoised[j] + c.p2 * here[j];
                            x[j] = c.c * start[j] - c.m * mix + *v * c.sn;
                        }
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
        let rf = super::steps::rf_ancestral(s, s_next);
        let down = rf.down;
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
                let mid = super::steps::rf_mid(s, down);
                let mut u = x.clone();
                blend(&mut u, &denoised, mid);
                let d_mid = denoise(&u, mid)?;
                blend(&mut x, &d_mid, down);
            }
        }
        if renoised {
            let z = noise();
            for (xv, zv) in x.iter_mut().zip(&z) {
                *xv = rf.a * *xv + zv * rf.renoise;
            }
        }
        Ok(x)
    }
}

/// k-diffusion's `get_ancestral_step` with eta 1: (σ_down, σ_up).
pub fn ancestral_step(from: f32, to: f32) -> (f32, f32) {
    let up = (to * to * (from * from - to * to) / (from * from)).sqrt();
    let up = if to < up { to } else { up };
    let down = (to * to - up * up).sqrt();
    (down, up)
}
