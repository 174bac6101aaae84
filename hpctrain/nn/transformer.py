"""Transformer pieces with explicit forward/backward: MLP, causal self-attention, blocks, GPT.

Composite modules keep no state of their own between forward and backward: everything lives in
their leaf layers' ``cache`` (and the attention core's), so ``Module.get_cache``/``set_cache``
swap a whole micro-batch. Their ``forward`` calls the sublayers (``self.fc1(x)``) and adds in
place, which reads the same on arrays and on tensors (``tensor_forward``): on a tensor each layer
and the attention core is one fused node of the autograd graph (``hpctrain.nn.layer_nodes``), the
residual sums are in-place additions of the graph, and no ``backward`` of theirs runs; on arrays
their explicit ``backward`` runs as before. The attention core is two functions (``causal_attention``,
``causal_attention_backward``) on ``(B, H, T, hd)`` arrays; ``SelfAttentionBase`` runs them
between its ``qkv`` and ``proj`` sublayers on the heads it computes, so a tensor-parallel
attention that holds only some heads is the same code with other sublayers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..autograd import Tensor, is_tensor
from ..autograd.tensors import add_into
from ..backend import matmul, stat_dtype, to_device, xp_of
from ..errors import Say, as_argument
from . import fused, gpu
from .buffers import Buffers
from .kernels import row_ones
from .layer_nodes import call_layer
from .layers import GELU, Dropout, Embedding, LayerNorm, Linear, TiedLinear, batch_positions
from .module import Module, Sequential, as_rng
from .moe import MoE, aux_loss_of, moe_blocks

_MASKS: dict[tuple, Any] = {}

#: Query rows per block of the causal attention: a block of queries only looks at the keys up to
#: its last row, so the score and value products skip most of the masked future (a quarter of
#: their work at 128 tokens, close to half for long sequences) instead of computing it and masking
#: it away. Smaller blocks skip more but run smaller, less efficient matrix products.
ATTENTION_BLOCK = 64


def _future_mask(t: int, dtype: Any, xp: Any) -> Any:
    """``(t, t)``: 0 where position i may look at j (j <= i), -inf above the diagonal (cached)."""
    key = (t, np.dtype(dtype), xp.__name__)
    mask = _MASKS.get(key)
    if mask is None:
        if len(_MASKS) > 16:
            _MASKS.clear()
        host = np.where(np.triu(np.ones((t, t), dtype=bool), k=1), -np.inf, 0.0).astype(dtype)
        mask = host if xp is np else xp.asarray(host)
        _MASKS[key] = mask
    return mask


def _blocks(t: int, block: int | None) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of the query blocks of ``t`` positions."""
    bs = ATTENTION_BLOCK if block is None else int(block)
    if bs < 1:
        raise ValueError(f"attention block must be >= 1, got {bs}")
    return [(s, min(s + bs, t)) for s in range(0, t, bs)]


def _get(buffers: Buffers | None, tag: str, shape: tuple, dtype: Any, xp: Any) -> Any:
    return xp.empty(shape, dtype=dtype) if buffers is None else buffers.get(tag, shape, dtype, xp)


