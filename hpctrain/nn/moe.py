"""A mixture of experts: ``MoE``, a learned router over E expert MLPs, each token sent to k of them.

The router is ``Linear(d_model, E)`` without bias, then a softmax over the E experts, then the
top k (Megatron's default: the softmax's values of the chosen experts weight their outputs, not
renormalised over the k). The experts are the MLP of ``nn.transformer`` (fc1 -> GELU -> fc2)
stored *stacked*: ``w1 (E, d_model, d_hidden)``, ``b1 (E, d_hidden)``, ``w2 (E, d_hidden,
d_model)``, ``b2 (E, d_model)``, so that expert parallelism holds a slice along axis 0
(``MoE.shard``; ``hpctrain.parallel.expert_parallel`` does it for a whole model), recorded in
``shard_index`` like a tensor-parallel layer's (``parallel.shards.shard_map`` reports the full
shape and the slice: checkpoints carry experts across layouts).

The forward and backward are written by hand (the hot path: the gather of each expert's tokens,
one matrix product per expert and layer, the weighted scatter back). Called on a tensor the layer
is one node of the graph (``nn.explicit``: everything a call keeps is in ``self.cache`` and the
router's ``cache``), so the two modes compute the same thing with the same code.

**Expert parallelism.** With a group (``MoE.shard(group)``: any object with ``rank``, ``size``
and the ``Communicator``'s ``alltoallv``, ``protocols.ExpertGroup``) this rank holds experts
``[rank*E/ep, (rank+1)*E/ep)``. Each forward exchanges the token counts per expert (one small
all-to-all-v), sends each kept token to its expert's rank (all-to-all-v), runs its experts on
what it received and sends the outputs back (all-to-all-v); the backward sends the output
gradients the same way and the input gradients back. The experts' gradients hold the
contributions of every rank's tokens: a trainer reduces them over the ranks that hold the same
experts (``grid.edp``) and scales them as dense ones (by the full dp size, as Megatron does).

**Capacity.** ``capacity=F > 0`` caps each expert at ``ceil(F * tokens * top_k / E)``
assignments per forward, tokens counted on this rank before dispatch (Switch's rule). Over the
cap an assignment is dropped (first choices before second ones, then by token order: GShard's
priority); a dropped assignment contributes nothing, so a token dropped by all its experts comes
out as zero (in a block, its output is its residual). ``capacity=0``: dropless.

**Load balancing.** ``aux_loss`` is the Switch/GShard term ``E * sum_e f_e * P_e`` of the last
forward: ``f_e`` the share of the router's assignments (before capacity) that chose expert e,
counted over the ep group, ``P_e`` the mean router probability of expert e over this rank's
tokens; with an ``aux_group`` (``set_aux_group``: the ranks holding a batch's distinct tokens,
``grid.dp_cp``) both over the whole batch (one all-reduce of 2E numbers per forward), the same
term on every rank and under any layout (Megatron's global aux loss). Its gradient path is one
design for both modes: set ``aux_weight`` (``set_aux_weight`` for a whole model) and the layer's
own backward adds ``aux_weight * d aux_loss / d router`` (in the explicit backward and in the
graph, whose node is that backward); ``aux_loss`` itself is a number for the caller to add, times
the same weight, to the loss it reports (it carries no graph: adding it to a tensor loss does not
count its gradient twice). With ep ranks of equal token counts the mean of their ``aux_loss`` is
the term over all their tokens, and the gradients averaged over them are that term's (with an
``aux_group``: each rank's backward is its tokens' part times the batch's tokens over its own, so
weights by token share make the sum exact). ``tokens_per_expert`` (int, (E,)) are the router's
assignments of the last forward over the ep group; ``dropped`` the assignments the cap dropped.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import matmul, stat_dtype, to_device, to_host, xp_of
from ..errors import Say, as_argument
from .buffers import Buffers
from .kernels import gelu_backward, gelu_forward
from .layers import Linear
from .module import Module, Parameter, as_rng


def moe_problem(experts: int, top_k: int, capacity: float, say: Say = as_argument) -> str | None:
    """Why ``experts``, ``top_k`` and ``capacity`` make no mixture of experts (``None``: they do),
    in ``say``'s names: the one place of this rule (``MoE``, the GPT's options, the command line)."""
    if experts < 1:
        return f"{say('experts', experts)} must be >= 1"
    if not 1 <= top_k <= experts:
        return f"{say('top_k', top_k)} must be between 1 and {say('experts', experts)}"
    if not math.isfinite(capacity) or capacity < 0:
        return f"{say('capacity', capacity)} must be a finite number >= 0 (0: dropless)"
    return None


def ep_problem(experts: int, ep: int, say: Say = as_argument) -> str | None:
    """Why ``experts`` do not spread over an expert-parallel group of ``ep`` ranks (``None``: they do)."""
    if ep < 1:
        return f"{say('ep', ep)} must be >= 1"
    if experts % ep:
        return f"{say('experts', experts)} must be divisible by {say('ep', ep)}"
    return None


def moe_layers(model: Any) -> list[MoE]:
    """The ``MoE`` layers of ``model`` (itself included), each once, in module order."""
    found: dict[int, MoE] = {}
    for _, m in model.named_modules() if hasattr(model, "named_modules") else ():
        if isinstance(m, MoE):
            found.setdefault(id(m), m)
    return list(found.values())


def aux_loss_of(model: Any) -> float:
    """The sum of the ``aux_loss`` of ``model``'s ``MoE`` layers (their last forward); 0 without any."""
    return float(sum(m.aux_loss for m in moe_layers(model)))


