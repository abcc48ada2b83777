//! Model detection: which architecture a checkpoint holds, and every size,
//! inferred from tensor names and shapes the way ComfyUI's
//! `model_detection.py` does it. Nothing is assumed from file names, so
//! pruned, distilled and tiny checkpoints work.
//!
//! Input is a map from tensor name to shape (e.g. from
//! `SafeTensors::tensors()`), so detection never reads tensor data.

use super::family::TextEncoder;
use std::collections::BTreeMap;

/// Tensor name → shape.
pub type Shapes = BTreeMap<String, Vec<usize>>;

/// Architecture families sdkit recognises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Sd1,
    Sd2,
    Sdxl,
    SdxlRefiner,
    Sd3,
    Flux,
    Chroma,
}

impl Family {
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// Families whose models sdkit can build today.
    pub fn supported(self) -> bool {
        self.spec().supported
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DetectError {
    #[error("no diffusion model found under \"{prefix}\" (no known key such as {prefix}input_blocks.0.0.weight)")]
    NoModel { prefix: String },
    #[error("tensor \"{name}\" is missing; the checkpoint looks truncated or converted with a different key layout")]
    Missing { name: String },
    #[error("tensor \"{name}\" has shape {shape:?}, expected {expected}")]
    BadShape {
        name: String,
        shape: Vec<usize>,
        expected: &'static str,
    },
    #[error("this is a {} checkpoint, which sdkit does not support yet", .0.name())]
    Unsupported(Family),
    #[error("the checkpoint holds only some of the {} text encoders", .0.name())]
    PartialText(Family),
    #[error("a UNet with context dim {context_dim:?}, model channels {model_channels}, ADM input {adm:?} matches no known family")]
    UnknownUnet {
        context_dim: Option<usize>,
        model_channels: usize,
        adm: Option<usize>,
    },
}

/// ComfyUI's UNet config, as inferred from shapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnetConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub model_channels: usize,
    /// Res blocks per level.
    pub num_res_blocks: Vec<usize>,
    pub channel_mult: Vec<usize>,
    /// Transformer depth of each input res block (0 = no attention).
    pub transformer_depth: Vec<usize>,
    /// Transformer depth of each output block.
    pub transformer_depth_output: Vec<usize>,
    /// Middle block transformer depth; None when the middle has no
    /// transformer.
    pub transformer_depth_middle: Option<usize>,
    /// SD2/SDXL project in/out with linear layers; SD1 with 1×1 convs.
    pub use_linear_in_transformer: bool,
    pub context_dim: Option<usize>,
    /// SDXL's class-embedding input width (`label_emb`).
    pub adm_in_channels: Option<usize>,
}

/// A diffusion model's network and its sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Net {
    Unet(UnetConfig),
    Flux(super::flux::FluxConfig),
    Mmdit(super::mmdit::MmditConfig),
}

impl Net {
    /// The UNet's config, if this is one.
    pub fn unet(&self) -> Option<&UnetConfig> {
        match self {
            Net::Unet(u) => Some(u),
            _ => None,
        }
    }
}

/// How a UNet splits a transformer's channels into attention heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heads {
    /// The same number of heads everywhere (SD1: `num_heads: 8`).
    Count(usize),
    /// Heads of this width (SD2/SDXL: `num_head_channels: 64`), so deeper
    /// levels have more; at least one head where a level is narrower (tiny
    /// models), as the rule that scales.
    Width(usize),
}

impl Heads {
    /// The head count at `channels`.
    pub fn at(self, channels: usize) -> usize {
        match self {
            Heads::Count(n) => n,
            Heads::Width(d) => (channels / d.max(1)).max(1),
        }
    }
}

