"""References for LoRA patching of fp8-held weights (stochastic rounding).

ComfyUI (0.3.64 here, torch 2.15 CPU) patches a LoRA into weights held in
fp8 by computing the patched weight in f32 and rounding it back to fp8
*stochastically*: comfy/model_patcher.py patch_weight_to_device ->
comfy/float.py stochastic_rounding(out, weight.dtype,
seed=string_to_seed(key)) -> manual_stochastic_round_to_float8. This script
records that machinery piece by piece (components) and end to end
(workflows), and writes tests/reference/fp8_lora/expected.json and the
graphs graphs/tiny_flux_fp8_lora.json / graphs/tiny_flux_fp8_e5m2_lora.json
(graphs/tiny_flux_lora_kohya.json with UNETLoader weight_dtype "fp8_e4m3fn"
resp. "fp8_e5m2", filename prefixes renamed; nothing else changed).

string_to_seed(key) (comfy/model_patcher.py), as recorded in
components.string_to_seed [{key, seed, utf8_crc32, equals_utf8_crc32,
max_code_point}]: CRC-32 (reflected, polynomial 0xEDB88320, register
0xFFFFFFFF, final xor 0xFFFFFFFF) over the *code points* of the str:
for each character c: crc ^= ord(c) (the whole code point, even > 255),
then 8 times crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0). For
ASCII keys this is zlib.crc32(key.encode()) (all real state-dict keys);
for code points >= 128 it is not the CRC of the UTF-8 bytes (recorded:
"caf\u00e9.\u65e5\u672c\u8a9e.\U0001F600.weight" -> 994108858, UTF-8
CRC 3081908796). "" -> 0. The seed is < 2^32.

torch's CPU float16 uniform draw (components.torch_rand_f16), read from the
installed headers (ATen/native/cpu/DistributionTemplates.h uniform_kernel,
ATen/core/DistributionsHelper.h uniform_real_distribution,
ATen/core/TransformationHelper.h uniform_real, ATen/core/MT19937RNGEngine.h)
and verified here against numpy's MT19937 for 11 seeds x 40000 draws:
  * g.manual_seed(seed) seeds at::mt19937 with init_genrand(seed &
    0xffffffff) (the standard MT19937 32-bit seeding: state[0] = seed,
    state[j] = 1812433253 * (state[j-1] ^ (state[j-1] >> 30)) + j mod
    2^32); numpy equivalent: bg = np.random.MT19937(0);
    bg._legacy_seeding(seed); bg.random_raw(n) (np.random.MT19937(seed)
    itself seeds through SeedSequence: different). Seed 2^32 + 5 draws as 5.
  * each element takes ONE 32-bit output u = mt19937() (CPUGeneratorImpl::
    random()), elements in row-major order, serially (no vectorised path,
    any shape).
  * for Half the kernel samples in opmath_t = float:
        f = float32(u & 0xFFFFFF) * 2^-24      (exact, in [0, 1))
        h = round_to_nearest_even_f16(f)
        if h == 1.0: h = 0.0                  (u & 0xFFFFFF >= 0xFFF800)
    (recorded clamp_example: seed 0, draw 9058, u 1526725704 -> 0.0).
    float32 rand uses the same f unrounded. Older torch releases used
    uniform_real_distribution<Half> here: (u & 0x7FF) * 2^-11, no clamp;
    asserted *not* to be what this torch does (results depend on torch
    version; this fixture is torch 2.15's).
  Recorded: for key RAND_KEY's seed (2934867767), torch.rand((64, 33),
  float16) as f16 bits (f16_bits, base64 little-endian u16), the first 8
  u32 outputs and f16 values. These are exactly the draws
  stochastic_rounding makes for a [64, 33] input with that seed (e.g. the
  mixed_64x33 cases with seed 2934867767).

stochastic_rounding(value f32, dtype, seed) for dtype float8_e4m3fn
(E=4, M=3, B=7, max 448) / float8_e5m2 (E=5, M=2, B=15, max 57344), step
by step as ComfyUI computes it on the CPU. Every intermediate is a float16
tensor; every f16 op is computed in f32 and rounded to f16 (nearest
even) once per op (verified on 200000 random f16 operand pairs, subnormals
and large values included, for add, sub, mul, div, floor, sign, and the
python-scalar forms +1.0, -1.0, *2^M, /2^k, 2^k*; all equal to numpy's
float16 arithmetic too; since f32 has > 2*11+2 bits this double rounding
equals a correctly rounded f16 op):
  0. g = torch.Generator(device=value.device) (cpu here);
     g.manual_seed(seed); output = empty fp8. num_slices = max(1, numel /
     4096^2) (a float), rows taken in slices of round(rows / num_slices);
     the generator is shared and draws continue in row order, so slicing
     never changes the result (asserted with 5-row slices); it only
     matters above 16.7M elements anyway.
  1. x = value.half()               f32 -> f16 nearest even; |x| >= 65520
                                    -> inf; below 2^-25 -> +-0.
  2. sign = torch.sign(x) (f16);  abs_x = |x|;
     sign = where(abs_x == 0, 0, sign)        (so -0.0 inputs give +0)
  3. exponent = clamp(floor(log2(abs_x)) + B, 0, 2^E - 1), all f16.
     log2 of an f16 is f16(log2(x)) rounded to nearest from the exact
     value (verified exhaustively over all positive finite f16; same
     through f32). Because of that rounding, for 94 f16 values just below
     a power of two 2^k (k = -16..-2 and 3..16; e.g. 0.2499, 15.99,
     0.01561, 65504; up to 0.25% below 2^k, 0.4% for the subnormal
     2^-16 one) floor(log2) is k, one more than the true floor: components.log2_floor_anomalies_f16_bits lists them (f16 bit
     patterns). log2(0) = -inf -> exponent 0. inf -> 2^E - 1.
  4. normal = exponent != 0
  5. calc_mantissa:
       p = 2.0 ** (exponent - B)                    f16, exact 2^e
                                                    (2^16 = inf in f16)
       ms = where(normal, ((abs_x / p) - 1.0) * 2^M,   three f16 ops
                          abs_x / 2^(1 - B - M))       one f16 op
       ms += torch.rand(ms.shape, dtype=f16, generator=g)  one f16 add:
                                                    THIS rounding matters
       ms = floor(ms) / 2^M                         f16
     (abs_x[:] = ms: abs_x now holds the rounded mantissa fraction.)
     With an anomalous exponent (step 3) x / p is just below 1, ms is a
     small negative number and floor gives -1 or 0: the result is 2^k (1 -
     2^-M) or 2^k.
  6. r = where(normal, p * (1.0 + ms), 2^(1 - B) * ms)   f16 ops
     sign *= r                                      f16 (negative values
                                                    that round to 0 give
                                                    -0.0 -> code 0x80)
  7. clamp(sign, -max, max) in f16 (finfo of the fp8 dtype); NaN stays NaN.
  8. output.copy_(sign): f16 -> fp8 nearest even; every value reaching it
     is exactly representable, so the cast is exact.
  e5m2 only: |x| whose f16 is >= 65376 (anomalous exponent 31 -> p = inf)
  or inf: x / inf - 1 = -1 or inf / inf = NaN -> NaN or, rarely,
  inf * 0.25 -> clamp 57344. The NaN code here is always 0xFF (x86's
  default NaN is negative); nan_codes counts them per case -- compare
  NaN as NaN. e4m3fn saturates at 448 (inf included), never NaN.
The function `emulate` rebuilds this with numpy alone (f32 ops rounded to
f16, numpy MT19937 draws) and is asserted equal, byte for byte, to
ComfyUI for every case and for every weight the workflows patched. A
variant with no f16 anywhere (f32 input, exact floor(log2)) differs in
components.stochastic_rounding.f16_matters codes (e.g. 30 of 10560 for
mixed_64x33 e4m3fn, 17 of 9600 for N(0, 0.125) weights): the f16 steps
must be reproduced for exactness.

components.stochastic_rounding:
  inputs: {name: {shape, f32 (base64 little-endian f32, row-major)}}:
    small_7x5 [7, 5]: zeros, +-tiny, boundaries, ordinary, saturating;
    mixed_64x33 [64, 33]: every special value (0, -0, f16 subnormals and
      below (2^-24, 3*2^-25 tie, 2^-25, 1e-10, 1e-30), e4m3 subnormal /
      normal boundary (2^-9, 2^-6 and neighbours), e5m2 boundary (2^-16,
      2^-14), log2-anomalous values, ordinary +-0.01..10, saturating 448,
      449, 464, 480, 500, 57344, 57345, 60000, 65000, 65400, 65504, 65519,
      65520, 1e5, 1e6, 3e38, +-inf), every finite value of both fp8
      formats with both signs, f16 ties, and log-uniform 1e-6..30 with
      random signs; shuffled;
    weights_48x40 [48, 40]: N(0, 0.125), like a Linear weight;
    one_1x1 [1, 1]: 0.3.
  cases: [{input, dtype ("float8_e4m3fn" / "float8_e5m2"), seed, seed_key
    (the key whose string_to_seed it is, or null for plain 0, 1, 12345),
    fp8 (base64 of output.view(torch.uint8)), nan_codes,
    differs_from_round_to_nearest (codes != value.to(dtype))}], every
    input x both dtypes x 5 seeds.
  f16_matters: {"input dtype": codes over the 5 seeds where the no-f16
    variant differs}.
components.half_ops: the op checks above; components.torch_rand_f16:
  above.

Workflows (4 steps, euler, simple, cfg 1, FluxGuidance 3.5, 64x64, seed
424242; LoraLoaderModelOnly of flux_lora's tiny kohya LoRA at 0.8), run
through ComfyUI's node classes on the CPU as flux_lora.py does. What
ComfyUI does (asserted, recorded under "loaded" and per workflow
"patched"):
  * UNETLoader(tiny_flux_dev.safetensors, "fp8_e4m3fn" / "fp8_e5m2"):
    model_options dtype fp8, so *every* parameter of the DiT (84: Linear
    weights and biases, RMSNorm scales) is held fp8 = the file's f16 value
    cast to nearest (torch .to); manual_cast_dtype float32: each forward
    casts the fp8 weights to f32 (comfy.ops.manual_cast.Linear, which has
    no set_weight, so set_func is None and stochastic_rounding is called
    directly).
  * LoraLoaderModelOnly adds 33 patches (every kohya target, all 2-D
    weights; no biases). They are applied when the KSampler loads the
    model (comfy.model_management.load_models_gpu -> ModelPatcher.load,
    a full load on the CPU): ModelPatcher.patch_weight_to_device(key,
    device_to=cpu) per patched key: temp = weight.to(float32, copy) (the
    fp8 values, exact), out = comfy.lora.calculate_weight (temp += 0.8 *
    alpha / rank * (up @ down), f32), then stochastic_rounding(out, fp8,
    seed=string_to_seed(key)) with a *CPU* generator (the value is on the
    CPU), and set_attr_param swaps the parameter. LowVramPatch (the per-
    forward path of partial loads, which would draw on the compute
    device's generator: on CUDA a different stream) is never called here.
    Each key is patched and rounded exactly once per sampling run (33
    calls for the 4 steps), before the first step; the seed depends only
    on the key, so a re-patch gives the same bytes.
  * patched: keys (in patch order), seeds {key: string_to_seed(key)},
    path, lowvram_patch_calls (0), stochastic_rounding_calls (33),
    differs_from_round_to_nearest {key: codes that differ from
    out.to(fp8)}, recorded: for RECORDED keys {key, seed, shape, dtype,
    fp8: base64 of the model's weight.view(torch.uint8) after patching
    (= stochastic_rounding's output, asserted)}, and for txt_in also
    patched_f32 (base64 f32: the calculate_weight result that was rounded,
    so a test can check the rounding without the LoRA math).
  Per workflow, as flux_lora: weight_dtype, loras, latent_shape,
  latent_f32, image_shape, image_f32, image_range [min, max, std],
  f32_vs_f64_unet_rel, unet_rounding_rel (sd1_pipeline.spread_runs; for
  the --fp64-unet run, where ComfyUI would keep the f32 manual cast
  because the dtype is given, unet_manual_cast is wrapped to return
  float64 for fp8 weights: same fp8 bytes, f64 compute), and for the
  record vs_round_to_nearest_rel (max |latent - latent of the same run with
  comfy.float.stochastic_rounding replaced by value.to(fp8)| / max |that|)
  and vs_tiny_flux_lora_kohya_rel (against flux_lora's f32-weight latent).
  Measured:
    tiny_flux_fp8_lora (e4m3fn): f32_vs_f64_unet_rel 1.4e-7,
      unet_rounding_rel 3.7e-7, vs_round_to_nearest_rel 0.035,
      vs_tiny_flux_lora_kohya_rel 0.033; 24-27% of each patched weight's
      codes differ from round-to-nearest (qkv: 3082 of 12288).
    tiny_flux_fp8_e5m2_lora: 1.9e-7, 3.7e-7, vs_round_to_nearest_rel
      0.074, vs kohya 0.078; 22-27% differ (qkv: 2717 of 12288).
  So the stochastic part matters as much as the fp8 storage itself:
  a Rust port must reproduce the exact bytes.

files: the entries the Rust test writes with tests/support
write_fixture_entry (folder/name under the models dir), the existing
fixtures' entries unchanged: this script rebuilds each file and asserts
its entry equal to the fixture's (same keys, shapes, scaled, alphas,
checksum_f16):
  files_from["flux/expected.json"]: unet/tiny_flux_dev.safetensors,
    clip/tiny_clip_l.safetensors, clip/tiny_t5xxl.safetensors,
    vae/tiny_flux_ae.safetensors (all plain f16, no "dtype");
  files_from["flux_lora/expected.json"]: loras/tiny_flux_lora_kohya.safetensors.
No new file formats: the fp8 weights are made by the loader.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/fp8_lora.py
(media-only imports are stubbed as in sd1_pipeline.py; relaxations for the
tiny parts as flux_pipeline.py; the flux / flux_lora fixtures are read,
not rewritten; fixture_runs.py has the steps shared with the other Flux
fixture scripts: model folders, fixture checks, workflow runs, spreads,
per-workflow fields.)
"""
import json
import os
import sys
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import flux_pipeline as fp  # noqa: E402
import flux_lora as fl  # noqa: E402
import lora_pipeline as lp  # noqa: E402
import fixture_runs as fr  # noqa: E402

