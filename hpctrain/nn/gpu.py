"""The GPU kernels behind the layers: one dispatch place, as ``hpctrain.nn.fused`` is for Numba on NumPy.

A layer (or fused function) asks ``usable(*arrays)``: the launcher when every array is a
C-contiguous CuPy array of float32, bfloat16 or float16 and the kernels are on, else ``None``,
and the layer's NumPy code runs (on NumPy, on the test stand-in, on float64). The CUDA C lives
in ``hpctrain.nn.cuda_src``; CuPy compiles it once per process (NVRTC, cached on disk by CuPy).
``HPCTRAIN_CUDA_KERNELS`` chooses: unset (default) uses them with real CuPy, ``0`` never, ``1``
always (``ConfigError`` without CuPy and a GPU).

Each kernel has its NumPy twin, the reference it is checked against, and checks that run
without a GPU: NVRTC compiles every kernel (``tests/test_cuda_kernels.py``, with NumPy models of
the tiled schemes), and ``tests/gpu_emulator.py`` runs this module's launchers on the tests' device
stand-in with each kernel and cuBLAS call carried out in NumPy (``tests/test_cuda_graph.py``: whole
GPT steps and trainers equal the NumPy path; a captured step replays like eager steps):

==========================  ============================  =============================================
kernel                      NumPy twin                    check off the GPU
==========================  ============================  =============================================
gelu_fwd/bwd (+bias)        layers.GELU                   NVRTC; emulated step; same formula op for op
ln_fwd, ln_bwd_rows/cols    layers.LayerNorm              NVRTC; kernel_models.layernorm_*; emulated
attn_softmax_fwd/bwd        transformer.causal_attention  NVRTC; the lse scheme's NumPy model; emulated
 + cuBLAS (nn.cublas)                                     step with the causal blocks; gpu_gemm.emulate
ce_fwd/bwd, sum_scaled      losses.CrossEntropyLoss       NVRTC; the one-pass model; emulated step
dropout                     philox (NumPy Philox4x32)     NVRTC; Random123's known answers; the CPU
                                                          Dropout draws the same words
embed_bwd                   layers.scatter_add            NVRTC; emulated step (float32 atomics)
bias_add, col_part/cols_add Linear's bias, column sums    NVRTC; emulated step
adam_mt, sgd_mt             optim Adam/AdamW/SGD          NVRTC; kernel_models.chunks; emulated step
sumsq_mt, sum_parts         the trainer's gradient norm   NVRTC; emulated (test_cuda_graph)
==========================  ============================  =============================================

Matrix products go through ``hpctrain.nn.cublas`` (cuBLAS called directly: a CUDA graph can
capture them, CuPy's wrappers refuse). On a GPU, ``make gpu-check`` runs each kernel against its
twin on the device (max error).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from .. import backend, settings
from ..errors import ConfigError
from . import cuda_src, gpu_gemm
from .buffers import Buffers

SUFFIX = cuda_src.DTYPE_SUFFIX
_GELU_C = float(np.sqrt(2.0 / np.pi))
_state: dict[str, Any] = {}
#: Scratch shared by every layer: the attention's T x T scores, column partials, and each layer's
#: backward outputs (an input gradient is dead once the layer before has consumed it): one layer's
#: transient arrays are the next layer's, in stream order, instead of one set per layer (the
#: reference counts of ``Buffers`` keep an array still held anywhere from being handed out).
shared = Buffers()
#: True while a CUDA graph is being captured (``hpctrain.nn.cuda_graph``): nothing may then read
#: the device from the host, allocate, or copy host->device (launchers leave that to the replayer).
capturing = False


def enabled() -> bool:
    """Whether the kernels are on (see the module docstring); asked by every layer call, so the
    answer is kept while the setting and the array module stay the same."""
    key = (os.environ.get("HPCTRAIN_CUDA_KERNELS"), backend.cupy())
    known = _state.get("enabled")
    if known is not None and known[0] == key:
        return known[1]
    choice = settings.cuda_kernels()
    cp = key[1]
    real = cp is not None and backend.is_real_cupy(cp)
    if choice and not real:
        raise ConfigError("HPCTRAIN_CUDA_KERNELS=1 needs CuPy and a GPU")
    _state["enabled"] = (key, real and choice is not False)
    return real and choice is not False


def use_kernels(kernels: Kernels | None) -> Kernels | None:
    """Make ``kernels`` the launcher for device arrays whatever ``enabled()`` says (``None``: back
    to the real one); returns the previous one. For tests only: an emulation on the CPU stand-in
    (``tests/gpu_emulator.py``) runs the kernels' path, its launches and products, without a GPU."""
    previous, _state["forced"] = _state.get("forced"), kernels
    return previous


