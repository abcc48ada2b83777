"""End-to-end and component references for Stability's SD3.5 ControlNets.

Two tiny ControlNets in the key layout of Stability's
sd3.5_large_controlnet_{blur,canny,depth}.safetensors are built for
ComfyUI's own class (comfy/cldm/dit_embedder.py ControlNetEmbedder, loaded
by comfy/controlnet.py load_controlnet_sd35), every value from
sd1_pipeline's `values(key, shape)` formula of the key as spelled in the
file, stored f16, except the `control_type` tensor (a fixed value). The base
is sd3_pipeline.py's checkpoints/tiny_sd35_medium.safetensors (MMDiT-X,
depth 2 = hidden 128, 2 heads of 64, adm 192), assembled as sd3_pipeline
builds it; its entry asserted equal to tests/reference/sd3/expected.json's
and dit_guidance/expected.json's. The workflows graphs/tiny_sd35_controlnet_
{canny,blur}.json (written by this script) are run through ComfyUI's own
node classes on the CPU in f32, and tests/reference/sd3_controlnet/
expected.json gets:
  files: the checkpoint's entry (folder, name, keys sorted with shapes,
      scaled, checksum_f16), then per ControlNet: folder "controlnet"
      (ComfyUI's ControlNetLoader folder), name, keys (sorted, with
      shapes), scaled {}, checksum_f16 (sd1_pipeline.checksum over every
      tensor's f16 bits in key order, control_type included), alphas
      {"control_type": value} (the one tensor not from the formula: one f16
      element, what tests/support write_tensors_with calls `fixed`), kind
      "sd35_controlnet", control_type, double_y_emb, blocks (transformer
      blocks), base "tiny_sd35_medium.safetensors".
  workflows: per graph as flux's: latent_shape, latent_f32, image_shape,
      image_f32 (base64 little-endian f32), image_range [min, max, std],
      f32_vs_f64_unet_rel, unet_rounding_rel (sd1_pipeline's spread runs:
      the f64 run has the ControlNet in f64 too, ComfyUI's unet_dtype gives
      it the same dtype); without_rel (max |latent - latent of the same
      graph with the apply node bypassed| / max |that latent|: the
      ControlNet matters); control_calls: every ControlNet.get_control call
      of the sampling, in order ([strength, sigma, applied, batch,
      batched_number]); dit_control: per MMDiT call [sigma, batch, number of
      control["output"] entries] (0 without control).
  components:
    controlnet_forward: {graph: ...} the first ControlNetEmbedder.forward
        call of each graph (the outputs copied before control_merge scales
        them in place): sigma, strength, double_y_emb; inputs x,
        timesteps, y, hint (each {shape, f32}; context_shape: what
        ComfyUI passes as context, unused); block_inputs: per transformer
        block its x input ({shape, f32}) and c (the block's conditioning
        vector, one for all blocks); sincos_pos_embed (canny only:
        get_2d_sincos_pos_embed_torch(128, w, h) [h*w, 128], what ComfyUI
        adds after the copied x_embedder); "output": {count, tensors:
        [{positions, shape, f32}]}, one item per DISTINCT tensor of the
        returned tuple with the positions it occupies; before the strength.
    hints: {graph: ...} how the hint of that first call was made:
        image_shape (what the apply node got, [B, H, W, C]), preprocess
        (its formula), pixels ({shape, f32}: what VAE.encode got, [B, H, W,
        C], after the resize and preprocess_image), encoded ({shape, f32}:
        VAE.encode's output), latent_format {scale_factor, shift_factor},
        hint ({shape, f32}: process_in of `encoded`, the forward's hint).
    pre_run: {graph: {double_y_emb, copied: [control model keys loaded
        from the main model], source: the main model's module, equal: the
        copy holds the main model's values}}.
    load_log: {file: [[level, message]...]} ControlNetLoader's log records
        at DEBUG level (the missing-key warning below, and a DEBUG "Model
        doesn't have a device attribute.").

Files (f16, no prefix; the large files' names: diffusers names for the
embedders -- time_text_embed.*, pos_embed.proj.* -- and ComfyUI's native
names for the rest; what load_controlnet_sd35 renames through
comfy.utils.MMDIT_MAP_BASIC), hidden 128 (= 64 x depth 2 of the tiny
SD3.5; ComfyUI reads depth = y_embedder.mlp.0.weight.shape[0] // 64),
2 heads, patch 2, 16 latent channels:
  controlnet/tiny_sd35_controlnet_canny.safetensors: control_type [1] = 1,
      double_y_emb False (time_text_embed.text_embedder.linear_1.weight
      [128, 192]: the pooled y itself), 2 transformer blocks:
      time_text_embed.timestep_embedder.linear_{1,2}.{weight, bias}
      ([128, 256], [128, 128]), time_text_embed.text_embedder.linear_{1,2}.
      {weight, bias} ([128, 192], [128, 128]), pos_embed_input.proj.
      {weight [128, 16, 2, 2], bias}, transformer_blocks.{0,1}.
      {adaLN_modulation.1 [768, 128], attn.qkv [384, 128], attn.proj,
      mlp.fc1 [512, 128], mlp.fc2 [128, 512]}.{weight, bias},
      controlnet_blocks.{0,1}.{weight [128, 128], bias}. No x_embedder
      (pos_embed.proj): diffusers' scripts/convert_sd3_controlnet_to_
      diffusers.py reads none from the real files (its SD3ControlNetModel
      has use_pos_embed=False) and Stability's 8B path never uses the net's
      own; ComfyUI copies the main model's at pre_run.
  controlnet/tiny_sd35_controlnet_blur.safetensors: control_type [1] = 0,
      double_y_emb True (text_embedder.linear_1.weight [128, 128]), 1
      transformer block: the same names plus pos_embed.proj.{weight
      [128, 16, 2, 2], bias} (the net's own x_embedder, used as is); no
      orig_y_embedder (ComfyUI copies the main model's y_embedder at
      pre_run). Stability's three real files are all double_y_emb False
      (text_embedder [2432, 2048], hidden 64 x 38, 19 blocks for depth 38,
      each block's output used twice); the double_y_emb path is the
      2B-style net's (Stability's sd3_infer.py: y through the main model's
      y_embedder first, x embedded by the net, no pos embed).

Workflows (CheckpointLoaderSimple tiny_sd35_medium -> ModelSamplingSD3 3.0,
CLIPTextEncode positive and a real negative, LoadImage example.png (64x48
RGBA -> RGB), ControlNetLoader, KSampler euler / simple 4 steps cfg 3.0,
VAEDecode with the checkpoint's VAE):
  tiny_sd35_controlnet_canny: ControlNetApplySD3 (comfy_extras/nodes_sd3.py,
      vae = the checkpoint's) strength 0.8, 0.0-0.7; EmptySD3LatentImage
      64x48 -> latent [1, 16, 6, 8] (patches 3 x 4: w != h in the sin-cos
      table). The last step (sigma 0.5 < percent_to_sigma(0.7) = 0.5625)
      runs without control.
  tiny_sd35_controlnet_blur: ControlNetApplyAdvanced (nodes.py) with its
      optional vae = the checkpoint's, strength 1.2, 0.1-1.0; the image
      through ImageScale(bilinear, 40x40, crop disabled) first;
      EmptySD3LatentImage 48x64 -> latent [1, 16, 8, 6]: the hint is a real
      resize (40x40 -> center crop 30x40 -> nearest-exact 48x64). The first
      step (sigma 1.0 > percent_to_sigma(0.1) = 0.9643) runs without
      control.

How ComfyUI does it (asserted here where observable):
  * Loading: load_controlnet_state_dict sees controlnet_blocks.0.weight,
      pos_embed_input.proj.weight and transformer_blocks.0.adaLN_modulation.
      1.bias (no double_blocks.0.img_attn.norm.key_norm.scale) ->
      load_controlnet_sd35: control_type = round(sd.pop("control_type").
      item()) (-1 when absent); the MMDIT_MAP_BASIC names renamed
      (time_text_embed.timestep_embedder.linear_{1,2} -> t_embedder.mlp.
      {0,2}, time_text_embed.text_embedder.linear_{1,2} -> y_embedder.mlp.
      {0,2}, pos_embed.proj -> x_embedder.proj), the rest kept; depth =
      y_embedder.mlp.0.weight.shape[0] // 64, hidden = 64 depth, heads =
      depth, blocks = count of transformer_blocks.N, double_y_emb = (that
      weight is square), ControlNetEmbedder(patch 2, in 16, main_model_double
      = depth, adm_in_channels 2048 -- the real pooled width, relaxed to 192
      below), load_state_dict(strict=False): missing keys logged as a
      warning ("missing controlnet keys: [...]": x_embedder.proj.{weight,
      bias} for canny, orig_y_embedder.mlp.{0,2}.{weight, bias} for blur,
      exactly these, as with the real files), unexpected at debug (none).
      Wrapped in ControlNetSD35(compression_ratio 1, latent_format SD3()
      (scale 1.5305, shift 0.0609: NOT zeroed, unlike load_controlnet_mmdit's
      SD3 diffusers nets), upscale_algorithm 'nearest-exact', extra_conds
      ['y'], strength_type CONSTANT, preprocess_image: control_type 1
      (canny) a * 255 * 0.5 + 0.5, 2 (depth) 1 - a, else (blur, -1) a).
  * Both apply nodes: control_net.copy().set_cond_hint(image [B, C, H, W],
      strength, (start, end), vae), one copy shared by positive and
      negative (so cond and uncond run as one batch of 2).
  * ControlNetSD35.pre_run (every sampling): double_y_emb ?
      orig_y_embedder.load_state_dict(main diffusion_model.y_embedder) :
      x_embedder.load_state_dict(main diffusion_model.x_embedder)
      (strict=False, into the one loaded net every copy shares; run once
      per conditioning holding the net: twice per sampling here), then
      timestep_range = (percent_to_sigma(start), percent_to_sigma(end))
      (ModelSamplingDiscreteFlow, shift 3: 1.0 at 0, 0.0 at 1, else
      3 (1 - p) / (1 + 2 (1 - p))); get_control returns None when sigma >
      range[0] or sigma < range[1].
  * The hint (get_control, cached while the latent size stays):
      common_upscale(image, latent_w * 1 * 8, latent_h * 1 * 8 (compression
      1 times the VAE's spacial_compression_encode() 8), "nearest-exact",
      "center") (center crop to the target aspect: x or y = round((old -
      old * ratio) / 2), then torch nearest-exact); preprocess_image; VAE
      .encode(hint [B, H, W, C]) (the VAE's own process_input 2a - 1, no
      clamp: canny pixels reach 128, so the encoder sees 255 a); SD3
      process_in (latent - 0.0609) * 1.5305; cast to the net's dtype. A
      batch-1 hint stays batch 1 (broadcast_image_to), broadcast in the
      forward.
  * The ControlNetEmbedder inputs: x = calculate_input(sigma, x_noisy) =
      x_noisy (CONST), timesteps = model_sampling.timestep(sigma) = sigma *
      1000, y = the batch's 'y' (pooled [B, 192]), context = c_crossattn
      (unused), hint.
  * ControlNetEmbedder.forward: x = x_embedder(x) (patch 2 conv ->
      tokens); if not double_y_emb: x += get_2d_sincos_pos_embed_torch(
      hidden, w, h) with h, w = (latent h + 1) // 2, (latent w + 1) // 2
      (val_center 7.5, val_magnitude 7.5: row coordinates linspace(7.5 -
      7.5 h / m, 7.5 + 7.5 h / m, h), columns the same with w, m = min(h,
      w); per axis a 64-wide [sin | cos] (32 each) of coordinate * omega_i,
      omega_i = 1 / 10000^(i / 32); token (row, col) = [emb(col) |
      emb(row)], tokens row-major) -- not the main model's cropped
      pos_embed, which Stability's reference adds; c =
      t_embedder(timesteps) (256 frequencies) + y_embedder(double_y_emb ?
      orig_y_embedder(y) : y); x = x + pos_embed_input(hint); per block i:
      out = transformer_blocks[i](x, c) (DismantledBlock: adaLN 6-way, no
      qk norm, self-attention over the image tokens only, GELU-tanh MLP);
      if not double_y_emb: x = out (double_y_emb: every block sees the
      same x); controlnet_blocks[i](out) appended ceil(main_model_double /
      blocks) times in a row. Returned {"output": tuple} (canny: block 0
      at position 0, block 1 at 1; blur: block 0 at 0 and 1).
  * control_merge: each DISTINCT tensor multiplied once, in place, by the
      strength; "input" and "middle" stay [].
  * MMDiT.forward_core_with_concat: after joint block i, if i <
      len(control["output"]) and the entry is not None: x += add (the image
      tokens; the tiny model's 2 blocks use output[0] and output[1]);
      asserted on the first MMDiT call with control of each graph with
      module hooks on its blocks.

Relaxed as in sd3_pipeline.py (its patch_comfy; flux_pipeline's via
fixture_runs.comfy_tmp, once), and one more: load_controlnet_sd35
hard-codes adm_in_channels 2048 (the real pooled width; the tiny SD3's is
192, so the canny net's y_embedder and the blur net's orig_y_embedder could
not take the tiny pooled y / the main y_embedder's weights). Its code
object's constant 2048 is replaced by 192 (the exact constant tuple is
asserted first); the bytecode is ComfyUI's.

    COMFY_DIR=/work/comfyfull /work/venv-ref/bin/python tools/reference/sd3_controlnet.py
(media-only imports are stubbed as in sd1_pipeline.py; the base fixtures
are not rewritten; the graphs are written by the main run; model folders,
fixture checks, the SD3.5 checkpoint, workflow runs, spreads and
per-workflow fields are fixture_runs.py's; the get_control and VAE.encode
recording, the range and hint checks and the per-workflow control fields
are control_runs.py's.)
"""
import math
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import flux_pipeline as fp  # noqa: E402
import flux_fill as ff  # noqa: E402
import fixture_runs as fr  # noqa: E402
import inpaint_pipeline as ip  # noqa: E402
import sd3_pipeline as s3  # noqa: E402
import control_runs as cr  # noqa: E402

