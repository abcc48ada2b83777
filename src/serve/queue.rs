//! The prompt queue, the history and the one worker that drains them, with
//! ComfyUI's semantics (execution.py's PromptQueue): items ordered by
//! `number` (a `front` prompt gets a negative one), a history of at most
//! 10 000 prompts in completion order, `/free` requests applied between
//! runs.

use super::Server;
use sdkit_engine::{CancelToken, Event, EventSink, Graph, RunError, RunOptions};
use serde_json::{json, Map, Value as Json};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// ComfyUI's MAXIMUM_HISTORY_SIZE.
const MAX_HISTORY: usize = 10_000;
/// extra_data keys never kept in the history (ComfyUI's
/// SENSITIVE_EXTRA_DATA_KEYS).
const SENSITIVE: &[&str] = &["auth_token_comfy_org", "api_key_comfy_org"];

/// One queued prompt.
pub struct Item {
    pub number: f64,
    pub prompt_id: String,
    pub prompt: Json,
    pub extra_data: Map<String, Json>,
    /// Output node ids, as ComfyUI's `outputs_to_execute`.
    pub outputs: Vec<String>,
    pub graph: Arc<Graph>,
    seq: u64,
}

impl Item {
    pub fn new(
        number: f64,
        prompt_id: String,
        prompt: Json,
        extra_data: Map<String, Json>,
        graph: Graph,
    ) -> Item {
        let outputs = graph
            .outputs()
            .into_iter()
            .map(|i| graph.nodes[i].id.clone())
            .collect();
        Item {
            number,
            prompt_id,
            prompt,
            extra_data,
            outputs,
            graph: Arc::new(graph),
            seq: 0,
        }
    }

