"""End-to-end and component references for Flux (dev, schnell, fp8, all-in-one).

The families reference (tools/reference/families_pipeline.py) extended to
Flux. Tiny models are built in the layouts of the files people download,
every tensor's name and shape taken from ComfyUI's own classes (Flux in
comfy/ldm/flux/model.py, T5 in comfy/text_encoders/t5.py, CLIPTextModel,
AutoencodingEngine with the diffusionmodules Encoder/Decoder), every value
from sd1_pipeline's `values(name, shape)` formula of the tensor's name as it
is spelled in that file, stored f16 (except the fp8 file, below). The
workflows in graphs/tiny_flux_*.json are then run through ComfyUI's own node
classes on the CPU in f32, and tests/reference/flux/expected.json gets:
  files: as in families: folder, name, sorted keys with shapes, scaled
      (empty here), checksum_f16 (sd1_pipeline.checksum of the f16 values).
      One extension for the fp8 file: "dtype": "F8_E4M3" means every 2-D
      tensor is stored float8_e4m3fn, cast by torch (round to nearest even;
      the values stay far below fp8's 448) from its f16 value, every other
      tensor F16; checksum_f16 is still that of the f16 values before the
      cast, and "checksum_raw" is sd1_pipeline.checksum of each tensor's
      stored bytes taken as uint8 (one unit per byte), summed in key order
      like checksum_f16. A helper that ignores "dtype" writes the f16 file.
  workflows: per graph, as families: latent_shape, latent_f32, image_shape,
      image_f32 (base64 little-endian f32), f32_vs_f64_unet_rel,
      unet_rounding_rel (sd1_pipeline's spreads, the DiT in place of the
      UNet), and image_range [min, max, std] for the record.
  components: pieces to debug in isolation:
    t5_tokens: for tricky prompts, ComfyUI's tokenize_with_weights()["t5xxl"]
        of comfy.text_encoders.flux.FluxTokenizer (its T5XXLTokenizer,
        min_length 256) and of comfy.text_encoders.sd3_clip.SD3Tokenizer
        (min_length 77): lists of batches of [token, weight]. Tokenizers get
        an empty embeddings folder, as a ComfyUI install has.
    t5_hidden: for two prompts, what ComfyUI's Flux CLIP
        (DualCLIPLoader type flux) encode returns: cond (the T5 hidden
        states, weights applied) and pooled (CLIP-L's unprojected pooled
        output), base64 f32 with shapes.
    flux_forward: the tiny dev DiT's forward (diffusion_model(x, timestep,
        context, y, guidance), f32) for seeded random inputs, given with the
        output; latents 8x8, 6x10 (odd patch counts 3x5) and 7x9 (ComfyUI
        pads to the patch size, circularly, and crops the output).

Files:
  unet/tiny_flux_dev.safetensors: Flux keys without prefix (as
      flux1-dev.safetensors): hidden_size 64, num_heads 2 (head dim 32),
      axes_dim [4, 14, 14] (= [16, 56, 56] * 32/128), theta 10000,
      in/out_channels 16 (img_in takes 64), vec_in_dim 64 (the tiny CLIP-L
      width), context_in_dim 32 (the tiny T5 width), mlp_ratio 4, depth 2,
      depth_single_blocks 2, qkv_bias, guidance_in.*.
  unet/tiny_flux_schnell.safetensors: the same without guidance_in.*.
  unet/tiny_flux_dev_fp8.safetensors: the dev keys, "dtype" F8_E4M3 above.
      On the CPU ComfyUI's UNETLoader("default") picks an f32 model (fp8
      compute is unsupported there, the model is small) and loads the fp8
      values into it exactly: the reference is f32 math on fp8-rounded
      weights.
  clip/tiny_t5xxl.safetensors: ComfyUI's T5 keys as in t5xxl_fp16:
      shared.weight [32128, 32], encoder.block.{i}.layer.0.SelfAttention.
      {q,k,v,o}.weight, block 0's relative_attention_bias.weight [32, 4],
      layer_norm weights, layer.1.DenseReluDense.{wi_0,wi_1,wo}.weight,
      encoder.final_layer_norm.weight. d_model 32, d_kv 8, 4 heads, d_ff
      64, 2 layers, gated gelu_pytorch_tanh, the real vocab.
  clip/tiny_clip_l.safetensors: families' tiny CLIP-L (HF layout, no text
      projection), checked against its fixture's checksum.
  vae/tiny_flux_ae.safetensors: the ae.safetensors layout (encoder.*,
      decoder.*, no quant_conv/post_quant_conv), z_channels 16, double_z,
      ch 32, ch_mult [1, 1, 2, 2], one res block per level (sd1's widths).
  checkpoints/tiny_flux_aio.safetensors: the key layout comfy.sd.
      save_checkpoint (what CheckpointSave calls) writes for the loaded dev
      model + flux DualCLIP + VAE: model.diffusion_model.*,
      text_encoders.clip_l.transformer.text_model.* (+ its
      text_projection.weight), text_encoders.t5xxl.transformer.*, vae.*;
      taken from a real save (asserted), values from the formula of these
      names; 0-dim tensors (the encoders' logit_scale) are not written, as
      in families.

ComfyUI only recognises full-size parts. Relaxed here, nothing else:
  * sd1_pipeline.patch_comfy: the tiny CLIP-L config as SDClipModel's
      default (used by FluxClipModel's clip_l). Its VAE patch is bypassed
      for the Flux layout (next item).
  * model_detection.detect_unet_config: for "image_model": "flux" ComfyUI
      hard-codes hidden_size 3072, num_heads 24, context_in_dim 4096,
      axes_dim [16, 56, 56]; those four are replaced by the tiny values
      (asserted equal to the file's shapes). Everything else it reads from
      the file (in_channels, vec_in_dim, depths, guidance_embed: dev ->
      supported_models.Flux, schnell -> FluxSchnell; asserted).
  * T5's config file t5_config_xxl.json: the tiny T5 config is given
      instead (SDClipModel.__init__ wrapped to swap the path for a dict).
  * The VAE: ComfyUI builds a file without post_quant_conv as
      AutoencodingEngine(Encoder/Decoder) with hard-coded ch 128, ch_mult
      [1, 2, 4, 4], num_res_blocks 2 (z_channels from the file). The
      AutoencodingEngine name in comfy.sd is wrapped to swap those three for
      the tiny ones in that Encoder/Decoder config; nothing else.
Not patched: DualCLIPLoader's t5xxl_detect looks for encoder.block.23 (absent
in a 2-layer T5), so dtype_t5 falls back to the CLIP dtype, which on the CPU
is f16 storage like a detected t5xxl_fp16 (compute f32 either way).
Everything else (tokenizers, T5 padding to 256 with no attention mask, token
weights, pooled output, guidance, rope ids, pad_to_patch_size, model
sampling/shift, samplers, latent scale/shift, VAE) is ComfyUI's own.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/flux_pipeline.py
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
import sd1_pipeline as sd1  # noqa: E402

ROOT = sd1.ROOT
WORKFLOWS = ["tiny_flux_txt2img", "tiny_flux_custom", "tiny_flux_img2img",
             "tiny_flux_schnell", "tiny_flux_long_prompt", "tiny_flux_fp8",
             "tiny_flux_aio"]

FLUX = dict(in_channels=16, out_channels=16, vec_in_dim=64, context_in_dim=32,
            hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=2,
            axes_dim=[4, 14, 14], theta=10000, patch_size=2, qkv_bias=True)
# What ComfyUI hard-codes for Flux, replaced by these.
FLUX_TINY = {k: FLUX[k] for k in ("hidden_size", "num_heads", "context_in_dim", "axes_dim")}
T5 = {"d_ff": 64, "d_kv": 8, "d_model": 32, "decoder_start_token_id": 0, "dropout_rate": 0.1,
      "eos_token_id": 1, "dense_act_fn": "gelu_pytorch_tanh", "initializer_factor": 1.0,
      "is_encoder_decoder": True, "is_gated_act": True, "layer_norm_epsilon": 1e-06,
      "model_type": "t5", "num_decoder_layers": 2, "num_heads": 4, "num_layers": 2,
      "output_past": True, "pad_token_id": 0, "relative_attention_num_buckets": 32,
      "relative_attention_max_distance": 128, "tie_word_embeddings": False,
      "vocab_size": 32128}
CLIP_L = sd1.CLIP
VAE_WIDTHS = {"ch": sd1.VAE["ch"], "ch_mult": sd1.VAE["ch_mult"],
              "num_res_blocks": sd1.VAE["num_res_blocks"]}
VAE = dict(sd1.VAE, z_channels=16)
FP8 = "F8_E4M3"
AIO = "tiny_flux_aio.safetensors"

# Prompts for components.t5_tokens.
TOKEN_PROMPTS = [
    ("plain", "a photo of a cat"),
    ("empty", ""),
    ("weighted", "a (cat:1.3) on a mat"),
    ("nested", "((a dog)) and ((a (big:1.5) bird:0.8)) [tiny]"),
    ("escaped", "a \\(x\\) and \\(y:1.2\\) here"),
    ("unicode", "café naïve 東京"),
    ("spaces", "  two   spaces  and\ttab  "),
    ("newlines", "first line\nsecond line\n\nthird"),
    ("digits_punct", "3.14159, 42! #tag @user 1,000,000 -- e=mc^2? (ok)"),
    ("long", " ".join("word{} is (here:1.1)".format(i) for i in range(90))),
    ("embedding", "a painting, embedding:my_style, (embedding:other:1.2) done"),
    ("caps_hyphen", "Hello-World UPPER lower MiXeD snake_case CamelCase"),
]
HIDDEN_PROMPTS = ["a photo of a cat", "a (red:1.3) fox in the \\(deep\\) snow"]


def flux_keys(torch, guidance):
    import comfy.ops
    from comfy.ldm.flux.model import Flux
    m = Flux(image_model="flux", guidance_embed=guidance, dtype=torch.float32, device="meta",
             operations=comfy.ops.disable_weight_init, **FLUX)
    keys = [(k, list(t.shape)) for k, t in m.state_dict().items()]
    # The flux1-dev.safetensors layout (780 tensors at full size).
    h, mlp = FLUX["hidden_size"], int(FLUX["hidden_size"] * FLUX["mlp_ratio"])
    hd = h // FLUX["num_heads"]
    want = {"img_in.weight": [h, 64], "img_in.bias": [h],
            "txt_in.weight": [h, FLUX["context_in_dim"]], "txt_in.bias": [h],
            "time_in.in_layer.weight": [h, 256], "time_in.in_layer.bias": [h],
            "time_in.out_layer.weight": [h, h], "time_in.out_layer.bias": [h],
            "vector_in.in_layer.weight": [h, FLUX["vec_in_dim"]], "vector_in.in_layer.bias": [h],
            "vector_in.out_layer.weight": [h, h], "vector_in.out_layer.bias": [h],
            "final_layer.linear.weight": [64, h], "final_layer.linear.bias": [64],
            "final_layer.adaLN_modulation.1.weight": [2 * h, h],
            "final_layer.adaLN_modulation.1.bias": [2 * h]}
    if guidance:
        want.update({"guidance_in.in_layer.weight": [h, 256], "guidance_in.in_layer.bias": [h],
                     "guidance_in.out_layer.weight": [h, h], "guidance_in.out_layer.bias": [h]})
    for i in range(FLUX["depth"]):
        for s in ("img", "txt"):
            p = "double_blocks.{}.{}_".format(i, s)
            want.update({p + "mod.lin.weight": [6 * h, h], p + "mod.lin.bias": [6 * h],
                         p + "attn.qkv.weight": [3 * h, h], p + "attn.qkv.bias": [3 * h],
                         p + "attn.norm.query_norm.scale": [hd],
                         p + "attn.norm.key_norm.scale": [hd],
                         p + "attn.proj.weight": [h, h], p + "attn.proj.bias": [h],
                         p + "mlp.0.weight": [mlp, h], p + "mlp.0.bias": [mlp],
                         p + "mlp.2.weight": [h, mlp], p + "mlp.2.bias": [h]})
    for i in range(FLUX["depth_single_blocks"]):
        p = "single_blocks.{}.".format(i)
        want.update({p + "linear1.weight": [3 * h + mlp, h], p + "linear1.bias": [3 * h + mlp],
                     p + "linear2.weight": [h, h + mlp], p + "linear2.bias": [h],
                     p + "modulation.lin.weight": [3 * h, h], p + "modulation.lin.bias": [3 * h],
                     p + "norm.query_norm.scale": [hd], p + "norm.key_norm.scale": [hd]})
    assert dict(keys) == want, sorted(set(dict(keys)) ^ set(want))
    return keys


def t5_keys(torch):
    import comfy.ops
    import comfy.text_encoders.t5
    m = comfy.text_encoders.t5.T5(dict(T5), torch.float32, "meta", comfy.ops.disable_weight_init)
    keys = [(k, list(t.shape)) for k, t in m.state_dict().items()]
    d, inner, ff = T5["d_model"], T5["d_kv"] * T5["num_heads"], T5["d_ff"]
    want = {"shared.weight": [T5["vocab_size"], d], "encoder.final_layer_norm.weight": [d],
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight":
                [T5["relative_attention_num_buckets"], T5["num_heads"]]}
    for i in range(T5["num_layers"]):
        p = "encoder.block.{}.layer.".format(i)
        want.update({p + "0.SelfAttention.q.weight": [inner, d],
                     p + "0.SelfAttention.k.weight": [inner, d],
                     p + "0.SelfAttention.v.weight": [inner, d],
                     p + "0.SelfAttention.o.weight": [d, inner],
                     p + "0.layer_norm.weight": [d], p + "1.layer_norm.weight": [d],
                     p + "1.DenseReluDense.wi_0.weight": [ff, d],
                     p + "1.DenseReluDense.wi_1.weight": [ff, d],
                     p + "1.DenseReluDense.wo.weight": [d, ff]})
    assert dict(keys) == want, sorted(set(dict(keys)) ^ set(want))
    return keys


def engine(ddconfig):
    from comfy.ldm.models.autoencoder import AutoencodingEngine
    return AutoencodingEngine(
        regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
        encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder",
                        "params": ddconfig},
        decoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Decoder",
                        "params": ddconfig})


def vae_keys(torch):
    keys = [(k, list(t.shape)) for k, t in engine(dict(VAE)).state_dict().items()]
    assert all(k.split(".")[0] in ("encoder", "decoder") for k, _ in keys)
    assert not any("quant_conv" in k for k, _ in keys)
    d = dict(keys)
    assert d["encoder.conv_out.weight"][0] == 32 and d["decoder.conv_in.weight"][1] == 16
    return keys


def file_specs(torch):
    """(folder, name, keys, dtype or None)"""
    dev = flux_keys(torch, True)
    return [
        ("unet", "tiny_flux_dev.safetensors", dev, None),
        ("unet", "tiny_flux_schnell.safetensors", flux_keys(torch, False), None),
        ("unet", "tiny_flux_dev_fp8.safetensors", dev, FP8),
        ("clip", "tiny_t5xxl.safetensors", t5_keys(torch), None),
        ("clip", "tiny_clip_l.safetensors", fam.clip_hf_keys(torch, CLIP_L, projection=False), None),
        ("vae", "tiny_flux_ae.safetensors", vae_keys(torch), None),
    ]


def write_file(path, keys, dtype, torch):
    """families' write_file (no scaled tensors here); with dtype F8_E4M3
    the 2-D tensors are cast from f16 to float8_e4m3fn. Returns
    (checksum_f16, checksum_raw)."""
    from safetensors.torch import save_file
    tensors, total, raw = {}, 0, 0
    for i, (k, shape) in enumerate(keys):
        v = sd1.values(k, shape).astype(np.float16)
        total = (total + sd1.checksum(v.view(np.uint16), i)) % (1 << 64)
        t = torch.from_numpy(v)
        if dtype == FP8 and len(shape) == 2:
            t = t.to(torch.float8_e4m3fn)
        b = t.contiguous().view(torch.uint8).numpy()
        raw = (raw + sd1.checksum(b, i)) % (1 << 64)
        tensors[k] = t
    save_file(tensors, path)
    return total, raw


def patch_comfy(tmp, torch):
    import comfy.model_detection
    import comfy.sd
    import comfy.sd1_clip

    vae_init = comfy.sd.VAE.__init__
    sd1.patch_comfy(tmp)  # CLIP-L config default (and sd1's VAE, bypassed below)
    sd1_vae_init = comfy.sd.VAE.__init__

    def vae_route(self, sd=None, device=None, config=None, dtype=None, metadata=None):
        init = sd1_vae_init
        if config is None and "decoder.conv_in.weight" in sd and "post_quant_conv.weight" not in sd:
            init = vae_init  # ComfyUI's own path (AutoencodingEngine), tiny widths below
        init(self, sd=sd, device=device, config=config, dtype=dtype, metadata=metadata)
    comfy.sd.VAE.__init__ = vae_route

    orig_engine = comfy.sd.AutoencodingEngine
    coder = {"comfy.ldm.modules.diffusionmodules.model.Encoder",
             "comfy.ldm.modules.diffusionmodules.model.Decoder"}

    def tiny_engine(*args, **kwargs):
        for part in ("encoder_config", "decoder_config"):
            c = kwargs.get(part)
            if c is not None and c["target"] in coder:
                assert c["params"]["ch"] == 128 and c["params"]["ch_mult"] == [1, 2, 4, 4]
                kwargs[part] = dict(c, params=dict(c["params"], **VAE_WIDTHS))
        return orig_engine(*args, **kwargs)
    comfy.sd.AutoencodingEngine = tiny_engine

    detect = comfy.model_detection.detect_unet_config

    def tiny_detect(state_dict, key_prefix, metadata=None):
        cfg = detect(state_dict, key_prefix, metadata=metadata)
        if cfg is not None and cfg.get("image_model") == "flux":
            assert (cfg["hidden_size"], cfg["num_heads"], cfg["context_in_dim"]) == (3072, 24, 4096)
            cfg.update({k: (list(v) if isinstance(v, list) else v) for k, v in FLUX_TINY.items()})
            w = state_dict["{}txt_in.weight".format(key_prefix)]
            assert list(w.shape) == [FLUX["hidden_size"], FLUX["context_in_dim"]]
        return cfg
    comfy.model_detection.detect_unet_config = tiny_detect

    init = comfy.sd1_clip.SDClipModel.__init__

    def tiny_init(self, *args, **kwargs):
        cfg = kwargs.get("textmodel_json_config")
        if isinstance(cfg, str) and os.path.basename(cfg) == "t5_config_xxl.json":
            kwargs["textmodel_json_config"] = dict(T5)
        init(self, *args, **kwargs)
    comfy.sd1_clip.SDClipModel.__init__ = tiny_init


def v3_nodes():
    """The V3 nodes these graphs use, called as families_pipeline calls
    them (class clone, its FUNCTION)."""
    import comfy_extras.nodes_flux as flux
    import comfy_extras.nodes_sd3 as sd3
    out = {}
    for cls in (flux.CLIPTextEncodeFlux, flux.FluxGuidance, sd3.EmptySD3LatentImage):
        def adapter(cls):
            class Node:
                FUNCTION = "run"

                def run(self, **kwargs):
                    clone = cls.PREPARE_CLASS_CLONE({})
                    return getattr(clone, clone.FUNCTION)(**kwargs).result
            return Node
        out[cls.__name__] = adapter(cls)
    return out


def make_aio(nodes, tmp, torch):
    """The key layout comfy.sd.save_checkpoint writes for the dev model, the
    flux DualCLIP pair and the VAE (loaded as the separate files)."""
    import comfy.sd
    from safetensors import safe_open
    (model,) = nodes.UNETLoader().load_unet("tiny_flux_dev.safetensors", "default")
    (clip,) = nodes.DualCLIPLoader().load_clip("tiny_clip_l.safetensors",
                                               "tiny_t5xxl.safetensors", "flux")
    (vae,) = nodes.VAELoader().load_vae("tiny_flux_ae.safetensors")
    path = os.path.join(tmp, "saved_aio.safetensors")
    comfy.sd.save_checkpoint(path, model, clip, vae)
    with safe_open(path, "pt") as f:
        saved = [(k, list(f.get_slice(k).get_shape())) for k in f.keys()]
    os.remove(path)
    keys = sorted((k, s) for k, s in saved if len(s) > 0)
    dropped = sorted(k for k, s in saved if len(s) == 0)
    prefixes = sorted({k.split(".")[0] if not k.startswith("text_encoders.")
                       else ".".join(k.split(".")[:3]) for k, _ in keys})
    assert prefixes == ["model", "text_encoders.clip_l.transformer",
                        "text_encoders.t5xxl.transformer", "vae"], prefixes
    n = {p: sum(k.startswith(p) for k, _ in keys) for p in
         ("model.diffusion_model.", "vae.", "text_encoders.clip_l.transformer.text_model.",
          "text_encoders.t5xxl.transformer.")}
    print("aio (comfy.sd.save_checkpoint layout):", n, "other:",
          [k for k, _ in keys if not any(k.startswith(p) for p in n)], "0-dim dropped:", dropped)
    return keys


def check_models(nodes, torch):
    import comfy.model_base as mb
    for name, cls, mt in [("tiny_flux_dev.safetensors", "Flux", mb.ModelType.FLUX),
                          ("tiny_flux_schnell.safetensors", "FluxSchnell", mb.ModelType.FLOW),
                          ("tiny_flux_dev_fp8.safetensors", "Flux", mb.ModelType.FLUX)]:
        (m,) = nodes.UNETLoader().load_unet(name, "default")
        got = type(m.model.model_config).__name__
        assert (got, m.model.model_type) == (cls, mt), (name, got)
        dm = m.model.diffusion_model
        print("detect", name, got, mt.name, type(m.model.model_sampling).__name__,
              "shift", getattr(m.model.model_sampling, "shift", None),
              "weights", dm.img_in.weight.dtype, "manual_cast", m.model.manual_cast_dtype,
              "guidance_embed", dm.params.guidance_embed)
        if name.endswith("fp8.safetensors"):
            for k, shape in flux_keys(torch, True):
                v = torch.from_numpy(sd1.values(k, shape).astype(np.float16))
                if len(shape) == 2:
                    v = v.to(torch.float8_e4m3fn)
                got_w = dm.state_dict()[k].float()
                assert torch.equal(got_w, v.float()), k
            print("   fp8 file: every weight loaded is the fp8 (2-D) / f16 value, exactly")
    model, clip, vae = nodes.CheckpointLoaderSimple().load_checkpoint(AIO)[:3]
    assert type(model.model.model_config).__name__ == "Flux"
    cm = clip.cond_stage_model
    print("detect", AIO, "Flux; clip", type(cm).__name__, "t5 weights",
          cm.t5xxl.transformer.shared.weight.dtype, "vae", type(vae.first_stage_model).__name__,
          "latent channels", vae.latent_channels)
    (clip,) = nodes.DualCLIPLoader().load_clip("tiny_clip_l.safetensors",
                                               "tiny_t5xxl.safetensors", "flux")
    cm = clip.cond_stage_model
    for part, keys in [("clip_l", fam.clip_hf_keys(torch, CLIP_L, False)), ("t5xxl", t5_keys(torch))]:
        state = getattr(cm, part).transformer.state_dict()
        for k, shape in keys:
            want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
            assert np.array_equal(state[k].float().numpy(), want), (part, k)
    print("DualCLIPLoader flux:", type(cm).__name__, "clip_l layer", cm.clip_l.layer,
          "projected pooled", cm.clip_l.return_projected_pooled, "t5 weights",
          cm.t5xxl.transformer.shared.weight.dtype, "t5 attention mask",
          cm.t5xxl.enable_attention_masks, "t5 special", cm.t5xxl.special_tokens)


def t5_tokens(tmp):
    import comfy.text_encoders.flux as flux
    import comfy.text_encoders.sd3_clip as sd3
    emb = os.path.join(tmp, "embeddings")
    os.makedirs(emb, exist_ok=True)
    toks = {"flux": flux.FluxTokenizer(embedding_directory=emb),
            "sd3": sd3.SD3Tokenizer(embedding_directory=emb)}
    out = {"classes": {k: "{}.{}".format(type(t.t5xxl).__module__, type(t.t5xxl).__name__)
                       for k, t in toks.items()},
           "min_length": {k: t.t5xxl.min_length for k, t in toks.items()},
           "embedding_directory": "an empty folder", "prompts": []}
    for label, text in TOKEN_PROMPTS:
        entry = {"label": label, "text": text}
        for k, t in toks.items():
            batches = t.tokenize_with_weights(text)["t5xxl"]
            entry[k] = [[[int(tok), float(w)] for tok, w in b] for b in batches]
        out["prompts"].append(entry)
        f = entry["flux"]
        print("t5 tokens", label, "batches", len(f), "len", [len(b) for b in f],
              "non-pad", sum(tok != 0 for b in f for tok, _ in b),
              "weights", sorted({w for b in f for _, w in b}),
              "head", [tok for tok, _ in f[0][:8]])
    return out


def report_long_prompt(nodes):
    """The long-prompt graph's T5 tokens: one unchunked batch past 256."""
    with open(os.path.join(ROOT, "graphs", "tiny_flux_long_prompt.json")) as f:
        text = json.load(f)["3"]["inputs"]["text"]
    (clip,) = nodes.DualCLIPLoader().load_clip("tiny_clip_l.safetensors",
                                               "tiny_t5xxl.safetensors", "flux")
    t = clip.tokenize(text)
    (batch,) = t["t5xxl"]
    weights = sorted({round(w, 4) for _, w in batch})
    assert len(batch) > 256 and 1.3 in weights, (len(batch), weights)
    print("long prompt: t5 tokens", len(batch), "(one batch, no padding), weights", weights,
          "clip_l chunks", len(t["l"]))


