"""End-to-end references for SDXL, SDXL-refiner and SD 2.x workflows.

The SD1 reference (tools/reference/sd1_pipeline.py) extended to three more
model families. Tiny checkpoints are built in the real single-file layouts,
every tensor's name and shape taken from ComfyUI's own classes
(UNetModel, AutoencoderKL, CLIPTextModel; the OpenCLIP layout of SDXL's G
and SD 2.x's H encoders is what ComfyUI's own saving conversion,
diffusers_convert.convert_text_enc_state_dict_v20, makes of its
CLIPTextModel), every value from sd1_pipeline's `values(name, shape)`
formula of the tensor's name in that file, stored f16. The workflows in
graphs/tiny_sdxl_*.json and graphs/tiny_sd2_*.json are then run through
ComfyUI's own node classes on the CPU in f32, and
tests/reference/families/expected.json gets each file's sorted key list with
shapes, its scaled tensors, a checksum of its f16 weights, and for each
workflow the latent SaveLatent gets and the image SaveImage gets (f32), with
the f32-vs-f64 and UNet-rounding spreads the SD1 script measures.

Files (values are `values(key, shape)` of each key as it is spelled in that
file; 0-dim tensors such as OpenCLIP's logit_scale and position_ids are not
written):
  checkpoints/tiny_sdxl.safetensors: model.diffusion_model.* (UNET_XL),
      conditioner.embedders.0.transformer.text_model.* (CLIP_L, HF layout,
      no text projection), conditioner.embedders.1.model.* (CLIP_G in the
      OpenCLIP layout), first_stage_model.* (the SD1 tiny VAE).
  checkpoints/tiny_sdxl_refiner.safetensors: UNET_REFINER,
      conditioner.embedders.0.model.* (CLIP_G, OpenCLIP), the tiny VAE.
  checkpoints/tiny_sd2.safetensors: UNET_SD2, cond_stage_model.model.*
      (CLIP_H, OpenCLIP layout), the tiny VAE; epsilon prediction.
  checkpoints/tiny_sd2_v.safetensors: the same keys, with
      output_blocks.3.1.transformer_blocks.0.norm1.bias (the last output
      block's first norm1 bias) multiplied by 4.0 in f32 before the f16
      cast (recorded under "scaled"), so its std (~0.115) passes ComfyUI's
      v-prediction test (> 0.09); the formula alone gives ~0.029.
  unet/tiny_sdxl_unet.safetensors: UNET_XL keys without a prefix.
  clip/tiny_clip_l.safetensors: CLIP_L, HF layout `text_model.*`.
  clip/tiny_clip_g.safetensors: CLIP_G, HF layout `text_model.*` plus
      `text_projection.weight` (what people download as clip_g).
  unet/tiny_sdxl_refiner_unet.safetensors: UNET_REFINER keys, no prefix.
  vae/tiny_sdxl_vae.safetensors: the tiny VAE without a prefix.

ComfyUI only recognises full-size parts. Relaxed here, nothing else:
  * sd1_pipeline.patch_comfy as it is: the CLIP-L text config (a 64-wide,
    3-layer, 1-head, quick_gelu CLIP, here also SDXL's clip_l), the VAE
    width (ch 32, ch_mult [1,1,2,2]) and SD15's match (unused here).
  * supported_models.SDXL / SDXLRefiner / SD20 `unet_config`: their exact
    full-size values (model_channels, context_dim, transformer_depth,
    adm_in_channels) replaced by the tiny ones, so model detection picks
    the same classes (asserted).
  * SDXLClipG's clip_config_bigg.json and SD2ClipHModel's
    sd2_clip_config.json: the tiny CLIP_G / CLIP_H configs are given
    instead (SDClipModel.__init__ wrapped to swap the path for a dict).
  * SD20.model_type: ComfyUI reads output_blocks.11.1.transformer_blocks.0.
    norm1.bias (the last output block of a full SD2 UNet). Here the same
    std > 0.09 test reads the LAST output block,
    output_blocks.{n-1}.1.transformer_blocks.0.norm1.bias (index 11 for a
    real SD2, 3 here); asserted to give V_PREDICTION for tiny_sd2_v and EPS
    for tiny_sd2.
Separate text encoders need no patch: the tiny G has 32 layers, so
ComfyUI's own rule (a file with text_model.encoder.layers.30.* is G, in
DualCLIPLoader's SDXLClipModel.load_sd and CLIPLoader's detect_te_model)
tells it from L.
Everything else (OpenCLIP -> CLIP key conversion, tokenizers, padding,
clip layers, encode_adm, model sampling, samplers, VAE) is ComfyUI's own.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/families_pipeline.py
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
import sd1_pipeline as sd1  # noqa: E402

ROOT = sd1.ROOT
COMFY = sd1.COMFY
WORKFLOWS = ["tiny_sdxl_txt2img", "tiny_sdxl_sizes", "tiny_sdxl_img2img",
             "tiny_sdxl_refiner", "tiny_sd2_txt2img", "tiny_sd2_v_txt2img",
             "tiny_sd2_v_img2img", "tiny_sdxl_separate", "tiny_sdxl_cond_ops",
             "tiny_sdxl_fp8", "tiny_sdxl_refiner_separate"]

_XL_COMMON = dict(in_channels=4, out_channels=4, model_channels=64,
                  transformer_depth_middle=1, use_linear_in_transformer=True,
                  num_heads=-1, num_head_channels=64)
UNET_XL = dict(_XL_COMMON, channel_mult=[1, 2], num_res_blocks=[1, 1],
               transformer_depth=[0, 2], transformer_depth_output=[0, 0, 2, 2],
               context_dim=192, adm_in_channels=1664)  # 128 pooled + 6 x 256
UNET_REFINER = dict(_XL_COMMON, channel_mult=[1, 2, 2], num_res_blocks=[1, 1, 1],
                    transformer_depth=[0, 2, 0],
                    transformer_depth_output=[0, 0, 2, 2, 0, 0],
                    context_dim=128, adm_in_channels=1408)  # 128 pooled + 5 x 256
UNET_SD2 = dict(_XL_COMMON, channel_mult=[1, 2], num_res_blocks=[1, 1],
                transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
                context_dim=128, adm_in_channels=None)
CLIP_L = sd1.CLIP
# G has bigG's 32 layers, so separate G files are told from L by ComfyUI's
# own layer-count rule (31+ layers); H, only ever read from a checkpoint
# here, keeps 3.
CLIP_G = dict(sd1.CLIP, hidden_act="gelu", hidden_size=128, intermediate_size=256,
              num_attention_heads=2, num_hidden_layers=32, projection_dim=128)
CLIP_H = dict(CLIP_G, num_hidden_layers=3)
VAE = sd1.VAE
V_BIAS = "model.diffusion_model.output_blocks.3.1.transformer_blocks.0.norm1.bias"

# What model detection must pick, and the matches that make it do so.
MATCH = {
    "SDXL": {"model_channels": 64, "use_linear_in_transformer": True,
             "transformer_depth": [0, 2], "context_dim": 192,
             "adm_in_channels": 1664, "use_temporal_attention": False},
    "SDXLRefiner": {"model_channels": 64, "use_linear_in_transformer": True,
                    "context_dim": 128, "adm_in_channels": 1408,
                    "transformer_depth": [0, 2, 0], "use_temporal_attention": False},
    "SD20": {"context_dim": 128, "model_channels": 64, "use_linear_in_transformer": True,
             "adm_in_channels": None, "use_temporal_attention": False},
}
ADM_WIDTH = {"SDXL": 1664, "SDXLRefiner": 1408}

# Recorded by the encode_adm wrappers: (class, adm width, the size kwargs).
ADM_LOG = []


def unet_keys(torch, c):
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    unet = UNetModel(image_size=None, in_channels=c["in_channels"],
                     model_channels=c["model_channels"], out_channels=c["out_channels"],
                     num_res_blocks=c["num_res_blocks"], channel_mult=c["channel_mult"],
                     num_heads=c["num_heads"], num_head_channels=c["num_head_channels"],
                     use_spatial_transformer=True,
                     transformer_depth=c["transformer_depth"],
                     transformer_depth_output=c["transformer_depth_output"],
                     transformer_depth_middle=c["transformer_depth_middle"],
                     context_dim=c["context_dim"],
                     use_linear_in_transformer=c["use_linear_in_transformer"],
                     adm_in_channels=c["adm_in_channels"],
                     num_classes="sequential" if c["adm_in_channels"] else None,
                     legacy=False, device="meta", operations=comfy.ops.disable_weight_init)
    return [(k, list(t.shape)) for k, t in unet.state_dict().items()]


def vae_keys(torch):
    from comfy.ldm.models.autoencoder import AutoencoderKL
    vae = AutoencoderKL(ddconfig=VAE, embed_dim=4)
    return [(k, list(t.shape)) for k, t in vae.state_dict().items()]


def clip_hf_keys(torch, config, projection):
    """ComfyUI's CLIPTextModel keys (HF layout); SD1/SDXL CLIP-L files carry
    no text projection."""
    import comfy.clip_model
    import comfy.ops
    m = comfy.clip_model.CLIPTextModel(config, torch.float32, "meta",
                                       comfy.ops.disable_weight_init)
    return [(k, list(t.shape)) for k, t in m.state_dict().items()
            if projection or not k.startswith("text_projection")]


def open_clip_keys(torch, config):
    """The OpenCLIP layout, as ComfyUI's own saving conversion writes it from
    its CLIPTextModel; checked against the layout SDXL/SD2 files have."""
    import comfy.clip_model
    import comfy.diffusers_convert
    import comfy.ops
    m = comfy.clip_model.CLIPTextModel(config, torch.float32, "meta",
                                       comfy.ops.disable_weight_init)
    sd = {"x.transformer." + k: v for k, v in m.state_dict().items()}
    out = comfy.diffusers_convert.convert_text_enc_state_dict_v20(sd, "x")
    keys = [(k[len("x."):], list(v.shape)) for k, v in out.items()]
    w, inter = config["hidden_size"], config["intermediate_size"]
    want = {"token_embedding.weight": [config["vocab_size"], w],
            "positional_embedding": [config["max_position_embeddings"], w],
            "ln_final.weight": [w], "ln_final.bias": [w],
            "text_projection": [w, config["projection_dim"]]}
    for i in range(config["num_hidden_layers"]):
        p = "transformer.resblocks.{}.".format(i)
        want.update({p + "ln_1.weight": [w], p + "ln_1.bias": [w],
                     p + "attn.in_proj_weight": [3 * w, w], p + "attn.in_proj_bias": [3 * w],
                     p + "attn.out_proj.weight": [w, w], p + "attn.out_proj.bias": [w],
                     p + "ln_2.weight": [w], p + "ln_2.bias": [w],
                     p + "mlp.c_fc.weight": [inter, w], p + "mlp.c_fc.bias": [inter],
                     p + "mlp.c_proj.weight": [w, inter], p + "mlp.c_proj.bias": [w]})
    assert dict(keys) == want, sorted(set(dict(keys)) ^ set(want))
    return keys


def file_specs(torch):
    """(folder, name, [(prefix, keys)], {key: factor})"""
    xl, vae = unet_keys(torch, UNET_XL), vae_keys(torch)
    l_hf = clip_hf_keys(torch, CLIP_L, projection=False)
    g_oc = open_clip_keys(torch, CLIP_G)
    sd2 = [("model.diffusion_model.", unet_keys(torch, UNET_SD2)), ("first_stage_model.", vae),
           ("cond_stage_model.model.", open_clip_keys(torch, CLIP_H))]
    return [
        ("checkpoints", "tiny_sdxl.safetensors",
         [("model.diffusion_model.", xl), ("first_stage_model.", vae),
          ("conditioner.embedders.0.transformer.", l_hf),
          ("conditioner.embedders.1.model.", g_oc)], {}),
        ("checkpoints", "tiny_sdxl_refiner.safetensors",
         [("model.diffusion_model.", unet_keys(torch, UNET_REFINER)),
          ("first_stage_model.", vae), ("conditioner.embedders.0.model.", g_oc)], {}),
        ("checkpoints", "tiny_sd2.safetensors", sd2, {}),
        ("checkpoints", "tiny_sd2_v.safetensors", sd2, {V_BIAS: 4.0}),
        ("unet", "tiny_sdxl_unet.safetensors", [("", xl)], {}),
        ("unet", "tiny_sdxl_refiner_unet.safetensors", [("", unet_keys(torch, UNET_REFINER))], {}),
        ("clip", "tiny_clip_l.safetensors", [("", l_hf)], {}),
        ("clip", "tiny_clip_g.safetensors", [("", clip_hf_keys(torch, CLIP_G, True))], {}),
        ("vae", "tiny_sdxl_vae.safetensors", [("", vae)], {}),
    ]


def write_file(path, keys, scaled, torch):
    """sd1_pipeline.write_checkpoint, with the scaled tensors multiplied (in
    f32, before the f16 cast)."""
    from safetensors.torch import save_file
    tensors, total = {}, 0
    for i, (k, shape) in enumerate(keys):
        v = sd1.values(k, shape)
        if k in scaled:
            v = v * np.float32(scaled[k])
        v = v.astype(np.float16)
        total = (total + sd1.checksum(v.view(np.uint16), i)) % (1 << 64)
        tensors[k] = torch.from_numpy(v)
    save_file(tensors, path)
    return total


def write_base_checkpoints(ckpt_dir, torch):
    """The tiny SD1 and SDXL checkpoints into `ckpt_dir` (the bases of the
    adapter references), checked against their fixtures' checksums.
    Returns the SDXL file's name."""
    os.makedirs(ckpt_dir)
    sd1_digest = sd1.write_checkpoint(os.path.join(ckpt_dir, sd1.CKPT),
                                      sd1.checkpoint_keys(torch), torch)
    (xl_spec,) = [s for s in file_specs(torch) if s[1] == "tiny_sdxl.safetensors"]
    _, xl_name, parts, xl_scaled = xl_spec
    xl_keys = sorted((p + k, s) for p, ks in parts for k, s in ks)
    xl_digest = write_file(os.path.join(ckpt_dir, xl_name), xl_keys, xl_scaled, torch)
    ref = os.path.join(ROOT, "tests", "reference")
    with open(os.path.join(ref, "sd1", "expected.json")) as f:
        assert json.load(f)["checksum_f16"] == str(sd1_digest)
    with open(os.path.join(ref, "families", "expected.json")) as f:
        (xl_file,) = [x for x in json.load(f)["files"] if x["name"] == xl_name]
        assert xl_file["checksum_f16"] == str(xl_digest)
    return xl_name


