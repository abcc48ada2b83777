//! The conformance suite: every op and fused pattern, planned and run on
//! every available backend, against the plain reference evaluator, on
//! random shapes and values. Errors are normalized mean squared error
//! (Σ(got − want)² / Σ want²), with a tolerance per op (ggml's
//! test-backend-ops is the model).
//!
//! Backends ([`backends`]): `cpu`, and each wgpu precision path the
//! adapter offers (on lavapipe the cooperative kernels run on emulated
//! fragments). The wgpu kernels run as they ship, without wgpu's shader
//! runtime checks, and with their workgroup memory poisoned with NaN
//! first, so a kernel that reads an element it never wrote fails here.

use proptest::prelude::*;
use sdkit_compute::backend::cpu;
use sdkit_compute::plan::{plan, Program};
use sdkit_compute::tensor::reference::{evaluate, Array};
use sdkit_compute::tensor::{
    Conv2dParams, GraphBuilder, InputKind, Op, ShapeError, TensorGraph, UpsampleMode, T,
};
use std::collections::HashMap;
use std::sync::Arc;

type Runner = fn(&Program, &HashMap<String, Array>) -> Result<Vec<Array>, String>;

fn run_cpu(p: &Program, inputs: &HashMap<String, Array>) -> Result<Vec<Array>, String> {
    let mut b = cpu::Bindings::default();
    for (name, a) in inputs {
        let data = Arc::new(a.data.clone());
        b.weights.insert(name.clone(), data.clone());
        b.inputs.insert(name.clone(), data);
    }
    cpu::run(p, &b).map_err(|e| e.to_string())
}

use sdkit_compute::backend::wgpu::{Options, WgpuBackend};

type GpuSlot = std::sync::OnceLock<Option<WgpuBackend>>;

/// One wgpu device per precision path for the whole suite (opening one per
/// case is slow): the adapter's best path (f16 weight storage where
/// SHADER_F16 exists) and the plain f32 fallback.
fn gpu(allow_f16: bool) -> Option<&'static WgpuBackend> {
    gpu_with(allow_f16, false)
}

/// The tensor-core path: matrix products on cooperative matrices with f16
/// operands and f32 accumulation, where the adapter has them.
/// On an adapter without them (lavapipe), the same kernels run on
/// emulated fragments.
fn gpu_coop() -> Option<&'static WgpuBackend> {
    static COOP: GpuSlot = std::sync::OnceLock::new();
    coop_slot(
        &COOP,
        Options {
            emulate_coopmat: true,
            poison_workgroup_memory: true,
            ..Options::default()
        },
    )
}

/// The cooperative path's other kernel forms: two-pass attention and GEMM
/// tiles staged through workgroup memory (no direct f16 reads), with
/// register prefetch.
fn gpu_coop_alt() -> Option<&'static WgpuBackend> {
    static ALT: GpuSlot = std::sync::OnceLock::new();
    let staged = sdkit_compute::backend::wgpu::codegen::tilings()
        .into_iter()
        .find(|t| !t.direct);
    coop_slot(
        &ALT,
        Options {
            two_pass_attention: true,
            gemm_tiles: staged,
            prefetch: true,
            emulate_coopmat: true,
            poison_workgroup_memory: true,
            ..Options::default()
        },
    )
}

/// Single-pass attention with its key blocks prefetched into registers
/// (the alternative slot prefetches the two-pass form).
fn gpu_coop_prefetch() -> Option<&'static WgpuBackend> {
    static PREFETCH: GpuSlot = std::sync::OnceLock::new();
    coop_slot(
        &PREFETCH,
        Options {
            prefetch: true,
            emulate_coopmat: true,
            poison_workgroup_memory: true,
            ..Options::default()
        },
    )
}

/// Single-pass attention with two query tiles a subgroup (on emulated
/// 8-lane fragments: two rows a lane).
fn gpu_coop_tiles() -> Option<&'static WgpuBackend> {
    static TILES: GpuSlot = std::sync::OnceLock::new();
    coop_slot(
        &TILES,
        Options {
            attention_tiles: 2,
            emulate_coopmat: true,
            poison_workgroup_memory: true,
            ..Options::default()
        },
    )
}

