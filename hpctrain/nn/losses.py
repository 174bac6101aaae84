"""Losses: ``forward(pred, target, weight=None)`` returns the (weighted) batch mean as a float
(on the GPU a 0-d device array: reading it would wait for the GPU, so the trainer reads it once
per step with the gradient norm), ``backward(scale=1.0)`` the gradient of that mean with respect
to ``pred``.

``weight`` is an optional per-sample weight of shape ``(B,)`` (0 for padding samples a sampler
added, 1 otherwise): the loss is then ``sum(w * l) / sum(w)``, so padded samples never count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..autograd import is_tensor
from ..backend import is_device_array, widen, xp_of
from ..errors import DatasetError
from . import gpu
from .buffers import Buffers
from .layer_nodes import call_loss


def per_sample_weight(weight: Any, per_sample: Any) -> tuple[Any, Any]:
    """Broadcastable weights and their total (the denominator of the mean: a float, or a 0-d
    device array for device weights): the losses' one sample-weight rule, which the
    vocabulary-parallel loss (``parallel.tensor_layers``) applies too."""
    xp = xp_of(per_sample)
    b = per_sample.shape[0]
    if weight is None:
        return None, float(per_sample.size)
    w = xp.asarray(weight, dtype=per_sample.dtype)
    if w.shape != (b,):
        raise ValueError(f"weight must have shape ({b},), got {tuple(w.shape)}")
    w = w.reshape((b,) + (1,) * (per_sample.ndim - 1))
    total = w.sum()
    return w, (total if is_device_array(total) else float(total)) * (per_sample.size // b)


def batch_mean(total: Any, denom: Any) -> Any:
    """``total / denom`` (0 for no weight): a float on the host; on the device a 0-d array, never
    read here."""
    if not (is_device_array(total) or is_device_array(denom)):
        return float(total) / denom if denom else 0.0
    if not is_device_array(denom):  # a host count (no weights): decided here, nothing read back
        return total / denom if denom else total * 0
    # CuPy's where takes arrays only (a Python bool has no ``astype``): the condition is device-side.
    return xp_of(denom).where(denom == 0, 0.0, total / (denom + (denom == 0)))


def all_weights_zero(denom: Any) -> bool:
    """Whether a host denominator is 0 (a device one is never read: see ``batch_mean``)."""
    return not is_device_array(denom) and not denom


def nonzero(denom: Any) -> Any:
    """``denom`` with 0 replaced by 1 on the device (the gradient is 0 there anyway: weights 0)."""
    return denom + (denom == 0) if is_device_array(denom) else denom


class TargetChecks:
    """A step's deferred target checks (``collect_target_checks``): one flag per loss call.

    Reading ``bad.any()`` in every loss call would be a device->host read per micro-batch (each
    one waits for the GPU); the trainer instead reads ``flag()`` with the step's one transfer and,
    once every rank knows some target was bad, ``error()`` names this rank's first one.
    """

    def __init__(self) -> None:
        self._found: list[tuple[Any, Any, int, str]] = []  # (any bad?, target, n_classes, who)

    def add(self, bad: Any, target: Any, n_classes: int, who: str) -> None:
        self._found.append((bad.any(), target, n_classes, who))

    def flag(self, xp: Any) -> Any:
        """1.0 when some checked target was out of range, else 0.0: a shape-(1,) float64 array of
        ``xp`` (on the device: not read here)."""
        if not self._found:
            return xp.zeros(1)
        return xp.stack([xp.asarray(b) for b, *_ in self._found]).any().astype(np.float64).reshape(1)

    def error(self) -> DatasetError | None:
        """The error for this rank's first bad target (host reads only on this error path)."""
        for _, target, n_classes, who in self._found:
            problem = _target_error(target, n_classes, who)
            if problem is not None:
                return problem
        return None


_collecting: list[TargetChecks] = []  # the innermost ``collect_target_checks`` in force


@contextmanager
def collect_target_checks() -> Iterator[TargetChecks]:
    """While in force, ``check_targets`` records its finding instead of reading it (see
    ``TargetChecks``); the caller must raise ``error()`` when the flag is set."""
    checks = TargetChecks()
    _collecting.append(checks)
    try:
        yield checks
    finally:
        _collecting.remove(checks)


def _target_error(target: Any, n_classes: int, who: str) -> DatasetError | None:
    """``DatasetError`` naming the first class index outside ``[0, n_classes)`` (``None``: none)."""
    xp = xp_of(target)
    bad = (target < 0) | (target >= n_classes)
    if not (target.size and bool(bad.any())):
        return None
    where = tuple(int(i) for i in xp.argwhere(bad)[0])
    value = int(target[where])
    return DatasetError(f"{who}: target {value} at position {where} is not a class index in "
                        f"[0, {n_classes}) (the logits have {n_classes} classes)")


