//! The KL autoencoder (ldm `Encoder`/`Decoder` with `quant_conv` and
//! `post_quant_conv`, as ComfyUI runs them) as tensor graphs with the
//! checkpoint's key names, and ComfyUI's VAEEncode/VAEDecode around them.
//! Latents on links are unscaled (ComfyUI applies the 0.18215 scale inside
//! sampling, not in the VAE nodes).

use super::detect::VaeConfig;
use sdkit_compute::tensor::{Conv2dParams, GraphBuilder, Scope, ShapeError, UpsampleMode, T};

type R<'a> = Result<T<'a>, ShapeError>;

/// GroupNorm(32, eps 1e-6), as ldm's `Normalize`.
fn norm<'a>(vb: &Scope<'a>, x: T<'a>, c: usize) -> R<'a> {
    vb.group_norm(x, 32, c, 1e-6)
}

fn resnet<'a>(vb: &Scope<'a>, x: T<'a>, cin: usize, cout: usize) -> R<'a> {
    let h = norm(&vb.pp("norm1"), x, cin)?.silu();
    let h = vb.pp("conv1").conv2d(h, cin, cout, 3, 1)?;
    let h = norm(&vb.pp("norm2"), h, cout)?.silu();
    let h = vb.pp("conv2").conv2d(h, cout, cout, 3, 1)?;
    let skip = if cin == cout {
        x
    } else {
        vb.pp("nin_shortcut").conv2d(x, cin, cout, 1, 1)?
    };
    skip.add(h)
}

/// Single-head self-attention over all pixels (ldm's `AttnBlock`).
fn attn<'a>(vb: &Scope<'a>, x: T<'a>, c: usize) -> R<'a> {
    let s = x.shape();
    let (b, hh, ww) = (s[0], s[2], s[3]);
    let h = norm(&vb.pp("norm"), x, c)?;
    let tokens = |t: T<'a>| -> R<'a> {
        t.reshape(&[b, c, hh * ww])?
            .permute(&[0, 2, 1])?
            .reshape(&[b, 1, hh * ww, c])
    };
    let q = tokens(vb.pp("q").conv2d(h, c, c, 1, 1)?)?;
    let k = tokens(vb.pp("k").conv2d(h, c, c, 1, 1)?)?;
    let v = tokens(vb.pp("v").conv2d(h, c, c, 1, 1)?)?;
    let o = q.attention(k, v, None, 1.0 / (c as f32).sqrt())?;
    let o = o
        .reshape(&[b, hh * ww, c])?
        .permute(&[0, 2, 1])?
        .reshape(&[b, c, hh, ww])?;
    vb.pp("proj_out").conv2d(o, c, c, 1, 1)?.add(x)
}

/// The decoder: `z` `[b, z_channels, h, w]` → `[b, 3, 8h, 8w]` (for four
/// levels), weights under `prefix` (e.g. `first_stage_model.decoder.`).
pub fn decoder<'a>(g: &'a GraphBuilder, cfg: &VaeConfig, prefix: &str, z: T<'a>) -> R<'a> {
    let vb = Scope::new(g, prefix);
    let levels = cfg.ch_mult.len();
    let mut c = cfg.ch * cfg.ch_mult.last().copied().unwrap_or(1);
    let mut h = vb.pp("conv_in").conv2d(z, cfg.z_channels, c, 3, 1)?;
    h = resnet(&vb.pp("mid.block_1"), h, c, c)?;
    h = attn(&vb.pp("mid.attn_1"), h, c)?;
    h = resnet(&vb.pp("mid.block_2"), h, c, c)?;
    for level in (0..levels).rev() {
        let up = vb.pp("up").pp(level);
        let cout = cfg.ch * cfg.ch_mult[level];
        for block in 0..=cfg.num_res_blocks {
            h = resnet(&up.pp("block").pp(block), h, c, cout)?;
            c = cout;
        }
        if level != 0 {
            let s = h.shape();
            h = h.upsample(UpsampleMode::Nearest, s[2] * 2, s[3] * 2)?;
            h = up.pp("upsample.conv").conv2d(h, c, c, 3, 1)?;
        }
    }
    let h = norm(&vb.pp("norm_out"), h, c)?.silu();
    vb.pp("conv_out").conv2d(h, c, cfg.in_channels, 3, 1)
}

/// The encoder: `x` `[b, in_channels, H, W]` → moments `[b, 2 z_channels,
/// H/8, W/8]` (for four levels), weights under `prefix` (e.g.
/// `first_stage_model.encoder.`).
pub fn encoder<'a>(g: &'a GraphBuilder, cfg: &VaeConfig, prefix: &str, x: T<'a>) -> R<'a> {
    let vb = Scope::new(g, prefix);
    let levels = cfg.ch_mult.len();
    let mut c = cfg.ch;
    let mut h = vb.pp("conv_in").conv2d(x, cfg.in_channels, c, 3, 1)?;
    for level in 0..levels {
        let down = vb.pp("down").pp(level);
        let cout = cfg.ch * cfg.ch_mult[level];
        for block in 0..cfg.num_res_blocks {
            h = resnet(&down.pp("block").pp(block), h, c, cout)?;
            c = cout;
        }
        if level + 1 != levels {
            // ldm's Downsample pads right and bottom only, then a 3×3
            // stride-2 convolution without padding.
            h = h.pad(&[(0, 0), (0, 0), (0, 1), (0, 1)], 0.0)?;
            let p = Conv2dParams {
                stride: [2; 2],
                padding: [0; 2],
                dilation: [1; 2],
                groups: 1,
            };
            h = down.pp("downsample.conv").conv2d_with(h, c, c, 3, p)?;
        }
    }
    h = resnet(&vb.pp("mid.block_1"), h, c, c)?;
    h = attn(&vb.pp("mid.attn_1"), h, c)?;
    h = resnet(&vb.pp("mid.block_2"), h, c, c)?;
    let h = norm(&vb.pp("norm_out"), h, c)?.silu();
    vb.pp("conv_out").conv2d(h, c, 2 * cfg.z_channels, 3, 1)
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
    let moments = if cfg.quant_conv {
        Scope::new(g, prefix)
            .pp("quant_conv")
            .conv2d(moments, zc, zc, 1, 1)?
    } else {
        moments
    };
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
    let z = if cfg.quant_conv {
        Scope::new(g, prefix)
            .pp("post_quant_conv")
            .conv2d(latent, zc, zc, 1, 1)?
    } else {
        latent
    };
    decoder(g, cfg, &format!("{prefix}decoder."), z)
}
