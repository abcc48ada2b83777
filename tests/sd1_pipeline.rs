//! SD1 workflows end to end give ComfyUI's latents and images for the same
//! seed: a tiny checkpoint in the real single-file layout (keys and shapes
//! from ComfyUI's own classes, values from a formula both sides compute,
//! stored f16) run by `sdkit run` through CheckpointLoaderSimple,
//! CLIPSetLastLayer, CLIPTextEncode (weights, two chunks), KSampler (euler;
//! normal and karras; CFG; denoise < 1), VAEEncode, VAEDecode, SaveImage
//! and SaveLatent, compared with ComfyUI's nodes running the same graphs
//! (tools/reference/sd1_pipeline.py → tests/reference/sd1/expected.json).

mod support;

use sdkit_compute::weights::{write_safetensors, DType, SafeTensors, TensorData};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Command;
use support::{copy_input, root, run, write_tensors};

fn fixture() -> serde_json::Value {
    support::fixture("sd1/expected.json")
}

/// Writes the tiny checkpoint under `models/checkpoints`; checks the
/// weights are the reference's.
fn write_checkpoint(base: &Path, fx: &serde_json::Value) {
    write_checkpoint_with_nan(base, fx, None);
}

/// [`write_checkpoint`], with the tensor named `nan` (if any) all NaN: a
/// broken download.
fn write_checkpoint_with_nan(base: &Path, fx: &serde_json::Value, nan: Option<&str>) {
    let path = base
        .join("models/checkpoints")
        .join(fx["checkpoint"].as_str().expect("name"));
    write_tensors(
        &path,
        &fx["keys"],
        None,
        fx["checksum_f16"].as_str().expect("checksum"),
        nan,
    );
}

fn setup() -> (tempfile::TempDir, serde_json::Value) {
    let fx = fixture();
    let base = tempfile::tempdir().expect("tempdir");
    write_checkpoint(base.path(), &fx);
    copy_input(base.path());
    (base, fx)
}

fn check(base: &Path, fx: &serde_json::Value, graph: &str, image_prefix: &str) {
    support::check_outputs(
        base,
        &fx["workflows"][graph],
        graph,
        "latents/tiny_sd1_00001_.latent",
        image_prefix,
    );
}

/// Runs `graph` with `sdkit run --device cpu` and checks its outputs.
fn matches_on_cpu(graph: &str, image_prefix: &str) {
    let (base, fx) = setup();
    run(base.path(), graph, "cpu");
    check(base.path(), &fx, graph, image_prefix);
}

/// SamplerEulerAncestral at its defaults is KSamplerSelect's
/// euler_ancestral: the custom-sampling graph with it gives the same
/// ComfyUI image.
#[test]
fn sampler_presets_match_their_ksampler_names() {
    let (base, fx) = setup();
    run(base.path(), "tiny_sd1_custom_presets", "cpu");
    check(base.path(), &fx, "tiny_sd1_custom", "tiny_sd1_custom");
}

#[test]
fn txt2img_matches_comfyui() {
    matches_on_cpu("tiny_sd1_txt2img", "tiny_sd1");
}

#[test]
fn img2img_matches_comfyui() {
    matches_on_cpu("tiny_sd1_img2img", "tiny_sd1_img2img");
}

/// An ancestral sampler that also drops the penultimate sigma
/// (dpm_2_ancestral) with the exponential scheduler: the KSampler glue
/// around the samplers (sigma rule, noise generator) is ComfyUI's.
#[test]
fn ancestral_sampler_matches_comfyui() {
    matches_on_cpu("tiny_sd1_ancestral", "tiny_sd1_ancestral");
}

/// Two KSamplerAdvanced nodes splitting one schedule (the first keeps its
/// leftover noise, the second adds none), with two samplers.
#[test]
fn advanced_two_stage_matches_comfyui() {
    matches_on_cpu("tiny_sd1_advanced", "tiny_sd1_advanced");
}

/// A CFG++ sampler at cfg 1 (the negative still runs: ComfyUI disables its
/// cfg-1 shortcut for these) with the beta scheduler.
#[test]
fn cfg_pp_sampler_matches_comfyui() {
    matches_on_cpu("tiny_sd1_cfgpp", "tiny_sd1_cfgpp");
}

/// The custom-sampling nodes: KSamplerSelect, BasicScheduler, SplitSigmas
/// and two SamplerCustom stages (noise added only in the first).
#[test]
fn custom_sampling_matches_comfyui() {
    matches_on_cpu("tiny_sd1_custom", "tiny_sd1_custom");
}

/// ModelSamplingDiscrete reading the model as v-prediction.
#[test]
fn v_prediction_matches_comfyui() {
    matches_on_cpu("tiny_sd1_vpred", "tiny_sd1_vpred");
}

/// Rectified-flow sampling (ModelSamplingSD3, shift 3) with the RF form of
/// euler_ancestral from σ = 1.
#[test]
fn flow_sampling_matches_comfyui() {
    matches_on_cpu("tiny_sd1_flow", "tiny_sd1_flow");
}

/// ModelSamplingFlux with a two-stage KSamplerAdvanced: the leftover-noise
/// latent leaves the first stage divided by (1 − σ) and re-enters the
/// second scaled by it.
#[test]
fn flux_sampling_two_stage_matches_comfyui() {
    matches_on_cpu("tiny_sd1_flux", "tiny_sd1_flux");
}

/// ModelSamplingDiscrete `lcm`: the distilled 50-sigma schedule and LCM's
/// consistency output with the lcm sampler.
#[test]
fn lcm_sampling_matches_comfyui() {
    matches_on_cpu("tiny_sd1_lcm", "tiny_sd1_lcm");
}

/// v-prediction on the zero-terminal-SNR schedule.
#[test]
fn zsnr_v_prediction_matches_comfyui() {
    matches_on_cpu("tiny_sd1_zsnr", "tiny_sd1_zsnr");
}

