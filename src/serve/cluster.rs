//! The queue, history and worker registry of a cluster, in Redis
//! (`sdkit serve --queue redis://…`, `sdkit worker --queue redis://…`).
//!
//! Keys, all under `sdkit:`:
//! - `jobs`: a stream of tokens, read by the consumer group `workers`. A
//!   token says "a prompt is waiting"; the worker that reads one takes the
//!   best pending prompt for itself (the [`CLAIM`] script) and binds the
//!   token to it (`bind`: token id → prompt id). A worker that dies leaves
//!   its token pending in the group; another takes it over with
//!   `XAUTOCLAIM` once it has been idle for the claim timeout (a live
//!   worker keeps its token fresh), and runs the bound prompt again.
//! - `pending`: sorted set of waiting prompts by number (ComfyUI's order;
//!   members are `SEQ|ID` so equal numbers keep arrival order); `items`:
//!   id → the queued prompt; `route`: id → what dispatch reads (its
//!   sequence number, model files, preferred worker, enqueue time).
//! - `running`: id → worker, token and start time.
//! - `history`: id → ComfyUI's history entry; `history:order`: ids by
//!   completion. The [`FINISH`] script records a prompt only while it is
//!   running, so each prompt ends in the history exactly once, whichever
//!   of two workers (one presumed dead, one that took over) ends first.
//! - `worker:ID`: a worker's record (device, memory, state, resident
//!   models), read by dispatch; `worker:ID:files`: the model files it has,
//!   read for validation and the model lists; both expire unless
//!   refreshed. `workers`: their ids.
//! - Channels `events` (workers → API processes: ComfyUI's WebSocket
//!   messages with the client they are for) and `control` (API processes
//!   → workers: interrupt, free).
//!
//! The scripts touch keys they do not declare, which a single Redis (or a
//! replicated one) allows and Redis Cluster does not.

