//! ComfyUI's tiled processing (`comfy.utils.tiled_scale` in 2-D): a
//! function runs on overlapping tiles of each batch item and the results
//! are blended with linear feathering. The VAE decodes and encodes this way
//! when the whole image does not fit the device (and in the Tiled nodes).
//!
//! Every float step follows ComfyUI's order (f32 masks built by repeated
//! multiplication, sums in tile order, one division at the end), so tiled
//! results match its own to rounding.

use sdkit_engine::Tensor;

/// Python's `round`: half to even.
pub fn round_half_even(v: f64) -> i64 {
    let r = v.round();
    if (v - v.trunc()).abs() == 0.5 && (r as i64) % 2 != 0 {
        (r - v.signum()) as i64
    } else {
        r as i64
    }
}

/// Tile origins along one axis of `size`: every `tile − overlap` from 0
/// while below `size − overlap` (Python's `range`), or just 0 when one
/// tile covers it.
fn positions(size: usize, tile: usize, overlap: usize) -> Vec<usize> {
    if size <= tile {
        return vec![0];
    }
    let step = tile.saturating_sub(overlap).max(1);
    (0..size.saturating_sub(overlap)).step_by(step).collect()
}

/// Tiles one pass visits over `[h, w]` (ComfyUI's
/// `get_tiled_scale_steps`).
pub fn tile_count(h: usize, w: usize, tile_y: usize, tile_x: usize, overlap: usize) -> usize {
    positions(h, tile_y, overlap).len() * positions(w, tile_x, overlap).len()
}

/// The feathering mask of one output tile `[th, tw]`: 1 inside, ramping
/// (t + 1)/feather over the `feather` outermost rows and columns, built
/// in ComfyUI's order (rows, then columns; each step one f32 multiply).
fn mask(th: usize, tw: usize, feather: usize) -> Vec<f32> {
    let mut m = vec![1f32; th * tw];
    if feather < th {
        for t in 0..feather {
            let a = ((t + 1) as f64 / feather as f64) as f32;
            for row in [t, th - 1 - t] {
                for v in &mut m[row * tw..(row + 1) * tw] {
                    *v *= a;
                }
            }
        }
    }
    if feather < tw {
        for t in 0..feather {
            let a = ((t + 1) as f64 / feather as f64) as f32;
            for col in [t, tw - 1 - t] {
                for row in 0..th {
                    m[row * tw + col] *= a;
                }
            }
        }
    }
    m
}

