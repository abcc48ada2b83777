//! Safetensors reading and writing, the weight store, and the float
//! conversions: round trips for every dtype, lazy access, prefix remapping,
//! every malformed-header error, a fixture written by the
//! official Python library, and fuzzing that nothing panics.

use proptest::prelude::*;
use sdkit_compute::weights::{
    bf16_to_f32, f16_to_f32, f8_e4m3_to_f32, f8_e5m2_to_f32, serialize_safetensors,
    write_safetensors, DType, SafeTensors, TensorData, WeightError, WeightStore, MAX_HEADER_BYTES,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn no_meta() -> BTreeMap<String, String> {
    BTreeMap::new()
}

/// Bytes of a file with the given header text and data section.
fn file_with_header(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn parse(bytes: Vec<u8>) -> Result<SafeTensors, WeightError> {
    SafeTensors::from_bytes("test.safetensors", bytes)
}

/// Encodes `v` in `dtype`. The 1- and 2-byte float formats are found by
/// searching all bit patterns with the decoders, which
/// `*_matches_reference_for_every_bit_pattern` check independently.
fn encode(dtype: DType, v: f64) -> Vec<u8> {
    let search16 = |f: fn(u16) -> f32| {
        (0..=u16::MAX)
            .find(|&b| f64::from(f(b)) == v)
            .expect("value representable")
            .to_le_bytes()
            .to_vec()
    };
    let search8 = |f: fn(u8) -> f32| {
        vec![(0..=u8::MAX)
            .find(|&b| f64::from(f(b)) == v)
            .expect("value representable")]
    };
    match dtype {
        DType::Bool => vec![u8::from(v != 0.0)],
        DType::U8 => vec![v as u8],
        DType::I8 => (v as i8).to_le_bytes().to_vec(),
        DType::F8E4M3 => search8(f8_e4m3_to_f32),
        DType::F8E5M2 => search8(f8_e5m2_to_f32),
        DType::I16 => (v as i16).to_le_bytes().to_vec(),
        DType::U16 => (v as u16).to_le_bytes().to_vec(),
        DType::F16 => search16(f16_to_f32),
        DType::BF16 => search16(bf16_to_f32),
        DType::I32 => (v as i32).to_le_bytes().to_vec(),
        DType::U32 => (v as u32).to_le_bytes().to_vec(),
        DType::F32 => (v as f32).to_le_bytes().to_vec(),
        DType::I64 => (v as i64).to_le_bytes().to_vec(),
        DType::U64 => (v as u64).to_le_bytes().to_vec(),
        DType::F64 => v.to_le_bytes().to_vec(),
        // Only safetensors dtypes (`DType::ALL`) are written here.
        other => panic!("{other} is not a safetensors dtype"),
    }
}

/// Four values each dtype holds exactly.
fn sample(dtype: DType) -> [f64; 4] {
    match dtype {
        DType::Bool => [0.0, 1.0, 1.0, 0.0],
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => [0.0, 1.0, 7.0, 200.0],
        DType::I8 | DType::I16 | DType::I32 | DType::I64 => [-3.0, 0.0, 7.0, 100.0],
        _ => [-2.5, 0.0, 1.0, 3.0],
    }
}

#[test]
fn round_trip_every_dtype() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("all.safetensors");
    let encoded: Vec<(String, DType, Vec<u8>)> = DType::ALL
        .iter()
        .map(|&d| {
            let bytes = sample(d).iter().flat_map(|&v| encode(d, v)).collect();
            (format!("t.{}", d.name()), d, bytes)
        })
        .collect();
    // A 1-byte tensor first, so every later tensor starts misaligned.
    let mut tensors: Vec<TensorData<'_>> = vec![("a_pad", DType::U8, &[1], &[9])];
    for (name, d, bytes) in &encoded {
        tensors.push((name, *d, &[2, 2], bytes));
    }
    tensors.push(("empty", DType::F32, &[0, 3], &[]));
    let mut meta = no_meta();
    meta.insert("format".into(), "pt".into());
    meta.insert("ünïcode".into(), "✓".into());
    write_safetensors(&path, &tensors, &meta).expect("write");

    let st = SafeTensors::open(&path).expect("open");
    assert_eq!(st.metadata(), &meta);
    assert_eq!(st.len(), DType::ALL.len() + 2);
    for (name, d, bytes) in &encoded {
        let info = st.get(name).expect("tensor present");
        assert_eq!(info.dtype, *d);
        assert_eq!(info.shape, vec![2, 2]);
        assert_eq!(info.numel(), 4);
        assert_eq!(info.size_bytes(), 4 * d.size_bytes());
        assert_eq!(st.raw(name).expect("raw"), &bytes[..]);
        let expected: Vec<f32> = sample(*d).iter().map(|&v| v as f32).collect();
        assert_eq!(st.to_f32(name).expect("to_f32"), expected, "{d}");
        assert_eq!(DType::from_name(d.name()), Some(*d));
    }
    assert_eq!(st.to_f32("empty").expect("empty"), Vec::<f32>::new());
    assert_eq!(st.get("empty").expect("empty").shape, vec![0, 3]);
    // Names come back sorted.
    let names: Vec<&str> = st.tensors().map(|t| t.name.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted);
    let total: u64 = DType::ALL.iter().map(|d| 4 * d.size_bytes() as u64).sum();
    assert_eq!(st.total_bytes(), total + 1);
    let mem = st.memory();
    assert_eq!(mem.tensors, DType::ALL.len() + 2);
    assert_eq!(mem.f32_bytes, (DType::ALL.len() as u64 * 4 + 1) * 4);
    assert_eq!(mem.by_dtype[&DType::F64], 32);

    // The same bytes in memory parse identically.
    let in_memory = serialize_safetensors(&tensors, &meta).expect("serialize");
    assert_eq!(in_memory, std::fs::read(&path).expect("read back"));
    // Header padding puts the data section on an 8-byte boundary.
    assert_eq!((8 + st.header_len()) % 8, 0);
    // Nothing but the file is left in the directory: the temporary is renamed.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("all.safetensors")]);
}

#[test]
fn scalar_and_integer_rounding() {
    let big = (1i64 << 40) + 1; // rounds to 2^40 in f32
    let bytes = serialize_safetensors(
        &[
            ("s", DType::F64, &[], &0.1f64.to_le_bytes()),
            ("i", DType::I64, &[1], &big.to_le_bytes()),
            ("b", DType::Bool, &[2], &[0, 2]),
        ],
        &no_meta(),
    )
    .expect("serialize");
    let st = parse(bytes).expect("parse");
    assert_eq!(st.get("s").expect("s").numel(), 1);
    assert_eq!(st.to_f32("s").expect("s"), vec![0.1f32]);
    assert_eq!(st.to_f32("i").expect("i"), vec![(1u64 << 40) as f32]);
    assert_eq!(st.to_f32("b").expect("b"), vec![0.0, 1.0]);
}

#[test]
fn overwrite_is_atomic_and_old_mapping_survives() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("w.safetensors");
    let one = 1.0f32.to_le_bytes();
    write_safetensors(&path, &[("x", DType::F32, &[1], &one)], &no_meta()).expect("write");
    let old = SafeTensors::open(&path).expect("open");
    let two = 2.0f32.to_le_bytes();
    write_safetensors(&path, &[("x", DType::F32, &[1], &two)], &no_meta()).expect("rewrite");
    // The rename left the mapped inode alone.
    assert_eq!(old.to_f32("x").expect("old"), vec![1.0]);
    let new = SafeTensors::open(&path).expect("reopen");
    assert_eq!(new.to_f32("x").expect("new"), vec![2.0]);
}

