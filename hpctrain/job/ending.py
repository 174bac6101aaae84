"""How the last job in a run directory ended, told by the directory itself: ``RUN_DIR/job.json``.

A launcher's exit status can say "done" for a job that did not finish: under MPICH's Hydra a rank
that exits with status 0 mid-run (``os._exit(0)`` in a library, say) makes ``mpiexec`` kill the
others at once and return 0, and Open MPI's launcher has returned 0 after losing a node. So the
job keeps its own record: rank 0 writes ``{"state": "running", ...}`` once it holds the run
directory, and the job's leader (rank 0, or the survivors' after lost ranks) rewrites it when the
job ends: ``finished`` (``summary.json`` written), ``preempted``, ``failed`` or ``interrupted``,
with the exit status and the message. A job ended without a word leaves ``running`` behind: the
next job on the directory (``--resume``) and ``hpctrain status RUN`` say so, with the last step in
``metrics.jsonl``. ``summary.json`` is moved to ``summary.previous.json`` when a job starts, so it
is only ever the summary of a job that finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import (
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    DatasetError,
    ExitStatus,
    GridError,
    MismatchError,
    Preempted,
    ReplicaLeft,
)
from ..files import rundir
from ..log import get_logger

RECORD = "job.json"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
_log = get_logger("train")


def exit_status(exc: BaseException) -> int:
    """The exit status ``hpctrain train`` ends with when ``exc`` ends its job (README's table)."""
    if isinstance(exc, Preempted):
        return ExitStatus.PREEMPTED
    if isinstance(exc, KeyboardInterrupt):
        return ExitStatus.INTERRUPTED
    if isinstance(exc, CheckpointWriteError):
        return ExitStatus.CHECKPOINT_WRITE
    if isinstance(exc, (ConfigError, DatasetError, CheckpointError, MismatchError, GridError)):
        return ExitStatus.CONFIG
    return ExitStatus.FAILURE


def read(run_dir: str) -> dict[str, Any] | None:
    """The record of the last job in ``run_dir`` (``None``: none there); a ``ConfigError`` naming
    the file when it is not one hpctrain wrote (not a regular file, too large, not a JSON object:
    ``rundir.read_record``), so that it is never mistaken for a directory without a record."""
    return rundir.read_record(os.path.join(run_dir, RECORD))


def _read_or_none(run_dir: str) -> dict[str, Any] | None:
    """:func:`read`, with a record that is not hpctrain's taken as none (said by the caller's warning)."""
    try:
        return read(run_dir)
    except ConfigError:
        return None


def _write(run_dir: str, record: dict[str, Any]) -> None:
    """Write the record; a run directory that cannot be written is said, never raised over the job's
    own outcome."""
    try:
        rundir.write_exclusive(os.path.join(run_dir, RECORD), json.dumps(record, indent=1))
    except OSError as exc:
        _log.warning("cannot record how the job ends in %s (%s)", os.path.join(run_dir, RECORD), exc.strerror)


def start(run_dir: str, world_size: int) -> None:
    """Rank 0, holding the run directory: say how the last job there ended, move its summary
    aside, and record this one as running."""
    try:  # (the job's claim refused what is not a regular file: here only a damaged record is left)
        last = read(run_dir)
        if last is not None:
            line = describe(last, last_step(run_dir))
            (_log.warning if last.get("state") == "running" else _log.info)("the last job in %s, %s", run_dir, line)
    except ConfigError as exc:
        _log.warning("how the last job in %s ended is unknown: %s; this job's record replaces it", run_dir, exc)
    summary = os.path.join(run_dir, SUMMARY)
    if os.path.lexists(summary):
        os.replace(summary, os.path.join(run_dir, "summary.previous.json"))
    _write(run_dir, {"state": "running", **rundir.owner_record(), "world_size": world_size})


#: Run directories whose job started here (its claim passed on every rank): only those get an ending.
_started: set[str] = set()


def started(run_dir: str) -> None:
    """Every rank, once the run's state is settled: :func:`recorded` will write the job's ending."""
    _started.add(os.path.abspath(run_dir))


@contextlib.contextmanager
def recorded(run_dir: str, leader: Callable[[], bool]) -> Iterator[None]:
    """Around a job on ``run_dir``: on its way out, the process that speaks for the job then
    (``leader()``) records how it ended, if the job started (:func:`started`; a job refused before
    it claimed the directory leaves the last job's record as it was). A rank that leaves while the
    others go on (``ReplicaLeft``) records nothing."""
    state, status, message, speaks = "finished", 0, "", True
    try:
        yield
    except ReplicaLeft:
        speaks = False
        raise
    except BaseException as exc:
        status = exit_status(exc)
        state = {ExitStatus.PREEMPTED: "preempted", ExitStatus.INTERRUPTED: "interrupted"}.get(status, "failed")
        message = str(exc).split("\n", 1)[0][:500] or type(exc).__name__
        raise
    finally:
        key = os.path.abspath(run_dir)
        if key in _started and speaks and leader():
            _write(run_dir, {**(_read_or_none(run_dir) or {}), "state": state, "exit_status": int(status),
                             "message": message, "ended": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        _started.discard(key)


def last_step(run_dir: str) -> int | None:
    """The step of the last whole line of ``metrics.jsonl`` (``None``: none); a ``ConfigError``
    naming the file when it is not a regular file (``rundir.open_regular``: never blocks)."""
    fd = rundir.open_regular(os.path.join(run_dir, METRICS))
    if fd is None:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def describe(record: dict[str, Any], step: int | None) -> str:
    """How the job of ``record`` ended, in words (``step``: the last one in its metrics)."""
    who = f"started {record.get('since')} on {record.get('host')}, pid {record.get('pid')}"
    who += f", Slurm job {record['job']}" if record.get("job") else ""
    reached = f"; metrics.jsonl reaches step {step}" if step is not None else "; it logged no step"
    state = record.get("state")
    if state == "running":
        return (f"{who}: did not finish and recorded no ending: it was killed, or a rank exited or died and the "
                f"launcher ended the job (whatever exit status it gave){reached}")
    verb = {"finished": "finished", "failed": "failed"}.get(str(state), f"was {state}")
    said = f": {record['message']}" if record.get("message") else ""
    return f"{who}: {verb} at {record.get('ended')} (exit status {record.get('exit_status')}){said}{reached}"
