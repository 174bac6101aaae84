"""The built-in layers and models on tensors (issue 36, items 3 and 5): each layer one fused node of
its own forward and backward, the built-in models composed of those nodes (no backward of theirs
runs), the losses as nodes, modules and weights used twice in one forward, the tied GPT head, and
the scratch buffers of layers that run twice."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from gradcheck import numeric_grad
from hpctrain import autograd as ag
from hpctrain import nn, optim
from hpctrain.backend import to_host
from hpctrain.errors import AutogradError
from hpctrain.nn import functional as F
from hpctrain.nn.layer_nodes import LayerCall, LossCall


def _nodes(root):
    """Every node of ``root``'s graph, by the type of Function that made it."""
    seen, stack, kinds = set(), [root.grad_fn], {}
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        kinds[n._fn.__name__] = kinds.get(n._fn.__name__, 0) + 1
        stack.extend(e[0] for e in n._edges if e is not None and e[1] >= 0)
    return kinds


def _gpt(**kw):
    sizes = dict(vocab_size=11, block_size=6, d_model=8, n_heads=2, n_layers=2, rng=0, dtype=np.float64)
    sizes.update(kw)
    return nn.GPT(**sizes)


def _explicit_grads(model, x, y, loss=None):
    loss = loss or nn.CrossEntropyLoss()
    model.zero_grad()
    value = loss.forward(model.forward(x), y)
    model.backward(loss.backward())
    return value, {n: p.grad.copy() for n, p in model.named_parameters()}


def _tensor_grads(model, x, y, loss=None):
    loss = loss or nn.CrossEntropyLoss()
    model.zero_grad()
    out = loss(model(ag.Tensor(x)), y)
    out.backward()
    return out.data, {n: p.grad.copy() for n, p in model.named_parameters()}


def explicit_and_engine_grads(model, x, y):
    """The loss and gradients of ``model`` by its hand-written backward, then through the engine
    with the same dropout masks (its generators rewound)."""
    rngs = [m.rng for _, m in model.named_modules() if isinstance(m, nn.Dropout)]
    states = [r.bit_generator.state for r in rngs]
    explicit = _explicit_grads(model, x, y)
    for r, s in zip(rngs, states):
        r.bit_generator.state = s  # the same masks again
    return explicit, _tensor_grads(model, x, y)


# -- the built-in layers and models as nodes --------------------------------------------------------


def test_gpt_on_a_tensor_is_a_graph_of_its_layers():
    """Each layer (and the attention core) one fused node, the residual sums in-place additions, the
    loss one node: no node of a whole block or model (whose hand-written backward would run)."""
    model = _gpt()
    g = np.random.default_rng(0)
    x, y = g.integers(0, 11, (2, 6)), g.integers(0, 11, (2, 6))
    kinds = _nodes(nn.CrossEntropyLoss()(model(ag.Tensor(x)), y))
    # per block: ln1, qkv, attention core, proj, ln2, fc1, gelu, fc2; then tok, pos, ln_f, head
    assert kinds == {"LossCall": 1, "LayerCall": 2 * 8 + 4, "AddInPlace": 2 * 2 + 1}, kinds


@pytest.mark.parametrize("variant", ["plain", "dropout", "tied"])
def test_gpt_through_the_engine_equals_its_hand_written_backward(variant, device):
    kw = {"dropout": dict(dropout=0.3), "tied": dict(tie_embeddings=True)}.get(variant, {})
    model = _gpt(**kw)
    g = np.random.default_rng(1)
    x, y = g.integers(0, 11, (3, 6)), g.integers(0, 11, (3, 6))
    if device is not None:  # the device stand-in: host/device mixing fails as on a GPU
        model.to("gpu")
        x, y = device.asarray(x), device.asarray(y)
    (want_v, want), (got_v, got) = explicit_and_engine_grads(model, x, y)
    assert float(to_host(got_v)) == pytest.approx(float(to_host(want_v)), rel=1e-12)
    assert got.keys() == want.keys()
    for n in want:
        np.testing.assert_allclose(to_host(got[n]), to_host(want[n]), rtol=1e-10, atol=1e-14, err_msg=n)
    assert all(m.__dict__.get("cache") is None for _, m in model.named_modules())  # state lived in the graph


