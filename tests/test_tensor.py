"""Tensor parallelism: each parallel layer equals its serial layer (float64), training follows the
serial loss curve at tp=2 (and tp=2 x dp=2), bad sizes are refused on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import hpctrain as ht
from hpctrain import Communicator, ProcessGrid
from hpctrain.errors import GridError, MismatchError
from hpctrain.nn import GPT, MLP, CausalSelfAttention, CrossEntropyLoss, Linear, MSELoss, Sequential, TransformerBlock
from hpctrain.optim import AdamW, clip_grad_norm
from hpctrain.parallel.tensor import (
    BACKWARD,
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    TensorParallelTrainer,
    copy_to_tp,
    full_state_dict,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
    shard_map,
    tensor_parallel,
    traffic,
)

F64 = np.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _local_of(layer, name, full):
    """This rank's piece of a full array, by the layer's shard index."""
    return full[layer.shard_index[name][1]]


def _check_grads(serial, parallel):
    """Every parallel parameter's data and grad equal the matching slice of the serial one's."""
    ser = dict(serial.named_parameters())
    for name, (p, full, index) in shard_map(parallel).items():
        assert tuple(full) == ser[name].shape, name
        np.testing.assert_allclose(p.data, ser[name].data[index], **TOL, err_msg=f"{name} data")
        np.testing.assert_allclose(p.grad, ser[name].grad[index], **TOL, err_msg=f"{name} grad")


# -- without MPI (a one-rank group) -------------------------------------------------------------


def test_mappings_are_twins_and_free_on_one_rank():
    one = Communicator(MPI.COMM_SELF)
    assert BACKWARD[copy_to_tp] is reduce_from_tp and BACKWARD[reduce_from_tp] is copy_to_tp
    assert BACKWARD[gather_from_tp] is scatter_to_tp and BACKWARD[scatter_to_tp] is gather_from_tp
    x = np.arange(6.0).reshape(2, 3)
    traffic.reset()
    for f in BACKWARD:
        assert f(x, one) is x
    assert traffic.bytes == {"allreduce": 0, "allgather": 0}


def test_tp1_model_equals_serial():
    one = Communicator(MPI.COMM_SELF)
    serial = TransformerBlock(8, 2, 16, rng=0, dtype=F64)
    par = tensor_parallel(serial, one)
    x = np.random.default_rng(1).standard_normal((2, 5, 8))
    np.testing.assert_allclose(par.forward(x), serial.forward(x), **TOL)
    g = np.random.default_rng(2).standard_normal((2, 5, 8))
    np.testing.assert_allclose(par.backward(g), serial.backward(g), **TOL)
    _check_grads(serial, par)
    assert [n for n, _ in par.named_parameters()] == [n for n, _ in serial.named_parameters()]


# -- each parallel layer against its serial layer ------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("gather", [False, True])
def test_column_parallel_linear(comm, gather):
    n = comm.size
    serial = Linear(5, 3 * n, rng=0, dtype=F64)
    par = ColumnParallelLinear.from_serial(serial, comm, gather_output=gather)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 5))
    g = rng.standard_normal((2, 4, 3 * n))
    y, gx = serial.forward(x), serial.backward(g)
    yp = par.forward(x)
    np.testing.assert_allclose(yp, y if gather else _local_of(par, "bias", y.T).T, **TOL)
    gxp = par.backward(g if gather else _local_of(par, "bias", g.T).T)
    np.testing.assert_allclose(gxp, gx, **TOL)
    _check_grads(serial, par)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("parallel_input", [True, False])
def test_row_parallel_linear(comm, parallel_input):
    n = comm.size
    serial = Linear(2 * n, 3, rng=0, dtype=F64)
    par = RowParallelLinear.from_serial(serial, comm, input_is_parallel=parallel_input)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 4, 2 * n))
    g = rng.standard_normal((2, 4, 3))
    y, gx = serial.forward(x), serial.backward(g)
    rows = par.shard_index["weight"][1][0]
    np.testing.assert_allclose(par.forward(x[..., rows] if parallel_input else x), y, **TOL)
    np.testing.assert_allclose(par.backward(g), gx[..., rows] if parallel_input else gx, **TOL)
    _check_grads(serial, par)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_parallel_mlp_one_allreduce_each_way(comm):
    serial = MLP(6, 4 * comm.size, rng=0, dtype=F64)
    par = ParallelMLP.from_serial(serial, comm)
    rng = np.random.default_rng(5)
    x, g = rng.standard_normal((3, 2, 6)), rng.standard_normal((3, 2, 6))
    traffic.reset()
    np.testing.assert_allclose(par.forward(x), serial.forward(x), **TOL)
    assert traffic.calls["allreduce"] == 1 and traffic.bytes["allreduce"] == x.nbytes
    np.testing.assert_allclose(par.backward(g), serial.backward(g), **TOL)
    assert traffic.calls["allreduce"] == 2 and traffic.calls["allgather"] == 0
    _check_grads(serial, par)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_parallel_self_attention_splits_heads(comm):
    heads = 2 * comm.size
    serial = CausalSelfAttention(4 * heads, heads, rng=0, dtype=F64)
    par = ParallelSelfAttention.from_serial(serial, comm)
    assert par.n_local_heads == 2
    rng = np.random.default_rng(6)
    x, g = rng.standard_normal((2, 5, 4 * heads)), rng.standard_normal((2, 5, 4 * heads))
    np.testing.assert_allclose(par.forward(x), serial.forward(x), **TOL)
    np.testing.assert_allclose(par.backward(g), serial.backward(g), **TOL)
    _check_grads(serial, par)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_tp_part_holds_only_its_shards(comm):
    """Each split parameter owns an array of its shard's size, not a view that keeps the serial
    model's whole array alive (row slices are contiguous: ascontiguousarray returned views, and a
    tp=2 GPT held 2.34 MB where its shards are 1.66 MB, found by the planner's memory check)."""
    from hpctrain.training.memory import owned_bytes

    serial = GPT(3 * comm.size + 1, 6, 4 * comm.size, comm.size, 2, rng=0, dtype=F64)
    par = tensor_parallel(serial, comm)
    params = [p.data for p in par.parameters()]
    assert owned_bytes(params) == sum(a.nbytes for a in params)
    split = [(n, p) for n, p in par.named_parameters() if p.data.base is not None]
    assert not split, [n for n, _ in split]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_gpt_vocab_parallel_logits_and_loss(comm):
    vocab = 3 * comm.size + 1  # does not divide: uneven vocabulary shards
    serial = GPT(vocab, 6, 4 * comm.size, comm.size, 2, rng=0, dtype=F64)
    par = tensor_parallel(serial, comm)
    rng = np.random.default_rng(7)
    idx, tgt = rng.integers(0, vocab, (3, 6)), rng.integers(0, vocab, (3, 6))
    w = np.array([1.0, 0.0, 1.0])
    logits = serial.forward(idx)
    ce = CrossEntropyLoss()
    value = ce.forward(logits, tgt, w)
    serial.backward(ce.backward())
    local = par.forward(idx)
    cols = par.head.shard_index["weight"][1][1]
    assert local.shape[-1] < vocab  # the full logits never exist here
    np.testing.assert_allclose(local, logits[..., cols], **TOL)
    pce = ht.parallel.tensor.VocabParallelCrossEntropy(comm, cols.start, vocab)
    np.testing.assert_allclose(pce.forward(local, tgt, w), value, **TOL)
    par.backward(pce.backward())
    _check_grads(serial, par)
    full = full_state_dict(par, comm)
    for name, p in serial.named_parameters():
        np.testing.assert_array_equal(full[name], p.data)


