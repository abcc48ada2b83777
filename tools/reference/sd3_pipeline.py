"""End-to-end and component references for Stable Diffusion 3 / 3.5.

The Flux reference (tools/reference/flux_pipeline.py) extended to SD3's
MMDiT. Tiny models are built in the layouts of the files people download,
every tensor's name and shape taken from ComfyUI's own classes (MMDiT in
comfy/ldm/modules/diffusionmodules/mmdit.py, CLIPTextModel, T5 in
comfy/text_encoders/t5.py, AutoencodingEngine with the diffusionmodules
Encoder/Decoder), every value from sd1_pipeline's `values(name, shape)`
formula of the tensor's name as it is spelled in that file, stored f16. The
workflows in graphs/tiny_sd3*.json / tiny_sd35*.json are then run through
ComfyUI's own node classes on the CPU in f32, and
tests/reference/sd3/expected.json gets:
  files: as in flux/families: folder, name, sorted keys with shapes,
      scaled ({key: factor}: the tensor's formula values times factor in
      f32 before the f16 cast, as in families; here each checkpoint's
      model.diffusion_model.pos_embed, below), checksum_f16
      (sd1_pipeline.checksum of the f16 values).
  workflows: per graph, as flux: latent_shape, latent_f32, image_shape,
      image_f32 (base64 little-endian f32), f32_vs_f64_unet_rel,
      unet_rounding_rel (sd1_pipeline's spreads, the MMDiT in place of the
      UNet), image_range [min, max, std].
  components:
    mmdit_forward: {checkpoint name: [cases]}: each variant's MMDiT forward
        (ComfyUI's model in f32: diffusion_model(x, timesteps, context, y))
        for seeded random inputs, with the output; latents 8x8, 6x10 (patch
        counts 3x5: pos_embed cropped off-centre) and 7x9 (padded
        circularly to 8x10, output cropped back). Cases as flux_forward:
        x/context/y shapes and base64 f32, timestep (ComfyUI's sigma*1000),
        out.
    sd3_cond: ComfyUI's SD3 CLIP encode (clip.encode_from_tokens(tokenize(
        text), return_pooled=True)) for one weighted prompt: "triple"
        (TripleCLIPLoader on the clip/ files), "clip_only" (DualCLIPLoader
        type sd3, clip_l + clip_g) and "checkpoint" (tiny_sd3's own encoders,
        whose weights differ: values are of the names in that file); and
        "triple_empty_none": CLIPTextEncodeSD3 with all three texts empty and
        empty_padding "none" (the triple workflow's negative). Each: cond and
        pooled shapes and base64 f32.

Files:
  checkpoints/tiny_sd3.safetensors (SD3 medium style),
  checkpoints/tiny_sd35_large.safetensors (qk_norm rms: attn.ln_q/ln_k),
  checkpoints/tiny_sd35_medium.safetensors (qk_norm rms, MMDiT-X dual
      attention x_block.attn2.* in joint block 0, pos_embed 24x24):
      the layout comfy.sd.save_checkpoint (CheckpointSave) writes for the
      MMDiT + TripleCLIP + VAE (taken from a real save, asserted):
      model.diffusion_model.*, text_encoders.clip_l.transformer.* (with
      text_projection.weight), text_encoders.clip_g.transformer.* (with
      text_projection.weight), text_encoders.t5xxl.transformer.*,
      first_stage_model.* (encoder/decoder, no quant_conv/post_quant_conv,
      as sd3_medium*.safetensors). 0-dim tensors (logit_scale) not written.
      MMDiT: depth 2 -> hidden 64*2 = 128, 2 heads of 64 (ComfyUI's fixed
      rule, no patch), patch 2, in/out 16, mlp 4x, qkv bias,
      pos_embed [1, P*P, 128] with P 16 (24 for medium), adm_in_channels
      192 (= 64 CLIP-L pooled + 128 CLIP-G projected pooled), context
      256 (the tiny T5's width; > 64 + 128 so the zero padding of the
      CLIP-L|G context is exercised, as 4096 > 768 + 1280).
  clip/tiny_clip_l.safetensors, clip/tiny_clip_g.safetensors: families'
      tiny CLIP-L (HF layout, no projection) and CLIP-G (32 layers, 128
      wide, text_projection.weight), checked against that fixture.
  clip/tiny_t5xxl_sd3.safetensors: flux's tiny T5 layout with d_model 256,
      d_kv 16, 4 heads, d_ff 128, 2 layers, the real vocab.

ComfyUI only recognises full-size parts. Relaxed here, nothing else:
  * flux_pipeline.patch_comfy: the tiny CLIP-L config default, the tiny
      VAE widths for the AutoencodingEngine (no-quant-conv) path (its Flux
      detection patch is unused here).
  * SDClipModel.__init__ wrapped (as families/flux do) to give the tiny
      CLIP-G config for clip_config_bigg.json and this tiny T5 config for
      t5_config_xxl.json.
  * SD3ClipModel.encode_token_weights hard-codes the full widths: 4096
      (pad of the L|G context, and the (1, 77, 4096) zeros), 768 and 1280
      (zero pooled / left pad of a missing CLIP-L or -G) and 2048 (zero
      pooled). Its code object's constants are replaced by 256, 64, 128
      and 192 (the exact constant tuple is asserted first); the bytecode is
      ComfyUI's.
Model detection (depth from x_embedder, heads = depth, pos_embed size,
qk_norm, dual-attention layers, adm and context widths) is not patched.
Not patched either: CLIPLoader-style detection of a separate T5 looks for
encoder.block.23 (absent in a 2-layer T5), so dtype_t5 is the CLIP dtype
(f16 storage on the CPU, f32 compute), as in flux.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/sd3_pipeline.py
(media-only imports are stubbed as in sd1_pipeline.py.)
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
import families_pipeline as fam  # noqa: E402
import flux_pipeline as flux  # noqa: E402
import sd1_pipeline as sd1  # noqa: E402

ROOT = sd1.ROOT
WORKFLOWS = ["tiny_sd3_txt2img", "tiny_sd3_triple", "tiny_sd3_no_t5", "tiny_sd3_img2img",
             "tiny_sd35_large_txt2img", "tiny_sd35_medium_txt2img"]

CLIP_L = sd1.CLIP  # 64 wide; pooled unprojected in SD3 -> 64
CLIP_G = fam.CLIP_G  # 128 wide, projection 128
T5 = dict(flux.T5, d_model=256, d_kv=16, num_heads=4, d_ff=128)
CONTEXT = T5["d_model"]
ADM = CLIP_L["hidden_size"] + CLIP_G["projection_dim"]
DEPTH = 2
HIDDEN = 64 * DEPTH  # ComfyUI's MMDiT: hidden 64 * depth, heads = depth
VARIANTS = {  # checkpoint -> (qk_norm, dual-attention layers, pos_embed_max_size)
    "tiny_sd3.safetensors": (None, [], 16),
    "tiny_sd35_large.safetensors": ("rms", [], 16),
    "tiny_sd35_medium.safetensors": ("rms", [0], 24),
}
# pos_embed [1, P*P, 128] from the formula alone is U(-1, 1)/sqrt(P*P*128),
# too small to matter (a wrong crop would go unnoticed); it is multiplied
# (in f32, before the f16 cast; "scaled" in the fixture) by a power of two
# near sqrt(P*P*128), so its values span about +-0.7 / +-0.94 as the real
# sin-cos table's +-1.
POS_EMBED = "model.diffusion_model.pos_embed"
POS_SCALE = {16: 128.0, 24: 256.0}
CLIP_FILES = ["tiny_clip_l.safetensors", "tiny_clip_g.safetensors", "tiny_t5xxl_sd3.safetensors"]
# What SD3ClipModel.encode_token_weights hard-codes, and the tiny widths.
FULL_WIDTHS = {4096: CONTEXT, 768: CLIP_L["hidden_size"], 1280: CLIP_G["projection_dim"],
               2048: ADM}
ENCODE_CONSTS = (None, 'l', 'g', 't5xxl', 0, (1, 768), ('device',), 1, -1, ('dim',), (768, 0),
                 (1, 1280), 4096, 2, 'attention_mask', -2, (1, 77, 4096), (1, 2048))
CKPT_DIR = None  # set by main()
COND_PROMPT = "a (red:1.3) fox in the \\(deep\\) snow, [night], ((frost))"


def mmdit_config(name):
    """What ComfyUI's model_detection.detect_unet_config reads from the file."""
    qk, dual, p = VARIANTS[name]
    cfg = {"in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": DEPTH,
           "input_size": None, "adm_in_channels": ADM,
           "context_embedder_config": {"target": "torch.nn.Linear",
                                       "params": {"in_features": CONTEXT, "out_features": HIDDEN}},
           "num_patches": p * p, "pos_embed_max_size": p, "pos_embed_scaling_factor": None,
           "x_block_self_attn_layers": list(dual)}
    if qk is not None:
        cfg["qk_norm"] = qk
    return cfg


