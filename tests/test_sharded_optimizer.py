"""The sharded optimizer alone (no MPI): a model's parameters cut into N named-range pieces, each
updated by its own ``ShardedOptimizer``, equal the full optimizer's update bitwise (float64; SGD,
Adam, AdamW with weight decay; float32 masters under mixed precision), on the host and on the
device stand-in; its state round-trips, and the pieces assemble into the full state that loads
under another number of pieces."""

from __future__ import annotations

import numpy as np
import pytest

import hpctrain as ht
from hpctrain.backend import BF16, to_host
from hpctrain.nn import Parameter
from hpctrain.optim.sharded import FlatLayout, ShardedOptimizer, assemble
from hpctrain.training.precision import Precision

SHAPES = [("emb.weight", (7, 3)), ("ln.bias", (5,)), ("fc.weight", (4, 2, 3)), ("fc.bias", (1,))]
N = sum(int(np.prod(s)) for _, s in SHAPES)


def make_opt(name, params):
    if name == "sgd":
        return ht.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    if name == "adam":
        return ht.optim.Adam(params, lr=1e-2, weight_decay=0.01)
    return ht.optim.AdamW(params, lr=1e-2, weight_decay=0.1, schedule=ht.optim.schedules.cosine(10, warmup_steps=2))


def model_params(dtype=np.float64):
    g = np.random.default_rng(5)
    return [Parameter(g.standard_normal(s).astype(dtype), name=n) for n, s in SHAPES]


def grads(step, dtype=np.float64):
    """The full gradient of ``step`` by name (magnitudes spread over decades)."""
    g = np.random.default_rng(100 + step)
    return {n: (g.standard_normal(s) * 10.0 ** g.integers(-3, 2, s)).astype(dtype) for n, s in SHAPES}


class Pieces:
    """``parts`` ShardedOptimizers over a layout of SHAPES, each with its own user optimizer (as
    each rank has), its arrays on ``xp``."""

    def __init__(self, opt, parts, xp, masters=None, dtype=np.float64):
        self.layout = FlatLayout(SHAPES, parts)
        self.xp = xp
        full = np.concatenate([p.data.ravel() for p in model_params(dtype)])
        self.opts = []
        for r in range(parts):
            lo, hi = self.layout.piece(r)
            user = make_opt(opt, model_params(dtype))
            self.opts.append(ShardedOptimizer(user, self.layout, r, xp.asarray(full[lo:hi]), masters=masters))

    def step(self, g):
        flat = np.concatenate([g[n].ravel() for n, _ in SHAPES])
        for r, o in enumerate(self.opts):
            lo, hi = self.layout.piece(r)
            o.step(self.xp.asarray(flat[lo:hi]))

    def params(self):
        return self.layout.views(np.concatenate([to_host(o.params) for o in self.opts]))


def run_full(opt, steps, masters=False, dtype=np.float64):
    params = model_params(np.float32 if masters else dtype)
    full = make_opt(opt, params)
    if masters:
        prec = Precision("bf16-mixed")
        full.set_masters(prec.make_masters(params))
    for s in range(steps):
        for p in params:
            p.grad[...] = grads(s, dtype)[p.name]
        full.step()
    return full, {p.name: p.data for p in params}


def xp_for(device):
    return np if device is None else device


@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("parts", [1, 3, 4, 40])  # 40 > elements of a parameter, some pieces empty
def test_pieces_update_bitwise_the_full_update(opt, parts, device):
    xp = xp_for(device)
    pieces = Pieces(opt, parts, xp)
    for s in range(3):
        pieces.step(grads(s))
    full, params = run_full(opt, 3)
    got = pieces.params()
    for name, want in params.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    whole = assemble(o.export_pieces() for o in pieces.opts)
    assert whole["step"] == 3 and all(o.optimizer.step_count == 3 for o in pieces.opts)
    for name, st in full.state.items():
        assert sorted(whole["state"][name]) == sorted(st), name
        for key, want in st.items():
            np.testing.assert_array_equal(to_host(whole["state"][name][key]), want, err_msg=f"{name}/{key}")


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_masters_are_float32_pieces_rounded_into_16_bit_parameters(opt, device):
    xp = xp_for(device)
    params = model_params(np.float32)
    masters = {p.name: p.data.copy() for p in params}
    layout = FlatLayout(SHAPES, 3)
    full16 = np.concatenate([p.data.ravel() for p in params]).astype(BF16)
    pieces16 = [xp.asarray(full16[slice(*layout.piece(r))]) for r in range(3)]
    opts = [ShardedOptimizer(make_opt(opt, model_params(np.float32)), layout, r, pieces16[r], masters=masters)
            for r in range(3)]  # fmt: skip
    for s in range(3):
        flat = np.concatenate([grads(s, np.float32)[n].ravel() for n, _ in SHAPES])
        for r, o in enumerate(opts):
            o.step(xp.asarray(flat[slice(*layout.piece(r))]))
    full, want16 = run_full(opt, 3, masters=True, dtype=np.float32)
    assert all(o.dtype == np.float32 and o.params.dtype == BF16 for o in opts)
    got16 = layout.views(np.concatenate([to_host(o.params) for o in opts]))
    gotm = assemble(o.export_pieces() for o in opts)["params"]
    for name in want16:
        np.testing.assert_array_equal(got16[name], want16[name], err_msg=name)
        np.testing.assert_array_equal(to_host(gotm[name]), full.masters[name].data, err_msg=name)


