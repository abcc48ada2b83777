//! Model families: detection from checkpoint keys and shapes now; model
//! builders (CLIP, UNet, VAE as tensor graphs) join here.

pub mod clip;
pub mod clip_vision;
pub mod controlnet;
pub mod detect;
pub mod family;
pub mod flux;
pub mod mmdit;
pub mod open_clip;
pub mod t2i;
pub mod t5;
pub mod taesd;
pub mod unet;
pub mod vae;

use sdkit_compute::tensor::{ShapeError, T};

/// Multi-head scaled dot-product attention of `q` `[b, s, c]` over `k`, `v`
/// `[b, s_kv, c]`, with `heads` heads of `c / heads` channels and an
/// optional additive mask, back as `[b, s, c]`: the split and merge every
/// transformer here does around the attention op.
pub(crate) fn multi_head_attention<'a>(
    q: T<'a>,
    k: T<'a>,
    v: T<'a>,
    heads: usize,
    mask: Option<T<'a>>,
) -> Result<T<'a>, ShapeError> {
    let (qs, ks) = (q.shape(), k.shape());
    let (b, s, c, skv) = (qs[0], qs[1], qs[2], ks[1]);
    let d = c / heads;
    let split = |t: T<'a>, len: usize| -> Result<T<'a>, ShapeError> {
        t.reshape(&[b, len, heads, d])?.permute(&[0, 2, 1, 3])
    };
    let o = split(q, s)?.attention(
        split(k, skv)?,
        split(v, skv)?,
        mask,
        1.0 / (d as f32).sqrt(),
    )?;
    o.permute(&[0, 2, 1, 3])?.reshape(&[b, s, c])
}

/// Transformer blocks a DiT runs as the identity (ComfyUI's "dit"
/// `double_block` / `single_block` replace patches that return their
/// input, as skip-layer guidance sets them): SD3's joint blocks and
/// Flux's double blocks by `double`, Flux's single blocks by `single`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SkipLayers {
    pub double: Vec<usize>,
    pub single: Vec<usize>,
}

impl SkipLayers {
    pub fn is_empty(&self) -> bool {
        self.double.is_empty() && self.single.is_empty()
    }
}
