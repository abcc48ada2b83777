//! `sdkit worker`: runs a cluster's prompts (see [`super::cluster`]).
//!
//! One prompt at a time through the normal [`Executor`], whose cache and
//! resident weights persist between prompts, so a worker that ran a
//! checkpoint last is the one dispatch prefers for it. The run's
//! WebSocket messages go to the API processes over the `events` channel;
//! `control` brings interrupts and `/free`. While a prompt runs the worker
//! keeps its token fresh; a worker that stops doing so (killed, hung,
//! cut off) has its prompt taken over by another after `--claim-timeout`.

use super::cluster::{self, Claim, Store, WorkerInfo, GROUP};
use super::objects::Objects;
use super::prompt_run::{failed_or_done, run_prompt, RunParts};
use super::publisher::{self, ClusterOutbox, Out};
use super::queue::Item;
use crate::cli::DirArgs;
use anyhow::{Context, Result};
use clap::Args;
use sdkit_engine::{validate_for, CancelToken, Executor, Graph, NodeLibrary, Outputs, Paths};
use sdkit_schema::export::ComboSource;
use sdkit_schema::spec::{ComboOptions, InputKind};
use serde_json::{json, Value as Json};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// The cluster's Redis, as given to `sdkit serve --queue`.
    #[arg(long, value_name = "redis://HOST:PORT[/DB]")]
    pub queue: String,
    #[command(flatten)]
    pub dirs: DirArgs,
    #[command(flatten)]
    pub runner: super::RunnerArgs,
    /// This worker's name in the cluster (default: host name and process
    /// id). Names must be unique among live workers.
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// Seconds a worker may go without a sign of life before another takes
    /// over its prompt.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    pub claim_timeout: f64,
    /// Put outputs in this object store (`file:///DIR` or
    /// `s3://BUCKET[/PREFIX]`), and fetch the inputs prompts load from it;
    /// give `sdkit serve` the same.
    #[arg(long, value_name = "URL")]
    pub output_store: Option<String>,
}

/// Model folders whose files decide dispatch: the large weights whose
/// loading a worker that already holds them saves.
const ROUTED_FOLDERS: &[&str] = &[
    "checkpoints",
    "diffusion_models",
    "unet",
    "clip",
    "text_encoders",
];

/// The model files `graph` loads, as `folder/name` (`vae_list/name` for
/// VAELoader's list, which also holds the TAESD pairs).
pub fn model_files(graph: &Graph, lib: &NodeLibrary) -> Vec<String> {
    let mut out = Vec::new();
    for node in &graph.nodes {
        let Some(spec) = lib.registry.get(&node.class_type) else {
            continue;
        };
        for (name, input) in &node.inputs {
            let sdkit_engine::GraphInput::Const(sdkit_engine::Value::String(v)) = input else {
                continue;
            };
            let folder = match spec.input(name).map(|i| &i.kind) {
                Some(InputKind::Combo {
                    options: ComboOptions::Models(folder),
                    ..
                }) => *folder,
                Some(InputKind::Combo {
                    options: ComboOptions::Vaes,
                    ..
                }) => "vae_list",
                _ => continue,
            };
            let f = format!("{folder}/{v}");
            if !out.contains(&f) {
                out.push(f);
            }
        }
    }
    out
}

/// The files among `files` that decide dispatch (see [`ROUTED_FOLDERS`]).
pub fn routed(files: &[String]) -> Vec<String> {
    files
        .iter()
        .filter(|f| {
            f.split_once('/')
                .is_some_and(|(folder, _)| ROUTED_FOLDERS.contains(&folder))
        })
        .cloned()
        .collect()
}

/// Whether `paths` has `file` (`folder/name`, as [`model_files`] names it).
fn has_file(paths: &Paths, file: &str) -> bool {
    let Some((folder, name)) = file.split_once('/') else {
        return false;
    };
    if folder == "vae_list" {
        return paths.contains(&ComboOptions::Vaes, name);
    }
    sdkit_engine::paths::MODEL_FOLDERS
        .iter()
        .find(|f| **f == folder)
        .is_some_and(|f| paths.contains(&ComboOptions::Models(f), name))
}