def test_state_dict_round_trip_snapshot_restore_and_misfits_refused(device):
    xp = xp_for(device)
    pieces = Pieces("adam", 3, xp)
    pieces.step(grads(0))
    o = pieces.opts[1]
    sd = o.state_dict()
    saved = {"step": sd["step"], "state": {n: {k: v.copy() for k, v in st.items()} for n, st in sd["state"].items()}}
    assert set(saved["state"]) == {r.name for r in o.ranges} and saved["step"] == 1
    assert all(v.size == r.size for r in o.ranges for v in saved["state"][r.name].values())
    # An all-or-nothing load: snapshot, load other state, restore: as before.
    snap = o.snapshot()
    o.load_state_dict({"step": 7, "state": {n: {k: v * 0 for k, v in st.items()} for n, st in saved["state"].items()}})
    assert o.state_dict()["step"] == 7 and all(not to_host(v).any() for v in o.flat_state.values())
    o.restore(snap)
    pieces.step(grads(1))  # every piece on from the restored state: the full optimizer's two steps
    _, want = run_full("adam", 2)
    got = pieces.params()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    o.load_state_dict(saved)  # round trip: the state after the first step, copied in
    now = o.state_dict()
    assert now["step"] == 1
    for n, st in saved["state"].items():
        for k, v in st.items():
            np.testing.assert_array_equal(to_host(now["state"][n][k]), to_host(v))
    with pytest.raises(ValueError, match="does not fit this rank's pieces"):
        o.load_state_dict({"step": 1, "state": {"no.such": {"exp_avg": np.zeros(1)}}})
    first = o.ranges[0]
    with pytest.raises(ValueError, match="expected"):
        o.load_state_dict({"step": 1, "state": {first.name: {"exp_avg": np.zeros(first.size + 1)}}})


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_assembled_pieces_load_under_another_number_of_pieces(opt, device):
    """What rebuilding after a lost rank does: every piece's export (a buddy's copy for a lost
    one) assembles into full tensors; those load into 3 pieces, which train on exactly as the
    full optimizer does."""
    xp = xp_for(device)
    four = Pieces(opt, 4, xp)
    for s in range(2):
        four.step(grads(s))
    whole = assemble(reversed([o.export_pieces() for o in four.opts]))  # any order
    three = Pieces(opt, 3, xp)
    for o in three.opts:
        o.load_full(whole["state"], params=whole["params"], step=whole["step"])
    three.step(grads(2))
    _, want = run_full(opt, 3)
    got = three.params()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    with pytest.raises(ValueError, match="one piece per rank"):
        assemble([o.export_pieces() for o in four.opts[:3]])


def test_full_state_through_a_gather():
    """``full_state`` / ``full_params`` build full tensors from what the caller's gather returns
    (one piece: the piece itself)."""
    pieces = Pieces("adam", 1, np)
    pieces.step(grads(0))
    o = pieces.opts[0]
    full, params = run_full("adam", 1)
    state = o.full_state(lambda a: a, ["exp_avg", "exp_avg_sq"])
    for name, st in full.state.items():
        for key, want in st.items():
            np.testing.assert_array_equal(state[name][key], want)
    for name, want in params.items():
        np.testing.assert_array_equal(o.full_params(lambda a: a)[name], want)


def test_layout_ranges_cover_every_element_once():
    for parts in (1, 2, 5, 40):
        layout = FlatLayout(SHAPES, parts)
        seen = {n: np.zeros(int(np.prod(s)), dtype=int) for n, s in SHAPES}
        for r in range(parts):
            lo, hi = layout.piece(r)
            at = 0
            for rng in layout.ranges(r):
                assert rng.offset == at  # ranges tile the piece in flat order
                seen[rng.name][rng.part] += 1
                at += rng.size
            assert at == hi - lo == layout.counts[r]
        assert all((v == 1).all() for v in seen.values())
    with pytest.raises(ValueError, match="distinct names"):
        FlatLayout([("a", (2,)), ("a", (3,))], 2)


class Rescaled(ht.optim.SGD):
    """An update that is not elementwise (it rescales by the whole array's norm)."""

    def update(self, p, state, lr, step, scratch=None):
        p.data -= lr * p.grad / max(float(np.linalg.norm(p.grad)), 1.0)


def test_only_elementwise_optimizers_are_sharded():
    layout = FlatLayout(SHAPES, 2)
    with pytest.raises(ValueError, match="elementwise"):
        ShardedOptimizer(Rescaled(model_params(), lr=0.1), layout, 0, np.zeros(layout.counts[0]))

    class Declared(Rescaled):
        elementwise = True  # declares its own rule elementwise (here falsely: the user's word)

    ShardedOptimizer(Declared(model_params(), lr=0.1), layout, 0, np.zeros(layout.counts[0]))


def test_zero_trainer_refuses_a_non_elementwise_optimizer_and_leaves_the_model():
    from mpi4py import MPI

    from hpctrain.nn import Linear, MSELoss, Sequential
    from hpctrain.parallel import ParallelTrainer

    model = Sequential(Linear(3, 4, rng=0, dtype=np.float64), Linear(4, 2, rng=1, dtype=np.float64))
    before = {n: p.data.copy() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="elementwise"):
        ParallelTrainer(model=model, loss=MSELoss(), optimizer=Rescaled(model.parameters(), lr=0.1),
                        grid=ht.ProcessGrid(ht.Communicator(MPI.COMM_SELF)), zero=3)  # fmt: skip
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.data, before[n], err_msg=n)
