"""Memory and time benchmark: full-size Flux.1 dev (fp8) on the CPU.

Builds, once, random-weight files in the layouts people download, every
tensor's name and shape taken from ComfyUI's own classes on the meta device
with the real configs, into $SDKIT_BENCH_DIR (default /tmp/sdkit-flux-bench):
  models/unet/flux1-dev-fp8.safetensors   comfy.ldm.flux.model.Flux with the
      config ComfyUI's model_detection gives a flux1-dev file (hidden 3072,
      24 heads, depth 19 + 38 single, context_in 4096, vec_in 768, guidance
      embedding, axes [16, 56, 56], qkv bias); every 2-D weight
      float8_e4m3fn, the rest bf16, as the fp8 Flux downloads (~11.9 GB);
  models/clip/t5xxl_fp8_e4m3fn.safetensors  comfy.text_encoders.t5.T5 with
      t5_config_xxl.json; 2-D weights fp8, the rest f16 (~4.9 GB);
  models/clip/clip_l.safetensors  comfy.clip_model.CLIPTextModel with
      sd1_clip_config.json (HF layout, no text projection), f16;
  models/vae/ae.safetensors  AutoencodingEngine with the diffusionmodules
      Encoder/Decoder as ComfyUI builds a file without quant convs (ch 128,
      ch_mult [1, 2, 4, 4], 2 res blocks, z 16), f16.
Values are seeded random (numpy Generator per tensor): weights normal with
std 0.6/sqrt(fan-in) (fp8 ones drawn from a 256-level normal quantile table
cast to fp8 by torch), biases normal*0.02, 1-D scales 1 + normal*0.05. The
files are streamed tensor by tensor by a small safetensors writer (peak
memory well under 1 GB, in a child process whose peak RSS is printed);
files already there at the right sizes are kept (bench-manifest.json).

Then runs the workflow written to $SDKIT_BENCH_DIR/bench.json — UNETLoader
(weight_dtype default), DualCLIPLoader (clip_l + t5xxl_fp8, type flux),
VAELoader, CLIPTextEncode, FluxGuidance 3.5, ConditioningZeroOut,
EmptySD3LatentImage 512x512, KSampler (euler, simple, --steps, CFG 1),
VAEDecode, SaveImage — with `sdkit run --device cpu --precision auto` (and
`--precision f32` with --f32) and with ComfyUI's own nodes in a fresh
Python process (`--cpu --use-pytorch-cross-attention`, as sdxl_memory.py),
each in its own process, and prints per side: wall time (process start to
exit), peak RSS (ru_maxrss from wait4), whether it finished, was killed or
failed, per-node times (sdkit: from its "executing N" lines; ComfyUI: each
node's own time), the sdkit/ComfyUI ratios and how far the two images are
apart (random weights give a noise-like image: the comparison only shows
that the two agree).

--mem-cap GB caps each measured process's host memory (page cache of the
mapped files included, so clean pages get evicted rather than the process
killed): a fresh memory cgroup under this process's own (v2 memory.max, or
v1 memory.limit_in_bytes + memsw) when that is writable, else
`systemd-run --scope -p MemoryMax=` when systemd runs, else no cap (said
so). RLIMIT_AS is not used: it counts mapped files and reserved address
space. With a cgroup the cgroup's own peak is printed too. Pages of the
files already cached by an earlier run stay charged where they were first
read, so for a strict cap run one side at a time (--no-sdkit / --no-comfy)
after dropping the page cache.

    cargo build --release
    COMFY_DIR=/path/to/ComfyUI python benches/flux_memory.py \\
        [--steps N] [--size PX] [--f32] [--mem-cap GB] [--timeout S]
        [--no-sdkit] [--no-comfy] [--exe PATH] [--plan] [--tiny]

--plan lists the files and their sizes without writing anything. --tiny
builds the same files at flux_pipeline.py's tiny widths (ComfyUI patched
as that script patches it) under $SDKIT_BENCH_DIR/tiny and runs a 128x128
image: a one-minute check of the plumbing.
"""
import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.environ.get("SDKIT_BENCH_DIR", "/tmp/sdkit-flux-bench")
SEED = 20251202
FORMAT = 1  # bump when the files' contents change

UNET_FILE = "flux1-dev-fp8.safetensors"
T5_FILE = "t5xxl_fp8_e4m3fn.safetensors"
CLIP_FILE = "clip_l.safetensors"
VAE_FILE = "ae.safetensors"

