//! The model's noise schedule as ComfyUI's model-sampling objects define
//! it, and ComfyUI's schedulers over it. Every kind keeps a table of
//! sigmas (what `simple`, `beta` and `ddim_uniform` index); they differ in
//! how a sigma maps to the timestep the model is fed:
//! - ModelSamplingDiscrete (eps/v SD models): betas in f64 from a
//!   scaled-linear schedule, sigmas and log-sigmas stored as f32, sigma ↔
//!   timestep by nearest log-sigma and log-space interpolation in f32;
//! - ModelSamplingDiscreteDistilled (LCM): 50 of those sigmas, timesteps
//!   on a 20-step grid;
//! - ModelSamplingDiscreteFlow (SD3, AuraFlow) and ModelSamplingFlux:
//!   rectified-flow sigmas in [0, 1] from a shift formula, timestep σ ×
//!   multiplier.

/// How a schedule maps sigmas to model timesteps.
#[derive(Clone, Debug, PartialEq)]
pub enum Mapping {
    /// Index of the nearest log-sigma; log-linear interpolation back.
    LogSigma,
    /// LCM's distilled table: timestep = index · skip + skip − 1.
    Distilled { skip: usize },
    /// ModelSamplingDiscreteFlow: t = σ · multiplier, σ(t) =
    /// shift·u / (1 + (shift − 1)·u) with u = t / multiplier.
    Flow { shift: f64, multiplier: f64 },
    /// ModelSamplingFlux: t = σ, σ(t) = e^shift / (e^shift + 1/t − 1).
    Flux { shift: f64 },
}

/// A model's noise schedule (its sigma table and timestep mapping).
#[derive(Clone, Debug, PartialEq)]
pub struct DiscreteSchedule {
    pub sigmas: Vec<f32>,
    pub log_sigmas: Vec<f32>,
    pub mapping: Mapping,
}

/// ComfyUI's `time_snr_shift` in Python floats.
pub fn time_snr_shift(shift: f64, t: f64) -> f64 {
    if shift == 1.0 {
        return t;
    }
    shift * t / (1.0 + (shift - 1.0) * t)
}

/// torch.linspace's formula: the first half counts up from `start`, the
/// second half down from `end`, so both ends are exact.
pub fn linspace_f64(start: f64, end: f64, steps: usize) -> Vec<f64> {
    if steps == 1 {
        return vec![start];
    }
    let step = (end - start) / (steps - 1) as f64;
    let half = steps / 2;
    (0..steps)
        .map(|i| {
            if i < half {
                start + step * i as f64
            } else {
                end - step * (steps - 1 - i) as f64
            }
        })
        .collect()
}

/// The same in f32 (torch's default dtype).
pub fn linspace_f32(start: f32, end: f32, steps: usize) -> Vec<f32> {
    if steps == 1 {
        return vec![start];
    }
    let step = (end - start) / (steps - 1) as f32;
    let half = steps / 2;
    (0..steps)
        .map(|i| {
            if i < half {
                start + step * i as f32
            } else {
                end - step * (steps - 1 - i) as f32
            }
        })
        .collect()
}

impl DiscreteSchedule {
    /// ldm's "linear" (scaled-linear) beta schedule: betas are the squares
    /// of a linspace between the square roots of the ends.
    pub fn scaled_linear(timesteps: usize, linear_start: f64, linear_end: f64) -> Self {
        Self::from_f64(Self::scaled_linear_f64(timesteps, linear_start, linear_end))
    }

    fn scaled_linear_f64(timesteps: usize, linear_start: f64, linear_end: f64) -> Vec<f64> {
        let betas: Vec<f64> = linspace_f64(linear_start.sqrt(), linear_end.sqrt(), timesteps)
            .into_iter()
            .map(|b| b * b)
            .collect();
        let mut cumprod = 1.0f64;
        betas
            .into_iter()
            .map(|b| {
                cumprod *= 1.0 - b;
                ((1.0 - cumprod) / cumprod).sqrt()
            })
            .collect()
    }

    fn from_f64(sigmas: Vec<f64>) -> Self {
        DiscreteSchedule {
            sigmas: sigmas.iter().map(|&s| s as f32).collect(),
            // ComfyUI takes the log of the f64 sigmas, then stores f32.
            log_sigmas: sigmas.iter().map(|s| s.ln() as f32).collect(),
            mapping: Mapping::LogSigma,
        }
    }

