"""parallelize + ParallelTrainer: dp x tp x pp equals one process (float64), names stay serial.

Layouts derive from the world size: tp=2 x pp=2 with dp = world / 4 (4 ranks: tp x pp; 8 ranks:
dp=2 x tp=2 x pp=2), with the 1F1B, GPipe and interleaved (2 virtual stages) schedules; and the
GPT pipelined as it is (pp=2, no renamed Sequential).
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import ProcessGrid
from hpctrain.nn import GPT, MLP, CrossEntropyLoss, Linear, Sequential
from hpctrain.optim import AdamW
from hpctrain.parallel import ParallelTrainer, parallelize, pipeline_stage

VOCAB, T, PER_REPLICA, STEPS = 11, 5, 4, 3


def make(kind: str):
    g = np.random.default_rng(0)
    if kind == "mlp":
        return Sequential(Linear(6, 8, rng=g, dtype=np.float64), MLP(8, 16, rng=g, dtype=np.float64),
                          MLP(8, 16, rng=g, dtype=np.float64), Linear(8, 3, rng=g, dtype=np.float64))  # fmt: skip
    return GPT(VOCAB, T, d_model=8, n_heads=2, n_layers=3, rng=g, dtype=np.float64)


def data(kind: str, dp: int, seed: int, per: int = PER_REPLICA):
    g = np.random.default_rng(100 + seed)
    n = per * dp
    if kind == "mlp":
        return g.normal(size=(n, 6)), g.integers(0, 3, n)
    return g.integers(0, VOCAB, (n, T)), g.integers(0, VOCAB, (n, T))


def serial(kind: str, dp: int, clip=None, per: int = PER_REPLICA):
    model, loss = make(kind), CrossEntropyLoss()
    opt = AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(STEPS):
        x, y = data(kind, dp, s, per)
        opt.zero_grad()
        losses.append(loss.forward(model.forward(x), y))
        model.backward(loss.backward())
        if clip:
            from hpctrain.optim import clip_grad_norm

            clip_grad_norm(model.parameters(), clip)
        opt.step()
    return model, losses


def check(comm, kind, tp, pp, schedule="1f1b", v=1, m=2, clip=None, per=PER_REPLICA):
    if comm.size % (tp * pp):
        pytest.skip(f"tp={tp} x pp={pp} does not divide a world of {comm.size}")
    grid = ProcessGrid(comm, tp=tp, pp=pp)
    dp, d = grid.dp_size, grid.dp.rank
    part = parallelize(make(kind), grid, virtual_stages=v)
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-2),
                         grid=grid, microbatches=m, schedule=schedule, virtual_stages=v, clip_norm=clip)
    stats = []
    for s in range(STEPS):
        x, y = data(kind, dp, s, per)
        sl = slice(d * per, (d + 1) * per)
        stats.append(tr.step(x[sl], y[sl]))
    ref, losses = serial(kind, dp, clip, per)
    np.testing.assert_allclose([st.loss for st in stats], losses, rtol=1e-11)
    full = dict(ref.named_parameters())
    for name, (p, shape, index) in tr.shards().items():
        assert tuple(shape) == full[name].shape, name
        np.testing.assert_allclose(p.data, full[name].data[index], rtol=1e-9, atol=1e-12, err_msg=name)
    # One set of names under every layout: together the ranks hold exactly the serial parameters.
    names = set().union(*comm.allgather_obj(sorted(tr.shards())))
    assert names == set(full)
    return tr


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_tp_x_pp_matches_serial(comm, kind, schedule):
    v = 2 if schedule == "interleaved" else 1
    tr = check(comm, kind, tp=2, pp=2, schedule=schedule, v=v, clip=0.5 if kind == "gpt" else None)
    assert tr.layout == {"dp": comm.size // 4, "tp": 2, "pp": 2}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_gpt_pipelined_as_it_is(comm, schedule):
    """pp=2 (dp = world / 2) on the GPT itself: the names are the GPT's own (tok_emb.weight...)."""
    tr = check(comm, "gpt", tp=1, pp=2, schedule=schedule, v=2 if schedule == "interleaved" else 1)
    if tr.grid.pp.rank == 0:
        assert "tok_emb.weight" in tr.shards() and "emb.tok_emb.weight" not in tr.shards()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_interleaved_short_batch_takes_whole_groups_of_stages(comm):
    """3 samples per replica, microbatches=4, pp=2: the interleaved schedule runs micro-batches in
    groups of the stages, so those steps take 2 and still equal one process; 1 sample cannot be
    cut so and is refused on every rank, saying why."""
    tr = check(comm, "mlp", tp=1, pp=2, schedule="interleaved", v=2, m=4, per=3)
    d = tr.grid.dp.rank
    x, y = data("mlp", tr.grid.dp_size, 0, per=3)
    assert tr.step(x[3 * d : 3 * d + 3], y[3 * d : 3 * d + 3]).extra["microbatches"] == 2
    with pytest.raises(ValueError, match=r"a batch of 1 samples cannot be cut into micro-batches \(the interleaved"):
        tr.step(x[d : d + 1], y[d : d + 1])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_tp_only_and_dp_only_through_parallelize(comm):
    check(comm, "gpt", tp=2 if comm.size % 2 == 0 else 1, pp=1)
    check(comm, "mlp", tp=1, pp=1, m=2)


