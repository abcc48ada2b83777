"""References for TAESD (the tiny autoencoder): VAELoader's "taesd" /
"taesdxl", VAEDecode / VAEEncode through it, and the sampler previews
ComfyUI makes with it (and with its Latent2RGB fallback).

Four vae_approx files are built in the layout of the released
madebyollin/taesd files (a bare nn.Sequential state dict: `0.weight`,
`1.conv.0.weight`, ...), every key name and shape taken from ComfyUI's own
comfy.taesd.taesd.Encoder / Decoder (latent_channels 4; ComfyUI hard-codes
the width 64, so these are full-size TAESDs, ~1.2M parameters each), every
value from sd1_pipeline's `values(key, shape)` formula of the key as
spelled in the file, times a per-file factor (below), stored f16. ComfyUI
loads them with its own nodes.VAELoader (load_taesd adds the
`taesd_encoder.` / `taesd_decoder.` prefixes and the vae_scale /
vae_shift tensors; comfy.sd.VAE builds comfy.taesd.taesd.TAESD from
them) and latent_preview.get_previewer (the decoder file alone), and the
workflows in graphs/tiny_sd1_taesd.json and graphs/tiny_sdxl_taesd.json
are run through ComfyUI's own node classes on the CPU in f32.
tests/reference/taesd/expected.json gets:
  "base": the fixtures the base checkpoints come from.
  "files": per file written here: folder ("vae_approx"), name, kind
      (taesd_encoder / taesd_decoder), base (null), sorted [key, shape]
      list, "scaled" (key -> factor applied in f32 before the f16 cast),
      checksum_f16 (sd1_pipeline.checksum over the file's tensors in
      sorted key order, as for the checkpoints). Rust writes them with
      tests/support's write_fixture_files from these lists.
  "models": per VAELoader name ("taesd", "taesdxl") {encoder, decoder
      (file names), vae_scale, vae_shift (what load_taesd adds), decode,
      encode}: one direct check each through the loaded comfy.sd.VAE,
      batch 1, the networks' own inputs and outputs recorded by forward
      hooks:
      decode: latent_shape / latent_f32 ([1, 4, 4, 6], 16 u with u in
          [-1, 1) from the weight formula of "taesd_check.latent": a raw
          latent as a LATENT holds it, so the decoder's Clamp works in
          its curved part), decoder_in_f32
          ((latent - vae_shift) * vae_scale, what taesd_decoder got),
          decoder_out_shape / decoder_out_f32 ([1, 3, 32, 48]: the
          network's output, not clamped), image_shape / image_f32 (what
          VAE.decode returns: [1, 32, 48, 3], (out - 0.5) * 2 then
          clamp((x + 1) / 2, 0, 1)).
      encode: image_shape / image_f32 ([1, 32, 48, 3], 8-bit levels from
          "taesd_check.image", / 255 in f32 as LoadImage makes them),
          encoder_in_f32 ([1, 3, 32, 48]: (image * 2 - 1) * 0.5 + 0.5 in
          f32, what taesd_encoder got; encoder_in_differs counts the
          values that rounding moved off the image's), encoder_out_shape
          / encoder_out_f32 ([1, 4, 4, 6]), latent_shape / latent_f32
          (what VAE.encode returns: out / vae_scale + vae_shift).
  "workflows": per graph the image SaveImage gets (the VAEDecode of the
      KSampler output through TAESD) and the latent SaveLatent gets (the
      VAEEncode of example.png through TAESD), f32, in sd1_pipeline's
      layout, so tests/support's check_graph reads it. No UNet is on the
      SaveLatent's path here, so its two spread fields carry the TAESD
      encoder's own f32 spread (also under their own names):
      "f32_vs_f64_unet_rel" = "f32_vs_f64_taesd_rel" (the graph with the
      TAESD VAE in float64), "unet_rounding_rel" = "taesd_rounding_rel"
      (every TAESD conv output times (1 + 2^-23 z), z standard normal from
      one seeded generator). Also: sampled_latent_shape /
      sampled_latent_f32 (the KSampler output the VAEDecode got: the
      sampling part of each graph is the txt2img graph's, so this is
      the base fixture's txt2img latent up to float32 rounding;
      sampled_vs_base_rel, asserted below 10x that fixture's spreads),
      image_in_range (the fraction of decoded values strictly inside
      (0, 1)).
  "previews": per sampling graph (graphs/tiny_sd1_txt2img.json and
      graphs/tiny_sdxl_txt2img.json, unchanged) the previews ComfyUI's
      KSampler callback makes with `--preview-method taesd` and with
      `--preview-method latent2rgb` (what `auto` picks in this ComfyUI):
      {node, steps, preview_size (args.preview_size, 512),
      pillow_version (the resize below is Pillow's), x0 (per step
      {step, shape, f32}: the first batch item of the callback's x0, the
      model-space denoised latent, what both previewers read), taesd,
      latent2rgb}. taesd: {decoder (the file get_previewer picked),
      frames}; latent2rgb: {factors ([channels][3]), bias (null for SD1),
      frames}. Each frame: {step (the callback's step + 1, as the progress
      bar gets it), total, width, height, u8 (the PIL RGB image
      decode_latent_to_preview returns, row-major H x W x 3), f32 (the
      [H, W, 3] tensor preview_to_image got; latent2rgb only: the TAESD
      one is the decoder's output on x0[:1], (out - 0.5) * 2, as "models"
      checks the decoder), preview_width, preview_height, preview_sha256
      (sha256 of the RGB bytes of ImageOps.contain(image, (512, 512),
      BILINEAR), the resize server.send_image / send_image_with_metadata
      make before the JPEG (quality 95), which is not recorded)}; the
      last frame also has preview_rows {rows ([0, 1, 3, 4, 255, 256,
      511]), u8}: those rows of the resized image, in full.

TAESD as ComfyUI runs it (comfy/taesd/taesd.py): every conv 3x3, zero
padding 1, stride 1 unless said; Block(x) = relu(c4(relu(c2(relu(c0(x)))))
+ x) (c0/c2/c4 = N.conv.0/2/4, all with bias; the skip is the identity).
  Encoder(x): conv 0, Block 1, then three times [stride-2 conv (2, 6,
      10), three Blocks], conv 14; no activation at the end.
  Decoder(z): tanh(z / 3) * 3, conv 1, relu, Blocks 3-5, nearest 2x
      upsample, conv 7, Blocks 8-10, 2x, conv 12, Blocks 13-15, 2x, conv
      17, Block 18, conv 19; no activation at the end.
  VAE.decode(latent): decoder((latent - vae_shift) * vae_scale), then
      (out - 0.5) * 2, then comfy.sd's process_output clamp((x + 1) / 2,
      0, 1), NHWC. VAE.encode(image): crop to multiples of 8 (centred),
      process_input image * 2 - 1, then encoder(x * 0.5 + 0.5) / vae_scale
      + vae_shift. vae_scale / vae_shift are f32 0-dim tensors (0.18215 /
      0 for taesd, 0.13025 / 0 for taesdxl); the previewer's TAESD has 1 /
      0 (x0 is already in model space).

Files (all tensors f16; values `values(key, shape)` times a factor,
recorded under "scaled": the file's factor on every `.weight` (conv
weights; biases unscaled), except the decoder's last conv: `19.weight`
gets -0.2 times the file's factor and `19.bias` its own factor, so the
decoded images of sampled latents sit mostly inside (0, 1) in all three
channels. The factors keep the activations of a random-weight TAESD from
dying out over its 14 conv layers (1.0 shrinks them ~3x per stage) and
make the SD and SDXL pairs different networks (the names alone would
give both the same values):
  vae_approx/taesd_encoder.safetensors, taesd_decoder.safetensors:
      factor 1.6 (19.weight -0.32, 19.bias -8).
  vae_approx/taesdxl_encoder.safetensors, taesdxl_decoder.safetensors:
      factor 1.7 (19.weight -0.34, 19.bias -10).
  Encoder keys: 0 (conv 3->64, bias), 1, 3-5, 7-9, 11-13 (Blocks:
      N.conv.{0,2,4}.weight/bias, 3x3 64->64, no skip weights: n_in ==
      n_out), 2, 6, 10 (3x3 stride-2 convs, no bias), 14 (conv
      64->latent_channels, bias).
  Decoder keys: 1 (conv latent_channels->64, bias; ComfyUI reads
      latent_channels from 1.weight's shape[1]), 3-5, 8-10, 13-15, 18
      (Blocks), 7, 12, 17 (3x3 convs after each 2x upsample, no bias), 19
      (conv 64->3, bias); 0 (Clamp), 2 (ReLU), 6, 11, 16 (Upsample) have
      no weights.

Workflows (the sampling nodes exactly as the txt2img graphs'):
  tiny_sd1_taesd: tiny_sd1_txt2img's KSampler (64x64, batch 2) ->
      VAEDecode with VAELoader "taesd" -> SaveImage; LoadImage example.png
      (64x48, RGBA: RGB kept) -> VAEEncode with the same VAE -> SaveLatent
      ([1, 4, 6, 8]).
  tiny_sdxl_taesd: tiny_sdxl_txt2img's KSampler (batch 1) -> VAEDecode
      with "taesdxl" -> SaveImage; LoadImage example.png -> ImageScale
      (bilinear, 68x60, no crop) -> VAEEncode (VAE.encode crops to 64x56,
      offsets 2, 2) -> SaveLatent ([1, 4, 7, 8]: odd latent height).

ComfyUI only recognises full-size models. Relaxed here, nothing else:
  families_pipeline.patch_comfy as it is (tiny CLIP/VAE configs, the
  SD15/SDXL matches) for the base checkpoints. The TAESD path needs no
  patch.

Checks (asserted): the base checkpoints match their fixtures' checksums;
VAELoader lists "taesd" and "taesdxl"; each loaded VAE is a TAESD with 4
latent channels, every tensor the file's f16 value (scaled), vae_scale /
vae_shift as load_taesd sets them, no missing / leftover key messages;
get_previewer gives a TAESDPreviewerImpl (taesd) on the decoder file with
vae_scale 1 and vae_shift 0, and a Latent2RGBPreviewer (latent2rgb); one
frame per step from each; both runs see the same x0; each graph's KSampler
output is its base fixture's txt2img latent (within 10x that fixture's
f32 spread); decoded images are not mostly clamped; and the semantics
stated here, recomputed outside ComfyUI's modules: the architecture
(torch.nn.functional from the file's tensors: decoder and encoder outputs
bit-equal), (latent - shift) * scale into the decoder, clamp(((out - 0.5)
* 2 + 1) / 2, 0, 1) out of VAE.decode, (image * 2 - 1) * 0.5 + 0.5 into
the encoder, out / scale + shift out of VAE.encode (all bit-equal), the
TAESD preview as the decoder's output at scale 1 on x0[:1], (out - 0.5) *
2, HWC, ((x + 1) / 2).clamp(0, 1) * 255 truncated to uint8 (bit-equal),
and the Latent2RGB preview as x0[0] (HWC) @ factors (+ bias) (within
1e-5) truncated the same way (bit-equal).

The Latent2RGB previews of the tiny models' x0 (|x0| up to ~50) are
mostly 0 or 255; the TAESD ones are mostly inside (0, 255).

    COMFY_DIR=/path/to/ComfyUI python tools/reference/taesd_pipeline.py
(media-only imports are stubbed as in sd1_pipeline.py; the base fixtures
are not rewritten.)
"""
import base64
import hashlib
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

