//! CPU kernels against naive, obviously-correct references computed in f64.
//!
//! Tolerances (largest error allowed, with how it is measured):
//! * matmul, conv2d: |got - want| ≤ 2e-6 · Σ|a·b| over the element's terms
//!   (the dot product's own condition scale; depths here reach ~300).
//! * attention: |got - want| ≤ 2e-6 · max|v| of the head.
//! * bf16 (AMX) paths: the same bounds against the references on
//!   bf16-rounded inputs (attention: 2.5e-3 · max|v|), plus NMSE ≤ 1e-4
//!   against the unrounded references.
//!
//! Observed maxima when written were 3-7× below each bound. Softmax,
//! norms, resampling and conversions: `cpu_rowwise.rs`.

mod common;

use common::{config, max_err, random};
use proptest::prelude::*;
use sdkit_compute::backend::cpu::amx;
use sdkit_compute::backend::cpu::kernels::{
    attention, conv2d, matmul, matmul_rows, KernelError, MatView, Products,
};

/// Whether the bf16 (AMX) cases can run here. Where CI's CPU has AMX it
/// sets SDKIT_REQUIRE_AMX, and then a CPU or kernel that refuses fails.
fn amx_here() -> bool {
    if amx::available() {
        return true;
    }
    assert!(
        std::env::var_os("SDKIT_REQUIRE_AMX").is_none(),
        "SDKIT_REQUIRE_AMX is set but AMX tiles are not available"
    );
    eprintln!("skipping bf16 cases: this CPU (or OS) has no AMX tiles");
    false
}

/// The values as the AMX kernels read them: rounded to bf16 (nearest
/// even). Products of two bf16 values are exact in f32, so a reference on
/// rounded inputs leaves only f32 accumulation error.
fn rounded(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| amx::bf16_to_f32(amx::bf16(v))).collect()
}

/// Σ(got - want)² / Σ want²: the bf16 paths' whole-output bound against
/// the unrounded f32 reference.
fn nmse(got: &[f32], want: &[f64]) -> f64 {
    let (mut e, mut w) = (0.0f64, 0.0f64);
    for (&g, &r) in got.iter().zip(want) {
        if r.is_nan() {
            continue;
        }
        e += (f64::from(g) - r).powi(2);
        w += r * r;
    }
    e / w.max(1e-300)
}

/// bf16 operands round each value by at most 2⁻⁹ relative, so on random
/// data the output's NMSE against f32 is ~1e-5; layout or rounding bugs
/// give ~1.
const BF16_NMSE: f64 = 1e-4;

// ---------------------------------------------------------------------------
// matmul
// ---------------------------------------------------------------------------

/// `c[b, i, j] = Σ_p a[b, i, p] · b[b, p, j]` read through the views, plus
/// Σ|a·b| per element.
#[allow(clippy::too_many_arguments)]
fn matmul_ref(
    a: &[f32],
    av: MatView,
    b: &[f32],
    bv: MatView,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0; batch * m * n];
    let mut mag = vec![0.0; batch * m * n];
    for bi in 0..batch {
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let x = f64::from(
                        a[av.offset + bi * av.batch_stride + i * av.row_stride + p * av.col_stride],
                    );
                    let y = f64::from(
                        b[bv.offset + bi * bv.batch_stride + p * bv.row_stride + j * bv.col_stride],
                    );
                    c[(bi * m + i) * n + j] += x * y;
                    mag[(bi * m + i) * n + j] += (x * y).abs();
                }
            }
        }
    }
    (c, mag)
}

