"""Cost model: the step time of dp / zero / tp / pp layouts over two nodes, predicted and measured.

    mpiexec -n 4 python benchmarks/cost_model.py [--rate 1gbit] [--per-node 2 1] [--quick] [--markdown FILE]

The prediction of a layout's step is its measured compute plus its communication priced by the
alpha-beta fit of each link class (``hpctrain.comm.linkprobe``, as ``hpctrain info --probe``):

- compute: every rank runs, at the same time as the others (so a shared machine's load counts),
  the forward and backward of its own piece of the model (the whole model on the dp share for dp
  and zero; MLPs with ``d_hidden / tp`` for tp; its stage per micro-batch, ``m + pp - 1`` slots of
  the 1F1B schedule, for pp) and the optimizer step; the slowest rank's time counts.
- communication, from the layout's volume per step and the link class of each group (inter-node
  when the group spans nodes): dp all-reduce of this rank's parameter bytes, 2 log2(p) alpha +
  2 (p-1)/p n/beta; zero 1 a reduce-scatter of the gradients and an all-gather of the parameters,
  log2(p) alpha + (p-1)/p n/beta each; tp two all-reduces of the activations per MLP (forward
  and backward); pp one activation and one gradient message per micro-batch, alpha + n/beta.
  The model sums compute and communication (no overlap), so the trainers run with overlap off.

As root, rank 0 builds two network-namespace nodes (tests/netns_cluster.py) with the link shaped
to ``--rate`` and runs the measurement across them, once per ``--per-node`` count (2 and 1 ranks
per node by default; the other ranks of an outer ``mpiexec`` leave at once); otherwise (or with
``--claimed``) the ranks claim two nodes on one host (``HPCTRAIN_NODE_NAME``) and the title says
so: there the "inter-node" link is shared memory too.
"""

from __future__ import annotations

import os

# One BLAS thread per rank: the ranks share the cores (as in the other benchmarks).
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import across_namespaces, emit, outer_rank, this_script, timed  # noqa: E402


class Layout(NamedTuple):
    tp: int
    pp: int
    zero: int

    def label(self, size: int) -> str:
        dp = size // (self.tp * self.pp)
        return f"dp={dp} tp={self.tp} pp={self.pp}" + (f" zero {self.zero}" if self.zero else "")


#: dp, zero 1, tp, pp, tp x pp (dp takes the ranks left; a layout the world does not divide is left out).
LAYOUTS = (Layout(1, 1, 0), Layout(1, 1, 1), Layout(2, 1, 0), Layout(1, 2, 0), Layout(2, 2, 0))


class Sizes(NamedTuple):
    d: int  # width
    hidden: int  # MLP hidden width
    blocks: int  # MLPs in the model
    batch: int  # global batch
    microbatches: int  # of a pipeline step
    steps: int  # timed steps (the median counts)


def link_of(group: Any, my_node: str, links: dict[str, Any]) -> Any:
    """The link class a group's collectives pay: inter-node when its ranks span nodes (collective).
    A one-rank group pays nothing on any link (with one rank per node there is no intra-node fit)."""
    spans = len(set(group.allgather_obj(my_node))) > 1
    return links["inter-node"] if spans or group.size == 1 else links["intra-node"]


def predict_comm(lay: Layout, grid: Any, my_node: str, links: dict[str, Any], local_bytes: int,
                 act_bytes: int, mlps_here: int, m: int) -> float:
    """Seconds of communication of one step of ``lay`` on this rank (module docstring)."""
    dp = grid.dp_size
    dp_link = link_of(grid.dp, my_node, links)
    # zero 1: a reduce-scatter of the gradients, an all-gather of the parameters: the same as one all-reduce.
    t = 2 * dp_link.gather_seconds(local_bytes, dp) if lay.zero else dp_link.allreduce_seconds(local_bytes, dp)
    if lay.tp > 1:  # one all-reduce forward, one backward per MLP; pp=2 splits the batch into m
        t += 2 * mlps_here * m * link_of(grid.tp, my_node, links).allreduce_seconds(act_bytes, lay.tp)
    if lay.pp > 1:  # each micro-batch's activation forward and its gradient back, on the critical path
        t += 2 * m * (lay.pp - 1) * link_of(grid.pp, my_node, links).seconds(act_bytes)
    # The trainer's own per step: two all-reduces of a few floats over the world (the batch check:
    # sample counts and digests; then the loss, gradient norm and flags: Trainer.step).
    return t + 2 * link_of(grid.world, my_node, links).allreduce_seconds(64, grid.world.size)


