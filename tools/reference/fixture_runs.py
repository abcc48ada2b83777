"""What the Flux-based reference-fixture scripts share (scaled_fp8.py,
flux_fill.py, flux_kontext.py, fp8_lora.py, gguf_lora.py; all built on
flux_pipeline.py and sd1_pipeline.py):

  * comfy_tmp: a temp dir with ComfyUI's model folders registered,
    graphs/input as input dir, flux_pipeline's relaxations installed and a
    log handler attached, all undone on exit;
  * fixture / load_graph / write_graph: tests/reference/<name>/expected.json
    and graphs/<name>.json;
  * file_entry / write_flux_files / lora_specs / write_flux_lora: the
    "files" entries, flux_pipeline's and flux_lora's files rewritten and
    asserted equal to their fixtures' entries;
  * run: one workflow, its latent and image as f32 arrays, the log
    checked;
  * check_image, rel, decode, latent_of, spreads, outputs, summary: the
    per-workflow fields every fixture has (f32_vs_f64_unet_rel and
    unet_rounding_rel against sd1_pipeline.spread_runs' latents;
    latent_shape, latent_f32, image_shape, image_f32, image_range) and the
    line printed for them;
  * finish: a spread run prints its latents, the main run writes
    expected.json.
"""
import base64
import contextlib
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
import flux_pipeline as fp  # noqa: E402
import flux_lora as fl  # noqa: E402
import lora_pipeline as lp  # noqa: E402

ROOT = sd1.ROOT
# Model folder under the temp dir -> the folder_paths kind it is registered as.
FOLDER_KINDS = {"checkpoints": "checkpoints", "unet": "diffusion_models",
                "clip": "text_encoders", "vae": "vae", "loras": "loras"}


def fixture(name):
    """tests/reference/NAME/expected.json, parsed."""
    with open(os.path.join(ROOT, "tests", "reference", name, "expected.json")) as f:
        return json.load(f)


def graph_path(name):
    return os.path.join(ROOT, "graphs", name + ".json")


def load_graph(name):
    """graphs/NAME.json, parsed."""
    with open(graph_path(name)) as f:
        return json.load(f)


def write_graph(name, g):
    """graphs/NAME.json in flux_lora.graph_text's layout."""
    with open(graph_path(name), "w") as f:
        f.write(fl.graph_text(g))


@contextlib.contextmanager
def comfy_tmp(torch, folders, log=None):
    """A temp dir (yielded) whose subfolders `folders` (names of
    FOLDER_KINDS) are ComfyUI's default model folders, graphs/input the
    input dir, flux_pipeline's relaxations installed (fp.patch_comfy) and
    `log` (a logging.Handler, optional) on the root logger. On exit the
    handler is removed and the dir deleted."""
    import folder_paths
    if log is not None:
        logging.getLogger().addHandler(log)
    tmp = tempfile.mkdtemp()
    try:
        fp.patch_comfy(tmp, torch)
        for folder in folders:
            d = os.path.join(tmp, folder)
            os.makedirs(d, exist_ok=True)
            folder_paths.add_model_folder_path(FOLDER_KINDS[folder], d, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))
        yield tmp
    finally:
        if log is not None:
            logging.getLogger().removeHandler(log)
        shutil.rmtree(tmp, ignore_errors=True)


def node_classes(nodes, *extra):
    """ComfyUI's node classes plus `extra` ({name: class} dicts), as the
    `nodes` argument of sd1.run_workflow."""
    mappings = dict(nodes.NODE_CLASS_MAPPINGS)
    for e in extra:
        mappings.update(e)
    return types.SimpleNamespace(NODE_CLASS_MAPPINGS=mappings)


def file_entry(folder, name, keys, digest, **extra):
    """A "files" entry as flux_pipeline writes it: folder, name, keys
    (sorted, with shapes), scaled {}, checksum_f16; then `extra`."""
    return dict({"folder": folder, "name": name, "keys": keys, "scaled": {},
                 "checksum_f16": str(digest)}, **extra)


def write_flux_files(tmp, names, torch, verbose=False):
    """flux_pipeline's f16 files named in `names`, written into tmp's
    folders as flux_pipeline writes them, keys and checksum_f16 asserted
    equal to tests/reference/flux/expected.json. Returns their file_entry
    entries in fp.file_specs order, each asserted equal to the flux
    fixture's entry as a whole."""
    ref = {x["name"]: x for x in fixture("flux")["files"]}
    entries = []
    for folder, name, keys, dtype in fp.file_specs(torch):
        if name not in names:
            continue
        assert dtype is None and "dtype" not in ref[name], name
        keys = sorted(keys)
        digest, _ = fp.write_file(os.path.join(tmp, folder, name), keys, dtype, torch)
        assert [list(k) for k in keys] == ref[name]["keys"], name
        assert str(digest) == ref[name]["checksum_f16"], name
        entries.append(file_entry(folder, name, keys, digest))
        assert json.loads(json.dumps(entries[-1])) == ref[name], name
        if verbose:
            print("file", folder, name, "keys", len(keys), "checksum", digest,
                  "(= flux/expected.json)")
    assert sorted(e["name"] for e in entries) == sorted(names), names
    return entries


