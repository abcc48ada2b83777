//! The sampling loop on the device: for the common case (the positive
//! and negative prediction over the whole latent, in one batch or two of
//! different context lengths; no area or guidance pass; a noise mask
//! allowed; a ControlNet chain every entry shares, `fused_control`) the
//! denoiser's program also blends the inpainting mask, combines the
//! predictions (CFG) and takes the sampler's step, and the latent and the
//! sampler's history stay on the device between steps
//! ([`sdkit_compute::runtime::Session::run_carried`]). Only the final
//! latent is read back, and each step's prediction when someone watches
//! previews (and the carried state once where the loop moves to another
//! program: another set of active ControlNets); on the CPU the host loop
//! is as fast and stays.
//!
//! The arithmetic is the host samplers' (`sampling::samplers`), operation
//! for operation: the per-step numbers (σ, the step's coefficients, from
//! `sampling::steps` where both loops share them) come from the host as
//! one-element inputs, so one program serves every step. Samplers that
//! call the model twice a step run the program twice ([`Two`]).

use super::cond_batch::{Item, Mult};
use super::denoiser::ModelGroup;
use super::fused_control::{Chain, FusedControl};
use super::fused_multi::{Multi, Tail};
use super::inpaint::Blend;
use super::{Model, Prediction};
use crate::models::unet::ControlResiduals;
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
    /// DDPM's ancestral step in VP form (`Sampler::Ddpm` on the host).
    Ddpm,
    /// Euler ancestral on a flow model (`rf_ancestral_step`): the flow
    /// Euler move to σ_down, then scaled and renoised to σ_next.
    EulerAncestralRf,
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
    /// DPM++ 3M SDE (η = 1) in the model's half-logSNR, the last two
    /// predictions carried.
    DpmPp3mSde,
    /// Euler CFG++ (plain or ancestral): the move from the unconditional
    /// prediction, the conditional one as the target.
    EulerCfgPp {
        ancestral: bool,
    },
    /// Two model calls a step, the second at the point the first moves
    /// to ([`Two`]).
    Two(Two),
    /// The multistep samplers of `fused_multi` ([`Multi`]).
    Multi(Multi),
    /// heunpp2: up to three calls a step (`fused_two::heunpp2_calls`).
    HeunPp2,
    /// SEEDS-2 or SEEDS-3 (`three`): two or three calls a step, each
    /// moving from the step's start (`fused_two::seeds_calls`).
    Seeds {
        three: bool,
    },
    /// DPM++ 2S ancestral CFG++: two calls a step, each moving from its
    /// own unconditional prediction (`fused_two::cfg_pp_2s_calls`).
    DpmPp2sCfgPp,
    /// DPM-Solver-fast: its own steps, one to three calls each
    /// (`fused_two::fast_calls`).
    DpmFast,
}

/// The samplers that call the model twice a step (once on the last
/// step). Each call is one run of the program: the first carries the
/// step's starting latent (and Heun's derivative) into `base` (`dold`)
/// and its move into `lat`; the second moves from `base`. Per-call
/// selectors (exactly 0 or 1) pick each call's form of one tail, so
/// every value is the host sampler's to the rounding of the same
/// operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Two {
    Heun,
    Dpm2,
    Dpm2Ancestral,
    DpmPp2sAncestral,
    DpmPpSde,
    /// The ancestral forms on a flow model: the move to the flow σ_down,
    /// then `a·x + z·renoise` (`sampling::steps::rf_ancestral`).
    Dpm2AncestralRf,
    DpmPp2sAncestralRf,
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
    /// The ControlNet chain the program runs, where the entries have one
    /// ([`FusedControl`]; set after [`Fused::of`] with its hints).
    pub control: Option<FusedControl>,
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

/// The program's outputs: the next latent, then the call's denoised
/// prediction (previews, SamplerCustom's x0, DPM++ 2M's history), then
/// what a two-call step carries from its first call (the latent it
/// started from, and Heun's derivative) or DPM++ 3M SDE's older
/// prediction passed on.
pub(crate) const NEXT: usize = 0;
pub(crate) const DENOISED: usize = 1;
pub(crate) const KEPT: usize = 2;
pub(crate) const DIR: usize = 3;

