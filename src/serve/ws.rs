//! WebSocket clients: `/ws?clientId=…`. A client gets `status` (with its
//! `sid`) on connecting, queue changes with everyone, and the execution
//! messages of the prompts it queued; prompts queued without a client id
//! are told to everyone, as ComfyUI does.

use super::Server;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value as Json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::mpsc;

/// Messages a slow client may fall behind by before it is disconnected
/// (a client that stopped reading must not grow the server's memory).
const BACKLOG: usize = 4096;

/// One connected socket: its outgoing queue, and whether it announced
/// (in its `feature_flags`) that it reads previews with metadata.
struct Client {
    tx: mpsc::Sender<Message>,
    preview_metadata: bool,
}

/// ComfyUI's binary event types.
const PREVIEW_IMAGE: u32 = 1;
const PREVIEW_IMAGE_WITH_METADATA: u32 = 4;
/// Image format number inside a type-1 frame: JPEG.
const JPEG: u32 = 1;

#[derive(Default)]
pub struct Clients {
    map: Mutex<HashMap<String, Client>>,
}

impl Clients {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Client>> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends `msg` to `client`, or to everyone for None.
    pub fn send(&self, client: Option<&str>, msg: Json) {
        let text = Message::Text(msg.to_string().into());
        self.send_each(client, |_| text.clone());
    }

    /// Whether a message for `client` (everyone for None) has a reader:
    /// previews are not encoded for nobody.
    pub fn any_for(&self, client: Option<&str>) -> bool {
        let map = self.lock();
        match client {
            Some(id) => map.contains_key(id),
            None => !map.is_empty(),
        }
    }

    /// A sampler preview (JPEG bytes) as ComfyUI sends it: type 4 with
    /// `metadata` (plus `image_type`) to clients that announced
    /// `supports_preview_metadata`, else type 1 (format number, image).
    pub fn send_preview(&self, client: Option<&str>, jpeg: &[u8], metadata: &Json) {
        let mut meta = metadata.clone();
        if let Some(m) = meta.as_object_mut() {
            m.insert("image_type".into(), json!("image/jpeg"));
        }
        let meta = meta.to_string();
        let with_meta = {
            let mut b = Vec::with_capacity(8 + meta.len() + jpeg.len());
            b.extend_from_slice(&PREVIEW_IMAGE_WITH_METADATA.to_be_bytes());
            b.extend_from_slice(&(meta.len() as u32).to_be_bytes());
            b.extend_from_slice(meta.as_bytes());
            b.extend_from_slice(jpeg);
            axum::body::Bytes::from(b)
        };
        let plain = {
            let mut b = Vec::with_capacity(8 + jpeg.len());
            b.extend_from_slice(&PREVIEW_IMAGE.to_be_bytes());
            b.extend_from_slice(&JPEG.to_be_bytes());
            b.extend_from_slice(jpeg);
            axum::body::Bytes::from(b)
        };
        self.send_each(client, |c| {
            Message::Binary(if c.preview_metadata {
                with_meta.clone()
            } else {
                plain.clone()
            })
        });
    }

    /// Queues `make(client)` on `client`'s socket, or on every socket.
    fn send_each(&self, client: Option<&str>, make: impl Fn(&Client) -> Message) {
        let mut map = self.lock();
        let mut dead = Vec::new();
        match client {
            Some(id) => {
                if let Some(c) = map.get(id) {
                    if c.tx.try_send(make(c)).is_err() {
                        dead.push(id.to_string());
                    }
                }
            }
            None => {
                for (id, c) in map.iter() {
                    if c.tx.try_send(make(c)).is_err() {
                        dead.push(id.clone());
                    }
                }
            }
        }
        for id in dead {
            // Closed, or too far behind: its writer task ends when the
            // sender is dropped.
            map.remove(&id);
        }
    }

    /// A `status` message (`info`: the queue's size) for everyone.
    pub fn broadcast_status(&self, info: Json) {
        self.send(None, json!({"type": "status", "data": {"status": info}}));
    }
}

#[derive(serde::Deserialize)]
pub struct WsQuery {
    #[serde(rename = "clientId")]
    client_id: Option<String>,
}

pub async fn handler(
    ws: WebSocketUpgrade,
    Query(q): Query<WsQuery>,
    State(server): State<Arc<Server>>,
) -> Response {
    let sid = q
        .client_id
        .filter(|s| !s.is_empty() && s.len() <= 256)
        .unwrap_or_else(|| sdkit_engine::exec::new_prompt_id().replace('-', ""));
    ws.on_upgrade(move |socket| client(socket, sid, server))
}

async fn client(socket: WebSocket, sid: String, server: Arc<Server>) {
    let (mut sink, mut stream) = socket.split();
    let (tx, mut rx) = mpsc::channel::<Message>(BACKLOG);
    // A reconnect with the same id replaces the old socket.
    server.clients.lock().insert(
        sid.clone(),
        Client {
            tx: tx.clone(),
            preview_metadata: false,
        },
    );
    let info = server
        .queue
        .info()
        .await
        .unwrap_or_else(|_| json!({"exec_info": {"queue_remaining": 0}}));
    let hello = json!({"type": "status", "data": {"status": info, "sid": sid}});
    let _ = tx.try_send(Message::Text(hello.to_string().into()));
    if let Some((prompt_id, Some(node))) = server.queue.running_for(&sid).await {
        let msg = json!({"type": "executing", "data": {"node": node, "display_node": node, "prompt_id": prompt_id}});
        let _ = tx.try_send(Message::Text(msg.to_string().into()));
    }
    let writer = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if sink.send(m).await.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    });
    let mut first = true;
    while let Some(Ok(msg)) = stream.next().await {
        match msg {
            Message::Text(text) => {
                // The front end opens with its feature flags; answer with
                // the server's.
                if first {
                    let parsed: Option<Json> = serde_json::from_str(text.as_str()).ok();
                    if parsed
                        .as_ref()
                        .and_then(|v| v.get("type"))
                        .and_then(Json::as_str)
                        == Some("feature_flags")
                    {
                        let wants_meta = parsed
                            .as_ref()
                            .and_then(|v| v.pointer("/data/supports_preview_metadata"))
                            .and_then(Json::as_bool)
                            .unwrap_or(false);
                        if let Some(c) = server.clients.lock().get_mut(&sid) {
                            if c.tx.same_channel(&tx) {
                                c.preview_metadata = wants_meta;
                            }
                        }
                        let flags = json!({"type": "feature_flags", "data": super::routes::features(&server)});
                        let _ = tx.try_send(Message::Text(flags.to_string().into()));
                    }
                }
                first = false;
            }
            Message::Close(_) => break,
            _ => {}
        }
    }
    {
        let mut map = server.clients.lock();
        if map.get(&sid).is_some_and(|c| c.tx.same_channel(&tx)) {
            map.remove(&sid);
        }
    }
    drop(tx);
    let _ = writer.await;
}

impl super::prompt_run::Outbox for Clients {
    fn text(&self, client: Option<&str>, msg: Json) {
        self.send(client, msg);
    }

    fn preview(&self, client: Option<&str>, jpeg: &[u8], meta: &Json) {
        self.send_preview(client, jpeg, meta);
    }

    fn wants_previews(&self, client: Option<&str>) -> bool {
        self.any_for(client)
    }
}
