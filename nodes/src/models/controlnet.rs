//! ControlNet (ComfyUI's `comfy/cldm/cldm.py`) in the ldm layout of the
//! `control_v11*` files (diffusers-format files are renamed to it,
//! [`diffusers_names`]): the UNet's first half (time and ADM embedding,
//! input blocks, middle block; [`super::unet::encode`]) whose input block
//! 0 also gets the hint image through `input_hint_block` (eight 3×3
//! convolutions, SiLU between them, strides of 2 at sequence indices 4, 8
//! and 12: the hint is 8× the latent), a 1×1 `zero_convs.N.0` on every
//! input block's output and `middle_block_out.0` on the middle's.

use super::detect::{unet_config, DetectError, Heads, Shapes, UnetConfig};
use super::unet::{encode, timestep_embedding};
use crate::adapters::keys::unet_to_diffusers;
use sdkit_compute::tensor::{GraphBuilder, Scope, ShapeError, T};
use std::collections::HashMap;

/// A ControlNet's sizes, inferred from its tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlNetConfig {
    /// The encoder half (no output blocks).
    pub unet: UnetConfig,
    /// The hint convolutions `(index, in, out)` in order.
    pub hint_convs: Vec<(usize, usize, usize)>,
    /// A union ControlNet's number of control types (`task_embedding`
    /// rows), None for a plain one.
    pub union_types: Option<usize>,
}

/// A union ControlNet's fixed widths (ComfyUI's cldm.py: one transformer
/// layer of 320 channels and 8 heads; a 256-wide embedding per type).
const UNION_WIDTH: usize = 320;
const UNION_TYPE_EMBED: usize = 256;

impl ControlNetConfig {
    /// Channels of the hint image (3 for RGB control images).
    pub fn hint_channels(&self) -> usize {
        self.hint_convs.first().map_or(3, |c| c.1)
    }
}

/// Reads the config of a ldm-layout ControlNet under `prefix`.
pub fn controlnet_config(s: &Shapes, prefix: &str) -> Result<ControlNetConfig, DetectError> {
    let unet = unet_config(s, prefix)?;
    let mut hint_convs = Vec::new();
    for i in (0..32).step_by(2) {
        match s.get(&format!("{prefix}input_hint_block.{i}.weight")) {
            Some(sh) if sh.len() == 4 => hint_convs.push((i, sh[1], sh[0])),
            Some(sh) => {
                return Err(DetectError::BadShape {
                    name: format!("{prefix}input_hint_block.{i}.weight"),
                    shape: sh.clone(),
                    expected: "[out, in, 3, 3]",
                })
            }
            None => break,
        }
    }
    if hint_convs.is_empty() {
        return Err(DetectError::NoModel {
            prefix: format!("{prefix}input_hint_block."),
        });
    }
    let union_types = s
        .get(&format!("{prefix}task_embedding"))
        .and_then(|v| v.first().copied());
    Ok(ControlNetConfig {
        unet,
        hint_convs,
        union_types,
    })
}

/// `union_controlnet_merge` for one control type `t`: the hint's
/// features `cond` `[b, 320, h, w]` averaged over space, plus the type's
/// `task_embedding` row, through one transformer layer (with a single
/// token, attention is exactly `out_proj(v)`: the softmax of one score is
/// 1), projected by `spatial_ch_projs` and added to `cond` everywhere.
fn union_merge<'a>(vb: &Scope<'a>, cond: T<'a>, t: usize, n: usize) -> Result<T<'a>, ShapeError> {
    let c = UNION_WIDTH;
    let b = cond.shape()[0];
    let task = vb.get("task_embedding", &[n, c])?.slice(0, t, t + 1)?;
    let x = cond.mean(&[2, 3], false)?.add(task)?;
    let tl = vb.pp("transformer_layes.0");
    let ln1 = tl.pp("ln_1").layer_norm(x, c, 1e-5)?;
    let qkv = tl.pp("attn.in_proj").linear(ln1, c, 3 * c)?;
    let v = qkv.slice(1, 2 * c, 3 * c)?;
    let x = x.add(tl.pp("attn.out_proj").linear(v, c, c)?)?;
    let ln2 = tl.pp("ln_2").layer_norm(x, c, 1e-5)?;
    let m = tl.pp("mlp.c_fc").linear(ln2, c, 4 * c)?.quick_gelu();
    let x = x.add(tl.pp("mlp.c_proj").linear(m, 4 * c, c)?)?;
    let alpha = vb
        .pp("spatial_ch_projs")
        .linear(x, c, c)?
        .reshape(&[b, c, 1, 1])?;
    cond.add(alpha)
}

