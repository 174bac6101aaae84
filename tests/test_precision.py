"""Mixed precision (``hpctrain.training.precision``): bf16-mixed and fp16-mixed GPT runs end near fp32's
loss, keep float32 masters (in the optimizer and in checkpoints, under the serial names), resume
bitwise, load any precision's checkpoint into any other, compose with tp x pp; fp16's loss
scaler skips an overflowing step on every rank and backs off, grows, and is in the checkpoint and
the metrics; bfloat16 crosses the communicator as its bits."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

import hpctrain as ht
from hpctrain import ProcessGrid
from hpctrain.autograd import Tensor
from hpctrain.backend import BF16, FP16
from hpctrain.nn import GPT, CrossEntropyLoss
from hpctrain.parallel import ParallelTrainer, parallelize
from hpctrain.training.precision import DynamicLossScaler, Precision

MIXED = ("bf16-mixed", "fp16-mixed")
STEPS = 12


def gpt():
    return GPT(vocab_size=16, block_size=8, d_model=16, n_heads=2, n_layers=2, rng=1)


def batch(seed, n=16):
    g = np.random.default_rng(seed)
    x = g.integers(0, 16, (n, 8))
    return x, (x + 1) % 16  # learnable: the next token is the token plus one


def build(comm, precision, tp=1, pp=1, zero=0, **kw):
    grid = ProcessGrid(comm, tp=tp, pp=pp)
    part = parallelize(gpt(), grid) if tp * pp > 1 else gpt()
    opt = ht.optim.AdamW(part.parameters(), lr=1e-2)
    kw.setdefault("microbatches", 2 if pp > 1 else 1)
    return ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=opt, grid=grid, precision=precision,
                           zero=zero, **kw)  # fmt: skip


def train(tr, steps, start=0):
    d, nd = tr.grid.dp.rank, tr.grid.dp.size
    out = []
    for s in range(start, start + steps):
        x, y = batch(s)
        out.append(tr.step(x[d::nd], y[d::nd]))
    return out


def evaluate(tr, first=False):
    """The loss of the trained (or, ``first``, a fresh) model on held-out batches, in its precision."""
    model = gpt() if first else tr.model
    loss = CrossEntropyLoss()
    x, y = batch(10_000, n=64)
    return loss.forward(model.forward(x), y)


@pytest.mark.parametrize("precision", MIXED)
def test_mixed_ends_within_two_percent_of_fp32(comm, precision):
    ref_tr = build(comm, "fp32")
    ref = train(ref_tr, STEPS)
    tr = build(comm, precision)
    d, nd = tr.grid.dp.rank, tr.grid.dp.size
    got, skipped = [], 0
    for i in range(STEPS):
        x, y = batch(i)
        while True:  # fp16's first steps may overflow at the initial scale 2**16: the same batch again
            got.append(tr.step(x[d::nd], y[d::nd]))
            if not got[-1].skipped:
                break
            skipped += 1
    assert skipped <= 3 and (precision == "fp16-mixed" or not skipped)
    assert tr.optimizer.step_count == STEPS
    first, last, mine = evaluate(ref_tr, first=True), evaluate(ref_tr), evaluate(tr)
    assert last < 0.8 * first  # it learns at all
    assert abs(mine - last) <= 0.02 * last, (mine, last)
    assert abs(got[-1].loss - ref[-1].loss) <= 0.02 * ref[-1].loss
    assert got[-1].loss != ref[-1].loss  # it really computed in 16 bits
    low = BF16 if precision == "bf16-mixed" else FP16
    assert {p.dtype for p in tr.params} == {low}
    assert {p.grad.dtype for p in tr.params} == {np.dtype(np.float32)}  # reduced in fp32 by default
    masters = tr.optimizer.masters
    assert {m.dtype for m in masters.values()} == {np.dtype(np.float32)}
    for p in tr.params:  # the compute copy is the master's rounding; state lives with the masters
        assert np.array_equal(p.data, masters[p.name].data.astype(low))
        assert {v.dtype for v in tr.optimizer.state[p.name].values()} == {np.dtype(np.float32)}


def test_bf16_gradient_reduction_halves_the_bytes(comm):
    ref = train(build(comm, "bf16-mixed"), STEPS)
    tr = build(comm, "bf16-mixed", grad_reduce_dtype="bf16")
    got = train(tr, STEPS)
    assert {p.grad.dtype for p in tr.params} == {BF16}
    assert abs(got[-1].loss - ref[-1].loss) <= 0.02 * ref[-1].loss
    replicas = comm.allgather(np.concatenate([tr.optimizer.masters[p.name].data.ravel() for p in tr.params]))
    assert all(np.array_equal(r, replicas[0]) for r in replicas)  # replicas stay identical


@pytest.mark.parametrize("precision", MIXED)
def test_checkpoint_holds_fp32_masters_and_resumes_bitwise(comm, shared_dir, precision):
    path = os.path.join(shared_dir, "ck.h5")
    a = build(comm, precision)
    train(a, 3)
    ht.checkpoint.save(path, a)
    header = ht.checkpoint.read_header(path)
    serial = {n for n, _ in gpt().named_parameters()}
    stored = {k[len("model/"):]: v["dtype"] for k, v in header["index"].items() if k.startswith("model/")}
    assert set(stored) == serial and set(stored.values()) == {"float32"}
    w = gpt()
    ht.checkpoint.load_weights(path, w)
    for n, p in w.named_parameters():  # the masters themselves, not their 16-bit rounding
        assert np.array_equal(p.data, a.optimizer.masters[n].data)
    after_a = train(a, 3, start=3)
    b = build(comm, precision)
    ht.checkpoint.load(path, b)
    after_b = train(b, 3, start=3)
    assert [s.loss for s in after_a] == [s.loss for s in after_b]
    for p, q in zip(a.params, b.params):
        assert np.array_equal(p.data, q.data) and p.data.dtype == q.data.dtype
        assert np.array_equal(a.optimizer.masters[p.name].data, b.optimizer.masters[q.name].data)
    if precision == "fp16-mixed":
        assert a.precision.scaler.state_dict() == b.precision.scaler.state_dict()


@pytest.mark.parametrize("src, dst", [("fp32", "bf16-mixed"), ("bf16-mixed", "fp32"), ("fp16-mixed", "bf16-mixed")])
def test_any_precision_loads_into_any_other(comm, shared_dir, src, dst):
    path = os.path.join(shared_dir, "ck.h5")
    a = build(comm, src)
    train(a, 2)
    ht.checkpoint.save(path, a)
    b = build(comm, dst)
    ht.checkpoint.load(path, b)
    full = {p.name: (a.optimizer.masters[p.name].data if a.optimizer.masters else p.data) for p in a.params}
    for p in b.params:
        if b.optimizer.masters:
            assert np.array_equal(b.optimizer.masters[p.name].data, full[p.name])
            assert np.array_equal(p.data, full[p.name].astype(p.dtype))
        else:
            assert np.array_equal(p.data, full[p.name])
    for name, st in a.optimizer.state.items():
        for k, v in st.items():
            assert np.array_equal(b.optimizer.state[name][k], v)
    assert not train(b, 1, start=2)[0].skipped


def test_composes_with_tp_and_pp(comm):
    if comm.size < 2 or comm.size % 2:
        pytest.skip("tp=2 or pp=2 needs an even world")
    def make(name):  # fp16 at a scale no layout overflows at: every layout updates at every step
        return Precision(name, scaler=DynamicLossScaler(init_scale=2.0**8) if name == "fp16-mixed" else None)

    for precision in MIXED:
        ref = train(build(comm, make(precision)), 4)
        for tp, pp in ((2, 1), (1, 2)) + (((2, 2),) if comm.size % 4 == 0 else ()):
            got = train(build(comm, make(precision), tp=tp, pp=pp), 4)
            assert not any(s.skipped for s in got + ref)
            # Other layouts cut the matrix products (and their 16-bit roundings) differently.
            np.testing.assert_allclose([s.loss for s in got], [s.loss for s in ref], rtol=2e-2)


class _PoisonOnce:
    """Writes inf into one gradient of the wrapped module's backward at the call numbered ``at``."""

    def __init__(self, module, at):
        self.calls, self.at, self.bwd = 0, at, module.backward
        module.backward = self

    def __call__(self, g):
        out = self.bwd(g)
        self.calls += 1
        if self.calls == self.at:
            self.target.grad.reshape(-1)[0] = np.inf
        return out