def causal_attention(q: Any, k: Any, v: Any, *, out: Any = None, buffers: Buffers | None = None,
                     block: int | None = None) -> tuple[Any, Any]:
    """Softmax(q k^T / sqrt(hd) + causal mask) v on ``(B, H, T, hd)`` arrays.

    Returns ``(y, att)``; ``att`` (B, H, T, T) holds the attention probabilities (0 above the
    diagonal) and is what the backward needs besides q, k, v. On the GPU kernels' path
    (``hpctrain.nn.gpu``) ``att`` is instead the rows' log-sum-exp (B, H, T): backward recomputes
    the probabilities from it, so no T x T array outlives a layer's forward. ``y`` is written into ``out`` when
    given (any strided ``(B, H, T, hd)`` view, e.g. of a ``(B, T, H*hd)`` buffer, so no transpose
    copy follows); ``buffers`` supplies the scratch arrays instead of new ones. The queries go in
    blocks of ``block`` rows (default ``ATTENTION_BLOCK``), each against the keys it may see.
    """
    xp = xp_of(q)
    b, h, t, hd = q.shape
    if out is None:
        out = xp.empty((b, h, t, v.shape[-1]), dtype=np.result_type(q.dtype, k.dtype, v.dtype))
    kern = gpu.usable(q, k, v, out, views=True) if q.dtype == k.dtype == v.dtype == out.dtype else None
    if kern is not None:  # batched products and one softmax kernel; att is the rows' log-sum-exp
        return out, kern.attention_forward(q, k, v, out, _get(buffers, "lse", (b, h, t), np.float32, xp))
    dtype = stat_dtype(np.result_type(q.dtype, k.dtype))  # 16-bit q, k: the softmax in float32
    scale = 1.0 / float(np.sqrt(hd))
    att = _get(buffers, "att", (b, h, t, t), dtype, xp)
    mx = _get(buffers, "max", (b, h, t, 1), dtype, xp)
    sums = _get(buffers, "sum", (b, h, t, 1), dtype, xp)
    kern = fused.usable(att)
    if kern is not None:
        c, ninf = fused.scalars(dtype, scale, -np.inf)
    for s, e in _blocks(t, block):
        a = att[:, :, s:e, :e]  # queries s..e-1 against keys 0..e-1: the rest is masked anyway
        matmul(xp, q[:, :, s:e], xp.swapaxes(k[:, :, :e], -1, -2), out=a)
        if kern is not None:  # the softmax in two fused passes around NumPy's vectorised exp
            kern.softmax_scores(att, s, e, c, ninf)
            xp.exp(a, out=a)
            kern.softmax_normalize(att, s, e)
            matmul(xp, a, v[:, :, :e], out=out[:, :, s:e])
            continue
        a *= scale
        a[..., s:e] += _future_mask(e - s, dtype, xp)  # the diagonal block: no look at j > i
        m = mx[:, :, s:e]
        a -= xp.max(a, axis=-1, keepdims=True, out=m)
        xp.exp(a, out=a)
        r = sums[:, :, s:e]
        xp.matmul(a, row_ones(e, dtype, xp), out=r[..., 0])
        a /= r
        matmul(xp, a, v[:, :, :e], out=out[:, :, s:e])
        if e < t:
            att[:, :, s:e, e:] = 0
    return out, att


def causal_attention_backward(
    dy: Any, q: Any, k: Any, v: Any, att: Any, *, out: tuple[Any, Any, Any] | None = None,
    buffers: Buffers | None = None, block: int | None = None,
) -> tuple[Any, Any, Any]:
    """Gradients ``(dq, dk, dv)`` of :func:`causal_attention` given ``dy`` = d loss / d y.

    ``out`` (three ``(B, H, T, hd)`` arrays or strided views) receives them when given. Only the
    blocks the forward computed (of ``block`` query rows) are read from ``att``.
    """
    xp = xp_of(dy)
    b, h, t, hd = q.shape
    scale = 1.0 / float(np.sqrt(hd))
    dtype = np.result_type(dy.dtype, att.dtype)
    if out is None:
        out = tuple(xp.empty(a.shape, dtype=np.result_type(dtype, a.dtype)) for a in (q, k, v))
    dq, dk, dv = out
    if att.ndim == 3:  # the GPU kernels' forward: att is the log-sum-exp
        dy = dy if dy.dtype == q.dtype else dy.astype(q.dtype)
        gpu.usable(q, views=True).attention_backward(dy, q, k, v, att, dq, dk, dv)
        return dq, dk, dv
    ds = _get(buffers, "datt", att.shape, dtype, xp)
    kern = fused.usable(ds, att)
    if kern is None:
        tmp = _get(buffers, "tmp", att.shape, dtype, xp)
        rowsum = _get(buffers, "rowsum", (*att.shape[:-1], 1), dtype, xp)
    blocks = _blocks(t, block)
    for s, e in blocks:
        # Softmax backward att * (datt - sum(datt * att)) on the block the forward computed;
        # masked positions have att == 0, so their score gradient is 0.
        p, d = att[:, :, s:e, :e], ds[:, :, s:e, :e]
        matmul(xp, dy[:, :, s:e], xp.swapaxes(v[:, :, :e], -1, -2), out=d)
        if kern is not None:  # one pass (hpctrain.nn.fused)
            kern.softmax_backward(ds, att, s, e, *fused.scalars(dtype, scale))
            matmul(xp, d, k[:, :, :e], out=dq[:, :, s:e])
            continue
        pt = tmp[:, :, s:e, :e]
        xp.multiply(d, p, out=pt)
        r = rowsum[:, :, s:e]
        xp.matmul(pt, row_ones(e, dtype, xp), out=r[..., 0])
        d -= r
        d *= p
        d *= scale
        matmul(xp, d, k[:, :, :e], out=dq[:, :, s:e])
    for s, e in blocks:
        # Keys s..e-1 are seen by queries s..t-1 only.
        matmul(xp, xp.swapaxes(att[:, :, s:, s:e], -1, -2), dy[:, :, s:], out=dv[:, :, s:e])
        matmul(xp, xp.swapaxes(ds[:, :, s:, s:e], -1, -2), q[:, :, s:], out=dk[:, :, s:e])
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

    tensor_forward = True  # on a tensor: fc1, act and fc2 are nodes (see the module docstring)

    def forward(self, x: Any) -> Any:
        fc1, bias = self.fc1, getattr(self.fc1, "bias", None)
        xd = x.data if is_tensor(x) else x
        # On the GPU the fc1 bias is added inside the GELU kernel (one pass fewer); a bias that is
        # not a plain contiguous array of x's dtype (a ZeRO-3 placeholder) takes the plain path.
        if type(fc1) is Linear and bias is not None and bias.data.dtype == xd.dtype and gpu.usable(xd, bias.data):
            return self.fc2(self.act(fc1(x, add_bias=False), bias=bias.data))
        return self.fc2(self.act(fc1(x)))

    def backward(self, grad_out: Any) -> Any:
        return self.fc1.backward(self.act.backward(self.fc2.backward(grad_out)))