ROOT = sd1.ROOT
COMFY = sd1.COMFY
WORKFLOWS = {"tiny_sd1_taesd": ("tiny_sd1_txt2img", "sd1"),
             "tiny_sdxl_taesd": ("tiny_sdxl_txt2img", "families")}
PREVIEW_GRAPHS = ["tiny_sd1_txt2img", "tiny_sdxl_txt2img"]
PROBLEMS = ("Missing VAE keys", "Leftover VAE keys", "could not find", "ERROR")

# VAELoader name -> per-file weight factor, the decoder's last conv factor,
# and the vae_scale / vae_shift nodes.VAELoader.load_taesd adds.
PAIRS = {
    "taesd": {"factor": 1.6, "last": -0.32, "last_bias": -8.0,
              "vae_scale": 0.18215, "vae_shift": 0.0},
    "taesdxl": {"factor": 1.7, "last": -0.34, "last_bias": -10.0,
                "vae_scale": 0.13025, "vae_shift": 0.0},
}
LAST_CONV = "19.weight"
LAST_BIAS = "19.bias"
LATENT_CHANNELS = 4
CHECK_LATENT = [1, LATENT_CHANNELS, 4, 6]
CHECK_IMAGE = [1, 32, 48, 3]
PREVIEW_ROWS = [0, 1, 3, 4, 255, 256, 511]

