"""``hpctrain train`` with an MoE GPT whose experts spread over ``--ep`` ranks, as users run it (real
``mpiexec`` jobs): it ends where one process ends, and its checkpoints resume under dp alone and
under one process (the experts resharded from the checkpoint's full tensors).

Dropless (``--moe-capacity 0``), float32 to 1e-5, with the default load-balancing weight: the term
counts each expert's share of the router's choices and its mean probability over the whole batch
(every dp replica's tokens, Megatron's global aux loss), so any layout (dp x ep, a resume under dp
alone or one process) trains and logs one process's term.
Every test starts its own jobs: they run once, in the serial pass (the ``jobs`` marker).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jobs import hpctrain

pytestmark = pytest.mark.jobs

STEPS = 6
MOE = ("--model", "gpt", "--moe-experts", "4", "--moe-top-k", "2", "--d-model", "16", "--n-heads", "2",
       "--n-layers", "2", "--block-size", "16", "--max-samples", "512", "--batch-size", "16",
       "--max-steps", str(STEPS), "--log-every", "1", "--epochs", "1")


def _ok(p) -> str:
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _metrics(run)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n, layout", [(2, ("--ep", "2")), (4, ("--ep", "4")), (4, ("--ep", "2", "--zero", "2"))],
                         ids=["ep2", "ep4", "dp4xep2-zero2"])
def test_an_moe_gpt_over_ep_ends_where_one_process_ends(serial, tmp_path, n, layout):
    one, many = tmp_path / "one", tmp_path / "many"
    _ok(hpctrain("train", *MOE, "--run-dir", str(one)))
    out = _ok(hpctrain("train", *MOE, *layout, "--run-dir", str(many), n=n))
    ep = layout[1]
    assert f"hybrid with dp={n} tp=1 pp=1 ep={ep}" in out, out
    assert "moe: 4 experts, top-2, in every block, dropless" in out and f"{4 // int(ep)} experts per rank" in out
    a, b = _losses(one), _losses(many)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)], rtol=1e-5)
    # The load-balancing term (one process's, whatever the layout) and the busiest expert's share
    # are logged every step.
    np.testing.assert_allclose([r["moe_aux_loss"] for r in _metrics(many)], [r["moe_aux_loss"] for r in _metrics(one)],
                               rtol=1e-5)
    for rec in _metrics(many):
        assert rec["moe_max_share"] >= 1.0 and np.isfinite(rec["moe_aux_loss"])
    summary = json.loads((many / "summary.json").read_text())
    assert summary["layout"] == {"dp": n, "tp": 1, "pp": 1, "ep": int(ep)}
    last = _metrics(many)[-1]
    assert summary["moe"] == {"aux_loss": last["moe_aux_loss"], "max_share": last["moe_max_share"]}
    assert f"busiest {last['moe_max_share']:.2f}x the mean share of tokens" in out, out


@pytest.mark.timeout(300)
def test_an_ep_checkpoint_resumes_under_dp_alone_and_under_one_process(serial, tmp_path):
    """A dp=2 x ep=2 run on 2 ranks stopped at step 3 continues with ``--ep 1`` on 2 ranks and
    with one process and no layout flag (ep=2 does not fit): the experts are resharded from the
    checkpoint and the losses go on as the uninterrupted run's."""
    flags = MOE  # the default load-balancing weight: its term is the batch's under any layout
    ref, first = tmp_path / "ref", tmp_path / "a"
    _ok(hpctrain("train", *flags, "--ep", "2", "--run-dir", str(ref), n=2))
    _ok(hpctrain("train", *flags, "--ep", "2", "--max-steps", "3", "--run-dir", str(first), n=2))
    second = tmp_path / "b"
    shutil.copytree(first, second)
    more = ("--max-steps", str(STEPS))

    out = _ok(hpctrain("train", "--run-dir", str(first), "--resume", "--ep", "1", *more, n=2))
    assert "dp=2 tp=1 pp=1 (the run's layout was dp=2 tp=1 pp=1 ep=2; resharded from the checkpoint)" in out, out
    out = _ok(hpctrain("train", "--run-dir", str(second), "--resume", *more))
    assert "dp with dp=1 tp=1 pp=1 (the run's dp=2 tp=1 pp=1 ep=2 does not fit 1 rank; resharded from the " \
           "checkpoint)" in out, out
    want = _losses(ref)
    for run in (first, second):
        got = _losses(run)
        assert sorted(got) == list(range(1, STEPS + 1))
        np.testing.assert_allclose([got[s] for s in range(4, STEPS + 1)], [want[s] for s in range(4, STEPS + 1)],
                                   rtol=1e-5, err_msg=str(run))
