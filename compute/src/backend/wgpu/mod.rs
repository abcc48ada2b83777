//! The wgpu backend: replays the same Programs as the CPU backend on
//! Vulkan, Metal or DX12 (and Mesa's lavapipe in CI).
//!
//! Activations live in one arena buffer laid out by the planner; each
//! kernel binds ranges of it (offsets are 256-byte aligned by the planner).
//! Weights and inputs are separate buffers. Shaders come from [`codegen`]
//! and are cached by source, so replaying a Program compiles nothing new.
//!
//! Weights are stored as f16 where the adapter has SHADER_F16 (arithmetic
//! stays f32; activations too with [`Options::f16_activations`]).
//! Reductions use subgroup operations where the adapter has SUBGROUP, and
//! matmul, conv and attention run on cooperative matrices (tensor cores)
//! where it offers f16 fragments with f32 accumulation; elsewhere the
//! portable register-tiled kernels run, and [`Options::emulate_coopmat`]
//! runs the cooperative kernels on emulated fragments for tests. Tensors
//! larger than the device's storage binding limit are bound as several
//! consecutive ranges, which the generated accessors pick between.
//! Streamed weights are copied between compute passes on the one queue,
//! not yet overlapped with compute.

pub mod codegen;
mod emulate;
mod poison;
pub mod probe;
mod quant;
mod required;
mod tune;

use crate::backend::cpu::Bindings;
use crate::backend::BindError;
use crate::plan::residency::{self, ResidencyPlan};
use crate::plan::schedule;
use crate::plan::{BufferKind, Command, KernelId, Program};
use crate::tensor::reference::Array;
use quant::QuantWeights;
pub use required::{no_adapter, REQUIRE_VAR};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
pub use tune::{Tuned, TunedKernel, Tuning, TuningObserver, Variant};

#[derive(Debug, thiserror::Error)]
pub enum WgpuError {
    #[error("no GPU adapter found{0}")]
    NoAdapter(String),
    #[error("cannot open the device: {0}")]
    Device(String),
    #[error(transparent)]
    Bind(#[from] crate::backend::BindError),
    #[error("{0}")]
    Weight(String),
    #[error("kernel k{kernel} ({kind}): {message}")]
    Unsupported {
        kernel: usize,
        kind: &'static str,
        message: String,
    },
    #[error("buffer of {bytes} bytes exceeds the device's buffer size limit of {limit} bytes")]
    TooLarge { bytes: u64, limit: u64 },
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    #[error("{0}")]
    Budget(#[from] residency::ResidencyError),
    #[error("device error: {0}")]
    Validation(String),
    #[error("device lost or readback failed: {0}")]
    Lost(String),
    #[error("probe {probe}: {message}")]
    Probe { probe: String, message: String },
}

/// A description of an adapter, for `sdkit devices`.
#[derive(Clone, Debug)]
pub struct AdapterReport {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub features: Vec<String>,
    /// Cooperative-matrix shapes (M×N×K, input → accumulator types), where
    /// the adapter has the experimental feature.
    pub cooperative_matrix: Vec<String>,
    pub max_storage_buffer_binding_size: u64,
    pub max_buffer_size: u64,
    pub max_compute_workgroup_storage_size: u32,
    /// Lanes per subgroup (min, max); 0 where the adapter does not say.
    pub subgroup_size: (u32, u32),
    /// Kernels tuned on this adapter and driver ([`Tuning`]): in the
    /// default cache folder for [`adapters_with_tuning`], in the
    /// backend's own for a backend; 0 from [`adapters`], which reads no
    /// file (device selection calls it).
    pub tuned_kernels: usize,
}

fn report(a: &wgpu::Adapter) -> AdapterReport {
    let info = a.get_info();
    let limits = a.limits();
    let feats = a.features();
    let mut features = Vec::new();
    for (f, name) in [
        (wgpu::Features::SHADER_F16, "SHADER_F16"),
        (wgpu::Features::SUBGROUP, "SUBGROUP"),
        (wgpu::Features::TIMESTAMP_QUERY, "TIMESTAMP_QUERY"),
        (wgpu::Features::PIPELINE_CACHE, "PIPELINE_CACHE"),
        (
            wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
            "EXPERIMENTAL_COOPERATIVE_MATRIX",
        ),
    ] {
        if feats.contains(f) {
            features.push(name.to_string());
        }
    }
    // The tile shapes a cooperative-matrix kernel would be built from.
    let cooperative_matrix = if feats.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        a.cooperative_matrix_properties()
            .iter()
            .map(|p| {
                format!(
                    "{}x{}x{} {:?}->{:?}",
                    p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type
                )
            })
            .collect()
    } else {
        Vec::new()
    };
    AdapterReport {
        name: info.name,
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info),
        features,
        cooperative_matrix,
        max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
        max_buffer_size: limits.max_buffer_size,
        max_compute_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
        subgroup_size: (info.subgroup_min_size, info.subgroup_max_size),
        tuned_kernels: 0,
    }
}

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
    wgpu::Instance::new(desc)
}

/// Every adapter this machine offers.
pub fn adapters() -> Vec<AdapterReport> {
    list_adapters(false)
}

/// [`adapters`], each with the kernels tuned for it in the default cache
/// folder (`sdkit devices`).
pub fn adapters_with_tuning() -> Vec<AdapterReport> {
    list_adapters(true)
}

fn list_adapters(tuning: bool) -> Vec<AdapterReport> {
    let dir = tuning.then(default_cache_dir).flatten();
    let inst = instance();
    pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()))
        .iter()
        .map(|a| AdapterReport {
            tuned_kernels: tune::Table::open(dir.as_deref(), &a.get_info()).len(),
            ..report(a)
        })
        .collect()
}

/// The cooperative-matrix configuration matrix kernels use: square f16
/// products into f32 (16×16 preferred: NVIDIA/AMD tensor cores; 8×8:
/// Apple's simdgroup matrices), on an adapter whose subgroup size is fixed
/// (the kernels divide a workgroup into subgroups by that size).
fn coop_config(a: &wgpu::Adapter) -> Option<codegen::Coop> {
    if !a
        .features()
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    {
        return None;
    }
    let info = a.get_info();
    if info.subgroup_min_size != info.subgroup_max_size || info.subgroup_min_size == 0 {
        return None;
    }
    let props = a.cooperative_matrix_properties();
    [16, 8].into_iter().find_map(|t| {
        props
            .iter()
            .any(|p| {
                p.m_size == t
                    && p.n_size == t
                    && p.k_size == t
                    && p.ab_type == wgpu::CooperativeScalarType::F16
                    && p.cr_type == wgpu::CooperativeScalarType::F32
            })
            .then_some(codegen::Coop {
                tile: t,
                subgroup: info.subgroup_min_size,
                emulated: false,
            })
    })
}

/// Emulated fragments ([`Options::emulate_coopmat`]): a row per lane, so
/// tiles as wide as the adapter's fixed subgroup (8 or 16 lanes).
fn emulated_coop(a: &wgpu::Adapter) -> Option<codegen::Coop> {
    let info = a.get_info();
    let lanes = info.subgroup_min_size;
    (lanes == info.subgroup_max_size && matches!(lanes, 8 | 16)).then_some(codegen::Coop {
        tile: lanes,
        subgroup: lanes,
        emulated: true,
    })
}

/// The pipeline cache for `device`, primed with `data` from an earlier
/// run where it is valid (wgpu checks its header against the adapter and
/// falls back to an empty cache otherwise).
#[allow(unsafe_code)]
fn load_pipeline_cache(device: &wgpu::Device, data: Option<&[u8]>) -> wgpu::PipelineCache {
    // SAFETY: `data` is only ever bytes this function's caller wrote from
    // `PipelineCache::get_data` into a file named by
    // `wgpu::util::pipeline_cache_key` for the same adapter; wgpu validates
    // the header (adapter, driver, wgpu version) and `fallback` makes any
    // mismatch or corruption an empty cache instead of an error.
    unsafe {
        device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
            label: Some("sdkit pipelines"),
            data,
            fallback: true,
        })
    }
}

