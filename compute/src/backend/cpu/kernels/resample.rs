//! Nearest and bilinear 2-D upsampling (PyTorch's `interpolate`).

use super::*;
// ---------------------------------------------------------------------------
// Resampling
// ---------------------------------------------------------------------------

fn check_resample(
    op: &'static str,
    x: &[f32],
    x_shape: [usize; 4],
    oh: usize,
    ow: usize,
    out: &[f32],
) -> Result<bool> {
    let [n, c, h, w] = x_shape;
    let shape = || format!("x={x_shape:?} out=[{oh}, {ow}]");
    length(op, "x", x.len(), product(op, &x_shape, &shape)?, &shape)?;
    length(
        op,
        "out",
        out.len(),
        product(op, &[n, c, oh, ow], &shape)?,
        &shape,
    )?;
    if (h == 0 || w == 0) && oh * ow * n * c != 0 {
        return Err(invalid(
            op,
            "cannot resample an empty image to a non-empty one",
            &shape,
        ));
    }
    Ok(out.is_empty())
}

/// PyTorch's `nearest` source index: `min(floor(dst * (in / out)), in - 1)`,
/// with the ratio and product in f32 as PyTorch computes them (which decides
/// the rounding at exact boundaries).
fn nearest_index(dst: usize, input: usize, output: usize) -> usize {
    if output == input {
        dst
    } else if output == 2 * input {
        dst >> 1
    } else {
        let scale = input as f32 / output as f32;
        ((dst as f32 * scale).floor() as usize).min(input - 1)
    }
}

/// Nearest-neighbour resize of `x` `[n, c, h, w]` to `out` `[n, c, oh, ow]`
/// with `torch.nn.functional.interpolate(mode="nearest")` semantics:
/// `src = min(floor(dst * in / out), in - 1)` per axis.
pub fn upsample_nearest2d(
    x: &[f32],
    x_shape: [usize; 4],
    oh: usize,
    ow: usize,
    out: &mut [f32],
) -> Result {
    if check_resample("upsample_nearest2d", x, x_shape, oh, ow, out)? {
        return Ok(());
    }
    let [_, _, h, w] = x_shape;
    let sy: Vec<usize> = (0..oh).map(|i| nearest_index(i, h, oh)).collect();
    let sx: Vec<usize> = (0..ow).map(|i| nearest_index(i, w, ow)).collect();
    out.par_chunks_mut(oh * ow)
        .zip(x.par_chunks(h * w))
        .with_min_len(rows_per_piece(oh * ow))
        .for_each(|(op, xp)| {
            for (orow, &y) in op.chunks_mut(ow).zip(&sy) {
                let xrow = &xp[y * w..(y + 1) * w];
                orow.iter_mut().zip(&sx).for_each(|(o, &xi)| *o = xrow[xi]);
            }
        });
    Ok(())
}

/// Source taps of one output coordinate of a linear resize.
#[derive(Clone, Copy, Debug)]
struct LinearTap {
    i0: usize,
    i1: usize,
    w0: f32,
    w1: f32,
}

/// PyTorch's bilinear source coordinate and weights for one axis, in f32 as
/// PyTorch computes them for f32 tensors.
fn linear_taps(input: usize, output: usize, align_corners: bool) -> Vec<LinearTap> {
    let scale = if align_corners {
        if output > 1 {
            (input - 1) as f32 / (output - 1) as f32
        } else {
            0.0
        }
    } else {
        input as f32 / output as f32
    };
    (0..output)
        .map(|dst| {
            if input == output {
                return LinearTap {
                    i0: dst,
                    i1: dst,
                    w0: 1.0,
                    w1: 0.0,
                };
            }
            let src = if align_corners {
                scale * dst as f32
            } else {
                (scale * (dst as f32 + 0.5) - 0.5).max(0.0)
            };
            let i0 = (src.floor() as usize).min(input - 1);
            let w1 = (src - i0 as f32).clamp(0.0, 1.0);
            let i1 = if i0 < input - 1 { i0 + 1 } else { i0 };
            LinearTap {
                i0,
                i1,
                w0: 1.0 - w1,
                w1,
            }
        })
        .collect()
}

/// Bilinear resize of `x` `[n, c, h, w]` to `out` `[n, c, oh, ow]` with
/// `torch.nn.functional.interpolate(mode="bilinear", align_corners=...)`
/// semantics: with `align_corners` the corner pixels' centres map onto each
/// other (`src = dst * (in - 1) / (out - 1)`); without, pixel areas do
/// (`src = max((dst + 0.5) * in / out - 0.5, 0)`). Edges clamp.
pub fn upsample_bilinear2d(
    x: &[f32],
    x_shape: [usize; 4],
    oh: usize,
    ow: usize,
    align_corners: bool,
    out: &mut [f32],
) -> Result {
    if check_resample("upsample_bilinear2d", x, x_shape, oh, ow, out)? {
        return Ok(());
    }
    let [_, _, h, w] = x_shape;
    let ty = linear_taps(h, oh, align_corners);
    let tx = linear_taps(w, ow, align_corners);
    out.par_chunks_mut(oh * ow)
        .zip(x.par_chunks(h * w))
        .with_min_len(rows_per_piece(oh * ow))
        .for_each(|(op, xp)| {
            for (orow, y) in op.chunks_mut(ow).zip(&ty) {
                let r0 = &xp[y.i0 * w..(y.i0 + 1) * w];
                let r1 = &xp[y.i1 * w..(y.i1 + 1) * w];
                for (o, t) in orow.iter_mut().zip(&tx) {
                    let top = t.w0 * r0[t.i0] + t.w1 * r0[t.i1];
                    let bottom = t.w0 * r1[t.i0] + t.w1 * r1[t.i1];
                    *o = y.w0 * top + y.w1 * bottom;
                }
            }
        });
    Ok(())
}
