//! Pure image operations on ComfyUI's IMAGE and MASK tensors.
//!
//! Layouts (as in ComfyUI):
//! * IMAGE is [`Tensor4`]: `f32`, `[batch, height, width, channels]`,
//!   row-major (BHWC), values nominally in `0..=1`.
//! * MASK is [`Mask3`]: `f32`, `[batch, height, width]`, row-major.
//!
//! Everything here reproduces the arithmetic of the Python reference
//! (ComfyUI on top of PyTorch 2.x CPU kernels, NumPy and Pillow) operation
//! by operation in `f32`, including where the x86-64 PyTorch build contracts
//! `a * b + c` into a fused multiply-add, so that results are bit-identical
//! to ComfyUI on CPU wherever that is achievable. The exceptions (documented
//! on the functions concerned) are the Gaussian kernel of blur/sharpen, whose
//! `sqrt`/`exp` come from MKL in PyTorch, and `bislerp`, which uses
//! `acos`/`sin`; both agree to within a few ULP.
//!
//! `tools/reference/image_ops.py` regenerates the fixtures that
//! `nodes/tests/imageops.rs` compares these functions against.

use sdkit_engine::memory::{try_filled, try_with_capacity};
use std::fmt;
use std::str::FromStr;

pub mod antialias;
mod canny;
mod latent;
mod pillow;
mod resize;
mod transform;

pub use canny::canny;
pub use latent::*;
use pillow::lanczos;
pub use pillow::{pil_contain_size, pil_resize_rgb, PilFilter};
pub use resize::*;
use resize::{new_output, Window};
pub use transform::*;