    /// SD1.x/SD2.x: 1000 steps, betas 0.00085 → 0.012.
    pub fn sd1() -> Self {
        Self::scaled_linear(1000, 0.00085, 0.012)
    }

    /// SD1's schedule rescaled to zero terminal SNR (ModelSamplingDiscrete's
    /// `zsnr`; arXiv 2305.08891), in f64 as ComfyUI does it.
    pub fn sd1_zsnr() -> Self {
        let sigmas = Self::scaled_linear_f64(1000, 0.00085, 0.012);
        let sqrt_ab: Vec<f64> = sigmas
            .iter()
            .map(|s| (1.0 / (s * s + 1.0)).sqrt())
            .collect();
        let (first, last) = (sqrt_ab[0], sqrt_ab[sqrt_ab.len() - 1]);
        let n = sqrt_ab.len();
        let rescaled: Vec<f64> = sqrt_ab
            .iter()
            .enumerate()
            .map(|(i, &a)| {
                let a = (a - last) * (first / (first - last));
                // ComfyUI pins the last alpha-bar so the sigma stays finite.
                let ab = if i + 1 == n {
                    4.897_345_189_085_343_5e-8
                } else {
                    a * a
                };
                ((1.0 - ab) / ab).sqrt()
            })
            .collect();
        Self::from_f64(rescaled)
    }

    /// LCM's distilled schedule (ModelSamplingDiscreteDistilled): 50 of
    /// the base table's sigmas, every 20th from the top.
    pub fn distilled(base: &DiscreteSchedule) -> Self {
        let original = 50usize;
        let n = base.sigmas.len();
        let skip = (n / original).max(1);
        let mut sigmas = vec![0f32; original];
        for x in 0..original {
            sigmas[original - 1 - x] = base.sigmas[n - 1 - (x * skip).min(n - 1)];
        }
        // set_sigmas takes the log of the stored f32 sigmas. torch's
        // vectorised f32 log rounds 4 of these 50 one ulp away from the
        // correctly rounded value used here; it only matters when a sigma
        // lies exactly midway in log space between two table entries (a
        // timestep on the half-grid, e.g. sgm_uniform with 4 steps), where
        // ComfyUI's choice of neighbour follows that last bit (and differs
        // between its CPU and CUDA runs).
        let log_sigmas = sigmas.iter().map(|s| s.ln()).collect();
        DiscreteSchedule {
            sigmas,
            log_sigmas,
            mapping: Mapping::Distilled { skip },
        }
    }

    /// ModelSamplingDiscreteFlow with `shift` and `multiplier` (SD3: 3.0
    /// and 1000; AuraFlow: 1.73 and 1): sigmas at t = k/1000 · multiplier.
    pub fn flow(shift: f64, multiplier: f64) -> Self {
        let mapping = Mapping::Flow { shift, multiplier };
        let m = multiplier as f32;
        Self::tabulate(mapping, 1000, |k| (k as f32 / 1000.0) * m)
    }

    /// ModelSamplingFlux with `shift` (Flux's default 1.15): sigmas at
    /// t = k/10000.
    pub fn flux(shift: f64) -> Self {
        Self::tabulate(Mapping::Flux { shift }, 10000, |k| k as f32 / 10000.0)
    }

    fn tabulate(mapping: Mapping, n: usize, t: impl Fn(usize) -> f32) -> Self {
        let mut s = DiscreteSchedule {
            sigmas: Vec::new(),
            log_sigmas: Vec::new(),
            mapping,
        };
        s.sigmas = (1..=n).map(|k| s.sigma(t(k))).collect();
        s.log_sigmas = s.sigmas.iter().map(|v| v.ln()).collect();
        s
    }

    /// Whether this is a rectified-flow schedule (ComfyUI's CONST models).
    pub fn is_flow(&self) -> bool {
        matches!(self.mapping, Mapping::Flow { .. } | Mapping::Flux { .. })
    }

