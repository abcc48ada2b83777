//! The nodes that combine and restrict CONDITIONING (nodes.py's
//! Conditioning* family): they only edit entries; the sampler applies
//! areas, masks, strengths and timestep ranges as ComfyUI's
//! `calc_cond_batch` does ([`super::ksampler`]).

use super::{input, opaque, CondArea, CondEntry, CondMask, Conditioning};
use sdkit_engine::{Inputs, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor, Value};
use sdkit_schema::SocketType;
use std::sync::Arc;

fn conditioning(inputs: &Inputs, name: &str) -> Result<Arc<Conditioning>, NodeError> {
    input(inputs, name, "CONDITIONING")
}

fn output(c: Conditioning) -> Result<NodeOutput, NodeError> {
    Ok(NodeOutput::values(vec![opaque(
        SocketType::Conditioning,
        c,
    )]))
}

/// Every entry of `name` changed by `f`.
fn each(
    inputs: &Inputs,
    name: &str,
    mut f: impl FnMut(&mut CondEntry) -> Result<(), NodeError>,
) -> Result<NodeOutput, NodeError> {
    let mut c = (*conditioning(inputs, name)?).clone();
    for e in &mut c.0 {
        f(e)?;
    }
    output(c)
}

fn strength(inputs: &Inputs, name: &str) -> Result<f32, NodeError> {
    let v = inputs.float(name)?;
    if !v.is_finite() {
        return Err(NodeError::invalid(format!(
            "{name} must be a finite number"
        )));
    }
    Ok(v as f32)
}

fn cells(inputs: &Inputs, name: &str) -> Result<usize, NodeError> {
    let v = inputs.int(name)?;
    usize::try_from(v / 8).map_err(|_| NodeError::invalid(format!("{name} {v} is out of range")))
}

/// ConditioningCombine: both lists, one after the other.
pub struct ConditioningCombine;

impl NodeImpl for ConditioningCombine {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let a = conditioning(inputs, "conditioning_1")?;
        let b = conditioning(inputs, "conditioning_2")?;
        output(Conditioning(a.0.iter().chain(&b.0).cloned().collect()))
    }
}

/// The first entry of `conditioning_from` (ComfyUI uses only that one and
/// warns when there are more).
fn first_from(ctx: &NodeContext, inputs: &Inputs, node: &str) -> Result<CondEntry, NodeError> {
    let from = conditioning(inputs, "conditioning_from")?;
    if from.0.len() > 1 {
        tracing::warn!(
            "node {} ({node}): conditioning_from has {} entries; only the first is used",
            ctx.node_id,
            from.0.len()
        );
    }
    from.0
        .first()
        .cloned()
        .ok_or_else(|| NodeError::invalid("conditioning_from is empty"))
}

/// ConditioningAverage: each entry's context moved towards the first
/// `from` context (cut or zero-padded to its length) by
/// `conditioning_to_strength`, and the pooled outputs likewise.
pub struct ConditioningAverage;

impl NodeImpl for ConditioningAverage {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let from = first_from(ctx, inputs, "ConditioningAverage")?;
        let s = inputs.float("conditioning_to_strength")?;
        // torch.mul(t, s) + torch.mul(f, 1 - s): each Python float becomes
        // an f32 factor.
        let (a, b) = (s as f32, (1.0 - s) as f32);
        let mix = |to: &[f32], from: &[f32]| -> Vec<f32> {
            to.iter()
                .enumerate()
                .map(|(i, t)| t * a + from.get(i).copied().unwrap_or(0.0) * b)
                .collect()
        };
        each(inputs, "conditioning_to", |e| {
            let (len, width) = (e.cross_attn.dim(1), e.cross_attn.dim(2));
            if from.cross_attn.dim(2) != width {
                return Err(NodeError::invalid(format!(
                    "conditioning_from is {} wide, conditioning_to {width}",
                    from.cross_attn.dim(2)
                )));
            }
            let n = len.min(from.cross_attn.dim(1)) * width;
            let data = mix(&e.cross_attn.data, &from.cross_attn.data[..n]);
            e.cross_attn =
                Tensor::new(e.cross_attn.shape.clone(), data).map_err(NodeError::invalid)?;
            e.pooled = match (&e.pooled, &from.pooled) {
                (Some(to), Some(f)) if to.numel() == f.numel() => Some(
                    Tensor::new(to.shape.clone(), mix(&to.data, &f.data))
                        .map_err(NodeError::invalid)?,
                ),
                (Some(_), Some(_)) => return Err(NodeError::invalid(
                    "the pooled outputs of conditioning_to and conditioning_from differ in width",
                )),
                // ComfyUI takes `from`'s as `to`'s, then mixes the two.
                (None, Some(f)) => Some(
                    Tensor::new(f.shape.clone(), mix(&f.data, &f.data))
                        .map_err(NodeError::invalid)?,
                ),
                (to, None) => to.clone(),
            };
            Ok(())
        })
    }
}

