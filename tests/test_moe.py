"""The mixture-of-experts layer on one process: its hand-written backward against finite
differences (router and load-balancing term included), the graph mode against the explicit one,
capacity drops (a dropped token's output is zero, in a block its residual), the GPT's MoE blocks
(with recompute), and the refusals."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain import Communicator
from hpctrain.autograd import Tensor
from hpctrain.nn import GPT, MLP, MoE, TransformerBlock, recompute_blocks
from hpctrain.nn.moe import moe_layers, set_aux_weight
from hpctrain.parallel import expert_parallel
from tests.gradcheck import numeric_grad

F64 = np.float64


def _objective(m, x, r):
    """The scalar the checks differentiate: ``sum(out * r) + aux_weight * aux_loss``."""
    return float((m.forward(x) * r).sum()) + m.aux_weight * m.aux_loss


@pytest.mark.parametrize("top_k,capacity", [(1, 0.0), (2, 0.0), (2, 0.6)])
def test_moe_backward_matches_finite_differences(top_k, capacity):
    rng = np.random.default_rng(0)
    m = MoE(6, 5, experts=4, top_k=top_k, capacity=capacity, rng=1, dtype=F64)
    m.aux_weight = 0.3
    x = rng.standard_normal((3, 4, 6))
    r = rng.standard_normal((3, 4, 6))
    m.zero_grad()
    m.forward(x)
    gx = m.backward(r.copy())
    if capacity:
        assert m.dropped > 0  # the cap is what this case checks
    np.testing.assert_allclose(gx, numeric_grad(lambda: _objective(m, x, r), x), atol=1e-7, rtol=1e-5)
    for name, p in m.named_parameters():
        num = numeric_grad(lambda: _objective(m, x, r), p.data)
        np.testing.assert_allclose(p.grad, num, atol=1e-7, rtol=1e-5, err_msg=name)
    assert np.abs(m.router.weight.grad).max() > 0


def test_aux_loss_is_the_switch_term_and_its_weight_only_moves_the_router():
    rng = np.random.default_rng(2)
    m = MoE(4, 3, experts=4, top_k=2, rng=3, dtype=F64)
    x = rng.standard_normal((10, 4))
    m.forward(x)
    logits = x @ m.router.weight.data
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    chosen = np.argsort(-p, axis=1, kind="stable")[:, :2]
    counts = np.bincount(chosen.ravel(), minlength=4)
    np.testing.assert_array_equal(m.tokens_per_expert, counts)
    assert math.isclose(m.aux_loss, 4 * np.sum(counts / counts.sum() * p.mean(0)), rel_tol=1e-12)
    grads = {}
    for w in (0.0, 0.5):
        m.aux_weight = w
        m.zero_grad()
        m.forward(x)
        m.backward(np.ones_like(x))
        grads[w] = {n: q.grad.copy() for n, q in m.named_parameters()}
    for n in grads[0.0]:
        same = np.array_equal(grads[0.0][n], grads[0.5][n])
        assert same == (n != "router.weight"), n


def test_graph_mode_equals_explicit_mode():
    rng = np.random.default_rng(4)
    m = MoE(6, 8, experts=4, top_k=2, rng=5, dtype=F64)
    m.aux_weight = 0.1
    x = rng.standard_normal((2, 5, 6))
    r = rng.standard_normal((2, 5, 6))
    m.zero_grad()
    out = m.forward(x)
    gx = m.backward(r.copy())
    explicit = {n: p.grad.copy() for n, p in m.named_parameters()}
    m.zero_grad()
    xt = Tensor(x.copy(), requires_grad=True)
    y = m(xt)
    (y * r).sum().backward()
    np.testing.assert_allclose(y.data, out, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(xt.grad, gx, rtol=1e-12, atol=1e-13)
    for n, p in m.named_parameters():
        np.testing.assert_allclose(p.grad, explicit[n], rtol=1e-12, atol=1e-13, err_msg=n)


def _top1_kept(m, x2, cap):
    """Which tokens keep their one expert under ``cap`` (the first ``cap`` of each, token order)."""
    top = np.argmax(x2 @ m.router.weight.data, axis=1)
    kept = np.zeros(len(top), bool)
    for e in range(m.experts):
        kept[np.flatnonzero(top == e)[:cap]] = True
    return kept


def test_capacity_dropped_token_outputs_zero():
    rng = np.random.default_rng(6)
    n, e, f = 24, 4, 0.5
    m = MoE(8, 6, experts=e, top_k=1, capacity=f, rng=7, dtype=F64)
    x = rng.standard_normal((n, 8))
    out = m.forward(x)
    cap = math.ceil(f * n * 1 / e)
    kept = _top1_kept(m, x, cap)
    assert 0 < kept.sum() < n and m.dropped == n - kept.sum()
    assert np.all(out[~kept] == 0.0)
    assert np.all(np.abs(out[kept]).sum(axis=1) > 0)
    dropless = MoE(8, 6, experts=e, top_k=1, rng=7, dtype=F64)
    np.testing.assert_array_equal(dropless.forward(x)[kept], out[kept])  # the kept ones as without a cap


def test_capacity_dropped_token_output_is_its_residual_in_a_block():
    rng = np.random.default_rng(8)
    block = TransformerBlock(8, 2, 12, rng=9, dtype=F64, moe={"experts": 4, "top_k": 1, "capacity": 0.25})
    x = rng.standard_normal((2, 8, 8))
    out = block.forward(x)
    h = x + block.attn.forward(block.ln1.forward(x))
    h2 = block.ln2.forward(h).reshape(-1, 8)
    kept = _top1_kept(block.mlp, h2, math.ceil(0.25 * 16 / 4)).reshape(2, 8)
    assert (~kept).any() and kept.any()
    np.testing.assert_array_equal(out[~kept], h[~kept])  # exactly: nothing else is added
    assert np.all(out[kept] != h[kept])


def _gpt(**kw):
    return GPT(vocab_size=11, block_size=6, d_model=8, n_heads=2, n_layers=4, d_hidden=12, rng=0, dtype=F64,
               moe_experts=4, moe_top_k=2, moe_every=2, **kw)


def test_gpt_moe_blocks_aux_loss_graph_and_recompute():
    model = _gpt()
    kinds = [type(b.mlp) for b in model.blocks]
    assert kinds == [MLP, MoE, MLP, MoE]  # Megatron's moe_layer_freq: blocks every-1, 2*every-1
    assert len(model.pipeline_cuts()) == GPT.pipeline_cut_count(4)
    assert model.state_dict()["blocks.1.mlp.w1"].shape == (4, 8, 12)
    set_aux_weight(model, 0.01)
    idx = np.random.default_rng(1).integers(0, 11, (3, 6))
    r = np.random.default_rng(2).standard_normal((3, 6, 11))
    model.zero_grad()
    logits = model.forward(idx)
    model.backward(r.copy())
    explicit = {n: p.grad.copy() for n, p in model.named_parameters()}
    aux = model.aux_loss
    assert aux == pytest.approx(sum(m.aux_loss for m in moe_layers(model))) and aux >= 2 - 1e-12  # >= 1 each
    for wrap in (False, True):
        other = _gpt()
        set_aux_weight(other, 0.01)
        if wrap:
            recompute_blocks(other)
        other.zero_grad()
        y = other(idx)
        (y * r).sum().backward()
        np.testing.assert_allclose(y.data, logits, rtol=1e-12, atol=1e-13)
        assert other.aux_loss == pytest.approx(aux, rel=1e-12)
        for n, p in other.named_parameters():
            np.testing.assert_allclose(p.grad, explicit[n], rtol=1e-10, atol=1e-12, err_msg=f"{n} recompute={wrap}")


def test_gpt_without_moe_is_unchanged():
    a = GPT(11, 6, 8, 2, 2, rng=0, dtype=F64)
    b = GPT(11, 6, 8, 2, 2, rng=0, dtype=F64, moe_experts=0, moe_every=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and np.array_equal(pa.data, pb.data)
    assert a.aux_loss == 0.0


@pytest.mark.parametrize("kwargs,words", [
    ({"experts": 0}, "experts=0 must be >= 1"),
    ({"experts": 4, "top_k": 5}, "top_k=5 must be between 1 and experts=4"),
    ({"top_k": 0}, "top_k=0 must be between 1"),
    ({"capacity": -1.0}, "capacity=-1.0 must be a finite number >= 0"),
    ({"capacity": float("nan")}, "capacity=nan must be"),
    ({"capacity": float("inf")}, "capacity=inf must be"),
])
def test_moe_refuses_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        MoE(4, 4, **kwargs)


def test_gpt_and_sharding_refusals():
    with pytest.raises(ValueError, match="moe_top_k=3 must be between 1 and moe_experts=2"):
        _gpt().__class__(11, 6, 8, 2, 2, moe_experts=2, moe_top_k=3)
    with pytest.raises(ValueError, match="moe_every=0 must be >= 1"):
        GPT(11, 6, 8, 2, 2, moe_experts=2, moe_every=0)
    with pytest.raises(ValueError, match="aux_weight"):
        set_aux_weight(_gpt(), -1.0)
    with pytest.raises(ValueError, match="experts=4 must be divisible by ep=3"):
        MoE(4, 4, experts=4).shard(types.SimpleNamespace(rank=0, size=3))
    with pytest.raises(ValueError, match="has no nn.MoE layer"):
        expert_parallel(MLP(4, 4), Communicator(MPI.COMM_SELF))


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (np.float32, 2e-5)])
def test_moe_on_the_device_standin_equals_the_host(standin, dtype, tol):
    """CuPy's rules (no implicit way back to the host, no host/device mixing) on the layer's
    routing, gathers and scatters: the same outputs and gradients as on NumPy."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 6, 8))
    r = rng.standard_normal((2, 6, 8))
    got = []
    for where in ("cpu", "gpu"):
        m = MoE(8, 6, experts=4, top_k=2, capacity=1.0, rng=13, dtype=dtype).to(where)
        m.aux_weight = 0.2
        xd, rd = (x.astype(dtype), r.astype(dtype))
        xd, rd = (xd, rd) if where == "cpu" else (standin.asarray(xd), standin.asarray(rd))
        out = m.forward(xd)
        gx = m.backward(rd)
        host = [standin.asnumpy(a) if where == "gpu" else a for a in (out, gx, *(p.grad for p in m.parameters()))]
        got.append((host, m.aux_loss, m.tokens_per_expert.copy()))
    (h_cpu, aux_cpu, tpe_cpu), (h_dev, aux_dev, tpe_dev) = got
    for a, b in zip(h_cpu, h_dev):
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol)
    assert aux_dev == pytest.approx(aux_cpu, rel=tol)
    np.testing.assert_array_equal(tpe_dev, tpe_cpu)
