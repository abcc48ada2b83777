"""End-to-end references for Flux LoRAs in the layouts people download.

Tiny LoRA files are built for flux_pipeline.py's tiny dev model
(unet/tiny_flux_dev.safetensors: hidden 64, 2 double + 2 single blocks,
mlp 256) and its tiny CLIP-L, every key name taken from ComfyUI's own LoRA
key maps on the loaded models (comfy.lora.model_lora_keys_unet /
model_lora_keys_clip, which for Flux include comfy.utils.flux_to_diffusers),
every value from sd1_pipeline's `values(name, shape)` formula of the key as
spelled in the file, stored f16, rank 4 -- the lora_pipeline.py schema. The
workflows graphs/tiny_flux_lora_*.json (tiny_flux_txt2img.json with LoRA
nodes spliced in after the loaders) are run through ComfyUI's own node
classes on the CPU in f32, and tests/reference/flux_lora/expected.json gets:
  uses_files: the base model files, from flux/expected.json.
  files: per LoRA file as lora_pipeline's "loras" entries (folder "loras",
      name, format, keys sorted with shapes, scaled, alphas, checksum_f16:
      sd1_pipeline.checksum over all tensors in key order, alphas included
      as one f16 element each). tests/support write_fixture_entry /
      write_fixture_files read them.
  key_map: per file, per LoRA key prefix (what precedes .lora_up.weight /
      .lora_B.weight / .alpha / .diff_b), what ComfyUI made of it: target
      (the model or CLIP weight, or bias for .diff_b), slice [dim, start,
      length] of the target it patches (null: all of it), function (the
      name of the function ComfyUI applies to the delta, null: none),
      alpha (null: absent), rank (lora_down / lora_A rows), scale (alpha /
      rank, 1.0 without alpha).
  unmapped: what ComfyUI logs, and leaves out, for keys it cannot map.
  workflows: as flux: latent_shape, latent_f32, image_shape, image_f32,
      f32_vs_f64_unet_rel, unet_rounding_rel, image_range; plus loras (the
      LoRA nodes in chain order: class, file, strength_model,
      strength_clip) and vs_tiny_flux_txt2img_rel (max |latent - the flux
      fixture's tiny_flux_txt2img latent| / max |that latent|).

LoRA files (tensors f16, rank r = 4; lora_up / lora_B times UP_FACTOR 0.5,
recorded under "scaled"):
  tiny_flux_lora_kohya.safetensors (kohya sd-scripts networks/lora_flux.py
      names: "lora_unet_" + the BFL module path with "." -> "_"):
      N.lora_down.weight [4, in], N.lora_up.weight [out, 4], N.alpha.
      Both double blocks: img_attn_qkv, img_attn_proj, img_mlp_0, img_mlp_2,
      img_mod_lin, txt_attn_qkv, txt_attn_proj, txt_mlp_0, txt_mlp_2,
      txt_mod_lin; both single blocks: linear1 (the whole fused [448, 64]),
      linear2, modulation_lin; and img_in, txt_in, time_in_in_layer,
      vector_in_out_layer, guidance_in_in_layer, final_layer_linear,
      final_layer_adaLN_modulation_1. Alphas: KOHYA_* below.
  tiny_flux_lora_diffusers.safetensors (diffusers / PEFT, as ai-toolkit
      saves: "transformer." + diffusers module path, no alphas):
      N.lora_A.weight [4, in], N.lora_B.weight [out, 4]. Both
      transformer_blocks: attn.to_q/to_k/to_v (img qkv slices),
      attn.add_q_proj/add_k_proj/add_v_proj (txt qkv slices), attn.to_out.0,
      attn.to_add_out, ff.net.0.proj, ff.net.2, ff_context.net.0.proj,
      ff_context.net.2, norm1.linear, norm1_context.linear; both
      single_transformer_blocks: attn.to_q/to_k/to_v, proj_mlp (linear1
      slices), proj_out (linear2), norm.linear; and x_embedder,
      context_embedder, time_text_embed.timestep_embedder.linear_2,
      proj_out (final_layer.linear), norm_out.linear
      (final_layer.adaLN_modulation.1 with swap_scale_shift on the delta).
  tiny_flux_lora_clip.safetensors (kohya with the text encoder):
      lora_te1_text_model_encoder_layers_{0,1,2}_{self_attn_q/k/v/out_proj,
      mlp_fc1, mlp_fc2} (all CLIP-L layers; alphas CLIP_ALPHA, none on layer
      2's mlp_fc2) and lora_unet_ double_blocks_1_img_attn_qkv,
      double_blocks_1_txt_mlp_0, single_blocks_1_linear1 (alpha 2.0),
      single_blocks_0_linear2 (no alpha).
  tiny_flux_lora_comfy.safetensors (ComfyUI's own names, as TrainLoraNode
      writes them: "diffusion_model." + module path, .alpha 1.0 and .diff_b
      for biases), plus "diffusion_model.single_blocks.1.linear1_qkv" (the
      name ComfyUI gives the q/k/v part of linear1, rows 0..192):
      double_blocks.0.img_attn.qkv, double_blocks.0.img_attn.proj (+ diff_b),
      double_blocks.1.txt_mod.lin, single_blocks.0.linear2 (+ diff_b),
      single_blocks.1.modulation.lin (alpha 1.0), single_blocks.1.linear1_qkv
      (alpha 3.0). diff_b [out] times 0.05 (1-D, so 0.05 (1 + 0.1 u)).

Merging as ComfyUI does it (comfy/sd.py load_lora_for_models, comfy/lora.py
load_lora / calculate_weight, comfy/weight_adapter/lora.py,
comfy/model_patcher.py add_patches / patch_weight_to_device): each prefix
maps to a target weight, or (weight, (dim, start, length)) -- a slice -- or
(weight, None, function); per patch, in the order the LoRA nodes ran,
  W[slice] += function(strength * scale * (up @ down))  (f32, W an f32 copy)
scale = alpha / down.shape[0], 1.0 without .alpha; .diff_b adds
strength * diff_b to the bias. Checked here (asserted) against that formula
computed in f64 from the f16 values, for every workflow's stack.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/flux_lora.py
(media-only imports are stubbed as in sd1_pipeline.py; the base fixtures are
rebuilt in a temporary folder from flux_pipeline and checked against
flux/expected.json, not rewritten.)
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
import flux_pipeline as fp  # noqa: E402
import lora_pipeline as lp  # noqa: E402

ROOT = sd1.ROOT
RANK = lp.RANK
UP_FACTOR = lp.UP_FACTOR
DIFF_B_FACTOR = lp.LYCORIS_SCALE["diff_b"]
BASE_GRAPH = "tiny_flux_txt2img"
H = fp.FLUX["hidden_size"]
MLP = int(H * fp.FLUX["mlp_ratio"])
BASE_FILES = ["tiny_flux_dev.safetensors", "tiny_clip_l.safetensors",
              "tiny_t5xxl.safetensors", "tiny_flux_ae.safetensors"]

KOHYA = "tiny_flux_lora_kohya.safetensors"
DIFFUSERS = "tiny_flux_lora_diffusers.safetensors"
CLIP = "tiny_flux_lora_clip.safetensors"
COMFY = "tiny_flux_lora_comfy.safetensors"

# kohya: BFL module path (per block) -> alpha (None: no .alpha key).
KOHYA_DOUBLE = {"img_attn.qkv": 1.0, "img_attn.proj": 2.0, "img_mlp.0": 3.0, "img_mlp.2": 3.0,
                "img_mod.lin": 8.0, "txt_attn.qkv": 1.0, "txt_attn.proj": 2.0,
                "txt_mlp.0": 3.0, "txt_mlp.2": None, "txt_mod.lin": 8.0}
KOHYA_SINGLE = {"linear1": 1.0, "linear2": 2.0, "modulation.lin": 8.0}
KOHYA_OTHER = {"img_in": None, "txt_in": None, "time_in.in_layer": None,
               "vector_in.out_layer": 2.0, "guidance_in.in_layer": None,
               "final_layer.linear": 2.0, "final_layer.adaLN_modulation.1": None}
# diffusers: module paths (no alphas in PEFT files).
DIFFUSERS_DOUBLE = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out", "ff.net.0.proj",
                    "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear",
                    "norm1_context.linear"]
DIFFUSERS_SINGLE = ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out", "norm.linear"]
DIFFUSERS_OTHER = ["x_embedder", "context_embedder", "time_text_embed.timestep_embedder.linear_2",
                   "proj_out", "norm_out.linear"]
# The slices ComfyUI's flux_to_diffusers gives (dim, start, length), asserted.
SLICES = {"attn.to_q": (0, 0, H), "attn.to_k": (0, H, H), "attn.to_v": (0, 2 * H, H),
          "attn.add_q_proj": (0, 0, H), "attn.add_k_proj": (0, H, H),
          "attn.add_v_proj": (0, 2 * H, H), "proj_mlp": (0, 3 * H, 4 * H)}
# CLIP file: CLIP-L module -> alpha; layer 2 mlp_fc2 without alpha.
CLIP_ALPHA = {"self_attn_q_proj": 2.0, "self_attn_k_proj": 2.0, "self_attn_v_proj": 2.0,
              "self_attn_out_proj": 2.0, "mlp_fc1": 6.0, "mlp_fc2": 6.0}
CLIP_UNET = {"double_blocks.1.img_attn.qkv": 2.0, "double_blocks.1.txt_mlp.0": 2.0,
             "single_blocks.1.linear1": 2.0, "single_blocks.0.linear2": None}
# ComfyUI-trained names: module -> (alpha, with diff_b)
COMFY_TARGETS = {"double_blocks.0.img_attn.qkv": (1.0, False),
                 "double_blocks.0.img_attn.proj": (1.0, True),
                 "double_blocks.1.txt_mod.lin": (1.0, False),
                 "single_blocks.0.linear2": (1.0, True),
                 "single_blocks.1.modulation.lin": (1.0, False),
                 "single_blocks.1.linear1_qkv": (3.0, False)}

# Workflows: LoRA nodes in chain order (class, file, strength_model,
# strength_clip or None).
WORKFLOWS = {
    "tiny_flux_lora_kohya": [("LoraLoaderModelOnly", KOHYA, 0.8, None)],
    "tiny_flux_lora_diffusers": [("LoraLoaderModelOnly", DIFFUSERS, 1.0, None)],
    "tiny_flux_lora_stack": [("LoraLoader", CLIP, 0.7, 0.5),
                             ("LoraLoaderModelOnly", DIFFUSERS, -0.4, None)],
    "tiny_flux_lora_comfy": [("LoraLoaderModelOnly", COMFY, 1.0, None)],
}
FORMATS = {
    KOHYA: "kohya sd-scripts (lora_unet_*, lora_down/lora_up, alpha)",
    DIFFUSERS: "diffusers / PEFT as ai-toolkit saves (transformer.*, lora_A/lora_B, no alpha)",
    CLIP: "kohya with text encoder (lora_te1_* CLIP-L + lora_unet_*)",
    COMFY: "ComfyUI names as TrainLoraNode saves (diffusion_model.*, lora_down/lora_up, "
           "alpha, diff_b) plus ComfyUI's linear1_qkv",
}


class Target:
    """One LoRA key prefix and what ComfyUI maps it to.
    style: "kohya" (lora_down/lora_up), "peft" (lora_A/lora_B), "diff_b".
    key: model / CLIP state-dict key patched; slice: (dim, start, length)
    or None; function: callable applied to the delta, or None; shape: the
    patched region's shape."""

    def __init__(self, prefix, style, alpha, mapped, state):
        self.prefix, self.style, self.alpha = prefix, style, alpha
        fn = None
        sl = None
        if isinstance(mapped, str):
            key = mapped
        else:
            key, sl = mapped[0], mapped[1]
            if len(mapped) > 2:
                fn = mapped[2]
        if style == "diff_b":
            key = key[:-len(".weight")] + ".bias"
        self.key, self.slice, self.function = key, (None if sl is None else tuple(sl)), fn
        shape = list(state[key].shape)
        if self.slice is not None:
            d, start, length = self.slice
            assert start + length <= shape[d], (prefix, self.slice, shape)
            shape[d] = length
        self.shape = shape

    def keys(self):
        """[(key, shape)], {key: factor}, {alpha key: alpha}"""
        p, (out, inn) = self.prefix, (self.shape + [None])[:2]
        if self.style == "diff_b":
            k = p + ".diff_b"
            return [(k, [out])], {k: DIFF_B_FACTOR}, {}
        down, up = {"kohya": (".lora_down.weight", ".lora_up.weight"),
                    "peft": (".lora_A.weight", ".lora_B.weight")}[self.style]
        keys = [(p + down, [RANK, inn]), (p + up, [out, RANK])]
        alphas = {}
        if self.alpha is not None:
            keys.append((p + ".alpha", []))
            alphas[p + ".alpha"] = self.alpha
        return keys, {p + up: UP_FACTOR}, alphas

    def scale(self):
        return 1.0 if self.alpha is None else self.alpha / RANK

    def delta(self, data, full_shape, torch):
        """The delta this prefix adds to the whole target at strength 1, f64,
        from the f16 values (the formula of the docstring)."""
        keys, scaled, alphas = data
        shapes = dict(keys)

        def get(suffix):
            k = self.prefix + suffix
            return lp.lora_value(k, shapes[k], scaled, alphas).astype(np.float64)
        if self.style == "diff_b":
            d = get(".diff_b")
        else:
            down, up = {"kohya": (".lora_down.weight", ".lora_up.weight"),
                        "peft": (".lora_A.weight", ".lora_B.weight")}[self.style]
            d = self.scale() * (get(up) @ get(down)).reshape(self.shape)
        if self.function is not None:
            d = self.function(torch.from_numpy(d)).numpy()
        out = np.zeros(full_shape)
        if self.slice is None:
            out += d
        else:
            dim, start, length = self.slice
            idx = [slice(None)] * len(full_shape)
            idx[dim] = slice(start, start + length)
            out[tuple(idx)] += d
        return out

    def record(self):
        return {"prefix": self.prefix, "target": self.key,
                "slice": None if self.slice is None else list(self.slice),
                "function": None if self.function is None else self.function.__name__,
                "alpha": self.alpha, "rank": None if self.style == "diff_b" else RANK,
                "scale": None if self.style == "diff_b" else self.scale()}


