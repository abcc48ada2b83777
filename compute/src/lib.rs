//! sdkit-compute: the compute stack models run on, below the workflow
//! runtime (`sdkit-engine`), which it knows nothing about.
//!
//! * [`tensor`]: the tensor graph models are built as (op IR + builder,
//!   the weight accessor `Scope`, the reference evaluator).
//! * [`plan`]: the planner: fusion, views, activation memory → `Program`;
//!   residency and the schedule of model uses.
//! * [`backend`]: backends that replay Programs (`cpu`, `wgpu`).
//! * [`runtime`]: the device programs run on, over the backends, and the
//!   `Bindings` of a program's weights and inputs.
//! * [`weights`]: safetensors files, memory-mapped and lazy.
//! * [`atomic`]: atomic writes through pid-named temporary files, and the
//!   sweep that removes those of writers that died.

pub mod atomic;
pub mod backend;
pub mod plan;
pub mod runtime;
pub mod tensor;
pub mod weights;

pub use runtime::{Bindings, Runtime, RuntimeError};
