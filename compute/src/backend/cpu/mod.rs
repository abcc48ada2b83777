// The one module of the CPU backend with `unsafe`: AMX tile instructions.
#[allow(unsafe_code)]
pub mod amx;
pub mod kernels;
mod run;

pub use kernels::Products;
pub use run::{run, run_with, Bindings, CpuError, PackedWeight, PackedWeights};

/// Sets how many threads the CPU backend's kernels use (the process-wide
/// pool; every core by default). Call once, before anything runs: the
/// pool can be built only once.
pub fn set_threads(n: usize) -> Result<(), String> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n.max(1))
        .build_global()
        .map_err(|e| format!("cannot set the CPU thread count: {e}"))
}

/// Threads the CPU backend's kernels use.
pub fn threads() -> usize {
    rayon::current_num_threads()
}