def lora_specs(model, clip):
    """{file: [Target]}, every name looked up in ComfyUI's key maps."""
    import comfy.lora
    unet_map = comfy.lora.model_lora_keys_unet(model.model, {})
    clip_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})
    state = model.model.state_dict()
    clip_state = clip.cond_stage_model.state_dict()

    def unet(prefix, style, alpha):
        return Target(prefix, style, alpha, unet_map[prefix], state)

    def kohya(module, alpha):
        t = unet("lora_unet_" + module.replace(".", "_"), "kohya", alpha)
        assert (t.key, t.slice, t.function) == ("diffusion_model." + module + ".weight", None, None)
        return t

    kohya_file = []
    for i in range(fp.FLUX["depth"]):
        for m, a in KOHYA_DOUBLE.items():
            kohya_file.append(kohya("double_blocks.{}.{}".format(i, m), a))
    for i in range(fp.FLUX["depth_single_blocks"]):
        for m, a in KOHYA_SINGLE.items():
            kohya_file.append(kohya("single_blocks.{}.{}".format(i, m), a))
    for m, a in KOHYA_OTHER.items():
        kohya_file.append(kohya(m, a))

    diffusers_file = []
    for blocks, names, n in (("transformer_blocks", DIFFUSERS_DOUBLE, fp.FLUX["depth"]),
                             ("single_transformer_blocks", DIFFUSERS_SINGLE,
                              fp.FLUX["depth_single_blocks"])):
        for i in range(n):
            for m in names:
                t = unet("transformer.{}.{}.{}".format(blocks, i, m), "peft", None)
                assert t.slice == SLICES.get(m), (t.prefix, t.slice)
                diffusers_file.append(t)
    for m in DIFFUSERS_OTHER:
        t = unet("transformer." + m, "peft", None)
        assert (t.function is not None) == (m == "norm_out.linear"), t.prefix
        diffusers_file.append(t)

    clip_file = []
    te = sorted(k for k in clip_map if k.startswith("lora_te1_text_model_encoder_layers_"))
    assert len(te) == 6 * fp.CLIP_L["num_hidden_layers"], te
    for prefix in te:
        module = prefix.split("_", 7)[-1]
        alpha = None if prefix.endswith("layers_2_mlp_fc2") else CLIP_ALPHA[module]
        t = Target(prefix, "kohya", alpha, clip_map[prefix], clip_state)
        assert t.key.startswith("clip_l.transformer.text_model.encoder.layers."), t.key
        clip_file.append(t)
    for m, a in CLIP_UNET.items():
        clip_file.append(kohya(m, a))

    comfy_file = []
    for m, (alpha, diff_b) in COMFY_TARGETS.items():
        t = unet("diffusion_model." + m, "kohya", alpha)
        if m.endswith("linear1_qkv"):
            assert (t.key, t.slice) == ("diffusion_model." + m[:-4] + ".weight", (0, 0, 3 * H))
        else:
            assert (t.key, t.slice) == ("diffusion_model." + m + ".weight", None)
        comfy_file.append(t)
        if diff_b:
            comfy_file.append(unet("diffusion_model." + m, "diff_b", None))
    return {KOHYA: kohya_file, DIFFUSERS: diffusers_file, CLIP: clip_file, COMFY: comfy_file}


