"""End-to-end references for Stability's control-LoRA format (the
stabilityai/control-lora `control-lora-*-rank*.safetensors` files; ComfyUI's
comfy.controlnet.ControlLora).

A control-LoRA file is not a ControlNet: ComfyUI recognises it by its
`lora_controlnet` key alone (comfy/controlnet.py, load_controlnet_state_dict:
`if "lora_controlnet" in controlnet_data: return ControlLora(...)`), keeps the
file's tensors as they are, and builds the ControlNet only when sampling
starts (ControlLora.pre_run, called by comfy.samplers.pre_run_control after
the sampling model has been loaded and patched): a comfy.cldm.cldm.ControlNet
with the sampling model's own unet_config (out_channels dropped,
hint_channels = input_hint_block.0.weight's dim 1), ControlLoraOps Linear /
Conv2d (no weights of their own), then
  1. every tensor of model.diffusion_model.state_dict() set on the ControlNet
     under the same name where the ControlNet has that attribute
     (time_embed.*, label_emb.*, input_blocks.*, middle_block.*; output
     blocks and `out.*` fail and are skipped): the UNet's weights as they
     are at that moment, i.e. with the model's LoRA patches applied;
  2. every file key except `lora_controlnet` that ends in .up / .down /
     .weight / .bias (and has no "__") set under its own name, cast to the
     model's dtype: `.weight` / `.bias` replace whatever step 1 put there,
     `.up` / `.down` become the module's up / down;
  3. a Linear / Conv2d with up set computes, on every call,
       W_eff = W + (up.flatten(1) @ down.flatten(1)).reshape(W.shape)
     (torch.mm in the model's dtype, no alpha, no scale, cast to the input
     dtype) and uses W_eff with its bias.
So one control-LoRA works with whichever SDXL-shaped model it is sampled
with. ComfyUI users load it with the plain ControlNetLoader (the graphs
here); DiffControlNetLoader's model input is ignored for it.

The file is built as ComfyUI's own control-LoRA writer (the ControlLoraSave
node, which ComfyUI had for producing this format) lays it out, every key
name and shape taken from ComfyUI's ControlNet for tiny_sdxl
(controlnet_pipeline.controlnet_keys) and tiny_sdxl's UNet
(families_pipeline.unet_keys):
  * a ControlNet tensor the UNet also has, with 2+ dims (Linear weight [out,
    in], Conv2d weight [out, in, kh, kw]): `<name minus .weight>.up` [out, r]
    / [out, r, 1, 1] and `.down` [r, in] / [r, in, kh, kw], r = min(RANK, in,
    out) (ComfyUI's extract_lora rule: 4 on input_blocks.0.0, whose in is 4;
    RANK = 8 elsewhere);
  * a ControlNet tensor the UNet also has, 1-dim (biases, GroupNorm /
    LayerNorm weights): the full tensor under its own name;
  * ControlNet-only tensors (input_hint_block.{0,2,...,14}, zero_convs.N.0,
    middle_block_out.0, weights and biases): full, own names;
  * `lora_controlnet`: an empty tensor, shape [0] (ComfyUI's writer stores
    torch.tensor([]); here f16 like every other tensor: only its presence
    matters);
  * except, on purpose, every tensor of
    input_blocks.3.1.transformer_blocks.1.* (the second transformer block of
    the level-1 SpatialTransformer: its Linear weights, biases and
    LayerNorms): absent from the file, so that block of the ControlNet is
    exactly the (patched) UNet's (UNET_ONLY_PREFIX).
Values: sd1_pipeline's `values(key, shape)` of the key as spelled in the
file, stored f16 (so `.up` is u / sqrt(r), `.down` u / sqrt(in kh kw)), no
scaled keys.

tests/reference/control_lora/expected.json gets (the layout of
tests/reference/controlnet/expected.json):
  "base": the fixtures the base checkpoint and the model LoRA come from.
  "files": [{folder "controlnet", name, kind "control_lora", base
      "tiny_sdxl.safetensors", sorted [key, shape] list, scaled {},
      checksum_f16 (sd1_pipeline.checksum over the file's tensors in sorted
      key order), rank (RANK), unet_only_prefix}]. Rust writes it with
      tests/support's write_fixture_files.
  "images": the control PNG used (graphs/input name -> width, height;
      controlnet_pipeline writes it, this script only checks it).
  "models": {"tiny_sdxl_control_lora.safetensors": {base, inputs, control,
      weights}}: one get_control on a copy of the loaded object with
      set_cond_hint(control_a [1, 3, 64, 64], strength 1, (0, 1)) and
      pre_run on tiny_sdxl's (unpatched) model, batch 1, batched_number 1,
      as controlnet_pipeline.forward_checks: inputs x_shape / x_f32 ([1, 4,
      8, 8], 2u), sigma (2.0), timestep (the discrete step
      model_sampling.timestep(sigma)), x_in_f32 (x / sqrt(sigma^2 + 1), what
      the ControlNet got), context_shape / context_f32 ([1, 77, 192], 8 *
      values), y_shape / y_f32 ([1, 1664], 8 * values), hint_image,
      hint_shape; control: the 'input' (empty), 'middle' and 'output' lists
      get_control returns, each entry null or {shape, f32}. weights: how
      the built ControlNet's parameters were sourced (counts: from_file
      (full tensors), lora_modules (modules with up/down), from_unet
      (tensors left as the UNet's), dtype, manual_cast_dtype), and
      merged_equal: true (the same forward with every module's W replaced
      by W + (up.flatten(1) @ down.flatten(1)).reshape(W.shape) and up/down
      removed gives bit-identical outputs).
  "workflows": per workflow as in controlnet/expected.json: latent_f32,
      image_f32 (and shapes), f32_vs_f64_unet_rel, unet_rounding_rel,
      control_vs_no_control_rel, control_calls ([file, sigma, strength,
      applied, batch] per get_control call), pre_runs (ControlLora.pre_run
      calls: ComfyUI calls it once per conditioning entry that holds it,
      positive and negative: the ControlNet is built twice, the same),
      unet_params_patched (how many of the ControlNet's UNet-sourced
      tensors, LoRA bases included, differ from the checkpoint's values at
      pre_run: 0 without a model LoRA; with one, the LoRA'd ones: the
      control-LoRA is built on the LoRA-patched UNet); with a model LoRA
      also unpatched_control_base_rel (how far the latent moves when, as a
      measurement only, the ControlNet's UNet-sourced tensors are set back
      to the checkpoint's values after pre_run: the fixture tells the two
      apart).

Workflows (64x64 latent 8x8, euler, normal, 4 steps, cfg 5, seed 31337,
control_a.png, ControlNetApplyAdvanced with vae connected (ignored: no
latent_format)):
  tiny_sdxl_control_lora: CheckpointLoaderSimple tiny_sdxl ->
      ControlNetLoader (tiny_sdxl_control_lora) -> ControlNetApplyAdvanced
      (0.9, 0.0-1.0) -> KSampler.
  tiny_sdxl_control_lora_model_lora: the same with LoraLoader
      (lora/expected.json's tiny_sdxl_lora, model 1.0, clip 0.7) between the
      checkpoint and the text encoders / KSampler, and strength 1.0: the
      LoRA's UNet patches reach the ControlNet's UNet-sourced weights.

ComfyUI only recognises full-size models: controlnet_pipeline.patch_comfy
as it is (families_pipeline's patches; ControlLora itself needs no
detection: it uses the sampling model's config).

Checks (asserted): the base checkpoint and the model LoRA match their
fixtures' checksums; ControlNetLoader gives a ControlLora; after pre_run
every Linear / Conv2d of the ControlNet has a weight, every file tensor is
the file's f16 value in the model dtype, every other tensor is the UNet's
current tensor; merged_equal; no missing / unexpected key or "could not be
applied" messages; each workflow's latent differs clearly from the graph
without its control nodes, by over 20 times the f32 spreads.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/control_lora_pipeline.py
(media-only imports are stubbed as in sd1_pipeline.py; the base fixtures
and the control image are not rewritten.)
"""
import base64
import json
import logging
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import families_pipeline as fam  # noqa: E402
import lora_pipeline as lp  # noqa: E402
import controlnet_pipeline as cp  # noqa: E402

