"""End-to-end references for SD3 LoRAs in the layouts people download.

flux_lora.py for SD3: tiny LoRA files are built for sd3_pipeline.py's tiny
SD3 checkpoint (checkpoints/tiny_sd3.safetensors: MMDiT hidden 128, 2 joint
blocks, the last context block pre-only -- adaLN_modulation.1 [256, 128]
and attn.qkv only; CLIP-L 3 layers, CLIP-G 32 layers, tiny T5), every key
name taken from ComfyUI's own LoRA key maps on the loaded checkpoint
(comfy.lora.model_lora_keys_unet, which for SD3 adds
comfy.utils.mmdit_to_diffusers, and model_lora_keys_clip), every value from
sd1_pipeline's `values(name, shape)` formula of the key as spelled in the
file, stored f16, rank 4. The workflows graphs/tiny_sd3_lora_*.json
(tiny_sd3_txt2img.json with LoRA nodes spliced in after the checkpoint
loader) are run through ComfyUI's own node classes on the CPU in f32, and
tests/reference/sd3_lora/expected.json gets flux_lora's schema:
  uses_files: the base checkpoint, from sd3/expected.json.
  files: per LoRA file: folder "loras", name, format, keys sorted with
      shapes, scaled, alphas, checksum_f16 (sd1_pipeline.checksum over all
      tensors in key order, alphas included as one f16 element each).
  key_map: per file, per LoRA key prefix: target (model / CLIP weight, or
      bias for .diff_b), slice [dim, start, length] or null, function
      (name of the function ComfyUI applies to the delta, null: none),
      alpha (null: absent), rank, scale (alpha / rank, 1.0 without alpha).
  unmapped: what ComfyUI logs, and leaves out, for keys it cannot map or
      whose target the model lacks.
  workflows: as flux_lora (latent_shape, latent_f32, image_shape,
      image_f32, f32_vs_f64_unet_rel, unet_rounding_rel, image_range, loras)
      with vs_tiny_sd3_txt2img_rel (max |latent - sd3 fixture's
      tiny_sd3_txt2img latent| / max |that latent|).

LoRA files (tensors f16, rank r = 4; lora_up / lora_B times UP_FACTOR 0.5,
recorded under "scaled"; Linear [out, in]: down [4, in], up [out, 4]; the
2x2 patch conv x_embedder.proj [128, 16, 2, 2]: down [4, 16, 2, 2], up
[128, 4, 1, 1] as PEFT / kohya LoCon save a Conv2d):
  tiny_sd3_lora_diffusers.safetensors (diffusers / PEFT names:
      "transformer." + diffusers SD3Transformer2DModel module path,
      N.lora_A.weight / N.lora_B.weight, N.alpha on some (DIFFUSERS_ALPHA)).
      transformer_blocks.{0,1}: attn.to_q/to_k/to_v (rows 0/128/256, 128 of
      joint_blocks.i.x_block.attn.qkv), attn.add_q_proj/add_k_proj/
      add_v_proj (the same rows of context_block.attn.qkv), attn.to_out.0,
      ff.net.0.proj, ff.net.2, norm1.linear, norm1_context.linear; block 0
      also attn.to_add_out, ff_context.net.0.proj, ff_context.net.2 (block
      1's context block is pre-only: no proj / mlp; its norm1_context.linear
      gets swap_scale_shift). pos_embed.proj (the conv),
      time_text_embed.timestep_embedder.linear_1/linear_2,
      time_text_embed.text_embedder.linear_1/linear_2, context_embedder,
      proj_out, norm_out.linear (swap_scale_shift).
  tiny_sd3_lora_kohya.safetensors (kohya sd-scripts lora_sd3 names,
      "lora_unet_" + MMDiT module path with "." -> "_", for joint block 0
      (x_block and context_block: attn_qkv, attn_proj, mlp_fc1, mlp_fc2,
      adaLN_modulation_1), x_embedder_proj (conv), t_embedder_mlp_0/2,
      y_embedder_mlp_0/2, context_embedder; and ComfyUI's own
      "diffusion_model." + module path for joint block 1 (x_block attn.qkv,
      attn.proj (+ diff_b), mlp.fc1, mlp.fc2 (+ diff_b), adaLN_modulation.1;
      context_block attn.qkv, adaLN_modulation.1), final_layer.linear
      (+ diff_b), final_layer.adaLN_modulation.1 (native order: no swap).
      N.lora_down.weight / N.lora_up.weight, N.alpha per KOHYA_ALPHA.
      diff_b [out] times 0.05 (1-D, so 0.05 (1 + 0.1 u)).
  tiny_sd3_lora_clip.safetensors (kohya with the text encoders):
      lora_te1_text_model_encoder_layers_{0,1,2}_* (all CLIP-L layers),
      lora_te2_text_model_encoder_layers_{0,1,30,31}_* (CLIP-G), each of
      self_attn_q/k/v/out_proj, mlp_fc1, mlp_fc2; lora_te1_text_projection,
      lora_te2_text_projection (OneTrainer's names); and lora_unet_
      joint_blocks_1_x_block_attn_qkv, joint_blocks_0_context_block_mlp_fc1,
      final_layer_linear (no alpha).

Merging as ComfyUI does it (see flux_lora.py): per patch, in node order,
  W[slice] += function(strength * scale * (up.flatten(1) @ down.flatten(1))
                        .reshape(W[slice].shape))   (f32, W an f32 copy)
scale = alpha / rank, 1.0 without .alpha; .diff_b adds strength * diff_b
to the bias; function swap_scale_shift(d) = cat(d[half:], d[:half]) on
dim 0. Asserted against that formula in f64 for every workflow's stack.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/sd3_lora.py
(the base fixtures are rebuilt in a temporary folder with sd3_pipeline and
checked against sd3/expected.json, not rewritten.)
"""
import base64
import json
import os
import shutil
import sys
import tempfile
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import families_pipeline as fam  # noqa: E402
import flux_pipeline as fp  # noqa: E402
import flux_lora as fl  # noqa: E402
import lora_pipeline as lp  # noqa: E402
import sd3_pipeline as s3  # noqa: E402

