//! Throughput of the CPU kernels on Stable-Diffusion-sized shapes, side by
//! side with PyTorch's CPU kernels on the same shapes when torch is
//! importable.
//!
//! Run with `cargo bench --bench cpu_ops` (add case names after `--` to run
//! only those). PyTorch is `python3` on PATH, or the interpreter named by
//! `SDKIT_BENCH_PYTHON`; without it only sdkit's numbers are printed. Both
//! sides use `RAYON_NUM_THREADS` threads if set, else one per core.
//!
//! PyTorch runs in a worker process, and the two sides alternate in blocks
//! of a few runs (each block starting with an untimed warm-up run, with a
//! pause between blocks so neither side's idle-spinning threads slow the
//! other), so a change in the machine's speed (shared cores are common) hits
//! both alike. Each number is the median of all timed runs; the minimum is
//! printed too.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use sdkit_compute::backend::cpu::kernels::{attention, conv2d, matmul, MatView, Products};

/// Each side runs each case in this many blocks, the two sides' blocks
/// alternating ...
const ROUNDS: usize = 3;
/// ... of one untimed warm-up run and this many timed runs.
const RUNS_PER_ROUND: usize = 3;
/// Timed runs per case and side.
const RUNS: usize = ROUNDS * RUNS_PER_ROUND;
/// Pause between blocks: PyTorch's OpenMP threads keep spinning for a while
/// after a parallel region ends (rayon's, more briefly), and would otherwise
/// steal cores from the other side's first runs.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(300);

/// One benchmark case: a name shared with the PyTorch worker, its work in
/// floating-point operations, and a closure running it once.
struct Case {
    name: &'static str,
    what: String,
    flops: f64,
    run: Box<dyn FnMut()>,
}