# What comfy.model_detection gives a flux1-dev file (asserted in flux_keys).
FLUX_DEV = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768,
                context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=19,
                depth_single_blocks=38, axes_dim=[16, 56, 56], theta=10000, patch_size=2,
                qkv_bias=True, guidance_embed=True)
# ComfyUI's config for an ae.safetensors file (comfy/sd.py, no post_quant_conv).
AE = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3,
      "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [],
      "dropout": 0.0}

ITEM = {"F8_E4M3": 1, "BF16": 2, "F16": 2}


def base_dir(tiny):
    return os.path.join(BENCH, "tiny") if tiny else BENCH


# --------------------------------------------------------------- ComfyUI side

def comfy_env():
    """ComfyUI importable on the CPU (media-only imports stubbed, as
    sd1_pipeline.py does); returns (flux_pipeline module, torch)."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "reference"))
    import flux_pipeline as fp
    sys.meta_path.insert(0, fp.sd1._StubFinder())
    sys.path.insert(0, fp.sd1.COMFY)
    sys.argv = [sys.argv[0], "--cpu", "--use-pytorch-cross-attention"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import torch
    torch.set_grad_enabled(False)
    import comfy.sd  # noqa: F401
    return fp, torch


def flux_keys(torch):
    import comfy.model_detection
    import comfy.ops
    from comfy.ldm.flux.model import Flux
    m = Flux(dtype=torch.float32, device="meta", operations=comfy.ops.disable_weight_init,
             **FLUX_DEV)
    sd = m.state_dict()
    detected = comfy.model_detection.detect_unet_config(sd, "")
    for k, v in FLUX_DEV.items():
        got = detected.get(k)
        assert (list(got) if isinstance(got, (list, tuple)) else got) == v, (k, got, v)
    return [(k, list(t.shape)) for k, t in sd.items()]


def t5_keys(torch):
    import comfy.ops
    import comfy.text_encoders.t5
    with open(os.path.join(os.path.dirname(comfy.text_encoders.t5.__file__),
                           "t5_config_xxl.json")) as f:
        cfg = json.load(f)
    m = comfy.text_encoders.t5.T5(cfg, torch.float32, "meta", comfy.ops.disable_weight_init)
    return [(k, list(t.shape)) for k, t in m.state_dict().items()]


def file_specs(fp, torch, tiny):
    """[(folder, name, keys, dtype of 2-D tensors, dtype of the rest)]"""
    if tiny:
        unet = fp.flux_keys(torch, True)
        t5 = fp.t5_keys(torch)
        clip = fp.fam.clip_hf_keys(torch, fp.CLIP_L, False)
        vae = fp.vae_keys(torch)
    else:
        import comfy.clip_model
        unet = flux_keys(torch)
        t5 = t5_keys(torch)
        with open(os.path.join(os.path.dirname(comfy.clip_model.__file__),
                               "sd1_clip_config.json")) as f:
            clip = fp.fam.clip_hf_keys(torch, json.load(f), False)
        with torch.device("meta"):
            vae = [(k, list(t.shape)) for k, t in fp.engine(dict(AE)).state_dict().items()]
        assert not any("quant_conv" in k for k, _ in vae)
    return [("unet", UNET_FILE, unet, "F8_E4M3", "BF16"),
            ("clip", T5_FILE, t5, "F8_E4M3", "F16"),
            ("clip", CLIP_FILE, clip, "F16", "F16"),
            ("vae", VAE_FILE, vae, "F16", "F16")]


def layout(keys, dt2, dt_rest):
    """The header bytes and the tensors in data order (2-byte dtypes first so
    that every tensor is aligned to its element size); the file's size."""
    entries = sorted((-ITEM[dt2 if len(s) == 2 else dt_rest], k, s) for k, s in keys)
    header, offset, order = {"__metadata__": {"format": "pt"}}, 0, []
    for neg, k, s in entries:
        dt = dt2 if len(s) == 2 else dt_rest
        n = int(np.prod(s, dtype=np.int64)) * -neg
        header[k] = {"dtype": dt, "shape": s, "data_offsets": [offset, offset + n]}
        order.append((k, s, dt))
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return hb, order, 8 + len(hb) + offset


