//! The KL autoencoder (ldm `Encoder`/`Decoder` with `quant_conv` and
//! `post_quant_conv`, as ComfyUI runs them) as tensor graphs with the
//! checkpoint's key names, and ComfyUI's VAEEncode/VAEDecode around them.
//! Latents on links are unscaled (ComfyUI applies the 0.18215 scale inside
//! sampling, not in the VAE nodes).

use super::detect::VaeConfig;
use sdkit_engine::tensor::{Conv2dParams, GraphBuilder, ShapeError, UpsampleMode, T};

/// SD1's latent scale factor (ComfyUI's `SD15` latent format).
pub const SD1_SCALE: f32 = 0.18215;

type R<'a> = Result<T<'a>, ShapeError>;

struct Ctx<'a, 'p> {
    g: &'a GraphBuilder,
    prefix: &'p str,
}

impl<'a> Ctx<'a, '_> {
    fn w(&self, name: &str, shape: &[usize]) -> R<'a> {
        self.g.weight(&format!("{}{name}", self.prefix), shape)
    }

    fn conv(&self, x: T<'a>, name: &str, cin: usize, cout: usize, k: usize) -> R<'a> {
        let p = Conv2dParams {
            stride: [1; 2],
            padding: [k / 2; 2],
            dilation: [1; 2],
            groups: 1,
        };
        x.conv2d(
            self.w(&format!("{name}.weight"), &[cout, cin, k, k])?,
            Some(self.w(&format!("{name}.bias"), &[cout])?),
            p,
        )
    }

    /// GroupNorm(32, eps 1e-6), as ldm's `Normalize`.
    fn norm(&self, x: T<'a>, name: &str, c: usize) -> R<'a> {
        x.group_norm(
            32,
            Some(self.w(&format!("{name}.weight"), &[c])?),
            Some(self.w(&format!("{name}.bias"), &[c])?),
            1e-6,
        )
    }

    fn resnet(&self, x: T<'a>, name: &str, cin: usize, cout: usize) -> R<'a> {
        let h = self.norm(x, &format!("{name}.norm1"), cin)?.silu();
        let h = self.conv(h, &format!("{name}.conv1"), cin, cout, 3)?;
        let h = self.norm(h, &format!("{name}.norm2"), cout)?.silu();
        let h = self.conv(h, &format!("{name}.conv2"), cout, cout, 3)?;
        let skip = if cin == cout {
            x
        } else {
            self.conv(x, &format!("{name}.nin_shortcut"), cin, cout, 1)?
        };
        skip.add(h)
    }

    /// Single-head self-attention over all pixels (ldm's `AttnBlock`).
    fn attn(&self, x: T<'a>, name: &str, c: usize) -> R<'a> {
        let s = x.shape();
        let (b, hh, ww) = (s[0], s[2], s[3]);
        let h = self.norm(x, &format!("{name}.norm"), c)?;
        let tokens = |t: T<'a>| -> R<'a> {
            t.reshape(&[b, c, hh * ww])?
                .permute(&[0, 2, 1])?
                .reshape(&[b, 1, hh * ww, c])
        };
        let q = tokens(self.conv(h, &format!("{name}.q"), c, c, 1)?)?;
        let k = tokens(self.conv(h, &format!("{name}.k"), c, c, 1)?)?;
        let v = tokens(self.conv(h, &format!("{name}.v"), c, c, 1)?)?;
        let o = q.attention(k, v, None, 1.0 / (c as f32).sqrt())?;
        let o = o
            .reshape(&[b, hh * ww, c])?
            .permute(&[0, 2, 1])?
            .reshape(&[b, c, hh, ww])?;
        self.conv(o, &format!("{name}.proj_out"), c, c, 1)?.add(x)
    }
}

/// The decoder: `z` `[b, z_channels, h, w]` → `[b, 3, 8h, 8w]` (for four
/// levels), weights under `prefix` (e.g. `first_stage_model.decoder.`).
pub fn decoder<'a>(g: &'a GraphBuilder, cfg: &VaeConfig, prefix: &str, z: T<'a>) -> R<'a> {
    let cx = Ctx { g, prefix };
    let levels = cfg.ch_mult.len();
    let mut c = cfg.ch * cfg.ch_mult.last().copied().unwrap_or(1);
    let mut h = cx.conv(z, "conv_in", cfg.z_channels, c, 3)?;
    h = cx.resnet(h, "mid.block_1", c, c)?;
    h = cx.attn(h, "mid.attn_1", c)?;
    h = cx.resnet(h, "mid.block_2", c, c)?;
    for level in (0..levels).rev() {
        let cout = cfg.ch * cfg.ch_mult[level];
        for block in 0..=cfg.num_res_blocks {
            h = cx.resnet(h, &format!("up.{level}.block.{block}"), c, cout)?;
            c = cout;
        }
        if level != 0 {
            let s = h.shape();
            h = h.upsample(UpsampleMode::Nearest, s[2] * 2, s[3] * 2)?;
            h = cx.conv(h, &format!("up.{level}.upsample.conv"), c, c, 3)?;
        }
    }
    let h = cx.norm(h, "norm_out", c)?.silu();
    cx.conv(h, "conv_out", c, cfg.in_channels, 3)
}

/// The encoder: `x` `[b, in_channels, H, W]` → moments `[b, 2 z_channels,
/// H/8, W/8]` (for four levels), weights under `prefix` (e.g.
/// `first_stage_model.encoder.`).
pub fn encoder<'a>(g: &'a GraphBuilder, cfg: &VaeConfig, prefix: &str, x: T<'a>) -> R<'a> {
    let cx = Ctx { g, prefix };
    let levels = cfg.ch_mult.len();
    let mut c = cfg.ch;
    let mut h = cx.conv(x, "conv_in", cfg.in_channels, c, 3)?;
    for level in 0..levels {
        let cout = cfg.ch * cfg.ch_mult[level];
        for block in 0..cfg.num_res_blocks {
            h = cx.resnet(h, &format!("down.{level}.block.{block}"), c, cout)?;
            c = cout;
        }
        if level + 1 != levels {
            // ldm's Downsample pads right and bottom only, then a 3×3
            // stride-2 convolution without padding.
            h = h.pad(&[(0, 0), (0, 0), (0, 1), (0, 1)], 0.0)?;
            let name = format!("down.{level}.downsample.conv");
            h = h.conv2d(
                cx.w(&format!("{name}.weight"), &[c, c, 3, 3])?,
                Some(cx.w(&format!("{name}.bias"), &[c])?),
                Conv2dParams {
                    stride: [2; 2],
                    padding: [0; 2],
                    dilation: [1; 2],
                    groups: 1,
                },
            )?;
        }
    }
    h = cx.resnet(h, "mid.block_1", c, c)?;
    h = cx.attn(h, "mid.attn_1", c)?;
    h = cx.resnet(h, "mid.block_2", c, c)?;
    let h = cx.norm(h, "norm_out", c)?.silu();
    cx.conv(h, "conv_out", c, 2 * cfg.z_channels, 3)
}

/// ComfyUI's VAEEncode for the KL VAE (`first_stage_model.` prefix):
/// IMAGE `[b, H, W, 3]` (H, W multiples of 8) → `x * 2 - 1` → encoder →
/// `quant_conv` → the posterior's mode (the mean: the first `z_channels`
/// moments). The latent is unscaled, as ComfyUI stores it.
pub fn encode_image<'a>(g: &'a GraphBuilder, cfg: &VaeConfig, prefix: &str, image: T<'a>) -> R<'a> {
    encode_pixels(g, cfg, prefix, image.permute(&[0, 3, 1, 2])?)
}

/// [`encode_image`] from pixels `[b, 3, H, W]` in 0..1 (a tile).
pub fn encode_pixels<'a>(
    g: &'a GraphBuilder,
    cfg: &VaeConfig,
    prefix: &str,
    pixels: T<'a>,
) -> R<'a> {
    let x = pixels.mul_scalar(2.0).add_scalar(-1.0);
    let moments = encoder(g, cfg, &format!("{prefix}encoder."), x)?;
    let zc = 2 * cfg.z_channels;
    let moments = Ctx { g, prefix }.conv(moments, "quant_conv", zc, zc, 1)?;
    moments.slice(1, 0, cfg.z_channels)
}

/// ComfyUI's VAEDecode for the KL VAE (`first_stage_model.` prefix): the
/// unscaled latent → `post_quant_conv` → decoder → `clamp((x + 1) / 2, 0,
/// 1)` as an IMAGE `[b, H, W, 3]`.
pub fn decode_image<'a>(
    g: &'a GraphBuilder,
    cfg: &VaeConfig,
    prefix: &str,
    latent: T<'a>,
) -> R<'a> {
    decode_raw(g, cfg, prefix, latent)?
        .add_scalar(1.0)
        .mul_scalar(0.5)
        .clamp(0.0, 1.0)
        .permute(&[0, 2, 3, 1])
}

/// The decoder's own output `[b, 3, H, W]` (about −1..1, before ComfyUI's
/// `process_output`): what tiled decoding blends.
pub fn decode_raw<'a>(g: &'a GraphBuilder, cfg: &VaeConfig, prefix: &str, latent: T<'a>) -> R<'a> {
    let zc = cfg.z_channels;
    let z = Ctx { g, prefix }.conv(latent, "post_quant_conv", zc, zc, 1)?;
    decoder(g, cfg, &format!("{prefix}decoder."), z)
}
