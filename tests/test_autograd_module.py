"""``nn.Parameter`` as a leaf tensor, modules without a backward (an MLP and a CNN trained against
NumPy references), and modules with their own backward as one graph node (shared weights, several
calls in flight, leaf hooks)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from hpctrain import autograd as ag
from hpctrain import nn, optim
from hpctrain.nn import functional as F


def test_parameter_is_a_leaf_tensor_with_a_preallocated_gradient():
    p = nn.Parameter(np.ones((2, 3), np.float32), name="w")
    assert isinstance(p, ag.Tensor) and p.is_leaf and p.requires_grad
    assert p.grad.shape == (2, 3) and p.grad.dtype == np.float32 and not p.grad.any()
    assert not hasattr(p, "__dict__") and p.name == "w" and repr(p) == "Parameter('w', shape=(2, 3), dtype=float32)"
    grad = p.grad
    (p * 2.0).sum().backward()
    assert p.grad is grad  # accumulated in place, as hand-written backwards do
    np.testing.assert_array_equal(grad, 2.0)
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert q.name == "w" and np.array_equal(q.data, p.data) and np.array_equal(q.grad, p.grad)


def test_engine_accumulates_into_a_gradient_that_views_a_flat_buffer():
    """What data-parallel buckets and ZeRO do: ``p.grad`` is a view of one flat buffer."""
    a, b = nn.Parameter(np.ones(3)), nn.Parameter(np.ones((2, 2)))
    flat = np.zeros(7)
    a.grad, b.grad = flat[:3], flat[3:].reshape(2, 2)
    ((a * 3.0).sum() + (b * 2.0).sum()).backward()
    np.testing.assert_array_equal(flat, [3, 3, 3, 2, 2, 2, 2])
    a.data = np.full(3, 5.0)  # data may be replaced (ZeRO-3's gathers)
    (a * a).sum().backward()
    np.testing.assert_array_equal(flat[:3], 3 + 10.0)


# -- forward-only modules --------------------------------------------------------------------------


class MLP(nn.Module):
    """No backward written."""

    def __init__(self, g: np.random.Generator) -> None:
        self.w1 = nn.Parameter(g.standard_normal((4, 8)) * 0.5)
        self.b1 = nn.Parameter(g.standard_normal(8) * 0.1)
        self.w2 = nn.Parameter(g.standard_normal((8, 3)) * 0.5)
        self.b2 = nn.Parameter(np.zeros(3))

    def forward(self, x):
        return F.relu(x @ self.w1 + self.b1) @ self.w2 + self.b2


def _mlp_reference_step(p, x, y, lr):
    h_pre = x @ p["w1"] + p["b1"]
    h = np.maximum(h_pre, 0)
    z = h @ p["w2"] + p["b2"]
    e = np.exp(z - z.max(1, keepdims=True))
    prob = e / e.sum(1, keepdims=True)
    loss = -np.log(prob[np.arange(len(y)), y]).mean()
    dz = prob.copy()
    dz[np.arange(len(y)), y] -= 1
    dz /= len(y)
    dh = dz @ p["w2"].T * (h_pre > 0)
    grads = {"w2": h.T @ dz, "b2": dz.sum(0), "w1": x.T @ dh, "b1": dh.sum(0)}
    return loss, {k: p[k] - lr * grads[k] for k in p}


def test_forward_only_mlp_trains_as_the_numpy_reference():
    g = np.random.default_rng(0)
    model = MLP(g)
    ref = {n: p.data.copy() for n, p in model.named_parameters()}
    opt = optim.SGD(model.parameters(), lr=0.2)
    x, y = g.standard_normal((6, 4)), g.integers(0, 3, 6)
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)  # a plain array in: the module gets a tensor
        loss.backward()
        opt.step()
        want, ref = _mlp_reference_step(ref, x, y, 0.2)
        np.testing.assert_allclose(float(loss), want, rtol=1e-12)
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.data, ref[n], rtol=1e-12, atol=1e-14, err_msg=n)


class CNN(nn.Module):
    def __init__(self, g: np.random.Generator) -> None:
        self.k = nn.Parameter(g.standard_normal((2, 1, 3, 3)) * 0.5)
        self.kb = nn.Parameter(g.standard_normal(2) * 0.1)
        self.w = nn.Parameter(g.standard_normal((8, 3)) * 0.5)

    def forward(self, x):
        h = F.max_pool2d(F.relu(F.conv2d(x, self.k, self.kb, padding=1)), 2)
        return F.reshape(h, (h.shape[0], -1)) @ self.w


def _cnn_reference_step(p, x, y, lr):
    """Forward and backward by loops (no im2col), cross-entropy, one SGD step."""
    n, _, hh, ww = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    conv = np.zeros((n, 2, hh, ww))
    for i in range(hh):
        for j in range(ww):
            conv[:, :, i, j] = np.einsum("nchw,ochw->no", xp[:, :, i : i + 3, j : j + 3], p["k"]) + p["kb"]
    act = np.maximum(conv, 0)
    pooled = act.reshape(n, 2, hh // 2, 2, ww // 2, 2).max(axis=(3, 5))
    flat = pooled.reshape(n, -1)
    z = flat @ p["w"]
    e = np.exp(z - z.max(1, keepdims=True))
    prob = e / e.sum(1, keepdims=True)
    dz = prob.copy()
    dz[np.arange(n), y] -= 1
    dz /= n
    gw = flat.T @ dz
    dpool = (dz @ p["w"].T).reshape(pooled.shape)
    dact = np.zeros_like(act)
    for i in range(hh // 2):
        for j in range(ww // 2):
            win = act[:, :, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2].reshape(n, 2, 4)
            first = win.argmax(-1)
            for a in range(n):
                for c in range(2):
                    r, s = divmod(int(first[a, c]), 2)
                    dact[a, c, 2 * i + r, 2 * j + s] += dpool[a, c, i, j]
    dconv = dact * (conv > 0)
    gk = np.zeros_like(p["k"])
    for i in range(hh):
        for j in range(ww):
            gk += np.einsum("no,nchw->ochw", dconv[:, :, i, j], xp[:, :, i : i + 3, j : j + 3])
    grads = {"k": gk, "kb": dconv.sum((0, 2, 3)), "w": gw}
    return {k: p[k] - lr * grads[k] for k in p}


def test_forward_only_cnn_trains_as_the_loop_reference():
    g = np.random.default_rng(1)
    model = CNN(g)
    ref = {n: p.data.copy() for n, p in model.named_parameters()}
    opt = optim.SGD(model.parameters(), lr=0.3)
    x, y = g.standard_normal((3, 1, 4, 4)), g.integers(0, 3, 3)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ref = _cnn_reference_step(ref, x, y, 0.3)
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.data, ref[n], rtol=1e-10, atol=1e-12, err_msg=n)


# -- modules with their own backward, on tensors ----------------------------------------------------


class Twice(nn.Module):
    """A forward-only module that runs one ``nn.Linear`` (a hand-written backward) twice."""

    def __init__(self) -> None:
        self.fc = nn.Linear(3, 3, rng=0, dtype=np.float64)
        self.scale = nn.Parameter(np.full(3, 0.5))

    def forward(self, x):
        return x + F.tanh(self.fc(x)) * self.fc(x * 2.0) * self.scale


def test_a_layer_used_twice_gets_both_gradients():
    model = Twice()
    x, r = np.random.default_rng(2).standard_normal((4, 3)), np.random.default_rng(3).standard_normal((4, 3))
    xt = ag.Tensor(x, requires_grad=True)
    (model(xt) * r).sum().backward()
    w, b, s = model.fc.weight.data, model.fc.bias.data, model.scale.data
    h1, h2 = x @ w + b, (2 * x) @ w + b
    t = np.tanh(h1)
    d1 = r * s * h2 * (1 - t * t)  # through the first use
    d2 = r * s * t  # through the second
    np.testing.assert_allclose(model.fc.weight.grad, x.T @ d1 + (2 * x).T @ d2, rtol=1e-12)
    np.testing.assert_allclose(model.fc.bias.grad, d1.sum(0) + d2.sum(0), rtol=1e-12)
    np.testing.assert_allclose(model.scale.grad, (r * t * h2).sum(0), rtol=1e-12)
    np.testing.assert_allclose(xt.grad, r + d1 @ w.T + 2 * d2 @ w.T, rtol=1e-12)
    assert model.fc.cache is None  # the calls' state lived in the graph, not the module


def test_hook_fires_once_for_a_layer_used_twice_after_both():
    model = Twice()
    fired = []
    w = model.fc.weight
    w.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.copy()))
    (model(np.ones((2, 3))) ** 2).sum().backward()
    assert len(fired) == 1
    np.testing.assert_array_equal(fired[0], w.grad)


def test_calls_in_flight_keep_their_own_state():
    """Two micro-batches forward, backward in the other order (a pipeline's 1F1B does this)."""
    lin = nn.Linear(3, 2, rng=4, dtype=np.float64)
    g = np.random.default_rng(5)
    x1, x2, g1, g2 = g.standard_normal((4, 3)), g.standard_normal((5, 3)), g.standard_normal((4, 2)), \
        g.standard_normal((5, 2))
    y1, y2 = lin(ag.Tensor(x1)), lin(ag.Tensor(x2))
    y2.backward(g2)
    y1.backward(g1)
    np.testing.assert_allclose(lin.weight.grad, x1.T @ g1 + x2.T @ g2, rtol=1e-12)
    np.testing.assert_allclose(lin.bias.grad, g1.sum(0) + g2.sum(0), rtol=1e-12)


@pytest.mark.parametrize("build", ["sequential", "gpt"])
def test_explicit_models_on_tensors_equal_their_own_backward(build):
    """A whole explicit model (each layer of a Sequential, or the GPT as one node) on a tensor:
    the same gradients as its forward/backward on arrays."""
    g = np.random.default_rng(6)
    if build == "sequential":
        from conftest import make_mlp

        model, x, y = make_mlp(4, 3, width=5, depth=3, seed=1), g.standard_normal((6, 4)), g.integers(0, 3, 6)
    else:
        model = nn.GPT(vocab_size=7, block_size=5, d_model=8, n_heads=2, n_layers=2, rng=0, dtype=np.float64)
        x, y = g.integers(0, 7, (2, 5)), g.integers(0, 7, (2, 5))
    loss = nn.CrossEntropyLoss()
    loss.forward(model.forward(x), y)
    model.backward(loss.backward())
    want = {n: p.grad.copy() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(ag.Tensor(x)), y).backward()
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, want[n], rtol=1e-10, atol=1e-13, err_msg=n)


def test_explicit_module_on_arrays_is_unchanged_and_under_no_grad_keeps_nothing():
    lin = nn.Linear(2, 2, rng=0)
    out = lin.forward(np.ones((1, 2), np.float32))  # the explicit protocol: forward, then backward
    assert isinstance(out, np.ndarray) and lin.cache is not None
    with ag.no_grad():  # nothing to record: arrays in, arrays out
        assert isinstance(lin(np.ones((1, 2), np.float32)), np.ndarray)
    with ag.no_grad():
        t = lin(ag.Tensor(np.ones((1, 2), np.float32)))
    assert isinstance(t, ag.Tensor) and not t.requires_grad and lin.cache is None
