//! ComfyUI's latent and image-batch nodes as plain functions, their
//! quirks kept (checked against ComfyUI's node classes by
//! `tools/reference/image_ops.py latentops`): LatentComposite(Masked),
//! LatentBlend, LatentFromBatch, RepeatLatentBatch, LatentCrop,
//! LatentFlip, LatentRotate, RepeatImageBatch, ImageFromBatch,
//! ImageColorToMask and ImageScaleToMaxDimension. Every latent node starts
//! from a copy of its first latent: its noise mask and batch index pass
//! through unchanged unless the node says otherwise.

use super::*;

/// A LATENT as these ops see it: `samples` `[b, c, h, w]`, and the
/// optional noise mask (data and shape, kept as given) and batch index.
#[derive(Clone, Debug, PartialEq)]
pub struct LatentParts {
    pub shape: [usize; 4],
    pub samples: Vec<f32>,
    pub noise_mask: Option<(Vec<usize>, Vec<f32>)>,
    pub batch_index: Option<Vec<i64>>,
}

impl LatentParts {
    fn with_samples(&self, shape: [usize; 4], samples: Vec<f32>) -> LatentParts {
        LatentParts {
            shape,
            samples,
            ..self.clone()
        }
    }
}

fn bad(msg: impl Into<String>) -> ImageOpError {
    ImageOpError::InvalidArgument(msg.into())
}

/// Python's `a[start:stop]` on a length-`len` axis: the range selected.
fn py_slice(start: i64, stop: i64, len: usize) -> std::ops::Range<usize> {
    let n = len as i64;
    let fix = |v: i64| if v < 0 { (v + n).max(0) } else { v.min(n) };
    let (a, b) = (fix(start), fix(stop));
    a as usize..b.max(a) as usize
}

/// The broadcast of a source extent onto a target's (torch's rules for
/// an assignment): equal, or a source of 1.
fn fits(src: usize, dst: usize) -> bool {
    src == dst || src == 1
}

/// LatentComposite: `samples_from` pasted into `samples_to` at `(x, y)`
/// pixels (÷ 8, floored), with `feather` pixels (÷ 8) of linear ramps on
/// the inner edges; the source clipped to the destination as Python
/// slices clip it (past the edge, a negative bound counts from the end and
/// torch refuses what does not fit).
pub fn latent_composite(
    to: &LatentParts,
    from: &LatentParts,
    x: usize,
    y: usize,
    feather: usize,
) -> Result<LatentParts> {
    let [b, c, h, w] = to.shape;
    let [fb, fc, fh, fw] = from.shape;
    let (x, y, feather) = ((x / 8) as i64, (y / 8) as i64, feather / 8);
    if !fits(fb, b) || !fits(fc, c) {
        return Err(bad(format!(
            "a source latent of shape {:?} does not fit one of {:?}",
            from.shape, to.shape
        )));
    }
    // samples_from[:, :, :h - y, :w - x]
    let rows = py_slice(0, h as i64 - y, fh);
    let cols = py_slice(0, w as i64 - x, fw);
    let (sh, sw) = (rows.len(), cols.len());
    // The target region: y:y + (source rows: the whole source without
    // feathering, the clipped one with it).
    let (th, tw) = if feather == 0 { (fh, fw) } else { (sh, sw) };
    let trows = py_slice(y, y + th as i64, h);
    let tcols = py_slice(x, x + tw as i64, w);
    if !fits(sh, trows.len()) || !fits(sw, tcols.len()) {
        return Err(bad(format!(
            "a {sh}×{sw} source region does not fit the {}×{} target region",
            trows.len(),
            tcols.len()
        )));
    }
    // The feather mask over the clipped source.
    let mut mask = vec![1f32; sh * sw];
    let scale_row = |r: std::ops::Range<usize>, v: f32, mask: &mut Vec<f32>| {
        for rr in r {
            mask[rr * sw..(rr + 1) * sw]
                .iter_mut()
                .for_each(|m| *m *= v);
        }
    };
    for t in 0..feather as i64 {
        let v = ((1.0 / feather as f64) * (t + 1) as f64) as f32;
        if y != 0 {
            scale_row(py_slice(t, t + 1, sh), v, &mut mask);
        }
        if y + (sh as i64) < h as i64 {
            scale_row(py_slice(sh as i64 - 1 - t, sh as i64 - t, sh), v, &mut mask);
        }
        let mut scale_col = |cs: std::ops::Range<usize>| {
            for r in 0..sh {
                for cc in cs.clone() {
                    mask[r * sw + cc] *= v;
                }
            }
        };
        if x != 0 {
            scale_col(py_slice(t, t + 1, sw));
        }
        if x + (sw as i64) < w as i64 {
            scale_col(py_slice(sw as i64 - 1 - t, sw as i64 - t, sw));
        }
    }
    let mut out = to.samples.clone();
    for bi in 0..b {
        let sb = if fb == 1 { 0 } else { bi };
        for ch in 0..c {
            let sc = if fc == 1 { 0 } else { ch };
            for (i, ty) in trows.clone().enumerate() {
                let sy = if sh == 1 { 0 } else { i };
                for (j, tx) in tcols.clone().enumerate() {
                    let sx = if sw == 1 { 0 } else { j };
                    let s = from.samples
                        [((sb * fc + sc) * fh + rows.start + sy) * fw + cols.start + sx];
                    let at = ((bi * c + ch) * h + ty) * w + tx;
                    out[at] = if feather == 0 {
                        s
                    } else {
                        let m = mask[sy * sw + sx];
                        s * m + out[at] * (1.0 - m)
                    };
                }
            }
        }
    }
    Ok(to.with_samples(to.shape, out))
}

