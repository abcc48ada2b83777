//! Weight files: `.safetensors` checkpoints, memory-mapped and read lazily.
//!
//! Checkpoints are multi-gigabyte single files. [`SafeTensors::open`] maps
//! the file and parses only its JSON header; the bytes of a tensor are
//! touched (and so paged in by the OS) only when [`SafeTensors::raw`] or
//! [`SafeTensors::to_f32`] asks for that tensor. A [`WeightStore`] then puts
//! several files behind one name space (a checkpoint plus a separate VAE, say)
//! so model code asks for `first_stage_model.decoder.conv_in.weight` without
//! knowing which file holds it.
//!
//! # Format
//!
//! A safetensors file is an 8-byte little-endian header length `N`, then `N`
//! bytes of UTF-8 JSON, then the data section:
//!
//! ```text
//! {"name": {"dtype": "F16", "shape": [320, 4, 3, 3], "data_offsets": [begin, end]},
//!  "__metadata__": {"format": "pt"}}
//! ```
//!
//! Offsets are relative to the first byte after the header. Every field is
//! untrusted: lengths, offsets and shapes are checked (with overflow checks)
//! and a bad file gives a [`WeightError`] naming the file and the tensor,
//! never a panic. Tensors may leave gaps between them (only overlaps are
//! refused), and nothing requires offsets to be aligned: all conversion reads
//! bytes with `from_le_bytes`.
//!
//! # Pickle checkpoints
//!
//! `.ckpt`, `.pt`, `.pth` and `.bin` files are Python pickles (often inside a
//! zip archive), and loading a pickle can run arbitrary code. They are refused
//! with [`WeightError::PickleRefused`], recognized by extension and, for any
//! file that is not a valid safetensors file, by magic bytes; they are never
//! unpickled.

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Largest header accepted. Real headers are well under 10 MiB even for
/// checkpoints with tens of thousands of tensors; the limit keeps a corrupt
/// length from making the JSON parser allocate gigabytes.
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// Extensions of pickle-based PyTorch checkpoints, compared case-insensitively.
pub const PICKLE_EXTENSIONS: [&str; 6] = ["ckpt", "pt", "pth", "bin", "pkl", "pickle"];

