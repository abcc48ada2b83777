//! UniPC (bh1 or bh2 variant), as ComfyUI's `uni_pc` runs it: data
//! prediction in VP form over sigmas as times (the last 0 replaced by
//! 0.001), multistep order min(3, steps − 1) with lower orders at the end,
//! corrector on every step but the last. [`uni_step`] computes one
//! update's numbers for both loops: the host sampler ([`uni_pc`]) and the
//! device loop ([`device_call`], `diffusion::fused`).

use super::solvers::{solve_small_f32, torch_pow_int};

/// A model call inside a sampler: x and sigma to a prediction.
type ModelFn<'a, E> = dyn FnMut(&[f32], f32) -> Result<Vec<f32>, E> + 'a;

/// SigmaConvert: log α of a sigma used as time.
fn lmc(s: f32) -> f32 {
    0.5 * (1.0 / ((s * s) + 1.0)).ln()
}

fn alpha(s: f32) -> f32 {
    lmc(s).exp()
}

fn std(s: f32) -> f32 {
    (1.0 - (2.0 * lmc(s)).exp()).sqrt()
}

fn lambda(s: f32) -> f32 {
    let l = lmc(s);
    l - 0.5 * (1.0 - (2.0 * l).exp()).ln()
}

/// The scaling of x to the model's input at σ `s`, √(σ² + 1).
fn input_scale(s: f32) -> f32 {
    ((s * s) + 1.0).sqrt()
}

/// The times UniPC steps through: the sigmas, a last 0 as 0.001.
fn times(sigmas: &[f32]) -> Vec<f32> {
    let mut ts = sigmas.to_vec();
    if let Some(last) = ts.last_mut().filter(|v| **v == 0.0) {
        *last = 0.001;
    }
    ts
}

/// One multistep update's numbers, to time `t` from the last of `t_prev`
/// with the last `order` model outputs m₀ (the latest), m₁, m₂:
/// - d1ₖ = (mₖ − m₀)/rksₖ₋₁ for k ≥ 1;
/// - the predictor `x_t_ = c_x·x − c_m·m₀`, `x_t = x_t_ − c_b·Σ d1ₖ·rhos_pₖ₋₁`;
/// - the corrector, with the model output m_t at x_t,
///   `x_t_ − c_b·(Σ d1ₖ·rhos_cₖ₋₁ + rhos_c[last]·(m_t − m₀))`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct UniStep {
    pub rks: Vec<f32>,
    pub c_x: f32,
    pub c_m: f32,
    pub c_b: f32,
    pub rhos_p: Vec<f32>,
    /// Empty where the update has no corrector.
    pub rhos_c: Vec<f32>,
}

