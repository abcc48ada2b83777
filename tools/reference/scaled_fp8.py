"""End-to-end reference for ComfyUI's "scaled fp8" weight files (Flux + T5).

Files people download as *_fp8_scaled.safetensors (flux1-dev-fp8-scaled,
t5xxl_fp8_e4m3fn_scaled) carry a `scaled_fp8` marker tensor, Linear weights
stored float8_e4m3fn and, per Linear, `<layer>.scale_weight` (f32 scalar).
ComfyUI (comfy/model_detection.py model_config_from_unet, comfy/sd.py
t5xxl_detect -> comfy/text_encoders/sd3_clip.py t5_xxl_detect, comfy/ops.py
scaled_fp8_ops) then builds the model with scaled_fp8_op.Linear, whose
forward computes with weight.to(compute dtype) * scale_weight.

Tiny files of that kind are built here from flux_pipeline.py's tiny Flux dev
and tiny T5 (same keys, same value formula), the workflow
graphs/tiny_flux_scaled_fp8.json (graphs/tiny_flux_fp8.json with the scaled
UNet and T5) is run through ComfyUI's own node classes on the CPU in f32, and
tests/reference/scaled_fp8/expected.json gets:
  files: flux_pipeline's entries (folder, name, keys sorted with shapes,
      scaled {}, checksum_f16) for
        unet/tiny_flux_dev_fp8_scaled.safetensors (fp.flux_keys(dev)),
        clip/tiny_t5xxl_fp8_scaled.safetensors (fp.t5_keys),
      both with "dtype": "F8_E4M3_SCALED" and "checksum_raw" (below), and
      the unscaled companions exactly as flux_pipeline writes them
      (clip/tiny_clip_l.safetensors, vae/tiny_flux_ae.safetensors; keys and
      checksum asserted equal to tests/reference/flux/expected.json), and
      loras/tiny_flux_lora_kohya.safetensors: flux_lora's entry copied
      verbatim from tests/reference/flux_lora/expected.json (rebuilt here
      with flux_lora.lora_specs / lora_pipeline.write_lora and asserted
      equal: keys, scaled, alphas, checksum_f16).
  workflows: tiny_flux_scaled_fp8 as flux's: latent_shape, latent_f32,
      image_shape, image_f32 (base64 little-endian f32), image_range [min,
      max, std], f32_vs_f64_unet_rel, unet_rounding_rel (sd1_pipeline's
      spread runs), plus vs_tiny_flux_txt2img_rel and vs_tiny_flux_fp8_rel
      (max |latent - that flux fixture latent| / max |that latent|), for
      the record.
    tiny_flux_scaled_fp8_lora (graphs/tiny_flux_scaled_fp8_lora.json: the
      same graph plus node 20 LoraLoaderModelOnly(tiny_flux_lora_kohya,
      strength_model 0.8) between UNETLoader and KSampler, prefixes
      renamed; = graphs/tiny_flux_fp8_lora.json with the scaled UNet / T5
      and weight_dtype "default", asserted): loras, latent_shape,
      latent_f32, image_shape, image_f32, image_range, f32_vs_f64_unet_rel,
      unet_rounding_rel (the same spread runs; in the --perturb-unet run
      this workflow's perturbation draws continue after the first
      workflow's, one generator), and for the record
      vs_round_to_nearest_rel (max |latent - latent of the same run with
      the patched weights' stochastic_rounding replaced by value.to(fp8)|
      / max |that|), without_lora_rel (against tiny_flux_scaled_fp8's
      latent), vs_tiny_flux_lora_kohya_rel (against flux_lora's f32-weight
      latent); and "patched" (below).
  components:
    t5_hidden: [{text, cond_shape, cond_f32, pooled_shape, pooled_f32,
        vs_unscaled_t5_rel}]: DualCLIPLoader(flux) on (tiny_clip_l,
        tiny_t5xxl_fp8_scaled), encode_from_tokens of "a photo of a cat"
        (as flux_pipeline's t5_hidden); vs_unscaled_t5_rel compares the cond
        with flux's (f16 tiny_t5xxl) one.
    scales: {file name: {"<stem>.scale_weight": the f32 scale as a
        number}} (exact: an f32 printed as f64), to debug the rule below.
    loaded: what ComfyUI built (dtypes, scale_input, manual cast, which
        branch of scaled_fp8_op.Linear.forward each Linear took).

The "F8_E4M3_SCALED" rule (tests/support rebuilds it byte for byte):
  * "keys" lists the base model keys only, sorted; the file holds, besides
    them, the derived `<stem>.scale_weight` tensors and `scaled_fp8`.
  * v16 = sd1_pipeline.values(name, shape).astype(float16) for every key.
  * a key is "scaled" when its shape is 2-D, its name does not end with
    "shared.weight" and does not contain "relative_attention_bias" (the
    Linear weights; the T5 embeddings stay f16).
  * scaled `<stem>.weight`: s = float32(max |float32(v16)|) / float32(448)
    computed in f32 (IEEE division, round to nearest even); stored
    F8_E4M3 = round_to_nearest_even_e4m3fn(float32(v16) / s), the division
    in f32 (asserted equal to numpy's f32 division), the cast torch's
    .to(float8_e4m3fn) (|q| <= 448 here, no saturation); plus
    `<stem>.scale_weight` = s, F32, shape [] (0-dim).
  * every other key: F16, v16.
  * `scaled_fp8`: F8_E4M3, shape [0] (no data).
  * checksum_f16: as flux (sd1_pipeline.checksum of v16's u16 bit patterns,
    index i = position in "keys", summed mod 2^64) -- scales not included.
  * checksum_raw: total = 0; for i, key in enumerate(keys): total +=
    checksum(stored bytes of key as uint8 units, i) (fp8: 1 byte per
    element; f16: 2 little-endian bytes per element); then with n =
    len(keys), for j, key in enumerate(scaled keys in "keys" order):
    total += checksum(the 4 little-endian bytes of its f32 scale as uint8
    units, n + j). All mod 2^64; `scaled_fp8` (no bytes) adds nothing.
    checksum(units, i) = sum_k units[k] * (k % 65521 + 1) * (i + 1) mod 2^64.

What ComfyUI makes of these files on the CPU (asserted, printed):
  * UNETLoader("default"): model_config.scaled_fp8 = float8_e4m3fn, the
    f32 UNet dtype (unet_dtype ignores the file's fp8 weight dtype for
    scaled files), operations scaled_fp8_ops. Every Linear is built with
    dtype float8_e4m3fn (override_dtype), so its *bias* is an fp8 parameter
    too: the file's f16 biases are rounded to e4m3fn (torch's cast, no
    scale) at load and used as such (|0.05 u| biases: ~4% max error, mostly
    e4m3 subnormals; keeping them f16 instead moves the DiT output by ~3e-3
    relative, far above the spreads). Norm scales stay f32 (values of the
    f16 file). The marker has 0 elements, so optimizations["fp8"] is True
    and scale_input parameters exist (ones, absent from the file: "unet
    missing" logs them); on the CPU fp8 matmul is unsupported so the
    forward never uses them: out = linear(x, W.to(f32) * s, b) when
    W.numel() < x.numel(), else linear(x * s, W.to(f32), b).
  * DualCLIPLoader(flux): with the relaxation below, t5xxl_scaled_fp8 =
    float8_e4m3fn, dtype_t5 = float16 (the final layer norm's dtype): the
    T5 Linears are scaled_fp8 ops (fp8 weight, scale_weight, no
    scale_input), embeddings / layer norms f16. CLIP-L is unaffected.

LoRA on the scaled fp8 UNet (ComfyUI 0.3.64, torch CPU; traced by
wrapping ModelPatcher.patch_weight_to_device, get_key_weight's results,
comfy.lora.calculate_weight, comfy.float.stochastic_rounding,
LowVramPatch.__call__ and forward hooks; all asserted):
  * LoraLoaderModelOnly adds 33 patches, every kohya target, all of them
    2-D Linear weights of scaled_fp8 Linears; the kohya file has no bias
    (diff_b) keys, so no bias is patched: every bias stays the load-time
    e4m3fn cast of the file's f16 value. (A bias patch would take
    get_key_weight(...bias) -> set_func None, convert_func None, an fp8
    parameter: stochastic_rounding(out, fp8, seed) directly, no scale --
    recorded, not exercised.)
  * They are applied once each, when the KSampler loads the model (full
    load on the CPU), by ModelPatcher.patch_weight_to_device(key,
    device_to=cpu); LowVramPatch is never called. get_key_weight gives
    set_func = the Linear's set_weight and convert_func = its
    convert_weight (scaled_fp8_ops.<locals>.scaled_fp8_op.Linear), the
    weight = the stored fp8 parameter. Then, all f32 on the CPU:
      temp = f32(stored fp8)                    (exact)
      temp *= scale_weight                      (convert_weight, inplace;
                                                 asserted = numpy's f32
                                                 product q * s)
      out = calculate_weight: temp += 0.8 * alpha / rank * (up @ down)
                                                (vs the f64 formula: worst
                                                 rel 9.7e-8)
      set_weight(out, inplace_update=False, seed=string_to_seed(key)):
        stored = stochastic_rounding(out / scale_weight, float8_e4m3fn,
                                     seed)      (the division is IEEE f32,
                                                 asserted = numpy's; the
                                                 rounding fp8_lora.py's,
                                                 CPU generator; every
                                                 patched weight rebuilt
                                                 byte for byte by
                                                 fp8_lora.emulate)
        -> a new Parameter; scale_weight unchanged.
    The forward after patching is the unpatched one: for txt_in (branch
    W*s) and double_blocks.0.img_attn.qkv (branch x*s) the first call
    during sampling is asserted bit-equal to linear(x, f32(stored) * s, b)
    resp. linear(x * s, f32(stored), b) with the patched bytes.
  * patched: keys (patch order), seeds {key: string_to_seed(key)}, path,
    set_func, convert_func, bias_patches (0), bias, lowvram_patch_calls
    (0), stochastic_rounding_calls (33), differs_from_round_to_nearest
    {key: codes != (out / s).to(fp8)}, clamped_to_448 {key: elements with
    |out / s| > 448}, recorded: for RECORDED keys {key, seed, scale (the
    f32 scale_weight as a number), scale_f32_bits, shape, dtype, fp8
    (base64 of the model's weight.view(torch.uint8) after patching),
    differs_from_round_to_nearest, clamped_to_448}, txt_in also patched_f32
    (base64 little-endian f32: calculate_weight's result W*s + dW, i.e.
    *before* the division by the scale; stochastic_rounding's input is
    patched_f32 / scale in f32).
  Measured: f32_vs_f64_unet_rel 1.4e-7, unet_rounding_rel 4.3e-7,
  vs_round_to_nearest_rel 0.034, without_lora_rel 0.144,
  vs_tiny_flux_lora_kohya_rel 0.037; 22-25% of the codes of each patched
  weight differ from round-to-nearest (qkv 3019 of 12288, txt_in 485 of
  2048). As in fp8_lora, the stochastic rounding moves the result ~1e5 x
  the spreads: the exact bytes must be reproduced.
  Saturation: the scale stays the file's max |W| / 448, so wherever the
  LoRA grows |W| beyond the old maximum, |out / s| > 448 and
  stochastic_rounding's clamp stores +-448 (asserted: code 0x7E / 0xFE).
  Here every patched weight has some: 25548 of 473088 elements in all,
  1.7% of img_attn.qkv (double_blocks.1) up to 11.3% of
  double_blocks.0.txt_mod.lin (the alpha-8 modulation targets clip most);
  qkv.0 233, txt_in 125 (max |out / s| 630.6).

ComfyUI only recognises full-size parts. Relaxed, as in flux_pipeline.py
(fp.patch_comfy: tiny CLIP-L / T5 configs, Flux widths in detect_unet_config,
the ae VAE widths), and one more:
  * comfy.sd.t5xxl_detect only looks at
      encoder.block.23.layer.1.DenseReluDense.wi_1.weight (or .wi.weight);
      the tiny T5 has 2 blocks, so ComfyUI would not call
      sd3_clip.t5_xxl_detect, would miss the scaled_fp8 marker, and would
      load the raw fp8 values into an unscaled T5. Wrapped: when the
      original finds nothing, a state dict holding the tiny T5's last
      block's wi_1 (encoder.block.1.layer.1.DenseReluDense.wi_1.weight) is
      passed to ComfyUI's own sd3_clip.t5_xxl_detect (asserted: its options
      contain t5xxl_scaled_fp8 = float8_e4m3fn).
Everything else is ComfyUI's own.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/scaled_fp8.py
(media-only imports are stubbed as in sd1_pipeline.py; the flux fixtures
are not rewritten; model folders, fixture checks, workflow runs, spreads
and the per-workflow fields shared with the other Flux fixture scripts
are fixture_runs.py's.)
"""
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import flux_pipeline as fp  # noqa: E402
import flux_lora as fl  # noqa: E402
import fp8_lora as fl8  # noqa: E402
import lora_pipeline as lp  # noqa: E402
import fixture_runs as fr  # noqa: E402