def check_targets(target: Any, n_classes: int, who: str) -> Any:
    """Refuse class indices outside ``[0, n_classes)`` (``DatasetError`` naming the first one);
    returns the targets to index the logits with.

    Without this a negative target silently picks a class from the end (``take_along_axis``
    wraps) and a too-large one fails deep in NumPy. One reduction over the targets, tiny next to
    the logits. Under ``collect_target_checks`` (a trainer's step) nothing is read: the finding
    is recorded and the returned targets are clamped into range so the forward runs to the
    step's agreement, which raises on every rank before any update.
    """
    if _collecting:
        bad = (target < 0) | (target >= n_classes)
        _collecting[-1].add(bad, target, n_classes, who)
        return xp_of(target).where(bad, 0, target)
    if gpu.capturing:  # a CUDA graph reads nothing back; its warm-up step checked these targets
        return target
    problem = _target_error(target, n_classes, who)
    if problem is not None:
        raise problem
    return target


def _as_rows_of(target: Any, pred: Any) -> Any:
    """``target`` in ``pred``'s shape: as it is, or, for a prediction of rows ``(B, n)``, targets
    ``(B,)`` (one output, n = 1) or ``(B, ...)`` holding n values per row (what ``--loss mse`` reads
    from a file), taken row by row. Anything else is a ``ValueError`` naming both shapes (never a
    broadcast: ``(B, 1) - (B,)`` would be a ``(B, B)`` difference)."""
    if target.shape == pred.shape:
        return target
    if pred.ndim == 2 and target.ndim >= 1 and target.shape[0] == pred.shape[0] \
            and math.prod(target.shape[1:]) == pred.shape[1]:
        return target.reshape(pred.shape)
    raise ValueError(f"MSELoss: pred shape {pred.shape} != target shape {target.shape} (targets of shape (B,) "
                     "fit one output (B, 1); (B, ...) fit (B, n) with n values per row)")


