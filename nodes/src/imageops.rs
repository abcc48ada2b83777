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
// common_upscale
// ---------------------------------------------------------------------------

/// A rectangular window (after the optional center crop) of a [`Tensor4`].
struct Window<'a> {
    src: &'a Tensor4,
    x0: usize,
    y0: usize,
    w: usize,
    h: usize,
}

impl Window<'_> {
    #[inline]
    fn at(&self, b: usize, y: usize, x: usize, ch: usize) -> f32 {
        let s = self.src;
        s.data[((b * s.h + self.y0 + y) * s.w + self.x0 + x) * s.c + ch]
    }

    /// Whether PyTorch would see this window (as a BCHW view) as
    /// channels-last contiguous.
    fn channels_last(&self, layout: SourceLayout) -> bool {
        let s = self.src;
        let sizes = [s.b, s.c, self.h, self.w];
        let strides = match layout {
            SourceLayout::ChannelsLastView => [s.h * s.w * s.c, 1, s.w * s.c, s.c],
            SourceLayout::ContiguousNchw => [s.c * s.h * s.w, s.h * s.w, s.w, 1],
        };
        is_channels_last_contiguous(sizes, strides)
    }
}

/// ComfyUI `comfy.utils.common_upscale` on an IMAGE (which ComfyUI passes as
/// a channels-last BCHW view). `width`/`height` are the output size.
pub fn upscale(
    img: &Tensor4,
    width: usize,
    height: usize,
    method: UpscaleMethod,
    crop: Crop,
) -> Result<Tensor4> {
    common_upscale(
        img,
        width,
        height,
        method,
        crop,
        SourceLayout::ChannelsLastView,
    )
}

/// ComfyUI `comfy.utils.common_upscale` with an explicit source layout (use
/// [`SourceLayout::ContiguousNchw`] for latents; the data is still BHWC).
pub fn common_upscale(
    img: &Tensor4,
    width: usize,
    height: usize,
    method: UpscaleMethod,
    crop: Crop,
    layout: SourceLayout,
) -> Result<Tensor4> {
    nonzero(width, "width")?;
    nonzero(height, "height")?;
    check_len(&img.shape(), img.data.len())?;
    nonzero(img.b, "batch size")?;
    nonzero(img.c, "channel count")?;
    nonzero(img.h, "input height")?;
    nonzero(img.w, "input width")?;

    if checked_numel(&[img.b, height, width, img.c]).is_none() {
        return Err(ImageOpError::InvalidArgument(format!(
            "output size {width}x{height} is too large"
        )));
    }
    let win = center_crop_window(img, width, height, crop)?;
    match method {
        UpscaleMethod::NearestExact => nearest_exact(&win, width, height, layout),
        UpscaleMethod::Bilinear => bilinear(&win, width, height, layout),
        UpscaleMethod::Bicubic => bicubic(&win, width, height),
        UpscaleMethod::Area => area(&win, width, height, layout),
        UpscaleMethod::Lanczos => lanczos(&win, width, height),
        UpscaleMethod::Bislerp => bislerp(&win, width, height),
    }
}

/// The `crop == "center"` arithmetic of `common_upscale` (Python floats and
/// banker's `round`), then `narrow` on height and width.
fn center_crop_window(
    img: &Tensor4,
    width: usize,
    height: usize,
    crop: Crop,
) -> Result<Window<'_>> {
    let (mut x, mut y) = (0usize, 0usize);
    if crop == Crop::Center {
        let old_w = img.w as f64;
        let old_h = img.h as f64;
        let old_aspect = old_w / old_h;
        let new_aspect = width as f64 / height as f64;
        if old_aspect > new_aspect {
            x = py_round_usize((old_w - old_w * (new_aspect / old_aspect)) / 2.0);
        } else if old_aspect < new_aspect {
            y = py_round_usize((old_h - old_h * (old_aspect / new_aspect)) / 2.0);
        }
    }
    let w = img.w.checked_sub(2 * x).filter(|&w| w > 0);
    let h = img.h.checked_sub(2 * y).filter(|&h| h > 0);
    match (w, h) {
        (Some(w), Some(h)) => Ok(Window {
            src: img,
            x0: x,
            y0: y,
            w,
            h,
        }),
        _ => Err(ImageOpError::InvalidArgument(format!(
            "center crop of a {}x{} image to aspect {}x{} leaves nothing",
            img.w, img.h, width, height
        ))),
    }
}

/// PyTorch's choice between `cpu_upsample_*_channels_last` and the generic
/// TensorIterator kernel (`_use_vectorized_kernel_cond_2d`). PyTorch also
/// takes the channels-last bilinear kernel for 3 channels when it runs on a
/// single thread; ComfyUI runs multi-threaded, so that case is not mirrored.
fn use_channels_last_kernel(
    win: &Window<'_>,
    out_w: usize,
    out_h: usize,
    layout: SourceLayout,
) -> bool {
    (win.channels_last(layout) && win.src.c > 3) || (out_h + out_w <= 128)
}

fn new_output(b: usize, h: usize, w: usize, c: usize) -> Result<Tensor4> {
    Ok(Tensor4 {
        b,
        h,
        w,
        c,
        data: alloc_filled(&[b, h, w, c], 0.0)?,
    })
}

