//! CLIP-vision image encoders in the HF layout (`vision_model.*`) as
//! ComfyUI's `comfy/clip_model.py` `CLIPVision` runs them: OpenAI's and
//! OpenCLIP's ViTs (a class token, `pre_layrnorm`, the pooled class token
//! through `post_layernorm` and `visual_projection`) and SigLIP (no class
//! token, a biased patch convolution, every token through
//! `post_layernorm`), with `clip_preprocess` in front.

use super::clip::{encoder_layer, Act};
use super::detect::{shape_of as shape, DetectError, Shapes};
use crate::imageops::antialias::bicubic_antialias;
use sdkit_compute::tensor::{Conv2dParams, GraphBuilder, Scope, ShapeError, T};

/// A vision encoder's sizes, from its shapes (the heads and activation
/// from the width, as ComfyUI's configs for the real models have them).
#[derive(Clone, Debug, PartialEq)]
pub struct ClipVisionConfig {
    pub width: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub patch: usize,
    /// The square input side: the smallest multiple of 16 at or above
    /// the patch grid's pixels (√(position rows, less the class token) ×
    /// patch): 224 and 336 for CLIP ViTs, 384 for SigLIP so400m's 27 × 14,
    /// as ComfyUI's configs say (the stride-14 convolution drops the rest).
    pub image_size: usize,
    /// SigLIP: no class token, the output post-normed.
    pub siglip: bool,
    pub act: Act,
    /// `visual_projection` `[projection, width]`, where the file has one.
    pub projection: Option<usize>,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

const PREFIX: &str = "vision_model.";

/// Whether the shapes hold a vision encoder this module reads.
pub fn is_clip_vision(s: &Shapes) -> bool {
    s.contains_key("vision_model.embeddings.patch_embedding.weight")
}

/// Infers the config from the shapes.
pub fn clip_vision_config(s: &Shapes) -> Result<ClipVisionConfig, DetectError> {
    let k = |n: &str| format!("{PREFIX}{n}");
    let pe = shape(
        s,
        k("embeddings.patch_embedding.weight"),
        4,
        "[width, 3, patch, patch]",
    )?;
    let (width, patch) = (pe[0], pe[2]);
    let pos = shape(
        s,
        k("embeddings.position_embedding.weight"),
        2,
        "[positions, width]",
    )?;
    let siglip = !s.contains_key(&k("embeddings.class_embedding"));
    let grid_cells = pos[0] - usize::from(!siglip);
    let side = (grid_cells as f64).sqrt().round() as usize;
    if side * side != grid_cells || patch == 0 || width == 0 {
        return Err(DetectError::BadShape {
            name: k("embeddings.position_embedding.weight"),
            shape: pos,
            expected: "a square grid of positions (plus a class token)",
        });
    }
    let intermediate = shape(
        s,
        k("encoder.layers.0.mlp.fc1.weight"),
        2,
        "[intermediate, width]",
    )?[0];
    let layers = (0..)
        .take_while(|n| s.contains_key(&k(&format!("encoder.layers.{n}.layer_norm1.weight"))))
        .count();
    // ComfyUI's configs: 16 heads for ViT-L/H/G and SigLIP so400m, 12 for
    // ViT-B; 64-wide heads for other widths.
    let heads = match width {
        768 => 12,
        1024 | 1152 | 1280 | 1664 => 16,
        w => (w / 64).max(1),
    };
    let act = if siglip {
        Act::GeluTanh
    } else if width <= 1024 {
        // OpenAI's ViT-B and ViT-L.
        Act::QuickGelu
    } else {
        Act::Gelu
    };
    let projection = match s.get("visual_projection.weight") {
        Some(p) if p.len() == 2 => Some(p[0]),
        _ => None,
    };
    let (mean, std) = if siglip {
        ([0.5; 3], [0.5; 3])
    } else {
        (
            [0.481_454_66, 0.457_827_5, 0.408_210_73],
            [0.268_629_54, 0.261_302_6, 0.275_777_1],
        )
    };
    Ok(ClipVisionConfig {
        width,
        layers,
        heads,
        intermediate,
        patch,
        image_size: (side * patch).div_ceil(16) * 16,
        siglip,
        act,
        projection,
        mean,
        std,
    })
}

/// ComfyUI's `clip_preprocess` of an IMAGE `[b, h, w, c ≥ 3]` (values
/// `data`) for `cfg`: `[b, 3, size, size]`. Resized (antialiased bicubic)
/// so the shorter side is `size` and centre-cropped, or, without `crop`,
/// resized to `size`×`size`; quantised to 1/255 (`round`, half to even);
/// normalised by the model's mean and std.
pub fn preprocess(
    cfg: &ClipVisionConfig,
    data: &[f32],
    [b, h, w, c]: [usize; 4],
    crop: bool,
) -> Vec<f32> {
    let size = cfg.image_size;
    // NHWC → NCHW, the first three channels.
    let mut planes = Vec::with_capacity(b * 3 * h * w);
    for bi in 0..b {
        for ch in 0..3 {
            planes.extend((0..h * w).map(|i| data[(bi * h * w + i) * c + ch]));
        }
    }
    let (planes, (ph, pw)) = if h == size && w == size {
        (planes, (h, w))
    } else {
        let (oh, ow) = if crop {
            let scale = size as f64 / h.min(w) as f64;
            (
                (scale * h as f64).round_ties_even() as usize,
                (scale * w as f64).round_ties_even() as usize,
            )
        } else {
            (size, size)
        };
        (
            bicubic_antialias(&planes, b * 3, (h, w), (oh, ow)),
            (oh, ow),
        )
    };
    let (y0, x0) = (ph.saturating_sub(size) / 2, pw.saturating_sub(size) / 2);
    let mut out = Vec::with_capacity(b * 3 * size * size);
    for (pi, plane) in planes.chunks(ph * pw).enumerate() {
        let ch = pi % 3;
        for y in y0..y0 + size.min(ph) {
            for x in x0..x0 + size.min(pw) {
                let v = (255.0 * plane[y * pw + x])
                    .clamp(0.0, 255.0)
                    .round_ties_even()
                    / 255.0;
                out.push((v - cfg.mean[ch]) / cfg.std[ch]);
            }
        }
    }
    out
}

/// What the encoder gives (ComfyUI's CLIP_VISION_OUTPUT).
pub struct VisionOut<'a> {
    /// Every token after the last layer (SigLIP: post-normed).
    pub last_hidden_state: T<'a>,
    /// Every token after the second-to-last layer.
    pub penultimate: T<'a>,
    /// The pooled output through the projection (SigLIP: the last hidden
    /// state itself).
    pub image_embeds: T<'a>,
}