def t5_hidden(nodes):
    (clip,) = nodes.DualCLIPLoader().load_clip("tiny_clip_l.safetensors",
                                               "tiny_t5xxl.safetensors", "flux")
    out = []
    for text in HIDDEN_PROMPTS:
        tokens = clip.tokenize(text)
        cond, pooled = clip.encode_from_tokens(tokens, return_pooled=True)
        c, p = cond.float().numpy(), pooled.float().numpy()
        assert np.isfinite(c).all() and np.isfinite(p).all()
        out.append({"text": text, "cond_shape": list(c.shape), "cond_f32": sd1.b64(c.astype("<f4")),
                    "pooled_shape": list(p.shape), "pooled_f32": sd1.b64(p.astype("<f4"))})
        print("t5 hidden", repr(text), "cond", c.shape, "std", float(c.std()),
              "pooled", p.shape, "std", float(p.std()))
    return out


def flux_forward(nodes, torch):
    (m,) = nodes.UNETLoader().load_unet("tiny_flux_dev.safetensors", "default")
    dm = m.model.diffusion_model
    assert dm.img_in.weight.dtype == torch.float32
    gen = torch.Generator().manual_seed(20250101)
    out = []
    for h, w in [(8, 8), (6, 10), (7, 9)]:
        x = torch.randn((1, 16, h, w), generator=gen)
        ctx = torch.randn((1, 256, FLUX["context_in_dim"]), generator=gen)
        y = torch.randn((1, FLUX["vec_in_dim"]), generator=gen)
        t = torch.tensor([0.75])
        g = torch.tensor([3.5])
        with torch.inference_mode():
            o = dm(x, t, ctx, y=y, guidance=g)
        assert o.shape == x.shape and torch.isfinite(o).all()

        def enc(a):
            return sd1.b64(a.float().numpy().astype("<f4"))
        out.append({"x_shape": list(x.shape), "x_f32": enc(x),
                    "context_shape": list(ctx.shape), "context_f32": enc(ctx),
                    "y_shape": list(y.shape), "y_f32": enc(y),
                    "timestep": float(t[0]), "guidance": float(g[0]),
                    "out_shape": list(o.shape), "out_f32": enc(o)})
        print("flux forward", list(x.shape), "out std", float(o.std()),
              "abs max", float(o.abs().max()))
    return out


