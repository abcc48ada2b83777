"""End-to-end and component references for Chroma (chroma-unlocked-v*).

The Flux reference (tools/reference/flux_pipeline.py) extended to Chroma, a
Flux-schnell derivative whose per-block modulation linears are replaced by
one small MLP (the "approximator", distilled_guidance_layer) and whose text
side is T5 alone. The tiny model is built in the layout of
chroma-unlocked-v*.safetensors, every tensor's name and shape taken from
ComfyUI's own class (Chroma in comfy/ldm/chroma/model.py), every value from
sd1_pipeline's `values(name, shape)` formula of the name, stored f16. The
T5 and the VAE are the Flux fixture's files, the same bytes (asserted by
their checksums against tests/reference/flux/expected.json). The workflows
in graphs/tiny_chroma_*.json run through ComfyUI's own node classes on the
CPU in f32, and tests/reference/chroma/expected.json gets, as for Flux:
  files: folder, name, sorted keys with shapes, scaled (empty),
      checksum_f16 (sd1_pipeline.checksum of the f16 values).
  workflows: per graph: latent_shape, latent_f32, image_shape, image_f32
      (base64 little-endian f32), f32_vs_f64_unet_rel, unet_rounding_rel
      (sd1_pipeline's spreads, the DiT in place of the UNet), image_range
      [min, max, std].
  components:
    chroma_tokens: for flux_pipeline's tricky prompts, ComfyUI's
        tokenize()["t5xxl"] of the CLIPLoader(type chroma) CLIP (its
        PixArtTokenizer: no padding, min_length 1), plain ("default") and
        after T5TokenizerOptions(min_padding 1, min_length 0)
        ("min_padding_1"): lists of batches of [token, weight].
    chroma_cond: for two prompts and three tokenizer settings (none;
        min_padding 1 / min_length 0; min_padding 0 / min_length 12, which
        pads a short prompt with pad tokens), what CLIPTextEncode returns:
        tokens, cond (f32), the conditioning dict's keys ("extra": each key
        with its value, null for None) and attention_mask (null: ComfyUI's
        chroma T5 returns none), plus t5_internal_mask: the mask
        sd1_clip.process_tokens computes on the way (1 up to and including
        the first end token, 0 after), which the chroma T5 does NOT use
        (enable_attention_masks False) and does not return.
    chroma_forward: the tiny DiT's forward (diffusion_model(x, timestep,
        context, guidance=..., attention_mask=...), f32) for seeded inputs:
        8x8 latent with a 9-token context, guidance 0, no mask (what every
        ComfyUI Chroma workflow passes); 6x10 latent with a 12-token context
        whose last 5 tokens are padding, masked with an additive
        [1, L, L] mask (L = txt + img tokens; 0 where a key is kept,
        -finfo(f32).max on the padded text keys, every query row alike),
        which is how ComfyUI's Chroma forwards a conditioning
        "attention_mask" to every attention (txt first, then img); and the
        8x8 latent at guidance 3.5 (as FluxGuidance would set). The first
        case also has mod_vectors (the approximator's output,
        [1, 344, hidden]) and the masked case img_equals_truncated (its
        output against the same input with the padded tokens dropped and no
        mask, max abs difference).

Files:
  unet/tiny_chroma.safetensors: Chroma keys without prefix (as
      chroma-unlocked-v*.safetensors): img_in [64, 64], txt_in [64, 32],
      distilled_guidance_layer.{in_proj [48, 64], layers.N.{in_layer,
      out_layer} [48, 48], norms.N.scale [48], out_proj [64, 48]} (N < 2),
      double_blocks.{0,1}.{img,txt}_{attn.qkv, attn.norm.{query,key}_norm.
      scale, attn.proj, mlp.0, mlp.2} (no *_mod), single_blocks.{0,1}.
      {linear1, linear2, norm.{query,key}_norm.scale} (no modulation),
      final_layer.linear (no adaLN_modulation). hidden_size 64, num_heads 2
      (head dim 32), axes_dim [4, 14, 14], theta 10000, mlp_ratio 4, depth
      2, depth_single_blocks 2, qkv_bias, context_in_dim 32 (the tiny T5),
      approximator in_dim 64 (= 16 timestep + 16 guidance + 32 mod-index
      features, fixed by the forward), hidden_dim 48, out_dim 64 (=
      hidden_size), n_layers 2.
  clip/tiny_t5xxl.safetensors, vae/tiny_flux_ae.safetensors: the Flux
      fixture's files (flux_pipeline.t5_keys / vae_keys), checksums equal.

ComfyUI only recognises full-size parts. Relaxed here, nothing else:
  * flux_pipeline.patch_comfy as it is (tiny T5 config for
      t5_config_xxl.json, the tiny VAE widths; its Flux detection patch does
      not touch a Chroma file).
  * model_detection.detect_unet_config: for "image_model": "chroma" ComfyUI
      hard-codes hidden_size 3072, num_heads 24, context_in_dim 4096,
      axes_dim [16, 56, 56], out_dim 3072, hidden_dim 5120, n_layers 5 (and
      in_channels = out_channels = 64, in_dim 64, which are kept); those
      seven are replaced by the tiny values (asserted against the file's
      shapes and its count of distilled_guidance_layer.layers.N).
      Everything else (depths, qkv_bias, theta, patch size, the class
      supported_models.Chroma, model_base.Chroma) is ComfyUI's own.
  * sd.detect_te_model: ComfyUI tells a T5-XXL by
      encoder.block.23.layer.1.DenseReluDense.wi_1.weight (24 layers); the
      2-layer tiny T5 would read as T5_BASE. A file that reads T5_BASE, has
      the gated wi_0/wi_1 and the T5 vocab with d_model 32 is called T5_XXL.
      t5xxl_detect still finds no block 23, so dtype_t5 falls back to the
      CLIP dtype (f16 storage on the CPU, f32 compute), as in the Flux
      fixture.
Cond and uncond run as separate DiT calls in these graphs (their context
lengths' LCM is over 4x the shorter: conds.CONDCrossAttn.can_concat), so
no context is repeat-padded. Everything else (the PixArt tokenizer, T5TokenizerOptions, token weights
against the all-pad empty sequence, no T5 mask, guidance 0, the
approximator, rope ids, pad_to_patch_size, ModelSamplingFlux shift 1.15,
the LCM-repeat batching of cond/uncond contexts, samplers, the Flux latent
scale/shift, the VAE) is ComfyUI's own.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/chroma_pipeline.py
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
import flux_pipeline as flux  # noqa: E402
import sd1_pipeline as sd1  # noqa: E402

ROOT = sd1.ROOT
WORKFLOWS = ["tiny_chroma_txt2img", "tiny_chroma_t5opts", "tiny_chroma_long"]
UNET = "tiny_chroma.safetensors"
T5_FILE = "tiny_t5xxl.safetensors"
VAE_FILE = "tiny_flux_ae.safetensors"

CHROMA = dict(in_channels=64, out_channels=64, context_in_dim=32, hidden_size=64,
              mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=2,
              axes_dim=[4, 14, 14], theta=10000, patch_size=2, qkv_bias=True,
              in_dim=64, out_dim=64, hidden_dim=48, n_layers=2)
# What ComfyUI hard-codes for Chroma, replaced by these.
CHROMA_TINY = {k: CHROMA[k] for k in ("hidden_size", "num_heads", "context_in_dim", "axes_dim",
                                      "out_dim", "hidden_dim", "n_layers")}
# T5TokenizerOptions(min_padding, min_length) variants for the components.
TOKEN_OPTIONS = [("default", None), ("min_padding_1", (1, 0)), ("min_length_12", (0, 12))]
COND_PROMPTS = ["a photo of a cat", "a (red:1.3) fox in the \\(deep\\) snow"]


def chroma_keys(torch):
    import comfy.ops
    from comfy.ldm.chroma.model import Chroma
    m = Chroma(image_model="chroma", dtype=torch.float32, device="meta",
               operations=comfy.ops.disable_weight_init, **CHROMA)
    keys = [(k, list(t.shape)) for k, t in m.state_dict().items()]
    # The chroma-unlocked-v*.safetensors layout.
    h, mlp = CHROMA["hidden_size"], int(CHROMA["hidden_size"] * CHROMA["mlp_ratio"])
    hd = h // CHROMA["num_heads"]
    a = CHROMA["hidden_dim"]
    want = {"img_in.weight": [h, CHROMA["in_channels"]], "img_in.bias": [h],
            "txt_in.weight": [h, CHROMA["context_in_dim"]], "txt_in.bias": [h],
            "distilled_guidance_layer.in_proj.weight": [a, CHROMA["in_dim"]],
            "distilled_guidance_layer.in_proj.bias": [a],
            "distilled_guidance_layer.out_proj.weight": [CHROMA["out_dim"], a],
            "distilled_guidance_layer.out_proj.bias": [CHROMA["out_dim"]],
            "final_layer.linear.weight": [CHROMA["out_channels"], h],
            "final_layer.linear.bias": [CHROMA["out_channels"]]}
    for i in range(CHROMA["n_layers"]):
        p = "distilled_guidance_layer."
        want.update({p + "layers.{}.in_layer.weight".format(i): [a, a],
                     p + "layers.{}.in_layer.bias".format(i): [a],
                     p + "layers.{}.out_layer.weight".format(i): [a, a],
                     p + "layers.{}.out_layer.bias".format(i): [a],
                     p + "norms.{}.scale".format(i): [a]})
    for i in range(CHROMA["depth"]):
        for s in ("img", "txt"):
            p = "double_blocks.{}.{}_".format(i, s)
            want.update({p + "attn.qkv.weight": [3 * h, h], p + "attn.qkv.bias": [3 * h],
                         p + "attn.norm.query_norm.scale": [hd],
                         p + "attn.norm.key_norm.scale": [hd],
                         p + "attn.proj.weight": [h, h], p + "attn.proj.bias": [h],
                         p + "mlp.0.weight": [mlp, h], p + "mlp.0.bias": [mlp],
                         p + "mlp.2.weight": [h, mlp], p + "mlp.2.bias": [h]})
    for i in range(CHROMA["depth_single_blocks"]):
        p = "single_blocks.{}.".format(i)
        want.update({p + "linear1.weight": [3 * h + mlp, h], p + "linear1.bias": [3 * h + mlp],
                     p + "linear2.weight": [h, h + mlp], p + "linear2.bias": [h],
                     p + "norm.query_norm.scale": [hd], p + "norm.key_norm.scale": [hd]})
    assert dict(keys) == want, sorted(set(dict(keys)) ^ set(want))
    return keys


def file_specs(torch):
    """(folder, name, keys)"""
    return [("unet", UNET, chroma_keys(torch)),
            ("clip", T5_FILE, flux.t5_keys(torch)),
            ("vae", VAE_FILE, flux.vae_keys(torch))]


def patch_comfy(tmp, torch):
    import comfy.model_detection
    import comfy.sd

    flux.patch_comfy(tmp, torch)

    detect = comfy.model_detection.detect_unet_config

    def tiny_detect(state_dict, key_prefix, metadata=None):
        cfg = detect(state_dict, key_prefix, metadata=metadata)
        if cfg is not None and cfg.get("image_model") == "chroma":
            assert (cfg["hidden_size"], cfg["num_heads"], cfg["context_in_dim"], cfg["out_dim"],
                    cfg["hidden_dim"], cfg["n_layers"]) == (3072, 24, 4096, 3072, 5120, 5)
            assert (cfg["in_channels"], cfg["out_channels"], cfg["in_dim"]) == (64, 64, 64)
            cfg.update({k: (list(v) if isinstance(v, list) else v) for k, v in CHROMA_TINY.items()})
            p = key_prefix + "distilled_guidance_layer."
            n = len({k[len(p):].split(".")[1] for k in state_dict if k.startswith(p + "layers.")})
            assert n == CHROMA["n_layers"], n
            assert list(state_dict[p + "in_proj.weight"].shape) == [CHROMA["hidden_dim"],
                                                                    CHROMA["in_dim"]]
            assert list(state_dict[p + "out_proj.weight"].shape) == [CHROMA["out_dim"],
                                                                     CHROMA["hidden_dim"]]
            assert list(state_dict[key_prefix + "txt_in.weight"].shape) == [
                CHROMA["hidden_size"], CHROMA["context_in_dim"]]
        return cfg
    comfy.model_detection.detect_unet_config = tiny_detect

    detect_te = comfy.sd.detect_te_model

    def tiny_detect_te(sd):
        te = detect_te(sd)
        w = sd.get("shared.weight")
        if (te == comfy.sd.TEModel.T5_BASE and w is not None
                and list(w.shape) == [flux.T5["vocab_size"], flux.T5["d_model"]]
                and "encoder.block.0.layer.1.DenseReluDense.wi_1.weight" in sd):
            return comfy.sd.TEModel.T5_XXL
        return te
    comfy.sd.detect_te_model = tiny_detect_te


def v3_nodes():
    """flux_pipeline's V3 nodes (EmptySD3LatentImage, ...) and
    T5TokenizerOptions, called as families_pipeline calls them."""
    import comfy_extras.nodes_cond as cond

    class T5TokenizerOptions:
        FUNCTION = "run"

        def run(self, **kwargs):
            clone = cond.T5TokenizerOptions.PREPARE_CLASS_CLONE({})
            return getattr(clone, clone.FUNCTION)(**kwargs).result
    return {**flux.v3_nodes(), "T5TokenizerOptions": T5TokenizerOptions}


def load_clip(nodes, options=None):
    """CLIPLoader(tiny T5, chroma), then T5TokenizerOptions(min_padding,
    min_length) if given, through the node classes."""
    (clip,) = nodes.CLIPLoader().load_clip(T5_FILE, "chroma")
    if options is not None:
        (clip,) = v3_nodes()["T5TokenizerOptions"]().run(
            clip=clip, min_padding=options[0], min_length=options[1])
    return clip


def check_models(nodes, torch):
    import comfy.model_base as mb
    (m,) = nodes.UNETLoader().load_unet(UNET, "default")
    got = type(m.model.model_config).__name__
    assert (got, type(m.model).__name__, m.model.model_type) == ("Chroma", "Chroma", mb.ModelType.FLUX)
    dm = m.model.diffusion_model
    ms = m.model.model_sampling
    import comfy.model_sampling
    assert isinstance(ms, comfy.model_sampling.ModelSamplingFlux) and abs(ms.shift - 1.15) < 1e-12
    assert isinstance(ms, comfy.model_sampling.CONST)
    assert dm.img_in.weight.dtype == torch.float32
    state = dm.state_dict()
    for k, shape in chroma_keys(torch):
        want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
        assert np.array_equal(state[k].float().numpy(), want), k
    print("detect", UNET, got, m.model.model_type.name, "ModelSamplingFlux+CONST", "shift", ms.shift,
          "sampling_settings", m.model.model_config.sampling_settings,
          "latent_format", type(m.model.latent_format).__name__,
          "weights", dm.img_in.weight.dtype, "manual_cast", m.model.manual_cast_dtype,
          "params", dm.params)
    clip = load_clip(nodes)
    cm = clip.cond_stage_model
    t5 = cm.t5xxl
    state = t5.transformer.state_dict()
    for k, shape in flux.t5_keys(torch):
        want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
        assert np.array_equal(state[k].float().numpy(), want), k
    assert not t5.enable_attention_masks and not t5.return_attention_masks
    tok = getattr(clip.tokenizer, clip.tokenizer.clip)  # "clip_t5xxl"
    print("CLIPLoader chroma:", type(cm).__name__, type(t5).__module__, "t5 weights",
          t5.transformer.shared.weight.dtype, "attention masks", t5.enable_attention_masks,
          t5.return_attention_masks, "zero_out_masked", t5.zero_out_masked,
          "special", t5.special_tokens, "tokenizer", type(tok).__module__,
          "min_length", tok.min_length, "max_length", tok.max_length, "min_padding",
          tok.min_padding, "pad", tok.pad_token, "end", tok.end_token, "start", tok.start_token)
    import comfy.ldm.modules.attention as attn
    print("attention:", attn.optimized_attention.__name__)


def chroma_tokens(nodes):
    clips = {label: load_clip(nodes, opts) for label, opts in TOKEN_OPTIONS[:2]}
    out = {"class": "comfy.text_encoders.pixart_t5.PixArtTokenizer (T5XXLTokenizer)",
           "options": {label: (None if opts is None else
                               {"min_padding": opts[0], "min_length": opts[1]})
                       for label, opts in TOKEN_OPTIONS[:2]},
           "prompts": []}
    for label, text in flux.TOKEN_PROMPTS:
        entry = {"label": label, "text": text}
        for k, clip in clips.items():
            batches = clip.tokenize(text)["t5xxl"]
            entry[k] = [[[int(tok), float(w)] for tok, w in b] for b in batches]
        out["prompts"].append(entry)
        d = entry["default"]
        print("chroma tokens", label, "batches", len(d), "len", [len(b) for b in d],
              "min_padding_1 len", [len(b) for b in entry["min_padding_1"]],
              "tail", [t for t, _ in d[-1][-3:]])
    return out


def chroma_cond(nodes):
    out = []
    for label, opts in TOKEN_OPTIONS:
        clip = load_clip(nodes, opts)
        for text in COND_PROMPTS:
            tokens = clip.tokenize(text)
            ((cond, extra),) = nodes.CLIPTextEncode().encode(clip, text)[0]
            c = cond.float().numpy()
            assert np.isfinite(c).all()
            assert "attention_mask" not in extra, sorted(extra)
            internal = clip.cond_stage_model.t5xxl.process_tokens(
                [[t for t, _ in b] for b in tokens["t5xxl"]], "cpu")[1]
            out.append({"options": label, "text": text,
                        "tokens": [[[int(t), float(w)] for t, w in b] for b in tokens["t5xxl"]],
                        "cond_shape": list(c.shape), "cond_f32": sd1.b64(c.astype("<f4")),
                        "extra": {k: (None if v is None else repr(v)) for k, v in extra.items()},
                        "attention_mask": None,
                        "t5_internal_mask": internal.tolist()})
            print("chroma cond", label, repr(text), "tokens", [len(b) for b in tokens["t5xxl"]],
                  "cond", c.shape, "std", float(c.std()), "dict", extra,
                  "internal mask (unused)", internal.tolist())
    # The same prompt with and without one trailing pad token: the shared
    # positions differ, so the pad is attended (no T5 mask).
    a = [e for e in out if e["text"] == COND_PROMPTS[0]]
    ca = np.frombuffer(base64.b64decode(a[0]["cond_f32"]), "<f4").reshape(a[0]["cond_shape"])
    cb = np.frombuffer(base64.b64decode(a[1]["cond_f32"]), "<f4").reshape(a[1]["cond_shape"])
    n = ca.shape[1]
    print("no T5 mask: cond with one extra pad vs without, shared tokens max diff",
          float(np.abs(ca - cb[:, :n]).max()))
    return out


def chroma_forward(nodes, torch):
    (m,) = nodes.UNETLoader().load_unet(UNET, "default")
    dm = m.model.diffusion_model
    assert dm.img_in.weight.dtype == torch.float32
    gen = torch.Generator().manual_seed(20250301)
    seen = {}
    hook = dm.distilled_guidance_layer.register_forward_hook(
        lambda mod, args, o: seen.__setitem__("mod", o.detach().clone()))

    def enc(a):
        return sd1.b64(a.float().numpy().astype("<f4"))
    x8 = torch.randn((1, 16, 8, 8), generator=gen)
    ctx9 = torch.randn((1, 9, CHROMA["context_in_dim"]), generator=gen)
    x610 = torch.randn((1, 16, 6, 10), generator=gen)
    ctx12 = torch.randn((1, 12, CHROMA["context_in_dim"]), generator=gen)
    out = []
    # (x, context, timestep, guidance, padded text tokens at the end)
    for x, ctx, t, g, n_pad in [(x8, ctx9, 0.75, 0.0, 0), (x610, ctx12, 0.4, 0.0, 5),
                                (x8, ctx9, 0.3, 3.5, 0)]:
        (h, w), n_txt = x.shape[2:], ctx.shape[1]
        t = torch.tensor([t])
        guidance = torch.tensor([g])
        mask = None
        entry = {"x_shape": list(x.shape), "x_f32": enc(x),
                 "context_shape": list(ctx.shape), "context_f32": enc(ctx),
                 "timestep": float(t[0]), "guidance": float(g)}
        if n_pad:
            n_img = ((h + 1) // 2) * ((w + 1) // 2)
            keep = torch.ones(n_txt + n_img, dtype=torch.bool)
            keep[n_txt - n_pad:n_txt] = False
            big = torch.finfo(torch.float32).max
            mask = torch.zeros((1, n_txt + n_img, n_txt + n_img))
            mask[:, :, ~keep] = -big
            entry.update({"txt_mask": [int(v) for v in keep[:n_txt]],
                          "attention_mask_shape": list(mask.shape),
                          "attention_mask_f32": enc(mask)})
        with torch.inference_mode():
            o = dm(x, t, ctx, guidance=guidance, attention_mask=mask)
        assert o.shape == x.shape and torch.isfinite(o).all()
        entry.update({"out_shape": list(o.shape), "out_f32": enc(o)})
        if not out:
            entry["mod_vectors_shape"] = list(seen["mod"].shape)
            entry["mod_vectors_f32"] = enc(seen["mod"])
        if n_pad:
            with torch.inference_mode():
                o2 = dm(x, t, ctx[:, :n_txt - n_pad], guidance=guidance)
            entry["img_equals_truncated"] = float((o - o2).abs().max())
            assert entry["img_equals_truncated"] < 1e-4 * float(o.abs().max())
        out.append(entry)
        print("chroma forward", list(x.shape), "ctx", list(ctx.shape), "pad", n_pad, "g", g,
              "out std", float(o.std()), "abs max", float(o.abs().max()),
              "masked vs truncated", entry.get("img_equals_truncated"))
    hook.remove()
    return out


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import folder_paths
    import nodes

    with open(os.path.join(ROOT, "tests", "reference", "flux", "expected.json")) as f:
        flux_files = {x["name"]: x for x in json.load(f)["files"]}
    tmp = tempfile.mkdtemp()
    try:
        patch_comfy(tmp, torch)
        out = {"files": [], "workflows": {}, "components": {}}
        folders = {"unet": "diffusion_models", "clip": "text_encoders", "vae": "vae"}
        for folder, kind in folders.items():
            d = os.path.join(tmp, folder)
            os.makedirs(d, exist_ok=True)
            folder_paths.add_model_folder_path(kind, d, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))

        for folder, name, keys in file_specs(torch):
            keys = sorted(keys)
            digest, _ = flux.write_file(os.path.join(tmp, folder, name), keys, None, torch)
            entry = {"folder": folder, "name": name, "keys": keys, "scaled": {},
                     "checksum_f16": str(digest)}
            if name in flux_files:  # the Flux fixture's file, byte for byte
                ref = flux_files[name]
                assert ref["keys"] == [list(k) for k in keys] and ref["folder"] == folder
                assert ref["checksum_f16"] == entry["checksum_f16"], name
            out["files"].append(entry)
            if not sub:
                print("file", folder, name, "keys", len(keys), "checksum", digest)

        node_ns = types.SimpleNamespace(
            NODE_CLASS_MAPPINGS={**nodes.NODE_CLASS_MAPPINGS, **v3_nodes()})
        if not sub:
            check_models(nodes, torch)
            out["components"]["chroma_tokens"] = chroma_tokens(nodes)
            out["components"]["chroma_cond"] = chroma_cond(nodes)
            out["components"]["chroma_forward"] = chroma_forward(nodes, torch)
            f64_latents, perturbed_latents = sd1.spread_runs(__file__)
        for name in WORKFLOWS:
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            if name == "tiny_chroma_long" and not sub:
                clip = load_clip(nodes)
                (batch,) = clip.tokenize(prompt["3"]["inputs"]["text"])["t5xxl"]
                weights = sorted({round(w, 4) for _, w in batch})
                assert len(batch) > 256 and 1.3 in weights, (len(batch), weights)
                (neg,) = clip.tokenize(prompt["5"]["inputs"]["text"])["t5xxl"]
                print("long prompt: t5 tokens", len(batch), "(one batch, no padding), weights",
                      weights, "empty negative tokens", neg)
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
        sd1.write_expected("chroma", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