BASE_GRAPH = "tiny_flux_lora_kohya"
WORKFLOWS = {"tiny_flux_fp8_lora": "fp8_e4m3fn", "tiny_flux_fp8_e5m2_lora": "fp8_e5m2"}
LORA_STRENGTH = 0.8
# The two patched weights whose fp8 bytes are recorded (txt_in also with
# the f32 weight ComfyUI rounded).
RECORDED = ["diffusion_model.double_blocks.0.img_attn.qkv.weight", "diffusion_model.txt_in.weight"]
WITH_INPUT = "diffusion_model.txt_in.weight"

SEED_KEYS = [
    "diffusion_model.double_blocks.0.img_attn.qkv.weight",
    "",
    "a",
    "diffusion_model.txt_in.weight",
    "model.diffusion_model.output_blocks.11.1.transformer_blocks.0.attn2.to_out.0.weight"
    ".lora_up.weight/" + "x" * 120,
    "caf\u00e9.\u65e5\u672c\u8a9e.\U0001F600.weight",
]
# Seeds of the stochastic_rounding cases: string_to_seed of these keys, and
# plain ints.
CASE_SEED_KEYS = ["diffusion_model.double_blocks.0.img_attn.qkv.weight",
                  "diffusion_model.txt_in.weight"]
CASE_INT_SEEDS = [0, 1, 12345]
RAND_KEY = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
RAND_N = 64 * 33

