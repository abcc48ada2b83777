//! The planner: a pure function from a [`TensorGraph`] to a [`Program`].
//!
//! It decides three things:
//!
//! * **Fusion.** Chains of elementwise ops become one generated kernel,
//!   described as data ([`Expr`]). Elementwise work on the single use of an
//!   anchor op's result (matmul, conv, norms, attention, ...) becomes that
//!   kernel's epilogue (bias, activation, residual add, scale), so
//!   GroupNorm + SiLU or conv + residual are one dispatch.
//! * **Views.** Reshape, permute, slice and expand become strides over an
//!   existing buffer; a copy is inserted only when a kernel needs contiguous
//!   data or a reshape cannot be expressed as strides.
//! * **Activation memory.** Every intermediate buffer gets an offset in one
//!   arena from its lifetime over the kernel schedule (greedy by size, best
//!   fit); [`PlanStats`] reports the peak and the lower bound.
//!
//! Backends only replay Programs; nothing here touches a device.

mod memory;
mod program;
pub mod residency;
pub mod samples;
pub mod schedule;

pub use memory::{assign_offsets, lower_bound, Lifetime};
pub use program::*;

use crate::tensor::{contiguous_strides, NodeId, Op, ShapeError, TensorGraph};
use std::collections::HashMap;

/// Where a node's value lives during planning.
#[derive(Clone, Debug)]
enum Loc {
    /// Stored (or a view of stored data).
    View(View),
    /// A scalar constant, folded into expressions.
    Scalar(f32),
    /// Elementwise, inlined into its single consumer's expression.
    Inline,
    /// An anchor whose result feeds an epilogue; computed by the kernel of
    /// the expression root that absorbs it.
    Absorbed,
}

/// Plans a graph. Fails only on graphs the builder could not have made
/// (inconsistent shapes), naming the op.
pub fn plan(g: &TensorGraph) -> Result<Program, ShapeError> {
    Planner::new(g).run()
}

struct Planner<'g> {
    g: &'g TensorGraph,
    uses: Vec<usize>,
    consumers: Vec<Vec<NodeId>>,
    /// Elementwise nodes inlined into their consumer.
    inline: Vec<bool>,
    /// For an absorbed anchor, the root of the expression that absorbs it.
    absorbed_by: HashMap<NodeId, NodeId>,
    /// For an expression root, the anchor it absorbs.
    absorbs: HashMap<NodeId, NodeId>,
    loc: Vec<Option<Loc>>,
    prog: Program,
}

fn bad(op: &'static str, message: impl Into<String>, shapes: Vec<Vec<usize>>) -> ShapeError {
    ShapeError {
        op,
        message: message.into(),
        shapes,
    }
}

impl<'g> Planner<'g> {
    fn new(g: &'g TensorGraph) -> Self {
        let n = g.nodes.len();
        let mut consumers = vec![Vec::new(); n];
        for (i, node) in g.nodes.iter().enumerate() {
            for inp in &node.inputs {
                consumers[inp.index()].push(NodeId(i as u32));
            }
        }
        let uses = g.use_counts();
        let is_output = |id: usize| g.outputs.iter().any(|o| o.index() == id);
        let single_ew_consumer = |i: usize| -> Option<NodeId> {
            if uses[i] != 1 || is_output(i) {
                return None;
            }
            let c = *consumers[i].first()?;
            let cn = g.node(c);
            (cn.op.is_elementwise() && cn.shape == g.nodes[i].shape).then_some(c)
        };
        let mut inline = vec![false; n];
        for (i, node) in g.nodes.iter().enumerate() {
            if node.op.is_elementwise() && single_ew_consumer(i).is_some() {
                inline[i] = true;
            }
        }
        // The root of an inlined chain: follow single consumers up.
        let root_of = |mut id: NodeId| {
            while inline[id.index()] {
                id = consumers[id.index()][0];
            }
            id
        };
        let mut absorbed_by = HashMap::new();
        let mut absorbs = HashMap::new();
        for (i, node) in g.nodes.iter().enumerate() {
            if !is_anchor(&node.op) {
                continue;
            }
            if let Some(c) = single_ew_consumer(i) {
                let root = root_of(c);
                // One accumulator per kernel: a second anchor feeding the
                // same expression is materialised instead.
                if let std::collections::hash_map::Entry::Vacant(e) = absorbs.entry(root) {
                    e.insert(NodeId(i as u32));
                    absorbed_by.insert(NodeId(i as u32), root);
                }
            }
        }
        Planner {
            g,
            uses,
            consumers,
            inline,
            absorbed_by,
            absorbs,
            loc: vec![None; n],
            prog: Program::default(),
        }
    }

