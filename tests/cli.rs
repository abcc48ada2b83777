//! Drives the `sdkit` binary on the example workflows in `graphs/` and on
//! the broken variants in `tests/broken/`.
//!
//! Broken variants are golden tests: `tests/broken/NAME.expected.json` holds
//! the diagnostics `sdkit validate --format json` prints. Re-record them with
//! `SDKIT_BLESS=1 cargo test --test cli`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn sdkit() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sdkit"))
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh base folder with the example input image.
fn base_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("input")).expect("mkdir");
    std::fs::copy(
        root().join("graphs/input/example.png"),
        dir.path().join("input/example.png"),
    )
    .expect("copy input");
    dir
}

/// [`base_dir`] with every example input (the graphs load them by name).
fn base_dir_with_inputs() -> tempfile::TempDir {
    let dir = base_dir();
    for e in std::fs::read_dir(root().join("graphs/input")).expect("graphs/input") {
        let e = e.expect("entry");
        if e.path().is_file() {
            std::fs::copy(e.path(), dir.path().join("input").join(e.file_name()))
                .expect("copy input");
        }
    }
    dir
}

fn run_in(base: &Path, args: &[&str]) -> Output {
    sdkit()
        .args(args)
        .arg("--base-dir")
        .arg(base)
        .output()
        .expect("runs sdkit")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                stack.push(e.path());
            } else if let Ok(rel) = e.path().strip_prefix(dir) {
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_example_graph_validates_and_image_graphs_run() {
    let graphs = root().join("graphs");
    let mut ran = 0;
    for e in std::fs::read_dir(&graphs).expect("graphs/") {
        let path = e.expect("entry").path();
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !["ron", "json"].contains(&ext) {
            continue;
        }
        let base = base_dir_with_inputs();
        let p = path.to_string_lossy().to_string();
        // Model workflows need model files: give every `.safetensors` name
        // they mention an empty placeholder in each model folder, so
        // validation passes, and expect the run to stop at the first
        // loader with a clear error (tests/sd1_pipeline.rs and
        // tests/families_pipeline.rs run them with real weights).
        let source = std::fs::read_to_string(&path).expect("read");
        let models: Vec<&str> = source
            .split('"')
            .filter(|s| (s.ends_with(".safetensors") || s.ends_with(".gguf")) && !s.contains('/'))
            .collect();
        let needs_model = !models.is_empty();
        for folder in [
            "checkpoints",
            "unet",
            "clip",
            "vae",
            "loras",
            "controlnet",
            "clip_vision",
            "style_models",
        ] {
            let dir = base.path().join("models").join(folder);
            std::fs::create_dir_all(&dir).expect("mkdir");
            for name in &models {
                std::fs::write(dir.join(name), b"").expect("write");
            }
        }
        // VAELoader's "taesd"/"taesdxl" are listed when both halves exist.
        let approx = base.path().join("models/vae_approx");
        std::fs::create_dir_all(&approx).expect("mkdir");
        for name in ["taesd", "taesdxl"] {
            for part in ["encoder", "decoder"] {
                std::fs::write(approx.join(format!("{name}_{part}.safetensors")), b"")
                    .expect("write");
            }
        }
        let v = run_in(base.path(), &["validate", &p]);
        assert_eq!(v.status.code(), Some(0), "{p}: {}", text(&v));
        let o = run_in(base.path(), &["run", "-q", &p]);
        if needs_model {
            assert_eq!(o.status.code(), Some(1), "{p}: {}", text(&o));
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                err.contains("Loader") && err.contains(".safetensors"),
                "{}",
                text(&o)
            );
        } else {
            assert_eq!(o.status.code(), Some(0), "{p}: {}", text(&o));
            assert!(
                !files_under(&base.path().join("output")).is_empty()
                    || !files_under(&base.path().join("temp")).is_empty(),
                "{p} wrote nothing"
            );
            ran += 1;
        }
    }
    assert!(ran >= 4, "only {ran} image graphs ran");
}

