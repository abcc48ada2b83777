//! The OpenCLIP text encoder (ViT-H/14 for SD 2.x, ViT-bigG/14 for SDXL
//! and SD3) as a tensor graph on the checkpoint's own OpenCLIP key names
//! (`transformer.resblocks.N.attn.in_proj_weight`, `ln_final`,
//! `text_projection`, ...), as ComfyUI runs it after converting those keys
//! to its CLIP layout (`clip_text_transformers_convert`): the fused
//! `in_proj` is one product whose thirds are q, k and v; the MLP's GELU is
//! the exact (erf) one; the causal mask is additive.
//!
//! Two outputs: the hidden state after a chosen layer (ComfyUI's
//! `layer_idx`, with or without the final LayerNorm: SD 2.x applies it,
//! SDXL's bigG does not) and the pooled output — the final-normed state
//! at each sequence's first end token, times `text_projection`.

use super::clip::ClipLayer;
use super::detect::OpenClipConfig;
use sdkit_compute::tensor::{GraphBuilder, Scope, ShapeError, T};

/// The encoder's outputs.
pub struct OpenClipOut<'a> {
    /// `[batch, len, width]` after the requested layer.
    pub hidden: T<'a>,
    /// `[batch, projection]`: the pooled, projected output.
    pub pooled: T<'a>,
}

/// Builds the encoder from token embeddings `tok` `[batch, len, width]`
/// (the rows of `token_embedding.weight` for the ids, looked up by the
/// caller as for CLIP), the additive causal `mask` `[len, len]`
/// ([`super::clip::causal_mask`]) and `eot` `[batch, 1, len]`: 1 at each
/// sequence's first end token, 0 elsewhere (the pooled row is that one-hot
/// times the states, which picks the row exactly). Weights are named
/// `{prefix}transformer.resblocks.0.ln_1.weight`, ... as in the file.
#[allow(clippy::too_many_arguments)]
pub fn text_encoder<'a>(
    g: &'a GraphBuilder,
    cfg: &OpenClipConfig,
    prefix: &str,
    tok: T<'a>,
    mask: T<'a>,
    eot: T<'a>,
    layer: ClipLayer,
    norm_hidden: bool,
) -> Result<OpenClipOut<'a>, ShapeError> {
    let s = tok.shape();
    let (b, len) = (s[0], s[1]);
    let w = cfg.width;
    let heads = cfg.heads.max(1);
    let vb = Scope::new(g, prefix);
    let pos = vb
        .get("positional_embedding", &[cfg.max_positions, w])?
        .slice(0, 0, len)?;
    let mut x = tok.add(pos)?;
    let mut hidden = None;
    let run = layer.layers_run(cfg.layers);
    for l in 0..cfg.layers {
        let p = vb.pp("transformer.resblocks").pp(l);
        let h = p.pp("ln_1").layer_norm(x, w, 1e-5)?;
        let attn = p.pp("attn");
        let qkv = h.linear(
            attn.get("in_proj_weight", &[3 * w, w])?,
            Some(attn.get("in_proj_bias", &[3 * w])?),
        )?;
        let third = |i: usize| qkv.slice(2, i * w, (i + 1) * w);
        let a = super::multi_head_attention(third(0)?, third(1)?, third(2)?, heads, Some(mask))?;
        x = attn.pp("out_proj").linear(a, w, w)?.add(x)?;
        let h = p.pp("ln_2").layer_norm(x, w, 1e-5)?;
        let h = p.pp("mlp.c_fc").linear(h, w, cfg.intermediate)?.gelu_erf();
        x = p.pp("mlp.c_proj").linear(h, cfg.intermediate, w)?.add(x)?;
        if l + 1 == run {
            hidden = Some(x);
        }
    }
    let ln_final = vb.pp("ln_final");
    let last = ln_final.layer_norm(x, w, 1e-5)?;
    // ComfyUI's "last" layer is the final-normed output; a layer picked
    // by index (even the last one, -1) is normed only where the family
    // says so.
    let hidden = match (layer, hidden) {
        (ClipLayer::FromEnd(_), Some(h)) if norm_hidden => ln_final.layer_norm(h, w, 1e-5)?,
        (ClipLayer::FromEnd(_), Some(h)) => h,
        _ => last,
    };
    let pooled = eot
        .matmul(last)?
        .reshape(&[b, w])?
        .matmul(vb.get("text_projection", &[w, cfg.projection])?)?;
    Ok(OpenClipOut { hidden, pooled })
}

/// The `eot` input of [`text_encoder`] for `tokens` (one row per
/// sequence): a one-hot at the first `end` token of each (at the first
/// position when a sequence has none), as ComfyUI's
/// `argmax(tokens == eos)` picks it.
pub fn end_token_one_hot(tokens: &[Vec<u32>], end: u32) -> Vec<f32> {
    let mut out = Vec::new();
    for row in tokens {
        let at = row.iter().position(|&t| t == end).unwrap_or(0);
        out.extend((0..row.len()).map(|i| if i == at { 1.0 } else { 0.0 }));
    }
    out
}
