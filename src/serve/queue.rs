//! The prompt queue, the history and the one worker that drains them, with
//! ComfyUI's semantics (execution.py's PromptQueue): items ordered by
//! `number` (a `front` prompt gets a negative one), a history of at most
//! 10 000 prompts in completion order, `/free` requests applied between
//! runs.

use super::prompt_run::{run_prompt, Finished, Outbox, RunParts};
use super::Server;
use sdkit_engine::{CancelToken, Graph};
use serde_json::{json, Map, Value as Json};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// ComfyUI's MAXIMUM_HISTORY_SIZE.
pub const MAX_HISTORY: usize = 10_000;
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
    /// The validated graph; None for an item read back from a cluster's
    /// store (its worker validates the prompt again).
    pub graph: Option<Arc<Graph>>,
    /// Arrival order among equal numbers.
    pub seq: u64,
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
            graph: Some(Arc::new(graph)),
            seq: 0,
        }
    }

    pub fn client_id(&self) -> Option<String> {
        super::prompt_run::client_id(&self.extra_data)
    }

    /// The item as a cluster stores it (no graph; the store keeps the
    /// arrival order itself).
    pub fn record(&self) -> Json {
        json!({
            "number": self.number,
            "prompt_id": self.prompt_id,
            "prompt": self.prompt,
            "extra_data": self.extra_data,
            "outputs": self.outputs,
        })
    }

    /// An item from [`Item::record`]'s form.
    pub fn from_record(v: &Json) -> Option<Item> {
        Some(Item {
            number: v.get("number")?.as_f64()?,
            prompt_id: v.get("prompt_id")?.as_str()?.to_string(),
            prompt: v.get("prompt")?.clone(),
            extra_data: v.get("extra_data")?.as_object()?.clone(),
            outputs: v
                .get("outputs")?
                .as_array()?
                .iter()
                .filter_map(|o| o.as_str().map(str::to_string))
                .collect(),
            graph: None,
            seq: 0,
        })
    }

    /// Its history entry once it ended with `done`; credentials in
    /// `extra_data` are left out.
    pub fn history_entry(mut self, done: Finished) -> Json {
        for k in SENSITIVE {
            self.extra_data.remove(*k);
        }
        json!({
            "prompt": self.to_json(),
            "outputs": done.outputs,
            "status": done.status,
            "meta": done.meta,
        })
    }

    /// `[number, prompt_id, prompt, extra_data, outputs_to_execute]`.
    pub fn to_json(&self) -> Json {
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
    fn start_next(&self) -> Option<(Arc<Graph>, RunParts)> {
        let mut q = self.lock();
        let graph = Arc::clone(q.pending.first()?.graph.as_ref()?);
        let item = q.pending.remove(0);
        let cancel = CancelToken::new();
        let parts = RunParts::new(&item.prompt_id, &item.extra_data, cancel.clone());
        q.running = Some(Running {
            item,
            cancel,
            last_node: None,
            started_ms: sdkit_engine::event::now_ms(),
        });
        Some((graph, parts))
    }

    /// Ends the running prompt with its history entry.
    fn finish(&self, done: Finished) {
        let mut q = self.lock();
        let Some(r) = q.running.take() else {
            return;
        };
        let item = r.item;
        while q.history.len() >= MAX_HISTORY {
            let Some(oldest) = q.history.keys().next().cloned() else {
                break;
            };
            q.history.shift_remove(&oldest);
        }
        q.history
            .insert(item.prompt_id.clone(), item.history_entry(done));
    }
}

/// Drains the queue forever, one prompt at a time.
pub async fn worker(server: Arc<Server>, queue: Arc<Queue>) {
    loop {
        apply_free(&server, &queue);
        let Some((graph, parts)) = queue.start_next() else {
            queue.wake.notified().await;
            continue;
        };
        server.broadcast_status().await;
        let on_node: Arc<dyn Fn(Option<String>) + Send + Sync> = {
            let queue = Arc::clone(&queue);
            Arc::new(move |node| queue.set_last_node(node))
        };
        let outbox: Arc<dyn Outbox> = server.clients.clone();
        let client = parts.client.clone();
        let mut done =
            run_prompt(&server.exec, &graph, parts, outbox, server.preview, on_node).await;
        let last = done.last.take();
        queue.finish(done);
        if let Some(m) = last {
            server.clients.send(client.as_deref(), m);
        }
        server.broadcast_status().await;
    }
}

fn apply_free(server: &Server, queue: &Queue) {
    let (unload, free) = queue.take_free();
    if unload || free {
        free_now(&server.exec);
    }
}

/// `/free`: cached node outputs hold the models; dropping them and the
/// device's resident weights gives the memory back.
pub fn free_now(exec: &sdkit_engine::Executor) {
    exec.clear_cache();
    exec.runtime().free();
    tracing::info!("freed cached models and device memory");
}
