"""The exactly rounded squared norm: the same whatever the arrays are cut into, on any rank count."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import hpctrain as ht
from hpctrain.optim.exactsum import digits_value, sumsq_digits


def _exact(arrays):
    return float(sum(Fraction(float(v)) for a in arrays for v in np.asarray(a, dtype=np.float64).ravel() ** 2))


@pytest.mark.parametrize("seed", range(4))
def test_exactly_rounded_and_cut_independent(seed):
    g = np.random.default_rng(seed)
    arrays = [g.standard_normal(g.integers(1, 300)) * 10.0 ** g.integers(-160, 150) for _ in range(6)]
    arrays.append(np.array([0.0, -0.0, 3e-200, 1e-170]))  # zeros and squares that underflow
    want = _exact(arrays)
    assert digits_value(sumsq_digits(arrays)) == want
    flat = np.concatenate(arrays)
    g.shuffle(flat)
    cuts = sorted(g.integers(0, flat.size, 5))
    parts = np.split(flat, cuts)
    assert digits_value(sum(sumsq_digits([p]) for p in parts)) == want  # digits add exactly


def test_float32_large_and_overflow():
    x = np.full(1000, 3.0, dtype=np.float32)
    assert digits_value(sumsq_digits([x])) == 9000.0
    assert digits_value(sumsq_digits([np.array([1e200, 1e200])])) == float("inf")
    assert digits_value(sumsq_digits([])) == 0.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_zero_levels_clip_by_bitwise_the_same_norm():
    """A float64 model clipped under dp: zero 0 (whole gradients on dp rank 0) and ZeRO (a flat
    piece on every dp rank) count the gradient cut differently, yet report and clip by the same
    norm, bitwise: the exactly rounded one (which matches the float64 dot to rounding)."""
    from hpctrain.nn import Linear, MSELoss, ReLU, Sequential
    from hpctrain.parallel import ParallelTrainer

    comm = ht.Communicator()
    g = np.random.default_rng(1)
    r, n = comm.rank, comm.size
    norms = []
    for zero in (0, 1, 3):
        g = np.random.default_rng(0)
        m = Sequential(Linear(5, 9, rng=g, dtype=np.float64), ReLU(), Linear(9, 3, rng=g, dtype=np.float64))
        tr = ParallelTrainer(model=m, loss=MSELoss(), optimizer=ht.optim.SGD(m.parameters(), lr=0.1),
                             grid=ht.ProcessGrid(comm), clip_norm=1e-3, zero=zero)  # fmt: skip
        assert tr.exact_norm
        got = []
        for s in range(3):
            d = np.random.default_rng(10 + s)
            x, y = d.standard_normal((4 * n, 5)), d.standard_normal((4 * n, 3))
            got.append(tr.step(x[r::n], y[r::n]).grad_norm)
        norms.append(got)
        tr.close()
    assert norms[0] == norms[1] == norms[2]
