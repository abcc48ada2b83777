"""PyTorch's f32 -> float8 casts (e4m3fn, e5m2) on values that probe the
rounding: every fp8 value, the midpoints between neighbours and one f32
ulp either side, the overflow thresholds, subnormals, random magnitudes.
Writes compute/tests/fixtures/fp8/cast.json: [[f32 bits in, e4m3fn result
as f32 bits, e5m2 result as f32 bits], ...]; compute/tests/weights.rs
compares sdkit's rounding with it.

    python tools/reference/fp8_cast.py
"""
import json
import os

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def probes():
    vals = []
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.uint8).view(dt).float()
        finite = codes[torch.isfinite(codes)].unique().sort().values
        mids = (finite[1:].double() + finite[:-1].double()) / 2
        vals += finite.tolist() + mids.tolist()
    vals += [448.0, 456.0, 464.0, 472.0, 480.0, 500.0, 57344.0, 61440.0, 65536.0, 1e6,
             2.0 ** -9, 2.0 ** -10, 2.0 ** -16, 2.0 ** -17, 3 * 2.0 ** -11, 1e-30]
    rng = np.random.default_rng(7)
    vals += (rng.standard_normal(600) * 10.0 ** rng.uniform(-5, 4, 600)).tolist()
    x = np.array(vals, dtype=np.float32)
    up = np.nextafter(x, np.float32(np.inf))
    down = np.nextafter(x, np.float32(-np.inf))
    x = np.concatenate([x, up, down])
    x = np.concatenate([x, -x])
    return np.unique(x.view(np.uint32)).view(np.float32)


def main():
    x = torch.from_numpy(probes())
    e4 = x.to(torch.float8_e4m3fn).float()
    e5 = x.to(torch.float8_e5m2).float()
    rows = [[int(a), int(b), int(c)] for a, b, c in zip(x.view(torch.int32).numpy().astype(np.uint32),
                                                       e4.view(torch.int32).numpy().astype(np.uint32),
                                                       e5.view(torch.int32).numpy().astype(np.uint32))]
    out = os.path.join(ROOT, "compute", "tests", "fixtures", "fp8", "cast.json")
    with open(out, "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows}, f, separators=(",", ":"))
    print("wrote", out, len(rows), "rows")


if __name__ == "__main__":
    main()
