"""The planner's model (``hpctrain.parallel.plan``) against hand-computed volumes, times and
memory: no MPI, the costs built by hand (or measured on a small serial model) and links given."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from hpctrain import nn
from hpctrain.comm.linkprobe import Link
from hpctrain.parallel.plan import TIE, Costs, Layout, PieceCost, Prediction, layouts, measure, plan, predict

GIB = 1 << 30
BETA = 1e9  # bytes per second of the test links


def piece(name: str, params: int, *, fwd: float = 0.0, bwd: float = 0.0, act: int = 0, split: int = 0,
          tpf: tuple = (), tpb: tuple = (), io: int = 0, units: int = 1, recomputable: bool = False) -> PieceCost:
    """A piece whose forward/backward take ``fwd``/``bwd`` seconds per sample."""
    return PieceCost(name, 0.0, fwd, 0.0, bwd, params, split, 0, act, io, io, params > 0, recomputable,
                     tpf, tpb, 0, 0, units, params // max(1, units))


def costs(pieces: list[PieceCost], batch: int = 16, opt_bytes: float = 8.0, opt_s: float = 0.0) -> Costs:
    return Costs(pieces, batch, 4, opt_bytes, opt_s)


def links(alpha: float = 0.0, beta: float = BETA, meet: float = 0.0) -> dict[str, Link]:
    return {"intra-node": Link((0, 1), alpha, beta, (), meet),
            "inter-node": Link((0, 2), 10 * alpha, beta / 10, (), meet)}


def small(world: int, link: Link) -> float:
    """The trainer's two all-reduces of 64 bytes over the world per step."""
    return 2 * link.allreduce_seconds(64, world) + 2 * link.meet if world > 1 else 0.0


def test_dp_allreduce_moves_each_ranks_gradient_bytes():
    p = 100_000
    c = costs([piece("0", p), piece("1", p)])
    ln = links()
    for dp in (2, 4):
        pred = predict(Layout(dp, 1, 1), c, ln, None, overlap=False)
        n = 2 * p * 4  # this rank's gradient bytes: every parameter, float32
        want = 2 * (dp - 1) / dp * n / BETA + small(dp, ln["intra-node"])
        assert pred.predicted_ms == pytest.approx(want * 1e3, rel=1e-9)
        assert pred.comm_parts["dp"] == pytest.approx(want * 1e3, rel=1e-9) and pred.compute_ms == 0


def test_compression_sends_the_plain_all_reduce_in_16_bits():
    p = 100_000
    c = costs([piece("0", p), piece("1", p)])
    ln = links()
    for dp in (2, 4):
        pred = predict(Layout(dp, 1, 1), c, ln, None, overlap=False, compression="fp16")
        want = 2 * (dp - 1) / dp * 2 * p * 2 / BETA + small(dp, ln["intra-node"])  # 2 bytes a gradient
        assert pred.comm_parts["dp"] == pytest.approx(want * 1e3, rel=1e-9)
        zero = dict(overlap=False)  # ZeRO is its own reducer: the same traffic with or without
        assert predict(Layout(dp, 1, 1, zero=1), c, ln, None, compression="bf16", **zero).comm_parts == \
            predict(Layout(dp, 1, 1, zero=1), c, ln, None, **zero).comm_parts


def test_buckets_count_one_latency_each_and_overlap_hides_what_backward_covers():
    p = 5_000_000  # 20 MB per piece: two pieces overflow one 25 MiB bucket, so two buckets
    c = costs([piece("0", p, bwd=1e-3), piece("1", p, bwd=1e-3)], batch=4)
    ln = links(alpha=1e-3)
    lay = Layout(2, 1, 1)
    one = ln["intra-node"].allreduce_seconds(20e6, 2)  # each bucket pays its own latency
    off = predict(lay, c, ln, None, overlap=False)
    assert off.comm_parts["dp"] == pytest.approx((2 * one + small(2, ln["intra-node"])) * 1e3, rel=1e-9)
    on = predict(lay, c, ln, None, overlap=True)
    backward = 2 * 2 * 1e-3  # two pieces, 2 samples each
    # the last piece's bucket starts halfway through backward; the second waits for the first
    exposed = backward / 2 + 2 * one - backward
    assert on.comm_parts["dp"] == pytest.approx((exposed + small(2, ln["intra-node"])) * 1e3, rel=1e-9)
    one_bucket = predict(lay, c, ln, None, overlap=False, bucket_mb=100)
    assert one_bucket.comm_parts["dp"] == pytest.approx(
        (ln["intra-node"].allreduce_seconds(40e6, 2) + small(2, ln["intra-node"])) * 1e3, rel=1e-9)