/// Errors from reading or writing weight files. Every variant names the file
/// (`path`; the name given to [`SafeTensors::from_bytes`] for in-memory data)
/// and, where one is involved, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// Opening, mapping or writing the file failed.
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A pickle checkpoint: refused without being unpickled.
    #[error(
        "{}: refusing to load {kind}: pickle checkpoints (.ckpt, .pt, .pth, .bin) can execute \
         arbitrary code when loaded, so sdkit never unpickles them; convert the file to \
         .safetensors with a tool you trust and load that instead",
        .path.display()
    )]
    PickleRefused { path: PathBuf, kind: &'static str },
    /// Shorter than the 8-byte header length.
    #[error("{}: {len} bytes is too short for a safetensors file (needs an 8-byte header length)", .path.display())]
    FileTooShort { path: PathBuf, len: u64 },
    /// The header length is over [`MAX_HEADER_BYTES`].
    #[error("{}: header length {header_len} is over the {limit}-byte limit; the file is corrupt or not safetensors", .path.display())]
    HeaderTooLarge {
        path: PathBuf,
        header_len: u64,
        limit: u64,
    },
    /// The header length points past the end of the file.
    #[error("{}: header length {header_len} runs past the end of the {file_len}-byte file; the file is truncated or not safetensors", .path.display())]
    HeaderOutOfRange {
        path: PathBuf,
        header_len: u64,
        file_len: u64,
    },
    /// The header is not UTF-8.
    #[error("{}: header is not valid UTF-8: {source}", .path.display())]
    HeaderNotUtf8 {
        path: PathBuf,
        #[source]
        source: std::str::Utf8Error,
    },
    /// The header is not JSON, or not a JSON object.
    #[error("{}: header is not a valid JSON object: {source}", .path.display())]
    InvalidJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The header names the same tensor (or `__metadata__`) twice.
    #[error("{}: header lists {tensor:?} more than once", .path.display())]
    DuplicateTensor { path: PathBuf, tensor: String },
    /// A tensor entry lacks `dtype`, `shape` or `data_offsets`, or one of
    /// them has the wrong JSON type.
    #[error("{}: tensor {tensor:?}: {reason}", .path.display())]
    InvalidTensorEntry {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    /// `__metadata__` is not an object of strings.
    #[error("{}: __metadata__: {reason}", .path.display())]
    InvalidMetadata { path: PathBuf, reason: String },
    /// A dtype this crate does not know (sub-byte float formats, say).
    #[error("{}: tensor {tensor:?} has unsupported dtype {dtype:?}", .path.display())]
    UnknownDType {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    /// The element count or byte size of the shape does not fit in `usize`.
    #[error("{}: tensor {tensor:?}: shape {shape:?} of {dtype} overflows the address space", .path.display())]
    ShapeOverflow {
        path: PathBuf,
        tensor: String,
        dtype: DType,
        shape: Vec<usize>,
    },
    /// `data_offsets` has `begin > end`.
    #[error("{}: tensor {tensor:?}: data_offsets [{begin}, {end}] end before they begin", .path.display())]
    InvalidOffsets {
        path: PathBuf,
        tensor: String,
        begin: u64,
        end: u64,
    },
    /// `data_offsets` runs past the end of the data section.
    #[error("{}: tensor {tensor:?}: data_offsets [{begin}, {end}] run past the {data_len}-byte data section; the file is truncated or corrupt", .path.display())]
    OffsetsOutOfRange {
        path: PathBuf,
        tensor: String,
        begin: u64,
        end: u64,
        data_len: u64,
    },
    /// The byte range does not match dtype size × element count.
    #[error("{}: tensor {tensor:?}: {dtype} {shape:?} needs {expected} bytes but data_offsets span {actual}", .path.display())]
    SizeMismatch {
        path: PathBuf,
        tensor: String,
        dtype: DType,
        shape: Vec<usize>,
        expected: usize,
        actual: u64,
    },
    /// Two tensors share bytes.
    #[error("{}: tensors {tensor:?} and {other:?} overlap", .path.display())]
    Overlap {
        path: PathBuf,
        tensor: String,
        other: String,
    },
    /// No tensor of that name in this file.
    #[error("{}: no tensor named {tensor:?}", .path.display())]
    TensorNotFound { path: PathBuf, tensor: String },
    /// No tensor of that name in a [`WeightStore`]; `detail` says where it
    /// was looked for.
    #[error("no tensor named {tensor:?} in the weight store: {detail}")]
    NotInStore { tensor: String, detail: String },
    /// [`write_safetensors`] was given something it cannot write.
    #[error("{}: cannot write tensor {tensor:?}: {reason}", .path.display())]
    InvalidInput {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
}

/// Element types of safetensors files, named as the format names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    Bool,
    U8,
    I8,
    /// 8-bit float, 4 exponent bits, 3 mantissa bits, no infinities
    /// (PyTorch's `float8_e4m3fn`; Flux fp8 checkpoints use it).
    F8E4M3,
    /// 8-bit float, 5 exponent bits, 2 mantissa bits (the top byte of an f16).
    F8E5M2,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    I64,
    U64,
    F64,
}

impl DType {
    /// Every dtype, in the order declared.
    pub const ALL: [DType; 15] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I16,
        DType::U16,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::F32,
        DType::I64,
        DType::U64,
        DType::F64,
    ];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// The name used in safetensors headers (`"F16"`, `"BF16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::F32 => "F32",
            DType::I64 => "I64",
            DType::U64 => "U64",
            DType::F64 => "F64",
        }
    }

    /// Parses a header dtype name; `None` for names this crate does not know.
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Whether the type is a floating-point format.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F8E4M3 | DType::F8E5M2 | DType::F16 | DType::BF16 | DType::F32 | DType::F64
        )
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where one tensor lives in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The name in the file's header.
    pub name: String,
    pub dtype: DType,
    /// Row-major dimensions; empty for a scalar.
    pub shape: Vec<usize>,
    /// Absolute byte range within the file (header included), so a reader
    /// can also `pread` it without the mapping. Its length is always
    /// `numel() * dtype.size_bytes()`.
    pub byte_range: Range<usize>,
}

impl TensorInfo {
    /// Number of elements (1 for a scalar). Cannot overflow: checked when
    /// the header was parsed.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes the tensor occupies in the file.
    pub fn size_bytes(&self) -> usize {
        self.byte_range.len()
    }
}

/// The bytes behind a [`SafeTensors`]: a file mapping, or a buffer.
enum Backing {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// One safetensors file: its parsed header and its (mapped) bytes.
///
/// `Send + Sync`: tensors can be read from several threads at once.
pub struct SafeTensors {
    path: PathBuf,
    backing: Backing,
    header_len: usize,
    tensors: BTreeMap<String, TensorInfo>,
    metadata: BTreeMap<String, String>,
}

impl fmt::Debug for SafeTensors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The bytes are gigabytes; show what identifies the file.
        f.debug_struct("SafeTensors")
            .field("path", &self.path)
            .field("file_len", &self.file_len())
            .field("tensors", &self.tensors.len())
            .field("metadata", &self.metadata)
            .finish()
    }
}

