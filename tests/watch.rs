//! `sdkit watch`: re-runs on save (including temp-file + rename saves),
//! executes only the changed node and its descendants, and survives a
//! broken save.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const WORKFLOW: &str = r#"(nodes: {
    "load": LoadImage(image: "example.png"),
    "scale": ImageScale(image: ("load", 0), upscale_method: "area", width: WIDTH, height: 0, crop: "disabled"),
    "inv": ImageInvert(image: ("scale", 0)),
    "mask": MaskToImage(mask: ("load", "MASK")),
    "save": SaveImage(images: ("inv", 0), filename_prefix: "w"),
    "save_mask": SaveImage(images: ("mask", 0), filename_prefix: "m"),
})"#;

struct Watch {
    child: Child,
    events: mpsc::Receiver<serde_json::Value>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Watch {
    /// Collects events up to the next end of a run (success or failure).
    fn next_run(&self) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut out = Vec::new();
        while Instant::now() < deadline {
            match self.events.recv_timeout(Duration::from_millis(200)) {
                Ok(e) => {
                    let t = e["type"].as_str().unwrap_or("").to_string();
                    out.push(e);
                    if t == "execution_success" || t == "execution_error" {
                        return out;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => panic!("sdkit watch exited"),
            }
        }
        panic!("no run finished in time; got {out:?}");
    }
}

fn executed(events: &[serde_json::Value]) -> Vec<String> {
    let mut v: Vec<String> = events
        .iter()
        .filter(|e| e["type"] == "executing" && e["data"]["node"].is_string())
        .map(|e| e["data"]["node"].as_str().unwrap_or("").to_string())
        .collect();
    v.sort();
    v
}

/// Saves like an editor: write a temporary file, rename it over the target.
fn save_via_rename(path: &Path, text: &str) {
    let tmp = path.with_extension("ron.swp");
    std::fs::write(&tmp, text).expect("write temp");
    std::fs::rename(&tmp, path).expect("rename");
}

fn start(base: &Path, file: &PathBuf) -> Watch {
    start_with(base, file, &[])
}

fn start_with(base: &Path, file: &PathBuf, extra: &[&str]) -> Watch {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args(["watch", "-q", "--events", "-"])
        .args(extra)
        .arg(file)
        .arg("--base-dir")
        .arg(base)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Ok(v) = serde_json::from_str(&line) {
                if tx.send(v).is_err() {
                    break;
                }
            }
        }
    });
    Watch { child, events: rx }
}

/// A base folder whose input/ holds the example image the workflow loads.
fn base_with_example() -> tempfile::TempDir {
    let base = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(base.path().join("input")).expect("mkdir");
    std::fs::copy(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("graphs/input/example.png"),
        base.path().join("input/example.png"),
    )
    .expect("copy");
    base
}

#[test]
fn watch_reruns_only_what_changed() {
    let base = base_with_example();
    let file = base.path().join("wf.ron");
    std::fs::write(&file, WORKFLOW.replace("WIDTH", "32")).expect("write");
    let w = start(base.path(), &file);
    let first = w.next_run();
    assert_eq!(
        executed(&first),
        ["inv", "load", "mask", "save", "save_mask", "scale"]
    );
    // Give the watcher a moment to be registered before the first edit
    // (it is, by the time the first run ends, but be generous on slow CI).
    std::thread::sleep(Duration::from_millis(300));

    save_via_rename(&file, &WORKFLOW.replace("WIDTH", "16"));
    let second = w.next_run();
    assert_eq!(executed(&second), ["inv", "save", "scale"]);
    let cached = second
        .iter()
        .find(|e| e["type"] == "execution_cached")
        .expect("cached event");
    let mut cached: Vec<String> = cached["data"]["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|v| v.as_str().unwrap_or("").to_string())
        .collect();
    cached.sort();
    assert_eq!(cached, ["load", "mask", "save_mask"]);

    // A broken save prints diagnostics and keeps watching.
    std::fs::write(&file, "(nodes: { \"load\": LoadImage(image: ").expect("write");
    std::thread::sleep(Duration::from_millis(800));
    std::fs::write(&file, WORKFLOW.replace("WIDTH", "8")).expect("write");
    let third = w.next_run();
    assert_eq!(executed(&third), ["inv", "save", "scale"]);
    let out = base.path().join("output");
    assert!(out.join("w_00003_.png").exists());
    assert!(!out.join("m_00002_.png").exists());
}

#[test]
fn free_after_run_drops_the_cache_between_runs() {
    let base = base_with_example();
    let file = base.path().join("wf.ron");
    std::fs::write(&file, WORKFLOW.replace("WIDTH", "32")).expect("write");
    let w = start_with(base.path(), &file, &["--free-after-run"]);
    let all = ["inv", "load", "mask", "save", "save_mask", "scale"];
    assert_eq!(executed(&w.next_run()), all);
    std::thread::sleep(Duration::from_millis(300));
    // Nothing was kept: the edit runs every node again.
    save_via_rename(&file, &WORKFLOW.replace("WIDTH", "16"));
    let second = w.next_run();
    assert_eq!(executed(&second), all);
    assert!(second
        .iter()
        .filter(|e| e["type"] == "execution_cached")
        .all(|e| e["data"]["nodes"].as_array().is_some_and(Vec::is_empty)));
}

/// `watch links/a.ron` where `a.ron → b.ron → ../real/wf.ron`: edits of
/// the real file (written in place or saved by rename) re-run, and so does
/// pointing a link elsewhere, after which the new target is watched.
#[cfg(unix)]
#[test]
fn watch_follows_a_chain_of_links_to_the_real_file() {
    use std::os::unix::fs::symlink;
    let base = base_with_example();
    let mkdir = |d: &str| {
        let p = base.path().join(d);
        std::fs::create_dir_all(&p).expect("mkdir");
        p
    };
    let (real, other, links) = (mkdir("real"), mkdir("other"), mkdir("links"));
    std::fs::write(real.join("wf.ron"), WORKFLOW.replace("WIDTH", "32")).expect("write");
    symlink("../real/wf.ron", links.join("b.ron")).expect("link");
    symlink("b.ron", links.join("a.ron")).expect("link");
    let w = start(base.path(), &links.join("a.ron"));
    assert_eq!(
        executed(&w.next_run()),
        ["inv", "load", "mask", "save", "save_mask", "scale"]
    );
    std::thread::sleep(Duration::from_millis(300));

    std::fs::write(real.join("wf.ron"), WORKFLOW.replace("WIDTH", "16")).expect("write");
    assert_eq!(executed(&w.next_run()), ["inv", "save", "scale"]);

    save_via_rename(&real.join("wf.ron"), &WORKFLOW.replace("WIDTH", "8"));
    assert_eq!(executed(&w.next_run()), ["inv", "save", "scale"]);

    // Point the middle link at a file in a folder not watched so far.
    std::fs::write(other.join("wf.ron"), WORKFLOW.replace("WIDTH", "4")).expect("write");
    std::fs::remove_file(links.join("b.ron")).expect("unlink");
    symlink("../other/wf.ron", links.join("b.ron")).expect("link");
    assert_eq!(executed(&w.next_run()), ["inv", "save", "scale"]);
    std::thread::sleep(Duration::from_millis(300));
    save_via_rename(&other.join("wf.ron"), &WORKFLOW.replace("WIDTH", "2"));
    assert_eq!(executed(&w.next_run()), ["inv", "save", "scale"]);
}
