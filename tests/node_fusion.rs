//! Cross-node fusion on a GPU: the image nodes after VAEDecode (invert,
//! blur, bilinear scale, sharpen, crop, repeat, from batch) join the
//! decoder's program, so the image is read
//! back once, in its final form, and the images are those of the same
//! nodes run one by one on the host. Where a chain cannot be taken (the
//! decoded image read twice, a mode with no tensor form) the nodes run as
//! before. On lavapipe in CI (`SDKIT_REQUIRE_WGPU`).

mod support;

use sdkit_engine::{CancelToken, Event, EventSink, Executor, Paths, RunOptions, Runtime};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Runs the tiny SD1 txt2img graph with `edit` applied on wgpu; returns
/// the base folder, the bytes read back from the device and the nodes
/// announced as executing. None where there is no adapter (and none is
/// required).
fn run(
    edit: impl Fn(&mut serde_json::Value),
    fuse: bool,
) -> Option<(tempfile::TempDir, u64, BTreeSet<String>)> {
    let (base, bytes, executing, report) = try_run(edit, fuse)?;
    let executed: BTreeSet<String> = report.expect("runs").executed.into_iter().collect();
    assert_eq!(executed, executing, "executed vs announced");
    Some((base, bytes, executing))
}

type Ran = (
    tempfile::TempDir,
    u64,
    BTreeSet<String>,
    Result<sdkit_engine::RunReport, sdkit_engine::RunError>,
);

/// [`run`], returning the run's result instead of expecting success.
fn try_run(edit: impl Fn(&mut serde_json::Value), fuse: bool) -> Option<Ran> {
    use sdkit_compute::backend::wgpu::WgpuBackend;
    let gpu = match WgpuBackend::new(None) {
        Ok(g) => g,
        Err(e) => {
            sdkit_compute::backend::wgpu::no_adapter("node fusion", e);
            return None;
        }
    };
    let fx = support::fixture("sd1/expected.json");
    let base = tempfile::tempdir().expect("tempdir");
    let ckpt = base
        .path()
        .join("models/checkpoints")
        .join(fx["checkpoint"].as_str().expect("name"));
    let sum = fx["checksum_f16"].as_str().expect("checksum");
    support::write_tensors(&ckpt, &fx["keys"], None, sum, None);
    let text = std::fs::read_to_string(support::root().join("graphs/tiny_sd1_txt2img.json"))
        .expect("graph");
    let mut graph: serde_json::Value = serde_json::from_str(&text).expect("json");
    edit(&mut graph);

    let lib = Arc::new(sdkit_nodes::library());
    let paths = Paths::under(base.path());
    let runtime = Runtime::wgpu(gpu);
    let exec = Executor::new(lib.clone(), Arc::new(paths.clone()))
        .with_runtime(runtime.clone())
        .with_node_fusion(fuse);
    let wf = sdkit_schema::workflow::load(&graph.to_string(), &lib.registry).expect("loads");
    let graph = sdkit_engine::validate(&wf, &lib.registry, &paths).expect("valid");
    let seen = Arc::new(Mutex::new(BTreeSet::new()));
    let into = seen.clone();
    let events: EventSink = Arc::new(move |e: &Event| {
        if let Event::Executing { node: Some(n), .. } = e {
            into.lock().expect("lock").insert(n.clone());
        }
    });
    let rt = tokio::runtime::Runtime::new().expect("tokio");
    let report = rt.block_on(exec.run(&graph, RunOptions::new(events, CancelToken::new())));
    let executing = seen.lock().expect("lock").clone();
    Some((base, runtime.bytes_downloaded(), executing, report))
}

/// The pixels of the PNG `name` under output/.
fn pixels(base: &Path, name: &str) -> Vec<u8> {
    image::open(base.join("output").join(name))
        .expect("png")
        .to_rgb8()
        .into_raw()
}

/// VAEDecode → ImageInvert → ImageBlur (radius 3) → ImageScaleBy
/// (bilinear 0.75) → ImageSharpen (radius 2) → ImageCrop →
/// RepeatImageBatch (2: a, b, a, b) → ImageFromBatch (from 1, 2: b, a)
/// → SaveImage.
fn chain(g: &mut serde_json::Value) {
    g["20"] = serde_json::json!({"class_type": "ImageInvert", "inputs": {"image": ["7", 0]}});
    g["24"] = serde_json::json!({"class_type": "ImageBlur",
        "inputs": {"image": ["20", 0], "blur_radius": 3, "sigma": 1.5}});
    g["21"] = serde_json::json!({"class_type": "ImageScaleBy",
        "inputs": {"image": ["24", 0], "upscale_method": "bilinear", "scale_by": 0.75}});
    g["25"] = serde_json::json!({"class_type": "ImageSharpen",
        "inputs": {"image": ["21", 0], "sharpen_radius": 2, "sigma": 1.0, "alpha": 0.8}});
    g["22"] = serde_json::json!({"class_type": "ImageCrop",
        "inputs": {"image": ["25", 0], "width": 40, "height": 32, "x": 4, "y": 2}});
    g["26"] = serde_json::json!({"class_type": "RepeatImageBatch",
        "inputs": {"image": ["22", 0], "amount": 2}});
    g["27"] = serde_json::json!({"class_type": "ImageFromBatch",
        "inputs": {"image": ["26", 0], "batch_index": 1, "length": 2}});
    g["8"]["inputs"]["images"] = serde_json::json!(["27", 0]);
}

