//! The sampling loop on the device: for the common case (the positive
//! and negative prediction over the whole latent, in one batch or two of
//! different context lengths; no ControlNet, area or guidance pass; a
//! noise mask allowed) the denoiser's program also blends the inpainting
//! mask, combines the predictions (CFG) and takes the sampler's step, and
//! the latent and the sampler's history stay on the device between steps
//! ([`sdkit_compute::runtime::Session::run_carried`]). Only the final
//! latent is read back, and each step's prediction when someone watches
//! previews; on the CPU the host loop is as fast and stays.
//!
//! The arithmetic is the host samplers' (`sampling::samplers`), operation
//! for operation: the per-step numbers (σ, the step's coefficients) come
//! from the host as one-element inputs, so one program serves every step.

use super::cond_batch::{Item, Mult};
use super::inpaint::Blend;
use super::{Model, Prediction};
use crate::sampling::samplers::{ancestral_step, Sampler, Space};
use sdkit_compute::runtime::Session;
use sdkit_compute::tensor::{GraphBuilder, ShapeError, T};
use sdkit_engine::{NodeContext, NodeError};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

/// The samplers whose step runs in the program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    Euler,
    EulerAncestral,
    DpmPp2m,
    /// The prediction, renoised to the next σ (the model's noise
    /// scaling).
    Lcm {
        flow: bool,
    },
    /// DPM++ 2M SDE (η = 1) in the model's half-logSNR, midpoint or Heun
    /// correction.
    DpmPp2mSde {
        heun: bool,
    },
}

/// One denoiser call, the CFG combination and a sampler step, as the
/// tail and head of the model's program.
#[derive(Clone, Debug)]
pub(crate) struct Fused {
    pub step: Step,
    pub prediction: Prediction,
    /// Per group of the model's batch (one, or two where the
    /// conditionings' context lengths differ), the conditioning (0
    /// positive, 1 negative) of each block of `b` rows, in order.
    pub groups: Vec<Vec<usize>>,
    /// CFG scale, when the negative prediction runs.
    pub cfg: Option<f32>,
    /// The latent's [b, c, h, w].
    pub dims: [usize; 4],
    /// The sampler, and the model's sigma space (its half-logSNR).
    pub sampler: Sampler,
    pub space: Space,
    /// Inpainting with a denoise mask (`KSamplerX0Inpaint`): the model
    /// sees the latent outside the mask renoised to σ, and the prediction
    /// keeps the original latent there. The mask is uploaded once, or
    /// each step under DifferentialDiffusion.
    pub inpaint: bool,
}

/// The inputs the model's head and the step's tail share.
pub(crate) struct Head<'a> {
    /// The carried latent.
    lat: T<'a>,
    /// The latent as the model sees it (blended where inpainting).
    seen: T<'a>,
    sigma: T<'a>,
    c_in: T<'a>,
    /// Inpainting: the mask, 1 − mask and the original latent.
    blend: Option<(T<'a>, T<'a>, T<'a>)>,
}

/// The program's outputs: the next latent, then the step's denoised
/// prediction (previews, SamplerCustom's x0, DPM++ 2M's history).
pub(crate) const NEXT: usize = 0;
pub(crate) const DENOISED: usize = 1;

