"""OSU-style all-reduce sweep: hpctrain's Communicator against raw mpi4py on the same buffers.

    mpiexec -n 2 python benchmarks/allreduce.py [--max-bytes 67108864] [--markdown [FILE]] [--quick]

Both sides reduce the same float32 buffers in the same run, interleaved per size, so machine
noise hits them alike. Bus bandwidth is 2(n-1)/n x bytes / time (the NCCL-tests convention).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

from hpctrain import Communicator


def timed(fn, iters: int, comm: MPI.Comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - t0
    # The slowest rank's time is the operation's time.
    return comm.allreduce(elapsed, op=MPI.MAX) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", type=int, default=4)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size; best kept")
    ap.add_argument("--markdown", nargs="?", const="-", metavar="FILE",
                    help="print a Markdown table; with FILE also append it there (make bench)")
    ap.add_argument("--quick", action="store_true", help="sizes up to 1 MiB, 2 rounds (well under a minute)")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_bytes, args.rounds = min(args.max_bytes, 1 << 20), 2

    comm = Communicator()
    raw = MPI.COMM_WORLD
    n = comm.size
    rows = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        count = max(nbytes // 4, 1)
        x = np.full(count, comm.rank + 1, dtype=np.float32)
        out = np.empty_like(x)
        iters = int(min(2000, max(5, (8 << 20) // max(nbytes, 1))))
        ours_t, raw_t = [], []

        def ours():
            comm.allreduce(x, out=out)

        def mpi():
            raw.Allreduce(x, out, op=MPI.SUM)

        ours(), mpi()  # warm-up (connection setup, pools)
        for _ in range(args.rounds):
            ours_t.append(timed(ours, iters, raw))
            raw_t.append(timed(mpi, iters, raw))
        assert out[0] == n * (n + 1) / 2
        t_ours, t_raw = min(ours_t), min(raw_t)
        factor = 2 * (n - 1) / n if n > 1 else 1.0
        rows.append((count * 4, t_raw, t_ours, factor * count * 4 / t_raw, factor * count * 4 / t_ours))
        nbytes *= 4 if nbytes < 4096 else 2
    if comm.rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].strip()
        head = ["bytes", "mpi4py us", "hpctrain us", "mpi4py GB/s", "hpctrain GB/s", "ratio"]
        lines = [f"# allreduce sweep: {n} ranks, float32, {lib}"]
        if args.markdown:
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        else:
            lines.append(" ".join(f"{h:>14}" for h in head))
        for b, tr, to, bwr, bwo in rows:
            cells = [f"{b}", f"{tr * 1e6:.2f}", f"{to * 1e6:.2f}", f"{bwr / 1e9:.3f}",
                     f"{bwo / 1e9:.3f}", f"{to / tr:.3f}"]
            lines.append(("| " + " | ".join(cells) + " |") if args.markdown
                         else " ".join(f"{c:>14}" for c in cells))
        print("\n".join(lines), flush=True)
        if args.markdown and args.markdown != "-":
            with open(args.markdown, "a") as f:
                f.write(f"{n} ranks, float32, {lib}; ratio = hpctrain time / mpi4py time\n\n")
                f.write("\n".join(lines[1:]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
