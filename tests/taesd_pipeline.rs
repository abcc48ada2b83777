//! TAESD against ComfyUI (tools/reference/taesd_pipeline.py →
//! tests/reference/taesd/expected.json): VAELoader's `taesd` and
//! `taesdxl` from `models/vae_approx` decoding a sampled latent and
//! encoding an image (the SDXL one at a size the encoder crops).

mod support;

use support::{check_graph, copy_input, write_base_checkpoints};

fn matches_on(graph: &str, device: &str, tol: Option<f32>) {
    let fx = support::fixture("taesd/expected.json");
    let base = tempfile::tempdir().expect("tempdir");
    let models = base.path().join("models");
    write_base_checkpoints(&models);
    for f in fx["files"].as_array().expect("files") {
        let folder = f["folder"].as_str().expect("folder");
        support::write_fixture_files(&models.join(folder), &serde_json::json!([f]));
    }
    copy_input(base.path());
    support::run(base.path(), graph, device);
    check_graph(base.path(), &fx, graph, tol);
}

#[test]
fn taesd_decodes_and_encodes_like_comfyui() {
    matches_on("tiny_sd1_taesd", "cpu", None);
}

#[test]
fn taesdxl_decodes_and_encodes_like_comfyui() {
    matches_on("tiny_sdxl_taesd", "cpu", None);
}

#[test]
fn taesd_on_wgpu_matches_comfyui() {
    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("TAESD on wgpu", e);
        return;
    }
    matches_on("tiny_sd1_taesd", "wgpu", Some(1e-3));
}
