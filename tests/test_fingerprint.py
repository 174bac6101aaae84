"""HPCTRAIN_DEBUG fingerprints: mismatched calls raise CollectiveMismatchError on every rank, no hang."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import Communicator
from hpctrain.comm.fingerprint import FingerprintTracer
from hpctrain.errors import CollectiveMismatchError, ConfigError


@pytest.fixture
def dcomm(comm):
    """A private communicator in debug mode (so a failed check leaves the world comm clean)."""
    c = Communicator(comm.mpi.Dup())
    c._debug = FingerprintTracer(c)
    yield c
    c.free()


def test_debug_env_selects_fingerprint_tracer(monkeypatch, comm):
    from hpctrain.comm.fingerprint import tracer_from_env

    monkeypatch.setenv("HPCTRAIN_DEBUG", "1")
    assert isinstance(tracer_from_env(comm), FingerprintTracer)
    monkeypatch.setenv("HPCTRAIN_DEBUG", "0")
    assert tracer_from_env(comm) is None  # off: no tracer at all on the hot path
    monkeypatch.setenv("HPCTRAIN_DEBUG", "maybe")
    with pytest.raises(ConfigError, match="HPCTRAIN_DEBUG='maybe' must be 0 or 1"):
        tracer_from_env(comm)


def test_matching_calls_pass(dcomm):
    x = np.full(4, dcomm.rank + 1.0)
    assert np.allclose(dcomm.allreduce(x), dcomm.size * (dcomm.size + 1) / 2)
    y = np.arange(3.0) if dcomm.rank == 0 else np.zeros(3)
    assert np.array_equal(dcomm.bcast(y), np.arange(3.0))
    assert dcomm.allgather_obj(dcomm.rank) == list(range(dcomm.size))
    dcomm.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_different_shapes_raise_on_every_rank(dcomm):
    x = np.ones(5 if dcomm.rank == 1 else 4)
    with pytest.raises(CollectiveMismatchError) as info:
        dcomm.allreduce(x)
    msg = str(info.value)
    assert "rank 0 called allreduce(shape=(4,)" in msg and "rank 1 called allreduce(shape=(5,)" in msg
    # The communicator is still usable afterwards: nothing was left half-done.
    assert dcomm.allreduce(np.ones(2))[0] == dcomm.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_bcast_against_allreduce_names_the_rank(dcomm):
    x = np.ones(3)
    odd = dcomm.size - 1
    with pytest.raises(CollectiveMismatchError, match=rf"but rank {odd} called bcast\(shape=\(3,\).*root=0"):
        if dcomm.rank == odd:
            dcomm.bcast(x, root=0)
        else:
            dcomm.allreduce(x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_send_recv_shape_mismatch_raises_on_both_sides(dcomm):
    if dcomm.rank > 1:
        return
    if dcomm.rank == 0:
        both = r"rank 0 called send\(shape=\(4,\).*rank 1 posted recv\(shape=\(6,\)"
        with pytest.raises(CollectiveMismatchError, match=both):
            dcomm.send(np.ones(4), dest=1, tag=3)
    else:
        with pytest.raises(CollectiveMismatchError, match=r"rank 1 posted recv\(shape=\(6,\)"):
            dcomm.recv(np.empty(6), source=0, tag=3)
    # A matching pair still works afterwards.
    if dcomm.rank == 0:
        dcomm.send(np.arange(4.0), dest=1, tag=3)
    else:
        assert np.array_equal(dcomm.recv(np.empty(4), source=0, tag=3), np.arange(4.0))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_isend_irecv_dtype_mismatch(dcomm):
    if dcomm.rank > 1:
        return
    if dcomm.rank == 0:
        req = dcomm.isend(np.ones(4, dtype=np.float32), dest=1, tag=1)
        req.wait()
        with pytest.raises(CollectiveMismatchError, match=r"dtype=float32.*dtype=float64"):
            while dcomm._debug.awaiting:  # the verdict arrives after the receiver checked
                dcomm._debug._poll_verdicts()
    else:
        req = dcomm.irecv(np.empty(4, dtype=np.float64), source=0, tag=1)
        with pytest.raises(CollectiveMismatchError, match=r"rank 0 called isend\(shape=\(4,\), dtype=float32"):
            req.wait()