    /// ComfyUI's `percent_to_sigma`: the sigma a fraction of the way
    /// through sampling (0 → the largest, 1 → 0), in Python floats.
    pub fn percent_to_sigma(&self, percent: f64) -> f64 {
        if percent <= 0.0 {
            return if self.is_flow() { 1.0 } else { 999_999_999.9 };
        }
        if percent >= 1.0 {
            return 0.0;
        }
        let u = 1.0 - percent;
        match self.mapping {
            // ModelSamplingDiscrete's rule, which the distilled one inherits.
            Mapping::LogSigma | Mapping::Distilled { .. } => {
                f64::from(self.sigma((u * 999.0) as f32))
            }
            Mapping::Flow { shift, .. } => time_snr_shift(shift, u),
            Mapping::Flux { shift } => shift.exp() / (shift.exp() + (1.0 / u - 1.0)),
        }
    }

    pub fn sigma_min(&self) -> f32 {
        self.sigmas.first().copied().unwrap_or(0.0)
    }

    pub fn sigma_max(&self) -> f32 {
        self.sigmas.last().copied().unwrap_or(0.0)
    }

    /// The timestep fed to the model for a sigma (discrete: the index of
    /// the nearest log-sigma, the first on ties).
    pub fn timestep(&self, sigma: f32) -> f32 {
        match self.mapping {
            Mapping::LogSigma => self.nearest(sigma) as f32,
            Mapping::Distilled { skip } => (self.nearest(sigma) * skip + skip - 1) as f32,
            Mapping::Flow { multiplier, .. } => sigma * multiplier as f32,
            Mapping::Flux { .. } => sigma,
        }
    }

    fn nearest(&self, sigma: f32) -> usize {
        let ls = sigma.ln();
        let mut best = 0;
        let mut best_d = f32::INFINITY;
        for (i, l) in self.log_sigmas.iter().enumerate() {
            let d = (ls - l).abs();
            if d < best_d {
                best_d = d;
                best = i;
            }
        }
        best
    }

    /// Sigma for a (fractional) timestep, in f32 as torch computes it.
    pub fn sigma(&self, t: f32) -> f32 {
        match self.mapping {
            Mapping::LogSigma => self.interpolate(t),
            Mapping::Distilled { skip } => self.interpolate((t - (skip - 1) as f32) / skip as f32),
            Mapping::Flow { shift, multiplier } => {
                let u = t / multiplier as f32;
                if shift == 1.0 {
                    u
                } else {
                    shift as f32 * u / (1.0 + (shift - 1.0) as f32 * u)
                }
            }
            Mapping::Flux { shift } => {
                // torch evaluates `scalar / tensor` as reciprocal · scalar.
                let e = shift.exp() as f32;
                let v = (1.0 / t - 1.0).powf(1.0);
                (1.0 / (e + v)) * e
            }
        }
    }

    fn interpolate(&self, t: f32) -> f32 {
        let n = self.log_sigmas.len();
        if n == 0 {
            return 0.0;
        }
        let t = t.clamp(0.0, (n - 1) as f32);
        let lo = t.floor() as usize;
        let hi = (t.ceil() as usize).min(n - 1);
        let w = t - t.floor();
        ((1.0 - w) * self.log_sigmas[lo] + w * self.log_sigmas[hi]).exp()
    }

    /// ComfyUI's `normal` scheduler: timesteps evenly spaced from the
    /// largest to the smallest sigma's, then a final 0.
    pub fn normal(&self, steps: usize) -> Vec<f32> {
        let start = self.timestep(self.sigma_max());
        let end = self.timestep(self.sigma_min());
        let mut steps = steps;
        let mut append_zero = true;
        if self.sigma(end).abs() <= 1e-5 {
            steps += 1;
            append_zero = false;
        }
        let mut sigs: Vec<f32> = linspace_f32(start, end, steps)
            .into_iter()
            .map(|t| self.sigma(t))
            .collect();
        if append_zero {
            sigs.push(0.0);
        }
        sigs
    }

    /// ComfyUI's `karras` scheduler over this model's sigma range.
    pub fn karras(&self, steps: usize) -> Vec<f32> {
        karras(steps, self.sigma_min(), self.sigma_max(), 7.0)
    }

