//! Geometry and mask nodes' maths: flips and quarter turns, ComfyUI's
//! masked composite, mask growth (SciPy's grey dilation/erosion), mask
//! thresholds, and the total-pixel and latent upscales built on
//! [`common_upscale`].

use super::{
    alloc_empty, alloc_filled, check_len, common_upscale, py_round_usize, Crop, ImageOpError,
    Mask3, Result, SourceLayout, Tensor4, UpscaleMethod,
};

/// ComfyUI's ImageFlip: `vertical` mirrors rows (`torch.flip(dims=[1])`,
/// "x-axis: vertically"), otherwise columns ("y-axis: horizontally").
pub fn flip(img: &Tensor4, vertical: bool) -> Result<Tensor4> {
    let (h, w, c) = (img.h, img.w, img.c);
    let mut out = alloc_empty(&[img.b, h, w, c])?;
    for b in 0..img.b {
        for y in 0..h {
            let sy = if vertical { h - 1 - y } else { y };
            for x in 0..w {
                let sx = if vertical { x } else { w - 1 - x };
                let at = ((b * h + sy) * w + sx) * c;
                out.extend_from_slice(&img.data[at..at + c]);
            }
        }
    }
    Tensor4::new(img.b, h, w, c, out)
}

/// ComfyUI's ImageRotate: `torch.rot90(image, k, dims=[2, 1])`, i.e. `k`
/// quarter turns clockwise.
pub fn rotate(img: &Tensor4, k: usize) -> Result<Tensor4> {
    let (h, w, c) = (img.h, img.w, img.c);
    let k = k % 4;
    let (oh, ow) = if k % 2 == 1 { (w, h) } else { (h, w) };
    let mut out = alloc_empty(&[img.b, oh, ow, c])?;
    for b in 0..img.b {
        for i in 0..oh {
            for j in 0..ow {
                let (sy, sx) = match k {
                    0 => (i, j),
                    1 => (h - 1 - j, i),
                    2 => (h - 1 - i, w - 1 - j),
                    _ => (j, w - 1 - i),
                };
                let at = ((b * h + sy) * w + sx) * c;
                out.extend_from_slice(&img.data[at..at + c]);
            }
        }
    }
    Tensor4::new(img.b, oh, ow, c, out)
}

/// ComfyUI's ThresholdMask: 1 where the mask is above `value` (compared
/// in f32, as torch compares a float tensor with a Python float), else 0.
pub fn threshold_mask(mask: &Mask3, value: f64) -> Mask3 {
    let v = value as f32;
    Mask3 {
        b: mask.b,
        h: mask.h,
        w: mask.w,
        data: mask
            .data
            .iter()
            .map(|&m| if m > v { 1.0 } else { 0.0 })
            .collect(),
    }
}

/// ComfyUI's GrowMask: `|expand|` passes of SciPy's grey dilation
/// (`expand > 0`) or erosion (`< 0`) with a 3×3 footprint, its corners
/// left out when `tapered`. SciPy's default "reflect" edge repeats the
/// edge pixel, so only pixels inside the mask count.
pub fn grow_mask(mask: &Mask3, expand: i64, tapered: bool) -> Result<Mask3> {
    let (h, w) = (mask.h, mask.w);
    let mut out = mask.data.clone();
    let mut next = alloc_filled(&[h, w], 0.0)?;
    let grow = expand > 0;
    for b in 0..mask.b {
        let plane = &mut out[b * h * w..(b + 1) * h * w];
        for _ in 0..expand.unsigned_abs() {
            super::check_cancel()?;
            for y in 0..h {
                for x in 0..w {
                    let mut best = plane[y * w + x];
                    for (dy, dx) in [
                        (-1i64, -1i64),
                        (-1, 0),
                        (-1, 1),
                        (0, -1),
                        (0, 1),
                        (1, -1),
                        (1, 0),
                        (1, 1),
                    ] {
                        if tapered && dy != 0 && dx != 0 {
                            continue;
                        }
                        let (ny, nx) = (y as i64 + dy, x as i64 + dx);
                        if ny < 0 || nx < 0 || ny >= h as i64 || nx >= w as i64 {
                            continue;
                        }
                        let v = plane[ny as usize * w + nx as usize];
                        best = if grow { best.max(v) } else { best.min(v) };
                    }
                    next[y * w + x] = best;
                }
            }
            plane.copy_from_slice(&next);
        }
    }
    Ok(Mask3 {
        b: mask.b,
        h,
        w,
        data: out,
    })
}

