//! ComfyUI's custom-sampling nodes (comfy_extras/nodes_custom_sampler.py):
//! SAMPLER and SIGMAS values built separately and combined by
//! SamplerCustom.

use super::ksampler::sample;
use super::{input, opaque, Conditioning, Model};
use crate::sampling::discrete::{
    karras_f64, laplace, linspace_f32, polyexponential, vp, BUILT_SCHEDULERS,
};
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

/// SamplerCustom's two outputs: the sampled latent and the last step's
/// denoised estimate (the sample itself when there was no step), both
/// keeping the input's batch index.
fn sampled_outputs(
    latent: &Latent,
    samples: sdkit_engine::Tensor,
    x0: Option<sdkit_engine::Tensor>,
) -> NodeOutput {
    let wrap = |samples| {
        Value::Latent(Arc::new(Latent {
            samples,
            batch_index: latent.batch_index.clone(),
            noise_mask: latent.noise_mask.clone(),
        }))
    };
    let out = wrap(samples.clone());
    let denoised = x0.map_or_else(|| out.clone(), wrap);
    NodeOutput::values(vec![out, denoised])
}

/// SamplerCustom: a SAMPLER over SIGMAS with CFG; outputs the sampled
/// latent and the last step's denoised estimate.
pub struct SamplerCustom;

impl NodeImpl for SamplerCustom {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["model"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let model: Arc<Model> = input(inputs, "model", "MODEL")?;
        let positive: Arc<Conditioning> = input(inputs, "positive", "CONDITIONING")?;
        let negative: Arc<Conditioning> = input(inputs, "negative", "CONDITIONING")?;
        let sampler: Arc<Sampler> = input(inputs, "sampler", "SAMPLER")?;
        let sigmas: Arc<Sigmas> = input(inputs, "sigmas", "SIGMAS")?;
        let latent = inputs.latent("latent_image")?;
        let seed = inputs.int("noise_seed")?;
        let seed = u64::try_from(seed)
            .map_err(|_| NodeError::invalid(format!("seed {seed} is out of range")))?;
        let add_noise = inputs.bool("add_noise")?;
        let (samples, x0) = sample(
            ctx,
            &model,
            &positive,
            Some(&negative),
            latent,
            add_noise.then_some(seed),
            seed,
            inputs.float("cfg")?,
            *sampler,
            &sigmas.0,
        )?;
        Ok(sampled_outputs(latent, samples, x0))
    }
}

/// NOISE: where SamplerCustomAdvanced's initial noise comes from; the
/// seed also seeds the sampler's own noise (DisableNoise's is 0).
#[derive(Debug, Clone, Copy)]
pub enum NoiseSource {
    Random(u64),
    Disabled,
}

/// GUIDER: the model and conditioning SamplerCustomAdvanced denoises
/// with (CFGGuider; BasicGuider has no negative and cfg 1).
#[derive(Debug, Clone)]
pub struct Guider {
    pub model: Arc<Model>,
    pub positive: Arc<Conditioning>,
    pub negative: Option<Arc<Conditioning>>,
    pub cfg: f64,
}

fn seed_input(inputs: &Inputs, name: &str) -> Result<u64, NodeError> {
    let seed = inputs.int(name)?;
    u64::try_from(seed).map_err(|_| NodeError::invalid(format!("seed {seed} is out of range")))
}

/// RandomNoise: the seeded torch-compatible noise of KSampler.
pub struct RandomNoise;

impl NodeImpl for RandomNoise {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let seed = seed_input(inputs, "noise_seed")?;
        Ok(NodeOutput::values(vec![opaque(
            SocketType::Noise,
            NoiseSource::Random(seed),
        )]))
    }
}

/// DisableNoise: zeros (for a latent that carries its noise already).
pub struct DisableNoise;

impl NodeImpl for DisableNoise {
    fn execute(&self, _ctx: &NodeContext, _inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        Ok(NodeOutput::values(vec![opaque(
            SocketType::Noise,
            NoiseSource::Disabled,
        )]))
    }
}

