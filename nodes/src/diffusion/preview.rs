//! Sampler previews as ComfyUI's default (`latent2rgb`) previewer makes
//! them: the first batch item's predicted clean latent, mapped per pixel
//! through the latent format's linear RGB factors, then `(v + 1) / 2`
//! clamped to [0, 1] and truncated to 8 bits.

use crate::models::family::LatentFormat;
use sdkit_engine::event::PreviewImage;
use std::sync::Arc;

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
