"""GPT training step against PyTorch: one process and data parallel, allocations, exposed communication.

    mpiexec -n 2 python benchmarks/gpt_torch.py [--quick] [--markdown FILE] [--no-torch]

The same GPT on both sides (d_model 256, 4 blocks, 4 heads, 128 tokens, a 65-character vocabulary,
global batch 16, AdamW), one BLAS/OpenMP thread per process:

* one process: rank 0 alone (the other ranks wait without spinning), hpctrain's forward + backward
  + AdamW step against PyTorch's (eager, ``scaled_dot_product_attention``), interleaved rounds,
  median step time; target: hpctrain <= 0.9x PyTorch's time. hpctrain twice: the explicit
  protocol (``model.forward`` / ``model.backward`` on arrays) and the same model through the
  autograd engine (called on a tensor: a node per layer, what the trainers run); target: the
  engine within 1.05x of the explicit step;
* data parallel over all ranks (batch 16 / ranks each): ``DataParallelTrainer`` against PyTorch
  ``DistributedDataParallel`` (gloo), interleaved rounds, median of the slowest rank; target:
  hpctrain's samples/s >= 1.1x PyTorch's;
* exposed communication per step (time inside communication calls) for each gradient-progress
  choice (``HPCTRAIN_PROGRESS``-like ``progress=`` of the trainer: ``poll``, ``thread``, ``none``);
* allocations per step: arrays hpctrain's layer buffers create, and bytes allocated above the step's
  starting memory (tracemalloc peak), after warm-up.

PyTorch runs only when it is importable (this benchmark installs nothing). The machine may be
shared: each ratio is taken within one run from interleaved rounds, and the spread of the
per-round ratios is printed as the noise.
"""

from __future__ import annotations

import os

# One thread per process for every library (before NumPy or torch load).
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpctrain as ht  # noqa: E402

try:
    from hpctrain.nn import buffers  # noqa: E402
except ImportError:  # hpctrain before the lean layers (to measure "before")
    buffers = None
from hpctrain.parallel import DataParallelTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CPU, VOCAB, emit, interleaved, spread, torch_dist, torch_gpt  # noqa: E402
from common import gpt_config as config  # noqa: E402

# -- hpctrain side ------------------------------------------------------------------------------


def ht_model(c: dict) -> ht.nn.GPT:
    return ht.nn.GPT(VOCAB, c["t"], c["d"], c["heads"], c["layers"], rng=0)


class HtSolo:
    def __init__(self, c: dict, x: np.ndarray, y: np.ndarray) -> None:
        self.model = ht_model(c)
        self.loss = ht.nn.CrossEntropyLoss()
        self.opt = ht.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1)
        self.x, self.y = x, y

    def step(self) -> None:
        self.opt.zero_grad()
        self.loss.forward(self.model.forward(self.x), self.y)
        self.model.backward(self.loss.backward())
        self.opt.step()


class HtEngine(HtSolo):
    """The same model, loss and optimizer through the autograd engine: the model called on a tensor
    (each layer a fused node), the loss a node, ``backward`` from it."""

    def step(self) -> None:
        from hpctrain.autograd import Tensor

        self.opt.zero_grad()
        self.loss(self.model(Tensor(self.x)), self.y).backward()
        self.opt.step()


class HtDP:
    def __init__(self, c: dict, comm: ht.Communicator, x: np.ndarray, y: np.ndarray, progress: str | None,
                 bucket_mb: float) -> None:
        model = ht_model(c)
        opt = ht.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        kw = {}
        if progress is not None:
            from hpctrain.parallel.reducer import AllReduceReducer

            kw["reducer"] = lambda params, dp: AllReduceReducer(params, dp, bucket_mb=bucket_mb, progress=progress)
        self.tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=comm,
                                      bucket_mb=bucket_mb, **kw)
        # the choice in effect (older trainers always polled)
        self.progress = getattr(getattr(self.tr, "reducer", None), "progress", "poll")
        self.x, self.y = x, y
        self.comm_s: list[float] = []

    def step(self) -> None:
        self.comm_s.append(self.tr.step(self.x, self.y).comm_seconds)


# -- PyTorch side -------------------------------------------------------------------------------


def torch_model(c: dict):
    import torch

    torch.manual_seed(0)
    return torch_gpt(VOCAB, c["d"], c["heads"], c["layers"], c["t"])