# -- training against the serial loss curve ------------------------------------------------------


def _grid(comm, dp):
    if comm.size != 2 * dp:
        pytest.skip(f"needs {2 * dp} ranks for tp=2 x dp={dp}, have {comm.size}")
    return ProcessGrid(comm, tp=2)


def _train_both(grid, make_model, make_batch, loss, steps=4, clip=0.5):
    """Serial run on the global batch vs TensorParallelTrainer; returns both loss lists."""
    serial = make_model()
    tp_model = tensor_parallel(make_model(), grid.tp)
    opt_s = AdamW(serial.parameters(), lr=1e-2)
    trainer = TensorParallelTrainer(model=tp_model, loss=loss, optimizer=AdamW(tp_model.parameters(), lr=1e-2),
                                    grid=grid, clip_norm=clip)
    dp, r = grid.dp_size, grid.coords.dp
    ser_losses, tp_losses = [], []
    for _ in range(steps):
        x, y = make_batch(np.random.default_rng(11), 4 * dp)  # one batch, so the loss must fall
        ref_loss = CrossEntropyLoss() if isinstance(loss, CrossEntropyLoss) else MSELoss()
        ser_losses.append(ref_loss.forward(serial.forward(x), y))
        serial.backward(ref_loss.backward())
        ref_norm = clip_grad_norm(serial.parameters(), clip)
        opt_s.step()
        opt_s.zero_grad()
        stats = trainer.step(x[4 * r : 4 * (r + 1)], y[4 * r : 4 * (r + 1)])
        tp_losses.append(stats.loss)
        np.testing.assert_allclose(stats.grad_norm, ref_norm, rtol=1e-9)
        assert stats.samples == 4 * dp
    trainer.check_replicas()
    full = trainer.full_state_dict()
    for name, p in serial.named_parameters():
        np.testing.assert_allclose(full[name], p.data, rtol=1e-8, atol=1e-10, err_msg=name)
    return ser_losses, tp_losses


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [1, 2])
def test_two_block_transformer_follows_serial(comm, dp):
    grid = _grid(comm, dp)

    def model():
        g = np.random.default_rng(21)
        return Sequential(TransformerBlock(8, 4, 16, rng=g, dtype=F64), TransformerBlock(8, 4, 16, rng=g, dtype=F64))

    def batch(rng, b):
        return rng.standard_normal((b, 5, 8)), rng.standard_normal((b, 5, 8))

    ser, par = _train_both(grid, model, batch, MSELoss())
    np.testing.assert_allclose(par, ser, rtol=1e-9)
    assert ser[-1] < ser[0]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [1, 2])