# Set while the graphs are re-run for the spreads: "f64" or "perturb".
SPREAD = {"mode": None}


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())

    def problems(self):
        return [m for m in self.records if any(p in m for p in PROBLEMS)]


def b64f(t):
    return sd1.b64(t.detach().float().numpy().astype("<f4"))


# --- files ------------------------------------------------------------------

def file_specs(torch):
    """(name, kind, pair, sorted [(key, shape)], {key: factor}) per file."""
    import comfy.taesd.taesd as taesd
    specs = []
    for pair, p in PAIRS.items():
        for kind, module in [("encoder", taesd.Encoder), ("decoder", taesd.Decoder)]:
            m = module(latent_channels=LATENT_CHANNELS)
            keys = sorted((k, list(t.shape)) for k, t in m.state_dict().items())
            scaled = {k: p["factor"] for k, _ in keys if k.endswith(".weight")}
            if kind == "decoder":
                scaled[LAST_CONV] = p["last"]
                scaled[LAST_BIAS] = p["last_bias"]
            specs.append(("{}_{}.safetensors".format(pair, kind), "taesd_" + kind, pair,
                          keys, scaled))
    return specs


def uniform(name, shape):
    """u in [-1, 1) (up to f32 rounding) from the weight formula: the 1-D
    form of `values` is 1 + 0.1 u. The check inputs are recorded, so
    nothing needs to repeat this."""
    n = int(np.prod(shape))
    return ((sd1.values(name, [n]) - np.float32(1)) * np.float32(10)).reshape(shape)


