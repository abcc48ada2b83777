//! The router: ComfyUI's routes (each also under `/api/`), its Host/Origin
//! check, the request-size cap, and the JSON routes.

use super::queue::{number_json, Item};
use super::{files, ws, Server};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, Query, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json as JsonBody, Router};
use sdkit_engine::{validate_for, Outputs};
use sdkit_schema::export::{object_info, ComboSource};
use sdkit_schema::spec::ComboOptions;
use sdkit_schema::{workflow, Diagnostic};
use serde_json::{json, Map, Value as Json};
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

/// The largest `/prompt` body: a workflow of thousands of nodes with its
/// UI form in `extra_data` is a few MB. Parsing JSON takes about ten
/// times its size in memory, so this bounds what one request can take.
const PROMPT_BODY_LIMIT: usize = 32 << 20;

/// The most nodes a prompt may have (large real workflows have a few
/// thousand); validation and execution are linear in it.
pub const MAX_PROMPT_NODES: usize = 20_000;

pub fn status(s: StatusCode) -> Response {
    s.into_response()
}

/// 503 for a queue that cannot be reached (a cluster's Redis).
pub fn unavailable(msg: &str) -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, msg.to_string()).into_response()
}

/// A queue answer as JSON, or 503.
fn answer(r: Result<Json, String>) -> Response {
    match r {
        Ok(v) => JsonBody(v).into_response(),
        Err(m) => unavailable(&m),
    }
}

/// 400 with a message (ComfyUI answers malformed requests with text).
pub fn bad_request(msg: &str) -> Response {
    (StatusCode::BAD_REQUEST, msg.to_string()).into_response()
}

fn json_body(body: &Bytes) -> Result<Json, String> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))
}

pub fn router(server: Arc<Server>) -> Router {
    let api: Router<Arc<Server>> = Router::new()
        .route("/ws", get(ws::handler))
        .route(
            "/prompt",
            get(get_prompt)
                .post(post_prompt)
                .route_layer(middleware::from_fn(prompt_length_check))
                .layer(DefaultBodyLimit::max(
                    server.max_body.min(PROMPT_BODY_LIMIT),
                )),
        )
        .route("/queue", get(get_queue).post(post_queue))
        .route("/history", get(get_history).post(post_history))
        .route("/history/{prompt_id}", get(get_history_one))
        .route("/jobs", get(get_jobs))
        .route("/jobs/{job_id}", get(get_job))
        .route("/interrupt", post(post_interrupt))
        .route("/free", post(post_free))
        .route("/object_info", get(get_object_info))
        .route("/object_info/{class}", get(get_object_info_one))
        .route("/view", get(files::view))
        .route("/upload/image", post(files::upload_image))
        .route("/system_stats", get(system_stats))
        .route("/embeddings", get(embeddings))
        .route("/extensions", get(extensions))
        .route("/models", get(model_folders))
        .route("/models/{folder}", get(model_files))
        .route("/users", get(users).post(post_users))
        .route("/settings", get(get_settings).post(post_settings))
        .route("/settings/{id}", get(get_setting).post(post_setting))
        .route("/userdata", get(files::list_userdata))
        .route(
            "/userdata/{file}",
            get(files::get_userdata)
                .post(files::post_userdata)
                .delete(files::delete_userdata),
        )
        .route("/userdata/{file}/move/{dest}", post(files::move_userdata))
        .route("/i18n", get(empty_object))
        .route("/features", get(get_features))
        .route("/workflow_templates", get(empty_object))
        .route("/experiment/models", get(empty_list))
        .route("/v2/userdata", get(empty_list))
        .route("/internal/logs", get(empty_string))
        .route("/internal/logs/raw", get(logs_raw))
        .route("/internal/folder_paths", get(folder_paths))
        .route("/manager/version", get(not_found));
    let limit = server.max_body;
    Router::new()
        .merge(api.clone())
        .nest("/api", api)
        .merge(super::templates::router())
        .fallback(files::front_end)
        .layer(middleware::from_fn_with_state(server.clone(), origin_check))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(server)
}

