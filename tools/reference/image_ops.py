"""Reference fixtures for sdkit's image operations (nodes/src/imageops/).

Run from anywhere (re-runnable; rewrites the fixture sets named, all of
them by default):

    /work/pyenv/bin/python tools/reference/image_ops.py [imageops] [imageops_extra] [latentops]

(e.g. COMFY_DIR=/work/comfyfull /work/venv-ref/bin/python
tools/reference/image_ops.py latentops)

Needs torch, numpy, Pillow and SciPy, plus a ComfyUI checkout (default
/work/comfy, override with COMFY_DIR). Each set is a folder under
nodes/tests/fixtures/: data.bin (every array back to back, raw
little-endian f32 or u8) and index.json (each array's offset/shape/dtype,
and every case: op, params, input arrays, expected output array or the
error ComfyUI raised). nodes/tests/imageops.rs replays the cases.

  imageops/        resampling, blur/sharpen and the simple image/mask nodes
                   (`build`).
  imageops_extra/  LatentUpscale(By), ImageScaleToTotalPixels, GrowMask,
                   ThresholdMask, ImageCompositeMasked, ImageFlip,
                   ImageRotate, ImageStitch, ImageBlend,
                   ResizeAndPadImage, FeatherMask, MaskComposite and
                   CropMask (`build_extra`). A set of its own so
                   that adding these did not regenerate imageops/
                   (ImageStitch's arrays are named stitch_*, ImageBlend's
                   and ResizeAndPadImage's zz_blend_* and zz_pad_*, the
                   three mask nodes' zzz_mask_*, so
                   that each later addition sorts, and so sits in
                   data.bin, after the older arrays): regenerated
                   elsewhere (ComfyUI 0.3.64, same torch/numpy/Pillow and
                   CPU capability in the header), imageops/ came out a few
                   ULPs different in gaussian_kernel, blur, sharpen and
                   bislerp (all inside imageops.rs's tolerances) and
                   identical everywhere else.

  latentops/       LATENT-dict nodes and a few more batch/mask/scale
                   nodes (`latent_ops.py`'s `build_latentops`): LatentComposite, LatentBlend,
                   LatentFromBatch, RepeatLatentBatch, LatentCrop,
                   LatentFlip, LatentRotate (nodes.py),
                   LatentCompositeMasked, ImageColorToMask
                   (comfy_extras/nodes_mask.py), RepeatImageBatch,
                   ImageFromBatch, ImageScaleToMaxDimension
                   (comfy_extras/nodes_images.py). Same index/data layout,
                   with these additions to each case:

      "node"         the ComfyUI class name ("op" is its snake_case name,
                     as in the other sets).
      "params"       the node's widget inputs under ComfyUI's own input
                     names (LatentBlend also records "blend_mode":
                     "normal", the method's default; the node exposes no
                     such input).
      "inputs"       the tensor inputs, positionally in ComfyUI's input
                     order; an optional input left unconnected is simply
                     absent (LatentCompositeMasked: [destination, source]
                     or [destination, source, mask]). An IMAGE
                     ([b, h, w, c]) or MASK ([b, h, w]) is an array name
                     (a string). A LATENT is an object:
                       {"samples": NAME,          f32 [b, c, h, w]
                        "noise_mask": NAME,       f32, only when the dict
                                                  has one (here [b, 1, h, w]:
                                                  the latent's size, 8x it,
                                                  or another; any batch)
                        "batch_index": [int, ...] only when the dict has one}
                     A key that is absent means the dict has no such key.
      "output_type"  "LATENT", "IMAGE" or "MASK".
      "output"       for IMAGE/MASK an array name (ImageScaleToMaxDimension
                     with lanczos: u8, k/255 as elsewhere); for LATENT an
                     object in the same encoding as a LATENT input, giving
                     exactly the keys of the dict the node returned
                     (noise_mask / batch_index passed through, sliced,
                     repeated or created by the node). Absent when the
                     case has "error" instead.
                   Arrays are stored once: an output equal (dtype, shape,
                   bytes) to an already stored array reuses its name, so an
                   output may be named in_*/lat_*/nmask_* or after another
                   case. Input arrays: lat_* (samples), nmask_*
                   (noise_mask), mask_* (MASK), cimg_*/img_*/simg_* (IMAGE).

What it mirrors: the real ComfyUI code, not a re-implementation. The
functions and node classes below are lifted out of the ComfyUI sources with
`ast` and executed unchanged against torch/numpy/Pillow, with the few
unrelated imports they touch (comfy.model_management, comfy_api's `io`)
stubbed to CPU:

  comfy/utils.py:                      common_upscale, lanczos, bislerp,
                                       repeat_to_batch_size
  node_helpers.py:                     image_alpha_fix
  nodes.py:                            ImageScale, ImageScaleBy, ImageInvert,
                                       ImageBatch, EmptyImage, LatentUpscale,
                                       LatentUpscaleBy, LatentComposite, LatentBlend,
                                       LatentFromBatch, RepeatLatentBatch,
                                       LatentCrop, LatentFlip, LatentRotate
  comfy_extras/nodes_images.py:        ImageCrop, ImageFlip, ImageRotate,
                                       ImageStitch, ResizeAndPadImage,
                                       RepeatImageBatch, ImageFromBatch,
                                       ImageScaleToMaxDimension
  comfy_extras/nodes_mask.py:          ImageToMask, MaskToImage, SolidMask,
                                       InvertMask, composite,
                                       ImageCompositeMasked, GrowMask,
                                       ThresholdMask, FeatherMask,
                                       MaskComposite, CropMask,
                                       LatentCompositeMasked,
                                       ImageColorToMask
  comfy_extras/nodes_post_processing.py: gaussian_kernel, Blur, Sharpen,
                                       ImageScaleToTotalPixels, Blend
                                       (ImageBlend)

Only the LoadImage/SaveImage pixel conversions are copied inline (their
node methods do file I/O); see `save_image_u8` and `load_image_f32`.

Everything runs on the CPU in float32 with 2 torch threads, which is what
the Rust side reproduces (PyTorch chooses numerically different upsampling
kernels depending on memory layout and output size; see imageops.rs).
"""

import ast
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import scipy
import scipy.ndimage
import torch
import torch.nn.functional as F
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "nodes" / "tests" / "fixtures"
COMFY = Path(os.environ.get("COMFY_DIR", "/work/comfy"))

# ComfyUI runs torch with many threads; with exactly one thread PyTorch
# picks yet another bilinear kernel for 3-channel images, so pin >= 2.
torch.set_num_threads(2)


# ---------------------------------------------------------------------------
# Load the real ComfyUI definitions
# ---------------------------------------------------------------------------

def _stub_namespace():
    """Globals the lifted ComfyUI code expects, pointing at the CPU."""
    model_management = types.SimpleNamespace(
        get_torch_device=lambda: torch.device("cpu"),
        intermediate_device=lambda: torch.device("cpu"),
    )
    utils = types.SimpleNamespace()
    comfy = types.SimpleNamespace(utils=utils, model_management=model_management)
    io = types.SimpleNamespace(
        ComfyNode=object,
        NodeOutput=lambda *values: values,
    )
    ns = {
        "__name__": "comfy_reference",
        "torch": torch,
        "np": np,
        "F": F,
        "Image": Image,
        "math": __import__("math"),
        "scipy": scipy,
        "comfy": comfy,
        "io": io,
        # comfy.comfy_types.IO, only read in INPUT_TYPES / RETURN_TYPES.
        "IO": types.SimpleNamespace(IMAGE="IMAGE"),
        "node_helpers": types.SimpleNamespace(),
        "MAX_RESOLUTION": 16384,
    }
    return ns, utils


