"""The trainers on the autograd engine against the explicit forward/backward they replaced.

    mpiexec -n 2 python benchmarks/trainer_engine.py [--quick] [--markdown FILE]

In one run, one BLAS thread per process, a float32 GPT (d_model 256, 4 blocks, 4 heads, 128
tokens, a 65-token vocabulary, AdamW):

1. one process (rank 0; the others wait): the trainer's step (``DataParallelTrainer`` over one
   rank: batch check, forward/backward, the step's agreement, AdamW) through the autograd engine,
   against the same trainer whose micro-batch runs the explicit protocol (``model.forward``,
   ``loss.forward``, ``model.backward(loss.backward())`` on arrays, the code the trainers ran
   before the engine) with the same layers. Interleaved rounds of CPU time (one thread: a shared
   machine's other load does not count), median; the difference is what the
   engine's bookkeeping costs a step (microseconds and share of the step), with the spread of the
   per-round differences as the noise. On a loaded machine that spread hides it, so the
   bookkeeping is also counted directly: the nodes of a step's graph times the engine's own cost
   per node (``autograd_overhead.py``'s chain: engine minus the same arrays in plain NumPy);
2. a pipeline of 2 stages (1F1B, 8 micro-batches, batch 16): the bytes a stage allocates during a
   step above what it held before (``tracemalloc``, NumPy's arrays included: the activations in
   flight), the larger stage's, and the trainer's own ``peak_activation_bytes``.

Run with an older hpctrain (one without ``hpctrain.training.graph``) it measures what that one
has (part 1 as the explicit trainer's step, part 2), for a before/after table.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")
# Rank 0 measures alone while the others wait in a barrier: on a loaded machine for longer than
# the default stall timeout.
os.environ.setdefault("HPCTRAIN_TIMEOUT", "0")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpctrain as ht  # noqa: E402
from hpctrain.backend import to_device, xp_of  # noqa: E402
from hpctrain.nn import GPT, CrossEntropyLoss  # noqa: E402
from hpctrain.parallel import DataParallelTrainer, ParallelTrainer, parallelize  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402

try:
    from hpctrain.training import graph  # noqa: F401, E402 - present once the trainers run on the engine
    ENGINE = True
except ImportError:
    ENGINE = False

VOCAB = 65


def config(quick: bool) -> dict:
    if quick:
        return {"d": 128, "layers": 2, "heads": 4, "t": 64, "batch": 8, "rounds": 5, "steps": 2}
    return {"d": 256, "layers": 4, "heads": 4, "t": 128, "batch": 16, "rounds": 7, "steps": 2}


def gpt(c: dict) -> GPT:
    return GPT(VOCAB, c["t"], c["d"], c["heads"], c["layers"], rng=0, dtype=np.float32)


def batch(c: dict, seed: int, n: int | None = None):
    g = np.random.default_rng(seed)
    n = c["batch"] if n is None else n
    return g.integers(0, VOCAB, (n, c["t"])), g.integers(0, VOCAB, (n, c["t"]))


def explicit_accumulate(self, batch):
    """The micro-batch loop the trainers ran before the engine (explicit protocol on arrays)."""
    x, y, w = batch.x, batch.y, batch.weight
    scales = self._scales(batch)
    xp = xp_of(self.params[0].data)
    loss_sum = 0.0
    for i, part in enumerate(batch.parts):
        if i == len(batch.parts) - 1:
            self.reducer.begin()
        out = self.model.forward(x[part])
        wi = None if w is None else to_device(w[part], xp)
        value = self.loss.forward(out, y[part]) if wi is None else self.loss.forward(out, y[part], wi)
        loss_sum = loss_sum + value * scales[i]
        self.model.backward(self.loss.backward(scales[i]))
    return loss_sum, {}, 0.0


class ExplicitTrainer(ParallelTrainer):
    """``ParallelTrainer`` whose micro-batches run the explicit protocol (no engine)."""

    _accumulate = explicit_accumulate


def graph_nodes_per_step(c: dict) -> int:
    """Nodes in one step's graph (one micro-batch: the trainer's)."""
    from hpctrain.autograd import graph_nodes
    from hpctrain.training.graph import forward_loss

    x, y = batch(c, 0)
    root = forward_loss(gpt(c), CrossEntropyLoss(), x, y, None, 1.0)
    return len(graph_nodes(root))


def per_node_seconds() -> float:
    """The engine's own cost per node (its chain against plain NumPy, best of rounds)."""
    from autograd_overhead import per_node

    return per_node(32, 7, 20)[1] / per_node(32, 1, 1)[2]


