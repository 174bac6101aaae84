"""hpctrain.torch.save / load under real mpiexec: hpctrain's sealed checkpoint format holding torch
models, optimizers, samplers and schedulers; resume under another dp size; all or nothing (issue 39)."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hpctrain.torch as htt  # noqa: E402
from hpctrain.checkpoint import inspect, list_checkpoints  # noqa: E402
from hpctrain.errors import CheckpointError  # noqa: E402
from torchkit import batches, max_diff, mlp, train  # noqa: E402


def _job(comm, zero=False, seed=0, norm=False):
    """A DDP model (``norm``: with batch norm, whose buffers are saved too), AdamW (or ZeRO-1 AdamW)
    with a scheduler, a sampler: what a training job saves."""
    model = torch.nn.Sequential(mlp(seed=seed), torch.nn.BatchNorm1d(3).double()) if norm else mlp(seed=seed)
    ddp = htt.DistributedDataParallel(model, comm)
    opt = (htt.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, comm, lr=0.05) if zero
           else torch.optim.AdamW(ddp.parameters(), lr=0.05))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sampler = htt.ShardedSampler(240, comm, seed=4)
    return {"model": ddp, "optimizer": opt, "sched": sched, "sampler": sampler}


def _steps(job, data, comm):
    for batch in data:
        train(job["model"], job["optimizer"], [batch], comm.rank, comm.size)
        job["sched"].step()
        job["sampler"].advance(24 // comm.size)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", [False, True])
def test_resume_under_another_dp_size_goes_on_as_one_process(comm, shared_dir, zero):
    data = batches(5)
    job = _job(comm, zero=zero, seed=comm.rank)
    _steps(job, data[:3], comm)
    path = htt.save(shared_dir, step=3, epoch=1, **job)
    assert path == os.path.join(shared_dir, "ckpt-00000003.h5")
    # Every rank alone (dp=1) reads the whole of it and trains the last two global batches whole.
    alone = comm.split(comm.rank)
    again = _job(alone, seed=7)
    got = htt.load(shared_dir, **again)
    assert (got.path, got.step, got.epoch) == (path, 3, 1)
    assert again["sampler"].position == 3 * 24 and again["sched"].last_epoch == 3
    _steps(again, data[3:], alone)
    # One process, never interrupted: the same five global batches.
    ref = _job(alone, seed=0)
    _steps(ref, data, alone)
    assert max_diff(again["model"], ref["model"]) < 1e-12
    assert again["optimizer"].param_groups[0]["lr"] == ref["optimizer"].param_groups[0]["lr"] == 0.0125


@pytest.mark.mpi(min_size=2)
def test_full_tensors_under_module_names(comm, shared_dir):
    job = _job(comm, norm=True)
    _steps(job, batches(1), comm)
    path = htt.save(os.path.join(shared_dir, "one.h5"), **job)
    if comm.rank == 0:
        with h5py.File(path, "r") as f:
            # Plain h5py reads every tensor whole (a 0-d one, num_batches_tracked, has no virtual
            # dataset: HDF5 maps only simple dataspaces; hpctrain reads its slab, see below).
            assert sorted(f["model"]) == [*(f"0.{i}.{k}" for i in (0, 2, 4) for k in ("bias", "weight")),
                                          "1.bias", "1.running_mean", "1.running_var", "1.weight"]
            np.testing.assert_array_equal(f["model/0.0.weight"][()], job["model"].module[0][0].weight.detach().numpy())
            np.testing.assert_array_equal(f["optim/0.0.weight/exp_avg"][()],
                                          job["optimizer"].state[job["model"].module[0][0].weight]["exp_avg"].numpy())
        assert "step 0, epoch 0" in inspect(path)
    again = _job(comm, seed=3, norm=True)
    htt.load(path, **again)
    assert int(again["model"].module[1].num_batches_tracked) == 1
    assert max_diff(again["model"], job["model"]) == 0.0


@pytest.mark.mpi(min_size=2)
def test_asynchronous_saves_and_keep(comm, shared_dir):
    job = _job(comm)
    data = batches(4)
    for step in range(1, 5):
        _steps(job, data[step - 1:step], comm)
        htt.save(shared_dir, step=step, keep=2, asynchronous=True, **job)
    assert htt.wait() == os.path.join(shared_dir, "ckpt-00000004.h5")
    assert [os.path.basename(p) for p in list_checkpoints(shared_dir)] == ["ckpt-00000003.h5", "ckpt-00000004.h5"]
    again = _job(comm, seed=5)
    htt.load(shared_dir, **again)
    assert max_diff(again["model"], job["model"]) == 0.0


@pytest.mark.mpi(min_size=2)
def test_a_checkpoint_of_another_model_changes_nothing_on_any_rank(comm, shared_dir):
    job = _job(comm)
    path = htt.save(os.path.join(shared_dir, "a.h5"), **job)
    other = {"model": htt.DistributedDataParallel(mlp(width=8), comm)}
    before = {k: v.clone() for k, v in other["model"].state_dict().items()}
    with pytest.raises(CheckpointError, match=r"does not fit this model: model/0.weight: checkpoint declares shape "
                                              r"\(16, 6\), model needs \(8, 6\)"):
        htt.load(path, **other)
    assert all(torch.equal(before[k], v) for k, v in other["model"].state_dict().items())


class _Picky:
    """An object whose ``load_state_dict`` refuses a new value on one rank: the whole load must
    come undone (its own old value it takes back)."""

    def __init__(self, refuse: bool, value: int = 0) -> None:
        self.refuse, self.value = refuse, value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        if self.refuse and state["value"] != self.value:
            raise ValueError("not this state")
        self.value = state["value"]


@pytest.mark.mpi(min_size=2)
def test_a_load_failing_on_one_rank_is_undone_on_every_rank(comm, shared_dir):
    job = _job(comm)
    _steps(job, batches(2), comm)
    path = htt.save(os.path.join(shared_dir, "a.h5"), picky=_Picky(False, 5), **job)
    fresh = _job(comm, seed=3)
    _steps(fresh, batches(1, seed=9), comm)
    before = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    opt_before = {i: {k: v.clone() for k, v in st.items()}
                  for i, st in fresh["optimizer"].state_dict()["state"].items()}
    picky = _Picky(comm.rank == 1)
    with pytest.raises(CheckpointError, match=r"cannot restore the trainer state \(nothing was changed\): ranks? "
                                              r"0(,2-\d+)?: another rank failed; rank 1: ValueError: not this state\Z"):
        htt.load(path, picky=picky, **fresh)
    assert picky.value == 0
    assert all(torch.equal(before[k], v) for k, v in fresh["model"].state_dict().items())
    after = fresh["optimizer"].state_dict()["state"]
    assert all(torch.equal(opt_before[i][k], after[i][k]) for i in opt_before for k in opt_before[i])
    assert fresh["sampler"].position == 24 // comm.size and fresh["sched"].last_epoch == 1


@pytest.mark.mpi(min_size=2)
def test_bad_arguments_are_one_error_on_every_rank(comm, shared_dir):
    job = _job(comm)
    with pytest.raises(TypeError, match=r"hpctrain.torch: ranks .*: junk=int: hpctrain.torch saves modules"):
        htt.save(os.path.join(shared_dir, "x.h5"), junk=3, **job)
    with pytest.raises(ValueError, match="optimizer: the optimizer holds 6 parameter"):  # its model not given
        htt.save(os.path.join(shared_dir, "x.h5"), optimizer=job["optimizer"])
    with pytest.raises(ValueError, match="keep= prunes a directory"):
        htt.save(shared_dir, keep=2, **job)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        htt.load(shared_dir, **job)
    with pytest.raises(TypeError, match=r"hpctrain.torch.save: ranks .*: hpctrain.torch.save at /objects/odd/s: "
                                        r"a value of type 'set' is not saved"):
        htt.save(os.path.join(shared_dir, "x.h5"), odd=_Odd(), **job)


class _Odd:
    def state_dict(self):
        return {"s": {1, 2}}

    def load_state_dict(self, state):
        pass