class TorchStep:
    def __init__(self, model, x: np.ndarray, y: np.ndarray) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        logits = self.model(self.x)
        self.torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), self.y.view(-1)).backward()
        self.opt.step()


def have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# -- timing -------------------------------------------------------------------------------------


def wait_quietly(comm: MPI.Comm) -> None:
    """Wait for rank 0 without spinning a core (a blocking MPI barrier busy-polls)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.01)


def allocations(step, n: int = 3) -> tuple[float, float]:
    """(arrays hpctrain's buffers create per step, bytes allocated above the step's start per step)."""
    for _ in range(3):
        step()
    made = buffers.created["arrays"] if buffers else float("nan")
    tracemalloc.start()
    peaks = []
    for _ in range(n):
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        step()
        peaks.append(tracemalloc.get_traced_memory()[1] - start)
    tracemalloc.stop()
    made_now = buffers.created["arrays"] if buffers else float("nan")
    return (made_now - made) / n, float(statistics.median(peaks))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller GPT and fewer rounds (well under a minute)")
    ap.add_argument("--markdown", metavar="FILE", help="append the table to FILE")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    ap.add_argument("--small-bucket", type=float, default=1.0, help="bucket MB of the progress comparison")
    ap.add_argument("--only-dp", action="store_true",
                    help="only the data-parallel part (e.g. under mpiexec -genv MPIR_CVAR_ASYNC_PROGRESS 1)")
    args = ap.parse_args(argv)
    c = config(args.quick)
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    use_torch = not args.no_torch and have_torch()
    absent = "not run (--no-torch)" if args.no_torch else "torch not importable"
    if use_torch:
        import torch

        torch.set_num_threads(1)
    load_start = os.getloadavg()
    g = np.random.default_rng(0)
    x_all = g.integers(0, VOCAB, (c["batch"], c["t"]))
    y_all = g.integers(0, VOCAB, (c["batch"], c["t"]))
    tokens = c["batch"] * c["t"]
    rows: list[tuple] = []

    # One process.
    if args.only_dp:
        pass
    elif rank == 0:
        solo = HtSolo(c, x_all, y_all)
        cases = {"hpctrain": solo.step}
        if hasattr(ht, "autograd"):  # hpctrain before the engine measures the explicit step alone
            cases["engine"] = HtEngine(c, x_all, y_all).step
        if use_torch:
            cases["torch"] = TorchStep(torch_model(c), x_all, y_all).step
        t = interleaved(cases, c["steps"], c["rounds"])
        _solo_rows(rows, t, tokens, use_torch, absent)
        for k in [k for k in ("hpctrain", "engine") if k in cases]:
            per_step, peak = allocations(cases[k])
            how = "explicit" if k == "hpctrain" else "engine"
            rows.append((f"1 process, {how}: arrays created per step (after warm-up)", f"{per_step:.0f}", "", "",
                         "0"))
            rows.append((f"1 process, {how}: bytes allocated above the step's start", f"{peak / 2**20:.1f} MiB",
                         "", "", ""))
        world.Ibarrier().Wait()  # matches the others' Ibarrier (a blocking Barrier would not)
    else:
        wait_quietly(world)
    if os.environ.get("MPIR_CVAR_ASYNC_PROGRESS", "0") not in ("", "0") and rank == 0:
        rows.append(("MPICH async progress thread", "on (MPIR_CVAR_ASYNC_PROGRESS)", "", "", ""))

    # Data parallel over every rank.
    if size > 1 and c["batch"] % size == 0:
        comm = ht.Communicator()
        share = c["batch"] // size
        x, y = x_all[rank * share:(rank + 1) * share], y_all[rank * share:(rank + 1) * share]
        # The default trainer (25 MB buckets: this GPT fits one, so nothing overlaps), then small
        # buckets under each progress choice.
        configs = [(None, 25.0)] + [(p, args.small_bucket) for p in _progress_choices()]
        dps = {cfg: HtDP(c, comm, x, y, cfg[0], cfg[1]) for cfg in configs}
        names = {cfg: f"hpctrain, {cfg[1]:g} MB buckets, progress={dps[cfg].progress}" for cfg in configs}
        cases = {names[cfg]: dps[cfg].step for cfg in configs}
        pg = None
        if use_torch:
            pg = torch_dist(world)
            from torch.nn.parallel import DistributedDataParallel

            cases["torch"] = TorchStep(DistributedDataParallel(torch_model(c), bucket_cap_mb=25), x, y).step
        t = interleaved(cases, c["steps"], c["rounds"], world)
        theirs = statistics.median(t["torch"]) if use_torch else None
        for cfg in configs:
            name, dp = names[cfg], dps[cfg]
            ours = statistics.median(t[name])
            comm_s = world.allreduce(float(np.median(dp.comm_s[2:])), op=MPI.MAX)
            rows.append((f"dp={size} (batch {share}/rank): {name[10:]}",
                         f"{c['batch'] / ours:,.1f} samples/s ({tokens / ours:,.0f} tokens/s); "
                         f"exposed comm {comm_s * 1e3:.1f} ms/step ({comm_s / ours:.1%})",
                         f"{c['batch'] / theirs:,.1f} samples/s" if theirs else absent,
                         f"{theirs / ours:.2f}x samples/s ({spread(t['torch'], t[name])})" if theirs else "",
                         ">= 1.10x" if cfg == configs[0] and theirs else ""))
        if pg is not None:
            import torch.distributed as dist

            dist.destroy_process_group()

    if rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].strip()
        torch_v = f"torch {__import__('torch').__version__}" if use_torch else "torch absent"
        title = (f"gpt_torch: GPT d_model {c['d']}, {c['layers']} blocks, {c['heads']} heads, {c['t']} tokens, "
                 f"batch {c['batch']}; {size} ranks, {lib}, {torch_v}" + (" (--quick)" if args.quick else ""))
        emit(title, ["measurement", "hpctrain", "PyTorch", "ratio", "target"], rows, args.markdown,
             notes=[f"Medians of {c['rounds']} interleaved rounds of {c['steps']} steps, one thread per process; "
                    "dp times are the slowest rank's. Exposed comm: seconds inside communication calls per step. "
                    f"Machine load average (1 min) {load_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
                    f"end, on {os.cpu_count()} cores (above the rank count: other work shared the cores)."])
    return 0


def _solo_rows(rows: list, t: dict[str, list[float]], tokens: int, use_torch: bool, absent: str) -> None:
    """The one-process rows: each hpctrain step against PyTorch's, and the engine's against the
    explicit one (wall and CPU time: the machine may be shared)."""
    label = {"hpctrain": "explicit protocol", "engine": "through the autograd engine"}
    for k in [k for k in ("hpctrain", "engine") if k in t]:
        ours = statistics.median(t[k])
        if use_torch:
            theirs = statistics.median(t["torch"])
            rows.append((f"1 process, {label[k]}: step time", f"{ours * 1e3:.0f} ms ({tokens / ours:,.0f} tokens/s)",
                         f"{theirs * 1e3:.0f} ms ({tokens / theirs:,.0f} tokens/s)",
                         f"{ours / theirs:.2f}x time ({spread(t[k], t['torch'])})", "<= 0.90x"))
            c_ours, c_theirs = statistics.median(CPU[k]), statistics.median(CPU["torch"])
            rows.append((f"1 process, {label[k]}: CPU time per step (less sensitive to a shared machine)",
                         f"{c_ours * 1e3:.0f} ms", f"{c_theirs * 1e3:.0f} ms",
                         f"{c_ours / c_theirs:.2f}x ({spread(CPU[k], CPU['torch'])})", "<= 0.90x"))
        else:
            rows.append((f"1 process, {label[k]}: step time", f"{ours * 1e3:.0f} ms ({tokens / ours:,.0f} tokens/s)",
                         absent, "", ""))
    if "engine" in t:
        e, x = statistics.median(CPU["engine"]), statistics.median(CPU["hpctrain"])
        rows.append(("1 process: the engine's CPU time over the explicit step's", f"{e * 1e3:.0f} / {x * 1e3:.0f} ms",
                     "", f"{e / x:.3f}x ({spread(CPU['engine'], CPU['hpctrain'])})", "<= 1.05x"))


def _progress_choices() -> list[str | None]:
    """The trainer's gradient-progress choices (``[None]``: an older trainer without the choice)."""
    try:
        from hpctrain.comm.progress import PROGRESS
    except ImportError:
        return [None]
    return list(PROGRESS)


if __name__ == "__main__":
    sys.exit(main())