use super::backend::QResult;
use super::combos::Advertised;
use super::queue::{Item, MAX_HISTORY};
use redis::aio::ConnectionManager;
use redis::{AsyncCommands, RedisResult, Script};
use serde_json::{json, Map, Value as Json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const PREFIX: &str = "sdkit:";
pub const GROUP: &str = "workers";

/// How long dispatch holds a prompt for an idle worker that already has
/// its model, before any worker may take it.
pub const AFFINITY_MS: u64 = 3000;
/// Prompts a worker looks through for one whose model it holds.
const LOOKAHEAD: usize = 16;

/// Adds a prompt: refuses an id already pending or running, replaces an
/// old history entry of the same id (ComfyUI overwrites it), queues it,
/// and adds a token. ARGV: prefix, id, item, number, route (JSON without
/// `seq`, added here). Returns the item's sequence number, or the error
/// DUPLICATE.
const ENQUEUE: &str = r#"
local p, id = ARGV[1], ARGV[2]
if redis.call('HEXISTS', p .. 'items', id) == 1 then
  return redis.error_reply('DUPLICATE ' .. id)
end
redis.call('HDEL', p .. 'history', id)
redis.call('ZREM', p .. 'history:order', id)
local seq = redis.call('INCR', p .. 'seq')
local route = cjson.decode(ARGV[5])
route.seq = seq
redis.call('HSET', p .. 'items', id, ARGV[3])
redis.call('HSET', p .. 'route', id, cjson.encode(route))
redis.call('ZADD', p .. 'pending', ARGV[4], string.format('%020d|%s', seq, id))
redis.call('XADD', p .. 'jobs', '*', 'token', id)
return seq
"#;

/// A worker takes a token. ARGV: prefix, token id, worker, now (ms),
/// affinity window (ms), the worker's resident model files (JSON list),
/// lookahead. Returns {'run', id, item, needed files} or {'skip'} (the
/// token is spent: nothing waits, or its prompt ended or was deleted) or
/// {'defer'} (every waiting prompt is held for an idle worker that has
/// its model, or was given back by this worker while another live worker
/// may take it: the token is passed on).
const CLAIM: &str = r#"
local p, token, worker = ARGV[1], ARGV[2], ARGV[3]
local now, window = tonumber(ARGV[4]), tonumber(ARGV[5])
local stream = p .. 'jobs'
local function spend()
  redis.call('XACK', stream, 'workers', token)
  redis.call('XDEL', stream, token)
  redis.call('HDEL', p .. 'bind', token)
end
local function run(id)
  local item = redis.call('HGET', p .. 'items', id)
  if not item then
    spend()
    return {'skip'}
  end
  redis.call('HSET', p .. 'running', id,
    cjson.encode({worker = worker, token = token, started_ms = now}))
  redis.call('HSET', p .. 'bind', token, id)
  local route = cjson.decode(redis.call('HGET', p .. 'route', id) or '{}')
  return {'run', id, item, cjson.encode(route.needs or {})}
end
-- Whether a live worker other than those in `excluded` exists.
local function others_alive(excluded)
  local skip = {}
  for _, w in ipairs(excluded) do skip[w] = true end
  for _, w in ipairs(redis.call('SMEMBERS', p .. 'workers')) do
    if not skip[w] and redis.call('EXISTS', p .. 'worker:' .. w) == 1 then
      return true
    end
  end
  return false
end
local bound = redis.call('HGET', p .. 'bind', token)
if bound then
  -- Taken over from a worker presumed dead: its prompt runs again
  -- unless it has ended meanwhile.
  if redis.call('HEXISTS', p .. 'running', bound) == 0 then
    spend()
    return {'skip'}
  end
  return run(bound)
end
local resident = {}
for _, m in ipairs(cjson.decode(ARGV[6])) do resident[m] = true end
local head = redis.call('ZRANGE', p .. 'pending', 0, tonumber(ARGV[7]) - 1)
if #head == 0 then
  spend()
  return {'skip'}
end
local held, free
for _, member in ipairs(head) do
  local id = string.sub(member, 22)
  local route = cjson.decode(redis.call('HGET', p .. 'route', id) or '{}')
  for _, m in ipairs(route.models or {}) do
    if resident[m] then held = member break end
  end
  if held then break end
  local waits = type(route.prefer) == 'string' and route.prefer ~= worker
    and now - (route.t or 0) < window
    and redis.call('EXISTS', p .. 'worker:' .. route.prefer) == 1
  if not waits and type(route.excluded) == 'table' then
    for _, w in ipairs(route.excluded) do
      if w == worker then
        waits = others_alive(route.excluded)
        break
      end
    end
  end
  if not waits and not free then free = member end
end
local chosen = held or free
if not chosen then
  spend()
  redis.call('XADD', stream, '*', 'token', 'deferred')
  return {'defer'}
end
redis.call('ZREM', p .. 'pending', chosen)
return run(string.sub(chosen, 22))
"#;

/// A worker ends a prompt. ARGV: prefix, id, token, history entry,
/// history limit. Records the entry only while the prompt is running (so
/// once), and spends the token. Returns 1 when recorded.
const FINISH: &str = r#"
local p, id, token = ARGV[1], ARGV[2], ARGV[3]
local recorded = 0
if redis.call('HEXISTS', p .. 'running', id) == 1 then
  redis.call('HDEL', p .. 'running', id)
  redis.call('HDEL', p .. 'items', id)
  redis.call('HDEL', p .. 'route', id)
  redis.call('HSET', p .. 'history', id, ARGV[4])
  redis.call('ZADD', p .. 'history:order', redis.call('INCR', p .. 'seq'), id)
  local over = redis.call('ZCARD', p .. 'history:order') - tonumber(ARGV[5])
  if over > 0 then
    for _, old in ipairs(redis.call('ZRANGE', p .. 'history:order', 0, over - 1)) do
      redis.call('HDEL', p .. 'history', old)
    end
    redis.call('ZREMRANGEBYRANK', p .. 'history:order', 0, over - 1)
  end
  recorded = 1
end
redis.call('XACK', p .. 'jobs', 'workers', token)
redis.call('XDEL', p .. 'jobs', token)
redis.call('HDEL', p .. 'bind', token)
return recorded
"#;

/// A worker keeps its token fresh while it runs the prompt. ARGV:
/// prefix, token, worker. Returns 0 when the token is no longer this
/// worker's (another took it over, or the prompt ended elsewhere).
const KEEP: &str = r#"
local p, token, worker = ARGV[1], ARGV[2], ARGV[3]
local mine = redis.call('XPENDING', p .. 'jobs', 'workers', token, token, 1, worker)
if #mine == 0 then return 0 end
redis.call('XCLAIM', p .. 'jobs', 'workers', worker, 0, token, 'JUSTID')
return 1
"#;

/// A worker gives back a prompt it lacks files for. ARGV: prefix, id,
/// token, worker. The prompt is pending again, in its place, with the
/// worker in its `excluded` list, and a new token is added. Returns 1, or
/// 0 when the prompt is not this worker's.
const GIVE_BACK: &str = r#"
local p, id, token, worker = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local run = redis.call('HGET', p .. 'running', id)
if not run or cjson.decode(run).worker ~= worker then return 0 end
local route = cjson.decode(redis.call('HGET', p .. 'route', id) or '{}')
local excluded = {}
if type(route.excluded) == 'table' then excluded = route.excluded end
table.insert(excluded, worker)
route.excluded = excluded
redis.call('HDEL', p .. 'running', id)
redis.call('HSET', p .. 'route', id, cjson.encode(route))
redis.call('ZADD', p .. 'pending', route.number, string.format('%020d|%s', route.seq, id))
redis.call('XACK', p .. 'jobs', 'workers', token)
redis.call('XDEL', p .. 'jobs', token)
redis.call('HDEL', p .. 'bind', token)
redis.call('XADD', p .. 'jobs', '*', 'token', id)
return 1
"#;

/// Deletes pending prompts (ARGV[2..], or all when none given).
const DELETE_PENDING: &str = r#"
local p = ARGV[1]
local function drop(member)
  local id = string.sub(member, 22)
  redis.call('ZREM', p .. 'pending', member)
  redis.call('HDEL', p .. 'items', id)
  redis.call('HDEL', p .. 'route', id)
end
if #ARGV == 1 then
  for _, m in ipairs(redis.call('ZRANGE', p .. 'pending', 0, -1)) do drop(m) end
  return 0
end
for i = 2, #ARGV do
  local route = redis.call('HGET', p .. 'route', ARGV[i])
  if route and redis.call('HEXISTS', p .. 'running', ARGV[i]) == 0 then
    drop(string.format('%020d|%s', cjson.decode(route).seq, ARGV[i]))
  end
end
return 0
"#;

/// The model files a worker has, by folder (`vae_list` for VAELoader's
/// list), for the API's validation and the front end's lists. Kept apart
/// from [`WorkerInfo`]: it can be long, and dispatch reads the records
/// at every prompt.
pub type Files = HashMap<String, Vec<String>>;

/// What a worker tells the cluster about itself.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct WorkerInfo {
    pub id: String,
    pub device: String,
    pub vram_total: u64,
    pub vram_free: u64,
    /// `idle` or `busy`.
    pub state: String,
    /// Model files its executor holds (`folder/name`).
    pub resident: Vec<String>,
    pub jobs_done: u64,
}

