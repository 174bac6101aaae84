"""Convolution and pooling layers (issue 36, item 3): the explicit protocol against finite differences
and against ``F``'s ops (one code), one fused node on a tensor, shape errors that say what is wrong,
and a small CNN trained by SGD on arrays and on tensors alike."""

from __future__ import annotations

import numpy as np
import pytest

from gradcheck import check_module
from hpctrain import autograd as ag
from hpctrain import nn, optim
from hpctrain.nn import functional as F
from hpctrain.nn.layer_nodes import LayerCall


def _cases(rng):
    return {
        "conv2d": (nn.Conv2d(2, 3, 3, stride=(1, 2), padding=1, rng=0, dtype=np.float64), (2, 2, 5, 6)),
        "conv2d_nobias": (nn.Conv2d(2, 3, (2, 3), bias=False, rng=0, dtype=np.float64), (2, 2, 4, 5)),
        "conv1d": (nn.Conv1d(2, 3, 3, stride=2, padding=1, rng=0, dtype=np.float64), (2, 2, 7)),
        "maxpool": (nn.MaxPool2d(2), (2, 3, 4, 6)),
        "maxpool_pad": (nn.MaxPool2d(3, stride=2, padding=1), (1, 2, 5, 5)),
        "avgpool": (nn.AvgPool2d((2, 3), stride=1, padding=(1, 1)), (2, 2, 4, 5)),
        "flatten": (nn.Flatten(), (2, 3, 2, 2)),
    }


@pytest.mark.parametrize("name", list(_cases(np.random.default_rng(0))))
def test_layer_gradients_match_finite_differences(name, rng):
    layer, shape = _cases(rng)[name]
    # distinct values: a max pool's gradient is defined where no two entries of a window tie
    x = rng.permutation(np.prod(shape)).reshape(shape).astype(np.float64) / np.prod(shape)
    check_module(layer, x, rng, atol=1e-7)


@pytest.mark.parametrize("name", list(_cases(np.random.default_rng(0))))
def test_layer_on_a_tensor_is_one_node_equal_to_its_explicit_backward(name, rng):
    layer, shape = _cases(rng)[name]
    x = rng.standard_normal(shape)
    want = layer.forward(x)
    r = rng.standard_normal(want.shape)
    layer.zero_grad()
    want_gx = layer.backward(r)
    want_p = {n: p.grad.copy() for n, p in layer.named_parameters()}
    layer.zero_grad()
    xt = ag.Tensor(x, requires_grad=True)
    out = layer(xt)
    if name != "flatten":  # a reshape stays the graph's own view
        assert out.grad_fn._fn is LayerCall
    out.backward(r)
    np.testing.assert_allclose(out.data, want, rtol=1e-12)
    np.testing.assert_allclose(xt.grad, want_gx, rtol=1e-12)
    for n, p in layer.named_parameters():
        np.testing.assert_allclose(p.grad, want_p[n], rtol=1e-12, err_msg=n)


def test_layers_compute_what_the_functional_ops_compute(rng):
    x = rng.standard_normal((2, 2, 5, 6))
    conv = nn.Conv2d(2, 4, 3, stride=2, padding=1, rng=1, dtype=np.float64)
    np.testing.assert_array_equal(conv.forward(x), F.conv2d(x, conv.weight.data, conv.bias.data, 2, 1).data)
    c1 = nn.Conv1d(2, 4, 3, padding=2, rng=1, dtype=np.float64)
    x1 = x[:, :, 0]
    np.testing.assert_allclose(c1.forward(x1), F.conv1d(x1, c1.weight.data, c1.bias.data, padding=2).data,
                               rtol=1e-14)
    np.testing.assert_array_equal(nn.MaxPool2d(2).forward(x[..., :4, :]), F.max_pool2d(x[..., :4, :], 2).data)
    np.testing.assert_array_equal(nn.AvgPool2d(3, 1, 1).forward(x), F.avg_pool2d(x, 3, 1, 1).data)
    w = nn.Conv2d(3, 8, (5, 3), rng=0).weight
    assert w.shape == (8, 3, 5, 3) and w.dtype == np.float32 and np.abs(w.data).max() <= 1 / np.sqrt(45)


def test_bad_shapes_and_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"needs \(N, 3, H, W\), got \(2, 4, 5, 5\)"):
        nn.Conv2d(3, 2, 3).forward(np.zeros((2, 4, 5, 5), np.float32))
    with pytest.raises(ValueError, match=r"Conv1d\(3, ...\) needs \(N, 3, L\)"):
        nn.Conv1d(3, 2, 3).forward(np.zeros((2, 3, 5, 5), np.float32))
    with pytest.raises(ValueError, match="does not fit an input of 2"):
        nn.Conv2d(1, 1, 3).forward(np.zeros((1, 1, 2, 5), np.float32))
    with pytest.raises(ValueError, match="positive channel counts"):
        nn.Conv2d(0, 1, 3)
    with pytest.raises(ValueError, match="pair of ints"):
        nn.MaxPool2d((2, 2, 2))
    with pytest.raises(ValueError, match="needs \\(N, C, H, W\\)"):
        nn.AvgPool2d(2).forward(np.zeros((4, 4), np.float32))


def _cnn(seed):
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, rng=seed, dtype=np.float64), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 4, 3, padding=1, rng=seed + 1, dtype=np.float64), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Flatten(), nn.Linear(16, 3, rng=seed + 2, dtype=np.float64))


def test_a_cnn_trains_the_same_on_arrays_and_on_tensors(rng):
    x, y = rng.standard_normal((6, 1, 8, 8)), rng.integers(0, 3, 6)
    a, b = _cnn(3), _cnn(3)
    oa, ob = optim.SGD(a.parameters(), lr=0.5), optim.SGD(b.parameters(), lr=0.5)
    loss = nn.CrossEntropyLoss()
    losses = []
    for _ in range(5):
        oa.zero_grad()
        va = loss.forward(a.forward(x), y)
        a.backward(loss.backward())
        oa.step()
        ob.zero_grad()
        vb = loss(b(ag.Tensor(x)), y)
        vb.backward()
        ob.step()
        assert float(vb) == pytest.approx(va, rel=1e-12)
        losses.append(va)
    assert losses[-1] < losses[0]
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-12, err_msg=n)
