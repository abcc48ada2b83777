//! sdkit-engine: validates workflows and runs them.
//!
//! * [`graph`]: validation of a workflow into a typed DAG, with diagnostics.
//! * [`exec`]: the executor, its cache and cancellation.
//! * [`event`]: ComfyUI-shaped execution events.
//! * [`node`]: the interface node implementations provide.
//! * [`value`]: values on links (images, masks, latents, ...).
//! * [`memory`]: fallible host allocation and the memory check before a node.
//! * [`paths`]: ComfyUI's folder layout.
//! * [`tensor`]: the tensor graph models are built as (op IR + builder).
//! * [`plan`]: the planner: fusion, views, activation memory → `Program`.
//! * [`backend`]: backends that replay Programs (`cpu`, `wgpu`).
//! * [`runtime`]: the device a run's nodes use, over the backends.
//! * [`weights`]: safetensors files, memory-mapped and lazy.
//! * [`atomic`]: atomic writes through pid-named temporary files, and the
//!   sweep that removes those of writers that died.

pub mod atomic;
pub mod backend;
pub mod event;
pub mod exec;
pub mod graph;
pub mod memory;
pub mod node;
pub mod paths;
pub mod plan;
pub mod runtime;
pub mod tensor;
pub mod value;
pub mod weights;

pub use event::{Event, EventSink};
pub use exec::{Executor, RunError, RunOptions, RunReport};
pub use graph::{validate, validate_for, Graph, GraphInput, GraphNode, Outputs};
pub use node::{CancelToken, Inputs, NodeContext, NodeError, NodeImpl, NodeLibrary, NodeOutput};
pub use paths::Paths;
pub use runtime::{Runtime, RuntimeError};
pub use value::{Latent, Tensor, Value};
