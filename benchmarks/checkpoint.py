"""Checkpoint I/O: hpctrain.checkpoint against plain h5py, same arrays, same run, interleaved rounds.

    mpiexec -n 4 python benchmarks/checkpoint.py [--mb 256] [--tensors 16] [--rounds 5] [--quick] [--markdown F]

The model is ``--tensors`` float32 tensors of ``--mb`` MiB in all, replicated on every rank (data
parallelism: hpctrain splits each tensor's rows among the replicas, so every rank writes a share).

* **save**: hpctrain at 1, 2, 4 ... writer ranks (the first k ranks of the job; the others wait)
  against plain h5py from one rank (``create_dataset(data=...)`` for every tensor + fsync). hpctrain
  = plan + one part file per writer + XXH3 per slab + index file with virtual datasets + fsyncs +
  rename.
* **stall**: how long training waits for a checkpoint: a blocking save against an asynchronous one
  (which returns after the host snapshot; the files are written in a background thread), and the
  snapshot alone (copying this rank's slabs) for reference. All ranks of the job.
* **load**: one rank reads the whole model: hpctrain (read every slab, verify its checksum, copy
  into the parameters, commit) against plain h5py (``read_direct`` of every tensor into
  preallocated arrays). *warm*: the files are in the page cache; *cold*: evicted before every
  round with ``posix_fadvise(DONTNEED)`` on the files (no root needed).

Each round times every method once, in turn; the table shows the median over ``--rounds`` rounds
and the ratio to plain h5py within the same run (the disk and CPUs are shared, so absolute numbers
drift between runs; ratios less).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import h5py
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402

from hpctrain import Communicator, checkpoint  # noqa: E402
from hpctrain.nn import Parameter  # noqa: E402
from hpctrain.optim import SGD  # noqa: E402
from hpctrain.trainer import Trainer  # noqa: E402


class BlobTrainer(Trainer):
    """``tensors`` arrays of ``rows x 1024`` float32, replicated on every rank of ``comm``."""

    def __init__(self, comm: Communicator, full: dict[str, np.ndarray]) -> None:
        super().__init__(comm=comm)
        self.local = {n: Parameter(a.copy(), name=n) for n, a in full.items()}
        self.optimizer = SGD(list(self.local.values()), lr=0.1)

    def shards(self):
        return {n: (p, p.data.shape, tuple(slice(None) for _ in p.data.shape)) for n, p in self.local.items()}

    def config(self):
        return {"type": "BlobTrainer"}

    def state_dict(self):
        return {"global_step": self.global_step, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.global_step = state["global_step"]


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(paths: list[str]) -> None:
    """Drop these files' pages from the page cache (clean pages only: they were fsynced)."""
    for root in paths:
        files = [root] if os.path.isfile(root) else [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def clock(comm: MPI.Intracomm, fn) -> float:
    """Seconds of ``fn`` on the slowest rank of ``comm`` (barrier before, max after)."""
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="total model size in MiB")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 3 rounds")
    ap.add_argument("--markdown", metavar="FILE")
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.rounds = 64, 3

    world = Communicator()
    raw = world.mpi
    rows = max(world.size, (args.mb << 20) // (args.tensors * 4096))
    rng = np.random.default_rng(0)
    full = {f"layer{i:03d}.weight": rng.standard_normal((rows, 1024), dtype=np.float32) for i in range(args.tensors)}
    nbytes = sum(a.nbytes for a in full.values())
    where = world.bcast_obj(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-bench-") if world.rank == 0 else None)
    plain = os.path.join(where, "plain.h5")

    # Writer groups: the first k ranks, k = 1, 2, 4, ... up to the world size.
    sizes = [k for k in (1, 2, 4, 8, 16) if k <= world.size]
    if world.size not in sizes:
        sizes.append(world.size)
    groups = {}
    for k in sizes:
        sub = raw.Split(0 if world.rank < k else MPI.UNDEFINED, world.rank)
        groups[k] = BlobTrainer(Communicator(sub), full) if sub != MPI.COMM_NULL else None
    everyone = groups[world.size]

    def h5_save() -> None:
        if world.rank == 0:
            with h5py.File(plain, "w") as f:
                for n, a in full.items():
                    f.create_dataset(n, data=a)
            fsync_path(plain)

    def ours_save(k: int) -> None:
        if groups[k] is not None:
            checkpoint.save(os.path.join(where, f"w{k}.h5"), groups[k])

    save_t: dict[str, list[float]] = {"h5py, 1 rank": [], **{f"hpctrain, {k} writer(s)": [] for k in sizes}}
    stall_t: dict[str, list[float]] = {"blocking save": [], "async save (stall)": [], "snapshot alone": []}
    load_t: dict[str, list[float]] = {f"{m}, {c}": [] for c in ("warm", "cold") for m in ("h5py", "hpctrain")}

    solo = groups[1]
    targets = {n: np.empty_like(a) for n, a in full.items()}

    def h5_load() -> None:
        if world.rank == 0:
            with h5py.File(plain, "r") as f:
                for n, out in targets.items():
                    f[n].read_direct(out)

    def ours_load() -> None:
        if world.rank == 0:
            checkpoint.load(os.path.join(where, "w1.h5"), solo)

    # Snapshot alone: what the async save copies on this rank (its share of the rows).
    def snapshot() -> None:
        lo, hi = world.rank * rows // world.size, (world.rank + 1) * rows // world.size
        for p in everyone.local.values():
            np.array(p.data[lo:hi], copy=True)

    for _ in range(args.rounds):
        save_t["h5py, 1 rank"].append(clock(raw, h5_save))
        for k in sizes:
            save_t[f"hpctrain, {k} writer(s)"].append(clock(raw, lambda k=k: ours_save(k)))
        stall_t["blocking save"].append(clock(raw, lambda: checkpoint.save(os.path.join(where, "blk.h5"), everyone)))
        stall_t["async save (stall)"].append(
            clock(raw, lambda: checkpoint.save(os.path.join(where, "async.h5"), everyone, asynchronous=True)))
        checkpoint.wait(everyone)  # not part of the stall: training would run meanwhile
        stall_t["snapshot alone"].append(clock(raw, snapshot))
        for cache in ("warm", "cold"):
            for name, fn, files in (("h5py", h5_load, [plain]), ("hpctrain", ours_load, [where])):
                if cache == "warm":
                    fn()  # bring the files in
                elif world.rank == 0:
                    evict(files)
                load_t[f"{name}, {cache}"].append(clock(raw, fn))

    if world.rank == 0:
        for n, out in targets.items():  # the loads read what was written
            assert np.array_equal(out, full[n]) and np.array_equal(solo.local[n].data, full[n]), n
        med = {k: statistics.median(v) for d in (save_t, stall_t, load_t) for k, v in d.items()}
        table = []
        base = med["h5py, 1 rank"]
        for k in save_t:
            table.append(["save", k, f"{med[k] * 1e3:.0f}", f"{nbytes / med[k] / 2**30:.2f}", f"{base / med[k]:.2f}"])
        blk = med["blocking save"]
        for k in stall_t:
            table.append(["stall", k, f"{med[k] * 1e3:.1f}", "", f"{blk / med[k]:.1f}x less than blocking"
                          if k != "blocking save" else "1"])
        for cache in ("warm", "cold"):
            b = med[f"h5py, {cache}"]
            for m in ("h5py", "hpctrain"):
                k = f"{m}, {cache}"
                table.append(["load", k, f"{med[k] * 1e3:.0f}", f"{nbytes / med[k] / 2**30:.2f}", f"{b / med[k]:.2f}"])
        emit(
            f"checkpoint I/O: {nbytes / 2**20:.0f} MiB in {args.tensors} float32 tensors, {world.size} ranks, "
            f"median of {args.rounds} interleaved rounds, {MPI.Get_library_version().splitlines()[0].strip()}",
            ["op", "method", "ms", "GiB/s", "x h5py (save, load) / x blocking (stall)"],
            table,
            args.markdown,
            notes=["save targets: grows with writer ranks, >= 0.9x plain h5py at 1 writer. stall target: async "
                   ">= 5x smaller than blocking (the stall is the host snapshot). load targets: >= 0.9x h5py warm "
                   "and cold (cold = pages evicted with posix_fadvise before each round)."],
        )
    raw.Barrier()
    if world.rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
