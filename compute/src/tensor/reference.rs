//! A plain, obviously-correct evaluator of tensor graphs: node by node,
//! unfused, contiguous, naive loops with f64 accumulation. It is slow on
//! purpose; the conformance suite compares every backend against it.

use super::{
    broadcast_shapes, contiguous_strides, BinaryOp, Node, Op, PadMode, ReduceOp, TensorGraph,
    UnaryOp, UpsampleMode,
};
use std::collections::HashMap;

/// A contiguous f32 array.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Array {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Array { shape, data }
    }

    /// Element at a broadcast multi-index (missing leading dims and size-1
    /// dims are broadcast).
    fn at_broadcast(&self, idx: &[usize]) -> f32 {
        self.data[self.offset_broadcast(idx)]
    }

    /// The offset of `idx` (right-aligned, size-1 dims broadcast): the
    /// contiguous strides built on the way, without allocating (the suite
    /// calls this once per element and multiply-add).
    fn offset_broadcast(&self, idx: &[usize]) -> usize {
        let off = idx.len() - self.shape.len();
        let (mut o, mut stride) = (0, 1);
        for (i, &d) in self.shape.iter().enumerate().rev() {
            if d != 1 {
                o += idx[off + i] * stride;
            }
            stride *= d;
        }
        o
    }
}

/// Applies one unary op, in f32, as every backend must.
pub fn unary(op: UnaryOp, x: f32) -> f32 {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Abs => x.abs(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Recip => 1.0 / x,
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        UnaryOp::Silu => x / (1.0 + (-x).exp()),
        UnaryOp::GeluTanh => {
            let c = (2.0f32 / std::f32::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }
        UnaryOp::GeluErf => 0.5 * x * (1.0 + erf(x / std::f32::consts::SQRT_2)),
        UnaryOp::QuickGelu => x / (1.0 + (-1.702 * x).exp()),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
    }
}

pub fn binary(op: BinaryOp, a: f32, b: f32) -> f32 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Pow => a.powf(b),
        BinaryOp::Max => a.max(b),
        BinaryOp::Min => a.min(b),
    }
}

/// Maclaurin coefficients of erf(x)·√π/2 in x²: (−1)ⁿ / (n! (2n + 1)).
const ERF_SERIES: [f64; 28] = {
    let mut c = [0.0; 28];
    let mut fact = 1.0;
    let mut n = 0;
    while n < 28 {
        if n > 0 {
            fact *= n as f64;
        }
        let sign = if n % 2 == 0 { 1.0 } else { -1.0 };
        c[n] = sign / (fact * (2 * n + 1) as f64);
        n += 1;
    }
    c
};

/// erf, evaluated in f64 and rounded to f32 (within 1 ulp of the exact
/// value). Below |x| = 2 a Maclaurin series truncated by |x| (Horner in
/// x²); up to 4 a continued fraction for erfc; beyond, ±1 (erfc(4) is under
/// half an f32 ulp of 1). Fast enough for GELU in the CPU backend's
/// elementwise loops.
pub fn erf(x: f32) -> f32 {
    let x = f64::from(x);
    let ax = x.abs();
    let r = if ax < 2.0 {
        let terms = if ax < 0.5 {
            9
        } else if ax < 1.0 {
            14
        } else {
            27
        };
        let x2 = x * x;
        let mut p = ERF_SERIES[terms];
        for c in ERF_SERIES[..terms].iter().rev() {
            p = p * x2 + c;
        }
        x * p * (2.0 / std::f64::consts::PI.sqrt())
    } else if ax < 4.0 {
        // erfc(x) = exp(−x²)/√π · 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + …))))
        let mut f = 0.0;
        for k in (1..40).rev() {
            f = (f64::from(k) / 2.0) / (ax + f);
        }
        let erfc = (-ax * ax).exp() / std::f64::consts::PI.sqrt() / (ax + f);
        (1.0 - erfc).copysign(x)
    } else {
        1f64.copysign(x)
    };
    r as f32
}

fn unravel(mut i: usize, shape: &[usize], out: &mut [usize]) {
    for d in (0..shape.len()).rev() {
        out[d] = i % shape[d];
        i /= shape[d];
    }
}

