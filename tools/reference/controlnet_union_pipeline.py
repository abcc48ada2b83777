"""End-to-end references for the union ControlNet (xinsir
controlnet-union-sdxl-1.0, "promax" layout) and SetUnionControlNetType.

tools/reference/controlnet_pipeline.py extended to ComfyUI's union
ControlNet: its helpers (key layouts, diffusers names, ComfyUI patches,
the get_control recorder, the direct forward check, the graph rewrites) are
imported from there, not repeated. Every key name and shape comes from
ComfyUI's own comfy.cldm.cldm.ControlNet built with
union_controlnet_num_control_type=8 (the diffusers names of its UNet part by
controlnet_pipeline.diffusers_names; the union part under the names the
xinsir file uses, which comfy.controlnet.load_controlnet_state_dict renames
`.attn.in_proj_{weight,bias}` -> `.attn.in_proj.{weight,bias}`), every
value from sd1_pipeline's `values(key, shape)` formula of the key as spelled
in the file, stored f16. ComfyUI loads the files through ControlNetLoader,
and graphs/tiny_sdxl_controlnet_union.json and
graphs/tiny_sdxl_controlnet_union_auto.json are run through ComfyUI's own
node classes (CheckpointLoaderSimple, CLIPTextEncode, LoadImage,
ControlNetLoader, SetUnionControlNetType, ControlNetApplyAdvanced, KSampler,
VAEDecode) on the CPU in f32.

Why two union files and a second SDXL base: ComfyUI's union part has fixed
widths (cldm.py: num_trans_channel = num_proj_channel = 320, 8 heads, one
layer, control_add_embed_dim 256), and with a control type set,
union_controlnet_merge adds the 320-wide task_embedding row to the mean of
the hint features and the 320-wide spatial_ch_projs output to the hint
features themselves, both model_channels wide: a type only works where
model_channels is 320. On tiny_sdxl (model_channels 64) a union file loads
and runs with "auto" (no type: the merge is skipped), and a type raises
inside ComfyUI (recorded under "errors"). So the typed workflow runs on
tiny_sdxl_320, a tiny SDXL with SDXL's real model_channels 320 and one
level.

tests/reference/controlnet_union/expected.json gets (the layout of
tests/reference/controlnet/expected.json):
  "base": the fixtures the base checkpoints come from.
  "files": per file written here: folder (controlnet or checkpoints),
      name, kind (controlnet_union_diffusers / checkpoint), base (the
      checkpoint it goes with; null for a checkpoint), sorted [key, shape]
      list, "scaled" ({}), checksum_f16 (sd1_pipeline.checksum over the
      file's tensors in sorted key order). Rust writes them with
      tests/support's write_fixture_files.
  "images": the control PNGs used (graphs/input name -> width, height;
      controlnet_pipeline writes them, this script only checks them).
  "models": per direct forward check "<file>#<type>": {file, type
      (SetUnionControlNetType's choice), control_type (the list ComfyUI
      passes the model as kwargs["control_type"]: [n] or [] for auto),
      base, inputs, control}: controlnet_pipeline.forward_checks (get_control
      on a copy of the loaded, SetUnionControlNetType'd object, hint image
      [1, 3, 64, 64], strength 1, pre_run on the base's model, batch 1;
      inputs x [1, 4, 8, 8], sigma 2.0, context [1, 77, 192], y [1, 1664],
      timestep, x_in; control: the 'input' (empty), 'middle' and 'output'
      lists, null or {shape, f32}).
        tiny_sdxl_320_controlnet_union.safetensors#depth: control_type [1].
        tiny_sdxl_controlnet_union.safetensors#auto: control_type [].
  "errors": the typed forward on the 64-wide file: {file, type,
      control_type, base, error (ComfyUI's exception, type and message)}.
  "workflows": per workflow as in controlnet/expected.json: latent_f32,
      image_f32, f32_vs_f64_unet_rel, unet_rounding_rel,
      control_vs_no_control_rel, control_calls ([file, sigma, strength,
      applied, batch] per get_control call), plus control_types_seen (the
      distinct kwargs["control_type"] lists the ControlNet's forward got)
      and: typed: type_vs_auto_rel (the same graph with type "auto");
      auto: set_type_bypassed_equal (true: the graph without
      SetUnionControlNetType gives the same latent bit for bit: ComfyUI's
      default control_type is [] as for "auto").

Files (all tensors f16, values `values(key, shape)`, no scaled keys):
  controlnet/tiny_sdxl_controlnet_union.safetensors: for tiny_sdxl
      (families_pipeline.UNET_XL: model_channels 64, channel_mult [1, 2],
      transformer depth [0, 2], 64-wide heads, context 192, ADM 1664):
      controlnet_pipeline's tiny_sdxl_controlnet keys (conv_in,
      time_embedding.*, add_embedding.*, down_blocks.*, mid_block.*,
      controlnet_cond_embedding.*, controlnet_down_blocks.0..3,
      controlnet_mid_block) plus the union part, the real xinsir names and
      shapes (their widths are fixed, not model_channels):
        task_embedding [8, 320]
        transformer_layes.0.attn.in_proj_weight [960, 320], in_proj_bias
          [960], attn.out_proj.{weight [320, 320], bias}, ln_1 / ln_2
          {weight, bias} [320], mlp.c_fc {weight [1280, 320], bias},
          mlp.c_proj {weight [320, 1280], bias}
        spatial_ch_projs {weight [320, 320], bias [320]}
        control_add_embedding.linear_1 {weight [4 * model_channels, 8 *
          256], bias}, linear_2 {weight [4 * model_channels, 4 *
          model_channels], bias}.
  controlnet/tiny_sdxl_320_controlnet_union.safetensors: the same layout
      for tiny_sdxl_320 (conv_in, down_blocks.0 (one resnet and one
      transformer (5 heads of 64, linear proj_in/out), no downsampler),
      mid_block (resnet, transformer, resnet), controlnet_down_blocks.0..1,
      controlnet_mid_block, controlnet_cond_embedding.* ending in 320
      channels, the union part as above with linear_1 [1280, 2048]).
  checkpoints/tiny_sdxl_320.safetensors: tiny_sdxl's keys with its UNet
      replaced by UNET_320 (families_pipeline.UNET_XL with model_channels
      320, channel_mult [1], num_res_blocks [1], transformer_depth [1],
      transformer_depth_output [1, 1]; middle transformer depth 1; ComfyUI
      reads context_dim and the linear projections from the input blocks'
      first transformer, so level 0 has one): the CLIP-L, CLIP-G and VAE
      tensors have tiny_sdxl's names, so its values.

Workflows (64x64 latent 8x8, euler, normal, 4 steps, cfg 5, control_a.png):
  tiny_sdxl_controlnet_union: tiny_sdxl_320, ControlNetLoader
      (tiny_sdxl_320_controlnet_union) -> SetUnionControlNetType
      ("canny/lineart/anime_lineart/mlsd": control_type [3]) ->
      ControlNetApplyAdvanced (0.9, 0.0-1.0, vae connected).
  tiny_sdxl_controlnet_union_auto: tiny_sdxl, ControlNetLoader
      (tiny_sdxl_controlnet_union) -> SetUnionControlNetType ("auto":
      control_type []) -> ControlNetApplyAdvanced (0.85, 0.0-1.0).

ComfyUI only recognises full-size models. Relaxed here, nothing else:
  * controlnet_pipeline.patch_comfy as it is (families_pipeline's patches,
    the tiny SDXL entry for diffusers ControlNets).
  * supported_models.SDXL's match: families_pipeline's tiny SDXL match
    without model_channels and transformer_depth, so tiny_sdxl_320 is
    detected as SDXL too (asserted for both bases).
  * unet_config_from_diffusers_unet: where neither ComfyUI's table nor
    controlnet_pipeline's tiny SDXL entry matches, the same entry with
    UNET_320's values is tried (controlnet_pipeline's own matcher, on the
    same five keys).

Checks (asserted): the base checkpoints match their fixtures' checksums;
load_controlnet gives a ControlNet with a union part
(num_control_type 8) for both files; every loaded tensor is the file's f16
value of its name; no missing / unexpected / leftover key messages; the
ControlNet's time_embed / label_emb / input_blocks / middle_block shapes are
its base UNet's; no "control could not be applied" warning; the typed
forward differs from the auto one; both latents differ clearly from the
graph without the control nodes, and the typed one from its "auto" form by
over 20 times the f32 spreads.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/controlnet_union_pipeline.py
(media-only imports are stubbed as in sd1_pipeline.py; the base fixtures and
the control images are not rewritten.)
"""
import base64
import functools
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
import controlnet_pipeline as cp  # noqa: E402

