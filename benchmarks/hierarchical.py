"""Hierarchical (node-aware) all-reduce vs the flat one vs raw mpi4py, on the same buffers.

    mpiexec -n 4 python benchmarks/hierarchical.py [--ranks-per-node 2] [--quick] [--markdown REPORT.md]

Nodes are measured (host names, ``HPCTRAIN_NODE_NAME``); ``--ranks-per-node K`` makes ranks
``0..K-1`` one "node", ``K..2K-1`` the next, and so on, so the three stages run as on K ranks per
node (on one host with an even number of ranks, two such nodes are claimed by default). The
three sides run in interleaved rounds (which goes first rotates) and each side's median round is
kept. On one host the "inter-node" link is shared memory like the rest,
so the hierarchical scheme only pays its extra stages there; it wins where the link between nodes
is much slower than shared memory (fewer bytes cross it: one leader per node sends them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, timed  # noqa: E402

from hpctrain import Communicator  # noqa: E402
from hpctrain.comm.hierarchical import HierarchicalComm  # noqa: E402
from hpctrain.comm.nodes import describe, node_names  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", type=int, default=4 << 10)
    ap.add_argument("--max-bytes", type=int, default=16 << 20)
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds per size; the median is kept")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="claim nodes of this many consecutive ranks (default: the measured nodes)")
    ap.add_argument("--quick", action="store_true", help="up to 1 MiB, 3 rounds")
    ap.add_argument("--markdown", metavar="FILE", help="append the table to FILE as Markdown")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_bytes, args.rounds = min(args.max_bytes, 1 << 20), 3
    comm = Communicator()
    names = node_names(comm)
    if not args.ranks_per_node and len(set(names)) == 1 and comm.size >= 4 and comm.size % 2 == 0:
        args.ranks_per_node = comm.size // 2  # one host: two claimed nodes, or there is nothing to compare
    claimed = bool(args.ranks_per_node)
    if claimed:
        names = [f"node{r // args.ranks_per_node}" for r in range(comm.size)]
    hier = HierarchicalComm(comm, names)
    raw = MPI.COMM_WORLD
    rows = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        rows.append(_measure(comm, hier, raw, nbytes // 4, args.rounds))
        nbytes *= 4
    hier.free()
    if comm.rank == 0:
        head = ["bytes", "mpi4py us", "flat us", "hierarchical us", "hier/flat", "hier/mpi4py"]
        table = [[b, f"{tr * 1e6:.1f}", f"{tf * 1e6:.1f}", f"{th * 1e6:.1f}", f"{th / tf:.2f}", f"{th / tr:.2f}"]
                 for b, tr, tf, th in rows]
        lib = MPI.Get_library_version().splitlines()[0].strip()
        where = " claimed on one host" if claimed else ""
        emit(f"hierarchical all-reduce: {comm.size} ranks on {hier.n_nodes} node(s){where} ({describe(names)}), "
             f"float32, {lib}, median of {args.rounds} rounds", head, table, args.markdown,
             notes=["flat = Communicator.allreduce (one MPI_Allreduce); hierarchical = MPI_Reduce in each node, "
                    "MPI_Allreduce over one leader per node, MPI_Bcast in each node (HierarchicalComm, "
                    "`--backend hierarchical`); ratios < 1 mean the hierarchical one is faster."])
    return 0


def _measure(comm: Communicator, hier: HierarchicalComm, raw: MPI.Comm, count: int, rounds: int) -> tuple:
    """``(bytes, raw s, flat s, hierarchical s)`` per call for ``count`` float32 values."""
    x = np.full(count, comm.rank + 1, dtype=np.float32)
    out = np.empty_like(x)
    iters = int(min(200, max(3, (4 << 20) // max(x.nbytes, 1))))
    sides = {
        "raw": lambda: raw.Allreduce(x, out, op=MPI.SUM),
        "flat": lambda: comm.allreduce(x, out=out),
        "hier": lambda: hier.iallreduce(x, out=out).wait(),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    for fn in sides.values():
        fn()  # warm-up (connections, pools)
    n = comm.size
    assert out[0] == n * (n + 1) / 2, out[0]
    keys = list(sides)
    for i in range(rounds):
        for k in keys[i % 3:] + keys[: i % 3]:
            times[k].append(timed(sides[k], iters, raw))
    return (x.nbytes, *(statistics.median(times[k]) for k in keys))


if __name__ == "__main__":
    sys.exit(main())