/// ConditioningConcat: the first `from` context appended to each entry's
/// along the token axis.
pub struct ConditioningConcat;

impl NodeImpl for ConditioningConcat {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let from = first_from(ctx, inputs, "ConditioningConcat")?;
        each(inputs, "conditioning_to", |e| {
            let width = e.cross_attn.dim(2);
            if from.cross_attn.dim(2) != width {
                return Err(NodeError::invalid(format!(
                    "conditioning_from is {} wide, conditioning_to {width}",
                    from.cross_attn.dim(2)
                )));
            }
            let mut data = e.cross_attn.data.clone();
            data.extend_from_slice(&from.cross_attn.data);
            let len = e.cross_attn.dim(1) + from.cross_attn.dim(1);
            e.cross_attn = Tensor::new(vec![1, len, width], data).map_err(NodeError::invalid)?;
            Ok(())
        })
    }
}

/// Every entry with `area` and `strength` (the area replaces a mask's
/// "mask bounds", as ComfyUI sets `set_area_to_bounds` false).
fn set_area(inputs: &Inputs, area: CondArea) -> Result<NodeOutput, NodeError> {
    let s = strength(inputs, "strength")?;
    each(inputs, "conditioning", |e| {
        e.area = Some(area);
        e.strength = s;
        e.mask = e.mask.take().map(|m| CondMask {
            set_area_to_bounds: false,
            ..m
        });
        Ok(())
    })
}

/// ConditioningSetArea: an area in pixels, stored in latent cells.
pub struct ConditioningSetArea;

impl NodeImpl for ConditioningSetArea {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let area = [
            cells(inputs, "height")?,
            cells(inputs, "width")?,
            cells(inputs, "y")?,
            cells(inputs, "x")?,
        ];
        set_area(inputs, CondArea::Latent(area))
    }
}

/// ConditioningSetAreaPercentage: an area as fractions of the latent.
pub struct ConditioningSetAreaPercentage;

impl NodeImpl for ConditioningSetAreaPercentage {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let area = [
            inputs.float("height")?,
            inputs.float("width")?,
            inputs.float("y")?,
            inputs.float("x")?,
        ];
        set_area(inputs, CondArea::Percentage(area))
    }
}

/// ConditioningSetAreaStrength.
pub struct ConditioningSetAreaStrength;

impl NodeImpl for ConditioningSetAreaStrength {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let s = strength(inputs, "strength")?;
        each(inputs, "conditioning", |e| {
            e.strength = s;
            Ok(())
        })
    }
}

/// ConditioningSetMask: a mask with its strength; "mask bounds" makes the
/// area the mask's bounding box when sampling starts.
pub struct ConditioningSetMask;

