//! LoRA and LoCon end to end: kohya-format files (UNet Linears, SD1's 1×1
//! proj convs, 3×3 LoCon convs with and without a Tucker mid, CLIP-L,
//! SDXL's te1/te2 with OpenCLIP-G's fused q/k/v) on the tiny SD1 and SDXL
//! checkpoints, two stacked with a negative strength, model-only, against
//! ComfyUI's nodes on the same graphs (tools/reference/lora_pipeline.py →
//! tests/reference/lora/expected.json).

mod support;

use support::{check_graph, copy_input, run, write_base_checkpoints, write_fixture_files};

/// The base checkpoints and the LoRAs.
fn setup() -> (tempfile::TempDir, serde_json::Value) {
    let fx = support::fixture("lora/expected.json");
    let base = tempfile::tempdir().expect("tempdir");
    let models = base.path().join("models");
    write_base_checkpoints(&models);
    write_fixture_files(&models.join("loras"), &fx["loras"]);
    copy_input(base.path());
    (base, fx)
}

fn matches_on(graph: &str, device: &str) {
    let (base, fx) = setup();
    run(base.path(), graph, device);
    check_graph(base.path(), &fx, graph, None);
}

#[test]
fn sd1_stacked_loras_match_comfyui() {
    matches_on("tiny_sd1_lora", "cpu");
}

#[test]
fn sd1_model_only_lora_matches_comfyui() {
    matches_on("tiny_sd1_lora_model_only", "cpu");
}

#[test]
fn sdxl_lora_matches_comfyui() {
    matches_on("tiny_sdxl_lora", "cpu");
}

#[test]
fn sdxl_lora_on_wgpu_matches_comfyui() {
    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("SDXL LoRA on wgpu", e);
        return;
    }
    // The GPU holds weights as f16 where the adapter can (as ComfyUI on a
    // GPU does), so the patched f32 weights of the CPU reference are
    // rounded there: the latent moves by ~2e-4, pixels by 1/255 on under
    // 1% of values.
    let (base, fx) = setup();
    run(base.path(), "tiny_sdxl_lora", "wgpu");
    check_graph(base.path(), &fx, "tiny_sdxl_lora", Some(1e-3));
}

/// LoHa (plain and CP), LoKr (full and decomposed factors, a conv), a
/// full diff with its bias and a bias-only diff, LoHa/LoKr on CLIP.
#[test]
fn sd1_lycoris_matches_comfyui() {
    matches_on("tiny_sd1_lycoris", "cpu");
}

/// What `watch` does when a LoRA strength is edited: the stack runs again
/// with one loader changed. Tensors only the other LoRA patches keep their
/// patch list, so they are neither recomputed nor uploaded again; the
/// changed LoRA's tensors are (counted from the KSampler's residency
/// events, on wgpu under a budget).
#[test]
fn lora_strength_edit_reuploads_only_that_loras_tensors() {
    let (base, _fx) = setup();
    let text =
        std::fs::read_to_string(support::root().join("graphs/tiny_sd1_lora.json")).expect("graph");
    // (strength of LoRA a, of LoRA b): first run, b edited, nothing
    // edited, a edited (a patches every UNet Linear, b only attn2 k/v).
    let variants: Vec<serde_json::Value> = [(0.8, -0.5), (0.8, -0.25), (0.8, -0.25), (0.5, -0.25)]
        .iter()
        .map(|(a, b)| {
            let mut wf: serde_json::Value = serde_json::from_str(&text).expect("json");
            wf["10"]["inputs"]["strength_model"] = serde_json::json!(a);
            wf["11"]["inputs"]["strength_model"] = serde_json::json!(b);
            wf
        })
        .collect();
    let Some(u) = support::residency_uploads(base.path(), &variants, "6", "LoRA edit residency")
    else {
        return;
    };
    // The unchanged run samples nothing (the executor's cache answers).
    assert_eq!(u.len(), 3, "one residency event per KSampler run: {u:?}");
    assert!(u[0] > 0, "the first run uploads the UNet");
    assert!(
        u[1] > 0,
        "b's patched tensors were not uploaded again: {u:?}"
    );
    assert!(
        u[1] * 4 < u[0],
        "editing b uploaded more than its tensors: {u:?}"
    );
    assert!(
        u[2] > u[1],
        "editing a (more tensors) uploaded less than b: {u:?}"
    );
}
