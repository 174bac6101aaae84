"""The planner checked: every layout ``hpctrain.parallel.plan`` lists, predicted against measured.

    mpiexec -n 4 python benchmarks/plan_check.py [--quick] [--models mlp gpt gpt-long] [--markdown FILE]
                                                 [--precision bf16-mixed]

For three models (the MLP classifier, the GPT, the GPT at a four times longer block), as
``hpctrain plan`` does: rank 0 measures the serial model's pieces while the others wait
(``plan.measure``, ``plan.on_rank0_alone``), the links are probed (``linkprobe.probe``, as
``hpctrain info --probe``), ``plan_calibrate.calibrate`` times real steps of up to nine layouts
and fits what steps make of the terms (marked * in the table: fitted, not predicted), and
``plan.plan`` lists every layout of the world with its predicted step and peak memory per rank.
Then each layout trains for real: ``parallelize`` with the plan's own pipeline
cut, ``ParallelTrainer`` with overlap on (as users run it), two warm-up steps and the median of
``--steps`` timed steps (the slowest rank's time of each), the peak memory from the engine's
``memory_summary`` (the MemoryMeter's categories, the rank that holds most), and the seconds the
tensor-parallel all-reduces took (``tensor_mappings.traffic``) against the plan's price of them.
The table gives both, the errors and where the plan's first choice ranks among the measured.
``--precision``: the jobs' policy, as ``hpctrain plan --precision`` takes it (the pieces measured,
calibration's steps and the measured steps all in it).

As root the run moves to two network-namespace nodes (tests/netns_cluster.py) with the link
shaped to ``--rate`` (``--one-node`` keeps it on this host); the ranks of an outer ``mpiexec``
then leave at once and rank 0 starts the two-node job.
"""

from __future__ import annotations

import os

# One BLAS thread per rank: the ranks share the cores (as in the other benchmarks).
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import across_namespaces, emit, outer_rank, this_script  # noqa: E402

MIB = 2**20
VOCAB = 65


def models(quick: bool) -> dict[str, dict[str, Any]]:
    """The three models: a builder, a sampler of inputs and targets, the global batch."""
    from hpctrain import nn

    d, blocks, batch = (64, 4, 64) if quick else (128, 4, 128)
    t, layers, gb = (32, 2, 16) if quick else (64, 4, 16)

    def mlp() -> Any:
        g = np.random.default_rng(0)
        layers_ = [nn.Linear(d, d, rng=g), nn.GELU()]
        for _ in range(blocks):
            layers_ += [nn.MLP(d, 4 * d, rng=g), nn.GELU()]
        return nn.Sequential(*layers_, nn.Linear(d, 10, rng=g))

    def gpt(block: int) -> Any:
        return lambda: nn.GPT(VOCAB, block, 64 if quick else 128, 4, layers, rng=0)

    def floats(n: int, seed: int = 1) -> tuple[Any, Any]:
        g = np.random.default_rng(seed)
        return g.standard_normal((n, d)).astype(np.float32), g.integers(0, 10, n)

    def tokens(block: int) -> Any:
        def draw(n: int, seed: int = 1) -> tuple[Any, Any]:
            idx = np.random.default_rng(seed).integers(0, VOCAB, (n, block + 1))
            return idx[:, :-1], idx[:, 1:]
        return draw

    return {"mlp": {"build": mlp, "data": floats, "batch": batch, "what": f"MLP classifier d={d}, {blocks} blocks"},
            "gpt": {"build": gpt(t), "data": tokens(t), "batch": gb, "what": f"GPT {layers} layers, block {t}"},
            "gpt-long": {"build": gpt(4 * t), "data": tokens(4 * t), "batch": gb // 4,
                         "what": f"GPT {layers} layers, block {4 * t}"}}


def job(precision: str) -> Any:
    """The trainer settings of a job in ``precision`` (``plan_calibrate.TrainSettings``), as
    ``hpctrain train --precision`` gives them: calibration and the measured steps alike."""
    from hpctrain.parallel.plan_calibrate import TrainSettings
    from hpctrain.training.precision import Precision

    # A fresh policy per trainer: fp16's loss scaler is each job's own.
    return TrainSettings(options=lambda: {"precision": Precision(precision)})


