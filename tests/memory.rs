//! Memory bombs against the `sdkit` binary, run under an address-space cap
//! (`prlimit --as`) so a regression fails the test instead of exhausting
//! the machine: each must end as a node error with exit code 1, never as
//! an abort ("memory allocation of N bytes failed", SIGABRT).

#![cfg(target_os = "linux")]

#[path = "../nodes/tests/support/png_bomb.rs"]
mod png_bomb;
use std::path::Path;
use std::process::{Command, Output};

/// A cap under which sdkit runs normally but cannot hold a 4 GiB tensor.
const CAP: &str = "--as=4000000000";

/// Runs `sdkit run -q WORKFLOW` in `base` under [`CAP`]. prlimit is part of
/// util-linux (Debian's CI images have it); its absence fails the test
/// rather than skipping the check.
fn run_capped(base: &Path, workflow: &Path) -> Output {
    Command::new("prlimit")
        .arg(CAP)
        .arg(env!("CARGO_BIN_EXE_sdkit"))
        .args(["run", "-q"])
        .arg(workflow)
        .arg("--base-dir")
        .arg(base)
        .output()
        .expect("prlimit (util-linux) runs sdkit")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The issue's EmptyLatentImage 16384×16384×64 → SaveLatent: a 4 GiB
/// latent that aborted in the allocator.
#[test]
fn huge_latent_is_a_node_error_under_a_memory_cap() {
    let base = tempfile::tempdir().expect("tempdir");
    let wf = base.path().join("latent.json");
    std::fs::write(
        &wf,
        r#"{"1": {"class_type": "EmptyLatentImage",
                  "inputs": {"width": 16384, "height": 16384, "batch_size": 64}},
            "2": {"class_type": "SaveLatent",
                  "inputs": {"samples": ["1", 0], "filename_prefix": "big"}}}"#,
    )
    .expect("write");
    let o = run_capped(base.path(), &wf);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("not enough memory") && err.contains("4.0 GiB"),
        "{err}"
    );
    assert!(!err.contains("memory allocation of"), "{err}");
}

/// A 20000×20000 PNG of about 50 KB (1.2 GB of RGB pixels, 6.4 GB as
/// tensors) through LoadImage: refused from its header.
#[test]
fn decompression_bomb_is_a_node_error_under_a_memory_cap() {
    let base = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(base.path().join("input")).expect("mkdir");
    png_bomb::write_bomb(&base.path().join("input/bomb.png"), 20000);
    let wf = base.path().join("load.json");
    std::fs::write(
        &wf,
        r#"{"1": {"class_type": "LoadImage", "inputs": {"image": "bomb.png"}},
            "2": {"class_type": "SaveImage",
                  "inputs": {"images": ["1", 0], "filename_prefix": "x"}}}"#,
    )
    .expect("write");
    let o = run_capped(base.path(), &wf);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("bomb.png") && err.contains("20000×20000") && err.contains("178956970"),
        "{err}"
    );
}
