"""PyTorch peer for benches/unet_step.rs: the SD1.5 UNet architecture (ldm
layout: ResBlocks, SpatialTransformers with conv projections, GEGLU, 8
heads, nearest upsampling), random weights, fp16 on CUDA (or f32 on the CPU with --cpu), one denoiser step
at batch 2, 64x64 latent, 77x768 context. Prints `seconds_per_step S`.

Written for timing only: same layers and shapes as sdkit's graph, not a
numerics reference (those live in tools/reference/)."""

import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def gn(c):
    return nn.GroupNorm(32, c, eps=1e-5)


class Res(nn.Module):
    def __init__(self, cin, cout, emb):
        super().__init__()
        self.n1, self.c1 = gn(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.e = nn.Linear(emb, cout)
        self.n2, self.c2 = gn(cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, emb):
        h = self.c1(F.silu(self.n1(x)))
        h = h + self.e(F.silu(emb))[:, :, None, None]
        h = self.c2(F.silu(self.n2(h)))
        return self.skip(x) + h


class Attn(nn.Module):
    def __init__(self, c, ctx, heads):
        super().__init__()
        self.h = heads
        self.q = nn.Linear(c, c, bias=False)
        self.k = nn.Linear(ctx, c, bias=False)
        self.v = nn.Linear(ctx, c, bias=False)
        self.o = nn.Linear(c, c)

    def forward(self, x, ctx):
        b, n, c = x.shape
        q, k, v = self.q(x), self.k(ctx), self.v(ctx)
        q, k, v = (t.view(b, -1, self.h, c // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, n, c))


class Transformer(nn.Module):
    def __init__(self, c, ctx, heads=8):
        super().__init__()
        self.norm = nn.GroupNorm(32, c, eps=1e-6)
        self.pin, self.pout = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.l1, self.l2, self.l3 = nn.LayerNorm(c), nn.LayerNorm(c), nn.LayerNorm(c)
        self.a1, self.a2 = Attn(c, c, heads), Attn(c, ctx, heads)
        self.ff1, self.ff2 = nn.Linear(c, 8 * c), nn.Linear(4 * c, c)

    def forward(self, x, ctx):
        b, c, h, w = x.shape
        y = self.pin(self.norm(x)).flatten(2).transpose(1, 2)
        y = y + self.a1(self.l1(y), self.l1(y))
        y = y + self.a2(self.l2(y), ctx)
        a, g = self.ff1(self.l3(y)).chunk(2, dim=-1)
        y = y + self.ff2(a * F.gelu(g))
        y = y.transpose(1, 2).reshape(b, c, h, w)
        return x + self.pout(y)


class UNet(nn.Module):
    def __init__(self, mc=320, mult=(1, 2, 4, 4), attn=(1, 1, 1, 0), ctx=768):
        super().__init__()
        emb = 4 * mc
        self.mc = mc
        self.temb = nn.Sequential(nn.Linear(mc, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.cin = nn.Conv2d(4, mc, 3, padding=1)
        self.down = nn.ModuleList()
        chans, ch = [mc], mc
        for lvl, m in enumerate(mult):
            for _ in range(2):
                blk = nn.ModuleList([Res(ch, m * mc, emb)])
                ch = m * mc
                if attn[lvl]:
                    blk.append(Transformer(ch, ctx))
                self.down.append(blk)
                chans.append(ch)
            if lvl != len(mult) - 1:
                self.down.append(nn.ModuleList([nn.Conv2d(ch, ch, 3, stride=2, padding=1)]))
                chans.append(ch)
        self.mid = nn.ModuleList([Res(ch, ch, emb), Transformer(ch, ctx), Res(ch, ch, emb)])
        self.up = nn.ModuleList()
        for lvl, m in reversed(list(enumerate(mult))):
            for i in range(3):
                blk = nn.ModuleList([Res(ch + chans.pop(), m * mc, emb)])
                ch = m * mc
                if attn[lvl]:
                    blk.append(Transformer(ch, ctx))
                if lvl and i == 2:
                    blk.append(nn.Conv2d(ch, ch, 3, padding=1))
                self.up.append(blk)
        self.nout, self.cout = gn(ch), nn.Conv2d(ch, 4, 3, padding=1)

    def run(self, blk, h, emb, ctx):
        for layer in blk:
            if isinstance(layer, Res):
                h = layer(h, emb)
            elif isinstance(layer, Transformer):
                h = layer(h, ctx)
            elif layer.stride == (2, 2):
                h = layer(h)
            else:
                h = layer(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return h

    def forward(self, x, t, ctx):
        half = self.mc // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=x.device) / half)
        args = t[:, None].float() * freqs[None]
        temb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(x.dtype)
        emb = self.temb(temb)
        h = self.cin(x)
        skips = [h]
        for blk in self.down:
            h = self.run(blk, h, emb, ctx)
            skips.append(h)
        h = self.run(self.mid, h, emb, ctx)
        for blk in self.up:
            h = self.run(blk, torch.cat([h, skips.pop()], dim=1), emb, ctx)
        return self.cout(F.silu(self.nout(h)))


def main():
    small = "--small" in sys.argv
    cpu = "--cpu" in sys.argv
    if cpu:
        # --bf16: PyTorch's bf16 CPU path (oneDNN; AMX where the CPU has it).
        dev, dt = "cpu", (torch.bfloat16 if "--bf16" in sys.argv else torch.float32)
        threads = os.environ.get("RAYON_NUM_THREADS")
        if threads:
            torch.set_num_threads(int(threads))
    else:
        assert torch.cuda.is_available(), "needs CUDA"
        dev, dt = "cuda", torch.float16
    mc, hw = (32, 16) if small else (320, 64)
    torch.manual_seed(0)
    model = UNet(mc).to(dev, dt).eval()
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(2, 4, hw, hw, device=dev, dtype=dt)
    t = torch.full((2,), 999.0, device=dev)
    ctx = torch.randn(2, 77, 768, device=dev, dtype=dt)
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    with torch.inference_mode():
        for _ in range(1 if cpu else 3):
            model(x, t, ctx)
        sync()
        once = time.perf_counter()
        model(x, t, ctx)
        sync()
        once = time.perf_counter() - once
        if cpu:
            # Few, long runs: the median, like the Rust side.
            times = [once]
            for _ in range(4 if small else 2):
                start = time.perf_counter()
                model(x, t, ctx)
                times.append(time.perf_counter() - start)
            secs = sorted(times)[len(times) // 2]
        else:
            iters = max(5, min(50, int(2.0 / max(once, 1e-6))))
            start = time.perf_counter()
            for _ in range(iters):
                model(x, t, ctx)
            sync()
            secs = (time.perf_counter() - start) / iters
    print(f"params {params / 1e6:.1f} M")
    print(f"seconds_per_step {secs}")


if __name__ == "__main__":
    main()
