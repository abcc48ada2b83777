//! The wgpu backend beyond single ops: a prepared Program replays with new
//! inputs and compiles nothing new; a UNet-shaped graph gives the CPU
//! backend's result. Skips, saying so, where no adapter exists.

use sdkit_compute::backend::cpu;
use sdkit_compute::backend::wgpu::{no_adapter, WgpuBackend};
use sdkit_compute::plan::{plan, samples};
use sdkit_compute::tensor::InputKind;
use std::sync::Arc;

fn backend() -> Option<WgpuBackend> {
    match WgpuBackend::new(None) {
        Ok(b) => Some(b),
        Err(e) => {
            no_adapter("wgpu backend tests", e);
            None
        }
    }
}

fn bindings(g: &sdkit_compute::tensor::TensorGraph, salt: u32) -> cpu::Bindings {
    let mut b = cpu::Bindings::default();
    for kind in [InputKind::Weight, InputKind::Activation] {
        for (_, name, shape) in g.inputs(kind) {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n)
                .map(|i| {
                    let x = (i as u32)
                        .wrapping_mul(2_654_435_761)
                        .wrapping_add(salt * 97 + name.len() as u32);
                    (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
                })
                .collect();
            // Weights on the f16 grid, so the f16 storage path is lossless
            // and CPU and GPU see the same numbers.
            let data: Vec<f32> = match kind {
                InputKind::Weight => data
                    .into_iter()
                    .map(|v| {
                        sdkit_compute::weights::f16_to_f32(
                            sdkit_compute::backend::wgpu::f32_to_f16_bits(v),
                        )
                    })
                    .collect(),
                InputKind::Activation => data,
            };
            let data = Arc::new(data);
            match kind {
                InputKind::Weight => b.weights.insert(name.to_string(), data),
                InputKind::Activation => b.inputs.insert(name.to_string(), data),
            };
        }
    }
    b
}

fn nmse(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    num / den.max(1e-30)
}

/// The error this backend's path allows: f32 arithmetic agrees to
/// rounding; cooperative-matrix products round both operands to f16
/// (11 significant bits), as the conformance suite's f16 paths.
fn tolerance(gpu: &WgpuBackend) -> f64 {
    if gpu.coop.is_some() {
        2e-5
    } else {
        1e-9
    }
}

#[test]
fn prepared_program_replays_and_matches_cpu() {
    let Some(gpu) = backend() else { return };
    let g = samples::unet_like_graph(1, 32, 16, 2).expect("builds");
    let prog = plan(&g).expect("plans");
    let first = bindings(&g, 1);
    let prepared = gpu.prepare(&prog, &first).expect("prepares");
    let compiled = gpu.pipelines_compiled();
    for salt in [1, 2] {
        let mut b = bindings(&g, salt);
        // Weights stay as uploaded; only inputs change between steps.
        b.weights = first.weights.clone();
        let got = prepared.run(&b).expect("runs");
        let want = cpu::run(&prog, &b).expect("cpu runs");
        let e = nmse(&got[0].data, &want[0].data);
        assert!(e < tolerance(&gpu), "step {salt}: nmse {e}");
    }
    // Preparing the same Program again compiles nothing new.
    let _again = gpu.prepare(&prog, &first).expect("prepares");
    assert_eq!(gpu.pipelines_compiled(), compiled);
}

/// A dropped program's arena and input buffers serve the next prepare of
/// the same shapes (a VAE's tiles, the next prompt's text encoder), with
/// or without a budget, and the reused buffers give the same outputs.
#[test]
fn dropped_programs_buffers_are_reused() {
    let Some(gpu) = backend() else { return };
    let g = samples::resblock_graph(1, 32, 4, 64).expect("builds");
    let prog = plan(&g).expect("plans");
    let b = bindings(&g, 3);
    let want = gpu.run(&prog, &b).expect("runs")[0].data.clone();
    let created = gpu.buffers_created();
    assert!(created >= 2, "an arena and an input");
    for _ in 0..3 {
        let p = gpu.prepare(&prog, &b).expect("prepares");
        for _ in 0..2 {
            assert_eq!(p.run(&b).expect("runs")[0].data, want);
        }
    }
    assert_eq!(
        gpu.buffers_created(),
        created,
        "a prepare created buffers again"
    );
    let budgeted = sdkit_compute::backend::wgpu::WgpuBackend::with_options(
        &sdkit_compute::backend::wgpu::Options {
            budget: Some(1 << 40),
            ..Default::default()
        },
    )
    .expect("adapter");
    let _ = budgeted.run(&prog, &b).expect("runs");
    let created = budgeted.buffers_created();
    assert_eq!(budgeted.run(&prog, &b).expect("runs")[0].data, want);
    assert_eq!(budgeted.buffers_created(), created);
}

#[test]
fn missing_input_is_a_typed_error() {
    let Some(gpu) = backend() else { return };
    let g = samples::resblock_graph(1, 32, 4, 64).expect("builds");
    let prog = plan(&g).expect("plans");
    let mut b = bindings(&g, 3);
    b.inputs.remove("emb");
    let err = gpu.run(&prog, &b).expect_err("fails");
    assert!(err.to_string().contains("emb"), "{err}");
}