def test_tp_collectives_of_a_gpt_are_four_per_block_at_the_activation_size():
    t, d, layers, batch = 8, 32, 2, 4
    gpt = nn.GPT(17, t, d, 4, layers, rng=0)
    c = measure(gpt, (batch, t), sample=lambda n: np.random.default_rng(0).integers(0, 17, (n, t)), repeats=1)
    blocks = [p for p in c.pieces if p.name.startswith("blocks.")]
    assert len(blocks) == layers
    act = t * d * 4  # bytes per sample of a (T, d_model) float32 activation
    for b in blocks:  # attention + MLP: one all-reduce of the output forward, one of the input's grad backward
        assert b.tp_forward == (act, act) and b.tp_backward == (act, act)
        assert 0 < b.split_params < b.params  # LayerNorms stay replicated
    embed, head = c.pieces[0], c.pieces[-1]
    assert embed.tp_forward == (act,) and embed.tp_backward == ()  # vocabulary embedding: ReduceFromTP
    assert head.tp_forward == () and head.tp_backward == (act,)  # vocabulary head: CopyToTP
    assert c.loss_tp == (t * 4,) * 3  # the vocab-parallel loss: max, sum of exp, target logit per row
    # Priced on the tp link: every call an all-reduce of bytes-per-sample x the rank's samples.
    zero = Costs([dataclass_zero(p) for p in c.pieces], c.batch, 4, 0.0, 0.0, loss_tp=c.loss_tp)
    ln = links()
    for tp in (2, 4):
        pred = predict(Layout(4 // tp, tp, 1), zero, ln, None)
        samples = batch / (4 // tp)
        calls = [n for p in zero.pieces for n in (*p.tp_forward, *p.tp_backward)] + list(zero.loss_tp)
        want = sum(ln["intra-node"].allreduce_seconds(n * samples, tp) for n in calls)
        assert pred.comm_parts["tp"] == pytest.approx(want * 1e3, rel=1e-9)
        assert len(calls) == 4 * layers + 2 + 3


def dataclass_zero(p: PieceCost) -> PieceCost:
    """``p`` with free compute (the test prices communication alone)."""
    from dataclasses import replace

    return replace(p, forward_fixed=0.0, forward_per_sample=0.0, backward_fixed=0.0, backward_per_sample=0.0)


def test_tp_shares_the_split_layers_work_and_parameters():
    p = piece("0", 1000, fwd=1.0, bwd=2.0, split=800)
    assert p.local_params(4) == 200 + 200
    assert p.forward_s(1.0, 4) == pytest.approx(0.2 + 0.8 / 4)
    assert p.backward_s(3.0, 2) == pytest.approx(2.0 * 3 * (0.2 + 0.4))


def test_zero_traffic_a_reduce_scatter_and_an_all_gather_zero_3_gathers_in_forward_and_backward():
    p, dp = 1_000_000, 4
    c = costs([piece("0", p, units=1), piece("1", p, units=1)])
    ln = links()
    link = ln["intra-node"]
    n = 2 * p * 4
    base = small(dp, link)
    zero0 = predict(Layout(dp, 1, 1), c, ln, None, overlap=False).comm_parts["dp"] * 1e-3 - base
    zero1 = predict(Layout(dp, 1, 1, zero=1), c, ln, None, overlap=False).comm_parts["dp"] * 1e-3 - base
    # ZeRO 1/2 move what one all-reduce moves: (p-1)/p of the bytes twice
    assert zero0 == pytest.approx(2 * (dp - 1) / dp * n / BETA, rel=1e-9)
    assert zero1 == pytest.approx(zero0, rel=1e-9)
    zero3 = predict(Layout(dp, 1, 1, zero=3), c, ln, None, overlap=False).comm_parts["dp"] * 1e-3 - base
    # ZeRO 3: the reduce-scatter, no final all-gather, each unit gathered before forward and backward
    # (with free compute nothing hides them; the first unit's gather is never prefetched)
    gathered = link.gather_seconds(n / 2, dp)
    assert zero3 == pytest.approx((dp - 1) / dp * n / BETA + 2 * (2 * gathered + gathered), rel=1e-9)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 8)])
def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, m):
    c = costs([piece(str(i), 10, fwd=1e-3, bwd=2e-3) for i in range(2 * pp)], batch=8 * m)
    pred = predict(Layout(1, 1, pp, microbatches=m), c, links(beta=math.inf), None)
    assert pred.bubble_ms / pred.predicted_ms == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-9)
    assert pred.comm_ms == 0


def test_pipeline_messages_lengthen_the_critical_path():
    c = costs([piece(str(i), 10, fwd=1e-3, bwd=2e-3, io=4000) for i in range(4)], batch=8)
    free = predict(Layout(1, 1, 2, microbatches=2), c, links(beta=math.inf), None)
    paid = predict(Layout(1, 1, 2, microbatches=2), c, links(beta=4e6), None)
    per = 4000 * 4 / 4e6  # one micro-batch of 4 samples x 4000 bytes
    assert paid.comm_parts["pp"] == pytest.approx(2 * per * 1e3, rel=1e-9)  # stage 0 sends two, receives two grads
    assert paid.predicted_ms > free.predicted_ms


