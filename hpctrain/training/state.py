"""The trainer's own saved state: ``TrainerState``, a part of ``hpctrain.Trainer`` (``trainer.state``).

A checkpoint saves and restores a trainer only through ``state_dict``/``load_state_dict`` and
``snapshot``/``restore`` (``hpctrain.protocols.Stateful``); this part is the base trainer's
implementation: the counters, the loader's sampler (its position), the module RNGs, the loss
scaler, the optimizer and the user's tracked objects. A strategy that owns more extends the
trainer's four methods with what it owns (``ParallelTrainer``: its reducer's shards; the
parameter server: its clocks).

The loop hands the state the loader's sampler (``Trainer.attach_sampler``) and, after a resume,
takes the sampler state a load restored before the loader's sampler was known
(``Trainer.take_pending_sampler``).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

from ..data.sampler import rescaled_position
from ..nn.rngs import ModuleRngs
from ..protocols import StateOwner, restore_of, snapshot_of


class TrainerState:
    """The epoch, the sampler's position, the module RNGs and the tracked objects of a trainer,
    and with them its side of ``protocols.Stateful``.

    ``owner`` (held weakly: the trainer holds this part) supplies what is saved with it and
    lives in its other parts: the communicators, the model, the optimizer, the precision (the
    loss scaler) and ``global_step`` (``protocols.StateOwner``).
    """

    def __init__(self, owner: StateOwner) -> None:
        self.owner: StateOwner = weakref.proxy(owner)
        self.epoch = 0
        #: The loader's sampler while ``fit`` runs (saved with the trainer's state).
        self.sampler: Any = None
        #: The sampler state a load restored, kept until ``fit`` sees the loader's sampler.
        self.pending_sampler: dict[str, Any] | None = None
        #: The user's objects saved with the trainer's state (``track``), by name.
        self.tracked: dict[str, Any] = {}
        #: While the tracked objects' states are taken (a state_dict() of theirs that calls back is refused).
        self._taking_state = False

    def track(self, name: str, obj: Any) -> None:
        """Save ``obj`` (a ``hpctrain.protocols.Stateful``, or any object with ``state_dict`` and
        ``load_state_dict``) with the trainer's state from now on, under ``name``: checkpoints
        write it, loads restore it (all or nothing, with the rest of the trainer), and a
        shrink after a lost rank puts it back with the step it redoes.

        Rank 0's ``state_dict()`` is saved, so the object must hold the same state on every
        rank (a metric of the agreed loss, a schedule, an early-stopping counter): a save where
        it differs is refused on every rank. The state may hold JSON values, dicts with string
        keys, lists (tuples come back as lists) and numeric arrays; anything else is refused at
        the save, naming where it is (``checkpoint.format.check_saveable``). A checkpoint
        written before ``obj`` was tracked leaves it as it is; a checkpoint's objects this
        trainer does not track are ignored.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"track: name must be a non-empty string, got {name!r}")
        part = obj if isinstance(obj, TrainerState) else getattr(obj, "state", None)  # a trainer holds one
        if isinstance(part, TrainerState):
            what = "the trainer itself" if part is self else f"another trainer ({type(obj).__name__})"
            raise ValueError(f"track({name!r}): {what} cannot be tracked: a trainer's state is saved with its own "
                             "checkpoints (track the objects of yours it does not save)")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"track({name!r}): {type(obj).__name__} has no state_dict()/load_state_dict() "
                            "(see hpctrain.protocols.Stateful)")  # fmt: skip
        if name in self.tracked:
            raise ValueError(f"track: {name!r} is already tracked ({type(self.tracked[name]).__name__})")
        self.tracked[name] = obj

    def take_pending_sampler(self) -> dict[str, Any] | None:
        """The sampler state the last load restored (``None``: none), forgotten from now on."""
        pending, self.pending_sampler = self.pending_sampler, None
        return pending

    def _modules_with_rng(self) -> list[tuple[str, Any]]:
        return ModuleRngs(self.owner.model).modules()

    def state_dict(self) -> dict[str, Any]:
        """Counters, the sampler's state (when ``fit`` runs with one) and module RNG states.

        Collective: RNG states are gathered from every rank, by module name and dp replica, so
        they load under another layout (a module lives on whichever stage holds it; replicas
        that draw differently keep doing so when the dp size is unchanged).
        """
        rngs: dict[str, list[Any]] = {}
        mine = {n: m.rng.bit_generator.state for n, m in self._modules_with_rng()}
        if self._taking_state:  # a tracked object whose state_dict() asks the trainer's: refused, not recursed
            raise RuntimeError("state_dict() of a tracked object called the trainer's state_dict(): a tracked "
                               "object must not hold the trainer's state")
        self._taking_state = True
        try:
            tracked, checks = self._tracked_states()
        finally:
            self._taking_state = False
        everyone = self.owner.comm.allgather_obj((self.owner.dp.rank, mine, checks))
        for d, states, _ in everyone:
            for k, v in states.items():
                rngs.setdefault(k, [None] * self.owner.dp.size)[d] = v
        _agree_tracked([c for _, _, c in everyone])
        state: dict[str, Any] = {
            "global_step": self.owner.global_step,
            "epoch": self.epoch,
            "module_rngs": rngs,
            "world_size": self.owner.comm.size,
            "dp_size": self.owner.dp.size,
        }
        sampler = self.sampler
        if sampler is not None and hasattr(sampler, "state_dict"):  # optional: a user's sampler may keep none
            state["sampler"] = sampler.state_dict()
        if self.owner.precision.scaler is not None:
            state["loss_scaler"] = self.owner.precision.scaler.state_dict()
        if tracked:
            state["tracked"] = tracked
        return state

    def _tracked_states(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The tracked objects' states, and per name a checksum of it or the problem with it
        (``"error: ..."``): caught, so every rank reaches the exchange that compares them."""
        from ..checkpoint.format import check_saveable, state_digest

        states: dict[str, Any] = {}
        checks: dict[str, str] = {}
        for name, obj in self.tracked.items():
            try:
                states[name] = obj.state_dict()
                check_saveable(states[name], f"track({name!r}): state_dict()")
                checks[name] = state_digest(states[name])
            except TypeError as exc:  # check_saveable's, which names the object
                checks[name] = f"error: {exc}"
            except Exception as exc:
                checks[name] = f"error: track({name!r}): {type(exc).__name__}: {exc}"
        return states, checks

    def state_problem(self, state: dict[str, Any]) -> str | None:
        """What in a saved ``state`` this trainer refuses before a load reads or changes anything
        (``None``: nothing): a counter that is not a whole number in range, a sampler position
        beyond this run's epoch, a data order drawn from another seed. A checkpoint's seal proves
        its bytes are whole, not that its values are sane (a file can be forged and sealed
        again). Not collective: ``state`` and the checks are the same on every rank."""
        from ..checkpoint.format import whole

        try:
            for key, least in (("global_step", 0), ("epoch", 0), ("world_size", 1), ("dp_size", 1)):
                if key in state or key in ("global_step", "epoch"):
                    whole(state.get(key), key, least)
            sampler = state.get("sampler")
            if sampler is not None:
                return self._sampler_problem(sampler, int(state.get("dp_size", state.get("world_size", 1))))
        except ValueError as exc:
            return str(exc)
        return None

    def _sampler_problem(self, saved: Any, saved_dp: int) -> str | None:
        """The saved sampler state against this run's sampler: its seed, and its position within
        an epoch of this run's data (the samples all replicas consumed, with one of slack per
        replica for the rescaling across dp sizes)."""
        if not isinstance(saved, dict):
            raise ValueError(f"sampler state is a {type(saved).__name__}, not a dict")
        from ..checkpoint.format import whole

        position = whole(saved.get("position"), "sampler position", 0)
        epoch = whole(saved["epoch"], "sampler epoch", 0) if "epoch" in saved else 0
        sampler = self.sampler
        mine = getattr(sampler, "seed", None)  # optional: a user's sampler may have no seed
        if "seed" in saved and isinstance(mine, int) and whole(saved["seed"], "sampler seed", 0) != mine:
            return (f"its data order was drawn with seed {saved['seed']} and this run's with seed {mine}: a resume "
                    f"keeps the run's seed (--seed {saved['seed']}); nothing was read")
        length = _length_or_none(sampler)
        if length is not None and position * saved_dp > length * self.owner.dp.size + saved_dp:
            return (f"its sampler position {position} (epoch {epoch}, over {saved_dp} replica(s)) is beyond this "
                    f"run's epoch of {length} per replica over {self.owner.dp.size}")
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved, under this trainer's layout.

        The sampler's position counts this dp replica's share of the epoch, so it is rescaled by
        the saved and the current **dp** size (tp and pp ranks of a replica read the same data).
        """
        scaler = self.owner.precision.scaler
        if scaler is not None and state.get("loss_scaler") is not None:
            scaler.load_state_dict(state["loss_scaler"])  # first: it validates (nothing changed yet)
        saved = state.get("tracked") or {}
        for name, obj in self.tracked.items():
            if name in saved:
                obj.load_state_dict(saved[name])
        self.owner.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self._load_rngs(state)
        self._load_sampler(state)

    def _load_rngs(self, state: dict[str, Any]) -> None:
        """Module RNG states by name and dp replica (or the per-rank list of earlier checkpoints)."""
        saved_rngs = state.get("module_rngs") or {}
        old = state.get("rng") or []
        for name, m in self._modules_with_rng():
            if name in saved_rngs:
                per = saved_rngs[name]
                pick = per[self.owner.dp.rank] if len(per) == self.owner.dp.size else per[0]
                if pick is not None:
                    m.rng.bit_generator.state = pick
            elif old:
                own = old[self.owner.comm.rank] if len(old) == self.owner.comm.size else old[0]
                if name in own:
                    m.rng.bit_generator.state = own[name]

    def _load_sampler(self, state: dict[str, Any]) -> None:
        """The sampler's state, rescaled to this dp size: kept until ``fit`` sees the loader's
        sampler (or applied now if it already has one)."""
        sampler_state = state.get("sampler")
        saved_dp = int(state.get("dp_size", state.get("world_size", self.owner.dp.size)))
        if sampler_state is not None:
            sampler_state = dict(sampler_state)
        if sampler_state is not None and saved_dp != self.owner.dp.size:
            sampler_state["position"] = rescaled_position(sampler_state["position"], saved_dp, self.owner.dp.size)
        self.pending_sampler = sampler_state
        sampler = self.sampler
        if sampler is not None and sampler_state is not None:
            if hasattr(sampler, "__len__"):  # optional: a sampler of unknown length is not capped
                sampler_state["position"] = min(int(sampler_state["position"]), len(sampler))
            sampler.load_state_dict(sampler_state)

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint load may change besides the parameters (``Stateful``): counters, the
        pending sampler state, module RNG states, the sampler, the loss scaler and the optimizer.
        Strategies extend it with what they own. Not collective."""
        return {
            "counters": (self.owner.global_step, self.epoch),
            "pending_sampler": copy.deepcopy(self.pending_sampler),
            "rngs": ModuleRngs(self.owner.model).snapshot(),
            "sampler": snapshot_of(self.sampler),
            "loss_scaler": snapshot_of(self.owner.precision.scaler),
            "optimizer": snapshot_of(self.owner.optimizer),
            "tracked": {name: snapshot_of(obj) for name, obj in self.tracked.items()},
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back what :meth:`snapshot` took (after a load failed on some rank). Not collective."""
        restore_of(self.owner.optimizer, snap["optimizer"])
        self.owner.global_step, self.epoch = snap["counters"]
        self.pending_sampler = snap["pending_sampler"]
        ModuleRngs(self.owner.model).restore(snap["rngs"])
        restore_of(self.sampler, snap["sampler"])
        restore_of(self.owner.precision.scaler, snap["loss_scaler"])
        for name, obj in self.tracked.items():
            restore_of(obj, snap.get("tracked", {}).get(name))


def _length_or_none(sampler: Any) -> int | None:
    try:
        return len(sampler) if sampler is not None else None
    except TypeError:  # a sampler of unknown length
        return None


def _agree_tracked(checks: list[dict[str, str]]) -> None:
    """Raise, the same on every rank (``checks``: each rank's, from ``_tracked_states``), when a
    tracked object's state could not be taken or saved on some rank, or differs between ranks:
    rank 0's alone is saved, so another rank's would be lost without a word."""
    for name in checks[0]:
        for rank, mine in enumerate(checks):
            if mine[name].startswith("error: "):
                raise TypeError(f"rank {rank}: {mine[name][7:]}")
        differ = [r for r, mine in enumerate(checks) if mine[name] != checks[0][name]]
        if differ:
            raise RuntimeError(f"track({name!r}): state_dict() differs between ranks (rank(s) {differ[:8]} from "
                               "rank 0); a tracked object must hold the same state on every rank (rank 0's is saved)")
