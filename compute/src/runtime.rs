//! Where node implementations run their tensor programs: the CPU backend or
//! one wgpu adapter, chosen once per executor (`--device`).
//!
//! A model use that runs one Program many times (a sampler's denoiser
//! steps) prepares a [`Session`] once: on wgpu the weights are uploaded and
//! the pipelines compiled then, and each step only uploads its inputs.

use crate::backend::cpu::{self, CpuError};
use crate::backend::wgpu::{Options, Prepared, Tuning, WgpuBackend, WgpuError};
use crate::plan::residency::ResidencyPlan;
use crate::plan::schedule::{UseSchedule, UseStep};
use crate::plan::Program;
use crate::tensor::reference::Array;
use std::collections::HashMap;
use std::sync::Arc;

/// Values bound to a program's named inputs and weights: f32 vectors, or
/// (`stored`, CPU only) tensors left in their file, converted for the
/// kernels that read them and dropped after the last one in each run.
#[derive(Clone, Default)]
pub struct Bindings {
    pub weights: HashMap<String, Arc<Vec<f32>>>,
    pub stored: HashMap<String, crate::weights::StoredWeight>,
    pub inputs: HashMap<String, Arc<Vec<f32>>>,
    /// CPU, bf16 products: weights packed for the AMX kernels, kept for
    /// the life of these bindings and their clones (a session).
    pub packed: cpu::PackedWeights,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Cpu(#[from] CpuError),
    #[error(transparent)]
    Wgpu(#[from] WgpuError),
    #[error("device {choice:?}: {message}")]
    Select { choice: String, message: String },
}

impl RuntimeError {
    /// Whether a smaller problem would run: the device ran out of memory
    /// (after re-planning), the budget cannot hold the activations, or a
    /// buffer exceeds the device's size limit. Callers that can split
    /// their work (tiled VAE decoding) retry smaller.
    pub fn needs_less_memory(&self) -> bool {
        matches!(
            self,
            RuntimeError::Wgpu(
                WgpuError::OutOfMemory(_) | WgpuError::Budget(_) | WgpuError::TooLarge { .. }
            )
        )
    }
}

#[derive(Clone)]
enum Device {
    Cpu(cpu::Products),
    Wgpu(Arc<WgpuBackend>),
}

/// The device programs run on. Cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    device: Device,
}

impl Default for Runtime {
    fn default() -> Self {
        Runtime::cpu()
    }
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Runtime({})", self.describe())
    }
}

impl Runtime {
    /// The CPU backend with f32 products (the reference results).
    pub fn cpu() -> Self {
        Self::cpu_with(cpu::Products::F32)
    }

    /// The CPU backend, its matrix products in `products` (bf16 runs only
    /// where the CPU has AMX tiles; elsewhere it is f32).
    pub fn cpu_with(products: cpu::Products) -> Self {
        Runtime {
            device: Device::Cpu(products),
        }
    }

    /// `cpu`, `wgpu` (the best adapter, software ones included), `auto` (a
    /// hardware GPU if there is one, else the CPU: a software adapter such
    /// as lavapipe is slower than the CPU backend) or an adapter name
    /// (case-insensitive substring).
    pub fn select(choice: &str) -> Result<Self, RuntimeError> {
        Self::select_with(choice, None)
    }

    /// [`Runtime::select`] with a device memory budget for the GPU (see
    /// [`parse_budget`]); the CPU backend ignores it.
    pub fn select_with(choice: &str, budget: Option<u64>) -> Result<Self, RuntimeError> {
        Self::select_precision(choice, budget, true)
    }

    /// [`Runtime::select_with`], choosing whether matrix products may use
    /// tensor cores (cooperative matrices: f16 operands, f32 accumulation,
    /// as PyTorch's fp16 path) where the adapter has them; without, every
    /// product is f32 arithmetic, to match the CPU backend to rounding.
    pub fn select_precision(
        choice: &str,
        budget: Option<u64>,
        tensor_cores: bool,
    ) -> Result<Self, RuntimeError> {
        Self::select_tuned(choice, budget, tensor_cores, Tuning::Cached)
    }

