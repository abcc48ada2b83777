//! Decoding user image files safely: every decode of an image a user
//! supplied (LoadImage, the server's `/view` previews) goes through here.
//!
//! A small file can declare an enormous image (a "decompression bomb": a
//! 1 MB PNG of 20000×20000 decodes to 1.2 GB of pixels and 4.8 GB of f32
//! tensors). As Pillow does for ComfyUI, images over
//! [`MAX_IMAGE_PIXELS`] are refused from their header, before any pixel
//! memory is allocated, and the image crate's [`Limits`] bound what its
//! decoders allocate as a second guard.

use image::codecs::gif::GifDecoder;
use image::codecs::png::PngDecoder;
use image::codecs::webp::WebPDecoder;
use image::{
    AnimationDecoder, DynamicImage, Frame, ImageDecoder, ImageFormat, ImageReader, Limits,
    RgbaImage,
};
use sdkit_engine::memory::try_with_capacity;
use sdkit_engine::{CancelToken, NodeError, Tensor};
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

/// The most pixels an image may have: ComfyUI refuses images over Pillow's
/// `MAX_IMAGE_PIXELS * 2` (Pillow raises `DecompressionBombError` there).
pub const MAX_IMAGE_PIXELS: u64 = 178_956_970;

/// The decoders' allocation cap: the largest allowed image at 16-bit RGBA,
/// the widest layout they produce.
const MAX_DECODE_ALLOC: u64 = MAX_IMAGE_PIXELS * 8;

fn limits() -> Limits {
    let mut l = Limits::default();
    l.max_alloc = Some(MAX_DECODE_ALLOC);
    l
}

fn cannot_decode(path: &Path, e: impl std::fmt::Display) -> NodeError {
    NodeError::file(path, format!("cannot decode image: {e}"))
}

/// Refuses dimensions over [`MAX_IMAGE_PIXELS`], in Pillow's words.
fn check_size(path: &Path, width: u32, height: u32) -> Result<(), NodeError> {
    let pixels = u64::from(width) * u64::from(height);
    if pixels > MAX_IMAGE_PIXELS {
        return Err(NodeError::file(
            path,
            format!(
                "image size ({width}×{height} = {pixels} pixels) exceeds the limit of \
                 {MAX_IMAGE_PIXELS} pixels, could be a decompression bomb"
            ),
        ));
    }
    Ok(())
}

fn open(path: &Path) -> Result<ImageReader<BufReader<File>>, NodeError> {
    let mut reader = ImageReader::open(path)
        .map_err(|e| NodeError::file(path, e))?
        .with_guessed_format()
        .map_err(|e| NodeError::file(path, e))?;
    reader.limits(limits());
    Ok(reader)
}

/// An image file's width and height, read from its header only; refuses
/// images over the size limit.
pub fn dimensions(path: &Path) -> Result<(u32, u32), NodeError> {
    let decoder = open(path)?
        .into_decoder()
        .map_err(|e| cannot_decode(path, e))?;
    let (w, h) = decoder.dimensions();
    check_size(path, w, h)?;
    Ok((w, h))
}

/// Decodes an image file's first (or only) frame, applying its EXIF
/// orientation as ComfyUI's `ImageOps.exif_transpose` does. Images over
/// the size limit are refused before their pixels are allocated.
pub fn decode(path: &Path) -> Result<DynamicImage, NodeError> {
    let mut decoder = open(path)?
        .into_decoder()
        .map_err(|e| cannot_decode(path, e))?;
    let (w, h) = decoder.dimensions();
    check_size(path, w, h)?;
    let orientation = decoder.orientation().ok();
    let mut img = DynamicImage::from_decoder(decoder).map_err(|e| cannot_decode(path, e))?;
    if let Some(o) = orientation {
        img.apply_orientation(o);
    }
    Ok(img)
}

