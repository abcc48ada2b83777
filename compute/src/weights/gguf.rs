//! GGUF files (llama.cpp's format, which ComfyUI-GGUF loads for Flux, SD3
//! and their T5s): the header, metadata and tensor table read into the
//! same [`TensorInfo`] map as a safetensors file, and the block-quantized
//! types decoded to f32 exactly as the `gguf` Python package's
//! `dequantize` does (every product of a scale and a quant is exact in
//! f32; only a final `+ min` or `− dmin·min` rounds), or in f16/bf16
//! arithmetic as ComfyUI-GGUF does by default ([`Dequant`]).
//!
//! Layout (little-endian): `GGUF`, u32 version (2 or 3), u64 tensor count,
//! u64 key/value count; key/values (u64-length strings, a u32 type, the
//! value); tensor infos (name, u32 rank, u64 dims fastest first, u32 ggml
//! type, u64 offset into the data); the data at the next multiple of
//! `general.alignment` (32 by default). Shapes are the dims reversed
//! (torch order), or ComfyUI-GGUF's `comfy.gguf.orig_shape.NAME` where the
//! converter flattened a tensor.

use super::{DType, TensorInfo, WeightError};
use std::collections::BTreeMap;
use std::path::Path;

/// Whether `bytes` start like a GGUF file.
pub(super) fn is_gguf(bytes: &[u8]) -> bool {
    bytes.starts_with(b"GGUF")
}

/// The ggml type id of a dtype this reader decodes, and back.
fn dtype_of(id: u32) -> Option<DType> {
    Some(match id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        10 => DType::Q2K,
        11 => DType::Q3K,
        12 => DType::Q4K,
        13 => DType::Q5K,
        14 => DType::Q6K,
        30 => DType::BF16,
        _ => return None,
    })
}

/// Elements per block and bytes per block of a (block-)quantized dtype.
pub(super) fn block(dtype: DType) -> Option<(usize, usize)> {
    Some(match dtype {
        DType::Q8_0 => (32, 34),
        DType::Q4_0 => (32, 18),
        DType::Q4_1 => (32, 20),
        DType::Q5_0 => (32, 22),
        DType::Q5_1 => (32, 24),
        DType::Q2K => (256, 84),
        DType::Q3K => (256, 110),
        DType::Q4K => (256, 144),
        DType::Q5K => (256, 176),
        DType::Q6K => (256, 210),
        _ => return None,
    })
}

/// A metadata value, as far as the loader needs it.
#[derive(Debug, Clone)]
enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    fn render(&self) -> String {
        match self {
            Value::Int(i) => i.to_string(),
            Value::Float(f) => f.to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Str(s) => s.clone(),
            Value::Array(a) => {
                let items: Vec<String> = a.iter().map(Value::render).collect();
                format!("[{}]", items.join(", "))
            }
        }
    }
}

