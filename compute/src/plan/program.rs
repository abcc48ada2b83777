//! The Program: plain data that backends replay.

use super::memory::{assign_offsets, lower_bound, Lifetime};
use super::strides_of;
use crate::tensor::{BinaryOp, Conv2dParams, NodeId, PadMode, ReduceOp, UnaryOp, UpsampleMode};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelId(pub u32);

/// Where a buffer's storage comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum BufferKind {
    /// An intermediate in the activation arena, at `Buffer::offset`.
    Arena,
    /// A weight, uploaded from the weight store by name.
    Weight(String),
    /// A per-run input, bound by name.
    Input(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    pub kind: BufferKind,
    /// Elements (f32 on the CPU backend).
    pub len: usize,
    /// Element offset in the arena (arena buffers only).
    pub offset: usize,
}

/// A strided window on a buffer: element `i` (multi-index) is at
/// `offset + Σ i[d] * strides[d]`. Stride 0 broadcasts.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct View {
    pub buffer: BufferId,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl View {
    pub fn contiguous(buffer: BufferId, shape: &[usize]) -> View {
        View {
            buffer,
            offset: 0,
            shape: shape.to_vec(),
            strides: strides_of(shape),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Elements from the view's first to its last in its buffer (0 when
    /// empty).
    pub fn span(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        1 + self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| (d - 1) * s)
            .sum::<usize>()
    }

    /// Dense row-major (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let want = strides_of(&self.shape);
        self.shape
            .iter()
            .zip(self.strides.iter().zip(&want))
            .all(|(&d, (s, w))| d == 1 || s == w)
    }

    /// numpy broadcast to `shape` by zero strides.
    pub fn broadcast_to(&self, shape: &[usize]) -> Option<View> {
        if shape.len() < self.shape.len() {
            return None;
        }
        let lead = shape.len() - self.shape.len();
        let mut strides = vec![0; shape.len()];
        for (i, (&d, &s)) in self.shape.iter().zip(&self.strides).enumerate() {
            let t = shape[lead + i];
            strides[lead + i] = if d == t {
                s
            } else if d == 1 {
                0
            } else {
                return None;
            };
        }
        Some(View {
            buffer: self.buffer,
            offset: self.offset,
            shape: shape.to_vec(),
            strides,
        })
    }

    pub fn permute(&self, perm: &[usize]) -> View {
        View {
            buffer: self.buffer,
            offset: self.offset,
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
        }
    }

    pub fn slice(&self, axis: usize, start: usize, step: usize, len: usize) -> View {
        let mut v = self.clone();
        v.offset += start * self.strides[axis];
        v.strides[axis] *= step;
        v.shape[axis] = len;
        v
    }

    /// A reshape as strides, when the view's memory order allows it:
    /// contiguous views always; otherwise by merging and splitting dims
    /// whose strides chain.
    pub fn reshape(&self, shape: &[usize]) -> Option<View> {
        if self.is_contiguous() {
            return Some(View {
                buffer: self.buffer,
                offset: self.offset,
                shape: shape.to_vec(),
                strides: strides_of(shape),
            });
        }
        // Walk old dims from the innermost out, cutting them into chunks
        // that are contiguous among themselves; each chunk must be covered
        // exactly by a run of new dims, which then get strides inside it.
        let (old, old_s) = (&self.shape, &self.strides);
        let mut strides = vec![0; shape.len()];
        let mut view_d = shape.len();
        let mut base = *old_s.last()?;
        let (mut chunk_numel, mut view_numel) = (1usize, 1usize);
        for d in (0..old.len()).rev() {
            chunk_numel *= old[d];
            let chunk_ends = d == 0 || (old[d - 1] != 1 && old_s[d - 1] != chunk_numel * base);
            if chunk_ends {
                while view_d > 0 && (view_numel < chunk_numel || shape[view_d - 1] == 1) {
                    strides[view_d - 1] = view_numel * base;
                    view_numel *= shape[view_d - 1];
                    view_d -= 1;
                }
                if view_numel != chunk_numel {
                    return None;
                }
                if d > 0 {
                    base = old_s[d - 1];
                    chunk_numel = 1;
                    view_numel = 1;
                }
            }
        }
        if view_d != 0 {
            return None;
        }
        Some(View {
            buffer: self.buffer,
            offset: self.offset,
            shape: shape.to_vec(),
            strides,
        })
    }

    /// The single stride of the first `dims` dims when they can be walked
    /// as one flat batch index.
    pub fn batch_stride(&self, dims: usize) -> Option<usize> {
        if dims == 0 {
            return Some(0);
        }
        let nontrivial: Vec<usize> = (0..dims).filter(|&d| self.shape[d] != 1).collect();
        if nontrivial.is_empty() {
            return Some(0);
        }
        if nontrivial.iter().all(|&d| self.strides[d] == 0) {
            return Some(0);
        }
        for w in nontrivial.windows(2) {
            let (a, b) = (w[0], w[1]);
            if self.strides[a] != self.strides[b] * self.shape[b] {
                return None;
            }
        }
        nontrivial.last().map(|&d| self.strides[d])
    }
}

