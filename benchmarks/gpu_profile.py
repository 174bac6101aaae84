"""Where one GPT training step's GPU time goes: a short profile for a brief GPU call (issue 40).

For the 85 M GPT (``gpt_gpu.SIZES``) in fp32 and bf16-mixed, after two warm-up steps:

1. one step under ``torch.profiler`` (CUDA and CPU activities: CUPTI records every kernel of the
   process, CuPy's and cuBLAS's included): the top kernels by GPU time, the launches per step
   (kernels, copies, memsets), the runtime/driver calls (syncs and host reads show up there),
   GPU busy time (the union of the kernels' intervals) against the step's wall time and its
   host time (how long the Python step takes to enqueue: close to wall time means launch-bound);
2. each module's forward and backward with a device sync around it (leaf layers, the attention
   core, loss, optimizer), as ``../shared/gpu/profile_step.py`` does;
3. the CuPy pool: bytes in use at the step's peak (a memory hook sees every pool allocation),
   reserved bytes, allocations per step, and the largest live arrays at the peak;
4. PyTorch's eager fp32 / bf16 autocast step of the same model under the same profiler (top kernels).

    python benchmarks/gpu_profile.py [--cpu | --emulate] [--size 85] [--no-torch] [--top 25]

``--cpu``: a dry run on NumPy with a tiny GPT and the CPU profiler only (proves the script end to
end without a GPU; its kernel table lists the step's annotated ranges instead). The output also
goes to ``$OUT/profile.txt`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_gpu import SIZES, build, captured, emulation, torch_side  # noqa: E402

from hpctrain import backend  # noqa: E402
from hpctrain.nn import gpu  # noqa: E402

LINES: list[str] = []


def say(text: str = "") -> None:
    print(text, flush=True)
    LINES.append(text)


class PoolWatch:
    """A CuPy memory hook: bytes in use (pool allocations not yet freed), their peak, allocations
    counted, and the live sizes at the peak."""

    def __init__(self, cp: Any) -> None:
        from cupy.cuda import memory_hook

        watch = self

        class Hook(memory_hook.MemoryHook):
            name = "hpctrain_profile"

            def malloc_postprocess(self, **kw: Any) -> None:
                watch.on_malloc(kw["mem_ptr"], kw["mem_size"])

            def free_postprocess(self, **kw: Any) -> None:
                watch.live.pop(kw["mem_ptr"], None)

        self.cp, self.hook = cp, Hook()
        self.live: dict[int, int] = {}
        self.reset()

    def reset(self) -> None:
        self.mallocs = self.malloc_bytes = 0
        self.peak = self.used()
        self.at_peak: list[int] = sorted(self.live.values(), reverse=True)

    def used(self) -> int:
        return int(self.cp.get_default_memory_pool().used_bytes())

    def on_malloc(self, ptr: int, size: int) -> None:
        self.live[ptr] = size
        self.mallocs += 1
        self.malloc_bytes += size
        used = self.used()
        if used > self.peak:
            self.peak = used
            self.at_peak = sorted(self.live.values(), reverse=True)


def kernel_events(trace: dict, cpu: bool) -> list[dict]:
    """The trace's device activities (kernels, copies, memsets); on ``--cpu`` its annotated ranges."""
    cats = ("user_annotation",) if cpu else ("kernel", "gpu_memcpy", "gpu_memset")
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in cats]


def busy_us(events: list[dict]) -> float:
    """The union of the events' intervals (overlapping streams counted once)."""
    total, end = 0.0, -1.0
    for e in sorted(events, key=lambda e: e["ts"]):
        s, f = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if f > end:
            total += f - max(s, end)
            end = f
    return total


def short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def table_of_kernels(events: list[dict], top: int, title: str) -> None:
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by[e["name"]][0] += 1
        by[e["name"]][1] += float(e.get("dur", 0))
    total = sum(t for _, t in by.values()) or 1.0
    say(f"\n{title}: {len(events)} launches, {total / 1e3:.2f} ms of GPU time in {len(by)} distinct kernels")
    say("| kernel | calls | ms | share | us per call |")
    say("|---|---|---|---|---|")
    for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        say(f"| {short(name)} | {n} | {t / 1e3:.3f} | {t / total:.1%} | {t / n:.1f} |")