/// A view of a `[batch, rows, cols]` operand: optionally transposed in memory,
/// broadcast over the batch, with padded rows and a leading offset; returns
/// the view and the buffer length it needs.
fn make_view(
    batch: usize,
    rows: usize,
    cols: usize,
    transposed: bool,
    broadcast: bool,
    pad: usize,
    offset: usize,
) -> (MatView, usize) {
    // Memory is [outer, inner + pad] with (outer, inner) = (rows, cols), or
    // (cols, rows) when transposed.
    let (outer, inner) = if transposed {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let ld = inner + pad;
    let per = outer * ld;
    let (row_stride, col_stride) = if transposed { (1, ld) } else { (ld, 1) };
    let batch_stride = if broadcast { 0 } else { per };
    let copies = if broadcast { 1 } else { batch };
    (
        MatView {
            offset,
            batch_stride,
            row_stride,
            col_stride,
        },
        offset + copies * per,
    )
}

fn check_matmul(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    views: [(bool, bool, usize, usize); 2],
    seed: u64,
    products: Products,
) {
    let [(ta, ba, pa, oa), (tb, bb, pb, ob)] = views;
    let (av, alen) = make_view(batch, m, k, ta, ba, pa, oa);
    let (bv, blen) = make_view(batch, k, n, tb, bb, pb, ob);
    let a = random(seed, alen);
    let b = random(seed ^ 0x55, blen);
    let mut c = vec![f32::NAN; batch * m * n];
    matmul(&a, av, &b, bv, &mut c, batch, m, n, k, products).expect("matmul");
    let (want, mag) = if products.uses_amx(m, n, k) {
        let (full, _) = matmul_ref(&a, av, &b, bv, batch, m, n, k);
        let e = nmse(&c, &full);
        assert!(e <= BF16_NMSE, "bf16 matmul nmse {e:e}");
        matmul_ref(&rounded(&a), av, &rounded(&b), bv, batch, m, n, k)
    } else {
        matmul_ref(&a, av, &b, bv, batch, m, n, k)
    };
    let err = max_err(&c, &want, |i| mag[i].max(1e-30));
    assert!(
        err <= 2e-6,
        "matmul err {err:e} batch={batch} m={m} n={n} k={k} views={views:?}"
    );
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn matmul_matches_reference(
        batch in 1usize..4, m in 1usize..40, n in 1usize..40, k in 1usize..70,
        ta: bool, tb: bool, ba: bool, bb: bool,
        pa in 0usize..3, pb in 0usize..3, oa in 0usize..5, ob in 0usize..5,
        seed: u64,
    ) {
        check_matmul(batch, m, n, k, [(ta, ba, pa, oa), (tb, bb, pb, ob)], seed, Products::F32);
    }

    /// bf16 on AMX: exact products of the rounded inputs, f32 sums.
    #[test]
    fn matmul_bf16_matches_reference_on_rounded_inputs(
        batch in 1usize..4, m in 1usize..100, n in 1usize..100, k in 8usize..200,
        ta: bool, tb: bool, ba: bool, bb: bool,
        pa in 0usize..3, pb in 0usize..3, oa in 0usize..5, ob in 0usize..5,
        seed: u64,
    ) {
        if amx_here() {
            check_matmul(batch, m, n, k, [(ta, ba, pa, oa), (tb, bb, pb, ob)], seed, Products::Bf16);
        }
    }
}

/// [`matmul_rows`] (B decoded a panel of weight rows at a time, as GGUF
/// weights are) gives [`matmul`]'s result on the whole decoded weight,
/// over panel counts from one to many, with a strided, batched A.
fn check_matmul_rows(batch: usize, m: usize, n: usize, k: usize, ta: bool, seed: u64) {
    let (av, alen) = make_view(batch, m, k, ta, false, 1, 2);
    let a = random(seed, alen);
    let w = random(seed ^ 0x77, n * k);
    let bv = MatView {
        offset: 0,
        batch_stride: 0,
        row_stride: 1,
        col_stride: k,
    };
    let mut want = vec![f32::NAN; batch * m * n];
    matmul(&a, av, &w, bv, &mut want, batch, m, n, k, Products::F32).expect("matmul");
    let asked = std::sync::Mutex::new(Vec::new());
    let rows = |start: usize, count: usize| {
        asked.lock().expect("lock").push((start, count));
        Ok(w[start * k..(start + count) * k].to_vec())
    };
    let mut got = vec![f32::NAN; batch * m * n];
    matmul_rows(&a, av, &rows, &mut got, batch, m, n, k, Products::F32).expect("matmul_rows");
    let (_, mag) = matmul_ref(&a, av, &w, bv, batch, m, n, k);
    let err = max_err(
        &got,
        &want.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
        |i| mag[i].max(1e-30),
    );
    assert!(
        err <= 2e-6,
        "matmul_rows err {err:e} batch={batch} m={m} n={n} k={k}"
    );
    // Every row decoded exactly once, in panels smaller than the weight
    // where there are enough rows to split.
    let mut asked = asked.into_inner().expect("lock");
    asked.sort_unstable();
    let mut next = 0;
    for &(start, count) in &asked {
        assert_eq!(start, next, "panels {asked:?}");
        next += count;
    }
    assert_eq!(next, n);
    if n >= 32 {
        assert!(asked.len() > 1, "one panel for {n} rows");
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn matmul_rows_matches_matmul(
        batch in 1usize..3, m in 1usize..40, n in 1usize..200, k in 1usize..70,
        ta: bool, seed: u64,
    ) {
        check_matmul_rows(batch, m, n, k, ta, seed);
    }
}

/// A decode failure or a wrong-sized panel is an error naming the op,
/// not a panic or a wrong product.
#[test]
fn matmul_rows_reports_decode_errors() {
    let (m, n, k) = (3, 40, 8);
    let a = vec![1.0f32; m * k];
    let av = MatView::row_major(m, k);
    let mut c = vec![0f32; m * n];
    let failing = |_: usize, _: usize| Err("block 3 is truncated".to_string());
    let err =
        matmul_rows(&a, av, &failing, &mut c, 1, m, n, k, Products::F32).expect_err("decode fails");
    assert!(err.to_string().contains("block 3 is truncated"), "{err}");
    let short = |_: usize, count: usize| Ok(vec![0f32; count * k - 1]);
    let err =
        matmul_rows(&a, av, &short, &mut c, 1, m, n, k, Products::F32).expect_err("short panel");
    assert!(matches!(err, KernelError::Length { .. }), "{err:?}");
}

#[test]
fn matmul_large_products_use_threads_correctly() {
    // Above the threading threshold: one product split inside gemm ...
    check_matmul(
        1,
        257,
        190,
        301,
        [(false, false, 0, 0), (true, false, 3, 1)],
        1,
        Products::F32,
    );
    // ... and a batch of mid-size ones with a broadcast operand.
    check_matmul(
        3,
        130,
        129,
        70,
        [(true, false, 1, 2), (false, true, 0, 0)],
        2,
        Products::F32,
    );
}

/// f32 → bf16 rounds to nearest, ties to even, as PyTorch's `.bfloat16()`.
#[test]
fn bf16_rounding_is_nearest_even() {
    for (x, bits) in [
        (1.0f32, 0x3f80u16),
        (1.0 + 2f32.powi(-8), 0x3f80),       // tie: down to even
        (1.0 + 3.0 * 2f32.powi(-8), 0x3f82), // tie: up to even
        (1.0 + 2f32.powi(-8) + 2f32.powi(-20), 0x3f81),
        (-2.5, 0xc020),
        (f32::INFINITY, 0x7f80),
        (f32::MAX, 0x7f80), // rounds past the largest bf16
    ] {
        assert_eq!(amx::bf16(x), bits, "{x}");
    }
    assert!(amx::bf16_to_f32(amx::bf16(f32::NAN)).is_nan());
    // The vectorised conversion the packing uses agrees bit for bit, on
    // ties, infinities, NaNs, subnormals and a ragged tail.
    let mut values = vec![
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        -(1.0 + 2f32.powi(-8)),
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MAX,
        f32::MIN_POSITIVE / 3.0,
        -0.0,
    ];
    values.extend(random(11, 40).iter().map(|v| v * 1e3));
    let mut got = vec![0u16; values.len()];
    amx::to_bf16(&values, &mut got);
    for (v, g) in values.iter().zip(&got) {
        let want = amx::bf16(*v);
        assert!(
            *g == want || (v.is_nan() && amx::bf16_to_f32(*g).is_nan()),
            "{v}: {g:#06x} vs {want:#06x}"
        );
    }
}

/// The bf16 paths on SD-like shapes: bands over threads, a weight shared
/// across the batch, pointwise and 3×3 convolutions over several tiles,
/// groups, and attention over several key blocks.
#[test]
fn bf16_products_on_large_shapes() {
    if !amx_here() {
        return;
    }
    let b = Products::Bf16;
    check_matmul(
        1,
        257,
        190,
        301,
        [(false, false, 0, 0), (true, false, 3, 1)],
        1,
        b,
    );
    check_matmul(
        3,
        130,
        129,
        70,
        [(true, false, 1, 2), (false, true, 0, 0)],
        2,
        b,
    );
    check_matmul(
        5,
        77,
        64,
        96,
        [(false, false, 0, 0), (false, false, 0, 0)],
        3,
        b,
    );
    for (o, c, k, groups, stride, padding) in [
        (64, 96, 1, 1, 1, 0),
        (70, 40, 3, 1, 1, 1),
        (48, 32, 3, 2, 2, 1),
        (33, 17, 3, 1, 1, 0),
    ] {
        let t = ConvCase {
            n: 2,
            c,
            h: 37,
            w: 29,
            o,
            kh: k,
            kw: k,
            stride: [stride; 2],
            padding: [padding; 2],
            dilation: [1, 1],
            groups,
            bias: o % 2 == 0,
        };
        check_conv(t, 4, b);
    }
    let mask = make_mask(70, 1300, 5);
    check_attention(2, 70, 1300, 40, 40, Some(&mask), 6, b);
    check_attention(3, 200, 77, 64, 64, None, 7, b);
}

#[test]
fn matmul_zero_depth_gives_zeros_and_row_broadcast_works() {
    let mut c = vec![f32::NAN; 6];
    matmul(
        &[],
        MatView::row_major(2, 0),
        &[],
        MatView::row_major(0, 3),
        &mut c,
        1,
        2,
        3,
        0,
        Products::F32,
    )
    .expect("k = 0");
    assert_eq!(c, vec![0.0; 6]);
    // row_stride 0: every row of `a` is the same vector.
    let a = [1.0, 2.0];
    let av = MatView {
        offset: 0,
        batch_stride: 0,
        row_stride: 0,
        col_stride: 1,
    };
    let b = [1.0, 0.0, 3.0, 4.0];
    let mut c = vec![0.0; 6];
    matmul(
        &a,
        av,
        &b,
        MatView::row_major(2, 2),
        &mut c,
        1,
        3,
        2,
        2,
        Products::F32,
    )
    .expect("broadcast rows");
    assert_eq!(c, vec![7.0, 8.0, 7.0, 8.0, 7.0, 8.0]);
}

#[test]
fn matmul_rejects_inconsistent_sizes() {
    let a = vec![0.0; 6];
    let b = vec![0.0; 6];
    let mut c = vec![0.0; 4];
    let err = matmul(
        &a,
        MatView::row_major(2, 3),
        &b,
        MatView::row_major(3, 2),
        &mut c,
        1,
        2,
        2,
        3,
        Products::F32,
    );
    assert_eq!(err, Ok(()));
    let err = matmul(
        &a,
        MatView::row_major(2, 3),
        &b,
        MatView::row_major(3, 2),
        &mut c,
        2,
        2,
        2,
        3,
        Products::F32,
    );
    assert!(
        matches!(err, Err(KernelError::Length { operand: "c", .. })),
        "{err:?}"
    );
    let mut c8 = vec![0.0; 8];
    let err = matmul(
        &a,
        MatView::row_major(2, 3),
        &b,
        MatView::row_major(3, 2),
        &mut c8,
        2,
        2,
        2,
        3,
        Products::F32,
    );
    assert!(
        matches!(err, Err(KernelError::OutOfBounds { operand: "a", .. })),
        "{err:?}"
    );
    let huge = MatView {
        offset: usize::MAX,
        batch_stride: 0,
        row_stride: 1,
        col_stride: 1,
    };
    let err = matmul(
        &a,
        huge,
        &b,
        MatView::row_major(3, 2),
        &mut c,
        1,
        2,
        2,
        3,
        Products::F32,
    );
    assert!(matches!(err, Err(KernelError::Invalid { .. })), "{err:?}");
}

// ---------------------------------------------------------------------------
// conv2d
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct ConvCase {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
    bias: bool,
}

impl ConvCase {
    fn out_hw(&self) -> Option<(usize, usize)> {
        let dim = |size: usize, k: usize, a: usize| {
            let padded = size + 2 * self.padding[a];
            let extent = self.dilation[a] * (k - 1) + 1;
            (extent <= padded).then(|| (padded - extent) / self.stride[a] + 1)
        };
        Some((dim(self.h, self.kh, 0)?, dim(self.w, self.kw, 1)?))
    }
}

/// The convolution sum written out, plus Σ|x·w| (bias counted in both).
fn conv_ref(t: &ConvCase, x: &[f32], wt: &[f32], bias: Option<&[f32]>) -> (Vec<f64>, Vec<f64>) {
    let (oh, ow) = t.out_hw().expect("valid case");
    let (cg, og) = (t.c / t.groups, t.o / t.groups);
    let mut out = vec![0.0; t.n * t.o * oh * ow];
    let mut mag = vec![0.0; out.len()];
    for b in 0..t.n {
        for oc in 0..t.o {
            let g = oc / og;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = bias.map_or(0.0, |bs| f64::from(bs[oc]));
                    let mut m = acc.abs();
                    for ic in 0..cg {
                        for ky in 0..t.kh {
                            for kx in 0..t.kw {
                                let iy = (oy * t.stride[0] + ky * t.dilation[0]) as isize
                                    - t.padding[0] as isize;
                                let ix = (ox * t.stride[1] + kx * t.dilation[1]) as isize
                                    - t.padding[1] as isize;
                                if iy < 0 || ix < 0 || iy >= t.h as isize || ix >= t.w as isize {
                                    continue;
                                }
                                let xv = f64::from(
                                    x[((b * t.c + g * cg + ic) * t.h + iy as usize) * t.w
                                        + ix as usize],
                                );
                                let wv = f64::from(wt[((oc * cg + ic) * t.kh + ky) * t.kw + kx]);
                                acc += xv * wv;
                                m += (xv * wv).abs();
                            }
                        }
                    }
                    let i = ((b * t.o + oc) * oh + oy) * ow + ox;
                    out[i] = acc;
                    mag[i] = m;
                }
            }
        }
    }
    (out, mag)
}

