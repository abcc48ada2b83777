//! Which model tensor an adapter's key names, as ComfyUI's
//! `model_lora_keys_unet` / `model_lora_keys_clip` map them: kohya names
//! (`lora_unet_*` in the ldm and in the diffusers spelling, `lora_te_*`,
//! `lora_te1_`/`lora_te2_` for SDXL's two encoders), diffusers/PEFT names
//! (`unet.down_blocks….processor.to_q`, `text_encoder.text_model.…`) and
//! the generic spelling of the model's own names.

use crate::models::detect::{EncoderArch, UnetConfig};
use crate::models::family::TextEncoder;
use std::collections::HashMap;

/// A tensor an adapter patches: its name in the model's weight store and,
/// for OpenCLIP's fused `in_proj_weight`, the rows of q, k or v.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    pub tensor: String,
    pub rows: Option<(usize, usize)>,
    /// The layer's two row halves go to the tensor's other halves
    /// (diffusers' Flux `norm_out`: scale and shift stored the other way
    /// round; ComfyUI's `swap_scale_shift`).
    pub swap_halves: bool,
}

impl Target {
    pub(crate) fn whole(tensor: String) -> Self {
        Target {
            tensor,
            rows: None,
            swap_halves: false,
        }
    }

    pub(crate) fn rows(tensor: String, start: usize, end: usize) -> Self {
        Target {
            tensor,
            rows: Some((start, end)),
            swap_halves: false,
        }
    }
}

const RESNET: [(&str, &str); 6] = [
    ("in_layers.2", "conv1"),
    ("emb_layers.1", "time_emb_proj"),
    ("out_layers.3", "conv2"),
    ("skip_connection", "conv_shortcut"),
    ("in_layers.0", "norm1"),
    ("out_layers.0", "norm2"),
];

const ATTENTIONS: [&str; 3] = ["proj_in", "proj_out", "norm"];

const TRANSFORMER: [&str; 11] = [
    "norm1",
    "norm2",
    "norm3",
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
];

const FF: [&str; 2] = ["ff.net.0.proj", "ff.net.2"];

const BASIC: [(&str, &str); 9] = [
    ("label_emb.0.0", "class_embedding.linear_1"),
    ("label_emb.0.2", "class_embedding.linear_2"),
    ("label_emb.0.0", "add_embedding.linear_1"),
    ("label_emb.0.2", "add_embedding.linear_2"),
    ("input_blocks.0.0", "conv_in"),
    ("out.0", "conv_norm_out"),
    ("out.2", "conv_out"),
    ("time_embed.0", "time_embedding.linear_1"),
    ("time_embed.2", "time_embedding.linear_2"),
];

/// ComfyUI's `unet_to_diffusers` for the layers (weight names without
/// `.weight`): diffusers name → ldm name.
pub fn unet_to_diffusers(cfg: &UnetConfig) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let resnet = |out: &mut Vec<(String, String)>, d: String, l: String| {
        for (ldm, dif) in RESNET {
            out.push((format!("{d}.{dif}"), format!("{l}.{ldm}")));
        }
    };
    let attention = |out: &mut Vec<(String, String)>, d: String, l: String, depth: usize| {
        for a in ATTENTIONS {
            out.push((format!("{d}.{a}"), format!("{l}.{a}")));
        }
        for t in 0..depth {
            for b in TRANSFORMER.iter().chain(&FF) {
                out.push((
                    format!("{d}.transformer_blocks.{t}.{b}"),
                    format!("{l}.transformer_blocks.{t}.{b}"),
                ));
            }
        }
    };
    let levels = cfg.channel_mult.len();
    let mut depth = cfg.transformer_depth.iter().copied();
    for x in 0..levels {
        let nres = cfg.num_res_blocks.get(x).copied().unwrap_or(0);
        let mut n = 1 + (nres + 1) * x;
        for i in 0..nres {
            resnet(
                &mut out,
                format!("down_blocks.{x}.resnets.{i}"),
                format!("input_blocks.{n}.0"),
            );
            let d = depth.next().unwrap_or(0);
            if d > 0 {
                attention(
                    &mut out,
                    format!("down_blocks.{x}.attentions.{i}"),
                    format!("input_blocks.{n}.1"),
                    d,
                );
            }
            n += 1;
        }
        out.push((
            format!("down_blocks.{x}.downsamplers.0.conv"),
            format!("input_blocks.{n}.0.op"),
        ));
    }
    if let Some(d) = cfg.transformer_depth_middle {
        attention(
            &mut out,
            "mid_block.attentions.0".into(),
            "middle_block.1".into(),
            d,
        );
    }
    for (i, n) in [0, 2].into_iter().enumerate() {
        resnet(
            &mut out,
            format!("mid_block.resnets.{i}"),
            format!("middle_block.{n}"),
        );
    }
    let mut depth_out: Vec<usize> = cfg.transformer_depth_output.clone();
    for x in 0..levels {
        let nres = cfg.num_res_blocks.get(levels - 1 - x).copied().unwrap_or(0);
        let l = nres + 1;
        for (i, n) in (l * x..l * (x + 1)).enumerate() {
            let mut c = 1;
            resnet(
                &mut out,
                format!("up_blocks.{x}.resnets.{i}"),
                format!("output_blocks.{n}.0"),
            );
            let d = depth_out.pop().unwrap_or(0);
            if d > 0 {
                c += 1;
                attention(
                    &mut out,
                    format!("up_blocks.{x}.attentions.{i}"),
                    format!("output_blocks.{n}.1"),
                    d,
                );
            }
            if i == l - 1 {
                out.push((
                    format!("up_blocks.{x}.upsamplers.0.conv"),
                    format!("output_blocks.{n}.{c}.conv"),
                ));
            }
        }
    }
    for (ldm, dif) in BASIC {
        out.push((dif.to_string(), ldm.to_string()));
    }
    out
}

