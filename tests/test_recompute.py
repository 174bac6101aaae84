"""Activation recomputation: bitwise the same losses and gradients as without it (dropout on),
only the inputs kept between forward and backward, names unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import hpctrain as ht
from hpctrain.nn import GPT, CrossEntropyLoss, Dropout, Linear, MSELoss, Recompute, ReLU, Sequential, recompute


def mlp(seed: int = 0) -> Sequential:
    g = np.random.default_rng(seed)
    return Sequential(Linear(8, 16, rng=g, dtype=np.float64), ReLU(), Dropout(0.3, rng=1),
                      Linear(16, 16, rng=g, dtype=np.float64), ReLU(), Dropout(0.2, rng=2),
                      Linear(16, 3, rng=g, dtype=np.float64))


def gpt(seed: int = 0) -> GPT:
    return GPT(vocab_size=11, block_size=6, d_model=8, n_heads=2, n_layers=3, rng=seed, dtype=np.float64,
               dropout=0.25)


def _train(model, loss, batches, steps=3):
    opt = ht.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        x, y = batches(s)
        opt.zero_grad()
        losses.append(loss.forward(model.forward(x), y))
        model.backward(loss.backward())
        grads = {p.name: p.grad.copy() for p in model.parameters()}
        opt.step()
    return losses, grads, {n: p.data.copy() for n, p in model.named_parameters()}


def _mlp_batches(s):
    g = np.random.default_rng(100 + s)
    return g.standard_normal((10, 8)), g.standard_normal((10, 3))


def _gpt_batches(s):
    g = np.random.default_rng(200 + s)
    return g.integers(0, 11, (4, 6)), g.integers(0, 11, (4, 6))


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_bitwise_equal_with_dropout(kind):
    make, loss, batches = (mlp, MSELoss, _mlp_batches) if kind == "mlp" else (gpt, CrossEntropyLoss, _gpt_batches)
    plain = make()
    names = [n for n, _ in plain.named_parameters()]
    rec = recompute(make())
    assert [n for n, _ in rec.named_parameters()] == names
    a = _train(plain, loss(), batches)
    b = _train(rec, loss(), batches)
    assert a[0] == b[0]
    for n in names:
        np.testing.assert_array_equal(a[1][n], b[1][n])
        np.testing.assert_array_equal(a[2][n], b[2][n])
    # The dropout generators end where they would without recomputation.
    r1 = [m.rng.bit_generator.state for _, m in plain.named_modules() if isinstance(m, Dropout)]
    r2 = [m.rng.bit_generator.state for _, m in rec.named_modules() if isinstance(m, Dropout)]
    assert r1 == r2 and r1


def test_dropout_really_on():
    """The equality above means something only if dropout changes the result."""
    x, y = _gpt_batches(0)
    on, off = gpt(), gpt()
    off.eval()
    assert CrossEntropyLoss().forward(on.forward(x), y) != CrossEntropyLoss().forward(off.forward(x), y)


def test_keeps_only_inputs_between_forward_and_backward():
    model = recompute(gpt())
    x, _ = _gpt_batches(0)
    model.forward(x)
    for i in range(3):
        block = model.blocks[i]
        assert isinstance(block, Recompute)
        held = [n for n, m in block.block.named_modules() if m.__dict__.get("cache") is not None]
        assert held == []
        assert len(block.cache) == 1 and block.cache[0][0].shape == (4, 6, 8)


def test_segments_and_errors():
    seq = mlp()
    wrapped = Recompute(seq, segments=[3, 4])
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in mlp().named_parameters()]
    with pytest.raises(ValueError):
        Recompute(mlp(), segments=[3, 3])
    with pytest.raises(ValueError):
        Recompute(mlp(), segments=0)
    with pytest.raises(TypeError):
        Recompute(gpt(), segments=2)
    with pytest.raises(TypeError):
        Recompute(object())
    with pytest.raises(RuntimeError):
        Recompute(Linear(2, 2)).backward(np.ones((1, 2)))


def test_swapping_a_child_reaches_the_block():
    """Strategies swap children (tensor parallelism): the wrapped block must compute with the new one."""
    model = recompute(gpt())
    block = model.blocks[0]
    new = ht.nn.MLP(8, 32, rng=5, dtype=np.float64)
    block.mlp = new
    assert block.block.mlp is new and dict(block.named_modules())["mlp"] is new


def test_pipeline_caches_travel():
    """get_cache/set_cache carry the kept inputs (pipelines keep several micro-batches in flight)."""
    a, b = recompute(gpt()), recompute(gpt())
    x1, y1 = _gpt_batches(1)
    x2, _ = _gpt_batches(2)
    loss = CrossEntropyLoss()
    v1 = loss.forward(a.forward(x1), y1)
    g1 = loss.backward()
    stash = a.get_cache()
    a.forward(x2)  # another micro-batch in between
    a.set_cache(stash)
    a.backward(g1)
    assert loss.forward(b.forward(x1), y1) == v1
    b.backward(loss.backward())
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if "drop" not in n:
            assert np.array_equal(p.grad, q.grad), n


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_data_parallel_with_recompute_bitwise():
    """Under data parallelism (overlap hooks armed), recomputation changes nothing."""
    comm = ht.Communicator()
    out = []
    for wrap in (False, True):
        model = gpt()
        if wrap:
            model = recompute(model)
        opt = ht.optim.AdamW(model.parameters(), lr=1e-2)
        tr = ht.parallel.DataParallelTrainer(model=model, loss=CrossEntropyLoss(), optimizer=opt, comm=comm,
                                             bucket_mb=0.001)
        losses = []
        for s in range(3):
            x, y = _gpt_batches(s)
            losses.append(tr.step(x[comm.rank::comm.size], y[comm.rank::comm.size]).loss)
        if wrap:
            assert tr.buckets.overlapped > 0  # hooks still fire per layer
        out.append((losses, {n: p.data.copy() for n, p in model.named_parameters()}))
        tr.close()
    assert out[0][0] == out[1][0]
    for n in out[0][1]:
        np.testing.assert_array_equal(out[0][1][n], out[1][1][n])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_tensor_parallel_swaps_inside_recompute():
    """tensor_parallel replaces the attention and MLP inside recomputed blocks; results unchanged."""
    from hpctrain import ProcessGrid
    from hpctrain.parallel import ParallelTrainer, tensor_parallel

    comm = ht.Communicator()
    if comm.size % 2:
        pytest.skip(f"tp=2 needs an even world size, got {comm.size}")
    grid = ProcessGrid(comm, tp=2)
    out = []
    for wrap in (False, True):
        model = gpt()
        if wrap:
            model = recompute(model)
        part = tensor_parallel(model, grid.tp)
        if wrap:
            assert type(part.blocks[0].block.attn).__name__ == "ParallelSelfAttention"
        tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=ht.optim.AdamW(part.parameters()),
                             grid=grid)  # fmt: skip
        d, n = grid.dp.rank, grid.dp.size
        losses = [tr.step(*(a[d::n] for a in _gpt_batches(s))).loss for s in range(2)]
        out.append((losses, {k: p.data.copy() for k, p in part.named_parameters()}))
        tr.close()
    assert out[0][0] == out[1][0]
    for k in out[0][1]:
        np.testing.assert_array_equal(out[0][1][k], out[1][1][k])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallelize_recompute_bitwise_under_composed_layouts(tp, pp):
    """``parallelize(model, grid, recompute=True)`` on tp/pp layouts (dropout on), plain and with
    zero 3 over the rest: losses and final weights bitwise those without recomputation."""
    from hpctrain import ProcessGrid
    from hpctrain.parallel import ParallelTrainer, parallelize

    comm = ht.Communicator()
    if comm.size % (tp * pp):
        pytest.skip(f"world size {comm.size} does not factor into tp={tp} x pp={pp}")
    if pp > 1:  # a pipeline of plain layers has no blocks to recompute: the same error everywhere
        plain = Sequential(Linear(3, 4), ReLU(), Linear(4, 2))
        with pytest.raises(ValueError, match="no blocks"):
            parallelize(plain, ProcessGrid(comm, tp=tp, pp=pp), recompute=True)
    out = []
    for rec, zero in ((False, 0), (True, 0), (True, 3)):
        grid = ProcessGrid(comm, tp=tp, pp=pp)
        part = parallelize(gpt(), grid, recompute=rec)
        wrapped = [n for n, m in part.named_modules() if isinstance(m, Recompute)]
        assert bool(wrapped) == rec
        tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=ht.optim.AdamW(part.parameters(), lr=1e-2),
                             grid=grid, microbatches=2, zero=zero)  # fmt: skip
        d, n = grid.dp.rank, grid.dp.size
        losses = []
        for s in range(3):
            g = np.random.default_rng(300 + s)
            x, y = g.integers(0, 11, (4 * n, 6)), g.integers(0, 11, (4 * n, 6))
            losses.append(tr.step(x[d::n], y[d::n]).loss)
        out.append((losses, {k: np.array(p.data) for k, (p, _, _) in tr.shards().items()}))
        tr.close()
    for losses, weights in out[1:]:
        assert losses == out[0][0]
        for k in out[0][1]:
            np.testing.assert_array_equal(weights[k], out[0][1][k], err_msg=k)


def test_parallelize_recompute_without_blocks():
    """One stage: a model without blocks is recomputed whole (in segments)."""
    from mpi4py import MPI

    from hpctrain.parallel.parallelize import parallelize

    grid = ht.ProcessGrid(ht.Communicator(MPI.COMM_SELF))
    part = parallelize(mlp(), grid, recompute=True)
    assert isinstance(part, Recompute) and part.segments is not None


class _GlobalNoise(ht.nn.Module):
    """Forward only: ``fc(x)`` times noise drawn from NumPy's global generator."""

    def __init__(self):
        self.fc = Linear(4, 4, rng=0, dtype=np.float64)

    def forward(self, x):
        h = self.fc(x)
        return h * (1.0 + np.random.standard_normal(h.shape))


