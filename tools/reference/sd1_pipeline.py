"""End-to-end references for SD1 workflows (tests/sd1_pipeline.rs).

Builds a tiny SD1 checkpoint in the real single-file layout
(`model.diffusion_model.*`, `first_stage_model.*`,
`cond_stage_model.transformer.text_model.*`, stored f16) whose keys and
shapes come from ComfyUI's own UNetModel, AutoencoderKL and CLIPTextModel,
with every value from an integer-hash formula that tests/sd1_pipeline.rs
repeats bit for bit. Then runs the workflows in graphs/tiny_sd1_*.json
through ComfyUI's own node classes (CheckpointLoaderSimple, CLIPSetLastLayer,
CLIPTextEncode, KSampler, VAEEncode, VAEDecode, their tiled forms,
LoadImage, ImageScale), on
the CPU in f32, and writes tests/reference/sd1/expected.json: the key list
with shapes, a checksum of the f16 weights, and for each workflow the
latent SaveLatent gets and the image SaveImage gets (f32).

ComfyUI only recognises full-size SD1 parts, so three size checks are
relaxed for the tiny file, nothing else: SD15's model_channels/context_dim
match, the CLIP text config (a 64-wide, 3-layer, 1-head CLIP here) and the
VAE width (ComfyUI hard-codes ch 128, ch_mult [1,2,4,4]; the same
AutoencoderKL class is built with ch 32, ch_mult [1,1,2,2]).

    COMFY_DIR=/path/to/ComfyUI python tools/reference/sd1_pipeline.py
(a ComfyUI checkout with its requirements; torchvision and other
media-only imports may be absent: they are stubbed.)
"""
import base64
import importlib.abc
import importlib.machinery
import json
import os
import shutil
import sys
import tempfile
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMFY = os.environ.get("COMFY_DIR", "/work/comfyfull")
CKPT = "tiny_sd1.safetensors"
WORKFLOWS = ["tiny_sd1_txt2img", "tiny_sd1_img2img", "tiny_sd1_ancestral",
             "tiny_sd1_advanced", "tiny_sd1_cfgpp", "tiny_sd1_custom",
             "tiny_sd1_vpred", "tiny_sd1_flow", "tiny_sd1_flux", "tiny_sd1_lcm",
             "tiny_sd1_zsnr", "tiny_sd1_guiders", "tiny_sd1_tiled"]

UNET = dict(in_channels=4, out_channels=4, model_channels=32, channel_mult=[1, 2],
            num_res_blocks=[1, 1], transformer_depth=[1, 1],
            transformer_depth_output=[1, 1, 1, 1], transformer_depth_middle=1,
            use_linear_in_transformer=False, context_dim=64, num_heads=8)
CLIP = {"architectures": ["CLIPTextModel"], "attention_dropout": 0.0, "bos_token_id": 0,
        "dropout": 0.0, "eos_token_id": 49407, "hidden_act": "quick_gelu",
        "hidden_size": 64, "initializer_factor": 1.0, "initializer_range": 0.02,
        "intermediate_size": 128, "layer_norm_eps": 1e-05, "max_position_embeddings": 77,
        "model_type": "clip_text_model", "num_attention_heads": 1, "num_hidden_layers": 3,
        "pad_token_id": 1, "projection_dim": 64, "vocab_size": 49408}
VAE = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3,
       "ch": 32, "ch_mult": [1, 1, 2, 2], "num_res_blocks": 1, "attn_resolutions": [],
       "dropout": 0.0}

MASK = (1 << 64) - 1


