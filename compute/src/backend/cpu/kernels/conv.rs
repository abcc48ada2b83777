//! 2-D convolution: im2col tiles times the weight (f32 through the gemm
//! crate, bf16 on AMX tiles with the weight packed once).

use super::*;
// ---------------------------------------------------------------------------
// Convolution
// ---------------------------------------------------------------------------

/// im2col tiles are capped at this many floats (8 MiB) per thread, so memory
/// stays bounded for large images; gemm blocks for cache on its own.
const COL_BUDGET: usize = 1 << 21;

/// Fewest output positions per tile worth a gemm call of its own.
const MIN_TILE_COLS: usize = 128;
/// Tile widths are rounded down to a multiple of this.
const TILE_ALIGN: usize = 64;

/// Geometry of one convolution, as im2col needs it.
#[derive(Clone, Copy, Debug)]
struct ConvGeom {
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    ow: usize,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
}

impl ConvGeom {
    /// Fills `col`, laid out `[cg*kh*kw, cols]`, with the input values under
    /// each kernel tap for output positions `p0..p0 + cols` (flattened
    /// `oy*ow + ox`), zero where the tap falls in the padding. `xg` is the
    /// group's input, `[cg, h, w]`.
    fn im2col(&self, xg: &[f32], p0: usize, cols: usize, col: &mut [f32], parallel: bool) {
        let fill = |r: usize, dst: &mut [f32]| self.im2col_row(xg, r, p0, dst);
        if cols == 0 {
            return;
        }
        if parallel {
            col.par_chunks_mut(cols)
                .enumerate()
                .for_each(|(r, dst)| fill(r, dst));
        } else {
            col.chunks_mut(cols)
                .enumerate()
                .for_each(|(r, dst)| fill(r, dst));
        }
    }

    /// One im2col row: kernel tap `r = (ci*kh + ky)*kw + kx`.
    fn im2col_row(&self, xg: &[f32], r: usize, p0: usize, dst: &mut [f32]) {
        let (ci, ky, kx) = (
            r / (self.kh * self.kw),
            (r / self.kw) % self.kh,
            r % self.kw,
        );
        let plane = &xg[ci * self.h * self.w..(ci + 1) * self.h * self.w];
        let (w, ow) = (self.w as isize, self.ow);
        let mut done = 0;
        let mut pos = p0;
        while done < dst.len() {
            let (oy, ox0) = (pos / ow, pos % ow);
            let run = (ow - ox0).min(dst.len() - done);
            let seg = &mut dst[done..done + run];
            let iy =
                (oy * self.stride[0] + ky * self.dilation[0]) as isize - self.padding[0] as isize;
            if iy < 0 || iy >= self.h as isize {
                seg.fill(0.0);
            } else {
                let row = &plane[iy as usize * self.w..(iy as usize + 1) * self.w];
                // Input column for output column ox is ox*stride + base.
                let base = (kx * self.dilation[1]) as isize - self.padding[1] as isize;
                if self.stride[1] == 1 {
                    // Unit stride: one contiguous copy between zeroed edges.
                    let (start, end) = (ox0 as isize, (ox0 + run) as isize);
                    let lo = (-base).clamp(start, end);
                    let hi = (w - base).clamp(lo, end);
                    if hi <= lo {
                        // The tap reads only padding for this whole run
                        // (lo may then sit outside the row).
                        seg.fill(0.0);
                    } else {
                        let (lo_i, hi_i) = ((lo - start) as usize, (hi - start) as usize);
                        seg[..lo_i].fill(0.0);
                        seg[lo_i..hi_i]
                            .copy_from_slice(&row[(lo + base) as usize..(hi + base) as usize]);
                        seg[hi_i..].fill(0.0);
                    }
                } else {
                    let sw = self.stride[1] as isize;
                    for (t, v) in seg.iter_mut().enumerate() {
                        let ix = (ox0 + t) as isize * sw + base;
                        *v = if (0..w).contains(&ix) {
                            row[ix as usize]
                        } else {
                            0.0
                        };
                    }
                }
            }
            done += run;
            pos += run;
        }
    }
}

/// The output positions `p0..p0 + cols` of one (image, group) pair, as one
/// mutable segment per output channel of the group.
struct ConvTile<'o> {
    job: usize,
    p0: usize,
    cols: usize,
    rows: Vec<&'o mut [f32]>,
}