# (dtype name, exponent bits, mantissa bits, bias, max finite)
FORMATS = {"float8_e4m3fn": (4, 3, 7, 448.0), "float8_e5m2": (5, 2, 15, 57344.0)}


b64 = sd1.b64


# ----------------------------------------------------------------- numpy side

def mt_raw(seed, n):
    """The first n 32-bit outputs of MT19937 seeded by init_genrand(seed &
    0xffffffff) (numpy's legacy seeding; np.random.MT19937(seed) itself
    seeds through SeedSequence and differs)."""
    bg = np.random.MT19937(0)
    bg._legacy_seeding(int(seed) & 0xFFFFFFFF)
    return bg.random_raw(n).astype(np.uint64).astype(np.uint32)


def rand_f16(seed, n):
    """torch.rand(n, dtype=float16, generator=g) after g.manual_seed(seed),
    CPU: f16(float32(u & 0xFFFFFF) * 2^-24) rounded to nearest even, a
    result of 1.0 replaced by 0.0."""
    u = mt_raw(seed, n)
    f = (u & np.uint32(0xFFFFFF)).astype(np.float32) * np.float32(2.0 ** -24)
    h = f.astype(np.float16)
    h[h == np.float16(1.0)] = np.float16(0.0)
    return h, u


def fp8_table(name):
    """Value of every code (float64, NaN for NaN codes), built from the
    format's definition."""
    eb, mb, bias, _ = FORMATS[name]
    vals = np.zeros(256)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e = (c >> mb) & ((1 << eb) - 1)
        m = c & ((1 << mb) - 1)
        if name == "float8_e4m3fn" and e == 15 and m == 7:
            v = np.nan
        elif name == "float8_e5m2" and e == 31:
            v = np.inf if m == 0 else np.nan
        elif e == 0:
            v = m / 2.0 ** mb * 2.0 ** (1 - bias)
        else:
            v = (1 + m / 2.0 ** mb) * 2.0 ** (e - bias)
        vals[c] = s * v
    return vals


def fp8_encode_exact(x, name):
    """Codes of values that fp8 `name` holds exactly (asserted), through
    their f16 bit patterns (every fp8 value is an f16); -0.0 -> 0x80; NaN
    -> 0xFF (NaN signs are not compared, see nan_eq)."""
    vals = fp8_table(name)
    lut = np.full(65536, -1, np.int32)
    for c in range(256):
        if not np.isnan(vals[c]):
            b = int(np.float16(vals[c]).view(np.uint16))
            assert float(np.float16(vals[c])) == vals[c]
            lut[b] = c
    x16 = np.asarray(x).astype(np.float16)
    assert np.array_equal(x16.astype(np.float64), np.asarray(x).astype(np.float64), equal_nan=True)
    codes = lut[x16.view(np.uint16)]
    codes = np.where(np.isnan(x16), 0xFF, codes)
    assert (codes >= 0).all()
    return codes.astype(np.uint8)


def nan_eq(a, b, name):
    """Byte arrays equal, NaN codes compared as NaN whatever their sign."""
    vals = fp8_table(name)
    na, nb = np.isnan(vals[a]), np.isnan(vals[b])
    return bool(np.array_equal(na, nb) and np.array_equal(a[~na], b[~nb]))


