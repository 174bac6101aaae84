"""The GPU kernels' path of a whole GPT step, run on the CPU (issue 40): the device stand-in with
the kernels and cuBLAS calls emulated in NumPy (``tests/gpu_emulator.py``). A step equals the NumPy
path's; captured as a CUDA graph (``hpctrain.nn.cuda_graph``) it allocates nothing, reads nothing
back and calls no cuBLAS through the array module (the stand-in raises on each during a capture),
and its replays equal eager steps bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import hpctrain as ht
from hpctrain import backend
from hpctrain.nn import cuda_graph, gpu
from hpctrain.optim import multi_tensor
from hpctrain.training.precision import Precision

V, T, D, H, L, B = 37, 8, 16, 2, 2, 3


@pytest.fixture
def emulated(standin, monkeypatch):
    from gpu_emulator import EmulatedKernels

    monkeypatch.setattr(gpu, "ATTENTION_ROWS", 2)  # T = 8: four causal blocks, as 1,024 tokens have
    k = EmulatedKernels()
    previous = gpu.use_kernels(k)
    try:
        yield k
    finally:
        gpu.use_kernels(previous)
        gpu.shared.clear()


def _batch(i: int):
    g = np.random.default_rng(100 + i)
    return g.integers(0, V, (B, T)), g.integers(0, V, (B, T))


def _setup(device: bool, precision: str, dropout: float = 0.0, weighted: bool = False):
    model = ht.nn.GPT(V, T, D, H, L, rng=0, dropout=dropout)
    if device:
        model.to("gpu")
    # eps well above the noise of gradients that are 0 in exact arithmetic (the key bias: softmax
    # ignores a shift along a row), which Adam would otherwise blow up into steps of lr
    opt = ht.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    if precision == "bf16":
        opt.set_masters(Precision.of("bf16-mixed").make_masters(list(model.parameters())))
    loss = ht.nn.CrossEntropyLoss()
    xp = backend.get_xp("gpu" if device else "cpu")
    x0, y0 = _batch(0)
    x, y = xp.asarray(x0), xp.asarray(y0)
    w = xp.asarray(np.linspace(0.5, 1.5, B).astype(np.float32)) if weighted else None

    def step():
        out = loss.forward(model.forward(x), y, weight=w)
        model.backward(loss.backward())
        model.set_cache({})  # as the Trainer does after backward
        loss.cache = None
        opt.step()
        opt.zero_grad()
        return out

    def load(i):  # a new batch into the arrays the step reads (a captured graph's inputs)
        xi, yi = _batch(i)
        x[...], y[...] = xp.asarray(xi), xp.asarray(yi)

    return model, opt, step, load


def _poison_scores():
    """NaN into the attention's shared score arrays: the causal blocks must compute every entry the
    step reads (a stale one from the step before would pass unseen)."""
    for (tag, *_), arrays in gpu.shared._arrays.items():
        if tag.startswith("att_"):
            for a in arrays:
                a.fill(np.nan)


def _host(a):
    return backend.to_host(a).astype(np.float64)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kernel_path_step_equals_the_numpy_step(emulated, precision):
    """Three steps through every launcher (Linear's products into the gradient, bias and column
    sums, LayerNorm, attention, GELU, the loss, AdamW over all tensors) equal the NumPy path."""
    ref_model, _, ref_step, ref_load = _setup(False, precision)
    model, _, step, load = _setup(True, precision)
    launches = emulated.launches
    for i in range(3):
        ref_load(i), load(i)
        a, b = float(ref_step()), float(_host(step()))
        _poison_scores()
        assert b == pytest.approx(a, rel=1e-5 if precision == "fp32" else 2e-2)
    assert emulated.launches - launches > 30 * 3  # the kernels' path ran, not CuPy's generic one
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        got, ref = _host(q.data), p.data.astype(np.float64)
        if precision == "fp32":
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=name)
        else:  # 16-bit rounding flips the sign of a few near-zero gradients: Adam then steps the other way
            far = np.abs(got - ref) > 2e-2 * np.maximum(np.abs(ref), 1.0)
            assert far.mean() < 0.01, (name, int(far.sum()), got.size)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_captured_step_replays_like_eager_steps(emulated, precision):
    """Capture after one warm-up step; each replay (the optimizer's scalars uploaded first, a new
    batch copied into the captured inputs) equals an eager step bit for bit."""
    eager_model, _, eager_step, eager_load = _setup(True, precision)
    eager = []
    for i in range(4):
        eager_load(i)
        eager.append(float(_host(eager_step())))
    model, opt, step, load = _setup(True, precision)
    load(0)
    captured = cuda_graph.capture(step, warmup=1, before_replay=lambda: multi_tensor.advance(opt),
                                  undo=lambda: setattr(opt, "step_count", opt.step_count - 1))
    assert opt.step_count == 1 and not gpu.capturing
    replayed = [eager[0]]
    for i in range(1, 4):
        load(i)
        replayed.append(float(_host(captured.replay())))
    assert replayed == eager
    for p, q in zip(eager_model.parameters(), model.parameters()):
        assert np.array_equal(_host(p.data), _host(q.data))
    assert opt.step_count == 4


@pytest.mark.parametrize("case", ["dropout", "weighted loss", "host read", "cupy matmul"])
def test_capture_refuses_what_a_graph_cannot_hold(emulated, standin, case):
    """The capture rules can fail: a host seed per step (dropout), an allocation (a weighted loss's
    device denominator), a read back, a product through the array module."""
    model, opt, step, _ = _setup(True, "fp32", dropout=0.1 if case == "dropout" else 0.0,
                                 weighted=case == "weighted loss")
    if case == "host read":
        inner = step

        def step():
            return float(inner())
    elif case == "cupy matmul":
        a = standin.zeros((4, 4), np.float32)

        def step():
            standin.matmul(a, a, out=a)
    with pytest.raises((standin.CaptureError, RuntimeError)) as err:
        cuda_graph.capture(step, warmup=1)
    assert not gpu.capturing and standin._recording is None
    assert any(w in str(err.value) for w in ("captured", "dropout"))


def test_squared_norm_of_many_gradients_in_two_launches(emulated, standin):
    """The trainer's gradient norm: float32 and bfloat16 gradients of any sizes (past one block,
    empty ones) in one launch per dtype and one to add the blocks; inf stays inf."""
    from hpctrain.backend import BF16

    g = np.random.default_rng(5)
    host = [g.standard_normal(n).astype(dt) for n, dt in ((5, np.float32), (40000, np.float32), (0, np.float32),
                                                          (70000, BF16), (3, BF16))]
    grads = [standin.asarray(a) for a in host]
    before = emulated.launches
    total = multi_tensor.sumsq(grads)
    assert emulated.launches - before == 3
    ref = sum(float((a.astype(np.float64) ** 2).sum()) for a in host)
    assert float(_host(total)[0]) == pytest.approx(ref, rel=1e-12)
    grads[1][7] = np.float32(np.inf)
    assert np.isinf(float(_host(multi_tensor.sumsq(grads))[0]))


@pytest.mark.gpu
@pytest.mark.skipif(backend.cupy() is None or not backend.is_real_cupy(backend.cupy()),
                    reason="needs CuPy and an NVIDIA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_captured_step_replays_like_eager_steps_on_the_gpu(precision):
    """The same on a GPU: a real capture (cuBLAS through hpctrain.nn.cublas, a private pool that
    the step leaves empty) replays like eager steps (the embedding's atomics may reorder sums)."""
    eager_model, _, eager_step, eager_load = _setup(True, precision)
    eager = []
    for i in range(4):
        eager_load(i)
        eager.append(float(eager_step()))
    model, opt, step, load = _setup(True, precision)
    load(0)
    captured = cuda_graph.capture(step, warmup=1, before_replay=lambda: multi_tensor.advance(opt),
                                  undo=lambda: setattr(opt, "step_count", opt.step_count - 1))
    replayed = [eager[0]]
    for i in range(1, 4):
        load(i)
        replayed.append(float(captured.replay()))
    np.testing.assert_allclose(replayed, eager, rtol=1e-5)
    assert captured.pool_bytes == 0  # nothing allocated inside the step
    for p, q in zip(eager_model.parameters(), model.parameters()):
        np.testing.assert_allclose(_host(q.data), _host(p.data), rtol=1e-4, atol=1e-6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["dp", "tp", "pp", "zero3"])
def test_strategies_on_the_kernels_path_stay_near_the_host(comm, kind, emulated, standin):
    """The conformance matrix's bf16-mixed column with the GPU kernels' path emulated: each strategy
    (Linear's products into the gradient, the shared backward buffers, the multi-tensor update of
    ZeRO's pieces) stays near the same trainer on the host (not bitwise: other sums, other orders).
    ``HPCTRAIN_TEST_EMULATED_KERNELS=1`` runs every stand-in test of the suite this way."""
    from test_conformance import build, global_batch, host, mixed, on, run

    runs = []
    for device in (None, standin):
        on(device)
        tr, d, dp = build(kind, comm, device=device, dtype=np.float32, precision=mixed("bf16-mixed"))
        stats = [run(tr, d, dp, *(a.astype(np.float32) if a.dtype.kind == "f" else a
                                   for a in global_batch(dp, seed)[:2])) for seed in range(2)]  # fmt: skip
        runs.append(([(s.loss, s.grad_norm) for s in stats], {n: host(p.data) for n, (p, _, _) in tr.shards().items()}))
    (host_stats, host_masters), (dev_stats, dev_masters) = runs
    np.testing.assert_allclose(dev_stats, host_stats, rtol=1e-2)
    for n, a in host_masters.items():
        np.testing.assert_allclose(dev_masters[n], a, rtol=1e-2, atol=2e-3, err_msg=n)
    assert emulated.launches > 0