#[test]
fn tensors_past_the_binding_limit_are_split() {
    use sdkit_compute::backend::wgpu::Options;
    // A 64 KiB binding cap splits the large weights and activations of this
    // graph over several bindings, as a 128 MiB cap splits a VAE decoder's
    // activations at 512 px on lavapipe.
    let gpu = match WgpuBackend::with_options(&Options {
        max_binding_bytes: Some(64 * 1024),
        ..Options::default()
    }) {
        Ok(g) => g,
        Err(e) => {
            no_adapter("wgpu binding split test", e);
            return;
        }
    };
    let g = samples::unet_like_graph(1, 32, 16, 2).expect("builds");
    let prog = plan(&g).expect("plans");
    let b = bindings(&g, 5);
    let got = gpu.run(&prog, &b).expect("runs split");
    let want = cpu::run(&prog, &b).expect("cpu runs");
    let e = nmse(&got[0].data, &want[0].data);
    assert!(e < tolerance(&gpu), "nmse {e}");
    assert!(gpu.split_operands() > 0, "nothing was split");
}

#[test]
fn compiled_pipelines_persist_to_the_cache_file() {
    use sdkit_compute::backend::wgpu::Options;
    let dir = tempfile::tempdir().expect("tempdir");
    let open = || {
        WgpuBackend::with_options(&Options {
            pipeline_cache_dir: Some(dir.path().to_path_buf()),
            ..Options::default()
        })
    };
    let gpu = match open() {
        Ok(g) => g,
        Err(e) => {
            no_adapter("pipeline cache test", e);
            return;
        }
    };
    let Some(file) = gpu.pipeline_cache_file().map(std::path::Path::to_path_buf) else {
        eprintln!("skipped: pipeline cache test: the adapter has no PIPELINE_CACHE");
        return;
    };
    let g = samples::resblock_graph(1, 32, 4, 64).expect("builds");
    let prog = plan(&g).expect("plans");
    let b = bindings(&g, 4);
    let first = gpu.run(&prog, &b).expect("runs");
    let bytes = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    assert!(bytes > 0, "{} was not written", file.display());
    drop(gpu);
    // A new device starts from the saved cache and computes the same.
    let again = open().expect("reopens");
    let second = again.run(&prog, &b).expect("runs from the cache");
    assert_eq!(first[0].data, second[0].data);
    // A corrupt file is an empty cache, not an error.
    std::fs::write(&file, b"not a pipeline cache").expect("overwrite");
    let third = open().expect("opens over a corrupt cache");
    let out = third.run(&prog, &b).expect("runs");
    assert_eq!(first[0].data, out[0].data);
}

/// Shaders run without wgpu's runtime checks (`Options::shader_checks`
/// off): index clamps, loop counters, guarded division and zeroed
/// workgroup memory change nothing in a kernel that stays in bounds and
/// writes before it reads, so checked and unchecked runs agree to the bit.
/// An out-of-bounds index would read a clamped element in one and a
/// neighbour in the other. Covers the portable kernels and the
/// cooperative ones (on emulated fragments where the adapter has none).
#[test]
fn unchecked_shaders_match_checked_ones_bit_for_bit() {
    use sdkit_compute::backend::wgpu::Options;
    let g = samples::unet_like_graph(1, 32, 16, 2).expect("builds");
    let prog = plan(&g).expect("plans");
    let b = bindings(&g, 3);
    for coop in [false, true] {
        let run = |shader_checks: bool| {
            let gpu = WgpuBackend::with_options(&Options {
                allow_coopmat: coop,
                emulate_coopmat: coop,
                shader_checks,
                ..Options::default()
            })
            .ok()?;
            if coop && gpu.coop.is_none() {
                eprintln!("skipped: unchecked cooperative kernels: no (emulated) cooperative path on this adapter");
                return None;
            }
            Some(gpu.run(&prog, &b).expect("runs").remove(0).data)
        };
        let (Some(unchecked), Some(checked)) = (run(false), run(true)) else {
            continue;
        };
        let differ = unchecked
            .iter()
            .zip(&checked)
            .filter(|(u, c)| u.to_bits() != c.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "coop {coop}: {differ} of {} values differ",
            checked.len()
        );
    }
}

#[test]
fn probes_measure_the_adapter_and_check_their_results() {
    use sdkit_compute::backend::wgpu::probe::ProbeSize;
    use sdkit_compute::backend::wgpu::Options;
    // Emulated fragments where the adapter has none (lavapipe), so the
    // fragment probes' shaders and expected values are checked here too;
    // poisoned workgroup memory, so a probe that reads a tile it never
    // filled fails its check.
    let gpu = match WgpuBackend::with_options(&Options {
        emulate_coopmat: true,
        poison_workgroup_memory: true,
        ..Options::default()
    }) {
        Ok(g) => g,
        Err(e) => {
            no_adapter("probes", e);
            return;
        }
    };
    let results = gpu
        .probe(&ProbeSize::quick())
        .expect("every probe runs and checks");
    let names: Vec<&str> = results.iter().map(|r| r.name.as_str()).collect();
    assert!(
        names.contains(&"memory read") && names.contains(&"f32 FMA"),
        "{names:?}"
    );
    if gpu.f16_weights {
        assert!(names.contains(&"f16 FMA"), "{names:?}");
    }
    match gpu.coop {
        Some(_) => assert_eq!(
            names.iter().filter(|n| n.contains("fragments")).count(),
            4,
            "{names:?}"
        ),
        None => {
            eprintln!("skipped: fragment probes: no (emulated) cooperative path on this adapter")
        }
    }
    for r in &results {
        assert!(r.rate.is_finite() && r.rate > 0.0, "{r}");
        eprintln!("{r}");
    }
}

