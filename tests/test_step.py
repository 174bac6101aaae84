"""The step alone: ``training.step.TrainStep`` with the smallest strategy, no fit, no loop, no
checkpoint, no ``Trainer``.

One ``Linear`` layer with MSE, SGD: every expectation is the update written out by hand in NumPy
on the global batch (the ranks' shares put together), so the same tests hold on one process and
under ``mpiexec -n N`` for any N.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpctrain import backend
from hpctrain.errors import NonFiniteError
from hpctrain.nn import Linear, MSELoss, Sequential
from hpctrain.optim import SGD
from hpctrain.parallel.reducer import AllReduceReducer
from hpctrain.training.step import Batch, TrainStep

D_IN, D_OUT, PER_RANK, LR = 3, 2, 4, 0.1


class OneLayerStep(TrainStep):
    """The smallest strategy: forward/backward of the whole model on each micro-batch, gradients
    summed over the ranks by bucket all-reduces. Only ``_forward_backward`` is its own."""

    def __init__(self, comm, *, clip_norm=None, on_nonfinite="raise", microbatches=1, device=None):
        super().__init__(comm=comm, on_nonfinite=on_nonfinite)
        self.model = Sequential(Linear(D_IN, D_OUT, rng=np.random.default_rng(0), dtype=np.float64))
        if device is not None:
            self.model.to("gpu")
        self.loss = MSELoss()
        self.params = sorted(self.model.parameters(), key=lambda p: p.name)
        self.optimizer = SGD(self.params, lr=LR)
        self.reducer = AllReduceReducer(self.params, comm)
        self.clip_norm, self.microbatches = clip_norm, microbatches

    def _forward_backward(self, batch: Batch):
        loss = 0.0
        for i, (part, w) in enumerate(zip(batch.parts, batch.part_weights)):
            if i == len(batch.parts) - 1:
                self.reducer.begin()
            scale = w / batch.weight_total  # this part's share of the global-batch mean
            loss = loss + self.loss.forward(self.model.forward(batch.x[part]), batch.y[part]) * scale
            self.model.backward(self.loss.backward(scale))
        return loss, {}, 0.0


def global_batch(size: int, seed: int = 0):
    g = np.random.default_rng(seed)
    n = PER_RANK * size
    return g.normal(size=(n, D_IN)), g.normal(size=(n, D_OUT))


def mine(a, comm, xp=np):
    return backend.to_device(a[comm.rank * PER_RANK : (comm.rank + 1) * PER_RANK], xp)


def by_hand(w, b, x, y):
    """(loss, dW, db) of MSE over every element of the global batch, for ``y = x @ w + b``."""
    diff = x @ w + b - y
    grad = 2.0 * diff / diff.size
    return float((diff * diff).mean()), x.T @ grad, grad.sum(axis=0)


def weights(step):
    lin = step.model[0]
    return backend.to_host(lin.weight.data).copy(), backend.to_host(lin.bias.data).copy()


def test_the_step_needs_no_loop_state_or_checkpoint():
    assert not any(hasattr(TrainStep, name) for name in ("fit", "state_dict", "snapshot", "checkpointer"))


@pytest.mark.parametrize("microbatches", [1, 2])
def test_one_step_is_the_hand_computed_sgd_update(comm, microbatches):
    st = OneLayerStep(comm, microbatches=microbatches)
    x, y = global_batch(comm.size)
    w0, b0 = weights(st)
    stats = st.step(mine(x, comm), mine(y, comm))
    loss, dw, db = by_hand(w0, b0, x, y)
    w1, b1 = weights(st)
    np.testing.assert_allclose(w1, w0 - LR * dw, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(b1, b0 - LR * db, rtol=1e-12, atol=1e-14)
    assert stats.loss == pytest.approx(loss, rel=1e-12)
    assert stats.grad_norm == pytest.approx(math.sqrt((dw * dw).sum() + (db * db).sum()), rel=1e-12)
    assert (stats.samples, stats.skipped, stats.stop, st.global_step) == (PER_RANK * comm.size, False, False, 1)
    assert st.optimizer.step_count == 1


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_skip_on_a_nonfinite_gradient_leaves_the_parameters_untouched(comm):
    st = OneLayerStep(comm, on_nonfinite="skip")
    x, y = global_batch(comm.size)
    bad = x.copy()
    bad[-1, 0] = np.nan  # on the last rank's share only: every rank must skip
    w0, b0 = weights(st)
    stats = st.step(mine(bad, comm), mine(y, comm))
    w1, b1 = weights(st)
    assert np.array_equal(w1, w0) and np.array_equal(b1, b0)
    assert stats.skipped and math.isnan(stats.grad_norm)
    assert (st.global_step, st.optimizer.step_count) == (1, 0)  # a batch consumed, no update
    # The gradients were cleared: the next step is the plain update from the same weights.
    st.step(mine(x, comm), mine(y, comm))
    _, dw, db = by_hand(w0, b0, x, y)
    np.testing.assert_allclose(weights(st)[0], w0 - LR * dw, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(weights(st)[1], b0 - LR * db, rtol=1e-12, atol=1e-14)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_raise_on_a_nonfinite_gradient_changes_nothing(comm):
    st = OneLayerStep(comm)
    x, y = global_batch(comm.size)
    bad = x.copy()
    bad[-1, 0] = np.inf
    w0, b0 = weights(st)
    with pytest.raises(NonFiniteError):
        st.step(mine(bad, comm), mine(y, comm))
    assert np.array_equal(weights(st)[0], w0) and np.array_equal(weights(st)[1], b0)
    assert (st.global_step, st.optimizer.step_count) == (0, 0)
    assert all(not p.grad.any() for p in st.params)  # ready for the next step


@pytest.mark.parametrize("fraction", [0.5, 2.0])
def test_clipping_scales_the_update_to_the_clip_norm(comm, fraction):
    x, y = global_batch(comm.size)
    probe = OneLayerStep(comm)
    w0, b0 = weights(probe)
    _, dw, db = by_hand(w0, b0, x, y)
    norm = math.sqrt((dw * dw).sum() + (db * db).sum())
    st = OneLayerStep(comm, clip_norm=fraction * norm)
    stats = st.step(mine(x, comm), mine(y, comm))
    coef = min(1.0, fraction * norm / (norm + 1e-6))  # only ever scaled down
    assert stats.grad_norm == pytest.approx(norm, rel=1e-12)  # reported before clipping
    np.testing.assert_allclose(weights(st)[0], w0 - LR * coef * dw, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(weights(st)[1], b0 - LR * coef * db, rtol=1e-12, atol=1e-14)


def test_one_host_read_per_step_on_the_device(comm, standin):
    """The loss, the norm, the finite check and the target check reach the host in one read
    (the stand-in counts them, as in test_conformance)."""
    st = OneLayerStep(comm, device=standin, microbatches=2)
    x, y = global_batch(comm.size)
    counts = []
    for _ in range(3):
        before = standin.syncs
        st.step(mine(x, comm, standin), mine(y, comm, standin))
        counts.append(standin.syncs - before)
    assert counts == [1, 1, 1]
