//! SDXL (base, refiner) and SD 2.x (eps, v) workflows end to end give
//! ComfyUI's latents and images for the same seed: tiny checkpoints in the
//! real single-file layouts (SDXL's `conditioner.embedders.*` CLIP-L and
//! OpenCLIP-G, SD 2.x's `cond_stage_model.model.*` OpenCLIP-H) and separate
//! UNet/CLIP/VAE files, run by `sdkit run` and compared with ComfyUI's nodes
//! on the same graphs (tools/reference/families_pipeline.py →
//! tests/reference/families/expected.json). Covers CLIPTextEncode (long,
//! weighted prompts), CLIPTextEncodeSDXL with sizes unlike the latent's,
//! CLIPSetLastLayer, img2img, base → refiner with leftover noise and
//! CLIPTextEncodeSDXLRefiner, batch 2 with karras, SD 2.x v-prediction by
//! ComfyUI's weight-statistics rule, UNETLoader + DualCLIPLoader +
//! VAELoader.

mod support;

use std::sync::OnceLock;
use support::{check_graph, copy_input, run, write_tensors};

fn fixture() -> &'static serde_json::Value {
    static FX: OnceLock<serde_json::Value> = OnceLock::new();
    FX.get_or_init(|| support::fixture("families/expected.json"))
}

/// A base folder with every tiny model file of the fixture and the input
/// image.
fn setup() -> tempfile::TempDir {
    let fx = fixture();
    let base = tempfile::tempdir().expect("tempdir");
    for f in fx["files"].as_array().expect("files") {
        let path = base
            .path()
            .join("models")
            .join(f["folder"].as_str().expect("folder"))
            .join(f["name"].as_str().expect("name"));
        write_tensors(
            &path,
            &f["keys"],
            f.get("scaled"),
            f["checksum_f16"].as_str().expect("checksum"),
            None,
        );
    }
    copy_input(base.path());
    base
}

fn matches_on(graph: &str, device: &str) {
    let base = setup();
    run(base.path(), graph, device);
    check_graph(base.path(), fixture(), graph, None);
}

#[test]
fn sdxl_txt2img_matches_comfyui() {
    matches_on("tiny_sdxl_txt2img", "cpu");
}

#[test]
fn sdxl_text_encode_with_sizes_matches_comfyui() {
    matches_on("tiny_sdxl_sizes", "cpu");
}

#[test]
fn sdxl_img2img_with_clip_skip_matches_comfyui() {
    matches_on("tiny_sdxl_img2img", "cpu");
}

#[test]
fn sdxl_base_to_refiner_matches_comfyui() {
    matches_on("tiny_sdxl_refiner", "cpu");
}

#[test]
fn sd2_txt2img_matches_comfyui() {
    matches_on("tiny_sd2_txt2img", "cpu");
}

#[test]
fn sd2_v_prediction_matches_comfyui() {
    matches_on("tiny_sd2_v_txt2img", "cpu");
}

#[test]
fn sd2_v_img2img_matches_comfyui() {
    matches_on("tiny_sd2_v_img2img", "cpu");
}

#[test]
fn sdxl_from_separate_files_matches_comfyui() {
    if fixture()["workflows"].get("tiny_sdxl_separate").is_none() {
        panic!("the fixture has no tiny_sdxl_separate reference");
    }
    matches_on("tiny_sdxl_separate", "cpu");
}

#[test]
fn sdxl_txt2img_on_wgpu_matches_comfyui() {
    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("SDXL txt2img on wgpu", e);
        return;
    }
    matches_on("tiny_sdxl_txt2img", "wgpu");
}

#[test]
fn sd2_v_on_wgpu_matches_comfyui() {
    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("SD2 v on wgpu", e);
        return;
    }
    matches_on("tiny_sd2_v_txt2img", "wgpu");
}

/// ConditioningSetArea (with its feathered edges), SetAreaPercentage,
/// SetAreaStrength, SetMask with "mask bounds", SetTimestepRange,
/// Combine, Average and Concat on SDXL, with the opposite-area entries
/// ComfyUI adds to the negative.
#[test]
fn sdxl_conditioning_ops_match_comfyui() {
    matches_on("tiny_sdxl_cond_ops", "cpu");
}

/// UNETLoader with weight_dtype fp8_e4m3fn: the weights rounded to fp8 as
/// ComfyUI stores them, computed in f32.
#[test]
fn unet_loader_fp8_weights_match_comfyui() {
    matches_on("tiny_sdxl_fp8", "cpu");
}

/// The refiner from separate files: UNETLoader (refiner UNet) and
/// CLIPLoader with OpenCLIP-G alone, with CLIPTextEncodeSDXLRefiner.
#[test]
fn sdxl_refiner_from_separate_files_matches_comfyui() {
    matches_on("tiny_sdxl_refiner_separate", "cpu");
}
