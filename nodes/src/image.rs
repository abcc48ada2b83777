//! Image and mask nodes that need no model weights. The maths lives in
//! [`crate::imageops`]; these types only move values in and out.

use crate::imageops::{self, Crop, ImageOpError, Mask3, MaskChannel, Tensor4, UpscaleMethod};
use sdkit_engine::{memory, Inputs, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor, Value};
use std::str::FromStr;

impl From<ImageOpError> for NodeError {
    fn from(e: ImageOpError) -> Self {
        match e {
            ImageOpError::OutOfMemory { shape } => NodeError::OutOfMemory {
                what: memory::describe("image", &shape),
                bytes: memory::f32_bytes(&shape),
                available: None,
            },
            ImageOpError::Interrupted => NodeError::Interrupted,
            e => NodeError::Invalid(e.to_string()),
        }
    }
}

/// An input image's shape, for estimates (`None` when it is not an image).
fn shape_of(inputs: &Inputs, name: &str) -> Option<[usize; 4]> {
    match inputs.image(name).ok()?.shape.as_slice() {
        &[b, h, w, c] => Some([b, h, w, c]),
        _ => None,
    }
}

/// An image input's working copy plus an output of `out` (`[b, h, w, c]`).
fn copy_and_output(inputs: &Inputs, name: &str, out: [usize; 4]) -> Option<u64> {
    let input = shape_of(inputs, name)?;
    Some(memory::f32_bytes(&input).saturating_add(memory::f32_bytes(&out)))
}

fn image_in(inputs: &Inputs, name: &str) -> Result<Tensor4, NodeError> {
    let t = inputs.image(name)?;
    if t.shape.len() != 4 {
        return Err(NodeError::invalid(format!(
            "input \"{name}\": expected an image [B, H, W, C], got shape {:?}",
            t.shape
        )));
    }
    // The ops take ownership of their input; copy it fallibly, as large
    // images are what runs out of memory.
    let mut data =
        memory::try_with_capacity(t.data.len()).map_err(|e| e.for_tensor("image", &t.shape))?;
    data.extend_from_slice(&t.data);
    Ok(Tensor4::new(
        t.shape[0], t.shape[1], t.shape[2], t.shape[3], data,
    )?)
}

pub(crate) fn mask_in(inputs: &Inputs, name: &str) -> Result<Mask3, NodeError> {
    let t = inputs.mask(name)?;
    // ComfyUI accepts [H, W] masks too and treats them as a batch of one
    // (and its composites reshape to [-1, 1, H, W], taking [B, 1, H, W]).
    let (b, h, w) = match t.shape.as_slice() {
        [h, w] => (1, *h, *w),
        [b, h, w] | [b, 1, h, w] => (*b, *h, *w),
        s => {
            return Err(NodeError::invalid(format!(
                "input \"{name}\": expected a mask [B, H, W], got shape {s:?}"
            )))
        }
    };
    Ok(Mask3::new(b, h, w, t.data.clone())?)
}

fn image_out(t: Tensor4) -> Value {
    Value::image(Tensor {
        shape: vec![t.b, t.h, t.w, t.c],
        data: t.data,
    })
}

fn mask_out(m: Mask3) -> Value {
    Value::mask(Tensor {
        shape: vec![m.b, m.h, m.w],
        data: m.data,
    })
}

fn one(v: Value) -> Result<NodeOutput, NodeError> {
    Ok(NodeOutput::values(vec![v]))
}

fn method(inputs: &Inputs) -> Result<UpscaleMethod, NodeError> {
    Ok(UpscaleMethod::from_str(inputs.string("upscale_method")?)?)
}

