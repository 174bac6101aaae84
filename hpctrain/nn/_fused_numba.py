"""The fused CPU kernels behind ``hpctrain.nn.fused`` (compiled by Numba; imported only through it).

Each kernel does in one pass over memory what the NumPy code does in several, on C-contiguous
arrays of one floating dtype; the scalars arrive already in that dtype, so every operation runs in
the array's precision as NumPy's does (no silent float64 intermediates). The elementwise kernels
(GELU, Adam) take NumPy's operations in NumPy's order without ``fastmath``, so they are bitwise
NumPy's results; the LayerNorm and softmax kernels sum each row in float64 and let the compiler
reorder the sums (``reassoc``: vectorised), equal to the NumPy code to rounding (its BLAS sums are
float32).
``nogil``: a progress thread (``HPCTRAIN_PROGRESS=thread``) can drive MPI while they run.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_JIT = {"cache": True, "nogil": True, "error_model": "numpy"}  # x / 0 is inf, as in NumPy
_SUMS = {**_JIT, "fastmath": {"reassoc"}}


@njit(**_JIT)
def gelu_inner(x, t, k, c):  # pragma: no cover - compiled
    """``t = x (c + k x^2)``: the argument of GELU's tanh (1-D arrays)."""
    for i in range(x.size):
        xi = x[i]
        u = xi * xi
        u = u * k
        u = u + c
        t[i] = u * xi


@njit(**_JIT)
def gelu_outer(x, t, y, one, half):  # pragma: no cover - compiled
    """``y = 0.5 x (1 + t)`` with ``t`` the tanh (1-D arrays)."""
    for i in range(x.size):
        v = t[i] + one
        v = v * x[i]
        y[i] = v * half


@njit(**_JIT)
def gelu_backward(x, t, g, out, k3, c, one, half):  # pragma: no cover - compiled
    """``out = 0.5 ((1 + t) + x (1 - t^2) (c + k3 x^2)) g`` (1-D arrays)."""
    for i in range(x.size):
        xi = x[i]
        ti = t[i]
        y = xi * xi
        y = y * k3
        y = y + c
        b = ti * ti
        b = one - b
        y = y * b
        y = y * xi
        y = y + ti
        y = y + one
        y = y * half
        out[i] = y * g[i]


@njit(**_SUMS)
def layernorm_forward(x, w, b, eps, xhat, rstd, y):  # pragma: no cover - compiled
    """Rows of ``x`` (n, d): ``xhat = (x - mean) / sqrt(var + eps)``, ``rstd`` (n,), ``y = xhat w + b``."""
    n, d = x.shape
    t = x.dtype.type
    for i in range(n):
        s = 0.0  # float64 sums: closer to the exact sums than any float32 order
        for j in range(d):
            s += x[i, j]
        mu = t(s / d)
        q = 0.0
        for j in range(d):
            h = x[i, j] - mu
            xhat[i, j] = h
            q += np.float64(h) * h
        r = t(1.0 / np.sqrt(q / d + eps))
        rstd[i] = r
        for j in range(d):
            h = xhat[i, j] * r
            xhat[i, j] = h
            y[i, j] = h * w[j] + b[j]


@njit(**_SUMS)
def layernorm_backward(g, xhat, rstd, w, gw, gb, gx):  # pragma: no cover - compiled
    """LayerNorm's backward over rows (n, d): adds the column sums into ``gw``/``gb`` and writes
    ``gx = (g w - mean(g w) - xhat mean(g w xhat)) rstd``."""
    n, d = g.shape
    t = g.dtype.type
    for i in range(n):
        a = 0.0  # float64 sums, as in the forward
        c = 0.0
        for j in range(d):
            gj = g[i, j]
            gh = gj * xhat[i, j]
            gw[j] += gh
            gb[j] += gj
            a += np.float64(gj * w[j])
            c += np.float64(gh * w[j])
        a = t(a / d)
        c = t(c / d)
        r = rstd[i]
        for j in range(d):
            gx[i, j] = (g[i, j] * w[j] - a - xhat[i, j] * c) * r


