//! What the end-to-end model tests share: the reference scripts' weight
//! formula (tools/reference/sd1_pipeline.py `values`), bit for bit; writing
//! tiny checkpoints from a fixture's key list; running `sdkit run`; and
//! comparing SaveLatent/SaveImage outputs with ComfyUI's.
#![allow(dead_code)]

pub mod cluster;
pub mod http;
pub mod torch_save;

use sdkit_compute::backend::wgpu::f32_to_f16_bits;
use sdkit_compute::weights::{write_safetensors, DType, SafeTensors, TensorData};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fixture under tests/reference.
pub fn fixture(rel: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(root().join("tests/reference").join(rel)).expect("fixture");
    serde_json::from_str(&text).expect("fixture json")
}

fn fnv1a(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The reference script's weight formula, bit for bit.
pub fn values(name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let seed = fnv1a(name);
    let scale = if name.ends_with("bias") || shape.len() == 1 {
        0.0
    } else {
        (1.0 / ((n / shape[0]) as f64).sqrt()) as f32
    };
    (0..n as u64)
        .map(|i| {
            let mut z = seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if name.ends_with("bias") {
                0.05 * u
            } else if shape.len() == 1 {
                1.0 + 0.1 * u
            } else {
                u * scale
            }
        })
        .collect()
}

fn checksum(bits: &[u16], index: usize) -> u64 {
    let s = bits.iter().enumerate().fold(0u64, |acc, (i, &b)| {
        acc.wrapping_add(u64::from(b).wrapping_mul((i as u64 % 65521) + 1))
    });
    s.wrapping_mul(index as u64 + 1)
}

/// Writes `path` (f16) with the tensors of `keys` (`[[name, shape], ...]`)
/// from the formula, `scaled` ones multiplied by their factor first, the
/// one named `nan` (if any) all NaN; checks the weights are the
/// reference's by `checksum` (computed before the NaN).
pub fn write_tensors(
    path: &Path,
    keys: &serde_json::Value,
    scaled: Option<&serde_json::Value>,
    checksum_f16: &str,
    nan: Option<&str>,
) {
    write_tensors_with(path, keys, scaled, None, checksum_f16, nan);
}

/// [`write_tensors`] where `fixed` gives some tensors' one value (0-dim
/// tensors such as a LoRA's `.alpha`).
pub fn write_tensors_with(
    path: &Path,
    keys: &serde_json::Value,
    scaled: Option<&serde_json::Value>,
    fixed: Option<&serde_json::Value>,
    checksum_f16: &str,
    nan: Option<&str>,
) {
    let keys = keys.as_array().expect("keys");
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut total = 0u64;
    for (i, k) in keys.iter().enumerate() {
        let name = k[0].as_str().expect("name").to_string();
        let shape: Vec<usize> = k[1]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_u64().expect("dim") as usize)
            .collect();
        let factor = scaled
            .and_then(|s| s.get(&name))
            .and_then(serde_json::Value::as_f64);
        let given = fixed
            .and_then(|f| f.get(&name))
            .and_then(serde_json::Value::as_f64);
        let raw = match given {
            Some(v) => vec![v as f32],
            None => values(&name, &shape),
        };
        let bits: Vec<u16> = raw
            .into_iter()
            .map(|v| match factor {
                Some(f) => v * f as f32,
                None => v,
            })
            .map(f32_to_f16_bits)
            .collect();
        total = total.wrapping_add(checksum(&bits, i));
        let bits = if nan == Some(name.as_str()) {
            vec![0x7e00u16; bits.len()]
        } else {
            bits
        };
        let bytes = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        blobs.push((name, shape, bytes));
    }
    assert_eq!(
        total.to_string(),
        checksum_f16,
        "{}: the weight formula differs from the reference script's",
        path.display()
    );
    let tensors: Vec<TensorData<'_>> = blobs
        .iter()
        .map(|(n, s, b)| (n.as_str(), DType::F16, s.as_slice(), b.as_slice()))
        .collect();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("mkdir");
    }
    write_safetensors(path, &tensors, &BTreeMap::new()).expect("writes tensors");
}

