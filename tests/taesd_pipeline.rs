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

/// Sampler previews as ComfyUI's previewers make them for each step of
/// graphs/tiny_sd1_txt2img.json: TAESD (the family's decoder in
/// models/vae_approx) and latent2rgb, compared as 8-bit images.
#[test]
fn sampler_previews_match_comfyui() {
    use sdkit_engine::event::{PreviewImage, PreviewMethod};
    use sdkit_engine::{CancelToken, Event, EventSink, Executor, Paths, RunOptions};
    use std::sync::{Arc, Mutex};

    let fx = support::fixture("taesd/expected.json");
    let want = &fx["previews"]["tiny_sd1_txt2img"];
    let base = tempfile::tempdir().expect("tempdir");
    let models = base.path().join("models");
    write_base_checkpoints(&models);
    for f in fx["files"].as_array().expect("files") {
        let folder = f["folder"].as_str().expect("folder");
        support::write_fixture_files(&models.join(folder), &serde_json::json!([f]));
    }
    let lib = Arc::new(sdkit_nodes::library());
    let paths = Paths::under(base.path());
    let text = std::fs::read_to_string(support::root().join("graphs/tiny_sd1_txt2img.json"))
        .expect("graph");
    let wf = sdkit_schema::workflow::load(&text, &lib.registry).expect("loads");
    let graph = sdkit_engine::validate(&wf, &lib.registry, &paths).expect("valid");
    let rt = tokio::runtime::Runtime::new().expect("tokio");
    let node = want["node"].to_string().trim_matches('"').to_string();
    for (method, key) in [
        (PreviewMethod::Taesd, "taesd"),
        (PreviewMethod::Latent2Rgb, "latent2rgb"),
    ] {
        let seen: Arc<Mutex<Vec<PreviewImage>>> = Arc::default();
        let sink = seen.clone();
        let node = node.clone();
        let events: EventSink = Arc::new(move |e: &Event| {
            if let Event::Preview { node: n, image, .. } = e {
                if *n == node {
                    sink.lock().expect("lock").push(image.clone());
                }
            }
        });
        let mut opts = RunOptions::new(events, CancelToken::new());
        opts.preview = method;
        // A fresh executor per method: the first run's cache would skip
        // the sampler.
        let exec = Executor::new(lib.clone(), Arc::new(paths.clone()));
        rt.block_on(exec.run(&graph, opts)).expect("runs");
        let got = seen.lock().expect("lock").clone();
        let frames = want[key]["frames"].as_array().expect("frames");
        assert_eq!(got.len(), frames.len(), "{key}: one preview per step");
        for (g, f) in got.iter().zip(frames) {
            let w = f["width"].as_u64().expect("width") as u32;
            let h = f["height"].as_u64().expect("height") as u32;
            assert_eq!((g.width, g.height), (w, h), "{key}");
            let bytes = support::b64(f["u8"].as_str().expect("u8"));
            assert_eq!(bytes.len(), g.rgb.len());
            let off = bytes
                .iter()
                .zip(g.rgb.iter())
                .filter(|(a, b)| a.abs_diff(**b) > 0)
                .count();
            let worst = bytes
                .iter()
                .zip(g.rgb.iter())
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap_or(0);
            eprintln!(
                "{key} step {}: {off} of {} values differ, worst {worst}",
                f["step"],
                bytes.len()
            );
            assert!(
                worst <= 1 && off * 100 <= bytes.len(),
                "{key}: {off} differ, worst {worst}"
            );
            // The server's resize (ImageOps.contain, BILINEAR) of the
            // reference frame, where the fixture keeps rows of it.
            if let Some(rows) = f.get("preview_rows") {
                use sdkit_nodes::imageops::{pil_contain_size, pil_resize_rgb, PilFilter};
                let (pw, ph) = pil_contain_size(w as usize, h as usize, 512);
                assert_eq!(
                    (pw as u64, ph as u64),
                    (
                        f["preview_width"].as_u64().expect("w"),
                        f["preview_height"].as_u64().expect("h")
                    )
                );
                let big =
                    pil_resize_rgb(&bytes, w as usize, h as usize, pw, ph, PilFilter::Bilinear);
                let want = support::b64(rows["u8"].as_str().expect("u8"));
                let got: Vec<u8> = rows["rows"]
                    .as_array()
                    .expect("rows")
                    .iter()
                    .flat_map(|r| {
                        let y = r.as_u64().expect("row") as usize;
                        big[y * pw * 3..(y + 1) * pw * 3].to_vec()
                    })
                    .collect();
                assert_eq!(got, want, "{key}: the preview resize differs from Pillow's");
            }
        }
    }
}