#[test]
fn writer_rejects_bad_input() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bad.safetensors");
    let four = [0u8; 4];
    let cases: Vec<Vec<TensorData<'_>>> = vec![
        vec![("x", DType::F32, &[2], &four)],
        vec![
            ("x", DType::F32, &[1], &four),
            ("x", DType::F32, &[1], &four),
        ],
        vec![("__metadata__", DType::F32, &[1], &four)],
        vec![("x", DType::F32, &[usize::MAX, 2], &four)],
    ];
    for tensors in cases {
        let err = write_safetensors(&path, &tensors, &no_meta()).expect_err("refused");
        assert!(matches!(err, WeightError::InvalidInput { .. }), "{err:?}");
    }
    assert!(!path.exists());
}

#[test]
fn lazy_access_reads_one_tensor_of_a_huge_sparse_file() {
    // A header that claims a 4 GiB tensor after a small one, and a file
    // extended sparsely to that size: opening and reading the small tensor
    // must neither read nor copy the 4 GiB (the test would crawl, or run
    // out of memory, if it did).
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("huge.safetensors");
    let huge = 4u64 << 30;
    let header = format!(
        r#"{{"small":{{"dtype":"F32","shape":[4],"data_offsets":[0,16]}},"huge":{{"dtype":"U8","shape":[{huge}],"data_offsets":[16,{}]}}}}"#,
        16 + huge
    );
    let small: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let bytes = file_with_header(&header, &small);
    std::fs::write(&path, &bytes).expect("write");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("reopen");
    file.set_len(bytes.len() as u64 + huge).expect("extend");
    drop(file);

    let st = SafeTensors::open(&path).expect("open");
    assert_eq!(st.to_f32("small").expect("small"), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(st.get("huge").expect("huge").size_bytes() as u64, huge);
    assert_eq!(st.total_bytes(), huge + 16);
    // One page in the middle of the huge tensor: zeros, from a hole.
    let raw = st.raw("huge").expect("raw");
    assert_eq!(raw[(huge / 2) as usize], 0);
}

fn tensor_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn store_remaps_prefixes_and_shadows_whole_prefixes() {
    let a = tensor_bytes(&[1.0]);
    let b = tensor_bytes(&[2.0, 2.0]);
    let c = tensor_bytes(&[3.0]);
    let ckpt = parse(
        serialize_safetensors(
            &[
                ("model.diffusion_model.in.weight", DType::F32, &[1], &a),
                (
                    "first_stage_model.decoder.conv_in.weight",
                    DType::F32,
                    &[2],
                    &b,
                ),
                (
                    "first_stage_model.encoder.only_in_ckpt",
                    DType::F32,
                    &[1],
                    &c,
                ),
            ],
            &no_meta(),
        )
        .expect("ckpt"),
    )
    .expect("parse ckpt");
    let v1 = tensor_bytes(&[10.0, 11.0]);
    let v2 = tensor_bytes(&[12.0]);
    let vae = SafeTensors::from_bytes(
        "vae.safetensors",
        serialize_safetensors(
            &[
                ("decoder.conv_in.weight", DType::F32, &[2], &v1),
                ("encoder.conv_in.weight", DType::F32, &[1], &v2),
            ],
            &no_meta(),
        )
        .expect("vae"),
    )
    .expect("parse vae");
    let ckpt = Arc::new(ckpt);
    let vae = Arc::new(vae);

    let mut store = WeightStore::new();
    store.mount(Arc::clone(&ckpt), "", "");
    // Before the VAE is mounted the checkpoint's own VAE answers.
    assert_eq!(
        store
            .to_f32("first_stage_model.decoder.conv_in.weight")
            .expect("ckpt vae"),
        vec![2.0, 2.0]
    );
    store.mount(Arc::clone(&vae), "", "first_stage_model.");
    // The UNet also under a diffusers-like name.
    store.mount(Arc::clone(&ckpt), "model.diffusion_model.", "unet.");

    assert_eq!(
        store
            .to_f32("first_stage_model.decoder.conv_in.weight")
            .expect("vae"),
        vec![10.0, 11.0]
    );
    let r = store
        .get("first_stage_model.encoder.conv_in.weight")
        .expect("resolves");
    assert_eq!(r.file.path(), Path::new("vae.safetensors"));
    assert_eq!(r.info.name, "encoder.conv_in.weight");
    assert_eq!(r.to_f32().expect("f32"), vec![12.0]);
    assert_eq!(
        store
            .to_f32("model.diffusion_model.in.weight")
            .expect("unet"),
        vec![1.0]
    );
    assert_eq!(store.raw("unet.in.weight").expect("unet alias"), &a[..]);

    // The VAE shadows the whole prefix: the checkpoint's leftover is gone.
    assert!(!store.contains("first_stage_model.encoder.only_in_ckpt"));
    let err = store
        .to_f32("first_stage_model.encoder.only_in_ckpt")
        .expect_err("shadowed");
    match &err {
        WeightError::NotInStore { tensor, detail } => {
            assert_eq!(tensor, "first_stage_model.encoder.only_in_ckpt");
            assert!(detail.contains("vae.safetensors"), "{detail}");
            assert!(detail.contains("encoder.only_in_ckpt"), "{detail}");
        }
        other => panic!("wrong error {other:?}"),
    }

    assert_eq!(
        store.names(),
        vec![
            "first_stage_model.decoder.conv_in.weight",
            "first_stage_model.encoder.conv_in.weight",
            "model.diffusion_model.in.weight",
            "unet.in.weight",
        ]
    );
    assert_eq!(
        store.keys_with_prefix("first_stage_model."),
        vec![
            "first_stage_model.decoder.conv_in.weight",
            "first_stage_model.encoder.conv_in.weight",
        ]
    );
    // 2 + 1 VAE floats, the UNet weight twice (once per name).
    assert_eq!(store.total_bytes(), 4 * (2 + 1 + 1 + 1));
    assert_eq!(store.memory().tensors, 4);
    assert_eq!(store.files().count(), 3);

    // With nothing mounted, or no covering mount, the error says so.
    let mut partial = WeightStore::new();
    let err = partial.to_f32("x").expect_err("empty store");
    assert!(err.to_string().contains("nothing is mounted"), "{err}");
    partial.mount(vae, "", "first_stage_model.");
    let err = partial.raw("model.x").expect_err("uncovered");
    assert!(err.to_string().contains("no mount covers it"), "{err}");
}

#[test]
fn store_open_mount_reads_files() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("vae.safetensors");
    let v = tensor_bytes(&[5.0]);
    write_safetensors(&path, &[("decoder.w", DType::F32, &[1], &v)], &no_meta()).expect("write");
    let mut store = WeightStore::new();
    let file = store
        .open_mount(&path, "decoder.", "first_stage_model.decoder.")
        .expect("mount");
    assert_eq!(file.len(), 1);
    assert_eq!(
        store.to_f32("first_stage_model.decoder.w").expect("w"),
        vec![5.0]
    );
    let err = store
        .open_mount(&dir.path().join("missing.safetensors"), "", "")
        .expect_err("missing");
    assert!(matches!(err, WeightError::Io { .. }), "{err:?}");
}

