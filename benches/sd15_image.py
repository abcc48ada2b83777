"""Whole-image benchmark: SD1.5 txt2img, 512x512, 20 euler steps, CFG, on
the CPU — sdkit (`sdkit run --device cpu`, release build, with
`--precision f32` and with `--precision auto`: bf16 products where the CPU
has AMX) beside ComfyUI's own nodes on the same workflow and the same
random-weight checkpoint, in the same run, each in its own process. Prints
wall times (process start to image), peak RSS, the ratios, and how far the
images are apart (f32 should equal ComfyUI's up to float rounding: the same
seed gives the same image; bf16 is compared with both).

The checkpoint is full-size SD1.5 in the real single-file layout (keys and
shapes from ComfyUI's UNetModel / AutoencoderKL / CLIPTextModel with SD1.5's
configs; values from tools/reference/sd1_pipeline.py's formula; f16),
written once to $SDKIT_BENCH_DIR (default /tmp/sdkit-sd15-bench, ~2 GB).

    cargo build --release
    COMFY_DIR=/path/to/ComfyUI python benches/sd15_image.py [--steps N]

Both sides use every core (or RAYON_NUM_THREADS / torch's default).
"""
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.environ.get("SDKIT_BENCH_DIR", "/tmp/sdkit-sd15-bench")
CKPT = "sd15_random.safetensors"


def reference_module():
    path = os.path.join(ROOT, "tools", "reference", "sd1_pipeline.py")
    spec = importlib.util.spec_from_file_location("sd1_pipeline", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def sd15_keys(torch):
    import comfy.clip_model
    import comfy.ops
    from comfy.ldm.models.autoencoder import AutoencoderKL
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    ops = comfy.ops.disable_weight_init
    unet = UNetModel(image_size=None, in_channels=4, model_channels=320, out_channels=4,
                     num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4], num_heads=8,
                     use_spatial_transformer=True, transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                     transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                     transformer_depth_middle=1, context_dim=768,
                     use_linear_in_transformer=False, legacy=False, device="meta",
                     operations=ops)
    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3,
                "out_ch": 3, "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                "attn_resolutions": [], "dropout": 0.0}
    with torch.device("meta"):
        vae = AutoencoderKL(ddconfig=ddconfig, embed_dim=4)
    with open(os.path.join(os.path.dirname(comfy.clip_model.__file__), "sd1_clip_config.json")) as f:
        clip_cfg = json.load(f)
    clip = comfy.clip_model.CLIPTextModel(clip_cfg, torch.float32, "meta", ops)
    keys = []
    for prefix, m in [("model.diffusion_model.", unet), ("first_stage_model.", vae),
                      ("cond_stage_model.transformer.", clip)]:
        for k, t in m.state_dict().items():
            if not k.startswith("text_projection"):
                keys.append((prefix + k, list(t.shape)))
    keys.sort()
    return keys


