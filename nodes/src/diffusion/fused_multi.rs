//! The device loop's multistep samplers beyond DPM++ 2M and the SDE
//! ones ([`Multi`]): the tail each appends to the model's program, and
//! each call's one-element inputs and carries. As everywhere in the
//! device loop, the arithmetic is the host sampler's, operation for
//! operation; terms a step lacks get zero coefficients (and the state
//! they read starts as zeros), so they add exact zeros.

use super::fused::{Fused, KEPT, NEXT};
use crate::sampling::samplers::{ancestral_step, Sampler};
use sdkit_compute::tensor::{GraphBuilder, ShapeError, T};

/// The multistep samplers of this module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Multi {
    /// LMS, iPNDM, iPNDM-v (DEIS `accumulate`s into x): the last three
    /// derivatives carried (`sampling::steps::Linear`).
    Linear { accumulate: bool },
    /// UniPC (bh1 or bh2): each call corrects the update that led to its
    /// point and predicts the next (`sampling::unipc::device_call`).
    UniPc { bh2: bool },
    /// res_multistep (plain, ancestral, CFG++): the exponential
    /// second-order move from the previous prediction, Euler where
    /// there is none.
    Res { cfg_pp: bool, ancestral: bool },
    /// Gradient estimation (γ = 2; CFG++ steps from the unconditional
    /// prediction): the previous derivative carried.
    GradEst { cfg_pp: bool },
    /// DPM++ 2M CFG++: the previous unconditional prediction carried.
    DpmPp2mCfgPp,
    /// ER-SDE: the previous prediction and divided difference carried
    /// (`sampling::steps::er_sde`).
    ErSde,
    /// SA-Solver (plain or PECE): the corrected point, the last three
    /// predictions and the predictor's noise carried; the model runs at
    /// the predicted point (`lat`). PECE runs the corrector in a call of
    /// its own, whose prediction at the corrected point replaces the
    /// first's.
    SaSolver { pece: bool },
}

/// What a multistep tail reads: the carried latent, the combined
/// prediction D, σ, and the unconditional prediction where it ran.
pub(crate) struct Tail<'a> {
    pub lat: T<'a>,
    pub d: T<'a>,
    pub sigma: T<'a>,
    pub uncond: Option<T<'a>>,
}

