"""The pieces of ``hpctrain train``: the typed config and its files, fit callbacks, weights for
evaluation through the checkpoint module, and ``ht.checkpoint`` after a plain import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import hpctrain as ht
from hpctrain import errors
from hpctrain.job import Config, merge, read_config, resolve, run


def test_config_is_a_typed_dataclass():
    c = resolve(merge({}, {"batch_size": 8, "lr": 1}), world=2)
    assert isinstance(c, Config)
    assert isinstance(c.lr, float) and c.lr == 1.0  # an int from a flag or file becomes the field's type
    assert (c.dp, c.local_batch) == (2, 4)
    with pytest.raises(errors.ConfigError, match="unknown setting"):
        resolve({"epoch": 3}, world=1)  # a dict naming no option is refused, not ignored


def test_config_json_of_a_run_is_accepted_back(tmp_path):
    c = resolve(merge({}, {"model": "gpt", "epochs": 2, "lr": 0.01, "run_dir": str(tmp_path)}), world=1)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(c.to_dict()))
    again = resolve(merge(read_config(str(path)), {}), world=1)
    assert again == c
    # ... with flags on top, and the derived fields recomputed for another world size.
    other = resolve(merge(read_config(str(path)), {"epochs": 5}), world=2)
    assert (other.epochs, other.model, other.lr, other.dp) == (5, "gpt", 0.01, 2)
    path.write_text('{"lr": "fast"}')
    with pytest.raises(errors.ConfigError, match="lr must be float"):
        read_config(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(errors.ConfigError, match="must hold a JSON object"):
        read_config(str(path))


def test_config_json_round_trip_trains_the_same(tmp_path):
    cfg = {"max_samples": 128, "batch_size": 32, "epochs": 1, "d_model": 16, "log_every": 100}
    comm = ht.Communicator().split(ht.Communicator().rank)
    try:
        first = run({**cfg, "run_dir": str(tmp_path / "a")}, comm)
        again = run(merge(read_config(str(tmp_path / "a" / "config.json")), {"run_dir": str(tmp_path / "b")}), comm)
    finally:
        comm.free()
    assert again["final_loss"] == first["final_loss"] and again["val_loss"] == first["val_loss"]


def test_plain_import_reaches_checkpoint(comm):
    if comm.size > 1:
        pytest.skip("starts a fresh interpreter; runs in the serial pass")
    code = "import hpctrain as ht; print(ht.checkpoint.save.__name__, ht.checkpoint.load.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["save", "load"]


class Recorder:
    """Every hook, in order; only some hooks defined on purpose (the others are optional)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_fit_start(self, trainer):
        self.calls.append(("start", trainer.global_step))

    def on_step_end(self, trainer, stats):
        self.calls.append(("step", trainer.global_step, stats.loss))
        stats.extra["val_loss"] = 0.5 * trainer.global_step  # the logger writes what callbacks add

    def on_epoch_end(self, trainer):
        self.calls.append(("epoch", trainer.epoch))

    def on_fit_end(self, trainer):
        self.calls.append(("end", trainer.global_step))


class StepsOnly:
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, trainer, stats):
        self.steps += 1


def _trainer(comm):
    model = ht.nn.Sequential(ht.nn.Linear(3, 2, rng=0, dtype=np.float64))
    opt = ht.optim.SGD(model.parameters(), lr=0.1)
    return ht.parallel.DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=comm)


def test_fit_callbacks_see_every_hook_in_order(tmp_path):
    comm = ht.Communicator().split(ht.Communicator().rank)
    g = np.random.default_rng(0)
    batches = [(g.normal(size=(4, 3)), g.integers(0, 2, 4)) for _ in range(3)]
    rec, steps = Recorder(), StepsOnly()
    metrics = tmp_path / "m.jsonl"
    hist = _trainer(comm).fit(batches, epochs=2, progress=False, log_every=100, metrics_file=str(metrics),
                              callbacks=[rec, steps])
    assert rec.calls[0] == ("start", 0) and rec.calls[-1] == ("end", 6)
    kinds = [c[0] for c in rec.calls]
    assert kinds == ["start"] + ["step"] * 3 + ["epoch"] + ["step"] * 3 + ["epoch", "end"]
    assert [c[2] for c in rec.calls if c[0] == "step"] == [s.loss for s in hist]
    assert steps.steps == 6
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["val_loss"] for r in lines] == [0.5 * s for s in range(1, 7)]


def test_fit_end_runs_when_training_raises():
    comm = ht.Communicator().split(ht.Communicator().rank)
    rec = Recorder()
    with pytest.raises(ValueError):
        _trainer(comm).fit([(np.zeros((2, 5)), np.zeros(2, dtype=np.int64))], callbacks=[rec], progress=False)
    assert rec.calls == [("start", 0), ("end", 0)]


def _saved(tmp_path):
    comm = ht.Communicator().split(ht.Communicator().rank)
    tr = _trainer(comm)
    path = ht.checkpoint.save(str(tmp_path / "c.h5"), tr)
    return path, {n: p.data.copy() for n, p in tr.model.named_parameters()}


def test_load_weights_reads_a_checkpoint_into_a_serial_model(tmp_path):
    path, want = _saved(tmp_path)
    model = ht.nn.Sequential(ht.nn.Linear(3, 2, rng=7, dtype=np.float64))
    ht.checkpoint.load_weights(path, model)
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.data, want[n])


def test_load_weights_checks_checksums_and_names(tmp_path):
    import h5py

    path, _ = _saved(tmp_path)
    other = ht.nn.Sequential(ht.nn.Linear(3, 4, rng=7, dtype=np.float64))
    before = other[0].weight.data.copy()
    with pytest.raises(errors.CheckpointError, match=r"does not fit this model: 0.bias: checkpoint has shape"):
        ht.checkpoint.load_weights(path, other)
    np.testing.assert_array_equal(other[0].weight.data, before)  # unchanged on refusal
    with h5py.File(path, "r+") as f:  # flip a value, keep the stored checksum
        f["model/0.weight"][0, 0] += 1.0
    from ckpt_tools import reseal

    reseal(path)  # the digests recomputed: the slab's checksum refuses it
    model = ht.nn.Sequential(ht.nn.Linear(3, 2, rng=7, dtype=np.float64))
    with pytest.raises(errors.CheckpointError, match="checksum mismatch in model/0.weight"):
        ht.checkpoint.load_weights(path, model)
    assert os.path.exists(path)