def patch_comfy(tmp, torch):
    import comfy.model_base
    import comfy.sd1_clip
    import comfy.sdxl_clip
    import comfy.supported_models

    sd1.patch_comfy(tmp)  # CLIP-L config default, tiny VAE, SD15 match
    for name, cfg in MATCH.items():
        getattr(comfy.supported_models, name).unet_config = dict(cfg)

    tiny = {"clip_config_bigg.json": CLIP_G, "sd2_clip_config.json": CLIP_H}
    init = comfy.sd1_clip.SDClipModel.__init__

    def tiny_init(self, *args, **kwargs):
        cfg = kwargs.get("textmodel_json_config")
        if isinstance(cfg, str) and os.path.basename(cfg) in tiny:
            kwargs["textmodel_json_config"] = dict(tiny[os.path.basename(cfg)])
        init(self, *args, **kwargs)
    comfy.sd1_clip.SDClipModel.__init__ = tiny_init

    def model_type(self, state_dict, prefix=""):
        # ComfyUI's rule, on the last output block instead of the fixed 11.
        if self.unet_config["in_channels"] == 4:
            n = 1 + max(int(k[len(prefix):].split(".")[1]) for k in state_dict
                        if k.startswith(prefix + "output_blocks."))
            k = "{}output_blocks.{}.1.transformer_blocks.0.norm1.bias".format(prefix, n - 1)
            out = state_dict.get(k, None)
            if out is not None and torch.std(out, unbiased=False) > 0.09:
                return comfy.model_base.ModelType.V_PREDICTION
        return comfy.model_base.ModelType.EPS
    comfy.supported_models.SD20.model_type = model_type

    # Recording only: which ADM width and sizes ComfyUI really used.
    for cls in (comfy.model_base.SDXL, comfy.model_base.SDXLRefiner):
        def wrap(orig, cls_name):
            def encode_adm(self, **kwargs):
                out = orig(self, **kwargs)
                ADM_LOG.append((cls_name, out.shape[1], {
                    k: kwargs.get(k) for k in ("width", "height", "crop_w", "crop_h",
                                               "target_width", "target_height",
                                               "aesthetic_score", "prompt_type")
                    if k in kwargs}))
                return out
            return encode_adm
        cls.encode_adm = wrap(cls.encode_adm, cls.__name__)


