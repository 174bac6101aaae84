"""Optimizers against hand-computed values, state round trips, clipping and schedules."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from hpctrain import nn, optim
from hpctrain.optim import schedules


def _run(opt, p, grads):
    out = []
    for g in grads:
        p.grad[...] = g
        opt.step()
        out.append(p.data.copy())
    return np.array(out)


def test_sgd_plain_momentum_nesterov_weight_decay_by_hand():
    p = nn.Parameter(np.array([1.0]), name="p")
    # plain: p -= 0.1 * 1 each step
    np.testing.assert_allclose(_run(optim.SGD([p], lr=0.1), p, [[1.0]] * 3)[:, 0], [0.9, 0.8, 0.7])
    p.data[...] = 1.0
    # momentum 0.9: buf = 1, 1.9, 2.71 -> p = 0.9, 0.71, 0.439
    np.testing.assert_allclose(_run(optim.SGD([p], lr=0.1, momentum=0.9), p, [[1.0]] * 3)[:, 0],
                               [0.9, 0.71, 0.439])
    p.data[...] = 1.0
    # nesterov: step = g + 0.9 * buf = 1.9, 2.71, 3.439 -> p = 0.81, 0.539, 0.1951
    np.testing.assert_allclose(
        _run(optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True), p, [[1.0]] * 3)[:, 0], [0.81, 0.539, 0.1951])
    p.data[...] = 1.0
    # weight decay alone with zero gradient: p *= 1 - 0.1 * 0.5 each step
    np.testing.assert_allclose(_run(optim.SGD([p], lr=0.1, weight_decay=0.5), p, [[0.0]] * 2)[:, 0],
                               [0.95, 0.9025])
    with pytest.raises(ValueError, match="nesterov"):
        optim.SGD([p], lr=0.1, nesterov=True)


def test_adam_and_adamw_by_hand():
    # lr 0.1, betas (0.9, 0.999), eps 1e-8, grads +0.5 then -0.5.
    # step 1: m_hat = 0.5, v_hat = 0.25 -> p = 1 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.900000002
    # step 2: m = 0.045 - 0.05 = -0.005, v = 0.00024975 + 0.00025 = 0.00049975,
    #         m_hat = -0.005 / 0.19, v_hat = 0.00049975 / 0.001999 = 0.25
    #         -> p += 0.1 * (0.005 / 0.19) / (0.5 + 1e-8) = 0.005263157789...
    p = nn.Parameter(np.array([1.0]), name="p")
    got = _run(optim.Adam([p], lr=0.1), p, [[0.5], [-0.5]])[:, 0]
    np.testing.assert_allclose(got, [0.900000002, 0.900000002 + 0.1 * (0.005 / 0.19) / (0.5 + 1e-8)], rtol=1e-12)
    # AdamW (decoupled, wd 0.1): p *= 1 - 0.1 * 0.1 before each Adam update
    # step 1: 0.99 - 0.099999998 = 0.890000002; step 2: 0.890000002 * 0.99 + 0.005263157789...
    p.data[...] = 1.0
    got = _run(optim.AdamW([p], lr=0.1, weight_decay=0.1), p, [[0.5], [-0.5]])[:, 0]
    s2 = 0.1 * (0.005 / 0.19) / (0.5 + 1e-8)
    np.testing.assert_allclose(got, [0.890000002, 0.890000002 * 0.99 + s2], rtol=1e-12)
    # Adam with L2 (wd 0.1): the gradient becomes g + 0.1 p: 0.6 (p = 1), then -0.5 + 0.09 = -0.41
    p.data[...] = 1.0
    got = _run(optim.Adam([p], lr=0.1, weight_decay=0.1), p, [[0.5], [-0.5]])[:, 0]
    p1 = 1 - 0.1 * 0.6 / (0.6 + 1e-8)
    g2 = -0.5 + 0.1 * p1
    m = 0.9 * 0.06 + 0.1 * g2
    v = 0.999 * 0.00036 + 0.001 * g2 * g2
    p2 = p1 - 0.1 * (m / 0.19) / (math.sqrt(v / (1 - 0.999**2)) + 1e-8)
    np.testing.assert_allclose(got, [p1, p2], rtol=1e-12)
    assert optim.AdamW([p]).weight_decay == 0.01 and optim.Adam([p]).weight_decay == 0.0
    assert optim.Adam([p]).betas == (0.9, 0.999) and optim.Adam([p]).eps == 1e-8 and optim.Adam([p]).lr == 1e-3


def _model():
    return nn.Sequential(nn.Linear(3, 4, rng=0, dtype=np.float64), nn.Tanh(), nn.Linear(4, 2, rng=1, dtype=np.float64))


@pytest.mark.parametrize("make", [
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                         schedule=schedules.cosine(10, warmup_steps=2)),
    lambda ps: optim.Adam(ps, lr=0.01, weight_decay=0.1, schedule=schedules.linear_warmup(4)),
    lambda ps: optim.AdamW(ps, lr=0.01, schedule=schedules.cosine(8, min_ratio=0.1)),
])
def test_state_dict_round_trip_continues_identically(make):
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(p.shape) for p in _model().parameters()] for _ in range(6)]
    a_model = _model()
    a = make(a_model.parameters())

    def step(opt, model, gs):
        for p, g in zip(model.parameters(), gs):
            p.grad[...] = g
        opt.step()

    for gs in grads[:3]:
        step(a, a_model, gs)
    sd = copy.deepcopy(a.state_dict())
    assert sd["step"] == 3 and set(sd["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(sd["state"]["0.weight"]) == set(a.state_keys)
    b_model = _model()
    b_model.load_state_dict(a_model.state_dict())
    b = make(b_model.parameters())
    b.load_state_dict(sd)
    assert b.step_count == 3 and b.current_lr == a.current_lr
    for gs in grads[3:]:
        step(a, a_model, gs)
        step(b, b_model, gs)
    for pa, pb in zip(a_model.parameters(), b_model.parameters()):
        np.testing.assert_array_equal(pa.data, pb.data)
    fresh_model = _model()
    fresh_model.load_state_dict(b_model.state_dict())
    fresh = make(fresh_model.parameters())  # without the state the next step differs
    step(fresh, fresh_model, grads[0])
    step(b, b_model, grads[0])
    assert not np.allclose(fresh_model.parameters()[0].data, b_model.parameters()[0].data)


def test_load_state_dict_refusals():
    m = _model()
    adam = optim.Adam(m.parameters())
    sgd = optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for p in m.parameters():
        p.grad[...] = 1.0
    adam.step()
    with pytest.raises(ValueError, match="state of a Adam"):
        sgd.load_state_dict(adam.state_dict())
    sd = copy.deepcopy(adam.state_dict())
    sd["state"]["nope"] = {}
    with pytest.raises(ValueError, match="unknown parameters: nope"):
        adam.load_state_dict(sd)
    sd = copy.deepcopy(adam.state_dict())
    sd["state"]["2.bias"]["exp_avg"] = np.zeros(5)
    with pytest.raises(ValueError, match=r"2\.bias/exp_avg: expected \(2,\), got \(5,\)"):
        adam.load_state_dict(sd)


def test_clip_grad_norm():
    a, b = nn.Parameter(np.zeros(2), name="a"), nn.Parameter(np.zeros(1), name="b")
    a.grad[...] = [3.0, 4.0]
    b.grad[...] = [12.0]
    assert optim.clip_grad_norm([a, b], 100.0) == pytest.approx(13.0)
    np.testing.assert_array_equal(a.grad, [3.0, 4.0])  # under the limit: untouched
    assert optim.clip_grad_norm([a, b], 6.5) == pytest.approx(13.0)
    coef = 6.5 / (13.0 + 1e-6)
    np.testing.assert_allclose(np.concatenate([a.grad, b.grad]), np.array([3.0, 4.0, 12.0]) * coef, rtol=1e-14)
    assert optim.grad_norm([a, b]) == pytest.approx(6.5, rel=1e-6)
    # a norm passed in (already reduced across ranks) decides the factor
    a.grad[...] = [1.0, 0.0]
    assert optim.clip_grad_norm([a], 1.0, norm=4.0) == 4.0
    np.testing.assert_allclose(a.grad, [1.0 / (4.0 + 1e-6), 0.0])
    # non-finite: reported, nothing scaled (the guard decides)
    a.grad[...] = [np.inf, 1.0]
    assert optim.clip_grad_norm([a], 1.0) == math.inf
    assert a.grad[1] == 1.0
    model = _model()
    for p in model.parameters():
        p.grad[...] = 1.0
    n = sum(p.grad.size for p in model.parameters())
    assert optim.clip_grad_norm(model, 1.0) == pytest.approx(math.sqrt(n))
    assert optim.grad_norm(model.parameters()) == pytest.approx(1.0, rel=1e-5)
    f32 = nn.Parameter(np.full(4, 1e20, dtype=np.float32), name="big")
    f32.grad[...] = 1e20  # squares overflow float32; the norm is accumulated in float64
    assert optim.grad_norm([f32]) == pytest.approx(2e20)
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_grad_norm([a], 0.0)


def test_schedules_values_and_use_in_optimizer():
    assert [schedules.constant()(s) for s in (0, 5, 10**6)] == [1.0, 1.0, 1.0]
    assert [schedules.linear_warmup(4)(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = schedules.cosine(10, warmup_steps=2, min_ratio=0.1)
    assert cos(0) == 0.5 and cos(1) == 1.0 and cos(2) == 1.0
    assert cos(6) == pytest.approx(0.55)  # half-way through the decay: 0.1 + 0.9 * 0.5
    assert cos(10) == pytest.approx(0.1) and cos(50) == pytest.approx(0.1)
    assert schedules.cosine(4)(2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="warmup_steps"):
        schedules.cosine(5, warmup_steps=5)
    with pytest.raises(ValueError, match="min_ratio"):
        schedules.cosine(5, min_ratio=2.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        schedules.linear_warmup(0)
    p = nn.Parameter(np.array([0.0]), name="p")
    opt = optim.SGD([p], lr=1.0, schedule=schedules.linear_warmup(4))
    steps = _run(opt, p, [[-1.0]] * 5)[:, 0]  # each step moves p by the scheduled lr
    np.testing.assert_allclose(np.diff(steps, prepend=0.0), [0.25, 0.5, 0.75, 1.0, 1.0])
    assert opt.config()["schedule"] == {"type": "LinearWarmup", "warmup_steps": 4}
    assert optim.SGD([p], lr=1.0).config()["schedule"] is None


def test_bad_hyperparameters_raise():
    p = nn.Parameter(np.zeros(1), name="p")
    for make in (lambda: optim.SGD([p], lr=-1.0), lambda: optim.SGD([p], lr=0.1, momentum=-0.5),
                 lambda: optim.Adam([p], betas=(1.0, 0.999)), lambda: optim.AdamW([p], weight_decay=-0.1),
                 lambda: optim.Adam([p], eps=-1.0), lambda: optim.SGD([], lr=0.1)):
        with pytest.raises(ValueError):
            make()
    q = nn.Parameter(np.zeros(1), name="p")
    with pytest.raises(ValueError, match="distinct names"):
        optim.SGD([p, q], lr=0.1)
