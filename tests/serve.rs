//! `sdkit serve` driven as ComfyUI's API clients drive ComfyUI: real HTTP
//! requests and a real WebSocket client against a running server process,
//! with weightless workflows (image nodes only).

mod support;

use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::http::*;

struct Server {
    child: Child,
    addr: String,
    base: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(extra: &[&str]) -> Server {
    let base = tempfile::tempdir().expect("tempdir");
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
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("line");
    let addr = listening_addr(&line);
    Server { child, addr, base }
}

#[test]
fn api_client_round_trip() {
    let s = start(&[]);
    let a = &s.addr;
    // Node registry, under both prefixes.
    let info = get(a, "/object_info").json();
    assert!(info["KSampler"]["input"]["required"]["seed"].is_array());
    let one = get(a, "/api/object_info/SaveImage").json();
    assert_eq!(one["SaveImage"]["output_node"], true);
    assert_eq!(get(a, "/api/object_info/NoSuchNode").json(), json!({}));

    let mut ws = ws_connect(a, "client-1");
    let hello = ws_next(&mut ws);
    assert_eq!(hello["type"], "status");
    assert_eq!(hello["data"]["sid"], "client-1");
    assert_eq!(hello["data"]["status"]["exec_info"]["queue_remaining"], 0);

    let r = post_json(
        a,
        "/prompt",
        &json!({"prompt": small(0x336699, "api"), "client_id": "client-1"}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let r = r.json();
    let id = r["prompt_id"].as_str().expect("prompt_id").to_string();
    assert_eq!(r["number"], 0);
    assert_eq!(r["node_errors"], json!({}));

    let msgs = ws_until_done(&mut ws, &id);
    let types: Vec<&str> = msgs.iter().filter_map(|m| m["type"].as_str()).collect();
    assert_eq!(types.first(), Some(&"execution_start"), "{types:?}");
    let pos = |t: &str| types.iter().position(|x| *x == t);
    let executed = pos("executed").expect("executed");
    let success = pos("execution_success").expect("success");
    assert!(executed < success && success < types.len(), "{types:?}");
    let out = &msgs[executed]["data"];
    assert_eq!(out["node"], "3");
    let img = &out["output"]["images"][0];
    assert_eq!(img["type"], "output");

    // History has the prompt, its outputs and status messages.
    let h = get(a, &format!("/history/{id}")).json();
    let entry = &h[&id];
    assert_eq!(entry["status"]["status_str"], "success");
    assert_eq!(entry["status"]["completed"], true);
    assert_eq!(entry["prompt"][1], id.as_str());
    assert_eq!(entry["prompt"][4], json!(["3"]));
    assert_eq!(entry["outputs"]["3"]["images"][0], *img);
    let names: Vec<&str> = entry["status"]["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|m| m[0].as_str())
        .collect();
    assert_eq!(names.first(), Some(&"execution_start"));
    assert_eq!(names.last(), Some(&"execution_success"));
    assert!(get(a, "/history?max_items=1").json().get(&id).is_some());

    // The image through /view, as saved.
    let file = img["filename"].as_str().expect("filename");
    let v = get(a, &format!("/view?filename={file}&type=output&subfolder="));
    assert_eq!(v.status, 200);
    assert!(v
        .headers
        .to_ascii_lowercase()
        .contains("content-type: image/png"));
    let decoded = image::load_from_memory(&v.body).expect("png").to_rgb8();
    assert_eq!(decoded.dimensions(), (32, 24));
    // 0x336699 inverted in float and truncated to 8 bits, as ComfyUI
    // saves it: 1 − 153/255 = 0.4 → 101.99… → 101.
    assert_eq!(decoded.get_pixel(0, 0).0, [204, 153, 101]);
    let rgb = get(a, &format!("/view?filename={file}&channel=rgb"));
    assert_eq!(rgb.status, 200);
    let jpeg = get(a, &format!("/api/view?filename={file}&preview=jpeg;80"));
    assert!(jpeg.headers.to_ascii_lowercase().contains("image/jpeg"));

    // Re-queueing the same prompt is served from the cache.
    let r = post_json(
        a,
        "/api/prompt",
        &json!({"prompt": small(0x336699, "api"), "client_id": "client-1"}),
    )
    .json();
    let id2 = r["prompt_id"].as_str().expect("id").to_string();
    let msgs = ws_until_done(&mut ws, &id2);
    let cached = msgs
        .iter()
        .find(|m| m["type"] == "execution_cached")
        .expect("cached message");
    assert!(cached["data"]["nodes"]
        .as_array()
        .is_some_and(|n| n.len() >= 2));

    // The jobs API newer front ends read: newest first, flat records with
    // the first output, pages, and the detail with outputs and workflow.
    let jobs = get(
        a,
        "/api/jobs?status=completed,failed,cancelled&limit=10&offset=0",
    )
    .json();
    assert_eq!(
        jobs["pagination"],
        json!({"offset": 0, "limit": 10, "total": 2, "has_more": false})
    );
    let newest = &jobs["jobs"][0];
    assert_eq!(newest["id"], id2.as_str());
    assert_eq!(newest["status"], "completed");
    assert_eq!(newest["outputs_count"], 1);
    assert_eq!(newest["preview_output"]["nodeId"], "3");
    assert_eq!(newest["preview_output"]["mediaType"], "images");
    assert_eq!(newest["preview_output"]["filename"], img["filename"]);
    assert!(newest["create_time"].as_u64().is_some_and(|t| t > 0));
    assert!(newest["execution_end_time"].as_u64() >= newest["execution_start_time"].as_u64());
    assert!(
        newest.get("outputs").is_none(),
        "list records carry no outputs"
    );
    let page = get(a, "/api/jobs?limit=1&offset=1&sort_order=asc").json();
    assert_eq!(page["jobs"][0]["id"], id2.as_str());
    assert_eq!(page["pagination"]["has_more"], false);
    assert_eq!(
        get(a, "/api/jobs?limit=1").json()["pagination"]["has_more"],
        true
    );
    let detail = get(a, &format!("/api/jobs/{id}")).json();
    assert_eq!(detail["outputs"]["3"]["images"][0], *img);
    assert_eq!(detail["workflow"]["prompt"]["3"]["class_type"], "SaveImage");
    assert_eq!(detail["execution_status"]["status_str"], "success");
    assert_eq!(
        get(a, "/api/jobs?status=pending,in_progress").json()["jobs"],
        json!([])
    );
    assert_eq!(get(a, "/api/jobs/no-such-job").status, 404);
    let bad = get(a, "/api/jobs?status=done");
    assert_eq!(bad.status, 400);
    assert!(bad.json()["error"]
        .as_str()
        .is_some_and(|e| e.contains("done")));
    assert_eq!(get(a, "/api/jobs?limit=-1").status, 400);

    // Queue and prompt info while idle.
    assert_eq!(get(a, "/prompt").json()["exec_info"]["queue_remaining"], 0);
    let q = get(a, "/queue").json();
    assert_eq!(q["queue_running"], json!([]));
    assert_eq!(q["queue_pending"], json!([]));

    // History deletion and clearing.
    assert_eq!(
        post_json(a, "/history", &json!({"delete": [id]})).status,
        200
    );
    assert_eq!(get(a, &format!("/history/{id}")).json(), json!({}));
    post_json(a, "/history", &json!({"clear": true}));
    assert_eq!(get(a, "/history").json(), json!({}));
}

#[test]
fn invalid_workflows_get_comfyui_error_shape() {
    let s = start(&[]);
    let a = &s.addr;
    // A value out of range on one node and a missing input on another.
    let mut p = small(0, "bad");
    p["1"]["inputs"]["width"] = json!(0);
    p["3"]["inputs"]
        .as_object_mut()
        .expect("inputs")
        .remove("filename_prefix");
    let r = post_json(a, "/prompt", &json!({"prompt": p}));
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["type"], "prompt_outputs_failed_validation");
    assert_eq!(e["error"]["message"], "Prompt outputs failed validation");
    let n1 = &e["node_errors"]["1"];
    assert_eq!(n1["class_type"], "EmptyImage");
    assert_eq!(n1["errors"][0]["type"], "value_smaller_than_min");
    assert_eq!(n1["errors"][0]["extra_info"]["input_name"], "width");
    assert_eq!(n1["dependent_outputs"], json!(["3"]));
    assert_eq!(
        e["node_errors"]["3"]["errors"][0]["type"],
        "required_input_missing"
    );
    assert!(e["node_errors"].get("2").is_none());

    // Unknown node type, no prompt, no outputs, malformed JSON.
    let mut p = small(0, "bad");
    p["2"]["class_type"] = json!("NoSuchNode");
    let e = post_json(a, "/prompt", &json!({"prompt": p})).json();
    assert_eq!(e["error"]["type"], "invalid_prompt");
    let e = post_json(a, "/prompt", &json!({"nothing": 1}));
    assert_eq!(e.status, 400);
    assert_eq!(e.json()["error"]["type"], "no_prompt");
    let e = post_json(
        a,
        "/prompt",
        &json!({"prompt": {"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}}}}),
    );
    assert_eq!(e.json()["error"]["type"], "prompt_no_outputs");
    let r = http(
        a,
        "POST",
        "/prompt",
        &[("Content-Type", "application/json")],
        b"{\"prompt\": ",
    );
    assert_eq!(r.status, 400);
    assert!(String::from_utf8_lossy(&r.body).contains("invalid JSON"));
    // Nothing was queued by any of these.
    assert_eq!(get(a, "/queue").json()["queue_pending"], json!([]));
}

#[test]
fn interrupt_and_queue_deletion() {
    let s = start(&[]);
    let a = &s.addr;
    let mut ws = ws_connect(a, "c");
    let first = post_json(a, "/prompt", &json!({"prompt": slow(1), "client_id": "c"})).json();
    let first = first["prompt_id"].as_str().expect("id").to_string();
    let second = post_json(a, "/prompt", &json!({"prompt": slow(2), "client_id": "c"})).json();
    let second = second["prompt_id"].as_str().expect("id").to_string();
    let third = post_json(
        a,
        "/prompt",
        &json!({"prompt": small(3, "third"), "client_id": "c", "front": true}),
    )
    .json();
    let third = third["prompt_id"].as_str().expect("id").to_string();
    // Wait for the first to be running.
    loop {
        let m = ws_next(&mut ws);
        if m["type"] == "executing" && m["data"]["prompt_id"] == first.as_str() {
            break;
        }
    }
    let q = get(a, "/queue").json();
    assert_eq!(q["queue_running"][0][1], first.as_str());
    // `front` puts the third before the second.
    assert_eq!(q["queue_pending"][0][1], third.as_str());
    assert_eq!(q["queue_pending"][1][1], second.as_str());
    // The same through the jobs API.
    let queued = get(a, "/api/jobs?status=in_progress,pending").json();
    let state = |id: &str| {
        queued["jobs"]
            .as_array()
            .and_then(|j| j.iter().find(|x| x["id"] == id))
            .map(|x| x["status"].clone())
    };
    assert_eq!(state(&first), Some(json!("in_progress")));
    assert_eq!(state(&second), Some(json!("pending")));
    assert_eq!(state(&third), Some(json!("pending")));
    let running = get(a, &format!("/api/jobs/{first}")).json();
    assert!(running["execution_start_time"].as_u64().is_some());
    assert_eq!(
        running["workflow"]["prompt"]["99"]["class_type"],
        "SaveImage"
    );
    assert_eq!(
        post_json(a, "/queue", &json!({"delete": [second]})).status,
        200
    );
    let q = get(a, "/queue").json();
    assert_eq!(q["queue_pending"].as_array().map(Vec::len), Some(1));

    // A targeted interrupt of another prompt does nothing; of this one stops it.
    post_json(a, "/interrupt", &json!({"prompt_id": "not-running"}));
    assert_eq!(
        post_json(a, "/interrupt", &json!({"prompt_id": first})).status,
        200
    );
    let msgs = ws_until_done(&mut ws, &first);
    assert!(
        msgs.iter().any(|m| m["type"] == "execution_interrupted"),
        "{msgs:?}"
    );
    let h = get(a, &format!("/history/{first}")).json();
    assert_eq!(h[&first]["status"]["status_str"], "error");
    assert_eq!(
        get(a, &format!("/api/jobs/{first}")).json()["status"],
        "cancelled"
    );
    // The queue goes on with the next prompt.
    let msgs = ws_until_done(&mut ws, &third);
    assert!(msgs.iter().any(|m| m["type"] == "execution_success"));
    assert_eq!(get(a, &format!("/history/{second}")).json(), json!({}));
    // /free answers and the server keeps working.
    assert_eq!(
        post_json(
            a,
            "/free",
            &json!({"unload_models": true, "free_memory": true})
        )
        .status,
        200
    );
    let r = post_json(
        a,
        "/prompt",
        &json!({"prompt": small(4, "after"), "client_id": "c"}),
    )
    .json();
    let id = r["prompt_id"].as_str().expect("id").to_string();
    let msgs = ws_until_done(&mut ws, &id);
    assert!(msgs.iter().any(|m| m["type"] == "execution_success"));
}

#[test]
fn uploads_rename_on_clash_and_files_stay_in_their_folders() {
    let s = start(&[]);
    let a = &s.addr;
    let (red, blue) = (png([255, 0, 0]), png([0, 0, 255]));
    let r = upload(a, &[("image", Some("pic.png"), &red)]).json();
    assert_eq!(
        r,
        json!({"name": "pic.png", "subfolder": "", "type": "input"})
    );
    // Same bytes: the same file; other bytes: "pic (1).png".
    assert_eq!(
        upload(a, &[("image", Some("pic.png"), &red)]).json()["name"],
        "pic.png"
    );
    assert_eq!(
        upload(a, &[("image", Some("pic.png"), &blue)]).json()["name"],
        "pic (1).png"
    );
    assert_eq!(
        upload(
            a,
            &[
                ("image", Some("pic.png"), &blue),
                ("overwrite", None, b"true")
            ]
        )
        .json()["name"],
        "pic.png"
    );
    let r = upload(
        a,
        &[
            ("image", Some("s.png"), &red),
            ("subfolder", None, b"sub/dir"),
        ],
    )
    .json();
    assert_eq!(r["subfolder"], "sub/dir");
    assert!(s.base.path().join("input/sub/dir/s.png").is_file());
    // The upload is visible to LoadImage's combo.
    let info = get(a, "/object_info/LoadImage").json();
    let opts = info["LoadImage"]["input"]["required"]["image"][0].to_string();
    assert!(opts.contains("pic (1).png"), "{opts}");

    // Traversal attempts.
    assert_eq!(
        upload(a, &[("image", Some("../evil.png"), &red)]).status,
        400
    );
    assert_eq!(
        upload(
            a,
            &[
                ("image", Some("x.png"), &red),
                ("subfolder", None, b"../..")
            ]
        )
        .status,
        400
    );
    assert_eq!(
        upload(
            a,
            &[("image", Some("x.png"), &red), ("subfolder", None, b"/tmp")]
        )
        .status,
        400
    );
    assert_eq!(upload(a, &[("other", None, b"x")]).status, 400);
    let r = http(
        a,
        "POST",
        "/upload/image",
        &[("Content-Type", "multipart/form-data; boundary=zz")],
        b"--zz\r\ngarbage",
    );
    assert_eq!(r.status, 400);
    std::fs::write(s.base.path().join("secret.txt"), "secret").expect("write");
    for path in [
        "/view?filename=../secret.txt&type=input",
        "/view?filename=%2e%2e%2fsecret.txt&type=input",
        "/view?filename=..%2Fsecret.txt",
        "/view?filename=/etc/passwd",
        "/view?filename=secret.txt&type=bogus",
    ] {
        assert_eq!(get(a, path).status, 400, "{path}");
    }
    assert_eq!(
        get(a, "/view?filename=secret.txt&type=input&subfolder=..").status,
        403
    );
    assert_eq!(
        get(a, "/view?filename=secret.txt&type=input&subfolder=%2E%2E").status,
        403
    );
    assert_eq!(get(a, "/view?filename=pic.png&type=input").status, 200);
    assert_eq!(get(a, "/view?filename=missing.png&type=input").status, 404);
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(s.base.path(), s.base.path().join("input/link"))
            .expect("symlink");
        assert_eq!(
            get(a, "/view?filename=secret.txt&type=input&subfolder=link").status,
            403
        );
    }

    // User data: write, read, list, move, delete, confined.
    let r = http(a, "POST", "/userdata/workflows%2Fa.json", &[], b"{\"x\":1}");
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!("workflows/a.json"));
    assert_eq!(get(a, "/userdata/workflows%2Fa.json").body, b"{\"x\":1}");
    assert_eq!(get(a, "/userdata?dir=workflows").json(), json!(["a.json"]));
    let r = http(
        a,
        "POST",
        "/userdata/workflows%2Fa.json?overwrite=false",
        &[],
        b"{}",
    );
    assert_eq!(r.status, 409);
    let r = http(
        a,
        "POST",
        "/userdata/workflows%2Fa.json/move/workflows%2Fb.json",
        &[],
        b"",
    );
    assert_eq!(r.json(), json!("workflows/b.json"));
    assert_eq!(
        http(a, "DELETE", "/userdata/workflows%2Fb.json", &[], b"").status,
        204
    );
    assert_eq!(get(a, "/userdata/workflows%2Fb.json").status, 404);
    assert_eq!(
        http(a, "POST", "/userdata/..%2F..%2Fescape.json", &[], b"x").status,
        403
    );
    assert_eq!(get(a, "/userdata/%2Fetc%2Fpasswd").status, 403);
    assert_eq!(get(a, "/userdata?dir=..").status, 403);
    assert!(!s.base.path().join("escape.json").exists());

    // Settings persist.
    assert_eq!(
        post_json(a, "/settings", &json!({"Comfy.Locale": "en"})).status,
        200
    );
    assert_eq!(post_json(a, "/settings/Comfy.Foo", &json!(3)).status, 200);
    assert_eq!(
        get(a, "/settings").json(),
        json!({"Comfy.Locale": "en", "Comfy.Foo": 3})
    );
    assert_eq!(get(a, "/api/settings/Comfy.Foo").json(), json!(3));
}

#[test]
fn cross_origin_posts_and_oversized_bodies_are_refused() {
    let s = start(&["--max-upload-size", "0.01"]);
    let a = &s.addr;
    let port = a.rsplit(':').next().expect("port");
    let body = json!({"prompt": small(0, "x")}).to_string();
    let evil = http(
        a,
        "POST",
        "/prompt",
        &[
            ("Origin", "http://evil.example"),
            ("Content-Type", "application/json"),
        ],
        body.as_bytes(),
    );
    assert_eq!(evil.status, 403);
    let null = http(a, "POST", "/prompt", &[("Origin", "null")], body.as_bytes());
    assert_eq!(null.status, 403);
    let same = format!("http://127.0.0.1:{port}");
    let ok = http(
        a,
        "POST",
        "/prompt",
        &[
            ("Origin", same.as_str()),
            ("Content-Type", "application/json"),
        ],
        body.as_bytes(),
    );
    assert_eq!(ok.status, 200, "{}", String::from_utf8_lossy(&ok.body));
    let other_port = http(
        a,
        "POST",
        "/prompt",
        &[("Origin", "http://127.0.0.1:1")],
        body.as_bytes(),
    );
    assert_eq!(other_port.status, 403);
    // A loopback server answers no other Host (DNS rebinding; see
    // loopback_server_answers_only_loopback_hosts).
    let lan = http(
        a,
        "GET",
        "/prompt",
        &[
            ("Host", "192.168.1.5:8188"),
            ("Origin", "http://evil.example"),
        ],
        b"",
    );
    assert_eq!(lan.status, 403);
    // 0.01 MB cap.
    let big = vec![b'a'; 20_000];
    let r = http(
        a,
        "POST",
        "/upload/image",
        &[("Content-Type", "multipart/form-data; boundary=zz")],
        &big,
    );
    assert!(r.status == 413 || r.status == 400, "{}", r.status);
    let r = http(
        a,
        "POST",
        "/prompt",
        &[("Content-Type", "application/json")],
        &big,
    );
    assert_eq!(r.status, 413);
    // The start-up routes the front end asks for.
    for path in [
        "/system_stats",
        "/embeddings",
        "/extensions",
        "/models",
        "/models/checkpoints",
        "/users",
        "/i18n",
        "/features",
        "/api/settings",
    ] {
        let r = get(a, path);
        assert_eq!(r.status, 200, "{path}");
        r.json();
    }
    assert_eq!(get(a, "/models/nope").status, 404);
    let stats = get(a, "/system_stats").json();
    assert_eq!(stats["devices"][0]["type"], "cpu");
}

#[test]
fn many_prompts_and_clients_with_disconnects() {
    let s = start(&[]);
    let a = s.addr.clone();
    // 20 clients; half of them leave while prompts run.
    let mut clients: Vec<Ws> = (0..20)
        .map(|i| ws_connect(&a, &format!("load-{i}")))
        .collect();
    for c in &mut clients {
        assert_eq!(ws_next(c)["type"], "status");
    }
    let mut ids = Vec::new();
    for i in 0..100u32 {
        let r = post_json(
            &a,
            "/prompt",
            &json!({"prompt": small(i * 997, "load"), "client_id": format!("load-{}", i % 20)}),
        );
        assert_eq!(r.status, 200);
        ids.push(r.json()["prompt_id"].as_str().expect("id").to_string());
        if i == 30 {
            for c in clients.drain(10..) {
                drop(c);
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let h = get(&a, "/history").json();
        let done = ids.iter().filter(|id| h.get(id.as_str()).is_some()).count();
        if done == ids.len() {
            for id in &ids {
                assert_eq!(h[id]["status"]["status_str"], "success", "{id}");
            }
            break;
        }
        assert!(Instant::now() < deadline, "{done} of 100 finished");
        std::thread::sleep(Duration::from_millis(200));
    }
    // Every output is on disk, under a distinct name.
    let out = std::fs::read_dir(s.base.path().join("output"))
        .expect("output")
        .count();
    assert_eq!(out, 100);
    // The remaining clients still get messages.
    let r = post_json(
        &a,
        "/prompt",
        &json!({"prompt": small(1, "last"), "client_id": "load-0"}),
    )
    .json();
    let id = r["prompt_id"].as_str().expect("id").to_string();
    let msgs = ws_until_done(&mut clients[0], &id);
    assert!(msgs.iter().any(|m| m["type"] == "execution_success"));
}

/// Issue probes: writes through symlinked folders, folders created before
/// a refusal, unclear answers. Each failed before its fix.
#[cfg(unix)]
#[test]
fn symlinked_folders_never_take_writes_outside() {
    let s = start(&["--max-upload-size", "1"]);
    let a = &s.addr;
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let out = elsewhere.path();
    let user = s.base.path().join("user/default");
    std::os::unix::fs::symlink(out, user.join("ulink")).expect("symlink");
    std::os::unix::fs::symlink(out.join("gone"), user.join("dangling")).expect("symlink");
    let input = s.base.path().join("input");
    std::os::unix::fs::symlink(out, input.join("linkdir")).expect("symlink");

    let refused = |r: Reply, what: &str| {
        assert_eq!(
            r.status,
            403,
            "{what}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert!(!r.body.is_empty(), "{what}: a refusal says why");
    };
    refused(
        http(a, "POST", "/userdata/ulink%2Fpwned.txt", &[], b"x"),
        "write through a link",
    );
    refused(
        http(a, "POST", "/userdata/ulink%2Fnew%2Fdeep.txt", &[], b"x"),
        "new folder through a link",
    );
    refused(
        http(a, "POST", "/userdata/dangling%2Fx.txt", &[], b"x"),
        "dangling link",
    );
    assert_eq!(
        http(a, "POST", "/userdata/workflows%2Fm.json", &[], b"{}").status,
        200
    );
    refused(
        http(
            a,
            "POST",
            "/userdata/workflows%2Fm.json/move/ulink%2Fmoved.json",
            &[],
            b"",
        ),
        "move out through a link",
    );
    assert!(user.join("workflows/m.json").is_file(), "the source stays");
    let red = png([255, 0, 0]);
    refused(
        upload(
            a,
            &[
                ("image", Some("p.png"), &red),
                ("subfolder", None, b"linkdir/newsub"),
            ],
        ),
        "upload into a new folder through a link",
    );
    let left: Vec<_> = std::fs::read_dir(out).expect("dir").flatten().collect();
    assert!(left.is_empty(), "written outside: {left:?}");
    assert!(!out.join("gone").exists());

    // Nested folders that stay inside are still made.
    let r = http(a, "POST", "/userdata/workflows%2Fa%2Fb%2Fc.json", &[], b"1");
    assert_eq!(r.status, 200);
    assert!(user.join("workflows/a/b/c.json").is_file());
    let r = upload(
        a,
        &[("image", Some("p.png"), &red), ("subfolder", None, b"x/y")],
    );
    assert_eq!(r.status, 200);
    assert!(input.join("x/y/p.png").is_file());

    // Unclear answers: a long name works to NAME_MAX, past it is 400 with a
    // reason; an upload past the cap is 413; traversal refusals say why.
    let long = format!("{}.png", "n".repeat(250));
    let r = upload(a, &[("image", Some(&long), &red)]);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let longer = format!("{}.png", "n".repeat(260));
    let r = upload(a, &[("image", Some(&longer), &red)]);
    assert_eq!(r.status, 400);
    assert!(String::from_utf8_lossy(&r.body).contains("too long"));
    let big = vec![7u8; 2 << 20];
    let r = upload(a, &[("image", Some("big.png"), &big)]);
    assert_eq!(r.status, 413);
    assert!(String::from_utf8_lossy(&r.body).contains("--max-upload-size"));
    let r = get(a, "/view?filename=..%2F..%2Fetc%2Fpasswd");
    assert_eq!(r.status, 400);
    assert!(!r.body.is_empty());
    let r = get(a, "/view?filename=x.png&subfolder=..%2F..");
    assert_eq!(r.status, 403);
    assert!(!r.body.is_empty());
}

/// DNS rebinding: a page under an attacker's name resolving to 127.0.0.1
/// sends its own Host with a matching Origin.
#[test]
fn loopback_server_answers_only_loopback_hosts() {
    let s = start(&[]);
    let a = &s.addr;
    let port = a.rsplit(':').next().expect("port");
    let host = format!("attacker.example:{port}");
    let origin = format!("http://attacker.example:{port}");
    let body = json!({"prompt": small(0, "x")}).to_string();
    let r = http(
        a,
        "POST",
        "/prompt",
        &[("Host", host.as_str()), ("Origin", origin.as_str())],
        body.as_bytes(),
    );
    assert_eq!(r.status, 403);
    assert!(String::from_utf8_lossy(&r.body).contains("--allow-host"));
    assert_eq!(
        http(a, "GET", "/queue", &[("Host", host.as_str())], b"").status,
        403
    );
    for ok in [
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
        "127.0.0.2".into(),
    ] {
        assert_eq!(
            http(a, "GET", "/queue", &[("Host", ok.as_str())], b"").status,
            200,
            "{ok}"
        );
    }
    drop(s);
    // A reverse proxy's name is allowed by the operator.
    let s = start(&["--allow-host", "Studio.Example"]);
    let r = http(&s.addr, "GET", "/queue", &[("Host", "studio.example")], b"");
    assert_eq!(r.status, 200);
    let r = http(&s.addr, "GET", "/queue", &[("Host", "other.example")], b"");
    assert_eq!(r.status, 403);
}

/// ComfyUI's `/prompt` rule: valid outputs run, invalid ones are reported
/// with 200; unknown types anywhere and oversized prompts are refused.
#[test]
fn prompts_run_their_valid_outputs_and_report_the_rest() {
    let s = start(&[]);
    let a = &s.addr;
    let mut ws = ws_connect(a, "partial");
    let mut p = small(0, "good");
    // A second branch whose EmptyImage is out of range.
    p["11"] = json!({"class_type": "EmptyImage", "inputs": {"width": 0, "height": 8, "batch_size": 1, "color": 0}});
    p["13"] = json!({"class_type": "SaveImage", "inputs": {"images": ["11", 0], "filename_prefix": "bad"}});
    // A third through a registered type sdkit does not implement.
    p["21"] = json!({"class_type": "ImageQuantize", "inputs": {"image": ["1", 0], "colors": 16, "dither": "none"}});
    p["23"] = json!({"class_type": "SaveImage", "inputs": {"images": ["21", 0], "filename_prefix": "pad"}});
    // A cycle no output uses.
    p["31"] = json!({"class_type": "ImageInvert", "inputs": {"image": ["32", 0]}});
    p["32"] = json!({"class_type": "ImageInvert", "inputs": {"image": ["31", 0]}});
    let r = post_json(a, "/prompt", &json!({"prompt": p, "client_id": "partial"}));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    let errs = &v["node_errors"];
    assert_eq!(errs["11"]["errors"][0]["type"], "value_smaller_than_min");
    assert_eq!(errs["11"]["dependent_outputs"], json!(["13"]));
    assert_eq!(errs["21"]["errors"][0]["type"], "node_not_implemented");
    assert_eq!(errs["21"]["dependent_outputs"], json!(["23"]));
    assert!(
        errs.get("31").is_none() && errs.get("3").is_none(),
        "{errs}"
    );
    let id = v["prompt_id"].as_str().expect("id").to_string();
    let msgs = ws_until_done(&mut ws, &id);
    assert!(
        msgs.iter().any(|m| m["type"] == "execution_success"),
        "{msgs:?}"
    );
    let outputs = get(a, &format!("/history/{id}")).json()[&id]["outputs"].clone();
    let ran: Vec<&String> = outputs.as_object().expect("outputs").keys().collect();
    assert_eq!(ran, vec!["3"]);

    // Every output invalid: refused, nothing queued.
    let mut p = small(0, "bad");
    p["1"]["inputs"]["width"] = json!(0);
    assert_eq!(post_json(a, "/prompt", &json!({"prompt": p})).status, 400);
    // An unknown type where no output needs it still refuses the prompt.
    let mut p = small(0, "x");
    p["9"] = json!({"class_type": "NoSuchNode", "inputs": {}});
    let r = post_json(a, "/prompt", &json!({"prompt": p}));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_prompt");

    // Bounded work per request: too many nodes is refused at once, a body
    // past the prompt cap is 413 before it is parsed.
    let mut p = serde_json::Map::new();
    for i in 0..20_001 {
        p.insert(
            i.to_string(),
            json!({"class_type": "ImageInvert", "inputs": {}}),
        );
    }
    let start = Instant::now();
    let r = post_json(a, "/prompt", &json!({"prompt": p}));
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("20001 nodes")));
    assert!(start.elapsed() < Duration::from_secs(20));
    // A 48 MB body is refused from its Content-Length, before it is sent.
    let mut c = TcpStream::connect(a.as_str()).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(30))).ok();
    let head = format!(
        "POST /prompt HTTP/1.1\r\nHost: {a}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{\"prompt\": ",
        48 << 20
    );
    c.write_all(head.as_bytes()).expect("write");
    let mut line = String::new();
    BufReader::new(&mut c)
        .read_line(&mut line)
        .expect("status line");
    assert!(line.contains(" 413 "), "{line}");
    assert_eq!(get(a, "/queue").json()["queue_pending"], json!([]));
}

/// The front end's template browser (`/templates/index.json`) lists
/// sdkit's example workflows that this server can run: the image-only ones
/// on a fresh base folder, a model workflow once its checkpoint is there.
/// Each listed one loads as a UI workflow and, queued as the front end
/// queues it (converted to the API form), runs.
#[test]
fn templates_list_the_examples_this_server_can_run() {
    let s = start(&[]);
    let a = &s.addr;
    let listed = || -> Vec<String> {
        let index = get(a, "/templates/index.json").json();
        assert_eq!(index[0]["moduleName"], "default");
        index[0]["templates"]
            .as_array()
            .expect("templates")
            .iter()
            .map(|t| {
                assert_eq!(t["mediaSubtype"], "png");
                t["name"].as_str().expect("name").to_string()
            })
            .collect()
    };
    let names = listed();
    assert!(
        names.contains(&"sdkit_image_pipeline".to_string()),
        "{names:?}"
    );
    assert!(names.contains(&"sdkit_mask_ops".to_string()), "{names:?}");
    assert!(
        !names.contains(&"sdkit_sd15_txt2img".to_string()),
        "{names:?}"
    );
    let ckpts = s.base.path().join("models/checkpoints");
    std::fs::create_dir_all(&ckpts).expect("mkdir");
    std::fs::write(ckpts.join("v1-5-pruned-emaonly.safetensors"), b"").expect("write");
    assert!(listed().contains(&"sdkit_sd15_txt2img".to_string()));

    let thumb = get(a, "/templates/sdkit_mask_ops-1.png");
    assert_eq!(thumb.status, 200);
    assert!(thumb.body.starts_with(b"\x89PNG"));
    assert_eq!(get(a, "/templates/nothing.json").status, 404);

    let lib = sdkit_nodes::library();
    let mut ws = ws_connect(a, "templates");
    for name in names {
        let ui = get(a, &format!("/templates/{name}.json")).json();
        let wf = sdkit_schema::workflow::load_json(&ui, &lib.registry)
            .unwrap_or_else(|d| panic!("{name}: {d:?}"));
        assert_eq!(wf.format, sdkit_schema::Format::ComfyUi, "{name}");
        let body = json!({
            "prompt": wf.to_api_json(&lib.registry),
            "client_id": "templates",
            "extra_data": {"extra_pnginfo": {"workflow": ui}},
        });
        let r = post_json(a, "/prompt", &body);
        assert_eq!(
            r.status,
            200,
            "{name}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let id = r.json()["prompt_id"].as_str().expect("id").to_string();
        let msgs = ws_until_done(&mut ws, &id);
        assert!(
            msgs.iter().any(|m| m["type"] == "execution_success"),
            "{name}: {msgs:?}"
        );
    }
}