def profiled(step: Any, sync: Any, cpu: bool, phases: bool = True) -> dict:
    """One ``step`` under the profiler; its Chrome trace as a dict."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
    sync()
    with profile(activities=acts) as prof:
        step()
        sync()
    del torch
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def host_and_wall(step: Any, sync: Any, rounds: int = 5) -> tuple[float, float]:
    """Median host time (the Python step returning, nothing waited for) and wall time (synced)."""
    host, wall = [], []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync()
        host.append(t1 - t0)
        wall.append(time.perf_counter() - t0)
    return float(np.median(host)), float(np.median(wall))


def per_module(setup: Any, sync: Any, steps: int = 2) -> None:
    """Each leaf module's forward and backward (and the attention core, loss, optimizer) with a sync
    around it."""
    acc: dict[str, float] = collections.defaultdict(float)
    wrapped = []

    def wrap(mod: Any, label: str) -> None:
        f, b = mod.forward, mod.backward

        def fw(*a: Any, **k: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            r = f(*a, **k)
            sync()
            acc[label + " fwd"] += time.perf_counter() - t0
            return r

        def bw(*a: Any, **k: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            r = b(*a, **k)
            sync()
            acc[label + " bwd"] += time.perf_counter() - t0
            return r

        mod.__dict__["forward"], mod.__dict__["backward"] = fw, bw
        wrapped.append(mod)

    for name, m in setup.model.named_modules():
        label = ".".join(p for p in name.split(".") if not p.isdigit())
        if type(m).__name__ == "CausalSelfAttention":
            wrap(m, "attn (whole: qkv + core + proj)")
        elif name and not m.children():
            wrap(m, f"{label} ({type(m).__name__})")
    try:
        for _ in range(steps):
            logits = setup.model.forward(setup.x)
            sync()
            t0 = time.perf_counter()
            setup.loss.forward(logits, setup.y)
            g = setup.loss.backward()
            sync()
            acc["loss fwd+bwd"] += time.perf_counter() - t0
            setup.model.backward(g)
            sync()
            t0 = time.perf_counter()
            setup.opt.step()
            setup.opt.zero_grad()
            sync()
            acc["optimizer step + zero_grad"] += time.perf_counter() - t0
    finally:
        for m in wrapped:
            del m.__dict__["forward"], m.__dict__["backward"]
    for d in ("fwd", "bwd"):
        whole = acc.get(f"attn (whole: qkv + core + proj) {d}", 0.0)
        parts = sum(v for k, v in acc.items() if k.endswith(f" {d}") and (".qkv " in k or ".proj " in k))
        if whole:
            acc[f"attn core (whole - qkv - proj) {d}"] = whole - parts
            del acc[f"attn (whole: qkv + core + proj) {d}"]
    total = sum(acc.values())
    say(f"\nper module (a sync around each; {steps} steps averaged): {total / steps * 1e3:.2f} ms per step")
    say("| part | ms per step | share |")
    say("|---|---|---|")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        say(f"| {k} | {v / steps * 1e3:.3f} | {v / total:.1%} |")


def runtime_calls(trace: dict) -> None:
    """The CPU side's CUDA runtime/driver calls by name (launches, syncs, copies, mallocs)."""
    by = collections.Counter()
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            by[e["name"]] += 1
    if by:
        say("runtime/driver calls in the step: " + ", ".join(f"{k} {v}" for k, v in by.most_common(12)))


def hpctrain_case(size: str, prec: str, a: argparse.Namespace, cp: Any, watch: PoolWatch | None) -> None:
    """Profile, timings, pool and per-module table of one hpctrain case (its arrays are freed when
    this returns: the caller empties the pool)."""
    xp_dev = "cpu" if a.cpu else "gpu"
    sync = (lambda: None) if a.host else cp.cuda.Device().synchronize
    setup = build(size, prec, xp_dev)
    for _ in range(2):
        setup.step()
    sync()
    host, wall = host_and_wall(setup.step, sync)
    if watch is not None:
        watch.reset()
    from torch.profiler import record_function

    step = setup.step
    trace = profiled(lambda: step(mark=lambda phase: record_function(f"hpctrain {phase}")), sync, a.host)
    v, t, d, h, n_layers, b = SIZES[size]
    say(f"\n## hpctrain GPT {size} M {prec} ({setup.n / 1e6:.1f} M parameters, batch {b} x {t} tokens)")
    ev = kernel_events(trace, a.host)
    gpu_busy = busy_us(ev) / 1e3
    say(f"step: wall {wall * 1e3:.2f} ms (synced, median of 5), host {host * 1e3:.2f} ms (the Python step "
        f"returning), GPU busy {gpu_busy:.2f} ms ({gpu_busy / (wall * 1e3):.0%} of wall): "
        + ("launch/host-bound" if gpu_busy < 0.8 * wall * 1e3 and host > 0.7 * wall else "GPU-bound"
           if gpu_busy >= 0.8 * wall * 1e3 else "gaps: host syncs or waits"))
    table_of_kernels(ev, a.top, "kernels in the profiled step" if not a.host else "annotated ranges (no GPU)")
    runtime_calls(trace)
    if watch is not None:
        pool = cp.get_default_memory_pool()
        sizes = collections.Counter(watch.at_peak)
        say(f"\nCuPy pool: peak in use during the step {watch.peak / 2**30:.3f} GiB, reserved "
            f"{pool.total_bytes() / 2**30:.3f} GiB, in use after {pool.used_bytes() / 2**30:.3f} GiB; "
            f"{watch.mallocs} pool allocations in the step ({watch.malloc_bytes / 2**20:,.1f} MiB)")
        say(f"live arrays at the peak: {len(watch.at_peak)}; largest sizes (MiB x count): "
            + ", ".join(f"{s / 2**20:.1f} x {c}" for s, c in sorted(sizes.items(), key=lambda kv: -kv[0])[:12]))
    per_module(setup, sync)
    if not a.cpu:  # (--emulate captures on the stand-in)
        graph_line(setup, sync)


