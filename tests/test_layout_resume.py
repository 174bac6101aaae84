"""Resuming under another layout: the sampler position is rescaled by the dp size.

A run checkpointed mid-epoch under one layout and resumed under another (another dp size, or
tp / pp ranks reading the same data) must consume exactly the remaining samples: the same number
of steps and the same losses as the uninterrupted run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from interrupt import Interrupted, Stop

from hpctrain import ProcessGrid
from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
from hpctrain.nn import MLP, CrossEntropyLoss, Linear, Sequential
from hpctrain.optim import AdamW
from hpctrain.parallel import (
    DataParallelTrainer,
    PipelineParallelTrainer,
    TensorParallelTrainer,
    pipeline_stage,
    tensor_parallel,
)

D_IN, D, C, STEPS_PER_EPOCH, EPOCHS = 6, 8, 3, 8, 2


def model() -> Sequential:
    g = np.random.default_rng(0)
    return Sequential(Linear(D_IN, D, rng=g, dtype=np.float64), MLP(D, 16, rng=g, dtype=np.float64),
                      MLP(D, 16, rng=g, dtype=np.float64), Linear(D, C, rng=g, dtype=np.float64))  # fmt: skip


def build(layout: str, comm):
    """(trainer, dp rank, dp size) of ``layout`` over ``comm``."""
    m, loss = model(), CrossEntropyLoss()
    if layout == "dp":
        return DataParallelTrainer(model=m, loss=loss, optimizer=AdamW(m.parameters(), lr=1e-2), comm=comm), \
            comm.rank, comm.size  # fmt: skip
    if layout == "tp":
        grid = ProcessGrid(comm, tp=2)
        part = tensor_parallel(m, grid.tp)
        tr = TensorParallelTrainer(model=part, loss=loss, optimizer=AdamW(part.parameters(), lr=1e-2), grid=grid)
    else:
        grid = ProcessGrid(comm, pp=2)
        part = pipeline_stage(m, grid.pp)
        tr = PipelineParallelTrainer(stage=part, loss=loss, optimizer=AdamW(part.parameters(), lr=1e-2), grid=grid,
                                     microbatches=2)  # fmt: skip
    return tr, grid.dp.rank, grid.dp_size


def loader(global_batch: int, d: int, dp: int) -> DataLoader:
    n = STEPS_PER_EPOCH * global_batch
    g = np.random.default_rng(5)
    data = ArrayDataset(g.normal(size=(n, D_IN)), g.integers(0, C, n))
    return DataLoader(data, batch_size=global_batch // dp, sampler=ShardedSampler(n, d, dp, shuffle=True, seed=3))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("after", ["tp", "pp"])
def test_mid_epoch_resume_under_another_dp_size(comm, tmp_path, after):
    if comm.size % 2:
        pytest.skip(f"tp=2 / pp=2 need an even world, have {comm.size}")
    root = comm.bcast_obj(str(tmp_path) if comm.rank == 0 else None)
    gb = 2 * comm.size  # the global batch: the same under every layout
    full, d, dp = build("dp", comm)
    history = full.fit(loader(gb, d, dp), epochs=EPOCHS, progress=False)
    assert len(history) == EPOCHS * STEPS_PER_EPOCH

    first, d, dp = build("dp", comm)  # dp = world, stopped at step 5 of 8
    ckpts = os.path.join(root, f"ckpts-{after}")
    with pytest.raises(Stop):
        first.fit(Interrupted(loader(gb, d, dp), first, 5), epochs=EPOCHS, checkpoint_dir=ckpts,
                  checkpoint_every=5, progress=False)  # fmt: skip
    second, d, dp = build(after, comm)  # dp = world / 2
    assert dp == comm.size // 2
    rest = second.fit(loader(gb, d, dp), epochs=EPOCHS, checkpoint_dir=ckpts, progress=False)
    assert second.global_step == EPOCHS * STEPS_PER_EPOCH == 5 + len(rest)
    np.testing.assert_allclose([s.loss for s in rest], [s.loss for s in history[5:]], rtol=1e-10)
    assert all(s.samples == gb for s in rest)
