//! Scaled dot-product attention: blocked, with an online softmax (f32, or
//! bf16 products on AMX tiles).

use super::*;
// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

/// Query rows per attention task.
pub(super) const ATTN_QB: usize = 64;
/// Keys per online-softmax step: the score block is `ATTN_QB × ATTN_KB`
/// floats (128 KiB), small enough to stay in L2 between its two gemms.
pub(super) const ATTN_KB: usize = 512;

/// Scaled dot-product attention, `softmax(q·kᵀ·scale + mask)·v` per head.
///
/// * `q`: `[bh, sq, d]`, `k`: `[bh, skv, d]`, `v`: `[bh, skv, dv]`.
/// * `mask`: additive, `[sq, skv]`, shared by every head (`-inf` hides a key).
/// * `out`: `[bh, sq, dv]`.
///
/// Never holds a full `sq × skv` score matrix: each task takes up to 64 query
/// rows of one head and walks the keys in blocks of 512 with an online
/// softmax (a running row max and sum, rescaling the partial output when the
/// max grows). A row whose keys are all masked gives NaN, as the plain
/// softmax would; `skv == 0` gives zeros, as PyTorch does.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    bh: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    scale: f32,
    out: &mut [f32],
    products: Products,
) -> Result {
    const OP: &str = "attention";
    let shape = || format!("bh={bh} sq={sq} skv={skv} d={d} dv={dv}");
    length(OP, "q", q.len(), product(OP, &[bh, sq, d], &shape)?, &shape)?;
    length(
        OP,
        "k",
        k.len(),
        product(OP, &[bh, skv, d], &shape)?,
        &shape,
    )?;
    length(
        OP,
        "v",
        v.len(),
        product(OP, &[bh, skv, dv], &shape)?,
        &shape,
    )?;
    if let Some(mask) = mask {
        length(
            OP,
            "mask",
            mask.len(),
            product(OP, &[sq, skv], &shape)?,
            &shape,
        )?;
    }
    length(
        OP,
        "out",
        out.len(),
        product(OP, &[bh, sq, dv], &shape)?,
        &shape,
    )?;
    if out.is_empty() {
        return Ok(());
    }
    if skv == 0 {
        out.fill(0.0);
        return Ok(());
    }

    // One task per (head, query block); each owns its rows of `out`, which
    // double as the running (unnormalized) output.
    let tasks: Vec<(usize, usize, &mut [f32])> = out
        .chunks_mut(sq * dv)
        .enumerate()
        .flat_map(|(head, o)| {
            o.chunks_mut(ATTN_QB * dv)
                .enumerate()
                .map(move |(i, block)| (head, i * ATTN_QB, block))
        })
        .collect();
    let kb_max = ATTN_KB.min(skv);
    let arch = pulp::Arch::new();
    if products.attention_uses_amx(sq, skv, d) {
        return attention_amx(q, k, v, mask, (bh, sq, skv, d, dv), scale, tasks);
    }
    tasks.into_par_iter().try_for_each_init(
        || OnlineSoftmax {
            scores: vec![0.0; ATTN_QB * kb_max],
            row_max: [0.0; ATTN_QB],
            row_sum: [0.0; ATTN_QB],
        },
        |state, (head, q0, acc)| {
            let rows = acc.len() / dv;
            acc.fill(0.0);
            state.row_max[..rows].fill(f32::NEG_INFINITY);
            state.row_sum[..rows].fill(0.0);
            let queries = Operand {
                data: q,
                offset: (head * sq + q0) * d,
                rs: d,
                cs: 1,
            };
            for j0 in (0..skv).step_by(kb_max) {
                let kb = kb_max.min(skv - j0);
                let s = &mut state.scores[..rows * kb];
                // kᵀ block: element (p, j) is k[head, j0 + j, p].
                let keys_t = Operand {
                    data: k,
                    offset: (head * skv + j0) * d,
                    rs: 1,
                    cs: d,
                };
                gemm_into(
                    OP,
                    rows,
                    kb,
                    d,
                    s,
                    0,
                    kb,
                    false,
                    queries,
                    keys_t,
                    scale,
                    Parallelism::None,
                )?;
                let mask_block = mask.map(|m| (m, q0 * skv + j0, skv));
                let (row_max, row_sum) = (&mut state.row_max[..rows], &mut state.row_sum[..rows]);
                arch.dispatch(SoftmaxStep {
                    s,
                    kb,
                    mask: mask_block,
                    row_max,
                    row_sum,
                    acc,
                    dv,
                });
                let values = Operand {
                    data: v,
                    offset: (head * skv + j0) * dv,
                    rs: dv,
                    cs: 1,
                };
                let weights = Operand {
                    data: s,
                    offset: 0,
                    rs: kb,
                    cs: 1,
                };
                gemm_into(
                    OP,
                    rows,
                    dv,
                    kb,
                    acc,
                    0,
                    dv,
                    true,
                    weights,
                    values,
                    1.0,
                    Parallelism::None,
                )?;
            }
            for (arow, &l) in acc.chunks_mut(dv).zip(state.row_sum.iter()) {
                let inv = 1.0 / l;
                arow.iter_mut().for_each(|a| *a *= inv);
            }
            Ok(())
        },
    )
}

