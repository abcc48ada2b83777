//! WGSL generation: one compute shader per Program kernel.
//!
//! Shapes, strides and offsets are baked in as constants, so each shader is
//! specialised to its kernel (the driver folds the index arithmetic) and the
//! source text itself is the pipeline cache key: a sampling loop that
//! replays one Program compiles every kernel once. Fused elementwise work is
//! generated from the kernel's [`Expr`]: as the whole body of an elementwise
//! kernel, or as the `epi` function anchor kernels apply before each store.

use super::quant::quant_reader;
pub use super::quant::Quant;
use crate::plan::{Expr, Kernel, KernelKind, View};
use crate::tensor::{contiguous_strides, BinaryOp, ReduceOp, UnaryOp, UpsampleMode};
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
}

/// The second pass of a split-K product.
#[derive(Clone, Debug)]
pub struct Finish {
    pub source: String,
    pub groups: [u32; 3],
    /// f32 elements the scratch binding holds.
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
            format!("in{j}[{}]", offset_code(&k.inputs[j], shape, "i"))
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

/// Generates the shader for a kernel, or says what is unsupported.
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
}

impl Operand {
    pub fn whole(f16: bool) -> Self {
        Operand {
            f16,
            chunks: 1,
            chunk_elems: usize::MAX,
            taps_first: false,
            quant: None,
        }
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
    /// Cooperative products whose grid would leave most of a large GPU
    /// idle (the deep UNet levels: few output tiles, long depth) split
    /// the depth over several workgroups and sum in a second pass; group
    /// norms with few long rows (a workgroup per group: 32 per image)
    /// split each row's statistics likewise ([`norm_split`]).
    pub split_k: bool,
    /// Staged cooperative products load the next depth step into
    /// registers while multiplying the current one (off by default until
    /// measured on a GPU: `wgpu_ops` prints both).
    pub prefetch: bool,
}

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
            split_k: true,
            prefetch: false,
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
    match &k.kind {
        KernelKind::Elementwise => {
            src.push_str(&simple("    dst[gi] = epi(0.0, gi);"));
            groups = grid(n_out);
        }
        KernelKind::MatMul { batch, m, n, k: kk } => {
            let (a, b) = (&k.inputs[0], &k.inputs[1]);
            let mv = |v: &View| -> Result<(usize, usize, usize, usize), String> {
                let r = v.shape.len();
                let bs = v
                    .batch_stride(r - 2)
                    .ok_or("matmul operand batch dims are not uniformly strided")?;
                Ok((v.offset, bs, v.strides[r - 2], v.strides[r - 1]))
            };
            let (ao, abs_, ars, acs) = mv(a)?;
            let (bo, bbs, brs, bcs) = mv(b)?;
            let load_a = format!(
                "fn load_a(z: u32, r: u32, c: u32) -> f32 {{ return in0[{ao}u + z * {abs_}u + r * {ars}u + c * {acs}u]; }}"
            );
            let load_b = format!(
                "fn load_b(z: u32, k0: u32, kr: u32, c: u32) -> f32 {{ let r = k0 + kr; return in1[{bo}u + z * {bbs}u + r * {brs}u + c * {bcs}u]; }}"
            );
            let store = format!(
                "fn store(z: u32, r: u32, c: u32, v: f32) {{ let oi = z * {}u + r * {n}u + c; dst[oi] = epi(v, oi); }}",
                m * n
            );
            if *batch > 65535 {
                return Err(format!("batch {batch} exceeds 65535 workgroups"));
            }
            let g = Gemm {
                m: *m,
                n: *n,
                k: *kk,
                batch: *batch,
                a_k_contiguous: acs <= ars,
                b_n_contiguous: bcs <= brs,
                direct_a: operands
                    .first()
                    .and_then(|o| Direct::of(0, o, acs, (ao, abs_), ars)),
                direct_b: operands
                    .get(1)
                    .and_then(|o| Direct::of(1, o, brs, (bo, bbs), bcs)),
            };
            let (code, tiles, split) = g.emit(caps, &load_a, &load_b, &store);
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
            let kk = cg * kh * kw;
            let taps = kh * kw;
            let bias_term = if *bias { "in2[oc]" } else { "0.0" };
            let store = format!(
                "fn store(z: u32, r: u32, c: u32, v: f32) {{ let b = z / {g}u; let g = z % {g}u; let oc = g * {og}u + r; let oi = (b * {o}u + oc) * {ohw}u + c; dst[oi] = epi(v + {bias_term}, oi); }}",
                ohw = oh * ow
            );
            let z = n * g;
            if z > 65535 {
                return Err(format!("batch x groups {z} exceeds 65535 workgroups"));
            }
            // GEMM per (image, group): rows = output channels of the group,
            // cols = output pixels, depth = input channels x kernel taps.
            // Weights are [out][in x taps] (depth contiguous, in either
            // order); the implicit im2col operand walks pixels contiguously.
            let gm = Gemm {
                m: og,
                n: oh * ow,
                k: kk,
                batch: z,
                a_k_contiguous: true,
                b_n_contiguous: true,
                // Batch index z = image·groups + group; the weights repeat
                // per image, so only groups of one may read them directly.
                direct_a: operands
                    .get(1)
                    .filter(|_| g == 1)
                    .and_then(|o| Direct::of(1, o, 1, (0, 0), kk)),
                direct_b: None,
            };
            let taps_first = operands.get(1).is_some_and(|o| o.taps_first);
            let load_a = format!(
                "fn load_a(z: u32, r: u32, c: u32) -> f32 {{ let g = z % {g}u; return in1[(g * {og}u + r) * {kk}u + c]; }}"
            );
            // The depth index r = k0 + kr as (channel, ky, kx). Tap-major
            // with whole steps of channels (every SD conv but the first),
            // the tap and first channel come from the step's start alone,
            // so everything but the final `+ kr·H·W` is the same for all of
            // a thread's elements in a step and is computed once.
            let step_whole = gm
                .coop_depth_step(caps)
                .is_some_and(|bk| cg.is_multiple_of(bk));
            let (depth, tail) = match (taps_first, step_whole) {
                (false, _) => (
                    format!("let r = k0 + kr; let ci = r / {taps}u; let tap = r % {taps}u;"),
                    String::new(),
                ),
                (true, false) => (
                    format!("let r = k0 + kr; let tap = r / {cg}u; let ci = r % {cg}u;"),
                    String::new(),
                ),
                (true, true) => (
                    format!("let tap = k0 / {cg}u; let ci = k0 % {cg}u;"),
                    format!(" + kr * {}u", h * w),
                ),
            };
            let load_b = format!(
                "fn load_b(z: u32, k0: u32, kr: u32, c: u32) -> f32 {{
    let b = z / {g}u; let g = z % {g}u;
    {depth} let ky = tap / {kw}u; let kx = tap % {kw}u;
    let oy = c / {ow}u; let ox = c % {ow}u;
    let iy = i32(oy * {sh}u + ky * {dh}u) - {ph}; let ix = i32(ox * {sw}u + kx * {dw}u) - {pw};
    if (iy < 0 || ix < 0 || iy >= {h} || ix >= {w}) {{ return 0.0; }}
    return in0[((b * {c}u + g * {cg}u + ci) * {h}u + u32(iy)) * {w}u + u32(ix){tail}];
}}",
                sh = params.stride[0],
                sw = params.stride[1],
                dh = params.dilation[0],
                dw = params.dilation[1],
                ph = params.padding[0],
                pw = params.padding[1],
            );
            let (code, tiles, split) = gm.emit(caps, &load_a, &load_b, &store);
            src.push_str(&code);
            groups = tiles;
            finish = split;
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
            let affine_code = if *affine {
                "let ch = (base + j) / SPATIAL % CH; y = y * in1[ch] + in2[ch];"
            } else {
                ""
            };
            let rows = n * gr;
            if let Some((chunks, clen)) = norm_split(rows, per).filter(|_| caps.split_k) {
                // Few long rows (the VAE's and the UNet's outer levels):
                // each row's statistics in chunks over many workgroups,
                // then the normalisation on the same grid.
                let fill = |t: &str| {
                    with_reductions(&t.replace("CHUNK_SETUP", NORM_CHUNK_SETUP), subgroups)
                        .replace("TOTAL", &format!("{}u", rows * chunks))
                        .replace("CHUNKS", &format!("{chunks}u"))
                        .replace("CLEN", &format!("{clen}u"))
                        .replace("PER", &format!("{per}u"))
                        .replace("EPS", &lit(*eps))
                        .replace("AFFINE", affine_code)
                        .replace("SPATIAL", &format!("{spatial}u"))
                        .replace("CH", &format!("{c}u"))
                };
                let total = rows * chunks;
                let grid2 = [total.min(65535) as u32, total.div_ceil(65535) as u32, 1];
                src.push_str(&fill(NORM_STATS));
                groups = grid2;
                finish = Some((fill(NORM_APPLY), grid2, 2 * total));
            } else {
                let body = with_reductions(ROW_NORM, subgroups)
                    .replace("ROW_LEN", &format!("{per}u"))
                    .replace("READ(j)", "in0[base + j]")
                    .replace("BASE", &format!("row * {per}u"))
                    .replace("CENTER", "true")
                    .replace("EPS", &lit(*eps))
                    .replace("AFFINE", affine_code)
                    .replace("SPATIAL", &format!("{spatial}u"))
                    .replace("ROWS", &format!("{}u", n * gr))
                    .replace("CH", &format!("{c}u"));
                src.push_str(&body);
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
            let affine_code = match (affine, rms) {
                (true, false) => "y = y * in1[j] + in2[j];",
                (true, true) => "y = y * in1[j];",
                _ => "",
            };
            let body = with_reductions(ROW_NORM, subgroups)
                .replace("ROW_LEN", &format!("{cols}u"))
                .replace("READ(j)", "in0[off0(base + j)]")
                .replace("BASE", &format!("row * {cols}u"))
                .replace("CENTER", if rms { "false" } else { "true" })
                .replace("EPS", &lit(*eps))
                .replace("AFFINE", affine_code)
                .replace("ROWS", &format!("{rows}u"));
            src.push_str(&body);
            if *rows > 65535 * 65535 {
                return Err("too many rows".into());
            }
            groups = [(*rows).min(65535) as u32, rows.div_ceil(65535) as u32, 1];
        }
        KernelKind::Softmax { outer, len, inner } => {
            let body = with_reductions(SOFTMAX, subgroups)
                .replace("ROWS", &format!("{}u", outer * inner))
                .replace("LEN", &format!("{len}u"))
                .replace("INNER", &format!("{inner}u"));
            src.push_str(&body);
            let rows = outer * inner;
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
                    "    var s = 0.0;\n    for (var r = 0u; r < {count}u; r++) {{ s = s + in0[base + {}]; }}\n    let mean = s / f32({count}u);\n",
                    roff.join(" + ")
                )
            } else {
                String::new()
            };
            let body = format!(
                "    let base = {};\n{mean_pass}    var acc1: f32 = {init};\n    for (var r = 0u; r < {count}u; r++) {{ let x = in0[base + {}]; {step} }}\n    dst[gi] = epi({}, gi);",
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
            let (code, tiles) = attention(*b * *h, *sq, *skv, *d, *dv, *scale, *masked, caps);
            src.push_str(&code);
            groups = tiles;
        }
        KernelKind::Gather { rows, cols } => {
            let body = format!(
                "    let r = gi / {cols}u; let col = gi % {cols}u;\n    let id = min(u32(max(in1[r], 0.0)), {}u);\n    dst[gi] = epi(in0[id * {cols}u + col], gi);",
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
                    "{head}    let sy = min(u32(floor(f32(y) * (f32({h}u) / f32({oh}u)))), {hm}u);\n    let sx = min(u32(floor(f32(x) * (f32({w}u) / f32({ow}u)))), {wm}u);\n    dst[gi] = epi(in0[base + sy * {w}u + sx], gi);",
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
    let v = (1.0 - ly) * ((1.0 - lx) * in0[base + y0 * {w}u + x0] + lx * in0[base + y0 * {w}u + x1])
          + ly * ((1.0 - lx) * in0[base + y1 * {w}u + x0] + lx * in0[base + y1 * {w}u + x1]);
    dst[gi] = epi(v, gi);",
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
                    "    if (a >= {start}u && a < {}u) {{ v = in{j}[{}]; }}",
                    start + part,
                    offset_code(view, &view.shape, &idx)
                );
                start += part;
            }
            body.push_str("    dst[gi] = epi(v, gi);");
            src.push_str(&simple(&body));
            groups = grid(n_out);
        }
        KernelKind::Pad { pads, value } => {
            let shape = &k.output.shape;
            let ins = &k.inputs[0].shape;
            let os = contiguous_strides(shape);
            let is = contiguous_strides(ins);
            let mut body = String::from("    var inside = true; var src = 0u;\n");
            for d in 0..shape.len() {
                let _ = writeln!(
                    body,
                    "    {{ let c = i32((gi / {}u) % {}u) - {}; if (c < 0 || c >= {}) {{ inside = false; }} else {{ src = src + u32(c) * {}u; }} }}",
                    os[d], shape[d], pads[d].0, ins[d], is[d]
                );
            }
            let _ = writeln!(
                body,
                "    var v = {};\n    if (inside) {{ v = in0[{}]; }}\n    dst[gi] = epi(v, gi);",
                lit(*value),
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
    let split = finish.is_some();
    let source = bind(&src, k.inputs.len(), operands, caps, split)?;
    let finish = match finish {
        Some((body, groups, scratch_elems)) => Some(Finish {
            source: bind(
                &format!("{PRELUDE}{}{body}", epilogue_fn(k)),
                k.inputs.len(),
                operands,
                caps,
                true,
            )?,
            groups,
            scratch_elems,
        }),
        None => None,
    };
    Ok(Shader {
        source,
        groups,
        finish,
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
    scratch: bool,
) -> Result<String, String> {
    // Every input read goes through `rd{j}(i)` and every store through
    // `wr(i, v)`: they widen f16 storage to f32 (arithmetic stays f32) and
    // pick the binding of a tensor split over several.
    let body = route_writes(&route_reads(src, n_inputs));
    let mut head = String::new();
    let coop = body.contains("coop_mat");
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
                "@group(0) @binding({binding}) var<storage, read_write> {name}_0: array<u32>;"
            );
            binding += 1;
            head.push_str(&quant_reader(j, q)?);
            continue;
        }
        let ty = if op.f16 { "f16" } else { "f32" };
        for c in 0..op.chunks {
            let _ = writeln!(
                head,
                "@group(0) @binding({binding}) var<storage, read_write> {name}_{c}: array<{ty}>;"
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
    if scratch {
        let _ = writeln!(
            head,
            "@group(0) @binding({binding}) var<storage, read_write> part: array<f32>;"
        );
    }
    head.push_str(&body);
    match caps.coop {
        Some(c) if c.emulated && coop => {
            super::emulate::emulate(&head, c.tile as usize, c.subgroup as usize)
        }
        _ => Ok(head),
    }
}

/// Rewrites every `inJ[expr]` into `rdJ(expr)` (brackets matched).
fn route_reads(src: &str, n_inputs: usize) -> String {
    let bytes = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    // One entry per open `[`: whether it opened a rewritten read.
    let mut depth_stack: Vec<bool> = Vec::new();
    while i < bytes.len() {
        let c = bytes[i] as char;
        if c == 'i' && src[i..].starts_with("in") && (i == 0 || !is_ident(bytes[i - 1])) {
            // inN[ ?
            let mut j = i + 2;
            while j < bytes.len() && bytes[j].is_ascii_digit() {
                j += 1;
            }
            if j > i + 2 && j < bytes.len() && bytes[j] == b'[' {
                if let Ok(n) = src[i + 2..j].parse::<usize>() {
                    if n < n_inputs {
                        out.push_str(&format!("rd{n}("));
                        depth_stack.push(true);
                        i = j + 1;
                        continue;
                    }
                }
            }
        }
        if c == '[' {
            depth_stack.push(false);
        } else if c == ']' && depth_stack.pop() == Some(true) {
            out.push(')');
            i += 1;
            continue;
        }
        out.push(c);
        i += 1;
    }
    out
}

/// Rewrites every store `dst[i] = v;` into `wr(i, v);`.
fn route_writes(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(p) = rest.find("dst[") {
        let before_ok = p == 0 || !is_ident(rest.as_bytes()[p - 1]);
        out.push_str(&rest[..p]);
        let after = &rest[p + 4..];
        if !before_ok {
            out.push_str("dst[");
            rest = after;
            continue;
        }
        // Index: up to the matching `]`.
        let mut depth = 1;
        let mut end = 0;
        for (i, ch) in after.char_indices() {
            match ch {
                '[' => depth += 1,
                ']' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let index = &after[..end];
        let tail = &after[end + 1..];
        let Some(eq) = tail.find('=') else {
            out.push_str("dst[");
            rest = after;
            continue;
        };
        let value_and_rest = &tail[eq + 1..];
        let Some(semi) = value_and_rest.find(';') else {
            out.push_str("dst[");
            rest = after;
            continue;
        };
        out.push_str(&format!("wr({index}, {});", value_and_rest[..semi].trim()));
        rest = &value_and_rest[semi + 1..];
    }
    out.push_str(rest);
    out
}

/// Whether `b` can be part of a WGSL identifier.
pub(super) fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// A 64x64-tiled GEMM (16x16 threads, 4x4 outputs each, K-steps of 16
/// through workgroup memory) over `load_a(z, row, k)`, `load_b(z, k0, kr,
/// col)` (depth k0 + kr, k0 the step's start)
/// and `store(z, row, col, v)`, which precede it in the shader. Workgroup (x, y, z) = (col tile, row tile,
/// batch).
fn gemm(m: usize, n: usize, k: usize) -> String {
    format!(
        "var<workgroup> As: array<f32, 1024>;
var<workgroup> Bs: array<f32, 1024>;
@compute @workgroup_size(16, 16, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {{
    let z = wg.z;
    let row0 = wg.y * 64u;
    let col0 = wg.x * 64u;
    let tid = lid.y * 16u + lid.x;
    var acc: array<f32, 16>;
    for (var k0 = 0u; k0 < {k}u; k0 = k0 + 16u) {{
        for (var q = 0u; q < 4u; q++) {{
            let e = tid + q * 256u;
            let ka = e % 16u; let ma = e / 16u;
            var va = 0.0;
            if (row0 + ma < {m}u && k0 + ka < {k}u) {{ va = load_a(z, row0 + ma, k0 + ka); }}
            As[ka * 64u + ma] = va;
            let nb = e % 64u; let kb = e / 64u;
            var vb = 0.0;
            if (col0 + nb < {n}u && k0 + kb < {k}u) {{ vb = load_b(z, k0, kb, col0 + nb); }}
            Bs[kb * 64u + nb] = vb;
        }}
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {{
            let a0 = As[kk * 64u + lid.y * 4u];
            let a1 = As[kk * 64u + lid.y * 4u + 1u];
            let a2 = As[kk * 64u + lid.y * 4u + 2u];
            let a3 = As[kk * 64u + lid.y * 4u + 3u];
            for (var j = 0u; j < 4u; j++) {{
                let bv = Bs[kk * 64u + lid.x * 4u + j];
                acc[j] = acc[j] + a0 * bv;
                acc[4u + j] = acc[4u + j] + a1 * bv;
                acc[8u + j] = acc[8u + j] + a2 * bv;
                acc[12u + j] = acc[12u + j] + a3 * bv;
            }}
        }}
        workgroupBarrier();
    }}
    for (var i = 0u; i < 4u; i++) {{
        for (var j = 0u; j < 4u; j++) {{
            let r = row0 + lid.y * 4u + i;
            let c = col0 + lid.x * 4u + j;
            if (r < {m}u && c < {n}u) {{ store(z, r, c, acc[i * 4u + j]); }}
        }}
    }}
}}
"
    )
}

/// One (batched) matrix product as the kernels see it: `m`×`k` by
/// `k`×`n`, `batch` times, through `load_a`/`load_b`/`store`.
struct Gemm {
    m: usize,
    n: usize,
    k: usize,
    batch: usize,
    /// Consecutive depth indices of A are adjacent in memory (else
    /// consecutive rows are): decides which index neighbouring threads
    /// walk when staging a tile, so their reads coalesce.
    a_k_contiguous: bool,
    /// Consecutive columns of B are adjacent in memory (else consecutive
    /// depth indices are).
    b_n_contiguous: bool,
    /// A's rows read straight from its f16 binding, where possible.
    direct_a: Option<Direct>,
    /// B's columns read straight from its f16 binding, where possible.
    direct_b: Option<Direct>,
}

/// An operand stored as f16 in one binding with its depth index
/// contiguous: cooperative loads can read its fragments from the buffer,
/// skipping the workgroup-memory staging.
struct Direct {
    /// The binding (`inJ_0`).
    binding: String,
    /// WGSL expression (of the batch index `z`) for the element offset of
    /// row/column 0, depth 0.
    base: String,
    /// Elements between consecutive rows (A) or columns (B).
    stride: usize,
}

impl Direct {
    /// For operand `j` bound as `op`, with element offset `offset +
    /// z·z_stride` of its first row/column, when its depth stride is 1 and
    /// every fragment starts 16-byte aligned (cooperative loads from
    /// buffers may require it; fragments start at multiples of 8 along the
    /// depth).
    fn of(
        j: usize,
        op: &Operand,
        depth_stride: usize,
        (offset, z_stride): (usize, usize),
        stride: usize,
    ) -> Option<Self> {
        let aligned = offset % 8 == 0 && z_stride % 8 == 0 && stride.is_multiple_of(8);
        (op.f16 && op.chunks == 1 && depth_stride == 1 && aligned).then(|| Direct {
            binding: format!("in{j}_0"),
            base: format!("{offset}u + z * {z_stride}u"),
            stride,
        })
    }
}

/// f16 elements (16 bytes) added to each row of a tile staged in
/// workgroup memory for cooperative loads. Unpadded, a tile's rows are
/// 64–256 bytes apart, so the rows of one fragment start in the same few
/// of the 32 four-byte banks and a fragment load serialises 4–8 ways; 16
/// more bytes per row spread 8 consecutive rows over all 32 banks. 16
/// bytes keep every row start as aligned as cooperative loads want.
/// `sdkit devices --probe` times fragment loads at both strides.
const SMEM_PAD: usize = 8;

/// Workgroups a split-K product aims for: about two per SM of a large GPU.
const SPLIT_TARGET: usize = 256;
/// Depth steps each split keeps at least, so the partial sums' extra
/// traffic stays small beside the product.
const SPLIT_MIN_STEPS: usize = 8;
/// Partial-sum elements a split may write (64 MiB of f32).
const SPLIT_MAX_SCRATCH: usize = 16 << 20;

/// How a cooperative-matrix GEMM workgroup divides its tile:
/// `sg_rows`×`sg_cols` subgroups, each owning `rows`×`cols` outputs
/// (multiples of the fragment size), over depth steps of `bk`; `direct`
/// lets f16 operands skip staging ([`Direct`]). Chosen by size unless
/// [`Caps::gemm_tiles`] fixes it (for tuning).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CoopTiles {
    pub sg_rows: usize,
    pub sg_cols: usize,
    pub rows: usize,
    pub cols: usize,
    pub bk: usize,
    pub direct: bool,
}

/// The cooperative GEMM tilings worth comparing on a new adapter
/// (`SDKIT_BENCH_TILINGS=1 cargo bench --bench wgpu_ops`); the default
/// choice, `Gemm::tiles_for`, picks among them.
pub fn tilings() -> Vec<CoopTiles> {
    let t = |sg_rows, sg_cols, rows, cols, bk, direct| CoopTiles {
        sg_rows,
        sg_cols,
        rows,
        cols,
        bk,
        direct,
    };
    vec![
        t(2, 4, 64, 32, 32, true),
        t(2, 2, 32, 32, 32, true),
        t(2, 4, 64, 32, 32, false),
        t(2, 4, 64, 32, 64, true),
        t(2, 2, 64, 64, 32, true),
        t(2, 2, 64, 64, 64, true),
        t(4, 2, 32, 64, 32, true),
        t(4, 2, 32, 32, 32, true),
        t(2, 4, 32, 32, 32, true),
        t(4, 4, 32, 32, 32, true),
        t(4, 4, 32, 16, 32, true),
    ]
}

impl Gemm {
    /// The shader body and launch grid: cooperative matrices where the
    /// adapter has them, else the portable register-tiled kernel.
    #[allow(clippy::type_complexity)]
    fn emit(
        &self,
        caps: &Caps,
        load_a: &str,
        load_b: &str,
        store: &str,
    ) -> (String, [u32; 3], Option<(String, [u32; 3], usize)>) {
        let funcs = format!("{load_a}\n{load_b}\n{store}\n");
        let Some(c) = caps.coop else {
            return (
                funcs + &gemm(self.m, self.n, self.k),
                [
                    self.n.div_ceil(64) as u32,
                    self.m.div_ceil(64) as u32,
                    self.batch as u32,
                ],
                None,
            );
        };
        let tiles = self.coop_tiles(c, caps);
        let gx = self.n.div_ceil(tiles.sg_cols * tiles.cols);
        let gy = self.m.div_ceil(tiles.sg_rows * tiles.rows);
        let split = if caps.split_k {
            self.split(gx * gy * self.batch, tiles.bk)
        } else {
            None
        };
        let code = funcs.clone() + &self.coop(c, tiles, split, caps.prefetch);
        let groups = [
            gx as u32,
            gy as u32,
            (self.batch * split.map_or(1, |(s, _)| s)) as u32,
        ];
        let finish = split.map(|(splits, _)| {
            let total = self.batch * self.m * self.n;
            let body = format!(
                "{funcs}@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{
    {LINEAR_ID}
    if (gi >= {total}u) {{ return; }}
    var v = 0.0;
    for (var p = 0u; p < {splits}u; p++) {{ v = v + part[p * {total}u + gi]; }}
    let rc = gi % {mn}u;
    store(gi / {mn}u, rc / {n}u, rc % {n}u, v);
}}
",
                mn = self.m * self.n,
                n = self.n,
            );
            (body, grid(total), splits * total)
        });
        (code, groups, finish)
    }

    /// The cooperative tiling `emit` uses, in this configuration's
    /// elements.
    fn coop_tiles(&self, c: Coop, caps: &Caps) -> CoopTiles {
        let tiles = caps.gemm_tiles.unwrap_or_else(|| self.tiles_for(c));
        CoopTiles {
            rows: c.extent(tiles.rows),
            cols: c.extent(tiles.cols),
            bk: c.extent(tiles.bk),
            ..tiles
        }
    }

    /// The depth step of the cooperative kernel; None on the portable one.
    fn coop_depth_step(&self, caps: &Caps) -> Option<usize> {
        caps.coop.map(|c| self.coop_tiles(c, caps).bk)
    }

    /// Split-K for a grid of `workgroups` over depth steps of `bk`: None
    /// when the grid already fills a large GPU (an H200 has 132 SMs), else
    /// (splits, depth per split) so that about [`SPLIT_TARGET`] workgroups
    /// run, each split keeping at least [`SPLIT_MIN_STEPS`] steps and the
    /// partial sums within [`SPLIT_MAX_SCRATCH`] elements.
    fn split(&self, workgroups: usize, bk: usize) -> Option<(usize, usize)> {
        if workgroups >= SPLIT_TARGET / 2 {
            return None;
        }
        let steps = self.k.div_ceil(bk);
        let outputs = self.batch * self.m * self.n;
        let want = SPLIT_TARGET
            .div_ceil(workgroups)
            .min(steps / SPLIT_MIN_STEPS)
            .min(SPLIT_MAX_SCRATCH / outputs.max(1));
        if want < 2 {
            return None;
        }
        let per = steps.div_ceil(want);
        Some((steps.div_ceil(per), per * bk))
    }

    /// The tiling by operand kind and size, from the tiling table measured
    /// on an H200 (benches/gpu/RESULTS.md): with A read directly (conv
    /// weights) 4×2 subgroups of 32×32 led at every conv size measured;
    /// with only B direct (linear weights) 2×2 of 32×32; with both staged,
    /// 128×128 tiles (2×4 of 64×32) where the grid stays large, else 64×64.
    fn tiles_for(&self, c: Coop) -> CoopTiles {
        let t = c.tile as usize;
        let whole = |dim: usize| self.k.is_multiple_of(t) && dim.is_multiple_of(t);
        let a_direct = self.direct_a.is_some() && whole(self.m);
        let b_direct = self.direct_b.is_some() && whole(self.n);
        let tiles = |sg_rows, sg_cols, rows, cols| CoopTiles {
            sg_rows,
            sg_cols,
            rows,
            cols,
            bk: 32,
            direct: true,
        };
        let big = c.extent(128);
        let big_tiles = self.m.div_ceil(big) * self.n.div_ceil(big) * self.batch;
        match (a_direct, b_direct) {
            (true, false) => tiles(4, 2, 32, 32),
            (false, true) => tiles(2, 2, 32, 32),
            _ if self.m >= big && self.n >= big && big_tiles >= 128 => tiles(2, 4, 64, 32),
            _ => tiles(2, 2, 32, 32),
        }
    }

    /// Tensor-core GEMM: each workgroup stages a BM×bk tile of A and a
    /// bk×BN tile of B in workgroup memory as f16 (or reads an f16 operand
    /// straight from its binding), and each of its subgroups multiplies its
    /// `rows`×`cols` share into f32 accumulator fragments. The epilogue
    /// goes through a per-subgroup f32 scratch fragment, so `store` (bias,
    /// activation, residual, f16 output, split bindings) stays the same as
    /// the portable kernel's.
    fn coop<'a>(
        &'a self,
        c: Coop,
        sh: CoopTiles,
        split: Option<(usize, usize)>,
        caps_prefetch: bool,
    ) -> String {
        let t = c.tile as usize;
        let s = c.subgroup as usize;
        let (fm, fnn) = (sh.rows / t, sh.cols / t);
        let bm = sh.sg_rows * sh.rows;
        let bn = sh.sg_cols * sh.cols;
        let bk = sh.bk;
        let nsg = sh.sg_rows * sh.sg_cols;
        let threads = nsg * s;
        let (m, n, k) = (self.m, self.n, self.k);
        // Direct reads need whole fragments along the depth and along the
        // rows/columns: a fragment past the end is then wholly outside the
        // output, so clamping it inside the operand only reads values that
        // are never stored.
        let usable = |d: Option<&'a Direct>, dim: usize| {
            d.filter(|_| sh.direct && k % t == 0 && dim.is_multiple_of(t))
        };
        let da = usable(self.direct_a.as_ref(), m);
        let db = usable(self.direct_b.as_ref(), n);
        // Staged tiles' row strides, padded (see [`SMEM_PAD`]).
        let (sa, sb) = (bk + SMEM_PAD, bn + SMEM_PAD);
        let ty = |role: &str, scalar: &str| format!("coop_mat{t}x{t}<{scalar}, {role}>");
        // Where the workgroup's depth range starts and ends, and where its
        // results go: the epilogue, or its split's partial sums.
        let (prologue, k_begin, k_end, result) = match split {
            None => (
                "    let z = wg.z;\n".to_string(),
                "0u".to_string(),
                format!("{k}u"),
                format!("store(z, r, col, Cs[sg * {}u + e])", t * t),
            ),
            Some((splits, per)) => (
                format!(
                    "    let z = wg.z / {splits}u;\n    let k_begin = (wg.z % {splits}u) * {per}u;\n    let k_end = min(k_begin + {per}u, {k}u);\n"
                ),
                "k_begin".to_string(),
                "k_end".to_string(),
                format!(
                    "part[(((wg.z % {splits}u) * {batch}u + z) * {m}u + r) * {n}u + col] = Cs[sg * {tt}u + e]",
                    batch = self.batch,
                    tt = t * t
                ),
            ),
        };
        let mut decl = String::new();
        let mut mac = String::new();
        let mut epi = String::new();
        for i in 0..fm {
            let load = match da {
                Some(d) => format!(
                    "coopLoadT<{}>(&{}[{} + min(row0 + sm * {}u + {}u, {}u) * {}u + k0 + kk], {}u)",
                    ty("A", "f16"),
                    d.binding,
                    d.base,
                    sh.rows,
                    i * t,
                    m - t,
                    d.stride,
                    d.stride
                ),
                None => format!(
                    "coopLoadT<{}>(&As[(sm * {}u + {}u) * {sa}u + kk], {sa}u)",
                    ty("A", "f16"),
                    sh.rows,
                    i * t
                ),
            };
            let _ = writeln!(mac, "            let a{i} = {load};");
        }
        for j in 0..fnn {
            let load = match db {
                Some(d) => format!(
                    "coopLoad<{}>(&{}[{} + min(col0 + sn * {}u + {}u, {}u) * {}u + k0 + kk], {}u)",
                    ty("B", "f16"),
                    d.binding,
                    d.base,
                    sh.cols,
                    j * t,
                    n - t,
                    d.stride,
                    d.stride
                ),
                None => format!(
                    "coopLoadT<{}>(&Bs[kk * {sb}u + sn * {}u + {}u], {sb}u)",
                    ty("B", "f16"),
                    sh.cols,
                    j * t
                ),
            };
            let _ = writeln!(mac, "            let b{j} = {load};");
        }
        for i in 0..fm {
            for j in 0..fnn {
                let _ = writeln!(decl, "    var c{i}_{j} = {}();", ty("C", "f32"));
                let _ = writeln!(
                    mac,
                    "            c{i}_{j} = coopMultiplyAdd(a{i}, b{j}, c{i}_{j});"
                );
                let _ = write!(
                    epi,
                    "    coopStoreT(c{i}_{j}, &Cs[sg * {tt}u], {t}u);
    workgroupBarrier();
{copy}    workgroupBarrier();
",
                    tt = t * t,
                    copy = strided(
                        "    ",
                        "lane",
                        t * t,
                        s,
                        &format!(
                            "        let r = row0 + sm * {rows}u + {ri}u + e / {t}u;
        let col = col0 + sn * {cols}u + {ci}u + e % {t}u;
        if (r < {m}u && col < {n}u) {{ {result}; }}
",
                            rows = sh.rows,
                            cols = sh.cols,
                            ri = i * t,
                            ci = j * t,
                        )
                    ),
                );
            }
        }
        // Staging: neighbouring threads take neighbouring memory. Element
        // e = tid + se·threads of a tile `width` wide is at (e / width,
        // e % width); where the threads are a multiple of the width each
        // thread keeps one position along it for all its elements, said
        // so, so the driver computes what depends on it once (a conv's
        // output pixel, from its column).
        let across = |width: usize| {
            if threads.is_multiple_of(width) {
                (
                    format!("tid / {width}u + se * {}u", threads / width),
                    format!("tid % {width}u"),
                )
            } else {
                (format!("e / {width}u"), format!("e % {width}u"))
            }
        };
        let (a_r, a_c) = if self.a_k_contiguous {
            across(bk)
        } else {
            let (q, rem) = across(bm);
            (rem, q)
        };
        let (b_r, b_c) = if self.b_n_contiguous {
            across(bn)
        } else {
            let (q, rem) = across(bk);
            (rem, q)
        };
        // The staged operands: register name, elements per step, the
        // element's row and column, its value at depth step `K`, its slot.
        type Value = Box<dyn Fn(&str) -> String>;
        let mut staged: Vec<(&str, usize, String, Value, String)> = Vec::new();
        let mut shared = String::new();
        if da.is_none() {
            let _ = writeln!(shared, "var<workgroup> As: array<f16, {}>;", bm * sa);
            staged.push((
                "a",
                bm * bk,
                format!("let r = {a_r}; let kc = {a_c};"),
                Box::new(move |kv: &str| {
                    format!("if (row0 + r < {m}u && {kv} + kc < {k}u) {{ v = load_a(z, row0 + r, {kv} + kc); }}")
                }),
                format!("As[r * {sa}u + kc]"),
            ));
        }
        if db.is_none() {
            let _ = writeln!(shared, "var<workgroup> Bs: array<f16, {}>;", bk * sb);
            staged.push((
                "b",
                bk * bn,
                format!("let kr = {b_r}; let c = {b_c};"),
                Box::new(move |kv: &str| {
                    format!("if ({kv} + kr < {k}u && col0 + c < {n}u) {{ v = load_b(z, {kv}, kr, col0 + c); }}")
                }),
                format!("Bs[kr * {sb}u + c]"),
            ));
        }
        // Register prefetch (`Caps::prefetch`): each thread's elements of
        // the next step load into registers before this step's products,
        // so global latency overlaps them; written to workgroup memory
        // after. Needs whole elements per thread.
        let prefetch = caps_prefetch
            && !staged.is_empty()
            && staged.iter().all(|s| s.1.is_multiple_of(threads));
        let (mut stage, mut fetch, mut commit, mut regs) =
            (String::new(), String::new(), String::new(), String::new());
        for (reg, len, idx, value, at) in &staged {
            // This thread's elements at depth step `kv`, loaded into `into`.
            let load = |kv: &str, into: &str| {
                strided(
                    "        ",
                    "tid",
                    *len,
                    threads,
                    &format!(
                        "            {idx}
            var v = 0.0;
            {}
            {into} = f16(v);
",
                        value(kv)
                    ),
                )
            };
            stage.push_str(&load("k0", at));
            if prefetch {
                let per = len / threads;
                let _ = writeln!(regs, "    var p{reg}: array<f16, {per}>;");
                fetch.push_str(&load("kn", &format!("p{reg}[se]")));
                commit.push_str(&strided(
                    "        ",
                    "tid",
                    *len,
                    threads,
                    &format!(
                        "            {idx}
            {at} = p{reg}[se];
"
                    ),
                ));
            }
        }
        let barrier = if !staged.is_empty() {
            "        workgroupBarrier();\n"
        } else {
            ""
        };
        // With a direct operand the depth may end inside a step: stop at
        // it rather than read past the row (k is then a multiple of the
        // fragment). A loop bound, not an `if`: naga treats branches on
        // local variables as non-uniform, which cooperative ops forbid.
        // Where every step is whole (SD's convs and linears: depths are
        // multiples of 32), the bound stays a constant, so the driver can
        // unroll the loop and issue the direct fragment loads together.
        let depth_end = if (da.is_some() || db.is_some()) && !k.is_multiple_of(bk) {
            format!("min({bk}u, {k_end} - k0)")
        } else {
            format!("{bk}u")
        };
        let main_loop = if prefetch {
            // The first step staged as usual, then each step fetches the
            // next before multiplying.
            format!(
                "{regs}    {{
        let k0 = {k_begin};
{stage}    }}
    workgroupBarrier();
    for (var k0 = {k_begin}; k0 < {k_end}; k0 += {bk}u) {{
        let kn = k0 + {bk}u;
{fetch}        for (var kk = 0u; kk < {depth_end}; kk += {t}u) {{
{mac}        }}
        workgroupBarrier();
{commit}        workgroupBarrier();
    }}
"
            )
        } else {
            format!(
                "    for (var k0 = {k_begin}; k0 < {k_end}; k0 += {bk}u) {{
{stage}{barrier}        for (var kk = 0u; kk < {depth_end}; kk += {t}u) {{
{mac}        }}
{barrier}    }}
"
            )
        };
        format!(
            "{shared}var<workgroup> Cs: array<f32, {c_len}>;
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32, @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {{
{prologue}    let row0 = wg.y * {bm}u;
    let col0 = wg.x * {bn}u;
    let sm = sg / {sgc}u;
    let sn = sg % {sgc}u;
{decl}{main_loop}{epi}}}
",
            c_len = nsg * t * t,
            sgc = sh.sg_cols,
        )
    }
}

