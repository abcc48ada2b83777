//! What the adapter itself can reach through wgpu, measured: memory read
//! bandwidth, f32 and f16 FMA rates, and cooperative-matrix (tensor core)
//! rates with fragments held in registers, loaded from workgroup memory
//! (at the row strides the GEMM's staged tiles use, and padded) and
//! loaded from a buffer. `sdkit devices --probe` prints them.
//!
//! The kernels' speed is only meaningful against these ceilings: a GEMM
//! at 18 TFLOP/s is a kernel problem when fragments in registers reach
//! 600 and a platform limit when they reach 25. The workgroup rows say
//! whether fragment loads from unpadded tiles conflict on memory banks.
//!
//! Every probe checks its result against the exact value its arithmetic
//! gives (all inputs and partial sums are exact in f16/f32), so a probe
//! that the driver miscompiles or skips reports an error, not a rate.

use super::{codegen::Coop, f32_to_f16_bits, WgpuBackend, WgpuError};
use std::fmt::Write;

/// How much work each probe does.
#[derive(Clone, Debug)]
pub struct ProbeSize {
    /// Workgroups per dispatch (of the compute and fragment probes).
    pub workgroups: u32,
    /// Loop trips per thread or subgroup.
    pub iters: u32,
    /// Bytes the bandwidth probe reads (capped by the binding limit).
    pub read_bytes: u64,
    /// Dispatches repeat in one submission until it takes this long.
    pub min_secs: f64,
}

impl ProbeSize {
    /// Enough to fill a large GPU and time it well (~1 s in all).
    pub fn full() -> Self {
        ProbeSize {
            workgroups: 2048,
            iters: 256,
            read_bytes: 256 << 20,
            min_secs: 0.05,
        }
    }

    /// A smoke test for software adapters (lavapipe) and tests.
    pub fn quick() -> Self {
        ProbeSize {
            workgroups: 4,
            iters: 4,
            read_bytes: 1 << 20,
            min_secs: 0.0,
        }
    }
}

/// One measured rate.
#[derive(Clone, Debug)]
pub struct ProbeResult {
    pub name: String,
    /// Per second, in `unit`s.
    pub rate: f64,
    /// "TFLOP/s" or "GB/s".
    pub unit: &'static str,
    /// Time of one dispatch.
    pub seconds: f64,
}

impl std::fmt::Display for ProbeResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Three significant digits from a GPU's hundreds of TFLOP/s down
        // to a software adapter's hundredths.
        let digits = match self.rate {
            r if r >= 100.0 => 0,
            r if r >= 10.0 => 1,
            r if r >= 1.0 => 2,
            _ => 3,
        };
        write!(
            f,
            "{}: {:.*} {} ({:.3} ms per dispatch)",
            self.name,
            digits,
            self.rate,
            self.unit,
            self.seconds * 1e3
        )
    }
}

/// Subgroups per fragment-probe workgroup, as in the GEMM's smaller
/// tilings.
const SUBGROUPS: usize = 4;
/// Value of every fragment element: 1/16, so every product and partial
/// sum is exact.
const FRAGMENT_VALUE: f32 = 0.0625;
/// FMA probes: accumulators per thread (independent chains, enough to
/// cover the FMA latency) and the addend per trip.
const CHAINS: usize = 8;
const ADDEND: f32 = 0.0625;

/// Where the fragment probe's loop gets its operands.
#[derive(Clone, Copy, Debug)]
enum Fragments {
    /// Loaded once before the loop: the multiply-add rate alone.
    Registers,
    /// Loaded every trip from workgroup memory, rows `a`/`b` elements
    /// apart for the A/B tiles.
    Workgroup { a: usize, b: usize },
    /// Loaded every trip from f16 buffers (small: cache-resident).
    Buffer { a: usize, b: usize },
}

impl WgpuBackend {
    /// Measures this adapter's ceilings (see the module doc). Fragment
    /// probes run where the backend has cooperative matrices (emulated
    /// ones too, as a check of the probes themselves), f16 where it has
    /// SHADER_F16.
    pub fn probe(&self, size: &ProbeSize) -> Result<Vec<ProbeResult>, WgpuError> {
        let mut out = vec![self.probe_read(size)?, self.probe_fma(size, false)?];
        if self.f16_weights {
            out.push(self.probe_fma(size, true)?);
        }
        if let Some(c) = self.coop {
            let t = c.tile as usize;
            // The GEMM's staged tiles: A rows are the depth step (2 tiles),
            // B rows the workgroup's columns (8 tiles); padded by 8 halves
            // (16 bytes), which shifts consecutive rows across banks.
            let (a, b) = (2 * t, 8 * t);
            for f in [
                Fragments::Registers,
                Fragments::Workgroup { a, b },
                Fragments::Workgroup { a: a + 8, b: b + 8 },
                Fragments::Buffer { a, b },
            ] {
                out.push(self.probe_fragments(size, c, f)?);
            }
        }
        Ok(out)
    }

