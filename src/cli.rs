//! Command-line parsing and the commands that are not long-running.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use sdkit_engine::{
    validate_for, CancelToken, EventSink, Executor, Graph, NodeLibrary, Outputs, Paths, RunError,
    RunOptions,
};
use sdkit_schema::export::{object_info, workflow_json_schema};
use sdkit_schema::workflow::{self, InputDoc};
use sdkit_schema::{Diagnostic, Workflow};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Exit code for a workflow that does not validate.
pub const EXIT_INVALID: i32 = 2;
/// Exit code for a run stopped by Ctrl-C (128 + SIGINT).
pub const EXIT_INTERRUPTED: i32 = 130;

#[derive(Parser, Debug)]
#[command(
    name = "sdkit",
    version,
    about = "A lean, fast engine for diffusion image generation"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Threads for CPU work (kernels on the CPU backend, image ops).
    /// Default: every core.
    #[arg(long, global = true, value_name = "N")]
    pub threads: Option<usize>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Validate and run a workflow file.
    Run(RunArgs),
    /// Run a workflow, then re-run it on every save, executing only what changed.
    Watch(RunArgs),
    /// Serve ComfyUI's HTTP/WebSocket API (and a front-end folder) for
    /// ComfyUI's front end and API clients.
    Serve(crate::serve::ServeArgs),
    /// Run a cluster's prompts: take them from the Redis that `sdkit serve
    /// --queue` puts them in, and report back through it.
    Worker(crate::serve::worker::WorkerArgs),
    /// Check a workflow file; exits 0 when valid, 2 when not.
    Validate {
        file: PathBuf,
        #[command(flatten)]
        dirs: DirArgs,
        /// Output format of the diagnostics.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Print every node type as JSON, in ComfyUI's /object_info shape.
    Nodes {
        #[command(flatten)]
        dirs: DirArgs,
    },
    /// Print a JSON Schema for the native workflow format (JSON form).
    Schema {
        #[command(flatten)]
        dirs: DirArgs,
    },
    /// List GPU adapters with their backend, features and limits.
    Devices {
        /// Also measure an adapter's ceilings (memory bandwidth, FMA and
        /// tensor-core rates, fragment loads): the best adapter, or the
        /// one whose name contains NAME.
        #[arg(long, value_name = "NAME", num_args = 0..=1, default_missing_value = "")]
        probe: Option<String>,
    },
    /// Plan a sample SD-structured tensor graph and print its Program:
    /// every dispatch with its fused epilogue, arena offsets, and statistics.
    Plan {
        /// Which graph: an SD ResBlock, a SpatialTransformer, or a UNet-shaped stack.
        #[arg(value_enum)]
        graph: SampleGraph,
        #[arg(long, default_value_t = 2)]
        batch: usize,
        /// Channels (ResBlock/transformer) or base width (UNet); a multiple of 32.
        #[arg(long, default_value_t = 320)]
        channels: usize,
        /// Spatial size of the latent (height = width).
        #[arg(long, default_value_t = 64)]
        size: usize,
        /// Only the statistics line.
        #[arg(long)]
        stats: bool,
        /// Also run the Program (random weights) on a device and time it.
        #[arg(long, value_enum)]
        run: Option<DeviceKind>,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Wgpu,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum SampleGraph {
    Resblock,
    Transformer,
    Unet,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
}

#[derive(Args, Debug, Clone)]
pub struct DirArgs {
    /// Base folder holding models/, input/, output/ and temp/ (default: the current folder).
    #[arg(long, value_name = "DIR")]
    pub base_dir: Option<PathBuf>,
    /// Model folders root (checkpoints/, loras/, vae/, ...).
    #[arg(long, value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
    /// Folder LoadImage reads from.
    #[arg(long, value_name = "DIR")]
    pub input_dir: Option<PathBuf>,
    /// Folder SaveImage writes to.
    #[arg(long, value_name = "DIR")]
    pub output_dir: Option<PathBuf>,
    /// Folder PreviewImage writes to.
    #[arg(long, value_name = "DIR")]
    pub temp_dir: Option<PathBuf>,
}

impl DirArgs {
    pub fn paths(&self) -> Result<Paths> {
        let base = match &self.base_dir {
            Some(b) => b.clone(),
            None => std::env::current_dir().context("cannot read the current folder")?,
        };
        let mut p = Paths::under(&base);
        if let Some(d) = &self.models_dir {
            p.models = d.clone();
        }
        if let Some(d) = &self.input_dir {
            p.input = d.clone();
        }
        if let Some(d) = &self.output_dir {
            p.output = d.clone();
        }
        if let Some(d) = &self.temp_dir {
            p.temp = d.clone();
        }
        Ok(p)
    }
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Workflow file: native RON/JSON, ComfyUI API JSON or ComfyUI UI JSON.
    pub file: PathBuf,
    #[command(flatten)]
    pub dirs: DirArgs,
    /// Override an input: NODE.INPUT=VALUE (VALUE in RON/JSON syntax, or bare text).
    #[arg(long = "set", value_name = "NODE.INPUT=VALUE")]
    pub set: Vec<String>,
    /// Write execution events as JSON lines to FILE, or to stdout with "-".
    #[arg(long, value_name = "FILE|-")]
    pub events: Option<String>,
    /// No progress display.
    #[arg(long, short)]
    pub quiet: bool,
    /// Where models run: auto (a hardware GPU if present, else the CPU),
    /// cpu, wgpu (best adapter, software ones included) or an adapter name
    /// from `sdkit devices`.
    #[arg(long, value_name = "auto|cpu|wgpu|NAME", default_value = "auto")]
    pub device: String,
    /// GPU memory the run may use (e.g. 6G, 512MiB, or bytes); weights that
    /// do not fit stream from host memory each step. `auto`: 4 GiB (wgpu
    /// does not report an adapter's memory size). Default: no limit.
    #[arg(long, value_name = "BYTES|auto")]
    pub vram_budget: Option<String>,
    /// Arithmetic of matrix products: `auto` uses tensor cores where the
    /// GPU offers them (f16 operands, f32 accumulation, as PyTorch and
    /// ComfyUI in fp16) and, on the CPU, AMX tiles where the CPU has them
    /// (bf16 operands, f32 accumulation; about 1.5x faster there); `f32`
    /// keeps every product in f32 (ComfyUI's CPU results to 1/255).
    #[arg(long, value_name = "auto|f32", default_value = "auto")]
    pub precision: Precision,
    /// Time the variants of each tensor-core kernel (tilings, split-K)
    /// the first time it runs and keep the fastest in the cache folder;
    /// without, runs use what earlier tuned runs chose. Costs the first
    /// run of each new image size seconds to a minute.
    #[arg(long)]
    pub tune: bool,
    /// After each run, drop cached node outputs and the GPU's resident
    /// weights (what ComfyUI's /free does), so `watch` gives memory back
    /// while the file is edited; the next run loads models again.
    #[arg(long)]
    pub free_after_run: bool,
    /// Refuse the whole workflow on any error. Without it, as ComfyUI
    /// does, outputs whose branch has an error are reported and skipped,
    /// the others run (and the exit code is still 2).
    #[arg(long)]
    pub strict: bool,
}

impl RunArgs {
    /// What errors refuse, by `--strict`.
    pub fn outputs(&self) -> Outputs {
        if self.strict {
            Outputs::All
        } else {
            Outputs::Valid
        }
    }
}

/// `--precision`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    Auto,
    F32,
}

impl RunArgs {
    /// The executor for this run's library, folders and device.
    pub fn executor(&self, lib: Arc<sdkit_engine::NodeLibrary>, paths: Paths) -> Result<Executor> {
        make_executor(
            &self.device,
            self.vram_budget.as_deref(),
            self.precision,
            self.tune,
            lib,
            paths,
        )
    }
}

/// An executor on `device` (auto|cpu|wgpu|NAME) under `vram_budget`.
pub fn make_executor(
    device: &str,
    vram_budget: Option<&str>,
    precision: Precision,
    tune: bool,
    lib: Arc<sdkit_engine::NodeLibrary>,
    paths: Paths,
) -> Result<Executor> {
    {
        let budget = match vram_budget {
            None => None,
            Some(text) => match sdkit_compute::runtime::parse_budget(text)
                .map_err(|e| anyhow::anyhow!("--vram-budget {e}"))?
            {
                Some(b) => Some(b),
                None => {
                    eprintln!(
                        "note: the GPU backend reports no memory size; --vram-budget auto uses {} MiB",
                        sdkit_compute::runtime::AUTO_BUDGET >> 20
                    );
                    Some(sdkit_compute::runtime::AUTO_BUDGET)
                }
            },
        };
        let tuning = if tune {
            sdkit_compute::backend::wgpu::Tuning::Measure
        } else {
            sdkit_compute::backend::wgpu::Tuning::Cached
        };
        let runtime = sdkit_engine::Runtime::select_tuned(
            device,
            budget,
            precision == Precision::Auto,
            tuning,
        )?;
        tracing::info!("models run on {}", runtime.describe());
        Ok(Executor::new(lib, Arc::new(paths)).with_runtime(runtime))
    }
}

pub fn main(cli: Cli) -> Result<i32> {
    if let Some(n) = cli.threads {
        if n == 0 {
            anyhow::bail!("--threads must be at least 1");
        }
        sdkit_compute::backend::cpu::set_threads(n).map_err(anyhow::Error::msg)?;
    }
    match cli.command {
        Command::Run(args) => run_command(args),
        Command::Watch(args) => crate::watch::watch(args),
        Command::Serve(args) => crate::serve::serve(args),
        Command::Worker(args) => crate::serve::worker::worker(args),
        Command::Validate { file, dirs, format } => validate_command(&file, &dirs, format),
        Command::Nodes { dirs } => {
            let lib = sdkit_nodes::library();
            print_json(&object_info(&lib.registry, &dirs.paths()?))
        }
        Command::Schema { dirs } => {
            let lib = sdkit_nodes::library();
            print_json(&workflow_json_schema(&lib.registry, &dirs.paths()?))
        }
        Command::Devices { probe } => devices_command(probe),
        Command::Plan {
            graph,
            batch,
            channels,
            size,
            stats,
            run,
        } => plan_command(graph, batch, channels, size, stats, run),
    }
}

fn devices_command(probe: Option<String>) -> Result<i32> {
    let list = sdkit_compute::backend::wgpu::adapters_with_tuning();
    let mut out = std::io::stdout().lock();
    let products = if sdkit_compute::backend::cpu::amx::available() {
        "bf16 products on AMX tiles with --precision auto"
    } else {
        "f32 products"
    };
    writeln!(
        out,
        "cpu: {} threads, {products} (always available)",
        rayon_threads()
    )?;
    if list.is_empty() {
        writeln!(
            out,
            "no GPU adapters (on Linux without a GPU, Mesa's lavapipe provides a software one: mesa-vulkan-drivers)"
        )?;
    }
    for a in list {
        writeln!(out, "{} [{} {}]", a.name, a.backend, a.device_type)?;
        writeln!(out, "  driver: {}", a.driver.trim())?;
        writeln!(
            out,
            "  features: {}",
            if a.features.is_empty() {
                "-".to_string()
            } else {
                a.features.join(", ")
            }
        )?;
        if !a.cooperative_matrix.is_empty() {
            writeln!(
                out,
                "  cooperative matrix: {}",
                a.cooperative_matrix.join(", ")
            )?;
        }
        let subgroup = match a.subgroup_size {
            (0, _) => String::new(),
            (lo, hi) if lo == hi => format!(", subgroup {lo} lanes"),
            (lo, hi) => format!(", subgroup {lo}-{hi} lanes"),
        };
        writeln!(
            out,
            "  max storage binding {} MiB, max buffer {} MiB, workgroup memory {} KiB{subgroup}",
            a.max_storage_buffer_binding_size >> 20,
            a.max_buffer_size >> 20,
            a.max_compute_workgroup_storage_size >> 10
        )?;
        if a.tuned_kernels > 0 {
            writeln!(
                out,
                "  tuned kernels: {} (`sdkit run --tune`; runs use them)",
                a.tuned_kernels
            )?;
        }
    }
    if let Some(name) = probe {
        probe_command(&mut out, (!name.is_empty()).then_some(name))?;
    }
    Ok(0)
}

/// Prints the measured ceilings of the best adapter (or the named one).
fn probe_command(out: &mut impl Write, adapter: Option<String>) -> Result<()> {
    use sdkit_compute::backend::wgpu::{probe::ProbeSize, Options, WgpuBackend};
    let gpu = WgpuBackend::with_options(&Options {
        adapter,
        ..Options::default()
    })
    .context("cannot open the adapter to probe")?;
    // A software adapter would take minutes over the full sizes.
    let size = if gpu.adapter.device_type.contains("Cpu") {
        ProbeSize {
            min_secs: 0.05,
            ..ProbeSize::quick()
        }
    } else {
        ProbeSize::full()
    };
    writeln!(
        out,
        "probe of {} ({}):",
        gpu.adapter.name, gpu.adapter.backend
    )?;
    if gpu.coop.is_none() {
        writeln!(out, "  no cooperative matrices: fragment probes skipped")?;
    }
    for r in gpu.probe(&size).context("probe failed")? {
        writeln!(out, "  {r}")?;
    }
    Ok(())
}

fn rayon_threads() -> usize {
    sdkit_compute::backend::cpu::threads()
}

fn plan_command(
    graph: SampleGraph,
    batch: usize,
    channels: usize,
    size: usize,
    stats_only: bool,
    run: Option<DeviceKind>,
) -> Result<i32> {
    use sdkit_compute::plan::{plan, samples};
    let g = match graph {
        SampleGraph::Resblock => samples::resblock_graph(batch, channels, size, 4 * channels),
        SampleGraph::Transformer => samples::transformer_graph(batch, channels, size, 77, 768, 8),
        SampleGraph::Unet => samples::unet_like_graph(batch, channels, size, 3),
    }
    .context("cannot build the sample graph (channels must be a multiple of 32)")?;
    let p = plan(&g).context("planning failed")?;
    let text = p.to_string();
    let mut out = std::io::stdout().lock();
    if stats_only {
        writeln!(out, "{}", text.lines().last().unwrap_or(""))?;
    } else {
        write!(out, "{text}")?;
    }
    writeln!(out, "kernels: {:?}", p.kernel_histogram())?;
    if let Some(device) = run {
        drop(out);
        time_program(&g, &p, device)?;
    }
    Ok(0)
}

/// Runs a planned sample graph with deterministic pseudo-random weights
/// and inputs, and prints the time per run (after one warm-up run).
fn time_program(
    g: &sdkit_compute::tensor::TensorGraph,
    p: &sdkit_compute::plan::Program,
    device: DeviceKind,
) -> Result<()> {
    use sdkit_compute::backend::{cpu, wgpu};
    use sdkit_compute::tensor::InputKind;
    let mut bind = cpu::Bindings::default();
    for kind in [InputKind::Weight, InputKind::Activation] {
        for (_, name, shape) in g.inputs(kind) {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n)
                .map(|i| ((i.wrapping_mul(2_654_435_761) % 2001) as f32 / 1000.0 - 1.0) * 0.05)
                .collect();
            let data = Arc::new(data);
            match kind {
                InputKind::Weight => bind.weights.insert(name.to_string(), data),
                InputKind::Activation => bind.inputs.insert(name.to_string(), data),
            };
        }
    }
    let runs = 3;
    match device {
        DeviceKind::Cpu => {
            cpu::run(p, &bind).context("cpu run failed")?;
            let t = std::time::Instant::now();
            for _ in 0..runs {
                cpu::run(p, &bind).context("cpu run failed")?;
            }
            println!(
                "cpu: {:.2} ms per run ({} threads)",
                t.elapsed().as_secs_f64() * 1e3 / runs as f64,
                rayon_threads()
            );
        }
        DeviceKind::Wgpu => {
            let gpu = wgpu::WgpuBackend::new(None).context("cannot open a GPU adapter")?;
            let prepared = gpu
                .prepare(p, &bind)
                .context("cannot prepare the program")?;
            prepared.run(&bind).context("wgpu run failed")?;
            let t = std::time::Instant::now();
            for _ in 0..runs {
                prepared.run(&bind).context("wgpu run failed")?;
            }
            println!(
                "wgpu ({}): {:.2} ms per run incl. input upload and readback; {} pipelines, f16 weights: {}",
                gpu.adapter.name,
                t.elapsed().as_secs_f64() * 1e3 / runs as f64,
                gpu.pipelines_compiled(),
                gpu.f16_weights
            );
        }
    }
    Ok(())
}