/// Writes the fixture file `f` (an entry of an expected.json `files`
/// list) under `models`: f16 as [`write_tensors_with`]; with `"dtype":
/// "F8_E4M3"` every 2-D tensor cast from its f16 value to float8_e4m3fn
/// (round to nearest even, as torch) and the rest f16; with
/// `"F8_E4M3_SCALED"` ComfyUI's scaled-fp8 layout
/// (tools/reference/scaled_fp8.py): each Linear weight (2-D, not an
/// embedding) divided by its scale `max|w| / 448` (f32) before the cast,
/// the scale beside it as `<layer>.scale_weight`, and a `scaled_fp8`
/// marker. Checked by `checksum_raw` over the stored bytes (one unit per
/// byte), then the scales' bytes.
pub fn write_fixture_entry(models: &Path, f: &serde_json::Value) {
    use sdkit_compute::weights::{f16_to_f32, f8_e4m3_to_f32, round_f8_e4m3};
    let path = models
        .join(f["folder"].as_str().expect("folder"))
        .join(f["name"].as_str().expect("name"));
    let dtype = f.get("dtype").and_then(serde_json::Value::as_str);
    let scaled = match dtype {
        Some("F8_E4M3") => false,
        Some("F8_E4M3_SCALED") => true,
        _ => {
            write_tensors_with(
                &path,
                &f["keys"],
                f.get("scaled"),
                f.get("alphas"),
                f["checksum_f16"].as_str().expect("checksum"),
                None,
            );
            return;
        }
    };
    // Every e4m3 code by its value, to encode the rounded values.
    let codes: std::collections::HashMap<u32, u8> = (0..=255u8)
        .filter(|&b| !f8_e4m3_to_f32(b).is_nan())
        .map(|b| (f8_e4m3_to_f32(b).to_bits(), b))
        .collect();
    let fp8 = |v: f32| -> u8 {
        let r = round_f8_e4m3(v);
        // −0 and +0 share a value but not a code.
        if r == 0.0 {
            if r.is_sign_negative() {
                0x80
            } else {
                0
            }
        } else {
            codes[&r.to_bits()]
        }
    };
    let mut blobs: Vec<(String, Vec<usize>, DType, Vec<u8>)> = Vec::new();
    let mut scales: Vec<(String, f32)> = Vec::new();
    let mut total = 0u64;
    let keys = f["keys"].as_array().expect("keys");
    for (i, k) in keys.iter().enumerate() {
        let name = k[0].as_str().expect("name").to_string();
        let shape: Vec<usize> = k[1]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_u64().expect("dim") as usize)
            .collect();
        let half: Vec<f32> = values(&name, &shape)
            .into_iter()
            .map(|v| f16_to_f32(f32_to_f16_bits(v)))
            .collect();
        let linear = shape.len() == 2
            && !(scaled
                && (name.ends_with("shared.weight") || name.contains("relative_attention_bias")));
        let (dtype, bytes): (DType, Vec<u8>) = if linear {
            let scale = if scaled {
                let s = half.iter().fold(0f32, |m, v| m.max(v.abs())) / 448.0;
                let stem = name.strip_suffix(".weight").expect("a Linear weight");
                scales.push((format!("{stem}.scale_weight"), s));
                s
            } else {
                1.0
            };
            let bytes = half
                .iter()
                .map(|&v| fp8(if scaled { v / scale } else { v }))
                .collect();
            (DType::F8E4M3, bytes)
        } else {
            let bytes = half
                .iter()
                .flat_map(|&v| f32_to_f16_bits(v).to_le_bytes())
                .collect();
            (DType::F16, bytes)
        };
        let units: Vec<u16> = bytes.iter().map(|&b| u16::from(b)).collect();
        total = total.wrapping_add(checksum(&units, i));
        blobs.push((name, shape, dtype, bytes));
    }
    for (j, (name, s)) in scales.iter().enumerate() {
        let bytes = s.to_le_bytes().to_vec();
        let units: Vec<u16> = bytes.iter().map(|&b| u16::from(b)).collect();
        total = total.wrapping_add(checksum(&units, keys.len() + j));
        blobs.push((name.clone(), Vec::new(), DType::F32, bytes));
    }
    if scaled {
        blobs.push(("scaled_fp8".into(), vec![0], DType::F8E4M3, Vec::new()));
    }
    assert_eq!(
        total.to_string(),
        f["checksum_raw"].as_str().expect("checksum_raw"),
        "{}: the fp8 weights differ from the reference script's",
        path.display()
    );
    let tensors: Vec<TensorData<'_>> = blobs
        .iter()
        .map(|(n, s, d, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("mkdir");
    }
    write_safetensors(&path, &tensors, &BTreeMap::new()).expect("writes tensors");
}

