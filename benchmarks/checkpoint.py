"""Checkpoint I/O: hpctrain.checkpoint against plain h5py, same arrays, same run, interleaved rounds.

    mpiexec -n 4 python benchmarks/checkpoint.py [--mb 256] [--tensors 16] [--many 256] [--rounds 5]
                                                 [--quick] [--markdown F]

The model is ``--tensors`` float32 tensors of ``--mb`` MiB in all, replicated on every rank (data
parallelism: hpctrain splits each tensor's rows among the replicas, so every rank writes a share).
Then the same with ``--many`` tensors of 1/64 of that size each (a table of its own): there the
cost per tensor (HDF5 objects, checks, system calls) dominates, as in a real model's checkpoint
with hundreds of parameters and optimizer moments.

* **save**: hpctrain at 1, 2, 4 ... writer ranks (the first k ranks of the job; the others wait)
  against plain h5py from one rank (``create_dataset(data=...)`` for every tensor + fsync). hpctrain
  = plan + one part file per writer + XXH3 per slab + index file with virtual datasets + fsyncs +
  rename.
* **stall**: how long training waits for a checkpoint, all ranks of the job. *blocking save*: the
  save call. *async save (call)*: the asynchronous save call, which joins the previous
  asynchronous save's writer, agrees on it and hands its commit to rank 0's next writer thread,
  then snapshots this rank's slabs into the buffers kept from the previous save and starts the
  writer thread. *snapshot alone*: that copy by itself. *slowdown of the following steps*: the
  simulated training steps (a bulk NumPy op, many small ones that need the GIL, an allreduce)
  that run while the background write goes on, minus as many steps with nothing in flight. The
  two together are what training loses to an asynchronous checkpoint.
* **load**: one rank reads the whole model: hpctrain (read every slab, verify its checksum, copy
  into the parameters, commit) against plain h5py (``read_direct`` of every tensor into
  preallocated arrays) and plain h5py reading into new arrays (``f[name][()]``: a transactional
  load must read into temporaries; new memory costs page faults the preallocated arrays do not).
  *warm*: the files are in the page cache; *cold*: evicted before every round with
  ``posix_fadvise(DONTNEED)`` on the files (no root needed). The methods that read into new
  arrays (``h5py, new arrays`` and hpctrain, whose load stages everything before it commits)
  pay for new memory when the process gets it from the system rather than reusing what it
  freed: on a virtual machine the first touch of such pages can cost as much as the copy, and
  varies from run to run with the allocator's state (see the note under the table).

Ranks with nothing to do in a timed section (the writers not in a group, all but rank 0 for
loads) wait with a sleeping poll, not in a spinning MPI call: MPICH spins at 100% CPU while it
waits, which on a small machine takes the cores from the ranks being timed.

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
from hpctrain.checkpoint.saving import fsync_file  # noqa: E402
from hpctrain.nn import Parameter  # noqa: E402
from hpctrain.optim import SGD  # noqa: E402
from hpctrain.training.trainer import Trainer  # noqa: E402


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


def quiet_barrier(comm: MPI.Intracomm) -> None:
    """A barrier that sleeps while it waits (MPICH's blocking calls spin a core), polling less
    often the longer it waits (up to every 2 ms: three ranks polling every 0.2 ms took CPU from
    the threads of the rank being timed)."""
    req = comm.Ibarrier()
    nap = 5e-5
    while not req.Test():
        time.sleep(nap)
        nap = min(2e-3, nap * 2)


def clock(comm: MPI.Intracomm, fn) -> float:
    """Seconds of ``fn`` on the slowest rank of ``comm`` (barrier before, max after; ranks that
    finish first wait without spinning)."""
    quiet_barrier(comm)
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    quiet_barrier(comm)
    return comm.allreduce(dt, op=MPI.MAX)


class Steps:
    """Simulated training steps: a bulk NumPy op (releases the GIL), many small ops that need it
    (a framework's per-layer Python), one small allreduce; about ``ms`` milliseconds each."""

    def __init__(self, comm: MPI.Intracomm, ms: float = 10.0) -> None:
        self.comm = comm
        self.bulk = np.random.default_rng(comm.rank).standard_normal(1 << 16)
        self.small = [np.ones(64) for _ in range(100)]
        self.reps = 1
        times = []
        for _ in range(9):
            t0 = time.perf_counter()
            self._work()
            times.append(time.perf_counter() - t0)
        # The median, and the largest count any rank asks for: a noisy sample must not shrink it.
        self.reps = max(1, int(ms / 1e3 / statistics.median(times)))
        self.reps = comm.allreduce(self.reps, op=MPI.MAX)

    def _work(self) -> None:
        for _ in range(self.reps):
            np.tanh(self.bulk, out=self.bulk)
            self.bulk += 0.5
            for a in self.small:
                np.multiply(a, 1.0000001, out=a)

    def step(self, busy: bool = False) -> tuple[float, bool]:
        """One step; returns (its seconds on this rank, whether any rank's ``busy`` was set)."""
        t0 = time.perf_counter()
        self._work()
        flag = self.comm.allreduce(1 if busy else 0, op=MPI.MAX)
        return time.perf_counter() - t0, bool(flag)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="total model size in MiB")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--many", type=int, default=256, metavar="N",
                    help="then the same with N tensors of 1/64 of the size each (0: skip): per-tensor costs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 3 rounds")
    ap.add_argument("--markdown", metavar="FILE")
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.rounds = 64, 3
    world = Communicator()
    run(world, args.tensors, args.mb, args)
    if args.many:
        run(world, args.many, max(1, args.mb * args.many // (64 * args.tensors)), args)
    return 0


def run(world: Communicator, tensors: int, mb: int, args: argparse.Namespace) -> None:
    """One model (``tensors`` float32 tensors, ``mb`` MiB in all): every method, interleaved."""
    raw = world.mpi
    rows = max(world.size, (mb << 20) // (tensors * 4096))
    rng = np.random.default_rng(0)
    full = {f"layer{i:03d}.weight": rng.standard_normal((rows, 1024), dtype=np.float32) for i in range(tensors)}
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
            fsync_file(plain)

    def ours_save(k: int) -> None:
        if groups[k] is not None:
            checkpoint.save(os.path.join(where, f"w{k}.h5"), groups[k])

    save_t: dict[str, list[float]] = {"h5py, 1 rank": [], **{f"hpctrain, {k} writer(s)": [] for k in sizes}}
    stall_t: dict[str, list[float]] = {"blocking save": [], "async save (call)": [], "snapshot alone": [],
                                       "slowdown of the following steps": []}
    writing_steps: list[int] = []
    step_ms: list[float] = []
    load_methods = ("h5py", "h5py, new arrays", "hpctrain")
    load_t: dict[str, list[float]] = {f"{m}, {c}": [] for c in ("warm", "cold") for m in load_methods}

    solo = groups[1]
    targets = {n: np.empty_like(a) for n, a in full.items()}

    def h5_load_new() -> None:
        """What plain h5py costs when it reads into new arrays, as a transactional load must."""
        if world.rank == 0:
            with h5py.File(plain, "r") as f:
                fresh = {n: f[n][()] for n in targets}
            del fresh

    def h5_load() -> None:
        if world.rank == 0:
            with h5py.File(plain, "r") as f:
                for n, out in targets.items():
                    f[n].read_direct(out)

    def ours_load() -> None:
        if world.rank == 0:
            checkpoint.load(os.path.join(where, "w1.h5"), solo)

    # Snapshot alone: what the async save copies on this rank (its share of the rows) into
    # buffers kept from the previous save.
    lo, hi = world.rank * rows // world.size, (world.rank + 1) * rows // world.size
    buffers = {n: np.empty_like(p.data[lo:hi]) for n, p in everyone.local.items()}

    def snapshot() -> None:
        for n, p in everyone.local.items():
            np.copyto(buffers[n], p.data[lo:hi])

    # A second trainer on the same ranks for the asynchronous saves: its pending save is finished
    # by its own next save (inside the timed call), not by the blocking saves of `everyone`.
    background = BlobTrainer(Communicator(raw.Dup()), full)
    steps = Steps(raw)

    def in_flight() -> bool:
        job = background.checkpointer.job
        return job is not None and job.thread is not None and job.thread.is_alive()

    for _ in range(args.rounds):
        save_t["h5py, 1 rank"].append(clock(raw, h5_save))
        for k in sizes:
            save_t[f"hpctrain, {k} writer(s)"].append(clock(raw, lambda k=k: ours_save(k)))
        stall_t["blocking save"].append(clock(raw, lambda: checkpoint.save(os.path.join(where, "blk.h5"), everyone)))
        stall_t["snapshot alone"].append(clock(raw, snapshot))
        quiet = [steps.step()[0] for _ in range(20)]
        step_ms.append(statistics.median(quiet) * 1e3)
        stall_t["async save (call)"].append(
            clock(raw, lambda: checkpoint.save(os.path.join(where, "async.h5"), background, asynchronous=True)))
        during, busy = [], True
        while busy:  # steps until every rank's writer thread is done
            dt, busy = steps.step(in_flight())
            during.append(dt)
        extra = sum(during) - len(during) * statistics.median(quiet)
        stall_t["slowdown of the following steps"].append(raw.allreduce(extra, op=MPI.MAX))
        writing_steps.append(len(during))
        for cache in ("warm", "cold"):
            for name, fn, files in (("h5py", h5_load, [plain]), ("h5py, new arrays", h5_load_new, [plain]),
                                    ("hpctrain", ours_load, [where])):
                if cache == "warm":
                    fn()  # bring the files in
                elif world.rank == 0:
                    evict(files)
                load_t[f"{name}, {cache}"].append(clock(raw, fn))

    checkpoint.wait(background)
    if world.rank == 0:
        for n, out in targets.items():  # the loads read what was written
            assert np.array_equal(out, full[n]) and np.array_equal(solo.local[n].data, full[n]), n
        med = {k: statistics.median(v) for d in (save_t, stall_t, load_t) for k, v in d.items()}
        table = []
        base = med["h5py, 1 rank"]
        for k in save_t:
            table.append(["save", k, f"{med[k] * 1e3:.0f}", f"{nbytes / med[k] / 2**30:.2f}", f"{base / med[k]:.2f}"])
        blk = med["blocking save"]
        lost = med["async save (call)"] + max(0.0, med["slowdown of the following steps"])
        for k in stall_t:
            table.append(["stall", k, f"{med[k] * 1e3:.1f}", "", f"{blk / med[k]:.1f}x less than blocking"
                          if k != "blocking save" and med[k] > 0 else ("1" if k == "blocking save" else "-")])
        table.append(["stall", "async call + slowdown", f"{lost * 1e3:.1f}", "",
                      f"{blk / lost:.1f}x less than blocking"])
        for cache in ("warm", "cold"):
            b, b_new = med[f"h5py, {cache}"], med[f"h5py, new arrays, {cache}"]
            for m in load_methods:
                k = f"{m}, {cache}"
                vs = f"{b / med[k]:.2f}" + (f" ({b_new / med[k]:.2f} x new arrays)" if m == "hpctrain" else "")
                table.append(["load", k, f"{med[k] * 1e3:.0f}", f"{nbytes / med[k] / 2**30:.2f}", vs])
        emit(
            f"checkpoint I/O: {nbytes / 2**20:.0f} MiB in {tensors} float32 tensors, {world.size} ranks, "
            f"median of {args.rounds} interleaved rounds, {MPI.Get_library_version().splitlines()[0].strip()}",
            ["op", "method", "ms", "GiB/s", "x h5py (save, load) / x blocking (stall)"],
            table,
            args.markdown,
            notes=[f"steps during the background write: {statistics.median(writing_steps):.0f} (median) of "
                   f"{statistics.median(step_ms):.1f} ms each; the async call includes the previous async save's "
                   f"join and agreement (its commit runs in rank 0's next writer thread)",
                   "save targets: grows with writer ranks, >= 0.9x plain h5py at 1 writer. stall target: async "
                   ">= 5x smaller than blocking (the stall is the host snapshot). load targets: >= 0.9x h5py warm "
                   "and cold (cold = pages evicted with posix_fadvise before each round). hpctrain's load "
                   "reads into new (staging) memory, as a load that changes nothing before every rank has "
                   "verified everything must: where the process gets new pages from the system, their cost "
                   "comes on top of a read_direct into arrays that exist (compare 'h5py, new arrays')."],
        )
    raw.Barrier()
    if world.rank == 0:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