/// LatentCompositeMasked (`composite` with multiplier 8): `source` over
/// `destination` at `(x, y)` pixels (÷ 8), weighted by `mask` (resized
/// bilinearly to the source, the batch tiled; ones without), clipped to
/// the destination; `resize_source` first resizes the source bilinearly.
pub fn latent_composite_masked(
    destination: &LatentParts,
    source: &LatentParts,
    x: usize,
    y: usize,
    resize_source: bool,
    mask: Option<&Mask3>,
) -> Result<LatentParts> {
    let [b, c, h, w] = destination.shape;
    let [sb, sc, mut sh, mut sw] = source.shape;
    if sc != c {
        return Err(bad(format!(
            "a source latent with {sc} channels cannot go into one with {c}"
        )));
    }
    let mut src = source.samples.clone();
    if resize_source && (sh, sw) != (h, w) {
        src = resize_planes(&src, sb * sc, (sh, sw), (h, w), Crop::Disabled)?;
        (sh, sw) = (h, w);
    }
    let src = repeat_to_batch(&src, sc * sh * sw, b);
    let left = x.min(w * 8) / 8;
    let top = y.min(h * 8) / 8;
    let m = match mask {
        Some(m) => {
            let planes = resize_planes(&m.data, m.b, (m.h, m.w), (sh, sw), Crop::Disabled)?;
            repeat_to_batch(&planes, sh * sw, b)
        }
        None => vec![1.0; b * sh * sw],
    };
    let (vh, vw) = ((h - top).min(sh), (w - left).min(sw));
    let mut out = destination.samples.clone();
    for bi in 0..b {
        for ch in 0..c {
            for sy in 0..vh {
                for sx in 0..vw {
                    let mv = m[(bi * sh + sy) * sw + sx];
                    let s = src[((bi * c + ch) * sh + sy) * sw + sx];
                    let at = ((bi * c + ch) * h + top + sy) * w + left + sx;
                    out[at] = mv * s + (1.0 - mv) * out[at];
                }
            }
        }
    }
    Ok(destination.with_samples(destination.shape, out))
}

/// LatentBlend ("normal"): `s1·f + s2·(1 − f)`, `samples2` first resized
/// (bicubic, centre crop) to `samples1`'s size when their shapes differ,
/// batches broadcast where one is 1.
pub fn latent_blend(s1: &LatentParts, s2: &LatentParts, factor: f64) -> Result<LatentParts> {
    let [b1, c1, h, w] = s1.shape;
    let [b2, c2, h2, w2] = s2.shape;
    let other = if s1.shape != s2.shape {
        upscale_latent(
            &s2.samples,
            s2.shape,
            (w, h),
            UpscaleMethod::Bicubic,
            Crop::Center,
        )?
    } else {
        s2.samples.clone()
    };
    let _ = (h2, w2);
    if c1 != c2 || !(b1 == b2 || b1 == 1 || b2 == 1) {
        return Err(bad(format!(
            "latents of shapes {:?} and {:?} do not blend",
            s1.shape, s2.shape
        )));
    }
    let b = b1.max(b2);
    let per = c1 * h * w;
    let f = factor as f32;
    let g = (1.0 - factor) as f32;
    let mut out = Vec::with_capacity(b * per);
    for bi in 0..b {
        let a = &s1.samples[if b1 == 1 { 0 } else { bi } * per..][..per];
        let o = &other[if b2 == 1 { 0 } else { bi } * per..][..per];
        out.extend(a.iter().zip(o).map(|(x, y)| x * f + y * g));
    }
    Ok(s1.with_samples([b, c1, h, w], out))
}