fn print_json(v: &serde_json::Value) -> Result<i32> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v)?;
    writeln!(out)?;
    Ok(0)
}

/// A workflow that loaded and validated, or its diagnostics.
pub enum Loaded {
    Ok(Box<Graph>),
    Invalid(Vec<Diagnostic>),
}

/// Reads, applies `--set` overrides, and validates.
pub fn load_and_validate(
    file: &Path,
    sets: &[String],
    lib: &NodeLibrary,
    paths: &Paths,
    outputs: Outputs,
) -> Result<Loaded> {
    let text = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let text = match String::from_utf8(text) {
        Ok(t) => t,
        Err(_) => {
            return Ok(Loaded::Invalid(vec![Diagnostic::error(
                sdkit_schema::DiagKind::SyntaxError,
                "the file is not UTF-8 text",
            )]))
        }
    };
    let mut wf = match workflow::load(&text, &lib.registry) {
        Ok(wf) => wf,
        Err(d) => return Ok(Loaded::Invalid(d)),
    };
    if let Err(d) = apply_sets(&mut wf, sets, &lib.registry) {
        return Ok(Loaded::Invalid(d));
    }
    Ok(match validate_for(&wf, lib, paths, outputs) {
        Ok(g) => Loaded::Ok(Box::new(g)),
        Err(d) => Loaded::Invalid(d),
    })
}