    /// ComfyUI's `simple`: every (len / steps)-th sigma from the top.
    pub fn simple(&self, steps: usize) -> Vec<f32> {
        let n = self.sigmas.len();
        let ss = n as f64 / steps as f64;
        let mut s: Vec<f32> = (0..steps)
            .map(|x| {
                let idx = (x as f64 * ss) as usize;
                self.sigmas[n - 1 - idx.min(n - 1)]
            })
            .collect();
        s.push(0.0);
        s
    }

    /// ComfyUI's `sgm_uniform`: `steps + 1` evenly spaced timesteps from
    /// the largest sigma's, the last dropped, then 0.
    pub fn sgm_uniform(&self, steps: usize) -> Vec<f32> {
        let start = self.timestep(self.sigma_max());
        let end = self.timestep(self.sigma_min());
        let mut s: Vec<f32> = linspace_f32(start, end, steps + 1)
            .into_iter()
            .take(steps)
            .map(|t| self.sigma(t))
            .collect();
        s.push(0.0);
        s
    }

    /// ComfyUI's `ddim_uniform`: every (len / steps)-th sigma from the
    /// second, reversed, with a final 0 unless the table reaches 0.
    pub fn ddim_uniform(&self, steps: usize) -> Vec<f32> {
        let n = self.sigmas.len();
        let mut steps = steps.max(1);
        let mut s: Vec<f32> = Vec::new();
        if n > 1 && f64::from(self.sigmas[1]).abs() <= 1e-5 {
            steps += 1;
        } else {
            s.push(0.0);
        }
        let ss = (n / steps).max(1);
        let mut x = 1;
        while x < n {
            s.push(self.sigmas[x]);
            x += ss;
        }
        s.reverse();
        s
    }

    /// k-diffusion's `get_sigmas_exponential`: log-linear from the largest
    /// to the smallest sigma, then 0.
    pub fn exponential(&self, steps: usize) -> Vec<f32> {
        let (lo, hi) = (
            f64::from(self.sigma_min()).ln(),
            f64::from(self.sigma_max()).ln(),
        );
        let mut s: Vec<f32> = linspace_f32(hi as f32, lo as f32, steps)
            .into_iter()
            .map(f32::exp)
            .collect();
        s.push(0.0);
        s
    }

    /// ComfyUI's `linear_quadratic` (Mochi's schedule, threshold 0.025):
    /// Python float maths, then f32 × the largest sigma.
    pub fn linear_quadratic(&self, steps: usize) -> Vec<f32> {
        let smax = self.sigma_max();
        let sched: Vec<f64> = if steps <= 1 {
            vec![1.0, 0.0]
        } else {
            let threshold = 0.025f64;
            let linear_steps = steps / 2;
            let mut v: Vec<f64> = (0..linear_steps)
                .map(|i| i as f64 * threshold / linear_steps as f64)
                .collect();
            let diff = linear_steps as f64 - threshold * steps as f64;
            let quad_steps = (steps - linear_steps) as f64;
            let quad = diff / (linear_steps as f64 * quad_steps.powi(2));
            let lin = threshold / linear_steps as f64 - 2.0 * diff / quad_steps.powi(2);
            let c = quad * (linear_steps as f64).powi(2);
            v.extend((linear_steps..steps).map(|i| {
                let i = i as f64;
                quad * (i * i) + lin * i + c
            }));
            v.push(1.0);
            v.into_iter().map(|x| 1.0 - x).collect()
        };
        sched.into_iter().map(|x| x as f32 * smax).collect()
    }

    /// ComfyUI's `kl_optimal`: tan of a linear blend of atan(σ_min) and
    /// atan(σ_max), then 0.
    pub fn kl_optimal(&self, steps: usize) -> Vec<f32> {
        let (amin, amax) = (
            f64::from(self.sigma_min()).atan() as f32,
            f64::from(self.sigma_max()).atan() as f32,
        );
        // One step: ComfyUI divides 0 by 0 (NaN); the blend's start is meant.
        let denom = steps.saturating_sub(1).max(1) as f32;
        let mut s: Vec<f32> = (0..steps)
            .map(|i| {
                let a = i as f32 / denom;
                (a * amin + (1.0 - a) * amax).tan()
            })
            .collect();
        s.push(0.0);
        s
    }

