"""End-to-end and component references for an XLabs-layout Flux ControlNet.

A tiny ControlNet in the key layout of the XLabs-AI flux-controlnet-*
files is built from ComfyUI's own class (comfy/ldm/flux/controlnet.py
ControlNetFlux, mistoline=False, latent_input=False), every value from
sd1_pipeline's `values(key, shape)` formula of the key as spelled in the
file, stored f16 (flux_pipeline.write_file). The base is flux_pipeline.py's
unet/tiny_flux_dev.safetensors with clip/tiny_t5xxl, clip/tiny_clip_l and
vae/tiny_flux_ae (keys and checksums asserted equal to
tests/reference/flux/expected.json). The workflows
graphs/tiny_flux_controlnet*.json (written by this script) are run through
ComfyUI's own node classes on the CPU in f32, and
tests/reference/flux_controlnet/expected.json gets:
  files: flux_pipeline's entries (folder, name, keys sorted with shapes,
      scaled {}, checksum_f16) for the four Flux files, then the ControlNet's
      (the same fields plus kind "flux_xlabs_controlnet" and base
      "tiny_flux_dev.safetensors"; folder "controlnet", ComfyUI's
      ControlNetLoader folder).
  workflows: per graph as flux's: latent_shape, latent_f32, image_shape,
      image_f32 (base64 little-endian f32), image_range [min, max, std],
      f32_vs_f64_unet_rel, unet_rounding_rel (sd1_pipeline's spread runs:
      the f64 run has the ControlNet in f64 too, ComfyUI's unet_dtype gives
      it the same dtype); without_rel (max |latent - latent of the same
      graph with every ControlNetApplyAdvanced bypassed| / max |that
      latent|: the ControlNet matters); control_calls: every
      ControlNet.get_control call of the sampling in the order the calls
      start ([strength, sigma, applied, batch, batched_number]; a chained
      net's call starts before its previous net's, which it calls first);
      dit_control: per DiT call (Flux.forward_orig) [sigma, batch, number
      of "input" entries, number of "output" entries] (0, 0 without
      control).
  components:
    controlnet_forward: the first ControlNetFlux.forward call of
        tiny_flux_controlnet (ControlNetFlux.forward hooked; the outputs
        copied before control_merge scales them in place): graph, sigma,
        strength; inputs x, timesteps, context, y, guidance, hint (each
        {shape, f32}); "input" and "output": {count, tensors: [{positions,
        shape, f32}]}, one item per DISTINCT tensor of the returned tuple
        with the positions it occupies (ComfyUI repeats the per-block
        tensors: "input" 19 entries, "output" 38). The outputs are
        ControlNetFlux's, before the strength.
    chain_hints: per ControlNetApplyAdvanced of tiny_flux_controlnet_chain
        (in graph order): strength, start_percent, end_percent, image_shape
        (what the node got, [B, H, W, C]), hint_shape and hint_f32 (what
        the first ControlNetFlux.forward of that net got as `hint`, after
        ComfyUI's resize; the second one is a real resize: 40x40 -> center
        crop 40x30 -> nearest-exact 64x48).

File controlnet/tiny_flux_controlnet_xlabs.safetensors (f16, no prefix):
  the tiny Flux dev's widths (hidden_size 64, num_heads 2 (head dim 32),
  axes_dim [4, 14, 14], mlp_ratio 4, vec_in_dim 64, context_in_dim 32,
  in_channels 16 (img_in [64, 64]), qkv_bias, guidance_in) with 2 double
  blocks and 1 single block (real XLabs files have 0 single blocks; this
  one exercises controlnet_single_blocks): img_in, time_in, vector_in,
  guidance_in, txt_in, double_blocks.{0,1}.*, single_blocks.0.* (the dev
  model's names and shapes, so the dev model's values for those names),
  controlnet_blocks.{0,1}.{weight [64, 64], bias}, controlnet_single_blocks.
  0.{weight [64, 64], bias}, pos_embed_input.{weight [64, 64], bias},
  input_hint_block.{0,2,4,...,14}.{weight, bias}: 3x3 convs 3->16, then
  16->16 (stride 2 at 4, 8, 12); no final_layer.

Workflows (the tiny Flux dev: UNETLoader + DualCLIPLoader flux + VAELoader
tiny_flux_ae; euler / simple, 4 steps, EmptySD3LatentImage 64x48 -> latent
[1, 16, 6, 8], ControlNetLoader(tiny_flux_controlnet_xlabs), no vae on the
apply nodes):
  tiny_flux_controlnet: FluxGuidance 3.0 on the positive, then
      ControlNetApplyAdvanced(positive, negative = CLIPTextEncode(a real
      negative prompt), LoadImage example.png (64x48 RGBA -> RGB), strength
      0.8, 0.0-0.7); cfg 2.0. Cond and uncond share the control object, so
      they run as one batch of 2 (guidance 3.0 / 3.5); the last step
      (sigma below percent_to_sigma(0.7)) runs without control.
  tiny_flux_controlnet_chain: FluxGuidance 3.5 on the positive, negative
      ConditioningZeroOut of the same encode; ControlNetApplyAdvanced
      (example.png, 0.6, 0.0-1.0) then ControlNetApplyAdvanced(the first's
      outputs, LoadImage example.png -> ImageScale(bilinear, 40x40, crop
      disabled) -> ImageInvert, 0.9, 0.2-0.8): the same loaded net twice;
      cfg 1.0 (uncond skipped). The second net skips the first step
      (sigma 1.0 above percent_to_sigma(0.2)).

How ComfyUI does it (asserted here where observable):
  * Loading (comfy/controlnet.py): load_controlnet_state_dict sees
      controlnet_blocks.0.weight and double_blocks.0.img_attn.norm.key_norm.
      scale -> load_controlnet_flux_xlabs_mistoline(mistoline=False):
      controlnet_config detects the keys as Flux (flux_pipeline's tiny
      detect relaxation, nothing more), ControlNetFlux(**unet_config),
      load_state_dict(strict=False) (missing keys: warning, unexpected:
      debug; none of either here, log captured at DEBUG), wrapped in
      ControlNet(extra_conds ['y', 'guidance'], compression_ratio 8,
      upscale_algorithm 'nearest-exact', latent_format None, strength_type
      CONSTANT). Every loaded tensor is the file's f16 value, f32.
  * ControlNetApplyAdvanced: control_net.copy().set_cond_hint(image
      [B, C, H, W], strength, (start, end)), previous net = the
      conditioning's 'control' (chain), one copy per previous net shared by
      positive and negative.
  * pre_run: timestep_range = (percent_to_sigma(start), percent_to_sigma(
      end)) (ModelSamplingFlux: 1.0 at 0.0, else flux_time_shift(1.15, 1,
      1 - p), flux_time_shift(mu, s, t) = e^mu / (e^mu + (1 / t - 1)^s):
      0.7 -> 0.5751, 0.2 -> 0.9266, 0.8 -> 0.4412; the 4 simple sigmas are
      1.0, 0.9045, 0.7595, 0.5128); get_control first calls the previous net's, then returns it
      unchanged (None if none) when sigma > range[0] or sigma < range[1].
  * The hint (ControlNet.get_control, cached while the latent size stays):
      common_upscale(image, latent_w * 8, latent_h * 8, "nearest-exact",
      "center") (center crop to the target aspect: x or y = round((old -
      old * ratio) / 2), then torch nearest-exact), cast to the model
      dtype; batch 1 is kept as is (broadcast_image_to returns a batch-1
      hint unchanged; ControlNetFlux broadcasts it over the batch).
  * The ControlNetFlux inputs: x = model_sampling.calculate_input(sigma,
      x_noisy) = x_noisy (CONST); timesteps = model_sampling.timestep(sigma)
      = sigma (ModelSamplingFlux); context = the batch's c_crossattn; y and
      guidance = the batch's 'y' (CLIP-L pooled) and 'guidance' conds
      (FluxGuidance's value, 3.5 where none was set).
  * ControlNetFlux.forward: hint * 2 - 1 -> input_hint_block (SiLU between
      the convs, none after the last) -> [B, 16, h, w] (latent size) ->
      patchified "b c (h 2) (w 2) -> b (h w) (c 2 2)"; x padded to even
      size and patchified the same; img = img_in(x) + pos_embed_input(hint);
      vec = time_in(emb(t)) + guidance_in(emb(guidance)) + vector_in(y[:,
      :64]) (emb: timestep_embedding, time_factor 1000); txt = txt_in(ctx);
      img_ids (0, row, col), txt_ids 0; after double block i:
      controlnet_blocks[i](img); then cat(txt, img) through the single
      blocks, after single block i: controlnet_single_blocks[i](img tokens).
      Returned: "input" = (per double block tensors) repeated
      ceil(19 / n) times, cut to 19 (n = 2: block 0 at even positions,
      block 1 at odd); "output" = the single tensors repeated, cut to 38
      (n = 1: one tensor at all 38); no "middle".
  * control_merge: each DISTINCT tensor multiplied once, in place, by the
      strength (a Python float: f32 tensor * f32(strength)); a chained net
      then adds the previous net's merged lists position by position
      (prev + own, out of place); "middle" stays [].
  * Flux.forward_orig: after double block i, if i < len(control["input"]):
      img[:, :add.shape[1]] += add; after single block i, if i <
      len(control["output"]): img[:, txt_len : txt_len + add.shape[1]] +=
      add (the tiny dev's 2 double / 2 single blocks use input[0..1] and
      output[0..1]); asserted on the first DiT call of
      tiny_flux_controlnet with module hooks on its blocks.

Relaxed as in flux_pipeline.py (fp.patch_comfy), nothing more.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/flux_controlnet.py
(media-only imports are stubbed as in sd1_pipeline.py; the flux fixtures are
not rewritten; the graphs are written by the main run; the steps shared
with the other Flux fixture scripts -- model folders, fixture checks,
workflow runs, spreads, per-workflow fields -- are fixture_runs.py's; the
recording wrappers, the DiT trace and its add-rule check and the
per-workflow control fields are control_runs.py's.)
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
CN = "tiny_flux_controlnet_xlabs.safetensors"
WORKFLOWS = ["tiny_flux_controlnet", "tiny_flux_controlnet_chain"]
CN_PARAMS = dict(fp.FLUX, depth=2, depth_single_blocks=1)
MAIN_DOUBLE, MAIN_SINGLE = 19, 38
HINT_BLOCKS = [0, 2, 4, 6, 8, 10, 12, 14]
HINT_STRIDE2 = {4, 8, 12}
PROBLEMS = ("missing controlnet keys", "unexpected controlnet keys", "leftover keys",
            "could not detect", "control could not be applied", "error checkpoint",
            "no VAE provided", "ERROR")

PROMPT = ("a (red:1.2) fox curled up asleep in fresh snow under tall pine trees, [soft blue "
          "dusk light], ((frost on its fur)), distant mountains, film grain")
NEGATIVE = "blurry, lowres, (jpeg artifacts:1.3), watermark, text, oversaturated"
CHAIN_PROMPT = ("an old stone lighthouse on a (rocky:1.1) cliff at sunset, waves crashing, "
                "seagulls, [warm orange light]")


def graph_for(name):
    """The API prompt of workflow `name` (node ids as in
    graphs/tiny_flux_txt2img.json where they play the same part)."""
    g = fr.flux_loaders()
    if name == "tiny_flux_controlnet":
        g.update({
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": PROMPT}},
            "4": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["3", 0],
                                                           "guidance": 3.0}},
            "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": NEGATIVE}},
            "10": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
            "20": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": CN}},
            "21": {"class_type": "ControlNetApplyAdvanced", "inputs": {
                "positive": ["4", 0], "negative": ["5", 0], "control_net": ["20", 0],
                "image": ["10", 0], "strength": 0.8, "start_percent": 0.0,
                "end_percent": 0.7}},
            "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 48,
                                                                  "batch_size": 1}},
            "7": {"class_type": "KSampler", "inputs": {
                "model": ["1", 0], "positive": ["21", 0], "negative": ["21", 1],
                "latent_image": ["6", 0], "seed": 737373, "steps": 4, "cfg": 2.0,
                "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        })
    else:
        g.update({
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0],
                                                             "text": CHAIN_PROMPT}},
            "4": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["3", 0],
                                                           "guidance": 3.5}},
            "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["3", 0]}},
            "10": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
            "11": {"class_type": "ImageScale", "inputs": {
                "image": ["10", 0], "upscale_method": "bilinear", "width": 40, "height": 40,
                "crop": "disabled"}},
            "12": {"class_type": "ImageInvert", "inputs": {"image": ["11", 0]}},
            "20": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": CN}},
            "21": {"class_type": "ControlNetApplyAdvanced", "inputs": {
                "positive": ["4", 0], "negative": ["5", 0], "control_net": ["20", 0],
                "image": ["10", 0], "strength": 0.6, "start_percent": 0.0,
                "end_percent": 1.0}},
            "22": {"class_type": "ControlNetApplyAdvanced", "inputs": {
                "positive": ["21", 0], "negative": ["21", 1], "control_net": ["20", 0],
                "image": ["12", 0], "strength": 0.9, "start_percent": 0.2,
                "end_percent": 0.8}},
            "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 48,
                                                                  "batch_size": 1}},
            "7": {"class_type": "KSampler", "inputs": {
                "model": ["1", 0], "positive": ["22", 0], "negative": ["22", 1],
                "latent_image": ["6", 0], "seed": 747474, "steps": 4, "cfg": 1.0,
                "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        })
    g.update(fr.save_nodes(name, ["13", 0]))
    return g


# --- the control file ------------------------------------------------------

def controlnet_keys(torch):
    """ControlNetFlux's state dict keys and shapes for the tiny widths,
    checked against the layout the docstring lists."""
    import comfy.ops
    from comfy.ldm.flux.controlnet import ControlNetFlux
    m = ControlNetFlux(image_model="flux", guidance_embed=True, dtype=torch.float32,
                       device="meta", operations=comfy.ops.disable_weight_init, **CN_PARAMS)
    keys = [(k, list(t.shape)) for k, t in m.state_dict().items()]
    got = dict(keys)
    dev = dict(fp.flux_keys(torch, True))
    h = CN_PARAMS["hidden_size"]
    want = {k: s for k, s in dev.items() if not k.startswith("final_layer.")
            and not (k.startswith("single_blocks.") and int(k.split(".")[1]) >= 1)
            and not (k.startswith("double_blocks.") and int(k.split(".")[1]) >= 2)}
    for i in range(CN_PARAMS["depth"]):
        want.update({"controlnet_blocks.{}.weight".format(i): [h, h],
                     "controlnet_blocks.{}.bias".format(i): [h]})
    want.update({"controlnet_single_blocks.0.weight": [h, h],
                 "controlnet_single_blocks.0.bias": [h],
                 "pos_embed_input.weight": [h, 4 * CN_PARAMS["in_channels"]],
                 "pos_embed_input.bias": [h]})
    for n in HINT_BLOCKS:
        want["input_hint_block.{}.weight".format(n)] = [16, 3 if n == 0 else 16, 3, 3]
        want["input_hint_block.{}.bias".format(n)] = [16]
    assert got == want, sorted(set(got.items()) ^ set((k, tuple(v)) for k, v in want.items()))
    strides = [m.input_hint_block[n].stride[0] for n in HINT_BLOCKS]
    assert strides == [2 if n in HINT_STRIDE2 else 1 for n in HINT_BLOCKS], strides
    return keys


def problems(log):
    """ip.LogCapture records about the UNet's weights (warnings) or the
    control model (any level)."""
    return ff.unet_warnings(log) + [m for _, m in log.records if any(p in m for p in PROBLEMS)]


class Record:
    """The xlabs loader's calls; every ControlNet.get_control call (stack
    order kept, result copied); every ControlNetFlux.forward call (inputs
    and outputs copied before control_merge touches them); every Flux DiT
    forward_orig call (the control it got) and, when `trace` is set, the
    hidden states around the blocks of the next DiT call."""
    def __init__(self, torch):
        import comfy.controlnet as cn
        import comfy.ldm.flux.controlnet as fc
        self.torch = torch
        self.loads = []
        self.trace = False
        self.reset()
        rec = self

        load = cn.load_controlnet_flux_xlabs_mistoline

        def load_wrap(sd, mistoline=False, model_options={}):
            rec.loads.append({"mistoline": mistoline})
            return load(sd, mistoline=mistoline, model_options=model_options)
        cn.load_controlnet_flux_xlabs_mistoline = load_wrap

        cr.record_get_control(rec, ("c_crossattn", "y", "guidance"))

        forward = fc.ControlNetFlux.forward

        def fwd_wrap(self, x, timesteps, context, y=None, guidance=None, hint=None, **kwargs):
            out = forward(self, x, timesteps, context, y=y, guidance=guidance, hint=hint, **kwargs)
            entry = {"model": id(self), "x": x.clone(), "timesteps": timesteps.clone(),
                     "context": context.clone(), "y": None if y is None else y.clone(),
                     "guidance": None if guidance is None else guidance.clone(),
                     "hint": hint.clone(), "kwargs": sorted(kwargs), "keys": sorted(out)}
            for key in ("input", "output", "middle"):
                if key in out:
                    entry[key] = cr.groups_of(list(out[key]))
            rec.forwards.append(entry)
            if rec.stack:
                rec.stack[-1]["forward"] = entry
            return out
        fc.ControlNetFlux.forward = fwd_wrap

        cr.record_flux_dit(rec)

    def reset(self):
        self.controls, self.forwards, self.dits, self.stack = [], [], [], []


# --- checks ----------------------------------------------------------------

def check_loaded(nodes, torch, keys, log, rec):
    """ControlNetLoader on the file, the log captured at DEBUG level (where
    ComfyUI reports unexpected keys)."""
    import comfy.controlnet as cn
    del rec.loads[:]
    with fr.debug_log(log) as msgs:
        (c,) = nodes.ControlNetLoader().load_controlnet(CN)
    assert not problems(log), problems(log)
    assert rec.loads == [{"mistoline": False}], rec.loads
    m = c.control_model
    assert type(c) is cn.ControlNet and type(m).__name__ == "ControlNetFlux", (type(c), type(m))
    assert not m.mistoline and not m.latent_input and m.controlnet_mode_embedder is None
    assert (m.main_model_double, m.main_model_single) == (MAIN_DOUBLE, MAIN_SINGLE)
    assert not hasattr(m, "final_layer")
    assert (len(m.double_blocks), len(m.single_blocks)) == (2, 1)
    assert m.params.guidance_embed and m.params.vec_in_dim == CN_PARAMS["vec_in_dim"]
    assert c.compression_ratio == 8 and c.upscale_algorithm == "nearest-exact"
    assert c.latent_format is None and c.extra_conds == ["y", "guidance"], c.extra_conds
    assert c.strength_type == cn.StrengthType.CONSTANT and not c.concat_mask
    assert c.manual_cast_dtype is None and m.dtype == torch.float32, (c.manual_cast_dtype, m.dtype)
    sd = m.state_dict()
    assert set(sd) == {k for k, _ in keys}, set(sd) ^ {k for k, _ in keys}
    for k, shape in keys:
        want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
        assert sd[k].dtype == torch.float32, (k, sd[k].dtype)
        assert np.array_equal(sd[k].numpy(), want), k
    print("load", CN, "->", type(c).__name__, "/", type(m).__name__,
          "via load_controlnet_flux_xlabs_mistoline(mistoline=False); dtype", m.dtype,
          "manual cast", c.manual_cast_dtype, "extra_conds", c.extra_conds, "double / single",
          len(m.double_blocks), len(m.single_blocks), "repeat to", m.main_model_double,
          m.main_model_single, "tensors", len(sd), "= file keys, every value its f16 value")
    print("   log at DEBUG during the load ({} records):".format(len(msgs)), msgs)
    return c


def want_hint(image, torch, w, h):
    import comfy.utils
    return comfy.utils.common_upscale(image.movedim(-1, 1), w, h, "nearest-exact", "center")


def check_forward(fwd, gc, torch):
    """One ControlNetFlux.forward call against the get_control call that
    made it (docstring rules)."""
    x, cond = gc["x"], gc["cond"]
    assert torch.equal(fwd["x"], x), "x = calculate_input(sigma, x) = x (CONST)"
    assert torch.equal(fwd["timesteps"], gc["t"]), "timesteps = sigma (ModelSamplingFlux)"
    assert torch.equal(fwd["context"], cond["c_crossattn"])
    assert torch.equal(fwd["y"], cond["y"]) and torch.equal(fwd["guidance"], cond["guidance"])
    assert fwd["kwargs"] == [] and fwd["keys"] == ["input", "output"], (fwd["kwargs"], fwd["keys"])
    assert fwd["hint"].shape[0] == 1 and list(fwd["hint"].shape[2:]) == [8 * x.shape[2],
                                                                         8 * x.shape[3]]
    n_tokens = (x.shape[2] // 2) * (x.shape[3] // 2)
    inp, outp = fwd["input"], fwd["output"]
    assert inp["count"] == MAIN_DOUBLE and outp["count"] == MAIN_SINGLE
    nd = 2
    assert [g["positions"] for g in inp["groups"]] == [
        [p for p in range(MAIN_DOUBLE) if p % nd == i] for i in range(nd)], inp["groups"]
    assert [g["positions"] for g in outp["groups"]] == [list(range(MAIN_SINGLE))]
    for g in inp["groups"] + outp["groups"]:
        assert list(g["value"].shape) == [x.shape[0], n_tokens, CN_PARAMS["hidden_size"]]
    assert math.ceil(MAIN_DOUBLE / nd) * nd >= MAIN_DOUBLE
    return n_tokens


def scaled_lists(fwd, strength):
    """control_merge's lists for one net without a previous one."""
    out = {key: cr.scaled(fwd[key], strength) for key in ("input", "output")}
    out["middle"] = []
    return out