class _Stub(types.ModuleType):
    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return _Stub(self.__name__ + "." + k)

    def __call__(self, *a, **k):
        return _Stub("call")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Media-only packages ComfyUI imports at start-up but these nodes never
    use."""
    NAMES = {"torchvision", "av", "spandrel", "kornia"}

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in self.NAMES:
            return None
        # The real package wins where it is installed.
        for finder in sys.meta_path:
            if finder is not self and getattr(finder, "find_spec", None):
                if finder.find_spec(name, path, target) is not None:
                    return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, m):
        m.__path__ = []


def fnv1a(name):
    h = 0xcbf29ce484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001b3) & MASK
    return h


def values(name, shape):
    """The weight formula (tests/sd1_pipeline.rs has the same): splitmix64 of
    the name's FNV-1a hash mixed with the index, its top 24 bits as a float
    in [-1, 1), then scaled: biases by 0.05, norm scales 1 + 0.1 u, the rest
    by 1/sqrt(fan-in). All steps are exact or correctly rounded f32."""
    n = int(np.prod(shape)) if shape else 1
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(fnv1a(name)) ^ (i * np.uint64(0x9E3779B97F4A7C15))
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24) * np.float32(2) - np.float32(1)
    if name.endswith("bias"):
        v = np.float32(0.05) * u
    elif len(shape) == 1:
        v = np.float32(1) + np.float32(0.1) * u
    else:
        fan_in = n // shape[0]
        v = u * np.float32(1.0 / np.sqrt(np.float64(fan_in)))
    return v.astype(np.float32).reshape(shape)


def checkpoint_keys(torch):
    import comfy.clip_model
    import comfy.ops
    from comfy.ldm.models.autoencoder import AutoencoderKL
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    ops = comfy.ops.disable_weight_init
    c = UNET
    unet = UNetModel(image_size=None, in_channels=c["in_channels"],
                     model_channels=c["model_channels"], out_channels=c["out_channels"],
                     num_res_blocks=c["num_res_blocks"], channel_mult=c["channel_mult"],
                     num_heads=c["num_heads"], use_spatial_transformer=True,
                     transformer_depth=c["transformer_depth"],
                     transformer_depth_output=c["transformer_depth_output"],
                     transformer_depth_middle=c["transformer_depth_middle"],
                     context_dim=c["context_dim"],
                     use_linear_in_transformer=c["use_linear_in_transformer"],
                     legacy=False, device="meta", operations=ops)
    vae = AutoencoderKL(ddconfig=VAE, embed_dim=4)
    clip = comfy.clip_model.CLIPTextModel(CLIP, torch.float32, "meta", ops)
    keys = []
    for prefix, m in [("model.diffusion_model.", unet), ("first_stage_model.", vae),
                      ("cond_stage_model.transformer.", clip)]:
        for k, t in m.state_dict().items():
            # SD1 checkpoints carry no text projection (ComfyUI's class has one).
            if k.startswith("text_projection"):
                continue
            keys.append((prefix + k, list(t.shape)))
    keys.sort()
    return keys


def checksum(bits, index):
    """A position-weighted sum of a tensor's f16 bit patterns (mod 2^64),
    times its index in key order plus one; tests/sd1_pipeline.rs repeats it
    to prove both sides made the same weights."""
    b = bits.reshape(-1).astype(np.uint64)
    w = (np.arange(b.size, dtype=np.uint64) % np.uint64(65521)) + np.uint64(1)
    with np.errstate(over="ignore"):
        return int((b * w).sum(dtype=np.uint64)) * (index + 1) % (1 << 64)


def write_checkpoint(path, keys, torch):
    from safetensors.torch import save_file
    tensors, total = {}, 0
    for i, (k, shape) in enumerate(keys):
        v = values(k, shape).astype(np.float16)
        total = (total + checksum(v.view(np.uint16), i)) % (1 << 64)
        tensors[k] = torch.from_numpy(v)
    save_file(tensors, path)
    return total


def patch_comfy(tmp):
    import comfy.sd
    import comfy.sd1_clip
    import comfy.supported_models
    from comfy.ldm.models.autoencoder import AutoencoderKL  # noqa: F401

    comfy.supported_models.SD15.unet_config = {
        "use_linear_in_transformer": False, "adm_in_channels": None,
        "use_temporal_attention": False}
    cfg = os.path.join(tmp, "tiny_clip_config.json")
    with open(cfg, "w") as f:
        json.dump(CLIP, f)
    init = comfy.sd1_clip.SDClipModel.__init__
    names = init.__code__.co_varnames[1:init.__code__.co_argcount]
    defaults = list(init.__defaults__)
    defaults[names.index("textmodel_json_config") - (len(names) - len(defaults))] = cfg
    init.__defaults__ = tuple(defaults)

    vae_init = comfy.sd.VAE.__init__

    def tiny_vae(self, sd=None, device=None, config=None, dtype=None, metadata=None):
        if config is None and "decoder.conv_in.weight" in sd:
            config = {"params": {"ddconfig": VAE, "embed_dim": 4}}
        vae_init(self, sd=sd, device=device, config=config, dtype=dtype, metadata=metadata)

    comfy.sd.VAE.__init__ = tiny_vae


def start_comfy():
    """ComfyUI importable on the CPU, for a reference script's main():
    media-only packages stubbed, its argument parser given `--cpu` (and
    `--fp64-unet` for a `--fp64-unet` run), gradients off, and for a
    `--perturb-unet` run the perturbation installed. Returns (fp64,
    perturb, torch)."""
    fp64 = "--fp64-unet" in sys.argv
    perturb = "--perturb-unet" in sys.argv
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, COMFY)
    sys.argv = [sys.argv[0], "--cpu"] + (["--fp64-unet"] if fp64 else [])
    import comfy.options
    comfy.options.enable_args_parsing()
    import torch
    torch.set_grad_enabled(False)
    import comfy.sd  # noqa: F401
    if perturb:
        install_perturbation(torch)
    return fp64, perturb, torch


def install_perturbation(torch):
    """`--perturb-unet`: the initial noise and every UNet output times
    (1 + 2^-23 z), z standard normal from one seeded generator."""
    import comfy.model_base
    import comfy.sample
    apply = comfy.model_base.BaseModel._apply_model
    gen = torch.Generator().manual_seed(7)

    def perturbed(self, *args, **kwargs):
        out = apply(self, *args, **kwargs)
        return out * (1 + 2.0 ** -23 * torch.randn(out.shape, generator=gen))
    comfy.model_base.BaseModel._apply_model = perturbed
    prepare = comfy.sample.prepare_noise

    def perturbed_noise(*args, **kwargs):
        n = prepare(*args, **kwargs)
        return n * (1 + 2.0 ** -23 * torch.randn(n.shape, generator=gen))
    comfy.sample.prepare_noise = perturbed_noise


def run_workflow(prompt, nodes, torch, times=None):
    """ComfyUI's execution, reduced to what these graphs need: inputs
    resolved depth-first, each node's FUNCTION called once, SaveImage
    SaveLatent captured instead of written. `times`, if given, receives
    each node's own seconds (its inputs are computed before it starts)."""
    import time
    results, saved, latents = {}, [], []
    import comfy_extras.nodes_custom_sampler as custom
    import comfy_extras.nodes_model_advanced as advanced
    EXTRA = {**custom.NODE_CLASS_MAPPINGS, **advanced.NODE_CLASS_MAPPINGS}

    def output(nid):
        if nid not in results:
            node = prompt[nid]
            kwargs = {}
            for name, v in node["inputs"].items():
                if isinstance(v, list):
                    kwargs[name] = output(v[0])[v[1]]
                else:
                    kwargs[name] = v
            if node["class_type"] == "SaveImage":
                saved.append(kwargs["images"])
                results[nid] = ()
            elif node["class_type"] == "SaveLatent":
                latents.append(kwargs["samples"]["samples"])
                results[nid] = ()
            else:
                cls = nodes.NODE_CLASS_MAPPINGS.get(node["class_type"]) or EXTRA[node["class_type"]]
                obj = cls()
                # ComfyUI's executor runs nodes in inference mode (the tiled
                # VAE code updates inference tensors in place).
                start = time.perf_counter()
                with torch.inference_mode():
                    results[nid] = getattr(obj, cls.FUNCTION)(**kwargs)
                if times is not None:
                    times[nid] = time.perf_counter() - start
        return results[nid]

    for nid in prompt:
        output(nid)
    return saved, latents


