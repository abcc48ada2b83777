//! A cluster on one machine: a real `redis-server` on a free loopback
//! port, one `sdkit serve --queue` API process and `sdkit worker`s on the
//! tiny SD1 checkpoint, driven over HTTP and WebSockets as API clients
//! drive ComfyUI. One worker is killed (SIGKILL) mid-prompt and restarted.
//!
//! Needs `redis-server` on PATH (Debian's redis-server package; `.ci/run`
//! installs it). Without it the test says so and passes, unless
//! `SDKIT_REQUIRE_REDIS` is set, as CI sets it: then it fails.

mod support;

use serde_json::{json, Value as Json};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use support::cluster::*;
use support::http::*;

/// Reads a client's messages until each of `ids` has ended (`executing`
/// with a null node); returns its messages about prompts and the number
/// of preview frames.
fn follow(mut ws: Ws, ids: HashSet<String>) -> (Vec<Json>, usize) {
    let mut ended = HashSet::new();
    let mut seen = Vec::new();
    let mut previews = 0;
    let deadline = Instant::now() + Duration::from_secs(240);
    while ended.len() < ids.len() {
        assert!(
            Instant::now() < deadline,
            "prompts did not end: {ended:?} of {ids:?}"
        );
        let m = match ws.read().expect("ws message") {
            tungstenite::Message::Text(t) => {
                serde_json::from_str::<Json>(t.as_str()).expect("json")
            }
            tungstenite::Message::Binary(_) => {
                previews += 1;
                continue;
            }
            tungstenite::Message::Close(_) => panic!("closed"),
            _ => continue,
        };
        let Some(id) = m["data"]["prompt_id"].as_str() else {
            continue;
        };
        if m["type"] == "executing" && m["data"]["node"].is_null() && ids.contains(id) {
            ended.insert(id.to_string());
        }
        seen.push(m);
    }
    (seen, previews)
}

