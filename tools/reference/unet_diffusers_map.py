"""ComfyUI's `comfy.utils.unet_to_diffusers` for the UNet configs sdkit's
tests use (the tiny SD1/SDXL/refiner ones and the real SD1.5, SD2 and SDXL
configs): nodes/tests/lora_keys.rs checks sdkit's mapping (the LoRA key
names in diffusers spelling) against it.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/unet_diffusers_map.py
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.environ.get("COMFY_DIR", "/work/comfyfull"))
import comfy.utils  # noqa: E402

CONFIGS = {
    "tiny_sd1": dict(num_res_blocks=[1, 1], channel_mult=[1, 2], transformer_depth=[1, 1],
                     transformer_depth_output=[1, 1, 1, 1], transformer_depth_middle=1),
    "tiny_sdxl": dict(num_res_blocks=[1, 1], channel_mult=[1, 2], transformer_depth=[0, 2],
                      transformer_depth_output=[0, 0, 2, 2], transformer_depth_middle=1),
    "tiny_refiner": dict(num_res_blocks=[1, 1, 1], channel_mult=[1, 2, 2], transformer_depth=[0, 2, 0],
                         transformer_depth_output=[0, 0, 2, 2, 0, 0], transformer_depth_middle=1),
    "sd15": dict(num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4],
                 transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                 transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], transformer_depth_middle=1),
    "sdxl": dict(num_res_blocks=[2, 2, 2], channel_mult=[1, 2, 4], transformer_depth=[0, 0, 2, 2, 10, 10],
                 transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], transformer_depth_middle=10),
}


def main():
    out = {}
    for name, cfg in CONFIGS.items():
        m = comfy.utils.unet_to_diffusers(dict(cfg))
        out[name] = {"config": cfg, "map": sorted([k[:-len(".weight")], v[:-len(".weight")]]
                                                  for k, v in m.items() if k.endswith(".weight"))}
    path = os.path.join(ROOT, "nodes", "tests", "fixtures", "lora_keys", "unet_to_diffusers.json")
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print("wrote", path, {k: len(v["map"]) for k, v in out.items()})


if __name__ == "__main__":
    main()
