"""A torch GPT trained data parallel: hpctrain.torch.DistributedDataParallel (MPI) against torch's DDP over gloo.

    mpiexec -n 2 python benchmarks/torch_ddp.py [--quick] [--markdown FILE] [--bucket-mb 25 4]

The same PyTorch model on both sides (``common.torch_gpt``: d_model 256, 4 blocks, 4 heads, 128
tokens, a 65-character vocabulary; AdamW), the same global batch (16 sequences, split over the
ranks), on the same machine in the same run, one thread per process. For each bucket size, the
cases take turns inside every round (machine noise hits them alike) and each case's median step
time over the rounds is kept (the slowest rank's):

* samples/s of each side, and the ratio hpctrain / gloo (target: >= 1.0x on the CPU at 2 ranks),
  at 128 tokens and at 16 (the same gradients for an eighth of the compute: communication-heavy);
* the all-reduce's *exposed* share of the step: (step - the same step under ``no_sync()``) / step,
  measured alike on both sides (what the reduction adds to the step, after whatever backward hid);
* hpctrain's time inside communication calls per step (``ddp.comm_seconds``: starting, polling and
  waiting for buckets).

Needs torch (``pip install 'hpctrain[torch]'``); this benchmark installs nothing and says so without it.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before NumPy or torch load
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import VOCAB, emit, interleaved, spread, torch_dist, torch_gpt  # noqa: E402
from common import gpt_config as config  # noqa: E402


def shapes(c: dict) -> list[dict]:
    """The model at its sequence length, and the same model on sequences 8x shorter: the same
    gradients to reduce for an eighth of the compute, so the reduction weighs on the step."""
    return [c, {**c, "t": c["t"] // 8, "steps": c["steps"] * 3}]


class Side:
    """One data-parallel model (hpctrain's wrapper or torch's) with its optimizer and this rank's batch."""

    def __init__(self, wrap, c: dict, x: np.ndarray, y: np.ndarray) -> None:
        import torch

        self.torch = torch
        torch.manual_seed(0)
        self.ddp = wrap(torch_gpt(VOCAB, c["d"], c["heads"], c["layers"], c["t"]))
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=3e-4, weight_decay=0.1)
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)
        self.comm_s: list[float] = []

    def step(self) -> None:
        self._step()
        self.comm_s.append(getattr(self.ddp, "comm_seconds", float("nan")))

    def _step(self) -> None:
        self.opt.zero_grad()
        logits = self.ddp(self.x)
        self.torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), self.y.view(-1)).backward()
        self.opt.step()

    def local(self) -> None:
        """The same step without the reduction (``no_sync``): what the model's compute costs."""
        with self.ddp.no_sync():
            self._step()


def measure(c: dict, bucket_mb: float, world: MPI.Comm, x: np.ndarray, y: np.ndarray) -> list[tuple]:
    """One row per side for one bucket size."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import hpctrain.torch as htt
    from hpctrain import Communicator

    ours = Side(lambda m: htt.DistributedDataParallel(m, Communicator(), bucket_mb=bucket_mb), c, x, y)
    theirs = Side(lambda m: TorchDDP(m, bucket_cap_mb=bucket_mb), c, x, y)
    cases = {"hpctrain": ours.step, "gloo": theirs.step, "hpctrain local": ours.local, "gloo local": theirs.local}
    t = interleaved(cases, c["steps"], c["rounds"], world)
    med = {k: statistics.median(v) for k, v in t.items()}
    comm_s = world.allreduce(float(np.median(ours.comm_s[2:])), op=MPI.MAX)  # after the warm-up
    rows = []
    for name in ("hpctrain", "gloo"):
        step, alone = med[name], med[f"{name} local"]
        exposed = f"{max(0.0, step - alone) / step:.0%}"
        if name == "hpctrain":
            exposed += f"; {comm_s * 1e3:.1f} ms in communication calls, {len(ours.ddp.buckets.buckets)} bucket(s)"
        label = "hpctrain.torch DDP (MPI)" if name == "hpctrain" else "torch DDP (gloo)"
        ratio = f"{med['gloo'] / med['hpctrain']:.2f}x ({spread(t['gloo'], t['hpctrain'])})"
        rows.append((f"{c['t']} tokens, {bucket_mb:g} MB buckets: {label}", f"{c['batch'] / step:,.1f}",
                     f"{step * 1e3:.0f} ms", exposed,
                     ratio if name == "hpctrain" else "", ">= 1.00x" if name == "hpctrain" else ""))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller GPT and fewer rounds")
    ap.add_argument("--markdown", metavar="FILE", help="append the table to FILE")
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 4.0], help="bucket sizes to compare")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    try:
        import torch
    except ImportError:
        if world.rank == 0:
            print("torch_ddp: torch is not importable (pip install 'hpctrain[torch]'): nothing measured")
        return 0
    torch.set_num_threads(1)
    c = config(args.quick)
    if c["batch"] % world.size:
        if world.rank == 0:
            print(f"torch_ddp: the global batch {c['batch']} does not split over {world.size} ranks")
        return 0
    g = np.random.default_rng(0)
    share = c["batch"] // world.size
    rows_x = g.integers(0, VOCAB, (c["batch"], c["t"]))
    rows_y = g.integers(0, VOCAB, (c["batch"], c["t"]))
    load = os.getloadavg()[0]
    torch_dist(world)
    rows = []
    for shape in shapes(c):
        x = np.ascontiguousarray(rows_x[world.rank * share:(world.rank + 1) * share, :shape["t"]])
        y = np.ascontiguousarray(rows_y[world.rank * share:(world.rank + 1) * share, :shape["t"]])
        rows += [row for mb in args.bucket_mb for row in measure(shape, mb, world, x, y)]
    import torch.distributed as dist

    dist.destroy_process_group()
    if world.rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].strip()
        title = (f"torch_ddp: torch GPT d_model {c['d']}, {c['layers']} blocks, {c['t']} and {c['t'] // 8} tokens, "
                 f"global batch {c['batch']} ({share}/rank); {world.size} ranks, {lib}, torch {torch.__version__}"
                 + (" (--quick)" if args.quick else ""))
        emit(title, ["case", "samples/s", "step", "all-reduce exposed", "hpctrain / gloo samples/s", "target"], rows,
             args.markdown,
             notes=[f"Medians of {c['rounds']} interleaved rounds of {c['steps']} steps, slowest rank, one thread per "
                    "process. Exposed: (step - the same step under no_sync()) / step. Machine load average (1 min) "
                    f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