/// Asserts `bytes` fail to parse with the variant `check` accepts, and
/// that the message names the file.
fn assert_err(bytes: Vec<u8>, check: impl Fn(&WeightError) -> bool) -> WeightError {
    let err = parse(bytes).expect_err("should be refused");
    assert!(check(&err), "unexpected error variant: {err:?}");
    assert!(err.to_string().contains("test.safetensors"), "{err}");
    err
}

fn header_err(header: &str, data_len: usize, check: impl Fn(&WeightError) -> bool) -> WeightError {
    assert_err(file_with_header(header, &vec![0; data_len]), check)
}

#[test]
fn malformed_files_give_typed_errors() {
    use WeightError as E;
    assert_err(vec![], |e| matches!(e, E::FileTooShort { len: 0, .. }));
    assert_err(vec![1, 0, 0], |e| {
        matches!(e, E::FileTooShort { len: 3, .. })
    });

    let mut short = 1000u64.to_le_bytes().to_vec();
    short.extend_from_slice(b"{}");
    assert_err(short, |e| {
        matches!(
            e,
            E::HeaderOutOfRange {
                header_len: 1000,
                file_len: 10,
                ..
            }
        )
    });
    assert_err(u64::MAX.to_le_bytes().to_vec(), |e| {
        matches!(e, E::HeaderTooLarge { .. })
    });
    assert_err((MAX_HEADER_BYTES + 1).to_le_bytes().to_vec(), |e| {
        matches!(e, E::HeaderTooLarge { .. })
    });

    let mut not_utf8 = 4u64.to_le_bytes().to_vec();
    not_utf8.extend_from_slice(&[b'{', 0xff, 0xfe, b'}']);
    assert_err(not_utf8, |e| matches!(e, E::HeaderNotUtf8 { .. }));

    for bad in [r#"{"a":"#, "", "[]", "null", r#"{"a":1}}"#, "{} x"] {
        header_err(bad, 0, |e| matches!(e, E::InvalidJson { .. }));
    }
    // Deep nesting is an error, not a stack overflow.
    let deep = format!(r#"{{"a":{}{}}}"#, "[".repeat(100_000), "]".repeat(100_000));
    header_err(&deep, 0, |e| matches!(e, E::InvalidJson { .. }));

    let entry = r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#;
    let err = header_err(
        &format!(r#"{{"w":{entry},"w":{entry}}}"#),
        4,
        |e| matches!(e, E::DuplicateTensor { tensor, .. } if tensor == "w"),
    );
    assert!(err.to_string().contains("\"w\""));
    header_err(
        r#"{"__metadata__":{},"__metadata__":{}}"#,
        0,
        |e| matches!(e, E::DuplicateTensor { tensor, .. } if tensor == "__metadata__"),
    );

    let invalid_entries = [
        r#"{"w":[]}"#,
        r#"{"w":{"shape":[1],"data_offsets":[0,4]}}"#,
        r#"{"w":{"dtype":7,"shape":[1],"data_offsets":[0,4]}}"#,
        r#"{"w":{"dtype":"F32","data_offsets":[0,4]}}"#,
        r#"{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
        r#"{"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}"#,
        r#"{"w":{"dtype":"F32","shape":[1e30],"data_offsets":[0,4]}}"#,
        r#"{"w":{"dtype":"F32","shape":1,"data_offsets":[0,4]}}"#,
        r#"{"w":{"dtype":"F32","shape":[1]}}"#,
        r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#,
        r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}"#,
        r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}}"#,
        r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":"0,4"}}"#,
    ];
    for header in invalid_entries {
        let err = header_err(
            header,
            8,
            |e| matches!(e, E::InvalidTensorEntry { tensor, .. } if tensor == "w"),
        );
        assert!(err.to_string().contains("\"w\""), "{err}");
    }

    for dtype in ["F4", "Q4_0", "f32", "F8_E8M0", ""] {
        header_err(
            &format!(r#"{{"w":{{"dtype":"{dtype}","shape":[1],"data_offsets":[0,1]}}}}"#),
            1,
            |e| matches!(e, E::UnknownDType { tensor, dtype: d, .. } if tensor == "w" && d == dtype),
        );
    }

    for shape in [
        format!("[{}, {}]", 1u64 << 40, 1u64 << 40),
        format!("[{}]", u64::MAX),
        format!("[{}]", u64::MAX / 2),
    ] {
        header_err(
            &format!(r#"{{"w":{{"dtype":"F32","shape":{shape},"data_offsets":[0,4]}}}}"#),
            4,
            |e| matches!(e, E::ShapeOverflow { .. }),
        );
    }

    header_err(
        r#"{"w":{"dtype":"U8","shape":[2],"data_offsets":[6,4]}}"#,
        8,
        |e| {
            matches!(
                e,
                E::InvalidOffsets {
                    begin: 6,
                    end: 4,
                    ..
                }
            )
        },
    );
    header_err(
        r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        7,
        |e| {
            matches!(
                e,
                E::OffsetsOutOfRange {
                    end: 8,
                    data_len: 7,
                    ..
                }
            )
        },
    );
    header_err(
        &format!(
            r#"{{"w":{{"dtype":"U8","shape":[1],"data_offsets":[{}, {}]}}}}"#,
            u64::MAX - 1,
            u64::MAX
        ),
        8,
        |e| matches!(e, E::OffsetsOutOfRange { .. }),
    );
    header_err(
        r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}}"#,
        24,
        |e| {
            matches!(
                e,
                E::SizeMismatch {
                    expected: 24,
                    actual: 20,
                    ..
                }
            )
        },
    );
    header_err(
        r#"{"w":{"dtype":"F16","shape":[],"data_offsets":[0,4]}}"#,
        4,
        |e| {
            matches!(
                e,
                E::SizeMismatch {
                    expected: 2,
                    actual: 4,
                    ..
                }
            )
        },
    );

    let err = header_err(
        r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[2],"data_offsets":[7,9]}}"#,
        9,
        |e| matches!(e, E::Overlap { .. }),
    );
    assert!(err.to_string().contains("\"a\"") && err.to_string().contains("\"b\""));
    // A short tensor inside a long one that started earlier.
    header_err(
        r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},"c":{"dtype":"U8","shape":[1],"data_offsets":[3,4]}}"#,
        8,
        |e| matches!(e, E::Overlap { .. }),
    );
    header_err(
        r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
        2,
        |e| matches!(e, E::Overlap { .. }),
    );

    header_err(r#"{"__metadata__":[]}"#, 0, |e| {
        matches!(e, E::InvalidMetadata { .. })
    });
    header_err(
        r#"{"__metadata__":{"epoch":3}}"#,
        0,
        |e| matches!(e, E::InvalidMetadata { reason, .. } if reason.contains("epoch")),
    );

    let ok = parse(file_with_header(
        r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
        &[1],
    ))
    .expect("valid");
    let err = ok.raw("nope").expect_err("missing");
    assert!(matches!(&err, E::TensorNotFound { tensor, .. } if tensor == "nope"));
    assert!(matches!(ok.to_f32("nope"), Err(E::TensorNotFound { .. })));
}

