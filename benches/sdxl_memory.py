"""Memory and time benchmark: a full-size SDXL checkpoint on the CPU.

Builds a random-weight SDXL base checkpoint in the real single-file layout
(keys and shapes from ComfyUI's own UNetModel with SDXL's config, its
CLIPTextModel for CLIP-L and, converted to the OpenCLIP layout by
ComfyUI's own saving code, for OpenCLIP-bigG, and AutoencoderKL; values
from tools/reference/sd1_pipeline.py's formula; f16, ~6.9 GB), written once
to $SDKIT_BENCH_DIR (default /tmp/sdkit-sdxl-bench). Then runs the same
workflow — CheckpointLoaderSimple, two CLIPTextEncodes, EmptyLatentImage
1024x1024, KSampler (1 euler step, CFG 7: one UNet call on a batch of 2),
VAEDecode, SaveImage — with `sdkit run --device cpu` and with ComfyUI's
own nodes (`--cpu`, PyTorch cross attention), each in its own process, and
prints each one's wall time and peak RSS (from wait4) beside the
checkpoint's size, and how far the two images are apart.

    cargo build --release
    COMFY_DIR=/path/to/ComfyUI python benches/sdxl_memory.py [--steps N]
"""
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.environ.get("SDKIT_BENCH_DIR", "/tmp/sdkit-sdxl-bench")
CKPT = "sdxl_random.safetensors"

UNET = dict(in_channels=4, out_channels=4, model_channels=320, channel_mult=[1, 2, 4],
            num_res_blocks=[2, 2, 2], transformer_depth=[0, 0, 2, 2, 10, 10],
            transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10],
            transformer_depth_middle=10, use_linear_in_transformer=True, context_dim=2048,
            num_heads=-1, num_head_channels=64, adm_in_channels=2816)
VAE = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3,
       "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [],
       "dropout": 0.0}


def module(rel, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


def comfy_env():
    """ComfyUI importable, on the CPU; the reference helpers loaded."""
    sd1 = module("tools/reference/sd1_pipeline.py", "sd1_pipeline")
    fam = module("tools/reference/families_pipeline.py", "families_pipeline")
    sys.meta_path.insert(0, sd1._StubFinder())
    sys.path.insert(0, sd1.COMFY)
    sys.argv = [sys.argv[0], "--cpu", "--use-pytorch-cross-attention"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import torch
    torch.set_grad_enabled(False)
    import comfy.sd  # noqa: F401
    return sd1, fam, torch


def sdxl_keys(fam, torch):
    import comfy.clip_model
    from comfy.ldm.models.autoencoder import AutoencoderKL
    cfg_dir = os.path.dirname(comfy.clip_model.__file__)
    with open(os.path.join(cfg_dir, "sd1_clip_config.json")) as f:
        clip_l = json.load(f)
    with open(os.path.join(cfg_dir, "clip_config_bigg.json")) as f:
        clip_g = json.load(f)
    with torch.device("meta"):
        vae = AutoencoderKL(ddconfig=VAE, embed_dim=4)
    parts = [("model.diffusion_model.", fam.unet_keys(torch, UNET)),
             ("first_stage_model.", [(k, list(t.shape)) for k, t in vae.state_dict().items()]),
             ("conditioner.embedders.0.transformer.", fam.clip_hf_keys(torch, clip_l, False)),
             ("conditioner.embedders.1.model.", fam.open_clip_keys(torch, clip_g))]
    return sorted((p + k, s) for p, keys in parts for k, s in keys)


def workflow(steps):
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["4", 1], "text": "a glass bottle with a galaxy inside, evening sunset"}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["4", 1], "text": "text, watermark"}},
        "3": {"class_type": "KSampler", "inputs": {"model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0], "seed": 42, "steps": steps, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "bench"}},
    }


def comfy_child(steps):
    """Runs the workflow through ComfyUI's nodes; writes the image as .npy."""
    sd1, _, torch = comfy_env()
    import folder_paths
    import nodes
    folder_paths.add_model_folder_path("checkpoints", os.path.join(BENCH, "models", "checkpoints"), is_default=True)
    saved, _ = sd1.run_workflow(workflow(steps), nodes, torch)
    img = np.clip(255.0 * saved[0][0].float().numpy(), 0, 255).astype(np.uint8)
    np.save(os.path.join(BENCH, "comfy.npy"), img)


def measured(cmd):
    """Wall time and peak RSS (bytes) of a child process."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if status != 0:
        sys.exit(f"{cmd[0]} failed ({status})")
    return wall, usage.ru_maxrss * 1024


def main():
    steps = 1
    if "--steps" in sys.argv:
        steps = int(sys.argv[sys.argv.index("--steps") + 1])
    if "--comfy-child" in sys.argv:
        comfy_child(steps)
        return
    ckpt_dir = os.path.join(BENCH, "models", "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    ckpt = os.path.join(ckpt_dir, CKPT)
    if not os.path.exists(ckpt):
        sd1, fam, torch = comfy_env()
        t = time.perf_counter()
        fam.write_file(ckpt, sdxl_keys(fam, torch), {}, torch)
        print(f"wrote {ckpt} in {time.perf_counter() - t:.1f} s")
    size = os.path.getsize(ckpt)
    graph = os.path.join(BENCH, "bench.json")
    with open(graph, "w") as f:
        json.dump(workflow(steps), f)
    out_dir = os.path.join(BENCH, "output")
    for f in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if f.startswith("bench_"):
            os.remove(os.path.join(out_dir, f))
    out = os.path.join(out_dir, "bench_00001_.png")
    exe = os.path.join(ROOT, "target", "release", "sdkit")
    t_sdkit, rss_sdkit = measured([exe, "run", "-q", "--device", "cpu", graph, "--base-dir", BENCH])
    t_comfy, rss_comfy = measured([sys.executable, os.path.abspath(__file__), "--comfy-child",
                                   "--steps", str(steps)])
    from PIL import Image
    ours = np.asarray(Image.open(out).convert("RGB")).astype(int)
    theirs = np.load(os.path.join(BENCH, "comfy.npy")).astype(int)
    diff = np.abs(ours - theirs)
    gib = 1 << 30
    print(f"SDXL 1024x1024, {steps} euler step(s) at CFG 7 + VAE decode, CPU")
    print(f"checkpoint {size / gib:.2f} GiB (f16)")
    print(f"sdkit   {t_sdkit:8.1f} s  peak RSS {rss_sdkit / gib:6.2f} GiB ({rss_sdkit / size:.2f}x checkpoint)")
    print(f"ComfyUI {t_comfy:8.1f} s  peak RSS {rss_comfy / gib:6.2f} GiB ({rss_comfy / size:.2f}x checkpoint)")
    print(f"sdkit/ComfyUI time {t_sdkit / t_comfy:.2f}x; image max diff {diff.max()}/255, "
          f"mean {diff.mean():.4f}, {np.count_nonzero(diff)} of {diff.size} values differ")


if __name__ == "__main__":
    main()