#[test]
fn workers_share_a_queue_and_survive_a_killed_worker() {
    let base = tempfile::tempdir().expect("tempdir");
    let Some((_redis, port)) = start_redis(base.path()) else {
        return;
    };
    support::write_base_checkpoints(&base.path().join("models"));
    let queue = format!("redis://127.0.0.1:{port}/0");

    let (_api, addr) = api(&queue, base.path());

    let mut worker_a = Some(worker(&queue, base.path(), "wA"));
    let _worker_b = worker(&queue, base.path(), "wB");

    // Four clients queue six prompts each.
    let mut clients = Vec::new();
    let mut all: HashMap<String, usize> = HashMap::new();
    for c in 0..4 {
        let ws = ws_connect(&addr, &format!("client{c}"));
        let mut ids = HashSet::new();
        for i in 0..6 {
            let body = json!({
                "prompt": prompt("tiny_sd1_txt2img", 1000 + (c * 6 + i) as u64, &format!("c{c}/p{i}")),
                "client_id": format!("client{c}"),
            });
            let r = post_json(&addr, "/prompt", &body);
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let id = r.json()["prompt_id"].as_str().expect("id").to_string();
            all.insert(id.clone(), c);
            ids.insert(id);
        }
        clients.push(std::thread::spawn(move || {
            (c, ids.clone(), follow(ws, ids))
        }));
    }

    // Kill wA while it runs a prompt, then restart it under the same name.
    let deadline = Instant::now() + Duration::from_secs(120);
    let killed = loop {
        assert!(Instant::now() < deadline, "wA never ran a prompt");
        let running = redis(port, &["HGETALL", "sdkit:running"]);
        let pairs = running.list();
        let hit = pairs.chunks(2).find_map(|kv| {
            let rec: Json = serde_json::from_str(kv.get(1)?.str()?).ok()?;
            (rec["worker"] == "wA").then(|| kv[0].str().map(str::to_string))?
        });
        if let Some(id) = hit {
            break id;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(worker_a.take());
    let killed_at = now_ms();
    let restarted = worker(&queue, base.path(), "wA");

    for h in clients {
        let (c, ids, (seen, previews)) = h.join().expect("client thread");
        for m in &seen {
            let id = m["data"]["prompt_id"].as_str().unwrap_or_default();
            assert!(
                ids.contains(id),
                "client {c} was sent {}'s {} message",
                id,
                m["type"]
            );
        }
        let succeeded: HashSet<&str> = seen
            .iter()
            .filter(|m| m["type"] == "execution_success")
            .filter_map(|m| m["data"]["prompt_id"].as_str())
            .collect();
        assert_eq!(succeeded.len(), ids.len(), "client {c}: {succeeded:?}");
        assert!(previews > 0, "client {c} got no previews");
    }

    // Every prompt ended once, successfully, the killed one included.
    let history = get(&addr, "/history").json();
    let h = history.as_object().expect("history");
    assert_eq!(h.len(), 24, "{:?}", h.keys().collect::<Vec<_>>());
    for (id, entry) in h {
        assert!(all.contains_key(id), "unknown prompt {id} in the history");
        assert_eq!(entry["status"]["status_str"], "success", "{id}: {entry}");
        assert!(entry["outputs"]["8"]["images"].is_array(), "{id}: {entry}");
    }
    // The killed worker's prompt ran again once its claim went stale: 5 s
    // after its last keep-alive, which may precede the kill by a beat
    // (1.25 s) when the prompt ran long.
    let start = h[&killed]["status"]["messages"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m[0] == "execution_start"))
        .and_then(|m| m[1]["timestamp"].as_u64())
        .expect("the killed prompt's start");
    assert!(
        start >= killed_at + 3700,
        "prompt {killed} restarted {} ms after its worker was killed",
        start as i64 - killed_at as i64
    );
    let q = get(&addr, "/queue").json();
    assert_eq!(q["queue_running"], json!([]));
    assert_eq!(q["queue_pending"], json!([]));
    let jobs = get(&addr, "/api/jobs?status=completed&limit=100").json();
    assert_eq!(jobs["jobs"].as_array().map(Vec::len), Some(24), "{jobs}");

    // Every token is spent; nothing is left pending in the group.
    assert!(matches!(redis(port, &["XLEN", "sdkit:jobs"]), Resp::Int(0)));
    let pending = redis(port, &["XPENDING", "sdkit:jobs", "workers"]);
    assert!(
        matches!(pending.list().first(), Some(Resp::Int(0))),
        "{pending:?}"
    );

    // 24 distinct images, and no partial file: the restarted worker swept
    // what the killed one left mid-write.
    let files = files_under(&base.path().join("output"));
    let pngs: Vec<&PathBuf> = files
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "png"))
        .collect();
    assert_eq!(pngs.len(), 24, "{files:?}");
    assert_eq!(files.len(), 24, "stray files: {files:?}");
    let distinct: HashSet<Vec<u8>> = pngs
        .iter()
        .map(|p| std::fs::read(p).expect("read"))
        .collect();
    assert_eq!(distinct.len(), 24);

    // The restarted worker rejoined and ran prompts.
    let rec = redis(port, &["GET", "sdkit:worker:wA"]);
    let rec: Json = serde_json::from_str(rec.str().expect("wA's record")).expect("json");
    assert!(rec["jobs_done"].as_u64() > Some(0), "{rec}");
    drop(restarted);
}

/// The first message of `ws` about `prompt_id` of type `ty`.
fn wait_for(ws: &mut Ws, prompt_id: &str, ty: &str) -> Json {
    loop {
        let m = ws_next(ws);
        if m["type"] == ty && m["data"]["prompt_id"] == prompt_id {
            return m;
        }
    }
}

