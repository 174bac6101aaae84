"""Preemption in ``fit``: a stop requested on one rank ends every rank after the same step, with a
checkpoint of that step, and a resumed run ends bitwise where an uninterrupted one ends. The
asynchronous parameter server (async, ssp), whose workers do not step together, goes through the
same cases: every worker stops at one agreed clock and the resume starts from its checkpoint."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import hpctrain as ht
from hpctrain import checkpoint as ckpt
from hpctrain import preempt
from hpctrain.comm import failure, watchdog
from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
from hpctrain.errors import ExitStatus, Preempted
from hpctrain.nn import Linear, ReLU, Sequential
from hpctrain.parallel import DataParallelTrainer, ParameterServerTrainer

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


def make_ps(comm, mode: str, seed: int = 0):
    r = np.random.default_rng(seed)
    model = Sequential(Linear(D_IN, 8, rng=r, dtype=np.float64), ReLU(), Linear(8, D_OUT, rng=r, dtype=np.float64))
    trainer = ParameterServerTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), lr=0.05, comm=comm, mode=mode,
                                     staleness=1, timeout=60)
    return model, trainer, ps_loader(comm)


def ps_loader(comm) -> DataLoader:
    n = 6 * BATCH * comm.size  # 6 steps per epoch on every rank, whatever the world size
    g = np.random.default_rng(5)
    data = ArrayDataset(g.normal(size=(n, D_IN)), g.integers(0, D_OUT, n))
    return DataLoader(data, batch_size=BATCH, sampler=ShardedSampler(n, comm.rank, comm.size, seed=3))


class AskToStopAsync(AskToStop):
    """``AskToStop`` for workers that do not step together: rank ``rank`` requests a stop once it
    has made ``at`` steps (``rank=None``: every rank, rank r after ``at + r`` steps). With ``gate``
    the other ranks run ahead to step ``at + 2`` and wait there until the requester has finished
    its step ``at + 1`` (a file in ``gate``): the stop is then agreed while they are ahead of it,
    so the requester must catch up to the stop clock (async has no bound on the lead otherwise,
    and a rank that finished its epochs before the stop was agreed would just end the run)."""

    def __init__(self, inner, trainer, at: int, rank: int | None, gate: str | None = None) -> None:
        super().__init__(inner, trainer, at, rank if rank is not None else trainer.comm.rank)
        self.at += trainer.comm.rank if rank is None else 0
        self.gate = gate

    def __iter__(self):
        me = self.trainer.comm.rank == self.rank
        for batch in self.inner:
            step = self.trainer.global_step
            if me and step == self.at:
                preempt.request("test")
            if self.gate and me and step == self.at + 1:
                open(self.gate, "w").close()
            if self.gate and not me and step == self.at + 2:
                deadline = time.monotonic() + 30
                while not os.path.exists(self.gate):
                    assert time.monotonic() < deadline, "the requesting rank never finished its step"
                    self.trainer.progress()  # serve the window traffic aimed at this rank meanwhile
                    time.sleep(0.001)
            yield batch


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "ssp"])
@pytest.mark.parametrize(("who", "every"), [("one", None), ("all", None), ("all", 2)])
def test_parameter_server_workers_stop_at_one_agreed_step_and_resume_from_it(comm, tmp_path, mode, who, every):
    """async/ssp workers step at their own pace; a stop asked on the last rank (who="one": while the
    others are ahead of it) or on every rank at different steps (who="all") ends every rank's fit
    with ``Preempted`` at the same step, with one checkpoint of that step (same name everywhere,
    the servers' state); periodic checkpoints (every=2) between the request and the stop still
    meet. Resumed (by fresh trainers with other initial values, or with every=2 by the stopped
    ones themselves), training starts from exactly that step and those parameters, bitwise, and
    runs the remaining steps; what follows is not bitwise reproducible (the workers' pushes
    interleave as they happen to)."""
    d = _dir(comm, tmp_path)
    at = 2
    _, trainer, loader = make_ps(comm, mode)
    if who == "one":
        asking = AskToStopAsync(loader, trainer, at, comm.size - 1, gate=os.path.join(d, "gate"))
    else:
        asking = AskToStopAsync(loader, trainer, at, None)
    ckdir = os.path.join(d, "ckpt")
    with pytest.raises(Preempted) as stop:
        trainer.fit(asking, epochs=2, checkpoint_dir=ckdir, checkpoint_every=every, keep=10, log_every=1000,
                    progress=False)
    step = stop.value.step
    assert comm.allgather_obj((step, trainer.global_step, trainer.clock, stop.value.checkpoint)) == (
        [(step, step, step, ckpt.checkpoint_path(ckdir, step))] * comm.size)
    # Not before the first request's step; not after the step every rank reaches once the stop was
    # started (the gated ranks wait at at + 2 for it; with who="all" the last asks at at + size - 1).
    assert at + 1 <= step <= (at + 3 if who == "one" else at + comm.size + 1)
    periodic = [ckpt.checkpoint_path(ckdir, k) for k in range(every or step, step, every or 1)]
    assert ckpt.list_checkpoints(ckdir) == [*periodic, stop.value.checkpoint]  # the stop's: one, by all
    saved = {n: p.data.copy() for n, (p, _, _) in trainer.shards().items()}
    everyone = comm.allgather_obj(saved)
    for n in saved:
        assert all(np.array_equal(e[n], saved[n]) for e in everyone), n  # one state on every rank
    preempt.clear()

    class Start:
        def on_fit_start(self, t):
            self.step, self.params = t.global_step, {n: p.data.copy() for n, (p, _, _) in t.shards().items()}

    if every:  # the same trainer goes on: loading the checkpoint clears the agreed stop
        resumed, loader = trainer, ps_loader(comm)
    else:  # fresh trainers with other initial values
        trainer.close()
        _, resumed, loader = make_ps(comm, mode, seed=9)
    start = Start()
    history = resumed.fit(loader, epochs=2, checkpoint_dir=ckdir, log_every=1000, progress=False, callbacks=[start])
    assert start.step == step and resumed.clock == resumed.global_step == 2 * len(loader)
    for n in saved:
        assert np.array_equal(start.params[n], saved[n]), n  # the servers and the replica: bitwise
    assert len(history) == 2 * len(loader) - step and all(not s.stop for s in history)
    resumed.close()


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
    assert failure.INTERRUPT_EXIT == ExitStatus.INTERRUPTED
    assert len({int(s) for s in ExitStatus}) == len(ExitStatus)
