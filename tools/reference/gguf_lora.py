"""References for a LoRA on a GGUF-quantized Flux, as users run it in
ComfyUI with the ComfyUI-GGUF custom nodes (city96): UnetLoaderGGUF ->
LoraLoaderModelOnly -> KSampler.

Unlike gguf_fixtures.py (which stands in for ComfyUI-GGUF with a
safetensors of the dequantized weights), this script runs ComfyUI-GGUF's
own code: a checkout of github.com/city96/ComfyUI-GGUF (COMFY_GGUF_DIR,
default $COMFY_DIR/custom_nodes/ComfyUI-GGUF, else ComfyUI-GGUF beside
$COMFY_DIR), imported as ComfyUI imports a custom node package (its
__init__.py, NODE_CLASS_MAPPINGS), its commit recorded under
"comfyui_gguf". Its UnetLoaderGGUF reads the .gguf with gguf-py, builds the
model with GGMLOps and wraps it in GGUFModelPatcher; ComfyUI's own
LoraLoaderModelOnly adds the patches; at load GGUFModelPatcher.
patch_weight_to_device then, per patched weight:
  * quantized (Q8_0, Q4_K): nothing is merged; the patch list is attached
    to the GGMLTensor, and GGMLLayer.get_weight, at every forward of the
    layer, dequantizes (dequantize_tensor(w, dtype=the input's dtype, f32
    here, dequant_dtype None: the f16-math dequant of gguf_fixtures.py,
    i.e. the values of gguf/expected.json "comfy_f16_math", then .to(f32))
    and applies comfy.lora.calculate_weight(patches, weight, key)
    (patch_dtype None: intermediate_dtype float32): W + strength * scale *
    (up @ down), up/down f16 -> f32, all in f32, the result kept f32 (not
    rounded to anything);
  * F32 / F16 (not quantized): as ComfyUI's own ModelPatcher: a float32
    copy, calculate_weight in f32, then comfy.float.stochastic_rounding(out,
    the stored dtype): F32 weights stay f32, F16 weights (the tensor keeps
    the file's f16 dtype under GGUF) are ROUNDED TO F16 (nearest even),
    then cast to f32 by the layer at forward. Plain UNETLoader on the CPU
    keeps f32 weights, so this f16 rounding is GGUF-only.
Both paths are observed (comfy.lora.calculate_weight and
comfy.float.stochastic_rounding traced during the run: "patch_paths"), and
every patched weight the layers use is checked against the f64 formula
(flux_lora.py's Target.delta) on the dequantized base ("merge").

Workflows (graphs/*.json: flux_lora.py's LoRA graph with node 1 replaced
by gguf_fixtures.py's UnetLoaderGGUF node, Save prefixes renamed):
  tiny_flux_gguf_lora: tiny_flux_q8_0.gguf + tiny_flux_lora_kohya.
      safetensors, strength_model 0.8 (graph tiny_flux_lora_kohya);
  tiny_flux_gguf_q4_k_lora: tiny_flux_q4_k.gguf + tiny_flux_lora_diffusers.
      safetensors, strength_model 1.0 (graph tiny_flux_lora_diffusers).

What a Rust test writes (nothing new: every file comes from an existing
fixture, checked equal here):
  * setup_with(flux/expected.json): the base files of "uses_files"
    (tiny_clip_l, tiny_t5xxl, tiny_flux_ae; tiny_flux_dev unused by the
    graphs);
  * models/unet/<gguf_files[i].name> = support::tiny_flux_gguf(flux/
    expected.json files["tiny_flux_dev.safetensors"]["keys"],
    gguf_files[i].ggml_type) (8 for Q8_0, 12 for Q4_K), whose file_size and
    sha256 are gguf_files[i] (= gguf/expected.json gguf_files[name].header,
    asserted: the script rebuilds both files with gguf_fixtures.make_flux and
    compares the whole entries);
  * write_fixture_entry(models, f) for each f of "files": the LoRA entries,
    copied verbatim from flux_lora/expected.json "files" (same name, keys,
    scaled, alphas, checksum_f16; asserted equal, and the files are written
    here from those entries with lora_pipeline.write_lora, as the Rust
    helper writes them).
Then run the graph and check_graph(base, this fixture, graph, None).

tests/reference/gguf_lora/expected.json:
  comfyui_gguf: the ComfyUI-GGUF checkout's commit; gguf_package.
  uses_files, gguf_files, files: above.
  workflows: per graph the families/flux schema (latent_shape, latent_f32,
      image_shape, image_f32, image_range, f32_vs_f64_unet_rel,
      unet_rounding_rel from the --fp64-unet / --perturb-unet sub-process
      runs), plus
      unet, loras ([class, file, strength_model, strength_clip]);
      without_lora_rel: max |latent - the same graph without the LoRA node|
          / max |that|: what the LoRA moves (asserted far above the spreads);
      without_lora_vs_gguf_fixture_rel: that LoRA-less latent (real
          ComfyUI-GGUF) against gguf/expected.json's latent of the same
          graph (the stand-in): 0 means the stand-in was exact;
      vs_flux_lora_rel: against flux_lora/expected.json's latent of the
          same LoRA on the unquantized safetensors model;
      f16_patch_rounding_rel: the latent moved when the patched F16
          weights are NOT rounded back to f16 (kept f32): what that rounding
          contributes;
      merge: per stored type of the patched weights (Q8_0 / Q4_K / F32 /
          F16): how many keys, the dtype the layer holds, max relative error
          of the weight the layer uses vs the f64 formula, whether every
          value is an f16 value, and the fraction of elements differing from
          f16(f64 formula) (F16 only);
      patch_paths: per stored type, the (caller, weight dtype in,
          intermediate dtype, dtype out, rounded to) tuples observed while the
          workflow ran, and the number of keys;
      model: the loaded model's dtype, manual_cast_dtype, the GGMLOps
          Linear dequant_dtype / patch_dtype.

    COMFY_DIR=/path/to/ComfyUI [COMFY_GGUF_DIR=/path/to/ComfyUI-GGUF] \
        python tools/reference/gguf_lora.py
(Model folders, fixture checks, workflow runs, spreads and per-workflow
fields as the other Flux fixture scripts: fixture_runs.py.)
"""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import flux_pipeline as fp  # noqa: E402
import lora_pipeline as lp  # noqa: E402
import flux_lora as fl  # noqa: E402
import gguf_fixtures as gf  # noqa: E402
import fixture_runs as fr  # noqa: E402

