"""One row of the matrix as real jobs: its uninterrupted one-process reference, its first job
(``mpiexec -n R``, a rank killed under ``--on-rank-loss shrink`` or a stop injected by
``driver.py``), its resume under another layout and rank count, then the checks: the losses of
every step (each logged exactly once) and the summary's against the reference's to the precision's
rounding, ``job.json`` finished, ``summary.json`` consistent.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jobs import REPO, clean_env, mpiexec, ulfm_flags

from .design import STEPS, STOP_AT, Row, as_flags

DRIVER = Path(__file__).with_name("driver.py")
#: A wait of a row's job longer than this is a stall (the watchdog's, and the launch's, bound).
WATCHDOG_S = 30
JOB_TIMEOUT_S = 75


@dataclass
class Ran:
    """What a job did: its exit status (``None``: killed at the time limit), output, seconds."""

    status: int | None
    out: str
    seconds: float
    command: str


def launch(args: list[str], n: int, data: Path, *, entry: tuple[str, ...] = ("-m", "hpctrain"),
           ulfm: bool = False, timeout: float = JOB_TIMEOUT_S) -> Ran:
    """``python ENTRY ARGS`` (under ``mpiexec -n n`` when n > 0), in its own session so that a job
    past ``timeout`` is ended whole (the launcher and every rank), never left running."""
    cmd = [sys.executable, *entry, *args]
    if n:
        cmd = [mpiexec(), *(ulfm_flags() if ulfm else []), "-n", str(n), *cmd]
    env = clean_env(HPCTRAIN_DATA=str(data), HPCTRAIN_TIMEOUT=str(WATCHDOG_S))
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        status: int | None = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        status = None
    return Ran(status, out, time.monotonic() - t0, " ".join(cmd))


def reference(row: Row, where: Path, data: Path) -> Path:
    """The uninterrupted one-process run of ``row``'s settings: its run directory."""
    run = where / "run"
    ran = launch(["train", *as_flags(row.reference_settings()), "--run-dir", str(run)], 0, data)
    assert ran.status == 0, f"the reference of {row.id} failed ({ran.command}):\n{ran.out}"
    return run


def tolerance(precision: str) -> float:
    """How far a row's losses may be from the one-process reference's (relative and absolute): one
    rounding of the compute dtype (a 16-bit compute under another layout rounds other partial
    results), or the drift of summing in another order once per parameter per step, a few roundings
    of the master dtype per step over the run's steps, whichever is larger."""
    import ml_dtypes

    from hpctrain.training.precision import Precision

    p = Precision.of(precision)
    return max(float(ml_dtypes.finfo(p.compute).eps), 5 * STEPS * float(ml_dtypes.finfo(p.master).eps))


def run(row: Row, where: Path, data: Path, ref: Path) -> list[Ran]:
    """Run ``row``'s jobs in ``where`` and check them against ``ref``; returns the jobs run."""
    run_dir = where / "run"
    target = row.resumed()
    kill = row.kill_at is not None
    event = "none" if not kill else "kill-end" if row.event == "kill-after-final" else "kill"
    # A kill's job is launched with ULFM, where --on-rank-loss defaults to shrink (the lost-rank line
    # below says it did): not given, so that the resume, launched without ULFM, derives its own
    # (an explicit shrink is the run's setting, and refused by a launch that cannot shrink).
    first = launch([event, str(row.killed()), str(row.kill_at or 0), str(STOP_AT if target else 0), "--",
                    *as_flags(row.settings()), "--run-dir", str(run_dir)], row.ranks, data, entry=(str(DRIVER),),
                   ulfm=kill)
    jobs = [first]
    said = _said(row, jobs)
    assert first.status == (75 if target else 0), said
    if kill:
        assert f"rank {row.killed()}: injected kill" in first.out, said
        assert f"hpctrain: lost rank(s) [{row.killed()}]" in first.out, said
    this_run = STEPS
    if target:
        stopped = re.search(r"stopped at step (\d+); checkpoint ", first.out)
        assert stopped, said
        this_run -= int(stopped.group(1))
        ranks, flags = target
        jobs.append(launch(["train", "--run-dir", str(run_dir), "--resume", *as_flags(flags)], ranks, data))
        said = _said(row, jobs)
        assert jobs[-1].status == 0, said
    # Every step counted once, however many a lost rank had redone.
    assert f"done: {this_run} steps ({STEPS} in total)" in jobs[-1].out, said
    check(run_dir, ref, row.precision, this_run, said)
    return jobs


def _said(row: Row, jobs: list[Ran]) -> str:
    """The row and its jobs' commands and output, for an assertion's message."""
    return f"row {row.id}\n" + "\n".join(f"$ {j.command}  ({j.status}, {j.seconds:.1f} s)\n{j.out}" for j in jobs)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def check(run: Path, ref: Path, precision: str, this_run: int, said: str) -> None:
    """``run`` ended as ``ref``: every step logged once with the reference's loss, the same
    closing figures (its last job took ``this_run`` steps), ``job.json`` finished."""
    tol = tolerance(precision)
    got, want = _metrics(run), _metrics(ref)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1)), said
    assert all(m["samples"] == want[0]["samples"] for m in got), said
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in want], rtol=tol, atol=tol,
                               err_msg=said)
    summary, ref_summary = (json.loads((r / "summary.json").read_text()) for r in (run, ref))
    assert (summary["steps"], summary["steps_this_run"]) == (STEPS, this_run), said
    assert summary["final_loss_steps"] == ref_summary["final_loss_steps"], said
    for key in ("final_loss", "val_loss"):
        np.testing.assert_allclose(summary[key], ref_summary[key], rtol=tol, atol=tol, err_msg=f"{key}\n{said}")
    job = json.loads((run / "job.json").read_text())
    assert (job["state"], job["exit_status"]) == ("finished", 0), said
