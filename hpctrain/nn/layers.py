"""Basic layers with explicit forward/backward on NumPy or CuPy arrays; called on a tensor, each is
one fused node of the autograd graph (``hpctrain.nn.layer_nodes``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import add_at, is_half, matmul, to_device, xp_of
from . import fused, gpu
from .buffers import Buffers
from .dropout import Dropout, dropout_problem  # noqa: F401 - their home was here
from .kernels import gelu_backward, gelu_forward, layer_norm_backward, layer_norm_forward, row_ones
from .module import Module, Parameter, as_rng


def add_bias_grad(bias: Parameter, g2: Any, buffers: Buffers, dtype: Any) -> None:
    """``bias.grad +=`` the column sums of the ``(rows, d)`` gradient ``g2``, as a vector-matrix
    product (BLAS) into ``buffers``' array of ``dtype``."""
    xp = xp_of(g2)
    ones = row_ones(g2.shape[0], g2.dtype, xp)
    bias.grad += matmul(xp, ones, g2, out=buffers.get("gb", (g2.shape[1],), dtype, xp))


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(d_in, d_out)``.

    Initialised like the common reference (uniform in +-1/sqrt(d_in)) from ``rng`` (a seed or a
    ``numpy.random.Generator``), in ``dtype`` (float32 by default).
    """

    fused_node = True  # on a tensor: one node of its own forward/backward (nn.layer_nodes)

    def __init__(
        self,
        d_in: int,
        d_out: int,
        bias: bool = True,
        rng: int | np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        if d_in < 1 or d_out < 1:
            raise ValueError(f"Linear needs positive sizes, got d_in={d_in}, d_out={d_out}")
        g = as_rng(rng)
        bound = 1.0 / np.sqrt(d_in)
        self.d_in, self.d_out = d_in, d_out
        self.weight = Parameter(g.uniform(-bound, bound, (d_in, d_out)).astype(dtype))
        self.bias = Parameter(g.uniform(-bound, bound, (d_out,)).astype(dtype)) if bias else None
        self.cache = None

    @classmethod
    def borrowing(cls, weight: Parameter, bias: Parameter | None) -> Linear:
        """A Linear that computes with ``weight`` ``(d_in, d_out)`` and ``bias`` that another module
        owns and registers under its own names (a tensor-parallel layer holds its slice under the
        serial names): shared, not copied, and not listed among this Linear's parameters."""
        lin = cls.__new__(cls)
        d = lin.__dict__  # past Module.__setattr__: no registration here
        d["weight"], d["bias"], d["cache"] = weight, bias, None
        d["d_in"], d["d_out"] = weight.shape
        return lin

    def forward(self, x: Any, add_bias: bool = True) -> Any:
        """``x @ weight + bias``; ``add_bias=False`` leaves the bias to the caller (the MLP adds it
        inside the GELU kernel on the GPU); the backward is the same either way."""
        if x.shape[-1] != self.d_in:
            raise ValueError(f"Linear({self.d_in}, {self.d_out}) got input of shape {x.shape}")
        self.cache = x
        xp, w = xp_of(x), self.weight.data
        b = self.bias.data if self.bias is not None and add_bias else None
        k = gpu.usable(x, w, *(() if b is None else (b,))) if x.dtype == w.dtype else None
        if k is not None:  # cuBLAS called directly (capturable), the bias added by one kernel
            y = self.scratch_buffers().get("y", (*x.shape[:-1], self.d_out), x.dtype, xp)
            k.matmul(x.reshape(-1, self.d_in), w, y.reshape(-1, self.d_out))
            if b is not None:
                k.bias_add(y.reshape(-1, self.d_out), b)
            return y
        # One 2-D matrix product over every row (B*T of them), written into a reused buffer: a 3-D
        # product would be one small product per batch entry.
        y = self.scratch_buffers().get("y", (*x.shape[:-1], self.d_out), np.result_type(x.dtype, w.dtype), xp)
        matmul(xp, x.reshape(-1, self.d_in), w, out=y.reshape(-1, self.d_out))
        if self.bias is not None and add_bias:
            y += self.bias.data
        return y

    def backward(self, grad_out: Any) -> Any:
        x = self.cache
        xp, w = xp_of(grad_out), self.weight.data
        x2 = x.reshape(-1, self.d_in)
        g2 = grad_out.reshape(-1, self.d_out)
        bias = self.bias
        k = gpu.usable(grad_out, x, w, self.weight.grad, *(() if bias is None else (bias.grad,))) \
            if grad_out.dtype == x.dtype == w.dtype else None
        if k is not None:  # the weight gradient accumulated by the product itself (beta 1), no copy
            k.matmul(x2.T, g2, self.weight.grad, beta=1.0)
            if bias is not None:
                k.col_sum(g2, bias.grad)
            gx = gpu.shared.get("linear_gx", (*grad_out.shape[:-1], self.d_in), grad_out.dtype, xp)
            return k.matmul(g2, w.T, gx.reshape(-1, self.d_in)).reshape(gx.shape)
        buf = self.scratch_buffers()
        gw = buf.get("gw", w.shape, np.result_type(x.dtype, grad_out.dtype), xp)
        self.weight.grad += matmul(xp, x2.T, g2, out=gw)  # x2.T is a view: BLAS reads it transposed
        if self.bias is not None:
            add_bias_grad(self.bias, g2, buf, gw.dtype)
        gx = buf.get("gx", (*grad_out.shape[:-1], self.d_in), np.result_type(grad_out.dtype, w.dtype), xp)
        matmul(xp, g2, w.T, out=gx.reshape(-1, self.d_in))
        return gx

    def extra_repr(self) -> str:
        return f"{self.d_in}, {self.d_out}, bias={self.bias is not None}"


