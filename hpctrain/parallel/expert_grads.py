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

from ..errors import Say, as_argument
from ..protocols import Reducer
from .reducer import GradReducer

__all__ = ["ExpertReducer", "ShardedExpertReducer", "ep_dp_problem", "ep_experts_problem", "expert_ids",
           "expert_reducer", "moe_problem"]


def moe_problem(experts: int, top_k: int, say: Say = as_argument) -> str | None:
    """Why a mixture of ``experts`` experts cannot route each token to ``top_k`` of them
    (``None``: it can), in ``say``'s names (``hpctrain train`` asks with its flags)."""
    if experts and top_k > experts:
        return f"{say('top_k', top_k)} routes each token to more experts than there are ({say('experts', experts)})"
    return None


def ep_dp_problem(ep: int, dp: int, say: Say = as_argument) -> str | None:
    """Why expert-parallel groups of ``ep`` ranks cannot be carved out of ``dp`` data-parallel
    replicas (``None``: they can), in ``say``'s names."""
    if ep != 1 and (ep > dp or dp % ep):
        return (f"{say('ep', ep)} must divide the data-parallel replicas (dp={dp}): "
                "the expert-parallel groups are carved out of dp")
    return None


def ep_experts_problem(experts: int, ep: int, say: Say = as_argument) -> str | None:
    """Why ``experts`` experts per MoE layer cannot spread over ``ep`` ranks (``None``: they can),
    in ``say``'s names: the one place of this rule (``ParallelTrainer`` asks it of its grid and
    model, ``hpctrain train`` of its flags)."""
    if ep == 1:
        return None
    if not experts:
        return (f"{say('ep', ep)} spreads the experts of a mixture-of-experts model, and this model has none "
                f"({say('experts', 0)})")
    if experts % ep:
        return (f"{say('experts', experts)}: the experts do not divide over {say('ep', ep)} ranks "
                f"(give a multiple of {ep})")
    return None


def expert_ids(model: Any, grid: Any) -> set[int]:
    """``id``s of this rank's expert parameters when they are spread over ``grid.ep`` (``ep > 1``;
    otherwise every rank holds every expert and they reduce with the dense ones: empty)."""
    if getattr(grid, "ep_size", 1) == 1:
        return set()
    names = expert_param_names(model)
    return {id(p) for n, p in model.named_parameters() if n in names}


def expert_reducer(params: list[Any], experts: set[int], grid: Any, over: Any, facade: Any, zero: int
                   ) -> ExpertReducer:
    """The dense parameters' reducer over ``grid.dp`` and the experts' over ``grid.edp``, each made
    by ``over(params, group)`` (the engine's one rule for a reducer), as one ``ExpertReducer``."""
    dense = over([p for p in params if id(p) not in experts], grid.dp)
    spread = over([p for p in params if id(p) in experts], grid.edp)
    cls = ShardedExpertReducer if zero else ExpertReducer
    return cls(dense, spread, experts, facade=facade)


def expert_param_names(model: Any) -> set[str]:
    """The parameters of ``model`` (by serial name) that are experts' (their gradients reduce over
    the expert replicas): those an MoE layer lists in ``expert_parameter_names()``, named in the
    model as a whole."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        own = getattr(module, "expert_parameter_names", None)
        if callable(own):
            names.update(f"{prefix}.{n}" if prefix else n for n in own())
    return names


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
        self.dense.apply(optimizer)
        if self.sharded:  # ZeRO: each reducer's sharded optimizer updates only its own piece
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
