pub mod cpu;
pub mod wgpu;