/// The runtime checks generated shaders go without
/// ([`Options::shader_checks`] off): the counter wgpu puts in every loop
/// (which stops drivers unrolling it) and the guards on integer division
/// everywhere; bounds checks (index clamps, and buffer accesses where
/// the platform has no checks of its own) only on Vulkan, where wgpu
/// enables the device's robust buffer access, which keeps buffer accesses
/// checked. On Metal and DX12 they stay.
/// `bounds` keeps the bounds checks on Vulkan too
/// ([`Options::bounds_checks`]).
fn trusted_checks(backend: wgpu::Backend, bounds: bool) -> wgpu::ShaderRuntimeChecks {
    let mut checks = wgpu::ShaderRuntimeChecks::checked();
    checks.force_loop_bounding = false;
    checks.int_div_checks = false;
    checks.bounds_checks = bounds || backend != wgpu::Backend::Vulkan;
    checks
}

/// A shader module compiled with only `checks` of wgpu's runtime checks.
#[allow(unsafe_code)]
fn trusted_module(
    device: &wgpu::Device,
    desc: wgpu::ShaderModuleDescriptor,
    checks: wgpu::ShaderRuntimeChecks,
) -> wgpu::ShaderModule {
    // SAFETY: every shader comes from `codegen`, whose kernels bound every
    // loop by a constant or a monotone count (no infinite loops), divide
    // integers only by non-zero constants, index arrays and buffers only
    // within their lengths (edge tiles are guarded by explicit
    // comparisons or clamped indices, never by the runtime's clamping)
    // and write workgroup memory before reading it. The conformance suite
    // runs them this way, with workgroup memory poisoned, and a backend
    // test holds them to the checked build's bits. `checks` keeps bounds
    // checks wherever the device does not check buffer accesses itself.
    unsafe { device.create_shader_module_trusted(desc, checks) }
}

/// Where the CLI keeps the pipeline cache: `SDKIT_CACHE_DIR`, else the
/// platform's cache folder (`XDG_CACHE_HOME` or `~/.cache` on Linux,
/// `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on Windows) + `sdkit`.
pub fn default_cache_dir() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = env("SDKIT_CACHE_DIR") {
        return Some(d);
    }
    let base = if cfg!(windows) {
        env("LOCALAPPDATA")
    } else if cfg!(target_os = "macos") {
        env("HOME").map(|h| h.join("Library/Caches"))
    } else {
        env("XDG_CACHE_HOME").or_else(|| env("HOME").map(|h| h.join(".cache")))
    };
    base.map(|b| b.join("sdkit"))
}

/// The token wgpu asks for before it enables an experimental feature
/// (here only cooperative matrices, whose kernels the conformance suite
/// checks on the adapter before they are trusted).
#[allow(unsafe_code)]
fn experimental() -> wgpu::ExperimentalFeatures {
    // SAFETY: wgpu marks the token unsafe because experimental features may
    // have implementation bugs; we only enable cooperative matrices and use
    // them through naga-validated WGSL in uniform control flow.
    unsafe { wgpu::ExperimentalFeatures::enabled() }
}

fn rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

pub use crate::weights::f32_to_f16_bits;

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
    /// Where the adapter has no cooperative matrices (but SUBGROUP and
    /// SHADER_F16 with a fixed subgroup size), run the cooperative kernels
    /// on fragments emulated in plain WGSL: much slower, for testing those
    /// kernels on any adapter (lavapipe in CI).
    pub emulate_coopmat: bool,
    /// Split the depth of cooperative products, and the rows of group
    /// norms, whose grid is too small to fill the GPU
    /// ([`codegen::Caps::split_k`]); off only to compare.
    pub split_k: bool,
    /// Staged cooperative products prefetch the next depth step into
    /// registers ([`codegen::Caps::prefetch`]).
    pub prefetch: bool,
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
            emulate_coopmat: false,
            split_k: true,
            prefetch: false,
            shader_checks: false,
            bounds_checks: false,
            poison_workgroup_memory: false,
            pipeline_cache_dir: None,
            tuning: Tuning::Off,
            budget: None,
            device_memory: None,
            quantized_weights: true,
        }
    }
}

pub struct WgpuBackend {
    /// Weights are stored as f16 (compute stays f32).
    pub f16_weights: bool,
    /// Activations, inputs and outputs are stored as f16 too.
    pub f16_activations: bool,
    /// Reductions use subgroup operations.
    pub subgroups: bool,
    /// Matrix products run on cooperative matrices (tile and subgroup size).
    pub coop: Option<codegen::Coop>,
    caps: codegen::Caps,
    /// [`Options::shader_checks`], [`Options::bounds_checks`] and
    /// [`Options::poison_workgroup_memory`].
    shader_checks: bool,
    bounds_checks: bool,
    poison: bool,
    backend: wgpu::Backend,
    binding_cap: Option<u64>,
    split_operands: std::sync::atomic::AtomicUsize,
    device: wgpu::Device,
    queue: wgpu::Queue,
    pub adapter: AdapterReport,
    limits: wgpu::Limits,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    /// Bind group and pipeline layouts by binding count: every binding a
    /// read-write storage buffer. Explicit, so both passes of a split-K
    /// product take one bind group though each reads only some bindings.
    layouts: Mutex<HashMap<u32, Arc<(wgpu::BindGroupLayout, wgpu::PipelineLayout)>>>,
    /// The driver's pipeline cache and the file it persists to.
    pipeline_cache: Option<(wgpu::PipelineCache, std::path::PathBuf)>,
    /// Pipelines compiled since the cache file was last written.
    unsaved_pipelines: std::sync::atomic::AtomicUsize,
    tuning: Tuning,
    /// Tuned kernels, loaded from and saved to the cache folder.
    tuning_table: Mutex<tune::Table>,
    tuning_observer: Mutex<Option<TuningObserver>>,
    budget: Option<u64>,
    device_memory: Option<u64>,
    /// [`Options::quantized_weights`].
    quantized_weights: bool,
    resident: Mutex<Resident>,
    uploaded: std::sync::atomic::AtomicU64,
    /// Device bytes besides weights (activation arenas, inputs, stream
    /// arenas) of the programs prepared and not yet dropped.
    live: std::sync::atomic::AtomicU64,
    /// Arena and input buffers of dropped programs, oldest first, reused
    /// by the next prepare that needs one of the same size (the VAE's
    /// tiles, the next prompt's text encoder).
    pool: Mutex<Vec<Arc<wgpu::Buffer>>>,
    /// Arena and input buffers created (not taken from the pool).
    created: std::sync::atomic::AtomicUsize,
}

/// Usage of every storage buffer kernels bind: written by uploads and
/// copies, read back by copies.
const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// Idle buffers the pool keeps at most, and their bytes.
const POOL_BUFFERS: usize = 16;
const POOL_BYTES: u64 = 256 << 20;

/// Weight buffers kept across prepares (the next sampler run, the next
/// model use, the next prompt), keyed by name and host data (see
/// [`resident_key`]) and holding that data alive, so the same data is
/// never uploaded twice; a key whose data nobody else holds any more (its
/// model is gone) is dropped.
/// `state` mirrors them for the residency policy
/// ([`schedule::DeviceWeights::step`]), which decides what to evict
/// using the run's use schedule.
#[derive(Default)]
struct Resident {
    buffers: HashMap<String, ResidentWeight>,
    state: schedule::DeviceWeights,
    schedule: schedule::UseSchedule,
    /// The schedule position of the model use now running.
    at: Option<usize>,
}

impl Resident {
    fn remove(&mut self, name: &str) {
        self.buffers.remove(name);
        self.state.forget(name);
    }

    /// Drops every kept weight `drop` picks.
    fn remove_where(&mut self, drop: impl Fn(&ResidentWeight) -> bool) {
        let keys: Vec<String> = self
            .buffers
            .iter()
            .filter(|(_, r)| drop(r))
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            self.remove(&k);
        }
    }
}

struct ResidentWeight {
    source: Source,
    buffer: Arc<wgpu::Buffer>,
}

/// Where a resident weight's host data lives, to tell when its model is
/// gone: an f32 vector nobody else holds, or a file no store maps any more.
enum Source {
    Host(Arc<Vec<f32>>),
    File(std::sync::Weak<crate::weights::SafeTensors>),
}

impl Source {
    fn of(bind: &Bindings, name: &str) -> Result<Self, BindError> {
        if let Some(d) = bind.weights.get(name) {
            return Ok(Source::Host(Arc::clone(d)));
        }
        let w = bind
            .stored
            .get(name)
            .ok_or_else(|| BindError::MissingWeight(name.to_string()))?;
        Ok(Source::File(Arc::downgrade(w.file())))
    }

    fn orphaned(&self) -> bool {
        match self {
            Source::Host(d) => Arc::strong_count(d) == 1,
            Source::File(f) => f.strong_count() == 0,
        }
    }
}

