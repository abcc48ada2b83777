//! Image nodes in tensor form, for fused image chains: on a GPU, VAEDecode
//! appends these to its program (see `sdkit_engine::ImageStage`), so an
//! image that is inverted, scaled (ImageScale, ImageScaleBy,
//! ImageScaleToTotalPixels, ImageScaleToMaxDimension), blurred, sharpened,
//! cropped, repeated (RepeatImageBatch) or cut from its batch
//! (ImageFromBatch) reaches the host once. Only
//! what the tensor ops compute as ComfyUI's PyTorch does has a stage
//! (bilinear without antialias is `F.interpolate`'s; nearest-exact, area,
//! bicubic and Lanczos stay on the host). The host functions in
//! `imageops` remain the reference: `nodes/tests/image_stages.rs` checks
//! each stage against them.

use crate::imageops::{self, Crop, UpscaleMethod};
use sdkit_compute::tensor::{Conv2dParams, GraphBuilder, ShapeError, UpsampleMode, T};
use sdkit_engine::{ImageStage, Inputs};
use std::str::FromStr;
use std::sync::Arc;

type R<'a> = Result<T<'a>, ShapeError>;

fn refuse(message: impl Into<String>, shape: &[usize]) -> ShapeError {
    ShapeError {
        op: "image stage",
        message: message.into(),
        shapes: vec![shape.to_vec()],
    }
}

/// `[b, h, w, c]` of an IMAGE.
fn dims(x: &T<'_>) -> Result<[usize; 4], ShapeError> {
    let s = x.shape();
    <[usize; 4]>::try_from(s.as_slice()).map_err(|_| refuse("expected an IMAGE [b, h, w, c]", &s))
}

/// ImageInvert: `1 − x` (as `−x + 1`, the same rounding).
pub fn invert() -> Option<ImageStage> {
    Some(ImageStage::new("image", |_g: &GraphBuilder, x| {
        Ok(x.neg().add_scalar(1.0))
    }))
}

/// Bilinear resizing (align_corners false, no antialias) of the window
/// `(x0, y0, w, h)` to `width × height`.
fn resize<'a>(
    x: T<'a>,
    window: (usize, usize, usize, usize),
    width: usize,
    height: usize,
) -> R<'a> {
    let [_, in_h, in_w, _] = dims(&x)?;
    let (x0, y0, w, h) = window;
    let mut x = x;
    if (w, h) != (in_w, in_h) {
        x = x.slice(1, y0, y0 + h)?.slice(2, x0, x0 + w)?;
    }
    if (width, height) == (w, h) {
        // F.interpolate to the same size copies.
        return Ok(x);
    }
    x.permute(&[0, 3, 1, 2])?
        .upsample(
            UpsampleMode::Bilinear {
                align_corners: false,
            },
            height,
            width,
        )?
        .permute(&[0, 2, 3, 1])
}

fn bilinear(inputs: &Inputs) -> bool {
    inputs
        .string("upscale_method")
        .ok()
        .and_then(|m| UpscaleMethod::from_str(m).ok())
        == Some(UpscaleMethod::Bilinear)
}

/// The float input `name` where the method is bilinear and the value is
/// positive (else the host reports the error).
fn bilinear_with(inputs: &Inputs, name: &str) -> Option<f64> {
    let v = inputs.float(name).ok()?;
    (bilinear(inputs) && v.is_finite() && v > 0.0).then_some(v)
}

/// ImageScale with the bilinear method.
pub fn scale_to(inputs: &Inputs) -> Option<ImageStage> {
    if !bilinear(inputs) {
        return None;
    }
    let crop = Crop::from_str(inputs.string("crop").ok()?).ok()?;
    let (width, height) = (inputs.usize("width").ok()?, inputs.usize("height").ok()?);
    Some(ImageStage::new("image", move |_g: &GraphBuilder, x| {
        let [_, h, w, _] = dims(&x)?;
        if (width, height) == (0, 0) {
            return Ok(x);
        }
        let (ow, oh) = imageops::scale_to_size(w, h, width, height);
        let window = imageops::crop_window(w, h, ow, oh, crop)
            .map_err(|e| refuse(e.to_string(), &x.shape()))?;
        resize(x, window, ow, oh)
    }))
}

/// ImageScaleBy with the bilinear method.
pub fn scale_by(inputs: &Inputs) -> Option<ImageStage> {
    let s = bilinear_with(inputs, "scale_by")?;
    Some(resize_to(move |w, h| imageops::scale_by_size(w, h, s)))
}

/// A bilinear resize of the whole image to the size `size(w, h)` gives.
fn resize_to(size: impl Fn(usize, usize) -> (usize, usize) + Send + Sync + 'static) -> ImageStage {
    ImageStage::new("image", move |_g: &GraphBuilder, x| {
        let [_, h, w, _] = dims(&x)?;
        let (ow, oh) = size(w, h);
        if ow == 0 || oh == 0 {
            return Err(refuse("scales to nothing", &x.shape()));
        }
        resize(x, (0, 0, w, h), ow, oh)
    })
}

