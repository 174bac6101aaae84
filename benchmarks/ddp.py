"""Data-parallel training: weak scaling, exposed communication, gradient sync against raw mpi4py.

    mpiexec -n 2 python benchmarks/ddp.py [--quick] [--markdown FILE]

In one run, on an MLP of a few million float32 parameters:

* weak scaling 1 -> N ranks: every rank first trains alone (a 1-rank communicator, all ranks at
  once so the machine is as busy as in the parallel run), then all ranks train together with the
  same per-rank batch; efficiency = solo step time / parallel step time (target >= 0.90);
* the step's exposed communication share with and without overlap, buckets of 1 and 25 MB;
* the gradient sync of a ~150-tensor model (GradBuckets: copy in, one all-reduce per bucket,
  copy out) against one flat raw ``mpi4py`` ``Allreduce`` of the same bytes (target <= 1.10x)
  and against a per-tensor ``mpi4py`` loop;
* when PyTorch is importable, the same MLP under torch ``DistributedDataParallel`` (gloo):
  our samples/s over theirs (target > 1).

Times are the slowest rank's, best of several rounds (machine noise only ever adds time).
"""

from __future__ import annotations

import os

# One BLAS thread per rank: ranks share the cores, and torch gets the same budget below.
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpctrain as ht  # noqa: E402
from hpctrain.comm.buckets import GradBuckets  # noqa: E402
from hpctrain.parallel import DataParallelTrainer  # noqa: E402

CLASSES = 10


def mlp(width: int, depth: int, d_in: int, seed: int = 0) -> ht.nn.Sequential:
    r = np.random.default_rng(seed)
    layers: list = [ht.nn.Linear(d_in, width, rng=r), ht.nn.ReLU()]
    for _ in range(depth - 2):
        layers += [ht.nn.Linear(width, width, rng=r), ht.nn.ReLU()]
    layers.append(ht.nn.Linear(width, CLASSES, rng=r))
    return ht.nn.Sequential(*layers)


def slowest(seconds: float) -> float:
    return MPI.COMM_WORLD.allreduce(seconds, op=MPI.MAX)


def time_steps(fn, iters: int, rounds: int, comm: MPI.Comm = MPI.COMM_WORLD) -> float:
    """Best-of-rounds seconds per call of ``fn`` (slowest rank of ``MPI.COMM_WORLD``)."""
    fn()  # warm-up: buffers, connections
    best = float("inf")
    for _ in range(rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, slowest((time.perf_counter() - t0) / iters))
    return best


def dp_case(comm, args, overlap: bool, bucket_mb: float) -> tuple[float, float]:
    """(seconds per step, exposed communication seconds per step) of DataParallelTrainer."""
    model = mlp(args.width, args.depth, args.d_in)
    opt = ht.optim.SGD(model.parameters(), lr=1e-3)
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=comm,
                             overlap=overlap, bucket_mb=bucket_mb)
    g = np.random.default_rng(comm.rank)
    x = g.normal(size=(args.batch, args.d_in)).astype(np.float32)
    y = g.integers(0, CLASSES, args.batch)
    comm_s: list[float] = []

    def step():
        comm_s.append(tr.step(x, y).comm_seconds)

    t = time_steps(step, args.iters, args.rounds)
    tr.close()
    return t, slowest(float(np.median(comm_s)))


def sync_case(comm, args) -> tuple[float, float, float, int, int]:
    """GradBuckets vs one flat raw Allreduce vs a per-tensor raw loop, same gradients."""
    n_layers = args.tensors // 2
    r = np.random.default_rng(0)
    model = ht.nn.Sequential(*[ht.nn.Linear(args.sync_width, args.sync_width, rng=r) for _ in range(n_layers)])
    params = model.parameters()
    for p in params:
        p.grad[...] = 1.0
    buckets = GradBuckets(params, comm, bucket_mb=25)
    raw = comm.mpi
    total = sum(p.data.size for p in params)
    flat = np.ones(total, np.float32)
    grads = [p.grad for p in params]

    def ours():
        buckets.begin()
        buckets.finish()

    def flat_raw():
        raw.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)

    def loop_raw():
        for gr in grads:
            raw.Allreduce(MPI.IN_PLACE, gr, op=MPI.SUM)

    t_ours, t_flat, t_loop = [], [], []
    for _ in range(args.rounds):  # interleaved so noise hits all three alike
        t_ours.append(time_steps(ours, args.iters, 1))
        t_flat.append(time_steps(flat_raw, args.iters, 1))
        t_loop.append(time_steps(loop_raw, args.iters, 1))
    return min(t_ours), min(t_flat), min(t_loop), len(params), total * 4


