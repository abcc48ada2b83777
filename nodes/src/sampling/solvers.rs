//! The solvers behind the multistep and adaptive samplers of
//! [`super::samplers`]: linear-multistep, DEIS, iPNDM-v and res coefficients,
//! DPM-Solver fast and adaptive, SA-Solver, UniPC, and the torch-exact
//! scalar helpers they share, kept in k-diffusion's (and ComfyUI's)
//! evaluation order.

use super::discrete::linspace_f32;
use super::samplers::*;

/// k-diffusion's `linear_multistep_coeff`: the integral over
/// [σ_i, σ_{i+1}] of the Lagrange basis polynomial j on the last `order`
/// sigmas, in f64. The integrand is a polynomial of degree < 4, which
/// 4-point Gauss–Legendre integrates exactly (scipy's quad agrees to
/// rounding).
pub(crate) fn lms_coeff(order: usize, t: &[f32], i: usize, j: usize) -> f64 {
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
pub(crate) fn res_coeffs(s: f32, old_down: f32, down: f32, prev: f32) -> (f32, f32, f32, f32) {
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
pub(super) fn deis_coeffs(sigmas: &[f32], max_order: usize) -> Vec<Vec<f32>> {
    (0..sigmas.len().saturating_sub(1))
        .map(|i| deis_step(sigmas, i, max_order))
        .collect()
}

/// Step `i`'s [`deis_coeffs`] (empty where its order is 1): the device
/// loop asks for one step at a time.
pub(crate) fn deis_step(sigmas: &[f32], i: usize, max_order: usize) -> Vec<f32> {
    let order = (i + 1).min(max_order);
    if order == 1 || i + 1 >= sigmas.len() {
        return Vec::new();
    }
    let (eps_s, smin, smax) = (1e-3f32, 0.002f32, 80f32);
    let beta_d =
        2.0 * ((smin * smin + 1.0).ln() / eps_s - (smax * smax + 1.0).ln()) / (eps_s - 1.0);
    let beta_min = (smax * smax + 1.0).ln() - 0.5 * beta_d;
    let (b0, b1) = (beta_min, beta_d + beta_min);
    let t = |k: usize| {
        let s = sigmas[k];
        ((beta_min * beta_min + 2.0 * beta_d * (s * s + 1.0).ln()).sqrt() - beta_min) / beta_d
    };
    const N: usize = 10_000;
    let (tc, tn) = (t(i), t(i + 1));
    let dtau = (tn - tc) / N as f32;
    let taus = linspace_f32(tc, tn, N);
    let prev: Vec<f32> = (0..order).map(|k| t(i - k)).collect();
    let integrand: Vec<f32> = taus
        .iter()
        .map(|&tau| {
            let alpha = (-0.5 * (tau * tau) * (b1 - b0) - tau * b0).exp();
            // d/dτ log α, as autograd finds it.
            let dlog = -(tau * (b1 - b0)) - b0;
            -0.5 * dlog / (alpha * (1.0 - alpha)).sqrt()
        })
        .collect();
    (0..order)
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
        .collect()
}

/// DPM-Solver-Fast (eta 0), as ComfyUI's `dpm_fast` runs it: from the
/// first sigma to the last nonzero one in `len − 1` model evaluations,
/// evenly spaced in t = −log σ, third-order steps with a final second- or
/// first-order one.
pub(super) fn dpm_fast<E>(
    mut x: Vec<f32>,
    sigmas: &[f32],
    mut denoise: impl FnMut(&[f32], f32) -> Result<Vec<f32>, E>,
    mut step: impl FnMut(usize, usize) -> Result<(), E>,
) -> Result<Vec<f32>, E> {
    let steps = dpm_fast_steps(sigmas);
    let mut eps_at = |x: &[f32], s: f32| -> Result<Vec<f32>, E> {
        let d = denoise(x, s)?;
        Ok(x.iter().zip(&d).map(|(a, b)| (a - b) / s).collect())
    };
    let total = steps.len();
    for (i, calls) in steps.iter().enumerate() {
        let e0 = eps_at(&x, calls[0].sigma)?;
        let mut moved = x.clone();
        for (k, c) in calls.iter().enumerate() {
            let e = if k == 0 {
                e0.clone()
            } else {
                eps_at(&moved, c.sigma)?
            };
            for (j, v) in moved.iter_mut().enumerate() {
                *v = x[j] - c.ca * e0[j] - c.cb * (e[j] - e0[j]);
            }
        }
        x = moved;
        step(i + 1, total)?;
    }
    Ok(x)
}

/// One model evaluation of a DPM-Solver-fast step, at σ `sigma`: with
/// ε = (x − D)/σ there and ε₀ the step's first, the point moves to
/// `x_s − ca·ε₀ − cb·(ε − ε₀)` from the step's start x_s, where the next
/// evaluation runs (the step's end after its last).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct FastCall {
    pub sigma: f32,
    pub ca: f32,
    pub cb: f32,
}

/// DPM-Solver-fast's steps over `sigmas` (ComfyUI's `dpm_fast`): from
/// the first sigma to the last nonzero one in `len − 1` model
/// evaluations, evenly spaced in t = −log σ, third-order steps with a
/// final second- or first-order one.
pub(crate) fn dpm_fast_steps(sigmas: &[f32]) -> Vec<Vec<FastCall>> {
    if sigmas.len() <= 1 {
        return Vec::new();
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
    orders
        .iter()
        .enumerate()
        .map(|(i, &order)| {
            let (t, tn) = (ts[i], ts[i + 1]);
            let h = tn - t;
            let (sn, em) = (sig(tn), h.exp_m1());
            let call = |sigma: f32, ca: f32, cb: f32| FastCall { sigma, ca, cb };
            // The first evaluation's move toward the step's first
            // intermediate point (or its end, first order).
            let towards = |r: f32| call(sig(t), sig(t + r * h) * (r * h).exp_m1(), 0.0);
            match order {
                1 => vec![call(sig(t), sn * em, 0.0)],
                2 => {
                    let r1 = 0.5f32;
                    let c = sn / (2.0 * r1) * em;
                    vec![towards(r1), call(sig(t + r1 * h), sn * em, c)]
                }
                _ => third_order(t, tn).to_vec(),
            }
        })
        .collect()
}

/// DPM-Solver-3's evaluations from t to `tn` (t = −log σ), r = 1/3, 2/3.
fn third_order(t: f32, tn: f32) -> [FastCall; 3] {
    let sig = |t: f32| (-t).exp();
    let h = tn - t;
    let (sn, em) = (sig(tn), h.exp_m1());
    let (r1, r2) = ((1.0f64 / 3.0) as f32, (2.0f64 / 3.0) as f32);
    let (s1, s2) = (t + r1 * h, t + r2 * h);
    let call = |sigma: f32, ca: f32, cb: f32| FastCall { sigma, ca, cb };
    [
        call(sig(t), sig(s1) * (r1 * h).exp_m1(), 0.0),
        call(
            sig(s1),
            sig(s2) * (r2 * h).exp_m1(),
            sig(s2) * (2.0f64 as f32) * ((r2 * h).exp_m1() / (r2 * h) - 1.0),
        ),
        call(sig(s2), sn * em, sn / r2 * (em / h - 1.0)),
    ]
}

/// The sigma range ComfyUI's DPM-Solver wrappers use: first sigma to the
/// last nonzero one, as t = −log σ.
pub(super) fn dpm_range(sigmas: &[f32]) -> (f32, f32) {
    let n = sigmas.len() - 1;
    let mut smin = sigmas[n];
    if smin == 0.0 {
        smin = sigmas[n - 1];
    }
    (-sigmas[0].ln(), -smin.ln())
}

/// DPM-Solver-23 with adaptive step size (eta 0; rtol 0.05, atol 0.0078,
/// h_init 0.05, PID with integral gain 1, accept safety 0.81), as
/// ComfyUI's `dpm_adaptive` runs it. The step controller works in f64 and
/// the error norm in f32, as there; the step callback reports accepted
/// steps (their count is not known ahead).
pub(super) fn dpm_adaptive<E>(
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
    let mut eps_at = |x: &[f32], s: f32| -> Result<Vec<f32>, E> {
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
        // The high order is the 3-step; the low order the 2-step with
        // r1 = 1/3, sharing its first two evaluations.
        let [c0, c1, c2] = third_order(s, t);
        let eps = eps_at(&x, c0.sigma)?;
        let u1: Vec<f32> = x.iter().zip(&eps).map(|(a, e)| a - c0.ca * e).collect();
        let e1 = eps_at(&u1, c1.sigma)?;
        let c_low = sig(t) / ((2.0 * (1.0f64 / 3.0)) as f32) * (t - s).exp_m1();
        let x_low: Vec<f32> = (0..n)
            .map(|j| x[j] - c2.ca * eps[j] - c_low * (e1[j] - eps[j]))
            .collect();
        let u2: Vec<f32> = (0..n)
            .map(|j| x[j] - c1.ca * eps[j] - c1.cb * (e1[j] - eps[j]))
            .collect();
        let e2 = eps_at(&u2, c2.sigma)?;
        let x_high: Vec<f32> = (0..n)
            .map(|j| x[j] - c2.ca * eps[j] - c2.cb * (e2[j] - eps[j]))
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
pub(super) fn sa_coeffs(
    sigma_next: f32,
    lambdas: &[f32],
    lambda_s: f32,
    lambda_t: f32,
    tau: f64,
) -> Vec<f32> {
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
pub(super) fn sa_solver<E>(
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
    let mut x = x;
    let mut x_pred = x.clone();
    let mut noise_v: Vec<f32> = Vec::new();
    let mut preds: Vec<Vec<f32>> = Vec::new();
    let total = sigmas.len() - 1;
    // Σ b·D over the last b.len() predictions, oldest first.
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
        let st = sa_step(space, sigmas, i, pece);
        match &st.corr {
            None => x = x_pred.clone(),
            Some(c) => {
                let res = combine(&preds, &c.b);
                for (j, xv) in x.iter_mut().enumerate() {
                    *xv = c.a * *xv + res[j];
                }
                if c.noise {
                    for (xv, v) in x.iter_mut().zip(&noise_v) {
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
        }
        match &st.pred {
            None => x = den,
            Some(p) => {
                let res = combine(&preds, &p.b);
                x_pred = x.iter().zip(&res).map(|(xv, r)| p.a * xv + r).collect();
                if let Some(k) = p.k {
                    let z = noise();
                    noise_v = z.iter().map(|zv| zv * sigmas[i + 1] * k * 1.0).collect();
                    for (xv, v) in x_pred.iter_mut().zip(&noise_v) {
                        *xv += v;
                    }
                }
            }
        }
        step(i + 1, total)?;
    }
    Ok(x)
}

/// One SA-Solver move: `x ← a·x + Σ bₖ·Dₖ` over the last `b.len()`
/// predictions, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct SaMove {
    pub a: f32,
    pub b: Vec<f32>,
    /// The corrector: whether the previous predictor's noise is added.
    pub noise: bool,
    /// The predictor: the noise's factor `k` (x ← x + z·σ_next·k), where
    /// the step is stochastic.
    pub k: Option<f32>,
}

/// SA-Solver's step `i` over `sigmas`, after its model call at σ_i: the
/// corrector of the previous predicted point (none on the first step,
/// nor on the last without PECE), then the predictor of the next point
/// (none on the last step, which takes the prediction).
pub(crate) struct SaStep {
    pub corr: Option<SaMove>,
    pub pred: Option<SaMove>,
}

pub(crate) fn sa_step(space: Space, sigmas: &[f32], i: usize, pece: bool) -> SaStep {
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
    // The predictions so far, this step's included (at most 4 kept).
    let held = (i + 1).min(4);
    let mut p_ord = held.min(3);
    let mut c_ord = if i == 0 || (sigmas[i + 1] == 0.0 && !pece) {
        0
    } else {
        held
    };
    if to_end {
        p_ord = p_ord.min(n_sig - 2 - i);
        c_ord = c_ord.min(n_sig - 1 - i);
    }
    let corr = (c_ord > 0).then(|| {
        // The previous predictor's τ and step.
        let tau = tau_of(sigmas[i]);
        let h = lambdas[i] - lambdas[i - 1];
        SaMove {
            a: sigmas[i] / sigmas[i - 1] * (-((tau * tau) as f32) * h).exp(),
            b: sa_coeffs(
                sigmas[i],
                &lambdas[i + 1 - c_ord..=i],
                lambdas[i - 1],
                lambdas[i],
                tau,
            ),
            noise: tau > 0.0,
            k: None,
        }
    });
    let pred = (sigmas[i + 1] != 0.0).then(|| {
        let tau = tau_of(sigmas[i + 1]);
        let h = lambdas[i + 1] - lambdas[i];
        SaMove {
            a: sigmas[i + 1] / sigmas[i] * (-((tau * tau) as f32) * h).exp(),
            b: sa_coeffs(
                sigmas[i + 1],
                &lambdas[i + 1 - p_ord..=i],
                lambdas[i],
                lambdas[i + 1],
                tau,
            ),
            noise: false,
            k: (tau > 0.0).then(|| (-((-2.0 * tau * tau) as f32 * h).exp_m1()).sqrt()),
        }
    });
    SaStep { corr, pred }
}

/// Solves a small dense system in f64 by Gauss–Jordan elimination with
/// partial pivoting (torch solves these in f32 with LAPACK).
pub(super) fn solve_small(a: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
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
pub(super) fn solve_small_f32(a: &[Vec<f32>], b: &[f32]) -> Vec<f32> {
    let a: Vec<Vec<f64>> = a
        .iter()
        .map(|r| r.iter().map(|&v| f64::from(v)).collect())
        .collect();
    let b: Vec<f64> = b.iter().map(|&v| f64::from(v)).collect();
    solve_small(&a, &b).into_iter().map(|v| v as f32).collect()
}

/// torch.pow with a small integer exponent, as its fast paths compute it.
pub(super) fn torch_pow_int(x: f32, e: usize) -> f32 {
    match e {
        0 => 1.0,
        1 => x,
        2 => x * x,
        3 => x * x * x,
        _ => x.powi(e as i32),
    }
}

/// torch.lerp for f32: from the start below weight 0.5, else from the end.
pub(super) fn torch_lerp(a: f32, b: f32, w: f32) -> f32 {
    let diff = b - a;
    if w.abs() < 0.5 {
        a + w * diff
    } else {
        b - diff * (1.0 - w)
    }
}

/// torch.nan_to_num with nan = 0: NaN → 0, ±inf → the largest finite.
pub(super) fn nan_to_num(v: f32) -> f32 {
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
pub(crate) fn ipndm_v_coeffs(order: usize, t: &[f32], i: usize) -> Vec<f32> {
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
pub(super) fn to_d(x: f32, sigma: f32, denoised: f32) -> f32 {
    (x - denoised) / sigma
}

pub(super) fn axpy(x: &mut [f32], d: &[f32], a: f32) {
    for (xv, dv) in x.iter_mut().zip(d) {
        *xv += dv * a;
    }
}

/// exp(lerp(log a, log b, 0.5)), with torch's lerp (weight ≥ 0.5 computes
/// from the end: b − (b − a)·(1 − w)).
pub(crate) fn log_mid(a: f32, b: f32) -> f32 {
    let (la, lb) = (a.ln(), b.ln());
    (lb - (lb - la) * 0.5).exp()
}