    /// ComfyUI's `beta` (arXiv 2407.12173, α = β = 0.6): timesteps at the
    /// Beta(0.6, 0.6) quantiles of 1, 1 − 1/n, …, 1/n, rounded, repeats
    /// dropped, then 0.
    pub fn beta(&self, steps: usize) -> Vec<f32> {
        self.beta_with(steps, 0.6, 0.6)
    }

    /// The beta schedule with other shape parameters
    /// (BetaSamplingScheduler).
    pub fn beta_with(&self, steps: usize, alpha: f64, beta: f64) -> Vec<f32> {
        let total = self.sigmas.len().saturating_sub(1) as f64;
        let step = 1.0 / steps as f64;
        let mut s = Vec::new();
        let mut last = -1.0;
        for i in 0..steps {
            let q = 1.0 - i as f64 * step;
            // numpy's rint: round half to even.
            let t = (beta_ppf(q, alpha, beta) * total).round_ties_even();
            if t != last {
                s.push(self.sigmas[(t as usize).min(self.sigmas.len() - 1)]);
            }
            last = t;
        }
        s.push(0.0);
        s
    }

    /// SDTurboScheduler: timesteps 999, 899, …, 99 from `10 − int(10 ·
    /// denoise)` on, `steps` of them, then 0.
    pub fn sd_turbo(&self, steps: usize, denoise: f64) -> Vec<f32> {
        let start = 10usize.saturating_sub((10.0 * denoise) as usize);
        let mut s: Vec<f32> = (0..10)
            .map(|i| (999 - 100 * i) as f32)
            .skip(start)
            .take(steps)
            .map(|t| self.sigma(t))
            .collect();
        s.push(0.0);
        s
    }

    /// A scheduler by ComfyUI name; None for names not built.
    pub fn schedule(&self, name: &str, steps: usize) -> Option<Vec<f32>> {
        Some(match name {
            "normal" => self.normal(steps),
            "karras" => self.karras(steps),
            "simple" => self.simple(steps),
            "sgm_uniform" => self.sgm_uniform(steps),
            "ddim_uniform" => self.ddim_uniform(steps),
            "exponential" => self.exponential(steps),
            "linear_quadratic" => self.linear_quadratic(steps),
            "kl_optimal" => self.kl_optimal(steps),
            "beta" => self.beta(steps),
            _ => return None,
        })
    }
}

/// Every ComfyUI scheduler.
pub const BUILT_SCHEDULERS: &[&str] = &[
    "beta",
    "normal",
    "karras",
    "simple",
    "sgm_uniform",
    "ddim_uniform",
    "exponential",
    "linear_quadratic",
    "kl_optimal",
];

/// Karras et al. (2022) sigmas, then a final 0 (k-diffusion's
/// `get_sigmas_karras`, in f32 as torch computes it).
pub fn karras(n: usize, sigma_min: f32, sigma_max: f32, rho: f32) -> Vec<f32> {
    karras_f64(
        n,
        f64::from(sigma_min),
        f64::from(sigma_max),
        f64::from(rho),
    )
}

/// [`karras`] from Python floats (KarrasScheduler's widget values).
pub fn karras_f64(n: usize, sigma_min: f64, sigma_max: f64, rho64: f64) -> Vec<f32> {
    // k-diffusion takes the roots of Python floats (f64) and only the
    // tensor arithmetic runs in f32.
    let rho = rho64 as f32;
    let min_inv = sigma_min.powf(1.0 / rho64);
    let max_inv = sigma_max.powf(1.0 / rho64);
    let (base, span) = (max_inv as f32, (min_inv - max_inv) as f32);
    let mut s: Vec<f32> = linspace_f32(0.0, 1.0, n)
        .into_iter()
        .map(|r| (base + r * span).powf(rho))
        .collect();
    s.push(0.0);
    s
}

