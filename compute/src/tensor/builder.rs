//! The builder API: `x.matmul(w)?.add(b)?.silu()` reads like the maths.

use super::BinaryOp;
use super::{
    broadcast_shapes, Conv2dParams, DType, InputKind, Node, NodeId, Op, PadMode, ReduceOp,
    ShapeError, TensorGraph, UnaryOp, UpsampleMode, MAX_RANK,
};
use std::cell::RefCell;

/// Collects nodes. Handles ([`T`]) borrow it, so building reads as method
/// chains; [`GraphBuilder::finish`] returns the plain [`TensorGraph`].
#[derive(Default)]
pub struct GraphBuilder {
    nodes: RefCell<Vec<Node>>,
    /// Inputs by name and kind: asking for one twice gives the same node
    /// (two copies of a model in one graph share their weights).
    named: RefCell<std::collections::HashMap<(String, InputKind), NodeId>>,
    /// Prepended to the names of per-run inputs ([`GraphBuilder::set_input_prefix`]).
    prefix: RefCell<String>,
}

/// A value being built: a node id plus the builder it belongs to.
#[derive(Clone, Copy)]
pub struct T<'a> {
    b: &'a GraphBuilder,
    pub id: NodeId,
}

type R<'a> = Result<T<'a>, ShapeError>;

fn err(op: &'static str, message: impl Into<String>, shapes: &[&[usize]]) -> ShapeError {
    ShapeError {
        op,
        message: message.into(),
        shapes: shapes.iter().map(|s| s.to_vec()).collect(),
    }
}