fn check_conv(t: ConvCase, seed: u64, products: Products) {
    let (oh, ow) = t.out_hw().expect("valid case");
    let x = random(seed, t.n * t.c * t.h * t.w);
    let wt = random(seed ^ 1, t.o * (t.c / t.groups) * t.kh * t.kw);
    let bias = t.bias.then(|| random(seed ^ 2, t.o));
    let mut out = vec![f32::NAN; t.n * t.o * oh * ow];
    conv2d(
        &x,
        [t.n, t.c, t.h, t.w],
        &wt,
        [t.o, t.c / t.groups, t.kh, t.kw],
        bias.as_deref(),
        t.stride,
        t.padding,
        t.dilation,
        t.groups,
        &mut out,
        products,
    )
    .expect("conv2d");
    let og = t.o / t.groups;
    let (want, mag) = if products.uses_amx(og, oh * ow, t.c / t.groups * t.kh * t.kw) {
        let (full, _) = conv_ref(&t, &x, &wt, bias.as_deref());
        let e = nmse(&out, &full);
        assert!(e <= BF16_NMSE, "bf16 conv2d nmse {e:e} for {t:?}");
        conv_ref(&t, &rounded(&x), &rounded(&wt), bias.as_deref())
    } else {
        conv_ref(&t, &x, &wt, bias.as_deref())
    };
    let err = max_err(&out, &want, |i| mag[i].max(1e-30));
    assert!(err <= 2e-6, "conv2d err {err:e} for {t:?}");
}

