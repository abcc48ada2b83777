//! The CLIP text encoder (OpenAI CLIP ViT-L/14's text tower for SD1) as a
//! tensor graph, with the original checkpoint key names.
//!
//! Pre-LayerNorm transformer: token + position embeddings, `layers` blocks
//! of causal self-attention and a quick-GELU MLP, final LayerNorm. ComfyUI's
//! clip skip (CLIPSetLastLayer) takes the hidden state after an earlier
//! layer and, for SD1, still applies the final LayerNorm to it.

use super::detect::ClipConfig;
use sdkit_engine::tensor::{GraphBuilder, Scope, ShapeError, T};

/// Which hidden state the encoder returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClipLayer {
    Last,
    /// ComfyUI's `stop_at_clip_layer`: -1 is the last layer, -2 the one
    /// before, ...
    FromEnd(usize),
}

impl ClipLayer {
    /// How many encoder layers run.
    pub fn layers_run(self, total: usize) -> usize {
        match self {
            ClipLayer::Last => total,
            ClipLayer::FromEnd(k) => total + 1 - k.clamp(1, total),
        }
    }
}

/// The additive causal mask: 0 on and below the diagonal, -inf above.
pub fn causal_mask(len: usize) -> Vec<f32> {
    let mut m = vec![0.0; len * len];
    for i in 0..len {
        for j in i + 1..len {
            m[i * len + j] = f32::NEG_INFINITY;
        }
    }
    m
}

/// Builds the encoder. Inputs: `tokens` `[batch, len]` (ids as f32) and
/// `mask` `[len, len]` ([`causal_mask`]). Weights are named
/// `{prefix}embeddings.token_embedding.weight`, ... as in the checkpoint.
/// Returns `[batch, len, width]`.
pub fn text_encoder<'a>(
    g: &'a GraphBuilder,
    cfg: &ClipConfig,
    prefix: &str,
    tokens: T<'a>,
    mask: T<'a>,
    layer: ClipLayer,
) -> Result<T<'a>, ShapeError> {
    let tok = Scope::new(g, prefix)
        .get("embeddings.token_embedding.weight", &[cfg.vocab, cfg.width])?
        .gather(tokens)?;
    text_encoder_embedded(g, cfg, prefix, tok, mask, layer)
}

/// The encoder from token embeddings `[batch, len, width]` (the rows of
/// `embeddings.token_embedding.weight` for the ids, looked up by the
/// caller: a 77-row lookup needs no device, and the table is the largest
/// tensor of a text encoder).
pub fn text_encoder_embedded<'a>(
    g: &'a GraphBuilder,
    cfg: &ClipConfig,
    prefix: &str,
    tok: T<'a>,
    mask: T<'a>,
    layer: ClipLayer,
) -> Result<T<'a>, ShapeError> {
    let len = tok.shape()[1];
    let w = cfg.width;
    let heads = cfg.heads.max(1);
    let vb = Scope::new(g, prefix);
    let pos = vb
        .get(
            "embeddings.position_embedding.weight",
            &[cfg.max_positions, w],
        )?
        .slice(0, 0, len)?;
    let mut x = tok.add(pos)?;
    for l in 0..layer.layers_run(cfg.layers) {
        let p = vb.pp("encoder.layers").pp(l);
        let h = p.pp("layer_norm1").layer_norm(x, w, 1e-5)?;
        let attn = p.pp("self_attn");
        let q = attn.pp("q_proj").linear(h, w, w)?;
        let k = attn.pp("k_proj").linear(h, w, w)?;
        let v = attn.pp("v_proj").linear(h, w, w)?;
        let a = super::multi_head_attention(q, k, v, heads, Some(mask))?;
        x = attn.pp("out_proj").linear(a, w, w)?.add(x)?;
        let h = p.pp("layer_norm2").layer_norm(x, w, 1e-5)?;
        let h = p.pp("mlp.fc1").linear(h, w, cfg.intermediate)?.quick_gelu();
        x = p.pp("mlp.fc2").linear(h, cfg.intermediate, w)?.add(x)?;
    }
    vb.pp("final_layer_norm").layer_norm(x, w, 1e-5)
}