impl GraphBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    fn push(&self, op: Op, inputs: Vec<NodeId>, shape: Vec<usize>, dtype: DType) -> T<'_> {
        let mut nodes = self.nodes.borrow_mut();
        let id = NodeId(nodes.len() as u32);
        nodes.push(Node {
            op,
            inputs,
            shape,
            dtype,
        });
        T { b: self, id }
    }

    /// A per-run input (latents, timesteps, embeddings).
    pub fn input(&self, name: &str, shape: &[usize]) -> R<'_> {
        self.input_of(name, shape, InputKind::Activation, DType::F32)
    }

    /// A weight, bound by name to a weight store at run time.
    pub fn weight(&self, name: &str, shape: &[usize]) -> R<'_> {
        self.input_of(name, shape, InputKind::Weight, DType::F32)
    }

    pub fn input_of(&self, name: &str, shape: &[usize], kind: InputKind, dtype: DType) -> R<'_> {
        if shape.len() > MAX_RANK || shape.contains(&0) {
            return Err(err(
                "input",
                format!("\"{name}\": rank must be ≤ {MAX_RANK} and sizes positive"),
                &[shape],
            ));
        }
        let name = match kind {
            InputKind::Activation => format!("{}{name}", self.prefix.borrow()),
            InputKind::Weight => name.to_string(),
        };
        let key = (name.clone(), kind);
        if let Some(&id) = self.named.borrow().get(&key) {
            let node = &self.nodes.borrow()[id.index()];
            if node.shape != shape || node.dtype != dtype {
                return Err(err(
                    "input",
                    format!("\"{name}\" is declared twice with different shapes or types"),
                    &[&node.shape, shape],
                ));
            }
            return Ok(T { b: self, id });
        }
        let t = self.push(Op::Input { name, kind }, vec![], shape.to_vec(), dtype);
        self.named.borrow_mut().insert(key, t.id);
        Ok(t)
    }

    /// Prefixes the names of the per-run inputs declared from now on
    /// (weights keep theirs): a second copy of a model in the same graph
    /// takes its own inputs. "" ends it.
    pub fn set_input_prefix(&self, prefix: &str) {
        *self.prefix.borrow_mut() = prefix.to_string();
    }

    pub fn constant(&self, v: f32) -> T<'_> {
        self.push(Op::Constant(v), vec![], vec![], DType::F32)
    }

    pub fn shape(&self, id: NodeId) -> Vec<usize> {
        self.nodes.borrow()[id.index()].shape.clone()
    }

    /// Concatenates along `axis`; all other dims must match.
    pub fn concat<'a>(&'a self, xs: &[T<'a>], axis: usize) -> R<'a> {
        let shapes: Vec<Vec<usize>> = xs.iter().map(|x| x.shape()).collect();
        let refs: Vec<&[usize]> = shapes.iter().map(|s| s.as_slice()).collect();
        let Some(first) = shapes.first() else {
            return Err(err("concat", "needs at least one input", &[]));
        };
        if axis >= first.len() {
            return Err(err("concat", format!("axis {axis} out of range"), &refs));
        }
        let mut out = first.clone();
        out[axis] = 0;
        for s in &shapes {
            let same = s.len() == first.len()
                && s.iter()
                    .zip(first)
                    .enumerate()
                    .all(|(i, (a, b))| i == axis || a == b);
            if !same {
                return Err(err("concat", "shapes differ outside the axis", &refs));
            }
            out[axis] += s[axis];
        }
        Ok(self.push(
            Op::Concat { axis },
            xs.iter().map(|x| x.id).collect(),
            out,
            DType::F32,
        ))
    }

    /// The graph, with `outputs` as the values to return. The builder is
    /// left empty (handles into it must not be used afterwards).
    pub fn finish(&self, outputs: &[T<'_>]) -> TensorGraph {
        let ids = outputs.iter().map(|t| t.id).collect();
        TensorGraph {
            nodes: self.nodes.take(),
            outputs: ids,
        }
    }
}

// `add`, `mul`, ... return `Result` (they check shapes), so the std::ops
// traits, whose outputs cannot fail, do not fit.
#[allow(clippy::should_implement_trait)]
impl<'a> T<'a> {
    pub fn shape(&self) -> Vec<usize> {
        self.b.shape(self.id)
    }

    pub fn rank(&self) -> usize {
        self.shape().len()
    }

    fn unary(self, op: UnaryOp) -> T<'a> {
        self.b
            .push(Op::Unary(op), vec![self.id], self.shape(), DType::F32)
    }

    pub fn neg(self) -> T<'a> {
        self.unary(UnaryOp::Neg)
    }
    pub fn abs(self) -> T<'a> {
        self.unary(UnaryOp::Abs)
    }
    pub fn exp(self) -> T<'a> {
        self.unary(UnaryOp::Exp)
    }
    pub fn log(self) -> T<'a> {
        self.unary(UnaryOp::Log)
    }
    pub fn sqrt(self) -> T<'a> {
        self.unary(UnaryOp::Sqrt)
    }
    pub fn rsqrt(self) -> T<'a> {
        self.unary(UnaryOp::Rsqrt)
    }
    pub fn recip(self) -> T<'a> {
        self.unary(UnaryOp::Recip)
    }
    pub fn tanh(self) -> T<'a> {
        self.unary(UnaryOp::Tanh)
    }
    pub fn sigmoid(self) -> T<'a> {
        self.unary(UnaryOp::Sigmoid)
    }
    pub fn silu(self) -> T<'a> {
        self.unary(UnaryOp::Silu)
    }
    pub fn gelu(self) -> T<'a> {
        self.unary(UnaryOp::GeluTanh)
    }
    pub fn gelu_erf(self) -> T<'a> {
        self.unary(UnaryOp::GeluErf)
    }
    pub fn quick_gelu(self) -> T<'a> {
        self.unary(UnaryOp::QuickGelu)
    }
    pub fn sin(self) -> T<'a> {
        self.unary(UnaryOp::Sin)
    }
    pub fn cos(self) -> T<'a> {
        self.unary(UnaryOp::Cos)
    }

    fn binary(self, op: BinaryOp, other: T<'a>) -> R<'a> {
        let (a, b) = (self.shape(), other.shape());
        let Some(shape) = broadcast_shapes(&a, &b) else {
            return Err(err(
                match op {
                    BinaryOp::Add => "add",
                    BinaryOp::Sub => "sub",
                    BinaryOp::Mul => "mul",
                    BinaryOp::Div => "div",
                    BinaryOp::Pow => "pow",
                    BinaryOp::Max => "maximum",
                    BinaryOp::Min => "minimum",
                },
                "shapes do not broadcast",
                &[&a, &b],
            ));
        };
        Ok(self
            .b
            .push(Op::Binary(op), vec![self.id, other.id], shape, DType::F32))
    }

    pub fn add(self, o: T<'a>) -> R<'a> {
        self.binary(BinaryOp::Add, o)
    }
    pub fn sub(self, o: T<'a>) -> R<'a> {
        self.binary(BinaryOp::Sub, o)
    }
    pub fn mul(self, o: T<'a>) -> R<'a> {
        self.binary(BinaryOp::Mul, o)
    }
    pub fn div(self, o: T<'a>) -> R<'a> {
        self.binary(BinaryOp::Div, o)
    }
    pub fn pow(self, o: T<'a>) -> R<'a> {
        self.binary(BinaryOp::Pow, o)
    }
    pub fn maximum(self, o: T<'a>) -> R<'a> {
        self.binary(BinaryOp::Max, o)
    }
    pub fn minimum(self, o: T<'a>) -> R<'a> {
        self.binary(BinaryOp::Min, o)
    }

    /// Scalar forms cannot fail: a scalar broadcasts to anything.
    pub fn add_scalar(self, v: f32) -> T<'a> {
        let c = self.b.constant(v);
        self.b.push(
            Op::Binary(BinaryOp::Add),
            vec![self.id, c.id],
            self.shape(),
            DType::F32,
        )
    }
    pub fn mul_scalar(self, v: f32) -> T<'a> {
        let c = self.b.constant(v);
        self.b.push(
            Op::Binary(BinaryOp::Mul),
            vec![self.id, c.id],
            self.shape(),
            DType::F32,
        )
    }

    pub fn clamp(self, min: f32, max: f32) -> T<'a> {
        self.b.push(
            Op::Clamp { min, max },
            vec![self.id],
            self.shape(),
            DType::F32,
        )
    }

    pub fn cast(self, dtype: DType) -> T<'a> {
        self.b
            .push(Op::Cast(dtype), vec![self.id], self.shape(), dtype)
    }

    /// `where(self != 0, a, b)`.
    pub fn select(self, a: T<'a>, b: T<'a>) -> R<'a> {
        let (c, sa, sb) = (self.shape(), a.shape(), b.shape());
        let shape = broadcast_shapes(&c, &sa)
            .and_then(|s| broadcast_shapes(&s, &sb))
            .ok_or_else(|| err("where", "shapes do not broadcast", &[&c, &sa, &sb]))?;
        Ok(self
            .b
            .push(Op::Where, vec![self.id, a.id, b.id], shape, DType::F32))
    }

    fn reduce(self, op: ReduceOp, axes: &[usize], keepdim: bool) -> R<'a> {
        let s = self.shape();
        let mut axes = axes.to_vec();
        axes.sort_unstable();
        axes.dedup();
        if axes.is_empty() || axes.iter().any(|&a| a >= s.len()) {
            return Err(err("reduce", format!("bad axes {axes:?}"), &[&s]));
        }
        let shape: Vec<usize> = s
            .iter()
            .enumerate()
            .filter_map(|(i, &d)| {
                if axes.contains(&i) {
                    keepdim.then_some(1)
                } else {
                    Some(d)
                }
            })
            .collect();
        Ok(self.b.push(
            Op::Reduce { op, axes, keepdim },
            vec![self.id],
            shape,
            DType::F32,
        ))
    }

    pub fn sum(self, axes: &[usize], keepdim: bool) -> R<'a> {
        self.reduce(ReduceOp::Sum, axes, keepdim)
    }
    pub fn mean(self, axes: &[usize], keepdim: bool) -> R<'a> {
        self.reduce(ReduceOp::Mean, axes, keepdim)
    }
    pub fn max(self, axes: &[usize], keepdim: bool) -> R<'a> {
        self.reduce(ReduceOp::Max, axes, keepdim)
    }
    pub fn var(self, axes: &[usize], keepdim: bool) -> R<'a> {
        self.reduce(ReduceOp::Var, axes, keepdim)
    }

    pub fn softmax(self, axis: usize) -> R<'a> {
        let s = self.shape();
        if axis >= s.len() {
            return Err(err("softmax", format!("axis {axis} out of range"), &[&s]));
        }
        Ok(self
            .b
            .push(Op::Softmax { axis }, vec![self.id], s, DType::F32))
    }

    fn affine_inputs(
        self,
        op: &'static str,
        len: usize,
        w: Option<T<'a>>,
        b: Option<T<'a>>,
    ) -> Result<Vec<NodeId>, ShapeError> {
        let s = self.shape();
        let mut ids = vec![self.id];
        for p in [w, b].into_iter().flatten() {
            let ps = p.shape();
            if ps != [len] {
                return Err(err(op, format!("weight/bias must be [{len}]"), &[&s, &ps]));
            }
            ids.push(p.id);
        }
        Ok(ids)
    }

    /// Normalises over the last axis.
    pub fn layer_norm(self, w: Option<T<'a>>, b: Option<T<'a>>, eps: f32) -> R<'a> {
        let s = self.shape();
        let last = *s
            .last()
            .ok_or_else(|| err("layer_norm", "scalar input", &[&s]))?;
        if w.is_some() != b.is_some() {
            return Err(err(
                "layer_norm",
                "give both weight and bias or neither",
                &[&s],
            ));
        }
        let inputs = self.affine_inputs("layer_norm", last, w, b)?;
        let affine = inputs.len() == 3;
        Ok(self
            .b
            .push(Op::LayerNorm { eps, affine }, inputs, s, DType::F32))
    }

    /// GroupNorm over an `[n, c, ...]` tensor.
    pub fn group_norm(self, groups: usize, w: Option<T<'a>>, b: Option<T<'a>>, eps: f32) -> R<'a> {
        let s = self.shape();
        if s.len() < 2 || groups == 0 || !s[1].is_multiple_of(groups) {
            return Err(err(
                "group_norm",
                format!("needs [n, c, ...] with c divisible by groups={groups}"),
                &[&s],
            ));
        }
        if w.is_some() != b.is_some() {
            return Err(err(
                "group_norm",
                "give both weight and bias or neither",
                &[&s],
            ));
        }
        let inputs = self.affine_inputs("group_norm", s[1], w, b)?;
        let affine = inputs.len() == 3;
        Ok(self.b.push(
            Op::GroupNorm {
                groups,
                eps,
                affine,
            },
            inputs,
            s,
            DType::F32,
        ))
    }

    pub fn rms_norm(self, w: Option<T<'a>>, eps: f32) -> R<'a> {
        let s = self.shape();
        let last = *s
            .last()
            .ok_or_else(|| err("rms_norm", "scalar input", &[&s]))?;
        let inputs = self.affine_inputs("rms_norm", last, w, None)?;
        let affine = inputs.len() == 2;
        Ok(self
            .b
            .push(Op::RmsNorm { eps, affine }, inputs, s, DType::F32))
    }

    /// `[..., m, k] x [..., k, n]` with broadcast batch dims; a rank-2 right
    /// side (a weight) applies to every batch.
    pub fn matmul(self, o: T<'a>) -> R<'a> {
        let (a, b) = (self.shape(), o.shape());
        if a.len() < 2 || b.len() < 2 {
            return Err(err("matmul", "operands need rank ≥ 2", &[&a, &b]));
        }
        let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
        let (k2, n) = (b[b.len() - 2], b[b.len() - 1]);
        if k != k2 {
            return Err(err(
                "matmul",
                format!("inner sizes differ ({k} vs {k2})"),
                &[&a, &b],
            ));
        }
        let batch = broadcast_shapes(&a[..a.len() - 2], &b[..b.len() - 2])
            .ok_or_else(|| err("matmul", "batch dims do not broadcast", &[&a, &b]))?;
        let mut shape = batch;
        shape.extend([m, n]);
        Ok(self
            .b
            .push(Op::MatMul, vec![self.id, o.id], shape, DType::F32))
    }

    /// `x @ w^T + b` with a PyTorch-layout `[out, in]` weight.
    pub fn linear(self, w: T<'a>, bias: Option<T<'a>>) -> R<'a> {
        let y = self.matmul(w.transpose(0, 1)?)?;
        match bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }

    pub fn conv2d(self, w: T<'a>, bias: Option<T<'a>>, p: Conv2dParams) -> R<'a> {
        let (x, ws) = (self.shape(), w.shape());
        let bad = |m: String| err("conv2d", m, &[&x, &ws]);
        if x.len() != 4 || ws.len() != 4 {
            return Err(bad("needs NCHW input and OIHW weight".into()));
        }
        if p.groups == 0 || x[1] != ws[1] * p.groups || ws[0] % p.groups != 0 {
            return Err(bad(format!(
                "channels: input {} vs weight {} x groups {}",
                x[1], ws[1], p.groups
            )));
        }
        if p.stride.contains(&0) || p.dilation.contains(&0) {
            return Err(bad("stride and dilation must be positive".into()));
        }
        let out_dim = |i: usize, k: usize| -> Option<usize> {
            let eff = p.dilation[i] * (k - 1) + 1;
            let padded = x[2 + i] + 2 * p.padding[i];
            (padded >= eff).then(|| (padded - eff) / p.stride[i] + 1)
        };
        let (Some(oh), Some(ow)) = (out_dim(0, ws[2]), out_dim(1, ws[3])) else {
            return Err(bad("kernel larger than padded input".into()));
        };
        let mut inputs = vec![self.id, w.id];
        if let Some(b) = bias {
            if b.shape() != [ws[0]] {
                return Err(bad(format!("bias must be [{}]", ws[0])));
            }
            inputs.push(b.id);
        }
        Ok(self
            .b
            .push(Op::Conv2d(p), inputs, vec![x[0], ws[0], oh, ow], DType::F32))
    }

    pub fn upsample(self, mode: UpsampleMode, out_h: usize, out_w: usize) -> R<'a> {
        let s = self.shape();
        if s.len() != 4 || out_h == 0 || out_w == 0 {
            return Err(err("upsample", "needs NCHW input and positive size", &[&s]));
        }
        Ok(self.b.push(
            Op::Upsample { mode, out_h, out_w },
            vec![self.id],
            vec![s[0], s[1], out_h, out_w],
            DType::F32,
        ))
    }

    /// Scaled dot-product attention; `self` is q `[b, h, sq, d]`.
    pub fn attention(self, k: T<'a>, v: T<'a>, mask: Option<T<'a>>, scale: f32) -> R<'a> {
        let (q, ks, vs) = (self.shape(), k.shape(), v.shape());
        let ok = q.len() == 4
            && ks.len() == 4
            && vs.len() == 4
            && q[..2] == ks[..2]
            && ks[..3] == vs[..3]
            && q[3] == ks[3];
        if !ok {
            return Err(err(
                "attention",
                "needs q [b,h,sq,d], k [b,h,skv,d], v [b,h,skv,dv]",
                &[&q, &ks, &vs],
            ));
        }
        let mut inputs = vec![self.id, k.id, v.id];
        if let Some(m) = mask {
            let ms = m.shape();
            if ms != [q[2], ks[2]] {
                return Err(err("attention", "mask must be [sq, skv]", &[&q, &ks, &ms]));
            }
            inputs.push(m.id);
        }
        let masked = inputs.len() == 4;
        Ok(self.b.push(
            Op::Attention { scale, masked },
            inputs,
            vec![q[0], q[1], q[2], vs[3]],
            DType::F32,
        ))
    }

    /// Embedding lookup: `self` is the table `[v, d]`.
    pub fn gather(self, ids: T<'a>) -> R<'a> {
        let (t, i) = (self.shape(), ids.shape());
        if t.len() != 2 || i.len() + 1 > MAX_RANK {
            return Err(err("gather", "table must be [v, d]", &[&t, &i]));
        }
        let mut shape = i.clone();
        shape.push(t[1]);
        Ok(self
            .b
            .push(Op::Gather, vec![self.id, ids.id], shape, DType::F32))
    }

    /// Pads each dim by `(before, after)` with `value`.
    pub fn pad(self, pads: &[(usize, usize)], value: f32) -> R<'a> {
        self.pad_with(pads, PadMode::Constant(value))
    }

    /// Pads each dim by mirroring the input at its edges (PyTorch's
    /// `reflect`); each pad must be smaller than its dimension.
    pub fn pad_reflect(self, pads: &[(usize, usize)]) -> R<'a> {
        self.pad_with(pads, PadMode::Reflect)
    }

    fn pad_with(self, pads: &[(usize, usize)], mode: PadMode) -> R<'a> {
        let s = self.shape();
        if pads.len() != s.len() {
            return Err(err("pad", "one (before, after) pair per dim", &[&s]));
        }
        if mode == PadMode::Reflect && s.iter().zip(pads).any(|(&d, &(a, b))| a >= d || b >= d) {
            return Err(err(
                "pad",
                format!("reflect padding {pads:?} must be smaller than each dimension"),
                &[&s],
            ));
        }
        let shape = s.iter().zip(pads).map(|(d, (a, b))| d + a + b).collect();
        Ok(self.b.push(
            Op::Pad {
                pads: pads.to_vec(),
                mode,
            },
            vec![self.id],
            shape,
            DType::F32,
        ))
    }

    pub fn reshape(self, shape: &[usize]) -> R<'a> {
        let s = self.shape();
        if s.iter().product::<usize>() != shape.iter().product::<usize>()
            || shape.len() > MAX_RANK
            || shape.contains(&0)
        {
            return Err(err(
                "reshape",
                format!("cannot reshape to {shape:?}"),
                &[&s],
            ));
        }
        Ok(self
            .b
            .push(Op::Reshape, vec![self.id], shape.to_vec(), DType::F32))
    }

    pub fn permute(self, perm: &[usize]) -> R<'a> {
        let s = self.shape();
        let mut seen = vec![false; s.len()];
        let valid = perm.len() == s.len()
            && perm
                .iter()
                .all(|&p| p < s.len() && !std::mem::replace(&mut seen[p], true));
        if !valid {
            return Err(err("permute", format!("bad permutation {perm:?}"), &[&s]));
        }
        let shape = perm.iter().map(|&p| s[p]).collect();
        Ok(self.b.push(
            Op::Permute {
                perm: perm.to_vec(),
            },
            vec![self.id],
            shape,
            DType::F32,
        ))
    }

    pub fn transpose(self, a: usize, b: usize) -> R<'a> {
        let r = self.rank();
        if a >= r || b >= r {
            return Err(err("transpose", format!("axes {a}, {b}"), &[&self.shape()]));
        }
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    pub fn slice(self, axis: usize, start: usize, end: usize) -> R<'a> {
        self.slice_step(axis, start, end, 1)
    }

    pub fn slice_step(self, axis: usize, start: usize, end: usize, step: usize) -> R<'a> {
        let s = self.shape();
        if axis >= s.len() || start >= end || end > s[axis] || step == 0 {
            return Err(err(
                "slice",
                format!("axis {axis} range {start}..{end} step {step}"),
                &[&s],
            ));
        }
        let mut shape = s.clone();
        shape[axis] = (end - start).div_ceil(step);
        Ok(self.b.push(
            Op::Slice {
                axis,
                start,
                end,
                step,
            },
            vec![self.id],
            shape,
            DType::F32,
        ))
    }

    /// Rotary position embedding as Flux applies it: `self` is
    /// `[b, h, l, d]`, `freqs` is `[b or 1, 1, l, d/2, 2, 2]` flattened to
    /// rank 5 as `[b or 1, l, d/2, 2, 2]` (rotation matrices per pair).
    /// Pairs (x0, x1) become (f00·x0 + f01·x1, f10·x0 + f11·x1). Built from
    /// views and elementwise ops, so it fuses into one kernel plus a concat.
    pub fn rope(self, freqs: T<'a>) -> R<'a> {
        let s = self.shape();
        let f = freqs.shape();
        let bad = |m: &str| err("rope", m.to_string(), &[&s, &f]);
        if s.len() != 4 || !s[3].is_multiple_of(2) {
            return Err(bad("x must be [b, h, l, d] with even d"));
        }
        let (b, h, l, d) = (s[0], s[1], s[2], s[3]);
        if f.len() != 5
            || f[1] != l
            || f[2] != d / 2
            || f[3] != 2
            || f[4] != 2
            || (f[0] != 1 && f[0] != b)
        {
            return Err(bad("freqs must be [b or 1, l, d/2, 2, 2]"));
        }
        // [b, h, l, d/2, 2] pairs; freqs broadcast over heads.
        let x = self
            .reshape(&[b * h, l, d / 2, 2])?
            .reshape(&[b, h, l, d / 2, 2])?;
        let x0 = x.slice(4, 0, 1)?.reshape(&[b, h, l, d / 2])?;
        let x1 = x.slice(4, 1, 2)?.reshape(&[b, h, l, d / 2])?;
        let fb = f[0];
        let coef = |i: usize, j: usize| -> R<'a> {
            freqs
                .slice(3, i, i + 1)?
                .slice(4, j, j + 1)?
                .reshape(&[fb, 1, l, d / 2])
        };
        let y0 = coef(0, 0)?.mul(x0)?.add(coef(0, 1)?.mul(x1)?)?;
        let y1 = coef(1, 0)?.mul(x0)?.add(coef(1, 1)?.mul(x1)?)?;
        let y0 = y0.reshape(&[b, h, l, d / 2, 1])?;
        let y1 = y1.reshape(&[b, h, l, d / 2, 1])?;
        self.b.concat(&[y0, y1], 4)?.reshape(&[b, h, l, d])
    }

    /// Broadcasts to `shape` (numpy rules) without copying.
    pub fn expand(self, shape: &[usize]) -> R<'a> {
        let s = self.shape();
        if broadcast_shapes(&s, shape).as_deref() != Some(shape) {
            return Err(err("expand", format!("cannot expand to {shape:?}"), &[&s]));
        }
        Ok(self
            .b
            .push(Op::Expand, vec![self.id], shape.to_vec(), DType::F32))
    }
}