/// `F.interpolate(mode="nearest-exact")`.
fn nearest_exact(
    win: &Window<'_>,
    out_w: usize,
    out_h: usize,
    layout: SourceLayout,
) -> Result<Tensor4> {
    let cl = use_channels_last_kernel(win, out_w, out_h, layout);
    let xs: Vec<usize> = (0..out_w)
        .map(|o| nearest_exact_index(win.w, out_w, o, cl))
        .collect();
    let ys: Vec<usize> = (0..out_h)
        .map(|o| nearest_exact_index(win.h, out_h, o, cl))
        .collect();
    let c = win.src.c;
    let mut out = new_output(win.src.b, out_h, out_w, c)?;
    let mut i = 0;
    for b in 0..win.src.b {
        for &sy in &ys {
            check_cancel()?;
            for &sx in &xs {
                for ch in 0..c {
                    out.data[i] = win.at(b, sy, sx, ch);
                    i += 1;
                }
            }
        }
    }
    Ok(out)
}

/// Source index of nearest-exact. The channels-last kernel uses
/// `floorf((dst + 0.5) * scale)` with the product in double; the generic
/// kernel uses `floorf(src + 0.5)` where `src = scale * (dst + 0.5f) - 0.5f`
/// (contracted to an FMA by the compiler) clamped at 0. Both use
/// `scale = (float)in / out`.
fn nearest_exact_index(in_size: usize, out_size: usize, dst: usize, channels_last: bool) -> usize {
    let scale = in_size as f32 / out_size as f32;
    let idx = if channels_last {
        (((dst as f64 + 0.5) * scale as f64) as f32).floor()
    } else {
        let src = scale.mul_add(dst as f32 + 0.5, -0.5).max(0.0);
        ((src as f64 + 0.5) as f32).floor()
    };
    (idx.max(0.0) as usize).min(in_size - 1)
}

#[derive(Clone, Copy)]
struct LinearTap {
    i0: usize,
    i1: usize,
    l0: f32,
    l1: f32,
}

/// ATen `compute_source_index_and_lambda` (align_corners=False). The
/// channels-last kernel's index computation is FMA-contracted in the
/// PyTorch build, the generic kernel's is not.
fn linear_taps(in_size: usize, out_size: usize, fused: bool) -> Vec<LinearTap> {
    (0..out_size)
        .map(|o| {
            if in_size == out_size {
                return LinearTap {
                    i0: o,
                    i1: o,
                    l0: 1.0,
                    l1: 0.0,
                };
            }
            let scale = in_size as f32 / out_size as f32;
            let half = o as f32 + 0.5;
            let mut real = if fused {
                scale.mul_add(half, -0.5)
            } else {
                scale * half - 0.5
            };
            if real < 0.0 {
                real = 0.0;
            }
            let i0 = (real.floor() as usize).min(in_size - 1);
            let l1 = (real - i0 as f32).clamp(0.0, 1.0);
            let i1 = if i0 < in_size - 1 { i0 + 1 } else { i0 };
            LinearTap {
                i0,
                i1,
                l0: 1.0 - l1,
                l1,
            }
        })
        .collect()
}

/// `F.interpolate(mode="bilinear", align_corners=False)`, no antialias.
fn bilinear(win: &Window<'_>, out_w: usize, out_h: usize, layout: SourceLayout) -> Result<Tensor4> {
    let cl = use_channels_last_kernel(win, out_w, out_h, layout);
    let xs = linear_taps(win.w, out_w, cl);
    let ys = linear_taps(win.h, out_h, cl);
    let c = win.src.c;
    let mut out = new_output(win.src.b, out_h, out_w, c)?;
    let mut i = 0;
    for b in 0..win.src.b {
        for ty in &ys {
            check_cancel()?;
            for tx in &xs {
                for ch in 0..c {
                    let p00 = win.at(b, ty.i0, tx.i0, ch);
                    let p01 = win.at(b, ty.i0, tx.i1, ch);
                    let p10 = win.at(b, ty.i1, tx.i0, ch);
                    let p11 = win.at(b, ty.i1, tx.i1, ch);
                    out.data[i] = if cl {
                        // cpu_upsample_linear_channels_last: four 2-D weights,
                        // summed left to right; GCC fuses the first product
                        // into the first add and the rest into a chain.
                        let w00 = ty.l0 * tx.l0;
                        let w01 = ty.l0 * tx.l1;
                        let w10 = ty.l1 * tx.l0;
                        let w11 = ty.l1 * tx.l1;
                        let s = p00.mul_add(w00, p01 * w01);
                        let s = p10.mul_add(w10, s);
                        p11.mul_add(w11, s)
                    } else {
                        // Generic separable kernel: interpolate along W within
                        // each of the two rows, then along H.
                        let t0 = p00.mul_add(tx.l0, p01 * tx.l1);
                        let t1 = p10.mul_add(tx.l0, p11 * tx.l1);
                        t0.mul_add(ty.l0, t1 * ty.l1)
                    };
                    i += 1;
                }
            }
        }
    }
    Ok(out)
}

#[derive(Clone, Copy)]
struct CubicTap {
    idx: [usize; 4],
    w: [f32; 4],
}

/// ATen `cubic_convolution1` (|x| <= 1) with A = -0.75, as contracted by
/// the compiler: the inner `(A + 2) * x - (A + 3)` becomes an FMA.
fn cubic_conv1(x: f32) -> f32 {
    const A: f32 = -0.75;
    let p = (A + 2.0).mul_add(x, -(A + 3.0));
    p * x * x + 1.0
}

