"""Reference outputs for sdkit's UNet (nodes/src/models/unet.rs).

Builds ComfyUI's own ldm `UNetModel` (comfy/ldm/modules/diffusionmodules/
openaimodel.py with comfy/ldm/modules/attention.py and
diffusionmodules/util.py, read from a ComfyUI checkout or its bare git mirror
and executed as the real package modules, with ComfyUI's unrelated imports
stubbed: plain torch layers for comfy.ops, PyTorch SDPA as the attention
choice) at a tiny SD1-like size, fills every weight from a deterministic
formula of its name (nodes/tests/unet.rs computes the same), runs
`_forward` (the body `forward` wraps with patcher hooks) on a fixed latent
and context (1x1 conv transformer projections at t = 999 and t = 1, linear
projections at t = 500) and writes nodes/tests/fixtures/unet/expected.json
with the outputs only; inputs and weights are formulas the test repeats.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/unet.py
(COMFY_DIR defaults to /work/comfy, falling back to the bare git mirror.)
"""
import json
import math
import os
import subprocess
import sys
import types

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIRROR = "/work/.mirror/Comfy-Org+ComfyUI/repo"
# Attention at both levels and in the middle: every block kind is exercised.
# 96 channels: GroupNorm(32) then has 3 channels a group (with 1 it would
# erase the per-channel timestep embedding), and half = 48 is no power of 2.
CFG = dict(in_channels=4, out_channels=4, model_channels=96, channel_mult=[1, 2],
           num_res_blocks=[1, 1], transformer_depth=[1, 1],
           transformer_depth_output=[1, 1, 1, 1], transformer_depth_middle=1,
           use_linear_in_transformer=False, context_dim=64, num_heads=2)
TIMESTEPS = [999.0, 1.0]
# SDXL's layout: no attention at the top level, two blocks deeper down,
# linear projections, 64-channel heads (one at 64 channels, two at 128) and
# the ADM vector through `label_emb`.
XL = dict(in_channels=4, out_channels=4, model_channels=64, channel_mult=[1, 2],
          num_res_blocks=[1, 1], transformer_depth=[0, 2],
          transformer_depth_output=[0, 0, 2, 2], transformer_depth_middle=1,
          use_linear_in_transformer=True, context_dim=64, num_heads=-1,
          num_head_channels=64, adm_in_channels=48)


def read_source(rel):
    path = os.path.join(os.environ.get("COMFY_DIR", "/work/comfy"), rel)
    if os.path.exists(path):
        return open(path).read()
    return subprocess.check_output(["git", "-C", MIRROR, "show", "HEAD:" + rel]).decode()


def module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    m.__path__ = []  # a package, so submodules resolve through sys.modules
    sys.modules[name] = m
    return m


def exec_source(name, rel):
    m = types.ModuleType(name)
    m.__package__ = name.rpartition(".")[0]
    sys.modules[name] = m
    exec(compile(read_source(rel), rel, "exec"), m.__dict__)
    return m


def load_openaimodel():
    class disable_weight_init:
        Linear = torch.nn.Linear
        Conv2d = torch.nn.Conv2d
        GroupNorm = torch.nn.GroupNorm
        LayerNorm = torch.nn.LayerNorm

        @staticmethod
        def conv_nd(dims, *args, **kwargs):
            assert dims == 2
            return torch.nn.Conv2d(*args, **kwargs)

    def mm_getattr(name):
        # Every capability query (xformers, sage, flash, nvidia...) is "no".
        return lambda *a, **k: False

    comfy = module("comfy")
    ops = module("comfy.ops", disable_weight_init=disable_weight_init,
                 scaled_dot_product_attention=F.scaled_dot_product_attention)
    mm = module("comfy.model_management", OOM_EXCEPTION=MemoryError,
                pytorch_attention_enabled=lambda: True,
                force_upcast_attention_dtype=lambda: None,
                get_free_memory=lambda *a, **k: 1 << 40)
    mm.__getattr__ = mm_getattr
    args = types.SimpleNamespace(dont_upcast_attention=False, use_split_cross_attention=False)
    cli = module("comfy.cli_args", args=args)
    pe = module("comfy.patcher_extension")
    comfy.ops, comfy.model_management, comfy.cli_args, comfy.patcher_extension = ops, mm, cli, pe
    module("comfy.ldm")
    module("comfy.ldm.util", exists=lambda v: v is not None,
           instantiate_from_config=lambda *a, **k: None)
    module("comfy.ldm.modules")
    module("comfy.ldm.modules.diffusionmodules")
    module("comfy.ldm.modules.sub_quadratic_attention",
           efficient_dot_product_attention=None)
    exec_source("comfy.ldm.modules.diffusionmodules.util",
                "comfy/ldm/modules/diffusionmodules/util.py")
    exec_source("comfy.ldm.modules.attention", "comfy/ldm/modules/attention.py")
    return exec_source("comfy.ldm.modules.diffusionmodules.openaimodel",
                       "comfy/ldm/modules/diffusionmodules/openaimodel.py")