/// Attention with online softmax (flash-attention style, no sq×skv
/// buffer): a workgroup of 64 threads takes 64 queries of one (batch,
/// head), each thread one query; blocks of keys and values are staged in
/// workgroup memory once for all 64, and each key is folded into the
/// thread's running max, sum and output as it is scored (a per-block
/// score array spills to local memory on NVIDIA and ran slower).
#[allow(clippy::too_many_arguments)]
fn attention(
    bh: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    scale: f32,
    masked: bool,
    caps: &Caps,
) -> (String, [u32; 3]) {
    if let Some(c) = caps.coop {
        let single = if caps.two_pass_attention {
            None
        } else {
            attention_coop_single(bh, sq, skv, d, dv, scale, masked, c, caps)
        };
        if let Some(code) =
            single.or_else(|| attention_coop(bh, sq, skv, d, dv, scale, masked, c, caps))
        {
            return code;
        }
    }
    const Q: usize = 64;
    // Keys per block: K and V blocks together within the workgroup memory
    // (at most 24 KiB, leaving room on 32 KiB adapters).
    let room = (caps.workgroup_memory as usize).min(24576);
    let mut kb = 64;
    while kb > 1 && kb * (d + dv) * 4 > room {
        kb /= 2;
    }
    let mask = if masked {
        format!("s = s + in3[qi * {skv}u + j0 + jj];")
    } else {
        String::new()
    };
    let qblocks = sq.div_ceil(Q);
    let blocks = bh * qblocks;
    // Copies the block of keys from `j0` of `input` (rows `width` wide)
    // into `array`, zeros past the last key.
    let stage = |array: &str, input: &str, offset: &str, width: usize| {
        strided(
            "        ",
            "lid.x",
            kb * width,
            Q,
            &format!(
                "            let jj = e / {width}u; var v = 0.0;
            if (j0 + jj < {skv}u) {{ v = {input}[{offset}(bh, j0 + jj, e % {width}u)]; }}
            {array}[e] = v;
"
            ),
        )
    };
    let code = format!(
        "var<workgroup> Ks: array<f32, {kl}>;
var<workgroup> Vs: array<f32, {vl}>;
@compute @workgroup_size({Q})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {{
    let blk = wg.x + wg.y * 65535u;
    if (blk >= {blocks}u) {{ return; }}
    let bh = blk / {qblocks}u;
    let i = (blk % {qblocks}u) * {Q}u + lid.x;
    let qi = min(i, {sqm}u);
    var qr: array<f32, {d}>;
    for (var t = 0u; t < {d}u; t++) {{ qr[t] = in0[q_off(bh, qi, t)] * {sc}; }}
    var acc: array<f32, {dv}>;
    var m = -3.4028235e38; var l = 0.0;
    for (var j0 = 0u; j0 < {skv}u; j0 += {kb}u) {{
{stage_k}{stage_v}        workgroupBarrier();
        let cnt = min({kb}u, {skv}u - j0);
        for (var jj = 0u; jj < cnt; jj++) {{
            var s = 0.0;
            for (var t = 0u; t < {d}u; t++) {{ s = s + qr[t] * Ks[jj * {d}u + t]; }}
            {mask}
            let mn = max(m, s);
            let corr = exp(m - mn);
            let p = exp(s - mn);
            l = l * corr + p;
            for (var t = 0u; t < {dv}u; t++) {{ acc[t] = acc[t] * corr + p * Vs[jj * {dv}u + t]; }}
            m = mn;
        }}
        workgroupBarrier();
    }}
    if (i < {sq}u) {{
        let row = bh * {sq}u + i;
        for (var t = 0u; t < {dv}u; t++) {{ let oi = row * {dv}u + t; dst[oi] = epi(acc[t] / l, oi); }}
    }}
}}
",
        kl = kb * d,
        vl = kb * dv,
        sqm = sq.saturating_sub(1),
        sc = lit(scale),
        stage_k = stage("Ks", "in1", "k_off", d),
        stage_v = stage("Vs", "in2", "v_off", dv),
    );
    let groups = [blocks.min(65535) as u32, blocks.div_ceil(65535) as u32, 1];
    (code, groups)
}

