//! The restricted pickle reader on files PyTorch wrote
//! (tools/reference/pickle_fixtures.py → tests/fixtures/pickle): every
//! dtype, shared and strided storages, zip (protocols 2 and 4) and legacy
//! layouts, ComfyUI's state-dict choice, an A1111 embedding, a Lightning
//! checkpoint; hostile pickles refused by the global they name; and
//! damaged bytes never panicking.

use proptest::prelude::*;
use sdkit_compute::weights::{SafeTensors, WeightError};
use std::path::{Path, PathBuf};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pickle")
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(dir().join("expected.json")).expect("expected.json");
    serde_json::from_str(&text).expect("json")
}

#[test]
fn torch_files_read_exactly() {
    let fx = expected();
    let files = fx["files"].as_object().expect("files");
    assert!(files.len() >= 6);
    for (file, tensors) in files {
        let st = SafeTensors::open(&dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let want = tensors.as_object().expect("tensors");
        let names: Vec<&str> = st.tensors().map(|t| t.name.as_str()).collect();
        let mut want_names: Vec<&str> = want.keys().map(String::as_str).collect();
        want_names.sort_unstable();
        assert_eq!(names, want_names, "{file}");
        for (name, t) in want {
            let info = st.get(name).expect("tensor");
            assert_eq!(
                info.dtype.name(),
                t["dtype"].as_str().expect("dtype"),
                "{file} {name}"
            );
            let shape: Vec<usize> = t["shape"]
                .as_array()
                .expect("shape")
                .iter()
                .map(|d| d.as_u64().expect("dim") as usize)
                .collect();
            assert_eq!(info.shape, shape, "{file} {name}");
            let got = st.to_f32(name).expect("values");
            let values: Vec<f32> = t["values"]
                .as_array()
                .expect("values")
                .iter()
                .map(|v| v.as_f64().expect("number") as f32)
                .collect();
            assert_eq!(got.len(), values.len(), "{file} {name}");
            for (i, (g, w)) in got.iter().zip(&values).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "{file} {name}[{i}]: {g} vs {w}"
                );
            }
        }
    }
}

#[test]
fn contiguous_tensors_are_ranges_of_the_file() {
    let st = SafeTensors::open(&dir().join("state_dict.ckpt")).expect("open");
    let len = st.file_len();
    for t in st.tensors() {
        let strided = matches!(t.name.as_str(), "model.transposed" | "model.sliced");
        assert_eq!(t.byte_range.start >= len, strided, "{}", t.name);
    }
    // The two views of one storage lie inside it, 8 elements apart.
    let a = st.get("model.shared_a").expect("a").byte_range.start;
    let b = st.get("model.shared_b").expect("b").byte_range.start;
    assert_eq!(b - a, 8 * 4);
}

#[test]
fn hostile_pickles_are_refused_by_name() {
    let fx = expected();
    let hostile = fx["hostile"].as_object().expect("hostile");
    assert_eq!(hostile.len(), 4);
    for (file, global) in hostile {
        let path = dir().join(file);
        let err = SafeTensors::open(&path).expect_err("refused");
        let global = global.as_str().expect("global");
        match &err {
            WeightError::PickleRefused { global: g, .. } => assert_eq!(g, global, "{file}"),
            other => panic!("{file}: {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains(&format!("`{global}`")), "{msg}");
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains("never runs code"), "{msg}");
    }
}

/// Hand-written pickles: each global an exploit needs is refused where it
/// is named, before anything could call it, in both GLOBAL forms.
#[test]
fn exploit_globals_are_refused_at_the_opcode() {
    let cases: &[(&[u8], &str)] = &[
        (b"cos\nsystem\n(S'id'\ntR.", "os.system"),
        (b"cbuiltins\ngetattr\n.", "builtins.getattr"),
        (b"c__builtin__\neval\n.", "builtins.eval"),
        (b"csubprocess\nPopen\n.", "subprocess.Popen"),
        (
            b"\x80\x04\x8c\x08builtins\x8c\x04exec\x93.",
            "builtins.exec",
        ),
        (
            b"ctorch.nn.modules.linear\nLinear\n.",
            "torch.nn.modules.linear.Linear",
        ),
    ];
    for (i, (bytes, global)) in cases.iter().enumerate() {
        let mut data = vec![0x80, 2];
        data.extend_from_slice(bytes);
        let err = SafeTensors::from_bytes(&format!("x{i}.ckpt"), data).expect_err("refused");
        match err {
            WeightError::PickleRefused {
                global: g, offset, ..
            } => {
                assert_eq!(&g, global);
                assert!(offset >= 2, "offset {offset}");
            }
            other => panic!("{global}: {other:?}"),
        }
    }
}

/// The embedding node reads `string_to_param.*` from these.
#[test]
fn a1111_embedding_flattens_to_dotted_names() {
    let st = SafeTensors::open(&dir().join("embedding.pt")).expect("open");
    let info = st.get("string_to_param.*").expect("vectors");
    assert_eq!(info.shape, vec![2, 16]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    /// Damaged torch files (bytes flipped, cut short) give errors, never a
    /// panic or a hang.
    #[test]
    fn damaged_files_never_panic(
        file in prop::sample::select(vec![
            "state_dict.ckpt", "proto4.pt", "legacy.pt", "embedding.pt", "lightning.ckpt",
        ]),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = std::fs::read(dir().join(file)).expect("read");
        for (at, v) in flips {
            let i = at.index(bytes.len());
            bytes[i] = v;
        }
        if truncate {
            let n = cut.index(bytes.len());
            bytes.truncate(n);
        }
        if let Ok(st) = SafeTensors::from_bytes(file, bytes) {
            for t in st.tensors() {
                let _ = st.to_f32(&t.name);
            }
        }
    }
}