/// SamplerCustomAdvanced in two stages split by SplitSigmasDenoise:
/// RandomNoise with a CFGGuider, then DisableNoise with a BasicGuider.
#[test]
fn guiders_match_comfyui() {
    matches_on_cpu("tiny_sd1_guiders", "tiny_sd1_guiders");
}

/// VAEEncodeTiled and VAEDecodeTiled around an img2img sampler: three
/// blended passes each, many tiles (edge tiles narrower than the feather),
/// an image cropped to the VAE's cell first.
#[test]
fn tiled_vae_matches_comfyui() {
    matches_on_cpu("tiny_sd1_tiled", "tiny_sd1_tiled");
}

/// Tiles that cannot overlap as asked (ComfyUI's tiled encode would step
/// by zero) are a clear error naming the node, not a hang or a panic.
#[test]
fn impossible_tile_overlap_is_an_error() {
    let (base, _) = setup();
    let o = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args([
            "run",
            "-q",
            "--device",
            "cpu",
            "--set",
            "4.tile_size=64",
            "--set",
            "4.overlap=32",
        ])
        .arg(root().join("graphs/tiny_sd1_tiled.json"))
        .arg("--base-dir")
        .arg(base.path())
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("VAEEncodeTiled") && err.contains("cannot overlap by 32"),
        "{err}"
    );
}

/// A device too small for the VAE's decode of the whole batch: the
/// runtime re-plans, then the decode falls back to tiles (as ComfyUI does
/// on out-of-memory; here one tile per batch item, three passes), and the
/// image still matches the reference.
#[test]
fn vae_decode_falls_back_to_tiles_when_memory_runs_out() {
    use sdkit_compute::backend::wgpu::{Options, WgpuBackend};
    use sdkit_engine::{CancelToken, Event, EventSink, Executor, Paths, RunOptions, Runtime};
    use std::sync::{Arc, Mutex};

    let small = match WgpuBackend::with_options(&Options {
        allow_coopmat: false,
        device_memory: Some(2_400_000),
        ..Options::default()
    }) {
        Ok(g) => g,
        Err(e) => {
            sdkit_compute::backend::wgpu::no_adapter("VAE tile fallback", e);
            return;
        }
    };
    let (base, fx) = setup();
    let lib = Arc::new(sdkit_nodes::library());
    let paths = Paths::under(base.path());
    let exec =
        Executor::new(lib.clone(), Arc::new(paths.clone())).with_runtime(Runtime::wgpu(small));
    let tiles: Arc<Mutex<Vec<u64>>> = Arc::default();
    let sink = tiles.clone();
    let events: EventSink = Arc::new(move |e: &Event| {
        if let Event::Progress { node, max, .. } = e {
            if node == "7" {
                sink.lock().expect("lock").push(*max);
            }
        }
    });
    let text = std::fs::read_to_string(root().join("graphs/tiny_sd1_txt2img.json")).expect("graph");
    let wf = sdkit_schema::workflow::load(&text, &lib.registry).expect("loads");
    let graph = sdkit_engine::validate(&wf, &lib.registry, &paths).expect("valid");
    let rt = tokio::runtime::Runtime::new().expect("tokio");
    rt.block_on(exec.run(&graph, RunOptions::new(events, CancelToken::new())))
        .expect("runs");
    let tiles = tiles.lock().expect("lock").clone();
    assert_eq!(tiles.len(), 6, "the decode did not run in tiles: {tiles:?}");
    assert!(tiles.iter().all(|&m| m == 6));
    check(base.path(), &fx, "tiny_sd1_txt2img", "tiny_sd1");
}

/// The same workflow on the wgpu backend (lavapipe on CI).
#[test]
fn txt2img_on_wgpu_matches_comfyui() {
    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("txt2img on wgpu", e);
        return;
    }
    let (base, fx) = setup();
    run(base.path(), "tiny_sd1_txt2img", "wgpu");
    check(base.path(), &fx, "tiny_sd1_txt2img", "tiny_sd1");
}

/// Runs the workflow `text` on wgpu with `device_loops` set and
/// `preview`: the base folder, the bytes the run downloaded and the
/// previews sent (None without an adapter, after saying why or failing
/// where one is required).
fn run_on_gpu(
    text: &str,
    device_loops: bool,
    preview: sdkit_engine::event::PreviewMethod,
) -> Option<(tempfile::TempDir, serde_json::Value, u64, usize)> {
    let gpu = support::gpu_runtime(device_loops, "sampling loop on the device")?;
    Some(run_on(gpu, text, preview))
}

/// Runs the workflow `text` on `runtime` in a fresh folder; returns it,
/// the fixture, the bytes read back from the device and the previews sent.
fn run_on(
    runtime: sdkit_engine::Runtime,
    text: &str,
    preview: sdkit_engine::event::PreviewMethod,
) -> (tempfile::TempDir, serde_json::Value, u64, usize) {
    let (base, fx) = setup();
    let (bytes, sent) = support::run_in(base.path(), runtime, text, preview);
    (base, fx, bytes, sent)
}

/// On a GPU the sampling loop runs on the device (`Options::device_loops`):
/// CFG and the Euler step are part of the UNet's program and the latent
/// stays there between steps, so the sampler reads back only the final
/// latent and prediction, not each step's two predictions. Both loops
/// give ComfyUI's image; the bytes downloaded differ by exactly the
/// per-step reads. With previews on, the device loop reads each step's
/// prediction too, and every step is previewed either way.
#[test]
fn sampling_loop_stays_on_the_device() {
    use sdkit_engine::event::PreviewMethod;
    let text = std::fs::read_to_string(root().join("graphs/tiny_sd1_txt2img.json")).expect("graph");
    // 4 steps; the latent is 2×4×8×8 f32 (2,048 bytes), each step's UNet
    // output twice that (positive and negative). On the device: the last
    // step's latent and prediction, and with previews each step's
    // prediction.
    let latent = 2 * 4 * 8 * 8 * 4;
    for (preview, saved) in [
        (PreviewMethod::None, 4 * 2 * latent - 2 * latent),
        (
            PreviewMethod::Latent2Rgb,
            4 * 2 * latent - (3 * latent + 2 * latent),
        ),
    ] {
        let mut downloaded = Vec::new();
        for device_loops in [true, false] {
            let Some((base, fx, bytes, previews)) = run_on_gpu(&text, device_loops, preview) else {
                return;
            };
            downloaded.push(bytes);
            let want = if preview == PreviewMethod::None { 0 } else { 4 };
            assert_eq!(previews, want, "previews sent ({preview:?})");
            check(base.path(), &fx, "tiny_sd1_txt2img", "tiny_sd1");
        }
        assert_eq!(
            downloaded[1] - downloaded[0],
            saved,
            "bytes downloaded, device loop vs host loop ({preview:?}): {downloaded:?}"
        );
    }
}

