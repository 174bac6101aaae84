"""The planner's model: a layout's step time and peak memory per rank, from measured costs.

``measure`` (``plan_costs``) times each pipeline piece of the serial model on this device;
``probe`` (``comm.linkprobe``) fits alpha-beta per link class. ``predict(layout, costs, links,
nodes, memory_limit)`` prices one layout; ``plan`` prices every layout the engine accepts
(``layouts``) and sorts them, the fastest that fits first. The terms of a step:

- **compute**: each rank runs its piece: its pipeline stage (cut as ``hpctrain train`` cuts:
  ``cut.balance_stages`` on the pieces' measured times at the micro-batch), its ``1/tp`` share
  of the split layers, on ``batch / (dp * cp)`` samples in ``m`` micro-batches; recompute adds
  the wrapped blocks' forward again to their backward, and so does ZeRO 3 beside tp for the
  tensor-parallel layers (``_reruns``: they release their gathered parameters after forward and
  compute again in backward, their forward all-reduces twice). Per micro-batch the measured fit
  ``fixed + per_sample * samples`` counts (a call costs something however small the batch; tp
  divides the work per sample, not that fixed cost, mostly the interpreter's).
- **tensor parallel**: per micro-batch, each split layer's all-reduce of its ``(rows, d_model)``
  activation in forward and of its input's gradient in backward (a GPT block: four), the
  vocabulary embedding's and head's, the vocab-parallel loss's three small ones, each priced on
  the link the tp group spans, and each a meeting (below): they block in the middle of compute.
- **pipeline**: each micro-batch's activation forward and its gradient back (``alpha + n /
  beta`` on the link that boundary crosses: ``boundary_links``) lengthen the stage's actions;
  the schedule (1F1B or GPipe) is executed by ``pipeline_schedules.simulate`` with these
  durations, whose makespan is the pipeline's time:
  its part beyond the busiest stage's own work is the **bubble** (``(p-1)/(m+p-1)`` of it when
  the stages are even and sends free). A stage meets its neighbour once per micro-batch.
- **data parallel**: the gradients of this rank's parameters in buckets of ``bucket_mb`` MiB
  (``comm.buckets``: packed in name order, started in reverse, each one all-reduce ``2
  ceil(log2 p) alpha + 2 (p-1)/p n / beta`` and a meeting); with overlap a bucket starts when
  backward has produced its last gradient, during the last micro-batch's backward, so only what
  is left after backward ends is exposed. ZeRO 1 and 2: a reduce-scatter per unit started as
  backward finishes it (overlapped the same way, waited on together), then one all-gather of
  the updated parameters after the step (exposed); ZeRO 3: no final all-gather, but every
  unit's parameters are gathered before its forward and its backward (and a recomputation's
  forward), prefetched one unit ahead: what a gather takes beyond its unit's compute is exposed,
  and each wait meets the other ranks. Groups crossing nodes share the node's link: ``k`` ranks
  of one node in groups that leave it each get ``beta / k``.
- **meeting** (``Link.meet``, ``linkprobe.meeting_seconds``): a blocking collective between two
  stretches of compute waits for the last rank to arrive; where ranks share cores (this 2-core
  machine runs 4), for a descheduled one to run again. Every blocking call above pays it once.
  It is the least stable number here: on this machine, loaded by others, the probe gave 0.1-7 ms
  from run to run while the tp calls timed inside steps cost 1-10 ms each; with a core per rank
  it is near alpha.
- **optimizer**: the measured seconds per parameter times this rank's parameters (``1/dp`` of
  them under ZeRO); the trainer's two small all-reduces over the world per step.
- **what the steps make of it** (``Costs.step_fixed_s``, ``compute_scale``, ``bubble_scale``,
  ``call_s`` by group; ``plan_calibrate``): a step pays a fixed cost no piece shows (the loss,
  batch checks, the trainer's bookkeeping); the pieces, timed by one rank alone, run slower where
  a node's ranks share its cores (``compute_scale``); a pipeline's idle stage there lends its
  core to a busy one or keeps polling on it, as MPICH's waits do (``bubble_scale``); recomputation's
  forward again allocates what the transient pools gave back, which costs more where ranks share
  cores (``recompute_scale``, on the compute recompute adds); and each
  blocking collective (``blocking_calls``: tp's per block and micro-batch, the pipeline's
  meetings, one wait for the buckets or ZeRO's reduce-scatters, ZeRO 3's gathers, the trainer's
  two agreements) costs more inside a step than the probe's ``Link.meet`` says (a peer
  descheduled during compute). ``calibrate`` fits them to the real trainer's steps of a few
  layouts of the real model; until then scales 1, no fixed cost, each call at ``Link.meet``.
  Why calls by group: a tp all-reduce waits in the middle of compute for all of its group, a
  ZeRO gather was started a unit ahead, a pipeline meeting waits for one neighbour.
- **memory**: ``plan_memory`` (the engine's categories).

Why ``benchmarks/cost_model.py``'s tp predictions were 50-67% low: not the volume (it counted
the bytes its tp all-reduces moved, ``tensor_mappings.traffic``, and they equal its model's) but
the per-call cost. Its alpha came from a ping-pong of two ranks doing nothing else (tens of
microseconds); in a step each of tp's four calls per block and micro-batch is a meeting of ranks
arriving from compute, which costs ``Link.meet``: milliseconds on this oversubscribed machine, a
hundred times alpha. ``benchmarks/plan_check.py`` prints the seconds measured inside the tp
collectives per step against this model's price of them.

Context (cp) and expert (ep) parallelism are hooks: ``Layout`` carries them and ``predict``
prices cp's ring (``2 (cp-1)/cp`` of each attention layer's K and V per micro-batch, overlapped
with the attention's compute) and ep's all-to-alls per MoE layer (tokens to their experts and
back, forward and backward, and one of the counts) when ``Costs`` has them;
``layouts`` lists cp/ep > 1 only when asked (``cp=``/``ep=`` sizes to try).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..comm.linkprobe import Link
from ..comm.pieces import pair_rounds
from .cut import balance_stages, counts_at
from .plan_costs import Costs, PieceCost, measure, on_rank0_alone
from .plan_layouts import Layout, layout_problem, layouts
from .plan_links import allreduce_seconds, boundary_links, gather_seconds, group_link, group_spans, send_seconds
from .plan_memory import gib, memory

__all__ = ["TIE", "Costs", "Layout", "PieceCost", "Prediction", "blocking_calls", "call_seconds", "layouts", "lead",
           "measure", "on_rank0_alone", "plan", "predict"]


@dataclass
class Prediction:
    """A layout's predicted step (milliseconds) and peak memory per rank (bytes)."""

    layout: Layout
    predicted_ms: float
    compute_ms: float
    comm_ms: float  # exposed communication: tp, pipeline sends, dp/ZeRO left after overlap
    bubble_ms: float
    memory_bytes: int
    memory_limit: int | None
    fits: bool
    why: str
    memory_parts: dict[str, int] = dataclasses.field(default_factory=dict)
    comm_parts: dict[str, float] = dataclasses.field(default_factory=dict)  # ms by group: tp, cp, ep, pp, dp
    calls: dict[str, int] = dataclasses.field(default_factory=dict)  # blocking_calls of the slowest stage
    recompute_ms: float = 0.0  # of compute_ms unscaled: what recomputation adds (its forward again)

    def as_json(self) -> dict[str, Any]:
        """The issue's keys (``hpctrain plan --json``)."""
        lay = self.layout
        return {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "zero": lay.zero,
                "recompute": lay.recompute, "microbatches": lay.microbatches,
                "predicted_ms": round(self.predicted_ms, 3), "memory_bytes": int(self.memory_bytes),
                "fits": self.fits, "why": self.why}