def model_states(p: int, dp: int, zero: int) -> int:
    """The hand count (float32 AdamW): params 4, grads 4, optimizer 8 bytes per parameter, by ZeRO stage."""
    shard = 4 * p // dp
    params, grads = (shard if zero == 3 else 4 * p), (shard if zero >= 2 else 4 * p)
    opt = 8 * p // (dp if zero else 1)
    return params + grads + opt


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_memory_per_zero_level_is_the_hand_count(zero, dp):
    p, unit = 4_000_000, 250_000
    c = costs([piece("0", 2_000_000, units=8, act=1000), piece("1", 2_000_000, units=8, act=3000)], batch=16)
    pred = predict(Layout(dp, 1, 1, zero=zero), c, links(), None)
    # zero 1: the reduced piece. Zero 2: three reductions of a unit's gradient in flight (over 4
    # ranks each with its first round's regrouped copy and half-size receive buffer: 2.5 units),
    # and the next unit's gradient; zero 3: and two gathered units.
    window = (3 * (2.5 if dp == 4 else 1) + 1) * 4 * unit
    buffers = {0: 0, 1: 4 * p // dp, 2: window, 3: window + 2 * 4 * unit}[zero]
    activations = (1000 + 3000) * 16 // dp
    assert pred.memory_parts == {"params": pred.memory_parts["params"], "grads": pred.memory_parts["grads"],
                                 "optimizer": pred.memory_parts["optimizer"], "buffers": buffers,
                                 "activations_peak": activations, "workspace": 0}
    assert pred.memory_bytes == model_states(p, dp, zero) + buffers + activations


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_mixed_precision_prices_16_bit_parameters_float32_gradients_and_masters(zero):
    """bf16-mixed AdamW, by hand: parameters 2 bytes, gradients (and their reduction, ZeRO 1's
    reduced piece, ZeRO 2/3's unit gradients) 4, optimizer 12 (two moments and the master); ZeRO
    3's gathered units and ZeRO 1/2's all-gather after the step move the 2-byte parameters."""
    p, unit, dp = 4_000_000, 250_000, 2
    pieces = [piece("0", 2_000_000, units=8), piece("1", 2_000_000, units=8)]
    mixed = dataclasses.replace(costs(pieces, opt_bytes=12.0), itemsize=2, grad_itemsize=4)
    assert mixed.grad_bytes == 4 and Costs.from_dict(mixed.as_dict()) == mixed
    pred = predict(Layout(dp, 1, 1, zero=zero), mixed, links(), None, overlap=False)
    window = (3 + 1) * 4 * unit  # three reductions of a 4-byte unit gradient in flight, the next one
    assert pred.memory_parts["params"] == (2 * p // dp if zero == 3 else 2 * p)
    assert pred.memory_parts["grads"] == (4 * p // dp if zero >= 2 else 4 * p)
    assert pred.memory_parts["optimizer"] == 12 * p // (dp if zero else 1)
    assert pred.memory_parts["buffers"] == {0: 0, 1: 4 * p // dp, 2: window, 3: window + 2 * 2 * unit}[zero]
    if zero == 0:  # the gradient all-reduce: float32 bytes
        ln = links()
        assert pred.comm_parts["dp"] == pytest.approx(
            (2 * (dp - 1) / dp * 4 * p / BETA + small(dp, ln["intra-node"])) * 1e3, rel=1e-9)
    if zero == 1:  # the reduce-scatter of float32 units, the all-gather of 2-byte parameters
        unmixed = predict(Layout(dp, 1, 1, zero=1), costs(pieces), links(), None, overlap=False)
        gather = (dp - 1) / dp * 2 * p / BETA  # half of the float32 run's all-gather
        assert pred.comm_parts["dp"] == pytest.approx(unmixed.comm_parts["dp"] - gather * 1e3, rel=1e-9)


def test_measure_in_the_jobs_precision_leaves_the_model_as_it_was():
    """``measure(precision=)`` casts a copy as the trainer casts the model: the pieces run in
    16-bit, the gradients are float32, the masters count with AdamW's state."""
    g = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(16, 32, rng=g), nn.GELU(), nn.Linear(32, 4, rng=g))
    grads = [p.grad for p in model.parameters()]
    plain = measure(model, (32, 16), repeats=1)
    mixed = measure(model, (32, 16), repeats=1, precision="bf16-mixed")
    assert (plain.itemsize, plain.grad_bytes, plain.optimizer_bytes_per_param) == (4, 4, 8.0)
    assert (mixed.itemsize, mixed.grad_bytes, mixed.optimizer_bytes_per_param) == (2, 4, 12.0)
    assert (measure(model, (32, 16), repeats=1, precision="fp64").itemsize) == 8
    assert all(p.data.dtype == np.float32 and p.grad is q for p, q in zip(model.parameters(), grads))
    assert Costs.from_dict(mixed.as_dict()) == mixed


def test_a_given_cut_prices_the_stages_where_it_says():
    """``--pp-cut``: the stages begin where the cut says (three pieces on stage 0 here, against two
    when balanced), the plan lists only its stage count, and a cut the engine refuses is refused."""
    p = 100_000
    c = costs([piece(str(i), p, fwd=1e-3, act=100) for i in range(4)] + [piece("4", 0)])
    balanced = predict(Layout(1, 1, 2), c, links(), None)
    given = predict(Layout(1, 1, 2), c, links(), None, cut=("3",))
    assert balanced.memory_parts["params"] == 2 * p * 4 and given.memory_parts["params"] == 3 * p * 4
    assert given.compute_ms == pytest.approx(1.5 * balanced.compute_ms, rel=1e-9)  # 3 pieces' forward against 2
    assert {x.layout.pp for x in plan(c, links(), 4, cut=("3",))} == {2}
    for cut, words in ((("9",), "'9' is not a piece"), (("1", "2"), "2 cut point(s) for 2 stages"),
                       (("4",), "stage 1 of the cut at 4 holds no parameters")):
        with pytest.raises(ValueError, match=re.escape(words)):
            predict(Layout(1, 1, 2), c, links(), None, cut=cut)


def test_zero_unit_gradients_are_all_there_with_micro_batches_or_when_the_window_is_larger():
    from hpctrain.parallel.plan_memory import scatter_peak

    p = 4_000_000
    big = costs([piece("0", p, units=2)], batch=16)  # units of half the model: the window exceeds it
    assert predict(Layout(4, 1, 1, zero=2), big, links(), None).memory_parts["buffers"] == 4 * p
    # zero 3 too: once every unit's gradient is there, backward ended and nothing is gathered
    assert predict(Layout(4, 1, 1, zero=3), big, links(), None).memory_parts["buffers"] == 4 * p
    many = costs([piece(str(i), p // 4, units=4, fwd=1e-3, bwd=2e-3) for i in range(4)], batch=16)
    stage = 4 * p // 2  # two pieces a stage
    piped = predict(Layout(2, 1, 2, zero=3, microbatches=2), many, links(), None)
    assert piped.memory_parts["buffers"] == stage + 2 * 4 * (p // 16)  # accumulating: every unit, and two gathered
    assert scatter_peak(100, 2) == 400 and scatter_peak(100, 4) == 850 and scatter_peak(100, 3) == 400


def test_recompute_keeps_block_inputs_and_one_blocks_activations():
    blocks = [piece(str(i), 100, act=10_000, io=500, recomputable=True, fwd=1e-3, bwd=2e-3) for i in range(4)]
    c = costs(blocks, batch=8)
    plain = predict(Layout(1, 1, 1), c, links(), None)
    rc = predict(Layout(1, 1, 1, recompute=True), c, links(), None)
    assert plain.memory_parts["activations_peak"] == 4 * 10_000 * 8
    # The last block re-created: the three inputs before it and its full activations (its own
    # kept input is one of their arrays).
    assert rc.memory_parts["activations_peak"] == 3 * 500 * 8 + 10_000 * 8
    assert rc.compute_ms == pytest.approx(plain.compute_ms + 4 * 8 * 1e-3 * 1e3)  # the forward again


def test_a_recomputed_blocks_peak_comes_after_the_later_pieces_freed_theirs():
    head = piece("head", 100, act=3000)
    c = costs([piece("0", 100, act=10_000, io=500, recomputable=True), piece("1", 100, act=6000, io=500,
                                                                              recomputable=True), head], batch=8)
    rc = predict(Layout(1, 1, 1, recompute=True), c, links(), None)
    kept = (500 + 500 + 3000) * 8
    # block 0 re-created with nothing before it: 10_000; block 1 after block 0's input: 500 + 6000
    assert rc.memory_parts["activations_peak"] == max(kept, 10_000 * 8, (500 + 6000) * 8)


def test_a_piece_measured_on_a_tensor_parallel_rank_uses_its_own_memory():
    from dataclasses import replace

    p = replace(piece("0", 100, split=80, act=1000), workspace_per_sample=400, tp_memory=((2, 64, 700, 32, 300),))
    assert p.activations(8, 2) == 64 + 700 * 8 and p.workspace(8, 2) == 32 + 300 * 8
    assert p.activations(8, 4) == pytest.approx((0.2 + 0.8 / 4) * 1000 * 8)  # not measured: the split share
    assert p.activations(8, 1) == 1000 * 8


@pytest.mark.parametrize("tp", [1, 2])
def test_recomputed_blocks_keep_no_workspace_under_any_tp(tp):
    """Recompute makes every layer in its block transient, the tensor-parallel ones included: the
    blocks' reuse pools drop out of the workspace at tp=2 as at tp=1; the head's stays (its share)."""
    from dataclasses import replace

    blocks = [replace(piece(str(i), 100, split=80, act=10_000, io=500, recomputable=True), workspace_fixed=4000,
                      workspace_per_sample=100) for i in range(3)]
    head = replace(piece("head", 100, split=100), workspace_fixed=2000)
    c = costs([*blocks, head], batch=8)
    plain = predict(Layout(1, tp, 1), c, links(), None)
    rc = predict(Layout(1, tp, 1, recompute=True), c, links(), None)
    assert plain.memory_parts["workspace"] == int(sum(p.workspace(8, tp) for p in [*blocks, head]))
    assert rc.memory_parts["workspace"] == int(head.workspace(8, tp)) == 2000 // tp


def test_pipeline_in_flight_micro_batches_count_on_the_first_stage():
    c = costs([piece(str(i), 100, act=1000, fwd=1e-3, bwd=2e-3) for i in range(4)], batch=16)
    pred = predict(Layout(1, 1, 2, microbatches=4), c, links(), None)
    # 1F1B: stage 0 holds pp = 2 micro-batches of 4 samples of its two pieces at its peak
    assert pred.memory_parts["activations_peak"] == 2 * 2 * 1000 * 4
    gp = predict(Layout(1, 1, 2, microbatches=4), c, links(), None, schedule="gpipe")
    assert gp.memory_parts["activations_peak"] == 4 * 2 * 1000 * 4


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stages_pools_keep_the_sets_of_the_micro_batches_it_holds(tp):
    from dataclasses import replace

    c = costs([replace(piece(str(i), 100, act=1000, split=100, fwd=1e-3, bwd=2e-3), workspace_fixed=5000,
                       tp_memory=((2, 0, 600, 3000, 0),)) for i in range(4)], batch=16)
    pred = predict(Layout(1, tp, 2, microbatches=4), c, links(), None)
    per_set = 2 * (1000 if tp == 1 else 600) * 4  # two pieces, 4 samples
    pools = 2 * (5000 if tp == 1 else 3000)
    # 2 held, less half the one the meter's own sample may see
    assert pred.memory_parts["workspace"] == pools + 1.5 * per_set
    assert predict(Layout(1, tp, 1), c, links(), None).memory_parts["workspace"] == 2 * pools
    from hpctrain.parallel.plan_memory import pooled_sets

    assert pooled_sets(2, 2, recompute=True) == 1  # the meter samples again inside a recomputed block


def test_a_layout_that_cannot_fit_is_refused_with_what_it_needs():
    # 31.2 GiB of model states on one rank: 16 bytes per parameter (float32 AdamW)
    p = int(31.2 * GIB / 16)
    c = costs([piece("0", p // 2, units=8), piece("1", p - p // 2, units=8)])
    pred = predict(Layout(1, 1, 1), c, links(), None, memory_limit=24 * GIB)
    assert not pred.fits and pred.why == "needs 31.2 GiB per rank, has 24"
    ok = predict(Layout(1, 1, 1), c, links(), None, memory_limit=32 * GIB)
    assert ok.fits and "compute" in ok.why
    best = plan(c, links(), 2, None, 24 * GIB)
    # plain dp keeps 31.2 GiB on each rank: it comes after the ones that fit, with its reason
    assert [p.fits for p in best] == sorted((p.fits for p in best), reverse=True)
    refused = {p.layout: p.why for p in best if not p.fits}
    assert refused[Layout(2, 1, 1)] == "needs 31.2 GiB per rank, has 24"
    assert all(p.memory_bytes <= 24 * GIB for p in best if p.fits) and best[0].fits
    assert any(p.fits and p.layout.pp == 2 for p in best)  # each stage holds half


def test_plan_is_sorted_fastest_first_and_says_why_the_first_wins():
    c = costs([piece(str(i), 1000, fwd=1e-3, bwd=2e-3, act=100, recomputable=True) for i in range(4)], batch=16)
    preds = plan(c, links(alpha=1e-4), 4, None, GIB)
    times = [p.predicted_ms for p in preds]
    assert times[1:] == sorted(times[1:]) and len(preds) == len(layouts(4, c))
    # the first: the plainest (least ZeRO, then no recompute) of those within TIE of the fastest
    near = [p for p in preds if p.predicted_ms <= min(times) * (1 + TIE)]
    assert preds[0] in near and all((p.layout.zero, p.layout.recompute) >= (preds[0].layout.zero,
                                                                           preds[0].layout.recompute) for p in near)
    assert ("faster than the next" if times[0] == min(times) else "goes first") in preds[0].why
    keys = {"dp", "tp", "pp", "cp", "ep", "zero", "recompute", "microbatches", "predicted_ms", "memory_bytes", "fits",
            "why"}
    assert set(preds[0].as_json()) == keys and isinstance(preds[0], Prediction)


def test_layouts_follow_the_engines_rules():
    gpt = nn.GPT(17, 8, 32, 2, 2, rng=0)  # 2 heads: tp=4 cannot split them
    c = measure(gpt, (8, 8), sample=lambda n: np.random.default_rng(0).integers(0, 17, (n, 8)), repeats=1)
    lays = layouts(4, c)
    assert all(lay.world == 4 for lay in lays)
    assert not any(lay.tp == 4 for lay in lays) and any(lay.tp == 2 for lay in lays)
    assert all(lay.zero == 0 for lay in lays if lay.dp == 1)
    assert all(lay.microbatches % lay.pp == 0 for lay in lays if lay.pp > 1)
    with pytest.raises(ValueError, match="tp=4 must divide"):
        predict(Layout(1, 4, 1), c, links(), None)
    with pytest.raises(ValueError, match="does not split into 3 micro-batches"):
        predict(Layout(2, 1, 2, microbatches=3), c, links(), None)
    mlp = measure(nn.Sequential(nn.Linear(8, 8, rng=0), nn.ReLU()), (8, 8), repeats=1)
    assert all(lay.tp == 1 and not lay.recompute for lay in layouts(4, mlp))  # nothing splits or recomputes


def test_measure_times_each_piece_and_leaves_the_model_as_it_was():
    g = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(16, 32, rng=g), nn.GELU(), nn.MLP(32, 64, rng=g), nn.Linear(32, 4, rng=g))
    before = [p.data.copy() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    c = measure(model, (32, 16), repeats=1)
    assert [p.name for p in c.pieces] == model.layer_names
    assert c.params == sum(p.data.size for p in model.parameters())
    assert all(p.forward_s(8) > 0 and p.backward_s(8) > 0 for p in c.pieces)
    assert c.pieces[2].recomputable and c.pieces[2].split_params == c.pieces[2].params and c.pieces[2].hidden == 64
    assert c.pieces[2].tp_forward == (32 * 4,) and c.pieces[2].units == 2
    assert c.pieces[0].input_per_sample == 16 * 4 and c.pieces[0].output_per_sample == 32 * 4
    assert c.optimizer_bytes_per_param == 8.0  # AdamW's two float32 moments
    assert all(np.array_equal(a, p.data) for a, p in zip(before, model.parameters()))
    assert all(p.grad is g for g, p in zip(grads, model.parameters())) and not any(np.any(g) for g in grads)
    assert all(m.training for _, m in model.named_modules())
    assert Costs.from_dict(c.as_dict()) == c


def test_measured_activations_are_what_the_memory_meter_counts():
    """The pieces' activations summed match the MemoryMeter over the whole serial model's forward."""
    from hpctrain.autograd import Tensor
    from hpctrain.training.memory import MemoryMeter

    g = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(16, 32, rng=g), nn.GELU(), nn.MLP(32, 128, rng=g), nn.MLP(32, 128, rng=g),
                          nn.Linear(32, 4, rng=g))
    c = measure(model, (64, 16), repeats=1)
    for n in (8, 32):
        x = g.standard_normal((n, 16)).astype(np.float32)
        out = model(Tensor(x, requires_grad=True))
        meter = MemoryMeter(model)
        meter.measure((out,))
        assert sum(p.activations(n) for p in c.pieces) == pytest.approx(meter.peak, rel=0.1)


def test_groups_pay_the_link_they_span_shared_by_the_groups_leaving_a_node():
    p = 1_000_000
    c = costs([piece("0", p, split=p, tpf=(1000,), tpb=(1000,))], batch=8)
    ln = links(alpha=1e-5)
    nodes = ["a", "a", "b", "b"]
    pred = predict(Layout(2, 2, 1), c, ln, nodes, overlap=False)
    # tp groups (0,1), (2,3) stay inside a node; dp groups (0,2), (1,3) both leave each node at once
    shared = Link((0, 2), 1e-4, BETA / 10 / 2, ())
    tp_bytes = 1000 * 8 / 2
    assert pred.comm_parts["tp"] == pytest.approx(2 * ln["intra-node"].allreduce_seconds(tp_bytes, 2) * 1e3, rel=1e-9)
    dp = shared.allreduce_seconds(p // 2 * 4, 2)
    assert pred.comm_parts["dp"] == pytest.approx((dp + small(4, ln["intra-node"])) * 1e3, rel=1e-9)
    # one dp group of 4 over the two nodes: both ranks of a node send across at once
    whole = predict(Layout(4, 1, 1), c, ln, nodes, overlap=False)
    dp4 = Link((0, 2), 1e-4, BETA / 10 / 2, ()).allreduce_seconds(p * 4, 4)
    assert whole.comm_parts["dp"] == pytest.approx((dp4 + small(4, ln["intra-node"])) * 1e3, rel=1e-9)
    # tp across the nodes (one rank per node and tp=2): its all-reduces pay the inter-node link
    across = predict(Layout(1, 2, 1), c, ln, ["a", "b"], overlap=False)
    assert across.comm_parts["tp"] == pytest.approx(
        2 * ln["inter-node"].allreduce_seconds(1000 * 8, 2) * 1e3, rel=1e-9)


def test_every_blocking_call_pays_the_ranks_meeting():
    """Link.meet, once per call: what the tp all-reduces cost beyond alpha-beta (the cost model's
    tp error was per call, not volume)."""
    c = costs([piece(str(i), 1000, split=1000, tpf=(64,), tpb=(64,)) for i in range(4)], batch=8)
    base = predict(Layout(1, 4, 1), c, links(), None)
    met = predict(Layout(1, 4, 1), c, links(meet=2e-3), None)
    calls = 4 * 2  # one forward and one backward all-reduce per piece, one micro-batch
    assert met.comm_parts["tp"] - base.comm_parts["tp"] == pytest.approx(calls * 2e-3 * 1e3, rel=1e-9)


def test_cp_ring_moves_two_cp_minus_1_over_cp_of_the_keys_and_values():
    kv = 2 * 8 * 32 * 4  # K and V of 8 tokens of width 32, float32, per sample
    c = Costs([piece("0", 100, split=0)], 16, 4, 8.0, 0.0, rows=8)
    c.pieces[0] = replace_piece(c.pieces[0], kv_per_sample=kv)
    ln = links()
    for cp in (2, 4):
        pred = predict(Layout(4 // cp, 1, 1, cp=cp), c, ln, None)
        # each rank holds T/cp tokens of its dp share; the ring carries the whole sequence's K/V
        moved = 2 * (cp - 1) / cp * kv * 16 / (4 // cp)
        assert pred.comm_parts["cp"] == pytest.approx(moved / BETA * 1e3, rel=1e-9)
    with pytest.raises(ValueError, match="2 x cp zigzag chunks"):
        predict(Layout(1, 1, 1, cp=4), Costs(c.pieces, 16, 4, 8.0, 0.0, rows=6), ln, None)


def test_ep_all_to_alls_move_the_routed_rows_and_shard_the_experts():
    rows = 4 * 2 * 32 * 4  # 4 tokens x top-2 x width 32, float32, per sample
    p = replace_piece(piece("0", 10_000), moe_per_sample=(rows,), expert_params=8_000, experts=4)
    c = costs([p], batch=16)
    pred = predict(Layout(4, 1, 1, ep=2), c, links(), None)
    samples = 16 / 4
    assert pred.comm_parts["ep"] == pytest.approx(4 * (2 - 1) / 2 * rows * samples / BETA * 1e3, rel=1e-9)
    assert p.local_params(1, 2) == 2_000 + 4_000  # dense whole, half the experts
    assert pred.memory_parts["params"] == 6_000 * 4
    with pytest.raises(ValueError, match="divisible by ep=4"):
        predict(Layout(4, 1, 1, ep=4), costs([replace_piece(p, experts=6)]), links(), None)


def replace_piece(p: PieceCost, **changes) -> PieceCost:
    from dataclasses import replace

    return replace(p, **changes)


def test_measure_finds_attention_keys_values_and_moe_rows():
    t, d = 8, 32
    gpt = nn.GPT(17, t, d, 4, 2, rng=0, moe_experts=4, moe_top_k=2)
    c = measure(gpt, (4, t), sample=lambda n: np.random.default_rng(0).integers(0, 17, (n, t)), repeats=1)
    blocks = [p for p in c.pieces if p.name.startswith("blocks.")]
    assert c.rows == t and all(b.kv_per_sample == 2 * t * d * 4 for b in blocks)
    assert all(b.moe_per_sample == (t * 2 * d * 4,) and b.experts == 4 for b in blocks)
    moes = [b.mlp for b in gpt.blocks]
    experts = sum(m.w1.data.size + m.b1.data.size + m.w2.data.size + m.b2.data.size for m in moes)
    assert sum(b.expert_params for b in blocks) == experts
    lays = layouts(4, c, ep=(1, 2, 4), cp=(1, 2))
    assert any(lay.ep == 4 for lay in lays) and any(lay.cp == 2 for lay in lays)
    assert all(lay.dp % lay.ep == 0 for lay in lays)


def test_blocking_calls_are_the_hand_count_per_layout():
    from hpctrain.parallel.plan import blocking_calls

    # two blocks of four tp all-reduces each (two forward, two backward) in 2 and 3 ZeRO units
    blocks = [piece("0", 1000, tpf=(8, 8), tpb=(8, 8), units=2, recomputable=True),
              piece("1", 1000, tpf=(8, 8), tpb=(8, 8), units=3, recomputable=True)]
    c = Costs(blocks, 16, 4, 8.0, 0.0, loss_tp=(4, 4, 4))
    none = {"tp": 0, "pp": 0, "cp": 0, "ep": 0, "dp": 0, "trainer": 0}
    assert blocking_calls(Layout(1, 1, 1), c, blocks) == none  # one rank: nothing to wait on
    assert blocking_calls(Layout(4, 1, 1), c, blocks) == {**none, "dp": 1, "trainer": 2}  # one 25 MiB bucket
    # tp: 8 per micro-batch and the loss's 3; a recomputed block re-issues its 2 backward ones
    assert blocking_calls(Layout(1, 4, 1), c, blocks)["tp"] == 8 + 3
    assert blocking_calls(Layout(1, 4, 1), c, blocks, last=False)["tp"] == 8
    assert blocking_calls(Layout(1, 4, 1, recompute=True, microbatches=2), c, blocks)["tp"] == 2 * (8 + 4 + 3)
    # ZeRO 2: a reduce-scatter per unit (5) and the final all-gather; ZeRO 3: a gather per
    # unit before each forward and backward (and recomputation) of each micro-batch too
    assert blocking_calls(Layout(4, 1, 1, zero=2), c, blocks)["dp"] == 5 + 1
    # ZeRO 1 waits once for all its reduce-scatters, then all-gathers: over two ranks each is one
    # library call; over four, PairTree's second round per unit waits on the first
    assert blocking_calls(Layout(2, 1, 2, zero=1), c, blocks)["dp"] == 1 + 1
    assert blocking_calls(Layout(4, 1, 1, zero=1), c, blocks)["dp"] == 5 * (2 - 1) + 1 + 1
    # a group across nodes: each reduce-scatter a call, as ZeRO 2's
    assert blocking_calls(Layout(2, 1, 2, zero=1), c, blocks, dp_spans=True)["dp"] == 5 + 1
    assert blocking_calls(Layout(2, 1, 2, zero=3, microbatches=4), c, blocks)["dp"] == 5 + 4 * 2 * 5
    assert blocking_calls(Layout(4, 1, 1, zero=3, recompute=True), c, blocks)["dp"] == 5 + 3 * 5
    assert blocking_calls(Layout(4, 1, 1), c, blocks)["dp"] == 1  # the buckets, waited on together
    # pipeline: one meeting per micro-batch
    assert blocking_calls(Layout(1, 1, 4, microbatches=8), c, blocks)["pp"] == 8


def test_zero3_computes_the_tensor_parallel_layers_forward_again_in_backward():
    from hpctrain.parallel.plan import blocking_calls

    # two blocks, every parameter split over tp, 1 ms forward and 2 ms backward per sample
    blocks = [piece(str(i), 1000, fwd=1e-3, bwd=2e-3, split=1000, tpf=(8, 8), tpb=(8, 8), units=2)
              for i in range(2)]
    c = dataclasses.replace(costs(blocks), loss_tp=(4, 4, 4), calibrated=True)
    # the engine's Rerun node: forward gathers and computes without recording; backward gathers,
    # computes again recording, and runs that backward: each split layer's forward all-reduce twice
    for z in (0, 1, 2):
        assert blocking_calls(Layout(2, 2, 1, zero=z), c, blocks)["tp"] == 8 + 3
    assert blocking_calls(Layout(2, 2, 1, zero=3), c, blocks)["tp"] == 8 + 4 + 3
    assert blocking_calls(Layout(2, 2, 1, zero=3, microbatches=1, recompute=False), c, blocks, last=False)["tp"] == 12
    # its compute: one forward of the split layers again, on this rank's half, priced as recomputation's
    samples = c.batch / 2  # dp=2, one micro-batch
    again = 2 * 1e-3 * samples / 2
    z3, z2 = predict(Layout(2, 2, 1, zero=3), c, links()), predict(Layout(2, 2, 1, zero=2), c, links())
    assert z3.recompute_ms == pytest.approx(again * 1e3) and z2.recompute_ms == 0.0
    assert z3.compute_ms - z2.compute_ms == pytest.approx(again * 1e3)
    # without tp (layers on arrays, no Rerun) nothing runs again
    assert predict(Layout(4, 1, 1, zero=3), c, links()).recompute_ms == 0.0


def test_calibrated_costs_add_the_engines_work_and_each_calls_price_instead_of_the_meeting():
    import dataclasses

    from hpctrain.parallel.plan import blocking_calls, call_seconds

    blocks = [piece("0", 1000, fwd=1e-4, bwd=2e-4, split=1000, tpf=(8,), tpb=(8,), units=2)]
    c = costs(blocks)
    ln = links(meet=5e-3)
    cal = dataclasses.replace(c, step_fixed_s=2e-3, call_s={"tp": 1e-3, "dp": 3e-4}, calibrated=True)
    for lay in (Layout(2, 1, 1), Layout(2, 1, 1, zero=3), Layout(1, 2, 1)):
        n = blocking_calls(lay, cal, blocks)
        price = call_seconds(n, cal)
        assert price == pytest.approx(n["tp"] * 1e-3 + (n["dp"] + n["trainer"]) * 3e-4)
        unpriced = predict(lay, dataclasses.replace(c, calibrated=True), ln)  # no meetings, no calls
        got = predict(lay, cal, ln)
        assert got.predicted_ms == pytest.approx(unpriced.predicted_ms + (2e-3 + price) * 1e3, rel=1e-9)
        assert got.comm_parts["calls"] == pytest.approx(price * 1e3)
        # uncalibrated: the probe's meeting is paid, the measured quantities are not
        assert predict(lay, c, ln).predicted_ms > unpriced.predicted_ms


def test_the_fitted_scales_apply_to_compute_recomputation_and_the_bubble_apart():
    import dataclasses

    # four recomputable blocks, 1 ms forward and 2 ms backward per sample: a pipeline of 2 stages
    blocks = [piece(str(i), 1000, fwd=1e-3, bwd=2e-3, recomputable=True) for i in range(4)]
    c = dataclasses.replace(costs(blocks, batch=8), calibrated=True)
    ln = links()
    lay = Layout(1, 1, 2, recompute=True, microbatches=2)
    one = predict(lay, c, ln)
    # recompute adds each block's forward again: 2 blocks x 1 ms x 4 samples per micro-batch, twice
    assert one.recompute_ms == pytest.approx(2 * 2 * 1e-3 * 4 * 1e3)
    assert one.bubble_ms > 0  # two stages, two micro-batches: one stage idles a third of the time
    fixed, cs, rs, bs = 3e-3, 1.5, 4.0, 0.5
    scaled = dataclasses.replace(c, step_fixed_s=fixed, compute_scale=cs, recompute_scale=rs, bubble_scale=bs)
    got = predict(lay, scaled, ln)
    want = fixed * 1e3 + cs * (one.compute_ms - one.recompute_ms) + rs * one.recompute_ms + one.comm_ms + \
        bs * one.bubble_ms
    assert got.predicted_ms == pytest.approx(want, rel=1e-9)
    assert got.compute_ms + got.comm_ms + got.bubble_ms == pytest.approx(got.predicted_ms, rel=1e-9)
    assert predict(Layout(1, 1, 2, microbatches=2), scaled, ln).recompute_ms == 0


def test_each_pipeline_boundary_pays_the_link_it_crosses():
    from hpctrain.parallel.plan import boundary_links

    ln = links(alpha=1e-5)
    two = ["a", "a", "b", "b"]
    # four stages on two nodes (ranks in blocks): only the middle boundary leaves a node
    got = boundary_links(Layout(1, 1, 4, microbatches=4), ln, two)
    assert [g.beta for g in got] == [BETA, BETA / 10, BETA]
    # two stages of two replicas: both replicas' sends leave node a at once, sharing its link
    got = boundary_links(Layout(2, 1, 2, microbatches=2), ln, two)
    assert [g.beta for g in got] == [BETA / 10 / 2]
    assert boundary_links(Layout(4, 1, 1), ln, two) == []
    assert [g.beta for g in boundary_links(Layout(1, 1, 4, microbatches=4), ln, None)] == [BETA] * 3
    # the sends the pipeline pays follow: a slower crossing makes the step no faster
    c = costs([piece(str(i), 1000, fwd=1e-4, bwd=2e-4, io=4096) for i in range(4)])
    one, across = (predict(Layout(1, 1, 4, microbatches=4), c, ln, n) for n in (None, two))
    assert across.predicted_ms > one.predicted_ms


def test_the_first_layouts_lead_is_said_as_a_lead_or_as_a_tie():
    from hpctrain.parallel.plan import lead

    assert lead(10.0, 11.0, "dp=4 tp=1 pp=1") == "10% faster than the next, dp=4 tp=1 pp=1"
    tie = lead(10.0, 9.9, "dp=4 tp=1 pp=1 zero 1")
    assert tie.startswith("dp=4 tp=1 pp=1 zero 1 is predicted 1.0% faster") and "goes first" in tie
