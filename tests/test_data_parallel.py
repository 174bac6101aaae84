"""DataParallelTrainer and GradBuckets: replicas, equivalence with serial training, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_mlp

import hpctrain as ht
from hpctrain.comm.buckets import GradBuckets, from_bf16, natural_key, to_bf16
from hpctrain.errors import MismatchError
from hpctrain.nn import Linear, Module, Sequential
from hpctrain.parallel import DataParallelTrainer

D_IN, D_OUT = 6, 3


def make_model(seed: int, dtype=np.float64, depth: int = 11, width: int = 12) -> Sequential:
    """An MLP deep enough (> 10 Linear layers) that natural name order matters for buckets."""
    return make_mlp(D_IN, D_OUT, width=width, depth=depth, seed=seed, dtype=dtype)


def make_opt(kind: str, params):
    if kind == "sgd":
        return ht.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return ht.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def global_data(n: int, seed: int = 7, dtype=np.float64):
    g = np.random.default_rng(seed)
    return g.normal(size=(n, D_IN)).astype(dtype), g.integers(0, D_OUT, n)


def share(a, comm):
    b = len(a) // comm.size
    return a[comm.rank * b : (comm.rank + 1) * b]


def clip_(params, max_norm):
    norm = float(np.sqrt(sum(float((p.grad * p.grad).sum()) for p in params)))
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for p in params:
            p.grad *= coef
    return norm


def serial_run(opt_kind, steps, batches, clip=None, dtype=np.float64, weights=None):
    model = make_model(0, dtype)
    opt = make_opt(opt_kind, model.parameters())
    loss = ht.nn.CrossEntropyLoss()
    losses = []
    for i in range(steps):
        x, y = batches[i]
        w = None if weights is None else weights[i]
        losses.append(loss.forward(model.forward(x), y, w))
        model.backward(loss.backward())
        if clip is not None:
            clip_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model, losses


def gathered(comm, model):
    return comm.allgather_obj({n: p.data.copy() for n, p in model.named_parameters()})


# -- serial unit tests (no MPI needed) -----------------------------------------------------------


def test_natural_key_orders_numbers():
    names = ["10.weight", "2.bias", "2.weight", "blocks.1.x", "blocks.10.x", "blocks.9.x"]
    assert sorted(names, key=natural_key) == ["2.bias", "2.weight", "10.weight", "blocks.1.x", "blocks.9.x",
                                              "blocks.10.x"]


def test_bf16_rounding_matches_reference():
    x = np.array([1.0, -2.5, 3.1415927, 1e-30, 65504.0, np.inf, -np.inf, 1.00390625, 1.01171875], np.float32)
    h = to_bf16(x, np.empty(x.shape, np.uint16))
    back = from_bf16(h, np.empty(x.shape, np.float32))
    assert back[0] == 1.0 and back[1] == -2.5 and np.isinf(back[5]) and np.isinf(back[6])
    # Ties round to even: 1 + 2^-8 sits halfway between 1 and 1 + 2^-7 -> 1.0.
    assert back[7] == 1.0 and back[8] == np.float32(1.015625)
    assert np.all(np.abs(back[:5] - x[:5]) <= np.abs(x[:5]) * 2.0**-8)
    nan = to_bf16(np.array([np.nan], np.float32), np.empty(1, np.uint16))
    assert np.isnan(from_bf16(nan, np.empty(1, np.float32)))[0]


def test_buckets_pack_by_size_and_dtype(comm):
    model = make_model(0, np.float32, depth=4, width=64)
    b = GradBuckets(model.parameters(), comm.split(comm.rank), bucket_mb=64 * 64 * 4 / 2**20)
    assert [p.name for p in b.params] == sorted((p.name for p in model.parameters()), key=natural_key)
    assert all(s <= 64 * 64 * 4 or len(bk.params) == 1 for s, bk in zip(b.sizes(), b.buckets))
    assert len(b.buckets) > 1
    for p in model.parameters():
        p.grad[...] = 1.5
    flats = [bk.flat for bk in b.buckets]
    b.begin()
    b.finish()
    assert all(bk.flat is f for bk, f in zip(b.buckets, flats))  # allocated once
    assert all(np.all(p.grad == 1.5) for p in model.parameters())


def test_serial_trainer_matches_plain_loop():
    comm = ht.Communicator().split(ht.Communicator().rank)
    x, y = global_data(24)
    model = make_model(0)
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                             optimizer=make_opt("sgd", model.parameters()),
                             comm=comm)
    for _ in range(3):
        tr.step(x, y)
    ref, _ = serial_run("sgd", 3, [(x, y)] * 3)
    for a, b in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-12, atol=1e-14)


def test_bad_arguments_refused():
    comm = ht.Communicator().split(ht.Communicator().rank)
    model = make_model(0)
    opt = make_opt("sgd", model.parameters())
    for kw in ({"accum_steps": 0}, {"clip_norm": -1.0}, {"compression": "int8"}, {"bucket_mb": 0}):
        with pytest.raises(ValueError):
            DataParallelTrainer(model=model, loss=ht.nn.MSELoss(), optimizer=opt, comm=comm, **kw)


# -- MPI tests -----------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_replicas_bitwise_identical_after_many_steps(comm):
    model = make_model(100 + comm.rank, np.float32)  # different init per rank: rank 0's wins
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                             optimizer=make_opt("adamw", model.parameters()),
                             comm=comm, bucket_mb=0.002)
    g = np.random.default_rng(comm.rank)  # different data on every rank
    for _ in range(40):
        x = g.normal(size=(8, D_IN)).astype(np.float32)
        tr.step(x, g.integers(0, D_OUT, 8))
    everyone = gathered(comm, model)
    for name, a in everyone[0].items():
        for r in range(1, comm.size):
            assert np.array_equal(a.view(np.uint32), everyone[r][name].view(np.uint32)), (name, r)
    tr.check_replicas()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_check_replicas_detects_drift(comm):
    model = make_model(0)
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                             optimizer=make_opt("sgd", model.parameters()),
                             comm=comm)
    tr.check_replicas()
    if comm.rank == comm.size - 1:
        model[2].bias.data[0] += 1e-12
    with pytest.raises(MismatchError, match=rf"2\.bias differs on ranks \[{comm.size - 1}\]"):
        tr.check_replicas()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.3])
@pytest.mark.parametrize("overlap", [True, False])
def test_equivalence_with_serial(comm, opt_kind, accum, clip, overlap):
    steps, per_rank = 4, 6
    batches = [global_data(per_rank * comm.size, seed=s) for s in range(steps)]
    model = make_model(0)
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                             optimizer=make_opt(opt_kind, model.parameters()),
                             comm=comm, bucket_mb=0.001, overlap=overlap, accum_steps=accum, clip_norm=clip)
    assert tr.strategy.hooks is None or tr.strategy.hooks.active == overlap
    stats = [tr.step(share(x, comm), share(y, comm)) for x, y in batches]
    # With overlap every bucket but the first layer's started while backward was still running.
    assert tr.buckets.overlapped == (len(tr.buckets.buckets) - 1 if overlap else 0)
    ref, ref_losses = serial_run(opt_kind, steps, batches, clip=clip)
    np.testing.assert_allclose([s.loss for s in stats], ref_losses, rtol=1e-12)
    assert all(s.samples == per_rank * comm.size for s in stats)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_close_to_serial(comm, compression):
    steps, per_rank = 5, 8
    batches = [global_data(per_rank * comm.size, seed=s, dtype=np.float32) for s in range(steps)]
    model = make_model(0, np.float32)
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                             optimizer=make_opt("sgd", model.parameters()),
                             comm=comm, bucket_mb=0.001, compression=compression)
    for x, y in batches:
        tr.step(share(x, comm), share(y, comm))
    ref, _ = serial_run("sgd", steps, batches, dtype=np.float32)
    tol = 2e-3 if compression == "fp16" else 2e-2
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(a.data, b.data, rtol=tol, atol=tol, err_msg=name)
    tr.check_replicas()  # compressed or not, every rank applies the same update


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_mismatched_models_refused_on_every_rank(comm):
    width = 12 if comm.rank == 0 else 13
    model = make_model(0, width=width)
    with pytest.raises(MismatchError, match=r"model's parameters.*ranks 0 differ from ranks 1"):
        DataParallelTrainer(model=model, loss=ht.nn.MSELoss(), optimizer=make_opt("sgd", model.parameters()),
                            comm=comm)
    model = make_model(0, dtype=np.float32 if comm.rank == comm.size - 1 else np.float64)
    with pytest.raises(ValueError, match="dtype|float"):
        DataParallelTrainer(model=model, loss=ht.nn.MSELoss(), optimizer=make_opt("sgd", model.parameters()),
                            comm=comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_mismatched_optimizer_or_config_refused(comm):
    model = make_model(0)
    opt = ht.optim.SGD(model.parameters(), lr=0.1 if comm.rank == 0 else 0.2)
    with pytest.raises(MismatchError, match=r"optimizer configuration.*lr: 0\.1 != 0\.2"):
        DataParallelTrainer(model=model, loss=ht.nn.MSELoss(), optimizer=opt, comm=comm)
    opt = ht.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(MismatchError, match="accum_steps"):
        DataParallelTrainer(model=model, loss=ht.nn.MSELoss(), optimizer=opt, comm=comm,
                            accum_steps=1 + (comm.rank == 1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_masked_samples_weight_each_rank_by_true_count(comm):
    # Rank r masks the last r samples of its share (the padding of an uneven dataset).
    per_rank, steps = 6, 3
    batches = [global_data(per_rank * comm.size, seed=10 + s) for s in range(steps)]
    w_all = np.concatenate([(np.arange(per_rank) < per_rank - min(r, per_rank - 1)).astype(float)
                            for r in range(comm.size)])
    model = make_model(0)
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                             optimizer=make_opt("sgd", model.parameters()),
                             comm=comm, accum_steps=2, bucket_mb=0.001)
    stats = [tr.step(share(x, comm), share(y, comm), share(w_all, comm)) for x, y in batches]
    keep = w_all > 0
    ref, ref_losses = serial_run("sgd", steps, [(x[keep], y[keep]) for x, y in batches])
    np.testing.assert_allclose([s.loss for s in stats], ref_losses, rtol=1e-12)
    assert stats[0].samples == int(keep.sum())
    for a, b in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-10, atol=1e-12)


class TwoBranch(Module):
    """``a(x)``, plus ``b(x)`` only where ``use_b`` (an unused branch on the other ranks)."""

    def __init__(self, use_b: bool) -> None:
        self.a = Linear(D_IN, D_OUT, rng=1, dtype=np.float64)
        self.b = Linear(D_IN, D_OUT, rng=2, dtype=np.float64)
        self.use_b = use_b

    def forward(self, x):
        y = self.a.forward(x)
        return y + self.b.forward(x) if self.use_b else y

    def backward(self, g):
        gx = self.a.backward(g)
        return gx + self.b.backward(g) if self.use_b else gx


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [True, False])
def test_unused_parameters_contribute_zeros(comm, overlap):
    x, y = global_data(4 * comm.size, seed=3)
    model = TwoBranch(use_b=comm.rank == 0)
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                             optimizer=ht.optim.SGD(model.parameters(), lr=1.0),
                             comm=comm, overlap=overlap, bucket_mb=1e-4)
    before = model.b.weight.data.copy()
    tr.step(share(x, comm), share(y, comm))
    # Expected gradient of b: rank 0's local mean gradient weighted by its share 1/size.
    ref = TwoBranch(use_b=True)
    loss = ht.nn.CrossEntropyLoss()
    loss.forward(ref.forward(x[:4]), y[:4])
    ref.backward(loss.backward())
    np.testing.assert_allclose(before - model.b.weight.data, ref.b.weight.grad / comm.size, rtol=1e-12)
    tr.check_replicas()


# A stuck rank under this trainer: tests/test_faults.py (the watchdog names it and ends the job).


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [True, False])
def test_gpt_equivalence_with_serial(comm, overlap):
    # Nested modules, embeddings (backward returns None), a block applied inside a Sequential:
    # the overlap hooks must fire only when each parameter's gradient is final.
    def gpt():
        return ht.nn.GPT(vocab_size=11, block_size=6, d_model=8, n_heads=2, n_layers=2, rng=0, dtype=np.float64)

    g = np.random.default_rng(4)
    per_rank, steps = 2, 3
    tokens = [g.integers(0, 11, (per_rank * comm.size, 6)) for _ in range(steps)]
    model = gpt()
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                             optimizer=ht.optim.AdamW(model.parameters(), lr=1e-2), comm=comm,
                             overlap=overlap, bucket_mb=2e-3, accum_steps=2, clip_norm=1.0)
    assert len(tr.buckets.buckets) > 3
    for t in tokens:
        tr.step(share(t[:, :-1], comm), share(t[:, 1:], comm))
    # After the first step buckets start in the observed backward order: all but the bucket
    # holding tok_emb (the last gradient backward produces) start while backward runs.
    last = [b.index for b in tr.buckets.buckets if any(p.name == "tok_emb.weight" for p in b.params)]
    assert tr.buckets.overlapped == (len(tr.buckets.buckets) - 1 if overlap else 0)
    assert [b.index for b in tr.buckets._order][-1:] == (last if overlap else [0])
    ref = gpt()
    opt = ht.optim.AdamW(ref.parameters(), lr=1e-2)
    loss = ht.nn.CrossEntropyLoss()
    for t in tokens:
        loss.forward(ref.forward(t[:, :-1]), t[:, 1:])
        ref.backward(loss.backward())
        ht.optim.clip_grad_norm(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_malformed_batch_on_one_rank_raises_everywhere(comm):
    model = make_model(0)
    tr = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(),
                             optimizer=make_opt("sgd", model.parameters()), comm=comm)
    x, y = global_data(4)
    if comm.rank == comm.size - 1:
        y = y[:3]
    with pytest.raises(ValueError, match=rf"rank {comm.size - 1}: x, y .*same length, got 4, 3"):
        tr.step(x, y)
    tr.step(x, global_data(4)[1])  # and the trainer is still usable afterwards
    tr.check_replicas()