# -- time ----------------------------------------------------------------------------------------


def stages_of(costs: Costs, pp: int, samples: float, tp: int = 1,
              cut: Sequence[str] | None = None) -> list[list[PieceCost]]:
    """The pieces of each pipeline stage, cut as ``hpctrain train`` cuts: at ``cut`` (``--pp-cut``'s
    points, piece names or indices where stages 1.. begin; ``ValueError`` saying what is wrong
    with them), else ``balance_stages`` on each piece's forward + backward time at the micro-batch."""
    if pp == 1:
        return [list(costs.pieces)]
    if cut:
        counts = counts_at(list(cut), [p.name for p in costs.pieces], pp)
    else:
        times = [p.forward_s(samples, tp) + p.backward_s(samples, tp) for p in costs.pieces]
        counts = balance_stages(times, pp, [p.holds_params for p in costs.pieces])
    out, start = [], 0
    for c in counts:
        out.append(costs.pieces[start : start + c])
        start += c
    empty = next((k for k, st in enumerate(out) if not any(p.holds_params for p in st)), None)
    if cut and empty is not None:  # (as hpctrain train refuses it: every stage's optimizer needs parameters)
        raise ValueError(f"stage {empty} of the cut at {', '.join(cut)} holds no parameters: every stage needs a "
                         "layer with parameters")
    return out