/// A weight's bytes as the device stores it (f16 or f32, in `layout`'s
/// order; a quantized one's blocks as the file holds them, padded to
/// words): from the bound vector, or from the file. A stored weight in
/// its natural order is decoded a chunk at a time (whole storage units:
/// a GGUF weight's quant blocks), so no f32 copy of it exists on the
/// host; a relaid-out one is read whole, encoded and dropped.
fn device_bytes(
    bind: &Bindings,
    name: &str,
    layout: Option<&(usize, usize)>,
    half: bool,
    quantized: bool,
) -> Result<Vec<u8>, WgpuError> {
    if let Some(d) = bind.weights.get(name) {
        return Ok(encode(&device_order(d, layout), half));
    }
    let w = bind
        .stored
        .get(name)
        .ok_or_else(|| BindError::MissingWeight(name.to_string()))?;
    let err = |e: crate::weights::WeightError| WgpuError::Weight(format!("weight \"{name}\": {e}"));
    if quantized {
        let mut bytes = w.file().raw(w.key()).map_err(err)?.to_vec();
        bytes.resize(bytes.len().div_ceil(4) * 4, 0);
        return Ok(bytes);
    }
    if layout.is_some() {
        let data = w.to_f32().map_err(err)?;
        return Ok(encode(&device_order(&data, layout), half));
    }
    // About a million elements per chunk, in whole storage units.
    let (per, _) = w.dtype().block();
    let chunk = ((1 << 20) / per).max(1) * per;
    let mut bytes = Vec::with_capacity(w.len() * if half { 2 } else { 4 } + 2);
    let mut start = 0;
    while start < w.len() {
        let len = chunk.min(w.len() - start);
        let part = w.range_f32(start, len).map_err(err)?;
        bytes.extend(encode(&part, half));
        // encode pads an odd count of halves; only the last chunk can be odd.
        start += len;
    }
    bytes.resize(bytes.len().div_ceil(4) * 4, 0);
    Ok(bytes)
}

/// Elements bound for `name`.
fn bound_len(bind: &Bindings, name: &str) -> Result<usize, BindError> {
    match (bind.weights.get(name), bind.stored.get(name)) {
        (Some(d), _) => Ok(d.len()),
        (None, Some(w)) => Ok(w.len()),
        (None, None) => Err(BindError::MissingWeight(name.to_string())),
    }
}

impl WgpuBackend {
    /// Opens the best adapter (discrete > integrated > virtual > other >
    /// CPU software), or the first whose name contains `name`. Requests the
    /// adapter's real limits, not the defaults.
    pub fn new(name: Option<&str>) -> Result<Self, WgpuError> {
        Self::with_options(&Options {
            adapter: name.map(str::to_string),
            ..Options::default()
        })
    }