/// 413 for a prompt whose declared length is past the cap, before its body
/// is read (the body limit alone reads up to the cap first).
async fn prompt_length_check(req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > PROMPT_BODY_LIMIT as u64) {
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "prompt too large: {} bytes, at most {PROMPT_BODY_LIMIT}",
                declared.unwrap_or(0)
            ),
        )
            .into_response();
    }
    next.run(req).await
}

async fn not_found() -> Response {
    status(StatusCode::NOT_FOUND)
}

async fn empty_object() -> JsonBody<Json> {
    JsonBody(json!({}))
}

async fn empty_list() -> JsonBody<Json> {
    JsonBody(json!([]))
}

async fn empty_string() -> JsonBody<Json> {
    JsonBody(json!(""))
}

async fn logs_raw() -> JsonBody<Json> {
    JsonBody(json!({"entries": [], "size": {"cols": 80, "rows": 24}}))
}

async fn folder_paths(State(server): State<Arc<Server>>) -> JsonBody<Json> {
    let p = &server.paths;
    let mut m = Map::new();
    for f in sdkit_engine::paths::MODEL_FOLDERS {
        m.insert(
            f.to_string(),
            json!([p.models.join(f).display().to_string()]),
        );
    }
    JsonBody(Json::Object(m))
}

/// The Host check of [`super::HostPolicy`], the Host/Origin check ComfyUI
/// makes (a web page elsewhere cannot drive a loopback server: its Origin
/// differs from the Host it talks to), and OPTIONS answered empty.
async fn origin_check(State(server): State<Arc<Server>>, req: Request, next: Next) -> Response {
    let h = req.headers();
    if let Some(host) = h.get(header::HOST) {
        let name = host.to_str().map(|s| split_host(s).0).unwrap_or_default();
        if !server.hosts.accepts(&name) {
            let raw = String::from_utf8_lossy(host.as_bytes());
            let shown = sdkit_schema::diagnostic::echo(&raw);
            tracing::warn!("refused a request for Host {shown}");
            return (
                StatusCode::FORBIDDEN,
                format!(
                    "Host {shown} is not served: this server listens on loopback and answers \
                     only loopback names; start it with --allow-host NAME to serve it under \
                     another name (e.g. behind a reverse proxy)"
                ),
            )
                .into_response();
        }
    }
    if let (Some(host), Some(origin)) = (
        h.get(header::HOST).and_then(|v| v.to_str().ok()),
        h.get(header::ORIGIN).and_then(|v| v.to_str().ok()),
    ) {
        if origin_mismatch(host, origin) {
            tracing::warn!("refused a request with Host {host} and Origin {origin}");
            return status(StatusCode::FORBIDDEN);
        }
    }
    if req.method() == Method::OPTIONS {
        return status(StatusCode::OK);
    }
    next.run(req).await
}

/// (hostname, port) of `host[:port]`, IPv6 in brackets.
fn split_host(s: &str) -> (String, Option<&str>) {
    let s = s.trim();
    if let Some(rest) = s.strip_prefix('[') {
        if let Some(end) = rest.find(']') {
            let port = rest[end + 1..].strip_prefix(':');
            return (rest[..end].to_ascii_lowercase(), port);
        }
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (h.to_ascii_lowercase(), Some(p)),
        _ => (s.to_ascii_lowercase(), None),
    }
}

pub fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn origin_mismatch(host: &str, origin: &str) -> bool {
    let (host_name, host_port) = split_host(host);
    if !is_loopback(&host_name) {
        return false;
    }
    // "null" (a file:// page or a sandboxed frame) is another origin too.
    let Some((_, netloc)) = origin.split_once("://") else {
        return true;
    };
    let netloc = netloc.split('/').next().unwrap_or_default();
    let (origin_name, origin_port) = split_host(netloc);
    if origin_name.is_empty() {
        return true;
    }
    // A port is compared only where both sides give one, as ComfyUI does.
    origin_name != host_name
        || (host_port.is_some() && origin_port.is_some() && host_port != origin_port)
}