class _GlobalNoiseExplicit(ht.nn.Module):
    """The same with its own backward (the explicit protocol)."""

    def __init__(self):
        self.fc = Linear(4, 4, rng=0, dtype=np.float64)
        self.cache = None

    def forward(self, x):
        h = self.fc(x)
        self.cache = 1.0 + np.random.standard_normal(h.shape)
        return h * self.cache

    def backward(self, g):
        noise, self.cache = self.cache, None
        return self.fc.backward(g * noise)


@pytest.mark.parametrize("path", ["graph", "explicit"])
def test_a_forward_drawing_from_numpys_global_generator_recomputes_the_same_draws(path):
    """Issue 47.9: recomputation replays NumPy's global generator too (PyTorch's
    ``preserve_rng_state``): gradients bitwise those without it, and the generator left where
    one forward leaves it."""
    keep = np.random.get_state()

    def run(wrap):
        block = _GlobalNoise() if path == "graph" else _GlobalNoiseExplicit()
        model = Recompute(block) if wrap else block
        np.random.seed(7)
        x = np.linspace(-1.0, 1.0, 12).reshape(3, 4)
        if path == "graph":
            (model(ht.autograd.Tensor(x)) ** 2).sum().backward()
        else:
            out = model.forward(x)
            model.backward(2 * out)
        return [p.grad.copy() for p in block.parameters()], np.random.get_state()[1].copy()

    try:
        (plain, after_plain), (rerun, after_rerun) = run(False), run(True)
    finally:
        np.random.set_state(keep)
    for a, b in zip(plain, rerun, strict=True):
        assert np.any(a)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(after_plain, after_rerun)


