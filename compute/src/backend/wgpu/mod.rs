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

mod adapter;
pub mod codegen;
mod emulate;
mod options;
mod poison;
mod prepare;
mod prepared;
pub mod probe;
mod quant;
mod required;
mod resident;
mod software;
mod tune;

use crate::backend::cpu::Bindings;
use crate::backend::BindError;
use crate::plan::residency::{self, ResidencyPlan};
use crate::plan::schedule;
use crate::plan::{BufferKind, Command, KernelId, Program};
use crate::tensor::reference::Array;
use adapter::*;
pub use adapter::{adapters, adapters_with_tuning, default_cache_dir, AdapterReport};
pub use options::Options;
pub use prepared::Prepared;
use prepared::*;
use quant::QuantWeights;
pub use required::{no_adapter, REQUIRE_VAR};
use resident::*;
pub use software::keep_loops;
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

pub use crate::weights::f32_to_f16_bits;

/// A bind group layout and the pipeline layout over it.
type Layouts = (wgpu::BindGroupLayout, wgpu::PipelineLayout);

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
    /// A CPU adapter (lavapipe): counted loops stay loops ([`software`]).
    software: bool,
    /// [`Options::read_only_inputs`].
    read_only_inputs: bool,
    backend: wgpu::Backend,
    binding_cap: Option<u64>,
    split_operands: std::sync::atomic::AtomicUsize,
    device: wgpu::Device,
    queue: wgpu::Queue,
    pub adapter: AdapterReport,
    limits: wgpu::Limits,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    /// Bind group and pipeline layouts by their bindings' access (true:
    /// read-only), every binding a storage buffer. Explicit, so both
    /// passes of a split-K product take one bind group though each reads
    /// only some bindings.
    layouts: Mutex<HashMap<Vec<bool>, Arc<Layouts>>>,
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
    /// [`Options::device_loops`].
    device_loops: bool,
    resident: Mutex<Resident>,
    uploaded: std::sync::atomic::AtomicU64,
    /// Bytes read back from the device (program outputs).
    downloaded: std::sync::atomic::AtomicU64,
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
            attention_tiles: opts.attention_tiles,
            split_k: opts.split_k,
            prefetch: opts.prefetch,
            double_buffer: opts.double_buffer,
            vector_staging: opts.vector_staging,
            channels_last: opts.channels_last,
            raster: opts.raster,
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
            software: adapter.get_info().device_type == wgpu::DeviceType::Cpu,
            read_only_inputs: opts.read_only_inputs,
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
            device_loops: opts.device_loops,
            resident: Mutex::new(Resident::default()),
            uploaded: std::sync::atomic::AtomicU64::new(0),
            downloaded: std::sync::atomic::AtomicU64::new(0),
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

    /// Whether loops may keep their state on the device
    /// ([`Options::device_loops`]).
    pub fn device_loops(&self) -> bool {
        self.device_loops
    }

    /// Bytes read back from the device so far (program outputs).
    pub fn bytes_downloaded(&self) -> u64 {
        self.downloaded.load(std::sync::atomic::Ordering::Relaxed)
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

    /// The layouts of storage bindings whose access `read_only` gives,
    /// binding by binding.
    fn layout(&self, read_only: &[bool]) -> Arc<Layouts> {
        let mut layouts = self
            .layouts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        layouts
            .entry(read_only.to_vec())
            .or_insert_with(|| {
                let entries: Vec<wgpu::BindGroupLayoutEntry> = read_only
                    .iter()
                    .enumerate()
                    .map(|(binding, &read_only)| wgpu::BindGroupLayoutEntry {
                        binding: binding as u32,
                        visibility: wgpu::ShaderStages::COMPUTE,
                        ty: wgpu::BindingType::Buffer {
                            ty: wgpu::BufferBindingType::Storage { read_only },
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

    /// The pipeline of `source`, whose storage bindings' access
    /// `read_only` gives (compiled once per source: the source declares
    /// the same access).
    fn pipeline(
        &self,
        source: &str,
        read_only: &[bool],
    ) -> Result<Arc<wgpu::ComputePipeline>, String> {
        let layout = self.layout(read_only);
        let mut cache = self
            .pipelines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(p) = cache.get(source) {
            return Ok(p.clone());
        }
        let mut text = std::borrow::Cow::Borrowed(source);
        if self.software {
            text = software::keep_loops(&text)?.into();
        }
        if self.poison {
            text = poison::poison_workgroup_memory(&text)?.into();
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: None,
            source: wgpu::ShaderSource::Wgsl(text),
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
    /// Whether buffers of `kind` are stored as f16.
    fn stores_half(&self, kind: &BufferKind) -> bool {
        match kind {
            BufferKind::Weight(_) => self.f16_weights,
            _ => self.f16_activations,
        }
    }

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
        for (j, v) in k
            .inputs
            .iter()
            .chain(std::iter::once(&k.output))
            .enumerate()
        {
            let b = prog.buffer(v.buffer);
            // Weights and per-run inputs live in buffers of their own (or
            // the streamed weights' buffer) that no kernel writes; the
            // arena holds the output too, so its inputs stay read-write.
            let read_only = j < k.inputs.len()
                && self.read_only_inputs
                && !matches!(b.kind, BufferKind::Arena)
                && v.buffer != k.output.buffer;
            if let Some(q) = match &b.kind {
                BufferKind::Weight(n) => quant.get(n),
                _ => None,
            } {
                operands.push((
                    codegen::Operand::quantized(*q).reading(read_only),
                    q.bytes(b.len),
                ));
                continue;
            }
            let taps_first = matches!(&b.kind, BufferKind::Weight(n) if taps.contains_key(n));
            let half = self.stores_half(&b.kind);
            let elem = if half { 2u64 } else { 4 };
            let bytes = self.stored_bytes(b.len, half);
            let limit = self.binding_limit();
            let op = if bytes <= limit {
                codegen::Operand {
                    taps_first,
                    read_only,
                    ..codegen::Operand::whole(half).with_len(b.len)
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
                    len: Some(b.len),
                    read_only,
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

    /// Bytes of the one scratch buffer `prog`'s split-K products, split
    /// group norms and channels-last convs share (kernels run one after
    /// another, so the largest one's).
    pub fn scratch_bytes(&self, prog: &Program) -> u64 {
        self.scratch_bytes_with(prog, &self.taps_first_weights(prog), &QuantWeights::new())
    }

    /// [`WgpuBackend::scratch_bytes`] with the tap-major and quantized
    /// weights known.
    fn scratch_bytes_with(&self, prog: &Program, taps: &TapsFirst, quant: &QuantWeights) -> u64 {
        if !self.caps.split_k && !self.caps.channels_last {
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
                Some(self.generate(k, &ops).ok()?.scratch_words()? as u64 * 4)
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
/// The part of output `v`'s buffer a readback copies, as (first element,
/// elements): the view's first element to its last (a slice of a larger
/// buffer reads only itself), widened for f16 storage to whole 4-byte
/// words, the copy's alignment (the buffer's storage is whole words).
fn read_range(v: &crate::plan::View, half: bool) -> (usize, usize) {
    let (mut lo, mut hi) = (v.offset, v.offset + v.span());
    if half {
        lo -= lo % 2;
        hi += hi % 2;
    }
    (lo, hi - lo)
}

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
