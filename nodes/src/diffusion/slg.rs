//! Skip-layer guidance, as ComfyUI's SkipLayerGuidanceDiT (and its
//! SkipLayerGuidanceSD3 form) and SkipLayerGuidanceDiTSimple do it: a DiT
//! run again with some of its blocks passed through (the "dit"
//! `double_block` / `single_block` replace patches), either as one more
//! prediction after CFG, `out + (cond − cond_skipped) · scale` (optionally
//! rescaled to the conditional prediction's spread), or as the negative
//! prediction itself (the Simple form). The sampler runs the extra passes
//! (`ksampler::sample`); UNets have no such blocks, and on them ComfyUI's
//! extra pass equals the conditional one, so they ignore it.

use super::{input, opaque, Model};
use crate::models::SkipLayers;
use sdkit_engine::{Inputs, NodeContext, NodeError, NodeImpl, NodeOutput};
use sdkit_schema::SocketType;
use std::sync::Arc;

/// How the skipped-block prediction enters the result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlgMode {
    /// A post-CFG function: `out + (cond − skipped) · scale`.
    PostCfg,
    /// The negative prediction is made with the blocks skipped.
    Uncond,
}

/// One skip-layer guidance applied to a model.
#[derive(Debug, Clone)]
pub struct SkipLayerGuidance {
    pub layers: SkipLayers,
    pub mode: SlgMode,
    pub scale: f64,
    /// Active while `sigma_end ≤ σ ≤ sigma_start` (from the percents, by
    /// the model's sampling when the node ran, as ComfyUI computes them).
    pub sigma_start: f64,
    pub sigma_end: f64,
    /// `rescaling_scale`: blends the result's spread towards the
    /// conditional prediction's.
    pub rescaling: f64,
}

impl SkipLayerGuidance {
    /// Whether it applies at `sigma` (ComfyUI compares `sigma[0].item()`).
    pub fn active(&self, sigma: f32) -> bool {
        let s = f64::from(sigma);
        s >= self.sigma_end && s <= self.sigma_start
    }

    /// The post-CFG update of `out` (the CFG result) from the conditional
    /// prediction and the one with blocks skipped, in f32 as torch does;
    /// with rescaling, `out ·= r · std(cond) / std(out) + 1 − r` (unbiased
    /// standard deviations over the whole batch).
    pub fn post_cfg(&self, out: &mut [f32], cond: &[f32], skipped: &[f32]) {
        if self.scale <= 0.0 {
            return;
        }
        let scale = self.scale as f32;
        for ((o, c), s) in out.iter_mut().zip(cond).zip(skipped) {
            *o += (c - s) * scale;
        }
        if self.rescaling != 0.0 {
            let factor = (std(cond) / std(out)) as f32;
            let r = self.rescaling as f32;
            let factor = r * factor + (1.0 - r);
            out.iter_mut().for_each(|v| *v *= factor);
        }
    }
}

/// Unbiased standard deviation (torch's `std()`), accumulated in f64.
fn std(v: &[f32]) -> f64 {
    let n = v.len() as f64;
    if v.len() < 2 {
        return f64::NAN;
    }
    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let ss: f64 = v.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum();
    (ss / (n - 1.0)).sqrt()
}

/// ComfyUI's `re.findall(r'\d+', s)` as block indices.
fn layer_list(inputs: &Inputs, name: &str) -> Result<Vec<usize>, NodeError> {
    let text = match inputs.get(name) {
        Some(_) => inputs.string(name)?,
        None => "",
    };
    text.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| NodeError::invalid(format!("{name}: block index {s} is too large")))
        })
        .collect()
}

fn percent(inputs: &Inputs, name: &str) -> Result<f64, NodeError> {
    let v = inputs.float(name)?;
    if !(0.0..=1.0).contains(&v) {
        return Err(NodeError::invalid(format!("{name} {v} is outside 0..1")));
    }
    Ok(v)
}

/// The model with `slg` added (or unchanged when it names no blocks).
fn with_slg(
    inputs: &Inputs,
    double: &str,
    single: Option<&str>,
    mode: SlgMode,
) -> Result<NodeOutput, NodeError> {
    let model: Arc<Model> = input(inputs, "model", "MODEL")?;
    let layers = SkipLayers {
        double: layer_list(inputs, double)?,
        single: match single {
            Some(s) => layer_list(inputs, s)?,
            None => Vec::new(),
        },
    };
    if layers.is_empty() {
        return Ok(NodeOutput::values(vec![opaque(SocketType::Model, model)]));
    }
    let scale = match mode {
        SlgMode::PostCfg => inputs.float("scale")?,
        SlgMode::Uncond => 0.0,
    };
    if !scale.is_finite() {
        return Err(NodeError::invalid("scale must be a finite number"));
    }
    let rescaling = match inputs.get("rescaling_scale") {
        Some(_) => inputs.float("rescaling_scale")?,
        None => 0.0,
    };
    let slg = SkipLayerGuidance {
        layers,
        mode,
        scale,
        sigma_start: model
            .schedule
            .percent_to_sigma(percent(inputs, "start_percent")?),
        sigma_end: model
            .schedule
            .percent_to_sigma(percent(inputs, "end_percent")?),
        rescaling,
    };
    let mut m = (*model).clone();
    if mode == SlgMode::Uncond {
        // ComfyUI's calc_cond_batch function: a later one replaces it.
        m.slg.retain(|s| s.mode != SlgMode::Uncond);
    }
    m.slg.push(Arc::new(slg));
    Ok(NodeOutput::values(vec![opaque(SocketType::Model, m)]))
}

/// SkipLayerGuidanceDiT: `double_layers`, `single_layers`, `scale`,
/// `start_percent`, `end_percent`, `rescaling_scale`.
pub struct SkipLayerGuidanceDit;

impl NodeImpl for SkipLayerGuidanceDit {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        with_slg(
            inputs,
            "double_layers",
            Some("single_layers"),
            SlgMode::PostCfg,
        )
    }
}

/// SkipLayerGuidanceSD3: SkipLayerGuidanceDiT with `layers` as the
/// double (joint) blocks.
pub struct SkipLayerGuidanceSd3;

impl NodeImpl for SkipLayerGuidanceSd3 {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        with_slg(inputs, "layers", None, SlgMode::PostCfg)
    }
}

/// SkipLayerGuidanceDiTSimple: the negative prediction with the blocks
/// skipped while active.
pub struct SkipLayerGuidanceDitSimple;

impl NodeImpl for SkipLayerGuidanceDitSimple {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        with_slg(
            inputs,
            "double_layers",
            Some("single_layers"),
            SlgMode::Uncond,
        )
    }
}
