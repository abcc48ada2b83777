"""Reference outputs for sdkit's CLIP text encoder (nodes/src/models/clip.rs).

Runs transformers' CLIPTextModel (the implementation ComfyUI's SD1 text
encoder mirrors) on a tiny configuration whose weights are a deterministic
function of each tensor's name and index — the Rust test computes the same
weights, so only the outputs are stored. Writes
nodes/tests/fixtures/clip_text/expected.json with the final hidden state and
ComfyUI's clip-skip -2 output (the hidden state after the second-to-last
layer, through the final LayerNorm).

Run from the repository root, in a venv with torch and transformers:
    python tools/reference/clip_text.py
"""
import json
import math
import os

import torch
from transformers import CLIPTextConfig, CLIPTextModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = dict(vocab=1000, width=64, layers=3, heads=1, intermediate=128, positions=77)


def value(name, shape):
    """Deterministic weights; nodes/tests/clip_text.rs has the same formula."""
    n = 1
    for d in shape:
        n *= d
    seed = sum(name.encode()) * 0.01
    base = [math.sin(i * 0.7071 + seed) for i in range(n)]
    if name.endswith("bias"):
        vals = [0.05 * b for b in base]
    elif "layer_norm" in name and name.endswith("weight"):
        vals = [1.0 + 0.1 * b for b in base]
    else:
        vals = [b / math.sqrt(shape[-1]) for b in base]
    return torch.tensor(vals, dtype=torch.float32).reshape(shape)


def main():
    cfg = CLIPTextConfig(
        vocab_size=CFG["vocab"],
        hidden_size=CFG["width"],
        intermediate_size=CFG["intermediate"],
        num_hidden_layers=CFG["layers"],
        num_attention_heads=CFG["heads"],
        max_position_embeddings=CFG["positions"],
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        bos_token_id=999,
        eos_token_id=998,
        pad_token_id=998,
    )
    model = CLIPTextModel(cfg).eval()
    sd = model.state_dict()
    for k in list(sd.keys()):
        if k.endswith("position_ids"):
            continue
        # Checkpoint names: cond_stage_model.transformer.text_model.<rest>
        # (older transformers nest the same names under `text_model.`).
        rest = k[len("text_model."):] if k.startswith("text_model.") else k
        sd[k] = value(rest, list(sd[k].shape))
    model.load_state_dict(sd)
    tokens = torch.tensor(
        [[999, 5, 17, 300, 42, 998, 998, 998, 998, 998, 998, 998, 998, 998, 998, 998],
         [999, 123, 456, 789, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 998]]
    )
    with torch.no_grad():
        out = model(input_ids=tokens, output_hidden_states=True)
        last = out.last_hidden_state
        tm = getattr(model, "text_model", model)
        skip2 = tm.final_layer_norm(out.hidden_states[-2])
    path = os.path.join(ROOT, "nodes", "tests", "fixtures", "clip_text", "expected.json")
    with open(path, "w") as f:
        json.dump(
            {
                "config": CFG,
                "tokens": tokens.tolist(),
                "last": [round(v, 7) for v in last.flatten().tolist()],
                "skip2": [round(v, 7) for v in skip2.flatten().tolist()],
            },
            f,
        )
    print("wrote", path)


if __name__ == "__main__":
    main()