fn queue_prompt(addr: &str, body: Json) -> String {
    let r = post_json(addr, "/prompt", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["prompt_id"].as_str().expect("id").to_string()
}

/// Polls `f` until it holds (30 s at most: CI machines are loaded).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "{what} never happened");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn interrupts_deletes_and_free_reach_the_workers_through_any_api_process() {
    let base = tempfile::tempdir().expect("tempdir");
    let Some((redis_proc, port)) = start_redis(base.path()) else {
        return;
    };
    support::write_base_checkpoints(&base.path().join("models"));
    let queue = format!("redis://127.0.0.1:{port}");
    // Two API processes; the client talks to the second, prompts are
    // queued through the first.
    let (_api1, a1) = api(&queue, base.path());
    let (_api2, a2) = api(&queue, base.path());
    let _w = worker(&queue, base.path(), "solo");
    let mut ws = ws_connect(&a2, "c");

    let first = queue_prompt(&a1, json!({"prompt": slow(1), "client_id": "c"}));
    // Running before the others are queued (else `front` would rightly
    // put the third ahead of it).
    wait_for(&mut ws, &first, "executing");
    let second = queue_prompt(&a1, json!({"prompt": slow(2), "client_id": "c"}));
    let third = queue_prompt(
        &a1,
        json!({"prompt": small(3, "third"), "client_id": "c", "front": true}),
    );
    let q = get(&a2, "/queue").json();
    assert_eq!(q["queue_running"][0][1], first.as_str(), "{q}");
    // `front` puts the third before the second, across processes.
    assert_eq!(q["queue_pending"][0][1], third.as_str(), "{q}");
    assert_eq!(q["queue_pending"][1][1], second.as_str(), "{q}");
    let jobs = get(&a2, "/api/jobs?status=in_progress,pending").json();
    assert_eq!(jobs["jobs"].as_array().map(Vec::len), Some(3), "{jobs}");
    let running = get(&a1, &format!("/api/jobs/{first}")).json();
    assert_eq!(running["status"], "in_progress", "{running}");
    assert_eq!(
        get(&a2, "/prompt").json()["exec_info"]["queue_remaining"],
        3
    );

    // A prompt id already queued is refused.
    let dup = post_json(
        &a1,
        "/prompt",
        &json!({"prompt": small(4, "dup"), "prompt_id": second}),
    );
    assert_eq!(dup.status, 400, "{}", String::from_utf8_lossy(&dup.body));

    assert_eq!(
        post_json(&a2, "/queue", &json!({"delete": [second]})).status,
        200
    );
    let q = get(&a1, "/queue").json();
    assert_eq!(q["queue_pending"].as_array().map(Vec::len), Some(1), "{q}");

    // An interrupt of another prompt does nothing; of this one stops it.
    post_json(&a2, "/interrupt", &json!({"prompt_id": "not-running"}));
    assert_eq!(
        post_json(&a2, "/interrupt", &json!({"prompt_id": first})).status,
        200
    );
    wait_for(&mut ws, &first, "execution_interrupted");
    wait_for(&mut ws, &third, "execution_success");
    eventually("the history of both", || {
        get(&a1, "/history").json().as_object().map(|h| h.len()) == Some(2)
    });
    let h = get(&a1, "/history").json();
    assert_eq!(h[&first]["status"]["status_str"], "error", "{h}");
    assert_eq!(h[&third]["status"]["status_str"], "success", "{h}");
    assert_eq!(h[&third]["worker"], "solo", "{h}");
    assert!(h.get(&second).is_none(), "a deleted prompt ran: {h}");
    let done = get(&a2, "/api/jobs?status=cancelled").json();
    assert_eq!(done["jobs"][0]["id"], first.as_str(), "{done}");

    // `/free` reaches the worker: it forgets the checkpoint it holds.
    let sd1 = queue_prompt(
        &a1,
        json!({"prompt": prompt("tiny_sd1_txt2img", 7, "sd1"), "client_id": "c"}),
    );
    wait_for(&mut ws, &sd1, "execution_success");
    let record = || -> Json {
        let r = redis(port, &["GET", "sdkit:worker:solo"]);
        serde_json::from_str(r.str().unwrap_or("null")).unwrap_or(Json::Null)
    };
    eventually("the worker holding the checkpoint", || {
        record()["resident"] == json!(["checkpoints/tiny_sd1.safetensors"])
    });
    let stats = get(&a2, "/system_stats").json();
    assert_eq!(stats["devices"][0]["type"], "worker", "{stats}");
    assert!(
        stats["devices"][0]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("solo: ")),
        "{stats}"
    );
    assert_eq!(
        post_json(&a1, "/free", &json!({"unload_models": true})).status,
        200
    );
    eventually("the worker freeing its models", || {
        record()["resident"] == json!([])
    });

    // History edits are the cluster's.
    assert_eq!(
        post_json(&a2, "/history", &json!({"delete": [first]})).status,
        200
    );
    assert_eq!(
        get(&a1, "/history").json().as_object().map(|h| h.len()),
        Some(2)
    );
    assert_eq!(
        post_json(&a1, "/history", &json!({"clear": true})).status,
        200
    );
    assert_eq!(get(&a2, "/history").json(), json!({}));

    // Without Redis the queue routes say so (503), and the process lives.
    drop(redis_proc);
    let r = get(&a1, "/queue");
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    let r = post_json(&a1, "/prompt", &json!({"prompt": small(5, "x")}));
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(get(&a1, "/object_info/SaveImage").status, 200);

    // A Redis that restarts empty: API processes and the worker reconnect,
    // the worker recreates the job stream, and prompts flow again.
    let bin = redis_binary().expect("redis-server");
    // The same port, so the processes find it; retried while a lingering
    // socket of the old server holds it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let _redis_again = loop {
        if let Some(p) = redis_on(&bin, base.path(), port) {
            break p;
        }
        assert!(Instant::now() < deadline, "redis-server did not restart");
        std::thread::sleep(Duration::from_millis(200));
    };
    let mut again = None;
    eventually("the API reconnecting", || {
        let r = post_json(
            &a1,
            "/prompt",
            &json!({"prompt": small(6, "again"), "client_id": "c"}),
        );
        if r.status == 200 {
            again = r.json()["prompt_id"].as_str().map(str::to_string);
        }
        again.is_some()
    });
    wait_for(&mut ws, &again.expect("queued"), "execution_success");
}