/// The ControlNet's residuals for `x` `[b, in, h, w]`, `hint` `[1 or b,
/// hint_channels, 8h, 8w]`: one per input block (the UNet adds them to
/// its skips) and one for the middle block.
#[allow(clippy::too_many_arguments)]
pub fn controlnet<'a>(
    g: &'a GraphBuilder,
    cfg: &ControlNetConfig,
    heads: Heads,
    prefix: &str,
    x: T<'a>,
    timesteps: T<'a>,
    context: T<'a>,
    y: Option<T<'a>>,
    hint: T<'a>,
    control_type: Option<&[usize]>,
) -> Result<(Vec<T<'a>>, T<'a>), ShapeError> {
    let vb = Scope::new(g, prefix);
    let hb = vb.pp("input_hint_block");
    let mut h = hint;
    let last = cfg.hint_convs.len() - 1;
    for (k, &(i, cin, cout)) in cfg.hint_convs.iter().enumerate() {
        let stride = if matches!(i, 4 | 8 | 12) { 2 } else { 1 };
        h = hb.pp(i).conv2d(h, cin, cout, 3, stride)?;
        if k != last {
            h = h.silu();
        }
    }
    // A union net: the control types' embedding joins the time embedding,
    // and a chosen type reweights the hint's features (`union_merge`).
    let mut type_emb = None;
    if let (Some(n), Some(types)) = (cfg.union_types, control_type) {
        let ted = 4 * cfg.unet.model_channels;
        let onehot = g.input("control_type", &[n])?;
        let e =
            timestep_embedding(g, onehot, UNION_TYPE_EMBED)?.reshape(&[1, n * UNION_TYPE_EMBED])?;
        let ce = vb.pp("control_add_embedding");
        let e = ce
            .pp("linear_1")
            .linear(e, n * UNION_TYPE_EMBED, ted)?
            .silu();
        type_emb = Some(ce.pp("linear_2").linear(e, ted, ted)?);
        if let Some(&t) = types.first() {
            h = union_merge(&vb, h, t, n)?;
        }
    }
    let enc = encode(
        g,
        &cfg.unet,
        heads,
        &vb,
        x,
        timesteps,
        context,
        y,
        Some(h),
        &[],
        type_emb,
    )?;
    let zc = vb.pp("zero_convs");
    let outs = enc
        .skips
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let c = s.shape()[1];
            zc.pp(i).pp(0).conv2d(s, c, c, 1, 1)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let c = enc.channels;
    let mid = vb.pp("middle_block_out.0").conv2d(enc.middle, c, c, 1, 1)?;
    Ok((outs, mid))
}

