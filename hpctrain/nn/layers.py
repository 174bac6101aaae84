"""Basic layers with explicit forward/backward on NumPy or CuPy arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import is_half, matmul, to_device, xp_of
from . import fused, gpu
from .buffers import Buffers
from .dropout import Dropout, dropout_problem  # noqa: F401 - their home was here
from .module import Module, Parameter, as_rng

# sqrt(2 / pi), the constant of GPT-2's tanh approximation of GELU.
_GELU_C = float(np.sqrt(2.0 / np.pi))


_ONES: dict[tuple, Any] = {}


def row_ones(n: int, dtype: Any, xp: Any) -> Any:
    """A cached vector of ``n`` ones of ``dtype`` (module ``xp``): sums along an axis as a
    matrix-vector product go through BLAS, several times faster than NumPy's reduction along a
    short axis."""
    key = (n, np.dtype(dtype), xp.__name__)
    ones = _ONES.get(key)
    if ones is None:
        if len(_ONES) > 32:
            _ONES.clear()
        ones = _ONES[key] = xp.ones(n, dtype=dtype)
    return ones


#: Elements per chunk of the elementwise layers on NumPy: a few arrays of this size stay in a
#: core's L2 cache while several passes run over them (one pass over arrays in L3 or memory each
#: time costs up to twice as much).
CHUNK = 1 << 17


def add_bias_grad(bias: Parameter, g2: Any, buffers: Buffers, dtype: Any) -> None:
    """``bias.grad +=`` the column sums of the ``(rows, d)`` gradient ``g2``, as a vector-matrix
    product (BLAS) into ``buffers``' array of ``dtype``."""
    xp = xp_of(g2)
    ones = row_ones(g2.shape[0], g2.dtype, xp)
    bias.grad += matmul(xp, ones, g2, out=buffers.get("gb", (g2.shape[1],), dtype, xp))


