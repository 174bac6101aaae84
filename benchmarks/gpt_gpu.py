"""hpctrain's GPT training step on the GPU against PyTorch on the same GPU, both in this run.

Sizes: 85 M (V=65, T=256, d=768, 12 blocks, batch 16) and 163 M (V=50304, T=1024, d=768, 12
blocks, batch 8). For each, hpctrain fp32 and bf16-mixed (float32 masters, AdamW), each eager and
replayed from a CUDA graph captured once shapes are fixed (``--no-graph`` skips that); PyTorch eager
fp32 (TF32 off, as CuPy's float32 products) and bf16 autocast. Interleaved rounds, median step
time; tokens/s, MFU (6 N + 12 L T d FLOP per token over the GPU's dense peak) and peak memory
(hpctrain: the CuPy pool's reserved bytes, freed between cases; PyTorch: max reserved).

    python benchmarks/gpt_gpu.py [--quick] [--cpu] [--sizes 85,163] [--no-graph]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hpctrain as ht  # noqa: E402
from hpctrain import backend  # noqa: E402
from hpctrain.nn import gpu  # noqa: E402
from hpctrain.optim import multi_tensor  # noqa: E402
from hpctrain.training.precision import Precision  # noqa: E402

SIZES = {"85": (65, 256, 768, 12, 12, 16), "163": (50304, 1024, 768, 12, 12, 8), "tiny": (65, 32, 64, 4, 2, 4)}
PEAKS = {"H100": {"fp32": 67e12, "bf16": 989e12}, "H200": {"fp32": 67e12, "bf16": 989e12}}


def build(size, precision, xp_dev):
    v, t, d, h, n_layers, b = SIZES[size]
    model = ht.nn.GPT(v, t, d, h, n_layers, rng=0).to(xp_dev)
    opt = ht.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    if precision == "bf16":
        opt.set_masters(Precision.of("bf16-mixed").make_masters(list(model.parameters())))
    loss = ht.nn.CrossEntropyLoss()
    g = np.random.default_rng(0)
    xp = backend.get_xp(xp_dev)
    x, y = xp.asarray(g.integers(0, v, (b, t))), xp.asarray(g.integers(0, v, (b, t)))

    def step():
        loss.forward(model.forward(x), y)
        model.backward(loss.backward())
        opt.step()
        opt.zero_grad()

    n = sum(int(p.data.size) for p in model.parameters())
    return step, opt, n, b * t


def captured(step, opt):
    """``step`` replayed from a CUDA graph (warm-up, capture, then per replay the optimizer's host
    side and one graph launch); ``None`` and the reason when capture fails."""
    cp = backend.cupy()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        step()
        stream.synchronize()
        gpu.capturing = True
        try:
            stream.begin_capture()
            try:
                step()
            finally:
                graph = stream.end_capture()
        except Exception as exc:  # noqa: BLE001 - reported, the eager numbers stand
            return None, f"{type(exc).__name__}: {exc}"[:160]
        finally:
            gpu.capturing = False
    opt.step_count -= 1  # the captured call advanced it once; each replay advances it

    def replay():
        multi_tensor.advance(opt)
        graph.launch(stream=stream)

    return replay, None


def torch_side(size, tdev, bf16):
    import torch
    import torch.nn as tnn
    from torch_gpt import TGPT

    v, t, d, h, n_layers, b = SIZES[size]
    torch.backends.cuda.matmul.allow_tf32 = False
    m = TGPT(v, t, d, h, n_layers).to(tdev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1)
    g = np.random.default_rng(0)
    x = torch.from_numpy(g.integers(0, v, (b, t))).to(tdev)
    y = torch.from_numpy(g.integers(0, v, (b, t))).to(tdev).reshape(-1)

    def step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast(tdev, dtype=torch.bfloat16, enabled=bf16):
            loss = tnn.functional.cross_entropy(m(x).reshape(-1, v), y)
        loss.backward()
        opt.step()

    return step, sum(p.numel() for p in m.parameters())


def timed(fn, sync, rounds):
    out = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return float(np.median(out[2:])) if len(out) > 2 else float(np.median(out))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="dry run: NumPy and torch on the CPU, a tiny GPT")
    ap.add_argument("--sizes", default=None)
    ap.add_argument("--no-graph", action="store_true")
    a = ap.parse_args()
    sizes = ["tiny"] if a.cpu else (a.sizes or ("85" if a.quick else "85,163")).split(",")
    rounds = 4 if a.cpu else (6 if a.quick else 10)
    xp_dev, tdev = ("cpu", "cpu") if a.cpu else ("gpu", "cuda")
    if not a.cpu and backend.cupy() is None:
        print("SKIP: no CuPy/GPU")
        return 0
    cp = None if a.cpu else backend.cupy()
    try:
        import torch
    except ImportError:
        torch = None
    sync = (lambda: None) if a.cpu else (lambda: (cp.cuda.Device().synchronize(),
                                                   torch is not None and torch.cuda.synchronize()))
    name = "cpu" if a.cpu else cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    peak = next((v for k, v in PEAKS.items() if k in name), None)
    print(f"| GPT step on {name} | hpctrain ms | graph ms | torch ms | hpctrain/torch | tokens/s | MFU | "
          "peak GiB (hpctrain / torch) |\n|---|---|---|---|---|---|---|---|", flush=True)
    for size in sizes:
        for prec in ("fp32", "bf16"):
            if not a.cpu:
                cp.get_default_memory_pool().free_all_blocks()
            step, opt, n, tokens = build(size, prec, xp_dev)
            t_h = timed(step, sync, rounds)
            t_g, why = None, None
            if not a.cpu and not a.no_graph:
                replay, why = captured(step, opt)
                t_g = timed(replay, sync, rounds) if replay else None
            mem_h = 0.0 if a.cpu else cp.get_default_memory_pool().total_bytes() / 2**30
            del step, opt
            t_t, mem_t = None, 0.0
            if torch is not None:
                if not a.cpu:
                    cp.get_default_memory_pool().free_all_blocks()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                tstep, _ = torch_side(size, tdev, prec == "bf16")
                t_t = timed(tstep, sync, rounds)
                mem_t = 0.0 if a.cpu else torch.cuda.max_memory_reserved() / 2**30
                del tstep
            v, t, d, h, n_layers, b = SIZES[size]
            best = min(x for x in (t_h, t_g) if x)
            flops = (6 * n + 12 * n_layers * t * d) * tokens
            mfu = f"{flops / best / peak[prec]:.0%}" if peak else "-"
            print(f"| {size} M {prec} ({n / 1e6:.1f} M) | {t_h * 1e3:.1f} | "
                  f"{f'{t_g * 1e3:.1f}' if t_g else ('-' if why is None else 'capture failed')} | "
                  f"{f'{t_t * 1e3:.1f}' if t_t else '-'} | {f'{best / t_t:.2f}x' if t_t else '-'} | "
                  f"{tokens / best:,.0f} | {mfu} | {mem_h:.2f} / {mem_t:.2f} |", flush=True)
            if why:
                print(f"  (graph capture, {size} {prec}: {why})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
