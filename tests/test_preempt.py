"""Preemption in ``fit``: a stop requested on one rank ends every rank after the same step, with a
checkpoint of that step, and a resumed run ends bitwise where an uninterrupted one ends."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import hpctrain as ht
from hpctrain import checkpoint as ckpt
from hpctrain import preempt
from hpctrain.comm import watchdog
from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
from hpctrain.errors import ExitStatus, Preempted
from hpctrain.nn import Linear, ReLU, Sequential
from hpctrain.parallel import DataParallelTrainer

N, D_IN, D_OUT, BATCH = 40, 5, 3, 4


def make(comm):
    r = np.random.default_rng(0)
    model = Sequential(Linear(D_IN, 8, rng=r, dtype=np.float64), ReLU(), Linear(8, D_OUT, rng=r, dtype=np.float64))
    opt = ht.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=comm)
    g = np.random.default_rng(5)
    data = ArrayDataset(g.normal(size=(N, D_IN)), g.integers(0, D_OUT, N))
    loader = DataLoader(data, batch_size=BATCH, sampler=ShardedSampler(N, comm.rank, comm.size, seed=3, pad="mask"))
    return model, trainer, loader


class AskToStop:
    """A loader that makes one rank request a stop once the trainer has made ``at`` steps."""

    def __init__(self, inner, trainer, at: int, rank: int) -> None:
        self.inner, self.trainer, self.at, self.rank, self.sampler = inner, trainer, at, rank, inner.sampler

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        for batch in self.inner:
            if self.trainer.global_step == self.at and self.trainer.comm.rank == self.rank:
                preempt.request("test")
            yield batch


@pytest.fixture(autouse=True)
def _clean_flag():
    preempt.clear()
    yield
    preempt.clear()


def _dir(comm, tmp_path) -> str:
    return comm.bcast_obj(str(tmp_path) if comm.rank == 0 else None)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("every", "at", "background"),
                         [(None, 6, False), (4, 6, False), (4, 7, False), (5, "epoch end", False), (4, 7, True)])
def test_stop_on_one_rank_checkpoints_that_step_everywhere_and_resume_is_exact(comm, tmp_path, every, at, background):
    """(4, 7, True): asynchronous checkpoints, the stop step's own periodic save still in the
    background when the stop is agreed: it is committed before Preempted is raised."""
    d = _dir(comm, tmp_path)
    model, trainer, loader = make(comm)
    trainer.fit(loader, epochs=3, log_every=1000, progress=False)
    ref = {n: p.data.copy() for n, p in model.named_parameters()}

    model, trainer, loader = make(comm)
    if at == "epoch end":  # stop with the last step of the second epoch (the sampler's position at its end)
        at = 2 * len(loader) - 1
    asking = AskToStop(loader, trainer, at=at, rank=comm.size - 1)  # the last rank only
    with pytest.raises(Preempted) as stop:
        trainer.fit(asking, epochs=3, checkpoint_dir=d, checkpoint_every=every, log_every=1000, progress=False,
                    async_checkpoint=background)
    # The request came before step at+1 ran: every rank finishes that step and stops there.
    assert trainer.global_step == at + 1 and stop.value.step == at + 1
    assert stop.value.checkpoint == ckpt.checkpoint_path(d, at + 1) and os.path.exists(stop.value.checkpoint)
    assert stop.value.exit_status == ExitStatus.PREEMPTED == 75
    preempt.clear()

    assert ckpt.list_checkpoints(d)[-1] == stop.value.checkpoint
    model, trainer, loader = make(comm)
    trainer.fit(loader, epochs=3, checkpoint_dir=d, checkpoint_every=every, log_every=1000, progress=False,
                async_checkpoint=background)
    for n, p in model.named_parameters():
        assert np.array_equal(p.data, ref[n]), n  # bitwise where the uninterrupted run ends


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_stop_without_checkpoint_dir_still_stops_every_rank(comm):
    _, trainer, loader = make(comm)
    with pytest.raises(Preempted) as stop:
        trainer.fit(AskToStop(loader, trainer, at=2, rank=0), epochs=3, log_every=1000, progress=False)
    assert trainer.global_step == 3 and stop.value.checkpoint is None


def test_install_routes_signals_to_the_flag_and_uninstall_restores():
    before = signal.getsignal(signal.SIGUSR1)
    assert preempt.install() == ["SIGTERM", "SIGUSR1", "SIGINT"]
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preempt.requested() and preempt.reason() == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: still the first reason, no exit
        assert preempt.reason() == "SIGUSR1"
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C after a stop request: out at once
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        preempt.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_exit_statuses_match_the_watchdog():
    assert watchdog.STALL_EXIT == ExitStatus.STALL and watchdog.EXCEPTION_EXIT == ExitStatus.FAILURE
    assert len({int(s) for s in ExitStatus}) == len(ExitStatus)
