//! `torch.save` files (`.ckpt`, `.pt`, `.pth`, `.bin`) read without Python.
//!
//! Two layouts exist:
//!
//! - **zip** (PyTorch ≥ 1.6): `<archive>/data.pkl` is the pickled object,
//!   whose tensors name their storages by persistent id
//!   `('storage', torch.HalfStorage, '<key>', 'cpu', numel)`; each storage's
//!   bytes are the uncompressed entry `<archive>/data/<key>`, so a
//!   contiguous tensor is a byte range of the mapped file, as in a
//!   safetensors file. Zip64 (files over 4 GiB) is read.
//! - **legacy** (older PyTorch): five pickles in a row (magic number,
//!   protocol version, system info, the object, the storage keys), then
//!   each storage as an 8-byte element count and its bytes.
//!
//! The object is unpickled by [`super::pickle`], which builds data and
//! runs nothing. ComfyUI's `load_torch_file` rule then picks the state
//! dict (the `state_dict` entry, else a lone dict entry, else the whole
//! object), and nested dicts and lists are flattened into dotted names
//! (`string_to_param.*` for a textual-inversion file). Tensors that are not
//! contiguous (a transposed view saved as is) are copied once, at load.

use super::pickle::{self, PickleErrorKind, StorageRef, TensorRef, Value};
use super::{DType, TensorInfo, WeightError};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;
use std::rc::Rc;

/// What a torch file holds: tensors whose byte ranges index the file, or,
/// past its end, `extra` (the copies of non-contiguous tensors).
pub(super) struct Loaded {
    pub tensors: BTreeMap<String, TensorInfo>,
    pub extra: Vec<u8>,
}

/// Deepest nesting flattened; state dicts are one or two levels deep.
const MAX_DEPTH: usize = 32;
/// Most values visited while flattening (a pickle can share one list
/// from many places; this bounds the walk, not just the file).
const MAX_VISITS: usize = 10_000_000;

/// Reads a torch file held in `bytes`.
pub(super) fn read(path: &Path, bytes: &[u8]) -> Result<Loaded, WeightError> {
    let result = if bytes.starts_with(b"PK\x03\x04") {
        read_zip(bytes)
    } else {
        read_legacy(bytes)
    };
    result.map_err(|e| match e {
        Failure::Global { global, offset } => WeightError::PickleRefused {
            path: path.to_path_buf(),
            global,
            offset,
        },
        Failure::Invalid(reason) => WeightError::InvalidPickle {
            path: path.to_path_buf(),
            reason,
        },
    })
}

enum Failure {
    Global { global: String, offset: usize },
    Invalid(String),
}

impl From<String> for Failure {
    fn from(s: String) -> Self {
        Failure::Invalid(s)
    }
}

fn unpickle(
    what: &str,
    data: &[u8],
    persistent: &mut dyn FnMut(&Value) -> Result<Value, String>,
) -> Result<(Value, usize), Failure> {
    pickle::load(data, persistent).map_err(|e| match e.kind {
        PickleErrorKind::Global(global) => Failure::Global {
            global,
            offset: e.offset,
        },
        PickleErrorKind::Invalid(_) => Failure::Invalid(format!("{what}: {e}")),
    })
}

// ---------------------------------------------------------------- zip ----

struct ZipEntry {
    name: String,
    /// The entry's data in the archive.
    data: Range<usize>,
    /// 0 = stored; torch.save never compresses.
    method: u16,
    flags: u16,
}

fn le16(b: &[u8], at: usize) -> Option<u16> {
    b.get(at..at + 2).map(|s| u16::from_le_bytes([s[0], s[1]]))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn le64(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at + 8)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(u64::from_le_bytes(a))
}

fn to_usize(v: u64, what: &str) -> Result<usize, String> {
    usize::try_from(v).map_err(|_| format!("zip {what} {v} does not fit in memory"))
}

