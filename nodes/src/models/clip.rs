//! The CLIP text encoder (OpenAI CLIP ViT-L/14's text tower for SD1) as a
//! tensor graph, with the original checkpoint key names.
//!
//! Pre-LayerNorm transformer: token + position embeddings, `layers` blocks
//! of causal self-attention and a quick-GELU MLP, final LayerNorm. ComfyUI's
//! clip skip (CLIPSetLastLayer) takes the hidden state after an earlier
//! layer and, for SD1, still applies the final LayerNorm to it.

use super::detect::ClipConfig;
use sdkit_compute::tensor::{GraphBuilder, Scope, ShapeError, T};

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

/// Where `text_projection.weight` lives for an encoder under `prefix`:
/// beside the `text_model.` level.
pub fn projection_prefix(prefix: &str) -> &str {
    prefix.strip_suffix("text_model.").unwrap_or(prefix)
}

/// The encoder's outputs.
pub struct ClipOut<'a> {
    /// `[batch, len, width]` after the requested layer.
    pub hidden: T<'a>,
    /// `[batch, projection]`: the final-normed state at each sequence's
    /// end token through `text_projection` (when asked for and the file
    /// has one).
    pub pooled: Option<T<'a>>,
}

/// Builds the encoder. Inputs: `tokens` `[batch, len]` (ids as f32) and
/// `mask` `[len, len]` ([`causal_mask`]). Weights are named
/// `{prefix}embeddings.token_embedding.weight`, ... as in the checkpoint.
/// Returns `[batch, len, width]` (SD1's rule: an earlier layer is
/// final-normed too).
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
    Ok(text_encoder_embedded(g, cfg, prefix, tok, mask, None, layer, true)?.hidden)
}

/// The encoder from token embeddings `[batch, len, width]` (the rows of
/// `embeddings.token_embedding.weight` for the ids, looked up by the
/// caller: a 77-row lookup needs no device, and the table is the largest
/// tensor of a text encoder). `eot` `[batch, 1, len]` (a one-hot at each
/// sequence's first end token, [`super::open_clip::end_token_one_hot`])
/// asks for the pooled output, through the text projection when `eot`
/// says so (and the file has one), else as it is. `norm_hidden`: whether an earlier layer's
/// state goes through the final LayerNorm (SD1 yes, SDXL no).
#[allow(clippy::too_many_arguments)]
pub fn text_encoder_embedded<'a>(
    g: &'a GraphBuilder,
    cfg: &ClipConfig,
    prefix: &str,
    tok: T<'a>,
    mask: T<'a>,
    eot: Option<(T<'a>, bool)>,
    layer: ClipLayer,
    norm_hidden: bool,
) -> Result<ClipOut<'a>, ShapeError> {
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
    let run = layer.layers_run(cfg.layers);
    // The pooled output needs every layer; the hidden state only `run`.
    let total = if eot.is_some() { cfg.layers } else { run };
    let mut hidden = None;
    for l in 0..total {
        let act = if cfg.gelu { Act::Gelu } else { Act::QuickGelu };
        let p = vb.pp("encoder.layers").pp(l);
        x = encoder_layer(&p, x, (w, heads, cfg.intermediate), act, Some(mask))?;
        if l + 1 == run {
            hidden = Some(x);
        }
    }
    let final_norm = vb.pp("final_layer_norm");
    let last = final_norm.layer_norm(x, w, 1e-5)?;
    // ComfyUI's "last" layer is the final-normed output; a layer picked
    // by index (even the last one, -1) is normed only where the family
    // says so.
    let hidden = match (layer, hidden) {
        (ClipLayer::FromEnd(_), Some(h)) if norm_hidden => final_norm.layer_norm(h, w, 1e-5)?,
        (ClipLayer::FromEnd(_), Some(h)) => h,
        _ => last,
    };
    let b = tok.shape()[0];
    let pooled = match (eot, cfg.projection) {
        (Some((eot, true)), Some(p)) => {
            let row = eot.matmul(last)?.reshape(&[b, w])?;
            // A Linear without bias, `[projection, width]`, beside (not
            // inside) the `text_model.` tensors.
            let outer = Scope::new(g, projection_prefix(prefix));
            Some(outer.pp("text_projection").linear_no_bias(row, w, p)?)
        }
        (Some((eot, false)), _) => Some(eot.matmul(last)?.reshape(&[b, w])?),
        _ => None,
    };
    Ok(ClipOut { hidden, pooled })
}

/// The MLP activation of a CLIP-style encoder layer (ComfyUI's
/// `ACTIVATIONS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    QuickGelu,
    /// Exact (erf) GELU.
    Gelu,
    /// `gelu_pytorch_tanh`.
    GeluTanh,
}

/// One pre-norm encoder layer (`layer_norm1`, `self_attn` with q/k/v/out
/// projections, `layer_norm2`, `mlp.fc1/fc2`; LayerNorms with ComfyUI's
/// eps 1e-5) on `x` `[b, len, width]`, `(width, heads, intermediate)`.
pub(crate) fn encoder_layer<'a>(
    p: &Scope<'a>,
    x: T<'a>,
    (w, heads, inter): (usize, usize, usize),
    act: Act,
    mask: Option<T<'a>>,
) -> Result<T<'a>, ShapeError> {
    let h = p.pp("layer_norm1").layer_norm(x, w, 1e-5)?;
    let attn = p.pp("self_attn");
    let q = attn.pp("q_proj").linear(h, w, w)?;
    let k = attn.pp("k_proj").linear(h, w, w)?;
    let v = attn.pp("v_proj").linear(h, w, w)?;
    let a = super::multi_head_attention(q, k, v, heads, mask)?;
    let x = attn.pp("out_proj").linear(a, w, w)?.add(x)?;
    let h = p.pp("layer_norm2").layer_norm(x, w, 1e-5)?;
    let h = p.pp("mlp.fc1").linear(h, w, inter)?;
    let h = match act {
        Act::QuickGelu => h.quick_gelu(),
        Act::Gelu => h.gelu_erf(),
        Act::GeluTanh => h.gelu(),
    };
    p.pp("mlp.fc2").linear(h, inter, w)?.add(x)
}
