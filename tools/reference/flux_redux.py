"""End-to-end and component references for Flux Redux (a SigLIP vision
encoder plus the Redux style model), as ComfyUI's Flux Redux example uses it.

Two tiny files are built from ComfyUI's own classes, every value from
sd1_pipeline's `values(key, shape)` formula of the key as spelled in the
file, stored f16 (flux_pipeline.write_file):
  clip_vision/tiny_sigclip_vision.safetensors: the key layout of the real
      sigclip_vision_patch14_384.safetensors (HF SiglipVisionModel's
      vision_model.* names, which ComfyUI's CLIPVisionModelProjection for
      model_type "siglip_vision_model" uses as they are): vision_model.
      embeddings.patch_embedding.{weight [64, 3, 14, 14], bias [64]},
      vision_model.embeddings.position_embedding.weight [16, 64],
      vision_model.encoder.layers.{0,1}.{layer_norm1, layer_norm2}.{weight,
      bias} [64], .self_attn.{q,k,v,out}_proj.{weight [64, 64], bias},
      .mlp.fc1.{weight [128, 64], bias}, .mlp.fc2.{weight [64, 128], bias},
      vision_model.post_layernorm.{weight, bias} [64]. No class embedding,
      no pre_layrnorm (SigLIP has neither), no visual_projection, no
      vision_model.head.* (HF's attention-pooling head: ComfyUI's model has
      no such module, it would be dropped unread -- load_state_dict(strict=
      False), unexpected keys not even logged; it is left out here).
      Tiny widths: hidden 64, 1 head (head dim 64; the real 1152 / 16 =
      72: no shape says the head count, so sdkit reads ComfyUI's head
      counts for the real widths and 64-wide heads otherwise), 2 layers
      (real 27), intermediate 128 (real 4304), patch 14 (as the real one),
      image size 64 (real 384): both are the smallest multiple of 16 at
      or above the patch grid's pixels (4 * 14 = 56 -> 64 as 27 * 14 =
      378 -> 384, the rule sdkit reads the size by), so the patch conv
      (stride 14) drops the last pixel rows and columns as with the real
      model, 16 tokens (real 729); and the 64x48 example image is upscaled
      (crop "center": 48x64 -> 64x85) or resized to 64x64 at once (crop
      "none"), both antialias regimes of the resize below.
  style_models/tiny_flux_redux.safetensors: redux_up.{weight [96, 64],
      bias [96]}, redux_down.{weight [32, 96], bias [32]} (real: [12288,
      1152] and [4096, 12288]: 3 x 4096 wide, 4096 = the T5-XXL width Flux
      takes as context): input width = the tiny SigLIP's 64, output width =
      the tiny T5's d_model 32 (flux_pipeline's context_in_dim), hidden 3 x
      32.
The base is flux_pipeline.py's unet/tiny_flux_dev, clip/tiny_t5xxl,
clip/tiny_clip_l and vae/tiny_flux_ae (keys and checksums asserted equal to
tests/reference/flux/expected.json). The workflows graphs/tiny_flux_redux*.
json (written by this script) are run through ComfyUI's own node classes on
the CPU in f32, and tests/reference/flux_redux/expected.json gets:
  files: flux_pipeline's entries (folder, name, keys sorted with shapes,
      scaled {}, checksum_f16) for the four Flux files, then the two new
      files (the same fields; clip_vision: kind "siglip_vision" and config,
      the tiny config ComfyUI is made to use; style_models: kind
      "flux_redux", redux_dim, txt_in_features).
  workflows: per graph as flux's: latent_shape, latent_f32, image_shape,
      image_f32 (base64 little-endian f32), image_range [min, max, std],
      f32_vs_f64_unet_rel, unet_rounding_rel (sd1_pipeline's spread runs);
      without_rel (max |latent - latent of the same graph with every
      StyleModelApply bypassed (its consumers take its conditioning input,
      nodes left unused dropped)| / max |that latent|: Redux matters);
      txt_tokens: per DiT call (Flux.forward_orig) the number of txt
      tokens it got (256 T5 tokens + 16 per applied image).
  components:
    cpu_capability: torch.backends.cpu.get_cpu_capability() of the run (see
        the resize below).
    clip_vision_encode: {graph: {node id: ...}} per CLIPVisionEncode: crop
        ("center" / "none"), source (what the image is), image_shape
        ([B, H, W, C], what the node got), size (the config's image size),
        scale_size ([h, w] of the interpolate), crop_offset ([h, w] of the
        slice), resized ({shape, f32}: F.interpolate's output, before the
        crop), pixel_values ({shape, f32}: exactly what the vision model
        got), last_hidden_state, image_embeds, penultimate_hidden_states,
        all_hidden_states ({shape, f32} each: the ClipVisionOutput fields;
        mm_projected is None, not listed), resize_formula_max_abs (max |the
        documented resize formula - torch's|), pixel_flips (how many
        pixel_values differ when the formula's resize is used instead) and
        tie_margin (min over the cropped resized values strictly inside
        (0, 1) of |255 x - (floor(255 x) + 0.5)| / 255: how far a resize
        may stray before a quantized pixel can change; asserted >
        resize_formula_max_abs where no pixel flipped).
    style_model_apply: {graph: {node id: ...}} per StyleModelApply:
        clip_vision_node (the CLIPVisionEncode it took), strength,
        strength_type, redux_tokens ({shape, f32}: ReduxImageEncoder's
        output for that encode's last_hidden_state, before the strength),
        context_shape_in, context_shape_out (the conditioning's tensor
        before / after the node).

Workflows (the tiny Flux dev: UNETLoader + DualCLIPLoader flux + VAELoader
tiny_flux_ae; CLIPVisionLoader(tiny_sigclip_vision), StyleModelLoader(
tiny_flux_redux), LoadImage example.png (64x48 RGBA -> RGB [1, 48, 64, 3]);
euler / simple, 4 steps, EmptySD3LatentImage 64x48 -> latent [1, 16, 6, 8];
node ids as ComfyUI's Redux example where they play the same part):
  tiny_flux_redux: the Redux example's graph: CLIPTextEncode -> FluxGuidance
      3.0 -> StyleModelApply(CLIPVisionEncode(example.png, crop "center"),
      strength 1.0, "multiply") -> BasicGuider (cfg 1: the positive only),
      ModelSamplingFlux(1.15, 0.5, 64, 48) on the model, RandomNoise,
      KSamplerSelect euler, BasicScheduler simple 4, SamplerCustomAdvanced.
  tiny_flux_redux_nocrop: CLIPTextEncode -> FluxGuidance 3.0 ->
      StyleModelApply(CLIPVisionEncode(example.png, crop "none"), 0.6) ->
      StyleModelApply(CLIPVisionEncode(ImageInvert(example.png), "none"),
      1.25) (the conditioning grows twice: 256 -> 272 -> 288 tokens);
      KSampler cfg 1.0, negative ConditioningZeroOut of the encode (skipped
      at cfg 1).

How ComfyUI does it (asserted here where observable):
  * CLIPVisionLoader -> comfy.clip_vision.load -> load_clipvision_from_sd
      (no "visual.transformer..." key: no conversion): the config JSON by
      key detection: vision_model.encoder.layers.22.layer_norm1.weight
      present, layers.0.layer_norm1.weight 1152 wide and 729 position
      embeddings -> comfy/clip_vision_siglip_384.json (hidden 1152, 16
      heads, 27 layers, intermediate 4304, patch 14, image 384,
      gelu_pytorch_tanh, image_mean = image_std = [0.5, 0.5, 0.5]).
      ClipVisionModel: CLIPVisionModelProjection (comfy/clip_model.py),
      weights in text_encoder_dtype (f16 on the CPU) with manual_cast ops
      (computed in f32: every weight cast to the input's f32; the post
      layernorm, built without a dtype, holds f32 copies), eval;
      return_all_hidden_states True for siglip; load_state_dict(strict=
      False), "missing clip vision: [...]" warned if any (none).
  * CLIPVisionEncode(crop): encode_image(image, crop = (crop == "center")):
      pixel_values = clip_preprocess(image, size = image_size, mean, std,
      crop).float():
        image[..., :3] (RGBA -> RGB), movedim to [B, 3, H, W]; unless H ==
        W == size: crop: scale = size / min(H, W) (Python float), scale_size
        = (round(scale * H), round(scale * W)) (Python round, half to
        even); no crop: (size, size); F.interpolate(mode="bicubic",
        antialias=True) to scale_size (align_corners False, no scale
        factor); then the slice [h : h + size, w : w + size], h = (H' -
        size) // 2, w = (W' - size) // 2 (a no-op for crop "none"); then
        torch.clip(255 * x, 0, 255).round() / 255 (torch.round: half to
        even) and (x - mean) / std per channel (f32 tensors; 0.5 here, so
        2 q - 1 up to rounding: the values are exactly k / 255 * 2 - 1
        computed as (k / 255 - 0.5) / 0.5 in f32).
      The resize (ATen CPU, f32, separable): the width pass first (skipped
        when the width is unchanged), then the height pass; per axis of in
        -> out: scale = f32(in) / f32(out); support = 2 * scale if scale >=
        1 else 2 (f32); invscale = f32(1 / scale) if scale >= 1 else 1;
        for output i: center = f32(scale * (i + 0.5)); xmin = max(trunc(
        center - support + 0.5), 0); xmax = min(trunc(center + support +
        0.5), in); w_j = K(f32((f32(xmin + j) - center + 0.5) * invscale))
        for j < xmax - xmin (the + 0.5 and * in f64, the rest f32); K the
        Keys cubic with a = -0.5 (NOT the -0.75 of the plain bicubic):
        |x| < 1: ((a + 2)|x| - (a + 3)) x^2 + 1, |x| < 2: ((a|x| - 5a)|x| +
        8a)|x| - 4a, else 0, each op rounded to f32; the w_j divided by
        their f32 sum (taps outside the image never exist: renormalised at
        the borders); out_i = w_0 in[xmin] + w_1 in[xmin + 1] + ... in f32,
        left to right. That is bit-exact against ATen's DEFAULT-capability
        kernel (ATEN_CPU_CAPABILITY=default); the AVX2 / AVX512 builds of
        the same kernel (what a normal x86 run uses, this one included: see
        cpu_capability) let the compiler fuse multiply-adds (FMA) in K and
        in some of the accumulations: weights then differ by up to 1 ulp
        and the resized values by ~1e-6; after the 1/255 quantization that
        flips a rare value by one step (resize_formula_max_abs and
        pixel_flips per encode, asserted <= 4e-6 and <= 0.1 %).
      The model (CLIPVisionModelProjection -> CLIPVision, model_type
        siglip_vision_model): embeddings = patch_embedding (Conv2d 3 -> W,
        kernel = stride = 14, WITH bias; the last size % 14 rows / columns
        never read) -> flatten(2).transpose(1, 2) (tokens row-major) +
        position_embedding.weight (one row per patch, no class token, no
        pre-layernorm); the encoder: per layer x += self_attn(layer_norm1(
        x)); x += mlp(layer_norm2(x)) (LayerNorm eps 1e-5 -- torch's
        default, not SigLIP's 1e-6 --; attention: q, k, v, out projections
        with bias, heads split, softmax(q k^T * d^-0.5) v (attention_basic
        here: optimized_attention_for_device(small_input=True) without
        PyTorch attention enabled), no mask; mlp fc1 -> gelu(tanh) ->
        fc2); then post_layernorm.
      The outputs (ClipVisionOutput): last_hidden_state = post_layernorm(
        the last layer's output) [B, 16, W] (asserted: the recorded
        all_hidden_states[:, -1] through the model's post_layernorm);
        image_embeds = the same tensor (pooled_output is x itself for
        siglip, visual_projection is the identity without projection_dim:
        no attention-pooling head as in HF's pooler_output);
        all_hidden_states [B, layers, 16, W]: every layer's output (not
        the embeddings, no layernorm); penultimate_hidden_states =
        all_hidden_states[:, -2] (the output of layer layers - 2, no
        layernorm); mm_projected None. Asserted by re-running the model's
        own modules step by step (bitwise) and an f64 NumPy forward from
        the file's values (relative error below 1e-5).
  * StyleModelLoader -> comfy.sd.load_style_model: "redux_down.weight" in
      the keys -> comfy.ldm.flux.redux.ReduxImageEncoder() (its defaults:
      redux_dim 1152, txt_in_features 4096), load_state_dict (strict: the
      shapes must fit), f32 parameters (built without a dtype; manual_cast
      Linear); wrapped in StyleModel, whose get_cond(clip_vision_output)
      = model(clip_vision_output.last_hidden_state) = redux_down(silu(
      redux_up(x))) [B, 16, txt width] (asserted bitwise with the
      modules, and against f64 NumPy).
  * StyleModelApply(conditioning, style_model, clip_vision_output, strength,
      "multiply"): cond = get_cond(...).flatten(0, 1).unsqueeze(0) (a batch
      of B images becomes ONE row of B x 16 tokens, asserted on a batch of
      the nocrop graph's two encodes), cond *= strength (in place, f32 by
      the Python float), then per conditioning entry [cat((txt, cond),
      dim 1), a copy of its dict] (the tokens appended after the text
      tokens; guidance and pooled_output carried over; no attention_mask
      made for "multiply" unless one exists). The DiT sees the longer
      context (txt_ids all zero as for the text tokens).

ComfyUI only recognises full-size files. Relaxed as in flux_pipeline.py
(fp.patch_comfy), and for the two new files, nothing else:
  * load_clipvision_from_sd's detection constants: the code object's
      constants 'vision_model.encoder.layers.22.layer_norm1.weight', 1152
      and 729 are replaced by '...layers.1...' (the last layer of the tiny
      model), 64 and 16 (the exact constant tuple is asserted first; the
      bytecode is ComfyUI's): the tiny file takes ComfyUI's own siglip_384
      branch.
  * ClipVisionModel.__init__: a json_config named clip_vision_siglip_384.
      json (its content asserted first) is swapped for a file holding the
      same keys with the tiny values (hidden_size 64, num_attention_heads
      1, num_hidden_layers 2, intermediate_size 128, image_size 64;
      num_channels, hidden_act, model_type, patch_size 14, image_mean and
      image_std as the real one).
  * ReduxImageEncoder.__init__.__defaults__: (1152, 4096, None, None)
      (asserted) -> (64, 32, None, None): load_style_model builds it with
      no arguments.

    COMFY_DIR=/work/comfyfull /work/venv-ref/bin/python tools/reference/flux_redux.py
(media-only imports are stubbed as in sd1_pipeline.py; the flux fixtures are
not rewritten; the graphs are written by the main run; model folders,
fixture checks, the graphs' loader and save nodes, the DEBUG log capture,
workflow runs, spreads and per-workflow fields (without_rel included) are
fixture_runs.py's.)
"""
import json
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