ROOT = sd1.ROOT
RANK = lp.RANK
BASE_GRAPH = "tiny_sd3_txt2img"
CKPT = "tiny_sd3.safetensors"
H = s3.HIDDEN
DEPTH = s3.DEPTH

DIFFUSERS = "tiny_sd3_lora_diffusers.safetensors"
KOHYA = "tiny_sd3_lora_kohya.safetensors"
CLIP = "tiny_sd3_lora_clip.safetensors"

# diffusers name (per block) -> (MMDiT module, slice, swap?) -- what
# ComfyUI's map is asserted to give; the last block only where it exists.
QKV = {"to_q": 0, "to_k": 1, "to_v": 2}
DIFFUSERS_BLOCK = {}
for _n, _j in QKV.items():
    DIFFUSERS_BLOCK["attn." + _n] = ("x_block.attn.qkv", (0, _j * H, H))
    DIFFUSERS_BLOCK["attn.add_{}_proj".format(_n[3:])] = ("context_block.attn.qkv", (0, _j * H, H))
DIFFUSERS_BLOCK.update({
    "attn.to_out.0": ("x_block.attn.proj", None),
    "attn.to_add_out": ("context_block.attn.proj", None),
    "ff.net.0.proj": ("x_block.mlp.fc1", None),
    "ff.net.2": ("x_block.mlp.fc2", None),
    "ff_context.net.0.proj": ("context_block.mlp.fc1", None),
    "ff_context.net.2": ("context_block.mlp.fc2", None),
    "norm1.linear": ("x_block.adaLN_modulation.1", None),
    "norm1_context.linear": ("context_block.adaLN_modulation.1", None),
})
PRE_ONLY_ABSENT = {"attn.to_add_out", "ff_context.net.0.proj", "ff_context.net.2"}
DIFFUSERS_OTHER = {
    "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
# PEFT files mostly lack alphas; some trainers / converters write them.
DIFFUSERS_ALPHA = {"attn.to_q": 2.0, "attn.to_k": 2.0, "attn.to_v": 2.0, "attn.add_q_proj": 8.0,
                   "attn.add_k_proj": 8.0, "attn.add_v_proj": 8.0, "attn.to_out.0": 1.0,
                   "ff.net.0.proj": 2.0, "norm1_context.linear": 8.0, "pos_embed.proj": 2.0,
                   "time_text_embed.text_embedder.linear_1": 8.0, "norm_out.linear": 2.0}
# kohya / diffusion_model.*: MMDiT module -> alpha (None: no .alpha key).
KOHYA_BLOCK = {"attn.qkv": 1.0, "attn.proj": 2.0, "mlp.fc1": 3.0, "mlp.fc2": None,
               "adaLN_modulation.1": 8.0}
KOHYA_OTHER = {"x_embedder.proj": 2.0, "t_embedder.mlp.0": None, "t_embedder.mlp.2": 8.0,
               "y_embedder.mlp.0": 2.0, "y_embedder.mlp.2": None, "context_embedder": 3.0}
COMFY_NAMED = {  # "diffusion_model." + module -> (alpha, with diff_b)
    "joint_blocks.1.x_block.attn.qkv": (2.0, False),
    "joint_blocks.1.x_block.attn.proj": (1.0, True),
    "joint_blocks.1.x_block.mlp.fc1": (None, False),
    "joint_blocks.1.x_block.mlp.fc2": (8.0, True),
    "joint_blocks.1.x_block.adaLN_modulation.1": (2.0, False),
    "joint_blocks.1.context_block.attn.qkv": (3.0, False),
    "joint_blocks.1.context_block.adaLN_modulation.1": (8.0, False),
    "final_layer.linear": (1.0, True),
    "final_layer.adaLN_modulation.1": (None, False),
}
CLIP_ALPHA = {"self_attn_q_proj": 2.0, "self_attn_k_proj": 2.0, "self_attn_v_proj": 2.0,
              "self_attn_out_proj": 2.0, "mlp_fc1": 6.0, "mlp_fc2": 6.0}
TE2_LAYERS = [0, 1, 30, 31]
CLIP_PROJ = {"lora_te1_text_projection": 2.0, "lora_te2_text_projection": 1.0}
CLIP_UNET = {"joint_blocks.1.x_block.attn.qkv": 2.0,
             "joint_blocks.0.context_block.mlp.fc1": 2.0, "final_layer.linear": None}
# Extra factor on a file's lora_up / lora_B (on top of UP_FACTOR), should a
# file change the latent too little.
BOOST = {}

WORKFLOWS = {
    "tiny_sd3_lora_diffusers": [("LoraLoaderModelOnly", DIFFUSERS, 0.9, None)],
    "tiny_sd3_lora_kohya": [("LoraLoaderModelOnly", KOHYA, 1.0, None)],
    "tiny_sd3_lora_clip": [("LoraLoader", CLIP, 0.8, 0.6)],
}
FORMATS = {
    DIFFUSERS: "diffusers / PEFT (transformer.*, lora_A/lora_B, alpha on some)",
    KOHYA: "kohya sd-scripts (lora_unet_*) and ComfyUI names (diffusion_model.*, diff_b), "
           "lora_down/lora_up, alpha",
    CLIP: "kohya with text encoders (lora_te1_* CLIP-L, lora_te2_* CLIP-G, "
          "lora_te{1,2}_text_projection) + lora_unet_*",
}
CLIP_PARTS = ("clip_l.", "clip_g.", "t5xxl.")


class Target(fl.Target):
    """flux_lora.Target, with Conv2d targets (down [r, in, kh, kw], up
    [out, r, 1, 1])."""

    def conv(self):
        return self.style != "diff_b" and len(self.shape) > 2

    def names(self):
        return {"kohya": (".lora_down.weight", ".lora_up.weight"),
                "peft": (".lora_A.weight", ".lora_B.weight")}[self.style]

    def keys(self):
        if not self.conv():
            return super().keys()
        p, (out, inn), k = self.prefix, self.shape[:2], self.shape[2:]
        down, up = self.names()
        keys = [(p + down, [RANK, inn] + k), (p + up, [out, RANK] + [1] * len(k))]
        alphas = {}
        if self.alpha is not None:
            keys.append((p + ".alpha", []))
            alphas[p + ".alpha"] = self.alpha
        return keys, {p + up: fl.UP_FACTOR}, alphas

    def delta(self, data, full_shape, torch):
        if not self.conv():
            return super().delta(data, full_shape, torch)
        keys, scaled, alphas = data
        shapes = dict(keys)
        down, up = self.names()

        def get(suffix):
            k = self.prefix + suffix
            return lp.lora_value(k, shapes[k], scaled, alphas).astype(np.float64)
        u, d = get(up), get(down)
        out = self.scale() * (u.reshape(u.shape[0], -1) @ d.reshape(d.shape[0], -1))
        assert self.slice is None and self.function is None
        return out.reshape(self.shape)


def lora_specs(model, clip):
    """{file: [Target]}, every name looked up in ComfyUI's key maps, and the
    CLIP map's name groups (for the report)."""
    import comfy.lora
    import comfy.utils
    unet_map = comfy.lora.model_lora_keys_unet(model.model, {})
    clip_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})
    state = model.model.state_dict()
    clip_state = clip.cond_stage_model.state_dict()

    def unet(prefix, style, alpha):
        return Target(prefix, style, alpha, unet_map[prefix], state)

    def native(prefix, module, style, alpha):
        t = unet(prefix, style, alpha)
        want = "diffusion_model." + module + (".bias" if style == "diff_b" else ".weight")
        assert (t.key, t.slice, t.function) == (want, None, None), (prefix, t.key)
        return t

    def kohya(module, alpha):
        return native("lora_unet_" + module.replace(".", "_"), module, "kohya", alpha)

    diffusers_file = []
    for i in range(DEPTH):
        last = i == DEPTH - 1
        for m, (module, sl) in DIFFUSERS_BLOCK.items():
            path = "transformer_blocks.{}.{}".format(i, m)
            target = "diffusion_model.joint_blocks.{}.{}.weight".format(i, module)
            if last and m in PRE_ONLY_ABSENT:
                # Mapped all the same; the model has no such weight.
                assert unet_map["transformer." + path] == target and target not in state
                continue
            t = unet("transformer." + path, "peft", DIFFUSERS_ALPHA.get(m))
            swap = last and m == "norm1_context.linear"
            assert (t.key, t.slice) == (target, sl), (t.prefix, t.key, t.slice)
            assert (t.function is comfy.utils.swap_scale_shift) if swap else t.function is None
            diffusers_file.append(t)
    for m, module in DIFFUSERS_OTHER.items():
        t = unet("transformer." + m, "peft", DIFFUSERS_ALPHA.get(m))
        assert (t.key, t.slice) == ("diffusion_model." + module + ".weight", None), t.prefix
        swap = m == "norm_out.linear"
        assert (t.function is comfy.utils.swap_scale_shift) if swap else t.function is None
        diffusers_file.append(t)
    # The other spellings ComfyUI gives every diffusers SD3 name.
    for t in diffusers_file:
        path = t.prefix[len("transformer."):]
        for alias in ("base_model.model." + path, "lora_transformer_" + path.replace(".", "_"),
                      "lycoris_" + path.replace(".", "_")):
            assert unet_map[alias] == unet_map[t.prefix], alias

    kohya_file = []
    for part in ("x_block", "context_block"):
        for m, a in KOHYA_BLOCK.items():
            kohya_file.append(kohya("joint_blocks.0.{}.{}".format(part, m), a))
    for m, a in KOHYA_OTHER.items():
        kohya_file.append(kohya(m, a))
    for m, (a, diff_b) in COMFY_NAMED.items():
        kohya_file.append(native("diffusion_model." + m, m, "kohya", a))
        if diff_b:
            kohya_file.append(native("diffusion_model." + m, m, "diff_b", None))

    clip_file = []
    groups = {}
    for prefix, key in clip_map.items():
        part = next((p for p in CLIP_PARTS if key.startswith(p)), None)
        if prefix.startswith("text_encoders."):
            head = ".".join(prefix.split(".")[:2]) + ".*"
        elif prefix.startswith("lora_"):
            head = "_".join(prefix.split("_")[:2]) + "_*"
        else:
            head = prefix.split(".")[0] + ".*"
        groups.setdefault("{} -> {}".format(head, part), 0)
        groups["{} -> {}".format(head, part)] += 1
    for te, part, layers in (("lora_te1_", "clip_l.", range(sd1.CLIP["num_hidden_layers"])),
                             ("lora_te2_", "clip_g.", TE2_LAYERS)):
        names = sorted(k for k in clip_map if k.startswith(te + "text_model_encoder_layers_"))
        assert len(names) == 6 * (sd1.CLIP if part == "clip_l." else s3.CLIP_G)[
            "num_hidden_layers"], (te, len(names))
        for prefix in names:
            layer = int(prefix.split("_")[6])
            if layer not in layers:
                continue
            module = prefix.split("_", 7)[-1]
            t = Target(prefix, "kohya", CLIP_ALPHA[module], clip_map[prefix], clip_state)
            hf = {v: c for c, v in comfy.lora.LORA_CLIP_MAP.items()}[module]
            assert t.key == "{}transformer.text_model.encoder.layers.{}.{}.weight".format(
                part, layer, hf), t.key
            clip_file.append(t)
    for prefix, alpha in CLIP_PROJ.items():
        t = Target(prefix, "kohya", alpha, clip_map[prefix], clip_state)
        part = "clip_l." if prefix.startswith("lora_te1_") else "clip_g."
        assert t.key == part + "transformer.text_projection.weight", t.key
        clip_file.append(t)
    for m, a in CLIP_UNET.items():
        clip_file.append(kohya(m, a))
    return {DIFFUSERS: diffusers_file, KOHYA: kohya_file, CLIP: clip_file}, groups