/// The image files a prompt's loaders name: (type, subfolder, name), from
/// values such as `a.png`, `sub/a.png` or `a.png [output]`.
fn input_files(prompt: &Json, lib: &NodeLibrary) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for node in prompt.as_object().into_iter().flat_map(|m| m.values()) {
        let Some(spec) = node
            .get("class_type")
            .and_then(Json::as_str)
            .and_then(|c| lib.registry.get(c))
        else {
            continue;
        };
        let inputs = node.get("inputs").and_then(Json::as_object);
        for (name, v) in inputs.into_iter().flatten() {
            let Some(v) = v.as_str() else { continue };
            if !matches!(
                spec.input(name).map(|i| &i.kind),
                Some(InputKind::Combo {
                    options: ComboOptions::InputImages,
                    ..
                })
            ) {
                continue;
            }
            let (path, ty) = match v.strip_suffix(']').and_then(|s| s.rsplit_once(" [")) {
                Some((p, t)) => (p, t),
                None => (v, "input"),
            };
            let (sub, file) = path.rsplit_once('/').unwrap_or(("", path));
            out.push((ty.to_string(), sub.to_string(), file.to_string()));
        }
    }
    out
}

/// The prompt `item` as a graph to run, validated as `/prompt` did, with
/// the outputs it was queued with.
pub fn graph_of(item: &Item, lib: &NodeLibrary, paths: &Paths) -> Result<Graph, String> {
    let wf = sdkit_schema::workflow::load(&item.prompt.to_string(), &lib.registry)
        .map_err(|d| first_error(&d))?;
    let mut graph = validate_for(&wf, lib, paths, Outputs::Valid).map_err(|d| first_error(&d))?;
    for n in &mut graph.nodes {
        n.output_node &= item.outputs.contains(&n.id);
    }
    if graph.outputs().is_empty() {
        return Err("none of the prompt's outputs can run on this worker".into());
    }
    Ok(graph)
}

fn first_error(d: &[sdkit_schema::Diagnostic]) -> String {
    d.iter()
        .find(|d| d.is_error())
        .map(|d| d.to_string())
        .unwrap_or_else(|| "invalid prompt".into())
}

/// The prompt being run.
struct Current {
    id: String,
    token: String,
    cancel: CancelToken,
    /// Another worker took the token over: this run's result is not
    /// recorded.
    superseded: bool,
}

#[derive(Default)]
struct State {
    current: Option<Current>,
    resident: Vec<String>,
    jobs_done: u64,
    unload: bool,
    files: cluster::Files,
    /// The files changed since they were last advertised.
    files_new: bool,
}

struct Worker {
    id: String,
    store: Arc<Store>,
    exec: Arc<Executor>,
    lib: Arc<NodeLibrary>,
    paths: Arc<Paths>,
    preview: sdkit_engine::event::PreviewMethod,
    timeout: Duration,
    state: Mutex<State>,
    /// Ordered messages to publish on the events channel.
    out: mpsc::UnboundedSender<Out>,
    objects: Option<Arc<Objects>>,
    stopping: AtomicBool,
}

fn default_name() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_else(|| "worker".into());
    format!("{host}-{}", std::process::id())
}