def main():
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

        def write(folder, name, keys, dtype):
            keys = sorted(keys)
            digest, raw = write_file(os.path.join(tmp, folder, name), keys, dtype, torch)
            entry = {"folder": folder, "name": name, "keys": keys, "scaled": {},
                     "checksum_f16": str(digest)}
            if dtype is not None:
                entry["dtype"] = dtype
                entry["checksum_raw"] = str(raw)
            out["files"].append(entry)
            if not sub:
                print("file", folder, name, "keys", len(keys), "checksum", digest,
                      "raw", raw if dtype else "")
            return entry

        for folder, name, keys, dtype in file_specs(torch):
            entry = write(folder, name, keys, dtype)
            if name == "tiny_clip_l.safetensors":
                with open(os.path.join(ROOT, "tests", "reference", "families", "expected.json")) as f:
                    (ref,) = [x for x in json.load(f)["files"] if x["name"] == name]
                assert ref["keys"] == [list(k) for k in entry["keys"]]
                assert ref["checksum_f16"] == entry["checksum_f16"]
        write("checkpoints", AIO, make_aio(nodes, tmp, torch), None)

        node_ns = types.SimpleNamespace(
            NODE_CLASS_MAPPINGS={**nodes.NODE_CLASS_MAPPINGS, **v3_nodes()})
        if not sub:
            check_models(nodes, torch)
            report_long_prompt(nodes)
            out["components"]["t5_tokens"] = t5_tokens(tmp)
            out["components"]["t5_hidden"] = t5_hidden(nodes)
            out["components"]["flux_forward"] = flux_forward(nodes, torch)
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
        sd1.write_expected("flux", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
