"""Context parallelism (issue 43): the zigzag helpers (serial), ring attention and Ulysses against
the one-process causal attention of the gathered sequence (float64, forward and the gradients of
q, k, v), a finite-difference check of ring attention's backward over the ranks, a GPT under
``context_parallel`` against the one-process GPT, and the refusals, on every rank alike.

The cp group is the world (``cp = comm.size``) and, at 4 ranks, pairs of ranks (``cp=2`` twice).
Ulysses needs ``Communicator.alltoall``."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import Communicator, ProcessGrid
from hpctrain.autograd import Tensor
from hpctrain.autograd.gradcheck import numeric_gradient
from hpctrain.nn import (
    GPT,
    CausalSelfAttention,
    CrossEntropyLoss,
    causal_attention,
    causal_attention_backward,
    recompute_blocks,
)
from hpctrain.nn import functional as F
from hpctrain.parallel import context_parallel, parallelize, zigzag_indices, zigzag_merge, zigzag_split
from hpctrain.parallel.context import context_targets
from hpctrain.parallel.cut import Stage, pipeline_pieces
from hpctrain.parallel.tensor import ParallelSelfAttention, shard_map

F64 = np.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
MODES = ["ring", "ulysses"]


# -- the zigzag helpers (serial) -----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_zigzag_indices_cover_the_sequence_once_balanced(n):
    t = 6 * n
    shares = [zigzag_indices(t, n, r) for r in range(n)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(t))
    c = t // (2 * n)
    for r, idx in enumerate(shares):
        assert idx.tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * n - 1 - r) * c, (2 * n - r) * c))
        # Causal work (keys each position sees) is the same on every rank: the zigzag's point.
        assert int((idx + 1).sum()) == int((shares[0] + 1).sum())


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_zigzag_split_and_merge_are_inverse(axis):
    x = np.arange(8**4).reshape(8, 8, 8, 8)
    n = 4
    parts = [zigzag_split(x, n, r, axis=axis) for r in range(n)]
    for r, p in enumerate(parts):
        np.testing.assert_array_equal(p, np.take(x, zigzag_indices(x.shape[axis], n, r), axis=axis))
    np.testing.assert_array_equal(zigzag_merge(parts, n, axis=axis), x)
    np.testing.assert_array_equal(zigzag_merge(np.stack(parts), n, axis=axis), x)


def test_zigzag_refusals_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"block size 100 does not split into 2\*cp=8 equal chunks"):
        zigzag_indices(100, 4, 0)
    with pytest.raises(ValueError, match=r"block size 6 does not split into 2\*cp=8"):
        zigzag_split(np.zeros((2, 6)), 4, 1)
    with pytest.raises(ValueError, match="rank 2 is not in a context-parallel group of 2"):
        zigzag_indices(8, 2, 2)
    with pytest.raises(ValueError, match="one part per rank of 3"):
        zigzag_merge([np.zeros((1, 2))] * 2, 3)


def test_one_rank_group_is_the_plain_attention():
    from mpi4py import MPI

    one = Communicator(MPI.COMM_SELF)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 2, 6, 3)) for _ in range(3))
    model = GPT(7, 8, 4, 2, 1, rng=0, dtype=F64)
    assert context_parallel(model, one) is model
    assert model.blocks[0].attn.context is None  # nothing to split over
    for mode in MODES:
        np.testing.assert_allclose(F.ring_attention(q, k, v, one, mode=mode).data, causal_attention(q, k, v)[0], **TOL)


# -- attention over the ranks --------------------------------------------------------------------


def _groups(comm):
    """The cp groups to test in this world: the world itself, and pairs at 4 ranks and more."""
    out = [("world", comm)]
    if comm.size >= 4 and comm.size % 2 == 0:
        out.append(("pairs", comm.split(comm.rank // 2)))
    return out


def _attention_case(group, mode, seed=0, heads=4):
    """Full q, k, v, dy (the same on every rank) and the one-process results."""
    n = group.size
    rng = np.random.default_rng(seed)
    q, k, v, dy = (rng.standard_normal((2, heads, 4 * n, 3)) for _ in range(4))
    y, att = causal_attention(q, k, v)
    return (q, k, v, dy), y, causal_attention_backward(dy, q, k, v, att)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_attention_equals_the_gathered_sequence(comm, mode):
    for _, group in _groups(comm):
        n, r = group.size, group.rank
        (q, k, v, dy), y, grads = _attention_case(group, mode, seed=group.size)
        share = [Tensor(zigzag_split(a, n, r, axis=2), requires_grad=True) for a in (q, k, v)]
        out = F.ring_attention(*share, group, mode=mode)
        np.testing.assert_allclose(out.data, zigzag_split(y, n, r, axis=2), **TOL)
        out.backward(zigzag_split(dy, n, r, axis=2))
        for name, t, full in zip("qkv", share, grads, strict=True):
            np.testing.assert_allclose(t.grad, zigzag_split(full, n, r, axis=2), **TOL, err_msg=f"d{name}")
            # The whole gradient, gathered, is the one-process gradient.
            np.testing.assert_allclose(zigzag_merge(group.allgather(t.grad), n, axis=2), full, **TOL)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_attention_on_the_device_stays_there(comm, mode, standin):
    """CuPy arrays (the strict stand-in): no host/device mixing, buffers staged for MPI, and the
    results those of the host."""
    n, r = comm.size, comm.rank
    (q, k, v, dy), y, grads = _attention_case(comm, mode, seed=21)
    share = [Tensor(standin.asarray(zigzag_split(a, n, r, axis=2)), requires_grad=True) for a in (q, k, v)]
    out = F.ring_attention(*share, comm, mode=mode)
    assert isinstance(out.data, standin.ndarray)
    out.backward(standin.asarray(zigzag_split(dy, n, r, axis=2)))
    np.testing.assert_allclose(out.data.get(), zigzag_split(y, n, r, axis=2), **TOL)
    for t, full in zip(share, grads, strict=True):
        assert isinstance(t.grad, standin.ndarray)
        np.testing.assert_allclose(t.grad.get(), zigzag_split(full, n, r, axis=2), **TOL)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ring_in_16_bits_rounds_like_the_attention(comm, dtype):
    """16-bit shares (K/V travel in 16 bits, the products and the merge in float32): the result is
    the float64 attention of the same 16-bit inputs up to the output's rounding."""
    from hpctrain.backend import BF16

    half = BF16 if dtype == "bfloat16" else np.dtype(np.float16)
    n, r = comm.size, comm.rank
    (q, k, v, dy), _, _ = _attention_case(comm, "ring", seed=8)
    q, k, v, dy = (a.astype(half) for a in (q, k, v, dy))
    y, att = causal_attention(*(a.astype(F64) for a in (q, k, v)))
    grads = causal_attention_backward(dy.astype(F64), *(a.astype(F64) for a in (q, k, v)), att)
    share = [Tensor(zigzag_split(a, n, r, axis=2), requires_grad=True) for a in (q, k, v)]
    out = F.ring_attention(*share, comm)
    assert out.data.dtype == half
    out.backward(zigzag_split(dy, n, r, axis=2))
    eps = 2.0 ** -7 if dtype == "bfloat16" else 2.0**-10  # the 16-bit format's unit rounding (x 2)
    np.testing.assert_allclose(out.data.astype(F64), zigzag_split(y, n, r, axis=2), atol=4 * eps, rtol=2 * eps)
    for t, full in zip(share, grads, strict=True):
        assert t.grad.dtype == half
        np.testing.assert_allclose(t.grad.astype(F64), zigzag_split(full, n, r, axis=2), atol=8 * eps, rtol=4 * eps)