    pub fn client_id(&self) -> Option<String> {
        self.extra_data
            .get("client_id")
            .and_then(Json::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    }

    /// `[number, prompt_id, prompt, extra_data, outputs_to_execute]`.
    fn to_json(&self) -> Json {
        json!([
            number_json(self.number),
            self.prompt_id,
            self.prompt,
            self.extra_data,
            self.outputs
        ])
    }
}

/// Integral numbers as JSON integers (ComfyUI's counter is an int).
pub fn number_json(n: f64) -> Json {
    if n.fract() == 0.0 && n.abs() < 9.0e15 {
        json!(n as i64)
    } else {
        json!(n)
    }
}

struct Running {
    item: Item,
    cancel: CancelToken,
    last_node: Option<String>,
    /// When it started, ms since the epoch (the jobs API's start time).
    started_ms: u64,
}

#[derive(Default)]
struct Inner {
    pending: Vec<Item>,
    running: Option<Running>,
    history: Map<String, Json>,
    counter: i64,
    seq: u64,
    unload_models: bool,
    free_memory: bool,
}

#[derive(Default)]
pub struct Queue {
    inner: Mutex<Inner>,
    wake: Notify,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The number a new prompt gets (ComfyUI: a counter, negated for
    /// `front`, or the client's own `number`).
    pub fn number(&self, given: Option<f64>, front: bool) -> f64 {
        let mut q = self.lock();
        if let Some(n) = given {
            return n;
        }
        let n = q.counter as f64;
        q.counter += 1;
        if front {
            -n
        } else {
            n
        }
    }

    pub fn push(&self, mut item: Item) {
        {
            let mut q = self.lock();
            q.seq += 1;
            item.seq = q.seq;
            q.pending.push(item);
            // Lowest number first; equal numbers in arrival order.
            q.pending.sort_by(|a, b| {
                a.number
                    .total_cmp(&b.number)
                    .then_with(|| a.seq.cmp(&b.seq))
            });
        }
        self.wake.notify_one();
    }

    /// Prompts pending or running.
    pub fn remaining(&self) -> usize {
        let q = self.lock();
        q.pending.len() + usize::from(q.running.is_some())
    }

    /// `{"exec_info": {"queue_remaining": N}}`.
    pub fn info(&self) -> Json {
        json!({"exec_info": {"queue_remaining": self.remaining()}})
    }

    pub fn to_json(&self) -> Json {
        let q = self.lock();
        json!({
            "queue_running": q.running.iter().map(|r| r.item.to_json()).collect::<Vec<_>>(),
            "queue_pending": q.pending.iter().map(Item::to_json).collect::<Vec<_>>(),
        })
    }

    pub fn clear_pending(&self) {
        self.lock().pending.clear();
    }

    pub fn delete_pending(&self, ids: &[String]) {
        self.lock().pending.retain(|i| !ids.contains(&i.prompt_id));
    }

    /// Interrupts the running prompt (only if it is `prompt_id`, when given).
    /// Returns whether one was interrupted.
    pub fn interrupt(&self, prompt_id: Option<&str>) -> bool {
        let q = self.lock();
        match &q.running {
            Some(r) if prompt_id.is_none_or(|p| p == r.item.prompt_id) => {
                r.cancel.cancel();
                true
            }
            _ => false,
        }
    }

    /// The running prompt's id and client, and the node it is executing.
    pub fn running_for(&self, client: &str) -> Option<(String, Option<String>)> {
        let q = self.lock();
        let r = q.running.as_ref()?;
        (r.item.client_id().as_deref() == Some(client))
            .then(|| (r.item.prompt_id.clone(), r.last_node.clone()))
    }

    fn set_last_node(&self, node: Option<String>) {
        if let Some(r) = self.lock().running.as_mut() {
            r.last_node = node;
        }
    }

    /// ComfyUI's get_history: the last `max_items` (from `offset` when
    /// given), or one prompt.
    pub fn history(&self, max_items: Option<usize>, offset: Option<usize>) -> Json {
        let q = self.lock();
        let n = q.history.len();
        let start = match (offset, max_items) {
            (Some(o), _) => o,
            (None, Some(m)) => n.saturating_sub(m),
            (None, None) => 0,
        };
        let take = max_items.unwrap_or(usize::MAX);
        Json::Object(
            q.history
                .iter()
                .skip(start)
                .take(take)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        )
    }

    /// Every prompt as a jobs-API list record: pending, running, then the
    /// history in completion order.
    pub fn job_records(&self) -> Vec<Json> {
        let q = self.lock();
        let mut jobs: Vec<Json> = q
            .pending
            .iter()
            .map(|i| super::jobs::from_item(i, "pending", None, false))
            .collect();
        if let Some(r) = &q.running {
            jobs.push(super::jobs::from_item(
                &r.item,
                "in_progress",
                Some(r.started_ms),
                false,
            ));
        }
        jobs.extend(
            q.history
                .iter()
                .map(|(id, h)| super::jobs::from_history(id, h, false)),
        );
        jobs
    }

    /// One job's detail record.
    pub fn job_detail(&self, id: &str) -> Option<Json> {
        let q = self.lock();
        if let Some(h) = q.history.get(id) {
            return Some(super::jobs::from_history(id, h, true));
        }
        if let Some(r) = q.running.as_ref().filter(|r| r.item.prompt_id == id) {
            return Some(super::jobs::from_item(
                &r.item,
                "in_progress",
                Some(r.started_ms),
                true,
            ));
        }
        q.pending
            .iter()
            .find(|i| i.prompt_id == id)
            .map(|i| super::jobs::from_item(i, "pending", None, true))
    }

    pub fn history_one(&self, prompt_id: &str) -> Json {
        let q = self.lock();
        let mut m = Map::new();
        if let Some(h) = q.history.get(prompt_id) {
            m.insert(prompt_id.to_string(), h.clone());
        }
        Json::Object(m)
    }

    pub fn clear_history(&self) {
        self.lock().history.clear();
    }

    pub fn delete_history(&self, ids: &[String]) {
        let mut q = self.lock();
        for id in ids {
            q.history.shift_remove(id);
        }
    }

    /// `/free`: done before the next prompt (now, when idle).
    pub fn request_free(&self, unload_models: bool, free_memory: bool) {
        {
            let mut q = self.lock();
            q.unload_models |= unload_models;
            q.free_memory |= free_memory;
        }
        self.wake.notify_one();
    }

    fn take_free(&self) -> (bool, bool) {
        let mut q = self.lock();
        (
            std::mem::take(&mut q.unload_models),
            std::mem::take(&mut q.free_memory),
        )
    }

    /// Moves the first pending prompt to running.
    fn start_next(&self) -> Option<(Arc<Graph>, RunOptionsParts)> {
        let mut q = self.lock();
        if q.pending.is_empty() {
            return None;
        }
        let item = q.pending.remove(0);
        let cancel = CancelToken::new();
        let parts = RunOptionsParts {
            prompt_id: item.prompt_id.clone(),
            client: item.client_id(),
            extra_pnginfo: item
                .extra_data
                .get("extra_pnginfo")
                .and_then(Json::as_object)
                .cloned()
                .unwrap_or_default(),
            cancel: cancel.clone(),
        };
        let graph = Arc::clone(&item.graph);
        q.running = Some(Running {
            item,
            cancel,
            last_node: None,
            started_ms: sdkit_engine::event::now_ms(),
        });
        Some((graph, parts))
    }

    /// Ends the running prompt with its history entry.
    fn finish(&self, outputs: Json, status: Json, meta: Json) {
        let mut q = self.lock();
        let Some(r) = q.running.take() else {
            return;
        };
        let mut item = r.item;
        for k in SENSITIVE {
            item.extra_data.remove(*k);
        }
        while q.history.len() >= MAX_HISTORY {
            let Some(oldest) = q.history.keys().next().cloned() else {
                break;
            };
            q.history.shift_remove(&oldest);
        }
        q.history.insert(
            item.prompt_id.clone(),
            json!({
                "prompt": item.to_json(),
                "outputs": outputs,
                "status": status,
                "meta": meta,
            }),
        );
    }
}

/// ComfyUI's `--preview-size` default: previews are scaled to fit it.
const PREVIEW_SIZE: u32 = 512;

/// A preview as JPEG (quality 95), scaled to fit PREVIEW_SIZE² keeping
/// its aspect ratio as ComfyUI's `ImageOps.contain(..., BILINEAR)` does
/// (Pillow's resampling, bit for bit).
fn preview_jpeg(p: &sdkit_engine::event::PreviewImage) -> Option<Vec<u8>> {
    use sdkit_nodes::imageops::{pil_contain_size, pil_resize_rgb, PilFilter};
    let (w, h) = (p.width as usize, p.height as usize);
    if w == 0 || h == 0 || p.rgb.len() != w * h * 3 {
        return None;
    }
    let (nw, nh) = pil_contain_size(w, h, PREVIEW_SIZE as usize);
    let px = pil_resize_rgb(&p.rgb, w, h, nw.max(1), nh.max(1), PilFilter::Bilinear);
    let img = image::RgbImage::from_raw(nw.max(1) as u32, nh.max(1) as u32, px)?;
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 95)
        .encode_image(&img)
        .ok()?;
    Some(out)
}

struct RunOptionsParts {
    prompt_id: String,
    client: Option<String>,
    extra_pnginfo: Map<String, Json>,
    cancel: CancelToken,
}

/// Drains the queue forever, one prompt at a time.
pub async fn worker(server: Arc<Server>) {
    loop {
        apply_free(&server);
        let Some((graph, parts)) = server.queue.start_next() else {
            server.queue.wake.notified().await;
            continue;
        };
        server.clients.broadcast_status(&server.queue);
        run_one(&server, &graph, parts).await;
        server.clients.broadcast_status(&server.queue);
    }
}

fn apply_free(server: &Server) {
    let (unload, free) = server.queue.take_free();
    if unload || free {
        // Cached node outputs hold the models; dropping them and the
        // device's resident weights gives the memory back.
        server.exec.clear_cache();
        server.exec.runtime().free();
        tracing::info!("freed cached models and device memory");
    }
}

async fn run_one(server: &Arc<Server>, graph: &Graph, parts: RunOptionsParts) {
    let messages: Arc<Mutex<Vec<Json>>> = Arc::default();
    let events: EventSink = {
        let server = Arc::clone(server);
        let messages = Arc::clone(&messages);
        let client = parts.client.clone();
        Arc::new(move |ev: &Event| {
            let Ok(msg) = serde_json::to_value(ev) else {
                return;
            };
            let data = msg.get("data").cloned().unwrap_or(Json::Null);
            match ev {
                Event::ExecutionStart { .. }
                | Event::ExecutionCached { .. }
                | Event::ExecutionSuccess { .. }
                | Event::ExecutionError { .. }
                | Event::ExecutionInterrupted { .. } => {
                    if let Ok(mut m) = messages.lock() {
                        m.push(json!([ev.name(), data]));
                    }
                }
                Event::Executing { node, .. } => server.queue.set_last_node(node.clone()),
                Event::Preview {
                    prompt_id,
                    node,
                    image,
                } => {
                    // Pixels go out as a binary frame, never as JSON; the
                    // encoding (a few ms) is skipped when nobody listens.
                    if !server.clients.any_for(client.as_deref()) {
                        return;
                    }
                    if let Some(jpeg) = preview_jpeg(image) {
                        let meta = json!({
                            "node_id": node, "prompt_id": prompt_id, "display_node_id": node,
                            "parent_node_id": null, "real_node_id": node,
                        });
                        server.clients.send_preview(client.as_deref(), &jpeg, &meta);
                    }
                    return;
                }
                _ => {}
            }
            server.clients.send(client.as_deref(), msg);
            if let Event::Progress {
                value,
                max,
                prompt_id,
                node,
            } = ev
            {
                // The newer front ends read per-node progress from this.
                let state = json!({
                    "type": "progress_state",
                    "data": {"prompt_id": prompt_id, "nodes": {node: {
                        "value": value, "max": max, "state": "running", "node_id": node,
                        "prompt_id": prompt_id, "display_node_id": node,
                        "parent_node_id": null, "real_node_id": node,
                    }}},
                });
                server.clients.send(client.as_deref(), state);
            }
        })
    };
    let opts = RunOptions {
        prompt_id: parts.prompt_id.clone(),
        extra_pnginfo: parts.extra_pnginfo,
        events,
        cancel: parts.cancel,
        preview: server.preview,
    };
    let result = server.exec.run(graph, opts).await;
    let (outputs, ok) = match &result {
        Ok(report) => (
            Json::Object(
                report
                    .outputs
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            ),
            true,
        ),
        Err(e) => {
            match e {
                RunError::Interrupted => tracing::info!("prompt {} interrupted", parts.prompt_id),
                RunError::Node { .. } => tracing::warn!("prompt {}: {e}", parts.prompt_id),
            }
            (json!({}), false)
        }
    };
    let meta: Map<String, Json> = outputs
        .as_object()
        .map(|o| {
            o.keys()
                .map(|k| {
                    (
                        k.clone(),
                        json!({"node_id": k, "display_node": k, "parent_node": null, "real_node_id": k}),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let messages = messages.lock().map(|m| m.clone()).unwrap_or_default();
    let status = json!({
        "status_str": if ok { "success" } else { "error" },
        "completed": ok,
        "messages": messages,
    });
    server.queue.finish(outputs, status, Json::Object(meta));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn previews_become_jpeg_scaled_to_fit() {
        let p = sdkit_engine::event::PreviewImage {
            width: 16,
            height: 8,
            rgb: Arc::new(vec![200; 16 * 8 * 3]),
        };
        let jpeg = preview_jpeg(&p).expect("encodes");
        let img = image::load_from_memory(&jpeg).expect("decodes");
        assert_eq!((img.width(), img.height()), (512, 256));
    }
}