/// On cooperative matrices conv weights are stored tap-major: relaid out
/// on upload and on every streamed copy alike, so a model whose weights
/// stream under a budget gives the resident model's result.
#[test]
fn tap_major_conv_weights_match_whether_resident_or_streamed() {
    use sdkit_compute::backend::wgpu::Options;
    let gpu = match WgpuBackend::with_options(&Options {
        emulate_coopmat: true,
        poison_workgroup_memory: true,
        ..Options::default()
    }) {
        Ok(g) => g,
        Err(e) => {
            no_adapter("tap-major weights", e);
            return;
        }
    };
    if gpu.coop.is_none() {
        eprintln!("skipped: tap-major weights: no (emulated) cooperative path on this adapter");
        return;
    }
    let g = samples::unet_like_graph(1, 32, 16, 2).expect("builds");
    let prog = plan(&g).expect("plans");
    let b = bindings(&g, 5);
    let want = cpu::run(&prog, &b).expect("cpu runs");
    let resident = gpu.run(&prog, &b).expect("runs resident");
    let e = nmse(&resident[0].data, &want[0].data);
    assert!(e < tolerance(&gpu), "resident: nmse {e}");
    gpu.free_weights();
    let budget = gpu.activation_bytes(&prog) + gpu.weight_bytes(&prog) / 2;
    let prepared = gpu
        .prepare_within(&prog, &b, Some(budget))
        .expect("prepares under a budget");
    assert!(prepared.streamed_bytes_per_run() > 0, "nothing streamed");
    let streamed = prepared.run(&b).expect("runs streamed");
    let e = nmse(&streamed[0].data, &want[0].data);
    assert!(e < tolerance(&gpu), "streamed: nmse {e}");
}

/// Tuning times every variant of each tensor-core kernel once, keeps the
/// fastest in the cache folder, and a later process runs those variants
/// without measuring again; a damaged file is ignored, not fatal. Every
/// variant computes the same product, so outputs match the CPU's. (One
/// product and one attention: emulated fragments compile slowly.)
#[test]
fn tuned_kernels_persist_and_match_cpu() {
    use sdkit_compute::backend::wgpu::{Options, Tuning};
    use sdkit_compute::tensor::GraphBuilder;
    let dir = tempfile::tempdir().expect("temp dir");
    let open = |tuning| {
        WgpuBackend::with_options(&Options {
            emulate_coopmat: true,
            tuning,
            pipeline_cache_dir: Some(dir.path().to_path_buf()),
            ..Options::default()
        })
    };
    let gpu = match open(Tuning::Measure) {
        Ok(g) => g,
        Err(e) => {
            no_adapter("tuning", e);
            return;
        }
    };
    // A second process, open from the start: it reads no file now and
    // tunes another program after the first has saved.
    let other = open(Tuning::Measure).expect("opens");
    if gpu.coop.is_none() {
        eprintln!("skipped: tuning: no (emulated) cooperative path on this adapter");
        return;
    }
    let gb = GraphBuilder::new();
    let build = || -> Result<_, sdkit_compute::tensor::ShapeError> {
        // Depth 512 over a grid of one or two workgroups: split-K.
        let x = gb.input("x", &[1, 32, 512])?;
        let w = gb.weight("w", &[32, 512])?;
        let h = x.linear(w, None)?;
        let q = h.reshape(&[1, 32, 2, 16])?.permute(&[0, 2, 1, 3])?;
        q.attention(q, q, None, 0.25)
    };
    let y = build().expect("builds");
    let g = gb.finish(&[y]);
    let prog = plan(&g).expect("plans");
    let b = bindings(&g, 7);
    let want = cpu::run(&prog, &b).expect("cpu runs");
    // Progress as kernels are measured: before the first, after each.
    let told = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = Arc::clone(&told);
    gpu.observe_tuning(Some(Arc::new(move |done, of| {
        sink.lock().expect("progress list").push((done, of))
    })));
    let measured = gpu.run(&prog, &b).expect("runs tuned").remove(0).data;
    assert_eq!(
        *told.lock().expect("progress list"),
        [(0, 2), (1, 2), (2, 2)]
    );
    let e = nmse(&measured, &want[0].data);
    assert!(e < tolerance(&gpu), "tuned: nmse {e}");
    let tuned = gpu.tuned_kernels(&prog);
    let kinds: Vec<&str> = tuned.iter().map(|t| t.tuned.kind.as_str()).collect();
    assert_eq!(kinds, ["matmul", "attention"], "{tuned:?}");
    for t in &tuned {
        eprintln!("kernel {}: {}", t.kernel, t.tuned);
        assert!(t.tuned.candidates >= 2, "{t:?}");
        assert_eq!(
            t.tuned.rejected, 0,
            "every variant computes the product: {t:?}"
        );
        assert!(t.tuned.seconds <= t.tuned.default_seconds, "{t:?}");
    }
    assert_eq!(gpu.tuning_counts(), (2, 2));
    let file = gpu.tuning_file().expect("tuning file");
    assert!(file.exists(), "{} not written", file.display());
    drop(gpu);

    // Another process: the file's variants, nothing measured, the same
    // result to the bit.
    let cached = open(Tuning::Cached).expect("reopens");
    let again = cached.run(&prog, &b).expect("runs cached").remove(0).data;
    assert_eq!(cached.tuning_counts(), (0, 2));
    let same = again
        .iter()
        .zip(&measured)
        .all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same, "cached variants give other values");
    let variants = |ts: Vec<sdkit_compute::backend::wgpu::TunedKernel>| {
        ts.into_iter().map(|t| t.tuned.variant).collect::<Vec<_>>()
    };
    assert_eq!(variants(cached.tuned_kernels(&prog)), variants(tuned));
    drop(cached);

    // The file decides: a product edited to run unsplit needs no split-K
    // scratch (scratch sizing follows the tuned variant) and still gives
    // the product.
    let untuned = WgpuBackend::with_options(&Options {
        emulate_coopmat: true,
        ..Options::default()
    })
    .expect("opens");
    assert!(untuned.scratch_bytes(&prog) > 0, "the default splits");
    drop(untuned);
    let mut table: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("reads")).expect("json");
    let tiles = serde_json::json!({
        "sg_rows": 2, "sg_cols": 2, "rows": 32, "cols": 32, "bk": 32, "direct": true
    });
    for (_, k) in table["kernels"].as_object_mut().expect("kernels") {
        if k["kind"] == "matmul" {
            k["variant"]["split_k"] = false.into();
            k["variant"]["tiles"] = tiles.clone();
        }
    }
    std::fs::write(&file, table.to_string()).expect("writes");
    let edited = open(Tuning::Cached).expect("reopens");
    assert_eq!(
        edited.scratch_bytes(&prog),
        0,
        "the edited variant is unsplit"
    );
    let out = edited.run(&prog, &b).expect("runs edited").remove(0).data;
    let e = nmse(&out, &want[0].data);
    assert!(e < tolerance(&edited), "edited: nmse {e}");
    let kinds = edited.tuned_kernels(&prog);
    assert!(
        kinds
            .iter()
            .any(|t| t.tuned.kind == "matmul" && !t.tuned.variant.split_k),
        "{kinds:?}"
    );
    drop(edited);

    // The second process's save keeps what the first tuned.
    let gb2 = GraphBuilder::new();
    let build2 = || -> Result<_, sdkit_compute::tensor::ShapeError> {
        gb2.input("x", &[1, 32, 64])?
            .linear(gb2.weight("w", &[48, 64])?, None)
    };
    let y2 = build2().expect("builds");
    let g2 = gb2.finish(&[y2]);
    let prog2 = plan(&g2).expect("plans");
    let b2 = bindings(&g2, 8);
    let want2 = cpu::run(&prog2, &b2).expect("cpu runs");
    let got2 = other.run(&prog2, &b2).expect("runs").remove(0).data;
    assert!(nmse(&got2, &want2[0].data) < tolerance(&other));
    assert_eq!(other.tuning_counts(), (1, 1));
    drop(other);
    let merged = open(Tuning::Cached).expect("reopens");
    assert_eq!(merged.tuning_counts(), (0, 3), "both processes' kernels");
    drop(merged);

    // A damaged file: defaults, and nothing measured with `Cached`.
    std::fs::write(&file, b"{ not json").expect("damages the file");
    let damaged = open(Tuning::Cached).expect("opens over a damaged file");
    let out = damaged.run(&prog, &b).expect("runs").remove(0).data;
    let e = nmse(&out, &want[0].data);
    assert!(e < tolerance(&damaged), "defaults: nmse {e}");
    assert_eq!(damaged.tuning_counts(), (0, 0));
    assert!(damaged.tuned_kernels(&prog).is_empty());
}

