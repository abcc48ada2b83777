"""End-to-end references for LoRA workflows (kohya / sd-scripts format, and
LyCORIS LoHa / LoKr / full diffs under kohya names).

Four adapter files are built for the tiny checkpoints of sd1_pipeline.py
(tiny_sd1) and families_pipeline.py (tiny_sdxl), in the key naming real
kohya files use, every key name taken from ComfyUI's own LoRA key maps
(comfy.lora.model_lora_keys_unet / model_lora_keys_clip on the loaded tiny
models; for the UNet the diffusers-derived `lora_unet_*` names, i.e.
comfy.utils.unet_to_diffusers, as kohya writes them, not the ldm-derived
aliases ComfyUI also accepts). The workflows in graphs/tiny_sd1_lora*.json,
graphs/tiny_sdxl_lora.json and graphs/tiny_sd1_lycoris.json are then run
through ComfyUI's own node
classes (CheckpointLoaderSimple, LoraLoader, LoraLoaderModelOnly,
CLIPTextEncode, KSampler, VAEDecode) on the CPU in f32, and
tests/reference/lora/expected.json gets, for each adapter file, its sorted key
list with shapes, its scaled tensors, its alpha values and a checksum of its
f16 tensors, and for each workflow the latent SaveLatent gets and the image
SaveImage gets (f32), with the f32-vs-f64 and UNet-rounding spreads the SD1
script measures.

LoRA files (all tensors f16; rank 4):
  per target layer `N` with weight [out, in] (Linear) or [out, in, kh, kw]
  (Conv2d):
    N.lora_down.weight  [4, in] / [4, in, kh, kw]   (Tucker: [4, in, 1, 1])
    N.lora_mid.weight   [4, 4, kh, kw]               (Tucker only)
    N.lora_up.weight    [out, 4] / [out, 4, 1, 1]
    N.alpha             0-dim, the alpha value (absent for some layers)
  Values: sd1_pipeline's `values(key, shape)` of the key as spelled in the
  file; lora_up tensors multiplied by 0.5 in f32 before the f16 cast
  (recorded under "scaled"); `.alpha` tensors hold the alpha value.
  Checksum: sd1_pipeline.checksum over ALL tensors of the file in sorted
  key order (alpha tensors included, as one f16 element each), exactly as
  for the checkpoints.

  tiny_sd1_lora.safetensors: every transformer Linear of the UNet
      (attn1/attn2 to_q/to_k/to_v/to_out.0, ff.net.0.proj, ff.net.2), every
      proj_in/proj_out (1x1 convs in SD1: down [4, in, 1, 1]), a plain LoCon
      on a 3x3 resnet conv and a Tucker LoCon (lora_mid) on another, and
      every CLIP-L layer's q/k/v/out_proj, fc1, fc2 (`lora_te_`).
      Alphas 2.0, except: absent on every UNet ff.net.2 and on
      lora_te_text_model_encoder_layers_1_mlp_fc2 (ComfyUI then scales by
      1.0), 8.0 on the plain LoCon.
  tiny_sd1_lora_b.safetensors: attn2 to_k/to_v of every transformer block
      and CLIP-L layers 0 and 2 (`lora_te_`); alpha 4.0 (scale 1), except
      1.0 on the attn2 to_v layers.
  tiny_sdxl_lora.safetensors: every transformer Linear and (linear)
      proj_in/proj_out of tiny_sdxl's UNet, a plain LoCon on a 3x3 resnet
      conv, `lora_te1_` on all CLIP-L layers, `lora_te2_` on CLIP-G layers
      0, 1, 30 and 31 (HF names: ComfyUI converts the OpenCLIP layout of the
      checkpoint to HF names, fused in_proj split into q/k/v, before
      patching). Alphas 2.0, except: absent on the te2 layer-31 ones, 8.0
      on the LoCon.

  tiny_sd1_lycoris.safetensors (on tiny_sd1; rank r = 4; SD1_LYCORIS):
    LoHa (Linear [out, in]):  N.hada_w1_a [out, r], N.hada_w1_b [r, in],
      N.hada_w2_a [out, r], N.hada_w2_b [r, in]
      on down_blocks.0...attn2.to_k [32, 64] (alpha 2.0),
      up_blocks.0.attentions.1...ff.net.2 [64, 256] (no alpha),
      lora_te_ layer 0 self_attn_q_proj [64, 64] (alpha 2.0) and layer 1
      mlp_fc1 [128, 64] (no alpha).
    LoHa with CP (3x3 conv [out, in, 3, 3]): N.hada_t1 / N.hada_t2
      [r, r, 3, 3], N.hada_w1_a / N.hada_w2_a [r, out], N.hada_w1_b /
      N.hada_w2_b [r, in] on down_blocks.1.resnets.0.conv1 [64, 32, 3, 3]
      (alpha 2.0).
    LoKr, delta of shape [a1 b1, a2 b2(, kh, kw)] from w1 [a1, a2] (N.lokr_w1
      or N.lokr_w1_a [a1, r] @ N.lokr_w1_b [r, a2]) and w2 [b1, b2(, kh, kw)]
      (N.lokr_w2 or N.lokr_w2_a [b1, r] @ N.lokr_w2_b [r, b2]):
      full w1 [4, 8], decomposed w2 16x32 on down_blocks.1...ff.net.2
      [64, 256] (alpha 2.0); decomposed w1 8x4, full w2 [32, 8] on
      up_blocks.1.attentions.0...ff.net.0.proj [256, 32] (no alpha); full w1
      [4, 8] and full w2 [16, 12, 3, 3] on up_blocks.0.resnets.1.conv1
      [64, 96, 3, 3] (alpha 8.0, which ComfyUI ignores there); both
      decomposed (4x8, 16x16) on lora_te_ layer 2 mlp_fc2 [64, 128]
      (alpha 2.0).
    Full diffs: N.diff [64, 64] and N.diff_b [64] on mid_block...attn1.to_out.0
      (weight and bias), N.diff_b [32] alone on up_blocks.1.attentions.1
      ...ff.net.2 (its bias only).
    Factors (under "scaled", applied in f32 before the f16 cast): 0.5 on
    the second factor of each product (hada_w1_b, hada_w2_b, lokr_w2,
    lokr_w2_b) and on N.diff; 0.05 on N.diff_b (1-D, so 1 + 0.1 u by the
    weight formula); LoHa's first factors hada_w1_a / hada_w2_a by 4 and
    the CP cores hada_t1 / hada_t2 by 8 (a Hadamard product of two
    fan-in-scaled products is otherwise ~1% of the weight, ~1e-4 with CP).

Checks (asserted): ComfyUI's key maps give every name; every adapter key is
loaded (no "lora key not loaded" / "NOT LOADED" / shape-mismatch / error
in ComfyUI's log, except the CLIP keys for LoraLoaderModelOnly, which must
be exactly those); the patch sets on the model and CLIP are exactly the
targets (weight keys, and the `.bias` keys for `.diff_b`); the weights
ComfyUI merges match the formulas below, computed independently in f64
(LoraLoader with the workflows' strengths: the tiny_sd1_lora + _b stack,
tiny_sdxl_lora, tiny_sd1_lycoris at 0.9 / 0.8); the base checkpoints
match the checksums of tests/reference/sd1 and families; each workflow's
latent differs clearly from the same graph without its LoRA nodes.

Merging as ComfyUI does it (comfy/lora.py load_lora / calculate_weight,
weight_adapter/lora.py, loha.py, lokr.py,
model_patcher.patch_weight_to_device):
  W' = W + sum over patches in order of
       strength * scale * (up.flatten(1) @ down.flatten(1)).reshape(W.shape)
  scale = alpha / down.shape[0] (alpha from N.alpha) or 1.0 without alpha;
  Tucker: down' [r, in, kh, kw] with down'[a, i, h, w] =
       sum_b down[b, i] * mid[a, b, h, w]; then as above (scale uses the
       rank of down).
  LoHa: delta = scale * (w1_a @ w1_b) * (w2_a @ w2_b)  (elementwise product,
       reshaped to W), scale = alpha / w1_b.shape[0] or 1.0 without alpha.
  LoHa CP: m_i[p, q, h, w] = sum_{a,b} w_i_a[a, p] t_i[a, b, h, w] w_i_b[b, q]
       (ComfyUI's einsum 'i j k l, j r, i p -> p r k l' of t_i, w_i_b,
       w_i_a), delta = scale * m_1 * m_2, scale as for LoHa.
  LoKr: w1 = lokr_w1 or lokr_w1_a @ lokr_w1_b, w2 = lokr_w2 or
       lokr_w2_a @ lokr_w2_b; a 4-D w2 makes w1 [a1, a2, 1, 1];
       delta = scale * kron(w1, w2), i.e. delta[i1 b1 + i2, j1 b2 + j2, ...]
       = w1[i1, j1] w2[i2, j2, ...], reshaped to W; scale = alpha / dim with
       dim the rank (w_b.shape[0]) of the decomposed factor, w2's when both
       are decomposed; 1.0 without alpha or when both factors are full (an
       alpha is then loaded but unused).
  LoHa / LoKr add (strength * scale * delta) like LoRA (strength * scale a
       Python double, delta f32).
  Full diff: load_lora patches W with ("diff", N.diff) and the bias key
       (model key with .weight replaced by .bias) with ("diff", N.diff_b);
       W' = W + strength * diff.to(f32) (the f16 diff cast to the f32 copy
       of W, then multiplied by strength in f32); no alpha, no scale.
  Computed in f32 (LoRA tensors cast f16 -> f32, W cast to f32), the sum
  added to W in f32, the result cast back to the model weight dtype:
  f32 for the UNet, f16 for the text encoders (ComfyUI keeps CLIP weights
  f16 on the CPU and computes in f32).

    COMFY_DIR=/path/to/ComfyUI python tools/reference/lora_pipeline.py
(media-only imports are stubbed as in sd1_pipeline.py; the base fixtures
are not rewritten.)
"""
import base64
import collections
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import families_pipeline as fam  # noqa: E402