/// 2-D convolution (cross-correlation, as `torch.nn.functional.conv2d`).
///
/// * `x`: `[n, c, h, w]` (`x_shape`), NCHW contiguous.
/// * `weight`: `[o, c / groups, kh, kw]` (`w_shape`).
/// * `bias`: `[o]` or `None`.
/// * `out`: `[n, o, oh, ow]` with
///   `oh = (h + 2*padding[0] - dilation[0]*(kh - 1) - 1) / stride[0] + 1`
///   (likewise `ow`); index 0 of `stride`/`padding`/`dilation` is height.
///
/// Output channel block `g` (of `o / groups`) sees only input channel block
/// `g`. 1×1 stride-1 unpadded convolutions are a plain GEMM on the input; the
/// rest are im2col tiles times the weight matrix, one tile per task, tiles
/// spread over threads.
#[allow(clippy::too_many_arguments)]
pub fn conv2d(
    x: &[f32],
    x_shape: [usize; 4],
    weight: &[f32],
    w_shape: [usize; 4],
    bias: Option<&[f32]>,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
    out: &mut [f32],
    products: Products,
) -> Result {
    conv2d_with(
        x,
        x_shape,
        ConvWeight::Plain(weight, products),
        w_shape,
        bias,
        stride,
        padding,
        dilation,
        groups,
        out,
    )
}

/// A convolution weight in the AMX kernels' tile order ([`pack_conv_weight`]),
/// packed once and used by every call ([`conv2d_packed`]).
pub struct PackedConvWeight {
    w_shape: [usize; 4],
    groups: usize,
    per_group: Vec<amx::PackedA>,
}

impl PackedConvWeight {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.per_group.iter().map(amx::PackedA::bytes).sum()
    }
}

/// Packs a `[o, c / groups, kh, kw]` weight for [`conv2d_packed`]; an
/// error where AMX is not available.
pub fn pack_conv_weight(
    weight: &[f32],
    w_shape: [usize; 4],
    groups: usize,
) -> Result<PackedConvWeight> {
    const OP: &str = "conv2d";
    let shape = || format!("weight={w_shape:?} groups={groups}");
    if !amx::available() {
        return Err(invalid(OP, "AMX tiles are not available", &shape));
    }
    let [o, cg, kh, kw] = w_shape;
    if groups == 0 || !o.is_multiple_of(groups) {
        return Err(invalid(
            OP,
            "output channels must split into groups",
            &shape,
        ));
    }
    length(
        OP,
        "weight",
        weight.len(),
        product(OP, &w_shape, &shape)?,
        &shape,
    )?;
    let (og, kk) = (o / groups, cg * kh * kw);
    let per_group = (0..groups)
        .map(|g| {
            let src = amx::Src {
                data: weight,
                offset: g * og * kk,
                rs: kk,
                cs: 1,
            };
            amx::PackedA::pack(src, og, kk, true)
        })
        .collect();
    Ok(PackedConvWeight {
        w_shape,
        groups,
        per_group,
    })
}

/// [`conv2d`] with a weight packed by [`pack_conv_weight`] (bf16 products).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_packed(
    x: &[f32],
    x_shape: [usize; 4],
    weight: &PackedConvWeight,
    bias: Option<&[f32]>,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    out: &mut [f32],
) -> Result {
    conv2d_with(
        x,
        x_shape,
        ConvWeight::Packed(&weight.per_group),
        weight.w_shape,
        bias,
        stride,
        padding,
        dilation,
        weight.groups,
        out,
    )
}

