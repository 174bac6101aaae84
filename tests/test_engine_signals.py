"""When the autograd engine tells a parameter's gradient is complete (its post-accumulate hooks, the
signal a data-parallel bucket and ZeRO start from): once per backward, after the last use, from
whatever computed the gradient: operations, a weight used twice, an explicit module's node (as
soon as the submodule that owns it is done), a recomputed block, a nested backward."""

from __future__ import annotations

import numpy as np

from hpctrain.autograd import Tensor, quiet_post_hooks
from hpctrain.nn import GELU, Linear, Module, Parameter, Recompute, Sequential
from hpctrain.nn import functional as F


def watch(params):
    """The order post-accumulate hooks fire in, by parameter name (one list for all)."""
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda t, name=p.name: fired.append(name))
    return fired


class Shared(Module):
    """``fc`` applied twice (shared weights), no backward written."""

    def __init__(self) -> None:
        self.fc = Linear(4, 4, rng=0, dtype=np.float64)

    def forward(self, x):
        return self.fc(F.tanh(self.fc(x)))


class TwoOwners(Module):
    """An explicit module whose parameters two submodules own (as a GPT written with a backward)."""

    def __init__(self) -> None:
        self.a = Linear(4, 4, rng=1, dtype=np.float64)
        self.b = Linear(4, 4, rng=2, dtype=np.float64)
        self.cache = None

    def forward(self, x):
        return self.b.forward(self.a.forward(x))

    def backward(self, g):
        gb = self.b.backward(g)
        self.order.append("b done")
        return self.a.backward(gb)


def x():
    return np.random.default_rng(0).standard_normal((3, 4))


def test_a_weight_used_twice_fires_once_after_its_last_use():
    m = Shared()
    fired = watch(p for _, p in m.named_parameters())
    m(Tensor(x())).sum().backward()
    assert sorted(fired) == ["fc.bias", "fc.weight"]  # once each, although used twice


def test_an_explicit_modules_owners_fire_as_each_is_done():
    m = TwoOwners()
    list(m.named_parameters())
    m.order = []
    fired = watch(m.parameters())

    def note(t):
        m.order.append(t.name)

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(note)
    m(Tensor(x())).sum().backward()
    # b's parameters are signalled as soon as b's backward ran, before a's backward: overlap.
    assert set(m.order[:2]) == {"b.weight", "b.bias"} and m.order[2] == "b done"
    assert set(m.order[3:]) == {"a.weight", "a.bias"}
    assert sorted(fired) == sorted(["a.weight", "a.bias", "b.weight", "b.bias"])  # once each


def test_a_recomputed_block_fires_once_with_the_same_gradients():
    def block():
        return Sequential(Linear(4, 6, rng=3, dtype=np.float64), GELU(), Linear(6, 4, rng=4, dtype=np.float64))

    plain, wrapped = block(), Recompute(block())
    grads = []
    for m in (plain, wrapped):
        fired = watch(p for _, p in m.named_parameters())
        m(Tensor(x())).sum().backward()
        assert sorted(fired) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        grads.append([p.grad.copy() for p in m.parameters()])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def test_a_recomputed_forward_only_block_keeps_only_its_input():
    from hpctrain.training.memory import graph_bytes

    class Block(Module):
        def __init__(self) -> None:
            self.w = Parameter(np.random.default_rng(5).standard_normal((4, 64)))

        def forward(self, h):
            return F.tanh(F.gelu(h @ self.w) @ self.w.T)

    inp = x()
    kept = {}
    for name, m in (("plain", Block()), ("recompute", Recompute(Block()))):
        out = m(Tensor(inp, requires_grad=True))
        kept[name] = graph_bytes(out)
    assert kept["recompute"] == inp.nbytes < kept["plain"]


def test_quiet_post_hooks_silences_those_leaves_only():
    a, b = Parameter(np.ones(3), "a"), Parameter(np.ones(3), "b")
    fired = watch([a, b])
    with quiet_post_hooks([a]):
        (a * b).sum().backward()
    assert fired == ["b"]
    assert np.array_equal(a.grad, np.ones(3))  # the gradient still accumulates
