"""Small float64 models and data shared by the pipeline tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpctrain.nn import (
    CrossEntropyLoss,
    Embedding,
    LayerNorm,
    Linear,
    Module,
    MSELoss,
    ReLU,
    Sequential,
    TransformerBlock,
)  # fmt: skip
from hpctrain.optim import Adam

D_IN, D_OUT, VOCAB, T = 6, 3, 11, 5


class TokPos(Module):
    """Token plus position embedding: the transformer's first pipeline layer."""

    def __init__(self, vocab: int, block: int, d: int, rng: Any, dtype: Any = np.float64) -> None:
        self.tok = Embedding(vocab, d, std=0.5, rng=rng, dtype=dtype)
        self.pos = Embedding(block, d, std=0.5, rng=rng, dtype=dtype)
        self.cache = None

    def forward(self, idx: Any) -> Any:
        return self.tok.forward(idx) + self.pos.forward(np.arange(idx.shape[1]))

    def backward(self, grad_out: Any) -> None:
        self.tok.backward(grad_out)
        self.pos.backward(grad_out.sum(axis=0))
        return None


def mlp(seed: int = 0) -> Sequential:
    g = np.random.default_rng(seed)
    return Sequential(
        Linear(D_IN, 16, rng=g, dtype=np.float64), ReLU(), Linear(16, 16, rng=g, dtype=np.float64), ReLU(),
        Linear(16, 12, rng=g, dtype=np.float64), ReLU(), Linear(12, D_OUT, rng=g, dtype=np.float64),
    )  # fmt: skip


def transformer(seed: int = 0) -> Sequential:
    g = np.random.default_rng(seed)
    d = 8
    return Sequential(
        TokPos(VOCAB, T, d, rng=g), TransformerBlock(d, 2, 16, rng=g, dtype=np.float64),
        TransformerBlock(d, 2, 16, rng=g, dtype=np.float64), TransformerBlock(d, 2, 16, rng=g, dtype=np.float64),
        LayerNorm(d, dtype=np.float64), Linear(d, VOCAB, rng=g, dtype=np.float64),
    )  # fmt: skip


def make(kind: str, seed: int = 0) -> tuple[Sequential, Any]:
    return (mlp(seed), MSELoss()) if kind == "mlp" else (transformer(seed), CrossEntropyLoss())


def batches(kind: str, sizes: list[int], seed: int = 1, masked: bool = False) -> list[tuple]:
    """Global batches (x, y, w) of the given sizes; w masks some samples when ``masked``."""
    g = np.random.default_rng(seed)
    out = []
    for b in sizes:
        if kind == "mlp":
            x, y = g.standard_normal((b, D_IN)), g.standard_normal((b, D_OUT))
        else:
            x, y = g.integers(0, VOCAB, (b, T)), g.integers(0, VOCAB, (b, T))
        w = (g.random(b) > 0.3).astype(np.float64) if masked else None
        out.append((x, y, w))
    return out


def serial_run(kind: str, data: list[tuple], lr: float = 0.01) -> tuple[list[float], dict[str, np.ndarray], Any]:
    """Losses, final parameters and optimizer of one process training on the whole batches."""
    model, loss = make(kind)
    opt = Adam(model.parameters(), lr=lr)
    losses = []
    for x, y, w in data:
        losses.append(loss.forward(model.forward(x), y, w))
        model.backward(loss.backward())
        opt.step()
        opt.zero_grad()
    return losses, {n: p.data.copy() for n, p in model.named_parameters()}, opt


def share(arr: Any, rank: int, size: int) -> Any:
    """Contiguous share ``rank`` of ``size`` of a global batch (None stays None)."""
    if arr is None:
        return None
    bounds = np.linspace(0, arr.shape[0], size + 1).astype(int)
    return arr[bounds[rank] : bounds[rank + 1]]