@njit(**_JIT)
def _adam_one(pi, gi, mi, vi, b1, one_b1, b2, one_b2, bc2, eps, step_size):  # pragma: no cover
    mi = mi * b1
    mi = mi + gi * one_b1
    vi = vi * b2
    s = gi * gi
    s = s * one_b2
    vi = vi + s
    s = vi / bc2
    s = np.sqrt(s)
    s = s + eps
    s = mi / s
    s = s * step_size
    return pi - s, mi, vi


@njit(**_JIT)
def adam(p, g, m, v, decay, l2, b1, one_b1, b2, one_b2, bc2, eps, step_size):  # pragma: no cover
    """One Adam/AdamW step on 1-D arrays in the NumPy code's order: ``p *= decay`` (AdamW; 1 keeps
    ``p``), ``g + l2 p`` (Adam's L2; 0 keeps ``g``), the moments, then ``p -= step m / (sqrt(v / bc2)
    + eps)``. ``decay == 1`` and ``l2 == 0`` skip their operation, as the NumPy code does; each case
    is its own loop without branches, so the compiler vectorises it."""
    if l2 != 0:
        for i in range(p.size):
            pi = p[i]
            p[i], m[i], v[i] = _adam_one(pi, g[i] + l2 * pi, m[i], v[i], b1, one_b1, b2, one_b2, bc2, eps, step_size)
    elif decay != 1:
        for i in range(p.size):
            p[i], m[i], v[i] = _adam_one(p[i] * decay, g[i], m[i], v[i], b1, one_b1, b2, one_b2, bc2, eps, step_size)
    else:
        for i in range(p.size):
            p[i], m[i], v[i] = _adam_one(p[i], g[i], m[i], v[i], b1, one_b1, b2, one_b2, bc2, eps, step_size)


@njit(**_SUMS)
def softmax_scores(att, s, e, scale, ninf):  # pragma: no cover - compiled
    """Rows ``s..e-1`` of the causal scores ``att`` (B, H, T, T), columns ``0..e-1`` holding the raw
    products q k^T: ``att * scale`` minus its row maximum over the columns a query may see
    (``j <= i``), ``ninf`` (-inf) on the columns it may not. ``np.exp`` follows, then
    :func:`softmax_normalize`."""
    b, h = att.shape[0], att.shape[1]
    for bi in range(b):
        for hi in range(h):
            for i in range(s, e):
                row = att[bi, hi, i]
                m = row[0] * scale
                for j in range(i + 1):
                    v = row[j] * scale
                    row[j] = v
                    m = max(m, v)
                for j in range(i + 1):
                    row[j] = row[j] - m
                for j in range(i + 1, e):
                    row[j] = ninf


@njit(**_SUMS)
def softmax_normalize(att, s, e):  # pragma: no cover - compiled
    """Rows ``s..e-1`` of ``att`` after ``exp``: divided by their sums (float64), 0 past column ``i``."""
    b, h, t = att.shape[0], att.shape[1], att.shape[3]
    zero = att.dtype.type(0)
    for bi in range(b):
        for hi in range(h):
            for i in range(s, e):
                row = att[bi, hi, i]
                r = 0.0
                for j in range(i + 1):
                    r += row[j]
                rr = att.dtype.type(r)
                for j in range(i + 1):
                    row[j] = row[j] / rr
                for j in range(i + 1, t):
                    row[j] = zero


@njit(**_SUMS)
def softmax_backward(ds, att, s, e, scale):  # pragma: no cover - compiled
    """Rows ``s..e-1`` of the score gradient ``ds`` (holding d loss / d att on columns ``0..e-1``):
    ``(ds - sum(ds * att)) * att * scale``, the row sums in float64."""
    b, h = ds.shape[0], ds.shape[1]
    for bi in range(b):
        for hi in range(h):
            for i in range(s, e):
                d = ds[bi, hi, i]
                p = att[bi, hi, i]
                r = 0.0
                for j in range(e):
                    r += np.float64(d[j] * p[j])
                rr = ds.dtype.type(r)
                for j in range(e):
                    v = d[j] - rr
                    v = v * p[j]
                    d[j] = v * scale


@njit(**_JIT)
def scatter_rows(target, index, values):  # pragma: no cover - compiled
    """``target[index[i]] += values[i]`` row by row in order (repeated rows accumulate, as
    ``np.add.at``); the indices are the caller's to check."""
    n, d = values.shape
    for i in range(n):
        r = index[i]
        for j in range(d):
            target[r, j] += values[i, j]