/// Adapter key → UNet tensor, for a UNet whose weights are `{prefix}{ldm}`
/// (`weights`: every weight name under the prefix, with `.weight`).
pub fn unet_keys<'a>(
    cfg: &UnetConfig,
    prefix: &str,
    weights: impl Iterator<Item = &'a str>,
) -> HashMap<String, Target> {
    let mut map = HashMap::new();
    let mut present = std::collections::HashSet::new();
    for w in weights {
        present.insert(w.to_string());
        let Some(ldm) = w
            .strip_prefix(prefix)
            .and_then(|r| r.strip_suffix(".weight"))
        else {
            continue;
        };
        let t = Target::whole(w.to_string());
        map.insert(format!("lora_unet_{}", ldm.replace('.', "_")), t.clone());
        // The generic spelling: ComfyUI's own name without `.weight`.
        map.insert(format!("diffusion_model.{ldm}"), t);
    }
    for (dif, ldm) in unet_to_diffusers(cfg) {
        let tensor = format!("{prefix}{ldm}.weight");
        if !present.contains(&tensor) {
            // Layers the config names that this UNet lacks (the last
            // level's downsampler).
            continue;
        }
        let t = Target::whole(tensor);
        let flat = dif.replace('.', "_");
        map.insert(format!("lora_unet_{flat}"), t.clone());
        map.insert(format!("lycoris_{flat}"), t.clone());
        let mut peft = dif.replace(".to_", ".processor.to_");
        if let Some(s) = peft.strip_suffix(".to_out.0") {
            peft = format!("{s}.to_out");
        }
        map.insert(format!("unet.{peft}"), t.clone());
        map.insert(peft, t);
    }
    map
}

/// ComfyUI's `LORA_CLIP_MAP`: HF layer name → kohya suffix.
const CLIP_LAYERS: [(&str, &str); 6] = [
    ("mlp.fc1", "mlp_fc1"),
    ("mlp.fc2", "mlp_fc2"),
    ("self_attn.k_proj", "self_attn_k_proj"),
    ("self_attn.q_proj", "self_attn_q_proj"),
    ("self_attn.v_proj", "self_attn_v_proj"),
    ("self_attn.out_proj", "self_attn_out_proj"),
];

/// The tensor (and rows) of HF layer `layer` of encoder layer `b`.
fn encoder_target(prefix: &str, arch: &EncoderArch, b: usize, layer: &str) -> Option<Target> {
    match arch {
        // T5 LoRA keys are not mapped yet: such a LoRA's T5 part is
        // reported unused, as any key that matches nothing.
        EncoderArch::T5(_) => None,
        EncoderArch::Clip(c) => (b < c.layers)
            .then(|| Target::whole(format!("{prefix}encoder.layers.{b}.{layer}.weight"))),
        EncoderArch::OpenClip(c) => {
            if b >= c.layers {
                return None;
            }
            let w = c.width;
            let p = format!("{prefix}transformer.resblocks.{b}.");
            let fused =
                |i: usize| Target::rows(format!("{p}attn.in_proj_weight"), i * w, (i + 1) * w);
            Some(match layer {
                "self_attn.q_proj" => fused(0),
                "self_attn.k_proj" => fused(1),
                "self_attn.v_proj" => fused(2),
                "self_attn.out_proj" => Target::whole(format!("{p}attn.out_proj.weight")),
                "mlp.fc1" => Target::whole(format!("{p}mlp.c_fc.weight")),
                _ => Target::whole(format!("{p}mlp.c_proj.weight")),
            })
        }
    }
}

