"""References for sdkit's GGUF reader (the files ComfyUI-GGUF loads).

Users load GGUF models through the ComfyUI-GGUF custom nodes (city96):
UnetLoaderGGUF {"unet_name"} lists *.gguf files of models/unet (=
diffusion_models), CLIPLoaderGGUF {"clip_name", "type"} (and the Dual/
Triple/Quadruple forms) *.gguf of models/clip (= text_encoders). Those
nodes read the file with llama.cpp's gguf-py package (GGUFReader), keep
each tensor's raw bytes (F32/F16 as plain torch tensors) and dequantize
the others per layer on the fly, inside Linear/Conv/... forward, then cast
to the dtype of the layer's input (the compute dtype). Their own torch
dequant (ComfyUI-GGUF dequant.py) computes the same formulas as gguf-py,
but in the dtype `dequant_dtype`: None by default (UnetLoaderGGUF,
CLIPLoaderGGUF), where the f16 scale fields stay f16 so the arithmetic is
f16 (t = d * s, y = t * q, then y + m or y - dmin * min, each rounded to
f16 by torch), or float32 etc. through UnetLoaderGGUFAdvanced. In f32
every dequant product is exact and only the final + m / - dmin * min
rounds, so f32 dequant (in any order, with or without fused
multiply-add) gives gguf-py's bits. This script makes two references with
gguf-py (the reference reader/writer/dequantizer):

1. Format and dequant conformance: tests/reference/gguf/quants.gguf, one
   tensor per type F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,
   Q3_K, Q4_K, Q5_K, Q6_K (torch shapes [rows, 256k]), plus a 3-D Q6_K, a
   1-D F32 of odd length, a 4-D F16 conv weight and a Q8_0 tensor stored
   [9, 256] whose `comfy.gguf.orig_shape.<name>` metadata (ARRAY of INT32,
   torch order) gives ComfyUI-GGUF's shape [32, 8, 3, 3] (what its
   convert.py writes for SD1/SDXL convs). Types gguf.quants.quantize
   supports are quantized from a sin pattern (the first 32 values 0, the
   next 32 the constant 0.25: zero and constant blocks); the K-quants
   (which gguf-py only dequantizes) are seeded random bytes with their f16
   scale fields set to finite values of magnitude 0.001-0.1 (negative d too
   for Q3_K/Q6_K, whose d is signed in real files). Metadata: general.
   architecture "flux" and general.quantization_version 2 (as ComfyUI-GGUF
   files), general.name, one key of every scalar type, arrays of INT32,
   FLOAT32 and STRING. tests/reference/gguf/quants.json records the header
   (magic, version, counts, alignment, data offset, file size, sha256), each
   key with its type id and value, and for each tensor: name, ggml type and
   id, dims as stored (ne[0] first), shape as torch sees it (reversed; and
   "comfy_shape" where orig_shape metadata overrides it), offset (from the
   data section) and absolute offset, byte size, sha256 of the raw bytes,
   and gguf.quants.dequantize of the bytes as f32: base64 little-endian
   (`values_f32`, for tensors up to 4096 values), always sha256 of those
   bytes, the first and last 16 values, the count of non-finite values and
   sum/abs-sum in f64 of the finite ones (numpy sums: compare loosely);
   for the quantized types "comfy_f16_math" gives the same summary of
   ComfyUI-GGUF's default f16-math dequant (fields unpacked here, checked
   to reproduce gguf-py's f32 values bit for bit, then the f16 formula in
   torch).

2. A tiny Flux in GGUF. The tiny dev Flux of tests/reference/flux (keys,
   shapes from its expected.json "files" entry tiny_flux_dev.safetensors,
   values sd1_pipeline.values rounded to f16) converted as city96's Flux
   GGUFs are made: ComfyUI-GGUF tools/convert.py (arch "flux", Flux keys
   without prefix, no renames, general.quantization_version 2,
   general.file_type) then llama.cpp's llama-quantize with ComfyUI-GGUF's
   lcpp.patch (img_tensor_get_type), which copies the KVs, overwrites
   general.file_type and quantizes only 2-D "*weight" tensors:
     * F32: img_in.*, time_in.in_layer.*, vector_in.in_layer.*,
       guidance_in.in_layer.*, final_layer.linear.* weights;
     * F16: txt_in.*, time_in.*, vector_in.*, guidance_in.*, final_layer.*
       weights (the rest of those);
     * K-quants need ne[0] (the row, in_features) % 256 == 0, else F16
       (the tiny width 64 makes most rows fall back: in tiny_flux_q4_k only
       double_blocks.*.{img,txt}_mlp.2.weight, rows of 256, are Q4_K);
     * every other 2-D weight: the target type;
     * 1-D tensors (biases, norm scales) keep convert.py's type.
   unet/tiny_flux_q8_0.gguf: from an f32 source (city96's files come from
     BF16 sources, where convert.py writes 1-D tensors F32 and the rest
     F16/BF16), so biases and norm scales are F32; llama-quantize ftype
     MOSTLY_Q8_0 (7). Q8_0 bytes from gguf.quants.quantize (bit-exact with
     ggml's quantize_row_q8_0_ref): per 32 values (f32) amax = max |x|,
     d = amax / 127, id = d ? 1/d : 0, q = round-half-away(x * id) (f32
     ops), stored f16(d) (round to nearest even) then 32 int8.
   unet/tiny_flux_q4_k.gguf: from the f16 file itself (convert.py keeps
     every tensor F16, 1-D ones too); ftype MOSTLY_Q4_K_S (14). gguf-py
     has no Q4_K quantizer, and llama.cpp's (make_qkx2_quants, an
     iterative search) is replaced by this simpler deterministic one
     (f32 IEEE ops, no fused multiply-add, rint = round half to even); the
     bytes it writes define the reference:
       per 256 values, 8 sub-blocks j of 32: mn_j = min(0, min x),
       mx_j = max x, s_j = (mx_j - mn_j) / 15, n_j = 0 - mn_j;
       d = f16(max_j s_j / 63), dmin = f16(max_j n_j / 63) (nearest even);
       sc_j = d > 0 ? min(63, rint(s_j / d)) : 0,
       m_j = dmin > 0 ? min(63, rint(n_j / dmin)) : 0;
       scale_j = d * sc_j, off_j = dmin * m_j;
       q = scale_j > 0 ? clamp(rint((x + off_j) / scale_j), 0, 15) : 0;
       packed as Q4_K (d, dmin, 12 bytes of 6-bit sc/m, 128 bytes of
       nibbles).
   Both are written by gguf.GGUFWriter (alignment 32, tensors in sorted key
   order as in the safetensors file) in the order convert.py/llama-quantize
   write them: KVs general.architecture, general.quantization_version,
   general.file_type. At ~0.7 and ~1 MB they are not committed: expected.
   json "gguf_files" describes each completely (KVs with types, every
   tensor's type/dims/offset/size/sha256 of its bytes and of its
   dequantized f32, data offset, file size and sha256) so a test can rebuild
   the same bytes and check them.
   Workflows graphs/tiny_flux_gguf_q8_0.json and tiny_flux_gguf_q4_k.json
   are tiny_flux_txt2img.json with node 1 UnetLoaderGGUF {"unet_name":
   "tiny_flux_q8_0.gguf"} (resp. q4_k) and renamed Save prefixes;
   tiny_flux_gguf_{q8_0,q4_k}_dequant_f32.json the same with
   UnetLoaderGGUFAdvanced {"unet_name", "dequant_dtype": "float32",
   "patch_dtype": "default", "patch_on_device": false}. They run as
   flux_pipeline.py runs its graphs (ComfyUI on the CPU, f32, the same tiny
   CLIP-L/T5/VAE files and patches), with the two nodes standing for
   ComfyUI-GGUF (not installed here): they load through UNETLoader a
   safetensors (f32) of the weights the layers get: F32/F16 tensors
   exactly, quantized ones dequantized with f16 math (UnetLoaderGGUF) or
   by gguf-py in f32 (dequant_dtype float32). ComfyUI-GGUF builds the same
   model (f32 on the CPU) and hands each layer exactly these values.
   tests/reference/gguf/expected.json "workflows" has the families/flux
   schema (latent and image f32, spreads, image_range) plus
   "vs_tiny_flux_txt2img_rel", the latent's max difference from the
   unquantized graph's relative to its max, and for the default graphs
   "vs_dequant_f32_rel", the same against the float32-dequant graph.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/gguf_fixtures.py
(needs the gguf package: pip install gguf.)
"""
import base64
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402