def _model(sz: Sizes, hidden: int, blocks: int) -> Any:
    from hpctrain.nn import MLP, Sequential

    g = np.random.default_rng(0)
    return Sequential(*[MLP(sz.d, hidden, rng=g) for _ in range(blocks)])


def compute_only(lay: Layout, sz: Sizes, dp: int) -> Any:
    """A call running this layout's compute alone on this rank's piece (module docstring)."""
    from hpctrain.optim import AdamW

    model = _model(sz, sz.hidden // lay.tp, sz.blocks // lay.pp)
    opt = AdamW(model.parameters(), lr=1e-3)
    m = sz.microbatches if lay.pp > 1 else 1
    b = sz.batch // dp // m
    x = np.random.default_rng(1).normal(size=(b, sz.d)).astype(np.float32)
    grad = np.full((b, sz.d), 1.0 / b, dtype=np.float32)

    def one() -> None:
        for _ in range(m + lay.pp - 1):  # 1F1B: m micro-batches plus the pipeline's fill and drain
            model.forward(x)
            model.backward(grad)
        opt.step()
        opt.zero_grad()

    return one


def measure(comm: Any, lay: Layout, sz: Sizes, my_node: str, links: dict[str, Any]) -> tuple:
    """``(compute s, predicted communication s, measured step s, local parameter bytes, tp bytes
    per step: modelled, counted)`` of ``lay`` (the count from ``tensor_mappings.traffic``).

    Compute alone and the whole step are timed in alternating rounds (the median of each counts),
    so a shared machine's changing load falls on both alike."""
    from mpi4py import MPI

    from hpctrain import ProcessGrid
    from hpctrain.nn import CrossEntropyLoss
    from hpctrain.optim import AdamW
    from hpctrain.parallel import ParallelTrainer, parallelize
    from hpctrain.parallel.tensor_mappings import traffic

    grid = ProcessGrid(comm, tp=lay.tp, pp=lay.pp)
    part = parallelize(_model(sz, sz.hidden, sz.blocks), grid)
    m = sz.microbatches if lay.pp > 1 else 1
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-3),
                         grid=grid, microbatches=m, zero=lay.zero, overlap=False)
    b = sz.batch // grid.dp_size
    g = np.random.default_rng(2 + grid.dp.rank)
    x, y = g.normal(size=(b, sz.d)).astype(np.float32), g.integers(0, sz.d, b)
    local = sum(p.data.nbytes for p in part.parameters())
    act = (b // m) * sz.d * 4
    comm_s = predict_comm(lay, grid, my_node, links, local, act, sz.blocks // lay.pp, m)
    sides = {"compute": compute_only(lay, sz, grid.dp_size), "step": lambda: tr.step(x, y)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for fn in sides.values():
        fn()  # warm-up
    traffic.reset()
    for _ in range(sz.steps):
        for k, fn in sides.items():
            times[k].append(timed(fn, 1, MPI.COMM_WORLD))
    tp_bytes = (2 * (sz.blocks // lay.pp) * m * act if lay.tp > 1 else 0, traffic.bytes["allreduce"] // sz.steps)
    return statistics.median(times["compute"]), comm_s, statistics.median(times["step"]), local, tp_bytes


def run(args: argparse.Namespace) -> int:
    """Probe the links, then measure and predict every layout (all ranks; rank 0 prints)."""
    from mpi4py import MPI

    from hpctrain import Communicator
    from hpctrain.comm.linkprobe import probe, table
    from hpctrain.comm.nodes import describe, node_name, node_names

    comm = Communicator()
    if comm.size % 2:
        raise ValueError(f"the cost model benchmark needs an even number of ranks (two nodes), got {comm.size}")
    claimed = len(set(node_names(comm))) < 2
    if claimed:  # one host: claim two nodes of consecutive ranks (say so in the title)
        os.environ["HPCTRAIN_NODE_NAME"] = f"node{comm.rank // (comm.size // 2)}"
    names = node_names(comm)
    links = probe(comm, names)
    sz = Sizes(d=128, hidden=512, blocks=4, batch=64, microbatches=4, steps=7) if args.quick else \
        Sizes(d=256, hidden=1024, blocks=4, batch=128, microbatches=4, steps=9)
    rows = []
    for lay in (lay for lay in LAYOUTS if comm.size % (lay.tp * lay.pp) == 0):
        comp, comm_s, step, local, (tp_model, tp_counted) = measure(comm, lay, sz, node_name(comm), links)
        pred = comp + comm_s
        rows.append([lay.label(comm.size), f"{local / 2**20:.2f}", f"{tp_model >> 10} / {tp_counted >> 10}",
                     f"{comp * 1e3:.1f}", f"{comm_s * 1e3:.1f}",
                     f"{pred * 1e3:.1f}", f"{step * 1e3:.1f}", f"{(pred - step) / step * 100:+.0f}%"])
    if comm.rank == 0:
        where = "claimed on one host: the inter-node link is shared memory too" if claimed else \
            f"network-namespace nodes, link shaped to {args.rate}"
        lib = MPI.Get_library_version().splitlines()[0].strip()
        emit(f"cost model: {comm.size} ranks on 2 nodes ({where}; {describe(names)}), MLP of {sz.blocks} x "
             f"MLP({sz.d}, {sz.hidden}) float32, global batch {sz.batch}, {sz.microbatches} micro-batches "
             f"when pp > 1, {lib}, median of {sz.steps} steps",
             ["layout", "params/rank MiB", "tp KiB/step model / counted", "compute ms", "comm (model) ms",
              "predicted ms", "measured ms", "error"],
             rows, args.markdown,
             notes=["Links (`linkprobe`, as `hpctrain info --probe`):\n\n```\n" + table(links) + "\n```",
                    "predicted = measured compute (each rank's piece, all at once) + communication from the "
                    "alpha-beta fits and the layout's volume (benchmarks/cost_model.py docstring); measured = "
                    "ParallelTrainer.step with overlap off; error = (predicted - measured) / measured."])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="the namespace link's rate (tc tbf), e.g. 10gbit")
    ap.add_argument("--per-node", type=int, nargs="+", default=[2, 1],
                    help="ranks on each namespace node, one run per number (2 on a 2-core host oversubscribes)")
    ap.add_argument("--quick", action="store_true", help="a smaller model, fewer steps")
    ap.add_argument("--claimed", action="store_true", help="claim two nodes on this host even as root")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the run inside the namespaces
    ap.add_argument("--markdown", metavar="FILE", help="append the table to FILE as Markdown")
    args = ap.parse_args(argv)
    from netns_cluster import why_not

    if args.inner or args.claimed or why_not() is not None:
        return run(args)
    if outer_rank():
        return 0  # started by an outer mpiexec: rank 0 starts the two-node job
    argv = [*this_script(__file__), "--inner", "--rate", args.rate, *(["--quick"] if args.quick else []),
            *(["--markdown", args.markdown] if args.markdown else [])]
    return across_namespaces(argv, args.rate, args.per_node, timeout=400)


if __name__ == "__main__":
    sys.exit(main())
