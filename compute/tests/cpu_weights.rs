//! Weights as the CPU reads them from files: a planned SD ResBlock runs
//! with bf16 weights from a safetensors file in the checkpoint's key
//! layout and equals the reference evaluation with the same (converted)
//! weights; ComfyUI's scaled-fp8 files read as its scaled ops compute.

use sdkit_compute::backend::cpu;
use sdkit_compute::plan::{plan, samples::resblock_graph};
use sdkit_compute::tensor::reference::{evaluate, Array};
use sdkit_compute::tensor::InputKind;
use sdkit_compute::weights::{
    bf16_to_f32, f16_to_f32, f8_e4m3_to_f32, write_safetensors, DType, SafeTensors, Scaled,
    TensorData, WeightError, WeightStore,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

#[test]
fn resblock_runs_on_bf16_checkpoint_weights() {
    let g = resblock_graph(1, 32, 8, 64).expect("builds");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ckpt.safetensors");

    // bf16 bytes for every weight, under the checkpoint prefix.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (_, name, shape) in g.inputs(InputKind::Weight) {
        let n: usize = shape.iter().product();
        let mut bytes = Vec::with_capacity(2 * n);
        for _ in 0..n {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let v = ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4;
            bytes.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        }
        blobs.push((
            format!("model.diffusion_model.{name}"),
            shape.to_vec(),
            bytes,
        ));
    }
    let tensors: Vec<(&str, DType, &[usize], &[u8])> = blobs
        .iter()
        .map(|(n, s, b)| (n.as_str(), DType::BF16, s.as_slice(), b.as_slice()))
        .collect();
    write_safetensors(&path, &tensors, &BTreeMap::new()).expect("writes");

    let mut store = WeightStore::new();
    store
        .open_mount(&path, "model.diffusion_model.", "")
        .expect("opens");

    let prog = plan(&g).expect("plans");
    let mut bind = cpu::Bindings::default();
    bind.bind_weights(&prog, &store).expect("binds");
    let x: Vec<f32> = (0..32 * 64)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let emb: Vec<f32> = (0..64).map(|i| (i as f32 * 0.1).sin()).collect();
    bind.inputs.insert("x".into(), Arc::new(x.clone()));
    bind.inputs.insert("emb".into(), Arc::new(emb.clone()));
    let got = cpu::run(&prog, &bind).expect("runs");

    let mut inputs = HashMap::new();
    for (name, shape, bytes) in &blobs {
        let data = bytes
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        let key = name
            .trim_start_matches("model.diffusion_model.")
            .to_string();
        inputs.insert(key, Array::new(shape.clone(), data));
    }
    inputs.insert("x".into(), Array::new(vec![1, 32, 8, 8], x));
    inputs.insert("emb".into(), Array::new(vec![1, 64], emb));
    let want = evaluate(&g, &inputs).expect("reference");
    let (a, b) = (&got[0].data, &want[0].data);
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    assert!(num / den < 1e-10, "nmse {}", num / den);

    // The same weights left in the file (`Bindings::stored`, converted per
    // kernel use and dropped after the last) give the same result, bit
    // for bit.
    let mut lazy = cpu::Bindings::default();
    for c in &prog.commands {
        if let sdkit_compute::plan::Command::Upload { name, .. } = c {
            lazy.stored
                .insert(name.clone(), store.stored(name).expect("stored"));
        }
    }
    lazy.inputs = bind.inputs.clone();
    let again = cpu::run(&prog, &lazy).expect("runs from the file");
    assert_eq!(again[0].data, got[0].data);

    // Letting the file's pages go loses nothing: they are read back.
    lazy.release_pages();
    let after = cpu::run(&prog, &lazy).expect("runs after releasing pages");
    assert_eq!(after[0].data, got[0].data);

    // bf16 products (AMX): the first run packs the convolution weights
    // into the bindings' cache (and lets their pages go), the next reads
    // the packed copies: the same result bit for bit, near the f32 one.
    if cpu::amx::available() {
        let first = cpu::run_with(&prog, &lazy, cpu::Products::Bf16).expect("bf16 run");
        assert!(lazy.packed.bytes() > 0, "no weight was packed");
        let second = cpu::run_with(&prog, &lazy, cpu::Products::Bf16).expect("bf16 again");
        assert_eq!(first[0].data, second[0].data);
        let (a, b) = (&first[0].data, &got[0].data);
        let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
        assert!(num / den < 1e-4, "bf16 nmse {}", num / den);
        assert!(
            num > 0.0,
            "bf16 run gave the f32 result: products stayed f32"
        );
    } else {
        assert!(
            std::env::var_os("SDKIT_REQUIRE_AMX").is_none(),
            "SDKIT_REQUIRE_AMX is set but AMX tiles are not available"
        );
        eprintln!("skipping the bf16 part: no AMX tiles here");
    }

    // A missing weight is a clear error naming it.
    let empty = WeightStore::new();
    let err = cpu::Bindings::default()
        .bind_weights(&prog, &empty)
        .expect_err("missing");
    assert!(err.to_string().contains("block."), "{err}");
}

