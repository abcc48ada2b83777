//! A worker's outgoing messages, in order: ComfyUI's WebSocket messages
//! and preview frames go to the cluster's events channel, and with an
//! output store each `executed` message's files are stored first (so a
//! client that hears of a file can `/view` it), under the names the store
//! gave them.

use super::cluster::{self, Store};
use super::objects::{output_files, Objects, Renames};
use super::prompt_run::Outbox;
use sdkit_engine::Paths;
use serde_json::{json, Value as Json};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

pub enum Out {
    /// A ready payload (a preview frame).
    Raw(Vec<u8>),
    /// A JSON message for a client (everyone for None).
    Text { client: Option<String>, msg: Json },
    /// Answered, once everything before it is published, with the files
    /// renamed since the last flush.
    Flush(oneshot::Sender<Renames>),
}

/// Sends through the worker's ordered channel.
pub struct ClusterOutbox(pub mpsc::UnboundedSender<Out>);

impl ClusterOutbox {
    pub fn send_text(&self, client: Option<&str>, msg: Json) {
        let _ = self.0.send(Out::Text {
            client: client.map(str::to_string),
            msg,
        });
    }

    /// Waits until every message sent so far is published; the renames
    /// their files took.
    pub async fn flush(&self) -> Renames {
        let (tx, rx) = oneshot::channel();
        if self.0.send(Out::Flush(tx)).is_err() {
            return Renames::new();
        }
        rx.await.unwrap_or_default()
    }
}

impl Outbox for ClusterOutbox {
    fn text(&self, client: Option<&str>, msg: Json) {
        self.send_text(client, msg);
    }

    fn preview(&self, client: Option<&str>, jpeg: &[u8], meta: &Json) {
        let _ = self
            .0
            .send(Out::Raw(cluster::preview_frame(client, meta, jpeg)));
    }

    fn wants_previews(&self, _client: Option<&str>) -> bool {
        // The API processes know who listens; a worker cannot.
        true
    }
}

/// Publishes what arrives on `rx` until every sender is gone.
pub async fn run(
    store: Arc<Store>,
    objects: Option<Arc<Objects>>,
    paths: Arc<Paths>,
    mut rx: mpsc::UnboundedReceiver<Out>,
) {
    use redis::AsyncCommands;
    let key = store.key("events");
    let mut renames = Renames::new();
    while let Some(out) = rx.recv().await {
        let payload = match out {
            Out::Raw(b) => b,
            Out::Text { client, mut msg } => {
                if let Some(o) = &objects {
                    if msg.get("type").and_then(Json::as_str) == Some("executed") {
                        if let Some(output) = msg.pointer_mut("/data/output") {
                            store_files(o, &paths, output, &mut renames).await;
                        }
                    }
                }
                json!({"client": client, "msg": msg})
                    .to_string()
                    .into_bytes()
            }
            Out::Flush(tx) => {
                let _ = tx.send(std::mem::take(&mut renames));
                continue;
            }
        };
        let r: redis::RedisResult<()> = store.conn().publish(&key, payload).await;
        if let Err(e) = r {
            tracing::warn!("cannot publish to the cluster: {e}");
        }
    }
}

/// The worker's folder for files of type `ty`.
pub fn folder<'a>(paths: &'a Paths, ty: &str) -> Option<&'a std::path::Path> {
    match ty {
        "output" => Some(&paths.output),
        "temp" => Some(&paths.temp),
        "input" => Some(&paths.input),
        _ => None,
    }
}

/// Stores the files an `executed` output lists, renaming where the store
/// already holds the name.
async fn store_files(o: &Objects, paths: &Paths, output: &mut Json, renames: &mut Renames) {
    for f in output_files(output) {
        let field = |k: &str| f.get(k).and_then(Json::as_str).unwrap_or("").to_string();
        let (ty, sub, name) = (field("type"), field("subfolder"), field("filename"));
        let Some(dir) = folder(paths, &ty) else {
            continue;
        };
        let local = dir.join(&sub).join(&name);
        let path = local.clone();
        let read = tokio::task::spawn_blocking(move || std::fs::read(path)).await;
        let bytes = match read.unwrap_or_else(|e| Err(std::io::Error::other(e))) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!("cannot read output {}: {e}", local.display());
                continue;
            }
        };
        match o.put_new(&ty, &sub, &name, bytes).await {
            Ok(stored) if stored != name => {
                f.insert("filename".into(), Json::String(stored.clone()));
                renames.insert((ty, sub, name), stored);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("cannot store output {}: {e:#}", local.display()),
        }
    }
}