impl SafeTensors {
    /// Maps the file and parses its header; reads no tensor data.
    ///
    /// Pickle checkpoints (see [`PICKLE_EXTENSIONS`]) are refused by their
    /// extension before the file is opened, and by their magic bytes if a
    /// file under another name is not valid safetensors.
    pub fn open(path: &Path) -> Result<Self, WeightError> {
        if let Some(ext) = path.extension().and_then(|e| e.to_str()) {
            if PICKLE_EXTENSIONS
                .iter()
                .any(|p| p.eq_ignore_ascii_case(ext))
            {
                return Err(WeightError::PickleRefused {
                    path: path.to_path_buf(),
                    kind: "a pickle checkpoint (by its extension)",
                });
            }
        }
        let io = |source| WeightError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < 8 {
            // Too short to hold a header (it may still be a tiny pickle, which
            // the parse reports). Read rather than map: some platforms refuse
            // to map an empty file.
            let bytes = std::fs::read(path).map_err(io)?;
            return Self::from_backing(path.to_path_buf(), Backing::Owned(bytes));
        }
        // SAFETY: `Mmap::map` is unsafe because the mapping aliases the file:
        // if another process truncates or rewrites it while mapped, reads see
        // the change or fault. We accept that here because checkpoints are
        // large read-only model files nobody edits while they are loaded, and
        // copying gigabytes into memory up front would defeat lazy loading
        // (the official safetensors loader makes the same trade). Our own
        // writer never rewrites a file in place: it writes a temporary file
        // and renames it over, which leaves existing mappings intact. The
        // mapping is read-only, and all parsing treats its bytes as untrusted.
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::from_backing(path.to_path_buf(), Backing::Mapped(map))
    }

    /// Parses a safetensors file held in memory. `name` stands for the path
    /// in errors. Pickle data is recognized by its magic bytes.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self, WeightError> {
        Self::from_backing(PathBuf::from(name), Backing::Owned(bytes))
    }

    fn from_backing(path: PathBuf, backing: Backing) -> Result<Self, WeightError> {
        let bytes = backing.bytes();
        let parsed = match parse_header(&path, bytes) {
            Ok(parsed) => parsed,
            // Only a file that is not valid safetensors is sniffed: a valid
            // header whose length happens to start with 0x80 stays valid.
            Err(err) => {
                return Err(match pickle_kind(bytes) {
                    Some(kind) => WeightError::PickleRefused { path, kind },
                    None => err,
                })
            }
        };
        Ok(SafeTensors {
            path,
            header_len: parsed.header_len,
            tensors: parsed.tensors,
            metadata: parsed.metadata,
            backing,
        })
    }

    /// The path the file was opened from (or the name given to
    /// [`SafeTensors::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size of the whole file in bytes.
    pub fn file_len(&self) -> usize {
        self.backing.bytes().len()
    }

    /// Length `N` of the JSON header (the data section starts at `8 + N`).
    pub fn header_len(&self) -> usize {
        self.header_len
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the file holds no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// All tensors, sorted by name.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.tensors.values()
    }

    /// The tensor of that name, if any.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Names starting with `prefix`, sorted.
    pub fn keys_with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.tensors
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .map(|(k, _)| k.as_str())
            .take_while(move |k| k.starts_with(prefix))
    }

    /// The `__metadata__` strings (empty if the file has none).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Sum of the tensors' sizes in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.size_bytes() as u64).sum()
    }

    /// The little-endian bytes of one tensor. For a mapped file this touches
    /// only that tensor's pages. Not necessarily aligned to the element size.
    pub fn raw(&self, name: &str) -> Result<&[u8], WeightError> {
        let info = self.get(name).ok_or_else(|| WeightError::TensorNotFound {
            path: self.path.clone(),
            tensor: name.to_string(),
        })?;
        self.raw_of(info)
    }

    fn raw_of(&self, info: &TensorInfo) -> Result<&[u8], WeightError> {
        // The range was checked against the length when parsing; `get`
        // keeps even a broken invariant from panicking.
        self.backing
            .bytes()
            .get(info.byte_range.clone())
            .ok_or_else(|| WeightError::OffsetsOutOfRange {
                path: self.path.clone(),
                tensor: info.name.clone(),
                begin: info.byte_range.start as u64,
                end: info.byte_range.end as u64,
                data_len: self.file_len() as u64,
            })
    }

    /// One tensor converted to `f32`, row-major.
    ///
    /// Float formats convert exactly (f16, bf16 and f8 values are all
    /// representable in f32, subnormals, infinities and NaNs included); f64
    /// and integers wider than 24 bits round to nearest; `BOOL` gives 0 or 1.
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>, WeightError> {
        let info = self.get(name).ok_or_else(|| WeightError::TensorNotFound {
            path: self.path.clone(),
            tensor: name.to_string(),
        })?;
        Ok(decode_f32(info.dtype, self.raw_of(info)?))
    }

    /// Size estimate for planning: see [`Memory`].
    pub fn memory(&self) -> Memory {
        Memory::of(self.tensors.values())
    }
}