def test_gpt_follows_serial(comm, dp):
    grid = _grid(comm, dp)

    def model():
        return GPT(11, 6, 8, 2, 2, rng=5, dtype=F64)

    def batch(rng, b):
        return rng.integers(0, 11, (b, 6)), rng.integers(0, 11, (b, 6))

    ser, par = _train_both(grid, model, batch, CrossEntropyLoss())
    np.testing.assert_allclose(par, ser, rtol=1e-9)
    assert ser[-1] < ser[0]


# -- refusals on every rank ----------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_bad_head_count_refused_on_every_rank(comm):
    heads = comm.size + 1  # never divisible by the tp size
    model = TransformerBlock(2 * heads, heads, 8, rng=0)
    with pytest.raises(ValueError, match=f"n_heads={heads} is not divisible by the tensor-parallel size {comm.size}"):
        tensor_parallel(model, comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_bad_hidden_size_refused_on_every_rank(comm):
    with pytest.raises(ValueError, match="hidden size"):
        tensor_parallel(MLP(4, 2 * comm.size + 1, rng=0), comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_different_models_refused_on_every_rank(comm):
    d = 8 if comm.rank == 0 else 12
    with pytest.raises(MismatchError, match="tensor_parallel"):
        tensor_parallel(MLP(d, 4 * comm.size, rng=0), comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_bad_shapes_refused_on_every_rank(comm):
    grid = ProcessGrid(comm, tp=comm.size)
    model = tensor_parallel(MLP(4, 2 * comm.size, rng=0, dtype=F64), grid.tp)
    trainer = TensorParallelTrainer(model=model, loss=MSELoss(), optimizer=AdamW(model.parameters()), grid=grid)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear\(4, "):
        trainer.step(np.zeros((2, 5)), np.zeros((2, 4)))
    b = 2 if comm.rank == 0 else 3
    with pytest.raises(MismatchError, match="batch shapes"):
        trainer.step(np.zeros((b, 4)), np.zeros((b, 4)))
    stats = trainer.step(np.ones((2, 4)), np.zeros((2, 4)))  # still usable afterwards
    assert stats.samples == 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_model_split_for_another_grid_refused(comm):
    grid = ProcessGrid(comm, tp=1)
    model = tensor_parallel(MLP(4, 2 * comm.size, rng=0), comm)
    with pytest.raises(GridError, match="split"):
        TensorParallelTrainer(model=model, loss=MSELoss(), optimizer=AdamW(model.parameters()), grid=grid)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_nonfinite_guard_decides_on_every_rank(comm):
    from hpctrain.errors import NonFiniteError

    grid = ProcessGrid(comm, tp=comm.size)
    for policy in ("skip", "raise"):
        model = tensor_parallel(MLP(4, 2 * comm.size, rng=0, dtype=F64), grid.tp)
        trainer = TensorParallelTrainer(model=model, loss=MSELoss(), optimizer=AdamW(model.parameters()), grid=grid,
                                        on_nonfinite=policy)
        before = {n: p.data.copy() for n, p in model.named_parameters()}
        x = np.ones((2, 4))
        x[1, 2] = np.nan
        if policy == "skip":
            assert trainer.step(x, np.zeros((2, 4))).skipped
        else:
            with pytest.raises(NonFiniteError, match="fc1.weight"):
                trainer.step(x, np.zeros((2, 4)))
        for n, p in model.named_parameters():
            np.testing.assert_array_equal(p.data, before[n])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_dropout_masks_agree_across_the_tp_group(comm):
    from hpctrain.nn import Dropout

    seed = 1 + comm.rank  # built differently on each rank: tensor_parallel takes tp rank 0's RNG
    model = Sequential(MLP(4, 2 * comm.size, rng=0, dtype=F64), Dropout(0.5, rng=seed))
    par = tensor_parallel(model, comm)
    out = par.forward(np.ones((3, 4)))
    everyone = comm.allgather(np.ascontiguousarray(out))
    for other in everyone:
        np.testing.assert_array_equal(other, out)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_one_rank_with_a_serial_model_refused_on_every_rank(comm):
    grid = ProcessGrid(comm, tp=comm.size)
    serial = MLP(4, 2 * comm.size, rng=0)
    split = tensor_parallel(serial, grid.tp)
    model = serial if comm.rank == 0 else split  # rank 0 forgot to split its model
    with pytest.raises(GridError, match=r"rank 0: .*got a serial model"):
        TensorParallelTrainer(model=model, loss=MSELoss(), optimizer=AdamW(model.parameters()), grid=grid)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_gpt_with_a_non_ce_loss_refused(comm):
    grid = ProcessGrid(comm, tp=comm.size)
    model = tensor_parallel(GPT(7, 4, 2 * comm.size, comm.size, 1, rng=0), grid.tp)
    with pytest.raises(ValueError, match="CrossEntropyLoss, got MSELoss"):
        TensorParallelTrainer(model=model, loss=MSELoss(), optimizer=AdamW(model.parameters()), grid=grid)


def test_a_recomputed_block_still_counts_as_one_that_splits():
    """``--tp 2 --recompute`` on the built-in MLP was refused as "no layer that splits": the
    Recompute wrapper shares its block's children, so the block itself was never seen (found by
    the combination matrix)."""
    from hpctrain.nn.recompute import Recompute
    from hpctrain.parallel.tensor import tp_split_layers

    plain = Sequential(Linear(4, 8, rng=0), MLP(8, 16, rng=1), Linear(8, 2, rng=2))
    wrapped = Sequential(Linear(4, 8, rng=0), Recompute(MLP(8, 16, rng=1)), Linear(8, 2, rng=2))
    assert tp_split_layers(plain) == tp_split_layers(wrapped) == ["1"]
    assert tp_split_layers(Sequential(Linear(4, 2, rng=0), Recompute(Linear(2, 2, rng=1)))) == []