def test_fp16_overflow_skips_on_every_rank_backs_off_and_grows(comm, shared_dir):
    scaler = DynamicLossScaler(init_scale=2.0**10, interval=2)
    tr = build(comm, Precision("fp16-mixed", scaler=scaler), overlap=False)
    train(tr, 1)
    if comm.rank == 0:  # an overflow on one rank only
        head = tr.model.head
        _PoisonOnce(head, at=1).target = head.weight
    before = [tr.optimizer.masters[p.name].data.copy() for p in tr.params]
    s = train(tr, 1, start=1)[0]
    assert s.skipped and s.extra["overflow"] and s.extra["loss_scale"] == 2.0**10
    assert all(np.array_equal(b, tr.optimizer.masters[p.name].data) for b, p in zip(before, tr.params))
    assert scaler.scale == 2.0**9 and tr.optimizer.step_count == 1
    stats = train(tr, 2, start=2)
    assert [s.extra["loss_scale"] for s in stats] == [2.0**9, 2.0**9] and not any(s.skipped for s in stats)
    assert scaler.scale == 2.0**10 and scaler.overflows == 1  # grew after `interval` clean steps
    path = os.path.join(shared_dir, "ck.h5")
    train(tr, 1, start=4)
    ht.checkpoint.save(path, tr)
    other = build(comm, "fp16-mixed")
    ht.checkpoint.load(path, other)
    assert other.precision.scaler.state_dict() == scaler.state_dict() == {"scale": 2.0**10, "good_steps": 1,
                                                                            "overflows": 1}


