//! GGUF weights kept quantized on the device: which weights of a
//! program stay in their file's quant blocks, and the WGSL that decodes
//! an element where a kernel reads it ([`quant_reader`]). The decode is
//! the CPU's (`weights::gguf`), operation for operation, so a quantized
//! operand reads the values the CPU computes with.

use super::{TapsFirst, WgpuBackend};
use crate::backend::cpu::Bindings;
use crate::plan::{BufferKind, Command, Program};
use crate::weights::{DType, Dequant};
use std::collections::HashMap;

/// Weight name → how the device holds it quantized; weights not named
/// are held as f16 (or f32) values.
pub(super) type QuantWeights = HashMap<String, Quant>;

impl WgpuBackend {
    /// The weights of `prog` the device keeps in their quant blocks: the
    /// GGUF block types bound from their file unpatched and uncast, in
    /// their natural order (not tap-major), fitting one binding, and not
    /// read back as an output (readback decodes values, not blocks).
    pub(super) fn quant_weights(
        &self,
        prog: &Program,
        bind: &Bindings,
        taps: &TapsFirst,
    ) -> QuantWeights {
        let mut out = QuantWeights::new();
        if !self.quantized_weights {
            return out;
        }
        let outputs: std::collections::HashSet<u32> =
            prog.outputs.iter().map(|v| v.buffer.0).collect();
        for c in &prog.commands {
            let Command::Upload { buffer, name } = c else {
                continue;
            };
            if outputs.contains(&buffer.0)
                || taps.contains_key(name)
                || bind.weights.contains_key(name)
                || !matches!(prog.buffer(*buffer).kind, BufferKind::Weight(_))
            {
                continue;
            }
            let Some(w) = bind.stored.get(name) else {
                continue;
            };
            if w.cast().is_some() || w.scaled() {
                continue;
            }
            let Some(q) = Quant::of(w.dtype(), w.file().dequant()) else {
                continue;
            };
            let (per, _) = w.dtype().block();
            if w.len() % per == 0 && q.bytes(w.len()) <= self.binding_limit() {
                out.insert(name.clone(), q);
            }
        }
        out
    }
}

/// The storage of a block-quantized GGUF weight on the device: its
/// blocks as the file holds them (bytes packed little-endian in u32
/// words), decoded element by element by the operand's `rdJ(i)` in the
/// arithmetic `dequant` names, as the CPU decode
/// (`weights::gguf::block_f32`) computes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quant {
    pub dtype: DType,
    pub dequant: Dequant,
}

impl Quant {
    /// For a GGUF block type this reader decodes: the types the CPU reads
    /// (Q8_0, Q4_0/1, Q5_0/1, Q2_K..Q6_K).
    pub fn of(dtype: DType, dequant: Dequant) -> Option<Self> {
        use DType::*;
        matches!(
            dtype,
            Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q2K | Q3K | Q4K | Q5K | Q6K
        )
        .then_some(Quant { dtype, dequant })
    }

    /// Device bytes of `elems` elements (whole blocks), padded to words.
    pub fn bytes(&self, elems: usize) -> u64 {
        let (per, size) = self.dtype.block();
        ((elems / per * size) as u64).div_ceil(4) * 4
    }
}

