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

use sdkit_engine::backend::cpu::Bindings;
use sdkit_engine::backend::wgpu::WgpuBackend;
use sdkit_engine::plan::{plan, samples};
use sdkit_engine::tensor::{Conv2dParams, GraphBuilder, InputKind, TensorGraph};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

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
        torch: format!("a = torch.randn({m}, {k}, device=dev); b = torch.randn({k}, {n}, device=dev)\ndef run(): return a @ b"),
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
        torch: format!("x = torch.randn({b}, {c}, {hw}, {hw}, device=dev); w = torch.randn({c}, {c}, 3, 3, device=dev); bb = torch.randn({c}, device=dev)\ndef run(): return torch.nn.functional.conv2d(x, w, bb, padding=1)"),
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
        torch: format!("q = torch.randn(1, {h}, {sq}, {d}, device=dev); k = torch.randn_like(q); v = torch.randn_like(q)\ndef run(): return torch.nn.functional.scaled_dot_product_attention(q, k, v)"),
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

fn torch_time(py: &str, body: &str, iters: usize) -> Option<f64> {
    let script = format!(
        "import torch, time\nassert torch.cuda.is_available()\ndev='cuda'\ntorch.backends.cuda.matmul.allow_tf32 = False\ntorch.backends.cudnn.allow_tf32 = False\n{body}\nrun(); torch.cuda.synchronize()\nt = time.perf_counter()\nfor _ in range({iters}): run()\ntorch.cuda.synchronize()\nprint((time.perf_counter() - t) / {iters})\n"
    );
    let out = Command::new(py).arg("-c").arg(script).output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

fn main() {
    let small = std::env::var_os("SDKIT_BENCH_SMALL").is_some();
    let adapter = std::env::var("SDKIT_ADAPTER").ok();
    let gpu = match WgpuBackend::new(adapter.as_deref()) {
        Ok(g) => g,
        Err(e) => {
            println!("wgpu_ops: skipped, no adapter: {e}");
            return;
        }
    };
    let py = std::env::var("SDKIT_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    println!(
        "wgpu_ops on {} ({}, {}), f32 portable kernels{}",
        gpu.adapter.name,
        gpu.adapter.backend,
        gpu.adapter.device_type,
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
        let prepared = match gpu.prepare(&prog, &b) {
            Ok(p) => p,
            Err(e) => {
                println!("{:<10} prepare failed: {e}", case.name);
                continue;
            }
        };
        // Warm up, then time enough repetitions to pass ~0.5 s.
        if let Err(e) = prepared.dispatch_only(1) {
            println!("{:<10} failed: {e}", case.name);
            continue;
        }
        let t = Instant::now();
        let _ = prepared.dispatch_only(1);
        let once = t.elapsed().as_secs_f64().max(1e-6);
        let iters = ((0.5 / once) as usize).clamp(1, 200);
        let t = Instant::now();
        let _ = prepared.dispatch_only(iters);
        let secs = t.elapsed().as_secs_f64() / iters as f64;
        let rate = if case.flops > 0.0 {
            format!("{:8.1} GFLOP/s", case.flops / secs / 1e9)
        } else {
            format!("{} dispatches", prog.stats.dispatches)
        };
        print!(
            "{:<10} sdkit {:9.3} ms  {rate}   {}",
            case.name,
            secs * 1e3,
            case.what
        );
        if !case.torch.is_empty() {
            match torch_time(&py, &case.torch, iters.max(5)) {
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
