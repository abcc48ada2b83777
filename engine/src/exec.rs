//! The executor: runs what a validated graph's outputs need, in dependency
//! order, independent branches concurrently, reusing cached outputs.
//!
//! Cache keys follow ComfyUI's input-signature rule: a node's key hashes its
//! type, its constant inputs, the keys of the nodes feeding it (with output
//! index) and its fingerprint (IS_CHANGED). Editing one constant changes the
//! key of that node and every node downstream, and nothing else, so a re-run
//! executes exactly those. The cache lives in the [`Executor`] and so spans
//! runs (watch mode, the server).

use crate::event::{now_ms, Event, EventSink};
use crate::graph::{Graph, GraphInput};
use crate::node::{CancelToken, Inputs, NodeContext, NodeError, NodeLibrary, NodeOutput};
use crate::paths::Paths;
use crate::value::Value;
use sdkit_compute::plan::schedule::{ScheduledUse, UseSchedule};
use sdkit_compute::runtime::Runtime;
use serde_json::{Map, Value as Json};
use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use tokio::task::JoinSet;

/// How one run is driven and observed.
#[derive(Clone)]
pub struct RunOptions {
    pub prompt_id: String,
    /// Extra PNG text chunks (ComfyUI's `extra_pnginfo`); `workflow` is
    /// filled from the graph's UI workflow when absent.
    pub extra_pnginfo: Map<String, Json>,
    pub events: EventSink,
    pub cancel: CancelToken,
    /// How samplers preview (the server's `--preview-method`).
    pub preview: crate::event::PreviewMethod,
}

impl RunOptions {
    pub fn new(events: EventSink, cancel: CancelToken) -> Self {
        RunOptions {
            prompt_id: new_prompt_id(),
            extra_pnginfo: Map::new(),
            events,
            cancel,
            preview: Default::default(),
        }
    }
}

/// What a successful run did.
#[derive(Clone, Debug, Default)]
pub struct RunReport {
    pub prompt_id: String,
    /// Node ids executed, in completion order.
    pub executed: Vec<String>,
    /// Node ids whose outputs came from the cache.
    pub cached: Vec<String>,
    /// UI outputs by node id (`{"images": [...]}`), as ComfyUI's history.
    pub outputs: BTreeMap<String, Json>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("node \"{node_id}\" ({node_type}) failed: {message}")]
    Node {
        node_id: String,
        node_type: String,
        message: String,
    },
    #[error("interrupted")]
    Interrupted,
}

/// What every node of one run shares.
struct RunShared {
    extra_pnginfo: Arc<Map<String, Json>>,
}

#[derive(Clone)]
struct CacheEntry {
    values: Arc<Vec<Value>>,
    ui: Option<Json>,
}

/// Runs graphs against a node library, keeping a cache between runs.
pub struct Executor {
    library: Arc<NodeLibrary>,
    paths: Arc<Paths>,
    runtime: Runtime,
    cache: Mutex<HashMap<u64, CacheEntry>>,
    /// Image chains after a producer run in its program on a GPU
    /// ([`crate::fusion`]).
    fuse_nodes: bool,
}

/// A random-looking id in UUID form (ComfyUI's prompt ids are UUIDs).
pub fn new_prompt_id() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = DefaultHasher::new();
    std::time::SystemTime::now().hash(&mut h);
    std::process::id().hash(&mut h);
    COUNTER
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        .hash(&mut h);
    let a = h.finish();
    a.rotate_left(17).hash(&mut h);
    let b = h.finish();
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        (b >> 48) & 0x3fff | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

fn hash_value(v: &Value, h: &mut DefaultHasher) {
    match v {
        Value::Int(i) => (0u8, i).hash(h),
        Value::Float(f) => (1u8, f.to_bits()).hash(h),
        Value::String(s) => (2u8, s).hash(h),
        Value::Bool(b) => (3u8, b).hash(h),
        // Constants are never tensors; pointer identity is enough if a
        // future node passes one.
        Value::Image(t) | Value::Mask(t) => (4u8, Arc::as_ptr(t) as usize).hash(h),
        Value::Latent(l) => (5u8, Arc::as_ptr(l) as usize).hash(h),
        Value::Opaque { value, .. } => (6u8, Arc::as_ptr(value) as *const u8 as usize).hash(h),
    }
}

impl Executor {
    pub fn new(library: Arc<NodeLibrary>, paths: Arc<Paths>) -> Self {
        Executor {
            library,
            paths,
            runtime: Runtime::cpu(),
            cache: Mutex::new(HashMap::new()),
            fuse_nodes: true,
        }
    }

