//! ControlNets end to end against ComfyUI's nodes
//! (tools/reference/controlnet_pipeline.py → tests/reference/controlnet/expected.json):
//! an SD1 ControlNet in the ldm layout, with and without the
//! `control_model.` prefix, through ControlNetApply (applied to the
//! negative by the sampler) and ControlNetApplyAdvanced (a timestep range;
//! two chained with different images, one cropped to the latent's aspect),
//! and with a LoRA on the model; an SDXL ControlNet in the diffusers
//! layout; a T2I-Adapter; the Canny preprocessor. On wgpu (lavapipe in
//! CI) the same against ComfyUI, and a chain in the sampling loop on the
//! device against the host loop.

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
    // In the device loop's programs, switching as nets start and stop:
    // one net within a range, a chain whose second net starts later.
    matches_on("tiny_sd1_controlnet_advanced", "wgpu", Some(1e-3));
    matches_on("tiny_sd1_controlnet_chain", "wgpu", Some(1e-3));
}

/// The chain graph `text` (latent only) run on `gpu` in a fresh folder:
/// the bytes read back and the saved latent.
fn chain_run(gpu: sdkit_engine::Runtime, text: &str) -> (u64, Vec<f32>) {
    let (base, _) = setup();
    let none = sdkit_engine::event::PreviewMethod::None;
    let (bytes, _) = support::run_in(base.path(), gpu, text, none);
    let path = "output/latents/tiny_sd1_controlnet_chain_00001_.latent";
    let latent = sdkit_compute::weights::SafeTensors::open(&base.path().join(path))
        .expect("SaveLatent wrote the latent")
        .to_f32("latent_tensor")
        .expect("f32");
    (bytes, latent)
}

/// On a GPU a ControlNet chain that every entry shares runs in the UNet's
/// program (the device loop): the residuals never reach the host. The
/// two-net chain (one file in each layout) with both nets from the first
/// step gives the host loop's latent on the same adapter and reads back
/// exactly what the graph without the nets does. (Chains that start and
/// stop are checked against ComfyUI above.)
#[test]
fn controlnet_chain_runs_in_the_device_loop() {
    let path = support::root().join("graphs/tiny_sd1_controlnet_chain.json");
    let text = std::fs::read_to_string(path).expect("graph");
    let mut g: serde_json::Value = serde_json::from_str(&text).expect("json");
    g["25"]["inputs"]["start_percent"] = serde_json::json!(0.0);
    let with_nets = support::latent_only(&g.to_string());
    g["6"]["inputs"]["positive"] = serde_json::json!(["3", 0]);
    g["6"]["inputs"]["negative"] = serde_json::json!(["4", 0]);
    let without = support::latent_only(&g.to_string());
    let mut runs = Vec::new();
    for (device_loops, text) in [(true, &with_nets), (false, &with_nets), (true, &without)] {
        let Some(gpu) = support::gpu_runtime(device_loops, "ControlNet in the device loop") else {
            return;
        };
        runs.push(chain_run(gpu, text));
    }
    let d = support::rel_diff(&runs[0].1, &runs[1].1);
    eprintln!(
        "device loop vs host loop: max rel diff {d:e}, bytes read back {} vs {}",
        runs[0].0, runs[1].0
    );
    assert!(d < 3e-5, "device loop differs by {d}");
    assert_eq!(
        runs[0].0, runs[2].0,
        "bytes read back with and without the nets"
    );
}

/// Samplers that carry state besides the latent, on the chain whose
/// second net starts at 30%: the device loop changes program where the
/// set of active nets changes and hands the carried state to the next
/// session. heunpp2's three calls a step (σᵢ, σᵢ₊₁, σᵢ₊₂) cross the
/// net's start back and forth, its second call handing on the step's
/// start and first derivative to the third; UniPC's history includes
/// model outputs passed through from its inputs (read back before the
/// run's carries overwrite them). SEEDS-3 and dpm_fast (a three-call
/// step, then a two-call one) carry the step's start, first prediction
/// and noise through calls at intermediate σ. Each gives the host loop's
/// latent on the same adapter and reads back less.
#[test]
fn carried_state_crosses_program_changes() {
    let path = support::root().join("graphs/tiny_sd1_controlnet_chain.json");
    let text = std::fs::read_to_string(path).expect("graph");
    for sampler in ["heunpp2", "uni_pc", "seeds_3", "dpm_fast"] {
        let mut g: serde_json::Value = serde_json::from_str(&text).expect("json");
        g["6"]["inputs"]["sampler_name"] = serde_json::json!(sampler);
        g["6"]["inputs"]["steps"] = serde_json::json!(5);
        let graph = support::latent_only(&g.to_string());
        let mut runs = Vec::new();
        for device_loops in [true, false] {
            let Some(gpu) = support::gpu_runtime(device_loops, "state across programs") else {
                return;
            };
            runs.push(chain_run(gpu, &graph));
        }
        let d = support::rel_diff(&runs[0].1, &runs[1].1);
        eprintln!(
            "{sampler}: device loop vs host loop: max rel diff {d:e}, bytes read back {} vs {}",
            runs[0].0, runs[1].0
        );
        assert!(d < 3e-5, "{sampler}: device loop differs by {d}");
        assert!(runs[0].0 < runs[1].0, "{sampler}: the device loop ran");
    }
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

/// An SDXL ControlNet on wgpu, in the device loop's program: the
/// diffusers layout, the ADM vector into the net too.
#[test]
fn sdxl_controlnet_on_wgpu_matches_comfyui() {
    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("SDXL ControlNet on wgpu", e);
        return;
    }
    matches_on("tiny_sdxl_controlnet", "wgpu", Some(1e-3));
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
