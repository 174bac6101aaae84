"""hpctrain's GPU kernels and cuBLAS calls emulated with NumPy on the device stand-in (tests only).

``gpu.use_kernels(EmulatedKernels())`` with the stand-in registered makes the layers take their
GPU kernels' path on the CPU: every launcher of ``hpctrain.nn.gpu.Kernels`` runs as on a GPU, down
to the ``(grid, block, args)`` of each launch, which lands here and is carried out by the NumPy
model of that kernel (``KERNELS``: the CUDA C of ``hpctrain.nn.cuda_src`` op for op, float32
arithmetic, 16-bit storage rounded to nearest even); each cuBLAS call list (``gpu_gemm.plan``) runs
through ``gpu_gemm.emulate`` on the arrays' memory. What that checks: the launchers' argument
plumbing, buffers and dtypes, the whole step's numerics against the NumPy path, and (with the
stand-in's capture) that the step allocates nothing, reads nothing back and calls no cuBLAS
through the array module. What it cannot check: the CUDA C itself (NVRTC compiles it; the GPU
check runs it against these twins).
"""

from __future__ import annotations

import ctypes
from typing import Any

import devicearray
import numpy as np

from hpctrain.backend import BF16
from hpctrain.nn import gpu, gpu_gemm, philox
from hpctrain.nn.cublas import Blas

F32 = np.float32
DF32 = np.dtype(np.float32)
STORAGE = {"f": np.dtype(np.float32), "b": BF16, "h": np.dtype(np.float16)}


def _np(a: Any) -> Any:
    return a._a if isinstance(a, devicearray.ndarray) else a


def _null(a: Any) -> bool:
    return isinstance(a, (np.integer, int)) and int(a) == 0


def _f(a: np.ndarray) -> np.ndarray:
    return a.astype(F32)


def _store(dst: np.ndarray, value: np.ndarray) -> None:
    dst[...] = value.astype(F32).astype(dst.dtype)


def _gelu_t(h, kc, c):
    t = h * h
    t = t * kc
    t = t + c
    t = t * h
    return np.tanh(t)


