//! The UNet graph equals ComfyUI's ldm `UNetModel` (tools/reference/unet.py)
//! at a tiny SD1-like size, with conv and linear transformer projections,
//! and in SDXL's layout (64-channel heads, no top-level attention, the ADM
//! vector through `label_emb`).

use sdkit_compute::backend::cpu;
use sdkit_compute::plan::plan;
use sdkit_compute::tensor::{GraphBuilder, InputKind};
use sdkit_nodes::models::detect::{Heads, UnetConfig};
use sdkit_nodes::models::unet::unet;
use std::sync::Arc;

const PREFIX: &str = "model.diffusion_model.";

/// The reference script's weight formula (the constants are arbitrary and
/// shared with it; rank-1 weights are norm scales).
#[allow(clippy::approx_constant)]
fn value(name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let seed: f64 = name.bytes().map(f64::from).sum::<f64>() * 0.01;
    let fan_in = (n / shape.first().copied().unwrap_or(1).max(1)) as f64;
    (0..n)
        .map(|i| {
            let i = i as f64;
            let b = (i * 0.7071 + i * i * 0.0123 + seed).sin();
            let v = if name.ends_with("bias") {
                0.05 * b
            } else if shape.len() == 1 {
                1.0 + 0.1 * b
            } else {
                b / fan_in.sqrt()
            };
            v as f32
        })
        .collect()
}

fn usizes(v: &serde_json::Value) -> Vec<usize> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("uint") as usize)
        .collect()
}

fn config(c: &serde_json::Value) -> UnetConfig {
    let n = |k: &str| c[k].as_u64().expect(k) as usize;
    UnetConfig {
        in_channels: n("in_channels"),
        out_channels: n("out_channels"),
        model_channels: n("model_channels"),
        num_res_blocks: usizes(&c["num_res_blocks"]),
        channel_mult: usizes(&c["channel_mult"]),
        transformer_depth: usizes(&c["transformer_depth"]),
        transformer_depth_output: usizes(&c["transformer_depth_output"]),
        transformer_depth_middle: c["transformer_depth_middle"]
            .as_i64()
            .and_then(|d| usize::try_from(d).ok()),
        use_linear_in_transformer: c["use_linear_in_transformer"].as_bool().expect("bool"),
        context_dim: Some(n("context_dim")),
        adm_in_channels: c["adm_in_channels"]
            .as_u64()
            .and_then(|d| usize::try_from(d).ok()),
    }
}

/// ComfyUI's `num_heads` / `num_head_channels` pair (−1 = unset).
fn heads(c: &serde_json::Value) -> Heads {
    match c["num_head_channels"].as_i64() {
        Some(w) if w > 0 => Heads::Width(w as usize),
        _ => Heads::Count(c["num_heads"].as_u64().expect("heads") as usize),
    }
}

#[test]
fn matches_comfyui_unet() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/unet/expected.json"
    ))
    .expect("fixture");
    let fx: serde_json::Value = serde_json::from_str(&text).expect("json");
    // The reference script's inputs.
    let x: Vec<f32> = (0..4 * 8 * 8)
        .map(|i| ((i as f64 * 0.37).sin() * 0.8) as f32)
        .collect();
    let context: Vec<f32> = (0..5 * 64)
        .map(|i| (i as f64 * 0.113).cos() as f32)
        .collect();
    // The SDXL-layout case's ADM vector.
    let adm: Vec<f32> = (0..48)
        .map(|i| ((i as f64 * 0.29).sin() * 0.5) as f32)
        .collect();
    let cases = fx["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 4);
    let mut worst = 0f32;
    for case in cases {
        let cfg = config(&case["config"]);
        let heads = heads(&case["config"]);
        let t = case["timestep"].as_f64().expect("timestep") as f32;
        let want: Vec<f32> = case["output"]
            .as_array()
            .expect("output")
            .iter()
            .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
            .collect();

        let g = GraphBuilder::new();
        let xi = g.input("x", &[1, 4, 8, 8]).expect("input");
        let ti = g.input("timesteps", &[1]).expect("input");
        let ci = g.input("context", &[1, 5, 64]).expect("input");
        let yi = cfg
            .adm_in_channels
            .map(|a| g.input("y", &[1, a]).expect("input"));
        let y = unet(&g, &cfg, heads, PREFIX, xi, ti, ci, yi, None).expect("builds");
        assert_eq!(y.shape(), [1, 4, 8, 8]);
        let graph = g.finish(&[y]);
        let prog = plan(&graph).expect("plans");
        let mut bind = cpu::Bindings::default();
        for (_, name, shape) in graph.inputs(InputKind::Weight) {
            let rest = name.trim_start_matches(PREFIX);
            bind.weights
                .insert(name.to_string(), Arc::new(value(rest, shape)));
        }
        bind.inputs.insert("x".into(), Arc::new(x.clone()));
        bind.inputs.insert("timesteps".into(), Arc::new(vec![t]));
        bind.inputs
            .insert("context".into(), Arc::new(context.clone()));
        bind.inputs.insert("y".into(), Arc::new(adm.clone()));
        let got = cpu::run(&prog, &bind).expect("runs");
        let out = &got[0].data;
        assert_eq!(out.len(), want.len());

        // A broken graph that collapses to a constant must not pass.
        let (lo, hi) = out
            .iter()
            .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
        assert!(hi - lo > 0.1, "output nearly constant: {lo}..{hi}");

        let max = out
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "unet (linear proj {}, heads {heads:?}, adm {:?}, t {t}): max abs diff {max:e} over {} values; {} dispatches",
            cfg.use_linear_in_transformer,
            cfg.adm_in_channels,
            want.len(),
            prog.stats.dispatches
        );
        assert!(max < 1e-4, "t {t}: max abs diff {max}");
        worst = worst.max(max);
    }
    eprintln!("unet: worst max abs diff {worst:e}");
}
