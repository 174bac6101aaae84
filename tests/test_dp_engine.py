"""Data parallelism on the autograd engine: a model without a backward, with a weight used twice,
trains as one process does, and its gradient buckets start while backward still runs (the
engine's post-accumulate hooks: before, a model sharing a parameter between uses got no overlap)."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.autograd import Tensor
from hpctrain.nn import CrossEntropyLoss, Module, Parameter
from hpctrain.nn import functional as F
from hpctrain.optim import SGD
from hpctrain.parallel import DataParallelTrainer


class Tied(Module):
    """Three square layers, the first one applied again at the end (shared weights)."""

    def __init__(self, d: int = 16) -> None:
        g = np.random.default_rng(0)
        for i in range(3):
            setattr(self, f"w{i}", Parameter(g.standard_normal((d, d)) / np.sqrt(d)))

    def forward(self, x):
        h = F.tanh(x @ self.w0)
        h = F.gelu(h @ self.w1)
        h = F.tanh(h @ self.w2)
        return h @ self.w0  # w0 again


def batch(n: int, seed: int):
    g = np.random.default_rng(seed)
    return g.standard_normal((n, 16)), g.integers(0, 16, n)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_forward_only_shared_weights_equal_one_process_with_overlap(comm):
    model = Tied()
    opt = SGD(model.parameters(), lr=0.1)
    # Buckets of one parameter each: three can start before backward has reached w0's first use.
    tr = DataParallelTrainer(model=model, loss=CrossEntropyLoss(), optimizer=opt, comm=comm, bucket_mb=1e-6)
    ref = Tied()
    ref_opt = SGD(ref.parameters(), lr=0.1)
    n = 4 * comm.size
    for s in range(3):
        x, y = batch(n, s)
        tr.step(x[comm.rank :: comm.size], y[comm.rank :: comm.size])
        if comm.size > 1:
            assert tr.buckets.overlapped >= 2  # w2's and w1's started before the backward ended
        ref_opt.zero_grad()
        F.cross_entropy(ref(Tensor(x)), y).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-12, atol=1e-14)
    tr.close()