/// One call's one-element inputs, carries and noise (where it draws).
pub(crate) struct MultiCall {
    pub scalars: Vec<(&'static str, f32)>,
    pub carry: Vec<(usize, &'static str)>,
    pub noise: Option<Vec<f32>>,
}

fn flag(b: bool) -> f32 {
    if b {
        1.0
    } else {
        0.0
    }
}

impl Multi {
    /// `sampler`'s form here, if it has one; the CFG++ forms need the
    /// unconditional prediction to run (`cfg`).
    pub(crate) fn of(sampler: Sampler, cfg: bool) -> Option<Multi> {
        Some(match sampler {
            Sampler::Lms | Sampler::Ipndm | Sampler::IpndmV => Multi::Linear { accumulate: false },
            Sampler::Deis => Multi::Linear { accumulate: true },
            Sampler::UniPc | Sampler::UniPcBh2 => Multi::UniPc {
                bh2: sampler == Sampler::UniPcBh2,
            },
            Sampler::ResMultistep | Sampler::ResMultistepAncestral => Multi::Res {
                cfg_pp: false,
                ancestral: sampler == Sampler::ResMultistepAncestral,
            },
            Sampler::ResMultistepCfgPp | Sampler::ResMultistepAncestralCfgPp if cfg => Multi::Res {
                cfg_pp: true,
                ancestral: sampler == Sampler::ResMultistepAncestralCfgPp,
            },
            Sampler::GradientEstimation => Multi::GradEst { cfg_pp: false },
            Sampler::GradientEstimationCfgPp if cfg => Multi::GradEst { cfg_pp: true },
            Sampler::DpmPp2mCfgPp if cfg => Multi::DpmPp2mCfgPp,
            Sampler::ErSde => Multi::ErSde,
            Sampler::SaSolver | Sampler::SaSolverPece => Multi::SaSolver {
                pece: sampler == Sampler::SaSolverPece,
            },
            _ => return None,
        })
    }

    /// The state the tail carries besides the latent (zeros at first).
    pub(crate) fn state(self) -> &'static [&'static str] {
        match self {
            Multi::Linear { .. } => &["h1", "h2", "h3"],
            Multi::UniPc { .. } => &["xb", "h0", "h1", "h2"],
            Multi::Res {
                ancestral: true, ..
            } => &["old", "noise"],
            Multi::Res { .. } | Multi::GradEst { .. } | Multi::DpmPp2mCfgPp => &["old"],
            Multi::ErSde => &["old", "oldd", "noise"],
            Multi::SaSolver { .. } => &["xc", "p1", "p2", "p3", "nv", "noise"],
        }
    }

    /// The next latent, the carried outputs pushed to `kept` (outputs
    /// `KEPT`, `KEPT + 1`, …).
    pub(crate) fn tail<'a>(
        self,
        f: &Fused,
        g: &'a GraphBuilder,
        t: Tail<'a>,
        kept: &mut Vec<T<'a>>,
    ) -> Result<T<'a>, ShapeError> {
        let Tail {
            lat,
            d,
            sigma,
            uncond,
        } = t;
        let scalar = |name: &str| g.input(name, &[1]);
        let input = |name: &str| g.input(name, &f.dims);
        let uncond = || {
            uncond.ok_or_else(|| ShapeError {
                op: "CFG++",
                message: "no unconditional prediction".into(),
                shapes: Vec::new(),
            })
        };
        let select = |moved: T<'a>| moved.mul(scalar("keep")?)?.add(d.mul(scalar("take")?)?);
        match self {
            Multi::Linear { accumulate } => {
                // The derivative and the three before it, each times its
                // coefficient, summed in the host's order.
                let d0 = lat.sub(d)?.div(sigma)?;
                let h = [input("h1")?, input("h2")?, input("h3")?];
                let first = d0.mul(scalar("m0")?)?;
                let mut acc = if accumulate { lat.add(first)? } else { first };
                for (k, hk) in h.iter().enumerate() {
                    acc = acc.add(hk.mul(scalar(&format!("m{}", k + 1))?)?)?;
                }
                let moved = if accumulate {
                    acc
                } else {
                    lat.add(acc.mul(scalar("dt")?)?.div(scalar("div")?)?)?
                };
                // The history moves up one: d₂ → d₃, d₁ → d₂, d₀ → d₁.
                kept.extend([h[1], h[0], d0]);
                select(moved)
            }
            Multi::UniPc { .. } => {
                // The model output at xt (whose input `lat` is), the
                // corrected x, the next point predicted from there.
                let (xt, xb) = (input("xt")?, input("xb")?);
                let h = [input("h0")?, input("h1")?, input("h2")?];
                let eps = lat.sub(d)?.div(sigma)?;
                let mt = xt.sub(eps.mul(scalar("sd")?)?)?.div(scalar("a")?)?;
                let d1 = |k: usize, r: &str| h[k].sub(h[0])?.div(scalar(r)?);
                let corr = d1(1, "rk1")?
                    .mul(scalar("rc1")?)?
                    .add(d1(2, "rk2")?.mul(scalar("rc2")?)?)?;
                let d1_t = mt.sub(h[0])?;
                let fixed = corr.add(d1_t.mul(scalar("rcl")?)?)?.mul(scalar("cb")?)?;
                let x = xb
                    .sub(fixed)?
                    .mul(scalar("sc")?)?
                    .add(xt.mul(scalar("st")?)?)?;
                let e = |k: usize, r: &str| h[k].sub(mt)?.div(scalar(r)?);
                let pred = e(0, "rp1")?
                    .mul(scalar("pp1")?)?
                    .add(e(1, "rp2")?.mul(scalar("pp2")?)?)?;
                let base = x.mul(scalar("cx")?)?.sub(mt.mul(scalar("cm")?)?)?;
                let point = base.sub(pred.mul(scalar("cbp")?)?)?;
                // The history moves up one (h₁ → h₂, h₀ → h₁, m_t → h₀).
                kept.extend([h[1], h[0], mt, point, base]);
                point.mul(scalar("kmul")?)?.div(scalar("kdiv")?)
            }
            Multi::Res { cfg_pp, ancestral } => {
                // Euler where there is no previous prediction (`sf`),
                // else e·x + h·(b1·D + b2·old) (`se`); CFG++ moves from
                // the unconditional prediction.
                let old = input("old")?;
                let (first, exp, keep) = if cfg_pp {
                    let u = uncond()?;
                    let first = d.add(lat.sub(u)?.div(sigma)?.mul(scalar("down")?)?)?;
                    let xs = lat.add(d.sub(u)?)?;
                    (first, xs, u)
                } else {
                    let first = lat.add(lat.sub(d)?.div(sigma)?.mul(scalar("dt")?)?)?;
                    (first, lat, d)
                };
                let mix = keep.mul(scalar("b1")?)?.add(old.mul(scalar("b2")?)?)?;
                let exp = exp.mul(scalar("e")?)?.add(mix.mul(scalar("h")?)?)?;
                let mut moved = first.mul(scalar("sf")?)?.add(exp.mul(scalar("se")?)?)?;
                if ancestral {
                    moved = moved.add(input("noise")?.mul(scalar("up")?)?)?;
                }
                kept.push(keep);
                Ok(moved)
            }
            Multi::GradEst { cfg_pp } => {
                let base = if cfg_pp { uncond()? } else { d };
                let d0 = lat.sub(base)?.div(sigma)?;
                let moved = if cfg_pp {
                    d.add(d0.mul(scalar("sn")?)?)?
                } else {
                    lat.add(d0.mul(scalar("dt")?)?)?
                };
                // γ = 2: + (1·(d − d_old))·dt from the second step (`dg`).
                let moved = moved.add(d0.sub(input("old")?)?.mul(scalar("dg")?)?)?;
                kept.push(d0);
                select(moved)
            }
            Multi::DpmPp2mCfgPp => {
                // D + (−e·u − e₁c·(D − old)) + e·x.
                let u = uncond()?;
                let mix = u
                    .mul(scalar("ne")?)?
                    .sub(d.sub(input("old")?)?.mul(scalar("ec")?)?)?;
                let moved = d.add(mix)?.add(lat.mul(scalar("e")?)?)?;
                kept.push(u);
                Ok(moved)
            }
            Multi::ErSde => {
                // a·x + b·D, + c2·dd with dd = (D − old)/q, + c3·((dd −
                // dd_old)/half), + (at·z)·k; the prediction on the last step.
                let dd = d.sub(input("old")?)?.div(scalar("q")?)?;
                let third = dd.sub(input("oldd")?)?.div(scalar("half")?)?;
                let z = input("noise")?.mul(scalar("at")?)?.mul(scalar("k")?)?;
                let moved = lat
                    .mul(scalar("a")?)?
                    .add(d.mul(scalar("b")?)?)?
                    .add(dd.mul(scalar("c2")?)?)?
                    .add(third.mul(scalar("c3")?)?)?
                    .add(z)?;
                kept.extend([d, dd]);
                select(moved)
            }
            Multi::SaSolver { .. } => {
                // The corrector a·x_c + Σ b·D (oldest first) + the last
                // noise, or the model's point itself (`sc` 0, `sl` 1);
                // then the predictor a·x_c + Σ b·D + z·σ_next·k.
                let xc = input("xc")?;
                let p = [input("p1")?, input("p2")?, input("p3")?];
                let sum = |names: &[&str], terms: &[T<'a>]| -> Result<T<'a>, ShapeError> {
                    let mut acc = terms[0].mul(scalar(names[0])?)?;
                    for (t, n) in terms.iter().zip(names).skip(1) {
                        acc = acc.add(t.mul(scalar(n)?)?)?;
                    }
                    Ok(acc)
                };
                let res_c = sum(&["cb3", "cb2", "cb1", "cb0"], &[p[2], p[1], p[0], d])?;
                let corr = xc
                    .mul(scalar("ca")?)?
                    .add(res_c)?
                    .add(input("nv")?.mul(scalar("cn")?)?)?;
                let x_c = corr.mul(scalar("sc")?)?.add(lat.mul(scalar("sl")?)?)?;
                let res_p = sum(&["pb2", "pb1", "pb0"], &[p[1], p[0], d])?;
                let nv = input("noise")?.mul(scalar("sn")?)?.mul(scalar("k")?)?;
                let pred = x_c.mul(scalar("pa")?)?.add(res_p)?.add(nv)?;
                // The history moves up one: p₂ → p₃, p₁ → p₂, D → p₁.
                kept.extend([p[1], p[0], d, x_c, nv]);
                select(pred)
            }
        }
    }