fn no_meta() -> BTreeMap<String, String> {
    BTreeMap::new()
}

fn tensor_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// ComfyUI's scaled-fp8 files: with the `scaled_fp8` marker, a weight
/// with a `scale_weight` sibling reads as fp8 × scale through every
/// reader (whole, by range, through a store and a cast), and is not
/// rounded again by a cast; without the marker the scale is just a tensor.
#[test]
fn scaled_fp8_weights_read_times_their_scale() {
    let dir = tempfile::tempdir().expect("temp dir");
    // e4m3 codes for 1.0, -1.5, 0.5 and 448.
    let codes = [0x38u8, 0xbc, 0x30, 0x7e];
    let scale = 0.013_671_875f32 * 1.1;
    let s = scale.to_le_bytes();
    let two = tensor_bytes(&[1.0, 2.0]);
    // f16 0.3 and -0.0517578125: not e4m3 values.
    let bias_bits = [0x34cdu16, 0xaaa0];
    let bias: Vec<u8> = bias_bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let write = |name: &str, marker: bool, scale_shape: &[usize], scale_bytes: &[u8]| {
        let path = dir.path().join(name);
        let mut t: Vec<TensorData<'_>> = vec![
            ("blk.lin.weight", DType::F8E4M3, &[2, 2], &codes),
            ("blk.lin.scale_weight", DType::F32, scale_shape, scale_bytes),
            ("blk.lin.bias", DType::F16, &[2], &bias),
            ("blk.other.weight", DType::F8E4M3, &[4], &codes),
        ];
        if marker {
            t.push(("scaled_fp8", DType::F8E4M3, &[0], &[]));
        }
        write_safetensors(&path, &t, &no_meta()).expect("write");
        path
    };
    let plain: Vec<f32> = codes.iter().map(|&c| f8_e4m3_to_f32(c)).collect();
    let scaled: Vec<f32> = plain.iter().map(|v| v * scale).collect();

    let path = write("scaled.safetensors", true, &[], &s);
    let file = SafeTensors::open(&path).expect("open");
    assert_eq!(
        file.get("blk.lin.weight").expect("w").scaled,
        Some(Scaled {
            held_as: DType::F8E4M3,
            scale
        })
    );
    assert_eq!(file.to_f32("blk.lin.weight").expect("w"), scaled);
    // The layer's bias is held in fp8 (ComfyUI builds the Linear in fp8),
    // unscaled.
    let bias_f32: Vec<f32> = bias_bits.iter().map(|&b| f16_to_f32(b)).collect();
    let bias_held: Vec<f32> = bias_f32
        .iter()
        .map(|&v| sdkit_compute::weights::round_f8_e4m3(v))
        .collect();
    assert_ne!(bias_held, bias_f32);
    assert_eq!(file.to_f32("blk.lin.bias").expect("b"), bias_held);
    // No scale_weight: read as stored.
    assert_eq!(file.to_f32("blk.other.weight").expect("w"), plain);
    let mut store = WeightStore::new();
    store.mount(Arc::new(file), "blk.", "m.");
    let w = store.stored("m.lin.weight").expect("stored");
    assert!(w.scaled());
    assert_eq!(w.range_f32(2, 2).expect("range"), scaled[2..].to_vec());
    // A cast (UNETLoader's weight_dtype, a text encoder's f16) leaves the
    // scaled value as ComfyUI's scaled ops compute it.
    assert_eq!(w.cast_to(DType::F16).to_f32().expect("cast"), scaled);
    assert_eq!(store.to_f32("m.lin.weight").expect("w"), scaled);

    // Without the marker nothing is scaled; a [1]-shaped scale is one value.
    let path = write("unmarked.safetensors", false, &[], &s);
    let file = SafeTensors::open(&path).expect("open");
    assert_eq!(file.to_f32("blk.lin.weight").expect("w"), plain);
    assert_eq!(file.to_f32("blk.lin.bias").expect("b"), bias_f32);
    let path = write("one.safetensors", true, &[1], &s);
    let file = SafeTensors::open(&path).expect("open");
    assert_eq!(file.to_f32("blk.lin.weight").expect("w"), scaled);

    // More than one scale per weight is refused, naming the tensor.
    let path = write("per_row.safetensors", true, &[2], &two);
    let err = SafeTensors::open(&path).expect_err("per-row scales");
    assert!(
        matches!(&err, WeightError::InvalidTensorEntry { tensor, .. } if tensor == "blk.lin.scale_weight"),
        "{err:?}"
    );
    assert!(err.to_string().contains("per_row.safetensors"), "{err}");
}