ROOT = sd1.ROOT
WORKFLOWS = ["tiny_sdxl_controlnet_union", "tiny_sdxl_controlnet_union_auto"]
CONTROL_NODES = cp.CONTROL_NODES | {"SetUnionControlNetType"}

BASE = "tiny_sdxl.safetensors"
BASE_320 = "tiny_sdxl_320.safetensors"
UNION = "tiny_sdxl_controlnet_union.safetensors"
UNION_320 = "tiny_sdxl_320_controlnet_union.safetensors"
# xinsir's controlnet-union-sdxl-1.0 promax: task_embedding [8, 320], one
# row per entry of ComfyUI's UNION_CONTROLNET_TYPES.
NUM_CONTROL_TYPE = 8
UNION_PREFIXES = ("task_embedding", "transformer_layes.", "spatial_ch_projs.",
                  "control_add_embedding.")

UNET_320 = dict(fam.UNET_XL, model_channels=320, channel_mult=[1], num_res_blocks=[1],
                transformer_depth=[1], transformer_depth_output=[1, 1])
TINY_XL320_DIFFUSERS = dict(cp.TINY_XL_DIFFUSERS, **{
    k: UNET_320[k] for k in ("model_channels", "num_res_blocks", "transformer_depth",
                             "channel_mult", "transformer_depth_output")})