/// Adapter key → (encoder index, tensor) for a CLIP's encoders, by
/// ComfyUI's rules: `lora_te_` is CLIP-L (or H, or G where G is alone),
/// `lora_te1_` L or H, `lora_te2_` G beside an L; diffusers'
/// `text_encoder.` / `text_encoder_2.` likewise. Layers 0–31, as ComfyUI
/// scans.
pub fn clip_keys(
    encoders: &[(TextEncoder, &str, &EncoderArch)],
) -> HashMap<String, (usize, Target)> {
    let mut map = HashMap::new();
    let has_l = encoders.iter().any(|e| e.0 == TextEncoder::ClipL);
    for b in 0..32 {
        for (hf, kohya) in CLIP_LAYERS {
            for (i, &(role, prefix, arch)) in encoders.iter().enumerate() {
                let Some(t) = encoder_target(prefix, arch, b, hf) else {
                    continue;
                };
                let names: &[&str] = match role {
                    TextEncoder::ClipL | TextEncoder::OpenClipH => {
                        &["lora_te_", "lora_te1_", "text_encoder."]
                    }
                    TextEncoder::OpenClipG if has_l => &["lora_te2_", "text_encoder_2."],
                    TextEncoder::OpenClipG => &["lora_te_", "text_encoder.", "lora_prior_te_"],
                    TextEncoder::T5Xxl => &[],
                };
                for n in names {
                    let key = if n.ends_with('.') {
                        format!("{n}text_model.encoder.layers.{b}.{hf}")
                    } else {
                        format!("{n}text_model_encoder_layers_{b}_{kohya}")
                    };
                    map.insert(key, (i, t.clone()));
                }
            }
        }
    }
    // The text projections of HF-layout encoders (`lora_te1_text_projection`
    // …; ComfyUI's map also takes them where the family reads no
    // projected output).
    for (i, &(role, prefix, arch)) in encoders.iter().enumerate() {
        let EncoderArch::Clip(c) = arch else {
            continue;
        };
        if c.projection.is_none() {
            continue;
        }
        let t = Target::whole(format!(
            "{}text_projection.weight",
            crate::models::clip::projection_prefix(prefix)
        ));
        let names: &[&str] = match role {
            TextEncoder::ClipL => &["lora_te1_text_projection"],
            TextEncoder::OpenClipG if has_l => &["lora_te2_text_projection"],
            TextEncoder::OpenClipG => &["lora_prior_te_text_projection"],
            _ => &[],
        };
        for n in names {
            map.insert(n.to_string(), (i, t.clone()));
        }
    }
    map
}

/// The names every transformer's weights take (ComfyUI's generic map):
/// kohya `lora_unet_{name with _}` and `diffusion_model.{name}`; with the
/// set of weight names, for the family maps to check against.
fn generic_keys<'a>(
    prefix: &str,
    weights: impl Iterator<Item = &'a str>,
) -> (HashMap<String, Target>, std::collections::HashSet<String>) {
    let mut map = HashMap::new();
    let mut present = std::collections::HashSet::new();
    for w in weights {
        present.insert(w.to_string());
        let Some(name) = w
            .strip_prefix(prefix)
            .and_then(|r| r.strip_suffix(".weight"))
        else {
            continue;
        };
        let t = Target::whole(w.to_string());
        map.insert(format!("lora_unet_{}", name.replace('.', "_")), t.clone());
        map.insert(format!("diffusion_model.{name}"), t);
    }
    (map, present)
}

/// ComfyUI's diffusers names of a Flux double block's layers (`attn.to_q`
/// … are rows of the fused qkv, listed apart) → the model's.
pub(crate) const FLUX_DOUBLE: [(&str, &str); 8] = [
    ("attn.to_out.0", "img_attn.proj"),
    ("norm1.linear", "img_mod.lin"),
    ("norm1_context.linear", "txt_mod.lin"),
    ("attn.to_add_out", "txt_attn.proj"),
    ("ff.net.0.proj", "img_mlp.0"),
    ("ff.net.2", "img_mlp.2"),
    ("ff_context.net.0.proj", "txt_mlp.0"),
    ("ff_context.net.2", "txt_mlp.2"),
];