def file_keys(targets):
    keys, scaled, alphas = [], {}, {}
    for t in targets:
        k, s, a = t.keys()
        keys += k
        scaled.update(s)
        alphas.update(a)
    keys.sort()
    assert len({k for k, _ in keys}) == len(keys)
    return keys, scaled, alphas


def graph_for(name):
    """tiny_flux_txt2img.json with WORKFLOWS[name]'s LoRA nodes (ids 20, 21,
    ...) between the loaders and their users, prefixes renamed."""
    with open(os.path.join(ROOT, "graphs", BASE_GRAPH + ".json")) as f:
        base = json.load(f)
    assert base["1"]["class_type"] == "UNETLoader" and base["2"]["class_type"] == "DualCLIPLoader"
    model, clip = ["1", 0], ["2", 0]
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
            elif v == ["2", 0]:
                node["inputs"][k] = clip
            elif k == "filename_prefix":
                node["inputs"][k] = v.replace(BASE_GRAPH, name)
        g[nid] = node
        if nid == "13":
            g.update(lora_nodes)
    assert len(g) == len(base) + len(lora_nodes)
    return g


def graph_text(g):
    return "{\n" + ",\n".join("  {}: {}".format(json.dumps(k), json.dumps(v))
                              for k, v in g.items()) + "\n}\n"