ROOT = sd1.ROOT
WORKFLOWS = ["tiny_sdxl_control_lora", "tiny_sdxl_control_lora_model_lora"]
BASE = "tiny_sdxl.safetensors"
CONTROL_LORA = "tiny_sdxl_control_lora.safetensors"
LORA = "tiny_sdxl_lora.safetensors"
RANK = 8
UNET_ONLY_PREFIX = "input_blocks.3.1.transformer_blocks.1."
HINT = "control_a.png"
CHECK_SIGMA = 2.0
CHECK_TOKENS = 77

NAMES = {}     # id(control_weights) -> file name
CALLS = []     # [file, sigma, strength, applied, batch] per get_control call
PRE_RUNS = []  # per ControlLora.pre_run: check_built's summary of the built ControlNet
SOURCES = {}   # file name -> {param: "file" | "lora" | "unet"}
UNPATCHED = []  # [True] while measuring: UNet-sourced tensors reset to the checkpoint's


# --- key layout -----------------------------------------------------------

def control_lora_keys(torch):
    """Sorted [(file key, shape)] and {ControlNet tensor: source}."""
    cn_keys = cp.controlnet_keys(torch, fam.UNET_XL)
    unet = dict(fam.unet_keys(torch, fam.UNET_XL))
    keys, source = [("lora_controlnet", [0])], {}
    for k, s in cn_keys:
        if k.startswith(UNET_ONLY_PREFIX):
            assert unet[k] == s, k
            source[k] = "unet"
        elif k in unet and len(s) >= 2:
            assert unet[k] == s and k.endswith(".weight"), k
            name = k[:-len(".weight")]
            out_dim, in_dim = s[0], s[1]
            r = min(RANK, in_dim, out_dim)
            up = [out_dim, r] + ([1, 1] if len(s) == 4 else [])
            keys += [(name + ".up", up), (name + ".down", [r] + s[1:])]
            source[k] = "lora"
        else:
            if k in unet:
                assert unet[k] == s, k
            keys.append((k, s))
            source[k] = "file"
    return sorted(keys), source