/// Errors for arguments an operation cannot accept. Valid-typed input never
/// panics; it yields one of these instead.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ImageOpError {
    /// `data.len()` is not the product of the dimensions (or that product
    /// overflows `usize`).
    #[error("data length {len} does not match shape {shape:?}")]
    ShapeMismatch { shape: Vec<usize>, len: usize },
    /// A size that must be positive was zero.
    #[error("{what} must be greater than zero")]
    ZeroSize { what: &'static str },
    /// The upscale method name is not one ComfyUI knows.
    #[error("unknown upscale method {0:?}")]
    UnknownMethod(String),
    /// The crop mode is neither "disabled" nor "center".
    #[error("unknown crop mode {0:?}")]
    UnknownCrop(String),
    /// The channel name is not red/green/blue/alpha.
    #[error("unknown channel {0:?}")]
    UnknownChannel(String),
    /// The operation cannot handle this many channels (ComfyUI would raise).
    #[error("{op} does not support images with {channels} channels")]
    UnsupportedChannels { op: &'static str, channels: usize },
    /// Any other argument ComfyUI/PyTorch would reject.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The output (of `shape`, f32) could not be allocated.
    #[error("not enough memory for a {} image", shape.iter().map(usize::to_string).collect::<Vec<_>>().join("×"))]
    OutOfMemory { shape: Vec<usize> },
    /// The run was interrupted (see [`cancellable`]).
    #[error("interrupted")]
    Interrupted,
}

type Result<T> = std::result::Result<T, ImageOpError>;

thread_local! {
    /// The cancel flag of the node running on this thread, if it runs
    /// through [`cancellable`].
    static CANCEL: std::cell::RefCell<Option<sdkit_engine::CancelToken>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` (image ops on this thread) so that their long loops stop with
/// [`ImageOpError::Interrupted`] once `cancel` is set. The flag is ambient
/// rather than an argument because the ops keep the signatures of the
/// PyTorch/Pillow functions they reproduce; they look at it once per
/// output row, so an interrupt lands within milliseconds even on the
/// largest image LoadImage accepts.
pub fn cancellable<R>(cancel: &sdkit_engine::CancelToken, f: impl FnOnce() -> R) -> R {
    /// Puts back the previous flag, even if `f` panics.
    struct Restore(Option<sdkit_engine::CancelToken>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            CANCEL.with(|c| *c.borrow_mut() = prev);
        }
    }
    let _restore = Restore(CANCEL.with(|c| c.replace(Some(cancel.clone()))));
    f()
}

/// `Interrupted` when the flag of [`cancellable`] is set.
fn check_cancel() -> Result<()> {
    let cancelled = CANCEL.with(|c| c.borrow().as_ref().is_some_and(|t| t.is_cancelled()));
    if cancelled {
        Err(ImageOpError::Interrupted)
    } else {
        Ok(())
    }
}

/// `dims` elements set to `value`, or `OutOfMemory` when they cannot be
/// allocated: sizes come from workflows, and an abort would take a server
/// down.
fn alloc_filled(dims: &[usize], value: f32) -> Result<Vec<f32>> {
    let oom = || ImageOpError::OutOfMemory {
        shape: dims.to_vec(),
    };
    let n = checked_numel(dims).ok_or_else(oom)?;
    try_filled(n, value).map_err(|_| oom())
}

/// Room for `dims` elements, or `OutOfMemory`.
fn alloc_empty(dims: &[usize]) -> Result<Vec<f32>> {
    let oom = || ImageOpError::OutOfMemory {
        shape: dims.to_vec(),
    };
    let n = checked_numel(dims).ok_or_else(oom)?;
    try_with_capacity(n).map_err(|_| oom())
}

/// Element count of a shape, `None` if it could not be allocated as `f32`s
/// (so oversized requests become errors instead of capacity panics).
fn checked_numel(dims: &[usize]) -> Option<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= isize::MAX as usize / 4)
}

fn check_len(dims: &[usize], len: usize) -> Result<()> {
    match checked_numel(dims) {
        Some(n) if n == len => Ok(()),
        _ => Err(ImageOpError::ShapeMismatch {
            shape: dims.to_vec(),
            len,
        }),
    }
}

fn nonzero(value: usize, what: &'static str) -> Result<usize> {
    if value == 0 {
        Err(ImageOpError::ZeroSize { what })
    } else {
        Ok(value)
    }
}

/// An IMAGE tensor: `[b, h, w, c]`, row-major, `f32`.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor4 {
    pub b: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub data: Vec<f32>,
}

impl Tensor4 {
    /// Wraps `data`, checking that its length is `b * h * w * c`.
    pub fn new(b: usize, h: usize, w: usize, c: usize, data: Vec<f32>) -> Result<Self> {
        check_len(&[b, h, w, c], data.len())?;
        Ok(Self { b, h, w, c, data })
    }

    /// A tensor with every element set to `value` (`torch.full`).
    pub fn filled(b: usize, h: usize, w: usize, c: usize, value: f32) -> Result<Self> {
        Ok(Self {
            b,
            h,
            w,
            c,
            data: alloc_filled(&[b, h, w, c], value)?,
        })
    }

    /// `[b, h, w, c]`.
    pub fn shape(&self) -> [usize; 4] {
        [self.b, self.h, self.w, self.c]
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Flat index of element `(b, y, x, ch)`; `None` if out of range.
    pub fn index(&self, b: usize, y: usize, x: usize, ch: usize) -> Option<usize> {
        if b < self.b && y < self.h && x < self.w && ch < self.c {
            Some(((b * self.h + y) * self.w + x) * self.c + ch)
        } else {
            None
        }
    }

    /// Element `(b, y, x, ch)`; `None` if out of range.
    pub fn get(&self, b: usize, y: usize, x: usize, ch: usize) -> Option<f32> {
        self.index(b, y, x, ch)
            .and_then(|i| self.data.get(i).copied())
    }

    /// The `h * w * c` elements of batch item `b`.
    pub fn item(&self, b: usize) -> Option<&[f32]> {
        let n = checked_numel(&[self.h, self.w, self.c])?;
        let start = b.checked_mul(n)?;
        self.data.get(start..start.checked_add(n)?)
    }
}

/// A MASK tensor: `[b, h, w]`, row-major, `f32`.
///
/// Masks get their own type (rather than a `Tensor4` with `c == 1`) so that
/// the node layer cannot confuse the two ComfyUI socket types.
#[derive(Clone, Debug, PartialEq)]
pub struct Mask3 {
    pub b: usize,
    pub h: usize,
    pub w: usize,
    pub data: Vec<f32>,
}

impl Mask3 {
    /// Wraps `data`, checking that its length is `b * h * w`.
    pub fn new(b: usize, h: usize, w: usize, data: Vec<f32>) -> Result<Self> {
        check_len(&[b, h, w], data.len())?;
        Ok(Self { b, h, w, data })
    }

    /// `[b, h, w]`.
    pub fn shape(&self) -> [usize; 3] {
        [self.b, self.h, self.w]
    }

    /// Element `(b, y, x)`; `None` if out of range.
    pub fn get(&self, b: usize, y: usize, x: usize) -> Option<f32> {
        if b < self.b && y < self.h && x < self.w {
            self.data.get((b * self.h + y) * self.w + x).copied()
        } else {
            None
        }
    }
}

// ---------------------------------------------------------------------------
// Method / crop names
// ---------------------------------------------------------------------------

/// The `upscale_method` values of ComfyUI's `common_upscale`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpscaleMethod {
    NearestExact,
    Bilinear,
    Area,
    Bicubic,
    Lanczos,
    Bislerp,
}

impl UpscaleMethod {
    /// The ComfyUI spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::NearestExact => "nearest-exact",
            Self::Bilinear => "bilinear",
            Self::Area => "area",
            Self::Bicubic => "bicubic",
            Self::Lanczos => "lanczos",
            Self::Bislerp => "bislerp",
        }
    }
}

impl FromStr for UpscaleMethod {
    type Err = ImageOpError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "nearest-exact" => Self::NearestExact,
            "bilinear" => Self::Bilinear,
            "area" => Self::Area,
            "bicubic" => Self::Bicubic,
            "lanczos" => Self::Lanczos,
            "bislerp" => Self::Bislerp,
            other => return Err(ImageOpError::UnknownMethod(other.to_string())),
        })
    }
}

impl fmt::Display for UpscaleMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The `crop` values of ComfyUI's `common_upscale`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crop {
    Disabled,
    Center,
}

impl FromStr for Crop {
    type Err = ImageOpError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "disabled" => Ok(Self::Disabled),
            "center" => Ok(Self::Center),
            other => Err(ImageOpError::UnknownCrop(other.to_string())),
        }
    }
}

/// How the torch tensor handed to `common_upscale` sits in memory. PyTorch
/// picks different (numerically different) CPU kernels depending on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceLayout {
    /// An IMAGE moved to BCHW with `movedim(-1, 1)`: a channels-last view.
    /// This is what every IMAGE node passes.
    ChannelsLastView,
    /// A contiguous NCHW tensor (latents). The data is still given to these
    /// functions as BHWC; only the kernel selection changes.
    ContiguousNchw,
}

// ---------------------------------------------------------------------------
// Small numeric helpers
// ---------------------------------------------------------------------------

/// Python's `round()` on a float: round half to even, to an integer.
fn py_round(x: f64) -> f64 {
    x.round_ties_even()
}

/// A non-negative Python-rounded value as `usize` (negative/NaN give 0).
fn py_round_usize(x: f64) -> usize {
    let r = py_round(x);
    if r.is_nan() || r <= 0.0 {
        0
    } else if r >= usize::MAX as f64 {
        usize::MAX
    } else {
        r as usize
    }
}

/// PyTorch's float `sum` reduction over a contiguous row (`cascade_sum` in
/// ATen's SumKernel): 8-lane vector accumulators combined through the
/// multi-level cascade, then a scalar tail, then the lanes in order. (The
/// x86-64 wheels reduce with 8 float lanes even on AVX-512 machines; checked
/// against torch 2.15.)
fn torch_sum_contiguous(x: &[f32]) -> f32 {
    const LANES: usize = 8;
    if x.len() < LANES {
        return torch_row_sum(x.len(), |i| x[i]);
    }
    let vecs = x.len() / LANES;
    let lanes = torch_row_sum_lanes::<LANES>(vecs, |i| {
        let mut v = [0f32; LANES];
        v.copy_from_slice(&x[i * LANES..(i + 1) * LANES]);
        v
    });
    let mut acc = 0f32;
    for &v in &x[vecs * LANES..] {
        acc += v;
    }
    for v in lanes {
        acc += v;
    }
    acc
}

/// ATen `row_sum` for scalars: four interleaved accumulators (ILP) fed
/// through `multi_row_sum`, then the tail, then the four partials.
fn torch_row_sum(size: usize, load: impl Fn(usize) -> f32) -> f32 {
    let groups = size / 4;
    let mut partial = torch_multi_row_sum::<4>(groups, |i, k| load(i * 4 + k));
    for i in groups * 4..size {
        partial[0] += load(i);
    }
    let mut acc = partial[0];
    for p in &partial[1..] {
        acc += p;
    }
    acc
}

/// ATen `row_sum` instantiated on `Vectorized<float>`: identical structure,
/// each lane accumulating independently.
fn torch_row_sum_lanes<const L: usize>(size: usize, load: impl Fn(usize) -> [f32; L]) -> [f32; L] {
    let groups = size / 4;
    let mut out = [0f32; L];
    for (lane, slot) in out.iter_mut().enumerate() {
        let mut partial = torch_multi_row_sum::<4>(groups, |i, k| load(i * 4 + k)[lane]);
        for i in groups * 4..size {
            partial[0] += load(i)[lane];
        }
        let mut acc = partial[0];
        for p in &partial[1..] {
            acc += p;
        }
        *slot = acc;
    }
    out
}

/// ATen `multi_row_sum`: sums `N` interleaved rows with a 4-level cascade
/// whose chunk size grows with the length (keeps rounding error small).
fn torch_multi_row_sum<const N: usize>(
    size: usize,
    load: impl Fn(usize, usize) -> f32,
) -> [f32; N] {
    const LEVELS: usize = 4;
    let ceil_log2 = if size <= 1 {
        0
    } else {
        usize::BITS - (size - 1).leading_zeros()
    } as usize;
    let level_power = std::cmp::max(4, ceil_log2 / LEVELS);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[0f32; N]; LEVELS];
    let mut i = 0usize;
    while i + level_step <= size {
        for _ in 0..level_step {
            for (k, a) in acc[0].iter_mut().enumerate() {
                *a += load(i, k);
            }
            i += 1;
        }
        for j in 1..LEVELS {
            // Move level j-1 into level j.
            let (lower, upper) = acc.split_at_mut(j);
            for (hi, lo) in upper[0].iter_mut().zip(lower[j - 1].iter_mut()) {
                *hi += *lo;
                *lo = 0.0;
            }
            let mask = level_mask << (j * level_power);
            if i & mask != 0 {
                break;
            }
        }
    }
    while i < size {
        for (k, a) in acc[0].iter_mut().enumerate() {
            *a += load(i, k);
        }
        i += 1;
    }
    let mut out = acc[0];
    for level in &acc[1..] {
        for k in 0..N {
            out[k] += level[k];
        }
    }
    out
}

/// `c10::compute_channels_last_contiguous_2d` for a 4-D BCHW tensor.
fn is_channels_last_contiguous(sizes: [usize; 4], strides: [usize; 4]) -> bool {
    let mut expected = 1usize;
    for d in [1usize, 3, 2, 0] {
        if sizes[d] != 1 {
            if strides[d] != expected {
                return false;
            }
            expected = expected.saturating_mul(sizes[d]);
        }
    }
    true
}

// ---------------------------------------------------------------------------
// ImageScale / ImageScaleBy
// ---------------------------------------------------------------------------

/// ComfyUI `ImageScale.upscale`: a zero width or height keeps the aspect
/// ratio (`max(1, round(w * height / h))`, Python banker's rounding); both
/// zero returns the image unchanged.
pub fn scale_to(
    img: &Tensor4,
    method: UpscaleMethod,
    width: usize,
    height: usize,
    crop: Crop,
) -> Result<Tensor4> {
    if width == 0 && height == 0 {
        return Ok(img.clone());
    }
    nonzero(img.h, "input height")?;
    nonzero(img.w, "input width")?;
    let (width, height) = scale_to_size(img.w, img.h, width, height);
    upscale(img, width, height, method, crop)
}

/// ImageScale's output size for an `in_w × in_h` image: a zero side keeps
/// the aspect ratio (both zero: unchanged).
pub fn scale_to_size(in_w: usize, in_h: usize, width: usize, height: usize) -> (usize, usize) {
    match (width, height) {
        (0, 0) => (in_w, in_h),
        (0, h) => (
            py_round_usize(in_w as f64 * h as f64 / in_h.max(1) as f64).max(1),
            h,
        ),
        (w, 0) => (
            w,
            py_round_usize(in_h as f64 * w as f64 / in_w.max(1) as f64).max(1),
        ),
        size => size,
    }
}

/// ImageScaleBy's output size: `round(side · scale_by)`, banker's rounding.
pub fn scale_by_size(in_w: usize, in_h: usize, scale_by: f64) -> (usize, usize) {
    (
        py_round_usize(in_w as f64 * scale_by),
        py_round_usize(in_h as f64 * scale_by),
    )
}

/// ComfyUI `ImageScaleBy.upscale`: `round(w * scale_by)` x
/// `round(h * scale_by)` (banker's rounding), crop disabled.
pub fn scale_by(img: &Tensor4, method: UpscaleMethod, scale_by: f64) -> Result<Tensor4> {
    if !scale_by.is_finite() || scale_by <= 0.0 {
        return Err(ImageOpError::InvalidArgument(format!(
            "scale_by must be positive, got {scale_by}"
        )));
    }
    let (width, height) = scale_by_size(img.w, img.h, scale_by);
    upscale(img, width, height, method, Crop::Disabled)
}

// ---------------------------------------------------------------------------
// Blur / Sharpen (comfy_extras/nodes_post_processing.py)
// ---------------------------------------------------------------------------

/// ComfyUI `gaussian_kernel(kernel_size, sigma)`, row-major `k x k`.
///
/// `torch.linspace` (FMA-contracted, mirrored exactly), `x*x + y*y`, the
/// division by `float(2 * sigma^2)` and the cascade `sum` are mirrored
/// exactly; PyTorch takes `sqrt` and `exp` from MKL's vector math, which is
/// not always correctly rounded, so a few weights may differ by one ULP.
pub fn gaussian_kernel(kernel_size: usize, sigma: f64) -> Vec<f32> {
    let k = kernel_size;
    let lin: Vec<f32> = if k == 1 {
        vec![-1.0]
    } else {
        let step = 2.0f32 / (k - 1) as f32;
        let halfway = k / 2;
        (0..k)
            .map(|i| {
                if i < halfway {
                    step.mul_add(i as f32, -1.0)
                } else {
                    (-step).mul_add((k - i - 1) as f32, 1.0)
                }
            })
            .collect()
    };
    let denom = (2.0 * sigma * sigma) as f32;
    let mut g = Vec::with_capacity(k * k);
    for &xi in &lin {
        for &yj in &lin {
            let d = (xi * xi + yj * yj).sqrt();
            let q = -(d * d) / denom;
            g.push((q as f64).exp() as f32);
        }
    }
    let sum = torch_sum_contiguous(&g);
    for v in &mut g {
        *v /= sum;
    }
    g
}

/// Depthwise `F.conv2d` of the reflect-padded image with a `k x k` kernel,
/// as ComfyUI's Blur/Sharpen do it (the extra zero padding they add is
/// cropped away again). Accumulation is the oneDNN order: row-major over
/// the kernel, fused multiply-adds from zero.
fn reflect_conv(img: &Tensor4, radius: usize, kernel: &[f32]) -> Result<Tensor4> {
    if radius >= img.h || radius >= img.w {
        return Err(ImageOpError::InvalidArgument(format!(
            "reflect padding of {radius} needs an image larger than {}x{}",
            img.w, img.h
        )));
    }
    let k = 2 * radius + 1;
    let reflect = sdkit_compute::tensor::reflect_index;
    let (h, w, c) = (img.h, img.w, img.c);
    let mut out = new_output(img.b, h, w, c)?;
    let rows: Vec<Vec<usize>> = (0..h)
        .map(|y| {
            (0..k)
                .map(|i| reflect(y as isize + i as isize - radius as isize, h))
                .collect()
        })
        .collect();
    let cols: Vec<Vec<usize>> = (0..w)
        .map(|x| {
            (0..k)
                .map(|j| reflect(x as isize + j as isize - radius as isize, w))
                .collect()
        })
        .collect();
    let mut o = 0;
    for b in 0..img.b {
        let base = b * h * w * c;
        for ry in &rows {
            check_cancel()?;
            for cx in &cols {
                for ch in 0..c {
                    let mut acc = 0f32;
                    for (i, &sy) in ry.iter().enumerate() {
                        for (j, &sx) in cx.iter().enumerate() {
                            let v = img.data[base + (sy * w + sx) * c + ch];
                            acc = v.mul_add(kernel[i * k + j], acc);
                        }
                    }
                    out.data[o] = acc;
                    o += 1;
                }
            }
        }
    }
    Ok(out)
}

/// ComfyUI `ImageBlur` (Gaussian blur, reflect padding). Radius 0 returns
/// the image unchanged. The reflect padding requires `radius < h` and
/// `radius < w` (PyTorch raises otherwise).
pub fn blur(img: &Tensor4, blur_radius: usize, sigma: f64) -> Result<Tensor4> {
    if blur_radius == 0 {
        return Ok(img.clone());
    }
    check_len(&img.shape(), img.data.len())?;
    reflect_conv(img, blur_radius, &blur_kernel(blur_radius, sigma))
}

/// ImageBlur's `k x k` kernel (`k = 2·radius + 1`).
pub fn blur_kernel(radius: usize, sigma: f64) -> Vec<f32> {
    gaussian_kernel(radius * 2 + 1, sigma)
}

/// ImageSharpen's `k x k` kernel: `-(alpha * 10) * gaussian`, the center
/// raised so that it sums to one.
pub fn sharpen_kernel(radius: usize, sigma: f64, alpha: f64) -> Vec<f32> {
    let k = radius * 2 + 1;
    let factor = (-(alpha * 10.0)) as f32;
    let mut kernel: Vec<f32> = gaussian_kernel(k, sigma)
        .iter()
        .map(|&v| v * factor)
        .collect();
    let sum = torch_sum_contiguous(&kernel);
    let center = (k / 2) * k + k / 2;
    kernel[center] = kernel[center] - sum + 1.0;
    kernel
}

/// ComfyUI `ImageSharpen`: kernel `-(alpha * 10) * gaussian` with the
/// center raised so the kernel sums to one, then clamp to `0..=1`.
pub fn sharpen(img: &Tensor4, sharpen_radius: usize, sigma: f64, alpha: f64) -> Result<Tensor4> {
    if sharpen_radius == 0 {
        return Ok(img.clone());
    }
    check_len(&img.shape(), img.data.len())?;
    let kernel = sharpen_kernel(sharpen_radius, sigma, alpha);
    let mut out = reflect_conv(img, sharpen_radius, &kernel)?;
    for v in &mut out.data {
        *v = v.clamp(0.0, 1.0);
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Simple image / mask nodes
// ---------------------------------------------------------------------------

/// ComfyUI `ImageInvert`: `1.0 - image`.
pub fn invert(img: &Tensor4) -> Tensor4 {
    Tensor4 {
        b: img.b,
        h: img.h,
        w: img.w,
        c: img.c,
        data: img.data.iter().map(|&v| 1.0 - v).collect(),
    }
}

/// ComfyUI `ImageCrop`: `x = min(x, w - 1)`, `y = min(y, h - 1)`, then the
/// slice `[y : y + height, x : x + width]` (Python slicing clamps the end).
pub fn crop(img: &Tensor4, width: usize, height: usize, x: usize, y: usize) -> Result<Tensor4> {
    nonzero(width, "width")?;
    nonzero(height, "height")?;
    nonzero(img.h, "input height")?;
    nonzero(img.w, "input width")?;
    check_len(&img.shape(), img.data.len())?;
    let x = x.min(img.w - 1);
    let y = y.min(img.h - 1);
    let x1 = x.saturating_add(width).min(img.w);
    let y1 = y.saturating_add(height).min(img.h);
    let (ow, oh, c) = (x1 - x, y1 - y, img.c);
    let mut data = alloc_empty(&[img.b, oh, ow, c])?;
    for b in 0..img.b {
        for yy in y..y1 {
            let start = ((b * img.h + yy) * img.w + x) * c;
            data.extend_from_slice(&img.data[start..start + ow * c]);
        }
    }
    Ok(Tensor4 {
        b: img.b,
        h: oh,
        w: ow,
        c,
        data,
    })
}

/// ComfyUI's ImagePadForOutpaint: the image inside a grey (0.5) border
/// of `[left, top, right, bottom]` pixels, and the mask of what to paint:
/// 1 on the border, inside the image `((f − d)/f)²` within `feathering`
/// pixels `d` of a padded side (its squared ramp, in f64 as Python
/// computes it), 0 elsewhere. The ramp is only drawn where twice the
/// feathering fits inside the image both ways, as ComfyUI's.
pub fn pad_for_outpaint(
    img: &Tensor4,
    [left, top, right, bottom]: [usize; 4],
    feathering: usize,
) -> Result<(Tensor4, Mask3)> {
    let (d2, d3) = (img.h, img.w);
    let (nh, nw) = (
        d2.saturating_add(top).saturating_add(bottom),
        d3.saturating_add(left).saturating_add(right),
    );
    let mut out = alloc_filled(&[img.b, nh, nw, img.c], 0.5)?;
    let row = d3 * img.c;
    for b in 0..img.b {
        for y in 0..d2 {
            let src = (b * d2 + y) * row;
            let dst = ((b * nh + top + y) * nw + left) * img.c;
            out[dst..dst + row].copy_from_slice(&img.data[src..src + row]);
        }
    }
    let mut mask = alloc_filled(&[nh, nw], 1.0)?;
    let feather = feathering > 0 && feathering * 2 < d2 && feathering * 2 < d3;
    for i in 0..d2 {
        for j in 0..d3 {
            let v = if feather {
                let dt = if top != 0 { i } else { d2 };
                let db = if bottom != 0 { d2 - i } else { d2 };
                let dl = if left != 0 { j } else { d3 };
                let dr = if right != 0 { d3 - j } else { d3 };
                let d = dt.min(db).min(dl).min(dr);
                if d >= feathering {
                    0.0
                } else {
                    let v = (feathering - d) as f64 / feathering as f64;
                    (v * v) as f32
                }
            } else {
                0.0
            };
            mask[(top + i) * nw + left + j] = v;
        }
    }
    Ok((
        Tensor4::new(img.b, nh, nw, img.c, out)?,
        Mask3::new(1, nh, nw, mask)?,
    ))
}

/// ComfyUI `ImageBatch`: if the `[h, w, c]` shapes differ, `image2` is
/// resized to `image1`'s size with `common_upscale(..., "bilinear",
/// "center")`; then the batches are concatenated. Channel counts must match
/// (`torch.cat` would raise).
pub fn batch(image1: &Tensor4, image2: &Tensor4) -> Result<Tensor4> {
    check_len(&image1.shape(), image1.data.len())?;
    check_len(&image2.shape(), image2.data.len())?;
    let resized;
    let second = if image1.shape()[1..] != image2.shape()[1..] {
        resized = upscale(
            image2,
            image1.w,
            image1.h,
            UpscaleMethod::Bilinear,
            Crop::Center,
        )?;
        &resized
    } else {
        image2
    };
    if second.c != image1.c {
        return Err(ImageOpError::InvalidArgument(format!(
            "cannot batch images with {} and {} channels",
            image1.c, second.c
        )));
    }
    let mut data = alloc_empty(&[image1.b + second.b, image1.h, image1.w, image1.c])?;
    data.extend_from_slice(&image1.data);
    data.extend_from_slice(&second.data);
    Ok(Tensor4 {
        b: image1.b + second.b,
        h: image1.h,
        w: image1.w,
        c: image1.c,
        data,
    })
}

/// The `channel` input of ComfyUI `ImageToMask`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskChannel {
    Red,
    Green,
    Blue,
    Alpha,
}

impl MaskChannel {
    fn index(self) -> usize {
        match self {
            Self::Red => 0,
            Self::Green => 1,
            Self::Blue => 2,
            Self::Alpha => 3,
        }
    }
}

impl FromStr for MaskChannel {
    type Err = ImageOpError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "red" => Ok(Self::Red),
            "green" => Ok(Self::Green),
            "blue" => Ok(Self::Blue),
            "alpha" => Ok(Self::Alpha),
            other => Err(ImageOpError::UnknownChannel(other.to_string())),
        }
    }
}

