"""Expert parallelism in the runtime: the layout rules of an MoE model over ``grid.ep`` and the
gradient reduction that treats expert parameters apart from the dense ones.

A mixture-of-experts layer (``nn.MoE``) holds its experts stacked (``w1 (E, d, h)``, ...); under
``ep > 1`` each rank of an ep group holds ``E / ep`` of them (``expert_parallel``), and the tokens
travel to their experts' ranks and back by all-to-all. So an expert's gradient on the rank that
holds it already sums the contributions of the tokens of every rank of its ep group: it is summed
again over the ranks that hold the *same* experts (``grid.edp``, the expert replicas), while the
dense parameters sum over every replica (``grid.dp``) as before. ``ExpertReducer`` is that pair of
reducers behind the one ``protocols.Reducer`` the step talks to.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import to_host
from ..errors import GridError, Say, as_argument
from ..nn.moe import moe_layers
from ..protocols import Reducer
from .reducer import GradReducer

__all__ = ["ExpertReducer", "ExpertStats", "ShardedExpertReducer", "ep_dp_problem", "expert_ids",
           "expert_reducer", "start_alike"]


def ep_dp_problem(ep: int, dp: int, say: Say = as_argument) -> str | None:
    """Why expert-parallel groups of ``ep`` ranks cannot be carved out of ``dp`` data-parallel
    replicas (``None``: they can), in ``say``'s names (``ProcessGrid`` refuses the same grid)."""
    if ep != 1 and (ep > dp or dp % ep):
        return (f"{say('ep', ep)} must divide the data-parallel replicas (dp={dp}): "
                "the expert-parallel groups are carved out of dp")
    return None


def expert_ids(model: Any, grid: Any) -> set[int]:
    """``id``s of this rank's expert parameters when they are spread over ``grid.ep`` (``ep > 1``:
    the stacked experts of each sharded ``nn.MoE``, its ``shard_index``); otherwise every rank holds
    every expert and they reduce with the dense ones: empty). A model whose experts were spread
    over a group of another size than ``grid.ep`` is refused (``GridError``: its expert gradients
    would reduce with other experts')."""
    layers = moe_layers(model)
    sizes = {m.group.size for m in layers if m.group is not None}
    if sizes - {grid.ep_size}:
        raise GridError(f"the model's experts are spread over ep={sorted(sizes)[0]} ranks but the grid has "
                        f"ep={grid.ep_size}: build the part with parallelize(model, grid)")
    if grid.ep_size == 1:
        return set()
    return {id(getattr(m, name)) for m in layers if m.group is not None for name in m.shard_index}


def start_alike(params: list[Any], experts: set[int], dense: Any, spread: Any) -> None:
    """Every replica starts from its group's rank 0 (collective): the dense parameters over
    ``dense`` (the replicas of everything), the expert slices over ``spread`` (``grid.edp_cp``)."""
    for p in params:
        group = spread if id(p) in experts else dense
        if group.size > 1:
            group.bcast(p.data, root=0)


def expert_reducer(params: list[Any], experts: set[int], groups: tuple[Any, Any], over: Any, facade: Any, zero: int
                   ) -> ExpertReducer:
    """The dense parameters' reducer over ``groups[0]`` (the replicas of everything: ``grid.dp``)
    and the experts' over ``groups[1]`` (the ranks that hold the same experts: ``grid.edp_cp``),
    each made by ``over(params, group)`` (the engine's one rule for a reducer), as one
    ``ExpertReducer``."""
    dense = over([p for p in params if id(p) not in experts], groups[0])
    spread = over([p for p in params if id(p) in experts], groups[1])
    cls = ShardedExpertReducer if zero else ExpertReducer
    return cls(dense, spread, experts, facade=facade)