def gelu_fwd(x, b, y, n, d, kc, c):
    h = _f(x.reshape(-1))
    if not _null(b):
        h = h + np.tile(_f(b), int(n) // int(d))
        _store(x.reshape(-1), h)
        h = _f(x.reshape(-1))  # backward reads x rounded to its dtype
    t = _gelu_t(h, kc, c)
    v = (t + F32(1.0)) * h
    _store(y.reshape(-1), v * F32(0.5))


def gelu_bwd(x, g, out, n, k3c, c, kc):
    h = _f(x.reshape(-1))
    t = _gelu_t(h, kc, c)
    a = h * h * k3c + c
    a = a * (F32(1.0) - t * t) * h + t
    a = (a + F32(1.0)) * F32(0.5)
    _store(out.reshape(-1), a * _f(g.reshape(-1)))


def ln_fwd(x, w, b, y, mean, rstd, d, eps):
    x2 = _f(x.reshape(-1, int(d)))
    mu = x2.sum(1, dtype=F32) / F32(d)
    h = x2 - mu[:, None]
    r = F32(1.0) / np.sqrt((h * h).sum(1, dtype=F32) / F32(d) + F32(eps))
    _store(y.reshape(-1, int(d)), h * r[:, None] * _f(w) + _f(b))
    mean[:], rstd[:] = mu, r


def ln_bwd_rows(g, x, w, mean, rstd, gx, d):
    d = int(d)
    g2, x2 = _f(g.reshape(-1, d)), _f(x.reshape(-1, d))
    xh = (x2 - mean[:, None]) * rstd[:, None]
    gw = g2 * _f(w)
    a, c = gw.sum(1, dtype=F32) / F32(d), (gw * xh).sum(1, dtype=F32) / F32(d)
    _store(gx.reshape(-1, d), (gw - a[:, None] - xh * c[:, None]) * rstd[:, None])


def ln_bwd_cols(g, x, mean, rstd, pw, pb, n, d, rows):
    d, rows = int(d), int(rows)
    g2, x2 = _f(g.reshape(-1, d)), _f(x.reshape(-1, d))
    xh = (x2 - mean[:, None]) * rstd[:, None]
    for c in range(pw.shape[0]):
        s = slice(c * rows, min((c + 1) * rows, int(n)))
        pw[c], pb[c] = (g2[s] * xh[s]).sum(0, dtype=F32), g2[s].sum(0, dtype=F32)


def cols_add(part, chunks, d, out, acc):
    s = part[: int(chunks)].sum(0, dtype=F32)
    _store(out.reshape(-1), _f(out.reshape(-1)) + s if int(acc) else s)


def bias_add(y, b, n, d):
    _store(y.reshape(-1, int(d)), _f(y.reshape(-1, int(d))) + _f(b))


def col_part(g, part, n, d, rows):
    g2 = _f(g.reshape(-1, int(d)))
    for c in range(part.shape[0]):
        part[c] = g2[c * int(rows):(c + 1) * int(rows)].sum(0, dtype=F32)


def _causal_rows(s, t):
    t = int(t)
    rows = s.reshape(-1, t)
    causal = np.arange(t)[None, :] <= (np.arange(rows.shape[0]) % t)[:, None]
    return rows, causal


def attn_softmax_fwd(s, p, lse, t, scale):
    rows, causal = _causal_rows(s, t)
    z = np.where(causal, np.where(causal, rows, F32(0.0)) * F32(scale), -np.inf).astype(F32)
    m = z.max(1)
    lrow = m + np.log(np.exp(z - m[:, None]).sum(1, dtype=F32))
    _store(p.reshape(rows.shape), np.where(causal, np.exp(z - lrow[:, None]), F32(0.0)))
    lse.reshape(-1)[:] = lrow


def attn_softmax_bwd(s, dp, lse, p, ds, t, scale):
    rows, causal = _causal_rows(s, t)
    dprows = np.where(causal, dp.reshape(rows.shape), F32(0.0)).astype(F32)  # nothing above the diagonal read
    srows = np.where(causal, rows, F32(0.0)).astype(F32)
    pr = np.where(causal, np.exp(srows * F32(scale) - lse.reshape(-1)[:, None]), F32(0.0)).astype(F32)
    dsum = (pr * dprows).sum(1, dtype=F32)
    _store(p.reshape(rows.shape), pr)
    _store(ds.reshape(rows.shape), pr * (dprows - dsum[:, None]) * F32(scale))


def ce_fwd(x, target, w, lse, nll, v):
    x2 = _f(x.reshape(-1, int(v)))
    m = x2.max(1)
    lse[:] = m + np.log(np.exp(x2 - m[:, None]).sum(1, dtype=F32))
    picked = x2[np.arange(x2.shape[0]), target]
    nll[:] = (lse - picked) * (F32(1.0) if _null(w) else w)


def ce_bwd(x, target, lse, w, cdev, coef, g, v):
    x2 = _f(x.reshape(-1, int(v)))
    c = (F32(coef) if _null(cdev) else cdev.reshape(-1)[0]) * (F32(1.0) if _null(w) else w)
    p = np.exp(x2 - lse[:, None])
    p[np.arange(x2.shape[0]), target] -= F32(1.0)
    _store(g.reshape(-1, int(v)), p * np.asarray(c, F32).reshape(-1, 1))


def sum_scaled(x, n, scale, out):
    out[...] = x.sum(dtype=F32) * F32(scale)


def dropout(x, y, n, lo, hi, thresh, scale):
    keep = (philox.words(int(lo) | int(hi) << 32, int(n)) >> 8) >= int(thresh)
    _store(y.reshape(-1), np.where(keep, _f(x.reshape(-1)) * F32(scale), F32(0.0)))


def embed_bwd(idx, g, grad, n, d):
    np.add.at(grad, idx.reshape(-1), _f(g.reshape(int(n), int(d))))


def _view(ptr: int, n: int, dtype: np.dtype) -> np.ndarray:
    """The ``n`` elements of ``dtype`` at address ``ptr`` (this process's memory: the stand-in's)."""
    raw = (ctypes.c_uint8 * (n * dtype.itemsize)).from_address(int(ptr))
    return np.frombuffer(raw, dtype=dtype)


def _tensors(chunks, tables, dtypes):
    """Per tensor of the block table, its arrays (each table a column of pointers)."""
    sizes: dict[int, int] = {}
    for t, _, e in chunks:
        sizes[int(t)] = max(sizes.get(int(t), 0), int(e))
    return {t: [None if int(tab[t]) == 0 else _view(tab[t], n, dt) for tab, dt in zip(tables, dtypes)]
            for t, n in sizes.items()}


def adam_mt(g_s, h_s, chunks, pp, gp, mp, vp, h16, hp):
    decay, l2, b1, ob1, b2, ob2, bc2, eps, step = (F32(v) for v in hp[:9])
    dtypes = (DF32, STORAGE[g_s], DF32, DF32, STORAGE[h_s])
    for p, g, m, v, h in _tensors(chunks, (pp, gp, mp, vp, h16), dtypes).values():
        if p is None:
            continue
        gi = _f(g)
        pi = p.copy()
        if l2 != 0:
            gi = gi + l2 * pi
        elif decay != 1:
            pi = pi * decay
        mi = m * b1 + gi * ob1
        vi = v * b2 + gi * gi * ob2
        pi = pi - mi / (np.sqrt(vi / bc2) + eps) * step
        p[:], m[:], v[:] = pi, mi, vi
        if h is not None:
            h[:] = pi.astype(h.dtype)


def sgd_mt(g_s, h_s, chunks, pp, gp, bp, h16, hp):
    lr, wd, mom, nesterov = (F32(v) for v in hp[:4])
    for p, g, buf, h in _tensors(chunks, (pp, gp, bp, h16), (DF32, STORAGE[g_s], DF32, STORAGE[h_s])).values():
        if p is None:
            continue
        gi = _f(g)
        if wd != 0:
            gi = gi + wd * p
        if mom != 0:
            buf[:] = buf * mom + gi
            gi = gi + mom * buf if nesterov != 0 else buf.copy()
        p[:] = p - lr * gi
        if h is not None:
            h[:] = p.astype(h.dtype)


def sumsq_mt(g_s, chunks, gp, part):
    for b, (t, a, e) in enumerate(chunks):
        g = _view(gp[t], int(e), STORAGE[g_s]).astype(np.float64)[int(a):int(e)]
        part[b] = (g * g).sum()


def sum_parts(part, n, out):
    out[0] = part[: int(n)].sum()


KERNELS = {f.__name__: f for f in (gelu_fwd, gelu_bwd, ln_fwd, ln_bwd_rows, ln_bwd_cols, cols_add, bias_add, col_part,
                                   attn_softmax_fwd, attn_softmax_bwd, ce_fwd, ce_bwd, dropout, embed_bwd)}


_CUDA_DTYPES = {v: np.dtype(k) if k != "bfloat16" else BF16 for k, v in gpu_gemm.CUDA_TYPES.items()}


def _colmajor_at(ptr: int, rows: int, cols: int, ld: int, dtype: np.dtype) -> np.ndarray:
    """The column-major ``rows x cols`` matrix with leading dimension ``ld`` at address ``ptr``."""
    flat = _view(ptr, (cols - 1) * ld + rows, dtype)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (dtype.itemsize, ld * dtype.itemsize), writeable=True)


