"""Every trainer through the same cases: they must agree with one process and with each other.

Cases: an all-padding batch, NaN with on_nonfinite="skip" and "raise", clipping, grad_norm,
the global step after a skip, and a raising step (float32 labels) followed by a good step.
Each trainer trains the same float64 model on the same global batches as one process with SGD;
after each case its parameters (through ``shards()``, so sharded layouts compare slice by slice)
must equal the serial model's.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hpctrain import ProcessGrid
from hpctrain.errors import NonFiniteError
from hpctrain.nn import MLP, CrossEntropyLoss, Linear, Sequential
from hpctrain.optim import SGD, clip_grad_norm
from hpctrain.parallel import (
    DataParallelTrainer,
    ParallelTrainer,
    ParameterServerTrainer,
    PipelineParallelTrainer,
    TensorParallelTrainer,
    pipeline_stage,
    tensor_parallel,
)

D_IN, D, C, LR, PER_REPLICA = 6, 8, 3, 0.1, 4
KINDS = ["dp", "tp", "pp", "tp_pp", "ps"]


def serial_model() -> Sequential:
    g = np.random.default_rng(0)
    return Sequential(Linear(D_IN, D, rng=g, dtype=np.float64), MLP(D, 16, rng=g, dtype=np.float64),
                      MLP(D, 16, rng=g, dtype=np.float64), Linear(D, C, rng=g, dtype=np.float64))  # fmt: skip


_built: list = []  # the test's trainers: closed after it (the parameter server's windows)


@pytest.fixture(autouse=True)
def _close_trainers():
    yield
    while _built:
        _built.pop().close()  # collective: every rank built the same trainers


def build(kind: str, comm, clip=None, policy="raise"):
    """(trainer, dp rank, dp size) for ``kind``; skips when the layout does not fit the world."""
    need = {"tp": 2, "pp": 2, "tp_pp": 4}.get(kind, 1)
    if comm.size % need:
        pytest.skip(f"{kind} needs a multiple of {need} ranks, the world has {comm.size}")
    if kind == "ps" and clip is not None:
        pytest.skip("ParameterServerTrainer applies plain SGD on the servers: it has no clip_norm")
    model, loss = serial_model(), CrossEntropyLoss()
    kw = {"clip_norm": clip, "on_nonfinite": policy}
    if kind == "dp":
        tr = DataParallelTrainer(model=model, loss=loss, optimizer=SGD(model.parameters(), lr=LR), comm=comm, **kw)
        return tr, comm.rank, comm.size
    if kind == "ps":
        tr = ParameterServerTrainer(model=model, loss=loss, lr=LR, comm=comm, mode="sync", on_nonfinite=policy)
        _built.append(tr)
        return tr, comm.rank, comm.size
    if kind == "tp":
        grid = ProcessGrid(comm, tp=2)
        part = tensor_parallel(model, grid.tp)
        tr = TensorParallelTrainer(model=part, loss=loss, optimizer=SGD(part.parameters(), lr=LR), grid=grid, **kw)
    elif kind == "pp":
        grid = ProcessGrid(comm, pp=2)
        part = pipeline_stage(model, grid.pp)
        tr = PipelineParallelTrainer(stage=part, loss=loss, optimizer=SGD(part.parameters(), lr=LR), grid=grid,
                                     microbatches=2, **kw)  # fmt: skip
    else:
        from hpctrain.parallel import parallelize

        grid = ProcessGrid(comm, tp=2, pp=2)
        part = parallelize(model, grid)
        tr = ParallelTrainer(model=part, loss=loss, optimizer=SGD(part.parameters(), lr=LR), grid=grid,
                             microbatches=2, **kw)  # fmt: skip
    return tr, grid.dp.rank, grid.dp_size


def global_batch(dp: int, seed: int):
    g = np.random.default_rng(seed)
    n = PER_REPLICA * dp
    return g.normal(size=(n, D_IN)), g.integers(0, C, n), np.ones(n)


def share(a, d, dp):
    return a[d * PER_REPLICA : (d + 1) * PER_REPLICA]


class Serial:
    """The one-process reference."""

    def __init__(self, clip=None) -> None:
        self.model, self.loss, self.clip = serial_model(), CrossEntropyLoss(), clip
        self.opt = SGD(self.model.parameters(), lr=LR)

    def step(self, x, y, w=None) -> tuple[float, float]:
        self.opt.zero_grad()
        value = self.loss.forward(self.model.forward(x), y, w)
        self.model.backward(self.loss.backward())
        norm = clip_grad_norm(self.model.parameters(), self.clip or np.inf)
        self.opt.step()
        return value, norm


def assert_same_params(tr, ref: Serial) -> None:
    full = dict(ref.model.named_parameters())
    for name, (p, _, index) in tr.shards().items():
        np.testing.assert_allclose(p.data, full[name].data[index], rtol=1e-11, atol=1e-13, err_msg=name)


def run(tr, d, dp, x, y, w=None):
    return tr.step(share(x, d, dp), share(y, d, dp), None if w is None else share(w, d, dp))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_grad_norm_and_loss_match_serial(comm, kind):
    tr, d, dp = build(kind, comm)
    ref = Serial()
    for seed in range(2):
        x, y, _ = global_batch(dp, seed)
        stats = run(tr, d, dp, x, y)
        loss, norm = ref.step(x, y)
        assert not stats.skipped and stats.samples == len(y) and stats.stop is False
        np.testing.assert_allclose(stats.loss, loss, rtol=1e-12)
        np.testing.assert_allclose(stats.grad_norm, norm, rtol=1e-10)
    assert tr.global_step == 2
    assert_same_params(tr, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_clipping_matches_serial(comm, kind):
    tr, d, dp = build(kind, comm, clip=0.05)
    ref = Serial(clip=0.05)
    for seed in range(2):
        x, y, _ = global_batch(dp, seed)
        stats = run(tr, d, dp, x, y)
        _, norm = ref.step(x, y)
        assert norm > 0.05  # the case really clips
        np.testing.assert_allclose(stats.grad_norm, norm, rtol=1e-10)  # reported before clipping
    assert_same_params(tr, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_all_padding_batch_changes_nothing(comm, kind):
    tr, d, dp = build(kind, comm)
    ref = Serial()
    x, y, w = global_batch(dp, 0)
    run(tr, d, dp, x, y)
    ref.step(x, y)
    updates = tr.optimizer.step_count if tr.optimizer is not None else None
    stats = run(tr, d, dp, x, y, np.zeros_like(w))
    assert stats.skipped and stats.samples == 0 and stats.loss == 0.0
    assert tr.global_step == 2  # a skipped step is still a step (one rule for every trainer)
    if updates is not None:
        assert tr.optimizer.step_count == updates  # ... but not an update
    assert_same_params(tr, ref)
    x, y, _ = global_batch(dp, 1)
    run(tr, d, dp, x, y)
    ref.step(x, y)
    assert_same_params(tr, ref)


def _nan_batch(dp, seed):
    x, y, w = global_batch(dp, seed)
    x = x.copy()
    x[1, 0] = np.nan  # in dp replica 0's share only
    return x, y, w


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_skip_on_every_rank_then_trains_on(comm, kind):
    tr, d, dp = build(kind, comm, policy="skip")
    ref = Serial()
    x, y, _ = _nan_batch(dp, 0)
    stats = run(tr, d, dp, x, y)
    assert stats.skipped and not np.isfinite(stats.loss) and stats.grad_norm is not None
    assert tr.global_step == 1
    assert_same_params(tr, ref)
    x, y, _ = global_batch(dp, 1)
    stats = run(tr, d, dp, x, y)
    ref.step(x, y)
    assert not stats.skipped and tr.global_step == 2
    assert_same_params(tr, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_raise_on_every_rank_then_trains_on(comm, kind):
    tr, d, dp = build(kind, comm, policy="raise")
    ref = Serial()
    x, y, _ = _nan_batch(dp, 0)
    with pytest.raises(NonFiniteError):
        run(tr, d, dp, x, y)
    assert tr.global_step == 0
    assert_same_params(tr, ref)
    x, y, _ = global_batch(dp, 1)
    stats = run(tr, d, dp, x, y)
    ref.step(x, y)
    assert not stats.skipped and tr.global_step == 1
    assert_same_params(tr, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_raising_step_leaves_the_trainer_ready(comm, kind):
    tr, d, dp = build(kind, comm)
    ref = Serial()
    x, y, _ = global_batch(dp, 0)
    run(tr, d, dp, x, y)
    ref.step(x, y)
    before = copy.deepcopy({n: p.data for n, (p, _, _) in tr.shards().items()})
    with pytest.raises(TypeError, match="integer targets"):
        run(tr, d, dp, x, y.astype(np.float32))  # on every rank, before any update
    assert tr.global_step == 1
    for n, (p, _, _) in tr.shards().items():
        np.testing.assert_array_equal(p.data, before[n])
    for seed in (1, 2):  # and the next steps train as if nothing had happened
        x, y, _ = global_batch(dp, seed)
        run(tr, d, dp, x, y)
        ref.step(x, y)
    assert tr.global_step == 3
    assert_same_params(tr, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_stop_request_on_one_rank_reaches_every_rank(comm, kind):
    from hpctrain import preempt

    tr, d, dp = build(kind, comm)
    x, y, _ = global_batch(dp, 0)
    assert run(tr, d, dp, x, y).stop is False
    if comm.rank == comm.size - 1:
        preempt.request()
    try:
        assert run(tr, d, dp, x, y).stop is True  # agreed inside the step's own collective
    finally:
        preempt.clear()
    assert run(tr, d, dp, x, y).stop is False