/// The frames of an animated GIF, PNG (APNG) or WebP, or `None` for a
/// still image. Each frame is checked against the size limit as it comes.
fn animation_frames<'a>(
    path: &Path,
) -> Result<Option<Box<dyn Iterator<Item = image::ImageResult<Frame>> + 'a>>, NodeError> {
    let reader = open(path)?;
    let Some(format) = reader.format() else {
        return Ok(None);
    };
    let file = || -> Result<BufReader<File>, NodeError> {
        Ok(BufReader::new(
            File::open(path).map_err(|e| NodeError::file(path, e))?,
        ))
    };
    let decode_err = |e| cannot_decode(path, e);
    let frames: Box<dyn Iterator<Item = _>> = match format {
        ImageFormat::Gif => {
            let mut d = GifDecoder::new(file()?).map_err(decode_err)?;
            let (w, h) = d.dimensions();
            check_size(path, w, h)?;
            d.set_limits(limits()).map_err(decode_err)?;
            Box::new(d.into_frames())
        }
        ImageFormat::Png => {
            let d = PngDecoder::with_limits(file()?, limits()).map_err(decode_err)?;
            if !d.is_apng().map_err(decode_err)? {
                return Ok(None);
            }
            let (w, h) = d.dimensions();
            check_size(path, w, h)?;
            Box::new(d.apng().map_err(decode_err)?.into_frames())
        }
        ImageFormat::WebP => {
            let mut d = WebPDecoder::new(file()?).map_err(decode_err)?;
            if !d.has_animation() {
                return Ok(None);
            }
            let (w, h) = d.dimensions();
            check_size(path, w, h)?;
            d.set_limits(limits()).map_err(decode_err)?;
            Box::new(d.into_frames())
        }
        _ => return Ok(None),
    };
    Ok(Some(frames))
}

/// ComfyUI's LoadImage on a file: IMAGE `[n, h, w, 3]` and MASK (`1 -
/// alpha`, or `[n, 64, 64]` zeros when no frame has transparency). An
/// animation gives all its frames as a batch, skipping frames whose size
/// differs from the first, as ComfyUI's `ImageSequence` loop does.
pub fn load_tensors(path: &Path, cancel: &CancelToken) -> Result<(Tensor, Tensor), NodeError> {
    let Some(frames) = animation_frames(path)? else {
        let img = decode(path)?;
        return image_to_tensors(&img).map_err(|e| e.node_error(path));
    };
    let mut batch = FrameBatch::default();
    for frame in frames {
        if cancel.is_cancelled() {
            return Err(NodeError::Interrupted);
        }
        let buf = frame.map_err(|e| cannot_decode(path, e))?.into_buffer();
        check_size(path, buf.width(), buf.height())?;
        batch.push(&buf).map_err(|e| e.node_error(path))?;
    }
    if batch.n == 0 {
        // An APNG whose default image is not part of its animation has
        // no frames to iterate: load the default image.
        let img = decode(path)?;
        return image_to_tensors(&img).map_err(|e| e.node_error(path));
    }
    Ok(batch.finish())
}

