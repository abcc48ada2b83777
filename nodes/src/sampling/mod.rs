//! Sampling maths that knows nothing about UNets: the model's noise
//! schedule (ComfyUI's ModelSamplingDiscrete) and schedulers. Samplers
//! (Euler, DPM++, ...) join here.

pub mod discrete;
pub mod euler;
pub mod samplers;
pub(crate) mod solvers;
pub(crate) mod steps;
pub(crate) mod unipc;
