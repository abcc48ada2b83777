"""The `latentops` fixture set of image_ops.py (run through it:
`image_ops.py latentops`): ComfyUI's LATENT-dict nodes and a few more
simple image/mask/batch nodes, with the case format image_ops.py's
docstring describes. Split out of image_ops.py for length; it uses that
module's helpers and fixture state (image_ops.py registers itself as
`image_ops` before importing this, so both see one copy).
"""
from image_ops import *  # noqa: F401,F403 (the shared helpers and imports)
from image_ops import _lift  # noqa: F401

# ---------------------------------------------------------------------------
# latentops: LATENT-dict nodes and a few more simple image/mask nodes
# ---------------------------------------------------------------------------

def _content_key(array, dtype):
    return (dtype, tuple(array.shape), array.tobytes())


def put_dedup(name, array, dtype="f32"):
    """put(), except that an array equal (dtype, shape, bytes) to one
    already registered is not stored again: its existing name is returned."""
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().contiguous().numpy()
    np_dtype = {"f32": "<f4", "u8": "u1"}[dtype]
    array = np.ascontiguousarray(array).astype(np_dtype, copy=False)
    key = _content_key(array, dtype)
    for old, (a, d) in ARRAYS.items():
        if _content_key(a, d) == key:
            return old
    return put(name, array, dtype)


def latent_ref(prefix, latent):
    """Encode a LATENT dict: {"samples": array, "noise_mask": array
    (only if present), "batch_index": [int, ...] (only if present)}."""
    extra = set(latent) - {"samples", "noise_mask", "batch_index"}
    assert not extra, extra
    out = {"samples": put_dedup(f"{prefix}_samples", latent["samples"])}
    if "noise_mask" in latent:
        out["noise_mask"] = put_dedup(f"{prefix}_noise_mask", latent["noise_mask"])
    if "batch_index" in latent:
        out["batch_index"] = [int(i) for i in latent["batch_index"]]
    return out


def node_case(name, op, node, params, inputs, compute, kind):
    """Like case(), for node-level cases whose output may be a LATENT
    dict (kind "LATENT": output is an object, see latent_ref) or an
    IMAGE/MASK tensor (kind "IMAGE"/"MASK"/"IMAGE_U8": output is an array
    name). Outputs equal to an existing array reuse its name."""
    entry = {"name": name, "op": op, "node": node, "params": params, "inputs": inputs,
             "output_type": "IMAGE" if kind == "IMAGE_U8" else kind}
    try:
        result = compute()
    except Exception as exc:  # ComfyUI/torch rejects these arguments
        entry["error"] = f"{type(exc).__name__}: {exc}"
    else:
        if kind == "LATENT":
            entry["output"] = latent_ref(f"out_{name}", result)
        else:
            entry["output"] = put_dedup(f"out_{name}", result, "u8" if kind == "IMAGE_U8" else "f32")
    CASES.append(entry)