/// WGSL loading a subgroup's query fragments (its T rows of the staged,
/// scaled Q tile `KQ`, rows `ks` apart) into registers `qa0…`.
fn coop_q_fragments(t: usize, qfrags: usize, ks: usize) -> String {
    let mut out = String::new();
    for f in 0..qfrags {
        let _ = writeln!(
            out,
            "    let qa{f} = coopLoadT<coop_mat{t}x{t}<f16, A>>(&KQ[sg * {}u + {}u], {ks}u);",
            t * ks,
            f * t
        );
    }
    out
}

/// WGSL scoring the subgroup's query fragments against a staged block of
/// `bk` keys (`KQ`, row-major by key, rows `ks` apart): f32 fragments
/// stored into the subgroup's rows of `Ss` (rows `ss` apart).
fn coop_scores(t: usize, qfrags: usize, ks: usize, bk: usize, ss: usize) -> String {
    let mut out = String::new();
    for jf in 0..bk / t {
        let _ = writeln!(
            out,
            "        {{\n            var sacc = coop_mat{t}x{t}<f32, C>();"
        );
        for f in 0..qfrags {
            let _ = writeln!(
                out,
                "            sacc = coopMultiplyAdd(qa{f}, coopLoad<coop_mat{t}x{t}<f16, B>>(&KQ[{}u], {ks}u), sacc);",
                jf * t * ks + f * t
            );
        }
        let _ = writeln!(
            out,
            "            coopStoreT(sacc, &Ss[sg * {}u + {}u], {ss}u);\n        }}",
            t * ss,
            jf * t
        );
    }
    out
}

