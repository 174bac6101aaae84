"""Mixed precision: which dtype each kind of array has, and fp16's dynamic loss scaling.

``Precision`` names the four dtypes of a training step (Lightning's names for the policies):

============  ===========  ===========  ==========================  ============
policy        parameters   compute      gradients (reduced in)      masters
============  ===========  ===========  ==========================  ============
fp32          float32      float32      float32                     (none)
fp64          float64      float64      float64                     (none)
bf16-mixed    bfloat16     bfloat16     float32 (or ``bf16``)       float32
fp16-mixed    float16      float16      float32 (or ``bf16``/fp16)  float32
============  ===========  ===========  ==========================  ============

Under a mixed policy the model's parameters hold the 16-bit copy the forward and backward
compute with; the optimizer (or ZeRO's sharded update) keeps float32 *masters* and its state in
float32, updates the masters with the float32 gradient and rounds them into the parameters.
Gradients accumulate in and are all-reduced in ``reduce`` (float32 by default: 16-bit sums over
many ranks lose the small contributions). Loss, softmax and LayerNorm statistics are computed in
float32 whatever the compute dtype (``stat_dtype``). ``fp64`` is not for speed: the trainer casts
the (float32) parameters to float64 once, so parameters, activations, gradients, their reduction
and the optimizer state are float64, and runs that should agree (1 and N ranks, dp and a pipeline)
agree to ~1e-12 where float32 drifts apart by rounding: the check that a difference is rounding,
not a bug. (``fp32`` means the parameters' own dtype: a model built in float64 trains in float64
under it too.) fp16 has a narrow exponent range: its
policy carries a ``DynamicLossScaler`` (the loss gradient is multiplied by the scale; a step
whose gradients overflow is skipped on every rank and the scale backs off).

The dtypes themselves and the 16-bit array helpers the layers use (``BF16``, ``is_half``,
``stat_dtype``, ``matmul``, ``widen``) are ``hpctrain.backend``'s, below ``nn``; this module is the
training side's policy, above ``nn`` (its masters are ``nn.Parameter``s). On NumPy, 16-bit
``matmul`` goes through float32 BLAS: the CPU path is for correctness and CI, not speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..autograd.function import differentiable
from ..backend import BF16, FP16, FP32, xp_of
from ..errors import Say, as_argument
from ..nn.module import Parameter

PRECISIONS = ("fp32", "fp64", "bf16-mixed", "fp16-mixed")
FP64 = np.dtype(np.float64)
_UNMIXED = ("fp32", "fp64")  # no masters, no loss scale: the parameters' own dtype throughout
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
_NAMED = {"fp32": FP32, "bf16": BF16, "fp16": FP16}
# What a refusal of fp32 with a 16-bit reduce adds for a library caller (the flags have no compression=).
_REDUCE_HINT = ("a 16-bit reduce needs a mixed precision: fp32 reduces in fp32; for 16-bit all-reduces of fp32 "
                "gradients use compression=")


def precision_problem(name: str, grad_reduce_dtype: str, say: Say = as_argument) -> str | None:
    """Why ``Precision(name, grad_reduce_dtype)`` is refused (``None``: it is not), in ``say``'s
    names: the one place of these rules (``hpctrain train``'s config asks it with its flags)."""
    if name not in PRECISIONS:
        return f"{say('precision')} must be one of {PRECISIONS}, got {name!r}"
    if grad_reduce_dtype not in REDUCE_DTYPES:
        return f"{say('grad_reduce_dtype')} must be one of {REDUCE_DTYPES}, got {grad_reduce_dtype!r}"
    if name in _UNMIXED and grad_reduce_dtype != "fp32":
        return f"{say('grad_reduce_dtype', grad_reduce_dtype)} needs {say('precision')} bf16-mixed or fp16-mixed"
    if name == "bf16-mixed" and grad_reduce_dtype == "fp16":
        return f"{say('precision', name)} gradients can overflow fp16: {say('grad_reduce_dtype')} fp32 or bf16"
    return None


class DynamicLossScaler:
    """fp16's loss scale: multiply the loss gradient by ``scale``; on an overflow (a non-finite
    gradient on any rank) the step is skipped and the scale multiplied by ``backoff``; after
    ``interval`` clean steps in a row it is multiplied by ``growth``. Scales stay powers of two
    so scaling and unscaling are exact.

    Stateful (``state_dict``/``load_state_dict``/``snapshot``/``restore``): the scale and the
    clean-step count are part of a checkpoint.
    """

    def __init__(self, init_scale: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000, min_scale: float = 1.0) -> None:  # fmt: skip
        for name, v in (("init_scale", init_scale), ("min_scale", min_scale)):
            if not (v > 0 and math.isfinite(v) and math.log2(v) == int(math.log2(v))):
                raise ValueError(f"{name} must be a positive power of two, got {v!r}")
        if growth not in (2.0, 4.0) or backoff not in (0.5, 0.25):
            raise ValueError(f"growth must be 2 or 4 and backoff 0.5 or 0.25 (exact), got {growth}, {backoff}")
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be a positive integer, got {interval!r}")
        self.scale, self.growth, self.backoff = float(init_scale), float(growth), float(backoff)
        self.interval, self.min_scale = interval, float(min_scale)
        self.good_steps = 0
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        """After a step (every rank with the same ``overflow``): back off or count towards growth."""
        if overflow:
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.good_steps = 0
            self.overflows += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.interval:
            self.scale *= self.growth
            self.good_steps = 0

    def config(self) -> dict[str, Any]:
        return {"growth": self.growth, "backoff": self.backoff, "interval": self.interval,
                "min_scale": self.min_scale}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scale = float(state["scale"])
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"loss scaler state has scale {scale!r}")
        self.scale, self.good_steps = scale, int(state["good_steps"])
        self.overflows = int(state.get("overflows", 0))

    def snapshot(self) -> dict[str, Any]:
        return self.state_dict()

    def restore(self, snap: dict[str, Any]) -> None:
        self.load_state_dict(snap)