/// A diffusers-format ControlNet's config, read from its layout
/// (ComfyUI matches a table of known configs; the same numbers follow
/// from the shapes): `conv_in` gives the width and input channels, each
/// `down_blocks.N` a level (its resnets, their output width, their
/// attention depths), `mid_block.attentions.0` the middle's depth,
/// `add_embedding` SDXL's ADM input.
pub fn diffusers_config(s: &Shapes) -> Result<UnetConfig, DetectError> {
    let get = |k: &str| -> Result<&Vec<usize>, DetectError> {
        s.get(k).ok_or_else(|| DetectError::NoModel {
            prefix: k.to_string(),
        })
    };
    let conv_in = get("conv_in.weight")?;
    let (model_channels, in_channels) = match conv_in.as_slice() {
        [m, i, _, _] => (*m, *i),
        other => {
            return Err(DetectError::BadShape {
                name: "conv_in.weight".into(),
                shape: other.to_vec(),
                expected: "[model_channels, in, 3, 3]",
            })
        }
    };
    let count = |prefix: &str| {
        (0..)
            .take_while(|i| s.keys().any(|k| k.starts_with(&format!("{prefix}{i}."))))
            .count()
    };
    let levels = count("down_blocks.");
    let mut num_res_blocks = Vec::new();
    let mut channel_mult = Vec::new();
    let mut transformer_depth = Vec::new();
    let mut context_dim = None;
    let mut use_linear = false;
    for l in 0..levels {
        let n = count(&format!("down_blocks.{l}.resnets."));
        num_res_blocks.push(n);
        let out = get(&format!("down_blocks.{l}.resnets.0.conv2.weight"))?;
        channel_mult.push(out.first().copied().unwrap_or(0) / model_channels.max(1));
        for r in 0..n {
            let a = format!("down_blocks.{l}.attentions.{r}.");
            let depth = count(&format!("{a}transformer_blocks."));
            transformer_depth.push(depth);
            if depth > 0 && context_dim.is_none() {
                context_dim = s
                    .get(&format!("{a}transformer_blocks.0.attn2.to_k.weight"))
                    .and_then(|v| v.get(1).copied());
                use_linear = s
                    .get(&format!("{a}proj_in.weight"))
                    .is_some_and(|v| v.len() == 2);
            }
        }
    }
    let middle = count("mid_block.attentions.0.transformer_blocks.");
    // The output half mirrors the input (a ControlNet has none; the key
    // map still lists it).
    let mut transformer_depth_output = Vec::new();
    let mut it = transformer_depth.iter();
    for &n in &num_res_blocks {
        let d: Vec<usize> = it.by_ref().take(n).copied().collect();
        let last = d.last().copied().unwrap_or(0);
        transformer_depth_output.extend(d);
        transformer_depth_output.push(last);
    }
    Ok(UnetConfig {
        in_channels,
        out_channels: in_channels,
        model_channels,
        num_res_blocks,
        channel_mult,
        transformer_depth,
        transformer_depth_output,
        transformer_depth_middle: (middle > 0).then_some(middle),
        use_linear_in_transformer: use_linear,
        context_dim,
        adm_in_channels: s
            .get("add_embedding.linear_1.weight")
            .and_then(|v| v.get(1).copied()),
    })
}

/// ComfyUI's renaming of a diffusers ControlNet to the ldm layout:
/// `unet_to_diffusers` for the UNet half, `controlnet_down_blocks.N` →
/// `zero_convs.N.0`, `controlnet_mid_block` → `middle_block_out.0`, and
/// the conditioning embedding's `conv_in`, `blocks.N`, `conv_out` →
/// `input_hint_block.{0, 2N + 2, last}`.
pub fn diffusers_names(cfg: &UnetConfig, s: &Shapes) -> HashMap<String, String> {
    let mut map = HashMap::new();
    let mut layer = |d: String, l: String| {
        for suffix in [".weight", ".bias"] {
            map.insert(format!("{d}{suffix}"), format!("{l}{suffix}"));
        }
    };
    for (d, l) in unet_to_diffusers(cfg) {
        layer(d, l);
    }
    layer("controlnet_mid_block".into(), "middle_block_out.0".into());
    let mut i = 0;
    while s.contains_key(&format!("controlnet_down_blocks.{i}.weight")) {
        layer(
            format!("controlnet_down_blocks.{i}"),
            format!("zero_convs.{i}.0"),
        );
        i += 1;
    }
    layer(
        "controlnet_cond_embedding.conv_in".into(),
        "input_hint_block.0".into(),
    );
    let mut n = 0;
    while s.contains_key(&format!("controlnet_cond_embedding.blocks.{n}.weight")) {
        layer(
            format!("controlnet_cond_embedding.blocks.{n}"),
            format!("input_hint_block.{}", 2 * n + 2),
        );
        n += 1;
    }
    layer(
        "controlnet_cond_embedding.conv_out".into(),
        format!("input_hint_block.{}", 2 * n + 2),
    );
    map
}