    fn run(mut self) -> Result<Program, ShapeError> {
        for i in 0..self.g.nodes.len() {
            let loc = self.plan_node(NodeId(i as u32))?;
            self.loc[i] = Some(loc);
        }
        let mut outputs = Vec::new();
        for o in &self.g.outputs {
            let mut v = self.materialized(*o, false)?;
            // A window with holes (a crop of an image) is gathered on the
            // device: reading back its whole span would move the holes.
            if v.span() > v.numel() {
                v = self.copy(&v, *o);
            }
            outputs.push(v);
        }
        for (k, v) in outputs.iter().enumerate() {
            self.prog.commands.push(Command::Download {
                view: v.clone(),
                output: k,
            });
        }
        self.prog.outputs = outputs;
        self.prog.finish_memory();
        let _ = (&self.uses, &self.consumers);
        Ok(self.prog)
    }

    fn node_loc(&self, id: NodeId) -> &Loc {
        // Nodes are planned in order and inputs precede users, so every
        // input has a location by the time it is asked for.
        self.loc[id.index()].as_ref().unwrap_or(&Loc::Inline)
    }

    /// The stored view of a node, inserting a copy when `contiguous` is
    /// required and the view is strided.
    fn materialized(&mut self, id: NodeId, contiguous: bool) -> Result<View, ShapeError> {
        let node = self.g.node(id);
        let v = match self.node_loc(id).clone() {
            Loc::View(v) => v,
            Loc::Scalar(c) => {
                // A scalar used where a buffer is needed: fill one.
                let out = self
                    .prog
                    .new_buffer(BufferKind::Arena, node.shape.iter().product());
                let view = View::contiguous(out, &node.shape);
                self.emit(
                    KernelKind::Elementwise,
                    vec![],
                    view.clone(),
                    Some(Expr::Const(c)),
                    vec![id],
                );
                view
            }
            Loc::Inline | Loc::Absorbed => {
                return Err(bad(
                    node.op.name(),
                    "internal: value was fused away but is needed as a buffer",
                    vec![node.shape.clone()],
                ))
            }
        };
        if contiguous && !v.is_contiguous() {
            return Ok(self.copy(&v, id));
        }
        Ok(v)
    }

    fn copy(&mut self, v: &View, id: NodeId) -> View {
        let out = self.prog.new_buffer(BufferKind::Arena, v.numel());
        let view = View::contiguous(out, &v.shape);
        self.emit(
            KernelKind::Elementwise,
            vec![v.clone()],
            view.clone(),
            Some(Expr::Input(0)),
            vec![id],
        );
        view
    }

    fn emit(
        &mut self,
        kind: KernelKind,
        inputs: Vec<View>,
        output: View,
        epilogue: Option<Expr>,
        nodes: Vec<NodeId>,
    ) {
        let k = KernelId(self.prog.kernels.len() as u32);
        self.prog.kernels.push(Kernel {
            kind,
            inputs,
            output,
            epilogue,
            nodes,
        });
        self.prog.commands.push(Command::Dispatch { kernel: k });
    }