def mmdit_keys(torch, name):
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
    m = OpenAISignatureMMDITWrapper(**mmdit_config(name), dtype=torch.float32, device="meta",
                                    operations=comfy.ops.disable_weight_init)
    keys = [(k, list(t.shape)) for k, t in m.state_dict().items()]
    # The sd3_medium / sd3.5 layout (model.diffusion_model.* there).
    qk, dual, p = VARIANTS[name]
    h, mlp, hd = HIDDEN, 4 * HIDDEN, HIDDEN // DEPTH
    want = {"x_embedder.proj.weight": [h, 16, 2, 2], "x_embedder.proj.bias": [h],
            "pos_embed": [1, p * p, h],
            "t_embedder.mlp.0.weight": [h, 256], "t_embedder.mlp.0.bias": [h],
            "t_embedder.mlp.2.weight": [h, h], "t_embedder.mlp.2.bias": [h],
            "y_embedder.mlp.0.weight": [h, ADM], "y_embedder.mlp.0.bias": [h],
            "y_embedder.mlp.2.weight": [h, h], "y_embedder.mlp.2.bias": [h],
            "context_embedder.weight": [h, CONTEXT], "context_embedder.bias": [h],
            "final_layer.linear.weight": [4 * 16, h], "final_layer.linear.bias": [4 * 16],
            "final_layer.adaLN_modulation.1.weight": [2 * h, h],
            "final_layer.adaLN_modulation.1.bias": [2 * h]}

    def attn(p):
        want.update({p + "qkv.weight": [3 * h, h], p + "qkv.bias": [3 * h]})
        if qk:
            want.update({p + "ln_q.weight": [hd], p + "ln_k.weight": [hd]})

    for i in range(DEPTH):
        for part in ("context_block", "x_block"):
            pre = "joint_blocks.{}.{}.".format(i, part)
            pre_only = part == "context_block" and i == DEPTH - 1
            n = 9 if (part == "x_block" and i in dual) else (2 if pre_only else 6)
            want.update({pre + "adaLN_modulation.1.weight": [n * h, h],
                         pre + "adaLN_modulation.1.bias": [n * h]})
            attn(pre + "attn.")
            if not pre_only:
                want.update({pre + "attn.proj.weight": [h, h], pre + "attn.proj.bias": [h],
                             pre + "mlp.fc1.weight": [mlp, h], pre + "mlp.fc1.bias": [mlp],
                             pre + "mlp.fc2.weight": [h, mlp], pre + "mlp.fc2.bias": [h]})
            if part == "x_block" and i in dual:
                attn(pre + "attn2.")
                want.update({pre + "attn2.proj.weight": [h, h], pre + "attn2.proj.bias": [h]})
    assert dict(keys) == want, sorted(set(dict(keys)) ^ set(want))
    return keys