def _local(pieces: list[PieceCost], lay: Layout) -> int:
    """Parameter elements of ``pieces`` on one rank of ``lay`` (its tp and ep shares)."""
    return sum(q.local_params(lay.tp, lay.ep) for q in pieces)


def _tp_seconds(calls: tuple[int, ...], samples: float, lay: Layout, link: Link | None) -> float:
    if link is None:
        return 0.0
    return sum(allreduce_seconds(link, n * samples, lay.tp) for n in calls)


def _reruns(pieces: list[PieceCost], lay: Layout) -> list[PieceCost]:
    """The pieces whose tensor-parallel layers run their forward again in backward: at ZeRO 3 a
    layer called on tensors (every tp layer) is one ``Rerun`` node that releases its gathered
    parameters after forward and gathers and computes again in backward (``zero_gather.UnitHooks``:
    its forward all-reduces twice; plan_check had priced dp=2 x tp=2 ZeRO 3 20-25% under)."""
    return [p for p in pieces if p.split_params and p.params] if lay.zero == 3 and lay.tp > 1 else []


def _rerun_s(p: PieceCost, samples: float, tp: int) -> float:
    """The forward of piece ``p``'s tensor-parallel layers again (``_reruns``): their share of its
    forward on a rank holding ``1/tp`` of them."""
    split = p.split_params / p.params / tp
    return p.forward_s(samples, tp) * split / p._share(tp)


def _stage_times(pieces: list[PieceCost], lay: Layout, costs: Costs, samples: float, links: dict[str, Link | None],
                 last: bool) -> tuple[float, float, float, float, dict[str, float]]:
    """``(forward compute, backward compute, forward communication, backward communication, the
    communication by group)`` seconds of one micro-batch on a stage of ``pieces``."""
    f = sum(p.forward_s(samples, lay.tp, lay.recompute) for p in pieces)
    b = sum(p.backward_s(samples, lay.tp, lay.recompute) for p in pieces)
    again = _reruns(pieces, lay)
    b += sum(_rerun_s(p, samples, lay.tp) for p in again)
    redo = [p for p in pieces if p.recomputable] if lay.recompute else []
    tp_link = links["tp"]
    tf = sum(_tp_seconds(p.tp_forward, samples, lay, tp_link) for p in [*pieces, *again])
    tf += _tp_seconds(costs.loss_tp, samples, lay, tp_link) if last else 0.0
    tb = sum(_tp_seconds(p.tp_backward, samples, lay, tp_link) for p in [*pieces, *redo])
    # cp's ring: 2 (cp-1)/cp of each attention's keys and values of the whole sequence (forward
    # and backward), in 2 (cp-1) steps overlapped with the piece's compute; a wait per pass.
    ring, link, cp = 0.0, links["cp"], lay.cp
    for p in (p for p in pieces if p.kv_per_sample and link is not None):
        moved = 2 * (cp - 1) / cp * p.kv_per_sample * samples * cp
        steps = 2 * (cp - 1) * link.alpha + moved / link.beta
        ring += max(0.0, steps - p.forward_s(samples, lay.tp) - p.backward_s(samples, lay.tp)) + 2 * link.meet
    # ep: each MoE layer's tokens to their experts and back, forward and backward: four
    # all-to-alls (and a small one of the counts), each moving (ep-1)/ep of the rows.
    a2a, link, ep = 0.0, links["ep"], lay.ep
    for n in (n for p in pieces for n in p.moe_per_sample if link is not None):
        one = (ep - 1) * link.alpha + (ep - 1) / ep * n * samples / link.beta + link.meet
        a2a += 4 * one + (ep - 1) * link.alpha + link.meet
    kinds = {"tp": tf + tb, "cp": ring, "ep": a2a}
    return f, b, tf + ring / 2 + a2a / 2, tb + ring / 2 + a2a / 2, kinds