/// Evaluates the graph. `inputs` maps input names (weights and activations)
/// to arrays of the declared shapes.
pub fn evaluate(g: &TensorGraph, inputs: &HashMap<String, Array>) -> Result<Vec<Array>, String> {
    let mut vals: Vec<Array> = Vec::with_capacity(g.nodes.len());
    for n in &g.nodes {
        let v = eval_node(n, &vals, inputs)?;
        if v.shape != n.shape {
            return Err(format!(
                "{}: produced shape {:?}, declared {:?}",
                n.op.name(),
                v.shape,
                n.shape
            ));
        }
        vals.push(v);
    }
    Ok(g.outputs.iter().map(|o| vals[o.index()].clone()).collect())
}

fn eval_node(n: &Node, vals: &[Array], inputs: &HashMap<String, Array>) -> Result<Array, String> {
    let arg = |i: usize| &vals[n.inputs[i].index()];
    let numel: usize = n.shape.iter().product();
    let mut idx = vec![0; n.shape.len()];
    let pointwise = |f: &dyn Fn(&[usize]) -> f32, idx: &mut Vec<usize>| -> Vec<f32> {
        (0..numel)
            .map(|i| {
                unravel(i, &n.shape, idx);
                f(idx)
            })
            .collect()
    };
    let data: Vec<f32> = match &n.op {
        Op::Input { name, .. } => {
            let a = inputs
                .get(name)
                .ok_or_else(|| format!("input \"{name}\" not bound"))?;
            if a.shape != n.shape {
                return Err(format!(
                    "input \"{name}\" has shape {:?}, graph expects {:?}",
                    a.shape, n.shape
                ));
            }
            a.data.clone()
        }
        Op::Constant(v) => vec![*v],
        Op::Unary(op) => pointwise(&|i| unary(*op, arg(0).at_broadcast(i)), &mut idx),
        Op::Binary(op) => pointwise(
            &|i| binary(*op, arg(0).at_broadcast(i), arg(1).at_broadcast(i)),
            &mut idx,
        ),
        Op::Where => pointwise(
            &|i| {
                if arg(0).at_broadcast(i) != 0.0 {
                    arg(1).at_broadcast(i)
                } else {
                    arg(2).at_broadcast(i)
                }
            },
            &mut idx,
        ),
        Op::Clamp { min, max } => {
            pointwise(&|i| arg(0).at_broadcast(i).max(*min).min(*max), &mut idx)
        }
        Op::Cast(_) => arg(0).data.clone(),
        Op::Reduce { op, axes, .. } => reduce(arg(0), *op, axes),
        Op::Softmax { axis } => softmax(arg(0), *axis),
        Op::LayerNorm { eps, affine } => {
            let x = arg(0);
            let cols = *x.shape.last().unwrap_or(&1);
            let (w, b) = if *affine {
                (Some(&arg(1).data), Some(&arg(2).data))
            } else {
                (None, None)
            };
            norm_rows(&x.data, cols, 1, *eps, w, b, false)
        }
        Op::RmsNorm { eps, affine } => {
            let x = arg(0);
            let cols = *x.shape.last().unwrap_or(&1);
            let w = affine.then(|| &arg(1).data);
            norm_rows(&x.data, cols, 1, *eps, w, None, true)
        }
        Op::GroupNorm {
            groups,
            eps,
            affine,
        } => {
            let x = arg(0);
            let c = x.shape[1];
            let spatial: usize = x.shape[2..].iter().product();
            let per_group = c / groups * spatial;
            let mut out = norm_rows(&x.data, per_group, 1, *eps, None, None, false);
            if *affine {
                let (w, b) = (&arg(1).data, &arg(2).data);
                for (i, v) in out.iter_mut().enumerate() {
                    let ch = (i / spatial) % c;
                    *v = *v * w[ch] + b[ch];
                }
            }
            out
        }
        Op::MatMul => matmul(arg(0), arg(1), &n.shape),
        Op::Conv2d(p) => {
            let (x, w) = (arg(0), arg(1));
            let bias = n.inputs.get(2).map(|b| &vals[b.index()].data);
            conv2d(x, w, bias, p, &n.shape)
        }
        Op::Upsample { mode, out_h, out_w } => upsample(arg(0), *mode, *out_h, *out_w),
        Op::Attention { scale, masked } => {
            let mask = masked.then(|| arg(3));
            attention(arg(0), arg(1), arg(2), mask, *scale)
        }
        Op::Gather => {
            let (t, ids) = (arg(0), arg(1));
            let d = t.shape[1];
            let mut out = Vec::with_capacity(numel);
            for &id in &ids.data {
                let r = id as usize;
                if id < 0.0 || r >= t.shape[0] {
                    return Err(format!("gather: id {id} out of range 0..{}", t.shape[0]));
                }
                out.extend_from_slice(&t.data[r * d..(r + 1) * d]);
            }
            out
        }
        Op::Concat { axis } => {
            let mut out = vec![0.0; numel];
            let mut base = 0;
            let ostr = contiguous_strides(&n.shape);
            for inp in &n.inputs {
                let a = &vals[inp.index()];
                let mut ii = vec![0; a.shape.len()];
                for (k, v) in a.data.iter().enumerate() {
                    unravel(k, &a.shape, &mut ii);
                    let mut o = 0;
                    for d in 0..ii.len() {
                        let c = if d == *axis { ii[d] + base } else { ii[d] };
                        o += c * ostr[d];
                    }
                    out[o] = *v;
                }
                base += a.shape[*axis];
            }
            out
        }
        Op::Pad { pads, mode } => {
            let x = arg(0);
            pointwise(
                &|i| {
                    let mut src = Vec::with_capacity(i.len());
                    for (d, &c) in i.iter().enumerate() {
                        let (before, _) = pads[d];
                        let n = x.shape[d] as isize;
                        let mut p = c as isize - before as isize;
                        if p < 0 || p >= n {
                            match mode {
                                PadMode::Constant(v) => return *v,
                                PadMode::Reflect if p < 0 => p = -p,
                                PadMode::Reflect => p = 2 * (n - 1) - p,
                            }
                        }
                        src.push(p as usize);
                    }
                    x.at_broadcast(&src)
                },
                &mut idx,
            )
        }
        Op::Reshape => arg(0).data.clone(),
        Op::Permute { perm } => {
            let x = arg(0);
            pointwise(
                &|i| {
                    let mut src = vec![0; i.len()];
                    for (d, &p) in perm.iter().enumerate() {
                        src[p] = i[d];
                    }
                    x.at_broadcast(&src)
                },
                &mut idx,
            )
        }
        Op::Slice {
            axis, start, step, ..
        } => {
            let x = arg(0);
            pointwise(
                &|i| {
                    let mut src = i.to_vec();
                    src[*axis] = start + i[*axis] * step;
                    x.at_broadcast(&src)
                },
                &mut idx,
            )
        }
        Op::Expand => pointwise(&|i| arg(0).at_broadcast(i), &mut idx),
    };
    // Constants are scalars; everything else must fill its shape.
    Ok(Array::new(n.shape.clone(), data))
}

