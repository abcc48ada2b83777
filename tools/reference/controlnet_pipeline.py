"""End-to-end references for ControlNet and T2I-Adapter workflows, and the
Canny preprocessor.

Four control models are built in the real key layouts, every key name and
shape taken from ComfyUI's own classes (comfy.cldm.cldm.ControlNet for the
ControlNets, comfy.t2i_adapter.adapter.Adapter for the T2I-Adapter; the
diffusers names of the SDXL ControlNet by inverting ComfyUI's own
comfy.utils.unet_to_diffusers map plus the ControlNet names its loader,
comfy.controlnet.load_controlnet_state_dict, maps), every value from
sd1_pipeline's `values(key, shape)` formula of the key as spelled in the
file, stored f16. ComfyUI loads them with comfy.controlnet.load_controlnet
(through ControlNetLoader), and the workflows in
graphs/tiny_sd1_controlnet*.json, graphs/tiny_sdxl_controlnet.json and
graphs/tiny_canny.json are run through ComfyUI's own node classes
(CheckpointLoaderSimple, LoraLoader, CLIPTextEncode, LoadImage,
ControlNetLoader, ControlNetApply, ControlNetApplyAdvanced, Canny,
KSampler, VAEDecode) on the CPU in f32.
tests/reference/controlnet/expected.json gets:
  "base": the fixtures the base checkpoints and the LoRA come from.
  "files": per file written here: folder (ComfyUI model folder:
      controlnet or checkpoints), name, kind (controlnet_ldm /
      controlnet_diffusers / t2i_adapter / checkpoint), base (the
      checkpoint it goes with; null for the checkpoint), sorted
      [key, shape] list, "scaled" ({}: no factors), checksum_f16
      (sd1_pipeline.checksum over the file's tensors in sorted key order,
      as for the checkpoints). Rust writes them with tests/support's
      write_tensors from these lists.
  "images": the control PNGs this script writes to graphs/input (name ->
      width, height); LoadImage gives u8 / 255 as f32 [1, H, W, 3].
  "models": per control file one direct forward check, {base, inputs,
      control}: ComfyUI's get_control (on a copy of the loaded object with
      set_cond_hint(image [B, C, H, W], strength 1, range (0, 1)) and
      pre_run on the base checkpoint's model, as the sampler calls it,
      batch 1, batched_number 1). inputs: x_shape / x_f32 ([1, 4, 8, 8],
      2u), sigma (2.0), context_shape / context_f32 ([1, 77, context
      width], 8 * values), y_shape / y_f32 (SDXL only: [1, 1664],
      8 * values), hint_image (a graphs/input name, as LoadImage loads
      it), hint_shape (the hint the model got after ComfyUI's resize,
      crop and, for the T2I, channel mean); for ControlNets also timestep
      (model_sampling.timestep(sigma): the nearest of the 1000 discrete
      steps) and x_in_f32 (x / sqrt(sigma^2 + 1), what the control model
      got). control: the 'input', 'middle' and 'output' lists get_control
      returns, each entry null (None) or {shape, f32}.
  "workflows": per sampling workflow the latent SaveLatent gets and the
      image SaveImage gets (f32), the f32-vs-f64 and UNet-rounding spreads
      sd1_pipeline measures, how far the latent moves without the control
      nodes ("control_vs_no_control_rel"), and "control_calls": every
      get_control call of the sampling ([file, sigma, strength, applied,
      batch], in the order the calls start: the conditioning holds the
      last-applied net, whose get_control calls its previous net's first
      and adds its own residuals to that one's); for a ranged workflow
      "range_vs_full_range_rel" (the same graph with 0.0-1.0).
      tiny_canny: {"kornia_version", "images": [per SaveImage in graph
      order: node, filename_prefix, low_threshold, high_threshold,
      edge_pixels, image_shape, image_f32 (0.0 / 1.0, 3 equal channels)]}.

Files (all tensors f16, values `values(key, shape)`, no scaled keys):
  controlnet/tiny_sd1_controlnet.safetensors: the ldm layout of the
      lllyasviel control_v11p_sd15_* files, every key prefixed
      `control_model.`: time_embed.{0,2}, input_blocks.* and
      middle_block.* exactly as tiny_sd1's UNet (model_channels 32,
      channel_mult [1, 2], one res block per level, one SpatialTransformer
      (8 heads, conv proj_in/out) per res block, context 64), zero_convs.N.0
      (1x1 convs, N = 0..3, one per input block), middle_block_out.0 (1x1),
      input_hint_block.{0,2,...,14} (3x3 convs 3->16->16->32(s2)->32->
      96(s2)->96->256(s2)->32: ComfyUI hard-codes those widths, only the
      last is model_channels).
  controlnet/tiny_sd1_controlnet_noprefix.safetensors: the same layout
      without the `control_model.` prefix (as comfyanonymous' *_fp16
      conversions store it); other names, so other values.
  controlnet/tiny_sdxl_controlnet.safetensors: the diffusers layout of an
      SDXL ControlNet (diffusers/controlnet-*-sdxl-1.0) for tiny_sdxl
      (model_channels 64, channel_mult [1, 2], transformer depth [0, 2],
      linear proj_in/out, 64-wide heads, context 192, ADM 1664):
      conv_in, time_embedding.linear_{1,2}, add_embedding.linear_{1,2},
      down_blocks.*, mid_block.*, controlnet_cond_embedding.conv_in /
      blocks.0..5 / conv_out (= input_hint_block.0 / 2..12 / 14),
      controlnet_down_blocks.0..3 (= zero_convs.N.0),
      controlnet_mid_block (= middle_block_out.0).
  controlnet/tiny_sd1_t2i.safetensors: the full T2I-Adapter layout
      (TencentARC t2iadapter_*_sd15v2 / sd14v1: Adapter(cin, channels,
      nums_rb=2, ksize=1, sk=True, use_conv=False)): conv_in [32, 64, 3,
      3] (cin 64 = 1 channel x PixelUnshuffle(8)), body.0..7 with
      block1 (3x3) / block2 (1x1) each, in_conv (1x1) where the width
      changes (body.2: 32->64, body.4: 64->128); channels [32, 64, 128,
      128] (ComfyUI takes [c, 2c, 4c, 4c] from conv_in's width), levels
      1-3 start with a 2x2 average pool (no weights): features at 1, 1/2,
      1/4, 1/8 of the latent size.
  checkpoints/tiny_sd1_deep.safetensors: the base of the T2I workflow: a
      tiny SD1 checkpoint whose UNet has SD1's full block structure
      (model_channels 32, channel_mult [1, 2, 4, 4], two res blocks per
      level, transformers on levels 0-2, 8 heads, context 64), with
      tiny_sd1's CLIP and VAE keys (so the same values). A T2I-Adapter's
      residuals are placed by input-block position for that structure
      (12 input blocks; the 4 features land after blocks 2, 5, 8, 11):
      on tiny_sd1 (4 input blocks) its one consumed feature would hit the
      downsample block at half its size and ComfyUI would skip it with
      "warning control could not be applied".
  The LoRA of tiny_sd1_controlnet_lora is lora/expected.json's
  tiny_sd1_lora.safetensors (written with lora_pipeline.write_lora).
Control images (graphs/input, written only where missing or different):
  control_a.png (64x64 RGB: gradient, a disc, a box and a thick diagonal
  line) and control_wide.png (80x48 RGB: rings and a bar; ControlNet
  crops it to the centre 48x48 before the nearest-exact upscale).

Workflows (64x64, euler, normal, 4 steps, cfg 6 (SDXL 5)):
  tiny_sd1_controlnet: ControlNetApply (strength 0.9) on the positive only.
  tiny_sd1_controlnet_advanced: ControlNetApplyAdvanced, strength 0.8,
      start_percent 0.2, end_percent 0.7 (steps 1 and 4 skip it).
  tiny_sd1_controlnet_chain: ControlNetApplyAdvanced with
      tiny_sd1_controlnet on control_a (0.7, 0.0-1.0), then again with
      tiny_sd1_controlnet_noprefix on control_wide (0.5, 0.3-1.0: step 1
      skips it).
  tiny_sd1_controlnet_lora: LoraLoader (tiny_sd1_lora, 0.8 / 0.6) +
      ControlNetApplyAdvanced (1.0, full range): the LoRA patches the
      UNet only, not the ControlNet.
  tiny_sdxl_controlnet: the SDXL diffusers ControlNet through
      ControlNetApplyAdvanced (0.85, 0.0-1.0), vae connected (ignored by
      ComfyUI for SD1/SDXL ControlNets).
  tiny_sd1_controlnet_t2i: tiny_sd1_deep + the T2I-Adapter through
      ControlNetApplyAdvanced (0.75, 0.0-0.5: steps 3 and 4 skip it) on
      the RGB control_a (the 1-channel adapter takes the channel mean).
  tiny_canny: LoadImage control_a -> Canny (0.2, 0.5) -> SaveImage and
      Canny (0.4, 0.8) -> SaveImage.

ComfyUI only recognises full-size models. Relaxed here, nothing else:
  * families_pipeline.patch_comfy as it is (tiny CLIP/VAE configs, the
    SD15/SDXL matches).
  * comfy.model_detection.unet_config_from_diffusers_unet: its table has
    no tiny SDXL; when no entry matches, the tiny SDXL entry (the table's
    SDXL entry with tiny_sdxl's values) is tried on the same five keys
    ComfyUI matches on (transformer_depth per down res block, context_dim,
    model_channels, in_channels, adm_in_channels).

Checks (asserted): the base checkpoints and the LoRA match their fixtures'
checksums; load_controlnet gives a ControlNet for the three ControlNet
files and a T2IAdapter for the adapter; every loaded tensor is the file's
f16 value of its name (so every key was mapped); no missing / unexpected /
leftover key messages; each ControlNet's time_embed / label_emb /
input_blocks / middle_block tensors have the shapes of its base UNet's;
the detected tiny_sd1_deep is SD15; no "control could not be applied"
warning; each workflow's latent differs clearly from the same graph
without its control nodes, and each ranged one from its full-range form
by over 20 times the f32 spreads.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/controlnet_pipeline.py
(media-only imports are stubbed as in sd1_pipeline.py, but the Canny node
needs the real kornia: its output is kornia's canny, which changes between
kornia releases (ComfyUI asks for kornia>=0.7.1; 0.9.0 kept ties along
horizontal/vertical gradients, as OpenCV does); the version used is
recorded. The base fixtures are not rewritten.)
"""
import base64
import json
import logging
import os
import shutil
import sys
import tempfile
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import families_pipeline as fam  # noqa: E402
import lora_pipeline as lp  # noqa: E402

