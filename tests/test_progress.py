"""Gradient progress choices (poll, thread, none): same training as one process, clear refusals."""

from __future__ import annotations

import numpy as np
import pytest

import hpctrain as ht
from hpctrain import settings
from hpctrain.comm import progress
from hpctrain.errors import ConfigError
from hpctrain.parallel import DataParallelTrainer
from hpctrain.parallel.reducer import AllReduceReducer


def _gpt():
    return ht.nn.GPT(vocab_size=11, block_size=8, d_model=16, n_heads=2, n_layers=3, rng=0, dtype=np.float64)


def _data(n):
    g = np.random.default_rng(5)
    return g.integers(0, 11, (n, 8)), g.integers(0, 11, (n, 8))


def _serial(steps, batches):
    model = _gpt()
    opt = ht.optim.AdamW(model.parameters(), lr=1e-2)
    loss = ht.nn.CrossEntropyLoss()
    for x, y in batches[:steps]:
        opt.zero_grad()
        loss.forward(model.forward(x), y)
        model.backward(loss.backward())
        opt.step()
    return {n: p.data.copy() for n, p in model.named_parameters()}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("choice", progress.PROGRESS)
def test_every_progress_choice_trains_like_one_process(comm, choice):
    n = 2 * comm.size
    batches = [_data(n) for _ in range(3)]
    model = _gpt()
    opt = ht.optim.AdamW(model.parameters(), lr=1e-2)
    # Tiny buckets: several start while backward still runs, so the choice really matters.
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=comm,
                             reducer=lambda params, dp: AllReduceReducer(params, dp, bucket_mb=0.001, progress=choice))
    assert tr.reducer.progress == choice and len(tr.buckets.buckets) > 3
    b = n // comm.size
    for x, y in batches:
        tr.step(x[comm.rank * b:(comm.rank + 1) * b], y[comm.rank * b:(comm.rank + 1) * b])
    assert tr.buckets.overlapped > 0  # buckets started during backward
    want = _serial(3, batches)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.data, want[name], rtol=1e-10, atol=1e-12, err_msg=name)
    tr.check_replicas()
    tr.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_unknown_progress_is_refused_on_every_rank(comm, monkeypatch):
    model = _gpt()
    with pytest.raises(ValueError, match="progress must be one of"):
        AllReduceReducer(model.parameters(), comm, progress="spin")
    monkeypatch.setenv("HPCTRAIN_PROGRESS", "spin")
    with pytest.raises(ConfigError, match="HPCTRAIN_PROGRESS"):
        DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                            optimizer=ht.optim.SGD(model.parameters(), lr=0.1), comm=comm)
    monkeypatch.setenv("HPCTRAIN_PROGRESS", "thread")  # the environment picks the default
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                             optimizer=ht.optim.SGD(model.parameters(), lr=0.1), comm=comm)
    assert tr.reducer.progress == "thread"
    tr.close()


def test_progress_setting_from_the_environment(monkeypatch):
    monkeypatch.delenv("HPCTRAIN_PROGRESS", raising=False)
    assert settings.progress() == "poll"
    monkeypatch.setenv("HPCTRAIN_PROGRESS", "Thread")
    assert settings.progress() == "thread"
    monkeypatch.setenv("HPCTRAIN_PROGRESS", "busy")
    with pytest.raises(ConfigError, match="HPCTRAIN_PROGRESS"):
        settings.progress()


def test_progress_thread_parks_when_nothing_is_in_flight():
    progress.begin()
    progress.begin()
    progress.end()
    assert progress._wake.is_set()  # one user left
    progress.end()
    assert not progress._wake.is_set()
    progress.end()  # an extra end never goes negative
    assert progress._users == 0