    /// [`Runtime::select_precision`], choosing whether tensor-core kernels
    /// are tuned ([`Tuning`]): the others use what earlier runs tuned
    /// (the file in the cache folder), measuring nothing.
    pub fn select_tuned(
        choice: &str,
        budget: Option<u64>,
        tensor_cores: bool,
        tuning: Tuning,
    ) -> Result<Self, RuntimeError> {
        let gpu_options = |adapter| gpu_options(adapter, budget, tensor_cores, tuning);
        let err = |message: String| RuntimeError::Select {
            choice: choice.to_string(),
            message,
        };
        // `tensor_cores` is the CPU's AMX tiles there: bf16 products.
        let cpu = || {
            Runtime::cpu_with(if tensor_cores {
                cpu::Products::Bf16
            } else {
                cpu::Products::F32
            })
        };
        match choice.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(cpu()),
            "auto" => {
                if !gpu_device_nodes() {
                    return Ok(cpu());
                }
                let hardware = crate::backend::wgpu::adapters()
                    .into_iter()
                    .any(|a| a.device_type != "Cpu");
                if !hardware {
                    return Ok(cpu());
                }
                match WgpuBackend::with_options(&gpu_options(None)) {
                    Ok(b) if b.adapter.device_type != "Cpu" => Ok(Runtime::wgpu(b)),
                    _ => Ok(cpu()),
                }
            }
            "wgpu" | "gpu" => WgpuBackend::with_options(&gpu_options(None))
                .map(Runtime::wgpu)
                .map_err(|e| err(e.to_string())),
            name => WgpuBackend::with_options(&gpu_options(Some(name.to_string())))
                .map(Runtime::wgpu)
                .map_err(|e| err(format!("{e} (`sdkit devices` lists the adapters)"))),
        }
    }

    pub fn wgpu(backend: WgpuBackend) -> Self {
        Runtime {
            device: Device::Wgpu(Arc::new(backend)),
        }
    }

    /// "cpu" or the adapter's name and API.
    pub fn describe(&self) -> String {
        match &self.device {
            Device::Cpu(p) => match p {
                cpu::Products::Bf16 if cpu::amx::available() => {
                    "cpu (bf16 products on AMX tiles)".to_string()
                }
                _ => "cpu (f32 products)".to_string(),
            },
            Device::Wgpu(b) => {
                let products = match b.coop {
                    Some(c) => format!("tensor cores {0}x{0}", c.tile),
                    None => "f32 products".to_string(),
                };
                format!("{} ({}, {products})", b.adapter.name, b.adapter.backend)
            }
        }
    }

    pub fn is_cpu(&self) -> bool {
        matches!(self.device, Device::Cpu(_))
    }

    /// Weight bytes uploaded to the device so far (0 on the CPU).
    pub fn bytes_uploaded(&self) -> u64 {
        match &self.device {
            Device::Cpu(_) => 0,
            Device::Wgpu(b) => b.bytes_uploaded(),
        }
    }

    /// Whether a loop should keep its state on the device between runs
    /// ([`Session::run_carried`]): on a GPU unless its options say not or
    /// it stores activations as f16 (a sampler's latent would be rounded
    /// to f16 every step; ComfyUI keeps it in f32); never on the CPU,
    /// where the host loop costs nothing extra.
    pub fn device_loops(&self) -> bool {
        match &self.device {
            Device::Cpu(_) => false,
            Device::Wgpu(b) => b.device_loops() && !b.f16_activations,
        }
    }

    /// Bytes of program outputs read back from the device so far (0 on
    /// the CPU).
    pub fn bytes_downloaded(&self) -> u64 {
        match &self.device {
            Device::Cpu(_) => 0,
            Device::Wgpu(b) => b.bytes_downloaded(),
        }
    }

    /// The device memory budget, if one is set (GPU only).
    pub fn budget(&self) -> Option<u64> {
        match &self.device {
            Device::Cpu(_) => None,
            Device::Wgpu(b) => b.budget(),
        }
    }

    /// Weight bytes kept resident on the device between runs (0 on the CPU).
    pub fn resident_bytes(&self) -> u64 {
        match &self.device {
            Device::Cpu(_) => 0,
            Device::Wgpu(b) => b.resident_bytes(),
        }
    }

    /// The model uses of the run about to start, in order (the executor
    /// sets it): kept weights are evicted by it, farthest next use first.
    pub fn set_schedule(&self, schedule: UseSchedule) {
        if let Device::Wgpu(b) = &self.device {
            b.set_schedule(schedule);
        }
    }

    /// The use at `position` of the schedule starts (None: a use outside
    /// it).
    pub fn enter_use(&self, position: Option<usize>) {
        if let Device::Wgpu(b) = &self.device {
            b.enter_use(position);
        }
    }

    /// Drops weights kept resident on the device between runs.
    pub fn free(&self) {
        if let Device::Wgpu(b) = &self.device {
            b.free_weights();
        }
    }

    /// Runs a program once.
    pub fn run(&self, prog: &Program, bind: &Bindings) -> Result<Vec<Array>, RuntimeError> {
        match &self.device {
            Device::Cpu(p) => {
                // Run once: a packed weight is never read again, so none is
                // kept (the peak stays a layer's worth, not the model's).
                bind.packed.keep_none();
                let out = cpu::run_with(prog, bind, *p);
                bind.release_pages();
                Ok(out?)
            }
            Device::Wgpu(b) => Ok(b.run(prog, bind)?),
        }
    }

    /// Runs `f` (prepares) telling `progress` (kernels tuned, kernels to
    /// tune) while kernels are measured ([`Tuning::Measure`]); a node
    /// shows it as its progress.
    pub fn with_tuning_progress<R>(
        &self,
        progress: crate::backend::wgpu::TuningObserver,
        f: impl FnOnce() -> R,
    ) -> R {
        match &self.device {
            Device::Cpu(_) => f(),
            Device::Wgpu(b) => {
                b.observe_tuning(Some(progress));
                let r = f();
                b.observe_tuning(None);
                r
            }
        }
    }

    /// Binds a program's weights for repeated runs.
    pub fn prepare<'a>(
        &'a self,
        prog: &'a Program,
        weights: &Bindings,
    ) -> Result<Session<'a>, RuntimeError> {
        self.prepare_reserving(prog, weights, 0)
    }

    /// Prepares several programs of one model that run side by side (a
    /// sampler's conditioning groups). Each leaves room for those after it
    /// (their activations and stream arenas), and sees those before it as
    /// live, so together they stay within the budget.
    pub fn prepare_many<'a>(
        &'a self,
        progs: &'a [Program],
        weights: &Bindings,
    ) -> Result<Vec<Session<'a>>, RuntimeError> {
        let reserves: Vec<u64> = match &self.device {
            Device::Wgpu(b) if b.budget().is_some() => {
                progs.iter().map(|p| b.sibling_reserve(p)).collect()
            }
            _ => vec![0; progs.len()],
        };
        progs
            .iter()
            .enumerate()
            .map(|(i, p)| self.prepare_reserving(p, weights, reserves[i + 1..].iter().sum()))
            .collect()
    }

    /// [`Runtime::prepare`] leaving `reserve` bytes of the budget free.
    fn prepare_reserving<'a>(
        &'a self,
        prog: &'a Program,
        weights: &Bindings,
        reserve: u64,
    ) -> Result<Session<'a>, RuntimeError> {
        match &self.device {
            Device::Cpu(products) => Ok(Session::Cpu {
                prog,
                products: *products,
                bind: Bindings {
                    weights: weights.weights.clone(),
                    stored: weights.stored.clone(),
                    inputs: HashMap::new(),
                    packed: weights.packed.clone(),
                },
            }),
            Device::Wgpu(b) => {
                // Out of device memory is not the end: free the weights
                // kept from earlier runs and re-plan with half the room for
                // weights (streaming more), up to six times. What still
                // does not fit is an error callers may answer by splitting
                // their work (`RuntimeError::needs_less_memory`).
                let mut budget = b.budget().map(|x| x.saturating_sub(reserve));
                let mut replans = 0;
                loop {
                    match b.prepare_within(prog, weights, budget) {
                        Err(WgpuError::OutOfMemory(e)) if replans < 6 => {
                            replans += 1;
                            b.free_weights();
                            // Halve the room for weights (streaming more);
                            // activations cannot shrink by re-planning.
                            let act = b.activation_bytes(prog);
                            let whole = act + b.weight_bytes(prog);
                            let now = budget.map_or(whole, |x| x.min(whole));
                            let next = act + now.saturating_sub(act) / 2;
                            budget = Some(next);
                            tracing::warn!(
                                "out of device memory ({e}); re-planning under {} MiB",
                                next >> 20
                            );
                        }
                        r => {
                            return Ok(Session::Wgpu {
                                prepared: Box::new(r?),
                                budget,
                                replans,
                            })
                        }
                    }
                }
            }
        }
    }
}

