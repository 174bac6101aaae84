"""A data-parallel step with its gradient buckets overlapped with backward or not, flat or by node.

    mpiexec -n 4 python benchmarks/dp_overlap.py [--quick] [--markdown FILE]

Meant for a world across nodes (benchmarks/two_nodes.py runs it on the two namespace nodes, the
link shaped by ``tc``): the same MLP and batch under ``DataParallelTrainer`` with ``overlap`` on
and off (bucket all-reduces started from backward hooks, or all after backward) and ``backend``
``mpi`` (flat) and ``hierarchical`` (reduce in the node, all-reduce across leaders, broadcast),
against two references measured in the same run: the step's compute alone (the same model on a
1-rank communicator, all ranks at once so the machine is as busy) and one raw mpi4py
``Allreduce`` of all the gradient bytes (what the communication costs with nothing around it).
Exposed communication = step - compute; "hidden" = the part of the raw all-reduce the step did
not pay. Rounds are interleaved (load from other jobs hits every case alike), each case's best kept.
"""

from __future__ import annotations

import os

# One BLAS thread per rank: ranks share the cores.
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpctrain as ht  # noqa: E402
from hpctrain.comm.nodes import describe, node_names  # noqa: E402
from hpctrain.parallel import DataParallelTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402
from ddp import CLASSES, mlp, time_steps  # noqa: E402

#: (overlap, backend) of each measured trainer, in table order.
CASES = ((True, "mpi"), (False, "mpi"), (True, "hierarchical"), (False, "hierarchical"))


def trainer(comm: ht.Communicator, args: argparse.Namespace, overlap: bool, backend: str):
    """A DataParallelTrainer of the benchmark's MLP and its step on a fixed batch of this rank."""
    model = mlp(args.width, args.depth, args.d_in)
    opt = ht.optim.SGD(model.parameters(), lr=1e-3)
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=comm,
                             overlap=overlap, bucket_mb=args.bucket_mb, backend=backend)
    g = np.random.default_rng(comm.rank)
    x = g.normal(size=(args.batch, args.d_in)).astype(np.float32)
    y = g.integers(0, CLASSES, args.batch)
    return lambda: tr.step(x, y)


def raw_allreduce(n_params: int):
    """One raw mpi4py Allreduce (in place, float32) of ``n_params`` values."""
    buf = np.ones(n_params, np.float32)
    return lambda: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller MLP, fewer rounds")
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="gradient bucket size (several buckets per step)")
    ap.add_argument("--markdown", metavar="FILE", help="append the table to FILE")
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.d_in, args.batch, args.iters, args.rounds = 512, 4, 256, 64, 3, 3
    else:
        args.width, args.depth, args.d_in, args.batch, args.iters, args.rounds = 1024, 5, 512, 128, 4, 5
    world = ht.Communicator()
    where = describe(node_names(world))  # collective: every rank, before rank 0 alone writes the table
    alone = world.split(world.rank)
    n_params = sum(p.data.size for p in mlp(args.width, args.depth, args.d_in).parameters())
    sides = {"compute": trainer(alone, args, True, "mpi"), "raw": raw_allreduce(n_params)}
    sides.update({case: trainer(world, args, *case) for case in CASES})
    best = dict.fromkeys(sides, float("inf"))
    for i in range(args.rounds):
        keys = list(sides)
        for k in keys[i % len(keys):] + keys[: i % len(keys)]:
            best[k] = min(best[k], time_steps(sides[k], args.iters, 1))
    if world.rank == 0:
        emit(*_table(world, where, args, n_params, best))
    alone.free()
    return 0


def _table(world: ht.Communicator, where: str, args: argparse.Namespace, n_params: int, best: dict) -> tuple:
    """``emit``'s arguments: the title, the header, a row per case and the notes."""
    compute, raw = best["compute"], best["raw"]
    rows = [["compute alone (1-rank communicator)", f"{compute * 1e3:.1f}", "", "", ""],
            [f"raw mpi4py Allreduce of {n_params * 4 / 2**20:.1f} MB", f"{raw * 1e3:.1f}", "", "", ""]]
    for overlap, backend in CASES:
        t = best[(overlap, backend)]
        exposed = max(t - compute, 0.0)
        rows.append([f"dp step, {'flat' if backend == 'mpi' else backend}, overlap {'on' if overlap else 'off'}",
                     f"{t * 1e3:.1f}", f"{exposed * 1e3:.1f}", f"{1 - exposed / raw:.0%}",
                     f"{t / best[(True, 'mpi')]:.2f}"])
    lib = MPI.Get_library_version().splitlines()[0].strip()
    title = (f"dp step overlap: {world.size} ranks ({where}), MLP {n_params / 1e6:.2f} M "
             f"params float32, batch {args.batch}/rank, buckets {args.bucket_mb:g} MB, {lib}"
             + (" (--quick)" if args.quick else ""))
    notes = ["Times: slowest rank, best of interleaved rounds. exposed = step - compute alone; hidden = "
             "1 - exposed / raw all-reduce (the share of the communication the step did not pay); "
             "vs default = step / the default's step (flat, overlap on)."]
    return (title, ["case", "ms/step", "exposed comm ms", "hidden", "vs default"], rows, args.markdown, notes)


if __name__ == "__main__":
    sys.exit(main())