@pytest.mark.mpi(min_size=2)
def test_ring_without_the_mask_is_full_attention(comm):
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 3, 4 * n, 2)) for _ in range(3))
    s = q @ k.swapaxes(-1, -2) / np.sqrt(2)
    p = np.exp(s - s.max(-1, keepdims=True))
    y = (p / p.sum(-1, keepdims=True)) @ v
    share = [zigzag_split(a, n, r, axis=2) for a in (q, k, v)]
    np.testing.assert_allclose(F.ring_attention(*share, comm, causal=False).data, zigzag_split(y, n, r, axis=2), **TOL)


@pytest.mark.mpi(min_size=2)
def test_ring_backward_against_finite_differences(comm):
    """The scalar is the same on every rank (the weighted sum over the whole sequence, summed over
    the ranks), and every rank perturbs the same element of the same full inputs, so central
    differences of it are the whole gradient, which the ranks' backward shares gather into."""
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(5)
    full = [rng.standard_normal((1, 2, 2 * n, 3)) for _ in range(3)]
    w = rng.standard_normal(full[0].shape)
    w_local = zigzag_split(w, n, r, axis=2)

    def scalar():
        y = F.ring_attention(*(zigzag_split(a, n, r, axis=2) for a in full), comm).data
        return float(comm.allreduce(np.array([(y * w_local).sum()]))[0])

    share = [Tensor(zigzag_split(a, n, r, axis=2), requires_grad=True) for a in full]
    F.ring_attention(*share, comm).backward(w_local)
    for name, t, x in zip("qkv", share, full, strict=True):
        analytic = zigzag_merge(comm.allgather(t.grad), n, axis=2)
        np.testing.assert_allclose(analytic, numeric_gradient(scalar, x, 1e-6), atol=1e-7, rtol=1e-6,
                                   err_msg=f"d{name}")  # fmt: skip