def wait_rss(proc):
    """Waits for a child; its peak RSS in GiB."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{proc.args} failed: {proc.returncode}")
    return usage.ru_maxrss / 2**20


def main():
    steps = 20
    if "--steps" in sys.argv:
        steps = int(sys.argv[sys.argv.index("--steps") + 1])
    argv = list(sys.argv)
    ref = reference_module()
    sys.meta_path.insert(0, ref._StubFinder())
    sys.path.insert(0, ref.COMFY)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import torch
    torch.set_grad_enabled(False)
    import comfy.sd  # noqa: F401
    import folder_paths
    import nodes

    ckpt_dir = os.path.join(BENCH, "models", "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    ckpt = os.path.join(ckpt_dir, CKPT)
    if not os.path.exists(ckpt):
        t = time.perf_counter()
        ref.write_checkpoint(ckpt, sd15_keys(torch), torch)
        print(f"wrote {ckpt} in {time.perf_counter() - t:.1f} s")
    folder_paths.add_model_folder_path("checkpoints", ckpt_dir, is_default=True)

    with open(os.path.join(ROOT, "graphs", "sd15_txt2img.json")) as f:
        prompt = json.load(f)
    prompt["4"]["inputs"]["ckpt_name"] = CKPT
    prompt["3"]["inputs"]["steps"] = steps
    prompt["3"]["inputs"]["seed"] = 42
    prompt["9"]["inputs"]["filename_prefix"] = "bench"
    graph = os.path.join(BENCH, "bench.json")
    with open(graph, "w") as f:
        json.dump(prompt, f)

    out_dir = os.path.join(BENCH, "output")
    for f in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if f.startswith("bench_"):
            os.remove(os.path.join(out_dir, f))
    if "--comfy-child" in argv:
        times = {}
        saved, _ = ref.run_workflow(prompt, nodes, torch, times)
        np.save(os.path.join(BENCH, "comfy.npy"), saved[0][0].float().numpy())
        with open(os.path.join(BENCH, "comfy_times.json"), "w") as f:
            json.dump(times, f)
        return

    from PIL import Image

    exe = os.path.join(ROOT, "target", "release", "sdkit")
    runs, stages = {}, {}
    for precision in ("f32", "auto"):
        t = time.perf_counter()
        # Without -q it names each node as it starts: stage times.
        proc = subprocess.Popen([exe, "run", "--device", "cpu", "--precision", precision,
                                 graph, "--base-dir", BENCH], stderr=subprocess.PIPE, text=True)
        starts = []
        for line in proc.stderr:
            if line.startswith("executing "):
                starts.append((line.split()[1], time.perf_counter()))
        rss = wait_rss(proc)
        secs = time.perf_counter() - t
        ends = [s for _, s in starts[1:]] + [time.perf_counter()]
        stages[precision] = {n: e - s for (n, s), e in zip(starts, ends)}
        img = np.asarray(Image.open(os.path.join(out_dir, "bench_00001_.png")).convert("RGB"))
        os.remove(os.path.join(out_dir, "bench_00001_.png"))
        runs[precision] = (secs, rss, img)

    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--steps", str(steps),
                             "--comfy-child"])
    rss_comfy = wait_rss(proc)
    t_comfy = time.perf_counter() - t
    theirs = np.clip(255.0 * np.load(os.path.join(BENCH, "comfy.npy")), 0, 255).astype(np.uint8)
    size = os.path.getsize(ckpt) / 2**30

    def diff(a, b):
        d = np.abs(a.astype(int) - b.astype(int))
        return f"max {d.max()}/255, mean {d.mean():.4f}, {np.count_nonzero(d)} of {d.size} differ"

    print(f"SD1.5 txt2img 512x512, {steps} euler steps, CFG 8, CPU ({torch.get_num_threads()} threads), "
          f"checkpoint {size:.2f} GiB")
    print(f"ComfyUI      {t_comfy:8.1f} s, peak RSS {rss_comfy:5.2f} GiB "
          f"(its nodes in a fresh process: load, encode, sample, decode)")
    for precision, (secs, rss, img) in runs.items():
        print(f"sdkit {precision:<6} {secs:8.1f} s, peak RSS {rss:5.2f} GiB ({rss / size:.2f}x the file); "
              f"{secs / t_comfy:.2f}x ComfyUI's time; vs ComfyUI's image: {diff(img, theirs)}")
    print(f"sdkit auto vs f32 image: {diff(runs['auto'][2], runs['f32'][2])}")
    with open(os.path.join(BENCH, "comfy_times.json")) as f:
        comfy_stages = json.load(f)
    for nid, name in (("3", "KSampler"), ("8", "VAEDecode")):
        row = f"{name:<10} ComfyUI {comfy_stages.get(nid, float('nan')):6.1f} s"
        for precision in ("f32", "auto"):
            ours = stages[precision].get(nid, float("nan"))
            row += f", sdkit {precision} {ours:6.1f} s ({ours / comfy_stages.get(nid, float('nan')):.2f}x)"
        print(row)


if __name__ == "__main__":
    main()