def usable(*arrays: Any, views: bool = False) -> Kernels | None:
    """The launcher when the kernels are on and every array is a C-contiguous CuPy array of a
    kernel dtype (float32, bfloat16, float16), else ``None``. ``views``: strided views with a unit
    stride along the last axis will do (the attention's batched products take them)."""
    for a in arrays:
        if not backend.is_device_array(a) or np.dtype(a.dtype).name not in SUFFIX:
            return None
        if not (a.flags.c_contiguous or views and (a.shape[-1] == 1 or a.strides[-1] == a.itemsize)):
            return None
    forced = _state.get("forced")
    if forced is not None:
        return forced
    if not enabled():
        return None
    k = _state.get("kernels")
    if k is None:
        k = _state["kernels"] = Kernels()
    return k


def scratch(module: Any, *arrays: Any) -> Buffers:
    """Where ``module``'s backward outputs go: the shared pool on the kernels' path (see
    ``shared``), else the module's own."""
    return shared if usable(*arrays, views=True) is not None else module._scratch()


def add_(y: Any, x: Any) -> Any:
    """``y += x`` with ``x`` of ``y``'s trailing shape (a residual sum, the positions over a
    batch): one kernel on the kernels' path (CuPy's bfloat16 arithmetic is a slow generic loop:
    20 us per residual sum at 85 M), else the array module's. Returns ``y``."""
    k = usable(y, x) if y.dtype == x.dtype and y.shape[y.ndim - x.ndim:] == x.shape else None
    if k is None:
        y += x
        return y
    k.bias_add(y.reshape(-1, x.size), x.reshape(-1))
    return y


#: Query rows per block of the causal attention's products, at least: a block of queries multiplies
#: only the keys up to its last row (at most 4 blocks: 62% of the full products' work; smaller
#: blocks would save more work but cost launches and smaller, slower products).
ATTENTION_ROWS = 256