SD3_CKPT = "tiny_sd35_medium.safetensors"
CANNY = "tiny_sd35_controlnet_canny.safetensors"
BLUR = "tiny_sd35_controlnet_blur.safetensors"
NETS = {CANNY: {"control_type": 1, "double_y_emb": False, "blocks": 2},
        BLUR: {"control_type": 0, "double_y_emb": True, "blocks": 1}}
WORKFLOWS = {"tiny_sd35_controlnet_canny": CANNY, "tiny_sd35_controlnet_blur": BLUR}
APPLY = {"tiny_sd35_controlnet_canny": "ControlNetApplySD3",
         "tiny_sd35_controlnet_blur": "ControlNetApplyAdvanced"}
APPLY_NODES = {"ControlNetApplySD3", "ControlNetApplyAdvanced"}
HIDDEN, ADM, DEPTH = s3.HIDDEN, s3.ADM, s3.DEPTH
MAIN_DOUBLE = DEPTH
SHIFT = 3.0
LATENT_SCALE, LATENT_SHIFT = 1.5305, 0.0609
# load_controlnet_sd35's constants (code objects left out), 2048 the one relaxed.
SD35_CONSTS = (None, -1, 'control_type', 1, 2, 0, 'y_embedder.mlp.0.weight', 64,
               'transformer_blocks.{}.', ('model_params',), 'custom_operations', True,
               ('disable_fast_fp8',), 16, 2048,
               ('img_size', 'patch_size', 'in_chans', 'num_layers', 'main_model_double',
                'double_y_emb', 'attention_head_dim', 'num_attention_heads', 'adm_in_channels',
                'device', 'dtype', 'operations'),
               ('compression_ratio', 'latent_format', 'load_device', 'manual_cast_dtype',
                'preprocess_image'))