/// Whether the OS shows any GPU device. On Linux without /dev/dri or
/// /dev/nvidia* there is none, so `auto` skips the Vulkan probe (whose
/// software drivers print warnings on headless machines).
fn gpu_device_nodes() -> bool {
    if !cfg!(target_os = "linux") {
        return true;
    }
    let dri = std::fs::read_dir("/dev/dri")
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    dri || std::path::Path::new("/dev/nvidia0").exists()
        || std::path::Path::new("/dev/kfd").exists()
}

impl Bindings {
    /// Lets the OS drop the file pages of the weights left in their file
    /// (see [`crate::weights::SafeTensors::release_pages`]): a model use
    /// calls it when done, so memory holds one model's pages at a time.
    pub fn release_pages(&self) {
        for w in self.stored.values() {
            w.release_pages();
        }
    }
}

/// A program with its weights bound, run with fresh inputs each time.
pub enum Session<'a> {
    Cpu {
        prog: &'a Program,
        bind: Bindings,
        products: cpu::Products,
    },
    Wgpu {
        prepared: Box<Prepared<'a>>,
        /// The budget it was planned under (below the runtime's after an
        /// out-of-memory re-plan).
        budget: Option<u64>,
        /// Times the device ran out of memory and the use was re-planned.
        replans: u32,
    },
}