/// ImageScaleToTotalPixels with the bilinear method.
pub fn scale_to_total_pixels(inputs: &Inputs) -> Option<ImageStage> {
    let mp = bilinear_with(inputs, "megapixels")?;
    Some(resize_to(move |w, h| imageops::total_pixels_size(w, h, mp)))
}

/// ImageScaleToMaxDimension with the bilinear method.
pub fn scale_to_max_dimension(inputs: &Inputs) -> Option<ImageStage> {
    if !bilinear(inputs) {
        return None;
    }
    let largest = inputs.usize("largest_size").ok()?;
    Some(resize_to(move |w, h| {
        imageops::max_dimension_size(w, h, largest)
    }))
}

/// ImageCrop: the window from `(x, y)`, clipped to the image (the corner
/// to its last pixel).
pub fn crop(inputs: &Inputs) -> Option<ImageStage> {
    let (width, height) = (inputs.usize("width").ok()?, inputs.usize("height").ok()?);
    let (x0, y0) = (inputs.usize("x").ok()?, inputs.usize("y").ok()?);
    if width == 0 || height == 0 {
        return None;
    }
    Some(ImageStage::new("image", move |_g: &GraphBuilder, x| {
        let [_, h, w, _] = dims(&x)?;
        if h == 0 || w == 0 {
            return Err(refuse("an empty image", &x.shape()));
        }
        let (cx, cy) = (x0.min(w - 1), y0.min(h - 1));
        let (x1, y1) = (
            cx.saturating_add(width).min(w),
            cy.saturating_add(height).min(h),
        );
        x.slice(1, cy, y1)?.slice(2, cx, x1)
    }))
}

/// RepeatImageBatch: the whole batch `amount` times, as a broadcast along
/// a new leading axis folded into the batch.
pub fn repeat_batch(inputs: &Inputs) -> Option<ImageStage> {
    let amount = inputs.usize("amount").ok().filter(|&a| a > 0)?;
    Some(ImageStage::new("image", move |_g: &GraphBuilder, x| {
        let [b, h, w, c] = dims(&x)?;
        if amount == 1 {
            return Ok(x);
        }
        x.reshape(&[1, b, h, w, c])?
            .expand(&[amount, b, h, w, c])?
            .reshape(&[amount * b, h, w, c])
    }))
}

/// ImageFromBatch: `length` images from `batch_index`, clamped to the
/// batch as the host clamps them.
pub fn from_batch(inputs: &Inputs) -> Option<ImageStage> {
    let index = inputs.usize("batch_index").ok()?;
    let length = inputs.usize("length").ok().filter(|&l| l > 0)?;
    Some(ImageStage::new("image", move |_g: &GraphBuilder, x| {
        let [b, ..] = dims(&x)?;
        if b == 0 {
            return Err(refuse("an empty image batch", &x.shape()));
        }
        let r = imageops::batch_range(b, index, length);
        x.slice(0, r.start, r.end)
    }))
}

/// ImageBlur: the Gaussian kernel over the reflect-padded image.
pub fn blur(inputs: &Inputs) -> Option<ImageStage> {
    let radius = inputs.usize("blur_radius").ok()?;
    let sigma = inputs.float("sigma").ok()?;
    Some(reflect_conv(
        radius,
        imageops::blur_kernel(radius, sigma),
        false,
    ))
}

/// ImageSharpen: its kernel over the reflect-padded image, clamped to 0..1.
pub fn sharpen(inputs: &Inputs) -> Option<ImageStage> {
    let radius = inputs.usize("sharpen_radius").ok()?;
    let sigma = inputs.float("sigma").ok()?;
    let alpha = inputs.float("alpha").ok()?;
    Some(reflect_conv(
        radius,
        imageops::sharpen_kernel(radius, sigma, alpha),
        true,
    ))
}

/// ComfyUI's Blur/Sharpen in tensor form: reflect padding by `radius`,
/// then a depthwise convolution with the `k x k` kernel (its extra zero
/// padding is cropped away again there, so it is left out here), then
/// optionally the clamp to 0..1. Radius 0 passes the image through, as the
/// nodes do; a radius the image is too small to reflect fails the stage
/// (`pad_reflect` refuses it), and the node then reports it.
fn reflect_conv(radius: usize, kernel: Vec<f32>, clamp: bool) -> ImageStage {
    if radius == 0 {
        return ImageStage::new("image", |_g: &GraphBuilder, x| Ok(x));
    }
    let k = 2 * radius + 1;
    ImageStage::new("image", move |g: &GraphBuilder, x| {
        let [_, _, _, c] = dims(&x)?;
        let kernel = g.input("kernel", &[1, 1, k, k])?.expand(&[c, 1, k, k])?;
        let r = radius;
        let y = x
            .permute(&[0, 3, 1, 2])?
            .pad_reflect(&[(0, 0), (0, 0), (r, r), (r, r)])?
            .conv2d(
                kernel,
                None,
                Conv2dParams {
                    stride: [1, 1],
                    padding: [0, 0],
                    dilation: [1, 1],
                    groups: c,
                },
            )?;
        let y = if clamp { y.clamp(0.0, 1.0) } else { y };
        y.permute(&[0, 2, 3, 1])
    })
    .with_data(vec![("kernel", Arc::new(kernel))])
}