/// What both cooperative attention forms share: 4 subgroups of T query
/// rows per workgroup, the head padded to a multiple of T, key blocks of
/// `bk` staged as f16, and the prologue that stages the scaled queries and
/// loads them into fragments.
struct CoopAttention {
    t: usize,
    bq: usize,
    dp: usize,
    dvp: usize,
    bk: usize,
    /// Row strides (elements) of `KQ`, `Vs`, `Ss` and `Ps`: each row
    /// padded by 16 bytes ([`SMEM_PAD`]).
    ks: usize,
    vs: usize,
    ss: usize,
    ps: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    scale: f32,
    threads: usize,
    qblocks: usize,
    blocks: usize,
}

/// Subgroups per cooperative attention workgroup.
const COOP_ATTN_SUBGROUPS: usize = 4;

impl CoopAttention {
    /// The largest key block (64, 32 or 16, at least T, a multiple of
    /// `lanes_per_row`) whose workgroup arrays, plus `extra_bytes`, fit;
    /// None when none does.
    #[allow(clippy::too_many_arguments)]
    fn new(
        bh: usize,
        (sq, skv, d, dv): (usize, usize, usize, usize),
        scale: f32,
        c: Coop,
        caps: &Caps,
        lanes_per_row: usize,
        extra_bytes: usize,
    ) -> Option<Self> {
        const NS: usize = COOP_ATTN_SUBGROUPS;
        let t = c.tile as usize;
        let lanes = c.subgroup as usize;
        let bq = NS * t;
        let dp = d.div_ceil(t) * t;
        let dvp = dv.div_ceil(t) * t;
        let (ks, vs) = (dp + SMEM_PAD, dvp + SMEM_PAD);
        // f32 score rows pad by 4 elements, f16 rows by 8: 16 bytes each.
        let ss = |bk: usize| bk + SMEM_PAD / 2;
        let ps = |bk: usize| bk + SMEM_PAD;
        let bytes = |bk: usize| {
            bk.max(bq) * ks * 2
                + bk * vs * 2
                + NS * t * ss(bk) * 4
                + NS * t * ps(bk) * 2
                + extra_bytes
        };
        let bk = [64, 32, 16]
            .into_iter()
            .map(|b| c.extent(b))
            .filter(|&b| b >= t && b % lanes_per_row == 0)
            .find(|&b| bytes(b) <= caps.workgroup_memory as usize)?;
        let qblocks = sq.div_ceil(bq);
        Some(CoopAttention {
            t,
            bq,
            dp,
            dvp,
            bk,
            ks,
            vs,
            ss: ss(bk),
            ps: ps(bk),
            sq,
            skv,
            d,
            dv,
            scale,
            threads: NS * lanes,
            qblocks,
            blocks: bh * qblocks,
        })
    }

