"""Pipeline checkpoints: full tensors saved from pp=2, loaded at pp=1 and back; exact resume."""

from __future__ import annotations

import os

import numpy as np
import pytest
from pipeline_models import batches, make, share

from hpctrain import ProcessGrid, checkpoint
from hpctrain.nn import Dropout, Linear, MSELoss, ReLU, Sequential
from hpctrain.optim import Adam
from hpctrain.parallel import PipelineParallelTrainer, pipeline_stage


def _trainer(comm, pp, seed=0, model=None, schedule="1f1b"):
    grid = ProcessGrid(comm, pp=pp)
    full, loss = make("mlp", seed) if model is None else (model, MSELoss())
    stage = pipeline_stage(full, grid.pp)
    opt = Adam(stage.parameters(), lr=0.01)
    return PipelineParallelTrainer(stage=stage, loss=loss, optimizer=opt, grid=grid, microbatches=3, schedule=schedule)


def _step(tr, batch):
    x, y, w = batch
    dp, d = tr.dp.size, tr.dp.rank
    return tr.step(share(x, d, dp), share(y, d, dp), share(w, d, dp))


def _full_state(tr):
    """{name: (param, exp_avg, exp_avg_sq)} of the whole model, gathered from every stage."""
    st = tr.optimizer.state
    mine = {
        p.name: (p.data.copy(), st[p.name]["exp_avg"].copy(), st[p.name]["exp_avg_sq"].copy())
        for p in tr.stage.parameters()
    }
    out = {}
    for part in tr.comm.allgather_obj(mine):
        out.update(part)
    return out


def _assert_same_state(a, b, exact=True):
    assert sorted(a) == sorted(b)
    for name in a:
        for x, y, what in zip(a[name], b[name], ("param", "exp_avg", "exp_avg_sq")):
            if exact:
                assert np.array_equal(x, y), f"{name} {what}"
            else:
                np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12, err_msg=f"{name} {what}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_pp2_to_pp1_and_back(comm, shared_dir):
    if comm.size % 2:
        pytest.skip("pp=2 needs an even world")
    data = batches("mlp", [12, 12, 12, 12], masked=True)
    a = _trainer(comm, pp=2)
    for b in data[:2]:
        _step(a, b)
    path = checkpoint.save(os.path.join(shared_dir, "pp2.h5"), a)
    header = checkpoint.load(path, _trainer(comm, pp=2, seed=9))  # same layout loads too
    assert header["layout"] == {"dp": comm.size // 2, "tp": 1, "pp": 2}

    # pp=2 -> pp=1 (every rank a full replica): weights and Adam state value for value.
    b1 = _trainer(comm, pp=1, seed=7)
    checkpoint.load(path, b1)
    assert b1.global_step == a.global_step == 2 and b1.optimizer.step_count == 2
    _assert_same_state(_full_state(a), _full_state(b1))
    # ... and both continue the same training.
    la, lb = _step(a, data[2]).loss, _step(b1, data[2]).loss
    assert la == pytest.approx(lb, rel=1e-10)
    _assert_same_state(_full_state(a), _full_state(b1), exact=False)

    # pp=1 -> pp=2.
    path1 = checkpoint.save(os.path.join(shared_dir, "pp1.h5"), b1)
    c = _trainer(comm, pp=2, seed=5)
    checkpoint.load(path1, c)
    assert c.global_step == 3 and c.optimizer.step_count == 3
    _assert_same_state(_full_state(b1), _full_state(c))
    assert _step(c, data[3]).loss == pytest.approx(_step(b1, data[3]).loss, rel=1e-10)


def _dropout_mlp(seed):
    g = np.random.default_rng(seed)
    return Sequential(
        Linear(6, 16, rng=g, dtype=np.float64), ReLU(), Dropout(0.25, rng=seed + 100),
        Linear(16, 16, rng=g, dtype=np.float64), ReLU(), Dropout(0.25, rng=seed + 200),
        Linear(16, 8, rng=g, dtype=np.float64), ReLU(), Linear(8, 3, rng=g, dtype=np.float64),
    )  # fmt: skip


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stop_and_resume_equals_uninterrupted(comm, shared_dir, schedule):
    pp = comm.size
    data = batches("mlp", [9, 12, 12, 10, 12, 12])
    whole = _trainer(comm, pp, model=_dropout_mlp(0), schedule=schedule)
    losses = [_step(whole, b).loss for b in data]

    first = _trainer(comm, pp, model=_dropout_mlp(0), schedule=schedule)
    for b in data[:3]:
        _step(first, b)
    path = checkpoint.save(os.path.join(shared_dir, "mid.h5"), first)
    # Another seed: parameters, Adam state and the dropout generators must all come from the file.
    resumed = _trainer(comm, pp, model=_dropout_mlp(3), schedule=schedule)
    checkpoint.load(path, resumed)
    after = [_step(resumed, b).loss for b in data[3:]]
    assert after == losses[3:]  # same layout: bitwise
    _assert_same_state(_full_state(whole), _full_state(resumed))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_fit_resumes_mid_epoch_exactly(comm, shared_dir):
    from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler

    g = np.random.default_rng(3)
    xs, ys = g.standard_normal((40, 6)), g.standard_normal((40, 3))

    def loader():
        return DataLoader(ArrayDataset(xs, ys), batch_size=8, sampler=ShardedSampler(40, 0, 1, seed=4))

    quiet = {"progress": False, "log_every": 1000}
    full = [s.loss for s in _trainer(comm, comm.size).fit(loader(), epochs=3, **quiet)]
    _trainer(comm, comm.size).fit(loader(), epochs=3, checkpoint_dir=shared_dir, checkpoint_every=3, **quiet)
    comm.barrier()
    if comm.rank == 0:  # keep only the checkpoint taken in the middle of epoch 1 (step 9 of 15)
        for path in checkpoint.list_checkpoints(shared_dir):
            if not path.endswith("ckpt-00000009.h5"):
                checkpoint.remove(path)
    comm.barrier()
    resumed = _trainer(comm, comm.size, seed=5)
    rest = resumed.fit(loader(), epochs=3, checkpoint_dir=shared_dir, checkpoint_every=100, **quiet)
    assert [s.loss for s in rest] == full[9:] and resumed.global_step == 15