def check_controls(name, rec, torch):
    """Every get_control call: range rule, strength scaling, chain merge.
    Returns the control_calls field."""
    calls = []
    for e in rec.controls:
        calls.append([e["strength"], e["sigma"], e["applied"], e["batch"], e["batched_number"]])
        prev = e["prev_entry"]
        if e["prev"] is not None:
            assert prev is not None and prev["net"] == e["prev"]
        prev_res = None if prev is None else prev["result"]
        if not e["applied"]:
            assert e["forward"] is None
            if prev_res is None:
                assert e["result"] is None
            else:
                assert e["result"].keys() == prev_res.keys()
                for k in prev_res:
                    assert all(torch.equal(a, b) for a, b in zip(e["result"][k], prev_res[k]))
            continue
        fwd = e["forward"]
        assert fwd is not None and fwd["model"] == e["model"]
        check_forward(fwd, e, torch)
        own = scaled_lists(fwd, e["strength"])
        res = e["result"]
        assert sorted(res) == ["input", "middle", "output"] and res["middle"] == [], sorted(res)
        for k in ("input", "output"):
            want = own[k] if prev_res is None else [p + o for p, o in zip(prev_res[k], own[k])]
            assert len(res[k]) == len(want) and all(torch.equal(a, b)
                                                    for a, b in zip(res[k], want)), (name, k)
    # The outermost call per model call is what the DiT got.
    outer = [e for e in rec.controls if not any(o["prev_entry"] is e for o in rec.controls)]
    cr.check_flux_dits(outer, rec.dits, torch)
    assert [d for d in rec.dits if d["control"] is not None], name
    return calls