def file_keys(name, targets):
    keys, scaled, alphas = fl.file_keys(targets)
    b = BOOST.get(name, 1.0)
    return keys, {k: v * b if k.endswith((".lora_up.weight", ".lora_B.weight")) else v
                  for k, v in scaled.items()}, alphas


def graph_for(name):
    """tiny_sd3_txt2img.json with WORKFLOWS[name]'s LoRA nodes (ids 20, ...)
    between the checkpoint loader and its users, prefixes renamed."""
    with open(os.path.join(ROOT, "graphs", BASE_GRAPH + ".json")) as f:
        base = json.load(f)
    assert base["1"]["class_type"] == "CheckpointLoaderSimple"
    model, clip = ["1", 0], ["1", 1]
    lora_nodes = {}
    for i, (cls, lora, sm, sc) in enumerate(WORKFLOWS[name]):
        nid = str(20 + i)
        if cls == "LoraLoader":
            lora_nodes[nid] = {"class_type": cls, "inputs": {
                "model": model, "clip": clip, "lora_name": lora, "strength_model": sm,
                "strength_clip": sc}}
            model, clip = [nid, 0], [nid, 1]
        else:
            lora_nodes[nid] = {"class_type": cls, "inputs": {
                "model": model, "lora_name": lora, "strength_model": sm}}
            model = [nid, 0]
    g = {}
    for nid, node in base.items():
        node = json.loads(json.dumps(node))
        for k, v in node["inputs"].items():
            if v == ["1", 0]:
                node["inputs"][k] = model
            elif v == ["1", 1]:
                node["inputs"][k] = clip
            elif k == "filename_prefix":
                node["inputs"][k] = v.replace(BASE_GRAPH, name)
        g[nid] = node
        if nid == "1":
            g.update(lora_nodes)
    assert len(g) == len(base) + len(lora_nodes)
    return g