def write_tensor(f, name, shape, dt, torch):
    import statistics
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    n = int(np.prod(shape, dtype=np.int64))
    tdt = {"BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}[dt]
    if name.endswith("bias"):
        std, mean = 0.02, 0.0
    elif len(shape) == 1:
        std, mean = 0.05, 1.0
    else:
        std, mean = 0.6 / np.sqrt(n // shape[0]), 0.0
    chunk = 1 << 24
    if dt == "F8_E4M3":
        q = statistics.NormalDist()
        levels = [q.inv_cdf((i + 0.5) / 256) * std + mean for i in range(256)]
        lut = torch.tensor(levels, dtype=torch.float32).to(tdt).view(torch.uint8).numpy()
        for s in range(0, n, chunk):
            f.write(lut[rng.integers(0, 256, min(chunk, n - s), dtype=np.uint8)].tobytes())
        return
    for s in range(0, n, chunk):
        v = rng.standard_normal(min(chunk, n - s), dtype=np.float32)
        v *= np.float32(std)
        v += np.float32(mean)
        f.write(torch.from_numpy(v).to(tdt).view(torch.uint8).numpy().tobytes())


def build_child(tiny, plan_only):
    fp, torch = comfy_env()
    base = base_dir(tiny)
    manifest = {"format": FORMAT, "seed": SEED, "tiny": tiny, "files": {}}
    for folder, name, keys, dt2, dt_rest in file_specs(fp, torch, tiny):
        hb, order, size = layout(keys, dt2, dt_rest)
        path = os.path.join(base, "models", folder, name)
        rel = os.path.join(folder, name)
        manifest["files"][rel] = size
        n2 = sum(int(np.prod(s)) for _, s in keys if len(s) == 2)
        n = sum(int(np.prod(s)) for _, s in keys)
        print(f"  {rel:<36} {len(keys):4} tensors, {n / 1e9:7.3f} G params, "
              f"{size / 1e9:7.3f} GB ({size / 2**30:6.2f} GiB; 2-D {dt2} {n2 / n:.1%}, rest {dt_rest})",
              flush=True)
        if plan_only or (os.path.exists(path) and os.path.getsize(path) == size):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        free = shutil.disk_usage(os.path.dirname(path)).free
        if free < size:
            sys.exit(f"{path}: {size / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free")
        t = time.perf_counter()
        with open(path + ".partial", "wb") as f:
            f.write(len(hb).to_bytes(8, "little"))
            f.write(hb)
            for k, s, dt in order:
                write_tensor(f, k, s, dt, torch)
        assert os.path.getsize(path + ".partial") == size
        os.replace(path + ".partial", path)
        print(f"    wrote in {time.perf_counter() - t:.1f} s", flush=True)
    if not plan_only:
        with open(os.path.join(base, "bench-manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)


def comfy_child(tiny, graph):
    import tempfile
    import types
    fp, torch = comfy_env()
    import folder_paths
    import nodes
    base = base_dir(tiny)
    tmp = tempfile.mkdtemp()
    if tiny:
        fp.patch_comfy(tmp, torch)
    for folder, kind in {"unet": "diffusion_models", "clip": "text_encoders", "vae": "vae"}.items():
        folder_paths.add_model_folder_path(kind, os.path.join(base, "models", folder),
                                           is_default=True)
    info = {"threads": torch.get_num_threads()}

    class UNETLoader(nodes.UNETLoader):
        def load_unet(self, *a, **k):
            out = super().load_unet(*a, **k)
            m = out[0].model
            info["unet"] = {"model": type(m.model_config).__name__,
                            "weights": str(m.diffusion_model.img_in.weight.dtype),
                            "manual_cast": str(m.manual_cast_dtype)}
            return out

    class DualCLIPLoader(nodes.DualCLIPLoader):
        def load_clip(self, *a, **k):
            out = super().load_clip(*a, **k)
            cm = out[0].cond_stage_model
            info["clip"] = {"t5_weights": str(cm.t5xxl.transformer.shared.weight.dtype),
                            "clip_l_weights": str(next(cm.clip_l.transformer.parameters()).dtype)}
            return out

    with open(graph) as f:
        prompt = json.load(f)
    ns = types.SimpleNamespace(NODE_CLASS_MAPPINGS={
        **nodes.NODE_CLASS_MAPPINGS, **fp.v3_nodes(),
        "UNETLoader": UNETLoader, "DualCLIPLoader": DualCLIPLoader})
    times = {}
    saved, _ = fp.sd1.run_workflow(prompt, ns, torch, times)
    img = np.clip(255.0 * saved[0][0].float().numpy(), 0, 255).astype(np.uint8)
    np.save(os.path.join(base, "comfy.npy"), img)
    with open(os.path.join(base, "comfy_times.json"), "w") as f:
        json.dump({"times": times, "info": info}, f)
    shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------- the driver

def workflow(steps, size, seed):
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET_FILE, "weight_dtype": "default"}},
        "2": {"class_type": "DualCLIPLoader", "inputs": {"clip_name1": CLIP_FILE, "clip_name2": T5_FILE, "type": "flux", "device": "default"}},
        "13": {"class_type": "VAELoader", "inputs": {"vae_name": VAE_FILE}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": "a red fox curled up asleep in fresh snow under tall pine trees, soft blue dusk light"}},
        "4": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["3", 0], "guidance": 3.5}},
        "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["3", 0]}},
        "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "7": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0], "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": ["13", 0]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "bench"}},
    }


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