import gguf  # noqa: E402

ROOT = sd1.ROOT
OUT = os.path.join(ROOT, "tests", "reference", "gguf")
GT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
QK_K = 256
# graph: (file, dequant_dtype of UnetLoaderGGUFAdvanced or None for UnetLoaderGGUF)
WORKFLOWS = {"tiny_flux_gguf_q8_0": ("tiny_flux_q8_0.gguf", None),
             "tiny_flux_gguf_q4_k": ("tiny_flux_q4_k.gguf", None),
             "tiny_flux_gguf_q8_0_dequant_f32": ("tiny_flux_q8_0.gguf", "float32"),
             "tiny_flux_gguf_q4_k_dequant_f32": ("tiny_flux_q4_k.gguf", "float32")}
BASE_GRAPH = "tiny_flux_txt2img"
INLINE_MAX = 4096  # values_f32 given in full up to this many values


def sha(b):
    return hashlib.sha256(bytes(b)).hexdigest()


def f32_summary(v, inline=True):
    v = np.ascontiguousarray(v, dtype="<f4").reshape(-1)
    fin = v[np.isfinite(v)].astype(np.float64)
    assert np.isfinite(v[:16]).all() and np.isfinite(v[-16:]).all()
    out = {"sha256_f32": sha(v.tobytes()),
           "first16": [float(x) for x in v[:16]], "last16": [float(x) for x in v[-16:]],
           "nonfinite": int(v.size - fin.size),
           "sum_f64": float(fin.sum()), "abs_sum_f64": float(np.abs(fin).sum())}
    if inline and v.size <= INLINE_MAX:
        out["values_f32"] = sd1.b64(v)
    return out


# ---------------------------------------------------------------- dequant

