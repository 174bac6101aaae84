"""The fused CPU kernels (hpctrain.nn.fused, Numba) against the NumPy code they replace, which stays
the fallback: GELU and Adam bitwise, LayerNorm, the attention softmax and the embedding backward to
rounding; and the HPCTRAIN_FUSED switch."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hpctrain import nn, optim
from hpctrain.errors import ConfigError
from hpctrain.nn import fused

pytest.importorskip("numba", reason="the fused kernels need Numba (pip install numba)")

TOL = {np.float32: {"rtol": 1e-5, "atol": 1e-6}, np.float64: {"rtol": 1e-12, "atol": 1e-14}}


def _both(monkeypatch, run):
    """``run()`` with the kernels on, then with the NumPy code (HPCTRAIN_FUSED=0)."""
    monkeypatch.setenv("HPCTRAIN_FUSED", "1")
    got = run()
    monkeypatch.setenv("HPCTRAIN_FUSED", "0")
    want = run()
    return got, want


def _ln(d, dtype, rng):
    ln = nn.LayerNorm(d, dtype=dtype)
    ln.weight.data[...] = rng.standard_normal(d)
    ln.bias.data[...] = rng.standard_normal(d)
    return ln


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 10, 7), (2, 300, 1024)])  # the second: several chunks and a short one
def test_fused_gelu_is_bitwise_the_numpy_code(monkeypatch, shape, dtype, rng):
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    x[0, 0, :3] = [0.0, -0.0, 40.0]
    g = rng.standard_normal(shape).astype(dtype)

    def run():
        layer = nn.GELU()
        y = layer.forward(x).copy()
        return y, layer.backward(g).copy()

    got, want = _both(monkeypatch, run)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_array_equal(a, b)


def _layernorm_run(x, grads):
    ln = _ln(x.shape[-1], x.dtype, np.random.default_rng(5))
    outs = []
    for g in grads:  # two backward passes: the parameter gradients accumulate
        outs.append(ln.forward(x).copy())
        outs.append(ln.backward(g.astype(x.dtype)).copy())
    return outs + [ln.weight.grad.copy(), ln.bias.grad.copy()]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_layernorm_matches_the_numpy_code(monkeypatch, dtype, rng):
    x = (rng.standard_normal((4, 9, 48)) * 2 + 0.5).astype(dtype)
    grads = [rng.standard_normal(x.shape) for _ in range(2)]
    got, want = _both(monkeypatch, lambda: _layernorm_run(x, grads))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(a, b, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["rtol"] * np.abs(b).max())


def test_fused_layernorm_is_at_least_as_accurate_as_the_numpy_code(monkeypatch, rng):
    """Rows far from zero mean with a small spread, where float32 sums lose digits: the kernels (float64
    sums) stay closer to the float64 result than the NumPy code (float32 BLAS sums)."""
    x = (rng.standard_normal((4, 9, 256)) * 0.1 + 30).astype(np.float32)
    grads = [rng.standard_normal(x.shape) for _ in range(2)]
    got, ours = _both(monkeypatch, lambda: _layernorm_run(x, grads))
    exact = _layernorm_run(x.astype(np.float64), grads)
    for a, b, e in zip(got, ours, exact):
        assert np.abs(a - e).max() <= max(np.abs(b - e).max(), 1e-6 * np.abs(e).max())


def test_layers_take_the_numpy_code_for_arrays_the_kernels_do_not_take(monkeypatch, rng):
    """Strided or mixed-dtype inputs still work (through the NumPy code, bitwise its results)."""
    x = rng.standard_normal((4, 6, 16)).astype(np.float32)[:, ::2]  # not contiguous
    g = rng.standard_normal((4, 6, 16)).astype(np.float32)[:, ::2]
    assert fused.usable(x) is None

    def run():
        ln = _ln(16, np.float32, np.random.default_rng(0))
        return ln.forward(x).copy(), ln.backward(g).copy(), ln.weight.grad.copy()

    got, want = _both(monkeypatch, run)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setenv("HPCTRAIN_FUSED", "1")
    gelu = nn.GELU()
    y64 = gelu.forward(x.astype(np.float64))
    assert gelu.backward(np.ones(x.shape, np.float32)).dtype == y64.dtype == np.float64  # mixed dtypes


@pytest.mark.parametrize("cls,wd", [(optim.AdamW, 0.1), (optim.AdamW, 0.0), (optim.Adam, 0.0), (optim.Adam, 0.05)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_adam_is_bitwise_the_numpy_code(monkeypatch, cls, wd, dtype, rng):
    shapes = [(5, 3), (7,), (2, 2, 2), (300, 70)]
    params = [nn.Parameter(rng.standard_normal(s).astype(dtype), name=f"p{i}") for i, s in enumerate(shapes)]
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(4)]

    def run():
        ps = copy.deepcopy(params)
        opt = cls(ps, lr=0.01, weight_decay=wd, schedule=lambda step: 1.0 / (step + 1))
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad[...] = g
            opt.step()
        return [p.data for p in ps] + [opt.state[p.name][k] for p in ps for k in ("exp_avg", "exp_avg_sq")]

    got, want = _both(monkeypatch, run)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_gpt_step_with_the_kernels_matches_the_numpy_code(monkeypatch, rng):
    idx = rng.integers(0, 11, (2, 12))
    target = rng.integers(0, 11, (2, 12))

    def run():
        model = nn.GPT(vocab_size=11, block_size=12, d_model=16, n_heads=2, n_layers=2, rng=4, dtype=np.float64)
        opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        loss = nn.CrossEntropyLoss()
        grads, losses = None, []
        for _ in range(3):
            opt.zero_grad()
            losses.append(loss.forward(model.forward(idx), target))
            model.backward(loss.backward())
            grads = grads or [p.grad.copy() for p in model.parameters()]
            opt.step()
        return [np.array(losses)] + grads + [p.data.copy() for p in model.parameters()]

    got, want = _both(monkeypatch, run)
    # Gradients that are rounding noise (the key bias's are zero analytically) move a weight by up
    # to lr * noise / eps in Adam, about 1e-11 here: the tolerance leaves room for that, no more.
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("t,block", [(7, 3), (16, 16), (40, 64), (128, 64)])
def test_fused_attention_softmax_matches_the_numpy_code(monkeypatch, t, block, dtype, rng):
    q, k, v, dy = ((rng.standard_normal((2, 3, t, 8)) * 2).astype(dtype) for _ in range(4))

    def run():
        y, att = nn.causal_attention(q, k, v, block=block)
        att = att.copy()
        return [y, att, *nn.causal_attention_backward(dy, q, k, v, att, block=block)]

    got, want = _both(monkeypatch, run)
    assert not np.triu(got[1], k=1).any()  # nothing above the diagonal: no look at the future
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(a, b, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["rtol"] * np.abs(b).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_embedding_backward_matches_the_numpy_code(monkeypatch, dtype, rng):
    """To rounding: NumPy's reduceat sums an index's rows in another order than one after another."""
    idx = rng.integers(0, 9, (4, 33))
    grads = [rng.standard_normal((4, 33, 16)).astype(dtype) for _ in range(2)]

    def run():
        emb = nn.Embedding(9, 16, rng=0, dtype=dtype)
        out = []
        for g in grads:
            emb.forward(idx)
            emb.backward(g)
            out.append(emb.weight.grad.copy())
        return out

    (once, twice), (want_once, want_twice) = _both(monkeypatch, run)
    np.testing.assert_allclose(once, want_once, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"])
    np.testing.assert_allclose(twice, want_twice, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"])


def test_the_switch(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_FUSED", "0")
    assert fused.kernels() is None
    monkeypatch.delenv("HPCTRAIN_FUSED")
    assert fused.kernels() is not None  # Numba is importable here (the module skips otherwise)
    monkeypatch.setenv("HPCTRAIN_FUSED", "maybe")
    with pytest.raises(ConfigError, match="HPCTRAIN_FUSED='maybe' must be 0 or 1"):
        fused.kernels()
    # Without Numba: unset falls back to NumPy, 1 refuses.
    monkeypatch.setattr(fused, "_loaded", [None])
    monkeypatch.delenv("HPCTRAIN_FUSED")
    assert fused.kernels() is None
    monkeypatch.setenv("HPCTRAIN_FUSED", "1")
    with pytest.raises(ConfigError, match="needs Numba"):
        fused.kernels()