# graph: (GGUF graph of gguf_fixtures.py, LoRA graph of flux_lora.py)
WORKFLOWS = {"tiny_flux_gguf_lora": ("tiny_flux_gguf_q8_0", "tiny_flux_lora_kohya"),
             "tiny_flux_gguf_q4_k_lora": ("tiny_flux_gguf_q4_k", "tiny_flux_lora_diffusers")}
BASE_FILES = ["tiny_clip_l.safetensors", "tiny_t5xxl.safetensors", "tiny_flux_ae.safetensors"]
GGML_TYPE = {"Q8_0": 8, "Q4_K": 12}
PATCHING = {
    "quantized (Q8_0, Q4_K)":
        "GGUFModelPatcher.patch_weight_to_device attaches the patch list to the GGMLTensor "
        "(no merge); GGMLLayer.get_weight at every forward: dequantize_tensor(w, "
        "dtype=input dtype (f32; f64 in the --fp64-unet run), dequant_dtype None: d etc. stay "
        "f16, the block formula in f16 arithmetic, then .to(f32)), then comfy.lora."
        "calculate_weight(patches, weight, key) (patch_dtype None: intermediate_dtype float32): "
        "weight += (strength * alpha / rank) * (up.f32 @ down.f32) in f32; result f32, not rounded",
    "F32": "GGUFModelPatcher.patch_weight_to_device at load, as ComfyUI's ModelPatcher: f32 copy, "
           "calculate_weight in f32, comfy.float.stochastic_rounding(out, float32): stays f32",
    "F16": "GGUFModelPatcher.patch_weight_to_device at load: the tensor keeps the file's f16; f32 "
           "copy, calculate_weight in f32, comfy.float.stochastic_rounding(out, float16) = "
           ".to(float16), round to nearest even; the layer casts it to f32 at forward. "
           "f16_patch_rounding_rel is what this rounding moves the latent",
}


