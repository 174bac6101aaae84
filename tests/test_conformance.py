"""Every trainer through the same cases: they must agree with one process and with each other.

Cases: an all-padding batch, NaN with on_nonfinite="skip" and "raise", clipping, grad_norm,
the global step after a skip, and a raising step (float32 labels) followed by a good step.
Each trainer trains the same float64 model on the same global batches as one process with SGD;
after each case its parameters (through ``shards()``, so sharded layouts compare slice by slice)
must equal the serial model's.

Every case runs twice (the ``device`` fixture): on the host, and with the model and batches on the
strict device stand-in (tests/devicearray.py), which refuses host/device mixing as CuPy does: CI
has no GPU, and this is what keeps every strategy's device path honest there.

The matrix (strategy x ZeRO level x recompute x precision) runs the model twice over: as written
with nn's layers, and written forward-only (``forward_only_model``: no backward anywhere, the
autograd engine derives it), on the host and on the stand-in; both equal one process.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import ProcessGrid, backend
from hpctrain.errors import NonFiniteError
from hpctrain.nn import MLP, CrossEntropyLoss, Linear, Module, Parameter, Recompute, Sequential
from hpctrain.nn import functional as F
from hpctrain.optim import SGD, clip_grad_norm
from hpctrain.parallel import (
    DataParallelTrainer,
    ParallelTrainer,
    ParameterServerTrainer,
    PipelineParallelTrainer,
    TensorParallelTrainer,
    pipeline_stage,
    tensor_parallel,
)

D_IN, D, C, LR, PER_REPLICA = 6, 8, 3, 0.1, 4
KINDS = ["dp", "tp", "pp", "tp_pp", "ps", "zero1", "zero2", "zero3"]


def serial_model(dtype=np.float64, recompute: bool = False) -> Sequential:
    """The model every trainer trains; ``recompute``: its MLP blocks recompute their activations."""
    g = np.random.default_rng(0)
    model = Sequential(Linear(D_IN, D, rng=g, dtype=dtype), MLP(D, 16, rng=g, dtype=dtype),
                       MLP(D, 16, rng=g, dtype=dtype), Linear(D, C, rng=g, dtype=dtype))  # fmt: skip
    if recompute:
        from hpctrain.nn.recompute import recompute_blocks

        assert recompute_blocks(model)[1] == 2
    return model


class FwdLinear(Module):
    """``x @ weight + bias`` without a backward, initialised as ``nn.Linear`` (same draws)."""

    def __init__(self, d_in: int, d_out: int, rng, dtype) -> None:
        ref = Linear(d_in, d_out, rng=rng, dtype=dtype)
        self.weight, self.bias = Parameter(ref.weight.data), Parameter(ref.bias.data)

    def forward(self, x):
        return x @ self.weight + self.bias


class FwdMLP(Module):
    """``fc2(gelu(fc1(x)))`` without a backward, initialised as ``nn.MLP``."""

    def __init__(self, d: int, hidden: int, rng, dtype) -> None:
        self.fc1, self.fc2 = FwdLinear(d, hidden, rng, dtype), FwdLinear(hidden, d, rng, dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def forward_only_model(dtype=np.float64, recompute: bool = False) -> Sequential:
    """``serial_model`` written without any backward (same parameters, names and values)."""
    g = np.random.default_rng(0)
    first = FwdLinear(D_IN, D, g, dtype)
    mlps = [FwdMLP(D, 16, g, dtype), FwdMLP(D, 16, g, dtype)]
    last = FwdLinear(D, C, g, dtype)
    if recompute:
        mlps = [Recompute(m) for m in mlps]
    return Sequential(first, *mlps, last)


_built: list = []  # the test's trainers: closed after it (the parameter server's windows)


@pytest.fixture(autouse=True)
def _close_trainers():
    yield
    while _built:
        _built.pop().close()  # collective: every rank built the same trainers


def build(kind: str, comm, clip=None, policy="raise", device=None, momentum=0.0, dtype=np.float64,
          recompute=False, precision=None, forward_only=False):
    """(trainer, dp rank, dp size) for ``kind``; skips when the layout does not fit the world.

    ``device``: the stand-in module to put the model on (``None``: the host); ``precision``: a
    mixed precision (``hpctrain.training.precision.Precision``; ``dtype`` must be float32 then);
    ``forward_only``: the model written without a backward (``forward_only_model``)."""
    need = {"tp": 2, "pp": 2, "tp_pp": 4}.get(kind, 1)
    if comm.size % need:
        pytest.skip(f"{kind} needs a multiple of {need} ranks, the world has {comm.size}")
    if kind == "ps" and clip is not None:
        pytest.skip("ParameterServerTrainer applies plain SGD on the servers: it has no clip_norm")
    model = (forward_only_model if forward_only else serial_model)(dtype, recompute)
    loss = CrossEntropyLoss()
    if device is not None:
        model.to("gpu")
    kw = {"clip_norm": clip, "on_nonfinite": policy, **({"precision": precision} if precision else {})}

    def sgd(m):
        return SGD(m.parameters(), lr=LR, momentum=momentum)

    if kind.startswith("zero"):
        grid = ProcessGrid(comm)
        tr = ParallelTrainer(model=model, loss=loss, optimizer=sgd(model), grid=grid,
                             zero=int(kind[-1]), **kw)  # fmt: skip
        return tr, grid.dp.rank, grid.dp_size
    if kind == "dp":
        tr = DataParallelTrainer(model=model, loss=loss, optimizer=sgd(model), comm=comm, **kw)
        return tr, comm.rank, comm.size
    if kind == "ps":
        tr = ParameterServerTrainer(model=model, loss=loss, lr=LR, comm=comm, mode="sync", on_nonfinite=policy)
        _built.append(tr)
        return tr, comm.rank, comm.size
    if kind == "tp":
        grid = ProcessGrid(comm, tp=2)
        part = tensor_parallel(model, grid.tp)
        tr = TensorParallelTrainer(model=part, loss=loss, optimizer=sgd(part), grid=grid, **kw)
    elif kind == "pp":
        grid = ProcessGrid(comm, pp=2)
        part = pipeline_stage(model, grid.pp)
        tr = PipelineParallelTrainer(stage=part, loss=loss, optimizer=sgd(part), grid=grid,
                                     microbatches=2, **kw)  # fmt: skip
    else:
        from hpctrain.parallel import parallelize

        grid = ProcessGrid(comm, tp=2, pp=2)
        part = parallelize(model, grid)
        tr = ParallelTrainer(model=part, loss=loss, optimizer=sgd(part), grid=grid,
                             microbatches=2, **kw)  # fmt: skip
    return tr, grid.dp.rank, grid.dp_size


def global_batch(dp: int, seed: int):
    g = np.random.default_rng(seed)
    n = PER_REPLICA * dp
    return g.normal(size=(n, D_IN)), g.integers(0, C, n), np.ones(n)


def share(a, d, dp):
    """Replica ``d``'s part of a host array, on the device when the model is there (as a loader
    with ``device="gpu"`` hands it over)."""
    part = a[d * PER_REPLICA : (d + 1) * PER_REPLICA]
    return backend.to_device(part, _XP[0])


_XP = [np]  # the array module the batches go to: set by ``on`` for each test


def on(device):
    _XP[0] = np if device is None else device
    return device


def host(a):
    return backend.to_host(a)


class Serial:
    """The one-process reference."""

    def __init__(self, clip=None, dtype=np.float64) -> None:
        self.model, self.loss, self.clip = serial_model(dtype), CrossEntropyLoss(), clip
        self.opt = SGD(self.model.parameters(), lr=LR)

    def step(self, x, y, w=None) -> tuple[float, float]:
        self.opt.zero_grad()
        value = self.loss.forward(self.model.forward(x), y, w)
        self.model.backward(self.loss.backward())
        norm = clip_grad_norm(self.model.parameters(), self.clip or np.inf)
        self.opt.step()
        return value, norm


def assert_same_params(tr, ref: Serial) -> None:
    full = dict(ref.model.named_parameters())
    for name, (p, _, index) in tr.shards().items():
        np.testing.assert_allclose(host(p.data), full[name].data[index], rtol=1e-11, atol=1e-13, err_msg=name)


def run(tr, d, dp, x, y, w=None):
    return tr.step(share(x, d, dp), share(y, d, dp), None if w is None else share(w, d, dp))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_grad_norm_and_loss_match_serial(comm, kind, device):
    on(device)
    tr, d, dp = build(kind, comm, device=device)
    ref = Serial()
    for seed in range(2):
        x, y, _ = global_batch(dp, seed)
        stats = run(tr, d, dp, x, y)
        loss, norm = ref.step(x, y)
        assert not stats.skipped and stats.samples == len(y) and stats.stop is False
        np.testing.assert_allclose(stats.loss, loss, rtol=1e-12)
        np.testing.assert_allclose(stats.grad_norm, norm, rtol=1e-10)
    assert tr.global_step == 2
    assert_same_params(tr, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_clipping_matches_serial(comm, kind, device):
    on(device)
    tr, d, dp = build(kind, comm, clip=0.05, device=device)
    ref = Serial(clip=0.05)
    for seed in range(2):
        x, y, _ = global_batch(dp, seed)
        stats = run(tr, d, dp, x, y)
        _, norm = ref.step(x, y)
        assert norm > 0.05  # the case really clips
        np.testing.assert_allclose(stats.grad_norm, norm, rtol=1e-10)  # reported before clipping
    assert_same_params(tr, ref)


# The matrix's runs: nn's layers on the stand-in (their host runs are the tests above and
# test_zero/test_recompute), the forward-only model on the host and on the stand-in.
MATRIX = [("nn", "standin", np.float64), ("nn", "standin", np.float32), ("forward_only", "host", np.float64),
          ("forward_only", "standin", np.float64), ("forward_only", "standin", np.float32)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("model, where, dtype", MATRIX,
                         ids=["nn-standin-f64", "nn-standin-f32", "fwd-host-f64", "fwd-standin-f64", "fwd-standin-f32"])
def test_matrix_clipped_steps_match_serial(comm, kind, recompute, model, where, dtype, standin):
    """Strategy x ZeRO level x recompute x precision, with nn's layers and forward-only, on the
    host and the device stand-in: two steps (the first one clipped, where the trainer clips)
    equal one host process's at the precision's tolerance."""
    device = on(standin if where == "standin" else None)
    dp = comm.size // {"tp": 2, "pp": 2, "tp_pp": 4}.get(kind, 1)
    first_norm = Serial(dtype=dtype).step(*global_batch(dp, 0)[:2])[1]
    clip = None if kind == "ps" else first_norm / 2  # the first step clips (the norm depends on dp)
    tr, d, dp = build(kind, comm, clip=clip, device=device, dtype=dtype, recompute=recompute,
                      forward_only=model == "forward_only")  # fmt: skip
    ref = Serial(clip=clip, dtype=dtype)
    rtol = 1e-10 if dtype == np.float64 else 2e-5
    for seed in range(2):
        x, y, _ = global_batch(dp, seed)
        x = x.astype(dtype)
        stats = run(tr, d, dp, x, y)
        loss, norm = ref.step(x, y)
        np.testing.assert_allclose([stats.loss, stats.grad_norm], [loss, norm], rtol=rtol)
    full = dict(ref.model.named_parameters())
    for name, (p, _, index) in tr.shards().items():
        assert p.data.dtype == dtype, name
        np.testing.assert_allclose(host(p.data), full[name].data[index], rtol=rtol, atol=rtol / 100, err_msg=name)


def mixed(name: str):
    """A fresh ``Precision``; fp16's loss scale starts low enough that these steps do not overflow."""
    from hpctrain.training.precision import DynamicLossScaler, Precision

    return Precision(name, scaler=DynamicLossScaler(init_scale=2.0**8) if name == "fp16-mixed" else None)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "ps"])  # the server applies fp32 SGD itself
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("model", ["nn", "forward_only"])
def test_matrix_mixed_precision_on_the_device_equals_the_host(comm, kind, recompute, precision, model, standin):
    """The matrix's mixed-precision column (16-bit ``ml_dtypes`` arrays through the stand-in):
    two steps of each strategy on the device equal the same trainer's on the host (fp32 masters and
    16-bit parameters bitwise), and stay near one fp32 process; nn's layers and forward-only."""
    runs = []
    for device in (None, standin):
        on(device)
        tr, d, dp = build(kind, comm, device=device, dtype=np.float32, recompute=recompute,
                          precision=mixed(precision), forward_only=model == "forward_only")  # fmt: skip
        stats = [run(tr, d, dp, *(a.astype(np.float32) if a.dtype.kind == "f" else a
                                   for a in global_batch(dp, seed)[:2])) for seed in range(2)]  # fmt: skip
        masters = {n: host(p.data) for n, (p, _, _) in tr.shards().items()}
        runs.append(([(s.loss, s.grad_norm, s.skipped) for s in stats], masters,
                     [host(p.data) for p in tr.params]))  # fmt: skip
    (host_stats, host_masters, host_params), (dev_stats, dev_masters, dev_params) = runs
    # The reported loss and norm are summed in another order on the device (one transfer): close.
    assert [s[2] for s in dev_stats] == [s[2] for s in host_stats]
    np.testing.assert_allclose([s[:2] for s in dev_stats], [s[:2] for s in host_stats], rtol=1e-6)
    for n, a in host_masters.items():
        assert a.dtype == np.float32 and np.array_equal(dev_masters[n], a), n
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(dev_params, host_params))
    assert dev_params[0].dtype.itemsize == 2  # the compute copy is 16-bit
    ref = Serial(dtype=np.float32)
    losses = [ref.step(x.astype(np.float32), y)[0] for x, y, _ in (global_batch(dp, s) for s in range(2))]
    np.testing.assert_allclose([s[0] for s in dev_stats], losses, rtol=2e-2)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_all_padding_batch_changes_nothing(comm, kind, device):
    on(device)
    tr, d, dp = build(kind, comm, device=device)
    ref = Serial()
    x, y, w = global_batch(dp, 0)
    run(tr, d, dp, x, y)
    ref.step(x, y)
    updates = tr.optimizer.step_count if tr.optimizer is not None else None
    stats = run(tr, d, dp, x, y, np.zeros_like(w))
    assert stats.skipped and stats.samples == 0 and stats.loss == 0.0
    assert tr.global_step == 2  # a skipped step is still a step (one rule for every trainer)
    if updates is not None:
        assert tr.optimizer.step_count == updates  # ... but not an update
    assert_same_params(tr, ref)
    x, y, _ = global_batch(dp, 1)
    run(tr, d, dp, x, y)
    ref.step(x, y)
    assert_same_params(tr, ref)


