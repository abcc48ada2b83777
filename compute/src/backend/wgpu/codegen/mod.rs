//! WGSL generation: one compute shader per Program kernel.
//!
//! Shapes, strides and offsets are baked in as constants, so each shader is
//! specialised to its kernel (the driver folds the index arithmetic) and the
//! source text itself is the pipeline cache key: a sampling loop that
//! replays one Program compiles every kernel once. Fused elementwise work is
//! generated from the kernel's [`Expr`]: as the whole body of an elementwise
//! kernel, or as the `epi` function anchor kernels apply before each store.

use super::quant::quant_reader;
use attention::attention;
use gemm::SMEM_PAD;
pub use gemm::{tilings, CoopTiles};
use product::{Im2col, Product, Sink, Source};

mod attention;
mod gemm;
mod product;
mod rowwise;
mod units;
pub use super::quant::Quant;
use crate::plan::{Expr, Kernel, KernelKind, View};
use crate::tensor::{contiguous_strides, BinaryOp, PadMode, ReduceOp, UnaryOp, UpsampleMode};
use rowwise::*;
use std::fmt::Write;

/// Threads per workgroup for one-thread-per-element kernels.
pub const WG: u32 = 256;

/// A generated shader and how to launch it.
pub struct Shader {
    pub source: String,
    /// Workgroups along x, y, z.
    pub groups: [u32; 3],
    /// Split kernels ([`Caps::split_k`]): the pass above writes partial
    /// results (products, or a group norm's chunk statistics) into a
    /// scratch binding after the operands, and this second pass (same
    /// bindings) combines them and applies the epilogue.
    pub finish: Option<Finish>,
    /// A pass before the one above (same bindings) that writes the
    /// scratch binding for it: a conv's input copied channels-last
    /// ([`Caps::channels_last`]).
    pub pre: Option<Finish>,
}

impl Shader {
    /// 4-byte words of the scratch binding the kernel's passes share
    /// (after its operands), if it has one.
    pub fn scratch_words(&self) -> Option<usize> {
        self.finish
            .iter()
            .chain(&self.pre)
            .map(|p| p.scratch_elems)
            .max()
    }

    /// The passes in the order they run: (source, workgroups).
    pub fn passes(&self) -> Vec<(&str, [u32; 3])> {
        fn extra(p: &Finish) -> (&str, [u32; 3]) {
            (p.source.as_str(), p.groups)
        }
        self.pre
            .iter()
            .map(extra)
            .chain([(self.source.as_str(), self.groups)])
            .chain(self.finish.iter().map(extra))
            .collect()
    }
}

/// A pass of a kernel besides its main one, sharing its bindings: the
/// second pass of a split kernel, or the first of a channels-last conv.
#[derive(Clone, Debug)]
pub struct Finish {
    pub source: String,
    pub groups: [u32; 3],
    /// 4-byte words the scratch binding holds.
    pub scratch_elems: usize,
}

/// WGSL: `body` for `e = first, first + step, …` below `len`, as a loop
/// with a trip count fixed at compile time (⌈len / step⌉; a guard only
/// where `step` does not divide `len`). Drivers unroll fixed-count loops,
/// so a staging loop issues all its global loads before waiting on the
/// first; `for (e = tid; e < len; e += step)` has a per-thread count.
/// `body` is whole lines, indented for inside the loop.
fn strided(indent: &str, first: &str, len: usize, step: usize, body: &str) -> String {
    strided_as(indent, "e", "se", first, len, step, body)
}

/// [`strided`] with the element named `var`, counted by `counter`.
fn strided_as(
    indent: &str,
    var: &str,
    counter: &str,
    first: &str,
    len: usize,
    step: usize,
    body: &str,
) -> String {
    let trips = len.div_ceil(step);
    let guarded: String;
    let (open, body, close) = if len.is_multiple_of(step) {
        (String::new(), body, String::new())
    } else {
        guarded = body.lines().map(|l| format!("    {l}\n")).collect();
        (
            format!("{indent}    if ({var} < {len}u) {{\n"),
            guarded.as_str(),
            format!("{indent}    }}\n"),
        )
    };
    format!(
        "{indent}for (var {counter} = 0u; {counter} < {trips}u; {counter}++) {{\n{indent}    let {var} = {first} + {counter} * {step}u;\n{open}{body}{close}{indent}}}\n"
    )
}

/// Exact f32 literal: bit pattern, so constants survive formatting and
/// non-finite values are representable.
fn lit(v: f32) -> String {
    format!("bitcast<f32>({}u)", v.to_bits())
}

fn unary(u: UnaryOp, x: &str) -> String {
    match u {
        UnaryOp::Neg => format!("(-({x}))"),
        UnaryOp::Abs => format!("abs({x})"),
        UnaryOp::Exp => format!("exp({x})"),
        UnaryOp::Log => format!("log({x})"),
        UnaryOp::Sqrt => format!("sqrt({x})"),
        UnaryOp::Rsqrt => format!("inverseSqrt({x})"),
        UnaryOp::Recip => format!("(1.0 / ({x}))"),
        UnaryOp::Tanh => format!("tanh_s({x})"),
        UnaryOp::Sigmoid => format!("(1.0 / (1.0 + exp(-({x}))))"),
        UnaryOp::Silu => format!("silu({x})"),
        UnaryOp::GeluTanh => format!("gelu_tanh({x})"),
        UnaryOp::GeluErf => format!("gelu_erf({x})"),
        UnaryOp::QuickGelu => format!("quick_gelu({x})"),
        UnaryOp::Sin => format!("sin({x})"),
        UnaryOp::Cos => format!("cos({x})"),
    }
}

