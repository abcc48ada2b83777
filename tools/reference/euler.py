"""Reference trajectory for sdkit's Euler sampler (nodes/src/sampling/euler.rs).

Runs ComfyUI's k-diffusion `sample_euler` (pulled from the ComfyUI git
mirror with `ast`) on a toy analytic denoiser — the exact posterior mean
for N(0, 1) data, denoised = x / (1 + sigma^2) — with ComfyUI's normal
schedule for SD1, from torch.randn noise scaled by sigma_max as ComfyUI's
EPS.noise_scaling does. Writes nodes/tests/fixtures/sampling/euler.json.

    python tools/reference/euler.py
"""
import ast
import json
import math
import os
import subprocess

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIRROR = "/work/.mirror/Comfy-Org+ComfyUI/repo"


def pick(path, names):
    src = subprocess.check_output(["git", "-C", MIRROR, "show", "HEAD:" + path]).decode()
    tree = ast.parse(src)
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    return ast.unparse(ast.Module(body=keep, type_ignores=[]))


def main():
    ns = {"torch": torch, "math": math, "trange": lambda n, disable=None: range(n)}

    class utils:
        @staticmethod
        def append_dims(x, n):
            return x[(...,) + (None,) * (n - x.ndim)]
    ns["utils"] = utils
    exec(pick("comfy/k_diffusion/sampling.py", {"sample_euler", "to_d"}), ns)
    with open(os.path.join(ROOT, "nodes", "tests", "fixtures", "sampling", "expected.json")) as f:
        sigmas = torch.tensor(json.load(f)["normal"]["20"], dtype=torch.float32)
    noise = torch.randn([1, 4, 4, 4], generator=torch.manual_seed(42))
    x = noise * sigmas[0]

    def model(x, sigma):
        return x / (1.0 + sigma[:, None, None, None] ** 2)
    out = ns["sample_euler"](model, x, sigmas)
    path = os.path.join(ROOT, "nodes", "tests", "fixtures", "sampling", "euler.json")
    with open(path, "w") as f:
        json.dump({"sigmas": sigmas.tolist(), "x0": x.flatten().tolist(), "out": out.flatten().tolist()}, f)
    print("wrote", path)


if __name__ == "__main__":
    main()