fn coop_slot(slot: &'static GpuSlot, opts: Options) -> Option<&'static WgpuBackend> {
    slot.get_or_init(|| {
        let b = WgpuBackend::with_options(&opts).ok()?;
        match b.coop {
            Some(c) => {
                eprintln!(
                    "conformance: wgpu-coop on {}: {}x{} tiles, subgroup {}{}",
                    b.adapter.name,
                    c.tile,
                    c.tile,
                    c.subgroup,
                    if c.emulated {
                        " (emulated fragments: no cooperative matrices on this adapter)"
                    } else {
                        ""
                    }
                );
                Some(b)
            }
            None => {
                eprintln!(
                    "conformance: skipped wgpu-coop: {} has no cooperative matrices with f16 inputs and f32 accumulation (or no fixed subgroup size)",
                    b.adapter.name
                );
                None
            }
        }
    })
    .as_ref()
}

/// `f16_activations`: the reduced-precision path (f16 storage everywhere,
/// f32 arithmetic), held to a looser tolerance.
fn gpu_with(allow_f16: bool, f16_activations: bool) -> Option<&'static WgpuBackend> {
    static BEST: GpuSlot = std::sync::OnceLock::new();
    static PLAIN: GpuSlot = std::sync::OnceLock::new();
    static HALF: GpuSlot = std::sync::OnceLock::new();
    let slot = match (allow_f16, f16_activations) {
        (_, true) => &HALF,
        (true, false) => &BEST,
        (false, false) => &PLAIN,
    };
    slot.get_or_init(|| {
        // The plain path turns off every optional feature.
        let opts = Options {
            allow_f16,
            allow_subgroups: allow_f16,
            // Checked on its own, to its own tolerance (`gpu_coop`).
            allow_coopmat: false,
            f16_activations,
            poison_workgroup_memory: true,
            ..Options::default()
        };
        match WgpuBackend::with_options(&opts) {
            Ok(b) => {
                eprintln!(
                    "conformance: wgpu on {} ({}, {}), f16 weights: {}, f16 activations: {}, subgroups: {}",
                    b.adapter.name,
                    b.adapter.backend,
                    b.adapter.device_type,
                    b.f16_weights,
                    b.f16_activations,
                    b.subgroups
                );
                Some(b)
            }
            Err(e) => {
                sdkit_compute::backend::wgpu::no_adapter("conformance on wgpu", e);
                None
            }
        }
    })
    .as_ref()
}

fn run_wgpu(p: &Program, inputs: &HashMap<String, Array>) -> Result<Vec<Array>, String> {
    run_on(gpu(true), p, inputs)
}

fn run_wgpu_f32(p: &Program, inputs: &HashMap<String, Array>) -> Result<Vec<Array>, String> {
    run_on(gpu(false), p, inputs)
}

fn run_wgpu_coop(p: &Program, inputs: &HashMap<String, Array>) -> Result<Vec<Array>, String> {
    run_on(gpu_coop(), p, inputs)
}

fn run_wgpu_coop_alt(p: &Program, inputs: &HashMap<String, Array>) -> Result<Vec<Array>, String> {
    run_on(gpu_coop_alt(), p, inputs)
}

fn run_wgpu_coop_prefetch(
    p: &Program,
    inputs: &HashMap<String, Array>,
) -> Result<Vec<Array>, String> {
    run_on(gpu_coop_prefetch(), p, inputs)
}

fn run_wgpu_coop_tiles(p: &Program, inputs: &HashMap<String, Array>) -> Result<Vec<Array>, String> {
    run_on(gpu_coop_tiles(), p, inputs)
}