/// Bilinear resize of `n` single-channel planes `[n, h, w]` to `[n, oh,
/// ow]` (`F.interpolate` when `crop` is disabled, `common_upscale` with
/// its centre crop otherwise): masks for the sampler, composites.
pub fn resize_planes(
    data: &[f32],
    n: usize,
    (h, w): (usize, usize),
    (oh, ow): (usize, usize),
    crop: Crop,
) -> Result<Vec<f32>> {
    if (h, w) == (oh, ow) {
        return Ok(data.to_vec());
    }
    let t = Tensor4::new(n, h, w, 1, data.to_vec())?;
    Ok(common_upscale(
        &t,
        ow,
        oh,
        UpscaleMethod::Bilinear,
        crop,
        SourceLayout::ContiguousNchw,
    )?
    .data)
}

/// `repeat_to_batch_size` of `[n, per…]` items to `b`: the first `b`, the
/// batch tiled as needed.
pub fn repeat_to_batch(data: &[f32], per: usize, b: usize) -> Vec<f32> {
    // No whole item to repeat: nothing (the caller's size checks report it).
    if per == 0 || data.len() < per {
        return Vec::new();
    }
    let n = data.len() / per;
    (0..b)
        .flat_map(|i| data[(i % n) * per..(i % n + 1) * per].iter().copied())
        .collect()
}

/// ComfyUI's ImageCompositeMasked (`composite` with multiplier 1):
/// `source` pasted over `destination` with its top-left at `(x, y)`,
/// weighted by `mask` (resized bilinearly to the source; ones without
/// one), clipped to the destination; `resize_source` first resizes the
/// source bilinearly to the destination's size.
pub fn composite(
    destination: &Tensor4,
    source: &Tensor4,
    (x, y): (usize, usize),
    mask: Option<&Mask3>,
    resize_source: bool,
) -> Result<Tensor4> {
    // `image_alpha_fix`: a source with more channels (RGBA on RGB) loses
    // the extra ones; a destination with more is given an alpha channel
    // and then does not match, which ComfyUI raises on.
    let (dest, source) = alpha_fix(destination, source)?;
    if dest.c != source.c {
        return Err(ImageOpError::InvalidArgument(format!(
            "the source has {} channels and the destination {}",
            source.c, destination.c
        )));
    }
    let (bd, hd, wd, c) = (destination.b, destination.h, destination.w, destination.c);
    let source = if resize_source {
        common_upscale(
            &source,
            wd,
            hd,
            UpscaleMethod::Bilinear,
            Crop::Disabled,
            SourceLayout::ChannelsLastView,
        )?
    } else {
        source
    };
    let (hs, ws) = (source.h, source.w);
    let src = repeat_to_batch(&source.data, hs * ws * c, bd);
    let (left, top) = (x.min(wd), y.min(hd));
    let m = match mask {
        Some(m) => {
            let planes = resize_planes(&m.data, m.b, (m.h, m.w), (hs, ws), Crop::Disabled)?;
            repeat_to_batch(&planes, hs * ws, bd)
        }
        None => vec![1.0; bd * hs * ws],
    };
    let (vh, vw) = ((hd - top).min(hs), (wd - left).min(ws));
    let mut out = destination.data.clone();
    for b in 0..bd {
        for sy in 0..vh {
            for sx in 0..vw {
                let mv = m[(b * hs + sy) * ws + sx];
                let inv = 1.0 - mv;
                let s_at = ((b * hs + sy) * ws + sx) * c;
                let d_at = ((b * hd + top + sy) * wd + left + sx) * c;
                for ch in 0..c {
                    out[d_at + ch] = mv * src[s_at + ch] + inv * out[d_at + ch];
                }
            }
        }
    }
    Tensor4::new(bd, hd, wd, c, out)
}