def row_chunks(xp: Any, *arrays: Any) -> Any:
    """Yield tuples of matching row slices of ``arrays`` (same shape; viewed as 2-D over the last
    axis) of about ``CHUNK`` elements each; on another array module (CuPy) the whole arrays at once,
    as one kernel per pass is what a GPU wants."""
    if xp is not np or arrays[0].size <= CHUNK:
        yield arrays
        return
    cols = arrays[0].shape[-1] if arrays[0].ndim else 1
    flat = [a.reshape(-1, cols) for a in arrays]
    rows = max(1, CHUNK // max(cols, 1))
    for s in range(0, flat[0].shape[0], rows):
        yield tuple(f[s : s + rows] for f in flat)


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(d_in, d_out)``.

    Initialised like the common reference (uniform in +-1/sqrt(d_in)) from ``rng`` (a seed or a
    ``numpy.random.Generator``), in ``dtype`` (float32 by default).
    """

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
            y = self._scratch().get("y", (*x.shape[:-1], self.d_out), x.dtype, xp)
            k.matmul(x.reshape(-1, self.d_in), w, y.reshape(-1, self.d_out))
            if b is not None:
                k.bias_add(y.reshape(-1, self.d_out), b)
            return y
        # One 2-D matrix product over every row (B*T of them), written into a reused buffer: a 3-D
        # product would be one small product per batch entry.
        y = self._scratch().get("y", (*x.shape[:-1], self.d_out), np.result_type(x.dtype, w.dtype), xp)
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
        buf = self._scratch()
        gw = buf.get("gw", w.shape, np.result_type(x.dtype, grad_out.dtype), xp)
        self.weight.grad += matmul(xp, x2.T, g2, out=gw)  # x2.T is a view: BLAS reads it transposed
        if self.bias is not None:
            add_bias_grad(self.bias, g2, buf, gw.dtype)
        gx = buf.get("gx", (*grad_out.shape[:-1], self.d_in), np.result_type(grad_out.dtype, w.dtype), xp)
        matmul(xp, g2, w.T, out=gx.reshape(-1, self.d_in))
        return gx

    def extra_repr(self) -> str:
        return f"{self.d_in}, {self.d_out}, bias={self.bias is not None}"


class ReLU(Module):
    """``max(x, 0)``; the gradient at exactly 0 is taken as 0."""

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

    def __init__(self, rng: int | np.random.Generator | None = None, dtype: Any = np.float32) -> None:
        # rng and dtype are accepted so every layer shares one constructor signature; unused.
        self.cache = None

    def forward(self, x: Any, bias: Any = None) -> Any:
        """GELU of ``x`` (of ``x + bias`` with a bias: a GPU kernel path only, see ``MLP``)."""
        xp = xp_of(x)
        buf = self._scratch()
        k = gpu.usable(x, *(() if bias is None else (bias,)))
        if k is not None:  # one kernel; backward recomputes the tanh from x (nothing else kept)
            y = buf.like("y", x)
            k.gelu_forward(x, bias, y)
            self.cache = (x, None)
            return y
        if bias is not None:
            x = x + bias
        t = buf.like("t", x)
        y = buf.like("y", x)
        self.cache = (x, t)
        k = fused.usable(x, t, y)
        if k is not None:  # the same operations fused around NumPy's vectorised tanh, chunk by chunk
            kc, c, one, half = fused.scalars(x.dtype, 0.044715 * _GELU_C, _GELU_C, 1.0, 0.5)
            xf, tf, yf = x.reshape(-1), t.reshape(-1), y.reshape(-1)
            for s in range(0, xf.size, CHUNK):
                xs, ts = xf[s : s + CHUNK], tf[s : s + CHUNK]
                k.gelu_inner(xs, ts, kc, c)
                np.tanh(ts, out=ts)
                k.gelu_outer(xs, ts, yf[s : s + CHUNK], one, half)
            return y
        # In place and in row chunks that stay in the core's cache while the eight passes run
        # over them: tanh(x (c + 0.044715 c x^2)), then 0.5 x (1 + t).
        for xs, ts, ys in row_chunks(xp, x, t, y):
            xp.multiply(xs, xs, out=ts)
            ts *= 0.044715 * _GELU_C
            ts += _GELU_C
            ts *= xs
            xp.tanh(ts, out=ts)
            xp.add(ts, 1.0, out=ys)
            ys *= xs
            ys *= 0.5
        return y

    def backward(self, grad_out: Any) -> Any:
        x, t = self.cache
        xp = xp_of(x)
        buf = self._scratch()
        # d/dx = 0.5 ((1 + t) + x (1 - t^2) c (1 + 3 * 0.044715 x^2)), by row chunks as forward.
        if t is None:  # the GPU kernel's forward kept x only
            g = grad_out if grad_out.dtype == x.dtype else grad_out.astype(x.dtype)
            return gpu.usable(x).gelu_backward(x, xp.ascontiguousarray(g), gpu.shared.like("gelu_gx", x))
        a = buf.get("gx", x.shape, np.result_type(x.dtype, grad_out.dtype), xp)
        k = fused.usable(x, t, grad_out, a) if grad_out.shape == x.shape else None
        if k is not None:  # one pass instead of ten
            k.gelu_backward(x.reshape(-1), t.reshape(-1), grad_out.reshape(-1), a.reshape(-1),
                            *fused.scalars(x.dtype, 0.134145 * _GELU_C, _GELU_C, 1.0, 0.5))
            return a
        for xs, ts, gs, ys in row_chunks(xp, x, t, grad_out, a):
            b = buf.get("tmp", xs.shape, x.dtype, xp)
            xp.multiply(xs, xs, out=ys)
            ys *= 0.134145 * _GELU_C
            ys += _GELU_C
            xp.multiply(ts, ts, out=b)
            xp.subtract(1.0, b, out=b)
            ys *= b
            ys *= xs
            ys += ts
            ys += 1.0
            ys *= 0.5
            ys *= gs
            del b
        return a


class Tanh(Module):
    """Elementwise ``tanh``."""

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
        w, b = self.weight.data, self.bias.data
        k = gpu.usable(x, w, b) if x.dtype == w.dtype == b.dtype else None
        if k is not None:  # one block per row, float32 statistics; x, mean and rstd kept
            buf, xp, n = self._scratch(), xp_of(x), x.size // self.d
            y = buf.like("y", x)
            stats = (buf.get("mean", (n,), np.float32, xp), buf.get("rstd", (n,), np.float32, xp))
            mean, rstd = k.layernorm_forward(x.reshape(-1, self.d), w, b, self.eps, y.reshape(-1, self.d), *stats)
            self.cache = (x, mean, rstd)
            return y
        if is_half(x.dtype):  # mixed precision: statistics in float32, the output rounded back
            return self._forward(x.astype(np.float32), w.astype(np.float32), b.astype(np.float32)).astype(x.dtype)
        return self._forward(x, w, b)

    def _forward(self, x: Any, w: Any, b: Any) -> Any:
        xp = xp_of(x)
        buf = self._scratch()
        d = self.d
        x2 = x.reshape(-1, d)
        n = x2.shape[0]
        k = fused.usable(x, w, b)
        if k is not None:  # one pass over each row (see hpctrain.nn.fused)
            xhat, rstd = buf.like("xhat", x), buf.get("rstd", (n, 1), x.dtype, xp)
            y = buf.like("y", x)
            k.layernorm_forward(x2, w, b, *fused.scalars(x.dtype, self.eps), xhat.reshape(-1, d), rstd.reshape(-1),
                                y.reshape(-1, d))
            self.cache = (xhat, rstd)
            return y
        ones = row_ones(d, x.dtype, xp)
        # Row sums as matrix-vector products (BLAS; a reduction along a short last axis is several
        # times slower), everything else in place in reused buffers.
        mu = xp.matmul(x2, ones, out=buf.get("mu", (n,), x.dtype, xp))
        mu /= d
        xhat = buf.like("xhat", x)
        xh2 = xhat.reshape(-1, d)
        xp.subtract(x2, mu[:, None], out=xh2)
        sq = buf.like("sq", x).reshape(-1, d)
        xp.multiply(xh2, xh2, out=sq)
        var = xp.matmul(sq, ones, out=buf.get("var", (n,), x.dtype, xp))
        var /= d
        var += self.eps
        xp.sqrt(var, out=var)
        rstd = xp.divide(1.0, var[:, None], out=buf.get("rstd", (n, 1), x.dtype, xp))
        xh2 *= rstd
        self.cache = (xhat, rstd)
        y = buf.get("y", x.shape, np.result_type(x.dtype, w.dtype), xp)
        xp.multiply(xhat, w, out=y)
        y += b
        return y

    def backward(self, grad_out: Any) -> Any:
        w = self.weight.data
        if len(self.cache) == 3:  # the GPU kernels' forward
            x, mean, rstd = self.cache
            g = grad_out if grad_out.dtype == x.dtype else grad_out.astype(x.dtype)
            g = xp_of(g).ascontiguousarray(g)
            gx = gpu.shared.like("ln_gx", x)
            k = gpu.usable(x, g, self.weight.grad, self.bias.grad)
            k.layernorm_backward(g.reshape(-1, self.d), x.reshape(-1, self.d), w, mean, rstd, gx.reshape(-1, self.d),
                                 self.weight.grad, self.bias.grad)
            return gx
        if is_half(grad_out.dtype):  # as forward: in float32, the input gradient rounded back
            return self._backward(grad_out.astype(np.float32), w.astype(np.float32)).astype(grad_out.dtype)
        return self._backward(grad_out, w)

    def _backward(self, grad_out: Any, w: Any) -> Any:
        xhat, rstd = self.cache
        xp = xp_of(grad_out)
        buf = self._scratch()
        d = self.d
        dtype = np.result_type(grad_out.dtype, xhat.dtype)
        g2 = grad_out.reshape(-1, d)
        xh2 = xhat.reshape(-1, d)
        n = g2.shape[0]
        k = fused.usable(grad_out, xhat, rstd, w, self.weight.grad, self.bias.grad)
        if k is not None and grad_out.shape == xhat.shape:  # one pass over each row
            gx = buf.like("gx", grad_out)
            k.layernorm_backward(g2, xh2, rstd.reshape(-1), w, self.weight.grad, self.bias.grad, gx.reshape(-1, d))
            return gx
        ones = row_ones(n, grad_out.dtype, xp)
        tmp = buf.get("tmp", g2.shape, dtype, xp)
        xp.multiply(g2, xh2, out=tmp)
        # Column sums (parameter gradients) and row sums as matrix-vector products. With gx =
        # grad_out * weight, the rows' mean of gx is (grad_out @ weight) / d and the rows' mean of
        # gx * xhat is ((grad_out * xhat) @ weight) / d: no pass over gx needed for either.
        self.weight.grad += xp.matmul(ones, tmp, out=buf.get("gw", (d,), dtype, xp))
        self.bias.grad += xp.matmul(ones, g2, out=buf.get("gb", (d,), grad_out.dtype, xp))
        wd = np.result_type(dtype, w.dtype)
        mean_gx = xp.matmul(tmp, w, out=buf.get("mgx", (n,), wd, xp))
        mean_gx /= d
        mean_g = xp.matmul(g2, w, out=buf.get("mg", (n,), wd, xp))
        mean_g /= d
        gx = buf.get("gx", grad_out.shape, np.result_type(grad_out.dtype, w.dtype), xp)
        gx2 = gx.reshape(-1, d)
        xp.multiply(g2, w, out=gx2)
        # Gradient through the normalisation: remove the mean and the component along xhat.
        xp.multiply(xh2, mean_gx[:, None], out=tmp)
        gx2 -= mean_g[:, None]
        gx2 -= tmp
        gx2 *= rstd
        return gx

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
        sums = np.add.reduceat(values[order], starts, axis=0)
        target[ids[starts]] += sums
        return
    k = gpu.usable(target, values) if target.dtype == np.float32 and values.ndim == 2 else None
    if k is not None and index.dtype == np.int64 and index.shape == values.shape[:1]:
        k.embedding_backward(xp.ascontiguousarray(index), values, target)  # float32 atomics
        return
    add_at = getattr(xp.add, "at", None)  # CuPy >= 13
    if add_at is not None:
        add_at(target, index, values)
    else:  # older CuPy
        import cupyx

        cupyx.scatter_add(target, index, values)


class Embedding(Module):
    """Lookup table: ``forward(idx)`` with integer ``idx`` of any shape returns ``(*idx.shape, d)``.

    ``weight`` (n, d) starts as N(0, std^2) (std=1 as in the common reference). ``backward``
    accumulates the row gradients and returns ``None`` (token ids have no gradient).
    """

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
        idx = to_device(idx, xp)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"Embedding needs integer indices, got {idx.dtype}")
        # (a CUDA graph's capture reads nothing back: the indices were checked in its warm-up step)
        if idx.size and not gpu.capturing and (int(idx.min()) < 0 or int(idx.max()) >= self.n):
            raise IndexError(
                f"Embedding({self.n}, {self.d}): indices must be in [0, {self.n}), "
                f"got range [{int(idx.min())}, {int(idx.max())}]"
            )
        self.cache = idx
        out = self._scratch().get("y", (*idx.shape, self.d), self.weight.data.dtype, xp)
        xp.take(self.weight.data, idx, axis=0, out=out)
        return out

    def backward(self, grad_out: Any) -> None:
        idx = self.cache
        scatter_add(self.weight.grad, idx.reshape(-1), grad_out.reshape(-1, self.d))
        return None

    def extra_repr(self) -> str:
        return f"{self.n}, {self.d}"