#[test]
fn gaps_empty_tensors_and_extra_fields_are_accepted() {
    // Gaps before, between and after tensors; an empty tensor inside
    // another's bytes; unknown extra keys; whitespace around the JSON.
    let header = r#"  {"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3],"extra":true},
        "z":{"dtype":"F32","shape":[0],"data_offsets":[2,2]},
        "b":{"dtype":"U8","shape":[1],"data_offsets":[5,6]},
        "__metadata__":{}}  "#;
    let st = parse(file_with_header(header, &[0, 1, 2, 0, 0, 3, 0, 0])).expect("valid");
    assert_eq!(st.raw("a").expect("a"), &[1, 2]);
    assert_eq!(st.raw("b").expect("b"), &[3]);
    assert_eq!(st.raw("z").expect("z"), &[] as &[u8]);
    assert!(st.metadata().is_empty());
    assert_eq!(st.keys_with_prefix("").count(), 3);
    assert_eq!(st.keys_with_prefix("a").collect::<Vec<_>>(), vec!["a"]);
    assert_eq!(st.keys_with_prefix("q").count(), 0);
    // An empty header.
    assert!(parse(file_with_header("{}", &[]))
        .expect("empty")
        .is_empty());
}

#[test]
fn valid_file_starting_with_pickle_byte_is_not_refused() {
    // Header length 0x0280 = 640: the file starts 0x80 0x02, like a
    // protocol-2 pickle, yet it is valid safetensors and must load.
    let mut header = r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#.to_string();
    header.push_str(&" ".repeat(0x280 - header.len()));
    let bytes = file_with_header(&header, &[42]);
    assert_eq!(&bytes[..2], &[0x80, 0x02]);
    let st = parse(bytes).expect("valid safetensors");
    assert_eq!(st.to_f32("w").expect("w"), vec![42.0]);
}