# --- ComfyUI records --------------------------------------------------------

def record_controls(torch, file_values):
    """Names each loaded control-LoRA, logs every get_control call and
    checks / summarises each ControlNet ControlLora.pre_run builds."""
    import comfy.controlnet as cn
    load = cn.load_controlnet

    def load_controlnet(path, *args, **kwargs):
        c = load(path, *args, **kwargs)
        assert type(c) is cn.ControlLora, type(c)
        NAMES[id(c.control_weights)] = os.path.basename(path)
        return c
    cn.load_controlnet = load_controlnet

    orig_get = cn.ControlNet.get_control

    def get_control(self, x_noisy, t, cond, batched_number, transformer_options):
        r = self.timestep_range
        applied = r is None or not (t[0] > r[0] or t[0] < r[1])
        CALLS.append([NAMES.get(id(getattr(self, "control_weights", None))), float(t[0]),
                      self.strength, bool(applied), int(x_noisy.shape[0])])
        return orig_get(self, x_noisy, t, cond, batched_number, transformer_options)
    cn.ControlNet.get_control = get_control

    orig_pre = cn.ControlLora.pre_run

    def pre_run(self, model, percent_to_timestep_function):
        orig_pre(self, model, percent_to_timestep_function)
        PRE_RUNS.append(check_built(self, model, torch, file_values))
        if UNPATCHED:
            unpatch_base(self, torch, file_values)
    cn.ControlLora.pre_run = pre_run