/// ATen `cubic_convolution2` (1 < |x| < 2) with A = -0.75: the two inner
/// multiply-adds are fused, the outer one is not.
fn cubic_conv2(x: f32) -> f32 {
    const A: f32 = -0.75;
    let p = A.mul_add(x, -(5.0 * A));
    let p = p.mul_add(x, 8.0 * A);
    p * x - 4.0 * A
}

/// Indices/weights of `HelperInterpCubic::compute_indices_weights`.
fn cubic_taps(in_size: usize, out_size: usize) -> Vec<CubicTap> {
    let scale = in_size as f32 / out_size as f32;
    let last = in_size as i64 - 1;
    (0..out_size)
        .map(|o| {
            // area_pixel_compute_source_index(cubic=true): no clamp at 0.
            let real = scale.mul_add(o as f32 + 0.5, -0.5);
            let input_index = (real.floor() as i64).min(last);
            let t = (real - input_index as f32).clamp(0.0, 1.0);
            let w = [
                cubic_conv2(t + 1.0),
                cubic_conv1(t),
                cubic_conv1(1.0 - t),
                cubic_conv2((1.0 - t) + 1.0),
            ];
            let mut idx = [0usize; 4];
            for (j, slot) in idx.iter_mut().enumerate() {
                *slot = (input_index + j as i64 - 1).clamp(0, last) as usize;
            }
            CubicTap { idx, w }
        })
        .collect()
}

/// The 4-tap accumulation of the generic kernel: `out = t0*w0; out += ...`
/// compiled as `fma(t3, w3, fma(t2, w2, fma(t0, w0, t1 * w1)))`.
#[inline]
fn cubic_combine(t: [f32; 4], w: [f32; 4]) -> f32 {
    let s = t[0].mul_add(w[0], t[1] * w[1]);
    let s = t[2].mul_add(w[2], s);
    t[3].mul_add(w[3], s)
}

/// `F.interpolate(mode="bicubic", align_corners=False)`: A = -0.75, border
/// indices clamped, output not clamped.
fn bicubic(win: &Window<'_>, out_w: usize, out_h: usize) -> Result<Tensor4> {
    let xs = cubic_taps(win.w, out_w);
    let ys = cubic_taps(win.h, out_h);
    let c = win.src.c;
    let mut out = new_output(win.src.b, out_h, out_w, c)?;
    let mut i = 0;
    for b in 0..win.src.b {
        for ty in &ys {
            check_cancel()?;
            for tx in &xs {
                for ch in 0..c {
                    let mut rows = [0f32; 4];
                    for (r, &sy) in rows.iter_mut().zip(&ty.idx) {
                        let t = tx.idx.map(|sx| win.at(b, sy, sx, ch));
                        *r = cubic_combine(t, tx.w);
                    }
                    out.data[i] = cubic_combine(rows, ty.w);
                    i += 1;
                }
            }
        }
    }
    Ok(out)
}

/// `F.interpolate(mode="area")` = `adaptive_avg_pool2d`.
fn area(win: &Window<'_>, out_w: usize, out_h: usize, layout: SourceLayout) -> Result<Tensor4> {
    let c = win.src.c;
    let mut out = new_output(win.src.b, out_h, out_w, c)?;
    if out_w == 1 && out_h == 1 {
        // adaptive_avg_pool2d short-cuts a 1x1 output to `mean((-1, -2))`,
        // i.e. PyTorch's cascade `sum` divided by h*w.
        let n = win.h * win.w;
        for b in 0..win.src.b {
            for ch in 0..c {
                out.data[b * c + ch] = mean_hw(win, layout, b, ch) / n as f32;
            }
        }
        return Ok(out);
    }
    // start_index = floor(o * in / out), end_index = ceil((o + 1) * in / out)
    let bounds = |o: usize, out_size: usize, in_size: usize| {
        let start = (o * in_size) / out_size;
        let end = ((o + 1) * in_size).div_ceil(out_size);
        (start, end)
    };
    let mut i = 0;
    for b in 0..win.src.b {
        for oy in 0..out_h {
            check_cancel()?;
            let (y0, y1) = bounds(oy, out_h, win.h);
            for ox in 0..out_w {
                let (x0, x1) = bounds(ox, out_w, win.w);
                for ch in 0..c {
                    let mut sum = 0f32;
                    for y in y0..y1 {
                        for x in x0..x1 {
                            sum += win.at(b, y, x, ch);
                        }
                    }
                    out.data[i] = sum / (y1 - y0) as f32 / (x1 - x0) as f32;
                    i += 1;
                }
            }
        }
    }
    Ok(out)
}