def t5_keys(torch):
    """flux_pipeline.t5_keys (ComfyUI's T5 keys, checked against the
    t5xxl_fp16 layout) for this wider config."""
    saved = flux.T5
    flux.T5 = T5
    try:
        return flux.t5_keys(torch)
    finally:
        flux.T5 = saved


def patch_comfy(tmp, torch):
    import comfy.sd1_clip
    import comfy.text_encoders.sd3_clip as sd3_clip

    flux.patch_comfy(tmp, torch)  # CLIP-L default, tiny AutoencodingEngine widths
    tiny = {"clip_config_bigg.json": CLIP_G, "t5_config_xxl.json": T5}
    init = comfy.sd1_clip.SDClipModel.__init__

    def tiny_init(self, *args, **kwargs):
        cfg = kwargs.get("textmodel_json_config")
        if isinstance(cfg, str) and os.path.basename(cfg) in tiny:
            kwargs["textmodel_json_config"] = dict(tiny[os.path.basename(cfg)])
        init(self, *args, **kwargs)
    comfy.sd1_clip.SDClipModel.__init__ = tiny_init

    f = sd3_clip.SD3ClipModel.encode_token_weights
    assert f.__code__.co_consts == ENCODE_CONSTS, f.__code__.co_consts

    def tiny_const(c):
        if isinstance(c, tuple):
            return tuple(tiny_const(x) for x in c)
        if type(c) is int:
            return FULL_WIDTHS.get(c, c)
        return c
    f.__code__ = f.__code__.replace(co_consts=tiny_const(f.__code__.co_consts))