/// The CLIP text encoder of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClipConfig {
    pub vocab: usize,
    pub width: usize,
    pub layers: usize,
    pub max_positions: usize,
    /// CLIP uses 64-dimensional heads (not visible in shapes).
    pub heads: usize,
    pub intermediate: usize,
    /// Exact (erf) GELU in the MLP: OpenCLIP models converted to this
    /// layout (G, H) use it, OpenAI's CLIP-L quick GELU. Not visible in
    /// shapes: the loader sets it from the encoder's role.
    pub gelu: bool,
    /// The pooled projection's width (`text_projection.weight`
    /// `[projection, width]` beside `text_model.`), when the file has one.
    pub projection: Option<usize>,
}

/// An OpenCLIP text encoder (ViT-H/14, ViT-bigG/14) in its own key layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenClipConfig {
    pub vocab: usize,
    pub width: usize,
    /// 24 for ViT-H, 32 for ViT-bigG (how ComfyUI tells them apart).
    pub layers: usize,
    pub max_positions: usize,
    /// 64-dimensional heads, as CLIP (not visible in shapes).
    pub heads: usize,
    pub intermediate: usize,
    /// The pooled output's width (`text_projection` `[width, projection]`).
    pub projection: usize,
}

/// The KL autoencoder (VAE) of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VaeConfig {
    pub ch: usize,
    pub ch_mult: Vec<usize>,
    pub num_res_blocks: usize,
    pub z_channels: usize,
    pub in_channels: usize,
    /// SD's VAEs have `quant_conv`/`post_quant_conv` 1×1 convolutions
    /// around the latent; Flux's and SD3's have none.
    pub quant_conv: bool,
}

/// The key layout a text encoder's weights use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EncoderArch {
    /// Hugging Face CLIPTextModel names (`embeddings.token_embedding`,
    /// `encoder.layers.N.self_attn.q_proj`, ...).
    Clip(ClipConfig),
    /// OpenCLIP names (`token_embedding`, `transformer.resblocks.N.attn.in_proj_weight`, ...).
    OpenClip(OpenClipConfig),
    /// T5 v1.1's encoder (`shared`, `encoder.block.N.layer.0.SelfAttention.q`, ...).
    T5(super::t5::T5Config),
}

impl EncoderArch {
    pub fn layers(&self) -> usize {
        match self {
            EncoderArch::Clip(c) => c.layers,
            EncoderArch::OpenClip(c) => c.layers,
            EncoderArch::T5(c) => c.layers,
        }
    }

    pub fn width(&self) -> usize {
        match self {
            EncoderArch::Clip(c) => c.width,
            EncoderArch::OpenClip(c) => c.width,
            EncoderArch::T5(c) => c.width,
        }
    }
}

/// One text encoder found in a file: its role in the family, where its
/// tensors are, and their layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextPart {
    pub role: TextEncoder,
    pub prefix: String,
    pub arch: EncoderArch,
}

/// Everything detected in a single-file checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detected {
    pub family: Family,
    pub net: Net,
    /// UNet attention heads (not visible in shapes: SD1's convention is
    /// 8 heads, SD2's and SDXL's 64-channel heads).
    pub heads: Heads,
    /// The text encoders the file carries, in the family's order (empty
    /// when it has none).
    pub text: Vec<TextPart>,
    pub vae: Option<VaeConfig>,
}

fn has_prefix(s: &Shapes, prefix: &str) -> bool {
    s.range(prefix.to_string()..)
        .next()
        .is_some_and(|(k, _)| k.starts_with(prefix))
}

/// Number of consecutive `prefix{n}.` groups starting at 0.
fn count_blocks(s: &Shapes, prefix: &str) -> usize {
    (0..)
        .take_while(|n| has_prefix(s, &format!("{prefix}{n}.")))
        .count()
}

/// The shape of tensor `name`, which must have `rank` dimensions.
pub(crate) fn shape_of(
    s: &Shapes,
    name: String,
    rank: usize,
    expected: &'static str,
) -> Result<Vec<usize>, DetectError> {
    let sh = s
        .get(&name)
        .ok_or(DetectError::Missing { name: name.clone() })?;
    if sh.len() != rank {
        return Err(DetectError::BadShape {
            name,
            shape: sh.clone(),
            expected,
        });
    }
    Ok(sh.clone())
}

