//! Latent nodes that need no model.

use crate::io::{input_path, python_json, save_target, SAVE_LOCK};
use sdkit_compute::weights::{write_safetensors_f32, F32TensorData, SafeTensors};
use sdkit_engine::memory;
use sdkit_engine::{Inputs, Latent, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor, Value};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;

/// ComfyUI's EmptyLatentImage: zeros of shape [batch, 4, height/8, width/8].
pub struct EmptyLatentImage;

impl NodeImpl for EmptyLatentImage {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let samples = Tensor::try_zeros_until(empty_latent_shape(inputs)?, "latent", &ctx.cancel)?;
        Ok(NodeOutput::values(vec![Value::Latent(Arc::new(Latent {
            samples,
            batch_index: None,
            noise_mask: None,
        }))]))
    }

    fn estimate_bytes(&self, _ctx: &NodeContext, inputs: &Inputs) -> Option<u64> {
        Some(memory::f32_bytes(&empty_latent_shape(inputs).ok()?))
    }
}

fn empty_latent_shape(inputs: &Inputs) -> Result<Vec<usize>, NodeError> {
    latent_shape(inputs, 4)
}

fn latent_shape(inputs: &Inputs, channels: usize) -> Result<Vec<usize>, NodeError> {
    let w = inputs.usize("width")?;
    let h = inputs.usize("height")?;
    let b = inputs.usize("batch_size")?;
    Ok(vec![b, channels, h / 8, w / 8])
}

/// ComfyUI's EmptySD3LatentImage: 16-channel zeros (SD3, Flux).
pub struct EmptySd3LatentImage;

impl NodeImpl for EmptySd3LatentImage {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let samples = Tensor::try_zeros_until(latent_shape(inputs, 16)?, "latent", &ctx.cancel)?;
        Ok(NodeOutput::values(vec![Value::Latent(Arc::new(Latent {
            samples,
            batch_index: None,
            noise_mask: None,
        }))]))
    }

    fn estimate_bytes(&self, _ctx: &NodeContext, inputs: &Inputs) -> Option<u64> {
        Some(memory::f32_bytes(&latent_shape(inputs, 16).ok()?))
    }
}

/// ComfyUI's SaveLatent: `{prefix}_{counter:05}_.latent` in the output
/// folder, a safetensors file with `latent_tensor` (f32) and the empty
/// `latent_format_version_0` marker, the prompt and extra info as metadata.
/// Written atomically.
pub struct SaveLatent;

impl NodeImpl for SaveLatent {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let latent = inputs.latent("samples")?;
        let prefix = inputs.string("filename_prefix")?;
        let mut meta = BTreeMap::new();
        meta.insert("prompt".to_string(), python_json(&ctx.prompt));
        for (k, v) in ctx.extra_pnginfo.iter() {
            meta.insert(k.clone(), python_json(v));
        }
        let root = &ctx.paths.output;
        let _guard = SAVE_LOCK
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (folder, name, subfolder, counter) = save_target(root, prefix, 0, 0)?;
        let file = format!("{name}_{counter:05}_.latent");
        let path = folder.join(&file);
        let tensors: [F32TensorData<'_>; 2] = [
            ("latent_tensor", &latent.samples.shape, &latent.samples.data),
            ("latent_format_version_0", &[0], &[]),
        ];
        let written = write_safetensors_f32(&path, &tensors, &meta, &|| !ctx.cancel.is_cancelled());
        ctx.check_cancel()?;
        written.map_err(|e| NodeError::file(&path, e))?;
        Ok(NodeOutput {
            values: Vec::new(),
            ui: Some(
                json!({"latents": [{"filename": file, "subfolder": subfolder, "type": "output"}]}),
            ),
        })
    }
}

/// ComfyUI's LoadLatent: a `.latent` file from the input folder; files
/// without the version marker hold scaled SD1 latents and are divided by
/// 0.18215.
pub struct LoadLatent;

