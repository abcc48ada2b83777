//! Inpainting end to end against ComfyUI's nodes
//! (tools/reference/inpaint_pipeline.py → tests/reference/inpaint/expected.json):
//! a 9-channel inpainting checkpoint through VAEEncodeForInpaint and
//! InpaintModelConditioning (with and without its noise mask), the noise
//! mask on ordinary SD1 and SDXL checkpoints (SetLatentNoiseMask; masks
//! from LoadImage's alpha and from mask nodes; a batch; an ancestral and a
//! multistep sampler; KSamplerAdvanced starting late), odd image sizes
//! that crop and resize the mask.

mod support;

use support::{check_graph, copy_input, run, write_base_checkpoints, write_fixture_files};

fn setup() -> (tempfile::TempDir, serde_json::Value) {
    let fx = support::fixture("inpaint/expected.json");
    let base = tempfile::tempdir().expect("tempdir");
    let models = base.path().join("models");
    write_base_checkpoints(&models);
    write_fixture_files(&models.join("checkpoints"), &fx["files"]);
    copy_input(base.path());
    (base, fx)
}

fn matches_on(graph: &str, device: &str, tol: Option<f32>) {
    let (base, fx) = setup();
    run(base.path(), graph, device);
    check_graph(base.path(), &fx, graph, tol);
}

#[test]
fn inpainting_checkpoint_with_vae_encode_for_inpaint_matches_comfyui() {
    matches_on("tiny_sd1_inpaint", "cpu", None);
}

#[test]
fn vae_encode_for_inpaint_crops_and_grows_like_comfyui() {
    matches_on("tiny_sd1_inpaint_crop", "cpu", None);
}

#[test]
fn inpaint_model_conditioning_matches_comfyui() {
    matches_on("tiny_sd1_inpaint_cond", "cpu", None);
    matches_on("tiny_sd1_inpaint_cond_nomask", "cpu", None);
}

#[test]
fn noise_mask_matches_comfyui() {
    matches_on("tiny_sd1_inpaint_noise_mask", "cpu", None);
}

#[test]
fn mask_nodes_batch_and_ancestral_noise_match_comfyui() {
    matches_on("tiny_sd1_inpaint_mask_nodes", "cpu", None);
}

#[test]
fn sdxl_noise_mask_matches_comfyui() {
    matches_on("tiny_sdxl_inpaint", "cpu", None);
}

#[test]
fn advanced_sampler_with_noise_mask_matches_comfyui() {
    matches_on("tiny_sd1_inpaint_advanced", "cpu", None);
}

#[test]
fn inpainting_on_wgpu_matches_comfyui() {
    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("inpainting on wgpu", e);
        return;
    }
    matches_on("tiny_sd1_inpaint_cond", "wgpu", Some(1e-3));
}

/// Noise masks on wgpu, where the sampling loop runs on the device with
/// KSamplerX0Inpaint's blend in the model's program: SetLatentNoiseMask
/// with Euler, the mask nodes with Euler ancestral, SDXL, and the custom
/// sampler with a noise mask.
#[test]
fn noise_masks_on_wgpu_match_comfyui() {
    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("noise masks on wgpu", e);
        return;
    }
    for graph in [
        "tiny_sd1_inpaint_noise_mask",
        "tiny_sd1_inpaint_mask_nodes",
        "tiny_sdxl_inpaint",
        "tiny_sd1_inpaint_advanced",
    ] {
        matches_on(graph, "wgpu", None);
    }
}