class MemCap:
    """A host-memory cap for one child process at a time: a fresh cgroup
    under this process's own (v2, else v1 memory), else systemd-run
    --scope, else none."""

    def __init__(self, gib):
        self.cap = int(gib * 2**30) if gib else 0
        self.kind, self.parent, self.note = None, None, "no cap"
        self.n = 0
        if not self.cap:
            return
        mounts = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                a, b = line.split(" - ")
                fields, (fstype, _, superopts) = a.split(), b.split()[:3]
                mounts.append((fields[3], fields[4], fstype, superopts.split(",")))
        own = {}
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                for c in (ctrls.split(",") if ctrls else [""]):
                    own[c] = path
        tried = []
        for root, mnt, fstype, opts in mounts:
            if fstype == "cgroup2" and "" in own:
                rel = own[""]
            elif fstype == "cgroup" and "memory" in opts and "memory" in own:
                rel = own["memory"]
            else:
                continue
            if root != "/" and rel.startswith(root):
                rel = rel[len(root):]
            d = os.path.join(mnt, rel.lstrip("/"))
            if fstype == "cgroup2" and "memory" not in (_read(os.path.join(d, "cgroup.subtree_control")) or ""):
                tried.append(f"{d}: memory controller not delegated")
                continue
            if not os.access(d, os.W_OK):
                tried.append(f"{d}: not writable")
                continue
            self.kind, self.parent = ("cgroup2" if fstype == "cgroup2" else "cgroup1"), d
            self.note = f"{self.kind} memory cgroup under {d}, limit {gib:g} GiB (swap 0)"
            return
        if shutil.which("systemd-run") and os.path.isdir("/run/systemd/system"):
            self.kind = "systemd-run"
            self.note = f"systemd-run --scope -p MemoryMax={self.cap} -p MemorySwapMax=0"
            return
        self.note = ("NO CAP APPLIED (no writable memory cgroup, no running systemd: "
                     + "; ".join(tried) + ")")

    def start(self, cmd):
        """(command, preexec_fn, cgroup dir or None)"""
        if self.kind == "systemd-run":
            return (["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={self.cap}",
                     "-p", "MemorySwapMax=0", "--"] + cmd, None, None)
        if self.kind is None:
            return cmd, None, None
        self.n += 1
        d = os.path.join(self.parent, f"sdkit-flux-bench-{os.getpid()}-{self.n}")
        os.mkdir(d)
        if self.kind == "cgroup2":
            _write(os.path.join(d, "memory.max"), str(self.cap))
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                _write(os.path.join(d, "memory.swap.max"), "0")
        else:
            _write(os.path.join(d, "memory.limit_in_bytes"), str(self.cap))
            if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(self.cap))
        procs = os.path.join(d, "cgroup.procs")

        def enter():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        return cmd, enter, d

    def finish(self, d):
        """The cgroup's peak (bytes) and OOM kills; removes it."""
        if d is None:
            return None, None
        peak_file = "memory.peak" if self.kind == "cgroup2" else "memory.max_usage_in_bytes"
        events = "memory.events" if self.kind == "cgroup2" else "memory.oom_control"
        peak = _read(os.path.join(d, peak_file))
        ooms = None
        for line in (_read(os.path.join(d, events)) or "").splitlines():
            if line.startswith("oom_kill "):
                ooms = int(line.split()[1])
        for _ in range(50):
            try:
                os.rmdir(d)
                break
            except OSError:
                time.sleep(0.1)
        return (int(peak) if peak and peak.strip().isdigit() else None), ooms


