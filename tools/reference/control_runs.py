"""What the ControlNet reference-fixture scripts share (flux_controlnet.py,
flux_instantx.py, sd3_controlnet.py; built on fixture_runs.py):

  * groups_of / groups_entry / scaled: a control model's returned tuple as
    its distinct tensors with the positions they occupy, as a component
    field, and control_merge's list of it for one net (each distinct
    tensor times the strength);
  * record_get_control / hint_fields / record_encode / record_flux_dit: a
    Record's wrappers of ControlNet.get_control (stack order kept, result
    copied), of VAE.encode (the hint's, on the get_control entry running)
    and of the Flux DiT's forward_orig (the control it got, a trace of the
    next call with control when rec.trace is set);
  * install_flux_trace / check_flux_trace: hooks around the Flux DiT's
    blocks and ComfyUI's add rule checked on them;
  * flux_percent_to_sigma, check_range, check_hint, check_flux_dits: the
    per get_control call rules (timestep range, the VAE-encoded hint,
    what the Flux DiT got);
  * want_image_scale, without_control: ImageScale(bilinear, crop
    disabled) written out; a Flux graph with its ControlNetApplyAdvanced
    nodes bypassed;
  * flux_dit_control / print_calls / workflow_entry: the per-workflow
    fields (fixture_runs' plus without_rel, control_calls, dit_control)
    and the lines printed for them.
"""
import inspect
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_runs as fr  # noqa: E402
import controlnet_pipeline as cp  # noqa: E402


# --- recording -------------------------------------------------------------

def groups_of(ts):
    """The distinct tensors of a tuple with the positions they occupy."""
    groups = []
    for pos, v in enumerate(ts):
        for g in groups:
            if g["tensor"] is v:
                g["positions"].append(pos)
                break
        else:
            groups.append({"tensor": v, "positions": [pos]})
    return {"count": len(ts), "groups": [{"positions": g["positions"],
                                          "value": g["tensor"].clone()} for g in groups]}


def groups_entry(grp):
    """groups_of's result as a component field: count, tensors [{positions,
    shape, f32}]."""
    return {"count": grp["count"],
            "tensors": [dict(positions=g["positions"], **fr.tensor_entry(g["value"]))
                        for g in grp["groups"]]}


def scaled(grp, strength):
    """control_merge's list for one net without a previous one: each
    DISTINCT tensor of groups_of's result times the strength, at its
    positions."""
    lst = [None] * grp["count"]
    for g in grp["groups"]:
        v = g["value"] * strength
        for p in g["positions"]:
            lst[p] = v
    return lst


def record_get_control(rec, cond_keys, extra=None):
    """ControlNet.get_control wrapped: every call appended to rec.controls
    (net, previous net and control model as ids; sigma, t, x, strength,
    range, applied, batch, batched_number, the conds named in `cond_keys`,
    then `extra(net)`'s fields; forward, result (copied) and prev_entry
    (the previous net's call it made) filled in as they come) and on
    rec.stack while it runs."""
    import comfy.controlnet as cn
    get_control = cn.ControlNet.get_control

    def gc_wrap(self, x_noisy, t, cond, batched_number, transformer_options):
        r = self.timestep_range
        # ids, not objects: a held model makes ComfyUI warn of a leak.
        prev = self.previous_controlnet
        entry = {"net": id(self), "prev": None if prev is None else id(prev),
                 "model": id(self.control_model), "sigma": float(t[0]),
                 "t": t.clone(), "x": x_noisy.clone(), "strength": self.strength,
                 "range": None if r is None else (float(r[0]), float(r[1])),
                 "applied": bool(r is None or not (t[0] > r[0] or t[0] < r[1])),
                 "batch": int(x_noisy.shape[0]), "batched_number": batched_number,
                 "cond": {k: cond[k] for k in cond_keys if k in cond},
                 "forward": None, "result": None, "prev_entry": None}
        if extra is not None:
            entry.update(extra(self))
        if rec.stack:
            rec.stack[-1]["prev_entry"] = entry
        rec.controls.append(entry)
        rec.stack.append(entry)
        try:
            out = get_control(self, x_noisy, t, cond, batched_number, transformer_options)
        finally:
            rec.stack.pop()
        entry["result"] = None if out is None else {
            k: [None if v is None else v.clone() for v in out[k]] for k in out}
        return out
    cn.ControlNet.get_control = gc_wrap


def hint_fields(net):
    """A get_control entry's fields for a net with a VAE-encoded hint: encode
    (record_encode's), image (the hint as set), vae (id), latent_format
    (class name), latent_factors (scale, shift), preprocess."""
    return {"encode": None, "image": net.cond_hint_original.clone(),
            "vae": None if net.vae is None else id(net.vae),
            "latent_format": type(net.latent_format).__name__,
            "latent_factors": (net.latent_format.scale_factor, net.latent_format.shift_factor),
            "preprocess": net.preprocess_image}