/// The WGSL that reads element `i` of quantized operand `j` (bound as
/// `inJ_0: array<u32>`): `rdJ(i)` and its byte/half helpers. Each
/// operation rounds as `Dequant` says, in the CPU decode's order: scales
/// first, then `· q`, then `+ m` / `− dmin·m`.
pub(super) fn quant_reader(j: usize, q: Quant) -> Result<String, String> {
    let (per, size) = q.dtype.block();
    let round = match q.dequant {
        Dequant::F32 => "return x;",
        // The f16 conversion of the pack builtin rounds to nearest.
        Dequant::F16 => "return unpack2x16float(pack2x16float(vec2<f32>(x, 0.0))).x;",
        Dequant::Bf16 => {
            "let b = bitcast<u32>(x); return bitcast<f32>((b + 0x7fffu + ((b >> 16u) & 1u)) & 0xffff0000u);"
        }
    };
    // `e`: the element within its block; `bs`: the block's first byte.
    let body = match q.dtype {
        DType::Q8_0 => "return R(H(bs) * SB(B(bs + 2u + e)));".to_string(),
        DType::Q4_0 | DType::Q4_1 => {
            let one = q.dtype == DType::Q4_1;
            let qs = if one { 4 } else { 2 };
            let tail = if one {
                "return R(R(H(bs) * q) + H(bs + 2u));"
            } else {
                "return R(H(bs) * (q - 8.0));"
            };
            format!("let q = f32((B(bs + {qs}u + e % 16u) >> (4u * (e / 16u))) & 15u); {tail}")
        }
        DType::Q5_0 | DType::Q5_1 => {
            let one = q.dtype == DType::Q5_1;
            let (qh, qs) = if one { (4, 8) } else { (2, 6) };
            let tail = if one {
                "return R(R(H(bs) * q) + H(bs + 2u));"
            } else {
                "return R(H(bs) * (q - 16.0));"
            };
            format!(
                "let lo = (B(bs + {qs}u + e % 16u) >> (4u * (e / 16u))) & 15u; \
                 let hi = (B(bs + {qh}u + e / 8u) >> (e % 8u)) & 1u; \
                 let q = f32(lo | (hi << 4u)); {tail}"
            )
        }
        DType::Q2K => "let j = e / 128u; let s = (e % 128u) / 32u; let l = e % 32u; \
             let q = f32((B(bs + 16u + 32u * j + l) >> (2u * s)) & 3u); \
             let g = B(bs + e / 16u); \
             let dl = R(H(bs + 80u) * f32(g & 15u)); let ml = R(H(bs + 82u) * f32(g >> 4u)); \
             return R(R(dl * q) - ml);"
            .to_string(),
        DType::Q3K => "let j = e / 128u; let s = (e % 128u) / 32u; let l = e % 32u; \
             let lo = i32((B(bs + 32u + 32u * j + l) >> (2u * s)) & 3u); \
             let hi = i32((B(bs + e % 32u) >> (e / 32u)) & 1u); \
             let q = f32(lo + 4 * hi - 4); \
             let g = e / 16u; \
             var low4 = B(bs + 96u + g % 8u); if (g >= 8u) { low4 = low4 >> 4u; } \
             let high2 = (B(bs + 104u + g % 4u) >> (2u * (g / 4u))) & 3u; \
             let scale = f32(i32((low4 & 15u) | (high2 << 4u)) - 32); \
             return R(R(H(bs + 108u) * scale) * q);"
            .to_string(),
        DType::Q4K | DType::Q5K => {
            let five = q.dtype == DType::Q5K;
            let qs = if five { 48 } else { 16 };
            let high = if five {
                "q = q | (((B(bs + 16u + e % 32u) >> (e / 32u)) & 1u) << 4u); "
            } else {
                ""
            };
            format!(
                "let c = e / 64u; let hf = (e % 64u) / 32u; let l = e % 32u; \
                 var q = (B(bs + {qs}u + 32u * c + l) >> (4u * hf)) & 15u; {high}\
                 let sj = e / 32u; let sc = bs + 4u; \
                 var s: u32; var m: u32; \
                 if (sj < 4u) {{ s = B(sc + sj) & 63u; m = B(sc + sj + 4u) & 63u; }} \
                 else {{ s = (B(sc + sj + 4u) & 15u) | ((B(sc + sj - 4u) >> 6u) << 4u); \
                        m = (B(sc + sj + 4u) >> 4u) | ((B(sc + sj) >> 6u) << 4u); }} \
                 return R(R(R(H(bs) * f32(s)) * f32(q)) - R(H(bs + 2u) * f32(m)));"
            )
        }
        DType::Q6K => "let j = e / 128u; let rr = e % 128u; \
             let lo = (B(bs + 64u * j + rr % 64u) >> (4u * (rr / 64u))) & 15u; \
             let hi = (B(bs + 128u + 32u * j + rr % 32u) >> (2u * (rr / 32u))) & 3u; \
             let q = f32(i32(lo | (hi << 4u)) - 32); \
             return R(R(H(bs + 208u) * SB(B(bs + 192u + e / 16u))) * q);"
            .to_string(),
        other => return Err(format!("no device decoder for {} weights", other.name())),
    };
    // The helpers carry the operand's index: a kernel may read several
    // quantized weights.
    let body = body
        .replace("SB(", &format!("dqsb{j}("))
        .replace("R(", &format!("dqr{j}("))
        .replace("H(", &format!("dqh{j}("))
        .replace("B(", &format!("dqb{j}("));
    Ok(format!(
        "fn dqr{j}(x: f32) -> f32 {{ {round} }}
fn dqb{j}(o: u32) -> u32 {{ return (in{j}_0[o >> 2u] >> ((o & 3u) << 3u)) & 255u; }}
fn dqh{j}(o: u32) -> f32 {{ return dqr{j}(unpack2x16float(in{j}_0[o >> 2u] >> ((o & 2u) << 3u)).x); }}
fn dqsb{j}(v: u32) -> f32 {{ return f32(bitcast<i32>(v << 24u) >> 24u); }}
fn rd{j}(i: u32) -> f32 {{ let e = i % {per}u; let bs = (i / {per}u) * {size}u; {body} }}
"
    ))
}