def file_values(key, shape, scaled):
    v = sd1.values(key, shape)
    if key in scaled:
        v = v * np.float32(scaled[key])
    return v.astype(np.float16).astype(np.float32)


# --- ComfyUI patches and records --------------------------------------------

def patch_vae(torch):
    """For the spread runs only: a TAESD VAE built in float64, or with every
    conv output perturbed by one float32 rounding."""
    import comfy.sd
    init = comfy.sd.VAE.__init__

    def vae_init(self, sd=None, device=None, config=None, dtype=None, metadata=None):
        is_taesd = sd is not None and "taesd_decoder.1.weight" in sd
        if is_taesd and SPREAD["mode"] == "f64":
            dtype = torch.float64
        init(self, sd=sd, device=device, config=config, dtype=dtype, metadata=metadata)
        if is_taesd and SPREAD["mode"] == "perturb":
            gen = torch.Generator().manual_seed(7)

            def hook(module, args, out):
                return out * (1 + 2.0 ** -23 * torch.randn(out.shape, generator=gen))
            for m in self.first_stage_model.modules():
                if isinstance(m, torch.nn.Conv2d):
                    m.register_forward_hook(hook)
    comfy.sd.VAE.__init__ = vae_init


SAMPLED = []   # KSampler outputs, in order
FRAMES = []    # preview records, in order


def record_sampling(torch):
    """Records each KSampler output, and each preview: the x0 the callback
    gave, the tensor preview_to_image got, the (format, image, max size)
    the previewer returned and what the progress bar hook got."""
    import comfy.utils
    import latent_preview
    import nodes
    ksampler = nodes.common_ksampler

    def common_ksampler(*args, **kwargs):
        out = ksampler(*args, **kwargs)
        SAMPLED.append(out[0]["samples"].clone())
        return out
    nodes.common_ksampler = common_ksampler

    to_image = latent_preview.preview_to_image

    def preview_to_image(latent_image):
        FRAMES.append({"tensor": latent_image.detach().clone()})
        return to_image(latent_image)
    latent_preview.preview_to_image = preview_to_image

    decode = latent_preview.LatentPreviewer.decode_latent_to_preview_image

    def decode_latent_to_preview_image(self, preview_format, x0):
        out = decode(self, preview_format, x0)
        FRAMES[-1].update({"previewer": type(self).__name__, "x0": x0[:1].detach().clone(),
                           "out": out})
        return out
    latent_preview.LatentPreviewer.decode_latent_to_preview_image = \
        decode_latent_to_preview_image

    def hook(value, total, preview, node_id=None):
        if preview is not None:
            assert FRAMES and FRAMES[-1]["out"] is preview
            FRAMES[-1].update({"step": value, "total": total})
    comfy.utils.set_progress_bar_global_hook(hook)


# --- checks -----------------------------------------------------------------

