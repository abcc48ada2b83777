"""End-to-end references for inpainting: VAEEncodeForInpaint,
InpaintModelConditioning (with and without its noise mask), SetLatentNoiseMask
on plain SD1 / SDXL models, a noise mask built by mask nodes on a batch of
two, and KSamplerAdvanced with a noise mask.

One extra checkpoint is written: tiny_sd1_inpaint.safetensors, the tiny SD1
checkpoint of sd1_pipeline.py with a 9-channel UNet input
(model.diffusion_model.input_blocks.0.0.weight [32, 9, 3, 3] instead of
[32, 4, 3, 3]; every key, shape from ComfyUI's UNetModel with in_channels 9,
values `values(key, shape)` of sd1_pipeline, stored f16, no scaled tensors).
ComfyUI detects it as SD15 with unet_config in_channels 9, an inpaint model
(supported_models_base.BASE.inpaint_model: in_channels > 4), so
BaseModel.set_inpaint gives it concat_keys ("mask", "masked_image")
(asserted). The bases tiny_sd1 / tiny_sdxl are those of the sd1 and families
fixtures (checksums asserted).

The input image graphs/input/inpaint.png (64x64 RGBA, 8 bits, written by
this script; `input_image`): R = 4x + 2, G = 4y + 2, B = 60 or 180 on an
8-pixel checkerboard plus 4 ((x y) mod 7); alpha = clip(round(48 (d - 10)),
0, 255) with d the distance of (x, y) from (38, 25) (a transparent disc of
radius 10 with a soft edge ~5 pixels wide), and alpha 0 on x 0..5, y 48..55
(a hard-edged hole on the left border). Transparent pixels keep their RGB
(PNG is not premultiplied and ComfyUI's LoadImage drops alpha with
convert("RGB")). LoadImage's MASK is 1 - alpha / 255 (f32: alpha as f32
divided by 255.0, then 1.0 minus it), 1 = inpaint, shape [1, 64, 64].

Workflows (graphs/NAME.json; all CLIPTextEncode positive / negative, VAEDecode,
SaveImage NAME, SaveLatent latents/NAME; CPU, f32):
  tiny_sd1_inpaint: tiny_sd1_inpaint; VAEEncodeForInpaint (grow_mask_by 6)
      of the 64x64 image with its alpha mask; KSampler euler / normal,
      4 steps, cfg 6, denoise 1.0. The 9-channel model gets c_concat =
      [round(denoise mask), the sampler's (scaled) latent] (no
      concat_latent_image / concat_mask in the conditioning).
  tiny_sd1_inpaint_crop: plain tiny_sd1; ImageScale (bilinear) to 70x66,
      VAEEncodeForInpaint (grow_mask_by 5): the 64x64 alpha mask is resized
      to 66x70, image and mask are center-cropped to 64x64 (offsets 1 and 3);
      KSampler heun / normal, 3 steps, cfg 5, denoise 1.0.
  tiny_sd1_inpaint_cond: tiny_sd1_inpaint; ImageScale (bilinear) to 68x60,
      InpaintModelConditioning (noise_mask true): latent 7x8 from the
      center-cropped 56x64 original, concat_latent_image from the blanked
      copy, concat_mask and noise mask the resized, cropped, unrounded
      56x64 mask; KSampler euler / normal, 4 steps, cfg 6.5, denoise 1.0.
  tiny_sd1_inpaint_cond_nomask: tiny_sd1_inpaint; InpaintModelConditioning
      of the 64x64 image with noise_mask false (no noise mask on the latent;
      the conditioning still carries concat_latent_image / concat_mask);
      KSampler euler_ancestral / karras, 4 steps, denoise 1.0.
  tiny_sd1_inpaint_noise_mask: plain tiny_sd1; VAEEncode of the image,
      SetLatentNoiseMask with LoadImage's alpha mask (soft, unrounded);
      KSampler euler / karras, 5 steps, cfg 5, denoise 0.7.
  tiny_sd1_inpaint_mask_nodes: plain tiny_sd1; ImageBatch(image,
      ImageInvert(image)) -> VAEEncode (a batch of 2); noise mask
      InvertMask(ImageToMask(image, red)) = 1 - (4x + 2) / 255 (fractional
      everywhere, one mask for both latents); KSampler euler_ancestral /
      normal, 5 steps, cfg 6, denoise 0.8 (the ancestral noise is added to
      the whole latent each step, the next model call re-blends it).
  tiny_sdxl_inpaint: tiny_sdxl; ImageScale (bilinear) to 72x56, VAEEncode
      (latent 7x9), SetLatentNoiseMask with the 64x64 alpha mask (resized to
      7x9 by the sampler, aspect not kept); KSampler euler / normal, 5 steps,
      cfg 6, denoise 0.6.
  tiny_sd1_inpaint_advanced: plain tiny_sd1; VAEEncode, SetLatentNoiseMask
      (alpha mask); KSamplerAdvanced add_noise enable, dpmpp_2m / normal,
      6 steps, start_at_step 1, end_at_step 10000,
      return_with_leftover_noise disable.

tests/reference/inpaint/expected.json:
  base: the fixtures of the base checkpoints (sd1, sdxl);
  files: [{folder, name, base, keys, scaled, checksum_f16}] (the inpaint
      checkpoint, keys sorted; checksum as sd1_pipeline.checksum);
  inputs: [{name, shape, sha256}] (the PNG under graphs/input);
  workflows: {NAME: {f32_vs_f64_unet_rel, unet_rounding_rel (the spreads
      the SD1 script measures), latent_shape, latent_f32, image_shape,
      image_f32 (base64 little-endian f32: SaveLatent's latent and
      SaveImage's image), sampler_latent_shape / sampler_latent_f32 (the
      latent the sampler node received, before process_latent_in),
      denoise_mask_shape / denoise_mask_f32 (the sampler's mask after
      prepare_mask, channel 0; the 4 channels are equal) where there is a
      noise mask, noise_mask_effect_rel (the latent vs the same run with the
      noise mask dropped), kept_cells / kept_region_rel (latent cells whose
      prepared mask is 0 and the max |output - input| there, relative),
      c_concat_shape / c_concat_f32 for the 9-channel model (what
      concat_cond returned for the positive; the negative's is the same)}}.

How ComfyUI does it (nodes.py, comfy/samplers.py, comfy/model_base.py):
  VAEEncodeForInpaint.encode: H, W floored to multiples of 8 (the VAE's
      downscale ratio); the mask reshaped to [B, 1, h, w] and resized with
      F.interpolate(bilinear, align_corners False, no antialias) to the
      image's H x W (identity when equal); image and mask center-cropped
      (offset (H mod 8) // 2, (W mod 8) // 2); the grown mask is
      clamp(conv2d(round(mask), ones(g, g), padding=ceil((g - 1) / 2)), 0, 1)
      cropped to [:H, :W] (for even g one row / column longer, so the window
      of output (i, j) is rows i - p .. i + g - 1 - p), then rounded; the
      pixels with round(mask) = 1 become 0.5 ((p - 0.5) * (1 - round(m)) +
      0.5 per channel, f32); latent = vae.encode(those pixels); noise_mask =
      the grown mask at pixel resolution [B, 1, H, W]. round() is
      half-to-even (torch.round).
  InpaintModelConditioning.encode: the same resize, crop and blanking
      (round(mask)) but no growing; concat_latent = encode(blanked);
      samples = encode(original pixels) (vae.encode crops those itself,
      VAE.vae_encode_crop_pixels, same offsets); noise_mask (if enabled) and
      concat_mask = the resized, cropped, UNROUNDED mask [B, 1, H, W]; both
      conditionings get concat_latent_image and concat_mask.
  SetLatentNoiseMask: noise_mask = mask.reshape(-1, 1, h, w), nothing else.
  Sampling with a noise mask (CFGGuider.outer_sample -> prepare_mask =
      comfy.utils.reshape_mask): F.interpolate(bilinear, align_corners
      False) of the [B', 1, h, w] mask straight to the latent's H x W (no
      crop, aspect not kept), repeated to 4 channels and to the batch
      (repeat_to_batch_size: tiled, then cut). KSAMPLER.sample: x =
      noise_scaling(sigmas[0], noise, latent) (noise * sqrt(1 + sigma^2) +
      latent when sigmas[0] is sigma_max, else noise * sigma + latent; latent
      already process_latent_in'd, i.e. times 0.18215 / 0.13025, when not all
      zero). Each model call goes through KSamplerX0Inpaint: x' = x * m +
      (noise * sigma + latent) * (1 - m) (noise: the sampler's initial
      noise, unscaled; sigma: the current sigma), denoised = model(x') * m +
      latent * (1 - m). So where m = 0 the result is the input latent
      (after the last step to sigma 0), exactly up to the sampler's own
      rounding.
  The 9-channel model (BaseModel.concat_cond, via extra_conds ->
      CONDNoiseShape c_concat; BaseModel._apply_model concatenates it on
      dim 1 after x's input scaling calculate_input, x / sqrt(sigma^2 + 1),
      c_concat itself unscaled; the same for cond and uncond): mask =
      concat_mask if the conditioning has one, else the sampler's prepared
      denoise mask (its channel 0); reshaped [-1, 1, h, w], resized with
      common_upscale(bilinear, "center" crop) to the latent size if it
      differs, ROUNDED, resized to the batch; masked_image =
      process_latent_in(concat_latent_image) if given (else the sampler's
      process_latent_in'd latent), resized likewise; c_concat = [mask (1 ch),
      masked_image (4 ch)]. Without any mask: ones and the "blank" latent
      (0.8223, -0.6876, 0.6364, 0.1380) (BaseModel.set_inpaint).

Checks (asserted): the checkpoint detection above; VAEEncodeForInpaint on the
64x64 image equals the formula above computed here in numpy (grown mask
exactly, latent = vae.encode of the numpy-blanked pixels exactly); the
prepared masks are what reshape_mask gives; c_concat's mask channel is 0/1
and its latent channels are exactly 0.18215 x the expected latent; wherever
the prepared mask is 0 the output latent is the input latent (relative
1e-4); each noise mask changes the latent clearly (noise_mask_effect_rel >
0.05); no unet missing / unexpected keys.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/inpaint_pipeline.py
(media-only imports are stubbed as in sd1_pipeline.py; the base fixtures
are not rewritten; graphs/input/inpaint.png is (re)written.)
"""
import base64
import hashlib
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