def test_parameters_are_complete_in_reverse_layer_order():
    """What a data-parallel bucket needs from the engine: a parameter's post-accumulate hook runs as
    soon as its last layer's node ran, the head's long before the embeddings' (one node for the
    whole model gave every parameter at the end, in registration order)."""
    model = _gpt()
    order = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: order.append(n))
    g = np.random.default_rng(2)
    nn.CrossEntropyLoss()(model(ag.Tensor(g.integers(0, 11, (2, 6)))), g.integers(0, 11, (2, 6))).backward()
    assert sorted(order) == sorted(n for n, _ in model.named_parameters())  # each once
    pos = {n: i for i, n in enumerate(order)}
    assert pos["head.weight"] < pos["ln_f.weight"] < pos["blocks.1.mlp.fc2.weight"] < pos["blocks.1.ln1.weight"] \
        < pos["blocks.0.mlp.fc2.weight"] < pos["blocks.0.attn.qkv.weight"] < pos["tok_emb.weight"]


@pytest.mark.parametrize("make", ["linear", "layer_norm", "gelu", "embedding", "tanh", "relu", "dropout"])
def test_every_builtin_layer_is_one_fused_node_with_its_own_backward(make):
    g = np.random.default_rng(3)
    layer, x = {
        "linear": (nn.Linear(4, 3, rng=0, dtype=np.float64), g.standard_normal((2, 5, 4))),
        "layer_norm": (nn.LayerNorm(4, dtype=np.float64), g.standard_normal((2, 5, 4))),
        "gelu": (nn.GELU(), g.standard_normal((2, 5, 4))),
        "embedding": (nn.Embedding(7, 4, rng=0, dtype=np.float64), g.integers(0, 7, (2, 5))),
        "tanh": (nn.Tanh(), g.standard_normal((2, 5, 4))),
        "relu": (nn.ReLU(), g.standard_normal((2, 5, 4))),
        "dropout": (nn.Dropout(0.4, rng=5), g.standard_normal((2, 5, 4))),
    }[make]
    for p in layer.parameters():  # nonzero so that a bias or a LayerNorm weight counts
        p.data[...] = g.standard_normal(p.shape)
    floating = x.dtype.kind == "f"
    xt = ag.Tensor(x, requires_grad=floating)
    state = getattr(layer, "rng", None) and copy.deepcopy(layer.rng.bit_generator.state)
    out = layer(xt)
    assert out.grad_fn._fn is LayerCall and layer.cache is None
    r = g.standard_normal(out.shape)
    layer.zero_grad()
    out.backward(r)
    got = {n: p.grad.copy() for n, p in layer.named_parameters()}
    if state:
        layer.rng.bit_generator.state = state
    layer.zero_grad()
    want_x = layer.backward(r) if layer.forward(x) is not None else None
    if floating:
        np.testing.assert_allclose(xt.grad, want_x, rtol=1e-12)
    for n, p in layer.named_parameters():
        np.testing.assert_allclose(got[n], p.grad, rtol=1e-12, err_msg=n)


# -- used twice in one forward ---------------------------------------------------------------------


class SharedBlock(nn.Module):
    """A forward-only model that runs one built-in transformer block twice (ALBERT-style weight
    sharing) and one MLP twice."""

    def __init__(self):
        self.block = nn.TransformerBlock(4, 2, 4, rng=1, dtype=np.float64)
        self.mlp = nn.MLP(4, 3, rng=2, dtype=np.float64)

    def forward(self, x):
        h = self.block(self.block(x))
        return self.mlp(h) + self.mlp(h * 0.5)


def test_a_block_and_an_mlp_used_twice_accumulate_both_gradients():
    model = SharedBlock()
    g = np.random.default_rng(4)
    x, r = g.standard_normal((2, 3, 4)), g.standard_normal((2, 3, 4))
    xt = ag.Tensor(x, requires_grad=True)
    (model(xt) * r).sum().backward()

    def f():
        with ag.no_grad():
            return float((model(x).data * r).sum())

    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, numeric_grad(f, p.data), rtol=1e-5, atol=1e-8, err_msg=n)
    np.testing.assert_allclose(xt.grad, numeric_grad(f, x), rtol=1e-5, atol=1e-8)


def test_a_layer_called_twice_keeps_its_first_output_and_reuses_buffers_after():
    """The scratch-buffer policy: a layer's output buffer is handed out again only once nothing
    holds it, so a second call in the same forward gets another array (the first output, which a
    later node saved, is intact), and steady-state steps make no new arrays."""
    from hpctrain.nn import buffers

    lin = nn.Linear(3, 3, rng=0)
    x = ag.Tensor(np.ones((2, 3), np.float32))
    a = lin(x)
    first = a.data.copy()
    b = lin(a)
    assert a.data is not b.data
    np.testing.assert_array_equal(a.data, first)
    model = _gpt(dtype=np.float32)
    g = np.random.default_rng(5)
    idx, y = g.integers(0, 11, (2, 6)), g.integers(0, 11, (2, 6))
    loss = nn.CrossEntropyLoss()
    for _ in range(2):
        _tensor_grads(model, idx, y, loss)
    before = buffers.created["arrays"]
    _tensor_grads(model, idx, y, loss)
    assert buffers.created["arrays"] == before


