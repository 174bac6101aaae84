"""The GPU kernels, checked without a GPU (issue 40): every CUDA source compiles for sm_90 through
NVRTC (``cuda-bindings`` and the NVRTC wheel, in the cuda-check extra; cached by the source's hash), and
each kernel's algorithm is checked against its NumPy twin as a NumPy model of what its blocks do.
On a GPU, ``make gpu-check`` runs the kernels themselves against the twins."""

from __future__ import annotations

import hashlib
import os
import pathlib

import numpy as np
import pytest

from hpctrain.nn import CrossEntropyLoss, cuda_src, gpu_gemm, philox
from hpctrain.nn.transformer import causal_attention, causal_attention_backward
from hpctrain.optim.multi_tensor import chunk_table

CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "hpctrain-nvrtc"


def _nvrtc_compile(source: str, arch: str = "sm_90") -> tuple[bool, str]:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"hpctrain.cu", 0, [], [])
    # CuPy adds -ftz=true to what we pass (cupy.cuda.compiler): compile as it will.
    opts = [o.encode() for o in (*cuda_src.OPTIONS, "-ftz=true", f"--gpu-architecture={arch}")]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    return err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")


def test_every_kernel_compiles_for_sm90_with_nvrtc():
    """A compile error fails CI, not the GPU run. Needs the cuda-check extra's ``cuda-bindings`` and
    ``nvidia-cuda-nvrtc`` (``make venv`` installs them); a passing source is remembered by hash."""
    pytest.importorskip("cuda.bindings.nvrtc",
                        reason="pip install cuda-bindings nvidia-cuda-nvrtc (the cuda-check extra)")
    source = cuda_src.source()
    digest = hashlib.sha256((source + repr(cuda_src.OPTIONS)).encode()).hexdigest()[:20]
    stamp = CACHE / f"{digest}.ok"
    if not stamp.exists():
        ok, log = _nvrtc_compile(source)
        assert ok, log
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text("compiled for sm_90\n")
    names = cuda_src.kernel_names()
    for name in names:
        assert f"void {name}(" in source
    assert len(names) == len(set(names)) == 3 * 14 + 2 + 3 + 2 * 9


def test_a_broken_source_is_refused():
    """The compile check can fail: a kernel with a type error does not compile."""
    pytest.importorskip("cuda.bindings.nvrtc")
    ok, log = _nvrtc_compile(cuda_src.PRELUDE + 'extern "C" __global__ void k(float* x) { x[0] = undefined_name; }')
    assert not ok and "undefined_name" in log


def test_philox_known_answers_and_dropout_words():
    """Random123's known-answer vectors for Philox4x32-10, and the stream's words by index."""
    z = philox.philox4x32(np.zeros((1, 4), np.uint32), (0, 0))[0]
    assert [hex(v) for v in z] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"]
    pi = philox.philox4x32(np.array([[0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]], np.uint32),
                           (0xA4093822, 0x299F31D0))[0]  # fmt: skip
    assert [hex(v) for v in pi] == ["0xd16cfe09", "0x94fdcceb", "0x5001e420", "0x24126ea1"]
    seed = (7 << 32) | 123
    w = philox.words(seed, 10)
    assert np.array_equal(w[4:8], philox.philox4x32(np.array([[1, 0, 0, 0]], np.uint32), (123, 7))[0])
    mask = philox.keep_mask(seed, (64, 1000), 0.25)
    assert abs(mask.mean() - 0.75) < 0.01 and np.array_equal(mask, philox.keep_mask(seed, (64, 1000), 0.25))


def test_dropout_draws_the_philox_words_on_the_cpu():
    """The CPU Dropout drops exactly the elements the kernel will (the same seed, the same words)."""
    from hpctrain.nn import Dropout

    d = Dropout(0.3, rng=5)
    seed = int(np.random.default_rng(5).integers(2**63))
    y = d.forward(np.ones((4, 50), np.float32))
    assert np.array_equal(y != 0, philox.keep_mask(seed, (4, 50), 0.3))
    assert np.allclose(y[y != 0], 1 / 0.7)


@pytest.mark.parametrize("trans", [(False, True), (False, False), (True, False)])
def test_batched_gemm_plans_multiply_strided_views(trans):
    """The cuBLAS arguments (column-major, leading dimensions, batch strides, one call or one per
    leading index) reproduce the products on q, k, v as strided views of the qkv output."""
    g = np.random.default_rng(0)
    b, t, h, hd = 3, 7, 2, 5
    qkv = g.standard_normal((b, t, 3 * h * hd))
    q, k, v = qkv.reshape(b, t, 3, h, hd).transpose(2, 0, 3, 1, 4)
    s = g.standard_normal((b, h, t, t))
    x, y = {(False, True): (q, k), (False, False): (s, v), (True, False): (s, q)}[trans]
    ref = (np.swapaxes(x, -1, -2) if trans[0] else x) @ (np.swapaxes(y, -1, -2) if trans[1] else y)
    out_base = np.zeros((b, t, 3 * h * max(hd, t)))
    out = out_base[..., : h * ref.shape[-1]].reshape(b, t, h, ref.shape[-1]).transpose(0, 2, 1, 3)
    calls = gpu_gemm.plan(x, y, out, *trans)
    gpu_gemm.emulate(calls, x, y, out)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    assert len(calls) == b  # strided views of a wider row: one call per batch entry
    contiguous = np.zeros(ref.shape)
    one = gpu_gemm.plan(np.ascontiguousarray(x), np.ascontiguousarray(y), contiguous, *trans)
    assert len(one) == 1 and one[0].batch == b * h