ROOT = sd1.ROOT
COMFY = sd1.COMFY
CKPT = "tiny_sd1_inpaint.safetensors"
IMAGE = "inpaint.png"
WORKFLOWS = ["tiny_sd1_inpaint", "tiny_sd1_inpaint_crop", "tiny_sd1_inpaint_cond",
             "tiny_sd1_inpaint_cond_nomask", "tiny_sd1_inpaint_noise_mask",
             "tiny_sd1_inpaint_mask_nodes", "tiny_sdxl_inpaint", "tiny_sd1_inpaint_advanced"]
INPUT_W = "model.diffusion_model.input_blocks.0.0.weight"
SD1_SCALE = 0.18215


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelno, record.getMessage()))

    def warnings(self):
        return [m for lvl, m in self.records if lvl >= logging.WARNING]


class Record:
    """What the sampler saw, per KSampler call: the latent and noise mask it
    was given, the prepared mask, and every concat_cond result with its
    inputs. `drop_mask` runs the samplers without their noise mask."""
    def __init__(self, torch):
        import comfy.model_base
        import comfy.sample
        import comfy.sampler_helpers
        self.calls, self.drop_mask = [], False
        rec = self
        sample = comfy.sample.sample

        def sample_wrap(*args, **kwargs):
            if rec.drop_mask:
                kwargs["noise_mask"] = None
            latent = args[8] if len(args) > 8 else kwargs["latent_image"]
            rec.calls.append({"latent": latent.clone(), "noise_mask": kwargs.get("noise_mask"),
                              "prepared": None, "concat": []})
            return sample(*args, **kwargs)
        comfy.sample.sample = sample_wrap
        prepare = comfy.sampler_helpers.prepare_mask

        def prepare_wrap(mask, shape, device):
            out = prepare(mask, shape, device)
            rec.calls[-1]["prepared"] = out.clone()
            return out
        comfy.sampler_helpers.prepare_mask = prepare_wrap
        concat = comfy.model_base.BaseModel.concat_cond

        def concat_wrap(model, **kwargs):
            out = concat(model, **kwargs)
            if out is not None:
                rec.calls[-1]["concat"].append({
                    "out": out.clone(),
                    "concat_latent_image": kwargs.get("concat_latent_image"),
                    "concat_mask": kwargs.get("concat_mask"),
                    "latent_image": kwargs.get("latent_image")})
            return out
        comfy.model_base.BaseModel.concat_cond = concat_wrap


