"""A run directory's own files get the checks checkpoints get (issue 47, item 6): a FIFO, a device
(``/dev/zero``), an oversized or garbage file at ``job.json`` or ``metrics.jsonl`` is refused with
a message naming the file and what is wrong, never opened in a way that blocks or read forever.

The helpers are tested in process; ``hpctrain status`` and a real ``mpiexec -n 2 hpctrain train
--resume`` on such a directory are run as commands, each bounded by a timeout (before the fix both
hung with no output).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from hpctrain.errors import ConfigError, ExitStatus
from hpctrain.files import rundir
from jobs import REPO, clean_env, hpctrain

TINY = ("--max-samples", "256", "--batch-size", "32", "--epochs", "1", "--d-model", "16", "--n-layers", "1",
        "--log-every", "1000")


def _plant(path, kind: str) -> None:
    """Something that is not a file hpctrain wrote at ``path``."""
    if os.path.lexists(path):
        os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    elif kind == "garbage":
        with open(path, "w") as f:
            f.write("this is not JSON {")
    elif kind == "list":
        with open(path, "w") as f:
            f.write("[1, 2, 3]")
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(rundir.MAX_RECORD + 1)  # (sparse: costs no disk)


WHAT = {"fifo": "is a FIFO, not a regular file", "zero": "is a device, not a regular file",
        "garbage": "is not a record hpctrain wrote: not JSON", "list": "holds a JSON list, not an object",
        "huge": f"more than the {rundir.MAX_RECORD:,}"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", sorted(WHAT))
def test_read_record_refuses_what_is_not_a_record_naming_the_file(serial, tmp_path, kind):
    path = tmp_path / "job.json"
    assert rundir.read_record(str(path)) is None  # nothing there: no record, no error
    _plant(path, kind)
    with pytest.raises(ConfigError, match=f"{path}.*{WHAT[kind]}"):
        rundir.read_record(str(path))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_metrics_readers_and_the_appender_refuse_a_fifo_or_device_without_blocking(serial, tmp_path, kind):
    from hpctrain.job import ending

    path = tmp_path / "metrics.jsonl"
    _plant(path, kind)
    for call in (lambda: rundir.open_append(str(path)), lambda: rundir.trim_metrics(str(path), 3),
                 lambda: ending.last_step(str(tmp_path))):
        with pytest.raises(ConfigError, match=f"{path}"):
            call()
    with pytest.raises(ConfigError, match=f"{path} {WHAT[kind]}.*move it away"):
        rundir.check_files(str(tmp_path), {"metrics.jsonl": None, "job.json": rundir.MAX_RECORD})


@pytest.mark.timeout(30)
def test_a_lock_that_is_a_fifo_is_an_unreadable_lock_not_a_hang(serial, tmp_path):
    os.mkfifo(tmp_path / rundir.LOCK_NAME)
    lock = rundir.RunLock(str(tmp_path))
    assert lock.owner() is None
    with pytest.raises(rundir.RunDirBusy, match="unreadable lock"):
        lock.acquire()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run directory of a tiny job that finished (one process)."""
    tmp = tmp_path_factory.mktemp("run_files")
    run = tmp / "run"
    p = hpctrain("train", *TINY, "--run-dir", str(run), cwd=tmp,
                 env=clean_env(HPCTRAIN_DATA=str(tmp / "data")))
    assert p.returncode == 0, p.stderr
    return tmp, run


def _copy(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run[1], run, symlinks=True)
    return run


@pytest.mark.jobs
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name,kind", [("job.json", "fifo"), ("job.json", "zero"), ("metrics.jsonl", "fifo"),
                                       ("metrics.jsonl", "zero")])