def gguf_nodes_dir():
    d = os.environ.get("COMFY_GGUF_DIR")
    if d:
        return d
    for d in (os.path.join(sd1.COMFY, "custom_nodes", "ComfyUI-GGUF"),
              os.path.join(os.path.dirname(os.path.abspath(sd1.COMFY)), "ComfyUI-GGUF")):
        if os.path.exists(os.path.join(d, "ops.py")):
            return d
    raise SystemExit("ComfyUI-GGUF not found: set COMFY_GGUF_DIR to a checkout of "
                     "https://github.com/city96/ComfyUI-GGUF")


def load_gguf_nodes():
    """ComfyUI-GGUF imported as ComfyUI imports a custom node (a package
    named after its folder; its __init__ imports .nodes)."""
    d = gguf_nodes_dir()
    name = "ComfyUI_GGUF"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(d, "__init__.py"), submodule_search_locations=[d])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    try:
        commit = subprocess.run(["git", "-C", d, "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return mod, sys.modules[name + ".nodes"], sys.modules[name + ".ops"], \
        sys.modules[name + ".dequant"], commit


def graph_for(name):
    """flux_lora.py's LoRA graph with gguf_fixtures.py's UnetLoaderGGUF node."""
    gguf_graph, lora_graph = WORKFLOWS[name]
    g = fl.graph_for(lora_graph)
    gg = fr.load_graph(gguf_graph)
    assert gg["1"]["class_type"] == "UnetLoaderGGUF"
    g["1"] = gg["1"]
    for node in g.values():
        p = node["inputs"].get("filename_prefix")
        if p is not None:
            node["inputs"]["filename_prefix"] = p.replace(lora_graph, name)
    return g


class Tracer:
    """Wraps comfy.lora.calculate_weight and comfy.float.stochastic_rounding
    (looked up by module attribute at call time by both ComfyUI and
    ComfyUI-GGUF) and records, per key, how its patches were applied.
    keep_f16_unrounded: stochastic_rounding to float16 returns the f32
    value instead (the f16_patch_rounding_rel experiment)."""

    def __init__(self, torch):
        import comfy.float
        import comfy.lora
        self.calls = {}
        self.keep_f16_unrounded = False
        self.last = None
        calc, rnd = comfy.lora.calculate_weight, comfy.float.stochastic_rounding

        def calculate_weight(patches, weight, key, *args, **kwargs):
            inter = args[0] if args else kwargs.get("intermediate_dtype", torch.float32)
            caller = sys._getframe(1).f_code.co_name
            out = calc(patches, weight, key, *args, **kwargs)
            rec = (caller, str(weight.dtype), str(inter), str(out.dtype))
            self.last = (key, rec)
            self.calls.setdefault(key, set()).add(rec + ("none",))
            return out

        def stochastic_rounding(value, dtype, *args, **kwargs):
            if self.last is not None:
                key, rec = self.last
                self.calls[key].discard(rec + ("none",))
                self.calls[key].add(rec + (str(dtype),))
                self.last = None
            if self.keep_f16_unrounded and dtype == torch.float16:
                return value.to(torch.float32)
            return rnd(value, dtype, *args, **kwargs)
        comfy.lora.calculate_weight = calculate_weight
        comfy.float.stochastic_rounding = stochastic_rounding


def layer_weight(model, key, is_quantized, torch):
    """The weight the layer of `key` computes with (f32 input), and the
    dtype it holds."""
    import comfy.utils
    mod = comfy.utils.get_attr(model.model, key[:-len(".weight")])
    w = mod.weight
    if is_quantized(w):
        return mod.get_weight(w, torch.float32), "GGMLTensor " + str(w.tensor_type.name)
    return w.detach().to(torch.float32), str(w.dtype).replace("torch.", "")


def check_merge(name, gnodes, dq, nodes, torch, specs, lora_data, gguf_desc, tmp, log):
    """The LoRA on the GGUF model, loaded as the sampler loads it: the patch
    set is exactly the targets, and each patched weight the layer uses
    against the f64 formula on the dequantized (f16-math) base."""
    import comfy.model_management
    from safetensors.torch import load_file
    (unet, lora, strength) = workflow_spec(name)
    (m0,) = gnodes.UnetLoaderGGUF().load_unet(unet)
    del log.records[:]
    (m,) = nodes.LoraLoaderModelOnly().load_lora_model_only(m0, lora, strength)
    assert not log.problems(), log.problems()
    assert type(m).__name__ == "GGUFModelPatcher", type(m)
    targets = specs[lora]
    assert set(m.patches) == {t.key for t in targets}, set(m.patches) ^ {t.key for t in targets}
    base = load_file(os.path.join(tmp, "unet",
                                  unet[:-len(".gguf")] + ".dequant_default.safetensors"))
    types_ = {t["name"]: t["type"] for t in gguf_desc["tensors"]}
    comfy.model_management.load_models_gpu([m])
    out = {}
    by_key = {}
    for t in targets:  # sliced targets (q, k, v of one qkv) share a key
        by_key.setdefault(t.key, []).append(t)
    try:
        for k, ts in by_key.items():
            sk = k[len("diffusion_model."):]
            kind = types_[sk]
            w, held = layer_weight(m, k, dq.is_quantized, torch)
            w = w.double().numpy()
            b = base[sk].double().numpy()
            ref = b.copy()
            for t in ts:
                ref = ref + strength * t.delta(lora_data[lora], list(b.shape), torch)
            err = float(np.abs(w - ref).max() / np.abs(ref).max())
            change = float(np.abs(w - b).max() / np.abs(b).max())
            is_f16 = bool(np.array_equal(w.astype(np.float16).astype(np.float64), w))
            r = out.setdefault(kind, {"keys": 0, "held_as": set(),
                                      "max_rel_err_vs_f64_formula": 0.0,
                                      "all_f16_values": True, "least_rel_change": 1.0})
            r["keys"] += 1
            r["held_as"].add(held)
            r["max_rel_err_vs_f64_formula"] = max(r["max_rel_err_vs_f64_formula"], err)
            r["all_f16_values"] = r["all_f16_values"] and is_f16
            r["least_rel_change"] = min(r["least_rel_change"], change)
            if kind == "F16":
                assert held == "float16" and is_f16, (k, held)
                assert err < 2.0 ** -10, (name, k, err)
                diff = w != ref.astype(np.float16).astype(np.float64)
                r["frac_not_f16_of_f64_formula"] = max(r.get("frac_not_f16_of_f64_formula", 0.0),
                                                       float(diff.mean()))
            else:
                assert err < 2.0 ** -20, (name, k, kind, err)
            assert change > 1e-3, (name, k, change)
    finally:
        comfy.model_management.unload_all_models()
    for r in out.values():
        r["held_as"] = sorted(r["held_as"])
    print("merge", name, json.dumps(out))
    return out


def workflow_spec(name):
    """(gguf file, LoRA file, strength_model)"""
    gguf_graph, lora_graph = WORKFLOWS[name]
    ((cls, lora, sm, sc),) = fl.WORKFLOWS[lora_graph]
    assert cls == "LoraLoaderModelOnly" and sc is None
    unet = fr.load_graph(gguf_graph)["1"]["inputs"]["unet_name"]
    return unet, lora, sm


def main():
    fp64, perturb, torch = sd1.start_comfy()
    torch.set_num_threads(1)
    sub = fp64 or perturb
    import comfy.model_management
    import nodes

    log = lp.LogCapture()
    with fr.comfy_tmp(torch, ["unet", "clip", "vae", "loras"], log) as tmp:
        gguf_ref, lora_ref = fr.fixture("gguf"), fr.fixture("flux_lora")
        # base files (tiny_flux_dev too: flux_lora.lora_specs loads it)
        fr.write_flux_files(tmp, BASE_FILES + ["tiny_flux_dev.safetensors"], torch)

        # the GGUF files, rebuilt and compared with gguf/expected.json whole
        used = [workflow_spec(n) for n in WORKFLOWS]
        made = {f["name"]: json.loads(json.dumps(f)) for f in gf.make_flux(tmp, False)}
        gguf_ref_files = {f["name"]: f for f in gguf_ref["gguf_files"]}
        gguf_files = []
        for unet in dict.fromkeys(u for u, _, _ in used):
            assert made[unet] == gguf_ref_files[unet], unet
            e = gguf_ref_files[unet]
            gguf_files.append({"folder": e["folder"], "name": unet,
                               "fixture": "gguf/expected.json gguf_files",
                               "target_type": e["target_type"],
                               "ggml_type": GGML_TYPE[e["target_type"]],
                               "llama_ftype": e["llama_ftype"], "type_counts": e["type_counts"],
                               "file_size": e["header"]["file_size"],
                               "sha256": e["header"]["sha256"]})

        # the LoRA files, written from flux_lora/expected.json's entries
        lora_entries = {f["name"]: f for f in lora_ref["files"]}
        files, lora_data = [], {}
        for lora in dict.fromkeys(lo for _, lo, _ in used):
            e = lora_entries[lora]
            keys = [(k, list(s)) for k, s in e["keys"]]
            digest = lp.write_lora(os.path.join(tmp, e["folder"], lora), keys, e["scaled"],
                                   e["alphas"], torch)
            assert str(digest) == e["checksum_f16"], lora
            files.append(e)
            lora_data[lora] = (keys, e["scaled"], e["alphas"])

        gmod, gnodes, gops, dq, commit = load_gguf_nodes()
        assert {"UnetLoaderGGUF", "UnetLoaderGGUFAdvanced"} <= set(gmod.NODE_CLASS_MAPPINGS)
        tracer = Tracer(torch)
        node_ns = fr.node_classes(nodes, fp.v3_nodes(), gmod.NODE_CLASS_MAPPINGS)

        for name in WORKFLOWS:
            if not os.path.exists(fr.graph_path(name)) and not sub:
                fr.write_graph(name, graph_for(name))
        specs = None
        if not sub:
            # flux_lora's targets (keys looked up in ComfyUI's key maps) give
            # the same files as the fixture entries
            specs = fr.lora_specs(nodes)
            for lora, (keys, scaled, alphas) in lora_data.items():
                k2, s2, a2 = fl.file_keys(specs[lora])
                assert (k2, s2, a2) == (keys, scaled, alphas), lora
            # the GGUF models as UnetLoaderGGUF builds them
            model_info = {}
            for unet in dict.fromkeys(u for u, _, _ in used):
                (m,) = gnodes.UnetLoaderGGUF().load_unet(unet)
                mm = m.model
                info = model_info[unet] = {
                    "patcher": type(m).__name__, "model_config": type(mm.model_config).__name__,
                    "dtype": str(mm.get_dtype()), "manual_cast_dtype": str(mm.manual_cast_dtype),
                    "Linear.dequant_dtype": str(gops.GGMLOps.Linear.dequant_dtype),
                    "Linear.patch_dtype": str(gops.GGMLOps.Linear.patch_dtype)}
                assert info["model_config"] == "Flux" and info["dtype"] == "torch.float32"
                assert gops.GGMLOps.Linear.dequant_dtype is None
                assert gops.GGMLOps.Linear.patch_dtype is None
                print("model", unet, info)
                del m, mm
            merges = {n: check_merge(n, gnodes, dq, nodes, torch, specs, lora_data,
                                     made[workflow_spec(n)[0]], tmp, log) for n in WORKFLOWS}
            runs = sd1.spread_runs(__file__)

        out = {"comfyui_gguf": {"repo": "https://github.com/city96/ComfyUI-GGUF", "commit": commit},
               "gguf_package": gf.gguf_version(),
               "uses_files": {"flux/expected.json": BASE_FILES,
                              "gguf/expected.json": [f["name"] for f in gguf_files],
                              "flux_lora/expected.json": [f["name"] for f in files]},
               "gguf_files": gguf_files, "files": files, "patching": PATCHING, "workflows": {}}
        for name, (gguf_graph, lora_graph) in WORKFLOWS.items():
            unet, lora, strength = workflow_spec(name)
            prompt = fr.load_graph(name)
            assert prompt == graph_for(name), name
            tracer.calls.clear()
            lat, img = fr.run(name, prompt, node_ns, torch, log)
            if sub:
                out["workflows"][name] = fr.f32_b64(lat)
                continue
            types_ = {t["name"]: t["type"] for t in made[unet]["tensors"]}
            paths = {}
            for k, recs in tracer.calls.items():
                kind = types_[k[len("diffusion_model."):]]
                p = paths.setdefault(kind, {"keys": 0, "calls": set()})
                p["keys"] += 1
                p["calls"] |= recs
            assert sum(p["keys"] for p in paths.values()) == len({t.key for t in specs[lora]}), name
            for kind, p in paths.items():
                p["calls"] = sorted(list(c) for c in p["calls"])
                for caller, w_in, inter, w_out, rounded in p["calls"]:
                    assert inter == "torch.float32" and w_out == "torch.float32", (kind, p)
                    if kind in GGML_TYPE:
                        assert (caller, w_in, rounded) == ("get_weight", "torch.float32", "none")
                    else:
                        assert caller == "patch_weight_to_device" and w_in == "torch.float32"
                        assert rounded == "torch." + {"F16": "float16", "F32": "float32"}[kind]
            clipped = fr.check_image(name, img)

            _, plain = sd1.run_workflow(lp.without_loras(prompt), node_ns, torch)
            plain = plain[0].float().numpy()
            stand_in = fr.latent_of(gguf_ref["workflows"][gguf_graph])
            plain_vs_fixture = fr.rel(plain, stand_in)
            assert plain_vs_fixture < 1e-6, (name, plain_vs_fixture)
            tracer.keep_f16_unrounded = True
            try:
                _, unrounded = sd1.run_workflow(prompt, node_ns, torch)
            finally:
                tracer.keep_f16_unrounded = False
                comfy.model_management.unload_all_models()

            w = out["workflows"][name] = {
                "unet": unet, "loras": [["LoraLoaderModelOnly", lora, strength, None]],
                **fr.spreads(name, lat, runs),
                "without_lora_rel": fr.rel(lat, plain),
                "without_lora_vs_gguf_fixture_rel": plain_vs_fixture,
                "vs_flux_lora_rel": fr.rel(lat, fr.latent_of(lora_ref["workflows"][lora_graph])),
                "f16_patch_rounding_rel": fr.rel(unrounded[0].float().numpy(), lat),
                "merge": merges[name], "patch_paths": paths, "model": model_info[unet],
                **fr.outputs(lat, img),
            }
            spread = max(w["f32_vs_f64_unet_rel"], w["unet_rounding_rel"])
            assert w["without_lora_rel"] > 1e-3 and w["without_lora_rel"] > 1000 * spread, w
            print(name, *fr.summary(lat, img, w, clipped),
                  "without LoRA", w["without_lora_rel"], "(that vs gguf fixture",
                  plain_vs_fixture, ") vs flux_lora", w["vs_flux_lora_rel"],
                  "f16 patch rounding", w["f16_patch_rounding_rel"])
            print("   patch paths", json.dumps(paths))
        fr.finish("gguf_lora", out, sub)


if __name__ == "__main__":
    main()