/// A connection to a cluster's Redis.
pub struct Store {
    pub client: redis::Client,
    conn: ConnectionManager,
    pub prefix: String,
    enqueue: Script,
    claim: Script,
    finish: Script,
    keep: Script,
    give_back: Script,
    delete_pending: Script,
    /// The node each running prompt is at, from the relayed `executing`
    /// messages (for a client that reconnects mid-run).
    last_node: Mutex<HashMap<String, String>>,
    /// The model files the live workers have ([`Store::refresh_files`]).
    advertised: Mutex<Advertised>,
}

/// Parses `redis://HOST:PORT[/DB]` (or `rediss://`, `unix://`) and
/// connects, creating the stream and its group when new.
pub async fn connect(url: &str) -> anyhow::Result<Store> {
    // Messages name the address without its password.
    let shown = redact(url);
    let url_tls = url.starts_with("rediss://") || url.starts_with("valkeys://");
    if url_tls && !cfg!(feature = "tls") {
        anyhow::bail!(
            "--queue {shown}: this sdkit was built without TLS (cargo build --features tls)"
        );
    }
    // TLS through rustls with ring: installed once for the process (the
    // S3 store uses the same one).
    #[cfg(feature = "tls")]
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = redis::Client::open(url)
        .map_err(|e| anyhow::anyhow!("--queue {shown}: not a Redis address: {e}"))?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_response_timeout(Some(Duration::from_secs(30)))
        .set_connection_timeout(Some(Duration::from_secs(5)));
    let conn = client
        .get_connection_manager_with_config(config)
        .await
        .map_err(|e| anyhow::anyhow!("--queue {shown}: cannot connect: {e}"))?;
    let store = Store {
        client,
        conn,
        prefix: PREFIX.to_string(),
        enqueue: Script::new(ENQUEUE),
        claim: Script::new(CLAIM),
        finish: Script::new(FINISH),
        keep: Script::new(KEEP),
        give_back: Script::new(GIVE_BACK),
        delete_pending: Script::new(DELETE_PENDING),
        last_node: Mutex::default(),
        advertised: Mutex::default(),
    };
    store
        .ensure_group()
        .await
        .map_err(|e| anyhow::anyhow!("--queue {shown}: cannot create the job stream: {e}"))?;
    Ok(store)
}