/// The central directory of a zip archive.
fn zip_entries(b: &[u8]) -> Result<Vec<ZipEntry>, String> {
    const EOCD: u32 = 0x0605_4b50;
    let bad = |what: &str| format!("damaged zip archive: {what}");
    // The end-of-central-directory record is in the last 64 KiB + 22 bytes
    // (its comment is at most 65,535 bytes).
    let lowest = b.len().saturating_sub(22 + 65_535);
    let eocd = (lowest..=b.len().saturating_sub(22))
        .rev()
        .find(|&i| le32(b, i) == Some(EOCD))
        .ok_or_else(|| bad("no end-of-central-directory record (truncated download?)"))?;
    let mut count = u64::from(le16(b, eocd + 10).ok_or_else(|| bad("short record"))?);
    let mut cd_size = u64::from(le32(b, eocd + 12).ok_or_else(|| bad("short record"))?);
    let mut cd_offset = u64::from(le32(b, eocd + 16).ok_or_else(|| bad("short record"))?);
    if count == 0xffff || cd_size == 0xffff_ffff || cd_offset == 0xffff_ffff {
        // Zip64: the locator sits just before the record.
        let loc = eocd
            .checked_sub(20)
            .filter(|&l| le32(b, l) == Some(0x0706_4b50))
            .ok_or_else(|| bad("zip64 locator missing"))?;
        let rec = to_usize(
            le64(b, loc + 8).ok_or_else(|| bad("short zip64 locator"))?,
            "offset",
        )?;
        if le32(b, rec) != Some(0x0606_4b50) {
            return Err(bad("zip64 end record missing"));
        }
        count = le64(b, rec + 32).ok_or_else(|| bad("short zip64 record"))?;
        cd_size = le64(b, rec + 40).ok_or_else(|| bad("short zip64 record"))?;
        cd_offset = le64(b, rec + 48).ok_or_else(|| bad("short zip64 record"))?;
    }
    let cd_start = to_usize(cd_offset, "offset")?;
    let cd_end = cd_start
        .checked_add(to_usize(cd_size, "size")?)
        .filter(|&e| e <= b.len())
        .ok_or_else(|| bad("central directory past the end of the file"))?;
    let mut entries = Vec::new();
    let mut at = cd_start;
    for _ in 0..count {
        if at + 46 > cd_end || le32(b, at) != Some(0x0201_4b50) {
            return Err(bad("central directory entry"));
        }
        let field16 = |o| le16(b, at + o).unwrap_or(0);
        let field32 = |o| le32(b, at + o).unwrap_or(0);
        let flags = field16(8);
        let method = field16(10);
        let mut comp = u64::from(field32(20));
        let mut uncomp = u64::from(field32(24));
        let name_len = usize::from(field16(28));
        let extra_len = usize::from(field16(30));
        let comment_len = usize::from(field16(32));
        let mut local = u64::from(field32(42));
        let name_end = at + 46 + name_len;
        let extra_end = name_end + extra_len;
        if extra_end + comment_len > cd_end {
            return Err(bad("central directory entry runs past its end"));
        }
        let name = String::from_utf8_lossy(&b[at + 46..name_end]).into_owned();
        // Zip64 extra field: the 64-bit values of the fields set to ~0, in order.
        let mut x = name_end;
        while x + 4 <= extra_end {
            let id = le16(b, x).unwrap_or(0);
            let size = usize::from(le16(b, x + 2).unwrap_or(0));
            let body = x + 4;
            if id == 1 {
                let mut p = body;
                for field in [&mut uncomp, &mut comp, &mut local] {
                    if *field == 0xffff_ffff {
                        if p + 8 > body + size {
                            return Err(bad("short zip64 extra field"));
                        }
                        *field = le64(b, p).ok_or_else(|| bad("short zip64 extra field"))?;
                        p += 8;
                    }
                }
            }
            x = body + size;
        }
        let local = to_usize(local, "offset")?;
        if le32(b, local) != Some(0x0403_4b50) {
            return Err(bad(&format!("local header of {name}")));
        }
        let start = local
            + 30
            + usize::from(le16(b, local + 26).ok_or_else(|| bad("short local header"))?)
            + usize::from(le16(b, local + 28).ok_or_else(|| bad("short local header"))?);
        let end = start
            .checked_add(to_usize(comp, "size")?)
            .filter(|&e| e <= b.len())
            .ok_or_else(|| {
                bad(&format!(
                    "{name} runs past the end of the file (truncated?)"
                ))
            })?;
        if method == 0 && comp != uncomp {
            return Err(bad(&format!("{name}: stored sizes differ")));
        }
        entries.push(ZipEntry {
            name,
            data: start..end,
            method,
            flags,
        });
        at = extra_end + comment_len;
    }
    Ok(entries)
}

