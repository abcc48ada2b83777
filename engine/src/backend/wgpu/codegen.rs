//! WGSL generation: one compute shader per Program kernel.
//!
//! Shapes, strides and offsets are baked in as constants, so each shader is
//! specialised to its kernel (the driver folds the index arithmetic) and the
//! source text itself is the pipeline cache key: a sampling loop that
//! replays one Program compiles every kernel once. Fused elementwise work is
//! generated from the kernel's [`Expr`]: as the whole body of an elementwise
//! kernel, or as the `epi` function anchor kernels apply before each store.

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
/// argument because some drivers return NaN where exp overflows.
const PRELUDE: &str = r#"
fn tanh_s(x: f32) -> f32 { return tanh(clamp(x, -15.0, 15.0)); }
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
}

impl Operand {
    pub fn whole(f16: bool) -> Self {
        Operand {
            f16,
            chunks: 1,
            chunk_elems: usize::MAX,
        }
    }
}

/// Generates the shader for a kernel; `operands` describes each input
/// then the output.
// Each arm sets the launch grid after emitting its source; a late `let`
// keeps the arms' long bodies flat.
#[allow(clippy::needless_late_init)]
pub fn generate(k: &Kernel, operands: &[Operand], subgroups: bool) -> Result<Shader, String> {
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
                "fn load_b(z: u32, r: u32, c: u32) -> f32 {{ return in1[{bo}u + z * {bbs}u + r * {brs}u + c * {bcs}u]; }}"
            );
            let store = format!(
                "fn store(z: u32, r: u32, c: u32, v: f32) {{ let oi = z * {}u + r * {n}u + c; dst[oi] = epi(v, oi); }}",
                m * n
            );
            src.push_str(&gemm(*m, *n, *kk, &load_a, &load_b, &store));
            if *batch > 65535 {
                return Err(format!("batch {batch} exceeds 65535 workgroups"));
            }
            groups = [n.div_ceil(64) as u32, m.div_ceil(64) as u32, *batch as u32];
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
            // GEMM per (image, group): rows = output channels of the group,
            // cols = output pixels, depth = input channels x kernel taps.
            let load_a = format!(
                "fn load_a(z: u32, r: u32, c: u32) -> f32 {{ let g = z % {g}u; return in1[(g * {og}u + r) * {kk}u + c]; }}"
            );
            let load_b = format!(
                "fn load_b(z: u32, r: u32, c: u32) -> f32 {{
    let b = z / {g}u; let g = z % {g}u;
    let ci = r / {khw}u; let ky = (r / {kw}u) % {kh}u; let kx = r % {kw}u;
    let oy = c / {ow}u; let ox = c % {ow}u;
    let iy = i32(oy * {sh}u + ky * {dh}u) - {ph}; let ix = i32(ox * {sw}u + kx * {dw}u) - {pw};
    if (iy < 0 || ix < 0 || iy >= {h} || ix >= {w}) {{ return 0.0; }}
    return in0[((b * {c}u + g * {cg}u + ci) * {h}u + u32(iy)) * {w}u + u32(ix)];
}}",
                khw = kh * kw,
                sh = params.stride[0],
                sw = params.stride[1],
                dh = params.dilation[0],
                dw = params.dilation[1],
                ph = params.padding[0],
                pw = params.padding[1],
            );
            let bias_term = if *bias { "in2[oc]" } else { "0.0" };
            let store = format!(
                "fn store(z: u32, r: u32, c: u32, v: f32) {{ let b = z / {g}u; let g = z % {g}u; let oc = g * {og}u + r; let oi = (b * {o}u + oc) * {ohw}u + c; dst[oi] = epi(v + {bias_term}, oi); }}",
                ohw = oh * ow
            );
            src.push_str(&gemm(og, oh * ow, kk, &load_a, &load_b, &store));
            let z = n * g;
            if z > 65535 {
                return Err(format!("batch x groups {z} exceeds 65535 workgroups"));
            }
            groups = [
                (oh * ow).div_ceil(64) as u32,
                og.div_ceil(64) as u32,
                z as u32,
            ];
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
            let mask = if *masked {
                format!("s = s + in3[i * {skv}u + j];")
            } else {
                String::new()
            };
            // One thread per query row with online softmax: no sq x skv
            // buffer, one pass over keys and values.
            let body = format!(
                "    let bh = gi / {sq}u; let i = gi % {sq}u;
    var qr: array<f32, {d}>;
    for (var t = 0u; t < {d}u; t++) {{ qr[t] = in0[q_off(bh, i, t)] * {sc}; }}
    var acc: array<f32, {dv}>;
    var m = -3.4028235e38; var l = 0.0;
    for (var j = 0u; j < {skv}u; j++) {{
        var s = 0.0;
        for (var t = 0u; t < {d}u; t++) {{ s = s + qr[t] * in1[k_off(bh, j, t)]; }}
        {mask}
        let mn = max(m, s);
        let corr = exp(m - mn);
        let p = exp(s - mn);
        l = l * corr + p;
        for (var t = 0u; t < {dv}u; t++) {{ acc[t] = acc[t] * corr + p * in2[v_off(bh, j, t)]; }}
        m = mn;
    }}
    for (var t = 0u; t < {dv}u; t++) {{ let oi = gi * {dv}u + t; dst[oi] = epi(acc[t] / l, oi); }}",
                sc = lit(*scale),
            );
            let rows = b * h * sq;
            src.push_str(&format!(
                "@compute @workgroup_size(256)\nfn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{\n    {LINEAR_ID}\n    if (gi >= {rows}u) {{ return; }}\n{body}\n}}\n"
            ));
            groups = grid(rows);
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
    // Every input read goes through `rd{j}(i)` and every store through
    // `wr(i, v)`: they widen f16 storage to f32 (arithmetic stays f32) and
    // pick the binding of a tensor split over several.
    let body = route_writes(&route_reads(&src, k.inputs.len()));
    if operands.len() != k.inputs.len() + 1 {
        return Err(format!(
            "{} operand layouts for {} inputs and an output",
            operands.len(),
            k.inputs.len()
        ));
    }
    let mut head = String::new();
    if operands.iter().any(|o| o.f16) {
        head.push_str("enable f16;\n");
    }
    // Subgroup builtins need the device's SUBGROUP feature; naga takes no
    // `enable subgroups;` directive yet.
    let mut binding = 0;
    for (j, op) in operands.iter().enumerate() {
        let is_out = j == k.inputs.len();
        let name = if is_out {
            "dst".to_string()
        } else {
            format!("in{j}")
        };
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
    head.push_str(&body);
    Ok(Shader {
        source: head,
        groups,
    })
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

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// A 64x64-tiled GEMM (16x16 threads, 4x4 outputs each, K-steps of 16
/// through workgroup memory) over `load_a(z, row, k)`, `load_b(z, k, col)`
/// and `store(z, row, col, v)`. Workgroup (x, y, z) = (col tile, row tile,
/// batch).
fn gemm(m: usize, n: usize, k: usize, load_a: &str, load_b: &str, store: &str) -> String {
    format!(
        "{load_a}
{load_b}
{store}
var<workgroup> As: array<f32, 1024>;
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
            if (col0 + nb < {n}u && k0 + kb < {k}u) {{ vb = load_b(z, k0 + kb, col0 + nb); }}
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