def run_layout(comm: Any, spec: dict[str, Any], pred: Any, costs: Any, steps: int,
               precision: str = "fp32") -> tuple[float, int, float]:
    """``(median step s, peak memory bytes of the rank holding most, tp all-reduce s per step)``."""
    from mpi4py import MPI

    from hpctrain.nn import CrossEntropyLoss
    from hpctrain.parallel.plan_calibrate import layout_trainer
    from hpctrain.parallel.tensor_mappings import traffic

    lay = pred.layout
    tr, grid = layout_trainer(comm, lay, costs, spec["build"], CrossEntropyLoss(), trainer=job(precision))
    x, y = spec["data"](costs.batch // lay.dp, seed=2 + grid.dp.rank)
    tr.memory_report()  # watch the activations from the first step on
    for _ in range(2):
        tr.memory_report(tr.step(x, y))
    times, tp_s = [], 0.0
    for _ in range(steps):
        comm.barrier()
        traffic.reset()
        t0 = time.perf_counter()
        stats = tr.step(x, y)
        dt = time.perf_counter() - t0
        tp_s += traffic.seconds
        times.append(comm.mpi.allreduce(dt, op=MPI.MAX))
        tr.memory_report(stats)  # with the pipeline's stashed micro-batches, as the job reports them
    mem = int(tr.memory_summary()["total"])
    tp_s = comm.mpi.allreduce(tp_s / steps, op=MPI.MAX)
    grid.free()
    return statistics.median(times), mem, tp_s


def check_model(comm: Any, name: str, spec: dict[str, Any], links: dict, names: list[str], args: argparse.Namespace
                ) -> list[list[str]]:
    """Plan one model, run every layout listed, return the table's rows (on every rank)."""
    from hpctrain.parallel import plan as planner

    batch = spec["batch"]
    x, _ = spec["data"](batch)
    # As `hpctrain plan` measures: rank 0 alone while the others sleep, the costs shared.
    costs = planner.on_rank0_alone(comm, None, lambda: planner.measure(
        spec["build"], x.shape, sample=lambda n: spec["data"](n)[0], precision=args.precision))
    costs = comm.bcast_obj(costs, root=0)  # one set of costs: every rank plans alike
    from hpctrain.nn import CrossEntropyLoss
    from hpctrain.parallel.plan_calibrate import calibrate, terms

    t0 = time.perf_counter()
    raw = costs
    from hpctrain.job.planning import MIN_SECONDS, STEPS

    # Timed as `hpctrain plan` times them (its STEPS, MIN_SECONDS), so the table is what users get.
    costs = calibrate(comm, costs, links, spec["build"], spec["data"], CrossEntropyLoss(), steps=STEPS, nodes=names,
                      min_seconds=MIN_SECONDS, trainer=job(args.precision))
    fitted = costs.extra["fit"]
    calibrated = (f"{name}: calibrated in {time.perf_counter() - t0:.1f} s from {len(costs.extra['calibration'])} "
                  f"layouts (marked *): the engine's own work {costs.step_fixed_s * 1e3:.2f} ms per step, compute x"
                  f"{costs.compute_scale:.2f}, recomputation x{costs.recompute_scale:.2f}, bubble "
                  f"x{costs.bubble_scale:.2f}; per blocking call "
                  + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in costs.call_s.items()))
    options: dict[str, Any] = {"microbatches": (1, 2)} if args.quick else {}
    if args.quick:
        options.update(zero=(0, 1, 3), recompute=(False,))
    preds = planner.plan(costs, links, comm.size, names, None, **options)
    measured = []
    for p in preds:
        step, mem, tp_s = run_layout(comm, spec, p, costs, args.steps, args.precision)
        measured.append((p, step, mem, tp_s))
    fit_set = set(costs.extra["calibration"])
    saved = {"costs": raw.as_dict(), "fit": fitted, "calibration": costs.extra["calibration"],
             "layouts": [{**dataclasses.asdict(p.layout), "terms": terms(p.layout, raw, links, names),
                          "predicted_ms": p.predicted_ms, "measured_s": step, "memory_predicted": p.memory_bytes,
                          "memory_measured": mem, "memory_parts": p.memory_parts}
                         for p, step, mem, _ in measured]}
    order = sorted(range(len(measured)), key=lambda i: measured[i][1])
    first_rank = order.index(0) + 1
    best = measured[order[0]][1]
    rows = []
    for i, (p, step, mem, tp_s) in enumerate(measured):
        ms = step * 1e3
        mark = " *" if p.layout.label() in fit_set else ""
        rows.append([name, p.layout.label() + mark, f"{p.compute_ms:.1f}", f"{p.comm_ms:.1f}", f"{p.bubble_ms:.1f}",
                     f"{p.predicted_ms:.1f}", f"{ms:.1f}", f"{(p.predicted_ms - ms) / ms * 100:+.0f}%",
                     f"{p.memory_bytes / MIB:.2f}", f"{mem / MIB:.2f}",
                     f"{(p.memory_bytes - mem) / mem * 100:+.0f}%",
                     f"{p.comm_parts.get('tp', 0.0):.1f} / {tp_s * 1e3:.1f}",
                     f"{order.index(i) + 1}"])
    verdict = (f"{name}: the plan's first choice {preds[0].layout.label()} ranks {first_rank} of {len(preds)} measured "
               f"({measured[0][1] / best * 100 - 100:+.0f}% against the best)")
    return rows, f"{calibrated}; {verdict}", saved