/// The encoder on preprocessed `pixels` `[b, 3, size, size]`.
pub fn clip_vision<'a>(
    g: &'a GraphBuilder,
    cfg: &ClipVisionConfig,
    pixels: T<'a>,
) -> Result<VisionOut<'a>, ShapeError> {
    let vb = Scope::new(g, PREFIX);
    let (w, p) = (cfg.width, cfg.patch);
    let b = pixels.shape()[0];
    let grid = cfg.image_size / p;
    // The convolution covers whole patches only: the rest is cut off.
    let emb = vb.pp("embeddings");
    let pe = emb.pp("patch_embedding");
    let bias = if cfg.siglip {
        Some(pe.get("bias", &[w])?)
    } else {
        None
    };
    let x = pixels.conv2d(
        pe.get("weight", &[w, 3, p, p])?,
        bias,
        Conv2dParams {
            stride: [p, p],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        },
    )?;
    let mut x = x.reshape(&[b, w, grid * grid])?.permute(&[0, 2, 1])?;
    let mut positions = grid * grid;
    if !cfg.siglip {
        let cls = emb
            .get("class_embedding", &[w])?
            .reshape(&[1, 1, w])?
            .expand(&[b, 1, w])?;
        x = g.concat(&[cls, x], 1)?;
        positions += 1;
    }
    x = x.add(
        emb.get("position_embedding.weight", &[positions, w])?
            .reshape(&[1, positions, w])?,
    )?;
    if !cfg.siglip {
        x = vb.pp("pre_layrnorm").layer_norm(x, w, 1e-5)?;
    }
    let mut penultimate = x;
    for l in 0..cfg.layers {
        let layer = vb.pp("encoder.layers").pp(l);
        x = encoder_layer(&layer, x, (w, cfg.heads, cfg.intermediate), cfg.act, None)?;
        if l + 2 == cfg.layers {
            penultimate = x;
        }
    }
    let post = vb.pp("post_layernorm");
    let (last, pooled) = if cfg.siglip {
        let x = post.layer_norm(x, w, 1e-5)?;
        (x, x)
    } else {
        let cls = x.slice(1, 0, 1)?.reshape(&[b, w])?;
        (x, post.layer_norm(cls, w, 1e-5)?)
    };
    let image_embeds = match cfg.projection {
        Some(pr) => Scope::new(g, "")
            .pp("visual_projection")
            .linear_no_bias(pooled, w, pr)?,
        None => pooled,
    };
    Ok(VisionOut {
        last_hidden_state: last,
        penultimate,
        image_embeds,
    })
}