fn read_zip(b: &[u8]) -> Result<Loaded, Failure> {
    let entries = zip_entries(b)?;
    let pkl = entries
        .iter()
        .find(|e| {
            e.name
                .strip_suffix("data.pkl")
                .is_some_and(|p| p.is_empty() || p.ends_with('/') && p.matches('/').count() == 1)
        })
        .ok_or_else(|| "a zip archive without data.pkl is not a torch.save file".to_string())?;
    let prefix = pkl.name.trim_end_matches("data.pkl").to_string();
    let by_name: HashMap<&str, &ZipEntry> = entries.iter().map(|e| (e.name.as_str(), e)).collect();
    let usable = |e: &ZipEntry| -> Result<Range<usize>, String> {
        if e.flags & 1 != 0 {
            return Err(format!("{} is encrypted", e.name));
        }
        if e.method != 0 {
            return Err(format!(
                "{} is compressed (method {}); torch.save stores entries uncompressed, so the \
                 archive was repacked: unpack and re-save it, or convert it to .safetensors",
                e.name, e.method
            ));
        }
        Ok(e.data.clone())
    };
    if let Some(order) = by_name.get(format!("{prefix}byteorder").as_str()) {
        let r = usable(order)?;
        if &b[r] != b"little" {
            return Err("big-endian torch files are not supported"
                .to_string()
                .into());
        }
    }
    let pkl_data = usable(pkl)?;
    let mut storages: HashMap<String, Rc<StorageRef>> = HashMap::new();
    let mut persistent = |pid: &Value| storage_from_pid(pid, &mut storages, false);
    let (root, _) = unpickle(&pkl.name, &b[pkl_data], &mut persistent)?;
    let locate = |s: &StorageRef| -> Result<Range<usize>, String> {
        let name = format!("{prefix}data/{}", s.key);
        let e = by_name
            .get(name.as_str())
            .ok_or_else(|| format!("storage {name} is missing from the archive"))?;
        usable(e)
    };
    collect(b, &root, &locate)
}

// ------------------------------------------------------------- legacy ----