/// One run of the fused program: the model called at `sigma`, with the
/// call's per-run inputs, and what carries into the next run.
pub(crate) struct Call {
    pub sigma: f32,
    pub inputs: HashMap<String, Arc<Vec<f32>>>,
    pub carry: Vec<(usize, &'static str)>,
    /// The step's first call: its prediction is the step's (previews,
    /// SamplerCustom's x0), as ComfyUI's sampler callback reports it.
    pub first: bool,
}

impl Fused {
    /// The fused form of this sampling, where it applies: a GPU-shaped
    /// runtime is the caller's choice; this checks the sampler, the
    /// prediction type and that the groups are plain (every item over
    /// the whole latent at strength one, always active, no ControlNet).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn of(
        model: &Model,
        sampler: Sampler,
        items: &[Item<'_>],
        groups: &[&[usize]],
        cfg: Option<f32>,
        dims: [usize; 4],
        inpaint: bool,
        chain: &Chain,
    ) -> Option<Fused> {
        let step = match sampler {
            // ddim is Euler but for inpainting's noise (its own seed),
            // which the blend's inputs carry.
            Sampler::Euler | Sampler::Ddim => Step::Euler,
            // The flow form of the ancestral step is another update.
            Sampler::EulerAncestral if model.prediction != Prediction::Flow => Step::EulerAncestral,
            Sampler::EulerAncestral => Step::EulerAncestralRf,
            Sampler::Ddpm => Step::Ddpm,
            Sampler::HeunPp2 => Step::HeunPp2,
            Sampler::Seeds2 | Sampler::Seeds3 => Step::Seeds {
                three: sampler == Sampler::Seeds3,
            },
            Sampler::DpmPp2m => Step::DpmPp2m,
            Sampler::Lcm => Step::Lcm {
                flow: model.prediction == Prediction::Flow,
            },
            Sampler::DpmPp2mSde => Step::DpmPp2mSde { heun: false },
            Sampler::DpmPp2mSdeHeun => Step::DpmPp2mSde { heun: true },
            Sampler::DpmPp3mSde => Step::DpmPp3mSde,
            // The unconditional prediction runs even at cfg 1 (the caller
            // gives the CFG scale).
            Sampler::EulerCfgPp | Sampler::EulerAncestralCfgPp if cfg.is_some() => {
                Step::EulerCfgPp {
                    ancestral: sampler == Sampler::EulerAncestralCfgPp,
                }
            }
            Sampler::Heun => Step::Two(Two::Heun),
            Sampler::Dpm2 => Step::Two(Two::Dpm2),
            Sampler::DpmPpSde => Step::Two(Two::DpmPpSde),
            // A flow model's ancestral forms are other updates.
            Sampler::Dpm2Ancestral if model.prediction != Prediction::Flow => {
                Step::Two(Two::Dpm2Ancestral)
            }
            Sampler::Dpm2Ancestral => Step::Two(Two::Dpm2AncestralRf),
            Sampler::DpmPp2sAncestral if model.prediction != Prediction::Flow => {
                Step::Two(Two::DpmPp2sAncestral)
            }
            Sampler::DpmPp2sAncestral => Step::Two(Two::DpmPp2sAncestralRf),
            Sampler::DpmPp2sAncestralCfgPp if cfg.is_some() => Step::DpmPp2sCfgPp,
            Sampler::DpmFast => Step::DpmFast,
            // The rest have a device form in `fused_multi`, or none
            // (dpm_adaptive chooses its steps from each step's error).
            _ => Step::Multi(Multi::of(sampler, cfg.is_some())?),
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
        }) && !matches!(chain, Chain::Host);
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
            control: None,
        })
    }

    /// Group `k`'s ControlNet residuals over its model input `x`, where
    /// the program runs a chain.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn control_residuals<'a>(
        &self,
        g: &'a GraphBuilder,
        model: &Model,
        k: usize,
        grp: &ModelGroup,
        hw: (usize, usize),
        dim: usize,
        x: T<'a>,
    ) -> Result<Option<ControlResiduals<'a>>, ShapeError> {
        match &self.control {
            Some(c) => c
                .residuals(g, model, (k, &self.prefix(k)), grp, hw, dim, x)
                .map(Some),
            None => Ok(None),
        }
    }

    /// The schedule the loop steps through: the SDE samplers step in
    /// half-logSNR, so a flow model's first σ of 1 moves just below it, as
    /// on the host.
    pub(crate) fn sigmas<'s>(&self, sigmas: &'s [f32]) -> std::borrow::Cow<'s, [f32]> {
        if self.sampler.offsets_first_sigma() {
            self.space.offset_first(sigmas)
        } else {
            std::borrow::Cow::Borrowed(sigmas)
        }
    }

    /// The loop's steps over its schedule `sigmas`: one per interval,
    /// but for dpm_fast's own.
    pub(crate) fn steps(&self, sigmas: &[f32]) -> usize {
        match self.step {
            Step::DpmFast => crate::sampling::solvers::dpm_fast_steps(sigmas).len(),
            _ => sigmas.len().saturating_sub(1),
        }
    }

    /// The loop's programs over the schedule `sigmas`: the sets of
    /// ControlNets that run together (bit masks over the chain, 0 without
    /// one), in the order the loop first needs them, and per step and
    /// call the index of its set.
    pub(crate) fn plan(&self, model: &Model, sigmas: &[f32]) -> (Vec<u64>, Vec<Vec<usize>>) {
        let sigmas = self.sigmas(sigmas);
        let eval = |s: f32| call_eval(model, s);
        let mut masks: Vec<u64> = Vec::new();
        let plan = (0..self.steps(&sigmas))
            .map(|i| {
                // The calls' σ, without drawing noise.
                self.calls(&sigmas, i, &eval, &mut Vec::new)
                    .iter()
                    .map(|c| {
                        let m = self.control.as_ref().map_or(0, |fc| fc.mask_at(c.sigma));
                        masks.iter().position(|&x| x == m).unwrap_or_else(|| {
                            masks.push(m);
                            masks.len() - 1
                        })
                    })
                    .collect()
            })
            .collect();
        (masks, plan)
    }

    /// This loop's program for the nets of `mask`.
    pub(crate) fn narrowed(&self, mask: u64) -> Fused {
        Fused {
            control: self.control.as_ref().and_then(|c| c.active(mask)),
            ..self.clone()
        }
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
        let mut uncond_pred = None;
        let d = match self.cfg {
            Some(_) => {
                let (cond, uncond) = (of(0)?, of(1)?);
                uncond_pred = Some(uncond);
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
        let mut kept = Vec::new();
        let next = match self.step {
            Step::Euler => lat.add(to_d()?.mul(scalar("dt")?)?)?,
            Step::Ddpm => {
                // c0·(x/k − c1·ε/c2) + c3·z, scaled to the next σ's input
                // (zero noise and `kn` 1 on the last step).
                let eps = lat.sub(d)?.div(sigma)?;
                let xs = lat.div(scalar("k")?)?;
                let mu = xs
                    .sub(eps.mul(scalar("c1")?)?.div(scalar("c2")?)?)?
                    .mul(scalar("c0")?)?
                    .add(g.input("noise", &self.dims)?.mul(scalar("c3")?)?)?;
                mu.mul(scalar("kn")?)?
            }
            Step::EulerAncestralRf => {
                // r·x + (1 − r)·D, then a·x + z·renoise; the prediction
                // itself on the last step (keep 0, take 1).
                let moved = lat
                    .mul(scalar("r")?)?
                    .add(d.mul(scalar("omr")?)?)?
                    .mul(scalar("a")?)?
                    .add(g.input("noise", &self.dims)?.mul(scalar("renoise")?)?)?;
                moved.mul(scalar("keep")?)?.add(d.mul(scalar("take")?)?)?
            }
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
            Step::DpmPp3mSde => {
                // The two-history form; with one (r0m 0, rs 1, c2 0) or
                // none (c1 = c2 = 0) the terms it lacks are exact zeros.
                let old = g.input("old", &self.dims)?;
                let old2 = g.input("old2", &self.dims)?;
                let d1_0 = d.sub(old)?.div(scalar("r0")?)?;
                let d1_1 = old.sub(old2)?.div(scalar("r1")?)?;
                let diff = d1_0.sub(d1_1)?;
                let rs = scalar("rs")?;
                let d1 = d1_0.add(diff.mul(scalar("r0m")?)?.div(rs)?)?;
                let d2 = diff.div(rs)?;
                let moved = lat
                    .mul(scalar("a")?)?
                    .add(d.mul(scalar("b")?)?)?
                    .add(d1.mul(scalar("c1")?)?)?
                    .sub(d2.mul(scalar("c2")?)?)?
                    .add(
                        g.input("noise", &self.dims)?
                            .mul(scalar("sn")?)?
                            .mul(scalar("k")?)?,
                    )?;
                kept.push(old);
                moved.mul(scalar("keep")?)?.add(d.mul(scalar("take")?)?)?
            }
            Step::EulerCfgPp { ancestral } => {
                // α_t·D + down·(x − α_s·u)/σ (+ α_t·z·up); the prediction
                // itself on the last step (keep 0, take 1).
                let u = uncond_pred.ok_or_else(|| ShapeError {
                    op: "CFG++",
                    message: "no unconditional prediction".into(),
                    shapes: Vec::new(),
                })?;
                let dd = lat.sub(u.mul(scalar("alpha_s")?)?)?.div(sigma)?;
                let alpha_t = scalar("alpha_t")?;
                let mut moved = d.mul(alpha_t)?.add(dd.mul(scalar("down")?)?)?;
                if ancestral {
                    let z = g.input("noise", &self.dims)?;
                    moved = moved.add(z.mul(alpha_t)?.mul(scalar("up")?)?)?;
                }
                moved.mul(scalar("keep")?)?.add(d.mul(scalar("take")?)?)?
            }
            Step::HeunPp2 => {
                // The move from this call's latent or the step's start
                // (`sa`, `sb`) along the weighted derivatives: the first
                // call's, the second's, this call's.
                let base = g.input("base", &self.dims)?;
                let d1 = g.input("d1", &self.dims)?;
                let src = lat.mul(scalar("sa")?)?.add(base.mul(scalar("sb")?)?)?;
                let dc = to_d()?;
                let dir = d1
                    .mul(scalar("w1")?)?
                    .add(g.input("d2", &self.dims)?.mul(scalar("w2")?)?)?
                    .add(dc.mul(scalar("wc")?)?)?;
                // The step's start and first derivative again (copies:
                // an input cannot be carried into itself), so a second
                // call hands them on where the program changes before
                // the third.
                kept.extend([lat, dc, base.mul_scalar(1.0), d1.mul_scalar(1.0)]);
                src.add(dir.mul(scalar("dt")?)?)?
            }
            Step::DpmFast => self.fast_tail(g, (lat, to_d()?), &mut kept)?,
            Step::DpmPp2sCfgPp => {
                let u = uncond_pred.ok_or_else(|| ShapeError {
                    op: "CFG++",
                    message: "no unconditional prediction".into(),
                    shapes: Vec::new(),
                })?;
                self.cfg_pp_2s_tail(g, (lat, d, u), &mut kept)?
            }
            Step::Seeds { .. } => {
                // From the step's start (`sb`, all but the first call):
                // sde·e + z·k, then c·x_s − m·(p1·D₁ + p2·D) + sde·sn,
                // with D₁ the first call's prediction.
                let (src, d1) = self.step_start(g, (lat, d), "d1")?;
                let sde = g
                    .input("sde", &self.dims)?
                    .mul(scalar("e")?)?
                    .add(g.input("noise", &self.dims)?.mul(scalar("k")?)?)?;
                let mix = d1.mul(scalar("p1")?)?.add(d.mul(scalar("p2")?)?)?;
                let moved = src
                    .mul(scalar("c")?)?
                    .sub(mix.mul(scalar("m")?)?)?
                    .add(sde.mul(scalar("sn")?)?)?;
                kept.extend([src, d1, sde]);
                moved.mul(scalar("keep")?)?.add(d.mul(scalar("take")?)?)?
            }
            Step::Multi(m) => {
                let t = Tail {
                    lat,
                    d,
                    sigma,
                    uncond: uncond_pred,
                };
                m.tail(self, g, t, &mut kept)?
            }
            Step::Two(two) => {
                // The point the move starts from: this call's latent (the
                // first call) or the step's start (the second).
                let base = g.input("base", &self.dims)?;
                let src = lat.mul(scalar("sa")?)?.add(base.mul(scalar("sb")?)?)?;
                let dir = if two == Two::Heun {
                    // The second call averages both derivatives.
                    let t = to_d()?;
                    let mean = g.input("dold", &self.dims)?.add(t)?.mul_scalar(0.5);
                    t.mul(scalar("pa")?)?.add(mean.mul(scalar("pb")?)?)?
                } else {
                    to_d()?
                };
                let mut moved = src.add(dir.mul(scalar("dt")?)?)?;
                if matches!(
                    two,
                    Two::DpmPp2sAncestral | Two::DpmPpSde | Two::DpmPp2sAncestralRf
                ) {
                    // The exponential move a·x − b·D (a flow blend r·x +
                    // (1 − r)·D has b = −(1 − r)), or the Euler one above
                    // on the last step (DPM++ 2S ancestral).
                    let exp = src.mul(scalar("a")?)?.sub(d.mul(scalar("b")?)?)?;
                    moved = moved.mul(scalar("se")?)?.add(exp.mul(scalar("sx")?)?)?;
                }
                if matches!(two, Two::Dpm2AncestralRf | Two::DpmPp2sAncestralRf) {
                    // The flow renoise scales the point first.
                    moved = moved.mul(scalar("an")?)?;
                }
                if !matches!(two, Two::Heun | Two::Dpm2) {
                    let noise = g.input("noise", &self.dims)?;
                    moved = moved.add(noise.mul(scalar("al")?)?.mul(scalar("su")?)?)?;
                }
                kept.push(src);
                if two == Two::Heun {
                    kept.push(dir);
                }
                moved
            }
        };
        let mut outs = vec![next, d];
        outs.extend(kept);
        Ok(outs)
    }

    /// The carried state before the first run, from the sampler's
    /// starting latent `x0`.
    fn start(&self, sigmas: &[f32], x0: Vec<f32>) -> HashMap<String, Arc<Vec<f32>>> {
        match self.step {
            // UniPC carries the model's input and the point itself.
            Step::Multi(Multi::UniPc { .. }) => {
                let (lat, xt) = crate::sampling::unipc::device_start(&x0, sigmas);
                HashMap::from([
                    ("lat".to_string(), Arc::new(lat)),
                    ("xt".to_string(), Arc::new(xt)),
                ])
            }
            _ => HashMap::from([("lat".to_string(), Arc::new(x0))]),
        }
    }

    /// The inputs the tail keeps between runs besides the latent: given
    /// zeros on the first run where its first call does not set them.
    fn state(&self) -> &'static [&'static str] {
        match self.step {
            Step::Euler => &[],
            Step::EulerAncestral | Step::EulerAncestralRf | Step::Ddpm | Step::Lcm { .. } => {
                &["noise"]
            }
            Step::EulerCfgPp { ancestral: true } => &["noise"],
            Step::EulerCfgPp { ancestral: false } => &[],
            Step::DpmPp2m => &["old"],
            Step::DpmPp2mSde { .. } => &["old", "noise"],
            Step::DpmPp3mSde => &["old", "old2", "noise"],
            Step::Two(Two::Heun) => &["base", "dold"],
            Step::Two(Two::Dpm2) => &["base"],
            Step::Two(_) => &["base", "noise"],
            Step::Multi(m) => m.state(),
            Step::HeunPp2 => &["base", "d1", "d2"],
            Step::Seeds { .. } => &["base", "d1", "sde", "noise"],
            Step::DpmPp2sCfgPp => &["base", "d1", "noise"],
            Step::DpmFast => &["base", "e0"],
        }
    }

    /// The model-call inputs at σ `s`: σ, c_in, CFG, the prediction's
    /// factors (`t`, the timestep, for LCM's).
    fn call_inputs(&self, f: &mut HashMap<String, Arc<Vec<f32>>>, s: f32, (c_in, t): (f32, f32)) {
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
    }

    /// Step `i`'s program runs (one, or two for [`Step::Two`]) with their
    /// one-element inputs and noise, drawn from `noise` where the host
    /// sampler draws it, in its order; `eval(σ)` is a call's (c_in, t).
    /// The f32 arithmetic is the host samplers'.
    pub(crate) fn calls(
        &self,
        sigmas: &[f32],
        i: usize,
        eval: &dyn Fn(f32) -> (f32, f32),
        noise: &mut dyn FnMut() -> Vec<f32>,
    ) -> Vec<Call> {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let per: usize = self.dims.iter().product();
        let call = |sigma: f32, scalars: &[(&str, f32)], carry: Vec<(usize, &'static str)>| {
            let mut inputs = HashMap::new();
            self.call_inputs(&mut inputs, sigma, eval(sigma));
            for &(name, v) in scalars {
                inputs.insert(name.to_string(), Arc::new(vec![v]));
            }
            Call {
                sigma,
                inputs,
                carry,
                first: false,
            }
        };
        let with_noise = |mut c: Call, z: Vec<f32>| {
            c.inputs.insert("noise".to_string(), Arc::new(z));
            c
        };
        let lat = vec![(NEXT, "lat")];
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let mut calls = match self.step {
            Step::Euler => vec![call(s, &[("dt", s_next - s)], lat)],
            Step::EulerAncestral => {
                let (down, up) = ancestral_step(s, s_next);
                let last = down == 0.0;
                let c = call(
                    s,
                    &[
                        ("dt", down - s),
                        ("up", up),
                        ("keep", flag(!last)),
                        ("take", flag(last)),
                    ],
                    lat,
                );
                let z = if last { vec![0.0; per] } else { noise() };
                vec![with_noise(c, z)]
            }
            Step::Ddpm => {
                let st = crate::sampling::steps::ddpm(s, s_next);
                let last = s_next == 0.0;
                let c = call(
                    s,
                    &[
                        ("k", st.k),
                        ("c0", st.c0),
                        ("c1", st.c1),
                        ("c2", st.c2),
                        ("c3", st.c3),
                        ("kn", st.kn),
                    ],
                    lat,
                );
                let z = if last { vec![0.0; per] } else { noise() };
                vec![with_noise(c, z)]
            }
            Step::EulerAncestralRf => {
                let last = s_next == 0.0;
                let (mut r, mut a, mut renoise) = (0.0, 0.0, 0.0);
                if !last {
                    let rf = crate::sampling::steps::rf_ancestral(s, s_next);
                    (r, a, renoise) = (rf.down / s, rf.a, rf.renoise);
                }
                let c = call(
                    s,
                    &[
                        ("r", r),
                        ("omr", 1.0 - r),
                        ("a", a),
                        ("renoise", renoise),
                        ("keep", flag(!last)),
                        ("take", flag(last)),
                    ],
                    lat,
                );
                let z = if last { vec![0.0; per] } else { noise() };
                vec![with_noise(c, z)]
            }
            Step::DpmPp2m => {
                let (t, t_next) = (-s.ln(), -s_next.ln());
                let h = t_next - t;
                let sig = |t: f32| (-t).exp();
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
                vec![call(
                    s,
                    &[
                        ("a", sig(t_next) / sig(t)),
                        ("b", (-h).exp_m1()),
                        ("c1", c1),
                        ("c", c),
                    ],
                    vec![(NEXT, "lat"), (DENOISED, "old")],
                )]
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
                let c = call(
                    s,
                    &[
                        ("a", a),
                        ("b", b),
                        ("c", c),
                        ("sn", s_next),
                        ("k", k),
                        ("keep", flag(!last)),
                        ("take", flag(last)),
                    ],
                    vec![(NEXT, "lat"), (DENOISED, "old")],
                );
                let z = if last { vec![0.0; per] } else { noise() };
                vec![with_noise(c, z)]
            }
            Step::DpmPp3mSde => {
                let sp = self.space;
                let last = s_next == 0.0;
                // The earlier steps' sizes, as the host sampler kept them.
                let size = |j: usize| sp.lambda(sigmas[j + 1]) - sp.lambda(sigmas[j]);
                let h_1 = (i >= 1).then(|| size(i - 1));
                let h_2 = (i >= 2).then(|| size(i - 2));
                let mut v = [
                    ("a", 0.0),
                    ("b", 0.0),
                    ("r0", 1.0),
                    ("r1", 1.0),
                    ("r0m", 0.0),
                    ("rs", 1.0),
                    ("c1", 0.0),
                    ("c2", 0.0),
                    ("sn", s_next),
                    ("k", 0.0),
                    ("keep", flag(!last)),
                    ("take", flag(last)),
                ];
                if !last {
                    use crate::sampling::steps::{dpmpp_3m_sde, Corr3};
                    let st = dpmpp_3m_sde(sp, s, s_next, h_1, h_2);
                    let (r0, r1, r0m, rs, c1, c2) = match st.corr {
                        Corr3::None => (1.0, 1.0, 0.0, 1.0, 0.0, 0.0),
                        Corr3::One { r, c } => (r, 1.0, 0.0, 1.0, c, 0.0),
                        Corr3::Two { r0, r1, c1, c2 } => (r0, r1, r0, r0 + r1, c1, c2),
                    };
                    let vals = [st.a, st.b, r0, r1, r0m, rs, c1, c2, s_next, st.k];
                    for (slot, val) in v.iter_mut().zip(vals) {
                        slot.1 = val;
                    }
                }
                // The older prediction moves to `old2` before this one
                // replaces it (carries are copied in this order).
                let c = call(
                    s,
                    &v,
                    vec![(NEXT, "lat"), (KEPT, "old2"), (DENOISED, "old")],
                );
                let z = if last { vec![0.0; per] } else { noise() };
                vec![with_noise(c, z)]
            }
            Step::EulerCfgPp { ancestral } => {
                let sp = self.space;
                let last = s_next == 0.0;
                let (mut alpha_s, mut alpha_t, mut down, mut up) = (0.0, 0.0, 0.0, 0.0);
                if !last {
                    // As the host sampler: α = σ·exp(half-logSNR).
                    alpha_s = s * sp.lambda(s).exp();
                    alpha_t = s_next * sp.lambda(s_next).exp();
                    let (dn, u) = if ancestral {
                        ancestral_step(s / alpha_s, s_next / alpha_t)
                    } else {
                        (s_next / alpha_t, 0.0)
                    };
                    down = alpha_t * dn;
                    up = u;
                }
                let c = call(
                    s,
                    &[
                        ("alpha_s", alpha_s),
                        ("alpha_t", alpha_t),
                        ("down", down),
                        ("up", up),
                        ("keep", flag(!last)),
                        ("take", flag(last)),
                    ],
                    lat,
                );
                if !ancestral {
                    vec![c]
                } else {
                    let z = if last { vec![0.0; per] } else { noise() };
                    vec![with_noise(c, z)]
                }
            }
            Step::Lcm { flow } => {
                let mut v = vec![("sn", s_next)];
                if flow {
                    v.push(("keep", 1.0 - s_next));
                }
                let c = call(s, &v, lat);
                let z = if s_next > 0.0 {
                    noise()
                } else {
                    vec![0.0; per]
                };
                vec![with_noise(c, z)]
            }
            Step::Two(two) => self.two_calls(two, (s, s_next), call, noise),
            Step::HeunPp2 => self.heunpp2_calls(sigmas, i, call),
            Step::Seeds { three } => self.seeds_calls(three, (s, s_next), call, noise),
            Step::DpmPp2sCfgPp => self.cfg_pp_2s_calls((s, s_next), call, noise),
            Step::DpmFast => self.fast_calls(sigmas, i, call),
            Step::Multi(m) => m
                .calls(self, sigmas, i, noise)
                .into_iter()
                .map(|mc| {
                    let c = call(s, &mc.scalars, mc.carry);
                    match mc.noise {
                        Some(z) => with_noise(c, z),
                        None => c,
                    }
                })
                .collect(),
        };
        if let Some(c) = calls.first_mut() {
            c.first = true;
        }
        calls
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
        if let Some(c) = &f.control {
            c.feeds(k, &prefix, &mut fixed);
        }
        t.push((format!("{prefix}t"), g.items.len() * b));
    }
    GroupFeeds { fixed, t }
}