impl NodeImpl for ConditioningSetMask {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let Value::Mask(mask) = inputs.require("mask")? else {
            return Err(NodeError::InputType {
                name: "mask".into(),
                expected: "MASK",
                found: "another type".into(),
            });
        };
        // A 2-D mask gets a batch axis (ComfyUI's unsqueeze(0)).
        let mask = match mask.shape.len() {
            2 => Arc::new(
                Tensor::new(vec![1, mask.shape[0], mask.shape[1]], mask.data.clone())
                    .map_err(NodeError::invalid)?,
            ),
            3 => Arc::clone(mask),
            _ => {
                return Err(NodeError::invalid(format!(
                    "mask has shape {:?}; expected [batch, height, width]",
                    mask.shape
                )))
            }
        };
        let s = strength(inputs, "strength")?;
        let bounds = inputs.string("set_cond_area")? == "mask bounds";
        each(inputs, "conditioning", |e| {
            e.mask = Some(CondMask {
                mask: Arc::clone(&mask),
                strength: s,
                set_area_to_bounds: bounds,
            });
            Ok(())
        })
    }
}

/// ConditioningZeroOut: zero contexts and pooled outputs (the options
/// stay).
pub struct ConditioningZeroOut;

impl NodeImpl for ConditioningZeroOut {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        each(inputs, "conditioning", |e| {
            e.cross_attn.data.fill(0.0);
            if let Some(p) = &mut e.pooled {
                p.data.fill(0.0);
            }
            Ok(())
        })
    }
}

/// FluxGuidance: the distilled guidance a Flux dev model gets.
pub struct FluxGuidance;

impl NodeImpl for FluxGuidance {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let g = inputs.float("guidance")?;
        each(inputs, "conditioning", |e| {
            e.guidance = Some(g);
            e.guidance_disabled = false;
            Ok(())
        })
    }
}

/// FluxDisableGuidance: the entries' guidance is unset, so a Flux dev
/// model runs without its guidance embedding (ComfyUI sets `guidance` to
/// None; schnell has none anyway).
pub struct FluxDisableGuidance;

impl NodeImpl for FluxDisableGuidance {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        each(inputs, "conditioning", |e| {
            e.guidance = None;
            e.guidance_disabled = true;
            Ok(())
        })
    }
}

/// ReferenceLatent: appends the latent to every entry's reference
/// latents (an edit model's guiding images, Flux Kontext); without a
/// latent the conditioning passes through.
pub struct ReferenceLatent;

impl NodeImpl for ReferenceLatent {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let Some(Value::Latent(latent)) = inputs.get("latent") else {
            return output((*conditioning(inputs, "conditioning")?).clone());
        };
        let samples = Arc::new(latent.samples.clone());
        if samples.shape.len() != 4 {
            return Err(NodeError::invalid(format!(
                "latent of shape {:?}: expected [batch, channels, height, width]",
                samples.shape
            )));
        }
        each(inputs, "conditioning", |e| {
            e.reference_latents.push(Arc::clone(&samples));
            Ok(())
        })
    }
}

/// FluxKontextMultiReferenceLatentMethod: how the model places several
/// reference latents ("offset", "index", "uxo/uno").
pub struct FluxKontextMultiReferenceLatentMethod;

impl NodeImpl for FluxKontextMultiReferenceLatentMethod {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        use crate::models::flux::RefMethod;
        let name = inputs.string("reference_latents_method")?;
        let method = match name {
            "offset" => RefMethod::Offset,
            "index" => RefMethod::Index,
            // ComfyUI: any name with "uxo" or "uso" in it.
            n if n.contains("uxo") || n.contains("uso") => RefMethod::Uxo,
            other => {
                return Err(NodeError::invalid(format!(
                    "reference_latents_method {other:?} is not one of offset, index, uxo/uno"
                )))
            }
        };
        each(inputs, "conditioning", |e| {
            e.reference_method = Some(method);
            Ok(())
        })
    }
}

/// ConditioningSetTimestepRange: the entry applies from `start` to `end`
/// (fractions of sampling).
pub struct ConditioningSetTimestepRange;

impl NodeImpl for ConditioningSetTimestepRange {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let (start, end) = (inputs.float("start")?, inputs.float("end")?);
        each(inputs, "conditioning", |e| {
            e.start_percent = Some(start);
            e.end_percent = Some(end);
            Ok(())
        })
    }
}
