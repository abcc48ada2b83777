//! One denoiser step of a full-size SD1.5 UNet (ldm layout, random
//! weights): batch 2 (CFG), 64×64 latent (a 512² image), 77-token context,
//! on the wgpu backend, beside PyTorch running the same architecture in
//! fp16 on the same GPU in the same run (benches/gpu/unet_torch.py).
//!
//! `cargo bench --bench unet_step` (best adapter, or `SDKIT_ADAPTER=name`);
//! `SDKIT_BENCH_DEVICE=cpu` runs it on the CPU backend in f32 beside
//! PyTorch's CPU f32, then (on CPUs with AMX) with bf16 products beside
//! PyTorch in bf16 (both on all cores, or `RAYON_NUM_THREADS`).
//! `SDKIT_BENCH_BUDGETS=1` runs it under device budgets of 100%, 50% and
//! 25% of the UNet's weights: time and bytes moved per step beside the
//! residency planner's lower bound and its predicted time (the resident
//! step plus the streamed bytes at the measured host→device bandwidth);
//! `SDKIT_BENCH_RUNS=N` times N steps per budget (default 3);
//! `SDKIT_BENCH_LATENT=16` runs another latent size (a multiple of 8).
//! `SDKIT_BENCH_LOOP=1` times a 10-step Euler loop with CFG both ways:
//! the host loop (each step's two predictions read back, CFG and the step
//! on the host, the latent and context uploaded again) and the device
//! loop (CFG and the step in the UNet's program, the latent carried on
//! the device, only the result read back), as the sampler runs them.
//! `SDKIT_BENCH_SMALL=1` runs a width-32, 16×16 version for software
//! adapters; `SDKIT_BENCH_PLAN_ONLY=1` stops after planning. PyTorch is
//! `python3` or `SDKIT_BENCH_PYTHON`. Times cover
//! dispatch through completion of one step, weights and inputs resident.

mod common;

use sdkit_compute::backend::cpu::Bindings;
use sdkit_compute::backend::wgpu::{Options, Tuning, WgpuBackend};
use sdkit_compute::plan::plan;
use sdkit_compute::tensor::{GraphBuilder, InputKind, TensorGraph};
use sdkit_nodes::models::detect::{Heads, UnetConfig};
use sdkit_nodes::models::unet::unet;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

fn sd15(model_channels: usize) -> UnetConfig {
    UnetConfig {
        in_channels: 4,
        out_channels: 4,
        model_channels,
        num_res_blocks: vec![2; 4],
        channel_mult: vec![1, 2, 4, 4],
        transformer_depth: vec![1, 1, 1, 1, 1, 1, 0, 0],
        // ComfyUI pops this list from the end: the first output blocks
        // (the deepest level, no attention) take the trailing zeros.
        transformer_depth_output: vec![1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        transformer_depth_middle: Some(1),
        use_linear_in_transformer: false,
        context_dim: Some(768),
        adm_in_channels: None,
    }
}

/// Small values from a fixed hash: scaled by 1/sqrt(fan-in) so 25 blocks
/// deep stay in f16 range; norm scales near 1.
fn fill(name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let fan_in = (n / shape.first().copied().unwrap_or(1).max(1)).max(1) as f32;
    let mut s: u64 = name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let u = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if shape.len() == 1 && !name.ends_with("bias") {
                1.0 + 0.1 * u
            } else if shape.len() == 1 {
                0.05 * u
            } else {
                u / fan_in.sqrt()
            }
        })
        .collect()
}

fn graph(small: bool) -> (TensorGraph, String) {
    graph_with(small, false)
}