def torch_case(comm, args) -> float | None:
    """Seconds per step of the same MLP under torch DDP (gloo), or None without torch."""
    try:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return None
    torch.set_num_threads(1)
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        port = None
    port = comm.bcast_obj(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
    try:
        torch.manual_seed(0)
        layers: list = [torch.nn.Linear(args.d_in, args.width), torch.nn.ReLU()]
        for _ in range(args.depth - 2):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(args.width, CLASSES))
        model = DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=25)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        lossf = torch.nn.CrossEntropyLoss()
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(args.batch, args.d_in, generator=g)
        y = torch.randint(0, CLASSES, (args.batch,), generator=g)

        def step():
            opt.zero_grad(set_to_none=False)
            lossf(model(x), y).backward()
            opt.step()

        return time_steps(step, args.iters, args.rounds)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, well under a minute")
    ap.add_argument("--markdown", metavar="FILE", help="append the table to FILE")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch DDP comparison")
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.d_in, args.batch, args.iters, args.rounds = 512, 4, 256, 32, 3, 2
        args.tensors, args.sync_width = 150, 128
    else:
        args.width, args.depth, args.d_in, args.batch, args.iters, args.rounds = 1024, 5, 512, 64, 5, 3
        args.tensors, args.sync_width = 150, 256

    world = ht.Communicator()
    n = world.size
    alone = world.split(world.rank)
    n_params = sum(p.data.size for p in mlp(args.width, args.depth, args.d_in).parameters())

    rows: list[tuple[str, str, str, str, str]] = []
    solo, _ = dp_case(alone, args, overlap=True, bucket_mb=25)
    par, par_comm = dp_case(world, args, overlap=True, bucket_mb=25)
    eff = solo / par
    rows.append((f"weak scaling 1 -> {n} ranks (batch {args.batch}/rank)",
                 f"{n * args.batch / par:,.0f} samples/s on {n}", f"{args.batch / solo:,.0f} samples/s on 1",
                 f"efficiency {eff:.2f}", ">= 0.90"))
    for overlap in (True, False):
        for mb in (25, 1):
            t, c = (par, par_comm) if (overlap, mb) == (True, 25) else dp_case(world, args, overlap, mb)
            rows.append((f"step, overlap={'on' if overlap else 'off'}, bucket {mb} MB",
                         f"{t * 1e3:.1f} ms/step", f"exposed comm {c * 1e3:.1f} ms", f"comm share {c / t:.0%}", ""))
    t_ours, t_flat, t_loop, ntens, nbytes = sync_case(world, args)
    rows.append((f"grad sync, {ntens} tensors, {nbytes / 2**20:.1f} MB", f"hpctrain {t_ours * 1e3:.2f} ms",
                 f"flat raw Allreduce {t_flat * 1e3:.2f} ms", f"{t_ours / t_flat:.2f}x", "<= 1.10x"))
    rows.append(("", f"hpctrain {t_ours * 1e3:.2f} ms", f"per-tensor raw loop {t_loop * 1e3:.2f} ms",
                 f"{t_ours / t_loop:.2f}x", "< 1"))
    t_torch = None if args.no_torch else torch_case(world, args)
    if t_torch is not None:
        import torch

        rows.append((f"vs torch {torch.__version__} DDP gloo (same MLP)", f"{n * args.batch / par:,.0f} samples/s",
                     f"{n * args.batch / t_torch:,.0f} samples/s", f"{t_torch / par:.2f}x", "> 1"))
    else:
        rows.append(("vs torch DDP gloo", "torch not importable: skipped", "", "", ""))

    if world.rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].strip()
        head = ["measurement", "hpctrain", "reference", "ratio", "target"]
        lines = [f"### ddp: {n} ranks, MLP {n_params / 1e6:.2f} M params (float32), {lib}"
                 + (" (--quick)" if args.quick else ""), "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if args.markdown:
            with open(args.markdown, "a") as f:
                f.write(text + "\n")
    alone.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