def test_loss_scale_is_in_the_metrics(comm, shared_dir):
    from hpctrain.job import run

    run_dir = os.path.join(shared_dir, "run")
    s = run({"model": "gpt", "max_samples": 16 * comm.size, "batch_size": 4 * comm.size, "epochs": 1,
             "d_model": 16, "n_heads": 2, "block_size": 8, "n_layers": 1, "log_every": 1000,
             "precision": "fp16-mixed", "run_dir": run_dir}, comm)  # fmt: skip
    if comm.rank == 0:
        lines = [json.loads(line) for line in open(s["metrics"])]
        assert lines and all(rec["loss_scale"] == 2.0**16 for rec in lines)
    per = s["memory"]["bytes_per_param"]
    assert (per["params"], per["grads"], per["optimizer"]) == (2.0, 4.0, 12.0)


def test_bad_precision_settings_raise_on_every_rank(comm):
    with pytest.raises(ValueError, match="precision must be one of"):
        build(comm, "bf16")
    with pytest.raises(ValueError, match="needs a mixed precision"):
        build(comm, "fp32", grad_reduce_dtype="bf16")
    with pytest.raises(ValueError, match="compression"):
        build(comm, "bf16-mixed", compression="bf16")
    with pytest.raises(ValueError, match="power of two"):
        DynamicLossScaler(init_scale=3.0)


def test_precision_flags():
    from hpctrain.errors import ConfigError
    from hpctrain.job.config import Config, resolve

    with pytest.raises(ConfigError, match="--grad-reduce-dtype bf16 needs --precision"):
        resolve(Config(grad_reduce_dtype="bf16"), 1)
    with pytest.raises(ConfigError, match="overflow fp16"):
        resolve(Config(precision="bf16-mixed", grad_reduce_dtype="fp16"), 1)
    with pytest.raises(ConfigError, match="not --compression"):
        resolve(Config(precision="bf16-mixed", compression="bf16"), 2)
    assert resolve(Config(precision="fp16-mixed"), 1).precision == "fp16-mixed"


def test_loss_scale_flags_reach_the_scaler_and_only_fp16_takes_them(comm):
    from hpctrain.errors import ConfigError
    from hpctrain.job.builders import build_trainer
    from hpctrain.job.config import Config, resolve

    for other in ("fp32", "bf16-mixed"):
        with pytest.raises(ConfigError, match=f"--loss-scale-init: only --precision fp16-mixed .* {other}"):
            resolve(Config(precision=other, loss_scale_init=256.0), 1)
    with pytest.raises(ConfigError, match="--loss-scale-init: init_scale must be a positive power of two"):
        resolve(Config(precision="fp16-mixed", loss_scale_init=300.0), 1)
    with pytest.raises(ConfigError, match="--loss-scale-interval: interval must be a positive integer"):
        resolve(Config(precision="fp16-mixed", loss_scale_interval=0), 1)
    batch = 16 * comm.size  # splits over any world size
    c = resolve(Config(precision="fp16-mixed", batch_size=batch, loss_scale_init=256.0, loss_scale_interval=3),
                comm.size)
    tr = build_trainer(c, gpt(), comm)
    scaler = tr.precision.scaler
    assert (scaler.scale, scaler.interval) == (256.0, 3)
    plain = resolve(Config(precision="fp16-mixed", batch_size=batch), comm.size)
    default = build_trainer(plain, gpt(), comm).precision.scaler
    assert (default.scale, default.interval) == (2.0**16, 2000)


