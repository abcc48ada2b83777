//! Pillow's fixed-point 8-bit resampling (`ImagingResample`), Lanczos for
//! ComfyUI's `lanczos` upscale and bilinear for the server's preview
//! scaling (`ImageOps.contain`).

use super::*;

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
    let (im, dest) = (wf / hf, 1.0);
    if im == dest {
        (size, size)
    } else if im > dest {
        (size, py_round_usize(hf / wf * size as f64))
    } else {
        (py_round_usize(wf / hf * size as f64), size)
    }
}

/// ComfyUI `comfy.utils.lanczos`: each image goes through
/// `np.clip(255 * x, 0, 255).astype(uint8)`, `PIL.Image.resize(LANCZOS)`
/// (LA/RGBA are premultiplied around the resize, as Pillow does), then
/// `/ 255`. PIL only accepts 2 (LA), 3 (RGB) or 4 (RGBA) channels here.
pub(super) fn lanczos(win: &Window<'_>, out_w: usize, out_h: usize) -> Result<Tensor4> {
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