SCALED = "F8_E4M3_SCALED"
FP8_MAX = 448.0
UNET_FILE = "tiny_flux_dev_fp8_scaled.safetensors"
T5_FILE = "tiny_t5xxl_fp8_scaled.safetensors"
COMPANIONS = ["tiny_clip_l.safetensors", "tiny_flux_ae.safetensors"]
WORKFLOW = "tiny_flux_scaled_fp8"
BASE_GRAPH = "tiny_flux_fp8"
HIDDEN_PROMPT = "a photo of a cat"
TINY_T5_LAST = "encoder.block.{}.layer.1.DenseReluDense.wi_1.weight".format(fp.T5["num_layers"] - 1)
REL_FP8 = 0.07
LORA_WORKFLOW = "tiny_flux_scaled_fp8_lora"
LORA_STRENGTH = 0.8
LORA_NODE = "20"
LORA_LOADERS = [["LoraLoaderModelOnly", fl.KOHYA, LORA_STRENGTH, None]]
assert [list(x) for x in fl.WORKFLOWS["tiny_flux_lora_kohya"]] == LORA_LOADERS
# The two patched weights whose stored fp8 bytes are recorded (txt_in also
# with the f32 weight calculate_weight returned).
RECORDED = ["diffusion_model.double_blocks.0.img_attn.qkv.weight", "diffusion_model.txt_in.weight"]
WITH_INPUT = "diffusion_model.txt_in.weight"
# Patched Linears whose forward (after patching, inside the sampling) is
# checked against stored fp8 x scale_weight: one per branch.
FORWARD_CHECKED = {"diffusion_model.txt_in.weight": "W*s",
                   "diffusion_model.double_blocks.0.img_attn.qkv.weight": "x*s"}