# Direct forward checks: (file, base, hint image, SetUnionControlNetType type).
CHECKS = [(UNION_320, BASE_320, "control_a.png", "depth"),
          (UNION, BASE, "control_a.png", "auto")]
# Compared with the typed check, not stored.
CHECK_AUTO_320 = (UNION_320, BASE_320, "control_a.png", "auto")
# ComfyUI raises on these (a type on a model_channels != 320 file).
FAILING = [(UNION, BASE, "control_a.png", "depth")]

TYPES_SEEN = []  # kwargs["control_type"] per union ControlNet forward


# --- key layouts ----------------------------------------------------------

def union_module(torch, c):
    """controlnet_pipeline.controlnet_module with a union part: ComfyUI's
    ControlNet built with union_controlnet_num_control_type=8."""
    import comfy.cldm.cldm as cldm
    cls = cldm.ControlNet
    cldm.ControlNet = functools.partial(cls, union_controlnet_num_control_type=NUM_CONTROL_TYPE)
    try:
        return cp.controlnet_module(torch, c)
    finally:
        cldm.ControlNet = cls


def union_file_keys(torch, c):
    """(sorted [(file key, shape)], {file key: module key})."""
    keys = [(k, list(t.shape)) for k, t in union_module(torch, c).state_dict().items()]
    plain = [(k, s) for k, s in keys if not k.startswith(UNION_PREFIXES)]
    names = cp.diffusers_names(plain, c)
    for k, _ in keys:
        if k.startswith(UNION_PREFIXES):
            # nn.MultiheadAttention's names in the xinsir file.
            names[k] = k.replace(".attn.in_proj.", ".attn.in_proj_")
    return sorted((names[k], s) for k, s in keys), {names[k]: k for k, _ in keys}


