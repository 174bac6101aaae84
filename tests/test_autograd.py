"""The autograd engine: graph order, accumulation, broadcasting, releasing, in-place detection, leaf
hooks, grad mode, ``Function`` and ``gradcheck`` (the operations' own checks: test_functional*.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hpctrain import autograd as ag
from hpctrain.errors import AutogradError, DtypeError, GradcheckError


def leaf(a, dtype=np.float64):
    return ag.Tensor(np.asarray(a, dtype=dtype), requires_grad=True)


# -- gradients, order, accumulation ---------------------------------------------------------------


def test_tensor_used_twice_sums_both_gradients():
    x = leaf([1.0, 2.0, 3.0])
    y = x * x + x  # x reaches the sum three times
    y.sum().backward()
    np.testing.assert_allclose(x.grad, 2 * x.data + 1)


def test_diamond_graph_runs_each_node_once_after_its_consumers():
    calls = []

    class Spy(ag.Function):
        @staticmethod
        def forward(ctx, a, tag):
            ctx.tag = tag
            return a * 1.0

        @staticmethod
        def backward(ctx, g):
            calls.append((ctx.tag, g.copy()))
            return g, None

    x = leaf([1.0, 2.0])
    h = Spy.apply(x, "h")
    a, b = Spy.apply(h, "a"), Spy.apply(h, "b")
    (a * 2 + b * 3).sum().backward()
    assert [c[0] for c in calls] == ["b", "a", "h"]  # latest first; h once, with the sum
    np.testing.assert_array_equal(calls[-1][1], [5.0, 5.0])
    np.testing.assert_array_equal(x.grad, [5.0, 5.0])


def test_broadcast_gradients_are_summed_back_to_each_shape():
    a = leaf(np.ones((2, 3)))
    b = leaf(np.ones(3) * 2)
    c = leaf(np.ones((2, 1)) * 3)
    s = leaf(5.0)
    (a * b * c * s).sum().backward()
    assert b.grad.shape == (3,) and c.grad.shape == (2, 1) and s.grad.shape == ()
    np.testing.assert_allclose(b.grad, np.full(3, 2 * 3 * 5.0))
    np.testing.assert_allclose(c.grad, np.full((2, 1), 3 * 2 * 5.0))
    np.testing.assert_allclose(s.grad, 6 * 2 * 3.0)


def test_gradients_accumulate_across_backwards_and_cast_to_the_leaf_dtype():
    x = leaf([1.0, 2.0], dtype=np.float32)
    (x * np.float64(2.0)).sum().backward()  # a float64 constant: the gradient comes back float32
    (x * 3.0).sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_array_equal(x.grad, [5.0, 5.0])


def test_backward_with_explicit_gradient_and_errors():
    x = leaf(np.arange(4.0))
    y = x * 2
    y.backward(np.array([1.0, 0.0, 2.0, 0.0]))
    np.testing.assert_array_equal(x.grad, [2.0, 0.0, 4.0, 0.0])
    with pytest.raises(ValueError, match="gradient is needed"):
        (x * 2).backward()
    with pytest.raises(ValueError, match="shape"):
        (x * 2).backward(np.ones(3))
    with pytest.raises(AutogradError, match="does not require"):
        ag.Tensor(np.ones(2)).sum().backward()


def test_leaf_root_and_integer_outputs_carry_no_gradient():
    x = leaf(3.0)
    x.backward()
    assert x.grad == 1.0
    idx = ag.Tensor(np.array([2, 0]))
    assert not idx.requires_grad and idx.is_leaf
    with pytest.raises(DtypeError):
        ag.Tensor(np.array([1, 2]), requires_grad=True)


def test_gradient_returned_in_the_wrong_shape_is_refused():
    class Wrong(ag.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g[:1]  # not a broadcast of the input's (3,)

    with pytest.raises(AutogradError, match=r"gradient of shape \(1,\) for argument 0 of shape \(3,\)"):
        Wrong.apply(leaf(np.ones(3))).sum().backward()


def test_wrong_number_of_gradients_is_refused():
    class Two(ag.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a + b

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(AutogradError, match="returned 1 gradients for 2 arguments"):
        Two.apply(leaf([1.0]), leaf([2.0])).sum().backward()


def test_function_sees_arrays_constants_and_needs_input_grad():
    seen = {}

    class Op(ag.Function):
        @staticmethod
        def forward(ctx, a, b, c, scale=1.0):
            seen["types"] = (type(a), type(b), type(c))
            seen["needs"] = ctx.needs_input_grad
            ctx.scale = scale
            return a * b * c * scale

        @staticmethod
        def backward(ctx, g):
            return None, g * ctx.scale * 2.0, None

    x = leaf([1.0, 2.0])
    y = Op.apply(ag.Tensor(np.ones(2)), x, np.float64(2.0), scale=3.0)
    assert seen["types"] == (np.ndarray, np.ndarray, np.float64)
    assert seen["needs"] == (False, True, False)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, [6.0, 6.0])


def test_multi_output_function_gets_zeros_for_an_unused_output():
    class Halves(ag.Function):
        @staticmethod
        def forward(ctx, a):
            return a[:2] * 1.0, a[2:] * 1.0

        @staticmethod
        def backward(ctx, g1, g2):
            return np.concatenate([g1, g2])

    x = leaf(np.arange(4.0))
    first, _ = Halves.apply(x)
    (first * 3).sum().backward()
    np.testing.assert_array_equal(x.grad, [3.0, 3.0, 0.0, 0.0])


# -- releasing and retain_graph --------------------------------------------------------------------


def test_saved_arrays_are_released_after_backward_and_a_second_backward_raises():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    node = y.grad_fn
    y.backward()
    mul_node = node._edges[0][0]
    assert mul_node._saved is None and mul_node._released
    with pytest.raises(AutogradError, match="second time.*retain_graph=True"):
        y.backward()


def test_retain_graph_allows_a_second_backward():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_array_equal(x.grad, 2 * 2 * x.data)


def test_saved_arrays_are_freed_when_their_node_ran(monkeypatch):
    import weakref

    class Keep(ag.Function):
        @staticmethod
        def forward(ctx, a):
            big = np.ones(1000)
            ctx.save_for_backward(big)
            ctx.extra = big
            refs.append(weakref.ref(big))
            return a * 1.0

        @staticmethod
        def backward(ctx, g):
            return g

    refs = []
    x = leaf([1.0])
    y = Keep.apply(x).sum()
    assert refs[0]() is not None
    y.backward()
    assert refs[0]() is None  # neither save_for_backward nor a ctx attribute keeps it


# -- in place --------------------------------------------------------------------------------------


def test_in_place_change_of_a_saved_input_is_refused_at_backward():
    x = leaf([1.0, 2.0])
    h = x * 1.0
    y = (h * h).sum()  # Mul saved h's array
    h += 1.0
    with pytest.raises(AutogradError, match=r"Mul: saved array \d \(argument \d\) was changed by an in-place"):
        y.backward()


def test_in_place_change_of_a_saved_output_is_refused():
    x = leaf([0.5, 1.0])
    e = x.exp()  # Exp saves its output
    loss = e.sum()
    with ag.no_grad():
        e *= 2.0  # not recorded, but the version moves on
    with pytest.raises(AutogradError, match=r"Exp: saved array 0 \(output 0\)"):
        loss.backward()


def test_in_place_change_through_a_view_is_seen_by_the_base():
    x = leaf(np.ones((2, 2)))
    h = x * 1.0
    y = (h * h).sum()
    v = h.reshape(4)  # shares h's memory and version counter
    with ag.no_grad():
        v += 1.0
    with pytest.raises(AutogradError, match="changed by an in-place"):
        y.backward()


def test_in_place_op_that_needs_no_saved_value_is_recorded():
    x = leaf([1.0, 2.0])
    h = x * 3.0
    h += x  # h = 3x + x, recorded in place
    h *= 2.0
    h.sum().backward()
    np.testing.assert_array_equal(x.grad, [8.0, 8.0])
    np.testing.assert_array_equal(h.data, [8.0, 16.0])


def test_in_place_refusals_while_recording():
    x = leaf([1.0, 2.0])
    with pytest.raises(AutogradError, match="leaf that requires a gradient"):
        x += 1.0
    with ag.no_grad():
        x += 1.0  # a parameter update by hand: allowed
    np.testing.assert_array_equal(x.data, [2.0, 3.0])
    h = x * 1.0
    _ = h[0]
    with pytest.raises(AutogradError, match="view shares"):
        h *= 2.0


def test_setitem_is_differentiable_in_both_operands():
    x = leaf(np.arange(4.0))
    v = leaf([10.0])
    h = x * 1.0
    h[1:3] = v * 2.0
    (h * np.array([1.0, 2.0, 3.0, 4.0])).sum().backward()
    np.testing.assert_array_equal(x.grad, [1.0, 0.0, 0.0, 4.0])
    np.testing.assert_array_equal(v.grad, [2.0 * (2.0 + 3.0)])


def test_raw_data_writes_are_not_detected():
    """Documented limit: writes to ``.data`` bypass the version counter (the gradient then uses
    the new values)."""
    x = leaf([1.0, 2.0])
    h = x * 1.0
    y = (h * h).sum()
    h.data += 1.0  # not seen
    y.backward()
    np.testing.assert_array_equal(x.grad, 2 * (x.data + 1.0))


# -- leaf hooks ------------------------------------------------------------------------------------


def test_post_accumulate_hook_fires_once_after_all_contributions():
    w = leaf([1.0, 2.0])
    b = leaf([0.5, 0.5])
    seen = []
    w.register_post_accumulate_grad_hook(lambda t: seen.append(("w", t.grad.copy())))
    b.register_post_accumulate_grad_hook(lambda t: seen.append(("b", t.grad.copy())))
    x = np.array([3.0, 4.0])
    h = x * w + b  # w used twice: here and below
    (h * w).sum().backward()
    names = [s[0] for s in seen]
    assert sorted(names) == ["b", "w"]  # each exactly once
    got = dict(seen)
    np.testing.assert_allclose(got["w"], x * w.data + h.data)  # both contributions summed
    np.testing.assert_allclose(got["b"], w.data)
    (w * 2).sum().backward()  # a second backward: once more
    assert [s[0] for s in seen].count("w") == 2


def test_post_accumulate_hook_fires_for_a_leaf_given_no_gradient():
    class Drop(ag.Function):
        accumulates_in_place = True  # as the built-in layers' nodes: None for what they add themselves

        @staticmethod
        def forward(ctx, a, b):
            return a * 1.0

        @staticmethod
        def backward(ctx, g):
            return g, None  # nothing for b

    a, b = leaf([1.0]), leaf([1.0])
    fired = []
    b.register_post_accumulate_grad_hook(lambda t: fired.append(t))
    Drop.apply(a, b).sum().backward()
    assert fired == [b] and b.grad is None


def test_hooks_can_be_removed_and_grad_hooks_replace_the_gradient():
    w = leaf([1.0, 2.0])
    fired = []
    handle = w.register_post_accumulate_grad_hook(lambda t: fired.append(1))
    handle.remove()
    w.register_hook(lambda g: g * 10)
    h = w * 1.0
    h.register_hook(lambda g: g + 1)  # a non-leaf's gradient, before its node runs
    (h * w).sum().backward()
    assert fired == []
    np.testing.assert_allclose(w.grad, 10 * ((w.data + 1) + w.data))
    with pytest.raises(AutogradError):
        h.register_post_accumulate_grad_hook(lambda t: None)


# -- grad mode -------------------------------------------------------------------------------------


def test_no_grad_as_context_and_decorator_and_enable_grad_inside():
    x = leaf([1.0])
    with ag.no_grad():
        y = x * 2
        assert not ag.is_grad_enabled()
        with ag.enable_grad():
            z = x * 2
    assert ag.is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None
    assert z.requires_grad

    @ag.no_grad()
    def f(t):
        return t * 3

    assert not f(x).requires_grad and ag.is_grad_enabled()


def test_grad_mode_is_per_thread():
    seen = []
    with ag.no_grad():
        t = threading.Thread(target=lambda: seen.append(ag.is_grad_enabled()))
        t.start()
        t.join()
    assert seen == [True]


def test_no_grad_saves_nothing():
    class Saver(ag.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * 1.0

    with ag.no_grad():
        y = Saver.apply(leaf([1.0]))
    assert y.grad_fn is None


# -- the tensor ------------------------------------------------------------------------------------


def test_operators_match_numpy_and_comparisons_are_plain_arrays():
    a, b = np.array([[1.0, -2.0], [3.0, 0.5]]), np.array([2.0, 4.0])
    ta, tb = ag.Tensor(a), ag.Tensor(b)
    for got, want in [(ta + tb, a + b), (1 - ta, 1 - a), (ta * 2, a * 2), (2 / tb, 2 / b), (ta ** 2, a**2),
                      (2.0**tb, 2.0**b), (-ta, -a), (ta @ tb, a @ b), (a @ ta, a @ a), (b - tb, b - b),
                      (ta.T, a.T), (ta[1], a[1]), (ta.reshape(4), a.reshape(4)), (ta.sum(0), a.sum(0)),
                      (ta.mean(), a.mean()), (ta.max(1, keepdims=True), a.max(1, keepdims=True))]:
        assert isinstance(got, ag.Tensor)
        np.testing.assert_array_equal(got.data, want)
    for got, want in [(ta > 0, a > 0), (ta <= tb, a <= b), (ta == 1.0, a == 1.0), (ta != tb, a != b)]:
        assert type(got) is np.ndarray
        np.testing.assert_array_equal(got, want)
    assert len({ta, tb, ta}) == 2  # hashed by identity
    assert ta.shape == (2, 2) and ta.dtype == np.float64 and ta.ndim == 2 and ta.size == 4
    assert ta.transpose(1, 0).shape == (2, 2) and ta.permute(1, 0).shape == (2, 2)


def test_numpy_and_device_operands_on_the_left_defer_to_the_tensor(standin):
    x = ag.Tensor(standin.asarray(np.array([1.0, 2.0])), requires_grad=True)
    y = standin.asarray(np.array([3.0, 4.0])) * x  # CuPy's rule: a type with __array_ufunc__ = None wins
    assert isinstance(y, ag.Tensor)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.get(), [3.0, 4.0])
    h = ag.Tensor(np.array([1.0]), requires_grad=True)
    z = np.array([2.0]) + h
    assert isinstance(z, ag.Tensor) and z.requires_grad


def test_detach_and_repr():
    x = leaf([1.0])
    d = (x * 2).detach()
    assert not d.requires_grad and d.is_leaf
    assert "grad_fn=<Mul node>" in repr(x * 2) and "requires_grad=True" in repr(x)


# -- gradcheck -------------------------------------------------------------------------------------


class Swish(ag.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x / (1 + ag.xp_of(x).exp(-x))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = 1 / (1 + ag.xp_of(x).exp(-x))
        return g * (s + x * s * (1 - s))


class WrongSwish(Swish):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = 1 / (1 + np.exp(-x))
        return g * (s + x * s * (1 - s)) * np.where(np.arange(x.size).reshape(x.shape) == 4, 1.01, 1.0)


def test_gradcheck_passes_a_right_function_on_both_devices(device):
    x = np.random.default_rng(0).standard_normal((2, 3))
    x = device.asarray(x) if device else x
    assert ag.gradcheck(Swish.apply, (ag.Tensor(x, requires_grad=True),))


def test_gradcheck_names_the_input_and_the_worst_element_of_a_wrong_function():
    x = np.random.default_rng(0).standard_normal((2, 3))
    with pytest.raises(GradcheckError, match=r"WrongSwish\.apply: input 0 \(shape \(2, 3\)\).*1 of 6 elements; "
                                             r"worst at index \(1, 1\)"):
        ag.gradcheck(WrongSwish.apply, (ag.Tensor(x, requires_grad=True),))


def test_gradcheck_of_several_inputs_and_outputs_leaves_the_callers_gradients_alone():
    a, b = leaf([[1.0, 2.0], [0.5, -1.0]]), leaf([0.3, -0.7])
    other = leaf([2.0])

    def fn(a, b):
        return (a * b * other).tanh(), (a @ b).exp()

    assert ag.gradcheck(fn, (a, b, ))
    assert a.grad is None and b.grad is None and other.grad is None


def test_gradcheck_refuses_float32_and_no_differentiable_input():
    with pytest.raises(DtypeError, match="float64"):
        ag.gradcheck(Swish.apply, (leaf([1.0], dtype=np.float32),))
    with pytest.raises(ValueError, match="no input"):
        ag.gradcheck(Swish.apply, (ag.Tensor(np.ones(2)),))


def test_gradcheck_catches_a_wrong_broadcast_reduction():
    class SumWrong(ag.Function):  # a + b, but b's gradient is taken as g's first row only
        @staticmethod
        def forward(ctx, a, b):
            return a + b

        @staticmethod
        def backward(ctx, g):
            return g, g[0]

    with pytest.raises(GradcheckError, match="input 1"):
        ag.gradcheck(SumWrong.apply, (leaf(np.ones((3, 2))), leaf(np.ones(2))))


# -- what a hostile caller tries ---------------------------------------------------------------------


def test_backward_inside_a_backward_recomputes_a_segment():
    """Re-entrant: a Function whose backward reruns its forward with recording and runs a backward
    of its own (activation recomputation's pattern) gives the gradients of the direct graph."""
    w = leaf([0.5, -1.5, 2.0])

    def segment(x):
        return (x * w).tanh() * w

    class Checkpoint(ag.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            with ag.no_grad():
                return segment(ag.Tensor(x)).data

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            inp = ag.Tensor(x, requires_grad=True)
            with ag.enable_grad():
                out = segment(inp)
            out.backward(g)
            return inp.grad

    x0 = np.array([1.0, 2.0, -0.5])
    xa = leaf(x0)
    (Checkpoint.apply(xa * 2.0) ** 2).sum().backward()
    got_x, got_w = xa.grad.copy(), w.grad.copy()
    w.grad = None
    xb = leaf(x0)
    (segment(xb * 2.0) ** 2).sum().backward()
    np.testing.assert_allclose(got_x, xb.grad, rtol=1e-12)
    np.testing.assert_allclose(got_w, w.grad, rtol=1e-12)


def test_a_deep_graph_runs_and_is_freed_without_recursion():
    x = leaf([1.0])
    h = x
    for _ in range(5000):  # past Python's recursion limit several times over
        h = h * 1.0
    h.sum().backward()
    assert x.grad[0] == 1.0
    del h  # a 5000-node chain is deallocated without a recursion error


def test_misuse_gets_clear_errors():
    class FloatGrad(ag.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return 2.0

    with pytest.raises(AutogradError, match="returned a float for argument 0"):
        FloatGrad.apply(leaf([1.0])).sum().backward()
    with pytest.raises(TypeError, match="positional"):
        FloatGrad.apply(leaf([1.0]), scale=leaf([2.0]))
    with pytest.raises(TypeError, match="outside the graph"):
        np.asarray(leaf([1.0]))
    with pytest.raises(TypeError, match="ufuncs"):  # NumPy's own refusal: the tensor opted out of ufuncs
        np.exp(leaf([1.0]))
    np.testing.assert_array_equal(np.asarray(ag.Tensor(np.ones(2))), [1.0, 1.0])
    assert bool(ag.Tensor(np.array(2.0))) and not bool(ag.Tensor(np.array([0.0])))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(ag.Tensor(np.ones(2)))


def test_a_parameter_gradient_of_another_dtype_takes_contributions_unrounded():
    """Mixed precision: a 16-bit parameter with a float32 gradient buffer gets the float32
    contribution as computed, not rounded to 16 bits first."""
    p = ag.Tensor(np.ones(2, dtype=np.float16), requires_grad=True)
    p.grad = np.zeros(2, dtype=np.float32)
    (p.astype(np.float32) * np.float32(1 / 3)).sum().backward()
    assert p.grad.dtype == np.float32
    np.testing.assert_array_equal(p.grad, np.float32(1 / 3))  # float16 would give 0.33325
