//! The interface between the executor and node implementations.

use crate::event::{Event, EventSink};
use crate::paths::Paths;
use crate::value::{Latent, Tensor, Value};
use sdkit_schema::Registry;
use serde_json::Value as Json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Errors a node can return. The executor reports them as
/// `execution_error` with the node id and type.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("input \"{0}\" is missing")]
    MissingInput(String),
    #[error("input \"{name}\" has type {found}, expected {expected}")]
    InputType {
        name: String,
        expected: &'static str,
        found: String,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("node type {0} is not implemented yet in sdkit")]
    NotImplemented(String),
    #[error("interrupted")]
    Interrupted,
    /// A host allocation failed, or would not fit what the process can
    /// still get (`available`, when known).
    #[error("not enough memory for {what} ({}{})", crate::memory::human(*bytes),
        available.map(|a| format!(", {} available", crate::memory::human(a))).unwrap_or_default())]
    OutOfMemory {
        what: String,
        bytes: u64,
        available: Option<u64>,
    },
}

impl NodeError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        NodeError::Invalid(msg.into())
    }

    pub fn file(path: &std::path::Path, msg: impl std::fmt::Display) -> Self {
        NodeError::File {
            path: path.display().to_string(),
            message: msg.to_string(),
        }
    }
}

/// A cancellation flag shared by a run and everything it starts.
#[derive(Clone, Debug, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    pub fn reset(&self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// What a running node can see of its run.
#[derive(Clone)]
pub struct NodeContext {
    pub node_id: String,
    pub class_type: String,
    pub prompt_id: String,
    pub paths: Arc<Paths>,
    /// The workflow in ComfyUI API form (SaveImage's `prompt` chunk).
    pub prompt: Arc<Json>,
    /// Extra PNG text chunks, e.g. `workflow` (ComfyUI's extra_pnginfo).
    pub extra_pnginfo: Arc<serde_json::Map<String, Json>>,
    pub cancel: CancelToken,
    pub events: EventSink,
    /// The device nodes run tensor programs on.
    pub runtime: sdkit_compute::runtime::Runtime,
    /// How samplers preview their progress.
    pub preview: crate::event::PreviewMethod,
}

impl NodeContext {
    /// Fails with `Interrupted` once the run is cancelled; long nodes call
    /// this between steps.
    pub fn check_cancel(&self) -> Result<(), NodeError> {
        if self.cancel.is_cancelled() {
            Err(NodeError::Interrupted)
        } else {
            Ok(())
        }
    }

    /// Warns, and goes on as ComfyUI does, when a model's output holds NaN
    /// or infinite values: a broken checkpoint otherwise yields a black
    /// image and a successful run with no hint why. Returns how many there
    /// were.
    pub fn warn_non_finite(&self, what: &str, data: &[f32]) -> usize {
        let bad = data.iter().filter(|v| !v.is_finite()).count();
        if bad > 0 {
            tracing::warn!(
                "node {} ({}): {bad} of the {} values of {what} are NaN or infinite; \
                 the model's weights or settings may be broken",
                self.node_id,
                self.class_type,
                data.len()
            );
        }
        bad
    }

    /// Reports a preview of the node's current result (a sampler's latent
    /// preview).
    pub fn preview(&self, image: crate::event::PreviewImage) {
        (self.events)(&Event::Preview {
            prompt_id: self.prompt_id.clone(),
            node: self.node_id.clone(),
            image,
        });
    }

    /// Progress reports for this node that outlive a borrow of it (kernel
    /// tuning during a prepare, [`crate::Runtime::with_tuning_progress`]).
    pub fn progress_sink(&self) -> Arc<dyn Fn(usize, usize) + Send + Sync> {
        let (events, prompt_id, node) = (
            Arc::clone(&self.events),
            self.prompt_id.clone(),
            self.node_id.clone(),
        );
        Arc::new(move |value, max| {
            events(&Event::Progress {
                value: value as u64,
                max: max as u64,
                prompt_id: prompt_id.clone(),
                node: node.clone(),
            })
        })
    }

    /// Reports progress and checks for cancellation.
    pub fn progress(&self, value: u64, max: u64) -> Result<(), NodeError> {
        (self.events)(&Event::Progress {
            value,
            max,
            prompt_id: self.prompt_id.clone(),
            node: self.node_id.clone(),
        });
        self.check_cancel()
    }
}

/// A node's inputs by name, after validation coerced every constant to its
/// declared type.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    values: HashMap<String, Value>,
}

impl Inputs {
    pub fn new(values: HashMap<String, Value>) -> Self {
        Inputs { values }
    }

    pub fn get(&self, name: &str) -> Option<&Value> {
        self.values.get(name)
    }

    pub fn require(&self, name: &str) -> Result<&Value, NodeError> {
        self.get(name)
            .ok_or_else(|| NodeError::MissingInput(name.to_string()))
    }