def write_expected(name, out):
    """Writes `out` as tests/reference/NAME/expected.json (the layout every
    reference script shares)."""
    dst = os.path.join(ROOT, "tests", "reference", name)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "expected.json"), "w") as f:
        json.dump(out, f, indent=0)
        f.write("\n")


def spread_runs(script):
    """The workflows' latents of `script` run again in fresh processes with
    the UNet in f64 (`--fp64-unet`) and perturbed (`--perturb-unet`): the
    reference's own float spreads, which the Rust tests scale their
    tolerances by."""
    import subprocess

    def run(flag):
        res = subprocess.run([sys.executable, os.path.abspath(script), flag],
                             check=True, capture_output=True, text=True)
        return json.loads(res.stdout.strip().splitlines()[-1])
    return run("--fp64-unet"), run("--perturb-unet")


def b64(a):
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()


def main():
    # `--fp64-unet`: the same run with ComfyUI's UNet in float64, printing
    # the latents as JSON; the normal run calls itself this way to measure
    # how far float32 rounding alone moves the reference (the spread the
    # tests' tolerances are set against).
    # `--perturb-unet`: the same run with the initial noise and each UNet
    # output multiplied by (1 + 2^-23·z), z standard normal: the spread
    # that float32 rounding differences alone cause (sdkit's noise is
    # within a few ulps of torch.randn, its UNet sums in another order).
    # Where a sampler step is ill-conditioned (zsnr's first sigma of 4519:
    # x + d·dt cancels ~10 bits) that spread is far larger than the f64
    # one.
    fp64 = "--fp64-unet" in sys.argv
    perturb = "--perturb-unet" in sys.argv
    sub = fp64 or perturb
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, COMFY)
    sys.argv = [sys.argv[0], "--cpu"] + (["--fp64-unet"] if fp64 else [])
    import comfy.options
    comfy.options.enable_args_parsing()
    import torch
    torch.set_grad_enabled(False)
    import comfy.sd  # noqa: F401
    if perturb:
        install_perturbation(torch)
    import folder_paths
    import nodes

    tmp = tempfile.mkdtemp()
    try:
        patch_comfy(tmp)
        keys = checkpoint_keys(torch)
        ckpt_dir = os.path.join(tmp, "checkpoints")
        os.makedirs(ckpt_dir)
        digest = write_checkpoint(os.path.join(ckpt_dir, CKPT), keys, torch)
        folder_paths.add_model_folder_path("checkpoints", ckpt_dir, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))

        out = {"checkpoint": CKPT, "keys": keys, "checksum_f16": str(digest), "workflows": {}}
        if not sub:
            import subprocess

            f64_latents, perturbed_latents = spread_runs(__file__)
        for name in WORKFLOWS:
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            saved, latents = run_workflow(prompt, nodes, torch)
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            if sub:
                out["workflows"][name] = b64(lat.astype("<f4"))
                continue

            def spread_to(latents):
                other = np.frombuffer(base64.b64decode(latents[name]), "<f4")
                return float(np.abs(lat.reshape(-1) - other).max() / np.abs(other).max())
            spread = spread_to(f64_latents)
            out["workflows"][name] = {
                "f32_vs_f64_unet_rel": spread,
                "unet_rounding_rel": spread_to(perturbed_latents),
                "latent_shape": list(lat.shape), "latent_f32": b64(lat.astype("<f4")),
                "image_shape": list(img.shape), "image_f32": b64(img.astype("<f4")),
            }
            print(name, "latent", lat.shape, float(np.abs(lat).mean()),
                  "image", img.shape, float(img.mean()), "f32 vs f64 UNet", spread,
                  "UNet rounding", out["workflows"][name]["unet_rounding_rel"])
        if sub:
            print(json.dumps(out["workflows"]))
            return
        write_expected("sd1", out)
        print("keys", len(keys), "checksum", digest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