def base_320_keys(torch):
    (spec,) = [s for s in fam.file_specs(torch) if s[1] == BASE]
    rest = [(p + k, s) for p, ks in spec[2] if p != "model.diffusion_model." for k, s in ks]
    unet = [("model.diffusion_model." + k, s) for k, s in fam.unet_keys(torch, UNET_320)]
    return sorted(unet + rest)


def file_specs(torch):
    """(folder, name, kind, base, sorted [(key, shape)], {file key: module
    key}) per file, as controlnet_pipeline.file_specs."""
    union, union_names = union_file_keys(torch, fam.UNET_XL)
    union_320, union_320_names = union_file_keys(torch, UNET_320)
    return [
        ("controlnet", UNION, "controlnet_union_diffusers", BASE, union, union_names),
        ("controlnet", UNION_320, "controlnet_union_diffusers", BASE_320, union_320,
         union_320_names),
        ("checkpoints", BASE_320, "checkpoint", None, base_320_keys(torch), {}),
    ]


# --- ComfyUI patches and records -------------------------------------------

def patch_comfy(tmp, torch):
    import comfy.cldm.cldm as cldm
    import comfy.model_detection as md
    import comfy.supported_models
    cp.patch_comfy(tmp, torch)
    comfy.supported_models.SDXL.unet_config = {
        k: v for k, v in fam.MATCH["SDXL"].items()
        if k not in ("model_channels", "transformer_depth")}

    detect = md.unet_config_from_diffusers_unet

    def detect_320(state_dict, dtype=None):
        out = detect(state_dict, dtype)
        if out is None:
            # controlnet_pipeline's matcher, on UNET_320's entry.
            entry = cp.TINY_XL_DIFFUSERS
            cp.TINY_XL_DIFFUSERS = TINY_XL320_DIFFUSERS
            try:
                out = detect(state_dict, dtype)
            finally:
                cp.TINY_XL_DIFFUSERS = entry
        return out
    md.unet_config_from_diffusers_unet = detect_320

    # Recording only: the control_type each union forward got.
    forward = cldm.ControlNet.forward

    def recorded(self, *args, **kwargs):
        if self.control_add_embedding is not None:
            TYPES_SEEN.append(list(kwargs.get("control_type", [])))
        return forward(self, *args, **kwargs)
    cldm.ControlNet.forward = recorded


def union_nodes(nodes):
    import comfy_extras.nodes_controlnet as ncn
    return types.SimpleNamespace(
        NODE_CLASS_MAPPINGS={**nodes.NODE_CLASS_MAPPINGS, **ncn.NODE_CLASS_MAPPINGS})


# --- checks ---------------------------------------------------------------

def check_key(check):
    name, _, _, kind = check
    return "{}#{}".format(name, kind)


def forward_checks(nodes, torch, checks):
    """controlnet_pipeline.forward_checks on `checks`, its ControlNetLoader
    followed by SetUnionControlNetType."""
    from comfy.cldm.control_types import UNION_CONTROLNET_TYPES
    import comfy_extras.nodes_controlnet as ncn
    by_key = {check_key(c): c for c in checks}

    class Loader:
        def load_controlnet(self, key):
            name, _, _, kind = by_key[key]
            (c,) = nodes.ControlNetLoader().load_controlnet(name)
            return ncn.SetUnionControlNetType().set_controlnet_type(c, kind)

    ns = types.SimpleNamespace(CheckpointLoaderSimple=nodes.CheckpointLoaderSimple,
                               LoadImage=nodes.LoadImage, ControlNetLoader=Loader)
    models = cp.MODELS
    cp.MODELS = [(check_key(c), c[1], c[2]) for c in checks]
    del TYPES_SEEN[:]
    try:
        out = cp.forward_checks(ns, torch)
    finally:
        cp.MODELS = models
    res = {}
    for (name, base, _, kind), seen in zip(checks, TYPES_SEEN):
        want = [UNION_CONTROLNET_TYPES[kind]] if kind != "auto" else []
        assert seen == want, (name, kind, seen)
        key = check_key((name, base, None, kind))
        res[key] = dict({"file": name, "type": kind, "control_type": want}, **out[key])
    assert len(TYPES_SEEN) == len(checks), TYPES_SEEN
    return res


