//! A program prepared on the device ([`Prepared`]): its buffers, bind
//! groups and streamed weights, replayed per run, profiled and timed.

use super::*;
use crate::plan::View;

/// The streamed weights of a prepared program.
pub(super) struct Stream {
    pub(super) arena: wgpu::Buffer,
    pub(super) staging: wgpu::Buffer,
    /// Per dispatch: (staging offset, arena offset, bytes) copied before it.
    pub(super) copies: Vec<Vec<(u64, u64, u64)>>,
    pub(super) bytes_per_run: u64,
}

/// A kernel's passes: one, or a split-K product and its sum.
pub(super) type Dispatch = Vec<(Arc<wgpu::ComputePipeline>, Arc<wgpu::BindGroup>, [u32; 3])>;

/// A Program made resident: weights uploaded, pipelines and bind groups
/// built. Each [`Prepared::run`] uploads the inputs, records every
/// dispatch in one compute pass and reads back the outputs.
pub struct Prepared<'a> {
    pub(super) backend: &'a WgpuBackend,
    pub(super) prog: &'a Program,
    /// Taken back into the backend's pool on drop.
    pub(super) arena: Option<Arc<wgpu::Buffer>>,
    /// Split-K partial sums (pooled too).
    pub(super) scratch: Option<Arc<wgpu::Buffer>>,
    pub(super) external: HashMap<u32, Arc<wgpu::Buffer>>,
    pub(super) inputs: Vec<(u32, String, usize)>,
    /// Whether each input holds a value from an earlier run (which a
    /// [`Prepared::run_carried`] may then leave out).
    pub(super) filled: Vec<std::sync::atomic::AtomicBool>,
    /// One mappable buffer per output, with what it holds.
    pub(super) readback: Vec<Readback>,
    pub(super) dispatches: Vec<Dispatch>,
    pub(super) stream: Option<Stream>,
    pub(super) residency: Option<ResidencyPlan>,
    pub(super) step: schedule::UseStep,
    /// What it adds to the backend's live bytes while it exists.
    pub(super) live_bytes: u64,
}

/// An output's readback: the part of its buffer the view covers
/// ([`super::read_range`]), copied into `buffer` each run it is read.
pub(super) struct Readback {
    pub(super) buffer: wgpu::Buffer,
    /// The range's first element and its bytes as stored.
    pub(super) first: usize,
    pub(super) bytes: u64,
    pub(super) half: bool,
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
    /// How many outputs the program has.
    pub fn outputs(&self) -> usize {
        self.prog.outputs.len()
    }

    /// Runs with the inputs in `bind` (weights there are ignored: they
    /// were uploaded by `prepare`).
    pub fn run(&self, bind: &Bindings) -> Result<Vec<Array>, WgpuError> {
        let all: Vec<usize> = (0..self.outputs()).collect();
        let outs = self.run_carried(bind, &[], &all)?;
        Ok(outs.into_iter().flatten().collect())
    }