/// A bounds-checked little-endian reader over the header.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, reason: impl Into<String>) -> WeightError {
        WeightError::InvalidGguf {
            path: self.path.to_path_buf(),
            reason: format!("{} (at byte {})", reason.into(), self.at),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WeightError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| self.err("the header runs past the end of the file"))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WeightError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, WeightError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, WeightError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A tensor dimension, checked against what the file could hold: a
    /// block-quantized type packs up to about 3 elements a byte (Q2_K),
    /// so a dimension may exceed the file's bytes, never 8 times them.
    fn dim(&mut self) -> Result<usize, WeightError> {
        let n = self.u64()?;
        if n > (self.bytes.len() as u64).saturating_mul(8) {
            return Err(self.err(format!(
                "a dimension {n} is larger than the file could hold"
            )));
        }
        Ok(n as usize)
    }

    /// A count or length, checked against what the file could hold.
    fn len(&mut self, what: &str) -> Result<usize, WeightError> {
        let n = self.u64()?;
        if n > self.bytes.len() as u64 {
            return Err(self.err(format!("{what} {n} is larger than the file")));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, WeightError> {
        let n = self.len("string length")?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err("a string is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value, WeightError> {
        Ok(match ty {
            0 => Value::Int(i128::from(self.array::<1>()?[0])),
            1 => Value::Int(i128::from(i8::from_le_bytes(self.array()?))),
            2 => Value::Int(i128::from(u16::from_le_bytes(self.array()?))),
            3 => Value::Int(i128::from(i16::from_le_bytes(self.array()?))),
            4 => Value::Int(i128::from(self.u32()?)),
            5 => Value::Int(i128::from(i32::from_le_bytes(self.array()?))),
            6 => Value::Float(f64::from(f32::from_le_bytes(self.array()?))),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 4 {
                    return Err(self.err("arrays nested too deep"));
                }
                let item = self.u32()?;
                let n = self.len("array length")?;
                let mut v = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    v.push(self.value(item, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::Int(i128::from(self.u64()?)),
            11 => Value::Int(i128::from(i64::from_le_bytes(self.array()?))),
            12 => Value::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(self.err(format!("unknown metadata type {other}"))),
        })
    }
}

/// What [`parse`] reads: the tensors (absolute byte ranges) and the
/// metadata rendered as strings.
pub(super) struct Parsed {
    pub tensors: BTreeMap<String, TensorInfo>,
    pub metadata: BTreeMap<String, String>,
    pub header_len: usize,
}

/// Parses a GGUF file's header and tensor table; reads no tensor data.
pub(super) fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed, WeightError> {
    let mut r = Reader { bytes, at: 0, path };
    r.take(4)?;
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(r.err(format!(
            "GGUF version {version} is not supported (2 and 3 are)"
        )));
    }
    let n_tensors = r.len("tensor count")?;
    let n_kv = r.len("key/value count")?;
    let mut kv: BTreeMap<String, Value> = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string()?;
        let ty = r.u32()?;
        let v = r.value(ty, 0)?;
        kv.insert(key, v);
    }
    let alignment = match kv.get("general.alignment") {
        Some(Value::Int(a)) if *a > 0 && *a <= 1 << 20 => *a as usize,
        Some(_) => return Err(r.err("general.alignment is not a positive integer")),
        None => 32,
    };
    struct Info {
        name: String,
        dims: Vec<usize>,
        dtype: DType,
        offset: usize,
    }
    let mut infos = Vec::with_capacity(n_tensors.min(1 << 16));
    for _ in 0..n_tensors {
        let name = r.string()?;
        let rank = r.u32()? as usize;
        if rank > 8 {
            return Err(r.err(format!("tensor {name:?} has {rank} dimensions")));
        }
        let mut dims = Vec::with_capacity(rank);
        for _ in 0..rank {
            dims.push(r.dim()?);
        }
        let id = r.u32()?;
        let dtype = dtype_of(id).ok_or_else(|| {
            r.err(format!(
                "tensor {name:?} has ggml type {id}, which sdkit does not read (it reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K)"
            ))
        })?;
        let offset = r.len("a tensor offset")?;
        infos.push(Info {
            name,
            dims,
            dtype,
            offset,
        });
    }
    let header_len = r.at;
    let data = header_len.next_multiple_of(alignment);
    let mut tensors = BTreeMap::new();
    for t in infos {
        let numel = t
            .dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| r.err(format!("tensor {:?}'s size overflows", t.name)))?;
        let nbytes = match block(t.dtype) {
            Some((elems, size)) => {
                if t.dims.first().is_some_and(|&d| !d.is_multiple_of(elems)) {
                    return Err(r.err(format!(
                        "tensor {:?}: rows of {} elements are not whole {}-element {} blocks",
                        t.name, t.dims[0], elems, t.dtype
                    )));
                }
                numel / elems * size
            }
            None => numel * t.dtype.size_bytes(),
        };
        let start = data
            .checked_add(t.offset)
            .filter(|s| s.checked_add(nbytes).is_some_and(|e| e <= bytes.len()))
            .ok_or_else(|| {
                r.err(format!(
                    "tensor {:?} runs past the end of the file; the file is truncated",
                    t.name
                ))
            })?;
        let mut shape: Vec<usize> = t.dims.iter().rev().copied().collect();
        // ComfyUI-GGUF's converter flattens some tensors and records the
        // original shape.
        if let Some(Value::Array(a)) = kv.get(&format!("comfy.gguf.orig_shape.{}", t.name)) {
            let orig: Option<Vec<usize>> = a
                .iter()
                .map(|v| match v {
                    Value::Int(i) => usize::try_from(*i).ok(),
                    _ => None,
                })
                .collect();
            if let Some(orig) = orig.filter(|o| o.iter().product::<usize>() == numel) {
                shape = orig;
            }
        }
        if tensors.contains_key(&t.name) {
            return Err(WeightError::DuplicateTensor {
                path: path.to_path_buf(),
                tensor: t.name,
            });
        }
        tensors.insert(
            t.name.clone(),
            TensorInfo {
                name: t.name,
                dtype: t.dtype,
                shape,
                byte_range: start..start + nbytes,
                scaled: None,
            },
        );
    }
    let metadata = kv.iter().map(|(k, v)| (k.clone(), v.render())).collect();
    Ok(Parsed {
        tensors,
        metadata,
        header_len,
    })
}

fn f16(b: &[u8], at: usize) -> f32 {
    super::f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Q4_K's and Q5_K's 6-bit (scale, min) of sub-block `j` from the 12
/// packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        (f32::from(q[j] & 63), f32::from(q[j + 4] & 63))
    } else {
        (
            f32::from((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4)),
            f32::from((q[j + 4] >> 4) | ((q[j] >> 6) << 4)),
        )
    }
}