ROOT = sd1.ROOT
COMFY = sd1.COMFY
WORKFLOWS = ["tiny_sd1_controlnet", "tiny_sd1_controlnet_advanced", "tiny_sd1_controlnet_chain",
             "tiny_sd1_controlnet_lora", "tiny_sdxl_controlnet", "tiny_sd1_controlnet_t2i"]
CANNY = "tiny_canny"
CONTROL_NODES = {"ControlNetApply", "ControlNetApplyAdvanced"}
PROBLEMS = ("missing controlnet keys", "unexpected controlnet keys", "leftover keys",
            "t2i missing", "t2i unexpected", "could not detect", "control could not be applied",
            "no match", "lora key not loaded", "ERROR")

SD1_CN = "tiny_sd1_controlnet.safetensors"
SD1_CN_NOPREFIX = "tiny_sd1_controlnet_noprefix.safetensors"
SDXL_CN = "tiny_sdxl_controlnet.safetensors"
T2I = "tiny_sd1_t2i.safetensors"
DEEP = "tiny_sd1_deep.safetensors"
LORA = "tiny_sd1_lora.safetensors"

UNET_DEEP = dict(sd1.UNET, channel_mult=[1, 2, 4, 4], num_res_blocks=[2, 2, 2, 2],
                 transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                 transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                 num_head_channels=-1, adm_in_channels=None)