/// Runs the worker until Ctrl-C or SIGTERM (the prompt in progress ends
/// first).
pub fn worker(args: WorkerArgs) -> Result<i32> {
    let paths = args.dirs.paths()?;
    for dir in [&paths.input, &paths.output, &paths.temp] {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    crate::sweep::stale_temp_files(&paths, None);
    if !(args.claim_timeout.is_finite() && args.claim_timeout >= 1.0) {
        anyhow::bail!(
            "--claim-timeout {}: give at least 1 second",
            args.claim_timeout
        );
    }
    let preview = super::preview_method(&args.runner.preview_method)?;
    let lib = Arc::new(sdkit_nodes::library());
    let exec = args
        .runner
        .executor(&args.runner.device, Arc::clone(&lib), paths)?;
    let id = args.name.clone().unwrap_or_else(default_name);
    let objects = match &args.output_store {
        Some(url) => Some(Arc::new(super::objects::open(url)?)),
        None => None,
    };
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    rt.block_on(async move {
        let store = Arc::new(cluster::connect(&args.queue).await?);
        let (tx, rx) = mpsc::unbounded_channel::<Out>();
        let w = Arc::new(Worker {
            id: id.clone(),
            store: Arc::clone(&store),
            paths: Arc::clone(exec.paths()),
            exec: Arc::new(exec),
            lib,
            preview,
            timeout: Duration::from_secs_f64(args.claim_timeout),
            state: Mutex::default(),
            out: tx,
            objects: objects.clone(),
            stopping: AtomicBool::new(false),
        });
        w.refresh_files();
        w.advertise().await;
        // Tests and scripts read this line.
        println!(
            "sdkit worker {id}: connected to {}",
            cluster::redact(&args.queue)
        );
        let publisher = tokio::spawn(publisher::run(
            Arc::clone(&store),
            objects,
            Arc::clone(&w.paths),
            rx,
        ));
        tokio::spawn(Arc::clone(&w).control());
        tokio::spawn(Arc::clone(&w).heartbeat());
        {
            let w = Arc::clone(&w);
            tokio::spawn(async move {
                shutdown_signal().await;
                eprintln!("sdkit worker: stopping after the prompt in progress");
                w.stopping.store(true, Ordering::SeqCst);
            });
        }
        Arc::clone(&w).take_prompts().await;
        let _ = store.retire(&w.id).await;
        drop(w);
        let _ = tokio::time::timeout(Duration::from_secs(5), publisher).await;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(0)
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

impl Worker {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn outbox(&self) -> ClusterOutbox {
        ClusterOutbox(self.out.clone())
    }

    /// Lists the model files this worker has (for the API's validation and
    /// the front end's lists).
    fn refresh_files(&self) {
        let mut files = HashMap::new();
        for folder in sdkit_engine::paths::MODEL_FOLDERS {
            files.insert(
                folder.to_string(),
                self.paths.options(&ComboOptions::Models(folder)),
            );
        }
        files.insert("vae_list".into(), self.paths.options(&ComboOptions::Vaes));
        let mut s = self.lock();
        if s.files != files {
            s.files = files;
            s.files_new = true;
        }
    }

    fn info(&self) -> WorkerInfo {
        let rt = self.exec.runtime();
        let (vram_total, vram_free) = super::routes::device_memory(rt);
        let s = self.lock();
        WorkerInfo {
            id: self.id.clone(),
            device: rt.describe(),
            vram_total,
            vram_free,
            state: if s.current.is_some() { "busy" } else { "idle" }.into(),
            resident: s.resident.clone(),
            jobs_done: s.jobs_done,
        }
    }

    /// The record lives three heartbeats (at least the claim timeout), so
    /// dispatch stops preferring a worker soon after it dies.
    async fn advertise(&self) {
        let ttl = self.timeout.max(Duration::from_secs(6));
        let files = {
            let mut s = self.lock();
            std::mem::take(&mut s.files_new).then(|| s.files.clone())
        };
        if let Err(e) = self
            .store
            .advertise(&self.info(), files.as_ref(), ttl)
            .await
        {
            tracing::warn!("cannot reach the cluster's Redis: {e}");
            // Sent again at the next beat.
            self.lock().files_new |= files.is_some();
        }
    }

    fn beat(&self) -> Duration {
        (self.timeout / 4).clamp(Duration::from_millis(250), Duration::from_secs(2))
    }

    /// Advertises this worker and keeps its token fresh.
    async fn heartbeat(self: Arc<Self>) {
        let mut n = 0u64;
        loop {
            tokio::time::sleep(self.beat()).await;
            n += 1;
            if n.is_multiple_of(8) {
                self.refresh_files();
            }
            self.advertise().await;
            let token = self.lock().current.as_ref().map(|c| c.token.clone());
            if let Some(token) = token {
                if let Ok(false) = self.store.keep(&token, &self.id).await {
                    let mut s = self.lock();
                    if let Some(c) = s.current.as_mut().filter(|c| c.token == token) {
                        tracing::warn!(
                            "prompt {} was taken over by another worker; stopping it here",
                            c.id
                        );
                        c.superseded = true;
                        c.cancel.cancel();
                    }
                }
            }
        }
    }

    /// Interrupts and `/free` from the API processes.
    async fn control(self: Arc<Self>) {
        self.store
            .listen("control", |payload| {
                let Ok(v) = serde_json::from_slice::<Json>(payload) else {
                    return;
                };
                if let Some(target) = v.get("interrupt") {
                    let s = self.lock();
                    if let Some(c) = &s.current {
                        if target.is_null() || target.as_str() == Some(c.id.as_str()) {
                            c.cancel.cancel();
                        }
                    }
                }
                if let Some(f) = v.get("free") {
                    let flag = |k: &str| f.get(k).and_then(Json::as_bool).unwrap_or(false);
                    if flag("unload_models") || flag("free_memory") {
                        self.lock().unload = true;
                    }
                }
            })
            .await
    }

    fn apply_free(&self) {
        let unload = std::mem::take(&mut self.lock().unload);
        if unload {
            super::queue::free_now(&self.exec);
            self.lock().resident.clear();
        }
    }

    /// A token to act on: one idle past the claim timeout (its worker is
    /// presumed dead), else a new one (waiting up to 2 s).
    async fn next_token(
        &self,
        reader: &mut redis::aio::MultiplexedConnection,
    ) -> redis::RedisResult<Option<String>> {
        let stream = self.store.key("jobs");
        let (_, claimed, _): (String, Vec<String>, Vec<String>) = redis::cmd("XAUTOCLAIM")
            .arg(&stream)
            .arg(GROUP)
            .arg(&self.id)
            .arg(self.timeout.as_millis() as u64)
            .arg("0-0")
            .arg("COUNT")
            .arg(1)
            .arg("JUSTID")
            .query_async(&mut self.store.conn())
            .await?;
        if let Some(t) = claimed.into_iter().next() {
            tracing::info!("taking over token {t}, idle past the claim timeout");
            return Ok(Some(t));
        }
        let reply: Option<redis::streams::StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg(&self.id)
            .arg("COUNT")
            .arg(1)
            .arg("BLOCK")
            .arg(2000)
            .arg("STREAMS")
            .arg(&stream)
            .arg(">")
            .query_async(reader)
            .await?;
        Ok(reply
            .and_then(|r| r.keys.into_iter().next())
            .and_then(|k| k.ids.into_iter().next())
            .map(|e| e.id))
    }

    async fn reader(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        // Its own connection: a blocked read would hold up every other
        // command on a shared one.
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_secs(10)))
            .set_connection_timeout(Some(Duration::from_secs(5)));
        self.store
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    async fn take_prompts(self: Arc<Self>) {
        let mut reader = None;
        while !self.stopping.load(Ordering::SeqCst) {
            self.apply_free();
            if reader.is_none() {
                match self.reader().await {
                    Ok(r) => reader = Some(r),
                    Err(e) => {
                        tracing::warn!("cannot reach the cluster's Redis: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                }
            }
            let Some(conn) = reader.as_mut() else {
                continue;
            };
            let token = match self.next_token(conn).await {
                Ok(Some(t)) => t,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!("cannot read the cluster's queue: {e}");
                    if e.code() == Some("NOGROUP") {
                        // Redis restarted without its data.
                        let _ = self.store.ensure_group().await;
                    }
                    reader = None;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            let resident = self.lock().resident.clone();
            match self.store.claim(&token, &self.id, &resident).await {
                Ok(Claim::Run { id, item, needs }) => {
                    if !self.hand_back(&token, &id, &needs).await {
                        self.run(token, id, item).await;
                    }
                }
                Ok(Claim::Skip) => {}
                Ok(Claim::Defer) => tokio::time::sleep(Duration::from_millis(200)).await,
                Err(e) => {
                    // The token stays pending and is taken over later.
                    tracing::warn!("cannot claim a prompt: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    /// Gives a prompt back to the queue when this worker lacks model files
    /// it needs and another live worker has them all; it will not be
    /// offered here again. Returns whether it was given back.
    async fn hand_back(&self, token: &str, id: &str, needs: &[String]) -> bool {
        let missing: Vec<&String> = needs.iter().filter(|f| !has_file(&self.paths, f)).collect();
        if missing.is_empty() {
            return false;
        }
        let others = self.store.worker_files().await.unwrap_or_default();
        let elsewhere = others.iter().any(|(id, files)| {
            *id != self.id
                && missing.iter().all(|f| {
                    f.split_once('/').is_some_and(|(folder, name)| {
                        files
                            .get(folder)
                            .is_some_and(|l| l.iter().any(|n| n == name))
                    })
                })
        });
        if !elsewhere {
            // Nobody has them: run it here, to fail with the reason.
            return false;
        }
        match self.store.give_back(id, token, &self.id).await {
            Ok(true) => {
                tracing::info!(
                    "prompt {id} needs {} which this worker lacks; given back",
                    missing
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                true
            }
            _ => false,
        }
    }

    async fn run(&self, token: String, id: String, record: Json) {
        let cancel = CancelToken::new();
        self.lock().current = Some(Current {
            id: id.clone(),
            token: token.clone(),
            cancel: cancel.clone(),
            superseded: false,
        });
        self.advertise().await;
        self.store.publish_status().await;
        let outbox = self.outbox();
        let (done, item, ok) = match Item::from_record(&record) {
            None => {
                let item = Item {
                    number: 0.0,
                    prompt_id: id.clone(),
                    prompt: json!({}),
                    extra_data: Default::default(),
                    outputs: Vec::new(),
                    graph: None,
                    seq: 0,
                };
                let done = self.refused(&item, "the queued prompt is unreadable");
                (done, item, false)
            }
            Some(item) => match self.graph(&item).await {
                Err(msg) => {
                    let msg = format!("worker {}: {msg}", self.id);
                    (self.refused(&item, &msg), item, false)
                }
                Ok(graph) => {
                    let parts = RunParts::new(&item.prompt_id, &item.extra_data, cancel);
                    let done = run_prompt(
                        &self.exec,
                        &graph,
                        parts,
                        Arc::new(self.outbox()),
                        self.preview,
                        Arc::new(|_| {}),
                    )
                    .await;
                    let ok = done.status.get("completed") == Some(&json!(true));
                    if ok {
                        self.lock().resident = routed(&model_files(&graph, &self.lib));
                    }
                    (done, item, ok)
                }
            },
        };
        let superseded = self.lock().current.as_ref().is_some_and(|c| c.superseded);
        let client = item.client_id();
        let mut done = done;
        let last = done.last.take();
        if !superseded {
            // Outputs are stored (and maybe renamed) as their messages
            // go out; the history names them as the store does.
            let renames = outbox.flush().await;
            let mut entry = item.history_entry(done);
            super::objects::rename_outputs(&mut entry["outputs"], &renames);
            // Which worker ran it (ComfyUI's clients read the known keys).
            entry["worker"] = json!(self.id);
            // A result is never dropped for a Redis hiccup: retry until it
            // is recorded (the token stays fresh meanwhile).
            loop {
                match self.store.finish(&id, &token, &entry).await {
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!("cannot record prompt {id} yet: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
            if let Some(m) = last {
                outbox.send_text(client.as_deref(), m);
            }
        }
        {
            let mut s = self.lock();
            s.current = None;
            if ok {
                s.jobs_done += 1;
            }
        }
        self.advertise().await;
        if let Ok(info) = self.store.info().await {
            outbox.send_text(None, json!({"type": "status", "data": {"status": info}}));
        }
    }

    /// The prompt's graph, once the input files it loads are here (from
    /// the output store, when they are not).
    async fn graph(&self, item: &Item) -> Result<Graph, String> {
        if let Some(o) = &self.objects {
            for (ty, sub, name) in input_files(&item.prompt, &self.lib) {
                let Some(dir) = publisher::folder(&self.paths, &ty) else {
                    continue;
                };
                let dest = dir.join(&sub).join(&name);
                if super::objects::key(&ty, &sub, &name).is_none() || dest.exists() {
                    continue;
                }
                if let Err(e) = o.fetch(&ty, &sub, &name, &dest).await {
                    tracing::warn!("{e:#}");
                }
            }
        }
        graph_of(item, &self.lib, &self.paths)
    }

    /// A prompt this worker cannot run: its error messages and history.
    fn refused(&self, item: &Item, msg: &str) -> super::prompt_run::Finished {
        let client = item.client_id();
        let now = sdkit_engine::event::now_ms();
        let start = json!({"prompt_id": item.prompt_id, "timestamp": now});
        let error = json!({
            "prompt_id": item.prompt_id, "node_id": "", "node_type": "",
            "executed": [], "exception_message": msg, "exception_type": "ValueError",
            "traceback": [], "current_inputs": {}, "current_outputs": {}, "timestamp": now,
        });
        let outbox = self.outbox();
        outbox.send_text(
            client.as_deref(),
            json!({"type": "execution_start", "data": start}),
        );
        outbox.send_text(
            client.as_deref(),
            json!({"type": "execution_error", "data": error}),
        );
        let mut done = failed_or_done(
            json!({}),
            false,
            vec![
                json!(["execution_start", start]),
                json!(["execution_error", error]),
            ],
        );
        done.last = Some(json!({"type": "executing", "data": {
            "node": null, "display_node": null, "prompt_id": item.prompt_id}}));
        done
    }
}
