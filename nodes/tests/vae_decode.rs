//! The VAE decode graph equals ComfyUI's ldm Decoder with VAEDecode's
//! scaling and clamping (tools/reference/vae_decode.py).

use sdkit_compute::backend::cpu;
use sdkit_compute::plan::plan;
use sdkit_compute::tensor::{GraphBuilder, InputKind};
use sdkit_nodes::models::detect::VaeConfig;
use sdkit_nodes::models::vae::decoder;
use std::sync::Arc;

const PREFIX: &str = "first_stage_model.decoder.";

/// The reference script's weight formula (0.7071 is an arbitrary frequency
/// shared with it).
#[allow(clippy::approx_constant)]
fn value(name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let seed: f64 = name.bytes().map(f64::from).sum::<f64>() * 0.01;
    let fan_in = (n / shape.first().copied().unwrap_or(1).max(1)) as f64;
    (0..n)
        .map(|i| {
            let b = (i as f64 * 0.7071 + seed).sin();
            let v = if name.ends_with("bias") {
                0.05 * b
            } else if name.contains("norm") && name.ends_with("weight") {
                1.0 + 0.1 * b
            } else {
                b / fan_in.sqrt()
            };
            v as f32
        })
        .collect()
}

#[test]
fn matches_comfyui_decoder() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/vae/expected.json"
    ))
    .expect("fixture");
    let fx: serde_json::Value = serde_json::from_str(&text).expect("json");
    let floats = |k: &str| -> Vec<f32> {
        fx[k]
            .as_array()
            .expect("array")
            .iter()
            .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
            .collect()
    };
    let c = &fx["config"];
    let cfg = VaeConfig {
        ch: c["ch"].as_u64().expect("ch") as usize,
        ch_mult: c["ch_mult"]
            .as_array()
            .expect("mult")
            .iter()
            .map(|v| v.as_u64().unwrap_or(1) as usize)
            .collect(),
        num_res_blocks: c["num_res_blocks"].as_u64().expect("nrb") as usize,
        z_channels: c["z_channels"].as_u64().expect("z") as usize,
        in_channels: c["out_ch"].as_u64().expect("out") as usize,
        quant_conv: true,
    };
    let g = GraphBuilder::new();
    let latent = g.input("latent", &[1, 4, 4, 4]).expect("input");
    // The decoder proper (decode_image adds post_quant_conv, which this
    // fixture's Decoder-only reference lacks) with VAEDecode's output map.
    let y = decoder(&g, &cfg, PREFIX, latent)
        .and_then(|x| {
            x.add_scalar(1.0)
                .mul_scalar(0.5)
                .clamp(0.0, 1.0)
                .permute(&[0, 2, 3, 1])
        })
        .expect("builds");
    let graph = g.finish(&[y]);
    let prog = plan(&graph).expect("plans");
    let mut bind = cpu::Bindings::default();
    for (_, name, shape) in graph.inputs(InputKind::Weight) {
        let rest = name.trim_start_matches(PREFIX);
        bind.weights
            .insert(name.to_string(), Arc::new(value(rest, shape)));
    }
    // The reference decodes latent / 0.18215 (f32 division, as torch).
    let latent: Vec<f32> = floats("latent").iter().map(|v| v / 0.18215f32).collect();
    bind.inputs.insert("latent".into(), Arc::new(latent));
    let got = cpu::run(&prog, &bind).expect("runs");
    assert_eq!(got[0].shape, [1, 8, 8, 3]);
    let want = floats("image");
    let max = got[0]
        .data
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!(
        "vae decode: max abs diff {max:e} over {} values; {} dispatches",
        want.len(),
        prog.stats.dispatches
    );
    assert!(max < 1e-5, "max abs diff {max}");
}
