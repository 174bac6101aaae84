"""``hpctrain status RUN``: how the last job in a run directory ended, from the directory alone (no
MPI): its record (``job.json``, see ``hpctrain.job.ending``), its last logged step, its newest
checkpoint and whether a summary was written. Exit status 0 when that job finished, 1 when it did
not (still running, preempted, failed, or ended without a word), 4 when RUN is no run directory or
holds a ``job.json`` or ``metrics.jsonl`` that is not what hpctrain wrote (a FIFO, a device, not a
JSON record: each named in its line; nothing is read from what is not a regular file)."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import ExitStatus


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="a run directory of hpctrain train (its --run-dir)")


def _checkpoint_dir(run: str) -> str:
    """The run's checkpoint directory: its config's ``checkpoint_dir``, else ``RUN/checkpoints``."""
    from ..errors import ConfigError
    from ..files import rundir

    try:
        given = (rundir.read_record(os.path.join(run, "config.json")) or {}).get("checkpoint_dir")
    except ConfigError:  # (read_config says what is wrong with it, when a job reads it)
        given = None
    return given if isinstance(given, str) and given else os.path.join(run, "checkpoints")


def main(args: argparse.Namespace) -> int:
    from .. import checkpoint
    from ..errors import ConfigError
    from ..files import rundir
    from ..job import ending

    run = args.run
    refused: list[str] = []  # the run directory's files that are not what hpctrain wrote, each said in its line
    try:
        record = ending.read(run)
    except ConfigError as exc:
        record, refused = None, [*refused, str(exc)]
    if record is None and not refused and not os.path.isfile(os.path.join(run, "config.json")):
        print(f"hpctrain status: error: {run} is not a run directory of hpctrain train (no {ending.RECORD}, no "
              "config.json)", file=sys.stderr)
        return ExitStatus.CONFIG
    try:
        step = ending.last_step(run)
        metrics = f"step {step}" if step is not None else "none"
    except ConfigError as exc:
        step, metrics, refused = None, str(exc), [*refused, str(exc)]
    owner = rundir.RunLock(run).owner()
    if refused and record is None:
        said = f"unknown: {refused[0]}"
    elif record is None:
        said = "left no record (written by an hpctrain that kept none)"
    elif record.get("state") == "running" and owner is not None and owner.get("pid") == record.get("pid"):
        said = f"is running (started {record.get('since')} on {record.get('host')}, pid {record.get('pid')})"
    else:
        said = ending.describe(record, step)
    print(f"run directory   {run}")
    print(f"last job        {said}")
    print(f"metrics         {metrics}")
    where = _checkpoint_dir(run)
    newest = checkpoint.list_checkpoints(where)
    print(f"checkpoint      {newest[-1] if newest else 'none in ' + where}")
    summary = os.path.join(run, ending.SUMMARY)
    print(f"summary         {summary if os.path.isfile(summary) else 'none (the last job did not finish)'}")
    if refused:  # said as an error too: the exit status of a refusal
        print(f"hpctrain status: error: {'; '.join(refused)}", file=sys.stderr)
        return ExitStatus.CONFIG
    finished = record is not None and record.get("state") == "finished" and os.path.isfile(summary)
    return ExitStatus.OK if finished else ExitStatus.FAILURE