fn conv_case() -> impl Strategy<Value = ConvCase> {
    (
        (
            1usize..3,
            1usize..4,
            1usize..5,
            1usize..5,
            1usize..12,
            1usize..12,
        ),
        (
            prop_oneof![Just(1usize), 1usize..5],
            1usize..5,
            [1usize..4, 1usize..4],
        ),
        (
            [0usize..3, 0usize..3],
            [1usize..4, 1usize..4],
            any::<bool>(),
        ),
    )
        .prop_map(
            |((n, groups, cg, og, h, w), (kh, kw, stride), (padding, dilation, bias))| {
                // A 1×1 kernel takes the pointwise path when also unit-stride and
                // unpadded; draw that often enough to be tested.
                let kw = if kh == 1 && kw > 2 { 1 } else { kw };
                ConvCase {
                    n,
                    c: cg * groups,
                    h,
                    w,
                    o: og * groups,
                    kh,
                    kw,
                    stride,
                    padding,
                    dilation,
                    groups,
                    bias,
                }
            },
        )
        .prop_filter("kernel fits the padded input", |t| t.out_hw().is_some())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn conv2d_matches_reference(t in conv_case(), seed: u64) {
        check_conv(t, seed, Products::F32);
    }

    /// bf16 on AMX (the cases big enough to take it).
    #[test]
    fn conv2d_bf16_matches_reference_on_rounded_inputs(t in conv_case(), seed: u64) {
        if amx_here() {
            check_conv(t, seed, Products::Bf16);
        }
    }
}