impl NodeImpl for LoadLatent {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let path = input_path(ctx, inputs.string("latent")?)?;
        let file = SafeTensors::open(&path).map_err(|e| NodeError::file(&path, e))?;
        let info = file
            .get("latent_tensor")
            .ok_or_else(|| NodeError::file(&path, "no latent_tensor in this file"))?;
        let shape = info.shape.clone();
        let mut data = file
            .to_f32("latent_tensor")
            .map_err(|e| NodeError::file(&path, e))?;
        if file.get("latent_format_version_0").is_none() {
            for v in &mut data {
                *v *= 1.0 / 0.18215f32;
            }
        }
        let samples = Tensor::new(shape, data).map_err(|e| NodeError::file(&path, e))?;
        Ok(NodeOutput::values(vec![Value::Latent(Arc::new(Latent {
            samples,
            batch_index: None,
            noise_mask: None,
        }))]))
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        let path = input_path(ctx, inputs.string("latent").ok()?).ok()?;
        let meta = std::fs::metadata(path).ok()?;
        let modified = meta
            .modified()
            .ok()?
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?;
        Some(format!("{}:{}", meta.len(), modified.as_nanos()))
    }
}

/// `samples` upscaled to `(w, h)` latent cells as ComfyUI's
/// `common_upscale` on the NCHW latent; the noise mask and batch indices
/// are kept (ComfyUI copies the dict).
fn upscaled(
    ctx: &NodeContext,
    latent: &Latent,
    (w, h): (usize, usize),
    method: &str,
    crop: &str,
) -> Result<NodeOutput, NodeError> {
    use crate::imageops::{cancellable, upscale_latent, Crop, UpscaleMethod};
    use std::str::FromStr;
    let s = &latent.samples.shape;
    let [b, c, lh, lw] = s[..] else {
        return Err(NodeError::invalid(format!(
            "a latent of shape {s:?}: expected [batch, channels, height, width]"
        )));
    };
    let method = UpscaleMethod::from_str(method)?;
    let crop = Crop::from_str(crop)?;
    let data = cancellable(&ctx.cancel, || {
        upscale_latent(&latent.samples.data, [b, c, lh, lw], (w, h), method, crop)
    })?;
    let samples = Tensor::new(vec![b, c, h, w], data).map_err(NodeError::invalid)?;
    Ok(NodeOutput::values(vec![Value::Latent(Arc::new(Latent {
        samples,
        batch_index: latent.batch_index.clone(),
        noise_mask: latent.noise_mask.clone(),
    }))]))
}

/// ComfyUI's LatentUpscale: to `width × height` pixels (each at least
/// 64; a 0 side keeps the aspect ratio, both 0 change nothing), in cells
/// of 8.
pub struct LatentUpscale;

impl NodeImpl for LatentUpscale {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let latent = inputs.latent("samples")?;
        let s = &latent.samples.shape;
        let [_, _, lh, lw] = s[..] else {
            return Err(NodeError::invalid(format!(
                "a latent of shape {s:?}: expected [batch, channels, height, width]"
            )));
        };
        let Some(size) = crate::imageops::latent_upscale_size(
            (lh, lw),
            inputs.usize("width")?,
            inputs.usize("height")?,
        ) else {
            return Ok(NodeOutput::values(vec![Value::Latent(Arc::clone(latent))]));
        };
        upscaled(
            ctx,
            latent,
            size,
            inputs.string("upscale_method")?,
            inputs.string("crop")?,
        )
    }
}

/// ComfyUI's LatentUpscaleBy: each side times `scale_by`, Python-rounded.
pub struct LatentUpscaleBy;

impl NodeImpl for LatentUpscaleBy {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let latent = inputs.latent("samples")?;
        let scale = inputs.float("scale_by")?;
        let s = &latent.samples.shape;
        let [_, _, h, w] = s[..] else {
            return Err(NodeError::invalid(format!(
                "a latent of shape {s:?}: expected [batch, channels, height, width]"
            )));
        };
        upscaled(
            ctx,
            latent,
            crate::imageops::latent_scale_by_size((h, w), scale),
            inputs.string("upscale_method")?,
            "disabled",
        )
    }
}

/// A LATENT as the ops in [`crate::imageops`] take it.
fn parts(latent: &Latent) -> Result<crate::imageops::LatentParts, NodeError> {
    let s = &latent.samples.shape;
    let shape: [usize; 4] = s[..].try_into().map_err(|_| {
        NodeError::invalid(format!(
            "a latent of shape {s:?}: expected [batch, channels, height, width]"
        ))
    })?;
    Ok(crate::imageops::LatentParts {
        shape,
        samples: latent.samples.data.clone(),
        noise_mask: latent
            .noise_mask
            .as_ref()
            .map(|m| (m.shape.clone(), m.data.clone())),
        batch_index: latent.batch_index.clone(),
    })
}