/// A CPU session's weights are read from the mapped file every step; when
/// it ends, their pages are let go.
impl Drop for Session<'_> {
    fn drop(&mut self) {
        if let Session::Cpu { bind, .. } = self {
            bind.release_pages();
        }
    }
}

impl Session<'_> {
    /// Runs with `inputs`, reading back every output.
    pub fn run(
        &mut self,
        inputs: HashMap<String, Arc<Vec<f32>>>,
    ) -> Result<Vec<Array>, RuntimeError> {
        let all: Vec<usize> = match self {
            Session::Cpu { prog, .. } => (0..prog.outputs.len()).collect(),
            Session::Wgpu { prepared, .. } => (0..prepared.outputs()).collect(),
        };
        let outs = self.run_carried(inputs, &[], &all)?;
        Ok(outs.into_iter().flatten().collect())
    }

    /// Runs with `inputs`, returning only the outputs in `read` (None for
    /// the others), and feeds output `o` of each `(o, name)` in `carry`
    /// to input `name` of the next run. An input left out keeps its value
    /// from the run before (given or carried). On a GPU the carried and
    /// kept values stay on the device and only `read` is downloaded: a
    /// sampling loop's latent crosses the bus once, and its fixed inputs
    /// (the text context) are uploaded once.
    pub fn run_carried(
        &mut self,
        inputs: HashMap<String, Arc<Vec<f32>>>,
        carry: &[(usize, &str)],
        read: &[usize],
    ) -> Result<Vec<Option<Array>>, RuntimeError> {
        match self {
            Session::Cpu {
                prog,
                bind,
                products,
            } => {
                // Inputs left out keep their last value.
                bind.inputs.extend(inputs);
                let outs = cpu::run_with(prog, bind, *products)?;
                for &(o, name) in carry {
                    let out = outs.get(o).ok_or_else(|| {
                        RuntimeError::Cpu(
                            crate::backend::BindError::MissingInput(format!("output {o}")).into(),
                        )
                    })?;
                    bind.inputs
                        .insert(name.to_string(), Arc::new(out.data.clone()));
                }
                Ok(outs
                    .into_iter()
                    .enumerate()
                    .map(|(i, a)| read.contains(&i).then_some(a))
                    .collect())
            }
            Session::Wgpu { prepared: p, .. } => Ok(p.run_carried(
                &Bindings {
                    inputs,
                    ..Bindings::default()
                },
                carry,
                read,
            )?),
        }
    }

    /// The residency plan the session runs under (GPU with a budget).
    pub fn residency(&self) -> Option<&ResidencyPlan> {
        match self {
            Session::Cpu { .. } => None,
            Session::Wgpu { prepared: p, .. } => p.residency(),
        }
    }

    /// What preparing the session evicted and loaded (GPU).
    pub fn use_step(&self) -> Option<&UseStep> {
        match self {
            Session::Cpu { .. } => None,
            Session::Wgpu { prepared: p, .. } => Some(p.use_step()),
        }
    }

    /// The device memory budget the session was planned under (GPU).
    pub fn budget(&self) -> Option<u64> {
        match self {
            Session::Cpu { .. } => None,
            Session::Wgpu { budget, .. } => *budget,
        }
    }

    /// Times preparing ran out of device memory and re-planned.
    pub fn replans(&self) -> u32 {
        match self {
            Session::Cpu { .. } => 0,
            Session::Wgpu { replans, .. } => *replans,
        }
    }
}