def one_process(c: dict) -> dict:
    """Median step seconds of the engine and the explicit trainer, rank 0 alone."""
    comm = ht.Communicator(MPI.COMM_SELF)
    kinds = {"engine": DataParallelTrainer} if ENGINE else {"explicit (this hpctrain's step)": DataParallelTrainer}
    if ENGINE:
        kinds["explicit"] = None
    trainers = {}
    for name, cls in kinds.items():
        m = gpt(c)
        opt = ht.optim.AdamW(m.parameters(), lr=3e-4)
        if cls is None:
            trainers[name] = ExplicitTrainer(model=m, loss=CrossEntropyLoss(), optimizer=opt,
                                             grid=ht.ProcessGrid(comm))  # fmt: skip
        else:
            trainers[name] = cls(model=m, loss=CrossEntropyLoss(), optimizer=opt, comm=comm)
    x, y = batch(c, 0)
    for tr in trainers.values():  # warm-up (buffers, kernels)
        tr.step(x, y)
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(c["rounds"]):
        for name, tr in trainers.items():
            t0 = time.process_time()  # this process's CPU (one thread): a shared machine's load does not count
            for _ in range(c["steps"]):
                tr.step(x, y)
            times[name].append((time.process_time() - t0) / c["steps"])
    for tr in trainers.values():
        tr.close()
    return {k: v for k, v in times.items()}


def pipeline_memory(c: dict, comm) -> dict:
    """Per stage: bytes allocated during a 1F1B step above the start, and the reported peak."""
    grid = ht.ProcessGrid(comm, pp=2)
    part = parallelize(gpt(c), grid)
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=ht.optim.AdamW(part.parameters(), lr=3e-4),
                         grid=grid, microbatches=8, schedule="1f1b")  # fmt: skip
    d, nd = grid.dp.rank, grid.dp.size
    x, y = batch(c, 1, 16 * nd)
    tr.step(x[d::nd], y[d::nd])  # warm-up: buffers made, shapes learned
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    st = tr.step(x[d::nd], y[d::nd])
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    tr.close()
    peaks = comm.allgather_obj((grid.pp.rank, peak))
    return {"alloc_peak": max(p for _, p in peaks), "reported": int(st.extra.get("peak_activation_bytes", 0))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    c = config(a.quick)
    comm = ht.Communicator()
    rows = []
    if comm.rank == 0:
        times = one_process(c)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            rows.append([f"GPT step, one process: {k}", f"{v * 1e3:.2f} ms"])
        if ENGINE:
            diffs = [e - x for e, x in zip(times["engine"], times["explicit"])]
            d = statistics.median(diffs)
            rows.append(["engine bookkeeping per step", f"{d * 1e6:.0f} us ({d / med['engine']:.1%} of the step; "
                         f"rounds {min(diffs) * 1e6:.0f}..{max(diffs) * 1e6:.0f} us)"])
            rows.append(["engine / explicit step time", f"{med['engine'] / med['explicit']:.3f}x"])
            nodes, cost = graph_nodes_per_step(c), per_node_seconds()
            rows.append(["graph nodes per step x engine cost per node",
                         f"{nodes} x {cost * 1e6:.2f} us = {nodes * cost * 1e6:.0f} us "
                         f"({nodes * cost / med['engine']:.2%} of the step)"])
    comm.barrier()
    if comm.size % 2 == 0:
        mem = pipeline_memory(c, comm)
        rows.append(["pp=2 1F1B, 8 micro-batches: bytes allocated in a step (largest stage)",
                     f"{mem['alloc_peak'] / 2**20:.2f} MiB"])
        rows.append(["pp=2 1F1B: reported peak_activation_bytes", f"{mem['reported'] / 2**20:.2f} MiB"])
    if comm.rank == 0:
        emit("Trainers on the autograd engine" + ("" if ENGINE else " (an hpctrain before the engine)"),
             ["measure", "value"], rows, a.markdown)


if __name__ == "__main__":
    main()