# Adapter(...) as ComfyUI's load_t2i_adapter rebuilds it from the keys.
T2I_CONFIG = dict(cin=64, channels=[32, 64, 128, 128], nums_rb=2, ksize=1, sk=True,
                  use_conv=False, xl=False)
# The table entry of comfy.model_detection.unet_config_from_diffusers_unet
# for SDXL, with tiny_sdxl's values.
TINY_XL_DIFFUSERS = {
    'use_checkpoint': False, 'image_size': 32, 'out_channels': 4, 'use_spatial_transformer': True,
    'legacy': False, 'num_classes': 'sequential', 'adm_in_channels': fam.UNET_XL["adm_in_channels"],
    'in_channels': 4, 'model_channels': fam.UNET_XL["model_channels"],
    'num_res_blocks': fam.UNET_XL["num_res_blocks"],
    'transformer_depth': fam.UNET_XL["transformer_depth"],
    'channel_mult': fam.UNET_XL["channel_mult"],
    'transformer_depth_middle': fam.UNET_XL["transformer_depth_middle"],
    'use_linear_in_transformer': True, 'context_dim': fam.UNET_XL["context_dim"],
    'num_head_channels': fam.UNET_XL["num_head_channels"],
    'transformer_depth_output': fam.UNET_XL["transformer_depth_output"],
    'use_temporal_attention': False, 'use_temporal_resblock': False}

# The direct forward checks: (control file, base checkpoint, hint image).
CHECK_SIGMA = 2.0
CHECK_TOKENS = 77
MODELS = [(SD1_CN, sd1.CKPT, "control_a.png"), (SD1_CN_NOPREFIX, sd1.CKPT, "control_wide.png"),
          (SDXL_CN, "tiny_sdxl.safetensors", "control_a.png"), (T2I, DEEP, "control_a.png")]


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())

    def problems(self):
        return [m for m in self.records if any(p in m for p in PROBLEMS)]


