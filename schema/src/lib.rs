//! sdkit-schema: what workflows are made of, and how they are written.
//!
//! * [`spec`]: node type specifications (sockets, widgets, outputs) and the
//!   [`Registry`] of them.
//! * [`syntax`]: a JSON/RON reader that keeps line:column positions.
//! * [`workflow`]: the workflow document and its native, ComfyUI API and
//!   ComfyUI UI forms.
//! * [`diagnostic`]: problems found in a workflow, with ComfyUI's names.
//! * [`export`]: ComfyUI `/object_info` and a JSON Schema for editors.
//!
//! This crate is pure: no I/O, no GPU, no engine.

pub mod diagnostic;
pub mod export;
pub mod spec;
pub mod syntax;
pub mod ui;
pub mod workflow;

pub use diagnostic::{DiagKind, Diagnostic, Severity};
pub use spec::{NodeSpec, Registry, SocketType};
pub use workflow::{Format, InputValue, Link, OutputRef, Workflow};