/// Sizes of a set of tensors, for memory planning.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Memory {
    /// Number of tensors.
    pub tensors: usize,
    /// Bytes as stored (what resident weights in their own dtype take).
    pub bytes: u64,
    /// Bytes if every tensor were converted to f32.
    pub f32_bytes: u64,
    /// Stored bytes per dtype (a mixed f16/f32 checkpoint shows both).
    pub by_dtype: BTreeMap<DType, u64>,
}

impl Memory {
    fn of<'a>(tensors: impl Iterator<Item = &'a TensorInfo>) -> Memory {
        let mut m = Memory::default();
        for t in tensors {
            m.tensors += 1;
            m.bytes += t.size_bytes() as u64;
            m.f32_bytes += t.numel() as u64 * 4;
            *m.by_dtype.entry(t.dtype).or_insert(0) += t.size_bytes() as u64;
        }
        m
    }
}

/// What [`parse_header`] found.
struct Parsed {
    header_len: usize,
    tensors: BTreeMap<String, TensorInfo>,
    metadata: BTreeMap<String, String>,
}

/// The header's top-level entries in file order, duplicates kept: a
/// `serde_json::Map` would silently keep only the last of two equal keys,
/// and a file that names a tensor twice is corrupt.
struct Entries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, Value>()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        d.deserialize_map(EntriesVisitor)
    }
}

fn parse_header(path: &Path, bytes: &[u8]) -> Result<Parsed, WeightError> {
    let Some(len_bytes) = bytes.first_chunk::<8>() else {
        return Err(WeightError::FileTooShort {
            path: path.to_path_buf(),
            len: bytes.len() as u64,
        });
    };
    let header_len = u64::from_le_bytes(*len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(WeightError::HeaderTooLarge {
            path: path.to_path_buf(),
            header_len,
            limit: MAX_HEADER_BYTES,
        });
    }
    let out_of_range = || WeightError::HeaderOutOfRange {
        path: path.to_path_buf(),
        header_len,
        file_len: bytes.len() as u64,
    };
    let header_end = usize::try_from(header_len)
        .ok()
        .and_then(|n| n.checked_add(8))
        .ok_or_else(out_of_range)?;
    let header = bytes.get(8..header_end).ok_or_else(out_of_range)?;
    let header = std::str::from_utf8(header).map_err(|source| WeightError::HeaderNotUtf8 {
        path: path.to_path_buf(),
        source,
    })?;
    // serde_json's recursion limit keeps deeply nested junk from
    // overflowing the stack.
    let Entries(entries) =
        serde_json::from_str(header).map_err(|source| WeightError::InvalidJson {
            path: path.to_path_buf(),
            source,
        })?;
    let data_len = bytes.len() - header_end;

    let mut tensors = BTreeMap::new();
    let mut metadata = None;
    for (name, value) in entries {
        let duplicate = || WeightError::DuplicateTensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
        };
        if name == "__metadata__" {
            if metadata.is_some() {
                return Err(duplicate());
            }
            metadata = Some(parse_metadata(path, &value)?);
            continue;
        }
        if tensors.contains_key(&name) {
            return Err(duplicate());
        }
        let info = parse_entry(path, &name, &value, header_end, data_len)?;
        tensors.insert(name, info);
    }
    check_overlaps(path, &tensors)?;
    Ok(Parsed {
        header_len: header_end - 8,
        tensors,
        metadata: metadata.unwrap_or_default(),
    })
}

fn parse_metadata(path: &Path, value: &Value) -> Result<BTreeMap<String, String>, WeightError> {
    let invalid = |reason: String| WeightError::InvalidMetadata {
        path: path.to_path_buf(),
        reason,
    };
    let object = value
        .as_object()
        .ok_or_else(|| invalid(format!("expected an object of strings, found {value}")))?;
    object
        .iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k.clone(), s.clone())),
            other => Err(invalid(format!(
                "value of {k:?} must be a string, found {other}"
            ))),
        })
        .collect()
}

