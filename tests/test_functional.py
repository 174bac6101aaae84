"""``hpctrain.nn.functional``: every operation gradchecked in float64 on NumPy and on the device
stand-in, and compared in forward with an independent reference where one is cheap."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import autograd as ag
from hpctrain import nn
from hpctrain.nn import functional as F

R = np.random.default_rng(7)


def _n(*shape):
    return R.standard_normal(shape)


def _pos(*shape):
    return R.uniform(0.5, 2.0, shape)


def _ints(high, *shape):
    return R.integers(0, high, shape)


# name: (function of the tensors, the float arrays checked, constants the function takes first)
CASES = {
    "add": (lambda a, b: F.add(a, b), [_n(2, 3), _n(3)], []),
    "sub": (lambda a, b: F.sub(a, b), [_n(2, 1), _n(3)], []),
    "mul": (lambda a, b: F.mul(a, b), [_n(2, 3), _n(2, 1)], []),
    "div": (lambda a, b: F.div(a, b), [_n(2, 3), _pos(3)], []),
    "neg": (F.neg, [_n(4)], []),
    "pow_scalar": (lambda a: F.pow(a, 3), [_n(5)], []),
    "pow_both": (F.pow, [_pos(4), _n(4)], []),
    "rpow": (lambda a: F.pow(2.0, a), [_n(4)], []),
    "matmul": (F.matmul, [_n(2, 3, 4), _n(4, 2)], []),
    "matmul_batched": (F.matmul, [_n(2, 1, 2, 3), _n(3, 3, 2)], []),
    "matmul_vector": (F.matmul, [_n(3), _n(2, 3, 4)], []),
    "exp": (F.exp, [_n(4)], []),
    "log": (F.log, [_pos(4)], []),
    "sqrt": (F.sqrt, [_pos(4)], []),
    "tanh": (F.tanh, [_n(4)], []),
    "sigmoid": (F.sigmoid, [_n(5) * 3], []),
    "relu": (F.relu, [_n(6)], []),
    "gelu": (F.gelu, [_n(2, 5)], []),
    "sum": (lambda a: F.sum(a, axis=1), [_n(2, 3, 2)], []),
    "sum_keep": (lambda a: F.sum(a, axis=(0, 2), keepdims=True), [_n(2, 3, 2)], []),
    "mean": (lambda a: F.mean(a, axis=-1), [_n(2, 3)], []),
    "mean_all": (F.mean, [_n(2, 3)], []),
    "max": (lambda a: F.max(a, axis=0), [_n(3, 4)], []),
    "max_all": (F.max, [_n(3, 4)], []),
    "logsumexp": (lambda a: F.logsumexp(a, axis=1), [_n(2, 4)], []),
    "softmax": (lambda a: F.softmax(a, 0), [_n(3, 2)], []),
    "log_softmax": (F.log_softmax, [_n(2, 4)], []),
    "reshape": (lambda a: F.reshape(a, (3, 2))[:, 1], [_n(2, 3)], []),
    "transpose": (lambda a: F.transpose(a, (2, 0, 1)), [_n(2, 3, 4)], []),
    "swapaxes": (lambda a: F.swapaxes(a, 0, -1), [_n(2, 3, 4)], []),
    "getitem_basic": (lambda a: F.getitem(a, (slice(1, None), None, slice(None, None, 2))), [_n(3, 4)], []),
    "getitem_repeat": (lambda i, a: F.getitem(a, i), [_n(3, 2)], [np.array([0, 2, 0, 0])]),
    "setitem": (lambda a, b: F.setitem(a, (slice(None), 1), b), [_n(3, 4), _n(3)], []),
    "concat": (lambda a, b: F.concat([a, b], axis=1), [_n(2, 3), _n(2, 1)], []),
    "split": (lambda a: F.split(a, [1, 3], axis=1)[1] * 2.0, [_n(2, 4)], []),
    "stack": (lambda a, b: F.stack([a, b], axis=1), [_n(2, 3), _n(2, 3)], []),
    "where": (lambda c, a, b: F.where(c, a, b), [_n(2, 3), _n(3)], [_n(2, 3) > 0]),
    "embedding": (lambda i, w: F.embedding(i, w), [_n(4, 3)], [_ints(4, 2, 3)]),
    "dropout": (lambda a: F.dropout(a, 0.4, rng=3), [_n(3, 4)], []),
    "layer_norm": (lambda a, w, b: F.layer_norm(a, 4, w, b), [_n(3, 4), _n(4), _n(4)], []),
    "layer_norm_2d": (lambda a, w: F.layer_norm(a, (2, 3), w), [_n(2, 2, 3), _n(2, 3)], []),
    "cross_entropy": (lambda t, a: F.cross_entropy(a, t), [_n(3, 4)], [_ints(4, 3)]),
    "cross_entropy_seq_weighted": (lambda t, w, a: F.cross_entropy(a, t, w), [_n(2, 3, 4)],
                                   [_ints(4, 2, 3), np.array([1.0, 0.5])]),
    "mse_loss": (lambda t, a: F.mse_loss(a, t), [_n(3, 2)], [_n(3, 2)]),
    "attention_causal_fused": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               [_n(1, 2, 3, 2), _n(1, 2, 3, 2), _n(1, 2, 3, 2)], []),
    "attention_composed": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.7),
                           [_n(2, 3, 2), _n(2, 4, 2), _n(2, 4, 3)], []),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=1), [_n(2, 2, 4, 3), _n(3, 2, 2, 2), _n(3)],
               []),
    "conv1d": (lambda x, w: F.conv1d(x, w, stride=2, padding=1), [_n(1, 2, 5), _n(2, 2, 3)], []),
    "max_pool2d": (lambda x: F.max_pool2d(x, 2, stride=1, padding=1), [_n(1, 2, 3, 3)], []),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, (2, 3), stride=2, padding=(1, 1)), [_n(2, 1, 3, 4)], []),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_op_passes_gradcheck(name, device):
    fn, arrays, constants = CASES[name]

    def put(a):
        return device.asarray(a) if device is not None and isinstance(a, np.ndarray) else a

    consts = [put(c) for c in constants]
    tensors = [ag.Tensor(put(a), requires_grad=True) for a in arrays]
    assert ag.gradcheck(lambda *t: fn(*consts, *t), tensors)
    if device is not None:  # it computed on the device: the output is a device array
        assert isinstance(fn(*consts, *tensors).data, device.ndarray)


# -- forward against independent references --------------------------------------------------------


def _conv_loop(x, w, b, stride, pad):
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0],) * 2, (pad[1],) * 2))
    oh, ow = (h + 2 * pad[0] - kh) // stride[0] + 1, (wd + 2 * pad[1] - kw) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride[0] : i * stride[0] + kh, j * stride[1] : j * stride[1] + kw]
            out[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w) + b
    return out


def test_conv2d_and_conv1d_match_a_direct_loop():
    x, w, b = _n(2, 3, 6, 5), _n(4, 3, 3, 2), _n(4)
    got = F.conv2d(ag.Tensor(x), ag.Tensor(w), ag.Tensor(b), stride=(2, 1), padding=(1, 0)).data
    np.testing.assert_allclose(got, _conv_loop(x, w, b, (2, 1), (1, 0)), atol=1e-12)
    x1, w1 = _n(2, 3, 7), _n(2, 3, 3)
    got1 = F.conv1d(ag.Tensor(x1), ag.Tensor(w1), stride=2, padding=1).data
    want1 = _conv_loop(x1[:, :, None], w1[:, :, None], np.zeros(2), (1, 2), (0, 1))[:, :, 0]
    np.testing.assert_allclose(got1, want1, atol=1e-12)


def _pool_loop(x, k, s, p, reduce, fill):
    xp = np.pad(x, ((0, 0), (0, 0), (p[0],) * 2, (p[1],) * 2), constant_values=fill)
    oh, ow = (xp.shape[2] - k[0]) // s[0] + 1, (xp.shape[3] - k[1]) // s[1] + 1
    return np.array([[[[reduce(xp[n, c, i * s[0] : i * s[0] + k[0], j * s[1] : j * s[1] + k[1]])
                        for j in range(ow)] for i in range(oh)] for c in range(x.shape[1])]
                     for n in range(x.shape[0])])


def test_pooling_matches_a_direct_loop():
    x = _n(2, 2, 5, 6)
    np.testing.assert_array_equal(F.max_pool2d(ag.Tensor(x), (2, 3), stride=(2, 2), padding=1).data,
                                  _pool_loop(x, (2, 3), (2, 2), (1, 1), np.max, -np.inf))
    np.testing.assert_allclose(F.avg_pool2d(ag.Tensor(x), 3, stride=1, padding=1).data,
                               _pool_loop(x, (3, 3), (1, 1), (1, 1), np.mean, 0.0), atol=1e-12)


def test_layer_norm_matches_the_layer_forward_and_backward():
    x, g = _n(2, 3, 5), _n(2, 3, 5)
    layer = nn.LayerNorm(5, dtype=np.float64)
    layer.weight.data[:] = _n(5)
    layer.bias.data[:] = _n(5)
    want = layer.forward(x).copy()
    want_gx = layer.backward(g).copy()
    xt, w, b = ag.Tensor(x, requires_grad=True), ag.Tensor(layer.weight.data.copy(), requires_grad=True), \
        ag.Tensor(layer.bias.data.copy(), requires_grad=True)
    y = F.layer_norm(xt, 5, w, b)
    y.backward(g)
    np.testing.assert_allclose(y.data, want, atol=1e-12)
    np.testing.assert_allclose(xt.grad, want_gx, atol=1e-12)
    np.testing.assert_allclose(w.grad, layer.weight.grad, atol=1e-12)
    np.testing.assert_allclose(b.grad, layer.bias.grad, atol=1e-12)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(F.layer_norm(ag.Tensor(x), 5).data, (x - mu) / np.sqrt(var + 1e-5), atol=1e-12)


def _attention_reference(q, k, v, causal, scale):
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def test_attention_fused_and_composed_match_a_reference_and_each_other():
    q, k, v, g = (_n(2, 3, 5, 4) for _ in range(4))
    scale = 1 / np.sqrt(4)
    tq, tk, tv = (ag.Tensor(a, requires_grad=True) for a in (q, k, v))
    fused = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    np.testing.assert_allclose(fused.data, _attention_reference(q, k, v, True, scale), atol=1e-12)
    fused.backward(g)
    cq, ck, cv = (ag.Tensor(a, requires_grad=True) for a in (q, k, v))
    composed = F.scaled_dot_product_attention(cq, ck, cv, is_causal=True, scale=scale)  # the composed path
    composed.backward(g)
    assert fused.grad_fn._fn.__name__ == "CausalAttention" and composed.grad_fn._fn.__name__ == "MatMul"
    for a, b in ((tq, cq), (tk, ck), (tv, cv)):
        np.testing.assert_allclose(a.grad, b.grad, atol=1e-12)
    np.testing.assert_allclose(F.scaled_dot_product_attention(ag.Tensor(q), ag.Tensor(k), ag.Tensor(v)).data,
                               _attention_reference(q, k, v, False, scale), atol=1e-12)


def test_losses_match_their_formulas():
    logits, t = _n(4, 3), _ints(3, 4)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(F.cross_entropy(ag.Tensor(logits), t).data, -logp[np.arange(4), t].mean())
    w = np.array([1.0, 0.0, 2.0, 1.0])
    np.testing.assert_allclose(F.cross_entropy(ag.Tensor(logits), t, w).data,
                               -(w * logp[np.arange(4), t]).sum() / w.sum())
    p, y = _n(3, 2), _n(3, 2)
    np.testing.assert_allclose(F.mse_loss(ag.Tensor(p), y).data, ((p - y) ** 2).mean())
    with pytest.raises(ValueError, match="constant"):
        F.mse_loss(ag.Tensor(p), ag.Tensor(y, requires_grad=True))
    from hpctrain.errors import DatasetError

    with pytest.raises(DatasetError, match="target 5"):
        F.cross_entropy(ag.Tensor(logits), np.array([0, 5, 1, 1]))


def test_activations_match_their_formulas():
    x = _n(3, 4)
    c = np.sqrt(2 / np.pi)
    np.testing.assert_allclose(F.gelu(ag.Tensor(x)).data, 0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x**3))),
                               atol=1e-12)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(F.softmax(ag.Tensor(x), 1).data, e / e.sum(1, keepdims=True), atol=1e-12)
    np.testing.assert_allclose(F.logsumexp(ag.Tensor(x), 1).data, np.log(np.exp(x).sum(1)), atol=1e-12)
    np.testing.assert_allclose(F.sigmoid(ag.Tensor(x)).data, 1 / (1 + np.exp(-x)), atol=1e-12)
    big = F.sigmoid(ag.Tensor(np.array([-1000.0, 1000.0]))).data  # no overflow
    np.testing.assert_array_equal(big, [0.0, 1.0])
    assert F.logsumexp(ag.Tensor(np.full(3, -np.inf))).data == -np.inf


def test_embedding_matches_the_layer_with_repeated_indices():
    idx, g = np.array([[1, 3, 1], [0, 1, 3]]), _n(2, 3, 2)
    layer = nn.Embedding(4, 2, rng=0, dtype=np.float64)
    want = layer.forward(idx).copy()
    layer.backward(g)
    w = ag.Tensor(layer.weight.data.copy(), requires_grad=True)
    y = F.embedding(idx, w)
    y.backward(g)
    np.testing.assert_array_equal(y.data, want)
    np.testing.assert_allclose(w.grad, layer.weight.grad, atol=1e-14)


def test_dropout_is_reproducible_from_its_generator_and_draws_as_the_layer():
    x = np.ones((4, 5))
    a = F.dropout(ag.Tensor(x), 0.5, rng=np.random.default_rng(11)).data
    layer = nn.Dropout(0.5, rng=np.random.default_rng(11))
    np.testing.assert_array_equal(a, layer.forward(x))
    g = np.random.default_rng(3)
    first, second = F.dropout(ag.Tensor(x), 0.5, rng=g).data, F.dropout(ag.Tensor(x), 0.5, rng=g).data
    assert not np.array_equal(first, second)  # one generator: a new mask each call
    t = ag.Tensor(x)
    assert F.dropout(t, 0.5, training=False) is t and F.dropout(t, 0.0) is t
    with pytest.raises(ValueError, match="dropout"):
        F.dropout(t, 1.0)


def test_astype_gradient_flows_back_in_the_input_dtype(device):
    x = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    t = ag.Tensor(device.asarray(x) if device else x, requires_grad=True)
    y = F.astype(t, np.float64)
    assert y.dtype == np.float64
    (y * y).sum().backward()
    assert t.grad.dtype == np.float32
    np.testing.assert_array_equal(t.grad.get() if device else t.grad, 2 * x)


def test_shape_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="does not fit"):
        F.conv2d(ag.Tensor(_n(1, 1, 2, 2)), ag.Tensor(_n(1, 1, 3, 3)))
    with pytest.raises(ValueError, match="channels"):
        F.conv2d(ag.Tensor(_n(1, 2, 4, 4)), ag.Tensor(_n(1, 3, 3, 3)))
    with pytest.raises(ValueError, match="trailing shape"):
        F.layer_norm(ag.Tensor(_n(2, 3)), 4)
    with pytest.raises(ValueError, match="add up"):
        F.split(ag.Tensor(_n(2, 3)), [1, 1], axis=1)
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        F.embedding(np.array([4]), ag.Tensor(_n(4, 2)))
    with pytest.raises(ValueError, match="do not fit"):
        F.scaled_dot_product_attention(ag.Tensor(_n(2, 3)), ag.Tensor(_n(2, 4)), ag.Tensor(_n(2, 3)))