    fn mismatch(name: &str, expected: &'static str, v: &Value) -> NodeError {
        NodeError::InputType {
            name: name.to_string(),
            expected,
            found: format!("{v:?}"),
        }
    }

    pub fn int(&self, name: &str) -> Result<i128, NodeError> {
        match self.require(name)? {
            Value::Int(i) => Ok(*i),
            v => Err(Self::mismatch(name, "INT", v)),
        }
    }

    /// An INT input that must fit a usize (sizes, counts).
    pub fn usize(&self, name: &str) -> Result<usize, NodeError> {
        let i = self.int(name)?;
        usize::try_from(i).map_err(|_| NodeError::invalid(format!("{name} = {i} is out of range")))
    }

    pub fn float(&self, name: &str) -> Result<f64, NodeError> {
        match self.require(name)? {
            Value::Float(f) => Ok(*f),
            Value::Int(i) => Ok(*i as f64),
            v => Err(Self::mismatch(name, "FLOAT", v)),
        }
    }

    pub fn string(&self, name: &str) -> Result<&str, NodeError> {
        match self.require(name)? {
            Value::String(s) => Ok(s),
            v => Err(Self::mismatch(name, "STRING", v)),
        }
    }

    pub fn bool(&self, name: &str) -> Result<bool, NodeError> {
        match self.require(name)? {
            Value::Bool(b) => Ok(*b),
            v => Err(Self::mismatch(name, "BOOLEAN", v)),
        }
    }

    pub fn image(&self, name: &str) -> Result<&Arc<Tensor>, NodeError> {
        match self.require(name)? {
            Value::Image(t) => Ok(t),
            v => Err(Self::mismatch(name, "IMAGE", v)),
        }
    }

    pub fn mask(&self, name: &str) -> Result<&Arc<Tensor>, NodeError> {
        match self.require(name)? {
            Value::Mask(t) => Ok(t),
            v => Err(Self::mismatch(name, "MASK", v)),
        }
    }

    pub fn latent(&self, name: &str) -> Result<&Arc<Latent>, NodeError> {
        match self.require(name)? {
            Value::Latent(l) => Ok(l),
            v => Err(Self::mismatch(name, "LATENT", v)),
        }
    }
}

/// What a node returns: one value per declared output, and optionally a UI
/// payload (`executed` event's `output`, e.g. `{"images": [...]}`).
#[derive(Clone, Debug, Default)]
pub struct NodeOutput {
    pub values: Vec<Value>,
    pub ui: Option<Json>,
}

impl NodeOutput {
    pub fn values(values: Vec<Value>) -> Self {
        NodeOutput { values, ui: None }
    }
}

/// A node type's behaviour. Implementations are stateless; everything a
/// run needs comes through the context and inputs.
pub trait NodeImpl: Send + Sync {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError>;

    /// ComfyUI's IS_CHANGED: a fingerprint of outside state (e.g. a file's
    /// contents) that the cache key includes, so a node re-runs when its
    /// source changes. Called with the constant inputs only.
    fn fingerprint(&self, _ctx: &NodeContext, _inputs: &Inputs) -> Option<String> {
        None
    }

    /// The inputs holding models this node runs on the device (a
    /// sampler's `model`, a text encoder's `clip`, a decoder's `vae`), not
    /// those it only passes on or patches. The executor runs such nodes
    /// one at a time, in its use schedule's order, and plans weight
    /// residency over that schedule ([`sdkit_compute::plan::schedule`]).
    fn device_inputs(&self) -> &'static [&'static str] {
        &[]
    }

    /// About how many bytes of host memory the node will allocate, from its
    /// inputs (output tensors, decoded files, working copies). The executor
    /// refuses the node before it starts when this exceeds the memory the
    /// process can still get ([`crate::memory::admit`]). `None`: unknown or
    /// small, never refused.
    fn estimate_bytes(&self, _ctx: &NodeContext, _inputs: &Inputs) -> Option<u64> {
        None
    }

    /// This node as a stage of a fused image chain: its IMAGE output is a
    /// function of the IMAGE input the stage names and of `inputs` (its
    /// constant inputs, the image left out), which a producer on a GPU
    /// appends to its own program so the image never visits the host in
    /// between. `None`: these inputs keep the node on the host (a mode
    /// with no tensor form, or the node is not a pure image operation).
    fn image_stage(&self, _inputs: &Inputs) -> Option<ImageStage> {
        None
    }

    /// Whether [`NodeImpl::execute_with_tail`] can append image stages to
    /// the program that makes this node's only output, an IMAGE.
    fn takes_image_tail(&self) -> bool {
        false
    }

    /// Runs with `tail` appended to the program that makes output 0 and
    /// returns the last stage's image as that output. `None`: not done this
    /// time (the executor then runs the node and each stage's node as
    /// usual).
    fn execute_with_tail(
        &self,
        _ctx: &NodeContext,
        _inputs: &Inputs,
        _tail: &[ImageStage],
    ) -> Option<Result<NodeOutput, NodeError>> {
        None
    }
}

