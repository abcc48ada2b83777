//! The tensor graph: what models are made of.
//!
//! Model code *builds* a graph once per shape with [`GraphBuilder`]; nothing
//! computes eagerly. Values live in a typed arena ([`NodeId`] indices, no
//! `Rc` graphs). Every op is shape-checked when it is added, and errors name
//! the op and the shapes. Weights are named graph inputs, bound at run time
//! to tensors from a weight store, so one graph serves every sampling step.
//!
//! The op set is small and matched exhaustively everywhere ([`Op`]): adding
//! an op fails to compile wherever it must be handled.

mod builder;
pub mod reference;
mod weights;

pub use builder::{GraphBuilder, T};
pub use weights::Scope;

use std::fmt;

/// Element types. Compute is f32 on the CPU; f16/bf16 are storage types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
        }
    }
}

/// Index of a node in a [`TensorGraph`]. Each node produces one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// Maximum rank; diffusion models need at most 5 (video latents).
pub const MAX_RANK: usize = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Tanh,
    Sigmoid,
    Silu,
    /// GELU with the tanh approximation.
    GeluTanh,
    /// Exact GELU, 0.5 x (1 + erf(x / sqrt 2)).
    GeluErf,
    /// x * sigmoid(1.702 x), as OpenAI's CLIP.
    QuickGelu,
    Sin,
    Cos,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    /// Biased variance (divides by n), as torch's `var(unbiased=False)`.
    Var,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// Bound to a named tensor of a weight store; constant across runs.
    Weight,
    /// Fed per run (latents, timesteps, text embeddings).
    Activation,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dParams {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UpsampleMode {
    Nearest,
    Bilinear { align_corners: bool },
}

/// What a padded position holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PadMode {
    Constant(f32),
    /// The input mirrored at its edges, the edge itself not repeated
    /// (PyTorch's `reflect`): position −1 reads 1, position n reads n − 2.
    /// Each pad must be smaller than its dimension.
    Reflect,
}

/// Where position `p` of a dimension of size `n` reads under
/// [`PadMode::Reflect`]: `p` itself inside, `−p` before the start,
/// `2(n − 1) − p` past the end (valid for `−n < p < 2n − 1`). The CPU
/// backend and the host image filters share it; the reference evaluator
/// keeps its own, so the conformance suite compares two.
pub fn reflect_index(p: isize, n: usize) -> usize {
    let n = n as isize;
    let q = if p < 0 {
        -p
    } else if p >= n {
        2 * (n - 1) - p
    } else {
        p
    };
    q as usize
}

/// The op set. Elementwise ops broadcast their inputs (numpy rules).
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    Input {
        name: String,
        kind: InputKind,
    },
    /// A scalar constant, broadcast wherever it is used.
    Constant(f32),
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// `where(cond != 0, a, b)`.
    Where,
    Clamp {
        min: f32,
        max: f32,
    },
    Cast(DType),
    Reduce {
        op: ReduceOp,
        axes: Vec<usize>,
        keepdim: bool,
    },
    Softmax {
        axis: usize,
    },
    /// Normalises over the last axis; optional weight and bias inputs.
    LayerNorm {
        eps: f32,
        affine: bool,
    },
    /// NC... input, `groups` groups over channels; optional weight and bias.
    GroupNorm {
        groups: usize,
        eps: f32,
        affine: bool,
    },
    RmsNorm {
        eps: f32,
        affine: bool,
    },
    /// Batched matmul `[..., m, k] x [..., k, n]`, batch dims broadcast.
    MatMul,
    /// NCHW input, OIHW weight, optional bias.
    Conv2d(Conv2dParams),
    Upsample {
        mode: UpsampleMode,
        out_h: usize,
        out_w: usize,
    },
    /// q `[b, h, sq, d]`, k `[b, h, skv, d]`, v `[b, h, skv, dv]`, optional
    /// additive mask broadcastable to `[sq, skv]`.
    Attention {
        scale: f32,
        masked: bool,
    },
    /// Embedding lookup: table `[v, d]`, ids of any shape → `[..ids, d]`.
    Gather,
    Concat {
        axis: usize,
    },
    Pad {
        pads: Vec<(usize, usize)>,
        mode: PadMode,
    },
    // Views: no data movement when the planner can express them as strides.
    Reshape,
    Permute {
        perm: Vec<usize>,
    },
    Slice {
        axis: usize,
        start: usize,
        end: usize,
        step: usize,
    },
    Expand,
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Constant(_) => "constant",
            Op::Unary(_) => "unary",
            Op::Binary(_) => "binary",
            Op::Where => "where",
            Op::Clamp { .. } => "clamp",
            Op::Cast(_) => "cast",
            Op::Reduce { .. } => "reduce",
            Op::Softmax { .. } => "softmax",
            Op::LayerNorm { .. } => "layer_norm",
            Op::GroupNorm { .. } => "group_norm",
            Op::RmsNorm { .. } => "rms_norm",
            Op::MatMul => "matmul",
            Op::Conv2d(_) => "conv2d",
            Op::Upsample { .. } => "upsample",
            Op::Attention { .. } => "attention",
            Op::Gather => "gather",
            Op::Concat { .. } => "concat",
            Op::Pad { .. } => "pad",
            Op::Reshape => "reshape",
            Op::Permute { .. } => "permute",
            Op::Slice { .. } => "slice",
            Op::Expand => "expand",
        }
    }

    /// Pointwise ops: fusable into one generated kernel.
    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Clamp { .. } | Op::Cast(_)
        )
    }

    /// Ops that only re-index their input.
    pub fn is_view(&self) -> bool {
        matches!(
            self,
            Op::Reshape | Op::Permute { .. } | Op::Slice { .. } | Op::Expand
        )
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl Node {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A finished graph: nodes in topological order (every input precedes its
/// user, by construction) and the values the caller wants back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TensorGraph {
    pub nodes: Vec<Node>,
    pub outputs: Vec<NodeId>,
}

impl TensorGraph {
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    /// How many times each node is used as an input (outputs count once).
    pub fn use_counts(&self) -> Vec<usize> {
        let mut c = vec![0; self.nodes.len()];
        for n in &self.nodes {
            for i in &n.inputs {
                c[i.index()] += 1;
            }
        }
        for o in &self.outputs {
            c[o.index()] += 1;
        }
        c
    }

    /// Names and shapes of the graph's inputs of one kind.
    pub fn inputs(&self, kind: InputKind) -> Vec<(NodeId, &str, &[usize])> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| match &n.op {
                Op::Input { name, kind: k } if *k == kind => {
                    Some((NodeId(i as u32), name.as_str(), n.shape.as_slice()))
                }
                _ => None,
            })
            .collect()
    }
}

/// A shape error, naming the op and the shapes involved.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{op}: {message} (input shapes {shapes:?})")]
pub struct ShapeError {
    pub op: &'static str,
    pub message: String,
    pub shapes: Vec<Vec<usize>>,
}

/// numpy broadcasting of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// Row-major strides of a contiguous shape.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}