fn read_legacy(b: &[u8]) -> Result<Loaded, Failure> {
    // 0x1950a86a20f9469cfc6c, as LONG1 bytes (little-endian).
    const MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];
    let mut none = |_: &Value| Err("a persistent id outside the object pickle".to_string());
    let (magic, n) = unpickle("magic number", b, &mut none)?;
    match magic {
        Value::BigInt(m) if *m == MAGIC => {}
        _ => {
            return Err(
                "a pickle that is not a torch.save file (no torch magic number)"
                    .to_string()
                    .into(),
            )
        }
    }
    let mut pos = n;
    let (_protocol, n) = unpickle("protocol version", &b[pos..], &mut none)?;
    pos += n;
    let (sys_info, n) = unpickle("system info", &b[pos..], &mut none)?;
    pos += n;
    if let Value::Dict(d) = &sys_info {
        if matches!(d.borrow().get("little_endian"), Some(Value::Bool(false))) {
            return Err("big-endian torch files are not supported"
                .to_string()
                .into());
        }
    }
    let mut storages: HashMap<String, Rc<StorageRef>> = HashMap::new();
    let mut persistent = |pid: &Value| storage_from_pid(pid, &mut storages, true);
    let (root, n) = unpickle("object", &b[pos..], &mut persistent)?;
    pos += n;
    let (keys, n) = unpickle("storage keys", &b[pos..], &mut none)?;
    pos += n;
    let Value::List(keys) = keys else {
        return Err("legacy storage key list missing".to_string().into());
    };
    let mut ranges: HashMap<String, Range<usize>> = HashMap::new();
    for key in keys.borrow().iter() {
        let Value::Str(key) = key else {
            return Err("legacy storage keys must be strings".to_string().into());
        };
        let s = storages
            .get(&**key)
            .ok_or_else(|| format!("legacy storage {key} is not used by the object"))?;
        let count = le64(b, pos).ok_or_else(|| format!("storage {key} is truncated"))?;
        let bytes = count
            .checked_mul(s.dtype.size_bytes() as u64)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| format!("storage {key} size overflows"))?;
        let start = pos + 8;
        let end = start
            .checked_add(bytes)
            .filter(|&e| e <= b.len())
            .ok_or_else(|| format!("storage {key} runs past the end of the file (truncated?)"))?;
        ranges.insert(key.to_string(), start..end);
        pos = end;
    }
    let locate = |s: &StorageRef| -> Result<Range<usize>, String> {
        ranges
            .get(&s.key)
            .cloned()
            .ok_or_else(|| format!("storage {} has no data in the file", s.key))
    };
    collect(b, &root, &locate)
}

/// `('storage', StorageType, key, location, numel[, view_metadata])`.
fn storage_from_pid(
    pid: &Value,
    storages: &mut HashMap<String, Rc<StorageRef>>,
    legacy: bool,
) -> Result<Value, String> {
    let Value::Tuple(t) = pid else {
        return Err(format!("persistent id is {}", pickle::describe(pid)));
    };
    match &t[..] {
        [Value::Str(kind), Value::Global(pickle::Global::Storage(dtype)), Value::Str(key), _location, Value::Int(numel), rest @ ..]
            if &**kind == "storage" =>
        {
            if legacy && !matches!(rest, [] | [Value::None]) {
                return Err("legacy storage views are not supported".into());
            }
            let numel = u64::try_from(*numel).map_err(|_| "negative storage size".to_string())?;
            let s = storages
                .entry(key.to_string())
                .or_insert_with(|| {
                    Rc::new(StorageRef {
                        key: key.to_string(),
                        dtype: *dtype,
                        numel,
                    })
                })
                .clone();
            Ok(Value::Storage(s))
        }
        [Value::Str(kind), Value::Global(g), ..] if &**kind == "storage" => {
            Err(format!("storage type {g:?} is not supported"))
        }
        _ => Err("persistent id is not a storage".into()),
    }
}

// ------------------------------------------------------------ tensors ----

/// ComfyUI's `load_torch_file` choice of the state dict within the object.
fn state_dict(root: &Value) -> Value {
    if let Value::Dict(d) = root {
        let d = d.borrow();
        if let Some(sd) = d.get("state_dict") {
            return sd.clone();
        }
        if let [(_, v @ Value::Dict(_))] = &d.entries[..] {
            return v.clone();
        }
    }
    root.clone()
}