/// ImageScaleToTotalPixels' output size for an `in_w × in_h` image:
/// `megapixels · 2²⁰` pixels (truncated), the aspect kept, each side
/// rounded as Python rounds.
pub fn total_pixels_size(in_w: usize, in_h: usize, megapixels: f64) -> (usize, usize) {
    let total = (megapixels * 1024.0 * 1024.0).trunc();
    let scale = (total / (in_w as f64 * in_h as f64)).sqrt();
    (
        py_round_usize(in_w as f64 * scale),
        py_round_usize(in_h as f64 * scale),
    )
}

/// ComfyUI's ImageScaleToTotalPixels: the aspect kept, about
/// `megapixels · 2^20` pixels (`int()` of it; sides Python-rounded).
pub fn scale_to_total_pixels(
    img: &Tensor4,
    method: UpscaleMethod,
    megapixels: f64,
) -> Result<Tensor4> {
    let (w, h) = total_pixels_size(img.w, img.h, megapixels);
    super::upscale(img, w, h, method, Crop::Disabled)
}

/// LatentUpscale's target in latent cells `(w, h)` for a latent of
/// `(lh, lw)` cells and the node's `width × height` pixels: each side at
/// least 64 pixels, a 0 side from the latent's aspect (Python-rounded),
/// then `// 8`; None when both are 0 (the latent passes through).
pub fn latent_upscale_size(
    (lh, lw): (usize, usize),
    width: usize,
    height: usize,
) -> Option<(usize, usize)> {
    let aspect = |a: usize, num: usize, den: usize| {
        py_round_usize(a as f64 * num as f64 / den.max(1) as f64).max(64)
    };
    let (w, h) = match (width, height) {
        (0, 0) => return None,
        (0, h) => {
            let h = h.max(64);
            (aspect(lw, h, lh), h)
        }
        (w, 0) => {
            let w = w.max(64);
            (w, aspect(lh, w, lw))
        }
        (w, h) => (w.max(64), h.max(64)),
    };
    Some((w / 8, h / 8))
}

/// LatentUpscaleBy's target `(w, h)`: each side times `scale_by`,
/// Python-rounded.
pub fn latent_scale_by_size((lh, lw): (usize, usize), scale_by: f64) -> (usize, usize) {
    (
        py_round_usize(lw as f64 * scale_by),
        py_round_usize(lh as f64 * scale_by),
    )
}

/// `comfy.utils.common_upscale` of a latent `[b, c, h, w]` (contiguous
/// NCHW, as LatentUpscale passes it) to `[b, c, oh, ow]`.
pub fn upscale_latent(
    data: &[f32],
    [b, c, h, w]: [usize; 4],
    (ow, oh): (usize, usize),
    method: UpscaleMethod,
    crop: Crop,
) -> Result<Vec<f32>> {
    check_len(&[b, c, h, w], data.len())?;
    // To the BHWC the resampler takes, and back.
    let mut bhwc = alloc_empty(&[b, h, w, c])?;
    for bi in 0..b {
        for p in 0..h * w {
            for ch in 0..c {
                bhwc.push(data[(bi * c + ch) * h * w + p]);
            }
        }
    }
    let t = Tensor4::new(b, h, w, c, bhwc)?;
    let r = common_upscale(&t, ow, oh, method, crop, SourceLayout::ContiguousNchw)?;
    let (rh, rw) = (r.h, r.w);
    let mut out = alloc_empty(&[b, c, rh, rw])?;
    for bi in 0..b {
        for ch in 0..c {
            for p in 0..rh * rw {
                out.push(r.data[(bi * rh * rw + p) * c + ch]);
            }
        }
    }
    Ok(out)
}