    fn probe_read(&self, size: &ProbeSize) -> Result<ProbeResult, WgpuError> {
        const THREADS: u64 = 256;
        const PER: u64 = 16;
        let cap = self.binding_limit().min(self.limits.max_buffer_size);
        let per_group = THREADS * PER * 16;
        let groups = (size.read_bytes.min(cap) / per_group).clamp(1, 65535);
        let bytes = groups * per_group;
        let src = format!(
            "@group(0) @binding(0) var<storage, read_write> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@compute @workgroup_size({THREADS})
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    let threads = {total}u;
    var acc = vec4<f32>(0.0);
    for (var i = 0u; i < {PER}u; i++) {{ acc = acc + src[gid.x + i * threads]; }}
    dst[gid.x] = acc.x + acc.y + acc.z + acc.w;
}}
",
            total = groups * THREADS
        );
        let ones: Vec<u8> = (0..bytes / 4).flat_map(|_| 1f32.to_le_bytes()).collect();
        let input = self.probe_buffer(&ones, "probe read");
        let out = self.probe_buffer(&vec![0; (groups * THREADS * 4) as usize], "probe out");
        let name = "memory read";
        let secs = self.probe_time(name, &src, &[&input, &out], [groups as u32, 1, 1], size)?;
        self.probe_check(name, &out, 4.0 * PER as f32)?;
        Ok(ProbeResult {
            name: name.into(),
            rate: bytes as f64 / secs / 1e9,
            unit: "GB/s",
            seconds: secs,
        })
    }

    /// `CHAINS` vec4 chains of x = x·m + c per thread, m = 1 and c =
    /// [`ADDEND`] read from a buffer (so nothing folds).
    fn probe_fma(&self, size: &ProbeSize, half: bool) -> Result<ProbeResult, WgpuError> {
        const THREADS: u32 = 256;
        let s = if half { "f16" } else { "f32" };
        let mut decl = String::new();
        let mut step = String::new();
        let mut sum = String::from("0.0");
        for i in 0..CHAINS {
            let _ = writeln!(decl, "    var x{i} = vec4<{s}>({s}({i}) + seed);");
            let _ = writeln!(step, "        x{i} = fma(x{i}, m, c);");
            let _ = write!(sum, " + f32(x{i}.x + x{i}.y + x{i}.z + x{i}.w)");
        }
        let src = format!(
            "{enable}@group(0) @binding(0) var<storage, read_write> params: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@compute @workgroup_size({THREADS})
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    let m = vec4<{s}>({s}(params[0]));
    let c = vec4<{s}>({s}(params[1]));
    let seed = {s}(params[2]);
{decl}    for (var it = 0u; it < {iters}u; it++) {{
{step}    }}
    dst[gid.x] = {sum};
}}
",
            enable = if half { "enable f16;\n" } else { "" },
            iters = size.iters,
        );
        let params: Vec<u8> = [1.0f32, ADDEND, 0.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let params = self.probe_buffer(&params, "probe params");
        let threads = u64::from(size.workgroups) * u64::from(THREADS);
        let out = self.probe_buffer(&vec![0; threads as usize * 4], "probe out");
        let name = if half { "f16 FMA" } else { "f32 FMA" };
        let secs = self.probe_time(name, &src, &[&params, &out], [size.workgroups, 1, 1], size)?;
        // Chain i ends at i + iters·c in each of its 4 lanes (exact: below
        // 2^11·c for the f16 sizes used).
        let chains = CHAINS as f32;
        let expect = 4.0 * (chains * (chains - 1.0) / 2.0 + chains * size.iters as f32 * ADDEND);
        self.probe_check(name, &out, expect)?;
        let flops = threads as f64 * f64::from(size.iters) * (CHAINS * 4 * 2) as f64;
        Ok(ProbeResult {
            name: name.into(),
            rate: flops / secs / 1e12,
            unit: "TFLOP/s",
            seconds: secs,
        })
    }

    /// Each subgroup multiplies 2 A fragments by 4 B fragments into 8 f32
    /// accumulators every trip (the inner step of a GEMM subgroup owning
    /// 32×64 outputs), with the operands where `f` says.
    fn probe_fragments(
        &self,
        size: &ProbeSize,
        c: Coop,
        f: Fragments,
    ) -> Result<ProbeResult, WgpuError> {
        let (t, lanes) = (c.tile as usize, c.subgroup as usize);
        let threads = SUBGROUPS * lanes;
        let (fa, fb) = (2, 4);
        // A: 4 row tiles (two per subgroup row) × 2 depth tiles; B: 2
        // depth tiles × 8 column tiles (four per subgroup column).
        let (sa, sb) = match f {
            Fragments::Registers => (2 * t, 8 * t),
            Fragments::Workgroup { a, b } | Fragments::Buffer { a, b } => (a, b),
        };
        let (a_len, b_len) = (4 * t * sa, 2 * t * sb);
        let (ta, tb) = match f {
            Fragments::Buffer { .. } => ("ga", "gb"),
            _ => ("As", "Bs"),
        };
        let ty = |role: &str, s: &str| format!("coop_mat{t}x{t}<{s}, {role}>");
        let mut loads = String::new();
        for i in 0..fa {
            let _ = writeln!(
                loads,
                "let a{i} = coopLoadT<{}>(&{ta}[(r0 + {}u) * {sa}u + kk], {sa}u);",
                ty("A", "f16"),
                i * t
            );
        }
        for j in 0..fb {
            let _ = writeln!(
                loads,
                "let b{j} = coopLoadT<{}>(&{tb}[kk * {sb}u + c0 + {}u], {sb}u);",
                ty("B", "f16"),
                j * t
            );
        }
        let mut decl = String::new();
        let mut mac = String::new();
        let mut store = String::new();
        for i in 0..fa {
            for j in 0..fb {
                let _ = writeln!(decl, "    var c{i}_{j} = {}();", ty("C", "f32"));
                let _ = writeln!(
                    mac,
                    "        c{i}_{j} = coopMultiplyAdd(a{i}, b{j}, c{i}_{j});"
                );
                let _ = writeln!(
                    store,
                    "    coopStoreT(c{i}_{j}, &Cs[sg * {tt}u], {t}u);
    workgroupBarrier();
    for (var e = lane; e < {tt}u; e += {lanes}u) {{ sum = sum + Cs[sg * {tt}u + e]; }}
    workgroupBarrier();",
                    tt = t * t
                );
            }
        }
        let indent =
            |s: &str, by: &str| -> String { s.lines().map(|l| format!("{by}{l}\n")).collect() };
        let (before, inside) = match f {
            Fragments::Registers => (indent(&loads, "    "), String::new()),
            _ => (String::new(), indent(&loads, "        ")),
        };
        let fill = |name: &str, len: usize| {
            format!(
                "    for (var e = tid; e < {len}u; e += {threads}u) {{ {name}[e] = f16(params[0]); }}\n"
            )
        };
        let (arrays, fills) = match f {
            Fragments::Buffer { .. } => (
                "@group(0) @binding(2) var<storage, read_write> ga: array<f16>;
@group(0) @binding(3) var<storage, read_write> gb: array<f16>;
"
                .to_string(),
                String::new(),
            ),
            _ => (
                format!(
                    "var<workgroup> As: array<f16, {a_len}>;\nvar<workgroup> Bs: array<f16, {b_len}>;\n"
                ),
                fill("As", a_len) + &fill("Bs", b_len),
            ),
        };
        let iters = size.iters;
        let src = format!(
            "enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read_write> params: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
{arrays}var<workgroup> Cs: array<f32, {cs}>;
@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32, @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {{
{fills}    workgroupBarrier();
    let r0 = (sg / 2u) * {rows}u;
    let c0 = (sg % 2u) * {cols}u;
    var kk = 0u;
{before}{decl}    for (var it = 0u; it < {iters}u; it++) {{
        kk = (it % 2u) * {t}u;
{inside}{mac}    }}
    var sum = 0.0;
{store}
    dst[wg.x * {threads}u + tid] = sum;
}}
",
            cs = SUBGROUPS * t * t,
            rows = fa * t,
            cols = fb * t,
        );
        let src = if c.emulated {
            super::emulate::emulate(&src, t, lanes).map_err(|e| WgpuError::Probe {
                probe: "fragments".into(),
                message: e,
            })?
        } else {
            src
        };
        let params = self.probe_buffer(&FRAGMENT_VALUE.to_le_bytes(), "probe params");
        let total = size.workgroups as usize * threads;
        let out = self.probe_buffer(&vec![0; total * 4], "probe out");
        let half = |len: usize| -> Vec<u8> {
            let v = f32_to_f16_bits(FRAGMENT_VALUE).to_le_bytes();
            // Whole 4-byte words.
            (0..len.div_ceil(2) * 2).flat_map(|_| v).collect()
        };
        let (ga, gb) = (
            self.probe_buffer(&half(a_len), "probe A"),
            self.probe_buffer(&half(b_len), "probe B"),
        );
        let buffers: Vec<&wgpu::Buffer> = match f {
            Fragments::Buffer { .. } => vec![&params, &out, &ga, &gb],
            _ => vec![&params, &out],
        };
        let name = match f {
            Fragments::Registers => format!("{t}x{t} fragments in registers"),
            Fragments::Workgroup { a, b } => {
                format!("{t}x{t} fragments from workgroup memory, rows {a}/{b} apart")
            }
            Fragments::Buffer { a, b } => {
                format!("{t}x{t} fragments from a buffer, rows {a}/{b} apart")
            }
        };
        let secs = self.probe_time(&name, &src, &buffers, [size.workgroups, 1, 1], size)?;
        // Every product adds T·v² to each element; a lane sums T²/lanes
        // elements of each of the 8 accumulators.
        let v = FRAGMENT_VALUE;
        let per_element = iters as f32 * t as f32 * v * v;
        let expect = (fa * fb) as f32 * (t * t / lanes) as f32 * per_element;
        self.probe_check(&name, &out, expect)?;
        let flops = (size.workgroups as usize * SUBGROUPS * fa * fb * 2 * t * t * t) as f64
            * f64::from(iters);
        Ok(ProbeResult {
            name,
            rate: flops / secs / 1e12,
            unit: "TFLOP/s",
            seconds: secs,
        })
    }

    /// A storage buffer holding `bytes` (padded to 4).
    fn probe_buffer(&self, bytes: &[u8], label: &str) -> wgpu::Buffer {
        let size = (bytes.len() as u64).div_ceil(4).max(1) * 4;
        let b = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: super::STORAGE,
            mapped_at_creation: false,
        });
        let mut padded = bytes.to_vec();
        padded.resize(size as usize, 0);
        self.queue.write_buffer(&b, 0, &padded);
        b
    }

    /// Seconds per dispatch of `src` over `buffers`: one warm-up, then
    /// dispatches repeated in one submission until it lasts
    /// `size.min_secs`, best of two such submissions.
    fn probe_time(
        &self,
        name: &str,
        src: &str,
        buffers: &[&wgpu::Buffer],
        groups: [u32; 3],
        size: &ProbeSize,
    ) -> Result<f64, WgpuError> {
        let err = |message: String| WgpuError::Probe {
            probe: name.to_string(),
            message,
        };
        let access = vec![false; buffers.len()];
        let pipeline = self.pipeline(src, &access).map_err(err)?;
        let layout = self.layout(&access);
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.as_entire_binding(),
            })
            .collect();
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout.0,
            entries: &entries,
        });
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let passes = [(pipeline, std::sync::Arc::new(group), groups)];
        let run = |reps: u32| self.time_passes(&passes, reps as usize);
        run(1)?;
        let mut reps = 1u32;
        let mut took = run(reps)?;
        while took < size.min_secs && reps < 1 << 14 {
            let want = (size.min_secs / took.max(1e-6) * f64::from(reps) * 1.2).ceil();
            reps = (want as u32).clamp(reps * 2, 1 << 14);
            took = run(reps)?;
        }
        let best = took.min(run(reps)?);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(err(e.to_string()));
        }
        Ok(best / f64::from(reps))
    }

    /// Every f32 of `buf` equals `expect`, else an error naming the first
    /// that does not.
    fn probe_check(&self, name: &str, buf: &wgpu::Buffer, expect: f32) -> Result<(), WgpuError> {
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("probe readback"),
            size: buf.size(),
            usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::MAP_READ,
            mapped_at_creation: false,
        });
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        encoder.copy_buffer_to_buffer(buf, 0, &staging, 0, buf.size());
        self.queue.submit([encoder.finish()]);
        let slice = staging.slice(..);
        super::map_for_reading(&self.device, &slice)?;
        let wrong = {
            let bytes = slice
                .get_mapped_range()
                .map_err(|e| WgpuError::Lost(e.to_string()))?;
            bytes
                .chunks_exact(4)
                .map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .enumerate()
                .find(|&(_, v)| v != expect)
        };
        staging.unmap();
        match wrong {
            None => Ok(()),
            Some((i, v)) => Err(WgpuError::Probe {
                probe: name.to_string(),
                message: format!("output {i} is {v}, expected {expect}"),
            }),
        }
    }
}
