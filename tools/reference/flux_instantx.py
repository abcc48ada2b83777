"""End-to-end and component references for an InstantX-layout Flux ControlNet.

A tiny ControlNet in the key layout of InstantX/FLUX.1-dev-Controlnet-Union
and Shakker-Labs/FLUX.1-dev-ControlNet-Union-Pro
(diffusion_pytorch_model.safetensors: diffusers FluxControlNetModel names)
is built for ComfyUI's own class (comfy/ldm/flux/controlnet.py
ControlNetFlux, latent_input=True, num_union_modes=10), its names the
diffusers names that comfy.utils.flux_to_diffusers maps onto the ComfyUI
keys (the fused ones split into their slices), every value from
sd1_pipeline's `values(key, shape)` formula of the key as spelled in the
file, stored f16 (flux_pipeline.write_file). The base is flux_pipeline.py's
unet/tiny_flux_dev.safetensors with clip/tiny_t5xxl, clip/tiny_clip_l and
vae/tiny_flux_ae (keys and checksums asserted equal to
tests/reference/flux/expected.json). The workflows
graphs/tiny_flux_controlnet_union*.json (written by this script) are run
through ComfyUI's own node classes on the CPU in f32, and
tests/reference/flux_instantx/expected.json gets:
  files: flux_pipeline's entries (folder, name, keys sorted with shapes,
      scaled {}, checksum_f16) for the four Flux files, then the ControlNet's
      (the same fields plus kind "flux_instantx_controlnet", base
      "tiny_flux_dev.safetensors" and union_modes 10; folder "controlnet",
      ComfyUI's ControlNetLoader folder).
  workflows: per graph as flux's: latent_shape, latent_f32, image_shape,
      image_f32 (base64 little-endian f32), image_range [min, max, std],
      f32_vs_f64_unet_rel, unet_rounding_rel (sd1_pipeline's spread runs:
      the f64 run has the ControlNet in f64 too, ComfyUI's unet_dtype gives
      it the same dtype); without_rel (max |latent - latent of the same
      graph with the ControlNetApplyAdvanced bypassed| / max |that latent|:
      the ControlNet matters); control_calls: every ControlNet.get_control
      call of the sampling in order ([strength, sigma, applied, batch,
      batched_number]); dit_control: per DiT call (Flux.forward_orig)
      [sigma, batch, number of "input" entries, number of "output" entries]
      (0, 0 without control).
  components:
    controlnet_forward: the first ControlNetFlux.forward call of
        tiny_flux_controlnet_union (ControlNetFlux.forward hooked; the
        outputs copied before control_merge scales them in place): graph,
        sigma, strength, control_type (what ComfyUI passes as
        kwargs["control_type"]: [3]); inputs x, timesteps, context, y,
        guidance, hint (each {shape, f32}; hint = the VAE-encoded,
        process_in'd latent, [1, 16, 6, 8]); context_shape; txt_tokens (the
        text tokens the net's blocks saw: context tokens + 1 mode token);
        img_tokens; "input" and "output": {count, tensors: [{positions,
        shape, f32}]}, one item per DISTINCT tensor of the returned tuple
        with the positions it occupies ("input" 19 entries: block 0 at
        0..9, block 1 at 10..18; "output" 38: single block 0 at all). The
        outputs are ControlNetFlux's, before the strength.
    controlnet_forward_auto: the same for the first forward of
        tiny_flux_controlnet_union_auto (control_type [], no mode token:
        txt_tokens = context tokens; batch 1, cfg 1.0).
    hints: {graph: how the hint of its first applied call was made}:
        image_shape (what the apply node got, [B, H, W, C]), pixels
        ({shape, f32}: what VAE.encode got, [B, H, W, C], after the resize),
        encoded ({shape, f32}: VAE.encode's output), latent_format
        {scale_factor, shift_factor}, hint ({shape, f32}: process_in of
        `encoded`, the forward's hint).
    key_map: [diffusers name, ComfyUI name, null or [dim, start, length]]
        per file key, as load_controlnet_flux_instantx converted it (the
        loaded tensors asserted equal to these file slices).
    load_log: ControlNetLoader's log records at DEBUG level.

File controlnet/tiny_flux_controlnet_instantx_union.safetensors (f16, no
  prefix), the tiny Flux dev's widths (hidden 64, 2 heads of 32, mlp 256,
  context 32, pooled 64, 16 latent channels, qkv bias, guidance embedder),
  2 double blocks and 1 single block (InstantX's union has 5 / 10,
  Shakker's Union-Pro 6 / 0), num_union_modes 10 (the real union's
  controlnet_mode_embedder has 10 rows; ComfyUI's SetUnionControlNetType
  names only 8 types, comfy/cldm/control_types.py UNION_CONTROLNET_TYPES:
  openpose 0, depth 1, hed/pidi/scribble/ted 2, canny/lineart/anime_lineart/
  mlsd 3, normal 4, segment 5, tile 6, repaint 7; rows 8 and 9 unreachable),
  controlnet_x_embedder [64, 64] (16 latent channels x 2 x 2; the 17-channel
  inpainting variant would be [64, 68]):
    x_embedder.{weight [64, 64], bias}, context_embedder.{weight [64, 32],
    bias}, time_text_embed.{timestep_embedder, guidance_embedder}.
    linear_1.{weight [64, 256], bias}, .linear_2.{weight [64, 64], bias},
    time_text_embed.text_embedder.linear_1.{weight [64, 64], bias},
    .linear_2.{weight [64, 64], bias};
    transformer_blocks.{0,1}.: norm1.linear and norm1_context.linear
    {weight [384, 64], bias}, attn.{to_q, to_k, to_v, add_q_proj,
    add_k_proj, add_v_proj, to_out.0, to_add_out}.{weight [64, 64], bias},
    attn.{norm_q, norm_k, norm_added_q, norm_added_k}.weight [32],
    ff.net.0.proj and ff_context.net.0.proj {weight [256, 64], bias},
    ff.net.2 and ff_context.net.2 {weight [64, 256], bias};
    single_transformer_blocks.0.: norm.linear {weight [192, 64], bias},
    attn.{to_q, to_k, to_v}.{weight [64, 64], bias}, attn.{norm_q,
    norm_k}.weight [32], proj_mlp {weight [256, 64], bias}, proj_out
    {weight [64, 320], bias};
    controlnet_blocks.{0,1}.{weight [64, 64], bias},
    controlnet_single_blocks.0.{weight [64, 64], bias},
    controlnet_x_embedder.{weight [64, 64], bias},
    controlnet_mode_embedder.weight [10, 64].
  No norm_out / proj_out (FluxControlNetModel has none; ControlNetFlux is
  built with final_layer=False), no pos_embed tensors (FluxPosEmbed has no
  parameters).

Workflows (the tiny Flux dev: UNETLoader + DualCLIPLoader flux + VAELoader
tiny_flux_ae; euler / simple, 4 steps, EmptySD3LatentImage 64x48 -> latent
[1, 16, 6, 8], FluxGuidance 3.0 on the positive, ControlNetLoader(the union
file), ControlNetApplyAdvanced with its vae input = the VAELoader's):
  tiny_flux_controlnet_union: SetUnionControlNetType(type "canny/lineart/
      anime_lineart/mlsd" -> control_type [3]) -> ControlNetApplyAdvanced(
      positive, negative = CLIPTextEncode(a real negative prompt), LoadImage
      example.png (64x48 RGBA -> RGB), strength 0.7, 0.0-0.8); cfg 2.0.
      Cond and uncond share the control object, so they run as one batch of
      2 (guidance 3.0 / 3.5); every step is inside the range (the last
      sigma 0.5128 >= percent_to_sigma(0.8) = 0.4412).
  tiny_flux_controlnet_union_auto: no SetUnionControlNetType ("auto": no
      control_type extra arg, no mode token); ControlNetApplyAdvanced(
      negative ConditioningZeroOut of the same encode, LoadImage example.png
      -> ImageScale(bilinear, 40x40, crop disabled), strength 1.0,
      0.2-1.0); cfg 1.0 (uncond skipped). The first step (sigma 1.0 >
      percent_to_sigma(0.2) = 0.9266) runs without control.

How ComfyUI does it (asserted here where observable):
  * Loading (comfy/controlnet.py): load_controlnet_state_dict sees
      controlnet_blocks.0.weight, no double_blocks.0.img_attn.norm.key_norm.
      scale, no pos_embed_input.proj.weight, no transformer_blocks.0.
      img_mlp.net.0.proj.weight, and controlnet_x_embedder.weight ->
      load_controlnet_flux_instantx: comfy.model_detection.
      convert_diffusers_mmdit(sd, "") (Flux branch: x_embedder.weight
      present; depth = count of transformer_blocks.N, depth_single_blocks =
      count of single_transformer_blocks.N, hidden = x_embedder.bias
      length) applies comfy.utils.flux_to_diffusers' map, popping every
      mapped key from sd:
        - plain renames: x_embedder -> img_in, context_embedder -> txt_in,
          time_text_embed.timestep_embedder.linear_{1,2} -> time_in.
          {in,out}_layer, .guidance_embedder.linear_{1,2} -> guidance_in.
          {in,out}_layer, .text_embedder.linear_{1,2} -> vector_in.
          {in,out}_layer, controlnet_x_embedder -> pos_embed_input; per
          double block transformer_blocks.i -> double_blocks.i: norm1.linear
          -> img_mod.lin, norm1_context.linear -> txt_mod.lin, attn.to_out.0
          -> img_attn.proj, attn.to_add_out -> txt_attn.proj, ff.net.0.proj
          -> img_mlp.0, ff.net.2 -> img_mlp.2, ff_context.net.{0.proj,2} ->
          txt_mlp.{0,2}, attn.norm_q / norm_k -> img_attn.norm.query_norm /
          key_norm .scale, attn.norm_added_q / norm_added_k ->
          txt_attn.norm.query_norm / key_norm .scale; per single block
          single_transformer_blocks.i -> single_blocks.i: norm.linear ->
          modulation.lin, proj_out -> linear2, attn.norm_q / norm_k ->
          norm.query_norm / key_norm .scale.
        - fused (dim 0 slices, weight and bias alike, h = 64):
          double_blocks.i.img_attn.qkv = [to_q | to_k | to_v] (rows 0:h,
          h:2h, 2h:3h), double_blocks.i.txt_attn.qkv = [add_q_proj |
          add_k_proj | add_v_proj] (the same rows), single_blocks.i.linear1
          = [attn.to_q | attn.to_k | attn.to_v | proj_mlp] (rows 0:h, h:2h,
          2h:3h, 3h:7h). The target starts as torch.empty_like(first slice)
          and grows along dim 0 as later slices need (new[:old rows] =
          old), each slice written with narrow(0, start, length).
        - swapped: only norm_out.linear.{weight, bias} -> final_layer.
          adaLN_modulation.1 with swap_scale_shift (diffusers' [scale |
          shift] halves -> ComfyUI's [shift | scale]); a ControlNet has no
          norm_out, so nothing is swapped here. The adaLN-Zero norm1 /
          norm1_context / norm.linear chunks (shift, scale, gate ...) are in
          ComfyUI's order already: copied as they are.
      Then controlnet_config(new_sd) detects Flux from the converted keys
      (flux_pipeline's tiny detect relaxation, nothing more); every key not
      popped (controlnet_blocks.*, controlnet_single_blocks.*,
      controlnet_mode_embedder.weight) is copied under its own name;
      num_union_modes = controlnet_mode_embedder.weight rows (10);
      control_latent_channels = pos_embed_input.weight.shape[1] // 4 (16;
      17 would set concat_mask); ControlNetFlux(latent_input=True,
      num_union_modes, control_latent_channels, **unet_config) (pos_embed_
      input Linear(16 * 4, hidden), no input_hint_block, main_model_double
      19, main_model_single 38), load_state_dict(strict=False) (no missing,
      no unexpected keys: the log is captured at DEBUG), wrapped in
      ControlNet(compression_ratio 1, latent_format Flux() (scale 0.3611,
      shift 0.1159), extra_conds ['y', 'guidance'], upscale_algorithm
      'nearest-exact' (ControlBase's default), strength_type CONSTANT).
      Every loaded tensor is the file's f16 value (or the concatenation of
      its slices), f32.
  * SetUnionControlNetType: control_net.copy(), extra_args["control_type"]
      = [UNION_CONTROLNET_TYPES[type]] ([] for "auto"); the graph without
      it has no "control_type" extra arg at all (ControlNetFlux.forward
      reads kwargs.get("control_type", []): the same).
  * ControlNetApplyAdvanced: control_net.copy().set_cond_hint(image
      [B, C, H, W], strength, (start, end), vae), one copy shared by
      positive and negative.
  * pre_run: timestep_range = (percent_to_sigma(start), percent_to_sigma(
      end)) (ModelSamplingFlux: 1.0 at 0.0, else flux_time_shift(1.15, 1,
      1 - p): 0.2 -> 0.9266, 0.8 -> 0.4412; the 4 simple sigmas are 1.0,
      0.9045, 0.7595, 0.5128); get_control returns None when sigma >
      range[0] or sigma < range[1].
  * The hint (ControlNet.get_control, made on the first applied call, then
      cached while the latent size stays): compression = 1 *
      vae.spacial_compression_encode() (8); common_upscale(image, latent_w
      * 8, latent_h * 8, "nearest-exact", "center") (center crop to the
      target aspect, then torch nearest-exact: identity for 64x48; 40x40 ->
      crop 40x30 -> 64x48 for the auto graph); preprocess_image identity;
      VAE.encode(hint [B, H, W, C]) (the VAE's own 2a - 1); Flux
      latent_format.process_in: (latent - 0.1159) * 0.3611; cast to the
      net's dtype. A batch-1 hint stays batch 1 (broadcast_image_to),
      broadcast in the forward.
  * The ControlNetFlux inputs: x = calculate_input(sigma, x_noisy) = x_noisy
      (CONST); timesteps = model_sampling.timestep(sigma) = sigma; context =
      the batch's c_crossattn; y and guidance = the batch's 'y' (CLIP-L
      pooled) and 'guidance' (FluxGuidance's value, 3.5 where none was set)
      extra conds; control_type = extra_args' (absent for "auto").
  * ControlNetFlux.forward (latent_input): hint = pad_to_patch_size(hint,
      (2, 2)) (circular; no-op at 6x8), patchified "b c (h 2) (w 2) -> b
      (h w) (c 2 2)" -> [1, 12, 64]; x padded and patchified the same; img
      = img_in(x) + pos_embed_input(hint) (pos_embed_input = the converted
      controlnet_x_embedder); vec = time_in(emb(t)) + guidance_in(emb(
      guidance)) + vector_in(y[:, :64]) (emb: timestep_embedding, 256
      wide, time_factor 1000); txt = txt_in(context); with a mode embedder
      and a non-empty control_type: txt = cat(controlnet_mode_embedder(
      tensor(control_type)) [1, 64] repeated over the batch, txt) (the mode
      token FIRST) and txt_ids = cat(txt_ids[:, :1], txt_ids) (one more
      zero id); img_ids (0, row, col), pe = pe_embedder(cat(txt_ids,
      img_ids)); after double block i: controlnet_blocks[i](img); then
      cat(txt, img) through the single blocks, after single block i:
      controlnet_single_blocks[i](img tokens after the txt_len text
      tokens). latent_input repetition: each double block's tensor repeated
      ceil(19 / n) times IN A ROW, then cut to 19 (n = 2: block 0 at 0..9,
      block 1 at 10..18; the XLabs nets interleave instead); singles the
      same to 38 (n = 1: one tensor at all 38). No "middle". Every step
      redone here with the net's own modules on the recorded inputs and
      compared bit for bit with the block inputs / outputs (hooks).
  * control_merge: each DISTINCT tensor multiplied once, in place, by the
      strength; "middle" stays [].
  * Flux.forward_orig: after double block i, if i < len(control["input"]):
      img[:, :add.shape[1]] += add; after single block i, if i <
      len(control["output"]): img[:, txt_len : txt_len + add.shape[1]] +=
      add. The tiny dev's 2 double / 2 single blocks use input[0..1] (both
      controlnet_blocks.0's output: with the in-a-row repetition block 1's
      output only reaches main double blocks 10..18, which the tiny dev
      does not have) and output[0..1]; asserted on the first DiT call of
      tiny_flux_controlnet_union with module hooks on its blocks.

Relaxed as in flux_pipeline.py (fp.patch_comfy), nothing more:
load_controlnet_flux_instantx hard-codes nothing width-related (19 / 38
repetition targets are ControlNetFlux's, kept).

    COMFY_DIR=/work/comfyfull /work/venv-ref/bin/python tools/reference/flux_instantx.py
(media-only imports are stubbed as in sd1_pipeline.py; the flux fixtures are
not rewritten; the graphs are written by the main run; the steps shared
with the other Flux fixture scripts -- model folders, fixture checks,
workflow runs, spreads, per-workflow fields -- are fixture_runs.py's; the
recording wrappers, the DiT trace and its add-rule check, the range and
hint checks and the per-workflow control fields are control_runs.py's.)
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import flux_pipeline as fp  # noqa: E402
import flux_fill as ff  # noqa: E402
import fixture_runs as fr  # noqa: E402
import inpaint_pipeline as ip  # noqa: E402
import control_runs as cr  # noqa: E402

FILES = ["tiny_flux_dev.safetensors", "tiny_t5xxl.safetensors", "tiny_clip_l.safetensors",
         "tiny_flux_ae.safetensors"]
CN = "tiny_flux_controlnet_instantx_union.safetensors"
UNION = "tiny_flux_controlnet_union"
AUTO = "tiny_flux_controlnet_union_auto"
WORKFLOWS = [UNION, AUTO]
CN_PARAMS = dict(fp.FLUX, depth=2, depth_single_blocks=1)
MODES = 10
LATENT_CHANNELS = 16
TYPE = "canny/lineart/anime_lineart/mlsd"
TYPE_ID = 3
MAIN_DOUBLE, MAIN_SINGLE = 19, 38
# Node order in the written graphs.
ORDER = ["1", "2", "13", "3", "4", "5", "10", "11", "20", "23", "21", "6", "7", "8", "9", "99"]
LATENT_SCALE, LATENT_SHIFT = 0.3611, 0.1159
PROBLEMS = ("missing controlnet keys", "unexpected controlnet keys", "leftover keys",
            "could not detect", "control could not be applied", "error checkpoint",
            "no VAE provided", "needs a VAE", "ERROR")

PROMPT = ("a (weathered:1.2) wooden sailboat moored at a stone pier, calm harbor water, "
          "[golden evening light], ((crisp rigging lines)), gulls overhead, film grain")
NEGATIVE = "blurry, lowres, (jpeg artifacts:1.3), watermark, text, deformed, oversaturated"
AUTO_PROMPT = ("a glass greenhouse full of ferns and orchids, (misty:1.1) morning, "
               "sunbeams through the panes, [soft green tones]")


def graph_for(name):
    """The API prompt of workflow `name` (node ids as in
    graphs/tiny_flux_controlnet.json where they play the same part)."""
    g = fr.flux_loaders()
    g.update({
        "4": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["3", 0],
                                                       "guidance": 3.0}},
        "10": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "20": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": CN}},
        "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 48,
                                                              "batch_size": 1}},
    })
    if name == UNION:
        g.update({
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": PROMPT}},
            "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": NEGATIVE}},
            "23": {"class_type": "SetUnionControlNetType", "inputs": {"control_net": ["20", 0],
                                                                      "type": TYPE}},
            "21": {"class_type": "ControlNetApplyAdvanced", "inputs": {
                "positive": ["4", 0], "negative": ["5", 0], "control_net": ["23", 0],
                "image": ["10", 0], "strength": 0.7, "start_percent": 0.0,
                "end_percent": 0.8, "vae": ["13", 0]}},
            "7": {"class_type": "KSampler", "inputs": {
                "model": ["1", 0], "positive": ["21", 0], "negative": ["21", 1],
                "latent_image": ["6", 0], "seed": 818181, "steps": 4, "cfg": 2.0,
                "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        })
    else:
        g.update({
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0],
                                                             "text": AUTO_PROMPT}},
            "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["3", 0]}},
            "11": {"class_type": "ImageScale", "inputs": {
                "image": ["10", 0], "upscale_method": "bilinear", "width": 40, "height": 40,
                "crop": "disabled"}},
            "21": {"class_type": "ControlNetApplyAdvanced", "inputs": {
                "positive": ["4", 0], "negative": ["5", 0], "control_net": ["20", 0],
                "image": ["11", 0], "strength": 1.0, "start_percent": 0.2,
                "end_percent": 1.0, "vae": ["13", 0]}},
            "7": {"class_type": "KSampler", "inputs": {
                "model": ["1", 0], "positive": ["21", 0], "negative": ["21", 1],
                "latent_image": ["6", 0], "seed": 828282, "steps": 4, "cfg": 1.0,
                "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        })
    g.update(fr.save_nodes(name, ["13", 0]))
    return {nid: g[nid] for nid in ORDER if nid in g}


def v3_nodes():
    import comfy_extras.nodes_controlnet as ncn
    return {**fp.v3_nodes(), "SetUnionControlNetType": ncn.SetUnionControlNetType}


# --- the control file ------------------------------------------------------

def comfy_keys(torch):
    """ControlNetFlux's state dict keys and shapes as
    load_controlnet_flux_instantx builds it for the tiny widths."""
    import comfy.ops
    from comfy.ldm.flux.controlnet import ControlNetFlux
    m = ControlNetFlux(latent_input=True, num_union_modes=MODES,
                       control_latent_channels=LATENT_CHANNELS, image_model="flux",
                       guidance_embed=True, dtype=torch.float32, device="meta",
                       operations=comfy.ops.disable_weight_init, **CN_PARAMS)
    return [(k, list(t.shape)) for k, t in m.state_dict().items()]


def controlnet_keys(torch):
    """The file's keys and shapes: ControlNetFlux's keys named back through
    comfy.utils.flux_to_diffusers (a fused key split into its slices), the
    keys it does not map under their own names. Returns (keys, key_map:
    [[diffusers, comfy, None or [dim, start, length]]] sorted by diffusers
    name); checked against the layout the docstring lists."""
    import comfy.utils
    h = CN_PARAMS["hidden_size"]
    cfg = {"depth": CN_PARAMS["depth"], "depth_single_blocks": CN_PARAMS["depth_single_blocks"],
           "hidden_size": h}
    sd_map = comfy.utils.flux_to_diffusers(cfg, output_prefix="")
    comfy = dict(comfy_keys(torch))
    keys, key_map, covered = [], [], {}
    for dk, t in sd_map.items():
        if isinstance(t, str):
            target, offset, fun = t, None, None
        else:
            target, offset = t[0], t[1]
            fun = t[2] if len(t) > 2 else None
        if target not in comfy:
            assert target.startswith("final_layer."), (dk, target)
            continue
        assert fun is None, (dk, target)
        shape = list(comfy[target])
        if offset is not None:
            assert offset[0] == 0
            shape[0] = offset[2]
            covered.setdefault(target, []).append((offset[1], offset[2]))
        else:
            covered.setdefault(target, []).append(None)
        keys.append((dk, shape))
        key_map.append([dk, target, None if offset is None else list(offset)])
    for k, s in comfy.items():
        if k not in covered:
            assert k.startswith(("controlnet_blocks.", "controlnet_single_blocks.",
                                 "controlnet_mode_embedder.")), k
            keys.append((k, list(s)))
            key_map.append([k, k, None])
        elif covered[k] != [None]:
            spans = sorted(covered[k])
            assert spans[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert spans[-1][0] + spans[-1][1] == comfy[k][0], (k, spans)
    mlp = 4 * h
    hd = h // CN_PARAMS["num_heads"]
    want = {"x_embedder.weight": [h, 64],
            "context_embedder.weight": [h, CN_PARAMS["context_in_dim"]],
            "controlnet_x_embedder.weight": [h, 4 * LATENT_CHANNELS],
            "controlnet_mode_embedder.weight": [MODES, h]}
    for e in ("timestep", "guidance"):
        want["time_text_embed.{}_embedder.linear_1.weight".format(e)] = [h, 256]
        want["time_text_embed.{}_embedder.linear_2.weight".format(e)] = [h, h]
    want["time_text_embed.text_embedder.linear_1.weight"] = [h, CN_PARAMS["vec_in_dim"]]
    want["time_text_embed.text_embedder.linear_2.weight"] = [h, h]
    for i in range(CN_PARAMS["depth"]):
        p = "transformer_blocks.{}.".format(i)
        want.update({p + "norm1.linear.weight": [6 * h, h],
                     p + "norm1_context.linear.weight": [6 * h, h],
                     p + "ff.net.0.proj.weight": [mlp, h], p + "ff.net.2.weight": [h, mlp],
                     p + "ff_context.net.0.proj.weight": [mlp, h],
                     p + "ff_context.net.2.weight": [h, mlp],
                     "controlnet_blocks.{}.weight".format(i): [h, h]})
        for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0",
                  "to_add_out"):
            want[p + "attn." + n + ".weight"] = [h, h]
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            want[p + "attn." + n + ".weight"] = [hd]
    for i in range(CN_PARAMS["depth_single_blocks"]):
        p = "single_transformer_blocks.{}.".format(i)
        want.update({p + "norm.linear.weight": [3 * h, h], p + "proj_mlp.weight": [mlp, h],
                     p + "proj_out.weight": [h, h + mlp],
                     "controlnet_single_blocks.{}.weight".format(i): [h, h]})
        for n in ("to_q", "to_k", "to_v"):
            want[p + "attn." + n + ".weight"] = [h, h]
        for n in ("norm_q", "norm_k"):
            want[p + "attn." + n + ".weight"] = [hd]
    for k, s in list(want.items()):
        if k.endswith(".weight") and len(s) == 2 and k != "controlnet_mode_embedder.weight":
            want[k[:-len("weight")] + "bias"] = [s[0]]
    got = dict(keys)
    assert len(got) == len(keys) and got == want, sorted(
        set((k, tuple(v)) for k, v in got.items()) ^ set((k, tuple(v)) for k, v in want.items()))
    return keys, sorted(key_map)


def problems(log):
    """ip.LogCapture records about the UNet's weights (warnings) or the
    control model (any level)."""
    return ff.unet_warnings(log) + [m for _, m in log.records if any(p in m for p in PROBLEMS)]


# --- recording -------------------------------------------------------------

class Record:
    """The instantx loader's calls; every ControlNet.get_control call (stack
    order kept, result copied, the VAE.encode it made); every
    ControlNetFlux.forward call (inputs, block inputs / outputs, outputs
    copied before control_merge touches them, the forward rules checked on
    the spot when `check` is set); every Flux DiT forward_orig call (the
    control it got) and, when `trace` is set, the hidden states around the
    blocks of the next DiT call with control."""
    def __init__(self, torch):
        import comfy.controlnet as cn
        import comfy.ldm.flux.controlnet as fc
        self.torch = torch
        self.loads = []
        self.trace = False
        self.check = False
        self.reset()
        rec = self

        load = cn.load_controlnet_flux_instantx

        def load_wrap(sd, model_options={}):
            rec.loads.append({"keys": sorted(sd)})
            return load(sd, model_options=model_options)
        cn.load_controlnet_flux_instantx = load_wrap

        cr.record_encode(rec)
        cr.record_get_control(rec, ("c_crossattn", "y", "guidance"), lambda net: dict(
            cr.hint_fields(net), extra_args=dict(net.extra_args)))

        forward = fc.ControlNetFlux.forward

        def fwd_wrap(self, x, timesteps, context, y=None, guidance=None, hint=None, **kwargs):
            blocks = {}

            def pre(tag):
                def hook(mod, args, kw):
                    blocks[tag + "_in"] = {k: v.clone() for k, v in kw.items()
                                           if isinstance(v, torch.Tensor)}
                    if args:
                        blocks[tag + "_in"]["x"] = args[0].clone()
                return hook

            def post(tag):
                def hook(mod, args, kw, out):
                    blocks[tag + "_out"] = tuple(o.clone() for o in out) \
                        if isinstance(out, tuple) else out.clone()
                return hook
            hooks = []
            for i, b in enumerate(self.double_blocks):
                hooks.append(b.register_forward_pre_hook(pre("double{}".format(i)),
                                                         with_kwargs=True))
                hooks.append(b.register_forward_hook(post("double{}".format(i)),
                                                     with_kwargs=True))
            for i, b in enumerate(self.single_blocks):
                hooks.append(b.register_forward_pre_hook(pre("single{}".format(i)),
                                                         with_kwargs=True))
                hooks.append(b.register_forward_hook(post("single{}".format(i)),
                                                     with_kwargs=True))
            try:
                out = forward(self, x, timesteps, context, y=y, guidance=guidance, hint=hint,
                              **kwargs)
            finally:
                for hk in hooks:
                    hk.remove()
            entry = {"model": id(self), "x": x.clone(), "timesteps": timesteps.clone(),
                     "context": context.clone(), "y": None if y is None else y.clone(),
                     "guidance": None if guidance is None else guidance.clone(),
                     "hint": hint.clone(), "kwargs": {k: v for k, v in kwargs.items()},
                     "keys": sorted(out), "blocks": blocks,
                     "txt_tokens": int(blocks["double0_in"]["txt"].shape[1]),
                     "img_tokens": int(blocks["double0_in"]["img"].shape[1])}
            for key in ("input", "output", "middle"):
                if key in out:
                    entry[key] = cr.groups_of(list(out[key]))
            if rec.check:
                check_net(self, entry, torch)
            del entry["blocks"]
            rec.forwards.append(entry)
            if rec.stack:
                rec.stack[-1]["forward"] = entry
            return out
        fc.ControlNetFlux.forward = fwd_wrap

        cr.record_flux_dit(rec)

    def reset(self):
        self.controls, self.forwards, self.dits, self.stack = [], [], [], []
        self.other_encodes = 0


# --- checks ----------------------------------------------------------------

def check_net(m, e, torch):
    """The docstring's ControlNetFlux.forward (latent_input), redone with
    the net's own modules on the recorded inputs; every step bit for bit
    equal to what its blocks saw / returned."""
    import comfy.ldm.common_dit
    from comfy.ldm.flux.layers import timestep_embedding
    from einops import rearrange
    x, t, ctx, y, g, hint = (e[k] for k in ("x", "timesteps", "context", "y", "guidance", "hint"))
    b = e["blocks"]
    ct = e["kwargs"].get("control_type", [])
    assert m.latent_input and m.controlnet_mode_embedder is not None
    hp = comfy.ldm.common_dit.pad_to_patch_size(hint, (2, 2))
    hp = rearrange(hp, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=2, pw=2)
    bs, _, h, w = x.shape
    xp = rearrange(comfy.ldm.common_dit.pad_to_patch_size(x, (2, 2)),
                   "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=2, pw=2)
    img = m.img_in(xp) + m.pos_embed_input(hp)
    vec = m.time_in(timestep_embedding(t, 256))
    vec = vec + m.guidance_in(timestep_embedding(g, 256))
    vec = vec + m.vector_in(y[:, :m.params.vec_in_dim])
    txt = m.txt_in(ctx)
    n_txt = ctx.shape[1]
    if len(ct) > 0:
        tok = m.controlnet_mode_embedder.weight[torch.tensor(ct)]
        txt = torch.cat([tok.unsqueeze(0).repeat(bs, 1, 1), txt], 1)
        n_txt += len(ct)
    hl, wl = (h + 1) // 2, (w + 1) // 2
    img_ids = torch.zeros((hl, wl, 3), dtype=x.dtype)
    img_ids[..., 1] = torch.arange(hl, dtype=x.dtype)[:, None]
    img_ids[..., 2] = torch.arange(wl, dtype=x.dtype)[None, :]
    img_ids = img_ids.reshape(1, hl * wl, 3).repeat(bs, 1, 1)
    ids = torch.cat((torch.zeros((bs, n_txt, 3), dtype=x.dtype), img_ids), 1)
    pe = m.pe_embedder(ids)
    d0 = b["double0_in"]
    assert torch.equal(d0["img"], img), "img_in(x) + pos_embed_input(hint)"
    assert torch.equal(d0["txt"], txt), "mode token first, then txt_in(context)"
    assert torch.equal(d0["vec"], vec) and torch.equal(d0["pe"], pe)
    nd, ns = len(m.double_blocks), len(m.single_blocks)
    douts = []
    for i in range(nd):
        oi, ot = b["double{}_out".format(i)]
        if i + 1 < nd:
            nxt = b["double{}_in".format(i + 1)]
            assert torch.equal(nxt["img"], oi) and torch.equal(nxt["txt"], ot)
        douts.append(m.controlnet_blocks[i](oi))
    cur = torch.cat((ot, oi), 1)
    souts = []
    for i in range(ns):
        assert torch.equal(b["single{}_in".format(i)]["x"], cur), i
        assert torch.equal(b["single{}_in".format(i)]["pe"], pe)
        cur = b["single{}_out".format(i)]
        souts.append(m.controlnet_single_blocks[i](cur[:, n_txt:, ...]))
    rd, rs = math.ceil(MAIN_DOUBLE / nd), math.ceil(MAIN_SINGLE / ns)
    assert e["keys"] == ["input", "output"], e["keys"]
    assert e["input"]["count"] == MAIN_DOUBLE and e["output"]["count"] == MAIN_SINGLE
    assert [gr["positions"] for gr in e["input"]["groups"]] == [
        [p for p in range(i * rd, (i + 1) * rd) if p < MAIN_DOUBLE] for i in range(nd)]
    assert [gr["positions"] for gr in e["output"]["groups"]] == [
        [p for p in range(i * rs, (i + 1) * rs) if p < MAIN_SINGLE] for i in range(ns)]
    for gr, o in zip(e["input"]["groups"] + e["output"]["groups"], douts + souts):
        assert torch.equal(gr["value"], o)
    assert e["txt_tokens"] == n_txt and e["img_tokens"] == hl * wl


def check_loaded(nodes, torch, keys, key_map, log, rec):
    """ControlNetLoader on the file, the log captured at DEBUG level (where
    ComfyUI reports unexpected keys). Returns (control, log records)."""
    import comfy.controlnet as cn
    import comfy.latent_formats
    del rec.loads[:]
    with fr.debug_log(log) as msgs:
        (c,) = nodes.ControlNetLoader().load_controlnet(CN)
    assert not problems(log), problems(log)
    assert not [m for m in msgs if "controlnet" in m[1].lower()], msgs
    assert rec.loads == [{"keys": sorted(k for k, _ in keys)}], rec.loads
    m = c.control_model
    assert type(c) is cn.ControlNet and type(m).__name__ == "ControlNetFlux", (type(c), type(m))
    assert m.latent_input and not m.mistoline and m.num_union_modes == MODES
    assert list(m.controlnet_mode_embedder.weight.shape) == [MODES, CN_PARAMS["hidden_size"]]
    assert not hasattr(m, "input_hint_block") and not hasattr(m, "input_cond_block")
    assert not hasattr(m, "final_layer")
    assert (m.main_model_double, m.main_model_single) == (MAIN_DOUBLE, MAIN_SINGLE)
    assert (len(m.double_blocks), len(m.single_blocks)) == (2, 1)
    assert m.params.guidance_embed and m.params.vec_in_dim == CN_PARAMS["vec_in_dim"]
    assert m.hidden_size == CN_PARAMS["hidden_size"] and m.num_heads == CN_PARAMS["num_heads"]
    assert c.compression_ratio == 1 and c.upscale_algorithm == "nearest-exact"
    assert type(c.latent_format) is comfy.latent_formats.Flux
    assert (c.latent_format.scale_factor, c.latent_format.shift_factor) == (LATENT_SCALE,
                                                                            LATENT_SHIFT)
    assert c.extra_conds == ["y", "guidance"] and c.extra_args == {}, c.extra_conds
    assert c.strength_type == cn.StrengthType.CONSTANT and not c.concat_mask
    assert c.manual_cast_dtype is None and m.dtype == torch.float32, (c.manual_cast_dtype, m.dtype)
    sd = m.state_dict()
    shapes = dict(comfy_keys(torch))
    assert {k: list(v.shape) for k, v in sd.items()} == shapes
    file_shape = dict(keys)
    by_target = {}
    for dk, ck, off in key_map:
        by_target.setdefault(ck, []).append((dk, off))
    assert set(by_target) == set(sd), set(by_target) ^ set(sd)
    for ck, parts in by_target.items():
        want = np.zeros(shapes[ck], np.float32)
        for dk, off in parts:
            v = sd1.values(dk, file_shape[dk]).astype(np.float16).astype(np.float32)
            if off is None:
                want = v
            else:
                want[off[1]:off[1] + off[2]] = v
        assert sd[ck].dtype == torch.float32, (ck, sd[ck].dtype)
        assert np.array_equal(sd[ck].numpy(), want), ck
    fused = sorted({ck for ck, parts in by_target.items() if parts[0][1] is not None})
    print("load", CN, "->", type(c).__name__, "/", type(m).__name__,
          "via load_controlnet_flux_instantx; latent_input", m.latent_input, "union modes",
          m.num_union_modes, "dtype", m.dtype, "manual cast", c.manual_cast_dtype,
          "extra_conds", c.extra_conds, "latent format", type(c.latent_format).__name__,
          "compression", c.compression_ratio, "double / single", len(m.double_blocks),
          len(m.single_blocks), "repeat to", m.main_model_double, m.main_model_single,
          "tensors", len(sd), "from", len(keys), "file keys; fused:", fused)
    print("   log at DEBUG during the load ({} records):".format(len(msgs)), msgs)
    return c, [list(x) for x in msgs]


def check_controls(name, rec, node, vae, torch):
    """Every get_control call: the range rule, the inputs, the hint chain,
    strength scaling; the outermost call per model call is what the DiT
    got. Returns (control_calls, the first applied entry)."""
    i = node["inputs"]
    want_range = (cr.flux_percent_to_sigma(i["start_percent"]),
                  cr.flux_percent_to_sigma(i["end_percent"]))
    want_ct = [TYPE_ID] if name == UNION else None
    calls, first = [], None
    for e in rec.controls:
        calls.append([e["strength"], e["sigma"], e["applied"], e["batch"], e["batched_number"]])
        cr.check_range(e, i, want_range)
        assert e["extra_args"] == ({} if want_ct is None else {"control_type": want_ct})
        if not e["applied"]:
            assert e["forward"] is None and e["result"] is None and e["encode"] is None
            continue
        fwd = e["forward"]
        assert fwd is not None and fwd["model"] == e["model"]
        x, cond = e["x"], e["cond"]
        assert torch.equal(fwd["x"], x), "x = calculate_input(sigma, x) = x (CONST)"
        assert torch.equal(fwd["timesteps"], e["t"]), "timesteps = sigma (ModelSamplingFlux)"
        assert torch.equal(fwd["context"], cond["c_crossattn"])
        assert torch.equal(fwd["y"], cond["y"]) and torch.equal(fwd["guidance"], cond["guidance"])
        assert fwd["kwargs"] == ({} if want_ct is None else {"control_type": want_ct})
        assert fwd["hint"].shape[0] == 1 and list(fwd["hint"].shape[1:]) == [
            LATENT_CHANNELS] + list(x.shape[2:]), fwd["hint"].shape
        assert fwd["txt_tokens"] == x_txt(cond) + (0 if want_ct is None else 1)
        first = cr.check_hint(name, e, first, vae, "Flux", (LATENT_SCALE, LATENT_SHIFT), torch)
        res = e["result"]
        assert sorted(res) == ["input", "middle", "output"] and res["middle"] == [], sorted(res)
        for key in ("input", "output"):
            want = cr.scaled(fwd[key], e["strength"])
            assert len(res[key]) == len(want) and all(
                torch.equal(a, b) for a, b in zip(res[key], want)), (name, key)
    cr.check_flux_dits(rec.controls, rec.dits, torch)
    assert first is not None, name
    return calls, first


def x_txt(cond):
    return int(cond["c_crossattn"].shape[1])


def forward_component(name, e):
    fwd = e["forward"]
    out = {"graph": name, "sigma": e["sigma"], "strength": e["strength"],
           "control_type": list(fwd["kwargs"].get("control_type", [])),
           "inputs": {k: fr.tensor_entry(fwd[k]) for k in ("x", "timesteps", "context", "y",
                                                            "guidance", "hint")},
           "context_shape": list(fwd["context"].shape), "txt_tokens": fwd["txt_tokens"],
           "img_tokens": fwd["img_tokens"]}
    for key in ("input", "output"):
        out[key] = cr.groups_entry(fwd[key])
    return out


def hint_component(e, image):
    enc, fwd = e["encode"], e["forward"]
    return {"image_shape": list(image.shape), "pixels": fr.tensor_entry(enc["pixels"]),
            "encoded": fr.tensor_entry(enc["latent"]),
            "latent_format": {"scale_factor": LATENT_SCALE, "shift_factor": LATENT_SHIFT},
            "hint": fr.tensor_entry(fwd["hint"])}


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import nodes

    log = ip.LogCapture()
    with fr.comfy_tmp(torch, ["unet", "clip", "vae", "controlnet"], log) as tmp:
        cdir = os.path.join(tmp, "controlnet")
        out = {"files": fr.write_flux_files(tmp, FILES, torch, verbose=not sub),
               "workflows": {}, "components": {}}
        assert [f["name"] for f in out["files"]] == FILES
        keys, key_map = controlnet_keys(torch)
        keys = sorted(keys)
        digest, _ = fp.write_file(os.path.join(cdir, CN), keys, None, torch)
        out["files"].append(fr.file_entry("controlnet", CN, keys, digest,
                                          kind="flux_instantx_controlnet",
                                          base="tiny_flux_dev.safetensors", union_modes=MODES))
        rec = Record(torch)
        node_ns = fr.node_classes(nodes, v3_nodes())
        if not sub:
            fr.print_file("controlnet", CN, keys, digest)
            print("key map (diffusers -> ComfyUI, [dim, start, length] for a slice):")
            for dk, ck, off in key_map:
                print("   ", dk, "->", ck, "" if off is None else off)
            for name in WORKFLOWS:
                fr.write_graph(name, graph_for(name))
            comp = out["components"]
            _, comp_log = check_loaded(nodes, torch, keys, key_map, log, rec)
            (example,) = nodes.LoadImage().load_image("example.png")[:1]
            (vae,) = nodes.VAELoader().load_vae("tiny_flux_ae.safetensors")
            assert vae.spacial_compression_encode() == 8
            runs = sd1.spread_runs(__file__)
            comp["hints"] = {}
        for name in WORKFLOWS:
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
            (node,) = [n for n in prompt.values() if n["class_type"] == "ControlNetApplyAdvanced"]
            calls, first = check_controls(name, rec, node, vae, torch)
            dit_control = cr.flux_dit_control(rec)
            cr.print_calls(calls, "DiT calls [sigma, batch, input entries, output entries]:",
                           dit_control)
            models = {f["model"] for f in rec.forwards}
            assert len(models) == 1, "one loaded net"
            (traced,) = [d for d in rec.dits if "trace" in d]
            assert traced is next(d for d in rec.dits if d["control"] is not None)
            cr.check_flux_trace(traced, torch)
            fwd = first["forward"]
            assert fwd is rec.forwards[0]
            if name == UNION:
                image = example
                assert fwd["x"].shape[0] == 2, "cond and uncond batched"
                assert sorted(fwd["guidance"].tolist()) == [3.0, 3.5], fwd["guidance"]
                assert [c[2] for c in calls] == [True, True, True, True], calls
                assert torch.equal(first["hint_parts"]["resized"], example.movedim(-1, 1)), \
                    "64x48: identity"
                out["components"]["controlnet_forward"] = forward_component(name, first)
            else:
                image = cr.want_image_scale(example, torch, 40, 40)
                assert fwd["x"].shape[0] == 1, "cfg 1.0: uncond skipped"
                assert fwd["guidance"].tolist() == [3.0], fwd["guidance"]
                assert [c[2] for c in calls] == [False, True, True, True], calls
                assert list(first["hint_parts"]["resized"].shape) == [1, 3, 48, 64]
                out["components"]["controlnet_forward_auto"] = forward_component(name, first)
            assert torch.equal(first["image"], image.movedim(-1, 1)), name
            comp["hints"][name] = hint_component(first, image)
            pix = first["encode"]["pixels"]
            print("   forward: x", list(fwd["x"].shape), "hint", list(fwd["hint"].shape),
                  "context", list(fwd["context"].shape), "txt tokens seen", fwd["txt_tokens"],
                  "img tokens", fwd["img_tokens"], "control_type",
                  fwd["kwargs"].get("control_type"), "guidance", fwd["guidance"].tolist(),
                  "timesteps", fwd["timesteps"].tolist(), "input distinct at",
                  [g["positions"] for g in fwd["input"]["groups"]], "output distinct",
                  len(fwd["output"]["groups"]), "abs max",
                  max(float(g["value"].abs().max()) for g in fwd["input"]["groups"]))
            print("   hint: image", list(image.shape), "-> pixels", list(pix.shape), "range",
                  [float(pix.min()), float(pix.max())], "-> encoded",
                  list(first["encode"]["latent"].shape), "std",
                  float(first["encode"]["latent"].std()), "-> hint std", float(fwd["hint"].std()))
            out["workflows"][name] = cr.workflow_entry(
                name, lat, img, runs, rec, cr.without_control(prompt), node_ns, torch, calls,
                dit_control)
        if not sub:
            out["components"]["key_map"] = key_map
            out["components"]["load_log"] = comp_log
        size = fr.finish("flux_instantx", out, sub)
        if size is not None:
            assert size < 2_000_000, size


if __name__ == "__main__":
    main()
