"""Image-shaped data (issue 45, item 1): inputs ``(N, C, H, W)`` and any ``(N, ...)`` are taken as
stored, by the checks, the built-in CNN (and the built-in fields, stored as images) and the
sampler; the MLP flattens them with a header line saying so."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from hpctrain import errors, nn
from hpctrain.data import builtin
from hpctrain.job import merge, models
from jobs import hpctrain

SMALL_CNN = {"model": "cnn", "d_model": 4, "n_layers": 2}


def write_images(path, n: int = 256, shape: tuple[int, ...] = (1, 32, 32), classes: int = 3) -> str:
    """``n`` learnable images of ``shape`` (a bright half for class 1, a dark one for class 2)."""
    g = np.random.default_rng(0)
    x = g.normal(size=(n, *shape)).astype(np.float32)
    y = g.integers(0, classes, n)
    x[y == 1, ..., : shape[-1] // 2] += 1
    x[y == 2, ..., : shape[-2] // 2, :] -= 1
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y
    return str(path)


@pytest.mark.timeout(60)
def test_images_open_as_they_are_stored(tmp_path):
    from hpctrain.data.checks import open_classification

    path = write_images(tmp_path / "img.h5", n=40, shape=(3, 8, 6))
    train, val, meta = open_classification(path, val_fraction=0.1)
    assert meta["x_shape"] == [3, 8, 6] and meta["n_in"] == 3 * 8 * 6
    x, y = train[np.arange(4)]
    assert x.shape == (4, 3, 8, 6) and x.dtype == np.float32 and y.shape == (4,)


@pytest.mark.parametrize("shape, first", [((3, 8, 8), nn.Conv2d), ((8, 8), nn.Unflatten), ((64,), nn.Unflatten)])
def test_the_cnn_takes_images_fields_and_square_rows(shape, first):
    model = models.build_cnn(merge({}, SMALL_CNN), {"x_shape": list(shape), "n_in": int(np.prod(shape)),
                                                    "n_classes": 5})
    assert isinstance(model[0], first)
    channels = shape[0] if len(shape) == 3 else 1
    assert next(m for m in model if isinstance(m, nn.Conv2d)).weight.shape[1] == channels
    assert model.forward(np.zeros((2, *shape), np.float32)).shape == (2, 5)


def test_the_cnn_refuses_samples_it_cannot_read_as_images_saying_what_to_store():
    with pytest.raises(errors.ConfigError, match=r"store d.h5's inputs as \(N, C, H, W\).*shape \(2, 3, 4, 5\)"):
        models.build_cnn(merge({}, SMALL_CNN), {"x_shape": [2, 3, 4, 5], "n_in": 120, "n_classes": 2,
                                                "path": "d.h5"})


def test_the_mlp_flattens_images_first_and_takes_rows_as_they_are():
    c = merge({}, {"model": "mlp", "d_model": 8, "n_layers": 1})
    mlp = models.build_classifier(c, {"x_shape": [1, 4, 4], "n_in": 16, "n_classes": 3})
    assert isinstance(mlp[0], nn.Flatten) and mlp.forward(np.zeros((2, 1, 4, 4), np.float32)).shape == (2, 3)
    rows = models.build_classifier(c, {"x_shape": [16], "n_in": 16, "n_classes": 3})
    assert isinstance(rows[0], nn.Linear)


def test_the_built_in_fields_are_stored_as_images_and_an_old_flat_cache_is_rewritten(tmp_path):
    path = tmp_path / "fields.h5"
    with h5py.File(path, "w") as f:  # the cache an older hpctrain wrote: flat rows and a side attribute
        f["x"] = np.zeros((2048, 256), np.float32)
        f["y"] = np.zeros(2048, np.int64)
        f.attrs.update(hpctrain_builtin="fields", version=1, side=16)
    builtin.fields(path)
    with h5py.File(path, "r") as f:
        assert f["x"].shape == (2048, 1, 16, 16) and "side" not in f.attrs


def _summary(run_dir) -> dict:
    with open(run_dir / "summary.json", encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.jobs
@pytest.mark.timeout(400)
def test_an_image_file_trains_the_cnn_under_dp_and_pp_as_one_process(tmp_path):
    data = write_images(tmp_path / "img.h5")
    common = ["train", "--model", "cnn", "--data", data, "--d-model", "4", "--n-layers", "2", "--batch-size", "32",
              "--epochs", "1", "--log-every", "4"]
    runs = {"one": (0, []), "dp2": (2, []), "pp2": (2, ["--pp", "2"])}
    for name, (n, extra) in runs.items():
        out = hpctrain(*common, "--run-dir", str(tmp_path / name), *extra, n=n, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "cnn" in out.stdout and "must have shape" not in out.stdout + out.stderr
    ref = _summary(tmp_path / "one")
    for name in ("dp2", "pp2"):
        s = _summary(tmp_path / name)
        assert s["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-5), name
        assert s["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5), name


@pytest.mark.jobs
@pytest.mark.timeout(200)
def test_the_mlp_on_images_says_it_flattens_them(tmp_path):
    data = write_images(tmp_path / "img.h5", n=64, shape=(1, 8, 8))
    out = hpctrain("train", "--data", data, "--batch-size", "16", "--epochs", "1", "--run-dir", str(tmp_path / "r"),
                   timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mlp: each input of shape (1, 8, 8) is flattened to 64 features" in out.stdout