def _lift(ns, relpath, names):
    """Exec the top-level defs/classes `names` of a ComfyUI file into ns."""
    path = COMFY / relpath
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            module = ast.Module(body=[node], type_ignores=[])
            exec(compile(module, f"{path}:{node.name}", "exec"), ns)
            found.add(node.name)
    missing = set(names) - found
    if missing:
        sys.exit(f"{relpath}: could not find {sorted(missing)}")


NS, UTILS = _stub_namespace()
_lift(NS, "comfy/utils.py", ["bislerp", "lanczos", "common_upscale"])
UTILS.common_upscale = NS["common_upscale"]
UTILS.lanczos = NS["lanczos"]
UTILS.bislerp = NS["bislerp"]
_lift(NS, "comfy/utils.py", ["repeat_to_batch_size"])
UTILS.repeat_to_batch_size = NS["repeat_to_batch_size"]
_lift(NS, "node_helpers.py", ["image_alpha_fix"])
NS["node_helpers"].image_alpha_fix = NS["image_alpha_fix"]
_lift(NS, "nodes.py", ["ImageScale", "ImageScaleBy", "ImageInvert", "ImageBatch", "EmptyImage",
                       "LatentUpscale", "LatentUpscaleBy"])
_lift(NS, "comfy_extras/nodes_images.py", ["ImageCrop", "ImageFlip", "ImageRotate", "ImageStitch",
                                           "ResizeAndPadImage"])
_lift(NS, "comfy_extras/nodes_mask.py", ["ImageToMask", "MaskToImage", "SolidMask", "InvertMask",
                                         "composite", "ImageCompositeMasked", "GrowMask",
                                         "ThresholdMask", "FeatherMask", "MaskComposite",
                                         "CropMask"])
_lift(NS, "comfy_extras/nodes_post_processing.py", ["gaussian_kernel", "Blur", "Sharpen",
                                                    "ImageScaleToTotalPixels", "Blend"])


def save_image_u8(image):
    """SaveImage.save_images: `255. * i.cpu().numpy()`, clip, astype(uint8)."""
    out = []
    for i in image:
        i = 255.0 * i.cpu().numpy()
        out.append(np.clip(i, 0, 255).astype(np.uint8))
    return np.stack(out)


def load_image_f32(pixels_u8):
    """LoadImage.load_image: `np.array(image).astype(np.float32) / 255.0`."""
    image = np.array(pixels_u8).astype(np.float32) / 255.0
    return torch.from_numpy(image)[None,]


def load_mask_f32(alpha_u8):
    """LoadImage.load_image: `1. - torch.from_numpy(alpha / 255.0)`."""
    mask = np.array(alpha_u8).astype(np.float32) / 255.0
    return 1.0 - torch.from_numpy(mask)


# ---------------------------------------------------------------------------
# Fixture bookkeeping
# ---------------------------------------------------------------------------

# One (arrays, cases) pair per fixture folder; put() and case() fill the
# one use_set() selected.
SETS = {}
ARRAYS = None
CASES = None


def use_set(name):
    global ARRAYS, CASES
    ARRAYS, CASES = SETS.setdefault(name, ({}, []))


def put(name, array, dtype="f32"):
    """Register an array (torch or numpy) to be written as name.bin."""
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().contiguous().numpy()
    np_dtype = {"f32": "<f4", "u8": "u1"}[dtype]
    array = np.ascontiguousarray(array).astype(np_dtype, copy=False)
    if name in ARRAYS:
        raise SystemExit(f"duplicate array {name}")
    ARRAYS[name] = (array, dtype)
    return name


def case(name, op, params, inputs, compute, out_dtype="f32", out_name=None):
    """Run compute(); record its output (as out_name, default out_<name>),
    or the error it raises."""
    entry = {"name": name, "op": op, "params": params, "inputs": inputs}
    try:
        result = compute()
    except Exception as exc:  # ComfyUI/torch/PIL rejects these arguments
        entry["error"] = f"{type(exc).__name__}: {exc}"
    else:
        entry["output"] = put(out_name or f"out_{name}", result, out_dtype)
    CASES.append(entry)