def check_loaded(nodes, torch, specs, log):
    """Each pair through VAELoader: a TAESD, every tensor the file's f16
    value, vae_scale / vae_shift as load_taesd sets them."""
    import comfy.taesd.taesd as taesd
    names = nodes.VAELoader.vae_list()
    assert "taesd" in names and "taesdxl" in names, names
    for pair, p in PAIRS.items():
        del log.records[:]
        (vae,) = nodes.VAELoader().load_vae(pair)
        assert not log.problems(), (pair, log.problems())
        m = vae.first_stage_model
        assert type(m) is taesd.TAESD and vae.latent_channels == LATENT_CHANNELS
        assert vae.vae_dtype == torch.float32, vae.vae_dtype
        sd = m.state_dict()
        n = 0
        for name, kind, spair, keys, scaled in specs:
            if spair != pair:
                continue
            prefix = "taesd_" + kind.split("_")[1] + "."
            for k, shape in keys:
                got = sd[prefix + k]
                assert got.dtype == torch.float32, (pair, k, got.dtype)
                assert np.array_equal(got.numpy(), file_values(k, shape, scaled)), (pair, k)
                n += 1
        assert n + 2 == len(sd), (pair, n, len(sd))
        assert m.vae_scale.item() == np.float32(p["vae_scale"]), m.vae_scale
        assert m.vae_shift.item() == np.float32(p["vae_shift"]), m.vae_shift
        print("load", pair, type(m).__name__, "latent channels", vae.latent_channels,
              "tensors", len(sd), "vae_scale", m.vae_scale.item(),
              "vae_shift", m.vae_shift.item())


def functional(torch, sd, kind, x):
    """The architecture as the docstring states it, from a file's tensors
    with torch.nn.functional alone (checks the layout described, not
    ComfyUI)."""
    F = torch.nn.functional

    def conv(i, h, stride=1):
        return F.conv2d(h, sd["{}.weight".format(i)], sd.get("{}.bias".format(i)),
                        stride=stride, padding=1)

    def block(i, h):
        r = F.relu(F.conv2d(h, sd["{}.conv.0.weight".format(i)],
                            sd["{}.conv.0.bias".format(i)], padding=1))
        r = F.relu(F.conv2d(r, sd["{}.conv.2.weight".format(i)],
                            sd["{}.conv.2.bias".format(i)], padding=1))
        r = F.conv2d(r, sd["{}.conv.4.weight".format(i)], sd["{}.conv.4.bias".format(i)],
                     padding=1)
        return F.relu(r + h)

    h = x
    if kind == "encoder":
        h = block(1, conv(0, h))
        for down in (2, 6, 10):
            h = conv(down, h, stride=2)
            for i in range(down + 1, down + 4):
                h = block(i, h)
        return conv(14, h)
    h = F.relu(conv(1, torch.tanh(h / 3) * 3))
    for up in (6, 11, 16):
        for i in range(up - 3, up):
            h = block(i, h)
        h = conv(up + 1, F.interpolate(h, scale_factor=2.0, mode="nearest"))
    return conv(19, block(18, h))


