"""The planner's peak memory checked, by category: every layout ``plan.plan`` lists, no timing.

    mpiexec -n 4 python benchmarks/plan_memory_check.py [--quick] [--models mlp gpt gpt-long] [--steps 2]
                                                        [--precision bf16-mixed] [--markdown FILE]

For ``plan_check.py``'s three models, rank 0 measures the serial model's pieces (``plan.measure``:
memory is deterministic, so one rank's measurement is every rank's), ``plan.plan`` lists every
layout of the world (the links are a placeholder: only the memory is compared) and each layout
trains ``--steps`` steps as ``plan_check.run_layout`` does (``memory_report`` on every step). Per
layout it prints the predicted peak per rank against ``memory_summary()["total"]``, and the
predicted categories (``Prediction.memory_parts``) against those of the rank holding most: the
breakdown says which term of ``plan_memory`` is off. ``--precision``: measured and trained in
that policy (``training.precision``), as ``hpctrain plan --precision`` measures.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_check import job, models  # noqa: E402

MIB = 2**20
KEYS = ("params", "grads", "optimizer", "buffers", "activations_peak", "workspace")
SHORT = {"params": "par", "grads": "grd", "optimizer": "opt", "buffers": "buf", "activations_peak": "act",
         "workspace": "wsp"}


def run_layout(comm: Any, spec: dict[str, Any], pred: Any, costs: Any, steps: int,
               precision: str = "fp32") -> tuple[int, dict[str, int]]:
    """``(memory_summary's total, the categories of the rank holding most)`` after ``steps`` steps."""
    from hpctrain.nn import CrossEntropyLoss
    from hpctrain.parallel.plan_calibrate import layout_trainer

    lay = pred.layout
    tr, grid = layout_trainer(comm, lay, costs, spec["build"], CrossEntropyLoss(), trainer=job(precision))
    x, y = spec["data"](costs.batch // lay.dp, seed=2 + grid.dp.rank)
    tr.memory_report()
    mine: dict[str, int] = {}
    for _ in range(steps):
        report = tr.memory_report(tr.step(x, y))
        mine = {k: max(v, mine.get(k, 0)) for k, v in report.items()}  # as memory_summary keeps them
    total = int(tr.memory_summary()["total"])
    everyone = comm.mpi.allgather(mine)
    grid.free()
    return total, max(everyone, key=lambda d: d["total"])


def main(argv: list[str] | None = None) -> int:
    from hpctrain import Communicator
    from hpctrain.comm.linkprobe import Link
    from hpctrain.parallel import plan as planner

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt", "gpt-long"], choices=["mlp", "gpt", "gpt-long"])
    ap.add_argument("--steps", type=int, default=2, help="steps per layout (memory_report after each)")
    ap.add_argument("--quick", action="store_true", help="plan_check's smaller models")
    ap.add_argument("--only", default="", help="run only layouts whose label contains this text")
    ap.add_argument("--markdown", metavar="FILE", help="append the lines to FILE as a Markdown section")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "fp64", "bf16-mixed", "fp16-mixed"],
                    help="the trainer's precision policy (the pieces measured in it too)")
    args = ap.parse_args(argv)
    comm = Communicator()
    specs = models(args.quick)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    link = Link((0, 1), 1e-5, 1e9, ())  # time is not checked here
    links = {"intra-node": link, "inter-node": link}
    for name in args.models:
        spec = specs[name]
        costs = None
        if comm.rank == 0:
            x, _ = spec["data"](spec["batch"])
            costs = planner.measure(spec["build"], x.shape, sample=lambda n, s=spec: s["data"](n)[0],
                                    precision=args.precision)
        costs = comm.bcast_obj(costs, root=0)
        preds = [p for p in planner.plan(costs, links, comm.size) if args.only in p.layout.label()]
        within = 0
        for p in preds:
            total, got = run_layout(comm, spec, p, costs, args.steps, args.precision)
            err = (p.memory_bytes - total) / total
            within += abs(err) <= 0.10
            if comm.rank == 0:
                parts = " ".join(f"{SHORT[k]} {p.memory_parts.get(k, 0) / MIB:.2f}/{got.get(k, 0) / MIB:.2f}"
                                 for k in KEYS)
                say(f"{name:8s} {p.layout.label():34s} predicted {p.memory_bytes / MIB:6.2f} MiB  measured "
                    f"{total / MIB:6.2f} MiB {err * 100:+4.0f}%  | {parts}")
        if comm.rank == 0:
            say(f"{name} ({args.precision}): {within} of {len(preds)} layouts within 10%")
    if comm.rank == 0 and args.markdown:  # (make bench: every benchmark appends its section)
        with open(args.markdown, "a") as fh:
            fh.write(f"\n### plan memory check: {comm.size} ranks, {args.precision}\n\n```text\n" + "\n".join(lines)
                     + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
