"""`hpctrain train` refuses non-finite settings and unwritable run directories at startup, on every
rank, and writes a summary.json that is valid JSON even when the validation loss is not finite."""

from __future__ import annotations

import json
import math
import os

import h5py
import numpy as np
import pytest

from hpctrain import errors
from hpctrain.job import merge, resolve, run

SMALL = {"max_samples": 64, "epochs": 1, "d_model": 16, "n_layers": 1, "log_every": 100}


def small(comm) -> dict:
    """SMALL with a global batch that splits over every world size (16, or 15 at 3 and 5 ranks)."""
    return {**SMALL, "batch_size": 16 // comm.size * comm.size}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("key, value", [
    ("lr", math.nan), ("lr", math.inf), ("lr", -math.inf), ("momentum", math.nan), ("momentum", math.inf),
    ("weight_decay", math.nan), ("weight_decay", math.inf), ("val_fraction", math.nan),
])  # fmt: skip
def test_non_finite_settings_refused(key, value):
    extra = {"optimizer": "sgd"} if key == "momentum" else {}
    with pytest.raises(errors.ConfigError, match=f"--{key.replace('_', '-')} {value} is not a finite number"):
        resolve(merge({}, {key: value, **extra}), 2)


@pytest.mark.timeout(30)
def test_negative_weight_decay_refused_and_finite_values_pass():
    with pytest.raises(errors.ConfigError, match="--weight-decay must be >= 0, got -0.1"):
        resolve(merge({}, {"weight_decay": -0.1}), 1)
    c = resolve(merge({}, {"lr": 1e-3, "weight_decay": 0.01, "optimizer": "sgd", "momentum": 0.5}), 1)
    assert (c.lr, c.weight_decay, c.momentum) == (1e-3, 0.01, 0.5)


@pytest.mark.timeout(30)
def test_non_finite_settings_in_a_toml_file_refused(tmp_path):
    from hpctrain.job import read_toml

    path = tmp_path / "run.toml"
    path.write_text("lr = nan\n")
    with pytest.raises(errors.ConfigError, match="--lr nan is not a finite number"):
        resolve(merge(read_toml(str(path)), {}), 1)


@pytest.fixture
def shared_dir(comm, tmp_path):
    return comm.bcast_obj(str(tmp_path))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow is the point
def test_summary_json_is_valid_json_when_the_validation_loss_is_not_finite(comm, shared_dir):
    # Training rows are ordinary; the held-out rows are finite float32 features so large that
    # the logits overflow: the run completes, its validation loss is NaN.
    path = os.path.join(shared_dir, "overflow.h5")
    if comm.rank == 0:
        g = np.random.default_rng(0)
        x = g.normal(size=(200, 4)).astype(np.float32)
        x[180:] = [3e38, -3e38, 3e38, -3e38]  # inf - inf in the first layer
        with h5py.File(path, "w") as f:
            f["x"], f["y"] = x, g.integers(0, 3, 200)
    comm.barrier()
    given = {**small(comm), "data": path, "val_fraction": 0.5, "run_dir": os.path.join(shared_dir, "r")}
    s = run(merge({}, given), comm)
    assert math.isnan(s["val_loss"]), s["val_loss"]
    assert s["val_samples"] == 64  # half the file is held out; --max-samples 64 caps the evaluation too
    if comm.rank == 0:
        text = open(os.path.join(s["run_dir"], "summary.json")).read()
        assert "NaN" not in text
        on_disk = json.loads(text, parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
        assert on_disk["val_loss"] is None and on_disk["steps"] == s["steps"]
    comm.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_read_only_run_directory_is_one_clear_error_on_every_rank(comm, tmp_path, request):
    import subprocess

    ro = None
    if comm.rank == 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        if os.geteuid() == 0:
            p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True)
            ok = p.returncode == 0
            if ok:
                request.addfinalizer(lambda: subprocess.run(["umount", str(ro)], capture_output=True))
        else:
            ro.chmod(0o555)
            request.addfinalizer(lambda: ro.chmod(0o755))
            ok = True
    ok = comm.bcast_obj(ok if comm.rank == 0 else None)
    if not ok:
        pytest.skip("cannot make a read-only directory here (root without mount)")
    ro = comm.bcast_obj(str(ro) if comm.rank == 0 else None)
    with pytest.raises(errors.ConfigError, match="Read-only file system|Permission denied") as info:
        run(merge({}, {**small(comm), "run_dir": os.path.join(ro, "run")}), comm)
    assert f"{ro}/run" in str(info.value) and "\n" not in str(info.value)  # the path and the cause, one line