fn latent_out(p: crate::imageops::LatentParts) -> Result<NodeOutput, NodeError> {
    let noise_mask = match p.noise_mask {
        Some((shape, data)) => Some(Tensor::new(shape, data).map_err(NodeError::invalid)?),
        None => None,
    };
    Ok(NodeOutput::values(vec![Value::Latent(Arc::new(Latent {
        samples: Tensor::new(p.shape.to_vec(), p.samples).map_err(NodeError::invalid)?,
        batch_index: p.batch_index,
        noise_mask,
    }))]))
}

/// Declares a latent node whose body maps its inputs to a `LatentParts`.
macro_rules! latent_node {
    ($(#[$doc:meta])* $name:ident, |$inputs:ident| $body:expr) => {
        $(#[$doc])*
        pub struct $name;

        impl NodeImpl for $name {
            fn execute(
                &self,
                _ctx: &NodeContext,
                $inputs: &Inputs,
            ) -> Result<NodeOutput, NodeError> {
                latent_out($body)
            }
        }
    };
}

latent_node!(
    /// ComfyUI's LatentComposite: `samples_from` into `samples_to` at
    /// `(x, y)` pixels, `feather` pixels of ramps on the inner edges.
    LatentComposite,
    |inputs| crate::imageops::latent_composite(
        &parts(inputs.latent("samples_to")?)?,
        &parts(inputs.latent("samples_from")?)?,
        inputs.usize("x")?,
        inputs.usize("y")?,
        inputs.usize("feather")?,
    )?
);

latent_node!(
    /// ComfyUI's LatentCompositeMasked: `source` over `destination` at
    /// `(x, y)` pixels through an optional mask.
    LatentCompositeMasked,
    |inputs| {
        let mask = match inputs.get("mask") {
            Some(_) => Some(crate::image::mask_in(inputs, "mask")?),
            None => None,
        };
        crate::imageops::latent_composite_masked(
            &parts(inputs.latent("destination")?)?,
            &parts(inputs.latent("source")?)?,
            inputs.usize("x")?,
            inputs.usize("y")?,
            inputs.bool("resize_source")?,
            mask.as_ref(),
        )?
    }
);

latent_node!(
    /// ComfyUI's LatentBlend ("normal").
    LatentBlend,
    |inputs| {
        if let Some(mode) = inputs.get("blend_mode").and(inputs.string("blend_mode").ok()) {
            if mode != "normal" {
                return Err(NodeError::invalid(format!("unsupported blend mode: {mode}")));
            }
        }
        crate::imageops::latent_blend(
            &parts(inputs.latent("samples1")?)?,
            &parts(inputs.latent("samples2")?)?,
            inputs.float("blend_factor")?,
        )?
    }
);

latent_node!(
    /// ComfyUI's LatentFromBatch.
    LatentFromBatch,
    |inputs| crate::imageops::latent_from_batch(
        &parts(inputs.latent("samples")?)?,
        inputs.usize("batch_index")?,
        inputs.usize("length")?,
    )?
);

latent_node!(
    /// ComfyUI's RepeatLatentBatch.
    RepeatLatentBatch,
    |inputs| crate::imageops::repeat_latent_batch(
        &parts(inputs.latent("samples")?)?,
        inputs.usize("amount")?,
    )
);

latent_node!(
    /// ComfyUI's LatentCrop (pixels, in cells of 8).
    LatentCrop,
    |inputs| crate::imageops::latent_crop(
        &parts(inputs.latent("samples")?)?,
        inputs.usize("width")?,
        inputs.usize("height")?,
        inputs.usize("x")?,
        inputs.usize("y")?,
    )
);

latent_node!(
    /// ComfyUI's LatentFlip.
    LatentFlip,
    |inputs| crate::imageops::latent_flip(
        &parts(inputs.latent("samples")?)?,
        inputs.string("flip_method")?.starts_with('x'),
    )
);

latent_node!(
    /// ComfyUI's LatentRotate.
    LatentRotate,
    |inputs| {
        let k = match inputs.string("rotation")? {
            r if r.starts_with("90") => 1,
            r if r.starts_with("180") => 2,
            r if r.starts_with("270") => 3,
            _ => 0,
        };
        crate::imageops::latent_rotate(&parts(inputs.latent("samples")?)?, k)
    }
);