class TiedLinear(Module):
    """``y = x @ weight.T`` with ``weight`` ``(d_out, d_in)`` a ``Parameter`` another module owns: a
    lookup table used as an output layer (the GPT's tied head, ``weight`` its token embedding's).
    No bias. The weight is registered here too, so this module alone (a pipeline's last stage)
    still lists it; a model that holds both lists it once, under its first name (the owner's).
    It computes through a ``Linear`` over transposed views of the table and of its gradient (made
    at each call: a ZeRO gather may replace the arrays), so its backward adds into the same
    ``.grad`` the owner's does: the two gradients sum."""

    fused_node = True  # on a tensor: one node of its own forward/backward (nn.layer_nodes)

    def __init__(self, weight: Parameter) -> None:
        if not isinstance(weight, Parameter) or weight.ndim != 2:
            raise TypeError(f"TiedLinear takes a 2-D Parameter (d_out, d_in), got {type(weight).__name__}")
        self.weight = weight
        self.d_out, self.d_in = weight.shape
        view = Parameter(weight.data.T)
        view.grad = None
        self.__dict__["linear"] = Linear.borrowing(view, None)  # unregistered: the weight is listed once
        self.cache = None

    def _bound(self) -> Linear:
        lin, w = self.__dict__["linear"], self.weight
        lin.weight.data = w.data.T
        lin.weight.grad = None if w.grad is None else w.grad.T
        return lin

    def forward(self, x: Any) -> Any:
        lin = self._bound()
        y = lin.forward(x)
        self.cache, lin.__dict__["cache"] = lin.cache, None
        return y

    def backward(self, grad_out: Any) -> Any:
        lin = self._bound()
        lin.__dict__["cache"] = self.cache
        try:
            return lin.backward(grad_out)
        finally:
            lin.__dict__["cache"] = None

    def extra_repr(self) -> str:
        return f"{self.d_in}, {self.d_out}, tied"


