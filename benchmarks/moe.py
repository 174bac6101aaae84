"""Mixture of experts: an MoE GPT (8 experts, top-2) at ep=1/2/4 against the dense GPT of the same
active parameters, the MoE's all-to-all against raw mpi4py, and what the load-balancing loss does.

    mpiexec -n 4 python benchmarks/moe.py [--quick] [--markdown FILE]

Every rank holds its own batch (the ranks are dp replicas; ep groups are carved out of them by
``ProcessGrid(world, ep=N)``). A step here is the model's forward and backward (the library's
part: no optimizer, no dp reduction, the same for every row), timed on the slowest rank; tokens/s
counts every rank's tokens. The dense GPT has ``d_hidden = top_k * d_hidden`` (each token's MLP
work and parameters equal a top-k MoE's active ones). The MoE's exchanges are timed inside the
step by wrapping its group's ``alltoallv``; the same row counts and bytes are then moved by
``Communicator.alltoallv`` and by raw ``MPI.Comm.Alltoallv`` on preallocated buffers (ratio
raw/ours: 1.0 is no overhead; target >= 0.9). Load balance: the MoE GPT trained ``--train-steps``
steps (AdamW) on the shipped Shakespeare excerpt with aux weight 0 and 0.01, then max/mean of the
router's tokens per expert over the MoE layers' last forward (1.0 is perfectly balanced, 8.0 one
expert takes every token at top-1). One BLAS thread per rank.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import emit  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctrain import Communicator, ProcessGrid  # noqa: E402
from hpctrain.data.builtin import corpus_text  # noqa: E402
from hpctrain.nn import GPT, CrossEntropyLoss  # noqa: E402
from hpctrain.nn.moe import moe_layers, set_aux_weight  # noqa: E402
from hpctrain.optim import AdamW  # noqa: E402
from hpctrain.parallel import expert_parallel  # noqa: E402

VOCAB = 65


class Timed:
    """An ep group whose ``alltoallv`` calls are timed and their row counts recorded."""

    def __init__(self, comm: Communicator) -> None:
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.seconds, self.calls = 0.0, []

    def alltoallv(self, x, send_counts, recv_counts=None, out=None):
        t0 = time.perf_counter()
        got = self.comm.alltoallv(x, send_counts, recv_counts, out)
        self.seconds += time.perf_counter() - t0
        self.calls.append((tuple(x.shape[1:]), x.dtype, list(send_counts), list(recv_counts)))
        return got


def build(args, moe: bool) -> GPT:
    hidden = args.hidden if moe else args.top_k * args.hidden
    return GPT(VOCAB, args.seq, args.d_model, args.heads, args.layers, d_hidden=hidden, rng=0,
               moe_experts=args.experts if moe else 0, moe_top_k=args.top_k)


def throughput(world: Communicator, args, ep: int, data) -> dict:
    """Forward+backward of the MoE GPT (ep > 0) or the dense one (ep == 0) on every rank."""
    model = build(args, moe=ep > 0)
    timed = None
    if ep > 1:
        model = expert_parallel(model, ProcessGrid(world, ep=ep).ep)
        timed = Timed(model.ep_comm)
        for m in moe_layers(model):
            m.group = timed
    idx, g = data
    step_t, a2a_t = [], []
    for i in range(args.steps + 2):
        if timed is not None:
            timed.seconds, timed.calls = 0.0, []
        world.barrier()
        t0 = time.perf_counter()
        model.forward(idx)
        model.backward(g)
        dt = time.perf_counter() - t0
        if i >= 2:  # two warm-up steps: buffers, connections
            step_t.append(world.allreduce(np.array([dt]), op="max")[0])
            a2a_t.append(world.allreduce(np.array([timed.seconds if timed else 0.0]), op="max")[0])
    tokens = world.size * idx.size
    step = statistics.median(step_t)
    return {"ep": ep, "step": step, "tps": tokens / step, "a2a": statistics.median(a2a_t),
            "calls": timed.calls if timed else [], "group": model.ep_comm if ep > 1 else None,
            "params": sum(p.data.size for p in model.parameters())}


def raw_vs_ours(group: Communicator, calls: list, rounds: int) -> tuple[float, float]:
    """Seconds for one step's exchanges (``calls``: shapes and counts the MoE used), through
    ``Communicator.alltoallv`` and through raw mpi4py ``Alltoallv``; the best of ``rounds``."""
    bufs = []
    for shape, dtype, send, recv in calls:
        row = int(np.prod(shape))
        x = np.ones((sum(send), *shape), dtype=dtype)
        out = np.empty((sum(recv), *shape), dtype=dtype)
        sc = np.asarray(send) * row
        rc = np.asarray(recv) * row
        spec = ([x, (sc, np.concatenate(([0], np.cumsum(sc)[:-1])))],
                [out, (rc, np.concatenate(([0], np.cumsum(rc)[:-1])))])
        bufs.append((x, send, recv, out, spec))

    def once(raw: bool) -> float:
        group.mpi.Barrier()
        t0 = time.perf_counter()
        for x, send, recv, out, spec in bufs:
            if raw:
                group.mpi.Alltoallv(*spec)
            else:
                group.alltoallv(x, send, recv, out=out)
        return group.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    raw, ours = [], []
    for r in range(rounds):  # interleaved, alternating which goes first
        for kind in ((True, False) if r % 2 == 0 else (False, True)):
            (raw if kind else ours).append(once(kind))
    return min(raw), min(ours)


def balance(args, weight: float) -> tuple[float, float, float]:
    """Train the MoE GPT alone with aux weight ``weight``: (max/mean tokens per expert, aux, loss)."""
    text = corpus_text()
    codes = np.frombuffer(text.encode("ascii", "replace"), dtype=np.uint8) % VOCAB
    model = build(args, moe=True)
    set_aux_weight(model, weight)
    opt, ce = AdamW(model.parameters(), lr=args.lr), CrossEntropyLoss()
    rng = np.random.default_rng(5)
    loss = 0.0
    for _ in range(args.train_steps):
        starts = rng.integers(0, len(codes) - args.seq - 1, args.batch)
        x = np.stack([codes[s:s + args.seq] for s in starts]).astype(np.int64)
        y = np.stack([codes[s + 1:s + args.seq + 1] for s in starts]).astype(np.int64)
        model.zero_grad()
        loss = ce.forward(model.forward(x), y)
        model.backward(ce.backward())
        opt.step()
    ratios = [m.tokens_per_expert.max() / m.tokens_per_expert.mean() for m in moe_layers(model)]
    return float(np.mean(ratios)), model.aux_loss, float(loss)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("d-model", 256), ("heads", 4), ("layers", 2), ("hidden", 512), ("experts", 8),
                          ("top-k", 2), ("batch", 8), ("seq", 128), ("steps", 5), ("train-steps", 200)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every table")
    ap.add_argument("--markdown", metavar="FILE", help="append the tables to FILE")
    args = ap.parse_args(argv)
    if args.quick:
        args.d_model, args.hidden, args.batch, args.seq, args.steps, args.train_steps = 64, 128, 4, 32, 2, 20
    world = Communicator()
    eps = [e for e in (2, 4) if e <= world.size and world.size % e == 0 and args.experts % e == 0]
    if not eps:
        print("benchmarks/moe.py needs 2 or 4 ranks (mpiexec -n 4)", file=sys.stderr)
        return 1
    rng = np.random.default_rng(world.rank)
    data = (rng.integers(0, VOCAB, (args.batch, args.seq)),
            rng.standard_normal((args.batch, args.seq, VOCAB)).astype(np.float32) / (args.batch * args.seq))
    rows = [throughput(world, args, ep, data) for ep in (0, 1, *eps)]
    exch = {r["ep"]: raw_vs_ours(r["group"], r["calls"], 7) for r in rows if r["group"] is not None}
    bal = {w: balance(args, w) for w in (0.0, 0.01)} if world.rank == 0 else {}
    if world.rank != 0:
        return 0
    dense = rows[0]
    lib = MPI.Get_library_version().splitlines()[0].strip()
    shape = (f"d_model={args.d_model}, {args.layers} blocks, experts={args.experts} x d_hidden={args.hidden}, "
             f"top-{args.top_k}, batch {args.batch} x {args.seq} per rank, {world.size} ranks, float32")
    table = []
    for r in rows:
        raw, ours = exch.get(r["ep"], (0.0, 0.0))
        table.append(["dense" if r["ep"] == 0 else f"MoE ep={r['ep']}", f"{r['params'] / 1e6:.2f}",
                      f"{r['step'] * 1e3:.1f}", f"{r['tps']:.0f}", f"{r['tps'] / dense['tps']:.2f}",
                      f"{r['a2a'] * 1e3:.2f}" if r["ep"] > 1 else "-",
                      f"{raw / ours:.2f}" if ours else "-"])
    emit(f"MoE GPT vs dense of the same active parameters ({shape}), {lib}",
         ["model", "params/rank M", "fwd+bwd ms", "tokens/s", "vs dense", "all-to-all ms", "raw/ours a2a"],
         table, args.markdown,
         notes=["all-to-all ms: the MoE's exchanges inside a step, waits for the slowest rank included (each "
                "is a synchronisation point); raw/ours a2a: one step's all-to-all-v calls (the same counts "
                "and bytes) by raw mpi4py Alltoallv over Communicator.alltoallv, best of 7 interleaved rounds "
                "(target >= 0.9)."])
    emit(f"Load balance after {args.train_steps} AdamW steps (lr {args.lr}) on the Shakespeare excerpt",
         ["aux weight", "max/mean tokens per expert", "aux loss", "LM loss"],
         [[w, f"{b[0]:.2f}", f"{b[1] / args.layers:.3f}", f"{b[2]:.3f}"]
          for w, b in bal.items()], args.markdown,
         notes=["max/mean: the router's assignments per expert of the last step, averaged over the MoE "
                "layers (1.0 balanced); aux loss per layer (1.0 balanced, up to the number of experts)."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