fn reduce(x: &Array, op: ReduceOp, axes: &[usize]) -> Vec<f32> {
    let out_shape: Vec<usize> = x
        .shape
        .iter()
        .enumerate()
        .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
        .collect();
    let n_out: usize = out_shape.iter().product();
    let count = (x.data.len() / n_out.max(1)) as f64;
    let mut acc = vec![Vec::<f64>::new(); n_out];
    let ostr = contiguous_strides(&out_shape);
    let mut ii = vec![0; x.shape.len()];
    for (k, v) in x.data.iter().enumerate() {
        unravel(k, &x.shape, &mut ii);
        let o: usize = ii
            .iter()
            .enumerate()
            .map(|(d, &c)| if axes.contains(&d) { 0 } else { c * ostr[d] })
            .sum();
        acc[o].push(f64::from(*v));
    }
    acc.into_iter()
        .map(|vs| {
            let r = match op {
                ReduceOp::Sum => vs.iter().sum(),
                ReduceOp::Mean => vs.iter().sum::<f64>() / count,
                ReduceOp::Max => vs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Var => {
                    let m = vs.iter().sum::<f64>() / count;
                    vs.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / count
                }
            };
            r as f32
        })
        .collect()
}

fn softmax(x: &Array, axis: usize) -> Vec<f32> {
    let s = &x.shape;
    let inner: usize = s[axis + 1..].iter().product();
    let len = s[axis];
    let outer: usize = s[..axis].iter().product();
    let mut out = vec![0.0; x.data.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * len + j) * inner + i;
            let m = (0..len)
                .map(|j| f64::from(x.data[at(j)]))
                .fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = (0..len).map(|j| (f64::from(x.data[at(j)]) - m).exp()).sum();
            for j in 0..len {
                out[at(j)] = ((f64::from(x.data[at(j)]) - m).exp() / sum) as f32;
            }
        }
    }
    out
}