#[test]
fn broken_variants_report_golden_diagnostics() {
    let dir = root().join("tests/broken");
    let bless = std::env::var_os("SDKIT_BLESS").is_some();
    let mut checked = 0;
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/broken")
        .map(|e| e.expect("entry").path())
        .filter(|p| {
            let n = p.to_string_lossy();
            (n.ends_with(".ron") || n.ends_with(".json")) && !n.ends_with(".expected.json")
        })
        .collect();
    entries.sort();
    for path in entries {
        let base = base_dir();
        let rel = format!(
            "tests/broken/{}",
            path.file_name().and_then(|n| n.to_str()).unwrap_or("")
        );
        let o = sdkit()
            .current_dir(root())
            .args(["validate", "--format", "json", &rel, "--base-dir"])
            .arg(base.path())
            .output()
            .expect("runs");
        assert_eq!(o.status.code(), Some(2), "{rel}: {}", text(&o));
        // Messages name folders under the (temporary) base folder.
        let stdout =
            String::from_utf8_lossy(&o.stdout).replace(&base.path().display().to_string(), "$BASE");
        let got: serde_json::Value = serde_json::from_str(&stdout).expect("JSON diagnostics");
        let diags = got["diagnostics"].as_array().expect("diagnostics");
        assert!(
            diags.iter().any(|d| d["severity"] == "error"),
            "{rel}: no error"
        );
        let expected_path = path.with_extension("expected.json");
        let pretty = serde_json::to_string_pretty(&got["diagnostics"]).expect("json") + "\n";
        if bless {
            std::fs::write(&expected_path, &pretty).expect("bless");
        } else {
            let want = std::fs::read_to_string(&expected_path).unwrap_or_else(|_| {
                panic!(
                    "{} missing; run with SDKIT_BLESS=1",
                    expected_path.display()
                )
            });
            assert_eq!(pretty, want, "{rel}: diagnostics changed");
        }
        // `run` refuses the same file with the same exit code, writing nothing.
        let r = sdkit()
            .current_dir(root())
            .args(["run", "-q", &rel, "--base-dir"])
            .arg(base.path())
            .output()
            .expect("runs");
        assert_eq!(r.status.code(), Some(2), "{rel}: {}", text(&r));
        assert!(files_under(&base.path().join("output")).is_empty());
        checked += 1;
    }
    assert!(checked >= 10);
}

#[test]
fn text_diagnostics_name_file_position_node_and_input() {
    let base = base_dir();
    let o = sdkit()
        .current_dir(root())
        .args(["validate", "tests/broken/unknown_input.ron", "--base-dir"])
        .arg(base.path())
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(
            "tests/broken/unknown_input.ron:3:69: error[unknown_input] node \"scale\" (ImageScale) input \"widht\": ImageScale has no input \"widht\"; did you mean \"width\"?"
        ),
        "{err}"
    );
}

#[test]
fn set_overrides_inputs() {
    let base = base_dir();
    let p = root().join("graphs/image_pipeline.ron");
    let o = run_in(
        base.path(),
        &[
            "run",
            "-q",
            &p.to_string_lossy(),
            "--set",
            "scale.width=32",
            "--set",
            "save.filename_prefix=small/pic",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = base.path().join("output/small/pic_00001_.png");
    let img = image::open(&out).expect("decodes");
    assert_eq!((img.width(), img.height()), (32, 24));
    let bad = run_in(
        base.path(),
        &["run", "-q", &p.to_string_lossy(), "--set", "scale.width=-3"],
    );
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad));
}

/// `--set` naming an input the node's type lacks, or no input, is an
/// error (exit 2, nothing run), not a warning.
#[test]
fn set_refuses_unknown_and_empty_input_names() {
    let base = base_dir();
    let p = root().join("graphs/image_pipeline.ron");
    for (set, says) in [
        ("scale.nope=64", "ImageScale has no input \"nope\""),
        ("scale.=64", "no input name after \"scale.\""),
    ] {
        let o = run_in(
            base.path(),
            &["run", "-q", &p.to_string_lossy(), "--set", set],
        );
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains(&format!("--set {set}: ")) && err.contains(says),
            "{err}"
        );
    }
    assert!(files_under(&base.path().join("output")).is_empty());
}

/// A 120 KB value is echoed as its first 200 characters and its size,
/// wherever the error about it is made.
#[test]
fn errors_echo_long_values_capped() {
    let base = base_dir();
    let p = root().join("graphs/image_pipeline.ron");
    let long = "y".repeat(120_000);
    for set in [
        format!("scale.width={long}"),
        format!("load.image={long}"),
        format!("scale.{long}=1"),
        format!("{long}.width=1"),
        format!("scale.width{long}"),
    ] {
        let o = run_in(
            base.path(),
            &["run", "-q", &p.to_string_lossy(), "--set", &set],
        );
        assert_eq!(o.status.code(), Some(2), "{}", &text(&o)[..2000]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.len() < 2000, "{} bytes of errors", err.len());
        assert!(err.contains(&"y".repeat(150)), "{err}");
        assert!(err.contains("bytes)"), "{err}");
    }
}

