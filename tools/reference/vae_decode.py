"""Reference output for sdkit's VAE decoder (nodes/src/models/vae.rs).

Builds ComfyUI's own ldm `Decoder` (comfy/ldm/modules/diffusionmodules/
model.py, loaded from a ComfyUI checkout with its unrelated imports stubbed
to plain torch) at a tiny size, fills every weight from a deterministic
formula of its name (nodes/tests/vae_decode.rs computes the same), decodes a
fixed latent as ComfyUI's VAEDecode does (latent / 0.18215, then
clamp((x + 1) / 2, 0, 1), channels last) and writes
nodes/tests/fixtures/vae/expected.json.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/vae_decode.py
(COMFY_DIR defaults to /work/comfy; only the one model.py file is read, from
there or from a bare git mirror via `git show`.)
"""
import json
import math
import os
import subprocess
import sys
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = dict(ch=32, ch_mult=[1, 2], num_res_blocks=1, z_channels=4, out_ch=3)


def load_decoder_module():
    comfy_dir = os.environ.get("COMFY_DIR", "/work/comfy")
    path = os.path.join(comfy_dir, "comfy/ldm/modules/diffusionmodules/model.py")
    if os.path.exists(path):
        src = open(path).read()
    else:
        src = subprocess.check_output(
            ["git", "-C", "/work/.mirror/Comfy-Org+ComfyUI/repo", "show",
             "HEAD:comfy/ldm/modules/diffusionmodules/model.py"]).decode()
    # Stubs: plain torch layers, no xformers, default attention choice.
    comfy = types.ModuleType("comfy")
    ops = types.ModuleType("comfy.ops")

    class disable_weight_init:
        Conv2d = torch.nn.Conv2d
        Conv3d = torch.nn.Conv3d
        GroupNorm = torch.nn.GroupNorm
        Linear = torch.nn.Linear
    ops.disable_weight_init = disable_weight_init
    mm = types.ModuleType("comfy.model_management")
    mm.xformers_enabled_vae = lambda: False
    mm.pytorch_attention_enabled_vae = lambda: False
    mm.pytorch_attention_enabled = lambda: False
    mm.get_free_memory = lambda *a, **k: 1 << 40
    mm.OOM_EXCEPTION = MemoryError
    comfy.ops = ops
    comfy.model_management = mm
    sys.modules.update({"comfy": comfy, "comfy.ops": ops, "comfy.model_management": mm})
    mod = types.ModuleType("ldm_model")
    exec(compile(src, "model.py", "exec"), mod.__dict__)
    return mod


def value(name, shape):
    """Deterministic weights; nodes/tests/vae_decode.rs has the same formula."""
    n = 1
    for d in shape:
        n *= d
    seed = sum(name.encode()) * 0.01
    base = [math.sin(i * 0.7071 + seed) for i in range(n)]
    if name.endswith("bias"):
        vals = [0.05 * b for b in base]
    elif "norm" in name and name.endswith("weight"):
        vals = [1.0 + 0.1 * b for b in base]
    else:
        fan_in = n // shape[0]
        vals = [b / math.sqrt(fan_in) for b in base]
    return torch.tensor(vals, dtype=torch.float32).reshape(shape)


def main():
    m = load_decoder_module()
    dec = m.Decoder(ch=CFG["ch"], out_ch=CFG["out_ch"], ch_mult=CFG["ch_mult"],
                    num_res_blocks=CFG["num_res_blocks"], attn_resolutions=[],
                    in_channels=3, resolution=16, z_channels=CFG["z_channels"]).eval()
    sd = dec.state_dict()
    for k in sd:
        sd[k] = value(k, list(sd[k].shape))
    dec.load_state_dict(sd)
    latent = torch.tensor([math.sin(i * 0.37) * 0.8 for i in range(1 * 4 * 4 * 4)],
                          dtype=torch.float32).reshape(1, 4, 4, 4)
    with torch.no_grad():
        x = dec(latent / 0.18215)
        img = torch.clamp((x + 1.0) / 2.0, min=0.0, max=1.0).movedim(1, -1)
    path = os.path.join(ROOT, "nodes", "tests", "fixtures", "vae", "expected.json")
    with open(path, "w") as f:
        json.dump({"config": CFG, "latent": latent.flatten().tolist(),
                   "image_shape": list(img.shape), "image": img.flatten().tolist()}, f)
    print("wrote", path, list(img.shape))


if __name__ == "__main__":
    main()
