//! kornia's Canny edge detector, as ComfyUI's Canny node runs it.

use super::*;

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