def test_pipeline_stage_cuts_a_gpt_with_its_own_names():
    class One:
        rank, size = 1, 2

    stage = pipeline_stage(make("gpt"), One())
    names = [n for n, _ in stage.named_parameters()]
    assert names[-1] == "head.weight" and all(not n.startswith(("emb.", "tok_emb")) for n in names)
    assert stage.pipeline["layers"][0] == "embed"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_bad_pipeline_settings_refused_on_every_rank(comm):
    from hpctrain.errors import ConfigError, GridError

    if comm.size % 2:
        pytest.skip(f"pp=2 needs an even world, have {comm.size}")
    grid = ProcessGrid(comm, pp=2)
    part = parallelize(make("gpt"), grid, virtual_stages=2)

    def trainer(**kw):
        return ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters()), grid=grid,
                               **kw)  # fmt: skip

    with pytest.raises(ConfigError, match="multiple of the pipeline stages"):
        trainer(microbatches=3, schedule="interleaved")
    with pytest.raises(GridError, match="virtual_stages=3 but the model part holds 2"):
        trainer(microbatches=2, schedule="interleaved", virtual_stages=3)
    with pytest.raises(ConfigError, match="needs schedule='interleaved'"):
        trainer(microbatches=2, schedule="1f1b")  # two chunks need the interleaved schedule
    with pytest.raises(ValueError, match="virtual_stages needs a pipeline"):
        parallelize(make("gpt"), ProcessGrid(comm), virtual_stages=2)
    with pytest.raises(GridError, match="no .pipeline attribute"):
        ParallelTrainer(model=make("mlp"), loss=CrossEntropyLoss(), optimizer=AdamW(make("mlp").parameters()),
                        grid=grid)  # fmt: skip


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_timeout_zero_is_off_for_pipeline_waits_too(comm, monkeypatch):
    from hpctrain.errors import ConfigError

    if comm.size % 2:
        pytest.skip(f"pp=2 needs an even world, have {comm.size}")
    grid = ProcessGrid(comm, pp=2)
    monkeypatch.setenv("HPCTRAIN_TIMEOUT", "0")
    for timeout in (None, 0):  # the environment's 0, then the argument's
        part = parallelize(make("mlp"), grid)
        tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters()), grid=grid,
                             microbatches=2, timeout=timeout)  # fmt: skip
        assert tr.timeout == 0 and tr.strategy.runner.timeout == 0  # waits block, nothing "expires now"
        x, y = data("mlp", grid.dp_size, 0)
        sl = slice(grid.dp.rank * PER_REPLICA, (grid.dp.rank + 1) * PER_REPLICA)
        assert np.isfinite(tr.step(x[sl], y[sl]).loss)
    with pytest.raises(ConfigError, match="timeout"):
        ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters()), grid=grid,
                        microbatches=2, timeout=-1)  # fmt: skip