@dataclass
class Precision:
    """The dtypes of a step (see the module docstring) and fp16's loss scaler.

    ``Precision.of("bf16-mixed", grad_reduce_dtype="fp32")``; ``Precision.of(p)`` of a
    ``Precision`` returns it.
    """

    name: str = "fp32"
    grad_reduce_dtype: str = "fp32"
    scaler: DynamicLossScaler | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        problem = precision_problem(self.name, self.grad_reduce_dtype)
        if problem is not None:
            fp32_with_16bit = self.name == "fp32" and self.grad_reduce_dtype in REDUCE_DTYPES
            raise ValueError(f"{problem} ({_REDUCE_HINT})" if fp32_with_16bit else problem)
        if self.name == "fp16-mixed" and self.scaler is None:
            self.scaler = DynamicLossScaler()

    @classmethod
    def of(cls, precision: str | Precision | None, grad_reduce_dtype: str | None = None) -> Precision:
        if isinstance(precision, Precision):
            return precision
        return cls(precision or "fp32", grad_reduce_dtype or "fp32")

    @property
    def mixed(self) -> bool:
        return self.name not in _UNMIXED

    @property
    def param(self) -> np.dtype:
        """The dtype of the model's parameters (what forward and backward read)."""
        return {"fp32": FP32, "fp64": FP64, "bf16-mixed": BF16, "fp16-mixed": FP16}[self.name]

    @property
    def compute(self) -> np.dtype:
        return self.param

    @property
    def reduce(self) -> np.dtype:
        """The dtype gradients accumulate in and are all-reduced in."""
        return FP64 if self.name == "fp64" else _NAMED[self.grad_reduce_dtype]

    @property
    def master(self) -> np.dtype:
        return FP32

    @property
    def loss_scale(self) -> float:
        """The factor the loss gradient is multiplied by this step (1 without a scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def config(self) -> dict[str, Any]:
        """Settings every rank must share (and checkpoints record)."""
        if self.name == "fp64":  # reduces in float64: no grad_reduce_dtype to record
            return {"precision": self.name}
        return {"precision": self.name, "grad_reduce_dtype": self.grad_reduce_dtype,
                **({"loss_scaler": self.scaler.config()} if self.scaler is not None else {})}  # fmt: skip

    def cast(self, params: list[Any]) -> None:
        """``fp64``: every floating-point parameter cast to float64, its gradient a float64 zero
        (the optimizer's state, made at its first step, follows). Other policies: nothing here
        (mixed ones cast in ``make_masters``). Every rank casts alike: call it on identical
        parameters, before the gradient buffers are laid out."""
        if self.name != "fp64":
            return
        for p in params:
            if differentiable(p.data.dtype) and p.data.dtype != FP64:
                p.data = p.data.astype(FP64)
                p.grad = _zeros(p, FP64)

    def make_masters(self, params: list[Any]) -> dict[str, Any]:
        """Float32 master copies of ``params`` (by name), then the parameters cast to ``param``
        and their gradients to ``reduce`` (zeros). Call while the parameters still hold float32
        values: the masters start from them, not from their 16-bit rounding."""
        masters = {}
        for p in params:
            if np.dtype(p.dtype) != FP32:
                raise TypeError(f"precision={self.name!r} starts from float32 parameters; {p.name} is {p.dtype}")
            master = Parameter(p.data.astype(FP32, copy=True), name=p.name)
            master.grad = None  # the optimizer lends it the parameter's gradient during an update
            masters[p.name] = master
            p.data = p.data.astype(self.param)
            p.grad = _zeros(p, self.reduce)
        return masters


def _zeros(p: Any, dtype: np.dtype) -> Any:
    return xp_of(p.data).zeros(p.shape, dtype=dtype)