#[test]
fn image_chain_after_vae_decode_runs_in_its_program() {
    let Some((fused, fused_bytes, nodes)) = run(chain, true) else {
        return;
    };
    let Some((host, host_bytes, host_nodes)) = run(chain, false) else {
        return;
    };
    assert_eq!(nodes, host_nodes, "the same nodes announced");
    for n in ["7", "20", "24", "21", "25", "22", "26", "27", "8"] {
        assert!(nodes.contains(n), "node {n} not announced: {nodes:?}");
    }
    // Batch 2: the host path reads the decoded 64×64 image; the fused one
    // only the final 40×32 crops (two: the batch reordered).
    let (decoded, last) = (2 * 64 * 64 * 3 * 4, 2 * 32 * 40 * 3 * 4);
    assert_eq!(
        host_bytes - fused_bytes,
        decoded - last,
        "bytes read back, host {host_bytes} vs fused {fused_bytes}"
    );
    for i in 1..=2 {
        let name = format!("tiny_sd1_{i:05}_.png");
        let (a, b) = (pixels(fused.path(), &name), pixels(host.path(), &name));
        assert_eq!(a.len(), 32 * 40 * 3);
        let worst = a.iter().zip(&b).map(|(x, y)| x.abs_diff(*y)).max();
        assert!(worst <= Some(1), "{name}: pixels differ by {worst:?}");
    }
    // The images come out as the second decoded image, then the first.
    let (first, second) = (
        pixels(fused.path(), "tiny_sd1_00001_.png"),
        pixels(fused.path(), "tiny_sd1_00002_.png"),
    );
    assert_ne!(first, second, "the two seeds' images");
}

#[test]
fn chains_that_cannot_fuse_run_node_by_node() {
    // The decoded image saved and inverted: read twice, so read back.
    let twice = |g: &mut serde_json::Value| {
        g["20"] = serde_json::json!({"class_type": "ImageInvert", "inputs": {"image": ["7", 0]}});
        g["23"] = serde_json::json!({"class_type": "SaveImage",
            "inputs": {"images": ["20", 0], "filename_prefix": "inverted"}});
    };
    // Lanczos has no tensor form.
    let lanczos = |g: &mut serde_json::Value| {
        g["21"] = serde_json::json!({"class_type": "ImageScaleBy",
            "inputs": {"image": ["7", 0], "upscale_method": "lanczos", "scale_by": 0.5}});
        g["8"]["inputs"]["images"] = serde_json::json!(["21", 0]);
    };
    for edit in [&twice as &dyn Fn(&mut serde_json::Value), &lanczos] {
        let Some((fused, fused_bytes, _)) = run(edit, true) else {
            return;
        };
        let Some((host, host_bytes, _)) = run(edit, false) else {
            return;
        };
        assert_eq!(fused_bytes, host_bytes);
        let name = "tiny_sd1_00001_.png";
        assert_eq!(pixels(fused.path(), name), pixels(host.path(), name));
    }
}

/// A stage that does not apply to the image it gets (a center crop that
/// leaves nothing) makes VAEDecode decline the chain; the nodes then run
/// one by one and the error names the scaling node, as without fusion.
#[test]
fn a_declined_chain_reports_the_failing_node() {
    let tiny = |g: &mut serde_json::Value| {
        g["21"] = serde_json::json!({"class_type": "ImageScale",
            "inputs": {"image": ["7", 0], "upscale_method": "bilinear",
                "width": 1, "height": 200, "crop": "center"}});
        g["8"]["inputs"]["images"] = serde_json::json!(["21", 0]);
    };
    for fuse in [true, false] {
        let Some((_, _, executing, report)) = try_run(tiny, fuse) else {
            return;
        };
        match report {
            Err(sdkit_engine::RunError::Node {
                node_id, message, ..
            }) => {
                assert_eq!(node_id, "21", "{message}");
                assert!(message.contains("leaves nothing"), "{message}");
            }
            other => panic!(
                "expected node 21's error, got {:?}",
                other.map(|r| r.executed)
            ),
        }
        assert!(executing.contains("7"), "{executing:?}");
    }
}
