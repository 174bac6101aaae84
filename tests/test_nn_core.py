"""The model protocol, the basic layers and losses, and the optimizers' reference values."""

from __future__ import annotations

import numpy as np
import pytest

from gradcheck import check_loss, check_module
from hpctrain import nn, optim


def test_linear_and_relu_gradients(rng):
    check_module(nn.Linear(5, 3, rng=0, dtype=np.float64), rng.standard_normal((4, 5)), rng)
    check_module(nn.Linear(5, 3, rng=0, dtype=np.float64), rng.standard_normal((2, 3, 5)), rng)
    check_module(nn.ReLU(), rng.standard_normal((4, 5)) + 0.05, rng)


@pytest.mark.parametrize("weighted", [False, True])
def test_loss_gradients(rng, weighted):
    w = np.array([1.0, 0.0, 1.0, 1.0]) if weighted else None
    check_loss(nn.MSELoss(), rng.standard_normal((4, 3)), rng.standard_normal((4, 3)), w)
    check_loss(nn.CrossEntropyLoss(), rng.standard_normal((4, 5)), rng.integers(0, 5, 4), w)
    check_loss(nn.CrossEntropyLoss(), rng.standard_normal((4, 3, 5)), rng.integers(0, 5, (4, 3)), w)


def test_weighted_loss_ignores_padding(rng):
    pred, target = rng.standard_normal((4, 5)), rng.integers(0, 5, 4)
    loss = nn.CrossEntropyLoss()
    full = loss.forward(pred[:3], target[:3])
    masked = loss.forward(pred, target, np.array([1.0, 1.0, 1.0, 0.0]))
    assert masked == pytest.approx(full)


def test_cross_entropy_is_stable_and_matches_definition(rng):
    logits = rng.standard_normal((3, 4)) * 1000
    t = np.array([0, 1, 3])
    value = nn.CrossEntropyLoss().forward(logits, t)
    m = logits.max(1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(1, keepdims=True))
    assert np.isfinite(value) and value == pytest.approx(-logp[np.arange(3), t].mean())


def test_names_state_dict_and_refusals():
    model = nn.Sequential(nn.Linear(4, 8, rng=0), nn.ReLU(), nn.Linear(8, 2, rng=1))
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [p.name for p in model.parameters()] == names
    sd = {k: v.copy() * 0 + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(sd)
    assert all((p.data == 1).all() for p in model.parameters())
    bad = dict(sd)
    del bad["0.bias"]
    bad["extra"] = np.zeros(1)
    bad["2.weight"] = np.zeros((3, 3))
    with pytest.raises(ValueError, match=r"missing: 0\.bias.*unexpected: extra.*2\.weight"):
        model.load_state_dict(bad)
    sliced = model[2:]
    assert [n for n, _ in sliced.named_parameters()] == ["2.weight", "2.bias"]


def test_sgd_reference_values():
    p = nn.Parameter(np.array([1.0, -2.0]), name="p")
    opt = optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.5)
    grads = [np.array([0.5, 1.0]), np.array([-1.0, 0.25])]
    # By hand: g = grad + wd*p; buf = g (first), then 0.9*buf + g; p -= lr*buf.
    # step 1: g = [1.0, 0.0]  buf = [1.0, 0.0]  p = [0.9, -2.0]
    # step 2: g = [-0.55, -0.75] buf = [0.35, -0.75] p = [0.865, -1.925]
    for g in grads:
        p.grad[...] = g
        opt.step()
    np.testing.assert_allclose(p.data, [0.865, -1.925])
    q = nn.Parameter(np.array([1.0]), name="q")
    nest = optim.SGD([q], lr=0.1, momentum=0.5, nesterov=True)
    for g in ([1.0], [1.0]):  # buf 1 -> 1.5; steps 0.1*(1+0.5) and 0.1*(1+0.75)
        q.grad[...] = g
        nest.step()
    np.testing.assert_allclose(q.data, [1.0 - 0.15 - 0.175])


@pytest.mark.parametrize("cls,wd", [(optim.Adam, 0.0), (optim.AdamW, 0.1), (optim.Adam, 0.1)])
def test_adam_reference_values(cls, wd):
    p = nn.Parameter(np.array([0.5, -1.0]), name="p")
    opt = cls([p], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd)
    x, m, v = p.data.copy(), np.zeros(2), np.zeros(2)
    for t, g in enumerate([np.array([0.1, -0.3]), np.array([0.2, 0.4]), np.array([-0.5, 0.0])], 1):
        p.grad[...] = g
        opt.step()
        if cls is optim.AdamW:
            x = x * (1 - 0.01 * wd)
        else:
            g = g + wd * x
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        x = x - 0.01 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.99**t)) + 1e-8)
    np.testing.assert_allclose(p.data, x, rtol=1e-12)
    sd = opt.state_dict()
    assert sd["step"] == 3 and set(sd["state"]["p"]) == {"exp_avg", "exp_avg_sq"}