def _reduction(pieces: list[PieceCost], lay: Layout, costs: Costs, link: Link | None, backward: float,
               bucket_mb: float, overlap: bool, compression: str | None = None) -> tuple[float, float]:
    """``(exposed seconds after the last backward, seconds after the optimizer step)`` of the
    gradient reduction over dp (module docstring; ``compression``: the buckets' 16-bit wire)."""
    if link is None:
        return 0.0, 0.0
    p, item = lay.dp, costs.grad_bytes  # gradients reduce in their own dtype (mixed precision: float32)
    # Backward runs the pieces in reverse: a unit (zero) or bucket is ready once backward has passed it.
    order = [q for q in reversed(pieces) if q.params]
    total = sum(q.local_params(lay.tp, lay.ep) for q in order) or 1
    chunks: list[tuple[float, float]] = []  # (ready fraction of backward, seconds)
    done = 0
    if lay.zero:
        for q in order:
            done += q.local_params(lay.tp, lay.ep)
            per = q.local_params(lay.tp, lay.ep) * item / max(1, q.units)
            # started without waiting as backward finishes each unit; waited on together at the end
            chunks += [(done / total, link.gather_seconds(per, p))] * q.units
        chunks.append((1.0, link.meet))
    else:
        wire = min(2, item) if compression else item  # packed at the gradients' size, sent in 16 bits
        for bucket in reversed(_buckets(pieces, lay, item, bucket_mb)):
            size = _local(bucket, lay)
            done += size
            chunks.append((done / total, allreduce_seconds(link, size * wire, p)))
    end = 0.0
    for ready, sec in chunks:
        start = ready * backward if overlap else backward
        end = max(end, start) + sec
    exposed = max(0.0, end - backward)
    after = gather_seconds(link, total * costs.itemsize, p) if lay.zero in (1, 2) else 0.0  # the updated parameters
    return exposed, after


def _buckets(pieces: list[PieceCost], lay: Layout, item: int, bucket_mb: float) -> list[list[PieceCost]]:
    """GradBuckets' buckets of a stage: packed in forward (name) order up to ``bucket_mb`` MiB."""
    cap = bucket_mb * (1 << 20)
    buckets: list[list[PieceCost]] = []
    fill = 0.0
    for q in (q for q in pieces if q.params):
        nbytes = q.local_params(lay.tp, lay.ep) * item
        if buckets and buckets[-1] and fill + nbytes <= cap:
            buckets[-1].append(q)
            fill += nbytes
        else:
            buckets.append([q])
            fill = nbytes
    return buckets


def blocking_calls(layout: Layout, costs: Costs, pieces: list[PieceCost], last: bool = True,
                   dp_spans: bool = False) -> dict[str, int]:
    """Blocking collectives one step of ``layout`` waits on, by group, on a stage of ``pieces``
    (``last``: the stage holding the loss), as the engine issues them: tp, per micro-batch, each
    split layer's forward and backward all-reduce (a recomputed block's forward again, and at ZeRO 3
    each split layer's forward again: ``_reruns``) and the
    vocab-parallel loss's three; pp, one meeting per micro-batch; cp, a ring per attention piece
    forward and backward; ep, five all-to-alls per MoE layer; dp, one wait for the buckets
    (started during backward, waited on together), or ZeRO's reduce-scatter per unit and ZeRO 1/2's
    all-gather after the step, ZeRO 3's gather per unit before each forward and backward (and
    recomputation) of each micro-batch; the trainer's two agreements over the world. What
    ``Costs.call_s`` multiplies.

    ZeRO's reduce-scatters as ``zero_scatter.GradScatter`` waits on them: ZeRO 2 and 3 wait on
    the oldest once two are in flight, each a call. ZeRO 1 keeps every unit's gradient and waits on
    none during backward, only on all of them at its end: a reduce-scatter that is one library call
    (two ranks, or a group size not a power of two) then costs no wait of its own, but over
    ``2**k`` ranks (``k > 1``) ``comm.pieces.PairTree`` chains ``k`` rounds, each started only when
    the one before is seen done, so ``k - 1`` of them wait per unit (plan_check, nine one-node
    runs: ZeRO 1 over two ranks cost a median 0.1-1.3 ms more than plain dp, ZeRO 2 1.9-7.2 ms;
    over four, ZeRO 1 3.5-6.8 ms). ``dp_spans`` (the dp group crosses nodes): ZeRO 1's
    reduce-scatters are counted a call each as ZeRO 2's (counting them free there put 5 fewer of
    three two-node runs' 420 layouts within 20%)."""
    lay, m = layout, layout.microbatches
    out = {"tp": 0, "pp": 0, "cp": 0, "ep": 0, "dp": 0, "trainer": 2 if lay.world > 1 else 0}
    redo = [p for p in pieces if p.recomputable] if lay.recompute else []
    if lay.tp > 1:
        per = sum(len(p.tp_forward) + len(p.tp_backward) for p in pieces) + sum(len(p.tp_backward) for p in redo)
        per += sum(len(p.tp_forward) for p in _reruns(pieces, lay))
        out["tp"] = m * (per + (len(costs.loss_tp) if last else 0))
    if lay.pp > 1:
        out["pp"] = m
    if lay.cp > 1:
        out["cp"] = m * 2 * sum(1 for p in pieces if p.kv_per_sample)
    if lay.ep > 1:
        out["ep"] = m * 5 * sum(len(p.moe_per_sample) for p in pieces)
    if lay.dp * lay.cp > 1:
        units = sum(max(1, q.units) for q in pieces if q.params)
        if not lay.zero:
            out["dp"] = 1  # the buckets, started during backward, are waited on together
        elif lay.zero == 2 or (lay.zero == 1 and dp_spans):
            out["dp"] = units + 1  # a reduce-scatter per unit, the all-gather
        elif lay.zero == 1:
            out["dp"] = units * (pair_rounds(lay.dp * lay.cp) - 1) + 2  # later rounds, the end, the all-gather
        else:
            out["dp"] = units + m * (3 if lay.recompute else 2) * units
    return out