class SelfAttentionBase(Module):
    """Causal multi-head self-attention on ``(B, T, d_model)`` through two sublayers: ``qkv``, whose
    output columns are ``[q | k | v]`` of the heads this module computes (``heads_here()``; head
    ``h`` of each is columns ``h*hd:(h+1)*hd``, hd = d_model // n_heads), and ``proj``, which
    takes those heads' outputs. ``CausalSelfAttention`` computes every head; a tensor-parallel
    attention (``hpctrain.parallel``) computes its rank's heads with this same code.
    """

    d_model: int
    n_heads: int
    qkv: Module
    proj: Module

    def heads_here(self) -> int:
        """How many heads this module computes: all ``n_heads`` unless a subclass holds fewer."""
        return self.n_heads

    tensor_forward = True  # on a tensor: qkv, the attention core and proj are nodes

    def forward(self, x: Any) -> Any:
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{type(self).__name__}({self.d_model}) needs (B, T, {self.d_model}), got {x.shape}")
        qkv = self.qkv(x)
        y = call_layer(self, qkv, fwd=self.attend, bwd=self.attend_backward) if is_tensor(qkv) else self.attend(qkv)
        return self.proj(y)

    def attend(self, qkv: Any) -> Any:
        """The attention core on the ``qkv`` output ``(B, T, 3 H hd)``: the heads' outputs in the
        ``(B, T, H hd)`` layout ``proj`` reads; keeps ``(q, k, v, att)`` in ``self.cache``."""
        b, t, _ = qkv.shape
        h, hd = self.heads_here(), self.d_model // self.n_heads
        # (B, T, 3, H, hd) -> (3, B, H, T, hd): q, k, v as strided views of the qkv output (no copy)
        parts = qkv.reshape(b, t, 3, h, hd).transpose(2, 0, 3, 1, 4)
        q, k, v = parts[0], parts[1], parts[2]
        xp, buf = xp_of(qkv), self.scratch_buffers()
        # The heads' outputs go straight into the (B, T, H*hd) layout the projection reads.
        y = buf.get("y", (b, t, h * hd), np.result_type(q.dtype, v.dtype), xp)
        # Under context parallelism (nn.ring.ContextAttention) the core runs over its group.
        core = getattr(self.__dict__.get("context"), "attention", causal_attention)
        _, att = core(q, k, v, out=y.reshape(b, t, h, hd).transpose(0, 2, 1, 3), buffers=buf)
        self.cache = (q, k, v, att)
        return y

    def attend_backward(self, grad_y: Any) -> Any:
        """The gradient of the ``qkv`` output given that of ``attend``'s output (``self.cache``)."""
        q, k, v, att = self.cache
        b, h, t, hd = q.shape
        dy = grad_y.reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        xp, buf = xp_of(dy), self.scratch_buffers()
        # dq, dk, dv land in the [q | k | v] column layout of the qkv layer's output gradient.
        dqkv = gpu.scratch(self, dy, q).get("dqkv", (b, t, 3 * h * hd), np.result_type(dy.dtype, q.dtype), xp)
        parts = dqkv.reshape(b, t, 3, h, hd).transpose(2, 0, 3, 1, 4)
        core = getattr(self.__dict__.get("context"), "attention_backward", causal_attention_backward)
        core(dy, q, k, v, att, out=(parts[0], parts[1], parts[2]), buffers=buf)
        return dqkv

    def backward(self, grad_out: Any) -> Any:
        return self.qkv.backward(self.attend_backward(self.proj.backward(grad_out)))


