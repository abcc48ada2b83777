//! sdkit-engine: validates workflows and runs them.
//!
//! * [`graph`]: validation of a workflow into a typed DAG, with diagnostics.
//! * [`exec`]: the executor, its cache and cancellation.
//! * [`event`]: ComfyUI-shaped execution events.
//! * [`node`]: the interface node implementations provide.
//! * [`value`]: values on links (images, masks, latents, ...).
//! * [`memory`]: fallible host allocation and the memory check before a node.
//! * [`paths`]: ComfyUI's folder layout.
//!
//! The compute stack (tensor IR, planner, backends, runtime, weights) is
//! the `sdkit-compute` crate below this one; nodes name its types there.
//! `Runtime` is re-exported because every `NodeContext` carries one.

pub mod event;
pub mod exec;
mod fusion;
pub mod graph;
pub mod memory;
pub mod node;
pub mod paths;
pub mod value;

pub use event::{Event, EventSink};
pub use exec::{Executor, RunError, RunOptions, RunReport};
pub use graph::{validate, validate_for, Graph, GraphInput, GraphNode, Outputs};
pub use node::{
    CancelToken, ImageStage, Inputs, NodeContext, NodeError, NodeImpl, NodeLibrary, NodeOutput,
};
pub use paths::Paths;
pub use sdkit_compute::runtime::{Runtime, RuntimeError};
pub use value::{Latent, Tensor, Value};
