"""``hpctrain plan``: every layout of a job predicted from measured costs, best first.

    mpiexec -n 4 hpctrain plan --model gpt                    # this job's ranks, nodes and links
    hpctrain plan --model gpt --ranks 8 --nodes 2 --memory 24 --probe-file probe.json   # another allocation
    mpiexec -n 4 hpctrain plan --model gpt --json             # {"layouts": [...], "calibration": ...}

The model and data flags are ``hpctrain train``'s (the same parser, ``job.add_arguments``); the
layout ones given (``--tp 2``, ``--zero 1``, a config file's ``strategy``) constrain the plan, as
beside ``--layout auto``: it lists only layouts with them and chooses the rest. Under the job's own
``mpiexec``/``srun`` the costs are calibrated with a few real steps first (``--no-calibrate``
skips it); ``--ranks N`` cannot time steps of ranks it does not hold, and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..job import add_arguments as train_arguments

EXAMPLES = """examples:
  mpiexec -n 4 hpctrain plan --model gpt                          # plan this job: its ranks, nodes, links
  mpiexec -n 4 hpctrain plan --model gpt --json                   # {"layouts": [...], "calibration": {...}}
  mpiexec -n 4 hpctrain plan --model gpt --no-calibrate           # no timed steps: faster, less accurate
  hpctrain info --probe --save probe.json                         # (under mpiexec on the nodes to plan for)
  hpctrain plan --model gpt --ranks 8 --nodes 2 --memory 24 --probe-file probe.json   # an allocation not had
  mpiexec -n 4 hpctrain train --model gpt --layout auto           # plan, then train with the best layout
more: docs/how-to/choose-a-layout.md"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``hpctrain train``'s flags (the model, the data, the rest), then the allocation's."""
    train_arguments(p)
    p.epilog = EXAMPLES
    p.usage = "%(prog)s [-h] [--config FILE] [--FLAG VALUE ...] [--ranks N --nodes K] [--memory GiB] [--json]"
    g = p.add_argument_group("the allocation planned for (default: this job's, under its mpiexec/srun)")
    g.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="plan for N ranks this job does not have (needs --probe-file)")
    g.add_argument("--nodes", type=int, default=None, metavar="K", help="... on K nodes, N/K ranks each [1]")
    g.add_argument("--memory", type=float, default=None, metavar="GIB",
                   help="memory per rank in GiB (default: the GPU's, else the node's memory / its ranks)")
    g.add_argument("--json", action="store_true",
                   help='print {"layouts": [...], "calibration": {...}} (layouts best first: dp, tp, pp, cp, ep, '
                        "zero, recompute, microbatches, predicted_ms, memory_bytes, fits, why; calibration: seconds, "
                        "step_fixed_s, call_s, compute_scale, recompute_scale, bubble_scale, steps_s, or null when "
                        "not calibrated) instead of the table")


def main(args: argparse.Namespace) -> int:
    """Entry of ``hpctrain plan``; exit 0, 2 (bad flags) or 4 (refused: configuration, data, probe
    file), each said once on every rank's behalf."""
    from ..errors import ExitStatus, HpctrainError
    from ..job import planning

    problem = planning.usage_problem(args.ranks, args.nodes, args.memory, getattr(args, "probe_file", None))
    if problem is not None:  # every rank reads the same flags: refused on each before MPI starts
        print(f"hpctrain plan: error: {problem}", file=sys.stderr)
        return ExitStatus.USAGE
    from ..comm import Communicator
    from ..comm.failure import fail
    from ..job.ending import exit_status

    comm = Communicator()
    try:
        rows, alloc, costs, cons, cal = _plan(args, comm)
    except HpctrainError as exc:
        return fail(exc, code=exit_status(exc), what="hpctrain plan")
    if comm.rank == 0:
        try:
            doc = {"layouts": rows, "calibration": cal.as_json()}
            print(json.dumps(doc, indent=1) if args.json else planning.table(rows, alloc, costs, cons, cal), flush=True)
        except BrokenPipeError:  # `hpctrain plan | head`: the reader has what it wanted
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's exit flushes stdout)
    return ExitStatus.OK


def _plan(args: argparse.Namespace, comm: Any) -> tuple[list[dict[str, Any]], Any, Any, dict[str, Any], Any]:
    """The settings as ``train`` reads them, planned as ``--layout auto`` plans (collective)."""
    from ..job import planning
    from ..job.config import OPTIONS, read_settings
    from ..job.runner import everywhere, limit_blas_threads, pick_device, write_builtin

    names = {o.name for o in OPTIONS}
    flags = {k: v for k, v in vars(args).items() if k in names}
    cfg, _ = everywhere(comm, lambda: read_settings(args.config, flags))
    cfg = cfg.replace(layout="auto")
    cons = planning.constraints(cfg)  # (the layout settings given: the plan keeps to them)
    # Checked as one rank's job: what depends on the layout (the batch's split) is each layout's own check.
    c = everywhere(comm, lambda: planning.open_resolved(cfg))
    device = pick_device(c, comm)
    limit_blas_threads(comm)
    alloc = planning.allocation(comm, everywhere, c.probe_file, device, args.ranks, args.nodes, args.memory)
    if args.ranks is None:  # calibration's steps read the built-in set on every node
        write_builtin(c, comm)
    # Calibrated with real steps only on the ranks it plans for: --ranks N plans an allocation not held.
    rows, alloc, costs, cal = planning.plan_rows(c, comm, device, alloc, everywhere, cons, held=args.ranks is None)
    return rows, alloc, costs, cons, cal
