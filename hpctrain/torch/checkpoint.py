"""``save`` / ``load``: torch objects in hpctrain's sealed HDF5 checkpoint format.

``hpctrain.checkpoint`` saves and loads a *trainer*: an object with ``comm``, ``shards()``,
``optimizer``, ``state_dict()``/``load_state_dict()``, ``snapshot()``/``restore()`` (ARCHITECTURE.md,
"checkpoint/"). ``_Bundle`` is that object over the torch objects handed in by keyword, so the
format, the parallel and asynchronous writes, ``keep``, the checksums and the all-or-nothing load
are hpctrain's own, unchanged:

- every module's parameters and buffers are full tensors under their module names
  (``model=`` unprefixed, any other keyword ``kw`` as ``kw.<name>``): ``model/<name>``;
- every optimizer's per-element state (Adam's moments) is full tensors ``optim/<name>/<key>``
  (a ``ZeroRedundancyOptimizer`` gathers its pieces: the checkpoint loads under any dp size);
- the rest (optimizer hyperparameters and scalar state, samplers, schedulers, any object with
  ``state_dict``/``load_state_dict``, the step) is JSON in the header, tensors kept as arrays.

A tensor is read and written through a NumPy (CUDA: CuPy) view of its memory, so a load copies the
checkpoint's values straight into the module's tensors and, if anything fails on any rank, copies
the old ones back.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from typing import Any

import torch

from .. import backend
from .. import checkpoint as ckpt
from ..checkpoint.format import check_saveable
from ..comm import Communicator
from ..log import get_logger
from ..protocols import restore_of, snapshot_of
from . import views
from .ddp import DistributedDataParallel
from .zero_optimizer import ZeroRedundancyOptimizer

_log = get_logger("torch")
_TORCH = "__torch__"  # marks a tensor in JSON state, so a load gives a tensor back


@dataclass(frozen=True)
class Loaded:
    """What :func:`load` read: the checkpoint's ``path``, its ``step`` and ``epoch``."""

    path: str
    step: int
    epoch: int


class _Param:
    """A tensor as the checkpoint reads and writes it: ``data`` is a view of its memory."""

    __slots__ = ("name", "data", "dtype")

    def __init__(self, name: str, t: torch.Tensor) -> None:
        try:
            self.data = views.as_array(t)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        self.name, self.dtype = name, self.data.dtype


class _OptimizerView:
    """What the checkpoint reads of the optimizers: per-element state by parameter name (views);
    ``state_keys`` ``None`` (a torch optimizer's keys are whatever the checkpoint holds)."""

    state_keys = None
    step_count = 0

    def __init__(self, state: dict[str, dict[str, Any]], config: dict[str, Any]) -> None:
        self.state, self.config = state, config

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_count, "config": self.config}


