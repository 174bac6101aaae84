"""hpctrain's GPT training step on the GPU against PyTorch on the same GPU, both in this run.

Sizes: 85 M (V=65, T=256, d=768, 12 blocks, batch 16) and 163 M (V=50304, T=1024, d=768, 12
blocks, batch 8). For each, hpctrain fp32 and bf16-mixed (float32 masters, AdamW), each eager and
replayed from a CUDA graph captured once shapes are fixed (``--no-graph`` skips that); PyTorch eager
fp32 (TF32 off, as CuPy's float32 products) and bf16 autocast. Interleaved rounds, median step
time; tokens/s, MFU (6 N + 12 L T d FLOP per token over the GPU's dense peak) and peak memory
(hpctrain: the CuPy pool's reserved bytes, freed between cases; PyTorch: max reserved).

    python benchmarks/gpt_gpu.py [--quick] [--cpu | --emulate] [--sizes 85,163] [--no-graph]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hpctrain as ht  # noqa: E402
from hpctrain import backend  # noqa: E402
from hpctrain.nn import cuda_graph, gpu  # noqa: E402
from hpctrain.optim import multi_tensor  # noqa: E402
from hpctrain.training.precision import Precision  # noqa: E402

SIZES = {"85": (65, 256, 768, 12, 12, 16), "163": (50304, 1024, 768, 12, 12, 8), "tiny": (65, 32, 64, 4, 2, 4)}
PEAKS = {"H100": {"fp32": 67e12, "bf16": 989e12}, "H200": {"fp32": 67e12, "bf16": 989e12}}


def build(size, precision, xp_dev):
    """The model, loss, optimizer and batch of one case, and ``step`` (forward, loss, backward,
    update, zeroed gradients) in a namespace with ``n`` (parameters) and ``tokens`` per step."""
    v, t, d, h, n_layers, b = SIZES[size]
    model = ht.nn.GPT(v, t, d, h, n_layers, rng=0).to(xp_dev)
    opt = ht.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    if precision == "bf16":
        opt.set_masters(Precision.of("bf16-mixed").make_masters(list(model.parameters())))
    loss = ht.nn.CrossEntropyLoss()
    g = np.random.default_rng(0)
    xp = backend.get_xp(xp_dev)
    x, y = xp.asarray(g.integers(0, v, (b, t))), xp.asarray(g.integers(0, v, (b, t)))

    def step(mark=lambda phase: contextlib.nullcontext()):
        """One training step; ``mark(phase)`` is a context around each phase (a profiler's range)."""
        with mark("forward"):
            logits = model.forward(x)
        with mark("loss"):
            loss.forward(logits, y)
            g = loss.backward()
        with mark("backward"):
            model.backward(g)
            model.set_cache({})  # as the Trainer: the next forward then reuses these activations' buffers
            loss.cache = None
        with mark("optimizer"):
            opt.step()
            opt.zero_grad()

    n = sum(int(p.data.size) for p in model.parameters())
    return types.SimpleNamespace(model=model, loss=loss, opt=opt, x=x, y=y, step=step, n=n, tokens=b * t)


def captured(step, opt):
    """``step`` replayed from a CUDA graph (``hpctrain.nn.cuda_graph``: warm-up, capture, then per
    replay the optimizer's host side and one graph launch); ``(None, None, reason)`` when the
    capture fails, else ``(replay, bytes the capture allocated, None)``."""
    try:
        graph = cuda_graph.capture(step, warmup=1, before_replay=lambda: multi_tensor.advance(opt),
                                   undo=lambda: setattr(opt, "step_count", opt.step_count - 1))
    except Exception as exc:  # noqa: BLE001 - reported, the eager numbers stand
        return None, 0, f"{type(exc).__name__}: {exc}"[:160]
    return graph.replay, graph.pool_bytes, None


def emulation():
    """The tests' device stand-in in CuPy's place and the kernels emulated on it (``--emulate``)."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    sys.path.insert(0, tests)
    import devicearray
    from gpu_emulator import EmulatedKernels

    from hpctrain.nn import gpu

    backend.use_device_module(devicearray)
    gpu.use_kernels(EmulatedKernels())


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
    ap.add_argument("--emulate", action="store_true", help="dry run of the GPU code (kernels, cuBLAS calls, the "
                    "graph capture) on the CPU: the tests' device stand-in with the kernels emulated, a tiny GPT")
    a = ap.parse_args()
    if a.emulate:
        emulation()
    small = a.cpu or a.emulate
    sizes = ["tiny"] if small else (a.sizes or ("85" if a.quick else "85,163")).split(",")
    rounds = 4 if small else (6 if a.quick else 10)
    xp_dev, tdev = ("cpu", "cpu") if a.cpu else ("gpu", "cuda")
    if not a.cpu and backend.cupy() is None:
        print("SKIP: no CuPy/GPU")
        return 0
    cp = None if a.cpu else backend.cupy()
    real = cp is not None and backend.is_real_cupy(cp)  # a pool to measure, a device to sync
    torch = None
    if not a.emulate:
        try:
            import torch
        except ImportError:
            pass
    sync = (lambda: (cp.cuda.Device().synchronize(), torch is not None and torch.cuda.synchronize())) if real \
        else (lambda: None)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode() if real else \
        ("the CPU stand-in, kernels emulated" if a.emulate else "cpu")
    peak = next((v for k, v in PEAKS.items() if k in name), None)
    print(f"| GPT step on {name} | hpctrain ms | graph ms | torch ms | hpctrain/torch (target <= 1.00x) | "
          "tokens/s | MFU | peak GiB hpctrain / torch (target <= 1.25x) |\n|---|---|---|---|---|---|---|---|",
          flush=True)
    for size in sizes:
        for prec in ("fp32", "bf16"):
            if real:
                cp.get_default_memory_pool().free_all_blocks()
            setup = build(size, prec, xp_dev)
            step, opt, n, tokens = setup.step, setup.opt, setup.n, setup.tokens
            t_h = timed(step, sync, rounds)
            t_g, why, graph_bytes, replay = None, None, 0, None
            if not a.cpu and not a.no_graph:  # (the emulation captures on the stand-in)
                replay, graph_bytes, why = captured(step, opt)
                t_g = timed(replay, sync, rounds) if replay else None
            # the pool's reserved bytes (PyTorch's side: max reserved), the graph's private pool included
            mem_h = (cp.get_default_memory_pool().total_bytes() + graph_bytes) / 2**30 if real else 0.0
            # nothing of this case may stay for the next one's memory (the replay holds the optimizer,
            # hence the model; the shared scratch holds this precision's arrays)
            del step, opt, setup, replay
            gpu.shared.clear()
            gc.collect()
            t_t, mem_t = None, 0.0
            if torch is not None:
                if real:
                    cp.get_default_memory_pool().free_all_blocks()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                tstep, _ = torch_side(size, tdev, prec == "bf16")
                t_t = timed(tstep, sync, rounds)
                mem_t = torch.cuda.max_memory_reserved() / 2**30 if real else 0.0
                del tstep
            v, t, d, h, n_layers, b = SIZES[size]
            best = min(x for x in (t_h, t_g) if x)
            flops = (6 * n + 12 * n_layers * t * d) * tokens
            mfu = f"{flops / best / peak[prec]:.0%}" if peak else "-"
            ratio = f"{best / t_t:.2f}x {'ok' if best <= t_t else 'OVER'}" if t_t else "-"
            mem = f" ({mem_h / mem_t:.2f}x {'ok' if mem_h <= 1.25 * mem_t else 'OVER'})" if mem_t else ""
            print(f"| {size} M {prec} ({n / 1e6:.1f} M) | {t_h * 1e3:.1f} | "
                  f"{f'{t_g * 1e3:.1f}' if t_g else ('-' if why is None else 'capture failed')} | "
                  f"{f'{t_t * 1e3:.1f}' if t_t else '-'} | {ratio} | "
                  f"{tokens / best:,.0f} | {mfu} | {mem_h:.2f} / {mem_t:.2f}{mem} |", flush=True)
            if why:
                print(f"  (graph capture, {size} {prec}: {why})", flush=True)
            elif graph_bytes:
                print(f"  (graph capture, {size} {prec}: the step allocated {graph_bytes / 2**20:.1f} MiB inside "
                      "the capture, from its private pool)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