impl Fused {
    /// The fused form of this sampling, where it applies: a GPU-shaped
    /// runtime is the caller's choice; this checks the sampler, the
    /// prediction type and that the groups are plain (every item over
    /// the whole latent at strength one, always active, no ControlNet).
    pub(crate) fn of(
        model: &Model,
        sampler: Sampler,
        items: &[Item<'_>],
        groups: &[&[usize]],
        cfg: Option<f32>,
        dims: [usize; 4],
        inpaint: bool,
    ) -> Option<Fused> {
        let step = match sampler {
            // ddim is Euler but for inpainting's noise (its own seed),
            // which the blend's inputs carry.
            Sampler::Euler | Sampler::Ddim => Step::Euler,
            // The flow form of the ancestral step is another update.
            Sampler::EulerAncestral if model.prediction != Prediction::Flow => Step::EulerAncestral,
            Sampler::DpmPp2m => Step::DpmPp2m,
            Sampler::Lcm => Step::Lcm {
                flow: model.prediction == Prediction::Flow,
            },
            Sampler::DpmPp2mSde => Step::DpmPp2mSde { heun: false },
            Sampler::DpmPp2mSdeHeun => Step::DpmPp2mSde { heun: true },
            _ => return None,
        };
        if !matches!(
            model.prediction,
            Prediction::Eps | Prediction::V | Prediction::Flow | Prediction::Lcm
        ) {
            return None;
        }
        let [_, _, h, w] = dims;
        let plain = groups.iter().flat_map(|g| g.iter()).all(|&i| {
            let it = &items[i];
            it.area == [h, w, 0, 0]
                && matches!(it.mult, Mult::Scalar(m) if m == 1.0)
                && it.sigma_start.is_none()
                && it.sigma_end.is_none()
                && it.control.is_none()
        });
        let conds: Vec<Vec<usize>> = groups
            .iter()
            .map(|g| g.iter().map(|&i| items[i].cond).collect())
            .collect();
        // Exactly one item per conditioning that runs.
        let want: &[usize] = if cfg.is_some() { &[0, 1] } else { &[0] };
        let mut sorted: Vec<usize> = conds.iter().flatten().copied().collect();
        sorted.sort_unstable();
        (plain && sorted == want).then_some(Fused {
            step,
            prediction: model.prediction,
            groups: conds,
            cfg,
            dims,
            sampler,
            space: Space::of(&model.schedule),
            inpaint,
        })
    }

    /// The prefix of group `k`'s per-run inputs: none for the first, so
    /// a one-group program's inputs keep the model's names.
    pub(crate) fn prefix(&self, k: usize) -> String {
        if k == 0 {
            String::new()
        } else {
            format!("g{k}.")
        }
    }

    /// The inputs every group and the tail share: the carried latent
    /// `lat`, as the model sees it (where inpainting, blended as
    /// `KSamplerX0Inpaint` does), σ and c_in.
    pub(crate) fn head<'a>(&self, g: &'a GraphBuilder) -> Result<Head<'a>, ShapeError> {
        let lat = g.input("lat", &self.dims)?;
        let sigma = g.input("sigma", &[1])?;
        let (seen, blend) = if self.inpaint {
            // x·m + scale_latent_inpaint(σ)·(1 − m), the eps/v form
            // n·σ + l (a flow model's inpainting stays on the host).
            let m = g.input("mask", &self.dims)?;
            let keep = m.neg().add_scalar(1.0);
            let n = g.input("inoise", &self.dims)?;
            let l = g.input("ilatent", &self.dims)?;
            let scaled = n.mul(sigma)?.add(l)?;
            (lat.mul(m)?.add(scaled.mul(keep)?)?, Some((m, keep, l)))
        } else {
            (lat, None)
        };
        Ok(Head {
            lat,
            seen,
            sigma,
            c_in: g.input("c_in", &[1])?,
            blend,
        })
    }

    /// Group `k`'s model input `x` (`shape`, [rows, c, h, w]): the latent
    /// as the model sees it divided by c_in, once per conditioning.
    pub(crate) fn model_input<'a>(
        &self,
        head: &Head<'a>,
        k: usize,
        shape: &[usize],
    ) -> Result<T<'a>, ShapeError> {
        let per: usize = self.dims.iter().product();
        head.seen
            .div(head.c_in)?
            .reshape(&[1, per])?
            .expand(&[self.groups[k].len(), per])?
            .reshape(shape)
    }

    /// The outputs after each group's model output `outs` ([rows, c, h,
    /// w]) with the inputs of `head`: the next latent and the denoised
    /// prediction.
    pub(crate) fn outputs<'a>(
        &self,
        g: &'a GraphBuilder,
        head: Head<'a>,
        outs: &[T<'a>],
    ) -> Result<Vec<T<'a>>, ShapeError> {
        let [b, ..] = self.dims;
        let scalar = |name: &str| g.input(name, &[1]);
        let Head {
            lat,
            seen,
            sigma,
            blend,
            ..
        } = head;
        // The prediction's per-step factors: v's 1/(σ²+1) and
        // σ/√(σ²+1) divisors, LCM's c_out and c_skip.
        let factors = match self.prediction {
            Prediction::V => Some((scalar("v_d")?, scalar("v_r")?)),
            Prediction::Lcm => Some((scalar("c_out")?, scalar("c_skip")?)),
            _ => None,
        };
        // ComfyUI's calculate_denoised per conditioning, in its order.
        let of = |cond: usize| -> Result<T<'a>, ShapeError> {
            let (gi, k) = self
                .groups
                .iter()
                .enumerate()
                .find_map(|(gi, g)| g.iter().position(|&c| c == cond).map(|k| (gi, k)))
                .unwrap_or((0, 0));
            let o = outs[gi].slice(0, k * b, (k + 1) * b)?;
            let x = seen;
            match (self.prediction, factors) {
                (Prediction::V, Some((d, r))) => x.div(d)?.sub(o.mul(sigma)?.div(r)?),
                (Prediction::Lcm, Some((c_out, c_skip))) => {
                    c_out.mul(x.sub(o.mul(sigma)?)?)?.add(c_skip.mul(x)?)
                }
                _ => x.sub(o.mul(sigma)?),
            }
        };
        // uncond + (cond − uncond)·cfg.
        let d = match self.cfg {
            Some(_) => {
                let (cond, uncond) = (of(0)?, of(1)?);
                uncond.add(cond.sub(uncond)?.mul(scalar("cfg")?)?)?
            }
            None => of(0)?,
        };
        // Inpainting keeps the original latent outside the mask:
        // out·m + latent·(1 − m).
        let d = match blend {
            Some((m, keep, l)) => d.mul(m)?.add(l.mul(keep)?)?,
            None => d,
        };
        let to_d = || lat.sub(d)?.div(sigma);
        let next = match self.step {
            Step::Euler => lat.add(to_d()?.mul(scalar("dt")?)?)?,
            Step::EulerAncestral => {
                // keep = 0 on the last step (σ_down = 0): the latent is
                // the prediction itself.
                let moved = lat
                    .add(to_d()?.mul(scalar("dt")?)?)?
                    .add(g.input("noise", &self.dims)?.mul(scalar("up")?)?)?;
                moved.mul(scalar("keep")?)?.add(d.mul(scalar("take")?)?)?
            }
            Step::DpmPp2m => {
                let dd = d
                    .mul(scalar("c1")?)?
                    .sub(g.input("old", &self.dims)?.mul(scalar("c")?)?)?;
                lat.mul(scalar("a")?)?.sub(dd.mul(scalar("b")?)?)?
            }
            // Zero noise on the last step (σ_next = 0) leaves the
            // prediction exactly.
            Step::Lcm { flow: false } => {
                d.add(g.input("noise", &self.dims)?.mul(scalar("sn")?)?)?
            }
            Step::Lcm { flow: true } => g
                .input("noise", &self.dims)?
                .mul(scalar("sn")?)?
                .add(d.mul(scalar("keep")?)?)?,
            Step::DpmPp2mSde { .. } => {
                // a·x + b·D, the correction c·(D − old), the noise; on the
                // last step (σ_next = 0) every factor is 0 and the result
                // is the prediction (keep 0, take 1).
                let old = g.input("old", &self.dims)?;
                let noise = g.input("noise", &self.dims)?;
                let moved = lat
                    .mul(scalar("a")?)?
                    .add(d.mul(scalar("b")?)?)?
                    .add(d.sub(old)?.mul(scalar("c")?)?)?
                    .add(noise.mul(scalar("sn")?)?.mul(scalar("k")?)?)?;
                moved.mul(scalar("keep")?)?.add(d.mul(scalar("take")?)?)?
            }
        };
        Ok(vec![next, d])
    }

    /// What output carries into which input between steps.
    pub(crate) fn carry(&self) -> Vec<(usize, &'static str)> {
        let mut c = vec![(NEXT, "lat")];
        if matches!(self.step, Step::DpmPp2m | Step::DpmPp2mSde { .. }) {
            c.push((DENOISED, "old"));
        }
        c
    }

    /// Step `i`'s one-element inputs (and the ancestral step's noise, drawn
    /// from `noise` only where the host sampler draws it), with the same
    /// f32 arithmetic as the host samplers.
    pub(crate) fn step_inputs(
        &self,
        sigmas: &[f32],
        i: usize,
        (c_in, t): (f32, f32),
        noise: &mut dyn FnMut() -> Vec<f32>,
    ) -> HashMap<String, Arc<Vec<f32>>> {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let mut f: HashMap<String, Arc<Vec<f32>>> = HashMap::new();
        let mut put = |name: &str, v: f32| {
            f.insert(name.to_string(), Arc::new(vec![v]));
        };
        put("c_in", c_in);
        put("sigma", s);
        if let Some(cfg) = self.cfg {
            put("cfg", cfg);
        }
        match self.prediction {
            Prediction::V => {
                let d = s * s + 1.0;
                put("v_d", d);
                put("v_r", d.sqrt());
            }
            Prediction::Lcm => {
                let ts = t * 10.0;
                put("c_out", ts / (ts * ts + 0.25).sqrt());
                put("c_skip", 0.25 / (ts * ts + 0.25));
            }
            _ => {}
        }
        let per: usize = self.dims.iter().product();
        match self.step {
            Step::Euler => put("dt", s_next - s),
            Step::EulerAncestral => {
                let (down, up) = ancestral_step(s, s_next);
                let last = down == 0.0;
                put("dt", down - s);
                put("up", up);
                put("keep", if last { 0.0 } else { 1.0 });
                put("take", if last { 1.0 } else { 0.0 });
                let z = if last { vec![0.0; per] } else { noise() };
                f.insert("noise".to_string(), Arc::new(z));
            }
            Step::DpmPp2m => {
                let (t, t_next) = (-s.ln(), -s_next.ln());
                let h = t_next - t;
                let sig = |t: f32| (-t).exp();
                put("a", sig(t_next) / sig(t));
                put("b", (-h).exp_m1());
                // The second-order correction from the step before, except
                // on the first and the last step.
                let (c1, c) = if i > 0 && s_next != 0.0 {
                    let h_last = t - (-sigmas[i - 1].ln());
                    let r = h_last / h;
                    let c = 1.0 / (2.0 * r);
                    (1.0 + c, c)
                } else {
                    (1.0, 0.0)
                };
                put("c1", c1);
                put("c", c);
                if i == 0 {
                    f.insert("old".to_string(), Arc::new(vec![0.0; per]));
                }
            }
            Step::DpmPp2mSde { heun } => {
                let sp = self.space;
                let last = s_next == 0.0;
                let (mut a, mut b, mut c, mut k) = (0.0, 0.0, 0.0, 0.0);
                if !last {
                    let (ls, lt) = (sp.lambda(s), sp.lambda(s_next));
                    let hv = lt - ls;
                    let h_eta = hv * 2.0;
                    let alpha_t = s_next * lt.exp();
                    a = s_next / s * (-hv).exp();
                    let em = -(-h_eta).exp_m1();
                    b = alpha_t * em;
                    // The previous step's size, where there was one.
                    if i > 0 {
                        let h_last = ls - sp.lambda(sigmas[i - 1]);
                        let r = h_last / hv;
                        c = if heun {
                            alpha_t * (em / -h_eta + 1.0) * (1.0 / r)
                        } else {
                            0.5 * alpha_t * em * (1.0 / r)
                        };
                    }
                    k = (-(-2.0 * hv).exp_m1()).sqrt();
                }
                put("a", a);
                put("b", b);
                put("c", c);
                put("sn", s_next);
                put("k", k);
                put("keep", if last { 0.0 } else { 1.0 });
                put("take", if last { 1.0 } else { 0.0 });
                let z = if last { vec![0.0; per] } else { noise() };
                f.insert("noise".to_string(), Arc::new(z));
                if i == 0 {
                    f.insert("old".to_string(), Arc::new(vec![0.0; per]));
                }
            }
            Step::Lcm { .. } => {
                put("sn", s_next);
                if self.step == (Step::Lcm { flow: true }) {
                    put("keep", 1.0 - s_next);
                }
                let z = if s_next > 0.0 {
                    noise()
                } else {
                    vec![0.0; per]
                };
                f.insert("noise".to_string(), Arc::new(z));
            }
        }
        f
    }
}

