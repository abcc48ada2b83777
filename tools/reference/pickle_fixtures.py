"""Real torch.save files for the restricted pickle reader
(compute/src/weights/{pickle,torch_file}.rs), written by PyTorch itself.

Writes compute/tests/fixtures/pickle/:
  state_dict.ckpt     zip, protocol 2: a Lightning-style {"state_dict": ...,
                      "global_step", "epoch"} around an OrderedDict with f32,
                      f16, bf16, f64, i64, bool and f8 e4m3fn tensors, a
                      0-dim tensor, an empty one, two views sharing one
                      storage (at offsets), a transposed (strided) view and a
                      sliced strided view.
  proto4.pt           the same state dict, pickle protocol 4 (FRAME,
                      MEMOIZE, SHORT_BINUNICODE, STACK_GLOBAL).
  legacy.pt           the same, _use_new_zipfile_serialization=False (the
                      pre-1.6 layout: five pickles, then raw storages).
  embedding.pt        an A1111 textual-inversion file: string_to_token,
                      string_to_param with an nn.Parameter (a
                      _rebuild_parameter call), name, step, sd_checkpoint.
  lightning.ckpt      a state dict next to "callbacks" holding an object of a
                      pytorch_lightning class and a NumPy scalar (ComfyUI maps
                      pytorch_lightning classes to an empty object).
  single_key.pt       {"model": {...}}: ComfyUI's lone-dict rule.
Hostile files (must be refused naming the global; never loaded here):
  hostile_system.ckpt torch.save of an object whose __reduce__ is os.system
                      (pickled as posix.system).
  hostile_eval.pt     builtins.eval through __reduce__ (protocol 2 writes it
                      as __builtin__.eval; Python's unpickler, and sdkit,
                      read that name as builtins.eval).
  hostile_module.pt   a whole nn.Linear (torch.nn.modules.linear.Linear):
                      not code execution, but a global outside the table.
  hostile_proto0.ckpt a protocol-0 pickle (GLOBAL opcode 'c') calling
                      os.system, no zip.
and expected.json: per readable file, every tensor's name, dtype, shape and
values (f32, row-major); per hostile file, the global named.

Run: /work/venv-ref/bin/python tools/reference/pickle_fixtures.py
"""
import collections
import json
import os
import pickle
import sys
import types

import numpy as np
import torch

OUT = os.path.join(os.path.dirname(__file__), "../../compute/tests/fixtures/pickle")


def state_dict():
    g = torch.Generator().manual_seed(7)
    sd = collections.OrderedDict()
    sd["model.f32"] = torch.randn(3, 4, generator=g)
    sd["model.f16"] = torch.randn(2, 3, generator=g).half()
    sd["model.bf16"] = torch.randn(5, generator=g).bfloat16()
    sd["model.f64"] = torch.randn(2, 2, generator=g).double()
    sd["model.i64"] = torch.arange(6).reshape(2, 3) - 2
    sd["model.bool"] = torch.tensor([True, False, True])
    sd["model.f8"] = torch.randn(4, generator=g).to(torch.float8_e4m3fn)
    sd["model.scalar"] = torch.tensor(2.5)
    sd["model.empty"] = torch.zeros(0, 3)
    base = torch.randn(24, generator=g)
    sd["model.shared_a"] = base[2:8].view(2, 3)
    sd["model.shared_b"] = base[10:22].view(3, 4)
    sd["model.transposed"] = torch.randn(3, 5, generator=g).t()
    sd["model.sliced"] = torch.randn(4, 6, generator=g)[1:3, ::2]
    return sd


def values(t):
    return t.detach().to(torch.float32).reshape(-1).tolist()


DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float64: "F64", torch.int64: "I64", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}


def describe(sd):
    return {k: {"dtype": DTYPES[v.dtype], "shape": list(v.shape), "values": values(v)}
            for k, v in sd.items()}


class Hostile:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


def main():
    os.makedirs(OUT, exist_ok=True)
    expected = {"files": {}, "hostile": {}}
    sd = state_dict()
    wrapped = {"state_dict": sd, "global_step": 5, "epoch": 1}

    torch.save(wrapped, os.path.join(OUT, "state_dict.ckpt"))
    expected["files"]["state_dict.ckpt"] = describe(sd)
    torch.save(wrapped, os.path.join(OUT, "proto4.pt"), pickle_protocol=4)
    expected["files"]["proto4.pt"] = describe(sd)
    legacy = {k: v for k, v in sd.items() if v.dtype != torch.float8_e4m3fn}
    torch.save({"state_dict": legacy}, os.path.join(OUT, "legacy.pt"),
               _use_new_zipfile_serialization=False)
    expected["files"]["legacy.pt"] = describe(legacy)

    g = torch.Generator().manual_seed(11)
    param = torch.nn.Parameter(torch.randn(2, 16, generator=g))
    emb = {"string_to_token": {"*": torch.tensor(265)},
           "string_to_param": {"*": param},
           "name": "tiny", "step": 10, "sd_checkpoint": "abc",
           "sd_checkpoint_name": "tiny_sd1"}
    torch.save(emb, os.path.join(OUT, "embedding.pt"))
    expected["files"]["embedding.pt"] = describe(
        {"string_to_token.*": emb["string_to_token"]["*"], "string_to_param.*": param})

    # A stand-in Lightning class, pickled under its real module path.
    mod = types.ModuleType("pytorch_lightning.callbacks.model_checkpoint")

    class ModelCheckpoint:
        def __init__(self):
            self.best_model_score = np.float32(0.25)
            self.monitor = "val/loss"
    ModelCheckpoint.__module__ = mod.__name__
    ModelCheckpoint.__qualname__ = "ModelCheckpoint"
    mod.ModelCheckpoint = ModelCheckpoint
    for name in ["pytorch_lightning", "pytorch_lightning.callbacks", mod.__name__]:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[mod.__name__] = mod
    small = collections.OrderedDict(
        (k, sd[k]) for k in ["model.f32", "model.f16", "model.transposed"])
    torch.save({"state_dict": small, "callbacks": {ModelCheckpoint: ModelCheckpoint()},
                "global_step": np.int64(3)},
               os.path.join(OUT, "lightning.ckpt"))
    expected["files"]["lightning.ckpt"] = describe(small)

    torch.save({"model": small}, os.path.join(OUT, "single_key.pt"))
    expected["files"]["single_key.pt"] = describe(small)

    torch.save({"x": Hostile(os.system, "echo pwned")}, os.path.join(OUT, "hostile_system.ckpt"))
    expected["hostile"]["hostile_system.ckpt"] = f"{os.system.__module__}.system"
    torch.save({"x": Hostile(eval, "1+1")}, os.path.join(OUT, "hostile_eval.pt"))
    expected["hostile"]["hostile_eval.pt"] = "builtins.eval"
    torch.save(torch.nn.Linear(2, 2), os.path.join(OUT, "hostile_module.pt"))
    expected["hostile"]["hostile_module.pt"] = "torch.nn.modules.linear.Linear"
    with open(os.path.join(OUT, "hostile_proto0.ckpt"), "wb") as f:
        pickle.dump(Hostile(os.system, "echo pwned"), f, protocol=0)
    expected["hostile"]["hostile_proto0.ckpt"] = f"{os.system.__module__}.system"

    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
