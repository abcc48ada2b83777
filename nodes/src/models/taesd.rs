//! TAESD, the tiny autoencoder (ComfyUI's `comfy/taesd/taesd.py`) with the
//! released files' keys: `taesd_encoder.N.*`, `taesd_decoder.N.*` as
//! VAELoader mounts them. Every convolution is 3×3 with padding 1 and 64
//! channels; a `Block` is `relu(conv4(relu(conv2(relu(conv0(x))))) + x)`.
//! - Encoder: conv 0, Block 1, then three times a stride-2 conv without
//!   bias (2, 6, 10) and three Blocks, then conv 14 to the latent channels.
//! - Decoder: `tanh(x / 3) · 3`, conv 1, ReLU, then three times three
//!   Blocks, a nearest 2× upsample and a conv without bias (7, 12, 17),
//!   then Block 18 and conv 19 to RGB.

use sdkit_compute::tensor::{Conv2dParams, GraphBuilder, Scope, UpsampleMode, T};

type R<'a> = Result<T<'a>, sdkit_compute::tensor::ShapeError>;

const W: usize = 64;

fn conv<'a>(vb: &Scope<'a>, x: T<'a>, cin: usize, cout: usize, stride: usize, bias: bool) -> R<'a> {
    if bias {
        return vb.conv2d(x, cin, cout, 3, stride);
    }
    let w = vb.get("weight", &[cout, cin, 3, 3])?;
    x.conv2d(
        w,
        None,
        Conv2dParams {
            stride: [stride; 2],
            padding: [1; 2],
            dilation: [1; 2],
            groups: 1,
        },
    )
}

fn relu(x: T<'_>) -> T<'_> {
    x.clamp(0.0, f32::INFINITY)
}

fn block<'a>(vb: &Scope<'a>, x: T<'a>) -> R<'a> {
    let c = vb.pp("conv");
    let h = relu(conv(&c.pp(0), x, W, W, 1, true)?);
    let h = relu(conv(&c.pp(2), h, W, W, 1, true)?);
    let h = conv(&c.pp(4), h, W, W, 1, true)?;
    Ok(relu(h.add(x)?))
}

/// The encoder's output for `x` `[b, 3, H, W]` (ComfyUI feeds it
/// `pixels · 0.5 + 0.5`).
pub fn encoder<'a>(g: &'a GraphBuilder, prefix: &str, x: T<'a>, latent: usize) -> R<'a> {
    let vb = Scope::new(g, prefix);
    let mut h = conv(&vb.pp(0), x, 3, W, 1, true)?;
    h = block(&vb.pp(1), h)?;
    for base in [2, 6, 10] {
        h = conv(&vb.pp(base), h, W, W, 2, false)?;
        for i in 1..=3 {
            h = block(&vb.pp(base + i), h)?;
        }
    }
    conv(&vb.pp(14), h, W, latent, 1, true)
}

/// The decoder's output `[b, 3, 8h, 8w]` for `z` `[b, latent, h, w]`
/// (already `(z − shift) · scale`).
pub fn decoder<'a>(g: &'a GraphBuilder, prefix: &str, z: T<'a>, latent: usize) -> R<'a> {
    let vb = Scope::new(g, prefix);
    // Clamp: tanh(x / 3) · 3, a true division as torch does it.
    let x = z.div(g.constant(3.0))?.tanh().mul_scalar(3.0);
    let mut h = relu(conv(&vb.pp(1), x, latent, W, 1, true)?);
    for base in [3, 8, 13] {
        for i in 0..3 {
            h = block(&vb.pp(base + i), h)?;
        }
        let s = h.shape();
        h = h.upsample(UpsampleMode::Nearest, 2 * s[2], 2 * s[3])?;
        h = conv(&vb.pp(base + 4), h, W, W, 1, false)?;
    }
    h = block(&vb.pp(18), h)?;
    conv(&vb.pp(19), h, W, 3, 1, true)
}