fn shape<'a>(s: &'a Shapes, name: &str) -> Result<&'a [usize], DetectError> {
    s.get(name).map(Vec::as_slice).ok_or(DetectError::Missing {
        name: name.to_string(),
    })
}

fn dim(s: &Shapes, name: &str, i: usize, expected: &'static str) -> Result<usize, DetectError> {
    let sh = shape(s, name)?;
    sh.get(i).copied().ok_or(DetectError::BadShape {
        name: name.to_string(),
        shape: sh.to_vec(),
        expected,
    })
}

/// Transformer depth, context dim and projection kind of a block's
/// SpatialTransformer (at `{block}1.`), if it has one.
fn transformer(s: &Shapes, block: &str) -> Result<Option<(usize, usize, bool)>, DetectError> {
    let tp = format!("{block}1.transformer_blocks.");
    if !has_prefix(s, &tp) {
        return Ok(None);
    }
    let depth = count_blocks(s, &tp);
    let context = dim(
        s,
        &format!("{tp}0.attn2.to_k.weight"),
        1,
        "[inner, context_dim]",
    )?;
    let linear = shape(s, &format!("{block}1.proj_in.weight"))?.len() == 2;
    Ok(Some((depth, context, linear)))
}

/// Infers a ldm-layout UNet's config (ComfyUI's `detect_unet_config` for
/// UNets) from the tensors under `prefix`.
pub fn unet_config(s: &Shapes, prefix: &str) -> Result<UnetConfig, DetectError> {
    let conv_in = format!("{prefix}input_blocks.0.0.weight");
    if !s.contains_key(&conv_in) {
        return Err(DetectError::NoModel {
            prefix: prefix.to_string(),
        });
    }
    let model_channels = dim(s, &conv_in, 0, "[model_channels, in, 3, 3]")?;
    let in_channels = dim(s, &conv_in, 1, "[model_channels, in, 3, 3]")?;
    let out_channels = match s.get(&format!("{prefix}out.2.weight")) {
        Some(sh) => sh.first().copied().unwrap_or(4),
        None => 4,
    };
    let adm_in_channels = s
        .get(&format!("{prefix}label_emb.0.0.weight"))
        .and_then(|sh| sh.get(1).copied());

    let mut num_res_blocks = Vec::new();
    let mut channel_mult = Vec::new();
    let mut transformer_depth = Vec::new();
    let mut transformer_depth_output = Vec::new();
    let mut context_dim = None;
    let mut use_linear = false;
    let (mut last_res, mut last_mult) = (0, 0);

    let n_in = count_blocks(s, &format!("{prefix}input_blocks."));
    for i in 0..n_in {
        let p = format!("{prefix}input_blocks.{i}.");
        // Output blocks mirror input blocks in reverse.
        let po = format!("{prefix}output_blocks.{}.", n_in - i - 1);
        if s.contains_key(&format!("{p}0.op.weight")) {
            // A downsampling block starts a new level.
            num_res_blocks.push(last_res);
            channel_mult.push(last_mult);
            last_res = 0;
            last_mult = 0;
            transformer_depth_output.push(transformer(s, &po)?.map_or(0, |t| t.0));
            continue;
        }
        if s.contains_key(&format!("{p}0.in_layers.0.weight")) {
            last_res += 1;
            let out = dim(
                s,
                &format!("{p}0.out_layers.3.weight"),
                0,
                "[out, in, 3, 3]",
            )?;
            last_mult = out / model_channels.max(1);
            match transformer(s, &p)? {
                Some((d, ctx, lin)) => {
                    transformer_depth.push(d);
                    if context_dim.is_none() {
                        context_dim = Some(ctx);
                        use_linear = lin;
                    }
                }
                None => transformer_depth.push(0),
            }
        }
        if s.contains_key(&format!("{po}0.in_layers.0.weight")) {
            transformer_depth_output.push(transformer(s, &po)?.map_or(0, |t| t.0));
        }
    }
    num_res_blocks.push(last_res);
    channel_mult.push(last_mult);
    let transformer_depth_middle =
        if s.contains_key(&format!("{prefix}middle_block.1.proj_in.weight")) {
            Some(count_blocks(
                s,
                &format!("{prefix}middle_block.1.transformer_blocks."),
            ))
        } else {
            None
        };
    Ok(UnetConfig {
        in_channels,
        out_channels,
        model_channels,
        num_res_blocks,
        channel_mult,
        transformer_depth,
        transformer_depth_output,
        transformer_depth_middle,
        use_linear_in_transformer: use_linear,
        context_dim,
        adm_in_channels,
    })
}