def apply_stack(nodes, model, clip, stack):
    for cls, lora, sm, sc in stack:
        if cls == "LoraLoader":
            model, clip = nodes.LoraLoader().load_lora(model, clip, lora, sm, sc)
        else:
            (model,) = nodes.LoraLoaderModelOnly().load_lora_model_only(model, lora, sm)
    return model, clip


def check_merge(nodes, torch, specs, data, log):
    """Each workflow's LoRA nodes on the loaded base: the patch sets are
    exactly the targets, nothing is left unloaded, and the merged weights
    match the f64 formula."""
    import comfy.lora
    for name, stack in WORKFLOWS.items():
        (m0,) = nodes.UNETLoader().load_unet("tiny_flux_dev.safetensors", "default")
        (c0,) = nodes.DualCLIPLoader().load_clip("tiny_clip_l.safetensors",
                                                 "tiny_t5xxl.safetensors", "flux")
        del log.records[:]
        model, clip = apply_stack(nodes, m0, c0, stack)
        assert not log.problems(), (name, log.problems())
        want = {}
        for cls, lora, sm, sc in stack:
            for t in specs[lora]:
                is_clip = t.key.startswith("clip_l.")
                if is_clip and cls != "LoraLoader":
                    continue
                want.setdefault(t.key, []).append((sc if is_clip else sm, lora, t))
        unet_want = {k for k in want if not k.startswith("clip_l.")}
        assert set(model.patches) == unet_want, set(model.patches) ^ unet_want
        clip_want = set(want) - unet_want
        assert set(clip.patcher.patches) == clip_want, set(clip.patcher.patches) ^ clip_want
        worst, least = {}, 1.0
        for k, items in want.items():
            is_clip = k in clip_want
            patcher = clip.patcher if is_clip else model
            orig = (c0.patcher if is_clip else m0).model.state_dict()[k]
            patches = patcher.patches[k]
            assert len(patches) == len(items), k
            for (strength, _, _, offset, function), (s, _, t) in zip(patches, items):
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
            kind = ("clip " if is_clip else "unet ") + str(orig.dtype).replace("torch.", "")
            worst[kind] = max(worst.get(kind, 0.0), err)
            change = float(np.abs(merged - base).max() / np.abs(base).max())
            assert change > 1e-3, (name, k, change)
            least = min(least, change)
        print("merge", name, "unet keys", len(unet_want), "clip keys", len(clip_want),
              "patches", sum(len(v) for v in want.values()),
              "max rel err vs f64 formula", worst, "least rel weight change", least)
        if clip_want:
            text = "a lighthouse at dusk"
            e0 = c0.encode_from_tokens(c0.tokenize(text), return_pooled=True)
            e1 = clip.encode_from_tokens(clip.tokenize(text), return_pooled=True)
            rel = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(e1, e0)]
            print("   CLIP LoRA: rel change (T5 cond, CLIP-L pooled)", rel)
            assert rel[0] == 0.0 and rel[1] > 1e-2, rel


