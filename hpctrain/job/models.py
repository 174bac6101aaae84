"""The built-in models of ``--model mlp``, ``--model gpt`` and ``--model cnn``: how each is built from a Config and,
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
BUILTIN = ("mlp", "gpt", "cnn")
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


def cnn_pieces(n_layers: int) -> int:
    """Layers of :func:`build_cnn` at least (an Unflatten leads for flat rows or (H, W) fields, a
    pooling layer joins each block while the field is two cells or wider): (Conv2d, ReLU) x n,
    Flatten, Linear, GELU, Linear."""
    return 4 + 2 * n_layers


def splits(c: Config) -> Splits | None:
    """The splits of ``c.model`` (``None`` for a user's model: its trainer checks it when built)."""
    if c.model == "cnn":
        return Splits({}, cnn_pieces(c.n_layers))
    if c.model == "gpt":
        return Splits(nn.GPT.tp_sizes(c.d_model, c.n_heads), nn.GPT.pipeline_cut_count(c.n_layers))
    if c.model == "mlp":
        return Splits({"hidden": CLASSIFIER_HIDDEN * c.d_model}, classifier_pieces(c.n_layers))
    return None


def build_gpt(c: Config, meta: dict[str, Any]) -> nn.GPT:
    """``--model gpt``: pipelined as it is (parallelize cuts a GPT between its pieces), so one set
    of parameter names everywhere."""
    rng = np.random.default_rng(c.seed)
    tied = {"tie_embeddings": True} if c.tie_embeddings else {}
    # A dense GPT is built without the MoE arguments: its weights do not depend on them.
    moe = {"moe_experts": c.moe_experts, "moe_top_k": c.moe_top_k, "moe_every": c.moe_every,
           "moe_capacity": c.moe_capacity} if c.moe_experts else {}
    gpt = nn.GPT(meta["vocab_size"], c.block_size, c.d_model, c.n_heads, c.n_layers, rng=rng, dropout=c.dropout,
                 **tied, **moe)
    if c.moe_experts:  # the load-balancing term's weight: its gradient is the MoE layers' own
        from ..nn.moe import set_aux_weight

        set_aux_weight(gpt, c.moe_aux_loss)
    return gpt


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
    # Samples of more than one axis (images) are flattened by the model's first layer, as a PyTorch
    # MLP does with nn.Flatten (the job's header says so); rows (N, D) go straight in.
    flat = [nn.Flatten()] if len(meta.get("x_shape") or [meta["n_in"]]) > 1 else []
    layers: list[Any] = [*flat, nn.Linear(meta["n_in"], d, rng=rng), nn.GELU(), *drop]
    for _ in range(c.n_layers):
        drop = [nn.Dropout(c.dropout, rng=int(masks.integers(2**31)))] if c.dropout else []
        layers += [nn.MLP(d, CLASSIFIER_HIDDEN * d, rng=rng), nn.GELU(), *drop]
    layers.append(nn.Linear(d, outputs(meta), rng=rng))
    return nn.Sequential(*layers)


def image_shape(meta: dict[str, Any]) -> tuple[int, int, int]:
    """``(C, H, W)`` of the samples ``--model cnn`` reads (``meta["x_shape"]``, else ``n_in``):
    images (C, H, W) as they are, (H, W) fields as one channel, flat rows of ``side * side``
    values as one square channel (``ConfigError`` for anything else, saying what to store)."""
    import math

    from ..errors import ConfigError

    shape = tuple(int(d) for d in (meta.get("x_shape") or [meta["n_in"]]))
    where = meta.get("path", "the data")
    if len(shape) == 3:
        return shape  # type: ignore[return-value]
    if len(shape) == 2:
        return (1, *shape)
    side = math.isqrt(shape[0]) if len(shape) == 1 else 0
    if len(shape) == 1 and side * side == shape[0]:
        return (1, side, side)
    what = f"rows of {shape[0]} values, not a square" if len(shape) == 1 else f"samples of shape {shape}"
    raise ConfigError(f"--model cnn reads images: store {where}'s inputs as (N, C, H, W), (N, H, W) or square "
                      f"rows (N, side * side); it holds {what}: reshape them, or bring your own model")


def build_cnn(c: Config, meta: dict[str, Any]) -> nn.Sequential:
    """``--model cnn``: images ``(N, C, H, W)`` (``(N, H, W)`` and square rows of ``side * side``
    values are read as one channel: an Unflatten leads), ``--n-layers`` blocks of a 3 x 3
    convolution (``--d-model`` channels), ReLU and 2 x 2 max pooling (while the field is two cells
    or wider), then an MLP head (``--d-model`` hidden, GELU). A flat Sequential: a pipeline cuts it
    between any two layers. ``--dropout``: before the head's last layer."""
    cin, h, w = image_shape(meta)
    stored = tuple(meta.get("x_shape") or [meta["n_in"]])
    rng = np.random.default_rng(c.seed)
    ch = c.d_model
    layers: list[Any] = []
    if len(stored) == 1:
        layers.append(nn.Unflatten(1, (cin, h, w)))
    elif len(stored) == 2:
        layers.append(nn.Unflatten(1, (1, h)))  # (N, H, W) -> (N, 1, H, W)
    for _ in range(c.n_layers):
        layers += [nn.Conv2d(cin, ch, 3, padding=1, rng=rng), nn.ReLU()]
        if min(h, w) >= 2:
            layers.append(nn.MaxPool2d(2))
            h, w = h // 2, w // 2
        cin = ch
    drop = [nn.Dropout(c.dropout, rng=int(np.random.default_rng([c.seed, 1]).integers(2**31)))] if c.dropout else []
    n_out = meta["n_classes"] if "n_classes" in meta else meta["n_out"]
    layers += [nn.Flatten(), nn.Linear(ch * h * w, ch, rng=rng), nn.GELU(), *drop, nn.Linear(ch, n_out, rng=rng)]
    return nn.Sequential(*layers)


def outputs(meta: dict[str, Any]) -> int:
    """The output width the data asks for: its classes (``--loss ce``) or its regression targets'
    values per row (``--loss mse``: 1 for targets of shape (N,))."""
    return int(meta["n_classes"] if "n_classes" in meta else meta["n_out"])