/// The UNet graph; `device_loop`: fed from a carried latent `lat`
/// (divided by `c_in`, once per conditioning) and ending in CFG and an
/// Euler step, outputs the next latent and the prediction.
fn graph_with(small: bool, device_loop: bool) -> (TensorGraph, String) {
    let (mc, mut hw) = if small { (32, 16) } else { (320, 64) };
    // SDKIT_BENCH_LATENT: another latent size (a full-size model at a small
    // latent keeps the weights, and so the residency numbers, of SD1.5 at
    // a compute cost a software adapter can finish).
    if let Some(v) = std::env::var("SDKIT_BENCH_LATENT")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        hw = v.max(8) / 8 * 8;
    }
    let cfg = sd15(mc);
    let g = GraphBuilder::new();
    let per = 4 * hw * hw;
    let out = (|| {
        let (x, head) = if device_loop {
            let lat = g.input("lat", &[1, 4, hw, hw])?;
            let x = lat
                .div(g.input("c_in", &[1])?)?
                .reshape(&[1, per])?
                .expand(&[2, per])?
                .reshape(&[2, 4, hw, hw])?;
            (x, Some(lat))
        } else {
            (g.input("x", &[2, 4, hw, hw])?, None)
        };
        let t = g.input("t", &[2])?;
        let c = g.input("context", &[2, 77, 768])?;
        let eps = unet(
            &g,
            &cfg,
            Heads::Count(8),
            "model.diffusion_model.",
            x,
            t,
            c,
            None,
            None,
        )?;
        let Some(lat) = head else {
            return Ok(vec![eps]);
        };
        // x − ε·σ per conditioning, uncond + (cond − uncond)·cfg, then
        // x + (x − D)/σ·dt.
        let sigma = g.input("sigma", &[1])?;
        let den = |k: usize| lat.sub(eps.slice(0, k, k + 1)?.mul(sigma)?);
        let (cond, uncond) = (den(0)?, den(1)?);
        let d = uncond.add(cond.sub(uncond)?.mul(g.input("cfg", &[1])?)?)?;
        let next = lat.add(lat.sub(d)?.div(sigma)?.mul(g.input("dt", &[1])?)?)?;
        Ok::<_, sdkit_compute::tensor::ShapeError>(vec![next, d])
    })();
    let y = out.expect("SD1.5 UNet graph");
    (
        g.finish(&y),
        format!("SD1.5 UNet, batch 2, {hw}x{hw} latent, width {mc}"),
    )
}

fn bindings(g: &TensorGraph) -> Bindings {
    let mut b = Bindings::default();
    for (_, name, shape) in g.inputs(InputKind::Weight) {
        b.weights
            .insert(name.to_string(), Arc::new(fill(name, shape)));
    }
    for (_, name, shape) in g.inputs(InputKind::Activation) {
        let data = if name == "t" {
            vec![999.0, 999.0]
        } else {
            fill(name, shape)
        };
        b.inputs.insert(name.to_string(), Arc::new(data));
    }
    b
}

fn torch_time(py: &str, small: bool, cpu: bool) -> Result<f64, String> {
    torch_time_args(py, small, cpu, &[])
}

