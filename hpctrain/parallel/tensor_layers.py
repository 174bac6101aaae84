"""Tensor-parallel layers: column/row-parallel Linear, MLP, self-attention, vocab-parallel embedding and loss.

Each layer holds this rank's slice of the serial layer's parameters under the serial attribute
names (``weight``, ``bias``, ``fc1``, ``qkv`` ...) so dotted names stay those of the serial model,
and records in ``shard_index`` where each local array sits in the full tensor (``full_shape`` and
an index). The computation is nn's: the linear layers hold an ``nn.Linear`` over their slice
(``Linear.borrowing``: their parameters, its fast path and precision handling), the attention is
``nn.transformer.SelfAttentionBase`` on this rank's heads, the embedding's
gradient goes through ``nn.layers.scatter_add``. Communication goes only through the mapping
``Function``s of ``tensor_mappings``; every layer with communication is a ``TPLayer`` that writes
only its forward on tensors (``compute``), so none has a backward of its own that could forget a
twin (the attention composes them as the serial one composes its Linears).

Shapes that do not split are refused with a ``ValueError`` when the layer is built; every rank
builds from the same serial model, so every rank refuses alike.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ..autograd import Function
from ..autograd.function import Context
from ..backend import matmul, to_device, widen, xp_of
from ..errors import Say, as_argument
from ..nn.layers import Linear, add_bias_grad, check_indices, scatter_add
from ..nn.losses import CrossEntropyLoss, all_weights_zero, batch_mean, check_targets, nonzero, per_sample_weight
from ..nn.module import Module, Parameter
from ..nn.transformer import SelfAttentionBase
from ..protocols import Comm
from .tensor_mappings import (
    CopyToTP,
    GatherFromTP,
    ReduceFromTP,
    ScatterToTP,
    TPLayer,
    partition,
    reduce_from_tp,
)


def tp_heads_problem(n_heads: int, tp: int, say: Say = as_argument) -> str | None:
    """Why ``n_heads`` attention heads do not split over ``tp`` ranks (``None``: they do), in
    ``say``'s names: the one place of this rule (``ParallelSelfAttention`` and ``hpctrain train``'s
    layout check ask it)."""
    if n_heads % tp:
        return f"tp={tp} must divide {say('n_heads', n_heads)} (the heads are split across ranks)"
    return None


def tp_hidden_problem(d_hidden: int, tp: int) -> str | None:
    """Why an MLP's hidden width ``d_hidden`` does not split over ``tp`` ranks (``None``: it does)."""
    if d_hidden % tp:
        return f"tp={tp} must divide the hidden width {d_hidden} (it is split across ranks)"
    return None


def _index_of(ranges: list[tuple[int, int]]) -> Any:
    """A slice for one contiguous range, else the sorted column ids (several ranges, as for qkv)."""
    if len(ranges) == 1:
        return slice(*ranges[0])
    return np.concatenate([np.arange(a, b) for a, b in ranges])