# -- a GPT under context_parallel ----------------------------------------------------------------


def _gpt():
    return GPT(13, 16, 8, 4, 2, rng=3, dtype=F64)


def _serial_reference(idx, tgt):
    model = _gpt()
    ce = CrossEntropyLoss()
    loss = ce.forward(model.forward(idx), tgt)
    model.backward(ce.backward())
    return loss, {name: p.grad.copy() for name, p in model.named_parameters()}


def _wrapped(wrap, group, mode):
    """A GPT under ``context_parallel``: as it is, its blocks recomputed, or cut into pipeline pieces
    (one ``Stage`` of all of them: the embedding piece asks the GPT for its positions)."""
    model = _gpt()
    if wrap == "recompute":
        model, wrapped = recompute_blocks(model)
        assert wrapped == 2
    context_parallel(model, group, mode)
    return Stage(pipeline_pieces(model)) if wrap == "pieces" else model


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("wrap", ["plain", "recompute", "pieces"])
@pytest.mark.parametrize("path", ["explicit", "graph"])
@pytest.mark.parametrize("mode", MODES)
def test_gpt_equals_one_process(comm, mode, path, wrap):
    for _, group in _groups(comm):
        n, r = group.size, group.rank
        rng = np.random.default_rng(40 + n)
        idx, tgt = rng.integers(0, 13, (3, 4 * n)), rng.integers(0, 13, (3, 4 * n))
        loss, grads = _serial_reference(idx, tgt)
        model = _wrapped(wrap, group, mode)
        ce = CrossEntropyLoss()
        x, y = zigzag_split(idx, n, r), zigzag_split(tgt, n, r)
        if path == "explicit":
            mine = ce.forward(model.forward(x), y)
            model.backward(ce.backward())
        else:
            value = ce(model(Tensor(x)), y)
            value.backward()
            mine = value.data
        # Each rank's loss is the mean over its tokens (equal counts): their mean is the serial loss,
        # and the serial gradients are the mean of the ranks' (the reduction over dp x cp).
        np.testing.assert_allclose(group.allreduce(np.array([float(mine)]))[0] / n, loss, **TOL)
        for name, p in model.named_parameters():
            np.testing.assert_allclose(group.allreduce(p.grad) / n, grads[name], **TOL, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_parallelize_on_a_grid_with_cp(comm, mode):
    """``parallelize(model, grid, cp_mode=...)`` sets ``grid.cp`` on the model (recomputed blocks
    here): cp = the world, and cp=2 x dp=2 at 4 ranks, each cp group against one process."""
    for cp in sorted({comm.size, 2} if comm.size % 2 == 0 else {comm.size}):
        grid = ProcessGrid(comm, cp=cp)
        n, r = grid.cp.size, grid.cp.rank
        model = parallelize(_gpt(), grid, recompute=True, cp_mode=mode)
        assert {m.context.mode for m in context_targets(model)} == {mode}
        rng = np.random.default_rng(70 + n)
        idx, tgt = rng.integers(0, 13, (2, 4 * n)), rng.integers(0, 13, (2, 4 * n))
        loss, grads = _serial_reference(idx, tgt)
        ce = CrossEntropyLoss()
        value = ce.forward(model.forward(zigzag_split(idx, n, r)), zigzag_split(tgt, n, r))
        model.backward(ce.backward())
        np.testing.assert_allclose(grid.cp.allreduce(np.array([float(value)]))[0] / n, loss, **TOL)
        for name, p in model.named_parameters():
            np.testing.assert_allclose(grid.cp.allreduce(p.grad) / n, grads[name], **TOL, err_msg=name)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("mode", MODES)
def test_tensor_parallel_attention_under_context_parallel(comm, mode):
    """tp=2 innermost, cp over the rest (the grid's layout): the tensor-parallel attention with a
    context group equals the serial attention on the gathered sequence."""
    if comm.size % 2:
        pytest.skip("tp=2 x cp needs an even number of ranks")
    tp, cp = comm.split(comm.rank // 2), comm.split(comm.rank % 2)
    n, r = cp.size, cp.rank
    serial = CausalSelfAttention(8, 4, rng=2, dtype=F64)
    rng = np.random.default_rng(9)
    x, dy = rng.standard_normal((2, 4 * n, 8)), rng.standard_normal((2, 4 * n, 8))
    y = serial.forward(x)
    dx = serial.backward(dy)
    par = ParallelSelfAttention.from_serial(serial, tp)
    context_parallel(par, cp, mode)
    assert par.context.group is cp
    np.testing.assert_allclose(par.forward(zigzag_split(x, n, r)), zigzag_split(y, n, r), **TOL)
    np.testing.assert_allclose(par.backward(zigzag_split(dy, n, r)), zigzag_split(dx, n, r), **TOL)
    full = dict(serial.named_parameters())
    for name, (p, _, index) in shard_map(par).items():
        np.testing.assert_allclose(cp.allreduce(p.grad), full[name].grad[index], **TOL, err_msg=name)


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_sequence_that_does_not_split_is_refused(comm, mode):
    n = comm.size
    bad = np.zeros((1, 4, 3, 2))  # 3 local positions: not two equal chunks
    with pytest.raises(ValueError, match=rf"block size {3 * n} does not split into 2\*cp={2 * n} equal chunks"):
        F.ring_attention(bad, bad, bad, comm, mode=mode)
    model = context_parallel(_gpt(), comm, mode)
    with pytest.raises(ValueError, match=rf"block size {3 * n} does not split into 2\*cp={2 * n}"):
        model.forward(np.zeros((1, 3), dtype=np.int64))
    t_local = 16 // n + 2  # fits one rank's block, not the whole sequence's
    with pytest.raises(ValueError, match=rf"a sequence of {t_local * n}, longer than block_size=16"):
        model.forward(np.zeros((1, t_local), dtype=np.int64))
    ints = np.zeros((1, 4, 4, 2), dtype=np.int64)
    with pytest.raises(TypeError, match="needs floating-point q, k, v, got int64"):
        F.ring_attention(ints, ints, ints, comm, mode=mode)


@pytest.mark.mpi(min_size=2)
def test_ulysses_heads_not_divisible_is_refused(comm):
    n = comm.size
    heads = 2 * n + 1
    x = np.zeros((1, heads, 4, 2))
    with pytest.raises(ValueError, match=rf"heads \({heads}\) divisible by cp={n}"):
        F.ring_attention(x, x, x, comm, mode="ulysses")
    model = GPT(7, 8, 2 * heads, heads, 1, rng=0, dtype=F64)
    with pytest.raises(ValueError, match=rf"heads \({heads}\) divisible by cp={n}; use mode='ring'"):
        context_parallel(model, comm, "ulysses")
    assert context_parallel(model, comm, "ring").blocks[0].attn.context.mode == "ring"  # ring takes any count
    with pytest.raises(ValueError, match="mode must be one of ring, ulysses, got 'zigzag'"):
        context_parallel(model, comm, "zigzag")