/// The fixed inputs of a fused program: each group's model inputs
/// (besides x and t) under its prefix, and each group's `t` input with
/// its rows.
pub(crate) struct GroupFeeds {
    pub fixed: HashMap<String, Arc<Vec<f32>>>,
    pub t: Vec<(String, usize)>,
}

/// [`GroupFeeds`] of `groups` (the sampler's conditioning groups, `b`
/// latents each) from their feeds.
pub(crate) fn group_feeds(
    f: &Fused,
    feeds: &[HashMap<String, Arc<Vec<f32>>>],
    groups: &[super::cond_batch::Group],
    b: usize,
) -> GroupFeeds {
    let mut fixed = HashMap::new();
    let mut t = Vec::new();
    for (k, (feed, g)) in feeds.iter().zip(groups).enumerate() {
        let prefix = f.prefix(k);
        for (name, v) in feed {
            fixed.insert(format!("{prefix}{name}"), Arc::clone(v));
        }
        t.push((format!("{prefix}t"), g.items.len() * b));
    }
    GroupFeeds { fixed, t }
}

/// The sampling loop on `session` (prepared from the fused program) with
/// the program's fixed inputs `feeds`. Reads back the final latent, and each step's prediction into
/// `step_x0` where `watch` (previews) or on the last step.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    ctx: &NodeContext,
    model: &Model,
    f: &Fused,
    session: &mut Session<'_>,
    feeds: &GroupFeeds,
    sigmas: &[f32],
    x0: Vec<f32>,
    blend: Option<&Blend<'_>>,
    noise: &mut dyn FnMut() -> Vec<f32>,
    step_x0: &RefCell<Option<Vec<f32>>>,
    watch: bool,
    on_step: &mut dyn FnMut(usize, usize) -> Result<(), NodeError>,
) -> Result<Vec<f32>, NodeError> {
    // The SDE samplers step in half-logSNR: a flow model's first σ of 1
    // moves just below it, as on the host.
    let sigmas: &[f32] = &if f.sampler.offsets_first_sigma() {
        f.space.offset_first(sigmas)
    } else {
        std::borrow::Cow::Borrowed(sigmas)
    };
    let total = sigmas.len() - 1;
    let carry = f.carry();
    tracing::debug!("sampling loop on the device: {:?}, {total} steps", f.step);
    let mut x0 = Some(x0);
    let mut out = Vec::new();
    for i in 0..total {
        ctx.check_cancel()?;
        let s = sigmas[i];
        // The fixed inputs once: the session keeps them.
        let mut feed = if i == 0 {
            feeds.fixed.clone()
        } else {
            HashMap::new()
        };
        let t = model.schedule.timestep(s);
        feed.extend(f.step_inputs(sigmas, i, (model.prediction.input_divisor(s), t), noise));
        for (name, rows) in &feeds.t {
            feed.insert(name.clone(), Arc::new(vec![t; *rows]));
        }
        if let Some(x) = x0.take() {
            feed.insert("lat".to_string(), Arc::new(x));
            if let Some(bl) = blend {
                feed.insert("inoise".to_string(), Arc::new(bl.noise.to_vec()));
                feed.insert("ilatent".to_string(), Arc::new(bl.latent.to_vec()));
            }
        }
        // The mask once, or DifferentialDiffusion's each step.
        if let Some(bl) = blend.filter(|bl| i == 0 || bl.differential.is_some()) {
            feed.insert("mask".to_string(), Arc::new(bl.mask_at(s).into_owned()));
        }
        let last = i + 1 == total;
        let read: &[usize] = match (last, watch) {
            (true, _) => &[NEXT, DENOISED],
            (false, true) => &[DENOISED],
            (false, false) => &[],
        };
        let mut outs = session
            .run_carried(feed, &carry, read)
            .map_err(|e| super::run_error("UNet", e))?;
        if let Some(d) = outs.get_mut(DENOISED).and_then(Option::take) {
            *step_x0.borrow_mut() = Some(d.data);
        }
        if let Some(x) = outs.get_mut(NEXT).and_then(Option::take) {
            out = x.data;
        }
        on_step(i, total)?;
    }
    Ok(out)
}