class ReLU(Module):
    """``max(x, 0)``; the gradient at exactly 0 is taken as 0."""

    fused_node = True  # on a tensor: one node of its own forward/backward (nn.layer_nodes)

    def __init__(self, rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        # rng and dtype are accepted so every layer shares one constructor signature; unused.
        self.cache = None

    def forward(self, x: Any) -> Any:
        mask = x > 0
        self.cache = mask
        return x * mask

    def backward(self, grad_out: Any) -> Any:
        return grad_out * self.cache




class GELU(Module):
    """GELU in the tanh approximation of GPT-2: ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``."""

    fused_node = True  # on a tensor: one node of its own forward/backward (nn.layer_nodes)

    def __init__(self, rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        # rng and dtype are accepted so every layer shares one constructor signature; unused.
        self.cache = None

    def forward(self, x: Any, bias: Any = None) -> Any:
        """GELU of ``x`` (of ``x + bias`` with a bias: a GPU kernel path only, see ``MLP``)."""
        y, x, t = gelu_forward(x, self.scratch_buffers(), bias)
        self.cache = (x, t)
        return y

    def backward(self, grad_out: Any) -> Any:
        x, t = self.cache
        return gelu_backward(grad_out, x, t, self.scratch_buffers())


class Tanh(Module):
    """Elementwise ``tanh``."""

    fused_node = True  # on a tensor: one node of its own forward/backward (nn.layer_nodes)

    def __init__(self, rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        # rng and dtype are accepted so every layer shares one constructor signature; unused.
        self.cache = None

    def forward(self, x: Any) -> Any:
        y = xp_of(x).tanh(x)
        self.cache = y
        return y

    def backward(self, grad_out: Any) -> Any:
        y = self.cache
        return grad_out * (1.0 - y * y)


class LayerNorm(Module):
    """Normalises the last axis to zero mean and unit variance, then ``* weight + bias``.

    ``weight`` starts at ones and ``bias`` at zeros; the variance is the biased one (as in the
    common reference), ``eps`` is added to it.
    """

    fused_node = True  # on a tensor: one node of its own forward/backward (nn.layer_nodes)

    def __init__(
        self,
        d: int,
        eps: float = 1e-5,
        rng: int | np.random.Generator | None = None,
        dtype: Any = np.float32,
    ) -> None:
        if d < 1:
            raise ValueError(f"LayerNorm needs a positive size, got {d}")
        # rng is accepted for a uniform constructor signature; the initialisation is deterministic.
        self.d, self.eps = d, eps
        self.weight = Parameter(np.ones(d, dtype=dtype))
        self.bias = Parameter(np.zeros(d, dtype=dtype))
        self.cache = None

    def forward(self, x: Any) -> Any:
        if x.shape[-1] != self.d:
            raise ValueError(f"LayerNorm({self.d}) got input of shape {x.shape}")
        y, self.cache = layer_norm_forward(x, self.weight.data, self.bias.data, self.eps, self.scratch_buffers())
        return y

    def backward(self, grad_out: Any) -> Any:
        return layer_norm_backward(grad_out, self.cache, self.weight.data, self.weight.grad, self.bias.grad,
                                   self.scratch_buffers())

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


def scatter_add(target: Any, index: Any, values: Any) -> None:
    """``target[index] += values`` with repeated indices accumulated (numpy or cupy).

    On NumPy the rows are summed per distinct index first (a stable sort, then one ``reduceat``
    over the sorted rows), which is several times faster than ``np.add.at`` and, into zeroed
    gradients, gives the same sums to rounding; the fused kernel (``hpctrain.nn.fused``), when on,
    adds the rows one after another in one pass, as ``np.add.at`` does. CuPy adds atomically on
    the device.
    """
    xp = xp_of(target)
    if xp is np:
        if index.size == 0:
            return
        k = fused.usable(target, values) if target.ndim == values.ndim == 2 else None
        if k is not None and index.dtype.kind in "iu" and index.shape == values.shape[:1]:
            k.scatter_rows(target, index, values)  # one pass, the rows in order (as np.add.at)
            return
        order = np.argsort(index, kind="stable")
        ids = index[order]
        starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
        # In the target's dtype: a float32 gradient of 16-bit rows sums many of them in float32.
        sums = np.add.reduceat(values[order], starts, axis=0, dtype=target.dtype)
        target[ids[starts]] += sums
        return
    k = gpu.usable(target, values) if target.dtype == np.float32 and values.ndim == 2 else None
    if k is not None and index.dtype == np.int64 and index.shape == values.shape[:1]:
        k.embedding_backward(xp.ascontiguousarray(index), values, target)  # float32 atomics
        return
    add_at(target, index, values)  # CuPy adds atomically on the device


def batch_positions(positions: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """The ``(T,)`` ``positions`` a graph's lookup of a ``dtype`` table takes for tokens of ``shape``
    ``(B, T)``: broadcast to it for a 16-bit table, so that the lookup's own backward sums the
    batch into its (float32, under a mixed precision) gradient, where the gradient of a ``(T,)``
    lookup broadcast over the batch by an add is summed in 16 bits and overflows under fp16's loss
    scale; as they are otherwise (a batch sum is cheaper than a scatter of every row)."""
    return xp_of(positions).broadcast_to(positions, shape) if is_half(dtype) else positions


def check_indices(idx: Any, n: int, who: str) -> Any:
    """``idx`` when it holds integer row indices of a table of ``n`` rows: ``TypeError`` for
    another dtype, ``IndexError`` naming the range found for one outside ``[0, n)`` (a read of
    two numbers, which on a GPU waits for it; skipped while a CUDA graph is captured, as a capture
    reads nothing back: the indices were checked in its warm-up step)."""
    if idx.dtype.kind not in "iu":
        raise TypeError(f"{who} needs integer indices, got {idx.dtype}")
    if idx.size and not gpu.capturing and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise IndexError(f"{who}: indices must be in [0, {n}), got range [{int(idx.min())}, {int(idx.max())}]")
    return idx


class Embedding(Module):
    """Lookup table: ``forward(idx)`` with integer ``idx`` of any shape returns ``(*idx.shape, d)``.

    ``weight`` (n, d) starts as N(0, std^2) (std=1 as in the common reference). ``backward``
    accumulates the row gradients and returns ``None`` (token ids have no gradient).
    """

    fused_node = True  # on a tensor: one node of its own forward/backward (nn.layer_nodes)

    def __init__(
        self,
        n: int,
        d: int,
        rng: int | np.random.Generator | None = None,
        dtype: Any = np.float32,
        *,
        std: float = 1.0,
    ) -> None:
        if n < 1 or d < 1:
            raise ValueError(f"Embedding needs positive sizes, got n={n}, d={d}")
        self.n, self.d = n, d
        self.weight = Parameter((as_rng(rng).standard_normal((n, d)) * std).astype(dtype))
        self.cache = None

    def forward(self, idx: Any) -> Any:
        xp = xp_of(self.weight.data)
        idx = check_indices(to_device(idx, xp), self.n, f"Embedding({self.n}, {self.d})")
        self.cache = idx
        out = self.scratch_buffers().get("y", (*idx.shape, self.d), self.weight.data.dtype, xp)
        xp.take(self.weight.data, idx, axis=0, out=out)
        return out

    def backward(self, grad_out: Any) -> None:
        idx = self.cache
        scatter_add(self.weight.grad, idx.reshape(-1), grad_out.reshape(-1, self.d))
        return None

    def extra_repr(self) -> str:
        return f"{self.n}, {self.d}"
