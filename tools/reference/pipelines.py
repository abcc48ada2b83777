"""Reference outputs for the example image workflows in graphs/.

Computes, with PyTorch and Pillow, what ComfyUI writes for
graphs/image_pipeline.ron (LoadImage -> ImageScale bilinear -> ImageInvert ->
SaveImage) and for the two saved images of graphs/mask_ops.ron, and stores
them as PNGs under tests/reference/. tests/pipelines.rs compares sdkit's
output pixels with them.

ImageScale uses ComfyUI's own comfy.utils.common_upscale. Point COMFY_DIR
at a ComfyUI checkout (default /work/comfy; comfy/utils.py, options.py,
cli_args.py and checkpoint_pickle.py are all it needs). The other node
bodies are a few lines each in ComfyUI (nodes.py LoadImage/SaveImage,
comfy_extras/nodes_post_processing.py Blur/Sharpen, nodes_mask.py,
nodes_images.py ImageCrop) and are restated below with the same tensor
operations.

Run from the repository root, in a venv with torch, numpy, pillow, einops:
    python tools/reference/pipelines.py
"""
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

sys.path.insert(0, os.environ.get("COMFY_DIR", "/work/comfy"))
import comfy.utils  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "reference")


def load_image(path):
    """nodes.py LoadImage for a single-frame 8-bit file."""
    img = ImageOps.exif_transpose(Image.open(path))
    rgb = np.array(img.convert("RGB")).astype(np.float32) / 255.0
    image = torch.from_numpy(rgb)[None,]
    if "A" in img.getbands():
        alpha = np.array(img.getchannel("A")).astype(np.float32) / 255.0
        mask = 1.0 - torch.from_numpy(alpha)
    else:
        mask = torch.zeros((64, 64), dtype=torch.float32)
    return image, mask.unsqueeze(0)


def save(image, name):
    """nodes.py SaveImage's pixel conversion, first image of the batch."""
    i = 255.0 * image[0].cpu().numpy()
    arr = np.clip(i, 0, 255).astype(np.uint8)
    Image.fromarray(arr).save(os.path.join(OUT, name))
    print("wrote", name, arr.shape)


def image_scale(image, method, width, height, crop):
    """nodes.py ImageScale: 0 keeps the aspect ratio."""
    if width == 0 and height == 0:
        return image
    samples = image.movedim(-1, 1)
    if width == 0:
        width = max(1, round(samples.shape[3] * height / samples.shape[2]))
    elif height == 0:
        height = max(1, round(samples.shape[2] * width / samples.shape[3]))
    s = comfy.utils.common_upscale(samples, width, height, method, crop)
    return s.movedim(1, -1)


def gaussian_kernel(kernel_size, sigma):
    x, y = torch.meshgrid(
        torch.linspace(-1, 1, kernel_size), torch.linspace(-1, 1, kernel_size), indexing="ij"
    )
    d = torch.sqrt(x * x + y * y)
    g = torch.exp(-(d * d) / (2.0 * sigma * sigma))
    return g / g.sum()


def blur(image, radius, sigma):
    """comfy_extras Blur.execute."""
    c = image.shape[3]
    k = 2 * radius + 1
    kernel = gaussian_kernel(k, sigma).repeat(c, 1, 1).unsqueeze(1)
    x = F.pad(image.permute(0, 3, 1, 2), (radius,) * 4, "reflect")
    y = F.conv2d(x, kernel, padding=k // 2, groups=c)[:, :, radius:-radius, radius:-radius]
    return y.permute(0, 2, 3, 1)


def sharpen(image, radius, sigma, alpha):
    """comfy_extras Sharpen.execute."""
    c = image.shape[3]
    k = 2 * radius + 1
    kernel = gaussian_kernel(k, sigma) * -(alpha * 10)
    kernel[k // 2, k // 2] = kernel[k // 2, k // 2] - kernel.sum() + 1.0
    kernel = kernel.repeat(c, 1, 1).unsqueeze(1)
    x = F.pad(image.permute(0, 3, 1, 2), (radius,) * 4, "reflect")
    y = F.conv2d(x, kernel, padding=k // 2, groups=c)[:, :, radius:-radius, radius:-radius]
    return torch.clamp(y.permute(0, 2, 3, 1), 0, 1)


def crop(image, width, height, x, y):
    """nodes_images.py ImageCrop."""
    x = min(x, image.shape[2] - 1)
    y = min(y, image.shape[1] - 1)
    return image[:, y : y + height, x : x + width, :]


def main():
    os.makedirs(OUT, exist_ok=True)
    image, mask = load_image(os.path.join(ROOT, "graphs", "input", "example.png"))

    # graphs/image_pipeline.ron (and its JSON, API and UI forms).
    scaled = image_scale(image, "bilinear", 128, 0, "disabled")
    save(1.0 - scaled, "image_pipeline.png")

    # graphs/mask_ops.ron: save_mask and save_crop.
    inv = 1.0 - mask
    as_image = inv.reshape((-1, 1, inv.shape[-2], inv.shape[-1])).movedim(1, -1).expand(-1, -1, -1, 3)
    save(blur(as_image, 3, 1.5), "mask_ops_alpha.png")
    save(crop(sharpen(image, 2, 1.0, 0.5), 32, 32, 16, 8), "mask_ops_crop.png")


if __name__ == "__main__":
    main()