    /// Runs with the inputs in `bind`, reading back only the outputs in
    /// `read` (None for the others), and leaves output `o` of each `(o,
    /// name)` in `carry` on the device as input `name` of the next run:
    /// a sampling loop's latent stays on the device between steps. An
    /// input `bind` leaves out keeps its value from the run before (given
    /// or carried): inputs fixed for a loop are uploaded once.
    pub fn run_carried(
        &self,
        bind: &Bindings,
        carry: &[(usize, &str)],
        read: &[usize],
    ) -> Result<Vec<Option<Array>>, WgpuError> {
        use std::sync::atomic::Ordering::Relaxed;
        let dev = &self.backend.device;
        let queue = &self.backend.queue;
        // Everything that can be refused is checked before the error
        // scope opens, so no early return leaves it open.
        let mut uploads = Vec::new();
        for ((buf, name, len), filled) in self.inputs.iter().zip(&self.filled) {
            match bind.inputs.get(name) {
                Some(data) => {
                    BindError::check_len(name, data.len(), *len)?;
                    uploads.push((*buf, data));
                }
                None if filled.load(Relaxed) => {}
                None => return Err(BindError::MissingInput(name.clone()).into()),
            }
        }
        // (source, offset, input index, bytes) of each carried output.
        let mut copies = Vec::new();
        for &(o, name) in carry {
            let v = self
                .prog
                .outputs
                .get(o)
                .ok_or_else(|| BindError::MissingInput(format!("output {o}")))?;
            let (src, off) = self.output_buffer(v)?;
            let b = self.prog.buffer(v.buffer);
            let Some(i) = self.inputs.iter().position(|(_, n, _)| n == name) else {
                return Err(BindError::MissingInput(name.to_string()).into());
            };
            let len = self.inputs[i].2;
            let dense = v.is_contiguous() && v.offset == 0 && v.numel() == b.len;
            if !dense || len != b.len || matches!(b.kind, BufferKind::Weight(_)) {
                return Err(WgpuError::Validation(format!(
                    "output {o} ({:?}) cannot be carried into input {name} ({len} elements)",
                    v.shape
                )));
            }
            let bytes = self
                .backend
                .stored_bytes(b.len, self.backend.f16_activations);
            copies.push((src, off, i, bytes));
        }
        let mut reads = Vec::new();
        for &o in read {
            let v = self
                .prog
                .outputs
                .get(o)
                .ok_or_else(|| BindError::MissingInput(format!("output {o}")))?;
            let r = &self.readback[o];
            let (buf, off) = self.output_buffer(v)?;
            let elem = if r.half { 2 } else { 4 };
            reads.push(((buf, off + r.first as u64 * elem), &r.buffer, r.bytes));
        }
        let validation = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        for (buf, data) in uploads {
            if let Some(b) = self.external.get(&buf) {
                queue.write_buffer(b, 0, &encode(data, self.backend.f16_activations));
            }
        }
        for filled in &self.filled {
            // Given now, or kept from before.
            filled.store(true, Relaxed);
        }
        let mut encoder =
            dev.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        match crate::backend::KernelTimes::from_env() {
            Some(mut times) => {
                // Each kernel alone: submitted and waited for.
                queue.submit([encoder.finish()]);
                self.profiled(&mut times)?;
                times.print();
                encoder =
                    dev.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            }
            None => self.record(&mut encoder, 1),
        }
        // Read back the outputs' ranges (their views applied after),
        // before any carry: an output may be a carried input itself (a
        // sampler's history passed on), which its carry overwrites.
        for ((src, off), st, bytes) in reads {
            if bytes > 0 {
                encoder.copy_buffer_to_buffer(src, off, st, 0, bytes);
            }
        }
        // Carried outputs are copied into their inputs' buffers after
        // every dispatch of this run has read them.
        for (src, off, i, bytes) in copies {
            if let Some(dst) = self.external.get(&self.inputs[i].0) {
                encoder.copy_buffer_to_buffer(src, off, dst, 0, bytes);
            }
        }
        queue.submit([encoder.finish()]);
        let outs = self.read_back(read);
        // The scope closes on every path, the readbacks' errors after.
        if let Some(e) = pollster::block_on(validation.pop()) {
            return Err(WgpuError::Validation(e.to_string()));
        }
        outs
    }

    /// The outputs in `read`, from their readback buffers (filled by the
    /// run just submitted); None for the others.
    fn read_back(&self, read: &[usize]) -> Result<Vec<Option<Array>>, WgpuError> {
        let mut outs: Vec<Option<Array>> = vec![None; self.prog.outputs.len()];
        for &o in read {
            let (v, r) = (&self.prog.outputs[o], &self.readback[o]);
            let (st, half) = (&r.buffer, r.half);
            // The readback starts at the range's first element.
            let local = View {
                offset: v.offset - r.first,
                ..v.clone()
            };
            let slice = st.slice(..);
            map_for_reading(&self.backend.device, &slice)?;
            // Unmapped on every path: the buffer is reused next run.
            let data = slice.get_mapped_range().map(|bytes| decode(&bytes, half));
            st.unmap();
            let data = data.map_err(|e| WgpuError::Lost(e.to_string()))?;
            self.backend
                .downloaded
                .fetch_add(st.size(), std::sync::atomic::Ordering::Relaxed);
            outs[o] = Some(Array::new(v.shape.clone(), read_view(&local, &data)));
        }
        Ok(outs)
    }