def build_latentops():
    """LatentComposite, LatentBlend, LatentFromBatch, RepeatLatentBatch,
    LatentCrop, LatentFlip, LatentRotate, LatentCompositeMasked,
    ImageColorToMask, RepeatImageBatch, ImageFromBatch and
    ImageScaleToMaxDimension, run as ComfyUI's own node classes.

    Behaviour the cases pin down (ComfyUI 0.3.64):
    * Every LATENT node starts from `samples.copy()` of its first LATENT
      input, so noise_mask / batch_index pass through untouched unless the
      node rewrites them: LatentFlip, LatentRotate and LatentCrop leave the
      noise_mask unflipped / uncropped; LatentComposite(Masked) and
      LatentBlend keep the destination's / samples1's keys and ignore the
      other latent's.
    * LatentComposite: x, y, feather are pixels, each `// 8` (no clamp).
      No feather: s[:, :, y:y+fh, x:x+fw] = from[:, :, :H-y, :W-x];
      past the bottom/right edge H-y < 0 is a negative (from-the-end)
      slice, so the shapes mismatch and torch raises unless that leaves
      0 or 1 rows / columns (a size-1 dim broadcasts onto the empty
      target: nothing changes). A batch-1 source broadcasts over the destination's batch;
      a bigger batch or other channel count raises. Feather: a mask of
      ones over the clipped source; for t in range(feather): row t (if
      y != 0), row rows-1-t (if the source ends above the bottom edge),
      column t (if x != 0), column cols-1-t (if it ends left of the right
      edge) *= (1/feather) * (t + 1). The slices are Python slices, so
      when feather > rows the "rows-1-t" slice goes negative and wraps
      (2 rows, feather 5: t = 3 multiplies row 0 by 0.8 again); then
      out = from * mask + to * (1 - mask).
    * LatentCompositeMasked (nodes_mask.composite, multiplier 8): x, y
      clamped to [-src*8, dst*8] pixels then `// 8`; resize_source:
      bilinear to the destination's size; source batch fitted with
      repeat_to_batch_size; the mask reshaped to [-1, 1, h, w], bilinear
      to the source's size, batch fitted likewise.
    * LatentBlend: samples2 of another shape (size or batch) goes through
      common_upscale(.., 'bicubic', crop='center') to samples1's h, w,
      then broadcasts (batch 1 vs n works, 2 vs 3 raises); out =
      s1 * f + s2 * (1 - f).
    * LatentFromBatch: batch_index = min(b - 1, batch_index), length =
      min(b - batch_index, length). noise_mask of batch 1 is kept whole;
      otherwise, if shorter than b, it is tiled up to b first, then
      sliced like the samples. batch_index: if the input has none it
      becomes list(range(batch_index, batch_index + length)); if it has
      one it is sliced (Python slice: a list shorter than the batch can
      come out short or empty).
    * RepeatLatentBatch: samples tiled `amount` times (whole batch
      repeated, not each item). noise_mask of batch > 1 is tiled `amount`
      times as it is (the tiling-to-b it computes is unused, so a batch-2
      mask on a batch-3 latent comes out 2 * amount); batch 1 is kept.
      batch_index (only if present): offset = max - min + 1, list +
      [x + i * offset for i in 1..amount for x in list].
    * LatentCrop: x, y, width, height // 8; x clamped to w - 8, y to
      h - 8 (negative for latents under 8: a from-the-end slice); then
      samples[:, :, y:y+height, x:x+width] (runs past the edge are cut).
    * ImageColorToMask: (clamp(image, 0, 1) * 255).round() (half to even)
      to int, (r << 16) + (g << 8) + b == color -> 1.0; alpha ignored; a
      1-channel image raises.
    * ImageScaleToMaxDimension: the longer side becomes largest_size, the
      other round(other / longer * largest_size) (Python round, half to
      even); square: both; common_upscale(.., "disabled"). A zero side
      raises (area returns an empty image).
    """
    _lift(NS, "nodes.py", ["LatentComposite", "LatentBlend", "LatentFromBatch",
                           "RepeatLatentBatch", "LatentCrop", "LatentFlip", "LatentRotate"])
    _lift(NS, "comfy_extras/nodes_mask.py", ["LatentCompositeMasked", "ImageColorToMask"])
    _lift(NS, "comfy_extras/nodes_images.py", ["RepeatImageBatch", "ImageFromBatch",
                                               "ImageScaleToMaxDimension"])

    # ---- inputs ----------------------------------------------------------
    # Latent samples [b, c, h, w].
    S = {
        "t1": rand_latent(301, (1, 4, 6, 8)),     # composite destinations
        "t2": rand_latent(302, (2, 4, 6, 8)),
        "f1": rand_latent(303, (1, 4, 3, 4)),     # composite sources
        "f2": rand_latent(304, (2, 4, 4, 5)),
        "f3": rand_latent(305, (3, 4, 3, 4)),
        "fb": rand_latent(306, (1, 4, 8, 10)),    # bigger than t1/t2
        "fr": rand_latent(307, (1, 4, 2, 3)),     # 2 rows: feather wraps
        "c16": rand_latent(308, (1, 16, 3, 4)),   # other channel count
        "b1": rand_latent(311, (1, 4, 3, 5)),     # batch nodes
        "b2": rand_latent(312, (2, 4, 3, 5)),
        "b3": rand_latent(313, (3, 4, 3, 5)),
        "b4": rand_latent(314, (4, 4, 2, 3)),
        "k1": rand_latent(321, (1, 4, 10, 12)),   # crop
        "k2": rand_latent(322, (2, 4, 9, 9)),
        "k3": rand_latent(323, (1, 4, 5, 6)),     # smaller than 8: x = w - 8 < 0
        "g1": rand_latent(331, (1, 4, 3, 5)),     # flip / rotate, odd sizes
        "g2": rand_latent(332, (2, 4, 4, 3)),
        "l1": rand_latent(341, (1, 4, 4, 6)),     # blend
        "l2": rand_latent(342, (1, 4, 4, 6)),
        "l3": rand_latent(343, (2, 4, 4, 6)),
        "l4": rand_latent(344, (1, 4, 3, 5)),     # other size: bicubic, center crop
        "l5": rand_latent(345, (3, 4, 4, 6)),
        "l6": rand_latent(346, (1, 4, 6, 5)),     # taller: crop the other way
    }
    # noise_mask values ([b, 1, h, w] as SetLatentNoiseMask makes them;
    # some at the latent's size, some at 8x, some other).
    NM = {
        "n1": rand_mask(351, (1, 1, 3, 5), 0.7),
        "n2": rand_mask(352, (2, 1, 3, 5), 0.7),
        "n3": rand_mask(353, (3, 1, 3, 5), 0.7),
        "n4": rand_mask(354, (4, 1, 2, 3), 0.7),
        "np": rand_mask(355, (1, 1, 24, 40), 0.7),   # pixel size of b*
        "nt": rand_mask(356, (2, 1, 6, 8), 0.7),     # t2's size
        "ng": rand_mask(357, (1, 1, 3, 5), 0.7),     # g1's size
        "nm": rand_mask(358, (2, 1, 5, 7), 0.7),     # odd size
    }
    # MASK inputs [b, h, w].
    MK = {
        "m34": rand_mask(361, (1, 3, 4), 0.7),      # f1's size
        "mpx": rand_mask(362, (1, 24, 32), 0.7),    # f1's pixel size
        "mb2": rand_mask(363, (2, 5, 7), 0.7),      # batch 2, other size
        "mb3": rand_mask(364, (3, 3, 4), 0.7),      # batch 3
        "m1": rand_mask(365, (1, 1, 1), 1.0),       # single pixel
    }
    for k, v in S.items():
        put(f"lat_{k}", v)
    for k, v in NM.items():
        put(f"nmask_{k}", v)
    for k, v in MK.items():
        put(f"mask_{k}", v)

    def L(samples, noise_mask=None, batch_index=None):
        """(python LATENT dict, JSON encoding of it)."""
        d = {"samples": S[samples]}
        j = {"samples": f"lat_{samples}"}
        if noise_mask is not None:
            d["noise_mask"] = NM[noise_mask]
            j["noise_mask"] = f"nmask_{noise_mask}"
        if batch_index is not None:
            d["batch_index"] = list(batch_index)
            j["batch_index"] = list(batch_index)
        return d, j

    def node(cls, method, *args):
        return getattr(NS[cls](), method)(*args)[0]

    def fresh(d):
        """A shallow copy, as ComfyUI hands each node its own dict (the
        nodes copy() it anyway); batch_index lists copied too."""
        d = dict(d)
        if "batch_index" in d:
            d["batch_index"] = list(d["batch_index"])
        return d

    def lat_name(j):
        s = j["samples"][4:]
        if "noise_mask" in j:
            s += "_" + j["noise_mask"][6:]
        if "batch_index" in j:
            s += "_bi" + "-".join(map(str, j["batch_index"]))
        return s

    counts = {}

    def add(name, op, nodecls, params, inputs, compute, kind="LATENT"):
        counts[nodecls] = counts.get(nodecls, 0) + 1
        node_case(name, op, nodecls, params, inputs, compute, kind)

    # ---- LatentComposite ---------------------------------------------------
    # x, y, feather in pixels, each // 8; no clamping. samples_to's dict
    # (noise_mask, batch_index) passes through.
    comp_pairs = [
        (L("t1"), L("f1")), (L("t2"), L("f1")), (L("t2"), L("f2")), (L("t1"), L("f2")),
        (L("t2"), L("f3")), (L("t1"), L("fb")), (L("t1"), L("fr")),
        (L("t2", "nt", [4, 7]), L("f1", "n1", [9])), (L("t1"), L("c16")),
    ]
    comp_xy = [(0, 0), (8, 8), (16, 24), (12, 20), (40, 24), (56, 40), (64, 0), (0, 48),
               (72, 8), (8, 56), (32, 40), (100, 100)]
    feathers = [0, 8, 16, 40]
    for (dt, jt), (df, jf) in comp_pairs:
        for x, y in comp_xy:
            for feather in feathers:
                # Fewer combinations for the other-channel / batch-3 pairs.
                # (Every one of them raises: batch 2 or 3 into batch 1 or 2,
                # 16 channels into 4.)
                if ((jf["samples"] in ("lat_c16", "lat_f3")
                     or (jt["samples"], jf["samples"]) == ("lat_t1", "lat_f2"))
                        and (x, y) not in [(0, 0), (16, 24)]):
                    continue
                if feather == 40 and jf["samples"] not in ("lat_fr", "lat_f1", "lat_fb"):
                    continue
                name = f"latent_composite_{lat_name(jt)}_{lat_name(jf)}_{x}_{y}_f{feather}"
                add(name, "latent_composite", "LatentComposite",
                    {"x": x, "y": y, "feather": feather}, [jt, jf],
                    lambda dt=dt, df=df, x=x, y=y, feather=feather: node(
                        "LatentComposite", "composite", fresh(dt), fresh(df), x, y, "normal",
                        feather))
    # Feather values that are not multiples of 8 (// 8).
    for feather in [4, 12, 24, 800]:
        (dt, jt), (df, jf) = L("t1"), L("f1")
        name = f"latent_composite_t1_f1_16_16_f{feather}"
        add(name, "latent_composite", "LatentComposite", {"x": 16, "y": 16, "feather": feather},
            [jt, jf], lambda dt=dt, df=df, feather=feather: node(
                "LatentComposite", "composite", fresh(dt), fresh(df), 16, 16, "normal", feather))

    # ---- LatentBlend -------------------------------------------------------
    blends = [
        (L("l1"), L("l2"), [0.0, 0.09, 0.37, 0.5, 1.0]),
        (L("l1", "ng", [2]), L("l2", "n1", [5]), [0.5]),   # samples1's dict passes through
        (L("l1"), L("l4"), [0.0, 0.37, 1.0]),              # bicubic upscale, center crop
        (L("l4"), L("l1"), [0.37]),                        # downscale
        (L("l1"), L("l6"), [0.37]),                        # taller source: crop rows
        (L("l3"), L("l1"), [0.37]),                        # batch 2 vs 1: broadcast
        (L("l1"), L("l3"), [0.37]),                        # batch 1 vs 2: broadcast
        (L("l3"), L("l5"), [0.37]),                        # batch 2 vs 3: raises
        (L("l3"), L("l3"), [0.25]),
        (L("l1"), L("c16"), [0.5]),                        # other channels: raises
    ]
    for (d1, j1), (d2, j2), factors in blends:
        for factor in factors:
            name = f"latent_blend_{lat_name(j1)}_{lat_name(j2)}_{factor!r}"
            add(name, "latent_blend", "LatentBlend",
                {"blend_factor": factor, "blend_mode": "normal"}, [j1, j2],
                lambda d1=d1, d2=d2, factor=factor: node(
                    "LatentBlend", "blend", fresh(d1), fresh(d2), factor, "normal"))

    # ---- LatentFromBatch / RepeatLatentBatch -------------------------------
    batch_lats = [
        L("b1"), L("b2"), L("b3"), L("b4"),
        L("b1", "n1"), L("b1", "np"),
        L("b2", "n2"), L("b2", "n1"),
        L("b3", "n3"), L("b3", "n2"),          # mask batch 2 < 3: repeated first
        L("b3", "n4"),                         # mask batch 4 > 3
        L("b4", "n3"),
        L("b3", None, [0, 1, 2]), L("b3", None, [5, 2, 9]), L("b2", None, [3, 4]),
        L("b1", None, [7]), L("b3", None, [1, 2]),   # batch_index shorter than the batch
        L("b3", "n2", [4, 6, 8]), L("b2", "n2", [0, 1]),
    ]
    from_batch = [(0, 1), (0, 2), (0, 3), (0, 64), (1, 1), (1, 2), (1, 5), (2, 1), (2, 2),
                  (3, 1), (5, 2), (63, 64)]
    for dl, jl in batch_lats:
        for bi, length in from_batch:
            name = f"latent_from_batch_{lat_name(jl)}_{bi}_{length}"
            add(name, "latent_from_batch", "LatentFromBatch",
                {"batch_index": bi, "length": length}, [jl],
                lambda dl=dl, bi=bi, length=length: node(
                    "LatentFromBatch", "frombatch", fresh(dl), bi, length))
        for amount in [1, 2, 3]:
            name = f"repeat_latent_batch_{lat_name(jl)}_{amount}"
            add(name, "repeat_latent_batch", "RepeatLatentBatch", {"amount": amount}, [jl],
                lambda dl=dl, amount=amount: node("RepeatLatentBatch", "repeat", fresh(dl), amount))

    # ---- LatentCrop ----------------------------------------------------------
    crop_lats = [L("k1"), L("k2"), L("k3"), L("k1", "np", [3])]
    crops = [(64, 64, 0, 0), (64, 64, 8, 16), (72, 64, 16, 8), (96, 80, 0, 0), (64, 72, 24, 16),
             (128, 128, 0, 0), (200, 100, 12, 20), (64, 64, 32, 16), (64, 64, 1000, 1000),
             (64, 64, 40, 0), (80, 64, 40, 24), (64, 64, 7, 15)]
    for dl, jl in crop_lats:
        for w, h, x, y in crops:
            if jl.get("noise_mask") and (w, h, x, y) not in crops[:3]:
                continue
            # k3 is 5x6: x, y always clamp to w - 8 = -2, h - 8 = -3, so
            # every crop is the same last 3 rows x 2 columns.
            if jl["samples"] == "lat_k3" and (w, h, x, y) not in crops[:2] + crops[8:9]:
                continue
            name = f"latent_crop_{lat_name(jl)}_{w}x{h}_at_{x}_{y}"
            add(name, "latent_crop", "LatentCrop", {"width": w, "height": h, "x": x, "y": y},
                [jl], lambda dl=dl, w=w, h=h, x=x, y=y: node(
                    "LatentCrop", "crop", fresh(dl), w, h, x, y))

    # ---- LatentFlip / LatentRotate -----------------------------------------
    for dl, jl in [L("g1"), L("g2"), L("g1", "ng", [1])]:
        for fm in ["x-axis: vertically", "y-axis: horizontally"]:
            add(f"latent_flip_{lat_name(jl)}_{fm[0]}", "latent_flip", "LatentFlip",
                {"flip_method": fm}, [jl],
                lambda dl=dl, fm=fm: node("LatentFlip", "flip", fresh(dl), fm))
        for rot in ["none", "90 degrees", "180 degrees", "270 degrees"]:
            add(f"latent_rotate_{lat_name(jl)}_{rot.split()[0]}", "latent_rotate", "LatentRotate",
                {"rotation": rot}, [jl],
                lambda dl=dl, rot=rot: node("LatentRotate", "rotate", fresh(dl), rot))

    # ---- LatentCompositeMasked -----------------------------------------------
    # (destination, source, masks); x, y in pixels.
    cm_pairs = [
        (L("t1"), L("f1"), [None, "m34", "mpx", "mb2", "m1"]),
        (L("t2"), L("f1"), [None, "m34", "mb2", "mb3"]),
        (L("t2"), L("f2"), [None, "mb2", "mb3"]),
        (L("t1"), L("f2"), [None, "mb2"]),          # source batch narrowed to 1
        (L("t2"), L("f3"), [None, "m34"]),
        (L("t1"), L("fb"), [None, "mpx"]),          # bigger source
        (L("t2", "nt", [4, 7]), L("f1", "n1", [9]), [None, "m34"]),
        (L("t1"), L("c16"), [None]),                # other channels: raises
    ]
    cm_xy = [(0, 0), (8, 8), (12, 20), (16, 24), (40, 24), (56, 40), (64, 48), (72, 0),
             (200, 200), (7, 9)]
    for (dd, jd), (ds, js), mks in cm_pairs:
        for m in mks:
            for resize in [False, True]:
                for x, y in cm_xy:
                    if resize and (x, y) not in [(0, 0), (12, 20), (56, 40)]:
                        continue
                    if jd.get("noise_mask") or js["samples"] == "lat_c16":
                        if (x, y) not in [(0, 0), (16, 24)]:
                            continue
                    inputs = [jd, js] + ([f"mask_{m}"] if m else [])
                    name = (f"latent_composite_masked_{lat_name(jd)}_{lat_name(js)}_"
                            f"{m or 'nomask'}_{x}_{y}" + ("_resize" if resize else ""))
                    add(name, "latent_composite_masked", "LatentCompositeMasked",
                        {"x": x, "y": y, "resize_source": resize}, inputs,
                        lambda dd=dd, ds=ds, m=m, x=x, y=y, resize=resize: node(
                            "LatentCompositeMasked", "composite", fresh(dd), fresh(ds), x, y,
                            resize, MK[m] if m is not None else None))

    # ---- ImageColorToMask ----------------------------------------------------
    # Pixels from a small palette of exact k/255 colours, plus values next
    # to the rounding boundaries (k + 0.5) / 255 and outside 0..1.
    rng = np.random.default_rng(371)
    palette = np.array([[0x12, 0xAB, 0x7F], [0xFF, 0xFF, 0xFF], [0, 0, 0], [0x80, 0x80, 0x01],
                        [0x12, 0xAB, 0x80]], dtype=np.float32) / np.float32(255.0)
    cimg = palette[rng.integers(0, len(palette), size=(2, 5, 6))].astype(np.float32)
    flat = cimg.reshape(-1, 3)
    # (k + 0.5) / 255 and its neighbours: round-half-even after * 255.
    for i, (k, d) in enumerate([(0x7F, 0), (0x7F, 1), (0x7F, -1), (0x12, 0), (0xAB, 1),
                                (0xFE, 0), (0x00, 0)]):
        v = (np.float32(k) + np.float32(0.5)) / np.float32(255.0)
        if d:
            v = np.nextafter(v, np.float32(2 * d))
        flat[3 + i] = [np.float32(0x12) / np.float32(255.0), np.float32(0xAB) / np.float32(255.0), v]
    flat[12] = [-0.2, 0.0, 0.0]         # clamps to black
    flat[13] = [1.3, 1.0, 1.7]          # clamps to white
    flat[14] = [0.0, -0.0, 1e-30]
    ci = {
        "rgb": torch.from_numpy(cimg),
        "rgba": torch.from_numpy(np.concatenate(
            [cimg[:1], rng.random((1, 5, 6, 1), dtype=np.float32)], axis=-1)),
        "one": torch.from_numpy(cimg[:1, :, :, :1].copy()),   # 1 channel: raises
    }
    for k, v in ci.items():
        put(f"cimg_{k}", v)
    for src, colors in [("rgb", [0x12AB7F, 0x12AB80, 0xFFFFFF, 0x000000, 0x808001, 0x12AB7E,
                                 0x123456]),
                        ("rgba", [0x12AB7F, 0xFFFFFF]), ("one", [0])]:
        for color in colors:
            add(f"image_color_to_mask_{src}_{color:06x}", "image_color_to_mask",
                "ImageColorToMask", {"color": color}, [f"cimg_{src}"],
                lambda src=src, color=color: node("ImageColorToMask", "image_to_mask", ci[src],
                                                  color), "MASK")

    # ---- RepeatImageBatch / ImageFromBatch -----------------------------------
    bimg = {"i1": rand_image(381, (1, 3, 4, 3)), "i2": rand_image(382, (2, 2, 3, 4)),
            "i3": rand_image(383, (3, 3, 2, 3))}
    for k, v in bimg.items():
        put(f"img_{k}", v)
    for src in bimg:
        for amount in [1, 2, 3, 4]:
            add(f"repeat_image_batch_{src}_{amount}", "repeat_image_batch", "RepeatImageBatch",
                {"amount": amount}, [f"img_{src}"],
                lambda src=src, amount=amount: node("RepeatImageBatch", "repeat", bimg[src],
                                                    amount), "IMAGE")
        for bi, length in from_batch:
            add(f"image_from_batch_{src}_{bi}_{length}", "image_from_batch", "ImageFromBatch",
                {"batch_index": bi, "length": length}, [f"img_{src}"],
                lambda src=src, bi=bi, length=length: node("ImageFromBatch", "frombatch",
                                                           bimg[src], bi, length), "IMAGE")

    # ---- ImageScaleToMaxDimension --------------------------------------------
    simg = {
        "wide": rand_image(391, (1, 2, 8, 3)),     # 8x2: 10 -> 10 x round(2.5) = 2
        "tall": rand_image(392, (2, 7, 4, 3)),     # 4x7, batch 2
        "sq": rand_image(393, (1, 5, 5, 3)),
        "rgba": rand_image(394, (1, 4, 6, 4)),     # 6x4 RGBA
        "thin": rand_image(395, (1, 2, 40, 3)),    # 130 -> 130x6: w + h > 128
    }
    for k, v in simg.items():
        put(f"simg_{k}", v)
    sizes = {"wide": [10, 6, 3, 1, 0, 8], "tall": [14, 3, 5, 7], "sq": [9, 2, 5],
             "rgba": [9, 3], "thin": [130]}
    # "bilinear" appears twice in the node's list; it is one method.
    for method in ["area", "lanczos", "bilinear", "nearest-exact", "bicubic"]:
        for src, lss in sizes.items():
            for ls in lss:
                if src == "thin" and method not in ("nearest-exact", "bilinear", "bicubic"):
                    continue
                kind = "IMAGE_U8" if method == "lanczos" else "IMAGE"

                def compute(src=src, ls=ls, method=method, kind=kind):
                    out = node("ImageScaleToMaxDimension", "upscale", simg[src], method, ls)
                    if kind == "IMAGE":
                        return out
                    # lanczos output is always k/255; store the byte.
                    u8 = (out * 255.0).round().to(torch.uint8)
                    assert torch.equal(u8.to(torch.float32) / 255.0, out)
                    return u8

                add(f"image_scale_to_max_dimension_{src}_{method}_{ls}",
                    "image_scale_to_max_dimension", "ImageScaleToMaxDimension",
                    {"upscale_method": method, "largest_size": ls}, [f"simg_{src}"], compute, kind)

    for k in sorted(counts):
        print(f"  {k:<26} {counts[k]:>4} cases")
