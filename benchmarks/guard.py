"""Cost of the safety nets: the stall watchdog and HPCTRAIN_DEBUG fingerprints, per call.

    mpiexec -n 2 python benchmarks/guard.py [--quick] [--markdown FILE]

For a few message sizes, the same all-reduce is timed through raw mpi4py, through Communicator
with the watchdog stopped, with the watchdog running (the default), and with debug fingerprints
(one extra small allgather per call). Variants are interleaved per round so machine noise hits
them alike; the best round is kept and the slowest rank's time is the operation's time.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from common import publish, timed
from mpi4py import MPI

from hpctrain import Communicator
from hpctrain.comm import watchdog
from hpctrain.comm.fingerprint import FingerprintTracer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations and rounds (well under a minute)")
    ap.add_argument("--markdown", metavar="FILE", help="append the table to FILE")
    args = ap.parse_args(argv)
    rounds = 3 if args.quick else 7
    sizes = [8, 4096, 1 << 20]

    comm = Communicator()
    raw = MPI.COMM_WORLD
    dbg = Communicator(comm.mpi)
    dbg._debug = FingerprintTracer(dbg)
    rows = []
    for nbytes in sizes:
        x = np.ones(nbytes // 8, dtype=np.float64)
        out = np.empty_like(x)
        iters = int(min(3000, max(20, (16 << 20) // nbytes))) // (4 if args.quick else 1)
        best = {"raw": [], "off": [], "on": [], "debug": []}
        variants = {
            "raw": lambda: raw.Allreduce(x, out, op=MPI.SUM),
            "on": lambda: comm.allreduce(x, out=out),
            "debug": lambda: dbg.allreduce(x, out=out),
        }
        for fn in variants.values():
            fn()  # warm-up
        for _ in range(rounds):
            for name, fn in variants.items():
                best[name].append(timed(fn, iters, raw))
            watchdog.stop()  # collective-free; start() below Dups the world again
            assert not watchdog.running()
            best["off"].append(timed(variants["on"], iters, raw))
            watchdog.start()
            assert watchdog.running() or raw.Get_size() == 1
        rows.append((nbytes, *(min(best[k]) for k in ("raw", "off", "on", "debug"))))

    # The fast path alone, free of network waits: a begin/end pair, and an 8-byte all-reduce on
    # COMM_SELF (all of Communicator's Python work, no peer) with the watchdog running and stopped.
    me = Communicator(MPI.COMM_SELF)
    y, yo = np.ones(1), np.empty(1)
    n_local = 20000 if args.quick else 100000
    local = {"pair": [], "self_on": [], "self_off": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n_local):
            watchdog.end(watchdog.begin(me, "allreduce", None, 0))
        local["pair"].append((time.perf_counter() - t0) / n_local)
        t0 = time.perf_counter()
        for _ in range(n_local):
            me.allreduce(y, out=yo)
        local["self_on"].append((time.perf_counter() - t0) / n_local)
        watchdog.stop()
        t0 = time.perf_counter()
        for _ in range(n_local):
            me.allreduce(y, out=yo)
        local["self_off"].append((time.perf_counter() - t0) / n_local)
        watchdog.start()
    pair, self_on, self_off = (min(local[k]) for k in ("pair", "self_on", "self_off"))

    if comm.rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].strip()
        head = ["bytes", "mpi4py us", "no watchdog us", "watchdog us", "watchdog overhead us", "watchdog/mpi4py",
                "debug fingerprints us"]
        title = f"### Safety nets: {comm.size} ranks, float64 all-reduce, {lib}"
        lines = [title + (" (--quick)" if args.quick else ""),
                 "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for b, t_raw, t_off, t_on, t_dbg in rows:
            cells = [str(b), f"{t_raw * 1e6:.2f}", f"{t_off * 1e6:.2f}", f"{t_on * 1e6:.2f}",
                     f"{(t_on - t_off) * 1e6:+.2f}", f"{t_on / t_raw:.3f}", f"{t_dbg * 1e6:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "| fast path (rank 0, no network) | ns per call |", "|---|---|",
                  f"| watchdog begin+end pair | {pair * 1e9:.0f} |",
                  f"| Communicator(COMM_SELF).allreduce 8 B, watchdog stopped | {self_off * 1e9:.0f} |",
                  f"| Communicator(COMM_SELF).allreduce 8 B, watchdog running | {self_on * 1e9:.0f} |",
                  f"| difference | {(self_on - self_off) * 1e9:+.0f} |"]
        publish("\n".join(lines), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