def forward_component(name, rec, strength):
    fwd = rec.forwards[0]
    (gc,) = [e for e in rec.controls if e["forward"] is fwd]
    inputs = {k: fr.tensor_entry(fwd[k]) for k in ("x", "timesteps", "context", "y",
                                                    "guidance", "hint")}
    out = {"graph": name, "sigma": gc["sigma"], "strength": strength, "inputs": inputs}
    for key in ("input", "output"):
        out[key] = cr.groups_entry(fwd[key])
    return out


def check_ranges(rec, nets):
    """Each get_control call's timestep_range is (percent_to_sigma(start),
    percent_to_sigma(end)) of its apply node (told apart by strength)."""
    by_strength = {n["inputs"]["strength"]: n["inputs"] for n in nets}
    assert len(by_strength) == len(nets)
    for e in rec.controls:
        i = by_strength[e["strength"]]
        want = (cr.flux_percent_to_sigma(i["start_percent"]),
                cr.flux_percent_to_sigma(i["end_percent"]))
        assert all(abs(a - b) <= 1e-12 for a, b in zip(e["range"], want)), (e["range"], want)
        assert e["applied"] == (not (e["sigma"] > want[0] or e["sigma"] < want[1]))
    return {s: [cr.flux_percent_to_sigma(i["start_percent"]),
                cr.flux_percent_to_sigma(i["end_percent"])] for s, i in by_strength.items()}


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
        keys = sorted(controlnet_keys(torch))
        digest, _ = fp.write_file(os.path.join(cdir, CN), keys, None, torch)
        out["files"].append(fr.file_entry("controlnet", CN, keys, digest,
                                          kind="flux_xlabs_controlnet",
                                          base="tiny_flux_dev.safetensors"))
        rec = Record(torch)
        node_ns = fr.node_classes(nodes, fp.v3_nodes())
        if not sub:
            fr.print_file("controlnet", CN, keys, digest)
            for name in WORKFLOWS:
                fr.write_graph(name, graph_for(name))
            check_loaded(nodes, torch, keys, log, rec)
            (example,) = nodes.LoadImage().load_image("example.png")[:1]
            runs = sd1.spread_runs(__file__)
        for name in WORKFLOWS:
            prompt = fr.load_graph(name)
            assert prompt == graph_for(name), name
            rec.reset()
            rec.trace = not sub and name == "tiny_flux_controlnet"
            lat, img = fr.run(name, prompt, node_ns, torch, log, problems)
            if sub:
                out["workflows"][name] = fr.f32_b64(lat)
                continue
            print(name)
            calls = check_controls(name, rec, torch)
            nets = [n for n in prompt.values() if n["class_type"] == "ControlNetApplyAdvanced"]
            ranges = check_ranges(rec, nets)
            dit_control = cr.flux_dit_control(rec)
            cr.print_calls(calls, "DiT calls [sigma, batch, input entries, output entries]:",
                           dit_control)
            print("   timestep ranges (sigma) by strength:", ranges)
            models = {f["model"] for f in rec.forwards}
            assert len(models) == 1, "one loaded net, shared by every apply node's copy"
            if name == "tiny_flux_controlnet":
                (traced,) = [d for d in rec.dits if "trace" in d]
                assert traced is next(d for d in rec.dits if d["control"] is not None)
                cr.check_flux_trace(traced, torch)
                fwd = rec.forwards[0]
                assert torch.equal(fwd["hint"], want_hint(example, torch, 64, 48))
                assert torch.equal(fwd["hint"], example.movedim(-1, 1)), "64x48: identity"
                assert fwd["x"].shape[0] == 2, "cond and uncond batched"
                g = sorted(fwd["guidance"].tolist())
                assert g == [3.0, 3.5], g
                assert [c[2] for c in calls] == [True, True, True, False], calls
                out["components"]["controlnet_forward"] = forward_component(
                    name, rec, nets[0]["inputs"]["strength"])
                print("   forward: x", list(fwd["x"].shape), "hint", list(fwd["hint"].shape),
                      "context", list(fwd["context"].shape), "y", list(fwd["y"].shape),
                      "guidance", fwd["guidance"].tolist(), "timesteps",
                      fwd["timesteps"].tolist(), "input distinct",
                      [g["positions"][:3] for g in fwd["input"]["groups"]], "output distinct",
                      len(fwd["output"]["groups"]), "abs max",
                      max(float(g["value"].abs().max()) for g in fwd["input"]["groups"]))
            else:
                imgs = [example, 1.0 - cr.want_image_scale(example, torch, 40, 40)]
                hints = []
                for node, image in zip(nets, imgs):
                    st = node["inputs"]["strength"]
                    first = next(c for c in rec.controls
                                 if c["strength"] == st and c["forward"] is not None)
                    hint = first["forward"]["hint"]
                    assert torch.equal(hint, want_hint(image, torch, 64, 48)), st
                    hints.append({"strength": st, "start_percent": node["inputs"]["start_percent"],
                                  "end_percent": node["inputs"]["end_percent"],
                                  "image_shape": list(image.shape),
                                  "hint_shape": list(hint.shape), "hint_f32": fr.b64t(hint)})
                    print("   hint of net", st, "image", list(image.shape), "-> hint",
                          list(hint.shape), "mean", float(hint.mean()))
                out["components"]["chain_hints"] = hints
                assert [c[2] for c in calls] == [False, True, True, True, True, True, True, True], \
                    calls
            out["workflows"][name] = cr.workflow_entry(
                name, lat, img, runs, rec, cr.without_control(prompt), node_ns, torch, calls,
                dit_control)
        size = fr.finish("flux_controlnet", out, sub)
        if size is not None:
            assert size < 2_000_000, size


if __name__ == "__main__":
    main()