/// The width of each size embedding in SDXL's ADM vector (ComfyUI's
/// `Timestep(256)`): the base model embeds six numbers (height, width,
/// crop top, crop left, target height, target width), the refiner five
/// (the last two replaced by the aesthetic score).
pub const ADM_EMBED: usize = 256;

/// The UNet family from its structure, the rules ComfyUI's
/// supported-model table encodes, stated so they hold at any width:
/// - no ADM input: SD1 projects in/out of its transformers with 1×1
///   convolutions, SD 2.x with linear layers;
/// - an ADM input is SDXL's pooled text vector plus size embeddings. The
///   refiner conditions on OpenCLIP-G alone, so its context width equals
///   the pooled width and its ADM is context + 5×256 (1280 + 1280); the
///   base's context is CLIP-L + G (2048) and its ADM pooled + 6×256.
fn unet_family(c: &UnetConfig) -> Result<Family, DetectError> {
    let unknown = || DetectError::UnknownUnet {
        context_dim: c.context_dim,
        model_channels: c.model_channels,
        adm: c.adm_in_channels,
    };
    let Some(context) = c.context_dim else {
        return Err(unknown());
    };
    match (c.adm_in_channels, c.use_linear_in_transformer) {
        (None, false) => Ok(Family::Sd1),
        (None, true) => Ok(Family::Sd2),
        (Some(adm), true) if adm == context + 5 * ADM_EMBED => Ok(Family::SdxlRefiner),
        (Some(adm), true) if adm > 6 * ADM_EMBED => Ok(Family::Sdxl),
        _ => Err(unknown()),
    }
}

/// Recognises DiT families by their signature keys.
fn dit_family(s: &Shapes, prefix: &str) -> Option<Family> {
    if s.contains_key(&format!(
        "{prefix}joint_blocks.0.context_block.attn.qkv.weight"
    )) {
        return Some(Family::Sd3);
    }
    if s.contains_key(&format!(
        "{prefix}double_blocks.0.img_attn.norm.key_norm.scale"
    )) {
        let chroma = has_prefix(s, &format!("{prefix}distilled_guidance_layer."));
        return Some(if chroma { Family::Chroma } else { Family::Flux });
    }
    None
}

/// `(vocab, width)` of a text encoder's token table `name`, if present.
fn embedding_table(s: &Shapes, name: &str) -> Result<Option<(usize, usize)>, DetectError> {
    match s.get(name).map(Vec::as_slice) {
        None => Ok(None),
        Some([v, w]) => Ok(Some((*v, *w))),
        Some(other) => Err(DetectError::BadShape {
            name: name.to_string(),
            shape: other.to_vec(),
            expected: "[vocab, width]",
        }),
    }
}

/// The sizes shapes show of a text transformer.
struct Tower {
    vocab: usize,
    width: usize,
    layers: usize,
    positions: usize,
    intermediate: usize,
}

/// Key names of a text transformer layout (relative to its prefix).
struct Layout {
    token_table: &'static str,
    positions: &'static str,
    layers: &'static str,
    fc1: &'static str,
}