# What ComfyUI's load_state_dict(strict=False) reports missing (copied at pre_run).
MISSING = {CANNY: ["x_embedder.proj.weight", "x_embedder.proj.bias"],
           BLUR: ["orig_y_embedder.mlp.0.weight", "orig_y_embedder.mlp.0.bias",
                  "orig_y_embedder.mlp.2.weight", "orig_y_embedder.mlp.2.bias"]}
ALLOWED = {"missing controlnet keys: {}".format(v) for v in MISSING.values()}
PROBLEMS = ("missing controlnet keys", "unexpected controlnet keys", "leftover keys",
            "could not detect", "control could not be applied", "error checkpoint",
            "no VAE provided", "needs a VAE", "ERROR")
# The file's diffusers names -> ComfyUI's (comfy.utils.MMDIT_MAP_BASIC, asserted).
RENAMES = {"time_text_embed.timestep_embedder.linear_1.": "t_embedder.mlp.0.",
           "time_text_embed.timestep_embedder.linear_2.": "t_embedder.mlp.2.",
           "time_text_embed.text_embedder.linear_1.": "y_embedder.mlp.0.",
           "time_text_embed.text_embedder.linear_2.": "y_embedder.mlp.2.",
           "pos_embed.proj.": "x_embedder.proj."}