pub fn features(server: &Server) -> Json {
    json!({
        "supports_preview_metadata": true,
        "max_upload_size": server.max_body,
    })
}

async fn get_features(State(server): State<Arc<Server>>) -> JsonBody<Json> {
    JsonBody(features(&server))
}

async fn get_prompt(State(server): State<Arc<Server>>) -> Response {
    answer(server.queue.info().await)
}

async fn get_queue(State(server): State<Arc<Server>>) -> Response {
    answer(server.queue.to_json().await)
}

fn string_list(v: Option<&Json>) -> Vec<String> {
    v.and_then(Json::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

async fn post_queue(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    let v = match json_body(&body) {
        Ok(v) => v,
        Err(m) => return bad_request(&m),
    };
    if v.get("clear").and_then(Json::as_bool) == Some(true) {
        if let Err(m) = server.queue.clear_pending().await {
            return unavailable(&m);
        }
    }
    let ids = string_list(v.get("delete"));
    if !ids.is_empty() {
        if let Err(m) = server.queue.delete_pending(&ids).await {
            return unavailable(&m);
        }
    }
    server.broadcast_status().await;
    status(StatusCode::OK)
}

async fn get_history(
    State(server): State<Arc<Server>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let num = |k: &str| -> Result<Option<usize>, String> {
        match q.get(k) {
            None => Ok(None),
            Some(v) => v
                .parse::<i64>()
                .map(|n| usize::try_from(n).ok())
                .map_err(|_| format!("{k} must be an integer")),
        }
    };
    let (max_items, offset) = match (num("max_items"), num("offset")) {
        (Ok(m), Ok(o)) => (m, o),
        (Err(m), _) | (_, Err(m)) => return bad_request(&m),
    };
    answer(server.queue.history(max_items, offset).await)
}

async fn get_history_one(
    State(server): State<Arc<Server>>,
    UrlPath(id): UrlPath<String>,
) -> Response {
    answer(server.queue.history_one(&id).await)
}

async fn get_jobs(
    State(server): State<Arc<Server>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let records = match server.queue.job_records().await {
        Ok(r) => r,
        Err(m) => return unavailable(&m),
    };
    match super::jobs::list(records, &q) {
        Ok(v) => JsonBody(v).into_response(),
        Err(m) => (StatusCode::BAD_REQUEST, JsonBody(json!({"error": m}))).into_response(),
    }
}

async fn get_job(State(server): State<Arc<Server>>, UrlPath(id): UrlPath<String>) -> Response {
    match server.queue.job_detail(&id).await {
        Err(m) => unavailable(&m),
        Ok(Some(v)) => JsonBody(v).into_response(),
        Ok(None) => (
            StatusCode::NOT_FOUND,
            JsonBody(json!({"error": format!("job {id} not found")})),
        )
            .into_response(),
    }
}

async fn post_history(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    let v = match json_body(&body) {
        Ok(v) => v,
        Err(m) => return bad_request(&m),
    };
    if v.get("clear").and_then(Json::as_bool) == Some(true) {
        if let Err(m) = server.queue.delete_history(None).await {
            return unavailable(&m);
        }
    }
    match server
        .queue
        .delete_history(Some(&string_list(v.get("delete"))))
        .await
    {
        Ok(()) => status(StatusCode::OK),
        Err(m) => unavailable(&m),
    }
}

async fn post_interrupt(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    // A body that is not JSON means a global interrupt, as in ComfyUI.
    let v: Json = serde_json::from_slice(&body).unwrap_or(json!({}));
    let id = v.get("prompt_id").and_then(Json::as_str);
    match server.queue.interrupt(id).await {
        Ok(()) => status(StatusCode::OK),
        Err(m) => unavailable(&m),
    }
}

async fn post_free(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    let v = match json_body(&body) {
        Ok(v) => v,
        Err(m) => return bad_request(&m),
    };
    let flag = |k: &str| v.get(k).and_then(Json::as_bool).unwrap_or(false);
    match server
        .queue
        .request_free(flag("unload_models"), flag("free_memory"))
        .await
    {
        Ok(()) => status(StatusCode::OK),
        Err(m) => unavailable(&m),
    }
}

async fn get_object_info(State(server): State<Arc<Server>>) -> JsonBody<Json> {
    server.refresh_combos().await;
    JsonBody(object_info(&server.lib.registry, &server.combos()))
}

async fn get_object_info_one(
    State(server): State<Arc<Server>>,
    UrlPath(class): UrlPath<String>,
) -> JsonBody<Json> {
    server.refresh_combos().await;
    let all = object_info(&server.lib.registry, &server.combos());
    let mut m = Map::new();
    if let Some(v) = all.get(&class) {
        m.insert(class, v.clone());
    }
    JsonBody(Json::Object(m))
}

/// ComfyUI's error shape for a prompt that cannot run.
fn prompt_error(ty: &str, message: &str, details: &str, node_errors: Json) -> Response {
    (
        StatusCode::BAD_REQUEST,
        JsonBody(json!({
            "error": {"type": ty, "message": message, "details": details, "extra_info": {}},
            "node_errors": node_errors,
        })),
    )
        .into_response()
}

/// The nodes of the API prompt that link to each node (its dependents).
fn dependents(prompt: &Map<String, Json>) -> HashMap<String, Vec<&str>> {
    let mut out: HashMap<String, Vec<&str>> = HashMap::new();
    for (id, node) in prompt {
        let inputs = node.get("inputs").and_then(Json::as_object);
        for v in inputs.into_iter().flat_map(|m| m.values()) {
            if let Some(src) = v.as_array().and_then(|a| a.first()) {
                let src = match src {
                    Json::String(s) => s.clone(),
                    Json::Number(n) => n.to_string(),
                    _ => continue,
                };
                out.entry(src).or_default().push(id.as_str());
            }
        }
    }
    out
}

/// Output nodes (`outputs`) that depend, through links, on `node`.
fn dependent_outputs(
    dependents: &HashMap<String, Vec<&str>>,
    outputs: &HashSet<&str>,
    node: &str,
) -> Vec<String> {
    let mut result = Vec::new();
    let mut seen = HashSet::new();
    let mut stack = vec![node];
    while let Some(id) = stack.pop() {
        if !seen.insert(id) {
            continue;
        }
        if outputs.contains(id) {
            result.push(id.to_string());
        }
        stack.extend(dependents.get(id).into_iter().flatten());
    }
    result.sort();
    result
}

/// Maps sdkit's diagnostics to ComfyUI's `{error, node_errors}`.
fn validation_error(server: &Server, prompt: &Json, diags: &[Diagnostic]) -> Response {
    let errors: Vec<&Diagnostic> = diags.iter().filter(|d| d.is_error()).collect();
    // Whole-prompt problems come first, as ComfyUI reports them alone.
    if let Some(d) = errors.iter().find(|d| {
        d.node_id.is_none() || matches!(d.kind.as_str(), "missing_node_type" | "invalid_prompt")
    }) {
        let ty = match d.kind.as_str() {
            "missing_node_type" | "syntax_error" => "invalid_prompt",
            other => other,
        };
        let details = d
            .node_id
            .as_ref()
            .map(|n| format!("Node ID '#{n}'"))
            .unwrap_or_default();
        return prompt_error(ty, &d.message, &details, json!({}));
    }
    let (node_errors, lines) = node_errors(server, prompt, &errors);
    prompt_error(
        "prompt_outputs_failed_validation",
        "Prompt outputs failed validation",
        &lines.join("\n"),
        node_errors,
    )
}

/// ComfyUI's `node_errors` for node-level errors, and one line per error.
fn node_errors(server: &Server, prompt: &Json, errors: &[&Diagnostic]) -> (Json, Vec<String>) {
    let empty = Map::new();
    let pmap = prompt.as_object().unwrap_or(&empty);
    let outputs: HashSet<&str> = pmap
        .iter()
        .filter(|(_, n)| {
            n.get("class_type")
                .and_then(Json::as_str)
                .and_then(|c| server.lib.registry.get(c))
                .is_some_and(|s| s.output_node)
        })
        .map(|(k, _)| k.as_str())
        .collect();
    let dependents = dependents(pmap);
    let mut node_errors = Map::new();
    let mut lines = Vec::new();
    for d in errors {
        let Some(id) = &d.node_id else { continue };
        let input = d.input.clone().unwrap_or_default();
        lines.push(format!("{}: {input}", d.message));
        let entry = node_errors.entry(id.clone()).or_insert_with(|| {
            json!({
                "errors": [],
                "dependent_outputs": dependent_outputs(&dependents, &outputs, id),
                "class_type": pmap
                    .get(id)
                    .and_then(|n| n.get("class_type"))
                    .cloned()
                    .unwrap_or_else(|| json!(d.node_type.clone().unwrap_or_default())),
            })
        });
        if let Some(list) = entry.get_mut("errors").and_then(Json::as_array_mut) {
            list.push(json!({
                "type": d.kind.as_str(),
                "message": d.message,
                "details": input,
                "extra_info": {"input_name": input},
            }));
        }
    }
    (Json::Object(node_errors), lines)
}

async fn post_prompt(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    let v = match json_body(&body) {
        Ok(v) => v,
        Err(m) => return bad_request(&m),
    };
    let Some(prompt) = v.get("prompt").cloned() else {
        return prompt_error(
            "no_prompt",
            "No prompt provided",
            "No prompt provided",
            json!({}),
        );
    };
    let Some(nodes) = prompt.as_object() else {
        return prompt_error(
            "invalid_prompt",
            "The prompt must be an object of nodes by id",
            "",
            json!({}),
        );
    };
    if nodes.len() > MAX_PROMPT_NODES {
        let msg = format!(
            "The prompt has {} nodes; at most {MAX_PROMPT_NODES} are accepted",
            nodes.len()
        );
        return prompt_error("invalid_prompt", &msg, &msg, json!({}));
    }
    let prompt_id = match v.get("prompt_id") {
        Some(Json::String(s)) if !s.is_empty() => s.clone(),
        _ => sdkit_engine::exec::new_prompt_id(),
    };
    let mut extra_data = v
        .get("extra_data")
        .and_then(Json::as_object)
        .cloned()
        .unwrap_or_default();
    if let Some(c) = v.get("client_id") {
        extra_data.insert("client_id".into(), c.clone());
    }
    // As ComfyUI: the jobs API sorts and reports by it.
    extra_data.insert("create_time".into(), json!(sdkit_engine::event::now_ms()));
    let text = prompt.to_string();
    let reg = &server.lib.registry;
    let wf = match workflow::load(&text, reg) {
        Ok(wf) => wf,
        Err(d) => return validation_error(&server, &prompt, &d),
    };
    let mut validated = validate_for(&wf, &server.lib, &server.combos(), Outputs::Valid);
    if let (Err(_), super::backend::Backend::Redis(store)) = (&validated, &server.queue) {
        // A worker that joined since the last refresh may have the file.
        if store.refresh_files().await.is_ok() {
            validated = validate_for(&wf, &server.lib, &server.combos(), Outputs::Valid);
        }
    }
    let mut graph = match validated {
        Ok(g) => g,
        Err(d) => return validation_error(&server, &prompt, &d),
    };
    // The front end's "queue selected output nodes".
    if let Some(targets) = v.get("partial_execution_targets").and_then(Json::as_array) {
        let targets: HashSet<&str> = targets.iter().filter_map(Json::as_str).collect();
        for n in &mut graph.nodes {
            n.output_node &= targets.contains(n.id.as_str());
        }
        if graph.outputs().is_empty() {
            return prompt_error("prompt_no_outputs", "Prompt has no outputs", "", json!({}));
        }
    }
    // Outputs whose branch failed validation are dropped and reported, as
    // ComfyUI answers: 200 with their `node_errors`, the rest queued.
    let dropped: Vec<&Diagnostic> = graph.dropped.iter().collect();
    let (node_errors, _) = node_errors(&server, &prompt, &dropped);
    // Numbered once valid, as ComfyUI does.
    let number = match server
        .queue
        .number(
            v.get("number").and_then(Json::as_f64),
            v.get("front").and_then(Json::as_bool).unwrap_or(false),
        )
        .await
    {
        Ok(n) => n,
        Err(m) => return unavailable(&m),
    };
    let models = super::worker::model_files(&graph, &server.lib);
    let item = Item::new(number, prompt_id.clone(), prompt, extra_data, graph);
    if let Err(m) = server.queue.push(item, models).await {
        return prompt_error("invalid_prompt", &m, &m, json!({}));
    }
    server.broadcast_status().await;
    JsonBody(
        json!({"prompt_id": prompt_id, "number": number_json(number), "node_errors": node_errors}),
    )
    .into_response()
}

/// Total and available memory from /proc/meminfo (0 where unknown).
fn memory() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// A device's total and free memory. The CPU device's is the machine's
/// (as ComfyUI reports it with --cpu). wgpu reports no memory size: a GPU
/// shows its budget, less the weights held resident, or 0 without one.
pub fn device_memory(rt: &sdkit_engine::Runtime) -> (u64, u64) {
    if rt.is_cpu() {
        memory()
    } else {
        let budget = rt.budget().unwrap_or(0);
        (budget, budget.saturating_sub(rt.resident_bytes()))
    }
}

async fn system_stats(State(server): State<Arc<Server>>) -> JsonBody<Json> {
    let (ram_total, ram_free) = memory();
    let rt = server.exec.runtime();
    let (vram_total, vram_free) = device_memory(rt);
    let argv: Vec<String> = std::env::args().collect();
    let mut devices = vec![json!({
        "name": rt.describe(),
        "type": if rt.is_cpu() { "cpu" } else { "wgpu" },
        "index": 0,
        "vram_total": vram_total,
        "vram_free": vram_free,
        "torch_vram_total": 0,
        "torch_vram_free": 0,
    })];
    // A cluster's devices are its workers'.
    if let super::backend::Backend::Redis(store) = &server.queue {
        devices = store
            .workers()
            .await
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, w)| {
                json!({
                    "name": format!("{}: {}", w.id, w.device),
                    "type": "worker",
                    "index": i,
                    "vram_total": w.vram_total,
                    "vram_free": w.vram_free,
                    "torch_vram_total": 0,
                    "torch_vram_free": 0,
                    "state": w.state,
                    "jobs_done": w.jobs_done,
                })
            })
            .collect();
    }
    JsonBody(json!({
        "system": {
            "os": std::env::consts::OS,
            "ram_total": ram_total,
            "ram_free": ram_free,
            "comfyui_version": env!("CARGO_PKG_VERSION"),
            "sdkit_version": env!("CARGO_PKG_VERSION"),
            "python_version": "",
            "pytorch_version": "",
            "embedded_python": false,
            "argv": argv,
        },
        "devices": devices,
    }))
}