def test_bfloat16_crosses_the_communicator(comm):
    r, n = comm.rank, comm.size
    x = np.full(5, r + 1, dtype=ml_dtypes.bfloat16)
    assert comm.allreduce(x).astype(np.float32).tolist() == [n * (n + 1) / 2] * 5
    req = comm.iallreduce(x.copy())
    assert req.wait().dtype == BF16
    got = comm.allgather(x)
    assert got.dtype == BF16 and got[:, 0].astype(np.float32).tolist() == [float(k + 1) for k in range(n)]
    y = x.copy()
    comm.bcast(y, root=n - 1)
    assert y.astype(np.float32).tolist() == [float(n)] * 5
    with pytest.raises(ht.errors.DtypeError, match="op='sum' only"):
        comm.allreduce(x, op="max")
    if n > 1:
        out = np.empty(5, dtype=ml_dtypes.bfloat16)
        reqs = [comm.isend(x, (r + 1) % n), comm.irecv(out, (r - 1) % n)]
        assert reqs[1].wait() is out
        reqs[0].wait()
        assert out.astype(np.float32).tolist() == [float((r - 1) % n + 1)] * 5


def _masters_of(tr):
    """``{serial name: float32 master}`` of a trainer (collective under ZeRO: gathered)."""
    out = {n: np.array(p.data) for n, (p, _, _) in tr.shards().items()}
    assert {a.dtype for a in out.values()} == {np.dtype(np.float32)}
    return out


@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_zero_levels_shard_the_masters_and_equal_zero0(comm, shared_dir, reduce):
    n = comm.size
    ref = build(comm, "bf16-mixed", grad_reduce_dtype=reduce)
    ref_loss = [s.loss for s in train(ref, 3)]
    g = 4.0 if reduce == "fp32" else 2.0  # gradient bytes per parameter
    per = ref.memory_summary()["bytes_per_param"]
    assert (per["params"], per["grads"], per["optimizer"]) == (2.0, g, 12.0)  # 2 + 2 + 12 with bf16 grads
    if reduce == "fp32":  # fp32 Adam for comparison: 4 + 4 + 8
        fp = build(comm, "fp32")
        train(fp, 1)  # Adam's moments exist from the first update on
        per = fp.memory_summary()["bytes_per_param"]
        assert (per["params"], per["grads"], per["optimizer"], per["model_states"]) == (4.0, 4.0, 8.0, 16.0)
    exact = n & (n - 1) == 0  # the reduce-scatter adds in the all-reduce's association (power-of-two groups)
    path = os.path.join(shared_dir, "z3.h5")
    for zero in (1, 2, 3):
        tr = build(comm, "bf16-mixed", zero=zero, grad_reduce_dtype=reduce)
        got = [s.loss for s in train(tr, 3)]
        if exact:
            assert got == ref_loss
        np.testing.assert_allclose(got, ref_loss, rtol=5e-3)
        # The ZeRO paper's model states, sharded over the dp size step by step.
        per = tr.memory_summary()["bytes_per_param"]
        want = (2.0 / n if zero == 3 else 2.0, g / n if zero >= 2 else g, 12.0 / n)
        assert per["params"] == pytest.approx(want[0], rel=0.02, abs=0.01), (zero, per)
        assert per["grads"] == pytest.approx(want[1], rel=0.02, abs=0.01), (zero, per)
        assert per["optimizer"] == pytest.approx(want[2], rel=0.02, abs=0.01), (zero, per)
        if zero == 3:
            ht.checkpoint.save(path, tr)
            mine = _masters_of(tr)
            after = [s.loss for s in train(tr, 2, start=3)]
    # The zero-3 checkpoint holds the full fp32 masters; it resumes bitwise under zero 3 and
    # loads under zero 0 with the same masters.
    w = gpt()
    ht.checkpoint.load_weights(path, w)
    assert all(np.array_equal(p.data, mine[name]) for name, p in w.named_parameters())
    again = build(comm, "bf16-mixed", zero=3, grad_reduce_dtype=reduce)
    ht.checkpoint.load(path, again)
    assert [s.loss for s in train(again, 2, start=3)] == after
    plain = build(comm, "bf16-mixed", grad_reduce_dtype=reduce)
    ht.checkpoint.load(path, plain)
    assert all(np.array_equal(a, mine[k]) for k, a in _masters_of(plain).items())


