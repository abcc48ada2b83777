//! Throughput of the wgpu backend: GEMM, conv2d, attention and a UNet-shaped
//! denoiser step, each planned from a tensor graph, prepared once and
//! replayed, beside PyTorch on the same GPU (CUDA) in the same run when
//! torch with a GPU is importable.
//!
//! `cargo bench --bench wgpu_ops` on the machine's best adapter (or
//! `SDKIT_ADAPTER=name`). `SDKIT_BENCH_SMALL=1` shrinks every case (for
//! software adapters such as lavapipe). PyTorch is `python3` or
//! `SDKIT_BENCH_PYTHON`. Times cover dispatch through completion, not
//! uploads or readback.

mod common;

use common::nmse;
use sdkit_compute::backend::cpu::Bindings;
use sdkit_compute::backend::wgpu::probe::ProbeSize;
use sdkit_compute::backend::wgpu::{Options, WgpuBackend};
use sdkit_compute::plan::{plan, samples};
use sdkit_compute::tensor::{Conv2dParams, GraphBuilder, InputKind, TensorGraph};
use std::process::Command;
use std::sync::Arc;

struct Case {
    name: &'static str,
    what: String,
    flops: f64,
    graph: TensorGraph,
    /// The same computation for PyTorch, as Python statements over `dev`
    /// and `torch` that define `run()`.
    torch: String,
}

fn bindings(g: &TensorGraph) -> Bindings {
    let mut b = Bindings::default();
    for kind in [InputKind::Weight, InputKind::Activation] {
        for (_, name, shape) in g.inputs(kind) {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1)
                .collect();
            let data = Arc::new(data);
            match kind {
                InputKind::Weight => b.weights.insert(name.to_string(), data),
                InputKind::Activation => b.inputs.insert(name.to_string(), data),
            };
        }
    }
    b
}