def v3_nodes():
    """flux_pipeline.v3_nodes plus the SD3 V3 nodes, called the same way
    (class clone, its FUNCTION)."""
    import comfy_extras.nodes_sd3 as sd3
    out = flux.v3_nodes()

    def adapter(cls):
        class Node:
            FUNCTION = "run"

            def run(self, **kwargs):
                clone = cls.PREPARE_CLASS_CLONE({})
                return getattr(clone, clone.FUNCTION)(**kwargs).result
        return Node
    for cls in (sd3.TripleCLIPLoader, sd3.CLIPTextEncodeSD3):
        out[cls.__name__] = adapter(cls)
    return out


def make_checkpoint(nodes, v3, tmp, name, torch):
    """The key layout comfy.sd.save_checkpoint writes for the MMDiT (loaded
    from a prefix-less file), the TripleCLIPLoader encoders and the VAE."""
    import comfy.sd
    from safetensors import safe_open
    (model,) = nodes.UNETLoader().load_unet("_mmdit_" + name, "default")
    (clip,) = v3["TripleCLIPLoader"]().run(clip_name1=CLIP_FILES[0], clip_name2=CLIP_FILES[1],
                                           clip_name3=CLIP_FILES[2])
    (vae,) = nodes.VAELoader().load_vae("_sd3_vae.safetensors")
    path = os.path.join(tmp, "saved.safetensors")
    comfy.sd.save_checkpoint(path, model, clip, vae)
    with safe_open(path, "pt") as f:
        saved = [(k, list(f.get_slice(k).get_shape())) for k in f.keys()]
    os.remove(path)
    keys = sorted((k, s) for k, s in saved if len(s) > 0)
    dropped = sorted(k for k, s in saved if len(s) == 0)
    prefixes = sorted({".".join(k.split(".")[:3]) if k.startswith("text_encoders.")
                       else ".".join(k.split(".")[:2]) if k.startswith("model.")
                       else k.split(".")[0] for k, _ in keys})
    assert prefixes == ["first_stage_model", "model.diffusion_model",
                        "text_encoders.clip_g.transformer", "text_encoders.clip_l.transformer",
                        "text_encoders.t5xxl.transformer"], prefixes
    d = dict(keys)
    assert not any("quant_conv" in k for k in d)
    for part in ("clip_l", "clip_g"):
        assert d["text_encoders.{}.transformer.text_projection.weight".format(part)]
    mm = {k[len("model.diffusion_model."):]: s for k, s in keys
          if k.startswith("model.diffusion_model.")}
    assert mm == dict(mmdit_keys(torch, name))
    n = {p: sum(k.startswith(p) for k, _ in keys) for p in
         ("model.diffusion_model.", "first_stage_model.", "text_encoders.clip_l.",
          "text_encoders.clip_g.", "text_encoders.t5xxl.")}
    print("checkpoint", name, "(comfy.sd.save_checkpoint layout):", n, "0-dim dropped:", dropped)
    return keys