    /// Builds the expression of an elementwise root, collecting leaf views.
    fn expr(
        &mut self,
        id: NodeId,
        out_shape: &[usize],
        leaves: &mut Vec<View>,
        fused: &mut Vec<NodeId>,
    ) -> Result<Expr, ShapeError> {
        let node = self.g.node(id);
        let is_acc = self
            .absorbed_by
            .get(&id)
            .is_some_and(|_| matches!(self.node_loc(id), Loc::Absorbed));
        if is_acc {
            return Ok(Expr::Acc);
        }
        match self.node_loc(id).clone() {
            Loc::Scalar(c) => return Ok(Expr::Const(c)),
            Loc::View(v) => {
                let b = v.broadcast_to(out_shape).ok_or_else(|| {
                    bad(
                        "fusion",
                        "operand does not broadcast to the kernel shape",
                        vec![v.shape.clone(), out_shape.to_vec()],
                    )
                })?;
                // The same buffer read the same way is one leaf.
                if let Some(k) = leaves.iter().position(|l| *l == b) {
                    return Ok(Expr::Input(k));
                }
                leaves.push(b);
                return Ok(Expr::Input(leaves.len() - 1));
            }
            Loc::Inline | Loc::Absorbed => {}
        }
        fused.push(id);
        let mut args = Vec::new();
        for inp in node.inputs.clone() {
            args.push(self.expr(inp, out_shape, leaves, fused)?);
        }
        let mut args = args.into_iter();
        let mut next = || args.next().unwrap_or(Expr::Const(0.0));
        Ok(match &node.op {
            Op::Unary(u) => Expr::Unary(*u, Box::new(next())),
            Op::Binary(b) => {
                let a = next();
                Expr::Binary(*b, Box::new(a), Box::new(next()))
            }
            Op::Where => {
                let (c, a) = (next(), next());
                Expr::Where(Box::new(c), Box::new(a), Box::new(next()))
            }
            Op::Clamp { min, max } => Expr::Clamp(Box::new(next()), *min, *max),
            Op::Cast(_) => next(),
            other => {
                return Err(bad(
                    other.name(),
                    "internal: not elementwise",
                    vec![node.shape.clone()],
                ))
            }
        })
    }

    fn plan_node(&mut self, id: NodeId) -> Result<Loc, ShapeError> {
        let node = self.g.node(id).clone();
        let shape = node.shape.clone();
        match &node.op {
            Op::Input { name, kind } => {
                let bk = match kind {
                    crate::tensor::InputKind::Weight => BufferKind::Weight(name.clone()),
                    crate::tensor::InputKind::Activation => BufferKind::Input(name.clone()),
                };
                let b = self.prog.new_buffer(bk.clone(), node.numel());
                let cmd = match bk {
                    BufferKind::Weight(name) => Command::Upload { buffer: b, name },
                    _ => Command::Bind {
                        buffer: b,
                        name: name.clone(),
                    },
                };
                self.prog.commands.push(cmd);
                Ok(Loc::View(View::contiguous(b, &shape)))
            }
            Op::Constant(c) => Ok(Loc::Scalar(*c)),
            op if op.is_elementwise() => {
                if self.inline[id.index()] {
                    return Ok(Loc::Inline);
                }
                let mut leaves = Vec::new();
                let mut fused = Vec::new();
                let expr = self.expr(id, &shape, &mut leaves, &mut fused)?;
                fused.reverse();
                let out = self.prog.new_buffer(BufferKind::Arena, node.numel());
                let view = View::contiguous(out, &shape);
                match self.absorbs.get(&id).copied() {
                    Some(anchor) => {
                        let (kind, inputs) = self.anchor_kernel(anchor)?;
                        let mut all = inputs;
                        let base = all.len();
                        all.extend(leaves);
                        let mut nodes = vec![anchor];
                        nodes.extend(fused);
                        self.emit(
                            kind,
                            all,
                            view.clone(),
                            Some(expr.shift_inputs(base)),
                            nodes,
                        );
                    }
                    None => {
                        self.emit(
                            KernelKind::Elementwise,
                            leaves,
                            view.clone(),
                            Some(expr),
                            fused,
                        );
                    }
                }
                Ok(Loc::View(view))
            }
            Op::Reshape => {
                let v = self.materialized(node.inputs[0], false)?;
                match v.reshape(&shape) {
                    Some(r) => Ok(Loc::View(r)),
                    None => {
                        let c = self.copy(&v, id);
                        Ok(Loc::View(c.reshape(&shape).unwrap_or(c)))
                    }
                }
            }
            Op::Permute { perm } => {
                let v = self.materialized(node.inputs[0], false)?;
                Ok(Loc::View(v.permute(perm)))
            }
            Op::Slice {
                axis, start, step, ..
            } => {
                let v = self.materialized(node.inputs[0], false)?;
                Ok(Loc::View(v.slice(*axis, *start, *step, shape[*axis])))
            }
            Op::Expand => {
                let v = self.materialized(node.inputs[0], false)?;
                let b = v.broadcast_to(&shape).ok_or_else(|| {
                    bad(
                        "expand",
                        "does not broadcast",
                        vec![v.shape.clone(), shape.clone()],
                    )
                })?;
                Ok(Loc::View(b))
            }
            _ => {
                if self.absorbed_by.contains_key(&id) {
                    return Ok(Loc::Absorbed);
                }
                let (kind, inputs) = self.anchor_kernel(id)?;
                let out = self.prog.new_buffer(BufferKind::Arena, node.numel());
                let view = View::contiguous(out, &shape);
                self.emit(kind, inputs, view.clone(), None, vec![id]);
                Ok(Loc::View(view))
            }
        }
    }