/// A dilated tap that lies wholly in the padding for a run (proptest found
/// it: the unit-stride copy range went negative).
#[test]
fn conv2d_tap_entirely_in_padding() {
    check_conv(
        ConvCase {
            n: 1,
            c: 1,
            h: 1,
            w: 3,
            o: 1,
            kh: 2,
            kw: 4,
            stride: [1, 1],
            padding: [2, 2],
            dilation: [1, 2],
            groups: 1,
            bias: false,
        },
        0,
        Products::F32,
    );
}

#[test]
fn conv2d_tiles_pointwise_and_strided_cases() {
    let base = ConvCase {
        n: 2,
        c: 6,
        h: 37,
        w: 41,
        o: 5,
        kh: 3,
        kw: 3,
        stride: [1, 1],
        padding: [1, 1],
        dilation: [1, 1],
        groups: 1,
        bias: true,
    };
    // Several im2col tiles per image, their edges falling mid-row.
    check_conv(base, 3, Products::F32);
    check_conv(
        ConvCase {
            stride: [2, 3],
            dilation: [2, 1],
            groups: 3,
            o: 6,
            ..base
        },
        4,
        Products::F32,
    );
    // Pointwise: straight to gemm, with and without groups.
    check_conv(
        ConvCase {
            kh: 1,
            kw: 1,
            padding: [0, 0],
            ..base
        },
        5,
        Products::F32,
    );
    check_conv(
        ConvCase {
            kh: 1,
            kw: 1,
            padding: [0, 0],
            groups: 2,
            o: 4,
            bias: false,
            ..base
        },
        6,
        Products::F32,
    );
    // One image, one group, few positions: im2col and gemm run parallel inside.
    check_conv(
        ConvCase {
            n: 1,
            c: 64,
            o: 48,
            h: 9,
            w: 9,
            ..base
        },
        7,
        Products::F32,
    );
}

