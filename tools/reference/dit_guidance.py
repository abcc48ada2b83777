"""End-to-end references for ComfyUI's DiT guidance nodes: skip-layer
guidance (SkipLayerGuidanceSD3, SkipLayerGuidanceDiT,
SkipLayerGuidanceDiTSimple) and FluxDisableGuidance.

The models are the existing tiny ones, unchanged:
  checkpoints/tiny_sd35_medium.safetensors: sd3_pipeline.py's (MMDiT-X,
      depth 2 = joint blocks 0 and 1, dual attention in block 0, qk_norm
      rms, pos_embed 24x24 scaled 256), assembled as sd3_pipeline builds it
      (its parts clip/tiny_clip_l, tiny_clip_g, tiny_t5xxl_sd3, the
      VAE and the prefix-less MMDiT written first, then
      comfy.sd.save_checkpoint's layout); keys, scaled and checksum_f16
      asserted equal to its entry in tests/reference/sd3/expected.json.
  unet/tiny_flux_dev.safetensors, clip/tiny_t5xxl.safetensors,
      clip/tiny_clip_l.safetensors, vae/tiny_flux_ae.safetensors:
      flux_pipeline.py's (double blocks 0, 1; single blocks 0, 1), entries
      asserted equal to tests/reference/flux/expected.json's.
  unet/tiny_chroma.safetensors: chroma_pipeline.py's (double 0, 1; single
      0, 1), entry asserted equal to tests/reference/chroma/expected.json's.
The workflows graphs/tiny_sd3_slg.json, tiny_flux_slg.json,
tiny_flux_no_guidance.json and tiny_chroma_slg_simple.json (written by
this script) are run through ComfyUI's own node classes on the CPU in f32,
and tests/reference/dit_guidance/expected.json gets:
  files: those six files' entries (folder, name, keys sorted with shapes,
      scaled, checksum_f16), each equal to its source fixture's entry.
  workflows: per graph as flux's: latent_shape, latent_f32, image_shape,
      image_f32 (base64 little-endian f32), image_range [min, max, std],
      f32_vs_f64_unet_rel, unet_rounding_rel (sd1_pipeline's spread runs);
      and, for the record, without_rel (max |latent - latent of the same
      graph with the guidance node removed, its consumers wired to its
      input| / max |that latent|: the node matters).
  components:
    slg_sigmas: {graph: [sigma...]}: the sigmas (f32 values, as the
        sampler passed them) of the model calls that ran with skipped
        blocks (transformer_options patches_replace["dit"] set), in
        order; [] for tiny_flux_no_guidance.
    slg_bounds: {graph: [sigma_start, sigma_end]}: the node's
        model_sampling.percent_to_sigma(start_percent / end_percent) (f64
        Python floats) for the SLG graphs.
    step_sigmas: {graph: [sigma per model step]}: the distinct sigmas the
        model was called at (euler: one step each).
    dit_calls: {graph: [[sigma, batch, role, skipped blocks]...]}: every
        BaseModel.apply_model call in order; role "cond+uncond", "cond" or
        "uncond" (which conditioning(s) the batch holds, asserted from the
        contexts), skipped blocks [[kind, index]...].
    guidance_seen: {graph: [guidance per Flux DiT call: null or
        [values]]} for the two Flux graphs (what Flux._forward got), and
        "tiny_flux_no_guidance_without": the same for that graph without
        FluxDisableGuidance.
    cfg1_skip_sigmas: {"SkipLayerGuidanceDiT": [...],
        "SkipLayerGuidanceDiTSimple": [...]}: slg_sigmas of tiny_flux_slg and
        tiny_chroma_slg_simple re-run with cfg 1.0 (not fixtures; what
        ComfyUI does there).

Workflows (euler / simple; KSampler; 64x64 EmptySD3LatentImage -> latent
8x8):
  tiny_sd3_slg: CheckpointLoaderSimple(tiny_sd35_medium) ->
      ModelSamplingSD3(3.0) -> SkipLayerGuidanceSD3(layers "1", scale 3.0,
      start 0.1, end 0.6) -> KSampler(cfg 4.0, 6 steps); positive and
      negative CLIPTextEncode. (The tiny MMDiT has 2 joint blocks, so "1"
      is the last one; its percent_to_sigma is ModelSamplingSD3's shift 3,
      the node coming after ModelSamplingSD3.)
  tiny_flux_slg: tiny Flux dev -> SkipLayerGuidanceDiT(double "0", single
      "1", scale 2.5, start 0.0, end 0.45, rescaling 0.5) -> KSampler(cfg
      2.0, 6 steps); positive CLIPTextEncode -> FluxGuidance 3.0, negative
      CLIPTextEncode (a real prompt; no FluxGuidance: ComfyUI gives it
      guidance 3.5). end 0.45, not 0.5: percent_to_sigma(0.5) =
      0.75951091695 (f64) and the 4th step's f32 sigma is 0.75951093435, a
      tie decided by f32 rounding (0.45 -> 0.79424).
  tiny_flux_no_guidance: tiny Flux dev; positive CLIPTextEncode ->
      FluxGuidance 5.0 -> FluxDisableGuidance; negative ConditioningZeroOut
      of the encode; KSampler(cfg 1.0, 4 steps: the negative is never run).
  tiny_chroma_slg_simple: tiny Chroma -> SkipLayerGuidanceDiTSimple(double
      "0", single "0", start 0.2, end 0.8) -> KSampler(cfg 3.0, 6 steps);
      positive and negative CLIPTextEncode (CLIPLoader chroma).

How ComfyUI does it (asserted here where observable):
  * SkipLayerGuidanceSD3.execute is SkipLayerGuidanceDiT.execute with
      double_layers = layers, single_layers "".
  * Both compute, at node time, sigma_start = percent_to_sigma(start),
      sigma_end = percent_to_sigma(end) of the model's model_sampling
      (ModelSamplingFlux / DiscreteFlow: start 0 -> 1.0 exactly; else
      time shift of 1 - percent, f64). Layers: every run of digits in the
      string. A layer is "skipped" by a patches_replace["dit"][(kind, i)]
      function returning its inputs unchanged (the block's img/txt pass
      through; for the MMDiT's joint block both streams).
  * SkipLayerGuidanceDiT: a sampler_post_cfg_function. After the normal
      cond+uncond call and cfg (uncond + (cond - uncond) * cfg), if scale > 0
      and sigma_end <= sigma <= sigma_start (sigma: the f32 sigma as a
      Python float), one more calc_cond_batch of the cond alone with the
      layers skipped: denoised = cfg_result + (cond - slg) * scale; if
      rescaling_scale != 0: factor = std(cond) / std(that) (torch .std():
      unbiased, over the whole batch tensor), factor = rescaling_scale *
      factor + (1 - rescaling_scale), denoised *= factor.
  * SkipLayerGuidanceDiTSimple: a sampler_calc_cond_batch_function. In
      range (and with an uncond), cond runs alone normally and uncond alone
      with the layers skipped; out of range the normal batched call.
  * Post-cfg functions run at cfg 1.0 too (uncond skipped: uncond_pred is
      zeros, cfg_result = cond), so SkipLayerGuidanceDiT still adds its pass
      there; SkipLayerGuidanceDiTSimple needs the uncond and does nothing
      (cfg1_skip_sigmas).
  * FluxDisableGuidance sets "guidance": None on the conditioning
      (overriding FluxGuidance's value); Flux.extra_conds then adds no
      guidance and Flux._forward gets guidance None, so guidance_in is not
      applied (vec = time_in + vector_in). Without the node the DiT gets
      the FluxGuidance value.

Relaxed as in sd3_pipeline.py, flux_pipeline.py and chroma_pipeline.py
(their patch_comfy; flux_pipeline's once). sd3_pipeline's SDClipModel
config (its 256-wide T5 for t5_config_xxl.json) and flux_pipeline's
(32-wide) clash, so the SD3 one is installed only while the SD3 checkpoint
is built and its graph runs.

    COMFY_DIR=/work/comfyfull /work/venv-ref/bin/python tools/reference/dit_guidance.py
(media-only imports are stubbed as in sd1_pipeline.py; the base fixtures
are not rewritten; model folders, fixture checks, the SD3.5 checkpoint,
workflow runs, spreads and per-workflow fields are fixture_runs.py's.)
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import flux_pipeline as fp  # noqa: E402
import flux_fill as ff  # noqa: E402
import fixture_runs as fr  # noqa: E402
import inpaint_pipeline as ip  # noqa: E402
import sd3_pipeline as s3  # noqa: E402
import chroma_pipeline as cp  # noqa: E402

FLUX_FILES = ["tiny_flux_dev.safetensors", "tiny_t5xxl.safetensors", "tiny_clip_l.safetensors",
              "tiny_flux_ae.safetensors"]
SD3_CKPT = "tiny_sd35_medium.safetensors"
WORKFLOWS = ["tiny_sd3_slg", "tiny_flux_slg", "tiny_flux_no_guidance", "tiny_chroma_slg_simple"]
NODE = {"tiny_sd3_slg": "SkipLayerGuidanceSD3", "tiny_flux_slg": "SkipLayerGuidanceDiT",
        "tiny_flux_no_guidance": "FluxDisableGuidance",
        "tiny_chroma_slg_simple": "SkipLayerGuidanceDiTSimple"}
# The skipped blocks each SLG graph asks for.
SKIPS = {"tiny_sd3_slg": [("double_block", 1)],
         "tiny_flux_slg": [("double_block", 0), ("single_block", 1)],
         "tiny_flux_no_guidance": [],
         "tiny_chroma_slg_simple": [("double_block", 0), ("single_block", 0)]}
STEPS = {"tiny_sd3_slg": 6, "tiny_flux_slg": 6, "tiny_flux_no_guidance": 4,
         "tiny_chroma_slg_simple": 6}
FOX = ("a (red:1.2) fox curled up asleep in fresh snow under tall pine trees, "
       "[soft blue dusk light], ((frost on its fur)), distant mountains, film grain")
NEGATIVE = "blurry, low quality, jpeg artifacts, watermark, oversaturated"


def tail(name, sampler):
    return {"8": {"class_type": "VAEDecode", "inputs": {"samples": [sampler, 0], "vae": None}},
            "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0],
                                                        "filename_prefix": name}},
            "99": {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0],
                                                          "filename_prefix": "latents/" + name}}}


def ksampler(model, pos, neg, seed, steps, cfg):
    return {"class_type": "KSampler", "inputs": {
        "model": model, "positive": pos, "negative": neg, "latent_image": ["6", 0], "seed": seed,
        "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}


LATENT = {"class_type": "EmptySD3LatentImage",
          "inputs": {"width": 64, "height": 64, "batch_size": 1}}


def flux_head(unet):
    if unet == "tiny_chroma.safetensors":
        clip = {"class_type": "CLIPLoader", "inputs": {"clip_name": "tiny_t5xxl.safetensors",
                                                       "type": "chroma", "device": "default"}}
    else:
        clip = {"class_type": "DualCLIPLoader", "inputs": {
            "clip_name1": "tiny_clip_l.safetensors", "clip_name2": "tiny_t5xxl.safetensors",
            "type": "flux", "device": "default"}}
    return {"1": {"class_type": "UNETLoader",
                  "inputs": {"unet_name": unet, "weight_dtype": "default"}},
            "2": clip,
            "13": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_flux_ae.safetensors"}}}


def graph_for(name):
    """The workflow, in the layout of graphs/tiny_*_txt2img.json."""
    if name == "tiny_sd3_slg":
        g = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD3_CKPT}},
             "2": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": 3.0}},
             "10": {"class_type": "SkipLayerGuidanceSD3", "inputs": {
                 "model": ["2", 0], "layers": "1", "scale": 3.0, "start_percent": 0.1,
                 "end_percent": 0.6}},
             "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": (
                 "an astronaut riding a horse across red dunes on mars, (cinematic:1.1), "
                 "dust in the air")}},
             "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": NEGATIVE}},
             "6": LATENT,
             "7": ksampler(["10", 0], ["3", 0], ["4", 0], 31415926, 6, 4.0)}
        vae = ["1", 2]
    elif name == "tiny_flux_slg":
        g = flux_head("tiny_flux_dev.safetensors")
        g.update({
            "10": {"class_type": "SkipLayerGuidanceDiT", "inputs": {
                "model": ["1", 0], "double_layers": "0", "single_layers": "1", "scale": 2.5,
                "start_percent": 0.0, "end_percent": 0.45, "rescaling_scale": 0.5}},
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": FOX}},
            "4": {"class_type": "FluxGuidance",
                  "inputs": {"conditioning": ["3", 0], "guidance": 3.0}},
            "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": NEGATIVE}},
            "6": LATENT,
            "7": ksampler(["10", 0], ["4", 0], ["5", 0], 271828, 6, 2.0)})
        vae = ["13", 0]
    elif name == "tiny_flux_no_guidance":
        g = flux_head("tiny_flux_dev.safetensors")
        g.update({
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": FOX}},
            "4": {"class_type": "FluxGuidance",
                  "inputs": {"conditioning": ["3", 0], "guidance": 5.0}},
            "11": {"class_type": "FluxDisableGuidance", "inputs": {"conditioning": ["4", 0]}},
            "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["3", 0]}},
            "6": LATENT,
            "7": ksampler(["1", 0], ["11", 0], ["5", 0], 424242, 4, 1.0)})
        vae = ["13", 0]
    else:
        g = flux_head("tiny_chroma.safetensors")
        g.update({
            "10": {"class_type": "SkipLayerGuidanceDiTSimple", "inputs": {
                "model": ["1", 0], "double_layers": "0", "single_layers": "0",
                "start_percent": 0.2, "end_percent": 0.8}},
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": FOX}},
            "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": NEGATIVE}},
            "6": LATENT,
            "7": ksampler(["10", 0], ["3", 0], ["5", 0], 8675309, 6, 3.0)})
        vae = ["13", 0]
    assert g["7"]["inputs"]["steps"] == STEPS[name]
    g = json.loads(json.dumps(g))
    t = tail(name, "7")
    t["8"]["inputs"]["vae"] = vae
    g.update(t)
    return g


def v3_nodes():
    import comfy_extras.nodes_flux as flux
    import comfy_extras.nodes_sd3 as sd3
    import comfy_extras.nodes_slg as slg
    return {**s3.v3_nodes(), "SkipLayerGuidanceSD3": ff.v3(sd3.SkipLayerGuidanceSD3),
            "SkipLayerGuidanceDiT": ff.v3(slg.SkipLayerGuidanceDiT),
            "SkipLayerGuidanceDiTSimple": ff.v3(slg.SkipLayerGuidanceDiTSimple),
            "FluxDisableGuidance": ff.v3(flux.FluxDisableGuidance)}


class Family:
    """sd3_pipeline's and chroma_pipeline's relaxations on top of the
    flux_pipeline ones fr.comfy_tmp installed (flux_pipeline.patch_comfy
    not run again: its wrappers do not stack); `use(name)` puts the SD3
    SDClipModel config (256-wide T5) in place for SD3, flux_pipeline's
    (32-wide T5) otherwise."""
    def __init__(self, tmp, torch):
        import comfy.sd1_clip
        self.cls = comfy.sd1_clip.SDClipModel
        self.flux_init = self.cls.__init__
        saved = fp.patch_comfy
        fp.patch_comfy = lambda tmp, torch: None
        try:
            s3.patch_comfy(tmp, torch)
            self.sd3_init = self.cls.__init__
            self.cls.__init__ = self.flux_init
            cp.patch_comfy(tmp, torch)
            assert self.cls.__init__ is self.flux_init
        finally:
            fp.patch_comfy = saved

    def use(self, name):
        self.cls.__init__ = self.sd3_init if name.startswith("tiny_sd3") else self.flux_init


def write_files(tmp, nodes, torch, family, verbose):
    """The six files, each entry asserted equal to its source fixture's."""
    entries = fr.write_flux_files(tmp, FLUX_FILES, torch, verbose=verbose)
    # Chroma, as chroma_pipeline writes it.
    (ref,) = [x for x in fr.fixture("chroma")["files"] if x["name"] == cp.UNET]
    keys = sorted(cp.chroma_keys(torch))
    digest, _ = fp.write_file(os.path.join(tmp, "unet", cp.UNET), keys, None, torch)
    entries.append(fr.file_entry("unet", cp.UNET, keys, digest))
    assert json.loads(json.dumps(entries[-1])) == ref, cp.UNET
    if verbose:
        print("file unet", cp.UNET, "keys", len(keys), "checksum", digest,
              "(= chroma/expected.json)")
    # SD3.5 medium, as sd3_pipeline builds it (its parts first).
    family.use("tiny_sd3")
    sd3_files = {x["name"]: x for x in fr.fixture("sd3")["files"]}
    flux_files = {x["name"]: x for x in fr.fixture("flux")["files"]}
    assert sd3_files["tiny_clip_l.safetensors"] == flux_files["tiny_clip_l.safetensors"]
    entries.append(fr.write_sd35(tmp, nodes, SD3_CKPT, torch, ("sd3",), clip_l=False,
                                 verbose=verbose))
    family.use("tiny_flux")
    return entries


