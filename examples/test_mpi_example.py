"""Testing your own MPI code with pytest: real ranks, pytest-mpi's marker, hpctrain's plugin.

    mpiexec -n 2 python -m pytest --with-mpi examples/test_mpi_example.py    # 2 ranks (any number)
    python -m pytest examples/test_mpi_example.py                            # 1 process: mpi tests skip

``@pytest.mark.mpi(min_size=2)`` (pytest-mpi) marks a test that needs ranks; without ``--with-mpi``
it is skipped. Derive what you expect from ``comm.rank`` and ``comm.size``, never from a fixed
world size, so the same file passes on 2, 4 or 8 ranks.

hpctrain's pytest plugin (installed with hpctrain) makes the ranks agree after each test: a test
that fails on one rank fails on all, and rank 0's report shows that rank's traceback; a rank
stuck in a collective a failed peer left ends the job within seconds, naming the test.
"""

from __future__ import annotations

import numpy as np
import pytest

import hpctrain as ht


@pytest.fixture
def comm():
    return ht.Communicator()


@pytest.mark.mpi(min_size=2)
def test_mean_of_the_ranks(comm):
    x = np.full(4, float(comm.rank))
    comm.allreduce(x, op="mean", out=x)
    assert np.allclose(x, (comm.size - 1) / 2)


def _model():
    rng = np.random.default_rng(0)
    return ht.nn.Sequential(ht.nn.Linear(4, 8, rng=rng, dtype=np.float64), ht.nn.Tanh(),
                            ht.nn.Linear(8, 1, rng=rng, dtype=np.float64))


@pytest.mark.mpi(min_size=2)
def test_a_data_parallel_step_equals_one_process(comm):
    """Equivalence is the proof: each rank steps on its rows of the batch; the update equals one
    process's on the whole batch (float64, so to rounding)."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(8 * comm.size, 4)), rng.normal(size=(8 * comm.size, 1))
    ref = _model()
    opt = ht.optim.SGD(ref.parameters(), lr=0.1)
    loss = ht.nn.MSELoss()
    loss.forward(ref.forward(x), y)
    ref.backward(loss.backward())
    opt.step()

    model = _model()
    trainer = ht.parallel.DataParallelTrainer(model=model, loss=ht.nn.MSELoss(),
                                              optimizer=ht.optim.SGD(model.parameters(), lr=0.1), comm=comm)
    trainer.step(x[comm.rank::comm.size], y[comm.rank::comm.size])  # this rank's share of the batch
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-12, atol=1e-12, err_msg=name)


def test_runs_on_every_rank_alike():
    """An unmarked test runs on each rank on its own (and in a plain one-process pytest)."""
    assert ht.nn.MSELoss().forward(np.ones((2, 1)), np.zeros((2, 1))) == 1.0
