"""The device stand-in (tests/devicearray.py) refuses what CuPy refuses: otherwise the strategy
matrix on it would prove nothing. And the package takes it for CuPy once registered."""

from __future__ import annotations

import numpy as np
import pytest


def test_no_implicit_way_back_to_numpy(standin):
    dev = standin.asarray(np.arange(6.0).reshape(2, 3))
    for convert in (np.asarray, np.array, lambda a: np.concatenate([a, np.zeros((1, 3))])):
        with pytest.raises(TypeError, match="NumPy"):
            convert(dev)
    with pytest.raises(TypeError, match="NumPy array mixed"):
        dev + np.ones(3)  # noqa: B018 - the operation is the test
    with pytest.raises(TypeError, match="NumPy array mixed"):
        standin.matmul(dev, np.ones(3))
    assert np.array_equal(dev.get(), np.arange(6.0).reshape(2, 3))


def test_results_stay_on_the_device_and_reads_are_counted(standin):
    dev = standin.asarray(np.arange(6.0))
    before = standin.syncs
    results = [dev * 2, np.exp(dev), dev[1], dev.sum(), standin.concatenate([dev, dev]), dev @ dev]
    assert all(isinstance(r, standin.ndarray) for r in results)  # a scalar index gives a 0-d array
    dev += 1
    assert standin.syncs == before  # nothing was read
    assert float(dev[0]) == 1.0 and dev.sum().item() == 21.0 and dev.tolist()[5] == 6.0
    assert standin.syncs == before + 3


def test_the_package_takes_it_for_cupy(standin):
    from hpctrain import backend

    dev = backend.to_device(np.ones(3), backend.get_xp("gpu"))
    assert backend.is_device_array(dev) and backend.xp_of(dev) is standin
    assert not backend.is_device_array(np.ones(3)) and not backend.is_real_cupy(standin)
    assert type(backend.to_host(dev)) is np.ndarray


def test_where_takes_an_array_condition_only(standin):
    """CuPy's ``where`` calls ``condition.astype``: a Python bool raises AttributeError there."""
    dev = standin.asarray(np.arange(3.0))
    assert isinstance(standin.where(dev > 1, dev, 0.0), standin.ndarray)
    with pytest.raises(AttributeError, match="astype"):
        standin.where(False, 0.0, dev)


@pytest.mark.parametrize("weighted", [False, True])
def test_losses_mean_on_the_device_with_and_without_weights(standin, weighted):
    """The GPU run's crash (gpt_vs_torch, the dp NCCL test): a loss without weights has a host
    denominator, and ``batch_mean`` handed ``cupy.where`` a Python bool."""
    from hpctrain.nn import CrossEntropyLoss, MSELoss

    g = np.random.default_rng(0)
    pred, target = g.standard_normal((4, 3)), g.standard_normal((4, 3))
    logits, labels = g.standard_normal((4, 5, 7)), g.integers(0, 7, (4, 5))
    w = np.array([1.0, 0.0, 1.0, 1.0]) if weighted else None
    for make, args in ((MSELoss, (pred, target)), (CrossEntropyLoss, (logits, labels))):
        host = make().forward(*args, weight=w)
        dev_args = [standin.asarray(a) for a in args]
        got = make().forward(*dev_args, weight=None if w is None else standin.asarray(w))
        assert isinstance(got, standin.ndarray) and got.shape == ()
        assert float(got) == pytest.approx(host, rel=1e-12)


def test_out_results_and_views_hold_what_cupy_holds(standin):
    """Reference counts must say what they say on CuPy (``nn.buffers`` reuses an array nobody holds):
    a ufunc with ``out=`` returns ``out`` itself, and a view keeps its owner alive."""
    import sys

    a, b, c = standin.ones((2, 2)), standin.ones((2, 2)), standin.empty((2, 2))
    assert standin.matmul(a, b, out=c) is c and standin.add(a, b, out=c) is c
    before = sys.getrefcount(c)
    views = [c.reshape(4), c.T, c[0], standin.swapaxes(c, 0, 1)]
    assert sys.getrefcount(c) == before + len(views)
    del views
    assert sys.getrefcount(c) == before