PROMPT = ("a (white:1.2) ceramic teapot on a wooden table beside a window, [morning light], "
          "steam rising from the spout, ((still life)), soft shadows")
BLUR_PROMPT = ("a quiet harbor town at dusk, fishing boats, (warm window lights:1.1), "
               "reflections on calm water, film photo")
NEGATIVE = "blurry, lowres, (jpeg artifacts:1.3), watermark, text, deformed, oversaturated"


def graph_for(name):
    """The API prompt of workflow `name` (node ids as in
    graphs/tiny_sd35_medium_txt2img.json where they play the same part)."""
    g = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD3_CKPT}},
        "2": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": SHIFT}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": PROMPT}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": NEGATIVE}},
        "10": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "20": {"class_type": "ControlNetLoader", "inputs": {"control_net_name":
                                                            WORKFLOWS[name]}},
    }
    if name == "tiny_sd35_controlnet_canny":
        g.update({
            "21": {"class_type": "ControlNetApplySD3", "inputs": {
                "positive": ["3", 0], "negative": ["4", 0], "control_net": ["20", 0],
                "vae": ["1", 2], "image": ["10", 0], "strength": 0.8, "start_percent": 0.0,
                "end_percent": 0.7}},
            "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 48,
                                                                  "batch_size": 1}},
            "7": {"class_type": "KSampler", "inputs": {
                "model": ["2", 0], "positive": ["21", 0], "negative": ["21", 1],
                "latent_image": ["6", 0], "seed": 20241122, "steps": 4, "cfg": 3.0,
                "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        })
    else:
        g["3"]["inputs"]["text"] = BLUR_PROMPT
        g.update({
            "11": {"class_type": "ImageScale", "inputs": {
                "image": ["10", 0], "upscale_method": "bilinear", "width": 40, "height": 40,
                "crop": "disabled"}},
            "21": {"class_type": "ControlNetApplyAdvanced", "inputs": {
                "positive": ["3", 0], "negative": ["4", 0], "control_net": ["20", 0],
                "image": ["11", 0], "strength": 1.2, "start_percent": 0.1,
                "end_percent": 1.0, "vae": ["1", 2]}},
            "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 48, "height": 64,
                                                                  "batch_size": 1}},
            "7": {"class_type": "KSampler", "inputs": {
                "model": ["2", 0], "positive": ["21", 0], "negative": ["21", 1],
                "latent_image": ["6", 0], "seed": 5551212, "steps": 4, "cfg": 3.0,
                "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        })
    g.update(fr.save_nodes(name, ["1", 2]))
    return g


def without_control(prompt):
    """The graph with every apply node bypassed (consumers take its
    positive / negative input)."""
    ctl = {nid for nid, n in prompt.items() if n["class_type"] in APPLY_NODES}

    def source(ref):
        while ref[0] in ctl:
            ref = prompt[ref[0]]["inputs"]["positive" if ref[1] == 0 else "negative"]
        return ref
    g = {nid: dict(n, inputs={k: source(v) if isinstance(v, list) else v
                              for k, v in n["inputs"].items()})
         for nid, n in prompt.items() if nid not in ctl}
    assert not [n for n in g.values() if n["class_type"] in APPLY_NODES]
    return g


def v3_nodes():
    import comfy_extras.nodes_sd3 as sd3
    return {**s3.v3_nodes(), "ControlNetApplySD3": ff.v3(sd3.ControlNetApplySD3)}


# --- relaxations and files -------------------------------------------------

def patch_comfy(tmp, torch):
    """sd3_pipeline's relaxations on top of the flux_pipeline ones
    fr.comfy_tmp installed (flux_pipeline.patch_comfy not run again: its
    wrappers do not stack), then load_controlnet_sd35's 2048 -> ADM."""
    import comfy.controlnet as cn
    saved = fp.patch_comfy
    fp.patch_comfy = lambda tmp, torch: None
    try:
        s3.patch_comfy(tmp, torch)
    finally:
        fp.patch_comfy = saved
    code = cn.load_controlnet_sd35.__code__
    plain = tuple(c for c in code.co_consts if not isinstance(c, types.CodeType))
    assert plain == SD35_CONSTS, plain
    consts = tuple(ADM if (type(c) is int and c == 2048) else c for c in code.co_consts)
    cn.load_controlnet_sd35.__code__ = code.replace(co_consts=consts)


def controlnet_keys(torch, name):
    """The file's keys and shapes: ControlNetEmbedder's state dict for the
    tiny widths, less what pre_run copies, the MMDIT_MAP_BASIC names in
    their diffusers spelling, plus control_type; checked against the layout
    the docstring lists."""
    import comfy.ops
    import comfy.utils
    from comfy.cldm.dit_embedder import ControlNetEmbedder
    spec = NETS[name]
    m = ControlNetEmbedder(img_size=None, patch_size=2, in_chans=16, num_layers=spec["blocks"],
                           main_model_double=MAIN_DOUBLE, double_y_emb=spec["double_y_emb"],
                           attention_head_dim=HIDDEN // DEPTH, num_attention_heads=DEPTH,
                           adm_in_channels=ADM, device="meta", dtype=torch.float32,
                           operations=comfy.ops.disable_weight_init)
    basic = {k[0]: k[1] for k in comfy.utils.MMDIT_MAP_BASIC}
    for src, dst in RENAMES.items():
        for s in ("weight", "bias"):
            assert basic[dst + s] == src + s, (dst, basic.get(dst + s))
    back = {dst: src for src, dst in RENAMES.items()}
    keys = []
    for k, t in m.state_dict().items():
        if k in MISSING[name]:
            continue
        for dst, src in back.items():
            if k.startswith(dst):
                k = src + k[len(dst):]
        keys.append((k, list(t.shape)))
    keys.append(("control_type", [1]))
    h = HIDDEN
    want = {"control_type": [1],
            "time_text_embed.timestep_embedder.linear_1.weight": [h, 256],
            "time_text_embed.timestep_embedder.linear_2.weight": [h, h],
            "time_text_embed.text_embedder.linear_1.weight":
                [h, h if spec["double_y_emb"] else ADM],
            "time_text_embed.text_embedder.linear_2.weight": [h, h],
            "pos_embed_input.proj.weight": [h, 16, 2, 2]}
    if spec["double_y_emb"]:
        want["pos_embed.proj.weight"] = [h, 16, 2, 2]
    for i in range(spec["blocks"]):
        p = "transformer_blocks.{}.".format(i)
        want.update({p + "adaLN_modulation.1.weight": [6 * h, h], p + "attn.qkv.weight": [3 * h, h],
                     p + "attn.proj.weight": [h, h], p + "mlp.fc1.weight": [4 * h, h],
                     p + "mlp.fc2.weight": [h, 4 * h],
                     "controlnet_blocks.{}.weight".format(i): [h, h]})
    for k, s in list(want.items()):
        if k.endswith(".weight"):
            want[k[:-len("weight")] + "bias"] = [s[0]]
    got = dict(keys)
    assert len(got) == len(keys) and got == want, sorted(
        set((k, tuple(v)) for k, v in got.items()) ^ set((k, tuple(v)) for k, v in want.items()))
    return keys


def file_value(k, shape, control_type):
    if k == "control_type":
        return np.full(shape, control_type, np.float32)
    return sd1.values(k, shape)


def write_controlnet(path, keys, control_type, torch):
    """f16 tensors from the formula (control_type: its fixed value);
    returns the checksum over all of them in key order."""
    from safetensors.torch import save_file
    tensors, total = {}, 0
    for i, (k, shape) in enumerate(keys):
        v = file_value(k, shape, control_type).astype(np.float16)
        total = (total + sd1.checksum(v.view(np.uint16), i)) % (1 << 64)
        tensors[k] = torch.from_numpy(v)
    save_file(tensors, path)
    return total


def problems(log):
    """ff.unet_warnings plus any control-model record but the expected
    missing-key warnings."""
    return ff.unet_warnings(log) + [m for _, m in log.records
                                    if any(p in m for p in PROBLEMS) and m not in ALLOWED]


# --- recording -------------------------------------------------------------

class Record:
    """The SD3.5 loader's calls; every ControlNetSD35.pre_run (what it
    copied); every ControlNet.get_control call (stack order kept, result
    copied, the VAE.encode it made); every ControlNetEmbedder.forward call
    (inputs, block inputs, outputs copied before control_merge touches them,
    the forward rules checked on the spot); every MMDiT forward (the control
    it got) and, when `trace` is set, the image tokens around the joint
    blocks of the next call with control."""
    def __init__(self, torch):
        import comfy.cldm.dit_embedder as de
        import comfy.controlnet as cn
        import comfy.ldm.modules.diffusionmodules.mmdit as mm
        self.torch = torch
        self.loads = []
        self.trace = False
        self.check = False
        self.reset()
        rec = self

        load = cn.load_controlnet_sd35

        def load_wrap(sd, model_options={}):
            rec.loads.append({"keys": sorted(sd), "control_type": None if "control_type" not in sd
                              else float(sd["control_type"].float().reshape(-1)[0])})
            return load(sd, model_options=model_options)
        cn.load_controlnet_sd35 = load_wrap

        pre_run = cn.ControlNetSD35.pre_run

        def pre_wrap(self, model, percent_to_timestep_function):
            pre_run(self, model, percent_to_timestep_function)
            cm, dm = self.control_model, model.diffusion_model
            if cm.double_y_emb:
                src, dst, name = dm.y_embedder, cm.orig_y_embedder, "y_embedder"
                pre = "orig_y_embedder."
            else:
                src, dst, name = dm.x_embedder, cm.x_embedder, "x_embedder"
                pre = "x_embedder."
            a, b = src.state_dict(), dst.state_dict()
            rec.pre_runs.append({
                "double_y_emb": bool(cm.double_y_emb), "source": "diffusion_model." + name,
                "copied": [pre + k for k in b],
                "equal": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a),
                "range": [float(r) for r in self.timestep_range]})
        cn.ControlNetSD35.pre_run = pre_wrap

        cr.record_encode(rec)
        cr.record_get_control(rec, ("c_crossattn", "y"), lambda net: cr.hint_fields(net))

        forward = de.ControlNetEmbedder.forward

        def fwd_wrap(self, x, timesteps, y=None, context=None, hint=None):
            blocks = []

            def pre(mod, args):
                blocks.append((args[0].clone(), args[1].clone()))
            hooks = [b.register_forward_pre_hook(pre) for b in self.transformer_blocks]
            try:
                out = forward(self, x, timesteps, y=y, context=context, hint=hint)
            finally:
                for hk in hooks:
                    hk.remove()
            entry = {"model": id(self), "x": x.clone(), "timesteps": timesteps.clone(),
                     "y": None if y is None else y.clone(),
                     "context_shape": None if context is None else list(context.shape),
                     "hint": hint.clone(), "keys": sorted(out), "blocks": blocks,
                     "double_y_emb": bool(self.double_y_emb),
                     "output": cr.groups_of(list(out["output"]))}
            if rec.check:
                entry["pos"] = check_embedder(self, entry, torch)
            rec.forwards.append(entry)
            if rec.stack:
                rec.stack[-1]["forward"] = entry
            return out
        de.ControlNetEmbedder.forward = fwd_wrap

        dit_forward = mm.OpenAISignatureMMDITWrapper.forward

        def dit_wrap(self, x, timesteps, context=None, y=None, control=None,
                     transformer_options={}, **kwargs):
            call = {"timestep": float(timesteps[0]), "batch": int(x.shape[0]),
                    "control": None if control is None else {
                        k: [None if v is None else v.clone() for v in control[k]]
                        for k in control}}
            rec.dits.append(call)
            hooks = []
            if rec.trace and control is not None:
                rec.trace = False
                call["trace"] = trace = {}
                hooks = install_trace(self, trace)
            try:
                return dit_forward(self, x, timesteps, context=context, y=y, control=control,
                                   transformer_options=transformer_options, **kwargs)
            finally:
                for hk in hooks:
                    hk.remove()
        mm.OpenAISignatureMMDITWrapper.forward = dit_wrap

    def reset(self):
        self.controls, self.forwards, self.dits, self.stack = [], [], [], []
        self.pre_runs, self.other_encodes = [], 0


def install_trace(dm, trace):
    """Hooks on the MMDiT's joint blocks: each block's image-token input and
    output, the final layer's input."""
    hooks = []

    def pre(tag):
        def hook(mod, args, kwargs):
            trace[tag + "_in"] = (args[1] if len(args) > 1 else kwargs["x"]).clone()
        return hook

    def post(tag):
        def hook(mod, args, kwargs, out):
            trace[tag + "_out"] = out[1].clone()
        return hook

    def final(mod, args, kwargs):
        trace["final_in"] = args[0].clone()
    for i, b in enumerate(dm.joint_blocks):
        hooks.append(b.register_forward_pre_hook(pre("joint{}".format(i)), with_kwargs=True))
        hooks.append(b.register_forward_hook(post("joint{}".format(i)), with_kwargs=True))
    hooks.append(dm.final_layer.register_forward_pre_hook(final, with_kwargs=True))
    trace["blocks"] = len(dm.joint_blocks)
    return hooks


# --- checks ----------------------------------------------------------------

def check_embedder(m, e, torch):
    """The docstring's ControlNetEmbedder.forward, redone with the net's own
    modules on the recorded inputs; every step bitwise equal. Returns the
    sin-cos table added (None for double_y_emb)."""
    from comfy.ldm.modules.diffusionmodules.mmdit import get_2d_sincos_pos_embed_torch
    x, t, y, hint = e["x"], e["timesteps"], e["y"], e["hint"]
    emb = m.x_embedder(x)
    pos = None
    if not m.double_y_emb:
        h, w = (x.shape[-2] + 1) // 2, (x.shape[-1] + 1) // 2
        pos = get_2d_sincos_pos_embed_torch(m.hidden_size, w, h, device=x.device)
        assert list(pos.shape) == [h * w, m.hidden_size]
        emb += pos
    c = m.t_embedder(t, dtype=emb.dtype)
    c = c + m.y_embedder(m.orig_y_embedder(y) if m.double_y_emb else y)
    xi = emb + m.pos_embed_input(hint)
    n = len(m.transformer_blocks)
    assert len(e["blocks"]) == n
    repeat = math.ceil(m.main_model_double / n)
    outs = []
    for i, blk in enumerate(m.transformer_blocks):
        bx, bc = e["blocks"][i]
        assert torch.equal(bx, xi), ("block input", i)
        assert torch.equal(bc, c), ("block c", i)
        o = blk(xi, c)
        outs.append(m.controlnet_blocks[i](o))
        if not m.double_y_emb:
            xi = o
    groups = e["output"]["groups"]
    assert e["keys"] == ["output"] and e["output"]["count"] == n * repeat
    assert [g["positions"] for g in groups] == [
        list(range(i * repeat, (i + 1) * repeat)) for i in range(n)], groups
    for g, o in zip(groups, outs):
        assert torch.equal(g["value"], o)
    return pos


def check_loaded(nodes, torch, log, rec):
    """ControlNetLoader on each file, the log captured at DEBUG level (where
    ComfyUI reports unexpected keys). Returns the records per file."""
    import comfy.controlnet as cn
    import comfy.latent_formats
    logs = {}
    for name, spec in NETS.items():
        del rec.loads[:]
        with fr.debug_log(log) as msgs:
            (c,) = nodes.ControlNetLoader().load_controlnet(name)
        assert not problems(log), problems(log)
        relevant = [m for m in msgs if "controlnet" in m[1]]
        assert relevant == [("WARNING", "missing controlnet keys: {}".format(MISSING[name]))], \
            relevant
        logs[name] = msgs
        assert len(rec.loads) == 1 and rec.loads[0]["control_type"] == spec["control_type"]
        m = c.control_model
        assert type(c) is cn.ControlNetSD35 and type(m).__name__ == "ControlNetEmbedder"
        assert m.double_y_emb == spec["double_y_emb"] and m.main_model_double == MAIN_DOUBLE
        assert len(m.transformer_blocks) == spec["blocks"] == len(m.controlnet_blocks)
        assert m.hidden_size == HIDDEN and m.patch_size == 2
        assert m.transformer_blocks[0].attn.num_heads == DEPTH
        assert c.compression_ratio == 1 and c.upscale_algorithm == "nearest-exact"
        assert type(c.latent_format) is comfy.latent_formats.SD3
        assert (c.latent_format.scale_factor, c.latent_format.shift_factor) == \
            (LATENT_SCALE, LATENT_SHIFT)
        assert c.extra_conds == ["y"] and c.strength_type == cn.StrengthType.CONSTANT
        assert not c.concat_mask and not c.global_average_pooling
        assert c.manual_cast_dtype is None and m.dtype == torch.float32, (c.manual_cast_dtype,
                                                                          m.dtype)
        a = torch.linspace(0, 1, 11)
        want = a * 255 * 0.5 + 0.5 if spec["control_type"] == 1 else a
        assert torch.equal(c.preprocess_image(a), want), name
        sd = m.state_dict()
        keys = controlnet_keys(torch, name)
        ren = {}
        for k, s in keys:
            if k == "control_type":
                continue
            r = k
            for src, dst in RENAMES.items():
                if k.startswith(src):
                    r = dst + k[len(src):]
            ren[r] = (k, s)
        assert set(sd) == set(ren) | set(MISSING[name]), set(sd) ^ (set(ren) | set(MISSING[name]))
        for r, (k, s) in ren.items():
            want = sd1.values(k, s).astype(np.float16).astype(np.float32)
            assert sd[r].dtype == torch.float32 and np.array_equal(sd[r].numpy(), want), k
        print("load", name, "->", type(c).__name__, "/", type(m).__name__,
              "via load_controlnet_sd35; control_type", rec.loads[0]["control_type"],
              "double_y_emb", m.double_y_emb, "blocks", len(m.transformer_blocks),
              "main_model_double", m.main_model_double, "dtype", m.dtype, "latent format",
              type(c.latent_format).__name__, c.latent_format.scale_factor,
              c.latent_format.shift_factor, "compression", c.compression_ratio,
              "upscale", c.upscale_algorithm, "extra_conds", c.extra_conds)
        print("   log at DEBUG during the load:", msgs)
    return logs


def percent_to_sigma(p, shift=SHIFT):
    """ModelSamplingDiscreteFlow.percent_to_sigma, written out."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    t = 1.0 - p
    return shift * t / (1 + (shift - 1) * t)


def check_controls(name, rec, node, vae, torch):
    """Every get_control call: the range rule, the inputs, the hint chain,
    strength scaling; the outermost call per model call is what the MMDiT
    got. Returns (control_calls, the first applied entry)."""
    i = node["inputs"]
    want_range = (percent_to_sigma(i["start_percent"]), percent_to_sigma(i["end_percent"]))
    calls, first = [], None
    for e in rec.controls:
        calls.append([e["strength"], e["sigma"], e["applied"], e["batch"], e["batched_number"]])
        cr.check_range(e, i, want_range)
        if not e["applied"]:
            assert e["forward"] is None and e["result"] is None and e["encode"] is None
            continue
        fwd = e["forward"]
        assert fwd is not None and fwd["model"] == e["model"]
        x, cond = e["x"], e["cond"]
        assert torch.equal(fwd["x"], x), "x = calculate_input(sigma, x) = x (CONST)"
        assert torch.equal(fwd["timesteps"], e["t"] * 1000), "timesteps = sigma * 1000"
        assert torch.equal(fwd["y"], cond["y"]) and fwd["context_shape"] == list(
            cond["c_crossattn"].shape)
        assert fwd["hint"].shape[0] == 1 and list(fwd["hint"].shape[1:]) == [16] + list(
            x.shape[2:]), fwd["hint"].shape
        # The hint chain (made on the first applied call, then cached).
        first = cr.check_hint(name, e, first, vae, "SD3", (LATENT_SCALE, LATENT_SHIFT), torch)
        res = e["result"]
        assert sorted(res) == ["input", "middle", "output"] and res["input"] == [] and \
            res["middle"] == [], sorted(res)
        want = cr.scaled(fwd["output"], e["strength"])
        assert len(res["output"]) == len(want) and all(
            torch.equal(a, b) for a, b in zip(res["output"], want)), name
    assert len(rec.controls) == len(rec.dits), (len(rec.controls), len(rec.dits))
    for e, d in zip(rec.controls, rec.dits):
        assert d["timestep"] == float(e["t"][0] * 1000) and e["batch"] == d["batch"]
        if e["result"] is None:
            assert d["control"] is None
        else:
            assert all(torch.equal(a, b) for a, b in zip(d["control"]["output"],
                                                         e["result"]["output"]))
    assert first is not None, name
    return calls, first


def check_trace(dit, torch):
    """The MMDiT add rule on one traced call."""
    tr, ctl = dit["trace"], dit["control"]["output"]
    n = tr["blocks"]
    for i in range(n):
        x = tr["joint{}_out".format(i)].clone()
        if i < len(ctl) and ctl[i] is not None:
            x += ctl[i]
        nxt = tr["joint{}_in".format(i + 1)] if i + 1 < n else tr["final_in"]
        assert torch.equal(nxt, x), i
    print("   MMDiT add rule checked on the first call with control: joint blocks", n,
          "-> output[0:{}] used of {}".format(min(n, len(ctl)), len(ctl)))


def forward_component(e, fwd):
    out = {"sigma": e["sigma"], "strength": e["strength"], "double_y_emb": fwd["double_y_emb"],
           "inputs": {k: fr.tensor_entry(fwd[k]) for k in ("x", "timesteps", "y", "hint")},
           "context_shape": fwd["context_shape"],
           "block_inputs": [fr.tensor_entry(bx) for bx, _ in fwd["blocks"]],
           "c": fr.tensor_entry(fwd["blocks"][0][1])}
    if fwd.get("pos") is not None:
        out["sincos_pos_embed"] = fr.tensor_entry(fwd["pos"])
    out["output"] = cr.groups_entry(fwd["output"])
    return out


def hint_component(e, image, control_type):
    enc, fwd = e["encode"], e["forward"]
    return {"image_shape": list(image.shape),
            "preprocess": "a * 255 * 0.5 + 0.5" if control_type == 1 else "a",
            "pixels": fr.tensor_entry(enc["pixels"]), "encoded": fr.tensor_entry(enc["latent"]),
            "latent_format": {"scale_factor": LATENT_SCALE, "shift_factor": LATENT_SHIFT},
            "hint": fr.tensor_entry(fwd["hint"])}


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import nodes

    log = ip.LogCapture()
    with fr.comfy_tmp(torch, ["checkpoints", "unet", "clip", "vae", "controlnet"], log) as tmp:
        patch_comfy(tmp, torch)
        cdir = os.path.join(tmp, "controlnet")
        out = {"files": [fr.write_sd35(tmp, nodes, SD3_CKPT, torch, ("sd3", "dit_guidance"),
                                       verbose=not sub)], "workflows": {}, "components": {}}
        for name, spec in NETS.items():
            keys = sorted(controlnet_keys(torch, name))
            digest = write_controlnet(os.path.join(cdir, name), keys, spec["control_type"], torch)
            out["files"].append(fr.file_entry(
                "controlnet", name, keys, digest, alphas={"control_type":
                                                          float(spec["control_type"])},
                kind="sd35_controlnet", control_type=spec["control_type"],
                double_y_emb=spec["double_y_emb"], blocks=spec["blocks"], base=SD3_CKPT))
            if not sub:
                fr.print_file("controlnet", name, keys, digest)
        rec = Record(torch)
        node_ns = fr.node_classes(nodes, v3_nodes())
        if not sub:
            for name in WORKFLOWS:
                fr.write_graph(name, graph_for(name))
            comp = {"controlnet_forward": {}, "hints": {}, "pre_run": {}, "load_log": {}}
            out["components"] = comp
            comp["load_log"] = check_loaded(nodes, torch, log, rec)
            (example,) = nodes.LoadImage().load_image("example.png")[:1]
            vae = nodes.CheckpointLoaderSimple().load_checkpoint(SD3_CKPT)[2]
            assert vae.spacial_compression_encode() == 8
            runs = sd1.spread_runs(__file__)
        for name, cn_name in WORKFLOWS.items():
            prompt = fr.load_graph(name)
            assert prompt == graph_for(name), name
            rec.reset()
            rec.trace = rec.check = not sub
            lat, img = fr.run(name, prompt, node_ns, torch, log, problems)
            if sub:
                out["workflows"][name] = fr.f32_b64(lat)
                continue
            print(name)
            rec.check = False
            assert rec.other_encodes == 0, "the only VAE.encode is the hint's"
            (node,) = [n for n in prompt.values() if n["class_type"] == APPLY[name]]
            calls, first = check_controls(name, rec, node, vae, torch)
            dit_control = [[d["timestep"] / 1000, d["batch"],
                            0 if d["control"] is None else len(d["control"]["output"])]
                           for d in rec.dits]
            cr.print_calls(calls, "MMDiT calls [sigma, batch, output entries]:", dit_control)
            # pre_run: the copy from the main model, once per conditioning
            # holding the net (positive and negative: the same object).
            pres = rec.pre_runs
            assert pres and all(p == pres[0] for p in pres), pres
            p = pres[0]
            assert p["equal"] and p["double_y_emb"] == NETS[cn_name]["double_y_emb"]
            assert p["copied"] == MISSING[cn_name], p["copied"]
            comp["pre_run"][name] = {k: p[k] for k in ("double_y_emb", "source", "copied",
                                                       "equal")}
            print("   pre_run ({} calls) copied".format(len(pres)), p["copied"], "from",
                  p["source"], "equal", p["equal"], "range", p["range"])
            (traced,) = [d for d in rec.dits if "trace" in d]
            assert traced is next(d for d in rec.dits if d["control"] is not None)
            check_trace(traced, torch)
            fwd = first["forward"]
            assert fwd["x"].shape[0] == 2, "cond and uncond batched"
            if name == "tiny_sd35_controlnet_canny":
                image = example
                assert [c[2] for c in calls] == [True, True, True, False], calls
                assert torch.equal(first["hint_parts"]["resized"], example.movedim(-1, 1)), \
                    "64x48: identity"
                assert fwd["pos"] is not None
            else:
                image = cr.want_image_scale(example, torch, 40, 40)
                assert [c[2] for c in calls] == [False, True, True, True], calls
                assert list(first["hint_parts"]["resized"].shape) == [1, 3, 64, 48]
                assert fwd["pos"] is None
            assert torch.equal(first["image"], image.movedim(-1, 1)), name
            comp["controlnet_forward"][name] = forward_component(first, fwd)
            comp["hints"][name] = hint_component(first, image, NETS[cn_name]["control_type"])
            pix = first["encode"]["pixels"]
            print("   forward: x", list(fwd["x"].shape), "hint", list(fwd["hint"].shape),
                  "y", list(fwd["y"].shape), "timesteps", fwd["timesteps"].tolist(),
                  "output count", fwd["output"]["count"], "distinct at",
                  [g["positions"] for g in fwd["output"]["groups"]], "abs max",
                  max(float(g["value"].abs().max()) for g in fwd["output"]["groups"]))
            print("   hint: image", list(image.shape), "-> pixels", list(pix.shape), "range",
                  [float(pix.min()), float(pix.max())], "-> encoded",
                  list(first["encode"]["latent"].shape), "std",
                  float(first["encode"]["latent"].std()), "-> hint std", float(fwd["hint"].std()))
            out["workflows"][name] = cr.workflow_entry(
                name, lat, img, runs, rec, without_control(prompt), node_ns, torch, calls,
                dit_control)
        size = fr.finish("sd3_controlnet", out, sub)
        if size is not None:
            assert size < 2_000_000, size


if __name__ == "__main__":
    main()