def failing_checks(nodes, torch):
    out = []
    for check in FAILING:
        try:
            forward_checks(nodes, torch, [check])
        except Exception as e:  # ComfyUI's own error, recorded
            msg = "{}: {}".format(type(e).__name__, e)
        else:
            raise AssertionError("no error", check)
        from comfy.cldm.control_types import UNION_CONTROLNET_TYPES
        out.append({"file": check[0], "base": check[1], "type": check[3],
                    "control_type": [UNION_CONTROLNET_TYPES[check[3]]], "error": msg})
        print("error", check_key(check), msg)
    return out


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def check_bases(nodes):
    import comfy.supported_models
    for name in (BASE, BASE_320):
        model = nodes.CheckpointLoaderSimple().load_checkpoint(name)[0]
        cfg = model.model.model_config
        assert type(cfg) is comfy.supported_models.SDXL, (name, cfg)
        print("base", name, type(cfg).__name__, "model_channels",
              cfg.unet_config["model_channels"])


def check_union_loaded(nodes, specs):
    for folder, name, _, _, _, _ in specs:
        if folder != "controlnet":
            continue
        (c,) = nodes.ControlNetLoader().load_controlnet(name)
        m = c.control_model
        assert m.num_control_type == NUM_CONTROL_TYPE, (name, m.num_control_type)
        assert list(m.task_embedding.shape) == [NUM_CONTROL_TYPE, 320]


def check_images():
    from PIL import Image
    out = {}
    name = "control_a.png"
    arr = cp.control_images()[name]
    with Image.open(os.path.join(ROOT, "graphs", "input", name)) as im:
        assert im.mode == "RGB" and np.array_equal(np.asarray(im), arr), name
    out[name] = {"width": arr.shape[1], "height": arr.shape[0]}
    return out


def with_type(prompt, kind):
    return {nid: dict(n, inputs=dict(n["inputs"], type=kind))
            if n["class_type"] == "SetUnionControlNetType" else n for nid, n in prompt.items()}