def check_built(c, model, torch, file_values):
    """The ControlNet pre_run built: every Linear / Conv2d has a weight; file
    tensors are the file's f16 values in the model dtype; the rest are the
    UNet's current tensors. Returns the source counts and how many
    UNet-sourced tensors differ from the checkpoint's values."""
    import comfy.controlnet as cn
    name = NAMES[id(c.control_weights)]
    dtype = c.control_model.dtype
    usd = model.diffusion_model.state_dict()
    lora_modules, patched = 0, 0
    for mname, m in c.control_model.named_modules():
        if isinstance(m, (cn.ControlLoraOps.Linear, cn.ControlLoraOps.Conv2d)):
            assert m.weight is not None, (name, mname)
            if m.up is not None:
                lora_modules += 1
                assert m.down is not None and m.up.dtype == dtype, (name, mname)
    sd = c.control_model.state_dict()
    counts = {"file": 0, "lora": 0, "unet": 0}
    sources = {}
    for k, t in sd.items():
        assert t.dtype == dtype, (name, k, t.dtype)
        if k in file_values:
            want = torch.from_numpy(file_values[k]).to(dtype)
            assert torch.equal(t, want), (name, k)
            counts["lora" if k.endswith((".up", ".down")) else "file"] += 1
            sources[k] = "file"
        else:
            assert torch.equal(t, usd[k]), (name, k)
            counts["unet"] += 1
            sources[k] = "unet"
            base = sd1.values("model.diffusion_model." + k, list(t.shape))
            base = torch.from_numpy(base.astype(np.float16)).to(dtype)
            patched += int(not torch.equal(t, base))
    assert counts["lora"] == 2 * lora_modules, (counts, lora_modules)
    assert set(file_values) == {k for k, v in sources.items() if v == "file"}, name
    SOURCES[name] = sources
    return {"file": name, "from_file": counts["file"], "lora_modules": lora_modules,
            "from_unet": counts["unet"], "unet_params_patched": patched,
            "dtype": str(dtype).replace("torch.", ""),
            "manual_cast_dtype": None if c.manual_cast_dtype is None
            else str(c.manual_cast_dtype).replace("torch.", "")}


def unpatch_base(c, torch, file_values):
    """Measurement only (not ComfyUI's behaviour): the UNet-sourced tensors
    of the built ControlNet set back to the checkpoint's values, as if the
    control-LoRA ignored the model's LoRA."""
    import comfy.utils
    dtype = c.control_model.dtype
    for k, t in c.control_model.state_dict().items():
        if k not in file_values:
            base = sd1.values("model.diffusion_model." + k, list(t.shape)).astype(np.float16)
            comfy.utils.set_attr_param(c.control_model, k, torch.from_numpy(base).to(dtype))


def merge_in_place(control_model, torch):
    """Every ControlLoraOps module with up / down: W + up @ down as its
    weight, up / down removed (ComfyUI's forward then takes its plain
    branch)."""
    import comfy.controlnet as cn
    for m in control_model.modules():
        if isinstance(m, (cn.ControlLoraOps.Linear, cn.ControlLoraOps.Conv2d)) \
                and m.up is not None:
            w = m.weight + torch.mm(m.up.flatten(start_dim=1),
                                    m.down.flatten(start_dim=1)).reshape(m.weight.shape)
            m.weight = torch.nn.Parameter(w, requires_grad=False)
            m.up = None
            m.down = None


# --- checks ---------------------------------------------------------------

def b64f(t):
    return sd1.b64(t.detach().float().numpy().astype("<f4"))