ROOT = sd1.ROOT
COMFY = sd1.COMFY
RANK = 4
UP_FACTOR = 0.5
WORKFLOWS = ["tiny_sd1_lora", "tiny_sd1_lora_model_only", "tiny_sdxl_lora", "tiny_sd1_lycoris"]
LORA_NODES = {"LoraLoader", "LoraLoaderModelOnly"}
NOT_LOADED = ("lora key not loaded", "NOT LOADED", "SHAPE MISMATCH", "ERROR lora",
              "Calculate Weight Failed", "WEIGHT NOT MERGED")

TRANSFORMER_LINEAR = re.compile(
    r"\.transformer_blocks\.\d+\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))$")
PROJ = re.compile(r"\.attentions\.\d+\.(proj_in|proj_out)$")

# 3x3 resnet convs: (diffusers module path, Tucker?)
SD1_LOCON = [("down_blocks.1.resnets.0.conv1", False), ("up_blocks.1.resnets.0.conv1", True)]
SDXL_LOCON = [("down_blocks.1.resnets.0.conv1", False)]
SDXL_TE2_LAYERS = [0, 1, 30, 31]

# One adapter target. kind: "lora" / "tucker" (kohya LoRA / LoCon),
# "loha" / "loha_cp" (LyCORIS LoHa, plain / CP), "lokr", "diff".
# opts: LoKr: w1 = (a1, a2), w2 = (b1, b2), w1_full / w2_full (else the
# factor is a product of two rank-RANK matrices); diff: weight / bias (which
# of `.diff` / `.diff_b` the file has).
Target = collections.namedtuple("Target", "name key shape kind alpha opts", defaults=(None,))