    pub fn with_options(opts: &Options) -> Result<Self, WgpuError> {
        let name = opts.adapter.as_deref();
        let inst = instance();
        let mut all = pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()));
        all.sort_by_key(|a| rank(a.get_info().device_type));
        let adapter = match name {
            Some(n) => {
                let n = n.to_lowercase();
                all.into_iter()
                    .find(|a| a.get_info().name.to_lowercase().contains(&n))
                    .ok_or_else(|| WgpuError::NoAdapter(format!(" matching \"{n}\"")))?
            }
            None => all.into_iter().next().ok_or_else(|| {
                WgpuError::NoAdapter(
                    " (on Linux without a GPU, install Mesa's lavapipe: mesa-vulkan-drivers)"
                        .into(),
                )
            })?,
        };
        let limits = adapter.limits();
        let f16 = opts.allow_f16 && adapter.features().contains(wgpu::Features::SHADER_F16);
        let subgroups =
            opts.allow_subgroups && adapter.features().contains(wgpu::Features::SUBGROUP);
        let mut features = wgpu::Features::empty();
        if f16 {
            features |= wgpu::Features::SHADER_F16;
        }
        if subgroups {
            features |= wgpu::Features::SUBGROUP;
        }
        let coop = if opts.allow_coopmat && f16 && subgroups {
            coop_config(&adapter).or_else(|| {
                opts.emulate_coopmat
                    .then(|| emulated_coop(&adapter))
                    .flatten()
            })
        } else {
            None
        };
        let tensor_cores = coop.is_some_and(|c| !c.emulated);
        if tensor_cores {
            features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        let cache_file = opts.pipeline_cache_dir.as_ref().and_then(|dir| {
            if !adapter.features().contains(wgpu::Features::PIPELINE_CACHE) {
                return None;
            }
            let key = wgpu::util::pipeline_cache_key(&adapter.get_info())?;
            Some(dir.join(key))
        });
        if cache_file.is_some() {
            features |= wgpu::Features::PIPELINE_CACHE;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("sdkit"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: if tensor_cores {
                experimental()
            } else {
                wgpu::ExperimentalFeatures::disabled()
            },
            ..Default::default()
        }))
        .map_err(|e| WgpuError::Device(e.to_string()))?;
        let pipeline_cache = cache_file.map(|file| {
            // A missing or unreadable file starts an empty cache.
            let data = std::fs::read(&file).ok();
            (load_pipeline_cache(&device, data.as_deref()), file)
        });
        let tuning_table = tune::Table::open(
            opts.pipeline_cache_dir
                .as_deref()
                .filter(|_| opts.tuning != Tuning::Off),
            &adapter.get_info(),
        );
        let caps = codegen::Caps {
            subgroups,
            coop,
            workgroup_memory: limits.max_compute_workgroup_storage_size,
            gemm_tiles: opts.gemm_tiles,
            two_pass_attention: opts.two_pass_attention,
            split_k: opts.split_k,
            prefetch: opts.prefetch,
        };
        Ok(WgpuBackend {
            f16_weights: f16,
            f16_activations: f16 && opts.f16_activations,
            subgroups,
            coop,
            caps,
            shader_checks: opts.shader_checks,
            bounds_checks: opts.bounds_checks,
            poison: opts.poison_workgroup_memory,
            backend: adapter.get_info().backend,
            binding_cap: opts.max_binding_bytes,
            split_operands: std::sync::atomic::AtomicUsize::new(0),
            device,
            queue,
            adapter: AdapterReport {
                tuned_kernels: tuning_table.len(),
                ..report(&adapter)
            },
            limits,
            pipelines: Mutex::new(HashMap::new()),
            layouts: Mutex::new(HashMap::new()),
            pipeline_cache,
            unsaved_pipelines: std::sync::atomic::AtomicUsize::new(0),
            tuning: opts.tuning,
            tuning_table: Mutex::new(tuning_table),
            tuning_observer: Mutex::new(None),
            budget: opts.budget,
            device_memory: opts.device_memory,
            quantized_weights: opts.quantized_weights,
            resident: Mutex::new(Resident::default()),
            uploaded: std::sync::atomic::AtomicU64::new(0),
            live: std::sync::atomic::AtomicU64::new(0),
            pool: Mutex::new(Vec::new()),
            created: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Weight bytes copied host → device so far (resident uploads and
    /// streamed copies).
    pub fn bytes_uploaded(&self) -> u64 {
        self.uploaded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The device memory budget, if any.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Drops every resident weight no prepared program still binds
    /// (`/free`, or before an out-of-memory re-plan).
    pub fn free_weights(&self) {
        self.lock_resident()
            .remove_where(|w| Arc::strong_count(&w.buffer) == 1);
        self.lock_pool().clear();
    }

    fn lock_pool(&self) -> std::sync::MutexGuard<'_, Vec<Arc<wgpu::Buffer>>> {
        self.pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A storage buffer of `size` bytes: an idle one of that size from the
    /// pool, or a new one.
    fn storage_buffer(&self, size: u64, label: &str) -> Arc<wgpu::Buffer> {
        let mut pool = self.lock_pool();
        if let Some(i) = pool.iter().position(|b| b.size() == size) {
            return pool.remove(i);
        }
        drop(pool);
        self.created
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Arc::new(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: STORAGE,
            mapped_at_creation: false,
        }))
    }

    /// Arena and input buffers created so far; prepares that found one of
    /// the right size idle in the pool create none.
    pub fn buffers_created(&self) -> usize {
        self.created.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Returns a buffer nothing else holds to the pool, dropping the
    /// oldest idle ones past the pool's limits.
    fn release(&self, buf: Arc<wgpu::Buffer>) {
        if Arc::strong_count(&buf) != 1 || buf.size() > POOL_BYTES {
            return;
        }
        let mut pool = self.lock_pool();
        pool.push(buf);
        while pool.len() > POOL_BUFFERS || pool.iter().map(|b| b.size()).sum::<u64>() > POOL_BYTES {
            pool.remove(0);
        }
    }

    /// Device bytes to leave free for `prog` when it is prepared after
    /// other programs of the same model that stay prepared (a sampler's
    /// conditioning groups): its activations and the most stream arena it
    /// can need.
    pub fn sibling_reserve(&self, prog: &Program) -> u64 {
        let elem = if self.f16_weights { 2 } else { 4 };
        let u = residency::ModelUse {
            weights: residency::weight_uses(prog, elem),
            kernels: prog.stats.dispatches,
            activation_bytes: self.activation_bytes(prog),
            runs: 1,
        };
        let align = u64::from(self.limits.min_storage_buffer_offset_alignment);
        u.activation_bytes + residency::stream_reserve(&u, align, self.binding_limit())
    }

    /// Bytes of weights kept resident between prepares.
    pub fn resident_bytes(&self) -> u64 {
        self.lock_resident().state.held_bytes()
    }

    /// The model uses of the run about to start, in order: what the
    /// residency policy evicts by.
    pub fn set_schedule(&self, s: schedule::UseSchedule) {
        let mut r = self.lock_resident();
        r.schedule = s;
        r.at = None;
    }

    /// The use at `position` in the schedule starts; its prepares tag the
    /// weights they keep with its models.
    pub fn enter_use(&self, position: Option<usize>) {
        self.lock_resident().at = position;
    }

    fn lock_resident(&self) -> std::sync::MutexGuard<'_, Resident> {
        self.resident
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The layouts of `bindings` read-write storage bindings.
    fn layout(&self, bindings: u32) -> Arc<(wgpu::BindGroupLayout, wgpu::PipelineLayout)> {
        let mut layouts = self
            .layouts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        layouts
            .entry(bindings)
            .or_insert_with(|| {
                let entries: Vec<wgpu::BindGroupLayoutEntry> = (0..bindings)
                    .map(|binding| wgpu::BindGroupLayoutEntry {
                        binding,
                        visibility: wgpu::ShaderStages::COMPUTE,
                        ty: wgpu::BindingType::Buffer {
                            ty: wgpu::BufferBindingType::Storage { read_only: false },
                            has_dynamic_offset: false,
                            min_binding_size: None,
                        },
                        count: None,
                    })
                    .collect();
                let group =
                    self.device
                        .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                            label: None,
                            entries: &entries,
                        });
                let pipeline =
                    self.device
                        .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                            label: None,
                            bind_group_layouts: &[Some(&group)],
                            immediate_size: 0,
                        });
                Arc::new((group, pipeline))
            })
            .clone()
    }

    /// The pipeline of `source`, whose bindings are `bindings` read-write
    /// storage buffers (compiled once per source).
    fn pipeline(&self, source: &str, bindings: u32) -> Result<Arc<wgpu::ComputePipeline>, String> {
        let layout = self.layout(bindings);
        let mut cache = self
            .pipelines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(p) = cache.get(source) {
            return Ok(p.clone());
        }
        let poisoned;
        let text = if self.poison {
            poisoned = poison::poison_workgroup_memory(source)?;
            &poisoned
        } else {
            source
        };
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: None,
            source: wgpu::ShaderSource::Wgsl(text.into()),
        };
        let module = if self.shader_checks {
            self.device.create_shader_module(desc)
        } else {
            trusted_module(
                &self.device,
                desc,
                trusted_checks(self.backend, self.bounds_checks),
            )
        };
        let p = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: None,
                layout: Some(&layout.1),
                module: &module,
                entry_point: Some("main"),
                compilation_options: wgpu::PipelineCompilationOptions {
                    zero_initialize_workgroup_memory: self.shader_checks,
                    ..Default::default()
                },
                cache: self.pipeline_cache.as_ref().map(|(c, _)| c),
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(format!("shader does not compile: {e}"));
        }
        let p = Arc::new(p);
        self.unsaved_pipelines
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        cache.insert(source.to_string(), p.clone());
        Ok(p)
    }

    /// Writes the driver's pipeline cache to its file (atomically) when
    /// pipelines were compiled since the last write. A failure to write
    /// only costs the next process its compile time: logged, not raised.
    pub fn save_pipeline_cache(&self) {
        let Some((cache, file)) = &self.pipeline_cache else {
            return;
        };
        if self
            .unsaved_pipelines
            .swap(0, std::sync::atomic::Ordering::Relaxed)
            == 0
        {
            return;
        }
        let Some(data) = cache.get_data() else {
            return;
        };
        if let Err(e) = write_atomically(file, &data) {
            tracing::warn!("pipeline cache {}: {e}", file.display());
        }
    }

    /// Whether compiled pipelines persist to a cache file.
    pub fn pipeline_cache_file(&self) -> Option<&std::path::Path> {
        self.pipeline_cache.as_ref().map(|(_, f)| f.as_path())
    }

    /// Kernel operands bound as several ranges so far (tensors past the
    /// binding limit).
    pub fn split_operands(&self) -> usize {
        self.split_operands
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Number of distinct pipelines compiled so far.
    pub fn pipelines_compiled(&self) -> usize {
        self.pipelines.lock().map_or(0, |c| c.len())
    }

    /// Bytes a buffer of `len` elements occupies (bindings are multiples
    /// of 4 bytes).
    fn stored_bytes(&self, len: usize, half: bool) -> u64 {
        if half {
            (len as u64 * 2).div_ceil(4) * 4
        } else {
            len as u64 * 4
        }
    }

    /// Bytes one binding may cover.
    fn binding_limit(&self) -> u64 {
        let dev = self.limits.max_storage_buffer_binding_size;
        self.binding_cap.map_or(dev, |c| c.min(dev)).max(256)
    }

    /// Whole-buffer checks: a single buffer must fit the device.
    fn check_binding(&self, bytes: u64) -> Result<(), WgpuError> {
        let limit = self.limits.max_buffer_size;
        if bytes > limit {
            return Err(WgpuError::TooLarge { bytes, limit });
        }
        Ok(())
    }

    /// Runs a program once; returns the graph outputs. For repeated runs
    /// (a sampling loop) use [`WgpuBackend::prepare`] once and
    /// [`Prepared::run`] per step.
    pub fn run(&self, prog: &Program, bind: &Bindings) -> Result<Vec<Array>, WgpuError> {
        let p = self.prepare(prog, bind)?;
        p.run(bind)
    }

    /// Allocates the arena, uploads the weights, compiles (or reuses)
    /// every kernel's pipeline and builds its bind group: everything a
    /// Program needs that does not change between runs.
    pub fn prepare<'a>(
        &'a self,
        prog: &'a Program,
        bind: &Bindings,
    ) -> Result<Prepared<'a>, WgpuError> {
        self.prepare_within(prog, bind, self.budget)
    }

    /// [`WgpuBackend::prepare`] under another budget (a re-plan after the
    /// device ran out of memory).
    pub fn prepare_within<'a>(
        &'a self,
        prog: &'a Program,
        bind: &Bindings,
        budget: Option<u64>,
    ) -> Result<Prepared<'a>, WgpuError> {
        use wgpu::util::DeviceExt;
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let arena_bytes = (prog.stats.arena_bytes as u64).max(4);
        let arena = self.storage_buffer(arena_bytes.div_ceil(4) * 4, "arena");
        let mut input_buffers: HashMap<u32, Arc<wgpu::Buffer>> = HashMap::new();
        for c in &prog.commands {
            if let Command::Bind { buffer, name } = c {
                let bytes = self.stored_bytes(prog.buffer(*buffer).len, self.f16_activations);
                self.check_binding(bytes)?;
                input_buffers.insert(buffer.0, self.storage_buffer(bytes, name));
            }
        }
        // Under a budget, idle pooled buffers would sit outside every
        // plan: what this prepare did not reuse goes back to the device.
        if budget.is_some() {
            self.lock_pool().clear();
        }
        let mut external: HashMap<u32, Arc<wgpu::Buffer>> = HashMap::new();
        let mut inputs = Vec::new();
        let align = u64::from(self.limits.min_storage_buffer_offset_alignment).max(4);
        // Sizing the scratch generates the products' shaders: once.
        let taps = self.taps_first_weights(prog);
        let quant = self.quant_weights(prog, bind, &taps);
        self.tune_program(prog, &taps, &quant)?;
        let scratch_bytes = self.scratch_bytes_with(prog, &taps, &quant);
        let activation_bytes = self.arena_io_bytes(prog) + scratch_bytes;
        let mut cache = self.lock_resident();
        let (residency, step) = self.plan_use(
            &mut cache,
            prog,
            &taps,
            &quant,
            bind,
            budget,
            activation_bytes,
        )?;
        if let Some(memory) = self.device_memory.filter(|&m| step.device_bytes > m) {
            return Err(WgpuError::OutOfMemory(format!(
                "the use needs {} bytes, the device has {memory}",
                step.device_bytes
            )));
        }
        // Streamed weights: their bytes in one host-visible staging buffer
        // (the master copy stays in host memory), a slot in the stream
        // arena, and a copy recorded before the kernel their plan names.
        let mut stream_slot: HashMap<u32, u64> = HashMap::new();
        let mut copies: Vec<Vec<(u64, u64, u64)>> = vec![Vec::new(); prog.stats.dispatches];
        let mut staging_bytes: Vec<u8> = Vec::new();
        let mut streamed_per_run = 0;
        if let Some((plan, uses)) = &residency {
            let by_name: HashMap<&str, u32> = prog
                .commands
                .iter()
                .filter_map(|c| match c {
                    Command::Upload { buffer, name } => Some((name.as_str(), buffer.0)),
                    _ => None,
                })
                .collect();
            for s in &plan.streamed {
                let w = &uses[s.weight];
                let bytes = device_bytes(
                    bind,
                    &w.name,
                    taps.get(&w.name),
                    self.f16_weights,
                    quant.contains_key(&w.name),
                )?;
                let at = staging_bytes.len() as u64;
                staging_bytes.extend_from_slice(&bytes);
                staging_bytes.resize(
                    staging_bytes.len().div_ceil(align as usize) * align as usize,
                    0,
                );
                if let Some(&buf) = by_name.get(w.name.as_str()) {
                    stream_slot.insert(buf, s.offset);
                }
                if let Some(list) = copies.get_mut(s.upload_before) {
                    list.push((at, s.offset, bytes.len() as u64));
                }
                streamed_per_run += bytes.len() as u64;
            }
        }
        let stream = match &residency {
            Some((plan, _)) if !plan.streamed.is_empty() => {
                let arena = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("stream arena"),
                    size: plan.stream_arena_bytes.max(4),
                    usage: STORAGE,
                    mapped_at_creation: false,
                });
                let staging = self
                    .device
                    .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                        label: Some("stream staging"),
                        contents: &staging_bytes,
                        usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::MAP_WRITE,
                    });
                Some(Stream {
                    arena,
                    staging,
                    copies,
                    bytes_per_run: streamed_per_run,
                })
            }
            _ => None,
        };
        for c in &prog.commands {
            match c {
                Command::Upload { buffer, name } => {
                    if stream_slot.contains_key(&buffer.0) {
                        continue;
                    }
                    let want = prog.buffer(*buffer).len;
                    BindError::check_len(name, bound_len(bind, name)?, want)?;
                    let layout = taps.get(name);
                    let quantized = quant.contains_key(name);
                    let source = Source::of(bind, name)?;
                    let key = resident_key(name, bind, layout.is_some(), quantized)?;
                    if let Some(r) = cache.buffers.get(&key) {
                        external.insert(buffer.0, Arc::clone(&r.buffer));
                        continue;
                    }
                    let bytes = device_bytes(bind, name, layout, self.f16_weights, quantized)?;
                    self.check_binding(bytes.len() as u64)?;
                    let buf = Arc::new(self.device.create_buffer_init(
                        &wgpu::util::BufferInitDescriptor {
                            label: Some(name),
                            contents: &bytes,
                            usage: STORAGE,
                        },
                    ));
                    self.uploaded
                        .fetch_add(bytes.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    cache.buffers.insert(
                        key,
                        ResidentWeight {
                            source,
                            buffer: Arc::clone(&buf),
                        },
                    );
                    external.insert(buffer.0, buf);
                }
                Command::Bind { buffer, name } => {
                    if let Some(buf) = input_buffers.remove(&buffer.0) {
                        external.insert(buffer.0, buf);
                    }
                    inputs.push((buffer.0, name.clone(), prog.buffer(*buffer).len));
                }
                _ => {}
            }
        }
        // One scratch buffer for every split-K product's partial sums.
        let scratch =
            (scratch_bytes > 0).then(|| self.storage_buffer(scratch_bytes, "split-k scratch"));
        let mut prepared = Vec::new();
        for c in &prog.commands {
            let Command::Dispatch { kernel } = c else {
                continue;
            };
            let ki = kernel.0 as usize;
            let k = &prog.kernels[ki];
            let unsupported = |m: String| WgpuError::Unsupported {
                kernel: ki,
                kind: k.kind.name(),
                message: m,
            };
            let operands = self.operand_layouts(prog, k, &taps, &quant);
            self.split_operands.fetch_add(
                operands.iter().filter(|(o, _)| o.chunks > 1).count(),
                std::sync::atomic::Ordering::Relaxed,
            );
            let views: Vec<&crate::plan::View> =
                k.inputs.iter().chain(std::iter::once(&k.output)).collect();
            let total_bindings: usize = operands.iter().map(|(o, _)| o.chunks).sum();
            if total_bindings > self.limits.max_storage_buffers_per_shader_stage as usize {
                return Err(unsupported(format!(
                    "needs {total_bindings} storage bindings, the device allows {}",
                    self.limits.max_storage_buffers_per_shader_stage
                )));
            }
            let layouts: Vec<codegen::Operand> = operands.iter().map(|(o, _)| *o).collect();
            let mut shader = self.generate(k, &layouts).map_err(unsupported)?;
            let max_bindings = self.limits.max_storage_buffers_per_shader_stage as usize;
            if shader.finish.is_some() && total_bindings == max_bindings {
                // No binding left for the split-K scratch: unsplit.
                let caps = codegen::Caps {
                    split_k: false,
                    ..self.caps
                };
                shader = codegen::generate(k, &layouts, &caps).map_err(unsupported)?;
            }
            let bindings = total_bindings as u32 + u32::from(shader.finish.is_some());
            let pipeline =
                self.pipeline(&shader.source, bindings)
                    .map_err(|m| WgpuError::Unsupported {
                        kernel: ki,
                        kind: k.kind.name(),
                        message: m,
                    })?;
            let mut at = Vec::new();
            for v in &views {
                let b = prog.buffer(v.buffer);
                at.push(match (&b.kind, stream_slot.get(&v.buffer.0), &stream) {
                    (BufferKind::Arena, _, _) => (arena.as_ref(), b.offset as u64 * 4),
                    (_, Some(&offset), Some(s)) => (&s.arena, offset),
                    _ => (
                        external
                            .get(&v.buffer.0)
                            .map(|b| b.as_ref())
                            .ok_or_else(|| {
                                BindError::MissingInput(format!("buffer b{}", v.buffer.0))
                            })?,
                        0,
                    ),
                });
            }
            let mut entries = operand_entries(&operands, &at);
            let mut passes = Vec::new();
            if let Some(f) = &shader.finish {
                let scratch = scratch.as_ref().ok_or_else(|| {
                    unsupported("split-K scratch was not sized for this kernel".into())
                })?;
                entries.push(buffer_entry(
                    entries.len() as u32,
                    scratch,
                    0,
                    f.scratch_elems as u64 * 4,
                ));
                let second = self.pipeline(&f.source, bindings).map_err(unsupported)?;
                passes.push((second, f.groups));
            }
            let group = Arc::new(self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &self.layout(bindings).0,
                entries: &entries,
            }));
            passes.insert(0, (pipeline, shader.groups));
            prepared.push(
                passes
                    .into_iter()
                    .map(|(p, g)| (p, Arc::clone(&group), g))
                    .collect(),
            );
        }
        if let Some(e) = pollster::block_on(validation.pop()) {
            return Err(WgpuError::Validation(e.to_string()));
        }
        if let Some(e) = pollster::block_on(oom.pop()) {
            return Err(WgpuError::OutOfMemory(e.to_string()));
        }
        drop(cache);
        self.save_pipeline_cache();
        let live_bytes = activation_bytes + stream.as_ref().map_or(0, |s| s.arena.size());
        // One readback buffer per output, reused every run.
        let readback = prog
            .outputs
            .iter()
            .map(|v| {
                let b = prog.buffer(v.buffer);
                let half = match b.kind {
                    BufferKind::Weight(_) => self.f16_weights,
                    _ => self.f16_activations,
                };
                self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("readback"),
                    size: self.stored_bytes(b.len, half),
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            })
            .collect();
        self.live
            .fetch_add(live_bytes, std::sync::atomic::Ordering::Relaxed);
        Ok(Prepared {
            live_bytes,
            backend: self,
            prog,
            arena: Some(arena),
            scratch,
            external,
            inputs,
            readback,
            dispatches: prepared,
            stream,
            residency: residency.map(|(p, _)| p),
            step,
        })
    }

    /// Host → device copy speed in bytes per second, measured the way
    /// streamed weights move: `bytes` from a host-visible staging buffer
    /// into a device buffer, best of three. What the residency plans'
    /// expected transfer times are computed with.
    pub fn upload_bandwidth(&self, bytes: u64) -> Result<f64, WgpuError> {
        let bytes = bytes.clamp(4, self.limits.max_buffer_size).div_ceil(4) * 4;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("bandwidth staging"),
            size: bytes,
            usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::MAP_WRITE,
            mapped_at_creation: true,
        });
        staging.unmap();
        let target = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("bandwidth target"),
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let mut encoder = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            encoder.copy_buffer_to_buffer(&staging, 0, &target, 0, bytes);
            let t = std::time::Instant::now();
            self.queue.submit([encoder.finish()]);
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| WgpuError::Lost(e.to_string()))?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(bytes as f64 / best.max(1e-9))
    }

    /// Bytes `prog`'s weights take on the device (f16 where stored so).
    /// Without the bindings this cannot tell GGUF weights, which a prepare
    /// keeps in their smaller quant blocks: an upper bound for them.
    pub fn weight_bytes(&self, prog: &Program) -> u64 {
        let elem = if self.f16_weights { 2 } else { 4 };
        residency::weight_uses(prog, elem)
            .iter()
            .map(|w| w.bytes)
            .sum()
    }

    /// Device bytes a prepared program needs besides its weights: the
    /// activation arena, the input and readback buffers and the split-K
    /// scratch.
    pub fn activation_bytes(&self, prog: &Program) -> u64 {
        self.arena_io_bytes(prog) + self.scratch_bytes(prog)
    }

    /// [`WgpuBackend::activation_bytes`] without the split-K scratch.
    fn arena_io_bytes(&self, prog: &Program) -> u64 {
        let arena = self.stored_bytes(prog.stats.arena_bytes / 4, self.f16_activations);
        let io: usize =
            prog.stats.input_bytes / 4 + prog.outputs.iter().map(|v| v.numel()).sum::<usize>();
        arena + self.stored_bytes(io, self.f16_activations)
    }

    /// How kernel `k`'s operands (inputs, then output) are bound, with
    /// their byte sizes: f16 for weights where the adapter has SHADER_F16
    /// (activations too with f16 activations); split into several bindings
    /// past the binding limit.
    fn operand_layouts(
        &self,
        prog: &Program,
        k: &crate::plan::Kernel,
        taps: &TapsFirst,
        quant: &QuantWeights,
    ) -> Vec<(codegen::Operand, u64)> {
        let mut operands = Vec::new();
        for v in k.inputs.iter().chain(std::iter::once(&k.output)) {
            let b = prog.buffer(v.buffer);
            if let Some(q) = match &b.kind {
                BufferKind::Weight(n) => quant.get(n),
                _ => None,
            } {
                operands.push((codegen::Operand::quantized(*q), q.bytes(b.len)));
                continue;
            }
            let taps_first = matches!(&b.kind, BufferKind::Weight(n) if taps.contains_key(n));
            let half = match b.kind {
                BufferKind::Weight(_) => self.f16_weights,
                _ => self.f16_activations,
            };
            let elem = if half { 2u64 } else { 4 };
            let bytes = (b.len as u64 * elem).div_ceil(4) * 4;
            let limit = self.binding_limit();
            let op = if bytes <= limit {
                codegen::Operand {
                    taps_first,
                    ..codegen::Operand::whole(half)
                }
            } else {
                // Chunks start on the storage offset alignment.
                let align = u64::from(self.limits.min_storage_buffer_offset_alignment).max(4);
                let chunk_bytes = (limit / align) * align;
                codegen::Operand {
                    f16: half,
                    chunks: bytes.div_ceil(chunk_bytes) as usize,
                    chunk_elems: (chunk_bytes / elem) as usize,
                    taps_first,
                    quant: None,
                }
            };
            operands.push((op, bytes));
        }
        operands
    }

    /// The weights this backend stores tap-major: those whose every use in
    /// `prog` is as the weights of convs that take them so
    /// ([`codegen::conv_taps_first`]), all of one shape and whole.
    fn taps_first_weights(&self, prog: &Program) -> TapsFirst {
        use crate::plan::KernelKind;
        let mut conv: TapsFirst = HashMap::new();
        let mut other = std::collections::HashSet::new();
        for k in &prog.kernels {
            for (i, v) in k.inputs.iter().enumerate() {
                let BufferKind::Weight(name) = &prog.buffer(v.buffer).kind else {
                    continue;
                };
                let layout = match &k.kind {
                    KernelKind::Conv2d {
                        c, kh, kw, params, ..
                    } if i == 1
                        && codegen::conv_taps_first(self.coop.is_some(), kh * kw)
                        && v.offset == 0
                        && v.numel() == prog.buffer(v.buffer).len =>
                    {
                        Some((c / params.groups.max(1) * kh * kw, kh * kw))
                    }
                    _ => None,
                };
                match layout {
                    Some(l) if conv.get(name).is_none_or(|&seen| seen == l) => {
                        conv.insert(name.clone(), l);
                    }
                    _ => {
                        other.insert(name.clone());
                    }
                }
            }
        }
        conv.retain(|name, _| !other.contains(name));
        conv
    }

    /// Bytes of the one scratch buffer `prog`'s split-K products and split
    /// group norms share (kernels run one after another, so the largest
    /// one's partial results).
    pub fn scratch_bytes(&self, prog: &Program) -> u64 {
        self.scratch_bytes_with(prog, &self.taps_first_weights(prog), &QuantWeights::new())
    }

    /// [`WgpuBackend::scratch_bytes`] with the tap-major and quantized
    /// weights known.
    fn scratch_bytes_with(&self, prog: &Program, taps: &TapsFirst, quant: &QuantWeights) -> u64 {
        if !self.caps.split_k {
            return 0;
        }
        prog.kernels
            .iter()
            .filter(|k| matches!(k.kind.name(), "matmul" | "conv2d" | "group_norm"))
            .filter_map(|k| {
                let ops: Vec<codegen::Operand> = self
                    .operand_layouts(prog, k, taps, quant)
                    .iter()
                    .map(|(o, _)| *o)
                    .collect();
                let f = self.generate(k, &ops).ok()?.finish?;
                Some(f.scratch_elems as u64 * 4)
            })
            .max()
            .unwrap_or(0)
    }

    /// Applies the residency policy to `prog`'s use: drops kept weights
    /// whose host data is gone (or whose name now holds other data),
    /// plans the use (`activation_bytes` besides its weights) within
    /// `budget` and evicts what the plan needs room for
    /// ([`schedule::DeviceWeights::step`]). Returns the plan (with a
    /// budget) and the step.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn plan_use(
        &self,
        cache: &mut Resident,
        prog: &Program,
        taps: &TapsFirst,
        quant: &QuantWeights,
        bind: &Bindings,
        budget: Option<u64>,
        activation_bytes: u64,
    ) -> Result<
        (
            Option<(ResidencyPlan, Vec<residency::WeightUse>)>,
            schedule::UseStep,
        ),
        WgpuError,
    > {
        let elem = if self.f16_weights { 2 } else { 4 };
        // Quantized weights take their blocks' bytes on the device.
        let uses = residency::weight_uses_sized(prog, |name, len| {
            quant.get(name).map_or(len as u64 * elem, |q| q.bytes(len))
        });
        // Weights whose host data nobody else holds: their model is gone.
        cache.remove_where(|r| r.source.orphaned());
        // A prepare that failed after planning (out of memory) left
        // weights the policy counts as held but no buffer holds.
        let missing: Vec<String> = cache
            .state
            .held
            .keys()
            .filter(|k| !cache.buffers.contains_key(k.as_str()))
            .cloned()
            .collect();
        for key in missing {
            cache.state.forget(&key);
        }
        // Weights a program still prepared binds (its buffer has holders
        // besides this cache): never evicted, and kept resident by this
        // use if it reads them too. Programs still prepared also hold
        // their activations, which this use's budget leaves room for.
        let in_use: std::collections::BTreeSet<String> = cache
            .buffers
            .iter()
            .filter(|(_, r)| Arc::strong_count(&r.buffer) > 1)
            .map(|(key, _)| key.clone())
            .collect();
        let live = self.live.load(std::sync::atomic::Ordering::Relaxed);
        let budget = budget.map(|b| b.saturating_sub(live));
        // The policy sees each weight by its resident key (name and data),
        // so two checkpoints with the same tensor names stay apart.
        let keyed = uses
            .iter()
            .map(|w| {
                let name = resident_key(
                    &w.name,
                    bind,
                    taps.contains_key(&w.name),
                    quant.contains_key(&w.name),
                )?;
                Ok(residency::WeightUse {
                    keep: in_use.contains(&name),
                    name,
                    ..w.clone()
                })
            })
            .collect::<Result<Vec<_>, WgpuError>>()?;
        let u = residency::ModelUse {
            weights: keyed,
            kernels: prog.stats.dispatches,
            activation_bytes,
            runs: 1,
        };
        let align = u64::from(self.limits.min_storage_buffer_offset_alignment);
        let models = cache
            .at
            .and_then(|at| cache.schedule.uses.get(at))
            .map(|s| s.models.clone())
            .unwrap_or_default();
        let r = &mut *cache;
        let step = r.state.step(
            &u,
            budget,
            align,
            self.binding_limit(),
            &r.schedule,
            r.at,
            &models,
            &in_use,
        )?;
        for name in &step.evicted {
            r.buffers.remove(name);
        }
        let plan = step.plan.clone().map(|p| (p, uses));
        Ok((plan, step))
    }
}