fn cases(small: bool) -> Vec<Case> {
    let s = |big: usize, little: usize| if small { little } else { big };
    let mut v = Vec::new();

    let (m, n, k) = (s(4096, 256), s(4096, 256), s(4096, 256));
    let g = GraphBuilder::new();
    let y = g
        .input("a", &[m, k])
        .and_then(|a| a.matmul(g.input("b", &[k, n])?));
    let graph = g.finish(&[y.expect("gemm graph")]);
    v.push(Case {
        name: "gemm",
        what: format!("{m}x{k} · {k}x{n}"),
        flops: 2.0 * (m * n * k) as f64,
        graph,
        torch: format!("a = torch.randn({m}, {k}, device=dev, dtype=dt); b = torch.randn({k}, {n}, device=dev, dtype=dt)\ndef run(): return a @ b"),
    });

    let (b, c, hw) = (2, s(320, 32), s(64, 16));
    let g = GraphBuilder::new();
    let p = Conv2dParams {
        stride: [1; 2],
        padding: [1; 2],
        dilation: [1; 2],
        groups: 1,
    };
    let y = g.input("x", &[b, c, hw, hw]).and_then(|x| {
        x.conv2d(
            g.weight("w", &[c, c, 3, 3])?,
            Some(g.weight("bias", &[c])?),
            p,
        )
    });
    let graph = g.finish(&[y.expect("conv graph")]);
    v.push(Case {
        name: "conv",
        what: format!("{b}x{c}x{hw}x{hw} -> {c}, 3x3"),
        flops: 2.0 * (b * c * hw * hw * c * 9) as f64,
        graph,
        torch: format!("x = torch.randn({b}, {c}, {hw}, {hw}, device=dev, dtype=dt); w = torch.randn({c}, {c}, 3, 3, device=dev, dtype=dt); bb = torch.randn({c}, device=dev, dtype=dt)\ndef run(): return torch.nn.functional.conv2d(x, w, bb, padding=1)"),
    });

    // SD1.5's commonest product: a 320-wide linear over 2×4096 tokens.
    let (tokens, width) = (s(8192, 256), s(320, 32));
    let g = GraphBuilder::new();
    let y = g.input("x", &[tokens, width]).and_then(|x| {
        x.linear(
            g.weight("w", &[width, width])?,
            Some(g.weight("b", &[width])?),
        )
    });
    let graph = g.finish(&[y.expect("linear graph")]);
    v.push(Case {
        name: "linear",
        what: format!("{tokens}x{width} · {width}x{width} + bias"),
        flops: 2.0 * (tokens * width * width) as f64,
        graph,
        torch: format!("x = torch.randn({tokens}, {width}, device=dev, dtype=dt); w = torch.randn({width}, {width}, device=dev, dtype=dt); bb = torch.randn({width}, device=dev, dtype=dt)\ndef run(): return torch.nn.functional.linear(x, w, bb)"),
    });

    // The deepest level: 1280 channels on an 8×8 latent (few output
    // tiles, a long depth).
    let (c, hw) = (s(1280, 64), 8);
    let g = GraphBuilder::new();
    let y = g.input("x", &[2, c, hw, hw]).and_then(|x| {
        x.conv2d(
            g.weight("w", &[c, c, 3, 3])?,
            Some(g.weight("bias", &[c])?),
            p,
        )
    });
    let graph = g.finish(&[y.expect("deep conv graph")]);
    v.push(Case {
        name: "deep_conv",
        what: format!("2x{c}x{hw}x{hw} -> {c}, 3x3"),
        flops: 2.0 * (2 * c * hw * hw * c * 9) as f64,
        graph,
        torch: format!("x = torch.randn(2, {c}, {hw}, {hw}, device=dev, dtype=dt); w = torch.randn({c}, {c}, 3, 3, device=dev, dtype=dt); bb = torch.randn({c}, device=dev, dtype=dt)\ndef run(): return torch.nn.functional.conv2d(x, w, bb, padding=1)"),
    });

    let (h, sq, d) = (8, s(4096, 256), 40);
    let g = GraphBuilder::new();
    let y = g.input("q", &[1, h, sq, d]).and_then(|q| {
        q.attention(
            g.input("k", &[1, h, sq, d])?,
            g.input("v", &[1, h, sq, d])?,
            None,
            1.0 / (d as f32).sqrt(),
        )
    });
    let graph = g.finish(&[y.expect("attention graph")]);
    v.push(Case {
        name: "attention",
        what: format!("{h} heads x {sq} tokens x {d}"),
        flops: 4.0 * (h * sq * sq * d) as f64,
        graph,
        torch: format!("q = torch.randn(1, {h}, {sq}, {d}, device=dev, dtype=dt); k = torch.randn_like(q); v = torch.randn_like(q)\ndef run(): return torch.nn.functional.scaled_dot_product_attention(q, k, v)"),
    });

    // The VAE decoder's last level at a 512² image: 32 groups of a million
    // elements, split over many workgroups (`[coop no split-K]`: one
    // workgroup per group, as before).
    let (c, hw) = (s(128, 32), s(512, 128));
    let g = GraphBuilder::new();
    let y = g.input("x", &[1, c, hw, hw]).and_then(|x| {
        let n = x.group_norm(
            32,
            Some(g.weight("w", &[c])?),
            Some(g.weight("b", &[c])?),
            1e-6,
        )?;
        Ok(n.silu())
    });
    v.push(Case {
        name: "group_norm",
        what: format!("1x{c}x{hw}x{hw}, 32 groups, + SiLU"),
        flops: 0.0,
        graph: g.finish(&[y.expect("group norm graph")]),
        torch: format!("x = torch.randn(1, {c}, {hw}, {hw}, device=dev, dtype=dt); w = torch.randn({c}, device=dev, dtype=dt); bb = torch.randn({c}, device=dev, dtype=dt)\ndef run(): return torch.nn.functional.silu(torch.nn.functional.group_norm(x, 32, w, bb, 1e-6))"),
    });

    let (base, size) = (s(320, 32), s(64, 16));
    let graph = samples::unet_like_graph(2, base, size, 3).expect("unet graph");
    v.push(Case {
        name: "unet_step",
        what: format!("UNet-shaped, batch 2, width {base}, {size}x{size} latent"),
        flops: 0.0,
        graph,
        torch: String::new(),
    });
    v
}