/// A fused kernel's computation, as data: the CPU backend interprets it and
/// the GPU backend turns it into shader code.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// The kernel input with this index, read at the output position.
    Input(usize),
    /// The anchor op's result at the output position (epilogues only).
    Acc,
    Const(f32),
    Unary(UnaryOp, Box<Expr>),
    Binary(BinaryOp, Box<Expr>, Box<Expr>),
    Where(Box<Expr>, Box<Expr>, Box<Expr>),
    Clamp(Box<Expr>, f32, f32),
}

impl Expr {
    /// Renumbers inputs by `base` (epilogue leaves follow anchor inputs).
    pub fn shift_inputs(self, base: usize) -> Expr {
        match self {
            Expr::Input(i) => Expr::Input(i + base),
            Expr::Acc | Expr::Const(_) => self,
            Expr::Unary(u, a) => Expr::Unary(u, Box::new(a.shift_inputs(base))),
            Expr::Binary(b, x, y) => Expr::Binary(
                b,
                Box::new(x.shift_inputs(base)),
                Box::new(y.shift_inputs(base)),
            ),
            Expr::Where(c, a, b) => Expr::Where(
                Box::new(c.shift_inputs(base)),
                Box::new(a.shift_inputs(base)),
                Box::new(b.shift_inputs(base)),
            ),
            Expr::Clamp(a, lo, hi) => Expr::Clamp(Box::new(a.shift_inputs(base)), lo, hi),
        }
    }

    /// Number of ops in the tree (for statistics).
    pub fn ops(&self) -> usize {
        match self {
            Expr::Input(_) | Expr::Acc | Expr::Const(_) => 0,
            Expr::Unary(_, a) | Expr::Clamp(a, _, _) => 1 + a.ops(),
            Expr::Binary(_, a, b) => 1 + a.ops() + b.ops(),
            Expr::Where(c, a, b) => 1 + c.ops() + a.ops() + b.ops(),
        }
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Input(i) => write!(f, "in{i}"),
            Expr::Acc => write!(f, "acc"),
            Expr::Const(c) => write!(f, "{c}"),
            Expr::Unary(u, a) => write!(f, "{}({a})", format!("{u:?}").to_lowercase()),
            Expr::Binary(b, x, y) => write!(f, "{}({x}, {y})", format!("{b:?}").to_lowercase()),
            Expr::Where(c, a, b) => write!(f, "where({c}, {a}, {b})"),
            Expr::Clamp(a, lo, hi) => write!(f, "clamp({a}, {lo}, {hi})"),
        }
    }
}