def unmapped(nodes, torch, tmp, log):
    """What ComfyUI does with keys it cannot map: the CLIP file through
    LoraLoaderModelOnly (its lora_te1_ keys), and a file with keys no map
    has (a norm scale in kohya naming, a T5 key for a model-only load, a
    misspelled module)."""
    from safetensors.torch import load_file, save_file
    out = {}
    (m0,) = nodes.UNETLoader().load_unet("tiny_flux_dev.safetensors", "default")
    del log.records[:]
    (m1,) = nodes.LoraLoaderModelOnly().load_lora_model_only(m0, CLIP, 1.0)
    msgs = sorted(log.problems())
    out["LoraLoaderModelOnly(" + CLIP + ")"] = {
        "logged": msgs, "patched_model_keys": len(m1.patches)}
    bogus = load_file(os.path.join(tmp, "loras", KOHYA))
    extra = {
        "lora_unet_double_blocks_0_img_attn_norm_query_norm.lora_down.weight": [RANK, 32],
        "lora_unet_double_blocks_0_img_attn_norm_query_norm.lora_up.weight": [32, RANK],
        "lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight": [RANK, 32],
        "lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_up.weight": [32, RANK],
        "lora_unet_double_blocks_0_img_atn_qkv.alpha": [],
    }
    for k, shape in extra.items():
        v = sd1.values(k, shape) if shape else np.array(2.0)
        bogus[k] = torch.from_numpy(v.astype(np.float16))
    save_file(bogus, os.path.join(tmp, "loras", "unmapped.safetensors"))
    del log.records[:]
    (m2,) = nodes.LoraLoaderModelOnly().load_lora_model_only(m0, "unmapped.safetensors", 1.0)
    (m3,) = nodes.LoraLoaderModelOnly().load_lora_model_only(m0, KOHYA, 1.0)
    msgs2 = sorted(log.problems())
    assert msgs2 == sorted("lora key not loaded: " + k for k in extra), msgs2
    assert set(m2.patches) == set(m3.patches)
    out["kohya file + unmappable keys"] = {
        "extra_keys": sorted(extra), "logged": msgs2,
        "same_patched_keys_as_without": set(m2.patches) == set(m3.patches)}
    for k, v in out.items():
        print("unmapped:", k, json.dumps(v)[:600])
    return out


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
        fp.patch_comfy(tmp, torch)
        for folder, kind in {"unet": "diffusion_models", "clip": "text_encoders",
                             "vae": "vae", "loras": "loras"}.items():
            d = os.path.join(tmp, folder)
            os.makedirs(d, exist_ok=True)
            folder_paths.add_model_folder_path(kind, d, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))
        with open(os.path.join(ROOT, "tests", "reference", "flux", "expected.json")) as f:
            flux_ref = json.load(f)
        ref_files = {x["name"]: x for x in flux_ref["files"]}
        for folder, name, keys, dtype in fp.file_specs(torch):
            if name not in BASE_FILES:
                continue
            keys = sorted(keys)
            digest, _ = fp.write_file(os.path.join(tmp, folder, name), keys, dtype, torch)
            assert [list(k) for k in keys] == [list(k) for k in ref_files[name]["keys"]], name
            assert str(digest) == ref_files[name]["checksum_f16"], name

        (model,) = nodes.UNETLoader().load_unet("tiny_flux_dev.safetensors", "default")
        (clip,) = nodes.DualCLIPLoader().load_clip("tiny_clip_l.safetensors",
                                                   "tiny_t5xxl.safetensors", "flux")
        assert type(model.model.model_config).__name__ == "Flux"
        specs = lora_specs(model, clip)
        del model, clip

        out = {"uses_files": {"flux/expected.json": BASE_FILES}, "files": [], "key_map": {},
               "unmapped": {}, "workflows": {}}
        data = {}
        for name, targets in specs.items():
            keys, scaled, alphas = file_keys(targets)
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
                    f.write(graph_text(graph_for(name)))

        if not sub:
            # ComfyUI's own load_lora on each file: the patch dict's keys are
            # exactly the targets (with slices / functions), all keys loaded.
            import comfy.lora
            import comfy.utils
            (model,) = nodes.UNETLoader().load_unet("tiny_flux_dev.safetensors", "default")
            (clip,) = nodes.DualCLIPLoader().load_clip("tiny_clip_l.safetensors",
                                                       "tiny_t5xxl.safetensors", "flux")
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
            flux_ref["workflows"][BASE_GRAPH]["latent_f32"]), "<f4")
        node_ns = types.SimpleNamespace(
            NODE_CLASS_MAPPINGS={**nodes.NODE_CLASS_MAPPINGS, **fp.v3_nodes()})
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
                "vs_tiny_flux_txt2img_rel": lora_rel,
                "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
                "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4")),
                "image_range": [float(img.min()), float(img.max()), float(img.std())],
            }
            w = out["workflows"][name]
            print(name, "latent", lat.shape, "std", float(lat.std()), "image min/max/std",
                  w["image_range"], "clipped", clipped, "vs tiny_flux_txt2img", lora_rel,
                  "(without LoRA nodes vs fixture", plain_rel, ") f32 vs f64",
                  w["f32_vs_f64_unet_rel"], "rounding", w["unet_rounding_rel"])
        if sub:
            print(json.dumps(out["workflows"]))
            return
        sd1.write_expected("flux_lora", out)
    finally:
        logging.getLogger().removeHandler(log)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
