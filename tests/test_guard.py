"""Non-finite guard: the same decision on every rank."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.errors import NonFiniteError
from hpctrain.nn import Parameter
from hpctrain.training.guard import check_finite


def _params(bad: bool):
    p = Parameter(np.zeros(3), name="fc.weight")
    q = Parameter(np.zeros(2), name="fc.bias")
    if bad:
        p.grad[1] = np.nan
    return [p, q]


def test_finite_passes(comm):
    assert check_finite(comm, 1.0, _params(False)) is False


def test_bad_policy_refused(comm):
    with pytest.raises(ValueError, match="on_nonfinite"):
        check_finite(comm, 1.0, _params(False), policy="ignore")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_nan_on_one_rank_skips_everywhere(comm):
    assert check_finite(comm, 1.0, _params(comm.rank == 1), policy="skip") is True


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_nan_on_one_rank_raises_everywhere_naming_it(comm):
    with pytest.raises(NonFiniteError, match="rank 1: fc.weight"):
        check_finite(comm, 1.0, _params(comm.rank == 1), policy="raise")
    with pytest.raises(NonFiniteError, match="rank 0: loss"):
        check_finite(comm, float("inf") if comm.rank == 0 else 1.0, _params(False))