#[test]
fn workers_keep_the_checkpoint_they_hold_and_tell_the_api_their_models() {
    let base = tempfile::tempdir().expect("tempdir");
    let Some((_redis, port)) = start_redis(base.path()) else {
        return;
    };
    support::write_base_checkpoints(&base.path().join("models"));
    let queue = format!("redis://127.0.0.1:{port}");
    // The API process has no models: it validates against the workers'.
    let api_base = tempfile::tempdir().expect("tempdir");
    let (_api, addr) = api(&queue, api_base.path());
    let _w1 = worker(&queue, base.path(), "w1");
    let _w2 = worker(&queue, base.path(), "w2");
    let info = get(&addr, "/object_info/CheckpointLoaderSimple").json();
    assert_eq!(
        info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0],
        json!(["tiny_sd1.safetensors", "tiny_sdxl.safetensors"]),
        "{info}"
    );
    // Alternating models: in queue order, each worker would switch at
    // every prompt.
    let mut ws = ws_connect(&addr, "c");
    let mut ids = Vec::new();
    for i in 0..12 {
        let graph = if i % 2 == 0 {
            "tiny_sd1_txt2img"
        } else {
            "tiny_sdxl_txt2img"
        };
        let body = json!({"prompt": prompt(graph, i, &format!("a{i}")), "client_id": "c"});
        ids.push((queue_prompt(&addr, body), graph));
    }
    follow_all(&mut ws, ids.iter().map(|(id, _)| id.clone()).collect());
    let h = get(&addr, "/history").json();
    let mut order: Vec<(u64, &str, &str)> = ids
        .iter()
        .map(|(id, graph)| {
            let e = &h[id];
            assert_eq!(e["status"]["status_str"], "success", "{e}");
            let start = e["status"]["messages"][0][1]["timestamp"]
                .as_u64()
                .unwrap_or(0);
            (start, e["worker"].as_str().unwrap_or("?"), *graph)
        })
        .collect();
    order.sort();
    for w in ["w1", "w2"] {
        let models: Vec<&str> = order.iter().filter(|o| o.1 == w).map(|o| o.2).collect();
        let switches = models.windows(2).filter(|p| p[0] != p[1]).count();
        // One switch at most: when a worker runs out of its own model's
        // prompts and helps with the other's.
        assert!(switches <= 1, "{w} ran {models:?}");
    }
}

