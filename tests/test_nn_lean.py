"""The lean layers (issue 20) against their previous versions (tests/reference_nn.py): same outputs
and gradients (bitwise where the operations are the same, else to rounding), buffers that are
never reused while someone holds them, and no new arrays once the first step has run."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from reference_nn import ReferenceCrossEntropy, as_reference, reference_adam_update

from hpctrain import nn, optim
from hpctrain.nn import buffers

# Exact where the operations and their order are unchanged; matrix products over 2-D instead of
# 3-D operands may round differently in the last bit.
TOL = {np.float32: {"rtol": 2e-5, "atol": 1e-6}, np.float64: {"rtol": 1e-12, "atol": 1e-14}}


def _models(dtype):
    kw = {"dtype": dtype}
    return {
        "linear": (lambda: nn.Linear(8, 12, rng=0, **kw), "x"),
        "gelu": (lambda: nn.GELU(), "x"),
        "layernorm": (lambda: _ln(kw), "x"),
        "embedding": (lambda: nn.Embedding(7, 8, rng=0, **kw), "idx"),
        "attention": (lambda: nn.CausalSelfAttention(8, 2, rng=1, **kw), "x"),
        "block": (lambda: nn.TransformerBlock(8, 2, 12, rng=2, **kw), "x"),
        "gpt": (lambda: nn.GPT(vocab_size=7, block_size=6, d_model=8, n_heads=2, n_layers=2, rng=3, **kw), "idx"),
    }


def _ln(kw):
    ln = nn.LayerNorm(8, **kw)
    g = np.random.default_rng(9)
    ln.weight.data[...] = g.standard_normal(8)
    ln.bias.data[...] = g.standard_normal(8)
    return ln


def _run(model, inputs, grads):
    """Two forward/backward passes (the second reuses every buffer); outputs, input grads, param grads."""
    outs, gins = [], []
    model.zero_grad()
    for x, g in zip(inputs, grads):
        y = model.forward(x)
        outs.append(np.array(y, copy=True))
        gx = model.backward(g.astype(y.dtype))
        gins.append(None if gx is None else np.array(gx, copy=True))
    return outs, gins, {n: p.grad.copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["linear", "gelu", "layernorm", "embedding", "attention", "block", "gpt"])
def test_lean_layer_matches_previous_version(name, dtype, rng):
    make, kind = _models(dtype)[name]
    if kind == "idx":
        inputs = [rng.integers(0, 6, (3, 5)) for _ in range(2)]
    else:
        inputs = [(rng.standard_normal((3, 5, 8)) * 2).astype(dtype) for _ in range(2)]
    new = make()
    old = as_reference(copy.deepcopy(new))
    probe = new.forward(inputs[0])
    grads = [rng.standard_normal(probe.shape) for _ in range(2)]
    got, want = _run(new, inputs, grads), _run(old, inputs, grads)
    # GELU and LayerNorm were bitwise their previous versions until they took fewer passes (GELU:
    # x (c + 0.044715 c x^2) instead of c (x + 0.044715 x^3); LayerNorm: sums as matrix-vector
    # products): now equal to rounding, like the rest.
    exact = False
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        if b is None:
            assert a is None
        elif exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, **TOL[dtype])
        assert a is None or a.dtype == b.dtype
    for n in want[2]:
        if exact:
            np.testing.assert_array_equal(got[2][n], want[2][n], err_msg=n)
        else:
            np.testing.assert_allclose(got[2][n], want[2][n], err_msg=n, **TOL[dtype])


@pytest.mark.parametrize("weighted", [False, True])
def test_lean_cross_entropy_is_bitwise_the_previous_one(rng, weighted):
    logits = rng.standard_normal((4, 3, 9)).astype(np.float32) * 3
    target = rng.integers(0, 9, (4, 3))
    w = np.array([1.0, 0.0, 1.0, 1.0]) if weighted else None
    new, old = nn.CrossEntropyLoss(), ReferenceCrossEntropy()
    for _ in range(2):
        assert new.forward(logits, target, w) == old.forward(logits, target, w)
        for scale in (1.0, 0.25):  # backward twice on one forward: the probabilities must survive
            np.testing.assert_array_equal(new.backward(scale), old.backward(scale))


@pytest.mark.parametrize("cls,wd", [(optim.AdamW, 0.1), (optim.Adam, 0.0), (optim.Adam, 0.05)])
def test_lean_adam_is_bitwise_the_previous_one(cls, wd, rng):
    shapes = [(5, 3), (7,), (2, 2, 2)]
    params = [nn.Parameter(rng.standard_normal(s).astype(np.float32), name=f"p{i}") for i, s in enumerate(shapes)]
    twins = [nn.Parameter(p.data.copy(), name=p.name) for p in params]
    opt, ref = cls(params, lr=0.01, weight_decay=wd), cls(twins, lr=0.01, weight_decay=wd)
    for _ in range(4):
        for p, q in zip(params, twins):
            p.grad[...] = q.grad[...] = rng.standard_normal(p.shape)
        opt.step()
        ref.step_count += 1
        for name, q in zip(ref.names, twins):
            reference_adam_update(ref, q, ref.state[name], ref.lr)
        for p, q in zip(params, twins):
            np.testing.assert_array_equal(p.data, q.data)
            np.testing.assert_array_equal(opt.state[p.name]["exp_avg_sq"], ref.state[q.name]["exp_avg_sq"])


def test_embedding_scatter_accumulates_repeats_into_nonzero_gradients(rng):
    emb = nn.Embedding(6, 4, rng=0, dtype=np.float64)
    emb.weight.grad[...] = rng.standard_normal((6, 4))
    want = emb.weight.grad.copy()
    idx = np.array([[5, 0, 5], [5, 2, 0]])
    g = rng.standard_normal((2, 3, 4))
    np.add.at(want, idx.reshape(-1), g.reshape(-1, 4))
    emb.forward(idx)
    emb.backward(g)
    np.testing.assert_allclose(emb.weight.grad, want, rtol=1e-14)


def test_outputs_a_caller_holds_are_never_overwritten(rng):
    gpt = nn.GPT(vocab_size=9, block_size=6, d_model=8, n_heads=2, n_layers=2, rng=0)
    a, b = rng.integers(0, 9, (2, 6)), rng.integers(0, 9, (2, 6))
    ya = gpt.forward(a)
    keep = ya.copy()
    yb = gpt.forward(b)
    assert yb is not ya and not np.shares_memory(ya, yb)
    np.testing.assert_array_equal(ya, keep)  # the second forward did not write into the first's output
    view = yb[0]  # a view keeps its base out of reuse too
    yc = gpt.forward(a)
    assert not np.shares_memory(view, yc)
    np.testing.assert_array_equal(yc, keep)


def test_a_gpt_step_creates_no_arrays_after_the_second(rng):
    gpt = nn.GPT(vocab_size=11, block_size=8, d_model=16, n_heads=2, n_layers=2, rng=0)
    loss = nn.CrossEntropyLoss()
    opt = optim.AdamW(gpt.parameters(), lr=1e-3)
    x, y = rng.integers(0, 11, (4, 8)), rng.integers(0, 11, (4, 8))

    def step():
        opt.zero_grad()
        loss.forward(gpt.forward(x), y)
        gpt.backward(loss.backward())
        opt.step()

    # Step 1 fills the pools; in step 2 each layer's cache still holds step 1's input while the
    # layer before it writes a new output, so that output gets a second array; from then on the
    # two alternate and nothing is created.
    step()
    step()
    before = dict(buffers.created)
    for _ in range(3):
        step()
    assert buffers.created == before
    # the pools hold what they made (and the first step made something)
    assert sum(m.scratch_buffers().nbytes for _, m in gpt.named_modules()) > 0


def test_buffers_reuse_only_free_arrays():
    pool = buffers.Buffers()
    a = pool.get("t", (3,), np.float32)
    b = pool.get("t", (3,), np.float32)
    assert a is not b  # a is still held
    del a
    c = pool.get("t", (3,), np.float32)
    assert c is not b and c.shape == (3,)
    assert pool.get("t", (4,), np.float32).shape == (4,)
    assert copy.deepcopy(pool).nbytes == 0


def test_buffers_by_rows_keep_arrays_by_capacity(rng):
    # rows=True (the MoE's pool): row counts that change every call share a few arrays by capacity,
    # a held view is never handed out again, and what is kept stays within twice the largest count.
    pool = buffers.Buffers(rows=True)
    counts = rng.integers(0, 300, 200)
    for n in counts:
        a = pool.get("h", (int(n), 5), np.float32)
        assert a.shape == (n, 5) and a.flags.c_contiguous
        del a  # (a caller that let go: its array serves the next call)
    row = 5 * np.dtype(np.float32).itemsize
    assert pool.nbytes <= 2 * int(counts.max()) * row  # one array: the smaller ones went as it came
    held = pool.get("h", (10, 5), np.float32)
    other = pool.get("h", (10, 5), np.float32)
    assert not np.shares_memory(held, other)  # the held view's array is in use
    del held
    assert np.shares_memory(pool.get("h", (3, 5), np.float32), other) is False
    assert pool.get("h", (0, 5), np.float32).shape == (0, 5)
    assert copy.deepcopy(pool).rows and copy.deepcopy(pool).nbytes == 0


def test_recomputed_blocks_keep_no_arrays_in_pools(rng):
    from hpctrain.nn.recompute import recompute

    gpt = recompute(nn.GPT(vocab_size=9, block_size=6, d_model=8, n_heads=2, n_layers=2, rng=0))
    x = rng.integers(0, 9, (2, 6))
    for _ in range(2):
        gpt.zero_grad()
        gpt.backward(np.ones_like(gpt.forward(x)))
    assert all(m.scratch_buffers().nbytes == 0 for _, m in gpt.blocks[0].named_modules())
    assert gpt.head.scratch_buffers().nbytes > 0  # outside the recomputed blocks, pools still work


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("t,block", [(7, 1), (7, 2), (7, 3), (7, 7), (7, 64), (9, 4)])
def test_blocked_causal_attention_matches_the_previous_core(t, block, dtype, rng):
    """Queries in blocks, each against the keys it may see only: the same probabilities (zero
    above the diagonal), outputs and gradients as the previous full-matrix core."""
    from reference_nn import causal_attention as ref_fwd
    from reference_nn import causal_attention_backward as ref_bwd

    q, k, v = (rng.standard_normal((2, 3, t, 4)).astype(dtype) for _ in range(3))
    dy = rng.standard_normal((2, 3, t, 4)).astype(dtype)
    y, att = nn.causal_attention(q, k, v, block=block)
    y0, att0 = ref_fwd(q, k, v)
    np.testing.assert_allclose(y, y0, **TOL[dtype])
    np.testing.assert_allclose(att, att0, **TOL[dtype])
    assert not att[..., np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]].any()
    for got, want in zip(nn.causal_attention_backward(dy, q, k, v, att, block=block), ref_bwd(dy, q, k, v, att0)):
        np.testing.assert_allclose(got, want, **TOL[dtype])


def test_attention_layer_in_blocks_matches_previous_version(monkeypatch, rng):
    from hpctrain.nn import transformer

    monkeypatch.setattr(transformer, "ATTENTION_BLOCK", 2)
    new = nn.CausalSelfAttention(8, 2, rng=1, dtype=np.float64)
    old = as_reference(copy.deepcopy(new))
    xs = [rng.standard_normal((3, 7, 8)) for _ in range(2)]
    grads = [rng.standard_normal((3, 7, 8)) for _ in range(2)]
    got, want = _run(new, xs, grads), _run(old, xs, grads)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_allclose(a, b, **TOL[np.float64])
    for n in want[2]:
        np.testing.assert_allclose(got[2][n], want[2][n], err_msg=n, **TOL[np.float64])
    q = np.zeros((1, 1, 3, 2))
    with pytest.raises(ValueError, match="block"):
        nn.causal_attention(q, q, q, block=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_in_row_chunks_is_bitwise_the_whole_array(monkeypatch, dtype, rng):
    """Chunking only changes which elements a pass runs over at a time, never an element's result."""
    from hpctrain.nn import kernels  # GELU's computation (the layer's and F.gelu's)

    x = (rng.standard_normal((3, 10, 7)) * 3).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    whole = nn.GELU()
    want_y, want_g = whole.forward(x).copy(), whole.backward(g).copy()
    monkeypatch.setattr(kernels, "CHUNK", 8)  # rows of 7: one row per chunk, a short last chunk too
    chunked = nn.GELU()
    np.testing.assert_array_equal(chunked.forward(x), want_y)
    np.testing.assert_array_equal(chunked.backward(g), want_g)