/// The same for the layers outside the blocks (`norm_out` is mapped
/// apart: its halves are swapped).
pub(crate) const FLUX_BASIC: [(&str, &str); 9] = [
    ("proj_out", "final_layer.linear"),
    ("x_embedder", "img_in"),
    (
        "time_text_embed.timestep_embedder.linear_1",
        "time_in.in_layer",
    ),
    (
        "time_text_embed.timestep_embedder.linear_2",
        "time_in.out_layer",
    ),
    ("context_embedder", "txt_in"),
    (
        "time_text_embed.text_embedder.linear_1",
        "vector_in.in_layer",
    ),
    (
        "time_text_embed.text_embedder.linear_2",
        "vector_in.out_layer",
    ),
    (
        "time_text_embed.guidance_embedder.linear_1",
        "guidance_in.in_layer",
    ),
    (
        "time_text_embed.guidance_embedder.linear_2",
        "guidance_in.out_layer",
    ),
];

/// Adapter key → Flux (or Chroma) tensor, for a model whose weights are
/// `{prefix}{name}` (`weights`: every weight name, with `.weight`), as
/// ComfyUI's `model_lora_keys_unet` maps them: kohya `lora_unet_*` and the
/// generic `diffusion_model.*` spelling of every weight; diffusers names
/// (`transformer.transformer_blocks.N.attn.to_q`, … with the `lycoris_`
/// and OneTrainer `lora_transformer_` spellings of the same) through
/// `flux_to_diffusers`, q, k, v (and a single block's `proj_mlp`) as row
/// ranges of the fused projections; `….linear1_qkv` as linear1's q/k/v
/// rows; diffusers' `norm_out.linear` to the final adaLN with its scale
/// and shift halves swapped back.
pub fn flux_keys<'a>(
    hidden: usize,
    mlp: usize,
    prefix: &str,
    weights: impl Iterator<Item = &'a str>,
) -> HashMap<String, Target> {
    let (mut map, present) = generic_keys(prefix, weights);
    for w in &present {
        let linear1 = w
            .strip_prefix(prefix)
            .and_then(|r| r.strip_suffix(".linear1.weight"));
        if let Some(block) = linear1 {
            map.insert(
                format!("diffusion_model.{block}.linear1_qkv"),
                Target::rows(w.clone(), 0, 3 * hidden),
            );
        }
    }
    let mut diffusers: Vec<(String, Target)> = Vec::new();
    let mut add = |dif: String, model: String, rows: Option<(usize, usize)>| {
        let tensor = format!("{prefix}{model}.weight");
        if present.contains(&tensor) {
            let mut t = Target::whole(tensor);
            t.rows = rows;
            diffusers.push((dif, t));
        }
    };
    let qkv = [("q", 0), ("k", 1), ("v", 2)];
    for i in 0.. {
        let (from, to) = (
            format!("transformer_blocks.{i}"),
            format!("double_blocks.{i}"),
        );
        if !present.contains(&format!("{prefix}{to}.img_attn.qkv.weight")) {
            break;
        }
        for (p, j) in qkv {
            let rows = Some((j * hidden, (j + 1) * hidden));
            add(
                format!("{from}.attn.to_{p}"),
                format!("{to}.img_attn.qkv"),
                rows,
            );
            add(
                format!("{from}.attn.add_{p}_proj"),
                format!("{to}.txt_attn.qkv"),
                rows,
            );
        }
        for (d, m) in FLUX_DOUBLE {
            add(format!("{from}.{d}"), format!("{to}.{m}"), None);
        }
    }
    for i in 0.. {
        let (from, to) = (
            format!("single_transformer_blocks.{i}"),
            format!("single_blocks.{i}"),
        );
        if !present.contains(&format!("{prefix}{to}.linear1.weight")) {
            break;
        }
        for (p, j) in qkv {
            let rows = Some((j * hidden, (j + 1) * hidden));
            add(format!("{from}.attn.to_{p}"), format!("{to}.linear1"), rows);
        }
        add(
            format!("{from}.proj_mlp"),
            format!("{to}.linear1"),
            Some((3 * hidden, 3 * hidden + mlp)),
        );
        add(
            format!("{from}.norm.linear"),
            format!("{to}.modulation.lin"),
            None,
        );
        add(format!("{from}.proj_out"), format!("{to}.linear2"), None);
    }
    for (d, m) in FLUX_BASIC {
        add(d.to_string(), m.to_string(), None);
    }
    let adaln = format!("{prefix}final_layer.adaLN_modulation.1.weight");
    if present.contains(&adaln) {
        let mut t = Target::whole(adaln);
        t.swap_halves = true;
        diffusers.push(("norm_out.linear".to_string(), t));
    }
    for (dif, t) in diffusers {
        let flat = dif.replace('.', "_");
        map.insert(format!("transformer.{dif}"), t.clone());
        map.insert(format!("lycoris_{flat}"), t.clone());
        map.insert(format!("lora_transformer_{flat}"), t);
    }
    map
}