def v3_nodes():
    """CLIPTextEncodeSDXL / ...Refiner are ComfyUI V3 nodes; called the way
    ComfyUI's executor calls them (class clone, EXECUTE_NORMALIZED)."""
    import comfy_extras.nodes_clip_sdxl as m
    out = {}
    for cls in (m.CLIPTextEncodeSDXL, m.CLIPTextEncodeSDXLRefiner):
        def adapter(cls):
            class Node:
                FUNCTION = "run"

                def run(self, **kwargs):
                    clone = cls.PREPARE_CLASS_CLONE({})
                    return getattr(clone, clone.FUNCTION)(**kwargs).result
            return Node
        out[cls.__name__] = adapter(cls)
    # ImageToMask (the cond_ops workflow's mask) is a V1 node.
    import comfy_extras.nodes_mask as masks
    out["ImageToMask"] = masks.ImageToMask
    return out


def check_models(nodes, torch):
    """Model detection picked the intended classes and prediction types."""
    import comfy.model_base as mb
    want = {"tiny_sdxl.safetensors": ("SDXL", mb.ModelType.EPS),
            "tiny_sdxl_refiner.safetensors": ("SDXLRefiner", mb.ModelType.EPS),
            "tiny_sd2.safetensors": ("SD20", mb.ModelType.EPS),
            "tiny_sd2_v.safetensors": ("SD20", mb.ModelType.V_PREDICTION)}
    for name, (cls, mt) in want.items():
        model, clip, _ = nodes.CheckpointLoaderSimple().load_checkpoint(name)[:3]
        got = type(model.model.model_config).__name__
        assert (got, model.model.model_type) == (cls, mt), (name, got, model.model.model_type)
        print("detect", name, got, model.model.model_type.name,
              type(model.model.model_sampling).__name__)
    (unet,) = nodes.UNETLoader().load_unet("tiny_sdxl_unet.safetensors", "default")
    assert type(unet.model.model_config).__name__ == "SDXL"
    print("detect tiny_sdxl_unet.safetensors", type(unet.model.model_config).__name__,
          unet.model.model_type.name)
    # The separate pair: each file went whole into the encoder it belongs to.
    (clip,) = nodes.DualCLIPLoader().load_clip("tiny_clip_l.safetensors",
                                               "tiny_clip_g.safetensors", "sdxl")
    for part, config, projection in [("clip_l", CLIP_L, False), ("clip_g", CLIP_G, True)]:
        state = getattr(clip.cond_stage_model, part).transformer.state_dict()
        for k, shape in clip_hf_keys(torch, config, projection):
            want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
            assert np.array_equal(state[k].float().numpy(), want), (part, k)
    print("DualCLIPLoader sdxl: tiny_clip_l -> clip_l, tiny_clip_g -> clip_g (all weights)")