/// A kept weight's key: its name, the host data it was made from, and
/// whether the device holds it tap-major (a conv weight: see
/// [`codegen::conv_taps_first`]).
/// A resident weight's identity: its name and where its data comes from
/// (the bound vector, or the file and tensor), so two checkpoints with the
/// same tensor names stay apart.
fn resident_key(
    name: &str,
    bind: &Bindings,
    taps_first: bool,
    quantized: bool,
) -> Result<String, BindError> {
    let layout = match (taps_first, quantized) {
        (true, _) => "/taps",
        (false, true) => "/quant",
        (false, false) => "",
    };
    if let Some(d) = bind.weights.get(name) {
        return Ok(format!("{name}#{:x}{layout}", Arc::as_ptr(d) as usize));
    }
    let w = bind
        .stored
        .get(name)
        .ok_or_else(|| BindError::MissingWeight(name.to_string()))?;
    let cast = w.cast().map_or("", |d| d.name());
    Ok(format!(
        "{name}#{:x}:{}{cast}{layout}",
        Arc::as_ptr(w.file()) as usize,
        w.key()
    ))
}

/// Weight name → (elements per output channel, taps) of the tap-major
/// conv weights.
type TapsFirst = HashMap<String, (usize, usize)>;

/// `data` in the order the device stores it: tap-major where `layout`
/// says so.
fn device_order<'d>(
    data: &'d [f32],
    layout: Option<&(usize, usize)>,
) -> std::borrow::Cow<'d, [f32]> {
    match layout {
        Some(&(per_out, taps)) => codegen::taps_first_layout(data, per_out, taps).into(),
        None => data.into(),
    }
}