def _maps(qtype):
    """Per element of one block: where its quant bits are. Returns
    (G groups sharing a scale, [(byte, shift, mask, value shift)] per element
    for the parts of q, q offset, the layout of the rest)."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    parts = [[] for _ in range(bs)]
    for i in range(bs):
        if qtype in (GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1):
            qs = {GT.Q4_0: 2, GT.Q4_1: 4, GT.Q5_0: 6, GT.Q5_1: 8}[qtype]
            parts[i].append((qs + i % 16, 4 * (i // 16), 15, 0))
            if qtype in (GT.Q5_0, GT.Q5_1):  # qh: u32 little-endian, bit i
                qh = {GT.Q5_0: 2, GT.Q5_1: 4}[qtype]
                parts[i].append((qh + i // 8, i % 8, 1, 4))
        elif qtype == GT.Q8_0:
            parts[i].append((2 + i, 0, 255, 0))
        elif qtype in (GT.Q2_K, GT.Q3_K):
            j, r = divmod(i, 128)
            qs = 16 if qtype == GT.Q2_K else 32
            parts[i].append((qs + 32 * j + r % 32, 2 * (r // 32), 3, 0))
            if qtype == GT.Q3_K:  # hmask bit i // 32 of byte i % 32
                parts[i].append((i % 32, i // 32, 1, 2))
        elif qtype in (GT.Q4_K, GT.Q5_K):
            c, r = divmod(i, 64)
            qs = 16 if qtype == GT.Q4_K else 48
            parts[i].append((qs + 32 * c + r % 32, 4 * (r // 32), 15, 0))
            if qtype == GT.Q5_K:  # qh bit i // 32 of byte i % 32
                parts[i].append((16 + i % 32, i // 32, 1, 4))
        elif qtype == GT.Q6_K:
            j, r = divmod(i, 128)
            parts[i].append((64 * j + r % 64, 4 * (r // 64), 15, 0))
            parts[i].append((128 + 32 * j + r % 32, 2 * (r // 32), 3, 4))
        else:
            raise ValueError(qtype)
    return parts


def block_fields(qtype, blocks):
    """The integer and f16 fields of `blocks` (n, type_size) uint8, per
    element: d (f16), s (int scale), q (int), and the offset: ("m", f16) for
    Q4_1/Q5_1, ("dmin", f16, int min) for Q2_K/Q4_K/Q5_K, None otherwise.
    The value is (d * s) * q, then + m or - dmin * min. Shapes (n, 256 or
    32)."""
    n = blocks.shape[0]
    b = blocks.astype(np.int64)

    def f16(off):
        return blocks[:, off:off + 2].copy().view(np.float16).reshape(n, 1)
    q = np.zeros((n, gguf.GGML_QUANT_SIZES[qtype][0]), np.int64)
    for i, parts in enumerate(_maps(qtype)):
        for byte, shift, mask, vshift in parts:
            q[:, i] |= ((b[:, byte] >> shift) & mask) << vshift
    bs = q.shape[1]
    extra = None
    s = np.ones((n, bs), np.int64)
    if qtype == GT.Q8_0:
        d, q = f16(0), np.where(q > 127, q - 256, q)
    elif qtype in (GT.Q4_0, GT.Q5_0):
        d, q = f16(0), q - (8 if qtype == GT.Q4_0 else 16)
    elif qtype in (GT.Q4_1, GT.Q5_1):
        d, extra = f16(0), ("m", f16(2))
    elif qtype == GT.Q2_K:
        g = np.arange(bs) // 16
        d, extra = f16(80), ("dmin", f16(82), b[:, 0:16][:, g] >> 4)
        s = b[:, 0:16][:, g] & 15
    elif qtype == GT.Q3_K:
        q = q - 4  # low 2 bits + 4 * hmask bit, minus 4: -4 where the bit is clear
        idx = np.arange(16)
        low = np.where(idx < 8, b[:, 96 + idx % 8] & 15, b[:, 96 + idx % 8] >> 4)
        high = (b[:, 104 + idx % 4] >> (2 * (idx // 4))) & 3
        d, s = f16(108), ((low | (high << 4)) - 32)[:, np.arange(bs) // 16]
    elif qtype in (GT.Q4_K, GT.Q5_K):
        sb = b[:, 4:16]
        j = np.arange(4)
        sc = np.concatenate([sb[:, j] & 63, (sb[:, j + 8] & 15) | ((sb[:, j] >> 6) << 4)], 1)
        mn = np.concatenate([sb[:, j + 4] & 63, (sb[:, j + 8] >> 4) | ((sb[:, j + 4] >> 6) << 4)], 1)
        g = np.arange(bs) // 32
        d, s, extra = f16(0), sc[:, g], ("dmin", f16(2), mn[:, g])
    elif qtype == GT.Q6_K:
        sc = blocks[:, 192:208].view(np.int8).astype(np.int64)
        d, s, q = f16(208), sc[:, np.arange(bs) // 16], q - 32
    return d, s, q, extra


def dequant_f32(qtype, blocks):
    """gguf-py's values from the fields, in f32: every product exact, at
    most one rounding (the final + m / - dmin * min)."""
    d, s, q, extra = block_fields(qtype, blocks)
    f = np.float32
    y = (d.astype(f) * s.astype(f)) * q.astype(f)
    if extra is not None and extra[0] == "m":
        y = y + extra[1].astype(f)
    elif extra is not None:
        y = y - extra[1].astype(f) * extra[2].astype(f)
    return y


def dequant_f16_math(qtype, blocks):
    """ComfyUI-GGUF's default dequant (UnetLoaderGGUF / CLIPLoaderGGUF,
    dequant_dtype None): the f16 scale fields stay f16 and torch does the
    same formula in half precision, each op rounded to f16: t = d * s,
    y = t * q, then y + m, or y - (dmin * min); the result is cast to the
    compute dtype after."""
    import torch
    d, s, q, extra = block_fields(qtype, blocks)
    h = torch.float16
    y = (torch.from_numpy(d.astype(np.float32)).to(h) * torch.from_numpy(s).to(h)) \
        * torch.from_numpy(q).to(h)
    if extra is not None and extra[0] == "m":
        y = y + torch.from_numpy(extra[1].astype(np.float32)).to(h)
    elif extra is not None:
        y = y - torch.from_numpy(extra[1].astype(np.float32)).to(h) * torch.from_numpy(extra[2]).to(h)
    return np.ascontiguousarray(y.float().numpy())


def dequant_both(qtype, raw, shape):
    """(gguf-py f32 values, ComfyUI-GGUF default f16-math values), torch
    shaped; the fields' f32 formula is checked equal to gguf-py's bits."""
    block, tsize = gguf.GGML_QUANT_SIZES[qtype]
    arr = np.frombuffer(raw, np.uint8)
    ref = np.asarray(gguf.quants.dequantize(
        arr.reshape(*shape[:-1], shape[-1] // block * tsize), qtype), np.float32).reshape(shape)
    if qtype in (GT.F32, GT.F16, GT.BF16):
        return ref, ref
    blocks = arr.reshape(-1, tsize)
    mine = dequant_f32(qtype, blocks).reshape(shape)
    assert np.array_equal(mine.view(np.uint32), ref.view(np.uint32)), qtype.name
    return ref, dequant_f16_math(qtype, blocks).reshape(shape)


# ---------------------------------------------------------------- part 1

def pattern(n, phase):
    """A deterministic smooth-ish pattern in about [-1.2, 1.2]; the first 32
    values 0 and the next 32 the constant 0.25 (zero and constant blocks)."""
    i = np.arange(n, dtype=np.float64)
    v = 0.8 * np.sin(0.37 * i + phase) * (1.0 + 0.5 * np.cos(0.011 * i * (phase + 1.0)))
    v[:32] = 0.0
    v[32:64] = 0.25
    return v.astype(np.float32)


# Byte offsets of the f16 fields inside one 256-value K-quant block.
K_F16_FIELDS = {GT.Q2_K: {"d": 80, "dmin": 82}, GT.Q3_K: {"d": 108},
                GT.Q4_K: {"d": 0, "dmin": 2}, GT.Q5_K: {"d": 0, "dmin": 2},
                GT.Q6_K: {"d": 208}}


def random_kquant(qtype, n_blocks, seed):
    """Seeded random bytes forming valid blocks: every bit pattern of the
    quants and packed scales is valid; only the f16 fields are set, finite,
    magnitude in [0.001, 0.1] (d signed where real files have signed d)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for field, off in K_F16_FIELDS[qtype].items():
        mag = rng.uniform(0.001, 0.1, size=n_blocks)
        if field == "d" and qtype in (GT.Q3_K, GT.Q6_K):
            mag = mag * np.where(rng.integers(0, 2, size=n_blocks) == 1, -1.0, 1.0)
        blocks[:, off:off + 2] = mag.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks


def special_f32():
    """Values placed at 64.. of the float tensors: signed zero, infinity,
    f16/bf16 subnormals, extremes (overflowing f16 to infinity)."""
    return np.array([-0.0, np.inf, -np.inf, 6e-8, -3.0e-5, 65504.0, 1e-40, -2.5e38],
                    dtype=np.float32)


QUANT_TENSORS = [
    # name, type, torch shape, source
    ("f32.weight", GT.F32, [4, 256], "pattern"),
    ("f16.weight", GT.F16, [8, 256], "pattern"),
    ("bf16.weight", GT.BF16, [8, 256], "pattern"),
    ("q8_0.weight", GT.Q8_0, [8, 256], "pattern"),
    ("q4_0.weight", GT.Q4_0, [8, 256], "pattern"),
    ("q4_1.weight", GT.Q4_1, [8, 256], "pattern"),
    ("q5_0.weight", GT.Q5_0, [8, 256], "pattern"),
    ("q5_1.weight", GT.Q5_1, [8, 256], "pattern"),
    ("q2_k.weight", GT.Q2_K, [8, 256], "random"),
    ("q3_k.weight", GT.Q3_K, [8, 256], "random"),
    ("q4_k.weight", GT.Q4_K, [8, 256], "random"),
    ("q5_k.weight", GT.Q5_K, [8, 256], "random"),
    ("q6_k.weight", GT.Q6_K, [8, 256], "random"),
    ("q6_k_3d.weight", GT.Q6_K, [2, 2, 512], "random"),
    ("odd_1d.bias", GT.F32, [100], "pattern"),
    ("conv4d.weight", GT.F16, [8, 4, 3, 3], "pattern"),
    ("conv_reshaped.weight", GT.Q8_0, [9, 256], "pattern"),
]
ORIG_SHAPE = {"conv_reshaped.weight": [32, 8, 3, 3]}

QUANT_KVS = [
    # key, type, value (after general.architecture, added by the writer)
    ("general.quantization_version", VT.UINT32, gguf.GGML_QUANT_VERSION),
    ("general.name", VT.STRING, "sdkit gguf conformance"),
    ("test.uint8", VT.UINT8, 200),
    ("test.int8", VT.INT8, -100),
    ("test.uint16", VT.UINT16, 60000),
    ("test.int16", VT.INT16, -30000),
    ("test.uint32", VT.UINT32, 4000000000),
    ("test.int32", VT.INT32, -2000000000),
    ("test.float32", VT.FLOAT32, 0.15625),
    ("test.bool", VT.BOOL, True),
    ("test.string", VT.STRING, "caf\u00e9 \u2713 \u6771\u4eac"),
    ("test.uint64", VT.UINT64, (1 << 63) + 5),
    ("test.int64", VT.INT64, -(1 << 62) - 3),
    ("test.float64", VT.FLOAT64, 3.141592653589793),
    ("test.array_int32", VT.ARRAY, [1, -2, 3, 2147483647]),
    ("test.array_float32", VT.ARRAY, [0.5, -1.25, 1e-3]),
    ("test.array_string", VT.ARRAY, ["a", "", "\u00e9t\u00e9"]),
]


def quant_tensor_bytes(name, qtype, shape, source, seed):
    n = int(np.prod(shape))
    if source == "random":
        blocks = random_kquant(qtype, n // QK_K, seed)
        row = shape[-1] // QK_K * gguf.GGML_QUANT_SIZES[qtype][1]
        return blocks.reshape(*shape[:-1], row)
    v = pattern(n, 0.5 + seed)
    if qtype in (GT.F32, GT.F16, GT.BF16):
        sp = special_f32()
        v[64:64 + len(sp)] = sp
    v = v.reshape(shape)
    if qtype == GT.F32:
        return v
    if qtype == GT.F16:
        with np.errstate(over="ignore"):
            return v.astype(np.float16)
    return gguf.quants.quantize(v, qtype)


def write_gguf(path, arch, kvs, tensors):
    """kvs: [(key, VT, value)] after general.architecture; tensors:
    [(name, GT, array)]: f32/f16 arrays in torch shape, or uint8 in byte
    shape with the type."""
    w = gguf.GGUFWriter(path=None, arch=arch)
    for key, vt, val in kvs:
        if vt == VT.ARRAY:
            w.add_array(key, val)
        else:
            w.add_key_value(key, val, vt)
    for name, qtype, arr in tensors:
        if qtype in (GT.F32, GT.F16):
            assert arr.dtype == (np.float32 if qtype == GT.F32 else np.float16)
            w.add_tensor(name, arr)
        else:
            assert arr.dtype == np.uint8
            w.add_tensor(name, arr, raw_dtype=qtype)
    from pathlib import Path
    w.write_header_to_file(path=Path(path))
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def parse_gguf(data):
    """An independent little parser of the layout sdkit must read; checked
    against GGUFReader below. Returns header, [(key, type, value)],
    [(name, dims, type, offset)], data_offset."""
    pos = 0

    def take(fmt):
        nonlocal pos
        r = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return r[0]

    def string():
        nonlocal pos
        n = take("Q")
        s = bytes(data[pos:pos + n]).decode("utf-8")
        pos += n
        return s
    scalar = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I",
              VT.INT32: "i", VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q",
              VT.FLOAT64: "d"}

    def value(vt):
        if vt == VT.STRING:
            return string()
        if vt == VT.ARRAY:
            sub = VT(take("I"))
            n = take("Q")
            return [sub.name, [value(sub) for _ in range(n)]]
        return take(scalar[vt])
    magic = bytes(data[0:4])
    pos = 4
    version = take("I")
    n_tensors = take("Q")
    n_kv = take("Q")
    kvs = []
    for _ in range(n_kv):
        key = string()
        vt = VT(take("I"))
        kvs.append((key, vt, value(vt)))
    infos = []
    for _ in range(n_tensors):
        name = string()
        nd = take("I")
        dims = [take("Q") for _ in range(nd)]
        t = take("I")
        off = take("Q")
        infos.append((name, dims, t, off))
    align = next((v for k, _, v in kvs if k == "general.alignment"), 32)
    data_offset = (pos + align - 1) // align * align
    assert all(b == 0 for b in data[pos:data_offset])
    header = {"magic": magic.decode(), "magic_u32_le": struct.unpack("<I", magic)[0],
              "version": version, "tensor_count": n_tensors, "kv_count": n_kv,
              "alignment": align, "tensor_infos_end": pos, "data_offset": data_offset}
    return header, kvs, infos, data_offset