fn torch_time_args(py: &str, small: bool, cpu: bool, extra: &[&str]) -> Result<f64, String> {
    // From the working directory first: the bench binary may run on another
    // machine than the one it was built on (benches/gpu/device.sh).
    let rel = "benches/gpu/unet_torch.py";
    let script = if std::path::Path::new(rel).exists() {
        rel
    } else {
        concat!(env!("CARGO_MANIFEST_DIR"), "/benches/gpu/unet_torch.py")
    };
    let mut cmd = Command::new(py);
    cmd.arg(script);
    if small {
        cmd.arg("--small");
    }
    if cpu {
        cmd.arg("--cpu");
    }
    cmd.args(extra);
    let out = cmd.output().map_err(|e| format!("{py}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("seconds_per_step "))
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| {
            let err = String::from_utf8_lossy(&out.stderr);
            format!(
                "no timing from {script}: {}",
                err.lines().last().unwrap_or("")
            )
        })
}

fn main() {
    let small = std::env::var_os("SDKIT_BENCH_SMALL").is_some();
    let adapter = std::env::var("SDKIT_ADAPTER").ok();
    let py = std::env::var("SDKIT_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let (g, what) = graph(small);
    let t = Instant::now();
    let prog = match plan(&g) {
        Ok(p) => p,
        Err(e) => {
            println!("unet_step: plan failed: {e}");
            return;
        }
    };
    println!(
        "unet_step: {what}: planned in {:.2} s, {} dispatches, arena {:.1} MiB",
        t.elapsed().as_secs_f64(),
        prog.stats.dispatches,
        prog.stats.arena_bytes as f64 / (1 << 20) as f64
    );
    let params: usize = g
        .inputs(InputKind::Weight)
        .iter()
        .map(|(_, _, s)| s.iter().product::<usize>())
        .sum();
    println!("unet_step: {:.1} M parameters", params as f64 / 1e6);
    if std::env::var_os("SDKIT_BENCH_PLAN_ONLY").is_some() {
        if std::env::var_os("SDKIT_BENCH_BUDGETS").is_some() {
            planned_budgets(&prog);
        }
        return;
    }
    let bind = bindings(&g);
    if std::env::var("SDKIT_BENCH_DEVICE").is_ok_and(|d| d == "cpu") {
        cpu_step(&prog, &bind, &py, small);
        return;
    }
    if std::env::var_os("SDKIT_BENCH_BUDGETS").is_some() {
        budgets(&prog, &bind, adapter.as_deref());
        return;
    }
    if std::env::var_os("SDKIT_BENCH_LOOP").is_some() {
        sampling_loop(&prog, &bind, small, adapter.as_deref());
        return;
    }
    // The peer first, so a run cut short still compares what it measured.
    let torch = torch_time(&py, small, false);
    match &torch {
        Ok(tt) => println!("unet_step: torch fp16 {:.2} ms/step", tt * 1e3),
        Err(e) => println!("unet_step: torch peer unavailable: {e}"),
    }
    // The portable kernels, then matrix products on cooperative matrices
    // (tensor cores) where the adapter has them; the last again with
    // wgpu's index clamps (bounds checks), then with all its shader
    // runtime checks, which the engine turns off, to show what they cost;
    // last (it takes longest) with its kernels tuned on this device
    // (`Tuning::Measure`: prepare includes the measuring;
    // `SDKIT_BENCH_TUNE=0` skips the row).
    let variants = [
        ("f16 weights, f32 activations", false, false, ""),
        ("coop, f32 activations", false, true, ""),
        ("coop, f16 activations", true, true, ""),
        (
            "coop, f16 activations, element loads, NCHW convs",
            true,
            true,
            "elements",
        ),
        ("coop, f16 activations, bounds checks", true, true, "bounds"),
        (
            "coop, f16 activations, shader checks",
            true,
            true,
            "checked",
        ),
        ("coop, f16 activations, tuned", true, true, "tuned"),
    ];
    let mut best = f64::INFINITY;
    let mut first: Option<Vec<f32>> = None;
    let tune = std::env::var("SDKIT_BENCH_TUNE").map_or(true, |v| v != "0");
    for (label, f16_act, coop, mode) in variants {
        if mode == "tuned" && !tune {
            continue;
        }
        let shader_checks = mode == "checked";
        let opts = Options {
            adapter: adapter.clone(),
            f16_activations: f16_act,
            allow_coopmat: coop,
            shader_checks,
            bounds_checks: mode == "bounds",
            vector_staging: mode != "elements",
            channels_last: mode != "elements",
            tuning: if mode == "tuned" {
                Tuning::Measure
            } else {
                Tuning::Off
            },
            ..Options::default()
        };
        let gpu = match WgpuBackend::with_options(&opts) {
            Ok(b) => b,
            Err(e) => {
                println!("unet_step: skipped, no adapter: {e}");
                return;
            }
        };
        if f16_act && !gpu.f16_activations {
            println!("unet_step [{label}]: skipped, adapter lacks SHADER_F16");
            continue;
        }
        if coop && gpu.coop.is_none() {
            println!("unet_step [{label}]: skipped, no cooperative-matrix path");
            continue;
        }
        let t = Instant::now();
        let prepared = match gpu.prepare(&prog, &bind) {
            Ok(p) => p,
            Err(e) => {
                println!("unet_step [{label}]: prepare failed: {e}");
                continue;
            }
        };
        let prep = t.elapsed().as_secs_f64();
        // Agreement with the first variant's output (f32 activations).
        let agree = match prepared.run(&bind) {
            Ok(out) => {
                let out = out.into_iter().next().map(|a| a.data).unwrap_or_default();
                match &first {
                    None => {
                        first = Some(out);
                        String::new()
                    }
                    Some(f) => format!(", nmse vs first {:.1e}", common::nmse(&out, f)),
                }
            }
            Err(e) => {
                println!("unet_step [{label}]: failed: {e}");
                continue;
            }
        };
        if let Err(e) = prepared.dispatch_only(2) {
            println!("unet_step [{label}]: failed: {e}");
            continue;
        }
        let (secs, _) = common::seconds_per_step(&prepared, 2.0, 2, 50);
        if !shader_checks {
            best = best.min(secs);
        }
        let ratio = match &torch {
            Ok(tt) => format!(" ({:.2}x torch)", secs / tt),
            Err(_) => String::new(),
        };
        println!(
            "unet_step [{label}] on {} ({}): {:.2} ms/step{ratio} (prepare+upload {:.2} s, {} pipelines{agree})",
            gpu.adapter.name,
            gpu.adapter.backend,
            secs * 1e3,
            prep,
            gpu.pipelines_compiled()
        );
        if mode == "tuned" {
            print_tuning(&gpu.tuned_kernels(&prog));
        }
        if !matches!(mode, "" | "tuned") {
            continue;
        }
        if let Ok(times) = prepared.profile(3) {
            print_profile(&prog, &times);
        }
    }
    if let Some(tt) = torch.ok().filter(|_| best.is_finite()) {
        println!(
            "unet_step: torch fp16 {:.2} ms/step, sdkit best {:.2} ms/step, sdkit/torch time {:.2}x",
            tt * 1e3,
            best * 1e3,
            best / tt
        );
    }
}

/// What tuning chose: each kind's kernels timed alone by default and
/// tuned, how often each variant won, and the largest gains.
fn print_tuning(tuned: &[sdkit_compute::backend::wgpu::TunedKernel]) {
    let mut kinds: Vec<(&str, f64, f64, usize)> = Vec::new();
    let mut wins: Vec<(String, usize)> = Vec::new();
    for t in tuned {
        let t = &t.tuned;
        match kinds.iter_mut().find(|k| k.0 == t.kind) {
            Some(k) => {
                k.1 += t.default_seconds;
                k.2 += t.seconds;
                k.3 += 1;
            }
            None => kinds.push((&t.kind, t.default_seconds, t.seconds, 1)),
        }
        let won = format!("{}: {}", t.kind, t.variant.describe(&t.kind));
        match wins.iter_mut().find(|w| w.0 == won) {
            Some(w) => w.1 += 1,
            None => wins.push((won, 1)),
        }
    }
    for (kind, default, tuned, n) in &kinds {
        println!(
            "  tuned {n} {kind} kernels: {:.2} ms by default, {:.2} ms tuned (each alone, summed)",
            default * 1e3,
            tuned * 1e3
        );
    }
    wins.sort_by_key(|w| std::cmp::Reverse(w.1));
    for (won, n) in &wins {
        println!("    {n:3}x {won}");
    }
    let mut gains: Vec<&sdkit_compute::backend::wgpu::TunedKernel> = tuned.iter().collect();
    gains.sort_by(|a, b| {
        (b.tuned.default_seconds - b.tuned.seconds)
            .total_cmp(&(a.tuned.default_seconds - a.tuned.seconds))
    });
    for t in gains.iter().take(5) {
        println!("    kernel {}: {}", t.kernel, t.tuned);
    }
}

/// Where a step's time goes: each kernel timed alone, summed by kind,
/// and the slowest kernels with their shapes.
fn print_profile(
    prog: &sdkit_compute::plan::Program,
    times: &[(sdkit_compute::plan::KernelId, f64)],
) {
    let total: f64 = times.iter().map(|t| t.1).sum();
    let mut by_kind: Vec<(&str, f64, usize)> = Vec::new();
    for (k, secs) in times {
        let name = prog.kernels[k.0 as usize].kind.name();
        match by_kind.iter_mut().find(|e| e.0 == name) {
            Some(e) => {
                e.1 += secs;
                e.2 += 1;
            }
            None => by_kind.push((name, *secs, 1)),
        }
    }
    by_kind.sort_by(|a, b| b.1.total_cmp(&a.1));
    let kinds: Vec<String> = by_kind
        .iter()
        .map(|(n, s, c)| format!("{n} {:.1} ms ({c}, {:.0}%)", s * 1e3, 100.0 * s / total))
        .collect();
    println!(
        "  profile, kernels alone sum to {:.1} ms: {}",
        total * 1e3,
        kinds.join(", ")
    );
    // The three slowest kernels of each of the three costliest kinds.
    for (kind, _, _) in by_kind.iter().take(3) {
        let mut slow: Vec<&(sdkit_compute::plan::KernelId, f64)> = times
            .iter()
            .filter(|(k, _)| prog.kernels[k.0 as usize].kind.name() == *kind)
            .collect();
        slow.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (k, secs) in slow.iter().take(3) {
            let kern = &prog.kernels[k.0 as usize];
            let mut what = format!("{:?}", kern.kind);
            what.truncate(110);
            println!("    {:7.3} ms  {what}", secs * 1e3);
        }
    }
}

/// The step on the CPU backend, f32 and (where the CPU has AMX) bf16
/// products, each beside PyTorch on the CPU in the same dtype.
fn cpu_step(prog: &sdkit_compute::plan::Program, bind: &Bindings, py: &str, small: bool) {
    use sdkit_compute::backend::cpu::{amx, run_with, Products};
    let threads = rayon_threads();
    let mut rows = vec![(Products::F32, "f32", vec![])];
    if amx::available() {
        rows.push((Products::Bf16, "bf16", vec!["--bf16"]));
    }
    for (products, name, extra) in rows {
        let _ = run_with(prog, bind, products);
        let runs = if small { 5 } else { 3 };
        let mut times = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            if let Err(e) = run_with(prog, bind, products) {
                println!("unet_step [cpu {name}]: failed: {e}");
                return;
            }
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let secs = times[times.len() / 2];
        println!(
            "unet_step [cpu {name}, {threads} threads]: {:.1} ms/step (median of {runs})",
            secs * 1e3
        );
        match torch_time_args(py, small, true, &extra) {
            Ok(tt) => println!(
                "unet_step: torch cpu {name} {:.1} ms/step, sdkit/torch time {:.2}x",
                tt * 1e3,
                secs / tt
            ),
            Err(e) => println!("unet_step: torch peer unavailable: {e}"),
        }
    }
}

fn rayon_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The step under budgets of 100%, 50% and 25% of the weights (plus the
/// activations): measured time and bytes moved per step, the plan's
/// streamed bytes and lower bound.
fn budgets(prog: &sdkit_compute::plan::Program, bind: &Bindings, adapter: Option<&str>) {
    let probe = match WgpuBackend::new(adapter) {
        Ok(b) => b,
        Err(e) => {
            println!("unet_step budgets: skipped, no adapter: {e}");
            return;
        }
    };
    let act = probe.activation_bytes(prog);
    let weights = probe.weight_bytes(prog);
    let bandwidth = probe.upload_bandwidth(256 << 20).unwrap_or(f64::NAN);
    drop(probe);
    println!(
        "unet_step budgets: weights {:.1} MiB, activations {:.1} MiB, host->device {:.2} GB/s",
        weights as f64 / 1048576.0,
        act as f64 / 1048576.0,
        bandwidth / 1e9
    );
    // SDKIT_BENCH_RUNS: timed steps per budget (slow software adapters: 1).
    let runs: usize = std::env::var("SDKIT_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let mut resident_step = None;
    for pct in [100u64, 50, 25] {
        let budget = act + weights * pct / 100;
        let gpu = match WgpuBackend::with_options(&Options {
            adapter: adapter.map(str::to_string),
            budget: Some(budget),
            ..Options::default()
        }) {
            Ok(b) => b,
            Err(e) => {
                println!("  {pct}%: no adapter: {e}");
                continue;
            }
        };
        let p = match gpu.prepare(prog, bind) {
            Ok(p) => p,
            Err(e) => {
                println!("  {pct}%: {e}");
                continue;
            }
        };
        let Some(plan) = p.residency().cloned() else {
            continue;
        };
        if runs > 1 {
            let _ = p.dispatch_only(1);
        }
        let before = gpu.bytes_uploaded();
        let t = Instant::now();
        if let Err(e) = p.dispatch_only(runs) {
            println!("  {pct}%: {e}");
            continue;
        }
        let secs = t.elapsed().as_secs_f64() / runs as f64;
        let moved = (gpu.bytes_uploaded() - before) / runs as u64;
        // Predicted: the resident step plus the streamed bytes at the
        // measured bandwidth (copies and compute in one queue do not
        // overlap).
        let base = *resident_step.get_or_insert(secs);
        let predicted = base + plan.streamed_bytes_per_run as f64 / bandwidth;
        println!(
            "  {pct:>3}% budget: {:8.1} ms/step (predicted {:.1}), moved {:7.1} MiB/step (plan {:.1}, lower bound {:.1}), resident {:.1} MiB, stream arena {:.1} MiB",
            secs * 1e3,
            predicted * 1e3,
            moved as f64 / 1048576.0,
            plan.streamed_bytes_per_run as f64 / 1048576.0,
            plan.lower_bound_per_run as f64 / 1048576.0,
            plan.resident_bytes as f64 / 1048576.0,
            plan.stream_arena_bytes as f64 / 1048576.0,
        );
    }
}

/// The residency plans alone (no device): f16 weights, f32 activations,
/// 256-byte slot alignment, 2 GiB bindings.
fn planned_budgets(prog: &sdkit_compute::plan::Program) {
    use sdkit_compute::plan::residency::{plan_residency, weight_uses, ModelUse};
    let weights = weight_uses(prog, 2);
    let total: u64 = weights.iter().map(|w| w.bytes).sum();
    let act = prog.stats.arena_bytes as u64 + prog.stats.input_bytes as u64;
    let u = ModelUse {
        weights,
        kernels: prog.stats.dispatches,
        activation_bytes: act,
        runs: 1,
    };
    let mib = |b: u64| b as f64 / 1048576.0;
    println!(
        "unet_step planned budgets: weights {:.1} MiB (f16), activations {:.1} MiB",
        mib(total),
        mib(act)
    );
    for pct in [100u64, 50, 25] {
        let budget = act + total * pct / 100;
        match plan_residency(&u, budget, 256, 2 << 30) {
            Ok(p) => println!(
                "  {pct:>3}% budget: streams {:.1} MiB/step (lower bound {:.1}), resident {:.1} MiB, stream arena {:.1} MiB",
                mib(p.streamed_bytes_per_run),
                mib(p.lower_bound_per_run),
                mib(p.resident_bytes),
                mib(p.stream_arena_bytes)
            ),
            Err(e) => println!("  {pct:>3}% budget: {e}"),
        }
    }
}

/// A 10-step Euler loop with CFG 7 over the UNet, as the sampler runs it
/// (f32 activations, cooperative matrices where the adapter has them;
/// device loops are off with f16 activations): the host loop, then the
/// device loop; time per step, bytes read back, and how far apart the
/// two results are.
fn sampling_loop(
    prog: &sdkit_compute::plan::Program,
    bind: &Bindings,
    small: bool,
    adapter: Option<&str>,
) {
    use sdkit_compute::Runtime;
    use std::collections::HashMap;
    let gpu = match WgpuBackend::with_options(&Options {
        adapter: adapter.map(str::to_string),
        ..Options::default()
    }) {
        Ok(b) => b,
        Err(e) => {
            println!("unet_step loop: skipped, no adapter: {e}");
            return;
        }
    };
    let name = gpu.adapter.name.clone();
    let rt = Runtime::wgpu(gpu);
    let (fg, _) = graph_with(small, true);
    let fused = match plan(&fg) {
        Ok(p) => p,
        Err(e) => {
            println!("unet_step loop: plan failed: {e}");
            return;
        }
    };
    let fbind = bindings(&fg);
    let lat0 = fbind.inputs["lat"].as_ref().clone();
    let per = lat0.len();
    let context = Arc::clone(&bind.inputs["context"]);
    let steps = 10;
    let sigmas: Vec<f32> = (0..=steps)
        .map(|i| 14.6 * (1.0 - i as f32 / steps as f32))
        .collect();
    let cfg = 7.0f32;
    let feed_of = |pairs: Vec<(&str, Vec<f32>)>| -> HashMap<String, Arc<Vec<f32>>> {
        pairs
            .into_iter()
            .map(|(k, v)| (k.to_string(), Arc::new(v)))
            .collect()
    };
    // The host loop: both predictions back each step.
    let mut host = match rt.prepare(prog, bind) {
        Ok(s) => s,
        Err(e) => {
            println!("unet_step loop: prepare failed: {e}");
            return;
        }
    };
    let run_host = |host: &mut sdkit_compute::runtime::Session<'_>| -> Result<Vec<f32>, String> {
        let mut x = lat0.clone();
        for i in 0..steps {
            let (s, dt) = (sigmas[i], sigmas[i + 1] - sigmas[i]);
            let c_in = (s * s + 1.0).sqrt();
            let xin: Vec<f32> = x.iter().map(|v| v / c_in).collect();
            let mut f = feed_of(vec![
                ("x", [xin.clone(), xin].concat()),
                ("t", vec![999.0; 2]),
            ]);
            f.insert("context".into(), Arc::clone(&context));
            let out = host.run(f).map_err(|e| e.to_string())?;
            let eps = &out[0].data;
            for j in 0..per {
                let (c, u) = (x[j] - eps[j] * s, x[j] - eps[per + j] * s);
                let d = u + (c - u) * cfg;
                x[j] += (x[j] - d) / s * dt;
            }
        }
        Ok(x)
    };
    let mut device = match rt.prepare(&fused, &fbind) {
        Ok(s) => s,
        Err(e) => {
            println!("unet_step loop: prepare failed: {e}");
            return;
        }
    };
    let run_device =
        |device: &mut sdkit_compute::runtime::Session<'_>| -> Result<Vec<f32>, String> {
            let mut last = Vec::new();
            for i in 0..steps {
                let (s, dt) = (sigmas[i], sigmas[i + 1] - sigmas[i]);
                let mut f = feed_of(vec![
                    ("c_in", vec![(s * s + 1.0).sqrt()]),
                    ("sigma", vec![s]),
                    ("dt", vec![dt]),
                    ("cfg", vec![cfg]),
                    ("t", vec![999.0; 2]),
                ]);
                if i == 0 {
                    f.insert("lat".into(), Arc::new(lat0.clone()));
                    f.insert("context".into(), Arc::clone(&context));
                }
                let read: &[usize] = if i + 1 == steps { &[0] } else { &[] };
                let outs = device
                    .run_carried(f, &[(0, "lat")], read)
                    .map_err(|e| e.to_string())?;
                if let Some(x) = outs.into_iter().next().flatten() {
                    last = x.data;
                }
            }
            Ok(last)
        };
    // Each once to warm up, then timed.
    let mut rows = Vec::new();
    for (label, device_loop) in [("host loop", false), ("device loop", true)] {
        let run = |s: &mut sdkit_compute::runtime::Session<'_>| {
            if device_loop {
                run_device(s)
            } else {
                run_host(s)
            }
        };
        let session = if device_loop { &mut device } else { &mut host };
        if let Err(e) = run(session) {
            println!("unet_step loop [{label}]: failed: {e}");
            return;
        }
        let before = rt.bytes_downloaded();
        let t = Instant::now();
        let x = match run(session) {
            Ok(x) => x,
            Err(e) => {
                println!("unet_step loop [{label}]: failed: {e}");
                return;
            }
        };
        let secs = t.elapsed().as_secs_f64() / steps as f64;
        let read = rt.bytes_downloaded() - before;
        println!(
            "unet_step loop [{label}] on {name}: {:.2} ms/step, {} bytes read back in {steps} steps",
            secs * 1e3,
            read
        );
        rows.push((secs, x));
    }
    if let [(host_s, hx), (dev_s, dx)] = &rows[..] {
        println!(
            "unet_step loop: device/host time {:.3}x, nmse between the loops {:.1e}",
            dev_s / host_s,
            common::nmse(dx, hx)
        );
    }
}