def h(x):
    """An op's float32 result rounded to f16 (the claim for every CPU half
    op used)."""
    return np.asarray(x, np.float32).astype(np.float16)


def emulate(x32, name, seed, variant="comfy"):
    """ComfyUI's stochastic_rounding(x32, fp8 `name`, seed) rebuilt with
    numpy alone, step by step (docstring). variant "f32": the same formula
    without any f16 rounding (input kept f32, every op f32, exact floor of
    log2) -- to count where the f16 arithmetic matters. Returns (fp8 codes,
    f16 values before the cast)."""
    eb, mb, bias, fmax = FORMATS[name]
    n = x32.size
    r, _ = rand_f16(seed, n)
    r = r.reshape(x32.shape)
    with np.errstate(all="ignore"):
        if variant == "comfy":
            x = x32.astype(np.float16)                                   # x.half()
            sign = np.sign(x)                                            # f16
            a = np.abs(x)
            sign = np.where(a == 0, np.float16(0), sign).astype(np.float16)
            lg = np.log2(a.astype(np.float64)).astype(np.float16)        # torch.log2, f16
            e = h(np.clip(h(np.floor(lg).astype(np.float32) + bias), 0, 2 ** eb - 1))
            normal = e != 0
            p = h(np.exp2(h(e.astype(np.float32) - bias).astype(np.float32)))  # 2.0 ** (e - bias)
            ms_n = h(h(h(a.astype(np.float32) / p.astype(np.float32)) - np.float32(1))
                     .astype(np.float32) * np.float32(2 ** mb))
            ms_s = h(a.astype(np.float32) / np.float32(2.0 ** (-bias + 1 - mb)))
            ms = np.where(normal, ms_n, ms_s)
            ms = h(ms.astype(np.float32) + r.astype(np.float32))          # += rand (f16)
            mant = h(np.floor(ms).astype(np.float32) / np.float32(2 ** mb))
            v_n = h(p.astype(np.float32) * h(np.float32(1) + mant.astype(np.float32)).astype(np.float32))
            v_s = h(np.float32(2.0 ** (-bias + 1)) * mant.astype(np.float32))
            out = h(sign.astype(np.float32) * np.where(normal, v_n, v_s).astype(np.float32))
            out = np.where(np.isnan(out), out, np.clip(out, np.float16(-fmax), np.float16(fmax)))
            out = out.astype(np.float16)
        else:
            x = x32.astype(np.float64)
            a = np.abs(x)
            sign = np.where(a == 0, 0.0, np.sign(x))
            e = np.clip(np.floor(np.log2(a)) + bias, 0, 2 ** eb - 1)
            normal = e != 0
            p = 2.0 ** (e - bias)
            ms = np.where(normal, (a / p - 1) * 2 ** mb, a / 2.0 ** (-bias + 1 - mb))
            ms = ms + r.astype(np.float64)
            mant = np.floor(ms) / 2 ** mb
            out = sign * np.where(normal, p * (1 + mant), 2.0 ** (-bias + 1) * mant)
            out = np.clip(out, -fmax, fmax)
    return fp8_encode_exact(out, name), out


# ----------------------------------------------------------------- components

def half_ops_check(torch):
    """torch's CPU f16 ops used by manual_stochastic_round_to_float8 against
    'compute in f32, round to f16' (numpy), and numpy's own float16
    arithmetic, on random f16 operands (subnormals, large values, signs)."""
    gen = np.random.default_rng(3)
    bits = gen.integers(0, 0x7C00, 200000).astype(np.uint16)
    a = bits.view(np.float16) * np.where(gen.random(bits.size) < 0.5, -1, 1).astype(np.float16)
    b = gen.integers(0x0001, 0x7C00, bits.size).astype(np.uint16).view(np.float16)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    res = {}
    with np.errstate(all="ignore"):
        for op, tf, nf, nn in [
                ("add", lambda: ta + tb, lambda: h(a.astype(np.float32) + b.astype(np.float32)), lambda: a + b),
                ("sub", lambda: ta - tb, lambda: h(a.astype(np.float32) - b.astype(np.float32)), lambda: a - b),
                ("mul", lambda: ta * tb, lambda: h(a.astype(np.float32) * b.astype(np.float32)), lambda: a * b),
                ("div", lambda: ta / tb, lambda: h(a.astype(np.float32) / b.astype(np.float32)), lambda: a / b),
                ("floor", lambda: torch.floor(ta), lambda: h(np.floor(a.astype(np.float32))), lambda: np.floor(a)),
                ("sign", lambda: torch.sign(ta), lambda: h(np.sign(a.astype(np.float32))), lambda: np.sign(a)),
                ("log2", lambda: torch.log2(tb), lambda: np.log2(b.astype(np.float64)).astype(np.float16),
                 lambda: np.log2(b))]:
            t = tf().numpy()
            want, native = nf(), nn()
            same = bool(np.array_equal(t.view(np.uint16), want.view(np.uint16)))
            same_native = bool(np.array_equal(t.view(np.uint16), native.view(np.uint16)))
            assert same, op
            res[op] = {"vs_f32_then_f16": same, "vs_numpy_float16": same_native}
        # scalar operands as the code writes them (python floats)
        for op, tf, nf in [
                ("add 1.0", lambda: tb + 1.0, lambda: h(b.astype(np.float32) + np.float32(1))),
                ("sub 1.0", lambda: ta - 1.0, lambda: h(a.astype(np.float32) - np.float32(1))),
                ("mul 8", lambda: ta * 8, lambda: h(a.astype(np.float32) * np.float32(8))),
                ("div 2^-9", lambda: tb / 2.0 ** -9, lambda: h(b.astype(np.float32) / np.float32(2.0 ** -9))),
                ("div 2^-16", lambda: tb / 2.0 ** -16, lambda: h(b.astype(np.float32) / np.float32(2.0 ** -16))),
                ("2^-6 *", lambda: 2.0 ** -6 * ta, lambda: h(np.float32(2.0 ** -6) * a.astype(np.float32)))]:
            t = tf().numpy()
            assert np.array_equal(t.view(np.uint16), nf().view(np.uint16)), op
            res[op] = {"vs_f32_then_f16": True}
    pw = torch.pow(2.0, torch.arange(-24, 17, dtype=torch.float16))
    assert [float(v) for v in pw] == [2.0 ** k for k in range(-24, 16)] + [float("inf")]
    res["2.0 ** e (e integer f16)"] = "exact 2^e; 2^16 = inf in f16"
    # exhaustive log2 over positive finite halves (incl. subnormals)
    allh = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16)
    t = torch.log2(torch.from_numpy(allh)).numpy()
    assert np.array_equal(t, np.log2(allh.astype(np.float64)).astype(np.float16))
    assert np.array_equal(t, np.log2(allh.astype(np.float64)).astype(np.float32).astype(np.float16))
    res["log2 exhaustive"] = ("torch.log2 of every positive finite f16 == f16(log2 in f64), "
                              "rounded to nearest even (direct or through f32)")
    fl_ = np.floor(t.astype(np.float64))
    ex = np.floor(np.log2(allh.astype(np.float64)))
    bad = fl_ != ex
    assert (fl_[bad] - ex[bad] == 1).all()
    anomalies = [int(v) for v in allh[bad].view(np.uint16)]
    print("half ops: torch CPU f16 add/sub/mul/div/floor/sign/log2 == f32 op then RNE to f16:",
          json.dumps(res))
    print("log2 anomalies: {} positive halves x with floor(f16(log2 x)) = floor(log2 x) + 1 "
          "(just below a power of two), e.g.".format(len(anomalies)),
          [float(v) for v in allh[bad][:4]], "...", [float(v) for v in allh[bad][-3:]])
    return res, anomalies