const HF_CLIP: Layout = Layout {
    token_table: "embeddings.token_embedding.weight",
    positions: "embeddings.position_embedding.weight",
    layers: "encoder.layers.",
    fc1: "encoder.layers.0.mlp.fc1.weight",
};

const OPEN_CLIP: Layout = Layout {
    token_table: "token_embedding.weight",
    positions: "positional_embedding",
    layers: "transformer.resblocks.",
    fc1: "transformer.resblocks.0.mlp.c_fc.weight",
};

fn tower(s: &Shapes, prefix: &str, l: &Layout) -> Result<Option<Tower>, DetectError> {
    let Some((vocab, width)) = embedding_table(s, &format!("{prefix}{}", l.token_table))? else {
        return Ok(None);
    };
    let positions = dim(
        s,
        &format!("{prefix}{}", l.positions),
        0,
        "[positions, width]",
    )?;
    let intermediate = dim(s, &format!("{prefix}{}", l.fc1), 0, "[intermediate, width]")?;
    Ok(Some(Tower {
        vocab,
        width,
        layers: count_blocks(s, &format!("{prefix}{}", l.layers)),
        positions,
        intermediate,
    }))
}

/// CLIP text encoder config under `prefix` (e.g.
/// `cond_stage_model.transformer.text_model.`).
pub fn clip_config(s: &Shapes, prefix: &str) -> Result<Option<ClipConfig>, DetectError> {
    let Some(t) = tower(s, prefix, &HF_CLIP)? else {
        return Ok(None);
    };
    let projection = s
        .get(&format!(
            "{}text_projection.weight",
            super::clip::projection_prefix(prefix)
        ))
        .and_then(|sh| sh.first().copied());
    Ok(Some(ClipConfig {
        vocab: t.vocab,
        width: t.width,
        layers: t.layers,
        max_positions: t.positions,
        heads: (t.width / 64).max(1),
        intermediate: t.intermediate,
        gelu: false,
        projection,
    }))
}

/// OpenCLIP text encoder config under `prefix` (SD 2.x:
/// `cond_stage_model.model.`; SDXL: `conditioner.embedders.1.model.`).
pub fn open_clip_config(s: &Shapes, prefix: &str) -> Result<Option<OpenClipConfig>, DetectError> {
    let Some(t) = tower(s, prefix, &OPEN_CLIP)? else {
        return Ok(None);
    };
    let projection = dim(
        s,
        &format!("{prefix}text_projection"),
        1,
        "[width, projection]",
    )?;
    Ok(Some(OpenClipConfig {
        vocab: t.vocab,
        width: t.width,
        layers: t.layers,
        max_positions: t.positions,
        heads: (t.width / 64).max(1),
        intermediate: t.intermediate,
        projection,
    }))
}

/// KL-VAE config under `prefix` (e.g. `first_stage_model.`).
pub fn vae_config(s: &Shapes, prefix: &str) -> Result<Option<VaeConfig>, DetectError> {
    let conv_in = format!("{prefix}encoder.conv_in.weight");
    if !s.contains_key(&conv_in) {
        return Ok(None);
    }
    let ch = dim(s, &conv_in, 0, "[ch, in, 3, 3]")?;
    let in_channels = dim(s, &conv_in, 1, "[ch, in, 3, 3]")?;
    let levels = count_blocks(s, &format!("{prefix}encoder.down."));
    let mut ch_mult = Vec::with_capacity(levels);
    for l in 0..levels {
        let w = format!("{prefix}encoder.down.{l}.block.0.conv2.weight");
        ch_mult.push(dim(s, &w, 0, "[out, out, 3, 3]")? / ch.max(1));
    }
    let num_res_blocks = count_blocks(s, &format!("{prefix}encoder.down.0.block."));
    let z_channels = dim(
        s,
        &format!("{prefix}decoder.conv_in.weight"),
        1,
        "[ch, z_channels, 3, 3]",
    )?;
    Ok(Some(VaeConfig {
        ch,
        ch_mult,
        num_res_blocks,
        z_channels,
        in_channels,
        quant_conv: s.contains_key(&format!("{prefix}post_quant_conv.weight")),
    }))
}