class Record:
    """Per KSampler call its positive / negative; per BaseModel.apply_model
    call the sigma, batch, context, skipped blocks and model_sampling; per
    Flux._forward the guidance it got."""
    def __init__(self, torch):
        import comfy.ldm.flux.model as fm
        import comfy.model_base as mb
        import comfy.sample
        self.samples, self.calls = [], []
        rec = self
        sample = comfy.sample.sample

        def sample_wrap(*args, **kwargs):
            rec.samples.append({"positive": args[6], "negative": args[7], "cfg": args[3]})
            return sample(*args, **kwargs)
        comfy.sample.sample = sample_wrap
        apply = mb.BaseModel.apply_model

        def apply_wrap(self, x, t, *args, **kwargs):
            to = kwargs.get("transformer_options", {})
            dit = to.get("patches_replace", {}).get("dit", {})
            ctx = kwargs.get("c_crossattn")
            rec.calls.append({"sigma": [float(s) for s in t], "batch": x.shape[0],
                              "skip": sorted(dit),
                              "skip_fns": sorted({f.__name__ for f in dit.values()}),
                              "context": None if ctx is None else ctx.clone(),
                              "model_sampling": self.model_sampling, "guidance": "absent"})
            return apply(self, x, t, *args, **kwargs)
        mb.BaseModel.apply_model = apply_wrap
        fwd = fm.Flux._forward

        def fwd_wrap(self, x, timestep, context, y=None, guidance=None, *args, **kwargs):
            rec.calls[-1]["guidance"] = None if guidance is None else [float(g) for g in guidance]
            return fwd(self, x, timestep, context, y, guidance, *args, **kwargs)
        fm.Flux._forward = fwd_wrap

    def clear(self):
        del self.samples[:], self.calls[:]