/// CFGGuider: classifier-free guidance between two conditionings.
pub struct CfgGuider;

impl NodeImpl for CfgGuider {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let guider = Guider {
            model: input(inputs, "model", "MODEL")?,
            positive: input(inputs, "positive", "CONDITIONING")?,
            negative: Some(input(inputs, "negative", "CONDITIONING")?),
            cfg: inputs.float("cfg")?,
        };
        Ok(NodeOutput::values(vec![opaque(SocketType::Guider, guider)]))
    }
}

/// BasicGuider: the conditioning alone (cfg 1, no negative).
pub struct BasicGuider;

impl NodeImpl for BasicGuider {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let guider = Guider {
            model: input(inputs, "model", "MODEL")?,
            positive: input(inputs, "conditioning", "CONDITIONING")?,
            negative: None,
            cfg: 1.0,
        };
        Ok(NodeOutput::values(vec![opaque(SocketType::Guider, guider)]))
    }
}

/// SamplerCustomAdvanced: SamplerCustom with the noise and the guidance
/// as separate inputs.
pub struct SamplerCustomAdvanced;

impl NodeImpl for SamplerCustomAdvanced {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["guider"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let noise: Arc<NoiseSource> = input(inputs, "noise", "NOISE")?;
        let guider: Arc<Guider> = input(inputs, "guider", "GUIDER")?;
        let sampler: Arc<Sampler> = input(inputs, "sampler", "SAMPLER")?;
        let sigmas: Arc<Sigmas> = input(inputs, "sigmas", "SIGMAS")?;
        let latent = inputs.latent("latent_image")?;
        let (noise_seed, seed) = match *noise {
            NoiseSource::Random(s) => (Some(s), s),
            NoiseSource::Disabled => (None, 0),
        };
        let (samples, x0) = sample(
            ctx,
            &guider.model,
            &guider.positive,
            guider.negative.as_deref(),
            latent,
            noise_seed,
            seed,
            guider.cfg,
            *sampler,
            &sigmas.0,
        )?;
        Ok(sampled_outputs(latent, samples, x0))
    }
}

/// SplitSigmasDenoise: the last round(steps · denoise) steps apart from
/// the rest (Python's slices: the high part ends where the low begins).
pub struct SplitSigmasDenoise;

impl NodeImpl for SplitSigmasDenoise {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s: Arc<Sigmas> = input(inputs, "sigmas", "SIGMAS")?;
        let denoise = inputs.float("denoise")?;
        let n = s.0.len();
        let steps = n.saturating_sub(1);
        // Python's round(): half to even.
        let total = (steps as f64 * denoise).round_ties_even().max(0.0) as usize;
        // sigmas[:-total] (empty for total 0) and sigmas[-(total + 1):].
        let high = if total == 0 {
            Vec::new()
        } else {
            s.0[..n.saturating_sub(total)].to_vec()
        };
        let low = s.0[n.saturating_sub(total + 1)..].to_vec();
        Ok(NodeOutput::values(vec![sigmas_out(high), sigmas_out(low)]))
    }
}

/// SamplingPercentToSigma: the model's sigma a fraction of the way
/// through sampling.
pub struct SamplingPercentToSigma;

impl NodeImpl for SamplingPercentToSigma {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let model: Arc<Model> = input(inputs, "model", "MODEL")?;
        let p = inputs.float("sampling_percent")?;
        let mut sigma = model.schedule.percent_to_sigma(p);
        if inputs.bool("return_actual_sigma")? {
            if p == 0.0 {
                sigma = f64::from(model.schedule.sigma_max());
            } else if p == 1.0 {
                sigma = f64::from(model.schedule.sigma_min());
            }
        }
        Ok(NodeOutput::values(vec![Value::Float(sigma)]))
    }
}

