"""`hpctrain train --model cnn` (issue 36, item 6): convolutions, pooling and an MLP head on the
built-in fields, learnable on one process and equal to one process under dp, pp and ZeRO."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_train_mpi import serial

from hpctrain import errors, nn
from hpctrain.data import builtin
from hpctrain.job import merge, models, run

# 8 steps of a small CNN: 4-channel blocks on the 16 x 16 fields.
CNN = {"model": "cnn", "d_model": 4, "n_layers": 2, "max_samples": 256, "batch_size": 32, "epochs": 1,
       "log_every": 4}


def small(comm) -> dict:
    """CNN with a global batch that splits over the world (8 per rank when 32 does not)."""
    if 32 % comm.size == 0:
        return dict(CNN)
    return {**CNN, "batch_size": 8 * comm.size, "max_samples": 64 * comm.size}


def test_fields_are_balanced_deterministic_and_cached(tmp_path):
    x, y = builtin.make_fields()
    assert x.shape == (2048, 1, 16, 16) and x.dtype == np.float32 and y.dtype == np.int64
    assert np.bincount(y).tolist() == [410, 410, 410, 409, 409]
    x2, y2 = builtin.make_fields()
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    path = builtin.fields(tmp_path / "fields.h5")
    stamp = os.stat(path).st_mtime_ns
    assert builtin.fields(tmp_path / "fields.h5") == path and os.stat(path).st_mtime_ns == stamp


def test_the_built_in_cnn_learns_the_fields(shared_dir):
    # One run directory for every rank: under mpiexec the run is collective.
    s = run(merge({}, {**CNN, "d_model": 8, "max_samples": 1024, "epochs": 3, "run_dir": f"{shared_dir}/run"}))
    assert s["val_accuracy"] > 0.9, s


def test_the_cnn_is_a_flat_sequential_of_convolutions_pooling_and_a_head():
    c = merge({}, {**CNN, "dropout": 0.1})
    model = models.build_cnn(c, {"n_in": 256, "n_classes": 5})
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["Unflatten", "Conv2d", "ReLU", "MaxPool2d", "Conv2d", "ReLU", "MaxPool2d", "Flatten",
                     "Linear", "GELU", "Dropout", "Linear"]
    assert len(model) - 3 >= models.cnn_pieces(2)  # the config's bound on pipeline stages holds
    assert model.forward(np.zeros((3, 256), np.float32)).shape == (3, 5)
    with pytest.raises(errors.ConfigError, match="rows of 200 values, not a square"):
        models.build_cnn(c, {"n_in": 200, "n_classes": 5})
    assert isinstance(model[1], nn.Conv2d) and model[1].weight.shape == (4, 1, 3, 3)


LAYOUTS = [
    ("dp", {}, lambda n: True),
    ("pp", {"strategy": "pp"}, lambda n: True),
    ("zero1", {"zero": 1}, lambda n: True),
    ("zero3", {"zero": 3}, lambda n: True),
    ("hybrid-pp2-zero2", {"strategy": "hybrid", "pp": 2, "zero": 2}, lambda n: n % 2 == 0),
]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, extra, fits", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_cnn_matches_one_process(comm, shared_dir, name, extra, fits):
    if not fits(comm.size):
        pytest.skip(f"{name} does not fit {comm.size} ranks")
    cfg = {**small(comm), **extra}
    s = run(merge({}, {**cfg, "run_dir": os.path.join(shared_dir, f"cnn-{name}")}), comm)
    ref = serial(comm, {k: v for k, v in cfg.items() if k not in ("strategy", "pp", "zero")}, shared_dir)
    assert s["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4)
    assert s["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-4)
    assert s["val_accuracy"] == pytest.approx(ref["val_accuracy"], abs=1e-9)


def test_tensor_parallelism_is_refused_for_the_cnn():
    from hpctrain.job.config import resolve

    with pytest.raises(errors.ConfigError, match="no layer that splits over tensor-parallel ranks"):
        resolve(merge({}, {**CNN, "strategy": "tp"}), 2)