/// Parses a `--vram-budget` value: bytes, with an optional K/M/G/T suffix
/// (powers of 1024; `KiB`, `MB`... also read as powers of 1024), or `auto`.
/// `auto` is None here: wgpu reports no memory size, so the caller applies
/// [`AUTO_BUDGET`] and says so.
pub fn parse_budget(text: &str) -> Result<Option<u64>, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    let digits = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a byte count (e.g. 6G, 512MiB, 2000000000)"))?;
    let scale = match unit.trim().to_ascii_lowercase().trim_end_matches('b') {
        "" => 1u64,
        "k" | "ki" => 1 << 10,
        "m" | "mi" => 1 << 20,
        "g" | "gi" => 1 << 30,
        "t" | "ti" => 1 << 40,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use K, M, G or T)"
            ))
        }
    };
    Ok(Some((value * scale as f64) as u64))
}

/// The budget `--vram-budget auto` uses: wgpu does not report how much
/// memory an adapter has, so a conservative 4 GiB (most discrete GPUs
/// sold since 2016 have at least that).
pub const AUTO_BUDGET: u64 = 4 << 30;

/// The wgpu options the CLI and server open a device with.
/// `SDKIT_SHADER_CHECKS=1` compiles shaders with wgpu's runtime checks
/// (`Options::shader_checks`), to rule the generated kernels out when a
/// GPU gives wrong images.
fn gpu_options(
    adapter: Option<String>,
    budget: Option<u64>,
    tensor_cores: bool,
    tuning: Tuning,
) -> Options {
    Options {
        adapter,
        budget,
        allow_coopmat: tensor_cores,
        tuning,
        pipeline_cache_dir: crate::backend::wgpu::default_cache_dir(),
        shader_checks: std::env::var("SDKIT_SHADER_CHECKS")
            .is_ok_and(|v| !v.is_empty() && v != "0"),
        ..Options::default()
    }
}