class Loss:
    """Base of the losses. ``loss(pred, target[, weight])`` on arrays is ``forward`` (the loss value;
    ``backward(scale)`` then gives the gradient of ``scale`` times it); on a tensor ``pred`` it is
    one node of the autograd graph (``hpctrain.nn.layer_nodes``) whose output, a 0-d tensor, is the
    value: ``loss(model(x), y).backward()``. ``call_state``: the attributes ``forward`` sets for
    its ``backward`` (moved into the node, so one loss object serves several calls in flight)."""

    call_state: tuple[str, ...] = ("cache",)

    def forward(self, pred: Any, target: Any, weight: Any = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def backward(self, scale: float = 1.0) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.backward")

    def __call__(self, pred: Any, target: Any, weight: Any = None) -> Any:
        if is_tensor(pred):
            return call_loss(self, pred, target, weight)
        return self.forward(pred, target) if weight is None else self.forward(pred, target, weight)


class MSELoss(Loss):
    """Mean squared error over all elements (the widely used reference's default)."""

    def __init__(self) -> None:
        self.cache = None

    def forward(self, pred: Any, target: Any, weight: Any = None) -> float:
        target = _as_rows_of(target, pred)
        diff = pred - target.astype(pred.dtype, copy=False)
        sq = diff * diff
        w, denom = per_sample_weight(weight, sq)
        if w is not None:
            sq = sq * w
        self.cache = (diff, w, denom)
        return batch_mean(sq.sum(), denom)

    def backward(self, scale: float = 1.0) -> Any:
        diff, w, denom = self.cache
        if all_weights_zero(denom):
            return diff * 0
        g = diff * (2.0 * scale / nonzero(denom))
        return g * w if w is not None else g


class CrossEntropyLoss(Loss):
    """Softmax cross-entropy with integer targets; logits ``(B, C)`` or ``(B, T, C)``.

    Uses a stable log-softmax (max subtracted); the mean runs over every target position.
    """

    call_state = ("cache", "_low")

    def __init__(self) -> None:
        self.cache = None
        self._buffers = Buffers()
        self._low = None  # the logits' 16-bit dtype under mixed precision

    def forward(self, logits: Any, target: Any, weight: Any = None) -> float:
        xp = xp_of(logits)
        k = gpu.usable(logits)
        if k is not None and logits.shape[:-1] == target.shape and target.dtype.kind in "iu":
            return self._forward_gpu(k, logits, target, weight)
        logits, self._low = widen(logits)  # 16-bit logits: the softmax and the loss in float32
        if logits.shape[:-1] != target.shape:
            raise ValueError(
                f"CrossEntropyLoss: logits {logits.shape} need targets of shape "
                f"{logits.shape[:-1]}, got {target.shape}"
            )
        if target.dtype.kind not in "iu":
            raise TypeError(f"CrossEntropyLoss needs integer targets, got {target.dtype}")
        target = check_targets(target, logits.shape[-1], "CrossEntropyLoss")
        buf = self._buffers
        row = (*logits.shape[:-1], 1)
        # The reference's operations in its order, into reused buffers (bitwise equal).
        shifted = buf.like("shifted", logits)
        xp.subtract(logits, xp.max(logits, axis=-1, keepdims=True, out=buf.get("max", row, logits.dtype, xp)),
                    out=shifted)
        probs = buf.like("probs", logits)
        xp.exp(shifted, out=probs)
        sumexp = xp.sum(probs, axis=-1, keepdims=True, out=buf.get("sumexp", row, logits.dtype, xp))
        logp_t = xp.take_along_axis(shifted, target[..., None], axis=-1)[..., 0] - xp.log(sumexp[..., 0])
        nll = -logp_t
        w, denom = per_sample_weight(weight, nll)
        if w is not None:
            nll = nll * w
        probs /= sumexp
        self.cache = (probs, target, w, denom)
        return batch_mean(nll.sum(), denom)

    def _forward_gpu(self, k: Any, logits: Any, target: Any, weight: Any) -> Any:
        """One kernel pass over the logits (online max and sum, float32): each row's log-sum-exp
        is kept, and backward writes the gradient over the logits themselves (no probabilities,
        no second logits-sized array). Without weights nothing is allocated and nothing read back
        (the mean is one more kernel into a reused 0-d array): what a captured CUDA graph needs."""
        xp, buf = xp_of(logits), self._buffers
        target = check_targets(target, logits.shape[-1], "CrossEntropyLoss")
        v = logits.shape[-1]
        t = xp.ascontiguousarray(target.reshape(-1), dtype=np.int64)
        n = t.size
        if weight is None:
            wrow, denom = None, float(n)
        else:
            w, denom = per_sample_weight(weight, xp.empty(logits.shape[:-1], dtype=np.float32))
            wrow = xp.ascontiguousarray(xp.broadcast_to(w, logits.shape[:-1]).reshape(-1), np.float32)
        lse, nll = k.cross_entropy_forward(logits.reshape(-1, v), t, wrow, buf.get("lse", (n,), np.float32, xp),
                                           buf.get("nll", (n,), np.float32, xp))
        self.cache = ("gpu", logits, t, wrow, lse, denom, None)
        if is_device_array(denom):
            return batch_mean(nll.sum(), denom)
        return k.sum_scaled(nll, 1.0 / denom if denom else 0.0, buf.get("loss", (), np.float32, xp))

    def _backward_gpu(self, scale: float) -> Any:
        _, logits, t, wrow, lse, denom, done = self.cache
        coef = scale / nonzero(denom) if not all_weights_zero(denom) else 0.0
        if done is not None:  # a second backward of one forward: the gradient is already there
            if not (is_device_array(done) or done):
                raise RuntimeError("CrossEntropyLoss.backward again after a backward with scale 0: the GPU path "
                                   "wrote that gradient over the logits")
            logits *= coef / done
        else:
            c = coef.astype(np.float32) if is_device_array(coef) else float(coef)
            g2 = logits.reshape(-1, logits.shape[-1])
            gpu.usable(logits).cross_entropy_backward(g2, t, lse, wrow, c, g2)
        self.cache = (*self.cache[:6], coef)
        return logits

    def backward(self, scale: float = 1.0) -> Any:
        if isinstance(self.cache[0], str):  # ("gpu", ...): the kernel path's forward
            return self._backward_gpu(scale)
        probs, target, w, denom = self.cache
        xp = xp_of(probs)
        # A copy: backward may run again (another scale) on the same forward.
        g = self._buffers.like("g", probs)
        g[...] = probs
        if all_weights_zero(denom):
            g *= 0
            return g if self._low is None else g.astype(self._low)
        onehot_at = xp.take_along_axis(g, target[..., None], axis=-1) - 1
        xp.put_along_axis(g, target[..., None], onehot_at, axis=-1)
        g *= scale / nonzero(denom)
        if w is not None:
            g *= w[..., None]
        return g if self._low is None else g.astype(self._low)