# tiny_sd1_lycoris.safetensors: (diffusers module path or kohya CLIP name,
# kind, alpha, opts); CLIP names start with lora_te_.
SD1_LYCORIS = [
    ("down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k", "loha", 2.0, None),
    ("up_blocks.0.attentions.1.transformer_blocks.0.ff.net.2", "loha", None, None),
    ("down_blocks.1.resnets.0.conv1", "loha_cp", 2.0, None),
    ("down_blocks.1.attentions.0.transformer_blocks.0.ff.net.2", "lokr", 2.0,
     dict(w1=(4, 8), w2=(16, 32), w1_full=True, w2_full=False)),
    ("up_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj", "lokr", None,
     dict(w1=(8, 4), w2=(32, 8), w1_full=False, w2_full=True)),
    ("up_blocks.0.resnets.1.conv1", "lokr", 8.0,
     dict(w1=(4, 8), w2=(16, 12), w1_full=True, w2_full=True)),
    ("mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0", "diff", None,
     dict(weight=True, bias=True)),
    ("up_blocks.1.attentions.1.transformer_blocks.0.ff.net.2", "diff", None,
     dict(weight=False, bias=True)),
    ("lora_te_text_model_encoder_layers_0_self_attn_q_proj", "loha", 2.0, None),
    ("lora_te_text_model_encoder_layers_1_mlp_fc1", "loha", None, None),
    ("lora_te_text_model_encoder_layers_2_mlp_fc2", "lokr", 2.0,
     dict(w1=(4, 8), w2=(16, 16), w1_full=False, w2_full=False)),
]
# Factors on the LyCORIS tensors (recorded under "scaled"): the second
# factor of each product by 0.5 as lora_up; the diffs by 0.5 (`.diff_b`,
# 1-D and so 1 + 0.1 u by the weight formula, by 0.05); LoHa's first
# factors (and CP cores) boosted, since a Hadamard product of two
# fan-in-scaled products is otherwise ~1e-3 of the weight (~1e-5 for CP).
LYCORIS_SCALE = {"hada_w1_b": 0.5, "hada_w2_b": 0.5, "lokr_w2": 0.5, "lokr_w2_b": 0.5,
                 "diff": 0.5, "diff_b": 0.05}
