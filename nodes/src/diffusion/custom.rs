//! ComfyUI's custom-sampling nodes (comfy_extras/nodes_custom_sampler.py):
//! SAMPLER and SIGMAS values built separately and combined by
//! SamplerCustom.

use super::ksampler::sample;
use super::{input, opaque, Conditioning, Model};
use crate::sampling::discrete::{karras_f64, linspace_f32, BUILT_SCHEDULERS};
use crate::sampling::samplers::Sampler;
use sdkit_engine::{Inputs, Latent, NodeContext, NodeError, NodeImpl, NodeOutput, Value};
use sdkit_schema::SocketType;
use std::sync::Arc;

/// SIGMAS: a noise schedule (descending, usually ending in 0).
#[derive(Debug, Clone)]
pub struct Sigmas(pub Vec<f32>);

fn sigmas_out(s: Vec<f32>) -> Value {
    opaque(SocketType::Sigmas, Sigmas(s))
}

fn sampler_named(name: &str) -> Result<Sampler, NodeError> {
    Sampler::from_name(name).ok_or_else(|| {
        NodeError::invalid(format!(
            "sampler {name:?} is not built yet in sdkit (built: {})",
            Sampler::BUILT.join(", ")
        ))
    })
}

/// KSamplerSelect: a sampler by name.
pub struct KSamplerSelect;

impl NodeImpl for KSamplerSelect {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s = sampler_named(inputs.string("sampler_name")?)?;
        Ok(NodeOutput::values(vec![opaque(SocketType::Sampler, s)]))
    }
}

/// BasicScheduler: the model's schedule; below denoise 1, the last
/// `steps + 1` sigmas of `int(steps / denoise)` steps.
pub struct BasicScheduler;

impl NodeImpl for BasicScheduler {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let model: Arc<Model> = input(inputs, "model", "MODEL")?;
        let name = inputs.string("scheduler")?;
        let steps = inputs.usize("steps")?;
        let denoise = inputs.float("denoise")?;
        let mut total = steps;
        if denoise < 1.0 {
            if denoise <= 0.0 {
                return Ok(NodeOutput::values(vec![sigmas_out(Vec::new())]));
            }
            total = (steps as f64 / denoise) as usize;
        }
        let s = model.schedule.schedule(name, total).ok_or_else(|| {
            NodeError::invalid(format!(
                "scheduler {name:?} is not built yet in sdkit (built: {})",
                BUILT_SCHEDULERS.join(", ")
            ))
        })?;
        let keep = (steps + 1).min(s.len());
        Ok(NodeOutput::values(vec![sigmas_out(
            s[s.len() - keep..].to_vec(),
        )]))
    }
}

/// KarrasScheduler: Karras et al. sigmas from the widget values.
pub struct KarrasScheduler;

impl NodeImpl for KarrasScheduler {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s = karras_f64(
            inputs.usize("steps")?,
            inputs.float("sigma_min")?,
            inputs.float("sigma_max")?,
            inputs.float("rho")?,
        );
        Ok(NodeOutput::values(vec![sigmas_out(s)]))
    }
}

/// ExponentialScheduler: log-linear from sigma_max to sigma_min, then 0.
pub struct ExponentialScheduler;

impl NodeImpl for ExponentialScheduler {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let steps = inputs.usize("steps")?;
        let (hi, lo) = (
            inputs.float("sigma_max")?.ln(),
            inputs.float("sigma_min")?.ln(),
        );
        let mut s: Vec<f32> = linspace_f32(hi as f32, lo as f32, steps)
            .into_iter()
            .map(f32::exp)
            .collect();
        s.push(0.0);
        Ok(NodeOutput::values(vec![sigmas_out(s)]))
    }
}

/// SplitSigmas: `sigmas[..=step]` and `sigmas[step..]` (they share one).
pub struct SplitSigmas;

impl NodeImpl for SplitSigmas {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s: Arc<Sigmas> = input(inputs, "sigmas", "SIGMAS")?;
        let step = inputs.usize("step")?;
        let high = s.0[..(step + 1).min(s.0.len())].to_vec();
        let low = s.0[step.min(s.0.len())..].to_vec();
        Ok(NodeOutput::values(vec![sigmas_out(high), sigmas_out(low)]))
    }
}

/// FlipSigmas: reversed, a leading 0 replaced by 0.0001.
pub struct FlipSigmas;

impl NodeImpl for FlipSigmas {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s: Arc<Sigmas> = input(inputs, "sigmas", "SIGMAS")?;
        let mut v = s.0.clone();
        v.reverse();
        if v.first() == Some(&0.0) {
            v[0] = 0.0001;
        }
        Ok(NodeOutput::values(vec![sigmas_out(v)]))
    }
}

/// SetFirstSigma: the first sigma replaced.
pub struct SetFirstSigma;

impl NodeImpl for SetFirstSigma {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s: Arc<Sigmas> = input(inputs, "sigmas", "SIGMAS")?;
        let mut v = s.0.clone();
        if let Some(first) = v.first_mut() {
            *first = inputs.float("sigma")? as f32;
        }
        Ok(NodeOutput::values(vec![sigmas_out(v)]))
    }
}

/// SamplerCustom: a SAMPLER over SIGMAS with CFG; outputs the sampled
/// latent and the last step's denoised estimate.
pub struct SamplerCustom;

impl NodeImpl for SamplerCustom {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let model: Arc<Model> = input(inputs, "model", "MODEL")?;
        let positive: Arc<Conditioning> = input(inputs, "positive", "CONDITIONING")?;
        let negative: Arc<Conditioning> = input(inputs, "negative", "CONDITIONING")?;
        let sampler: Arc<Sampler> = input(inputs, "sampler", "SAMPLER")?;
        let sigmas: Arc<Sigmas> = input(inputs, "sigmas", "SIGMAS")?;
        let latent = inputs.latent("latent_image")?;
        if latent.noise_mask.is_some() {
            return Err(NodeError::invalid(
                "latents with a noise mask (inpainting) are not supported yet",
            ));
        }
        let seed = inputs.int("noise_seed")?;
        let seed = u64::try_from(seed)
            .map_err(|_| NodeError::invalid(format!("seed {seed} is out of range")))?;
        let add_noise = inputs.bool("add_noise")?;
        let (samples, x0) = sample(
            ctx,
            &model,
            &positive,
            &negative,
            latent,
            add_noise.then_some(seed),
            seed,
            inputs.float("cfg")?,
            *sampler,
            &sigmas.0,
        )?;
        let wrap = |samples| {
            Value::Latent(Arc::new(Latent {
                samples,
                batch_index: latent.batch_index.clone(),
                noise_mask: latent.noise_mask.clone(),
            }))
        };
        let out = wrap(samples.clone());
        let denoised = x0.map_or_else(|| out.clone(), wrap);
        Ok(NodeOutput::values(vec![out, denoised]))
    }
}