def lora_specs(nodes, unet="tiny_flux_dev.safetensors", t5="tiny_t5xxl.safetensors"):
    """flux_lora.lora_specs for UNETLoader(unet, "default") and
    DualCLIPLoader(tiny_clip_l, t5, flux): its LoRA targets, keys named by
    ComfyUI's key maps of that model."""
    (model,) = nodes.UNETLoader().load_unet(unet, "default")
    (clip,) = nodes.DualCLIPLoader().load_clip("tiny_clip_l.safetensors", t5, "flux")
    return fl.lora_specs(model, clip)


def write_flux_lora(tmp, specs, lora, torch):
    """flux_lora's LoRA file `lora` written from `specs` into tmp/loras
    (lora_pipeline.write_lora), keys, scaled, alphas and checksum_f16
    asserted equal to its entry in tests/reference/flux_lora/expected.json.
    Returns (that entry, (keys, scaled, alphas), checksum_f16)."""
    (ref,) = [x for x in fixture("flux_lora")["files"] if x["name"] == lora]
    keys, scaled, alphas = fl.file_keys(specs[lora])
    digest = lp.write_lora(os.path.join(tmp, "loras", lora), keys, scaled, alphas, torch)
    assert [list(k) for k in keys] == ref["keys"], lora
    assert scaled == ref["scaled"] and alphas == ref["alphas"], lora
    assert str(digest) == ref["checksum_f16"], lora
    return ref, (keys, scaled, alphas), digest


def run(name, prompt, node_ns, torch, log=None, problems=None):
    """sd1.run_workflow of a graph with one SaveLatent and one SaveImage:
    (latent, image) as f32 numpy arrays, asserted finite. `log` (a
    LogCapture on the root logger), if given, is cleared first and
    `problems(log)` (default: its problems(), lora_pipeline's weights not
    loaded) asserted empty after."""
    if log is not None:
        del log.records[:]
    saved, latents = sd1.run_workflow(prompt, node_ns, torch)
    if log is not None:
        found = problems(log) if problems is not None else log.problems()
        assert not found, (name, found)
    (image,) = saved
    img = image.float().numpy()
    (latent,) = latents
    lat = latent.float().numpy()
    assert np.isfinite(lat).all() and np.isfinite(img).all(), name
    return lat, img


def f32_b64(a):
    """base64 of `a` as little-endian f32."""
    return sd1.b64(a.astype("<f4"))


def check_image(name, img):
    """Not flat, not saturated. Returns the fraction of clipped values."""
    assert img.std() > 0.02, (name, float(img.std()))
    clipped = float(((img <= 0.0) | (img >= 1.0)).mean())
    assert clipped < 0.2, (name, clipped)
    return clipped


def rel(a, b):
    """max |a - b| / max |b|, in f32 (any shapes of the same size)."""
    a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
    return float(np.abs(a - b).max() / np.abs(b).max())


def decode(s):
    """A base64 little-endian f32 string, as a flat array."""
    return np.frombuffer(base64.b64decode(s), "<f4")


def latent_of(w):
    """The latent of a fixture's workflow entry, flat."""
    return decode(w["latent_f32"])


def spreads(name, lat, runs):
    """f32_vs_f64_unet_rel and unet_rounding_rel of workflow `name`'s
    latent against the latents of sd1.spread_runs (`runs`, its pair:
    --fp64-unet, --perturb-unet)."""
    f64_latents, perturbed_latents = runs
    return {"f32_vs_f64_unet_rel": rel(lat, decode(f64_latents[name])),
            "unet_rounding_rel": rel(lat, decode(perturbed_latents[name]))}


def outputs(lat, img):
    """latent_shape, latent_f32, image_shape, image_f32 (base64
    little-endian f32) and image_range [min, max, std]."""
    return {"latent_shape": list(lat.shape), "latent_f32": f32_b64(lat),
            "image_shape": list(img.shape), "image_f32": f32_b64(img),
            "image_range": [float(img.min()), float(img.max()), float(img.std())]}


def summary(lat, img, w, clipped):
    """The fields printed for every workflow (w: its entry)."""
    return ("latent", lat.shape, "abs mean", float(np.abs(lat).mean()), "std", float(lat.std()),
            "image", img.shape, "min/max/std", w["image_range"], "clipped", clipped,
            "f32 vs f64", w["f32_vs_f64_unet_rel"], "rounding", w["unet_rounding_rel"])


def finish(name, out, sub):
    """A spread run (`sub`) prints its workflows' latents as the last line
    of its output (what sd1.spread_runs reads) and returns None; the main
    run writes `out` as tests/reference/NAME/expected.json and returns its
    size in bytes."""
    if sub:
        print(json.dumps(out["workflows"]))
        return None
    sd1.write_expected(name, out)
    path = os.path.join(ROOT, "tests", "reference", name, "expected.json")
    size = os.path.getsize(path)
    print("wrote", path, size, "bytes")
    return size