LOHA_BOOST = {"loha": {"hada_w1_a": 4.0, "hada_w2_a": 4.0},
              "loha_cp": {"hada_w1_a": 4.0, "hada_w2_a": 4.0, "hada_t1": 8.0, "hada_t2": 8.0}}


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())

    def problems(self):
        return [m for m in self.records if any(p in m for p in NOT_LOADED)]


def unet_names(model):
    """diffusers module path -> (kohya name, ComfyUI model key, weight shape),
    for every module of ComfyUI's unet_to_diffusers map that the model has,
    each checked against ComfyUI's LoRA key map."""
    import comfy.lora
    import comfy.utils
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    sd = model.model.state_dict()
    out = {}
    for dk, ldm in comfy.utils.unet_to_diffusers(model.model.model_config.unet_config).items():
        if not dk.endswith(".weight"):
            continue
        mk = "diffusion_model." + ldm
        if mk not in sd:
            continue
        path = dk[:-len(".weight")]
        name = "lora_unet_" + path.replace(".", "_")
        assert key_map.get(name) == mk, (name, key_map.get(name), mk)
        out[path] = (name, mk, list(sd[mk].shape))
    return out


def clip_names(clip, prefix):
    """kohya name -> (ComfyUI CLIP key, weight shape) for the encoder-layer
    names of ComfyUI's CLIP LoRA key map that start with `prefix` (the map
    also has `{prefix}text_projection`, not targeted here)."""
    import comfy.lora
    key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})
    sd = clip.cond_stage_model.state_dict()
    return {n: (k, list(sd[k].shape)) for n, k in key_map.items() if n.startswith(prefix + "text_model_encoder_layers_")}


def te_layer(name):
    return int(re.search(r"_layers_(\d+)_", name).group(1))


def lora_specs(sd1_model, sd1_clip, xl_model, xl_clip):
    """{file: (base, [Target])}"""
    u1, uxl = unet_names(sd1_model), unet_names(xl_model)
    te = clip_names(sd1_clip, "lora_te_")
    te1 = clip_names(xl_clip, "lora_te1_")
    te2 = clip_names(xl_clip, "lora_te2_")
    assert len(te) == 6 * sd1.CLIP["num_hidden_layers"], len(te)
    assert len(te1) == 6 * fam.CLIP_L["num_hidden_layers"], len(te1)
    assert len(te2) == 6 * fam.CLIP_G["num_hidden_layers"], len(te2)
    assert all(k.startswith("clip_l.") for k, _ in te.values())
    assert all(k.startswith("clip_l.") for k, _ in te1.values())
    assert all(k.startswith("clip_g.") for k, _ in te2.values())

    def transformer(u):
        return sorted(p for p in u if TRANSFORMER_LINEAR.search(p) or PROJ.search(p))

    def conv(u, path, tucker, alpha):
        name, mk, shape = u[path]
        assert len(shape) == 4 and shape[2:] == [3, 3] and shape[0] != shape[1], (path, shape)
        return Target(name, mk, shape, "tucker" if tucker else "lora", alpha)

    # A: every transformer Linear + proj_in/out, two LoCons, all CLIP-L.
    a = []
    for p in transformer(u1):
        name, mk, shape = u1[p]
        a.append(Target(name, mk, shape, "lora", None if p.endswith("ff.net.2") else 2.0))
    (c0, t0), (c1, t1) = SD1_LOCON
    a.append(conv(u1, c0, t0, 8.0))
    a.append(conv(u1, c1, t1, 2.0))
    for n, (k, shape) in sorted(te.items()):
        a.append(Target(n, k, shape, "lora",
                        None if n == "lora_te_text_model_encoder_layers_1_mlp_fc2" else 2.0))
    # B: attn2 to_k/to_v, CLIP-L layers 0 and 2.
    b = []
    for p in transformer(u1):
        if p.endswith("attn2.to_k") or p.endswith("attn2.to_v"):
            name, mk, shape = u1[p]
            b.append(Target(name, mk, shape, "lora", 1.0 if p.endswith("to_v") else 4.0))
    for n, (k, shape) in sorted(te.items()):
        if te_layer(n) in (0, 2):
            b.append(Target(n, k, shape, "lora", 4.0))
    # XL.
    xl = []
    for p in transformer(uxl):
        name, mk, shape = uxl[p]
        assert len(shape) == 2, (p, shape)  # linear proj_in/out in SDXL
        xl.append(Target(name, mk, shape, "lora", 2.0))
    for path, tucker in SDXL_LOCON:
        xl.append(conv(uxl, path, tucker, 8.0))
    for n, (k, shape) in sorted(te1.items()):
        xl.append(Target(n, k, shape, "lora", 2.0))
    for n, (k, shape) in sorted(te2.items()):
        if te_layer(n) in SDXL_TE2_LAYERS:
            xl.append(Target(n, k, shape, "lora", None if te_layer(n) == 31 else 2.0))
    # LyCORIS on SD1: LoHa (plain, CP), LoKr (each factor full or
    # decomposed, Linear and 3x3 conv), full diffs of a weight and biases.
    ly = []
    for where, kind, alpha, opts in SD1_LYCORIS:
        if where.startswith("lora_te_"):
            (k, shape), name = te[where], where
        else:
            name, k, shape = u1[where]
        if kind == "loha_cp":
            assert len(shape) == 4 and shape[2:] == [3, 3] and shape[0] != shape[1], (where, shape)
        elif kind == "lokr":
            (a1, a2), (b1, b2) = opts["w1"], opts["w2"]
            assert [a1 * b1, a2 * b2] == shape[:2], (where, shape, opts)
            assert len(shape) == 2 or (opts["w1_full"] and opts["w2_full"]), (where, opts)
        else:
            assert len(shape) == 2, (where, shape)
        ly.append(Target(name, k, shape, kind, alpha, opts))
    assert len({t.key for t in ly}) == len(ly)
    return {"tiny_sd1_lora.safetensors": ("sd1", a),
            "tiny_sd1_lora_b.safetensors": ("sd1", b),
            "tiny_sdxl_lora.safetensors": ("sdxl", xl),
            "tiny_sd1_lycoris.safetensors": ("sd1", ly)}