def record_encode(rec):
    """VAE.encode wrapped: pixels, latent and VAE id of a call made inside a
    get_control call go on its entry ("encode"); other calls are counted
    (rec.other_encodes)."""
    import comfy.sd
    encode = comfy.sd.VAE.encode

    def encode_wrap(self, pixel_samples):
        out = encode(self, pixel_samples)
        if rec.stack:
            rec.stack[-1]["encode"] = {"pixels": pixel_samples.clone(), "latent": out.clone(),
                                       "vae": id(self)}
        else:
            rec.other_encodes += 1
        return out
    comfy.sd.VAE.encode = encode_wrap


def record_flux_dit(rec):
    """Flux.forward_orig wrapped: every call appended to rec.dits (sigma,
    batch, txt_len, img_len, the control it got, copied); when rec.trace is
    set, the next call with control is traced (install_flux_trace) and
    rec.trace cleared."""
    import comfy.ldm.flux.model as fm
    orig = fm.Flux.forward_orig
    sig = inspect.signature(orig)

    def orig_wrap(self, *args, **kwargs):
        a = sig.bind(self, *args, **kwargs).arguments
        control = a.get("control")
        call = {"sigma": float(a["timesteps"][0]), "batch": int(a["img"].shape[0]),
                "txt_len": int(a["txt"].shape[1]), "img_len": int(a["img"].shape[1]),
                "control": None if control is None else {
                    k: [None if v is None else v.clone() for v in control[k]]
                    for k in control}}
        rec.dits.append(call)
        hooks = []
        if rec.trace and control is not None:
            rec.trace = False
            call["trace"] = trace = {}
            hooks = install_flux_trace(self, trace)
        try:
            return orig(self, *args, **kwargs)
        finally:
            for hk in hooks:
                hk.remove()
    fm.Flux.forward_orig = orig_wrap


def install_flux_trace(dm, trace):
    """Forward hooks on the DiT's blocks (all copies): each double block's
    img input / (img, txt) output, each single block's input / output, the
    final layer's input."""
    hooks = []

    def pre(tag):
        def hook(mod, args, kwargs):
            v = kwargs["img"] if "img" in kwargs else args[0]
            trace[tag + "_in"] = v.clone()
        return hook

    def post(tag):
        def hook(mod, args, kwargs, out):
            trace[tag + "_out"] = tuple(o.clone() for o in out) if isinstance(out, tuple) \
                else out.clone()
        return hook
    for i, b in enumerate(dm.double_blocks):
        hooks.append(b.register_forward_pre_hook(pre("double{}".format(i)), with_kwargs=True))
        hooks.append(b.register_forward_hook(post("double{}".format(i)), with_kwargs=True))
    for i, b in enumerate(dm.single_blocks):
        hooks.append(b.register_forward_pre_hook(pre("single{}".format(i)), with_kwargs=True))
        hooks.append(b.register_forward_hook(post("single{}".format(i)), with_kwargs=True))
    hooks.append(dm.final_layer.register_forward_pre_hook(pre("final"), with_kwargs=True))
    trace["double_blocks"], trace["single_blocks"] = len(dm.double_blocks), len(dm.single_blocks)
    return hooks


# --- checks ----------------------------------------------------------------

def check_flux_trace(dit, torch):
    """The Flux add rule on one traced DiT call."""
    tr, ctl = dit["trace"], dit["control"]
    nd, ns = tr["double_blocks"], tr["single_blocks"]
    txt_len = dit["txt_len"]
    img = None
    for i in range(nd):
        out_img, out_txt = tr["double{}_out".format(i)]
        img = out_img.clone()
        if i < len(ctl["input"]) and ctl["input"][i] is not None:
            add = ctl["input"][i]
            img[:, :add.shape[1]] += add
        if i + 1 < nd:
            assert torch.equal(tr["double{}_in".format(i + 1)], img), i
    x = torch.cat((out_txt, img), 1)
    assert txt_len == out_txt.shape[1]
    for i in range(ns):
        assert torch.equal(tr["single{}_in".format(i)], x), i
        x = tr["single{}_out".format(i)].clone()
        if i < len(ctl["output"]) and ctl["output"][i] is not None:
            add = ctl["output"][i]
            x[:, txt_len:txt_len + add.shape[1]] += add
    assert torch.equal(tr["final_in"], x[:, txt_len:])
    used = (min(nd, len(ctl["input"])), min(ns, len(ctl["output"])))
    print("   Flux add rule checked on the first DiT call with control: double blocks", nd,
          "single blocks", ns, "-> input[0:{}] and output[0:{}] used".format(*used),
          "txt tokens", txt_len, "img tokens", dit["img_len"])