def test_a_module_registered_twice_is_listed_and_updated_once():
    lin = nn.Linear(2, 2, rng=0, dtype=np.float64)
    model = nn.Sequential(lin, nn.Tanh(), lin)
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias"]
    assert list(model.state_dict()) == ["0.weight", "0.bias"]
    w0 = lin.weight.data.copy()
    opt = optim.SGD(model.parameters(), lr=1.0)
    x = np.ones((1, 2))
    (model(ag.Tensor(x)) * 1.0).sum().backward()
    grad = lin.weight.grad.copy()
    opt.step()
    np.testing.assert_allclose(lin.weight.data, w0 - grad)  # one step, not two


# -- the tied head ---------------------------------------------------------------------------------


def test_tied_head_shares_the_embedding_and_sums_both_gradients():
    tied = _gpt(tie_embeddings=True)
    assert tied.head.weight is tied.tok_emb.weight
    names = [n for n, _ in tied.named_parameters()]
    assert "head.weight" not in names and names.count("tok_emb.weight") == 1
    assert "head.weight" not in tied.state_dict() and tied.tied_weights() == {"head.weight": "tok_emb.weight"}
    assert tied.tp_plan()["head"] == "tied_vocab_head" and _gpt().tied_weights() == {}
    # The same function as an untied model whose head is the embedding transposed: the tied
    # gradient is the embedding's plus the head's, transposed.
    untied = _gpt()
    untied.load_state_dict({**tied.state_dict(), "head.weight": tied.tok_emb.weight.data.T.copy()})
    g = np.random.default_rng(6)
    x, y = g.integers(0, 11, (2, 6)), g.integers(0, 11, (2, 6))
    for grads in (_explicit_grads, _tensor_grads):
        v_t, g_t = grads(tied, x, y)
        v_u, g_u = grads(untied, x, y)
        assert v_t == pytest.approx(v_u, rel=1e-12)
        np.testing.assert_allclose(g_t["tok_emb.weight"], g_u["tok_emb.weight"] + g_u["head.weight"].T, rtol=1e-10)

    def f():
        return nn.CrossEntropyLoss().forward(tied.forward(x), y)

    _tensor_grads(tied, x, y)
    np.testing.assert_allclose(tied.tok_emb.weight.grad, numeric_grad(f, tied.tok_emb.weight.data), atol=1e-8)


def test_tied_gpt_round_trips_its_state_and_refuses_a_head_weight():
    a, b = _gpt(tie_embeddings=True), _gpt(tie_embeddings=True, rng=9)
    b.load_state_dict(a.state_dict())
    assert all(np.array_equal(p.data, q.data) for p, q in zip(a.parameters(), b.parameters()))
    assert b.head.weight is b.tok_emb.weight
    with pytest.raises(ValueError, match="unexpected: head.weight"):
        b.load_state_dict({**a.state_dict(), "head.weight": a.tok_emb.weight.data.T})


# -- losses ----------------------------------------------------------------------------------------


def test_a_loss_serves_two_calls_in_flight():
    """Two micro-batches through one loss object, backward in the other order (1F1B)."""
    loss = nn.CrossEntropyLoss()
    g = np.random.default_rng(7)
    z1, z2 = ag.Tensor(g.standard_normal((4, 5)), requires_grad=True), ag.Tensor(g.standard_normal((3, 5)),
                                                                                requires_grad=True)
    y1, y2 = g.integers(0, 5, 4), g.integers(0, 5, 3)
    l1, l2 = loss(z1, y1), loss(z2, y2)
    assert l1.grad_fn._fn is LossCall
    l2.backward()
    l1.backward()
    for z, y in ((z1, y1), (z2, y2)):
        ref = nn.CrossEntropyLoss()
        ref.forward(z.data, y)
        np.testing.assert_allclose(z.grad, ref.backward(), rtol=1e-12)
    with pytest.raises(ValueError, match="target is a constant"):
        nn.MSELoss()(z1, ag.Tensor(np.zeros((4, 5)), requires_grad=True))


# -- what the engine's way keeps -------------------------------------------------------------------


def test_hooks_and_missing_gradients_of_a_builtin_layers_parameters():
    lin = nn.Linear(3, 2, rng=0, dtype=np.float64)
    seen = []
    lin.weight.register_hook(lambda g: seen.append(g.copy()) or g * 2)
    lin.bias.grad = None
    x = np.random.default_rng(8).standard_normal((4, 3))
    lin(ag.Tensor(x)).sum().backward()
    np.testing.assert_allclose(seen[0], x.T @ np.ones((4, 2)))
    np.testing.assert_allclose(lin.weight.grad, 2 * seen[0])  # the hook's gradient was accumulated
    np.testing.assert_allclose(lin.bias.grad, [4.0, 4.0])