/// NVIDIA's Align Your Steps noise levels (11 per model type).
const AYS: [(&str, [f64; 11]); 3] = [
    (
        "SD1",
        [
            14.614_641_229_3,
            6.474_576_095_6,
            3.863_674_598_5,
            2.694_615_152_0,
            1.884_192_117_7,
            1.394_380_509_2,
            0.964_258_390_4,
            0.652_368_601_6,
            0.397_745_627_2,
            0.151_523_266_2,
            0.029_167_158_2,
        ],
    ),
    (
        "SDXL",
        [
            14.614_641_229_3,
            6.318_448_528_7,
            3.768_179_031_5,
            2.181_148_076_9,
            1.340_524_494_5,
            0.862_072_114_1,
            0.555_069_328_9,
            0.379_854_070_8,
            0.233_236_413_4,
            0.111_418_817_7,
            0.029_167_158_2,
        ],
    ),
    (
        "SVD",
        [
            700.00, 54.5, 15.886, 7.977, 4.248, 1.789, 0.981, 0.403, 0.173, 0.034, 0.002,
        ],
    ),
];

/// numpy's `linspace(0, 1, n)` (the last point exactly 1).
fn unit_linspace(n: usize) -> Vec<f64> {
    let step = 1.0 / (n.max(2) - 1) as f64;
    let mut v: Vec<f64> = (0..n).map(|i| i as f64 * step).collect();
    if let Some(last) = v.last_mut().filter(|_| n > 1) {
        *last = 1.0;
    }
    v
}

/// AlignYourSteps' `loglinear_interp`: `n` points log-linearly between the
/// given decreasing levels (numpy's `interp` arithmetic).
fn loglinear_interp(levels: &[f64], n: usize) -> Vec<f64> {
    let xs = unit_linspace(levels.len());
    let ys: Vec<f64> = levels.iter().rev().map(|v| v.ln()).collect();
    let mut out: Vec<f64> = unit_linspace(n)
        .into_iter()
        .map(|x| {
            if x >= xs[xs.len() - 1] {
                return ys[ys.len() - 1].exp();
            }
            let j = xs.partition_point(|&p| p <= x).saturating_sub(1);
            let slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]);
            (slope * (x - xs[j]) + ys[j]).exp()
        })
        .collect();
    out.reverse();
    out
}

/// AlignYourStepsScheduler: NVIDIA's optimized levels, interpolated to the
/// step count; below denoise 1 the last round(steps · denoise) steps.
pub struct AlignYourStepsScheduler;

impl NodeImpl for AlignYourStepsScheduler {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s = align_your_steps(
            inputs.string("model_type")?,
            inputs.usize("steps")?,
            inputs.float("denoise")?,
        )
        .map_err(NodeError::invalid)?;
        Ok(NodeOutput::values(vec![sigmas_out(s)]))
    }
}

/// The AlignYourStepsScheduler's sigmas.
pub fn align_your_steps(kind: &str, steps: usize, denoise: f64) -> Result<Vec<f32>, String> {
    let levels = AYS
        .iter()
        .find(|(k, _)| *k == kind)
        .map(|(_, l)| l)
        .ok_or_else(|| format!("model_type {kind:?} is not SD1, SDXL or SVD"))?;
    let mut total = steps;
    if denoise < 1.0 {
        if denoise <= 0.0 {
            return Ok(Vec::new());
        }
        // Python's round: half to even.
        total = (steps as f64 * denoise).round_ties_even() as usize;
    }
    let sigmas = if steps + 1 != levels.len() {
        loglinear_interp(levels, steps + 1)
    } else {
        levels.to_vec()
    };
    let keep = (total + 1).min(sigmas.len());
    let mut s: Vec<f32> = sigmas[sigmas.len() - keep..]
        .iter()
        .map(|&v| v as f32)
        .collect();
    if let Some(last) = s.last_mut() {
        *last = 0.0;
    }
    Ok(s)
}

/// PolyexponentialScheduler.
pub struct PolyexponentialScheduler;

impl NodeImpl for PolyexponentialScheduler {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s = polyexponential(
            inputs.usize("steps")?,
            inputs.float("sigma_min")?,
            inputs.float("sigma_max")?,
            inputs.float("rho")?,
        );
        Ok(NodeOutput::values(vec![sigmas_out(s)]))
    }
}