/// A node's operation on an IMAGE (`[b, h, w, c]`, f32) in tensor form; see
/// [`NodeImpl::image_stage`].
pub struct ImageStage {
    /// The IMAGE input the operation reads.
    pub input: &'static str,
    /// Tensors the operation reads besides the image (a blur's kernel),
    /// under the names its `append` declares with `GraphBuilder::input`.
    pub data: Vec<(&'static str, Arc<Vec<f32>>)>,
    pub append: Box<AppendStage>,
}

/// Appends a stage's operations on the image `x` to `g`.
pub type AppendStage = dyn for<'a> Fn(
        &'a sdkit_compute::tensor::GraphBuilder,
        sdkit_compute::tensor::T<'a>,
    ) -> Result<sdkit_compute::tensor::T<'a>, sdkit_compute::tensor::ShapeError>
    + Send
    + Sync;

impl ImageStage {
    pub fn new(
        input: &'static str,
        append: impl for<'a> Fn(
                &'a sdkit_compute::tensor::GraphBuilder,
                sdkit_compute::tensor::T<'a>,
            )
                -> Result<sdkit_compute::tensor::T<'a>, sdkit_compute::tensor::ShapeError>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        ImageStage {
            input,
            data: Vec::new(),
            append: Box::new(append),
        }
    }

    /// The stage with `data` bound to the inputs it declares.
    pub fn with_data(mut self, data: Vec<(&'static str, Arc<Vec<f32>>)>) -> Self {
        self.data = data;
        self
    }

    /// `stages` applied in order to `x`. Stage `i`'s inputs are declared
    /// as `stage{i}.NAME` (two blurs in a chain keep their own kernels);
    /// [`ImageStage::bindings`] names them the same way.
    pub fn apply_all<'a>(
        stages: &[ImageStage],
        g: &'a sdkit_compute::tensor::GraphBuilder,
        mut x: sdkit_compute::tensor::T<'a>,
    ) -> Result<sdkit_compute::tensor::T<'a>, sdkit_compute::tensor::ShapeError> {
        for (i, s) in stages.iter().enumerate() {
            g.set_input_prefix(&format!("stage{i}."));
            let y = (s.append)(g, x);
            g.set_input_prefix("");
            x = y?;
        }
        Ok(x)
    }

    /// The stages' data under the names [`ImageStage::apply_all`] declares.
    pub fn bindings(stages: &[ImageStage]) -> Vec<(String, Arc<Vec<f32>>)> {
        stages
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                s.data
                    .iter()
                    .map(move |(name, t)| (format!("stage{i}.{name}"), t.clone()))
            })
            .collect()
    }
}

/// Node specs plus the implementations that exist so far. A spec without an
/// implementation validates but fails to run with "not implemented yet".
#[derive(Clone, Default)]
pub struct NodeLibrary {
    pub registry: Registry,
    impls: HashMap<String, Arc<dyn NodeImpl>>,
}

impl NodeLibrary {
    pub fn new(registry: Registry) -> Self {
        NodeLibrary {
            registry,
            impls: HashMap::new(),
        }
    }

    pub fn implement(&mut self, name: &str, imp: impl NodeImpl + 'static) {
        self.impls.insert(name.to_string(), Arc::new(imp));
    }

    pub fn implementation(&self, name: &str) -> Option<Arc<dyn NodeImpl>> {
        self.impls.get(name).cloned()
    }

    pub fn is_implemented(&self, name: &str) -> bool {
        self.impls.contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A broken checkpoint's NaN output is counted (and warned about), and
    /// the node goes on, as ComfyUI does.
    #[test]
    fn non_finite_outputs_are_counted() {
        let ctx = NodeContext {
            node_id: "3".into(),
            class_type: "KSampler".into(),
            prompt_id: "p".into(),
            paths: Arc::new(Paths::under(std::path::Path::new("."))),
            prompt: Arc::new(Json::Null),
            extra_pnginfo: Arc::new(serde_json::Map::new()),
            cancel: CancelToken::new(),
            events: crate::event::discard(),
            runtime: sdkit_compute::runtime::Runtime::cpu(),
            preview: Default::default(),
        };
        let data = [0.5, f32::NAN, f32::INFINITY, -1.0, f32::NEG_INFINITY];
        assert_eq!(ctx.warn_non_finite("the sampled latent", &data), 3);
        assert_eq!(ctx.warn_non_finite("the sampled latent", &[0.0, 1.0]), 0);
    }
}
