"""``gradcheck``: a backward against central differences, in float64 (a public tool: check your own
``Function`` with it, as the test suite checks every operation of this package)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..backend import to_device, to_host, xp_of
from ..errors import DtypeError, GradcheckError
from . import backprop
from .function import differentiable
from .grad_mode import no_grad
from .tensors import Tensor


def _outputs(out: Any, name: str) -> list[Tensor]:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not all(isinstance(o, Tensor) for o in outs):
        raise TypeError(f"gradcheck: {name} must return a Tensor or a tuple of Tensors, got {type(out).__name__}")
    return [o for o in outs if differentiable(o.data.dtype)]


def gradcheck(fn: Callable[..., Any], inputs: Sequence[Any] | Any, *, eps: float = 1e-6, atol: float = 1e-5,
              rtol: float = 1e-3, seed: int = 0) -> bool:
    """Check the gradients ``fn`` computes by backward against central differences.

    ``inputs`` are ``fn``'s positional arguments; those that are tensors requiring a gradient are
    checked and must be float64 (others are passed as they are). The scalar checked is
    ``sum_k <out_k, w_k>`` over ``fn``'s floating-point outputs with fixed random weights ``w_k``,
    so every output element counts with its own weight. Each checked input is copied first: the
    caller's tensors and every other leaf ``fn`` uses keep their ``.grad``. ``fn`` must be
    deterministic (give a random op a fixed seed).

    Returns ``True``; raises ``GradcheckError`` naming the input, the element that differs most
    (beyond ``atol + rtol * |numerical|``) and both values.
    """
    args = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    owner = getattr(fn, "__self__", None)  # Swish.apply: name the Function, not the base class
    name = f"{owner.__name__}.{fn.__name__}" if isinstance(owner, type) else getattr(fn, "__qualname__", repr(fn))
    checked = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
    if not checked:
        raise ValueError(f"gradcheck: no input of {name} is a Tensor that requires a gradient")
    for i in checked:
        if args[i].data.dtype != np.float64:
            raise DtypeError(f"gradcheck: input {i} of {name} is {args[i].data.dtype}; differences need float64 "
                             "(Tensor(x.astype(np.float64), requires_grad=True))")
        args[i] = Tensor(xp_of(args[i].data).array(args[i].data, dtype=np.float64, order="C"), requires_grad=True)
    outs = _outputs(fn(*args), name)
    rng = np.random.default_rng(seed)
    weights = [to_device(rng.standard_normal(o.shape), xp_of(o.data)) for o in outs]
    live = [(o, w) for o, w in zip(outs, weights) if o.requires_grad]
    if live:
        backprop.backward([o for o, _ in live], [w for _, w in live], inputs=[args[i] for i in checked])

    def value() -> float:
        with no_grad():
            now = _outputs(fn(*args), name)
        return float(sum(float((o.data.astype(np.float64) * w).sum()) for o, w in zip(now, weights)))

    for i in checked:
        x = args[i]
        analytic = np.zeros(x.shape) if x.grad is None else to_host(x.grad).astype(np.float64)
        numeric = numeric_gradient(value, x.data, eps)
        _compare(name, i, analytic, numeric, atol, rtol)
    return True


def numeric_gradient(value: Callable[[], float], x: Any, eps: float = 1e-6) -> np.ndarray:
    """``d value() / d x`` by central differences (a host float64 array of ``x``'s shape): each
    element of the C-contiguous array ``x`` (NumPy or CuPy) is moved by ``+-eps`` in place, then
    put back."""
    flat = x.reshape(-1)
    out = np.empty(flat.shape[0])
    for j in range(flat.shape[0]):
        old = flat[j].copy()
        flat[j] = old + eps
        hi = value()
        flat[j] = old - eps
        lo = value()
        flat[j] = old
        out[j] = (hi - lo) / (2 * eps)
    return out.reshape(x.shape)


def _compare(name: str, i: int, analytic: np.ndarray, numeric: np.ndarray, atol: float, rtol: float) -> None:
    excess = np.abs(analytic - numeric) - (atol + rtol * np.abs(numeric))
    bad = ~(excess <= 0)  # NaN counts as a difference
    if not bad.any():
        return
    worst = np.unravel_index(int(np.argmax(np.where(np.isnan(excess), np.inf, excess))), analytic.shape)
    raise GradcheckError(
        f"gradcheck of {name}: input {i} (shape {analytic.shape}): the analytic gradient differs from the numerical "
        f"one at {int(bad.sum())} of {analytic.size} elements; worst at index {tuple(int(v) for v in worst)}: "
        f"analytic {float(analytic[worst]):.8g}, numerical {float(numeric[worst]):.8g} (atol={atol}, rtol={rtol})")