def report_clip(nodes, torch):
    """How ComfyUI tokenizes and which layers it reads, for the record."""
    def load(name):
        return nodes.CheckpointLoaderSimple().load_checkpoint(name)[1]
    wf = {n: json.load(open(os.path.join(ROOT, "graphs", n + ".json"))) for n in WORKFLOWS}
    long_xl = wf["tiny_sdxl_txt2img"]["3"]["inputs"]["text"]
    sizes = wf["tiny_sdxl_sizes"]["3"]["inputs"]
    long_sd2 = wf["tiny_sd2_txt2img"]["3"]["inputs"]["text"]
    xl, sd2, ref = load("tiny_sdxl.safetensors"), load("tiny_sd2.safetensors"), \
        load("tiny_sdxl_refiner.safetensors")
    t = xl.tokenize(long_xl)
    assert len(t["g"]) == len(t["l"]) == 2, (len(t["g"]), len(t["l"]))
    tail_g = [tok for tok, _ in t["g"][1][-3:]]
    tail_l = [tok for tok, _ in t["l"][1][-3:]]
    print("sdxl long prompt chunks g", len(t["g"]), "l", len(t["l"]),
          "g chunk-2 tail", tail_g, "l chunk-2 tail", tail_l,
          "weights", sorted({round(w, 3) for c in t["g"] for _, w in c}))
    assert tail_g == [0, 0, 0] and tail_l == [49407] * 3
    g, l = xl.tokenize(sizes["text_g"]), xl.tokenize(sizes["text_l"])
    assert len(g["g"]) == 1 and len(l["l"]) == 2
    print("sdxl sizes text_g chunks", len(g["g"]), "text_l chunks", len(l["l"]),
          "(CLIPTextEncodeSDXL pads g with an empty chunk)")
    t = sd2.tokenize(long_sd2)
    assert len(t["h"]) == 2 and t["h"][1][-1][0] == 0
    print("sd2 long prompt chunks", len(t["h"]), "pad", t["h"][1][-1][0])
    for name, clip in [("sdxl", xl), ("refiner", ref), ("sd2", sd2)]:
        m = clip.cond_stage_model
        for part in ("clip_l", "clip_g", "clip_h"):
            if hasattr(m, part):
                c = getattr(m, part)
                print("clip layer", name, part, c.layer, c.layer_idx,
                      "final LN on hidden", c.layer_norm_hidden_state,
                      "pad", c.special_tokens.get("pad"), "layers", c.num_layers)