/// GGUF weights stay in their quant blocks on the device and each kernel
/// decodes what it reads: every block type of the reference file
/// (tests/reference/gguf, checked against the `gguf` package), in the
/// f32 and ComfyUI-GGUF's f16 arithmetic, read by a product and by an
/// elementwise kernel, gives the CPU's values, resident and streamed under
/// a budget; the device holds the blocks' bytes, not f16 expansions.
#[test]
fn gguf_weights_stay_quantized_and_match_cpu() {
    use sdkit_compute::backend::wgpu::Options;
    use sdkit_compute::tensor::GraphBuilder;
    use sdkit_compute::weights::{Dequant, SafeTensors, WeightStore};
    let Some(gpu) = backend() else { return };
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/reference/gguf/quants.gguf"
    );
    // The products on cooperative fragments too (emulated where the
    // adapter has none), which stage the decoded weight in workgroup
    // memory.
    let coop = WgpuBackend::with_options(&Options {
        emulate_coopmat: true,
        poison_workgroup_memory: true,
        ..Options::default()
    })
    .expect("the adapter opened above");
    let mut cases = vec![(&gpu, Dequant::F32), (&gpu, Dequant::F16)];
    if coop.coop.is_some() {
        cases.push((&coop, Dequant::F16));
    } else {
        eprintln!("skipped: quantized weights on cooperative fragments: no (emulated) cooperative path on this adapter");
    }
    for (gpu, dequant) in cases {
        let mut file = SafeTensors::open(std::path::Path::new(path)).expect("opens");
        file.set_dequant(dequant);
        let file = Arc::new(file);
        let quantized: Vec<(String, usize, usize)> = file
            .tensors()
            .filter(|t| t.dtype.block().0 > 1)
            .map(|t| {
                let n: usize = t.shape.iter().product();
                let cols = t.dtype.block().0.max(256);
                (t.name.clone(), n / cols, cols)
            })
            .collect();
        assert!(quantized.len() >= 11, "{quantized:?}");
        let mut store = WeightStore::new();
        store.mount(Arc::clone(&file), "", "");
        let g = GraphBuilder::new();
        let gathers = GraphBuilder::new();
        let mut outs = Vec::new();
        let mut gathered = Vec::new();
        let mut bind = cpu::Bindings::default();
        let mut block_bytes = 0u64;
        for (i, (name, rows, cols)) in quantized.iter().enumerate() {
            let shape = file.get(name).expect("tensor").shape.clone();
            let w = g
                .weight(name, &shape)
                .and_then(|w| w.reshape(&[*rows, *cols]))
                .expect("weight");
            let x = g.input(&format!("x{i}"), &[3, *cols]).expect("input");
            outs.push(x.linear(w, None).expect("linear"));
            let one = g.input(&format!("one{i}"), &[1]).expect("input");
            outs.push(w.mul(one).expect("read"));
            // Rows picked by a gather (a text encoder's token table; a
            // program of its own: gathered tables never stream).
            let ids = gathers.input(&format!("ids{i}"), &[3]).expect("input");
            let table = gathers
                .weight(name, &shape)
                .and_then(|w| w.reshape(&[*rows, *cols]))
                .expect("weight");
            gathered.push(table.gather(ids).expect("gather"));
            let ids = vec![(*rows - 1) as f32, 0.0, (*rows / 2) as f32];
            bind.inputs.insert(format!("ids{i}"), Arc::new(ids));
            bind.stored
                .insert(name.clone(), store.stored(name).expect("stored"));
            let x: Vec<f32> = (0..3 * cols)
                .map(|k| ((k * 37 + i * 11) % 101) as f32 / 50.0 - 1.0)
                .collect();
            bind.inputs.insert(format!("x{i}"), Arc::new(x));
            bind.inputs.insert(format!("one{i}"), Arc::new(vec![1.0]));
            block_bytes += (file.raw(name).expect("raw").len() as u64).div_ceil(4) * 4;
        }
        let graph = g.finish(&outs);
        let prog = plan(&graph).expect("plans");
        let want = cpu::run(&prog, &bind).expect("cpu runs");
        let check = |got: &[sdkit_compute::tensor::reference::Array], how: &str| {
            for (o, (a, b)) in got.iter().zip(&want).enumerate() {
                let name = &quantized[o / 2].0;
                if o % 2 == 1 {
                    // The decoded values themselves: the CPU's to the
                    // last bit but for a fused multiply-add.
                    let off = a
                        .data
                        .iter()
                        .zip(&b.data)
                        .filter(|(x, y)| (*x - *y).abs() > 1e-6 * y.abs().max(1e-3))
                        .count();
                    assert_eq!(off, 0, "{how} {dequant:?} {name}: {off} values differ");
                } else {
                    let e = nmse(&a.data, &b.data);
                    assert!(e < tolerance(gpu), "{how} {dequant:?} {name}: nmse {e}");
                }
            }
        };
        gpu.free_weights();
        let before = gpu.bytes_uploaded();
        check(&gpu.run(&prog, &bind).expect("runs"), "resident");
        assert_eq!(
            gpu.bytes_uploaded() - before,
            block_bytes,
            "the device holds the blocks"
        );
        // Under a budget that holds half of them, the rest stream.
        gpu.free_weights();
        let budget = gpu.activation_bytes(&prog) + block_bytes / 2;
        let prepared = gpu
            .prepare_within(&prog, &bind, Some(budget))
            .expect("prepares under a budget");
        assert!(prepared.streamed_bytes_per_run() > 0, "nothing streamed");
        check(&prepared.run(&bind).expect("runs streamed"), "streamed");
        let prog = plan(&gathers.finish(&gathered)).expect("plans");
        let want = cpu::run(&prog, &bind).expect("cpu runs");
        let got = gpu.run(&prog, &bind).expect("runs");
        for (o, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.data.len(), b.data.len());
            let off = a
                .data
                .iter()
                .zip(&b.data)
                .filter(|(x, y)| (*x - *y).abs() > 1e-6 * y.abs().max(1e-3))
                .count();
            let name = &quantized[o].0;
            assert_eq!(off, 0, "gather {dequant:?} {name}: {off} values differ");
        }
    }
    // Expanded at upload instead (the option off): the same values, in
    // twice the bytes of f16 (or four of f32).
    let expand = WgpuBackend::with_options(&Options {
        quantized_weights: false,
        ..Options::default()
    })
    .expect("the adapter opened above");
    let mut file = SafeTensors::open(std::path::Path::new(path)).expect("opens");
    file.set_dequant(Dequant::F32);
    let mut store = WeightStore::new();
    store.mount(Arc::new(file), "", "");
    let g = GraphBuilder::new();
    let y = g
        .input("x", &[2, 256])
        .and_then(|x| x.linear(g.weight("q4_k.weight", &[8, 256])?, None))
        .expect("linear");
    let prog = plan(&g.finish(&[y])).expect("plans");
    let mut bind = cpu::Bindings::default();
    bind.stored.insert(
        "q4_k.weight".into(),
        store.stored("q4_k.weight").expect("stored"),
    );
    bind.inputs.insert(
        "x".into(),
        Arc::new((0..512).map(|i| i as f32 / 512.0).collect()),
    );
    let got = expand.run(&prog, &bind).expect("runs");
    let elem = if expand.f16_weights { 2 } else { 4 };
    assert_eq!(expand.bytes_uploaded(), 8 * 256 * elem);
    let quantized = gpu.run(&prog, &bind).expect("runs");
    let e = nmse(&got[0].data, &quantized[0].data);
    assert!(e < 1e-6, "nmse {e}");
}