/// The streamed weights of a prepared program.
struct Stream {
    arena: wgpu::Buffer,
    staging: wgpu::Buffer,
    /// Per dispatch: (staging offset, arena offset, bytes) copied before it.
    copies: Vec<Vec<(u64, u64, u64)>>,
    bytes_per_run: u64,
}

/// A kernel's passes: one, or a split-K product and its sum.
type Dispatch = Vec<(Arc<wgpu::ComputePipeline>, Arc<wgpu::BindGroup>, [u32; 3])>;

/// A Program made resident: weights uploaded, pipelines and bind groups
/// built. Each [`Prepared::run`] uploads the inputs, records every
/// dispatch in one compute pass and reads back the outputs.
pub struct Prepared<'a> {
    backend: &'a WgpuBackend,
    prog: &'a Program,
    /// Taken back into the backend's pool on drop.
    arena: Option<Arc<wgpu::Buffer>>,
    /// Split-K partial sums (pooled too).
    scratch: Option<Arc<wgpu::Buffer>>,
    external: HashMap<u32, Arc<wgpu::Buffer>>,
    inputs: Vec<(u32, String, usize)>,
    /// One mappable buffer per output.
    readback: Vec<wgpu::Buffer>,
    dispatches: Vec<Dispatch>,
    stream: Option<Stream>,
    residency: Option<ResidencyPlan>,
    step: schedule::UseStep,
    /// What it adds to the backend's live bytes while it exists.
    live_bytes: u64,
}