#[test]
fn prompts_go_to_workers_that_have_their_models() {
    let base = tempfile::tempdir().expect("tempdir");
    let Some((_redis, port)) = start_redis(base.path()) else {
        return;
    };
    support::write_base_checkpoints(&base.path().join("models"));
    // A second worker with the SD1 checkpoint only.
    let partial = tempfile::tempdir().expect("tempdir");
    let ck = partial.path().join("models/checkpoints");
    std::fs::create_dir_all(&ck).expect("mkdir");
    std::fs::copy(
        base.path().join("models/checkpoints/tiny_sd1.safetensors"),
        ck.join("tiny_sd1.safetensors"),
    )
    .expect("copy");
    let queue = format!("redis://127.0.0.1:{port}");
    let (_api, addr) = api(&queue, partial.path());
    let _full = worker(&queue, base.path(), "full");
    let _sd1 = worker(&queue, partial.path(), "sd1only");
    let mut ws = ws_connect(&addr, "c");
    let mut ids = Vec::new();
    for i in 0..8 {
        let graph = if i % 2 == 0 {
            "tiny_sdxl_txt2img"
        } else {
            "tiny_sd1_txt2img"
        };
        let body = json!({"prompt": prompt(graph, i, &format!("m{i}")), "client_id": "c"});
        ids.push((queue_prompt(&addr, body), graph));
    }
    follow_all(&mut ws, ids.iter().map(|(id, _)| id.clone()).collect());
    let h = get(&addr, "/history").json();
    for (id, graph) in &ids {
        let e = &h[id];
        assert_eq!(e["status"]["status_str"], "success", "{graph}: {e}");
        if *graph == "tiny_sdxl_txt2img" {
            assert_eq!(e["worker"], "full", "{e}");
        }
    }
}

#[test]
fn outputs_and_uploads_go_through_the_object_store() {
    let base = tempfile::tempdir().expect("tempdir");
    let Some((_redis, port)) = start_redis(base.path()) else {
        return;
    };
    // Three disks and a store: nothing shared but Redis and the store.
    let (api_dir, w1_dir, w2_dir, store_dir) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    for d in [&w1_dir, &w2_dir] {
        support::write_base_checkpoints(&d.path().join("models"));
    }
    let queue = format!("redis://127.0.0.1:{port}");
    let store = format!("file://{}", store_dir.path().display());
    let (_api, addr) = serve_with(Some(&queue), api_dir.path(), &["--output-store", &store]);
    let _w1 = worker_with(&queue, w1_dir.path(), "w1", &["--output-store", &store]);
    let _w2 = worker_with(&queue, w2_dir.path(), "w2", &["--output-store", &store]);
    let mut ws = ws_connect(&addr, "c");

    // An upload reaches the workers through the store.
    let up = upload(&addr, &[("image", Some("pic.png"), &png([10, 200, 30]))]);
    assert_eq!(up.status, 200, "{}", String::from_utf8_lossy(&up.body));
    let load = json!({
        "1": {"class_type": "LoadImage", "inputs": {"image": "pic.png"}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "inv"}},
    });
    let inv = queue_prompt(&addr, json!({"prompt": load, "client_id": "c"}));

    // Every worker numbers "same" from its own empty folder: the store
    // keeps each image under a name of its own.
    let mut ids = vec![inv.clone()];
    for i in 0..6 {
        let body = json!({"prompt": prompt("tiny_sd1_txt2img", i, "same"), "client_id": "c"});
        ids.push(queue_prompt(&addr, body));
    }
    let mut executed: HashMap<String, String> = HashMap::new();
    let mut pending: HashSet<String> = ids.iter().cloned().collect();
    while !pending.is_empty() {
        let m = ws_next(&mut ws);
        let id = m["data"]["prompt_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if m["type"] == "executed" {
            let f = &m["data"]["output"]["images"][0];
            // What the client hears of can be viewed at once.
            let view = get(
                &addr,
                &format!(
                    "/view?filename={}&type=output&subfolder=",
                    f["filename"].as_str().unwrap_or("")
                ),
            );
            assert_eq!(view.status, 200, "{m}");
            executed.insert(id.clone(), f["filename"].as_str().unwrap_or("").to_string());
        }
        if m["type"] == "executing" && m["data"]["node"].is_null() {
            pending.remove(&id);
        }
    }
    let h = get(&addr, "/history").json();
    let mut names = HashSet::new();
    let mut images = HashSet::new();
    for id in &ids {
        let e = &h[id];
        assert_eq!(e["status"]["status_str"], "success", "{e}");
        let name = e["outputs"]["3"]["images"][0]["filename"]
            .as_str()
            .or(e["outputs"]["8"]["images"][0]["filename"].as_str())
            .expect("an image")
            .to_string();
        assert_eq!(executed.get(id), Some(&name), "history and message differ");
        let view = get(&addr, &format!("/view?filename={name}&type=output"));
        assert_eq!(view.status, 200);
        names.insert(name);
        images.insert(view.body);
    }
    let workers: HashSet<&str> = ids
        .iter()
        .filter_map(|id| h[id]["worker"].as_str())
        .collect();
    assert_eq!(
        workers.len(),
        2,
        "one worker ran everything: no clash was tried"
    );
    assert_eq!(names.len(), 7, "{names:?}");
    assert_eq!(images.len(), 7, "two prompts share an image");
    // The inverted upload: 255 - (10, 200, 30), truncated after the float
    // round trip as ComfyUI's SaveImage does.
    let inv_name = h[&inv]["outputs"]["3"]["images"][0]["filename"]
        .as_str()
        .expect("name");
    let got = image::load_from_memory(&get(&addr, &format!("/view?filename={inv_name}")).body)
        .expect("png")
        .to_rgb8();
    assert_eq!(got.get_pixel(0, 0).0, [245, 54, 225]);
    assert!(store_dir.path().join("input/pic.png").is_file());
}

