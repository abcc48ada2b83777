//! The diffusers spelling of UNet layer names (what kohya LoRA keys use)
//! equals ComfyUI's `unet_to_diffusers` for tiny and real SD1.5 and SDXL
//! configs (tools/reference/unet_diffusers_map.py), and the CLIP key map
//! gives OpenCLIP's fused q/k/v their rows.

use sdkit_nodes::adapters::keys::{clip_keys, unet_to_diffusers, Target};
use sdkit_nodes::models::detect::{EncoderArch, OpenClipConfig, UnetConfig};
use sdkit_nodes::models::family::TextEncoder;
use std::collections::BTreeSet;

fn list(v: &serde_json::Value) -> Vec<usize> {
    v.as_array()
        .expect("list")
        .iter()
        .map(|x| x.as_u64().expect("int") as usize)
        .collect()
}

#[test]
fn diffusers_names_match_comfyui() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/lora_keys/unet_to_diffusers.json"
    ))
    .expect("fixture");
    let fx: serde_json::Value = serde_json::from_str(&text).expect("json");
    for (name, case) in fx.as_object().expect("cases") {
        let c = &case["config"];
        let cfg = UnetConfig {
            in_channels: 4,
            out_channels: 4,
            model_channels: 320,
            num_res_blocks: list(&c["num_res_blocks"]),
            channel_mult: list(&c["channel_mult"]),
            transformer_depth: list(&c["transformer_depth"]),
            transformer_depth_output: list(&c["transformer_depth_output"]),
            transformer_depth_middle: c["transformer_depth_middle"].as_u64().map(|d| d as usize),
            use_linear_in_transformer: true,
            context_dim: Some(768),
            adm_in_channels: None,
        };
        let want: BTreeSet<(String, String)> = case["map"]
            .as_array()
            .expect("map")
            .iter()
            .map(|p| {
                (
                    p[0].as_str().expect("name").to_string(),
                    p[1].as_str().expect("name").to_string(),
                )
            })
            .collect();
        let got: BTreeSet<(String, String)> = unet_to_diffusers(&cfg).into_iter().collect();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn open_clip_q_k_v_are_rows_of_in_proj() {
    let arch = EncoderArch::OpenClip(OpenClipConfig {
        vocab: 49408,
        width: 128,
        layers: 2,
        max_positions: 77,
        heads: 2,
        intermediate: 256,
        projection: 128,
    });
    let hf = EncoderArch::Clip(sdkit_nodes::models::detect::ClipConfig {
        vocab: 49408,
        width: 64,
        layers: 2,
        max_positions: 77,
        heads: 1,
        intermediate: 128,
        gelu: false,
        projection: None,
    });
    let map = clip_keys(&[
        (TextEncoder::ClipL, "l.text_model.", &hf),
        (TextEncoder::OpenClipG, "g.", &arch),
    ]);
    let k = &map["lora_te2_text_model_encoder_layers_1_self_attn_k_proj"];
    assert_eq!(
        k,
        &(
            1,
            Target {
                tensor: "g.transformer.resblocks.1.attn.in_proj_weight".into(),
                rows: Some((128, 256)),
                swap_halves: false,
            }
        )
    );
    assert_eq!(
        map["lora_te_text_model_encoder_layers_0_mlp_fc1"].1.tensor,
        "l.text_model.encoder.layers.0.mlp.fc1.weight"
    );
    assert_eq!(map["lora_te1_text_model_encoder_layers_0_mlp_fc1"].0, 0);
    // No layer 2 in a 2-layer encoder.
    assert!(!map.contains_key("lora_te2_text_model_encoder_layers_2_mlp_fc1"));
}
