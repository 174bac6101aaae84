"""The interfaces the layers of hpctrain talk through, declared as ``typing.Protocol``s.

Annotations, not base classes: an object satisfies a protocol by having its methods. This module
imports nothing of hpctrain, so every layer may import it (see ARCHITECTURE.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

# -- communication (hpctrain.comm) --------------------------------------------------------------


@runtime_checkable
class Pending(Protocol):
    """A non-blocking operation in flight (``hpctrain.comm.Request``)."""

    def wait(self) -> Any:
        """Complete the operation (inside the stall watchdog's bracket); returns its result."""

    def test(self) -> bool:
        """Drive progress; True once the operation has completed."""


@runtime_checkable
class Comm(Protocol):
    """A group of ranks and the operations between them: what callers use of
    ``hpctrain.comm.Communicator`` (the one implementation; tests may pass stand-ins with the
    members they need). Arrays in, arrays out; ``*_obj`` methods move picklable objects."""

    rank: int
    size: int
    #: The underlying mpi4py intracommunicator (for the comm layer and one-sided windows).
    mpi: Any
    #: What this communicator's waits are for, named in stall reports (private communicators).
    purpose: str | None

    @property
    def cuda_aware(self) -> bool: ...
    @property
    def local_rank(self) -> int: ...
    def set_timeout(self, seconds: float | None) -> None: ...
    def allreduce(self, x: Any, op: str = "sum", out: Any = None) -> Any: ...
    def iallreduce(self, x: Any, op: str = "sum", out: Any = None) -> Pending: ...
    def reduce_scatter(self, x: Any, op: str = "sum", out: Any = None) -> Any: ...
    def bcast(self, x: Any, root: int = 0) -> Any: ...
    def allgather(self, x: Any, out: Any = None) -> Any: ...
    def send(self, x: Any, dest: int, tag: int = 0) -> None: ...
    def recv(self, out: Any, source: int, tag: int = 0) -> Any: ...
    def isend(self, x: Any, dest: int, tag: int = 0) -> Pending: ...
    def irecv(self, out: Any, source: int, tag: int = 0) -> Pending: ...
    def bcast_obj(self, obj: Any, root: int = 0) -> Any: ...
    def allgather_obj(self, obj: Any) -> list[Any]: ...
    def gather_obj(self, obj: Any, root: int = 0) -> list[Any] | None: ...
    def split(self, color: int, key: int | None = None) -> Comm: ...
    def dup(self) -> Comm: ...
    def adopt(self, other: Comm) -> None: ...
    def barrier(self) -> None: ...
    def abort(self, code: int = 1) -> None: ...
    def free(self) -> None: ...
    def hostname(self) -> str: ...

@runtime_checkable
class Agreement(Protocol):
    """A group of ranks that reaches one verdict: what the layers that know no ``comm`` (``data``)
    use of a communicator (``hpctrain.comm.Communicator`` is one; its methods are those of
    ``hpctrain.comm.validate``). Collective: every rank of the group calls the same methods."""

    rank: int
    size: int

    def allgather_obj(self, obj: Any) -> list[Any]: ...
    def raise_if_any(self, problem: BaseException | str | None, *, what: str = "",
                     payload: Any = None) -> list[Any]:
        """Raise the same error on every rank if any rank has a ``problem``; else every payload."""

    def agree(self, what: str, value: Any) -> None:
        """Raise ``MismatchError`` on every rank unless every rank holds the same ``value``."""


# -- state a checkpoint saves and restores (hpctrain.checkpoint) ---------------------------------


@runtime_checkable
class Stateful(Protocol):
    """An object whose state a checkpoint saves and restores: trainers, optimizers (ZeRO's
    sharded one too), samplers, the loss scaler, the parameter server, module RNGs.

    - ``state_dict()``: the state to save (JSON-able values and arrays; it may be collective
      when the object spans ranks: a trainer gathers RNG states);
    - ``load_state_dict(state)``: take it back; it validates before it changes anything where
      it can, and raises ``ValueError`` (or a library error) on state it cannot take;
    - ``snapshot()`` / ``restore(snap)``: the all-or-nothing load. ``snapshot()`` captures, in
      memory, everything ``load_state_dict`` (and a checkpoint's write of the object's arrays)
      may change; ``restore(snap)`` puts it back exactly. A snapshot is valid until the object
      next changes by other means (a training step): it may hold references to what a load
      replaces rather than copies of it. Never collective.

    ``hpctrain.checkpoint`` saves and restores a trainer only through these methods, and a
    trainer composes the snapshots of the objects it owns: a new stateful object implements this
    protocol in its own file and is covered by its owner's ``snapshot``/``restore``.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def snapshot(self) -> Any: ...

    def restore(self, snap: Any) -> None: ...


def snapshot_of(obj: Any) -> Any:
    """``obj.snapshot()``; for an object that only saves and loads (a user's sampler with
    ``state_dict``/``load_state_dict``), a deep copy of its ``state_dict()``. ``None`` for
    ``None`` and for an object with no state (a sampler without ``state_dict``)."""
    if isinstance(obj, Stateful):
        return ("snapshot", obj.snapshot())
    if obj is None or not hasattr(obj, "state_dict"):  # optional: see above
        return None
    return ("state", copy.deepcopy(obj.state_dict()))


def restore_of(obj: Any, snap: Any) -> None:
    """Put back what :func:`snapshot_of` took of ``obj`` (nothing for ``None``)."""
    if obj is None or snap is None:
        return
    kind, value = snap
    if kind == "snapshot":
        obj.restore(value)
    else:
        obj.load_state_dict(copy.deepcopy(value))


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
        """The arrays the reducer keeps, by ``hpctrain.training.memory`` category, or ``None`` when the
        trainer's parameters, gradients and optimizer state are the whole story."""


# -- what the layers above use of a trainer (hpctrain.training.Trainer and its subclasses) --------
#
# Each is the side one user of a trainer sees, no more: a callback, the checkpoint, the loop, the
# rank-loss recovery. ``hpctrain.Trainer`` (and ``ParallelTrainer`` for ``Recoverable``) has them all.


@runtime_checkable
class StateOwner(Protocol):
    """What a trainer's ``training.state.TrainerState`` reads and sets of the trainer that holds
    it: the groups its state spans, the objects it saves with it, and the step counter."""

    comm: Comm
    dp: Comm
    model: Any
    optimizer: Any
    #: ``training.precision.Precision``: its ``scaler`` (fp16's loss scale) is saved.
    precision: Any
    global_step: int


@runtime_checkable
class TrainerView(Protocol):
    """What a ``fit`` callback reads of the trainer it is handed (``on_fit_start(trainer)``,
    ``on_step_end(trainer, stats)``, ``on_epoch_end(trainer)``, ``on_fit_end(trainer)``)."""

    comm: Comm
    global_step: int
    epoch: int
    #: ``None`` for a trainer that updates itself (the parameter server).
    optimizer: Any


@runtime_checkable
class Checkpointable(TrainerView, Stateful, Protocol):
    """What ``hpctrain.checkpoint`` reads of a trainer (besides its optional ``checkpointer``):
    the layout and settings it records, this rank's tensors, and the ``Stateful`` methods."""

    @property
    def layout(self) -> dict[str, int]: ...

    def config(self) -> dict[str, Any]:
        """The settings compared across ranks and stored in checkpoints."""

    def shards(self) -> dict[str, tuple[Any, tuple, tuple]]:
        """``{serial name: (Parameter, full shape, index in the full tensor)}`` of this rank."""


@runtime_checkable
class RankLossHook(Protocol):
    """What ``fit`` calls on ``trainer.rank_loss`` (``hpctrain.resilience.RankLoss``)."""

    def before_step(self, trainer: Fittable, batch: Any) -> None: ...

    def recover(self, trainer: Fittable, exc: BaseException) -> bool:
        """``True``: the survivors go on (with the next batch); ``False``: ``exc`` is raised."""

    def save(self, trainer: Fittable, write: Callable[[], str]) -> str: ...

    def memory_arrays(self) -> list[Any]: ...


@runtime_checkable
class Fittable(Checkpointable, Protocol):
    """What ``training.loop.fit`` and the job use of a trainer."""

    last_checkpoint: str | None
    rank_loss: RankLossHook | None

    def enter_fit(self) -> None: ...

    def step(self, x: Any, y: Any, weight: Any = None) -> Any: ...

    def memory_report(self, stats: Any = None) -> dict[str, int]: ...

    def attach_sampler(self, sampler: Any) -> None: ...

    def take_pending_sampler(self) -> dict[str, Any] | None: ...

    def close(self) -> None: ...


@runtime_checkable
class Recoverable(Fittable, Protocol):
    """What ``hpctrain.resilience`` uses of a trainer to go on without a lost rank
    (``parallel.ParallelTrainer``): its groups, its parts, the step's undo and ``rebind``."""

    dp: Comm
    #: ``comm.grid.ProcessGrid``.
    grid: Any
    params: list[Any]
    model: Any
    reducer: Reducer
    #: The ZeRO stage (0: none).
    zero: int

    def abandon_step(self) -> None:
        """Undo what a step that raised did before its update (the reduction, the gradients)."""

    def rebind(self, grid: Any, full: dict[str, Any] | None = None) -> None:
        """Go on over ``grid`` (the survivors'): communicators, reducer, hooks and ZeRO pieces."""


class ExpertGroup(Protocol):
    """What an ``nn.MoE`` uses of its expert-parallel group (a ``Communicator``: ``grid.ep``):
    its place and the all-to-all-v of rows (``send_counts[i]`` rows to rank i, ``recv_counts[j]``
    from rank j, the rows from rank 0 first)."""

    rank: int
    size: int

    def alltoallv(self, x: Any, send_counts: Any, recv_counts: Any = None, out: Any = None) -> Any: ...