def test_status_names_a_planted_fifo_or_device_and_exits_4(serial, finished_run, tmp_path, name, kind):
    run = _copy(finished_run, tmp_path)
    _plant(run / name, kind)
    try:
        p = hpctrain("status", str(run), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hpctrain status hung on a {kind} at {name}")
    assert p.returncode == ExitStatus.CONFIG, (p.stdout, p.stderr)
    assert f"{run / name} {WHAT[kind]}: refused" in p.stderr, p.stderr
    assert f"{run / name} {WHAT[kind]}" in p.stdout, p.stdout  # in its own line of the report too


@pytest.mark.jobs
@pytest.mark.timeout(200)
def test_status_says_a_garbage_job_json_is_garbage_not_missing(serial, finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    _plant(run / "job.json", "garbage")
    p = hpctrain("status", str(run), timeout=60)
    assert p.returncode == ExitStatus.CONFIG, (p.stdout, p.stderr)
    assert "no job.json" not in p.stdout + p.stderr
    assert f"last job        unknown: {run / 'job.json'} is not a record hpctrain wrote: not JSON" in p.stdout
    assert "metrics         step " in p.stdout  # the rest of the report is still there


@pytest.mark.jobs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,kind", [("job.json", "fifo"), ("metrics.jsonl", "zero")])
def test_resume_on_a_planted_fifo_or_device_is_refused_on_every_rank_before_anything(serial, finished_run, tmp_path,
                                                                                    name, kind):
    tmp, _ = finished_run
    run = _copy(finished_run, tmp_path)
    _plant(run / name, kind)
    before = sorted(os.listdir(run))
    try:
        p = hpctrain("train", "--run-dir", str(run), "--resume", "--epochs", "2", n=2, cwd=REPO, timeout=150,
                     env=clean_env(HPCTRAIN_DATA=str(tmp / "data"), HPCTRAIN_TIMEOUT="60"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"hpctrain train --resume hung on a {kind} at {name}")
    assert p.returncode == ExitStatus.CONFIG, (p.stdout, p.stderr)
    said = [line for line in p.stderr.splitlines() if "hpctrain train: error:" in line]
    assert len(said) == 1 and f"{run / name} {WHAT[kind]}: refused" in said[0], p.stderr
    assert "Traceback" not in p.stderr and "step " not in p.stdout, (p.stdout, p.stderr)
    assert sorted(os.listdir(run)) == before  # nothing written, moved or trimmed


@pytest.mark.jobs
@pytest.mark.timeout(300)
def test_resume_over_a_garbage_job_json_says_so_and_replaces_it(serial, finished_run, tmp_path):
    tmp, _ = finished_run
    run = _copy(finished_run, tmp_path)
    _plant(run / "job.json", "garbage")
    p = hpctrain("train", "--run-dir", str(run), "--resume", "--epochs", "2", n=2, cwd=REPO, timeout=150,
                 env=clean_env(HPCTRAIN_DATA=str(tmp / "data"), HPCTRAIN_TIMEOUT="60"))
    assert p.returncode == 0, p.stderr
    assert (f"how the last job in {run} ended is unknown: {run / 'job.json'} is not a record hpctrain wrote: "
            "not JSON") in p.stdout + p.stderr
    assert rundir.read_record(str(run / "job.json"))["state"] == "finished"


@pytest.mark.jobs
@pytest.mark.timeout(300)
def test_resume_with_an_oversized_config_json_is_refused_before_it_is_read(serial, finished_run, tmp_path):
    tmp, _ = finished_run
    run = _copy(finished_run, tmp_path)
    _plant(run / "config.json", "huge")
    p = hpctrain("train", "--run-dir", str(run), "--resume", n=2, cwd=REPO, timeout=150,
                 env=clean_env(HPCTRAIN_DATA=str(tmp / "data"), HPCTRAIN_TIMEOUT="60"))
    assert p.returncode == ExitStatus.CONFIG, (p.stdout, p.stderr)
    said = [line for line in p.stderr.splitlines() if "hpctrain train: error:" in line]
    assert len(said) == 1 and f"config file {run / 'config.json'} has " in said[0] and WHAT["huge"] in said[0], p.stderr


@pytest.mark.jobs
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_plot_refuses_a_metrics_file_that_is_not_a_file(serial, finished_run, tmp_path, kind):
    run = _copy(finished_run, tmp_path)
    _plant(run / "metrics.jsonl", kind)
    try:
        p = hpctrain("plot", str(run), "--out", str(tmp_path / "plots"), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hpctrain plot hung on a {kind} at metrics.jsonl")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert f"hpctrain plot: error: {run / 'metrics.jsonl'} {WHAT[kind]}: refused" in p.stderr, p.stderr