    /// Step `i`'s calls over `sigmas` (the loop's, as [`Fused::sigmas`]
    /// gives them), drawing from `noise` where the host sampler draws:
    /// one, or SA-Solver PECE's two where it corrects.
    pub(crate) fn calls(
        self,
        f: &Fused,
        sigmas: &[f32],
        i: usize,
        noise: &mut dyn FnMut() -> Vec<f32>,
    ) -> Vec<MultiCall> {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let old = vec![(NEXT, "lat"), (KEPT, "old")];
        let mut noise_drawn = None;
        let (scalars, carry) = match self {
            Multi::Linear { accumulate } => {
                let l = crate::sampling::steps::linear(f.sampler, sigmas, i);
                let mut v: Vec<(&str, f32)> =
                    ["m0", "m1", "m2", "m3"].into_iter().zip(l.m).collect();
                if !accumulate {
                    v.extend([("dt", l.dt), ("div", l.div)]);
                }
                v.extend([("keep", flag(!l.take)), ("take", flag(l.take))]);
                // Carries are copied in this order: each moves up before
                // the one below replaces it.
                let carry = vec![
                    (NEXT, "lat"),
                    (KEPT, "h3"),
                    (KEPT + 1, "h2"),
                    (KEPT + 2, "h1"),
                ];
                (v, carry)
            }
            Multi::UniPc { bh2 } => {
                let v = crate::sampling::unipc::device_call(sigmas, i, bh2);
                let carry = vec![
                    (NEXT, "lat"),
                    (KEPT, "h2"),
                    (KEPT + 1, "h1"),
                    (KEPT + 2, "h0"),
                    (KEPT + 3, "xt"),
                    (KEPT + 4, "xb"),
                ];
                (v, carry)
            }
            Multi::Res { cfg_pp, ancestral } => {
                let down_at = |a: f32, b: f32| {
                    if ancestral {
                        ancestral_step(a, b)
                    } else {
                        (b, 0.0)
                    }
                };
                let (down, up) = down_at(s, s_next);
                let mut v = vec![
                    ("e", 0.0),
                    ("h", 0.0),
                    ("b1", 0.0),
                    ("b2", 0.0),
                    ("sf", 1.0),
                    ("se", 0.0),
                ];
                if i > 0 && down != 0.0 {
                    // The previous step's σ_down, as the host kept it.
                    let old_down = down_at(sigmas[i - 1], s).0;
                    let (e, h, b1, b2) =
                        crate::sampling::solvers::res_coeffs(s, old_down, down, sigmas[i - 1]);
                    v = vec![
                        ("e", e),
                        ("h", h),
                        ("b1", b1),
                        ("b2", b2),
                        ("sf", 0.0),
                        ("se", 1.0),
                    ];
                }
                v.push(if cfg_pp {
                    ("down", down)
                } else {
                    ("dt", down - s)
                });
                if ancestral {
                    v.push(("up", up));
                    let per: usize = f.dims.iter().product();
                    noise_drawn = Some(if s_next > 0.0 && up != 0.0 {
                        noise()
                    } else {
                        vec![0.0; per]
                    });
                }
                (v, old)
            }
            Multi::GradEst { cfg_pp } => {
                let last = s_next == 0.0;
                let dt = s_next - s;
                let mut v = vec![
                    ("dg", if i >= 1 && !last { dt } else { 0.0 }),
                    ("keep", flag(!last)),
                    ("take", flag(last)),
                ];
                v.push(if cfg_pp { ("sn", s_next) } else { ("dt", dt) });
                (v, old)
            }
            Multi::DpmPp2mCfgPp => {
                let (t, t_next) = (-s.ln(), -s_next.ln());
                let h = t_next - t;
                let e = (-h).exp();
                let em1 = (-h).exp_m1();
                // The correction from the step before, except on the first
                // and the last step.
                let ec = if i > 0 && s_next != 0.0 {
                    let h_last = t - (-sigmas[i - 1].ln());
                    em1 * (1.0 / (2.0 * (h_last / h)))
                } else {
                    0.0
                };
                (vec![("ne", -e), ("ec", ec), ("e", e)], old)
            }
            Multi::SaSolver { pece } => return sa_calls(f, sigmas, i, pece, noise),
            Multi::ErSde => {
                let last = s_next == 0.0;
                // The last step takes the prediction; its zero
                // coefficients keep the discarded move finite.
                let st = if last {
                    crate::sampling::steps::ErSde {
                        a: 0.0,
                        b: 0.0,
                        c2: 0.0,
                        q: 1.0,
                        c3: 0.0,
                        half: 1.0,
                        at: 0.0,
                        k: 0.0,
                        stage: 1,
                    }
                } else {
                    crate::sampling::steps::er_sde(f.space, sigmas, i)
                };
                let v = vec![
                    ("a", st.a),
                    ("b", st.b),
                    ("q", st.q),
                    ("c2", st.c2),
                    ("half", st.half),
                    ("c3", st.c3),
                    ("at", st.at),
                    ("k", st.k),
                    ("keep", flag(!last)),
                    ("take", flag(last)),
                ];
                let per: usize = f.dims.iter().product();
                noise_drawn = Some(if last { vec![0.0; per] } else { noise() });
                let carry = vec![(NEXT, "lat"), (KEPT, "old"), (KEPT + 1, "oldd")];
                (v, carry)
            }
        };
        vec![MultiCall {
            scalars,
            carry,
            noise: noise_drawn,
        }]
    }
}