    /// `coop_mat` type of role A/B/C with scalar f16/f32.
    fn ty(&self, role: &str, scalar: &str) -> String {
        format!("coop_mat{0}x{0}<{scalar}, {role}>", self.t)
    }

    /// `acc += pa · V[kf-th key fragment, f-th value fragment]`, with V
    /// staged as f16 in `Vs` (rows `vs` apart).
    fn pv_line(&self, acc: &str, f: usize) -> String {
        let (t, vs) = (self.t, self.vs);
        format!(
            "            {acc} = coopMultiplyAdd(pa, coopLoadT<{}>(&Vs[kf * {}u + {}u], {vs}u), {acc});",
            self.ty("B", "f16"),
            t * vs,
            f * t
        )
    }

    /// The workgroup arrays (`extra_decls` after them) and the entry
    /// point up to the query fragments `qa0…` in registers.
    fn head(&self, extra_decls: &str) -> String {
        let (t, bk, dp, threads) = (self.t, self.bk, self.dp, self.threads);
        let (bq, sq, d) = (self.bq, self.sq, self.d);
        format!(
            "var<workgroup> KQ: array<f16, {kql}>;
var<workgroup> Vs: array<f16, {vl}>;
var<workgroup> Ss: array<f32, {sl}>;
var<workgroup> Ps: array<f16, {pl}>;
{extra_decls}@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32, @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {{
    let blk = wg.x + wg.y * 65535u;
    if (blk >= {blocks}u) {{ return; }}
    let bh = blk / {qblocks}u;
    let q0 = (blk % {qblocks}u) * {bq}u;
{stage_q}    workgroupBarrier();
{qload}    workgroupBarrier();
",
            kql = bk.max(bq) * self.ks,
            vl = bk * self.vs,
            sl = COOP_ATTN_SUBGROUPS * t * self.ss,
            pl = COOP_ATTN_SUBGROUPS * t * self.ps,
            blocks = self.blocks,
            qblocks = self.qblocks,
            stage_q = self.by_rows(
                "    ",
                bq,
                dp,
                &format!(
                    "        var v = 0.0;
        if (q0 + kr < {sq}u && t < {d}u) {{ v = in0[q_off(bh, q0 + kr, t)] * {}; }}
        KQ[kr * {ks}u + t] = f16(v);
",
                    lit(self.scale),
                    ks = self.ks,
                )
            ),
            qload = coop_q_fragments(t, dp / t, self.ks),
        )
    }

    /// Stages the key block at `j0` into `KQ` (zeros past the keys and the
    /// head).
    fn stage_k(&self) -> String {
        self.stage("KQ", "in1", "k_off", (self.dp, self.ks), self.d)
    }

    /// Stages the value block at `j0` into `Vs`.
    fn stage_v(&self) -> String {
        self.stage("Vs", "in2", "v_off", (self.dvp, self.vs), self.dv)
    }

    /// Copies `bk` rows (keys from `j0`) of `input` (rows `width` wide,
    /// addressed by `offset`) into `array` as f16 rows `padded` wide,
    /// `stride` apart.
    fn stage(
        &self,
        array: &str,
        input: &str,
        offset: &str,
        (padded, stride): (usize, usize),
        width: usize,
    ) -> String {
        self.by_rows(
            "        ",
            self.bk,
            padded,
            &format!(
                "            var v = 0.0;
            if (j0 + kr < {skv}u && t < {width}u) {{ v = {input}[{offset}(bh, j0 + kr, t)]; }}
            {array}[kr * {stride}u + t] = f16(v);
",
                skv = self.skv,
            ),
        )
    }

    /// WGSL: `body` for every element (row `kr`, column `t`) of a tile of
    /// `rows` rows `padded` wide: subgroup `sg` takes rows sg, sg + 4, …
    /// and each lane a fixed set of columns, in loops of fixed trip count.
    /// A lane's columns never change, so the driver computes their
    /// addressing once and unrolls the rest; neighbouring lanes read
    /// neighbouring elements of a row.
    fn by_rows(&self, indent: &str, rows: usize, padded: usize, body: &str) -> String {
        const NS: usize = COOP_ATTN_SUBGROUPS;
        let lanes = self.threads / NS;
        let inner: String = body.lines().map(|l| format!("    {l}\n")).collect();
        let columns = strided_as(
            &format!("{indent}    "),
            "t",
            "sc",
            "lane",
            padded,
            lanes,
            &inner,
        );
        strided_as(indent, "kr", "sr", "sg", rows, NS, &columns)
    }

    /// Scores of the subgroup's rows against the staged key block.
    fn scores(&self) -> String {
        coop_scores(self.t, self.dp / self.t, self.ks, self.bk, self.ss)
    }

    /// The additive mask's term for score `s` of key `j0 + j`.
    fn mask(&self, masked: bool) -> String {
        if masked {
            format!("s = s + in3[qi * {}u + j0 + j];", self.skv)
        } else {
            String::new()
        }
    }

    fn groups(&self) -> [u32; 3] {
        [
            self.blocks.min(65535) as u32,
            self.blocks.div_ceil(65535) as u32,
            1,
        ]
    }
}

/// Attention on cooperative matrices in one pass (flash-attention's
/// online softmax): a workgroup of 4 subgroups takes 4·T queries of one
/// (batch, head), each subgroup T of them, with the head padded to a
/// multiple of T. Per block of keys: K and V are staged as f16, the
/// scores come from fragments (Q held in registers) into workgroup
/// memory, then every lane takes one query row and a share of the keys
/// (rows' maxima and sums combined across lanes by subgroup shuffles) and
/// writes the probabilities as f16, and P·V accumulates straight into the
/// output fragments.
///
/// Fragments cannot be scaled per row, so the output is rescaled lazily:
/// each row's probabilities are exp(s − m) against a reference maximum m
/// that only moves when a block's maximum exceeds it by more than
/// [`ATTN_RESCALE_MARGIN`] (probabilities stay ≤ e^8, well inside f16).
/// Only then (on the first block, and rarely after) do the workgroup's
/// output fragments take a round trip through workgroup memory to be
/// multiplied by exp(m_old − m_new) row by row; the decision is one
/// workgroup-uniform flag. None when the workgroup memory cannot hold the
/// smallest block.
#[allow(clippy::too_many_arguments)]
fn attention_coop_single(
    bh: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    scale: f32,
    masked: bool,
    c: Coop,
    caps: &Caps,
) -> Option<(String, [u32; 3])> {
    let t = c.tile as usize;
    let lanes = c.subgroup as usize;
    if lanes < t || !lanes.is_multiple_of(t) {
        return None;
    }
    // Lanes per query row, and output columns per lane per fragment.
    let lpr = lanes / t;
    if !t.is_multiple_of(lpr) {
        return None;
    }
    let cpl = t / lpr;
    let a = CoopAttention::new(bh, (sq, skv, d, dv), scale, c, caps, lpr, 4)?;
    let (bk, dvp) = (a.bk, a.dvp);
    let kpl = bk / lpr;
    let ofrags = dvp / t;
    // Output fragments per round trip: as many as the subgroup's score
    // rows hold.
    let per_trip = (bk / t).max(1);
    // Subgroup all-reduce over the lanes sharing a row (lane = part·T + row).
    let reduce = |v: &str, combine: &dyn Fn(&str, &str) -> String| -> String {
        let mut out = String::new();
        let mut mask = t;
        while mask < lanes {
            let other = format!("subgroupShuffleXor({v}, {mask}u)");
            let _ = write!(out, " {v} = {};", combine(v, &other));
            mask *= 2;
        }
        out
    };
    let tt = t * t;
    // Each subgroup's share of `Ss` and of `Ps`.
    let sub = t * a.ss;
    let psub = t * a.ps;
    let mut o_decl = String::new();
    let mut pv_mac = String::new();
    let mut rescale = String::new();
    let mut store = String::new();
    for f in 0..ofrags {
        let _ = writeln!(o_decl, "    var o{f} = {}();", a.ty("C", "f32"));
        let _ = writeln!(pv_mac, "{}", a.pv_line(&format!("o{f}"), f));
    }
    // Round trips of up to `per_trip` fragments through the subgroup's
    // score rows: store, scale the lane's share of its row, load back.
    for first in (0..ofrags).step_by(per_trip) {
        let trip: Vec<usize> = (first..(first + per_trip).min(ofrags)).collect();
        for (i, f) in trip.iter().enumerate() {
            let _ = writeln!(
                rescale,
                "            coopStoreT(o{f}, &Ss[sg * {sub}u + {}u], {t}u);",
                i * tt
            );
        }
        let _ = writeln!(rescale, "            workgroupBarrier();");
        for i in 0..trip.len() {
            let _ = writeln!(
                rescale,
                "            for (var e = 0u; e < {cpl}u; e++) {{ let at = sg * {sub}u + {}u + r * {t}u + part * {cpl}u + e; Ss[at] = Ss[at] * corr; }}",
                i * tt
            );
        }
        let _ = writeln!(rescale, "            workgroupBarrier();");
        for (i, f) in trip.iter().enumerate() {
            let _ = writeln!(
                rescale,
                "            o{f} = coopLoadT<{}>(&Ss[sg * {sub}u + {}u], {t}u);",
                a.ty("C", "f32"),
                i * tt
            );
        }
        let _ = writeln!(rescale, "            workgroupBarrier();");
    }
    // The epilogue: each fragment through workgroup memory, divided by the
    // row sums.
    for f in 0..ofrags {
        let _ = writeln!(
            store,
            "    coopStoreT(o{f}, &Ss[sg * {sub}u], {t}u);\n    workgroupBarrier();"
        );
        for i in 0..cpl {
            let _ = writeln!(
                store,
                "    {{ let col = {}u + part * {cpl}u + {i}u; if (qrow < {sq}u && col < {dv}u) {{ let oi = (bh * {sq}u + qrow) * {dv}u + col; dst[oi] = epi(Ss[sg * {sub}u + r * {t}u + part * {cpl}u + {i}u] / l, oi); }} }}",
                f * t,
            );
        }
        let _ = writeln!(store, "    workgroupBarrier();");
    }
    // Each lane walks its keys from its own starting point, (jj + lane)
    // mod kpl: walked in step, the lanes' score rows (`ss` apart) would
    // meet in the same bank at every step, a 32-way conflict when rows
    // are 64 floats apart; staggered, with 16-byte padded rows, the 32
    // lanes of a 16×16 tile's rows touch 32 different banks.
    let code = format!(
        "{head}    let r = lane % {t}u;
    let part = lane / {t}u;
    let qrow = q0 + sg * {t}u + r;
    let qi = min(qrow, {sqm}u);
    let srow = sg * {sub}u + r * {ss}u + part * {kpl}u;
    let prow = sg * {psub}u + r * {ps}u + part * {kpl}u;
{o_decl}    var m = -3.4028235e38;
    var l = 0.0;
    for (var j0 = 0u; j0 < {skv}u; j0 += {bk}u) {{
{stage_k}{stage_v}        workgroupBarrier();
{scores}        workgroupBarrier();
        var bm = -3.4028235e38;
        for (var jj = 0u; jj < {kpl}u; jj++) {{
            let jr = (jj + lane) % {kpl}u;
            let j = part * {kpl}u + jr;
            if (j0 + j < {skv}u) {{ var s = Ss[srow + jr]; {mask} Ss[srow + jr] = s; bm = max(bm, s); }}
        }}
       {red_max}
        if (bm > m + {margin}) {{ atomicOr(&rescale, 1u); }}
        let moved = workgroupUniformLoad(&rescale);
        if (tid == 0u) {{ atomicStore(&rescale, 0u); }}
        var corr = 1.0;
        if (moved != 0u) {{
            let mn = max(m, bm);
            corr = exp(m - mn);
            m = mn;
        }}
        var ps = 0.0;
        for (var jj = 0u; jj < {kpl}u; jj++) {{
            let jr = (jj + lane) % {kpl}u;
            let j = part * {kpl}u + jr;
            var p = 0.0;
            if (j0 + j < {skv}u) {{ p = exp(Ss[srow + jr] - m); }}
            ps = ps + p;
            Ps[prow + jr] = f16(p);
        }}
       {red_sum}
        l = l * corr + ps;
        workgroupBarrier();
        if (moved != 0u) {{
{rescale}        }}
        for (var kf = 0u; kf < {kfs}u; kf++) {{
            let pa = coopLoadT<{pty}>(&Ps[sg * {psub}u + kf * {t}u], {ps}u);
{pv_mac}        }}
        workgroupBarrier();
    }}
{store}}}
",
        head = a.head("var<workgroup> rescale: atomic<u32>;\n"),
        stage_k = a.stage_k(),
        stage_v = a.stage_v(),
        scores = a.scores(),
        mask = a.mask(masked),
        sqm = sq.saturating_sub(1),
        kfs = bk / t,
        pty = a.ty("A", "f16"),
        margin = lit(ATTN_RESCALE_MARGIN),
        ss = a.ss,
        ps = a.ps,
        red_max = reduce("bm", &|a, b| format!("max({a}, {b})")),
        red_sum = reduce("ps", &|a, b| format!("{a} + {b}")),
    );
    Some((code, a.groups()))
}