fn binary(b: BinaryOp, x: &str, y: &str) -> String {
    match b {
        BinaryOp::Add => format!("({x} + {y})"),
        BinaryOp::Sub => format!("({x} - {y})"),
        BinaryOp::Mul => format!("({x} * {y})"),
        BinaryOp::Div => format!("({x} / {y})"),
        BinaryOp::Pow => format!("pow({x}, {y})"),
        BinaryOp::Max => format!("max({x}, {y})"),
        BinaryOp::Min => format!("min({x}, {y})"),
    }
}

/// Helper functions every shader may use. `tanh` is evaluated on a clamped
/// argument because some drivers return NaN where exp overflows, and by
/// its Taylor series near 0, where drivers that build it from exp lose
/// relative precision (lavapipe: 2e-5 at x = 0.003); the series' first
/// omitted term is below 1.3e-9 relative for |x| < 0.125.
const PRELUDE: &str = r#"
fn tanh_s(x: f32) -> f32 {
    let c = clamp(x, -15.0, 15.0);
    let c2 = c * c;
    let series = c * (1.0 + c2 * (-0.33333334 + c2 * (0.13333334 + c2 * -0.053968254)));
    return select(tanh(c), series, abs(c) < 0.125);
}
fn silu(x: f32) -> f32 { return x / (1.0 + exp(-x)); }
fn quick_gelu(x: f32) -> f32 { return x / (1.0 + exp(-1.702 * x)); }
fn gelu_tanh(x: f32) -> f32 {
    return 0.5 * x * (1.0 + tanh_s(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
// erf with |error| < 1.2e-7 (W. J. Cody's rational form via erfc for large
// |x|); WGSL has no erf.
fn erf_s(x: f32) -> f32 {
    let a = abs(x);
    let t = 1.0 / (1.0 + 0.5 * a);
    let y = t * exp(-a * a - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418
        + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587
        + t * (-0.82215223 + t * 0.17087277)))))))));
    return sign(x) * (1.0 - y);
}
fn gelu_erf(x: f32) -> f32 { return 0.5 * x * (1.0 + erf_s(x * 0.7071067811865476)); }
"#;

/// WGSL for an expression; `leaf(k)` gives the code reading input k at the
/// current output index.
fn expr(e: &Expr, leaf: &dyn Fn(usize) -> String) -> String {
    match e {
        Expr::Input(k) => leaf(*k),
        Expr::Acc => "acc".into(),
        Expr::Const(c) => lit(*c),
        Expr::Unary(u, a) => unary(*u, &expr(a, leaf)),
        Expr::Binary(b, x, y) => binary(*b, &expr(x, leaf), &expr(y, leaf)),
        Expr::Where(c, a, b) => format!(
            "select({}, {}, ({}) != 0.0)",
            expr(b, leaf),
            expr(a, leaf),
            expr(c, leaf)
        ),
        Expr::Clamp(a, lo, hi) => format!("clamp({}, {}, {})", expr(a, leaf), lit(*lo), lit(*hi)),
    }
}

/// Code for the element offset of `view` at linear index `idx` of `shape`
/// (the view broadcast to it).
fn offset_code(view: &View, shape: &[usize], idx: &str) -> String {
    let Some(v) = view.broadcast_to(shape) else {
        return format!("{}u", view.offset);
    };
    if v.strides == contiguous_strides(shape) {
        return format!("({}u + {idx})", v.offset);
    }
    let inner = contiguous_strides(shape);
    let mut terms = vec![format!("{}u", v.offset)];
    for d in 0..shape.len() {
        if v.strides[d] == 0 || shape[d] == 1 {
            continue;
        }
        let coord = if d == 0 {
            format!("({idx} / {}u)", inner[0])
        } else {
            format!("(({idx} / {}u) % {}u)", inner[d], shape[d])
        };
        terms.push(format!("{coord} * {}u", v.strides[d]));
    }
    format!("({})", terms.join(" + "))
}

/// `fn epi(acc, i)`: the kernel's epilogue at output index `i`.
fn epilogue_fn(k: &Kernel) -> String {
    let shape = &k.output.shape;
    let body = match &k.epilogue {
        None => "acc".to_string(),
        Some(e) => expr(e, &|j| {
            format!("rd{j}({})", offset_code(&k.inputs[j], shape, "i"))
        }),
    };
    format!("fn epi(acc: f32, i: u32) -> f32 {{ return {body}; }}\n")
}

/// Workgroup counts for `threads` one-per-element threads, folding into y
/// past the 65535 limit on x.
fn grid(threads: usize) -> [u32; 3] {
    let groups = threads.div_ceil(WG as usize).max(1) as u32;
    if groups <= 65535 {
        [groups, 1, 1]
    } else {
        [65535, groups.div_ceil(65535), 1]
    }
}

const LINEAR_ID: &str = "let gi = gid.x + gid.y * (nwg.x * 256u);";

