//! Sampler previews as ComfyUI's previewers make them, from the first
//! batch item's predicted clean latent (model space):
//! - `latent2rgb` (the default): mapped per pixel through the latent
//!   format's linear RGB factors;
//! - TAESD (the server's default when the family's `*_decoder.*` file is
//!   in `models/vae_approx`): decoded by the TAESD decoder with scale 1
//!   and shift 0, `(x − 0.5) · 2`;
//!
//! then `(v + 1) / 2` clamped to [0, 1], × 255 and truncated to 8 bits.

use super::{graph_error, ModelFile};
use crate::models::family::LatentFormat;
use crate::models::taesd;
use sdkit_compute::backend::cpu::Bindings;
use sdkit_compute::plan::{plan, Program};
use sdkit_compute::tensor::GraphBuilder;
use sdkit_compute::weights::{SafeTensors, WeightStore};
use sdkit_engine::event::{PreviewImage, PreviewMethod};
use sdkit_engine::NodeContext;
use std::sync::Arc;

/// The TAESD preview decoder for `[1, channels, h, w]` latents of
/// `format`, when previews are TAESD and the file exists; otherwise None
/// (latent2rgb), with a warning when the file is missing or unreadable.
pub fn taesd_program(
    ctx: &NodeContext,
    format: &LatentFormat,
    (channels, h, w): (usize, usize, usize),
) -> Option<(Program, Bindings)> {
    if ctx.preview != PreviewMethod::Taesd {
        return None;
    }
    let stem = format!("{}_decoder.", format.taesd?);
    let files = ctx.paths.model_files("vae_approx");
    let Some(name) = files.iter().find(|f| f.starts_with(&stem)) else {
        tracing::debug!("no {stem}* in models/vae_approx: latent2rgb previews");
        return None;
    };
    let built = (|| -> Result<(Program, Bindings), String> {
        let path = ctx
            .paths
            .model("vae_approx", name)
            .ok_or_else(|| format!("{name}: not a model path"))?;
        let file = SafeTensors::open(&path).map_err(|e| e.to_string())?;
        let mut store = WeightStore::new();
        store.mount(Arc::new(file), "", "taesd_decoder.");
        let mf = ModelFile::new(name.clone(), store);
        let g = GraphBuilder::new();
        let out = g
            .input("x0", &[1, channels, h, w])
            .and_then(|z| {
                taesd::decoder(&g, "taesd_decoder.", z, channels)?
                    .add_scalar(-0.5)
                    .mul_scalar(2.0)
                    .add_scalar(1.0)
                    .mul_scalar(0.5)
                    .clamp(0.0, 1.0)
                    .permute(&[0, 2, 3, 1])
            })
            .map_err(|e| graph_error("TAESD preview", e).to_string())?;
        let prog = plan(&g.finish(&[out])).map_err(|e| e.to_string())?;
        let bind = mf.bindings(&prog, None, None).map_err(|e| e.to_string())?;
        Ok((prog, bind))
    })();
    match built {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::warn!("TAESD previews unavailable ({e}); using latent2rgb");
            None
        }
    }
}

/// A decoded TAESD preview image `[1, H, W, 3]` in 0..1 as 8-bit RGB.
pub fn taesd_image(px: &[f32], h: usize, w: usize) -> PreviewImage {
    PreviewImage {
        width: w as u32,
        height: h as u32,
        // torch's uint8 cast truncates toward zero.
        rgb: Arc::new(px.iter().map(|v| (v * 255.0) as u8).collect()),
    }
}

/// The preview of `x0` (`[batch, channels, h, w]`, model space) through
/// `format`'s factors, or None when the channels are not the format's or
/// the data is short.
pub fn latent_preview(
    x0: &[f32],
    channels: usize,
    h: usize,
    w: usize,
    format: &LatentFormat,
) -> Option<PreviewImage> {
    if channels != format.channels || format.rgb_factors.len() != channels {
        return None;
    }
    let (f, bias) = (format.rgb_factors, format.rgb_bias);
    let plane = h * w;
    let item = x0.get(..channels * plane)?;
    let mut rgb = Vec::with_capacity(plane * 3);
    for p in 0..plane {
        for k in 0..3 {
            let mut v = bias[k];
            for (c, row) in f.iter().enumerate() {
                v += item[c * plane + p] * row[k];
            }
            // torch's uint8 cast truncates toward zero.
            rgb.push((((v + 1.0) / 2.0).clamp(0.0, 1.0) * 255.0) as u8);
        }
    }
    Some(PreviewImage {
        width: w as u32,
        height: h as u32,
        rgb: Arc::new(rgb),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::family::{FLUX, SD15, SDXL};

    #[test]
    fn sd15_pixels_follow_the_factors() {
        // Two pixels: channel values (1, 0, 0, 0) and (0, 0, 0, 1).
        let x0 = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0];
        let p = latent_preview(&x0, 4, 1, 2, &SD15).expect("preview");
        assert_eq!((p.width, p.height), (2, 1));
        // (0.3512 + 1) / 2 · 255 = 172.28 → 172, and so on.
        assert_eq!(p.rgb[..3], [172, 156, 168]);
        // (−0.2120 + 1) / 2 · 255 = 100.47; (−0.7177 + 1)/2·255 = 35.99.
        assert_eq!(p.rgb[3..], [100, 94, 35]);
        assert!(latent_preview(&x0, 16, 1, 2, &SD15).is_none());
        assert!(latent_preview(&x0[..4], 4, 1, 2, &SD15).is_none());
    }

    #[test]
    fn sdxl_adds_its_bias_and_clamps() {
        let x0 = [10.0, -10.0];
        let p = latent_preview(&[0.0, 0.0, 0.0, 0.0], 4, 1, 1, &SDXL).expect("preview");
        // Bias only: (0.1084 + 1) / 2 · 255 = 141.32.
        assert_eq!(p.rgb[0], 141);
        let big = [x0[0], 0.0, 0.0, 0.0];
        let q = latent_preview(&big, 4, 1, 1, &SDXL).expect("preview");
        assert_eq!(q.rgb[0], 255);
    }

    #[test]
    fn sixteen_channel_formats_preview_too() {
        // A zero Flux latent shows the bias: (−0.0329 + 1) / 2 · 255 = 123.3.
        let p = latent_preview(&[0.0; 16], 16, 1, 1, &FLUX).expect("preview");
        assert_eq!(p.rgb[..], [123, 118, 116]);
        assert!(latent_preview(&[0.0; 4], 4, 1, 1, &FLUX).is_none());
    }
}