def set_aux_group(model: Any, group: Any) -> None:
    """Have every ``MoE`` of ``model`` count its load-balancing term over ``group`` (``rank``,
    ``size`` and the ``Communicator``'s ``allreduce``: the ranks holding distinct tokens of one
    batch, ``grid.dp_cp``); ``None`` or a group of one: over the ep group's tokens as before."""
    group = None if group is None or int(group.size) == 1 else group
    for m in moe_layers(model):
        m.aux_group = group


def set_aux_weight(model: Any, weight: float) -> None:
    """Have every ``MoE`` of ``model`` add ``weight * d aux_loss`` to its router's gradients."""
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"aux_weight={weight!r} must be a finite number >= 0")
    for m in moe_layers(model):
        m.aux_weight = weight


class _Route:
    """One forward's routing: the kept assignments in dispatch order (by expert), their gates,
    the rows each rank sends and receives, and how the received rows group by local expert."""

    def __init__(self, token: Any, slot: Any, expert: Any, gate: Any) -> None:
        self.token, self.slot, self.expert, self.gate = token, slot, expert, gate
        self.send: list[int] = []
        self.recv: list[int] = []
        self.order: Any = None  # received rows -> grouped by local expert (None: already)
        self.undo: Any = None  # the inverse permutation
        self.bounds: list[tuple[int, int]] = []  # each local expert's rows in the grouped order
        self.share: Any = None  # f_e over the group (the aux loss's gradient needs it)


