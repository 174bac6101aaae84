"""comm.Window: one-sided accumulate/get/fetch_add on real MPI windows, lifetime and errors."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain import Communicator
from hpctrain.comm import Window
from hpctrain.errors import BufferError, DtypeError, WindowError


def self_comm() -> Communicator:
    """A one-rank communicator, so unmarked tests also run (independently) on every MPI rank."""
    return Communicator(MPI.COMM_SELF)


def test_accumulate_get_single_rank():
    with Window(self_comm(), 6, np.float64) as win:
        win.accumulate(np.arange(3, dtype=np.float64), 0, offset=2)
        win.accumulate(np.ones(3), 0, offset=2)
        out = win.get(np.empty(6), 0)
        np.testing.assert_array_equal(out, [0, 0, 1, 2, 3, 0])
        np.testing.assert_array_equal(win.local(), out)
        old = win.fetch_add(np.full(2, 10.0), np.empty(2), 0, offset=4)
        np.testing.assert_array_equal(old, [3, 0])
        np.testing.assert_array_equal(win.get(np.empty(2), 0, offset=4), [13, 10])
        win.accumulate(np.full(1, -5.0), 0, offset=0, op="replace")
        assert win.local()[0] == -5.0
        win.progress()


def test_errors_and_lifetime():
    win = Window(self_comm(), 4, np.float32)
    with pytest.raises(BufferError, match="do not fit"):
        win.accumulate(np.ones(3, np.float32), 0, offset=2)
    with pytest.raises(BufferError, match="dtype"):
        win.get(np.empty(2, np.float64), 0)
    with pytest.raises(ValueError, match="not a rank"):
        win.get(np.empty(2, np.float32), 1)
    with pytest.raises(BufferError, match="contiguous"):
        win.accumulate(np.ones((4, 2), np.float32)[:, 0], 0)
    with pytest.raises(ValueError, match="op must be"):
        win.accumulate(np.ones(1, np.float32), 0, op="prod")
    with pytest.raises(DtypeError):
        Window(self_comm(), 1, np.dtype("U3"))
    with pytest.raises(ValueError, match=">= 0"):
        Window(self_comm(), -1)
    win.free()
    assert win.freed
    win.free()  # twice is a no-op
    for use in (
        lambda: win.get(np.empty(1, np.float32), 0),
        lambda: win.accumulate(np.ones(1, np.float32), 0),
        lambda: win.local(),
        lambda: win.progress(),
        lambda: win.__enter__(),
    ):
        with pytest.raises(WindowError, match="freed"):
            use()


def test_context_manager_frees_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with Window(self_comm(), 2) as win:
            raise RuntimeError("boom")
    assert win.freed


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_every_rank_accumulates_into_every_piece(comm):
    # Pieces of different sizes (rank r holds r + 2 elements).
    with Window(comm, comm.rank + 2, np.float64) as win:
        assert win.counts == [r + 2 for r in range(comm.size)]
        for target in range(comm.size):
            win.accumulate(np.full(target + 2, comm.rank + 1.0), target)
            win.accumulate(np.full(1, 100.0 * (comm.rank + 1)), target, offset=target + 1)
        comm.barrier()
        total = comm.size * (comm.size + 1) / 2
        for target in range(comm.size):
            out = win.get(np.empty(target + 2), target)
            expect = np.full(target + 2, total)
            expect[-1] += 100 * total
            np.testing.assert_array_equal(out, expect)
        np.testing.assert_array_equal(win.local()[:-1], total)
        comm.barrier()  # nobody frees while others still read


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_fetch_add_is_atomic(comm):
    # Every rank increments one counter on the last rank many times; the values fetched must be
    # exactly 0 .. n*size-1, each once (a lost or torn update would repeat or skip one).
    n = 200
    with Window(comm, 1 if comm.rank == comm.size - 1 else 0, np.int64) as win:
        one = np.ones(1, np.int64)
        got = [int(win.fetch_add(one, np.empty(1, np.int64), comm.size - 1)[0]) for _ in range(n)]
        everyone = sorted(v for vs in comm.allgather_obj(got) for v in vs)
        assert everyone == list(range(n * comm.size))
        comm.barrier()
        assert int(win.get(np.empty(1, np.int64), comm.size - 1)[0]) == n * comm.size
        comm.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_free_is_collective_and_use_after_free_raises_everywhere(comm):
    win = Window(comm, 3)
    win.free()
    with pytest.raises(WindowError):
        win.get(np.empty(1), 0)
    # Errors about the target piece name the target's size on every rank.
    with Window(comm, comm.rank) as w2:
        with pytest.raises(BufferError, match="rank 0's piece of 0 elements"):
            w2.get(np.empty(1), 0)