def run(args: argparse.Namespace) -> int:
    """Probe, plan and measure every model (all ranks; rank 0 prints)."""
    from mpi4py import MPI

    from hpctrain import Communicator
    from hpctrain.comm.linkprobe import probe, table
    from hpctrain.comm.nodes import describe, node_names

    comm = Communicator()
    names = node_names(comm)
    t0 = time.perf_counter()
    links = probe(comm, names)
    meet = next(link.meet for link in links.values() if link is not None)
    specs = models(args.quick)
    rows, verdicts, saved = [], [], {}
    for name in args.models:
        r, v, saved[name] = check_model(comm, name, specs[name], links, names, args)
        rows += r
        verdicts.append(v)
    if args.save and comm.rank == 0:  # what the table came from, for refitting the model offline
        Path(args.save).write_text(json.dumps({"links": {k: v and dataclasses.asdict(v) for k, v in links.items()},
                                               "nodes": names, "models": saved}, indent=1))
    if comm.rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].strip()
        what = "; ".join(f"{k}: {specs[k]['what']}, global batch {specs[k]['batch']}" for k in args.models)
        emit(f"plan check: {comm.size} ranks ({describe(names)}), {what}, {args.precision} AdamW, overlap on, {lib}, "
             f"median of {args.steps} steps, load average {os.getloadavg()[0]:.1f}",
             ["model", "layout", "compute ms", "comm ms", "bubble ms", "predicted ms", "measured ms", "error",
              "predicted MiB", "measured MiB", "mem error", "tp comm ms plan / measured", "measured rank"],
             rows, args.markdown,
             notes=["Links (`linkprobe`, as `hpctrain info --probe`):\n\n```\n" + table(links) + "\n```\n\n"
                    f"A blocking collective's meeting of ranks arriving from compute (`Link.meet`): "
                    f"{meet * 1e3:.2f} ms.",
                    *verdicts,
                    "predicted: hpctrain.parallel.plan (its docstring gives each term) from pieces measured by rank 0 "
                    "alone and calibrated (the layouts marked * were timed for the fit, the rest are predictions); "
                    "measured: ParallelTrainer.step, the slowest rank, and memory_summary's total "
                    f"(the rank holding most); errors (predicted - measured) / measured; "
                    f"{time.perf_counter() - t0:.0f} s in all."])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt", "gpt-long"], choices=["mlp", "gpt", "gpt-long"])
    ap.add_argument("--steps", type=int, default=9, help="timed steps per layout (the median counts)")
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer layouts (zero 0/1/3, no recompute)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "fp64", "bf16-mixed", "fp16-mixed"],
                    help="the jobs' precision: measured, calibrated and trained in it (as hpctrain plan --precision)")
    ap.add_argument("--rate", default="1gbit", help="the namespace link's rate (tc tbf) of the two-node run")
    ap.add_argument("--per-node", type=int, default=2, help="ranks on each namespace node")
    ap.add_argument("--one-node", action="store_true", help="run on this host even as root")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the run inside the namespaces
    ap.add_argument("--markdown", metavar="FILE", help="append the table to FILE as Markdown")
    ap.add_argument("--save", metavar="FILE", help="write the costs, each layout's terms and measurements as JSON "
                    "(to refit the model offline: plan_calibrate.fit on any subset)")
    args = ap.parse_args(argv)
    from netns_cluster import why_not

    if args.inner or args.one_node or why_not() is not None:
        return run(args)
    if outer_rank():
        return 0  # started by an outer mpiexec (make bench): rank 0 alone starts the two-node job
    argv = [*this_script(__file__), "--inner", "--steps", str(args.steps), "--models", *args.models,
            "--precision", args.precision,
            *(["--quick"] if args.quick else []), *(["--markdown", args.markdown] if args.markdown else []),
            *(["--save", args.save] if args.save else [])]
    return across_namespaces(argv, args.rate, [args.per_node], timeout=3000)


if __name__ == "__main__":
    sys.exit(main())
