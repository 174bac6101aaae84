"""Stall watchdog: timeouts, bookkeeping and the side channel (the aborting path is in test_faults)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hpctrain import Trainer
from hpctrain.comm import watchdog
from hpctrain.errors import ConfigError


def test_set_timeout_validates(comm):
    comm.set_timeout(2.5)
    assert comm._timeout == 2.5
    comm.set_timeout(None)
    assert comm._timeout is None
    for bad in (-1, "10"):
        with pytest.raises(ValueError, match="timeout"):
            comm.set_timeout(bad)


def test_env_timeout(monkeypatch):
    monkeypatch.delenv("HPCTRAIN_TIMEOUT", raising=False)
    assert watchdog.env_timeout() == watchdog.DEFAULT_TIMEOUT == 300
    monkeypatch.setenv("HPCTRAIN_TIMEOUT", "12.5")
    assert watchdog.env_timeout() == 12.5
    monkeypatch.setenv("HPCTRAIN_TIMEOUT", "soon")  # refused, not silently replaced by the default
    with pytest.raises(ConfigError, match="HPCTRAIN_TIMEOUT='soon' is not a number"):
        watchdog.env_timeout()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_timeout_precedence_and_step(comm):
    dog = watchdog._dog
    assert dog is not None and dog.thread.is_alive()
    trainer = Trainer(comm=comm, timeout=7)
    trainer.global_step = 41
    assert dog.timeout_of(comm) == 7 and dog.step() == 41
    comm.set_timeout(3)
    assert dog.timeout_of(comm) == 3
    comm.set_timeout(None)
    trainer.timeout = None
    assert dog.timeout_of(comm) == dog.default
    del trainer
    comm.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_blocking_calls_are_recorded(comm):
    dog = watchdog._dog
    comm.allreduce(np.ones(2))
    op, members, peer, seq, _ = dog.describe()["last"]
    assert (op, members, peer, seq) == ("allreduce", tuple(range(comm.size)), None, comm._seq)
    req = comm.iallreduce(np.ones(2))
    req.wait()
    assert dog.describe()["last"][0] == "iallreduce" and not dog.active
    comm.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_side_channel_sees_who_has_arrived(comm):
    """Rank 0 asks the others while they wait in a barrier it has not entered yet."""
    dog = watchdog._dog
    sub = comm.split(0)  # members in world ranks, as the reports name them
    if comm.rank == 0:
        answers: dict = {}
        deadline = time.monotonic() + 30
        while len(answers) < comm.size - 1 or not all(a["active"] for a in answers.values()):
            assert time.monotonic() < deadline, answers
            answers = dog._ask(list(range(1, comm.size)))
        for r, a in answers.items():
            assert a["rank"] == r
            op, members, peer, seq, age = a["active"][0]
            # (In HPCTRAIN_DEBUG mode they wait in the barrier's fingerprint exchange.)
            assert op.startswith("barrier") and (members, peer, seq) == (tuple(range(comm.size)), None, sub._seq + 1)
    sub.barrier()
    sub.free()
