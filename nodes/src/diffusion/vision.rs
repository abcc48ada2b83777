//! Image conditioning from a CLIP-vision encoder, as ComfyUI's nodes do
//! it: CLIPVisionLoader (`models/clip_vision`), CLIPVisionEncode
//! (`clip_preprocess`, then the encoder's last and penultimate hidden
//! states and image embeddings), StyleModelLoader (`models/style_models`:
//! Flux Redux's `ReduxImageEncoder`) and StyleModelApply, which appends the
//! style model's tokens (× strength) to every conditioning entry's context.

use super::loaders::{file_fingerprint, model_path, shapes};
use super::{graph_error, input, opaque, run_model, Conditioning, ModelFile};
use crate::models::clip_vision::{clip_vision, clip_vision_config, preprocess, ClipVisionConfig};
use sdkit_compute::plan::plan;
use sdkit_compute::tensor::{GraphBuilder, Scope, ShapeError};
use sdkit_compute::weights::SafeTensors;
use sdkit_engine::{Inputs, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor};
use sdkit_schema::SocketType;
use std::sync::Arc;

/// A loaded vision encoder (CLIP_VISION).
#[derive(Debug)]
pub struct ClipVisionModel {
    pub file: Arc<ModelFile>,
    pub cfg: ClipVisionConfig,
}

/// CLIP_VISION_OUTPUT: `[b, tokens, width]` hidden states and the image
/// embeddings.
#[derive(Debug)]
pub struct ClipVisionOutput {
    pub last_hidden_state: Tensor,
    pub penultimate_hidden_states: Tensor,
    pub image_embeds: Tensor,
}

/// A loaded style model (STYLE_MODEL): Flux Redux's image encoder,
/// `redux_down(SiLU(redux_up(x)))`, sizes from its shapes.
#[derive(Debug)]
pub struct StyleModel {
    pub file: Arc<ModelFile>,
    /// `redux_up` `[hidden, input]`, `redux_down` `[output, hidden]`.
    pub input: usize,
    pub hidden: usize,
    pub output: usize,
}

fn open(ctx: &NodeContext, folder: &str, name: &str) -> Result<SafeTensors, NodeError> {
    let path = model_path(ctx, folder, name)?;
    SafeTensors::open(&path).map_err(|e| NodeError::invalid(e.to_string()))
}

fn model_file(name: &str, file: SafeTensors) -> Arc<ModelFile> {
    Arc::new(ModelFile::whole(name, Arc::new(file)))
}

/// CLIPVisionLoader.
pub struct ClipVisionLoader;

impl NodeImpl for ClipVisionLoader {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let name = inputs.string("clip_name")?;
        let file = open(ctx, "clip_vision", name)?;
        let s = shapes(&file);
        if !crate::models::clip_vision::is_clip_vision(&s) {
            return Err(NodeError::file(
                file.path(),
                "not a CLIP vision model sdkit reads (HF layout `vision_model.*`: CLIP ViT or SigLIP); OpenCLIP `visual.*` files and DINOv2 are not supported yet",
            ));
        }
        let cfg = clip_vision_config(&s).map_err(|e| NodeError::file(file.path(), e))?;
        Ok(NodeOutput::values(vec![opaque(
            SocketType::ClipVision,
            ClipVisionModel {
                file: model_file(name, file),
                cfg,
            },
        )]))
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        file_fingerprint(ctx, "clip_vision", inputs.string("clip_name").ok()?)
    }
}

/// CLIPVisionEncode: `crop` "center" (shorter side to the model's size,
/// centre crop) or "none" (squashed to the model's size).
pub struct ClipVisionEncode;

impl NodeImpl for ClipVisionEncode {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["clip_vision"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let model: Arc<ClipVisionModel> = input(inputs, "clip_vision", "CLIP_VISION")?;
        let image = inputs.image("image")?;
        let crop = match inputs.get("crop") {
            Some(_) => inputs.string("crop")? != "none",
            None => true,
        };
        let [b, h, w, c] = image.shape[..] else {
            return Err(NodeError::invalid(format!(
                "image of shape {:?}; expected [batch, height, width, channels]",
                image.shape
            )));
        };
        if c < 3 || b == 0 || h == 0 || w == 0 {
            return Err(NodeError::invalid(format!(
                "image of shape {:?}; CLIP vision takes RGB images",
                image.shape
            )));
        }
        let cfg = &model.cfg;
        let pixels = preprocess(cfg, &image.data, [b, h, w, c], crop);
        let size = cfg.image_size;
        let what = format!("CLIP vision {}", model.file.name);
        let g = GraphBuilder::new();
        let outs = g
            .input("pixels", &[b, 3, size, size])
            .and_then(|x| clip_vision(&g, cfg, x))
            .map_err(|e| graph_error(&what, e))?;
        let prog = plan(&g.finish(&[outs.last_hidden_state, outs.penultimate, outs.image_embeds]))
            .map_err(|e| graph_error(&what, e))?;
        let mut bind = model.file.bindings(&prog, None, None)?;
        bind.inputs.insert("pixels".into(), Arc::new(pixels));
        let mut out = run_model(ctx, &what, &model.file.name, &prog, bind)?.into_iter();
        let mut next = || -> Result<Tensor, NodeError> {
            let a = out
                .next()
                .ok_or_else(|| NodeError::invalid(format!("{what} gave too few outputs")))?;
            Tensor::new(a.shape, a.data).map_err(NodeError::invalid)
        };
        let value = ClipVisionOutput {
            last_hidden_state: next()?,
            penultimate_hidden_states: next()?,
            image_embeds: next()?,
        };
        Ok(NodeOutput::values(vec![opaque(
            SocketType::ClipVisionOutput,
            value,
        )]))
    }
}