def node_inputs(prompt, name):
    (node,) = [n for n in prompt.values() if n["class_type"] == NODE[name]]
    return node["inputs"]


def bounds(name, prompt, ms):
    """The node's (sigma_start, sigma_end), from the sampler's
    model_sampling, as the node computes them."""
    i = node_inputs(prompt, name)
    return ms.percent_to_sigma(i["start_percent"]), ms.percent_to_sigma(i["end_percent"])


def check_calls(name, prompt, rec, torch):
    """Asserts the docstring's rules on the model calls; returns the
    components' entries (slg sigmas, bounds, step sigmas, dit_calls,
    guidance per call)."""
    (sample,) = rec.samples
    (pos,) = sample["positive"]
    (neg,) = sample["negative"]
    pos_ctx, neg_ctx = pos[0], neg[0]
    calls = rec.calls
    steps = []
    for c in calls:
        (s,) = set(c["sigma"])
        if not steps or steps[-1] != s:
            steps.append(s)
    assert len(steps) == STEPS[name] and len(set(steps)) == len(steps), (name, steps)
    want_skip = sorted(SKIPS[name])
    ms = calls[0]["model_sampling"]
    assert all(c["model_sampling"] is ms for c in calls)

    def same(one, ref):
        """The batch entry is `ref`, repeated along the tokens if ComfyUI
        padded it to a common length (conds.CONDCrossAttn.concat)."""
        ref = ref.to(one.dtype)
        n, m = one.shape[1], ref.shape[1]
        return (one.shape[0] == 1 and one.shape[2:] == ref.shape[2:] and n % m == 0
                and torch.equal(one, ref.repeat(1, n // m, 1)))

    def parts(c):
        ctx = c["context"]
        return ["cond" if same(ctx[i:i + 1], pos_ctx) else
                "uncond" if same(ctx[i:i + 1], neg_ctx) else "?" for i in range(c["batch"])]
    per = [parts(c) for c in calls]
    roles = ["+".join(p) for p in per]
    assert "?" not in "".join(roles), (name, roles)
    slg = [c["sigma"][0] for c in calls if c["skip"]]
    for c in calls:
        if c["skip"]:
            assert c["skip"] == want_skip and c["skip_fns"] == ["skip"], (name, c["skip"])
    entry = {"step_sigmas": steps, "slg_sigmas": slg,
             "dit_calls": [[c["sigma"][0], c["batch"], r, [list(k) for k in c["skip"]]]
                           for c, r in zip(calls, roles)]}
    if name == "tiny_flux_no_guidance":
        assert not slg
        assert roles == ["cond"] * STEPS[name], roles  # cfg 1.0: no uncond
        assert [c["guidance"] for c in calls] == [None] * STEPS[name]
        assert "guidance" in pos[1] and pos[1]["guidance"] is None, pos[1].keys()
        entry["guidance"] = [c["guidance"] for c in calls]
        return entry
    start, end = bounds(name, prompt, ms)
    active = [s for s in steps if end <= s <= start]
    assert slg == active and 0 < len(active) < len(steps), (name, slg, active, steps)
    margin = min(abs(s - b) for s in steps for b in (start, end) if s != b)
    ties = [s for s in steps if s in (start, end)]
    entry["bounds"] = [start, end]
    by_step = {s: [(c, r) for c, r in zip(calls, roles) if c["sigma"][0] == s] for s in steps}
    simple = name == "tiny_chroma_slg_simple"
    for s, cs in by_step.items():
        plain = [r for c, r in cs if not c["skip"]]
        skipped = [r for c, r in cs if c["skip"]]
        got = sorted("+".join(plain).split("+")) if plain else []
        if s not in active:
            assert got == ["cond", "uncond"] and not skipped, (name, s, plain, skipped)
        elif simple:
            # cond alone normally, then uncond alone with the layers skipped.
            assert [r for _, r in cs] == ["cond", "uncond"] and skipped == ["uncond"], (name, cs)
        else:
            # the normal call(s), then the cond alone with the layers skipped.
            assert got == ["cond", "uncond"] and skipped == ["cond"], (name, plain, skipped)
            assert cs[-1][0]["skip"], name
    if name.startswith("tiny_flux"):
        entry["guidance"] = [c["guidance"] for c in calls]
        g = {}
        for c, p in zip(calls, per):
            for r, v in zip(p, c["guidance"]):
                g.setdefault(r, set()).add(v)
        assert g == {"cond": {3.0}, "uncond": {3.5}}, g
    print("   sigma_start", start, "sigma_end", end, "step sigmas", steps)
    print("   skip-layer pass at", slg, "(", len(slg), "of", len(steps), "steps ), blocks",
          want_skip, "closest step sigma to a bound", margin,
          "step sigmas equal to a bound", ties)
    print("   calls [sigma, batch, role, skipped]:", entry["dit_calls"])
    return entry


def without(prompt, name):
    """The graph with the guidance node removed (consumers take its model
    or conditioning input)."""
    g = json.loads(json.dumps(prompt))
    (nid,) = [k for k, n in g.items() if n["class_type"] == NODE[name]]
    inputs = g[nid]["inputs"]
    src = inputs.get("model", inputs.get("conditioning"))
    del g[nid]
    for n in g.values():
        for k, v in n["inputs"].items():
            if isinstance(v, list) and v[0] == nid:
                n["inputs"][k] = list(src)
    return g


def with_cfg(prompt, cfg):
    g = json.loads(json.dumps(prompt))
    g["7"]["inputs"]["cfg"] = cfg
    return g


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import nodes

    log = ip.LogCapture()
    with fr.comfy_tmp(torch, ["checkpoints", "unet", "clip", "vae"], log) as tmp:
        family = Family(tmp, torch)
        out = {"files": write_files(tmp, nodes, torch, family, not sub),
               "workflows": {}, "components": {}}
        node_ns = fr.node_classes(nodes, v3_nodes())
        if not sub:
            for name in WORKFLOWS:
                fr.write_graph(name, graph_for(name))
            comp = {"slg_sigmas": {}, "slg_bounds": {}, "step_sigmas": {}, "dit_calls": {},
                    "guidance_seen": {}, "cfg1_skip_sigmas": {}}
            out["components"] = comp
            runs = sd1.spread_runs(__file__)
            rec = Record(torch)
        for name in WORKFLOWS:
            prompt = fr.load_graph(name)
            family.use(name)
            if not sub:
                assert prompt == graph_for(name), name
                rec.clear()
            lat, img = fr.run(name, prompt, node_ns, torch, log, ff.unet_warnings)
            if sub:
                out["workflows"][name] = fr.f32_b64(lat)
                continue
            print(name)
            entry = check_calls(name, prompt, rec, torch)
            comp["slg_sigmas"][name] = entry["slg_sigmas"]
            comp["step_sigmas"][name] = entry["step_sigmas"]
            comp["dit_calls"][name] = entry["dit_calls"]
            if "bounds" in entry:
                comp["slg_bounds"][name] = entry["bounds"]
            if "guidance" in entry:
                comp["guidance_seen"][name] = entry["guidance"]
            clipped = fr.check_image(name, img)
            w = fr.spreads(name, lat, runs)
            rec.clear()
            _, plain = sd1.run_workflow(without(prompt, name), node_ns, torch)
            assert not any(c["skip"] for c in rec.calls), name
            if name == "tiny_flux_no_guidance":
                seen = [c["guidance"] for c in rec.calls]
                assert seen == [[5.0]] * STEPS[name], seen
                comp["guidance_seen"][name + "_without"] = seen
                print("   without FluxDisableGuidance: guidance per DiT call", seen)
            w["without_rel"] = fr.rel(lat, plain[0].float().numpy())
            spread = max(w["f32_vs_f64_unet_rel"], w["unet_rounding_rel"])
            assert w["without_rel"] > max(1e-3, 100 * spread), (name, w)
            w.update(fr.outputs(lat, img))
            out["workflows"][name] = w
            print("  ", *fr.summary(lat, img, w, clipped), "without", NODE[name], w["without_rel"])
        if not sub:
            # cfg 1.0: the post-cfg function (SkipLayerGuidanceDiT) still runs;
            # the calc_cond_batch function (Simple) has no uncond to change.
            for name in ("tiny_flux_slg", "tiny_chroma_slg_simple"):
                family.use(name)
                rec.clear()
                prompt = with_cfg(fr.load_graph(name), 1.0)
                sd1.run_workflow(prompt, node_ns, torch)
                slg = [c["sigma"][0] for c in rec.calls if c["skip"]]
                comp["cfg1_skip_sigmas"][NODE[name]] = slg
                print(name, "at cfg 1.0:", len(rec.calls), "model calls, skip-layer pass at", slg)
            assert comp["cfg1_skip_sigmas"]["SkipLayerGuidanceDiT"] == \
                comp["slg_sigmas"]["tiny_flux_slg"]
            assert comp["cfg1_skip_sigmas"]["SkipLayerGuidanceDiTSimple"] == []
        fr.finish("dit_guidance", out, sub)


if __name__ == "__main__":
    main()
