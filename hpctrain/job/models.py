"""The built-in models of ``--model mlp`` and ``--model gpt``: how each is built from a Config and,
before it exists, what a layout must respect (the sizes a tensor-parallel group splits, the pieces
a pipeline can cut between).

Each model's structure is said here once (the classifier) or by the model itself (the GPT's
``tp_sizes`` and ``pipeline_cut_count``): the configuration's checks ask :func:`splits`, they do
not restate the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import nn
from .options import Config

#: The built-in model names (anything else is a user's ``package.module:factory``).
BUILTIN = ("mlp", "gpt")
#: The classifier's MLP blocks widen to this many times ``--d-model`` (``fc1`` column-wise over tp).
CLASSIFIER_HIDDEN = 4


@dataclass(frozen=True)
class Splits:
    """What a layout must respect of a built-in model, known from the Config alone."""

    #: ``{size name: size}`` a tensor-parallel group must divide (``n_heads``, ``hidden``).
    tp_sizes: dict[str, int]
    #: Pieces a pipeline can cut between (the most stages it can have).
    pipeline_pieces: int


def classifier_pieces(n_layers: int) -> int:
    """Layers of :func:`build_classifier` without dropout: Linear, GELU, (MLP, GELU) x n, Linear."""
    return 3 + 2 * n_layers


def splits(c: Config) -> Splits | None:
    """The splits of ``c.model`` (``None`` for a user's model: its trainer checks it when built)."""
    if c.model == "gpt":
        return Splits(nn.GPT.tp_sizes(c.d_model, c.n_heads), nn.GPT.pipeline_cut_count(c.n_layers))
    if c.model == "mlp":
        return Splits({"hidden": CLASSIFIER_HIDDEN * c.d_model}, classifier_pieces(c.n_layers))
    return None


def build_gpt(c: Config, meta: dict[str, Any]) -> nn.GPT:
    """``--model gpt``: pipelined as it is (parallelize cuts a GPT between its pieces), so one set
    of parameter names everywhere."""
    rng = np.random.default_rng(c.seed)
    return nn.GPT(meta["vocab_size"], c.block_size, c.d_model, c.n_heads, c.n_layers, rng=rng, dropout=c.dropout)


def build_classifier(c: Config, meta: dict[str, Any]) -> nn.Sequential:
    """``--model mlp``, a classifier (``--loss ce``) or a regressor (``--loss mse``): a flat
    Sequential so a pipeline can cut it anywhere; MLP blocks so tensor parallelism has something to
    shard (fc1 column-wise, fc2 row-wise).

    With ``--dropout``, a Dropout after each hidden activation, seeded from a generator of its
    own so the weights are the same with and without it.
    """
    rng = np.random.default_rng(c.seed)
    d = c.d_model
    masks = np.random.default_rng([c.seed, 1])
    drop = [nn.Dropout(c.dropout, rng=int(masks.integers(2**31)))] if c.dropout else []
    layers: list[Any] = [nn.Linear(meta["n_in"], d, rng=rng), nn.GELU(), *drop]
    for _ in range(c.n_layers):
        drop = [nn.Dropout(c.dropout, rng=int(masks.integers(2**31)))] if c.dropout else []
        layers += [nn.MLP(d, CLASSIFIER_HIDDEN * d, rng=rng), nn.GELU(), *drop]
    layers.append(nn.Linear(d, outputs(meta), rng=rng))
    return nn.Sequential(*layers)


def outputs(meta: dict[str, Any]) -> int:
    """The output width the data asks for: its classes (``--loss ce``) or its regression targets'
    values per row (``--loss mse``: 1 for targets of shape (N,))."""
    return int(meta["n_classes"] if "n_classes" in meta else meta["n_out"])
