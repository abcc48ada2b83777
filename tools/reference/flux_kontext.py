"""End-to-end references for Flux Kontext editing (reference latents).

Kontext dev has the Flux dev architecture, so the model is flux_pipeline.py's
unet/tiny_flux_dev.safetensors unchanged, with its companions
clip/tiny_t5xxl, clip/tiny_clip_l and vae/tiny_flux_ae (keys and checksums
asserted equal to tests/reference/flux/expected.json). The workflows
graphs/tiny_flux_kontext*.json are run through ComfyUI's own node classes on
the CPU in f32, and tests/reference/flux_kontext/expected.json gets:
  files: flux_pipeline's entries (folder, name, keys sorted with shapes,
      scaled {}, checksum_f16) for those four files.
  workflows: per graph as flux's: latent_shape, latent_f32, image_shape,
      image_f32 (base64 little-endian f32), image_range [min, max, std],
      f32_vs_f64_unet_rel, unet_rounding_rel (sd1_pipeline's spread runs);
      and, for the record, without_refs_rel (max |latent - latent of the same
      graph with every ReferenceLatent removed| / max |that latent|: the
      references matter).
  components:
    ref_ids: {graph: [[index, h_first, w_first, h_last, w_last, tokens] per
        reference]}: the img_ids of each reference's tokens in the DiT's
        first call (ids[..., 0] constant = index; ids[..., 1] = h_first ..
        h_last along the token rows, ids[..., 2] = w_first .. w_last along
        the columns, a full grid; asserted), tokens = its token count.
    dit_tokens: {graph: [image tokens, image + reference tokens, text
        tokens]} of that first call.
    kontext_resolutions: comfy_extras/nodes_flux.py
        PREFERED_KONTEXT_RESOLUTIONS as [width, height] pairs.
    kontext_image_scale: [{label, input_shape, output_shape, positions
        [[y, x, c]...] (256, numpy default_rng(SEED) integers), values_f32
        (base64 f32 of the output at those positions), mean (of the whole
        output, f64), pillow (the Pillow version that resampled)}] for
        FluxKontextImageScale applied to LoadImage(example.png) and to
        LoadImage(example.png) -> ImageScale(bilinear, 96x40, crop
        disabled).

Workflows (4 steps, euler / simple, FluxGuidance 2.5 on the positive):
  tiny_flux_kontext: LoadImage example.png -> ImageScale(bilinear) 48x40 ->
      VAEEncode -> ReferenceLatent on CLIPTextEncode(prompt) -> FluxGuidance;
      negative CLIPTextEncode("") with no reference (and no FluxGuidance:
      ComfyUI's Flux.extra_conds gives it guidance 3.5); cfg 2.0;
      EmptySD3LatentImage 64x48 (latent 6x8, reference 5x6).
  tiny_flux_kontext_multi: two ReferenceLatent chained on the positive
      (example.png at 48x40 -> latent 5x6, then at 32x56 -> latent 7x4),
      default method (offset); negative ConditioningZeroOut of the positive
      (keeps the references; cfg 1.0 skips it anyway); the latent is the
      first reference's VAEEncode output (5x6).
  tiny_flux_kontext_index / tiny_flux_kontext_uxo: the multi graph's
      references, FluxKontextMultiReferenceLatentMethod("index" /
      "uxo/uno") on the positive after them; EmptySD3LatentImage 48x48.

How ComfyUI does it (asserted here where observable):
  * ReferenceLatent (comfy_extras/nodes_edit_model.py) appends the latent
      to the conditioning's "reference_latents" list (conditioning_set_
      values(append=True)); FluxKontextMultiReferenceLatentMethod sets
      "reference_latents_method" ("uxo/uno" -> "uxo").
  * Flux.extra_conds (comfy/model_base.py): ref_latents = CONDList of
      process_latent_in(each) ((x - 0.1159) * 0.3611); ref_latents_method a
      CONDConstant, only when references exist.
  * Flux._forward (comfy/ldm/flux/model.py): the noisy latent is padded to
      even size (circular) and patchified, ids (0, row, col); each reference
      the same way with (index, row + h_offset', col + w_offset') where
      offset' = (offset + 1) // 2 (latent pixels -> patches, rounded half
      up), its tokens appended after the image tokens; only the image
      tokens are returned. Per method, h, w running (latent pixels):
        offset (default): index 1; if ref_h + h > ref_w + w: w_offset = w
            else h_offset = h; h = max(h, ref_h + h_offset), w = max(w,
            ref_w + w_offset).
        index: index 1, 2, ... per reference, offsets 0.
        uxo: index 0 (same as the image), h_offset = h_len * 2 + h,
            w_offset = w_len * 2 + w (h_len, w_len: the image's patch
            grid); h += ref_h, w += ref_w.
      The ids tensor has the model input's dtype (f32; f64 in the
      --fp64-unet run); rope casts the positions to f32.
  * Batching (comfy/samplers.py can_concat_cond): a cond with ref_latents
      and one without have different keys, so graph 1's cond and uncond run
      as separate DiT calls (batch 1 each); cfg 1.0 drops the uncond.

Relaxed as in flux_pipeline.py (fp.patch_comfy), nothing more.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/flux_kontext.py
(media-only imports are stubbed as in sd1_pipeline.py; the flux fixtures are
not rewritten; the steps shared with the other Flux fixture scripts --
model folders, fixture checks, workflow runs, spreads, per-workflow
fields -- are fixture_runs.py's.)
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import flux_pipeline as fp  # noqa: E402
import flux_fill as ff  # noqa: E402
import fixture_runs as fr  # noqa: E402
import inpaint_pipeline as ip  # noqa: E402

FILES = ["tiny_flux_dev.safetensors", "tiny_t5xxl.safetensors", "tiny_clip_l.safetensors",
         "tiny_flux_ae.safetensors"]
WORKFLOWS = ["tiny_flux_kontext", "tiny_flux_kontext_multi", "tiny_flux_kontext_index",
             "tiny_flux_kontext_uxo"]
METHOD = {"tiny_flux_kontext": None, "tiny_flux_kontext_multi": None,
          "tiny_flux_kontext_index": "index", "tiny_flux_kontext_uxo": "uxo"}
SCALE_SEED = 20250711
SCALE_POSITIONS = 256


def v3_nodes():
    import comfy_extras.nodes_edit_model as edit
    import comfy_extras.nodes_flux as flux
    return {**fp.v3_nodes(), "ReferenceLatent": ff.v3(edit.ReferenceLatent),
            "FluxKontextImageScale": ff.v3(flux.FluxKontextImageScale),
            "FluxKontextMultiReferenceLatentMethod":
                ff.v3(flux.FluxKontextMultiReferenceLatentMethod)}


class Record:
    """Per KSampler call its positive / negative conditioning; per DiT call
    (Flux._forward) x, the reference latents, the method, the guidance, and
    what forward_orig got (img tokens, img_ids, txt)."""
    def __init__(self, torch):
        import comfy.ldm.flux.model as fm
        import comfy.sample
        self.samples, self.calls = [], []
        rec = self
        sample = comfy.sample.sample

        def sample_wrap(*args, **kwargs):
            rec.samples.append({"positive": args[6], "negative": args[7]})
            return sample(*args, **kwargs)
        comfy.sample.sample = sample_wrap
        fwd = fm.Flux._forward

        def fwd_wrap(self, x, timestep, context, y=None, guidance=None, ref_latents=None,
                     control=None, transformer_options={}, **kwargs):
            rec.calls.append({
                "x": x.clone(), "context": list(context.shape),
                "refs": None if ref_latents is None else [r.clone() for r in ref_latents],
                "method": kwargs.get("ref_latents_method"),
                "guidance": None if guidance is None else guidance.clone()})
            return fwd(self, x, timestep, context, y, guidance, ref_latents, control,
                       transformer_options, **kwargs)
        fm.Flux._forward = fwd_wrap
        orig = fm.Flux.forward_orig

        def orig_wrap(self, img, img_ids, txt, txt_ids, *args, **kwargs):
            rec.calls[-1].update(img=img.clone(), img_ids=img_ids.clone(),
                                 txt_tokens=txt.shape[1])
            return orig(self, img, img_ids, txt, txt_ids, *args, **kwargs)
        fm.Flux.forward_orig = orig_wrap


def patchify(torch, x):
    """Circular pad to even size, "b c (h 2) (w 2) -> b (h w) (c 2 2)"."""
    ph, pw = x.shape[-2] % 2, x.shape[-1] % 2
    x = torch.nn.functional.pad(x, (0, pw, 0, ph), mode="circular")
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(
        b, (h // 2) * (w // 2), c * 4)


def expected_ids(method, x_hw, ref_hws):
    """The docstring's rule, written out again: per reference (index,
    h_offset', w_offset', h_len, w_len)."""
    h_len, w_len = (x_hw[0] + 1) // 2, (x_hw[1] + 1) // 2
    h = w = 0
    out = []
    for i, (rh, rw) in enumerate(ref_hws):
        if method == "index":
            index, ho, wo = i + 1, 0, 0
        elif method == "uxo":
            index, ho, wo = 0, h_len * 2 + h, w_len * 2 + w
            h += rh
            w += rw
        else:
            index, ho, wo = 1, 0, 0
            if rh + h > rw + w:
                wo = w
            else:
                ho = h
            h = max(h, rh + ho)
            w = max(w, rw + wo)
        out.append((index, (ho + 1) // 2, (wo + 1) // 2, (rh + 1) // 2, (rw + 1) // 2))
    return out


def check_calls(name, rec, torch, model):
    """Asserts what the DiT received; returns (ref_ids entry, dit_tokens
    entry, batching description)."""
    (sample,) = rec.samples
    pos = sample["positive"]
    assert len(pos) == 1
    refs_in = pos[0][1].get("reference_latents")
    assert refs_in is not None and len(refs_in) == (1 if name == "tiny_flux_kontext" else 2)
    want_method = METHOD[name]
    cfg1 = name != "tiny_flux_kontext"
    calls = rec.calls
    steps = 4
    assert len(calls) == (steps if cfg1 else 2 * steps), (name, len(calls))
    for c in calls:
        assert c["x"].shape[0] == 1, "never batched"
    with_refs = [c for c in calls if c["refs"] is not None]
    without = [c for c in calls if c["refs"] is None]
    if cfg1:
        assert len(with_refs) == steps and not without
        batching = "cfg 1.0: uncond skipped, {} DiT calls of batch 1".format(len(calls))
    else:
        assert len(with_refs) == steps and len(without) == steps
        order = "".join("c" if c["refs"] is not None else "u" for c in calls)
        gu = sorted({float(c["guidance"][0]) for c in without})
        gc = sorted({float(c["guidance"][0]) for c in with_refs})
        assert gc == [2.5] and gu == [3.5], (gc, gu)
        batching = ("cond and uncond NOT batched: {} DiT calls of batch 1, order {} "
                    "(c = cond with refs, guidance {}; u = uncond without, guidance {})").format(
                        len(calls), order, gc, gu)
    first = with_refs[0]
    x = first["x"]
    H, W = x.shape[-2:]
    h_len, w_len = (H + 1) // 2, (W + 1) // 2
    n_img = h_len * w_len
    refs = first["refs"]
    assert first["method"] == want_method, (first["method"], want_method)
    for r, r0 in zip(refs, refs_in):
        assert r.dtype == x.dtype
        assert torch.equal(r, model.process_latent_in(r0).to(r.dtype)), name
    img, ids = first["img"], first["img_ids"]
    assert ids.dtype == x.dtype, (ids.dtype, x.dtype)
    total = n_img + sum(((r.shape[-2] + 1) // 2) * ((r.shape[-1] + 1) // 2) for r in refs)
    assert img.shape[1] == total and ids.shape[1] == total, (img.shape, total)
    # Tokens: the padded, patchified latent, then each padded reference.
    assert torch.equal(img, torch.cat([patchify(torch, x)] + [patchify(torch, r) for r in refs], 1))
    # Image ids: (0, row, col).
    rows = torch.arange(h_len, dtype=ids.dtype).view(-1, 1).expand(h_len, w_len).reshape(-1)
    cols = torch.arange(w_len, dtype=ids.dtype).view(1, -1).expand(h_len, w_len).reshape(-1)
    assert torch.equal(ids[0, :n_img], torch.stack([torch.zeros_like(rows), rows, cols], -1))
    want = expected_ids(want_method, (H, W), [tuple(r.shape[-2:]) for r in refs])
    entry, at = [], n_img
    for r, (index, ho, wo, rh, rw) in zip(refs, want):
        n = rh * rw
        got = ids[0, at:at + n]
        rr = torch.arange(rh, dtype=ids.dtype).view(-1, 1).expand(rh, rw).reshape(-1)
        cc = torch.arange(rw, dtype=ids.dtype).view(1, -1).expand(rh, rw).reshape(-1)
        grid = torch.stack([torch.full_like(rr, index), rr + ho, cc + wo], -1)
        assert torch.equal(got, grid), (name, got, grid)
        entry.append([int(got[0, 0]), int(got[0, 1]), int(got[0, 2]), int(got[-1, 1]),
                      int(got[-1, 2]), n])
        at += n
    # Every call of the run got the same references and ids.
    for c in with_refs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(c["refs"], refs))
        assert torch.equal(c["img_ids"], ids)
    tokens = [n_img, total, first["txt_tokens"]]
    print("   DiT first call: x", list(x.shape), "refs", [list(r.shape) for r in refs],
          "method", first["method"], "tokens image", n_img, "+ refs", total - n_img, "=", total,
          "txt", first["txt_tokens"], "ids dtype", ids.dtype)
    print("   ref ids [index, h_first, w_first, h_last, w_last, tokens]:", entry)
    print("  ", batching)
    return entry, tokens, batching


def without_refs(prompt):
    """The graph with every ReferenceLatent removed (consumers take its
    conditioning input)."""
    g = json.loads(json.dumps(prompt))
    for nid in [k for k, n in g.items() if n["class_type"] == "ReferenceLatent"]:
        src = g[nid]["inputs"]["conditioning"]
        del g[nid]
        for n in g.values():
            for k, v in n["inputs"].items():
                if isinstance(v, list) and v[0] == nid:
                    n["inputs"][k] = list(src)
    assert not [n for n in g.values() if n["class_type"] == "ReferenceLatent"]
    return g


def kontext_image_scale(node_ns, torch):
    import PIL
    import comfy_extras.nodes_flux as flux
    res = [list(r) for r in flux.PREFERED_KONTEXT_RESOLUTIONS]
    out = []
    load = {"10": {"class_type": "LoadImage", "inputs": {"image": "example.png"}}}
    cases = [("example", dict(load), ["10", 0]),
             ("example_96x40", dict(load, **{"11": {"class_type": "ImageScale", "inputs": {
                 "image": ["10", 0], "upscale_method": "bilinear", "width": 96, "height": 40,
                 "crop": "disabled"}}}), ["11", 0])]
    for label, g, src in cases:
        g["97"] = {"class_type": "SaveImage", "inputs": {"images": src}}
        g["12"] = {"class_type": "FluxKontextImageScale", "inputs": {"image": src}}
        g["98"] = {"class_type": "SaveImage", "inputs": {"images": ["12", 0]}}
        (inp, img), _ = sd1.run_workflow(g, node_ns, torch)
        a = img.float().numpy()
        _, ih, iw, _ = inp.shape
        _, oh, ow, oc = a.shape
        aspect = iw / ih
        want = min((abs(aspect - w / h), w, h) for w, h in res)[1:]
        assert (ow, oh) == want, ((ow, oh), want)
        # Lanczos goes through 8-bit PIL: every value is k / 255.
        q = np.round(a * 255)
        assert np.array_equal((q / 255).astype(np.float32), a), label
        rng = np.random.default_rng(SCALE_SEED)
        pos = np.stack([rng.integers(0, oh, SCALE_POSITIONS), rng.integers(0, ow, SCALE_POSITIONS),
                        rng.integers(0, oc, SCALE_POSITIONS)], 1)
        vals = a[0, pos[:, 0], pos[:, 1], pos[:, 2]]
        mean = float(a.astype(np.float64).mean())
        old_aspect, new_aspect = iw / ih, ow / oh
        cx = round((iw - iw * (new_aspect / old_aspect)) / 2) if old_aspect > new_aspect else 0
        cy = round((ih - ih * (old_aspect / new_aspect)) / 2) if old_aspect < new_aspect else 0
        out.append({"label": label, "input_shape": list(inp.shape), "output_shape": list(a.shape),
                    "positions": pos.tolist(), "values_f32": sd1.b64(vals.astype("<f4")),
                    "mean": mean, "pillow": PIL.__version__})
        print("FluxKontextImageScale", label, "input", list(inp.shape), "aspect", round(aspect, 4),
              "-> output", list(a.shape), "(w, h) =", want, "center crop x", cx, "y", cy,
              "mean", mean, "distinct levels", len(np.unique(q)))
    return res, out


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import nodes

    log = ip.LogCapture()
    with fr.comfy_tmp(torch, ["unet", "clip", "vae"], log) as tmp:
        out = {"files": fr.write_flux_files(tmp, FILES, torch, verbose=not sub),
               "workflows": {}, "components": {}}
        assert [f["name"] for f in out["files"]] == FILES

        node_ns = fr.node_classes(nodes, v3_nodes())
        if not sub:
            (m,) = nodes.UNETLoader().load_unet(FILES[0], "default")
            assert type(m.model.model_config).__name__ == "Flux"
            assert m.model.diffusion_model.img_in.weight.dtype == torch.float32
            model = m.model
            res, scale = kontext_image_scale(node_ns, torch)
            out["components"]["kontext_resolutions"] = res
            out["components"]["kontext_image_scale"] = scale
            out["components"]["ref_ids"] = {}
            out["components"]["dit_tokens"] = {}
            runs = sd1.spread_runs(__file__)
            rec = Record(torch)
        for name in WORKFLOWS:
            prompt = fr.load_graph(name)
            if not sub:
                del rec.samples[:], rec.calls[:]
            lat, img = fr.run(name, prompt, node_ns, torch, log, ff.unet_warnings)
            if sub:
                out["workflows"][name] = fr.f32_b64(lat)
                continue
            print(name)
            entry, tokens, _ = check_calls(name, rec, torch, model)
            out["components"]["ref_ids"][name] = entry
            out["components"]["dit_tokens"][name] = tokens
            clipped = fr.check_image(name, img)
            w = fr.spreads(name, lat, runs)
            del rec.samples[:], rec.calls[:]
            _, plain = sd1.run_workflow(without_refs(prompt), node_ns, torch)
            assert all(c["refs"] is None for c in rec.calls)
            n_plain = len(rec.calls)
            batch_plain = sorted({c["x"].shape[0] for c in rec.calls})
            w["without_refs_rel"] = fr.rel(lat, plain[0].float().numpy())
            spread = max(w["f32_vs_f64_unet_rel"], w["unet_rounding_rel"])
            assert w["without_refs_rel"] > max(1e-3, 100 * spread), (name, w)
            w.update(fr.outputs(lat, img))
            out["workflows"][name] = w
            print("  ", *fr.summary(lat, img, w, clipped), "without refs", w["without_refs_rel"],
                  "(that run:", n_plain, "DiT calls, batch sizes", batch_plain, ")")
        fr.finish("flux_kontext", out, sub)


if __name__ == "__main__":
    main()
