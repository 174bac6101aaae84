"""Declared interfaces (``typing.Protocol``): what each layer may call on the objects of another.

A class implements a protocol by having its methods; nothing needs to inherit from these.
``getattr`` probing is used only for methods a protocol marks optional.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

# -- models (hpctrain.nn; parallel/ asks a model for its plans) ----------------------------------


@runtime_checkable
class Module(Protocol):
    """A model or layer every trainer can train (``hpctrain.nn.Module`` implements it).

    ``backward(grad_out)`` adds parameter gradients into ``Parameter.grad`` and returns the
    gradient with respect to the input. Optional methods, asked for with ``getattr`` by
    ``hpctrain.parallel`` (a model without them gets the generic behaviour):

    - ``tp_plan() -> {module name: kind}``: how the parts that are not generic layers split over
      tensor-parallel ranks (kinds: ``parallel.tensor.PLAN_KINDS``; the GPT's
      ``{"tok_emb": "vocab_embedding", "head": "vocab_head"}``). Without it, ``MLP`` and
      ``CausalSelfAttention`` layers split and everything else is replicated.
    - ``pipeline_cuts() -> [(name, {serial module name: module}, forward, backward)]``: the pieces
      a pipeline may cut between, in forward order. Without it, a ``Sequential`` is cut between
      its layers and any other model cannot be pipelined.
    """

    def forward(self, x: Any) -> Any: ...

    def backward(self, grad_out: Any) -> Any: ...

    def parameters(self) -> list[Any]: ...

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Any]]: ...

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Any]]: ...

    def zero_grad(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def get_cache(self) -> dict[str, Any]: ...

    def set_cache(self, caches: dict[str, Any]) -> None: ...

    def to(self, device: str) -> Any: ...


# -- the data-parallel gradient reduction (hpctrain.parallel.reducer) ----------------------------


@runtime_checkable
class Reducer(Protocol):
    """What ``Trainer.step`` and ``ParallelTrainer`` call on the dp gradient reduction.

    Per step, in order: ``zero_grad``, ``begin``, ``mark_ready`` (from backward hooks, zero or more
    times), ``finish``, ``counted_grads``, ``scale_grads`` (clipping, loss scale), ``apply``;
    ``abort`` when anything in between raised. Around checkpoints: ``full_shards`` before a save
    or a load, ``after_load`` after a load. ``parallel.reducer.GradReducer`` is the base with the
    one-rank defaults; ``AllReduceReducer`` (flat, hierarchical or NCCL buckets) and
    ``zero.ZeroReducer`` (ZeRO 1/2/3) implement every method.
    """

    #: The ``comm.buckets.GradBuckets`` this reducer all-reduces through, or ``None``.
    buckets: Any

    def zero_grad(self) -> None:
        """Zero every gradient this rank accumulates into."""

    def begin(self) -> None:
        """Arm the reduction for one step (before the final backward)."""

    def mark_ready(self, params: Any) -> None:
        """These parameters' gradients are final (may start communication)."""

    def finish(self) -> float:
        """Complete the reduction; returns the seconds spent in communication."""

    def abort(self) -> None:
        """The step raised: forget any reduction in progress (the next ``begin`` must work)."""

    def counted_grads(self) -> list[tuple[Any, Any]]:
        """``[(parameter, reduced gradient)]`` this dp rank counts in the global norm."""

    def scale_grads(self, factor: float) -> None:
        """Multiply the reduced gradients by ``factor``."""

    def apply(self, optimizer: Any) -> None:
        """The optimizer update with the reduced gradients."""

    def describe(self) -> dict[str, Any]:
        """Settings every rank must share (compared across ranks)."""

    def full_shards(self, shards: dict[str, tuple[Any, tuple, tuple]]) -> dict[str, tuple[Any, tuple, tuple]]:
        """``shards`` as a checkpoint reads and writes them (ZeRO: full tensors gathered over dp,
        collective); unchanged when the reducer keeps no pieces."""

    def after_load(self) -> None:
        """Take what a checkpoint load wrote into ``full_shards``' tensors back into this rank's
        pieces (nothing when the reducer keeps no pieces)."""

    def remove(self) -> None:
        """Take what the reducer installed on the model off it and free its communicators."""

    def memory_arrays(self) -> dict[str, list[Any]] | None:
        """The arrays the reducer keeps, by ``hpctrain.memory`` category, or ``None`` when the
        trainer's parameters, gradients and optimizer state are the whole story."""
