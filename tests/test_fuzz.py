"""Damaged inputs to the entry points that parse files: clear hpctrain errors, never a crash or hang.

Random truncations, bit flips, overwritten blocks and random bytes of a good checkpoint, HDF5
dataset and TOML config file (plus well-formed TOML with random keys and values) go through
``tests/faults/fuzz_worker.py`` in a subprocess with a timeout: an interpreter crash (say in
libhdf5) or a hang fails the test instead of taking pytest down. A damaged checkpoint that still
loads must load exactly the original values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import pytest

from hpctrain import checkpoint as ckpt
from hpctrain.errors import CheckpointError, ConfigError, DatasetError

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults", "fuzz_worker.py")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("what, error, cases", [
    ("checkpoint", "CheckpointError", 120), ("hdf5", "DatasetError", 200), ("config", "ConfigError", 300),
])  # fmt: skip
def test_fuzz(serial, tmp_path, what, error, cases):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "HPCTRAIN_"))}
    p = subprocess.run([sys.executable, WORKER, what, str(tmp_path), "7", str(cases)],
                       capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, f"the worker died (signal or exception): rc={p.returncode}\n{p.stderr[-3000:]}"
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["n_unexpected"] == 0, "\n".join(report["unexpected"])
    outcomes = report["outcomes"]
    assert sum(outcomes.values()) == cases
    assert sum(n for k, n in outcomes.items() if k.endswith(":" + error)) > cases // 4, outcomes


def _good_checkpoint(tmp_path) -> str:
    import hpctrain as ht
    from hpctrain.nn import Linear
    from hpctrain.parallel import DataParallelTrainer

    model = ht.nn.Sequential(Linear(3, 2, rng=0))
    tr = DataParallelTrainer(model=model, loss=ht.nn.MSELoss(), optimizer=ht.optim.SGD(model.parameters(), lr=0.1),
                             comm=ht.Communicator())
    return ckpt.save(str(tmp_path / "c.h5"), tr)


def test_checkpoint_header_bitflip_is_detected(serial, tmp_path):
    path = _good_checkpoint(tmp_path)
    with h5py.File(path, "r+") as f:
        state = json.loads(f.attrs["trainer_state"])
        state["global_step"] = 1000  # what a flipped bit in the JSON could do silently
        f.attrs["trainer_state"] = json.dumps(state)
    with pytest.raises(CheckpointError, match="do not match its whole-file digest"):
        ckpt.inspect(path)
    from ckpt_tools import reseal

    reseal(path)  # whole-file digests recomputed (XXH3 is no signature): the header's own checksum
    with pytest.raises(CheckpointError, match="checksum mismatch in its header"):
        ckpt.inspect(path)


def test_truncated_and_foreign_files(serial, tmp_path):
    path = _good_checkpoint(tmp_path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"c\.h5"):
        ckpt.inspect(path)
    (tmp_path / "x.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(CheckpointError, match="not a readable HDF5 file"):
        ckpt.inspect(str(tmp_path / "x.h5"))
    from hpctrain.data import HDF5Dataset

    with pytest.raises(DatasetError, match="cannot open as HDF5"):
        HDF5Dataset(str(tmp_path / "x.h5"), "x")


def test_config_not_utf8_or_a_directory(serial, tmp_path):
    from hpctrain.job import read_toml

    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'lr = 0.1\nmodel = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        read_toml(str(bad))
    with pytest.raises(ConfigError, match="cannot be read"):
        read_toml(str(tmp_path))