def forward_check(nodes, torch):
    """controlnet_pipeline.forward_checks for the control-LoRA, plus the
    merged-weights forward."""
    model = nodes.CheckpointLoaderSimple().load_checkpoint(BASE)[0]
    bm = model.model
    ms = bm.model_sampling
    (control,) = nodes.ControlNetLoader().load_controlnet(CONTROL_LORA)
    (hint,) = nodes.LoadImage().load_image(HINT)[:1]
    ctx_dim = bm.model_config.unet_config["context_dim"]
    adm = bm.model_config.unet_config["adm_in_channels"]
    x = torch.from_numpy(sd1.values("control_check.x", [1, 4, 8, 8]) * np.float32(32))
    ctx = torch.from_numpy(sd1.values("control_check.context", [1, CHECK_TOKENS, ctx_dim])
                           * np.float32(8))
    y = torch.from_numpy(sd1.values("control_check.y", [1, adm]) * np.float32(8))
    sigma = torch.tensor([CHECK_SIGMA], dtype=torch.float32)
    cond = {"c_crossattn": ctx, "y": y}
    inputs = {"x_shape": list(x.shape), "x_f32": b64f(x), "sigma": CHECK_SIGMA,
              "context_shape": list(ctx.shape), "context_f32": b64f(ctx),
              "y_shape": list(y.shape), "y_f32": b64f(y), "hint_image": HINT}
    c = control.copy().set_cond_hint(hint.movedim(-1, 1), 1.0, (0.0, 1.0))
    del PRE_RUNS[:]
    c.pre_run(bm, lambda a: ms.percent_to_sigma(a))
    (built,) = PRE_RUNS
    assert built["unet_params_patched"] == 0, built
    m = c.control_model
    seen = {}
    fwd = m.forward

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return fwd(*args, **kwargs)
    m.forward = spy
    try:
        with torch.inference_mode():
            got = c.get_control(x, sigma, cond, 1, {})
            merge_in_place(m, torch)
            c.cond_hint = None
            merged = c.get_control(x, sigma, cond, 1, {})
    finally:
        del m.forward
    assert torch.equal(seen["timesteps"], ms.timestep(sigma).float())
    assert torch.equal(seen["x"], ms.calculate_input(sigma, x))
    inputs["timestep"] = float(seen["timesteps"][0])
    inputs["x_in_f32"] = b64f(seen["x"])
    inputs["hint_shape"] = list(seen["hint"].shape)
    equal = all((a is None and b is None) or torch.equal(a, b)
                for k in ("input", "middle", "output") for a, b in zip(got[k], merged[k]))
    assert equal, "merged weights differ"
    c.cleanup()
    weights = {k: v for k, v in built.items() if k not in ("file", "unet_params_patched")}
    weights["merged_equal"] = equal
    desc = {k: [None if t is None else list(t.shape) for t in got[k]] for k in got}
    print("forward", CONTROL_LORA, "hint", inputs["hint_shape"], desc, weights)
    print("   abs max", {k: max([float(t.abs().max()) for t in got[k] if t is not None] or [0])
                         for k in got})
    return {CONTROL_LORA: {"base": BASE, "inputs": inputs,
                           "control": {k: cp.tensor_list(got[k])
                                       for k in ("input", "middle", "output")},
                           "weights": weights}}


