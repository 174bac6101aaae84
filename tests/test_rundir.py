"""Run directories: the lock, fresh default names, exclusive temporaries, stale-file cleanup."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpctrain.errors import ConfigError
from hpctrain.files import rundir
from hpctrain.files.rundir import LOCK_NAME, RunDirBusy, RunLock


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_lock(d, **owner):
    record = {**rundir.owner_record(), **owner}
    (d / LOCK_NAME).write_text(json.dumps(record))
    return record


def test_second_lock_on_a_live_owner_is_refused_naming_it(tmp_path):
    with RunLock(str(tmp_path)):
        with pytest.raises(RunDirBusy, match=rf"in use by another job \(host .*, pid {os.getpid()}, since"):
            RunLock(str(tmp_path)).acquire()
        assert isinstance(RunDirBusy("x"), ConfigError)
    assert not (tmp_path / LOCK_NAME).exists()  # released


def test_lock_of_another_live_process_is_refused(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _write_lock(tmp_path, pid=sleeper.pid, started=rundir._start_time(sleeper.pid), job=None)
        with pytest.raises(RunDirBusy, match=f"pid {sleeper.pid}"):
            RunLock(str(tmp_path)).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    lock = RunLock(str(tmp_path)).acquire()  # now its owner is dead: taken over
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_stale_locks_are_taken_over(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _write_lock(tmp_path, pid=_dead_pid(), job=None)
    with caplog.at_level("WARNING", logger="hpctrain"), RunLock(str(tmp_path)):
        pass
    assert "is no longer running" in caplog.text
    # A pid reused by an unrelated process (another start time) does not hold the lock either.
    _write_lock(tmp_path, pid=os.getppid(), started="1", job=None)
    RunLock(str(tmp_path)).acquire().release()
    # A requeued Slurm job finds its own lock (same job id, maybe written on another node).
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _write_lock(tmp_path, host="node-that-died", pid=1, job="4242")
    with caplog.at_level("WARNING", logger="hpctrain"), RunLock(str(tmp_path)):
        pass
    assert "this Slurm job's own lock" in caplog.text


def test_lock_of_a_job_on_another_host_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _write_lock(tmp_path, host="elsewhere", pid=_dead_pid(), job="77")
    with pytest.raises(RunDirBusy, match=f"Slurm job 77, host elsewhere.*delete {tmp_path / LOCK_NAME}"):
        RunLock(str(tmp_path)).acquire()


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock = RunLock(str(tmp_path)).acquire()
    other = _write_lock(tmp_path, pid=1, host="elsewhere")
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text()) == other


def test_new_run_dirs_of_the_same_second_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt, *a: "20260101-000000")
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    made = [rundir.new_run_dir(str(tmp_path / "runs")) for _ in range(3)]
    assert [os.path.basename(p) for p in made] == ["20260101-000000-job12", "20260101-000000-job12-2",
                                                   "20260101-000000-job12-3"]
    assert all(os.path.isdir(p) and not os.listdir(p) for p in made)


def test_write_exclusive_replaces_a_symlink_instead_of_following_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's data")
    (tmp_path / "config.json").symlink_to(victim)
    # A symlink planted at this process's temporary name is not written through either.
    os.symlink(victim, rundir.temporary_name(str(tmp_path / "summary.json")))
    rundir.write_exclusive(str(tmp_path / "config.json"), "{}")
    rundir.write_exclusive(str(tmp_path / "summary.json"), "{}")
    assert victim.read_text() == "someone's data"
    assert not (tmp_path / "config.json").is_symlink() and (tmp_path / "config.json").read_text() == "{}"
    assert (tmp_path / "summary.json").read_text() == "{}"


def test_open_append_refuses_a_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("x")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError, match="metrics.jsonl cannot be opened .it is a symbolic link"):
        rundir.open_append(str(tmp_path / "metrics.jsonl"))
    assert victim.read_text() == "x"


def test_clean_stale_temporaries(tmp_path):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    stale = [ck / "ckpt-00000004.h5.tmp.1234", tmp_path / "config.json.tmp.host.99"]
    for p in stale:
        p.write_text("half")
    (ck / "ckpt-00000002.h5").write_text("complete")
    (tmp_path / "link.tmp.1").symlink_to(ck / "ckpt-00000002.h5")
    removed = rundir.clean_stale_temporaries(str(tmp_path), str(ck), str(tmp_path / "missing"))
    assert sorted(removed) == sorted(str(p) for p in stale)
    assert (ck / "ckpt-00000002.h5").exists() and (tmp_path / "link.tmp.1").is_symlink()


def test_resume_with_another_model_is_refused_naming_the_difference(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model": "mlp", "d_model": 64, "epochs": 3}))
    rundir.check_resume_compatible(str(cfg), {"model": "mlp", "d_model": 64, "epochs": 6}, ("model", "d_model"))
    with pytest.raises(ConfigError, match=r"made with d_model=64, not 32.*nothing was changed"):
        rundir.check_resume_compatible(str(cfg), {"model": "mlp", "d_model": 32}, ("model", "d_model"))
    rundir.check_resume_compatible(str(tmp_path / "none.json"), {}, ("model",))  # a fresh directory


def test_set_aside_renames_and_never_overwrites(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt, *a: "T")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "metrics.jsonl").write_text("1")
    moved = rundir.set_aside(str(tmp_path / "checkpoints"), str(tmp_path / "metrics.jsonl"), str(tmp_path / "x"))
    assert [os.path.basename(b) for _, b in moved] == ["checkpoints.replaced-T", "metrics.jsonl.replaced-T"]
    (tmp_path / "metrics.jsonl").write_text("2")
    assert os.path.basename(rundir.set_aside(str(tmp_path / "metrics.jsonl"))[0][1]) == "metrics.jsonl.replaced-T-2"
    assert (tmp_path / "metrics.jsonl.replaced-T").read_text() == "1"


def test_trim_metrics_drops_steps_after_the_checkpoint_in_place(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 9)) + '{"step": 9, "lo')
    with rundir.open_append(str(path)) as appending:  # the logger's handle, opened before the trim
        assert rundir.trim_metrics(str(path), 5) == 4
        appending.write(json.dumps({"step": 6}) + "\n")
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert rundir.trim_metrics(str(tmp_path / "missing.jsonl"), 1) == 0
