"""``hpctrain train`` with the user's own model (``--model file.py:factory``) and data (``--data``
with ``--x-key/--y-key`` or ``--tokens-key``, ``--loss ce|mse``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hpctrain import errors
from hpctrain.job import resolve, run

# The example users copy (examples/custom_model.py): the tests train exactly what the docs show.
USER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "custom_model.py")
USER += ":build"
SMALL = {"model": USER, "max_samples": 128, "batch_size": 32, "epochs": 1, "d_model": 16, "log_every": 1000}


@pytest.fixture
def solo(comm):
    c = comm.split(comm.rank)
    yield c
    c.free()


def _h5(path, **arrays):
    import h5py

    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)
    return str(path)


def test_user_model_trains_and_its_layer_learns(solo, tmp_path):
    s = run({**SMALL, "max_samples": 1024, "epochs": 3, "run_dir": str(tmp_path / "u")}, solo)
    import h5py

    with h5py.File(s["checkpoint"], "r") as f:
        scale = f["model/2.s"][()]  # the user's own Parameter, saved under its serial name
    assert scale.shape == (16,) and not np.allclose(scale, 1.0)
    assert s["val_accuracy"] > 0.4, s  # well above chance


def test_custom_keys_and_mse(solo, tmp_path):
    g = np.random.default_rng(0)
    x = g.normal(size=(200, 5)).astype(np.float32)
    w = g.normal(size=(5, 2)).astype(np.float32)
    path = _h5(tmp_path / "reg.h5", inputs=x, targets=x @ w, labels=(x[:, 0] > 0).astype(np.int64))
    reg = run({**SMALL, "data": path, "x_key": "inputs", "y_key": "targets", "loss": "mse", "epochs": 5,
               "lr": 0.01, "run_dir": str(tmp_path / "mse")}, solo)
    assert reg["val_loss"] < 0.5 * float(((x @ w) ** 2).mean())  # it learned the linear map
    cls = run({**SMALL, "data": path, "x_key": "inputs", "y_key": "labels", "epochs": 5,
               "run_dir": str(tmp_path / "ce")}, solo)
    assert cls["val_accuracy"] > 0.8
    with pytest.raises(errors.HpctrainError, match="nope"):
        run({**SMALL, "data": path, "x_key": "nope", "run_dir": str(tmp_path / "x")}, solo)
    with pytest.raises(errors.HpctrainError, match="class indices"):
        run({**SMALL, "data": path, "x_key": "inputs", "y_key": "targets", "run_dir": str(tmp_path / "y")}, solo)


def test_tokens_key(solo, tmp_path):
    text = np.frombuffer(b"abcabcabd" * 200, dtype=np.uint8).astype(np.int64) - ord("a")
    path = _h5(tmp_path / "chars.h5", chars=text)
    s = run({"model": "gpt", "data": path, "tokens_key": "chars", "block_size": 8, "d_model": 16, "n_heads": 2,
             "batch_size": 16, "epochs": 2, "log_every": 1000, "run_dir": str(tmp_path / "g")}, solo)
    assert s["val_loss"] < np.log(4)  # below a uniform guess over the 4 characters


@pytest.mark.parametrize("spec, message", [
    ("nowhere.py:build", "nowhere.py does not exist"),
    (USER.replace(":build", ":missing"), "has no callable 'missing'"),
    ("no_such_package_xyz:build", "cannot import no_such_package_xyz"),
    ("bogus", "neither mlp, gpt nor package.module:factory"),
])
def test_bad_model_specs_refused(solo, tmp_path, spec, message):
    with pytest.raises(errors.ConfigError, match=message):
        run({**SMALL, "model": spec, "run_dir": str(tmp_path / "r")}, solo)


def test_gpt_refuses_mse():
    with pytest.raises(errors.ConfigError, match="--loss ce"):
        resolve({"model": "gpt", "loss": "mse"}, world=1)


LAYOUTS = [("dp", {}), ("tp", {"strategy": "tp"}), ("pp", {"strategy": "pp"})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, extra", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_user_model_under_each_layout_matches_one_process(comm, shared_dir, name, extra):
    if name == "tp" and 64 % comm.size:
        pytest.skip(f"the MLP's hidden width 64 does not split over tp={comm.size}")
    if name == "pp" and comm.size > 6:
        pytest.skip("the user model has 6 layers to cut")
    cfg = {**SMALL, "batch_size": 8 * comm.size * 4, "max_samples": 8 * comm.size * 4 * 4, **extra}
    s = run({**cfg, "run_dir": os.path.join(shared_dir, name)}, comm)
    alone = comm.split(comm.rank)
    try:
        ref = run({**cfg, "strategy": "dp", "run_dir": os.path.join(shared_dir, f"serial-{comm.rank}")}, alone)
    finally:
        alone.free()
    assert s["steps"] == ref["steps"] == 4
    assert s["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4)
    assert s["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-4)


# -- regression on your own data (issue 37: the built-in mlp read n_classes; (N,) targets crashed mid-run) --


@pytest.mark.parametrize("shape, model", [("n", "mlp"), ("n", USER), ("n1", "mlp"), ("n2", USER)],
                         ids=["n-mlp", "n-user", "n1-mlp", "n2-user"])
def test_builtin_mlp_and_your_model_regress_on_your_targets(serial, solo, tmp_path, shape, model):
    """``--loss mse`` on float targets (N,), (N, 1) or (N, 2): the built-in mlp and examples/custom_model.py
    train and learn the map (the mlp once stopped at ``'n_classes'``, (N,) targets at a shape error)."""
    g = np.random.default_rng(0)
    x = g.normal(size=(256, 5)).astype(np.float32)
    w = g.normal(size=(5, 2)).astype(np.float32)
    y = {"n": (x @ w)[:, 0], "n1": (x @ w)[:, :1], "n2": x @ w}[shape]
    path = _h5(tmp_path / "reg.h5", inputs=x, values=y)
    s = run({**SMALL, "model": model, "data": path, "x_key": "inputs", "y_key": "values", "loss": "mse",
             "epochs": 5, "lr": 0.01, "max_samples": None, "run_dir": str(tmp_path / "run")}, solo)
    assert s["val_loss"] < 0.5 * float((y**2).mean()), s  # it learned the linear map


def test_array_dataset_with_1d_float_targets_trains_one_output(comm):
    """A script's ``ArrayDataset(x, y)`` with y of shape (N,) and a model of one output: the loss takes
    (B,) targets as (B, 1) (it once raised a shape error at the first step)."""
    from hpctrain import nn, optim
    from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
    from hpctrain.parallel import DataParallelTrainer

    g = np.random.default_rng(0)
    x = g.normal(size=(64 * comm.size, 3)).astype(np.float32)
    y = x.sum(axis=1)
    loader = DataLoader(ArrayDataset(x, y), batch_size=16, sampler=ShardedSampler(len(x), comm.rank, comm.size))
    model = nn.Sequential(nn.Linear(3, 1, rng=0))
    tr = DataParallelTrainer(model=model, loss=nn.MSELoss(), optimizer=optim.SGD(model.parameters(), lr=0.1),
                             comm=comm)
    stats = tr.fit(loader, epochs=5, progress=False, log_every=10**6)
    assert stats[-1].loss < 0.1 * stats[0].loss


def test_mse_takes_targets_row_by_row_and_never_broadcasts():
    from hpctrain.nn import MSELoss

    loss = MSELoss()
    pred = np.array([[1.0], [2.0]])
    assert loss.forward(pred, np.array([1.0, 4.0])) == 2.0  # (B,) fits (B, 1): (0 + 4) / 2
    np.testing.assert_array_equal(loss.backward(), [[0.0], [-2.0]])
    assert loss.forward(np.zeros((2, 6)), np.ones((2, 3, 2))) == 1.0  # (B, ...) with n values per row
    with pytest.raises(ValueError, match=r"pred shape \(2, 2\) != target shape \(2,\)"):
        loss.forward(np.zeros((2, 2)), np.zeros(2))  # two outputs, one target: refused, not broadcast
    with pytest.raises(ValueError, match="pred shape"):
        loss.forward(np.zeros((3, 1)), np.zeros(2))
