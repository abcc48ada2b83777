//! The per-step numbers of the two-call and third-order samplers, computed
//! in one place for both loops: the host samplers (`samplers.rs`) and the
//! device loop (`diffusion::fused`) take the same f32 values, so the two
//! differ only in the arithmetic on tensors.

use super::samplers::{ancestral_step, Sampler, Space};

pub(crate) use super::solvers::log_mid;

/// An exponential-integrator move, `x ← a·x − b·D + alpha·z·su`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Exp {
    pub a: f32,
    pub b: f32,
    pub alpha: f32,
    pub su: f32,
}

/// DPM++ SDE (r = 1/2, η = 1) from σ `s` to `s_next` > 0: the first move
/// to the midpoint `s1` (noise `za`), the model there, then the second
/// move from x with the midpoint's prediction (noise `ka·za + kb·zb`: the
/// Brownian increment over the whole step from the two halves).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct DpmPpSde {
    pub s1: f32,
    pub first: Exp,
    pub second: Exp,
    pub ka: f32,
    pub kb: f32,
}

pub(crate) fn dpmpp_sde(space: Space, s: f32, s_next: f32) -> DpmPpSde {
    let (ls, lt) = (space.lambda(s), space.lambda(s_next));
    let h = lt - ls;
    let ls1 = ls + 0.5 * h;
    let s1 = space.sigma(ls1);
    let alpha_s = s * ls.exp();
    let alpha_s1 = s1 * ls1.exp();
    let alpha_t = s_next * lt.exp();
    // Brownian increments over [s1, s] and [s_next, s1]: the second
    // query's interval contains the first's.
    let (w1, w2) = (f64::from(s - s1), f64::from(s1 - s_next));
    let (ka, kb) = (
        (w1 / (w1 + w2)).sqrt() as f32,
        (w2 / (w1 + w2)).sqrt() as f32,
    );
    let toward = |to_lambda: f32, alpha: f32| {
        let (sd, su) = ancestral_step((-ls).exp(), (-to_lambda).exp());
        let h_ = -sd.ln() - ls;
        Exp {
            a: (alpha / alpha_s) * (-h_).exp(),
            b: alpha * (-h_).exp_m1(),
            alpha,
            su,
        }
    };
    DpmPpSde {
        s1,
        first: toward(ls1, alpha_s1),
        second: toward(lt, alpha_t),
        ka,
        kb,
    }
}

/// DPM++ 2S ancestral from σ `s` to the ancestral step's `down` > 0: the
/// midpoint σ and the two moves' (a, b) of `x ← a·x − b·D`.
pub(crate) fn dpmpp_2s(s: f32, down: f32) -> (f32, (f32, f32), (f32, f32)) {
    // t = −log σ; σ(t) = exp(−t).
    let (t, t_next) = (-s.ln(), -down.ln());
    let h = t_next - t;
    let sm = t + 0.5 * h;
    let sig = |t: f32| (-t).exp();
    (
        sig(sm),
        (sig(sm) / sig(t), (-h * 0.5).exp_m1()),
        (sig(t_next) / sig(t), (-h).exp_m1()),
    )
}

/// One DPM++ 3M SDE step (η = 1) from σ `s` to `s_next` > 0: `x ← a·x +
/// b·D`, the correction from the earlier predictions, then the noise
/// `x ← x + z·s_next·k`. `h` is this step's size in half-logSNR, for the
/// next steps' history.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Sde3m {
    pub a: f32,
    pub b: f32,
    pub h: f32,
    pub k: f32,
    pub corr: Corr3,
}

/// DPM++ 3M SDE's correction from the history.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Corr3 {
    /// The first step: none.
    None,
    /// One earlier prediction D₁: `x ← x + c·((D − D₁)/r)`.
    One { r: f32, c: f32 },
    /// Two, D₁ and D₂: with d1_0 = (D − D₁)/r0 and d1_1 = (D₁ − D₂)/r1,
    /// `x ← x + c1·(d1_0 + (d1_0 − d1_1)·r0/(r0 + r1)) − c2·((d1_0 −
    /// d1_1)/(r0 + r1))`.
    Two { r0: f32, r1: f32, c1: f32, c2: f32 },
}

