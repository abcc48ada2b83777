//! The CLIP text encoder graph equals transformers' CLIPTextModel (what
//! ComfyUI's SD1 encoder runs) on a tiny configuration, for the last layer
//! and for ComfyUI's clip skip -2. Reference: tools/reference/clip_text.py.

use sdkit_compute::backend::cpu;
use sdkit_compute::plan::plan;
use sdkit_compute::tensor::{GraphBuilder, InputKind};
use sdkit_nodes::models::clip::{causal_mask, text_encoder, ClipLayer};
use sdkit_nodes::models::detect::ClipConfig;
use std::sync::Arc;

const PREFIX: &str = "cond_stage_model.transformer.text_model.";

/// The reference script's weight formula. 0.7071 is an arbitrary
/// frequency shared with the script, not 1/sqrt(2).
#[allow(clippy::approx_constant)]
fn value(name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let seed: f64 = name.bytes().map(f64::from).sum::<f64>() * 0.01;
    let last = *shape.last().unwrap_or(&1) as f64;
    (0..n)
        .map(|i| {
            let b = (i as f64 * 0.7071 + seed).sin();
            let v = if name.ends_with("bias") {
                0.05 * b
            } else if name.contains("layer_norm") && name.ends_with("weight") {
                1.0 + 0.1 * b
            } else {
                b / last.sqrt()
            };
            v as f32
        })
        .collect()
}

#[test]
fn matches_transformers_clip_text_model() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/clip_text/expected.json"
    ))
    .expect("fixture");
    let fx: serde_json::Value = serde_json::from_str(&text).expect("json");
    let c = &fx["config"];
    let get = |k: &str| c[k].as_u64().expect("config") as usize;
    let cfg = ClipConfig {
        vocab: get("vocab"),
        width: get("width"),
        layers: get("layers"),
        max_positions: get("positions"),
        heads: get("heads"),
        intermediate: get("intermediate"),
        gelu: false,
        projection: None,
    };
    let tokens: Vec<f32> = fx["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .flat_map(|r| {
            r.as_array()
                .expect("row")
                .iter()
                .map(|v| v.as_f64().unwrap_or(0.0) as f32)
        })
        .collect();
    let (b, len) = (2, tokens.len() / 2);
    for (layer, key) in [(ClipLayer::Last, "last"), (ClipLayer::FromEnd(2), "skip2")] {
        let g = GraphBuilder::new();
        let t = g.input("tokens", &[b, len]).expect("input");
        let m = g.input("mask", &[len, len]).expect("input");
        let y = text_encoder(&g, &cfg, PREFIX, t, m, layer).expect("builds");
        let graph = g.finish(&[y]);
        let prog = plan(&graph).expect("plans");
        let mut bind = cpu::Bindings::default();
        for (_, name, shape) in graph.inputs(InputKind::Weight) {
            let rest = name.trim_start_matches(PREFIX);
            bind.weights
                .insert(name.to_string(), Arc::new(value(rest, shape)));
        }
        bind.inputs
            .insert("tokens".into(), Arc::new(tokens.clone()));
        bind.inputs
            .insert("mask".into(), Arc::new(causal_mask(len)));
        let got = cpu::run(&prog, &bind).expect("runs");
        let want: Vec<f32> = fx[key]
            .as_array()
            .expect("expected")
            .iter()
            .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
            .collect();
        assert_eq!(got[0].data.len(), want.len());
        let max = got[0]
            .data
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{key}: max abs diff {max:e}");
        assert!(max < 2e-5, "{key}: max abs diff {max}");
    }
}