def input_image():
    """graphs/input/inpaint.png's pixels, [64, 64, 4] uint8 (docstring)."""
    y, x = np.mgrid[0:64, 0:64]
    r = x * 4 + 2
    g = y * 4 + 2
    b = np.where((x // 8 + y // 8) % 2 == 0, 60, 180) + (x * y % 7) * 4
    d = np.sqrt((x - 38.0) ** 2 + (y - 25.0) ** 2)
    a = np.clip(np.round((d - 10.0) * 48.0), 0, 255)
    a[48:56, 0:6] = 0
    return np.stack([r, g, b, a], -1).astype(np.uint8)


def write_input(path):
    from PIL import Image
    px = input_image()
    Image.fromarray(px, "RGBA").save(path, format="PNG")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    # Read back as LoadImage will.
    back = np.array(Image.open(path))
    assert back.shape == (64, 64, 4) and np.array_equal(back, px)
    return {"name": IMAGE, "shape": list(px.shape), "sha256": digest}


def inpaint_keys(torch):
    """tiny_sd1's keys from ComfyUI's UNetModel built with in_channels 9:
    exactly one shape differs."""
    base = sd1.checkpoint_keys(torch)
    saved = sd1.UNET
    try:
        sd1.UNET = dict(saved, in_channels=9)
        keys = sd1.checkpoint_keys(torch)
    finally:
        sd1.UNET = saved
    diff = [(a, b) for a, b in zip(base, keys) if a != b]
    assert len(base) == len(keys) and diff == [((INPUT_W, [32, 4, 3, 3]), (INPUT_W, [32, 9, 3, 3]))], diff
    return keys


def check_detection(nodes, log):
    import comfy.model_base
    del log.records[:]
    plain = nodes.CheckpointLoaderSimple().load_checkpoint(sd1.CKPT)[0]
    plain_warnings = log.warnings()
    del log.records[:]
    model = nodes.CheckpointLoaderSimple().load_checkpoint(CKPT)[0]
    warnings = log.warnings()
    assert not [w for w in warnings if w.startswith("unet ")], warnings
    assert warnings == plain_warnings, (warnings, plain_warnings)
    cfg = model.model.model_config
    assert type(cfg).__name__ == "SD15" and cfg.unet_config["in_channels"] == 9, cfg.unet_config
    assert cfg.inpaint_model() and not plain.model.model_config.inpaint_model()
    assert model.model.concat_keys == ("mask", "masked_image"), model.model.concat_keys
    assert plain.model.concat_keys == ()
    assert model.model.model_type == comfy.model_base.ModelType.EPS
    w = model.model.diffusion_model.input_blocks[0][0].weight
    assert list(w.shape) == [32, 9, 3, 3]
    want = sd1.values(INPUT_W, [32, 9, 3, 3]).astype(np.float16).astype(np.float32)
    assert np.array_equal(w.float().numpy(), want)
    print("detect", CKPT, type(cfg).__name__, "in_channels", cfg.unet_config["in_channels"],
          "concat_keys", model.model.concat_keys, model.model.model_type.name,
          "load warnings as tiny_sd1's:", warnings)


def check_encode_for_inpaint(nodes, torch):
    """VAEEncodeForInpaint on the 64x64 image against the docstring's
    formula in numpy (grown mask, blanked pixels)."""
    image, mask = nodes.LoadImage().load_image(IMAGE)
    px = input_image()
    assert np.array_equal(image.numpy()[0], px[..., :3].astype(np.float32) / np.float32(255))
    m = np.float32(1) - px[..., 3].astype(np.float32) / np.float32(255)
    assert np.array_equal(mask.numpy()[0], m)
    vae = nodes.CheckpointLoaderSimple().load_checkpoint(CKPT)[2]
    g = 6
    (out,) = nodes.VAEEncodeForInpaint().encode(vae, image, mask, g)
    mr = np.round(m)
    p = -(-(g - 1) // 2)
    padded = np.pad(mr, p)
    grown = np.zeros((64, 64), np.float32)
    for i in range(64):
        for j in range(64):
            grown[i, j] = min(1.0, padded[i:i + g, j:j + g].sum())
    assert np.array_equal(out["noise_mask"].numpy(), grown[None, None]), "grown mask"
    blank = (image.numpy()[0] - np.float32(0.5)) * (np.float32(1) - mr)[..., None] + np.float32(0.5)
    t = vae.encode(torch.from_numpy(blank[None].astype(np.float32)))
    assert torch.equal(t, out["samples"]), float((t - out["samples"]).abs().max())
    print("VAEEncodeForInpaint grow", g, "mask pixels", int(mr.sum()), "grown", int(grown.sum()),
          "blanked pixels equal the formula; latent", list(t.shape))


def check_call(name, call, lat, torch):
    """Prepared mask = reshape_mask; kept region; c_concat layout."""
    import comfy.utils
    info = {}
    latent = call["latent"]
    if call["noise_mask"] is not None:
        prep = call["prepared"]
        want = comfy.utils.reshape_mask(call["noise_mask"], latent.shape)
        assert torch.equal(prep, want), name
        assert all(torch.equal(prep[:, c], prep[:, 0]) for c in range(prep.shape[1]))
        keep = (prep == 0).numpy()
        got = lat.astype(np.float64)
        ref = latent.double().numpy()
        n = int(keep.sum())
        rel = float(np.abs(got - ref)[keep].max() / np.abs(ref).max()) if n else 0.0
        assert rel < 1e-4, (name, rel)
        info.update(kept_cells=n, kept_region_rel=rel,
                    denoise_mask_shape=list(prep[:, :1].shape),
                    denoise_mask_f32=sd1.b64(prep[:, :1].numpy().astype("<f4")))
    if call["concat"]:
        outs = [c["out"] for c in call["concat"]]
        assert all(torch.equal(o, outs[0]) for o in outs), name
        c0 = call["concat"][0]
        out = outs[0]
        assert out.shape[1] == 5 and out.shape[0] == latent.shape[0]
        assert out.shape[2:] == latent.shape[2:]
        mch = out[:, :1]
        assert torch.equal(mch, mch.round()) and float(mch.min()) >= 0 and float(mch.max()) <= 1
        if c0["concat_latent_image"] is None:
            # VAEEncodeForInpaint: the sampler's mask and latent.
            assert torch.equal(mch, call["prepared"][:, :1].round()), name
            assert torch.equal(out[:, 1:], latent * SD1_SCALE), name
        else:
            assert torch.equal(out[:, 1:], c0["concat_latent_image"] * SD1_SCALE), name
            cm = c0["concat_mask"]
            want = comfy.utils.common_upscale(cm.reshape((-1, 1) + tuple(cm.shape[-2:])),
                                              latent.shape[-1], latent.shape[-2],
                                              "bilinear", "center").round()
            assert torch.equal(mch, want), name
        info.update(c_concat_shape=list(out.shape),
                    c_concat_f32=sd1.b64(out.numpy().astype("<f4")))
        print("   c_concat", list(out.shape), "mask cells", int(mch.sum()),
              "from", "concat_mask" if c0["concat_mask"] is not None else "denoise mask")
    return info


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import folder_paths
    import nodes
    import comfy_extras.nodes_mask as masks

    log = LogCapture()
    logging.getLogger().addHandler(log)
    tmp = tempfile.mkdtemp()
    try:
        fam.patch_comfy(tmp, torch)
        ckpt_dir = os.path.join(tmp, "checkpoints")
        fam.write_base_checkpoints(ckpt_dir, torch)
        keys = inpaint_keys(torch)
        digest = fam.write_file(os.path.join(ckpt_dir, CKPT), keys, {}, torch)
        folder_paths.add_model_folder_path("checkpoints", ckpt_dir, is_default=True)
        input_dir = os.path.join(ROOT, "graphs", "input")
        folder_paths.set_input_directory(input_dir)
        png = os.path.join(input_dir, IMAGE)
        if not sub:
            inp = write_input(png)
        out = {"base": {"sd1": "sd1/expected.json", "sdxl": "families/expected.json"},
               "files": [{"folder": "checkpoints", "name": CKPT, "base": "sd1", "keys": keys,
                          "scaled": {}, "checksum_f16": str(digest)}],
               "inputs": [] if sub else [inp], "workflows": {}}
        node_ns = types.SimpleNamespace(
            NODE_CLASS_MAPPINGS={**nodes.NODE_CLASS_MAPPINGS, **masks.NODE_CLASS_MAPPINGS})

        if not sub:
            print("file", CKPT, "keys", len(keys), "checksum", digest, "input", inp)
            check_detection(nodes, log)
            check_encode_for_inpaint(nodes, torch)

            f64_latents, perturbed_latents = sd1.spread_runs(__file__)

        rec = Record(torch)
        for name in WORKFLOWS:
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            del rec.calls[:]
            del log.records[:]
            saved, latents = sd1.run_workflow(prompt, node_ns, torch)
            assert not [w for w in log.warnings() if w.startswith("unet ")], log.warnings()
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            assert np.isfinite(lat).all() and np.isfinite(img).all(), name
            if sub:
                out["workflows"][name] = sd1.b64(lat.astype("<f4"))
                continue
            (call,) = rec.calls
            has_mask = call["noise_mask"] is not None
            assert has_mask == (name != "tiny_sd1_inpaint_cond_nomask"), name
            assert bool(call["concat"]) == ("_inpaint_crop" not in name and
                                            prompt["1"]["inputs"]["ckpt_name"] == CKPT), name
            print(name)
            info = check_call(name, call, lat, torch)

            def spread_to(latents):
                other = np.frombuffer(base64.b64decode(latents[name]), "<f4")
                return float(np.abs(lat.reshape(-1) - other).max() / np.abs(other).max())
            w = {"f32_vs_f64_unet_rel": spread_to(f64_latents),
                 "unet_rounding_rel": spread_to(perturbed_latents)}
            if has_mask:
                rec.drop_mask = True
                try:
                    _, plain = sd1.run_workflow(prompt, node_ns, torch)
                finally:
                    rec.drop_mask = False
                plain = plain[0].float().numpy()
                effect = float(np.abs(lat - plain).max() / np.abs(plain).max())
                assert effect > 0.05, (name, effect)
                w["noise_mask_effect_rel"] = effect
            w.update(info)
            w.update({
                "sampler_latent_shape": list(call["latent"].shape),
                "sampler_latent_f32": sd1.b64(call["latent"].numpy().astype("<f4")),
                "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
                "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4")),
            })
            out["workflows"][name] = w
            print("   latent", lat.shape, "abs mean", float(np.abs(lat).mean()),
                  "std", float(lat.std()), "image", img.shape, "mean", float(img.mean()),
                  "f32 vs f64 UNet", w["f32_vs_f64_unet_rel"],
                  "UNet rounding", w["unet_rounding_rel"],
                  "mask effect", w.get("noise_mask_effect_rel"),
                  "kept cells", w.get("kept_cells"), "kept rel", w.get("kept_region_rel"))
        if sub:
            print(json.dumps(out["workflows"]))
            return
        sd1.write_expected("inpaint", out)
    finally:
        logging.getLogger().removeHandler(log)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
