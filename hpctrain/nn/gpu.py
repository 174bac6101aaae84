"""The GPU kernels behind the layers: one dispatch place, as ``hpctrain.nn.fused`` is for Numba on NumPy.

A layer (or fused function) asks ``usable(*arrays)``: the launcher when every array is a
C-contiguous CuPy array of float32, bfloat16 or float16 and the kernels are on, else ``None``,
and the layer's NumPy code runs (on NumPy, on the test stand-in, on float64). The CUDA C lives
in ``hpctrain.nn.cuda_src``; CuPy compiles it once per process (NVRTC, cached on disk by CuPy).
``HPCTRAIN_CUDA_KERNELS`` chooses: unset (default) uses them with real CuPy, ``0`` never, ``1``
always (``ConfigError`` without CuPy and a GPU).

Each kernel has its NumPy twin, the reference it is checked against, and a check that runs
without a GPU:

==========================  ============================  =============================================
kernel                      NumPy twin                    check off the GPU (tests/test_cuda_kernels.py)
==========================  ============================  =============================================
gelu_fwd/bwd (+bias)        layers.GELU                   NVRTC compile; same formula, op for op
ln_fwd, ln_bwd_rows/cols    layers.LayerNorm              NVRTC compile; kernel_models.layernorm_*
attn_softmax_fwd/bwd        transformer.causal_attention  NVRTC; kernel_models.attention_* (lse form,
 + cuBLAS batched (gemm)                                  recomputed P) and gpu_gemm.emulate of plans
ce_fwd/bwd                  losses.CrossEntropyLoss       NVRTC; kernel_models.cross_entropy_online
dropout                     philox (NumPy Philox4x32)     NVRTC; Random123's known answers; the CPU
                                                          Dropout draws the same words
embed_bwd                   layers.scatter_add            NVRTC compile (float32 atomics)
adam_mt, sgd_mt             optim Adam/AdamW/SGD          NVRTC; kernel_models.chunks (block table)
cols_add                    (column sums)                 NVRTC compile
==========================  ============================  =============================================

On a GPU, ``make gpu-check`` runs each kernel against its twin on the device (max error).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import backend, settings
from ..errors import ConfigError
from . import cuda_src, gpu_gemm
from .buffers import Buffers

SUFFIX = cuda_src.DTYPE_SUFFIX
_GELU_C = float(np.sqrt(2.0 / np.pi))
_state: dict[str, Any] = {}
#: Scratch shared by every layer (the attention's T x T scores, LayerNorm's column partials): one
#: layer's transient arrays are the next layer's, in stream order, instead of one set per layer.
shared = Buffers()
#: True while a CUDA graph is being captured: launchers then leave host->device copies to the caller.
capturing = False


def enabled() -> bool:
    """Whether the kernels are on (see the module docstring)."""
    choice = settings.cuda_kernels()
    cp = backend.cupy()
    real = cp is not None and backend.is_real_cupy(cp)
    if choice and not real:
        raise ConfigError("HPCTRAIN_CUDA_KERNELS=1 needs CuPy and a GPU")
    return real and choice is not False


def usable(*arrays: Any, views: bool = False) -> Kernels | None:
    """The launcher when the kernels are on and every array is a C-contiguous CuPy array of a
    kernel dtype (float32, bfloat16, float16), else ``None``. ``views``: strided views with a unit
    stride along the last axis will do (the attention's batched products take them)."""
    for a in arrays:
        if not backend.is_device_array(a) or np.dtype(a.dtype).name not in SUFFIX:
            return None
        if not (a.flags.c_contiguous or views and (a.shape[-1] == 1 or a.strides[-1] == a.itemsize)):
            return None
    if not enabled():
        return None
    k = _state.get("kernels")
    if k is None:
        k = _state["kernels"] = Kernels()
    return k


def _grid(n: int, threads: int = 256) -> tuple[int]:
    return (max(1, min(-(-n // threads), 8192)),)


class Kernels:
    """Launchers: each takes CuPy arrays, checks nothing the caller did not (shapes are the
    layers'), and launches on the current stream."""

    def __init__(self) -> None:
        import cupy as cp

        self.cp = cp
        self.module = cp.RawModule(code=cuda_src.source(), options=cuda_src.OPTIONS, name_expressions=None)
        self._fns: dict[str, Any] = {}

    def fn(self, name: str) -> Any:
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self.module.get_function(name)
        return f

    @staticmethod
    def sfx(a: Any) -> str:
        return SUFFIX[np.dtype(a.dtype).name]

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

    def layernorm_forward(self, x2: Any, w: Any, b: Any, eps: float, y2: Any) -> tuple[Any, Any]:
        """Rows of ``x2`` (n, d) normalised into ``y2``; returns the rows' float32 (mean, rstd)."""
        n, d = x2.shape
        mean = self.cp.empty(n, np.float32)  # kept by the layer for backward: not scratch
        rstd = self.cp.empty(n, np.float32)
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
        for part, out in ((pw, gw), (pb, gb)):
            self.fn(f"cols_add_{self.sfx(out)}")((-(-d // 128),), (128,), (part, np.int32(chunks), np.int32(d), out))
        return gx2

    # -- causal attention ------------------------------------------------------------------------
    def _scores(self, tag: str, q: Any) -> Any:
        b, h, t, _ = q.shape
        return shared.get(tag, (b, h, t, t), np.float32, self.cp)

    def _lowp(self, tag: str, s: Any, dtype: Any) -> Any:
        """``s`` itself for float32, else a 16-bit scratch of its shape (what the next product reads)."""
        return s if np.dtype(dtype) == np.float32 else shared.get(tag, s.shape, dtype, self.cp)

    def attention_forward(self, q: Any, k: Any, v: Any, out: Any) -> Any:
        """Causal softmax(q k^T / sqrt(hd)) v into ``out``; returns the rows' log-sum-exp (B, H, T)."""
        b, h, t, hd = q.shape
        scale = np.float32(1.0 / math.sqrt(hd))
        s = self._scores("att_s", q)
        gpu_gemm.run(q, k, s, trans_y=True)
        p = self._lowp("att_p", s, q.dtype)
        lse = self.cp.empty((b, h, t), np.float32)
        self.fn(f"attn_softmax_fwd_{self.sfx(p)}")((b * h * t,), (self._row_threads(t),),
                                                   (s, p, lse, np.int32(t), scale))
        gpu_gemm.run(p, v, out)
        return lse

    def attention_backward(self, dy: Any, q: Any, k: Any, v: Any, lse: Any, dq: Any, dk: Any, dv: Any) -> None:
        """``dq, dk, dv`` of :meth:`attention_forward`, the probabilities recomputed from ``lse``."""
        b, h, t, hd = q.shape
        scale = np.float32(1.0 / math.sqrt(hd))
        s, dp = self._scores("att_s", q), self._scores("att_dp", q)
        gpu_gemm.run(q, k, s, trans_y=True)
        gpu_gemm.run(dy, v, dp, trans_y=True)
        p, ds = self._lowp("att_p", s, q.dtype), self._lowp("att_ds", dp, q.dtype)
        self.fn(f"attn_softmax_bwd_{self.sfx(p)}")((b * h * t,), (self._row_threads(t),),
                                                   (s, dp, lse, p, ds, np.int32(t), scale))
        gpu_gemm.run(p, dy, dv, trans_x=True)
        gpu_gemm.run(ds, k, dq)
        gpu_gemm.run(ds, q, dk, trans_x=True)

    # -- softmax cross-entropy -------------------------------------------------------------------
    def cross_entropy_forward(self, x2: Any, target: Any, wrow: Any) -> tuple[Any, Any]:
        """Per row of ``x2`` (n, V): ``(lse, loss * weight)``, float32, in one pass over the logits."""
        n, v = x2.shape
        lse, nll = self.cp.empty(n, np.float32), self.cp.empty(n, np.float32)
        self.fn(f"ce_fwd_{self.sfx(x2)}")((n,), (512,), (x2, target, wrow if wrow is not None else np.uint64(0), lse,
                                                          nll, np.int64(v)))
        return lse, nll

    def cross_entropy_backward(self, x2: Any, target: Any, lse: Any, coef: Any, g2: Any) -> Any:
        """``g2 = (softmax(x2) - onehot(target)) * coef[row]`` (``g2`` may be ``x2``)."""
        n, v = x2.shape
        self.fn(f"ce_bwd_{self.sfx(x2)}")((n,), (512,), (x2, target, lse, coef, g2, np.int64(v)))
        return g2

    # -- dropout, embedding ----------------------------------------------------------------------
    def dropout(self, x: Any, y: Any, seed: int, thresh: int, scale: float) -> Any:
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