class ColumnParallelLinear(TPLayer):
    """``y = x @ W + b`` with ``W`` split by output columns: rank r holds ``W[:, cols_r]``, ``b[cols_r]``.

    The input is replicated (``CopyToTP``: its gradient is all-reduced); the output stays split
    unless ``gather_output`` (``GatherFromTP``, which needs ``d_out % tp == 0``). ``linear`` (an
    ``nn.Linear`` over the slice, sharing ``weight`` and ``bias``) computes.
    """

    def __init__(self, d_in: int, d_out: int, comm: Comm, bias: bool = True, gather_output: bool = False,
                 rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        self._setup(Linear(d_in, d_out, bias=bias, rng=rng, dtype=dtype), comm, gather_output, None)

    @classmethod
    def from_serial(cls, linear: Linear, comm: Comm, gather_output: bool = False,
                    columns: list[tuple[int, int]] | None = None) -> ColumnParallelLinear:
        """Slice ``linear``'s columns for this rank (``columns``: explicit ``[start, stop)`` ranges)."""
        obj = cls.__new__(cls)
        obj._setup(linear, comm, gather_output, columns)
        return obj

    def _setup(self, linear: Linear, comm: Comm, gather_output: bool, columns: list | None) -> None:
        d_in, d_out = linear.weight.shape
        if columns is None:
            if gather_output and d_out % comm.size:
                raise ValueError(
                    f"ColumnParallelLinear: d_out={d_out} is not divisible by the tensor-parallel size "
                    f"{comm.size} (needed to gather the output)"
                )
            if d_out < comm.size:
                raise ValueError(f"ColumnParallelLinear: d_out={d_out} < tensor-parallel size {comm.size}")
            columns = [partition(d_out, comm.size, comm.rank)]
        self.comm, self.gather_output = comm, gather_output
        self.d_in, self.d_out = d_in, d_out
        idx = _index_of(columns)
        xp = xp_of(linear.weight.data)
        self.weight = Parameter(xp.ascontiguousarray(linear.weight.data[:, idx]))
        self.bias = Parameter(linear.bias.data[idx].copy()) if linear.bias is not None else None
        self.d_local = self.weight.shape[1]
        self.shard_index = {"weight": ((d_in, d_out), (slice(None), idx))}
        if self.bias is not None:
            self.shard_index["bias"] = ((d_out,), (idx,))
        self.linear = Linear.borrowing(self.weight, self.bias)  # computes; lists no parameters
        self.cache = None

    def compute(self, x: Any) -> Any:
        if x.shape[-1] != self.d_in:
            raise ValueError(f"ColumnParallelLinear({self.d_in}, {self.d_out}) got input of shape {x.shape}")
        y = self.linear(CopyToTP.apply(x, self.comm))
        return GatherFromTP.apply(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"{self.d_in}, {self.d_out} (local {self.d_local}), tp={self.comm.size}"


class BiasAfterReduce(Function):
    """``y + bias`` after the all-reduce (a new array: an output that is its input's array shares
    its version, and the block's residual sum adds into this one in place); the bias gradient is
    added into ``layer.bias.grad`` here (column sums as a BLAS product,
    ``nn.layers.add_bias_grad``), so the node gives the bias none of its own."""

    accumulates_in_place = True  # the parameters' gradients are added into their .grad here

    @staticmethod
    def forward(ctx: Context, y: Any, bias: Any, layer: Any) -> Any:
        ctx.layer = layer
        return y + bias

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        layer = ctx.layer
        if ctx.needs_input_grad[1]:
            add_bias_grad(layer.bias, g.reshape(-1, layer.d_out), layer.scratch_buffers(), g.dtype)
        return g, None, None


class RowParallelLinear(TPLayer):
    """``y = x @ W + b`` with ``W`` split by input rows: rank r holds ``W[rows_r, :]``; ``b`` is replicated.

    The input arrives split along its last axis (``input_is_parallel``; otherwise ``ScatterToTP``
    here); ``linear`` (an ``nn.Linear`` over the rows, without bias) computes the partial product,
    ``ReduceFromTP`` sums it and the bias is added once, after the reduction.
    """

    def __init__(self, d_in: int, d_out: int, comm: Comm, bias: bool = True, input_is_parallel: bool = True,
                 rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        self._setup(Linear(d_in, d_out, bias=bias, rng=rng, dtype=dtype), comm, input_is_parallel, None)

    @classmethod
    def from_serial(cls, linear: Linear, comm: Comm, input_is_parallel: bool = True,
                    rows: tuple[int, int] | None = None) -> RowParallelLinear:
        """Slice ``linear``'s rows for this rank (``rows``: an explicit ``[start, stop)``)."""
        obj = cls.__new__(cls)
        obj._setup(linear, comm, input_is_parallel, rows)
        return obj

    def _setup(self, linear: Linear, comm: Comm, input_is_parallel: bool, rows: tuple | None) -> None:
        d_in, d_out = linear.weight.shape
        if rows is None:
            if not input_is_parallel and d_in % comm.size:
                raise ValueError(
                    f"RowParallelLinear: d_in={d_in} is not divisible by the tensor-parallel size {comm.size} "
                    "(needed to scatter the input)"
                )
            if d_in < comm.size:
                raise ValueError(f"RowParallelLinear: d_in={d_in} < tensor-parallel size {comm.size}")
            rows = partition(d_in, comm.size, comm.rank)
        self.comm, self.input_is_parallel = comm, input_is_parallel
        self.d_in, self.d_out = d_in, d_out
        self.weight = Parameter(linear.weight.data[rows[0] : rows[1]].copy())
        self.bias = Parameter(linear.bias.data.copy()) if linear.bias is not None else None
        self.d_local = self.weight.shape[0]
        self.shard_index = {"weight": ((d_in, d_out), (slice(*rows), slice(None)))}
        # The bias stays out of the Linear: it is added once, after the reduction.
        self.linear = Linear.borrowing(self.weight, None)
        self.cache = None

    def compute(self, x: Any) -> Any:
        if not self.input_is_parallel:
            if x.shape[-1] != self.d_in:
                raise ValueError(f"RowParallelLinear({self.d_in}, {self.d_out}) got input of shape {x.shape}")
        elif x.shape[-1] != self.d_local:
            raise ValueError(
                f"RowParallelLinear({self.d_in}, {self.d_out}) expects this rank's {self.d_local} input "
                f"columns, got input of shape {x.shape}"
            )
        if not self.input_is_parallel:
            x = ScatterToTP.apply(x, self.comm)
        y = ReduceFromTP.apply(self.linear(x), self.comm)
        return BiasAfterReduce.apply(y, self.bias, self) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{self.d_in} (local {self.d_local}), {self.d_out}, tp={self.comm.size}"


class ParallelMLP(TPLayer):
    """``fc2(act(fc1(x)))`` with ``fc1`` column- and ``fc2`` row-parallel: one all-reduce each way."""

    def __init__(self, fc1: ColumnParallelLinear, act: Module, fc2: RowParallelLinear) -> None:
        self.fc1, self.act, self.fc2 = fc1, act, fc2
        self.comm = fc1.comm
        self.cache = None

    @classmethod
    def from_serial(cls, mlp: Any, comm: Comm) -> ParallelMLP:
        """Split a serial ``MLP`` (``fc1``, ``act``, ``fc2``) over ``comm``."""
        d_hidden = mlp.fc1.weight.shape[1]
        problem = tp_hidden_problem(d_hidden, comm.size)
        if problem is not None:
            raise ValueError(f"ParallelMLP: hidden size {d_hidden} is not divisible: {problem}")
        return cls(ColumnParallelLinear.from_serial(mlp.fc1, comm), copy.deepcopy(mlp.act),  # own cache
                   RowParallelLinear.from_serial(mlp.fc2, comm))

    def compute(self, x: Any) -> Any:
        return self.fc2(self.act(self.fc1(x)))


class ParallelSelfAttention(SelfAttentionBase):
    """Causal multi-head self-attention with the heads split across the tensor-parallel group.

    ``qkv`` is column-parallel (rank r holds the q, k and v columns of its heads), the attention
    of those heads is ``SelfAttentionBase``'s (the serial code on ``n_local_heads`` heads: on a
    tensor the core is one node) and ``proj`` is row-parallel: one all-reduce forward, one
    backward. Needs ``n_heads % tp == 0``.
    """

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, n_heads: int, comm: Comm) -> None:
        self.qkv, self.proj = qkv, proj
        self.n_heads, self.comm = n_heads, comm
        self.n_local_heads = n_heads // comm.size
        self.d_model = proj.d_out
        self.head_dim = self.d_model // n_heads
        self.cache = None

    def heads_here(self) -> int:
        return self.n_local_heads

    @classmethod
    def from_serial(cls, attn: Any, comm: Comm) -> ParallelSelfAttention:
        """Split a serial ``CausalSelfAttention`` (``qkv``, ``proj``, ``n_heads``) by heads over ``comm``."""
        n_heads = int(attn.n_heads)
        d = attn.proj.weight.shape[1]
        problem = tp_heads_problem(n_heads, comm.size)
        if problem is not None:  # (the first words are what callers have matched since round one)
            raise ValueError(f"ParallelSelfAttention: n_heads={n_heads} is not divisible by the tensor-parallel "
                             f"size {comm.size}: {problem}")
        if attn.qkv.weight.shape != (d, 3 * d):
            raise ValueError(f"ParallelSelfAttention: qkv weight must be ({d}, {3 * d}), got {attn.qkv.weight.shape}")
        dl = d // comm.size
        start = comm.rank * dl
        cols = [(j * d + start, j * d + start + dl) for j in range(3)]  # this rank's heads of q, k, v
        qkv = ColumnParallelLinear.from_serial(attn.qkv, comm, columns=cols)
        proj = RowParallelLinear.from_serial(attn.proj, comm, rows=(start, start + dl))
        return cls(qkv, proj, n_heads, comm)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads} (local {self.n_local_heads}), tp={self.comm.size}"


class VocabLookup(Function):
    """This rank's rows of the embedding at the ids it owns, zeros elsewhere; the rows' gradients
    are added into ``layer.weight.grad`` with the serial Embedding's scatter (``nn.layers``)."""

    accumulates_in_place = True  # the parameters' gradients are added into their .grad here

    @staticmethod
    def forward(ctx: Context, idx: Any, w: Any, layer: Any) -> Any:
        xp = xp_of(w)
        idx = check_indices(to_device(idx, xp), layer.n, f"VocabParallelEmbedding({layer.n})")
        mine = (idx >= layer.start) & (idx < layer.stop)
        local = xp.where(mine, idx - layer.start, 0)
        ctx.save_for_backward(local, mine)
        ctx.layer = layer
        return w[local] * mine[..., None]

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        local, mine = ctx.saved_tensors
        w = ctx.layer.weight
        if ctx.needs_input_grad[1]:
            scatter_add(w.grad, local[mine], g[mine].reshape(-1, w.shape[1]))
        return None, None, None


class VocabParallelEmbedding(TPLayer):
    """An ``Embedding`` whose rows (the vocabulary) are split: rank r looks up only its own ids.

    Ids owned by other ranks give zeros locally; one all-reduce assembles the full embeddings.
    """

    def __init__(self, weight: Any, n: int, comm: Comm, rows: tuple[int, int]) -> None:
        self.comm, self.n = comm, n
        self.start, self.stop = rows
        self.weight = Parameter(weight)
        self.shard_index = {"weight": ((n, weight.shape[1]), (slice(*rows), slice(None)))}
        self.cache = None

    @classmethod
    def from_serial(cls, emb: Any, comm: Comm) -> VocabParallelEmbedding:
        n = emb.weight.shape[0]
        if n < comm.size:
            raise ValueError(f"VocabParallelEmbedding: {n} rows < tensor-parallel size {comm.size}")
        rows = partition(n, comm.size, comm.rank)
        return cls(emb.weight.data[rows[0] : rows[1]].copy(), n, comm, rows)

    def compute(self, idx: Any) -> Any:
        return ReduceFromTP.apply(VocabLookup.apply(idx, self.weight, self), self.comm)

    def extra_repr(self) -> str:
        return f"{self.n} (local rows {self.start}:{self.stop}), {self.weight.shape[1]}, tp={self.comm.size}"


class TiedLogits(Function):
    """``x @ weight.T`` for a head tied to an embedding's ``(rows, d)`` weight; the weight's
    gradient ``g.T @ x`` is added into ``layer.weight.grad`` here (its other use, the lookup,
    adds its own: they sum)."""

    accumulates_in_place = True  # the parameters' gradients are added into their .grad here

    @staticmethod
    def forward(ctx: Context, x: Any, w: Any, layer: Any) -> Any:
        xp = xp_of(x)
        ctx.save_for_backward(x, w)
        ctx.layer = layer
        y = xp.empty((*x.shape[:-1], w.shape[0]), dtype=np.result_type(x.dtype, w.dtype))
        matmul(xp, x.reshape(-1, w.shape[1]), w.T, out=y.reshape(-1, w.shape[0]))
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        x, w = ctx.saved_tensors
        xp = xp_of(g)
        g2, x2 = g.reshape(-1, w.shape[0]), x.reshape(-1, w.shape[1])
        if ctx.needs_input_grad[1]:
            p = ctx.layer.weight
            p.grad += matmul(xp, g2.T, x2, out=xp.empty(w.shape, dtype=np.result_type(g.dtype, x.dtype)))
        gx = None
        if ctx.needs_input_grad[0]:
            gx = xp.empty(x.shape, dtype=np.result_type(g.dtype, w.dtype))
            matmul(xp, g2, w, out=gx.reshape(-1, w.shape[1]))
        return gx, None, None


class VocabParallelTiedHead(TPLayer):
    """The output layer tied to a ``VocabParallelEmbedding`` (nanoGPT's tied head, split over the
    vocabulary): ``x @ weight.T`` with the embedding's very ``Parameter`` (this rank's rows of the
    vocabulary, so its logits are the embedding's columns: left split, as a vocab head's; the
    loss is ``VocabParallelCrossEntropy``). The weight's two uses add their gradients into one
    ``.grad``; it is registered here under the head's name too, so a pipeline's last stage (which
    holds no embedding) lists it, with the embedding's ``shard_index``."""

    def __init__(self, embedding: VocabParallelEmbedding) -> None:
        self.comm, self.n = embedding.comm, embedding.n
        self.start, self.stop = embedding.start, embedding.stop
        self.weight = embedding.weight
        self.shard_index = {"weight": embedding.shard_index["weight"]}
        self.cache = None

    def compute(self, x: Any) -> Any:
        return TiedLogits.apply(CopyToTP.apply(x, self.comm), self.weight, self)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]}, {self.n} (local rows {self.start}:{self.stop}), tied, tp={self.comm.size}"