/// The arithmetic a dequantization rounds to after each operation:
/// ComfyUI-GGUF computes `d·q (+ m)` in its `dequant_dtype` — f16 by
/// default (the scales' own type), f32 with "float32" (the `gguf`
/// package's values: every product is exact), bf16 with "bfloat16".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dequant {
    #[default]
    F32,
    F16,
    Bf16,
}

impl Dequant {
    fn round(self) -> fn(f32) -> f32 {
        match self {
            Dequant::F32 => |x| x,
            Dequant::F16 => super::round_f16,
            Dequant::Bf16 => |x| super::bf16_to_f32(super::f32_to_bf16_bits(x)),
        }
    }
}

/// One block of `dtype` into `out` (its block's element count), each
/// operation rounded by `r` in ComfyUI-GGUF's order: scales first
/// (`d·sc`, `dmin·m`), then `· q`, then `+ m` / `− dmin·m`.
fn block_f32(dtype: DType, b: &[u8], out: &mut [f32], r: fn(f32) -> f32) {
    let h = |at: usize| r(f16(b, at));
    match dtype {
        DType::Q8_0 => {
            let d = h(0);
            for (i, o) in out.iter_mut().enumerate() {
                *o = r(d * f32::from(b[2 + i] as i8));
            }
        }
        DType::Q4_0 | DType::Q4_1 => {
            let d = h(0);
            let one = dtype == DType::Q4_1;
            let (m, qs) = if one {
                (h(2), &b[4..20])
            } else {
                (0.0, &b[2..18])
            };
            for (i, o) in out.iter_mut().enumerate() {
                let q = (qs[i % 16] >> (4 * (i / 16))) & 15;
                *o = if one {
                    r(r(d * f32::from(q)) + m)
                } else {
                    r(d * (f32::from(q) - 8.0))
                };
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            let d = h(0);
            let one = dtype == DType::Q5_1;
            let (m, qh, qs) = if one {
                (h(2), &b[4..8], &b[8..24])
            } else {
                (0.0, &b[2..6], &b[6..22])
            };
            let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
            for (i, o) in out.iter_mut().enumerate() {
                let lo = (qs[i % 16] >> (4 * (i / 16))) & 15;
                let q = lo | ((((qh >> i) & 1) as u8) << 4);
                *o = if one {
                    r(r(d * f32::from(q)) + m)
                } else {
                    r(d * (f32::from(q) - 16.0))
                };
            }
        }
        DType::Q2K => {
            let (sc, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (h(80), h(82));
            for (i, o) in out.iter_mut().enumerate() {
                let (j, s, l) = (i / 128, (i % 128) / 32, i % 32);
                let q = (qs[32 * j + l] >> (2 * s)) & 3;
                let g = sc[i / 16];
                let dl = r(d * f32::from(g & 15));
                let ml = r(dmin * f32::from(g >> 4));
                *o = r(r(dl * f32::from(q)) - ml);
            }
        }
        DType::Q3K => {
            let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = h(108);
            for (i, o) in out.iter_mut().enumerate() {
                let (j, s, l) = (i / 128, (i % 128) / 32, i % 32);
                let lo = i32::from((qs[32 * j + l] >> (2 * s)) & 3);
                let hi = i32::from((hmask[i % 32] >> (i / 32)) & 1);
                let q = lo + 4 * hi - 4;
                let g = i / 16;
                let low4 = if g < 8 { sc[g] & 15 } else { sc[g - 8] >> 4 };
                let high2 = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
                let scale = i32::from(low4 | (high2 << 4)) - 32;
                *o = r(r(d * scale as f32) * q as f32);
            }
        }
        DType::Q4K | DType::Q5K => {
            let (d, dmin) = (h(0), h(2));
            let sc = &b[4..16];
            let five = dtype == DType::Q5K;
            let (qh, qs) = if five {
                (&b[16..48], &b[48..176])
            } else {
                (&b[0..0], &b[16..144])
            };
            for (i, o) in out.iter_mut().enumerate() {
                let (c, hf, l) = (i / 64, (i % 64) / 32, i % 32);
                let mut q = (qs[32 * c + l] >> (4 * hf)) & 15;
                if five {
                    q |= ((qh[i % 32] >> (i / 32)) & 1) << 4;
                }
                let (s, m) = scale_min_k4(i / 32, sc);
                *o = r(r(r(d * s) * f32::from(q)) - r(dmin * m));
            }
        }
        DType::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = h(208);
            for (i, o) in out.iter_mut().enumerate() {
                let (j, rr) = (i / 128, i % 128);
                let lo = (ql[64 * j + rr % 64] >> (4 * (rr / 64))) & 15;
                let hi = (qh[32 * j + rr % 32] >> (2 * (rr / 32))) & 3;
                let q = i32::from(lo | (hi << 4)) - 32;
                *o = r(r(d * f32::from(sc[i / 16] as i8)) * q as f32);
            }
        }
        _ => out.fill(f32::NAN),
    }
}

/// A block-quantized tensor's bytes (whole blocks) in f32, computed in
/// `dequant`'s arithmetic.
pub(super) fn decode_blocks(dtype: DType, bytes: &[u8], dequant: Dequant) -> Vec<f32> {
    use rayon::prelude::*;
    let Some((elems, size)) = block(dtype) else {
        return Vec::new();
    };
    let n = bytes.len() / size;
    let mut out = vec![0f32; n * elems];
    let r = dequant.round();
    let run = |(o, b): (&mut [f32], &[u8])| block_f32(dtype, b, o, r);
    if bytes.len() < (1 << 20) {
        out.chunks_mut(elems)
            .zip(bytes.chunks_exact(size))
            .for_each(run);
    } else {
        out.par_chunks_mut(elems)
            .zip(bytes.par_chunks_exact(size))
            .for_each(run);
    }
    out
}
