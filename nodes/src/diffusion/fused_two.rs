//! The device loop's samplers of more than one call a step: the
//! two-call ones ([`Two`]), whose first call moves `lat` and keeps where
//! the step started (and Heun's derivative) and whose second moves from
//! there, and heunpp2 (up to three calls). Per-call 0/1 selectors pick
//! each call's form of the shared tail (`Fused::outputs`).

use super::fused::{Call, Fused, Two, DIR, KEPT, NEXT};
use crate::sampling::samplers::ancestral_step;
use sdkit_compute::tensor::{GraphBuilder, ShapeError, T};
use std::sync::Arc;

impl Fused {
    /// A [`Step::Two`] sampler's calls from σ `s` to `s_next`, built by
    /// `call(σ, scalars, carry)`.
    pub(super) fn two_calls(
        &self,
        two: Two,
        (s, s_next): (f32, f32),
        call: impl Fn(f32, &[(&str, f32)], Vec<(usize, &'static str)>) -> Call,
        noise: &mut dyn FnMut() -> Vec<f32>,
    ) -> Vec<Call> {
        // The first call moves `lat` and keeps where it started (and
        // Heun's derivative); the second moves from there.
        let first_carry = || {
            let mut c = vec![(NEXT, "lat"), (KEPT, "base")];
            if two == Two::Heun {
                c.push((DIR, "dold"));
            }
            c
        };
        let lat = || vec![(NEXT, "lat")];
        // Scalars default to the first call's Euler move from `lat`.
        let mut first = vec![
            ("sa", 1.0),
            ("sb", 0.0),
            ("pa", 1.0),
            ("pb", 0.0),
            ("se", 1.0),
            ("sx", 0.0),
            ("a", 0.0),
            ("b", 0.0),
            ("al", 1.0),
            ("su", 0.0),
            ("dt", 0.0),
        ];
        let set = |v: &mut Vec<(&str, f32)>, name: &str, val: f32| {
            if let Some(slot) = v.iter_mut().find(|(n, _)| *n == name) {
                slot.1 = val;
            }
        };
        let mut second = first.clone();
        for (name, val) in [("sa", 0.0), ("sb", 1.0)] {
            set(&mut second, name, val);
        }
        let with_noise = |mut c: Call, z: Vec<f32>| {
            c.inputs.insert("noise".to_string(), Arc::new(z));
            c
        };
        if two == Two::DpmPpSde {
            for v in [&mut first, &mut second] {
                set(v, "se", 0.0);
                set(v, "sx", 1.0);
            }
            if s_next == 0.0 {
                // The prediction itself: 0·x − (−1)·D.
                set(&mut first, "b", -1.0);
                return vec![call(s, &first, lat())];
            }
            let st = crate::sampling::steps::dpmpp_sde(self.space, s, s_next);
            for (v, e) in [(&mut first, st.first), (&mut second, st.second)] {
                set(v, "a", e.a);
                set(v, "b", e.b);
                set(v, "al", e.alpha);
                set(v, "su", e.su);
            }
            let (za, zb) = (noise(), noise());
            let z: Vec<f32> = za
                .iter()
                .zip(&zb)
                .map(|(a, b)| st.ka * a + st.kb * b)
                .collect();
            return vec![
                with_noise(call(s, &first, first_carry()), za),
                with_noise(call(st.s1, &second, lat()), z),
            ];
        }
        // The others move toward `end` (the ancestral forms' σ_down, then
        // noise × σ_up, or a flow model's a·x + z·renoise), on the last
        // step by one Euler call.
        let rf = matches!(two, Two::Dpm2AncestralRf | Two::DpmPp2sAncestralRf)
            .then(|| crate::sampling::steps::rf_ancestral(s, s_next));
        let ancestral = rf.is_some() || matches!(two, Two::Dpm2Ancestral | Two::DpmPp2sAncestral);
        let (end, up) = match rf {
            Some(r) => (r.down, r.renoise),
            None if ancestral => ancestral_step(s, s_next),
            None => (s_next, 0.0),
        };
        if let Some(r) = rf {
            first.push(("an", 1.0));
            second.push(("an", r.a));
        }
        set(&mut first, "dt", end - s);
        if end == 0.0 {
            return vec![call(s, &first, lat())];
        }
        set(&mut second, "dt", end - s);
        let mid = match two {
            // The second call at σ_next averages both derivatives.
            Two::Heun => {
                set(&mut second, "pa", 0.0);
                set(&mut second, "pb", 1.0);
                end
            }
            // Blends toward the flow midpoint, then from the step's start
            // to σ_down, with the midpoint's prediction.
            Two::DpmPp2sAncestralRf => {
                let mid = crate::sampling::steps::rf_mid(s, end);
                for (v, target) in [(&mut first, mid), (&mut second, end)] {
                    let r = target / s;
                    set(v, "se", 0.0);
                    set(v, "sx", 1.0);
                    set(v, "a", r);
                    set(v, "b", -(1.0 - r));
                }
                mid
            }
            Two::DpmPp2sAncestral => {
                let (mid, (a1, b1), (a2, b2)) = crate::sampling::steps::dpmpp_2s(s, end);
                for (v, a, b) in [(&mut first, a1, b1), (&mut second, a2, b2)] {
                    set(v, "se", 0.0);
                    set(v, "sx", 1.0);
                    set(v, "a", a);
                    set(v, "b", b);
                }
                mid
            }
            // DPM-2: the first call moves to the log-midpoint.
            _ => {
                let mid = crate::sampling::steps::log_mid(s, end);
                set(&mut first, "dt", mid - s);
                mid
            }
        };
        let first = call(s, &first, first_carry());
        if !ancestral {
            return vec![first, call(mid, &second, lat())];
        }
        set(&mut second, "su", up);
        let z = noise();
        vec![first, with_noise(call(mid, &second, lat()), z)]
    }

    /// heunpp2's calls for step `i` over `sigmas`, as the host sampler
    /// makes them: one Euler call where σ_next is the schedule's end;
    /// else a second call at σ_next (from x₂ = x + d·dt), and where
    /// σ₂ = σ[i + 2] is not the end a third at σ₂ (from x₃ = x₂ +
    /// d₂·(σ₂ − σ_next)); the last call moves the step's start x by the
    /// weighted derivatives times dt. Each move is `src` plus
    /// `(w1·d1 + w2·d2 + wc·d)·dt` with the host's weights (1 where it
    /// has one term, 0 for the terms it lacks).
    pub(super) fn heunpp2_calls(
        &self,
        sigmas: &[f32],
        i: usize,
        call: impl Fn(f32, &[(&str, f32)], Vec<(usize, &'static str)>) -> Call,
    ) -> Vec<Call> {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let s_end = sigmas[sigmas.len() - 1];
        let dt = s_next - s;
        // (sa, sb, w1, w2, wc, dt): from this call's latent along its own
        // derivative, by default.
        let along = |dt: f32| {
            [
                ("sa", 1.0),
                ("sb", 0.0),
                ("w1", 0.0),
                ("w2", 0.0),
                ("wc", 1.0),
                ("dt", dt),
            ]
        };
        let lat = || vec![(NEXT, "lat")];
        if s_next == s_end {
            return vec![call(s, &along(dt), lat())];
        }
        // The first call keeps the step's start (its own input, copied
        // before the move replaces it) and its derivative.
        let first = call(
            s,
            &along(dt),
            vec![(KEPT, "base"), (NEXT, "lat"), (DIR, "d1")],
        );
        let s2 = sigmas[i + 2];
        let step_start = |w1: f32, w2: f32, wc: f32| {
            [
                ("sa", 0.0),
                ("sb", 1.0),
                ("w1", w1),
                ("w2", w2),
                ("wc", wc),
                ("dt", dt),
            ]
        };
        if s2 == s_end {
            let w2 = s_next / (2.0 * sigmas[0]);
            let w1 = 1.0 - w2;
            return vec![first, call(s_next, &step_start(w1, 0.0, w2), lat())];
        }
        // The second hands on the step's start and first derivative too
        // (copies), for a third call in another program.
        let second = call(
            s_next,
            &along(s2 - s_next),
            vec![
                (NEXT, "lat"),
                (DIR, "d2"),
                (KEPT + 2, "base"),
                (KEPT + 3, "d1"),
            ],
        );
        let w = 3.0 * sigmas[0];
        let (w2, w3) = (s_next / w, s2 / w);
        let w1 = 1.0 - w2 - w3;
        vec![first, second, call(s2, &step_start(w1, w2, w3), lat())]
    }

    /// A SEEDS step's calls from σ `s` to `s_next`
    /// (`sampling::steps::seeds`), each with its own noise, drawn in the
    /// host's order; the last step is one call taking the prediction.
    /// The first call keeps the step's start and its prediction (`sa` 1),
    /// the others move from them (`sb` 1) and hand them on.
    pub(super) fn seeds_calls(
        &self,
        three: bool,
        (s, s_next): (f32, f32),
        call: impl Fn(f32, &[(&str, f32)], Vec<(usize, &'static str)>) -> Call,
        noise: &mut dyn FnMut() -> Vec<f32>,
    ) -> Vec<Call> {
        let with_noise = |mut c: Call, z: Vec<f32>| {
            c.inputs.insert("noise".to_string(), Arc::new(z));
            c
        };
        if s_next == 0.0 {
            let mut v: Vec<(&str, f32)> = ["sa", "sb", "e", "k", "c", "m", "p1", "p2", "sn"]
                .into_iter()
                .map(|n| (n, 0.0))
                .collect();
            v.extend([("keep", 0.0), ("take", 1.0)]);
            let per: usize = self.dims.iter().product();
            return vec![with_noise(call(s, &v, vec![(NEXT, "lat")]), vec![0.0; per])];
        }
        let calls = crate::sampling::steps::seeds(self.space, s, s_next, three);
        calls
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let [sa, sb] = start_flags(k);
                let v = [
                    sa,
                    sb,
                    ("e", c.e),
                    ("k", c.k),
                    ("c", c.c),
                    ("m", c.m),
                    ("p1", c.p1),
                    ("p2", c.p2),
                    ("sn", c.sn),
                    ("keep", 1.0),
                    ("take", 0.0),
                ];
                let carry = vec![
                    (NEXT, "lat"),
                    (KEPT, "base"),
                    (KEPT + 1, "d1"),
                    (KEPT + 2, "sde"),
                ];
                with_noise(call(c.sigma, &v, carry), noise())
            })
            .collect()
    }

    /// DPM++ 2S ancestral CFG++'s move, `a·(x_s + (D₁ − u)) − b·D`, from
    /// the step's start x_s and first prediction D₁ (this call's own where
    /// `sa` is 1, the carried ones where `sb` is), with this call's
    /// unconditional prediction u and prediction D, then `+ z·up`; the
    /// prediction itself on the last step.
    pub(super) fn cfg_pp_2s_tail<'a>(
        &self,
        g: &'a GraphBuilder,
        (lat, d, u): (T<'a>, T<'a>, T<'a>),
        kept: &mut Vec<T<'a>>,
    ) -> Result<T<'a>, ShapeError> {
        let scalar = |name: &str| g.input(name, &[1]);
        let (src, d1) = self.step_start(g, (lat, d), "d1")?;
        let moved = src
            .add(d1.sub(u)?)?
            .mul(scalar("a")?)?
            .sub(d.mul(scalar("b")?)?)?
            .add(g.input("noise", &self.dims)?.mul(scalar("up")?)?)?;
        kept.extend([src, d1]);
        moved.mul(scalar("keep")?)?.add(d.mul(scalar("take")?)?)
    }

    /// DPM++ 2S ancestral CFG++'s calls from σ `s` to `s_next`, as the
    /// host sampler runs them: to the log-midpoint toward σ_down, then
    /// from the step's start to σ_down, then the noise × σ_up; one call
    /// taking the prediction on the last step (σ_down = 0).
    pub(super) fn cfg_pp_2s_calls(
        &self,
        (s, s_next): (f32, f32),
        call: impl Fn(f32, &[(&str, f32)], Vec<(usize, &'static str)>) -> Call,
        noise: &mut dyn FnMut() -> Vec<f32>,
    ) -> Vec<Call> {
        let (down, up) = ancestral_step(s, s_next);
        let zeros = |names: &[&'static str]| -> Vec<(&'static str, f32)> {
            names.iter().map(|&n| (n, 0.0)).collect()
        };
        if down == 0.0 {
            let mut v = zeros(&["sa", "sb", "a", "b", "up", "keep"]);
            v.push(("take", 1.0));
            return vec![call(s, &v, vec![(NEXT, "lat")])];
        }
        let (t, t_next) = (-s.ln(), -down.ln());
        let h = t_next - t;
        let sm = t + 0.5 * h;
        let sig = |t: f32| (-t).exp();
        let moves = [
            (sig(sm) / sig(t), (-h * 0.5).exp_m1()),
            (sig(t_next) / sig(t), (-h).exp_m1()),
        ];
        let scalars = |k: usize| {
            let [sa, sb] = start_flags(k);
            [
                sa,
                sb,
                ("a", moves[k].0),
                ("b", moves[k].1),
                ("up", if k == 0 { 0.0 } else { up }),
                ("keep", 1.0),
                ("take", 0.0),
            ]
        };
        let first = call(
            s,
            &scalars(0),
            vec![(NEXT, "lat"), (KEPT, "base"), (KEPT + 1, "d1")],
        );
        let mut second = call(sig(sm), &scalars(1), vec![(NEXT, "lat")]);
        second.inputs.insert("noise".to_string(), Arc::new(noise()));
        vec![first, second]
    }

    /// DPM-Solver-fast's move `x_s − ca·ε₀ − cb·(ε − ε₀)` with ε this
    /// call's (x − D)/σ, from the step's start x_s and first ε₀ (this
    /// call's own where `sa` is 1, the carried ones where `sb` is).
    pub(super) fn fast_tail<'a>(
        &self,
        g: &'a GraphBuilder,
        (lat, eps): (T<'a>, T<'a>),
        kept: &mut Vec<T<'a>>,
    ) -> Result<T<'a>, ShapeError> {
        let scalar = |name: &str| g.input(name, &[1]);
        let (src, e0) = self.step_start(g, (lat, eps), "e0")?;
        let moved = src
            .sub(e0.mul(scalar("ca")?)?)?
            .sub(eps.sub(e0)?.mul(scalar("cb")?)?)?;
        kept.extend([src, e0]);
        Ok(moved)
    }

    /// DPM-Solver-fast's step `i` over `sigmas` (`solvers::dpm_fast_steps`).
    pub(super) fn fast_calls(
        &self,
        sigmas: &[f32],
        i: usize,
        call: impl Fn(f32, &[(&str, f32)], Vec<(usize, &'static str)>) -> Call,
    ) -> Vec<Call> {
        let steps = crate::sampling::solvers::dpm_fast_steps(sigmas);
        let Some(calls) = steps.get(i) else {
            return Vec::new();
        };
        calls
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let [sa, sb] = start_flags(k);
                let v = [sa, sb, ("ca", c.ca), ("cb", c.cb)];
                let carry = vec![(NEXT, "lat"), (KEPT, "base"), (KEPT + 1, "e0")];
                call(c.sigma, &v, carry)
            })
            .collect()
    }

    /// The step's start and its first call's `own` value: this call's
    /// latent and `own` where it is the step's first (`sa` 1), else the
    /// carried `base` and `carried` (`sb` 1). Both go on as computed
    /// copies, so a later call in another program still has them.
    pub(super) fn step_start<'a>(
        &self,
        g: &'a GraphBuilder,
        (lat, own): (T<'a>, T<'a>),
        carried: &str,
    ) -> Result<(T<'a>, T<'a>), ShapeError> {
        let (sa, sb) = (g.input("sa", &[1])?, g.input("sb", &[1])?);
        let src = lat.mul(sa)?.add(g.input("base", &self.dims)?.mul(sb)?)?;
        let first = own.mul(sa)?.add(g.input(carried, &self.dims)?.mul(sb)?)?;
        Ok((src, first))
    }
}

/// The [`Fused::step_start`] selectors of a step's call `k`.
fn start_flags(k: usize) -> [(&'static str, f32); 2] {
    let first = if k == 0 { 1.0 } else { 0.0 };
    [("sa", first), ("sb", 1.0 - first)]
}