def model_checks(nodes, torch):
    """Per pair one VAE.decode and one VAE.encode, the networks' own inputs
    and outputs recorded by forward hooks."""
    out = {}
    for pair, p in PAIRS.items():
        (vae,) = nodes.VAELoader().load_vae(pair)
        m = vae.first_stage_model
        seen = {}

        def record(name):
            def hook(module, args, output):
                seen[name] = (args[0].detach().clone(), output.detach().clone())
            return hook
        hooks = [m.taesd_decoder.register_forward_hook(record("decoder")),
                 m.taesd_encoder.register_forward_hook(record("encoder"))]
        latent = torch.from_numpy(np.float32(16) * uniform("taesd_check.latent", CHECK_LATENT))
        # 8-bit levels / 255 in f32, as LoadImage gives them.
        levels = np.floor((uniform("taesd_check.image", CHECK_IMAGE) + 1) * np.float32(128))
        image = torch.from_numpy(np.clip(levels, 0, 255).astype(np.float32) / np.float32(255))
        with torch.inference_mode():
            decoded = vae.decode(latent)
            encoded = vae.encode(image)
        for h in hooks:
            h.remove()
        dec_in, dec_out = seen["decoder"]
        enc_in, enc_out = seen["encoder"]
        assert list(decoded.shape) == [1, CHECK_IMAGE[1], CHECK_IMAGE[2], 3]
        assert list(encoded.shape) == CHECK_LATENT
        differs = int((enc_in != image.movedim(-1, 1)).sum())
        # The scale / shift / clamp arithmetic and the architecture as the
        # docstring states them.
        sd = {k: v.float() for k, v in m.state_dict().items()}
        dec_sd = {k[len("taesd_decoder."):]: v for k, v in sd.items()
                  if k.startswith("taesd_decoder.")}
        enc_sd = {k[len("taesd_encoder."):]: v for k, v in sd.items()
                  if k.startswith("taesd_encoder.")}
        scale, shift = torch.tensor(p["vae_scale"]), torch.tensor(p["vae_shift"])
        assert torch.equal(dec_in, (latent - shift) * scale)
        assert torch.equal(dec_out, functional(torch, dec_sd, "decoder", dec_in))
        assert torch.equal(decoded.movedim(-1, 1),
                           torch.clamp(((dec_out - 0.5) * 2 + 1.0) / 2.0, 0.0, 1.0))
        assert torch.equal(enc_in, (image.movedim(-1, 1) * 2.0 - 1.0) * 0.5 + 0.5)
        assert torch.equal(enc_out, functional(torch, enc_sd, "encoder", enc_in))
        assert torch.equal(encoded, enc_out / scale + shift)
        out[pair] = {
            "encoder": "{}_encoder.safetensors".format(pair),
            "decoder": "{}_decoder.safetensors".format(pair),
            "vae_scale": p["vae_scale"], "vae_shift": p["vae_shift"],
            "decode": {"latent_shape": list(latent.shape), "latent_f32": b64f(latent),
                       "decoder_in_f32": b64f(dec_in),
                       "decoder_out_shape": list(dec_out.shape),
                       "decoder_out_f32": b64f(dec_out),
                       "image_shape": list(decoded.shape), "image_f32": b64f(decoded)},
            "encode": {"image_shape": list(image.shape), "image_f32": b64f(image),
                       "encoder_in_f32": b64f(enc_in), "encoder_in_differs": differs,
                       "encoder_out_shape": list(enc_out.shape),
                       "encoder_out_f32": b64f(enc_out),
                       "latent_shape": list(encoded.shape), "latent_f32": b64f(encoded)},
        }
        print("model", pair, "decoder in", list(dec_in.shape), "abs max",
              float(dec_in.abs().max()), "out", list(dec_out.shape), "mean",
              float(dec_out.mean()), "std", float(dec_out.std()), "image in (0,1)",
              float(((decoded > 0) & (decoded < 1)).float().mean()))
        print("   encoder in", list(enc_in.shape), "rounded off the image", differs,
              "out", list(enc_out.shape), "std", float(enc_out.std()), "latent std",
              float(encoded.std()))
    return out


# --- workflows and previews ---------------------------------------------------

def run_taesd_workflow(name, nodes, torch):
    with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
        prompt = json.load(f)
    del SAMPLED[:]
    saved, latents = sd1.run_workflow(prompt, nodes, torch)
    (image,) = saved
    (latent,) = latents
    (sampled,) = SAMPLED
    return image.float().numpy(), latent.float().numpy(), sampled.float().numpy()


def workflows(nodes, torch, log):
    out = {}
    ref = os.path.join(ROOT, "tests", "reference")
    for name, (base_graph, base_fixture) in WORKFLOWS.items():
        del log.records[:]
        img, lat, sampled = run_taesd_workflow(name, nodes, torch)
        assert not log.problems(), (name, log.problems())
        assert np.isfinite(lat).all() and np.isfinite(img).all(), name
        with open(os.path.join(ref, base_fixture, "expected.json")) as f:
            w = json.load(f)["workflows"][base_graph]
        want = np.frombuffer(base64.b64decode(w["latent_f32"]), "<f4").reshape(w["latent_shape"])
        # The same sampling as the base fixture's, up to float32 rounding
        # (that run's thread count and summation order).
        vs_base = float(np.abs(sampled - want).max() / np.abs(want).max())
        assert vs_base < 10 * max(w["f32_vs_f64_unet_rel"], w["unet_rounding_rel"]), \
            (name, vs_base)
        in_range = float(((img > 0) & (img < 1)).mean())
        assert in_range > 0.3, (name, in_range)
        spreads = {}
        for mode in ("f64", "perturb"):
            SPREAD["mode"] = mode
            try:
                _, other, _ = run_taesd_workflow(name, nodes, torch)
            finally:
                SPREAD["mode"] = None
            spreads[mode] = float(np.abs(lat - other).max() / np.abs(other).max())
            assert 0 < spreads[mode] < 1e-4, (name, mode, spreads[mode])
        out[name] = {
            "f32_vs_f64_unet_rel": spreads["f64"], "unet_rounding_rel": spreads["perturb"],
            "f32_vs_f64_taesd_rel": spreads["f64"], "taesd_rounding_rel": spreads["perturb"],
            "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
            "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4")),
            "image_in_range": in_range,
            "sampled_latent_shape": list(sampled.shape),
            "sampled_latent_f32": sd1.b64(sampled.astype("<f4")),
            "sampled_vs_base_rel": vs_base,
        }
        print(name, "image", img.shape, "mean", float(img.mean()), "in (0,1)", in_range,
              "latent", lat.shape, "abs mean", float(np.abs(lat).mean()), "std",
              float(lat.std()), "f32 vs f64 TAESD", spreads["f64"], "TAESD rounding",
              spreads["perturb"], "sampled vs base fixture", vs_base)
    return out