/// The first pass of a channels-last conv: its NCHW input (`rd0`, f32 or
/// f16) copied as f16 into the scratch `part`, `[image][pixel][c / 8]`
/// units of 8 channels. A thread per unit; neighbouring threads take
/// neighbouring pixels, so each of a unit's 8 reads coalesces.
fn channels_last_copy(n: usize, c: usize, pixels: usize) -> (String, [u32; 3], usize) {
    let units = n * c / 8 * pixels;
    let mut pack = Vec::new();
    for pair in 0..4 {
        pack.push(format!(
            "pack2x16float(vec2<f32>(rd0(base + {}u), rd0(base + {}u)))",
            2 * pair * pixels,
            (2 * pair + 1) * pixels
        ));
    }
    let body = format!(
        "@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{
    {LINEAR_ID}
    if (gi >= {units}u) {{ return; }}
    let p = gi % {pixels}u; let cu = (gi / {pixels}u) % {cu}u; let b = gi / {per_image}u;
    let base = (b * {c}u + cu * 8u) * {pixels}u + p;
    part[(b * {pixels}u + p) * {cu}u + cu] = vec4<u32>({});
}}
",
        pack.join(", "),
        cu = c / 8,
        per_image = c / 8 * pixels,
    );
    (body, grid(units), units * 4)
}

/// Whether each binding of a kernel with these operands (inputs, then
/// the output; `scratch`: one more after them) is read-only, in binding
/// order: what its bind group layout declares.
pub fn read_only_bindings(operands: &[Operand], scratch: bool) -> Vec<bool> {
    let n = operands.len();
    let mut out = Vec::new();
    for (j, op) in operands.iter().enumerate() {
        let chunks = if op.quant.is_some() { 1 } else { op.chunks };
        out.extend(std::iter::repeat_n(op.read_only && j + 1 < n, chunks));
    }
    if scratch {
        out.push(false);
    }
    out
}

/// How a kernel's passes use the scratch binding `part`.
#[derive(Clone, Copy, Debug)]
enum Scratch {
    /// f32 words: a split kernel's partial results (`part_st`/`part_ld`
    /// for products, direct indexing for group norms).
    Words,
    /// 16-byte units of f16 (a conv's channels-last copy of its input);
    /// a split conv's partial sums follow them from word `partials_at`
    /// (a multiple of 4), each stored as the bits of one component.
    Units { partials_at: Option<usize> },
}

/// How one kernel operand is bound: its element type and, for tensors larger
/// than the device's binding limit, how it is split into several bindings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operand {
    pub f16: bool,
    /// Number of bindings (1 unless the buffer exceeds the binding limit).
    pub chunks: usize,
    /// Elements per binding (all but the last are full).
    pub chunk_elems: usize,
    /// A conv weight stored tap-major, `[out][ky·kw + kx][in / groups]`,
    /// instead of `[out][in / groups][ky][kx]` (see [`conv_taps_first`]).
    pub taps_first: bool,
    /// A GGUF weight bound as its file's quant blocks and decoded where
    /// it is read (one binding; `f16` is false).
    pub quant: Option<Quant>,
    /// Elements the tensor holds, where known: a product may stage a
    /// tensor of whole 16-byte units in units ([`units::Vector`]).
    pub len: Option<usize>,
    /// An input in a buffer no binding of the dispatch writes (a weight,
    /// a per-run input; never the activation arena, which the output is
    /// bound from): declared `read`, so drivers may read it through
    /// their read-only caches.
    pub read_only: bool,
}

impl Operand {
    pub fn whole(f16: bool) -> Self {
        Operand {
            f16,
            chunks: 1,
            chunk_elems: usize::MAX,
            taps_first: false,
            quant: None,
            len: None,
            read_only: false,
        }
    }

    /// The same binding, read-only or not (see [`Operand::read_only`]).
    pub fn reading(self, read_only: bool) -> Self {
        Operand { read_only, ..self }
    }

    /// The same binding, of a tensor of `len` elements.
    pub fn with_len(self, len: usize) -> Self {
        Operand {
            len: Some(len),
            ..self
        }
    }

    /// Elements in one 16-byte unit of this binding (8 f16, 4 f32) where
    /// it is one plain binding of whole units, which a kernel may then
    /// read a unit at a time.
    pub(super) fn unit(&self) -> Option<usize> {
        let width = if self.f16 { 8 } else { 4 };
        (self.chunks == 1 && self.quant.is_none() && self.len.is_some_and(|l| l % width == 0))
            .then_some(width)
    }

    /// A weight bound as its quant blocks, in one binding.
    pub fn quantized(quant: Quant) -> Self {
        Operand {
            quant: Some(quant),
            ..Operand::whole(false)
        }
    }
}

/// Whether a conv with these weights (`taps` = kh·kw) takes them
/// tap-major on the GPU: on cooperative matrices with more than one tap.
/// The product's depth then runs tap by tap, each tap over the input
/// channels, so a depth step of the staged im2col operand (32 channels of
/// one tap) shares one input pixel per output pixel: the pixel's address
/// and padding test are worked out once per step and each staged element
/// is one load `channel · H·W` further on, where the channel-major order
/// divides every element's depth index into (channel, ky, kx).
pub fn conv_taps_first(coop: bool, taps: usize) -> bool {
    coop && taps > 1
}

/// `[out][in][taps]` → `[out][taps][in]` (the tap-major conv weight).
pub fn taps_first_layout(data: &[f32], per_out: usize, taps: usize) -> Vec<f32> {
    let ins = per_out / taps.max(1);
    let mut out = vec![0.0; data.len()];
    for (o, row) in data.chunks(per_out).enumerate() {
        let base = o * per_out;
        for (ci, taps_of) in row.chunks(taps).enumerate() {
            for (t, &v) in taps_of.iter().enumerate() {
                out[base + t * ins + ci] = v;
            }
        }
    }
    out
}

/// A cooperative-matrix (tensor core) configuration the adapter offers:
/// square `tile`×`tile`×`tile` products of f16 inputs into f32
/// accumulators, run by subgroups of exactly `subgroup` lanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coop {
    pub tile: u32,
    pub subgroup: u32,
    /// Fragments emulated in plain WGSL ([`super::emulate`]): the same
    /// kernels on an adapter without cooperative matrices, for tests.
    pub emulated: bool,
}

