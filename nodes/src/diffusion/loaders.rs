//! CheckpointLoaderSimple and VAELoader.

use super::{opaque, Clip, Model, ModelFile, Prediction, TextEncoderModel, Vae, VaeKind};
use crate::models::detect::{
    detect_checkpoint, detect_text_encoder, detect_unet, vae_config, EncoderArch, Family, Heads,
    Net, Shapes, TextPart, UnetConfig,
};
use crate::models::family::{DefaultSampling, TextEncoder};
use crate::sampling::discrete::DiscreteSchedule;
use sdkit_compute::weights::{DType, Dequant, SafeTensors, WeightStore};
use sdkit_engine::{Inputs, NodeContext, NodeError, NodeImpl, NodeOutput};
use sdkit_schema::SocketType;
use std::path::PathBuf;
use std::sync::Arc;

pub const UNET_PREFIX: &str = "model.diffusion_model.";
/// SD1's CLIP (the other families' encoders are found by detection).
pub const CLIP_PREFIX: &str = "cond_stage_model.transformer.text_model.";
pub const VAE_PREFIX: &str = "first_stage_model.";

/// Stands in for a part a checkpoint lacks (ComfyUI passes None and fails
/// where it is used); consuming nodes name what is missing.
#[derive(Debug)]
pub struct MissingPart {
    pub what: &'static str,
    pub file: String,
}

