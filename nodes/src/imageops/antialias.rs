//! PyTorch's antialiased bicubic resize (`F.interpolate(mode="bicubic",
//! antialias=True)`, ATen's `_upsample_bicubic2d_aa` on the CPU), which
//! CLIP-vision preprocessing uses: separable, the width first, then the
//! height (an axis whose size does not change is left alone); each output
//! sample a normalised Keys-cubic (a = −0.5) window whose support widens
//! with the downscale factor, in f32 with ATen's mixed f32/f64 steps.

/// The Keys cubic with a = −0.5, in f32.
fn cubic(x: f32) -> f32 {
    let a = -0.5f32;
    let x = x.abs();
    if x < 1.0 {
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    } else {
        0.0
    }
}

/// Per output index: the first input index and the normalised weights.
fn axis(input: usize, output: usize) -> Vec<(usize, Vec<f32>)> {
    // area_pixel_compute_scale<float> without a given scale factor.
    let scale = input as f32 / output as f32;
    let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
    let max_interp = (support.ceil() as usize) * 2 + 1;
    let invscale = if scale >= 1.0 {
        (1.0 / f64::from(scale)) as f32
    } else {
        1.0
    };
    (0..output)
        .map(|i| {
            let center = (f64::from(scale) * (i as f64 + 0.5)) as f32;
            let xmin = ((f64::from(center - support) + 0.5) as i64).max(0);
            let xmax = ((f64::from(center + support) + 0.5) as i64).min(input as i64);
            let size = (xmax - xmin).clamp(0, max_interp as i64) as usize;
            let xmin = xmin as usize;
            let mut w: Vec<f32> = (0..size)
                .map(|j| {
                    let d = (j + xmin) as f32 - center;
                    cubic(((f64::from(d) + 0.5) * f64::from(invscale)) as f32)
                })
                .collect();
            let total: f32 = w.iter().sum();
            if total != 0.0 {
                w.iter_mut().for_each(|v| *v /= total);
            }
            (xmin, w)
        })
        .collect()
}

/// Resizes `planes` (`n` planes of `in_h`×`in_w`, row-major) to
/// `out_h`×`out_w`.
pub fn bicubic_antialias(
    planes: &[f32],
    n: usize,
    (in_h, in_w): (usize, usize),
    (out_h, out_w): (usize, usize),
) -> Vec<f32> {
    let mut cur = planes.to_vec();
    let mut w = in_w;
    if out_w != in_w {
        let ax = axis(in_w, out_w);
        let mut next = Vec::with_capacity(n * in_h * out_w);
        for row in cur.chunks(in_w).take(n * in_h) {
            for (x0, wt) in &ax {
                let mut acc = 0f32;
                for (k, &c) in wt.iter().enumerate() {
                    acc = if k == 0 {
                        row[x0 + k] * c
                    } else {
                        acc + row[x0 + k] * c
                    };
                }
                next.push(acc);
            }
        }
        cur = next;
        w = out_w;
    }
    if out_h != in_h {
        let ax = axis(in_h, out_h);
        let mut next = Vec::with_capacity(n * out_h * w);
        for plane in cur.chunks(in_h * w).take(n) {
            for (y0, wt) in &ax {
                for x in 0..w {
                    let mut acc = 0f32;
                    for (k, &c) in wt.iter().enumerate() {
                        let v = plane[(y0 + k) * w + x] * c;
                        acc = if k == 0 { v } else { acc + v };
                    }
                    next.push(acc);
                }
            }
        }
        cur = next;
    }
    cur
}