/// `sum` over height and width of one (batch, channel) of the window, in
/// the order PyTorch's single-threaded `cascade_sum` uses for this memory
/// layout: if the two reduced dims coalesce, one row of `h*w` values,
/// otherwise one row per image row, accumulated into the output in turn.
/// A row whose elements are adjacent in memory takes the vectorised path;
/// a strided row (channels-last with several channels) is summed by
/// `scalar_outer_sum`/`vectorized_outer_sum`, which use `multi_row_sum`
/// directly for whole groups of 4 (or 32) channels and `row_sum` otherwise.
fn mean_hw(win: &Window<'_>, layout: SourceLayout, b: usize, ch: usize) -> f32 {
    let c = win.src.c;
    let coalesced = win.h == 1 || win.w == win.src.w;
    let (rows, len) = if coalesced {
        (1, win.h * win.w)
    } else {
        (win.h, win.w)
    };
    let elem = |r: usize, i: usize| {
        if coalesced {
            win.at(b, i / win.w, i % win.w, ch)
        } else {
            win.at(b, r, i, ch)
        }
    };
    // Stride (in elements) between neighbours of a row; a length-1 width
    // is dropped by TensorIterator, leaving the height dim.
    let (stride_w, stride_h) = match layout {
        SourceLayout::ChannelsLastView => (c, win.src.w * c),
        SourceLayout::ContiguousNchw => (1, win.src.w),
    };
    let row_stride = if win.w > 1 { stride_w } else { stride_h };
    let unit_stride = row_stride == 1 || len <= 1;
    let channels_inner = layout == SourceLayout::ChannelsLastView && c > 1;
    let mut total = 0f32;
    for r in 0..rows {
        let row_sum = if unit_stride {
            let vals: Vec<f32> = (0..len).map(|i| elem(r, i)).collect();
            torch_sum_contiguous(&vals)
        } else if channels_inner {
            let group = if c >= 8 { 32 } else { 4 };
            if ch < (c / group) * group {
                let [s] = torch_multi_row_sum::<1>(len, |i, _| elem(r, i));
                s
            } else {
                torch_row_sum(len, |i| elem(r, i))
            }
        } else {
            torch_row_sum(len, |i| elem(r, i))
        };
        total += row_sum;
    }
    total
}

// ---------------------------------------------------------------------------
// lanczos (ComfyUI's PIL round trip)
// ---------------------------------------------------------------------------

/// Pillow's fixed-point precision for 8-bit resampling (`PRECISION_BITS`).
const PIL_PRECISION_BITS: u32 = 32 - 8 - 2;

/// Pillow's truncated-sinc Lanczos-3 filter.
fn pil_lanczos(x: f64) -> f64 {
    fn sinc(x: f64) -> f64 {
        if x == 0.0 {
            1.0
        } else {
            let x = x * std::f64::consts::PI;
            x.sin() / x
        }
    }
    if (-3.0..3.0).contains(&x) {
        sinc(x) * sinc(x / 3.0)
    } else {
        0.0
    }
}

/// Per output pixel: first source index and fixed-point weights.
struct PilCoeffs {
    taps: Vec<(usize, Vec<i32>)>,
}

/// The Pillow filters sdkit resamples with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PilFilter {
    /// `Image.LANCZOS` (support 3).
    Lanczos,
    /// `Image.BILINEAR`: the triangle filter (support 1).
    Bilinear,
}