/// [`attention`] on AMX tiles: the same blocked online softmax, with both
/// products in bf16. Keys and values are packed once per (head, key
/// block) up front, shared by every query block of the head.
fn attention_amx(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    (bh, sq, skv, d, dv): (usize, usize, usize, usize, usize),
    scale: f32,
    tasks: Vec<(usize, usize, &mut [f32])>,
) -> Result {
    use amx::{gemm, Lhs, PackedA, PackedB, Src};
    const OP: &str = "attention";
    let shape = || format!("bh={bh} sq={sq} skv={skv} d={d} dv={dv}");
    let err = amx_error(OP, &shape);
    let kb_max = ATTN_KB.min(skv);
    let per_head = skv.div_ceil(kb_max);
    // Block (head, j) of keys as B = kᵀ ([d, kb]) and of values ([kb, dv]).
    let packed: Vec<(PackedB, PackedB)> = (0..bh * per_head)
        .into_par_iter()
        .map(|i| {
            let (head, j0) = (i / per_head, (i % per_head) * kb_max);
            let kb = kb_max.min(skv - j0);
            let keys = Src {
                data: k,
                offset: (head * skv + j0) * d,
                rs: 1,
                cs: d,
            };
            let values = Src {
                data: v,
                offset: (head * skv + j0) * dv,
                rs: dv,
                cs: 1,
            };
            (
                PackedB::pack(keys, d, kb, false),
                PackedB::pack(values, kb, dv, false),
            )
        })
        .collect();
    tasks.into_par_iter().try_for_each_init(
        || {
            let state = OnlineSoftmax {
                scores: vec![0.0; ATTN_QB * (kb_max + SCORE_PAD)],
                row_max: [0.0; ATTN_QB],
                row_sum: [0.0; ATTN_QB],
            };
            (state, PackedA::empty())
        },
        |(state, p), (head, q0, acc)| {
            let rows = acc.len() / dv;
            acc.fill(0.0);
            state.row_max[..rows].fill(f32::NEG_INFINITY);
            state.row_sum[..rows].fill(0.0);
            let queries = Src {
                data: q,
                offset: (head * sq + q0) * d,
                rs: d,
                cs: 1,
            };
            let qa = PackedA::pack(queries, rows, d, false);
            for (jb, (keys, values)) in packed[head * per_head..(head + 1) * per_head]
                .iter()
                .enumerate()
            {
                let (j0, kb) = (jb * kb_max, keys.cols());
                // Rows of scores `kb + SCORE_PAD` apart: a power-of-two
                // stride would map a tile's 16 rows to the same few L1 sets.
                let stride = kb + SCORE_PAD;
                let s = &mut state.scores[..rows * stride];
                // Raw scores: the scale is folded into the exponentials.
                gemm(
                    Lhs::Packed(&qa, 0..qa.blocks()),
                    keys,
                    s,
                    stride,
                    false,
                    1.0,
                )
                .map_err(&err)?;
                // The online-softmax step of `online_softmax_step`, its
                // loops in AVX-512 (amx::scaled_max, amx::exp_sum_into), the
                // numerators going straight into bf16 tiles `p`.
                p.reset(rows, kb);
                for (i, srow) in s.chunks_mut(stride).enumerate() {
                    let srow = &mut srow[..kb];
                    let mrow = mask.map(|m| &m[(q0 + i) * skv + j0..][..kb]);
                    let (max, row_scale) = amx::scaled_max(srow, scale, mrow);
                    let new_max = state.row_max[i].max(max);
                    if new_max == f32::NEG_INFINITY {
                        continue; // every key so far is masked: p's row stays 0
                    }
                    let rescale = exp_approx(state.row_max[i] - new_max);
                    let sum = amx::exp_sum_into(srow, row_scale, new_max, p, i);
                    state.row_sum[i] = state.row_sum[i] * rescale + sum;
                    state.row_max[i] = new_max;
                    if rescale != 1.0 {
                        acc[i * dv..(i + 1) * dv]
                            .iter_mut()
                            .for_each(|a| *a *= rescale);
                    }
                }
                gemm(Lhs::Packed(p, 0..p.blocks()), values, acc, dv, true, 1.0).map_err(&err)?;
            }
            for (arow, &l) in acc.chunks_mut(dv).zip(state.row_sum.iter()) {
                let inv = 1.0 / l;
                arow.iter_mut().for_each(|a| *a *= inv);
            }
            Ok(())
        },
    )
}