/// ComfyUI's ImageStitch: `image2` joined to `image1` on the `direction`
/// side ("right", "down", "left", "up"). The shorter batch repeats its
/// last image; with `match_size` image2 is scaled (Lanczos) to image1's
/// height (or width), its other side `int()` of the aspect; without, the
/// smaller one is padded, centred, with the colour's value (0 for the
/// primaries). Fewer channels are padded with ones. `spacing` pixels
/// (rounded up to even) of `color` go between, alpha 1.
pub fn stitch(
    image1: &Tensor4,
    image2: Option<&Tensor4>,
    direction: &str,
    match_size: bool,
    spacing: usize,
    color: &str,
) -> Result<Tensor4> {
    let copy = |t: &Tensor4| Tensor4::new(t.b, t.h, t.w, t.c, t.data.clone());
    let Some(image2) = image2 else {
        return copy(image1);
    };
    let horizontal = match direction {
        "right" | "left" => true,
        "down" | "up" => false,
        other => {
            return Err(ImageOpError::InvalidArgument(format!(
                "direction {other:?} is not one of right, down, left, up"
            )))
        }
    };
    let value: Vec<f32> = match color {
        "white" => vec![1.0],
        "black" => vec![0.0],
        "red" => vec![1.0, 0.0, 0.0],
        "green" => vec![0.0, 1.0, 0.0],
        "blue" => vec![0.0, 0.0, 1.0],
        other => {
            return Err(ImageOpError::InvalidArgument(format!(
                "spacing_color {other:?} is not one of white, black, red, green, blue"
            )))
        }
    };
    // Batches: the shorter repeats its last image.
    let b = image1.b.max(image2.b);
    let extend = |t: &Tensor4| -> Result<Tensor4> {
        let per = t.h * t.w * t.c;
        let mut data = t.data.clone();
        for _ in t.b..b {
            data.extend_from_slice(&t.data[(t.b - 1) * per..t.b * per]);
        }
        Tensor4::new(b, t.h, t.w, t.c, data)
    };
    let mut one = extend(image1)?;
    let mut two = extend(image2)?;
    if match_size {
        let aspect = two.w as f64 / two.h as f64;
        let (tw, th) = if horizontal {
            ((one.h as f64 * aspect) as usize, one.h)
        } else {
            (one.w, (one.w as f64 / aspect) as usize)
        };
        two = common_upscale(
            &two,
            tw,
            th,
            UpscaleMethod::Lanczos,
            Crop::Disabled,
            SourceLayout::ChannelsLastView,
        )?;
    } else {
        let pad_value = if value.len() == 1 { value[0] } else { 0.0 };
        if horizontal {
            let h = one.h.max(two.h);
            one = pad_centred(&one, (h, one.w), pad_value)?;
            two = pad_centred(&two, (h, two.w), pad_value)?;
        } else {
            let w = one.w.max(two.w);
            one = pad_centred(&one, (one.h, w), pad_value)?;
            two = pad_centred(&two, (two.h, w), pad_value)?;
        }
    }
    let c = one.c.max(two.c);
    one = with_channels(&one, c)?;
    two = with_channels(&two, c)?;
    let mut parts = if matches!(direction, "left" | "up") {
        vec![two, one]
    } else {
        vec![one, two]
    };
    if spacing > 0 {
        let sw = spacing + spacing % 2;
        let (sh, sww) = if horizontal {
            (parts[0].h.max(parts[1].h), sw)
        } else {
            (sw, parts[0].w.max(parts[1].w))
        };
        let mut px = vec![0.0f32; c];
        if value.len() == 1 {
            px.iter_mut().take(3).for_each(|v| *v = value[0]);
        } else {
            px.iter_mut().zip(&value).for_each(|(v, &x)| *v = x);
        }
        if c == 4 {
            px[3] = 1.0;
        }
        let data = px.iter().copied().cycle().take(b * sh * sww * c).collect();
        parts.insert(1, Tensor4::new(b, sh, sww, c, data)?);
    }
    concat(&parts, horizontal)
}

/// `t` padded with `value` to `(h, w)`, centred (the extra row or column
/// after, as `pad // 2` before).
fn pad_centred(t: &Tensor4, (h, w): (usize, usize), value: f32) -> Result<Tensor4> {
    if (t.h, t.w) == (h, w) {
        return Tensor4::new(t.b, t.h, t.w, t.c, t.data.clone());
    }
    let (top, left) = ((h - t.h) / 2, (w - t.w) / 2);
    let mut out = alloc_filled(&[t.b, h, w, t.c], value)?;
    let row = t.w * t.c;
    for b in 0..t.b {
        for y in 0..t.h {
            let src = (b * t.h + y) * row;
            let dst = ((b * h + top + y) * w + left) * t.c;
            out[dst..dst + row].copy_from_slice(&t.data[src..src + row]);
        }
    }
    Tensor4::new(t.b, h, w, t.c, out)
}

