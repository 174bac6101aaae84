"""Checkpoint I/O: hpctrain.checkpoint save/load against plain h5py and numpy.save, same arrays, same run.

    mpiexec -n 2 python benchmarks/checkpoint.py [--mb 256] [--tensors 16] [--quick] [--markdown REPORT.md]

The model is a stack of float32 tensors; half of them are sharded over the ranks along the first
axis (as tensor parallelism holds them), half replicated. hpctrain gathers the shards to rank 0,
which writes one file (checksums, temporary name, fsync, rename). The baselines are what a user
would write by hand on rank 0 with the full arrays already in memory: h5py datasets + fsync, and
one ``numpy.save`` per array + fsync. Loads read everything back (hpctrain also verifies every
checksum first). Timings are the best of ``--rounds`` and include fsync; the page cache is not
dropped (no root needed), so loads measure the library path more than the disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
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
    """``tensors`` arrays of ``rows x 1024`` float32; even-numbered ones sharded over the ranks."""

    def __init__(self, comm: Communicator, tensors: int, rows: int) -> None:
        super().__init__(comm=comm)
        self.full, self.local, self.index = {}, {}, {}
        rng = np.random.default_rng(0)
        for i in range(tensors):
            name = f"layer{i:03d}.weight"
            full = rng.standard_normal((rows, 1024), dtype=np.float32)
            self.full[name] = full
            if i % 2 == 0:
                part = np.array_split(np.arange(rows), comm.size)[comm.rank]
                sl = (slice(int(part[0]), int(part[-1]) + 1), slice(None))
            else:
                sl = (slice(None), slice(None))
            self.local[name] = Parameter(np.ascontiguousarray(full[sl]), name=name)
            self.index[name] = sl
        self.optimizer = SGD(list(self.local.values()), lr=0.1)

    def shards(self):
        return {n: (p, self.full[n].shape, self.index[n]) for n, p in self.local.items()}

    def config(self):
        return {"type": "BlobTrainer"}

    def state_dict(self):
        return {"global_step": self.global_step, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.global_step = state["global_step"]


def fsync_path(path: str) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def drop_page_cache() -> bool:
    """Empty the kernel's page cache (needs root) so a load reads the disk, as after a restart."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def best(fn, rounds: int, comm, cold: bool = False) -> float:
    times = []
    for _ in range(rounds):
        if cold and comm.rank == 0:
            drop_page_cache()
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        comm.barrier()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="total model size in MiB")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every load (root)")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 rounds")
    ap.add_argument("--markdown", metavar="FILE")
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.rounds = 64, 2
    if args.cold and not drop_page_cache():
        print("--cold needs root to drop the page cache; measuring warm loads", flush=True)
        args.cold = False

    comm = Communicator()
    rows = max(comm.size, (args.mb << 20) // (args.tensors * 4096))
    t = BlobTrainer(comm, args.tensors, rows)
    nbytes = sum(a.nbytes for a in t.full.values())
    where = comm.bcast_obj(tempfile.mkdtemp(dir=args.dir) if comm.rank == 0 else None)
    ours = os.path.join(where, "ckpt.h5")
    plain = os.path.join(where, "plain.h5")
    npdir = os.path.join(where, "npy")

    def h5_save():
        if comm.rank == 0:
            with h5py.File(plain, "w") as f:
                for n, a in t.full.items():
                    f.create_dataset(n, data=a)
            fsync_path(plain)

    def np_save():
        if comm.rank == 0:
            os.makedirs(npdir, exist_ok=True)
            for n, a in t.full.items():
                p = os.path.join(npdir, n + ".npy")
                np.save(p, a)
                fsync_path(p)

    def h5_load():
        if comm.rank == 0:
            with h5py.File(plain, "r") as f:
                for n in t.full:
                    f[n][()]

    def np_load():
        if comm.rank == 0:
            for n in t.full:
                np.load(os.path.join(npdir, n + ".npy"))

    results = {
        "save": {
            "hpctrain": best(lambda: checkpoint.save(ours, t), args.rounds, comm),
            "h5py": best(h5_save, args.rounds, comm),
            "numpy.save": best(np_save, args.rounds, comm),
        },
        "load": {
            "hpctrain": best(lambda: checkpoint.load(ours, t), args.rounds, comm, args.cold),
            "h5py": best(h5_load, args.rounds, comm, args.cold),
            "numpy.load": best(np_load, args.rounds, comm, args.cold),
        },
    }
    if comm.rank == 0:
        rows_out = []
        for what, res in results.items():
            base = res["h5py"]
            for name, sec in res.items():
                rows_out.append([what, name, f"{sec * 1e3:.1f}", f"{nbytes / sec / 2**30:.2f}", f"{base / sec:.2f}"])
        emit(
            f"checkpoint I/O{' (cold page cache on load)' if args.cold else ''}: {nbytes / 2**20:.0f} MiB in "
            f"{args.tensors} tensors, {comm.size} ranks "
            f"(half sharded), {MPI.Get_library_version().splitlines()[0].strip()}",
            ["op", "method", "ms", "GiB/s", "x plain h5py"],
            rows_out,
            args.markdown,
            notes=["hpctrain save = gather shards + XXH3 checksum per dataset + tmp file + fsync + rename; "
                   "hpctrain load = verify every checksum + read this rank's slices. Target >= 0.9x h5py."],
        )
        shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