impl Coop {
    /// A tile extent chosen for 16×16 fragments (a multiple of 16), in
    /// this configuration's elements. Emulated fragments keep the 16×16
    /// kernels' fragment counts (2×2 fragments per subgroup stay 2×2 on
    /// emulated 8×8 ones), so tests on them run the structure tensor cores
    /// run, at the emulation's compile cost per fragment; real 8×8
    /// hardware keeps the extents.
    pub(super) fn extent(&self, elems: usize) -> usize {
        if self.emulated {
            elems * self.tile as usize / 16
        } else {
            elems
        }
    }
}

/// What the adapter lets generated kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Subgroup reductions (`SUBGROUP`).
    pub subgroups: bool,
    /// Matrix products (matmul, conv) on cooperative matrices.
    pub coop: Option<Coop>,
    /// Workgroup memory per workgroup, bytes.
    pub workgroup_memory: u32,
    /// Fixes the cooperative GEMM tiling instead of choosing it by size
    /// (benchmarks compare tilings with it).
    pub gemm_tiles: Option<CoopTiles>,
    /// Cooperative attention in two passes over the keys (max, then sums)
    /// instead of one with per-row rescaling; the conformance suite checks
    /// both forms.
    pub two_pass_attention: bool,
    /// Query tiles (T rows each) per subgroup of single-pass cooperative
    /// attention: 1 (64 queries a workgroup on 16×16 fragments) or 2
    /// (128: each K and V fragment staged and loaded once for twice the
    /// queries, the score and probability tiles twice as large, so key
    /// blocks halve where workgroup memory is short). Tuning tries 2.
    pub attention_tiles: usize,
    /// Cooperative products whose grid would leave most of a large GPU
    /// idle (the deep UNet levels: few output tiles, long depth) split
    /// the depth over several workgroups and sum in a second pass; group
    /// norms with few long rows (a workgroup per group: 32 per image)
    /// split each row's statistics likewise ([`norm_split`]).
    pub split_k: bool,
    /// Staged cooperative products load the next depth step into
    /// registers while multiplying the current one, and cooperative
    /// attention the next key block's K and V while scoring and
    /// accumulating the current one (where both are staged in 16-byte
    /// units); off by default until measured on a GPU (`wgpu_ops`
    /// prints both; tuning tries it).
    pub prefetch: bool,
    /// Staged cooperative products keep two workgroup stages: the next
    /// depth step is staged into one while the other is multiplied, one
    /// barrier a step instead of two (off by default until measured on a
    /// GPU; tuning tries it). Register prefetch, where on, takes
    /// precedence.
    pub double_buffer: bool,
    /// Staged product operands (cooperative and portable kernels) and
    /// attention's K and V that are views of whole 16-byte units are read
    /// a unit at a time ([`units::Vector`]), not element by element (on by
    /// default; off only to compare).
    pub vector_staging: bool,
    /// Cooperative 3×3-style convs (several taps, one group, channels a
    /// multiple of 8) whose input is at most [`CHANNELS_LAST_MAX`]
    /// elements first copy it channels-last as f16 into the scratch
    /// binding, so the im2col operand is staged 8 channels (16 bytes) at a
    /// time instead of element by element (on by default; off to
    /// compare). A split-K conv keeps its partial sums after the copy
    /// ([`Scratch::Units`]).
    pub channels_last: bool,
    /// Cooperative GEMM grids with more than [`gemm::RASTER_ROWS`] block
    /// rows take their blocks in grouped order for L2 reuse (on by
    /// default; off to compare).
    pub raster: bool,
}

/// Input elements up to which a conv copies its input channels-last
/// (64 MiB of f16: a 512² VAE level of 128 channels; the UNet's levels
/// are far smaller).
pub const CHANNELS_LAST_MAX: usize = 32 << 20;

impl Caps {
    /// The portable path: no optional feature, WebGPU's minimum workgroup
    /// memory.
    pub fn plain() -> Self {
        Caps {
            subgroups: false,
            coop: None,
            workgroup_memory: 16384,
            gemm_tiles: None,
            two_pass_attention: false,
            attention_tiles: 1,
            split_k: true,
            prefetch: false,
            double_buffer: false,
            vector_staging: true,
            channels_last: true,
            raster: true,
        }
    }
}

