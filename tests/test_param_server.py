"""ParameterServerTrainer on real MPI windows: sync == serial SGD, async/ssp converge, the SSP
staleness bound holds, uneven step counts close cleanly, errors reach every rank, checkpoints
resume exactly. Run at n=2, 3 and 4 (nothing here assumes a world size)."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from interrupt import Interrupted, Stop
from mpi4py import MPI

from hpctrain import Communicator, checkpoint
from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
from hpctrain.errors import MismatchError, NonFiniteError, WindowError
from hpctrain.nn import Linear, MSELoss, ReLU, Sequential
from hpctrain.optim import SGD
from hpctrain.parallel import ParameterServerTrainer

mpi = pytest.mark.mpi(min_size=2)


def mlp(seed: int = 0) -> Sequential:
    return Sequential(Linear(5, 7, rng=seed, dtype=np.float64), ReLU(), Linear(7, 3, rng=seed + 1, dtype=np.float64))


def batches(steps: int, rows: int, seed: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    g = np.random.default_rng(seed)
    return [(g.normal(size=(rows, 5)), g.normal(size=(rows, 3))) for _ in range(steps)]


def my_rows(rows: int, comm: Communicator) -> np.ndarray:
    """Uneven split of a global batch (rank r may get one row more than rank r+1)."""
    return np.array_split(np.arange(rows), comm.size)[comm.rank]


def flat(model) -> np.ndarray:
    return np.concatenate([p.data.ravel() for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0])])


def serial_sgd(data, lr: float, momentum: float = 0.0) -> tuple[list[np.ndarray], list[float]]:
    model, loss = mlp(), MSELoss()
    opt = SGD(model.parameters(), lr=lr, momentum=momentum)
    params, losses = [], []
    for x, y in data:
        opt.zero_grad()
        losses.append(loss.forward(model.forward(x), y))
        model.backward(loss.backward())
        opt.step()
        params.append(flat(model))
    return params, losses


# -- sync == serial SGD --------------------------------------------------------------------------


@mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("servers", ["all", "first"])
def test_sync_equals_serial_sgd(comm, momentum, servers):
    rows = 4 * comm.size + 1
    data = batches(6, rows)
    ref_params, ref_losses = serial_sgd(data, lr=0.05, momentum=momentum)
    model = mlp(seed=comm.rank * 10)  # rank 0's initial values are broadcast
    srv = None if servers == "all" else [0]
    with ParameterServerTrainer(
        model=model, loss=MSELoss(), lr=0.05, comm=comm, mode="sync", momentum=momentum, servers=srv
    ) as t:
        for (x, y), want, want_loss in zip(data, ref_params, ref_losses):
            idx = my_rows(rows, comm)
            stats = t.step(x[idx], y[idx])
            np.testing.assert_allclose(flat(model), want, rtol=0, atol=1e-12)
            assert stats.loss == pytest.approx(want_loss, rel=1e-12)
            assert stats.samples == rows
            assert stats.extra["lag"] == 0
    assert t.global_step == len(data)


# -- async and ssp converge ---------------------------------------------------------------------


def regression(n: int = 512, d: int = 8, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, d))
    w = g.normal(size=(d, 2))
    return x, x @ w + 0.01 * g.normal(size=(n, 2))


def run_workers(comm, mode: str, steps: int, staleness: int = 2, slow_ms: float = 0.0, lr: float = 0.05):
    """Each rank trains on its own random batches; the last rank sleeps ``slow_ms`` per step.

    Returns (trainer after close, initial full-data loss, final full-data loss, lags seen)."""
    x, y = regression()
    model = Sequential(Linear(8, 2, rng=0, dtype=np.float64))
    loss = MSELoss()
    before = loss.forward(model.forward(x), y)
    t = ParameterServerTrainer(model=model, loss=loss, lr=lr, comm=comm, mode=mode, staleness=staleness, timeout=60)
    g = np.random.default_rng(100 + comm.rank)
    lags = []
    for _ in range(steps):
        if slow_ms and comm.rank == comm.size - 1:
            time.sleep(slow_ms / 1000)
        idx = np.sort(g.choice(len(x), 16, replace=False))
        lags.append(t.step(x[idx], y[idx]).extra["lag"])
    t.close()
    after = loss.forward(model.forward(x), y)
    return t, before, after, lags


@mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_converge(comm, mode):
    t, before, after, _ = run_workers(comm, mode, steps=150, slow_ms=2)
    assert after < 0.01 * before, (before, after)
    # close() leaves every replica equal to the servers' final state.
    everyone = comm.allgather(flat(t.model))
    for other in everyone[1:]:
        np.testing.assert_array_equal(other, everyone[0])


@mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_ssp_staleness_bound_never_exceeded(comm, staleness):
    # The last rank is slow, so the others run into the bound: the largest lag seen anywhere must
    # reach it (the test would notice a wait that never happens) and never pass it.
    _, _, _, lags = run_workers(comm, "ssp", steps=15, staleness=staleness, slow_ms=15)
    every = [lag for lg in comm.allgather_obj(lags) for lag in lg]
    assert max(every) <= staleness
    assert max(every) == staleness


@mpi
@pytest.mark.timeout(120)
def test_async_lag_is_recorded_and_can_exceed_any_bound(comm):
    _, _, _, lags = run_workers(comm, "async", steps=20, slow_ms=15)
    every = [lag for lg in comm.allgather_obj(lags) for lag in lg]
    # No waiting in async: fast workers run well ahead of the sleeping one.
    assert max(every) >= 3


# -- shutdown -----------------------------------------------------------------------------------


@mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_uneven_step_counts_close_cleanly(comm, mode):
    x, y = regression()
    model = Sequential(Linear(8, 2, rng=0, dtype=np.float64))
    t = ParameterServerTrainer(model=model, loss=MSELoss(), lr=0.01, comm=comm, mode=mode, staleness=1, timeout=60)
    steps = 3 + 4 * comm.rank  # rank 0 stops first; with ssp the others must not wait on it
    for i in range(steps):
        t.step(x[i * 8 : i * 8 + 8], y[i * 8 : i * 8 + 8])
    t.close()
    t.close()  # twice is a no-op
    assert t.global_step == steps
    everyone = comm.allgather(flat(model))
    for other in everyone[1:]:
        np.testing.assert_array_equal(other, everyone[0])
    with pytest.raises(WindowError, match="after close"):
        t.step(x[:8], y[:8])


# -- errors on every rank -----------------------------------------------------------------------


@mpi
@pytest.mark.timeout(60)
def test_mismatched_config_raises_on_every_rank(comm):
    mode = "ssp" if comm.rank == comm.size - 1 else "async"
    with pytest.raises(MismatchError, match="parameter-server configuration"):
        ParameterServerTrainer(model=mlp(), loss=MSELoss(), lr=0.1, comm=comm, mode=mode)


@mpi
@pytest.mark.timeout(60)
def test_bad_argument_on_one_rank_raises_on_every_rank(comm):
    mode = "bogus" if comm.rank == 0 else "sync"
    with pytest.raises(ValueError, match="rank 0: mode must be one of"):
        ParameterServerTrainer(model=mlp(), loss=MSELoss(), lr=0.1, comm=comm, mode=mode)
    with pytest.raises(ValueError, match="momentum is supported only with mode='sync'"):
        ParameterServerTrainer(model=mlp(), loss=MSELoss(), lr=0.1, comm=comm, mode="async", momentum=0.9)
    with pytest.raises(ValueError, match="servers must be distinct ranks"):
        ParameterServerTrainer(model=mlp(), loss=MSELoss(), lr=0.1, comm=comm, servers=[0, comm.size])


@mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_nonfinite_reaches_every_rank(comm, mode):
    t = ParameterServerTrainer(model=mlp(), loss=MSELoss(), lr=0.1, comm=comm, mode=mode, staleness=0, timeout=30)
    x, y = batches(1, 4)[0]
    t.step(x, y)
    comm.barrier()
    if comm.rank == 0:
        x = x.copy()
        x[0, 0] = np.nan
    # Rank 0 raises at once (in sync mode every rank does); the others at the first step that
    # sees its flag in the clock window (an ssp worker while waiting for rank 0).
    with pytest.raises(NonFiniteError, match="rank 0"):
        for _ in range(5000):
            t.step(x, y)
            time.sleep(0.001)
    t.close()


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_nonfinite_on_two_workers_at_once(comm, mode):
    """Two workers flag at the same step: the others name one of them or count both, never a
    rank that did not flag (the flag is a sum of (1 << 32) + rank + 1 per flagging worker)."""
    t = ParameterServerTrainer(model=mlp(), loss=MSELoss(), lr=0.1, comm=comm, mode=mode, staleness=0, timeout=30)
    x, y = batches(1, 4)[0]
    t.step(x, y)
    comm.barrier()
    if comm.rank in (0, 1):
        x = x.copy()
        x[0, 0] = np.nan
    with pytest.raises(NonFiniteError) as info:
        for _ in range(5000):
            t.step(x, y)
            time.sleep(0.001)
    expected = f"rank {comm.rank}: non-finite" if comm.rank < 2 else r"(rank [01]|2 workers) hit a non-finite"
    assert re.search(expected, str(info.value)), str(info.value)
    t.close()


@mpi
@pytest.mark.timeout(60)
def test_nonfinite_skip_keeps_parameters(comm):
    model = mlp()
    t = ParameterServerTrainer(model=model, loss=MSELoss(), lr=0.1, comm=comm, mode="sync", on_nonfinite="skip")
    x, y = batches(1, 4)[0]
    before = flat(model)
    if comm.rank == comm.size - 1:
        x = x.copy()
        x[1, 1] = np.inf
    with np.errstate(invalid="ignore"):
        assert t.step(x, y).skipped
    np.testing.assert_array_equal(flat(model), before)
    t.close()


# -- checkpoints --------------------------------------------------------------------------------


@mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sync_stop_and_resume_equals_uninterrupted(comm, shared_dir, momentum):
    rows = 3 * comm.size
    data = batches(8, rows, seed=11)
    idx = my_rows(rows, comm)
    kw = dict(loss=MSELoss(), lr=0.05, comm=comm, mode="sync", momentum=momentum)

    with ParameterServerTrainer(model=mlp(), **kw) as full:
        for x, y in data:
            full.step(x[idx], y[idx])
    want = flat(full.model)

    directory = shared_dir
    path = os.path.join(directory, "ps.h5")
    with ParameterServerTrainer(model=mlp(), **kw) as first:
        for x, y in data[:5]:
            first.step(x[idx], y[idx])
        checkpoint.save(path, first)
    # A fresh trainer with other initial values picks up where the first one stopped.
    with ParameterServerTrainer(model=mlp(seed=42), **kw) as resumed:
        checkpoint.load(path, resumed)
        assert resumed.global_step == 5
        for x, y in data[5:]:
            resumed.step(x[idx], y[idx])
    np.testing.assert_allclose(flat(resumed.model), want, rtol=0, atol=1e-12)

    # Saved from n ranks, loaded into one process: continues like the serial reference.
    ref, _ = serial_sgd([(x, y) for x, y in data], lr=0.05, momentum=momentum)
    if comm.rank == 0:
        solo = ParameterServerTrainer(model=mlp(seed=5), **{**kw, "comm": Communicator(MPI.COMM_SELF)})
        checkpoint.load(path, solo)
        for x, y in data[5:]:
            solo.step(x, y)
        solo.close()
        np.testing.assert_allclose(flat(solo.model), ref[-1], rtol=0, atol=1e-12)
    comm.barrier()


@mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_checkpoint_restores_the_servers_state(comm, shared_dir, mode):
    x, y = regression()
    kw = dict(loss=MSELoss(), lr=0.02, comm=comm, mode=mode, staleness=1, timeout=60)
    directory = shared_dir
    path = os.path.join(directory, "ps-async.h5")
    t = ParameterServerTrainer(model=Sequential(Linear(8, 2, rng=0, dtype=np.float64)), **kw)
    for i in range(6):
        t.step(x[i * 8 + comm.rank :: 64][:8], y[i * 8 + comm.rank :: 64][:8])
    checkpoint.save(path, t)  # collective: the servers' state at this point, whole
    saved = flat(t.model)
    t.close()
    fresh = ParameterServerTrainer(model=Sequential(Linear(8, 2, rng=9, dtype=np.float64)), **kw)
    checkpoint.load(path, fresh)
    assert fresh.global_step == 6 and fresh.clock == 6
    np.testing.assert_array_equal(flat(fresh.model), saved)
    fresh.shards()  # pulls from the servers: they hold the checkpoint's values too
    np.testing.assert_array_equal(flat(fresh.model), saved)
    everyone = comm.allgather(saved)  # the snapshot is the same on every rank
    for other in everyone[1:]:
        np.testing.assert_array_equal(other, everyone[0])
    fresh.step(x[:8], y[:8])  # and training goes on from there
    fresh.close()


def _loader(comm) -> DataLoader:
    g = np.random.default_rng(21)
    data = ArrayDataset(g.normal(size=(45, 5)), g.normal(size=(45, 3)))
    return DataLoader(data, batch_size=4, sampler=ShardedSampler(45, comm.rank, comm.size, seed=2, pad="mask"))


@mpi
@pytest.mark.timeout(180)
def test_sync_fit_stop_and_resume_equals_uninterrupted(comm, tmp_path):
    """fit() with a checkpoint cadence, killed mid-epoch, resumed by a fresh trainer (other init):
    same losses and parameters as one uninterrupted fit (sampler position, clock, velocity)."""
    root = comm.bcast_obj(str(tmp_path) if comm.rank == 0 else None)
    kw = dict(loss=MSELoss(), lr=0.05, comm=comm, mode="sync", momentum=0.5)
    with ParameterServerTrainer(model=mlp(), **kw) as full:
        history = full.fit(_loader(comm), epochs=3, progress=False, log_every=1000)
    per_epoch = len(_loader(comm))
    stop = per_epoch + 2
    d = os.path.join(root, "ps-ckpts")
    with ParameterServerTrainer(model=mlp(), **kw) as first:
        with pytest.raises(Stop):
            first.fit(Interrupted(_loader(comm), first, stop), epochs=3, checkpoint_dir=d, checkpoint_every=2,
                      progress=False)
    with ParameterServerTrainer(model=mlp(seed=8), **kw) as second:
        rest = second.fit(_loader(comm), epochs=3, checkpoint_dir=d, checkpoint_every=2, progress=False)
        assert second.global_step == full.global_step and second.clock == full.clock
    last = stop - stop % 2
    np.testing.assert_allclose([s.loss for s in rest], [s.loss for s in history[last:]], rtol=1e-12)
    np.testing.assert_allclose(flat(second.model), flat(full.model), rtol=0, atol=1e-12)


@mpi
@pytest.mark.timeout(60)
def test_ssp_zero_timeout_means_no_limit_and_the_clock_wait_is_watched(comm, shared_dir):
    """timeout=0 is "off" (as everywhere), not "expire now": a worker held back by a slow one
    waits for it; while it waits, the watchdog sees the wait and names the slow worker.

    The slow rank does not step until rank 0's watched wait has named it (a file in the shared
    directory), so the test does not depend on how fast an oversubscribed machine gets rank 0 to
    its wait (a fixed sleep did not: CI once saw rank 0 arrive after the slow rank had gone on)."""
    from hpctrain.comm import watchdog

    t = ParameterServerTrainer(model=mlp(), loss=MSELoss(), lr=0.01, comm=comm, mode="ssp", staleness=0, timeout=0)
    assert t.timeout == 0
    x, y = batches(1, 4)[0]
    named = os.path.join(shared_dir, "named")
    seen, real = [], watchdog.begin
    if comm.rank == comm.size - 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(named):  # everyone else reaches the clock wait and waits for this rank
            assert time.monotonic() < deadline, "rank 0 never named the slow rank in its clock wait"
            time.sleep(0.01)
    elif comm.rank == 0:

        def spy(c, op, peer=None, seq=None):
            if op.startswith("ssp clock wait"):
                seen.append(peer)
                if peer == comm.size - 1:
                    open(named, "w").close()
            return real(c, op, peer, seq)

        watchdog.begin = spy
    try:
        for _ in range(3):
            stats = t.step(x, y)
            assert np.isfinite(stats.loss)
    finally:
        watchdog.begin = real
    t.close()
    if comm.rank == 0:
        assert comm.size - 1 in seen, seen  # waited, watched, naming the slow rank (among others that lag)
