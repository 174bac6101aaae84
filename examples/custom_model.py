"""A model of your own for ``hpctrain train``: the protocol, runnable (from a clone of the repository).

    mpiexec -n 2 hpctrain train --model examples/custom_model.py:build              # data parallel
    mpiexec -n 2 hpctrain train --model examples/custom_model.py:build --tp 2       # its nn.MLP split over tp
    mpiexec -n 2 hpctrain train --model examples/custom_model.py:build --pp 2       # a Sequential: cut into stages

With an installed wheel, copy this file (the documentation shows it whole) and name your copy.

The factory takes the job's ``hpctrain.job.Config`` (every flag as a typed field; ``config.info``
holds the data's facts: ``n_in``, ``x_shape``, ``n_classes`` with ``--loss ce`` or ``n_out`` with
``--loss mse``, ``vocab_size`` for token windows) and returns an ``hpctrain.nn.Module``. It is
called on every rank and must build the same model there (seed it from ``config.seed``).
"""

from __future__ import annotations

import numpy as np

from hpctrain import nn


class Scale(nn.Module):
    """``y = x * s``, a learned scale per feature: a layer written from scratch.

    The protocol of a layer: ``Parameter`` attributes are registered under their attribute names
    (here ``s``); ``forward`` keeps what ``backward`` needs in ``self.cache``; ``backward(g)``
    adds to each parameter's ``.grad`` and returns the gradient of the input.
    """

    def __init__(self, d: int, dtype=np.float32) -> None:
        self.s = nn.Parameter(np.ones(d, dtype=dtype))
        self.cache = None

    def forward(self, x):
        self.cache = x
        return x * self.s.data

    def backward(self, g):
        self.s.grad += (g * self.cache).reshape(-1, g.shape[-1]).sum(axis=0)
        return g * self.s.data


def build(config) -> nn.Module:
    """An MLP classifier (or regressor) with a ``Scale`` layer and a transformer-style ``nn.MLP`` block.

    A ``Sequential`` so a pipeline can cut it between layers; ``nn.MLP`` so tensor parallelism
    has something to split (its fc1 column-wise, fc2 row-wise).
    """
    info = config.info
    rng = np.random.default_rng(config.seed)
    d = config.d_model
    n_out = info["n_classes"] if "n_classes" in info else info["n_out"]
    return nn.Sequential(
        nn.Linear(info["n_in"], d, rng=rng), nn.GELU(), Scale(d),
        nn.MLP(d, 4 * d, rng=rng), nn.GELU(),
        nn.Linear(d, n_out, rng=rng),
    )