class ExpertReducer(GradReducer):
    """Two reductions behind one ``protocols.Reducer``: ``dense`` over every replica (``grid.dp``)
    for the dense parameters, ``experts`` over the expert replicas (``grid.edp``) for the experts'
    (``expert_ids``: their ``id``). Each step call goes to both, each parameter's to the one that
    reduces it. The dense reducer's ``apply`` steps the one optimizer over every parameter, experts
    included, once (``ShardedExpertReducer``: two ZeRO reducers, each updating its own piece)."""

    sharded = False

    def __init__(self, dense: Reducer, experts: Reducer, expert_ids: set[int], facade: Any = None) -> None:
        super().__init__(list(dense.params) + list(experts.params), dense.dp)  # type: ignore[attr-defined]
        self.dense, self.experts, self.expert_ids = dense, experts, set(expert_ids)
        self.facade = facade  # the user's optimizer, on which ZeRO writes the full state
        self.buckets = dense.buckets  # the order backward fills them is learned for the dense ones

    def _split(self, params: Any) -> tuple[list[Any], list[Any]]:
        dense, experts = [], []
        for p in params:
            (experts if id(p) in self.expert_ids else dense).append(p)
        return dense, experts

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def begin(self) -> None:
        self.dense.begin()
        self.experts.begin()

    def mark_ready(self, params: Any) -> None:
        dense, experts = self._split(params)
        if dense:
            self.dense.mark_ready(dense)
        if experts:
            self.experts.mark_ready(experts)

    def finish(self) -> float:
        return self.dense.finish() + self.experts.finish()

    def abort(self) -> None:
        try:
            self.dense.abort()
        finally:
            self.experts.abort()

    def counted_grads(self) -> list[tuple[Any, Any]]:
        # Dense pieces counted by one dp rank, each expert slice by one rank of its replicas.
        return self.dense.counted_grads() + self.experts.counted_grads()

    def scale_grads(self, factor: float) -> None:
        self.dense.scale_grads(factor)
        self.experts.scale_grads(factor)

    def apply(self, optimizer: Any) -> None:
        step = optimizer.step_count
        self.dense.apply(optimizer)
        if self.sharded:  # ZeRO: each sharded optimizer updates its own piece, and advances the
            optimizer.step_count = step  # user's optimizer's step count: one step, counted once
            self.experts.apply(optimizer)

    def describe(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "dense": self.dense.describe(), "experts": self.experts.describe()}

    def full_shards(self, shards: dict[str, tuple[Any, tuple, tuple]]) -> dict[str, tuple[Any, tuple, tuple]]:
        """Each reducer's full tensors of its own parameters; under ZeRO each writes its full
        optimizer state on the user's optimizer, so the two are merged there (collective over dp
        and over the expert replicas)."""
        dense = {n: s for n, s in shards.items() if id(s[0]) not in self.expert_ids}
        experts = {n: s for n, s in shards.items() if id(s[0]) in self.expert_ids}
        out = self.dense.full_shards(dense)
        state = dict(self.facade.state) if self.sharded else None
        out.update(self.experts.full_shards(experts))
        if state is not None:
            self.facade.state = {**state, **{k: v for k, v in self.facade.state.items() if v}}
        return out

    def after_load(self) -> None:
        self.dense.after_load()
        self.experts.after_load()

    def remove(self) -> None:
        self.dense.remove()
        self.experts.remove()

    def memory_arrays(self) -> dict[str, list[Any]] | None:
        parts = [r.memory_arrays() for r in (self.dense, self.experts)]
        if all(p is None for p in parts):
            return None
        merged: dict[str, Any] = {}
        for part in parts:
            for key, arrays in (part or {}).items():
                if key == "buffers_peak":  # bytes: the two peaks may coincide, so their sum bounds it
                    merged[key] = merged.get(key, 0) + int(arrays)
                else:
                    merged.setdefault(key, []).extend(arrays)
        return merged



class ShardedExpertReducer(ExpertReducer):
    """``ExpertReducer`` over two ZeRO reducers: ``Stateful`` as they are (their sharded optimizers'
    pieces), so a trainer's snapshot and restore take both."""

    sharded = True

    def state_dict(self) -> dict[str, Any]:
        return {"dense": self.dense.state_dict(), "experts": self.experts.state_dict()}  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dense.load_state_dict(state["dense"])  # type: ignore[attr-defined]
        self.experts.load_state_dict(state["experts"])  # type: ignore[attr-defined]

    def snapshot(self) -> dict[str, Any]:
        return {"dense": self.dense.snapshot(), "experts": self.experts.snapshot()}  # type: ignore[attr-defined]

    def restore(self, snap: dict[str, Any]) -> None:
        self.dense.restore(snap["dense"])  # type: ignore[attr-defined]
        self.experts.restore(snap["experts"])  # type: ignore[attr-defined]