/// Bytes that look like a torch file but are not one give a clear error
/// naming the file (the reader itself is tested in tests/pickle.rs).
#[test]
fn broken_pickle_checkpoints_are_clear_errors() {
    let dir = tempfile::tempdir().expect("temp dir");
    // A missing file is an I/O error whatever its extension.
    let missing = dir.path().join("v1-5.ckpt");
    let err = SafeTensors::open(&missing).expect_err("missing");
    assert!(matches!(err, WeightError::Io { .. }), "{err:?}");
    let zip = b"PK\x03\x04\x14\x00\x00\x00\x08\x00archive/data.pkl".to_vec();
    let pickle2 = b"\x80\x02}q\x00X\x05\x00\x00\x00stateq\x01.".to_vec();
    let pickle4 = b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94.".to_vec();
    let tiny = b"\x80\x05.".to_vec();
    for (i, bytes) in [zip, pickle2, pickle4, tiny].into_iter().enumerate() {
        let path = dir.path().join(format!("disguised{i}.safetensors"));
        std::fs::write(&path, &bytes).expect("write");
        let err = SafeTensors::open(&path).expect_err("not a checkpoint");
        assert!(matches!(err, WeightError::InvalidPickle { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        let err = SafeTensors::from_bytes("mem", bytes).expect_err("not a checkpoint");
        assert!(matches!(err, WeightError::InvalidPickle { .. }), "{err:?}");
    }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/weights")
        .join(name)
}

#[test]
fn reads_file_written_by_python_safetensors() {
    // Made by tools/reference/make_safetensors.py with the official writer.
    let st = SafeTensors::open(&fixture("torch_small.safetensors")).expect("open fixture");
    assert_eq!(st.metadata().get("format").map(String::as_str), Some("pt"));
    assert_eq!(
        st.metadata().get("note").map(String::as_str),
        Some("sdkit fixture")
    );
    let f32s = st.get("model.diffusion_model.f32").expect("f32");
    assert_eq!((f32s.dtype, f32s.shape.clone()), (DType::F32, vec![2, 3]));
    assert_eq!(
        st.to_f32("model.diffusion_model.f32").expect("f32"),
        vec![-0.5, -0.25, 0.0, 0.25, 0.5, 0.75]
    );
    let f16 = st.to_f32("first_stage_model.f16").expect("f16");
    assert_eq!(f16[..4], [1.0, -2.5, 2f32.powi(-24), f32::NEG_INFINITY]);
    assert!(f16[4].is_nan());
    assert_eq!(
        st.get("first_stage_model.f16").expect("f16").dtype,
        DType::F16
    );
    assert_eq!(
        st.to_f32("cond_stage_model.bf16").expect("bf16"),
        vec![1.0, -0.15625, 3.004_055_270_473_91e38_f64 as f32]
    );
    let ids = st.get("position_ids").expect("ids");
    assert_eq!((ids.dtype, ids.shape.clone()), (DType::I64, vec![1, 3]));
    let raw = st.raw("position_ids").expect("raw ids");
    let ints: Vec<i64> = raw
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    assert_eq!(ints, vec![0, 1, 1 << 40]);
    assert_eq!(st.get("scalar").expect("scalar").shape, Vec::<usize>::new());
    assert_eq!(st.to_f32("scalar").expect("scalar"), vec![7.0]);
}

/// f16 value from the textbook formula, in f64.
fn f16_reference(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((h >> 10) & 0x1f);
    let m = f64::from(h & 0x3ff);
    match e {
        0 => sign * 2f64.powi(-14) * (m / 1024.0),
        31 if m == 0.0 => sign * f64::INFINITY,
        31 => f64::NAN,
        _ => sign * 2f64.powi(e - 15) * (1.0 + m / 1024.0),
    }
}

fn bf16_reference(b: u16) -> f64 {
    let sign = if b & 0x8000 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 7) & 0xff);
    let m = f64::from(b & 0x7f);
    match e {
        0 => sign * 2f64.powi(-126) * (m / 128.0),
        255 if m == 0.0 => sign * f64::INFINITY,
        255 => f64::NAN,
        _ => sign * 2f64.powi(e - 127) * (1.0 + m / 128.0),
    }
}

fn e4m3_reference(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f64::from(b & 0x7);
    match (e, b & 0x7f) {
        (_, 0x7f) => f64::NAN,
        (0, _) => sign * 2f64.powi(-6) * (m / 8.0),
        _ => sign * 2f64.powi(e - 7) * (1.0 + m / 8.0),
    }
}

fn e5m2_reference(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 2) & 0x1f);
    let m = f64::from(b & 0x3);
    match e {
        0 => sign * 2f64.powi(-14) * (m / 4.0),
        31 if m == 0.0 => sign * f64::INFINITY,
        31 => f64::NAN,
        _ => sign * 2f64.powi(e - 15) * (1.0 + m / 4.0),
    }
}