def heads_problem(d_model: int, n_heads: int, say: Say = as_argument) -> str | None:
    """Why ``n_heads`` heads do not fit a width of ``d_model`` (``None``: they do), in ``say``'s
    names: the one place of this rule (the attention, the GPT and ``hpctrain train``'s ``--n-heads``)."""
    if n_heads < 1:
        return f"{say('n_heads')} must be >= 1, got {n_heads}"
    if d_model % n_heads:
        return f"{say('n_heads', n_heads)} must divide {say('d_model', d_model)}"
    return None


class CausalSelfAttention(SelfAttentionBase):
    """Multi-head causal self-attention on ``(B, T, d_model)``.

    ``qkv`` = Linear(d_model, 3 d_model) with output columns ``[q | k | v]``; head ``h`` of each is
    columns ``h*hd:(h+1)*hd`` (hd = d_model // n_heads). ``proj`` = Linear(d_model, d_model).
    """

    def __init__(
        self, d_model: int, n_heads: int, rng: int | np.random.Generator | None = None, dtype: Any = np.float32
    ) -> None:
        problem = heads_problem(d_model, n_heads)
        if problem is not None:
            raise ValueError(problem)
        g = as_rng(rng)
        self.d_model, self.n_heads = d_model, n_heads
        self.qkv = Linear(d_model, 3 * d_model, rng=g, dtype=dtype)
        self.proj = Linear(d_model, d_model, rng=g, dtype=dtype)
        self.cache = None

    def extra_repr(self) -> str:
        return f"{self.d_model}, n_heads={self.n_heads}"


def _residual(y: Any, x: Any) -> Any:
    """``y + x`` into ``y``: a tensor through ``add_into`` (the graph's in-place sum where safe),
    arrays through ``gpu.add_`` (one kernel on a GPU)."""
    return add_into(y, x) if is_tensor(y) else gpu.add_(y, x)