def measured(cmd, cap, timeout, stage_lines=False):
    """Runs `cmd`; wall time, peak RSS (bytes, wait4), outcome, per-node
    start times (from sdkit's "executing N" lines when stage_lines)."""
    cmd, preexec, cg = cap.start(cmd)
    t = time.perf_counter()
    p = subprocess.Popen(cmd, preexec_fn=preexec,
                         stderr=subprocess.PIPE if stage_lines else None, text=True)
    timer, fired = None, []
    if timeout:
        def kill():
            fired.append(1)
            os.kill(p.pid, signal.SIGKILL)
        timer = threading.Timer(timeout, kill)
        timer.start()
    starts, tail = [], collections.deque(maxlen=20)
    if stage_lines:
        for line in p.stderr:
            if line.startswith("executing "):
                starts.append((line.split()[1], time.perf_counter()))
            else:
                tail.append(line.rstrip())
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if timer:
        timer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    cg_peak, ooms = cap.finish(cg)
    if p.returncode == 0:
        outcome = "finished"
    elif fired:
        outcome = f"killed: --timeout {timeout} s"
    elif p.returncode < 0:
        outcome = f"killed by signal {-p.returncode}" + (" (OOM: cgroup oom_kill)" if ooms else "")
    else:
        outcome = f"failed (exit {p.returncode})" + (" (cgroup oom_kill)" if ooms else "")
    if p.returncode != 0 and tail:
        print("\n".join("    | " + x for x in tail))
    ends = [s for _, s in starts[1:]] + [t + wall]
    stages = {n: e - s for (n, s), e in zip(starts, ends)}
    return {"wall": wall, "rss": usage.ru_maxrss * 1024, "ok": p.returncode == 0,
            "outcome": outcome, "stages": stages, "cg_peak": cg_peak}