def without_set_type(prompt):
    """The graph with SetUnionControlNetType bypassed."""
    st = {nid: n["inputs"]["control_net"] for nid, n in prompt.items()
          if n["class_type"] == "SetUnionControlNetType"}
    return {nid: dict(n, inputs={k: st.get(v[0], v) if isinstance(v, list) else v
                                 for k, v in n["inputs"].items()})
            for nid, n in prompt.items() if nid not in st}


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import folder_paths
    import nodes

    log = cp.LogCapture()
    root = logging.getLogger()
    root.addHandler(log)
    level = root.level
    tmp = tempfile.mkdtemp()
    try:
        patch_comfy(tmp, torch)
        cp.record_controls()
        ckpt_dir = os.path.join(tmp, "checkpoints")
        fam.write_base_checkpoints(ckpt_dir, torch)
        folder_paths.add_model_folder_path("checkpoints", ckpt_dir, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))

        specs = file_specs(torch)
        out = {"base": {"sd1": "sd1/expected.json", "sdxl": "families/expected.json"},
               "files": [], "images": None if sub else check_images(), "models": {},
               "errors": [], "workflows": {}}
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
        node_ns = union_nodes(nodes)

        if not sub:
            check_bases(nodes)
            quiet = [(h, h.level) for h in root.handlers if h is not log]
            for h, _ in quiet:
                h.setLevel(max(h.level, logging.INFO))
            root.setLevel(logging.DEBUG)
            cp.check_loaded(nodes, torch, specs, log)
            check_union_loaded(nodes, specs)
            del log.records[:]
            out["models"] = forward_checks(nodes, torch, CHECKS)
            typed = out["models"][check_key(CHECKS[0])]["control"]["output"][0]["f32"]
            auto = forward_checks(nodes, torch, [CHECK_AUTO_320])
            auto = auto[check_key(CHECK_AUTO_320)]["control"]["output"][0]["f32"]
            typed, auto = (np.frombuffer(base64.b64decode(t), "<f4") for t in (typed, auto))
            print("forward typed vs auto (output 0)", rel(typed, auto))
            assert rel(typed, auto) > 0.01
            assert not log.problems(), log.problems()
            out["errors"] = failing_checks(nodes, torch)
            root.setLevel(level)
            for h, lvl in quiet:
                h.setLevel(lvl)

            f64_latents, perturbed_latents = sd1.spread_runs(__file__)

        for name in WORKFLOWS:
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            del log.records[:]
            del cp.CALLS[:]
            del TYPES_SEEN[:]
            saved, latents = sd1.run_workflow(prompt, node_ns, torch)
            assert not log.problems(), (name, log.problems())
            calls = [list(c) for c in cp.CALLS]
            assert calls and all(c[3] for c in calls), (name, calls)
            seen = sorted({tuple(t) for t in TYPES_SEEN})
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            assert np.isfinite(lat).all() and np.isfinite(img).all(), name
            if sub:
                out["workflows"][name] = sd1.b64(lat.astype("<f4"))
                continue
            _, plain = sd1.run_workflow(cp.without_control(prompt), node_ns, torch)
            r = rel(lat, plain[0].float().numpy())
            assert r > 0.01, (name, r)

            def spread_to(latents):
                other = np.frombuffer(base64.b64decode(latents[name]), "<f4")
                return rel(lat.reshape(-1), other)
            w = {"f32_vs_f64_unet_rel": spread_to(f64_latents),
                 "unet_rounding_rel": spread_to(perturbed_latents),
                 "control_vs_no_control_rel": r,
                 "control_types_seen": [list(t) for t in seen]}
            spread = max(w["f32_vs_f64_unet_rel"], w["unet_rounding_rel"])
            (kind,) = {n["inputs"]["type"] for n in prompt.values()
                       if n["class_type"] == "SetUnionControlNetType"}
            if kind != "auto":
                assert seen == [(3,)], (name, seen)
                _, auto = sd1.run_workflow(with_type(prompt, "auto"), node_ns, torch)
                w["type_vs_auto_rel"] = rel(lat, auto[0].float().numpy())
                assert w["type_vs_auto_rel"] > 20 * spread, (name, w)
            else:
                assert seen == [()], (name, seen)
                _, bypassed = sd1.run_workflow(without_set_type(prompt), node_ns, torch)
                w["set_type_bypassed_equal"] = bool(
                    np.array_equal(lat, bypassed[0].float().numpy()))
                assert w["set_type_bypassed_equal"], name
            assert r > 20 * spread, (name, w)
            w.update({"control_calls": calls,
                      "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
                      "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4"))})
            out["workflows"][name] = w
            print(name, "latent", lat.shape, "abs mean", float(np.abs(lat).mean()),
                  "std", float(lat.std()), "image mean", float(img.mean()),
                  "f32 vs f64 UNet", w["f32_vs_f64_unet_rel"],
                  "UNet rounding", w["unet_rounding_rel"], "vs no control", r,
                  "vs auto", w.get("type_vs_auto_rel"), "types seen", seen)
            for c in calls:
                print("   get_control", c)
        if sub:
            print(json.dumps(out["workflows"]))
            return
        sd1.write_expected("controlnet_union", out)
    finally:
        root.setLevel(level)
        root.removeHandler(log)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