def _nan_batch(dp, seed):
    x, y, w = global_batch(dp, seed)
    x = x.copy()
    x[1, 0] = np.nan  # in dp replica 0's share only
    return x, y, w


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_skip_on_every_rank_then_trains_on(comm, kind, device):
    on(device)
    tr, d, dp = build(kind, comm, policy="skip", device=device)
    ref = Serial()
    x, y, _ = _nan_batch(dp, 0)
    stats = run(tr, d, dp, x, y)
    assert stats.skipped and not np.isfinite(stats.loss) and stats.grad_norm is not None
    assert tr.global_step == 1
    assert_same_params(tr, ref)
    x, y, _ = global_batch(dp, 1)
    stats = run(tr, d, dp, x, y)
    ref.step(x, y)
    assert not stats.skipped and tr.global_step == 2
    assert_same_params(tr, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_raise_on_every_rank_then_trains_on(comm, kind, device):
    on(device)
    tr, d, dp = build(kind, comm, policy="raise", device=device)
    ref = Serial()
    x, y, _ = _nan_batch(dp, 0)
    with pytest.raises(NonFiniteError):
        run(tr, d, dp, x, y)
    assert tr.global_step == 0
    assert_same_params(tr, ref)
    x, y, _ = global_batch(dp, 1)
    stats = run(tr, d, dp, x, y)
    ref.step(x, y)
    assert not stats.skipped and tr.global_step == 1
    assert_same_params(tr, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_raising_step_leaves_the_trainer_ready(comm, kind, device):
    on(device)
    tr, d, dp = build(kind, comm, device=device)
    ref = Serial()
    x, y, _ = global_batch(dp, 0)
    run(tr, d, dp, x, y)
    ref.step(x, y)
    before = {n: host(p.data) for n, (p, _, _) in tr.shards().items()}
    with pytest.raises(TypeError, match="integer targets"):
        run(tr, d, dp, x, y.astype(np.float32))  # on every rank, before any update
    assert tr.global_step == 1
    for n, (p, _, _) in tr.shards().items():
        np.testing.assert_array_equal(host(p.data), before[n])
    for seed in (1, 2):  # and the next steps train as if nothing had happened
        x, y, _ = global_batch(dp, seed)
        run(tr, d, dp, x, y)
        ref.step(x, y)
    assert tr.global_step == 3
    assert_same_params(tr, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "ps"])  # the server's workers check alone
def test_bad_target_on_one_replica_raises_on_every_rank(comm, kind, device):
    """A class index out of range on the last replica only: every rank raises the loss's
    DatasetError (agreed in the step's own all-reduce, no read of its own), nothing changes, and
    the next steps train as if nothing had happened."""
    from hpctrain.errors import DatasetError

    on(device)
    tr, d, dp = build(kind, comm, device=device)
    ref = Serial()
    x, y, _ = global_batch(dp, 0)
    before = {n: host(p.data) for n, (p, _, _) in tr.shards().items()}
    y_bad = y.copy()
    y_bad[-1] = C  # the last replica's last sample
    with pytest.raises(DatasetError, match=r"rank.*: .*target 3 at position \(\d,\) is not a class index in \[0, 3\)"):
        run(tr, d, dp, x, y_bad)
    assert tr.global_step == 0
    for n, (p, _, _) in tr.shards().items():
        np.testing.assert_array_equal(host(p.data), before[n])
    for seed in (1, 2):
        x, y, _ = global_batch(dp, seed)
        run(tr, d, dp, x, y)
        ref.step(x, y)
    assert_same_params(tr, ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_stop_request_on_one_rank_reaches_every_rank(comm, kind, device):
    from hpctrain import preempt

    on(device)
    tr, d, dp = build(kind, comm, device=device)
    x, y, _ = global_batch(dp, 0)
    assert run(tr, d, dp, x, y).stop is False
    if comm.rank == comm.size - 1:
        preempt.request()
    try:
        assert run(tr, d, dp, x, y).stop is True  # agreed inside the step's own collective
    finally:
        preempt.clear()
    assert run(tr, d, dp, x, y).stop is False


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind, clip, precision", [(k, None, None) for k in KINDS]
                         + [("dp", 1e9, None), ("zero3", 1e9, None)]
                         + [(k, None, p) for k, p in (("dp", "bf16-mixed"), ("pp", "bf16-mixed"),
                                                      ("tp", "fp16-mixed"), ("zero3", "fp16-mixed"))])  # fmt: skip
def test_one_host_read_per_step_on_the_device(comm, kind, clip, precision, standin):
    """On the device the loss, gradient norm, non-finite check and the loss's target check reach
    the host in one transfer per step (a read per parameter or per micro-batch would wait for the
    GPU each time). The stand-in counts reads. (Buffers staged for MPI are counted apart:
    CUDA-aware MPI or NCCL avoid them.) ``clip=1e9`` on float64: the exactly rounded norm, whose
    gradients ride in that same transfer. The parameter server reads its loss, weight, target
    check and gradients in one transfer too; mixed precision adds none."""
    dtype = np.float32 if precision else np.float64
    tr, d, dp = build(kind, comm, clip=clip, device=on(standin), dtype=dtype,
                      precision=mixed(precision) if precision else None)  # fmt: skip
    grid = getattr(tr, "grid", None)
    last_stage = grid is None or grid.pp.rank == grid.pp.size - 1
    # The one read, on a rank holding a loss or gradients it counts in the norm (a first
    # pipeline stage on dp rank > 0 has neither: it reads nothing).
    expected = 1 if last_stage or tr.strategy._counted_grads() else 0
    counts = []
    for seed in range(3):
        x, y, w = global_batch(dp, seed)
        before = standin.syncs
        # Padding weights on the host, as the loader hands them over: they cost no read.
        tr.step(share(x.astype(dtype), d, dp), share(y, d, dp), w[d * PER_REPLICA : (d + 1) * PER_REPLICA])
        counts.append(standin.syncs - before)
    # After every step (an assert inside the loop would leave the other ranks in a collective).
    assert counts[1:] == [expected, expected]  # the first step learns orders and shapes


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["dp", "tp", "pp", "zero1", "zero3"])
def test_checkpoint_resumes_on_the_device_and_on_the_host(comm, kind, shared_dir, standin):
    """A checkpoint of a trainer on the device stand-in (parameters and momentum) resumes bitwise
    on the device and on the host: the next step of each equals the original's."""
    from hpctrain import checkpoint as ckpt

    device = on(standin)
    path = f"{shared_dir}/ckpt.h5"
    tr, d, dp = build(kind, comm, device=device, momentum=0.9)
    x, y, _ = global_batch(dp, 0)
    run(tr, d, dp, x, y)
    ckpt.save(path, tr)
    resumed = []
    for target in (device, None):  # this side, then the host
        other, _, _ = build(kind, comm, device=on(target), momentum=0.9)
        x7, y7, _ = global_batch(dp, 7)
        run(other, d, dp, x7, y7)  # another state, which the load must replace entirely
        ckpt.load(path, other)
        resumed.append(other)
    x, y, _ = global_batch(dp, 1)
    on(device)
    run(tr, d, dp, x, y)
    want = {n: host(p.data) for n, (p, _, _) in tr.shards().items()}
    for target, other in zip((device, None), resumed):
        on(target)
        run(other, d, dp, x, y)
        for n, (p, _, _) in other.shards().items():
            np.testing.assert_array_equal(host(p.data), want[n], err_msg=f"{n} resumed on {target or 'host'}")