/// The HF-layout CLIP under `prefix` as a text part, if present.
fn clip_part(s: &Shapes, role: TextEncoder, prefix: &str) -> Result<Option<TextPart>, DetectError> {
    Ok(clip_config(s, prefix)?.map(|c| TextPart {
        role,
        prefix: prefix.to_string(),
        arch: EncoderArch::Clip(c),
    }))
}

/// The OpenCLIP-layout encoder under `prefix` as a text part, if present.
fn open_clip_part(
    s: &Shapes,
    role: TextEncoder,
    prefix: &str,
) -> Result<Option<TextPart>, DetectError> {
    Ok(open_clip_config(s, prefix)?.map(|c| TextPart {
        role,
        prefix: prefix.to_string(),
        arch: EncoderArch::OpenClip(c),
    }))
}

fn t5_part(s: &Shapes, prefix: &str) -> Result<Option<TextPart>, DetectError> {
    Ok(super::t5::t5_config(s, prefix)?.map(|c| TextPart {
        role: TextEncoder::T5Xxl,
        prefix: prefix.to_string(),
        arch: EncoderArch::T5(c),
    }))
}

/// The text encoders of a single-file checkpoint of `family`, where each
/// family's files keep them (ComfyUI's `process_clip_state_dict`).
/// SDXL carries two; a file with only one of them is refused by name.
fn text_parts(s: &Shapes, family: Family) -> Result<Vec<TextPart>, DetectError> {
    let parts = match family {
        Family::Sd1 => vec![clip_part(
            s,
            TextEncoder::ClipL,
            "cond_stage_model.transformer.text_model.",
        )?],
        Family::Sd2 => vec![open_clip_part(
            s,
            TextEncoder::OpenClipH,
            "cond_stage_model.model.",
        )?],
        Family::Sdxl => vec![
            clip_part(
                s,
                TextEncoder::ClipL,
                "conditioner.embedders.0.transformer.text_model.",
            )?,
            open_clip_part(s, TextEncoder::OpenClipG, "conditioner.embedders.1.model.")?,
        ],
        Family::SdxlRefiner => vec![open_clip_part(
            s,
            TextEncoder::OpenClipG,
            "conditioner.embedders.0.model.",
        )?],
        // ComfyUI's saves: `text_encoders.{clip_l,clip_g,t5xxl}.transformer.`;
        // SD3 files carry any of them (T5 is often left out).
        Family::Sd3 => {
            let parts = [
                clip_part(
                    s,
                    TextEncoder::ClipL,
                    "text_encoders.clip_l.transformer.text_model.",
                )?,
                clip_part(
                    s,
                    TextEncoder::OpenClipG,
                    "text_encoders.clip_g.transformer.text_model.",
                )?,
                t5_part(s, "text_encoders.t5xxl.transformer.")?,
            ];
            return Ok(parts.into_iter().flatten().collect());
        }
        Family::Flux => vec![
            clip_part(
                s,
                TextEncoder::ClipL,
                "text_encoders.clip_l.transformer.text_model.",
            )?,
            t5_part(s, "text_encoders.t5xxl.transformer.")?,
        ],
        _ => vec![],
    };
    match (
        parts.iter().all(Option::is_some),
        parts.iter().any(Option::is_some),
    ) {
        (true, _) => Ok(parts.into_iter().flatten().collect()),
        (false, false) => Ok(Vec::new()),
        (false, true) => Err(DetectError::PartialText(family)),
    }
}