/// `min(b − 1, index)` and `min(b − index, length)`, as ComfyUI clamps
/// a batch selection.
pub fn batch_range(b: usize, index: usize, length: usize) -> std::ops::Range<usize> {
    let i = index.min(b.saturating_sub(1));
    i..i + length.min(b - i)
}

/// LatentFromBatch: `length` latents from `batch_index` (clamped); a
/// noise mask of batch 1 stays, a larger one is tiled to the batch and
/// cut the same way; the batch index is the range (or the input's cut).
pub fn latent_from_batch(s: &LatentParts, index: usize, length: usize) -> Result<LatentParts> {
    let [b, c, h, w] = s.shape;
    if b == 0 {
        return Err(bad("an empty latent batch"));
    }
    let r = batch_range(b, index, length);
    let per = c * h * w;
    let mut out = s.with_samples(
        [r.len(), c, h, w],
        s.samples[r.start * per..r.end * per].to_vec(),
    );
    if let Some((shape, data)) = &s.noise_mask {
        let mb = shape.first().copied().unwrap_or(1);
        if mb > 1 {
            let mper = data.len() / mb;
            let tiled = if mb < b {
                repeat_to_batch(data, mper, b)
            } else {
                data.clone()
            };
            let n = tiled.len() / mper.max(1);
            let mr = r.start.min(n)..r.end.min(n);
            let mut ms = shape.clone();
            ms[0] = mr.len();
            out.noise_mask = Some((ms, tiled[mr.start * mper..mr.end * mper].to_vec()));
        }
    }
    out.batch_index = Some(match &s.batch_index {
        None => (r.start as i64..r.end as i64).collect(),
        Some(bi) => {
            let n = bi.len();
            bi[r.start.min(n)..r.end.min(n)].to_vec()
        }
    });
    Ok(out)
}

/// RepeatLatentBatch: the whole batch `amount` times; a noise mask of
/// batch > 1 repeated as it is (ComfyUI's tiling to the batch goes unused);
/// a batch index extended by offsets of its span.
pub fn repeat_latent_batch(s: &LatentParts, amount: usize) -> LatentParts {
    let [b, c, h, w] = s.shape;
    let mut out = s.with_samples([b * amount, c, h, w], s.samples.repeat(amount));
    if let Some((shape, data)) = &s.noise_mask {
        if shape.first().copied().unwrap_or(1) > 1 {
            let mut ms = shape.clone();
            ms[0] *= amount;
            out.noise_mask = Some((ms, data.repeat(amount)));
        }
    }
    if let Some(bi) = &s.batch_index {
        let (lo, hi) = (
            bi.iter().copied().min().unwrap_or(0),
            bi.iter().copied().max().unwrap_or(0),
        );
        let offset = hi - lo + 1;
        let mut v = bi.clone();
        for i in 1..amount as i64 {
            v.extend(bi.iter().map(|x| x + i * offset));
        }
        out.batch_index = Some(v);
    }
    out
}

/// LatentCrop: `width × height` pixels at `(x, y)` (all ÷ 8), x and y
/// clamped to 8 cells before the edge (negative for a latent under 8
/// cells: Python then counts from the end).
pub fn latent_crop(
    s: &LatentParts,
    width: usize,
    height: usize,
    x: usize,
    y: usize,
) -> LatentParts {
    let [b, c, h, w] = s.shape;
    let x = ((x / 8) as i64).min(w as i64 - 8);
    let y = ((y / 8) as i64).min(h as i64 - 8);
    let rows = py_slice(y, (height / 8) as i64 + y, h);
    let cols = py_slice(x, (width / 8) as i64 + x, w);
    let mut out = Vec::with_capacity(b * c * rows.len() * cols.len());
    for plane in s.samples.chunks(h * w).take(b * c) {
        for r in rows.clone() {
            out.extend_from_slice(&plane[r * w + cols.start..r * w + cols.end]);
        }
    }
    s.with_samples([b, c, rows.len(), cols.len()], out)
}