/// A GGUF file (v3, no metadata) of one tensor: `shape` in torch order,
/// ggml type `ty`, `data` its blocks.
fn one_tensor_gguf(shape: &[usize], ty: u32, data: &[u8]) -> Vec<u8> {
    let mut out: Vec<u8> = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&1u64.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&1u64.to_le_bytes());
    out.push(b'w');
    out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
    for d in shape.iter().rev() {
        out.extend_from_slice(&(*d as u64).to_le_bytes());
    }
    out.extend_from_slice(&ty.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.resize(out.len().next_multiple_of(32), 0);
    out.extend_from_slice(data);
    out
}

/// Every GGUF block type: (ggml id, elements and bytes per block, byte
/// offsets of its f16 scales).
const BLOCK_TYPES: [(u32, usize, usize, &[usize]); 10] = [
    (8, 32, 34, &[0]),
    (2, 32, 18, &[0]),
    (3, 32, 20, &[0, 2]),
    (6, 32, 22, &[0]),
    (7, 32, 24, &[0, 2]),
    (10, 256, 84, &[80, 82]),
    (11, 256, 110, &[108]),
    (12, 256, 144, &[0, 2]),
    (13, 256, 176, &[0, 2]),
    (14, 256, 210, &[208]),
];

/// Random blocks of one type whose f16 scales are finite and small.
fn random_blocks(ty: usize, blocks: usize, seed: u64) -> Vec<u8> {
    let (_, _, size, scales) = BLOCK_TYPES[ty];
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut out: Vec<u8> = (0..blocks * size).map(|_| next() as u8).collect();
    for b in 0..blocks {
        for &at in scales {
            let v = (next() % 2000) as f32 / 20000.0 - 0.05;
            let h = sdkit_compute::backend::wgpu::f32_to_f16_bits(v).to_le_bytes();
            out[b * size + at..b * size + at + 2].copy_from_slice(&h);
        }
    }
    out
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: 24, ..Default::default() })]

    /// A product whose weight stays quantized on the device gives the
    /// CPU's result, for random blocks of every type, both arithmetics,
    /// and random shapes (rows, whole blocks per row, batch rows).
    #[test]
    fn quantized_products_match_cpu(
        ty in 0usize..10, rows in 1usize..40, blocks in 1usize..3, m in 1usize..20,
        f16_math: bool, seed: u64,
    ) {
        use sdkit_compute::tensor::GraphBuilder;
        use sdkit_compute::weights::{Dequant, SafeTensors, WeightStore};
        let Some(gpu) = backend() else { return Ok(()) };
        let (id, per, _, _) = BLOCK_TYPES[ty];
        let cols = per * blocks;
        let data = random_blocks(ty, rows * blocks, seed);
        let mut file = SafeTensors::from_bytes("w.gguf", one_tensor_gguf(&[rows, cols], id, &data))
            .expect("parses");
        file.set_dequant(if f16_math { Dequant::F16 } else { Dequant::F32 });
        let mut store = WeightStore::new();
        store.mount(Arc::new(file), "", "");
        let g = GraphBuilder::new();
        let y = g
            .input("x", &[m, cols])
            .and_then(|x| x.linear(g.weight("w", &[rows, cols])?, None))
            .expect("linear");
        let prog = plan(&g.finish(&[y])).expect("plans");
        let mut bind = cpu::Bindings::default();
        bind.stored.insert("w".into(), store.stored("w").expect("stored"));
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i as u64 ^ seed).wrapping_mul(2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        bind.inputs.insert("x".into(), Arc::new(x));
        let want = cpu::run(&prog, &bind).expect("cpu runs");
        let before = gpu.bytes_uploaded();
        let got = gpu.run(&prog, &bind).expect("runs");
        proptest::prop_assert_eq!(gpu.bytes_uploaded() - before, (data.len() as u64).div_ceil(4) * 4);
        let e = nmse(&got[0].data, &want[0].data);
        proptest::prop_assert!(e < tolerance(&gpu), "nmse {}", e);
    }
}