fn flatten(
    v: &Value,
    name: &str,
    depth: usize,
    visits: &mut usize,
    out: &mut Vec<(String, Rc<TensorRef>)>,
) -> Result<(), String> {
    *visits += 1;
    if *visits > MAX_VISITS || depth > MAX_DEPTH {
        return Err("the object nests too deeply or too widely to be a state dict".into());
    }
    let join = |k: &str| {
        if name.is_empty() {
            k.to_string()
        } else {
            format!("{name}.{k}")
        }
    };
    match v {
        Value::Tensor(t) => out.push((name.to_string(), t.clone())),
        Value::Dict(d) => {
            for (k, v) in d.borrow().entries.iter() {
                let key = match k {
                    Value::Str(s) => s.to_string(),
                    Value::Int(i) => i.to_string(),
                    _ => continue,
                };
                flatten(v, &join(&key), depth + 1, visits, out)?;
            }
        }
        Value::List(l) => {
            for (i, v) in l.borrow().iter().enumerate() {
                flatten(v, &join(&i.to_string()), depth + 1, visits, out)?;
            }
        }
        Value::Tuple(t) => {
            for (i, v) in t.iter().enumerate() {
                flatten(v, &join(&i.to_string()), depth + 1, visits, out)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Every tensor of the state dict, located in the file.
fn collect(
    b: &[u8],
    root: &Value,
    locate: &dyn Fn(&StorageRef) -> Result<Range<usize>, String>,
) -> Result<Loaded, Failure> {
    let mut found = Vec::new();
    flatten(&state_dict(root), "", 0, &mut 0, &mut found)?;
    let mut tensors = BTreeMap::new();
    let mut extra = Vec::new();
    for (name, t) in found {
        if tensors.contains_key(&name) {
            continue;
        }
        let data = locate(&t.storage)?;
        let info = place(b, &name, &t, data, &mut extra)?;
        tensors.insert(name, info);
    }
    Ok(Loaded { tensors, extra })
}

/// The byte range of one tensor: within its storage's entry when
/// contiguous, else of a copy appended to `extra`.
fn place(
    b: &[u8],
    name: &str,
    t: &TensorRef,
    storage: Range<usize>,
    extra: &mut Vec<u8>,
) -> Result<TensorInfo, String> {
    let dtype: DType = t.dtype;
    let el = dtype.size_bytes();
    let bad = |why: String| format!("tensor {name:?}: {why}");
    let shape: Vec<usize> = t
        .shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| bad(format!("size {d} too large"))))
        .collect::<Result<_, _>>()?;
    let numel = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let storage_len = storage.len() / el;
    let declared = t.storage.numel as u128 * t.storage.dtype.size_bytes() as u128;
    if declared > storage.len() as u128 {
        return Err(bad(format!(
            "storage {} holds {} bytes, its id says {declared} (truncated file?)",
            t.storage.key,
            storage.len()
        )));
    }
    let info = |byte_range| TensorInfo {
        name: name.to_string(),
        dtype,
        shape: shape.clone(),
        byte_range,
        scaled: None,
    };
    if numel == 0 {
        return Ok(info(storage.start..storage.start));
    }
    // The furthest element the view reaches, checked against the storage.
    let mut last = t.offset as u128;
    for (&d, &s) in t.shape.iter().zip(&t.stride) {
        last += (d as u128 - 1) * s as u128;
    }
    if last >= storage_len as u128 {
        return Err(bad(format!(
            "view (offset {}, size {:?}, stride {:?}) reaches past its {storage_len}-element storage",
            t.offset, t.shape, t.stride
        )));
    }
    let offset = t.offset as usize;
    let mut expect = 1u64;
    let mut contiguous = true;
    for (&d, &s) in t.shape.iter().zip(&t.stride).rev() {
        if d != 1 && s != expect {
            contiguous = false;
        }
        expect *= d;
    }
    if contiguous {
        let start = storage.start + offset * el;
        return Ok(info(start..start + numel * el));
    }
    // A strided view: gather it into row-major order once.
    let begin = extra.len();
    extra
        .try_reserve(numel * el)
        .map_err(|_| bad("out of memory copying a strided tensor".into()))?;
    let src = &b[storage];
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..numel {
        let e: usize = offset
            + idx
                .iter()
                .zip(&t.stride)
                .map(|(&i, &s)| i * s as usize)
                .sum::<usize>();
        extra.extend_from_slice(&src[e * el..(e + 1) * el]);
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    let base = b.len();
    Ok(info(base + begin..base + extra.len()))
}