impl Drop for Prepared<'_> {
    fn drop(&mut self) {
        self.backend
            .live
            .fetch_sub(self.live_bytes, std::sync::atomic::Ordering::Relaxed);
        // The arena and input buffers go back to the pool (queue order
        // keeps work already submitted ahead of any reuse).
        for (buf, _, _) in &self.inputs {
            if let Some(b) = self.external.remove(buf) {
                self.backend.release(b);
            }
        }
        if let Some(scratch) = self.scratch.take() {
            self.backend.release(scratch);
        }
        if let Some(arena) = self.arena.take() {
            self.backend.release(arena);
        }
    }
}

impl Prepared<'_> {
    /// Runs with the inputs in `bind` (weights there are ignored: they
    /// were uploaded by `prepare`).
    pub fn run(&self, bind: &Bindings) -> Result<Vec<Array>, WgpuError> {
        let dev = &self.backend.device;
        let queue = &self.backend.queue;
        let validation = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        for (buf, name, len) in &self.inputs {
            let data = bind
                .inputs
                .get(name)
                .ok_or_else(|| BindError::MissingInput(name.clone()))?;
            BindError::check_len(name, data.len(), *len)?;
            let bytes = encode(data, self.backend.f16_activations);
            if let Some(b) = self.external.get(buf) {
                queue.write_buffer(b, 0, &bytes);
            }
        }
        let mut encoder =
            dev.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        self.record(&mut encoder, 1);
        // Read back the outputs' whole buffers, then apply their views.
        for (v, st) in self.prog.outputs.iter().zip(&self.readback) {
            let b = self.prog.buffer(v.buffer);
            let size = st.size();
            let (src, off) = match b.kind {
                BufferKind::Arena => match &self.arena {
                    Some(a) => (a.as_ref(), b.offset as u64 * 4),
                    None => return Err(BindError::MissingInput("the arena".into()).into()),
                },
                _ => match self.external.get(&v.buffer.0) {
                    Some(e) => (e.as_ref(), 0),
                    None => {
                        return Err(
                            BindError::MissingInput(format!("buffer b{}", v.buffer.0)).into()
                        )
                    }
                },
            };
            encoder.copy_buffer_to_buffer(src, off, st, 0, size);
        }
        queue.submit([encoder.finish()]);
        let mut outs = Vec::new();
        for (v, st) in self.prog.outputs.iter().zip(&self.readback) {
            let half = match self.prog.buffer(v.buffer).kind {
                BufferKind::Weight(_) => self.backend.f16_weights,
                _ => self.backend.f16_activations,
            };
            let slice = st.slice(..);
            map_for_reading(dev, &slice)?;
            // Unmapped on every path: the buffer is reused next run.
            let data = slice.get_mapped_range().map(|bytes| decode(&bytes, half));
            st.unmap();
            let data = data.map_err(|e| WgpuError::Lost(e.to_string()))?;
            outs.push(Array::new(v.shape.clone(), read_view(v, &data)));
        }
        if let Some(e) = pollster::block_on(validation.pop()) {
            return Err(WgpuError::Validation(e.to_string()));
        }
        Ok(outs)
    }

    /// The residency plan this program runs under (with a budget).
    pub fn residency(&self) -> Option<&ResidencyPlan> {
        self.residency.as_ref()
    }

    /// What preparing did to the device's kept weights: evictions, loads.
    pub fn use_step(&self) -> &schedule::UseStep {
        &self.step
    }

    /// Weight bytes copied host → device each run (streamed weights).
    pub fn streamed_bytes_per_run(&self) -> u64 {
        self.stream.as_ref().map_or(0, |s| s.bytes_per_run)
    }

    /// Records every dispatch `times` times: one compute pass, split where
    /// streamed weights are copied into their slots.
    fn record(&self, encoder: &mut wgpu::CommandEncoder, times: usize) {
        for _ in 0..times {
            // Passes forget the encoder borrow so copies can be recorded
            // between them.
            let mut pass = Some(
                encoder
                    .begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("program"),
                        timestamp_writes: None,
                    })
                    .forget_lifetime(),
            );
            for (i, passes) in self.dispatches.iter().enumerate() {
                if let Some(s) = self.stream.as_ref().filter(|s| !s.copies[i].is_empty()) {
                    drop(pass.take());
                    for &(from, to, bytes) in &s.copies[i] {
                        encoder.copy_buffer_to_buffer(&s.staging, from, &s.arena, to, bytes);
                    }
                    self.backend.uploaded.fetch_add(
                        s.copies[i].iter().map(|c| c.2).sum(),
                        std::sync::atomic::Ordering::Relaxed,
                    );
                    pass = Some(
                        encoder
                            .begin_compute_pass(&wgpu::ComputePassDescriptor {
                                label: Some("program"),
                                timestamp_writes: None,
                            })
                            .forget_lifetime(),
                    );
                }
                if let Some(p) = pass.as_mut() {
                    for (pipeline, group, g) in passes {
                        p.set_pipeline(pipeline);
                        p.set_bind_group(0, group.as_ref(), &[]);
                        p.dispatch_workgroups(g[0], g[1], g[2]);
                    }
                }
            }
        }
    }

    /// Seconds each dispatch takes alone, in Program order, each replayed
    /// `reps` times in one submission (the wall time of that submission
    /// over `reps`): where a step's time goes, for benchmarks. Streamed
    /// weights are not copied (their slots keep what they hold).
    pub fn profile(&self, reps: usize) -> Result<Vec<(KernelId, f64)>, WgpuError> {
        let kernels = self.prog.commands.iter().filter_map(|c| match c {
            Command::Dispatch { kernel } => Some(*kernel),
            _ => None,
        });
        let mut out = Vec::new();
        for (passes, kernel) in self.dispatches.iter().zip(kernels) {
            self.backend.time_passes(passes, 1)?;
            let n = reps.max(1);
            out.push((kernel, self.backend.time_passes(passes, n)? / n as f64));
        }
        Ok(out)
    }

    /// Records and submits every dispatch `times` times and waits, without
    /// uploads or readback: the kernel time benchmarks measure.
    pub fn dispatch_only(&self, times: usize) -> Result<(), WgpuError> {
        let dev = &self.backend.device;
        let mut encoder =
            dev.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        self.record(&mut encoder, times);
        self.backend.queue.submit([encoder.finish()]);
        dev.poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| WgpuError::Lost(e.to_string()))?;
        Ok(())
    }
}

