"""Reference noise for sdkit's torch RNG port (nodes/src/noise.rs).

Writes nodes/tests/fixtures/noise/expected.json: torch.randn on the CPU
generator after torch.manual_seed(seed), as comfy.sample.prepare_noise
draws it, for several seeds and sizes (scalar path below 16 elements,
16-blocks with a redrawn tail above).

Run from the repository root in a venv with torch:
    python tools/reference/noise.py
"""
import json
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = [(0, 1), (0, 5), (1, 15), (42, 16), (42, 17), (156680208700286, 100), (2**64 - 1, 33),
         (12345, 4 * 8 * 8), (7, 1000)]


def main():
    out = []
    for seed, n in CASES:
        g = torch.manual_seed(seed)
        v = torch.randn([n], generator=g, device="cpu")
        out.append({"seed": str(seed), "n": n, "values": [float(x) for x in v.tolist()]})
    path = os.path.join(ROOT, "nodes", "tests", "fixtures", "noise", "expected.json")
    with open(path, "w") as f:
        json.dump({"torch": torch.__version__, "cases": out}, f)
    print("wrote", path)


if __name__ == "__main__":
    main()