class VocabParallelCrossEntropy:
    """Cross-entropy over logits split along the vocabulary (last) axis; never builds full logits.

    Same interface and result as ``CrossEntropyLoss``: three small all-reduces of (B, T)-shaped
    arrays (max, sum of exp, target logit) replace a gather of (B, T, vocab).
    """

    #: Target dtypes kinds it accepts (the step refuses others before any forward, on every rank).
    target_kinds = "iu"

    def __init__(self, comm: Comm, start: int, vocab: int) -> None:
        self.comm, self.start, self.vocab = comm, start, vocab
        self.cache = None
        self._low = None  # the logits' 16-bit dtype under mixed precision

    def forward(self, logits: Any, target: Any, weight: Any = None) -> float:
        xp = xp_of(logits)
        logits, self._low = widen(logits)  # 16-bit logits: the softmax and the loss in float32
        if logits.shape[:-1] != target.shape:
            raise ValueError(
                f"VocabParallelCrossEntropy: logits {logits.shape} need targets of shape {logits.shape[:-1]}, "
                f"got {target.shape}"
            )
        if target.dtype.kind not in "iu":
            raise TypeError(f"cross-entropy needs integer targets, got {target.dtype}")
        target = check_targets(target, self.vocab, "VocabParallelCrossEntropy")
        n_local = logits.shape[-1]
        gmax = logits.max(axis=-1)
        if self.comm.size > 1:
            gmax = self.comm.allreduce(gmax, op="max")
        shifted = logits - gmax[..., None]
        exp = xp.exp(shifted)
        sumexp = reduce_from_tp(exp.sum(axis=-1), self.comm)
        local_t = target - self.start
        mine = (local_t >= 0) & (local_t < n_local)
        safe = xp.where(mine, local_t, 0)
        picked = xp.take_along_axis(shifted, safe[..., None], axis=-1)[..., 0] * mine
        target_logit = reduce_from_tp(picked, self.comm)
        nll = xp.log(sumexp) - target_logit
        w, denom = per_sample_weight(weight, nll)
        if w is not None:
            nll = nll * w
        self.cache = (exp / sumexp[..., None], safe, mine, w, denom)
        return batch_mean(nll.sum(), denom)

    def backward(self, scale: float = 1.0) -> Any:
        xp = xp_of(self.cache[0])
        probs, safe, mine, w, denom = self.cache
        g = probs.copy()
        if all_weights_zero(denom):
            g *= 0
        else:
            at = xp.take_along_axis(g, safe[..., None], axis=-1) - mine[..., None]
            xp.put_along_axis(g, safe[..., None], at, axis=-1)
            g *= scale / nonzero(denom)
            if w is not None:
                g *= w[..., None]
        return g if self._low is None else g.astype(self._low)


def parallel_loss(model: Any, loss: Any, tp_comm: Comm) -> tuple[Any, Exception | None]:
    """The loss a split ``model`` trains with, and the problem if it cannot: a model whose head
    was split over the vocabulary (``vocab_parallel``) computes ``CrossEntropyLoss`` as
    ``VocabParallelCrossEntropy`` (its logits never exist whole on one rank)."""
    vocab = getattr(model, "vocab_parallel", None)
    if vocab is None or isinstance(loss, VocabParallelCrossEntropy):
        return loss, None
    if not isinstance(loss, CrossEntropyLoss):
        return loss, ValueError("a vocab-parallel GPT's logits are split over the vocabulary; "
                                f"train it with CrossEntropyLoss, got {type(loss).__name__}")
    return VocabParallelCrossEntropy(tp_comm, vocab[0], vocab[1]), None