/// ComfyUI's `MMDIT_MAP_BLOCK` (weights): model layer → diffusers name.
const MMDIT_BLOCK: [(&str, &str); 9] = [
    ("context_block.adaLN_modulation.1", "norm1_context.linear"),
    ("context_block.attn.proj", "attn.to_add_out"),
    ("context_block.mlp.fc1", "ff_context.net.0.proj"),
    ("context_block.mlp.fc2", "ff_context.net.2"),
    ("x_block.adaLN_modulation.1", "norm1.linear"),
    ("x_block.attn.proj", "attn.to_out.0"),
    ("x_block.attn2.proj", "attn2.to_out.0"),
    ("x_block.mlp.fc1", "ff.net.0.proj"),
    ("x_block.mlp.fc2", "ff.net.2"),
];

/// `MMDIT_MAP_BASIC` (weights; `norm_out` is mapped apart, swapped).
const MMDIT_BASIC: [(&str, &str); 6] = [
    ("context_embedder", "context_embedder"),
    (
        "t_embedder.mlp.0",
        "time_text_embed.timestep_embedder.linear_1",
    ),
    (
        "t_embedder.mlp.2",
        "time_text_embed.timestep_embedder.linear_2",
    ),
    ("x_embedder.proj", "pos_embed.proj"),
    ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
    ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
];

/// Adapter key → SD3 MMDiT tensor, as ComfyUI's `model_lora_keys_unet`
/// maps them: kohya `lora_unet_*` and `diffusion_model.*` for every
/// weight; diffusers names (with the `transformer.`, `base_model.model.`,
/// OneTrainer `lora_transformer_` and `lycoris_` spellings) through
/// `mmdit_to_diffusers`: q, k, v as rows of the fused projections,
/// `norm_out` and the last block's pre-only `norm1_context` with their
/// (shift, scale) halves swapped.
pub fn mmdit_keys<'a>(
    hidden: usize,
    prefix: &str,
    weights: impl Iterator<Item = &'a str>,
) -> HashMap<String, Target> {
    let (mut map, present) = generic_keys(prefix, weights);
    let mut diffusers: Vec<(String, Target)> = Vec::new();
    let mut add = |dif: String, model: String, rows: Option<(usize, usize)>, swap: bool| {
        let tensor = format!("{prefix}{model}.weight");
        if present.contains(&tensor) {
            let mut t = Target::whole(tensor);
            t.rows = rows;
            t.swap_halves = swap;
            diffusers.push((dif, t));
        }
    };
    // ComfyUI takes the last block from the hidden width (depth = hidden
    // / 64), which is the last block of every real SD3.
    let last = (hidden / 64).saturating_sub(1);
    for i in 0.. {
        let (from, to) = (
            format!("transformer_blocks.{i}"),
            format!("joint_blocks.{i}"),
        );
        if !present.contains(&format!("{prefix}{to}.x_block.attn.qkv.weight")) {
            break;
        }
        for (p, j) in [("q", 0), ("k", 1), ("v", 2)] {
            let rows = Some((j * hidden, (j + 1) * hidden));
            add(
                format!("{from}.attn.to_{p}"),
                format!("{to}.x_block.attn.qkv"),
                rows,
                false,
            );
            add(
                format!("{from}.attn.add_{p}_proj"),
                format!("{to}.context_block.attn.qkv"),
                rows,
                false,
            );
            add(
                format!("{from}.attn2.to_{p}"),
                format!("{to}.x_block.attn2.qkv"),
                rows,
                false,
            );
        }
        for (m, d) in MMDIT_BLOCK {
            let swap = i == last && d == "norm1_context.linear";
            add(format!("{from}.{d}"), format!("{to}.{m}"), None, swap);
        }
    }
    for (m, d) in MMDIT_BASIC {
        add(d.to_string(), m.to_string(), None, false);
    }
    add(
        "proj_out".to_string(),
        "final_layer.linear".to_string(),
        None,
        false,
    );
    add(
        "norm_out.linear".to_string(),
        "final_layer.adaLN_modulation.1".to_string(),
        None,
        true,
    );
    for (dif, t) in diffusers {
        let flat = dif.replace('.', "_");
        map.insert(format!("transformer.{dif}"), t.clone());
        map.insert(format!("base_model.model.{dif}"), t.clone());
        map.insert(format!("lora_transformer_{flat}"), t.clone());
        map.insert(format!("lycoris_{flat}"), t);
    }
    map
}