/// What a kernel computes, before its optional epilogue.
#[derive(Clone, Debug, PartialEq)]
pub enum KernelKind {
    /// Pure generated kernel: the epilogue is the whole computation.
    Elementwise,
    /// inputs: a `[batch.., m, k]`, b `[batch.., k, n]` views (strided).
    MatMul {
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
    },
    /// inputs: x, weight, [bias], all contiguous.
    Conv2d {
        n: usize,
        c: usize,
        h: usize,
        w: usize,
        o: usize,
        kh: usize,
        kw: usize,
        params: Conv2dParams,
        bias: bool,
    },
    GroupNorm {
        n: usize,
        c: usize,
        spatial: usize,
        groups: usize,
        eps: f32,
        affine: bool,
    },
    LayerNorm {
        rows: usize,
        cols: usize,
        eps: f32,
        affine: bool,
    },
    RmsNorm {
        rows: usize,
        cols: usize,
        eps: f32,
        affine: bool,
    },
    Softmax {
        outer: usize,
        len: usize,
        inner: usize,
    },
    Reduce {
        op: ReduceOp,
        shape: Vec<usize>,
        axes: Vec<usize>,
    },
    /// inputs: q, k, v (strided `[b, h, s, d]` views), [mask contiguous].
    Attention {
        b: usize,
        h: usize,
        sq: usize,
        skv: usize,
        d: usize,
        dv: usize,
        scale: f32,
        masked: bool,
    },
    Gather {
        rows: usize,
        cols: usize,
    },
    Upsample {
        n: usize,
        c: usize,
        h: usize,
        w: usize,
        oh: usize,
        ow: usize,
        mode: UpsampleMode,
    },
    /// The first `parts` inputs are concatenated (later inputs are
    /// epilogue leaves).
    Concat {
        axis: usize,
        parts: usize,
    },
    Pad {
        pads: Vec<(usize, usize)>,
        mode: PadMode,
    },
}

impl KernelKind {
    pub fn name(&self) -> &'static str {
        match self {
            KernelKind::Elementwise => "elementwise",
            KernelKind::MatMul { .. } => "matmul",
            KernelKind::Conv2d { .. } => "conv2d",
            KernelKind::GroupNorm { .. } => "group_norm",
            KernelKind::LayerNorm { .. } => "layer_norm",
            KernelKind::RmsNorm { .. } => "rms_norm",
            KernelKind::Softmax { .. } => "softmax",
            KernelKind::Reduce { .. } => "reduce",
            KernelKind::Attention { .. } => "attention",
            KernelKind::Gather { .. } => "gather",
            KernelKind::Upsample { .. } => "upsample",
            KernelKind::Concat { .. } => "concat",
            KernelKind::Pad { .. } => "pad",
        }
    }
}

/// One dispatch: an anchor computation (or none) and an elementwise
/// epilogue over its result, writing one contiguous output.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    pub kind: KernelKind,
    pub inputs: Vec<View>,
    pub output: View,
    pub epilogue: Option<Expr>,
    /// The tensor-graph nodes this kernel computes.
    pub nodes: Vec<NodeId>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Make a weight available on the device.
    Upload {
        buffer: BufferId,
        name: String,
    },
    /// Bind a per-run input.
    Bind {
        buffer: BufferId,
        name: String,
    },
    Dispatch {
        kernel: KernelId,
    },
    /// Read back graph output `output`.
    Download {
        view: View,
        output: usize,
    },
}

/// Planning statistics, in bytes of f32 storage.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlanStats {
    pub dispatches: usize,
    pub fused_ops: usize,
    pub arena_bytes: usize,
    pub peak_bytes: usize,
    pub lower_bound_bytes: usize,
    pub weight_bytes: usize,
    pub input_bytes: usize,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Program {
    pub buffers: Vec<Buffer>,
    pub kernels: Vec<Kernel>,
    pub commands: Vec<Command>,
    pub outputs: Vec<View>,
    pub stats: PlanStats,
}

impl Program {
    pub(super) fn new_buffer(&mut self, kind: BufferKind, len: usize) -> BufferId {
        let id = BufferId(self.buffers.len() as u32);
        self.buffers.push(Buffer {
            kind,
            len,
            offset: 0,
        });
        id
    }

    pub fn buffer(&self, id: BufferId) -> &Buffer {
        &self.buffers[id.0 as usize]
    }