/// SA-Solver's calls for step `i` (`sampling::solvers::sa_step`): one
/// that corrects (where it does) and predicts (or takes the prediction
/// on the last step); with PECE where it corrects, a first call that
/// only corrects (its point passed on unchanged) and a second at the
/// corrected point that predicts.
fn sa_calls(
    f: &Fused,
    sigmas: &[f32],
    i: usize,
    pece: bool,
    noise: &mut dyn FnMut() -> Vec<f32>,
) -> Vec<MultiCall> {
    let st = crate::sampling::solvers::sa_step(f.space, sigmas, i, pece);
    let per: usize = f.dims.iter().product();
    // Σ b·D with b oldest first, as named newest first: `prefix`0 is
    // this call's prediction; the terms a move lacks get zeros.
    let put = |v: &mut Vec<(&'static str, f32)>, names: &[&'static str], b: &[f32]| {
        for (k, name) in names.iter().enumerate() {
            let c = b.len().checked_sub(k + 1).map_or(0.0, |j| b[j]);
            v.push((name, c));
        }
    };
    let corrector = |v: &mut Vec<(&'static str, f32)>, on: bool| {
        let m = st.corr.as_ref().filter(|_| on);
        v.extend([
            ("ca", m.map_or(0.0, |m| m.a)),
            ("cn", flag(m.is_some_and(|m| m.noise))),
            ("sc", flag(m.is_some())),
            ("sl", flag(m.is_none())),
        ]);
        put(v, &["cb0", "cb1", "cb2", "cb3"], m.map_or(&[], |m| &m.b));
    };
    // The predictor, or the point passed on (`pa` 1) where `pass`.
    let mut predictor = |v: &mut Vec<(&'static str, f32)>, pass: bool| {
        let m = st.pred.as_ref().filter(|_| !pass);
        let k = m.and_then(|m| m.k);
        v.extend([
            ("pa", m.map_or(1.0, |m| m.a)),
            ("sn", if k.is_some() { sigmas[i + 1] } else { 0.0 }),
            ("k", k.unwrap_or(0.0)),
        ]);
        put(v, &["pb0", "pb1", "pb2"], m.map_or(&[], |m| &m.b));
        let last = st.pred.is_none() && !pass;
        v.extend([("keep", flag(!last)), ("take", flag(last))]);
        if k.is_some() {
            noise()
        } else {
            vec![0.0; per]
        }
    };
    // Carries: each history slot moves up before the one below replaces
    // it.
    let all = || {
        vec![
            (NEXT, "lat"),
            (KEPT, "p3"),
            (KEPT + 1, "p2"),
            (KEPT + 2, "p1"),
            (KEPT + 3, "xc"),
            (KEPT + 4, "nv"),
        ]
    };
    let mut first = Vec::new();
    // A loop that stops short of σ = 0 returns the corrected point: its
    // last predictor's point (and PECE's model call there) go unused.
    let short = i + 2 == sigmas.len() && st.pred.is_some();
    if pece && st.corr.is_some() && !short {
        // Both calls run at σ_i, so in one program: the first hands on
        // only its point, the history moving up in the second.
        corrector(&mut first, true);
        let z = predictor(&mut first, true);
        let mut second = Vec::new();
        corrector(&mut second, false);
        let z2 = predictor(&mut second, false);
        return vec![
            MultiCall {
                scalars: first,
                carry: vec![(NEXT, "lat")],
                noise: Some(z),
            },
            MultiCall {
                scalars: second,
                carry: all(),
                noise: Some(z2),
            },
        ];
    }
    corrector(&mut first, true);
    let z = predictor(&mut first, short);
    vec![MultiCall {
        scalars: first,
        carry: all(),
        noise: Some(z),
    }]
}
