"""End-to-end references for Flux Fill (inpaint / outpaint), Flux Canny /
Depth-style models and the DifferentialDiffusion node.

Two tiny Flux DiTs are built from flux_pipeline.py's tiny dev model (same
keys, same value formula, f16, guidance_in present), with a wider input:
  unet/tiny_flux_fill.safetensors: in_channels 96 (img_in.weight [64, 384]),
      as flux1-fill-dev: 16 latent + 16 masked-image latent + 64 mask
      channels, patchified 2x2.
  unet/tiny_flux_canny.safetensors: in_channels 32 (img_in.weight [64, 128]),
      as flux1-canny-dev / flux1-depth-dev: 16 latent + 16 control latent.
Every other key and shape is the dev model's (asserted: the only difference
from fp.flux_keys(dev) is img_in.weight); out_channels stay 16. The
workflows graphs/tiny_flux_fill.json, tiny_flux_fill_outpaint.json,
tiny_flux_canny.json and tiny_sd1_diffdiff.json are run through ComfyUI's
own node classes on the CPU in f32, and tests/reference/flux_fill/
expected.json gets:
  files: flux_pipeline's entries (folder, name, keys sorted with shapes,
      scaled {}, checksum_f16) for the two DiTs; the companions
      clip/tiny_t5xxl, clip/tiny_clip_l, vae/tiny_flux_ae exactly as
      flux_pipeline writes them (keys and checksum asserted equal to
      tests/reference/flux/expected.json); checkpoints/tiny_sd1.safetensors
      as sd1_pipeline writes it (keys and checksum asserted equal to
      tests/reference/sd1/expected.json).
  workflows: per graph as flux's: latent_shape, latent_f32, image_shape,
      image_f32 (base64 little-endian f32), image_range [min, max, std],
      f32_vs_f64_unet_rel, unet_rounding_rel (sd1_pipeline's spread runs);
      where the graph has a noise mask also denoise_mask_shape /
      denoise_mask_f32 (the sampler's prepared mask, channel 0, before
      DifferentialDiffusion), and where it has DifferentialDiffusion:
      diffdiff_strength, diffdiff_thresholds (per model call, the threshold
      ComfyUI computed, f32 as a number) and without_diffdiff_rel (max
      |latent - latent of the same graph with the node removed| / max |that
      latent|, for the record: the node matters).

Workflows (4 steps each; Flux: euler / simple, cfg 1.0, FluxGuidance 30 on
the positive, ConditioningZeroOut of the same encode as negative):
  tiny_flux_fill: UNETLoader(tiny_flux_fill) -> DifferentialDiffusion(1.0);
      LoadImage inpaint.png -> ImageScale(bilinear) 68x60 ->
      InpaintModelConditioning(mask = LoadImage's alpha mask, noise_mask
      true): pixels and mask center-cropped to 64x56, latent 8 wide x 7
      high (odd: the DiT pads it circularly to 8x8 and crops the output).
  tiny_flux_fill_outpaint: the fill model -> DifferentialDiffusion(0.6);
      LoadImage example.png -> ImageScale 48x48 -> ImagePadForOutpaint(left
      16, bottom 8, feathering 16) -> InpaintModelConditioning(pad's mask,
      noise_mask true) (64x56, latent 8x7; the mask is 1 on the pad and
      ((16 - d) / 16)^2 within 16 pixels of the padded sides, fractional;
      with feathering 8 no prepared-mask cell would reach the last
      threshold, 0.513, and the threshold would not matter).
  tiny_flux_canny: UNETLoader(tiny_flux_canny), no DifferentialDiffusion;
      LoadImage control_a.png -> ImageScale 64x64 -> Canny(0.4, 0.8) ->
      InstructPixToPixConditioning -> KSampler on its (all-zero) latent.
  tiny_sd1_diffdiff: tiny_sd1 -> DifferentialDiffusion(0.5); LoadImage
      example.png -> ImageScale 64x64 -> VAEEncode; mask: ImageScale of the
      same image to 40x48 -> ImagePadForOutpaint(left 8, top 16, right 16,
      feathering 12) (64x64, fractional feathered edge) ->
      SetLatentNoiseMask; KSampler euler / normal, cfg 5, denoise 0.8 (a
      discrete eps model: DifferentialDiffusion's threshold goes through
      ModelSamplingDiscrete.timestep()).

How ComfyUI does it (asserted here where it is observable):
  * Flux.concat_cond (comfy/model_base.py), called once per conditioning by
      extra_conds at the start of sampling (process_conds): num_channels =
      img_in.weight.shape[1] / 4; none if <= out_channels (16). image =
      concat_latent_image (zeros if absent), common_upscale(bilinear,
      "center") to the latent size, process_latent_in ((x - 0.1159) *
      0.3611). If num_channels <= 32 that is c_concat (canny / depth).
      Else (fill) mask = concat_mask if the conditioning has one, else the
      sampler's prepared denoise_mask -- InpaintModelConditioning always
      sets concat_mask, so concat_mask is used; it is the resized, cropped,
      UNROUNDED pixel mask (unlike SD1 inpaint models, Flux does not round
      it); mean over its channel dim, common_upscale(bilinear, "center") to
      8 x the latent size (identity here), folded 8x8 into 64 channels:
      mask channel ph * 8 + pw at latent (y, x) = pixel mask (8y + ph,
      8x + pw). c_concat = [image (16), mask (64)].
  * BaseModel._apply_model: DiT input = cat([x (CONST calculate_input:
      unchanged), c_concat], dim 1) -> [noisy 16, image 16, mask 64] (fill)
      or [noisy 16, control 16] (canny); Flux._forward pads that to even
      size (circular) and patchifies "b c (h 2) (w 2) -> b (h w) (c 2 2)".
  * InstructPixToPixConditioning: pixels cropped to multiples of 8,
      concat_latent_image = vae.encode, the latent is zeros_like it (not
      process_latent_in'd by the sampler: count_nonzero == 0).
  * DifferentialDiffusion (comfy_extras/nodes_differential_diffusion.py)
      sets the model's denoise_mask_function, which KSamplerX0Inpaint calls
      before every model call with the prepared mask: ts_from =
      timestep(sigmas[0]), ts_to = timestep(max(sigma_min, sigmas[-1])),
      threshold = (timestep(sigma) - ts_to) / (ts_from - ts_to) (1 at the
      first call), binary = (mask >= threshold); the mask used is binary if
      strength is 1 (or 0), else strength * binary + (1 - strength) * mask.
      It changes only the KSamplerX0Inpaint blending, not c_concat (built
      once, from concat_mask). With the "normal" scheduler (SD1 graph) the
      last model call is at sigma_min itself, so its threshold is exactly 0
      and every cell is denoised at that call (binary all ones; with
      strength 0.5 the mask-0 cells get 0.5): nothing is kept exactly. With
      Flux's "simple" schedule the last sigma (0.513) is far above
      sigma_min, so mask-0 cells keep the input latent.

ComfyUI only recognises full-size parts. Relaxed as in flux_pipeline.py
(fp.patch_comfy: the tiny Flux widths in detect_unet_config, the tiny
CLIP-L / T5 configs, the ae VAE widths; sd1_pipeline's SD15 / VAE size
checks through it), nothing more: detect_unet_config reads in_channels from
img_in.weight itself (96 -> supported_models.FluxInpaint, 32 -> Flux;
asserted).

    COMFY_DIR=/path/to/ComfyUI python tools/reference/flux_fill.py
(media-only imports are stubbed as in sd1_pipeline.py, but the Canny node
needs the real kornia, as in controlnet_pipeline.py; the base fixtures are
not rewritten. Model folders, fixture checks, workflow runs, spreads and
the per-workflow fields shared with the other Flux fixture scripts are
fixture_runs.py's.)
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import flux_pipeline as fp  # noqa: E402
import fixture_runs as fr  # noqa: E402
import inpaint_pipeline as ip  # noqa: E402

FILL = "tiny_flux_fill.safetensors"
CANNY = "tiny_flux_canny.safetensors"
IN_CHANNELS = {FILL: 96, CANNY: 32}
COMPANIONS = ["tiny_t5xxl.safetensors", "tiny_clip_l.safetensors", "tiny_flux_ae.safetensors"]
WORKFLOWS = ["tiny_flux_fill", "tiny_flux_fill_outpaint", "tiny_flux_canny", "tiny_sd1_diffdiff"]
FLUX_WORKFLOWS = WORKFLOWS[:3]
OUT_CHANNELS = fp.FLUX["out_channels"]


def wide_keys(torch, in_channels):
    """The dev DiT's keys from ComfyUI's Flux class built with
    `in_channels`: only img_in.weight differs from fp.flux_keys(dev)."""
    import comfy.ops
    from comfy.ldm.flux.model import Flux
    m = Flux(image_model="flux", guidance_embed=True, dtype=torch.float32, device="meta",
             operations=comfy.ops.disable_weight_init, **dict(fp.FLUX, in_channels=in_channels))
    keys = [(k, list(t.shape)) for k, t in m.state_dict().items()]
    dev = dict(fp.flux_keys(torch, True))
    got = dict(keys)
    assert set(got) == set(dev), sorted(set(got) ^ set(dev))
    diff = {k: (dev[k], got[k]) for k in got if got[k] != dev[k]}
    h = fp.FLUX["hidden_size"]
    assert diff == {"img_in.weight": ([h, 64], [h, 4 * in_channels])}, diff
    return keys


def v3(cls):
    """A ComfyUI V3 node called as the executor does (class clone, its
    FUNCTION), as flux_pipeline.v3_nodes."""
    class Node:
        FUNCTION = "run"

        def run(self, **kwargs):
            clone = cls.PREPARE_CLASS_CLONE({})
            return getattr(clone, clone.FUNCTION)(**kwargs).result
    return Node


def v3_nodes():
    import comfy_extras.nodes_canny as canny
    import comfy_extras.nodes_differential_diffusion as dd
    import comfy_extras.nodes_ip2p as ip2p
    return {**fp.v3_nodes(), "Canny": v3(canny.Canny),
            "DifferentialDiffusion": v3(dd.DifferentialDiffusion),
            "InstructPixToPixConditioning": v3(ip2p.InstructPixToPixConditioning)}


class Record:
    """Per KSampler call: the latent and noise mask it got, the prepared
    mask, every Flux.concat_cond (inputs, output), every DiT input, every
    DifferentialDiffusion call (sigma, threshold, mask in / out)."""
    def __init__(self, torch):
        import comfy.ldm.flux.model
        import comfy.model_base
        import comfy.sample
        import comfy.sampler_helpers
        import comfy_extras.nodes_differential_diffusion as dd
        self.calls = []
        rec = self
        sample = comfy.sample.sample

        def sample_wrap(*args, **kwargs):
            latent = args[8] if len(args) > 8 else kwargs["latent_image"]
            rec.calls.append({"latent": latent.clone(), "noise_mask": kwargs.get("noise_mask"),
                              "prepared": None, "concat": [], "dit_in": [], "dd": []})
            return sample(*args, **kwargs)
        comfy.sample.sample = sample_wrap
        prepare = comfy.sampler_helpers.prepare_mask

        def prepare_wrap(mask, shape, device):
            out = prepare(mask, shape, device)
            rec.calls[-1]["prepared"] = out.clone()
            return out
        comfy.sampler_helpers.prepare_mask = prepare_wrap
        concat = comfy.model_base.Flux.concat_cond

        def concat_wrap(model, **kwargs):
            out = concat(model, **kwargs)
            rec.calls[-1]["concat"].append({
                "out": None if out is None else out.clone(),
                "concat_latent_image": kwargs.get("concat_latent_image"),
                "concat_mask": kwargs.get("concat_mask"),
                "denoise_mask": kwargs.get("denoise_mask"),
                "process_latent_in": model.process_latent_in})
            return out
        comfy.model_base.Flux.concat_cond = concat_wrap
        fwd = comfy.ldm.flux.model.Flux._forward

        def fwd_wrap(self, x, *args, **kwargs):
            rec.calls[-1]["dit_in"].append(x.clone())
            return fwd(self, x, *args, **kwargs)
        comfy.ldm.flux.model.Flux._forward = fwd_wrap
        dd_forward = dd.DifferentialDiffusion.__dict__["forward"].__func__

        def dd_wrap(cls, sigma, denoise_mask, extra_options, strength):
            out = dd_forward(cls, sigma, denoise_mask, extra_options, strength)
            ms = extra_options["model"].inner_model.model_sampling
            sigmas = extra_options["sigmas"]
            sigma_to = ms.sigma_min
            if sigmas[-1] > sigma_to:
                sigma_to = sigmas[-1]
            ts_from, ts_to = ms.timestep(sigmas[0]), ms.timestep(sigma_to)
            thr = (ms.timestep(sigma[0]) - ts_to) / (ts_from - ts_to)
            rec.calls[-1]["dd"].append({"sigma": float(sigma[0]), "threshold": thr.clone(),
                                        "strength": strength, "mask": denoise_mask.clone(),
                                        "out": out.clone()})
            return out
        dd.DifferentialDiffusion.forward = classmethod(dd_wrap)


def fold_mask(m):
    """Flux fill's mask channels from a [B, 1, 8h, 8w] pixel mask."""
    b, _, H, W = m.shape
    return m.view(b, H // 8, 8, W // 8, 8).permute(0, 2, 4, 1, 3).reshape(b, 64, H // 8, W // 8)


def unet_warnings(log):
    """inpaint_pipeline.LogCapture's warnings about the UNet's weights
    (none expected)."""
    return [w for w in log.warnings() if w.startswith("unet ")]


def check_models(nodes, torch, log):
    import comfy.model_base as mb
    for name, cls in [(FILL, "FluxInpaint"), (CANNY, "Flux")]:
        del log.records[:]
        (m,) = nodes.UNETLoader().load_unet(name, "default")
        assert not unet_warnings(log), log.warnings()
        cfg = m.model.model_config
        got = type(cfg).__name__
        assert (got, m.model.model_type) == (cls, mb.ModelType.FLUX), (name, got)
        assert cfg.unet_config["in_channels"] == IN_CHANNELS[name], cfg.unet_config
        assert cfg.unet_config["out_channels"] == OUT_CHANNELS
        dm = m.model.diffusion_model
        assert dm.img_in.weight.dtype == torch.float32
        assert list(dm.img_in.weight.shape) == [fp.FLUX["hidden_size"], 4 * IN_CHANNELS[name]]
        state = dm.state_dict()
        for k, shape in wide_keys(torch, IN_CHANNELS[name]):
            want = sd1.values(k, shape).astype(np.float16).astype(np.float32)
            assert np.array_equal(state[k].numpy(), want), k
        print("detect", name, got, m.model.model_type.name, "in_channels",
              cfg.unet_config["in_channels"], "img_in", list(dm.img_in.weight.shape),
              "guidance_embed", dm.params.guidance_embed, "weights", dm.img_in.weight.dtype,
              "concat_keys", m.model.concat_keys, "every weight = its f16 value")
    model = nodes.CheckpointLoaderSimple().load_checkpoint(sd1.CKPT)[0]
    assert type(model.model.model_config).__name__ == "SD15"
    print("detect", sd1.CKPT, "SD15", type(model.model.model_sampling).__name__)


def report_canny(node_ns):
    """The Canny edge image the canny graph conditions on (kornia's)."""
    import kornia
    g = fr.load_graph("tiny_flux_canny")
    keep = {"10", "11", "12"}
    g = {k: v for k, v in g.items() if k in keep}
    g["98"] = {"class_type": "SaveImage", "inputs": {"images": ["12", 0]}}
    (edges,), _ = sd1.run_workflow(g, node_ns, __import__("torch"))
    e = edges.numpy()
    assert set(np.unique(e)) <= {0.0, 1.0} and 0.01 < e.mean() < 0.5, float(e.mean())
    print("canny (kornia", kornia.__version__ + "):", list(e.shape), "edge pixels",
          int(e[..., 0].sum()), "of", e[..., 0].size)


def check_call(name, prompt, call, lat, torch):
    """Asserts the docstring's rules on what the sampler did; returns the
    fixture's extra fields."""
    info = {}
    latent = call["latent"]
    is_flux = name in FLUX_WORKFLOWS
    dd_node = [n for n in prompt.values() if n["class_type"] == "DifferentialDiffusion"]
    if call["noise_mask"] is not None:
        import comfy.utils
        prep = call["prepared"]
        assert torch.equal(prep, comfy.utils.reshape_mask(call["noise_mask"], latent.shape)), name
        m0 = prep[:, :1].numpy()
        frac = int(((m0 > 0) & (m0 < 1)).sum())
        info.update(denoise_mask_shape=list(prep[:, :1].shape),
                    denoise_mask_f32=sd1.b64(m0.astype("<f4")))
        print("   noise mask", list(call["noise_mask"].shape), "prepared", list(prep.shape),
              "cells 0 / fractional / 1:", int((m0 == 0).sum()), frac, int((m0 == 1).sum()))
    if dd_node:
        strength = dd_node[0]["inputs"]["strength"]
        assert call["dd"] and call["noise_mask"] is not None, name
        thresholds = []
        for i, d in enumerate(call["dd"]):
            thr = d["threshold"]
            binary = (d["mask"] >= thr).to(d["mask"].dtype)
            want = binary if not (strength and strength < 1) else \
                strength * binary + (1 - strength) * d["mask"]
            assert torch.equal(d["out"], want), (name, i)
            assert torch.equal(d["mask"], call["prepared"]), (name, i)
            thresholds.append(float(thr))
        assert thresholds[0] == 1.0, thresholds
        assert all(a > b for a, b in zip(thresholds, thresholds[1:])) and thresholds[-1] >= 0, thresholds
        assert (thresholds[-1] == 0) == (name == "tiny_sd1_diffdiff"), thresholds
        # The threshold matters: some fractional cell's binary value flips.
        m0 = call["prepared"][:, :1]
        frac = (m0 > 0) & (m0 < 1)
        binaries = torch.stack([(m0 >= d["threshold"]) for d in call["dd"]])
        flips = int((frac & (binaries.any(0) != binaries.all(0))).sum())
        assert flips > 0, (name, "no fractional cell crosses a threshold")
        # No cell sits within f32 noise of a (nonzero) threshold.
        margin = min(float((m0[frac] - d["threshold"]).abs().min()) for d in call["dd"]
                     if float(d["threshold"]) > 0)
        assert margin > 1e-4, (name, margin)
        info.update(diffdiff_strength=strength, diffdiff_thresholds=thresholds)
        print("   DifferentialDiffusion strength", strength, "model calls", len(call["dd"]),
              "sigmas", [round(d["sigma"], 6) for d in call["dd"]], "thresholds", thresholds,
              "mask cells >= threshold per call",
              [int((d["mask"][:, :1] >= d["threshold"]).sum()) for d in call["dd"]],
              "fractional cells that flip", flips, "closest cell to a threshold", margin)
        effective = [d["out"] for d in call["dd"]]
    elif call["noise_mask"] is not None:
        effective = [call["prepared"]]
    else:
        effective = []
    if effective:
        # Cells whose mask is 0 at every model call keep the input latent.
        keep = torch.stack([e == 0 for e in effective]).all(0).numpy()
        n = int(keep.sum())
        ref = latent.double().numpy()
        rel = float(np.abs(lat.astype(np.float64) - ref)[keep].max() / np.abs(ref).max()) if n else 0.0
        assert rel < 1e-4, (name, rel)
        zero = int((call["prepared"] == 0).sum())
        print("   kept latent elements (effective mask 0 at every call):", n, "(prepared mask 0:",
              zero, ") output = input latent there, rel", rel)
    if not is_flux:
        assert not call["concat"] and not call["dit_in"]
        return info
    # Flux: concat_cond once per conditioning (positive, negative), same result.
    assert len(call["concat"]) == 2, len(call["concat"])
    outs = [c["out"] for c in call["concat"]]
    assert all(torch.equal(o, outs[0]) for o in outs), name
    c0 = call["concat"][0]
    out = outs[0]
    noise_shape = latent.shape
    img = c0["process_latent_in"](c0["concat_latent_image"])
    assert list(c0["concat_latent_image"].shape) == list(noise_shape), name  # no resize needed
    if name == "tiny_flux_canny":
        assert c0["concat_mask"] is None and call["noise_mask"] is None
        assert list(out.shape) == [1, OUT_CHANNELS] + list(noise_shape[2:])
        assert torch.equal(out, img), name
        assert torch.count_nonzero(latent) == 0
        print("   c_concat", list(out.shape), "= process_latent_in(concat_latent_image);"
              " sampler latent all zero")
    else:
        cm = c0["concat_mask"]
        assert cm is not None and c0["denoise_mask"] is not None, name
        assert torch.equal(cm, call["noise_mask"]), name  # InpaintModelConditioning: the same mask
        assert list(cm.shape) == [1, 1, 8 * noise_shape[2], 8 * noise_shape[3]], cm.shape
        assert list(out.shape) == [1, OUT_CHANNELS + 64] + list(noise_shape[2:])
        assert torch.equal(out[:, :OUT_CHANNELS], img), name
        assert torch.equal(out[:, OUT_CHANNELS:], fold_mask(cm)), name
        mch = out[:, OUT_CHANNELS:]
        frac = int(((mch > 0) & (mch < 1)).sum())
        assert frac > 0, "Flux keeps the mask unrounded"
        print("   c_concat", list(out.shape), "= [process_latent_in(concat_latent_image) 16,"
              " concat_mask folded 8x8 -> 64 (ch = ph*8 + pw)]; mask from concat_mask (not the"
              " denoise mask); fractional mask values kept:", frac, "of", mch.numel(),
              "min/max", float(mch.min()), float(mch.max()))
    # DiT input: [x, c_concat] per call.
    steps = len(call["dit_in"])
    for x in call["dit_in"]:
        assert list(x.shape[2:]) == list(noise_shape[2:]), x.shape
        assert x.shape[1] == OUT_CHANNELS + out.shape[1], x.shape
        assert torch.equal(x[:, OUT_CHANNELS:], out.to(x.dtype)), name
    print("   DiT input", list(call["dit_in"][0].shape), "x", steps,
          "(odd latent sizes padded circularly inside Flux._forward)"
          if any(s % 2 for s in noise_shape[2:]) else "")
    return info


def without_diffdiff(prompt):
    """The graph with its DifferentialDiffusion node removed (the sampler
    takes the node's model input)."""
    g = json.loads(json.dumps(prompt))
    (nid,) = [k for k, n in g.items() if n["class_type"] == "DifferentialDiffusion"]
    src = g[nid]["inputs"]["model"]
    del g[nid]
    for n in g.values():
        for k, v in n["inputs"].items():
            if isinstance(v, list) and v[0] == nid:
                n["inputs"][k] = list(src)
    return g


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import nodes

    log = ip.LogCapture()
    with fr.comfy_tmp(torch, ["checkpoints", "unet", "clip", "vae"], log) as tmp:
        sd1_ref = fr.fixture("sd1")
        sd1_ref.pop("workflows")
        (dev_ref,) = [x for x in fr.fixture("flux")["files"]
                      if x["name"] == "tiny_flux_dev.safetensors"]

        out = {"files": [], "workflows": {}}

        def entry(folder, name, keys, digest):
            out["files"].append(fr.file_entry(folder, name, keys, digest))
            if not sub:
                print("file", folder, name, "keys", len(keys), "checksum", digest)

        dev = sorted(fp.flux_keys(torch, True))
        for name in (FILL, CANNY):
            keys = sorted(wide_keys(torch, IN_CHANNELS[name]))
            digest, _ = fp.write_file(os.path.join(tmp, "unet", name), keys, None, torch)
            assert [k for k, _ in keys] == [k for k, _ in dev]
            assert str(digest) != dev_ref["checksum_f16"]
            entry("unet", name, keys, digest)
        out["files"] += fr.write_flux_files(tmp, COMPANIONS, torch, verbose=not sub)
        keys = sd1.checkpoint_keys(torch)
        digest = sd1.write_checkpoint(os.path.join(tmp, "checkpoints", sd1.CKPT), keys, torch)
        assert sd1_ref["checkpoint"] == sd1.CKPT
        assert [list(k) for k in keys] == sd1_ref["keys"]
        assert str(digest) == sd1_ref["checksum_f16"]
        entry("checkpoints", sd1.CKPT, keys, digest)
        if not sub:
            print("   companions: keys and checksums = flux/expected.json, sd1/expected.json")

        node_ns = fr.node_classes(nodes, v3_nodes())
        if not sub:
            check_models(nodes, torch, log)
            report_canny(node_ns)
            runs = sd1.spread_runs(__file__)
        rec = Record(torch)
        for name in WORKFLOWS:
            prompt = fr.load_graph(name)
            del rec.calls[:]
            lat, img = fr.run(name, prompt, node_ns, torch, log, unet_warnings)
            if sub:
                out["workflows"][name] = fr.f32_b64(lat)
                continue
            print(name)
            (call,) = rec.calls
            info = check_call(name, prompt, call, lat, torch)
            clipped = fr.check_image(name, img)
            w = fr.spreads(name, lat, runs)
            if "diffdiff_strength" in info:
                del rec.calls[:]
                _, plain = sd1.run_workflow(without_diffdiff(prompt), node_ns, torch)
                assert not rec.calls[0]["dd"]
                w["without_diffdiff_rel"] = fr.rel(lat, plain[0].float().numpy())
                spread = max(w["f32_vs_f64_unet_rel"], w["unet_rounding_rel"])
                assert w["without_diffdiff_rel"] > max(1e-3, 100 * spread), (name, w)
            w.update(info)
            w.update(fr.outputs(lat, img))
            out["workflows"][name] = w
            print("  ", *fr.summary(lat, img, w, clipped),
                  "without DifferentialDiffusion", w.get("without_diffdiff_rel"))
        fr.finish("flux_fill", out, sub)


if __name__ == "__main__":
    main()