def main():
    # --fp64-unet / --perturb-unet as in sd1_pipeline.py: the run repeated
    # with the UNet in float64 / with float32-rounding-sized perturbations,
    # printing the latents; the normal run calls itself both ways.
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import folder_paths
    import nodes

    tmp = tempfile.mkdtemp()
    try:
        patch_comfy(tmp, torch)
        out = {"files": [], "workflows": {}}
        folders = {"checkpoints": "checkpoints", "unet": "diffusion_models",
                   "clip": "text_encoders", "vae": "vae"}
        for folder, name, parts, scaled in file_specs(torch):
            keys = sorted((p + k, s) for p, ks in parts for k, s in ks)
            assert all(k in dict(keys) for k in scaled)
            d = os.path.join(tmp, folder)
            os.makedirs(d, exist_ok=True)
            digest = write_file(os.path.join(d, name), keys, scaled, torch)
            out["files"].append({"folder": folder, "name": name, "keys": keys,
                                 "scaled": scaled, "checksum_f16": str(digest)})
            if not sub:
                print("file", folder, name, "keys", len(keys), "checksum", digest)
        for folder, kind in folders.items():
            folder_paths.add_model_folder_path(kind, os.path.join(tmp, folder), is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))
        node_ns = types.SimpleNamespace(
            NODE_CLASS_MAPPINGS={**nodes.NODE_CLASS_MAPPINGS, **v3_nodes()})

        if not sub:
            check_models(nodes, torch)
            report_clip(nodes, torch)

            f64_latents, perturbed_latents = sd1.spread_runs(__file__)
        for name in WORKFLOWS:
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            del ADM_LOG[:]
            saved, latents = sd1.run_workflow(prompt, node_ns, torch)
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            assert np.isfinite(lat).all() and np.isfinite(img).all(), name
            if name.startswith("tiny_sdxl"):
                widths = {(c, w) for c, w, _ in ADM_LOG}
                base = set() if name.endswith("refiner_separate") else {("SDXL", 1664)}
                want = base | ({("SDXLRefiner", 1408)} if "refiner" in name else set())
                assert widths == want, (name, widths)
            else:
                assert not ADM_LOG, name
            if sub:
                out["workflows"][name] = sd1.b64(lat.astype("<f4"))
                continue

            def spread_to(latents):
                other = np.frombuffer(base64.b64decode(latents[name]), "<f4")
                return float(np.abs(lat.reshape(-1) - other).max() / np.abs(other).max())
            out["workflows"][name] = {
                "f32_vs_f64_unet_rel": spread_to(f64_latents),
                "unet_rounding_rel": spread_to(perturbed_latents),
                "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
                "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4")),
            }
            w = out["workflows"][name]
            print(name, "latent", lat.shape, "abs mean", float(np.abs(lat).mean()),
                  "std", float(lat.std()), "image", img.shape, "mean", float(img.mean()),
                  "f32 vs f64 UNet", w["f32_vs_f64_unet_rel"],
                  "UNet rounding", w["unet_rounding_rel"])
            seen = []
            for c, width, kw in ADM_LOG:
                if (c, width, kw) not in seen:
                    seen.append((c, width, kw))
                    print("   adm", c, width, kw)
        if sub:
            print(json.dumps(out["workflows"]))
            return
        sd1.write_expected("families", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