#[test]
fn conv2d_rejects_inconsistent_sizes() {
    let x = vec![0.0; 2 * 4 * 5 * 5];
    let w = vec![0.0; 3 * 4 * 3 * 3];
    let mut out = vec![0.0; 2 * 3 * 3 * 3];
    let ok = conv2d(
        &x,
        [2, 4, 5, 5],
        &w,
        [3, 4, 3, 3],
        None,
        [1, 1],
        [0, 0],
        [1, 1],
        1,
        &mut out,
        Products::F32,
    );
    assert_eq!(ok, Ok(()));
    let bad_groups = conv2d(
        &x,
        [2, 4, 5, 5],
        &w,
        [3, 4, 3, 3],
        None,
        [1, 1],
        [0, 0],
        [1, 1],
        2,
        &mut out,
        Products::F32,
    );
    assert!(
        matches!(bad_groups, Err(KernelError::Invalid { .. })),
        "{bad_groups:?}"
    );
    let bad_out = conv2d(
        &x,
        [2, 4, 5, 5],
        &w,
        [3, 4, 3, 3],
        None,
        [1, 1],
        [1, 1],
        [1, 1],
        1,
        &mut out,
        Products::F32,
    );
    assert!(
        matches!(bad_out, Err(KernelError::Length { operand: "out", .. })),
        "{bad_out:?}"
    );
    let bad_bias = conv2d(
        &x,
        [2, 4, 5, 5],
        &w,
        [3, 4, 3, 3],
        Some(&[0.0; 2]),
        [1, 1],
        [0, 0],
        [1, 1],
        1,
        &mut out,
        Products::F32,
    );
    assert!(
        matches!(
            bad_bias,
            Err(KernelError::Length {
                operand: "bias",
                ..
            })
        ),
        "{bad_bias:?}"
    );
    let too_big = conv2d(
        &x,
        [2, 4, 5, 5],
        &w,
        [3, 4, 3, 3],
        None,
        [1, 1],
        [0, 0],
        [3, 3],
        1,
        &mut out,
        Products::F32,
    );
    assert!(
        matches!(too_big, Err(KernelError::Invalid { .. })),
        "{too_big:?}"
    );
    let zero_stride = conv2d(
        &x,
        [2, 4, 5, 5],
        &w,
        [3, 4, 3, 3],
        None,
        [0, 1],
        [0, 0],
        [1, 1],
        1,
        &mut out,
        Products::F32,
    );
    assert!(
        matches!(zero_stride, Err(KernelError::Invalid { .. })),
        "{zero_stride:?}"
    );
}