class ExpertStats:
    """What a step reports of its MoE layers (``StepStats.extra``, metrics.jsonl, the progress line):
    ``moe_aux_loss``, the load-balancing term over the global batch (each micro-batch's weighted by
    its share, as its gradient is), and ``moe_max_share``, the most tokens any expert got over the
    mean (1: perfectly balanced; a router that collapses onto one expert of E drives it to E), from
    the router's choices summed over every MoE layer and the whole batch.

    It also scales each layer's ``aux_weight`` (the user's, ``nn.moe.set_aux_weight``) by the
    micro-batch's share of the global batch (and fp16's loss scale), as the loss's own gradient is
    scaled, so the term's gradient summed over replicas and micro-batches is the global one.
    ``slots``: the most experts of any layer on any rank (the engine agrees on it).
    """

    def __init__(self, model: Any, grid: Any, slots: int) -> None:
        self.layers = moe_layers(model)
        self.bind(grid)
        self.weights = [m.aux_weight for m in self.layers]
        self.slots = slots  # the most experts of any layer on any rank (0: no MoE anywhere, nothing reported)
        # Each rank's own tokens' term (tp ranks repeat it); tokens per expert are the ep group's.
        self.aux_counted = grid.tp.rank == 0
        self.tokens_counted = self.aux_counted and grid.ep.rank == 0
        self.sums = np.zeros(1 + self.slots)

    def weigh(self, scale: float) -> None:
        """The next micro-batch's share (times the loss scale): each layer's aux weight follows it."""
        for m, w in zip(self.layers, self.weights):
            m.aux_weight = w * scale

    def bind(self, grid: Any) -> None:
        """Each layer's term over the whole batch: the ranks holding distinct tokens, ``grid.dp_cp``
        (``nn.moe.set_aux_group``; one tiny all-reduce per layer and forward)."""
        for m in self.layers:
            m.aux_group = None if grid.dp_cp.size == 1 else grid.dp_cp

    def add(self, share: float, layers: list[Any] | None = None) -> None:
        """After a micro-batch's forward: its term (weighted by ``share``) and its tokens, of
        ``layers`` (default: all; a pipeline's chunk those it holds)."""
        layers = self.layers if layers is None else layers
        if self.aux_counted:
            self.sums[0] += share * sum(float(m.aux_loss) for m in layers)
        if self.tokens_counted:
            for m in layers:
                self.sums[1 : 1 + m.experts] += np.asarray(to_host(m.tokens_per_expert), dtype=np.float64)

    def counter(self, chunks: list[Any], scales: list[float], loss_scale: float) -> Any:
        """A pipeline's ``on_forward(i, c)``: ``add`` micro-batch ``i``'s share (``scales[i]``
        without the loss scale) of chunk ``c``'s layers, so the step logs the mean over its
        micro-batches (the loss's rule), not the last one's."""
        held = [moe_layers(c) for c in chunks]
        return lambda i, c: self.add(scales[i] / loss_scale, held[c])

    def take(self, extra: dict[str, Any]) -> dict[str, Any]:
        """``extra`` with this rank's sums of the step after its ``_reduce`` entries (summed over the
        world by the step); the sums start again for the next step."""
        if not self.slots:
            return extra
        out, self.sums = list(self.sums), np.zeros(1 + self.slots)
        return {**extra, "_reduce": [*extra.get("_reduce", []), *out]}

    def stats(self, extra: dict[str, Any], sums: Any) -> tuple[dict[str, Any], Any]:
        """``extra`` with the step's figures from the sums over the world, and the sums before them."""
        if not self.slots:
            return extra, sums
        n = 1 + self.slots
        mine, tokens = sums[-n:], np.asarray(sums[-n + 1 :], dtype=np.float64)
        mean = tokens.mean()
        share = float(tokens.max() / mean) if mean > 0 else 0.0
        return {**extra, "moe_aux_loss": float(mine[0]), "moe_max_share": share}, sums[:-n]
