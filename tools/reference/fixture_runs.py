"""What the Flux-based reference-fixture scripts share (scaled_fp8.py,
flux_fill.py, flux_kontext.py, fp8_lora.py, gguf_lora.py, flux_redux.py,
dit_guidance.py and, through control_runs.py or directly, the ControlNet
scripts flux_controlnet.py, flux_instantx.py, sd3_controlnet.py; all built on
flux_pipeline.py and sd1_pipeline.py):

  * comfy_tmp: a temp dir with ComfyUI's model folders registered,
    graphs/input as input dir, flux_pipeline's relaxations installed and a
    log handler attached, all undone on exit;
  * fixture / load_graph / write_graph: tests/reference/<name>/expected.json
    and graphs/<name>.json;
  * flux_loaders / save_nodes: the graphs' tiny Flux dev loader nodes and
    their VAEDecode / SaveImage / SaveLatent tail;
  * file_entry / write_flux_files / write_sd35 / lora_specs /
    write_flux_lora / print_file: the "files" entries, flux_pipeline's,
    sd3_pipeline's and flux_lora's files rewritten and asserted equal to
    their fixtures' entries, a written file's keys printed;
  * debug_log: the root logger at DEBUG around a model load, its records
    kept;
  * run: one workflow, its latent and image as f32 arrays, the log
    checked;
  * check_image, rel, decode, latent_of, spreads, without_rel, outputs,
    summary: the per-workflow fields every fixture has (f32_vs_f64_unet_rel
    and unet_rounding_rel against sd1_pipeline.spread_runs' latents;
    without_rel against the graph without the feature under test;
    latent_shape, latent_f32, image_shape, image_f32, image_range) and the
    line printed for them;
  * b64t / tensor_entry: a tensor as a component field ({shape, f32});
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
import sd3_pipeline as s3  # noqa: E402
import families_pipeline as fam  # noqa: E402

ROOT = sd1.ROOT
# Model folder under the temp dir -> the folder_paths kind it is registered as.
FOLDER_KINDS = {"checkpoints": "checkpoints", "unet": "diffusion_models",
                "clip": "text_encoders", "vae": "vae", "loras": "loras",
                "controlnet": "controlnet", "clip_vision": "clip_vision",
                "style_models": "style_models"}


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


def flux_loaders():
    """The tiny Flux dev's loader nodes: UNETLoader "1", DualCLIPLoader flux
    "2", VAELoader "13"."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_flux_dev.safetensors",
                                                     "weight_dtype": "default"}},
        "2": {"class_type": "DualCLIPLoader", "inputs": {
            "clip_name1": "tiny_clip_l.safetensors", "clip_name2": "tiny_t5xxl.safetensors",
            "type": "flux", "device": "default"}},
        "13": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_flux_ae.safetensors"}},
    }


def save_nodes(name, vae):
    """VAEDecode "8" (of sampler "7"'s latent with `vae`), SaveImage "9" and
    SaveLatent "99" of workflow `name`."""
    return {
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": vae}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": name}},
        "99": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0],
                                                      "filename_prefix": "latents/" + name}},
    }


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


def write_sd35(tmp, nodes, ckpt, torch, fixtures, clip_l=True, verbose=False):
    """sd3_pipeline's tiny SD3.5 checkpoint `ckpt`, written into tmp's
    folders as sd3_pipeline builds it: its parts first (clip_l when
    `clip_l`, clip_g and t5xxl_sd3, keys and checksum_f16 asserted equal to
    tests/reference/sd3/expected.json; the VAE and MMDiT halves), then the
    checkpoint. Returns its file_entry (scaled: the positional embedding's
    scale), asserted equal to its entry in each of `fixtures`'
    expected.json."""
    sd3_files = {x["name"]: x for x in fixture("sd3")["files"]}
    parts = [("clip", "tiny_clip_l.safetensors", fam.clip_hf_keys(torch, s3.CLIP_L, False),
              True)] if clip_l else []
    for folder, name, keys, listed in parts + [
            ("clip", "tiny_clip_g.safetensors", fam.clip_hf_keys(torch, s3.CLIP_G, True), True),
            ("clip", "tiny_t5xxl_sd3.safetensors", s3.t5_keys(torch), True),
            ("vae", "_sd3_vae.safetensors", fp.vae_keys(torch), False),
            ("unet", "_mmdit_" + ckpt, s3.mmdit_keys(torch, ckpt), False)]:
        keys = sorted(keys)
        digest = fam.write_file(os.path.join(tmp, folder, name), keys, {}, torch)
        if listed:
            assert [list(k) for k in keys] == sd3_files[name]["keys"], name
            assert str(digest) == sd3_files[name]["checksum_f16"], name
    keys = sorted(s3.make_checkpoint(nodes, s3.v3_nodes(), tmp, ckpt, torch))
    scaled = {s3.POS_EMBED: s3.POS_SCALE[s3.VARIANTS[ckpt][2]]}
    digest = fam.write_file(os.path.join(tmp, "checkpoints", ckpt), keys, scaled, torch)
    entry = file_entry("checkpoints", ckpt, keys, digest)
    entry["scaled"] = dict(scaled)
    as_json = json.loads(json.dumps(entry))
    for name in fixtures:
        (ref,) = [x for x in fixture(name)["files"] if x["name"] == ckpt]
        assert as_json == ref, (name, ckpt)
    if verbose:
        print("file checkpoints", ckpt, "keys", len(keys), "checksum", digest,
              "(= {})".format(" = ".join(n + "/expected.json" for n in fixtures)))
    return entry


def print_file(folder, name, keys, digest):
    """A written file's line (folder, name, key count, parameters, checksum)
    and its keys with their shapes."""
    print("file", folder, name, "keys", len(keys), "params",
          sum(int(np.prod(s)) for _, s in keys), "checksum", digest)
    for k, s in keys:
        print("   ", k, s)


@contextlib.contextmanager
def debug_log(log):
    """The root logger at DEBUG (where ComfyUI reports unexpected keys),
    every other handler at INFO or above, `log` (a LogCapture on the root
    logger) cleared; all restored on exit. Yields a list that, on exit,
    holds the captured records as (level name, message)."""
    root = logging.getLogger()
    level = root.level
    quiet = [(h, h.level) for h in root.handlers if h is not log]
    for h, _ in quiet:
        h.setLevel(max(h.level, logging.INFO))
    root.setLevel(logging.DEBUG)
    del log.records[:]
    msgs = []
    try:
        yield msgs
    finally:
        root.setLevel(level)
        for h, lvl in quiet:
            h.setLevel(lvl)
        msgs.extend((logging.getLevelName(lvl), m) for lvl, m in log.records)


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


def without_rel(name, lat, w, prompt, node_ns, torch):
    """w["without_rel"]: max |lat - the latent of `prompt` (workflow `name`
    without the feature under test)| / max |that latent|, asserted above
    1e-3 and 100 times the spreads (the feature matters)."""
    _, plain = sd1.run_workflow(prompt, node_ns, torch)
    w["without_rel"] = rel(lat, plain[0].float().numpy())
    spread = max(w["f32_vs_f64_unet_rel"], w["unet_rounding_rel"])
    assert w["without_rel"] > max(1e-3, 100 * spread), (name, w)


def b64t(t):
    """base64 of a tensor as little-endian f32."""
    return sd1.b64(t.detach().float().numpy().astype("<f4"))


def tensor_entry(t):
    """A tensor as a component field: {shape, f32}."""
    return {"shape": list(t.shape), "f32": b64t(t)}


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
