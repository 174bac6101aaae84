"""Using the trained model (issue 45, item 10): ``hpctrain.load_model(run)`` rebuilds a run's model
(built-in or the user's factory) with its trained weights, whatever layout trained it, and
``hpctrain.checkpoint.load_weights`` takes a run directory as ``--resume`` does."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from ckpt_tools import flip

import hpctrain as ht
from hpctrain import errors
from hpctrain.job import merge, run

HERE = os.path.dirname(os.path.abspath(__file__))
USER = os.path.join(os.path.dirname(HERE), "examples", "custom_model.py") + ":build"
SMALL = {"max_samples": 128, "batch_size": 32, "epochs": 1, "d_model": 16, "log_every": 1000}


def predict(model, x) -> np.ndarray:
    """What docs/how-to/trained-model.md does: the model on a tensor, without a graph."""
    with ht.autograd.no_grad():
        return model(ht.autograd.Tensor(x)).data


class EndOfTraining:
    """``fit`` callback: the model's predictions on ``x`` with the trainer's weights after its last
    step, gathered from any layout into a serial copy (collective), not through a checkpoint."""

    def __init__(self, c) -> None:
        from hpctrain.job.inputs import open_data

        _, val, self.meta = open_data(c)
        self.c, self.x, self.predictions = c, val[np.arange(len(val))][0], None

    def on_fit_end(self, trainer) -> None:
        from hpctrain.job.builders import build_model
        from hpctrain.job.callbacks import load_full_weights

        model = build_model(self.c, self.meta)
        load_full_weights(trainer, model)
        model.eval()
        self.predictions = predict(model, self.x)


LAYOUTS = [
    ("tp2-pp2", {"model": "mlp", "strategy": "hybrid", "tp": 2, "pp": 2}, 4),
    ("pp2-cnn", {"model": "cnn", "n_layers": 2, "d_model": 4, "strategy": "hybrid", "pp": 2}, 2),
    ("tp2", {"model": "mlp", "strategy": "hybrid", "tp": 2}, 2),
    ("zero3", {"model": "mlp", "zero": 3}, 2),
    ("user-pp2", {"model": USER, "strategy": "hybrid", "pp": 2}, 2),
]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, extra, ranks", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_load_model_predicts_as_the_model_at_the_end_of_training(comm, shared_dir, name, extra, ranks):
    if comm.size % ranks:
        pytest.skip(f"{name} needs a multiple of {ranks} ranks")
    run_dir = os.path.join(shared_dir, name)
    c = merge({}, {**SMALL, **extra, "run_dir": run_dir})
    probe = EndOfTraining(c)
    run(c, comm, callbacks=[probe])
    model = ht.load_model(run_dir)  # one process: no collective
    assert not model.training
    assert np.array_equal(predict(model, probe.x), probe.predictions)


def _trained(comm, where) -> str:
    solo = comm.split(comm.rank)  # every rank its own one-process run
    try:
        run_dir = os.path.join(where, f"run-{comm.rank}")
        run(merge({}, {**SMALL, "model": "mlp", "checkpoint_every": 2, "run_dir": run_dir}), solo)
    finally:
        solo.free()
    return run_dir


@pytest.mark.timeout(120)
def test_load_weights_takes_a_run_directory_its_newest_checkpoint_that_loads(comm, tmp_path, caplog):
    from hpctrain.job.trained import run_config

    run_dir = _trained(comm, str(tmp_path))
    files = ht.checkpoint.checkpoints_of(run_dir)  # newest first
    assert len(files) >= 2 and run_config(files[0]) == os.path.join(run_dir, "config.json")
    model = ht.load_model(files[0])
    fresh = ht.load_model(files[1])
    header = ht.checkpoint.load_weights(run_dir, fresh)  # the directory: its newest
    assert header["path"] == files[0]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(model.parameters(), fresh.parameters()))
    flip(files[0], "model/0.weight")  # the newest damaged: the one before it loads, said so
    assert ht.checkpoint.load_weights(run_dir, fresh)["path"] == files[1]
    assert "skipping checkpoint" in caplog.text and os.path.basename(files[0]) in caplog.text
    assert ht.load_model(run_dir) is not None


def test_load_model_says_what_is_missing(tmp_path):
    with pytest.raises(errors.ConfigError, match="is neither a run directory nor a checkpoint file"):
        ht.load_model(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.CheckpointError, match="no checkpoints in"):
        ht.load_model(tmp_path / "empty")


@pytest.mark.timeout(300)
def test_the_docs_predict_example_runs_as_written(comm, tmp_path, monkeypatch, capsys):
    text = open(os.path.join(os.path.dirname(HERE), "docs", "tutorials", "trained-model.md"), encoding="utf-8").read()
    code = re.search(r"<!-- the predict example: tests/test_load_model.py runs this block as written -->\n"
                     r"```python\n(.*?)```", text, re.S).group(1)
    where = tmp_path / f"rank{comm.rank}"  # every rank its own one-process run, as the page's runs/cnn
    where.mkdir()
    monkeypatch.chdir(where)
    solo = comm.split(comm.rank)
    try:
        run(merge({}, {"model": "cnn", "d_model": 8, "max_samples": 512, "epochs": 2, "batch_size": 32,
                       "log_every": 1000, "run_dir": "runs/cnn"}), solo)
    finally:
        solo.free()
    capsys.readouterr()
    exec(compile(code, "predict.py", "exec"), {"__name__": "__main__"})
    accuracy = float(re.fullmatch(r"accuracy (\S+)\n", capsys.readouterr().out).group(1))
    assert accuracy > 0.4  # five classes: chance is 0.2