/// `h_1`, `h_2`: the last two steps' sizes, where there were such steps.
pub(crate) fn dpmpp_3m_sde(
    space: Space,
    s: f32,
    s_next: f32,
    h_1: Option<f32>,
    h_2: Option<f32>,
) -> Sde3m {
    let (ls, lt) = (space.lambda(s), space.lambda(s_next));
    let h = lt - ls;
    let h_eta = h * 2.0;
    let alpha_t = s_next * lt.exp();
    let phi_2 = (-h_eta).exp_m1() / h_eta + 1.0;
    let corr = match (h_1, h_2) {
        (Some(h1), Some(h2)) => {
            let phi_3 = phi_2 / h_eta - 0.5;
            Corr3::Two {
                r0: h1 / h,
                r1: h2 / h,
                c1: alpha_t * phi_2,
                c2: alpha_t * phi_3,
            }
        }
        (Some(h1), None) => Corr3::One {
            r: h1 / h,
            c: alpha_t * phi_2,
        },
        _ => Corr3::None,
    };
    Sde3m {
        a: s_next / s * (-h).exp(),
        b: alpha_t * -(-h_eta).exp_m1(),
        h,
        k: (-(-2.0 * h).exp_m1()).sqrt(),
        corr,
    }
}

/// One step of the linear multistep samplers (LMS, DEIS, iPNDM,
/// iPNDM-v) as the device loop runs it, over the derivative
/// d₀ = (x − D)/σ and the last three carried d₁, d₂, d₃ (zeros before
/// there are three):
/// - the sum form, `x ← x + (dt·Σ mₖ·dₖ)/div` (LMS: dt = div = 1);
/// - DEIS's accumulating form, `x ← ((x + m₀·d₀) + m₁·d₁) + …`;
/// - where `take`, the prediction itself (the last step, σ_next = 0).
///
/// The terms the host sampler lacks at this step have mₖ = 0, and
/// multiplying by 1 or dividing by 1 is exact, so each form rounds as
/// the host's (`samplers.rs`) does, term by term.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Linear {
    pub m: [f32; 4],
    pub dt: f32,
    pub div: f32,
    pub take: bool,
}

/// Step `i` of `sampler` (one of the four) over `sigmas`.
pub(crate) fn linear(sampler: Sampler, sigmas: &[f32], i: usize) -> Linear {
    use super::solvers::{deis_step, ipndm_v_coeffs, lms_coeff};
    let (s, s_next) = (sigmas[i], sigmas[i + 1]);
    let mut l = Linear {
        m: [0.0; 4],
        dt: 1.0,
        div: 1.0,
        take: false,
    };
    let order = (i + 1).min(4);
    let put = |m: &mut [f32; 4], c: &[f32]| {
        for (slot, v) in m.iter_mut().zip(c) {
            *slot = *v;
        }
    };
    match sampler {
        Sampler::Deis => {
            // Order 1 (the first and the last step) is Euler.
            let c = if s_next <= 0.0 {
                Vec::new()
            } else {
                deis_step(sigmas, i, 3)
            };
            if c.is_empty() {
                l.m[0] = s_next - s;
            } else {
                put(&mut l.m, &c);
            }
        }
        _ if s_next == 0.0 => l.take = true,
        Sampler::Lms => {
            let c: Vec<f32> = (0..order)
                .map(|j| lms_coeff(order, sigmas, i, j) as f32)
                .collect();
            put(&mut l.m, &c);
        }
        Sampler::IpndmV => {
            l.dt = s_next - s;
            put(&mut l.m, &ipndm_v_coeffs(order, sigmas, i));
        }
        // iPNDM's fixed Adams–Bashforth forms.
        _ => {
            l.dt = s_next - s;
            let (c, div): (&[f32], f32) = match order {
                1 => (&[1.0], 1.0),
                2 => (&[3.0, -1.0], 2.0),
                3 => (&[23.0, -16.0, 5.0], 12.0),
                _ => (&[55.0, -59.0, 37.0, -9.0], 24.0),
            };
            put(&mut l.m, c);
            l.div = div;
        }
    }
    l
}

/// One ER-SDE step (VP ER-SDE-Solver-3, arXiv 2309.06169, s_noise 1)
/// from σ `s` to `s_next` > 0, with λ = σ/α = exp(−half-logSNR):
/// `x ← a·x + b·D`, then `x ← x + c2·dd` with the divided difference
/// dd = (D − D_old)/q, then `x ← x + c3·((dd − dd_old)/half)`, then the
/// noise `x ← x + (at·z)·k`. A term the step lacks (the first step has
/// no D_old, the second no dd_old) has c = 0 and q or half 1, so it adds
/// an exact zero.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ErSde {
    pub a: f32,
    pub b: f32,
    pub c2: f32,
    pub q: f32,
    pub c3: f32,
    pub half: f32,
    pub at: f32,
    pub k: f32,
    /// 1 to 3: which of the terms above the step has.
    pub stage: usize,
}

