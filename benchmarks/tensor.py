"""Tensor parallelism of one transformer block: per-rank memory, step time and traffic at tp=1 and tp=2.

    mpiexec -n 2 python benchmarks/tensor.py [--quick] [--markdown FILE]

tp=1 runs on every rank alone (so both runs keep the same cores busy), tp=2 on ranks 0 and 1.
Each rank uses one BLAS thread (OPENBLAS_NUM_THREADS etc. default to 1 here).
The communication volume is counted in the tensor-parallel mappings and compared with Megatron's
expectation: 2 all-reduces of (batch x seq x d_model) per block forward (attention output and MLP
output) and 2 in backward. The tp all-reduce is also timed against raw mpi4py on the same buffer.
"""

from __future__ import annotations

import os

# One BLAS thread per rank (before NumPy loads): ranks share the cores, and threaded BLAS in
# every rank oversubscribes them and turns timings into noise.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import publish  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctrain import Communicator, ProcessGrid  # noqa: E402
from hpctrain.nn import MSELoss, TransformerBlock  # noqa: E402
from hpctrain.optim import AdamW  # noqa: E402
from hpctrain.parallel import TensorParallelTrainer, tensor_parallel  # noqa: E402
from hpctrain.parallel.tensor_mappings import reduce_from_tp, traffic  # noqa: E402


def measure(comm: Communicator, args: argparse.Namespace) -> dict:
    """One configuration on ``comm`` (its size is the tp size)."""
    grid = ProcessGrid(comm, tp=comm.size)
    block = TransformerBlock(args.d_model, args.heads, 4 * args.d_model, rng=0, dtype=np.float32)
    model = tensor_parallel(block, grid.tp)
    opt = AdamW(model.parameters(), lr=1e-4)
    trainer = TensorParallelTrainer(model=model, loss=MSELoss(), optimizer=opt, grid=grid)
    g = np.random.default_rng(1)
    x = g.standard_normal((args.batch, args.seq, args.d_model)).astype(np.float32)
    y = g.standard_normal((args.batch, args.seq, args.d_model)).astype(np.float32)
    for _ in range(2):
        trainer.step(x, y)  # warm-up (optimizer state, MPI connections)
    times, comms = [], []
    for _ in range(args.steps):
        comm.barrier()
        s = trainer.step(x, y)
        times.append(comm.allreduce(np.array([s.seconds]), op="max")[0])
        comms.append(comm.allreduce(np.array([s.comm_seconds]), op="max")[0])
    traffic.reset()
    out = model.forward(x)
    fwd = dict(traffic.bytes), dict(traffic.calls)
    traffic.reset()
    model.backward(np.ones_like(out))
    bwd = dict(traffic.bytes), dict(traffic.calls)
    params = sum(p.data.nbytes for p in model.parameters())
    state = sum(v.nbytes for st in opt.state.values() for v in st.values())
    return {"tp": comm.size, "params": params, "state": state, "step": statistics.median(times),
            "comm": statistics.median(comms), "fwd": fwd, "bwd": bwd}


def raw_vs_mapping(comm: Communicator, nbytes: int, iters: int) -> tuple[float, float]:
    """Seconds per all-reduce of ``nbytes`` float32: raw mpi4py vs ``reduce_from_tp``; best of 5 rounds."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    out = np.empty_like(a)
    raw_t, ours_t = [], []

    def timed(fn) -> float:
        comm.mpi.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return comm.mpi.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)

    for _ in range(5):
        raw_t.append(timed(lambda: comm.mpi.Allreduce(a, out, op=MPI.SUM)))
        ours_t.append(timed(lambda: reduce_from_tp(a, comm)))
    return min(raw_t), min(ours_t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="small sizes (well under a minute)")
    ap.add_argument("--markdown", metavar="FILE", help="append the tables to FILE")
    args = ap.parse_args(argv)
    if args.quick:
        args.d_model, args.heads, args.batch, args.seq, args.steps = 128, 4, 4, 64, 5

    world = Communicator()
    if world.size < 2:
        print("benchmarks/tensor.py needs at least 2 ranks (mpiexec -n 2)", file=sys.stderr)
        return 1
    results = [measure(Communicator(MPI.COMM_SELF), args)]
    world.barrier()
    pair = world.split(int(world.rank >= 2))  # ranks 0 and 1 form the tp=2 group
    act_bytes = args.batch * args.seq * args.d_model * 4
    ratios = None
    if world.rank < 2:
        results.append(measure(pair, args))
        ratios = raw_vs_mapping(pair, act_bytes, max(5, args.steps * 4))
    world.barrier()
    if world.rank != 0:
        return 0

    lib = MPI.Get_library_version().splitlines()[0].strip()
    lines = [
        f"### Tensor parallelism: one transformer block (d_model={args.d_model}, heads={args.heads}, "
        f"d_hidden={4 * args.d_model}, batch={args.batch}, seq={args.seq}, float32, AdamW), {lib}",
        "",
        "| tp | params/rank KiB | +Adam state KiB | step ms (median) | comm ms | fwd all-reduce bytes "
        "(calls) | expected fwd bytes | bwd all-reduce bytes (calls) | measured/expected |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        expected = 2 * act_bytes if r["tp"] > 1 else 0
        fb, fc = r["fwd"][0]["allreduce"], r["fwd"][1]["allreduce"]
        bb, bc = r["bwd"][0]["allreduce"], r["bwd"][1]["allreduce"]
        ratio = f"{fb / expected:.3f}" if expected else "n/a (no communication)"
        lines.append(
            f"| {r['tp']} | {r['params'] / 1024:.1f} | {(r['params'] + r['state']) / 1024:.1f} | "
            f"{r['step'] * 1e3:.2f} | {r['comm'] * 1e3:.2f} | {fb} ({fc}) | {expected} | {bb} ({bc}) | {ratio} |"
        )
    t1, t2 = results[0], results[1]
    lines += [
        "",
        f"Per-rank parameter memory at tp=2: {t2['params'] / t1['params']:.3f}x of tp=1; "
        f"step time: {t2['step'] / t1['step']:.2f}x of tp=1.",
        "",
        "| all-reduce of one (batch x seq x d_model) activation | raw mpi4py us | reduce_from_tp us | ratio |",
        "|---|---|---|---|",
        f"| {act_bytes} bytes | {ratios[0] * 1e6:.1f} | {ratios[1] * 1e6:.1f} | {ratios[1] / ratios[0]:.3f} |",
        "",
    ]
    publish("\n".join(lines), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