def check_models(nodes, v3, torch):
    import comfy.model_base as mb
    import comfy.model_detection
    import comfy.utils
    for name in VARIANTS:
        model, clip, vae = nodes.CheckpointLoaderSimple().load_checkpoint(name)[:3]
        cfg = type(model.model.model_config).__name__
        assert (cfg, model.model.model_type) == ("SD3", mb.ModelType.FLOW), (name, cfg)
        sd = comfy.utils.load_torch_file(os.path.join(CKPT_DIR, name))
        det = comfy.model_detection.detect_unet_config(sd, "model.diffusion_model.")
        assert det == mmdit_config(name), (name, det)
        dm = model.model.diffusion_model
        ms = model.model.model_sampling
        cm = clip.cond_stage_model
        assert dm.hidden_size == HIDDEN and dm.num_heads == DEPTH
        assert cm.clip_l is not None and cm.clip_g is not None and cm.t5xxl is not None
        assert vae.latent_channels == 16
        p = VARIANTS[name][2]
        pe = sd1.values(POS_EMBED, [1, p * p, HIDDEN]) * np.float32(POS_SCALE[p])
        assert np.array_equal(dm.pos_embed.float().numpy(), pe.astype(np.float16).astype(np.float32))
        print("detect", name, cfg, model.model.model_type.name, type(ms).__name__,
              "shift", ms.shift, "multiplier", ms.multiplier, "weights", dm.x_embedder.proj.weight.dtype,
              "hidden", dm.hidden_size, "heads", dm.num_heads, "latent format",
              type(model.model.latent_format).__name__, model.model.latent_format.scale_factor,
              model.model.latent_format.shift_factor)
        print("   unet_config", det)
        print("   clip", type(cm).__name__, "t5 weights", cm.t5xxl.transformer.shared.weight.dtype,
              "t5 mask", cm.t5_attention_mask, "vae", type(vae.first_stage_model).__name__)
    (clip,) = v3["TripleCLIPLoader"]().run(clip_name1=CLIP_FILES[0], clip_name2=CLIP_FILES[1],
                                           clip_name3=CLIP_FILES[2])
    cm = clip.cond_stage_model
    for part, keys in [("clip_l", fam.clip_hf_keys(torch, CLIP_L, False)),
                       ("clip_g", fam.clip_hf_keys(torch, CLIP_G, True)),
                       ("t5xxl", t5_keys(torch))]:
        state = getattr(cm, part).transformer.state_dict()
        for k, shape in keys:
            want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
            assert np.array_equal(state[k].float().numpy(), want), (part, k)
    print("TripleCLIPLoader: each file whole in its encoder; clip_l layer", cm.clip_l.layer,
          cm.clip_l.layer_idx, "projected pooled", cm.clip_l.return_projected_pooled,
          "| clip_g layer", cm.clip_g.layer, cm.clip_g.layer_idx, "projected pooled",
          cm.clip_g.return_projected_pooled, "| t5 special", cm.t5xxl.special_tokens,
          "min_length", clip.tokenizer.t5xxl.min_length)
    (clip,) = nodes.DualCLIPLoader().load_clip(CLIP_FILES[0], CLIP_FILES[1], "sd3")
    cm = clip.cond_stage_model
    assert cm.clip_l is not None and cm.clip_g is not None and cm.t5xxl is None
    print("DualCLIPLoader sd3 (clip_l + clip_g):", type(cm).__name__, "t5xxl None")


def enc(a):
    return sd1.b64(a.float().numpy().astype("<f4"))


def sd3_cond(nodes, v3):
    triple = v3["TripleCLIPLoader"]().run(clip_name1=CLIP_FILES[0], clip_name2=CLIP_FILES[1],
                                          clip_name3=CLIP_FILES[2])[0]
    dual = nodes.DualCLIPLoader().load_clip(CLIP_FILES[0], CLIP_FILES[1], "sd3")[0]
    ckpt = nodes.CheckpointLoaderSimple().load_checkpoint("tiny_sd3.safetensors")[1]
    out = {}

    def record(label, cond, pooled, **extra):
        c, p = cond.float(), pooled.float()
        assert np.isfinite(c.numpy()).all() and np.isfinite(p.numpy()).all()
        out[label] = dict(extra, cond_shape=list(c.shape), cond_f32=enc(c),
                          pooled_shape=list(p.shape), pooled_f32=enc(p))
        print("sd3 cond", label, "cond", list(c.shape), "std", float(c.std()), "pooled",
              list(p.shape), "std", float(p.std()))
        return c
    for label, clip in [("triple", triple), ("clip_only", dual), ("checkpoint", ckpt)]:
        tokens = clip.tokenize(COND_PROMPT)
        cond, pooled = clip.encode_from_tokens(tokens, return_pooled=True)
        c = record(label, cond, pooled, text=COND_PROMPT,
                   token_counts={k: [len(b) for b in v] for k, v in tokens.items()})
        if label == "clip_only":
            assert (c[..., ADM:] == 0).all() and list(c.shape) == [1, 77, CONTEXT]
        else:
            assert (c[:, :77, ADM:] == 0).all() and list(c.shape) == [1, 154, CONTEXT]
    (cond,) = v3["CLIPTextEncodeSD3"]().run(clip=triple, clip_l="", clip_g="", t5xxl="",
                                            empty_padding="none")
    ((c, meta),) = cond
    p = meta["pooled_output"]
    assert (p == 0).all()
    record("triple_empty_none", c, p, node="CLIPTextEncodeSD3", clip_l="", clip_g="", t5xxl="",
           empty_padding="none")
    return out


