"""``--precision fp64`` (issue 45, item 3): the float64 check that tells rounding from a bug. A run
at 2 ranks (dp, and two pipeline stages) ends where one process ends to float64 rounding, step by
step, and its checkpoint holds float64 parameters and optimizer state."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpctrain.errors import ConfigError
from hpctrain.job import resolve
from hpctrain.training.precision import Precision
from tests.jobs import hpctrain

# About 200 steps of the built-in classification set, a loss logged at every one.
RUN = ["train", "--model", "mlp", "--epochs", "3", "--max-samples", "1024", "--batch-size", "16", "--d-model", "16",
       "--log-every", "1", "--precision", "fp64"]  # fmt: skip


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]


def _float_dtypes(run_dir: Path) -> dict[str, str]:
    """``{checkpoint entry: dtype}`` of the last checkpoint's parameters and optimizer state."""
    from hpctrain.checkpoint.header import read_header

    last = sorted((run_dir / "checkpoints").glob("ckpt-*.h5"))[-1]
    index = read_header(str(last))["index"]
    return {k: e["dtype"] for k, e in index.items() if k.startswith(("model/", "optim/"))}


@pytest.mark.jobs
def test_fp64_at_two_ranks_ends_where_one_process_ends_step_by_step(tmp_path):
    runs = {"one process": ([], 0), "dp 2": ([], 2), "pp 2": (["--pp", "2"], 2)}
    losses = {}
    for what, (extra, n) in runs.items():
        run_dir = tmp_path / what.replace(" ", "-")
        done = hpctrain(*RUN, *extra, "--run-dir", str(run_dir), n=n, timeout=300)
        assert done.returncode == 0, f"{what}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        losses[what] = _losses(run_dir)
        dtypes = _float_dtypes(run_dir)
        assert any(k.startswith("optim/") for k in dtypes), f"{what}: no optimizer state in the checkpoint"
        assert set(dtypes.values()) == {"float64"}, f"{what}: {dtypes}"
    want = np.array(losses["one process"])
    steps = len(want)
    assert steps >= 100
    for what in ("dp 2", "pp 2"):
        got = np.array(losses[what])
        assert got.shape == want.shape, what
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=what)


def test_the_fp64_policy_casts_the_parameters_and_takes_no_16_bit_reduction():
    from hpctrain import nn

    model = nn.Sequential(nn.Linear(3, 4, rng=0), nn.ReLU(), nn.Linear(4, 2, rng=1))
    p64 = Precision.of("fp64")
    assert not p64.mixed and p64.param == np.float64 and p64.reduce == np.float64
    p64.cast(model.parameters())
    assert {(p.data.dtype, p.grad.dtype) for p in model.parameters()} == {(np.dtype(np.float64),) * 2}
    with pytest.raises(ValueError, match="bf16-mixed or fp16-mixed"):
        Precision("fp64", "bf16")
    with pytest.raises(ConfigError, match="--precision fp64 reduces gradients in float64 .not --compression"):
        resolve({"precision": "fp64", "compression": "fp16"}, 2)