FILES = ["tiny_flux_dev.safetensors", "tiny_t5xxl.safetensors", "tiny_clip_l.safetensors",
         "tiny_flux_ae.safetensors"]
VISION = "tiny_sigclip_vision.safetensors"
REDUX = "tiny_flux_redux.safetensors"
WORKFLOWS = ["tiny_flux_redux", "tiny_flux_redux_nocrop"]

# ComfyUI's comfy/clip_vision_siglip_384.json, asserted before it is swapped.
SIGLIP_384 = {"num_channels": 3, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
              "image_size": 384, "intermediate_size": 4304, "model_type": "siglip_vision_model",
              "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
SIGLIP = dict(SIGLIP_384, hidden_size=64, num_attention_heads=1, num_hidden_layers=2,
              intermediate_size=128, image_size=64)
WIDTH, HEADS, LAYERS = SIGLIP["hidden_size"], SIGLIP["num_attention_heads"], \
    SIGLIP["num_hidden_layers"]
SIZE, PATCH, FFN = SIGLIP["image_size"], SIGLIP["patch_size"], SIGLIP["intermediate_size"]
GRID = SIZE // PATCH
TOKENS = GRID * GRID
TXT = fp.T5["d_model"]
assert TXT == fp.FLUX["context_in_dim"]
T5_TOKENS = 256
LN_EPS = 1e-5
# load_clipvision_from_sd's constants; the three relaxed ones are replaced.
DETECT_CONSTS = (
    None, 'vision_model.encoder.layers.47.layer_norm1.weight', 'clip_vision_config_g.json',
    'vision_model.encoder.layers.30.layer_norm1.weight', 'clip_vision_config_h.json',
    'vision_model.encoder.layers.22.layer_norm1.weight',
    'vision_model.embeddings.position_embedding.weight', 0,
    'vision_model.encoder.layers.0.layer_norm1.weight', 1152, 729, 'clip_vision_siglip_384.json',
    1024, 'clip_vision_siglip_512.json', 577, 'multi_modal_projector.linear_1.bias',
    'clip_vision_config_vitl_336_llava.json', 'clip_vision_config_vitl_336.json',
    'clip_vision_config_vitl.json', 'encoder.layer.39.layer_scale2.lambda1', 'image_encoders',
    'dino2_giant.json', 'encoder.layer.23.layer_scale2.lambda1', 'dino2_large.json',
    'missing clip vision: {}')
DETECT_TINY = {'vision_model.encoder.layers.22.layer_norm1.weight':
               'vision_model.encoder.layers.{}.layer_norm1.weight'.format(LAYERS - 1),
               1152: WIDTH, 729: TOKENS}
REDUX_DEFAULTS = (1152, 4096, None, None)
PROBLEMS = ("missing clip vision", "clip vision", "invalid style model", "leftover keys",
            "ERROR")

PROMPT = ("a (watercolor:1.2) painting of a lighthouse on a rocky coast at dawn, [pastel "
          "sky], gentle waves, ((soft morning light)), seabirds")
NOCROP_PROMPT = ("a cozy reading nook by a rainy window, stacked books, a (steaming:1.1) cup "
                 "of tea, warm lamp light, [film grain]")


def graph_for(name):
    """The API prompt of workflow `name` (node ids as in ComfyUI's Redux
    example / graphs/tiny_flux_custom.json where they play the same part)."""
    g = fr.flux_loaders()
    g.update({
        "38": {"class_type": "CLIPVisionLoader", "inputs": {"clip_name": VISION}},
        "42": {"class_type": "StyleModelLoader", "inputs": {"style_model_name": REDUX}},
        "40": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
    })
    if name == "tiny_flux_redux":
        g.update({
            "30": {"class_type": "ModelSamplingFlux", "inputs": {
                "model": ["1", 0], "max_shift": 1.15, "base_shift": 0.5, "width": 64,
                "height": 48}},
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": PROMPT}},
            "4": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["3", 0],
                                                           "guidance": 3.0}},
            "39": {"class_type": "CLIPVisionEncode", "inputs": {
                "clip_vision": ["38", 0], "image": ["40", 0], "crop": "center"}},
            "41": {"class_type": "StyleModelApply", "inputs": {
                "conditioning": ["4", 0], "style_model": ["42", 0],
                "clip_vision_output": ["39", 0], "strength": 1.0,
                "strength_type": "multiply"}},
            "22": {"class_type": "BasicGuider", "inputs": {"model": ["30", 0],
                                                           "conditioning": ["41", 0]}},
            "25": {"class_type": "RandomNoise", "inputs": {"noise_seed": 515151}},
            "16": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
            "17": {"class_type": "BasicScheduler", "inputs": {
                "model": ["30", 0], "scheduler": "simple", "steps": 4, "denoise": 1.0}},
            "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 48,
                                                                  "batch_size": 1}},
            "7": {"class_type": "SamplerCustomAdvanced", "inputs": {
                "noise": ["25", 0], "guider": ["22", 0], "sampler": ["16", 0],
                "sigmas": ["17", 0], "latent_image": ["6", 0]}},
        })
    else:
        g.update({
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0],
                                                             "text": NOCROP_PROMPT}},
            "4": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["3", 0],
                                                           "guidance": 3.0}},
            "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["3", 0]}},
            "39": {"class_type": "CLIPVisionEncode", "inputs": {
                "clip_vision": ["38", 0], "image": ["40", 0], "crop": "none"}},
            "11": {"class_type": "ImageInvert", "inputs": {"image": ["40", 0]}},
            "43": {"class_type": "CLIPVisionEncode", "inputs": {
                "clip_vision": ["38", 0], "image": ["11", 0], "crop": "none"}},
            "41": {"class_type": "StyleModelApply", "inputs": {
                "conditioning": ["4", 0], "style_model": ["42", 0],
                "clip_vision_output": ["39", 0], "strength": 0.6,
                "strength_type": "multiply"}},
            "44": {"class_type": "StyleModelApply", "inputs": {
                "conditioning": ["41", 0], "style_model": ["42", 0],
                "clip_vision_output": ["43", 0], "strength": 1.25,
                "strength_type": "multiply"}},
            "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 48,
                                                                  "batch_size": 1}},
            "7": {"class_type": "KSampler", "inputs": {
                "model": ["1", 0], "positive": ["44", 0], "negative": ["5", 0],
                "latent_image": ["6", 0], "seed": 626262, "steps": 4, "cfg": 1.0,
                "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        })
    g.update(fr.save_nodes(name, ["13", 0]))
    return g


def without_redux(prompt):
    """The graph with every StyleModelApply bypassed (consumers take its
    conditioning input) and the nodes no output needs any more dropped."""
    apply = {nid for nid, n in prompt.items() if n["class_type"] == "StyleModelApply"}

    def source(ref):
        while ref[0] in apply:
            ref = prompt[ref[0]]["inputs"]["conditioning"]
        return ref
    g = {nid: dict(n, inputs={k: source(v) if isinstance(v, list) else v
                              for k, v in n["inputs"].items()})
         for nid, n in prompt.items() if nid not in apply}
    needed = set()

    def need(nid):
        if nid in needed:
            return
        needed.add(nid)
        for v in g[nid]["inputs"].values():
            if isinstance(v, list):
                need(v[0])
    for nid, n in g.items():
        if n["class_type"] in ("SaveImage", "SaveLatent"):
            need(nid)
    g = {nid: n for nid, n in g.items() if nid in needed}
    assert not [n for n in g.values() if n["class_type"] in (
        "StyleModelApply", "CLIPVisionEncode", "CLIPVisionLoader", "StyleModelLoader")]
    return g


# --- relaxations and files -------------------------------------------------

def patch_comfy(tmp, torch):
    """The three relaxations of the docstring (flux_pipeline's are
    fr.comfy_tmp's)."""
    import comfy.clip_vision as cv
    import comfy.ldm.flux.redux as rx
    code = cv.load_clipvision_from_sd.__code__
    plain = tuple(c for c in code.co_consts if not isinstance(c, types.CodeType))
    assert plain == DETECT_CONSTS, plain
    consts = tuple(DETECT_TINY.get(c, c) if type(c) in (int, str) else c
                   for c in code.co_consts)
    assert sum(a != b for a, b in zip(consts, code.co_consts)) == len(DETECT_TINY)
    cv.load_clipvision_from_sd.__code__ = code.replace(co_consts=consts)

    cfg = os.path.join(tmp, "tiny_clip_vision_siglip.json")
    with open(cfg, "w") as f:
        json.dump(SIGLIP, f)
    init = cv.ClipVisionModel.__init__

    def tiny_init(self, json_config):
        if os.path.basename(json_config) == "clip_vision_siglip_384.json":
            with open(json_config) as f:
                assert json.load(f) == SIGLIP_384
            json_config = cfg
        init(self, json_config)
    cv.ClipVisionModel.__init__ = tiny_init

    enc = rx.ReduxImageEncoder.__init__
    assert enc.__defaults__ == REDUX_DEFAULTS, enc.__defaults__
    enc.__defaults__ = (WIDTH, TXT, None, None)


def vision_keys(torch):
    """CLIPVisionModelProjection's state dict keys for the tiny config,
    checked against the HF SiglipVisionModel layout the docstring lists."""
    import comfy.clip_model
    import comfy.ops
    m = comfy.clip_model.CLIPVisionModelProjection(dict(SIGLIP), torch.float32, "meta",
                                                   comfy.ops.disable_weight_init)
    keys = [(k, list(t.shape)) for k, t in m.state_dict().items()]
    p = "vision_model."
    want = {p + "embeddings.patch_embedding.weight": [WIDTH, 3, PATCH, PATCH],
            p + "embeddings.patch_embedding.bias": [WIDTH],
            p + "embeddings.position_embedding.weight": [TOKENS, WIDTH],
            p + "post_layernorm.weight": [WIDTH], p + "post_layernorm.bias": [WIDTH]}
    for i in range(LAYERS):
        q = p + "encoder.layers.{}.".format(i)
        for n in ("layer_norm1", "layer_norm2"):
            want[q + n + ".weight"] = [WIDTH]
            want[q + n + ".bias"] = [WIDTH]
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            want[q + "self_attn." + n + ".weight"] = [WIDTH, WIDTH]
            want[q + "self_attn." + n + ".bias"] = [WIDTH]
        want.update({q + "mlp.fc1.weight": [FFN, WIDTH], q + "mlp.fc1.bias": [FFN],
                     q + "mlp.fc2.weight": [WIDTH, FFN], q + "mlp.fc2.bias": [WIDTH]})
    got = dict(keys)
    assert len(got) == len(keys) and got == want, sorted(set(got) ^ set(want))
    return keys


def redux_keys(torch):
    import comfy.ldm.flux.redux as rx
    m = rx.ReduxImageEncoder(WIDTH, TXT, device="meta")
    keys = [(k, list(t.shape)) for k, t in m.state_dict().items()]
    want = {"redux_up.weight": [3 * TXT, WIDTH], "redux_up.bias": [3 * TXT],
            "redux_down.weight": [TXT, 3 * TXT], "redux_down.bias": [TXT]}
    assert dict(keys) == want and len(keys) == 4, keys
    return keys


def file_values(keys):
    """{key: f64 array} of the file's f16 values."""
    return {k: sd1.values(k, s).astype(np.float16).astype(np.float64) for k, s in keys}


def problems(log):
    """ff.unet_warnings plus any record about the vision / style model."""
    return ff.unet_warnings(log) + [m for _, m in log.records if any(p in m for p in PROBLEMS)]


# --- recording -------------------------------------------------------------

class Record:
    """Every clip_preprocess call (its input and output); every
    ClipVisionModel.encode_image call (image, crop, the ClipVisionOutput
    fields, the embeddings output); every ReduxImageEncoder.forward (input,
    output before StyleModelApply scales it in place); every
    StyleModelApply.apply_stylemodel (conditioning in and out); every Flux
    DiT call's txt length."""
    def __init__(self, torch):
        import comfy.clip_vision as cv
        import comfy.ldm.flux.model as fm
        import comfy.ldm.flux.redux as rx
        import nodes
        self.reset()
        rec = self

        pre = cv.clip_preprocess

        def pre_wrap(image, **kwargs):
            out = pre(image, **kwargs)
            rec.preprocess.append(dict(kwargs, image=image.clone(), out=out.clone()))
            return out
        cv.clip_preprocess = pre_wrap

        encode = cv.ClipVisionModel.encode_image

        def enc_wrap(self, image, crop=True):
            n = len(rec.preprocess)
            embs = []
            hook = self.model.vision_model.embeddings.register_forward_hook(
                lambda mod, args, out: embs.append(out.clone()))
            try:
                out = encode(self, image, crop=crop)
            finally:
                hook.remove()
            (p,) = rec.preprocess[n:]
            rec.encodes.append({"model": self, "image": image.clone(), "crop": crop, "pre": p,
                                "embeddings": embs, "fields": sorted(vars(out)),
                                "out": {k: (None if v is None else v.clone())
                                        for k, v in vars(out).items()},
                                "same_embeds": out["image_embeds"] is out["last_hidden_state"]})
            return out
        cv.ClipVisionModel.encode_image = enc_wrap

        forward = rx.ReduxImageEncoder.forward

        def redux_wrap(self, x):
            out = forward(self, x)
            rec.redux.append({"model": self, "x": x.clone(), "out": out.clone()})
            return out
        rx.ReduxImageEncoder.forward = redux_wrap

        apply = nodes.StyleModelApply.apply_stylemodel

        def apply_wrap(self, conditioning, style_model, clip_vision_output, strength,
                       strength_type):
            n = len(rec.redux)
            cin = [(t.clone(), dict(k)) for t, k in conditioning]
            (out,) = apply(self, conditioning, style_model, clip_vision_output, strength,
                           strength_type)
            rec.applies.append({"in": cin, "out": [(t.clone(), dict(k)) for t, k in out],
                                "strength": strength, "strength_type": strength_type,
                                "cvo": clip_vision_output, "redux": rec.redux[n:],
                                "style_model": style_model})
            return (out,)
        nodes.StyleModelApply.apply_stylemodel = apply_wrap

        orig = fm.Flux.forward_orig

        def orig_wrap(self, img, img_ids, txt, txt_ids, *args, **kwargs):
            rec.dits.append({"txt_len": int(txt.shape[1]),
                             "txt_ids_zero": bool((txt_ids == 0).all())})
            return orig(self, img, img_ids, txt, txt_ids, *args, **kwargs)
        fm.Flux.forward_orig = orig_wrap

    def reset(self):
        self.preprocess, self.encodes, self.redux, self.applies, self.dits = [], [], [], [], []


# --- the documented formulas ------------------------------------------------

def aa_axis(n_in, n_out):
    """Per output index (xmin, f32 weights) of the antialiased bicubic
    resize along one axis, as the docstring writes it (ATen's DEFAULT
    kernel)."""
    f32, f64 = np.float32, np.float64
    scale = f32(n_in) / f32(n_out)
    support = f32(2.0 * f64(scale)) if scale >= 1.0 else f32(2.0)
    max_interp = int(math.ceil(support)) * 2 + 1
    invscale = f32(1.0 / f64(scale)) if scale >= 1.0 else f32(1.0)
    a = f32(-0.5)

    def keys_cubic(x):
        x = f32(abs(x))
        if x < 1.0:
            return f32(f32(f32(f32(f32(a + f32(2)) * x) - f32(a + f32(3))) * x) * x) + f32(1)
        if x < 2.0:
            t = f32(f32(a * x) - f32(f32(5) * a))
            t = f32(f32(t * x) + f32(f32(8) * a))
            return f32(f32(t * x) - f32(f32(4) * a))
        return f32(0)
    out = []
    for i in range(n_out):
        center = f32(f64(scale) * (i + 0.5))
        xmin = max(int(f64(f32(center - support)) + 0.5), 0)
        xsize = min(int(f64(f32(center + support)) + 0.5), n_in) - xmin
        xsize = min(max(xsize, 0), max_interp)
        ws, total = [], f32(0)
        for j in range(xsize):
            d = f32(f32(j + xmin) - center)
            w = keys_cubic(f32((f64(d) + 0.5) * f64(invscale)))
            ws.append(w)
            total = f32(total + w)
        if total != 0:
            ws = [f32(w / total) for w in ws]
        out.append((xmin, ws))
    return out


def aa_resize(x, h, w):
    """x [B, C, H, W] f32 numpy -> [B, C, h, w]: the width pass, then the
    height pass, each skipped when its size stays."""
    def one(a, axis, n):
        a = np.moveaxis(a, axis, -1)
        o = np.zeros(a.shape[:-1] + (n,), np.float32)
        for i, (xmin, ws) in enumerate(aa_axis(a.shape[-1], n)):
            t = a[..., xmin] * ws[0]
            for j in range(1, len(ws)):
                t = t + a[..., xmin + j] * ws[j]
            o[..., i] = t
        return np.moveaxis(o, -1, axis)
    x = np.asarray(x, np.float32)
    if x.shape[3] != w:
        x = one(x, 3, w)
    if x.shape[2] != h:
        x = one(x, 2, h)
    return x


def quantize_normalize(x, torch):
    """clip_preprocess after the resize, with its own ops."""
    q = torch.clip(255. * x, 0, 255).round() / 255.0
    mean = torch.tensor(SIGLIP["image_mean"], dtype=x.dtype)
    std = torch.tensor(SIGLIP["image_std"], dtype=x.dtype)
    return (q - mean.view([3, 1, 1])) / std.view([3, 1, 1])


def layer_norm(x, w, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + LN_EPS) * w + b


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def siglip_f64(pix, W):
    """The docstring's SigLIP forward in f64 from the file's values W.
    Returns (last_hidden_state, [each layer's output])."""
    p = "vision_model."
    b, c = pix.shape[:2]
    x = pix[:, :, :GRID * PATCH, :GRID * PATCH].reshape(b, c, GRID, PATCH, GRID, PATCH)
    x = x.transpose(0, 2, 4, 1, 3, 5).reshape(b, TOKENS, c * PATCH * PATCH)
    conv = W[p + "embeddings.patch_embedding.weight"].reshape(WIDTH, -1)
    x = x @ conv.T + W[p + "embeddings.patch_embedding.bias"]
    x = x + W[p + "embeddings.position_embedding.weight"]
    layers = []
    hd = WIDTH // HEADS
    for i in range(LAYERS):
        q = p + "encoder.layers.{}.".format(i)

        def lin(v, n):
            return v @ W[q + n + ".weight"].T + W[q + n + ".bias"]
        h = layer_norm(x, W[q + "layer_norm1.weight"], W[q + "layer_norm1.bias"])
        qq, kk, vv = (lin(h, "self_attn." + n).reshape(b, TOKENS, HEADS, hd).transpose(0, 2, 1, 3)
                      for n in ("q_proj", "k_proj", "v_proj"))
        s = qq @ kk.transpose(0, 1, 3, 2) * hd ** -0.5
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = (s @ vv).transpose(0, 2, 1, 3).reshape(b, TOKENS, WIDTH)
        x = x + lin(o, "self_attn.out_proj")
        h = layer_norm(x, W[q + "layer_norm2.weight"], W[q + "layer_norm2.bias"])
        x = x + lin(gelu_tanh(lin(h, "mlp.fc1")), "mlp.fc2")
        layers.append(x)
    last = layer_norm(x, W[p + "post_layernorm.weight"], W[p + "post_layernorm.bias"])
    return last, layers


def redux_f64(x, R):
    u = x @ R["redux_up.weight"].T + R["redux_up.bias"]
    u = u / (1 + np.exp(-u))
    return u @ R["redux_down.weight"].T + R["redux_down.bias"]


def rel64(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# --- checks ----------------------------------------------------------------

def check_loaded(nodes, torch, log, vkeys, rkeys):
    """CLIPVisionLoader and StyleModelLoader on the files, the log captured
    at DEBUG level; the loaded values are the file's. Returns (clip vision,
    style model)."""
    import comfy.clip_model
    import comfy.clip_vision as cv
    import comfy.ldm.flux.redux as rx
    import comfy.sd
    with fr.debug_log(log) as msgs:
        (clip_vision,) = nodes.CLIPVisionLoader().load_clip(VISION)
        (style,) = nodes.StyleModelLoader().load_style_model(REDUX)
    assert not problems(log), problems(log)
    assert type(clip_vision) is cv.ClipVisionModel
    m = clip_vision.model
    assert type(m) is comfy.clip_model.CLIPVisionModelProjection
    assert clip_vision.image_size == SIZE and clip_vision.return_all_hidden_states
    assert clip_vision.image_mean == SIGLIP["image_mean"] and \
        clip_vision.image_std == SIGLIP["image_std"]
    vm = m.vision_model
    assert vm.embeddings.class_embedding is None and vm.output_layernorm
    assert vm.embeddings.patch_embedding.bias is not None
    assert vm.embeddings.patch_embedding.stride == (PATCH, PATCH)
    assert not isinstance(vm.pre_layrnorm, torch.nn.Module), "identity lambda"
    assert not isinstance(m.visual_projection, torch.nn.Module), "identity lambda"
    assert m.multi_modal_projector is None
    assert len(vm.encoder.layers) == LAYERS
    assert all(isinstance(mod, torch.nn.LayerNorm) and mod.eps == LN_EPS
               for mod in vm.modules() if isinstance(mod, torch.nn.LayerNorm))
    sd = m.state_dict()
    assert set(sd) == {k for k, _ in vkeys}, set(sd) ^ {k for k, _ in vkeys}
    for k, shape in vkeys:
        want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
        assert np.array_equal(sd[k].float().numpy(), want), k
    dtypes = sorted({str(t.dtype) for t in sd.values()})
    r = style.model
    assert type(style) is comfy.sd.StyleModel and type(r) is rx.ReduxImageEncoder
    assert r.redux_dim == WIDTH
    rsd = r.state_dict()
    assert set(rsd) == {k for k, _ in rkeys}
    for k, shape in rkeys:
        want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
        assert rsd[k].dtype == torch.float32 and np.array_equal(rsd[k].numpy(), want), k
    print("load", VISION, "->", type(clip_vision).__name__, "/", type(m).__name__,
          "image_size", clip_vision.image_size, "mean/std", clip_vision.image_mean,
          clip_vision.image_std, "weights", dtypes, "layers", len(vm.encoder.layers),
          "tensors", len(sd), "= file keys, every value its f16 value")
    print("load", REDUX, "->", type(style).__name__, "/", type(r).__name__, "redux_dim",
          r.redux_dim, "up", list(r.redux_up.weight.shape), "down",
          list(r.redux_down.weight.shape), "f32")
    print("   log at DEBUG during the loads:", msgs)
    return clip_vision, style


def check_encode(e, image, crop, clip_vision, W, torch):
    """One CLIPVisionEncode against the docstring. Returns its component
    entry."""
    import comfy.ldm.modules.attention as attn
    p = e["pre"]
    assert e["crop"] == crop and e["model"] is clip_vision
    assert p["size"] == SIZE and p["crop"] == crop
    assert list(p["mean"]) == SIGLIP["image_mean"] and list(p["std"]) == SIGLIP["image_std"]
    assert torch.equal(p["image"], image) and torch.equal(e["image"], image)
    x = image[:, :, :, :3].movedim(-1, 1)
    h, w = x.shape[2], x.shape[3]
    if crop:
        scale = SIZE / min(h, w)
        scale_size = (round(scale * h), round(scale * w))
    else:
        scale_size = (SIZE, SIZE)
    resized = torch.nn.functional.interpolate(x, size=scale_size, mode="bicubic",
                                              antialias=True)
    oh, ow = (resized.shape[2] - SIZE) // 2, (resized.shape[3] - SIZE) // 2
    pix = quantize_normalize(resized[:, :, oh:oh + SIZE, ow:ow + SIZE], torch)
    assert torch.equal(p["out"], pix), "clip_preprocess as documented"
    q = (pix.numpy() + 1) / 2 * 255
    assert np.abs(q - np.round(q)).max() < 1e-3, "quantized to k / 255"
    formula = aa_resize(x.numpy(), *scale_size)
    dmax = float(np.abs(formula - resized.numpy()).max())
    fpix = quantize_normalize(torch.from_numpy(formula)[:, :, oh:oh + SIZE, ow:ow + SIZE], torch)
    flips = int((fpix != pix).sum())
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        assert dmax == 0.0 and flips == 0, (dmax, flips)
    assert dmax <= 4e-6 and flips <= pix.numel() // 1000, (dmax, flips)

    out = e["out"]
    assert e["fields"] == ["all_hidden_states", "image_embeds", "last_hidden_state",
                           "mm_projected", "penultimate_hidden_states"], e["fields"]
    assert out["mm_projected"] is None and e["same_embeds"]
    last, hs = out["last_hidden_state"], out["all_hidden_states"]
    assert list(last.shape) == [1, TOKENS, WIDTH] and list(hs.shape) == [1, LAYERS, TOKENS, WIDTH]
    assert last.dtype == torch.float32 and hs.dtype == torch.float32
    assert torch.equal(out["image_embeds"], last)
    assert torch.equal(out["penultimate_hidden_states"], hs[:, -2])
    # The model's own modules, step by step.
    vm = clip_vision.model.vision_model
    emb = vm.embeddings.patch_embedding(pix).flatten(2).transpose(1, 2)
    emb = emb + vm.embeddings.position_embedding.weight.to(emb.dtype)
    (got_emb,) = e["embeddings"]
    assert torch.equal(got_emb, emb), "patch conv + position embedding, no class token"
    oa = attn.optimized_attention_for_device(emb.device, mask=False, small_input=True)
    xs = emb.clone()
    for i, layer in enumerate(vm.encoder.layers):
        xs = layer(xs.clone(), None, oa)
        assert torch.equal(xs, hs[:, i]), ("layer", i)
    assert torch.equal(vm.post_layernorm(hs[:, -1]), last), "last = post_layernorm(last layer)"
    # An independent f64 forward from the file's values.
    ref_last, ref_layers = siglip_f64(pix.double().numpy(), W)
    r_last = rel64(last.numpy(), ref_last)
    r_layers = [rel64(hs[:, i].numpy(), ref_layers[i]) for i in range(LAYERS)]
    assert r_last < 1e-5 and max(r_layers) < 1e-5, (r_last, r_layers)
    entry = {"crop": "center" if crop else "none", "image_shape": list(image.shape),
             "size": SIZE, "scale_size": list(scale_size), "crop_offset": [oh, ow],
             "resized": fr.tensor_entry(resized), "pixel_values": fr.tensor_entry(pix)}
    for k in ("last_hidden_state", "image_embeds", "penultimate_hidden_states",
              "all_hidden_states"):
        entry[k] = fr.tensor_entry(out[k])
    entry["resize_formula_max_abs"] = dmax
    entry["pixel_flips"] = flips
    crop_r = resized[:, :, oh:oh + SIZE, ow:ow + SIZE].double().numpy() * 255
    frac = crop_r - np.floor(crop_r)
    inside = (crop_r > 0) & (crop_r < 255)
    entry["tie_margin"] = float((np.abs(frac - 0.5)[inside]).min() / 255)
    assert flips > 0 or entry["tie_margin"] > dmax, (entry["tie_margin"], dmax)
    print("   CLIPVisionEncode crop", entry["crop"], "image", list(image.shape), "->",
          "interpolate", list(resized.shape[2:]), "crop at", [oh, ow], "-> pixels",
          list(pix.shape), "range", [float(pix.min()), float(pix.max())], "| formula resize",
          "max abs", dmax, "pixel flips", flips, "tie margin", entry["tie_margin"],
          "| last_hidden_state", list(last.shape), "std",
          float(last.std()), "all", list(hs.shape), "| f64 rel last", r_last, "layers", r_layers)
    return entry


def check_apply(a, enc, style, R, torch):
    """One StyleModelApply against the docstring. Returns (its component
    entry without the node ids, the redux tokens)."""
    (rd,) = a["redux"]
    assert rd["model"] is style.model
    last = enc["out"]["last_hidden_state"]
    assert torch.equal(rd["x"], last), "get_cond = model(last_hidden_state)"
    m = style.model
    tok = m.redux_down(torch.nn.functional.silu(m.redux_up(last)))
    assert torch.equal(rd["out"], tok), "redux_down(silu(redux_up(x)))"
    r = rel64(tok.numpy(), redux_f64(last.double().numpy(), R))
    assert r < 1e-5, r
    assert list(tok.shape) == [1, TOKENS, TXT]
    s = a["strength"]
    assert a["strength_type"] == "multiply"
    cond = tok.flatten(start_dim=0, end_dim=1).unsqueeze(dim=0) * s
    assert torch.equal(cond, tok * torch.tensor(s, dtype=torch.float32)), "f32(strength)"
    assert len(a["in"]) == len(a["out"]) == 1
    (t_in, k_in), (t_out, k_out) = a["in"][0], a["out"][0]
    assert torch.equal(t_out, torch.cat((t_in, cond), dim=1))
    assert sorted(k_in) == sorted(k_out) and "attention_mask" not in k_out, sorted(k_out)
    for k in k_in:
        v, u = k_in[k], k_out[k]
        assert (torch.equal(v, u) if hasattr(v, "shape") else v == u), k
    print("   StyleModelApply strength", s, "redux tokens", list(tok.shape), "std",
          float(tok.std()), "f64 rel", r, "context", list(t_in.shape), "->", list(t_out.shape),
          "keys", sorted(k_out))
    return {"strength": s, "strength_type": a["strength_type"],
            "redux_tokens": fr.tensor_entry(tok), "context_shape_in": list(t_in.shape),
            "context_shape_out": list(t_out.shape)}, tok


def check_batch_rule(nodes, style, encodes, torch):
    """StyleModelApply on a batch of two images: one row of 2 x 16 tokens."""
    import comfy.clip_vision as cv
    batch = cv.Output()
    batch["last_hidden_state"] = torch.cat([e["out"]["last_hidden_state"] for e in encodes])
    txt = torch.zeros(1, T5_TOKENS, TXT)
    (out,) = nodes.StyleModelApply().apply_stylemodel([[txt, {}]], style, batch, 0.5,
                                                      "multiply")
    ((t, k),) = out
    want = torch.cat([txt] + [style.model(e["out"]["last_hidden_state"]) * 0.5
                              for e in encodes], dim=1)
    assert list(t.shape) == [1, T5_TOKENS + 2 * TOKENS, TXT] and torch.equal(t, want)
    assert k == {}
    print("   batch of 2 images through StyleModelApply ->", list(t.shape),
          "(one row, image 0's tokens then image 1's)")


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import nodes

    log = ip.LogCapture()
    with fr.comfy_tmp(torch, ["unet", "clip", "vae", "clip_vision", "style_models"], log) as tmp:
        patch_comfy(tmp, torch)
        out = {"files": fr.write_flux_files(tmp, FILES, torch, verbose=not sub),
               "workflows": {}, "components": {}}
        assert [f["name"] for f in out["files"]] == FILES
        vkeys = sorted(vision_keys(torch))
        rkeys = sorted(redux_keys(torch))
        for folder, name, keys, extra in [
                ("clip_vision", VISION, vkeys, {"kind": "siglip_vision", "config": SIGLIP}),
                ("style_models", REDUX, rkeys, {"kind": "flux_redux", "redux_dim": WIDTH,
                                                "txt_in_features": TXT})]:
            digest, _ = fp.write_file(os.path.join(tmp, folder, name), keys, None, torch)
            out["files"].append(fr.file_entry(folder, name, keys, digest, **extra))
            if not sub:
                fr.print_file(folder, name, keys, digest)
        rec = Record(torch)
        node_ns = fr.node_classes(nodes, fp.v3_nodes())
        if not sub:
            for name in WORKFLOWS:
                fr.write_graph(name, graph_for(name))
            clip_vision, style = check_loaded(nodes, torch, log, vkeys, rkeys)
            W, R = file_values(vkeys), file_values(rkeys)
            (example,) = nodes.LoadImage().load_image("example.png")[:1]
            assert list(example.shape) == [1, 48, 64, 3], example.shape
            sources = {"40": ("example.png", example),
                       "11": ("ImageInvert(example.png)", 1.0 - example)}
            cap = torch.backends.cpu.get_cpu_capability()
            out["components"] = {"cpu_capability": cap, "clip_vision_encode": {},
                                 "style_model_apply": {}}
            print("torch", torch.__version__, "cpu capability", cap)
            runs = sd1.spread_runs(__file__)
        for name in WORKFLOWS:
            prompt = fr.load_graph(name)
            assert prompt == graph_for(name), name
            rec.reset()
            lat, img = fr.run(name, prompt, node_ns, torch, log, problems)
            if sub:
                out["workflows"][name] = fr.f32_b64(lat)
                continue
            print(name)
            # The loaders run once per graph: the recorded objects are this
            # graph's; the module-level checks use the objects they hold.
            enc_nodes = [nid for nid, n in prompt.items() if n["class_type"] == "CLIPVisionEncode"]
            apply_nodes = [nid for nid, n in prompt.items()
                           if n["class_type"] == "StyleModelApply"]
            assert len(rec.encodes) == len(enc_nodes) and len(rec.applies) == len(apply_nodes)
            assert len(rec.preprocess) == len(enc_nodes)
            cv_model = rec.encodes[0]["model"]
            assert all(e["model"] is cv_model for e in rec.encodes), "one loaded model"
            st = rec.applies[0]["style_model"]
            assert all(a["style_model"] is st for a in rec.applies)
            encs, comps = {}, {}
            for nid in enc_nodes:
                i = prompt[nid]["inputs"]
                src, image = sources[i["image"][0]]
                crop = i["crop"] == "center"
                (e,) = [e for e in rec.encodes if e["crop"] == crop and
                        torch.equal(e["image"], image)]
                encs[nid] = e
                comps[nid] = dict(source=src, **check_encode(e, image, crop, cv_model, W, torch))
            out["components"]["clip_vision_encode"][name] = comps
            applies, toks = {}, {}
            for nid in apply_nodes:
                i = prompt[nid]["inputs"]
                (a,) = [a for a in rec.applies if a["strength"] == i["strength"]]
                e = encs[i["clip_vision_output"][0]]
                assert a["cvo"]["last_hidden_state"] is not None
                assert torch.equal(a["cvo"]["last_hidden_state"], e["out"]["last_hidden_state"])
                entry, toks[nid] = check_apply(a, e, st, R, torch)
                applies[nid] = dict(clip_vision_node=i["clip_vision_output"][0], **entry)
            out["components"]["style_model_apply"][name] = applies
            # The conditioning grows by 16 tokens per applied image.
            n_txt = T5_TOKENS + TOKENS * len(apply_nodes)
            want_in = T5_TOKENS
            for nid in apply_nodes:
                a = applies[nid]
                assert a["context_shape_in"] == [1, want_in, TXT], a["context_shape_in"]
                want_in += TOKENS
                assert a["context_shape_out"] == [1, want_in, TXT]
            txt_tokens = [d["txt_len"] for d in rec.dits]
            assert txt_tokens and all(n == n_txt for n in txt_tokens), txt_tokens
            assert all(d["txt_ids_zero"] for d in rec.dits)
            if name == "tiny_flux_redux_nocrop":
                check_batch_rule(nodes, st, [encs["39"], encs["43"]], torch)
            clipped = fr.check_image(name, img)
            w = fr.spreads(name, lat, runs)
            rec.reset()
            fr.without_rel(name, lat, w, without_redux(prompt), node_ns, torch)
            assert not rec.encodes and not rec.applies
            assert all(d["txt_len"] == T5_TOKENS for d in rec.dits)
            w["txt_tokens"] = txt_tokens
            w.update(fr.outputs(lat, img))
            out["workflows"][name] = w
            print("   DiT calls txt tokens", txt_tokens)
            print("  ", *fr.summary(lat, img, w, clipped), "without redux", w["without_rel"])
        size = fr.finish("flux_redux", out, sub)
        if size is not None:
            assert size < 2_000_000, size


if __name__ == "__main__":
    main()