/// StyleModelLoader: Flux Redux files; T2I style adapters are refused by
/// name.
pub struct StyleModelLoader;

impl NodeImpl for StyleModelLoader {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let name = inputs.string("style_model_name")?;
        let file = open(ctx, "style_models", name)?;
        let s = shapes(&file);
        if s.contains_key("style_embedding") {
            return Err(NodeError::file(
                file.path(),
                "T2I style adapters are not supported yet (sdkit reads Flux Redux style models)",
            ));
        }
        let (Some(up), Some(down)) = (s.get("redux_up.weight"), s.get("redux_down.weight")) else {
            return Err(NodeError::file(
                file.path(),
                "not a style model sdkit reads (Flux Redux: redux_up / redux_down)",
            ));
        };
        if up.len() != 2 || down.len() != 2 || down[1] != up[0] {
            return Err(NodeError::file(
                file.path(),
                format!("redux_up {up:?} and redux_down {down:?} do not chain"),
            ));
        }
        let model = StyleModel {
            input: up[1],
            hidden: up[0],
            output: down[0],
            file: model_file(name, file),
        };
        Ok(NodeOutput::values(vec![opaque(
            SocketType::StyleModel,
            model,
        )]))
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        file_fingerprint(ctx, "style_models", inputs.string("style_model_name").ok()?)
    }
}

/// StyleModelApply: the style model's tokens for the image(s), flattened
/// into one row (`flatten(0, 1).unsqueeze(0)`), × strength ("multiply"),
/// appended to every entry's context.
pub struct StyleModelApply;

impl NodeImpl for StyleModelApply {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["style_model"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let cond: Arc<Conditioning> = input(inputs, "conditioning", "CONDITIONING")?;
        let model: Arc<StyleModel> = input(inputs, "style_model", "STYLE_MODEL")?;
        let vision: Arc<ClipVisionOutput> =
            input(inputs, "clip_vision_output", "CLIP_VISION_OUTPUT")?;
        let strength = inputs.float("strength")?;
        if !strength.is_finite() {
            return Err(NodeError::invalid("strength must be a finite number"));
        }
        let kind = match inputs.get("strength_type") {
            Some(_) => inputs.string("strength_type")?,
            None => "multiply",
        };
        if kind == "attn_bias" && strength != 1.0 {
            return Err(NodeError::invalid(
                "StyleModelApply strength_type \"attn_bias\" is not supported yet (it needs attention masks per query and key); use \"multiply\"",
            ));
        }
        let x = &vision.last_hidden_state;
        let [b, tokens, width] = x.shape[..] else {
            return Err(NodeError::invalid(format!(
                "the CLIP vision output's hidden state has shape {:?}",
                x.shape
            )));
        };
        if width != model.input {
            return Err(NodeError::invalid(format!(
                "the style model takes {}-wide image tokens; this CLIP vision model gives {width} (use the vision model the style model was made for, SigLIP for Redux)",
                model.input
            )));
        }
        let what = format!("style model {}", model.file.name);
        let g = GraphBuilder::new();
        let out = (|| {
            let vb = Scope::new(&g, "");
            let h = vb.pp("redux_up").linear(
                g.input("x", &[b, tokens, width])?,
                width,
                model.hidden,
            )?;
            vb.pp("redux_down")
                .linear(h.silu(), model.hidden, model.output)
        })()
        .map_err(|e: ShapeError| graph_error(&what, e))?;
        let prog = plan(&g.finish(&[out])).map_err(|e| graph_error(&what, e))?;
        let mut bind = model.file.bindings(&prog, None, None)?;
        bind.inputs.insert("x".into(), Arc::new(x.data.clone()));
        let tokens_out = run_model(ctx, &what, &model.file.name, &prog, bind)?
            .into_iter()
            .next()
            .ok_or_else(|| NodeError::invalid(format!("{what} gave no output")))?;
        // [b, n, out] → one row of b·n tokens, × strength in f32.
        let s = strength as f32;
        let style: Vec<f32> = if kind == "multiply" {
            tokens_out.data.iter().map(|v| v * s).collect()
        } else {
            tokens_out.data
        };
        let n = b * tokens;
        let mut out = (*cond).clone();
        for e in &mut out.0 {
            let shape = e.cross_attn.shape.clone();
            let [eb, len, dim] = shape[..] else {
                return Err(NodeError::invalid(format!(
                    "conditioning of shape {shape:?}: expected [batch, tokens, width]"
                )));
            };
            if dim != model.output {
                return Err(NodeError::invalid(format!(
                    "the style model gives {}-wide tokens; the conditioning is {dim} wide (text encoder and style model do not belong together)",
                    model.output
                )));
            }
            if eb != 1 {
                return Err(NodeError::invalid(format!(
                    "conditioning of batch {eb}: StyleModelApply joins a batch of one, as ComfyUI's torch.cat does"
                )));
            }
            let mut data = Vec::with_capacity((len + n) * dim);
            data.extend_from_slice(&e.cross_attn.data);
            data.extend_from_slice(&style);
            e.cross_attn = Tensor::new(vec![1, len + n, dim], data).map_err(NodeError::invalid)?;
        }
        Ok(NodeOutput::values(vec![opaque(
            SocketType::Conditioning,
            out,
        )]))
    }
}