/// Extra floats per row of the bf16 attention's score block.
const SCORE_PAD: usize = 16;

/// Per-thread scratch of [`attention`].
struct OnlineSoftmax {
    /// One block of scores, then of softmax numerators: `[rows, kb]`.
    scores: Vec<f32>,
    /// Running max of each query row's scores so far.
    row_max: [f32; ATTN_QB],
    /// Running Σ e^(score - row_max) of each query row.
    row_sum: [f32; ATTN_QB],
}

/// One online-softmax step over a `[rows, kb]` block of scores `s`: adds the
/// mask (`(mask, start, stride)`: row `i` of the block is
/// `mask[start + i*stride..][..kb]`), raises each row's running max, turns
/// the scores into `e^(score - max)`, and rescales the running sums and the
/// partial outputs `acc` (`[rows, dv]`) by `e^(old max - new max)`.
///
/// Run through [`pulp::Arch::dispatch`] so its loops are compiled for
/// AVX-512 or AVX2 when the CPU has them: the exponentials are a large share
/// of attention's time, and the x86-64 baseline only has 4-wide SSE. (A
/// struct rather than a closure, because only a `#[inline(always)]` method
/// is reliably inlined into the dispatcher's target-feature function.)
struct SoftmaxStep<'a> {
    s: &'a mut [f32],
    kb: usize,
    mask: Option<(&'a [f32], usize, usize)>,
    row_max: &'a mut [f32],
    row_sum: &'a mut [f32],
    acc: &'a mut [f32],
    dv: usize,
}

impl pulp::WithSimd for SoftmaxStep<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        let SoftmaxStep {
            s,
            kb,
            mask,
            row_max,
            row_sum,
            acc,
            dv,
        } = self;
        online_softmax_step(s, kb, mask, row_max, row_sum, acc, dv);
    }
}

#[inline(always)]
fn online_softmax_step(
    s: &mut [f32],
    kb: usize,
    mask: Option<(&[f32], usize, usize)>,
    row_max: &mut [f32],
    row_sum: &mut [f32],
    acc: &mut [f32],
    dv: usize,
) {
    for (i, srow) in s.chunks_mut(kb).enumerate() {
        if let Some((mask, start, stride)) = mask {
            let mrow = &mask[start + i * stride..][..kb];
            srow.iter_mut().zip(mrow).for_each(|(s, m)| *s += m);
        }
        let new_max = row_max[i].max(max_f32(srow));
        if new_max == f32::NEG_INFINITY {
            // Every key so far is masked: they weigh nothing, and
            // e^(-inf - -inf) would be NaN.
            srow.fill(0.0);
            continue;
        }
        let rescale = exp_approx(row_max[i] - new_max);
        row_sum[i] = row_sum[i] * rescale + exp_shifted_sum(srow, new_max);
        row_max[i] = new_max;
        if rescale != 1.0 {
            acc[i * dv..(i + 1) * dv]
                .iter_mut()
                .for_each(|a| *a *= rescale);
        }
    }
}