def rand_component(torch):
    """The CPU generator draw alone, verified against numpy's MT19937."""
    import comfy.model_patcher
    seeds = [0, 1, 12345, 2 ** 32 - 1, 2 ** 32 + 5] + \
        [comfy.model_patcher.string_to_seed(k) for k in SEED_KEYS]
    clamp_example = None
    for seed in seeds:
        n = 40000
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        t = torch.rand(n, dtype=torch.float16, generator=g).numpy()
        want, u = rand_f16(seed, n)
        assert np.array_equal(t.view(np.uint16), want.view(np.uint16)), seed
        # a 2-D request draws the same sequence in row-major order
        g.manual_seed(seed)
        t2 = torch.rand((200, 200), dtype=torch.float16, generator=g).numpy().reshape(-1)
        assert np.array_equal(t2.view(np.uint16), want.view(np.uint16)), seed
        # float32: u & 0xFFFFFF times 2^-24, same draws
        g.manual_seed(seed)
        t32 = torch.rand(n, generator=g).numpy()
        assert np.array_equal(t32, (u & np.uint32(0xFFFFFF)).astype(np.float32) * np.float32(2.0 ** -24))
        # the older rule (torch before the opmath change: u & 0x7FF times 2^-11) is not it
        old = ((u & np.uint32(0x7FF)).astype(np.float32) * np.float32(2.0 ** -11)).astype(np.float16)
        assert not np.array_equal(t, old)
        hit = np.nonzero((u & np.uint32(0xFFFFFF)) >= np.uint32(0xFFF800))[0]
        if clamp_example is None and len(hit) and seed < 2 ** 32:
            i = int(hit[0])
            clamp_example = {"seed": seed, "index": i, "u32": int(u[i]),
                             "f32": float((int(u[i]) & 0xFFFFFF) * 2.0 ** -24), "f16": float(t[i])}
            assert t[i] == 0.0
    seed = comfy.model_patcher.string_to_seed(RAND_KEY)
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    t = torch.rand((64, 33), dtype=torch.float16, generator=g)
    u = mt_raw(seed, RAND_N)
    # seeds >= 2^32: manual_seed keeps the 64-bit seed but mt19937 takes its low 32 bits
    g.manual_seed(2 ** 32 + 5)
    a = torch.rand(16, generator=g)
    g.manual_seed(5)
    assert torch.equal(a, torch.rand(16, generator=g))
    out = {
        "key": RAND_KEY, "seed": seed, "shape": [64, 33],
        "call": "g = torch.Generator(device='cpu'); g.manual_seed(seed); "
                "torch.rand((64, 33), dtype=torch.float16, generator=g)",
        "f16_bits": b64(t.numpy().view(np.uint16).astype("<u2")),
        "first_u32": [int(v) for v in u[:8]],
        "first_f16": [float(v) for v in t.reshape(-1)[:8]],
        "rule": "f16 = round_nearest_even_f16(f32(u32 & 0xFFFFFF) * 2^-24); 1.0 -> 0.0; one "
                "mt19937 32-bit output per element, row-major; mt19937 seeded by init_genrand(seed "
                "& 0xffffffff)",
        "verified_seeds": seeds,
        "clamp_example": clamp_example,
    }
    print("torch.rand f16 (CPU): every draw == f16(f32(u32 & 0xFFFFFF) * 2^-24), 1.0 -> 0, for seeds",
          seeds, "; clamp example", clamp_example)
    print("   first u32 for seed", seed, out["first_u32"][:4], "-> f16", out["first_f16"][:4])
    return out


def seed_component():
    import comfy.model_patcher
    out = []
    for k in SEED_KEYS:
        s = comfy.model_patcher.string_to_seed(k)
        crc = zlib.crc32(k.encode("utf-8"))
        out.append({"key": k, "seed": s, "utf8_crc32": crc, "equals_utf8_crc32": s == crc,
                    "max_code_point": max((ord(c) for c in k), default=0)})
        print("string_to_seed {!r:.60} = {} (zlib.crc32 of UTF-8 {}{})".format(
            k, s, crc, "" if s == crc else ": differs"))
    return out