def graph_line(setup: Any, sync: Any) -> None:
    """The same step captured once into a CUDA graph (``gpt_gpu.captured``) and replayed."""
    replay, graph_bytes, why = captured(setup.step, setup.opt)
    if replay is None:
        say(f"\nCUDA graph: capture failed: {why}")
        return
    _, wall = host_and_wall(replay, sync)
    say(f"\nCUDA graph: {wall * 1e3:.2f} ms per replayed step; {graph_bytes / 2**20:.1f} MiB allocated inside the "
        "capture (0: the step allocates nothing)")


def torch_case(size: str, prec: str, a: argparse.Namespace) -> None:
    import torch

    tdev = "cpu" if a.cpu else "cuda"
    sync = (lambda: None) if a.cpu else torch.cuda.synchronize
    tstep, n = torch_side(size, tdev, prec == "bf16")
    for _ in range(2):
        tstep()
    host, wall = host_and_wall(tstep, sync)
    trace = profiled(tstep, sync, a.cpu)
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and
          e.get("cat") in (("cpu_op",) if a.cpu else ("kernel", "gpu_memcpy", "gpu_memset"))]
    gpu_busy = busy_us(ev) / 1e3
    say(f"\n## PyTorch {'bf16 autocast' if prec == 'bf16' else 'eager fp32 (TF32 off)'} {size} M: wall "
        f"{wall * 1e3:.2f} ms, host {host * 1e3:.2f} ms, GPU busy {gpu_busy:.2f} ms")
    table_of_kernels(ev, min(a.top, 15), "PyTorch's kernels" if not a.cpu else "PyTorch's CPU ops (--cpu)")
    if not a.cpu:
        say(f"PyTorch peak memory {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB allocated, "
            f"{torch.cuda.max_memory_reserved() / 2**30:.3f} GiB reserved")
    del tstep
    gc.collect()
    if not a.cpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on NumPy, a tiny GPT, the CPU profiler")
    ap.add_argument("--size", default=None, help="a gpt_gpu.SIZES key (default 85; tiny on --cpu)")
    ap.add_argument("--no-torch", action="store_true", help="skip PyTorch's side")
    ap.add_argument("--emulate", action="store_true", help="dry run of the GPU code on the CPU (the tests' stand-in, "
                    "kernels emulated, a tiny GPT, the capture included)")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    t0 = time.time()
    a.host = a.cpu or a.emulate  # no device to sync, no CUPTI
    if a.emulate:
        emulation()
    size = a.size or ("tiny" if a.host else "85")
    try:
        import torch  # noqa: F401 - the profiler is PyTorch's
    except ImportError:
        say("gpu_profile: SKIP: torch does not import (its profiler records the kernels)")
        return 0
    cp = None
    if a.emulate:
        cp = backend.cupy()
    elif not a.cpu:
        cp = backend.cupy()
        if cp is None:
            say("gpu_profile: SKIP: no CuPy/GPU (--cpu runs the dry run)")
            return 0
        torch.cuda.init()
        say(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, CuPy {cp.__version__}, "
            f"torch {torch.__version__}")
    watch = None
    if cp is not None and backend.is_real_cupy(cp):
        watch = PoolWatch(cp)
        watch.hook.__enter__()
    try:
        for prec in ("fp32", "bf16"):
            hpctrain_case(size, prec, a, cp, watch)
            gpu.shared.clear()  # this precision's scratch: not the next case's memory
            gc.collect()
            if watch is not None:
                cp.get_default_memory_pool().free_all_blocks()
    finally:
        if watch is not None:
            watch.hook.__exit__()
    if not (a.no_torch or a.emulate):
        for prec in ("fp32", "bf16"):
            torch_case(size, prec, a)
    say(f"\n(gpu_profile took {time.time() - t0:.0f} s)")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "profile.txt"), "w") as f:
            f.write("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