def adapter_keys(t):
    """[(key, shape)] and {key: factor} of one target."""
    name, shape, kind, opts = t.name, t.shape, t.kind, t.opts
    out, inn = shape[0], shape[1]
    if kind in ("lora", "tucker"):
        up = name + ".lora_up.weight"
        if len(shape) == 2:
            keys = [(name + ".lora_down.weight", [RANK, inn]), (up, [out, RANK])]
        elif kind == "tucker":
            keys = [(name + ".lora_down.weight", [RANK, inn, 1, 1]),
                    (name + ".lora_mid.weight", [RANK, RANK] + shape[2:]),
                    (up, [out, RANK, 1, 1])]
        else:
            keys = [(name + ".lora_down.weight", [RANK, inn] + shape[2:]),
                    (up, [out, RANK, 1, 1])]
        return keys, {up: UP_FACTOR}
    if kind == "loha":
        keys = [(name + ".hada_w1_a", [out, RANK]), (name + ".hada_w1_b", [RANK, int(np.prod(shape[1:]))]),
                (name + ".hada_w2_a", [out, RANK]), (name + ".hada_w2_b", [RANK, int(np.prod(shape[1:]))])]
    elif kind == "loha_cp":
        keys = [(name + ".hada_t1", [RANK, RANK] + shape[2:]), (name + ".hada_w1_a", [RANK, out]),
                (name + ".hada_w1_b", [RANK, inn]),
                (name + ".hada_t2", [RANK, RANK] + shape[2:]), (name + ".hada_w2_a", [RANK, out]),
                (name + ".hada_w2_b", [RANK, inn])]
    elif kind == "lokr":
        (a1, a2), (b1, b2) = opts["w1"], opts["w2"]
        keys = [(name + ".lokr_w1", [a1, a2])] if opts["w1_full"] else \
            [(name + ".lokr_w1_a", [a1, RANK]), (name + ".lokr_w1_b", [RANK, a2])]
        keys += [(name + ".lokr_w2", [b1, b2] + shape[2:])] if opts["w2_full"] else \
            [(name + ".lokr_w2_a", [b1, RANK]), (name + ".lokr_w2_b", [RANK, b2])]
    elif kind == "diff":
        keys = ([(name + ".diff", list(shape))] if opts["weight"] else []) + \
            ([(name + ".diff_b", [out])] if opts["bias"] else [])
    else:
        raise ValueError(kind)
    scaled = {}
    for k, _ in keys:
        suffix = k[len(name) + 1:]
        f = LYCORIS_SCALE.get(suffix, 1.0) * LOHA_BOOST.get(kind, {}).get(suffix, 1.0)
        if f != 1.0:
            scaled[k] = f
    return keys, scaled


