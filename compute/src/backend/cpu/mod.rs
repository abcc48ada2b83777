pub mod kernels;
mod run;

pub use run::{run, Bindings, CpuError};
