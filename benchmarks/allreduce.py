"""OSU-style all-reduce sweep: hpctrain's Communicator against raw mpi4py on the same buffers.

    mpiexec -n 2 python benchmarks/allreduce.py [--max-bytes 67108864] [--quick] [--markdown REPORT.md]
    python benchmarks/allreduce.py --per-call      # one rank: the Python cost of each call alone

Both sides reduce the same float32 buffers in the same run, in interleaved rounds (which side
goes first alternates), and each side's median round is kept, so machine noise hits them alike.
Bus bandwidth is 2(n-1)/n x bytes / time (the NCCL-tests convention). The stall watchdog is on,
as in a real job (``--no-watchdog`` stops it to measure its cost).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, timed  # noqa: E402

from hpctrain import Communicator  # noqa: E402
from hpctrain.comm import watchdog  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", type=int, default=4)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds per size; the median is kept")
    ap.add_argument("--no-watchdog", action="store_true", help="stop the stall watchdog first")
    ap.add_argument("--per-call", action="store_true",
                    help="one rank, watchdog forced on: hpctrain's Python cost per call over raw mpi4py, from the "
                         "fastest of many short rounds (CPU only, so it survives a loaded machine)")
    ap.add_argument("--quick", action="store_true", help="up to 1 MiB, 2 rounds")
    ap.add_argument("--markdown", metavar="FILE", help="append the table to FILE as Markdown")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_bytes, args.rounds = min(args.max_bytes, 1 << 20), 5

    comm = Communicator()
    if args.per_call:
        return per_call(comm, args)
    if args.no_watchdog:
        watchdog.stop()
    raw = MPI.COMM_WORLD
    n = comm.size
    rows = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        count = max(nbytes // 4, 1)
        x = np.full(count, comm.rank + 1, dtype=np.float32)
        out = np.empty_like(x)
        # Short rounds: on a shared machine a long one is always preempted somewhere.
        iters = int(min(300, max(5, (2 << 20) // max(nbytes, 1))))
        ours_t, raw_t = [], []

        def ours():
            comm.allreduce(x, out=out)

        def mpi():
            raw.Allreduce(x, out, op=MPI.SUM)

        ours(), mpi()  # warm-up (connection setup, pools)
        for i in range(args.rounds):
            for fn, times in ((ours, ours_t), (mpi, raw_t))[:: 1 if i % 2 else -1]:
                times.append(timed(fn, iters, raw))
        assert out[0] == n * (n + 1) / 2
        t_ours, t_raw = statistics.median(ours_t), statistics.median(raw_t)
        factor = 2 * (n - 1) / n if n > 1 else 1.0
        rows.append((count * 4, t_raw, t_ours, factor * count * 4 / t_raw, factor * count * 4 / t_ours))
        nbytes *= 4 if nbytes < 4096 else 2
    if comm.rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].strip()
        head = ["bytes", "mpi4py us", "hpctrain us", "mpi4py GB/s", "hpctrain GB/s", "ratio"]
        table = [
            [b, f"{tr * 1e6:.2f}", f"{to * 1e6:.2f}", f"{bwr / 1e9:.3f}", f"{bwo / 1e9:.3f}", f"{to / tr:.3f}"]
            for b, tr, to, bwr, bwo in rows
        ]
        dog = "off" if args.no_watchdog else "on"
        emit(f"allreduce sweep: {n} ranks, float32, {lib}, watchdog {dog}, median of {args.rounds} rounds",
             head, table, args.markdown,
             notes=["ratio = hpctrain time / raw mpi4py time (1.0 = same speed); bus bandwidth = "
                    "2(n-1)/n x bytes / time."])
    return 0


def per_call(comm: Communicator, args: argparse.Namespace) -> int:
    """The Python cost of the call itself: on one rank MPI_Allreduce is a local copy, so the time
    over raw mpi4py is the bracket (checks, debug test, watchdog record). The watchdog does not
    start on one rank; it is started here by hand so its records cost what they cost in a job."""
    if comm.size != 1:
        raise SystemExit("--per-call measures one rank: run it without mpiexec")
    if not args.no_watchdog and watchdog._dog is None:
        watchdog._dog = watchdog._Dog(300.0)  # private on purpose: a one-rank job has no watchdog
    raw = MPI.COMM_WORLD
    rows = []
    nbytes = args.min_bytes
    while nbytes <= min(args.max_bytes, 1 << 16):
        x = np.ones(max(nbytes // 4, 1), dtype=np.float32)
        out = np.empty_like(x)
        best = {"mpi4py": [], "hpctrain": []}
        fns = {"mpi4py": lambda: raw.Allreduce(x, out, op=MPI.SUM), "hpctrain": lambda: comm.allreduce(x, out=out)}
        for i in range(20 * args.rounds):
            for name in (("mpi4py", "hpctrain") if i % 2 else ("hpctrain", "mpi4py")):
                fn = fns[name]
                t0 = time.perf_counter()
                for _ in range(200):  # short: a round that was not preempted exists
                    fn()
                best[name].append((time.perf_counter() - t0) / 200)
        t_raw, t_ours = min(best["mpi4py"]), min(best["hpctrain"])
        rows.append([x.nbytes, f"{t_raw * 1e6:.3f}", f"{t_ours * 1e6:.3f}", f"{(t_ours - t_raw) * 1e9:.0f}",
                     f"{t_ours / t_raw:.2f}"])
        nbytes *= 4
    dog = "off" if args.no_watchdog else "on"
    emit(f"allreduce per-call cost: 1 rank, float32, out= given, watchdog {dog}, fastest of {20 * args.rounds} "
         "rounds of 200 calls", ["bytes", "mpi4py us", "hpctrain us", "extra ns", "ratio"], rows, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