def _one_gemm(transa, transb, m, n, k, a, ta, lda, b, tb, ldb, beta, c, tc, ldc):
    """``C = op(A) op(B) (+ C)`` as cuBLAS reads column-major memory; float32 products of 16-bit."""
    ar, ac = (k, m) if transa else (m, k)
    br, bc = (n, k) if transb else (k, n)
    am = _colmajor_at(a, ar, ac, lda, _CUDA_DTYPES[ta]).astype(F32 if _CUDA_DTYPES[ta].itemsize == 2 else None)
    bm = _colmajor_at(b, br, bc, ldb, _CUDA_DTYPES[tb]).astype(am.dtype)
    cm = _colmajor_at(c, m, n, ldc, _CUDA_DTYPES[tc])
    prod = (am.T if transa else am) @ (bm.T if transb else bm)
    cm[...] = prod + cm.astype(prod.dtype) if beta else prod


class EmulatedBlas(Blas):
    """``cublas.Blas`` whose three cuBLAS entry points run on the stand-in's memory: the real
    ``run`` (handles, plans, address tables) down to the raw addresses each call passes."""

    calls = 0

    def __init__(self):
        super().__init__(cp=devicearray)

    def _new_handle(self, stream):
        return 1, None

    @staticmethod
    def _beta(ptr):
        return float(_view(ptr, 1, DF32)[0])

    def _gemm(self, h, transa, transb, m, n, k, alpha, a, ta, lda, b, tb, ldb, beta, c, tc, ldc, compute, algo):
        be = self._beta(beta)
        devicearray.record(lambda: _one_gemm(transa, transb, m, n, k, a, ta, lda, b, tb, ldb, be, c, tc, ldc))
        EmulatedBlas.calls += 1
        return 0

    def _strided(self, h, transa, transb, m, n, k, alpha, a, ta, lda, sa, b, tb, ldb, sb, beta, c, tc, ldc, sc, count,
                 compute, algo):
        be = self._beta(beta)
        ia, ib, ic = (_CUDA_DTYPES[t].itemsize for t in (ta, tb, tc))

        def body():
            for i in range(count):
                _one_gemm(transa, transb, m, n, k, a + i * sa * ia, ta, lda, b + i * sb * ib, tb, ldb, be,
                          c + i * sc * ic, tc, ldc)
        devicearray.record(body)
        EmulatedBlas.calls += 1
        return 0

    def _pointers(self, h, transa, transb, m, n, k, alpha, ta_, ta, lda, tb_, tb, ldb, beta, tc_, tc, ldc, count,
                  compute, algo):
        be = self._beta(beta)

        def body():  # the tables are read when the call runs, as on the device
            pa, pb, pc = (_view(t, count, np.dtype(np.uint64)) for t in (ta_, tb_, tc_))
            for i in range(count):
                _one_gemm(transa, transb, m, n, k, int(pa[i]), ta, lda, int(pb[i]), tb, ldb, be, int(pc[i]), tc, ldc)
        devicearray.record(body)
        EmulatedBlas.calls += 1
        return 0


class EmulatedKernels(gpu.Kernels):
    """``gpu.Kernels`` whose launches run the NumPy models above on the stand-in's memory."""

    def __init__(self) -> None:
        super().__init__(devicearray, EmulatedBlas())
        self.launches = 0

    def fn(self, name: str) -> Any:
        if name in ("sum_scaled", "sum_parts"):
            body = sum_scaled if name == "sum_scaled" else sum_parts
        elif name.startswith("sumsq_mt_"):
            def body(*a, sfx=name[-1]):
                return sumsq_mt(sfx, *a)
        elif name.startswith(("adam_mt_", "sgd_mt_")):
            rule, sfx = name.split("_mt_")

            def body(*a, rule=adam_mt if rule == "adam" else sgd_mt, sfx=sfx):
                return rule(sfx[0], sfx[1], *a)
        else:
            base, sfx = name.rsplit("_", 1)
            body = KERNELS[base]
            assert sfx in STORAGE, name

        def launch(grid, block, args):
            self.launches += 1
            a = tuple(_np(x) for x in args)
            devicearray.record(lambda: body(*a))

        return launch
