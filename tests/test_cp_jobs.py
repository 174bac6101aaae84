"""``hpctrain train --cp N`` as users run it (real ``mpiexec`` jobs; the ``jobs`` marker): each
layout with context parallelism ends where one process ends (float32, 1e-5), a checkpoint written
under ``--cp 2`` resumes under dp alone and under one process (and one written without cp resumes
under ``--cp 2``) and ends where the uninterrupted run ends, and what the job says of its layout
(header, closing line, ``--dry-run``, ``summary.json``) and of a layout it refuses (one line, every
rank, before any step)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hpctrain.errors import ExitStatus
from jobs import REPO, clean_env, hpctrain

pytestmark = pytest.mark.jobs

# A tiny GPT: 16 steps of a global batch of 16 windows of 16 tokens (the batch splits over 1, 2, 4
# replicas; the block into 2 x cp chunks for cp = 2 and 4; 4 heads split over tp x cp = 4).
GPT = ("--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2", "--block-size", "16",
       "--max-samples", "256", "--batch-size", "16", "--epochs", "1", "--log-every", "4", "--microbatches", "2")
STEPS = 16


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _ok(p) -> str:
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def _ends_alike(run: Path, ref: Path) -> None:
    """Every step once with the reference's loss, and the same validation loss of the final
    weights (float32 under other splits of the same sums: equal to rounding, not bitwise). The
    weights themselves are not compared: a gradient that is zero in exact arithmetic (the key
    projection's bias: softmax ignores a shift of every score) is rounding noise, which AdamW
    turns into steps of about its learning rate under any two layouts."""
    got, want = _losses(run), _losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), run
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-5, err_msg=str(run))
    mine, theirs = (json.loads((r / "summary.json").read_text()) for r in (run, ref))
    np.testing.assert_allclose(mine["val_loss"], theirs["val_loss"], rtol=1e-5, err_msg=str(run))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """The environment of every job: the built-in data written once."""
    return clean_env(HPCTRAIN_DATA=str(tmp_path_factory.mktemp("cp-data")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    """The uninterrupted one-process run every cp job must end like."""
    run = tmp_path_factory.mktemp("cp-reference") / "run"
    _ok(hpctrain("train", *GPT, "--run-dir", str(run), env=data))
    return run


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n, layout", [
    (2, ("--cp", "2")),
    (4, ("--cp", "4")),
    (4, ("--cp", "4", "--cp-mode", "ulysses")),
    (4, ("--cp", "2", "--tp", "2")),
    (4, ("--cp", "2", "--pp", "2")),
    (4, ("--cp", "2", "--zero", "3")),  # dp=2 x cp=2: ZeRO shards over the four replicas
], ids=lambda v: v if isinstance(v, int) else "".join(v).replace("--", "-"))
def test_a_cp_job_ends_where_one_process_ends(serial, tmp_path, data, reference, n, layout):
    run = tmp_path / "run"
    out = _ok(hpctrain("train", *GPT, *layout, "--run-dir", str(run), n=n, env=data))
    summary = json.loads((run / "summary.json").read_text())
    cp = int(layout[1])
    lay = summary["layout"]
    assert lay["cp"] == cp and lay["dp"] * lay["tp"] * lay["pp"] * cp == n
    assert lay["cp_mode"] == ("ulysses" if "ulysses" in layout else "ring")
    assert f"hybrid with dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} cp={cp}" in out, out
    _ends_alike(run, reference)


@pytest.mark.timeout(300)
def test_a_cp_checkpoint_resumes_under_dp_and_one_process_and_a_dp_one_under_cp(serial, tmp_path, data, reference):
    """Context parallelism shards no parameter: a checkpoint written under ``--cp 2`` (stopped at
    step 6) resumes under ``--strategy dp`` on 2 ranks and on one process with no flag; one written
    by dp on 2 ranks resumes under ``--cp 2``; each run ends where the uninterrupted one ends."""
    first = tmp_path / "cp"
    _ok(hpctrain("train", *GPT, "--cp", "2", "--max-steps", "6", "--run-dir", str(first), n=2, env=data))
    second = tmp_path / "cp-to-one"
    shutil.copytree(first, second)
    more = ("--max-steps", str(STEPS))
    out = _ok(hpctrain("train", "--run-dir", str(first), "--resume", "--strategy", "dp", *more, n=2, env=data))
    assert ("dp with dp=2 tp=1 pp=1 (the run's dp=1 tp=1 pp=1 cp=2 does not go with this job's --strategy dp; "
            "resharded from the checkpoint)") in out, out
    out = _ok(hpctrain("train", "--run-dir", str(second), "--resume", *more, env=data))
    assert "dp with dp=1 tp=1 pp=1 (the run's dp=1 tp=1 pp=1 cp=2 does not fit 1 rank; resharded" in out, out
    back = tmp_path / "dp-to-cp"
    _ok(hpctrain("train", *GPT, "--max-steps", "6", "--run-dir", str(back), n=2, env=data))
    out = _ok(hpctrain("train", "--run-dir", str(back), "--resume", "--cp", "2", *more, n=2, env=data))
    assert "hybrid with dp=1 tp=1 pp=1 cp=2 (the run's layout was dp=2 tp=1 pp=1; resharded from the checkpoint)" \
        in out, out
    for run in (first, second, back):
        _ends_alike(run, reference)


@pytest.mark.timeout(180)
def test_the_dry_run_says_the_cp_layout_and_a_refusal_is_one_line_on_every_rank(serial, tmp_path, data):
    out = _ok(hpctrain("train", *GPT, "--cp", "2", "--cp-mode", "ulysses", "--dry-run", "--run-dir",
                       str(tmp_path / "dry"), n=2, env=data))
    assert "hybrid with dp=1 tp=1 pp=1 cp=2 ulysses" in out and "dry run:" in out, out
    assert not (tmp_path / "dry").exists()
    p = hpctrain("train", *GPT, "--cp", "2", "--block-size", "18", "--run-dir", str(tmp_path / "bad"), n=2, env=data)
    assert p.returncode == 4, p.stdout + p.stderr
    said = [line for line in p.stderr.splitlines() if "error" in line]
    assert said == ["[rank 0] hpctrain train: error: ranks 0-1: --block-size 18 does not split into 2 x --cp 2 = 4 "
                    "chunks (the zigzag split that balances the causal mask): use a multiple of 4"], p.stderr  # once
    assert not (tmp_path / "bad").exists()
    # A model of the user's without attention: refused when it is built, before any step.
    p = hpctrain("train", "--model", "examples/custom_model.py:build", "--cp", "2", "--max-samples", "64",
                 "--run-dir", str(tmp_path / "mine"), n=2, env=data, cwd=REPO)
    assert p.returncode == ExitStatus.CONFIG, p.stdout + p.stderr
    assert "--cp 2: --model examples/custom_model.py:build has no attention layer" in p.stderr, p.stderr
    assert "step 1" not in p.stdout, p.stdout