/// A small quantized tensor whose row is longer than its file has bytes
/// (4.5 bits an element) is a valid GGUF file, not a truncated one.
#[test]
fn a_quantized_row_longer_than_its_file_parses() {
    use sdkit_compute::weights::SafeTensors;
    let data = random_blocks(1, 16, 7);
    let file = SafeTensors::from_bytes("w.gguf", one_tensor_gguf(&[1, 512], 2, &data))
        .expect("a 1×512 Q4_0 tensor in a 400-byte file parses");
    assert_eq!(file.get("w").expect("tensor").shape, vec![1, 512]);
}

/// What a run reads back is that run's outputs, also where an output is
/// a carried input itself (a sampler's history passed on) that a carry
/// of the same run overwrites: reads come before carries.
#[test]
fn reads_see_the_run_before_its_carries() {
    use sdkit_compute::tensor::GraphBuilder;
    use sdkit_compute::{Bindings, Runtime};
    use std::collections::HashMap;
    let Some(gpu) = backend() else { return };
    let g = GraphBuilder::new();
    let outs = (|| {
        let a = g.input("a", &[16])?;
        Ok::<_, sdkit_compute::tensor::ShapeError>(vec![a.add_scalar(1.0), a])
    })()
    .expect("builds");
    let prog = plan(&g.finish(&outs)).expect("plans");
    let a0: Vec<f32> = (0..16).map(|i| i as f32 * 0.25).collect();
    let rt = Runtime::wgpu(gpu);
    for runtime in [&Runtime::cpu(), &rt] {
        let mut s = runtime
            .prepare(&prog, &Bindings::default())
            .expect("prepares");
        let feed = HashMap::from([("a".to_string(), Arc::new(a0.clone()))]);
        for (run, want) in [(0, 0.0), (1, 1.0)] {
            let f = if run == 0 {
                feed.clone()
            } else {
                HashMap::new()
            };
            let outs = s.run_carried(f, &[(0, "a")], &[0, 1]).expect("runs");
            let (next, this) = (&outs[0], &outs[1]);
            let (next, this) = (next.as_ref().expect("read"), this.as_ref().expect("read"));
            for (i, v) in a0.iter().enumerate() {
                assert_eq!(this.data[i], v + want, "{} run {run}", runtime.describe());
                assert_eq!(next.data[i], v + want + 1.0, "{}", runtime.describe());
            }
        }
    }
}