/// Exact equality, with -0 distinct from +0 and NaN matching NaN of the
/// same sign.
fn same(got: f32, want: f64, negative: bool) -> bool {
    if want.is_nan() {
        got.is_nan() && got.is_sign_negative() == negative
    } else {
        f64::from(got) == want && got.is_sign_negative() == negative
    }
}

#[test]
fn f16_matches_reference_for_every_bit_pattern() {
    for h in 0..=u16::MAX {
        let got = f16_to_f32(h);
        assert!(
            same(got, f16_reference(h), h & 0x8000 != 0),
            "{h:#06x}: {got:e} vs {:e}",
            f16_reference(h)
        );
        if got.is_nan() {
            // The payload moves to the top of the f32 mantissa.
            assert_eq!(got.to_bits() & 0x007f_ffff, u32::from(h & 0x3ff) << 13);
        }
    }
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14));
}

#[test]
fn bf16_matches_reference_for_every_bit_pattern() {
    for b in 0..=u16::MAX {
        let got = bf16_to_f32(b);
        assert!(same(got, bf16_reference(b), b & 0x8000 != 0), "{b:#06x}");
    }
}

#[test]
fn f8_matches_reference_for_every_bit_pattern() {
    for b in 0..=u8::MAX {
        let neg = b & 0x80 != 0;
        assert!(
            same(f8_e4m3_to_f32(b), e4m3_reference(b), neg),
            "e4m3 {b:#04x}"
        );
        assert!(
            same(f8_e5m2_to_f32(b), e5m2_reference(b), neg),
            "e5m2 {b:#04x}"
        );
    }
    assert_eq!(f8_e4m3_to_f32(0x7e), 448.0);
    assert_eq!(f8_e4m3_to_f32(0x01), 2f32.powi(-9));
    assert!(f8_e4m3_to_f32(0xff).is_nan());
    assert_eq!(f8_e5m2_to_f32(0x7c), f32::INFINITY);
}

#[test]
fn file_conversion_covers_every_half_pattern_misaligned() {
    let all: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
    let bytes = serialize_safetensors(
        &[
            ("0pad", DType::U8, &[3], &[0, 0, 0]),
            ("f16", DType::F16, &[65536], &all),
            ("bf16", DType::BF16, &[256, 256], &all),
        ],
        &no_meta(),
    )
    .expect("serialize");
    let st = parse(bytes).expect("parse");
    assert_eq!(st.get("f16").expect("f16").byte_range.start % 2, 1);
    let f16 = st.to_f32("f16").expect("f16");
    let bf16 = st.to_f32("bf16").expect("bf16");
    for h in 0..=u16::MAX {
        let i = usize::from(h);
        assert_eq!(f16[i].to_bits(), f16_to_f32(h).to_bits(), "{h:#06x}");
        assert_eq!(bf16[i].to_bits(), bf16_to_f32(h).to_bits(), "{h:#06x}");
    }
}

/// A small valid file with a few dtypes, some misaligned, and metadata.
fn valid_file() -> Vec<u8> {
    let f32s = tensor_bytes(&[1.0, -2.0, 3.5, 0.25]);
    let halves: Vec<u8> = [0x3c00u16, 0xc100, 0x7c00, 0x0001]
        .iter()
        .flat_map(|h| h.to_le_bytes())
        .collect();
    let ints: Vec<u8> = [-7i64, 1 << 40]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let mut meta = no_meta();
    meta.insert("format".into(), "pt".into());
    serialize_safetensors(
        &[
            ("a.weight", DType::F32, &[2, 2], &f32s),
            ("b", DType::U8, &[1], &[5]),
            ("c.f16", DType::F16, &[4], &halves),
            ("d.bf16", DType::BF16, &[2, 2], &halves),
            ("e.ids", DType::I64, &[2], &ints),
        ],
        &meta,
    )
    .expect("serialize")
}