class TransformerBlock(Module):
    """Pre-norm block: ``x = x + attn(ln1(x)); x = x + mlp(ln2(x))``.

    ``dropout > 0`` adds GPT-2's residual dropout on both branches (``drop1``, ``drop2``, each with
    its own generator seeded from ``rng``); parameter names are the same either way. ``moe``: the
    keyword arguments of an ``nn.MoE`` (``experts``, ``top_k``, ``capacity``) that replaces the MLP.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_hidden: int,
        rng: int | np.random.Generator | None = None,
        dtype: Any = np.float32,
        dropout: float = 0.0,
        moe: dict[str, Any] | None = None,
    ) -> None:
        g = as_rng(rng)
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, n_heads, rng=g, dtype=dtype)
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        self.mlp = MoE(d_model, d_hidden, rng=g, dtype=dtype, **moe) if moe else \
            MLP(d_model, d_hidden, rng=g, dtype=dtype)
        if dropout:
            seeds = g.integers(2**63, size=2)
            self.drop1 = Dropout(dropout, rng=int(seeds[0]))
            self.drop2 = Dropout(dropout, rng=int(seeds[1]))

    tensor_forward = True  # on a tensor: every layer a node, the residual sums in-place additions

    def _drop(self, name: str, x: Any, backward: bool = False) -> Any:
        d = self.__dict__.get("_modules", {}).get(name)
        if d is None:
            return x
        if backward:
            return d.backward(x)
        # An inactive dropout is no node: the in-place residual sum goes into x itself.
        return d(x) if d.training and d.p else d.forward(x)

    def forward(self, x: Any) -> Any:
        # The residual sums go into the sublayers' fresh outputs (nobody caches those; Dropout
        # returns a new array or, when off, that output), not into new arrays; x itself is never
        # changed (ln1 caches it). On a GPU's arrays one kernel each (gpu.add_); on a tensor whose
        # memory another shares (a tensor-parallel mapping hands back its input), into a new one.
        h = _residual(self._drop("drop1", self.attn(self.ln1(x))), x)
        return _residual(self._drop("drop2", self.mlp(self.ln2(h))), h)

    def backward(self, grad_out: Any) -> Any:
        g = gpu.add_(self.ln2.backward(self.mlp.backward(self._drop("drop2", grad_out, True))), grad_out)
        return gpu.add_(self.ln1.backward(self.attn.backward(self._drop("drop1", g, True))), g)


class GPT(Module):
    """A small GPT: token + position embeddings, ``n_layers`` blocks, final LayerNorm, linear head.

    ``forward(idx)`` takes integer tokens ``(B, T)`` with ``T <= block_size`` and returns logits
    ``(B, T, vocab_size)``; ``backward(grad_logits)`` accumulates every gradient and returns
    ``None`` (token ids have no gradient). Embeddings start as N(0, 0.02^2) like GPT-2's.
    ``dropout`` is the blocks' residual dropout (0: none, the default).

    ``tie_embeddings=True`` is nanoGPT's tied head: ``head`` is a ``TiedLinear`` computing
    ``x @ tok_emb.weight.T`` with the token embedding's very ``Parameter``, which both add their
    gradients into. The model lists it once, under the embedding's name ``tok_emb.weight``
    (``state_dict``, ``parameters()``, checkpoints: no ``head.weight``); ``tied_weights()`` names
    the alias (``{"head.weight": "tok_emb.weight"}``), for code that sees the head alone (a
    pipeline's last stage lists it as ``head.weight``).

    ``moe_experts=E > 0``: the MLP of every ``moe_every``-th block (blocks ``moe_every-1, ...``:
    Megatron's ``moe_layer_freq``) is an ``nn.MoE`` (E experts of ``d_hidden``, ``moe_top_k``,
    ``moe_capacity``); ``aux_loss`` sums their load-balancing terms (``nn.moe``: its gradient).
    """

    tensor_forward = True  # on a tensor: embeddings, blocks, final norm and head are nodes

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
        tie_embeddings: bool = False,
        moe_experts: int = 0, moe_top_k: int = 2, moe_every: int = 1, moe_capacity: float = 0.0,
    ) -> None:
        if n_layers < 1:
            raise ValueError(f"GPT needs n_layers >= 1, got {n_layers}")
        problem = heads_problem(d_model, n_heads)
        if problem is not None:
            raise ValueError(problem)
        g = as_rng(rng)
        d_hidden = self.tp_sizes(d_model, n_heads, d_hidden)["hidden"]
        self.vocab_size, self.block_size = vocab_size, block_size
        self.tok_emb = Embedding(vocab_size, d_model, std=0.02, rng=g, dtype=dtype)
        self.pos_emb = Embedding(block_size, d_model, std=0.02, rng=g, dtype=dtype)
        moes = moe_blocks(n_layers, moe_experts, moe_top_k, moe_every, moe_capacity)
        self.blocks = Sequential(*(TransformerBlock(d_model, n_heads, d_hidden, rng=g, dtype=dtype, dropout=dropout,
                                                    moe=moe) for moe in moes))
        self.ln_f = LayerNorm(d_model, dtype=dtype)
        self.tie_embeddings = bool(tie_embeddings)
        self.head = TiedLinear(self.tok_emb.weight) if tie_embeddings else \
            Linear(d_model, vocab_size, bias=False, rng=g, dtype=dtype)

    def forward(self, idx: Any) -> Any:
        xp = xp_of(self.tok_emb.weight.data)
        tokens = to_device(idx.data if is_tensor(idx) else idx, xp)
        if tokens.ndim != 2 or tokens.shape[1] > self.block_size:
            raise ValueError(f"GPT needs tokens (B, T) with T <= block_size={self.block_size}, got {tokens.shape}")
        pos = self._positions(tokens.shape[1], xp)
        if is_tensor(idx):  # through the graph: the lookups as nodes
            tokens, pos = Tensor(tokens), Tensor(batch_positions(pos, tokens.shape, self.pos_emb.weight.dtype))
        x = _residual(self.tok_emb(tokens), self.pos_emb(pos))  # into the lookup's fresh output
        return self.head(self.ln_f(self.blocks(x)))

    @property
    def aux_loss(self) -> float:
        """The sum of the MoE blocks' load-balancing terms of the last forward (0 without MoE)."""
        return aux_loss_of(self)

    def tied_weights(self) -> dict[str, str]:
        """``{alias: owner}``: the parameter names that are another's very ``Parameter`` (the tied
        head's weight is the token embedding's); empty when nothing is tied."""
        return {"head.weight": "tok_emb.weight"} if self.tie_embeddings else {}

    def _positions(self, t: int, xp: Any) -> Any:
        """Positions of ``t`` tokens: ``0..t-1``, or this rank's share's under ``context_parallel``."""
        pos, cp = self.__dict__.get("_pos"), self.__dict__.get("context")
        if pos is None or pos.shape[0] != t or xp_of(pos) is not xp or self.__dict__.get("_pos_cp") is not cp:
            pos = self.__dict__["_pos"] = xp.arange(t) if cp is None else xp.asarray(cp.positions(t, self.block_size))
            self.__dict__["_pos_cp"] = cp
        return pos

    def backward(self, grad_out: Any) -> None:
        g = self.blocks.backward(self.ln_f.backward(self.head.backward(grad_out)))
        self.tok_emb.backward(g)
        xp, gw = xp_of(g), self.pos_emb.weight.grad  # summed in its dtype: in 16 bits fp16's loss scale overflows
        gpos = self.scratch_buffers().get("gpos", g.shape[1:], gw.dtype, xp)
        k = gpu.usable(g, gw)
        if k is not None:  # the column-sum kernel, summed in float32
            k.col_sum(g.reshape(g.shape[0], -1), gpos.reshape(-1), accumulate=False)
        else:  # (CuPy's sum may also take CUB, which allocates: not for a captured step)
            xp.sum(g, axis=0, dtype=gpos.dtype, out=gpos)
        self.pos_emb.backward(gpos)
        return None

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, block_size={self.block_size}"

    # -- plans: how parallel/ may split this model (optional methods of protocols.Module) ------

    def pipeline_cuts(self) -> list[tuple[str, dict[str, Module], Any, Any]]:
        """The pieces a pipeline may cut between, in forward order: ``(name, {serial module name:
        module}, forward, backward)`` for the embeddings, each block, the final LayerNorm and
        the head. Forward and backward look the module up at each call, so wrappers installed
        later (ZeRO-3 gathers, overlap hooks) are the ones that run."""
        tok, pos = self.tok_emb, self.pos_emb
        block_size, positions_of = self.block_size, self._positions

        def embed(idx: Any) -> Any:
            xp = xp_of(pos.weight.data)
            tokens = to_device(idx.data if is_tensor(idx) else idx, xp)
            if tokens.ndim != 2 or tokens.shape[1] > block_size:
                raise ValueError(f"GPT needs tokens (B, T) with T <= block_size={block_size}, got {tokens.shape}")
            positions = positions_of(tokens.shape[1], xp)
            if is_tensor(idx):  # through the graph: the lookups as nodes
                return tok(Tensor(tokens)) + pos(Tensor(batch_positions(positions, tokens.shape, pos.weight.dtype)))
            return tok.forward(tokens) + pos.forward(positions)

        def embed_backward(g: Any) -> None:
            tok.backward(g)
            pos.backward(g.sum(axis=0, dtype=pos.weight.grad.dtype))  # (as GPT.backward: not in 16 bits)
            return None

        def late(m: Any) -> tuple[Any, Any]:
            return (lambda x: m(x)), (lambda g: m.backward(g))

        pieces = [("embed", {"tok_emb": tok, "pos_emb": pos}, embed, embed_backward)]
        for name in self.blocks.layer_names:
            b = getattr(self.blocks, name)
            pieces.append((f"blocks.{name}", {f"blocks.{name}": b}, *late(b)))
        for name in ("ln_f", "head"):
            m = getattr(self, name)
            pieces.append((name, {name: m}, *late(m)))
        return pieces

    @staticmethod
    def pipeline_cut_count(n_layers: int) -> int:
        """How many pieces ``pipeline_cuts`` gives for ``n_layers`` blocks (a config check's
        bound on the pipeline stages, before the model exists)."""
        return n_layers + 3

    @staticmethod
    def tp_sizes(d_model: int, n_heads: int, d_hidden: int | None = None) -> dict[str, int]:
        """The sizes a tensor-parallel group splits: the attention's heads and the MLPs' hidden
        width (``d_hidden``, default ``4 * d_model``), for a config check before the model exists."""
        return {"n_heads": n_heads, "hidden": 4 * d_model if d_hidden is None else d_hidden}

    def tp_plan(self) -> dict[str, str]:
        """How the parts that are not generic layers split over tensor-parallel ranks, by module
        name: the token embedding over the vocabulary, the head column-wise with its logits left
        split over the vocabulary (the loss is then the vocab-parallel cross-entropy). Blocks'
        attention and MLP split as those layers always do. A tied head is ``tied_vocab_head``:
        the embedding's vocabulary rows, used transposed."""
        return {"tok_emb": "vocab_embedding", "head": "tied_vocab_head" if self.tie_embeddings else "vocab_head"}