/// `url` with the password of `redis://USER:PASSWORD@HOST` replaced by
/// `***`, for messages and logs.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return url.to_string();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
        None => url.to_string(),
    }
}

/// What a worker's claim gave it.
pub enum Claim {
    /// Run prompt `id` (`item`: its queued form; `needs`: the model files
    /// it loads).
    Run {
        id: String,
        item: Json,
        needs: Vec<String>,
    },
    Skip,
    Defer,
}

fn parse_json(s: &str) -> Json {
    serde_json::from_str(s).unwrap_or(Json::Null)
}

impl Store {
    pub fn key(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }

    pub fn conn(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// Creates the token stream and its group unless they exist (again,
    /// after a Redis that kept no data restarted).
    pub async fn ensure_group(&self) -> RedisResult<()> {
        let made: RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(self.key("jobs"))
            .arg(GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut self.conn())
            .await;
        match made {
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            other => other,
        }
    }

    pub async fn number(&self, given: Option<f64>, front: bool) -> RedisResult<f64> {
        if let Some(n) = given {
            return Ok(n);
        }
        let n: i64 = self.conn().incr(self.key("counter"), 1).await?;
        let n = (n - 1) as f64;
        Ok(if front { -n } else { n })
    }

    /// Queues `item`, which loads the model files `needs`, preferring an
    /// idle worker that holds its large ones.
    pub async fn push(&self, item: &Item, needs: &[String]) -> QResult<()> {
        let models = super::worker::routed(needs);
        let prefer = match self.workers().await {
            Ok(ws) => ws
                .into_iter()
                .find(|w| w.state == "idle" && w.resident.iter().any(|r| models.contains(r)))
                .map(|w| w.id),
            Err(_) => None,
        };
        let route = json!({
            "models": models,
            "needs": needs,
            "number": item.number,
            "prefer": prefer,
            "t": sdkit_engine::event::now_ms(),
            "client": item.client_id(),
        });
        let r: RedisResult<i64> = self
            .enqueue
            .arg(&self.prefix)
            .arg(&item.prompt_id)
            .arg(item.record().to_string())
            .arg(item.number)
            .arg(route.to_string())
            .invoke_async(&mut self.conn())
            .await;
        match r {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("DUPLICATE") => Err(format!(
                "prompt_id {} is already queued or running",
                item.prompt_id
            )),
            Err(e) => Err(format!("the queue's Redis failed: {e}")),
        }
    }

    pub async fn remaining(&self) -> RedisResult<usize> {
        let (a, b): (usize, usize) = redis::pipe()
            .zcard(self.key("pending"))
            .hlen(self.key("running"))
            .query_async(&mut self.conn())
            .await?;
        Ok(a + b)
    }

    pub async fn info(&self) -> RedisResult<Json> {
        Ok(json!({"exec_info": {"queue_remaining": self.remaining().await?}}))
    }

    /// Pending items in queue order.
    async fn pending(&self) -> RedisResult<Vec<Item>> {
        let members: Vec<String> = self.conn().zrange(self.key("pending"), 0, -1).await?;
        let ids: Vec<&str> = members.iter().filter_map(|m| m.get(21..)).collect();
        self.items(&ids).await
    }

    async fn items(&self, ids: &[&str]) -> RedisResult<Vec<Item>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let raw: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(self.key("items"))
            .arg(ids)
            .query_async(&mut self.conn())
            .await?;
        Ok(raw
            .into_iter()
            .flatten()
            .filter_map(|s| Item::from_record(&parse_json(&s)))
            .collect())
    }