def special_values():
    """f32 values for the hand-made cases (docstring)."""
    f16sub = 2.0 ** -24
    v = [0.0, -0.0,
         # f16 subnormal range and below
         f16sub, -f16sub, 3 * 2.0 ** -25, 2.0 ** -25, -2.0 ** -25, 2.0 ** -26, 1e-7, -5e-8,
         1e-10, -1e-12, 1e-30, 2.0 ** -14, 6.0e-5, -3.0e-5, 2.0 ** -15, 2.0 ** -16, -2.0 ** -17,
         # e4m3fn subnormal/normal boundary (min normal 2^-6, subnormal step 2^-9)
         2.0 ** -6, 2.0 ** -6 * (1 - 2.0 ** -10), 2.0 ** -6 * (1 - 2.0 ** -11),
         2.0 ** -6 * (1 + 2.0 ** -10), -2.0 ** -6, 0.875 * 2.0 ** -6, 0.9 * 2.0 ** -6,
         2.0 ** -9, -2.0 ** -9, 1.5 * 2.0 ** -9, 2.0 ** -10, 0.3 * 2.0 ** -9, -0.7 * 2.0 ** -9,
         # e5m2 boundary (min normal 2^-14, subnormal step 2^-16)
         0.75 * 2.0 ** -14, 0.8 * 2.0 ** -14, 1.9 * 2.0 ** -16, -1.2 * 2.0 ** -16,
         # just below powers of two (f16 log2 rounds up)
         0.2499, 0.12494, -0.0624, 0.03122, 0.01561, 7.996, 15.99, -31.97, 127.94, 255.9,
         # ordinary
         0.01, -0.01, 0.0123, 0.1, -0.1, 0.3, -0.3, 0.5, 1.0, -1.0, 1.1, 2.7, -3.3, 7.5, 9.99, -10.0,
         # exactly representable in both formats (and in e4m3 only)
         0.25, -0.75, 1.5, 3.0, -6.0, 0.046875, 0.0703125, -1.75, 1.125, 2.25,
         # saturation
         240.0, 256.0, 300.0, 447.0, 448.0, 449.0, 464.0, 480.0, 500.0, -448.0, -1000.0, 1e4,
         -3e4, 49152.0, 57344.0, 57345.0, 60000.0, -61440.0, 65000.0, 65400.0, 65504.0, 65519.0,
         65520.0, 1e5, -1e6, 3e38, float("inf"), float("-inf")]
    return np.array(v, np.float32)


def all_fp8_values():
    vals = []
    for name in FORMATS:
        t = fp8_table(name)
        vals += [x for x in t if np.isfinite(x)]
    return np.array(sorted(set(vals)), np.float32)


def make_inputs():
    gen = np.random.default_rng(20250807)
    sp = special_values()
    # 7x5: a few of each kind
    pick = [0.0, -0.0, 2.0 ** -24, 1e-7, 1e-10, 2.0 ** -6, 2.0 ** -6 * (1 - 2.0 ** -11), 2.0 ** -9,
            0.75 * 2.0 ** -14, 0.01561, 0.2499, 15.99, 0.01, -0.01, 0.3, -0.3, 1.0, -2.7, 9.99,
            -0.046875, 1.5, 448.0, 449.0, 500.0, 57344.0, 60000.0, -1e4, 0.0123, 0.1, -0.5,
            3.3, 0.05, -0.07, 0.002, 6.1e-5]
    small = np.array(pick, np.float32).reshape(7, 5)
    # 64x33: every special value, every finite fp8 value (both formats, both
    # signs), midpoints between f16 neighbours, the log2 anomaly halves, and
    # log-uniform magnitudes 1e-6..30 with random signs.
    allh = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16)
    lg = np.log2(allh.astype(np.float64)).astype(np.float16)
    anomalies = allh[np.floor(lg.astype(np.float64)) != np.floor(np.log2(allh.astype(np.float64)))]
    f8 = all_fp8_values()
    mids = []
    for x in [0.3, 0.01, 1.7, 2.0 ** -20, 5.0]:
        a = np.float16(x)
        b = np.nextafter(a, np.float16(10))
        mids.append((np.float32(a) + np.float32(b)) / 2)  # f16 tie (to even)
    parts = [sp, f8, -f8, anomalies.astype(np.float32), -anomalies[::3].astype(np.float32),
             np.array(mids, np.float32)]
    n = 64 * 33
    head = np.concatenate(parts)
    rest = n - head.size
    mag = np.exp(gen.uniform(np.log(1e-6), np.log(30.0), rest))
    sgn = np.where(gen.random(rest) < 0.5, -1.0, 1.0)
    body = np.concatenate([head, (mag * sgn).astype(np.float32)])
    perm = gen.permutation(n)
    mixed = body[perm].astype(np.float32).reshape(64, 33)
    # weights-like: N(0, 0.125) as a LoRA-patched Linear weight
    weights = (gen.standard_normal((48, 40)) * 0.125).astype(np.float32)
    one = np.array([[0.3]], np.float32)
    return {"small_7x5": small, "mixed_64x33": mixed, "weights_48x40": weights, "one_1x1": one}


def stochastic_component(torch):
    import comfy.float
    import comfy.model_patcher
    dtypes = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
    for name, dt in dtypes.items():
        t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float().double().numpy()
        mine = fp8_table(name)
        assert np.array_equal(np.isnan(t), np.isnan(mine)) and \
            np.array_equal(t[~np.isnan(t)], mine[~np.isnan(mine)]), name
    seeds = [(k, comfy.model_patcher.string_to_seed(k)) for k in CASE_SEED_KEYS] + \
        [(None, s) for s in CASE_INT_SEEDS]
    inputs = make_inputs()
    out = {"inputs": {}, "cases": []}
    for iname, x in inputs.items():
        out["inputs"][iname] = {"shape": list(x.shape), "f32": b64(x.astype("<f4"))}
    stats = {}
    for iname, x in inputs.items():
        for name, dt in dtypes.items():
            for key, seed in seeds:
                got = comfy.float.stochastic_rounding(torch.from_numpy(x.copy()), dt, seed=seed)
                assert got.dtype == dt and list(got.shape) == list(x.shape)
                codes = got.view(torch.uint8).numpy()
                mine, _ = emulate(x, name, seed)
                assert nan_eq(codes, mine, name), (iname, name, seed)
                # the pieces: manual_stochastic_round_to_float8 on the whole
                # tensor, and on row slices sharing one generator, are the same
                g = torch.Generator(device="cpu")
                g.manual_seed(seed)
                whole = comfy.float.manual_stochastic_round_to_float8(
                    torch.from_numpy(x.copy()), dt, generator=g).to(dt)
                assert nan_eq(whole.view(torch.uint8).numpy(), codes, name)
                if x.shape[0] > 5:
                    g.manual_seed(seed)
                    parts = [comfy.float.manual_stochastic_round_to_float8(
                        torch.from_numpy(x[i:i + 5].copy()), dt, generator=g).to(dt)
                        for i in range(0, x.shape[0], 5)]
                    assert nan_eq(torch.cat([p.view(torch.uint8) for p in parts]).numpy(), codes, name)
                rne = torch.from_numpy(x.copy()).to(dt).view(torch.uint8).numpy()
                nan = np.isnan(fp8_table(name)[codes])
                f32codes, _ = emulate(x, name, seed, variant="f32")
                st = stats.setdefault((iname, name), [0, 0, 0, 0])
                st[0] += int((codes != rne).sum())
                st[1] += int((~nan_mask(codes, f32codes, name)).sum())
                st[2] += int(nan.sum())
                st[3] += codes.size
                case = {"input": iname, "dtype": name, "seed": seed, "seed_key": key,
                        "fp8": b64(codes), "nan_codes": int(nan.sum()),
                        "differs_from_round_to_nearest": int((codes != rne).sum())}
                out["cases"].append(case)
    for (iname, name), (d, d32, nn, tot) in stats.items():
        print("stochastic_rounding {:14s} {:14s}: over {} seeds, {} of {} codes differ from "
              "round-to-nearest, {} from the same formula without f16 rounding, {} NaN".format(
                  iname, name, len(seeds), d, tot, d32, nn))
    out["f16_matters"] = {"{} {}".format(i, n): v[1] for (i, n), v in stats.items()}
    return out