/// The diffusion model under `prefix`: its family (refused by name when
/// sdkit cannot build it) and config.
fn diffusion_model(s: &Shapes, prefix: &str) -> Result<(Family, Net), DetectError> {
    match dit_family(s, prefix) {
        Some(f @ (Family::Flux | Family::Chroma)) => {
            return Ok((f, Net::Flux(super::flux::flux_config(s, prefix)?)));
        }
        Some(Family::Sd3) => {
            return Ok((
                Family::Sd3,
                Net::Mmdit(super::mmdit::mmdit_config(s, prefix)?),
            ));
        }
        Some(f) => return Err(DetectError::Unsupported(f)),
        None => {}
    }
    let unet = unet_config(s, prefix)?;
    let family = unet_family(&unet)?;
    if !family.supported() {
        return Err(DetectError::Unsupported(family));
    }
    Ok((family, Net::Unet(unet)))
}

/// Detects a single-file checkpoint in the original (ldm) layout.
///
/// Unsupported families are recognised and refused by name.
pub fn detect_checkpoint(s: &Shapes) -> Result<Detected, DetectError> {
    let (family, net) = diffusion_model(s, "model.diffusion_model.")?;
    Ok(Detected {
        family,
        heads: family.spec().heads,
        text: text_parts(s, family)?,
        vae: match vae_config(s, VAE_PREFIXES[0])? {
            Some(v) => Some(v),
            None => vae_config(s, VAE_PREFIXES[1])?,
        },
        net,
    })
}

/// Where single-file checkpoints keep the VAE: SD's `first_stage_model.`,
/// or `vae.` (ComfyUI's saves of Flux, SD3 and later families).
pub const VAE_PREFIXES: [&str; 2] = ["first_stage_model.", "vae."];

/// The prefix the VAE of a checkpoint with these shapes is under.
pub fn vae_prefix(s: &Shapes) -> &'static str {
    if has_prefix(s, VAE_PREFIXES[0]) {
        VAE_PREFIXES[0]
    } else if has_prefix(s, VAE_PREFIXES[1]) {
        VAE_PREFIXES[1]
    } else {
        VAE_PREFIXES[0]
    }
}

/// Detects a diffusion-model-only file (UNETLoader): the UNet's keys with
/// no prefix, or under `model.diffusion_model.` as some tools save them.
/// Returns the prefix found.
pub fn detect_unet(s: &Shapes) -> Result<(Family, Net, Heads, &'static str), DetectError> {
    let prefix = if has_prefix(s, "model.diffusion_model.") {
        "model.diffusion_model."
    } else {
        ""
    };
    let (family, unet) = diffusion_model(s, prefix)?;
    Ok((family, unet, family.spec().heads, prefix))
}

/// The one text encoder of a standalone file: HF layout under
/// `text_model.` (with `text_projection.weight` beside it), OpenCLIP's
/// at the top level, or T5's (by its gated feed-forward's `wi_1`, whatever
/// its width). The CLIP role is ComfyUI's `detect_te_model` rule: 31 or
/// more layers is OpenCLIP-G, 23 or more OpenCLIP-H, fewer CLIP-L.
pub fn detect_text_encoder(s: &Shapes) -> Result<Option<TextPart>, DetectError> {
    if let Some(c) = super::t5::t5_config(s, "")? {
        return Ok(Some(TextPart {
            role: TextEncoder::T5Xxl,
            prefix: String::new(),
            arch: EncoderArch::T5(c),
        }));
    }
    let role = |layers: usize| match layers {
        31.. => TextEncoder::OpenClipG,
        23.. => TextEncoder::OpenClipH,
        _ => TextEncoder::ClipL,
    };
    if let Some(c) = clip_config(s, "text_model.")? {
        return Ok(Some(TextPart {
            role: role(c.layers),
            prefix: "text_model.".to_string(),
            arch: EncoderArch::Clip(c),
        }));
    }
    if let Some(c) = open_clip_config(s, "")? {
        return Ok(Some(TextPart {
            role: role(c.layers),
            prefix: String::new(),
            arch: EncoderArch::OpenClip(c),
        }));
    }
    Ok(None)
}