/// Generates the shader for a kernel; `operands` describes each input
/// then the output.
// Each arm sets the launch grid after emitting its source; a late `let`
// keeps the arms' long bodies flat.
#[allow(clippy::needless_late_init)]
pub fn generate(k: &Kernel, operands: &[Operand], caps: &Caps) -> Result<Shader, String> {
    let subgroups = caps.subgroups;
    let n_out = k.output.numel();
    let mut src = String::new();
    src.push_str(PRELUDE);
    src.push_str(&epilogue_fn(k));
    let simple = |body: &str| -> String {
        format!(
            "@compute @workgroup_size(256)\nfn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{\n    {LINEAR_ID}\n    if (gi >= {n_out}u) {{ return; }}\n{body}\n}}\n"
        )
    };
    let groups;
    // The split-K second pass's body, grid and scratch size.
    let mut finish: Option<(String, [u32; 3], usize)> = None;
    // Likewise a first pass (a conv's channels-last copy).
    let mut pre: Option<(String, [u32; 3], usize)> = None;
    match &k.kind {
        KernelKind::Elementwise => {
            src.push_str(&simple("    wr(gi, epi(0.0, gi));"));
            groups = grid(n_out);
        }
        KernelKind::MatMul { batch, m, n, k: kk } => {
            let view = |input: usize| -> Result<Source, String> {
                let v = &k.inputs[input];
                let r = v.shape.len();
                let batch = v
                    .batch_stride(r - 2)
                    .ok_or("matmul operand batch dims are not uniformly strided")?;
                Ok(Source::View {
                    input,
                    offset: v.offset,
                    batch,
                    row: v.strides[r - 2],
                    col: v.strides[r - 1],
                })
            };
            let product = Product {
                m: *m,
                n: *n,
                k: *kk,
                batch: *batch,
                a: view(0)?,
                b: view(1)?,
                out: Sink::Dense {
                    rows: *m,
                    cols: *n,
                    plain: k.epilogue.is_none(),
                },
            };
            let (code, tiles, split) = product.emit(operands, caps)?;
            src.push_str(&code);
            groups = tiles;
            finish = split;
        }
        KernelKind::Conv2d {
            n,
            c,
            h,
            w,
            o,
            kh,
            kw,
            params,
            bias,
        } => {
            let g = params.groups;
            let (cg, og) = (c / g, o / g);
            let eff_h = params.dilation[0] * (kh - 1) + 1;
            let eff_w = params.dilation[1] * (kw - 1) + 1;
            let oh = (h + 2 * params.padding[0] - eff_h) / params.stride[0] + 1;
            let ow = (w + 2 * params.padding[1] - eff_w) / params.stride[1] + 1;
            // GEMM per (image, group): rows = output channels of the group,
            // cols = output pixels, depth = input channels x kernel taps.
            // Weights are [out][in x taps] (depth contiguous, in either
            // order); the implicit im2col operand walks pixels contiguously.
            let taps_first = operands.get(1).is_some_and(|o| o.taps_first);
            let product = |channels_last: bool| Product {
                m: og,
                n: oh * ow,
                k: cg * kh * kw,
                batch: n * g,
                a: Source::ConvWeights {
                    input: 1,
                    groups: g,
                    per_group: og,
                    depth: cg * kh * kw,
                },
                b: Source::Im2col(Im2col {
                    input: 0,
                    groups: g,
                    channels: *c,
                    per_group: cg,
                    h: *h,
                    w: *w,
                    out_w: ow,
                    kw: *kw,
                    taps: kh * kw,
                    params: *params,
                    taps_first,
                    channels_last,
                }),
                out: Sink::Conv {
                    groups: g,
                    per_group: og,
                    channels: *o,
                    pixels: oh * ow,
                    bias: bias.then_some(2),
                },
            };
            // Channels-last needs the tap-major depth (a unit of 8
            // channels then lies within one tap). A split conv keeps its
            // partial sums in the scratch after the copy.
            let channels_last = caps.coop.is_some()
                && caps.channels_last
                && caps.vector_staging
                && g == 1
                && taps_first
                && c.is_multiple_of(8)
                && n * c * h * w <= CHANNELS_LAST_MAX;
            let (code, tiles, split) = product(channels_last).emit(operands, caps)?;
            src.push_str(&code);
            groups = tiles;
            finish = split;
            if channels_last {
                let copy = channels_last_copy(*n, *c, h * w);
                if let Some(f) = &mut finish {
                    f.2 += copy.2;
                }
                pre = Some(copy);
            }
        }
        KernelKind::GroupNorm {
            n,
            c,
            spatial,
            groups: gr,
            eps,
            affine,
        } => {
            let per = c / gr * spatial;
            let affine = if *affine {
                Affine::Channels {
                    spatial: *spatial,
                    channels: *c,
                }
            } else {
                Affine::None
            };
            let rows = n * gr;
            if let Some((chunks, clen)) = norm_split(rows, per).filter(|_| caps.split_k) {
                // Few long rows (the VAE's and the UNet's outer levels):
                // each row's statistics in chunks over many workgroups,
                // then the normalisation on the same grid.
                let norm = SplitNorm {
                    rows,
                    per,
                    chunks,
                    clen,
                    eps: *eps,
                    affine,
                };
                let total = rows * chunks;
                let grid2 = [total.min(65535) as u32, total.div_ceil(65535) as u32, 1];
                src.push_str(&norm.stats_wgsl(subgroups));
                groups = grid2;
                finish = Some((norm.apply_wgsl(subgroups), grid2, 2 * total));
            } else {
                let norm = RowNorm {
                    rows,
                    len: per,
                    viewed: false,
                    center: true,
                    eps: *eps,
                    affine,
                };
                src.push_str(&norm.wgsl(subgroups));
                groups = [(n * gr) as u32, 1, 1];
            }
        }
        KernelKind::LayerNorm {
            rows,
            cols,
            eps,
            affine,
        }
        | KernelKind::RmsNorm {
            rows,
            cols,
            eps,
            affine,
        } => {
            let rms = matches!(k.kind, KernelKind::RmsNorm { .. });
            src.push_str(&format!(
                "fn off0(i: u32) -> u32 {{ return {}; }}\n",
                offset_code(&k.inputs[0], &k.inputs[0].shape, "i")
            ));
            let norm = RowNorm {
                rows: *rows,
                len: *cols,
                viewed: true,
                center: !rms,
                eps: *eps,
                affine: if *affine {
                    Affine::Columns { bias: !rms }
                } else {
                    Affine::None
                },
            };
            src.push_str(&norm.wgsl(subgroups));
            if *rows > 65535 * 65535 {
                return Err("too many rows".into());
            }
            groups = [(*rows).min(65535) as u32, rows.div_ceil(65535) as u32, 1];
        }
        KernelKind::Softmax { outer, len, inner } => {
            let rows = outer * inner;
            let softmax = Softmax {
                rows,
                len: *len,
                inner: *inner,
            };
            src.push_str(&softmax.wgsl(subgroups));
            groups = [rows.min(65535) as u32, rows.div_ceil(65535) as u32, 1];
        }
        KernelKind::Reduce { op, shape, axes } => {
            let strides = contiguous_strides(shape);
            let kept: Vec<usize> = (0..shape.len()).filter(|d| !axes.contains(d)).collect();
            let red: Vec<usize> = axes.clone();
            let count: usize = red.iter().map(|&d| shape[d]).product();
            // Output index → base offset over kept dims.
            let mut base = vec!["0u".to_string()];
            let kept_shape: Vec<usize> = kept.iter().map(|&d| shape[d]).collect();
            let ks = contiguous_strides(&kept_shape);
            for (j, &d) in kept.iter().enumerate() {
                base.push(format!(
                    "((gi / {}u) % {}u) * {}u",
                    ks[j], shape[d], strides[d]
                ));
            }
            let red_shape: Vec<usize> = red.iter().map(|&d| shape[d]).collect();
            let rs = contiguous_strides(&red_shape);
            let mut roff = vec!["0u".to_string()];
            for (j, &d) in red.iter().enumerate() {
                roff.push(format!(
                    "((r / {}u) % {}u) * {}u",
                    rs[j], shape[d], strides[d]
                ));
            }
            let (init, step, fin) = match op {
                ReduceOp::Sum => ("0.0", "acc1 = acc1 + x;", "acc1"),
                ReduceOp::Mean => ("0.0", "acc1 = acc1 + x;", "acc1 / f32(COUNT)"),
                ReduceOp::Max => ("-3.4028235e38", "acc1 = max(acc1, x);", "acc1"),
                ReduceOp::Var => (
                    "0.0",
                    "let d = x - mean; acc1 = acc1 + d * d;",
                    "acc1 / f32(COUNT)",
                ),
            };
            let mean_pass = if matches!(op, ReduceOp::Var) {
                format!(
                    "    var s = 0.0;\n    for (var r = 0u; r < {count}u; r++) {{ s = s + rd0(base + {}); }}\n    let mean = s / f32({count}u);\n",
                    roff.join(" + ")
                )
            } else {
                String::new()
            };
            let body = format!(
                "    let base = {};\n{mean_pass}    var acc1: f32 = {init};\n    for (var r = 0u; r < {count}u; r++) {{ let x = rd0(base + {}); {step} }}\n    wr(gi, epi({}, gi));",
                base.join(" + "),
                roff.join(" + "),
                fin.replace("COUNT", &format!("{count}u"))
            );
            src.push_str(&simple(&body));
            groups = grid(n_out);
        }
        KernelKind::Attention {
            b,
            h,
            sq,
            skv,
            d,
            dv,
            scale,
            masked,
        } => {
            let off = |v: &View, name: &str| -> String {
                // [b, h, s, t] strides.
                format!(
                    "fn {name}(bh: u32, s: u32, t: u32) -> u32 {{ return {}u + (bh / {h}u) * {}u + (bh % {h}u) * {}u + s * {}u + t * {}u; }}\n",
                    v.offset, v.strides[0], v.strides[1], v.strides[2], v.strides[3]
                )
            };
            src.push_str(&off(&k.inputs[0], "q_off"));
            src.push_str(&off(&k.inputs[1], "k_off"));
            src.push_str(&off(&k.inputs[2], "v_off"));
            // K and V in 16-byte units where their views allow (a
            // dimension of one takes any stride).
            let unit = |j: usize, width: usize| -> Option<usize> {
                let v = &k.inputs[j];
                let w = operands.get(j)?.unit()?;
                let whole = |x: usize| x.is_multiple_of(w);
                let strided = v.strides[..3]
                    .iter()
                    .zip(&v.shape[..3])
                    .all(|(&s, &n)| n == 1 || whole(s));
                (caps.vector_staging
                    && v.strides[3] == 1
                    && whole(v.offset)
                    && whole(width)
                    && strided)
                    .then_some(w)
            };
            let units = [None, unit(1, *d), unit(2, *dv)];
            let (code, tiles) =
                attention(*b * *h, *sq, *skv, *d, *dv, *scale, *masked, caps, units);
            src.push_str(&code);
            groups = tiles;
        }
        KernelKind::Gather { rows, cols } => {
            let body = format!(
                "    let r = gi / {cols}u; let col = gi % {cols}u;\n    let id = min(u32(max(rd1(r), 0.0)), {}u);\n    wr(gi, epi(rd0(id * {cols}u + col), gi));",
                rows - 1
            );
            src.push_str(&simple(&body));
            groups = grid(n_out);
        }
        KernelKind::Upsample {
            c,
            h,
            w,
            oh,
            ow,
            mode,
            ..
        } => {
            let head = format!(
                "    let x = gi % {ow}u; let y = (gi / {ow}u) % {oh}u; let plane = gi / {ohw}u;\n    let base = plane * {hw}u;\n",
                ohw = oh * ow,
                hw = h * w
            );
            let _ = c;
            let body = match mode {
                UpsampleMode::Nearest => format!(
                    "{head}    let sy = min(u32(floor(f32(y) * (f32({h}u) / f32({oh}u)))), {hm}u);\n    let sx = min(u32(floor(f32(x) * (f32({w}u) / f32({ow}u)))), {wm}u);\n    wr(gi, epi(rd0(base + sy * {w}u + sx), gi));",
                    hm = h - 1,
                    wm = w - 1
                ),
                UpsampleMode::Bilinear { align_corners } => {
                    let src_coord = |d: &str, i: usize, o: usize| -> String {
                        if *align_corners {
                            if o > 1 {
                                format!("f32({d}) * (f32({}u) / f32({}u))", i - 1, o - 1)
                            } else {
                                "0.0".into()
                            }
                        } else {
                            format!("max((f32({d}) + 0.5) * (f32({i}u) / f32({o}u)) - 0.5, 0.0)")
                        }
                    };
                    format!(
                        "{head}    let fy = {}; let fx = {};
    let y0 = min(u32(floor(fy)), {hm}u); let x0 = min(u32(floor(fx)), {wm}u);
    let y1 = min(y0 + 1u, {hm}u); let x1 = min(x0 + 1u, {wm}u);
    let ly = fy - f32(y0); let lx = fx - f32(x0);
    let v = (1.0 - ly) * ((1.0 - lx) * rd0(base + y0 * {w}u + x0) + lx * rd0(base + y0 * {w}u + x1))
          + ly * ((1.0 - lx) * rd0(base + y1 * {w}u + x0) + lx * rd0(base + y1 * {w}u + x1));
    wr(gi, epi(v, gi));",
                        src_coord("y", *h, *oh),
                        src_coord("x", *w, *ow),
                        hm = h - 1,
                        wm = w - 1
                    )
                }
            };
            src.push_str(&simple(&body));
            groups = grid(n_out);
        }
        KernelKind::Concat { axis, parts } => {
            let shape = &k.output.shape;
            let inner: usize = shape[axis + 1..].iter().product();
            let len = shape[*axis];
            let anchors = *parts;
            let mut body = format!(
                "    let inner = gi % {inner}u; let a = (gi / {inner}u) % {len}u; let outer = gi / {};\n    var v = 0.0;\n",
                len * inner
            );
            let mut start = 0;
            for (j, view) in k.inputs.iter().take(anchors).enumerate() {
                let part = view.shape[*axis];
                let idx = format!("((outer * {part}u + (a - {start}u)) * {inner}u + inner)");
                let _ = writeln!(
                    body,
                    "    if (a >= {start}u && a < {}u) {{ v = rd{j}({}); }}",
                    start + part,
                    offset_code(view, &view.shape, &idx)
                );
                start += part;
            }
            body.push_str("    wr(gi, epi(v, gi));");
            src.push_str(&simple(&body));
            groups = grid(n_out);
        }
        KernelKind::Pad { pads, mode } => {
            let shape = &k.output.shape;
            let ins = &k.inputs[0].shape;
            let os = contiguous_strides(shape);
            let is = contiguous_strides(ins);
            let mut body = String::from("    var inside = true; var src = 0u;\n");
            for d in 0..shape.len() {
                // Reflecting: −c before the start, 2(n − 1) − c past the
                // end (pads are below the dimension: one reflection lands
                // inside).
                let outside = match mode {
                    PadMode::Constant(_) => "inside = false;".to_string(),
                    PadMode::Reflect => format!(
                        "src = src + u32(select(2 * {} - c, -c, c < 0)) * {}u;",
                        ins[d] - 1,
                        is[d]
                    ),
                };
                let _ = writeln!(
                    body,
                    "    {{ let c = i32((gi / {}u) % {}u) - {}; if (c < 0 || c >= {}) {{ {outside} }} else {{ src = src + u32(c) * {}u; }} }}",
                    os[d], shape[d], pads[d].0, ins[d], is[d]
                );
            }
            let fill = match mode {
                PadMode::Constant(v) => lit(*v),
                PadMode::Reflect => lit(0.0),
            };
            let _ = writeln!(
                body,
                "    var v = {fill};\n    if (inside) {{ v = rd0({}); }}\n    wr(gi, epi(v, gi));",
                offset_code(&k.inputs[0], ins, "src")
            );
            src.push_str(&simple(&body));
            groups = grid(n_out);
        }
    }
    if operands.len() != k.inputs.len() + 1 {
        return Err(format!(
            "{} operand layouts for {} inputs and an output",
            operands.len(),
            k.inputs.len()
        ));
    }
    // The scratch: f32 partial results for a second pass, f16 units a
    // first pass writes, or both (the units first).
    let scratch = match (&finish, &pre) {
        (Some(_), None) => Some(Scratch::Words),
        (finish, Some(copy)) => Some(Scratch::Units {
            partials_at: finish.as_ref().map(|_| copy.2),
        }),
        (None, None) => None,
    };
    let source = bind(&src, k.inputs.len(), operands, caps, scratch)?;
    let pass =
        |(body, groups, scratch_elems): (String, [u32; 3], usize)| -> Result<Finish, String> {
            Ok(Finish {
                source: bind(
                    &format!("{PRELUDE}{}{body}", epilogue_fn(k)),
                    k.inputs.len(),
                    operands,
                    caps,
                    scratch,
                )?,
                groups,
                scratch_elems,
            })
        };
    Ok(Shader {
        source,
        groups,
        finish: finish.map(pass).transpose()?,
        pre: pre.map(pass).transpose()?,
    })
}