async fn embeddings(State(server): State<Arc<Server>>) -> JsonBody<Json> {
    let files = server.combos().options(&ComboOptions::Models("embeddings"));
    let names: Vec<String> = files
        .into_iter()
        .map(|f| match f.rfind('.') {
            Some(i) => f[..i].to_string(),
            None => f,
        })
        .collect();
    JsonBody(json!(names))
}

/// Front-end extension scripts: `extensions/**/*.js` of the front-end folder.
async fn extensions(State(server): State<Arc<Server>>) -> JsonBody<Json> {
    let mut out = Vec::new();
    if let Some(root) = &server.front_end {
        let mut stack = vec![root.join("extensions")];
        while let Some(d) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd.flatten() {
                let p = e.path();
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "js") {
                    if let Ok(rel) = p.strip_prefix(root) {
                        let rel: Vec<String> = rel
                            .components()
                            .map(|c| c.as_os_str().to_string_lossy().into_owned())
                            .collect();
                        out.push(format!("/{}", rel.join("/")));
                    }
                }
            }
        }
    }
    out.sort();
    JsonBody(json!(out))
}

async fn model_folders() -> JsonBody<Json> {
    JsonBody(json!(sdkit_engine::paths::MODEL_FOLDERS))
}

async fn model_files(
    State(server): State<Arc<Server>>,
    UrlPath(folder): UrlPath<String>,
) -> Response {
    let Some(known) = sdkit_engine::paths::MODEL_FOLDERS
        .iter()
        .find(|f| **f == folder.as_str())
    else {
        return status(StatusCode::NOT_FOUND);
    };
    server.refresh_combos().await;
    JsonBody(json!(server.combos().options(&ComboOptions::Models(known)))).into_response()
}