/// The samplers with a device loop, on the karras schedule, give the
/// host loop's latent (the host samplers are checked against k-diffusion
/// in `nodes/tests/samplers.rs`): the step's arithmetic and noise draws
/// are the same; the two-call samplers (Heun, DPM-2, DPM++ 2S ancestral,
/// DPM++ SDE) run the program twice a step, heunpp2 three times (twice on
/// the second-last step, once on the last), the linear multistep ones
/// (LMS, DEIS, iPNDM, iPNDM-v) carry three derivatives, UniPC three
/// model outputs and its corrector's base, res_multistep, gradient
/// estimation and DPM++ 2M CFG++ (each plain and CFG++) one; DDPM none.
/// Each device loop reads back the same bytes, so none fell back to the
/// host loop. The host loop runs on the CPU: on lavapipe each run takes
/// seconds, on the CPU a fraction of one, and the two backends' UNets
/// agree far inside the bound.
#[test]
fn device_loops_match_host_loops() {
    use sdkit_engine::event::PreviewMethod;
    let read = |name| std::fs::read_to_string(root().join(name)).expect("graph");
    let txt2img = read("graphs/tiny_sd1_txt2img.json");
    // Split over two KSamplerAdvanced nodes, the first ending with noise
    // left: its last step makes both calls.
    let advanced = read("graphs/tiny_sd1_advanced.json");
    let plain = r#""sampler_name": "euler", "scheduler": "normal""#;
    // (Euler, Euler ancestral, DPM++ 2M, LCM: checked against ComfyUI.
    // ddim is Euler; DPM-2 is DPM-2 ancestral without noise.) Over 7
    // steps (`:7`) LMS and iPNDM reach order 4 and UniPC order 3, falling
    // back at the end; UniPC is first order over 2, rescaled over 1.
    let samplers = "dpmpp_2m_sde dpmpp_3m_sde euler_ancestral_cfg_pp heun dpm_2_ancestral dpmpp_2s_ancestral dpmpp_sde \
        res_multistep res_multistep_ancestral res_multistep_cfg_pp res_multistep_ancestral_cfg_pp \
        gradient_estimation gradient_estimation_cfg_pp dpmpp_2m_cfg_pp dpmpp_2s_ancestral_cfg_pp dpm_fast:8 dpm_fast:4 ddpm heunpp2 er_sde:5 seeds_2 seeds_3 sa_solver:6 sa_solver_pece:6 \
        lms:7 deis:7 ipndm:7 ipndm_v:7 uni_pc:7 uni_pc_bh2:7 uni_pc:2 uni_pc:1";
    let mut cases: Vec<(&str, String)> = samplers
        .split_whitespace()
        .map(|spec| {
            let (sampler, steps) = spec.split_once(':').unwrap_or((spec, "4"));
            let with = format!(r#""sampler_name": "{sampler}", "scheduler": "karras""#);
            let steps = format!(r#""steps": {steps}"#);
            let graph = txt2img.replace(plain, &with);
            (sampler, graph.replace(r#""steps": 4"#, &steps))
        })
        .collect();
    // On a flow model (ModelSamplingSD3): the ancestral RF forms, an SDE
    // sampler's offset first σ, the flow λ (SA-Solver's interval).
    let flow = read("graphs/tiny_sd1_flow.json");
    let ancestral = r#""sampler_name": "euler_ancestral""#;
    let on_advanced = "heun dpmpp_sde uni_pc_bh2 heunpp2 seeds_2 sa_solver_pece";
    let on_flow = "euler_ancestral dpm_2_ancestral dpmpp_2s_ancestral dpmpp_2m_sde uni_pc \
        er_sde seeds_3 sa_solver";
    for (graph, samplers) in [(&advanced, on_advanced), (&flow, on_flow)] {
        for sampler in samplers.split_whitespace() {
            let with = format!(r#""sampler_name": "{sampler}""#);
            cases.push((sampler, graph.replace(ancestral, &with)));
        }
    }
    // One adapter and one CPU runtime for every case: their pipelines and
    // packed weights carry over.
    let Some(gpu) = support::gpu_runtime(true, "sampling loop on the device") else {
        return;
    };
    let cpu = sdkit_engine::Runtime::cpu();
    // Bytes read back, per graph.
    let mut downloads: HashMap<[bool; 2], u64> = HashMap::new();
    for (sampler, graph) in cases {
        assert!(graph != txt2img && graph != advanced, "{sampler}");
        let graph = support::latent_only(&graph);
        let before = gpu.bytes_downloaded();
        let (on_gpu, ..) = run_on(gpu.clone(), &graph, PreviewMethod::None);
        let bytes = gpu.bytes_downloaded() - before;
        // Every device loop over a graph reads back the same: the last
        // latent and prediction of each sampler node, whatever its steps
        // and calls (a host loop reads two predictions a call).
        let kind = ["KSamplerAdvanced", "ModelSamplingSD3"].map(|n| graph.contains(n));
        let first = *downloads.entry(kind).or_insert(bytes);
        assert_eq!(
            bytes, first,
            "{sampler}: bytes read back (the first case's {first})"
        );
        let (on_cpu, ..) = run_on(cpu.clone(), &graph, PreviewMethod::None);
        let latents: Vec<Vec<f32>> = [on_gpu, on_cpu]
            .iter()
            .map(|base| {
                SafeTensors::open(&base.path().join("output/latents/tiny_sd1_00001_.latent"))
                    .expect("SaveLatent wrote the latent")
                    .to_f32("latent_tensor")
                    .expect("f32")
            })
            .collect();
        let d = support::rel_diff(&latents[0], &latents[1]);
        eprintln!("{sampler}: device loop vs host loop, max rel diff {d:e}");
        assert!(latents[0].iter().all(|v| v.is_finite()), "{sampler}");
        assert!(d < 3e-5, "{sampler}: device loop differs by {d}");
    }
}

/// The samplers whose loop runs on the device, on wgpu: DPM++ 2M and
/// Euler ancestral through SamplerCustom (a partial schedule, noise added
/// once), DPM++ 2M on a v-prediction model, Euler on img2img, and Euler
/// ancestral split over two KSamplerAdvanced nodes, LCM on an LCM-read
/// model.
#[test]
fn device_loops_match_comfyui() {
    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("device loops", e);
        return;
    }
    for (graph, prefix) in [
        ("tiny_sd1_custom", "tiny_sd1_custom"),
        ("tiny_sd1_vpred", "tiny_sd1_vpred"),
        ("tiny_sd1_img2img", "tiny_sd1_img2img"),
        ("tiny_sd1_advanced", "tiny_sd1_advanced"),
        ("tiny_sd1_lcm", "tiny_sd1_lcm"),
    ] {
        let (base, fx) = setup();
        run(base.path(), graph, "wgpu");
        check(base.path(), &fx, graph, prefix);
    }
}

/// The workflow with its VAE from VAELoader: a standalone file holding the
/// checkpoint's VAE without the `first_stage_model.` prefix (as VAE files
/// are shipped) decodes to the same image.
#[test]
fn standalone_vae_file_decodes_the_same() {
    let (base, fx) = setup();
    let ckpt = base.path().join("models/checkpoints/tiny_sd1.safetensors");
    let file = SafeTensors::open(&ckpt).expect("checkpoint");
    let mut blobs = Vec::new();
    for t in file.tensors() {
        if let Some(rest) = t.name.strip_prefix("first_stage_model.") {
            blobs.push((
                rest.to_string(),
                t.shape.clone(),
                file.raw(&t.name).expect("raw").to_vec(),
            ));
        }
    }
    let tensors: Vec<TensorData<'_>> = blobs
        .iter()
        .map(|(n, s, b)| (n.as_str(), DType::F16, s.as_slice(), b.as_slice()))
        .collect();
    std::fs::create_dir_all(base.path().join("models/vae")).expect("mkdir");
    write_safetensors(
        &base.path().join("models/vae/tiny_vae.safetensors"),
        &tensors,
        &BTreeMap::new(),
    )
    .expect("writes vae");
    let text = std::fs::read_to_string(root().join("graphs/tiny_sd1_txt2img.json")).expect("graph");
    let mut g: serde_json::Value = serde_json::from_str(&text).expect("json");
    g["20"] = serde_json::json!({"class_type": "VAELoader", "inputs": {"vae_name": "tiny_vae.safetensors"}});
    g["7"]["inputs"]["vae"] = serde_json::json!(["20", 0]);
    let graph = base.path().join("vae_loader.json");
    std::fs::write(&graph, g.to_string()).expect("write graph");
    let o = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args(["run", "-q", "--precision", "f32", "--device", "cpu"])
        .arg(&graph)
        .arg("--base-dir")
        .arg(base.path())
        .output()
        .expect("runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check(base.path(), &fx, "tiny_sd1_txt2img", "tiny_sd1");
}

/// A `.ckpt` copy of the checkpoint (torch.save's zip layout, Lightning's
/// `state_dict` wrapper) and a `.pt` copy of its VAE, read by the
/// restricted pickle reader, give the same image as the safetensors file.
#[test]
fn ckpt_copy_gives_the_same_image() {
    use support::torch_save::{write as torch_save, Obj};
    let (base, fx) = setup();
    let models = base.path().join("models");
    let file = SafeTensors::open(&models.join("checkpoints/tiny_sd1.safetensors")).expect("ckpt");
    let blobs: Vec<(String, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .map(|t| {
            (
                t.name.clone(),
                t.shape.clone(),
                file.raw(&t.name).expect("raw").to_vec(),
            )
        })
        .collect();
    let dict = |prefix: &str| {
        Obj::Dict(
            blobs
                .iter()
                .filter_map(|(n, s, b)| {
                    let name = n.strip_prefix(prefix)?;
                    Some((name, Obj::Tensor(DType::F16, s.as_slice(), b.as_slice())))
                })
                .collect(),
        )
    };
    torch_save(
        &models.join("checkpoints/tiny_sd1_copy.ckpt"),
        &Obj::Dict(vec![
            ("epoch", Obj::Int(6)),
            ("global_step", Obj::Int(470000)),
            ("state_dict", dict("")),
        ]),
    );
    std::fs::create_dir_all(models.join("vae")).expect("mkdir");
    torch_save(&models.join("vae/tiny_vae.pt"), &dict("first_stage_model."));
    std::fs::remove_file(models.join("checkpoints/tiny_sd1.safetensors")).expect("rm");
    let text = std::fs::read_to_string(root().join("graphs/tiny_sd1_txt2img.json")).expect("graph");
    let mut g: serde_json::Value = serde_json::from_str(&text).expect("json");
    g["1"]["inputs"]["ckpt_name"] = serde_json::json!("tiny_sd1_copy.ckpt");
    g["20"] = serde_json::json!({"class_type": "VAELoader", "inputs": {"vae_name": "tiny_vae.pt"}});
    g["7"]["inputs"]["vae"] = serde_json::json!(["20", 0]);
    let graph = base.path().join("ckpt.json");
    std::fs::write(&graph, g.to_string()).expect("write graph");
    let o = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args(["run", "-q", "--precision", "f32", "--device", "cpu"])
        .arg(&graph)
        .arg("--base-dir")
        .arg(base.path())
        .output()
        .expect("runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check(base.path(), &fx, "tiny_sd1_txt2img", "tiny_sd1");
}

/// Bad model files fail the loader with a message naming the file and the
/// problem; nothing panics.
#[test]
fn bad_checkpoints_are_clear_errors() {
    let base = tempfile::tempdir().expect("tempdir");
    let dir = base.path().join("models/checkpoints");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("old.ckpt"), b"PK\x03\x04 pickle inside").expect("write");
    std::fs::write(
        dir.join("cut.safetensors"),
        [200u8, 0, 0, 0, 0, 0, 0, 0, b'{'],
    )
    .expect("write");
    // A valid file that holds an SDXL-shaped UNet key set in miniature.
    let keys: &[(&str, &[usize])] = &[
        (
            "model.diffusion_model.input_blocks.0.0.weight",
            &[320, 4, 3, 3],
        ),
        ("model.diffusion_model.label_emb.0.0.weight", &[1280, 2816]),
    ];
    let blobs: Vec<(String, Vec<usize>, Vec<u8>)> = keys
        .iter()
        .map(|(k, s)| {
            (
                k.to_string(),
                s.to_vec(),
                vec![0u8; s.iter().product::<usize>() * 2],
            )
        })
        .collect();
    let tensors: Vec<TensorData<'_>> = blobs
        .iter()
        .map(|(n, s, b)| (n.as_str(), DType::F16, s.as_slice(), b.as_slice()))
        .collect();
    write_safetensors(&dir.join("partial.safetensors"), &tensors, &BTreeMap::new()).expect("write");
    for (name, expect) in [
        ("old.ckpt", "cannot read this torch checkpoint"),
        ("cut.safetensors", "cut.safetensors"),
        ("partial.safetensors", "partial.safetensors"),
        ("missing.safetensors", "Value not in list"),
    ] {
        let graph = base.path().join("g.json");
        let g = serde_json::json!({
            "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": name}},
            "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "x"}},
            "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
            "4": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["3", 0], "seed": 1, "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
            "5": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0], "filename_prefix": "x"}}
        });
        std::fs::write(&graph, g.to_string()).expect("write graph");
        let o = Command::new(env!("CARGO_BIN_EXE_sdkit"))
            .args(["run", "-q", "--device", "cpu"])
            .arg(&graph)
            .arg("--base-dir")
            .arg(base.path())
            .output()
            .expect("runs");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{name} loaded");
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert!(
            err.contains(expect),
            "{name}: expected {expect:?} in: {err}"
        );
        assert!(err.contains("CheckpointLoaderSimple"), "{name}: {err}");
    }
}

/// The tiny checkpoint's UNet program (`batch`, 8×8 latent) with its
/// weights and inputs bound.
fn tiny_unet_program(
    base: &Path,
    batch: usize,
) -> (
    sdkit_compute::plan::Program,
    sdkit_compute::backend::cpu::Bindings,
) {
    use sdkit_compute::backend::cpu::Bindings;
    use sdkit_compute::plan::plan;
    use sdkit_compute::tensor::GraphBuilder;
    use std::sync::Arc;

    let file = SafeTensors::open(&base.join("models/checkpoints/tiny_sd1.safetensors"))
        .expect("checkpoint");
    let shapes = file
        .tensors()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    let d = sdkit_nodes::models::detect::detect_checkpoint(&shapes).expect("detects");
    let g = GraphBuilder::new();
    let y = (|| {
        let x = g.input("x", &[batch, 4, 8, 8])?;
        let t = g.input("t", &[batch])?;
        let c = g.input("context", &[batch, 77, 64])?;
        sdkit_nodes::models::unet::unet(
            &g,
            d.net.unet().expect("a UNet"),
            d.heads,
            "model.diffusion_model.",
            x,
            t,
            c,
            None,
            None,
        )
    })()
    .expect("unet graph");
    let prog = plan(&g.finish(&[y])).expect("plans");
    let mut bind = Bindings::default();
    for c in &prog.commands {
        if let sdkit_compute::plan::Command::Upload { name, .. } = c {
            bind.weights
                .insert(name.clone(), Arc::new(file.to_f32(name).expect("weight")));
        }
    }
    let wave = |n: usize, f: f32| -> Arc<Vec<f32>> {
        Arc::new((0..n).map(|i| (i as f32 * f).sin()).collect())
    };
    bind.inputs.insert("x".into(), wave(batch * 4 * 64, 0.37));
    bind.inputs.insert("t".into(), Arc::new(vec![981.0; batch]));
    bind.inputs
        .insert("context".into(), wave(batch * 77 * 64, 0.113));
    (prog, bind)
}

/// The tiny UNet on wgpu under a budget below its weights: the same output
/// as without a budget, streaming exactly what the plan says each run; a
/// smaller budget streams more.
#[test]
fn unet_streams_under_a_budget() {
    use sdkit_compute::backend::wgpu::{Options, WgpuBackend};

    let open = match WgpuBackend::new(None) {
        Ok(g) => g,
        Err(e) => {
            sdkit_compute::backend::wgpu::no_adapter("unet under a budget", e);
            return;
        }
    };
    drop(open);
    let (base, _fx) = setup();
    let (prog, bind) = tiny_unet_program(base.path(), 2);
    let full = WgpuBackend::new(None).expect("adapter");
    let want = full.run(&prog, &bind).expect("runs")[0].data.clone();
    let weight_bytes = full.bytes_uploaded();
    let act = full.activation_bytes(&prog);
    let mut last_streamed = 0;
    for frac in [2u64, 4] {
        let budget = act + weight_bytes / frac;
        let gpu = WgpuBackend::with_options(&Options {
            budget: Some(budget),
            ..Options::default()
        })
        .expect("adapter");
        let p = gpu
            .prepare(&prog, &bind)
            .expect("prepares under the budget");
        let plan = p.residency().expect("a plan").clone();
        assert!(plan.device_bytes <= budget);
        assert!(
            plan.streamed_bytes_per_run > 0,
            "1/{frac} of the weights cannot all stay"
        );
        assert!(
            plan.streamed_bytes_per_run >= last_streamed,
            "a smaller budget streamed less"
        );
        last_streamed = plan.streamed_bytes_per_run;
        let after_prepare = gpu.bytes_uploaded();
        assert_eq!(after_prepare, plan.resident_bytes);
        for run in 1..=2u64 {
            let got = p.run(&bind).expect("runs")[0].data.clone();
            assert_eq!(
                got, want,
                "streamed run {run} differs from the resident run"
            );
            assert_eq!(
                gpu.bytes_uploaded() - after_prepare,
                run * plan.streamed_bytes_per_run,
                "bytes moved differ from the plan"
            );
        }
        eprintln!(
            "budget {budget}: resident {} + stream arena {} of {weight_bytes} weight bytes, \
             {} streamed per run (lower bound {})",
            plan.resident_bytes,
            plan.stream_arena_bytes,
            plan.streamed_bytes_per_run,
            plan.lower_bound_per_run
        );
    }
}

/// A device with less memory than the use needs and no budget set: the
/// runtime catches the out-of-memory error, frees kept weights and
/// re-plans under half, streaming, with the same output.
#[test]
fn out_of_memory_replans_and_streams() {
    use sdkit_compute::backend::wgpu::{Options, WgpuBackend};
    use sdkit_engine::Runtime;

    let full = match WgpuBackend::new(None) {
        Ok(g) => g,
        Err(e) => {
            sdkit_compute::backend::wgpu::no_adapter("out-of-memory replanning", e);
            return;
        }
    };
    let (base, _fx) = setup();
    let (prog, bind) = tiny_unet_program(base.path(), 2);
    let want = full.run(&prog, &bind).expect("runs")[0].data.clone();
    let whole = full.activation_bytes(&prog) + full.bytes_uploaded();
    drop(full);
    let memory = whole * 3 / 4;
    let small = WgpuBackend::with_options(&Options {
        device_memory: Some(memory),
        ..Options::default()
    })
    .expect("adapter");
    let runtime = Runtime::wgpu(small);
    let mut session = runtime.prepare(&prog, &bind).expect("re-plans");
    assert_eq!(session.replans(), 1);
    let budget = session.budget().expect("a budget after the re-plan");
    assert!(budget <= memory, "{budget} > {memory}");
    let plan = session.residency().expect("a plan").clone();
    assert!(plan.streamed_bytes_per_run > 0);
    let got = session.run(bind.inputs.clone()).expect("runs")[0]
        .data
        .clone();
    assert_eq!(got, want, "the re-planned run differs");
}

/// Two programs of one model prepared side by side (a sampler's
/// conditioning groups) under a budget below the model: the first leaves
/// room for the second's activations and stream arena, the second keeps
/// the weights the first holds resident, together they stay within the
/// budget, and both give the unlimited outputs.
#[test]
fn programs_prepared_side_by_side_share_the_budget() {
    use sdkit_compute::backend::wgpu::{Options, WgpuBackend};
    use sdkit_engine::Runtime;

    let full = match WgpuBackend::new(None) {
        Ok(g) => g,
        Err(e) => {
            sdkit_compute::backend::wgpu::no_adapter("shared budget", e);
            return;
        }
    };
    let (base, _fx) = setup();
    let (p2, bind2) = tiny_unet_program(base.path(), 2);
    let (p4, bind4) = tiny_unet_program(base.path(), 4);
    let want2 = full.run(&p2, &bind2).expect("runs")[0].data.clone();
    let want4 = full.run(&p4, &bind4).expect("runs")[0].data.clone();
    let weights = full.weight_bytes(&p2);
    let (act2, act4) = (full.activation_bytes(&p2), full.activation_bytes(&p4));
    drop(full);
    let budget = act2 + act4 + weights * 3 / 4;
    let runtime = Runtime::wgpu(
        WgpuBackend::with_options(&Options {
            budget: Some(budget),
            ..Options::default()
        })
        .expect("adapter"),
    );
    let progs = [p2, p4];
    let mut sessions = runtime.prepare_many(&progs, &bind2).expect("prepares both");
    let first = sessions[0].residency().expect("plan").clone();
    let second = sessions[1].use_step().expect("step").clone();
    let plan = second.plan.as_ref().expect("plan");
    assert!(first.streamed_bytes_per_run > 0 && plan.streamed_bytes_per_run > 0);
    // The first's resident weights stay resident for the second.
    assert!(plan.resident_bytes >= first.resident_bytes);
    let live_first = first.device_bytes - first.resident_bytes;
    assert!(
        live_first + second.device_bytes <= budget,
        "{live_first} + {} > {budget}",
        second.device_bytes
    );
    let got2 = sessions[0].run(bind2.inputs.clone()).expect("runs")[0]
        .data
        .clone();
    let got4 = sessions[1].run(bind4.inputs.clone()).expect("runs")[0]
        .data
        .clone();
    assert_eq!(got2, want2);
    assert_eq!(got4, want4);
}

/// Across runs in one process (watch, server): a prompt edit re-runs the
/// text encoder and the sampler but uploads no UNet weights again.
#[test]
fn prompt_edit_uploads_no_unet_weights() {
    let (base, _fx) = setup();
    let text = std::fs::read_to_string(root().join("graphs/tiny_sd1_txt2img.json")).expect("graph");
    let variants: Vec<serde_json::Value> = ["a lighthouse", "a lighthouse at night"]
        .iter()
        .map(|prompt| {
            let mut wf: serde_json::Value = serde_json::from_str(&text).expect("json");
            wf["3"]["inputs"]["text"] = serde_json::json!(prompt);
            wf
        })
        .collect();
    let Some(uploads) =
        support::residency_uploads(base.path(), &variants, "6", "prompt edit residency")
    else {
        return;
    };
    assert_eq!(uploads.len(), 2, "one residency event per KSampler run");
    assert!(uploads[0] > 0, "the first run uploads the UNet");
    assert_eq!(uploads[1], 0, "the edited run uploaded UNet weights again");
}

/// Hires fix with a second prompt, as one workflow on wgpu under a budget
/// that holds the largest model use but not every model at once: the
/// executor's use schedule lists the uses in the order they run, each use
/// uploads exactly what its plan says and stays within the budget,
/// evictions make room, the second sampler finds the UNet still resident,
/// and the images equal those of an unlimited run.
#[test]
fn hires_workflow_plans_residency_across_models() {
    use sdkit_engine::{CancelToken, Event, EventSink, Executor, Paths, RunOptions, Runtime};
    use std::sync::{Arc, Mutex};

    if let Err(e) = sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        sdkit_compute::backend::wgpu::no_adapter("hires workflow residency", e);
        return;
    }
    let (base, _fx) = setup();
    let lib = Arc::new(sdkit_nodes::library());
    let paths = Paths::under(base.path());
    let text = std::fs::read_to_string(root().join("graphs/tiny_sd1_hires.json")).expect("graph");
    let wf = sdkit_schema::workflow::load(&text, &lib.registry).expect("loads");
    let graph = sdkit_engine::validate(&wf, &lib.registry, &paths).expect("valid");
    let rt = tokio::runtime::Runtime::new().expect("tokio");
    let run = |budget: u64| -> (Vec<Event>, Vec<Vec<u8>>) {
        let runtime = Runtime::select_precision("wgpu", Some(budget), false).expect("adapter");
        let exec = Executor::new(lib.clone(), Arc::new(paths.clone())).with_runtime(runtime);
        let events: Arc<Mutex<Vec<Event>>> = Arc::default();
        let sink = events.clone();
        let events_sink: EventSink = Arc::new(move |e: &Event| {
            if matches!(
                e,
                Event::Residency { .. } | Event::Schedule { .. } | Event::Executing { .. }
            ) {
                sink.lock().expect("lock").push(e.clone());
            }
        });
        rt.block_on(exec.run(&graph, RunOptions::new(events_sink, CancelToken::new())))
            .expect("runs");
        let images = ["hires_base", "hires"]
            .iter()
            .map(|p| {
                let path = base.path().join(format!("output/{p}_00001_.png"));
                let bytes = std::fs::read(&path).expect("image");
                std::fs::remove_file(&path).expect("remove");
                bytes
            })
            .collect();
        let events = events.lock().expect("lock").clone();
        (events, images)
    };
    // Each use's residency event, in order.
    #[derive(Clone, Debug)]
    struct Use {
        node: String,
        weights: u64,
        activations: u64,
        loaded: u64,
        streamed: u64,
        runs: u64,
        uploaded: u64,
        evicted: u64,
        device: u64,
    }
    let residency = |events: &[Event]| -> Vec<Use> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Residency {
                    node,
                    weight_bytes,
                    activation_bytes,
                    loaded_bytes,
                    streamed_bytes_per_run,
                    runs,
                    uploaded_bytes,
                    evicted_bytes,
                    device_bytes,
                    ..
                } => Some(Use {
                    node: node.clone(),
                    weights: *weight_bytes,
                    activations: *activation_bytes,
                    loaded: *loaded_bytes,
                    streamed: *streamed_bytes_per_run,
                    runs: *runs,
                    uploaded: *uploaded_bytes,
                    evicted: *evicted_bytes,
                    device: *device_bytes,
                }),
                _ => None,
            })
            .collect()
    };
    // Unlimited (a budget far above the models): every use's size.
    let (free, want) = run(1 << 40);
    let sizes = residency(&free);
    let use_of = |node: &str| {
        sizes
            .iter()
            .find(|s| s.node == node)
            .unwrap_or_else(|| panic!("no residency event for node {node}"))
            .clone()
    };
    // Room for the VAE encoder's use (its 96² activations are the largest)
    // beside the UNet, but not beside the CLIP and the VAE decoder too.
    let (encode, unet, clip, decode) = (use_of("10"), use_of("6"), use_of("3"), use_of("7"));
    let slack = 64 << 10;
    assert!(slack < clip.weights + decode.weights);
    let belady = encode.weights + encode.activations + unet.weights + slack;
    let largest = sizes
        .iter()
        .map(|s| s.weights + s.activations)
        .max()
        .expect("uses");
    for budget in [belady, largest + 1024] {
        let (events, got) = run(budget);
        assert_eq!(
            got, want,
            "budget {budget}: images differ from the unlimited run"
        );
        let schedule: Vec<String> = events
            .iter()
            .find_map(|e| match e {
                Event::Schedule { uses, .. } => Some(uses.iter().map(|u| u.node.clone()).collect()),
                _ => None,
            })
            .expect("a schedule event");
        let uses = residency(&events);
        let order: Vec<String> = uses.iter().map(|u| u.node.clone()).collect();
        assert_eq!(order, schedule, "uses ran out of schedule order");
        for u in &uses {
            eprintln!("budget {budget}: {u:?}");
            assert!(
                u.device <= budget,
                "node {}: {} > {budget}",
                u.node,
                u.device
            );
            assert_eq!(
                u.uploaded,
                u.loaded + u.streamed * u.runs,
                "node {}: bytes moved differ from the plan",
                u.node
            );
        }
        let by_node = |n: &str| uses.iter().find(|u| u.node == n).expect("use").clone();
        if budget == belady {
            // At the encoder the CLIP (never used again) and the decoder
            // (used after the second sampler) make room; the UNet stays.
            assert!(by_node("10").evicted > 0, "the encoder evicted nothing");
            assert_eq!(
                by_node("12").uploaded,
                0,
                "the second sampler uploaded UNet weights"
            );
        }
    }
}