    /// Running items with their run records.
    async fn running(&self) -> RedisResult<Vec<(Item, Json)>> {
        let runs: HashMap<String, String> = self.conn().hgetall(self.key("running")).await?;
        let ids: Vec<&str> = runs.keys().map(String::as_str).collect();
        let mut out: Vec<(Item, Json)> = self
            .items(&ids)
            .await?
            .into_iter()
            .map(|i| {
                let rec = runs.get(&i.prompt_id).map(|r| parse_json(r));
                (i, rec.unwrap_or(Json::Null))
            })
            .collect();
        out.sort_by_key(|(_, r)| r.get("started_ms").and_then(Json::as_u64).unwrap_or(0));
        Ok(out)
    }

    pub async fn to_json(&self) -> RedisResult<Json> {
        let running = self.running().await?;
        let pending = self.pending().await?;
        Ok(json!({
            "queue_running": running.iter().map(|(i, _)| i.to_json()).collect::<Vec<_>>(),
            "queue_pending": pending.iter().map(Item::to_json).collect::<Vec<_>>(),
        }))
    }

    /// Deletes the pending prompts `ids` (all of them for None).
    pub async fn delete_pending(&self, ids: Option<&[String]>) -> RedisResult<()> {
        if ids.is_some_and(<[String]>::is_empty) {
            return Ok(());
        }
        let mut call = self.delete_pending.arg(&self.prefix);
        for id in ids.unwrap_or_default() {
            call.arg(id);
        }
        call.invoke_async(&mut self.conn()).await
    }

    async fn control(&self, msg: Json) -> RedisResult<()> {
        self.conn()
            .publish(self.key("control"), msg.to_string())
            .await
    }

    pub async fn interrupt(&self, prompt_id: Option<&str>) -> RedisResult<()> {
        self.control(json!({"interrupt": prompt_id})).await
    }

    pub async fn request_free(&self, unload_models: bool, free_memory: bool) -> RedisResult<()> {
        self.control(json!({"free": {"unload_models": unload_models, "free_memory": free_memory}}))
            .await
    }

    pub async fn running_for(&self, client: &str) -> Option<(String, Option<String>)> {
        let running = self.running().await.ok()?;
        let (item, _) = running
            .into_iter()
            .find(|(i, _)| i.client_id().as_deref() == Some(client))?;
        let node = self
            .last_node
            .lock()
            .ok()
            .and_then(|m| m.get(&item.prompt_id).cloned());
        Some((item.prompt_id, node))
    }

    /// Follows the relayed `executing` messages (see `last_node`).
    pub fn note_executing(&self, msg: &Json) {
        if msg.get("type").and_then(Json::as_str) != Some("executing") {
            return;
        }
        let Some(id) = msg.pointer("/data/prompt_id").and_then(Json::as_str) else {
            return;
        };
        if let Ok(mut m) = self.last_node.lock() {
            match msg.pointer("/data/node").and_then(Json::as_str) {
                Some(node) => {
                    m.insert(id.to_string(), node.to_string());
                }
                None => {
                    m.remove(id);
                }
            }
        }
    }

    /// History ids in completion order.
    async fn history_ids(&self, start: isize, stop: isize) -> RedisResult<Vec<String>> {
        self.conn()
            .zrange(self.key("history:order"), start, stop)
            .await
    }

    async fn history_entries(&self, ids: &[String]) -> RedisResult<Map<String, Json>> {
        if ids.is_empty() {
            return Ok(Map::new());
        }
        let raw: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(self.key("history"))
            .arg(ids)
            .query_async(&mut self.conn())
            .await?;
        Ok(ids
            .iter()
            .zip(raw)
            .filter_map(|(id, e)| Some((id.clone(), parse_json(&e?))))
            .collect())
    }

    /// ComfyUI's get_history, as [`super::queue::Queue::history`].
    pub async fn history(
        &self,
        max_items: Option<usize>,
        offset: Option<usize>,
    ) -> RedisResult<Json> {
        let n: usize = self.conn().zcard(self.key("history:order")).await?;
        let start = match (offset, max_items) {
            (Some(o), _) => o,
            (None, Some(m)) => n.saturating_sub(m),
            (None, None) => 0,
        };
        if start >= n || max_items == Some(0) {
            return Ok(json!({}));
        }
        let stop = max_items.map_or(-1, |m| (start + m - 1).min(n - 1) as isize);
        let ids = self.history_ids(start as isize, stop).await?;
        Ok(Json::Object(self.history_entries(&ids).await?))
    }