def test_changing_a_layers_saved_input_in_place_is_refused():
    lin = nn.Linear(3, 2, rng=0, dtype=np.float64)
    h = ag.Tensor(np.ones((2, 3)), requires_grad=True) * 1.0
    out = lin(h)
    h += 1.0
    with pytest.raises(AutogradError, match="changed by an in-place operation"):
        out.sum().backward()


def test_in_place_addition_writes_into_the_tensor_and_differentiates():
    g = np.random.default_rng(9)
    a = ag.Tensor(g.standard_normal((3, 4)), requires_grad=True)
    b = ag.Tensor(g.standard_normal(4), requires_grad=True)

    def fn(a, b):
        h = F.tanh(a) * 2.0  # (tanh keeps its output: the in-place sum goes into the product's)
        data = h.data
        h += b
        h -= a * 0.5
        assert h.data is data  # written in place, no new array
        return h

    assert ag.gradcheck(fn, (a, b))


def _f_chain_peak(pool, monkeypatch):
    """tracemalloc's peak over a third step of a chain of ``F.layer_norm`` and ``F.gelu`` (forward
    keeps every activation for backward, as a model does) with ``pool`` as F's scratch pool."""
    import tracemalloc

    from hpctrain.nn.functional import activation, layer

    monkeypatch.setattr(activation, "FRESH", pool)
    monkeypatch.setattr(layer, "FRESH", pool)
    g = np.random.default_rng(10)
    w, b = ag.Tensor(np.ones(64), requires_grad=True), ag.Tensor(np.zeros(64), requires_grad=True)
    x = ag.Tensor(g.standard_normal((32, 64)), requires_grad=True)

    def step():
        h = x
        for _ in range(6):
            h = F.gelu(F.layer_norm(h, 64, w, b)) * 1.0
        h.sum().backward()

    tracemalloc.start()
    try:
        step()
        step()
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        step()
        return tracemalloc.get_traced_memory()[1], start
    finally:
        tracemalloc.stop()


def test_functional_scratch_pool_keeps_the_peak_of_fresh_arrays(monkeypatch):
    """F's scratch comes from one shared pool (no allocation in steady state, the speed of the
    layers' own pools) that holds, per shape, only as many arrays as were in use at once: a step's
    peak is the peak of allocating fresh arrays; between steps the pool keeps it allocated."""
    from hpctrain.nn.buffers import Buffers

    fresh_peak, _ = _f_chain_peak(Buffers(retain=False), monkeypatch)
    shared = Buffers(keep=64, keys=128, tags=False)
    peak, held = _f_chain_peak(shared, monkeypatch)
    assert peak <= fresh_peak * 1.02, (peak, fresh_peak)
    assert shared.nbytes <= held
    tagged_peak, _ = _f_chain_peak(Buffers(keep=64, keys=128), monkeypatch)
    assert tagged_peak > peak  # one pool per tag would hold forward and backward arrays apart


def test_a_residual_sum_goes_into_the_output_unless_its_memory_is_shared():
    from hpctrain.autograd.tensors import add_into

    g = np.random.default_rng(11)
    x = ag.Tensor(g.standard_normal((2, 3)), requires_grad=True)
    fresh = x * 2.0
    data = fresh.data
    out = add_into(fresh, x)
    assert out is fresh and out.data is data  # in place: no new array
    view = (x * 2.0).reshape(3, 2).reshape(2, 3)  # shares its memory with the product
    out2 = add_into(view, x)
    assert out2 is not view and out2.data is not view.data
    (out * 1.0 + out2).sum().backward()
    np.testing.assert_allclose(x.grad, np.full((2, 3), 6.0))
    arr = np.ones(3)
    assert add_into(arr, 1.0) is arr and arr.tolist() == [2.0, 2.0, 2.0]


def test_a_layer_whose_parameter_is_replaced_takes_the_new_one_into_its_node():
    """The node's parameters are found once per layer and found again when one is assigned (a
    transform swapping a weight): the new one's hooks run, the old one is left alone."""
    lin = nn.Linear(2, 2, rng=0, dtype=np.float64)
    x = ag.Tensor(np.ones((1, 2)))
    lin(x).sum().backward()
    old = lin.weight
    old_grad = old.grad.copy()
    lin.weight = nn.Parameter(np.zeros((2, 2)))
    fired = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    out = lin(x)
    assert {id(e[0]) for e in out.grad_fn._edges if e is not None} == {id(lin.weight), id(lin.bias)}
    out.sum().backward()
    assert fired == [lin.weight] and np.array_equal(old.grad, old_grad)
    np.testing.assert_array_equal(lin.weight.grad, np.ones((2, 2)))