def load_base(nodes):
    model, clip = nodes.CheckpointLoaderSimple().load_checkpoint(CKPT)[:2]
    return model, clip


def is_clip_key(k):
    return k.startswith(CLIP_PARTS)


def check_merge(nodes, torch, specs, data, log):
    """flux_lora.check_merge on the SD3 checkpoint: each workflow's LoRA
    nodes; the patch sets are exactly the targets, nothing is left
    unloaded, the merged weights match the f64 formula."""
    import comfy.lora
    for name, stack in WORKFLOWS.items():
        m0, c0 = load_base(nodes)
        del log.records[:]
        model, clip = fl.apply_stack(nodes, m0, c0, stack)
        assert not log.problems(), (name, log.problems())
        want = {}
        for cls, lora, sm, sc in stack:
            for t in specs[lora]:
                c = is_clip_key(t.key)
                if c and cls != "LoraLoader":
                    continue
                want.setdefault(t.key, []).append((sc if c else sm, lora, t))
        unet_want = {k for k in want if not is_clip_key(k)}
        assert set(model.patches) == unet_want, set(model.patches) ^ unet_want
        clip_want = set(want) - unet_want
        assert set(clip.patcher.patches) == clip_want, set(clip.patcher.patches) ^ clip_want
        worst, least = {}, 1.0
        for k, items in want.items():
            c = k in clip_want
            patcher = clip.patcher if c else model
            orig = (c0.patcher if c else m0).model.state_dict()[k]
            patches = patcher.patches[k]
            assert len(patches) == len(items), k
            # Patches of one file on one weight (q/k/v row slices) come in
            # ComfyUI's map order; matched here by slice.
            order = sorted(range(len(items)), key=lambda j: (items[j][2].slice or (0, -1, 0)))
            got = sorted(patches, key=lambda p: (p[3] or (0, -1, 0)))
            for (strength, _, _, offset, function), j in zip(got, order):
                s, _, t = items[j]
                assert strength == s and offset == t.slice and function is t.function, k
            merged = comfy.lora.calculate_weight(patches, orig.to(torch.float32, copy=True), k)
            merged = merged.to(orig.dtype).double().numpy()
            base = orig.double().numpy()
            ref = base.copy()
            for s, lora, t in items:
                ref = ref + s * t.delta(data[lora], list(orig.shape), torch)
            ulp = 2.0 ** -10 if orig.dtype == torch.float16 else 2.0 ** -20
            err = float(np.abs(merged - ref).max() / np.abs(ref).max())
            assert err < ulp, (name, k, err, orig.dtype)
            kind = ("clip " if c else "unet ") + str(orig.dtype).replace("torch.", "")
            worst[kind] = max(worst.get(kind, 0.0), err)
            change = float(np.abs(merged - base).max() / np.abs(base).max())
            assert change > 1e-3, (name, k, change)
            least = min(least, change)
        print("merge", name, "unet keys", len(unet_want), "clip keys", len(clip_want),
              "patches", sum(len(v) for v in want.values()),
              "max rel err vs f64 formula", worst, "least rel weight change", least)
        if clip_want:
            text = "a lighthouse at dusk"
            (e0, p0) = c0.encode_from_tokens(c0.tokenize(text), return_pooled=True)
            (e1, p1) = clip.encode_from_tokens(clip.tokenize(text), return_pooled=True)
            lg = s3.CLIP_L["hidden_size"]

            def rel(a, b):
                return float((a - b).abs().max() / b.abs().max())
            r = {"cond CLIP-L|G": rel(e1[:, :77], e0[:, :77]),
                 "cond T5": rel(e1[:, 77:], e0[:, 77:]),
                 "pooled CLIP-L": rel(p1[:, :lg], p0[:, :lg]),
                 "pooled CLIP-G": rel(p1[:, lg:], p0[:, lg:])}
            print("   CLIP LoRA: rel change", r)
            assert r["cond T5"] == 0.0 and min(v for k, v in r.items() if k != "cond T5") > 1e-2, r