def lora_keys(targets):
    """(sorted [(key, shape)], {key: factor}, {alpha key: alpha})"""
    keys, scaled, alphas = [], {}, {}
    for t in targets:
        k, f = adapter_keys(t)
        keys += k
        scaled.update(f)
        if t.alpha is not None:
            keys.append((t.name + ".alpha", []))
            alphas[t.name + ".alpha"] = t.alpha
    keys.sort()
    assert len(set(k for k, _ in keys)) == len(keys)
    return keys, scaled, alphas


def lora_value(key, shape, scaled, alphas):
    """The f16 array written for one key."""
    if key in alphas:
        return np.array(alphas[key], dtype=np.float16)
    v = sd1.values(key, shape)
    if key in scaled:
        v = v * np.float32(scaled[key])
    return v.astype(np.float16)


def write_lora(path, keys, scaled, alphas, torch):
    from safetensors.torch import save_file
    tensors, total = {}, 0
    for i, (k, shape) in enumerate(keys):
        v = lora_value(k, shape, scaled, alphas)
        assert list(v.shape) == shape
        total = (total + sd1.checksum(v.view(np.uint16), i)) % (1 << 64)
        tensors[k] = torch.from_numpy(np.ascontiguousarray(v))
    save_file(tensors, path)
    return total


def patched_keys(t):
    """The model keys a target patches: (model key, part)."""
    if t.kind != "diff":
        return [(t.key, "weight")]
    bias = t.key[:-len(".weight")] + ".bias"
    return ([(t.key, "weight")] if t.opts["weight"] else []) + \
        ([(bias, "bias")] if t.opts["bias"] else [])


def expected_delta(t, part, keys, scaled, alphas):
    """The formulas of this file's docstring, in f64, from the f16 values:
    the delta of one patched key at strength 1."""
    name, shape, alpha = t.name, t.shape, t.alpha
    shapes = dict(keys)

    def get(suffix):
        k = name + "." + suffix
        return lora_value(k, shapes[k], scaled, alphas).astype(np.float64)
    if t.kind in ("lora", "tucker"):
        up, down = get("lora_up.weight"), get("lora_down.weight")
        if t.kind == "tucker":
            mid = get("lora_mid.weight")
            down = np.einsum("bi,abhw->aihw", down.reshape(down.shape[:2]), mid)
        scale = 1.0 if alpha is None else alpha / RANK
        return scale * (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)).reshape(shape)
    if t.kind == "loha":
        # Hadamard product of two rank-r products; scale alpha / r.
        scale = 1.0 if alpha is None else alpha / RANK
        m1 = get("hada_w1_a") @ get("hada_w1_b")
        m2 = get("hada_w2_a") @ get("hada_w2_b")
        return scale * (m1 * m2).reshape(shape)
    if t.kind == "loha_cp":
        # m[:, :, h, w] = w_a^T @ t[:, :, h, w] @ w_b  (w_a [r, out], w_b [r, in]).
        scale = 1.0 if alpha is None else alpha / RANK
        m = []
        for i in (1, 2):
            core, wa, wb = get("hada_t%d" % i), get("hada_w%d_a" % i), get("hada_w%d_b" % i)
            mi = np.zeros(shape)
            for h in range(shape[2]):
                for w in range(shape[3]):
                    mi[:, :, h, w] = wa.T @ core[:, :, h, w] @ wb
            m.append(mi)
        return scale * m[0] * m[1]
    if t.kind == "lokr":
        # Kronecker product: delta[i1*b1 + i2, j1*b2 + j2, ...] =
        # w1[i1, j1] * w2[i2, j2, ...]; scale alpha / (rank of the
        # decomposed factor, w2's when both are), 1 when both are full.
        o = t.opts
        w1 = get("lokr_w1") if o["w1_full"] else get("lokr_w1_a") @ get("lokr_w1_b")
        w2 = get("lokr_w2") if o["w2_full"] else get("lokr_w2_a") @ get("lokr_w2_b")
        dim = None if o["w1_full"] else RANK
        dim = dim if o["w2_full"] else RANK
        scale = 1.0 if alpha is None or dim is None else alpha / dim
        (a1, a2), (b1, b2) = w1.shape, w2.shape[:2]
        k = np.einsum("ij,kl...->ikjl...", w1, w2).reshape([a1 * b1, a2 * b2] + list(w2.shape[2:]))
        return scale * k.reshape(shape)
    if t.kind == "diff":
        return get("diff") if part == "weight" else get("diff_b")
    raise ValueError(t.kind)