/// A loop whose state stays on the device: output 0 feeds input `x` of
/// the next run without a download, and only what is read comes back.
/// The CPU session carries the same way; both give the host loop's
/// values.
#[test]
fn carried_outputs_stay_on_the_device_between_runs() {
    use sdkit_compute::tensor::GraphBuilder;
    use sdkit_compute::{Bindings, Runtime};
    use std::collections::HashMap;
    let Some(gpu) = backend() else { return };
    let g = GraphBuilder::new();
    let outs = (|| {
        let x = g.input("x", &[2, 64])?;
        let w = g.weight("w", &[64, 64])?;
        let s = g.input("s", &[1])?;
        let y = x.matmul(w)?.tanh().mul(s)?.add(x)?;
        let z = y.mul(s)?;
        Ok::<_, sdkit_compute::tensor::ShapeError>(vec![y, z])
    })()
    .expect("builds");
    let prog = plan(&g.finish(&outs)).expect("plans");
    let mut bind = Bindings::default();
    let w: Vec<f32> = (0..64 * 64)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 400.0)
        .collect();
    bind.weights.insert("w".into(), Arc::new(w));
    let x0: Vec<f32> = (0..128).map(|i| (i as f32 / 64.0).sin()).collect();
    let feed = |step: usize, first: bool| {
        let mut f = HashMap::new();
        f.insert("s".to_string(), Arc::new(vec![0.5 + step as f32 * 0.1]));
        if first {
            f.insert("x".to_string(), Arc::new(x0.clone()));
        }
        f
    };
    // The host loop: every output read back and fed again.
    let cpu = Runtime::cpu();
    let mut host = cpu.prepare(&prog, &bind).expect("prepares");
    let mut x = x0.clone();
    let mut last = Vec::new();
    for step in 0..4 {
        let mut f = feed(step, false);
        f.insert("x".to_string(), Arc::new(x.clone()));
        let out = host.run(f).expect("runs");
        x = out[0].data.clone();
        last = out[1].data.clone();
    }
    // One more step with the last step's `s`.
    let kept = {
        let mut f = feed(3, false);
        f.insert("x".to_string(), Arc::new(x.clone()));
        host.run(f).expect("runs")[0].data.clone()
    };
    let rt = Runtime::wgpu(gpu);
    for runtime in [&cpu, &rt] {
        let mut s = runtime.prepare(&prog, &bind).expect("prepares");
        let before = runtime.bytes_downloaded();
        for step in 0..3 {
            let outs = s
                .run_carried(feed(step, step == 0), &[(0, "x")], &[])
                .expect("runs");
            assert!(outs.iter().all(Option::is_none));
        }
        assert_eq!(runtime.bytes_downloaded(), before, "nothing read yet");
        let outs = s
            .run_carried(feed(3, false), &[(0, "x")], &[1])
            .expect("runs");
        let z = outs[1].as_ref().expect("read");
        assert!(outs[0].is_none());
        // The CPU replays the host loop's arithmetic exactly; the GPU's
        // tanh and product order differ in the last bits.
        let bound = if runtime.is_cpu() { 0.0 } else { 1e-6 };
        assert!(
            nmse(&z.data, &last) <= bound,
            "{} {:?} {:?}",
            runtime.describe(),
            &z.data[..4],
            &last[..4]
        );
        if !runtime.is_cpu() {
            // Only the one output read came back.
            let read = runtime.bytes_downloaded() - before;
            assert!(read == 128 * 4 || read == 128 * 2, "{read} bytes read");
        }
        // Inputs left out keep their last value: `s` from step 3, `x`
        // carried.
        let outs = s
            .run_carried(HashMap::new(), &[(0, "x")], &[0])
            .expect("runs");
        let y = outs[0].as_ref().expect("read");
        assert!(nmse(&y.data, &kept) <= bound * 10.0, "kept inputs");
        // An output that is not the input's size cannot be carried.
        let wrong = g_mismatch(&mut s);
        assert!(wrong.is_err() || runtime.is_cpu());
        // A refused run leaves the session (and the device's error
        // scopes) as they were: the next run succeeds.
        let mut f = HashMap::new();
        f.insert("s".to_string(), Arc::new(vec![0.5f32]));
        f.insert("x".to_string(), Arc::new(x0.clone()));
        let again = s.run_carried(f, &[], &[0]).expect("runs after a refusal");
        assert!(again[0]
            .as_ref()
            .is_some_and(|y| y.data.iter().all(|v| v.is_finite())));
    }
}