def unmapped(nodes, torch, tmp, log):
    """What ComfyUI does with keys it cannot map: the CLIP file through
    LoraLoaderModelOnly, and the diffusers file plus keys whose target the
    pre-only last block lacks (mapped, then dropped: "NOT LOADED"), a kohya
    name for such a weight, a T5 key for a model-only load and a
    misspelled module."""
    from safetensors.torch import load_file, save_file
    out = {}
    m0, _ = load_base(nodes)
    del log.records[:]
    (m1,) = nodes.LoraLoaderModelOnly().load_lora_model_only(m0, CLIP, 1.0)
    msgs = sorted(log.problems())
    n_te = sum(k.startswith("lora_te") for k in load_file(os.path.join(tmp, "loras", CLIP)))
    assert len(msgs) == n_te and all(m.startswith("lora key not loaded: lora_te") for m in msgs)
    out["LoraLoaderModelOnly(" + CLIP + ")"] = {"logged": msgs,
                                                "patched_model_keys": len(m1.patches)}
    bogus = load_file(os.path.join(tmp, "loras", DIFFUSERS))
    last = "transformer.transformer_blocks.{}.".format(DEPTH - 1)
    extra = {
        last + "attn.to_add_out.lora_A.weight": [RANK, H],
        last + "attn.to_add_out.lora_B.weight": [H, RANK],
        last + "ff_context.net.0.proj.lora_A.weight": [RANK, H],
        last + "ff_context.net.0.proj.lora_B.weight": [4 * H, RANK],
        "lora_unet_joint_blocks_1_context_block_mlp_fc2.lora_down.weight": [RANK, 4 * H],
        "lora_unet_joint_blocks_1_context_block_mlp_fc2.lora_up.weight": [H, RANK],
        "lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight": [RANK, 256],
        "lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_up.weight": [64, RANK],
        "transformer.transformer_blocks.0.attn.to_qq.alpha": [],
    }
    for k, shape in extra.items():
        v = sd1.values(k, shape) if shape else np.array(2.0)
        bogus[k] = torch.from_numpy(v.astype(np.float16))
    save_file(bogus, os.path.join(tmp, "loras", "unmapped.safetensors"))
    del log.records[:]
    (m2,) = nodes.LoraLoaderModelOnly().load_lora_model_only(m0, "unmapped.safetensors", 1.0)
    msgs2 = sorted(log.problems())
    (m3,) = nodes.LoraLoaderModelOnly().load_lora_model_only(m0, DIFFUSERS, 1.0)
    not_mapped = sorted(k for k in extra if not k.startswith(last))
    want = sorted(["lora key not loaded: " + k for k in not_mapped] +
                  ["NOT LOADED diffusion_model.joint_blocks.{}.context_block.{}.weight".format(
                      DEPTH - 1, m) for m in ("attn.proj", "mlp.fc1")])
    assert msgs2 == want, msgs2
    assert set(m2.patches) == set(m3.patches)
    out["diffusers file + unmappable keys"] = {
        "extra_keys": sorted(extra), "logged": msgs2,
        "same_patched_keys_as_without": set(m2.patches) == set(m3.patches)}
    for k, v in out.items():
        print("unmapped:", k, json.dumps(v)[:700])
    return out