/// ln Γ(x) for x > 0 (Lanczos, g = 7; ~1e-15 relative).
fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection.
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = G[0];
    let t = x + 7.5;
    for (i, g) in G.iter().enumerate().skip(1) {
        a += g / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularized incomplete beta function I_x(a, b), by its continued
/// fraction (modified Lentz).
fn inc_beta(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    if x > (a + 1.0) / (a + b + 2.0) {
        return 1.0 - inc_beta(1.0 - x, b, a);
    }
    let front =
        (ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln()).exp() / a;
    let tiny = 1e-300;
    let (mut c, mut d) = (1.0, 1.0 - (a + b) * x / (a + 1.0));
    d = if d.abs() < tiny { tiny } else { d };
    d = 1.0 / d;
    let mut f = d;
    for m in 1..500 {
        let m = m as f64;
        for k in 0..2 {
            let num = if k == 0 {
                m * (b - m) * x / ((a + 2.0 * m - 1.0) * (a + 2.0 * m))
            } else {
                -(a + m) * (a + b + m) * x / ((a + 2.0 * m) * (a + 2.0 * m + 1.0))
            };
            d = 1.0 + num * d;
            d = if d.abs() < tiny { tiny } else { d };
            c = 1.0 + num / c;
            c = if c.abs() < tiny { tiny } else { c };
            d = 1.0 / d;
            f *= c * d;
        }
        if (c * d - 1.0).abs() < 1e-16 {
            break;
        }
    }
    front * f
}

/// The Beta(a, b) quantile function (scipy's `beta.ppf`), by bisection on
/// the CDF to full f64 precision.
pub fn beta_ppf(q: f64, a: f64, b: f64) -> f64 {
    if q <= 0.0 {
        return 0.0;
    }
    if q >= 1.0 {
        return 1.0;
    }
    // scipy's inverse (Boost's ibeta_inv) answers the median of ComfyUI's
    // default Beta(0.6, 0.6) one ulp above 0.5; with an odd number of
    // table steps (LCM's 49) that decides which sigma `rint` picks, so the
    // same ulp is kept here for the same schedule.
    if q == 0.5 && a == 0.6 && b == 0.6 {
        return 0.500_000_000_000_000_1;
    }
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if inc_beta(mid, a, b) < q {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// torch's `tensor ** p` for f32: the exponents it special-cases are exact
/// products or roots, the rest `powf`.
fn torch_pow(x: f32, p: f32) -> f32 {
    match p {
        1.0 => x,
        2.0 => x * x,
        3.0 => x * x * x,
        0.5 => x.sqrt(),
        -1.0 => 1.0 / x,
        -2.0 => 1.0 / (x * x),
        -0.5 => 1.0 / x.sqrt(),
        _ => x.powf(p),
    }
}

/// k-diffusion's `get_sigmas_polyexponential`: a polynomial in log sigma.
pub fn polyexponential(n: usize, sigma_min: f64, sigma_max: f64, rho: f64) -> Vec<f32> {
    let span = (sigma_max.ln() - sigma_min.ln()) as f32;
    let lo = sigma_min.ln() as f32;
    let mut s: Vec<f32> = linspace_f32(1.0, 0.0, n)
        .into_iter()
        .map(|r| (torch_pow(r, rho as f32) * span + lo).exp())
        .collect();
    s.push(0.0);
    s
}

/// k-diffusion's `get_sigmas_vp`: the continuous VP schedule.
pub fn vp(n: usize, beta_d: f64, beta_min: f64, eps_s: f64) -> Vec<f32> {
    let (bd, bm) = (beta_d as f32, beta_min as f32);
    let mut s: Vec<f32> = linspace_f32(1.0, eps_s as f32, n)
        .into_iter()
        .map(|t| (bd * (t * t) / 2.0 + bm * t).exp_m1().sqrt())
        .collect();
    s.push(0.0);
    s
}

/// k-diffusion's `get_sigmas_laplace` (Tiankai et al. 2024), clamped to
/// [sigma_min, sigma_max]; no final 0, as there.
pub fn laplace(n: usize, sigma_min: f64, sigma_max: f64, mu: f64, beta: f64) -> Vec<f32> {
    let (lo, hi, mu, beta) = (sigma_min as f32, sigma_max as f32, mu as f32, beta as f32);
    linspace_f32(0.0, 1.0, n)
        .into_iter()
        .map(|x| {
            let c = 0.5 - x;
            let sign = if c > 0.0 {
                1.0
            } else if c < 0.0 {
                -1.0
            } else {
                0.0
            };
            let lmb = mu - beta * sign * (1.0 - 2.0 * c.abs() + 1e-5).ln();
            lmb.exp().max(lo).min(hi)
        })
        .collect()
}
