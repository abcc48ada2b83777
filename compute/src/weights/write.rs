//! Writing safetensors files (atomically).

use super::{DType, WeightError};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::Path;

/// One tensor to write: name, dtype, shape and little-endian bytes.
pub type TensorData<'a> = (&'a str, DType, &'a [usize], &'a [u8]);

/// Builds the padded header (length prefix included) for `tensors` laid out
/// back to back in the order given.
fn build_header(
    path: &Path,
    tensors: &[TensorData<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, WeightError> {
    let layout: Vec<_> = tensors
        .iter()
        .map(|&(name, dtype, shape, data)| (name, dtype, shape, data.len()))
        .collect();
    build_header_for(path, &layout, metadata)
}

/// [`build_header`] from each tensor's name, dtype, shape and byte length.
fn build_header_for(
    path: &Path,
    tensors: &[(&str, DType, &[usize], usize)],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, WeightError> {
    let invalid = |tensor: &str, reason: String| WeightError::InvalidInput {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        reason,
    };
    // The workspace enables serde_json's preserve_order, so the header lists
    // metadata first and then the tensors in data order, like other writers.
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let meta = metadata
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        header.insert("__metadata__".to_string(), Value::Object(meta));
    }
    let mut offset = 0usize;
    for &(name, dtype, shape, len) in tensors {
        if name == "__metadata__" {
            return Err(invalid(name, "the name is reserved for metadata".into()));
        }
        if header.contains_key(name) {
            return Err(invalid(name, "the name appears twice".into()));
        }
        let expected = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.size_bytes()))
            .ok_or_else(|| invalid(name, format!("shape {shape:?} overflows")))?;
        if len != expected {
            return Err(invalid(
                name,
                format!("{dtype} {shape:?} needs {expected} bytes, got {len}"),
            ));
        }
        let end = offset + len;
        let entry = serde_json::json!({
            "dtype": dtype.name(),
            "shape": shape,
            "data_offsets": [offset, end],
        });
        header.insert(name.to_string(), entry);
        offset = end;
    }
    let mut json = Value::Object(header).to_string().into_bytes();
    // Pad with spaces (valid JSON whitespace) so the data section starts
    // 8-byte aligned, as the reference writer does.
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Serializes tensors and metadata into safetensors bytes, in memory.
/// Tensors are laid out in the order given.
pub fn serialize_safetensors(
    tensors: &[TensorData<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, WeightError> {
    let mut out = build_header(Path::new("<memory>"), tensors, metadata)?;
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    Ok(out)
}

/// Writes a safetensors file, tensors laid out in the order given.
///
/// Atomic: writes a temporary file in the same directory, syncs it and
/// renames it over `path`, so a crash never leaves a half-written file and a
/// process that has the old file mapped keeps reading the old contents.
pub fn write_safetensors(
    path: &Path,
    tensors: &[TensorData<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<(), WeightError> {
    let header = build_header(path, tensors, metadata)?;
    write_atomic(path, &header, |w| {
        for (_, _, _, data) in tensors {
            w.write_all(data)?;
        }
        Ok(())
    })
}

/// One f32 tensor to write from its values: name, shape and data.
pub type F32TensorData<'a> = (&'a str, &'a [usize], &'a [f32]);

/// [`write_safetensors`] for f32 tensors given as values: they are turned
/// into bytes a block at a time while writing, so saving a large tensor
/// needs no second copy of it. `keep_going` is asked between blocks; when
/// it says no, the write stops with an `Interrupted` I/O error and leaves
/// no file.
pub fn write_safetensors_f32(
    path: &Path,
    tensors: &[F32TensorData<'_>],
    metadata: &BTreeMap<String, String>,
    keep_going: &dyn Fn() -> bool,
) -> Result<(), WeightError> {
    let layout: Vec<_> = tensors
        .iter()
        .map(|&(name, shape, data)| (name, DType::F32, shape, data.len().saturating_mul(4)))
        .collect();
    let header = build_header_for(path, &layout, metadata)?;
    write_atomic(path, &header, |w| {
        // 1 Mi values (4 MiB) a block: cancellation is seen within
        // milliseconds, and the conversion buffer stays small.
        let mut buf = Vec::with_capacity(4 << 20);
        for (_, _, data) in tensors {
            for block in data.chunks(1 << 20) {
                if !keep_going() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::Interrupted,
                        "cancelled",
                    ));
                }
                buf.clear();
                buf.extend(block.iter().flat_map(|v| v.to_le_bytes()));
                w.write_all(&buf)?;
            }
        }
        Ok(())
    })
}

/// Writes `header` and then what `body` writes to a temporary file in
/// `path`'s folder, syncs it and renames it over `path`.
///
/// The temporary file is created with mode 0666 less the umask, as
/// `File::create` does, so outputs get the same permissions as every other
/// file the user writes (tempfile's default is 0600).
fn write_atomic(
    path: &Path,
    header: &[u8],
    body: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), WeightError> {
    let io = |source| WeightError::Io {
        path: path.to_path_buf(),
        source,
    };
    // A pid-named temporary (see `atomic`), so that one a killed process
    // leaves is removed at the next start; on error it is removed on drop.
    let mut tmp = crate::atomic::TempFile::beside(path).map_err(io)?;
    {
        let mut w = BufWriter::new(tmp.file().map_err(io)?);
        w.write_all(header).map_err(io)?;
        body(&mut w).map_err(io)?;
        w.flush().map_err(io)?;
    }
    tmp.persist(path).map_err(io)?;
    Ok(())
}