def check_merge(nodes, torch, specs, lora_data):
    """ComfyUI's LoraLoader on each base: exact patch sets, the merged
    weights against the formula, nothing left unloaded."""
    import comfy.lora
    stacks = [("sd1", "tiny_sd1.safetensors",
               [("tiny_sd1_lora.safetensors", 0.8, 0.6),
                ("tiny_sd1_lora_b.safetensors", -0.5, 1.2)]),
              ("sdxl", "tiny_sdxl.safetensors", [("tiny_sdxl_lora.safetensors", 1.0, 0.7)]),
              ("sd1 lycoris", "tiny_sd1.safetensors", [("tiny_sd1_lycoris.safetensors", 0.9, 0.8)])]
    for base, ckpt, stack in stacks:
        model, clip = nodes.CheckpointLoaderSimple().load_checkpoint(ckpt)[:2]
        m0, c0 = model, clip
        want = {}
        for lora, sm, sc in stack:
            model, clip = nodes.LoraLoader().load_lora(model, clip, lora, sm, sc)
            for t in specs[lora][1]:
                for k, part in patched_keys(t):
                    want.setdefault(k, []).append((lora, sc if k.startswith("clip_") else sm, t, part))
        unet_want = {k for k in want if k.startswith("diffusion_model.")}
        clip_want = set(want) - unet_want
        assert set(model.patches) == unet_want, set(model.patches) ^ unet_want
        assert set(clip.patcher.patches) == clip_want, set(clip.patcher.patches) ^ clip_want
        worst, changes = {}, []
        for k, items in want.items():
            patcher = clip.patcher if k in clip_want else model
            orig = (c0.patcher if k in clip_want else m0).model.state_dict()[k]
            assert len(patcher.patches[k]) == len(items)
            for (strength, *_), (lora, s, _, _) in zip(patcher.patches[k], items):
                assert strength == s, (k, strength, s)
            merged = comfy.lora.calculate_weight(patcher.patches[k],
                                                 orig.to(torch.float32, copy=True), k)
            merged = merged.to(orig.dtype)  # as patch_weight_to_device rounds
            ref = orig.double().numpy()
            for lora, s, t, part in items:
                keys, scaled, alphas = lora_data[lora]
                ref = ref + s * expected_delta(t, part, keys, scaled, alphas)
            got = merged.double().numpy()
            # f32 merging (UNet), f16 rounding of the merged CLIP weights.
            ulp = 2.0 ** -10 if orig.dtype == torch.float16 else 2.0 ** -20
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err < ulp, (k, err, orig.dtype)
            kind = "clip " + str(orig.dtype) if k in clip_want else "unet " + str(orig.dtype)
            worst[kind] = max(worst.get(kind, 0.0), float(err))
            diff = np.abs(got - orig.double().numpy()).max() / np.abs(orig.double().numpy()).max()
            assert diff > 1e-3, (k, diff)
            changes.append((k, items[0][2].kind, diff))
        print("merge", base, "unet keys", len(unet_want), "clip keys", len(clip_want),
              "stacked", sum(len(v) > 1 for v in want.values()),
              "max rel err vs f64 formula", worst)
        if "lycoris" in base:
            for k, kind, diff in changes:
                print("   ", kind, k, "max rel change", diff)
        # The CLIP LoRA changes the conditioning.
        text = "a lighthouse at dusk"
        e0 = c0.encode_from_tokens(c0.tokenize(text), return_pooled=True)
        e1 = clip.encode_from_tokens(clip.tokenize(text), return_pooled=True)
        rel = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(e1, e0)]
        assert min(rel) > 1e-2, rel
        print("   cond rel change (cond, pooled)", rel)