def _plain(value: Any) -> Any:
    """JSON-able state: tensors as marked arrays (nested containers followed)."""
    if torch.is_tensor(value):
        return {_TORCH: value.detach().cpu().numpy() if value.dtype != torch.bfloat16 else value.float().numpy()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _unplain(value: Any) -> Any:
    """:func:`_plain` undone: marked arrays as tensors again."""
    if isinstance(value, dict):
        if set(value) == {_TORCH}:
            return torch.as_tensor(value[_TORCH])
        return {k: _unplain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    return value


def _opt_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


class _Bundle:
    """The trainer interface of ``hpctrain.checkpoint`` over torch objects (see the module docstring)."""

    def __init__(self, comm: Communicator, objects: dict[str, Any], step: int = 0, epoch: int = 0) -> None:
        self.comm, self.global_step, self.epoch = comm, int(step), int(epoch)
        self.checkpointer = _checkpointer(comm)
        self.modules: dict[str, torch.nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.others: dict[str, Any] = {}
        self.wrappers = [o for o in objects.values() if isinstance(o, DistributedDataParallel)]
        for kw, obj in objects.items():
            if isinstance(obj, torch.nn.Module):
                self.modules[kw] = obj.module if isinstance(obj, DistributedDataParallel) else obj
            elif isinstance(obj, torch.optim.Optimizer):
                self.optimizers[kw] = obj
            elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
                self.others[kw] = obj
            else:
                raise TypeError(f"{kw}={type(obj).__name__}: hpctrain.torch saves modules, optimizers and objects "
                                "with state_dict() and load_state_dict()")
        self.tensors: dict[str, torch.Tensor] = {}
        for kw, m in self.modules.items():
            prefix = "" if kw == "model" else f"{kw}."
            for name, t in [*m.named_parameters(), *m.named_buffers()]:
                self.tensors[prefix + name] = t
        self._names = {id(t): n for n, t in self.tensors.items()}
        self.optimizer = _OptimizerView({}, {kw: type(o).__name__ for kw, o in self.optimizers.items()})
        self.optimizer.step_count = self.global_step  # what `hpctrain ckpt inspect` shows
        for kw, opt in self.optimizers.items():
            missing = [p for p in _opt_params(opt) if id(p) not in self._names]
            if missing:
                raise ValueError(f"{kw}: the optimizer holds {len(missing)} parameter(s) of shape "
                                 f"{tuple(missing[0].shape)}... that none of the modules given hold; pass the "
                                 "model it trains too (model=...)")
        self.layout = {"framework": "torch", "dp": comm.size,
                       "zero": any(isinstance(o, ZeroRedundancyOptimizer) for o in self.optimizers.values())}

    def config(self) -> dict[str, Any]:
        return {"modules": {kw: type(m).__name__ for kw, m in self.modules.items()},
                "optimizers": {kw: type(o).__name__ for kw, o in self.optimizers.items()}}

    def shards(self) -> dict[str, tuple[Any, tuple, tuple]]:
        """Every tensor whole, under its name."""
        views.sync()
        return {n: (_Param(n, t), tuple(t.shape), tuple(slice(0, d) for d in t.shape)) for n, t in self.tensors.items()}

    # -- state --------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Before a save: the optimizers' per-element state as full tensors into ``optimizer.state``
        and the JSON part (collective: a ``ZeroRedundancyOptimizer`` gathers its pieces)."""
        for obj in self.wrappers:  # the buffers rank 0 holds, as the next forward would broadcast them
            if obj.broadcast_buffers:
                obj.sync_buffers()
        self.optimizer.state = {}
        optimizers = {kw: self._optimizer_json(opt) for kw, opt in self.optimizers.items()}
        state = {"global_step": self.global_step, "epoch": self.epoch, "optimizers": optimizers,
                 "objects": {kw: _plain(o.state_dict()) for kw, o in self.others.items()}}
        check_saveable(state, "hpctrain.torch.save")
        self._json = state

    def state_dict(self) -> dict[str, Any]:
        """The JSON part :meth:`prepare` made."""
        return self._json

    def _optimizer_json(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        sd, params = opt.state_dict(), _opt_params(opt)
        small: dict[str, dict[str, Any]] = {}
        for i, st in sd["state"].items():
            p = params[int(i)]
            name = self._names[id(p)]
            for key, value in st.items():
                if torch.is_tensor(value) and value.shape == p.shape and value.dim() > 0:
                    self.optimizer.state.setdefault(name, {})[key] = views.as_array(value.contiguous())
                else:
                    small.setdefault(name, {})[key] = _plain(value)
        groups = [{**{k: _plain(v) for k, v in g.items() if k != "params"},
                   "params": [self._names[id(params[int(i)])] for i in g["params"]]} for g in sd["param_groups"]]
        return {"param_groups": groups, "small": small}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Everything but the tensors (written by the load already) and the optimizers' staged
        per-element state, put into the objects."""
        if (self.optimizers or self.others) and "optimizers" not in state:
            raise ValueError("the checkpoint was not written by hpctrain.torch: it holds no torch optimizers or "
                             "objects (load its weights alone: model=...)")
        for kw, opt in self.optimizers.items():
            saved = state["optimizers"].get(kw)
            if saved is None:
                raise ValueError(f"the checkpoint holds no optimizer {kw!r} (it has {sorted(state['optimizers'])})")
            opt.load_state_dict(self._optimizer_sd(kw, opt, saved))
        for kw, obj in self.others.items():
            if kw not in state["objects"]:
                raise ValueError(f"the checkpoint holds no {kw!r} (it has {sorted(state['objects'])})")
            obj.load_state_dict(_unplain(state["objects"][kw]))
        self.global_step, self.epoch = int(state.get("global_step", 0)), int(state.get("epoch", 0))
        backend.synchronize()  # CuPy wrote into CUDA tensors: done before torch reads them

    def _optimizer_sd(self, kw: str, opt: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
        """torch's state dict for ``opt`` from the checkpoint's groups, scalars and staged tensors."""
        params = _opt_params(opt)
        index = {self._names[id(p)]: i for i, p in enumerate(params)}
        now = [[self._names[id(p)] for p in g["params"]] for g in opt.param_groups]
        if [g["params"] for g in saved["param_groups"]] != now:
            raise ValueError(f"optimizer {kw!r}: the checkpoint's parameter groups hold other parameters "
                             f"(first group: {saved['param_groups'][0]['params'][:3]}..., here {now[0][:3]}...)")
        state: dict[int, dict[str, Any]] = {}
        for name, i in index.items():
            st = dict(_unplain(saved["small"].get(name, {})))
            st.update({k: views.as_tensor(v) for k, v in self.optimizer.state.get(name, {}).items()})
            if st:
                state[i] = st
        groups = [{**_unplain({k: v for k, v in g.items() if k != "params"}), "params": [index[n] for n in g["params"]]}
                  for g in saved["param_groups"]]
        return {"state": state, "param_groups": groups}

    def snapshot(self) -> dict[str, Any]:
        """What ``load_state_dict`` may change besides the tensors (not collective)."""
        return {"optimizers": {kw: snapshot_of(o) for kw, o in self.optimizers.items()},
                "others": {kw: snapshot_of(o) for kw, o in self.others.items()},
                "counters": (self.global_step, self.epoch)}

    def restore(self, snap: dict[str, Any]) -> None:
        for kw, o in self.optimizers.items():
            restore_of(o, snap["optimizers"][kw])
        for kw, o in self.others.items():
            restore_of(o, snap["others"][kw])
        self.global_step, self.epoch = snap["counters"]


# -- one checkpointer per communicator ----------------------------------------------------------------

_CHECKPOINTERS: dict[int, ckpt.Checkpointer] = {}
_WORLD: list[Communicator] = []


def _key(comm: Communicator) -> int:
    """One key per group: every Communicator of the world wraps the one COMM_WORLD object (the
    checkpointer keeps its communicator, so the object outlives its entry)."""
    return id(comm.mpi)


def _checkpointer(comm: Communicator) -> ckpt.Checkpointer:
    """The checkpointer of ``comm``'s group (collective the first time), kept for the next calls:
    it holds the asynchronous save in flight."""
    own = _CHECKPOINTERS.get(_key(comm))
    if own is None:
        own = _CHECKPOINTERS[_key(comm)] = ckpt.Checkpointer(comm)
    elif own.comm is not comm:
        own.comm = comm  # another Communicator object of the same group: same private channel
    return own


def comm_of(objects: dict[str, Any], comm: Communicator | None) -> Communicator:
    """``comm``, else the one a ``DistributedDataParallel`` or ``ZeroRedundancyOptimizer`` among
    ``objects`` reduces over, else every rank."""
    if comm is not None:
        return comm
    for obj in objects.values():
        if isinstance(obj, (DistributedDataParallel, ZeroRedundancyOptimizer)):
            return obj.comm
    if not _WORLD:
        _WORLD.append(Communicator())
    return _WORLD[0]


def _bundle(comm: Communicator, objects: dict[str, Any], step: int = 0, epoch: int = 0, *,
            saving: bool = False) -> _Bundle:
    """The bundle (``saving``: prepared for a save), or the same error on every rank (collective)."""
    bundle, problem = None, None
    try:
        bundle = _Bundle(comm, objects, step, epoch)
    except (TypeError, ValueError) as exc:
        problem = exc
    comm.raise_if_any(problem, what="hpctrain.torch")
    if saving:  # after the verdict: a ZeroRedundancyOptimizer's state is gathered here (collective)
        try:
            bundle.prepare()
        except (TypeError, ValueError) as exc:
            problem = exc
        comm.raise_if_any(problem, what="hpctrain.torch.save")
    return bundle


def save(path: str, *, step: int | None = None, epoch: int = 0, keep: int = 0, asynchronous: bool = False,
         comm: Communicator | None = None, **objects: Any) -> str:
    """Save ``objects`` (by keyword: ``model=``, ``optimizer=``, ``sampler=``, any module, optimizer
    or object with ``state_dict``/``load_state_dict``) to ``path``; collective over ``comm``
    (default: the group of a ``DistributedDataParallel`` among them, else every rank).

    With ``step``, ``path`` is a directory and the file ``ckpt-<step>.h5`` in it; ``keep=N`` then
    deletes all but the newest N once it is committed (``step`` and ``epoch`` are recorded; :func:`load`
    returns them). ``asynchronous=True`` returns after a host
    snapshot; the file appears at the next save, load or :func:`wait` (call it before exiting).
    Returns the file's path.
    """
    if step is None and keep:
        raise ValueError("keep= prunes a directory of ckpt-<step>.h5 files: give step= too")
    for name, value in (("step", step), ("epoch", epoch), ("keep", keep)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    bundle = _bundle(comm_of(objects, comm), objects, step or 0, epoch, saving=True)
    if step is not None:
        return ckpt.save_in(path, bundle, keep=keep, asynchronous=asynchronous)
    return ckpt.save(path, bundle, asynchronous=asynchronous)


def load(path: str, *, comm: Communicator | None = None, **objects: Any) -> Loaded:
    """Load ``objects`` (by the keywords they were saved under) from ``path``, a checkpoint file or
    a directory (its newest checkpoint that loads); collective. All or nothing: a missing or
    damaged file, a checkpoint of another model or an object that refuses its state raises the
    same error on every rank with every object unchanged. Any dp size may load it."""
    bundle = _bundle(comm_of(objects, comm), objects)
    if os.path.isdir(path):
        found = ckpt.load_latest(path, bundle)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {path}")
        path = found
    else:
        ckpt.load(path, bundle)
    return Loaded(path, bundle.global_step, bundle.epoch)


def wait() -> str | None:
    """Finish every asynchronous save this process started (collective over their groups);
    returns the last one's path, ``None`` when none was in flight."""
    done = None
    for own in list(_CHECKPOINTERS.values()):
        done = own.wait() or done
    return done


@atexit.register
def _unfinished() -> None:
    for own in _CHECKPOINTERS.values():
        if own.job is not None:
            _log.warning("an asynchronous checkpoint (%s) was never committed: call hpctrain.torch.wait() "
                         "before the job ends", own.job.path)