def check_images():
    from PIL import Image
    arr = cp.control_images()[HINT]
    with Image.open(os.path.join(ROOT, "graphs", "input", HINT)) as im:
        assert im.mode == "RGB" and np.array_equal(np.asarray(im), arr), HINT
    return {HINT: {"width": arr.shape[1], "height": arr.shape[0]}}


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


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
        cp.patch_comfy(tmp, torch)
        ckpt_dir = os.path.join(tmp, "checkpoints")
        fam.write_base_checkpoints(ckpt_dir, torch)
        folder_paths.add_model_folder_path("checkpoints", ckpt_dir, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))

        with open(os.path.join(ROOT, "tests", "reference", "lora", "expected.json")) as f:
            (lora,) = [x for x in json.load(f)["loras"] if x["name"] == LORA]
        lora_dir = os.path.join(tmp, "loras")
        os.makedirs(lora_dir)
        digest = lp.write_lora(os.path.join(lora_dir, LORA), [(k, s) for k, s in lora["keys"]],
                               lora["scaled"], lora["alphas"], torch)
        assert str(digest) == lora["checksum_f16"], (digest, lora["checksum_f16"])
        folder_paths.add_model_folder_path("loras", lora_dir, is_default=True)

        keys, source = control_lora_keys(torch)
        cn_dir = os.path.join(tmp, "controlnet")
        os.makedirs(cn_dir)
        digest = fam.write_file(os.path.join(cn_dir, CONTROL_LORA), keys, {}, torch)
        folder_paths.add_model_folder_path("controlnet", cn_dir, is_default=True)
        file_values = {k: sd1.values(k, s).astype(np.float16) for k, s in keys
                       if k != "lora_controlnet"}
        record_controls(torch, file_values)
        out = {"base": {"sdxl": "families/expected.json", "lora": "lora/expected.json"},
               "files": [{"folder": "controlnet", "name": CONTROL_LORA, "kind": "control_lora",
                          "base": BASE, "keys": keys, "scaled": {},
                          "checksum_f16": str(digest), "rank": RANK,
                          "unet_only_prefix": UNET_ONLY_PREFIX}],
               "images": None if sub else check_images(), "models": {}, "workflows": {}}
        if not sub:
            n = {v: sum(1 for x in source.values() if x == v) for v in ("lora", "file", "unet")}
            print("file", CONTROL_LORA, "keys", len(keys),
                  "params", sum(int(np.prod(s)) for _, s in keys), "checksum", digest,
                  "ControlNet tensors by source", n)
            quiet = [(h, h.level) for h in root.handlers if h is not log]
            for h, _ in quiet:
                h.setLevel(max(h.level, logging.INFO))
            root.setLevel(logging.DEBUG)
            del log.records[:]
            out["models"] = forward_check(nodes, torch)
            assert not log.problems(), log.problems()
            root.setLevel(level)
            for h, lvl in quiet:
                h.setLevel(lvl)

            f64_latents, perturbed_latents = sd1.spread_runs(__file__)

        for name in WORKFLOWS:
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            del log.records[:]
            del CALLS[:]
            del PRE_RUNS[:]
            saved, latents = sd1.run_workflow(prompt, nodes, torch)
            assert not log.problems(), (name, log.problems())
            calls = [list(c) for c in CALLS]
            assert calls and all(c[3] for c in calls), (name, calls)
            assert all(c[0] == CONTROL_LORA for c in calls), calls
            pre_runs = [dict(p) for p in PRE_RUNS]
            assert pre_runs and all(p == pre_runs[0] for p in pre_runs), pre_runs
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            assert np.isfinite(lat).all() and np.isfinite(img).all(), name
            if sub:
                out["workflows"][name] = sd1.b64(lat.astype("<f4"))
                continue
            has_lora = any(n["class_type"] == "LoraLoader" for n in prompt.values())
            patched = pre_runs[0]["unet_params_patched"]
            assert (patched > 0) == has_lora, (name, pre_runs[0])
            _, plain = sd1.run_workflow(cp.without_control(prompt), nodes, torch)
            r = rel(lat, plain[0].float().numpy())

            def spread_to(latents):
                other = np.frombuffer(base64.b64decode(latents[name]), "<f4")
                return rel(lat.reshape(-1), other)
            w = {"f32_vs_f64_unet_rel": spread_to(f64_latents),
                 "unet_rounding_rel": spread_to(perturbed_latents),
                 "control_vs_no_control_rel": r}
            spread = max(w["f32_vs_f64_unet_rel"], w["unet_rounding_rel"])
            assert r > 0.01 and r > 20 * spread, (name, w)
            if has_lora:
                UNPATCHED.append(True)
                try:
                    _, unpatched = sd1.run_workflow(prompt, nodes, torch)
                finally:
                    del UNPATCHED[:]
                w["unpatched_control_base_rel"] = rel(lat, unpatched[0].float().numpy())
                assert w["unpatched_control_base_rel"] > 20 * spread, (name, w)
            w.update({"control_calls": calls, "pre_runs": len(pre_runs),
                      "unet_params_patched": patched,
                      "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
                      "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4"))})
            out["workflows"][name] = w
            print(name, "latent", lat.shape, "abs mean", float(np.abs(lat).mean()),
                  "std", float(lat.std()), "image mean", float(img.mean()),
                  "f32 vs f64 UNet", w["f32_vs_f64_unet_rel"],
                  "UNet rounding", w["unet_rounding_rel"], "vs no control", r,
                  "vs unpatched control base", w.get("unpatched_control_base_rel"),
                  "pre_runs", len(pre_runs), pre_runs[0])
            for c in calls:
                print("   get_control", c)
        if sub:
            print(json.dumps(out["workflows"]))
            return
        sd1.write_expected("control_lora", out)
    finally:
        root.setLevel(level)
        root.removeHandler(log)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