/// How far (natural log) a row's block maximum may exceed its reference
/// maximum before the output is rescaled: probabilities stay ≤ e^8 ≈
/// 2981, exact enough in f16 (max 65504) and summed in f32.
const ATTN_RESCALE_MARGIN: f32 = 8.0;

/// Attention on cooperative matrices: a workgroup of 4 subgroups takes
/// 4·T queries of one (batch, head), each subgroup T of them, with the
/// head padded to a multiple of T. Scores for a block of keys come from
/// f16 fragments (Q held in registers, K staged in workgroup memory); the
/// subgroup's first T lanes own one query row each for the softmax. Two
/// passes over the keys: the first finds each row's maximum, the second
/// accumulates exp(s − max)·V into f32 fragments and the row sums, so no
/// accumulator ever needs rescaling (which fragments cannot do per row).
/// None when the workgroup memory cannot hold the smallest block.
#[allow(clippy::too_many_arguments)]
fn attention_coop(
    bh: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    scale: f32,
    masked: bool,
    c: Coop,
    caps: &Caps,
) -> Option<(String, [u32; 3])> {
    let t = c.tile as usize;
    let lanes = c.subgroup as usize;
    if lanes < t {
        return None;
    }
    // The row sums, for the epilogue.
    let ll = COOP_ATTN_SUBGROUPS * t;
    let a = CoopAttention::new(bh, (sq, skv, d, dv), scale, c, caps, 1, ll * 4)?;
    let (bk, dvp) = (a.bk, a.dvp);
    let ofrags = dvp / t;
    let mut odecl = String::new();
    let mut pv = String::new();
    let mut out = String::new();
    for f in 0..ofrags {
        let _ = writeln!(odecl, "    var o{f} = {}();", a.ty("C", "f32"));
        let _ = writeln!(pv, "{}", a.pv_line(&format!("o{f}"), f));
        let _ = write!(
            out,
            "    coopStoreT(o{f}, &Ss[sg * {sub}u], {t}u);
    workgroupBarrier();
{copy}    workgroupBarrier();
",
            copy = strided(
                "    ",
                "lane",
                t * t,
                lanes,
                &format!(
                    "        let r = e / {t}u; let col = {c0}u + e % {t}u;
        let qrow = q0 + sg * {t}u + r;
        if (qrow < {sq}u && col < {dv}u) {{
            let oi = (bh * {sq}u + qrow) * {dv}u + col;
            dst[oi] = epi(Ss[sg * {sub}u + e] / Ls[sg * {t}u + r], oi);
        }}
",
                    sub = t * a.ss,
                    c0 = f * t,
                )
            ),
            sub = t * a.ss,
        );
    }
    // Lanes stagger their keys as in the single-pass form.
    let code = format!(
        "{head}    let srow = sg * {tss}u + min(lane, {tm}u) * {ss}u;
    let prow = sg * {tps}u + min(lane, {tm}u) * {ps}u;
    let qi = min(q0 + sg * {t}u + min(lane, {tm}u), {sqm}u);
    var m = -3.4028235e38;
    var l = 0.0;
    for (var j0 = 0u; j0 < {skv}u; j0 += {bk}u) {{
{stage_k}        workgroupBarrier();
{scores}        workgroupBarrier();
        if (lane < {t}u) {{
            for (var jj = 0u; jj < {bk}u; jj++) {{
                let j = (jj + lane) % {bk}u;
                if (j0 + j < {skv}u) {{ var s = Ss[srow + j]; {mask} m = max(m, s); }}
            }}
        }}
        workgroupBarrier();
    }}
{odecl}    for (var j0 = 0u; j0 < {skv}u; j0 += {bk}u) {{
{stage_k}{stage_v}        workgroupBarrier();
{scores}        workgroupBarrier();
        if (lane < {t}u) {{
            for (var jj = 0u; jj < {bk}u; jj++) {{
                let j = (jj + lane) % {bk}u;
                var p = 0.0;
                if (j0 + j < {skv}u) {{ var s = Ss[srow + j]; {mask} p = exp(s - m); }}
                l = l + p;
                Ps[prow + j] = f16(p);
            }}
        }}
        workgroupBarrier();
        for (var kf = 0u; kf < {kfs}u; kf++) {{
            let pa = coopLoadT<{pty}>(&Ps[sg * {tps}u + kf * {t}u], {ps}u);
{pv}        }}
        workgroupBarrier();
    }}
    if (lane < {t}u) {{ Ls[sg * {t}u + lane] = l; }}
    workgroupBarrier();
{out}}}
",
        head = a.head(&format!("var<workgroup> Ls: array<f32, {ll}>;\n")),
        stage_k = a.stage_k(),
        stage_v = a.stage_v(),
        scores = a.scores(),
        mask = a.mask(masked),
        tss = t * a.ss,
        tps = t * a.ps,
        ss = a.ss,
        ps = a.ps,
        tm = t - 1,
        sqm = sq.saturating_sub(1),
        kfs = bk / t,
        pty = a.ty("A", "f16"),
    );
    Some((code, a.groups()))
}