/// `t` with its channels padded with ones to `c`.
fn with_channels(t: &Tensor4, c: usize) -> Result<Tensor4> {
    if t.c == c {
        return Tensor4::new(t.b, t.h, t.w, t.c, t.data.clone());
    }
    let data = t
        .data
        .chunks(t.c)
        .flat_map(|px| px.iter().copied().chain(std::iter::repeat_n(1.0, c - t.c)))
        .collect();
    Tensor4::new(t.b, t.h, t.w, c, data)
}

/// `torch.cat` of BHWC images along the width (`horizontal`) or height.
fn concat(parts: &[Tensor4], horizontal: bool) -> Result<Tensor4> {
    let first = &parts[0];
    let (b, c) = (first.b, first.c);
    let fits = |p: &Tensor4| {
        p.b == b
            && p.c == c
            && if horizontal {
                p.h == first.h
            } else {
                p.w == first.w
            }
    };
    if !parts.iter().all(fits) {
        return Err(ImageOpError::InvalidArgument(
            "the images' sizes do not line up for stitching".to_string(),
        ));
    }
    if horizontal {
        let h = first.h;
        let w: usize = parts.iter().map(|p| p.w).sum();
        let mut out = alloc_empty(&[b, h, w, c])?;
        for bi in 0..b {
            for y in 0..h {
                for p in parts {
                    let row = p.w * c;
                    let at = (bi * h + y) * row;
                    out.extend_from_slice(&p.data[at..at + row]);
                }
            }
        }
        Tensor4::new(b, h, w, c, out)
    } else {
        let w = first.w;
        let h: usize = parts.iter().map(|p| p.h).sum();
        let mut out = alloc_empty(&[b, h, w, c])?;
        for bi in 0..b {
            for p in parts {
                let per = p.h * w * c;
                out.extend_from_slice(&p.data[bi * per..(bi + 1) * per]);
            }
        }
        Tensor4::new(b, h, w, c, out)
    }
}

/// ComfyUI's ImageBlend: `image2` (channels fixed as ImageCompositeMasked
/// does; resized bicubically, centre-cropped, to `image1` when the shapes
/// differ) blended by `mode` ("normal", "multiply", "screen", "overlay",
/// "soft_light", "difference"), mixed with `image1` by `factor`, clamped
/// to 0..1; in f32, operation by operation as torch.
pub fn blend(image1: &Tensor4, image2: &Tensor4, factor: f64, mode: &str) -> Result<Tensor4> {
    let (one, two) = alpha_fix(image1, image2)?;
    let two = if (two.b, two.h, two.w, two.c) != (one.b, one.h, one.w, one.c) {
        common_upscale(
            &two,
            one.w,
            one.h,
            UpscaleMethod::Bicubic,
            Crop::Center,
            SourceLayout::ChannelsLastView,
        )?
    } else {
        two
    };
    // torch broadcasts a batch of one against the other batch.
    let per = one.h * one.w * one.c;
    let b = one.b.max(two.b);
    let fits = |t: &Tensor4| t.b == b || t.b == 1;
    if two.h * two.w * two.c != per || !fits(&one) || !fits(&two) {
        return Err(ImageOpError::InvalidArgument(format!(
            "image2 has {} images of {} channels; image1 has {} of {}",
            two.b, two.c, one.b, one.c
        )));
    }
    let item = |t: &Tensor4, i: usize| -> std::ops::Range<usize> {
        let i = if t.b == 1 { 0 } else { i };
        i * per..(i + 1) * per
    };
    let g = |x: f32| {
        if x <= 0.25 {
            ((16.0 * x - 12.0) * x + 4.0) * x
        } else {
            x.sqrt()
        }
    };
    let f: fn(f32, f32, &dyn Fn(f32) -> f32) -> f32 = match mode {
        "normal" => |_, b, _| b,
        "multiply" => |a, b, _| a * b,
        "screen" => |a, b, _| 1.0 - (1.0 - a) * (1.0 - b),
        "overlay" => |a, b, _| {
            if a <= 0.5 {
                2.0 * a * b
            } else {
                1.0 - 2.0 * (1.0 - a) * (1.0 - b)
            }
        },
        "soft_light" => |a, b, g| {
            if b <= 0.5 {
                a - (1.0 - 2.0 * b) * a * (1.0 - a)
            } else {
                a + (2.0 * b - 1.0) * (g(a) - a)
            }
        },
        "difference" => |a, b, _| a - b,
        other => {
            return Err(ImageOpError::InvalidArgument(format!(
                "blend_mode {other:?} is not one of normal, multiply, screen, overlay, soft_light, difference"
            )))
        }
    };
    let (keep, mix) = ((1.0 - factor) as f32, factor as f32);
    let mut data = alloc_empty(&[b, one.h, one.w, one.c])?;
    for i in 0..b {
        let (x, y) = (&one.data[item(&one, i)], &two.data[item(&two, i)]);
        data.extend(
            x.iter()
                .zip(y)
                .map(|(&a, &b)| (a * keep + f(a, b, &g) * mix).clamp(0.0, 1.0)),
        );
    }
    Tensor4::new(b, one.h, one.w, one.c, data)
}