def nan_mask(a, b, name):
    """Per element: equal codes, NaN codes equal whatever their sign."""
    vals = fp8_table(name)
    na, nb = np.isnan(vals[a]), np.isnan(vals[b])
    return (a == b) | (na & nb)


# ----------------------------------------------------------------- workflows

def graph_for(name):
    g = fr.load_graph(BASE_GRAPH)
    assert g["1"]["class_type"] == "UNETLoader"
    assert g["1"]["inputs"] == {"unet_name": "tiny_flux_dev.safetensors", "weight_dtype": "default"}
    assert g["20"]["inputs"]["lora_name"] == fl.KOHYA
    assert g["20"]["inputs"]["strength_model"] == LORA_STRENGTH
    g["1"]["inputs"]["weight_dtype"] = WORKFLOWS[name]
    assert g["9"]["inputs"]["filename_prefix"] == BASE_GRAPH
    assert g["99"]["inputs"]["filename_prefix"] == "latents/" + BASE_GRAPH
    g["9"]["inputs"]["filename_prefix"] = name
    g["99"]["inputs"]["filename_prefix"] = "latents/" + name
    return g


class Trace:
    """Wraps ModelPatcher.patch_weight_to_device, LowVramPatch.__call__ and
    comfy.float.stochastic_rounding to see which path patched what.
    rne=True: stochastic_rounding rounds fp8 to nearest instead."""

    def __init__(self, torch):
        import comfy.float
        import comfy.model_patcher as mp
        self.torch, self.mp, self.cf = torch, mp, comfy.float
        self.orig = (mp.ModelPatcher.patch_weight_to_device, mp.LowVramPatch.__call__,
                     comfy.float.stochastic_rounding)
        self.rne = False
        self.reset()
        trace = self

        def pw(patcher, key, device_to=None, inplace_update=False):
            patched = key in patcher.patches
            trace.current = key
            r = trace.orig[0](patcher, key, device_to=device_to, inplace_update=inplace_update)
            trace.current = None
            if patched:
                w = mp.get_key_weight(patcher.model, key)[0]
                trace.patched.append({"key": key, "device_to": str(device_to),
                                      "dtype": str(w.dtype).replace("torch.", ""),
                                      "after": w.detach().clone()})
            return r

        def lowvram(patch, weight):
            trace.lowvram.append(patch.key)
            return trace.orig[1](patch, weight)

        def sr(value, dtype, seed=0):
            fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            if trace.rne and fp8:
                out = value.to(dtype=dtype)
            else:
                out = trace.orig[2](value, dtype, seed=seed)
            trace.rounded.append({"key": trace.current, "seed": seed, "value": value.detach().clone(),
                                  "value_dtype": str(value.dtype).replace("torch.", ""),
                                  "device": str(value.device), "out": out.detach().clone()})
            return out
        mp.ModelPatcher.patch_weight_to_device = pw
        mp.LowVramPatch.__call__ = lowvram
        comfy.float.stochastic_rounding = sr

    def reset(self):
        self.patched, self.lowvram, self.rounded, self.current = [], [], [], None

    def nearest_latent(self, prompt, node_ns, torch):
        """The workflow run again (after reset()) with the patched weights
        rounded to nearest instead of stochastically (rne): its latent."""
        self.reset()
        self.rne = True
        try:
            _, latents = sd1.run_workflow(prompt, node_ns, torch)
        finally:
            self.rne = False
        return latents[0].float().numpy()

    def close(self):
        self.mp.ModelPatcher.patch_weight_to_device = self.orig[0]
        self.mp.LowVramPatch.__call__ = self.orig[1]
        self.cf.stochastic_rounding = self.orig[2]


def check_loaded(nodes, torch):
    """UNETLoader(weight_dtype fp8_*) on the CPU: every parameter fp8 (the
    file's f16 value cast to nearest), compute by manual cast to f32."""
    info = {}
    keys = sorted(fp.flux_keys(torch, True))
    for wf, wd in WORKFLOWS.items():
        dt = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[wd]
        (m,) = nodes.UNETLoader().load_unet("tiny_flux_dev.safetensors", wd)
        state = m.model.diffusion_model.state_dict()
        assert set(state) == {k for k, _ in keys}
        for k, shape in keys:
            v = torch.from_numpy(sd1.values(k, shape).astype(np.float16)).to(dt)
            assert state[k].dtype == dt, (k, state[k].dtype)
            assert torch.equal(state[k].view(torch.uint8), v.view(torch.uint8)), k
        qkv = m.model.diffusion_model.double_blocks[0].img_attn.qkv
        info[wd] = {
            "model_config": type(m.model.model_config).__name__,
            "parameters": "all {} state-dict tensors {} (Linear weights and biases, norm scales): the "
                          "f16 file values cast to nearest (torch .to)".format(len(keys), wd),
            "manual_cast_dtype": str(m.model.manual_cast_dtype).replace("torch.", ""),
            "linear_class": "{}.{}".format(type(qkv).__module__, type(qkv).__qualname__),
            "linear_has_set_weight": hasattr(qkv, "set_weight"),
            "weight_inplace_update": m.weight_inplace_update,
        }
        print("UNETLoader", wd, json.dumps(info[wd]))
    return info