/// Where [`conv2d_with`] takes its weight from.
enum ConvWeight<'a> {
    /// f32 values, multiplied in this arithmetic.
    Plain(&'a [f32], Products),
    /// Packed for AMX, one matrix per group.
    Packed(&'a [amx::PackedA]),
}

#[allow(clippy::too_many_arguments)]
fn conv2d_with(
    x: &[f32],
    x_shape: [usize; 4],
    src: ConvWeight<'_>,
    w_shape: [usize; 4],
    bias: Option<&[f32]>,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
    out: &mut [f32],
) -> Result {
    const OP: &str = "conv2d";
    let [n, c, h, w] = x_shape;
    let [o, cg, kh, kw] = w_shape;
    let shape = || {
        format!(
            "x={x_shape:?} weight={w_shape:?} stride={stride:?} padding={padding:?} dilation={dilation:?} groups={groups}"
        )
    };
    if groups == 0 || stride.contains(&0) || dilation.contains(&0) {
        return Err(invalid(
            OP,
            "groups, stride and dilation must be positive",
            &shape,
        ));
    }
    if kh == 0 || kw == 0 {
        return Err(invalid(OP, "empty kernel", &shape));
    }
    if !c.is_multiple_of(groups) || !o.is_multiple_of(groups) || cg != c / groups {
        return Err(invalid(
            OP,
            "channels must split into groups: c % groups == 0, o % groups == 0, weight dim 1 == c / groups",
            &shape,
        ));
    }
    let out_dim = |size: usize, k: usize, axis: usize| -> Result<usize> {
        let padded = padding[axis]
            .checked_mul(2)
            .and_then(|p| p.checked_add(size))
            .ok_or_else(|| invalid(OP, "sizes overflow usize", &shape))?;
        let extent = dilation[axis]
            .checked_mul(k - 1)
            .and_then(|e| e.checked_add(1))
            .ok_or_else(|| invalid(OP, "sizes overflow usize", &shape))?;
        if extent > padded {
            return Err(invalid(
                OP,
                "dilated kernel is larger than the padded input",
                &shape,
            ));
        }
        Ok((padded - extent) / stride[axis] + 1)
    };
    let (oh, ow) = (out_dim(h, kh, 0)?, out_dim(w, kw, 1)?);
    length(OP, "x", x.len(), product(OP, &x_shape, &shape)?, &shape)?;
    let (weight, products, prepacked) = match src {
        ConvWeight::Plain(weight, products) => {
            length(
                OP,
                "weight",
                weight.len(),
                product(OP, &w_shape, &shape)?,
                &shape,
            )?;
            (weight, products, None)
        }
        // Packed and checked by pack_conv_weight; the f32 path is not taken.
        ConvWeight::Packed(groups) => (&[][..], Products::Bf16, Some(groups)),
    };
    if let Some(bias) = bias {
        length(OP, "bias", bias.len(), o, &shape)?;
    }
    length(
        OP,
        "out",
        out.len(),
        product(OP, &[n, o, oh, ow], &shape)?,
        &shape,
    )?;

    let og = o / groups;
    let p = oh * ow;
    let kk = cg * kh * kw;
    let plane = h * w;
    if og * p == 0 || n == 0 {
        return Ok(());
    }
    let jobs = n * groups;
    let threads = rayon::current_num_threads();
    let weight_of = |g: usize| Operand {
        data: weight,
        offset: g * og * kk,
        rs: kk,
        cs: 1,
    };

    // On AMX the weight is packed (once per call unless the caller packed
    // it for good), shared by every tile.
    let owned;
    let packed: Option<&[amx::PackedA]> = match prepacked {
        Some(p) => Some(p),
        None if products.uses_amx(og, p, kk) => {
            owned = pack_conv_weight(weight, w_shape, groups)?;
            Some(&owned.per_group)
        }
        None => None,
    };
    let amx_err = amx_error(OP, &shape);

    if kh == 1 && kw == 1 && stride == [1, 1] && padding == [0, 0] {
        if let Some(packed) = packed {
            // Pointwise on tiles: pack each image's input once, then bands
            // of output channels (whole 32-row blocks) in parallel.
            let mut input = amx::PackedB::empty();
            for (j, dst) in out.chunks_mut(og * p).enumerate() {
                let (b, g) = (j / groups, j % groups);
                let src = amx::Src {
                    data: x,
                    offset: (b * c + g * cg) * plane,
                    rs: plane,
                    cs: 1,
                };
                input.repack(src, cg, p, true);
                let a = &packed[g];
                let band = amx_band(og) / amx::BLOCK;
                dst.par_chunks_mut(band * amx::BLOCK * p)
                    .enumerate()
                    .try_for_each(|(t, d)| {
                        let accumulate = fill_bias(d, bias, g * og + t * band * amx::BLOCK, p);
                        let blocks = t * band..((t + 1) * band).min(a.blocks());
                        amx::gemm(amx::Lhs::Packed(a, blocks), &input, d, p, accumulate, 1.0)
                            .map_err(&amx_err)
                    })?;
            }
            return Ok(());
        }
        // Pointwise: the group's input [cg, h*w] already is the im2col matrix,
        // and each job's output [og, h*w] is one contiguous block.
        let outer = jobs >= 2 * threads;
        return out
            .par_chunks_mut(og * p)
            .enumerate()
            .try_for_each(|(j, dst)| {
                let (b, g) = (j / groups, j % groups);
                let accumulate = fill_bias(dst, bias, g * og, p);
                let input = Operand {
                    data: x,
                    offset: (b * c + g * cg) * plane,
                    rs: plane,
                    cs: 1,
                };
                gemm_auto(
                    OP,
                    og,
                    p,
                    cg,
                    dst,
                    accumulate,
                    weight_of(g),
                    input,
                    1.0,
                    outer,
                )
            });
    }

    let geom = ConvGeom {
        h,
        w,
        kh,
        kw,
        ow,
        stride,
        padding,
        dilation,
    };
    // Enough tiles for every thread to get several (load balance), each wide
    // enough for an efficient gemm, with the im2col buffer within budget.
    let tiles_per_job = (4 * threads).div_ceil(jobs).max(1);
    let budget_cols = (COL_BUDGET / kk.max(1)).max(MIN_TILE_COLS);
    let tile = p
        .div_ceil(tiles_per_job)
        .max(MIN_TILE_COLS)
        .min(budget_cols);
    // A multiple of gemm's widest AVX-512 micro-kernel (64 columns of the
    // output, which it computes transposed) leaves no ragged edge blocks.
    let tile = if tile > TILE_ALIGN {
        tile / TILE_ALIGN * TILE_ALIGN
    } else {
        tile
    }
    .min(p);

    let mut tiles = Vec::with_capacity(jobs * p.div_ceil(tile));
    for (job, job_out) in out.chunks_mut(og * p).enumerate() {
        let first = tiles.len();
        for p0 in (0..p).step_by(tile) {
            tiles.push(ConvTile {
                job,
                p0,
                cols: tile.min(p - p0),
                rows: Vec::with_capacity(og),
            });
        }
        for row in job_out.chunks_mut(p) {
            for (t, seg) in row.chunks_mut(tile).enumerate() {
                tiles[first + t].rows.push(seg);
            }
        }
    }
    // With fewer tiles than threads, each tile's im2col and gemm go parallel.
    let outer = tiles.len() >= threads;
    tiles.into_par_iter().try_for_each_init(
        || (Vec::new(), Vec::new(), amx::PackedB::empty()),
        |(col, prod, packed_col): &mut (Vec<f32>, Vec<f32>, amx::PackedB), tile| {
            let (b, g) = (tile.job / groups, tile.job % groups);
            let cols = tile.cols;
            prod.resize(og * cols, 0.0);
            let xg = &x[(b * c + g * cg) * plane..(b * c + (g + 1) * cg) * plane];
            let prod = &mut prod[..og * cols];
            if let Some(packed) = &packed {
                // im2col rows straight into tile order, two at a time.
                packed_col.repack_rows(kk, cols, |r, dst| geom.im2col_row(xg, r, tile.p0, dst));
                let a = &packed[g];
                amx::gemm(
                    amx::Lhs::Packed(a, 0..a.blocks()),
                    packed_col,
                    prod,
                    cols,
                    false,
                    1.0,
                )
                .map_err(&amx_err)?;
            } else {
                col.resize(kk * cols, 0.0);
                geom.im2col(xg, tile.p0, cols, &mut col[..kk * cols], !outer);
                let patches = Operand {
                    data: &col[..kk * cols],
                    offset: 0,
                    rs: cols,
                    cs: 1,
                };
                gemm_auto(
                    OP,
                    og,
                    cols,
                    kk,
                    prod,
                    false,
                    weight_of(g),
                    patches,
                    1.0,
                    outer,
                )?;
            }
            for (r, (seg, src)) in tile.rows.into_iter().zip(prod.chunks(cols)).enumerate() {
                match bias {
                    Some(bias) => {
                        let bv = bias[g * og + r];
                        seg.iter_mut().zip(src).for_each(|(d, s)| *d = s + bv);
                    }
                    None => seg.copy_from_slice(src),
                }
            }
            Ok(())
        },
    )
}

/// Fills each `cols`-long row `r` of `dst` with `bias[first + r]`; returns
/// whether it did (and so whether a following gemm must accumulate).
fn fill_bias(dst: &mut [f32], bias: Option<&[f32]>, first: usize, cols: usize) -> bool {
    match bias {
        Some(bias) => {
            for (row, &bv) in dst.chunks_mut(cols).zip(&bias[first..]) {
                row.fill(bv);
            }
            true
        }
        None => false,
    }
}