def mmdit_forward(nodes, torch):
    out = {}
    for name in VARIANTS:
        model = nodes.CheckpointLoaderSimple().load_checkpoint(name)[0]
        dm = model.model.diffusion_model
        assert dm.x_embedder.proj.weight.dtype == torch.float32
        gen = torch.Generator().manual_seed(20250314)
        cases = []
        for h, w in [(8, 8), (6, 10), (7, 9)]:
            x = torch.randn((1, 16, h, w), generator=gen)
            ctx = torch.randn((1, 20, CONTEXT), generator=gen)
            y = torch.randn((1, ADM), generator=gen)
            t = torch.tensor([750.0])
            with torch.inference_mode():
                o = dm(x, t, ctx, y)
            assert o.shape == x.shape and torch.isfinite(o).all()
            cases.append({"x_shape": list(x.shape), "x_f32": enc(x),
                          "context_shape": list(ctx.shape), "context_f32": enc(ctx),
                          "y_shape": list(y.shape), "y_f32": enc(y),
                          "timestep": float(t[0]),
                          "out_shape": list(o.shape), "out_f32": enc(o)})
            print("mmdit forward", name, list(x.shape), "out std", float(o.std()),
                  "abs max", float(o.abs().max()))
        out[name] = cases
    return out


def main():
    global CKPT_DIR
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import folder_paths
    import nodes

    tmp = tempfile.mkdtemp()
    try:
        patch_comfy(tmp, torch)
        out = {"files": [], "workflows": {}, "components": {}}
        folders = {"checkpoints": "checkpoints", "unet": "diffusion_models",
                   "clip": "text_encoders", "vae": "vae"}
        for folder, kind in folders.items():
            d = os.path.join(tmp, folder)
            os.makedirs(d, exist_ok=True)
            folder_paths.add_model_folder_path(kind, d, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))
        CKPT_DIR = os.path.join(tmp, "checkpoints")

        def write(folder, name, keys, listed=True, scaled={}):
            keys = sorted(keys)
            assert all(k in dict(keys) for k in scaled)
            digest = fam.write_file(os.path.join(tmp, folder, name), keys, scaled, torch)
            entry = {"folder": folder, "name": name, "keys": keys, "scaled": dict(scaled),
                     "checksum_f16": str(digest)}
            if listed:
                out["files"].append(entry)
                if not sub:
                    print("file", folder, name, "keys", len(keys), "checksum", digest)
            return entry

        with open(os.path.join(ROOT, "tests", "reference", "families", "expected.json")) as f:
            fam_files = {x["name"]: x for x in json.load(f)["files"]}
        for name, keys in [("tiny_clip_l.safetensors", fam.clip_hf_keys(torch, CLIP_L, False)),
                           ("tiny_clip_g.safetensors", fam.clip_hf_keys(torch, CLIP_G, True))]:
            entry = write("clip", name, keys)
            assert fam_files[name]["keys"] == [list(k) for k in entry["keys"]]
            assert fam_files[name]["checksum_f16"] == entry["checksum_f16"]
        write("clip", "tiny_t5xxl_sd3.safetensors", t5_keys(torch))
        # Parts the checkpoints are assembled from (not fixture files).
        write("vae", "_sd3_vae.safetensors", flux.vae_keys(torch), listed=False)
        for name in VARIANTS:
            write("unet", "_mmdit_" + name, mmdit_keys(torch, name), listed=False)

        v3 = v3_nodes()
        for name in VARIANTS:
            write("checkpoints", name, make_checkpoint(nodes, v3, tmp, name, torch),
                  scaled={POS_EMBED: POS_SCALE[VARIANTS[name][2]]})

        node_ns = types.SimpleNamespace(NODE_CLASS_MAPPINGS={**nodes.NODE_CLASS_MAPPINGS, **v3})
        if not sub:
            check_models(nodes, v3, torch)
            out["components"]["sd3_cond"] = sd3_cond(nodes, v3)
            out["components"]["mmdit_forward"] = mmdit_forward(nodes, torch)
            f64_latents, perturbed_latents = sd1.spread_runs(__file__)
        for name in WORKFLOWS:
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            saved, latents = sd1.run_workflow(prompt, node_ns, torch)
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            assert np.isfinite(lat).all() and np.isfinite(img).all(), name
            if sub:
                out["workflows"][name] = sd1.b64(lat.astype("<f4"))
                continue
            # Not flat, not saturated.
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
            }
            w = out["workflows"][name]
            print(name, "latent", lat.shape, "abs mean", float(np.abs(lat).mean()),
                  "std", float(lat.std()), "image", img.shape, "min/max/std", w["image_range"],
                  "clipped", float(((img <= 0.0) | (img >= 1.0)).mean()),
                  "f32 vs f64", w["f32_vs_f64_unet_rel"], "rounding", w["unet_rounding_rel"])
        if sub:
            print(json.dumps(out["workflows"]))
            return
        sd1.write_expected("sd3", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