def without_loras(prompt):
    """The graph with every LoRA node bypassed (outputs rewired to inputs)."""
    lora = {nid for nid, n in prompt.items() if n["class_type"] in LORA_NODES}

    def source(ref):
        while ref[0] in lora:
            ref = prompt[ref[0]]["inputs"]["model" if ref[1] == 0 else "clip"]
        return ref
    return {nid: dict(n, inputs={k: source(v) if isinstance(v, list) else v
                                 for k, v in n["inputs"].items()})
            for nid, n in prompt.items() if nid not in lora}


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import folder_paths
    import nodes

    log = LogCapture()
    logging.getLogger().addHandler(log)
    tmp = tempfile.mkdtemp()
    try:
        fam.patch_comfy(tmp, torch)
        # The base checkpoints, as the SD1 / families scripts build them.
        ckpt_dir = os.path.join(tmp, "checkpoints")
        xl_name = fam.write_base_checkpoints(ckpt_dir, torch)
        folder_paths.add_model_folder_path("checkpoints", ckpt_dir, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))

        # Key names from ComfyUI's maps on the loaded tiny models.
        sd1_model, sd1_clip = nodes.CheckpointLoaderSimple().load_checkpoint(sd1.CKPT)[:2]
        xl_model, xl_clip = nodes.CheckpointLoaderSimple().load_checkpoint(xl_name)[:2]
        assert type(sd1_model.model.model_config).__name__ == "SD15"
        assert type(xl_model.model.model_config).__name__ == "SDXL"
        specs = lora_specs(sd1_model, sd1_clip, xl_model, xl_clip)
        del sd1_model, sd1_clip, xl_model, xl_clip

        lora_dir = os.path.join(tmp, "loras")
        os.makedirs(lora_dir)
        folder_paths.add_model_folder_path("loras", lora_dir, is_default=True)
        out = {"base": {"sd1": "sd1/expected.json", "sdxl": "families/expected.json"},
               "loras": [], "workflows": {}}
        lora_data = {}
        for name, (base, targets) in specs.items():
            keys, scaled, alphas = lora_keys(targets)
            lora_data[name] = (keys, scaled, alphas)
            digest = write_lora(os.path.join(lora_dir, name), keys, scaled, alphas, torch)
            out["loras"].append({"name": name, "base": base, "keys": keys, "scaled": scaled,
                                 "alphas": alphas, "checksum_f16": str(digest)})
            if not sub:
                print("lora", name, "on", base, "targets", len(targets), "keys", len(keys),
                      "alphas", sorted(set(alphas.values())),
                      "no alpha", sum(t[4] is None for t in targets), "checksum", digest)
                show = [t for t in targets if t[0].endswith("attn1_to_q")][:1] + \
                    [t for t in targets if t[0].endswith("proj_in")][:1] + \
                    [t for t in targets if len(t[2]) == 4 and t[2][2:] == [3, 3]] + \
                    [t for t in targets if t[0].startswith("lora_te")][:1] + targets[-1:]
                if name == "tiny_sd1_lycoris.safetensors":
                    show = targets
                for t in show:
                    print("   ", t.name, "->", t.key, t.shape, t.kind, t.alpha, t.opts or "")
                    if t.kind not in ("lora", "tucker"):
                        for k, shape in adapter_keys(t)[0]:
                            print("       ", k, shape, scaled.get(k, ""))

        if not sub:
            del log.records[:]
            check_merge(nodes, torch, specs, lora_data)
            assert not log.problems(), log.problems()

            f64_latents, perturbed_latents = sd1.spread_runs(__file__)

        node_ns = types.SimpleNamespace(NODE_CLASS_MAPPINGS=nodes.NODE_CLASS_MAPPINGS)
        for name in WORKFLOWS:
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            del log.records[:]
            saved, latents = sd1.run_workflow(prompt, node_ns, torch)
            problems = log.problems()
            if name.endswith("model_only"):
                # LoraLoaderModelOnly maps the UNet only: ComfyUI reports
                # exactly the CLIP keys of the file as not loaded.
                (lora,) = [n["inputs"]["lora_name"] for n in prompt.values()
                           if n["class_type"] == "LoraLoaderModelOnly"]
                te = {k for k, _ in lora_data[lora][0] if k.startswith("lora_te")}
                assert {"lora key not loaded: " + k for k in te} == set(problems), problems
            else:
                assert not problems, problems
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            assert np.isfinite(lat).all() and np.isfinite(img).all(), name
            if sub:
                out["workflows"][name] = sd1.b64(lat.astype("<f4"))
                continue
            _, plain = sd1.run_workflow(without_loras(prompt), node_ns, torch)
            plain = plain[0].float().numpy()
            lora_rel = float(np.abs(lat - plain).max() / np.abs(plain).max())
            assert lora_rel > 0.05, (name, lora_rel)

            def spread_to(latents):
                other = np.frombuffer(base64.b64decode(latents[name]), "<f4")
                return float(np.abs(lat.reshape(-1) - other).max() / np.abs(other).max())
            out["workflows"][name] = {
                "f32_vs_f64_unet_rel": spread_to(f64_latents),
                "unet_rounding_rel": spread_to(perturbed_latents),
                "lora_vs_no_lora_rel": lora_rel,
                "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
                "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4")),
            }
            w = out["workflows"][name]
            print(name, "latent", lat.shape, "abs mean", float(np.abs(lat).mean()),
                  "std", float(lat.std()), "image", img.shape, "mean", float(img.mean()),
                  "f32 vs f64 UNet", w["f32_vs_f64_unet_rel"],
                  "UNet rounding", w["unet_rounding_rel"], "vs no LoRA", lora_rel)
        if sub:
            print(json.dumps(out["workflows"]))
            return
        sd1.write_expected("lora", out)
    finally:
        logging.getLogger().removeHandler(log)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
