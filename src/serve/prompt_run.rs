//! Running one queued prompt: the executor's events become ComfyUI's
//! WebSocket messages, sent through an [`Outbox`] (this process's sockets,
//! or a Redis channel for a cluster worker), and the result becomes the
//! prompt's history entry. The embedded queue and `sdkit worker` share it.

use sdkit_engine::{CancelToken, Event, EventSink, Executor, Graph, RunError, RunOptions};
use serde_json::{json, Map, Value as Json};
use std::sync::{Arc, Mutex};

/// Where a run's messages go.
pub trait Outbox: Send + Sync + 'static {
    /// A JSON message for `client` (everyone for None).
    fn text(&self, client: Option<&str>, msg: Json);
    /// A sampler preview (JPEG) with ComfyUI's preview metadata.
    fn preview(&self, client: Option<&str>, jpeg: &[u8], meta: &Json);
    /// Whether anyone would read a preview for `client`: encoding one
    /// takes a few ms, skipped when nobody listens.
    fn wants_previews(&self, client: Option<&str>) -> bool;
}

/// What a run needs besides its graph.
pub struct RunParts {
    pub prompt_id: String,
    pub client: Option<String>,
    pub extra_pnginfo: Map<String, Json>,
    pub cancel: CancelToken,
}

impl RunParts {
    pub fn new(prompt_id: &str, extra_data: &Map<String, Json>, cancel: CancelToken) -> Self {
        RunParts {
            prompt_id: prompt_id.to_string(),
            client: client_id(extra_data),
            extra_pnginfo: extra_data
                .get("extra_pnginfo")
                .and_then(Json::as_object)
                .cloned()
                .unwrap_or_default(),
            cancel,
        }
    }
}

/// The `client_id` a prompt was queued with (None: tell everyone).
pub fn client_id(extra_data: &Map<String, Json>) -> Option<String> {
    extra_data
        .get("client_id")
        .and_then(Json::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// A finished prompt's history fields (besides `prompt`).
pub struct Finished {
    pub outputs: Json,
    pub status: Json,
    pub meta: Json,
    /// The run's last message, `executing` with a null node: held back
    /// until the history entry is recorded, as ComfyUI sends it after
    /// `task_done`, so a client that reads `/history` on it finds the entry.
    pub last: Option<Json>,
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

/// Runs `graph`, sending its messages through `outbox`; `on_node` hears
/// each node as it starts (None at the end).
pub async fn run_prompt(
    exec: &Executor,
    graph: &Graph,
    parts: RunParts,
    outbox: Arc<dyn Outbox>,
    preview: sdkit_engine::event::PreviewMethod,
    on_node: Arc<dyn Fn(Option<String>) + Send + Sync>,
) -> Finished {
    let messages: Arc<Mutex<Vec<Json>>> = Arc::default();
    let last: Arc<Mutex<Option<Json>>> = Arc::default();
    let events: EventSink = {
        let messages = Arc::clone(&messages);
        let last = Arc::clone(&last);
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
                Event::Executing { node: None, .. } => {
                    on_node(None);
                    if let Ok(mut l) = last.lock() {
                        *l = Some(msg);
                    }
                    return;
                }
                Event::Executing { node, .. } => on_node(node.clone()),
                Event::Preview {
                    prompt_id,
                    node,
                    image,
                } => {
                    // Pixels go out as a binary frame, never as JSON.
                    if !outbox.wants_previews(client.as_deref()) {
                        return;
                    }
                    if let Some(jpeg) = preview_jpeg(image) {
                        let meta = json!({
                            "node_id": node, "prompt_id": prompt_id, "display_node_id": node,
                            "parent_node_id": null, "real_node_id": node,
                        });
                        outbox.preview(client.as_deref(), &jpeg, &meta);
                    }
                    return;
                }
                _ => {}
            }
            outbox.text(client.as_deref(), msg);
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
                outbox.text(client.as_deref(), state);
            }
        })
    };
    let opts = RunOptions {
        prompt_id: parts.prompt_id.clone(),
        extra_pnginfo: parts.extra_pnginfo,
        events,
        cancel: parts.cancel,
        preview,
    };
    let result = exec.run(graph, opts).await;
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
    let messages = messages.lock().map(|m| m.clone()).unwrap_or_default();
    let mut done = failed_or_done(outputs, ok, messages);
    done.last = last.lock().ok().and_then(|mut l| l.take());
    done
}

/// The history fields of a prompt that ended with `outputs` and the
/// execution `messages` it sent.
pub fn failed_or_done(outputs: Json, ok: bool, messages: Vec<Json>) -> Finished {
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
    let status = json!({
        "status_str": if ok { "success" } else { "error" },
        "completed": ok,
        "messages": messages,
    });
    Finished {
        outputs,
        status,
        meta: Json::Object(meta),
        last: None,
    }
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
