"""Reference fixture for sdkit's safetensors reader (engine/src/weights.rs).

Run from anywhere (re-runnable; rewrites the fixture):

    /work/pyenv/bin/python tools/reference/make_safetensors.py

Needs torch and the `safetensors` package. Writes
engine/tests/fixtures/weights/torch_small.safetensors with the official
writer (`safetensors.torch.save_file`), so engine/tests/weights.rs proves the
Rust reader understands files as PyTorch tooling produces them: f32, f16,
bf16 and i64 tensors (f16 with a subnormal, -inf and nan), plus metadata.

    /work/pyenv/bin/python tools/reference/make_safetensors.py --check FILE

loads FILE (e.g. one written by sdkit's `write_safetensors`) with the
official loader and prints each tensor, for the other direction.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

OUT = (
    Path(__file__).resolve().parents[2]
    / "engine/tests/fixtures/weights/torch_small.safetensors"
)


def make():
    tensors = {
        # Values chosen so the Rust test can spell them out exactly.
        "model.diffusion_model.f32": torch.arange(6, dtype=torch.float32).reshape(2, 3)
        / 4
        - 0.5,
        "first_stage_model.f16": torch.tensor(
            [1.0, -2.5, 2.0**-24, float("-inf"), float("nan")], dtype=torch.float16
        ),
        "cond_stage_model.bf16": torch.tensor([1.0, -0.15625, 3.0e38], dtype=torch.bfloat16),
        "position_ids": torch.tensor([[0, 1, 2**40]], dtype=torch.int64),
        "scalar": torch.tensor(7.0, dtype=torch.float32),
    }
    metadata = {"format": "pt", "note": "sdkit fixture"}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata=metadata)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


def check(path):
    for name, t in load_file(path).items():
        print(name, t.dtype, list(t.shape), t.flatten().tolist())


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        check(sys.argv[2])
    else:
        make()