/// ComfyUI `ImageToMask`: `image[:, :, :, channel]`. Asking for a channel
/// the image lacks (e.g. alpha of RGB) is an error, as in PyTorch.
pub fn image_to_mask(img: &Tensor4, channel: MaskChannel) -> Result<Mask3> {
    check_len(&img.shape(), img.data.len())?;
    let ch = channel.index();
    if ch >= img.c {
        return Err(ImageOpError::UnsupportedChannels {
            op: "ImageToMask",
            channels: img.c,
        });
    }
    let data = img.data.chunks_exact(img.c).map(|p| p[ch]).collect();
    Ok(Mask3 {
        b: img.b,
        h: img.h,
        w: img.w,
        data,
    })
}

/// ComfyUI `MaskToImage`: the mask repeated into three channels.
pub fn mask_to_image(mask: &Mask3) -> Tensor4 {
    Tensor4 {
        b: mask.b,
        h: mask.h,
        w: mask.w,
        c: 3,
        data: mask.data.iter().flat_map(|&v| [v, v, v]).collect(),
    }
}

/// ComfyUI `SolidMask`: a `1 x height x width` mask of `float32(value)`.
pub fn solid_mask(value: f64, width: usize, height: usize) -> Result<Mask3> {
    nonzero(width, "width")?;
    nonzero(height, "height")?;
    Ok(Mask3 {
        b: 1,
        h: height,
        w: width,
        data: alloc_filled(&[1, height, width], value as f32)?,
    })
}

