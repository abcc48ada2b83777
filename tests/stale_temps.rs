//! A process killed mid-write leaves its pid-named temporary files
//! (`.sdkit-{pid}-….tmp`); `run`, `watch` and `serve` remove those of dead
//! writers at start, in every folder they write to, and nothing else.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

/// A pid that belonged to a process which has exited.
fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().expect("spawn true");
    let pid = child.id();
    child.wait().expect("wait");
    pid
}

struct Layout {
    base: tempfile::TempDir,
    cache: tempfile::TempDir,
    stale: Vec<PathBuf>,
    kept: Vec<PathBuf>,
}

fn write(path: &Path) -> PathBuf {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("mkdir");
    }
    std::fs::write(path, b"partial").expect("write");
    path.to_path_buf()
}

/// Temporary files of a dead writer in output/ (nested too), temp/,
/// input/, user/ and the cache folder; and files that must survive: the
/// same names with this test's (live) pid, a pid-less legacy name written
/// just now, and ordinary files that merely look similar.
fn layout() -> Layout {
    let base = tempfile::tempdir().expect("tempdir");
    let cache = tempfile::tempdir().expect("tempdir");
    let b = base.path();
    std::fs::create_dir_all(b.join("input")).expect("mkdir");
    std::fs::copy(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("graphs/input/example.png"),
        b.join("input/example.png"),
    )
    .expect("copy");
    let dead = dead_pid();
    let live = std::process::id();
    let mut stale = Vec::new();
    let mut kept = Vec::new();
    for dir in [
        b.join("output"),
        b.join("output/a/b"),
        b.join("temp"),
        b.join("input"),
        b.join("user/default/workflows"),
        cache.path().to_path_buf(),
    ] {
        stale.push(write(&dir.join(format!(".sdkit-{dead}-0-save-0.png.tmp"))));
        kept.push(write(&dir.join(format!(".sdkit-{live}-0-save-0.png.tmp"))));
    }
    // An older version's name without a pid, written just now: its writer
    // may still be running, so it stays until it is an hour old.
    kept.push(write(&b.join("output/.sdkit-weights-AbC123.tmp")));
    let old = write(&b.join("output/.sdkit-weights-Old999.tmp"));
    std::fs::File::options()
        .write(true)
        .open(&old)
        .and_then(|f| f.set_modified(SystemTime::now() - Duration::from_secs(7200)))
        .expect("backdate");
    stale.push(old);
    for other in [
        format!("output/sdkit-{dead}-0-x.tmp"),
        format!("output/.sdkit-{dead}-0-x.png"),
        format!("output/.x.{dead}.0.tmp"),
        "output/comfy.settings.json.tmp".to_string(),
    ] {
        kept.push(write(&b.join(other)));
    }
    Layout {
        base,
        cache,
        stale,
        kept,
    }
}

/// Checks that every stale file is gone, except those under `except` (a
/// folder the command does not sweep), and that every other file is kept.
fn check(l: &Layout, except: Option<&Path>, stderr: &str) {
    for p in l
        .stale
        .iter()
        .filter(|p| except.is_none_or(|e| !p.starts_with(e)))
    {
        assert!(
            !p.exists(),
            "stale {} was kept; stderr:\n{stderr}",
            p.display()
        );
    }
    for p in &l.kept {
        assert!(p.exists(), "{} was removed; stderr:\n{stderr}", p.display());
    }
}

#[test]
fn run_removes_the_temporary_files_of_dead_writers_only() {
    let l = layout();
    let out = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args(["run", "-q"])
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("graphs/image_pipeline.ron"))
        .arg("--base-dir")
        .arg(l.base.path())
        .env("SDKIT_CACHE_DIR", l.cache.path())
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    // The user folder is the server's; `run` leaves it alone.
    check(&l, Some(&l.base.path().join("user")), &stderr);
    assert!(stderr.contains("removed 6 temporary files"), "{stderr}");
}

#[test]
fn serve_removes_them_before_it_listens() {
    let l = layout();
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
        .arg(l.base.path())
        .env("SDKIT_CACHE_DIR", l.cache.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts");
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        BufReader::new(out).read_line(&mut line).expect("line");
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.contains("listening"), "{line}");
    check(&l, None, "");
}

#[test]
fn watch_removes_them_before_the_first_run() {
    let l = layout();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args(["watch", "-q", "--events", "-"])
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("graphs/image_pipeline.ron"))
        .arg("--base-dir")
        .arg(l.base.path())
        .env("SDKIT_CACHE_DIR", l.cache.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts");
    // The first event line means the run started, after the sweep.
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        BufReader::new(out).read_line(&mut line).expect("line");
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(!line.is_empty());
    check(&l, Some(&l.base.path().join("user")), "");
}
