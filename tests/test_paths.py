"""Paths: directory names are names (no globbing), checkpoint temporaries are created exclusively."""

from __future__ import annotations

import os

import numpy as np
import pytest

import hpctrain as ht
from hpctrain import checkpoint
from hpctrain.files import rundir
from hpctrain.nn import Linear, Sequential
from hpctrain.parallel import DataParallelTrainer


def _trainer(comm):
    model = Sequential(Linear(3, 2, rng=np.random.default_rng(0), dtype=np.float64))
    return DataParallelTrainer(model=model, loss=ht.nn.MSELoss(), optimizer=ht.optim.SGD(model.parameters(), lr=0.1),
                               comm=comm)


def _shared(comm, path) -> str:
    return comm.bcast_obj(str(path) if comm.rank == 0 else None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["exp[1]", "a*b", "q?", "[!x]"])
def test_glob_characters_in_directory_names(comm, tmp_path, name):
    d = _shared(comm, tmp_path / name)
    t = _trainer(comm)
    checkpoint.save_in(d, t)
    if comm.rank == 0:
        os.makedirs(os.path.join(str(tmp_path), "exp1"), exist_ok=True)  # what the glob would have matched
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(d)] == ["ckpt-00000000.h5"]
    assert checkpoint.load_latest(d, _trainer(comm)).endswith("ckpt-00000000.h5")
    assert checkpoint.list_checkpoints(os.path.join(d, "missing")) == []


@pytest.mark.timeout(60)
def test_checkpoint_temporary_never_follows_a_symlink(comm, tmp_path):
    d = _shared(comm, tmp_path)
    victim = os.path.join(d, "victim")
    final = checkpoint.checkpoint_path(d, 0)
    if comm.rank == 0:
        with open(victim, "w") as f:
            f.write("someone's file")
        os.symlink(victim, rundir.temporary_name(final))  # planted at the name rank 0 writes through
    comm.barrier()
    checkpoint.save_in(d, _trainer(comm))
    if comm.rank == 0:
        with open(victim) as f:
            assert f.read() == "someone's file"
        assert not os.path.islink(final) and "all checksums verified" in checkpoint.inspect(final)
        assert not [n for n in os.listdir(d) if rundir.TMP_MARK in n]
