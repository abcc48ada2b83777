//! A matrix product whose right operand is a weight decoded from its file
//! a panel of rows at a time: GGUF's block-quantized weights are
//! dequantized inside the product, and no f32 copy of the whole weight
//! ever exists (a Flux Linear of 3072 × 12288 would be 150 MB).

use super::{check_lhs_and_out, invalid, length, matmul, MatView, Products, Result};
use rayon::prelude::*;

/// Rows `[start, start + count)` of an `[n, k]` weight, row-major, in f32.
pub type DecodeRows<'a> = dyn Fn(usize, usize) -> std::result::Result<Vec<f32>, String> + Sync + 'a;

/// f32 bytes of one decoded panel: small enough that a panel per thread
/// stays near the caches and far below the weight's own size.
const PANEL_BYTES: usize = 16 << 20;

/// `c[b] = a[b] · wᵀ` for `b < batch`, where `w` is the `[n, k]` weight
/// `rows` decodes (a Linear layer's weight, shared by the batch).
///
/// * `a` is read through `av` as `[batch, m, k]`; `c` is contiguous
///   `[batch, m, n]` and is overwritten.
/// * The columns of `c` are cut into panels of whole weight rows; each
///   panel is decoded and multiplied by [`matmul`] (the same products as
///   on the whole decoded weight; the sums may run in another order), a
///   round of two panels per thread at a time, so only a few panels are
///   held at once.
#[allow(clippy::too_many_arguments)]
pub fn matmul_rows(
    a: &[f32],
    av: MatView,
    rows: &DecodeRows<'_>,
    c: &mut [f32],
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    products: Products,
) -> Result {
    const OP: &str = "matmul";
    let shape = || format!("batch={batch} m={m} n={n} k={k} a={av:?} (B decoded by rows)");
    let mn = check_lhs_and_out(OP, a, av, c.len(), [batch, m, n, k], &shape)?;
    if mn == 0 || batch == 0 {
        return Ok(());
    }
    let threads = rayon::current_num_threads().max(1);
    // Enough panels for every thread, none larger than PANEL_BYTES.
    let by_memory = (PANEL_BYTES / 4 / k.max(1)).max(8);
    let by_threads = n.div_ceil(2 * threads).max(8);
    let panel = by_memory.min(by_threads).min(n);
    let panels = n.div_ceil(panel);
    // B as the transpose of the decoded [w, k] rows.
    let bv = MatView {
        offset: 0,
        batch_stride: 0,
        row_stride: 1,
        col_stride: k,
    };
    let per_round = 2 * threads;
    for round in (0..panels).step_by(per_round) {
        let done: Vec<(usize, usize, Vec<f32>)> = (round..(round + per_round).min(panels))
            .into_par_iter()
            .map(|p| {
                let j0 = p * panel;
                let w = panel.min(n - j0);
                let b = rows(j0, w).map_err(|e| invalid(OP, e, &shape))?;
                length(OP, "decoded rows", b.len(), w * k, &shape)?;
                let mut out = vec![0f32; batch * m * w];
                matmul(a, av, &b, bv, &mut out, batch, m, w, k, products)?;
                Ok((j0, w, out))
            })
            .collect::<Result<_>>()?;
        for (j0, w, out) in done {
            for (dst, src) in c.chunks_mut(n).zip(out.chunks(w)) {
                dst[j0..j0 + w].copy_from_slice(src);
            }
        }
    }
    Ok(())
}