def flux_percent_to_sigma(p, shift=1.15):
    """ModelSamplingFlux.percent_to_sigma, written out."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    t = 1.0 - p
    return math.exp(shift) / (math.exp(shift) + (1 / t - 1))


def check_range(e, inputs, want_range):
    """One get_control call of a lone net (no previous one) of an apply node
    with `inputs`: its strength, timestep_range = want_range, applied
    exactly when the sigma is inside it."""
    assert e["prev"] is None and e["prev_entry"] is None
    assert e["strength"] == inputs["strength"]
    assert all(abs(a - b) <= 1e-12 for a, b in zip(e["range"], want_range)), \
        (e["range"], want_range)
    assert e["applied"] == (not (e["sigma"] > want_range[0] or e["sigma"] < want_range[1]))


def check_hint(name, e, first, vae, latent_format, factors, torch):
    """The hint of an applied get_control call (hint_fields' entry). The
    first one (`first` None) encoded it: the image common_upscale'd
    (nearest-exact, center) to the latent size * 8, the net's preprocess,
    VAE.encode (redone with `vae`), then (latent - shift) * scale (the
    net's `latent_format` with `factors` (scale, shift)); later ones reuse
    it (cached). Returns the first applied entry (its hint_parts: resized,
    pixels)."""
    import comfy.utils
    x, fwd = e["x"], e["forward"]
    if first is not None:
        assert e["encode"] is None, "the hint is cached"
        assert torch.equal(fwd["hint"], first["forward"]["hint"])
        return first
    enc = e["encode"]
    assert enc is not None and enc["vae"] == e["vae"] is not None
    assert e["latent_format"] == latent_format and e["latent_factors"] == factors
    resized = comfy.utils.common_upscale(e["image"], x.shape[3] * 8, x.shape[2] * 8,
                                         "nearest-exact", "center")
    pixels = e["preprocess"](resized).movedim(1, -1)
    assert torch.equal(enc["pixels"], pixels), name
    again = vae.encode(pixels)
    assert torch.equal(enc["latent"], again), float((enc["latent"] - again).abs().max())
    scale, shift = factors
    hint = (enc["latent"] - shift) * scale
    assert torch.equal(fwd["hint"], hint), float((fwd["hint"] - hint).abs().max())
    e["hint_parts"] = {"resized": resized, "pixels": pixels}
    return e


def check_flux_dits(entries, dits, torch):
    """The outermost get_control call per model call (`entries`) is what
    the Flux DiT call got."""
    assert len(entries) == len(dits), (len(entries), len(dits))
    for e, d in zip(entries, dits):
        assert e["sigma"] == d["sigma"] and e["batch"] == d["batch"]
        if e["result"] is None:
            assert d["control"] is None
        else:
            for k in ("input", "output"):
                assert all(torch.equal(a, b) for a, b in zip(d["control"][k], e["result"][k]))


def want_image_scale(image, torch, w, h):
    import comfy.utils
    return comfy.utils.common_upscale(image.movedim(-1, 1), w, h, "bilinear",
                                      "disabled").movedim(1, -1)


def without_control(prompt):
    g = cp.without_control(prompt)
    assert not [n for n in g.values() if n["class_type"] == "ControlNetApplyAdvanced"]
    return g


# --- per-workflow fields ---------------------------------------------------

def flux_dit_control(rec):
    """Per Flux DiT call [sigma, batch, number of "input" entries, number of
    "output" entries] (0, 0 without control)."""
    return [[d["sigma"], d["batch"],
             0 if d["control"] is None else len(d["control"]["input"]),
             0 if d["control"] is None else len(d["control"]["output"])]
            for d in rec.dits]


def print_calls(calls, dits, dit_control):
    """The get_control calls, one a line, then the DiT calls (`dits`: their
    label)."""
    print("   get_control calls [strength, sigma, applied, batch, batched_number]:")
    for c in calls:
        print("     ", c)
    print("  ", dits, dit_control)


def workflow_entry(name, lat, img, runs, rec, plain, node_ns, torch, calls, dit_control):
    """Workflow `name`'s fields: fixture_runs' spreads, without_rel (`plain`:
    the graph without its apply nodes, run with no get_control call and no
    control reaching the DiT), control_calls, dit_control, outputs; its
    summary line printed."""
    clipped = fr.check_image(name, img)
    w = fr.spreads(name, lat, runs)
    rec.reset()
    fr.without_rel(name, lat, w, plain, node_ns, torch)
    assert not rec.controls and all(d["control"] is None for d in rec.dits)
    w["control_calls"] = calls
    w["dit_control"] = dit_control
    w.update(fr.outputs(lat, img))
    print("  ", *fr.summary(lat, img, w, clipped), "without control", w["without_rel"])
    return w