fn parse_entry(
    path: &Path,
    name: &str,
    value: &Value,
    header_end: usize,
    data_len: usize,
) -> Result<TensorInfo, WeightError> {
    let invalid = |reason: &str| WeightError::InvalidTensorEntry {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        reason: reason.to_string(),
    };
    // Extra keys are ignored, as other readers do.
    let entry = value
        .as_object()
        .ok_or_else(|| invalid("expected an object with dtype, shape and data_offsets"))?;
    let dtype_name = entry
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("\"dtype\" is missing or not a string"))?;
    let dtype = DType::from_name(dtype_name).ok_or_else(|| WeightError::UnknownDType {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        dtype: dtype_name.to_string(),
    })?;
    let shape = entry
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("\"shape\" is missing or not an array"))?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| invalid("\"shape\" must hold non-negative integers"))?;
    let offsets = entry
        .get("data_offsets")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("\"data_offsets\" is missing or not an array"))?;
    let (begin, end) = match offsets.as_slice() {
        [b, e] => b.as_u64().zip(e.as_u64()),
        _ => None,
    }
    .ok_or_else(|| invalid("\"data_offsets\" must be two non-negative integers"))?;

    let expected = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.size_bytes()))
        .ok_or_else(|| WeightError::ShapeOverflow {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            dtype,
            shape: shape.clone(),
        })?;
    if begin > end {
        return Err(WeightError::InvalidOffsets {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            begin,
            end,
        });
    }
    if end > data_len as u64 {
        return Err(WeightError::OffsetsOutOfRange {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            begin,
            end,
            data_len: data_len as u64,
        });
    }
    if end - begin != expected as u64 {
        return Err(WeightError::SizeMismatch {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            dtype,
            shape,
            expected,
            actual: end - begin,
        });
    }
    // end <= data_len, and header_end + data_len is the file length, so
    // these fit in usize.
    let byte_range = header_end + begin as usize..header_end + end as usize;
    Ok(TensorInfo {
        name: name.to_string(),
        dtype,
        shape,
        byte_range,
    })
}

/// Gaps between tensors are allowed; shared bytes are not. Empty tensors
/// occupy no bytes and so overlap nothing.
fn check_overlaps(path: &Path, tensors: &BTreeMap<String, TensorInfo>) -> Result<(), WeightError> {
    let mut ranges: Vec<&TensorInfo> = tensors.values().filter(|t| t.size_bytes() > 0).collect();
    ranges.sort_by_key(|t| (t.byte_range.start, t.byte_range.end));
    // The tensor reaching furthest so far: sorted by start, a range
    // overlaps an earlier one exactly when it starts before that end.
    let mut furthest: Option<&TensorInfo> = None;
    for t in ranges {
        if let Some(prev) = furthest {
            if t.byte_range.start < prev.byte_range.end {
                return Err(WeightError::Overlap {
                    path: path.to_path_buf(),
                    tensor: t.name.clone(),
                    other: prev.name.clone(),
                });
            }
        }
        furthest = match furthest {
            Some(prev) if prev.byte_range.end >= t.byte_range.end => Some(prev),
            _ => Some(t),
        };
    }
    Ok(())
}

/// What the magic bytes say about a file that is not valid safetensors.
fn pickle_kind(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        // torch.save since PyTorch 1.6: a zip archive holding data.pkl.
        [b'P', b'K', 3, 4, ..] => Some("a zip archive (a torch.save checkpoint)"),
        // Pickle protocols 2 to 5 start with the PROTO opcode 0x80 and the
        // protocol number; older torch.save files are bare pickles.
        [0x80, 2..=5, ..] => Some("a pickle stream"),
        _ => None,
    }
}

/// Exact f16 → f32: every f16 is representable in f32, so this only moves
/// the fields, renormalizing subnormals.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: man · 2^-24. Shift the leading one up to bit 10
            // (the implicit bit's place); each shift lowers the exponent.
            let shift = man.leading_zeros() - 21;
            let man = (man << shift) & 0x3ff;
            sign | ((113 - shift) << 23) | (man << 13)
        }
        // Infinity, or NaN with its payload (and quiet bit) kept in place.
        (0x1f, _) => sign | 0x7f80_0000 | (man << 13),
        // Normal: rebias the exponent from 15 to 127.
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Exact bf16 → f32: bf16 is the top half of an f32.
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Exact f8 E5M2 → f32: E5M2 is the top byte of an f16.
pub fn f8_e5m2_to_f32(b: u8) -> f32 {
    f16_to_f32(u16::from(b) << 8)
}

/// f32 rounded to the nearest f16 (ties to even, as PyTorch's cast).
pub fn round_f16(x: f32) -> f32 {
    f16_to_f32(crate::backend::wgpu::f32_to_f16_bits(x))
}

/// The f32 → `dtype` → f32 rounding of a float storage dtype, if it
/// rounds.
pub fn rounding(dtype: DType) -> Option<fn(f32) -> f32> {
    match dtype {
        DType::F16 => Some(round_f16),
        DType::F8E4M3 => Some(round_f8_e4m3),
        DType::F8E5M2 => Some(round_f8_e5m2),
        _ => None,
    }
}

/// f32 rounded to the nearest `float8_e4m3fn` value (ties to even), as
/// PyTorch casts: the format has no infinities, and larger magnitudes
/// (infinities included) saturate at ±448; the sign of zero kept.
pub fn round_f8_e4m3(x: f32) -> f32 {
    round_f8(x, 3, -6, 448.0, 448.0)
}