/// Normalises consecutive rows of `cols` values; `rms` skips the mean.
fn norm_rows(
    x: &[f32],
    cols: usize,
    _unused: usize,
    eps: f32,
    w: Option<&Vec<f32>>,
    b: Option<&Vec<f32>>,
    rms: bool,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(cols) {
        let n = row.len() as f64;
        let mean = if rms {
            0.0
        } else {
            row.iter().map(|&v| f64::from(v)).sum::<f64>() / n
        };
        let var = row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        let inv = 1.0 / (var + f64::from(eps)).sqrt();
        for (j, &v) in row.iter().enumerate() {
            let mut y = ((f64::from(v) - mean) * inv) as f32;
            if let Some(w) = w {
                y *= w[j];
            }
            if let Some(b) = b {
                y += b[j];
            }
            out.push(y);
        }
    }
    out
}

fn matmul(a: &Array, b: &Array, out_shape: &[usize]) -> Vec<f32> {
    let r = out_shape.len();
    let (m, n) = (out_shape[r - 2], out_shape[r - 1]);
    let k = a.shape[a.shape.len() - 1];
    let batch_shape = &out_shape[..r - 2];
    let nb: usize = batch_shape.iter().product();
    let mut out = vec![0.0; nb * m * n];
    let mut bi = vec![0; batch_shape.len() + 2];
    for bat in 0..nb {
        unravel(bat, batch_shape, &mut bi[..batch_shape.len()]);
        // Each operand's matrix for this batch index (broadcast where its
        // batch dims are 1 or missing), row-major and contiguous.
        // (`bi` ends in the row and column 0, 0.)
        let (oa, ob) = (a.offset_broadcast(&bi), b.offset_broadcast(&bi));
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f64;
                for p in 0..k {
                    acc += f64::from(a.data[oa + i * k + p]) * f64::from(b.data[ob + p * n + j]);
                }
                out[(bat * m + i) * n + j] = acc as f32;
            }
        }
    }
    out
}

fn conv2d(
    x: &Array,
    w: &Array,
    bias: Option<&Vec<f32>>,
    p: &super::Conv2dParams,
    out_shape: &[usize],
) -> Vec<f32> {
    let (n, c, h, wd) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let (o, cg, kh, kw) = (w.shape[0], w.shape[1], w.shape[2], w.shape[3]);
    let (oh, ow) = (out_shape[2], out_shape[3]);
    let og = o / p.groups;
    let mut out = vec![0.0; n * o * oh * ow];
    for b in 0..n {
        for oc in 0..o {
            let g = oc / og;
            for y in 0..oh {
                for xo in 0..ow {
                    let mut acc = bias.map_or(0.0, |bv| f64::from(bv[oc]));
                    for ic in 0..cg {
                        let ch = g * cg + ic;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (y * p.stride[0] + ky * p.dilation[0]) as isize
                                    - p.padding[0] as isize;
                                let ix = (xo * p.stride[1] + kx * p.dilation[1]) as isize
                                    - p.padding[1] as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xv =
                                    x.data[((b * c + ch) * h + iy as usize) * wd + ix as usize];
                                let wv = w.data[((oc * cg + ic) * kh + ky) * kw + kx];
                                acc += f64::from(xv) * f64::from(wv);
                            }
                        }
                    }
                    out[((b * o + oc) * oh + y) * ow + xo] = acc as f32;
                }
            }
        }
    }
    out
}