def _attention_model(q, k, v, dy):
    """The kernels' scheme in NumPy: forward keeps the rows' log-sum-exp only; backward recomputes
    S, takes dP = dY V^T, then P = exp(S scale - lse), dS = P (dP - sum(P dP)) scale."""
    t, hd = q.shape[-2], q.shape[-1]
    scale = 1.0 / np.sqrt(hd)
    causal = np.tril(np.ones((t, t), bool))
    s = q @ np.swapaxes(k, -1, -2) * scale
    m = np.where(causal, s, -np.inf).max(-1, keepdims=True)
    lse = m + np.log(np.where(causal, np.exp(s - m), 0).sum(-1, keepdims=True))
    p = np.where(causal, np.exp(s - lse), 0.0)
    y = p @ v
    s2 = q @ np.swapaxes(k, -1, -2)
    dp = dy @ np.swapaxes(v, -1, -2)
    p2 = np.where(causal, np.exp(s2 * scale - lse), 0.0)
    ds = p2 * (dp - (p2 * dp).sum(-1, keepdims=True)) * scale
    return y, np.swapaxes(p2, -1, -2) @ dy, ds @ k, np.swapaxes(ds, -1, -2) @ q


def test_attention_scheme_equals_the_numpy_attention():
    g = np.random.default_rng(1)
    q, k, v, dy = (g.standard_normal((2, 3, 9, 4)) for _ in range(4))
    y_ref, att = causal_attention(q, k, v, block=4)
    dq_ref, dk_ref, dv_ref = causal_attention_backward(dy, q, k, v, att, block=4)
    y, dv, dq, dk = _attention_model(q, k, v, dy)
    for got, ref in ((y, y_ref), (dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)


def _online_rows(x: np.ndarray, threads: int) -> np.ndarray:
    """The cross-entropy kernel's log-sum-exp: thread ``i`` runs an online (max, sum) over columns
    ``i, i + threads, ...``, then the block merges the pairs (``block_online``)."""
    n, v = x.shape
    m = np.full((n, threads), -np.inf)
    z = np.zeros((n, threads))
    for j in range(v):
        a, i = x[:, j], j % threads
        up = a > m[:, i]
        z[:, i] = np.where(up, z[:, i] * np.exp(m[:, i] - a) + 1.0, z[:, i] + np.exp(a - m[:, i]))
        m[:, i] = np.maximum(m[:, i], a)
    bm = m.max(1, keepdims=True)
    zz = np.where(np.isinf(m), 0.0, z * np.exp(m - bm)).sum(1)
    return bm[:, 0] + np.log(zz)


def test_cross_entropy_one_pass_scheme_equals_the_loss():
    g = np.random.default_rng(2)
    logits, target = g.standard_normal((2, 5, 37)) * 4, g.integers(0, 37, (2, 5))
    w = np.array([1.0, 0.5])
    loss = CrossEntropyLoss()
    ref = loss.forward(logits, target, weight=w)
    grad = loss.backward(scale=2.0)
    x = logits.reshape(-1, 37)
    lse = _online_rows(x, threads=8)
    wrow = np.repeat(w, 5)
    nll = (lse - x[np.arange(10), target.reshape(-1)]) * wrow
    assert nll.sum() / (w.sum() * 5) == pytest.approx(ref, rel=1e-12)
    coef = 2.0 / (w.sum() * 5) * wrow
    onehot = np.eye(37)[target.reshape(-1)]
    np.testing.assert_allclose(((np.exp(x - lse[:, None]) - onehot) * coef[:, None]).reshape(grad.shape), grad,
                               rtol=1e-10, atol=1e-14)  # fmt: skip


def test_layernorm_scheme_equals_the_layer():
    """Row statistics, the input gradient from (x, mean, rstd), and the weight gradients as column
    partial sums over chunks of rows added in chunk order (the kernels' deterministic sums)."""
    from hpctrain.nn import LayerNorm

    g = np.random.default_rng(3)
    x, go = g.standard_normal((150, 24)), g.standard_normal((150, 24))
    ln = LayerNorm(24, dtype=np.float64)
    ln.weight.data[:] = g.standard_normal(24)
    y_ref = ln.forward(x)
    gx_ref = ln.backward(go)
    mean = x.mean(1)
    rstd = 1.0 / np.sqrt(((x - mean[:, None]) ** 2).mean(1) + ln.eps)
    xh = (x - mean[:, None]) * rstd[:, None]
    np.testing.assert_allclose(xh * ln.weight.data + ln.bias.data, y_ref, rtol=1e-12, atol=1e-12)
    gw = go * ln.weight.data
    gx = (gw - gw.mean(1, keepdims=True) - xh * (gw * xh).mean(1, keepdims=True)) * rstd[:, None]
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-10, atol=1e-12)
    parts = [(go[r:r + 64] * xh[r:r + 64]).sum(0) for r in range(0, 150, 64)]
    np.testing.assert_allclose(sum(parts), ln.weight.grad, rtol=1e-12)


def test_optimizer_block_table_covers_every_element_once():
    sizes = [5, 0, 40000, 16384, 1]
    table = chunk_table(sizes, chunk=16384)
    seen = [np.zeros(n, int) for n in sizes]
    for t, a, e in table:
        assert 0 < e - a <= 16384
        seen[t][a:e] += 1
    assert all((s == 1).all() for s in seen)
    assert chunk_table([]).shape == (1, 3)  # nothing to do: one empty block