/// ComfyUI `InvertMask`: `1.0 - mask`.
pub fn invert_mask(mask: &Mask3) -> Mask3 {
    Mask3 {
        b: mask.b,
        h: mask.h,
        w: mask.w,
        data: mask.data.iter().map(|&v| 1.0 - v).collect(),
    }
}

/// ComfyUI `EmptyImage`: RGB filled with `color` (0xRRGGBB); each channel
/// is `byte / 0xFF` in double precision, then stored as `float32`.
pub fn empty_image(width: usize, height: usize, batch_size: usize, color: u32) -> Result<Tensor4> {
    nonzero(width, "width")?;
    nonzero(height, "height")?;
    nonzero(batch_size, "batch size")?;
    let channel = |shift: u32| (((color >> shift) & 0xFF) as f64 / 255.0) as f32;
    let rgb = [channel(16), channel(8), channel(0)];
    let shape = [batch_size, height, width, 3];
    let mut data = alloc_empty(&shape)?;
    for _ in 0..batch_size * height * width {
        data.extend_from_slice(&rgb);
    }
    Ok(Tensor4 {
        b: batch_size,
        h: height,
        w: width,
        c: 3,
        data,
    })
}

// ---------------------------------------------------------------------------
// u8 conversions (LoadImage / SaveImage / lanczos)
// ---------------------------------------------------------------------------

