"""The array computations of GELU and LayerNorm, forward and backward, on NumPy or CuPy arrays:
shared by the layers (``nn.GELU``, ``nn.LayerNorm``) and ``hpctrain.nn.functional``.

They write into arrays from a ``Buffers`` pool (a layer's own, reused across steps; ``F`` passes a
pool that keeps nothing) and use the fused Numba kernels (``hpctrain.nn.fused``) on NumPy and the
CUDA kernels (``hpctrain.nn.gpu``) on CuPy where those apply.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import is_half, xp_of
from . import fused, gpu
from .buffers import Buffers

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


# -- GELU ------------------------------------------------------------------------------------------


def gelu_forward(x: Any, buf: Buffers, bias: Any = None) -> tuple[Any, Any, Any]:
    """``(y, x, t)``: GELU of ``x`` (of ``x + bias`` with a bias), and what its backward needs:
    the input it saw and the ``tanh`` term (``None`` on the GPU kernel's path, whose backward
    recomputes it from ``x``)."""
    xp = xp_of(x)
    k = gpu.usable(x, *(() if bias is None else (bias,)))
    if k is not None:  # one kernel; nothing but x kept
        y = buf.like("y", x)
        k.gelu_forward(x, bias, y)
        return y, x, None
    if bias is not None:
        x = x + bias
    t = buf.like("t", x)
    y = buf.like("y", x)
    k = fused.usable(x, t, y)
    if k is not None:  # the same operations fused around NumPy's vectorised tanh, chunk by chunk
        kc, c, one, half = fused.scalars(x.dtype, 0.044715 * _GELU_C, _GELU_C, 1.0, 0.5)
        xf, tf, yf = x.reshape(-1), t.reshape(-1), y.reshape(-1)
        for s in range(0, xf.size, CHUNK):
            xs, ts = xf[s : s + CHUNK], tf[s : s + CHUNK]
            k.gelu_inner(xs, ts, kc, c)
            np.tanh(ts, out=ts)
            k.gelu_outer(xs, ts, yf[s : s + CHUNK], one, half)
        return y, x, t
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
    return y, x, t


def gelu_backward(grad_out: Any, x: Any, t: Any, buf: Buffers) -> Any:
    """The input gradient of GELU given ``grad_out`` and forward's ``x`` and ``t``."""
    xp = xp_of(x)
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


# -- LayerNorm -------------------------------------------------------------------------------------


def layer_norm_forward(x: Any, w: Any, b: Any, eps: float, buf: Buffers) -> tuple[Any, tuple]:
    """``(y, saved)``: the last axis of ``x`` normalised (biased variance plus ``eps``), times
    ``w`` plus ``b``, and what the backward needs (``(xhat, rstd)``; ``(x, mean, rstd)`` from the
    GPU kernels). 16-bit inputs: the statistics in float32, ``y`` rounded back."""
    k = gpu.usable(x, w, b) if x.dtype == w.dtype == b.dtype else None
    if k is not None:  # one block per row, float32 statistics; x, mean and rstd kept
        d, xp = x.shape[-1], xp_of(x)
        n = x.size // d
        y = buf.like("y", x)
        stats = (buf.get("mean", (n,), np.float32, xp), buf.get("rstd", (n,), np.float32, xp))
        mean, rstd = k.layernorm_forward(x.reshape(-1, d), w, b, eps, y.reshape(-1, d), *stats)
        return y, (x, mean, rstd)
    if is_half(x.dtype):
        y, saved = _ln_forward(x.astype(np.float32), w.astype(np.float32), b.astype(np.float32), eps, buf)
        return y.astype(x.dtype), saved
    return _ln_forward(x, w, b, eps, buf)


def _ln_forward(x: Any, w: Any, b: Any, eps: float, buf: Buffers) -> tuple[Any, tuple[Any, Any]]:
    xp = xp_of(x)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    n = x2.shape[0]
    k = fused.usable(x, w, b)
    if k is not None:  # one pass over each row (see hpctrain.nn.fused)
        xhat, rstd = buf.like("xhat", x), buf.get("rstd", (n, 1), x.dtype, xp)
        y = buf.like("y", x)
        k.layernorm_forward(x2, w, b, *fused.scalars(x.dtype, eps), xhat.reshape(-1, d), rstd.reshape(-1),
                            y.reshape(-1, d))
        return y, (xhat, rstd)
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
    var += eps
    xp.sqrt(var, out=var)
    rstd = xp.divide(1.0, var[:, None], out=buf.get("rstd", (n, 1), x.dtype, xp))
    xh2 *= rstd
    y = buf.get("y", x.shape, np.result_type(x.dtype, w.dtype), xp)
    xp.multiply(xhat, w, out=y)
    y += b
    return y, (xhat, rstd)


def layer_norm_backward(grad_out: Any, saved: tuple, w: Any, gw: Any, gb: Any, buf: Buffers) -> Any:
    """The input gradient of LayerNorm from what its forward ``saved``; *adds* the weight's and the
    bias's gradients into ``gw`` and ``gb``. 16-bit gradients: computed in float32, the input
    gradient rounded back."""
    if len(saved) == 3:  # the GPU kernels' forward
        x, mean, rstd = saved
        d = x.shape[-1]
        g = grad_out if grad_out.dtype == x.dtype else grad_out.astype(x.dtype)
        g = xp_of(g).ascontiguousarray(g)
        gx = gpu.shared.like("ln_gx", x)
        gpu.usable(x, g, gw, gb).layernorm_backward(g.reshape(-1, d), x.reshape(-1, d), w, mean, rstd,
                                                    gx.reshape(-1, d), gw, gb)
        return gx
    xhat, rstd = saved
    if is_half(grad_out.dtype):
        return _ln_backward(grad_out.astype(np.float32), xhat, rstd, w.astype(np.float32), gw, gb,
                            buf).astype(grad_out.dtype)
    return _ln_backward(grad_out, xhat, rstd, w, gw, gb, buf)


def _ln_backward(grad_out: Any, xhat: Any, rstd: Any, w: Any, gw: Any, gb: Any, buf: Buffers) -> Any:
    xp = xp_of(grad_out)
    d = xhat.shape[-1]
    dtype = np.result_type(grad_out.dtype, xhat.dtype)
    g2 = grad_out.reshape(-1, d)
    xh2 = xhat.reshape(-1, d)
    n = g2.shape[0]
    k = fused.usable(grad_out, xhat, rstd, w, gw, gb)
    if k is not None and grad_out.shape == xhat.shape:  # one pass over each row
        gx = buf.like("gx", grad_out)
        k.layernorm_backward(g2, xh2, rstd.reshape(-1), w, gw, gb, gx.reshape(-1, d))
        return gx
    ones = row_ones(n, grad_out.dtype, xp)
    tmp = buf.get("tmp", g2.shape, dtype, xp)
    xp.multiply(g2, xh2, out=tmp)
    # Column sums (parameter gradients) and row sums as matrix-vector products. With gx =
    # grad_out * weight, the rows' mean of gx is (grad_out @ weight) / d and the rows' mean of
    # gx * xhat is ((grad_out * xhat) @ weight) / d: no pass over gx needed for either.
    gw += xp.matmul(ones, tmp, out=buf.get("gw", (d,), dtype, xp))
    gb += xp.matmul(ones, g2, out=buf.get("gb", (d,), grad_out.dtype, xp))
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
