"""Context parallelism in the engine: ``ParallelTrainer`` on a grid with cp > 1 (float64 GPT)
ends where one process ends, to 1e-10, with dp, tp, pp, ZeRO 1-3, recompute and clipping.

Every rank of a cp group steps on the same batch (that of its dp index); the engine takes each
rank's zigzag share of the tokens of x and y, weights its loss 1/cp, and reduces the gradients
over ``grid.dp_cp``. The layouts derive from the world size (cp=2 with dp = world / 2; cp = world;
tp or pp = 2 beside cp = 2 on 4 ranks; tp = pp = cp = 2 on 8)."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import ProcessGrid
from hpctrain.nn import GPT, CrossEntropyLoss
from hpctrain.optim import AdamW
from hpctrain.parallel import ParallelTrainer, parallelize

VOCAB, T, PER_REPLICA, STEPS = 13, 8, 4, 3


def make() -> GPT:
    return GPT(VOCAB, T, d_model=16, n_heads=4, n_layers=2, rng=np.random.default_rng(0), dtype=np.float64)


def data(dp: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(100 + seed)
    n = PER_REPLICA * dp
    return g.integers(0, VOCAB, (n, T)), g.integers(0, VOCAB, (n, T))


def serial(dp: int, clip: float | None) -> tuple[GPT, list[float]]:
    """One process, the whole global batch, the same optimizer: the reference."""
    from hpctrain.optim import clip_grad_norm

    model, loss = make(), CrossEntropyLoss()
    opt = AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(STEPS):
        x, y = data(dp, s)
        opt.zero_grad()
        losses.append(loss.forward(model.forward(x), y))
        model.backward(loss.backward())
        if clip:
            clip_grad_norm(model.parameters(), clip)
        opt.step()
    return model, losses


def check(comm, cp: int, tp: int = 1, pp: int = 1, mode: str = "ring", zero: int = 0, recompute: bool = False,
          clip: float | None = 0.5, microbatches: int = 2) -> ParallelTrainer:
    if comm.size % (cp * tp * pp):
        pytest.skip(f"cp={cp} x tp={tp} x pp={pp} does not divide a world of {comm.size}")
    grid = ProcessGrid(comm, tp=tp, pp=pp, cp=cp)
    dp, d = grid.dp_size, grid.dp.rank
    part = parallelize(make(), grid, cp_mode=mode, recompute=recompute)
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-2),
                         grid=grid, microbatches=microbatches, clip_norm=clip, zero=zero)
    stats = []
    for s in range(STEPS):
        x, y = data(dp, s)
        sl = slice(d * PER_REPLICA, (d + 1) * PER_REPLICA)  # the dp index's share: the same on its cp ranks
        stats.append(tr.step(x[sl], y[sl]))
    ref, losses = serial(dp, clip)
    # The logged loss is the one-process loss, and the samples are counted once per replica.
    np.testing.assert_allclose([st.loss for st in stats], losses, rtol=1e-10)
    assert all(st.samples == PER_REPLICA * dp for st in stats)
    full = dict(ref.named_parameters())
    for name, (p, shape, index) in tr.shards().items():
        assert tuple(shape) == full[name].shape, name
        np.testing.assert_allclose(p.data, full[name].data[index], rtol=1e-10, atol=1e-10, err_msg=name)
    assert set().union(*comm.allgather_obj(sorted(tr.shards()))) == set(full)
    tr.check_replicas()  # bitwise equal over dp x cp
    assert tr.layout["cp"] == cp and tr.config()["cp"] == cp
    return tr


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_cp2_with_dp_what_is_left_matches_one_process(comm, mode):
    tr = check(comm, cp=2, mode=mode)
    assert tr.strategy.replicas.size == comm.size  # dp x cp: every rank holds the dense parameters


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_cp_over_four_ranks_matches_one_process(comm, mode):
    check(comm, cp=4, mode=mode)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("split", [{"tp": 2}, {"pp": 2}, {"tp": 2, "mode": "ulysses"}])
def test_cp2_beside_tp_or_pp_matches_one_process(comm, split):
    check(comm, cp=2, **split)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_cp2_with_zero_shards_over_dp_x_cp(comm, zero):
    tr = check(comm, cp=2, zero=zero)
    assert tr.reducer.describe()  # ZeRO's reducer over the replicas (dp x cp), not over dp alone
    assert tr.strategy.replicas.size == 2 * tr.grid.dp_size


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_cp2_with_recompute_and_one_microbatch(comm):
    check(comm, cp=2, recompute=True, microbatches=1, clip=None)


@pytest.mark.mpi(min_size=8)
@pytest.mark.timeout(180)
def test_cp2_x_tp2_x_pp2_matches_one_process(comm):
    check(comm, cp=2, tp=2, pp=2)