F64_CASTS = []


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import nodes
    import comfy.model_management as mm
    import comfy.model_patcher

    if fp64:
        # With weight_dtype fp8 ComfyUI ignores --fp64-unet (the dtype is
        # given; manual cast picks f32): the f64 spread run casts the fp8
        # weights to f64 instead.
        orig_cast = mm.unet_manual_cast

        def f64_cast(weight_dtype, *args, **kwargs):
            if weight_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                F64_CASTS.append(weight_dtype)
                return torch.float64
            return orig_cast(weight_dtype, *args, **kwargs)
        mm.unet_manual_cast = f64_cast

    log = lp.LogCapture()
    with fr.comfy_tmp(torch, ["unet", "clip", "vae", "loras"], log) as tmp:
        out = {"files_from": {"flux/expected.json": fl.BASE_FILES,
                              "flux_lora/expected.json": [fl.KOHYA]},
               "files": fr.write_flux_files(tmp, fl.BASE_FILES, torch),
               "components": {}, "loaded": {}, "workflows": {}}
        specs = fr.lora_specs(nodes)
        kohya_ref, _, _ = fr.write_flux_lora(tmp, specs, fl.KOHYA, torch)
        out["files"].append(kohya_ref)
        lora_targets = sorted(t.key for t in specs[fl.KOHYA])

        if not sub:
            for name in WORKFLOWS:
                fr.write_graph(name, graph_for(name))
            seeds = seed_component()
            half, anomalies = half_ops_check(torch)
            out["components"]["string_to_seed"] = seeds
            out["components"]["torch_rand_f16"] = rand_component(torch)
            out["components"]["half_ops"] = half
            out["components"]["log2_floor_anomalies_f16_bits"] = anomalies
            out["components"]["stochastic_rounding"] = stochastic_component(torch)
            out["loaded"] = check_loaded(nodes, torch)
            runs = sd1.spread_runs(__file__)

        node_ns = fr.node_classes(nodes, fp.v3_nodes())
        trace = Trace(torch)
        kohya_lat = fr.latent_of(fr.fixture("flux_lora")["workflows"][BASE_GRAPH])
        try:
            for name, wd in WORKFLOWS.items():
                prompt = fr.load_graph(name)
                assert prompt == graph_for(name), name
                trace.reset()
                trace.rne = False
                lat, img = fr.run(name, prompt, node_ns, torch, log)
                unet_rounded = [r for r in trace.rounded if r["key"] is not None]
                assert len(unet_rounded) == len(trace.rounded), "stochastic_rounding outside patching"
                if sub:
                    if fp64:
                        assert F64_CASTS, "the f64 run did not cast to f64"
                        del F64_CASTS[:]
                    out["workflows"][name] = fr.f32_b64(lat)
                    continue
                fp8name = {"fp8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[wd]
                # the patching, as it happened
                assert not trace.lowvram, trace.lowvram
                pkeys = [p["key"] for p in trace.patched]
                assert sorted(pkeys) == lora_targets, sorted(set(pkeys) ^ set(lora_targets))
                assert len(set(pkeys)) == len(pkeys)  # once each per sampling
                assert [r["key"] for r in unet_rounded] == pkeys
                assert {p["device_to"] for p in trace.patched} == {"cpu"}
                assert {r["device"] for r in unet_rounded} == {"cpu"}
                assert {r["value_dtype"] for r in unet_rounded} == {"float32"}
                assert {p["dtype"] for p in trace.patched} == {fp8name}
                worst_rne = 0
                for p, r in zip(trace.patched, unet_rounded):
                    assert r["seed"] == comfy.model_patcher.string_to_seed(p["key"])
                    after = p["after"].view(torch.uint8).numpy()
                    assert np.array_equal(after, r["out"].view(torch.uint8).numpy()), p["key"]
                    x = r["value"].numpy()
                    mine, _ = emulate(x, fp8name, r["seed"])
                    assert nan_eq(after, mine, fp8name), p["key"]
                    rne = r["value"].to(p["after"].dtype).view(torch.uint8).numpy()
                    p["differs_from_rne"] = int((after != rne).sum())
                    worst_rne = max(worst_rne, p["differs_from_rne"] / after.size)
                recorded = []
                for k in RECORDED:
                    (p,) = [q for q in trace.patched if q["key"] == k]
                    (r,) = [q for q in unet_rounded if q["key"] == k]
                    e = {"key": k, "seed": r["seed"], "shape": list(p["after"].shape),
                         "dtype": p["dtype"], "fp8": b64(p["after"].view(torch.uint8).numpy()),
                         "differs_from_round_to_nearest": p["differs_from_rne"]}
                    if k == WITH_INPUT:
                        e["patched_f32"] = b64(r["value"].numpy().astype("<f4"))
                    recorded.append(e)
                patched_info = {
                    "keys": pkeys,
                    "seeds": {p["key"]: comfy.model_patcher.string_to_seed(p["key"]) for p in trace.patched},
                    "path": "ModelPatcher.patch_weight_to_device(key, device_to=cpu) (full load), "
                            "comfy.float.stochastic_rounding on the f32 result, generator on cpu",
                    "lowvram_patch_calls": len(trace.lowvram),
                    "stochastic_rounding_calls": len(unet_rounded),
                    "differs_from_round_to_nearest": {p["key"]: p["differs_from_rne"] for p in trace.patched},
                    "recorded": recorded,
                }
                rne_rel = fr.rel(lat, trace.nearest_latent(prompt, node_ns, torch))
                assert len(trace.rounded) == len(pkeys)
                kohya_rel = fr.rel(lat, kohya_lat)
                clipped = fr.check_image(name, img)
                w = out["workflows"][name] = {
                    "weight_dtype": wd,
                    "loras": [["LoraLoaderModelOnly", fl.KOHYA, LORA_STRENGTH, None]],
                    **fr.spreads(name, lat, runs),
                    "vs_round_to_nearest_rel": rne_rel,
                    "vs_tiny_flux_lora_kohya_rel": kohya_rel,
                    **fr.outputs(lat, img),
                    "patched": patched_info,
                }
                print(name, *fr.summary(lat, img, w, clipped), "vs round-to-nearest", rne_rel,
                      "vs f32-weight kohya fixture", kohya_rel)
                print("   patched {} weights via patch_weight_to_device on cpu, LowVramPatch calls {}, "
                      "codes differing from round-to-nearest: worst fraction {:.4f}; each rebuilt "
                      "by the numpy emulation from its f32 value and seed".format(
                          len(pkeys), len(trace.lowvram), worst_rne))
                for e in recorded:
                    print("   recorded", e["key"], "seed", e["seed"], "shape", e["shape"],
                          "differs from RNE", e["differs_from_round_to_nearest"])
        finally:
            trace.close()
        size = fr.finish("fp8_lora", out, sub)
        assert sub or size < 400000, size


if __name__ == "__main__":
    main()
