"""HDF5Dataset batch reads against plain h5py reading the same rows, per rank, in the same run.

    mpiexec -n 2 python benchmarks/hdf5_dataset.py [--quick] [--markdown FILE] [--dir DIR]

Rank 0 writes one file (x: float32 (N, D), y: int64 (N,)). Every rank then reads its own shard of
an epoch (ShardedSampler, interleaved) batch by batch, three ways on the same index arrays,
interleaved per round so machine noise hits them alike:

* h5py: ``f["x"][idx]; f["y"][idx]`` with the batch's sorted indices (what a user would write);
* HDF5Dataset: ``ds[idx]`` (one read per key per batch);
* DataLoader: a whole pass of ``DataLoader(ds, B, sampler)`` (adds sorting and batching).

Times are per batch, the slowest rank's, best of the rounds. ratio = HDF5Dataset / h5py.
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

from hpctrain import Communicator  # noqa: E402
from hpctrain.data import DataLoader, HDF5Dataset, ShardedSampler  # noqa: E402


def slowest(comm: MPI.Comm, seconds: float) -> float:
    return comm.allreduce(seconds, op=MPI.MAX)


def bench_case(path: str, n: int, d: int, batch: int, shuffle: bool, rounds: int, comm: Communicator,
               raw: MPI.Comm) -> tuple:
    sampler = ShardedSampler(n, comm.rank, comm.size, shuffle=shuffle, seed=0)
    idx = sampler.indices()
    batches = [np.sort(idx[i : i + batch]) for i in range(0, idx.size, batch)]
    ds = HDF5Dataset(path, ["x", "y"])
    f = h5py.File(path, "r")
    fx, fy = f["x"], f["y"]
    loader = DataLoader(ds, batch, sampler)

    def plain():
        for b in batches:
            fx[b]
            fy[b]

    def ours():
        for b in batches:
            ds[b]

    def loop():
        sampler.position = 0
        for _ in loader:
            pass

    # Same rows either way (checked once, outside the timing).
    x0, y0 = ds[batches[0]]
    assert np.array_equal(x0, fx[batches[0]]) and np.array_equal(y0, fy[batches[0]])
    times = {"h5py": [], "ours": [], "loader": []}
    for fn in (plain, ours, loop):
        fn()  # warm-up: page cache, h5py metadata
    for _ in range(rounds):
        for name, fn in (("h5py", plain), ("ours", ours), ("loader", loop)):
            raw.Barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(slowest(raw, time.perf_counter() - t0) / len(batches))
    f.close()
    ds.close()
    best = {k: min(v) for k, v in times.items()}
    mb = batch * (d * 4 + 8) / 1e6
    return (n, d, batch, "shuffled" if shuffle else "in order", best["h5py"], best["ours"], best["loader"], mb)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (< 60 s)")
    ap.add_argument("--markdown", metavar="FILE", default=None, help="append the table to FILE")
    ap.add_argument("--dir", default=None, help="where to write the test file (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args(argv)

    comm = Communicator()
    raw = MPI.COMM_WORLD
    if args.quick:
        n, widths, sizes, rounds = 20_000, (16,), (64, 512), args.rounds or 3
    else:
        n, widths, sizes, rounds = 200_000, (16, 256), (64, 512, 4096), args.rounds or 5
    base = args.dir or (tempfile.mkdtemp(prefix="hpctrain-bench-") if comm.rank == 0 else None)
    base = comm.bcast_obj(base)
    rows = []
    try:
        for d in widths:
            path = os.path.join(base, f"bench_{n}x{d}.h5")
            if comm.rank == 0:
                rng = np.random.default_rng(0)
                with h5py.File(path, "w") as f:
                    f["x"] = rng.standard_normal((n, d), dtype=np.float32)
                    f["y"] = np.arange(n, dtype=np.int64)
            comm.barrier()
            for batch in sizes:
                for shuffle in (False, True):
                    rows.append(bench_case(path, n, d, batch, shuffle, rounds, comm, raw))
    finally:
        comm.barrier()
        if comm.rank == 0 and args.dir is None:
            shutil.rmtree(base, ignore_errors=True)

    if comm.rank == 0:
        head = ["rows", "row floats", "batch", "order", "h5py ms/batch", "HDF5Dataset ms/batch",
                "DataLoader ms/batch", "HDF5Dataset MB/s", "ratio"]
        table = [[n_, d, b, order, f"{t_h5 * 1e3:.3f}", f"{t_ours * 1e3:.3f}", f"{t_loop * 1e3:.3f}",
                  f"{mb / t_ours:.1f}", f"{t_ours / t_h5:.2f}"]
                 for n_, d, b, order, t_h5, t_ours, t_loop, mb in rows]
        title = (f"HDF5Dataset vs plain h5py: {comm.size} rank(s), each reading its shard "
                 f"(h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version})")
        notes = ["Per batch, slowest rank, best of the rounds; both read the same sorted rows of x (float32) "
                 "and y (int64); ratio = HDF5Dataset / h5py (below 1: faster). Page cache warm."]
        emit(title, head, table, args.markdown, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