    /// Whether image chains after a producer join its program on a GPU
    /// (on by default; the CPU runs them node by node either way, as
    /// ComfyUI computes them).
    pub fn with_node_fusion(mut self, on: bool) -> Self {
        self.fuse_nodes = on;
        self
    }

    /// Runs nodes' tensor programs on `runtime` (the CPU by default).
    pub fn with_runtime(mut self, runtime: Runtime) -> Self {
        self.runtime = runtime;
        self
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    pub fn library(&self) -> &Arc<NodeLibrary> {
        &self.library
    }

    pub fn paths(&self) -> &Arc<Paths> {
        &self.paths
    }

    /// Drops every cached output.
    pub fn clear_cache(&self) {
        self.lock_cache().clear();
    }

    pub fn cached_entries(&self) -> usize {
        self.lock_cache().len()
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, HashMap<u64, CacheEntry>> {
        // A node that panicked mid-run cannot leave the map half-written
        // (inserts are single calls), so a poisoned lock is still usable.
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A node's context. The prompt and PNG chunks are shared by every
    /// node of a run (one copy per run, not per node: a copy per node made
    /// a run's time grow with the square of its node count).
    fn context(
        &self,
        graph: &Graph,
        i: usize,
        opts: &RunOptions,
        shared: &RunShared,
    ) -> NodeContext {
        NodeContext {
            node_id: graph.nodes[i].id.clone(),
            class_type: graph.nodes[i].class_type.clone(),
            prompt_id: opts.prompt_id.clone(),
            paths: self.paths.clone(),
            prompt: Arc::clone(&graph.api_json),
            extra_pnginfo: Arc::clone(&shared.extra_pnginfo),
            cancel: opts.cancel.clone(),
            events: opts.events.clone(),
            runtime: self.runtime.clone(),
            preview: opts.preview,
        }
    }

    /// Cache keys of the needed nodes, in execution order.
    fn keys(
        &self,
        graph: &Graph,
        needed: &[usize],
        opts: &RunOptions,
        shared: &RunShared,
    ) -> HashMap<usize, u64> {
        let mut keys = HashMap::new();
        for &i in needed {
            let node = &graph.nodes[i];
            let mut h = DefaultHasher::new();
            node.class_type.hash(&mut h);
            let mut consts = HashMap::new();
            for (name, input) in &node.inputs {
                name.hash(&mut h);
                match input {
                    GraphInput::Const(v) => {
                        hash_value(v, &mut h);
                        consts.insert(name.clone(), v.clone());
                    }
                    GraphInput::Link { node, output } => {
                        keys.get(node).copied().unwrap_or(0u64).hash(&mut h);
                        output.hash(&mut h);
                    }
                }
            }
            if let Some(imp) = self.library.implementation(&node.class_type) {
                let ctx = self.context(graph, i, opts, shared);
                imp.fingerprint(&ctx, &Inputs::new(consts)).hash(&mut h);
            }
            // Output nodes write files named after the run; they are keyed
            // like any node, so an unchanged SaveImage is not re-run, as in
            // ComfyUI.
            keys.insert(i, h.finish());
        }
        keys
    }

    /// Runs the graph. Emits ComfyUI's events through `opts.events`.
    pub async fn run(&self, graph: &Graph, opts: RunOptions) -> Result<RunReport, RunError> {
        let emit = |e: Event| (opts.events)(&e);
        let pid = opts.prompt_id.clone();
        emit(Event::ExecutionStart {
            prompt_id: pid.clone(),
            timestamp: now_ms(),
        });
        let needed = graph.needed();
        let mut extra = opts.extra_pnginfo.clone();
        if let (false, Some(w)) = (extra.contains_key("workflow"), &graph.ui_workflow) {
            extra.insert("workflow".into(), w.clone());
        }
        let shared = RunShared {
            extra_pnginfo: Arc::new(extra),
        };
        let keys = self.keys(graph, &needed, &opts, &shared);

        let mut results: HashMap<usize, CacheEntry> = HashMap::new();
        {
            let cache = self.lock_cache();
            for &i in &needed {
                if let Some(e) = cache.get(&keys[&i]) {
                    results.insert(i, e.clone());
                }
            }
        }
        // Only what uncached outputs need runs: walk up from them and stop
        // at cached nodes.
        let mut to_run: HashSet<usize> = HashSet::new();
        let mut stack: Vec<usize> = graph
            .outputs()
            .into_iter()
            .filter(|i| !results.contains_key(i))
            .collect();
        while let Some(i) = stack.pop() {
            if results.contains_key(&i) || !to_run.insert(i) {
                continue;
            }
            for (_, inp) in &graph.nodes[i].inputs {
                if let GraphInput::Link { node, .. } = inp {
                    stack.push(*node);
                }
            }
        }
        let mut report = RunReport {
            prompt_id: pid.clone(),
            ..Default::default()
        };
        report.cached = needed
            .iter()
            .filter(|i| results.contains_key(i))
            .map(|&i| graph.nodes[i].id.clone())
            .collect();
        emit(Event::ExecutionCached {
            nodes: report.cached.clone(),
            prompt_id: pid.clone(),
            timestamp: now_ms(),
        });
        for &i in &needed {
            if let Some(ui) = results.get(&i).and_then(|e| e.ui.clone()) {
                let id = graph.nodes[i].id.clone();
                report.outputs.insert(id.clone(), ui.clone());
                emit(Event::Executed {
                    node: id.clone(),
                    display_node: id,
                    output: ui,
                    prompt_id: pid.clone(),
                });
            }
        }

        // On a GPU, image chains after a producer run as part of it: the
        // chain's members are scheduled as their producer.
        let mut chains = if self.fuse_nodes && !self.runtime.is_cpu() {
            crate::fusion::image_chains(&self.library, graph, &to_run)
        } else {
            HashMap::new()
        };
        let absorbed: HashMap<usize, usize> = chains
            .iter()
            .flat_map(|(&p, tail)| tail.iter().map(move |m| (m.index, p)))
            .collect();

        // Dependency counts among the nodes to run.
        let mut waiting: HashMap<usize, usize> = HashMap::new();
        let mut dependents: HashMap<usize, Vec<usize>> = HashMap::new();
        for &i in to_run.iter().filter(|i| !absorbed.contains_key(i)) {
            let mut srcs: Vec<usize> = graph.nodes[i]
                .inputs
                .iter()
                .filter_map(|(_, inp)| match inp {
                    GraphInput::Link { node, .. } if to_run.contains(node) => {
                        Some(absorbed.get(node).copied().unwrap_or(*node))
                    }
                    _ => None,
                })
                .collect();
            srcs.sort_unstable();
            srcs.dedup();
            waiting.insert(i, srcs.len());
            for s in srcs {
                dependents.entry(s).or_default().push(i);
            }
        }
        // Ready nodes start in the graph's topological order so a run is
        // reproducible when it is serial.
        let rank: HashMap<usize, usize> = graph
            .order
            .iter()
            .enumerate()
            .map(|(r, &i)| (i, r))
            .collect();
        let mut ready: Vec<usize> = to_run
            .iter()
            .copied()
            .filter(|i| waiting.get(i) == Some(&0))
            .collect();
        ready.sort_by_key(|i| std::cmp::Reverse(rank[i]));

        // The use schedule: nodes that run models on the device, in
        // topological order. They run one at a time in this order, so the
        // residency policy sees the real future and the budget is never
        // shared by two model uses.
        let (schedule, use_of) = self.schedule(graph, &to_run, &rank, &keys);
        if !schedule.uses.is_empty() {
            emit(Event::Schedule {
                prompt_id: pid.clone(),
                uses: schedule.uses.clone(),
            });
        }
        self.runtime.set_schedule(schedule);
        let mut device_busy = false;
        let mut next_use = 0usize;

        let parallel = std::thread::available_parallelism().map_or(2, |n| n.get());
        let mut running: JoinSet<(usize, crate::fusion::Done)> = JoinSet::new();
        let mut failure: Option<(usize, NodeError)> = None;
        let mut interrupted_at: Option<usize> = None;

        loop {
            while failure.is_none() && interrupted_at.is_none() && running.len() < parallel {
                // The lowest-ranked ready node that may start: any node
                // without a device use; a device use when none runs and it
                // is next in the schedule (or, should the order ever stall,
                // when nothing runs at all).
                let pick = ready.iter().rposition(|i| match use_of.get(i) {
                    None => true,
                    Some(&at) => !device_busy && (at == next_use || running.is_empty()),
                });
                let Some(i) = pick.map(|p| ready.remove(p)) else {
                    break;
                };
                if let Some(&at) = use_of.get(&i) {
                    device_busy = true;
                    next_use = at + 1;
                    self.runtime.enter_use(Some(at));
                }
                if opts.cancel.is_cancelled() {
                    interrupted_at = Some(i);
                    break;
                }
                let node = &graph.nodes[i];
                emit(Event::Executing {
                    node: Some(node.id.clone()),
                    display_node: Some(node.id.clone()),
                    prompt_id: pid.clone(),
                });
                let mut values = HashMap::new();
                for (name, inp) in &node.inputs {
                    let v = match inp {
                        GraphInput::Const(v) => v.clone(),
                        GraphInput::Link { node: src, output } => {
                            match results.get(src).and_then(|e| e.values.get(*output)) {
                                Some(v) => v.clone(),
                                None => {
                                    failure = Some((
                                        i,
                                        NodeError::invalid(format!(
                                            "input \"{name}\": node \"{}\" returned no output {output}",
                                            graph.nodes[*src].id
                                        )),
                                    ));
                                    break;
                                }
                            }
                        }
                    };
                    values.insert(name.clone(), v);
                }
                if failure.is_some() {
                    break;
                }
                let ctx = self.context(graph, i, &opts, &shared);
                let imp = self.library.implementation(&node.class_type);
                let inputs = Inputs::new(values);
                let mut tail = chains.remove(&i).unwrap_or_default();
                for m in &mut tail {
                    m.ctx = Some(self.context(graph, m.index, &opts, &shared));
                }
                running.spawn_blocking(move || {
                    let done = match imp {
                        Some(imp) if !tail.is_empty() => {
                            crate::fusion::run_chain(i, imp.as_ref(), &ctx, &inputs, tail)
                        }
                        Some(imp) => {
                            let r = crate::fusion::guarded(imp.as_ref(), &ctx, &inputs, || {
                                imp.execute(&ctx, &inputs)
                            });
                            match r {
                                Ok(out) => crate::fusion::Done {
                                    finished: vec![i],
                                    outputs: vec![(i, out)],
                                    failure: None,
                                },
                                Err(e) => crate::fusion::Done {
                                    failure: Some((i, e)),
                                    ..Default::default()
                                },
                            }
                        }
                        None => crate::fusion::Done {
                            failure: Some((i, NodeError::NotImplemented(ctx.class_type.clone()))),
                            ..Default::default()
                        },
                    };
                    (i, done)
                });
            }
            let Some(joined) = running.join_next().await else {
                break;
            };
            let (i, done) = match joined {
                Ok(x) => {
                    if use_of.contains_key(&x.0) {
                        device_busy = false;
                        self.runtime.enter_use(None);
                    }
                    x
                }
                Err(e) => {
                    // Only reachable if the runtime shuts down mid-run.
                    return Err(RunError::Node {
                        node_id: String::new(),
                        node_type: String::new(),
                        message: format!("task failed: {e}"),
                    });
                }
            };
            let mut outputs: HashMap<usize, NodeOutput> = done.outputs.into_iter().collect();
            for j in done.finished {
                let id = graph.nodes[j].id.clone();
                if j != i {
                    // A chain member (its producer's start was announced).
                    emit(Event::Executing {
                        node: Some(id.clone()),
                        display_node: Some(id.clone()),
                        prompt_id: pid.clone(),
                    });
                }
                let Some(out) = outputs.remove(&j) else {
                    // Fused into the next: nothing on the host to keep.
                    report.executed.push(id);
                    continue;
                };
                let spec_outputs = self
                    .library
                    .registry
                    .get(&graph.nodes[j].class_type)
                    .map_or(0, |s| s.outputs.len());
                if out.values.len() < spec_outputs {
                    failure.get_or_insert((
                        j,
                        NodeError::invalid(format!(
                            "returned {} outputs, its type declares {spec_outputs}",
                            out.values.len()
                        )),
                    ));
                    break;
                }
                let entry = CacheEntry {
                    values: Arc::new(out.values),
                    ui: out.ui,
                };
                self.lock_cache().insert(keys[&j], entry.clone());
                if let Some(ui) = &entry.ui {
                    report.outputs.insert(id.clone(), ui.clone());
                    emit(Event::Executed {
                        node: id.clone(),
                        display_node: id.clone(),
                        output: ui.clone(),
                        prompt_id: pid.clone(),
                    });
                }
                report.executed.push(id);
                results.insert(j, entry);
            }
            match done.failure {
                Some((_, NodeError::Interrupted)) => {
                    interrupted_at.get_or_insert(i);
                }
                Some((j, e)) => {
                    failure.get_or_insert((j, e));
                }
                None if failure.is_none() => {
                    if let Some(ds) = dependents.get(&i) {
                        for &d in ds {
                            if let Some(w) = waiting.get_mut(&d) {
                                *w -= 1;
                                if *w == 0 {
                                    ready.push(d);
                                }
                            }
                        }
                        ready.sort_by_key(|i| std::cmp::Reverse(rank[i]));
                    }
                }
                None => {}
            }
        }

        if let Some((i, e)) = failure {
            let node = &graph.nodes[i];
            // A node's error may quote an input (a path, a prefix) that is
            // megabytes long; the report keeps its start and its end.
            let message = sdkit_schema::diagnostic::cap_message(e.to_string());
            emit(Event::ExecutionError {
                prompt_id: pid.clone(),
                node_id: node.id.clone(),
                node_type: node.class_type.clone(),
                executed: report.executed.clone(),
                exception_message: message.clone(),
                exception_type: error_type(&e).into(),
                traceback: Vec::new(),
                current_inputs: Json::Object(Map::new()),
                current_outputs: Json::Object(Map::new()),
                timestamp: now_ms(),
            });
            emit(Event::Executing {
                node: None,
                display_node: None,
                prompt_id: pid.clone(),
            });
            return Err(RunError::Node {
                node_id: node.id.clone(),
                node_type: node.class_type.clone(),
                message,
            });
        }
        if interrupted_at.is_some() || opts.cancel.is_cancelled() {
            let (node_id, node_type) = interrupted_at.map_or((String::new(), String::new()), |i| {
                (graph.nodes[i].id.clone(), graph.nodes[i].class_type.clone())
            });
            emit(Event::ExecutionInterrupted {
                prompt_id: pid.clone(),
                node_id,
                node_type,
                executed: report.executed.clone(),
                timestamp: now_ms(),
            });
            emit(Event::Executing {
                node: None,
                display_node: None,
                prompt_id: pid.clone(),
            });
            return Err(RunError::Interrupted);
        }

        // Keep only what this graph uses, so memory is bounded by one
        // workflow's outputs while edits of it still hit the cache.
        let live: HashSet<u64> = needed.iter().map(|i| keys[i]).collect();
        self.lock_cache().retain(|k, _| live.contains(k));

        emit(Event::ExecutionSuccess {
            prompt_id: pid.clone(),
            timestamp: now_ms(),
        });
        emit(Event::Executing {
            node: None,
            display_node: None,
            prompt_id: pid,
        });
        Ok(report)
    }
}

impl Executor {
    /// The model uses among `to_run`, in rank order, each naming its
    /// models by the cache key and output of the node they come from; and
    /// each such node's position.
    fn schedule(
        &self,
        graph: &Graph,
        to_run: &HashSet<usize>,
        rank: &HashMap<usize, usize>,
        keys: &HashMap<usize, u64>,
    ) -> (UseSchedule, HashMap<usize, usize>) {
        let mut nodes: Vec<usize> = to_run.iter().copied().collect();
        nodes.sort_by_key(|i| rank[i]);
        let mut schedule = UseSchedule::default();
        let mut use_of = HashMap::new();
        for i in nodes {
            let node = &graph.nodes[i];
            let Some(imp) = self.library.implementation(&node.class_type) else {
                continue;
            };
            let device = imp.device_inputs();
            let models: Vec<String> = node
                .inputs
                .iter()
                .filter(|(name, _)| device.contains(&name.as_str()))
                .filter_map(|(_, inp)| match inp {
                    GraphInput::Link { node, output } => Some(format!(
                        "{:016x}.{output}",
                        keys.get(node).copied().unwrap_or(0)
                    )),
                    GraphInput::Const(_) => None,
                })
                .collect();
            if models.is_empty() {
                continue;
            }
            use_of.insert(i, schedule.uses.len());
            schedule.uses.push(ScheduledUse {
                node: node.id.clone(),
                class_type: node.class_type.clone(),
                models,
            });
        }
        (schedule, use_of)
    }
}

fn error_type(e: &NodeError) -> &'static str {
    match e {
        NodeError::MissingInput(_) | NodeError::InputType { .. } => "TypeError",
        NodeError::Invalid(_) => "ValueError",
        NodeError::File { .. } => "FileNotFoundError",
        NodeError::NotImplemented(_) => "NotImplementedError",
        NodeError::Interrupted => "InterruptProcessingException",
        NodeError::OutOfMemory { .. } => "torch.OutOfMemoryError",
    }
}
