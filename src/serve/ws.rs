//! WebSocket clients: `/ws?clientId=…`. A client gets `status` (with its
//! `sid`) on connecting, queue changes with everyone, and the execution
//! messages of the prompts it queued; prompts queued without a client id
//! are told to everyone, as ComfyUI does.

use super::queue::Queue;
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

#[derive(Default)]
pub struct Clients {
    map: Mutex<HashMap<String, mpsc::Sender<Message>>>,
}

impl Clients {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, mpsc::Sender<Message>>> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends `msg` to `client`, or to everyone for None.
    pub fn send(&self, client: Option<&str>, msg: Json) {
        let text = Message::Text(msg.to_string().into());
        let mut map = self.lock();
        let mut dead = Vec::new();
        match client {
            Some(id) => {
                if let Some(tx) = map.get(id) {
                    if tx.try_send(text).is_err() {
                        dead.push(id.to_string());
                    }
                }
            }
            None => {
                for (id, tx) in map.iter() {
                    if tx.try_send(text.clone()).is_err() {
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

    pub fn broadcast_status(&self, queue: &Queue) {
        self.send(
            None,
            json!({"type": "status", "data": {"status": queue.info()}}),
        );
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
    server.clients.lock().insert(sid.clone(), tx.clone());
    let hello = json!({"type": "status", "data": {"status": server.queue.info(), "sid": sid}});
    let _ = tx.try_send(Message::Text(hello.to_string().into()));
    if let Some((prompt_id, Some(node))) = server.queue.running_for(&sid) {
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
        if map.get(&sid).is_some_and(|t| t.same_channel(&tx)) {
            map.remove(&sid);
        }
    }
    drop(tx);
    let _ = writer.await;
}