/// Workgroup-wide sum and max of one value per thread (256 threads). The
/// portable form reduces a tree in workgroup memory; the subgroup form
/// reduces within each subgroup in registers, then across subgroups.
const REDUCE_TREE: &str = r#"
var<workgroup> red: array<f32, 256>;
fn wg_sum(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { red[t] = red[t] + red[t + s]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}
fn wg_max(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { red[t] = max(red[t], red[t + s]); }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}
"#;

const REDUCE_SUBGROUP: &str = r#"
var<workgroup> red: array<f32, 256>;
var<private> sg_lane: u32;
var<private> sg_index: u32;
var<private> sg_count: u32;
fn wg_sum(v: f32, t: u32) -> f32 {
    let s = subgroupAdd(v);
    if (sg_lane == 0u) { red[sg_index] = s; }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < sg_count; i++) { total = total + red[i]; }
    workgroupBarrier();
    return total;
}
fn wg_max(v: f32, t: u32) -> f32 {
    let s = subgroupMax(v);
    if (sg_lane == 0u) { red[sg_index] = s; }
    workgroupBarrier();
    var m = -3.4028235e38;
    for (var i = 0u; i < sg_count; i++) { m = max(m, red[i]); }
    workgroupBarrier();
    return m;
}
"#;

/// Entry-point parameters and setup for the subgroup reductions.
const SG_PARAMS: &str = ", @builtin(subgroup_invocation_id) sgi: u32, @builtin(subgroup_id) sgid: u32, @builtin(num_subgroups) nsg: u32";
const SG_SETUP: &str = "sg_lane = sgi; sg_index = sgid; sg_count = nsg;";