pub(crate) fn uni_step(
    t_prev: &[f32],
    t: f32,
    order: usize,
    bh2: bool,
    corrector: bool,
) -> UniStep {
    let tp0 = t_prev[t_prev.len() - 1];
    let (lp0, lt) = (lambda(tp0), lambda(t));
    let (sp0, st) = (std(tp0), std(t));
    let alpha_t = lmc(t).exp();
    let h = lt - lp0;
    let mut rks: Vec<f32> = (1..order)
        .map(|i| (lambda(t_prev[t_prev.len() - 1 - i]) - lp0) / h)
        .collect();
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
    let rhos_p: Vec<f32> = if order <= 1 {
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
    let rhos_c = match (corrector, order) {
        (false, _) => Vec::new(),
        (true, 1) => vec![0.5],
        (true, _) => solve_small_f32(&r_mat, &b),
    };
    rks.pop();
    UniStep {
        rks,
        c_x: st / sp0,
        c_m: alpha_t * h_phi_1,
        c_b: alpha_t * b_h,
        rhos_p,
        rhos_c,
    }
}

/// The multistep order of the update to `ts[st]` (1 ≤ st ≤ steps):
/// rising to `order` from the start, falling at the end.
fn order_at(st: usize, order: usize, steps: usize) -> usize {
    if st < order {
        st
    } else {
        order.min(steps + 1 - st)
    }
}

pub(super) fn uni_pc<E>(
    x: Vec<f32>,
    sigmas: &[f32],
    bh2: bool,
    mut denoise: impl FnMut(&[f32], f32) -> Result<Vec<f32>, E>,
    mut step: impl FnMut(usize, usize) -> Result<(), E>,
) -> Result<Vec<f32>, E> {
    if sigmas.len() < 2 {
        return Ok(x);
    }
    let ts = times(sigmas);
    // data_prediction_fn over predict_eps_sigma.
    let mut model_fn = |x: &[f32], s: f32| -> Result<Vec<f32>, E> {
        let k = input_scale(s);
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
        let u = uni_step(t_prev, t, order, bh2, corrector);
        let m0 = &models[models.len() - 1];
        let d1s: Vec<Vec<f32>> = u
            .rks
            .iter()
            .enumerate()
            .map(|(i, &rk)| {
                let mi = &models[models.len() - 2 - i];
                mi.iter().zip(m0).map(|(a, b)| (a - b) / rk).collect()
            })
            .collect();
        let x_t_: Vec<f32> = (0..n).map(|j| u.c_x * x[j] - u.c_m * m0[j]).collect();
        let x_t: Vec<f32> = if d1s.is_empty() {
            x_t_.iter().map(|v| v - u.c_b * 0.0).collect()
        } else {
            (0..n)
                .map(|j| {
                    let pred = d1s
                        .iter()
                        .zip(&u.rhos_p)
                        .fold(0f32, |acc, (d, r)| acc + d[j] * r);
                    x_t_[j] - u.c_b * pred
                })
                .collect()
        };
        if !corrector {
            return Ok((x_t, None));
        }
        let model_t = model_fn(&x_t, t)?;
        let rc_last = u.rhos_c[u.rhos_c.len() - 1];
        let out: Vec<f32> = (0..n)
            .map(|j| {
                let corr = d1s
                    .iter()
                    .zip(&u.rhos_c)
                    .fold(0f32, |acc, (d, r)| acc + d[j] * r);
                let d1_t = model_t[j] - m0[j];
                x_t_[j] - u.c_b * (corr + rc_last * d1_t)
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
                let step_order = order_at(st, order, steps);
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

/// The device loop's state before its first call, from the sampler's
/// starting latent `x`: the model's input there (`lat`, x/k₀·k₀ as the
/// host rounds it) and x/k₀ (`xt`).
pub(crate) fn device_start(x: &[f32], sigmas: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let s0 = sigmas.first().copied().unwrap_or(0.0);
    let k0 = (1.0f32 + s0 * s0).sqrt();
    let xt: Vec<f32> = x.iter().map(|v| v / k0).collect();
    let k = input_scale(s0);
    (xt.iter().map(|v| v * k).collect(), xt)
}

/// The one-element inputs of the device loop's call `j` (the model at
/// `ts[j]`), named as `diffusion::fused` reads them. Each call:
/// 1. takes the model output m_t = (xt − sd·(lat − D)/σ)/a at the carried
///    point xt (its input `lat` = xt·√(σ²+1));
/// 2. corrects the update that led to xt (`sc` 1; call 0, where there
///    was none, keeps xt: `sc` 0, `st` 1) from the carried x_t_ (`xb`)
///    and history h₀ (latest), h₁, h₂ with `rk1`, `rk2`, `rc1`, `rc2`,
///    `rcl`, `cb`;
/// 3. predicts the next point from there and the history with m_t first
///    (`rp1`, `rp2`, `pp1`, `pp2`, `cx`, `cm`, `cbp`);
/// 4. scales it to the next call's input (`kmul`, `kdiv` 1), or after the
///    last call divides by α at the end (`kmul` 1, `kdiv`).
///
/// The terms an update of lower order lacks have zero coefficients (and
/// divisors 1), so each sum rounds as the host's fold does.
pub(crate) fn device_call(sigmas: &[f32], j: usize, bh2: bool) -> Vec<(&'static str, f32)> {
    let ts = times(sigmas);
    let steps = ts.len() - 1;
    let order = 3.min(ts.len().saturating_sub(2));
    let s = ts[j];
    let mut v = vec![("a", alpha(s)), ("sd", std(s))];
    // The corrector of the update to ts[j].
    let (mut rk, mut rc, mut rcl, mut cb, mut sc) = ([1.0; 2], [0.0; 2], 0.0, 0.0, 0.0);
    if j >= 1 {
        let u = uni_step(&ts[..j], s, order_at(j, order, steps), bh2, true);
        for (k, &r) in u.rks.iter().enumerate() {
            rk[k] = r;
            rc[k] = u.rhos_c[k];
        }
        rcl = u.rhos_c[u.rhos_c.len() - 1];
        cb = u.c_b;
        sc = 1.0;
    }
    v.extend([
        ("rk1", rk[0]),
        ("rk2", rk[1]),
        ("rc1", rc[0]),
        ("rc2", rc[1]),
        ("rcl", rcl),
        ("cb", cb),
        ("sc", sc),
        ("st", 1.0 - sc),
    ]);
    // The predictor of the update to ts[j + 1]; with one step, none (x
    // only rescaled, as ComfyUI does).
    let (mut rp, mut pp, mut cx, mut cm, mut cbp) = ([1.0; 2], [0.0; 2], 1.0, 0.0, 0.0);
    if order > 0 {
        let u = uni_step(
            &ts[..=j],
            ts[j + 1],
            order_at(j + 1, order, steps),
            bh2,
            false,
        );
        for (k, &r) in u.rks.iter().enumerate() {
            rp[k] = r;
            pp[k] = u.rhos_p[k];
        }
        (cx, cm, cbp) = (u.c_x, u.c_m, u.c_b);
    }
    let (kmul, kdiv) = if j + 1 < steps {
        (input_scale(ts[j + 1]), 1.0)
    } else {
        (1.0, alpha(ts[steps]))
    };
    v.extend([
        ("rp1", rp[0]),
        ("rp2", rp[1]),
        ("pp1", pp[0]),
        ("pp2", pp[1]),
        ("cx", cx),
        ("cm", cm),
        ("cbp", cbp),
        ("kmul", kmul),
        ("kdiv", kdiv),
    ]);
    v
}