    fn views_of(&mut self, ids: &[NodeId]) -> Result<Vec<View>, ShapeError> {
        ids.iter().map(|&i| self.materialized(i, false)).collect()
    }

    /// The kernel kind and input views of an anchor op.
    fn anchor_kernel(&mut self, id: NodeId) -> Result<(KernelKind, Vec<View>), ShapeError> {
        let node = self.g.node(id).clone();
        let shapes = |p: &Self| -> Vec<Vec<usize>> {
            node.inputs
                .iter()
                .map(|i| p.g.node(*i).shape.clone())
                .collect()
        };
        let contiguous_inputs = |p: &mut Self| -> Result<Vec<View>, ShapeError> {
            let ids = node.inputs.clone();
            ids.into_iter().map(|i| p.materialized(i, true)).collect()
        };
        Ok(match &node.op {
            Op::MatMul => {
                let a = self.materialized(node.inputs[0], false)?;
                let b = self.materialized(node.inputs[1], false)?;
                let r = node.shape.len();
                let (m, n) = (node.shape[r - 2], node.shape[r - 1]);
                let k = a.shape[a.shape.len() - 1];
                let batch_shape = node.shape[..r - 2].to_vec();
                let batch: usize = batch_shape.iter().product();
                let prep = |p: &mut Self, v: View, rows: usize, cols: usize, src: NodeId| {
                    let mut full = batch_shape.clone();
                    full.extend([rows, cols]);
                    let bv = v.broadcast_to(&full);
                    match bv.as_ref().and_then(|b| b.batch_stride(batch_shape.len())) {
                        Some(_) => bv.unwrap_or(v),
                        None => {
                            // Batch dims that cannot share one stride: copy
                            // the broadcast operand out.
                            let expanded = bv.unwrap_or(v);
                            p.copy(&expanded, src)
                        }
                    }
                };
                let a = prep(self, a, m, k, node.inputs[0]);
                let b = prep(self, b, k, n, node.inputs[1]);
                (KernelKind::MatMul { batch, m, n, k }, vec![a, b])
            }
            Op::Conv2d(p) => {
                let x = &self.g.node(node.inputs[0]).shape;
                let w = &self.g.node(node.inputs[1]).shape;
                let kind = KernelKind::Conv2d {
                    n: x[0],
                    c: x[1],
                    h: x[2],
                    w: x[3],
                    o: w[0],
                    kh: w[2],
                    kw: w[3],
                    params: *p,
                    bias: node.inputs.len() == 3,
                };
                (kind, contiguous_inputs(self)?)
            }
            Op::GroupNorm {
                groups,
                eps,
                affine,
            } => {
                let s = &node.shape;
                let kind = KernelKind::GroupNorm {
                    n: s[0],
                    c: s[1],
                    spatial: s[2..].iter().product(),
                    groups: *groups,
                    eps: *eps,
                    affine: *affine,
                };
                (kind, contiguous_inputs(self)?)
            }
            Op::LayerNorm { eps, affine } => {
                let cols = *node.shape.last().unwrap_or(&1);
                let kind = KernelKind::LayerNorm {
                    rows: node.numel() / cols,
                    cols,
                    eps: *eps,
                    affine: *affine,
                };
                // Row norms read strided rows (e.g. a channels-last view
                // of an NCHW activation) without a copy dispatch.
                (kind, self.views_of(&node.inputs)?)
            }
            Op::RmsNorm { eps, affine } => {
                let cols = *node.shape.last().unwrap_or(&1);
                let kind = KernelKind::RmsNorm {
                    rows: node.numel() / cols,
                    cols,
                    eps: *eps,
                    affine: *affine,
                };
                (kind, self.views_of(&node.inputs)?)
            }
            Op::Softmax { axis } => {
                let s = &node.shape;
                let kind = KernelKind::Softmax {
                    outer: s[..*axis].iter().product(),
                    len: s[*axis],
                    inner: s[axis + 1..].iter().product(),
                };
                (kind, contiguous_inputs(self)?)
            }
            Op::Reduce { op, axes, .. } => {
                let x = self.g.node(node.inputs[0]).shape.clone();
                let kind = KernelKind::Reduce {
                    op: *op,
                    shape: x,
                    axes: axes.clone(),
                };
                (kind, contiguous_inputs(self)?)
            }
            Op::Attention { scale, masked } => {
                let q = self.g.node(node.inputs[0]).shape.clone();
                let kv = self.g.node(node.inputs[1]).shape[2];
                let kind = KernelKind::Attention {
                    b: q[0],
                    h: q[1],
                    sq: q[2],
                    skv: kv,
                    d: q[3],
                    dv: node.shape[3],
                    scale: *scale,
                    masked: *masked,
                };
                // Attention reads strided q/k/v (e.g. head-permuted views)
                // directly; the mask must be contiguous.
                let mut ins = Vec::new();
                for (j, i) in node.inputs.clone().into_iter().enumerate() {
                    ins.push(self.materialized(i, j == 3)?);
                }
                (kind, ins)
            }
            Op::Gather => {
                let t = self.g.node(node.inputs[0]).shape.clone();
                let kind = KernelKind::Gather {
                    rows: t[0],
                    cols: t[1],
                };
                (kind, contiguous_inputs(self)?)
            }
            Op::Upsample { mode, out_h, out_w } => {
                let x = self.g.node(node.inputs[0]).shape.clone();
                let kind = KernelKind::Upsample {
                    n: x[0],
                    c: x[1],
                    h: x[2],
                    w: x[3],
                    oh: *out_h,
                    ow: *out_w,
                    mode: *mode,
                };
                (kind, contiguous_inputs(self)?)
            }
            Op::Concat { axis } => {
                let ins = node
                    .inputs
                    .clone()
                    .into_iter()
                    .map(|i| self.materialized(i, false))
                    .collect::<Result<Vec<_>, _>>()?;
                let parts = ins.len();
                (KernelKind::Concat { axis: *axis, parts }, ins)
            }
            Op::Pad { pads, mode } => {
                let ins = vec![self.materialized(node.inputs[0], false)?];
                (
                    KernelKind::Pad {
                        pads: pads.clone(),
                        mode: *mode,
                    },
                    ins,
                )
            }
            other => {
                return Err(bad(
                    other.name(),
                    "internal: not an anchor op",
                    shapes(self),
                ))
            }
        })
    }
}

/// Ops that run as their own (hand-written) kernel and may take an
/// elementwise epilogue.
fn is_anchor(op: &Op) -> bool {
    !(op.is_elementwise() || op.is_view() || matches!(op, Op::Input { .. } | Op::Constant(_)))
}

/// Contiguous strides helper re-exported for views.
pub(crate) fn strides_of(shape: &[usize]) -> Vec<usize> {
    contiguous_strides(shape)
}