/// A kernel body made a complete shader: the bindings of its operands
/// (and of the split-K scratch `part`, after them), their accessors, and
/// emulated fragments where the caps ask for them.
fn bind(
    src: &str,
    n_inputs: usize,
    operands: &[Operand],
    caps: &Caps,
    scratch: Option<Scratch>,
) -> Result<String, String> {
    // The kernels read input `j` through `rd{j}(i)` and store through
    // `wr(i, v)`, defined here: they widen f16 storage to f32 (arithmetic
    // stays f32), decode quantized blocks and pick the binding of a
    // tensor split over several.
    let mut head = String::new();
    let coop = src.contains("coop_mat");
    if coop || operands.iter().any(|o| o.f16) {
        head.push_str("enable f16;\n");
    }
    if coop {
        head.push_str("enable wgpu_cooperative_matrix;\n");
    }
    // Subgroup builtins need the device's SUBGROUP feature; naga takes no
    // `enable subgroups;` directive yet.
    let mut binding = 0;
    for (j, op) in operands.iter().enumerate() {
        let is_out = j == n_inputs;
        let access = if op.read_only && !is_out {
            "read"
        } else {
            "read_write"
        };
        let name = if is_out {
            "dst".to_string()
        } else {
            format!("in{j}")
        };
        if let Some(q) = op.quant.filter(|_| !is_out) {
            if op.chunks != 1 {
                return Err(format!("quantized operand {j} is split over bindings"));
            }
            let _ = writeln!(
                head,
                "@group(0) @binding({binding}) var<storage, {access}> {name}_0: array<u32>;"
            );
            binding += 1;
            head.push_str(&quant_reader(j, q)?);
            continue;
        }
        let ty = if op.f16 { "f16" } else { "f32" };
        // A product that stages this input in 16-byte units reads it
        // through `vld{j}(unit)`: the binding is declared as units, and
        // single elements are taken out of them.
        if !is_out && src.contains(&format!("vld{j}(")) {
            if op.unit().is_none() {
                return Err(format!(
                    "operand {j} is read in 16-byte units but is not bound as whole units"
                ));
            }
            let (unit, rd) = if op.f16 {
                (
                    "vec4<u32>",
                    format!("let w = {name}_0[i / 8u][(i / 2u) % 4u]; return unpack2x16float(w)[i % 2u];"),
                )
            } else {
                ("vec4<f32>", format!("return {name}_0[i / 4u][i % 4u];"))
            };
            let _ = writeln!(
                head,
                "@group(0) @binding({binding}) var<storage, {access}> {name}_0: array<{unit}>;
fn vld{j}(u: u32) -> {unit} {{ return {name}_0[u]; }}
fn rd{j}(i: u32) -> f32 {{ {rd} }}"
            );
            binding += 1;
            continue;
        }
        for c in 0..op.chunks {
            let _ = writeln!(
                head,
                "@group(0) @binding({binding}) var<storage, {access}> {name}_{c}: array<{ty}>;"
            );
            binding += 1;
        }
        // Chunk selection; a single chunk compiles to a plain access.
        let mut access = String::new();
        for c in 0..op.chunks {
            let lo = c * op.chunk_elems;
            let stmt = if is_out {
                format!("{{ {name}_{c}[i - {lo}u] = {ty}(v); return; }}")
            } else {
                format!("{{ return f32({name}_{c}[i - {lo}u]); }}")
            };
            if c + 1 == op.chunks {
                let _ = write!(access, "{stmt}");
            } else {
                let hi = (c + 1) * op.chunk_elems;
                let _ = write!(access, "if (i < {hi}u) {stmt} ");
            }
        }
        if is_out {
            let _ = writeln!(head, "fn wr(i: u32, v: f32) {{ {access} }}");
        } else {
            let _ = writeln!(head, "fn rd{j}(i: u32) -> f32 {{ {access} }}");
        }
    }
    match scratch {
        Some(Scratch::Words) => {
            let _ = writeln!(
                head,
                "@group(0) @binding({binding}) var<storage, read_write> part: array<f32>;
fn part_st(i: u32, v: f32) {{ part[i] = v; }}
fn part_ld(i: u32) -> f32 {{ return part[i]; }}"
            );
        }
        Some(Scratch::Units { partials_at }) => {
            let _ = writeln!(
                head,
                "@group(0) @binding({binding}) var<storage, read_write> part: array<vec4<u32>>;"
            );
            if let Some(at) = partials_at {
                // `at` is whole units (the copy's), so word w of the
                // partial sums is component w % 4 of unit at / 4 + w / 4.
                let _ = writeln!(
                    head,
                    "fn part_st(i: u32, v: f32) {{ part[{u}u + i / 4u][i % 4u] = bitcast<u32>(v); }}
fn part_ld(i: u32) -> f32 {{ return bitcast<f32>(part[{u}u + i / 4u][i % 4u]); }}",
                    u = at / 4
                );
            }
        }
        None => {}
    }
    head.push_str(src);
    match caps.coop {
        Some(c) if c.emulated && coop => {
            super::emulate::emulate(&head, c.tile as usize, c.subgroup as usize)
        }
        _ => Ok(head),
    }
}

/// Whether `b` can be part of a WGSL identifier.
pub(super) fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taps_first_layout_moves_each_tap_before_the_channels() {
        // Two output channels of 3 input channels × 2 taps, valued
        // o·100 + ci·10 + tap.
        let data: Vec<f32> = (0..2)
            .flat_map(|o| {
                (0..3).flat_map(move |ci| (0..2).map(move |t| (o * 100 + ci * 10 + t) as f32))
            })
            .collect();
        let got = taps_first_layout(&data, 6, 2);
        let want = [
            0.0, 10.0, 20.0, 1.0, 11.0, 21.0, 100.0, 110.0, 120.0, 101.0, 111.0, 121.0,
        ];
        assert_eq!(got, want);
    }
}
