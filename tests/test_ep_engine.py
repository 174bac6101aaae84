"""ParallelTrainer with an MoE GPT whose experts spread over ``grid.ep``: equal to one process.

The gradient rule is derived here, not trusted: each rank's loss is its share of the global
batch's mean; an expert's gradient on the rank that holds it already sums the tokens of its whole
ep group, so it sums over the expert replicas only (``grid.edp``), dense ones over dp. The
load-balancing term counts each expert's share of the router's choices and its mean probability
over the whole batch (every dp x cp replica's tokens: one all-reduce per layer and forward), so one
process computes the same thing on the same micro-batches, whatever the layout. Float64,
dropless, to 1e-9.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import ProcessGrid
from hpctrain.nn import GPT, CrossEntropyLoss
from hpctrain.nn.moe import moe_layers, set_aux_weight
from hpctrain.optim import AdamW, clip_grad_norm
from hpctrain.parallel import ParallelTrainer, parallelize

VOCAB, T, PER, STEPS, EXPERTS, AUX = 11, 8, 3, 3, 4, 0.01  # AUX: the job's default weight


def make(dtype=np.float64) -> GPT:
    gpt = GPT(VOCAB, T, d_model=8, n_heads=2, n_layers=2, rng=np.random.default_rng(0), dtype=dtype,
              moe_experts=EXPERTS, moe_top_k=2)
    set_aux_weight(gpt, AUX)
    return gpt


def data(dp: int, step: int, per: int = PER):
    g = np.random.default_rng(100 + step)
    return g.integers(0, VOCAB, (per * dp, T)), g.integers(0, VOCAB, (per * dp, T))


def serial(dp: int, m: int = 1, per: int = PER, clip: float | None = None, aux_weight: float = AUX):
    """One process: each step ``m`` micro-batches (the ``j``-th ``per / m`` rows of every one of
    the ``dp`` replicas together: the tokens the term of one forward spans), the loss's gradient
    and the load-balancing term's weight scaled by its share."""
    model, loss = make(), CrossEntropyLoss()
    opt = AdamW(model.parameters(), lr=1e-2)
    parts, rows = m, per // m
    losses, aux = [], []
    for s in range(STEPS):
        x, y = data(dp, s, per)
        opt.zero_grad()
        set_aux_weight(model, aux_weight / parts)
        step_loss = step_aux = 0.0
        for j in range(m):
            idx = np.concatenate([np.arange(rows) + r * per + j * rows for r in range(dp)])
            step_loss += loss.forward(model.forward(x[idx]), y[idx]) / parts
            step_aux += sum(m_.aux_loss for m_ in moe_layers(model)) / parts
            model.backward(loss.backward(1.0 / parts))
        if clip:
            clip_grad_norm(model.parameters(), clip)
        opt.step()
        losses.append(step_loss)
        aux.append(step_aux)
    return model, losses, aux