def preview_frames(graph, method, nodes, torch, args, log):
    """graph run with --preview-method `method`: its frames."""
    import latent_preview
    args.preview_method = method
    del FRAMES[:]
    del log.records[:]
    try:
        with open(os.path.join(ROOT, "graphs", graph + ".json")) as f:
            prompt = json.load(f)
        sd1.run_workflow(prompt, nodes, torch)
    finally:
        args.preview_method = type(method).NoPreviews
    assert not log.problems(), (graph, log.problems())
    frames = list(FRAMES)
    for fr in frames:
        assert "step" in fr and "out" in fr, fr.keys()
    assert latent_preview.MAX_PREVIEW_RESOLUTION == args.preview_size
    return frames


def frame_json(fr, with_f32, last):
    from PIL import Image, ImageOps
    fmt, image, max_size = fr["out"]
    assert fmt == "JPEG" and image.mode == "RGB", (fmt, image.mode)
    u8 = np.asarray(image)
    # server.send_image / send_image_with_metadata: ImageOps.contain to
    # (max_size, max_size), BILINEAR where PIL has Image.Resampling.
    resized = ImageOps.contain(image, (max_size, max_size), Image.Resampling.BILINEAR)
    r = np.asarray(resized)
    out = {"step": fr["step"], "total": fr["total"], "width": image.width,
           "height": image.height, "u8": base64.b64encode(u8.tobytes()).decode()}
    if with_f32:
        t = fr["tensor"]
        assert list(t.shape) == [image.height, image.width, 3]
        out["f32"] = b64f(t)
    out.update({"preview_width": resized.width, "preview_height": resized.height,
                "preview_sha256": hashlib.sha256(r.tobytes()).hexdigest()})
    if last:
        rows = [i for i in PREVIEW_ROWS if i < resized.height]
        out["preview_rows"] = {"rows": rows,
                               "u8": base64.b64encode(r[rows].tobytes()).decode()}
    return out


def previews(nodes, torch, log, specs):
    import comfy.cli_args
    import comfy.taesd.taesd as taesd
    import latent_preview
    args = comfy.cli_args.args
    method = comfy.cli_args.LatentPreviewMethod
    out = {}
    for graph in PREVIEW_GRAPHS:
        with open(os.path.join(ROOT, "graphs", graph + ".json")) as f:
            prompt = json.load(f)
        (node,) = [nid for nid, n in prompt.items() if n["class_type"] == "KSampler"]
        steps = prompt[node]["inputs"]["steps"]
        ckpt = prompt["1"]["inputs"]["ckpt_name"]
        model = nodes.CheckpointLoaderSimple().load_checkpoint(ckpt)[0]
        fmt = model.model.latent_format
        args.preview_method = method.TAESD
        try:
            previewer = latent_preview.get_previewer(model.load_device, fmt)
        finally:
            args.preview_method = method.NoPreviews
        assert type(previewer) is latent_preview.TAESDPreviewerImpl, type(previewer)
        t = previewer.taesd
        assert t.vae_scale.item() == 1.0 and t.vae_shift.item() == 0.0
        pair = fmt.taesd_decoder_name[:-len("_decoder")]
        decoder = "{}_decoder.safetensors".format(pair)
        (keys, scaled), = [(k, sc) for name, _, _, k, sc in specs if name == decoder]
        sd = t.taesd_decoder.state_dict()
        assert sorted(sd) == [k for k, _ in keys], graph
        for k, shape in keys:
            assert np.array_equal(sd[k].numpy(), file_values(k, shape, scaled)), (graph, k)
        assert isinstance(t, taesd.TAESD)
        del model

        by = {}
        for m in (method.TAESD, method.Latent2RGB):
            frames = preview_frames(graph, m, nodes, torch, args, log)
            kinds = {fr["previewer"] for fr in frames}
            want = "TAESDPreviewerImpl" if m == method.TAESD else "Latent2RGBPreviewer"
            assert kinds == {want}, (graph, m, kinds)
            assert [fr["step"] for fr in frames] == list(range(1, steps + 1)), graph
            assert all(fr["total"] == steps for fr in frames)
            by[m] = frames
        x0 = []
        factors = torch.tensor(fmt.latent_rgb_factors)
        bias = fmt.latent_rgb_factors_bias

        def to_u8(t):
            return (((t + 1.0) / 2.0).clamp(0, 1) * 255).to(torch.uint8).numpy()
        for a, b in zip(by[method.TAESD], by[method.Latent2RGB]):
            assert torch.equal(a["x0"], b["x0"]), graph
            # The conversions as the docstring states them.
            img = functional(torch, sd, "decoder", a["x0"])[0].sub(0.5).mul(2).movedim(0, 2)
            assert torch.equal(img, a["tensor"]), graph
            assert np.array_equal(to_u8(img), np.asarray(a["out"][1])), graph
            rgb = b["x0"][0].movedim(0, -1) @ factors
            if bias is not None:
                rgb = rgb + torch.tensor(bias)
            assert torch.allclose(rgb, b["tensor"], rtol=0, atol=1e-5), graph
            assert np.array_equal(to_u8(b["tensor"]), np.asarray(b["out"][1])), graph
            x0.append({"step": a["step"], "shape": list(a["x0"].shape), "f32": b64f(a["x0"])})
        import PIL
        entry = {"node": node, "steps": steps, "preview_size": args.preview_size,
                 "pillow_version": PIL.__version__, "x0": x0}
        for m, key in ((method.TAESD, "taesd"), (method.Latent2RGB, "latent2rgb")):
            frames = by[m]
            js = [frame_json(fr, m == method.Latent2RGB, i == len(frames) - 1)
                  for i, fr in enumerate(frames)]
            if key == "taesd":
                entry[key] = {"decoder": decoder, "frames": js}
            else:
                entry[key] = {"factors": fmt.latent_rgb_factors,
                              "bias": fmt.latent_rgb_factors_bias, "frames": js}
            for fr, j in zip(frames, js):
                u8 = np.asarray(fr["out"][1])
                print("preview", graph, key, "step", j["step"], "image", j["width"], "x",
                      j["height"], "mean", float(u8.mean()), "min", int(u8.min()), "max",
                      int(u8.max()), "->", j["preview_width"], "x", j["preview_height"])
        out[graph] = entry
    return out