class MoE(Module):
    """A mixture of ``experts`` MLPs (``d_model -> d_hidden -> d_model``, GELU) with a learned
    top-``top_k`` router; ``capacity`` (0: dropless) caps each expert's assignments per forward.
    See the module docstring for the router's normalisation, capacity, ``aux_loss`` with its
    ``aux_weight``, ``tokens_per_expert`` and expert parallelism (``shard``). Input ``(..., d_model)``."""

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        experts: int = 8,
        top_k: int = 2,
        capacity: float = 0.0,
        rng: int | np.random.Generator | None = 0,
        dtype: Any = np.float32,
    ) -> None:
        problem = moe_problem(experts, top_k, capacity)
        if problem is not None:
            raise ValueError(f"MoE: {problem}")
        if d_model < 1 or d_hidden < 1:
            raise ValueError(f"MoE needs positive sizes, got d_model={d_model}, d_hidden={d_hidden}")
        g = as_rng(rng)
        self.d_model, self.d_hidden = int(d_model), int(d_hidden)
        self.experts, self.top_k, self.capacity = int(experts), int(top_k), float(capacity)
        self.router = Linear(d_model, experts, bias=False, rng=g, dtype=dtype)
        # Each expert initialised as a Linear pair (uniform in +-1/sqrt(fan in)).
        b1, b2 = 1.0 / np.sqrt(d_model), 1.0 / np.sqrt(d_hidden)
        self.w1 = Parameter(g.uniform(-b1, b1, (experts, d_model, d_hidden)).astype(dtype))
        self.b1 = Parameter(g.uniform(-b1, b1, (experts, d_hidden)).astype(dtype))
        self.w2 = Parameter(g.uniform(-b2, b2, (experts, d_hidden, d_model)).astype(dtype))
        self.b2 = Parameter(g.uniform(-b2, b2, (experts, d_model)).astype(dtype))
        self.group: Any = None
        self.aux_group: Any = None  # set_aux_group: the replicas the load-balancing term spans
        self.aux_weight = 0.0
        self.aux_loss = 0.0
        self.tokens_per_expert = np.zeros(experts, dtype=np.int64)
        self.dropped = 0
        self.cache = None
        # The experts' rows change every step (under ep, with capacity): arrays kept by row buckets.
        self.__dict__["_buffers"] = Buffers(rows=True)

    # -- expert parallelism ----------------------------------------------------------------------

    def shard(self, group: Any) -> None:
        """Keep only this rank's experts of ``group`` (``rank``, ``size``, ``alltoallv``): the slice
        ``[rank*E/size, (rank+1)*E/size)`` of the stacked parameters, recorded in ``shard_index``.
        Refuses experts not divisible by the group's size, and a layer already sharded."""
        if self.group is not None:
            raise RuntimeError("MoE.shard: this layer is already expert-parallel")
        problem = ep_problem(self.experts, int(group.size))
        if problem is not None:
            raise ValueError(f"MoE: {problem}")
        per = self.experts // group.size
        start = group.rank * per
        idx = slice(start, start + per)
        self.shard_index = {}
        for name in ("w1", "b1", "w2", "b2"):
            p = getattr(self, name)
            full = p.shape
            local = Parameter(p.data[idx].copy(), p.name)
            setattr(self, name, local)
            self.shard_index[name] = (full, (idx,) + tuple(slice(0, n) for n in full[1:]))
        self.group = group

    def local_experts(self) -> range:
        """The global indices of the experts this rank holds."""
        per = self.w1.shape[0]
        first = 0 if self.group is None else self.group.rank * per
        return range(first, first + per)

    def _exchange(self, rows: Any, send: list[int], recv: list[int]) -> Any:
        """Rows to the ranks of the group (``send[i]`` to rank i); those from each rank back."""
        if self.group is None or self.group.size == 1:
            return rows
        return self.group.alltoallv(rows, send, recv)

    def _counts(self, chosen: np.ndarray, kept: np.ndarray) -> np.ndarray:
        """``(ranks, 2E)``: every rank's router choices and kept assignments per expert (an
        all-to-all-v of this rank's row to every rank: the group need offer nothing more)."""
        mine = np.concatenate([chosen, kept]).astype(np.int64)[None, :]
        if self.group is None or self.group.size == 1:
            return mine
        n = self.group.size
        return np.asarray(to_host(self.group.alltoallv(np.repeat(mine, n, axis=0), [1] * n, [1] * n)))

    # -- routing -----------------------------------------------------------------------------------

    def _choose(self, probs: Any) -> tuple[Any, Any, Any]:
        """Top-k of ``probs`` (N, E) and the capacity: ``(order, expert, keep)`` over the N*k
        assignments ``i = slot*N + token`` (first choices first: GShard's priority), ``order``
        sorting them by expert (stable), ``expert`` each one's expert, ``keep`` within the cap."""
        xp, n, k = xp_of(probs), probs.shape[0], self.top_k
        top = xp.argsort(-probs, axis=1, kind="stable")[:, :k]
        expert = top.T.reshape(-1)
        order = xp.argsort(expert, kind="stable")
        if self.capacity <= 0:
            return order, expert, None
        cap = math.ceil(self.capacity * n * k / self.experts)
        sorted_e = expert[order]
        counts = xp.bincount(sorted_e, minlength=self.experts)
        starts = xp.cumsum(counts) - counts
        place = xp.arange(order.size) - starts[sorted_e]  # position within its expert's queue
        return order, expert, place < cap

    def _route(self, probs: Any) -> _Route:
        xp, n, e_all = xp_of(probs), probs.shape[0], self.experts
        order, expert, keep = self._choose(probs)
        # Counted where the routing is (E numbers come back to the host, not N*k indices).
        chosen = to_host(xp.bincount(expert, minlength=e_all))
        if keep is not None:
            order = order[keep]
        token, slot = order % n, order // n
        ex = expert[order]
        r = _Route(token, slot, ex, probs[token, ex])
        kept = chosen if keep is None else to_host(xp.bincount(ex, minlength=e_all))
        table = self._counts(chosen, kept)
        total = table[:, :e_all].sum(axis=0)
        self.tokens_per_expert = total
        self.dropped = int(total.sum() - table[:, e_all:].sum())
        r.share = chosen  # this rank's choices (``_balance`` makes them f_e)
        mine = self.local_experts()
        per_rank = table[:, e_all:][:, mine.start:mine.stop]  # (ranks, local experts): rows I receive
        ranks = table.shape[0]
        per = e_all // ranks
        r.send = [int(kept[j * per:(j + 1) * per].sum()) for j in range(ranks)]
        r.recv = [int(c) for c in per_rank.sum(axis=1)]
        sizes = per_rank.sum(axis=0)
        ends = np.cumsum(sizes)
        r.bounds = [(int(end - size), int(end)) for size, end in zip(sizes, ends)]
        if ranks > 1:  # from each rank, its rows by local expert: regroup them by expert
            starts = np.cumsum(per_rank.reshape(-1)) - per_rank.reshape(-1)
            starts = starts.reshape(per_rank.shape)
            idx = [np.arange(starts[j, l], starts[j, l] + per_rank[j, l])
                   for l in range(per_rank.shape[1]) for j in range(ranks)]
            grouped = np.concatenate(idx) if idx else np.zeros(0, np.int64)
            r.order = to_device(grouped, xp)
            r.undo = to_device(np.argsort(grouped, kind="stable"), xp)
        return r

    def _balance(self, probs: Any, route: _Route) -> float:
        """The load-balancing term ``E * sum_e f_e * P_e``; sets ``route.share`` to f_e (the
        backward's). With an ``aux_group`` both come from the whole batch: one all-reduce of this
        rank's assignments and probability sums per expert (2E numbers) over the group, so the term
        is the same under any layout. Without one: f_e over the ep group, P_e over this rank."""
        xp, n, e_all = xp_of(probs), probs.shape[0], self.experts
        psum = to_host(probs.sum(axis=0)).astype(np.float64) if n else np.zeros(e_all)
        if self.aux_group is not None:
            both = np.concatenate([np.asarray(route.share, dtype=np.float64), psum])
            both = np.asarray(to_host(self.aux_group.allreduce(both)))
            counts, psum = both[:e_all], both[e_all:]
            tokens = counts.sum() / self.top_k  # every token makes k choices
        else:
            counts, tokens = self.tokens_per_expert.astype(np.float64), n
        share = counts / max(counts.sum(), 1.0)
        route.share = to_device(share.astype(probs.dtype), xp)
        return float(e_all * (share * psum).sum() / max(tokens, 1))

    # -- forward / backward --------------------------------------------------------------------

    def forward(self, x: Any) -> Any:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"MoE({self.d_model}, ...) got input of shape {x.shape}")
        xp = xp_of(x)
        x2 = x.reshape(-1, self.d_model)
        logits = self.router.forward(x2)
        rc, self.router.cache = self.router.cache, None
        sd = stat_dtype(logits.dtype)
        probs = logits.astype(sd, copy=True)
        probs -= probs.max(axis=1, keepdims=True)
        xp.exp(probs, out=probs)
        probs /= probs.sum(axis=1, keepdims=True)
        route = self._route(probs)
        n = x2.shape[0]
        self.aux_loss = self._balance(probs, route)
        rows = self._exchange(xp.ascontiguousarray(x2[route.token]), route.send, route.recv)
        if route.order is not None:
            rows = rows[route.order]
        h, t, a, y = self._experts(rows, route.bounds)
        if route.undo is not None:
            y = y[route.undo]
        y = self._exchange(xp.ascontiguousarray(y), route.recv, route.send)
        out = xp.zeros((n, self.d_model), dtype=np.result_type(x.dtype, y.dtype))
        gate = route.gate.astype(y.dtype)[:, None]
        for j in range(self.top_k):  # tokens are unique within one choice: a plain indexed add
            m = route.slot == j
            out[route.token[m]] += y[m] * gate[m]
        self.cache = (x.shape, probs, route, rows, h, t, a, y, rc)
        return out.reshape(x.shape)

    def _experts(self, rows: Any, bounds: list[tuple[int, int]]) -> tuple[Any, Any, Any, Any]:
        """Each local expert's MLP on its rows of ``rows`` (grouped by expert): ``(h, t, a, y)``,
        the pre-activation, GELU's saved term, the activation and the output."""
        xp = xp_of(rows)
        dt = np.result_type(rows.dtype, self.w1.dtype)
        h = xp.empty((rows.shape[0], self.d_hidden), dtype=dt)
        w1, b1, w2, b2 = self.w1.data, self.b1.data, self.w2.data, self.b2.data
        for l, (s, e) in enumerate(bounds):
            if e > s:
                matmul(xp, rows[s:e], w1[l], out=h[s:e])
                h[s:e] += b1[l]
        a, h, t = gelu_forward(h, self.scratch_buffers())
        y = xp.empty((rows.shape[0], self.d_model), dtype=dt)
        for l, (s, e) in enumerate(bounds):
            if e > s:
                matmul(xp, a[s:e], w2[l], out=y[s:e])
                y[s:e] += b2[l]
        return h, t, a, y

    def backward(self, grad_out: Any) -> Any:
        shape, probs, route, rows, h, t, a, y, rc = self.cache
        xp = xp_of(grad_out)
        g2 = grad_out.reshape(-1, self.d_model)
        n = g2.shape[0]
        gt = g2[route.token]
        dgate = (gt * y).sum(axis=1, dtype=probs.dtype)  # 16-bit rows: the sum in float32
        dy = gt * route.gate.astype(gt.dtype)[:, None]
        dy = self._exchange(xp.ascontiguousarray(dy), route.send, route.recv)
        if route.order is not None:
            dy = dy[route.order]
        drows = self._experts_backward(dy, rows, (h, t, a), route.bounds)
        if route.undo is not None:
            drows = drows[route.undo]
        drows = self._exchange(xp.ascontiguousarray(drows), route.recv, route.send)
        dprobs = xp.zeros(probs.shape, dtype=probs.dtype)
        dprobs[route.token, route.expert] = dgate
        if self.aux_weight and n:
            dprobs += (self.aux_weight * self.experts / n) * route.share
        dlogits = probs * (dprobs - (dprobs * probs).sum(axis=1, keepdims=True))
        self.router.cache = rc
        try:
            gx = self.router.backward(dlogits.astype(rc.dtype, copy=False))
        finally:
            self.router.cache = None
        dx = gx.astype(np.result_type(gx.dtype, drows.dtype), copy=True)
        for j in range(self.top_k):
            m = route.slot == j
            dx[route.token[m]] += drows[m]
        self.cache = None
        return dx.reshape(shape)

    def _experts_backward(self, dy: Any, rows: Any, kept: tuple, bounds: list[tuple[int, int]]) -> Any:
        """The local experts' parameter gradients (added) and their input rows' gradient."""
        h, t, a = kept
        xp = xp_of(dy)
        w1, w2 = self.w1.data, self.w2.data
        da = xp.empty(a.shape, dtype=np.result_type(dy.dtype, w2.dtype))
        for l, (s, e) in enumerate(bounds):
            if e > s:
                self.w2.grad[l] += matmul(xp, a[s:e].T, dy[s:e])
                self.b2.grad[l] += dy[s:e].sum(axis=0)
                matmul(xp, dy[s:e], w2[l].T, out=da[s:e])
            else:
                da[s:e] = 0
        dh = gelu_backward(da, h, t, self.scratch_buffers())
        drows = xp.empty(rows.shape, dtype=np.result_type(dh.dtype, w1.dtype))
        for l, (s, e) in enumerate(bounds):
            if e > s:
                self.w1.grad[l] += matmul(xp, rows[s:e].T, dh[s:e])
                self.b1.grad[l] += dh[s:e].sum(axis=0)
                matmul(xp, dh[s:e], w1[l].T, out=drows[s:e])
        return drows

    def extra_repr(self) -> str:
        ep = "" if self.group is None else f", ep={self.group.size}"
        return (f"{self.d_model}, {self.d_hidden}, experts={self.experts}, top_k={self.top_k}, "
                f"capacity={self.capacity}{ep}")


def moe_blocks(n_layers: int, experts: int, top_k: int, every: int, capacity: float) -> list[dict[str, Any] | None]:
    """Per block of a GPT of ``n_layers``: the ``MoE`` keyword arguments of the blocks whose MLP is
    a mixture (every ``every``-th: blocks ``every-1, 2*every-1, ...``), ``None`` for the others;
    all ``None`` when ``experts`` is 0. Refuses what ``moe_problem`` refuses, in the GPT's names."""
    if experts == 0:
        return [None] * n_layers
    problem = moe_problem(experts, top_k, capacity, say=lambda n, v=...: as_argument(f"moe_{n}", v))
    if problem is None and every < 1:
        problem = f"moe_every={every!r} must be >= 1"
    if problem is not None:
        raise ValueError(f"GPT: {problem}")
    moe = {"experts": int(experts), "top_k": int(top_k), "capacity": float(capacity)}
    return [dict(moe) if (i + 1) % every == 0 else None for i in range(n_layers)]