    pub async fn history_one(&self, id: &str) -> RedisResult<Json> {
        Ok(Json::Object(self.history_entries(&[id.to_string()]).await?))
    }

    pub async fn delete_history(&self, ids: Option<&[String]>) -> RedisResult<()> {
        match ids {
            None => {
                redis::pipe()
                    .del(self.key("history"))
                    .del(self.key("history:order"))
                    .query_async(&mut self.conn())
                    .await
            }
            Some([]) => Ok(()),
            Some(ids) => {
                redis::pipe()
                    .hdel(self.key("history"), ids)
                    .zrem(self.key("history:order"), ids)
                    .query_async(&mut self.conn())
                    .await
            }
        }
    }

    pub async fn job_records(&self) -> RedisResult<Vec<Json>> {
        let mut jobs: Vec<Json> = self
            .pending()
            .await?
            .iter()
            .map(|i| super::jobs::from_item(i, "pending", None, false))
            .collect();
        for (i, r) in self.running().await? {
            let started = r.get("started_ms").and_then(Json::as_u64);
            jobs.push(super::jobs::from_item(&i, "in_progress", started, false));
        }
        let ids = self.history_ids(0, -1).await?;
        jobs.extend(
            self.history_entries(&ids)
                .await?
                .iter()
                .map(|(id, h)| super::jobs::from_history(id, h, false)),
        );
        Ok(jobs)
    }

    pub async fn job_detail(&self, id: &str) -> RedisResult<Option<Json>> {
        if let Some(h) = self.history_entries(&[id.to_string()]).await?.get(id) {
            return Ok(Some(super::jobs::from_history(id, h, true)));
        }
        if let Some((i, r)) = self
            .running()
            .await?
            .into_iter()
            .find(|(i, _)| i.prompt_id == id)
        {
            let started = r.get("started_ms").and_then(Json::as_u64);
            return Ok(Some(super::jobs::from_item(
                &i,
                "in_progress",
                started,
                true,
            )));
        }
        let pending = self.items(&[id]).await?;
        Ok(pending
            .first()
            .map(|i| super::jobs::from_item(i, "pending", None, true)))
    }