/// `node_helpers.image_alpha_fix(destination, source)`: a source with
/// more channels loses the extra ones; a destination with fewer gets an
/// alpha channel of ones.
fn alpha_fix(destination: &Tensor4, source: &Tensor4) -> Result<(Tensor4, Tensor4)> {
    let copy = |t: &Tensor4| Tensor4::new(t.b, t.h, t.w, t.c, t.data.clone());
    if destination.c < source.c {
        let c = destination.c;
        let data = source
            .data
            .chunks(source.c)
            .flat_map(|px| px[..c].iter().copied())
            .collect();
        Ok((
            copy(destination)?,
            Tensor4::new(source.b, source.h, source.w, c, data)?,
        ))
    } else if destination.c > source.c {
        Ok((
            with_channels(destination, destination.c + 1)?,
            copy(source)?,
        ))
    } else {
        Ok((copy(destination)?, copy(source)?))
    }
}

/// ComfyUI's ResizeAndPadImage: scaled by `interpolation` to fit
/// `target_w × target_h` (the smaller ratio; sides `int()`-truncated),
/// centred on a white or black canvas.
pub fn resize_and_pad(
    img: &Tensor4,
    (target_w, target_h): (usize, usize),
    white: bool,
    interpolation: UpscaleMethod,
) -> Result<Tensor4> {
    let scale = (target_w as f64 / img.w as f64).min(target_h as f64 / img.h as f64);
    let (nw, nh) = (
        (img.w as f64 * scale) as usize,
        (img.h as f64 * scale) as usize,
    );
    let value = if white { 1.0 } else { 0.0 };
    if (nw == 0 || nh == 0) && interpolation == UpscaleMethod::Area {
        // torch's adaptive pooling gives an empty image here (the other
        // methods raise): all padding.
        let out = alloc_filled(&[img.b, target_h, target_w, img.c], value)?;
        return Tensor4::new(img.b, target_h, target_w, img.c, out);
    }
    let resized = common_upscale(
        img,
        nw,
        nh,
        interpolation,
        Crop::Disabled,
        SourceLayout::ChannelsLastView,
    )?;
    let (top, left) = ((target_h - nh) / 2, (target_w - nw) / 2);
    let mut out = alloc_filled(&[img.b, target_h, target_w, img.c], value)?;
    let row = nw * img.c;
    for b in 0..img.b {
        for y in 0..nh {
            let src = (b * nh + y) * row;
            let dst = ((b * target_h + top + y) * target_w + left) * img.c;
            out[dst..dst + row].copy_from_slice(&resized.data[src..src + row]);
        }
    }
    Tensor4::new(img.b, target_h, target_w, img.c, out)
}