#[test]
fn the_queue_runs_over_tls_and_checks_the_server_certificate() {
    let base = tempfile::tempdir().expect("tempdir");
    let Some((_redis, port, ca)) = start_redis_tls(base.path(), "s3cret") else {
        return;
    };
    let queue = format!("rediss://:s3cret@127.0.0.1:{port}");
    let worker_args: Vec<String> = ["worker", "--queue", &queue, "--name", "tls"]
        .iter()
        .map(|s| s.to_string())
        .chain(common(base.path()))
        .collect();

    // A server whose certificate nothing trusts is refused, and the
    // message keeps the password out.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args(&worker_args)
        .env_remove("SSL_CERT_FILE")
        .env_remove("SSL_CERT_DIR")
        .output()
        .expect("sdkit runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "connected to an untrusted server");
    assert!(err.contains("cannot connect"), "{err}");
    assert!(!err.contains("s3cret"), "{err}");

    // Trusting the private CA (as a deployment would with its own), the
    // API and a worker talk TLS, authenticated, and a prompt runs.
    let trust = [("SSL_CERT_FILE", ca.as_path())];
    let mut serve_args: Vec<String> = ["serve", "--port", "0", "--queue", &queue]
        .iter()
        .map(|s| s.to_string())
        .collect();
    serve_args.extend(common(base.path()));
    let (_api, line) = sdkit_env(&serve_args, &trust);
    let a = listening_addr(&line);
    let (_w, line) = sdkit_env(&worker_args, &trust);
    assert!(
        line.contains(&format!("connected to rediss://:***@127.0.0.1:{port}")),
        "{line}"
    );
    let mut ws = ws_connect(&a, "c");
    let id = queue_prompt(&a, json!({"prompt": small(7, "tls"), "client_id": "c"}));
    let msgs = ws_until_done(&mut ws, &id);
    assert!(msgs.iter().any(|m| m["type"] == "executed"), "{msgs:?}");
    let h = get(&a, &format!("/history/{id}")).json();
    assert_eq!(h[&id]["status"]["status_str"], "success", "{h}");
    assert_eq!(h[&id]["worker"], "tls", "{h}");
}