impl PilFilter {
    fn support(self) -> f64 {
        match self {
            PilFilter::Lanczos => 3.0,
            PilFilter::Bilinear => 1.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            PilFilter::Lanczos => pil_lanczos(x),
            PilFilter::Bilinear => {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
        }
    }
}

/// Pillow `precompute_coeffs` + `normalize_coeffs_8bpc` for a box of
/// `(0, in_size)` (floats) resampled to `out_size`.
fn pil_coeffs(in_size: usize, out_size: usize, filter: PilFilter) -> PilCoeffs {
    let in0 = 0f32;
    let in1 = in_size as f32;
    let scale = (in1 - in0) as f64 / out_size as f64;
    let filterscale = if scale < 1.0 { 1.0 } else { scale };
    let support = filter.support() * filterscale;
    let inv_filterscale = 1.0 / filterscale;
    let one = (1i64 << PIL_PRECISION_BITS) as f64;
    let taps = (0..out_size)
        .map(|xx| {
            let center = in0 as f64 + (xx as f64 + 0.5) * scale;
            // C's `(int)` truncates toward zero; negatives clamp to 0 anyway.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
            let count = (xmax - xmin).max(0) as usize;
            let mut k: Vec<f64> = (0..count)
                .map(|x| filter.weight(((x as i64 + xmin) as f64 - center + 0.5) * inv_filterscale))
                .collect();
            let ww: f64 = k.iter().fold(0.0, |acc, &w| acc + w);
            if ww != 0.0 {
                for v in &mut k {
                    *v /= ww;
                }
            }
            let fixed = k
                .iter()
                .map(|&v| {
                    if v < 0.0 {
                        (-0.5 + v * one) as i32
                    } else {
                        (0.5 + v * one) as i32
                    }
                })
                .collect();
            (xmin as usize, fixed)
        })
        .collect();
    PilCoeffs { taps }
}

/// Pillow `clip8`: drop the fraction bits (arithmetic shift) and clamp.
fn pil_clip8(ss: i64) -> u8 {
    (ss >> PIL_PRECISION_BITS).clamp(0, 255) as u8
}

/// Pillow `MULDIV255`: `(a * b + 127) / 255` done with shifts.
fn muldiv255(a: u8, b: u8) -> u8 {
    let tmp = a as u32 * b as u32 + 128;
    (((tmp >> 8) + tmp) >> 8) as u8
}

/// Pillow's un-premultiply (`rgba2rgbA` / `la2lA`).
fn unpremultiply(v: u8, alpha: u8) -> u8 {
    if alpha == 255 || alpha == 0 {
        v
    } else {
        ((255 * v as u32) / alpha as u32).min(255) as u8
    }
}

/// An interleaved 8-bit image as Pillow holds it (only the bands in use).
struct U8Image {
    w: usize,
    h: usize,
    c: usize,
    px: Vec<u8>,
}

/// One horizontal pass of Pillow's `ImagingResampleHorizontal_8bpc` over
/// rows `first..first + rows` of `src`.
fn pil_pass_horizontal(src: &U8Image, coeffs: &PilCoeffs, first: usize, rows: usize) -> U8Image {
    let (c, out_w) = (src.c, coeffs.taps.len());
    let round = 1i64 << (PIL_PRECISION_BITS - 1);
    let mut px = vec![0u8; rows * out_w * c];
    for yy in 0..rows {
        let line = &src.px[(yy + first) * src.w * c..(yy + first + 1) * src.w * c];
        for (xx, (xmin, k)) in coeffs.taps.iter().enumerate() {
            for ch in 0..c {
                let mut ss = round;
                for (x, &kv) in k.iter().enumerate() {
                    ss += line[(x + xmin) * c + ch] as i64 * kv as i64;
                }
                px[(yy * out_w + xx) * c + ch] = pil_clip8(ss);
            }
        }
    }
    U8Image {
        w: out_w,
        h: rows,
        c,
        px,
    }
}

/// One vertical pass of Pillow's `ImagingResampleVertical_8bpc`; source
/// row indices are `bounds - shift`.
fn pil_pass_vertical(src: &U8Image, coeffs: &PilCoeffs, shift: usize) -> U8Image {
    let (c, out_h) = (src.c, coeffs.taps.len());
    let round = 1i64 << (PIL_PRECISION_BITS - 1);
    let mut px = vec![0u8; out_h * src.w * c];
    for (yy, (ymin, k)) in coeffs.taps.iter().enumerate() {
        let ymin = ymin - shift;
        for xx in 0..src.w {
            for ch in 0..c {
                let mut ss = round;
                for (y, &kv) in k.iter().enumerate() {
                    ss += src.px[((y + ymin) * src.w + xx) * c + ch] as i64 * kv as i64;
                }
                px[(yy * src.w + xx) * c + ch] = pil_clip8(ss);
            }
        }
    }
    U8Image {
        w: src.w,
        h: out_h,
        c,
        px,
    }
}

/// `Image.resize((w, h), LANCZOS)` on an LA/RGB/RGBA-like u8 image with
/// Pillow's two-pass fixed-point `ImagingResampleInner` (Pillow 13: the
/// vertical pass runs first when the height shrinks and the width does not;
/// otherwise horizontal first, over only the rows the vertical pass reads).
/// For 2 and 4 channels the caller premultiplies alpha.
fn pil_resample(src: &U8Image, out_w: usize, out_h: usize, filter: PilFilter) -> U8Image {
    let need_h = out_w != src.w;
    let need_v = out_h != src.h;
    let horizontal_first = !(out_w >= src.w && out_h < src.h);
    let vert = pil_coeffs(src.h, out_h, filter);
    if horizontal_first {
        let (first, shift, rows) = if need_h {
            // Rows of the source that the vertical pass will read.
            let first = vert.taps.first().map_or(0, |t| t.0);
            let last = vert.taps.last().map_or(0, |t| t.0 + t.1.len());
            (first, first, last - first)
        } else {
            (0, 0, src.h)
        };
        let tmp = if need_h {
            pil_pass_horizontal(src, &pil_coeffs(src.w, out_w, filter), first, rows)
        } else {
            U8Image {
                w: src.w,
                h: src.h,
                c: src.c,
                px: src.px.clone(),
            }
        };
        if need_v {
            pil_pass_vertical(&tmp, &vert, shift)
        } else {
            tmp
        }
    } else {
        // Here need_v holds (the height shrinks).
        let tmp = pil_pass_vertical(src, &vert, 0);
        if need_h {
            pil_pass_horizontal(&tmp, &pil_coeffs(src.w, out_w, filter), 0, tmp.h)
        } else {
            tmp
        }
    }
}

/// `Image.resize((out_w, out_h), filter)` of an 8-bit RGB image (rows of
/// `w × 3` bytes), as Pillow computes it.
pub fn pil_resize_rgb(
    px: &[u8],
    w: usize,
    h: usize,
    out_w: usize,
    out_h: usize,
    filter: PilFilter,
) -> Vec<u8> {
    let src = U8Image {
        w,
        h,
        c: 3,
        px: px.to_vec(),
    };
    pil_resample(&src, out_w, out_h, filter).px
}

/// `ImageOps.contain(image, (size, size))`'s output size for a `w × h`
/// image: the largest that fits with the aspect kept, the other side
/// rounded as Python's `round` does.
pub fn pil_contain_size(w: usize, h: usize, size: usize) -> (usize, usize) {
    let (wf, hf) = (w.max(1) as f64, h.max(1) as f64);
    let round = |v: f64| -> usize {
        let r = v.round();
        let r = if (v - v.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
            r - v.signum()
        } else {
            r
        };
        r.max(0.0) as usize
    };
    let (im, dest) = (wf / hf, 1.0);
    if im == dest {
        (size, size)
    } else if im > dest {
        (size, round(hf / wf * size as f64))
    } else {
        (round(wf / hf * size as f64), size)
    }
}

/// ComfyUI `comfy.utils.lanczos`: each image goes through
/// `np.clip(255 * x, 0, 255).astype(uint8)`, `PIL.Image.resize(LANCZOS)`
/// (LA/RGBA are premultiplied around the resize, as Pillow does), then
/// `/ 255`. PIL only accepts 2 (LA), 3 (RGB) or 4 (RGBA) channels here.
fn lanczos(win: &Window<'_>, out_w: usize, out_h: usize) -> Result<Tensor4> {
    let c = win.src.c;
    if !(2..=4).contains(&c) {
        return Err(ImageOpError::UnsupportedChannels {
            op: "lanczos",
            channels: c,
        });
    }
    let has_alpha = c != 3;
    let mut out = new_output(win.src.b, out_h, out_w, c)?;
    let per_item = out_h * out_w * c;
    for b in 0..win.src.b {
        check_cancel()?;
        let mut px = Vec::with_capacity(win.h * win.w * c);
        for y in 0..win.h {
            for x in 0..win.w {
                for ch in 0..c {
                    px.push(f32_to_u8(win.at(b, y, x, ch)));
                }
            }
        }
        let img = U8Image {
            w: win.w,
            h: win.h,
            c,
            px,
        };
        // Image.resize returns a copy when the size is unchanged.
        let resized = if out_w == img.w && out_h == img.h {
            img
        } else if has_alpha {
            let mut pre = img;
            for p in pre.px.chunks_exact_mut(c) {
                let a = p[c - 1];
                for v in &mut p[..c - 1] {
                    *v = muldiv255(*v, a);
                }
            }
            let mut r = pil_resample(&pre, out_w, out_h, PilFilter::Lanczos);
            for p in r.px.chunks_exact_mut(c) {
                let a = p[c - 1];
                for v in &mut p[..c - 1] {
                    *v = unpremultiply(*v, a);
                }
            }
            r
        } else {
            pil_resample(&img, out_w, out_h, PilFilter::Lanczos)
        };
        let dst = &mut out.data[b * per_item..(b + 1) * per_item];
        for (d, &v) in dst.iter_mut().zip(&resized.px) {
            *d = u8_to_f32(v);
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// bislerp
// ---------------------------------------------------------------------------

/// `generate_bilinear_data` of ComfyUI's bislerp: a 1-D bilinear resize of
/// `arange(len_old)` (and of `arange + 1` with the last entry pulled back),
/// giving the fractional ratio and both integer neighbours per output.
fn bislerp_coords(len_old: usize, len_new: usize) -> Vec<(f32, usize, usize)> {
    // The tensor is (1, 1, 1, len_old): C == 1, so PyTorch picks the
    // channels-last kernel only for small outputs (1 + len_new <= 128).
    let fused = len_new < 128;
    let taps = linear_taps(len_old, len_new, fused);
    taps.iter()
        .map(|t| {
            let interp = |v0: f32, v1: f32| {
                if fused {
                    // Channels-last formula with the zero-weight second row.
                    let s = v0.mul_add(t.l0, v1 * t.l1);
                    let s = v0.mul_add(0.0, s);
                    v1.mul_add(0.0, s)
                } else {
                    let t0 = v0.mul_add(t.l0, v1 * t.l1);
                    t0.mul_add(1.0, t0 * 0.0)
                }
            };
            let c1 = interp(t.i0 as f32, t.i1 as f32);
            let shifted = |i: usize| {
                if i + 1 == len_old {
                    i as f32
                } else {
                    (i + 1) as f32
                }
            };
            let c2 = interp(shifted(t.i0), shifted(t.i1));
            let ratio = c1 - c1.floor();
            (ratio, c1.max(0.0) as usize, c2.max(0.0) as usize)
        })
        .collect()
}

/// ComfyUI's `slerp` on two C-vectors with ratio `r`.
fn slerp_pixel(b1: &[f32], b2: &[f32], r: f32, out: &mut [f32]) {
    let norm = |v: &[f32]| v.iter().fold(0f32, |acc, &x| x.mul_add(x, acc)).sqrt();
    let n1 = norm(b1);
    let n2 = norm(b2);
    let unit = |v: f32, n: f32| if n == 0.0 { 0.0 } else { v / n };
    let mut dot = 0f32;
    for (&a, &b) in b1.iter().zip(b2) {
        dot += unit(a, n1) * unit(b, n2);
    }
    // PyTorch compares against the Python doubles cast to float32.
    let upper = (1.0f64 - 1e-5) as f32;
    let lower = (1e-5f64 - 1.0) as f32;
    if dot > upper {
        out.copy_from_slice(b1);
        return;
    }
    if dot < lower {
        for ((o, &a), &b) in out.iter_mut().zip(b1).zip(b2) {
            *o = a * (1.0 - r) + b * r;
        }
        return;
    }
    let omega = dot.acos();
    let so = omega.sin();
    let s1 = ((1.0 - r) * omega).sin() / so;
    let s2 = (r * omega).sin() / so;
    let scale = n1 * (1.0 - r) + n2 * r;
    for ((o, &a), &b) in out.iter_mut().zip(b1).zip(b2) {
        *o = (s1 * unit(a, n1) + s2 * unit(b, n2)) * scale;
    }
}

/// ComfyUI `comfy.utils.bislerp`: slerp along width, then along height,
/// treating each pixel's channel vector as a direction plus a norm.
/// Not bit-exact (PyTorch's `acos`/`sin`/`norm` differ from libm by an ULP
/// or so); agrees to about 1e-6.
fn bislerp(win: &Window<'_>, out_w: usize, out_h: usize) -> Result<Tensor4> {
    let c = win.src.c;
    let n = win.src.b;
    let xs = bislerp_coords(win.w, out_w);
    let ys = bislerp_coords(win.h, out_h);
    // Width pass: (n, h, out_w, c).
    let mut mid = alloc_filled(&[n, win.h, out_w, c], 0.0)?;
    let mut p1 = vec![0f32; c];
    let mut p2 = vec![0f32; c];
    for b in 0..n {
        for y in 0..win.h {
            check_cancel()?;
            for (x, &(r, i1, i2)) in xs.iter().enumerate() {
                for ch in 0..c {
                    p1[ch] = win.at(b, y, i1.min(win.w - 1), ch);
                    p2[ch] = win.at(b, y, i2.min(win.w - 1), ch);
                }
                let o = ((b * win.h + y) * out_w + x) * c;
                slerp_pixel(&p1, &p2, r, &mut mid[o..o + c]);
            }
        }
    }
    // Height pass.
    let mut out = new_output(n, out_h, out_w, c)?;
    for b in 0..n {
        for (y, &(r, i1, i2)) in ys.iter().enumerate() {
            check_cancel()?;
            for x in 0..out_w {
                let a = ((b * win.h + i1.min(win.h - 1)) * out_w + x) * c;
                let bb = ((b * win.h + i2.min(win.h - 1)) * out_w + x) * c;
                let o = ((b * out_h + y) * out_w + x) * c;
                slerp_pixel(&mid[a..a + c], &mid[bb..bb + c], r, &mut out.data[o..o + c]);
            }
        }
    }
    Ok(out)
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
    let (mut width, mut height) = (width, height);
    if width == 0 {
        width = py_round_usize(img.w as f64 * height as f64 / img.h as f64).max(1);
    } else if height == 0 {
        height = py_round_usize(img.h as f64 * width as f64 / img.w as f64).max(1);
    }
    upscale(img, width, height, method, crop)
}

/// ComfyUI `ImageScaleBy.upscale`: `round(w * scale_by)` x
/// `round(h * scale_by)` (banker's rounding), crop disabled.
pub fn scale_by(img: &Tensor4, method: UpscaleMethod, scale_by: f64) -> Result<Tensor4> {
    if !scale_by.is_finite() || scale_by <= 0.0 {
        return Err(ImageOpError::InvalidArgument(format!(
            "scale_by must be positive, got {scale_by}"
        )));
    }
    let width = py_round_usize(img.w as f64 * scale_by);
    let height = py_round_usize(img.h as f64 * scale_by);
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
    let reflect = |p: isize, n: usize| -> usize {
        let n = n as isize;
        let q = if p < 0 {
            -p
        } else if p >= n {
            2 * (n - 1) - p
        } else {
            p
        };
        q as usize
    };
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
    let kernel = gaussian_kernel(blur_radius * 2 + 1, sigma);
    reflect_conv(img, blur_radius, &kernel)
}

/// ComfyUI `ImageSharpen`: kernel `-(alpha * 10) * gaussian` with the
/// center raised so the kernel sums to one, then clamp to `0..=1`.
pub fn sharpen(img: &Tensor4, sharpen_radius: usize, sigma: f64, alpha: f64) -> Result<Tensor4> {
    if sharpen_radius == 0 {
        return Ok(img.clone());
    }
    check_len(&img.shape(), img.data.len())?;
    let k = sharpen_radius * 2 + 1;
    let factor = (-(alpha * 10.0)) as f32;
    let mut kernel: Vec<f32> = gaussian_kernel(k, sigma)
        .iter()
        .map(|&v| v * factor)
        .collect();
    let sum = torch_sum_contiguous(&kernel);
    let center = (k / 2) * k + k / 2;
    kernel[center] = kernel[center] - sum + 1.0;
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

/// Edges as ComfyUI's Canny node finds them (kornia's `canny`, default 5×5
/// Gaussian with σ = 1): grey (BT.601 weights), blurred (reflected
/// border), unnormalised Sobel gradients (replicated border), magnitude
/// `sqrt(gx² + gy² + 1e-6)`, non-maximum suppression along the gradient
/// rounded to 45° (strictly above the left/upper neighbour, at least the
/// right/lower one, strictly above both on diagonals; outside the image the
/// magnitude is that of a flat pixel), thresholds (weak above `low`, strong
/// above `high`) and 8-neighbour hysteresis until nothing changes. The
/// result is 0/1 in three channels.
pub fn canny(img: &Tensor4, low: f32, high: f32) -> Result<Tensor4> {
    check_len(&img.shape(), img.data.len())?;
    if img.c != 3 && img.c != 1 {
        return Err(ImageOpError::InvalidArgument(format!(
            "Canny takes 1 or 3 channels, not {}",
            img.c
        )));
    }
    if !(low > 0.0 && low <= high) {
        return Err(ImageOpError::InvalidArgument(format!(
            "low_threshold {low} must be positive and at most high_threshold {high}"
        )));
    }
    let (h, w) = (img.h, img.w);
    let mut out = new_output(img.b, h, w, 3)?;
    // The Gaussian taps at offsets −2..2, normalised.
    let taps: Vec<f32> = (-2i32..=2)
        .map(|x| (-((x * x) as f32) / 2.0).exp())
        .collect();
    let sum: f32 = taps.iter().sum();
    let taps: Vec<f32> = taps.iter().map(|t| t / sum).collect();
    let reflect = |i: isize, n: usize| -> usize {
        let n = n as isize;
        if n == 1 {
            return 0;
        }
        let mut i = i;
        while i < 0 || i >= n {
            i = if i < 0 { -i } else { 2 * (n - 1) - i };
        }
        i as usize
    };
    let clamp = |i: isize, n: usize| -> usize { i.clamp(0, n as isize - 1) as usize };
    for b in 0..img.b {
        check_cancel()?;
        let grey: Vec<f32> = (0..h * w)
            .map(|p| {
                let px = &img.data[(b * h * w + p) * img.c..];
                if img.c == 3 {
                    0.299 * px[0] + 0.587 * px[1] + 0.114 * px[2]
                } else {
                    px[0]
                }
            })
            .collect();
        // Separable blur: along x, then along y.
        let mut tmp = vec![0f32; h * w];
        for y in 0..h {
            for x in 0..w {
                let mut s = 0f32;
                for (k, t) in taps.iter().enumerate() {
                    s += t * grey[y * w + reflect(x as isize + k as isize - 2, w)];
                }
                tmp[y * w + x] = s;
            }
        }
        let mut blur = vec![0f32; h * w];
        for y in 0..h {
            for x in 0..w {
                let mut s = 0f32;
                for (k, t) in taps.iter().enumerate() {
                    s += t * tmp[reflect(y as isize + k as isize - 2, h) * w + x];
                }
                blur[y * w + x] = s;
            }
        }
        let at = |y: isize, x: isize| blur[clamp(y, h) * w + clamp(x, w)];
        let eps = 1e-6f32;
        let flat = eps.sqrt();
        let mut mag = vec![0f32; h * w];
        let mut dir = vec![0usize; h * w];
        for y in 0..h as isize {
            for x in 0..w as isize {
                let gx = -at(y - 1, x - 1) + at(y - 1, x + 1) - 2.0 * at(y, x - 1)
                    + 2.0 * at(y, x + 1)
                    - at(y + 1, x - 1)
                    + at(y + 1, x + 1);
                let gy = -at(y - 1, x - 1) - 2.0 * at(y - 1, x) - at(y - 1, x + 1)
                    + at(y + 1, x - 1)
                    + 2.0 * at(y + 1, x)
                    + at(y + 1, x + 1);
                let i = y as usize * w + x as usize;
                mag[i] = (gx * gx + gy * gy + eps).sqrt();
                let angle = gy.atan2(gx);
                let a = (angle * (4.0 / std::f32::consts::PI)).round_ties_even();
                dir[i] = a.rem_euclid(8.0) as usize % 8;
            }
        }
        // Neighbour k at (dy, dx), k = 0 right, 2 down, 4 left, 6 up.
        const OFF: [(isize, isize); 8] = [
            (0, 1),
            (1, 1),
            (1, 0),
            (1, -1),
            (0, -1),
            (-1, -1),
            (-1, 0),
            (-1, 1),
        ];
        let neighbour = |y: usize, x: usize, k: usize| -> f32 {
            let (dy, dx) = OFF[k];
            let (yy, xx) = (y as isize + dy, x as isize + dx);
            if yy < 0 || xx < 0 || yy >= h as isize || xx >= w as isize {
                flat
            } else {
                mag[yy as usize * w + xx as usize]
            }
        };
        let beats = |m: f32, n: f32, k: usize| m > n || ((k == 0 || k == 2) && m == n);
        let mut edges = vec![0f32; h * w];
        for y in 0..h {
            for x in 0..w {
                let i = y * w + x;
                let (m, p) = (mag[i], dir[i]);
                let q = (p + 4) % 8;
                let keep =
                    beats(m, neighbour(y, x, p), p) && beats(m, neighbour(y, x, q), q) && m > flat;
                let m = if keep { m } else { 0.0 };
                edges[i] = (f32::from(u8::from(m > low)) + f32::from(u8::from(m > high))) * 0.5;
            }
        }
        // Hysteresis: weak pixels next to a strong one become strong.
        loop {
            let mut next = edges.clone();
            let mut changed = false;
            for y in 0..h {
                for x in 0..w {
                    let i = y * w + x;
                    if edges[i] != 0.5 {
                        continue;
                    }
                    let strong = OFF.iter().any(|&(dy, dx)| {
                        let (yy, xx) = (y as isize + dy, x as isize + dx);
                        yy >= 0
                            && xx >= 0
                            && yy < h as isize
                            && xx < w as isize
                            && edges[yy as usize * w + xx as usize] == 1.0
                    });
                    if strong {
                        next[i] = 1.0;
                        changed = true;
                    }
                }
            }
            edges = next;
            if !changed {
                break;
            }
        }
        for (i, e) in edges.iter().enumerate() {
            let v = if *e == 1.0 { 1.0 } else { 0.0 };
            let o = (b * h * w + i) * 3;
            out.data[o..o + 3].fill(v);
        }
    }
    Ok(out)
}