/// The attention tests' extra backends, where the cooperative path runs
/// here: single-pass attention prefetching its key blocks, and with two
/// query tiles a subgroup.
fn attention_backends() -> Vec<(&'static str, Runner, f64)> {
    let mut v: Vec<(&'static str, Runner, f64)> = Vec::new();
    if gpu_coop_prefetch().is_some() {
        v.push(("wgpu-coop-prefetch", run_wgpu_coop_prefetch, F16_NMSE));
    }
    if gpu_coop_tiles().is_some() {
        v.push(("wgpu-coop-tiles", run_wgpu_coop_tiles, F16_NMSE));
    }
    v
}

fn run_wgpu_f16(p: &Program, inputs: &HashMap<String, Array>) -> Result<Vec<Array>, String> {
    run_on(gpu_with(true, true), p, inputs)
}

/// Error floor of the f16-storage path: f16 keeps 11 significant bits, so
/// each stored intermediate carries up to 2^-12 relative error.
const F16_NMSE: f64 = 2e-5;

fn run_on(
    g: Option<&WgpuBackend>,
    p: &Program,
    inputs: &HashMap<String, Array>,
) -> Result<Vec<Array>, String> {
    let Some(g) = g else {
        return Err("no adapter".into());
    };
    let mut b = cpu::Bindings::default();
    for (name, a) in inputs {
        let data = Arc::new(a.data.clone());
        b.weights.insert(name.clone(), data.clone());
        b.inputs.insert(name.clone(), data);
    }
    g.run(p, &b).map_err(|e| e.to_string())
}

/// (name, runner, nmse floor) for every backend and precision path
/// available here; with `emulated`, also the cooperative kernels on
/// emulated fragments where the adapter has no cooperative matrices.
fn backends(emulated: bool) -> Vec<(&'static str, Runner, f64)> {
    let mut v: Vec<(&'static str, Runner, f64)> = vec![("cpu", run_cpu, 0.0)];
    let skip = std::env::var_os("SDKIT_SKIP_WGPU").is_some();
    if skip {
        // A developer's opt-out; where an adapter is required (CI), it may
        // not switch the wgpu half of the suite off.
        sdkit_compute::backend::wgpu::no_adapter("conformance on wgpu", "SDKIT_SKIP_WGPU is set");
    } else {
        if let Some(best) = gpu(true) {
            v.push(("wgpu", run_wgpu, 0.0));
            // The fallback path only differs where the best path uses f16
            // or subgroups.
            if (best.f16_weights || best.subgroups) && gpu(false).is_some() {
                v.push(("wgpu-f32", run_wgpu_f32, 0.0));
            }
            if gpu_with(true, true).is_some_and(|g| g.f16_activations) {
                v.push(("wgpu-f16", run_wgpu_f16, F16_NMSE));
            }
            // f16 operands: the same error floor as f16 storage.
            if gpu_coop().is_some_and(|g| emulated || g.coop.is_some_and(|c| !c.emulated)) {
                v.push(("wgpu-coop", run_wgpu_coop, F16_NMSE));
                if gpu_coop_alt().is_some() {
                    v.push(("wgpu-coop-alt", run_wgpu_coop_alt, F16_NMSE));
                }
            }
        }
    }
    v
}

/// xorshift: deterministic values from the proptest-chosen seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Random values for every graph input. Inputs named `ids*` get integer
/// ids below `vocab`.
fn inputs_for(g: &TensorGraph, seed: u64, vocab: usize) -> HashMap<String, Array> {
    let mut rng = Rng(seed | 1);
    let mut m = HashMap::new();
    for kind in [InputKind::Weight, InputKind::Activation] {
        for (_, name, shape) in g.inputs(kind) {
            let n: usize = shape.iter().product();
            // Matrices and kernels scaled by 1/sqrt(fan-in), as trained
            // networks are, so deep graphs keep activations O(1) (and in
            // f16 range) instead of growing layer by layer.
            let scale = if kind == InputKind::Weight && shape.len() >= 2 {
                1.0 / (shape[1..].iter().product::<usize>() as f32).sqrt()
            } else {
                1.0
            };
            let data = (0..n)
                .map(|_| {
                    let v = rng.next() * scale;
                    if name.starts_with("ids") {
                        ((v + 1.0) * 0.5 * vocab as f32)
                            .floor()
                            .min(vocab as f32 - 1.0)
                    } else {
                        // Values on the f16 grid: f16 storage of weights
                        // and inputs is then lossless, so every path is held
                        // to the same tolerance (and comparisons such as
                        // `where(a - b, ..)` agree).
                        sdkit_compute::weights::f16_to_f32(
                            sdkit_compute::backend::wgpu::f32_to_f16_bits(v),
                        )
                    }
                })
                .collect();
            m.insert(name.to_string(), Array::new(shape.to_vec(), data));
        }
    }
    m
}

fn nmse(got: &[f32], want: &[f32]) -> f64 {
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    for (g, w) in got.iter().zip(want) {
        num += (f64::from(*g) - f64::from(*w)).powi(2);
        den += f64::from(*w).powi(2);
    }
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

thread_local! {
    /// Cases this test thread has run on emulated fragments.
    static EMULATED_CASES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Property-test cases per test that also run the cooperative kernels on
/// emulated fragments: each random shape is a new shader, and lavapipe
/// takes seconds to compile an emulated one. The fixed-shape tests below
/// always run them.
const EMULATED_CASES_PER_TEST: usize = 3;

/// Plans and runs `g` on every backend; compares with the reference.
fn check(g: TensorGraph, seed: u64, tol: f64, vocab: usize) -> Result<(), TestCaseError> {
    let emulated = EMULATED_CASES.with(|n| {
        n.set(n.get() + 1);
        n.get() <= EMULATED_CASES_PER_TEST
    });
    check_on(g, seed, tol, vocab, emulated)
}

/// [`check`] on every backend, emulated fragments included.
fn check_all(g: TensorGraph, seed: u64, tol: f64, vocab: usize) -> Result<(), TestCaseError> {
    check_on(g, seed, tol, vocab, true)
}

fn check_on(
    g: TensorGraph,
    seed: u64,
    tol: f64,
    vocab: usize,
    emulated: bool,
) -> Result<(), TestCaseError> {
    let inputs = inputs_for(&g, seed, vocab);
    check_inputs(g, &inputs, tol, emulated)
}

/// [`check_on`] with given input values.
fn check_inputs(
    g: TensorGraph,
    inputs: &HashMap<String, Array>,
    tol: f64,
    emulated: bool,
) -> Result<(), TestCaseError> {
    check_with(g, inputs, tol, backends(emulated))
}

/// [`check_inputs`] on the given backends.
fn check_with(
    g: TensorGraph,
    inputs: &HashMap<String, Array>,
    tol: f64,
    backends: Vec<(&'static str, Runner, f64)>,
) -> Result<(), TestCaseError> {
    let inputs = inputs.clone();
    let want = evaluate(&g, &inputs).map_err(TestCaseError::fail)?;
    let prog = plan(&g).map_err(|e| TestCaseError::fail(e.to_string()))?;
    // SDKIT_CONFORMANCE_TIMES=1 prints each backend's time per case
    // (on lavapipe mostly shader compilation): where the suite's time goes.
    let timed = std::env::var_os("SDKIT_CONFORMANCE_TIMES").is_some();
    for (name, run, floor) in backends {
        let tol = tol.max(floor);
        let started = std::time::Instant::now();
        let got = run(&prog, &inputs).map_err(|e| TestCaseError::fail(format!("{name}: {e}")))?;
        if timed {
            eprintln!(
                "conformance time: {name} {:.2} s, {} kernels",
                started.elapsed().as_secs_f64(),
                prog.kernels.len()
            );
        }
        prop_assert_eq!(got.len(), want.len());
        for (o, (a, b)) in got.iter().zip(&want).enumerate() {
            prop_assert_eq!(&a.shape, &b.shape);
            let err = nmse(&a.data, &b.data);
            let listing: String = prog
                .to_string()
                .lines()
                .take(40)
                .collect::<Vec<_>>()
                .join("\n");
            prop_assert!(
                err <= tol && err.is_finite(),
                "{name}: output {o} nmse {err:e} > {tol:e} got {:?} want {:?}\n{listing}",
                &a.data[..a.data.len().min(4)],
                &b.data[..b.data.len().min(4)]
            );
        }
    }
    Ok(())
}

fn build(f: impl for<'a> FnOnce(&'a GraphBuilder) -> Result<T<'a>, ShapeError>) -> TensorGraph {
    let g = GraphBuilder::new();
    match f(&g) {
        Ok(y) => g.finish(&[y]),
        Err(e) => panic!("test graph does not build: {e}"),
    }
}

fn shape(max_rank: usize, max_dim: usize) -> impl Strategy<Value = Vec<usize>> {
    proptest::collection::vec(1..=max_dim, 1..=max_rank)
}

const UNARY: &[&str] = &[
    "neg",
    "abs",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "recip",
    "tanh",
    "sigmoid",
    "silu",
    "gelu",
    "gelu_erf",
    "quick_gelu",
    "sin",
    "cos",
];

fn apply_unary<'a>(x: T<'a>, name: &str) -> T<'a> {
    // Ops with restricted domains get positive inputs.
    let pos = || x.abs().add_scalar(0.25);
    match name {
        "neg" => x.neg(),
        "abs" => x.abs(),
        "exp" => x.exp(),
        "log" => pos().log(),
        "sqrt" => pos().sqrt(),
        "rsqrt" => pos().rsqrt(),
        "recip" => pos().recip(),
        "tanh" => x.tanh(),
        "sigmoid" => x.sigmoid(),
        "silu" => x.silu(),
        "gelu" => x.gelu(),
        "gelu_erf" => x.gelu_erf(),
        "quick_gelu" => x.quick_gelu(),
        "sin" => x.sin(),
        _ => x.cos(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn unary_ops(s in shape(4, 9), op in 0..UNARY.len(), seed in any::<u64>()) {
        let g = build(|g| Ok(apply_unary(g.input("x", &s)?, UNARY[op])));
        check(g, seed, 1e-10, 0)?;
    }

    #[test]
    fn binary_ops_broadcast(s in shape(4, 7), mask in 0u32..16, op in 0usize..7, seed in any::<u64>()) {
        // The second operand drops the dims chosen by `mask` to 1.
        let s2: Vec<usize> = s.iter().enumerate().map(|(i, &d)| if mask >> i & 1 == 1 { 1 } else { d }).collect();
        let g = build(|g| {
            let (a, b) = (g.input("a", &s)?, g.input("b", &s2)?);
            match op {
                0 => a.add(b),
                1 => a.sub(b),
                2 => a.mul(b),
                3 => a.div(b.abs().add_scalar(0.5)),
                4 => a.abs().add_scalar(0.1).pow(b),
                5 => a.maximum(b),
                _ => a.minimum(b),
            }
        });
        check(g, seed, 1e-10, 0)?;
    }

    #[test]
    fn fused_elementwise_chains(s in shape(3, 16), seed in any::<u64>()) {
        let g = build(|g| {
            let (a, b, c) = (g.input("a", &s)?, g.input("b", &s)?, g.input("c", &[*s.last().unwrap_or(&1)])?);
            let t = a.mul(b)?.add(c)?.silu().mul_scalar(0.5).tanh();
            let cond = a.sub(b)?;
            cond.select(t, b.clamp(-0.3, 0.3))
        });
        let p = plan(&g).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(p.stats.dispatches, 1, "{}", p);
        check(g, seed, 1e-10, 0)?;
    }

    #[test]
    fn reductions(s in shape(4, 6), axes_mask in 1u32..16, op in 0usize..4, keep in any::<bool>(), seed in any::<u64>()) {
        let axes: Vec<usize> = (0..s.len()).filter(|i| axes_mask >> i & 1 == 1).collect();
        prop_assume!(!axes.is_empty());
        let g = build(|g| {
            let x = g.input("x", &s)?;
            match op {
                0 => x.sum(&axes, keep),
                1 => x.mean(&axes, keep),
                2 => x.max(&axes, keep),
                _ => x.var(&axes, keep),
            }
        });
        check(g, seed, 1e-9, 0)?;
    }

    #[test]
    fn softmax_any_axis(s in shape(4, 9), axis in 0usize..4, seed in any::<u64>()) {
        let axis = axis % s.len();
        let g = build(|g| g.input("x", &s)?.mul_scalar(4.0).softmax(axis));
        check(g, seed, 1e-10, 0)?;
    }

    #[test]
    fn norms(rows in 1usize..12, cols in 1usize..70, kind in 0usize..3, seed in any::<u64>()) {
        let g = build(|g| {
            let x = g.input("x", &[rows, cols])?.mul_scalar(3.0).add_scalar(1.0);
            let w = g.weight("w", &[cols])?;
            let b = g.weight("b", &[cols])?;
            match kind {
                0 => x.layer_norm(Some(w), Some(b), 1e-5),
                1 => x.layer_norm(None, None, 1e-6),
                _ => x.rms_norm(Some(w), 1e-6),
            }
        });
        check(g, seed, 1e-9, 0)?;
    }

    #[test]
    fn group_norm_silu(n in 1usize..3, groups in 1usize..5, per in 1usize..4, hw in 1usize..9, seed in any::<u64>()) {
        let c = groups * per;
        let g = build(|g| {
            let x = g.input("x", &[n, c, hw, hw])?;
            let (w, b) = (g.weight("w", &[c])?, g.weight("b", &[c])?);
            Ok(x.group_norm(groups, Some(w), Some(b), 1e-5)?.silu())
        });
        let p = plan(&g).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(p.stats.dispatches, 1);
        check(g, seed, 1e-9, 0)?;
    }

    #[test]
    fn matmul_views(b in 1usize..4, m in 1usize..40, k in 1usize..40, n in 1usize..40, form in 0usize..4, seed in any::<u64>()) {
        let g = build(|g| match form {
            // Batched.
            0 => g.input("a", &[b, m, k])?.matmul(g.input("x", &[b, k, n])?),
            // Weight broadcast across the batch, transposed view (linear).
            1 => g.input("a", &[b, m, k])?.linear(g.weight("w", &[n, k])?, Some(g.weight("bias", &[n])?)),
            // Transposed left operand.
            2 => g.input("a", &[b, k, m])?.transpose(1, 2)?.matmul(g.input("x", &[b, k, n])?),
            // Broadcast batch on the left, with a GELU epilogue.
            _ => Ok(g.input("a", &[1, m, k])?.matmul(g.input("x", &[b, k, n])?)?.gelu()),
        });
        check(g, seed, 1e-9, 0)?;
    }

    #[test]
    fn conv2d_params(n in 1usize..3, cin_g in 1usize..4, cout_g in 1usize..4, groups in 1usize..3,
                     hw in 3usize..12, k in 1usize..4, stride in 1usize..3, pad in 0usize..2,
                     dil in 1usize..3, residual in any::<bool>(), seed in any::<u64>()) {
        let (cin, cout) = (cin_g * groups, cout_g * groups);
        prop_assume!(hw + 2 * pad > dil * (k - 1));
        let p = Conv2dParams { stride: [stride; 2], padding: [pad; 2], dilation: [dil; 2], groups };
        let g = build(|g| {
            let x = g.input("x", &[n, cin, hw, hw])?;
            let w = g.weight("w", &[cout, cin_g, k, k])?;
            let bias = g.weight("bias", &[cout])?;
            let y = x.conv2d(w, Some(bias), p)?;
            if residual {
                let s = y.shape();
                y.add(g.input("res", &s)?)
            } else {
                Ok(y)
            }
        });
        let prog = plan(&g).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(prog.stats.dispatches, 1);
        check(g, seed, 1e-9, 0)?;
    }

    #[test]
    fn upsample(n in 1usize..3, c in 1usize..4, h in 1usize..9, w in 1usize..9, oh in 1usize..17, ow in 1usize..17, mode in 0usize..3, seed in any::<u64>()) {
        let m = match mode {
            0 => UpsampleMode::Nearest,
            1 => UpsampleMode::Bilinear { align_corners: false },
            _ => UpsampleMode::Bilinear { align_corners: true },
        };
        let g = build(|g| g.input("x", &[n, c, h, w])?.upsample(m, oh, ow));
        check(g, seed, 1e-10, 0)?;
    }

    #[test]
    fn attention_masked(b in 1usize..3, h in 1usize..4, sq in 1usize..80, skv in 1usize..80, d in 1usize..24, masked in any::<bool>(), seed in any::<u64>()) {
        let g = build(|g| {
            let q = g.input("q", &[b, h, sq, d])?;
            let k = g.input("k", &[b, h, skv, d])?;
            let v = g.input("v", &[b, h, skv, d])?;
            let mask = if masked { Some(g.input("mask", &[sq, skv])?) } else { None };
            q.attention(k, v, mask, 1.0 / (d as f32).sqrt())
        });
        check(g, seed, 1e-9, 0)?;
    }

    #[test]
    fn gather_concat_pad(v in 2usize..20, d in 1usize..9, len in 1usize..12, seed in any::<u64>()) {
        let g = build(|g| {
            let t = g.weight("table", &[v, d])?;
            let e = t.gather(g.input("ids", &[1, len])?)?;
            let other = g.input("x", &[1, len, 3])?;
            let cat = g.concat(&[e, other], 2)?;
            cat.pad(&[(0, 0), (1, 2), (0, 1)], -1.5)
        });
        check(g, seed, 1e-12, v)?;
    }

    /// Reflect padding (ImageBlur/ImageSharpen pad this way) of a
    /// channels-last image read through a permuted view, as the image
    /// stages do; each pad below its dimension.
    #[test]
    fn reflect_pad(n in 1usize..3, h in 1usize..9, w in 1usize..9, c in 1usize..4, seed in any::<u64>(), f in any::<[u8; 4]>()) {
        let pads = [
            (0, 0),
            (0, 0),
            (f[0] as usize % h, f[1] as usize % h),
            (f[2] as usize % w, f[3] as usize % w),
        ];
        let g = build(|g| {
            let x = g.input("x", &[n, h, w, c])?;
            x.permute(&[0, 3, 1, 2])?.pad_reflect(&pads)?.add_scalar(0.5).permute(&[0, 2, 3, 1])
        });
        check(g, seed, 1e-12, 0)?;
    }

    #[test]
    fn view_chains(a in 1usize..5, b in 1usize..5, c in 1usize..5, start in 0usize..2, seed in any::<u64>()) {
        prop_assume!(start < c);
        let g = build(|g| {
            let x = g.input("x", &[a, b, c])?;
            // permute → slice → expand → reshape (forcing a copy when the
            // strides cannot express it) → elementwise.
            let y = x.permute(&[2, 0, 1])?.slice(0, start, c)?;
            let s = y.shape();
            let y = y.reshape(&[1, s[0], s[1], s[2]])?.expand(&[2, s[0], s[1], s[2]])?;
            let z = y.reshape(&[2 * s[0] * s[1] * s[2]])?;
            Ok(z.exp())
        });
        check(g, seed, 1e-10, 0)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Rows of 8192+ elements in few groups: the GPU splits each row's
    /// statistics over chunks and combines them (`norm_split`), chunk
    /// lengths not dividing the row.
    #[test]
    fn group_norm_long_rows(n in 1usize..3, groups in 1usize..4, per in 1usize..3, hw in 91usize..140, affine in any::<bool>(), seed in any::<u64>()) {
        let c = groups * per;
        let g = build(|g| {
            let x = g.input("x", &[n, c, hw, hw])?;
            let y = if affine {
                let (w, b) = (g.weight("w", &[c])?, g.weight("b", &[c])?);
                x.group_norm(groups, Some(w), Some(b), 1e-5)?
            } else {
                x.group_norm(groups, None, None, 1e-6)?
            };
            y.silu().add(x)
        });
        check(g, seed, 1e-9, 0)?;
    }

    #[test]
    fn rope_pairs(b in 1usize..3, h in 1usize..4, l in 1usize..9, half in 1usize..9, shared in any::<bool>(), seed in any::<u64>()) {
        let fb = if shared { 1 } else { b };
        let g = build(|g| {
            let x = g.input("x", &[b, h, l, 2 * half])?;
            let f = g.input("freqs", &[fb, l, half, 2, 2])?;
            x.rope(f)
        });
        check(g, seed, 1e-12, 0)?;
    }
}

#[test]
fn sd_blocks_match_reference() {
    use sdkit_compute::plan::samples::{resblock_graph, transformer_graph};
    let rb = resblock_graph(2, 64, 8, 128).expect("builds");
    check_all(rb, 7, 1e-9, 0).expect("resblock");
    let tb = transformer_graph(1, 64, 6, 12, 48, 8).expect("builds");
    check_all(tb, 11, 1e-9, 0).expect("transformer");
}

#[test]
fn large_products_use_every_tile_shape() {
    // Big enough for the 128×128 cooperative tiles (at least 128 of them)
    // with ragged edges on every side; the proptests above stay within the
    // 64×64 ones.
    let g = build(|g| {
        g.input("a", &[8, 520, 72])?
            .matmul(g.input("b", &[8, 72, 515])?)
    });
    check_all(g, 5, 1e-9, 0).expect("batched matmul");
    let p = same_3x3();
    let g = build(|g| {
        g.input("x", &[2, 8, 63, 65])?.conv2d(
            g.weight("w", &[260, 8, 3, 3])?,
            Some(g.weight("bias", &[260])?),
            p,
        )
    });
    check_all(g, 9, 1e-9, 0).expect("conv");
    // Depths of whole fragments: f16 weights read straight from their
    // binding, with row counts that are not (edge fragments clamp).
    // (Widths of 136 are not whole fragments: staged instead.)
    for n in [136, 144] {
        let g = build(|g| {
            g.input("a", &[4, 300, 128])?
                .linear(g.weight("w", &[n, 128])?, Some(g.weight("bias", &[n])?))
        });
        check_all(g, 11, 1e-9, 0).expect("linear");
    }
    let g = build(|g| {
        g.input("x", &[2, 16, 40, 40])?
            .conv2d(g.weight("w", &[144, 16, 3, 3])?, None, p)
    });
    check_all(g, 13, 1e-9, 0).expect("conv, direct weights");
}

#[test]
fn staged_operands_in_16_byte_units() {
    // Views whose unit-stride axis and offsets are whole 16-byte units
    // are staged a unit at a time on the cooperative paths: A along its
    // depth and along its rows (transposed), B along its columns and
    // along its depth (a linear's weight), at an offset into its tensor
    // (a slice), with edges that are not whole blocks. Depths and widths
    // that are whole units but not whole depth steps end inside a step.
    //
    // Attention stages K and V in units where its views allow, and convs
    // on cooperative matrices read a channels-last copy of their input.
    //
    // The suite's cooperative paths keep activations in f32 (units of 4);
    // f16 activations (units of 8) run here too, on staged tiles with
    // two workgroup stages.
    static HALF: GpuSlot = std::sync::OnceLock::new();
    let half = coop_slot(
        &HALF,
        Options {
            f16_activations: true,
            gemm_tiles: sdkit_compute::backend::wgpu::codegen::tilings()
                .into_iter()
                .find(|t| !t.direct),
            double_buffer: true,
            emulate_coopmat: true,
            poison_workgroup_memory: true,
            ..Options::default()
        },
    );
    let graphs = [
        (
            "A along depth, sliced B along columns",
            build(|g| {
                g.input("a", &[2, 70, 40])?
                    .matmul(g.input("b", &[2, 40, 88])?.slice(2, 8, 88)?)
            }),
        ),
        (
            "A along rows",
            build(|g| {
                g.input("a", &[2, 24, 40])?
                    .transpose(1, 2)?
                    .matmul(g.input("b", &[2, 24, 20])?)
            }),
        ),
        (
            "sliced A, B along depth",
            build(|g| {
                g.input("a", &[3, 50, 48])?
                    .slice(2, 8, 48)?
                    .linear(g.weight("w", &[36, 40])?, Some(g.weight("bias", &[36])?))
            }),
        ),
        (
            // K and V as heads of a [batch, tokens, heads·width] tensor
            // (as split from a projection), over several key blocks.
            "attention, head views",
            build(|g| {
                let heads = |name: &str, len: usize| -> Result<T<'_>, ShapeError> {
                    g.input(name, &[1, len, 2, 40])?.transpose(1, 2)
                };
                heads("q", 70)?.attention(heads("k", 150)?, heads("v", 150)?, None, 0.16)
            }),
        ),
        (
            // Channels-last convs: the input copied as f16 units of 8
            // channels, a tap's units read with the padding as zeros;
            // strided and dilated, channels not a whole depth step.
            "conv, channels last",
            build(|g| {
                let p = Conv2dParams {
                    stride: [2, 1],
                    padding: [1, 2],
                    dilation: [1, 2],
                    groups: 1,
                };
                g.input("x", &[2, 24, 13, 11])?.conv2d(
                    g.weight("w", &[20, 24, 3, 3])?,
                    Some(g.weight("bias", &[20])?),
                    p,
                )
            }),
        ),
        (
            // Whole blocks and no epilogue: the cooperative kernel stores
            // its fragments straight into an f32 output.
            "whole blocks, fragments stored directly",
            build(|g| {
                g.input("a", &[2, 64, 48])?
                    .matmul(g.input("b", &[2, 48, 128])?)
            }),
        ),
        (
            // A 1×1 conv reads its input as a view: pixels in units.
            "conv 1x1",
            build(|g| {
                let p = Conv2dParams {
                    padding: [0; 2],
                    ..same_3x3()
                };
                g.input("x", &[2, 20, 8, 6])?.conv2d(
                    g.weight("w", &[12, 20, 1, 1])?,
                    Some(g.weight("bias", &[12])?),
                    p,
                )
            }),
        ),
        (
            "conv, channels last, same size",
            build(|g| {
                g.input("x", &[1, 16, 9, 9])?.conv2d(
                    g.weight("w", &[8, 16, 3, 3])?,
                    None,
                    same_3x3(),
                )
            }),
        ),
    ];
    for (seed, (what, g)) in graphs.into_iter().enumerate() {
        let inputs = inputs_for(&g, seed as u64, 0);
        let want = evaluate(&g, &inputs).expect("reference");
        let prog = plan(&g).expect("plans");
        if half.is_some() {
            let got = run_on(half, &prog, &inputs).expect(what);
            let err = nmse(&got[0].data, &want[0].data);
            assert!(err <= F16_NMSE, "{what}: f16 activations, nmse {err:e}");
        }
        check_inputs(g, &inputs, 1e-9, true).expect(what);
    }
}

/// A 3×3 convolution's parameters that keep the image size.
fn same_3x3() -> Conv2dParams {
    Conv2dParams {
        stride: [1; 2],
        padding: [1; 2],
        dilation: [1; 2],
        groups: 1,
    }
}

/// The cooperative path (where there is one) splits `g`'s product.
fn assert_splits(g: &TensorGraph) {
    if let Some(b) = gpu_coop() {
        let prog = plan(g).expect("plans");
        assert!(b.scratch_bytes(&prog) > 0, "not split:\n{prog}");
    }
}

#[test]
fn deep_products_split_the_depth() {
    // Few output tiles over a long depth (the UNet's deepest levels): the
    // cooperative kernels split the depth over workgroups and a second
    // pass sums the parts and applies the epilogue (bias, residual, GELU).
    let p = same_3x3();
    let g = build(|g| {
        let c = g.input("x", &[2, 64, 4, 5])?.conv2d(
            g.weight("w", &[64, 64, 3, 3])?,
            Some(g.weight("bias", &[64])?),
            p,
        )?;
        let s = c.shape();
        c.add(g.input("res", &s)?)
    });
    assert_splits(&g);
    check_all(g, 31, 1e-9, 0).expect("deep conv");
    let g = build(|g| {
        g.input("a", &[1, 16, 2048])?
            .linear(g.weight("w", &[64, 2048])?, Some(g.weight("bias", &[64])?))
            .map(|y| y.gelu())
    });
    assert_splits(&g);
    check_all(g, 32, 1e-9, 0).expect("long linear");
    // Staged operands and a depth that ends inside a step.
    let g = build(|g| {
        g.input("a", &[2, 20, 1000])?
            .matmul(g.input("b", &[2, 1000, 24])?)
    });
    check_all(g, 33, 1e-9, 0).expect("long batched matmul");
}

#[test]
fn attention_heads_of_sd_widths() {
    // SD's head widths (40, 80, 160: padded to the cooperative tile, and
    // the widest with smaller key blocks) over several query and key
    // blocks with ragged ends, the first with an additive mask.
    for (i, d) in [40usize, 80, 160].into_iter().enumerate() {
        let g = build(|g| {
            let q = g.input("q", &[1, 2, 200, d])?;
            let k = g.input("k", &[1, 2, 150, d])?;
            let v = g.input("v", &[1, 2, 150, d])?;
            let mask = if i == 0 {
                Some(g.input("mask", &[200, 150])?)
            } else {
                None
            };
            q.attention(k, v, mask, 1.0 / (d as f32).sqrt())
        });
        // Emulated fragments are 8×8 (lavapipe's 32 KiB of workgroup
        // memory): 80 and 160 are whole fragments there as 40 is, and the
        // 160-wide head still takes full key blocks, so the wider heads
        // add only shader compilation (35 s and two minutes cold) and no
        // coverage; real cooperative matrices (16×16: 40 padded to 48)
        // run them.
        let inputs = inputs_for(&g, 20 + i as u64, 0);
        let mut on = backends(d == 40);
        if d == 40 {
            on.extend(attention_backends());
        }
        check_with(g, &inputs, 1e-9, on).expect("attention");
    }
}

#[test]
fn attention_with_growing_scores_rescales() {
    // Scores that climb along the keys in every other row (a ramp in the
    // additive mask): every block or two raises those rows' maxima by more
    // than the single-pass kernel's margin, so the workgroup's output
    // fragments are rescaled between blocks that only accumulate. The
    // climbing rows' old sums shrink to nothing; the flat rows between
    // them keep theirs (factors of 1, or between e^-8 and 1 where their
    // maximum grew a little), so a row scaled by the wrong factor, or
    // fragments put back in the wrong place, shows.
    let (sq, skv) = (40, 200);
    let g = build(|g| {
        g.input("q", &[1, 2, sq, 24])?.attention(
            g.input("k", &[1, 2, skv, 24])?,
            g.input("v", &[1, 2, skv, 24])?,
            Some(g.input("mask", &[sq, skv])?),
            0.2,
        )
    });
    let mut inputs = inputs_for(&g, 41, 0);
    // Steps of 1/4 stay exact in f16 storage; the jitter (up to one)
    // keeps the flat rows' softmaxes apart.
    let ramp = (0..sq * skv)
        .map(|i| {
            let (row, key) = (i / skv, i % skv);
            let climb = if row % 2 == 0 { 0.25 * key as f32 } else { 0.0 };
            climb + 0.25 * ((row * 7 + key * 13) % 5) as f32
        })
        .collect();
    inputs.insert("mask".into(), Array::new(vec![sq, skv], ramp));
    let mut on = backends(true);
    on.extend(attention_backends());
    check_with(g, &inputs, 1e-9, on).expect("attention");
}

#[test]
fn unet_shaped_graph_matches_reference() {
    // Down and up levels, skip concatenations, upsampling: the whole
    // planned Program (fusion, views, arena reuse) against unfused
    // evaluation. The planner's work, checked on every native backend;
    // the cooperative kernels' epilogues on these blocks are checked by
    // `sd_blocks_match_reference`, and their emulated shaders here would
    // cost CI minutes of lavapipe compilation (a cold shader cache) for
    // nothing more.
    let g = sdkit_compute::plan::samples::unet_like_graph(1, 32, 8, 2).expect("builds");
    check_on(g, 3, 1e-8, 0, false).expect("unet");
}

#[test]
fn every_op_is_covered() {
    // A new op must join this suite: the match fails to compile otherwise.
    let names = |op: &Op| match op {
        Op::Input { .. } | Op::Constant(_) => "leaf",
        Op::Unary(_) => "unary_ops",
        Op::Binary(_) => "binary_ops_broadcast",
        Op::Where | Op::Clamp { .. } => "fused_elementwise_chains",
        Op::Cast(_) => "cast (identity on CPU f32)",
        Op::Reduce { .. } => "reductions",
        Op::Softmax { .. } => "softmax_any_axis",
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => "norms",
        Op::GroupNorm { .. } => "group_norm_silu",
        Op::MatMul => "matmul_views",
        Op::Conv2d(_) => "conv2d_params",
        Op::Upsample { .. } => "upsample",
        Op::Attention { .. } => "attention_masked",
        Op::Gather | Op::Concat { .. } | Op::Pad { .. } => "gather_concat_pad",
        Op::Reshape | Op::Permute { .. } | Op::Slice { .. } | Op::Expand => "view_chains",
    };
    assert_eq!(names(&Op::MatMul), "matmul_views");
}
