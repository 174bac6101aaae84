"""Transformer pieces with explicit forward/backward: MLP, causal self-attention, blocks, GPT.

Composite modules keep no state of their own between forward and backward: everything lives in
their leaf layers' ``cache`` (and the attention core's), so ``Module.get_cache``/``set_cache``
swap a whole micro-batch. The attention core is also exposed as two functions
(``causal_attention``, ``causal_attention_backward``) on ``(B, H, T, hd)`` arrays so a
tensor-parallel attention that holds only some heads can reuse it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from .layers import GELU, Dropout, Embedding, LayerNorm, Linear
from .module import Module, Sequential, as_rng


def causal_attention(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """Softmax(q k^T / sqrt(hd) + causal mask) v on ``(B, H, T, hd)`` arrays.

    Returns ``(y, att)``; ``att`` (B, H, T, T) is what the backward needs besides q, k, v.
    """
    xp = xp_of(q)
    t, hd = q.shape[-2], q.shape[-1]
    scores = (q @ xp.swapaxes(k, -1, -2)) * (1.0 / float(np.sqrt(hd)))
    future = xp.triu(xp.ones((t, t), dtype=bool), k=1)  # position i may not look at j > i
    scores = xp.where(future, xp.asarray(-xp.inf, dtype=scores.dtype), scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    att = xp.exp(scores)
    att /= att.sum(axis=-1, keepdims=True)
    return att @ v, att


def causal_attention_backward(dy: Any, q: Any, k: Any, v: Any, att: Any) -> tuple[Any, Any, Any]:
    """Gradients ``(dq, dk, dv)`` of :func:`causal_attention` given ``dy`` = d loss / d y."""
    xp = xp_of(dy)
    scale = 1.0 / float(np.sqrt(q.shape[-1]))
    dv = xp.swapaxes(att, -1, -2) @ dy
    datt = dy @ xp.swapaxes(v, -1, -2)
    # Softmax backward; masked positions have att == 0 so their score gradient is 0.
    dscores = att * (datt - (datt * att).sum(axis=-1, keepdims=True))
    dscores *= scale
    dq = dscores @ k
    dk = xp.swapaxes(dscores, -1, -2) @ q
    return dq, dk, dv


class MLP(Module):
    """``fc2(GELU(fc1(x)))`` with ``fc1`` = Linear(d_model, d_hidden), ``fc2`` = Linear(d_hidden, d_model)."""

    def __init__(
        self, d_model: int, d_hidden: int, rng: int | np.random.Generator | None = None, dtype: Any = np.float32
    ) -> None:
        g = as_rng(rng)
        self.fc1 = Linear(d_model, d_hidden, rng=g, dtype=dtype)
        self.act = GELU()
        self.fc2 = Linear(d_hidden, d_model, rng=g, dtype=dtype)

    def forward(self, x: Any) -> Any:
        return self.fc2.forward(self.act.forward(self.fc1.forward(x)))

    def backward(self, grad_out: Any) -> Any:
        return self.fc1.backward(self.act.backward(self.fc2.backward(grad_out)))


class CausalSelfAttention(Module):
    """Multi-head causal self-attention on ``(B, T, d_model)``.

    ``qkv`` = Linear(d_model, 3 d_model) with output columns ``[q | k | v]``; head ``h`` of each is
    columns ``h*hd:(h+1)*hd`` (hd = d_model // n_heads). ``proj`` = Linear(d_model, d_model).
    """

    def __init__(
        self, d_model: int, n_heads: int, rng: int | np.random.Generator | None = None, dtype: Any = np.float32
    ) -> None:
        if n_heads < 1 or d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must be positive and divide d_model={d_model}")
        g = as_rng(rng)
        self.d_model, self.n_heads = d_model, n_heads
        self.qkv = Linear(d_model, 3 * d_model, rng=g, dtype=dtype)
        self.proj = Linear(d_model, d_model, rng=g, dtype=dtype)
        self.cache = None

    def forward(self, x: Any) -> Any:
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"CausalSelfAttention({self.d_model}) needs (B, T, {self.d_model}), got {x.shape}")
        b, t, d = x.shape
        h = self.n_heads
        # (B, T, 3, H, hd) -> (3, B, H, T, hd): q, k, v with heads as a batch axis
        qkv = self.qkv.forward(x).reshape(b, t, 3, h, d // h).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        y, att = causal_attention(q, k, v)
        self.cache = (q, k, v, att)
        return self.proj.forward(y.transpose(0, 2, 1, 3).reshape(b, t, d))

    def backward(self, grad_out: Any) -> Any:
        q, k, v, att = self.cache
        b, h, t, hd = q.shape
        dy = self.proj.backward(grad_out).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        dq, dk, dv = causal_attention_backward(dy, q, k, v, att)
        dqkv = xp_of(dq).stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(b, t, 3 * h * hd)
        return self.qkv.backward(dqkv)

    def extra_repr(self) -> str:
        return f"{self.d_model}, n_heads={self.n_heads}"


class TransformerBlock(Module):
    """Pre-norm block: ``x = x + attn(ln1(x)); x = x + mlp(ln2(x))``.

    ``dropout > 0`` adds GPT-2's residual dropout on both branches (``drop1``, ``drop2``, each with
    its own generator seeded from ``rng``); parameter names are the same either way.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_hidden: int,
        rng: int | np.random.Generator | None = None,
        dtype: Any = np.float32,
        dropout: float = 0.0,
    ) -> None:
        g = as_rng(rng)
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, n_heads, rng=g, dtype=dtype)
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        self.mlp = MLP(d_model, d_hidden, rng=g, dtype=dtype)
        if dropout:
            seeds = g.integers(2**63, size=2)
            self.drop1 = Dropout(dropout, rng=int(seeds[0]))
            self.drop2 = Dropout(dropout, rng=int(seeds[1]))

    def _drop(self, name: str, x: Any, backward: bool = False) -> Any:
        d = self.__dict__.get("_modules", {}).get(name)
        if d is None:
            return x
        return d.backward(x) if backward else d.forward(x)

    def forward(self, x: Any) -> Any:
        x = x + self._drop("drop1", self.attn.forward(self.ln1.forward(x)))
        return x + self._drop("drop2", self.mlp.forward(self.ln2.forward(x)))

    def backward(self, grad_out: Any) -> Any:
        g = grad_out + self.ln2.backward(self.mlp.backward(self._drop("drop2", grad_out, True)))
        return g + self.ln1.backward(self.attn.backward(self._drop("drop1", g, True)))