def causal_blocks(t: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of the query blocks of ``t`` positions (one block below 2 x ATTENTION_ROWS)."""
    n = max(1, min(4, t // ATTENTION_ROWS))
    edges = [round(i * t / n) for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _grid(n: int, threads: int = 256) -> tuple[int]:
    return (max(1, min(-(-n // threads), 8192)),)


class Kernels:
    """Launchers: each takes CuPy arrays, checks nothing the caller did not (shapes are the
    layers'), and launches on the current stream."""

    def __init__(self, cp: Any = None, blas: Any = None) -> None:
        if cp is None:  # the real thing: CuPy compiles the source once per process (NVRTC)
            import cupy as cp

            from .cublas import Blas

            self.module = cp.RawModule(code=cuda_src.source(), options=cuda_src.OPTIONS, name_expressions=None)
            blas = Blas()
        self.cp, self.blas = cp, blas
        self._fns: dict[str, Any] = {}

    def fn(self, name: str) -> Any:
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self.module.get_function(name)
        return f

    @staticmethod
    def sfx(a: Any) -> str:
        return SUFFIX[np.dtype(a.dtype).name]

    # -- matrix products (cuBLAS, capturable: hpctrain.nn.cublas) -----------------------------------
    def matmul(self, x: Any, y: Any, out: Any, beta: float = 0.0) -> Any:
        """``out = x @ y`` (``beta=1``: ``out +=``) for 2-D arrays, each row-major or a transposed
        view of one (read in place); float32 accumulation, ``out`` may be wider than the inputs."""
        return self.blas.run(gpu_gemm.plan2d(x, y, out), x, y, out, beta)

    def bmm(self, x: Any, y: Any, out: Any, trans_x: bool = False, trans_y: bool = False) -> Any:
        """``out = op(x) @ op(y)`` over the leading two axes of 4-D views (``gpu_gemm.plan``)."""
        if x.dtype != y.dtype:
            raise TypeError(f"a batched product needs one input dtype, got {x.dtype} and {y.dtype}")
        return self.blas.run(gpu_gemm.plan(x, y, out, trans_x, trans_y), x, y, out)

    # -- bias, column sums ---------------------------------------------------------------------------
    def bias_add(self, y2: Any, bias: Any) -> Any:
        """``y2 += bias`` along the rows of ``y2`` (n, d)."""
        n, d = y2.shape
        self.fn(f"bias_add_{self.sfx(y2)}")(_grid(n * d), (256,), (y2, bias, np.int64(n * d), np.int32(d)))
        return y2

    def col_sum(self, g2: Any, out: Any, accumulate: bool = True) -> Any:
        """``out (+)= g2.sum(0)`` for ``g2`` (n, d): float32 partials over chunks of rows, added in
        chunk order (the same sums every run, no atomics)."""
        n, d = g2.shape
        rows = 64
        chunks = -(-n // rows)
        part = shared.get("col_part", (chunks, d), np.float32, self.cp)
        self.fn(f"col_part_{self.sfx(g2)}")((-(-d // 128), chunks), (128,), (g2, part, np.int64(n), np.int32(d),
                                                                            np.int32(rows)))
        self._cols_add(part, out, accumulate)
        return out

    def _cols_add(self, part: Any, out: Any, accumulate: bool = True) -> None:
        chunks, d = part.shape
        self.fn(f"cols_add_{self.sfx(out)}")((-(-d // 128),), (128,), (part, np.int32(chunks), np.int32(d), out,
                                                                       np.int32(accumulate)))

    # -- GELU ------------------------------------------------------------------------------------
    def gelu_forward(self, x: Any, bias: Any, y: Any) -> Any:
        """``y = gelu(x + bias)``; with a bias, ``x`` becomes ``x + bias`` (what backward reads)."""
        n, d = x.size, x.shape[-1]
        kc, c = np.float32(0.044715 * _GELU_C), np.float32(_GELU_C)
        self.fn(f"gelu_fwd_{self.sfx(x)}")(_grid(n), (256,), (x, bias if bias is not None else np.uint64(0), y,
                                                              np.int64(n), np.int32(d), kc, c))
        return y

    def gelu_backward(self, x: Any, g: Any, out: Any) -> Any:
        n = x.size
        self.fn(f"gelu_bwd_{self.sfx(x)}")(_grid(n), (256,), (x, g, out, np.int64(n), np.float32(0.134145 * _GELU_C),
                                                              np.float32(_GELU_C), np.float32(0.044715 * _GELU_C)))
        return out

    # -- LayerNorm -------------------------------------------------------------------------------
    @staticmethod
    def _row_threads(d: int) -> int:
        return int(min(512, max(32, 32 * -(-d // 128))))

    def layernorm_forward(self, x2: Any, w: Any, b: Any, eps: float, y2: Any, mean: Any, rstd: Any
                          ) -> tuple[Any, Any]:
        """Rows of ``x2`` (n, d) normalised into ``y2``; the rows' float32 statistics into ``mean``
        and ``rstd`` (n,) (the layer keeps them for backward); returns them."""
        n, d = x2.shape
        self.fn(f"ln_fwd_{self.sfx(x2)}")((n,), (self._row_threads(d),), (x2, w, b, y2, mean, rstd, np.int32(d),
                                                                          np.float32(eps)))
        return mean, rstd

    def layernorm_backward(self, g2: Any, x2: Any, w: Any, mean: Any, rstd: Any, gx2: Any, gw: Any, gb: Any) -> Any:
        """Input gradient into ``gx2``; ``gw += sum(g * xhat)``, ``gb += sum(g)`` over rows (no atomics)."""
        n, d = x2.shape
        s = self.sfx(x2)
        self.fn(f"ln_bwd_rows_{s}")((n,), (self._row_threads(d),), (g2, x2, w, mean, rstd, gx2, np.int32(d)))
        rows = 64
        chunks = -(-n // rows)
        pw = shared.get("ln_pw", (chunks, d), np.float32, self.cp)
        pb = shared.get("ln_pb", (chunks, d), np.float32, self.cp)
        self.fn(f"ln_bwd_cols_{s}")((-(-d // 128), chunks), (128,), (g2, x2, mean, rstd, pw, pb, np.int64(n),
                                                                    np.int32(d), np.int32(rows)))
        self._cols_add(pw, gw)
        self._cols_add(pb, gb)
        return gx2

    # -- causal attention ------------------------------------------------------------------------
    def _scores(self, tag: str, q: Any) -> Any:
        b, h, t, _ = q.shape
        return shared.get(tag, (b, h, t, t), np.float32, self.cp)

    def _lowp(self, tag: str, s: Any, dtype: Any) -> Any:
        """``s`` itself for float32, else a 16-bit scratch of its shape (what the next product reads)."""
        return s if np.dtype(dtype) == np.float32 else shared.get(tag, s.shape, dtype, self.cp)

    def attention_forward(self, q: Any, k: Any, v: Any, out: Any, lse: Any) -> Any:
        """Causal softmax(q k^T / sqrt(hd)) v into ``out``; the rows' log-sum-exp into ``lse``
        (B, H, T) float32 (what backward recomputes the probabilities from); returns ``lse``.
        The products skip the masked future block by block (``causal_blocks``)."""
        b, h, t, hd = q.shape
        scale = np.float32(1.0 / math.sqrt(hd))
        s = self._scores("att_s", q)
        blocks = causal_blocks(t)
        for r0, r1 in blocks:
            self.bmm(q[:, :, r0:r1], k[:, :, :r1], s[:, :, r0:r1, :r1], trans_y=True)
        p = self._lowp("att_p", s, q.dtype)
        self.fn(f"attn_softmax_fwd_{self.sfx(p)}")((b * h * t,), (self._row_threads(t),),
                                                   (s, p, lse, np.int32(t), scale))
        for r0, r1 in blocks:
            self.bmm(p[:, :, r0:r1, :r1], v[:, :, :r1], out[:, :, r0:r1])
        return lse

    def attention_backward(self, dy: Any, q: Any, k: Any, v: Any, lse: Any, dq: Any, dk: Any, dv: Any) -> None:
        """``dq, dk, dv`` of :meth:`attention_forward`, the probabilities recomputed from ``lse``
        (only below the diagonal: the kernel reads nothing of the masked future)."""
        b, h, t, hd = q.shape
        scale = np.float32(1.0 / math.sqrt(hd))
        s, dp = self._scores("att_s", q), self._scores("att_dp", q)
        blocks = causal_blocks(t)
        for r0, r1 in blocks:
            self.bmm(q[:, :, r0:r1], k[:, :, :r1], s[:, :, r0:r1, :r1], trans_y=True)
            self.bmm(dy[:, :, r0:r1], v[:, :, :r1], dp[:, :, r0:r1, :r1], trans_y=True)
        p, ds = self._lowp("att_p", s, q.dtype), self._lowp("att_ds", dp, q.dtype)
        self.fn(f"attn_softmax_bwd_{self.sfx(p)}")((b * h * t,), (self._row_threads(t),),
                                                   (s, dp, lse, p, ds, np.int32(t), scale))
        for r0, r1 in blocks:  # queries r0..r1 saw keys up to r1; keys r0..r1 were seen by queries r0..t
            self.bmm(ds[:, :, r0:r1, :r1], k[:, :, :r1], dq[:, :, r0:r1])
            self.bmm(p[:, :, r0:, r0:r1], dy[:, :, r0:], dv[:, :, r0:r1], trans_x=True)
            self.bmm(ds[:, :, r0:, r0:r1], q[:, :, r0:], dk[:, :, r0:r1], trans_x=True)

    # -- softmax cross-entropy -------------------------------------------------------------------
    def cross_entropy_forward(self, x2: Any, target: Any, wrow: Any, lse: Any, nll: Any) -> tuple[Any, Any]:
        """Per row of ``x2`` (n, V), in one pass over the logits: ``lse`` and ``nll`` = loss * weight
        (float32, (n,) each; ``wrow`` ``None``: weight 1); returns them."""
        n, v = x2.shape
        self.fn(f"ce_fwd_{self.sfx(x2)}")((n,), (512,), (x2, target, wrow if wrow is not None else np.uint64(0), lse,
                                                          nll, np.int64(v)))
        return lse, nll

    def sum_scaled(self, x: Any, scale: float, out: Any) -> Any:
        """``out[()] = x.sum() * scale`` for a float32 vector, in one block (a fixed order)."""
        self.fn("sum_scaled")((1,), (1024,), (x, np.int64(x.size), np.float32(scale), out))
        return out

    def cross_entropy_backward(self, x2: Any, target: Any, lse: Any, wrow: Any, coef: Any, g2: Any) -> Any:
        """``g2 = (softmax(x2) - onehot(target)) * coef * wrow[row]`` (``g2`` may be ``x2``); ``coef``
        a float (fixed into a captured graph) or a 0-d float32 device array; ``wrow`` may be ``None``."""
        n, v = x2.shape
        dev = not isinstance(coef, (int, float))
        self.fn(f"ce_bwd_{self.sfx(x2)}")((n,), (512,), (x2, target, lse, wrow if wrow is not None else np.uint64(0),
                                                          coef if dev else np.uint64(0),
                                                          np.float32(0.0 if dev else coef), g2, np.int64(v)))
        return g2

    # -- dropout, embedding ----------------------------------------------------------------------
    def dropout(self, x: Any, y: Any, seed: int, thresh: int, scale: float) -> Any:
        if capturing:
            raise RuntimeError("dropout draws its seed on the host each step: a captured CUDA graph would replay one "
                               "mask forever (train with dropout eagerly)")
        n = x.size
        self.fn(f"dropout_{self.sfx(x)}")(_grid(n), (256,), (x, y, np.int64(n), np.uint32(seed & 0xFFFFFFFF),
                                                              np.uint32(seed >> 32 & 0xFFFFFFFF), np.uint32(thresh),
                                                              np.float32(scale)))
        return y

    def embedding_backward(self, idx: Any, g2: Any, grad: Any) -> None:
        n, d = g2.shape
        self.fn(f"embed_bwd_{self.sfx(g2)}")(_grid(n * d), (256,), (idx, g2, grad, np.int64(n), np.int32(d)))

    # -- optimizers over many tensors ------------------------------------------------------------
    def multi_tensor(self, rule: str, g_sfx: str, h_sfx: str, tables: tuple[Any, ...], hp: Any) -> None:
        """One launch of ``adam_mt``/``sgd_mt``: ``tables[0]`` the (tensor, start, stop) block table."""
        chunks = tables[0]
        self.fn(f"{rule}_mt_{g_sfx}{h_sfx}")((int(chunks.shape[0]),), (256,), (*tables, hp))
