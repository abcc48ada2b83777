//! The OpenCLIP text encoder graph on the checkpoint's OpenCLIP keys equals
//! ComfyUI's CLIPTextModel on the keys ComfyUI converts them to
//! (tools/reference/open_clip.py): the last and penultimate hidden states
//! (without and with the final LayerNorm) and the projected pooled output.

use sdkit_compute::backend::cpu;
use sdkit_compute::plan::plan;
use sdkit_compute::tensor::{GraphBuilder, InputKind};
use sdkit_nodes::models::clip::{causal_mask, ClipLayer};
use sdkit_nodes::models::detect::{open_clip_config, OpenClipConfig, Shapes};
use sdkit_nodes::models::open_clip::{end_token_one_hot, text_encoder};
use std::sync::Arc;

const PREFIX: &str = "conditioner.embedders.1.model.";

/// The reference script's weight formula (its constants are arbitrary and
/// shared with it).
#[allow(clippy::approx_constant)]
fn value(name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let seed: f64 = name.bytes().map(f64::from).sum::<f64>() * 0.01;
    let last = shape.last().copied().unwrap_or(1) as f64;
    (0..n)
        .map(|i| {
            let i = i as f64;
            let b = (i * 0.7071 + i * i * 0.0031 + seed).sin();
            let v = if name.ends_with("bias") {
                0.05 * b
            } else if name.contains(".ln_") || name.starts_with("ln_") {
                1.0 + 0.1 * b
            } else {
                b / last.sqrt()
            };
            v as f32
        })
        .collect()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
        .collect()
}

/// The checkpoint's tensor shapes, for detection.
fn shapes(w: usize, layers: usize, inter: usize, vocab: usize) -> Shapes {
    let mut s = Shapes::new();
    let mut put = |k: String, v: &[usize]| {
        s.insert(format!("{PREFIX}{k}"), v.to_vec());
    };
    put("token_embedding.weight".into(), &[vocab, w]);
    put("positional_embedding".into(), &[77, w]);
    put("text_projection".into(), &[w, w]);
    put("ln_final.weight".into(), &[w]);
    for l in 0..layers {
        put(
            format!("transformer.resblocks.{l}.attn.in_proj_weight"),
            &[3 * w, w],
        );
        put(
            format!("transformer.resblocks.{l}.mlp.c_fc.weight"),
            &[inter, w],
        );
    }
    s
}

#[test]
fn matches_comfyui_open_clip() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/open_clip/expected.json"
    ))
    .expect("fixture");
    let fx: serde_json::Value = serde_json::from_str(&text).expect("json");
    let c = &fx["config"];
    let n = |k: &str| c[k].as_u64().expect(k) as usize;
    let cfg: OpenClipConfig = open_clip_config(
        &shapes(n("width"), n("layers"), n("intermediate"), n("vocab")),
        PREFIX,
    )
    .expect("detects")
    .expect("present");
    assert_eq!((cfg.width, cfg.layers, cfg.heads), (128, 3, 2));
    let tokens: Vec<Vec<u32>> = fx["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|r| {
            r.as_array()
                .expect("row")
                .iter()
                .map(|t| t.as_u64().expect("id") as u32)
                .collect()
        })
        .collect();
    let positions: Vec<usize> = fx["positions"]
        .as_array()
        .expect("positions")
        .iter()
        .map(|p| p.as_u64().expect("pos") as usize)
        .collect();
    let (b, len, w) = (tokens.len(), tokens[0].len(), cfg.width);

    // Token rows looked up on the host, as CLIPTextEncode does.
    let table = value("token_embedding.weight", &[cfg.vocab, w]);
    let tok: Vec<f32> = tokens
        .iter()
        .flatten()
        .flat_map(|&t| table[t as usize * w..(t as usize + 1) * w].to_vec())
        .collect();
    let eot = end_token_one_hot(&tokens, n("eos") as u32);

    let mut worst = 0f32;
    for (name, norm) in [("penultimate", false), ("penultimate_normed", true)] {
        let g = GraphBuilder::new();
        let ti = g.input("tok", &[b, len, w]).expect("input");
        let mi = g.input("mask", &[len, len]).expect("input");
        let ei = g.input("eot", &[b, 1, len]).expect("input");
        let out = text_encoder(&g, &cfg, PREFIX, ti, mi, ei, ClipLayer::FromEnd(2), norm)
            .expect("builds");
        let last = text_encoder(&g, &cfg, PREFIX, ti, mi, ei, ClipLayer::Last, false)
            .expect("builds")
            .hidden;
        let graph = g.finish(&[out.hidden, out.pooled, last]);
        let prog = plan(&graph).expect("plans");
        let mut bind = cpu::Bindings::default();
        for (_, wname, shape) in graph.inputs(InputKind::Weight) {
            let rest = wname.trim_start_matches(PREFIX);
            bind.weights
                .insert(wname.to_string(), Arc::new(value(rest, shape)));
        }
        bind.inputs.insert("tok".into(), Arc::new(tok.clone()));
        bind.inputs
            .insert("mask".into(), Arc::new(causal_mask(len)));
        bind.inputs.insert("eot".into(), Arc::new(eot.clone()));
        let got = cpu::run(&prog, &bind).expect("runs");
        let at = |data: &[f32]| -> Vec<f32> {
            (0..b)
                .flat_map(|r| {
                    positions
                        .iter()
                        .flat_map(move |&p| (0..w).map(move |k| (r * len + p) * w + k))
                })
                .map(|i| data[i])
                .collect()
        };
        for (what, mine, want) in [
            (name, at(&got[0].data), floats(&fx[name])),
            ("pooled", got[1].data.clone(), floats(&fx["pooled"])),
            ("last", at(&got[2].data), floats(&fx["last"])),
        ] {
            assert_eq!(mine.len(), want.len(), "{what}");
            let max = mine
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            eprintln!(
                "open_clip {what}: max abs diff {max:e} over {} values",
                want.len()
            );
            assert!(max < 1e-4, "{what}: max abs diff {max}");
            worst = worst.max(max);
        }
    }
    eprintln!("open_clip: worst {worst:e}");
}