def is_scaled(name, shape):
    return (len(shape) == 2 and not name.endswith("shared.weight")
            and "relative_attention_bias" not in name)


def stem(name):
    assert name.endswith(".weight"), name
    return name[:-len(".weight")]


def scaled_tensor(name, shape, torch):
    """(v16, stored fp8 tensor, f32 scale) of a scaled key."""
    v16 = sd1.values(name, shape).astype(np.float16)
    v32 = v16.astype(np.float32)
    s = np.float32(np.abs(v32).max()) / np.float32(FP8_MAX)
    assert isinstance(s, np.float32) and s > 0, (name, type(s))
    q32 = torch.from_numpy(v32) / torch.tensor(s, dtype=torch.float32)
    assert q32.dtype == torch.float32
    assert np.array_equal(q32.numpy(), v32 / s), name  # IEEE f32 division
    assert float(q32.abs().max()) <= FP8_MAX * (1 + 2 ** -20), name
    q = q32.to(torch.float8_e4m3fn)
    assert not torch.isnan(q.float()).any(), name
    return v16, q, s


def write_scaled(path, keys, torch):
    """The F8_E4M3_SCALED file of `keys` (sorted). Returns (checksum_f16,
    checksum_raw, {"<stem>.scale_weight": float(s)})."""
    from safetensors.torch import save_file
    tensors, total, raw, scales = {}, 0, 0, {}
    for i, (k, shape) in enumerate(keys):
        if is_scaled(k, shape):
            v16, t, s = scaled_tensor(k, shape, torch)
            tensors[stem(k) + ".scale_weight"] = torch.tensor(s, dtype=torch.float32)
            scales[stem(k) + ".scale_weight"] = s
        else:
            v16 = sd1.values(k, shape).astype(np.float16)
            t = torch.from_numpy(v16)
        total = (total + sd1.checksum(v16.view(np.uint16), i)) % (1 << 64)
        b = t.contiguous().view(torch.uint8).numpy()
        assert b.size == int(np.prod(shape)) * (1 if t.dtype == torch.float8_e4m3fn else 2)
        raw = (raw + sd1.checksum(b, i)) % (1 << 64)
        tensors[k] = t
    n = len(keys)
    for j, (k, s) in enumerate(scales.items()):
        b = np.frombuffer(struct.pack("<f", float(s)), np.uint8)
        assert b.tobytes() == np.array([s], "<f4").tobytes()
        raw = (raw + sd1.checksum(b, n + j)) % (1 << 64)
    tensors["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    assert list(tensors["scaled_fp8"].shape) == [0]
    assert all(list(tensors[k].shape) == [] for k in scales)
    save_file(tensors, path)
    # scales in key order, as the checksum used them
    assert list(scales) == [stem(k) + ".scale_weight" for k, s in keys if is_scaled(k, s)]
    return total, raw, {k: float(v) for k, v in scales.items()}


def e4m3_rne(x):
    """float8_e4m3fn codes of f32 values |x| <= 448 by round to nearest,
    ties to the even code, in numpy alone (no torch): the rule as Rust
    implements it."""
    e = np.arange(16).repeat(8)
    m = np.tile(np.arange(8), 16)
    vals = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))[:127]
    a = np.abs(x.astype(np.float64)).reshape(-1)
    assert (a < 464.0).all()  # rounds to at most 448
    hi = np.clip(np.searchsorted(vals, a), 1, 126)
    lo = hi - 1
    dlo, dhi = a - vals[lo], vals[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == 0, 0, code)
    sign = np.signbit(x.reshape(-1)).astype(np.int64) << 7
    return (code | sign).astype(np.uint8)