/// One tiled pass over `x` (`[b, c, h, w]`): `f` maps a tile `[1, c, th,
/// tw]` to `[1, out_channels, round(th·scale), round(tw·scale)]`; tiles of
/// `tile_y × tile_x` overlap by `overlap` and are blended with a linear
/// feather of `round(overlap·scale)`. `done` is called after each tile.
#[allow(clippy::too_many_arguments)]
pub fn tiled_scale<E>(
    x: &Tensor,
    tile_y: usize,
    tile_x: usize,
    overlap: usize,
    scale: f64,
    out_channels: usize,
    f: &mut dyn FnMut(&Tensor) -> Result<Tensor, E>,
    done: &mut dyn FnMut() -> Result<(), E>,
    shape_error: &dyn Fn(String) -> E,
) -> Result<Tensor, E> {
    let [b, c, h, w] = x.shape[..] else {
        return Err(shape_error(format!(
            "tiled input of shape {:?} is not [batch, channels, height, width]",
            x.shape
        )));
    };
    let scaled = |v: usize| round_half_even(v as f64 * scale).max(0) as usize;
    let (oh, ow) = (scaled(h), scaled(w));
    let item = c * h * w;
    let out_item = out_channels * oh * ow;
    let mut output = vec![0f32; b * out_item];
    let feather = scaled(overlap);
    for bi in 0..b {
        let s = &x.data[bi * item..(bi + 1) * item];
        let crop = |y0: usize, x0: usize, th: usize, tw: usize| -> Tensor {
            let mut d = Vec::with_capacity(c * th * tw);
            for ci in 0..c {
                for y in y0..y0 + th {
                    let at = (ci * h + y) * w + x0;
                    d.extend_from_slice(&s[at..at + tw]);
                }
            }
            Tensor {
                shape: vec![1, c, th, tw],
                data: d,
            }
        };
        let run =
            |f: &mut dyn FnMut(&Tensor) -> Result<Tensor, E>, t: &Tensor| -> Result<Tensor, E> {
                let o = f(t)?;
                let want = [1, out_channels, scaled(t.shape[2]), scaled(t.shape[3])];
                if o.shape != want {
                    return Err(shape_error(format!(
                        "a {:?} tile gave {:?}, expected {want:?}",
                        t.shape, o.shape
                    )));
                }
                Ok(o)
            };
        let dst = &mut output[bi * out_item..(bi + 1) * out_item];
        if h <= tile_y && w <= tile_x {
            let o = run(f, &crop(0, 0, h, w))?;
            dst.copy_from_slice(&o.data);
            done()?;
            continue;
        }
        let mut acc = vec![0f32; out_item];
        let mut div = vec![0f32; out_item];
        for &py in &positions(h, tile_y, overlap) {
            for &px in &positions(w, tile_x, overlap) {
                let y0 = py.min(h.saturating_sub(overlap));
                let x0 = px.min(w.saturating_sub(overlap));
                let (th, tw) = (tile_y.min(h - y0), tile_x.min(w - x0));
                let o = run(f, &crop(y0, x0, th, tw))?;
                let (ph, pw) = (o.shape[2], o.shape[3]);
                let (uy, ux) = (scaled(y0), scaled(x0));
                if uy + ph > oh || ux + pw > ow {
                    return Err(shape_error(format!(
                        "a tile at ({y0}, {x0}) lands outside the {oh}x{ow} output"
                    )));
                }
                let m = mask(ph, pw, feather);
                for ci in 0..out_channels {
                    for y in 0..ph {
                        let src = &o.data[(ci * ph + y) * pw..(ci * ph + y + 1) * pw];
                        let mrow = &m[y * pw..(y + 1) * pw];
                        let at = (ci * oh + uy + y) * ow + ux;
                        for (((a, d), &v), &mv) in acc[at..at + pw]
                            .iter_mut()
                            .zip(&mut div[at..at + pw])
                            .zip(src)
                            .zip(mrow)
                        {
                            *a += v * mv;
                            *d += mv;
                        }
                    }
                }
                done()?;
            }
        }
        for ((o, a), d) in dst.iter_mut().zip(&acc).zip(&div) {
            *o = a / d;
        }
    }
    Ok(Tensor {
        shape: vec![b, out_channels, oh, ow],
        data: output,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_rounding() {
        assert_eq!(round_half_even(0.5), 0);
        assert_eq!(round_half_even(1.5), 2);
        assert_eq!(round_half_even(2.5), 2);
        assert_eq!(round_half_even(2.4), 2);
        assert_eq!(round_half_even(-1.5), -2);
        assert_eq!(round_half_even(3.0), 3);
    }

    #[test]
    fn positions_follow_python_range() {
        assert_eq!(positions(25, 4, 2), (0..23).step_by(2).collect::<Vec<_>>());
        assert_eq!(positions(8, 8, 2), vec![0]);
        assert_eq!(positions(21, 16, 2), vec![0, 14]);
        assert_eq!(tile_count(21, 25, 16, 4, 2), 2 * 12);
    }

    /// An identity tile function blends back to the input exactly where
    /// the weights allow: every output value is a weighted mean of copies
    /// of itself.
    #[test]
    fn identity_tiles_reproduce_the_input() {
        let (h, w) = (21, 25);
        let data: Vec<f32> = (0..2 * 3 * h * w)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let x = Tensor {
            shape: vec![2, 3, h, w],
            data: data.clone(),
        };
        let mut calls = 0;
        let out = tiled_scale::<String>(
            &x,
            8,
            6,
            2,
            1.0,
            3,
            &mut |t| Ok(t.clone()),
            &mut || {
                calls += 1;
                Ok(())
            },
            &|m| m,
        )
        .expect("tiles");
        assert_eq!(calls, 2 * tile_count(h, w, 8, 6, 2));
        for (a, b) in out.data.iter().zip(&data) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
        }
    }
}