async fn users(State(server): State<Arc<Server>>) -> JsonBody<Json> {
    JsonBody(json!({"storage": "server", "migrated": server.user_dir.exists()}))
}

async fn post_users() -> Response {
    (
        StatusCode::BAD_REQUEST,
        JsonBody(json!({"error": "sdkit serves one user; there are no others to add"})),
    )
        .into_response()
}

fn settings_path(server: &Server) -> std::path::PathBuf {
    server.user_dir.join("comfy.settings.json")
}

fn read_settings(server: &Server) -> Map<String, Json> {
    std::fs::read(settings_path(server))
        .ok()
        .and_then(|b| serde_json::from_slice::<Json>(&b).ok())
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default()
}

fn write_settings(server: &Server, s: &Map<String, Json>) -> Response {
    let text = serde_json::to_string_pretty(&Json::Object(s.clone())).unwrap_or_default();
    let path = settings_path(server);
    match sdkit_compute::atomic::write_atomic(&path, text.as_bytes()) {
        Ok(()) => status(StatusCode::OK),
        Err(_) => status(StatusCode::INTERNAL_SERVER_ERROR),
    }
}

async fn get_settings(State(server): State<Arc<Server>>) -> JsonBody<Json> {
    JsonBody(Json::Object(read_settings(&server)))
}

async fn get_setting(
    State(server): State<Arc<Server>>,
    UrlPath(id): UrlPath<String>,
) -> JsonBody<Json> {
    JsonBody(
        read_settings(&server)
            .get(&id)
            .cloned()
            .unwrap_or(Json::Null),
    )
}

async fn post_settings(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    let v = match json_body(&body) {
        Ok(v) => v,
        Err(m) => return bad_request(&m),
    };
    let Some(new) = v.as_object() else {
        return bad_request("settings must be a JSON object");
    };
    let mut s = read_settings(&server);
    s.extend(new.clone());
    write_settings(&server, &s)
}

async fn post_setting(
    State(server): State<Arc<Server>>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> Response {
    let v = match json_body(&body) {
        Ok(v) => v,
        Err(m) => return bad_request(&m),
    };
    let mut s = read_settings(&server);
    s.insert(id, v);
    write_settings(&server, &s)
}