def describe_file(path, comfy_shapes=None, inline=True):
    """The header, KVs and tensors of a written file, read back with
    GGUFReader (and checked against parse_gguf); each tensor dequantized with
    gguf.quants.dequantize. Returns (description, {name: f32 torch-shaped})."""
    with open(path, "rb") as f:
        data = f.read()
    header, kvs, infos, data_offset = parse_gguf(data)
    reader = gguf.GGUFReader(path)
    assert reader.data_offset == data_offset, (reader.data_offset, data_offset)
    assert len(reader.tensors) == len(infos)
    kv_out = []
    for key, vt, val in kvs:
        field = reader.get_field(key)
        assert field is not None and field.types[0] == vt, key
        got = field.contents()
        want = val[1] if vt == VT.ARRAY else val
        if vt in (VT.FLOAT32,):
            assert np.float32(got) == np.float32(want), key
        elif vt == VT.ARRAY and val[0] == "FLOAT32":
            assert np.array_equal(np.float32(got), np.float32(want)), key
        else:
            assert got == want, (key, got, want)
        entry = {"key": key, "type": vt.name, "type_id": int(vt)}
        if vt == VT.ARRAY:
            entry["item_type"] = val[0]
            entry["item_type_id"] = int(VT[val[0]])
            entry["value"] = val[1]
        else:
            entry["value"] = str(val) if vt in (VT.UINT64, VT.INT64) else val
        kv_out.append(entry)
    tensors, values = [], {}
    for t, (name, dims, tid, off) in zip(reader.tensors, infos):
        assert t.name == name and int(t.tensor_type) == tid
        assert [int(x) for x in t.shape] == dims
        assert t.data_offset == data_offset + off and off % header["alignment"] == 0
        qtype = GT(tid)
        block, tsize = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims))
        assert dims[0] % block == 0 and t.n_bytes == n // block * tsize
        raw = data[t.data_offset:t.data_offset + t.n_bytes]
        shape = list(reversed(dims))
        deq, deq16 = dequant_both(qtype, raw, shape)
        # GGUFReader's own view gives the same values
        deq2 = np.asarray(gguf.quants.dequantize(t.data, qtype), np.float32).reshape(shape)
        assert np.array_equal(deq.view(np.uint32), deq2.view(np.uint32)), name
        entry = {"name": name, "type": qtype.name, "type_id": tid, "dims": dims,
                 "shape": shape, "offset": off, "abs_offset": t.data_offset,
                 "nbytes": int(t.n_bytes), "block_size": block, "type_size": tsize,
                 "sha256_raw": sha(raw)}
        cs = (comfy_shapes or {}).get(name)
        if cs is not None:
            assert int(np.prod(cs)) == n
            entry["comfy_shape"] = cs
            deq, deq16 = deq.reshape(cs), deq16.reshape(cs)
        entry.update(f32_summary(deq, inline))
        if qtype not in (GT.F32, GT.F16, GT.BF16):
            entry["comfy_f16_math"] = f32_summary(deq16, inline)
        tensors.append(entry)
        values[name] = (deq, deq16)
    last = tensors[-1]
    end = last["abs_offset"] + last["nbytes"]
    assert len(data) == (end + header["alignment"] - 1) // header["alignment"] * header["alignment"]
    header.update({"file_size": len(data), "sha256": sha(data),
                   "header_sha256": sha(data[:data_offset])})
    return {"header": header, "kv": kv_out, "tensors": tensors}, values


