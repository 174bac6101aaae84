"""``ParallelTrainer.rebind``: the communicators, the reducer, the overlap hooks and ZeRO's pieces
rebuilt over a new grid by the rule the constructor uses, which the rank-loss recovery calls after
a shrink (here without losing a rank: a grid over the same ranks, anew, so that training must go on
exactly as a trainer that was never rebound); and ``RankLoss`` refusing a trainer it cannot recover.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_mlp

from hpctrain.comm.grid import ProcessGrid
from hpctrain.nn import MSELoss
from hpctrain.optim import Adam
from hpctrain.optim.sharded import assemble
from hpctrain.parallel import ParallelTrainer

PER_RANK, D_IN, D_OUT = 4, 5, 3


def _trainer(comm, **kw):
    model = make_mlp(D_IN, D_OUT, width=8)
    return ParallelTrainer(model=model, loss=MSELoss(), optimizer=Adam(model.parameters(), lr=0.01),
                           grid=ProcessGrid(comm), **kw)


def _batches(comm, steps):
    g = np.random.default_rng(7)
    mine = slice(comm.rank * PER_RANK, (comm.rank + 1) * PER_RANK)
    out = []
    for _ in range(steps):
        x, y = g.normal(size=(PER_RANK * comm.size, D_IN)), g.normal(size=(PER_RANK * comm.size, D_OUT))
        out.append((x[mine], y[mine]))
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kw", [{"backend": "hierarchical"}, {"zero": 1}, {"zero": 3}],
                         ids=["hierarchical", "zero1", "zero3"])
def test_rebind_rebuilds_by_the_constructors_rule_and_training_goes_on_alike(comm, kw):
    ref, tr = _trainer(comm, **kw), _trainer(comm, **kw)
    batches = _batches(comm, 4)
    try:
        for x, y in batches[:2]:
            ref.step(x, y)
            tr.step(x, y)
        old, described = tr.reducer, tr.reducer.describe()
        full = None
        if tr.zero:  # what the recovery hands over: every dp rank's pieces put together
            full = assemble(comm.allgather_obj(tr.reducer.export_pieces()))
            old.remove()
        grid = ProcessGrid(comm.dup())
        tr.rebind(grid, full)
        assert (tr.grid, tr.comm, tr.dp) == (grid, grid.world, grid.dp)
        assert tr.reducer is not old and tr.reducer.describe() == described
        assert (tr.strategy.hooks is None) == (ref.strategy.hooks is None)
        if "backend" in kw:  # the constructor's rule, backend= included (the recovery once dropped it)
            assert type(tr.buckets.reducer).__name__ == type(ref.buckets.reducer).__name__ == "HierarchicalComm"
        for x, y in batches[2:]:
            assert tr.step(x, y).loss == pytest.approx(ref.step(x, y).loss, rel=1e-12)
        mine, theirs = ref.shards(), tr.shards()
        for name, (p, _, _) in mine.items():
            np.testing.assert_allclose(theirs[name][0].data, p.data, rtol=1e-12, atol=1e-15, err_msg=name)
    finally:
        ref.close()
        tr.close()


@pytest.mark.mpi(min_size=2)
def test_rank_loss_refuses_a_trainer_it_cannot_recover_on_every_rank(comm):
    from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
    from hpctrain.parallel import ParameterServerTrainer
    from hpctrain.resilience import RankLoss

    n = 2 * PER_RANK * comm.size
    g = np.random.default_rng(0)
    loader = DataLoader(ArrayDataset(g.normal(size=(n, D_IN)), g.normal(size=(n, D_OUT))), PER_RANK,
                        ShardedSampler(n, comm.rank, comm.size))
    ps = ParameterServerTrainer(model=make_mlp(D_IN, D_OUT, width=8), loss=MSELoss(), lr=0.1, comm=comm)
    try:
        ps.rank_loss = RankLoss(loader)
        with pytest.raises(ValueError, match=r"data-parallel replicas only .* not strategy='ps'"):
            ps.fit(loader, 1)
        assert ps.global_step == 0  # refused before the first step
    finally:
        ps.close()
