"""Layers beyond Linear/ReLU: finite-difference gradients (float64), reference forwards, structure."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradcheck import check_module
from hpctrain import nn

F64 = {"dtype": np.float64}


def test_activation_gradients(rng):
    x = rng.standard_normal((3, 4, 5))
    check_module(nn.GELU(), x, rng)
    check_module(nn.Tanh(), x, rng)


def test_gelu_is_gpt2_tanh_approximation():
    x = np.linspace(-5, 5, 101)
    y = nn.GELU().forward(x)
    ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-15)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    np.testing.assert_allclose(y, exact, atol=1e-3)  # close to the erf form, but not equal
    assert np.abs(y - exact).max() > 1e-6


def test_layernorm_gradients_and_definition(rng):
    ln = nn.LayerNorm(6, **F64)
    ln.weight.data[...] = rng.standard_normal(6)
    ln.bias.data[...] = rng.standard_normal(6)
    x = rng.standard_normal((2, 3, 6)) * 3 + 1
    check_module(ln, x, rng)
    y = ln.forward(x)
    xhat = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, xhat * ln.weight.data + ln.bias.data, rtol=1e-12)


def test_embedding_gradients_with_repeated_ids(rng):
    emb = nn.Embedding(5, 3, rng=0, **F64)
    idx = np.array([[0, 2, 2], [4, 0, 2]])
    check_module(emb, idx, rng)
    assert emb.forward(idx).shape == (2, 3, 3)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        emb.forward(np.array([5]))
    with pytest.raises(TypeError, match="integer"):
        emb.forward(np.array([0.0]))


def test_dropout_seeded_scaled_and_off_in_eval(rng):
    x = np.ones((200, 50), dtype=np.float32)
    a, b = nn.Dropout(0.3, rng=7), nn.Dropout(0.3, rng=7)
    ya, yb = a.forward(x), b.forward(x)
    np.testing.assert_array_equal(ya, yb)  # same seed, same mask
    assert ya.dtype == np.float32
    assert set(np.unique(ya)) <= {0.0, np.float32(1 / 0.7)}
    assert abs((ya == 0).mean() - 0.3) < 0.02
    assert not np.array_equal(a.forward(x), ya)  # the generator advances
    g = rng.standard_normal(x.shape)
    y = a.forward(x)
    np.testing.assert_allclose(a.backward(g), g * y, rtol=1e-6)  # x is ones, so y is the mask
    a.eval()
    assert a.forward(x) is x and a.backward(g) is g
    assert nn.Dropout(0.0, rng=1).forward(x) is x
    with pytest.raises(ValueError, match="probability"):
        nn.Dropout(1.0)


def test_dropout_gradients(rng):
    d = nn.Dropout(0.4, rng=3)
    state = d.rng.bit_generator.state

    def reset():
        d.rng.bit_generator.state = state

    check_module(d, rng.standard_normal((4, 6)), rng, before=reset)


def test_mlp_attention_block_gpt_gradients(rng):
    x = rng.standard_normal((2, 4, 8))
    check_module(nn.MLP(8, 12, rng=0, **F64), x, rng)
    check_module(nn.CausalSelfAttention(8, 2, rng=1, **F64), x, rng)
    check_module(nn.TransformerBlock(8, 2, 12, rng=2, **F64), x, rng)
    gpt = nn.GPT(vocab_size=7, block_size=5, d_model=8, n_heads=2, n_layers=2, d_hidden=12, rng=3, **F64)
    check_module(gpt, rng.integers(0, 7, (2, 4)), rng)


def test_attention_matches_per_head_loop_and_is_causal(rng):
    att = nn.CausalSelfAttention(8, 4, rng=0, **F64)
    x = rng.standard_normal((2, 5, 8))
    y = att.forward(x)
    qkv = x @ att.qkv.weight.data + att.qkv.bias.data
    hd = 2
    out = np.zeros((2, 5, 8))
    for b in range(2):
        for h in range(4):
            q, k, v = (qkv[b, :, j * 8 + h * hd: j * 8 + (h + 1) * hd] for j in range(3))
            for i in range(5):
                s = q[i] @ k[: i + 1].T / math.sqrt(hd)
                p = np.exp(s - s.max())
                out[b, i, h * hd:(h + 1) * hd] = (p / p.sum()) @ v[: i + 1]
    np.testing.assert_allclose(y, out @ att.proj.weight.data + att.proj.bias.data, rtol=1e-10)
    x2 = x.copy()
    x2[:, 3:] += 1.0  # changing the future leaves the past unchanged
    np.testing.assert_allclose(att.forward(x2)[:, :3], y[:, :3], rtol=1e-12)
    with pytest.raises(ValueError, match="divide"):
        nn.CausalSelfAttention(8, 3)


def test_contract_structure_and_float32_default(rng):
    gpt = nn.GPT(vocab_size=11, block_size=6, d_model=8, n_heads=2, n_layers=2, rng=0)
    names = [n for n, _ in gpt.named_parameters()]
    assert names[:2] == ["tok_emb.weight", "pos_emb.weight"]
    assert names[-3:] == ["ln_f.weight", "ln_f.bias", "head.weight"]
    for i in range(2):
        for part in ("ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                     "attn.proj.bias", "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias",
                     "mlp.fc2.weight", "mlp.fc2.bias"):
            assert f"blocks.{i}.{part}" in names
    assert gpt.blocks[0].mlp.fc1.weight.shape == (8, 32)  # d_hidden defaults to 4 * d_model
    assert gpt.blocks[0].attn.qkv.weight.shape == (8, 24) and gpt.blocks[0].attn.n_heads == 2
    assert isinstance(gpt.blocks[1].mlp.act, nn.GELU)
    assert all(p.dtype == np.float32 for p in gpt.parameters())
    idx = rng.integers(0, 11, (3, 6))
    logits = gpt.forward(idx)
    assert logits.shape == (3, 6, 11) and logits.dtype == np.float32
    assert gpt.backward(np.ones_like(logits)) is None
    assert all(p.grad.dtype == np.float32 for p in gpt.parameters())
    with pytest.raises(ValueError, match="block_size"):
        gpt.forward(rng.integers(0, 11, (3, 7)))
    same = nn.GPT(vocab_size=11, block_size=6, d_model=8, n_heads=2, n_layers=2, rng=0)
    np.testing.assert_array_equal(same.forward(idx), logits)  # reproducible from the seed


def test_all_layers_keep_float32(rng):
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    for m in (nn.GELU(), nn.Tanh(), nn.LayerNorm(8), nn.Dropout(0.5, rng=0), nn.MLP(8, 16, rng=0),
              nn.CausalSelfAttention(8, 2, rng=0), nn.TransformerBlock(8, 2, 16, rng=0)):
        y = m.forward(x)
        assert y.dtype == np.float32, type(m).__name__
        assert m.backward(np.ones_like(y)).dtype == np.float32, type(m).__name__


def test_block_and_gpt_compose_their_parts(rng):
    blk = nn.TransformerBlock(8, 2, 12, rng=0, **F64)
    x = rng.standard_normal((2, 5, 8))
    h = x + blk.attn.forward(blk.ln1.forward(x))
    np.testing.assert_allclose(blk.forward(x), h + blk.mlp.forward(blk.ln2.forward(h)), rtol=1e-12)
    gpt = nn.GPT(vocab_size=7, block_size=5, d_model=8, n_heads=2, n_layers=2, rng=1, **F64)
    idx = rng.integers(0, 7, (2, 4))
    e = gpt.tok_emb.weight.data[idx] + gpt.pos_emb.weight.data[:4]
    for b in gpt.blocks:
        e = b.forward(e)
    ref = gpt.ln_f.forward(e) @ gpt.head.weight.data
    np.testing.assert_allclose(gpt.forward(idx), ref, rtol=1e-12)
    assert gpt.head.bias is None


def test_linear_without_bias_gradients(rng):
    check_module(nn.Linear(4, 3, bias=False, rng=0, **F64), rng.standard_normal((2, 3, 4)), rng)


def test_loss_scale_and_sequence_shape(rng):
    logits, t = rng.standard_normal((3, 4, 6)), rng.integers(0, 6, (3, 4))
    ce = nn.CrossEntropyLoss()
    value = ce.forward(logits, t)
    g = ce.backward()
    np.testing.assert_allclose(ce.backward(0.25), 0.25 * g)
    flat = nn.CrossEntropyLoss()
    assert flat.forward(logits.reshape(12, 6), t.reshape(12)) == pytest.approx(value)
    np.testing.assert_allclose(flat.backward().reshape(3, 4, 6), g, rtol=1e-12)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(g, (p - np.eye(6)[t]) / 12, rtol=1e-10)
    x32 = logits.astype(np.float32)
    ce.forward(x32, t)
    assert ce.backward().dtype == np.float32
    mse = nn.MSELoss()
    mse.forward(x32, x32 * 0)
    assert mse.backward().dtype == np.float32


def test_bad_shapes_raise_clear_errors(rng):
    with pytest.raises(ValueError, match=r"LayerNorm\(4\)"):
        nn.LayerNorm(4).forward(np.zeros((2, 5)))
    with pytest.raises(ValueError, match=r"needs \(B, T, 8\)"):
        nn.CausalSelfAttention(8, 2).forward(np.zeros((2, 8)))
    with pytest.raises(ValueError, match="n_layers"):
        nn.GPT(vocab_size=5, block_size=4, d_model=8, n_heads=2, n_layers=0)
    with pytest.raises(ValueError, match="divide"):
        nn.GPT(vocab_size=5, block_size=4, d_model=8, n_heads=3, n_layers=1)
    with pytest.raises(ValueError, match=r"CrossEntropyLoss: logits"):
        nn.CrossEntropyLoss().forward(np.zeros((2, 3, 4)), np.zeros(2, dtype=int))