/// Step `i` of ER-SDE over `sigmas` (σ_{i+1} > 0), the steps before it
/// run in the same loop.
pub(crate) fn er_sde(space: Space, sigmas: &[f32], i: usize) -> ErSde {
    let lam = |k: usize| (-space.lambda(sigmas[k])).exp();
    let scaler = |v: f32| v * ((v.powf(0.3)).exp() + 10.0);
    let (s, s_next) = (sigmas[i], sigmas[i + 1]);
    let stage = (i + 1).min(3);
    let (ls, lt) = (lam(i), lam(i + 1));
    let (alpha_s, alpha_t) = (s / ls, s_next / lt);
    let r_alpha = alpha_t / alpha_s;
    let r = scaler(lt) / scaler(ls);
    let mut st = ErSde {
        a: r_alpha * r,
        b: alpha_t * (1.0 - r),
        c2: 0.0,
        q: 1.0,
        c3: 0.0,
        half: 1.0,
        at: alpha_t,
        k: super::solvers::nan_to_num((lt * lt - (ls * ls) * (r * r)).sqrt()),
        stage,
    };
    if stage >= 2 {
        // The integrals of 1/scaler and (λ − λ_s)/scaler over the step,
        // by 200-point Riemann sums from λ_t, as the reference takes them.
        let dt = lt - ls;
        let step = -dt / 200.0;
        let pos: Vec<f32> = (0..200).map(|k| lt + k as f32 * step).collect();
        let scaled: Vec<f32> = pos.iter().map(|&p| scaler(p)).collect();
        let sum = |f: &dyn Fn(usize) -> f32| -> f32 {
            (0..200).map(|k| f64::from(f(k))).sum::<f64>() as f32
        };
        let s1 = sum(&|k| 1.0 / scaled[k]) * step;
        st.c2 = alpha_t * (dt + s1 * scaler(lt));
        st.q = ls - lam(i - 1);
        if stage >= 3 {
            let su = sum(&|k| (pos[k] - ls) / scaled[k]) * step;
            st.c3 = alpha_t * ((dt * dt) / 2.0 + su * scaler(lt));
            st.half = (ls - lam(i - 2)) / 2.0;
        }
    }
    st
}

/// One model call of a SEEDS step (arXiv 2305.14267, η = 1, s_noise 1),
/// at σ `sigma`: after the model's prediction D, the noise accumulator
/// moves as `sde ← sde·e + k·z` and the point as `x ← c·x_s − m·(p1·D₁ +
/// p2·D) + sde·sn`, with x_s the step's start and D₁ its first call's
/// prediction. The next call runs at the point this one moves to; the
/// last call's point is the step's end.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SeedsCall {
    pub sigma: f32,
    pub e: f32,
    pub k: f32,
    pub c: f32,
    pub m: f32,
    pub p1: f32,
    pub p2: f32,
    pub sn: f32,
}