fn torch_time(py: &str, body: &str, iters: usize, half: bool) -> Option<f64> {
    let dt = if half {
        "torch.float16"
    } else {
        "torch.float32"
    };
    let script = format!(
        "import torch, time\nassert torch.cuda.is_available()\ndev='cuda'\ntorch.backends.cuda.matmul.allow_tf32 = False\ntorch.backends.cudnn.allow_tf32 = False\ndt = {dt}\n{body}\nrun(); torch.cuda.synchronize()\nt = time.perf_counter()\nfor _ in range({iters}): run()\ntorch.cuda.synchronize()\nprint((time.perf_counter() - t) / {iters})\n"
    );
    let out = Command::new(py).arg("-c").arg(script).output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

fn main() {
    let small = std::env::var_os("SDKIT_BENCH_SMALL").is_some();
    let adapter = std::env::var("SDKIT_ADAPTER").ok();
    // `checks`: none (as shipped), bounds checks only, or all of wgpu's.
    let open = |coop: bool, checks: &str| {
        WgpuBackend::with_options(&Options {
            adapter: adapter.clone(),
            allow_coopmat: coop,
            shader_checks: checks == "checked",
            bounds_checks: checks == "bounds",
            ..Options::default()
        })
    };
    let portable = match open(false, "") {
        Ok(g) => g,
        Err(e) => {
            println!("wgpu_ops: skipped, no adapter: {e}");
            return;
        }
    };
    // The tensor-core path beside the portable one, where the adapter has
    // cooperative matrices; PyTorch runs fp16 for it and f32 (no TF32) for
    // the portable path.
    let mut paths = vec![("f32".to_string(), portable)];
    // Each default path again with wgpu's shader runtime checks (index
    // clamps, loop counters, zeroed workgroup memory), which the engine
    // turns off, and with the index clamps alone: what each costs or
    // saves on this adapter.
    for checks in ["bounds", "checked"] {
        if let Ok(g) = open(false, checks) {
            paths.push((format!("f32 {checks}"), g));
        }
    }
    // Group norms unsplit (a workgroup per group), for comparison.
    if let Ok(g) = WgpuBackend::with_options(&Options {
        adapter: adapter.clone(),
        allow_coopmat: false,
        split_k: false,
        ..Options::default()
    }) {
        paths.push(("f32 no split".to_string(), g));
    }
    match open(true, "") {
        Ok(g) if g.coop.is_some() => {
            paths.push(("coop".to_string(), g));
            for checks in ["bounds", "checked"] {
                if let Ok(g) = open(true, checks) {
                    paths.push((format!("coop {checks}"), g));
                }
            }
            // f16 activations let matrix products read both operands
            // straight from their bindings; two-pass attention is the
            // fallback form.
            // Products without split-K show what splitting the depth buys
            // on the small-grid shapes.
            // Register prefetch (staged product operands, attention's
            // key blocks) and two workgroup stages for staged operands
            // are off by default until these rows show they help.
            for (name, f16_activations, two_pass_attention, split_k, staging) in [
                ("coop f16-act", true, false, true, (false, false)),
                ("coop 2-pass", false, true, true, (false, false)),
                ("coop no split-K", false, false, false, (false, false)),
                ("coop prefetch", false, false, true, (true, false)),
                ("coop two stages", false, false, true, (false, true)),
            ] {
                if let Ok(g) = WgpuBackend::with_options(&Options {
                    adapter: adapter.clone(),
                    f16_activations,
                    two_pass_attention,
                    split_k,
                    prefetch: staging.0,
                    double_buffer: staging.1,
                    ..Options::default()
                }) {
                    paths.push((name.to_string(), g));
                }
            }
            // Single-pass attention with 128 queries a workgroup.
            if let Ok(g) = WgpuBackend::with_options(&Options {
                adapter: adapter.clone(),
                attention_tiles: 2,
                ..Options::default()
            }) {
                paths.push(("coop two query tiles".to_string(), g));
            }
            // Staged operands element by element, as before they were
            // read in 16-byte units; convs over their NCHW input.
            // Products' blocks in plain row order. Weights and inputs
            // bound read-write, as before they were read-only.
            for (name, vector_staging, channels_last, raster, read_only_inputs) in [
                ("coop element loads", false, false, true, true),
                ("coop NCHW convs", true, false, true, true),
                ("coop row-major grid", true, true, false, true),
                ("coop read-write inputs", true, true, true, false),
            ] {
                if let Ok(g) = WgpuBackend::with_options(&Options {
                    adapter: adapter.clone(),
                    vector_staging,
                    channels_last,
                    raster,
                    read_only_inputs,
                    ..Options::default()
                }) {
                    paths.push((name.to_string(), g));
                }
            }
        }
        _ => println!("wgpu_ops: no cooperative-matrix path on this adapter"),
    }
    // Each fixed cooperative GEMM tiling too (`SDKIT_BENCH_TILINGS=1`), to
    // tune the size heuristic on a new adapter.
    if paths.len() > 1 && std::env::var_os("SDKIT_BENCH_TILINGS").is_some() {
        for t in sdkit_compute::backend::wgpu::codegen::tilings() {
            if let Ok(g) = WgpuBackend::with_options(&Options {
                adapter: adapter.clone(),
                gemm_tiles: Some(t),
                ..Options::default()
            }) {
                let name = format!(
                    "coop {}x{} sg of {}x{}, bk {}{}",
                    t.sg_rows,
                    t.sg_cols,
                    t.rows,
                    t.cols,
                    t.bk,
                    if t.direct { ", direct" } else { "" }
                );
                paths.push((name, g));
            }
        }
    }
    // The tensor-core roof through wgpu on this adapter (fragments in
    // registers, `sdkit devices --probe`): cooperative rows print their
    // share of it.
    let roof = paths
        .iter()
        .find(|(p, g)| p == "coop" && g.coop.is_some_and(|c| !c.emulated))
        .filter(|_| !small)
        .and_then(|(_, g)| match g.probe(&ProbeSize::full()) {
            Ok(results) => results
                .into_iter()
                .inspect(|r| println!("probe: {r}"))
                .find(|r| r.name.contains("in registers"))
                .map(|r| r.rate),
            Err(e) => {
                println!("probe failed: {e}");
                None
            }
        });
    let py = std::env::var("SDKIT_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    println!(
        "wgpu_ops on {} ({}, {}){}",
        paths[0].1.adapter.name,
        paths[0].1.adapter.backend,
        paths[0].1.adapter.device_type,
        if small { ", small shapes" } else { "" }
    );
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    for case in cases(small) {
        if !filter.is_empty() && !filter.iter().any(|f| case.name.contains(f.as_str())) {
            continue;
        }
        let prog = match plan(&case.graph) {
            Ok(p) => p,
            Err(e) => {
                println!("{:<10} plan failed: {e}", case.name);
                continue;
            }
        };
        let b = bindings(&case.graph);
        let mut first: Option<Vec<f32>> = None;
        for (path, gpu) in &paths {
            let tiling = path.starts_with("coop ") && path.contains("sg of");
            let products = matches!(case.name, "gemm" | "conv" | "linear" | "deep_conv");
            let split = products || case.name == "group_norm";
            // Prefetch changes the staged products and attention.
            let prefetched = products || case.name == "attention";
            if (tiling && !products)
                || (path == "coop prefetch" && !prefetched)
                || (path == "coop no split-K" && !split)
                || (path == "f32 no split" && case.name != "group_norm")
                || ((path == "coop 2-pass" || path == "coop two query tiles")
                    && case.name != "attention")
            {
                continue;
            }
            let label = format!("{} [{path}]", case.name);
            let prepared = match gpu.prepare(&prog, &b) {
                Ok(p) => p,
                Err(e) => {
                    println!("{label:<26} prepare failed: {e}");
                    continue;
                }
            };
            // Agreement with the first (f32) path: a wrong fast kernel
            // shows here even when the conformance run was skipped.
            let agree = match prepared.run(&b) {
                Ok(out) => {
                    let out = out.into_iter().next().map(|a| a.data).unwrap_or_default();
                    match &first {
                        None => {
                            first = Some(out);
                            String::new()
                        }
                        Some(f) => format!("  nmse vs f32 {:.1e}", nmse(&out, f)),
                    }
                }
                Err(e) => {
                    println!("{label:<26} failed: {e}");
                    continue;
                }
            };
            let (secs, iters) = common::seconds_per_step(&prepared, 0.5, 1, 200);
            let rate = if case.flops > 0.0 {
                let share = match roof.filter(|_| path.starts_with("coop")) {
                    Some(tflops) => {
                        format!(" ({:.0}% of roof)", case.flops / secs / 1e10 / tflops)
                    }
                    None => String::new(),
                };
                format!("{:8.1} GFLOP/s{share}", case.flops / secs / 1e9)
            } else {
                format!("{} dispatches", prog.stats.dispatches)
            };
            print!(
                "{label:<26} sdkit {:9.3} ms  {rate}   {}{agree}",
                secs * 1e3,
                case.what
            );
            // The peer once per path kind, not per tiling.
            let variant =
                path.ends_with("checked") || path.ends_with("bounds") || path.contains("no split");
            if !case.torch.is_empty() && !tiling && !variant {
                match torch_time(&py, &case.torch, iters.max(5), path.starts_with("coop")) {
                    Some(tt) => print!(
                        "   torch {:9.3} ms  sdkit/torch time {:.2}x",
                        tt * 1e3,
                        secs / tt
                    ),
                    None => print!("   (torch with CUDA not available)"),
                }
            }
            println!();
        }
    }
}
