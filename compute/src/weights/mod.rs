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
//! `.ckpt`, `.pt`, `.pth` and `.bin` files are `torch.save` pickles, and
//! unpickling one with Python can run arbitrary code. They are read here by
//! a restricted reader ([`pickle`], [`torch_file`]) that builds only
//! tensors and plain containers and executes nothing; a file that names any
//! other global is refused with [`WeightError::PickleRefused`], naming it.
//! Their tensors are then byte ranges of the mapped file like a
//! safetensors file's, so everything above this module sees one kind of
//! file.

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

mod convert;
mod gguf;
pub use gguf::Dequant;
mod pickle;
mod store;
mod torch_file;
mod write;

use convert::decode_f32;
pub use convert::{
    bf16_to_f32, f16_to_f32, f32_to_bf16_bits, f32_to_f16_bits, f8_e4m3_to_f32, f8_e5m2_to_f32,
    round_f16, round_f8_e4m3, round_f8_e5m2, rounding,
};
pub use store::{Resolved, StoredWeight, WeightStore};
pub use write::{
    serialize_safetensors, write_safetensors, write_safetensors_f32, F32TensorData, TensorData,
};

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
    /// A pickle file names a global outside what a state dict needs
    /// (`os.system`, `builtins.eval`, a model class): refused, nothing run.
    #[error(
        "{}: refusing to load: the pickle names `{global}` (at byte {offset} of its object \
         pickle); sdkit rebuilds only tensors and plain containers from .ckpt/.pt/.bin files and \
         never runs code a file names. If you trust the file, convert it to .safetensors with \
         a tool you trust",
        .path.display()
    )]
    PickleRefused {
        path: PathBuf,
        global: String,
        offset: usize,
    },
    /// A pickle checkpoint that is damaged or uses something this reader
    /// does not support.
    #[error("{}: cannot read this torch checkpoint: {reason}", .path.display())]
    InvalidPickle { path: PathBuf, reason: String },
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
    #[error("{}: not a valid GGUF file: {reason}", .path.display())]
    InvalidGguf { path: PathBuf, reason: String },
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
    /// GGUF's block-quantized types (never in safetensors headers): each
    /// block holds [`DType::block`] elements as f16 scales and packed
    /// integers.
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl DType {
    /// Every safetensors dtype, in the order declared.
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

    /// Bytes per element; for a block-quantized type, per block.
    pub fn size_bytes(self) -> usize {
        if let Some((_, bytes)) = gguf::block(self) {
            return bytes;
        }
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
            _ => 0,
        }
    }

    /// `(elements, bytes)` of the smallest unit of storage: one element,
    /// or one block of a quantized type.
    pub fn block(self) -> (usize, usize) {
        gguf::block(self).unwrap_or((1, self.size_bytes()))
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
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q2K => "Q2_K",
            DType::Q3K => "Q3_K",
            DType::Q4K => "Q4_K",
            DType::Q5K => "Q5_K",
            DType::Q6K => "Q6_K",
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
        ) || gguf::block(self).is_some()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where one tensor lives in its file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The name in the file's header.
    pub name: String,
    pub dtype: DType,
    /// Row-major dimensions; empty for a scalar.
    pub shape: Vec<usize>,
    /// Absolute byte range within the file (header included), so a reader
    /// can also `pread` it without the mapping. Its length is always
    /// `numel() * dtype.size_bytes()`. (A torch checkpoint's non-contiguous
    /// tensor was copied at load: its range starts at or past the file's
    /// length and indexes that copy.)
    pub byte_range: Range<usize>,
    /// How ComfyUI's scaled-fp8 ops hold this tensor, where the file is a
    /// "scaled fp8" one (see [`SafeTensors::open`]); `None` elsewhere.
    pub scaled: Option<Scaled>,
}

