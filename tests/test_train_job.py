"""The main job as users run it: resume refusals and fallbacks, the run-directory lock, SIGTERM under
``mpiexec -n 2`` with an exact resume, exit statuses, glob characters in run directory names.

The subprocess tests start their own jobs and run in the serial pass; the in-process ones run at
every world size.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpctrain import checkpoint
from hpctrain.errors import ExitStatus
from jobs import REPO, hpctrain
from jobs import clean_env as _env
from jobs import mpiexec as _mpiexec

# A tiny MLP job: a few seconds; the global batch 48 splits over 1, 2, 3 and 4 ranks.
TINY = ("--max-samples", "288", "--batch-size", "48", "--epochs", "2", "--d-model", "16", "--n-layers", "1",
        "--log-every", "1000")
# A small GPT: ~5-10 s on 2 ranks here, long enough to interrupt.
SMALL_GPT = ("--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--block-size", "32",
             "--batch-size", "16", "--epochs", "3", "--max-samples", "1600", "--checkpoint-every", "25",
             "--log-every", "50")


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.fault
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", [(), ("--strategy", "ps", "--ps-mode", "async")], ids=["dp", "ps-async"])
def test_sigterm_to_the_job_checkpoints_its_step_and_resume_ends_bitwise(serial, tmp_path, strategy):
    """SIGTERM to mpiexec's process group mid-run (what a scheduler sends): exit 75, a checkpoint of the
    step it stopped at; a second job on the locked run directory is refused meanwhile; ``--resume``
    ends bitwise where an uninterrupted run ends, with one metrics line per step.

    The asynchronous parameter server's workers step at their own pace and agree on the stop step
    through its clock window; its resume starts from that checkpoint but does not retrace an
    uninterrupted run bitwise (the workers' pushes interleave as they happen to): for it the resumed
    run must end with every step once, and no reference run is made."""
    exact = not strategy
    # Long enough (dp: ~1,100 steps, a few seconds on a quiet machine) to still be training after
    # the two refused jobs below have started; at 171 steps a quick machine finished first.
    args = (*SMALL_GPT, *strategy, *(("--epochs", "20") if exact else ()))
    if exact:
        ref = hpctrain("train", *args, "--run-dir", str(tmp_path / "ref"), n=2)
        assert ref.returncode == 0, ref.stdout + ref.stderr
        want = json.loads((tmp_path / "ref" / "summary.json").read_text())

    run = tmp_path / "run"
    job = subprocess.Popen([_mpiexec(), "-n", "2", sys.executable, "-m", "hpctrain", "train", *args,
                            "--run-dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None and not (
                (run / "metrics.jsonl").exists() and len(_steps(run)) >= 3):
            time.sleep(0.1)
        if exact:  # the run directory lock is the job's, whatever the strategy: checked once
            # The run directory is locked while the job uses it: a second job is refused, naming the first.
            second = hpctrain("train", *TINY, "--run-dir", str(run), "--resume")
            assert second.returncode == ExitStatus.CONFIG, second.stdout + second.stderr
            assert f"run directory {run} is in use by another job" in second.stderr, second.stderr
            # ... and so is its checkpoint directory, for a job with a run directory of its own (with
            # --resume it would otherwise load the running job's weights and write among its files).
            third = hpctrain("train", *TINY, "--run-dir", str(tmp_path / "other"), "--checkpoint-dir",
                             str(run / "checkpoints"), "--resume")
            assert third.returncode == ExitStatus.CONFIG, third.stdout + third.stderr
            assert f"checkpoint directory {run / 'checkpoints'} is in use by another job" in third.stderr
        while time.monotonic() < deadline and job.poll() is None and len(_steps(run)) < 20:
            time.sleep(0.05)
        assert job.poll() is None, "the job ended before it could be interrupted"
        os.killpg(job.pid, signal.SIGTERM)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == ExitStatus.PREEMPTED, out + err
    m = re.search(r"preempted on SIGTERM: stopped at step (\d+); checkpoint (\S+?);", out)
    assert m, out + err
    step, path = int(m.group(1)), m.group(2)
    assert path == checkpoint.checkpoint_path(str(run / "checkpoints"), step)
    assert Path(path).exists() and "all checksums verified" in checkpoint.inspect(path)
    assert not (run / ".hpctrain.lock").exists()  # released on the way out

    # The command the job printed, run as printed (issue 37: it once said "resubmit with --resume",
    # and --run-dir RUN --resume alone was refused: the run's settings were not read back).
    said = re.search(r"; to continue: (.*)$", out, flags=re.M).group(1)
    assert said == f"mpiexec -n 2 hpctrain train --run-dir {run} --resume", said
    resumed = _as_printed(said)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {path} at step {step}" in resumed.stdout
    got = json.loads((run / "summary.json").read_text())
    assert 20 <= step < got["steps"]
    assert _steps(run) == list(range(1, got["steps"] + 1))  # no step twice after the resume
    if not exact:
        return
    assert (got["steps"], got["final_loss"], got["val_loss"]) == (want["steps"], want["final_loss"], want["val_loss"])
    with h5py.File(got["checkpoint"], "r") as a, h5py.File(want["checkpoint"], "r") as b:
        for name in b["model"]:
            assert np.array_equal(a["model"][name][()], b["model"][name][()]), name  # bitwise


def _as_printed(command: str) -> subprocess.CompletedProcess:
    """A command hpctrain printed, run as printed (this venv's mpiexec and ``python -m hpctrain``)."""
    import shlex

    words = shlex.split(command)
    hpc = words.index("hpctrain")
    launch = [_mpiexec(), *words[1:hpc]] if words[0] == "mpiexec" else []
    return subprocess.run([*launch, sys.executable, "-m", "hpctrain", *words[hpc + 1:]], capture_output=True,
                          text=True, timeout=300, env=_env())


# -- in process, every world size -------------------------------------------------------------------


def _shared(comm, path: Path) -> Path:
    return Path(comm.bcast_obj(str(path) if comm.rank == 0 else None))


def _train(capsys, *args: str) -> tuple[int, str, str]:
    """``hpctrain train TINY ARGS`` in this process: (status, rank 0's stdout, rank 0's stderr) on every
    rank (messages said once are said by rank 0)."""
    from hpctrain import Communicator
    from hpctrain.cli import main

    rc = main(["train", *TINY, *args])
    cap = capsys.readouterr()
    out, err = Communicator().bcast_obj((cap.out, cap.err))
    return rc, out, err


@pytest.mark.timeout(120)
def test_resume_into_a_missing_or_empty_directory_says_it_starts_fresh(comm, tmp_path, capsys):
    run = _shared(comm, tmp_path / "new")
    rc, out, _ = _train(capsys, "--run-dir", str(run), "--resume")
    assert rc == 0
    if comm.rank == 0:
        # The job made its checkpoint directory when it locked it: there, but empty.
        assert f"no checkpoint to resume from ({run / 'checkpoints'} is empty): starting fresh" in out


@pytest.mark.timeout(120)
def test_incompatible_resume_is_refused_and_leaves_the_run_untouched(comm, tmp_path, capsys):
    run = _shared(comm, tmp_path / "run")
    assert _train(capsys, "--run-dir", str(run))[0] == 0
    before = _files(run) if comm.rank == 0 else None
    rc, _, err = _train(capsys, "--run-dir", str(run), "--resume", "--d-model", "32")
    assert rc == ExitStatus.CONFIG
    assert "the run in" in err and "d_model=16, not 32" in err and "nothing was changed" in err, err
    if comm.rank == 0:
        assert _files(run) == before  # config.json, checkpoints, metrics: byte for byte
    # Without --resume the same directory is refused too (it holds checkpoints).
    rc, _, err = _train(capsys, "--run-dir", str(run), "--d-model", "32")
    assert rc == ExitStatus.CONFIG and "already holds checkpoints" in err and "--restart" in err
    if comm.rank == 0:
        assert _files(run) == before


@pytest.mark.timeout(120)
def test_resume_refuses_when_no_checkpoint_loads_and_restart_starts_over(comm, tmp_path, capsys):
    run = _shared(comm, tmp_path / "run")
    assert _train(capsys, "--run-dir", str(run), "--checkpoint-every", "3")[0] == 0
    found = checkpoint.list_checkpoints(str(run / "checkpoints"))
    assert len(found) >= 2
    comm.barrier()
    if comm.rank == 0:
        for p in found:  # every checkpoint truncated: nothing can load
            with open(p, "r+b") as f:
                f.truncate(os.path.getsize(p) // 2)
    comm.barrier()
    before = _files(run) if comm.rank == 0 else None
    rc, out, err = _train(capsys, "--run-dir", str(run), "--resume", "--checkpoint-every", "3")
    assert rc == ExitStatus.CONFIG, out + err
    for p in found:
        assert os.path.basename(p) in err, err  # each file named, with why
    assert "--restart" in err
    if comm.rank == 0:
        assert _files(run) == before
    rc, out, err = _train(capsys, "--run-dir", str(run), "--restart", "--checkpoint-every", "3")
    assert rc == 0, err
    if comm.rank == 0:
        aside = [p for p in run.iterdir() if p.name.startswith("checkpoints.replaced-")]
        assert len(aside) == 1 and [os.path.basename(p) for p in checkpoint.list_checkpoints(str(aside[0]))] == [
            os.path.basename(p) for p in found]
        assert "started over" in out and str(aside[0]) in out
        # The checkpoint directory's lock went aside with it and was dropped there, the new one released.
        assert not (aside[0] / ".hpctrain.lock").exists() and not (run / "checkpoints" / ".hpctrain.lock").exists()
        # The trace went aside too: the run started over does not continue the old one.
        assert [p.name.startswith("trace.json.replaced-") for p in run.iterdir()].count(True) == 1


@pytest.mark.timeout(120)
def test_bad_newest_checkpoint_falls_back_to_the_previous_one_announced(comm, tmp_path, capsys):
    run = _shared(comm, tmp_path / "exp[1]")  # glob characters: a name, not a pattern
    assert _train(capsys, "--run-dir", str(run), "--checkpoint-every", "3", "--epochs", "1")[0] == 0
    found = checkpoint.list_checkpoints(str(run / "checkpoints"))
    comm.barrier()
    if comm.rank == 0:
        with open(found[-1], "r+b") as f:
            f.truncate(100)
    comm.barrier()
    rc, out, err = _train(capsys, "--run-dir", str(run), "--checkpoint-every", "3", "--resume")
    assert rc == 0, err
    if comm.rank == 0:
        assert f"skipping checkpoint {found[-1]}" in out and f"fell back to checkpoint {found[-2]}" in out, out
        assert f"resumed from {found[-2]}" in out
        steps = _steps(run)
        assert steps == sorted(set(steps)) and steps[-1] == json.loads((run / "summary.json").read_text())["steps"]


@pytest.mark.timeout(120)
def test_after_a_fallback_the_run_evaluates_and_reports_its_own_checkpoint(comm, tmp_path, capsys):
    """A damaged (or foreign) file newer than anything the run writes: the resume skips it, and the
    final evaluation, summary.json and ``generate`` use the checkpoint this run wrote, not it."""
    run = _shared(comm, tmp_path / "run")
    assert _train(capsys, "--run-dir", str(run), "--epochs", "1")[0] == 0
    comm.barrier()
    bad = run / "checkpoints" / "ckpt-99999999.h5"
    if comm.rank == 0:
        bad.write_bytes(b"not a checkpoint")
    comm.barrier()
    rc, out, err = _train(capsys, "--run-dir", str(run), "--resume")
    assert rc == 0, out + err
    summary = json.loads((run / "summary.json").read_text())
    own = checkpoint.checkpoint_path(str(run / "checkpoints"), summary["steps"])
    assert summary["checkpoint"] == own and summary["steps_this_run"] > 0
    assert f"checkpoint      {own}" in out
    assert bad.exists()  # skipped, never deleted
    # The finished run resumed once more: nothing to train, it evaluates and reports the one it loaded.
    comm.barrier()
    rc, out, err = _train(capsys, "--run-dir", str(run), "--resume")
    assert rc == 0, out + err
    again = json.loads((run / "summary.json").read_text())
    assert again["checkpoint"] == own and again["steps_this_run"] == 0 and again["val_loss"] == summary["val_loss"]


@pytest.mark.timeout(120)
def test_async_keep_1_holds_one_committed_checkpoint_at_every_moment_and_across_resumes(comm, tmp_path, capsys):
    """--async-checkpoint --keep 1 with all ranks writing: from the first commit on there is always a
    committed checkpoint (rank 0 watches), the end leaves exactly one, and so does a resumed job."""
    import threading

    run = _shared(comm, tmp_path / "run")
    ck, seen, done = run / "checkpoints", [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(len(checkpoint.list_checkpoints(str(ck))))
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch) if comm.rank == 0 else None
    for extra in ((), ("--resume", "--epochs", "3")):
        if watcher is not None and not extra:
            watcher.start()
        rc, _, err = _train(capsys, "--run-dir", str(run), "--async-checkpoint", "--keep", "1",
                            "--checkpoint-every", "1", *extra)
        assert rc == 0, err
        steps = json.loads((run / "summary.json").read_text())["steps"]
        if comm.rank == 0:
            assert checkpoint.list_checkpoints(str(ck)) == [checkpoint.checkpoint_path(str(ck), steps)]
            assert len([n for n in os.listdir(ck) if n.endswith(".parts")]) == 1
        comm.barrier()
    if watcher is not None:
        done.set()
        watcher.join()
        first = next(i for i, n in enumerate(seen) if n)
        assert 0 not in seen[first:], "a moment with no committed checkpoint on disk"


@pytest.mark.timeout(120)
def test_config_json_is_accepted_back_by_config(comm, tmp_path, capsys):
    run = _shared(comm, tmp_path / "a")
    assert _train(capsys, "--run-dir", str(run), "--seed", "3")[0] == 0
    from hpctrain.cli import main

    assert main(["train", "--config", str(run / "config.json"), "--run-dir", str(run.parent / "b")]) == 0
    capsys.readouterr()
    comm.barrier()
    if comm.rank == 0:  # rank 0 writes the summaries
        a, b = (json.loads((run.parent / d / "summary.json").read_text()) for d in ("a", "b"))
        assert a["final_loss"] == b["final_loss"] and a["steps"] == b["steps"]


@pytest.mark.timeout(120)
def test_a_live_lock_refuses_the_job_and_a_dead_ones_is_taken_over(comm, tmp_path, capsys):
    run = _shared(comm, tmp_path / "run")
    sleeper = None
    if comm.rank == 0:
        run.mkdir()
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        from hpctrain.files import rundir

        (run / ".hpctrain.lock").write_text(json.dumps({**rundir.owner_record(), "pid": sleeper.pid, "job": None,
                                                         "started": rundir._start_time(sleeper.pid)}))
    comm.barrier()
    try:
        rc, _, err = _train(capsys, "--run-dir", str(run))
        assert rc == ExitStatus.CONFIG and "is in use by another job" in err and "pid" in err, err
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
    comm.barrier()
    rc, out, err = _train(capsys, "--run-dir", str(run))
    assert rc == 0, err
    if comm.rank == 0:
        assert "taking over the lock" in out and not (run / ".hpctrain.lock").exists()


@pytest.mark.timeout(120)
def test_a_checkpoint_directory_another_job_holds_is_refused_on_every_rank(comm, tmp_path, capsys):
    """Two jobs, one --checkpoint-dir: the second is refused at the start, naming the first, and
    leaves no lock behind; once the first is gone it runs."""
    shared = _shared(comm, tmp_path)
    ck, holder = shared / "ck", None
    if comm.rank == 0:  # another job: a process that took the directory's lock as a job does
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hpctrain.files.rundir import RunLock; "
                                   "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)",
                                   str(ck)], stdout=subprocess.PIPE, text=True, env=_env())
        assert holder.stdout.readline().strip() == "held"
    comm.barrier()
    try:
        rc, _, err = _train(capsys, "--run-dir", str(shared / "b"), "--checkpoint-dir", str(ck))
        assert rc == ExitStatus.CONFIG, err
        pid = comm.bcast_obj(holder.pid if holder else None)
        assert f"checkpoint directory {ck} is in use by another job" in err and f"pid {pid}" in err, err
        assert "--checkpoint-dir" in err
        if comm.rank == 0:
            assert not (shared / "b" / ".hpctrain.lock").exists()  # the run directory's lock let go too
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    comm.barrier()
    rc, _, err = _train(capsys, "--run-dir", str(shared / "b"), "--checkpoint-dir", str(ck))
    assert rc == 0, err
    if comm.rank == 0:
        assert checkpoint.list_checkpoints(str(ck)) and not (ck / ".hpctrain.lock").exists()


def test_default_run_directories_of_one_second_differ(comm, tmp_path, capsys, monkeypatch):
    if comm.size > 1:
        pytest.skip("chdir per process: serial pass")
    monkeypatch.chdir(tmp_path)
    import hpctrain.files.rundir as rundir

    monkeypatch.setattr(rundir.time, "strftime", lambda fmt, *a: "20260101-000000")
    assert _train(capsys)[0] == 0 and _train(capsys)[0] == 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["20260101-000000", "20260101-000000-2"]


# -- exit statuses, python -m hpctrain, tools without MPI ------------------------------------------


def test_exit_statuses_are_documented():
    text = (REPO / "docs" / "reference" / "command-line.md").read_text()
    table = dict(re.findall(r"^\| (\d+) \| (\w+)", text, flags=re.M))
    assert {int(k): v for k, v in table.items()} == {
        0: "done", 1: "failure", 2: "usage", 3: "stall", 4: "refused", 5: "unsaved", 75: "preempted",
        130: "interrupted"}
    assert sorted(int(s) for s in ExitStatus) == sorted(int(k) for k in table)


@pytest.mark.timeout(120)
def test_config_problems_exit_4(serial, tmp_path):
    p = hpctrain("train", "--config", str(tmp_path / "missing.toml"))
    assert p.returncode == ExitStatus.CONFIG and "does not exist" in p.stderr
    p = hpctrain("train", "--resume", "--restart", "--run-dir", str(tmp_path))
    assert p.returncode == ExitStatus.CONFIG and "give one of them" in p.stderr


# -- a resume continues the run as it was configured (issue 37) ------------------------------------------


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``hpctrain ARGS`` in this process, as ``_train`` but with no settings added."""
    from hpctrain import Communicator
    from hpctrain.cli import main

    rc = main(list(args))
    cap = capsys.readouterr()
    out, err = Communicator().bcast_obj((cap.out, cap.err))
    return rc, out, err


def _said(comm, run: Path) -> dict:
    return comm.bcast_obj(json.loads((run / "config.json").read_text()) if comm.rank == 0 else None)


@pytest.mark.timeout(180)
def test_resume_starts_from_the_runs_config_and_what_it_changes_stays(comm, tmp_path, capsys):
    run = _shared(comm, tmp_path / "run")
    first = _cli(capsys, "train", *TINY, "--d-model", "24", "--lr", "0.004", "--epochs", "1", "--run-dir", str(run))
    assert first[0] == 0, first
    # Only the run directory, --resume and what changes: the rest (a d_model, an lr the defaults do
    # not have) comes from the run's config.json. It was refused before (d_model=24, not 64).
    rc, out, err = _cli(capsys, "train", "--run-dir", str(run), "--resume", "--epochs", "2", "--lr", "0.001")
    assert rc == 0, out + err
    if comm.rank == 0:
        assert (f"resuming the run in {run} as its config.json says; this job changes --epochs 1 -> 2, "
                "--lr 0.004 -> 0.001 (kept for the next resume)") in out, out
        assert "1 of 2 epochs done (epochs count the whole run, resumes included)" in out, out
    said = _said(comm, run)
    assert (said["d_model"], said["lr"], said["epochs"]) == (24, 0.001, 2)
    # The next resume keeps the lr the last one set (it once went back to the run's first lr).
    rc, out, err = _cli(capsys, "train", "--run-dir", str(run), "--resume", "--epochs", "3")
    assert rc == 0, out + err
    if comm.rank == 0:
        assert "this job changes --epochs 2 -> 3 (kept" in out and "--lr" not in out.split("resuming")[1].split("\n")[0]
        lrs = {round(json.loads(line)["lr"], 9) for line in (run / "metrics.jsonl").read_text().splitlines()[-3:]}
        assert lrs == {0.001}, lrs
    assert _said(comm, run)["lr"] == 0.001
    rc, out, _ = _cli(capsys, "train", "--run-dir", str(run), "--resume")
    assert rc == 0 and (comm.rank != 0 or "(no setting changed)" in out and "nothing left to train" in out), out
    if comm.size % 2 == 0:  # the layout is this launch's: what the run derived (strategy dp) is derived again
        rc, out, err = _cli(capsys, "train", "--run-dir", str(run), "--resume", "--epochs", "4", "--tp", "2")
        assert rc == 0, out + err
        assert _said(comm, run)["strategy"] == "hybrid"


@pytest.mark.timeout(180)
def test_refusals_that_suggest_a_command_print_one_that_works(comm, tmp_path, capsys):
    run = _shared(comm, tmp_path / "run")
    assert _cli(capsys, "train", *TINY, "--d-model", "24", "--epochs", "1", "--run-dir", str(run))[0] == 0
    for refused in (("train", *TINY, "--run-dir", str(run)),  # checkpoints there, no --resume
                    ("train", *TINY, "--run-dir", str(run), "--resume")):  # d_model 16 (TINY), not 24
        rc, _, err = _cli(capsys, *refused)
        assert rc == ExitStatus.CONFIG, err
        command = re.search(r"(hpctrain train --run-dir \S+ --resume)", err).group(1)
        assert command == f"hpctrain train --run-dir {run} --resume", err
        again = _cli(capsys, *command.split()[1:])
        assert again[0] == 0 and (comm.rank != 0 or "resumed from" in again[1]), again