    /// The live workers' records.
    pub async fn workers(&self) -> RedisResult<Vec<WorkerInfo>> {
        let ids: Vec<String> = self.conn().smembers(self.key("workers")).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let recs = self.worker_keys(&ids, "").await?;
        let mut out = Vec::new();
        let mut gone = Vec::new();
        for (id, rec) in ids.into_iter().zip(recs) {
            match rec.and_then(|r| serde_json::from_str::<WorkerInfo>(&r).ok()) {
                Some(w) => out.push(w),
                None => gone.push(id),
            }
        }
        if !gone.is_empty() {
            let _: RedisResult<()> = self.conn().srem(self.key("workers"), &gone).await;
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// `sdkit:worker:ID{suffix}` of each of `ids`, in one MGET.
    async fn worker_keys(&self, ids: &[String], suffix: &str) -> RedisResult<Vec<Option<String>>> {
        let keys: Vec<String> = ids
            .iter()
            .map(|id| self.key(&format!("worker:{id}{suffix}")))
            .collect();
        redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut self.conn())
            .await
    }

    /// The model files the live workers had at the last refresh.
    pub fn advertised(&self) -> Advertised {
        self.advertised
            .lock()
            .map(|a| Arc::clone(&a))
            .unwrap_or_default()
    }

    /// Re-reads the model files the live workers have.
    pub async fn refresh_files(&self) -> RedisResult<()> {
        let mut all = Files::new();
        for (_, files) in self.worker_files().await? {
            for (folder, list) in files {
                all.entry(folder).or_default().extend(list);
            }
        }
        for files in all.values_mut() {
            files.sort();
            files.dedup();
        }
        if let Ok(mut a) = self.advertised.lock() {
            *a = Arc::new(all);
        }
        Ok(())
    }

    /// The live workers' model files.
    pub async fn worker_files(&self) -> RedisResult<Vec<(String, Files)>> {
        let ids: Vec<String> = self.workers().await?.into_iter().map(|w| w.id).collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let lists = self.worker_keys(&ids, ":files").await?;
        Ok(ids
            .into_iter()
            .zip(lists)
            .filter_map(|(id, l)| Some((id, serde_json::from_str(&l?).ok()?)))
            .collect())
    }

    /// Publishes a worker's record (and its model files, when they are
    /// new), kept for `ttl`.
    pub async fn advertise(
        &self,
        w: &WorkerInfo,
        files: Option<&Files>,
        ttl: Duration,
    ) -> RedisResult<()> {
        let secs = ttl.as_secs().max(1);
        let rec = serde_json::to_string(w).unwrap_or_default();
        let files_key = self.key(&format!("worker:{}:files", w.id));
        let mut pipe = redis::pipe();
        pipe.set_ex(self.key(&format!("worker:{}", w.id)), rec, secs);
        match files {
            Some(f) => pipe.set_ex(&files_key, json!(f).to_string(), secs),
            None => pipe.expire(&files_key, secs as i64),
        };
        pipe.sadd(self.key("workers"), &w.id)
            .query_async(&mut self.conn())
            .await
    }

    pub async fn retire(&self, id: &str) -> RedisResult<()> {
        redis::pipe()
            .del(self.key(&format!("worker:{id}")))
            .del(self.key(&format!("worker:{id}:files")))
            .srem(self.key("workers"), id)
            .query_async(&mut self.conn())
            .await
    }

    pub async fn claim(
        &self,
        token: &str,
        worker: &str,
        resident: &[String],
    ) -> RedisResult<Claim> {
        let r: Vec<String> = self
            .claim
            .arg(&self.prefix)
            .arg(token)
            .arg(worker)
            .arg(sdkit_engine::event::now_ms())
            .arg(AFFINITY_MS)
            .arg(json!(resident).to_string())
            .arg(LOOKAHEAD)
            .invoke_async(&mut self.conn())
            .await?;
        Ok(match r.as_slice() {
            [run, id, item, needs] if run == "run" => Claim::Run {
                id: id.clone(),
                item: parse_json(item),
                needs: serde_json::from_str(needs).unwrap_or_default(),
            },
            [defer] if defer == "defer" => Claim::Defer,
            _ => Claim::Skip,
        })
    }

    /// Records `entry` as `id`'s history (once) and spends `token`.
    pub async fn finish(&self, id: &str, token: &str, entry: &Json) -> RedisResult<bool> {
        let recorded: i64 = self
            .finish
            .arg(&self.prefix)
            .arg(id)
            .arg(token)
            .arg(entry.to_string())
            .arg(MAX_HISTORY)
            .invoke_async(&mut self.conn())
            .await?;
        Ok(recorded == 1)
    }

    /// Puts prompt `id` back in the queue for the other workers.
    pub async fn give_back(&self, id: &str, token: &str, worker: &str) -> RedisResult<bool> {
        let done: i64 = self
            .give_back
            .arg(&self.prefix)
            .arg(id)
            .arg(token)
            .arg(worker)
            .invoke_async(&mut self.conn())
            .await?;
        Ok(done == 1)
    }

    /// Keeps `token` fresh; false when it is no longer `worker`'s.
    pub async fn keep(&self, token: &str, worker: &str) -> RedisResult<bool> {
        let mine: i64 = self
            .keep
            .arg(&self.prefix)
            .arg(token)
            .arg(worker)
            .invoke_async(&mut self.conn())
            .await?;
        Ok(mine == 1)
    }

    /// Hands each message of channel `name` to `on`, forever: a dropped
    /// connection is made again a second later.
    pub async fn listen(&self, name: &str, mut on: impl FnMut(&[u8])) {
        use futures_util::StreamExt;
        loop {
            let sub = async {
                let mut ps = self.client.get_async_pubsub().await?;
                ps.subscribe(self.key(name)).await?;
                let mut stream = ps.on_message();
                while let Some(m) = stream.next().await {
                    on(m.get_payload_bytes());
                }
                Ok::<(), redis::RedisError>(())
            };
            if let Err(e) = sub.await {
                tracing::warn!("the cluster's {name} channel failed ({e}); reconnecting");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// A status message for every client.
    pub async fn publish_status(&self) {
        if let Ok(info) = self.info().await {
            self.publish_text(None, &json!({"type": "status", "data": {"status": info}}))
                .await;
        }
    }

    pub async fn publish_text(&self, client: Option<&str>, msg: &Json) {
        let payload = json!({"client": client, "msg": msg}).to_string();
        let r: RedisResult<()> = self.conn().publish(self.key("events"), payload).await;
        if let Err(e) = r {
            tracing::warn!("cannot publish to the cluster: {e}");
        }
    }
}

/// A preview frame on the events channel: this byte, the metadata's
/// length (u32, big-endian), `{"client", "meta"}`, then the JPEG.
pub const PREVIEW_FRAME: u8 = 1;

pub fn preview_frame(client: Option<&str>, meta: &Json, jpeg: &[u8]) -> Vec<u8> {
    let head = json!({"client": client, "meta": meta}).to_string();
    let mut b = Vec::with_capacity(5 + head.len() + jpeg.len());
    b.push(PREVIEW_FRAME);
    b.extend_from_slice(&(head.len() as u32).to_be_bytes());
    b.extend_from_slice(head.as_bytes());
    b.extend_from_slice(jpeg);
    b
}

/// A message from the events channel.
pub enum Relayed {
    Text {
        client: Option<String>,
        msg: Json,
    },
    Preview {
        client: Option<String>,
        meta: Json,
        jpeg: Vec<u8>,
    },
}

pub fn parse_relayed(payload: &[u8]) -> Option<Relayed> {
    let client = |v: &Json| v.get("client").and_then(Json::as_str).map(str::to_string);
    if payload.first() == Some(&PREVIEW_FRAME) {
        let len = u32::from_be_bytes(payload.get(1..5)?.try_into().ok()?) as usize;
        let head: Json = serde_json::from_slice(payload.get(5..5 + len)?).ok()?;
        return Some(Relayed::Preview {
            client: client(&head),
            meta: head.get("meta").cloned().unwrap_or(Json::Null),
            jpeg: payload.get(5 + len..)?.to_vec(),
        });
    }
    let v: Json = serde_json::from_slice(payload).ok()?;
    Some(Relayed::Text {
        client: client(&v),
        msg: v.get("msg")?.clone(),
    })
}

/// The API process's side of the events channel: forwards each worker
/// message to this process's sockets. Reconnects when Redis drops.
pub async fn relay(server: std::sync::Arc<super::Server>, store: std::sync::Arc<Store>) {
    store
        .listen("events", |payload| match parse_relayed(payload) {
            Some(Relayed::Text { client, msg }) => {
                store.note_executing(&msg);
                server.clients.send(client.as_deref(), msg);
            }
            Some(Relayed::Preview { client, meta, jpeg }) => {
                server.clients.send_preview(client.as_deref(), &jpeg, &meta);
            }
            None => tracing::warn!("ignored a malformed message on the events channel"),
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_shown_without_their_password() {
        assert_eq!(
            redact("rediss://app:s3cr:et@cache.example:6380/2"),
            "rediss://app:***@cache.example:6380/2"
        );
        assert_eq!(
            redact("redis://:pw@127.0.0.1/#insecure"),
            "redis://:***@127.0.0.1/#insecure"
        );
        for plain in ["redis://127.0.0.1:6379/0", "redis://user@h", "nonsense"] {
            assert_eq!(redact(plain), plain);
        }
    }

    #[test]
    fn preview_frames_round_trip() {
        let meta = json!({"node_id": "3", "prompt_id": "p"});
        let f = preview_frame(Some("c1"), &meta, &[1, 2, 3]);
        match parse_relayed(&f) {
            Some(Relayed::Preview {
                client,
                meta: m,
                jpeg,
            }) => {
                assert_eq!(client.as_deref(), Some("c1"));
                assert_eq!(m, meta);
                assert_eq!(jpeg, vec![1, 2, 3]);
            }
            _ => panic!("not a preview"),
        }
        let t = json!({"client": null, "msg": {"type": "status"}}).to_string();
        assert!(matches!(
            parse_relayed(t.as_bytes()),
            Some(Relayed::Text { client: None, .. })
        ));
        assert!(parse_relayed(&[1, 0, 0, 0, 9, b'{']).is_none());
    }
}