/// A tensor of a scaled-fp8 layer: ComfyUI builds the whole Linear in the
/// file's fp8 dtype, so its weight and bias are rounded to `held_as` when
/// loaded, and computes with `weight · scale` (the bias's scale is 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scaled {
    pub held_as: DType,
    pub scale: f32,
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
    /// Copies of a torch checkpoint's non-contiguous tensors, addressed by
    /// byte ranges that start at the file's length.
    extra: Vec<u8>,
    /// The arithmetic GGUF quants are decoded in.
    dequant: Dequant,
    /// Read from a GGUF file.
    gguf: bool,
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
    /// Maps the file and parses its header (or, for a torch checkpoint, its
    /// object pickle); reads no tensor data.
    ///
    /// A file is read as a torch checkpoint when it is not valid
    /// safetensors and either its extension is one of [`PICKLE_EXTENSIONS`]
    /// or its bytes start like one (a zip archive, a pickle stream).
    pub fn open(path: &Path) -> Result<Self, WeightError> {
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

    /// Parses a weight file held in memory. `name` stands for the path in
    /// errors, and its extension counts as [`SafeTensors::open`] says.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self, WeightError> {
        Self::from_backing(PathBuf::from(name), Backing::Owned(bytes))
    }

    fn from_backing(path: PathBuf, backing: Backing) -> Result<Self, WeightError> {
        let bytes = backing.bytes();
        let pickle_name = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|ext| {
                PICKLE_EXTENSIONS
                    .iter()
                    .any(|p| p.eq_ignore_ascii_case(ext))
            });
        // A pickle name is read as torch.save unless the bytes are valid
        // safetensors (protocol 0/1 pickles have no magic bytes); any other
        // name only when it is not safetensors and starts like a pickle.
        if gguf::is_gguf(bytes) {
            let parsed = gguf::parse(&path, bytes)?;
            return Ok(SafeTensors {
                path,
                header_len: parsed.header_len,
                tensors: parsed.tensors,
                metadata: parsed.metadata,
                backing,
                extra: Vec::new(),
                dequant: Dequant::default(),
                gguf: true,
            });
        }
        let parsed = if pickle_name && bytes.starts_with(b"PK\x03\x04") {
            None
        } else {
            match parse_header(&path, bytes) {
                Ok(parsed) => Some(parsed),
                Err(err) if !pickle_name && !looks_like_pickle(bytes) => return Err(err),
                Err(_) => None,
            }
        };
        let Some(parsed) = parsed else {
            let loaded = torch_file::read(&path, bytes)?;
            return Ok(SafeTensors {
                path,
                header_len: 0,
                tensors: loaded.tensors,
                metadata: BTreeMap::new(),
                backing,
                extra: loaded.extra,
                dequant: Dequant::default(),
                gguf: false,
            });
        };
        let mut file = SafeTensors {
            path,
            header_len: parsed.header_len,
            tensors: parsed.tensors,
            metadata: parsed.metadata,
            backing,
            extra: Vec::new(),
            dequant: Dequant::default(),
            gguf: false,
        };
        file.attach_fp8_scales()?;
        Ok(file)
    }

    /// ComfyUI's "scaled fp8" files (a `scaled_fp8` marker tensor, at the
    /// top or under a model's prefix, whose dtype names the fp8 format; an
    /// f32 marker means e4m3fn): each Linear with a `<layer>.scale_weight`
    /// scalar is built in that fp8 dtype, so its weight and bias are
    /// rounded to it, and computes with `weight · scale`. That is attached
    /// to the tensors here, so every reader of the file (every loader,
    /// LoRA's base weights, the backends' conversions) sees the values
    /// ComfyUI computes with. A scale of more than one value has no defined
    /// broadcast in ComfyUI's ops and is refused.
    fn attach_fp8_scales(&mut self) -> Result<(), WeightError> {
        let Some(marker) = self
            .tensors
            .values()
            .find(|t| t.name == "scaled_fp8" || t.name.ends_with(".scaled_fp8"))
        else {
            return Ok(());
        };
        let held_as = match marker.dtype {
            DType::F8E5M2 => DType::F8E5M2,
            _ => DType::F8E4M3,
        };
        let stems: Vec<String> = self
            .tensors
            .keys()
            .filter_map(|k| k.strip_suffix(".scale_weight").map(str::to_string))
            .collect();
        for stem in stems {
            let scale_key = format!("{stem}.scale_weight");
            let values = self.to_f32(&scale_key)?;
            let &[scale] = values.as_slice() else {
                return Err(WeightError::InvalidTensorEntry {
                    path: self.path.clone(),
                    tensor: scale_key,
                    reason: format!(
                        "{} values; only one scale per weight (ComfyUI's scaled fp8) is supported",
                        values.len()
                    ),
                });
            };
            for (part, scale) in [("weight", scale), ("bias", 1.0)] {
                if let Some(info) = self.tensors.get_mut(&format!("{stem}.{part}")) {
                    info.scaled = Some(Scaled { held_as, scale });
                }
            }
        }
        Ok(())
    }

    /// Sets the arithmetic a GGUF file's quantized tensors are decoded in
    /// (the `gguf` package's f32 by default).
    pub fn set_dequant(&mut self, dequant: Dequant) {
        self.dequant = dequant;
    }

    pub fn dequant(&self) -> Dequant {
        self.dequant
    }

    /// Whether the file is a GGUF one.
    pub fn is_gguf(&self) -> bool {
        self.gguf
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

    /// Renames tensors by `map` (old name → new) and drops the others,
    /// returning the names dropped: a file in another layout (a diffusers
    /// ControlNet, say) seen in the layout the model code reads.
    pub fn rename(&mut self, map: &std::collections::HashMap<String, String>) -> Vec<String> {
        let old = std::mem::take(&mut self.tensors);
        let mut dropped = Vec::new();
        for (name, mut info) in old {
            match map.get(&name) {
                Some(new) => {
                    info.name = new.clone();
                    self.tensors.insert(new.clone(), info);
                }
                None => dropped.push(name),
            }
        }
        dropped
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
        let file = self.backing.bytes();
        let r = info.byte_range.clone();
        let bytes = if r.start >= file.len() && !r.is_empty() {
            self.extra.get(r.start - file.len()..r.end - file.len())
        } else {
            file.get(r)
        };
        bytes.ok_or_else(|| WeightError::OffsetsOutOfRange {
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
        Ok(self.decode(info, self.raw_of(info)?))
    }

    /// `bytes` (the whole of `info`'s data, or whole storage units of it)
    /// in f32: decoded in the file's dequantization arithmetic, and held
    /// as a scaled-fp8 layer holds it where the tensor is one.
    pub(crate) fn decode(&self, info: &TensorInfo, bytes: &[u8]) -> Vec<f32> {
        let mut v = decode_f32(info.dtype, bytes, self.dequant);
        if let Some(Scaled { held_as, scale }) = info.scaled {
            let round = (info.dtype != held_as)
                .then(|| convert::rounding(held_as))
                .flatten();
            v.iter_mut().for_each(|x| {
                let r = round.map_or(*x, |f| f(*x));
                *x = r * scale;
            });
        }
        v
    }

    /// Lets the OS drop this tensor's pages of the mapped file from the
    /// process (whole pages inside its byte range): they stay in the page
    /// cache and are read back on the next access. A model use calls it when
    /// done with a weight, so a workflow's peak memory is its largest use,
    /// not the sum of every model it touched. Does nothing for files held
    /// in memory, or where the OS refuses.
    pub fn release_pages(&self, name: &str) {
        let (Backing::Mapped(map), Some(info)) = (&self.backing, self.get(name)) else {
            return;
        };
        const PAGE: usize = 4096;
        let r = &info.byte_range;
        let (start, end) = (r.start.next_multiple_of(PAGE), r.end / PAGE * PAGE);
        if end <= start || end > map.len() {
            return;
        }
        // SAFETY: MADV_DONTNEED is unsafe in general because on private or
        // writable mappings it discards data (pages come back zeroed or
        // re-read). This mapping is read-only and shared with the file
        // (`Mmap::map`), so dropped pages hold nothing but the file's
        // contents and are faulted back in from it unchanged; no reference
        // into them can observe a difference (the soundness argument of
        // mapping the file at all, above, covers outside changes).
        #[allow(unsafe_code)]
        let result = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
        if let Err(e) = result {
            tracing::debug!("{}: releasing pages of {name}: {e}", self.path.display());
        }
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
        scaled: None,
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

/// Whether the bytes start like a `torch.save` file: a zip archive (since
/// PyTorch 1.6) or a pickle stream of protocol 2 to 5 (older files).
fn looks_like_pickle(bytes: &[u8]) -> bool {
    matches!(bytes, [b'P', b'K', 3, 4, ..] | [0x80, 2..=5, ..])
}