def build_base(nodes, tmp, torch):
    """sd3_pipeline's tiny_sd3 checkpoint (from its parts, as its main()
    builds it) in tmp/checkpoints, checked against sd3/expected.json."""
    with open(os.path.join(ROOT, "tests", "reference", "sd3", "expected.json")) as f:
        ref = json.load(f)
    ref_files = {x["name"]: x for x in ref["files"]}

    def write(folder, name, keys, scaled={}):
        keys = sorted(keys)
        digest = fam.write_file(os.path.join(tmp, folder, name), keys, scaled, torch)
        if name in ref_files:
            assert [list(k) for k in keys] == [list(k) for k in ref_files[name]["keys"]], name
            assert str(digest) == ref_files[name]["checksum_f16"], name
            assert dict(scaled) == ref_files[name]["scaled"], name
    write("clip", "tiny_clip_l.safetensors", fam.clip_hf_keys(torch, s3.CLIP_L, False))
    write("clip", "tiny_clip_g.safetensors", fam.clip_hf_keys(torch, s3.CLIP_G, True))
    write("clip", "tiny_t5xxl_sd3.safetensors", s3.t5_keys(torch))
    write("vae", "_sd3_vae.safetensors", fp.vae_keys(torch))
    write("unet", "_mmdit_" + CKPT, s3.mmdit_keys(torch, CKPT))
    v3 = s3.v3_nodes()
    write("checkpoints", CKPT, s3.make_checkpoint(nodes, v3, tmp, CKPT, torch),
          scaled={s3.POS_EMBED: s3.POS_SCALE[s3.VARIANTS[CKPT][2]]})
    return ref, v3


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import folder_paths
    import logging
    import nodes

    log = lp.LogCapture()
    logging.getLogger().addHandler(log)
    tmp = tempfile.mkdtemp()
    try:
        s3.patch_comfy(tmp, torch)
        for folder, kind in {"checkpoints": "checkpoints", "unet": "diffusion_models",
                             "clip": "text_encoders", "vae": "vae", "loras": "loras"}.items():
            d = os.path.join(tmp, folder)
            os.makedirs(d, exist_ok=True)
            folder_paths.add_model_folder_path(kind, d, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))
        sd3_ref, v3 = build_base(nodes, tmp, torch)

        model, clip = load_base(nodes)
        assert type(model.model.model_config).__name__ == "SD3"
        specs, groups = lora_specs(model, clip)
        del model, clip

        out = {"uses_files": {"sd3/expected.json": [CKPT]}, "files": [], "key_map": {},
               "unmapped": {}, "workflows": {}}
        data = {}
        for name, targets in specs.items():
            keys, scaled, alphas = file_keys(name, targets)
            data[name] = (keys, scaled, alphas)
            digest = lp.write_lora(os.path.join(tmp, "loras", name), keys, scaled, alphas, torch)
            out["files"].append({"folder": "loras", "name": name, "format": FORMATS[name],
                                 "keys": keys, "scaled": scaled, "alphas": alphas,
                                 "checksum_f16": str(digest)})
            out["key_map"][name] = [t.record() for t in targets]
            if sub:
                continue
            print("lora", name, "prefixes", len(targets), "keys", len(keys),
                  "alphas", sorted(set(alphas.values())), "checksum", digest)
            for t in targets:
                r = t.record()
                print("   {:62s} -> {}{}{} alpha {} scale {}".format(
                    r["prefix"], r["target"],
                    "" if r["slice"] is None else " slice " + str(r["slice"]),
                    "" if r["function"] is None else " fn " + r["function"],
                    r["alpha"], r["scale"]))

        for name in WORKFLOWS:
            path = os.path.join(ROOT, "graphs", name + ".json")
            if not os.path.exists(path) and not sub:
                with open(path, "w") as f:
                    f.write(fl.graph_text(graph_for(name)))

        if not sub:
            print("CLIP LoRA name groups (prefix -> encoder: count):", json.dumps(groups))
            import comfy.lora
            import comfy.utils
            model, clip = load_base(nodes)
            key_map = comfy.lora.model_lora_keys_unet(model.model, {})
            key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, key_map)
            for name, targets in specs.items():
                lora = comfy.utils.load_torch_file(os.path.join(tmp, "loras", name), safe_load=True)
                del log.records[:]
                loaded = comfy.lora.load_lora(lora, key_map)
                assert not log.problems(), log.problems()
                want = {}
                for t in targets:
                    if t.style == "diff_b":
                        want[t.key] = ("diff", None)
                    else:
                        k = t.key if t.slice is None and t.function is None else \
                            ((t.key, t.slice) if t.function is None else (t.key, None, t.function))
                        want[k] = ("lora", t)
                assert set(loaded) == set(want), set(loaded) ^ set(want)
                for k, (kind, t) in want.items():
                    v = loaded[k]
                    if kind == "lora":
                        assert type(v).__name__ == "LoRAAdapter", (k, v)
                        alpha = v.weights[2]
                        assert (alpha is None) == (t.alpha is None) and \
                            (alpha is None or abs(alpha - t.alpha) < 1e-6), (k, alpha, t.alpha)
                        assert v.weights[1].shape[0] == RANK
                    else:
                        assert v[0] == "diff", (k, v)
                print("load_lora", name, "patch dict entries", len(loaded), "sliced",
                      sum(not isinstance(k, str) and k[1] is not None for k in loaded),
                      "with function", sum(not isinstance(k, str) and len(k) > 2 for k in loaded))
            del model, clip
            check_merge(nodes, torch, specs, data, log)
            out["unmapped"] = unmapped(nodes, torch, tmp, log)
            f64_latents, perturbed_latents = sd1.spread_runs(__file__)

        base_lat = np.frombuffer(base64.b64decode(
            sd3_ref["workflows"][BASE_GRAPH]["latent_f32"]), "<f4")
        node_ns = types.SimpleNamespace(NODE_CLASS_MAPPINGS={**nodes.NODE_CLASS_MAPPINGS, **v3})
        for name, stack in WORKFLOWS.items():
            path = os.path.join(ROOT, "graphs", name + ".json")
            g = graph_for(name)
            with open(path) as f:
                prompt = json.load(f)
            assert prompt == g, name
            del log.records[:]
            saved, latents = sd1.run_workflow(prompt, node_ns, torch)
            assert not log.problems(), (name, log.problems())
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            assert np.isfinite(lat).all() and np.isfinite(img).all(), name
            if sub:
                out["workflows"][name] = sd1.b64(lat.astype("<f4"))
                continue
            assert img.std() > 0.02, (name, float(img.std()))
            clipped = float(((img <= 0.0) | (img >= 1.0)).mean())
            assert clipped < 0.2, (name, clipped)
            _, plain = sd1.run_workflow(lp.without_loras(prompt), node_ns, torch)
            plain = plain[0].float().numpy().reshape(-1)
            plain_rel = float(np.abs(plain - base_lat).max() / np.abs(base_lat).max())
            assert plain_rel < 1e-5, (name, plain_rel)
            lora_rel = float(np.abs(lat.reshape(-1) - base_lat).max() / np.abs(base_lat).max())
            assert lora_rel > 1e-3, (name, lora_rel)

            def spread_to(latents):
                other = np.frombuffer(base64.b64decode(latents[name]), "<f4")
                return float(np.abs(lat.reshape(-1) - other).max() / np.abs(other).max())
            out["workflows"][name] = {
                "loras": [list(x) for x in stack],
                "f32_vs_f64_unet_rel": spread_to(f64_latents),
                "unet_rounding_rel": spread_to(perturbed_latents),
                "vs_tiny_sd3_txt2img_rel": lora_rel,
                "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
                "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4")),
                "image_range": [float(img.min()), float(img.max()), float(img.std())],
            }
            w = out["workflows"][name]
            print(name, "latent", lat.shape, "std", float(lat.std()), "image min/max/std",
                  w["image_range"], "clipped", clipped, "vs tiny_sd3_txt2img", lora_rel,
                  "(without LoRA nodes vs fixture", plain_rel, ") f32 vs f64",
                  w["f32_vs_f64_unet_rel"], "rounding", w["unet_rounding_rel"])
        if sub:
            print(json.dumps(out["workflows"]))
            return
        sd1.write_expected("sd3_lora", out)
    finally:
        logging.getLogger().removeHandler(log)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
