//! Preparing a program on the device: the residency plan applied,
//! weights uploaded (or staged for streaming), every kernel's shader
//! generated, compiled and bound ([`WgpuBackend::prepare_within`]).

use super::*;

impl WgpuBackend {
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
        // One scratch buffer for every split kernel's partial results and
        // every channels-last conv's copy of its input.
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
            if shader.scratch_words().is_some() && total_bindings == max_bindings {
                // No binding left for the scratch: unsplit, no
                // channels-last copy.
                let caps = codegen::Caps {
                    split_k: false,
                    channels_last: false,
                    ..self.caps
                };
                shader = codegen::generate(k, &layouts, &caps).map_err(unsupported)?;
            }
            let access = codegen::read_only_bindings(&layouts, shader.scratch_words().is_some());
            let mut passes = Vec::new();
            for (source, groups) in shader.passes() {
                let pipeline =
                    self.pipeline(source, &access)
                        .map_err(|m| WgpuError::Unsupported {
                            kernel: ki,
                            kind: k.kind.name(),
                            message: m,
                        })?;
                passes.push((pipeline, groups));
            }
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
            if let Some(words) = shader.scratch_words() {
                let scratch = scratch.as_ref().ok_or_else(|| {
                    unsupported("the scratch buffer was not sized for this kernel".into())
                })?;
                entries.push(buffer_entry(
                    entries.len() as u32,
                    scratch,
                    0,
                    words as u64 * 4,
                ));
            }
            let group = Arc::new(self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &self.layout(&access).0,
                entries: &entries,
            }));
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
        // One readback buffer per output, reused every run, as large as
        // the part of its buffer the output's view covers.
        let readback = prog
            .outputs
            .iter()
            .map(|v| {
                let half = self.stores_half(&prog.buffer(v.buffer).kind);
                let (first, len) = read_range(v, half);
                let bytes = self.stored_bytes(len, half);
                let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("readback"),
                    size: bytes.max(4),
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                Readback {
                    buffer,
                    first,
                    bytes,
                    half,
                }
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
            filled: inputs.iter().map(|_| Default::default()).collect(),
            inputs,
            readback,
            dispatches: prepared,
            stream,
            residency: residency.map(|(p, _)| p),
            step,
        })
    }
}
