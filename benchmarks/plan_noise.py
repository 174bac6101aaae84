"""How far calibration's timed steps move from run to run: the noise the planner's fit carries.

    mpiexec -n 4 python benchmarks/plan_noise.py [--models mlp gpt gpt-long] [--steps 14] [--quick] [--markdown FILE]

For ``plan_check.py``'s models, every layout ``plan_calibrate.probe_layouts`` times is built twice (two
passes over the layouts, a trainer each time, as calibration builds them: ``layout_trainer``, one
warm-up step, the memory meter watching), and each trainer times ``--steps`` steps (the slowest
rank's time of each). Per layout it prints three estimates from each pass, each against plan_check's
figure of the *other* pass (what a prediction fitted to one pass meets when the layout is timed
again): what calibration would have taken (the median of ``planning.STEPS`` steps, more while they
add up to less than ``MIN_SECONDS``, at most four times as many), those steps' lower median (of two:
the faster), and plan_check's own figure (two warm-ups, the median of nine). The summary gives the
median, 90th percentile and largest of those differences over every layout and pass.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import emit  # noqa: E402
from plan_check import models  # noqa: E402


def timed(comm: Any, lay: Any, costs: Any, spec: dict[str, Any], steps: int) -> list[float]:
    """The slowest rank's seconds of ``steps`` steps of ``lay`` after one warm-up (as calibration)."""
    from hpctrain.nn import CrossEntropyLoss
    from hpctrain.parallel.plan_calibrate import layout_trainer

    tr, grid = layout_trainer(comm, lay, costs, spec["build"], CrossEntropyLoss())
    try:
        x, y = spec["data"](costs.batch // lay.dp, seed=2 + grid.dp.rank)
        tr.memory_report()
        tr.memory_report(tr.step(x, y))
        out = []
        for _ in range(steps):
            comm.barrier()
            t0 = time.perf_counter()
            stats = tr.step(x, y)
            out.append(float(comm.allreduce(np.array([time.perf_counter() - t0]), op="max")[0]))
            tr.memory_report(stats)
        return out
    finally:
        grid.free()


def calibration_count(times: list[float]) -> int:
    """How many of ``times`` calibration takes (``step_seconds``'s rule with ``planning``'s values)."""
    from hpctrain.job.planning import MIN_SECONDS, STEPS

    n = STEPS
    while sum(times[:n]) < MIN_SECONDS and n < 4 * STEPS and n < len(times):
        n += 1
    return n


ESTIMATES = {
    "calibration (median)": lambda t: statistics.median(t[:calibration_count(t)]),
    "their lower median": lambda t: sorted(t[:calibration_count(t)])[(calibration_count(t) - 1) // 2],
    "plan_check (median of 9)": lambda t: statistics.median(t[1:10]),
}


def main(argv: list[str] | None = None) -> int:
    from hpctrain import Communicator
    from hpctrain.parallel import plan as planner
    from hpctrain.parallel.plan_calibrate import probe_layouts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt", "gpt-long"], choices=["mlp", "gpt", "gpt-long"])
    ap.add_argument("--steps", type=int, default=14, help="timed steps per trainer (at least 10)")
    ap.add_argument("--quick", action="store_true", help="plan_check's smaller models")
    ap.add_argument("--markdown", metavar="FILE", help="append the tables to FILE as Markdown")
    args = ap.parse_args(argv)
    if args.steps < 10:
        ap.error("--steps must be at least 10: plan_check's figure is two warm-ups and nine steps")
    comm = Communicator()
    specs = models(args.quick)
    diffs: dict[str, list[float]] = {k: [] for k in ESTIMATES}
    rows: list[list[str]] = []
    for name in args.models:
        spec = specs[name]
        x, _ = spec["data"](spec["batch"])
        costs = planner.on_rank0_alone(comm, None, lambda s=spec, x=x: planner.measure(
            s["build"], x.shape, sample=lambda n: s["data"](n)[0]))
        costs = comm.bcast_obj(costs, root=0)
        lays = probe_layouts(comm.size, costs)
        passes = [[timed(comm, lay, costs, spec, args.steps) for lay in lays] for _ in range(2)]
        for i, lay in enumerate(lays):
            for p in (0, 1):
                ref = ESTIMATES["plan_check (median of 9)"](passes[1 - p][i])
                row = [name, f"{lay.label()} (pass {p + 1})", f"{ref * 1e3:.1f}"]
                for k, fn in ESTIMATES.items():
                    d = fn(passes[p][i]) / ref - 1
                    diffs[k].append(abs(d))
                    row.append(f"{d * 100:+.0f}%")
                rows.append(row)
    if comm.rank == 0:
        emit(f"plan noise: {comm.size} ranks, two trainers of each layout calibration times, {args.steps} steps each; "
             "each estimate against the other trainer's plan_check figure",
             ["model", "layout", "other pass: plan_check ms", *ESTIMATES], rows, args.markdown)
        summary = []
        for k, v in diffs.items():
            v = sorted(v)
            summary.append([k, f"{statistics.median(v) * 100:.1f}%", f"{v[int(0.9 * (len(v) - 1))] * 100:.1f}%",
                            f"{v[-1] * 100:.1f}%"])
        emit("plan noise: differences over every layout and pass",
             ["estimate", "median difference", "90th percentile", "largest"], summary, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