def call_seconds(calls: dict[str, int], costs: Costs) -> float:
    """Seconds ``calls`` (``blocking_calls``) wait inside a step at ``costs.call_s``'s measured
    price per group (cp, ep and the trainer's at dp's: the same world-wide meeting)."""
    price = costs.call_s
    return sum(n * price.get(k, price.get("dp", 0.0)) for k, n in calls.items())


def _zero3_gathers(pieces: list[PieceCost], lay: Layout, costs: Costs, link: Link | None, f: float, b: float) -> float:
    """Exposed seconds of ZeRO-3's per-unit gathers in one micro-batch's forward and backward:
    prefetched one unit ahead, so a gather beyond its unit's compute shows."""
    if link is None or lay.zero != 3:
        return 0.0
    units = [(q.local_params(lay.tp, lay.ep) * costs.itemsize / max(1, q.units), q.units) for q in pieces if q.params]
    n = sum(k for _, k in units) or 1
    gathers = [gather_seconds(link, size, lay.dp) for size, k in units for _ in range(k)]
    passes = 3 if lay.recompute else 2
    exposed = 0.0
    for share in (f / n, b / n):
        # the first unit's gather has nothing to hide behind; each wait meets the other ranks
        exposed += sum(max(0.0, g - share) for g in gathers) + (gathers[0] - link.meet if gathers else 0.0)
    return exposed * passes / 2


def _pipeline(stage_times: list[tuple[float, float, float, float]], sends: list[float], lay: Layout,
              schedule: str) -> tuple[float, list[float]]:
    """``(makespan, each stage's finish)`` of one step's micro-batches (``simulate``)."""
    from .pipeline_schedules import simulate

    m = lay.microbatches
    if lay.pp == 1:
        f, b, tf, tb, _ = stage_times[0]
        return m * (f + b + tf + tb), [m * (f + b + tf + tb)]

    def duration(s: int, action: Any) -> float:
        f, b, tf, tb, _ = stage_times[s]
        if action.kind == "F":
            return f + tf + (sends[s] if s < lay.pp - 1 else 0.0)
        return b + tb + (sends[s - 1] if s > 0 else 0.0)

    if not any(sum(t[:4]) for t in stage_times) and not any(sends):
        return 0.0, [0.0] * lay.pp  # nothing takes time (simulate's bubble would divide by zero)
    out = simulate(schedule, lay.pp, m, durations=duration)
    finish = [0.0] * lay.pp
    for (s, action), t0 in out["start"].items():
        finish[s] = max(finish[s], t0 + duration(s, action))
    return float(out["makespan"]), finish


