//! Ctrl-C (SIGINT) stops a run at the next node, reports
//! execution_interrupted, exits 130 and leaves no output files.
#![cfg(unix)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

const SLOW: &str = r#"(nodes: {
    "load": LoadImage(image: "example.png"),
    "big": ImageScale(image: ("load", 0), upscale_method: "bicubic", width: 1024, height: 1024, crop: "disabled"),
    "blur": ImageBlur(image: ("big", 0), blur_radius: 8, sigma: 2.0),
    "blur2": ImageBlur(image: ("blur", 0), blur_radius: 8, sigma: 2.0),
    "save": SaveImage(images: ("blur2", 0), filename_prefix: "slow"),
})"#;

#[test]
fn sigint_interrupts_cleanly() {
    let base = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(base.path().join("input")).expect("mkdir");
    std::fs::copy(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("graphs/input/example.png"),
        base.path().join("input/example.png"),
    )
    .expect("copy");
    let file = base.path().join("slow.ron");
    std::fs::write(&file, SLOW).expect("write");
    let mut child = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args(["run", "-q", "--events", "-"])
        .arg(&file)
        .arg("--base-dir")
        .arg(base.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut types = Vec::new();
    let mut sent = false;
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        let v: serde_json::Value = serde_json::from_str(&line).expect("event JSON");
        types.push(v["type"].as_str().unwrap_or("").to_string());
        if !sent && v["type"] == "executing" && v["data"]["node"] == "blur" {
            let status = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status()
                .expect("kill");
            assert!(status.success());
            sent = true;
        }
    }
    let status = child.wait().expect("wait");
    assert!(sent, "never reached the blur node: {types:?}");
    assert_eq!(status.code(), Some(130), "{types:?}");
    // ComfyUI's order: the interruption, then `executing` with no node.
    let n = types.len();
    assert_eq!(
        types.get(n.wrapping_sub(2)).map(String::as_str),
        Some("execution_interrupted"),
        "{types:?}"
    );
    assert_eq!(types.last().map(String::as_str), Some("executing"));
    assert!(!types.iter().any(|t| t == "execution_success"));
    let out = base.path().join("output");
    let leftovers: Vec<_> = std::fs::read_dir(&out)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}
