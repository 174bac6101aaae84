"""What ``hpctrain train`` reports while and after it runs: the progress lines under mpiexec
(step N/total, an ETA), the one-process bar's length under ``--max-steps``, the announced final
evaluation, and the summary's figures checked against the per-step records of ``metrics.jsonl``."""

from __future__ import annotations

import json
import re
import sys

import pytest

from hpctrain.job import run
from jobs import hpctrain

# 6 steps an epoch (288 samples, global batch 48), stopped at 57 steps: more than the final
# loss's window of 50, in the 10th epoch.
JOB = ("--max-samples", "288", "--batch-size", "48", "--epochs", "12", "--max-steps", "57", "--d-model", "16",
       "--n-layers", "1", "--log-every", "10")


def test_progress_and_summary_under_mpiexec(serial, tmp_path):
    p = hpctrain("train", *JOB, "--run-dir", str(tmp_path / "r"), n=2)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    steps = [re.match(r"epoch \d+ step (\d+)/57 \| eta \d+ s \| loss ", x) for x in lines]
    assert [int(m.group(1)) for m in steps if m] == [10, 20, 30, 40, 50], p.stdout
    evaluating = [i for i, x in enumerate(lines) if re.fullmatch(r"evaluating .*ckpt-00000057\.h5 on [\d,]+ "
                                                                 r"held-out samples", x)]
    assert evaluating and evaluating[0] < next(i for i, x in enumerate(lines) if x.startswith("done:")), p.stdout

    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    recs = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 57
    after_first = recs[1:]  # the first step (a warm-up) is left out of the rates
    seconds = sum(r["seconds"] for r in after_first)
    assert s["samples_per_s"] == pytest.approx(sum(r["samples"] for r in after_first) / seconds, rel=1e-12)
    assert s["comm_share"] == pytest.approx(sum(r["comm_seconds"] for r in after_first) / seconds, rel=1e-12)
    # The final loss is the last 50 steps' mean, not the last epoch's (3 steps) nor the run's.
    assert s["final_loss"] == pytest.approx(sum(r["loss"] for r in recs[-50:]) / 50, rel=1e-12)
    assert s["final_loss_steps"] == 50
    assert f"final loss      {s['final_loss']:.4f} (training, mean of the last 50 steps)" in p.stdout


def test_one_process_bar_counts_to_max_steps(serial, comm, tmp_path, capsys, monkeypatch):
    # A terminal gets the tqdm bar: its total is where --max-steps stops (3), not the epochs' 8 steps.
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    run({"max_samples": 128, "batch_size": 32, "epochs": 2, "d_model": 16, "max_steps": 3,
         "run_dir": str(tmp_path / "r")}, comm)
    err = capsys.readouterr().err
    assert re.search(r"\b3/3\b", err) and "/8" not in err, err