pub fn b64(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("bad base64"),
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c) << (18 - 6 * i);
        }
        let n = chunk.len() * 6 / 8;
        for i in 0..n {
            out.push((acc >> (16 - 8 * i)) as u8);
        }
    }
    out
}

/// Little-endian f32s from base64.
pub fn f32s(s: &str) -> Vec<f32> {
    b64(s)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Copies the example input image into `base/input`.
pub fn copy_input(base: &Path) {
    std::fs::create_dir_all(base.join("input")).expect("mkdir");
    for e in std::fs::read_dir(root().join("graphs/input")).expect("graphs/input") {
        let e = e.expect("entry");
        if e.path().is_file() {
            std::fs::copy(e.path(), base.join("input").join(e.file_name())).expect("copy");
        }
    }
}

/// Runs graphs/`graph`.json with `sdkit run` in f32 on `device`.
pub fn run(base: &Path, graph: &str, device: &str) {
    // The references are f32: no tensor-core products on GPUs that have
    // them (lavapipe has none either way), so `--tune` has nothing to
    // measure: it must change nothing.
    let o = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args([
            "run",
            "-q",
            "--tune",
            "--precision",
            "f32",
            "--device",
            device,
        ])
        .arg(root().join("graphs").join(format!("{graph}.json")))
        .arg("--base-dir")
        .arg(base)
        .output()
        .expect("runs");
    // SDKIT_PROFILE: the run's kernel times (printed by the backends to
    // stderr) shown with the test's output.
    if std::env::var_os("SDKIT_PROFILE").is_some() {
        eprint!("{}", String::from_utf8_lossy(&o.stderr));
    }
    assert!(
        o.status.success(),
        "{graph} on {device}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `graph` (API JSON) without its VAEDecode and SaveImage nodes: the
/// latent comparisons skip the decode (on lavapipe a second a run).
pub fn latent_only(graph: &str) -> String {
    let mut g: serde_json::Value = serde_json::from_str(graph).expect("json");
    if let Some(nodes) = g.as_object_mut() {
        nodes.retain(|_, n| !matches!(n["class_type"].as_str(), Some("VAEDecode" | "SaveImage")));
    }
    g.to_string()
}

/// A wgpu runtime with the sampling loop on the device or not
/// (`Options::device_loops`); None without an adapter, after
/// `no_adapter` said why (or failed the test where one is required).
pub fn gpu_runtime(device_loops: bool, what: &str) -> Option<sdkit_engine::Runtime> {
    use sdkit_compute::backend::wgpu::{Options, WgpuBackend};
    match WgpuBackend::with_options(&Options {
        device_loops,
        ..Options::default()
    }) {
        Ok(g) => Some(sdkit_engine::Runtime::wgpu(g)),
        Err(e) => {
            sdkit_compute::backend::wgpu::no_adapter(what, e);
            None
        }
    }
}

/// Runs the workflow `text` (ComfyUI API JSON) in `base` on `runtime`
/// with `preview`; returns the bytes read back from the device and the
/// previews sent.
pub fn run_in(
    base: &Path,
    runtime: sdkit_engine::Runtime,
    text: &str,
    preview: sdkit_engine::event::PreviewMethod,
) -> (u64, usize) {
    use sdkit_engine::{CancelToken, Event, EventSink, Executor, Paths, RunOptions};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    let lib = Arc::new(sdkit_nodes::library());
    let paths = Paths::under(base);
    let exec = Executor::new(lib.clone(), Arc::new(paths.clone())).with_runtime(runtime.clone());
    let wf = sdkit_schema::workflow::load(text, &lib.registry).expect("loads");
    let graph = sdkit_engine::validate(&wf, &lib.registry, &paths).expect("valid");
    let previews = Arc::new(AtomicUsize::new(0));
    let seen = previews.clone();
    let events: EventSink = Arc::new(move |e: &Event| {
        if matches!(e, Event::Preview { .. }) {
            seen.fetch_add(1, Ordering::Relaxed);
        }
    });
    let mut opts = RunOptions::new(events, CancelToken::new());
    opts.preview = preview;
    let rt = tokio::runtime::Runtime::new().expect("tokio");
    rt.block_on(exec.run(&graph, opts)).expect("runs");
    let sent = previews.load(Ordering::Relaxed);
    (runtime.bytes_downloaded(), sent)
}

/// Max abs difference relative to the reference's largest magnitude.
pub fn rel_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}

/// Checks one workflow's SaveLatent (`latent_file`, under `output/`) and
/// SaveImage (`image_prefix`) outputs against the reference `w`. The
/// latent tolerance is 10× the reference's own float32 spread, the larger
/// of two the reference scripts record: how far ComfyUI's latent moves
/// when its UNet runs in float64, and when the initial noise and every
/// UNet output are perturbed by one float32 rounding (which shows how
/// ill-conditioned a workflow's sampling is: zsnr's first Euler step from
/// σ ≈ 4519 cancels ~10 bits). Pixels may differ by one level where a
/// value sits at a rounding boundary.
pub fn check_outputs(
    base: &Path,
    w: &serde_json::Value,
    graph: &str,
    latent_file: &str,
    image_prefix: &str,
) {
    check_outputs_within(base, w, graph, latent_file, image_prefix, None);
}

/// [`check_outputs`] with the latent tolerance given (`Some`) rather than
/// 10× the reference's spread: for a device that rounds weights the f32
/// reference does not (a GPU storing LoRA-patched f32 weights as f16, as
/// ComfyUI on a GPU does); pixels then may differ by 1/255 on at most 1%
/// of values.
pub fn check_outputs_within(
    base: &Path,
    w: &serde_json::Value,
    graph: &str,
    latent_file: &str,
    image_prefix: &str,
    latent_tol_override: Option<f32>,
) {
    let spread = w["f32_vs_f64_unet_rel"].as_f64().expect("spread") as f32;
    let rounding = w["unet_rounding_rel"].as_f64().expect("rounding spread") as f32;
    let spread = spread.max(rounding);
    let latent_tol = latent_tol_override.unwrap_or(10.0 * spread);
    let want_latent = f32s(w["latent_f32"].as_str().expect("latent"));
    let latent_shape: Vec<usize> =
        serde_json::from_value(w["latent_shape"].clone()).expect("shape");
    let file = SafeTensors::open(&base.join("output").join(latent_file))
        .expect("SaveLatent wrote the latent");
    assert_eq!(
        file.get("latent_tensor").expect("latent_tensor").shape,
        latent_shape
    );
    assert!(file.get("latent_format_version_0").is_some());
    let got_latent = file.to_f32("latent_tensor").expect("f32");
    let dl = rel_diff(&got_latent, &want_latent);

    let shape: Vec<usize> = serde_json::from_value(w["image_shape"].clone()).expect("shape");
    let want = f32s(w["image_f32"].as_str().expect("image"));
    let (b, h, wd) = (shape[0], shape[1], shape[2]);
    let per = h * wd * 3;
    let mut worst = 0u8;
    let mut off = 0usize;
    for i in 0..b {
        let path = base.join(format!("output/{image_prefix}_{:05}_.png", i + 1));
        let img = image::open(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .to_rgb8();
        assert_eq!(img.dimensions(), (wd as u32, h as u32));
        for (p, r) in img.as_raw().iter().zip(&want[i * per..(i + 1) * per]) {
            let r = sdkit_nodes::io::to_u8(*r);
            let d = p.abs_diff(r);
            worst = worst.max(d);
            off += usize::from(d > 0);
        }
    }
    eprintln!(
        "{graph}: latent max rel diff {dl:e} (reference float32 spread {spread:e}); \
         image worst {worst}/255, {off} of {} values differ",
        b * per
    );
    assert!(
        dl < latent_tol,
        "{graph}: latent differs by {dl} (relative)"
    );
    assert!(worst <= 1, "{graph}: pixels differ by up to {worst}");
    if latent_tol_override.is_some() {
        assert!(
            off * 100 <= b * per,
            "{graph}: {off} of {} pixel values differ",
            b * per
        );
    }
}

/// The tiny SD1 and SDXL checkpoints (rebuilt from their own fixtures)
/// under `models/checkpoints`: the bases of the adapter fixtures.
pub fn write_base_checkpoints(models: &Path) {
    let sd1 = fixture("sd1/expected.json");
    write_tensors(
        &models
            .join("checkpoints")
            .join(sd1["checkpoint"].as_str().expect("name")),
        &sd1["keys"],
        None,
        sd1["checksum_f16"].as_str().expect("checksum"),
        None,
    );
    let fam = fixture("families/expected.json");
    for f in fam["files"].as_array().expect("files") {
        if f["name"] == "tiny_sdxl.safetensors" {
            write_tensors(
                &models.join("checkpoints/tiny_sdxl.safetensors"),
                &f["keys"],
                f.get("scaled"),
                f["checksum_f16"].as_str().expect("checksum"),
                None,
            );
        }
    }
}

/// Writes each entry of `files` (`name`, `keys`, `scaled`, optional
/// `alphas`, `checksum_f16`) into `dir`.
pub fn write_fixture_files(dir: &Path, files: &serde_json::Value) {
    for f in files.as_array().expect("files") {
        write_tensors_with(
            &dir.join(f["name"].as_str().expect("name")),
            &f["keys"],
            f.get("scaled"),
            f.get("alphas"),
            f["checksum_f16"].as_str().expect("checksum"),
            None,
        );
    }
}

/// The `filename_prefix` of graphs/`graph`.json's node of `class`.
pub fn graph_prefix(graph: &str, class: &str) -> String {
    let text = std::fs::read_to_string(root().join(format!("graphs/{graph}.json"))).expect("graph");
    let g: serde_json::Value = serde_json::from_str(&text).expect("graph json");
    g.as_object()
        .expect("API-format graph")
        .values()
        .find(|n| n["class_type"] == class)
        .and_then(|n| n["inputs"]["filename_prefix"].as_str())
        .unwrap_or_else(|| panic!("no {class} with a filename_prefix"))
        .to_string()
}

/// Checks graphs/`graph`.json's SaveLatent and SaveImage outputs under
/// `base` against `fx["workflows"][graph]`.
pub fn check_graph(base: &Path, fx: &serde_json::Value, graph: &str, latent_tol: Option<f32>) {
    check_outputs_within(
        base,
        &fx["workflows"][graph],
        graph,
        &format!("{}_00001_.latent", graph_prefix(graph, "SaveLatent")),
        &graph_prefix(graph, "SaveImage"),
        latent_tol,
    );
}

/// Runs each workflow of `variants` (ComfyUI API JSON) in turn through one
/// executor on wgpu with a 1 GiB budget, as `watch` and the server run
/// edits, and returns the bytes uploaded in each residency event of node
/// `node`. None (after `no_adapter`) without an adapter.
pub fn residency_uploads(
    base: &Path,
    variants: &[serde_json::Value],
    node: &str,
    what: &str,
) -> Option<Vec<u64>> {
    use sdkit_engine::{CancelToken, Event, EventSink, Executor, Paths, RunOptions, Runtime};
    use std::sync::{Arc, Mutex};

    let runtime = match Runtime::select_with("wgpu", Some(1 << 30)) {
        Ok(g) => g,
        Err(e) => {
            sdkit_compute::backend::wgpu::no_adapter(what, e);
            return None;
        }
    };
    let lib = Arc::new(sdkit_nodes::library());
    let paths = Paths::under(base);
    let exec = Executor::new(lib.clone(), Arc::new(paths.clone())).with_runtime(runtime);
    let uploads: Arc<Mutex<Vec<u64>>> = Arc::default();
    let sink = uploads.clone();
    let node = node.to_string();
    let events: EventSink = Arc::new(move |e: &Event| {
        if let Event::Residency {
            uploaded_bytes,
            node: n,
            ..
        } = e
        {
            if *n == node {
                sink.lock().expect("lock").push(*uploaded_bytes);
            }
        }
    });
    let rt = tokio::runtime::Runtime::new().expect("tokio");
    for wf in variants {
        let wf = sdkit_schema::workflow::load(&wf.to_string(), &lib.registry).expect("loads");
        let graph = sdkit_engine::validate(&wf, &lib.registry, &paths).expect("valid");
        rt.block_on(exec.run(&graph, RunOptions::new(events.clone(), CancelToken::new())))
            .expect("runs");
    }
    let out = uploads.lock().expect("lock").clone();
    Some(out)
}

/// SHA-256 of `data`, lowercase hex (fixtures record GGUF files by it).
pub fn sha256(data: &[u8]) -> String {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for chunk in msg.chunks(64) {
        let mut w = [0u32; 64];
        for i in 0..16 {
            w[i] = u32::from_be_bytes([
                chunk[4 * i],
                chunk[4 * i + 1],
                chunk[4 * i + 2],
                chunk[4 * i + 3],
            ]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let mut v = h;
        for i in 0..64 {
            let s1 = v[4].rotate_right(6) ^ v[4].rotate_right(11) ^ v[4].rotate_right(25);
            let ch = (v[4] & v[5]) ^ (!v[4] & v[6]);
            let t1 = v[7]
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = v[0].rotate_right(2) ^ v[0].rotate_right(13) ^ v[0].rotate_right(22);
            let maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
            let t2 = s0.wrapping_add(maj);
            v = [
                t1.wrapping_add(t2),
                v[0],
                v[1],
                v[2],
                v[3].wrapping_add(t1),
                v[4],
                v[5],
                v[6],
            ];
        }
        for (a, b) in h.iter_mut().zip(v) {
            *a = a.wrapping_add(b);
        }
    }
    h.iter().map(|x| format!("{x:08x}")).collect()
}

/// The tiny Flux of a fixture's key list as ComfyUI-GGUF's Flux files of
/// ggml type `target` are made (tools/reference/gguf_fixtures.py,
/// "conversion"): values from the formula rounded to f16; the 2-D weights
/// of img_in, time_in.in_layer, vector_in.in_layer, guidance_in.in_layer
/// and final_layer.linear F32, the rest of txt_in, time_in, vector_in,
/// guidance_in and final_layer F16; every other 2-D weight in the target
/// type: 8, Q8_0 from an f32 source (1-D tensors F32; per 32 values d =
/// max|x| / 127, q = x / d rounded half away from zero, d stored f16); 12,
/// Q4_K from the f16 source (1-D tensors F16, F16 where rows are not
/// whole 256-value blocks; [`q4_k_block`]). Tensors in key order,
/// alignment 32.
pub fn tiny_flux_gguf(keys: &serde_json::Value, target: u32) -> Vec<u8> {
    let mut keys: Vec<(String, Vec<usize>)> = keys
        .as_array()
        .expect("keys")
        .iter()
        .map(|k| {
            (
                k[0].as_str().expect("name").to_string(),
                k[1].as_array()
                    .expect("shape")
                    .iter()
                    .map(|d| d.as_u64().expect("dim") as usize)
                    .collect(),
            )
        })
        .collect();
    keys.sort();
    let f32_2d = [
        "img_in.",
        "time_in.in_layer.",
        "vector_in.in_layer.",
        "guidance_in.in_layer.",
        "final_layer.linear.",
    ];
    let f16_2d = [
        "txt_in.",
        "time_in.",
        "vector_in.",
        "guidance_in.",
        "final_layer.",
    ];
    let mut tensors = Vec::new();
    for (name, shape) in &keys {
        let v: Vec<f32> = values(name, shape)
            .into_iter()
            .map(|x| sdkit_compute::weights::f16_to_f32(f32_to_f16_bits(x)))
            .collect();
        let as_f16 = |v: &[f32]| -> Vec<u8> {
            v.iter()
                .flat_map(|x| f32_to_f16_bits(*x).to_le_bytes())
                .collect()
        };
        let (ty, bytes): (u32, Vec<u8>) = if shape.len() != 2 && target == 12 {
            (1, as_f16(&v))
        } else if shape.len() != 2 || f32_2d.iter().any(|p| name.contains(p)) {
            (0, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        } else if target == 12 && shape[1] % 256 == 0 {
            (12, v.chunks(256).flat_map(q4_k_block).collect())
        } else if target == 12 {
            (1, as_f16(&v))
        } else if f16_2d.iter().any(|p| name.contains(p)) {
            (
                1,
                v.iter()
                    .flat_map(|x| f32_to_f16_bits(*x).to_le_bytes())
                    .collect(),
            )
        } else {
            let mut b = Vec::with_capacity(v.len() / 32 * 34);
            for block in v.chunks(32) {
                let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                b.extend_from_slice(&f32_to_f16_bits(d).to_le_bytes());
                b.extend(block.iter().map(|x| (x * id).round() as i8 as u8));
            }
            (8, b)
        };
        tensors.push((name.clone(), shape.clone(), ty, bytes));
    }
    gguf_bytes("flux", if target == 12 { 14 } else { 7 }, &tensors)
}

/// One Q4_K block of 256 values, by the reference script's quantizer
/// ("conversion" in tests/reference/gguf/expected.json): per 32-value
/// sub-block, scale (max − min(0, min)) / 15 and offset −min(0, min); d
/// and dmin the largest of them / 63 in f16; 6-bit multipliers and 4-bit
/// quants rounded half to even.
fn q4_k_block(x: &[f32]) -> Vec<u8> {
    let f16 = |v: f32| sdkit_compute::weights::f16_to_f32(f32_to_f16_bits(v));
    let mut s = [0f32; 8];
    let mut n = [0f32; 8];
    for j in 0..8 {
        let sub = &x[32 * j..32 * j + 32];
        let mn = sub.iter().fold(0f32, |m, &v| m.min(v));
        let mx = sub.iter().fold(f32::MIN, |m, &v| m.max(v));
        s[j] = (mx - mn) / 15.0;
        n[j] = 0.0 - mn;
    }
    let d = f16(s.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
    let dmin = f16(n.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
    let six = |v: f32, by: f32| -> u8 {
        if by > 0.0 {
            (v / by).round_ties_even().min(63.0) as u8
        } else {
            0
        }
    };
    let sc: Vec<u8> = s.iter().map(|&v| six(v, d)).collect();
    let mm: Vec<u8> = n.iter().map(|&v| six(v, dmin)).collect();
    let q: Vec<u8> = (0..256)
        .map(|i| {
            let j = i / 32;
            let scale = d * f32::from(sc[j]);
            let off = dmin * f32::from(mm[j]);
            if scale > 0.0 {
                ((x[i] + off) / scale).round_ties_even().clamp(0.0, 15.0) as u8
            } else {
                0
            }
        })
        .collect();
    let mut b = Vec::with_capacity(144);
    b.extend_from_slice(&f32_to_f16_bits(d).to_le_bytes());
    b.extend_from_slice(&f32_to_f16_bits(dmin).to_le_bytes());
    let mut scales = [0u8; 12];
    for j in 0..4 {
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        scales[j + 4] = mm[j] | ((mm[j + 4] >> 4) << 6);
        scales[j + 8] = (sc[j + 4] & 15) | ((mm[j + 4] & 15) << 4);
    }
    b.extend_from_slice(&scales);
    for c in 0..4 {
        for l in 0..32 {
            b.push(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
        }
    }
    b
}

/// A GGUF v3 file: `general.architecture`, quantization version 2 and
/// `file_type`, then `tensors` (name, torch shape, ggml type id, data) in
/// the order given, alignment 32.
pub fn gguf_bytes(
    arch: &str,
    file_type: u32,
    tensors: &[(String, Vec<usize>, u32, Vec<u8>)],
) -> Vec<u8> {
    let mut infos = Vec::new();
    let mut data: Vec<u8> = Vec::new();
    for (name, shape, ty, bytes) in tensors {
        infos.push((name, shape, *ty, data.len()));
        data.extend_from_slice(bytes);
        data.resize(data.len().next_multiple_of(32), 0);
    }
    let mut out: Vec<u8> = b"GGUF".to_vec();
    let string = |out: &mut Vec<u8>, s: &str| {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    };
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(infos.len() as u64).to_le_bytes());
    out.extend_from_slice(&3u64.to_le_bytes());
    string(&mut out, "general.architecture");
    out.extend_from_slice(&8u32.to_le_bytes());
    string(&mut out, arch);
    for (k, v) in [
        ("general.quantization_version", 2u32),
        ("general.file_type", file_type),
    ] {
        string(&mut out, k);
        out.extend_from_slice(&4u32.to_le_bytes());
        out.extend_from_slice(&v.to_le_bytes());
    }
    for (name, shape, ty, offset) in &infos {
        string(&mut out, name);
        out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(&(*offset as u64).to_le_bytes());
    }
    out.resize(out.len().next_multiple_of(32), 0);
    out.extend_from_slice(&data);
    out
}