def main():
    _, _, torch = sd1.start_comfy()
    import folder_paths
    import nodes

    log = LogCapture()
    root = logging.getLogger()
    root.addHandler(log)
    level = root.level
    quiet = [(h, h.level) for h in root.handlers if h is not log]
    tmp = tempfile.mkdtemp()
    try:
        fam.patch_comfy(tmp, torch)
        patch_vae(torch)
        record_sampling(torch)
        ckpt_dir = os.path.join(tmp, "checkpoints")
        fam.write_base_checkpoints(ckpt_dir, torch)
        folder_paths.add_model_folder_path("checkpoints", ckpt_dir, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))

        specs = file_specs(torch)
        out = {"base": {"sd1": "sd1/expected.json", "sdxl": "families/expected.json"},
               "files": [], "models": {}, "workflows": {}, "previews": {}}
        approx = os.path.join(tmp, "vae_approx")
        os.makedirs(approx)
        for name, kind, pair, keys, scaled in specs:
            digest = fam.write_file(os.path.join(approx, name), keys, scaled, torch)
            out["files"].append({"folder": "vae_approx", "name": name, "kind": kind,
                                 "base": None, "keys": keys, "scaled": scaled,
                                 "checksum_f16": str(digest)})
            print("file vae_approx", name, kind, "keys", len(keys),
                  "params", sum(int(np.prod(s)) for _, s in keys), "checksum", digest)
        folder_paths.add_model_folder_path("vae_approx", approx, is_default=True)

        # ComfyUI reports leftover keys at DEBUG level: captured, not printed.
        for h, _ in quiet:
            h.setLevel(max(h.level, logging.INFO))
        root.setLevel(logging.DEBUG)
        check_loaded(nodes, torch, specs, log)
        out["models"] = model_checks(nodes, torch)
        out["workflows"] = workflows(nodes, torch, log)
        out["previews"] = previews(nodes, torch, log, specs)

        dst = os.path.join(ROOT, "tests", "reference", "taesd")
        os.makedirs(dst, exist_ok=True)
        path = os.path.join(dst, "expected.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=0)
            f.write("\n")
        print("wrote", path, os.path.getsize(path), "bytes")
    finally:
        root.setLevel(level)
        for h, lvl in quiet:
            h.setLevel(lvl)
        root.removeHandler(log)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