// ---------------------------------------------------------------------------
// attention
// ---------------------------------------------------------------------------

#[allow(clippy::too_many_arguments)]
fn attention_ref(
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
) -> Vec<f64> {
    let mut out = vec![0.0; bh * sq * dv];
    for h in 0..bh {
        for i in 0..sq {
            let scores: Vec<f64> = (0..skv)
                .map(|j| {
                    let dot: f64 = (0..d)
                        .map(|p| {
                            f64::from(q[(h * sq + i) * d + p]) * f64::from(k[(h * skv + j) * d + p])
                        })
                        .sum();
                    dot * f64::from(scale) + mask.map_or(0.0, |m| f64::from(m[i * skv + j]))
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for e in 0..dv {
                out[(h * sq + i) * dv + e] = (0..skv)
                    .map(|j| weights[j] * f64::from(v[(h * skv + j) * dv + e]))
                    .sum::<f64>()
                    / total;
            }
        }
    }
    out
}

/// A mask with about a fifth of the keys hidden (-inf) and the rest given
/// small offsets; key `i % skv` of row `i` always stays visible.
fn make_mask(sq: usize, skv: usize, seed: u64) -> Vec<f32> {
    let r = random(seed, sq * skv);
    (0..sq * skv)
        .map(|idx| {
            let (i, j) = (idx / skv, idx % skv);
            if r[idx] < -0.6 && j != i % skv {
                f32::NEG_INFINITY
            } else {
                r[idx]
            }
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn check_attention(
    bh: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    mask: Option<&[f32]>,
    seed: u64,
    products: Products,
) {
    let q = random(seed, bh * sq * d)
        .iter()
        .map(|x| 3.0 * x)
        .collect::<Vec<_>>();
    let k = random(seed ^ 1, bh * skv * d);
    let v = random(seed ^ 2, bh * skv * dv);
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![f32::NAN; bh * sq * dv];
    attention(
        &q, &k, &v, mask, bh, sq, skv, d, dv, scale, &mut out, products,
    )
    .expect("attention");
    // On AMX the scores are exact products of rounded q and k; the softmax
    // weights are then rounded too, which moves the output by at most
    // 2⁻⁹ of the largest value.
    let (want, bound) = if products.attention_uses_amx(sq, skv, d) {
        let full = attention_ref(&q, &k, &v, mask, bh, sq, skv, d, dv, scale);
        let e = nmse(&out, &full);
        assert!(e <= BF16_NMSE, "bf16 attention nmse {e:e}");
        let (q, k, v) = (rounded(&q), rounded(&k), rounded(&v));
        let want = attention_ref(&q, &k, &v, mask, bh, sq, skv, d, dv, scale);
        (want, 2.5e-3)
    } else {
        let want = attention_ref(&q, &k, &v, mask, bh, sq, skv, d, dv, scale);
        (want, 2e-6)
    };
    let vmax: Vec<f64> = (0..bh)
        .map(|h| {
            v[h * skv * dv..(h + 1) * skv * dv]
                .iter()
                .fold(0.0f64, |m, &x| m.max(f64::from(x).abs()))
        })
        .collect();
    let err = max_err(&out, &want, |i| vmax[i / (sq * dv)].max(1e-30));
    assert!(
        err <= bound,
        "attention err {err:e} bh={bh} sq={sq} skv={skv} d={d} dv={dv} mask={}",
        mask.is_some()
    );
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn attention_matches_reference(
        bh in 1usize..4, sq in 1usize..150, skv in 1usize..700, d in 1usize..48, dv in 1usize..48,
        masked: bool, seed: u64,
    ) {
        let mask = masked.then(|| make_mask(sq, skv, seed ^ 3));
        check_attention(bh, sq, skv, d, dv, mask.as_deref(), seed, Products::F32);
    }

    /// bf16 on AMX, sizes that take it (d ≥ 8, enough work).
    #[test]
    fn attention_bf16_matches_reference_on_rounded_inputs(
        bh in 1usize..3, sq in 16usize..150, skv in 32usize..1100, d in 8usize..80, dv in 1usize..48,
        masked: bool, seed: u64,
    ) {
        if amx_here() {
            let mask = masked.then(|| make_mask(sq, skv, seed ^ 3));
            check_attention(bh, sq, skv, d, dv, mask.as_deref(), seed, Products::Bf16);
        }
    }
}

#[test]
fn attention_edge_cases() {
    // A row whose first key block is entirely masked, then visible keys.
    let (sq, skv) = (3, 1100);
    let mut mask = vec![0.0f32; sq * skv];
    mask[skv..skv + 1000].fill(f32::NEG_INFINITY);
    check_attention(2, sq, skv, 8, 5, Some(&mask), 9, Products::F32);

    // A fully masked row is NaN, like the plain softmax; other rows are not.
    let mut mask = vec![0.0f32; 2 * 4];
    mask[4..].fill(f32::NEG_INFINITY);
    let (q, k, v) = (random(1, 2 * 3), random(2, 4 * 3), random(3, 4 * 2));
    let mut out = vec![0.0; 2 * 2];
    attention(
        &q,
        &k,
        &v,
        Some(&mask),
        1,
        2,
        4,
        3,
        2,
        0.5,
        &mut out,
        Products::F32,
    )
    .expect("attention");
    assert!(
        out[..2].iter().all(|x| x.is_finite()) && out[2..].iter().all(|x| x.is_nan()),
        "{out:?}"
    );

    // No keys: zeros, as PyTorch gives.
    let mut out = vec![f32::NAN; 2 * 3];
    attention(
        &random(1, 2 * 4),
        &[],
        &[],
        None,
        1,
        2,
        0,
        4,
        3,
        0.5,
        &mut out,
        Products::F32,
    )
    .expect("skv = 0");
    assert_eq!(out, vec![0.0; 6]);

    let err = attention(
        &q,
        &k,
        &v,
        Some(&mask[..7]),
        1,
        2,
        4,
        3,
        2,
        0.5,
        &mut [0.0; 4],
        Products::F32,
    );
    assert!(
        matches!(
            err,
            Err(KernelError::Length {
                operand: "mask",
                ..
            })
        ),
        "{err:?}"
    );
}