def _workspace(comm, tp: int, rec: bool) -> tuple[dict, list[int]]:
    """A float32 GPT under tp (dp the rest), 8 samples per rank, two steps: the rank's memory report
    and the bytes each pool inside a recomputed block keeps."""
    from hpctrain import ProcessGrid
    from hpctrain.parallel import ParallelTrainer, parallelize

    grid = ProcessGrid(comm, tp=tp)
    model = GPT(vocab_size=64, block_size=32, d_model=64, n_heads=4, n_layers=2, rng=0, dtype=np.float32)
    part = parallelize(model, grid, recompute=rec)
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=ht.optim.AdamW(part.parameters()), grid=grid)
    tr.memory_report()  # watch the first step too
    d, n = grid.dp.rank, grid.dp.size
    g = np.random.default_rng(0)
    x, y = g.integers(0, 64, (8 * n, 32)), g.integers(0, 64, (8 * n, 32))
    for _ in range(2):
        stats = tr.step(x[d::n], y[d::n])
    report = tr.memory_report(stats)
    pools = [m.scratch_buffers().nbytes for _, w in part.named_modules() if isinstance(w, Recompute)
             for _, m in w.block.named_modules()]
    tr.close()
    return report, pools


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_recompute_frees_the_tensor_parallel_layers_workspace():
    """The tp layers swapped into recomputed blocks keep no reuse pools, as the serial ones: a GPT
    at tp=2 with recompute holds no more workspace than at tp=1 with recompute (tp only splits
    what is outside the blocks), and less than at tp=2 without it."""
    comm = ht.Communicator()
    if comm.size % 2:
        pytest.skip(f"tp=2 needs an even world size, got {comm.size}")
    serial, _ = _workspace(comm, 1, True)
    plain, _ = _workspace(comm, 2, False)
    split, pools = _workspace(comm, 2, True)
    assert pools and not any(pools), pools  # nothing kept inside the recomputed blocks
    assert split["workspace"] <= serial["workspace"], (split["workspace"], serial["workspace"])
    assert split["workspace"] < plain["workspace"]
    assert split["activations_peak"] < plain["activations_peak"]