/// Whatever parses must be self-consistent and fully readable.
fn exercise(st: &SafeTensors) {
    let mut ranges = Vec::new();
    for t in st.tensors() {
        assert_eq!(t.size_bytes(), t.numel() * t.dtype.size_bytes());
        assert!(t.byte_range.end <= st.file_len());
        assert!(t.byte_range.start >= 8 + st.header_len());
        let raw = st.raw(&t.name).expect("raw of a listed tensor");
        assert_eq!(raw.len(), t.size_bytes());
        let values = st.to_f32(&t.name).expect("to_f32 of a listed tensor");
        assert_eq!(values.len(), t.numel());
        if !t.byte_range.is_empty() {
            ranges.push(t.byte_range.clone());
        }
    }
    ranges.sort_by_key(|r| r.start);
    for pair in ranges.windows(2) {
        assert!(pair[0].end <= pair[1].start, "overlap accepted");
    }
    let _ = st.memory();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(st) = parse(bytes) {
            exercise(&st);
        }
    }

    #[test]
    fn random_headers_never_panic(
        len_prefix in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
        body in "[{}\\[\\]\":,0-9a-zA-Z_ .-]{0,80}",
        data in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut bytes = file_with_header(&body, &data);
        if let Some(n) = len_prefix {
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        if let Ok(st) = parse(bytes) {
            exercise(&st);
        }
    }

    #[test]
    fn structured_headers_never_panic(
        entries in proptest::collection::vec(
            (
                "[a-c]",
                prop_oneof![
                    Just("F32".to_string()), Just("F16".to_string()), Just("BF16".to_string()),
                    Just("U8".to_string()), Just("I64".to_string()), Just("F8_E4M3".to_string()),
                    Just("BOOL".to_string()), Just("X9".to_string()),
                ],
                proptest::collection::vec(
                    prop_oneof![0u64..4, Just(u64::MAX), Just(1u64 << 32), Just(1u64 << 62)],
                    0..4,
                ),
                prop_oneof![0u64..40, Just(u64::MAX), Just(u64::MAX - 3)],
                prop_oneof![0u64..40, Just(u64::MAX)],
            ),
            0..5,
        ),
        data_len in 0usize..40,
    ) {
        let body: Vec<String> = entries
            .iter()
            .map(|(name, dtype, shape, begin, end)| {
                format!(
                    r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{begin},{end}]}}"#
                )
            })
            .collect();
        let header = format!("{{{}}}", body.join(","));
        if let Ok(st) = parse(file_with_header(&header, &vec![1; data_len])) {
            exercise(&st);
        }
    }

    #[test]
    fn corrupted_valid_files_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in proptest::option::of(any::<prop::sample::Index>()),
        header_only in any::<bool>(),
    ) {
        let mut bytes = valid_file();
        let header_end = 8 + usize::try_from(u64::from_le_bytes(
            bytes[..8].try_into().expect("8 bytes"),
        )).expect("small header");
        for (at, byte) in edits {
            // Mostly hit the header: flips in the data section only change values.
            let span = if header_only { header_end } else { bytes.len() };
            let i = at.index(span);
            bytes[i] = byte;
        }
        if let Some(cut) = cut {
            let keep = cut.index(bytes.len() + 1);
            bytes.truncate(keep);
        }
        if let Ok(st) = parse(bytes) {
            exercise(&st);
        }
    }
}

#[test]
fn valid_fuzz_seed_parses() {
    let st = parse(valid_file()).expect("seed is valid");
    exercise(&st);
    assert_eq!(
        st.to_f32("c.f16").expect("f16"),
        vec![1.0, -2.5, f32::INFINITY, 2f32.powi(-24)]
    );
}

/// The streaming f32 writer (SaveLatent's) writes what the byte writer
/// writes, and a cancelled write leaves no file behind.
#[test]
fn f32_writer_matches_and_stops_when_cancelled() {
    use sdkit_compute::weights::write_safetensors_f32;
    let dir = tempfile::tempdir().expect("temp dir");
    let values: Vec<f32> = (0..(3 << 20)).map(|i| i as f32 * 0.5).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let shape = [3usize, 1 << 20];
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    write_safetensors(&a, &[("t", DType::F32, &shape, &bytes)], &no_meta()).expect("bytes");
    write_safetensors_f32(&b, &[("t", &shape, &values)], &no_meta(), &|| true).expect("f32");
    assert_eq!(std::fs::read(&a).expect("a"), std::fs::read(&b).expect("b"));

    let c = dir.path().join("c");
    let calls = std::cell::Cell::new(0);
    let err = write_safetensors_f32(&c, &[("t", &shape, &values)], &no_meta(), &|| {
        calls.set(calls.get() + 1);
        calls.get() < 2
    })
    .expect_err("cancelled");
    assert!(err.to_string().contains("cancelled"), "{err}");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
}