def check(comm, ep: int, pp: int = 1, zero: int = 0, m: int = 1, per: int = PER, clip: float | None = None,
          tp: int = 1, cp: int = 1, aux_weight: float = AUX):
    if comm.size % (ep * pp * tp * cp) or (comm.size // (pp * tp * cp)) % ep:
        pytest.skip(f"ep={ep} x pp={pp} x tp={tp} x cp={cp} does not fit a world of {comm.size}")
    grid = ProcessGrid(comm, pp=pp, ep=ep, tp=tp, cp=cp)
    dp, d = grid.dp_size, grid.dp.rank
    gpt = make()
    set_aux_weight(gpt, aux_weight)
    part = parallelize(gpt, grid)
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-2), grid=grid,
                         zero=zero, microbatches=m, clip_norm=clip)
    stats = []
    for s in range(STEPS):
        x, y = data(dp, s, per)
        stats.append(tr.step(x[d * per : (d + 1) * per], y[d * per : (d + 1) * per]))
    ref, losses, aux = serial(dp, m, per, clip, aux_weight)
    np.testing.assert_allclose([st.loss for st in stats], losses, rtol=1e-10)
    full = dict(ref.named_parameters())
    shards = tr.shards()
    for name, (p, shape, index) in shards.items():
        assert tuple(shape) == full[name].shape, name
        np.testing.assert_allclose(p.data, full[name].data[index], rtol=1e-9, atol=1e-10, err_msg=name)
    assert set().union(*comm.allgather_obj(sorted(shards))) == set(full)
    tr.close()
    return tr, stats, aux


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_moe_gpt_over_ep_matches_one_process(comm, ep, zero):
    tr, stats, aux = check(comm, ep, zero=zero)
    spread = [n for n, (p, full, _) in tr.shards().items() if tuple(full) != p.shape]
    assert bool(spread) == (ep > 1)  # the experts are sliced exactly when ep > 1
    assert all(n.split(".")[-1] in ("w1", "b1", "w2", "b2") for n in spread)
    # The logged term is the batch's (one process's micro-batches, each by its share).
    np.testing.assert_allclose([st.extra["moe_aux_loss"] for st in stats], aux, rtol=1e-10)
    assert all(1.0 <= st.extra["moe_max_share"] <= EXPERTS for st in stats)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_moe_gpt_ep_with_a_pipeline_matches_one_process(comm, m):
    # pp=2 with ep=2 out of dp = world / 2, over m micro-batches: the logged load-balancing term is
    # the mean of the micro-batches' (each by its share, the loss's rule), not the last one's.
    _, stats, aux = check(comm, ep=2, pp=2, m=m, per=4)
    np.testing.assert_allclose([st.extra["moe_aux_loss"] for st in stats], aux, rtol=1e-10)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 1])
def test_moe_gpt_ep_with_tp_matches_one_process(comm, zero):
    # tp=2 with ep=2 out of dp = world / 2: the experts whole on both tp ranks, spread over ep.
    tr, stats, aux = check(comm, ep=2, tp=2, zero=zero, clip=0.05)
    np.testing.assert_allclose([st.extra["moe_aux_loss"] for st in stats], aux, rtol=1e-10)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 2])
def test_moe_gpt_ep_with_cp_matches_one_process(comm, zero):
    # cp=2 with ep=2 out of dp = world / 2: each rank routes its share of every sequence's tokens;
    # the load-balancing term spans every dp x cp replica's: one process's, logged as such.
    _, stats, aux = check(comm, ep=2, cp=2, zero=zero)
    np.testing.assert_allclose([st.extra["moe_aux_loss"] for st in stats], aux, rtol=1e-10)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_moe_gpt_over_ep_with_accumulation_matches_one_process(comm):
    check(comm, ep=2, m=2, per=4)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 2])
def test_clipping_counts_each_expert_slice_once(comm, zero):
    # A norm small enough to clip every step: the global norm must count every expert slice once.
    tr, stats, _ = check(comm, ep=2, zero=zero, clip=0.05)
    assert all(st.grad_norm > 0.05 for st in stats)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_collapsed_router_shows_in_the_max_share(comm):
    # A router whose first choice is expert 0 or 1 (the sign of one feature) and whose second is
    # always expert 2 (experts 2 and 3 tie; the stable top-k takes the first): expert 2 gets every
    # token, 3 none, so the busiest expert has all N of 2N assignments over E experts: E/2 the mean.
    grid = ProcessGrid(comm, ep=2 if comm.size % 2 == 0 else 1)
    part = parallelize(make(), grid)
    for m in moe_layers(part):
        m.router.weight.data[...] = 0.0
        m.router.weight.data[0, :2] = (100.0, -100.0)
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-2), grid=grid)
    x, y = data(grid.dp_size, 0)
    d = grid.dp.rank
    st = tr.step(x[d * PER : (d + 1) * PER], y[d * PER : (d + 1) * PER])
    assert st.extra["moe_max_share"] == pytest.approx(EXPERTS / 2)
    tr.close()