/// LatentFlip: "x-axis: vertically" flips the rows, "y-axis:
/// horizontally" the columns.
pub fn latent_flip(s: &LatentParts, vertically: bool) -> LatentParts {
    let [_, _, h, w] = s.shape;
    let mut out = Vec::with_capacity(s.samples.len());
    for plane in s.samples.chunks(h * w) {
        for r in 0..h {
            let src = if vertically { h - 1 - r } else { r };
            let row = &plane[src * w..(src + 1) * w];
            if vertically {
                out.extend_from_slice(row);
            } else {
                out.extend(row.iter().rev());
            }
        }
    }
    s.with_samples(s.shape, out)
}

/// LatentRotate: `torch.rot90(samples, k, dims=[3, 2])` (k quarter
/// turns clockwise).
pub fn latent_rotate(s: &LatentParts, k: usize) -> LatentParts {
    let [b, c, h, w] = s.shape;
    let k = k % 4;
    let (oh, ow) = if k % 2 == 1 { (w, h) } else { (h, w) };
    let mut out = Vec::with_capacity(s.samples.len());
    for plane in s.samples.chunks(h * w).take(b * c) {
        for i in 0..oh {
            for j in 0..ow {
                let (r, col) = match k {
                    0 => (i, j),
                    1 => (h - 1 - j, i),
                    2 => (h - 1 - i, w - 1 - j),
                    _ => (j, w - 1 - i),
                };
                out.push(plane[r * w + col]);
            }
        }
    }
    s.with_samples([b, c, oh, ow], out)
}

/// RepeatImageBatch: the whole batch `amount` times.
pub fn repeat_image_batch(img: &Tensor4, amount: usize) -> Result<Tensor4> {
    Tensor4::new(img.b * amount, img.h, img.w, img.c, img.data.repeat(amount))
}

/// ImageFromBatch: `length` images from `batch_index`, clamped as
/// LatentFromBatch clamps.
pub fn image_from_batch(img: &Tensor4, index: usize, length: usize) -> Result<Tensor4> {
    if img.b == 0 {
        return Err(bad("an empty image batch"));
    }
    let r = batch_range(img.b, index, length);
    let per = img.h * img.w * img.c;
    Tensor4::new(
        r.len(),
        img.h,
        img.w,
        img.c,
        img.data[r.start * per..r.end * per].to_vec(),
    )
}

/// ImageColorToMask: 1 where `(r << 16) + (g << 8) + b` of the pixel
/// (clamped to 0..1, × 255, rounded half to even) is `color`.
pub fn image_color_to_mask(img: &Tensor4, color: i64) -> Result<Mask3> {
    if img.c < 3 {
        return Err(bad(format!(
            "ImageColorToMask takes RGB images; this one has {} channels",
            img.c
        )));
    }
    let q = |v: f32| (v.clamp(0.0, 1.0) * 255.0).round_ties_even() as i64;
    let data = img
        .data
        .chunks(img.c)
        .map(|p| {
            let v = (q(p[0]) << 16) + (q(p[1]) << 8) + q(p[2]);
            if v == color {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    Mask3::new(img.b, img.h, img.w, data)
}

/// ImageScaleToMaxDimension's output size `(w, h)`: the longer side
/// `largest`, the other in proportion, rounded as Python rounds.
pub fn max_dimension_size(w: usize, h: usize, largest: usize) -> (usize, usize) {
    match h.cmp(&w) {
        std::cmp::Ordering::Greater => (
            py_round_usize(w as f64 / h as f64 * largest as f64),
            largest,
        ),
        std::cmp::Ordering::Less => (
            largest,
            py_round_usize(h as f64 / w as f64 * largest as f64),
        ),
        std::cmp::Ordering::Equal => (largest, largest),
    }
}

/// ImageScaleToMaxDimension: the longer side to `largest`, the other
/// Python-rounded in proportion (a square to `largest` both ways).
pub fn scale_to_max_dimension(
    img: &Tensor4,
    method: UpscaleMethod,
    largest: usize,
) -> Result<Tensor4> {
    let (ow, oh) = max_dimension_size(img.w, img.h, largest);
    upscale(img, ow, oh, method, Crop::Disabled)
}
