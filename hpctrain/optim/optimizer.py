"""Optimizers: SGD, Adam, AdamW with the formulas and defaults of the widely used references.

State is kept per parameter *name* (``Parameter.name``), so a checkpoint can store it next to the
parameter and reshard it with it. ``schedule`` (a callable ``step -> multiplier``) scales ``lr``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from ..nn import fused
from ..nn.module import Parameter
from . import multi_tensor


class Optimizer:
    """Base: holds parameters, the step count and per-parameter state. A parameter whose
    ``requires_grad`` is false (frozen) is left as it is by ``step``, as PyTorch's optimizers
    skip a parameter without a gradient."""

    state_keys: tuple[str, ...] = ()
    #: Whether ``update`` is elementwise: a slice of a parameter updated with the same slice of its
    #: gradient and state gives that slice of the whole update (``optim.sharded`` updates pieces).
    #: Declared by the class that defines ``update``; a subclass overriding it declares it again.
    elementwise: bool = False

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float,
        schedule: Callable[[int], float] | None = None,
    ) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got no parameters")
        if lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        names = [p.name or str(i) for i, p in enumerate(self.params)]
        if len(set(names)) != len(names):
            raise ValueError("parameters passed to an optimizer must have distinct names")
        self.names = names
        self.lr = lr
        self.schedule = schedule
        self.step_count = 0
        self.state: dict[str, dict[str, Any]] = {n: {} for n in names}
        #: Float32 masters by name under mixed precision (``set_masters``), else ``None``.
        self.masters: dict[str, Parameter] | None = None

    @property
    def current_lr(self) -> float:
        """The learning rate the next ``step`` uses (after the schedule)."""
        return self.lr * (self.schedule(self.step_count) if self.schedule else 1.0)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad.fill(0)

    def set_masters(self, masters: dict[str, Parameter]) -> None:
        """Mixed precision: update these float32 masters (by parameter name) instead of the
        16-bit parameters, keep the state in float32, and round each updated master into its
        parameter (``hpctrain.training.precision``). A master's ``grad`` is its parameter's gradient
        (widened to float32) during the update only."""
        missing = sorted(set(self.names) - set(masters))
        if missing:
            raise ValueError(f"no master for parameters: {', '.join(missing)}")
        self.masters = {n: masters[n] for n in self.names}

    def step(self) -> None:
        lr = self.current_lr
        self.step_count += 1
        if multi_tensor.step(self, lr, self.step_count):  # CuPy arrays: one launch (nn.gpu)
            return
        masters = self.masters
        for name, p in zip(self.names, self.params):
            if not p.requires_grad:  # frozen (requires_grad = False): not even weight decay moves it
                continue
            if masters is None:
                self.update(p, self.state[name], lr, self.step_count)
                continue
            m = masters[name]
            g = p.grad  # a 16-bit gradient widens exactly; the update itself is the fp32 one
            m.grad = g if g.dtype == m.data.dtype else g.astype(m.data.dtype)
            self.update(m, self.state[name], lr, self.step_count)
            m.grad = None  # no second gradient kept between steps
            p.data[...] = m.data  # round to nearest even into the compute copy

    def update(self, p: Parameter, state: dict[str, Any], lr: float, step: int,
               scratch: dict[str, Any] | None = None) -> None:
        """Update ``p.data`` in place from ``p.grad`` and ``state`` (its arrays created on first
        use) by this optimizer's rule, as step number ``step`` (1 for the first) with learning rate
        ``lr``. It reads only the hyper-parameters of ``self``, so ``optim.sharded`` applies it to
        pieces of parameters. ``scratch``: a dict in which the rule may keep work arrays between
        calls (``None``: on the optimizer itself, sized for its largest parameter)."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """Hyper-parameters (compared across ranks and stored in checkpoints)."""
        return {"type": type(self).__name__, "lr": self.lr, "schedule": _describe(self.schedule)}

    def state_dict(self) -> dict[str, Any]:
        """``{"step": n, "config": {...}, "state": {param name: {key: array}}}``."""
        return {"step": self.step_count, "config": self.config(), "state": self.state}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the step count and per-parameter state from :meth:`state_dict` (copies it).

        Refuses state of another optimizer type, of unknown parameters or of the wrong shape.
        """
        kind = sd.get("config", {}).get("type")
        if kind is not None and kind != type(self).__name__:
            raise ValueError(f"{type(self).__name__}.load_state_dict got the state of a {kind}")
        unknown = sorted(set(sd["state"]) - set(self.names))
        if unknown:
            raise ValueError(f"optimizer state for unknown parameters: {', '.join(unknown)}")
        wrong = [
            f"{name}/{k}: expected {p.shape}, got {tuple(v.shape)}"
            for name, p in zip(self.names, self.params)
            for k, v in sd["state"].get(name, {}).items()
            if tuple(v.shape) != p.shape
        ]
        if wrong:
            raise ValueError(f"optimizer state of the wrong shape: {'; '.join(wrong)}")
        self.step_count = int(sd["step"])
        for name, p in zip(self.names, self.params):
            src = sd["state"].get(name, {})
            xp = xp_of(p.data)
            dtype = p.dtype if self.masters is None else self.masters[name].dtype  # state lives with the masters
            self.state[name] = {k: to_device(v, xp).astype(dtype, copy=True) for k, v in src.items()}


    def snapshot(self) -> dict[str, Any]:
        """The step count and each parameter's state dict (``hpctrain.protocols.Stateful``).
        References, not copies: a load replaces a parameter's state dict whole and never writes
        into its arrays, so they are what :meth:`restore` puts back."""
        return {"step": self.step_count, "state": dict(self.state)}

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back what :meth:`snapshot` took."""
        self.step_count = snap["step"]
        self.state.clear()
        self.state.update(snap["state"])


def _describe(schedule: Callable[[int], float] | None) -> Any:
    """A JSON-able description of a schedule: its ``config()`` if it has one, else its name."""
    if schedule is None:
        return None
    if hasattr(schedule, "config"):
        return schedule.config()
    return getattr(schedule, "__qualname__", type(schedule).__name__)


class SGD(Optimizer):
    """SGD with momentum, Nesterov and (L2) weight decay, as in the common reference."""

    state_keys = ("momentum_buffer",)
    elementwise = True
    multi_tensor_rule = "sgd"  # the GPU kernel of this update (optim.multi_tensor)

    def __init__(self, params, lr: float, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, schedule=None) -> None:
        super().__init__(params, lr, schedule)
        if momentum < 0 or weight_decay < 0:
            raise ValueError(f"momentum and weight_decay must be >= 0, got {momentum} and {weight_decay}")
        if nesterov and momentum <= 0:
            raise ValueError("nesterov=True needs momentum > 0")
        self.momentum, self.nesterov, self.weight_decay = momentum, nesterov, weight_decay

    def update(self, p, state, lr, step, scratch=None) -> None:
        if multi_tensor.update_one(self, p, state, lr, step, scratch):
            return
        g = p.grad
        if self.weight_decay:
            g = g + self.weight_decay * p.data
        if self.momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.copy()
            else:
                buf *= self.momentum
                buf += g
            g = g + self.momentum * buf if self.nesterov else buf
        p.data -= lr * g

    def config(self) -> dict[str, Any]:
        return {**super().config(), "momentum": self.momentum, "nesterov": self.nesterov,
                "weight_decay": self.weight_decay}


class Adam(Optimizer):
    """Adam with bias correction; ``weight_decay`` is L2 added to the gradient."""

    state_keys = ("exp_avg", "exp_avg_sq")
    decoupled = False
    elementwise = True
    multi_tensor_rule = "adam"

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, schedule=None) -> None:
        super().__init__(params, lr, schedule)
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps} and {weight_decay}")
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay

    def update(self, p, state, lr, step, scratch=None) -> None:
        b1, b2 = self.betas
        t = step
        g = p.grad
        xp = xp_of(p.data)
        if self._fused_update(p, state, lr, step) or multi_tensor.update_one(self, p, state, lr, step, scratch):
            return
        if self.weight_decay:
            if self.decoupled:
                p.data *= 1 - lr * self.weight_decay
            else:
                g = g + self.weight_decay * p.data
        if "exp_avg" not in state:
            state["exp_avg"] = xp.zeros_like(p.data)
            state["exp_avg_sq"] = xp.zeros_like(p.data)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        # The reference's operations in its order, in place and through one scratch array shared
        # by all parameters (bitwise equal to the formulas, no temporaries).
        s = self._scratch_like(p.data, xp, scratch)
        m *= b1
        m += xp.multiply(g, 1 - b1, out=s)
        v *= b2
        xp.multiply(g, g, out=s)
        s *= 1 - b2
        v += s
        step_size = lr / (1 - b1**t)
        xp.divide(v, 1 - b2**t, out=s)
        xp.sqrt(s, out=s)
        s += self.eps
        xp.divide(m, s, out=s)
        s *= step_size
        p.data -= s

    def _fused_update(self, p: Parameter, state: dict[str, Any], lr: float, step: int) -> bool:
        """The whole update in one pass (``hpctrain.nn.fused``; bitwise the NumPy code's result)
        when the kernels are on and the arrays suit them; ``False`` leaves it to the NumPy code."""
        if not isinstance(p.data, np.ndarray):
            return False
        m, v = state.get("exp_avg"), state.get("exp_avg_sq")
        arrays = (p.data, p.grad) if m is None else (p.data, p.grad, m, v)
        k = fused.usable(*arrays)
        if k is None or any(a.shape != p.data.shape for a in arrays):
            return False
        if m is None:
            m = state["exp_avg"] = np.zeros_like(p.data)
            v = state["exp_avg_sq"] = np.zeros_like(p.data)
        b1, b2 = self.betas
        t = step
        wd = self.weight_decay
        decay = 1 - lr * wd if wd and self.decoupled else 1.0
        l2 = wd if wd and not self.decoupled else 0.0
        k.adam(p.data.reshape(-1), p.grad.reshape(-1), m.reshape(-1), v.reshape(-1),
               *fused.scalars(p.data.dtype, decay, l2, b1, 1 - b1, b2, 1 - b2, 1 - b2**t, self.eps,
                              lr / (1 - b1**t)))
        return True

    def _scratch_like(self, a: Any, xp: Any, cache: dict[str, Any] | None = None) -> Any:
        """A scratch view shaped like ``a`` from one flat array kept in ``cache``: sized for ``a``,
        or (``None``: on this optimizer) for the largest parameter."""
        own = cache is None
        cache = self.__dict__ if own else cache
        flat = cache.get("_scratch")
        if flat is None or flat.dtype != a.dtype or xp_of(flat) is not xp or flat.size < a.size:
            size = a.size
            if own:
                pool = self.masters.values() if self.masters else self.params  # what the update runs on
                size = max(int(q.data.size) for q in pool if q.data.dtype == a.dtype)
            flat = cache["_scratch"] = xp.empty(size, dtype=a.dtype)
        return flat[: a.size].reshape(a.shape)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}


class AdamW(Adam):
    """Adam with decoupled weight decay (``p *= 1 - lr * wd`` before the Adam update)."""

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, schedule=None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, schedule)