def _train(comm, ep: int, **kw):
    """Losses of STEPS steps of the MoE GPT over ``ep`` (float32; ``recompute`` for parallelize,
    the rest for the trainer), and the trainer after its replicas were checked."""
    grid = ProcessGrid(comm, ep=ep)
    part = parallelize(make(np.float32), grid, recompute=kw.pop("recompute", False))
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-2), grid=grid,
                         **kw)
    d, losses = grid.dp.rank, []
    for s in range(STEPS):
        x, y = data(grid.dp_size, s)
        losses.append(tr.step(x[d * PER : (d + 1) * PER], y[d * PER : (d + 1) * PER]).loss)
    tr.check_replicas()  # dense parameters equal over dp, each expert slice over its replicas
    tr.close()
    return losses


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_recompute_and_mixed_precision_over_ep(comm):
    ep = 2 if comm.size % 2 == 0 else 1
    plain = _train(comm, ep)
    assert _train(comm, ep, recompute=True) == plain  # recomputation changes nothing, bitwise
    mixed = _train(comm, ep, precision="bf16-mixed")
    np.testing.assert_allclose(mixed, plain, rtol=5e-2)  # bf16's rounding, not another model
    assert mixed != plain


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_lost_rank_under_ep_is_refused_in_the_command_lines_words(comm):
    # RankLoss's check of the trainer: ValueError on every rank, the words the command line says
    # with its flags' names.
    from hpctrain.errors import ConfigError
    from hpctrain.job import resolve
    from hpctrain.resilience import check_shrinkable

    def as_flags(text: str) -> str:
        for name in ("on_rank_loss", "ep"):
            text = text.replace(f"{name}=", "--" + name.replace("_", "-") + " ")
        return text.replace("'", "")

    if comm.size % 2:
        pytest.skip("ep=2 needs an even world")
    grid = ProcessGrid(comm, ep=2)
    part = parallelize(make(), grid)
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-2), grid=grid)
    with pytest.raises(ValueError) as lib:
        check_shrinkable(tr)
    tr.close()
    with pytest.raises(ConfigError) as cli:
        resolve({"model": "gpt", "moe_experts": EXPERTS, "ep": 2, "on_rank_loss": "shrink"}, comm.size)
    assert as_flags(str(lib.value)) == str(cli.value)
    assert "experts spread over --ep 2" in str(cli.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_part_spread_over_another_ep_than_the_grids_is_refused(comm):
    from hpctrain.errors import GridError

    if comm.size % 2:
        pytest.skip("ep=2 needs an even world")
    part = parallelize(make(), ProcessGrid(comm, ep=2))
    with pytest.raises(GridError, match=r"the model's experts are spread over ep=2 ranks but the grid has ep=1"):
        ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-2),
                        grid=ProcessGrid(comm))


def _workspace(comm, ep: int, steps: int) -> list[int]:
    """The trainer's ``workspace`` (the layers' reuse pools, ``training.memory``) after each step."""
    grid = ProcessGrid(comm, ep=ep)
    part = parallelize(make(np.float32), grid)
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-2), grid=grid)
    d, seen = grid.dp.rank, []
    for s in range(steps):
        x, y = data(grid.dp_size, s)
        tr.step(x[d * PER : (d + 1) * PER], y[d * PER : (d + 1) * PER])
        seen.append(tr.memory_report()["workspace"])
    tr.close()
    return seen


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_the_workspace_under_ep_stops_growing(comm):
    # Under ep the rows an expert receives change every step; the MoE's pool (nn.buffers) kept one
    # array per row count it ever saw (up to 32 shapes per tag: ~13x ep=1's workspace here). It
    # keeps them by capacity now, at most twice the largest count: within twice ep=1's throughout.
    if comm.size % 2:
        pytest.skip("ep=2 needs an even world")
    steps = 40
    one, two = _workspace(comm, 1, steps), _workspace(comm, 2, steps)
    assert one[-1] == one[steps // 4]  # ep=1: the same rows every step, nothing new after the first steps
    assert max(two) <= 2 * max(one), (one, two)