/// IMAGE and MASK tensors from a decoded still image, as ComfyUI builds
/// them: 8-bit values / 255 in f32; a mask from alpha when the image has
/// an alpha channel, else a 64×64 zero mask.
pub fn image_to_tensors(img: &DynamicImage) -> Result<(Tensor, Tensor), TensorAllocError> {
    let (w, h) = (img.width() as usize, img.height() as usize);
    // 16-bit grayscale is PIL mode "I": ComfyUI scales it by 1/255 and
    // clips to 8 bits, which saturates most values. Keep its behaviour.
    let rgb = match img {
        DynamicImage::ImageLuma16(g) => {
            let mut out = image::RgbImage::new(w as u32, h as u32);
            for (o, p) in out.pixels_mut().zip(g.pixels()) {
                let v = (f64::from(p.0[0]) / 255.0).clamp(0.0, 255.0) as u8;
                *o = image::Rgb([v, v, v]);
            }
            out
        }
        _ => img.to_rgb8(),
    };
    let image_shape = vec![1, h, w, 3];
    let mut data = try_with_capacity(rgb.len()).map_err(|_| alloc_error("image", &image_shape))?;
    data.extend(rgb.as_raw().iter().map(|&v| f32::from(v) / 255.0));
    drop(rgb);
    let image = Tensor {
        shape: image_shape,
        data,
    };
    let mask = if img.color().has_alpha() {
        let shape = vec![1, h, w];
        let mut data = try_with_capacity(w * h).map_err(|_| alloc_error("mask", &shape))?;
        data.extend(
            img.to_rgba8()
                .pixels()
                .map(|p| 1.0 - f32::from(p.0[3]) / 255.0),
        );
        Tensor { shape, data }
    } else {
        Tensor::zeros(vec![1, 64, 64])
    };
    Ok((image, mask))
}

/// IMAGE and MASK batches built frame by frame, so an animation is never
/// held twice (as decoded frames and as tensors).
#[derive(Default)]
struct FrameBatch {
    n: usize,
    size: (usize, usize),
    image: Vec<f32>,
    mask: Vec<f32>,
    transparent: bool,
}

impl FrameBatch {
    /// Appends a frame; one of another size than the first is skipped.
    fn push(&mut self, f: &RgbaImage) -> Result<(), TensorAllocError> {
        let size = (f.width() as usize, f.height() as usize);
        if self.n > 0 && size != self.size {
            return Ok(());
        }
        let (w, h) = size;
        let n = self.n + 1;
        self.image
            .try_reserve(w * h * 3)
            .map_err(|_| alloc_error("image", &[n, h, w, 3]))?;
        self.mask
            .try_reserve(w * h)
            .map_err(|_| alloc_error("mask", &[n, h, w]))?;
        for p in f.pixels() {
            self.image
                .extend(p.0[..3].iter().map(|&v| f32::from(v) / 255.0));
            self.mask.push(1.0 - f32::from(p.0[3]) / 255.0);
            self.transparent |= p.0[3] != 255;
        }
        self.n = n;
        self.size = size;
        Ok(())
    }

    fn finish(self) -> (Tensor, Tensor) {
        let (w, h) = self.size;
        let image = Tensor {
            shape: vec![self.n, h, w, 3],
            data: self.image,
        };
        // Opaque frames get ComfyUI's 64×64 zero masks.
        let mask = if self.transparent {
            Tensor {
                shape: vec![self.n, h, w],
                data: self.mask,
            }
        } else {
            Tensor::zeros(vec![self.n, 64, 64])
        };
        (image, mask)
    }
}

fn alloc_error(kind: &'static str, shape: &[usize]) -> TensorAllocError {
    TensorAllocError {
        kind,
        shape: shape.to_vec(),
        bytes: sdkit_engine::memory::f32_bytes(shape),
    }
}

/// A tensor allocation that failed while converting a decoded image.
#[derive(Debug)]
pub struct TensorAllocError {
    kind: &'static str,
    shape: Vec<usize>,
    bytes: u64,
}

impl TensorAllocError {
    fn node_error(self, path: &Path) -> NodeError {
        NodeError::OutOfMemory {
            what: format!(
                "{} from {}",
                sdkit_engine::memory::describe(self.kind, &self.shape),
                path.display()
            ),
            bytes: self.bytes,
            available: None,
        }
    }
}

/// About how much host memory loading `path` takes: the decoded pixels
/// (up to 16-bit RGBA) plus the f32 image and mask. One frame's worth; an
/// animation's frame count is not in its header. `None` when the header
/// cannot be read (the load itself will report why).
pub fn estimate_load_bytes(path: &Path) -> Option<u64> {
    let (w, h) = dimensions(path).ok()?;
    Some(u64::from(w) * u64::from(h) * (8 + 12 + 4))
}