def rand_image(seed, shape):
    """Deterministic float32 image, some values outside 0..1 plus exact
    0, 1 and k/255 values so clamping and quantisation edges are hit."""
    rng = np.random.default_rng(seed)
    x = (rng.random(shape, dtype=np.float32) * np.float32(1.2) - np.float32(0.1)).astype(np.float32)
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=max(4, flat.size // 10), replace=False)
    for j, p in enumerate(picks):
        flat[p] = [0.0, 1.0, np.float32(rng.integers(0, 256)) / np.float32(255.0)][j % 3]
    return torch.from_numpy(x)


def image_node(cls, method, *args):
    return getattr(NS[cls](), method)(*args)[0]


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

def build():
    img = {
        "a": rand_image(1, (2, 7, 9, 3)),
        "b": rand_image(2, (1, 13, 10, 4)),
        "c": rand_image(3, (2, 9, 6, 4)),
        "d": rand_image(4, (1, 5, 6, 2)),
        "e": rand_image(5, (1, 4, 6, 3)),
        "g": rand_image(6, (1, 5, 8, 3)),
        "m": rand_image(7, (1, 6, 5, 1)),
        # One-hot rows: with a single input row the output along the width
        # is exactly the interpolation weights, exposing 1-ULP differences.
        "imp": torch.eye(4, 3, dtype=torch.float32).reshape(1, 1, 4, 3),
    }
    for k, v in img.items():
        put(f"in_{k}", v)
    mask = rand_image(8, (2, 5, 7))
    put("in_mask", mask)

    def upscale(src, w, h, method, crop):
        # ImageScale.upscale without the zero-size rule: movedim to BCHW,
        # common_upscale, movedim back.
        s = NS["common_upscale"](img[src].movedim(-1, 1), w, h, method, crop)
        return s.movedim(1, -1)

    # (input, width, height, crop): up/down, non-integer ratios, both crops,
    # thin outputs with h + w > 128 (PyTorch's generic kernel), C == 4
    # (channels-last kernel), cropped C == 4 with batch 2 (generic again).
    geometries = [
        ("a", 13, 11, "disabled"),
        ("a", 4, 5, "disabled"),
        ("a", 14, 10, "center"),
        ("a", 6, 3, "center"),
        ("a", 3, 6, "center"),
        ("a", 9, 7, "disabled"),
        ("a", 9, 12, "disabled"),
        ("a", 5, 1, "disabled"),
        ("a", 1, 1, "disabled"),
        ("a", 1, 1, "center"),
        ("e", 130, 2, "disabled"),
        ("e", 3, 126, "disabled"),
        ("b", 13, 15, "disabled"),
        ("b", 7, 5, "center"),
        ("b", 1, 1, "disabled"),
        ("b", 130, 3, "center"),
        ("c", 128, 1, "center"),
        ("c", 11, 4, "disabled"),
        ("c", 2, 140, "disabled"),
        ("c", 1, 1, "center"),
        ("d", 11, 8, "disabled"),
        ("d", 4, 3, "center"),
        ("m", 7, 9, "disabled"),
        ("imp", 31, 1, "disabled"),
        ("imp", 37, 1, "disabled"),
        ("imp", 11, 1, "disabled"),
    ]
    # Pillow 13 runs the vertical pass first when the height shrinks and the
    # width does not; these cover both orders and single-pass resizes.
    lanczos_only = [
        ("a", 9, 4, "disabled"),
        ("a", 13, 4, "disabled"),
        ("a", 12, 7, "disabled"),
        ("a", 4, 12, "disabled"),
        ("b", 10, 6, "disabled"),
        ("b", 12, 6, "disabled"),
        ("d", 6, 2, "disabled"),
    ]
    methods = ["nearest-exact", "bilinear", "area", "bicubic", "lanczos", "bislerp"]
    for method in methods:
        extra = lanczos_only if method == "lanczos" else []
        for src, w, h, crop in geometries + extra:
            # Thin outputs with h + w > 128 only matter where PyTorch switches
            # kernels (nearest-exact, bilinear); bicubic keeps one of them.
            thin = w + h > 128
            if thin and method not in ("nearest-exact", "bilinear") and not (method in ("bicubic", "bislerp") and h == 2):
                continue
            if method == "bislerp" and src == "m":
                continue
            name = f"upscale_{method}_{src}_{w}x{h}_{crop}"
            out_dtype = "u8" if method == "lanczos" else "f32"

            def compute(src=src, w=w, h=h, method=method, crop=crop, out_dtype=out_dtype):
                out = upscale(src, w, h, method, crop)
                # lanczos output is always k/255; store the byte.
                return (out * 255.0).round().to(torch.uint8) if out_dtype == "u8" else out

            case(name, "upscale", {"method": method, "width": w, "height": h, "crop": crop},
                 [f"in_{src}"], compute, out_dtype)
    # Latents reach common_upscale as contiguous NCHW tensors, for which
    # PyTorch picks other kernels than for an IMAGE's channels-last view.
    for method, w, h in [("bilinear", 130, 3), ("nearest-exact", 130, 3), ("area", 1, 1),
                         ("area", 5, 4)]:
        case(f"upscale_nchw_{method}_b_{w}x{h}", "upscale_nchw",
             {"method": method, "width": w, "height": h, "crop": "disabled"}, ["in_b"],
             lambda method=method, w=w, h=h: NS["common_upscale"](
                 img["b"].movedim(-1, 1).contiguous(), w, h, method, "disabled").movedim(1, -1))

    # "e" is 6x4: a 1000x1 center crop keeps round(1.997) * 2 = 4 rows = nothing.
    case("upscale_center_crop_empty", "upscale",
         {"method": "bilinear", "width": 1000, "height": 1, "crop": "center"},
         ["in_e"], lambda: upscale("e", 1000, 1, "bilinear", "center"))

    # ImageScale (zero keeps aspect; "e" is 6x4 so 6*3/4 = 4.5 rounds to 4).
    for method, w, h, crop in [
        ("bilinear", 0, 3, "disabled"),
        ("nearest-exact", 0, 12, "center"),
        ("bicubic", 10, 0, "disabled"),
        ("area", 0, 0, "disabled"),
    ]:
        src = "e" if h == 3 else "a"
        case(f"scale_to_{method}_{src}_{w}x{h}", "scale_to",
             {"method": method, "width": w, "height": h, "crop": crop}, [f"in_{src}"],
             lambda src=src, method=method, w=w, h=h, crop=crop:
                 image_node("ImageScale", "upscale", img[src], method, w, h, crop))
    # ImageScaleBy: 9*1.5 = 13.5 -> 14, 7*1.5 = 10.5 -> 10 (banker's rounding).
    for method, factor in [("bilinear", 1.5), ("area", 0.5), ("lanczos", 0.37), ("bicubic", 1.25)]:
        case(f"scale_by_{method}_{factor}", "scale_by", {"method": method, "scale_by": factor},
             ["in_a"], lambda method=method, factor=factor:
                 image_node("ImageScaleBy", "upscale", img["a"], method, factor))

    # ImageBlur / ImageSharpen.
    for src, radius, sigma in [("a", 1, 1.0), ("a", 2, 0.5), ("a", 3, 2.3), ("b", 5, 1.5),
                               ("b", 9, 10.0), ("a", 7, 1.0)]:
        case(f"blur_{src}_r{radius}_s{sigma}", "blur", {"radius": radius, "sigma": sigma},
             [f"in_{src}"], lambda src=src, radius=radius, sigma=sigma:
                 NS["Blur"].execute(img[src], radius, sigma)[0])
    for src, radius, sigma, alpha in [("a", 1, 1.0, 1.0), ("a", 2, 0.7, 0.3), ("b", 3, 1.5, 5.0),
                                      ("b", 4, 0.4, 2.0)]:
        case(f"sharpen_{src}_r{radius}_s{sigma}_a{alpha}", "sharpen",
             {"radius": radius, "sigma": sigma, "alpha": alpha}, [f"in_{src}"],
             lambda src=src, radius=radius, sigma=sigma, alpha=alpha:
                 NS["Sharpen"].execute(img[src], radius, sigma, alpha)[0])
    for k, sigma in [(3, 1.0), (5, 0.3), (7, 2.3), (11, 1.5), (19, 10.0)]:
        case(f"gaussian_kernel_{k}_{sigma}", "gaussian_kernel", {"size": k, "sigma": sigma}, [],
             lambda k=k, sigma=sigma: NS["gaussian_kernel"](k, sigma))

    # Simple image nodes.
    case("invert_a", "invert", {}, ["in_a"], lambda: image_node("ImageInvert", "invert", img["a"]))
    for w, h, x, y in [(4, 3, 2, 1), (5, 2, 20, 3), (3, 9, 0, 40), (100, 100, 1, 1)]:
        case(f"crop_{w}x{h}_at_{x}_{y}", "crop", {"width": w, "height": h, "x": x, "y": y}, ["in_a"],
             lambda w=w, h=h, x=x, y=y: image_node("ImageCrop", "crop", img["a"], w, h, x, y))
    case("batch_same", "batch", {}, ["in_a", "in_a"],
         lambda: image_node("ImageBatch", "batch", img["a"], img["a"]))
    case("batch_resize", "batch", {}, ["in_a", "in_g"],
         lambda: image_node("ImageBatch", "batch", img["a"], img["g"]))
    case("batch_channels", "batch", {}, ["in_a", "in_b"],
         lambda: image_node("ImageBatch", "batch", img["a"], img["b"]))
    for src, channel in [("a", "green"), ("b", "alpha"), ("a", "alpha")]:
        case(f"image_to_mask_{src}_{channel}", "image_to_mask", {"channel": channel}, [f"in_{src}"],
             lambda src=src, channel=channel: image_node("ImageToMask", "image_to_mask", img[src], channel))
    case("mask_to_image", "mask_to_image", {}, ["in_mask"],
         lambda: image_node("MaskToImage", "mask_to_image", mask))
    case("solid_mask", "solid_mask", {"value": 0.37, "width": 5, "height": 3}, [],
         lambda: image_node("SolidMask", "solid", 0.37, 5, 3))
    case("invert_mask", "invert_mask", {}, ["in_mask"], lambda: image_node("InvertMask", "invert", mask))
    for color in [0x12AB7F, 0xFFFFFF, 0x000000, 0x808001]:
        case(f"empty_image_{color:06x}", "empty_image",
             {"width": 5, "height": 3, "batch": 2, "color": color}, [],
             lambda color=color: image_node("EmptyImage", "generate", 5, 3, 2, color))

    # u8 conversions. Values around every k/255 boundary, in f32.
    vals = []
    for k in range(256):
        v = np.float32(k) / np.float32(255.0)
        vals += [v, np.nextafter(v, np.float32(2)), np.nextafter(v, np.float32(-2)),
                 (np.float32(k) + np.float32(0.5)) / np.float32(255.0)]
    vals += [-0.0, -1.0, 2.0, 1.0000001, -1e-30, 0.99999994]
    edges = torch.tensor(np.array(vals, dtype=np.float32)).reshape(1, 1, -1, 1)
    put("in_edges", edges)
    case("to_u8_edges", "to_u8", {}, ["in_edges"], lambda: save_image_u8(edges), "u8")
    case("to_u8_a", "to_u8", {}, ["in_a"], lambda: save_image_u8(img["a"]), "u8")
    all_bytes = np.arange(256, dtype=np.uint8).reshape(1, 16, 16)
    put("in_bytes", all_bytes, "u8")
    case("from_u8", "from_u8", {}, ["in_bytes"], lambda: load_image_f32(all_bytes[0, :, :, None]))
    case("mask_from_alpha_u8", "mask_from_alpha_u8", {}, ["in_bytes"],
         lambda: load_mask_f32(all_bytes[0])[None,])


# ---------------------------------------------------------------------------
# imageops_extra: latent upscales, total-pixel scale, mask and geometry nodes
# ---------------------------------------------------------------------------

def rand_latent(seed, shape):
    """Deterministic float32 latent [b, c, h, w] (standard normal), with
    bislerp's edge cases planted: zero vectors, and pixel vectors equal to,
    opposite to and parallel to (2.5x) their right-hand neighbour."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    b, _, h, w = shape
    for j in range(max(4, b * h * w // 6)):
        bi, y, xx = int(rng.integers(b)), int(rng.integers(h)), int(rng.integers(w - 1))
        right = x[bi, :, y, xx + 1].copy()
        x[bi, :, y, xx] = [np.zeros_like(right), right, -right, right * np.float32(2.5)][j % 4]
    return torch.from_numpy(x)


def rand_mask(seed, shape, density):
    """Deterministic float32 mask: fractional values in [0, 1) on about
    `density` of the pixels (0 elsewhere), plus some exact 1.0 pixels."""
    rng = np.random.default_rng(seed)
    v = rng.random(shape, dtype=np.float32)
    keep = rng.random(shape) < density
    m = np.where(keep, v, np.float32(0.0)).astype(np.float32)
    flat = m.reshape(-1)
    flat[rng.choice(flat.size, size=max(1, flat.size // 12), replace=False)] = 1.0
    return torch.from_numpy(m)


def build_extra():
    def lat(name):
        return {"samples": latents[name]}

    # ---- LatentUpscale / LatentUpscaleBy: latents [b, c, h, w] ----------
    latents = {
        "la": rand_latent(101, (1, 4, 5, 7)),
        "lb": rand_latent(102, (2, 4, 6, 9)),
        "lc": rand_latent(103, (1, 16, 5, 6)),
    }
    for k, v in latents.items():
        put(f"in_{k}", v)
    lat_methods = ["nearest-exact", "bilinear", "area", "bicubic", "bislerp"]
    # (width, height, crop) in pixels, as the node takes them: max(64, .)
    # then // 8; a 0 side follows the latent's aspect (Python round), both
    # 0 return the latent unchanged.
    lat_geoms = {
        "la": [
            (0, 0, "disabled"),      # unchanged
            (64, 64, "disabled"),    # 8x8
            (32, 16, "disabled"),    # both clamped to 64 -> 8x8
            (100, 70, "disabled"),   # 12x8 (floor division)
            (72, 88, "center"),      # 9x11, center crop (x = round(1.45) = 1)
            (90, 0, "center"),       # h = round(5*90/7 = 64.29) = 64 -> 11x8
            (0, 69, "disabled"),     # w = round(7*69/5 = 96.6) = 97 -> 12x8
            (0, 40, "disabled"),     # h clamped to 64 first: w = round(89.6) = 90 -> 11x8
            (80, 0, "disabled"),     # h = round(57.14) = 57 -> clamped 64 -> 10x8
        ],
        "lb": [
            (0, 69, "disabled"),     # w = round(9*69/6 = 103.5) = 104 -> 13x8 (103 // 8 = 12)
            (120, 64, "center"),     # 15x8, center crop (y = round(0.6) = 1)
        ],
        "lc": [
            (64, 64, "disabled"),
            (64, 64, "center"),      # x = round((6 - 6*(1/1.2)) / 2 = 0.5) = 0: no crop
        ],
    }
    for method in lat_methods:
        for src, geoms in lat_geoms.items():
            for w, h, crop in geoms:
                case(f"latent_upscale_{method}_{src}_{w}x{h}_{crop}", "latent_upscale",
                     {"method": method, "width": w, "height": h, "crop": crop}, [f"in_{src}"],
                     lambda method=method, src=src, w=w, h=h, crop=crop: image_node(
                         "LatentUpscale", "upscale", lat(src), method, w, h, crop)["samples"])
    # LatentUpscaleBy: round(side * scale_by), no clamp, no // 8.
    # la 5x7 * 0.5: round(2.5) = 2, round(3.5) = 4; * 1.37: 6.85 -> 7, 9.59 -> 10.
    # * 0.1: round(0.5) = 0 rows.
    lat_by = {"la": [1.5, 0.5, 1.37, 2.0, 0.1], "lb": [0.5, 1.37], "lc": [0.5, 1.37]}
    for method in lat_methods:
        for src, factors in lat_by.items():
            for factor in factors:
                case(f"latent_upscale_by_{method}_{src}_{factor}", "latent_upscale_by",
                     {"method": method, "scale_by": factor}, [f"in_{src}"],
                     lambda method=method, src=src, factor=factor: image_node(
                         "LatentUpscaleBy", "upscale", lat(src), method, factor)["samples"])

    # ---- ImageScaleToTotalPixels: images [b, h, w, c] -------------------
    img = {
        "tp_a": rand_image(111, (1, 13, 17, 3)),
        "tp_b": rand_image(112, (2, 9, 7, 3)),
        "tp_c": rand_image(113, (1, 1, 4, 3)),
        "tp_d": rand_image(114, (1, 2, 40, 3)),
    }
    # total = int(mp * 2**20); scale = sqrt(total / (w * h)); sides round().
    #  tp_a 0.0003: 314 -> 20x15 (round(15.496)), 0.0001: 104 -> 12x9
    #  tp_b 0.0002: 209 -> 13x16       tp_c 25 / 2**20: total 25 exactly,
    #  scale 2.5 -> 10x2 (round(2.5) = 2)
    tp_all = [("tp_a", 0.0003), ("tp_a", 0.0001), ("tp_b", 0.0002), ("tp_c", 25 / 2**20)]
    # tp_d 0.001: 1048 -> 145x7, w + h > 128, where PyTorch switches
    # nearest/bilinear kernels. 0.01 (the node's minimum) only for lanczos,
    # stored as bytes: 10485 -> 117x90 (round(89.54)).
    tp_more = {"nearest-exact": [("tp_d", 0.001)], "bilinear": [("tp_d", 0.001)],
               "lanczos": [("tp_a", 0.01)]}
    for method in ["nearest-exact", "bilinear", "area", "bicubic", "lanczos"]:
        for src, mp in tp_all + tp_more.get(method, []):
            out_dtype = "u8" if method == "lanczos" else "f32"

            def compute(src=src, mp=mp, method=method, out_dtype=out_dtype):
                out = NS["ImageScaleToTotalPixels"].execute(img[src], method, mp)[0]
                # lanczos output is always k/255; store the byte.
                return (out * 255.0).round().to(torch.uint8) if out_dtype == "u8" else out

            case(f"scale_to_total_pixels_{method}_{src}_{mp!r}", "scale_to_total_pixels",
                 {"method": method, "megapixels": mp}, [f"in_{src}"], compute, out_dtype)

    # ---- ImageFlip / ImageRotate ----------------------------------------
    img["fr_a"] = rand_image(121, (2, 3, 5, 3))
    img["fr_b"] = rand_image(122, (1, 4, 2, 4))
    for src in ["fr_a", "fr_b"]:
        for fm in ["x-axis: vertically", "y-axis: horizontally"]:
            case(f"flip_{src}_{fm[0]}", "flip", {"flip_method": fm}, [f"in_{src}"],
                 lambda src=src, fm=fm: image_node("ImageFlip", "flip", img[src], fm))
        for rot in ["none", "90 degrees", "180 degrees", "270 degrees"]:
            case(f"rotate_{src}_{rot.split()[0]}", "rotate", {"rotation": rot}, [f"in_{src}"],
                 lambda src=src, rot=rot: image_node("ImageRotate", "rotate", img[src], rot))

    # ---- ImageCompositeMasked -------------------------------------------
    img["cd"] = rand_image(131, (2, 8, 9, 3))     # destination, batch 2
    img["cd4"] = rand_image(132, (1, 7, 6, 4))    # RGBA destination
    img["ce"] = rand_image(133, (1, 6, 8, 3))     # destination, batch 1
    img["cs"] = rand_image(134, (1, 6, 5, 3))     # source, batch 1
    img["cs2"] = rand_image(135, (2, 4, 7, 3))    # source, batch 2
    img["cs4"] = rand_image(136, (1, 5, 4, 4))    # RGBA source
    masks = {
        "cm": rand_mask(141, (1, 4, 3), 0.7),      # smaller than the sources
        "cm2": rand_mask(142, (2, 8, 9), 0.6),     # batch 2, bigger
        "cm3": rand_mask(143, (3, 3, 5), 0.6),     # batch 3 (> destination's 2)
        "cm4": rand_mask(144, (1, 6, 5), 0.6),     # exactly cs's size
    }
    # (destination, source, mask, x, y, resize_source)
    comps = [
        ("cd", "cs", None, 0, 0, False),
        ("cd", "cs", None, 3, 2, False),
        ("cd", "cs", None, 6, 5, False),       # partly outside (3x3 visible)
        ("cd", "cs", None, 20, 3, False),      # wholly outside: unchanged
        ("cd", "cs", "cm", 3, 2, False),
        ("cd", "cs", "cm", 6, 5, False),
        ("cd", "cs", "cm", 0, 6, False),       # 2 rows visible
        ("cd", "cs", "cm4", 1, 1, False),      # mask already the source's size
        ("cd", "cs", None, 0, 0, True),
        ("cd", "cs", "cm", 0, 0, True),
        ("cd", "cs", "cm2", 4, 5, True),       # resized source then offset
        ("cd", "cs2", "cm2", 1, 1, False),
        ("cd", "cs2", "cm3", 6, 2, False),     # mask batch narrowed to 2
        ("ce", "cs2", "cm2", 2, 1, False),     # source batch narrowed to 1
        ("ce", "cs2", None, 5, 4, True),
        ("cd", "cs4", "cm", 2, 3, False),      # RGBA source: alpha dropped
        ("cd", "cs4", None, 0, 0, True),       # ... then resized
        ("cd4", "cs", None, 1, 1, False),      # RGB onto RGBA: ComfyUI raises
        ("cd4", "cs", "cm", 1, 1, False),
    ]
    for dst, src, m, x, y, resize in comps:
        inputs = [f"in_{dst}", f"in_{src}"] + ([f"in_{m}"] if m else [])
        name = f"composite_{dst}_{src}_{m or 'nomask'}_{x}_{y}" + ("_resize" if resize else "")
        case(name, "composite_masked", {"x": x, "y": y, "resize_source": resize}, inputs,
             lambda dst=dst, src=src, m=m, x=x, y=y, resize=resize: image_node(
                 "ImageCompositeMasked", "composite", img[dst], img[src], x, y, resize,
                 masks[m] if m else None))

    # ---- GrowMask -------------------------------------------------------
    masks["gm_a"] = rand_mask(151, (2, 9, 11), 0.25)   # sparse, fractional
    masks["gm_b"] = rand_image(152, (1, 6, 5, 1))[..., 0]  # dense, -0.1..1.1
    masks["gm_c"] = rand_mask(153, (1, 1, 7), 0.5)     # a single row
    grow = {"gm_a": [-2, -1, 0, 1, 3], "gm_b": [-2, -1, 0, 1, 3], "gm_c": [-1, 1]}
    for src, expands in grow.items():
        for expand in expands:
            for tapered in [True, False]:
                case(f"grow_mask_{src}_{expand}_{'tapered' if tapered else 'square'}", "grow_mask",
                     {"expand": expand, "tapered_corners": tapered}, [f"in_{src}"],
                     lambda src=src, expand=expand, tapered=tapered: image_node(
                         "GrowMask", "expand_mask", masks[src], expand, tapered))

    # ---- ThresholdMask --------------------------------------------------
    # Includes each threshold's own float32 value and its neighbours (torch
    # compares in float32: f32(0.3) > 0.3 is False), -0.0 and NaN.
    th = rand_image(161, (1, 4, 10, 1))[..., 0].numpy().copy()
    edge = []
    for v in [0.0, 0.3, 0.5, 0.77, 1.0]:
        f = np.float32(v)
        edge += [f, np.nextafter(f, np.float32(2)), np.nextafter(f, np.float32(-2))]
    edge += [np.float32(-0.0), np.float32("nan")]
    th.reshape(-1)[: len(edge)] = edge
    masks["th"] = torch.from_numpy(th)
    for value in [0.0, 0.3, 0.5, 0.77, 1.0]:
        case(f"threshold_mask_{value}", "threshold_mask", {"value": value}, ["in_th"],
             lambda value=value: image_node("ThresholdMask", "image_to_mask", masks["th"], value))

    for k, v in img.items():
        put(f"in_{k}", v)
    for k, v in masks.items():
        put(f"in_{k}", v)

    build_stitch()
    build_blend()
    build_resize_and_pad()
    build_masks()


def build_stitch():
    """ImageStitch cases, appended to imageops_extra.

    write() lays arrays out sorted by name, so these are all named
    stitch_*, which sorts after every earlier in_* / out_* array: the
    older arrays keep their offsets and data.bin only grows at the end.

    Outputs are stored as f32: where match_image_size resizes image2
    (always with lanczos, through Pillow), that part is k/255 (clipped to
    0..1 and quantised even when the size does not change: Pillow's
    same-size resize is a plain copy), but image1, the padding and the
    spacing keep their float values.
    """
    si = {
        "a": rand_image(171, (1, 5, 7, 3)),    # RGB
        "b": rand_image(172, (1, 3, 4, 3)),    # RGB, smaller, other aspect
        "c": rand_image(173, (2, 4, 6, 4)),    # RGBA, batch 2
        "d": rand_image(174, (1, 6, 3, 4)),    # RGBA, tall
        "e": rand_image(175, (2, 5, 4, 3)),    # RGB, batch 2, a's height
        "f": rand_image(176, (1, 4, 2, 3)),    # RGB, c's height
        "g": rand_image(177, (1, 3, 9, 4)),    # RGBA, width 9
        "h": rand_image(178, (1, 7, 9, 3)),    # RGB 9x7
        "k": rand_image(179, (1, 11, 2, 3)),   # RGB, height 11
        "l": rand_image(180, (1, 11, 15, 3)),  # RGB 15x11
        "w": rand_image(181, (1, 1, 9, 3)),    # RGB, one row
    }
    # (image1, image2, direction, match_image_size, spacing_width, spacing_color)
    # Without matching, the shorter side is padded centred (pad // 2 before,
    # the rest after) with 1.0 for white, 0.0 for black and for the tuple
    # colours -- on every channel, so a padded RGBA image's alpha is the pad
    # value too. Then the channel counts are evened out with ones, then the
    # spacing (odd widths rounded up to even) goes between.
    stitches = [
        ("a", "b", "right", False, 0, "white"),   # b padded 1 + 1 rows of 1.0
        ("a", "b", "down", False, 2, "black"),    # b padded 1 + 2 columns of 0
        ("a", "b", "left", False, 3, "red"),      # spacing 3 -> 4; pad 0 (tuple)
        ("a", "b", "up", False, 1, "green"),      # spacing 1 -> 2
        ("b", "a", "right", False, 2, "blue"),    # image1 is the padded one
        ("b", "a", "down", False, 0, "white"),
        # match_image_size: image2 -> lanczos to h1 x int(h1 * w2 / h2)
        # (left/right) or int(w1 / (w2 / h2)) x w1 (up/down).
        ("a", "b", "right", True, 0, "white"),    # 5 x int(6.67) = 6
        ("a", "b", "down", True, 2, "red"),       # int(5.25) = 5 x 7
        ("b", "a", "left", True, 3, "white"),     # 3 x int(4.2) = 4 (down)
        ("b", "a", "up", True, 0, "black"),       # int(2.857) = 2 x 4
        # RGB / RGBA and batch 1 / 2 mixes.
        ("a", "c", "right", False, 2, "white"),   # a repeated, alpha ones; c padded 0 + 1 rows of 1.0
        ("c", "a", "down", False, 2, "black"),    # c padded 0 + 1 columns of 0.0 (alpha 0 too)
        ("c", "a", "up", True, 3, "blue"),        # a (repeated) -> 6 x int(4.29) = 4, then alpha ones
        ("a", "c", "left", True, 2, "green"),     # RGBA image2 resized: 5 x int(7.5) = 7
        ("d", "c", "right", True, 2, "red"),      # d repeated; c upscaled to 6 x 9
        ("c", "d", "down", False, 3, "white"),    # d padded 1 + 2 columns of 1.0 (alpha too)
        ("e", "c", "left", False, 0, "green"),    # batch 2 both, RGB + RGBA
        ("d", "e", "up", False, 2, "black"),      # d repeated; widths 3 vs 4
        # Same size after matching: no resize, but still clipped and
        # quantised to k/255 (RGB, and RGBA with no premultiplication).
        ("a", "e", "right", True, 2, "black"),    # e: 5 x int(4.0) = 4
        ("f", "c", "left", True, 0, "white"),     # c: 4 x int(6.0) = 6
        # int() of an inexact float: 9 / (9 / 7) = 6.999999999999999 -> 6
        # rows (not 7), 11 * (15 / 11) = 14.999999999999998 -> 14 columns.
        ("g", "h", "down", True, 2, "blue"),
        ("k", "l", "right", True, 0, "red"),
        # int(4 / 9) = 0 rows: Pillow raises "height and width must be > 0".
        ("b", "w", "down", True, 0, "white"),
    ]
    used = set()
    for i1, i2, direction, match, spacing, color in stitches:
        name = (f"image_stitch_{i1}_{i2}_{direction}_{'match' if match else 'pad'}"
                f"_{spacing}_{color}")
        used.update([i1, i2])
        case(name, "image_stitch",
             {"direction": direction, "match_image_size": match, "spacing_width": spacing,
              "spacing_color": color},
             [f"stitch_in_{i1}", f"stitch_in_{i2}"],
             lambda i1=i1, i2=i2, direction=direction, match=match, spacing=spacing, color=color:
                 image_node("ImageStitch", "stitch", si[i1], direction, match, spacing, color,
                            si[i2]),
             out_name=f"stitch_out_{name}")
    # No image2: image1 comes back unchanged (not clipped, no spacing).
    case("image_stitch_a_only", "image_stitch",
         {"direction": "right", "match_image_size": True, "spacing_width": 2,
          "spacing_color": "red"},
         ["stitch_in_a"],
         lambda: image_node("ImageStitch", "stitch", si["a"], "right", True, 2, "red"),
         out_name="stitch_out_image_stitch_a_only")
    assert used == set(si), sorted(set(si) - used)
    for k, v in si.items():
        put(f"stitch_in_{k}", v)


def blend_image(seed, shape):
    """Deterministic float32 image in [0, 1) with about a third of the
    values replaced by ImageBlend's edge values: 0, 1, the `where`
    thresholds 0.25 and 0.5 and their float32 neighbours, and k/255."""
    rng = np.random.default_rng(seed)
    x = rng.random(shape, dtype=np.float32)
    q, h = np.float32(0.25), np.float32(0.5)
    special = [np.float32(0.0), np.float32(1.0), q, h,
               np.nextafter(q, np.float32(1)), np.nextafter(q, np.float32(0)),
               np.nextafter(h, np.float32(1)), np.nextafter(h, np.float32(0))]
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=max(len(special), flat.size // 3), replace=False)
    for j, p in enumerate(picks):
        flat[p] = (special + [np.float32(rng.integers(0, 256)) / np.float32(255.0)])[j % (len(special) + 1)]
    return torch.from_numpy(x)


def build_blend():
    """ImageBlend (class Blend) cases, appended to imageops_extra; arrays
    named zz_blend_* so that they sort after every earlier array.

    execute(): image_alpha_fix(image1, image2); if the shapes then differ
    (size, batch or channels) image2 goes through common_upscale(...,
    image1's width and height, "bicubic", "center"); then
    clamp(image1 * (1 - f) + mode(image1, image2) * f, 0, 1), all float32
    with the Python scalars rounded to float32 (1 - f is taken in double
    first: f32(1 - 0.09) = 0.91000003 but 1 - f32(0.09) = 0.90999997).
    """
    bi = {
        "a": blend_image(191, (1, 5, 6, 3)),    # RGB
        "b": blend_image(192, (1, 5, 6, 3)),    # RGB, a's size
        "c": blend_image(193, (1, 4, 3, 3)),    # RGB, smaller, other aspect (upscaled, cropped)
        "d": blend_image(194, (2, 4, 5, 3)),    # RGB, batch 2
        "e": blend_image(195, (2, 7, 6, 3)),    # RGB, batch 2, bigger (downscaled, cropped)
        "f": blend_image(196, (1, 5, 6, 4)),    # RGBA, a's size
        "g": blend_image(197, (1, 3, 4, 4)),    # RGBA, smaller
        "h": blend_image(198, (1, 4, 5, 3)),    # RGB, d's size, batch 1
        "k": blend_image(199, (3, 4, 5, 3)),    # RGB, d's size, batch 3
        "o": rand_image(200, (1, 5, 6, 3)),     # RGB, -0.1..1.1 (clamp)
        "p": rand_image(201, (1, 5, 6, 3)),     # RGB, -0.1..1.1
    }
    modes = ["normal", "multiply", "screen", "overlay", "soft_light", "difference"]
    # (image1, image2, blend modes, blend factors)
    blends = [
        # Same size: the thresholds reach the `where`s unchanged. 0.09 is
        # where f32(1 - f) differs from 1 - f32(f).
        ("a", "b", modes, [0.0, 0.09, 0.37, 1.0]),
        ("b", "a", ["overlay", "soft_light"], [0.37]),
        # image2 bicubic-upscaled 3x4 -> 6x5 with a centre crop (of width).
        ("a", "c", modes, [0.37, 1.0]),
        # Batch 2 both; image2 bicubic-downscaled 6x7 -> 5x4, centre crop.
        ("d", "e", modes, [0.37]),
        # RGB image1, RGBA image2: image2's alpha is dropped (same size:
        # no resize; other size: the sliced RGB view is resized).
        ("a", "f", ["overlay", "soft_light"], [0.37]),
        ("a", "g", ["soft_light", "difference"], [0.37]),
        # RGBA both: alpha is blended like the colours (image2 upscaled).
        ("g", "f", ["normal", "screen"], [0.5]),
        # RGBA image1, RGB image2: image_alpha_fix pads *image1* with a
        # fifth channel of ones (not image2 with alpha), so the 5 vs 3
        # channels do not broadcast: ComfyUI raises.
        ("f", "a", ["normal"], [0.5]),
        # Batch 2 vs 1 in either order: the shapes differ, so image2 is
        # "resized" to its own size (bicubic at scale 1 is exact), then
        # broadcast; batch 2 vs 3 raises.
        ("d", "h", ["soft_light"], [0.37]),
        ("h", "d", ["overlay"], [0.37]),
        ("d", "k", ["normal"], [0.37]),
        # Values outside 0..1: clamp, and g() on negatives / above 1.
        ("o", "p", modes, [0.37]),
    ]
    used = set()
    for i1, i2, bmodes, factors in blends:
        used.update([i1, i2])
        for mode in bmodes:
            for factor in factors:
                name = f"image_blend_{i1}_{i2}_{mode}_{factor!r}"
                case(name, "image_blend", {"blend_factor": factor, "blend_mode": mode},
                     [f"zz_blend_in_{i1}", f"zz_blend_in_{i2}"],
                     lambda i1=i1, i2=i2, mode=mode, factor=factor:
                         NS["Blend"].execute(bi[i1], bi[i2], factor, mode)[0],
                     out_name=f"zz_blend_out_{name}")
    assert used == set(bi), sorted(set(bi) - used)
    for k, v in bi.items():
        put(f"zz_blend_in_{k}", v)


def build_resize_and_pad():
    """ResizeAndPadImage cases, appended to imageops_extra; arrays named
    zz_pad_* so that they sort after every earlier array.

    scale = min(tw / w, th / h) in double; the image is resized with
    common_upscale(..., int(w * scale), int(h * scale), interpolation,
    "disabled") and pasted at ((tw - nw) // 2, (th - nh) // 2) into a
    canvas of 1.0 (white) or 0.0 (black) on every channel, alpha too.

    Lanczos outputs are stored as u8 like the other lanczos cases: the
    resized part is k/255 (through Pillow) and the padding 0 or 1, so the
    whole output is k/255 (checked below).
    """
    pi = {
        "a": rand_image(211, (1, 4, 6, 3)),    # 6x4 RGB
        "b": rand_image(212, (2, 6, 4, 3)),    # 4x6 RGB, batch 2
        "c": rand_image(213, (1, 11, 5, 3)),   # 5x11
        "d": rand_image(214, (1, 4, 13, 3)),   # 13x4
        "e": rand_image(215, (1, 4, 5, 4)),    # 5x4 RGBA
        "f": rand_image(216, (1, 2, 9, 3)),    # 9x2
    }
    # (image, target_width, target_height) -> resized to nw x nh at (x, y)
    geometries = [
        ("a", 8, 8),    # up 4/3: 8 x int(5.33) = 5, at (0, 1): 1 row above, 2 below
        ("a", 3, 5),    # down 1/2: 3x2 at (0, 1)
        ("a", 9, 6),    # exact fit, up 1.5
        ("a", 3, 2),    # exact fit, down 1/2
        ("a", 6, 4),    # same size: scale 1
        ("b", 7, 7),    # up 7/6: int(4.67) = 4 x 7 at (1, 0): 1 column left, 2 right
        ("b", 5, 3),    # down 1/2: 2x3 at (1, 0)
        # int() truncation: 11 * (15 / 11) = 14.999999999999998 -> 14 rows
        # in a 15-row target (the last row padding); 13 * (15 / 13) likewise
        # -> 14 columns of 15.
        ("c", 8, 15),   # 6x14 at (1, 0)
        ("d", 15, 7),   # 14x4 at (0, 1)
        ("e", 7, 7),    # RGBA up 1.4: 7 x int(5.6) = 5 at (0, 1)
        ("e", 3, 4),    # RGBA down 0.6: 3 x int(2.4) = 2 at (0, 1)
        # int(2 / 3) = 0 rows: F.interpolate and Pillow raise; area
        # (adaptive_avg_pool2d) returns an empty tensor: all padding.
        ("f", 3, 3),
    ]
    methods = ["area", "bicubic", "nearest-exact", "bilinear", "lanczos"]
    used = set()
    for gi, (src, tw, th) in enumerate(geometries):
        used.add(src)
        for mi, method in enumerate(methods):
            # Both colours for every geometry and for every method.
            color = ["white", "black"][(gi + mi) % 2]
            name = f"resize_and_pad_{src}_{tw}x{th}_{method}_{color}"
            out_dtype = "u8" if method == "lanczos" else "f32"

            def compute(src=src, tw=tw, th=th, method=method, color=color, out_dtype=out_dtype):
                out = image_node("ResizeAndPadImage", "resize_and_pad", pi[src], tw, th, color,
                                 method)
                if out_dtype == "f32":
                    return out
                # lanczos output is always k/255; store the byte.
                u8 = (out * 255.0).round().to(torch.uint8)
                assert torch.equal(u8.to(torch.float32) / 255.0, out), name
                return u8

            case(name, "resize_and_pad",
                 {"target_width": tw, "target_height": th, "padding_color": color,
                  "interpolation": method},
                 [f"zz_pad_in_{src}"], compute, out_dtype, out_name=f"zz_pad_out_{name}")
    assert used == set(pi), sorted(set(pi) - used)
    for k, v in pi.items():
        put(f"zz_pad_in_{k}", v)


def edge_mask(seed, shape, wide=False):
    """Deterministic float32 mask in [0, 1) with about a third of the
    values replaced by MaskComposite's edge values: 0, 1, 0.5 (round half
    to even -> 0) and its float32 neighbours, 1.5 (-> 2) and, when wide,
    values outside 0..1 (-0.4, -0.6, 1.3) that the final clamp hits."""
    rng = np.random.default_rng(seed)
    x = rng.random(shape, dtype=np.float32)
    h = np.float32(0.5)
    special = [np.float32(0.0), np.float32(1.0), h,
               np.nextafter(h, np.float32(1)), np.nextafter(h, np.float32(0))]
    if wide:
        special += [np.float32(1.5), np.float32(-0.4), np.float32(-0.6), np.float32(1.3)]
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=max(len(special), flat.size // 3), replace=False)
    for j, p in enumerate(picks):
        flat[p] = special[j % len(special)]
    return torch.from_numpy(x)


def build_masks():
    """FeatherMask, MaskComposite and CropMask cases, appended to
    imageops_extra; arrays named zzz_mask_* so that they sort after every
    earlier array.

    FeatherMask.feather: left/right clamped to w, top/bottom to h; then in
    place, in this order, column x (x < left) *= (x + 1) / left, column -x
    (x < right; x = 0 is column 0, not the last one) *= (x + 1) / right,
    row y *= (y + 1) / top, row -y *= (y + 1) / bottom; each factor a
    double rounded to float32, each product rounded to float32.

    MaskComposite.combine: right = min(x + sw, dw), bottom likewise; the
    source's top-left (right - x) x (bottom - y) is combined with the
    destination there (float32 * + -, or round() half-to-even -> bool ->
    bitwise and/or/xor -> 0.0/1.0), broadcasting batches, then the whole
    output is clamped to 0..1.

    CropMask.crop: mask[:, y:y + height, x:x + width] (Python slicing:
    runs past the edge are cut short, a start at or past it is empty).
    """
    mi = {
        "f": rand_mask(221, (2, 6, 8), 0.8),          # feather / crop, batch 2
        "a": edge_mask(222, (1, 6, 7)),               # destination, batch 1
        "b": edge_mask(223, (2, 4, 5), wide=True),    # source, batch 2
        "c": edge_mask(224, (1, 4, 5), wide=True),    # source, batch 1
        "d": edge_mask(225, (2, 5, 6), wide=True),    # destination, batch 2, outside 0..1
        "e": edge_mask(226, (1, 8, 9)),               # source bigger than every destination
    }
    used = set()

    # ---- FeatherMask on a 6x8 mask, batch 2 ----------------------------
    feathers = [
        (0, 0, 0, 0), (3, 0, 0, 0), (0, 2, 0, 0), (0, 0, 3, 0), (0, 0, 0, 4),
        (1, 1, 1, 1), (2, 3, 4, 2),
        (5, 0, 6, 0),       # > half the width: the ramps overlap
        (0, 4, 0, 5),       # > half the height
        (6, 5, 7, 4),       # all four overlap
        (20, 9, 8, 6),      # clamped to the width / height (8 = w, 6 = h)
    ]
    used.add("f")
    for left, top, right, bottom in feathers:
        name = f"feather_mask_f_{left}_{top}_{right}_{bottom}"
        case(name, "feather_mask", {"left": left, "top": top, "right": right, "bottom": bottom},
             ["zzz_mask_in_f"],
             lambda l=left, t=top, r=right, b=bottom:
                 image_node("FeatherMask", "feather", mi["f"], l, t, r, b),
             out_name=f"zzz_mask_out_{name}")

    # Cross-check the feather semantics documented above (float32 factors).
    src = mi["f"].numpy()
    for left, top, right, bottom in feathers:
        o = src.copy()
        w, h = o.shape[-1], o.shape[-2]
        l, r, t, b = min(left, w), min(right, w), min(top, h), min(bottom, h)
        for x in range(l):
            o[:, :, x] *= np.float32((x + 1.0) / l)
        for x in range(r):
            o[:, :, -x] *= np.float32((x + 1) / r)
        for y in range(t):
            o[:, y, :] *= np.float32((y + 1) / t)
        for y in range(b):
            o[:, -y, :] *= np.float32((y + 1) / b)
        got = image_node("FeatherMask", "feather", mi["f"], left, top, right, bottom).numpy()
        assert np.array_equal(o, got), (left, top, right, bottom)

    # ---- MaskComposite -------------------------------------------------
    ops = ["multiply", "add", "subtract", "and", "or", "xor"]
    composites = [
        ("a", "c", 0, 0),   # top-left, inside
        ("a", "c", 1, 2),   # inside, touches the bottom edge
        ("a", "c", 4, 3),   # partly outside right and bottom (3x3 visible)
        ("a", "c", 7, 0),   # x == width: nothing visible, only the clamp
        ("a", "c", 0, 6),   # y == height: likewise
        ("a", "c", 8, 1),   # x > width: negative visible width, ComfyUI raises
        ("d", "b", 2, 3),   # batch 2 both, partly outside
        ("d", "c", 3, 1),   # batch 2 destination, batch 1 source (broadcast)
        ("a", "b", 1, 1),   # batch 1 destination, batch 2 source: raises
        ("a", "e", 0, 0),   # source bigger than the destination
        ("d", "e", 2, 1),   # bigger source, offset
    ]
    for dst, srck, x, y in composites:
        used.update([dst, srck])
        for op in ops:
            name = f"mask_composite_{dst}_{srck}_{x}_{y}_{op}"
            case(name, "mask_composite", {"x": x, "y": y, "operation": op},
                 [f"zzz_mask_in_{dst}", f"zzz_mask_in_{srck}"],
                 lambda dst=dst, srck=srck, x=x, y=y, op=op:
                     image_node("MaskComposite", "combine", mi[dst], mi[srck], x, y, op),
                 out_name=f"zzz_mask_out_{name}")

    # ---- CropMask ------------------------------------------------------
    crops = [
        ("f", 0, 0, 8, 6),      # whole mask
        ("f", 0, 0, 1, 1),
        ("f", 2, 1, 3, 4),      # inside
        ("f", 7, 5, 1, 1),      # last pixel
        ("f", 5, 3, 10, 10),    # runs past the right and bottom edges
        ("f", 0, 0, 512, 512),  # the node's defaults
        ("f", 8, 0, 2, 2),      # x == width: empty [2, 2, 0]
        ("f", 3, 6, 2, 2),      # y == height: empty [2, 0, 2]
        ("a", 4, 2, 5, 9),      # batch 1, past both edges
    ]
    for srck, x, y, w, h in crops:
        used.add(srck)
        name = f"crop_mask_{srck}_{x}_{y}_{w}x{h}"
        case(name, "crop_mask", {"x": x, "y": y, "width": w, "height": h},
             [f"zzz_mask_in_{srck}"],
             lambda srck=srck, x=x, y=y, w=w, h=h:
                 image_node("CropMask", "crop", mi[srck], x, y, w, h),
             out_name=f"zzz_mask_out_{name}")

    assert used == set(mi), sorted(set(mi) - used)
    for k, v in mi.items():
        put(f"zzz_mask_in_{k}", v)


def write(set_name, extra_versions=None):
    """index.json + data.bin (all arrays back to back, little-endian)."""
    OUT = FIXTURES / set_name
    ARRAYS, CASES = SETS[set_name]
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.bin"):
        old.unlink()
    blob = bytearray()
    arrays = {}
    for name, (array, dtype) in sorted(ARRAYS.items()):
        arrays[name] = {"offset": len(blob), "shape": list(array.shape), "dtype": dtype}
        blob += array.tobytes()
    (OUT / "data.bin").write_bytes(bytes(blob))
    header = {
        "generator": "tools/reference/image_ops.py",
        "versions": {
            "torch": torch.__version__,
            "numpy": np.__version__,
            "pillow": Image.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **(extra_versions or {}),
        },
    }
    # One array / case per line keeps the index small and diffable.
    lines = ["{", f' "header": {json.dumps(header, sort_keys=True)},', ' "arrays": {']
    items = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in arrays.items()]
    lines.append(",\n".join(items))
    lines += [" },", ' "cases": [']
    lines.append(",\n".join(f"  {json.dumps(c, sort_keys=True)}" for c in CASES))
    lines += [" ]", "}"]
    text = "\n".join(lines) + "\n"
    json.loads(text)  # sanity
    (OUT / "index.json").write_text(text)
    total = len(blob) + len(text)
    print(f"{len(CASES)} cases, {len(ARRAYS)} arrays, {total / 1024:.1f} KiB in {OUT}")


def _latent_ops():
    """latent_ops.py, sharing this module's state (when run as a script,
    this module is `__main__`: registered as `image_ops` first, so the
    import does not load a second copy with its own fixture sets)."""
    sys.modules.setdefault("image_ops", sys.modules[__name__])
    import latent_ops
    return latent_ops


def comfy_version():
    path = COMFY / "comfyui_version.py"
    if not path.exists():
        return "unknown"
    ns = {}
    exec(path.read_text(), ns)
    return ns.get("__version__", "unknown")


# folder under nodes/tests/fixtures -> (builder, extra header versions)
BUILDERS = {
    "imageops": (build, lambda: None),
    "imageops_extra": (build_extra, lambda: {"scipy": scipy.__version__, "comfyui": comfy_version()}),
    "latentops": (lambda: _latent_ops().build_latentops(), lambda: {"comfyui": comfy_version()}),
}


if __name__ == "__main__":
    names = sys.argv[1:] or list(BUILDERS)
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        sys.exit(f"unknown fixture set(s) {unknown}; known: {sorted(BUILDERS)}")
    for set_name in names:
        builder, versions = BUILDERS[set_name]
        use_set(set_name)
        builder()
        write(set_name, versions())