/// Carries output 1 into an input of another size: refused by the GPU
/// session (the CPU's only meets it at the next run's shape check).
fn g_mismatch(s: &mut sdkit_compute::runtime::Session<'_>) -> Result<(), String> {
    let mut f = std::collections::HashMap::new();
    f.insert("s".to_string(), Arc::new(vec![1.0f32]));
    s.run_carried(f, &[(1, "s")], &[])
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Two workgroup stages change when a staged tile is filled, never what
/// is multiplied: products with partial tiles, a conv and a split-K conv
/// give the single-stage kernel's bits (emulated fragments on adapters
/// without cooperative matrices).
#[test]
fn double_buffered_staging_matches_one_stage_bit_for_bit() {
    use sdkit_compute::backend::wgpu::codegen::{self, tilings};
    use sdkit_compute::backend::wgpu::Options;
    use sdkit_compute::tensor::{Conv2dParams, GraphBuilder};
    let staged = tilings().into_iter().find(|t| !t.direct);
    let open = |double_buffer| {
        WgpuBackend::with_options(&Options {
            emulate_coopmat: true,
            poison_workgroup_memory: true,
            gemm_tiles: staged,
            double_buffer,
            ..Options::default()
        })
    };
    let (one, two) = match (open(false), open(true)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            no_adapter("double-buffered staging", e);
            return;
        }
    };
    if one.coop.is_none() {
        no_adapter(
            "double-buffered staging",
            "no cooperative fragments, emulated or not",
        );
        return;
    }
    let p = |padding| Conv2dParams {
        stride: [1; 2],
        padding: [padding; 2],
        dilation: [1; 2],
        groups: 1,
    };
    let mut graphs = Vec::new();
    let g = GraphBuilder::new();
    let y = g
        .input("a", &[2, 200, 72])
        .and_then(|a| a.linear(g.weight("w", &[130, 72])?, Some(g.weight("b", &[130])?)));
    graphs.push(g.finish(&[y.expect("linear")]));
    let g = GraphBuilder::new();
    let y = g
        .input("x", &[2, 8, 20, 20])
        .and_then(|x| x.conv2d(g.weight("w", &[16, 8, 3, 3])?, None, p(1)));
    graphs.push(g.finish(&[y.expect("conv")]));
    let g = GraphBuilder::new();
    let y = g
        .input("x", &[2, 64, 4, 4])
        .and_then(|x| x.conv2d(g.weight("w", &[64, 64, 3, 3])?, None, p(1)));
    graphs.push(g.finish(&[y.expect("deep conv")]));
    // The kernels compared are the two-stage form, within WebGPU's
    // minimum workgroup memory.
    let caps = codegen::Caps {
        subgroups: true,
        coop: one.coop,
        workgroup_memory: 16384,
        gemm_tiles: staged,
        double_buffer: true,
        ..codegen::Caps::plain()
    };
    for (i, g) in graphs.iter().enumerate() {
        let prog = plan(g).expect("plans");
        let k = prog
            .kernels
            .iter()
            .find(|k| matches!(k.kind.name(), "matmul" | "conv2d"))
            .expect("a product");
        let ops = vec![codegen::Operand::whole(false); k.inputs.len() + 1];
        let src = codegen::generate(k, &ops, &caps).expect("generates").source;
        assert!(src.contains("let so = 1u - cur;"), "graph {i}: one stage");
        let b = bindings(g, i as u32);
        let a = one.run(&prog, &b).expect("one stage");
        let d = two.run(&prog, &b).expect("two stages");
        assert_eq!(a[0].data, d[0].data, "graph {i}");
        assert!(a[0].data.iter().all(|v| v.is_finite()));
    }
}

/// Device loops are on by default on a GPU, off where asked and off with
/// f16 activations (a sampler's latent would be rounded to f16 each
/// step), and never on the CPU.
#[test]
fn device_loops_follow_the_options() {
    use sdkit_compute::backend::wgpu::Options;
    use sdkit_compute::Runtime;
    assert!(!Runtime::cpu().device_loops());
    let open = |device_loops, f16_activations| {
        WgpuBackend::with_options(&Options {
            device_loops,
            f16_activations,
            ..Options::default()
        })
    };
    let (on, off, half) = match (open(true, false), open(false, false), open(true, true)) {
        (Ok(a), Ok(b), Ok(c)) => (a, b, c),
        (Err(e), ..) | (_, Err(e), _) | (.., Err(e)) => {
            no_adapter("device loop options", e);
            return;
        }
    };
    let f16 = half.f16_activations;
    assert!(Runtime::wgpu(on).device_loops());
    assert!(!Runtime::wgpu(off).device_loops());
    assert_eq!(Runtime::wgpu(half).device_loops(), !f16);
}

/// An output that is a slice of a larger buffer reads back only the
/// slice's range (f32, and f16 activations at odd element offsets, whose
/// range widens to whole words), with the slice's values.
#[test]
fn sliced_outputs_read_back_only_their_range() {
    use sdkit_compute::backend::wgpu::Options;
    use sdkit_compute::tensor::GraphBuilder;
    for f16_activations in [false, true] {
        let gpu = match WgpuBackend::with_options(&Options {
            f16_activations,
            ..Options::default()
        }) {
            Ok(g) => g,
            Err(e) => {
                no_adapter("sliced outputs", e);
                return;
            }
        };
        let half = gpu.f16_activations;
        let g = GraphBuilder::new();
        let y = g
            .input("x", &[5, 7])
            .and_then(|x| x.mul_scalar(2.0).slice(0, 1, 4))
            .expect("builds");
        let g = g.finish(&[y]);
        let prog = plan(&g).expect("plans");
        assert_ne!(
            prog.outputs[0].offset, 0,
            "the output is a view into its buffer:\n{prog}"
        );
        let b = bindings(&g, 3);
        let before = gpu.bytes_downloaded();
        let got = gpu.run(&prog, &b).expect("runs").remove(0);
        let want = cpu::run(&prog, &b).expect("cpu runs").remove(0);
        assert_eq!(got.shape, [3, 7]);
        assert!(
            nmse(&got.data, &want.data) < if half { 2e-5 } else { tolerance(&gpu) },
            "f16 {half}: {:?} vs {:?}\n{prog}",
            got.data,
            want.data
        );
        // 21 elements from element 7: f32 words, or f16 from 6 to 28.
        let bytes = if half { 22 * 2 } else { 21 * 4 };
        assert_eq!(gpu.bytes_downloaded() - before, bytes, "f16 {half}");
    }
}
