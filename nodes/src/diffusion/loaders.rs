//! CheckpointLoaderSimple and VAELoader.

use super::{opaque, Clip, Model, ModelFile, Vae};
use crate::models::detect::{detect_checkpoint, vae_config, Shapes};
use crate::sampling::discrete::DiscreteSchedule;
use sdkit_engine::weights::{SafeTensors, WeightStore};
use sdkit_engine::{Inputs, NodeContext, NodeError, NodeImpl, NodeOutput};
use sdkit_schema::SocketType;
use std::path::PathBuf;
use std::sync::Arc;

pub const UNET_PREFIX: &str = "model.diffusion_model.";
pub const CLIP_PREFIX: &str = "cond_stage_model.transformer.text_model.";
pub const VAE_PREFIX: &str = "first_stage_model.";

/// Stands in for a part a checkpoint lacks (ComfyUI passes None and fails
/// where it is used); consuming nodes name what is missing.
#[derive(Debug)]
pub struct MissingPart {
    pub what: &'static str,
    pub file: String,
}

fn model_path(ctx: &NodeContext, folder: &str, name: &str) -> Result<PathBuf, NodeError> {
    let path = ctx.paths.model(folder, name).ok_or_else(|| {
        NodeError::invalid(format!(
            "model name {name:?} must be a relative path inside models/{folder}"
        ))
    })?;
    if !path.is_file() {
        return Err(NodeError::file(
            &path,
            format!("no such file in models/{folder}"),
        ));
    }
    Ok(path)
}

/// Changes when the file is replaced or rewritten, so the cached load is
/// dropped.
fn file_fingerprint(ctx: &NodeContext, folder: &str, name: &str) -> Option<String> {
    let path = ctx.paths.model(folder, name)?;
    let meta = std::fs::metadata(path).ok()?;
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    Some(format!("{}:{modified}", meta.len()))
}

fn open(path: &std::path::Path) -> Result<Arc<SafeTensors>, NodeError> {
    // The weight errors name the file themselves.
    SafeTensors::open(path)
        .map(Arc::new)
        .map_err(|e| NodeError::invalid(e.to_string()))
}

fn shapes(file: &SafeTensors) -> Shapes {
    file.tensors()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect()
}

/// ComfyUI's CheckpointLoaderSimple for single-file checkpoints in the
/// original layout.
pub struct CheckpointLoaderSimple;

impl NodeImpl for CheckpointLoaderSimple {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let name = inputs.string("ckpt_name")?;
        let path = model_path(ctx, "checkpoints", name)?;
        let file = open(&path)?;
        let mut s = shapes(&file);
        let mut store = WeightStore::new();
        store.mount(Arc::clone(&file), "", "");
        // Older SD1 files keep CLIP without the `text_model.` level; ComfyUI
        // renames those keys on load.
        let legacy_clip = "cond_stage_model.transformer.";
        if !s.keys().any(|k| k.starts_with(CLIP_PREFIX))
            && s.keys().any(|k| k.starts_with(legacy_clip))
        {
            store.mount(Arc::clone(&file), legacy_clip, CLIP_PREFIX);
            let moved: Vec<(String, Vec<usize>)> = s
                .iter()
                .filter_map(|(k, v)| {
                    k.strip_prefix(legacy_clip)
                        .map(|rest| (format!("{CLIP_PREFIX}{rest}"), v.clone()))
                })
                .collect();
            s.extend(moved);
        }
        let d = detect_checkpoint(&s).map_err(|e| NodeError::file(&path, e))?;
        let shared = Arc::new(ModelFile::new(name, store));
        let model = Model {
            file: Arc::clone(&shared),
            prefix: UNET_PREFIX.to_string(),
            unet: d.unet,
            heads: d.heads,
            schedule: DiscreteSchedule::sd1(),
            latent: d.family.spec().latent,
            prediction: super::Prediction::Eps,
        };
        let clip = match d.clip {
            Some(cfg) => opaque(
                SocketType::Clip,
                Clip {
                    file: Arc::clone(&shared),
                    prefix: CLIP_PREFIX.to_string(),
                    cfg,
                    layer_idx: None,
                },
            ),
            None => opaque(
                SocketType::Clip,
                MissingPart {
                    what: "CLIP text encoder",
                    file: name.to_string(),
                },
            ),
        };
        let vae = match d.vae {
            Some(cfg) => opaque(
                SocketType::Vae,
                Vae {
                    file: Arc::clone(&shared),
                    prefix: VAE_PREFIX.to_string(),
                    cfg,
                },
            ),
            None => opaque(
                SocketType::Vae,
                MissingPart {
                    what: "VAE",
                    file: name.to_string(),
                },
            ),
        };
        Ok(NodeOutput::values(vec![
            opaque(SocketType::Model, model),
            clip,
            vae,
        ]))
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        file_fingerprint(ctx, "checkpoints", inputs.string("ckpt_name").ok()?)
    }
}

/// ComfyUI's VAELoader for standalone KL VAE files (`encoder.*`,
/// `decoder.*`, `quant_conv.*`, `post_quant_conv.*`, with or without the
/// `first_stage_model.` prefix).
pub struct VaeLoader;

impl NodeImpl for VaeLoader {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let name = inputs.string("vae_name")?;
        if matches!(name, "pixel_space") || name.starts_with("taesd") {
            return Err(NodeError::invalid(format!(
                "VAE {name:?} is not supported yet: sdkit loads KL VAE files from models/vae"
            )));
        }
        let path = model_path(ctx, "vae", name)?;
        let file = open(&path)?;
        let s = shapes(&file);
        if s.keys().any(|k| k.contains("up_blocks.")) {
            return Err(NodeError::file(
                &path,
                "diffusers-format VAE files are not supported yet; use the original (ldm) layout",
            ));
        }
        let mut store = WeightStore::new();
        let prefixed = s.keys().any(|k| k.starts_with(VAE_PREFIX));
        store.mount(
            Arc::clone(&file),
            "",
            if prefixed { "" } else { VAE_PREFIX },
        );
        let probe_prefix = if prefixed { VAE_PREFIX } else { "" };
        let cfg = vae_config(&s, probe_prefix)
            .map_err(|e| NodeError::file(&path, e))?
            .ok_or_else(|| {
                NodeError::file(&path, "no VAE decoder found (decoder.conv_in.weight)")
            })?;
        let vae = Vae {
            file: Arc::new(ModelFile::new(name, store)),
            prefix: VAE_PREFIX.to_string(),
            cfg,
        };
        Ok(NodeOutput::values(vec![opaque(SocketType::Vae, vae)]))
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        file_fingerprint(ctx, "vae", inputs.string("vae_name").ok()?)
    }
}