def ensure_files(args):
    base = base_dir(args.tiny)
    man = _read(os.path.join(base, "bench-manifest.json"))
    if man and not args.plan:
        m = json.loads(man)
        if m.get("format") == FORMAT and m.get("seed") == SEED and all(
                os.path.exists(os.path.join(base, "models", rel))
                and os.path.getsize(os.path.join(base, "models", rel)) == size
                for rel, size in m["files"].items()):
            return m["files"]
    print(("files (not written: --plan)" if args.plan else "building files") + f" in {base}/models:",
          flush=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--build-child"]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--plan"] if args.plan else []
    t = time.perf_counter()
    p = subprocess.Popen(cmd)
    _, status, usage = os.wait4(p.pid, 0)
    if status != 0:
        sys.exit(f"building the files failed ({os.waitstatus_to_exitcode(status)})")
    if args.plan:
        return None
    print(f"  built in {time.perf_counter() - t:.1f} s, builder peak RSS "
          f"{usage.ru_maxrss / 2**20:.2f} GiB", flush=True)
    with open(os.path.join(base, "bench-manifest.json")) as f:
        return json.load(f)["files"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--size", type=int, default=None, help="image side (default 512; --tiny 128)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--f32", action="store_true", help="also run sdkit --precision f32")
    ap.add_argument("--mem-cap", type=float, default=0, metavar="GB",
                    help="host-memory cap per measured process, GiB")
    ap.add_argument("--timeout", type=float, default=0, metavar="S",
                    help="kill a measured process after S seconds")
    ap.add_argument("--exe", default=os.environ.get("SDKIT_BIN", os.path.join(ROOT, "target", "release", "sdkit")),
                    help="the sdkit binary (default $SDKIT_BIN or target/release/sdkit)")
    ap.add_argument("--no-sdkit", action="store_true")
    ap.add_argument("--no-comfy", action="store_true")
    ap.add_argument("--plan", action="store_true", help="list the files and sizes; write nothing")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a smoke test")
    ap.add_argument("--build-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--comfy-child", metavar="GRAPH", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_child:
        return build_child(args.tiny, args.plan)
    if args.comfy_child:
        return comfy_child(args.tiny, args.comfy_child)

    files = ensure_files(args)
    if args.plan:
        return
    base = base_dir(args.tiny)
    size = args.size or (128 if args.tiny else 512)
    prompt = workflow(args.steps, size, args.seed)
    graph = os.path.join(base, "bench.json")
    with open(graph, "w") as f:
        json.dump(prompt, f, indent=1)
    cap = MemCap(args.mem_cap)
    out_dir = os.path.join(base, "output")
    out_png = os.path.join(out_dir, "bench_00001_.png")

    def clear_outputs():
        for f in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
            if f.startswith("bench_"):
                os.remove(os.path.join(out_dir, f))

    from PIL import Image
    runs = {}
    exe = args.exe
    if not args.no_sdkit and not os.access(exe, os.X_OK):
        sys.exit(f"{exe}: not built (cargo build --release)")
    for precision in (["auto"] + (["f32"] if args.f32 else [])) if not args.no_sdkit else []:
        clear_outputs()
        print(f"running sdkit --precision {precision} ...", flush=True)
        r = measured([exe, "run", "--device", "cpu", "--precision", precision, graph,
                      "--base-dir", base], cap, args.timeout, stage_lines=True)
        r["img"] = (np.asarray(Image.open(out_png).convert("RGB"))
                    if r["ok"] and os.path.exists(out_png) else None)
        runs[f"sdkit {precision}"] = r
    if not args.no_comfy:
        for f in ("comfy.npy", "comfy_times.json"):
            if os.path.exists(os.path.join(base, f)):
                os.remove(os.path.join(base, f))
        print("running ComfyUI ...", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--comfy-child", graph]
        r = measured(cmd + (["--tiny"] if args.tiny else []), cap, args.timeout)
        npy = os.path.join(base, "comfy.npy")
        r["img"] = np.load(npy) if r["ok"] and os.path.exists(npy) else None
        extra = _read(os.path.join(base, "comfy_times.json"))
        extra = json.loads(extra) if extra else {"times": {}, "info": {}}
        r["stages"], r["info"] = extra["times"], extra["info"]
        runs["ComfyUI"] = r

    gib = 2**30
    total = sum(files.values())
    print()
    print(f"Flux dev{' (TINY widths)' if args.tiny else ''} fp8 txt2img {size}x{size}, "
          f"{args.steps} euler step(s), CFG 1, guidance 3.5, + VAE decode; CPU, {os.cpu_count()} cores")
    print("files: " + ", ".join(f"{os.path.basename(k)} {v / 1e9:.3f} GB" for k, v in files.items())
          + f"; total {total / gib:.2f} GiB")
    print(f"memory cap: {cap.note}")
    if not args.no_sdkit:
        print(f"sdkit binary: {exe}")
    if "ComfyUI" in runs and runs["ComfyUI"].get("info"):
        print(f"ComfyUI chose: {json.dumps(runs['ComfyUI']['info'])}")
    comfy = runs.get("ComfyUI")
    names = {nid: n["class_type"] for nid, n in prompt.items()}
    for name, r in runs.items():
        line = (f"{name:<12} {r['wall']:8.1f} s  peak RSS {r['rss'] / gib:6.2f} GiB "
                f"({r['rss'] / total:.2f}x the files)  {r['outcome']}")
        if r["cg_peak"]:
            line += f"; cgroup peak {r['cg_peak'] / gib:.2f} GiB (page cache incl.)"
        print(line)
        if r["stages"]:
            print("    " + ", ".join(f"{names.get(n, n)} {s:.1f} s" for n, s in r["stages"].items()
                                     if s >= 0.05 or args.tiny))

    def diff(a, b):
        d = np.abs(a.astype(int) - b.astype(int))
        return (f"max abs diff {d.max()}/255, mean {d.mean():.3f}, "
                f"{np.count_nonzero(d)} of {d.size} differ")
    for name, r in runs.items():
        if name == "ComfyUI":
            continue
        if comfy and comfy["ok"] and r["ok"]:
            stages = []
            for nid in ("7", "8"):
                if nid in r["stages"] and comfy["stages"].get(nid):
                    stages.append(f"{names[nid]} {r['stages'][nid] / comfy['stages'][nid]:.2f}x")
            print(f"{name}/ComfyUI: time {r['wall'] / comfy['wall']:.2f}x, peak RSS "
                  f"{r['rss'] / comfy['rss']:.2f}x" + (f" ({', '.join(stages)})" if stages else ""))
        if comfy is not None and r["img"] is not None and comfy["img"] is not None:
            print(f"{name} vs ComfyUI image: {diff(r['img'], comfy['img'])}")
    if "sdkit auto" in runs and "sdkit f32" in runs and \
            runs["sdkit auto"]["img"] is not None and runs["sdkit f32"]["img"] is not None:
        print(f"sdkit auto vs f32 image: {diff(runs['sdkit auto']['img'], runs['sdkit f32']['img'])}")
    for name, r in runs.items():
        if r["img"] is not None:
            print(f"{name} image std {r['img'].std():.1f}/255, "
                  f"{np.mean((r['img'] == 0) | (r['img'] == 255)):.1%} saturated")


if __name__ == "__main__":
    main()