/// f32 rounded to the nearest `float8_e5m2` value (ties to even), as
/// PyTorch casts: magnitudes that round past 57344 become infinite.
pub fn round_f8_e5m2(x: f32) -> f32 {
    round_f8(x, 2, -14, 57344.0, f32::INFINITY)
}

/// Round to a float with `man` mantissa bits, smallest normal exponent
/// `min_exp` (subnormals below it), largest finite value `max`; `over`
/// for magnitudes that round beyond it. Exact: f64 holds every step.
fn round_f8(x: f32, man: i32, min_exp: i32, max: f64, over: f32) -> f32 {
    if x.is_nan() || x == 0.0 {
        return x;
    }
    if x.is_infinite() {
        return over.copysign(x);
    }
    let a = f64::from(x.abs());
    // The f32's own binary exponent (subnormal f32s are far below min_exp).
    let e = ((((x.to_bits() >> 23) & 0xff) as i32) - 127).max(min_exp);
    let ulp = (2f64).powi(e - man);
    let q = (a / ulp).round_ties_even() * ulp;
    let r = if q > max { over } else { q as f32 };
    if x < 0.0 {
        -r
    } else {
        r
    }
}

/// Exact f8 E4M3 (`float8_e4m3fn`) → f32: bias 7, no infinities, and only
/// `S.1111.111` is NaN, so exponent 15 still holds finite values (up to 448).
pub fn f8_e4m3_to_f32(b: u8) -> f32 {
    let sign = u32::from(b & 0x80) << 24;
    let exp = u32::from((b >> 3) & 0xf);
    let man = u32::from(b & 0x7);
    let bits = match (exp, man) {
        (0xf, 0x7) => sign | 0x7fc0_0000,
        (0, _) => {
            // Subnormal: man · 2^-9, exact in f32 (small integer times a
            // power of two); `sign` keeps -0.
            return f32::from_bits(sign | ((man as f32) * (1.0 / 512.0)).to_bits());
        }
        _ => sign | ((exp + 120) << 23) | (man << 20),
    };
    f32::from_bits(bits)
}

/// Converts elements of `N` little-endian bytes; reads byte by byte, so the
/// slice need not be aligned. Large tensors convert on every core: the CPU
/// backend reads each weight from the file at every use.
fn decode_with<const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> f32 + Sync) -> Vec<f32> {
    use rayon::prelude::*;
    let one = |c: &[u8]| {
        let mut a = [0u8; N];
        a.copy_from_slice(c);
        f(a)
    };
    if bytes.len() < (1 << 20) {
        bytes.chunks_exact(N).map(one).collect()
    } else {
        bytes.par_chunks_exact(N).map(one).collect()
    }
}

/// f16 → f32 for every bit pattern (256 KiB), so a conversion is one
/// load: weights are converted at every use on the CPU.
fn f16_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(f16_to_f32).collect())
}

/// Converts a tensor's bytes to f32 (see [`SafeTensors::to_f32`]).
fn decode_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::Bool => decode_with(bytes, |[b]: [u8; 1]| if b != 0 { 1.0 } else { 0.0 }),
        DType::U8 => decode_with(bytes, |[b]: [u8; 1]| f32::from(b)),
        DType::I8 => decode_with(bytes, |b: [u8; 1]| f32::from(i8::from_le_bytes(b))),
        DType::F8E4M3 => decode_with(bytes, |[b]: [u8; 1]| f8_e4m3_to_f32(b)),
        DType::F8E5M2 => decode_with(bytes, |[b]: [u8; 1]| f8_e5m2_to_f32(b)),
        DType::I16 => decode_with(bytes, |b| f32::from(i16::from_le_bytes(b))),
        DType::U16 => decode_with(bytes, |b| f32::from(u16::from_le_bytes(b))),
        DType::F16 => {
            let table = f16_table();
            decode_with(bytes, |b| table[usize::from(u16::from_le_bytes(b))])
        }
        DType::BF16 => decode_with(bytes, |b| bf16_to_f32(u16::from_le_bytes(b))),
        // Wider integers round to nearest, which `as` does.
        DType::I32 => decode_with(bytes, |b| i32::from_le_bytes(b) as f32),
        DType::U32 => decode_with(bytes, |b| u32::from_le_bytes(b) as f32),
        DType::F32 => decode_with(bytes, f32::from_le_bytes),
        DType::I64 => decode_with(bytes, |b| i64::from_le_bytes(b) as f32),
        DType::U64 => decode_with(bytes, |b| u64::from_le_bytes(b) as f32),
        DType::F64 => decode_with(bytes, |b| f64::from_le_bytes(b) as f32),
    }
}

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