/// A model call's (c_in, timestep) at σ `s`.
fn call_eval(model: &Model, s: f32) -> (f32, f32) {
    (
        model.prediction.input_divisor(s),
        model.schedule.timestep(s),
    )
}

/// The device loop's programs as [`run`] switches between them.
pub(crate) struct Programs<'a, 'p> {
    /// The current session (the first program's, prepared), the last one
    /// at the end.
    pub session: &'a mut Option<Session<'p>>,
    /// Prepares program `k`'s session.
    pub open: &'a mut dyn FnMut(usize) -> Result<Session<'p>, NodeError>,
    /// Per step and call, the program it runs.
    pub plan: &'a [Vec<usize>],
}

/// The sampling loop on the device with the program's fixed inputs
/// `feeds`, over `programs`: a change of program moves the carried state
/// to a session of the new one. Reads back the final latent,
/// and each step's prediction into `step_x0` where `watch` (previews) or
/// on the last step.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<'p>(
    ctx: &NodeContext,
    model: &Model,
    f: &Fused,
    programs: Programs<'_, 'p>,
    feeds: &GroupFeeds,
    sigmas: &[f32],
    x0: Vec<f32>,
    blend: Option<&Blend<'_>>,
    noise: &mut dyn FnMut() -> Vec<f32>,
    step_x0: &RefCell<Option<Vec<f32>>>,
    watch: bool,
    on_step: &mut dyn FnMut(usize, usize) -> Result<(), NodeError>,
) -> Result<Vec<f32>, NodeError> {
    let Programs {
        session,
        open,
        plan,
    } = programs;
    let sigmas = f.sigmas(sigmas);
    let total = f.steps(&sigmas);
    tracing::debug!("sampling loop on the device: {:?}, {total} steps", f.step);
    let per: usize = f.dims.iter().product();
    // The state the next run starts from where its session is new: the
    // latent at first, then what the last run of the session before
    // carried.
    let mut handoff = Some(f.start(&sigmas, x0));
    let mut current = plan.first().and_then(|c| c.first()).copied().unwrap_or(0);
    let mut out = Vec::new();
    let eval = |s: f32| call_eval(model, s);
    let program = |i: usize, k: usize| plan.get(i).and_then(|c| c.get(k)).copied().unwrap_or(0);
    for i in 0..total {
        let calls = f.calls(&sigmas, i, &eval, noise);
        let n_calls = calls.len();
        for (k, call) in calls.into_iter().enumerate() {
            ctx.check_cancel()?;
            if program(i, k) != current {
                current = program(i, k);
                // The old session's memory goes before the new one takes
                // its own.
                *session = None;
                *session = Some(open(current)?);
            }
            let Some(session) = session.as_mut() else {
                return Err(NodeError::invalid("the device loop has no session"));
            };
            let s = call.sigma;
            let mut feed = call.inputs;
            let t = model.schedule.timestep(s);
            for (name, rows) in &feeds.t {
                feed.insert(name.clone(), Arc::new(vec![t; *rows]));
            }
            let fresh = handoff.is_some();
            let mask_now = blend.filter(|bl| fresh || bl.differential.is_some());
            if let Some(state) = handoff.take() {
                // A new session: the fixed inputs (it keeps them), the
                // carried state, zeros for the state not set yet.
                for (name, v) in &feeds.fixed {
                    feed.insert(name.clone(), Arc::clone(v));
                }
                feed.extend(state);
                if let Some(bl) = blend {
                    feed.insert("inoise".to_string(), Arc::new(bl.noise.to_vec()));
                    feed.insert("ilatent".to_string(), Arc::new(bl.latent.to_vec()));
                }
                for name in f.state() {
                    feed.entry(name.to_string())
                        .or_insert_with(|| Arc::new(vec![0.0; per]));
                }
            }
            // The mask once a session, or DifferentialDiffusion's at each
            // call's σ.
            if let Some(bl) = mask_now {
                feed.insert("mask".to_string(), Arc::new(bl.mask_at(s).into_owned()));
            }
            let last_step = i + 1 == total;
            let last_call = last_step && k + 1 == n_calls;
            // The next call's program: where it changes, this run's
            // carried outputs come back to seed the next session.
            let next = if k + 1 < n_calls {
                program(i, k + 1)
            } else {
                program(i + 1, 0)
            };
            let moving = !last_call && next != current;
            let mut read = Vec::new();
            if call.first && (watch || last_step) {
                read.push(DENOISED);
            }
            if last_call {
                read.push(NEXT);
            }
            if moving {
                read.extend(call.carry.iter().map(|c| c.0));
            }
            read.sort_unstable();
            read.dedup();
            let mut outs = session
                .run_carried(feed, &call.carry, &read)
                .map_err(|e| super::run_error("UNet", e))?;
            if moving {
                let mut state = HashMap::new();
                for &(o, name) in &call.carry {
                    if let Some(a) = outs.get(o).and_then(Option::as_ref) {
                        state.insert(name.to_string(), Arc::new(a.data.clone()));
                    }
                }
                handoff = Some(state);
            }
            if call.first {
                if let Some(d) = outs.get_mut(DENOISED).and_then(Option::take) {
                    *step_x0.borrow_mut() = Some(d.data);
                }
            }
            if last_call {
                if let Some(x) = outs.get_mut(NEXT).and_then(Option::take) {
                    out = x.data;
                }
            }
        }
        on_step(i, total)?;
    }
    Ok(out)
}