pub(crate) fn model_path(
    ctx: &NodeContext,
    folder: &str,
    name: &str,
) -> Result<PathBuf, NodeError> {
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
pub(crate) fn file_fingerprint(ctx: &NodeContext, folder: &str, name: &str) -> Option<String> {
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

pub(crate) fn open(path: &std::path::Path) -> Result<Arc<SafeTensors>, NodeError> {
    // The weight errors name the file themselves.
    SafeTensors::open(path)
        .map(Arc::new)
        .map_err(|e| NodeError::invalid(e.to_string()))
}

pub(crate) fn shapes(file: &SafeTensors) -> Shapes {
    file.tensors()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect()
}

/// A text encoder of `family` found in `file`, with its family's rule.
fn text_encoder(
    file: &Arc<ModelFile>,
    family: Family,
    part: TextPart,
) -> Result<TextEncoderModel, String> {
    let rule = family
        .spec()
        .text_rule(part.role)
        .ok_or_else(|| format!("{} has no {:?} text encoder", family.name(), part.role))?;
    let mut arch = part.arch;
    // OpenCLIP's towers in the HF layout keep their exact GELU.
    if let EncoderArch::Clip(c) = &mut arch {
        c.gelu = part.role != TextEncoder::ClipL;
    }
    Ok(TextEncoderModel {
        file: Arc::clone(file),
        prefix: part.prefix,
        arch,
        rule,
        patches: Arc::default(),
    })
}

/// The MODEL of a UNet under `prefix` of `file`, with its family's
/// sampling: SD 2.x files are v-prediction by ComfyUI's weight-statistics
/// rule, SDXL files that say so by a `v_pred` key (with `ztsnr`: zero
/// terminal SNR).
fn build_model(
    file: &Arc<ModelFile>,
    shapes: &Shapes,
    family: Family,
    net: Net,
    heads: Heads,
    prefix: &str,
) -> Result<Model, String> {
    let spec = family.spec();
    let unet = match net {
        Net::Unet(u) => u,
        Net::Mmdit(m) => {
            // SD3: rectified flow, shift 3, timesteps 1000·σ.
            let schedule = match spec.sampling {
                DefaultSampling::Flow { shift, multiplier } => {
                    DiscreteSchedule::flow(shift, multiplier)
                }
                _ => DiscreteSchedule::flow(3.0, 1000.0),
            };
            return Ok(Model {
                family,
                file: Arc::clone(file),
                patches: Arc::default(),
                prefix: prefix.to_string(),
                net: Net::Mmdit(m),
                heads,
                schedule,
                latent: spec.latent,
                prediction: Prediction::Flow,
                differential: None,
                skip_layers: Default::default(),
                slg: Vec::new(),
            });
        }
        Net::Flux(f) => {
            // Dev samples with Flux's resolution-dependent shift (1.15 at
            // the default size, the value ComfyUI uses without
            // ModelSamplingFlux); schnell, told apart by having no
            // guidance embedding, as plain rectified flow.
            let schedule = if f.guidance {
                match spec.sampling {
                    DefaultSampling::FluxShift { shift } => DiscreteSchedule::flux(shift),
                    _ => DiscreteSchedule::flux(1.15),
                }
            } else {
                DiscreteSchedule::flow(1.0, 1.0)
            };
            return Ok(Model {
                family,
                file: Arc::clone(file),
                patches: Arc::default(),
                prefix: prefix.to_string(),
                net: Net::Flux(f),
                heads,
                schedule,
                latent: spec.latent,
                prediction: Prediction::Flow,
                differential: None,
                skip_layers: Default::default(),
                slg: Vec::new(),
            });
        }
    };
    if shapes.contains_key("edm_mean") || shapes.contains_key("edm_vpred.sigma_max") {
        return Err(format!(
            "this {} checkpoint uses EDM sampling (Playground 2.5 or an EDM v-prediction model), which sdkit does not support yet",
            family.name()
        ));
    }
    let mut schedule = DiscreteSchedule::sd1();
    let prediction = match spec.sampling {
        DefaultSampling::EpsOrV if sd2_is_v(file, shapes, &unet, prefix)? => Prediction::V,
        _ if shapes.contains_key("v_pred") => {
            if shapes.contains_key("ztsnr") {
                schedule = DiscreteSchedule::sd1_zsnr();
            }
            Prediction::V
        }
        DefaultSampling::Eps | DefaultSampling::EpsOrV => Prediction::Eps,
        _ => return Err(format!("{} sampling is not supported yet", family.name())),
    };
    Ok(Model {
        family,
        file: Arc::clone(file),
        patches: Arc::default(),
        prefix: prefix.to_string(),
        net: Net::Unet(unet),
        heads,
        schedule,
        latent: spec.latent,
        prediction,
        differential: None,
        skip_layers: Default::default(),
        slg: Vec::new(),
    })
}

/// ComfyUI's SD 2.x rule: a 4-channel model is v-prediction when the
/// first transformer's `norm1.bias` in the last output block has a
/// standard deviation above 0.09 (ComfyUI names `output_blocks.11`, the
/// last block of the real layout; the last one is the rule at any depth).
fn sd2_is_v(
    file: &ModelFile,
    shapes: &Shapes,
    unet: &UnetConfig,
    prefix: &str,
) -> Result<bool, String> {
    if unet.in_channels != 4 {
        return Ok(false);
    }
    let blocks = (0..)
        .take_while(|n| {
            shapes.contains_key(&format!("{prefix}output_blocks.{n}.0.in_layers.0.weight"))
        })
        .count();
    let Some(last) = blocks.checked_sub(1) else {
        return Ok(false);
    };
    let key = format!("{prefix}output_blocks.{last}.1.transformer_blocks.0.norm1.bias");
    if !shapes.contains_key(&key) {
        return Ok(false);
    }
    let v = file.tensor_f32(&key).map_err(|e| e.to_string())?;
    let n = v.len().max(1) as f64;
    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let var = v
        .iter()
        .map(|&x| (f64::from(x) - mean).powi(2))
        .sum::<f64>()
        / n;
    Ok(var.sqrt() > 0.09)
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
        let model = build_model(&shared, &s, d.family, d.net, d.heads, UNET_PREFIX)
            .map_err(|e| NodeError::file(&path, e))?;
        let clip = if d.text.is_empty() {
            opaque(
                SocketType::Clip,
                MissingPart {
                    what: "CLIP text encoder",
                    file: name.to_string(),
                },
            )
        } else {
            let encoders = d
                .text
                .into_iter()
                .map(|p| text_encoder(&shared, d.family, p))
                .collect::<Result<_, _>>()
                .map_err(|e| NodeError::file(&path, e))?;
            opaque(
                SocketType::Clip,
                Clip {
                    family: d.family,
                    encoders,
                    layer_idx: None,
                    t5_options: None,
                },
            )
        };
        let vae = match d.vae {
            Some(cfg) => opaque(
                SocketType::Vae,
                Vae {
                    file: Arc::clone(&shared),
                    prefix: crate::models::detect::vae_prefix(&s).to_string(),
                    kind: VaeKind::Kl(cfg),
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
        match name {
            "taesd" => return load_taesd(ctx, name, 0.18215, 0.0),
            "taesdxl" => return load_taesd(ctx, name, 0.13025, 0.0),
            "taesd3" | "taef1" | "pixel_space" => {
                return Err(NodeError::invalid(format!(
                    "VAE {name:?} is not supported yet: sdkit loads KL VAE files from models/vae \
                     and taesd/taesdxl from models/vae_approx"
                )))
            }
            _ => {}
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
            kind: VaeKind::Kl(cfg),
        };
        Ok(NodeOutput::values(vec![opaque(SocketType::Vae, vae)]))
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        file_fingerprint(ctx, "vae", inputs.string("vae_name").ok()?)
    }
}

/// VAELoader's `taesd`/`taesdxl`: the first `{name}_encoder.*` and
/// `{name}_decoder.*` files of `models/vae_approx`, with the family's
/// latent scale and shift (ComfyUI's `load_taesd`).
fn load_taesd(
    ctx: &NodeContext,
    name: &str,
    scale: f32,
    shift: f32,
) -> Result<NodeOutput, NodeError> {
    let files = ctx.paths.model_files("vae_approx");
    let find = |part: &str| -> Result<PathBuf, NodeError> {
        let stem = format!("{name}_{part}.");
        let file = files.iter().find(|f| f.starts_with(&stem)).ok_or_else(|| {
            NodeError::invalid(format!(
                "VAE {name:?} needs {stem}safetensors (or .pth) in models/vae_approx"
            ))
        })?;
        model_path(ctx, "vae_approx", file)
    };
    let (enc, dec) = (find("encoder")?, find("decoder")?);
    let mut store = WeightStore::new();
    store.mount(open(&enc)?, "", "taesd_encoder.");
    let decoder = open(&dec)?;
    let latent_channels = decoder
        .get("1.weight")
        .and_then(|t| t.shape.get(1).copied())
        .ok_or_else(|| NodeError::file(&dec, "no TAESD decoder (1.weight [64, latent, 3, 3])"))?;
    store.mount(decoder, "", "taesd_decoder.");
    let vae = Vae {
        file: Arc::new(ModelFile::new(name, store)),
        prefix: String::new(),
        kind: VaeKind::Taesd {
            latent_channels,
            scale,
            shift,
        },
    };
    Ok(NodeOutput::values(vec![opaque(SocketType::Vae, vae)]))
}

/// ComfyUI's UNETLoader: a diffusion model alone (`models/diffusion_models`
/// or `models/unet`), keys without a prefix.
pub struct UnetLoader;

impl NodeImpl for UnetLoader {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let name = inputs.string("unet_name")?;
        // ComfyUI stores the weights in the fp8 type and casts each layer's
        // back to the compute dtype: the values are the fp8-rounded ones.
        // ("_fast" adds fp8 matrix products on GPUs that have them; the
        // values are the same.)
        let cast = match inputs.string("weight_dtype")? {
            "default" => None,
            "fp8_e4m3fn" | "fp8_e4m3fn_fast" => Some(DType::F8E4M3),
            "fp8_e5m2" => Some(DType::F8E5M2),
            other => {
                return Err(NodeError::invalid(format!(
                    "weight_dtype {other:?} is not one of default, fp8_e4m3fn, fp8_e4m3fn_fast, fp8_e5m2"
                )))
            }
        };
        load_diffusion_model(ctx, "diffusion_models", name, cast, Dequant::F32)
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        file_fingerprint(ctx, "diffusion_models", inputs.string("unet_name").ok()?)
    }
}

/// A diffusion-model-only file of `folder` (safetensors, a torch file or
/// GGUF, told apart by content), its weights read as if cast to `cast`.
fn load_diffusion_model(
    ctx: &NodeContext,
    folder: &str,
    name: &str,
    cast: Option<DType>,
    dequant: Dequant,
) -> Result<NodeOutput, NodeError> {
    let path = model_path(ctx, folder, name)?;
    let mut raw = SafeTensors::open(&path).map_err(|e| NodeError::invalid(e.to_string()))?;
    raw.set_dequant(dequant);
    let file = Arc::new(raw);
    let s = shapes(&file);
    let (family, net, heads, prefix) = detect_unet(&s).map_err(|e| NodeError::file(&path, e))?;
    let mut mf = ModelFile::whole(name, file);
    mf.cast = cast;
    let shared = Arc::new(mf);
    let model = build_model(&shared, &s, family, net, heads, prefix)
        .map_err(|e| NodeError::file(&path, e))?;
    Ok(NodeOutput::values(vec![opaque(SocketType::Model, model)]))
}

/// ComfyUI-GGUF's UnetLoaderGGUF and UnetLoaderGGUFAdvanced: a `.gguf`
/// diffusion model from `models/unet` or `models/diffusion_models`. Its
/// quantized weights are dequantized per layer as they are used, in the
/// arithmetic ComfyUI-GGUF uses: f16 by default (its scales' type),
/// `dequant_dtype` float32 or target (the compute dtype, f32 here) as the
/// gguf package, bfloat16 in bf16. `patch_dtype` and `patch_on_device`
/// concern LoRA patching, which GGUF models do not take yet.
pub struct UnetLoaderGguf;

/// ComfyUI-GGUF's `dequant_dtype` option as arithmetic.
fn dequant_of(inputs: &Inputs) -> Result<Dequant, NodeError> {
    Ok(match inputs.string("dequant_dtype").unwrap_or("default") {
        "default" | "float16" => Dequant::F16,
        "target" | "float32" => Dequant::F32,
        "bfloat16" => Dequant::Bf16,
        other => {
            return Err(NodeError::invalid(format!(
                "dequant_dtype {other:?} is not one of default, target, float32, float16, bfloat16"
            )))
        }
    })
}

impl NodeImpl for UnetLoaderGguf {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let dequant = dequant_of(inputs)?;
        load_diffusion_model(ctx, "unet_gguf", inputs.string("unet_name")?, None, dequant)
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        file_fingerprint(ctx, "unet_gguf", inputs.string("unet_name").ok()?)
    }
}

/// A standalone text-encoder file: its tensors and the one encoder in it.
struct EncoderFile {
    file: Arc<ModelFile>,
    part: TextPart,
    path: PathBuf,
}

/// llama.cpp's T5 tensor names (GGUF T5 encoders, as ComfyUI-GGUF maps
/// them) → the `t5xxl` file layout; None for any other name.
fn llama_t5_name(name: &str) -> Option<String> {
    let rest = name.strip_suffix(".weight")?;
    let hf = match rest {
        "token_embd" => "shared".to_string(),
        "enc.output_norm" => "encoder.final_layer_norm".to_string(),
        _ => {
            let (block, part) = rest.strip_prefix("enc.blk.")?.split_once('.')?;
            let layer = match part {
                "attn_norm" => "layer.0.layer_norm",
                "attn_q" => "layer.0.SelfAttention.q",
                "attn_k" => "layer.0.SelfAttention.k",
                "attn_v" => "layer.0.SelfAttention.v",
                "attn_o" => "layer.0.SelfAttention.o",
                "attn_rel_b" => "layer.0.SelfAttention.relative_attention_bias",
                "ffn_norm" => "layer.1.layer_norm",
                "ffn_gate" => "layer.1.DenseReluDense.wi_0",
                "ffn_up" => "layer.1.DenseReluDense.wi_1",
                "ffn_down" => "layer.1.DenseReluDense.wo",
                _ => return None,
            };
            format!("encoder.block.{block}.{layer}")
        }
    };
    Some(format!("{hf}.weight"))
}

/// Opens a text encoder of `folder` (`text_encoders`, or `clip_gguf` for
/// ComfyUI-GGUF's loaders, both also `models/clip`), its quantized tensors
/// decoded in `dequant`: CLIP in the HF layout (`text_model.*`,
/// `text_projection.weight`) that ComfyUI saves and people download or
/// OpenCLIP's (which encoder by ComfyUI's layer-count rule: 31 or more is
/// OpenCLIP-G, 23 or more OpenCLIP-H, fewer CLIP-L), or T5 (a GGUF T5 in
/// llama.cpp's names is seen in the `t5xxl` layout).
fn open_encoder(
    ctx: &NodeContext,
    folder: &str,
    name: &str,
    dequant: Dequant,
) -> Result<EncoderFile, NodeError> {
    let path = model_path(ctx, folder, name)?;
    let mut raw = SafeTensors::open(&path).map_err(|e| NodeError::invalid(e.to_string()))?;
    raw.set_dequant(dequant);
    if raw.get("enc.blk.0.attn_q.weight").is_some() {
        let map: std::collections::HashMap<String, String> = raw
            .tensors()
            .filter_map(|t| llama_t5_name(&t.name).map(|hf| (t.name.clone(), hf)))
            .collect();
        // The decoder-only `output` head and anything unknown are dropped.
        raw.rename(&map);
    }
    let file = Arc::new(raw);
    let s = shapes(&file);
    let part = detect_text_encoder(&s)
        .map_err(|e| NodeError::file(&path, e))?
        .ok_or_else(|| {
            NodeError::file(
                &path,
                "no text encoder found (CLIP's text_model.embeddings.token_embedding.weight or token_embedding.weight, T5's encoder.block.0.layer.1.DenseReluDense.wi_1.weight)",
            )
        })?;
    let mut store = WeightStore::new();
    store.mount(file, "", "");
    Ok(EncoderFile {
        file: Arc::new(ModelFile::new(name, store)),
        part,
        path,
    })
}

fn clip_output(family: Family, files: Vec<EncoderFile>) -> Result<NodeOutput, NodeError> {
    let mut encoders = Vec::with_capacity(files.len());
    for f in files {
        let path = f.path.clone();
        encoders
            .push(text_encoder(&f.file, family, f.part).map_err(|e| NodeError::file(&path, e))?);
    }
    // The family's order (SDXL: L, then G).
    let order = family.spec().text_encoders;
    encoders.sort_by_key(|e| order.iter().position(|r| r.encoder == e.rule.encoder));
    Ok(NodeOutput::values(vec![opaque(
        SocketType::Clip,
        Clip {
            family,
            encoders,
            layer_idx: None,
            t5_options: None,
        },
    )]))
}

/// SD3's CLIP from two or three of CLIP-L, OpenCLIP-G and T5, each role
/// at most once. Two CLIPs the layer counts do not tell apart (models with
/// fewer layers than the real ones) are L and G by width, as in SDXL.
fn sd3_clip(mut files: Vec<EncoderFile>) -> Result<NodeOutput, NodeError> {
    let clips: Vec<usize> = (0..files.len())
        .filter(|&i| files[i].part.role != TextEncoder::T5Xxl)
        .collect();
    if let [i, j] = clips[..] {
        if files[i].part.role == files[j].part.role {
            let (l, g) = if files[i].part.arch.width() > files[j].part.arch.width() {
                (j, i)
            } else {
                (i, j)
            };
            files[l].part.role = TextEncoder::ClipL;
            files[g].part.role = TextEncoder::OpenClipG;
        }
    }
    let roles: Vec<TextEncoder> = files.iter().map(|f| f.part.role).collect();
    for (i, r) in roles.iter().enumerate() {
        let allowed = matches!(
            r,
            TextEncoder::ClipL | TextEncoder::OpenClipG | TextEncoder::T5Xxl
        );
        if !allowed || roles[..i].contains(r) {
            return Err(NodeError::invalid(format!(
                "SD3 takes one each of CLIP-L, OpenCLIP-G and T5; these files are {roles:?}"
            )));
        }
    }
    clip_output(Family::Sd3, files)
}

/// ComfyUI's CLIPLoader, DualCLIPLoader and TripleCLIPLoader (one, two or
/// three text-encoder files from `models/text_encoders` or `models/clip`),
/// and ComfyUI-GGUF's CLIPLoaderGGUF, DualCLIPLoaderGGUF and
/// TripleCLIPLoaderGGUF (the same over files of either kind, GGUF T5s in
/// llama.cpp's names included, dequantized in f16 arithmetic as it does).
/// Which encoder a file holds comes from its keys; the `type` picks the
/// family (see [`clip_from_files`]).
pub struct ClipFilesLoader {
    files: usize,
    gguf: bool,
}

impl ClipFilesLoader {
    pub const fn core(files: usize) -> Self {
        ClipFilesLoader { files, gguf: false }
    }

    pub const fn gguf(files: usize) -> Self {
        ClipFilesLoader { files, gguf: true }
    }

    fn folder(&self) -> &'static str {
        if self.gguf {
            "clip_gguf"
        } else {
            "text_encoders"
        }
    }

    fn keys(&self) -> Vec<String> {
        match self.files {
            1 => vec!["clip_name".into()],
            n => (1..=n).map(|i| format!("clip_name{i}")).collect(),
        }
    }
}

impl NodeImpl for ClipFilesLoader {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let dequant = if self.gguf {
            Dequant::F16
        } else {
            Dequant::F32
        };
        let files = self
            .keys()
            .iter()
            .map(|k| open_encoder(ctx, self.folder(), inputs.string(k)?, dequant))
            .collect::<Result<Vec<_>, _>>()?;
        // TripleCLIPLoader has no type: it is SD3's.
        let ty = if self.files == 3 {
            "sd3"
        } else {
            inputs.string("type")?
        };
        clip_from_files(&ctx.class_type, ty, files)
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        let mut parts = Vec::new();
        for k in self.keys() {
            parts.push(file_fingerprint(
                ctx,
                self.folder(),
                inputs.string(&k).ok()?,
            )?);
        }
        Some(parts.join("|"))
    }
}