    /// The buffer and byte offset output `v`'s buffer starts at.
    fn output_buffer(&self, v: &View) -> Result<(&wgpu::Buffer, u64), WgpuError> {
        let b = self.prog.buffer(v.buffer);
        match b.kind {
            BufferKind::Arena => match &self.arena {
                Some(a) => Ok((a.as_ref(), b.offset as u64 * 4)),
                None => Err(BindError::MissingInput("the arena".into()).into()),
            },
            _ => match self.external.get(&v.buffer.0) {
                Some(e) => Ok((e.as_ref(), 0)),
                None => Err(BindError::MissingInput(format!("buffer b{}", v.buffer.0)).into()),
            },
        }
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

    /// Runs each dispatch in its own submission, waited for, adding its
    /// wall time to `times` (`SDKIT_PROFILE`).
    fn profiled(&self, times: &mut crate::backend::KernelTimes) -> Result<(), WgpuError> {
        for (i, kernel) in (0..self.dispatches.len()).zip(self.kernel_ids()) {
            let mut encoder = self
                .backend
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            self.record_range(&mut encoder, i..i + 1);
            times.add(self.prog, kernel, self.backend.submit_timed(encoder)?);
        }
        Ok(())
    }

    /// The kernel of each dispatch, in Program order.
    fn kernel_ids(&self) -> impl Iterator<Item = KernelId> + '_ {
        self.prog.commands.iter().filter_map(|c| match c {
            Command::Dispatch { kernel } => Some(*kernel),
            _ => None,
        })
    }

    /// Records every dispatch `times` times: one compute pass, split where
    /// streamed weights are copied into their slots.
    pub(super) fn record(&self, encoder: &mut wgpu::CommandEncoder, times: usize) {
        for _ in 0..times {
            self.record_range(encoder, 0..self.dispatches.len());
        }
    }

    /// Records dispatches `range` (with their streamed weights' copies).
    fn record_range(&self, encoder: &mut wgpu::CommandEncoder, range: std::ops::Range<usize>) {
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
        for (i, passes) in self
            .dispatches
            .iter()
            .enumerate()
            .skip(range.start)
            .take(range.len())
        {
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

    /// Seconds each dispatch takes alone, in Program order, each replayed
    /// `reps` times in one submission (the wall time of that submission
    /// over `reps`): where a step's time goes, for benchmarks. Streamed
    /// weights are not copied (their slots keep what they hold).
    pub fn profile(&self, reps: usize) -> Result<Vec<(KernelId, f64)>, WgpuError> {
        let mut out = Vec::new();
        for (passes, kernel) in self.dispatches.iter().zip(self.kernel_ids()) {
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
pub(super) type Pass = (Arc<wgpu::ComputePipeline>, Arc<wgpu::BindGroup>, [u32; 3]);

impl WgpuBackend {
    /// Wall seconds of `n` replays of `passes` recorded in one submission
    /// and waited for: with `n` large enough the submission's own cost
    /// vanishes in the kernels' time (profiles and tuning).
    pub(super) fn time_passes(&self, passes: &[Pass], n: usize) -> Result<f64, WgpuError> {
        self.submit_timed(self.record_passes(passes, n))
    }

    /// Wall seconds from submitting `encoder` until the device is idle.
    pub(super) fn submit_timed(&self, encoder: wgpu::CommandEncoder) -> Result<f64, WgpuError> {
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
    pub(super) fn record_passes(&self, passes: &[Pass], n: usize) -> wgpu::CommandEncoder {
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
    pub(super) fn forget_pipelines<'s>(&self, sources: impl Iterator<Item = &'s String>) {
        let mut cache = self
            .pipelines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for s in sources {
            cache.remove(s);
        }
    }
}