/// LaplaceScheduler.
pub struct LaplaceScheduler;

impl NodeImpl for LaplaceScheduler {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s = laplace(
            inputs.usize("steps")?,
            inputs.float("sigma_min")?,
            inputs.float("sigma_max")?,
            inputs.float("mu")?,
            inputs.float("beta")?,
        );
        Ok(NodeOutput::values(vec![sigmas_out(s)]))
    }
}

/// VPScheduler.
pub struct VpScheduler;

impl NodeImpl for VpScheduler {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s = vp(
            inputs.usize("steps")?,
            inputs.float("beta_d")?,
            inputs.float("beta_min")?,
            inputs.float("eps_s")?,
        );
        Ok(NodeOutput::values(vec![sigmas_out(s)]))
    }
}

/// BetaSamplingScheduler: the beta schedule with chosen shape parameters.
pub struct BetaSamplingScheduler;

impl NodeImpl for BetaSamplingScheduler {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let model: Arc<Model> = input(inputs, "model", "MODEL")?;
        let s = model.schedule.beta_with(
            inputs.usize("steps")?,
            inputs.float("alpha")?,
            inputs.float("beta")?,
        );
        Ok(NodeOutput::values(vec![sigmas_out(s)]))
    }
}

/// SDTurboScheduler.
pub struct SdTurboScheduler;

impl NodeImpl for SdTurboScheduler {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let model: Arc<Model> = input(inputs, "model", "MODEL")?;
        let s = model
            .schedule
            .sd_turbo(inputs.usize("steps")?, inputs.float("denoise")?);
        Ok(NodeOutput::values(vec![sigmas_out(s)]))
    }
}

/// The parametrised sampler nodes (SamplerEulerAncestral,
/// SamplerDPMPP_2M_SDE, …) at the settings their KSampler names use:
/// ComfyUI builds them with `ksampler(name, {eta, s_noise, …})`, and with
/// every setting at the sampler function's default that is the sampler
/// KSamplerSelect gives. Other settings are refused by name. The noise
/// of a "gpu" noise device is drawn as ComfyUI's run on a CPU draws it
/// (its Brownian tree on the latent's device).
pub struct SamplerPreset {
    /// The KSampler name, given the node's inputs.
    pub name: fn(&Inputs) -> Result<&'static str, NodeError>,
    /// `(input, the value the KSampler sampler uses)`.
    pub defaults: &'static [(&'static str, f64)],
}

impl NodeImpl for SamplerPreset {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let name = (self.name)(inputs)?;
        for &(input, want) in self.defaults {
            let got = match inputs.get(input) {
                Some(sdkit_engine::Value::Int(v)) => *v as f64,
                Some(_) => inputs.float(input)?,
                None => continue,
            };
            if (got - want).abs() > 1e-12 {
                return Err(NodeError::invalid(format!(
                    "{input} {got} is not supported yet for {name} (sdkit runs it at {input} {want})"
                )));
            }
        }
        let s = sampler_named(name)?;
        Ok(NodeOutput::values(vec![opaque(SocketType::Sampler, s)]))
    }
}

/// The settings every eta/s_noise sampler takes by default.
pub const ETA_NOISE: &[(&str, f64)] = &[("eta", 1.0), ("s_noise", 1.0)];

/// SamplerDPMPP_2M_SDE's KSampler name by solver type.
pub fn dpmpp_2m_sde_name(inputs: &Inputs) -> Result<&'static str, NodeError> {
    Ok(match inputs.string("solver_type")? {
        "heun" => "dpmpp_2m_sde_heun",
        _ => "dpmpp_2m_sde",
    })
}

/// SamplerER_SDE: only its ER-SDE solver type, as `er_sde` runs it.
pub fn er_sde_name(inputs: &Inputs) -> Result<&'static str, NodeError> {
    match inputs.string("solver_type")? {
        "ER-SDE" => Ok("er_sde"),
        other => Err(NodeError::invalid(format!(
            "SamplerER_SDE's {other:?} solver type is not supported yet (sdkit runs \"ER-SDE\")"
        ))),
    }
}
