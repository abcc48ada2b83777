//! Sampler previews as ComfyUI's default (`latent2rgb`) previewer makes
//! them: the first batch item's predicted clean latent, mapped per pixel
//! through the latent format's linear RGB factors, then `(v + 1) / 2`
//! clamped to [0, 1] and truncated to 8 bits.

use sdkit_engine::event::PreviewImage;
use std::sync::Arc;

/// SD1/SD2's latent → RGB factors (comfy/latent_formats.py, `SD15`), one
/// row per latent channel.
const SD15: [[f32; 3]; 4] = [
    [0.3512, 0.2297, 0.3227],
    [0.3250, 0.4974, 0.2350],
    [-0.2829, 0.1762, 0.2721],
    [-0.2120, -0.2616, -0.7177],
];

/// SDXL's factors and bias (`SDXL`).
const SDXL: [[f32; 3]; 4] = [
    [0.3651, 0.4232, 0.4341],
    [-0.2533, -0.0042, 0.1068],
    [0.1076, 0.1111, -0.0362],
    [-0.3165, -0.2492, -0.2188],
];
const SDXL_BIAS: [f32; 3] = [0.1084, -0.0175, -0.0011];

/// The factors for a 4-channel latent format, told apart by its scale
/// factor; None for formats without a preview mapping here.
fn factors(channels: usize, latent_scale: f32) -> Option<(&'static [[f32; 3]; 4], [f32; 3])> {
    if channels != 4 {
        return None;
    }
    if (latent_scale - 0.13025).abs() < 1e-6 {
        Some((&SDXL, SDXL_BIAS))
    } else if (latent_scale - 0.18215).abs() < 1e-6 {
        Some((&SD15, [0.0; 3]))
    } else {
        None
    }
}

/// The preview of `x0` (`[batch, channels, h, w]`, model space), or None
/// when the format has no mapping or the data is short.
pub fn latent_preview(
    x0: &[f32],
    channels: usize,
    h: usize,
    w: usize,
    latent_scale: f32,
) -> Option<PreviewImage> {
    let (f, bias) = factors(channels, latent_scale)?;
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

    #[test]
    fn sd15_pixels_follow_the_factors() {
        // Two pixels: channel values (1, 0, 0, 0) and (0, 0, 0, 1).
        let x0 = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0];
        let p = latent_preview(&x0, 4, 1, 2, 0.18215).expect("preview");
        assert_eq!((p.width, p.height), (2, 1));
        // (0.3512 + 1) / 2 · 255 = 172.28 → 172, and so on.
        assert_eq!(p.rgb[..3], [172, 156, 168]);
        // (−0.2120 + 1) / 2 · 255 = 100.47; (−0.7177 + 1)/2·255 = 35.99.
        assert_eq!(p.rgb[3..], [100, 94, 35]);
        assert!(latent_preview(&x0, 16, 1, 2, 0.18215).is_none());
        assert!(latent_preview(&x0[..4], 4, 1, 2, 0.18215).is_none());
    }

    #[test]
    fn sdxl_adds_its_bias_and_clamps() {
        let x0 = [10.0, -10.0];
        let p = latent_preview(&[0.0, 0.0, 0.0, 0.0], 4, 1, 1, 0.13025).expect("preview");
        // Bias only: (0.1084 + 1) / 2 · 255 = 141.32.
        assert_eq!(p.rgb[0], 141);
        let big = [x0[0], 0.0, 0.0, 0.0];
        let q = latent_preview(&big, 4, 1, 1, 0.13025).expect("preview");
        assert_eq!(q.rgb[0], 255);
    }
}