/// The calls of a SEEDS-2 (or SEEDS-3, `three`) step from σ `s` to
/// `s_next` > 0. SEEDS-2's second move takes lerp(D₁, D₂, 1/(2r) = 1),
/// which is D₂ itself (p1 = 0, p2 = 1).
pub(crate) fn seeds(space: Space, s: f32, s_next: f32, three: bool) -> Vec<SeedsCall> {
    use super::solvers::torch_lerp;
    let (ls, lt) = (space.lambda(s), space.lambda(s_next));
    let h = lt - ls;
    let h_eta = h * 2.0;
    let phi1 = |v: f32| v.exp_m1();
    let phi2 = |v: f32| (v.exp_m1() - v) / v;
    let alpha_t = s_next * lt.exp();
    // The intermediate points at fractions r of the step: (σ, α).
    let (r1, r2) = if three {
        (1.0 / 3.0, 2.0 / 3.0)
    } else {
        (0.5f64, 1.0f64)
    };
    let at = |r: f64| -> (f32, f32) {
        let l = torch_lerp(ls, lt, r as f32);
        let sig = space.sigma(l);
        (sig, sig * l.exp())
    };
    // The noise carried from fraction `from` to `to` of the step.
    let renoise = |from: f64, to: f64| {
        let sf = ((from - to) as f32) * h;
        (sf.exp(), (-(sf * 2.0).exp_m1()).sqrt())
    };
    let (s1, a1) = at(r1);
    let (rf1, rf2) = (r1 as f32, r2 as f32);
    let first = SeedsCall {
        sigma: s,
        e: 0.0,
        k: (-((-2.0 * r1) as f32 * h).exp_m1()).sqrt(),
        c: s1 / s * (-rf1 * h).exp(),
        m: 1.0,
        p1: 0.0,
        p2: a1 * phi1(-rf1 * h_eta),
        sn: s1,
    };
    let c_end = s_next / s * (-h).exp();
    if !three {
        let (e, k) = renoise(r1, 1.0);
        let second = SeedsCall {
            sigma: s1,
            e,
            k,
            c: c_end,
            m: alpha_t * phi1(-h_eta),
            p1: 0.0,
            p2: 1.0,
            sn: s_next,
        };
        return vec![first, second];
    }
    let (s2, a2) = at(r2);
    let a3_2 = (r2 / r1) as f32 * phi2(-rf2 * h_eta);
    let (e, k) = renoise(r1, r2);
    let second = SeedsCall {
        sigma: s1,
        e,
        k,
        c: s2 / s * (-rf2 * h).exp(),
        m: a2,
        p1: phi1(-rf2 * h_eta) - a3_2,
        p2: a3_2,
        sn: s2,
    };
    let b3 = phi2(-h_eta) / rf2;
    let (e, k) = renoise(r2, 1.0);
    let third = SeedsCall {
        sigma: s2,
        e,
        k,
        c: c_end,
        m: alpha_t,
        p1: phi1(-h_eta) - b3,
        p2: b3,
        sn: s_next,
    };
    vec![first, second, third]
}

/// The ancestral step of a flow model (η = 1) from σ `s` to `s_next`:
/// the move's target σ_down, then `x ← a·x + z·renoise`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RfAncestral {
    pub down: f32,
    pub a: f32,
    pub renoise: f32,
}

pub(crate) fn rf_ancestral(s: f32, s_next: f32) -> RfAncestral {
    let ratio = 1.0 + (s_next / s - 1.0);
    let down = s_next * ratio;
    let (a_next, a_down) = (1.0 - s_next, 1.0 - down);
    RfAncestral {
        down,
        a: a_next / a_down,
        renoise: (s_next * s_next - down * down * (a_next * a_next) / (a_down * a_down)).sqrt(),
    }
}

/// DPM++ 2S ancestral's midpoint on a flow model: halfway from σ `s` to
/// `down` in λ = log((1 − σ)/σ), σ(λ) = (e^λ + 1)⁻¹ (0.9999 from σ = 1,
/// where λ is infinite).
pub(crate) fn rf_mid(s: f32, down: f32) -> f32 {
    if s == 1.0 {
        return 0.9999;
    }
    let lam = |v: f32| ((1.0 - v) / v).ln();
    let (t, t_down) = (lam(s), lam(down));
    let sm = t + 0.5 * (t_down - t);
    1.0 / (sm.exp() + 1.0)
}

/// One DDPM step (VP ancestral) from σ `s` to `s_next`: with ε = (x −
/// D)/σ, `x ← (c0·(x/k − c1·ε/c2) + c3·z)·kn`, z drawn where σ_next > 0
/// (kn 1 on the last step, which stays in the model's space).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Ddpm {
    pub k: f32,
    pub c0: f32,
    pub c1: f32,
    pub c2: f32,
    pub c3: f32,
    pub kn: f32,
}

pub(crate) fn ddpm(s: f32, s_next: f32) -> Ddpm {
    let ac = 1.0 / ((s * s) + 1.0);
    let acp = 1.0 / ((s_next * s_next) + 1.0);
    let alpha = ac / acp;
    Ddpm {
        k: (1.0f32 + s * s).sqrt(),
        c0: (1.0 / alpha).sqrt(),
        c1: 1.0 - alpha,
        c2: (1.0 - ac).sqrt(),
        c3: ((1.0 - alpha) * (1.0 - acp) / (1.0 - ac)).sqrt(),
        kn: if s_next == 0.0 {
            1.0
        } else {
            (1.0f32 + s_next * s_next).sqrt()
        },
    }
}