def predict(layout: Layout, costs: Costs, links: dict[str, Link | None], nodes_layout: list[str] | None = None,
            memory_limit: int | None = None, *, bucket_mb: float = 25.0, overlap: bool = True,
            schedule: str = "1f1b", cut: Sequence[str] | None = None,
            compression: str | None = None) -> Prediction:
    """The step time and peak memory per rank of ``layout`` (module docstring: the terms).

    ``links``: ``linkprobe.probe``'s fits by class; ``nodes_layout``: each rank's node name (rank
    order; ``None``: one node); ``memory_limit``: bytes per rank (``None``: no limit); ``cut``: the
    pipeline's cut as ``--pp-cut`` gives it (``stages_of``; ``None``: balanced as ``train`` balances);
    ``compression``: ``--compression`` (``"fp16"``/``"bf16"``): the plain dp all-reduce's gradients
    travel in 16 bits (ZeRO, its own reducer, takes none)."""
    lay = layout
    problem = layout_problem(lay, costs)
    if problem is not None:
        raise ValueError(f"the engine refuses {lay.label()}: {problem}")
    if nodes_layout is not None and len(nodes_layout) != lay.world:
        raise ValueError(f"nodes_layout names {len(nodes_layout)} ranks but {lay.label()} takes {lay.world}")
    if costs.calibrated:  # call_s measured each call's in-step wait: it replaces the probe's meet
        links = {k: (dataclasses.replace(v, meet=0.0) if v is not None else None) for k, v in links.items()}
    samples = costs.batch / (lay.dp * lay.cp) / lay.microbatches
    stages = stages_of(costs, lay.pp, samples, lay.tp, cut)
    by = {k: group_link(k, lay, links, nodes_layout) for k in ("tp", "pp", "dp_cp", "cp", "ep")}
    pp_link, dp_link = by["pp"], by["dp_cp"]
    dp_spans = lay.dp * lay.cp > 1 and bool(group_spans("dp_cp", lay, nodes_layout))
    times = [_stage_times(st, lay, costs, samples, by, s == lay.pp - 1) for s, st in enumerate(stages)]
    sends = [send_seconds(link, st[-1].output_per_sample * samples)
             for link, st in zip(boundary_links(lay, links, nodes_layout), stages[:-1])]
    makespan, finish = _pipeline(times, sends, lay, schedule)
    world_link = links.get("intra-node") or links.get("inter-node")
    small = 2 * allreduce_seconds(world_link, 64, lay.world) if lay.world > 1 else 0.0
    # The stage that sets the step is chosen at unit scales (its own work, transfers and idle time as
    # timed, the calls unpriced), as ``plan_calibrate.terms`` sees the layout: chosen after the
    # fitted scales, a stage that idles most could win under a large bubble scale and the prediction
    # leave the fit it came from (plan_check, two nodes: a layout timed for the fit predicted +90%).
    best: tuple = (-1.0,)  # (unit step, step, compute, communication, bubble, parts, calls, redo)
    for s, st in enumerate(stages):
        f, b, tf, tb, kinds = times[s]
        exposed, after = _reduction(st, lay, costs, dp_link, b, bucket_mb, overlap, compression)
        exposed += lay.microbatches * _zero3_gathers(st, lay, costs, dp_link, f, b)
        opt = costs.optimizer_s_per_param * _local(st, lay) / (lay.dp if lay.zero else 1)
        # A stage that receives meets its neighbour once per micro-batch (plan_check: not per message).
        meets = lay.microbatches * (pp_link.meet if pp_link is not None else 0.0)
        parts = {k: lay.microbatches * v for k, v in kinds.items()}
        parts.update(dp=exposed + after + small,
                     pp=lay.microbatches * ((sends[s] if s < lay.pp - 1 else 0.0) + (sends[s - 1] if s > 0 else 0.0))
                     + meets)
        # Each blocking call's in-step cost (measured: calibrate).
        calls = blocking_calls(lay, costs, st, s == lay.pp - 1, dp_spans)
        parts["calls"] = call_seconds(calls, costs)
        compute = lay.microbatches * (f + b) + opt
        redo = lay.microbatches * sum(p.forward_s(samples, lay.tp, True) + p.backward_s(samples, lay.tp, True)
                                      - p.forward_s(samples, lay.tp) - p.backward_s(samples, lay.tp)
                                      for p in st) if lay.recompute else 0.0
        # ZeRO 3's tensor-parallel layers computed again in backward: a forward again, as recompute's
        redo += lay.microbatches * sum(_rerun_s(p, samples, lay.tp) for p in _reruns(st, lay))
        comm = sum(parts.values())
        # What the schedule leaves idle: the stage's finish beyond its own work and messages.
        bubble = max(0.0, finish[s] + exposed + opt + after + small + meets - compute - comm + parts["calls"])
        # The engine's own work, the compute (recomputation's part apart) and the idle time as the
        # steps make them (calibrate).
        work = costs.step_fixed_s + costs.compute_scale * (compute - redo) + costs.recompute_scale * redo
        step = work + comm + costs.bubble_scale * bubble
        unit = compute + comm - parts["calls"] + bubble
        if unit > best[0] + 1e-12:
            best = (unit, step, work, comm, costs.bubble_scale * bubble, parts, calls, redo)
    _, step, compute, comm, bubble, parts, calls, redo = best
    need, memory_parts = memory(lay, costs, stages, samples, schedule)
    fits = memory_limit is None or need <= memory_limit
    why = (f"compute {compute * 1e3:.1f} ms + communication {comm * 1e3:.1f} ms + bubble {bubble * 1e3:.1f} ms"
           if fits else f"needs {gib(need)} GiB per rank, has {gib(memory_limit or 0)}")
    return Prediction(lay, step * 1e3, compute * 1e3, comm * 1e3, bubble * 1e3, int(need), memory_limit, fits, why,
                      memory_parts, {k: v * 1e3 for k, v in parts.items()}, calls, redo * 1e3)