/// Applies `NODE.INPUT=VALUE` overrides. An input the node's type does
/// not have is an error here, though a file's unknown input is a warning:
/// a file may come from a newer ComfyUI, a `--set` is a typo.
fn apply_sets(
    wf: &mut Workflow,
    sets: &[String],
    registry: &sdkit_schema::Registry,
) -> Result<(), Vec<Diagnostic>> {
    use sdkit_schema::diagnostic::echo;
    let mut errors = Vec::new();
    let mut error = |msg: String| {
        errors.push(Diagnostic::error(
            sdkit_schema::DiagKind::InvalidPrompt,
            msg,
        ))
    };
    for s in sets {
        let parsed = s.split_once('=').and_then(|(lhs, v)| {
            let (node, input) = lhs.rsplit_once('.')?;
            Some((node.trim(), input.trim(), v))
        });
        let Some((node, input, value)) = parsed else {
            error(format!("--set {}: expected NODE.INPUT=VALUE", echo(s)));
            continue;
        };
        let Some(doc) = wf.node_mut(node) else {
            error(format!(
                "--set {}: no node \"{}\" in the workflow",
                echo(s),
                echo(node)
            ));
            continue;
        };
        if input.is_empty() {
            error(format!(
                "--set {}: no input name after \"{}.\"",
                echo(s),
                echo(node)
            ));
            continue;
        }
        // A node of an unknown type is reported by validation.
        if let Some(spec) = registry.get(&doc.class_type) {
            if spec.input(input).is_none() {
                let names: Vec<&str> = spec.inputs.iter().map(|i| i.name.as_str()).collect();
                error(format!(
                    "--set {}: {} has no input \"{}\" (its inputs: {})",
                    echo(s),
                    spec.name,
                    echo(input),
                    names.join(", ")
                ));
                continue;
            }
        }
        let value = workflow::parse_input_value(value);
        match doc.input_mut(input) {
            Some(i) => i.value = value,
            None => doc.inputs.push(InputDoc {
                name: input.to_string(),
                value,
                pos: None,
            }),
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// Prints diagnostics as `FILE:LINE:COL: error[kind] node "id" (Type) input "x": message`.
pub fn print_diagnostics(file: &Path, diags: &[Diagnostic]) {
    let mut err = std::io::stderr().lock();
    for d in diags {
        let _ = writeln!(err, "{}:{d}", file.display());
    }
    let n = diags.iter().filter(|d| d.is_error()).count();
    if n > 0 {
        let _ = writeln!(
            err,
            "{}: {n} error{} found",
            file.display(),
            if n == 1 { "" } else { "s" }
        );
    }
}

fn validate_command(file: &Path, dirs: &DirArgs, format: Format) -> Result<i32> {
    let lib = sdkit_nodes::library();
    let paths = dirs.paths()?;
    let (diags, code) = match load_and_validate(file, &[], &lib, &paths, Outputs::All)? {
        Loaded::Ok(g) => (g.warnings.clone(), 0),
        Loaded::Invalid(d) => (d, EXIT_INVALID),
    };
    match format {
        Format::Text => {
            print_diagnostics(file, &diags);
            if code == 0 {
                eprintln!("{}: valid", file.display());
            }
        }
        Format::Json => {
            let v = serde_json::json!({
                "file": file.display().to_string(),
                "valid": code == 0,
                "diagnostics": diags,
            });
            print_json(&v)?;
        }
    }
    Ok(code)
}

/// Builds the event sink: JSON lines to a file or stdout, plus the
/// terminal progress display.
pub fn event_sink(args: &RunArgs) -> Result<(EventSink, Option<crate::progress::Progress>)> {
    let writer: Option<Arc<Mutex<Box<dyn Write + Send>>>> = match args.events.as_deref() {
        None => None,
        Some("-") => Some(Arc::new(Mutex::new(Box::new(std::io::stdout())))),
        Some(path) => {
            let f = std::fs::File::create(path)
                .with_context(|| format!("cannot create events file {path}"))?;
            Some(Arc::new(Mutex::new(Box::new(std::io::LineWriter::new(f)))))
        }
    };
    let progress = (!args.quiet).then(crate::progress::Progress::new);
    let bar = progress.clone();
    let sink: EventSink = Arc::new(move |e| {
        // Previews are pixels for the server's WebSocket clients; as a JSON
        // line they would only repeat the image size every step.
        if let Some(w) = writer
            .as_ref()
            .filter(|_| !matches!(e, sdkit_engine::Event::Preview { .. }))
        {
            if let Ok(line) = serde_json::to_string(e) {
                let mut w = w.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let _ = writeln!(w, "{line}");
            }
        }
        if let Some(p) = &bar {
            p.event(e);
        }
    });
    Ok((sink, progress))
}

/// Runs one validated graph with Ctrl-C cancelling it; returns the exit code.
pub async fn run_graph(
    exec: &Executor,
    graph: &Graph,
    events: EventSink,
    cancel: CancelToken,
) -> i32 {
    let opts = RunOptions::new(events, cancel.clone());
    let run = exec.run(graph, opts);
    tokio::pin!(run);
    let result = loop {
        tokio::select! {
            r = &mut run => break r,
            _ = tokio::signal::ctrl_c() => {
                if cancel.is_cancelled() {
                    eprintln!("interrupted twice: exiting");
                    std::process::exit(EXIT_INTERRUPTED);
                }
                eprintln!("interrupting: stopping at the next node or step (Ctrl-C again to quit now)");
                cancel.cancel();
            }
        }
    };
    match result {
        Ok(report) => {
            for (node, out) in &report.outputs {
                if let Some(images) = out.get("images").and_then(|i| i.as_array()) {
                    for img in images {
                        let dir = match img.get("type").and_then(|t| t.as_str()) {
                            Some("temp") => &exec.paths().temp,
                            _ => &exec.paths().output,
                        };
                        let sub = img.get("subfolder").and_then(|s| s.as_str()).unwrap_or("");
                        let name = img.get("filename").and_then(|s| s.as_str()).unwrap_or("");
                        eprintln!("node {node}: wrote {}", dir.join(sub).join(name).display());
                    }
                }
            }
            0
        }
        Err(RunError::Interrupted) => {
            eprintln!("interrupted");
            EXIT_INTERRUPTED
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn run_command(args: RunArgs) -> Result<i32> {
    let lib = Arc::new(sdkit_nodes::library());
    let paths = args.dirs.paths()?;
    crate::sweep::stale_temp_files(&paths, None);
    let graph = match load_and_validate(&args.file, &args.set, &lib, &paths, args.outputs())? {
        Loaded::Ok(g) => g,
        Loaded::Invalid(d) => {
            print_diagnostics(&args.file, &d);
            return Ok(EXIT_INVALID);
        }
    };
    print_graph_diagnostics(&args.file, &graph);
    let (sink, progress) = event_sink(&args)?;
    let exec = args.executor(lib, paths)?;
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let code = rt.block_on(run_graph(&exec, &graph, sink, CancelToken::new()));
    if let Some(p) = progress {
        p.finish();
    }
    // Outputs dropped for errors make the run incomplete.
    Ok(if code == 0 && !graph.dropped.is_empty() {
        EXIT_INVALID
    } else {
        code
    })
}

/// A runnable graph's warnings, and the errors of the outputs it skips.
pub fn print_graph_diagnostics(file: &Path, graph: &Graph) {
    print_diagnostics(file, &graph.warnings);
    if !graph.dropped.is_empty() {
        print_diagnostics(file, &graph.dropped);
        eprintln!(
            "{}: running the outputs without errors (--strict refuses the whole file)",
            file.display()
        );
    }
}