def verify_file(path, keys, checksum_raw):
    """The written file, read back as bytes (safetensors header + data),
    against the docstring's rule rebuilt with numpy alone."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    data = blob[8 + n:]

    def raw(k):
        a, b = header[k]["data_offsets"]
        return np.frombuffer(data[a:b], np.uint8)
    scaled = [(k, sh) for k, sh in keys if is_scaled(k, sh)]
    want = {k for k, _ in keys} | {stem(k) + ".scale_weight" for k, _ in scaled} | {"scaled_fp8"}
    assert set(header) == want, set(header) ^ want
    assert header["scaled_fp8"]["dtype"] == "F8_E4M3" and header["scaled_fp8"]["shape"] == [0]
    total = 0
    for i, (k, sh) in enumerate(keys):
        v16 = sd1.values(k, sh).astype(np.float16)
        assert header[k]["shape"] == list(sh), k
        if is_scaled(k, sh):
            v32 = v16.astype(np.float32)
            s = np.float32(np.abs(v32).max()) / np.float32(FP8_MAX)
            h = header[stem(k) + ".scale_weight"]
            assert h["dtype"] == "F32" and h["shape"] == [], (k, h)
            assert raw(stem(k) + ".scale_weight").tobytes() == np.array([s], "<f4").tobytes(), k
            assert header[k]["dtype"] == "F8_E4M3", k
            b = e4m3_rne(v32 / s)
        else:
            assert header[k]["dtype"] == "F16", k
            b = np.frombuffer(v16.astype("<f2").tobytes(), np.uint8)
        assert np.array_equal(raw(k), b), k
        total = (total + sd1.checksum(b, i)) % (1 << 64)
    for j, (k, _) in enumerate(scaled):
        total = (total + sd1.checksum(raw(stem(k) + ".scale_weight"), len(keys) + j)) % (1 << 64)
    assert total == checksum_raw, (path, total, checksum_raw)


def patch_t5_detect():
    """comfy.sd.t5xxl_detect recognising the 2-block tiny T5 (docstring)."""
    import comfy.sd
    import comfy.text_encoders.sd3_clip
    orig = comfy.sd.t5xxl_detect
    calls = []

    def tiny_t5xxl_detect(clip_data):
        out = orig(clip_data)
        if not out:
            for sd in clip_data:
                if TINY_T5_LAST in sd:
                    out = comfy.text_encoders.sd3_clip.t5_xxl_detect(sd)
                    break
        calls.append(dict(out))
        return out
    comfy.sd.t5xxl_detect = tiny_t5xxl_detect
    return calls


def graph():
    g = fr.load_graph(BASE_GRAPH)
    assert g["1"]["inputs"]["unet_name"] == "tiny_flux_dev_fp8.safetensors"
    assert g["2"]["inputs"]["clip_name2"] == "tiny_t5xxl.safetensors"
    g["1"]["inputs"]["unet_name"] = UNET_FILE
    g["2"]["inputs"]["clip_name2"] = T5_FILE
    assert g["9"]["inputs"]["filename_prefix"] == BASE_GRAPH
    assert g["99"]["inputs"]["filename_prefix"] == "latents/" + BASE_GRAPH
    g["9"]["inputs"]["filename_prefix"] = WORKFLOW
    g["99"]["inputs"]["filename_prefix"] = "latents/" + WORKFLOW
    return g


def graph_lora():
    """graph() with LoraLoaderModelOnly(kohya, 0.8) as node 20 between
    UNETLoader and KSampler, prefixes renamed. Asserted equal to
    graphs/tiny_flux_fp8_lora.json with the scaled files and weight_dtype
    "default"."""
    base = graph()
    g = {}
    for nid, node in base.items():
        node = json.loads(json.dumps(node))
        if node["class_type"] == "KSampler":
            assert node["inputs"]["model"] == ["1", 0]
            node["inputs"]["model"] = [LORA_NODE, 0]
        if "filename_prefix" in node["inputs"]:
            v = node["inputs"]["filename_prefix"]
            assert v in (WORKFLOW, "latents/" + WORKFLOW), v
            node["inputs"]["filename_prefix"] = v.replace(WORKFLOW, LORA_WORKFLOW)
        g[nid] = node
        if nid == "13":
            ((cls, lora, sm, _),) = LORA_LOADERS
            g[LORA_NODE] = {"class_type": cls, "inputs": {
                "model": ["1", 0], "lora_name": lora, "strength_model": sm}}
    assert len(g) == len(base) + 1
    other = fr.load_graph("tiny_flux_fp8_lora")
    assert other["1"]["inputs"] == {"unet_name": "tiny_flux_dev.safetensors",
                                    "weight_dtype": "fp8_e4m3fn"}
    other["1"]["inputs"] = {"unet_name": UNET_FILE, "weight_dtype": "default"}
    other["2"]["inputs"]["clip_name2"] = T5_FILE
    for nid in ("9", "99"):
        other[nid]["inputs"]["filename_prefix"] = other[nid]["inputs"]["filename_prefix"].replace(
            "tiny_flux_fp8_lora", LORA_WORKFLOW)
    assert other == g and list(other) == list(g)
    return g


class LoraTrace(fl8.Trace):
    """fp8_lora.Trace (patch_weight_to_device, LowVramPatch,
    stochastic_rounding; rne=True rounds to nearest instead) plus, per
    patched key, the set_func / convert_func get_key_weight gave, the
    Linear module, and comfy.lora.calculate_weight's f32 result; and
    forward hooks on FORWARD_CHECKED's Linears recording their first call
    after patching."""

    def __init__(self, torch):
        super().__init__(torch)
        import comfy.lora
        import comfy.utils
        self.lora = comfy.lora
        mp = self.mp
        self.orig2 = (mp.ModelPatcher.patch_weight_to_device, comfy.lora.calculate_weight)
        trace = self

        def pw(patcher, key, device_to=None, inplace_update=False):
            if key in patcher.patches:
                w, set_func, convert_func = mp.get_key_weight(patcher.model, key)
                op = comfy.utils.get_attr(patcher.model, key.rsplit(".", 1)[0])
                trace.funcs[key] = {"set_func": set_func, "convert_func": convert_func, "op": op,
                                    "model": patcher.model,
                                    "before": w.detach().clone(),
                                    "inplace_update": patcher.weight_inplace_update or inplace_update}
                if key in FORWARD_CHECKED:
                    def hook(mod, args, out, key=key):
                        if key not in trace.forward:
                            trace.forward[key] = {
                                "x": args[0].detach().clone(), "out": out.detach().clone(),
                                "weight": mod.weight.detach().clone(),
                                "bias": mod.bias.detach().clone(),
                                "scale_weight": mod.scale_weight.detach().clone()}
                    trace.hooks.append(op.register_forward_hook(hook))
            return trace.orig2[0](patcher, key, device_to=device_to, inplace_update=inplace_update)

        def cw(patches, weight, key, *args, **kwargs):
            temp = weight.detach().clone()
            out = trace.orig2[1](patches, weight, key, *args, **kwargs)
            trace.computed.append({"key": key, "current": trace.current, "temp": temp,
                                   "out": out.detach().clone()})
            return out
        mp.ModelPatcher.patch_weight_to_device = pw
        comfy.lora.calculate_weight = cw

    def reset(self):
        super().reset()
        for h in getattr(self, "hooks", []):
            h.remove()
        self.funcs, self.computed, self.forward, self.hooks = {}, [], {}, []

    def close(self):
        self.reset()
        self.mp.ModelPatcher.patch_weight_to_device = self.orig2[0]
        self.lora.calculate_weight = self.orig2[1]
        super().close()


def func_name(f):
    return None if f is None else getattr(f, "__qualname__", repr(f))


def check_patching(trace, lora_targets, lora_data, scales, torch):
    """The patching of the LoRA workflow as it happened (asserted), and its
    record."""
    import comfy.model_patcher
    import comfy.utils
    assert not trace.lowvram, trace.lowvram
    pkeys = [p["key"] for p in trace.patched]
    assert sorted(pkeys) == sorted(lora_targets), sorted(set(pkeys) ^ set(lora_targets))
    assert len(set(pkeys)) == len(pkeys)  # once each per sampling
    assert not [k for k in pkeys if not k.endswith(".weight")], "bias patched"
    assert [c["key"] for c in trace.computed] == pkeys
    assert [c["current"] for c in trace.computed] == pkeys
    assert [r["key"] for r in trace.rounded] == pkeys, "stochastic_rounding outside patching"
    assert {p["device_to"] for p in trace.patched} == {"cpu"}
    assert {r["device"] for r in trace.rounded} == {"cpu"}
    assert {r["value_dtype"] for r in trace.rounded} == {"float32"}
    assert {p["dtype"] for p in trace.patched} == {"float8_e4m3fn"}
    assert {f["inplace_update"] for f in trace.funcs.values()} == {False}
    targets = {t.key: t for t in lora_data[0]}
    worst_rne, worst_formula = 0.0, 0.0
    for p, c, r in zip(trace.patched, trace.computed, trace.rounded):
        k = p["key"]
        f = trace.funcs[k]
        op = f["op"]
        # set_func / convert_func: the scaled_fp8 Linear's own methods.
        assert type(op).__qualname__.startswith("scaled_fp8_ops.<locals>.scaled_fp8_op"), k
        assert f["set_func"] is not None and f["set_func"].__func__ is type(op).set_weight, k
        assert f["convert_func"] is not None and f["convert_func"].__func__ is type(op).convert_weight, k
        s = np.float32(scales[stem(k[len("diffusion_model."):]) + ".scale_weight"])
        assert float(op.scale_weight) == float(s), k  # scale untouched by patching
        file_key = k[len("diffusion_model."):]
        _, q, s2 = scaled_tensor(file_key, list(p["after"].shape), torch)
        assert s2 == s
        assert torch.equal(f["before"].view(torch.uint8), q.view(torch.uint8)), k
        # convert_func: temp = f32(stored fp8) * scale, in place, f32.
        assert c["temp"].dtype == torch.float32
        assert np.array_equal(c["temp"].numpy(), q.float().numpy() * s), k
        # calculate_weight: temp + 0.8 * alpha / rank * up @ down (f32), checked in f64.
        want = q.float().numpy().astype(np.float64) * float(s) + LORA_STRENGTH * targets[k].delta(
            (lora_data[1], lora_data[2], lora_data[3]), list(q.shape), torch)
        out = c["out"].numpy()
        rel = float(np.abs(out - want).max() / np.abs(want).max())
        assert rel < 1e-5, (k, rel)
        worst_formula = max(worst_formula, rel)
        # set_weight: stochastic_rounding(out / scale, fp8, seed=string_to_seed(key)).
        assert r["seed"] == comfy.model_patcher.string_to_seed(k), k
        assert np.array_equal(r["value"].numpy(), out / s), k  # IEEE f32 division
        after = p["after"].view(torch.uint8).numpy()
        assert np.array_equal(after, r["out"].view(torch.uint8).numpy()), k
        assert op.weight.dtype == torch.float8_e4m3fn
        assert np.array_equal(op.weight.detach().view(torch.uint8).numpy(), after), k
        mine, _ = fl8.emulate(r["value"].numpy(), "float8_e4m3fn", r["seed"])
        assert np.array_equal(after, mine), k  # numpy rebuild, byte for byte
        rne = r["value"].to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        p["differs_from_rne"] = int((after != rne).sum())
        worst_rne = max(worst_rne, p["differs_from_rne"] / after.size)
        # the scale is the file's (max |W| / 448): W*s + dW beyond it saturates
        v = r["value"].numpy()
        p["clamped"] = int((np.abs(v) > FP8_MAX).sum())
        assert ((after[np.abs(v) > FP8_MAX] & 0x7F) == 0x7E).all(), k
        # the bias: not patched, still the load-time e4m3fn cast of the f16 value
        b16 = torch.from_numpy(sd1.values(stem(file_key) + ".bias", [q.shape[0]]).astype(np.float16))
        assert op.bias.dtype == torch.float8_e4m3fn
        assert torch.equal(op.bias.view(torch.uint8), b16.to(torch.float8_e4m3fn).view(torch.uint8)), k
    # The forward after patching: stored fp8 x scale_weight, as before.
    assert set(trace.forward) == set(FORWARD_CHECKED), set(trace.forward)
    for k, branch in FORWARD_CHECKED.items():
        fw = trace.forward[k]
        (p,) = [q for q in trace.patched if q["key"] == k]
        assert torch.equal(fw["weight"].view(torch.uint8), p["after"].view(torch.uint8)), k
        w, b, sw, x = fw["weight"].float(), fw["bias"].float(), fw["scale_weight"], fw["x"]
        assert (w.numel() < x.numel()) == (branch == "W*s"), (k, branch)
        want = (torch.nn.functional.linear(x, w * sw, b) if branch == "W*s"
                else torch.nn.functional.linear(x * sw, w, b))
        assert torch.equal(fw["out"], want), k
    # What a bias patch would take (none here): get_key_weight of a bias.
    bias_key = RECORDED[0][:-len(".weight")] + ".bias"
    bias_w, bias_set, bias_convert = comfy.model_patcher.get_key_weight(
        trace.funcs[RECORDED[0]]["model"], bias_key)
    assert bias_set is None and bias_convert is None and bias_w.dtype == torch.float8_e4m3fn
    recorded = []
    for k in RECORDED:
        (p,) = [q for q in trace.patched if q["key"] == k]
        (r,) = [q for q in trace.rounded if q["key"] == k]
        (c,) = [q for q in trace.computed if q["key"] == k]
        s = float(trace.funcs[k]["op"].scale_weight)
        e = {"key": k, "seed": r["seed"], "scale": s,
             "scale_f32_bits": int(np.float32(s).view(np.uint32)),
             "shape": list(p["after"].shape), "dtype": p["dtype"],
             "fp8": fl8.b64(p["after"].view(torch.uint8).numpy()),
             "differs_from_round_to_nearest": p["differs_from_rne"], "clamped_to_448": p["clamped"]}
        if k == WITH_INPUT:
            e["patched_f32"] = fl8.b64(c["out"].numpy().astype("<f4"))
        recorded.append(e)
    f0 = trace.funcs[RECORDED[0]]
    info = {
        "keys": pkeys,
        "seeds": {k: comfy.model_patcher.string_to_seed(k) for k in pkeys},
        "path": "ModelPatcher.patch_weight_to_device(key, device_to=cpu) (full load): temp = "
                "f32(stored fp8); convert_func(temp, inplace=True): temp *= scale_weight (f32); "
                "out = comfy.lora.calculate_weight (temp += 0.8 * alpha / rank * up @ down, f32); "
                "set_func(out, seed=string_to_seed(key)): stochastic_rounding(out / scale_weight "
                "(f32 division), float8_e4m3fn, seed), generator on cpu, stored as a new "
                "Parameter; scale_weight unchanged; the forward uses stored fp8 x scale_weight",
        "set_func": func_name(f0["set_func"]),
        "convert_func": func_name(f0["convert_func"]),
        "every_patched_key_has_set_and_convert_func": True,
        "bias_patches": 0,
        "bias": "the kohya file patches only the 33 Linear weights (no diff_b / bias keys); every "
                "bias stays the load-time float8_e4m3fn cast of the file's f16 value. A bias patch "
                "would find get_key_weight({}) -> set_func {}, convert_func {}, dtype {}: "
                "stochastic_rounding(out, fp8, seed) directly, no scale".format(
                    bias_key, func_name(bias_set), func_name(bias_convert), dtype_name(bias_w)),
        "lowvram_patch_calls": len(trace.lowvram),
        "stochastic_rounding_calls": len(trace.rounded),
        "differs_from_round_to_nearest": {p["key"]: p["differs_from_rne"] for p in trace.patched},
        "clamped_to_448": {p["key"]: p["clamped"] for p in trace.patched},
        "recorded": recorded,
    }
    print("   patched {} weights (no biases) via patch_weight_to_device on cpu: set_func {}, "
          "convert_func {}; LowVramPatch calls {}; calculate_weight vs f64 formula worst rel {:.2e}; "
          "codes differing from round-to-nearest: worst fraction {:.4f}; every one rebuilt by "
          "fp8_lora.emulate from out / scale and the seed".format(
              len(pkeys), info["set_func"], info["convert_func"], len(trace.lowvram),
              worst_formula, worst_rne))
    print("   bias:", info["bias"])
    clamped = sum(info["clamped_to_448"].values())
    print("   |out / scale| > 448, saturated to +-448: {} codes in {} of {} weights (most {:.4f} "
          "of a weight)".format(clamped, sum(1 for v in info["clamped_to_448"].values() if v),
                                len(pkeys), max(p["clamped"] / p["after"].numel() for p in trace.patched)))
    for e in recorded:
        print("   recorded", e["key"], "seed", e["seed"], "scale", e["scale"], "shape", e["shape"],
              "differs from RNE", e["differs_from_round_to_nearest"], "clamped", e["clamped_to_448"])
    return info


def dtype_name(t):
    return None if t is None else str(t.dtype).replace("torch.", "")


def check_linear(mod, key, shape, scales, torch):
    """A scaled_fp8 Linear as loaded: fp8 weight = the file's bytes, its
    scale_weight = the file's scale; the effective weight is close to the
    f16 value. Returns (rel max err, rel rms err)."""
    v16, q, s = scaled_tensor(key, shape, torch)
    sw = getattr(mod, "scale_weight", None)
    assert type(mod).__qualname__.startswith("scaled_fp8_ops.<locals>.scaled_fp8_op"), \
        (key, type(mod).__qualname__)
    assert sw is not None and sw.dtype == torch.float32 and list(sw.shape) == [], (key, sw)
    assert float(sw) == scales[stem(key) + ".scale_weight"] == float(s), (key, float(sw), s)
    assert mod.weight.dtype == torch.float8_e4m3fn, (key, mod.weight.dtype)
    assert torch.equal(mod.weight.view(torch.uint8), q.view(torch.uint8)), key
    eff = mod.weight.float() * sw
    ref = torch.from_numpy(v16.astype(np.float32))
    err = (eff - ref).abs()
    rel = float(err.max() / ref.abs().max())
    rms = float(err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert rel < REL_FP8, (key, rel)
    assert rel > 0, key
    return rel, rms


def check_models(nodes, torch, scales, detect_calls, log):
    """ComfyUI's loaders really build scaled_fp8 ops from these files."""
    import comfy.sd
    import comfy.utils
    loaded = {}
    # UNet
    del log.records[:]
    (m,) = nodes.UNETLoader().load_unet(UNET_FILE, "default")
    unet_log = [r for r in log.records if "missing" in r or "unexpected" in r]
    cfg = m.model.model_config
    assert type(cfg).__name__ == "Flux" and cfg.scaled_fp8 == torch.float8_e4m3fn, cfg
    dm = m.model.diffusion_model
    state = dm.state_dict()
    ukeys = sorted(fp.flux_keys(torch, True))
    worst = (0.0, 0.0)
    linears = 0
    for k, shape in ukeys:
        if is_scaled(k, shape):
            mod = dm.get_submodule(stem(k))
            rel, rms = check_linear(mod, k, shape, scales[UNET_FILE], torch)
            worst = max(worst, (rel, rms))
            linears += 1
            if mod.bias is not None:
                b = torch.from_numpy(sd1.values(stem(k) + ".bias", [shape[0]]).astype(np.float16))
                assert mod.bias.dtype == torch.float8_e4m3fn, (k, mod.bias.dtype)
                assert torch.equal(mod.bias.view(torch.uint8),
                                   b.to(torch.float8_e4m3fn).view(torch.uint8)), k
        elif not k.endswith(".bias"):
            want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
            assert state[k].dtype == torch.float32, (k, state[k].dtype)
            assert np.array_equal(state[k].numpy(), want), k
    qkv = dm.double_blocks[0].img_attn.qkv
    si = qkv.scale_input
    unet_info = {
        "model_config": type(cfg).__name__, "scaled_fp8": dtype_name(torch.empty(0, dtype=cfg.scaled_fp8)),
        "optimizations_fp8": cfg.optimizations.get("fp8"),
        "manual_cast_dtype": None if m.model.manual_cast_dtype is None else
        str(m.model.manual_cast_dtype).replace("torch.", ""),
        "linear_weight": dtype_name(qkv.weight), "linear_bias": dtype_name(qkv.bias),
        "scale_weight": dtype_name(qkv.scale_weight),
        "scale_input": None if si is None else [dtype_name(si), float(si)],
        "norm_scale": dtype_name(dm.double_blocks[0].img_attn.norm.query_norm.scale),
        "scaled_linears": linears,
        "biases": "the file's f16 biases cast to float8_e4m3fn (no scale) at load",
        "log": unet_log,
    }
    print("UNETLoader", UNET_FILE, json.dumps(unet_info))
    print("   double_blocks.0.img_attn.qkv: weight", qkv.weight.dtype, "scale_weight",
          float(qkv.scale_weight), "(file", scales[UNET_FILE]["double_blocks.0.img_attn.qkv.scale_weight"],
          ") bias", qkv.bias.dtype, "scale_input", None if si is None else float(si))
    print("   every scaled Linear: fp8 bytes and scale as in the file; effective weight vs f16 "
          "value: worst rel max err {:.4f}, its rms rel {:.4f} (limit {})".format(*worst, REL_FP8))
    print("   biases are fp8 parameters: the f16 bias values rounded to e4m3fn, exactly")

    # Which branch of scaled_fp8_op.Linear.forward each Linear takes for the
    # workflow's shapes (64x64 image: 16 image tokens, 256 T5 tokens).
    paths = {}
    hooks = []
    for name, mod in dm.named_modules():
        if hasattr(mod, "scale_weight"):
            def hook(mod, args, name=name):
                x = args[0]
                paths[name] = "W*s" if mod.weight.numel() < x.numel() else "x*s"
            hooks.append(mod.register_forward_pre_hook(hook))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((1, 16, 8, 8), generator=gen)
    ctx = torch.randn((1, 256, fp.FLUX["context_in_dim"]), generator=gen)
    y = torch.randn((1, fp.FLUX["vec_in_dim"]), generator=gen)
    with torch.inference_mode():
        o = dm(x, torch.tensor([0.75]), ctx, y=y, guidance=torch.tensor([3.5]))
    assert torch.isfinite(o).all()
    for h in hooks:
        h.remove()
    unet_info["linear_branch"] = {
        "W*s (weight.numel() < input.numel(): linear(x, W*s, b))":
            sorted(k for k, v in paths.items() if v == "W*s"),
        "x*s (else: linear(x*s, W, b))": sorted(k for k, v in paths.items() if v == "x*s")}
    print("   Linear branch at the workflow's shapes:", json.dumps(unet_info["linear_branch"]))
    loaded["unet"] = unet_info
    del m, dm

    # T5 detection (the relaxation) and the loaded T5.
    t5_sd = comfy.utils.load_torch_file(os.path.join(TMP[0], "clip", T5_FILE), safe_load=True)
    l_sd = comfy.utils.load_torch_file(os.path.join(TMP[0], "clip", COMPANIONS[0]), safe_load=True)
    opts = comfy.sd.t5xxl_detect([l_sd, t5_sd])
    assert opts == {"dtype_t5": torch.float16, "t5xxl_scaled_fp8": torch.float8_e4m3fn}, opts
    print("t5xxl_detect (relaxed) on (tiny_clip_l, {}):".format(T5_FILE), opts)
    del detect_calls[:]
    del log.records[:]
    (clip,) = nodes.DualCLIPLoader().load_clip(COMPANIONS[0], T5_FILE, "flux")
    clip_log = [r for r in log.records if "missing" in r or "unexpected" in r]
    assert detect_calls == [opts], detect_calls
    cm = clip.cond_stage_model
    tr = cm.t5xxl.transformer
    assert getattr(tr, "scaled_fp8", None) is not None and tr.scaled_fp8.dtype == torch.float8_e4m3fn
    tstate = tr.state_dict()
    for k, shape in sorted(fp.t5_keys(torch)):
        if is_scaled(k, shape):
            mod = tr.get_submodule(stem(k))
            check_linear(mod, k, shape, scales[T5_FILE], torch)
            assert mod.scale_input is None
        else:
            want = sd1.values(k, shape).astype(np.float16)
            assert tstate[k].dtype == torch.float16, (k, tstate[k].dtype)
            assert np.array_equal(tstate[k].numpy(), want), k
    for k, shape in fp.fam.clip_hf_keys(torch, fp.CLIP_L, False):
        want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
        assert np.array_equal(cm.clip_l.transformer.state_dict()[k].float().numpy(), want), k
    q = tr.encoder.block[0].layer[0].SelfAttention.q
    t5_paths, t5_in = {}, {}
    hooks = []
    for name, mod in tr.named_modules():
        if hasattr(mod, "scale_weight"):
            def hook(mod, args, name=name):
                x = args[0]
                t5_paths[name] = "W*s" if mod.weight.numel() < x.numel() else "x*s"
                t5_in[name] = dtype_name(x)
            hooks.append(mod.register_forward_pre_hook(hook))
    clip.encode_from_tokens(clip.tokenize(HIDDEN_PROMPT), return_pooled=True)
    for h in hooks:
        h.remove()
    t5_info = {
        "t5xxl_detect": {k: dtype_name(torch.empty(0, dtype=v)) for k, v in opts.items()},
        "linear_weight": dtype_name(q.weight), "scale_weight": dtype_name(q.scale_weight),
        "scale_input": None if q.scale_input is None else float(q.scale_input),
        "shared": dtype_name(tr.shared.weight),
        "relative_attention_bias": dtype_name(
            tr.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight),
        "layer_norm": dtype_name(tr.encoder.final_layer_norm.weight),
        "linear_input_dtype": sorted(set(t5_in.values())),
        "linear_branch": sorted(set(t5_paths.values())),
        "clip_l_weights": dtype_name(cm.clip_l.transformer.text_model.embeddings.token_embedding.weight),
        "log": clip_log,
    }
    print("DualCLIPLoader flux", COMPANIONS[0], T5_FILE, json.dumps(t5_info))
    print("   encoder.block.0.layer.0.SelfAttention.q: weight", q.weight.dtype, "scale_weight",
          float(q.scale_weight), "(file",
          scales[T5_FILE]["encoder.block.0.layer.0.SelfAttention.q.scale_weight"], ")")
    loaded["t5"] = t5_info
    return loaded


