"""Reference outputs for sdkit's OpenCLIP text encoder
(nodes/src/models/open_clip.rs).

Runs ComfyUI's own text encoder (comfy/clip_model.py `CLIPTextModel`, with
the "gelu" activation of its ViT-H and ViT-bigG configs) on weights written
in the OpenCLIP key layout that SD 2.x and SDXL checkpoints use, converted
by ComfyUI's own `clip_text_transformers_convert` (comfy/utils.py), at a
tiny size. Weights are a formula of each OpenCLIP name (the Rust test
computes the same), so only outputs are stored:
nodes/tests/fixtures/open_clip/expected.json with (at a few positions) the
last hidden state,
the penultimate one without and with the final LayerNorm (SDXL's bigG and
SD 2.x respectively) and the projected pooled output.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/open_clip.py
(ComfyUI's source is read as tools/reference/unet.py reads it.)
"""
import ast
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import unet as ref  # noqa: E402  (the ComfyUI loader and stubs)

CFG = dict(vocab=49408, width=128, layers=3, intermediate=256, positions=77, eos=998)
# ComfyUI encodes whole 77-token windows. The first is padded after its end
# token with 0, as SDXL's bigG tokenizer pads; the second is full.
TOKENS = [[999, 5, 17, 300, 42, 998] + [0] * 71,
          [999] + [(i * 37) % 997 + 1 for i in range(75)] + [998]]
POSITIONS = [0, 1, 4, 5, 6, 40, 76]


def value(name, shape):
    """Deterministic weights; nodes/tests/open_clip.rs has the same formula.
    (The vocabulary is full size: ComfyUI's CLIPTextModel fixes it.)"""
    n = 1
    for d in shape:
        n *= d
    seed = sum(name.encode()) * 0.01
    base = [math.sin(i * 0.7071 + i * i * 0.0031 + seed) for i in range(n)]
    if name.endswith("bias"):
        vals = [0.05 * b for b in base]
    elif ".ln_" in name or name.startswith("ln_"):
        vals = [1.0 + 0.1 * b for b in base]
    else:
        vals = [b / math.sqrt(shape[-1]) for b in base]
    return torch.tensor(vals, dtype=torch.float32).reshape(shape)


def open_clip_state():
    w, inter = CFG["width"], CFG["intermediate"]
    shapes = {"token_embedding.weight": [CFG["vocab"], w],
              "positional_embedding": [CFG["positions"], w],
              "ln_final.weight": [w], "ln_final.bias": [w],
              "text_projection": [w, w]}
    for l in range(CFG["layers"]):
        p = f"transformer.resblocks.{l}."
        shapes.update({
            p + "ln_1.weight": [w], p + "ln_1.bias": [w],
            p + "attn.in_proj_weight": [3 * w, w], p + "attn.in_proj_bias": [3 * w],
            p + "attn.out_proj.weight": [w, w], p + "attn.out_proj.bias": [w],
            p + "ln_2.weight": [w], p + "ln_2.bias": [w],
            p + "mlp.c_fc.weight": [inter, w], p + "mlp.c_fc.bias": [inter],
            p + "mlp.c_proj.weight": [w, inter], p + "mlp.c_proj.bias": [w],
        })
    return {k: value(k, s) for k, s in shapes.items()}


def comfy_functions(names):
    """Functions of comfy/utils.py, executed alone (the module imports far
    more than they need)."""
    tree = ast.parse(ref.read_source("comfy/utils.py"))
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    ns = {"torch": torch}
    exec(compile(ast.Module(body=body, type_ignores=[]), "comfy/utils.py", "exec"), ns)
    return ns


def main():
    ref.load_openaimodel()  # comfy.ops / model_management stubs and attention.py

    class TokenEmbedding(torch.nn.Embedding):
        def forward(self, x, out_dtype=None):
            return super().forward(x)

    class ops:
        Linear = torch.nn.Linear
        LayerNorm = torch.nn.LayerNorm
        Embedding = TokenEmbedding

    sys.modules["comfy.ops"].cast_to = lambda w, dtype=None, device=None: w.to(dtype)
    clip_model = ref.exec_source("comfy.clip_model", "comfy/clip_model.py")
    conv = comfy_functions({"transformers_convert", "clip_text_transformers_convert"})
    sd = conv["clip_text_transformers_convert"](open_clip_state(), "", "")
    config = {"num_hidden_layers": CFG["layers"], "hidden_size": CFG["width"],
              "num_attention_heads": CFG["width"] // 64, "intermediate_size": CFG["intermediate"],
              "hidden_act": "gelu", "max_position_embeddings": CFG["positions"],
              "eos_token_id": CFG["eos"]}
    model = clip_model.CLIPTextModel(config, torch.float32, "cpu", ops).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("position_ids" in m for m in missing), (missing, unexpected)
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        last, raw, pooled, _ = model(tokens, intermediate_output=-2,
                                     final_layer_norm_intermediate=False)
        _, normed, _, _ = model(tokens, intermediate_output=-2)
    # Hidden states at a few positions only, to keep the fixture small: the
    # start token, words, the end token, its padding and the last slot.
    out = {"config": CFG, "tokens": TOKENS, "positions": POSITIONS}
    for k, t in [("last", last), ("penultimate", raw), ("penultimate_normed", normed)]:
        out[k] = [round(v, 6) for v in t[:, POSITIONS, :].flatten().tolist()]
        print(k, list(t.shape), t.min().item(), t.max().item())
    out["pooled"] = [round(v, 6) for v in pooled.flatten().tolist()]
    path = os.path.join(ref.ROOT, "nodes", "tests", "fixtures", "open_clip", "expected.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print("wrote", path)


if __name__ == "__main__":
    main()