def value(name, shape):
    """Deterministic weights; nodes/tests/unet.rs has the same formula.
    Rank-1 weights are norm scales (ResBlock norms are not named "norm")."""
    n = 1
    for d in shape:
        n *= d
    seed = sum(name.encode()) * 0.01
    # The quadratic phase decorrelates rows: with a pure i·0.7071 phase every
    # row is the same sinusoid shifted, and the timestep embedding barely
    # reaches the output.
    base = [math.sin(i * 0.7071 + i * i * 0.0123 + seed) for i in range(n)]
    if name.endswith("bias"):
        vals = [0.05 * b for b in base]
    elif len(shape) == 1:
        vals = [1.0 + 0.1 * b for b in base]
    else:
        fan_in = n // shape[0]
        vals = [b / math.sqrt(fan_in) for b in base]
    return torch.tensor(vals, dtype=torch.float32).reshape(shape)


def inputs():
    """Fixed inputs; nodes/tests/unet.rs builds the same."""
    x = torch.tensor([math.sin(i * 0.37) * 0.8 for i in range(1 * 4 * 8 * 8)],
                     dtype=torch.float32).reshape(1, 4, 8, 8)
    ctx = torch.tensor([math.cos(i * 0.113) for i in range(1 * 5 * 64)],
                       dtype=torch.float32).reshape(1, 5, 64)
    return x, ctx


def adm():
    """The ADM vector of the SDXL-layout case; nodes/tests/unet.rs repeats it."""
    return torch.tensor([math.sin(i * 0.29) * 0.5 for i in range(48)],
                        dtype=torch.float32).reshape(1, 48)


def build(m, c):
    net = m.UNetModel(
        image_size=None, in_channels=c["in_channels"], model_channels=c["model_channels"],
        out_channels=c["out_channels"], num_res_blocks=c["num_res_blocks"],
        channel_mult=c["channel_mult"], num_heads=c["num_heads"],
        num_head_channels=c.get("num_head_channels", -1),
        adm_in_channels=c.get("adm_in_channels"),
        num_classes="sequential" if c.get("adm_in_channels") else None,
        use_spatial_transformer=True, transformer_depth=c["transformer_depth"],
        transformer_depth_output=c["transformer_depth_output"],
        transformer_depth_middle=c["transformer_depth_middle"],
        context_dim=c["context_dim"], use_linear_in_transformer=c["use_linear_in_transformer"],
        legacy=False).eval()
    sd = net.state_dict()
    for k in sd:
        sd[k] = value(k, list(sd[k].shape))
    net.load_state_dict(sd)
    return net


def main():
    m = load_openaimodel()
    x, ctx = inputs()
    cases = []
    # SD1 layout (1x1 conv projections) at two timesteps, and the SD2/SDXL
    # linear projections once.
    linear = dict(CFG, use_linear_in_transformer=True)
    for cfg, timesteps in [(CFG, TIMESTEPS), (linear, [500.0]), (XL, [700.0])]:
        net = build(m, cfg)
        for t in timesteps:
            extra = {"y": adm()} if cfg.get("adm_in_channels") else {}
            with torch.no_grad():
                y = net._forward(x, torch.tensor([t], dtype=torch.float32), ctx,
                                 transformer_options={}, **extra)
            cases.append({"config": cfg, "timestep": t, "shape": list(y.shape),
                          "output": y.flatten().tolist()})
            print(cfg["use_linear_in_transformer"], t, y.min().item(), y.max().item())
    d = os.path.join(ROOT, "nodes", "tests", "fixtures", "unet")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "expected.json")
    with open(path, "w") as f:
        json.dump({"cases": cases}, f)
    print("wrote", path)


if __name__ == "__main__":
    main()
