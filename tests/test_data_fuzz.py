"""Random ``--data`` files through the whole job: it trains, or every rank ends with the same clear
one-line hpctrain error; never a NumPy or h5py exception, never a hang.

Each case writes a small HDF5 file with random shapes, ranks, dtypes, value ranges (negative,
huge, NaN), storage (contiguous, chunked, gzip, lzf, shuffle, fletcher32), links and attributes,
and sometimes damages its bytes (truncation, bit flips, overwritten blocks); then ``run`` trains
an MLP or a GPT on it under the current world size. ``make test`` runs a few cases per world size
(seconds); ``HPCTRAIN_TEST_FUZZ=N`` runs N more (marked ``fuzz``). A hang ends in the test's
timeout, which aborts the job under ``python -m mpi4py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpctrain.errors import HpctrainError
from jobs import mpiexec, without_launcher

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults"))
from fuzz_worker import mutate  # noqa: E402  (the damage the file fuzzers share)

X_DTYPES = ["f4", "f8", "f2", "i4", "u1", "i8", "?", "c8", "S3"]
Y_DTYPES = ["i8", "i4", "u1", "u8", "i1", "f4", "?"]


def _values(rng: np.random.Generator, shape: tuple, dtype: str, kind: str) -> np.ndarray:
    """Random values of ``dtype``: mostly sensible, sometimes negative, huge or not finite."""
    dt = np.dtype(dtype)
    if dt.kind == "S":
        return rng.integers(97, 123, size=(*shape, 3), dtype=np.uint8).view("S3").reshape(shape)
    if kind == "features":
        a = rng.normal(size=shape)
        r = rng.random()
        if r < 0.15 and a.size:
            a.flat[int(rng.integers(0, a.size))] = rng.choice([np.nan, np.inf, -np.inf, 1e300])
    else:
        hi = int(rng.choice([2, 5, 40]))
        a = rng.integers(0, hi, size=shape).astype(np.float64)
        r = rng.random()
        if r < 0.15 and a.size:
            a.flat[int(rng.integers(0, a.size))] = rng.choice([-1, -7, 10**9, 2**40, 0.5])
    with np.errstate(all="ignore"):
        if dt.kind in "iu":
            info = np.iinfo(dt)
            return np.clip(np.nan_to_num(a), info.min, info.max).astype(dt)
        return a.astype(dt)


def _storage(rng: np.random.Generator, shape: tuple) -> dict:
    """Random HDF5 storage options for a dataset of ``shape``."""
    if not shape or 0 in shape or rng.random() < 0.35:
        return {}
    opts: dict = {"chunks": tuple(int(rng.integers(1, max(2, s + 1))) for s in shape)}
    r = rng.random()
    if r < 0.4:
        opts["compression"] = "gzip"
        opts["compression_opts"] = int(rng.integers(1, 10))
    elif r < 0.6:
        opts["compression"] = "lzf"
    opts["shuffle"] = bool(rng.random() < 0.3)
    opts["fletcher32"] = bool(rng.random() < 0.3)
    return opts


def _key(f: h5py.File, rng: np.random.Generator, name: str, shape: tuple, dtype: str, kind: str) -> None:
    """Write ``name``; sometimes missing, a group, a scalar, or reached through a link."""
    r = rng.random()
    if r < 0.03:
        return
    if r < 0.05:
        f.create_group(name)
        return
    if r < 0.07:
        f[name] = 3
        return
    data = _values(rng, shape, dtype, kind)
    if r < 0.10:
        f.create_dataset("_" + name, data=data)
        f[name] = h5py.SoftLink("/_" + name)
        return
    f.create_dataset(name, data=data, **_storage(rng, shape))


def random_data_file(rng: np.random.Generator, path: str) -> str:
    """Write one random ``--data`` file (damaged sometimes); returns the model it is meant for."""
    model = "mlp" if rng.random() < 0.65 else "gpt"
    n = int(rng.choice([0, 1, 3, 17, 40, 90]))
    with h5py.File(path, "w") as f:
        if model == "mlp":
            d = int(rng.choice([0, 1, 3, 6]))
            x_shape = [(n, d), (n, d), (n, d), (n,), (n, d, 2)][int(rng.integers(0, 5))]
            y_shape = [(n,), (n,), (n,), (n, 2), (max(n - 1, 0),)][int(rng.integers(0, 5))]
            _key(f, rng, "x", x_shape, str(rng.choice(X_DTYPES)), "features")
            _key(f, rng, "y", y_shape, str(rng.choice(Y_DTYPES)), "labels")
        else:
            shape = [(4 * n,), (4 * n,), (4 * n,), (n, 3)][int(rng.integers(0, 4))]
            _key(f, rng, "tokens", shape, str(rng.choice(Y_DTYPES)), "labels")
            r = rng.random()
            if r < 0.3:
                f.attrs["vocab"] = "abcdefghijklmnopqrstuvwxyz"[: int(rng.integers(0, 27))]
            elif r < 0.4:
                f.attrs["vocab"] = rng.choice([np.nan, -3, 10**12, 7])
    if rng.random() < 0.25:
        data = open(path, "rb").read()
        with open(path, "wb") as out:
            out.write(mutate(data, rng)[1])
    return model


def one_case(comm, seed: int, where: str) -> str:
    """Run the job on random file ``seed``: the outcome (``"ok"`` or the error's type), the same on
    every rank; fails the test on anything else."""
    from hpctrain.job import merge, run

    rng = np.random.default_rng([seed, 2026])
    path = os.path.join(where, f"fuzz-{seed}.h5")
    model = random_data_file(rng, path) if comm.rank == 0 else None
    model = comm.bcast_obj(model)
    cfg = {"data": path, "model": model, "epochs": 1, "batch_size": 2 * comm.size, "max_samples": 8,
           "d_model": 8, "n_layers": 1, "n_heads": 2, "block_size": 4, "log_every": 1000,
           "run_dir": os.path.join(where, f"run-{seed}")}
    try:
        run(merge({}, cfg), comm)
        outcome = "ok"
    except HpctrainError as exc:
        message = str(exc)
        assert message and "\n" not in message, f"case {seed}: not one line: {message!r}"
        assert "Traceback" not in message, f"case {seed}: {message}"
        outcome = type(exc).__name__
    # Anything that is not an HpctrainError propagates: the test fails with its traceback.
    everyone = comm.allgather_obj(outcome)
    assert len(set(everyone)) == 1, f"case {seed}: ranks ended differently: {everyone}"
    return outcome


def _fuzz(comm, tmp_path, seeds) -> dict:
    where = comm.bcast_obj(str(tmp_path))
    outcomes: dict[str, int] = {}
    for seed in seeds:
        out = one_case(comm, seed, where)
        outcomes[out] = outcomes.get(out, 0) + 1
    return outcomes


@pytest.mark.timeout(120)
def test_fuzz_data_files_quick(comm, tmp_path, monkeypatch):
    # A hang would otherwise wait the default 300 s before the watchdog ends it.
    monkeypatch.setenv("HPCTRAIN_TIMEOUT", "30")
    outcomes = _fuzz(comm, tmp_path, range(12))
    assert sum(outcomes.values()) == 12
    assert outcomes.get("DatasetError", 0) >= 3, outcomes  # the generator does produce bad files


@pytest.mark.fuzz
@pytest.mark.timeout(3600)
def test_fuzz_data_files_long(comm, tmp_path, monkeypatch):
    n = int(os.environ.get("HPCTRAIN_TEST_FUZZ", "0") or 0)
    if n <= 0:
        pytest.skip("opt-in: HPCTRAIN_TEST_FUZZ=N runs N more random --data files")
    monkeypatch.setenv("HPCTRAIN_TIMEOUT", "30")
    outcomes = _fuzz(comm, tmp_path, range(1000, 1000 + n))
    if comm.rank == 0:
        print(f"\n{n} random --data files: {outcomes}")
    assert outcomes.get("ok", 0) > 0 and outcomes.get("DatasetError", 0) > 0, outcomes


# -- through the command line: one line per rank, exit status 2, no traceback ----------------------

def _hpctrain_job(args: list[str], cwd: str, timeout: float = 90) -> subprocess.CompletedProcess:
    env = without_launcher(dict(os.environ))
    env["HPCTRAIN_TIMEOUT"] = "30"
    return subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "hpctrain", "train", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


CLI_CASES = [
    ("negative label", {"x": np.ones((64, 3), np.float32), "y": np.r_[np.zeros(63, np.int64), -1]}, [],
     "key 'y' row 63 holds label -1: labels must be class indices >= 0"),
    ("2-D tokens", {"tokens": np.zeros((64, 2), np.int64)}, ["--model", "gpt"],
     r"key 'tokens' has shape \(64, 2\): tokens \(the token ids\) must have shape \(N,\)"),
    ("lr nan", {"x": np.ones((64, 3), np.float32), "y": np.zeros(64, np.int64)}, ["--lr", "nan"],
     "--lr nan is not a finite number"),
]  # fmt: skip


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_bad_data_through_the_command_line_is_one_clear_line(comm, tmp_path):
    if comm.size > 1:
        pytest.skip("starts its own mpiexec; it runs in the serial pass")
    for name, keys, extra, message in CLI_CASES:
        path = str(tmp_path / (name.replace(" ", "-") + ".h5"))
        with h5py.File(path, "w") as f:
            for k, v in keys.items():
                f[k] = v
        p = _hpctrain_job(["--data", path, "--max-samples", "16", "--batch-size", "8", "--epochs", "1",
                           "--run-dir", str(tmp_path / name.replace(" ", "-")), *extra], str(tmp_path))
        assert p.returncode in (2, 4), (name, p.returncode, p.stderr[-2000:])  # config (2) or data (4) error
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert "Traceback" not in p.stderr, p.stderr
        errors = [x for x in lines if "hpctrain train: error: " in x]
        # Raised on every rank with the same message: said once, as one whole line.
        assert len(errors) == 1 and re.match(r"(\[rank 0\] )?hpctrain train: error: ", errors[0]), (name, p.stderr)
        assert re.search(message, errors[0]), (name, errors[0])