/// Where a store name resolved to.
#[derive(Debug, Clone, Copy)]
pub struct Resolved<'a> {
    pub file: &'a SafeTensors,
    /// The tensor; `info.name` is its name in `file`, which differs from the
    /// store name when the mount remaps prefixes.
    pub info: &'a TensorInfo,
}

impl Resolved<'_> {
    /// The tensor's bytes (see [`SafeTensors::raw`]).
    pub fn raw(&self) -> Result<&[u8], WeightError> {
        self.file.raw_of(self.info)
    }

    /// The tensor in f32 (see [`SafeTensors::to_f32`]).
    pub fn to_f32(&self) -> Result<Vec<f32>, WeightError> {
        Ok(decode_f32(self.info.dtype, self.raw()?))
    }
}

/// A tensor left in its file, in its stored dtype, until a kernel needs
/// it: the CPU backend converts it to f32 for the kernels that read it and
/// drops the copy after the last one, so no f32 copy of a model lives
/// beside the memory-mapped file.
#[derive(Debug, Clone)]
pub struct StoredWeight {
    file: Arc<SafeTensors>,
    key: String,
    dtype: DType,
    len: usize,
    /// Read as if stored in this (narrower) dtype: UNETLoader's fp8
    /// `weight_dtype` (ComfyUI casts the weights to it when loading and
    /// back to the compute dtype per layer).
    cast: Option<DType>,
}

impl StoredWeight {
    /// The dtype it is read as if cast to, if any.
    pub fn cast(&self) -> Option<DType> {
        self.cast
    }

    /// The same tensor read as if cast to `dtype` first (F16, F8E4M3 or
    /// F8E5M2; other dtypes read as stored).
    pub fn cast_to(mut self, dtype: DType) -> Self {
        self.cast = Some(dtype);
        self
    }

    fn finish(&self, mut v: Vec<f32>) -> Vec<f32> {
        if self.cast == Some(self.dtype) {
            return v;
        }
        if let Some(round) = self.cast.and_then(rounding) {
            v.iter_mut().for_each(|x| *x = round(*x));
        }
        v
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The file it is read from.
    pub fn file(&self) -> &Arc<SafeTensors> {
        &self.file
    }

    /// Its name in that file.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The tensor in f32 (see [`SafeTensors::to_f32`]).
    pub fn to_f32(&self) -> Result<Vec<f32>, WeightError> {
        Ok(self.finish(self.file.to_f32(&self.key)?))
    }

    /// Elements `[start, start + len)` in f32, the rest left unread.
    pub fn range_f32(&self, start: usize, len: usize) -> Result<Vec<f32>, WeightError> {
        let size = self.dtype.size_bytes();
        let raw = self.file.raw(&self.key)?;
        let bytes = start
            .checked_add(len)
            .filter(|&end| end <= self.len)
            .and_then(|end| raw.get(start * size..end * size))
            .ok_or_else(|| WeightError::NotInStore {
                tensor: self.key.clone(),
                detail: format!(
                    "elements {start}..{} are outside its {} elements",
                    start.saturating_add(len),
                    self.len
                ),
            })?;
        Ok(self.finish(decode_f32(self.dtype, bytes)))
    }
}

#[derive(Debug)]
struct Mount {
    file: Arc<SafeTensors>,
    from: String,
    to: String,
}

/// One name space over several weight files.
///
/// Each [`mount`](WeightStore::mount) makes the tensors of a file whose
/// names start with `from` visible under `to` instead (`from + rest` is seen
/// as `to + rest`). A later mount *shadows* everything under its `to` prefix
/// from earlier mounts, whole: mounting a separate VAE at
/// `first_stage_model.` replaces the checkpoint's VAE rather than mixing
/// the two, and a name under that prefix the VAE lacks is missing, not
/// taken from the checkpoint.
///
/// ```no_run
/// # use sdkit_compute::weights::*;
/// # use std::path::Path;
/// # fn main() -> Result<(), WeightError> {
/// let mut store = WeightStore::new();
/// store.open_mount(Path::new("sd15.safetensors"), "", "")?;
/// store.open_mount(Path::new("vae.safetensors"), "", "first_stage_model.")?;
/// let w = store.to_f32("first_stage_model.decoder.conv_in.weight")?;
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct WeightStore {
    mounts: Vec<Mount>,
}

impl WeightStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `file`'s tensors named `from + rest` visible as `to + rest`,
    /// shadowing earlier mounts under `to`. A file may be mounted several
    /// times with different prefixes.
    pub fn mount(&mut self, file: Arc<SafeTensors>, from: &str, to: &str) {
        self.mounts.push(Mount {
            file,
            from: from.to_string(),
            to: to.to_string(),
        });
    }