TMP = [None]


def t5_hidden(nodes, flux_ref):
    (clip,) = nodes.DualCLIPLoader().load_clip(COMPANIONS[0], T5_FILE, "flux")
    cond, pooled = clip.encode_from_tokens(clip.tokenize(HIDDEN_PROMPT), return_pooled=True)
    c, p = cond.float().numpy(), pooled.float().numpy()
    assert np.isfinite(c).all() and np.isfinite(p).all()
    (ref,) = [x for x in flux_ref["components"]["t5_hidden"] if x["text"] == HIDDEN_PROMPT]
    rc = fr.decode(ref["cond_f32"]).reshape(ref["cond_shape"])
    rp = fr.decode(ref["pooled_f32"]).reshape(ref["pooled_shape"])
    assert rc.shape == c.shape and rp.shape == p.shape
    rel = float(np.abs(c - rc).max() / np.abs(rc).max())
    assert 1e-4 < rel < 0.2, rel  # scaled fp8 T5 near the f16 one, not equal
    assert np.array_equal(p, rp)  # CLIP-L is the same file
    print("t5 hidden", repr(HIDDEN_PROMPT), "cond", c.shape, "std", float(c.std()),
          "vs the f16 T5 (flux fixture) rel", rel, "pooled identical to flux's")
    return [{"text": HIDDEN_PROMPT, "cond_shape": list(c.shape), "cond_f32": sd1.b64(c.astype("<f4")),
             "pooled_shape": list(p.shape), "pooled_f32": sd1.b64(p.astype("<f4")),
             "vs_unscaled_t5_rel": rel}]


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import nodes

    log = lp.LogCapture()
    with fr.comfy_tmp(torch, ["unet", "clip", "vae", "loras"], log) as tmp:
        TMP[0] = tmp
        detect_calls = patch_t5_detect()
        flux_ref = fr.fixture("flux")
        ref_files = {x["name"]: x for x in flux_ref["files"]}

        out = {"files": [], "workflows": {}, "components": {}}
        scales = {}
        for folder, name, keys in [("unet", UNET_FILE, fp.flux_keys(torch, True)),
                                   ("clip", T5_FILE, fp.t5_keys(torch))]:
            keys = sorted(keys)
            digest, raw, sc = write_scaled(os.path.join(tmp, folder, name), keys, torch)
            verify_file(os.path.join(tmp, folder, name), keys, raw)
            scales[name] = sc
            out["files"].append(fr.file_entry(folder, name, keys, digest, dtype=SCALED,
                                              checksum_raw=str(raw)))
            if not sub:
                vals = sorted(sc.values())
                print("file", folder, name, "keys", len(keys), "scaled", len(sc), "checksum", digest,
                      "(bytes re-read and rebuilt with numpy alone: equal)",
                      "raw", raw, "size", os.path.getsize(os.path.join(tmp, folder, name)),
                      "scales min/max", vals[0], vals[-1])
                for k in list(sc)[:2]:
                    print("   scale", k, repr(sc[k]), np.float32(sc[k]).view(np.uint32).item())
        # The unscaled base: same keys as the plain file.
        base = {e["name"]: e for e in out["files"]}
        assert [list(k) for k in base[UNET_FILE]["keys"]] == ref_files["tiny_flux_dev.safetensors"]["keys"]
        assert base[UNET_FILE]["checksum_f16"] == ref_files["tiny_flux_dev.safetensors"]["checksum_f16"]
        assert [list(k) for k in base[T5_FILE]["keys"]] == ref_files["tiny_t5xxl.safetensors"]["keys"]
        assert base[T5_FILE]["checksum_f16"] == ref_files["tiny_t5xxl.safetensors"]["checksum_f16"]
        out["files"] += fr.write_flux_files(tmp, COMPANIONS, torch, verbose=not sub)

        # The kohya LoRA, as flux_lora writes it (names from ComfyUI's key
        # maps of the loaded scaled model: the same as the plain one's).
        specs = fr.lora_specs(nodes, UNET_FILE, T5_FILE)
        kohya_ref, lora_file, digest = fr.write_flux_lora(tmp, specs, fl.KOHYA, torch)
        out["files"].append(kohya_ref)
        lora_data = (specs[fl.KOHYA],) + lora_file
        lora_targets = sorted(t.key for t in specs[fl.KOHYA])
        if not sub:
            print("file loras", fl.KOHYA, "keys", len(lora_file[0]), "checksum", digest,
                  "(= flux_lora/expected.json)")

        graphs = {WORKFLOW: graph(), LORA_WORKFLOW: graph_lora()}
        prompts = {}
        for name, g in graphs.items():
            if not sub:
                fr.write_graph(name, g)
            prompts[name] = fr.load_graph(name)
            assert prompts[name] == g

        node_ns = fr.node_classes(nodes, fp.v3_nodes())
        if not sub:
            out["components"]["loaded"] = check_models(nodes, torch, scales, detect_calls, log)
            out["components"]["scales"] = scales
            out["components"]["t5_hidden"] = t5_hidden(nodes, flux_ref)
            runs = sd1.spread_runs(__file__)
        lora_ref = fr.fixture("flux_lora")
        trace = LoraTrace(torch)
        try:
            lats = {}
            for name, prompt in prompts.items():
                trace.reset()
                trace.rne = False
                lat, img = fr.run(name, prompt, node_ns, torch, log)
                lats[name] = lat
                if name == WORKFLOW:
                    assert not trace.patched and not trace.rounded and not trace.computed, name
                else:
                    assert len(trace.patched) == len(lora_targets), len(trace.patched)
                if sub:
                    out["workflows"][name] = fr.f32_b64(lat)
                    continue
                clipped = fr.check_image(name, img)

                def flux_rel(wf, ref=flux_ref):
                    return fr.rel(lat, fr.latent_of(ref["workflows"][wf]))
                if name == WORKFLOW:
                    w = out["workflows"][name] = {
                        **fr.spreads(name, lat, runs),
                        "vs_tiny_flux_txt2img_rel": flux_rel("tiny_flux_txt2img"),
                        "vs_tiny_flux_fp8_rel": flux_rel("tiny_flux_fp8"),
                        **fr.outputs(lat, img),
                    }
                    assert w["vs_tiny_flux_txt2img_rel"] > 1e-4, w["vs_tiny_flux_txt2img_rel"]
                    print(name, *fr.summary(lat, img, w, clipped), "vs tiny_flux_txt2img",
                          w["vs_tiny_flux_txt2img_rel"], "vs tiny_flux_fp8", w["vs_tiny_flux_fp8_rel"])
                    continue
                print(name, "(LoRA): patching")
                patched = check_patching(trace, lora_targets, lora_data, scales[UNET_FILE], torch)
                # vs the same run with the patched weights' stochastic
                # rounding replaced by round to nearest, as fp8_lora measures it
                rne_rel = fr.rel(lat, trace.nearest_latent(prompt, node_ns, torch))
                assert len(trace.rounded) == len(lora_targets)
                w = out["workflows"][name] = {
                    "loras": LORA_LOADERS,
                    **fr.spreads(name, lat, runs),
                    "vs_round_to_nearest_rel": rne_rel,
                    "without_lora_rel": fr.rel(lat, lats[WORKFLOW]),
                    "vs_tiny_flux_lora_kohya_rel": flux_rel("tiny_flux_lora_kohya", lora_ref),
                    **fr.outputs(lat, img),
                    "patched": patched,
                }
                assert w["without_lora_rel"] > 1e-3, w["without_lora_rel"]
                print(name, *fr.summary(lat, img, w, clipped), "vs round-to-nearest", rne_rel,
                      "without LoRA", w["without_lora_rel"], "vs tiny_flux_lora_kohya (f32 weights)",
                      w["vs_tiny_flux_lora_kohya_rel"])
        finally:
            trace.close()
        fr.finish("scaled_fp8", out, sub)


if __name__ == "__main__":
    main()