/// Values in [-1, 1) from a fixed seed; the data only has to be
/// non-degenerate.
fn random(seed: u64, len: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn gemm_case(
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    b_transposed: bool,
    products: Products,
) -> Case {
    let a = random(1, m * k);
    let b = random(2, k * n);
    let mut c = vec![0.0f32; m * n];
    // A transposed B is how a Linear layer's [out, in] weight is used.
    let bv = if b_transposed {
        MatView::transposed(k, n)
    } else {
        MatView::row_major(k, n)
    };
    Case {
        name,
        what: format!(
            "matmul {m}x{k} · {k}x{n}{}",
            if b_transposed { " (B transposed)" } else { "" }
        ),
        flops: 2.0 * (m * n * k) as f64,
        run: Box::new(move || {
            if let Err(e) = matmul(
                &a,
                MatView::row_major(m, k),
                &b,
                bv,
                &mut c,
                1,
                m,
                n,
                k,
                products,
            ) {
                panic!("{e}");
            }
        }),
    }
}

fn conv_case(name: &'static str, products: Products) -> Case {
    let (n, c, h, w, o) = (2, 320, 64, 64, 320);
    let x = random(3, n * c * h * w);
    let wt = random(4, o * c * 9);
    let bias = random(5, o);
    let mut out = vec![0.0f32; n * o * h * w];
    Case {
        name,
        what: format!("conv2d {n}x{c}x{h}x{w} -> {o}, 3x3 pad 1"),
        flops: 2.0 * (n * o * h * w * c * 9) as f64,
        run: Box::new(move || {
            let shape = [n, c, h, w];
            if let Err(e) = conv2d(
                &x,
                shape,
                &wt,
                [o, c, 3, 3],
                Some(&bias),
                [1, 1],
                [1, 1],
                [1, 1],
                1,
                &mut out,
                products,
            ) {
                panic!("{e}");
            }
        }),
    }
}

fn attention_case(name: &'static str, products: Products) -> Case {
    let (heads, s, d) = (8, 4096, 40);
    let q = random(6, heads * s * d);
    let k = random(7, heads * s * d);
    let v = random(8, heads * s * d);
    let mut out = vec![0.0f32; heads * s * d];
    let scale = 1.0 / (d as f32).sqrt();
    Case {
        name,
        what: format!("attention {heads} heads x {s} tokens x {d}"),
        flops: 4.0 * (heads * s * s * d) as f64,
        run: Box::new(move || {
            if let Err(e) = attention(
                &q, &k, &v, None, heads, s, s, d, d, scale, &mut out, products,
            ) {
                panic!("{e}");
            }
        }),
    }
}

/// The PyTorch worker: builds the same cases, then for each line
/// `name runs` on stdin runs that case once untimed and `runs` times timed,
/// and prints the seconds of each timed run on one line (or `none`).
const TORCH_WORKER: &str = r#"
import sys, time
try:
    import torch
    import torch.nn.functional as F
except Exception as e:
    print("unavailable", repr(e), flush=True)
    sys.exit(0)

torch.set_num_threads(int(sys.argv[1]))
torch.set_grad_enabled(False)

def gemm_1024(dt):
    a, b = torch.randn(1024, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt)
    return lambda: torch.matmul(a, b)

def gemm_sd(dt):
    a, w = torch.randn(4096, 320, dtype=dt), torch.randn(1280, 320, dtype=dt)
    return lambda: torch.matmul(a, w.t())

def conv(dt):
    x, w, b = (torch.randn(*s, dtype=dt) for s in ((2, 320, 64, 64), (320, 320, 3, 3), (320,)))
    return lambda: F.conv2d(x, w, b, padding=1)

def attention(dt):
    q, k, v = (torch.randn(1, 8, 4096, 40, dtype=dt) for _ in range(3))
    return lambda: F.scaled_dot_product_attention(q, k, v)

makers = {"gemm_1024": gemm_1024, "gemm_sd": gemm_sd, "conv": conv, "attention": attention}
built = {}
print("ready", torch.__version__, torch.get_num_threads(), flush=True)
for line in sys.stdin:
    name, runs = line.split()
    base, dt = (name[:-5], torch.bfloat16) if name.endswith("_bf16") else (name, torch.float32)
    if base not in makers:
        print("none", flush=True)
        continue
    if name not in built:
        built[name] = makers[base](dt)
    f = built[name]
    f()
    times = []
    for _ in range(int(runs)):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    print(" ".join(map(str, times)), flush=True)
"#;

/// A running PyTorch worker.
struct Torch {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Torch {
    /// Starts the worker, or says why PyTorch cannot be used.
    fn start(threads: usize) -> Result<(Self, String), String> {
        let python = std::env::var("SDKIT_BENCH_PYTHON").unwrap_or_else(|_| "python3".to_owned());
        let mut child = Command::new(&python)
            .args(["-c", TORCH_WORKER, &threads.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {python}: {e}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("no pipes to the worker".to_owned());
        };
        let mut torch = Torch {
            child,
            stdin,
            stdout: BufReader::new(stdout),
        };
        let hello = torch.line().map_err(|e| format!("{python}: {e}"))?;
        match hello.strip_prefix("ready ") {
            Some(version) => Ok((torch, version.to_owned())),
            None if hello.is_empty() => Err(format!("{python} exited without starting")),
            None => Err(format!("{python}: torch {hello}")),
        }
    }

    fn line(&mut self) -> Result<String, String> {
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        Ok(line.trim().to_owned())
    }

    /// Seconds of `runs` timed runs of `name` after a warm-up run, or `None`
    /// when the worker lacks the case.
    fn time(&mut self, name: &str, runs: usize) -> Result<Option<Vec<f64>>, String> {
        writeln!(self.stdin, "{name} {runs}").map_err(|e| e.to_string())?;
        let reply = self.line()?;
        if reply == "none" {
            return Ok(None);
        }
        let times: Vec<f64> = reply
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map_err(|_| format!("unexpected reply {reply:?}"))?;
        if times.len() != runs {
            return Err(format!("unexpected reply {reply:?}"));
        }
        Ok(Some(times))
    }
}

impl Drop for Torch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Median and minimum of some timings.
fn stats(mut times: Vec<f64>) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[0])
}

fn timed(f: &mut dyn FnMut()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

fn main() {
    // rayon's own rule, so both sides get the same count.
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    println!(
        "cpu_ops: {threads} threads, median (and min) of {RUNS} runs in {ROUNDS} blocks, each after a warm-up run"
    );
    let mut torch = match Torch::start(threads) {
        Ok((torch, version)) => {
            println!("PyTorch {version}, alternating with sdkit in blocks");
            Some(torch)
        }
        Err(why) => {
            println!("PyTorch comparison skipped: {why}");
            None
        }
    };
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mut cases = vec![
        gemm_case("gemm_1024", 1024, 1024, 1024, false, Products::F32),
        gemm_case("gemm_sd", 4096, 1280, 320, true, Products::F32),
        conv_case("conv", Products::F32),
        attention_case("attention", Products::F32),
    ];
    // bf16 rows where the CPU has AMX tiles (PyTorch's side: its bf16 path).
    if sdkit_compute::backend::cpu::amx::available() {
        let b = Products::Bf16;
        cases.extend([
            gemm_case("gemm_1024_bf16", 1024, 1024, 1024, false, b),
            gemm_case("gemm_sd_bf16", 4096, 1280, 320, true, b),
            conv_case("conv_bf16", b),
            attention_case("attention_bf16", b),
        ]);
    }
    let gflops = |flops: f64, secs: f64| flops / secs / 1e9;
    for mut case in cases {
        if !filters.is_empty() && !filters.iter().any(|f| case.name.contains(f.as_str())) {
            continue;
        }
        let mut ours = Vec::with_capacity(RUNS);
        let mut theirs = Vec::with_capacity(RUNS);
        for _ in 0..ROUNDS {
            timed(&mut case.run);
            ours.extend((0..RUNS_PER_ROUND).map(|_| timed(&mut case.run)));
            let Some(worker) = torch.as_mut() else {
                continue;
            };
            std::thread::sleep(SETTLE);
            match worker.time(case.name, RUNS_PER_ROUND) {
                Ok(times) => theirs.extend(times.into_iter().flatten()),
                Err(e) => {
                    println!("PyTorch worker failed ({e}); continuing without it");
                    torch = None;
                }
            }
            std::thread::sleep(SETTLE);
        }
        let (med, min) = stats(ours);
        println!(
            "{:<10} sdkit {:>7.1} GFLOP/s (min-time {:>6.1}) {:>8.2} ms   {}",
            case.name,
            gflops(case.flops, med),
            gflops(case.flops, min),
            med * 1e3,
            case.what
        );
        if theirs.len() == RUNS {
            let (tmed, tmin) = stats(theirs);
            println!(
                "{:<10} torch {:>7.1} GFLOP/s (min-time {:>6.1}) {:>8.2} ms   sdkit/torch {:.2}x (by min-time {:.2}x)",
                "",
                gflops(case.flops, tmed),
                gflops(case.flops, tmin),
                tmed * 1e3,
                tmed / med,
                tmin / min
            );
        }
    }
}
