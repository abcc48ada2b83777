//! The backend's options ([`Options`]).

use super::*;

/// Backend options.
#[derive(Clone, Debug)]
pub struct Options {
    /// Adapter name filter (case-insensitive substring).
    pub adapter: Option<String>,
    /// Store weights as f16 when the adapter supports SHADER_F16.
    pub allow_f16: bool,
    /// Use subgroup operations (in reductions) when the adapter has SUBGROUP.
    pub allow_subgroups: bool,
    /// Run matrix products (matmul, conv) on cooperative matrices (tensor
    /// cores) where the adapter offers f16 products with f32 accumulation:
    /// both operands are rounded to f16, as PyTorch's fp16 path does.
    pub allow_coopmat: bool,
    /// Store activations (and inputs/outputs) as f16 too, where the
    /// adapter supports SHADER_F16: half the memory traffic, f32 arithmetic
    /// inside every kernel. Off by default: seed-exact parity with ComfyUI
    /// is measured in f32.
    pub f16_activations: bool,
    /// Fixes the cooperative GEMM tiling (benchmarks compare tilings);
    /// None chooses by size.
    pub gemm_tiles: Option<codegen::CoopTiles>,
    /// Cooperative attention in two passes (see [`codegen::Caps`]).
    pub two_pass_attention: bool,
    /// Query tiles per subgroup of single-pass cooperative attention
    /// ([`codegen::Caps::attention_tiles`]); 1 until a GPU run shows 2
    /// helps (tuning tries it).
    pub attention_tiles: usize,
    /// Where the adapter has no cooperative matrices (but SUBGROUP and
    /// SHADER_F16 with a fixed subgroup size), run the cooperative kernels
    /// on fragments emulated in plain WGSL: much slower, for testing those
    /// kernels on any adapter (lavapipe in CI).
    pub emulate_coopmat: bool,
    /// Split the depth of cooperative products, and the rows of group
    /// norms, whose grid is too small to fill the GPU
    /// ([`codegen::Caps::split_k`]); off only to compare.
    pub split_k: bool,
    /// Staged cooperative products prefetch the next depth step, and
    /// cooperative attention the next key block, into registers
    /// ([`codegen::Caps::prefetch`]).
    pub prefetch: bool,
    /// Two workgroup stages for staged cooperative operands
    /// ([`codegen::Caps::double_buffer`]); off until a GPU run shows it
    /// helps.
    pub double_buffer: bool,
    /// Staged operands read in 16-byte units where their layout allows
    /// ([`codegen::Caps::vector_staging`]); off only to compare.
    pub vector_staging: bool,
    /// Cooperative convs copy their input channels-last first, where it
    /// allows ([`codegen::Caps::channels_last`]); off only to compare.
    pub channels_last: bool,
    /// Cooperative GEMM workgroups take their output blocks in grouped
    /// order ([`codegen::Caps::raster`]); off only to compare.
    pub raster: bool,
    /// Kernel inputs that no binding of their dispatch writes (weights,
    /// per-run inputs) are bound read-only ([`codegen::Operand::read_only`]);
    /// off only to compare.
    pub read_only_inputs: bool,
    /// Compile shaders with all of wgpu's runtime checks: index clamping
    /// on every array access, a counter bounding every loop, guarded
    /// integer division and zeroed workgroup memory. Off by default: the
    /// generated kernels keep their indices in bounds, their loops have
    /// fixed bounds and they write workgroup memory before reading it (the
    /// conformance suite runs them unchecked, with workgroup memory
    /// poisoned), and the loop counters cost the tight loops their
    /// unrolling. Off, bounds checks still stay where the device does not
    /// check buffer accesses itself (everywhere but Vulkan, whose robust
    /// buffer access wgpu enables). On to rule the generated code out when
    /// chasing a wrong result.
    pub shader_checks: bool,
    /// With `shader_checks` off, keep wgpu's bounds checks (index clamps)
    /// on Vulkan as well, loops and division still unchecked. Off by
    /// default; for benchmarks: on lavapipe the portable attention runs
    /// ~20% faster with the clamps than without (93 against 117 ms), so
    /// what they cost or save on a GPU is measured, not assumed.
    pub bounds_checks: bool,
    /// Test aid: every kernel first fills its workgroup memory with NaN
    /// (garbage for integers), so a read of an element it never wrote
    /// shows in the output (see [`poison`]).
    pub poison_workgroup_memory: bool,
    /// Folder for the driver's compiled-pipeline cache (wgpu's
    /// PipelineCache, where the adapter has PIPELINE_CACHE): loaded when
    /// the device opens and rewritten after prepares that compiled new
    /// kernels, so the next process skips the driver's compile. The
    /// kernel tuning file ([`Options::tuning`]) lives there too. None: no
    /// files ([`default_cache_dir`] is what the CLI uses).
    pub pipeline_cache_dir: Option<std::path::PathBuf>,
    /// Whether tensor-core kernels run variants measured fastest on this
    /// device ([`Tuning`]; [`tune`] says what varies). Off by default:
    /// measuring costs the first prepare of each kernel shape.
    pub tuning: Tuning,
    /// Bind at most this many bytes per binding (below the adapter's own
    /// limit), splitting larger tensors; lets tests exercise splitting.
    pub max_binding_bytes: Option<u64>,
    /// Device memory a prepared program may use (activations, resident
    /// weights, the stream arena). Weights that do not fit stream from host
    /// memory every run ([`crate::plan::residency`]). None: no limit.
    pub budget: Option<u64>,
    /// Treat the device as having only this much memory: a prepare whose
    /// plan, with the weights other models keep, needs more fails with
    /// [`WgpuError::OutOfMemory`] as a driver would. Emulates a smaller GPU
    /// than the budget assumes (tests of the out-of-memory re-plan).
    pub device_memory: Option<u64>,
    /// Keep GGUF weights in their quant blocks on the device (Q4_K: 4.5
    /// bits a weight), decoded by each kernel where it reads them,
    /// instead of expanded to f16 at upload. On by default; off to
    /// compare.
    pub quantized_weights: bool,
    /// Loops whose state can stay on the device run there: a sampler
    /// whose CFG and step fit in the denoiser's program carries its
    /// latent from step to step on the device and reads back only the
    /// result (and previews). On by default; off to compare with the
    /// host loop.
    pub device_loops: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            adapter: None,
            allow_f16: true,
            allow_subgroups: true,
            allow_coopmat: true,
            f16_activations: false,
            max_binding_bytes: None,
            gemm_tiles: None,
            two_pass_attention: false,
            attention_tiles: 1,
            emulate_coopmat: false,
            split_k: true,
            prefetch: false,
            double_buffer: false,
            vector_staging: true,
            channels_last: true,
            raster: true,
            read_only_inputs: true,
            shader_checks: false,
            bounds_checks: false,
            poison_workgroup_memory: false,
            pipeline_cache_dir: None,
            tuning: Tuning::Off,
            budget: None,
            device_memory: None,
            quantized_weights: true,
            device_loops: true,
        }
    }
}