/// Fills a reduction kernel template for the chosen reduction form.
fn with_reductions(template: &str, subgroups: bool) -> String {
    if subgroups {
        template
            .replace("REDUCE", REDUCE_SUBGROUP)
            .replace("MAIN_PARAMS", SG_PARAMS)
            .replace("MAIN_SETUP", SG_SETUP)
    } else {
        template
            .replace("REDUCE", REDUCE_TREE)
            .replace("MAIN_PARAMS", "")
            .replace("MAIN_SETUP", "")
    }
}

/// A workgroup per row: mean (if CENTER) and variance in two passes for
/// accuracy, then normalise and store.
const ROW_NORM: &str = r#"
REDUCE
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>MAIN_PARAMS) {
    MAIN_SETUP
    let row = wg.x + wg.y * 65535u;
    if (row >= ROWS) { return; }
    let t = lid.x;
    let base = BASE;
    var mean = 0.0;
    if (CENTER) {
        var s = 0.0;
        for (var j = t; j < ROW_LEN; j = j + 256u) { s = s + READ(j); }
        mean = wg_sum(s, t) / f32(ROW_LEN);
    }
    var q = 0.0;
    for (var j = t; j < ROW_LEN; j = j + 256u) { let d = READ(j) - mean; q = q + d * d; }
    let rstd = inverseSqrt(wg_sum(q, t) / f32(ROW_LEN) + EPS);
    for (var j = t; j < ROW_LEN; j = j + 256u) {
        var y = (READ(j) - mean) * rstd;
        AFFINE
        let oi = base + j;
        dst[oi] = epi(y, oi);
    }
}
"#;

/// Workgroups a split group norm aims for: several per SM of a large GPU,
/// so the loads of enough warps are in flight to hide memory latency.
const NORM_SPLIT_TARGET: usize = 1024;
/// Elements a split group norm's workgroup keeps at least (16 per thread).
const NORM_MIN_CHUNK: usize = 4096;

/// How a group norm of `rows` rows of `per` elements splits each row:
/// (chunks per row, elements per chunk), or None where the rows alone
/// give enough workgroups or are too short to split.
fn norm_split(rows: usize, per: usize) -> Option<(usize, usize)> {
    if rows >= NORM_SPLIT_TARGET / 2 {
        return None;
    }
    // At most one chunk per thread of the combining workgroup.
    let want = NORM_SPLIT_TARGET
        .div_ceil(rows)
        .min(per / NORM_MIN_CHUNK)
        .min(256);
    if want < 2 {
        return None;
    }
    let clen = per.div_ceil(want);
    Some((per.div_ceil(clen), clen))
}

/// The start of both split group norm passes: the workgroup's (row,
/// chunk), its thread, and the chunk's element range within the row.
const NORM_CHUNK_SETUP: &str = "MAIN_SETUP
    let id = wg.x + wg.y * 65535u;
    if (id >= TOTAL) { return; }
    let row = id / CHUNKS;
    let t = lid.x;
    let base = row * PER;
    let lo = id % CHUNKS * CLEN;
    let hi = min(lo + CLEN, PER);";

/// Split group norm, first pass: a workgroup per (row, chunk) writes the
/// chunk's mean and sum of squared deviations (two passes over the chunk,
/// as `ROW_NORM`, for accuracy) to `part`.
const NORM_STATS: &str = r#"
REDUCE
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>MAIN_PARAMS) {
    CHUNK_SETUP
    var s = 0.0;
    for (var j = lo + t; j < hi; j = j + 256u) { s = s + in0[base + j]; }
    let mean = wg_sum(s, t) / f32(hi - lo);
    var q = 0.0;
    for (var j = lo + t; j < hi; j = j + 256u) { let d = in0[base + j] - mean; q = q + d * d; }
    let m2 = wg_sum(q, t);
    if (t == 0u) { part[id * 2u] = mean; part[id * 2u + 1u] = m2; }
}
"#;

/// Split group norm, second pass (same grid): each workgroup combines its
/// row's chunk statistics (Chan et al.'s pairwise update: the row's sum
/// of squared deviations is the chunks' plus each chunk's count times its
/// mean's squared distance from the row's) and normalises its chunk.
const NORM_APPLY: &str = r#"
REDUCE
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>MAIN_PARAMS) {
    CHUNK_SETUP
    var cnt = 0.0;
    var cm = 0.0;
    var cq = 0.0;
    if (t < CHUNKS) {
        cnt = f32(min((t + 1u) * CLEN, PER) - t * CLEN);
        cm = part[(row * CHUNKS + t) * 2u];
        cq = part[(row * CHUNKS + t) * 2u + 1u];
    }
    let mean = wg_sum(cnt * cm, t) / f32(PER);
    let dm = cm - mean;
    let rstd = inverseSqrt(wg_sum(cq + cnt * dm * dm, t) / f32(PER) + EPS);
    for (var j = lo + t; j < hi; j = j + 256u) {
        var y = (in0[base + j] - mean) * rstd;
        AFFINE
        let oi = base + j;
        dst[oi] = epi(y, oi);
    }
}
"#;

/// A workgroup per softmax row (stride INNER between elements).
const SOFTMAX: &str = r#"
REDUCE
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>MAIN_PARAMS) {
    MAIN_SETUP
    let row = wg.x + wg.y * 65535u;
    if (row >= ROWS) { return; }
    let t = lid.x;
    let o = row / INNER; let i = row % INNER;
    let base = o * LEN * INNER + i;
    var m = -3.4028235e38;
    for (var j = t; j < LEN; j = j + 256u) { m = max(m, in0[base + j * INNER]); }
    m = wg_max(m, t);
    var sum = 0.0;
    for (var j = t; j < LEN; j = j + 256u) { sum = sum + exp(in0[base + j * INNER] - m); }
    sum = wg_sum(sum, t);
    for (var j = t; j < LEN; j = j + 256u) {
        let oi = base + j * INNER;
        dst[oi] = epi(exp(in0[oi] - m) / sum, oi);
    }
}
"#;

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