#[test]
fn save_numbering_continues_and_png_has_prompt_and_workflow() {
    let base = base_dir();
    let p = root().join("graphs/comfy_ui_image_pipeline.json");
    for _ in 0..2 {
        // Separate processes: the in-process cache does not carry over.
        let o = run_in(base.path(), &["run", "-q", &p.to_string_lossy()]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    }
    assert_eq!(
        files_under(&base.path().join("output")),
        vec!["inverted_00001_.png", "inverted_00002_.png"]
    );
    let f = std::fs::File::open(base.path().join("output/inverted_00001_.png")).expect("open");
    let reader = png::Decoder::new(std::io::BufReader::new(f))
        .read_info()
        .expect("png");
    let chunks: Vec<(String, String)> = reader
        .info()
        .uncompressed_latin1_text
        .iter()
        .map(|c| (c.keyword.clone(), c.text.clone()))
        .collect();
    let prompt = &chunks
        .iter()
        .find(|c| c.0 == "prompt")
        .expect("prompt chunk")
        .1;
    let prompt: serde_json::Value = serde_json::from_str(prompt).expect("prompt JSON");
    assert_eq!(prompt["3"]["class_type"], "ImageInvert");
    assert_eq!(prompt["3"]["inputs"]["image"], serde_json::json!(["2", 0]));
    let workflow = &chunks
        .iter()
        .find(|c| c.0 == "workflow")
        .expect("workflow chunk")
        .1;
    let workflow: serde_json::Value = serde_json::from_str(workflow).expect("workflow JSON");
    assert_eq!(workflow["last_node_id"], 5);
}

#[test]
fn nodes_and_schema_print_json() {
    let base = base_dir();
    let o = run_in(base.path(), &["nodes"]);
    assert_eq!(o.status.code(), Some(0));
    let info: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    let ks = &info["KSampler"];
    assert_eq!(
        ks["input_order"]["required"],
        serde_json::json!([
            "model",
            "seed",
            "steps",
            "cfg",
            "sampler_name",
            "scheduler",
            "positive",
            "negative",
            "latent_image",
            "denoise"
        ])
    );
    assert_eq!(ks["input"]["required"]["seed"][0], "INT");
    assert_eq!(
        ks["input"]["required"]["seed"][1]["max"],
        serde_json::json!(u64::MAX)
    );
    assert_eq!(ks["output"], serde_json::json!(["LATENT"]));
    assert_eq!(
        info["LoadImage"]["input"]["required"]["image"][0],
        serde_json::json!(["example.png"])
    );
    assert_eq!(info["SaveImage"]["output_node"], true);
    let o = run_in(base.path(), &["schema"]);
    assert_eq!(o.status.code(), Some(0));
    let schema: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(schema["required"], serde_json::json!(["nodes"]));
    assert!(schema["definitions"]["node_type"]["enum"]
        .as_array()
        .expect("enum")
        .contains(&serde_json::json!("ImageScale")));
}

#[test]
fn unreadable_input_image_is_a_node_error_not_a_panic() {
    let base = base_dir();
    std::fs::write(
        base.path().join("input/broken.png"),
        b"\x89PNG\r\n\x1a\nnot really",
    )
    .expect("write");
    let p = root().join("graphs/image_pipeline.ron");
    let o = run_in(
        base.path(),
        &[
            "run",
            "-q",
            &p.to_string_lossy(),
            "--set",
            "load.image=broken.png",
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("broken.png") && err.contains("load"), "{err}");
    assert!(files_under(&base.path().join("output")).is_empty());
}

#[test]
fn devices_probe_measures_the_adapter_or_names_what_is_missing() {
    let o = sdkit().args(["devices", "--probe"]).output().expect("runs");
    let out = text(&o);
    if out.contains("no GPU adapters") {
        assert!(!o.status.success(), "{out}");
        sdkit_compute::backend::wgpu::no_adapter("devices --probe", "no GPU adapters");
        return;
    }
    assert!(o.status.success(), "{out}");
    for line in ["probe of ", "memory read: ", "f32 FMA: "] {
        assert!(out.contains(line), "missing {line:?} in:\n{out}");
    }
    let o = sdkit()
        .args(["devices", "--probe", "no such adapter"])
        .output()
        .expect("runs");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("matching \"no such adapter\""),
        "{}",
        text(&o)
    );
}

/// As ComfyUI: an output whose branch has an error is reported and
/// skipped, the others run (exit 2: the run is incomplete); `--strict`
/// runs nothing.
#[test]
fn outputs_with_errors_are_skipped_unless_strict() {
    let base = base_dir();
    let wf = base.path().join("two.ron");
    std::fs::write(
        &wf,
        r#"(nodes: {
            "good": EmptyImage(width: 16, height: 16, batch_size: 1, color: 0),
            "save": SaveImage(images: ("good", 0), filename_prefix: "good"),
            "bad": EmptyImage(width: 0, height: 16, batch_size: 1, color: 0),
            "save_bad": SaveImage(images: ("bad", 0), filename_prefix: "bad"),
        })"#,
    )
    .expect("write");
    let wf = wf.to_string_lossy().into_owned();
    let o = run_in(base.path(), &["run", "-q", "--strict", &wf]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(files_under(&base.path().join("output")).is_empty());
    let o = run_in(base.path(), &["run", "-q", &wf]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("value_smaller_than_min") && err.contains("\"bad\""),
        "{err}"
    );
    assert_eq!(
        files_under(&base.path().join("output")),
        ["good_00001_.png"]
    );
}

/// `--threads N` sizes the CPU pool (every core by default); 0 is refused.
#[test]
fn threads_flag_sizes_the_cpu_pool() {
    let o = sdkit()
        .args(["--threads", "1", "devices"])
        .output()
        .expect("runs");
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("cpu: 1 threads"),
        "{}",
        text(&o)
    );
    let o = sdkit()
        .args(["devices", "--threads", "0"])
        .output()
        .expect("runs");
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--threads"),
        "{}",
        text(&o)
    );
}
