"""The tensor-parallel mappings are autograd Functions paired with their twins: a layer written
forward-only with them gets the right gradient (the engine ran the twins), the explicit protocol's
backward without its forward raises, and the layers compute with nn's own code (bitwise the serial
model's at tp=1, nn's row scatter)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain import Communicator
from hpctrain.autograd import Tensor, graph_nodes
from hpctrain.nn import GPT, MLP, Embedding, Linear, TransformerBlock
from hpctrain.nn.module import Parameter
from hpctrain.parallel.tensor import (
    BACKWARD,
    PAIRS,
    ColumnParallelLinear,
    CopyToTP,
    GatherFromTP,
    ParallelMLP,
    ReduceFromTP,
    RowParallelLinear,
    ScatterToTP,
    TPLayer,
    VocabParallelEmbedding,
    tensor_parallel,
    traffic,
)
from hpctrain.parallel.tensor_mappings import partition


class GatheredLinear(TPLayer):
    """``x @ W`` with ``W`` split by columns and the output gathered, written forward-only with the
    mappings: no backward of its own."""

    def __init__(self, serial: Linear, comm) -> None:
        self.comm = comm
        lo, hi = partition(serial.d_out, comm.size, comm.rank)
        self.weight = Parameter(np.ascontiguousarray(serial.weight.data[:, lo:hi]))
        self.linear = Linear.borrowing(self.weight, None)
        self.cache = None

    def compute(self, x):
        return GatherFromTP.apply(self.linear(CopyToTP.apply(x, self.comm)), self.comm)


def mappings(out) -> list[str]:
    """The mapping Functions the graph of ``out`` holds, in forward order."""
    names = {p.__name__ for p in PAIRS}
    nodes = sorted(graph_nodes(out), key=lambda n: n._seq)
    return [n._fn.__name__ for n in nodes if n._fn.__name__ in names]


def test_pairs_are_twins_by_construction():
    assert {p.twin() for p in PAIRS} == set(PAIRS)
    for p in PAIRS:
        assert p.twin().fn is p.grad and p.twin().grad is p.fn
        assert BACKWARD[p.fn] is p.grad
    assert CopyToTP.twin() is ReduceFromTP and GatherFromTP.twin() is ScatterToTP


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_layer_written_forward_only_gets_the_serial_gradient(comm):
    serial = Linear(5, 2 * comm.size, bias=False, rng=0, dtype=np.float64)
    par = GatheredLinear(serial, comm)
    rng = np.random.default_rng(3)
    x, g = rng.standard_normal((3, 5)), rng.standard_normal((3, 2 * comm.size))
    traffic.reset()
    np.testing.assert_allclose(par.forward(x), serial.forward(x), rtol=1e-12)
    assert mappings(par.cache[1]) == ["CopyToTP", "GatherFromTP"]
    assert traffic.calls == {"allreduce": 0, "allgather": 1}
    # The input gradient needs every rank's columns: only CopyToTP's twin (an all-reduce) gives it.
    np.testing.assert_allclose(par.backward(g), serial.backward(g), rtol=1e-12)
    assert traffic.calls == {"allreduce": 1, "allgather": 1}
    lo, hi = partition(serial.d_out, comm.size, comm.rank)
    np.testing.assert_allclose(par.weight.grad, serial.weight.grad[:, lo:hi], rtol=1e-12)


class FailingMidway(GatheredLinear):
    """``GatheredLinear`` whose forward raises after its local product when ``fail`` is set: half a
    forward was recorded (a user's layer hitting a bad batch, say)."""

    fail = False

    def compute(self, x):
        h = self.linear(CopyToTP.apply(x, self.comm))
        if self.fail:
            raise ValueError("bad batch")
        return GatherFromTP.apply(h, self.comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_forward_that_raised_midway_leaves_no_graph_to_run(comm):
    """A backward after such a forward must not run the half graph (with the tape it once gave a
    gradient of the wrong shape without a word); the next step must still match the serial layer."""
    serial = Linear(5, 2 * comm.size, bias=False, rng=0, dtype=np.float64)
    par = FailingMidway(serial, comm)
    rng = np.random.default_rng(3)
    x, g = rng.standard_normal((3, 5)), rng.standard_normal((3, 2 * comm.size))
    par.fail = True
    with pytest.raises(ValueError, match="bad batch"):
        par.forward(x)
    with pytest.raises(RuntimeError, match="FailingMidway.backward called without a forward"):
        par.backward(g[:, :2])
    assert not par.weight.grad.any()
    par.fail = False
    np.testing.assert_allclose(par.forward(x), serial.forward(x), rtol=1e-12)
    np.testing.assert_allclose(par.backward(g), serial.backward(g), rtol=1e-12)
    lo, hi = partition(serial.d_out, comm.size, comm.rank)
    np.testing.assert_allclose(par.weight.grad, serial.weight.grad[:, lo:hi], rtol=1e-12)


def _one_rank_layers():
    one = Communicator(MPI.COMM_SELF)
    return {
        "custom": (GatheredLinear(Linear(4, 2, rng=0), one), np.ones((2, 4), np.float32)),
        "column": (ColumnParallelLinear.from_serial(Linear(4, 2, rng=0), one), np.ones((2, 4), np.float32)),
        "row": (RowParallelLinear.from_serial(Linear(4, 2, rng=0), one), np.ones((2, 4), np.float32)),
        "mlp": (ParallelMLP.from_serial(MLP(4, 8, rng=0), one), np.ones((2, 4), np.float32)),
        "embedding": (VocabParallelEmbedding.from_serial(Embedding(5, 4, rng=0), one), np.array([[0, 3]])),
    }


@pytest.mark.parametrize("kind", ["custom", "column", "row", "mlp", "embedding"])
def test_backward_without_forward_raises(kind):
    layer, x = _one_rank_layers()[kind]
    with pytest.raises(RuntimeError, match="backward called without a forward"):
        layer.backward(np.ones((2, 2), np.float32))
    y = layer.forward(x)
    layer.backward(np.ones_like(y))
    with pytest.raises(RuntimeError, match="backward called twice after one forward"):
        layer.backward(np.ones_like(y))


def test_graph_is_the_layers_cache_and_swaps_per_micro_batch():
    """Several forwards in flight through the explicit protocol (get_cache/set_cache, as an
    explicit parent's node does): each backward runs its own micro-batch's graph."""
    one = Communicator(MPI.COMM_SELF)
    serial = Linear(4, 3, rng=0, dtype=np.float64)
    par = ColumnParallelLinear.from_serial(serial, one)
    rng = np.random.default_rng(1)
    xs, gs = rng.standard_normal((2, 2, 4)), rng.standard_normal((2, 2, 3))
    caches = []
    for x in xs:
        par.forward(x)
        caches.append(par.get_cache())
    assert isinstance(par.cache[1], Tensor) and mappings(par.cache[1]) == ["CopyToTP"]
    got = []
    for cache, g in reversed(list(zip(caches, gs))):
        par.set_cache(cache)
        got.append(par.backward(g))
    for x, g, gx in zip(xs[::-1], gs[::-1], got):
        serial.forward(x)
        np.testing.assert_array_equal(gx, serial.backward(g))


def test_linear_layers_hold_an_nn_linear_and_keep_their_names():
    one = Communicator(MPI.COMM_SELF)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        par = cls.from_serial(Linear(4, 2, rng=0), one)
        assert isinstance(par.linear, Linear) and par.linear.weight is par.weight
        assert [n for n, _ in par.named_parameters()] == ["weight", "bias"]
        assert set(par.shard_index) <= {"weight", "bias"}


@pytest.mark.parametrize("fused", ["0", None])
@pytest.mark.parametrize("case", ["gpt_f32", "block_f16"])
def test_tp1_bitwise_serial(monkeypatch, fused, case):
    """At tp=1 the parallel layers run nn's own code: forward, input gradient and parameter
    gradients (accumulated over two backward passes, as with gradient accumulation) are bitwise
    the serial model's, with and without the fused kernels, in float32 and float16."""
    if fused is None:
        monkeypatch.delenv("HPCTRAIN_FUSED", raising=False)
    else:
        monkeypatch.setenv("HPCTRAIN_FUSED", fused)
    rng = np.random.default_rng(5)
    if case == "gpt_f32":
        serial = GPT(7, 8, 8, 2, 1, rng=0, dtype=np.float32)
        xs = [rng.integers(0, 7, (6, 8)) for _ in range(2)]  # many repeated ids
        gs = [rng.standard_normal((6, 8, 7)).astype(np.float32) for _ in range(2)]
    else:
        serial = TransformerBlock(8, 2, 16, rng=0, dtype=np.float16)
        xs = [rng.standard_normal((2, 5, 8)).astype(np.float16) for _ in range(2)]
        gs = [rng.standard_normal((2, 5, 8)).astype(np.float16) for _ in range(2)]
    par = tensor_parallel(serial, Communicator(MPI.COMM_SELF))
    for x, g in zip(xs, gs):
        np.testing.assert_array_equal(par.forward(x), serial.forward(x))
        a, b = par.backward(g), serial.backward(g)
        assert (a is None and b is None) or np.array_equal(a, b)
    ser = dict(serial.named_parameters())
    for name, p in par.named_parameters():
        np.testing.assert_array_equal(p.grad, ser[name].grad, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fused", ["0", None])
def test_vocab_embedding_gradient_is_nns_row_scatter(comm, monkeypatch, fused):
    """Split over the vocabulary, each rank's rows get bitwise the serial Embedding's gradient
    (nn's scatter adds each id's rows in order, into gradients accumulated over two passes)."""
    if fused is None:
        monkeypatch.delenv("HPCTRAIN_FUSED", raising=False)
    else:
        monkeypatch.setenv("HPCTRAIN_FUSED", fused)
    vocab = 2 * comm.size + 1
    serial = Embedding(vocab, 6, rng=0, dtype=np.float32)
    par = VocabParallelEmbedding.from_serial(serial, comm)
    rng = np.random.default_rng(9)  # the same ids and gradients on every rank
    for _ in range(2):
        idx = rng.integers(0, vocab, (8, 16))
        g = rng.standard_normal((8, 16, 6)).astype(np.float32)
        np.testing.assert_array_equal(par.forward(idx), serial.forward(idx))
        assert par.backward(g) is None and serial.backward(g) is None
    np.testing.assert_array_equal(par.weight.grad, serial.weight.grad[par.start : par.stop])