def test_statistics_are_float32_under_16_bit_compute():
    from hpctrain.nn import LayerNorm
    from hpctrain.nn.transformer import causal_attention

    g = np.random.default_rng(0)
    for low in (BF16, FP16):
        x = (g.standard_normal((4, 8, 16)) * 30 + 100).astype(low)  # a large mean: 16-bit sums lose it
        ln = LayerNorm(16)
        ln.weight.data, ln.bias.data = ln.weight.data.astype(low), ln.bias.data.astype(low)
        wide = LayerNorm(16)
        assert np.array_equal(ln.forward(x), wide.forward(x.astype(np.float32)).astype(low))
        gy = g.standard_normal(x.shape).astype(low)
        assert np.array_equal(ln.backward(gy), wide.backward(gy.astype(np.float32)).astype(low))
        logits, target = (g.standard_normal((8, 16)) * 8).astype(low), g.integers(0, 16, 8)
        loss = CrossEntropyLoss()
        assert loss.forward(logits, target) == CrossEntropyLoss().forward(logits.astype(np.float32), target)
        assert loss.backward().dtype == low
        q, k, v = (g.standard_normal((1, 2, 8, 4)).astype(low) for _ in range(3))
        y, att = causal_attention(q, k, v)
        assert att.dtype == np.float32 and y.dtype == low
        # The scores are a 16-bit product (as under autocast); the softmax over them is float32.
        np.testing.assert_allclose(att.sum(axis=-1), 1.0, atol=1e-6)
        _, att32 = causal_attention(*(a.astype(np.float32) for a in (q, k, v)))
        np.testing.assert_allclose(att, att32, atol=2e-2)


def test_a_failed_load_leaves_masters_parameters_and_scale_as_they_were(comm, shared_dir):
    path = os.path.join(shared_dir, "ck.h5")
    tr = build(comm, Precision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**8)))
    train(tr, 2)
    ht.checkpoint.save(path, tr)
    train(tr, 3, start=2)
    before = ([np.array(p.data) for p in tr.params], {k: m.data.copy() for k, m in tr.optimizer.masters.items()},
              tr.precision.scaler.state_dict())  # fmt: skip
    if comm.rank == comm.size - 1:  # the other ranks' loads succeed, then everything goes back

        def refuse(state):
            raise ValueError("refused on one rank")

        tr.load_state_dict = refuse
    with pytest.raises(ht.errors.CheckpointError):
        ht.checkpoint.load(path, tr)
    assert all(np.array_equal(a, p.data) for a, p in zip(before[0], tr.params))
    assert all(np.array_equal(before[1][k], m.data) for k, m in tr.optimizer.masters.items())
    assert tr.precision.scaler.state_dict() == before[2]


@pytest.mark.parametrize("low", [BF16, FP16])
def test_16_bit_products_accumulate_in_float32_and_round_once(low):
    from hpctrain.nn import Linear

    g = np.random.default_rng(2)
    lin = Linear(256, 8, rng=0)
    lin.weight.data, lin.bias.data = lin.weight.data.astype(low), lin.bias.data.astype(low)
    x = g.standard_normal((4, 256)).astype(low)
    product = (x.astype(np.float32) @ lin.weight.data.astype(np.float32)).astype(low)
    assert np.array_equal(lin.forward(x), (product + lin.bias.data).astype(low))


def _pieces(tr):
    """This rank's own arrays (under ZeRO its pieces of the parameters, the float32 masters and
    the optimizer state), copied."""
    arrays = tr.memory_arrays()
    return [np.array(a, copy=True) for k in ("params", "optimizer") for a in arrays[k]]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision, zero", [("bf16-mixed", 1), ("fp16-mixed", 3), ("fp32", 3)])