# --- control images -------------------------------------------------------

def control_images():
    """name -> uint8 [H, W, 3]."""
    yy, xx = np.mgrid[0:64, 0:64]
    a = np.stack([20 + xx * 2, 30 + yy, np.full_like(xx, 60)], -1)
    a[(xx - 22) ** 2 + (yy - 24) ** 2 <= 13 ** 2] = (235, 220, 180)
    a[(xx >= 36) & (xx < 56) & (yy >= 30) & (yy < 54)] = (40, 160, 220)
    # A thick line from (6, 58) to (58, 40).
    dist = np.abs((xx - 6) * 18 + (yy - 58) * 52) / np.hypot(18, 52)
    a[(dist <= 1.5) & (xx >= 6) & (xx <= 58)] = (250, 60, 60)

    yy, xx = np.mgrid[0:48, 0:80]
    w = np.stack([10 + xx, 40 + yy * 2, 200 - xx * 2], -1)
    r2 = (xx - 40) ** 2 + (yy - 24) ** 2
    rings = (r2 <= 22 ** 2) & ((np.floor(np.sqrt(r2)) // 5) % 2 == 0)
    w[rings] = (200, 60, 40)
    w[(xx >= 8) & (xx < 14)] = (250, 250, 250)
    return {"control_a.png": a.astype(np.uint8), "control_wide.png": w.astype(np.uint8)}


def write_images():
    from PIL import Image
    out = {}
    for name, arr in control_images().items():
        path = os.path.join(ROOT, "graphs", "input", name)
        same = False
        if os.path.exists(path):
            with Image.open(path) as im:
                same = im.mode == "RGB" and np.array_equal(np.asarray(im), arr)
        if not same:
            Image.fromarray(arr, "RGB").save(path)
        out[name] = {"width": arr.shape[1], "height": arr.shape[0]}
    return out


# --- key layouts ----------------------------------------------------------

def controlnet_module(torch, c):
    """ComfyUI's ControlNet for the UNet config `c` (3-channel hint), on
    the meta device."""
    import comfy.cldm.cldm
    import comfy.ops
    adm = c.get("adm_in_channels")
    return comfy.cldm.cldm.ControlNet(
        image_size=None, in_channels=c["in_channels"], model_channels=c["model_channels"],
        hint_channels=3, num_res_blocks=c["num_res_blocks"], channel_mult=c["channel_mult"],
        num_heads=c["num_heads"], num_head_channels=c.get("num_head_channels", -1),
        use_spatial_transformer=True, transformer_depth=c["transformer_depth"],
        transformer_depth_middle=c["transformer_depth_middle"], context_dim=c["context_dim"],
        use_linear_in_transformer=c["use_linear_in_transformer"], adm_in_channels=adm,
        num_classes="sequential" if adm else None, legacy=False, device="meta",
        operations=comfy.ops.disable_weight_init)


def controlnet_keys(torch, c):
    return [(k, list(t.shape)) for k, t in controlnet_module(torch, c).state_dict().items()]


def diffusers_names(keys, c):
    """ldm ControlNet key -> its diffusers name: ComfyUI's unet_to_diffusers
    map inverted, plus the ControlNet names load_controlnet_state_dict maps
    (controlnet_down_blocks.N -> zero_convs.N.0, controlnet_mid_block ->
    middle_block_out.0, controlnet_cond_embedding conv_in / blocks.i /
    conv_out -> input_hint_block.0 / 2(i+1) / last)."""
    import comfy.utils
    m = comfy.utils.unet_to_diffusers(c)
    hint = sorted({int(k.split(".")[1]) for k, _ in keys if k.startswith("input_hint_block.")})
    zeros = sorted({int(k.split(".")[1]) for k, _ in keys if k.startswith("zero_convs.")})
    for s in ("weight", "bias"):
        m["controlnet_mid_block." + s] = "middle_block_out.0." + s
        for n in zeros:
            m["controlnet_down_blocks.{}.{}".format(n, s)] = "zero_convs.{}.0.{}".format(n, s)
        m["controlnet_cond_embedding.conv_in." + s] = "input_hint_block.0." + s
        for i, n in enumerate(hint[1:-1]):
            assert n == 2 * (i + 1)
            m["controlnet_cond_embedding.blocks.{}.{}".format(i, s)] = \
                "input_hint_block.{}.{}".format(n, s)
        m["controlnet_cond_embedding.conv_out." + s] = "input_hint_block.{}.{}".format(hint[-1], s)
    inv = {}
    for d, ldm in m.items():
        inv.setdefault(ldm, []).append(d)
    out = {}
    for k, _ in keys:
        names = inv[k]
        if len(names) > 1:  # label_emb: class_embedding / add_embedding
            names = [n for n in names if n.startswith("add_embedding.")]
        (out[k],) = names
    return out


def t2i_keys(torch):
    import comfy.t2i_adapter.adapter
    m = comfy.t2i_adapter.adapter.Adapter(**T2I_CONFIG)
    return [(k, list(t.shape)) for k, t in m.state_dict().items()]


def deep_checkpoint_keys(torch):
    unet = fam.unet_keys(torch, UNET_DEEP)
    rest = [(k, s) for k, s in sd1.checkpoint_keys(torch)
            if not k.startswith("model.diffusion_model.")]
    return [("model.diffusion_model." + k, s) for k, s in unet] + rest


def file_specs(torch):
    """(folder, name, kind, base, sorted [(key, shape)], {file key: module
    key}) per file; module key: the name in the loaded model's state
    dict."""
    sd1_cn = controlnet_keys(torch, sd1.UNET)
    xl_cn = controlnet_keys(torch, fam.UNET_XL)
    xl_names = diffusers_names(xl_cn, fam.UNET_XL)
    t2i = t2i_keys(torch)
    specs = [
        ("controlnet", SD1_CN, "controlnet_ldm", sd1.CKPT,
         [("control_model." + k, s) for k, s in sd1_cn],
         {"control_model." + k: k for k, _ in sd1_cn}),
        ("controlnet", SD1_CN_NOPREFIX, "controlnet_ldm", sd1.CKPT, sd1_cn,
         {k: k for k, _ in sd1_cn}),
        ("controlnet", SDXL_CN, "controlnet_diffusers", "tiny_sdxl.safetensors",
         [(xl_names[k], s) for k, s in xl_cn], {xl_names[k]: k for k, _ in xl_cn}),
        ("controlnet", T2I, "t2i_adapter", DEEP, t2i, {k: k for k, _ in t2i}),
        ("checkpoints", DEEP, "checkpoint", None, deep_checkpoint_keys(torch), {}),
    ]
    return [(f, n, kind, base, sorted(keys), m) for f, n, kind, base, keys, m in specs]


# --- ComfyUI patches and records -------------------------------------------

def patch_comfy(tmp, torch):
    import comfy.model_detection as md
    fam.patch_comfy(tmp, torch)
    orig = md.unet_config_from_diffusers_unet

    def detect(state_dict, dtype=None):
        out = orig(state_dict, dtype)
        if out is not None or "conv_in.weight" not in state_dict:
            return out
        # The five keys ComfyUI's table is matched on.
        depth = []
        for i in range(md.count_blocks(state_dict, "down_blocks.{}")):
            attn = md.count_blocks(state_dict, "down_blocks.{}.attentions.".format(i) + "{}")
            res = md.count_blocks(state_dict, "down_blocks.{}.resnets.".format(i) + "{}")
            for a in range(attn):
                prefix = "down_blocks.{}.attentions.{}.transformer_blocks.".format(i, a)
                depth.append(md.count_blocks(state_dict, prefix + "{}"))
            if attn == 0:
                depth += [0] * res
        ctx = [v.shape[1] for k, v in state_dict.items() if k.endswith("attn2.to_k.weight")]
        emb = state_dict.get("add_embedding.linear_1.weight")
        match = {"transformer_depth": depth, "context_dim": ctx[0] if ctx else None,
                 "model_channels": state_dict["conv_in.weight"].shape[0],
                 "in_channels": state_dict["conv_in.weight"].shape[1],
                 "adm_in_channels": None if emb is None else emb.shape[1]}
        if all(TINY_XL_DIFFUSERS[k] == v for k, v in match.items()):
            return md.convert_config(dict(TINY_XL_DIFFUSERS, dtype=dtype))
        return None
    md.unet_config_from_diffusers_unet = detect


NAMES = {}   # id(control model module) -> file name
CALLS = []   # [file, sigma, strength, applied, batch] per get_control call


def record_controls():
    """Names each loaded control model and logs every get_control call."""
    import comfy.controlnet as cn
    load = cn.load_controlnet

    def load_controlnet(path, *args, **kwargs):
        c = load(path, *args, **kwargs)
        NAMES[id(module_of(c))] = os.path.basename(path)
        return c
    cn.load_controlnet = load_controlnet

    for cls in (cn.ControlNet, cn.T2IAdapter):
        def wrap(orig):
            def get_control(self, x_noisy, t, cond, batched_number, transformer_options):
                r = self.timestep_range
                applied = r is None or not (t[0] > r[0] or t[0] < r[1])
                CALLS.append([NAMES.get(id(module_of(self))), float(t[0]), self.strength,
                              bool(applied), int(x_noisy.shape[0])])
                return orig(self, x_noisy, t, cond, batched_number, transformer_options)
            return get_control
        cls.get_control = wrap(cls.get_control)


def module_of(c):
    return c.t2i_model if hasattr(c, "t2i_model") else c.control_model


def canny_node():
    """Canny is a ComfyUI V3 node; called the way ComfyUI's executor calls
    it (class clone, EXECUTE_NORMALIZED)."""
    import comfy_extras.nodes_canny as m

    class Node:
        FUNCTION = "run"

        def run(self, **kwargs):
            clone = m.Canny.PREPARE_CLASS_CLONE({})
            return getattr(clone, clone.FUNCTION)(**kwargs).result
    return Node


# --- checks ---------------------------------------------------------------

def check_loaded(nodes, torch, specs, log):
    """Each control file through ControlNetLoader: the right class, every
    tensor the file's f16 value, structure equal to its base UNet."""
    import comfy.controlnet as cn
    for folder, name, kind, base, keys, names in specs:
        if folder != "controlnet":
            continue
        del log.records[:]
        (c,) = nodes.ControlNetLoader().load_controlnet(name)
        assert not log.problems(), (name, log.problems())
        m = module_of(c)
        want = cn.T2IAdapter if kind == "t2i_adapter" else cn.ControlNet
        assert type(c) is want, (name, type(c))
        sd = m.state_dict()
        assert set(sd) == set(names.values()), (name, set(sd) ^ set(names.values()))
        for k, shape in keys:
            v = sd1.values(k, shape).astype(np.float16).astype(np.float32)
            got = sd[names[k]]
            assert got.dtype == torch.float32, (name, k, got.dtype)
            assert np.array_equal(got.numpy(), v), (name, k)
        if kind != "t2i_adapter":
            model = nodes.CheckpointLoaderSimple().load_checkpoint(base)[0]
            usd = model.model.state_dict()
            n = 0
            for k, t in sd.items():
                if k.startswith(("time_embed.", "label_emb.", "input_blocks.", "middle_block.")):
                    assert list(usd["diffusion_model." + k].shape) == list(t.shape), (name, k)
                    n += 1
            print("load", name, type(c).__name__, "dtype", m.dtype, "manual cast",
                  c.manual_cast_dtype, "tensors", len(sd), "shared with", base, n)
        else:
            print("load", name, type(c).__name__, "channels_in", c.channels_in,
                  "unshuffle", m.unshuffle_amount, "xl", m.xl, "tensors", len(sd))


def b64f(t):
    return sd1.b64(t.detach().float().numpy().astype("<f4"))


def tensor_list(ts):
    return [None if t is None else {"shape": list(t.shape), "f32": b64f(t)} for t in ts]


def forward_checks(nodes, torch):
    """MODELS: get_control once each, as the sampler would call it."""
    import comfy.controlnet as cn
    out = {}
    for name, base, image in MODELS:
        model = nodes.CheckpointLoaderSimple().load_checkpoint(base)[0]
        bm = model.model
        ms = bm.model_sampling
        (control,) = nodes.ControlNetLoader().load_controlnet(name)
        (hint,) = nodes.LoadImage().load_image(image)[:1]
        ctx_dim = bm.model_config.unet_config["context_dim"]
        x = torch.from_numpy(sd1.values("control_check.x", [1, 4, 8, 8]) * np.float32(32))
        ctx = torch.from_numpy(sd1.values("control_check.context", [1, CHECK_TOKENS, ctx_dim])
                               * np.float32(8))
        sigma = torch.tensor([CHECK_SIGMA], dtype=torch.float32)
        cond = {"c_crossattn": ctx}
        inputs = {"x_shape": list(x.shape), "x_f32": b64f(x), "sigma": CHECK_SIGMA,
                  "context_shape": list(ctx.shape), "context_f32": b64f(ctx)}
        adm = bm.model_config.unet_config.get("adm_in_channels")
        if adm:
            y = torch.from_numpy(sd1.values("control_check.y", [1, adm]) * np.float32(8))
            cond["y"] = y
            inputs.update({"y_shape": list(y.shape), "y_f32": b64f(y)})
        inputs["hint_image"] = image
        c = control.copy().set_cond_hint(hint.movedim(-1, 1), 1.0, (0.0, 1.0))
        c.pre_run(bm, lambda a: ms.percent_to_sigma(a))
        seen = {}
        m = module_of(c)
        fwd = m.forward

        def spy(*args, **kwargs):
            seen.update(kwargs)
            if args:
                seen["args"] = args
            return fwd(*args, **kwargs)
        m.forward = spy
        try:
            with torch.inference_mode():
                got = c.get_control(x, sigma, cond, 1, {})
        finally:
            del m.forward
        if isinstance(c, cn.ControlNet):
            assert torch.equal(seen["timesteps"], ms.timestep(sigma).float())
            assert torch.equal(seen["x"], ms.calculate_input(sigma, x))
            inputs["timestep"] = float(seen["timesteps"][0])
            inputs["x_in_f32"] = b64f(seen["x"])
            inputs["hint_shape"] = list(seen["hint"].shape)
        else:
            inputs["hint_shape"] = list(seen["args"][0].shape)
            # Popped from the end, one per input block: the features land
            # after input blocks 2, 5, 8, 11 (SD1's 12-block structure).
            assert [i for i, t in enumerate(got["input"]) if t is not None] == [0, 3, 6, 9]
        c.cleanup()
        out[name] = {"base": base, "inputs": inputs,
                     "control": {k: tensor_list(got[k]) for k in ("input", "middle", "output")}}
        desc = {k: [None if t is None else list(t.shape) for t in got[k]] for k in got}
        print("forward", name, "hint", inputs["hint_shape"], desc)
        print("   abs max", {k: max([float(t.abs().max()) for t in got[k] if t is not None] or [0])
                             for k in got})
    return out


def without_control(prompt):
    """The graph with every ControlNetApply(Advanced) bypassed."""
    ctl = {nid for nid, n in prompt.items() if n["class_type"] in CONTROL_NODES}

    def source(ref):
        while ref[0] in ctl:
            node = prompt[ref[0]]
            if node["class_type"] == "ControlNetApply":
                ref = node["inputs"]["conditioning"]
            else:
                ref = node["inputs"]["positive" if ref[1] == 0 else "negative"]
        return ref
    return {nid: dict(n, inputs={k: source(v) if isinstance(v, list) else v
                                 for k, v in n["inputs"].items()})
            for nid, n in prompt.items() if nid not in ctl}


def full_range(prompt):
    return {nid: dict(n, inputs=dict(n["inputs"], start_percent=0.0, end_percent=1.0))
            if n["class_type"] == "ControlNetApplyAdvanced" else n for nid, n in prompt.items()}


def canny_run(nodes_ns, torch):
    with open(os.path.join(ROOT, "graphs", CANNY + ".json")) as f:
        prompt = json.load(f)
    saved, _ = sd1.run_workflow(prompt, nodes_ns, torch)
    saves = [(nid, n) for nid, n in prompt.items() if n["class_type"] == "SaveImage"]
    assert len(saves) == len(saved)
    images = []
    for (nid, n), img in zip(saves, saved):
        canny = prompt[n["inputs"]["images"][0]]["inputs"]
        a = img.float().numpy()
        assert set(np.unique(a).tolist()) <= {0.0, 1.0}
        assert np.array_equal(a[..., 0], a[..., 1]) and np.array_equal(a[..., 0], a[..., 2])
        images.append({"node": nid, "filename_prefix": n["inputs"]["filename_prefix"],
                       "low_threshold": canny["low_threshold"],
                       "high_threshold": canny["high_threshold"],
                       "edge_pixels": int(a[..., 0].sum()),
                       "image_shape": list(a.shape), "image_f32": sd1.b64(a.astype("<f4"))})
        print("canny", canny["low_threshold"], canny["high_threshold"], "edge pixels",
              int(a[..., 0].sum()), "of", a.shape[1] * a.shape[2])
    assert images[0]["edge_pixels"] != images[1]["edge_pixels"]
    import kornia
    return {"kornia_version": kornia.__version__, "images": images}


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import folder_paths
    import nodes

    log = LogCapture()
    root = logging.getLogger()
    root.addHandler(log)
    level = root.level
    tmp = tempfile.mkdtemp()
    try:
        patch_comfy(tmp, torch)
        record_controls()
        images = write_images() if not sub else None
        ckpt_dir = os.path.join(tmp, "checkpoints")
        fam.write_base_checkpoints(ckpt_dir, torch)
        folder_paths.add_model_folder_path("checkpoints", ckpt_dir, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))

        # The LoRA, from its fixture's key list.
        with open(os.path.join(ROOT, "tests", "reference", "lora", "expected.json")) as f:
            (lora,) = [x for x in json.load(f)["loras"] if x["name"] == LORA]
        lora_dir = os.path.join(tmp, "loras")
        os.makedirs(lora_dir)
        keys = [(k, s) for k, s in lora["keys"]]
        digest = lp.write_lora(os.path.join(lora_dir, LORA), keys, lora["scaled"],
                               lora["alphas"], torch)
        assert str(digest) == lora["checksum_f16"], (digest, lora["checksum_f16"])
        folder_paths.add_model_folder_path("loras", lora_dir, is_default=True)

        specs = file_specs(torch)
        out = {"base": {"sd1": "sd1/expected.json", "sdxl": "families/expected.json",
                        "lora": "lora/expected.json"},
               "files": [], "images": images, "models": {}, "workflows": {}}
        for folder, name, kind, base, keys, _ in specs:
            d = os.path.join(tmp, folder)
            os.makedirs(d, exist_ok=True)
            digest = fam.write_file(os.path.join(d, name), keys, {}, torch)
            out["files"].append({"folder": folder, "name": name, "kind": kind, "base": base,
                                 "keys": keys, "scaled": {}, "checksum_f16": str(digest)})
            if not sub:
                print("file", folder, name, kind, "keys", len(keys),
                      "params", sum(int(np.prod(s)) for _, s in keys), "checksum", digest)
        folder_paths.add_model_folder_path("controlnet", os.path.join(tmp, "controlnet"),
                                           is_default=True)
        node_ns = types.SimpleNamespace(
            NODE_CLASS_MAPPINGS={**nodes.NODE_CLASS_MAPPINGS, "Canny": canny_node()})

        if not sub:
            model = nodes.CheckpointLoaderSimple().load_checkpoint(DEEP)[0]
            assert type(model.model.model_config).__name__ == "SD15", model.model.model_config
            del model
            # ComfyUI reports unexpected keys at DEBUG level: captured here,
            # not printed.
            quiet = [(h, h.level) for h in root.handlers if h is not log]
            for h, _ in quiet:
                h.setLevel(max(h.level, logging.INFO))
            root.setLevel(logging.DEBUG)
            check_loaded(nodes, torch, specs, log)
            out["models"] = forward_checks(nodes, torch)
            root.setLevel(level)
            for h, lvl in quiet:
                h.setLevel(lvl)

            f64_latents, perturbed_latents = sd1.spread_runs(__file__)

        for name in WORKFLOWS:
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            del log.records[:]
            del CALLS[:]
            saved, latents = sd1.run_workflow(prompt, node_ns, torch)
            assert not log.problems(), (name, log.problems())
            calls = [list(c) for c in CALLS]
            assert calls and any(c[3] for c in calls), (name, calls)
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            assert np.isfinite(lat).all() and np.isfinite(img).all(), name
            if sub:
                out["workflows"][name] = sd1.b64(lat.astype("<f4"))
                continue
            _, plain = sd1.run_workflow(without_control(prompt), node_ns, torch)
            plain = plain[0].float().numpy()
            rel = float(np.abs(lat - plain).max() / np.abs(plain).max())
            assert rel > 0.01, (name, rel)

            def spread_to(latents):
                other = np.frombuffer(base64.b64decode(latents[name]), "<f4")
                return float(np.abs(lat.reshape(-1) - other).max() / np.abs(other).max())
            w = {"f32_vs_f64_unet_rel": spread_to(f64_latents),
                 "unet_rounding_rel": spread_to(perturbed_latents),
                 "control_vs_no_control_rel": rel}
            if not all(c[3] for c in calls):
                _, full = sd1.run_workflow(full_range(prompt), node_ns, torch)
                full = full[0].float().numpy()
                w["range_vs_full_range_rel"] = float(np.abs(lat - full).max() / np.abs(full).max())
                # Far above the f32 spreads the tests' tolerance comes from
                # (the tiny T2I's late steps move the latent ~1e-4 only).
                spread = max(w["f32_vs_f64_unet_rel"], w["unet_rounding_rel"])
                assert w["range_vs_full_range_rel"] > 20 * spread, (name, w)
            w.update({"control_calls": calls,
                      "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
                      "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4"))})
            out["workflows"][name] = w
            print(name, "latent", lat.shape, "abs mean", float(np.abs(lat).mean()),
                  "std", float(lat.std()), "image mean", float(img.mean()),
                  "f32 vs f64 UNet", w["f32_vs_f64_unet_rel"],
                  "UNet rounding", w["unet_rounding_rel"], "vs no control", rel,
                  "vs full range", w.get("range_vs_full_range_rel"))
            for c in calls:
                print("   get_control", c)
        if sub:
            print(json.dumps(out["workflows"]))
            return
        out["workflows"][CANNY] = canny_run(node_ns, torch)
        sd1.write_expected("controlnet", out)
    finally:
        root.setLevel(level)
        root.removeHandler(log)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