macro_rules! image_node {
    // With an estimate of the host memory the node allocates and its form
    // as a stage of a fused image chain (`crate::image_stages`).
    ($(#[$doc:meta])* $name:ident, |$inputs:ident| $body:expr, estimate |$ein:ident| $est:expr, stage |$sin:ident| $stage:expr) => {
        $(#[$doc])*
        pub struct $name;

        impl NodeImpl for $name {
            fn execute(
                &self,
                ctx: &NodeContext,
                $inputs: &Inputs,
            ) -> Result<NodeOutput, NodeError> {
                imageops::cancellable(&ctx.cancel, || $body)
            }

            fn estimate_bytes(&self, _ctx: &NodeContext, $ein: &Inputs) -> Option<u64> {
                $est
            }

            fn image_stage(&self, $sin: &Inputs) -> Option<sdkit_engine::ImageStage> {
                $stage
            }
        }
    };
    // With an estimate of the host memory the node allocates.
    ($(#[$doc:meta])* $name:ident, |$inputs:ident| $body:expr, estimate |$ein:ident| $est:expr) => {
        image_node!($(#[$doc])* $name, |$inputs| $body, estimate |$ein| $est, stage |_s| None);
    };
    ($(#[$doc:meta])* $name:ident, |$inputs:ident| $body:expr, stage |$sin:ident| $stage:expr) => {
        image_node!($(#[$doc])* $name, |$inputs| $body, estimate |_inputs| None, stage |$sin| $stage);
    };
    ($(#[$doc:meta])* $name:ident, |$inputs:ident| $body:expr) => {
        image_node!($(#[$doc])* $name, |$inputs| $body, estimate |_inputs| None);
    };
}

/// FluxKontextImageScale's sizes, `(width, height)`: about a megapixel
/// each, the aspect ratios Kontext was trained on.
pub const KONTEXT_RESOLUTIONS: [(usize, usize); 17] = [
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
];

/// The [`KONTEXT_RESOLUTIONS`] size nearest a `width × height` image's
/// aspect ratio (ties to the smaller width, then height, as ComfyUI's
/// `min` over tuples).
pub fn kontext_size(width: usize, height: usize) -> (usize, usize) {
    let aspect = width as f64 / height.max(1) as f64;
    let key = |&(w, h): &(usize, usize)| ((aspect - w as f64 / h as f64).abs(), w, h);
    KONTEXT_RESOLUTIONS
        .iter()
        .copied()
        .min_by(|a, b| {
            key(a)
                .partial_cmp(&key(b))
                .unwrap_or(std::cmp::Ordering::Equal)
        })
        .unwrap_or((1024, 1024))
}

image_node!(
    /// ComfyUI's FluxKontextImageScale: Lanczos to the nearest of
    /// Kontext's sizes, centre-cropped to its aspect ratio.
    FluxKontextImageScale,
    |inputs| {
        let img = image_in(inputs, "image")?;
        let (w, h) = kontext_size(img.w, img.h);
        one(image_out(imageops::scale_to(
            &img,
            UpscaleMethod::Lanczos,
            w,
            h,
            Crop::Center,
        )?))
    },
    estimate |inputs| {
        let [b, h, w, c] = shape_of(inputs, "image")?;
        let (nw, nh) = kontext_size(w, h);
        copy_and_output(inputs, "image", [b, nh, nw, c])
    }
);

image_node!(
    /// ComfyUI's ImageScaleToTotalPixels.
    ImageScaleToTotalPixels,
    |inputs| {
        let img = image_in(inputs, "image")?;
        one(image_out(imageops::scale_to_total_pixels(
            &img,
            method(inputs)?,
            inputs.float("megapixels")?,
        )?))
    },
    stage |inputs| crate::image_stages::scale_to_total_pixels(inputs)
);

image_node!(
    /// ComfyUI's ImageFlip.
    ImageFlip,
    |inputs| {
        let img = image_in(inputs, "image")?;
        let vertical = inputs.string("flip_method")?.starts_with('x');
        one(image_out(imageops::flip(&img, vertical)?))
    }
);

image_node!(
    /// ComfyUI's ImageRotate: quarter turns clockwise.
    ImageRotate,
    |inputs| {
        let img = image_in(inputs, "image")?;
        let r = inputs.string("rotation")?;
        let k = if r.starts_with("90") {
            1
        } else if r.starts_with("180") {
            2
        } else if r.starts_with("270") {
            3
        } else {
            0
        };
        one(image_out(imageops::rotate(&img, k)?))
    }
);

image_node!(
    /// ComfyUI's ImageCompositeMasked.
    ImageCompositeMasked,
    |inputs| {
        let dst = image_in(inputs, "destination")?;
        let src = image_in(inputs, "source")?;
        let mask = match inputs.get("mask") {
            Some(_) => Some(mask_in(inputs, "mask")?),
            None => None,
        };
        one(image_out(imageops::composite(
            &dst,
            &src,
            (inputs.usize("x")?, inputs.usize("y")?),
            mask.as_ref(),
            inputs.bool("resize_source")?,
        )?))
    }
);

/// ComfyUI's GetImageSize: the image's width, height and batch size.
pub struct GetImageSize;

impl NodeImpl for GetImageSize {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let [b, h, w, _] = shape_of(inputs, "image")
            .ok_or_else(|| NodeError::invalid("input \"image\": expected an image [B, H, W, C]"))?;
        Ok(NodeOutput::values(
            [w, h, b].map(|v| Value::Int(v as i128)).to_vec(),
        ))
    }
}

image_node!(
    /// ComfyUI's ImageStitch.
    ImageStitch,
    |inputs| {
        let first = image_in(inputs, "image1")?;
        let second = match inputs.get("image2") {
            Some(_) => Some(image_in(inputs, "image2")?),
            None => None,
        };
        one(image_out(imageops::stitch(
            &first,
            second.as_ref(),
            inputs.string("direction")?,
            inputs.bool("match_image_size")?,
            inputs.usize("spacing_width")?,
            inputs.string("spacing_color")?,
        )?))
    }
);

image_node!(
    /// ComfyUI's ImageBlend.
    ImageBlend,
    |inputs| {
        one(image_out(imageops::blend(
            &image_in(inputs, "image1")?,
            &image_in(inputs, "image2")?,
            inputs.float("blend_factor")?,
            inputs.string("blend_mode")?,
        )?))
    }
);

image_node!(
    /// ComfyUI's ResizeAndPadImage.
    ResizeAndPadImage,
    |inputs| {
        let interpolation = UpscaleMethod::from_str(inputs.string("interpolation")?)?;
        one(image_out(imageops::resize_and_pad(
            &image_in(inputs, "image")?,
            (inputs.usize("target_width")?, inputs.usize("target_height")?),
            inputs.string("padding_color")? == "white",
            interpolation,
        )?))
    }
);

image_node!(
    /// ComfyUI's FeatherMask.
    FeatherMask,
    |inputs| {
        let m = mask_in(inputs, "mask")?;
        let side = ["left", "top", "right", "bottom"].map(|k| inputs.usize(k));
        let [l, t, r, b] = side;
        one(mask_out(imageops::feather_mask(&m, [l?, t?, r?, b?])))
    }
);

image_node!(
    /// ComfyUI's CropMask.
    CropMask,
    |inputs| {
        let m = mask_in(inputs, "mask")?;
        one(mask_out(imageops::crop_mask(
            &m,
            (inputs.usize("x")?, inputs.usize("y")?),
            (inputs.usize("width")?, inputs.usize("height")?),
        )?))
    }
);

image_node!(
    /// ComfyUI's MaskComposite.
    MaskComposite,
    |inputs| {
        one(mask_out(imageops::mask_composite(
            &mask_in(inputs, "destination")?,
            &mask_in(inputs, "source")?,
            (inputs.usize("x")?, inputs.usize("y")?),
            inputs.string("operation")?,
        )?))
    }
);

image_node!(
    /// ComfyUI's GrowMask.
    GrowMask,
    |inputs| {
        let m = mask_in(inputs, "mask")?;
        let expand = i64::try_from(inputs.int("expand")?)
            .map_err(|_| NodeError::invalid("expand is out of range"))?;
        one(mask_out(imageops::grow_mask(
            &m,
            expand,
            inputs.bool("tapered_corners")?,
        )?))
    }
);

image_node!(
    /// ComfyUI's ThresholdMask.
    ThresholdMask,
    |inputs| {
        let m = mask_in(inputs, "mask")?;
        one(mask_out(imageops::threshold_mask(&m, inputs.float("value")?)))
    }
);

image_node!(
    /// ComfyUI's ImagePadForOutpaint: the padded image and its mask.
    ImagePadForOutpaint,
    |inputs| {
        let img = image_in(inputs, "image")?;
        let pad = ["left", "top", "right", "bottom"].map(|k| inputs.usize(k));
        let [l, t, r, b] = pad;
        let (image, mask) = imageops::pad_for_outpaint(
            &img,
            [l?, t?, r?, b?],
            inputs.usize("feathering")?,
        )?;
        Ok(NodeOutput::values(vec![image_out(image), mask_out(mask)]))
    },
    estimate |inputs| {
        let [b, h, w, c] = shape_of(inputs, "image")?;
        let pad = |k: &str| inputs.usize(k).ok();
        let (nh, nw) = (h + pad("top")? + pad("bottom")?, w + pad("left")? + pad("right")?);
        copy_and_output(inputs, "image", [b, nh, nw, c + 1])
    }
);

image_node!(
    /// ComfyUI's ImageScale; width or height 0 keeps the aspect ratio.
    ImageScale,
    |inputs| {
        let img = image_in(inputs, "image")?;
        let crop = Crop::from_str(inputs.string("crop")?)?;
        one(image_out(imageops::scale_to(
            &img,
            method(inputs)?,
            inputs.usize("width")?,
            inputs.usize("height")?,
            crop,
        )?))
    },
    estimate |inputs| {
        let [b, h, w, c] = shape_of(inputs, "image")?;
        let (width, height) = imageops::scale_to_size(
            w,
            h,
            inputs.usize("width").ok()?,
            inputs.usize("height").ok()?,
        );
        copy_and_output(inputs, "image", [b, height, width, c])
    },
    stage |inputs| crate::image_stages::scale_to(inputs)
);

image_node!(
    /// ComfyUI's ImageScaleBy.
    ImageScaleBy,
    |inputs| {
        let img = image_in(inputs, "image")?;
        one(image_out(imageops::scale_by(
            &img,
            method(inputs)?,
            inputs.float("scale_by")?,
        )?))
    },
    estimate |inputs| {
        let [b, h, w, c] = shape_of(inputs, "image")?;
        let (width, height) = imageops::scale_by_size(w, h, inputs.float("scale_by").ok()?);
        copy_and_output(inputs, "image", [b, height, width, c])
    },
    stage |inputs| crate::image_stages::scale_by(inputs)
);

image_node!(
    /// ComfyUI's Canny (kornia's edge detector; see `imageops::canny`).
    Canny,
    |inputs| {
        let img = image_in(inputs, "image")?;
        one(image_out(imageops::canny(
            &img,
            inputs.float("low_threshold")? as f32,
            inputs.float("high_threshold")? as f32,
        )?))
    }
);

image_node!(
    /// ComfyUI's ImageInvert: 1 - x.
    ImageInvert,
    |inputs| one(image_out(imageops::invert(&image_in(inputs, "image")?))),
    stage |_inputs| crate::image_stages::invert()
);

image_node!(
    /// ComfyUI's ImageCrop.
    ImageCrop,
    |inputs| {
        let img = image_in(inputs, "image")?;
        one(image_out(imageops::crop(
            &img,
            inputs.usize("width")?,
            inputs.usize("height")?,
            inputs.usize("x")?,
            inputs.usize("y")?,
        )?))
    },
    estimate |inputs| {
        let [b, h, w, c] = shape_of(inputs, "image")?;
        let (width, height) = (inputs.usize("width").ok()?, inputs.usize("height").ok()?);
        copy_and_output(inputs, "image", [b, height.min(h), width.min(w), c])
    },
    stage |inputs| crate::image_stages::crop(inputs)
);

image_node!(
    /// ComfyUI's ImageBlur (Gaussian, reflect padding).
    ImageBlur,
    |inputs| {
        let img = image_in(inputs, "image")?;
        one(image_out(imageops::blur(
            &img,
            inputs.usize("blur_radius")?,
            inputs.float("sigma")?,
        )?))
    },
    stage |inputs| crate::image_stages::blur(inputs)
);

image_node!(
    /// ComfyUI's ImageSharpen.
    ImageSharpen,
    |inputs| {
        let img = image_in(inputs, "image")?;
        one(image_out(imageops::sharpen(
            &img,
            inputs.usize("sharpen_radius")?,
            inputs.float("sigma")?,
            inputs.float("alpha")?,
        )?))
    },
    stage |inputs| crate::image_stages::sharpen(inputs)
);

image_node!(
    /// ComfyUI's ImageBatch: image2 is resized to image1's size if needed.
    ImageBatch,
    |inputs| {
        let a = image_in(inputs, "image1")?;
        let b = image_in(inputs, "image2")?;
        one(image_out(imageops::batch(&a, &b)?))
    },
    estimate |inputs| {
        // Both copies, image2 resized to image1's size, and the batch.
        let [b1, h, w, c] = shape_of(inputs, "image1")?;
        let [b2, ..] = shape_of(inputs, "image2")?;
        let second = copy_and_output(inputs, "image2", [b2, h, w, c])?;
        Some(second.saturating_add(2 * memory::f32_bytes(&[b1 + b2, h, w, c])))
    }
);

image_node!(
    /// ComfyUI's EmptyImage: a batch filled with a 0xRRGGBB colour.
    EmptyImage,
    |inputs| {
        let color = inputs.int("color")?;
        let color = u32::try_from(color)
            .map_err(|_| NodeError::invalid(format!("color {color} is not a 24-bit RGB value")))?;
        one(image_out(imageops::empty_image(
            inputs.usize("width")?,
            inputs.usize("height")?,
            inputs.usize("batch_size")?,
            color,
        )?))
    },
    estimate |inputs| {
        let dims = ["batch_size", "height", "width"].map(|n| inputs.usize(n).ok());
        let [Some(b), Some(h), Some(w)] = dims else {
            return None;
        };
        Some(memory::f32_bytes(&[b, h, w, 3]))
    }
);

image_node!(
    /// ComfyUI's ImageToMask: one channel of an image.
    ImageToMask,
    |inputs| {
        let img = image_in(inputs, "image")?;
        let ch = MaskChannel::from_str(inputs.string("channel")?)?;
        one(mask_out(imageops::image_to_mask(&img, ch)?))
    }
);

image_node!(
    /// ComfyUI's MaskToImage: the mask in all three channels.
    MaskToImage,
    |inputs| one(image_out(imageops::mask_to_image(&mask_in(inputs, "mask")?)))
);

image_node!(
    /// ComfyUI's SolidMask.
    SolidMask,
    |inputs| {
        one(mask_out(imageops::solid_mask(
            inputs.float("value")?,
            inputs.usize("width")?,
            inputs.usize("height")?,
        )?))
    }
);

image_node!(
    /// ComfyUI's InvertMask: 1 - mask.
    InvertMask,
    |inputs| one(mask_out(imageops::invert_mask(&mask_in(inputs, "mask")?)))
);

image_node!(
    /// ComfyUI's RepeatImageBatch: the whole batch `amount` times.
    RepeatImageBatch,
    |inputs| {
        let img = image_in(inputs, "image")?;
        one(image_out(imageops::repeat_image_batch(
            &img,
            inputs.usize("amount")?,
        )?))
    },
    stage |inputs| crate::image_stages::repeat_batch(inputs)
);

image_node!(
    /// ComfyUI's ImageFromBatch: `length` images from `batch_index`
    /// (both clamped to the batch).
    ImageFromBatch,
    |inputs| {
        let img = image_in(inputs, "image")?;
        one(image_out(imageops::image_from_batch(
            &img,
            inputs.usize("batch_index")?,
            inputs.usize("length")?,
        )?))
    },
    stage |inputs| crate::image_stages::from_batch(inputs)
);

image_node!(
    /// ComfyUI's ImageColorToMask: 1 where a pixel is `color` (0xRRGGBB).
    ImageColorToMask,
    |inputs| {
        let img = image_in(inputs, "image")?;
        let color = i64::try_from(inputs.int("color")?)
            .map_err(|_| NodeError::invalid("color is out of range"))?;
        one(mask_out(imageops::image_color_to_mask(&img, color)?))
    }
);

image_node!(
    /// ComfyUI's ImageScaleToMaxDimension: the longer side to
    /// `largest_size`, the aspect kept.
    ImageScaleToMaxDimension,
    |inputs| {
        let img = image_in(inputs, "image")?;
        one(image_out(imageops::scale_to_max_dimension(
            &img,
            method(inputs)?,
            inputs.usize("largest_size")?,
        )?))
    },
    stage |inputs| crate::image_stages::scale_to_max_dimension(inputs)
);
