//! ControlNets end to end against ComfyUI's nodes
//! (tools/reference/controlnet_pipeline.py → tests/reference/controlnet/expected.json):
//! an SD1 ControlNet in the ldm layout, with and without the
//! `control_model.` prefix, through ControlNetApply (applied to the
//! negative by the sampler) and ControlNetApplyAdvanced (a timestep range;
//! two chained with different images, one cropped to the latent's aspect),
//! and with a LoRA on the model; an SDXL ControlNet in the diffusers
//! layout; a T2I-Adapter; the Canny preprocessor.

mod support;

use support::{check_graph, copy_input, write_base_checkpoints, write_fixture_files};

fn setup() -> (tempfile::TempDir, serde_json::Value) {
    setup_from("controlnet/expected.json")
}

/// A base folder with the base checkpoints, `fixture`'s files (each in
/// its folder), the LoRA fixture's LoRAs and the example inputs.
fn setup_from(fixture: &str) -> (tempfile::TempDir, serde_json::Value) {
    let fx = support::fixture(fixture);
    let base = tempfile::tempdir().expect("tempdir");
    let models = base.path().join("models");
    write_base_checkpoints(&models);
    for f in fx["files"].as_array().expect("files") {
        let folder = f["folder"].as_str().expect("folder");
        write_fixture_files(&models.join(folder), &serde_json::json!([f]));
    }
    let lora = support::fixture("lora/expected.json");
    write_fixture_files(&models.join("loras"), &lora["loras"]);
    copy_input(base.path());
    (base, fx)
}

fn matches_on(graph: &str, device: &str, tol: Option<f32>) {
    let (base, fx) = setup();
    support::run(base.path(), graph, device);
    check_graph(base.path(), &fx, graph, tol);
}

#[test]
fn controlnet_apply_matches_comfyui() {
    matches_on("tiny_sd1_controlnet", "cpu", None);
}

#[test]
fn controlnet_apply_advanced_with_a_range_matches_comfyui() {
    matches_on("tiny_sd1_controlnet_advanced", "cpu", None);
}

#[test]
fn chained_controlnets_match_comfyui() {
    matches_on("tiny_sd1_controlnet_chain", "cpu", None);
}

#[test]
fn controlnet_with_lora_matches_comfyui() {
    matches_on("tiny_sd1_controlnet_lora", "cpu", None);
}

#[test]
fn sdxl_diffusers_controlnet_matches_comfyui() {
    matches_on("tiny_sdxl_controlnet", "cpu", None);
}

#[test]
fn controlnet_on_wgpu_matches_comfyui() {
    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("ControlNet on wgpu", e);
        return;
    }
    matches_on("tiny_sd1_controlnet_chain", "wgpu", Some(1e-3));
}

/// A T2I-Adapter (the full kind, average-pooling downsamplers, a grey
/// hint) on an SD1 UNet with SD1's twelve input blocks, in a time range.
#[test]
fn t2i_adapter_matches_comfyui() {
    matches_on("tiny_sd1_controlnet_t2i", "cpu", None);
}

/// The Canny preprocessor against kornia's (what ComfyUI's node runs), at
/// two threshold pairs: edge maps are 0 or 1, so a pixel either matches or
/// not; float summation order may flip a pixel whose magnitude sits on a
/// threshold or ties a neighbour, so a handful may differ.
#[test]
fn canny_matches_comfyui() {
    let (base, fx) = setup();
    support::run(base.path(), "tiny_canny", "cpu");
    let images = fx["workflows"]["tiny_canny"]["images"]
        .as_array()
        .expect("images");
    for im in images {
        let prefix = im["filename_prefix"].as_str().expect("prefix");
        let want = support::f32s(im["image_f32"].as_str().expect("image"));
        let path = base.path().join(format!("output/{prefix}_00001_.png"));
        let img = image::open(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .to_rgb8();
        let got = img.as_raw();
        assert_eq!(got.len(), want.len());
        let off = got
            .iter()
            .zip(&want)
            .filter(|(g, w)| **g != sdkit_nodes::io::to_u8(**w))
            .count();
        let edges = want.iter().filter(|v| **v > 0.5).count() / 3;
        eprintln!(
            "{prefix}: {off} of {} values differ ({edges} edge pixels)",
            got.len()
        );
        assert!(
            edges > 20,
            "{prefix}: the reference has too few edges to test"
        );
        assert!(off <= 3 * 6, "{prefix}: {off} values differ");
    }
}

/// A union ControlNet (xinsir's layout, diffusers format) with and
/// without SetUnionControlNetType: "auto" on tiny_sdxl; a chosen type on
/// a 320-wide SDXL (the union layers are 320 wide, as in the real model).
fn union_matches(graph: &str) {
    let (base, fx) = setup_from("controlnet_union/expected.json");
    support::run(base.path(), graph, "cpu");
    check_graph(base.path(), &fx, graph, None);
}

#[test]
fn union_controlnet_auto_matches_comfyui() {
    union_matches("tiny_sdxl_controlnet_union_auto");
}

#[test]
fn union_controlnet_with_a_type_matches_comfyui() {
    union_matches("tiny_sdxl_controlnet_union");
}

/// Stability's control-LoRA: a ControlNet made from the sampling model's
/// weights and the file's, with and without a LoRA on the model (which
/// the ControlNet then inherits).
fn control_lora_matches(graph: &str) {
    let (base, fx) = setup_from("control_lora/expected.json");
    support::run(base.path(), graph, "cpu");
    check_graph(base.path(), &fx, graph, None);
}

#[test]
fn control_lora_matches_comfyui() {
    control_lora_matches("tiny_sdxl_control_lora");
}

#[test]
fn control_lora_on_a_lora_patched_model_matches_comfyui() {
    control_lora_matches("tiny_sdxl_control_lora_model_lora");
}