def test_a_failed_load_under_zero_leaves_every_ranks_pieces_as_they_were(comm, shared_dir, precision, zero):
    """All or nothing under ZeRO: one rank's load fails after the others have taken the new
    state into their pieces (sharded float32 masters, ZeRO-3 parameter pieces, optimizer state):
    every rank's pieces are bitwise as before, and training goes on exactly as without the load."""
    path = os.path.join(shared_dir, "ck.h5")
    tr, twin = (build(comm, precision, zero=zero) for _ in range(2))
    for t in (tr, twin):
        train(t, 2)
    ht.checkpoint.save(path, tr)
    for t in (tr, twin):
        train(t, 2, start=2)
    before = _pieces(tr)
    if comm.rank == comm.size - 1:
        tr.load_state_dict = lambda state: (_ for _ in ()).throw(ValueError("refused on one rank"))
    with pytest.raises(ht.errors.CheckpointError):
        ht.checkpoint.load(path, tr)
    after = _pieces(tr)
    same = len(before) == len(after) and all(a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
                                             for a, b in zip(before, after))  # fmt: skip
    assert comm.allgather_obj(same) == [True] * comm.size
    assert [s.loss for s in train(tr, 2, start=4)] == [s.loss for s in train(twin, 2, start=4)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_mixed_precision_with_the_hierarchical_backend_trains_as_the_flat_one(comm, reduce):
    """bf16-mixed composes with ``backend="hierarchical"``: float32 gradients go through the
    node-aware all-reduce, 16-bit ones (``grad_reduce_dtype="bf16"``) through the flat 16-bit
    sum; either way the run equals the flat backend's."""
    from hpctrain.comm.hierarchical import HierarchicalComm

    flat = build(comm, "bf16-mixed", grad_reduce_dtype=reduce)
    hier = build(comm, "bf16-mixed", grad_reduce_dtype=reduce, backend="hierarchical")
    assert isinstance(hier.reducer.buckets.reducer, HierarchicalComm)
    want, got = ([s.loss for s in train(t, 3)] for t in (flat, hier))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(flat.params, hier.params):
        np.testing.assert_allclose(b.data.astype(np.float32), a.data.astype(np.float32), rtol=1e-2, atol=1e-3)


def test_fp16_overflow_the_scaler_handles_prints_no_warning(comm):
    """An overflowing fp16 step is the loss scaler's business (skipped, scale halved): NumPy's
    "RuntimeWarning: overflow" for each one was noise in every fp16 run's output."""
    import warnings

    tr = build(comm, Precision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**24)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        stats = train(tr, 2)
    assert stats[0].skipped  # it did overflow


@pytest.mark.parametrize("graph", [False, True])
def test_the_position_gradient_sums_the_batch_in_float32_under_fp16_mixed(graph):
    # Issue 43's fp16-mixed MoE rows: the one-process run overflowed where an ep layout did not.
    # The cause was the GPT's position-embedding gradient, the sum over the batch of every sample's
    # residual gradient, rounded into float16 (a rank of a dp layout sums fewer samples); the
    # token embedding's rows of one token were summed alike. Here each sample's gradient is far
    # inside float16's range while the batch's sum is not; explicitly and through the graph.
    n = 64
    ref = gpt()
    half = gpt()
    Precision("fp16-mixed").make_masters(half.parameters())  # float16 parameters, float32 gradients
    tokens = np.tile(np.random.default_rng(0).integers(0, 16, (1, 8)), (n, 1))  # same sign in every sample
    g = np.random.default_rng(1).standard_normal((n, 8, 16)).astype(np.float32)
    g[:] = g[0]

    def run(model, grad):
        if graph:
            model(Tensor(tokens)).backward(grad)
        else:
            model.forward(tokens)
            model.backward(grad)

    run(ref, g)
    g *= np.float32(3 * float(np.finfo(FP16).max) / np.abs(ref.pos_emb.weight.grad).max())
    ref.zero_grad()
    run(ref, g)
    run(half, g.astype(FP16))
    assert np.abs(ref.pos_emb.weight.grad).max() / n < float(np.finfo(FP16).max) / 8  # each sample's: in range
    for name in ("pos_emb", "tok_emb"):
        got, want = getattr(half, name).weight.grad, getattr(ref, name).weight.grad
        assert got.dtype == np.float32 and np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max(), err_msg=name)