/// A CLIP of loader `type` from opened encoder files: stable_diffusion
/// (CLIP-L for SD 1.x, OpenCLIP-H for SD 2.x, OpenCLIP-G alone for the SDXL
/// refiner) and chroma (T5) from one file; sdxl (CLIP-L and OpenCLIP-G, in
/// either order: where the layer counts do not tell them apart, in models
/// with fewer layers than the real ones, the wider is G) and flux (CLIP-L
/// and T5) from two; sd3 from two or three.
fn clip_from_files(
    node: &str,
    ty: &str,
    mut files: Vec<EncoderFile>,
) -> Result<NodeOutput, NodeError> {
    let roles: Vec<TextEncoder> = files.iter().map(|f| f.part.role).collect();
    let need = |want: &[TextEncoder], what: &str| -> Result<(), NodeError> {
        if want.iter().all(|r| roles.contains(r)) {
            Ok(())
        } else {
            Err(NodeError::invalid(format!(
                "{node} {ty} needs {what}; these files are {roles:?}"
            )))
        }
    };
    match (ty, files.len()) {
        ("sd3", 2 | 3) => sd3_clip(files),
        ("flux", 2) => {
            need(&[TextEncoder::ClipL, TextEncoder::T5Xxl], "CLIP-L and T5")?;
            clip_output(Family::Flux, files)
        }
        ("chroma", 1) => {
            need(&[TextEncoder::T5Xxl], "a T5 text encoder")?;
            clip_output(Family::Chroma, files)
        }
        ("stable_diffusion", 1) => {
            let family = match roles[0] {
                TextEncoder::ClipL => Family::Sd1,
                TextEncoder::OpenClipH => Family::Sd2,
                _ => Family::SdxlRefiner,
            };
            clip_output(family, files)
        }
        ("sdxl", 2) => {
            if files[0].part.role == files[1].part.role {
                let wider_a = files[0].part.arch.width() > files[1].part.arch.width();
                let (l, g) = if wider_a { (1, 0) } else { (0, 1) };
                files[l].part.role = TextEncoder::ClipL;
                files[g].part.role = TextEncoder::OpenClipG;
            }
            let roles: Vec<TextEncoder> = files.iter().map(|f| f.part.role).collect();
            if !roles.contains(&TextEncoder::ClipL) || !roles.contains(&TextEncoder::OpenClipG) {
                return Err(NodeError::invalid(format!(
                    "{node} sdxl needs CLIP-L and OpenCLIP-G; these files are {roles:?}"
                )));
            }
            clip_output(Family::Sdxl, files)
        }
        (ty, n) => Err(NodeError::invalid(format!(
            "{node} type {ty:?} with {n} file(s) is not supported yet: sdkit loads stable_diffusion and chroma (one file), sdxl, sd3 and flux (two), sd3 (three)"
        ))),
    }
}