class GPT(Module):
    """A small GPT: token + position embeddings, ``n_layers`` blocks, final LayerNorm, linear head.

    ``forward(idx)`` takes integer tokens ``(B, T)`` with ``T <= block_size`` and returns logits
    ``(B, T, vocab_size)``; ``backward(grad_logits)`` accumulates every gradient and returns
    ``None`` (token ids have no gradient). Embeddings start as N(0, 0.02^2) like GPT-2's.
    ``dropout`` is the blocks' residual dropout (0: none, the default).
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        d_model: int,
        n_heads: int,
        n_layers: int,
        d_hidden: int | None = None,
        rng: int | np.random.Generator | None = None,
        dtype: Any = np.float32,
        dropout: float = 0.0,
    ) -> None:
        if n_layers < 1:
            raise ValueError(f"GPT needs n_layers >= 1, got {n_layers}")
        if n_heads < 1 or d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must be positive and divide d_model={d_model}")
        g = as_rng(rng)
        d_hidden = 4 * d_model if d_hidden is None else d_hidden
        self.vocab_size, self.block_size = vocab_size, block_size
        self.tok_emb = Embedding(vocab_size, d_model, std=0.02, rng=g, dtype=dtype)
        self.pos_emb = Embedding(block_size, d_model, std=0.02, rng=g, dtype=dtype)
        self.blocks = Sequential(*(TransformerBlock(d_model, n_heads, d_hidden, rng=g, dtype=dtype, dropout=dropout)
                                   for _ in range(n_layers)))
        self.ln_f = LayerNorm(d_model, dtype=dtype)
        self.head = Linear(d_model, vocab_size, bias=False, rng=g, dtype=dtype)

    def forward(self, idx: Any) -> Any:
        xp = xp_of(self.tok_emb.weight.data)
        idx = to_device(idx, xp)
        if idx.ndim != 2 or idx.shape[1] > self.block_size:
            raise ValueError(f"GPT needs tokens (B, T) with T <= block_size={self.block_size}, got {idx.shape}")
        x = self.tok_emb.forward(idx) + self.pos_emb.forward(xp.arange(idx.shape[1]))
        return self.head.forward(self.ln_f.forward(self.blocks.forward(x)))

    def backward(self, grad_out: Any) -> None:
        g = self.blocks.backward(self.ln_f.backward(self.head.backward(grad_out)))
        self.tok_emb.backward(g)
        self.pos_emb.backward(g.sum(axis=0))
        return None

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, block_size={self.block_size}"