def make_quants():
    path = os.path.join(OUT, "quants.gguf")
    kvs = list(QUANT_KVS) + [("comfy.gguf.orig_shape." + k, VT.ARRAY, v)
                             for k, v in ORIG_SHAPE.items()]
    tensors = []
    for seed, (name, qtype, shape, source) in enumerate(QUANT_TENSORS):
        tensors.append((name, qtype, quant_tensor_bytes(name, qtype, shape, source, seed)))
    write_gguf(path, "flux", kvs, tensors)
    desc, values = describe_file(path, ORIG_SHAPE)
    for (name, qtype, shape, source), t in zip(QUANT_TENSORS, desc["tensors"]):
        assert t["name"] == name and t["type"] == qtype.name
        assert t["shape"] == shape
        t["source"] = source
        v, v16 = values[name]
        finite = np.isfinite(v)
        assert np.array_equal(np.isfinite(v16), finite), name
        if qtype not in (GT.F32, GT.F16, GT.BF16):
            rel = float(np.abs(v16 - v).max() / np.abs(v).max())
            assert rel < 2.0 ** -10, (name, rel)
        if source == "pattern" and qtype not in (GT.F32, GT.F16, GT.BF16):
            # a quantizer round trip: close to the pattern
            want = pattern(int(np.prod(shape)), 0.5 + QUANT_TENSORS.index(
                (name, qtype, shape, source))).reshape(-1)
            err = float(np.abs(v.reshape(-1) - want).max())
            t["max_abs_err_vs_pattern"] = err
            assert err < 0.2, (name, err)
        assert finite.all() or qtype in (GT.F32, GT.F16, GT.BF16), name
        print("quants", name, qtype.name, "dims", t["dims"], "bytes", t["nbytes"],
              "offset", t["offset"], "abs max", float(np.abs(v[finite]).max()))
    out = {"file": "quants.gguf", "gguf_package": gguf_version(),
           "qk_k": QK_K, "types": {q.name: {"id": int(q), "block_size": gguf.GGML_QUANT_SIZES[q][0],
                                            "type_size": gguf.GGML_QUANT_SIZES[q][1]}
                                   for q in (GT.F32, GT.F16, GT.BF16, GT.Q8_0, GT.Q4_0, GT.Q4_1,
                                             GT.Q5_0, GT.Q5_1, GT.Q2_K, GT.Q3_K, GT.Q4_K,
                                             GT.Q5_K, GT.Q6_K)},
           **desc}
    with open(os.path.join(OUT, "quants.json"), "w") as f:
        json.dump(out, f, indent=0)
        f.write("\n")
    print("quants.gguf", desc["header"]["file_size"], "bytes, sha256", desc["header"]["sha256"])


def gguf_version():
    from importlib.metadata import version
    return version("gguf")


# ---------------------------------------------------------------- part 2

F32_KEEP = ("img_in.", "time_in.in_layer.", "vector_in.in_layer.", "guidance_in.in_layer.",
            "final_layer.linear.")
F16_KEEP = ("txt_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")
K_QUANTS = (GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K)
FLUX_FILES = {
    "tiny_flux_q8_0.gguf": {"target": GT.Q8_0, "ftype": gguf.LlamaFileType.MOSTLY_Q8_0,
                            "source": "f32"},
    "tiny_flux_q4_k.gguf": {"target": GT.Q4_K, "ftype": gguf.LlamaFileType.MOSTLY_Q4_K_S,
                            "source": "f16"},
}


CONVERSION = {
    "order": "tensors in sorted key order; KVs general.architecture (STRING flux), "
             "general.quantization_version (UINT32 2), general.file_type (UINT32 llama ftype); "
             "alignment 32, zero padding after the tensor infos and after each tensor",
    "types": "1-D: F32 (q8_0 file, f32 source) or F16 (q4_k file, f16 source); 2-D weights "
             "containing img_in., time_in.in_layer., vector_in.in_layer., guidance_in.in_layer., "
             "final_layer.linear.: F32; else containing txt_in., time_in., vector_in., "
             "guidance_in., final_layer.: F16; else the target, but a K-quant target with "
             "ne[0] % 256 != 0 gives F16",
    "values": "sd1_pipeline.values(name, shape) rounded to f16, as f32",
    "dequant": "F32/F16 exact; quantized: value = (d * s) * q, then + m (Q4_1/Q5_1) or "
               "- dmin * min (Q2_K/Q4_K/Q5_K); UnetLoaderGGUF (dequant_dtype None): each op "
               "in f16 (round to nearest even), then to f32 (sha256_f32 of comfy_f16_math); "
               "UnetLoaderGGUFAdvanced dequant_dtype float32: in f32 = gguf-py (sha256_f32)",
    "Q8_0": "per 32 values: amax = max|x|, d = amax / 127 (f32), id = d != 0 ? 1 / d : 0, "
            "q = round half away from zero (x * id) as int8; block = f16(d) (nearest even), q[32]",
    "Q4_K": "per 256 values, sub-blocks j = 0..8 of 32 (f32 ops, rint = round half to even): "
            "mn = min(0, min x), mx = max x, s_j = (mx - mn) / 15, n_j = 0 - mn; "
            "d = f16(max s_j / 63), dmin = f16(max n_j / 63); "
            "sc_j = d > 0 ? min(63, rint(s_j / d)) : 0, m_j = dmin > 0 ? min(63, rint(n_j / dmin)) : 0; "
            "scale = d * sc_j, off = dmin * m_j; q = scale > 0 ? clamp(rint((x + off) / scale), 0, 15) : 0; "
            "block = f16 d, f16 dmin, scales[12] (j < 4: scales[j] = sc_j | (sc_{j+4} >> 4) << 6, "
            "scales[j+4] = m_j | (m_{j+4} >> 4) << 6, scales[j+8] = (sc_{j+4} & 15) | (m_{j+4} & 15) << 4), "
            "qs[128] (qs[32c + l] = q[64c + l] | q[64c + 32 + l] << 4)",
}


def flux_keys():
    with open(os.path.join(ROOT, "tests", "reference", "flux", "expected.json")) as f:
        (entry,) = [x for x in json.load(f)["files"] if x["name"] == "tiny_flux_dev.safetensors"]
    return [(k, list(s)) for k, s in entry["keys"]]


def convert_type(name, shape, source):
    """ComfyUI-GGUF convert.py (ModelFlux) for a source tensor of dtype
    `source` ("f16" or "f32"; bf16 sources behave as f32 here)."""
    n = int(np.prod(shape))
    if source == "f32" and (len(shape) == 1 or n <= 1024):
        return GT.F32
    return GT.F16


def quantize_type(name, shape, have, target):
    """llama-quantize with lcpp.patch (img_tensor_get_type), arch flux."""
    if not (name.endswith("weight") and len(shape) >= 2):
        return have
    if any(p in name for p in F32_KEEP):
        new = GT.F32
    elif any(p in name for p in F16_KEEP):
        new = GT.F16
    else:
        new = target  # no to_v/qkv/ffn_down rule applies for Q8_0 or Q4_K_S
    if new in K_QUANTS and shape[-1] % QK_K != 0:
        new = GT.F16
    return new