fn upsample(x: &Array, mode: UpsampleMode, oh: usize, ow: usize) -> Vec<f32> {
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let mut out = Vec::with_capacity(n * c * oh * ow);
    for plane in 0..n * c {
        let src = &x.data[plane * h * w..(plane + 1) * h * w];
        for y in 0..oh {
            for xo in 0..ow {
                let v = match mode {
                    UpsampleMode::Nearest => {
                        let sy = ((y as f64 * h as f64 / oh as f64).floor() as usize).min(h - 1);
                        let sx = ((xo as f64 * w as f64 / ow as f64).floor() as usize).min(w - 1);
                        src[sy * w + sx]
                    }
                    UpsampleMode::Bilinear { align_corners } => {
                        let coord = |d: usize, i: usize, o: usize| -> f64 {
                            if align_corners {
                                if o > 1 {
                                    d as f64 * (i - 1) as f64 / (o - 1) as f64
                                } else {
                                    0.0
                                }
                            } else {
                                ((d as f64 + 0.5) * i as f64 / o as f64 - 0.5).max(0.0)
                            }
                        };
                        let fy = coord(y, h, oh);
                        let fx = coord(xo, w, ow);
                        let (y0, x0) = (fy.floor() as usize, fx.floor() as usize);
                        let (y1, x1) = ((y0 + 1).min(h - 1), (x0 + 1).min(w - 1));
                        let (ly, lx) = (fy - y0 as f64, fx - x0 as f64);
                        let g = |yy: usize, xx: usize| f64::from(src[yy * w + xx]);
                        ((1.0 - ly) * ((1.0 - lx) * g(y0, x0) + lx * g(y0, x1))
                            + ly * ((1.0 - lx) * g(y1, x0) + lx * g(y1, x1)))
                            as f32
                    }
                };
                out.push(v);
            }
        }
    }
    out
}

fn attention(q: &Array, k: &Array, v: &Array, mask: Option<&Array>, scale: f32) -> Vec<f32> {
    let (b, h, sq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let skv = k.shape[2];
    let dv = v.shape[3];
    let mut out = vec![0.0; b * h * sq * dv];
    for bh in 0..b * h {
        for i in 0..sq {
            let mut scores = vec![0.0f64; skv];
            for (j, s) in scores.iter_mut().enumerate() {
                let mut acc = 0.0f64;
                for t in 0..d {
                    acc += f64::from(q.data[(bh * sq + i) * d + t])
                        * f64::from(k.data[(bh * skv + j) * d + t]);
                }
                *s = acc * f64::from(scale) + mask.map_or(0.0, |m| f64::from(m.data[i * skv + j]));
            }
            let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
            let probs: Vec<f64> = scores.iter().map(|s| (s - mx).exp() / sum).collect();
            for t in 0..dv {
                let mut acc = 0.0f64;
                for (j, p) in probs.iter().enumerate() {
                    acc += p * f64::from(v.data[(bh * skv + j) * dv + t]);
                }
                out[(bh * sq + i) * dv + t] = acc as f32;
            }
        }
    }
    out
}

/// Checks a binary's broadcast (used by tests building inputs).
pub fn broadcastable(a: &[usize], b: &[usize]) -> bool {
    broadcast_shapes(a, b).is_some()
}

#[cfg(test)]
mod erf_tests {
    /// A slow, converged reference: the series to 1e-17 below 2.5, the
    /// continued fraction with 60 terms above.
    fn erf_slow(x: f64) -> f64 {
        if x.abs() < 2.5 {
            let (mut sum, mut term, x2, mut n) = (x, x, x * x, 0.0);
            loop {
                n += 1.0;
                term *= -x2 / n;
                let add = term / (2.0 * n + 1.0);
                sum += add;
                if add.abs() < 1e-17 {
                    break;
                }
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            let ax = x.abs();
            let mut f = 0.0;
            for k in (1..60).rev() {
                f = (f64::from(k) / 2.0) / (ax + f);
            }
            (1.0 - (-ax * ax).exp() / std::f64::consts::PI.sqrt() / (ax + f)).copysign(x)
        }
    }

    #[test]
    fn erf_within_one_ulp() {
        let mut x = -6.0f32;
        while x < 6.0 {
            let want = erf_slow(f64::from(x)) as f32;
            let got = super::erf(x);
            let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
            assert!(ulps <= 1, "erf({x}) = {got}, want {want}");
            x += 0.000_37;
        }
        assert_eq!(super::erf(0.0), 0.0);
        assert_eq!(
            super::erf(1e-30),
            (1e-30f64 * 2.0 / std::f64::consts::PI.sqrt()) as f32
        );
    }
}
