//! ControlNet (ComfyUI's `comfy/cldm/cldm.py`) in the ldm layout of the
//! `control_v11*` files: the UNet's first half (time and ADM embedding,
//! input blocks, middle block; [`super::unet::encode`]) whose input block
//! 0 also gets the hint image through `input_hint_block` (eight 3×3
//! convolutions, SiLU between them, strides of 2 at sequence indices 4, 8
//! and 12: the hint is 8× the latent), a 1×1 `zero_convs.N.0` on every
//! input block's output and `middle_block_out.0` on the middle's.

use super::detect::{unet_config, DetectError, Heads, Shapes, UnetConfig};
use super::unet::encode;
use sdkit_compute::tensor::{GraphBuilder, Scope, ShapeError, T};

/// A ControlNet's sizes, inferred from its tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlNetConfig {
    /// The encoder half (no output blocks).
    pub unet: UnetConfig,
    /// The hint convolutions `(index, in, out)` in order.
    pub hint_convs: Vec<(usize, usize, usize)>,
}

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
    Ok(ControlNetConfig { unet, hint_convs })
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
    let enc = encode(g, &cfg.unet, heads, &vb, x, timesteps, context, y, Some(h))?;
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