/// One value of SaveImage's `np.clip(255. * x, 0, 255).astype(np.uint8)`:
/// the product is `float32` (NumPy keeps the array's dtype for a Python
/// float), the cast truncates, NaN becomes 0.
#[inline]
pub fn f32_to_u8(x: f32) -> u8 {
    let v = 255.0f32 * x;
    if v.is_nan() {
        0
    } else {
        v.clamp(0.0, 255.0) as u8
    }
}

/// One value of LoadImage's `np.array(img).astype(np.float32) / 255.0`
/// (a `float32` division).
#[inline]
pub fn u8_to_f32(v: u8) -> f32 {
    v as f32 / 255.0f32
}

/// SaveImage / PreviewImage quantisation of a whole IMAGE (same BHWC order).
pub fn to_u8(img: &Tensor4) -> Vec<u8> {
    img.data.iter().map(|&v| f32_to_u8(v)).collect()
}

/// LoadImage's conversion of 8-bit pixels (BHWC order) to an IMAGE.
pub fn from_u8(b: usize, h: usize, w: usize, c: usize, px: &[u8]) -> Result<Tensor4> {
    check_len(&[b, h, w, c], px.len())?;
    Tensor4::new(b, h, w, c, px.iter().map(|&v| u8_to_f32(v)).collect())
}

/// LoadImage's mask from an 8-bit alpha plane: `1 - a / 255`.
pub fn mask_from_alpha_u8(b: usize, h: usize, w: usize, alpha: &[u8]) -> Result<Mask3> {
    check_len(&[b, h, w], alpha.len())?;
    Mask3::new(b, h, w, alpha.iter().map(|&a| 1.0 - u8_to_f32(a)).collect())
}