def plan(costs: Costs, links: dict[str, Link | None], world: int, nodes: list[str] | None = None,
         memory_limit: int | None = None, **options: Any) -> list[Prediction]:
    """Every layout of ``world`` ranks, predicted: the ones that fit by predicted step (fastest
    first), then the ones that do not fit (least memory first), each with its ``why``; the first
    one's ``why`` says what it wins by. Among the layouts predicted within ``TIE`` of the fastest,
    the plainest (the least ZeRO, then no recompute) goes first. ``options``: ``layouts``' choices
    (``zero``, ``recompute``, ``microbatches``, ``cp``, ``ep``) and ``predict``'s (``bucket_mb``,
    ``overlap``, ``schedule``, ``compression``, ``cut``: with a cut, only the layouts of its stage
    count)."""
    pick = {k: options.pop(k) for k in ("zero", "recompute", "microbatches", "cp", "ep") if k in options}
    cut = options.get("cut")
    lays = [lay for lay in layouts(world, costs, **pick) if not cut or lay.pp == len(cut) + 1]
    preds = [predict(lay, costs, links, nodes, memory_limit, **options) for lay in lays]
    fit = sorted((p for p in preds if p.fits), key=lambda p: (p.predicted_ms, p.memory_bytes))
    rest = sorted((p for p in preds if not p.fits), key=lambda p: p.memory_bytes)
    if fit:
        near = [p for p in fit if p.predicted_ms <= fit[0].predicted_ms * (1 + TIE)]
        first = min(near, key=lambda p: (p.layout.zero, p.layout.recompute))  # (the fastest of equals)
        fit = [first, *(p for p in fit if p is not first)]
    if len(fit) > 1:
        fit[0].why = f"{fit[0].why}; {lead(fit[0].predicted_ms, fit[1].predicted_ms, fit[1].layout.label())}"
    return fit + rest


#: Predicted steps within this share of the fastest are a tie to the plan: calibration's steps of one
#: layout move 6% at the median between two trainers on this machine (``benchmarks/plan_noise.py``).
#: ZeRO and recompute buy memory with time; where the plan cannot tell the times apart, the layout
#: that does not pay for memory it does not need goes first (plan_check: measured ZeRO 1 over two
#: ranks a median 0.1-1.3 ms slower than plain dp, ZeRO 2 1.9-7.2 ms).
TIE = 0.02


def lead(first_ms: float, next_ms: float, next_label: str) -> str:
    """The first layout's lead on the next, as the plan's ``why`` says it (``hpctrain plan``'s too)."""
    if next_ms >= first_ms:
        return f"{next_ms / first_ms - 1:.0%} faster than the next, {next_label}"
    return (f"{next_label} is predicted {1 - next_ms / first_ms:.1%} faster, within the {TIE:.0%} the plan "
            f"cannot tell apart: the plainer layout (less ZeRO, no recompute) goes first")