/// One pass of a kernel: pipeline, bind group and workgroups.
type Pass = (Arc<wgpu::ComputePipeline>, Arc<wgpu::BindGroup>, [u32; 3]);

impl WgpuBackend {
    /// Wall seconds of `n` replays of `passes` recorded in one submission
    /// and waited for: with `n` large enough the submission's own cost
    /// vanishes in the kernels' time (profiles and tuning).
    fn time_passes(&self, passes: &[Pass], n: usize) -> Result<f64, WgpuError> {
        let encoder = self.record_passes(passes, n);
        let t = std::time::Instant::now();
        self.queue.submit([encoder.finish()]);
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| WgpuError::Lost(e.to_string()))?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// An encoder holding `n` replays of `passes` in one compute pass. One
    /// pass is bound once, so short kernels (the probes) time dispatches
    /// alone.
    fn record_passes(&self, passes: &[Pass], n: usize) -> wgpu::CommandEncoder {
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("replayed"),
                timestamp_writes: None,
            });
            for rep in 0..n {
                for (pipeline, group, g) in passes {
                    if rep == 0 || passes.len() > 1 {
                        pass.set_pipeline(pipeline);
                        pass.set_bind_group(0, group.as_ref(), &[]);
                    }
                    pass.dispatch_workgroups(g[0], g[1], g[2]);
                }
            }
        }
        encoder
    }

    /// Drops the compiled pipelines of these sources from this process's
    /// cache (tuning's losing variants).
    fn forget_pipelines<'s>(&self, sources: impl Iterator<Item = &'s String>) {
        let mut cache = self
            .pipelines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for s in sources {
            cache.remove(s);
        }
    }
}

/// Bind group entries for a kernel's operands (inputs, then output):
/// each bound at `at` (buffer, byte offset), an operand past the binding
/// limit as its chunks.
fn operand_entries<'b>(
    operands: &[(codegen::Operand, u64)],
    at: &[(&'b wgpu::Buffer, u64)],
) -> Vec<wgpu::BindGroupEntry<'b>> {
    let mut entries = Vec::new();
    for ((op, bytes), &(buffer, base)) in operands.iter().zip(at) {
        let elem = if op.f16 { 2u64 } else { 4 };
        for c in 0..op.chunks {
            let (offset, size) = if op.chunks == 1 {
                (base, *bytes)
            } else {
                let chunk = op.chunk_elems as u64 * elem;
                let start = c as u64 * chunk;
                (base + start, chunk.min(bytes - start))
            };
            entries.push(buffer_entry(entries.len() as u32, buffer, offset, size));
        }
    }
    entries
}

/// Binding `binding`: `size` bytes of `buffer` from byte `offset`.
fn buffer_entry(
    binding: u32,
    buffer: &wgpu::Buffer,
    offset: u64,
    size: u64,
) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer,
            offset,
            size: std::num::NonZeroU64::new(size),
        }),
    }
}

/// Writes `data` to `file` through a temporary file and a rename, so a
/// reader never sees half a file; creates the folder.
fn write_atomically(file: &std::path::Path, data: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    crate::atomic::write_atomic(file, data)
}

/// Maps `slice` of a MAP_READ buffer and waits until it is readable.
fn map_for_reading(dev: &wgpu::Device, slice: &wgpu::BufferSlice) -> Result<(), WgpuError> {
    let (tx, rx) = std::sync::mpsc::channel();
    slice.map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    dev.poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| WgpuError::Lost(e.to_string()))?;
    match rx.recv() {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(WgpuError::Lost(e.to_string())),
        Err(e) => Err(WgpuError::Lost(e.to_string())),
    }
}

/// Little-endian bytes of f32 values, or of their f16 roundings (padded to
/// a multiple of 4 bytes).
fn encode(data: &[f32], half: bool) -> Vec<u8> {
    if half {
        let mut b: Vec<u8> = data
            .iter()
            .flat_map(|v| f32_to_f16_bits(*v).to_le_bytes())
            .collect();
        b.resize(b.len().div_ceil(4) * 4, 0);
        b
    } else {
        data.iter().flat_map(|v| v.to_le_bytes()).collect()
    }
}

fn decode(bytes: &[u8], half: bool) -> Vec<f32> {
    if half {
        bytes
            .chunks_exact(2)
            .map(|c| crate::weights::f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect()
    } else {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// Applies a view to its buffer's data (relative to the buffer start).
fn read_view(v: &crate::plan::View, data: &[f32]) -> Vec<f32> {
    let n = v.numel();
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; v.shape.len()];
    for _ in 0..n {
        let off: usize = v.offset
            + idx
                .iter()
                .zip(&v.strides)
                .map(|(i, s)| i * s)
                .sum::<usize>();
        out.push(data.get(off).copied().unwrap_or(f32::NAN));
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < v.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::f32_to_f16_bits;
    use crate::weights::f16_to_f32;

    #[test]
    fn f16_round_trip_and_rounding() {
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            if x.is_nan() {
                assert!(f16_to_f32(f32_to_f16_bits(x)).is_nan());
                continue;
            }
            assert_eq!(f32_to_f16_bits(x), h, "{h:#06x} = {x}");
        }
        // Halfway cases round to even.
        assert_eq!(f32_to_f16_bits(1.0 + 1.0 / 2048.0), 0x3c00);
        assert_eq!(f32_to_f16_bits(1.0 + 3.0 / 2048.0), 0x3c02);
        assert_eq!(f32_to_f16_bits(65520.0), 0x7c00);
    }
}
