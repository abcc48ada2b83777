"""Reference sigmas for sdkit's discrete model sampling
(nodes/src/sampling/discrete.rs).

Runs ComfyUI's own ModelSamplingDiscrete (comfy/model_sampling.py), its
make_beta_schedule (comfy/ldm/modules/diffusionmodules/util.py) and its
normal_scheduler (comfy/samplers.py) and k-diffusion's get_sigmas_karras
(comfy/k_diffusion/sampling.py), each pulled out of the ComfyUI git mirror
with `ast` so none of their heavy imports run. Writes
nodes/tests/fixtures/sampling/expected.json.

    python tools/reference/sampling_schedule.py
"""
import ast
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIRROR = "/work/.mirror/Comfy-Org+ComfyUI/repo"


def source(path):
    return subprocess.check_output(["git", "-C", MIRROR, "show", "HEAD:" + path]).decode()


def pick(src, names):
    tree = ast.parse(src)
    keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    return ast.unparse(ast.Module(body=keep, type_ignores=[]))


def main():
    ns = {"torch": torch, "math": math, "np": np}
    exec(pick(source("comfy/ldm/modules/diffusionmodules/util.py"), {"make_beta_schedule"}), ns)
    util = types.ModuleType("comfy.ldm.modules.diffusionmodules.util")
    util.make_beta_schedule = ns["make_beta_schedule"]
    for name in ["comfy", "comfy.ldm", "comfy.ldm.modules", "comfy.ldm.modules.diffusionmodules"]:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["comfy.ldm.modules.diffusionmodules.util"] = util
    ms = {}
    exec(source("comfy/model_sampling.py"), ms)
    exec(pick(source("comfy/samplers.py"), {"normal_scheduler"}), ns)
    kd = {"torch": torch, "math": math}
    exec(pick(source("comfy/k_diffusion/sampling.py"), {"get_sigmas_karras", "append_zero"}), kd)

    s = ms["ModelSamplingDiscrete"]()
    probe = [0.0292, 0.5, 1.0, 3.7, 14.6146]
    out = {
        "sigmas": s.sigmas.tolist(),
        "log_sigmas": s.log_sigmas.tolist(),
        "timestep": {str(p): float(s.timestep(torch.tensor(p))) for p in probe},
        "sigma_of_t": {str(t): float(s.sigma(torch.tensor(t))) for t in [0.0, 0.5, 10.25, 500.0, 998.7, 999.0]},
        "normal": {str(n): ns["normal_scheduler"](s, n).tolist() for n in [1, 5, 20, 30]},
        "karras": {str(n): kd["get_sigmas_karras"](n, float(s.sigma_min), float(s.sigma_max)).tolist() for n in [5, 20]},
    }
    path = os.path.join(ROOT, "nodes", "tests", "fixtures", "sampling", "expected.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print("wrote", path)


if __name__ == "__main__":
    main()