/// f32 → float8 rounding (UNETLoader's fp8 `weight_dtype`) equals
/// PyTorch's casts bit for bit on every fp8 value, the midpoints and their
/// neighbours, the overflow thresholds and random magnitudes
/// (tools/reference/fp8_cast.py).
#[test]
fn fp8_rounding_matches_torch() {
    use sdkit_compute::weights::{round_f8_e4m3, round_f8_e5m2};
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fp8/cast.json"),
    )
    .expect("fixture");
    let fx: serde_json::Value = serde_json::from_str(&text).expect("json");
    let rows = fx["rows"].as_array().expect("rows");
    assert!(rows.len() > 5000);
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    for r in rows {
        let bits = |i: usize| f32::from_bits(r[i].as_u64().expect("bits") as u32);
        let (x, e4, e5) = (bits(0), bits(1), bits(2));
        assert!(
            same(round_f8_e4m3(x), e4),
            "e4m3fn({x:e}): {:e} vs torch {e4:e}",
            round_f8_e4m3(x)
        );
        assert!(
            same(round_f8_e5m2(x), e5),
            "e5m2({x:e}): {:e} vs torch {e5:e}",
            round_f8_e5m2(x)
        );
    }
}

/// Little-endian f32s from base64.
fn b64_f32(s: &str) -> Vec<f32> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            _ => 63,
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c) << (18 - 6 * i);
        }
        for i in 0..chunk.len().saturating_sub(1) {
            out.push((acc >> (16 - 8 * i)) as u8);
        }
    }
    out.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A GGUF file with one tensor of every type sdkit reads (F32, F16, BF16,
/// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K; a 3-D and a 1-D tensor, one
/// flattened with ComfyUI-GGUF's `orig_shape`) decodes bit for bit as the
/// `gguf` Python package's `dequantize` (tools/reference/gguf_fixtures.py;
/// ±inf, −0 and subnormals included), and its metadata reads.
#[test]
fn gguf_tensors_decode_as_the_gguf_package() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/reference/gguf/");
    let file = SafeTensors::open(Path::new(&format!("{dir}quants.gguf"))).expect("opens");
    let text = std::fs::read_to_string(format!("{dir}quants.json")).expect("fixture");
    let fx: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        file.metadata()
            .get("general.architecture")
            .map(String::as_str),
        Some("flux")
    );
    assert_eq!(
        file.metadata().get("test.string").map(String::as_str),
        Some("café ✓ 東京")
    );
    let tensors = fx["tensors"].as_array().expect("tensors");
    assert_eq!(file.len(), tensors.len());
    for t in tensors {
        let name = t["name"].as_str().expect("name");
        let info = file.get(name).expect("tensor");
        let shape: Vec<usize> = t
            .get("comfy_shape")
            .unwrap_or(&t["shape"])
            .as_array()
            .expect("shape")
            .iter()
            .map(|v| v.as_u64().expect("dim") as usize)
            .collect();
        assert_eq!(info.shape, shape, "{name}");
        assert_eq!(
            info.dtype.name(),
            t["type"].as_str().expect("type"),
            "{name}"
        );
        let got = file.to_f32(name).expect("decodes");
        let want = b64_f32(t["values_f32"].as_str().expect("values"));
        assert_eq!(got.len(), want.len(), "{name}");
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()))
            .count();
        assert_eq!(differ, 0, "{name}: {differ} values differ from gguf's");
    }
}

/// ComfyUI-GGUF's default dequantization (its UnetLoaderGGUF and CLIP
/// loaders: each operation in f16) decodes bit for bit as its own code did
/// on the same file.
#[test]
fn gguf_f16_dequantization_is_comfyui_ggufs() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/reference/gguf/");
    let mut file = SafeTensors::open(Path::new(&format!("{dir}quants.gguf"))).expect("opens");
    file.set_dequant(sdkit_compute::weights::Dequant::F16);
    let text = std::fs::read_to_string(format!("{dir}quants.json")).expect("fixture");
    let fx: serde_json::Value = serde_json::from_str(&text).expect("json");
    let mut checked = 0;
    for t in fx["tensors"].as_array().expect("tensors") {
        let Some(want) = t["comfy_f16_math"]["values_f32"].as_str() else {
            continue;
        };
        let name = t["name"].as_str().expect("name");
        let got = file.to_f32(name).expect("decodes");
        let want = b64_f32(want);
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()))
            .count();
        assert_eq!(
            differ, 0,
            "{name}: {differ} values differ from ComfyUI-GGUF's"
        );
        checked += 1;
    }
    assert!(checked >= 10, "{checked} quantized tensors checked");
}

/// A truncated or malformed GGUF file is a clear error, never a panic.
#[test]
fn broken_gguf_files_are_errors() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/reference/gguf/");
    let bytes = std::fs::read(format!("{dir}quants.gguf")).expect("read");
    // The last tensor ends 16 bytes before the end (alignment padding).
    for cut in [4, 12, 24, 100, 1000, 1661, 20000, bytes.len() - 17] {
        let e = SafeTensors::from_bytes("cut.gguf", bytes[..cut].to_vec())
            .err()
            .unwrap_or_else(|| panic!("a file cut at {cut} bytes parsed"));
        assert!(e.to_string().contains("cut.gguf"), "{e}");
    }
    let mut bad = bytes.clone();
    bad[4] = 9; // version 9
    let e = SafeTensors::from_bytes("v9.gguf", bad)
        .map(|_| ())
        .expect_err("refused");
    assert!(e.to_string().contains("version 9"), "{e}");
}