/// Every sampler name ComfyUI lists runs an SD1 workflow through KSampler
/// (5 steps) and gives a finite latent.
#[test]
fn every_sampler_runs_an_sd1_workflow() {
    let (base, _fx) = setup();
    // The KSampler spec's list: ComfyUI's SAMPLER_NAMES.
    let names = sdkit_nodes::specs::SAMPLERS;
    assert!(names.len() >= 40, "{names:?}");
    for (k, name) in names.iter().enumerate() {
        let o = Command::new(env!("CARGO_BIN_EXE_sdkit"))
            .args(["run", "-q", "--device", "cpu", "--set"])
            .arg(format!("6.sampler_name={name}"))
            .arg(root().join("graphs/tiny_sd1_ancestral.json"))
            .arg("--base-dir")
            .arg(base.path())
            .output()
            .expect("runs");
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let path = base
            .path()
            .join(format!("output/latents/tiny_sd1_{:05}_.latent", k + 1));
        let latent = SafeTensors::open(&path)
            .and_then(|f| f.to_f32("latent_tensor"))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            latent.iter().all(|v| v.is_finite()),
            "{name}: non-finite latent"
        );
    }
}

/// `sdkit serve` on the tiny checkpoint: each sampler step reaches the
/// queuing WebSocket client as a binary preview frame, with metadata (type
/// 4) for a client that announced `supports_preview_metadata`, else type 1,
/// as ComfyUI sends them.
#[test]
fn server_sends_sampler_previews() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpStream;
    let (base, _) = setup();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args([
            "serve",
            "--port",
            "0",
            "--device",
            "cpu",
            "--precision",
            "f32",
            "--base-dir",
        ])
        .arg(base.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("line");
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .expect("addr")
        .to_string();
    let graph: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("graphs/tiny_sd1_txt2img.json")).expect("graph"),
    )
    .expect("json");
    let queue = |client: &str, seed: u64| {
        let mut prompt = graph.clone();
        prompt["6"]["inputs"]["seed"] = serde_json::json!(seed);
        let body = serde_json::json!({"prompt": prompt, "client_id": client}).to_string();
        let mut s = TcpStream::connect(&addr).expect("connect");
        write!(
            s,
            "POST /prompt HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .expect("send");
        let mut reply = String::new();
        s.read_to_string(&mut reply).expect("reply");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    };
    let connect = |client: &str| {
        let stream = TcpStream::connect(&addr).expect("connect");
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(120)))
            .ok();
        let url = format!("ws://{addr}/ws?clientId={client}");
        tungstenite::client(url.as_str(), stream)
            .expect("handshake")
            .0
    };
    // Binary frames until the run ends (`executing` with a null node).
    let frames_until_done = |ws: &mut tungstenite::WebSocket<TcpStream>| {
        let mut frames = Vec::new();
        loop {
            match ws.read().expect("message") {
                tungstenite::Message::Binary(b) => frames.push(b.to_vec()),
                tungstenite::Message::Text(t) => {
                    let m: serde_json::Value = serde_json::from_str(t.as_str()).expect("json");
                    assert_ne!(m["type"], "execution_error", "{m}");
                    if m["type"] == "executing" && m["data"]["node"].is_null() {
                        return frames;
                    }
                }
                _ => {}
            }
        }
    };
    let u32_at = |b: &[u8], i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let steps = graph["6"]["inputs"]["steps"].as_u64().expect("steps") as usize;

    let mut meta_client = connect("with-metadata");
    meta_client
        .send(tungstenite::Message::Text(
            r#"{"type":"feature_flags","data":{"supports_preview_metadata":true}}"#.into(),
        ))
        .expect("flags");
    // The server's own flags come back once ours are recorded.
    loop {
        if let tungstenite::Message::Text(t) = meta_client.read().expect("message") {
            if t.as_str().contains("\"feature_flags\"") {
                assert!(t.as_str().contains("\"supports_preview_metadata\":true"));
                break;
            }
        }
    }
    queue("with-metadata", 1);
    let frames = frames_until_done(&mut meta_client);
    assert_eq!(frames.len(), steps, "one preview per step");
    for f in &frames {
        assert_eq!(u32_at(f, 0), 4);
        let len = u32_at(f, 4) as usize;
        let meta: serde_json::Value = serde_json::from_slice(&f[8..8 + len]).expect("metadata");
        assert_eq!(meta["node_id"], "6");
        assert_eq!(meta["image_type"], "image/jpeg");
        assert!(meta["prompt_id"].is_string());
        let img = image::load_from_memory(&f[8 + len..]).expect("jpeg");
        // An 8×8 latent, scaled to fit 512² as ComfyUI's --preview-size.
        assert_eq!((img.width(), img.height()), (512, 512));
    }

    let mut plain_client = connect("plain");
    // A new seed: the sampler runs again (an identical prompt is cached).
    queue("plain", 2);
    let frames = frames_until_done(&mut plain_client);
    assert_eq!(frames.len(), steps);
    for f in &frames {
        assert_eq!((u32_at(f, 0), u32_at(f, 4)), (1, 1), "type 1, JPEG");
        image::load_from_memory(&f[8..]).expect("jpeg");
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A checkpoint whose UNet output weights are NaN still runs to an image
/// (as in ComfyUI), but the run says the sampler's output is not finite.
#[test]
fn non_finite_model_output_is_reported() {
    let fx = fixture();
    let base = tempfile::tempdir().expect("tempdir");
    write_checkpoint_with_nan(base.path(), &fx, Some("model.diffusion_model.out.2.weight"));
    let o = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args(["run", "-q", "--device", "cpu"])
        .arg(root().join("graphs/tiny_sd1_txt2img.json"))
        .arg("--base-dir")
        .arg(base.path())
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("NaN or infinite"), "{err}");
}