    /// Opens `path` and mounts it; returns the file for further mounts.
    pub fn open_mount(
        &mut self,
        path: &Path,
        from: &str,
        to: &str,
    ) -> Result<Arc<SafeTensors>, WeightError> {
        let file = Arc::new(SafeTensors::open(path)?);
        self.mount(Arc::clone(&file), from, to);
        Ok(file)
    }

    /// The files mounted, in mount order (a file mounted twice appears twice).
    pub fn files(&self) -> impl Iterator<Item = &Arc<SafeTensors>> {
        self.mounts.iter().map(|m| &m.file)
    }

    /// The mount that owns `name`: the latest whose `to` prefixes it.
    fn owner(&self, name: &str) -> Option<(&Mount, String)> {
        self.mounts.iter().rev().find_map(|m| {
            name.strip_prefix(m.to.as_str())
                .map(|rest| (m, format!("{}{rest}", m.from)))
        })
    }

    /// Where `name` resolves to, if anywhere.
    pub fn get(&self, name: &str) -> Option<Resolved<'_>> {
        let (mount, key) = self.owner(name)?;
        let info = mount.file.get(&key)?;
        Some(Resolved {
            file: &mount.file,
            info,
        })
    }

    /// Whether `name` resolves.
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Like [`get`](Self::get), with an error saying where it looked.
    pub fn resolve(&self, name: &str) -> Result<Resolved<'_>, WeightError> {
        let not_found = |detail: String| WeightError::NotInStore {
            tensor: name.to_string(),
            detail,
        };
        let Some((mount, key)) = self.owner(name) else {
            let prefixes: Vec<String> = self
                .mounts
                .iter()
                .map(|m| format!("{:?} ({})", m.to, m.file.path().display()))
                .collect();
            return Err(not_found(if prefixes.is_empty() {
                "nothing is mounted".to_string()
            } else {
                format!(
                    "no mount covers it; mounted prefixes: {}",
                    prefixes.join(", ")
                )
            }));
        };
        let info = mount.file.get(&key).ok_or_else(|| {
            not_found(format!(
                "it maps to {key:?} in {}, which has no such tensor",
                mount.file.path().display()
            ))
        })?;
        Ok(Resolved {
            file: &mount.file,
            info,
        })
    }

    /// A handle on the tensor `name` that reads it when asked.
    pub fn stored(&self, name: &str) -> Result<StoredWeight, WeightError> {
        let r = self.resolve(name)?;
        let (mount, key) = self.owner(name).ok_or_else(|| WeightError::NotInStore {
            tensor: name.to_string(),
            detail: "no mount covers it".to_string(),
        })?;
        Ok(StoredWeight {
            file: Arc::clone(&mount.file),
            key,
            dtype: r.info.dtype,
            len: r.info.numel(),
            cast: None,
        })
    }

    /// The bytes of a tensor (see [`SafeTensors::raw`]).
    pub fn raw(&self, name: &str) -> Result<&[u8], WeightError> {
        let r = self.resolve(name)?;
        r.file.raw_of(r.info)
    }

    /// A tensor in f32 (see [`SafeTensors::to_f32`]).
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>, WeightError> {
        self.resolve(name)?.to_f32()
    }

    /// Every visible name with where it resolves, sorted by name.
    pub fn entries(&self) -> Vec<(String, Resolved<'_>)> {
        let mut out = Vec::new();
        for (i, m) in self.mounts.iter().enumerate() {
            let later = &self.mounts[i + 1..];
            for key in m.file.keys_with_prefix(&m.from) {
                let Some(rest) = key.strip_prefix(m.from.as_str()) else {
                    continue;
                };
                let name = format!("{}{rest}", m.to);
                // Shadowed by a later mount: that mount answers for it.
                if later.iter().any(|l| name.starts_with(l.to.as_str())) {
                    continue;
                }
                if let Some(info) = m.file.get(key) {
                    out.push((
                        name,
                        Resolved {
                            file: &m.file,
                            info,
                        },
                    ));
                }
            }
        }
        // A visible name comes from exactly one mount (the owner), so
        // there are no duplicates to remove.
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Every visible name, sorted.
    pub fn names(&self) -> Vec<String> {
        self.entries().into_iter().map(|(n, _)| n).collect()
    }

    /// Visible names starting with `prefix`, sorted.
    pub fn keys_with_prefix(&self, prefix: &str) -> Vec<String> {
        self.entries()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| n.starts_with(prefix))
            .collect()
    }

    /// Bytes of all visible tensors as stored.
    pub fn total_bytes(&self) -> u64 {
        self.memory().bytes
    }

    /// Size estimate of all visible tensors (see [`Memory`]).
    pub fn memory(&self) -> Memory {
        let entries = self.entries();
        Memory::of(entries.iter().map(|(_, r)| r.info))
    }
}
