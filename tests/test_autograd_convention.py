"""One calling convention (issue 47, items 3 and 12): an array handed to a module that trains, in
grad mode, is a constant input of the graph (the docs' "From a script" example trains every
parameter); every layer honors ``requires_grad = False`` (the weight stays bitwise as it was);
every public ``F`` operation takes plain arrays; a ``Function`` whose backward forgets a gradient
that is needed is refused, naming it and the argument."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from hpctrain import autograd as ag
from hpctrain import nn, optim
from hpctrain.errors import AutogradError
from hpctrain.nn import functional as F
from tests.test_own_model import blocks


def _finite_difference(loss_of, p, idx, h=1e-6):
    """Central difference of ``loss_of()`` in element ``idx`` of parameter ``p`` (float64)."""
    keep = p.data[idx]
    p.data[idx] = keep + h
    up = loss_of()
    p.data[idx] = keep - h
    down = loss_of()
    p.data[idx] = keep
    return (up - down) / (2 * h)


def test_the_docs_script_model_called_on_an_array_trains_every_parameter(tmp_path, monkeypatch):
    """The docs' script calls ``model(x)`` on a NumPy array: every parameter (the leading
    ``nn.Linear`` included) gets its gradient, equal to a central finite difference."""
    (tmp_path / "mymodel.py").write_text(blocks("docs/own-model.md")["forward-only"])
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        from mymodel import build

        from hpctrain.job import Config

        model = build(Config(d_model=8).replace(info={"n_in": 5, "n_classes": 3}))
    finally:
        sys.modules.pop("mymodel", None)
    model.astype(np.float64)  # float64: a finite difference to ~1e-9
    g = np.random.default_rng(0)
    x, y = g.standard_normal((12, 5)), g.integers(0, 3, 12)
    assert "model(x)" in blocks("docs/own-model.md")["script"]  # the call this test makes
    F.cross_entropy(model(x), y).backward()

    def loss_of():
        with ag.no_grad():
            return float(F.cross_entropy(model(x), y).item())

    pick = np.random.default_rng(1)
    for name, p in model.named_parameters():
        assert np.abs(p.grad).max() > 0, f"{name} got no gradient"
        for _ in range(3):
            idx = tuple(int(pick.integers(0, n)) for n in p.shape)
            want = _finite_difference(loss_of, p, idx)
            assert p.grad[idx] == pytest.approx(want, rel=1e-5, abs=1e-9), f"{name}{list(idx)}"


def test_an_array_under_no_grad_or_to_a_frozen_module_stays_the_explicit_protocol():
    lin = nn.Linear(3, 2, rng=0)
    x = np.ones((1, 3), np.float32)
    assert isinstance(lin(x), ag.Tensor)  # trains, grad mode: a node of the graph
    with ag.no_grad():
        assert isinstance(lin(x), np.ndarray)
    for p in lin.parameters():
        p.requires_grad = False
    assert isinstance(lin(x), np.ndarray)
    out = lin.forward(x)  # forward by hand, then its own backward: on arrays as ever
    assert isinstance(out, np.ndarray) and isinstance(lin.backward(np.ones_like(out)), np.ndarray)


class _Scale(nn.Module):
    """A module with its own backward (one ``ModuleCall`` node on a tensor)."""

    def __init__(self, d):
        self.w = nn.Parameter(np.linspace(0.5, 1.5, d))
        self.b = nn.Parameter(np.zeros(d))
        self.cache = None

    def forward(self, x):
        self.cache = x
        return x * self.w.data + self.b.data

    def backward(self, g):
        x, self.cache = self.cache, None
        self.w.grad += (g * x).reshape(-1, x.shape[-1]).sum(axis=0)
        self.b.grad += g.reshape(-1, x.shape[-1]).sum(axis=0)
        return g * self.w.data


F64 = np.float64
# Every nn layer type with parameters (and a module with its own backward): (model, input).
LAYERS = {
    "Linear": lambda: (nn.Linear(4, 3, rng=0, dtype=F64), (5, 4)),
    "LayerNorm": lambda: (nn.LayerNorm(4, dtype=F64), (5, 4)),
    "Embedding": lambda: (nn.Sequential(nn.Embedding(7, 4, rng=0, dtype=F64), nn.Linear(4, 3, rng=1, dtype=F64)),
                          ("ids", (5,), 7)),
    "TiedLinear": lambda: (_tied(), ("ids", (5,), 7)),
    "Conv1d": lambda: (nn.Conv1d(2, 3, 3, rng=0, dtype=F64), (2, 2, 6)),
    "Conv2d": lambda: (nn.Conv2d(2, 3, 3, padding=1, rng=0, dtype=F64), (2, 2, 5, 5)),
    "MLP": lambda: (nn.MLP(4, 8, rng=0, dtype=F64), (2, 3, 4)),
    "CausalSelfAttention": lambda: (nn.CausalSelfAttention(4, 2, rng=0, dtype=F64), (2, 3, 4)),
    "TransformerBlock": lambda: (nn.TransformerBlock(4, 2, 8, rng=0).astype(F64), (2, 3, 4)),
    "GPT": lambda: (nn.GPT(vocab_size=7, block_size=3, d_model=4, n_heads=2, n_layers=1, rng=0, dtype=F64),
                    ("ids", (2, 3), 7)),
    "Sequential": lambda: (nn.Sequential(nn.Linear(4, 4, rng=0, dtype=F64), nn.GELU(), nn.Linear(4, 3, rng=1,
                                                                                                 dtype=F64)), (5, 4)),
    "Recompute": lambda: (nn.Recompute(nn.MLP(4, 8, rng=0, dtype=F64)), (2, 3, 4)),
    "own backward": lambda: (nn.Sequential(nn.Linear(4, 4, rng=0, dtype=F64), _Scale(4)), (5, 4)),
}  # fmt: skip


def _tied():
    emb = nn.Embedding(7, 4, rng=0, dtype=F64)
    return nn.Sequential(emb, nn.LayerNorm(4, dtype=F64), nn.TiedLinear(emb.weight))


@pytest.mark.parametrize("kind", list(LAYERS))
def test_a_frozen_weight_stays_bitwise_as_it_was_in_every_layer(kind):
    """Every other parameter frozen (``requires_grad = False``): through three AdamW steps with
    weight decay, those keep their values bit for bit and a zero gradient; the others train."""
    model, spec = LAYERS[kind]()
    g = np.random.default_rng(2)
    x = g.integers(0, spec[2], spec[1]) if spec[0] == "ids" else g.standard_normal(spec)
    params = model.parameters()
    frozen = params[0::2]
    cold = {id(p) for p in frozen}
    for p in frozen:
        p.requires_grad = False
    before = {id(p): p.data.copy() for p in params}
    opt = optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        out = model(x)
        (out * g.standard_normal(out.shape)).sum().backward()
        for p in frozen:
            assert not np.any(p.grad), f"{p.name}: a frozen weight got a gradient"
        opt.step()
        opt.zero_grad()
    for p in params:
        same = np.array_equal(p.data, before[id(p)])
        assert same if id(p) in cold else not same, f"{p.name} ({'frozen' if id(p) in cold else 'trained'})"


def _args() -> dict:
    """Plain-array arguments of every public ``F`` operation: ``{name: (args, kwargs)}``."""
    g = np.random.default_rng(3)
    a, b = g.standard_normal((2, 3)), g.standard_normal((2, 3)) + 3.0
    img, k = g.standard_normal((2, 2, 4, 4)), g.standard_normal((3, 2, 3, 3))
    q = g.standard_normal((1, 2, 3, 4))
    return {
        "add": ((a, b), {}), "sub": ((a, b), {}), "mul": ((a, b), {}), "div": ((a, b), {}), "neg": ((a,), {}),
        "pow": ((b, 2.0), {}), "matmul": ((a, b.T), {}), "exp": ((a,), {}), "log": ((b,), {}), "sqrt": ((b,), {}),
        "tanh": ((a,), {}), "sigmoid": ((a,), {}), "relu": ((a,), {}), "astype": ((a, np.float32), {}),
        "sum": ((a,), {"axis": 1}), "mean": ((a,), {}), "max": ((a,), {"axis": 0}),
        "reshape": ((a, 3, 2), {}), "transpose": ((a,), {}), "swapaxes": ((a, 0, 1), {}),
        "getitem": ((a, (slice(None), 1)), {}), "setitem": ((a, (0, 1), 5.0), {}), "concat": (([a, b],), {}),
        "stack": (([a, b],), {"axis": 1}), "split": ((a, [1, 2]), {"axis": 1}), "where": ((a > 0, a, b), {}),
        "gelu": ((a,), {}), "softmax": ((a,), {}), "log_softmax": ((a,), {}), "logsumexp": ((a,), {"axis": 1}),
        "layer_norm": ((a, 3, b[0], a[0]), {}), "embedding": ((np.array([0, 1, 1]), a), {}),
        "dropout": ((a, 0.5), {"rng": 0}), "cross_entropy": ((a, np.array([0, 2])), {}),
        "mse_loss": ((a, b), {}), "scaled_dot_product_attention": ((q, q + 1, q - 1), {"is_causal": True}),
        "conv2d": ((img, k), {"padding": 1}), "conv1d": ((img[:, :, 0], k[:, :, 0]), {}),
        "max_pool2d": ((img, 2), {}), "avg_pool2d": ((img, 2), {}),
        "ring_attention": ((q[:, :, :2], q[:, :, 1:] + 1, q[:, :, :2] - 1, _one_rank()), {"causal": True}),
    }  # fmt: skip


def _one_rank():
    """A group of this rank alone: ring attention over it is the plain causal attention."""
    from mpi4py import MPI

    from hpctrain import Communicator

    return Communicator(MPI.COMM_SELF)


def _values(out):
    outs = out if isinstance(out, tuple) else (out,)
    return [np.asarray(o.data if ag.is_tensor(o) else o) for o in outs]


@pytest.mark.parametrize("name", sorted(F.__all__))
def test_every_public_F_operation_takes_plain_arrays(name):
    """Each operation of ``F.__all__`` (the test knows them all) computes on plain arrays what it
    computes on constant tensors of them, and trains a tensor argument."""
    args, kwargs = _args()[name]
    on_arrays = getattr(F, name)(*args, **kwargs)
    def wrap(v):
        if isinstance(v, list):
            return [wrap(e) for e in v]
        return ag.Tensor(v) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v

    on_tensors = getattr(F, name)(*[wrap(v) for v in args], **kwargs)
    for got, want in zip(_values(on_arrays), _values(on_tensors), strict=True):
        np.testing.assert_array_equal(got, want)


def test_F_knows_exactly_the_operations_this_test_covers():
    assert set(_args()) == set(F.__all__)


class _Forgets(ag.Function):
    @staticmethod
    def forward(ctx, a, b):
        return a * b

    @staticmethod
    def backward(ctx, g):
        return g, None  # b's gradient forgotten


def test_a_function_that_forgets_a_needed_gradient_is_refused_naming_it():
    a = ag.Tensor(np.ones(3), requires_grad=True)
    b = ag.Tensor(np.full(3, 2.0), requires_grad=True)
    with pytest.raises(AutogradError, match=r"_Forgets\.backward returned None for argument 1 .*needs a gradient"):
        _Forgets.apply(a, b).sum().backward()
    c = ag.Tensor(np.ones(3), requires_grad=True)
    _Forgets.apply(c, np.full(3, 2.0)).sum().backward()  # None for a constant: as it should be
    np.testing.assert_array_equal(c.grad, np.ones(3))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_frozen_weight_stays_as_it_was_under_data_parallel_training_and_zero(zero):
    """The trainers honor ``requires_grad = False`` too: the frozen weight, as a checkpoint sees it,
    is bitwise its initial value after AdamW steps with weight decay; the others train."""
    import hpctrain as ht

    comm = ht.Communicator()
    model = nn.Sequential(nn.Linear(4, 8, rng=0, dtype=F64), nn.GELU(), nn.Linear(8, 3, rng=1, dtype=F64))
    model[0].weight.requires_grad = False
    before = {n: p.data.copy() for n, p in model.named_parameters()}
    opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tr = ht.parallel.DataParallelTrainer(model=model, loss=nn.CrossEntropyLoss(), optimizer=opt, comm=comm, zero=zero)
    g = np.random.default_rng(comm.rank)
    try:
        for _ in range(3):
            tr.step(g.standard_normal((6, 4)), g.integers(0, 3, 6))
        after = {n: np.array(p.data).reshape(full) for n, (p, full, _) in tr.shards().items()}
    finally:
        tr.close()
    for name, value in after.items():
        same = np.array_equal(value, before[name])
        assert same if name == "0.weight" else not same, name