    /// Lifetimes of arena buffers over the kernel schedule, and their
    /// offsets.
    pub(super) fn finish_memory(&mut self) {
        let nk = self.kernels.len();
        let mut first = vec![usize::MAX; self.buffers.len()];
        let mut last = vec![0usize; self.buffers.len()];
        for (k, kern) in self.kernels.iter().enumerate() {
            let b = kern.output.buffer.0 as usize;
            first[b] = first[b].min(k);
            last[b] = last[b].max(k);
            for v in &kern.inputs {
                let b = v.buffer.0 as usize;
                first[b] = first[b].min(k);
                last[b] = last[b].max(k);
            }
        }
        for o in &self.outputs {
            // Outputs live until they are read back after the last kernel.
            last[o.buffer.0 as usize] = nk;
            first[o.buffer.0 as usize] = first[o.buffer.0 as usize].min(nk);
        }
        let mut lifetimes = Vec::new();
        let mut ids = Vec::new();
        for (i, b) in self.buffers.iter().enumerate() {
            if b.kind == BufferKind::Arena && first[i] != usize::MAX {
                lifetimes.push(Lifetime {
                    size: b.len * 4,
                    first: first[i],
                    last: last[i],
                });
                ids.push(i);
            }
        }
        let offsets = assign_offsets(&lifetimes);
        let mut peak = 0;
        for ((&i, lt), &off) in ids.iter().zip(&lifetimes).zip(&offsets) {
            self.buffers[i].offset = off / 4;
            peak = peak.max(off + lt.size);
        }
        self.stats = PlanStats {
            dispatches: nk,
            fused_ops: self.kernels.iter().map(|k| k.nodes.len()).sum(),
            arena_bytes: peak,
            peak_bytes: peak,
            lower_bound_bytes: lower_bound(&lifetimes),
            weight_bytes: self
                .buffers
                .iter()
                .filter(|b| matches!(b.kind, BufferKind::Weight(_)))
                .map(|b| b.len * 4)
                .sum(),
            input_bytes: self
                .buffers
                .iter()
                .filter(|b| matches!(b.kind, BufferKind::Input(_)))
                .map(|b| b.len * 4)
                .sum(),
        };
    }

    /// Dispatches per kernel kind, e.g. `[("conv2d", 2), ("group_norm", 2)]`.
    pub fn kernel_histogram(&self) -> Vec<(&'static str, usize)> {
        let mut h: Vec<(&'static str, usize)> = Vec::new();
        for k in &self.kernels {
            match h.iter_mut().find(|(n, _)| *n == k.kind.name()) {
                Some((_, c)) => *c += 1,
                None => h.push((k.kind.name(), 1)),
            }
        }
        h.sort();
        h
    }
}

fn fmt_view(v: &View) -> String {
    let base = format!("b{}", v.buffer.0);
    if v.is_contiguous() && v.offset == 0 {
        format!("{base}{:?}", v.shape)
    } else {
        format!("{base}+{}{:?}/{:?}", v.offset, v.shape, v.strides)
    }
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.commands {
            match c {
                Command::Upload { buffer, name } => {
                    writeln!(f, "upload  b{} <- weight \"{name}\"", buffer.0)?
                }
                Command::Bind { buffer, name } => {
                    writeln!(f, "bind    b{} <- input \"{name}\"", buffer.0)?
                }
                Command::Dispatch { kernel } => {
                    let k = &self.kernels[kernel.0 as usize];
                    let ins: Vec<String> = k.inputs.iter().map(fmt_view).collect();
                    write!(
                        f,
                        "k{:<4} {} {} <- ({})",
                        kernel.0,
                        k.kind.name(),
                        fmt_view(&k.output),
                        ins.join(", ")
                    )?;
                    if let Some(e) = &k.epilogue {
                        write!(f, " then {e}")?;
                    }
                    let off = self.buffer(k.output.buffer).offset * 4;
                    writeln!(f, "   [arena @{off}]")?;
                }
                Command::Download { view, output } => {
                    writeln!(f, "download out{output} <- {}", fmt_view(view))?
                }
            }
        }
        let s = &self.stats;
        writeln!(
            f,
            "{} dispatches for {} ops; activations peak {} bytes (lower bound {}, ratio {:.3}); weights {} bytes",
            s.dispatches,
            s.fused_ops,
            s.peak_bytes,
            s.lower_bound_bytes,
            if s.lower_bound_bytes > 0 {
                s.peak_bytes as f64 / s.lower_bound_bytes as f64
            } else {
                1.0
            },
            s.weight_bytes
        )
    }
}