/// ComfyUI's FeatherMask: the `left`/`top`/`right`/`bottom` edges (each
/// at most the mask's side) ramped by `(i + 1) / n`. As ComfyUI indexes
/// the right and bottom ramps with `-i`, their first step (`i = 0`) lands
/// on the first column/row, not the last.
pub fn feather_mask(mask: &Mask3, [left, top, right, bottom]: [usize; 4]) -> Mask3 {
    let (h, w) = (mask.h, mask.w);
    let (left, right, top, bottom) = (left.min(w), right.min(w), top.min(h), bottom.min(h));
    let mut data = mask.data.clone();
    let from_end = |i: usize, n: usize| if i == 0 { 0 } else { n - i };
    for plane in data.chunks_mut((h * w).max(1)) {
        let mut scale_col = |x: usize, rate: f32| {
            for y in 0..h {
                plane[y * w + x] *= rate;
            }
        };
        for x in 0..left {
            scale_col(x, ((x as f64 + 1.0) / left as f64) as f32);
        }
        for x in 0..right {
            scale_col(from_end(x, w), ((x as f64 + 1.0) / right as f64) as f32);
        }
        let mut scale_row = |y: usize, rate: f32| {
            for v in &mut plane[y * w..(y + 1) * w] {
                *v *= rate;
            }
        };
        for y in 0..top {
            scale_row(y, ((y as f64 + 1.0) / top as f64) as f32);
        }
        for y in 0..bottom {
            scale_row(from_end(y, h), ((y as f64 + 1.0) / bottom as f64) as f32);
        }
    }
    Mask3 {
        b: mask.b,
        h,
        w,
        data,
    }
}

/// ComfyUI's CropMask: `mask[:, y:y+height, x:x+width]`, clipped to the
/// mask as Python slices are.
pub fn crop_mask(
    mask: &Mask3,
    (x, y): (usize, usize),
    (width, height): (usize, usize),
) -> Result<Mask3> {
    let (x0, y0) = (x.min(mask.w), y.min(mask.h));
    let (x1, y1) = (
        x.saturating_add(width).min(mask.w),
        y.saturating_add(height).min(mask.h),
    );
    let (w, h) = (x1 - x0, y1 - y0);
    let mut data = alloc_empty(&[mask.b, h, w])?;
    for b in 0..mask.b {
        for yy in y0..y1 {
            let at = (b * mask.h + yy) * mask.w;
            data.extend_from_slice(&mask.data[at + x0..at + x1]);
        }
    }
    Mask3::new(mask.b, h, w, data)
}

/// ComfyUI's MaskComposite: `source` combined into `destination` at
/// `(x, y)` by `operation` (multiply, add, subtract; and, or, xor on the
/// rounded masks), clipped to the destination, the result clamped to 0..1.
pub fn mask_composite(
    destination: &Mask3,
    source: &Mask3,
    (x, y): (usize, usize),
    operation: &str,
) -> Result<Mask3> {
    let (hd, wd) = (destination.h, destination.w);
    let op: fn(f32, f32) -> f32 = match operation {
        "multiply" => |d, s| d * s,
        "add" => |d, s| d + s,
        "subtract" => |d, s| d - s,
        "and" => |d, s| {
            f32::from(u8::from(
                d.round_ties_even() != 0.0 && s.round_ties_even() != 0.0,
            ))
        },
        "or" => |d, s| {
            f32::from(u8::from(
                d.round_ties_even() != 0.0 || s.round_ties_even() != 0.0,
            ))
        },
        "xor" => |d, s| {
            f32::from(u8::from(
                (d.round_ties_even() != 0.0) != (s.round_ties_even() != 0.0),
            ))
        },
        other => {
            return Err(ImageOpError::InvalidArgument(format!(
                "operation {other:?} is not one of multiply, add, subtract, and, or, xor"
            )))
        }
    };
    if source.b != destination.b && source.b != 1 {
        return Err(ImageOpError::InvalidArgument(format!(
            "a batch of {} source masks cannot be composited onto {}",
            source.b, destination.b
        )));
    }
    // Past the far edge ComfyUI's slices no longer line up and torch
    // raises; at the edge the region is empty.
    if x > wd || y > hd {
        return Err(ImageOpError::InvalidArgument(format!(
            "the source at ({x}, {y}) lies outside the {wd}×{hd} destination"
        )));
    }
    let mut out = destination.data.clone();
    let (vw, vh) = (
        (x + source.w).min(wd).saturating_sub(x),
        (y + source.h).min(hd).saturating_sub(y),
    );
    for b in 0..destination.b {
        let sb = if source.b == 1 { 0 } else { b };
        for sy in 0..vh {
            for sx in 0..vw {
                let d = &mut out[(b * hd + y + sy) * wd + x + sx];
                *d = op(*d, source.data[(sb * source.h + sy) * source.w + sx]);
            }
        }
    }
    out.iter_mut().for_each(|v| *v = v.clamp(0.0, 1.0));
    Mask3::new(destination.b, hd, wd, out)
}