def q4_k_quantize(x):
    """The deterministic Q4_K quantizer of the module docstring (f32 ops)."""
    f32 = np.float32
    x = np.ascontiguousarray(x, dtype=f32)
    shape = x.shape
    b = x.reshape(-1, 8, 32)
    nb = b.shape[0]
    mn = np.minimum(b.min(axis=-1), f32(0))
    mx = b.max(axis=-1)
    s = (mx - mn) / f32(15)
    nmin = f32(0) - mn
    d16 = (s.max(axis=-1) / f32(63)).astype(np.float16)
    m16 = (nmin.max(axis=-1) / f32(63)).astype(np.float16)
    d = d16.astype(f32)[:, None]
    dm = m16.astype(f32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.minimum(f32(63), np.rint(s / d)), f32(0)).astype(np.uint8)
        m = np.where(dm > 0, np.minimum(f32(63), np.rint(nmin / dm)), f32(0)).astype(np.uint8)
        scale = (d * sc.astype(f32))[:, :, None]
        off = (dm * m.astype(f32))[:, :, None]
        q = np.where(scale > 0, np.clip(np.rint((b + off) / scale), f32(0), f32(15)), f32(0))
    q = q.astype(np.uint8)
    packed = np.empty((nb, 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(nb, 128)
    out = np.concatenate([d16.view(np.uint8).reshape(nb, 2), m16.view(np.uint8).reshape(nb, 2),
                          packed, qs], axis=1)
    # own unpacking agrees with gguf-py's
    gsc, gm = gguf.quants.Q4_K.get_scale_min(packed)
    assert np.array_equal(gsc, sc) and np.array_equal(gm, m)
    return out.reshape(*shape[:-1], shape[-1] // QK_K * 144)


def flux_tensors(spec):
    """[(name, type, array)] in sorted key order, and the f16-rounded f32
    source values."""
    out, src = [], {}
    for name, shape in sorted(flux_keys()):
        v = sd1.values(name, shape).astype(np.float16).astype(np.float32)
        src[name] = v
        qtype = quantize_type(name, shape, convert_type(name, shape, spec["source"]),
                              spec["target"])
        if qtype == GT.F32:
            arr = v
        elif qtype == GT.F16:
            arr = v.astype(np.float16)
        elif qtype == GT.Q4_K:
            arr = q4_k_quantize(v)
        else:
            arr = gguf.quants.quantize(v, qtype)
        out.append((name, qtype, arr))
    return out, src


def make_flux(tmp, describe):
    """Writes the two files into tmp/unet, and their dequantized state dicts
    (f32 values) as tmp/unet/<stem>.dequant_f32.safetensors (gguf-py) and
    <stem>.dequant_default.safetensors (ComfyUI-GGUF's default f16 math).
    Returns descriptions."""
    import torch
    from safetensors.torch import save_file
    files = []
    for name, spec in FLUX_FILES.items():
        path = os.path.join(tmp, "unet", name)
        tensors, src = flux_tensors(spec)
        kvs = [("general.quantization_version", VT.UINT32, gguf.GGML_QUANT_VERSION),
               ("general.file_type", VT.UINT32, int(spec["ftype"]))]
        write_gguf(path, "flux", kvs, tensors)
        desc, values = describe_file(path, inline=False)
        sd, sd16 = {}, {}
        counts = {}
        for t in desc["tensors"]:
            v, v16 = values[t["name"]]
            err = float(np.abs(v - src[t["name"]]).max())
            if t["type"] in ("F32", "F16"):
                assert err == 0.0, t["name"]
            else:
                t["max_abs_err_vs_f16"] = err
                t["max_abs_err_f16_math_vs_f16"] = float(np.abs(v16 - src[t["name"]]).max())
                assert err < 0.05, (t["name"], err)
            counts[t["type"]] = counts.get(t["type"], 0) + 1
            sd[t["name"]] = torch.from_numpy(np.array(v, dtype=np.float32, order="C"))
            sd16[t["name"]] = torch.from_numpy(np.array(v16, dtype=np.float32, order="C"))
        stem = path[:-len(".gguf")]
        save_file(sd, stem + ".dequant_f32.safetensors")
        save_file(sd16, stem + ".dequant_default.safetensors")
        if describe:
            print(name, desc["header"]["file_size"], "bytes", counts, "sha256",
                  desc["header"]["sha256"])
        files.append(dict({"folder": "unet", "name": name,
                           "source": ("tests/reference/flux files tiny_flux_dev.safetensors: keys,"
                                      " sd1_pipeline.values rounded to f16, as " +
                                      {"f32": "an f32 source (1-D tensors F32)",
                                       "f16": "the f16 file (1-D tensors F16)"}[spec["source"]]),
                           "llama_ftype": spec["ftype"].name, "target_type": spec["target"].name,
                           "type_counts": counts}, **desc))
    return files


def graph_for(name, unet, dequant_dtype):
    """tiny_flux_txt2img.json with UnetLoaderGGUF (or UnetLoaderGGUFAdvanced
    with that dequant_dtype) and renamed prefixes."""
    with open(os.path.join(ROOT, "graphs", BASE_GRAPH + ".json")) as f:
        g = json.load(f)
    assert g["1"]["class_type"] == "UNETLoader"
    if dequant_dtype is None:
        g["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": unet}}
    else:
        g["1"] = {"class_type": "UnetLoaderGGUFAdvanced", "inputs": {
            "unet_name": unet, "dequant_dtype": dequant_dtype, "patch_dtype": "default",
            "patch_on_device": False}}
    for node in g.values():
        p = node["inputs"].get("filename_prefix")
        if p is not None:
            node["inputs"]["filename_prefix"] = p.replace(BASE_GRAPH, name)
    return g


def main():
    fp64, perturb, torch = sd1.start_comfy()
    torch.set_num_threads(1)
    sub = fp64 or perturb
    import flux_pipeline as fp
    import folder_paths
    import nodes

    tmp = tempfile.mkdtemp()
    try:
        fp.patch_comfy(tmp, torch)
        for folder, kind in {"unet": "diffusion_models", "clip": "text_encoders",
                             "vae": "vae"}.items():
            d = os.path.join(tmp, folder)
            os.makedirs(d, exist_ok=True)
            folder_paths.add_model_folder_path(kind, d, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))
        with open(os.path.join(ROOT, "tests", "reference", "flux", "expected.json")) as f:
            flux_ref = json.load(f)
        ref_files = {x["name"]: x for x in flux_ref["files"]}
        for folder, name, keys, dtype in fp.file_specs(torch):
            if folder == "unet" and name != "tiny_flux_dev.safetensors":
                continue
            keys = sorted(keys)
            digest, _ = fp.write_file(os.path.join(tmp, folder, name), keys, dtype, torch)
            assert [list(k) for k in keys] == [list(k) for k in ref_files[name]["keys"]], name
            assert str(digest) == ref_files[name]["checksum_f16"], name

        if not sub:
            os.makedirs(OUT, exist_ok=True)
            make_quants()
        gguf_files = make_flux(tmp, not sub)

        def load_gguf(unet_name, dequant_dtype):
            path = os.path.join(tmp, "unet", unet_name)
            with open(path, "rb") as f:
                digest = sha(f.read())
            kind = {None: "default", "default": "default", "float32": "f32",
                    "target": "f32"}[dequant_dtype]  # target: the f32 compute dtype here
            (m,) = nodes.UNETLoader().load_unet(
                "{}.dequant_{}.safetensors".format(unet_name[:-len(".gguf")], kind), "default")
            return (m, unet_name, digest)

        class UnetLoaderGGUF:
            """ComfyUI-GGUF's node (unet_name -> MODEL, filename, sha256),
            standing on the weights its default dequant gives (f16 math)."""
            FUNCTION = "load_unet"

            def load_unet(self, unet_name):
                return load_gguf(unet_name, None)

        class UnetLoaderGGUFAdvanced:
            FUNCTION = "load_unet"

            def load_unet(self, unet_name, dequant_dtype, patch_dtype, patch_on_device):
                assert patch_dtype == "default" and patch_on_device is False
                return load_gguf(unet_name, dequant_dtype)

        if not sub:
            # the dequantized weights are what the model holds, exactly
            from safetensors.torch import load_file
            for unet, dq in WORKFLOWS.values():
                (m,) = load_gguf(unet, dq)[:1]
                dm = m.model.diffusion_model
                assert type(m.model.model_config).__name__ == "Flux"
                assert dm.img_in.weight.dtype == torch.float32
                state = dm.state_dict()
                kind = "default" if dq is None else "f32"
                for k, v in load_file(os.path.join(tmp, "unet", "{}.dequant_{}.safetensors".format(
                        unet[:-5], kind))).items():
                    assert torch.equal(state[k], v), (unet, k)
            print("UNETLoader holds the dequantized f32 weights exactly")

        node_ns = types.SimpleNamespace(NODE_CLASS_MAPPINGS={
            **nodes.NODE_CLASS_MAPPINGS, **fp.v3_nodes(), "UnetLoaderGGUF": UnetLoaderGGUF,
            "UnetLoaderGGUFAdvanced": UnetLoaderGGUFAdvanced})
        out = {"gguf_package": gguf_version(), "gguf_files": gguf_files,
               "conversion": CONVERSION,
               "uses_files": {"flux/expected.json": ["tiny_clip_l.safetensors",
                                                     "tiny_t5xxl.safetensors",
                                                     "tiny_flux_ae.safetensors"]},
               "workflows": {}}
        if not sub:
            f64_latents, perturbed_latents = sd1.spread_runs(__file__)
        base_lat = np.frombuffer(base64.b64decode(
            flux_ref["workflows"][BASE_GRAPH]["latent_f32"]), "<f4")
        for name, (unet, dq) in WORKFLOWS.items():
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            assert prompt == graph_for(name, unet, dq), name
            saved, latents = sd1.run_workflow(prompt, node_ns, torch)
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            assert np.isfinite(lat).all() and np.isfinite(img).all(), name
            if sub:
                out["workflows"][name] = sd1.b64(lat.astype("<f4"))
                continue
            assert img.std() > 0.02, (name, float(img.std()))
            assert ((img <= 0.0) | (img >= 1.0)).mean() < 0.2, name

            def spread_to(latents):
                other = np.frombuffer(base64.b64decode(latents[name]), "<f4")
                return float(np.abs(lat.reshape(-1) - other).max() / np.abs(other).max())
            out["workflows"][name] = {
                "f32_vs_f64_unet_rel": spread_to(f64_latents),
                "unet_rounding_rel": spread_to(perturbed_latents),
                "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
                "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4")),
                "image_range": [float(img.min()), float(img.max()), float(img.std())],
                "vs_tiny_flux_txt2img_rel": float(np.abs(lat.reshape(-1) - base_lat).max()
                                                  / np.abs(base_lat).max()),
            }
            w = out["workflows"][name]
            print(name, "latent", lat.shape, "std", float(lat.std()), "image", img.shape,
                  "min/max/std", w["image_range"], "f32 vs f64", w["f32_vs_f64_unet_rel"],
                  "rounding", w["unet_rounding_rel"], "vs unquantized",
                  w["vs_tiny_flux_txt2img_rel"])
        if sub:
            print(json.dumps(out["workflows"]))
            return
        for name, (unet, dq) in WORKFLOWS.items():
            if dq is None:
                w, other = out["workflows"][name], out["workflows"][name + "_dequant_f32"]
                a, b = (np.frombuffer(base64.b64decode(x["latent_f32"]), "<f4") for x in (w, other))
                w["vs_dequant_f32_rel"] = float(np.abs(a - b).max() / np.abs(b).max())
                print(name, "vs", name + "_dequant_f32", w["vs_dequant_f32_rel"])
        sd1.write_expected("gguf", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
