"""The planner's peak memory per rank: the engine's own accounting (``training.memory``, the
``memory`` block of ``summary.json``: params, grads, optimizer, buffers, activations_peak),
counted from the measured pieces instead of from arrays that exist.

- **params**: this rank's pieces (its pipeline stage), the split layers' share ``1/tp``; ZeRO-3
  keeps ``1/dp`` of them (the rest is gathered per unit: two units at once, a buffer).
- **grads**: as many as the parameters, in the reduce dtype (``Costs.grad_bytes``: float32 under
  mixed precision); they live in the dp buckets; ZeRO 2 and 3 keep the reduced ``1/dp`` piece (a
  unit's local gradient is a transient buffer).
- **optimizer**: ``Costs.optimizer_bytes_per_param`` per local parameter (AdamW: two float32
  moments; mixed precision's float32 masters besides), ``1/dp`` of it under any ZeRO stage.
- **buffers**: ZeRO 1's reduced piece of the gradients (``1/dp``). ZeRO 2's unit gradients:
  with micro-batches all of them (they accumulate through the step); without, the reductions'
  window (``scatter_peak``: three in flight, each with its regrouped copies, and the next unit's
  gradient), at most all of them. ZeRO 3's the same, two gathered units beside the window.
- **workspace**: what the layers' reuse pools keep beyond the activations (measured per piece
  by the ``MemoryMeter``, on a tensor-parallel rank where ``PieceCost.tp_memory`` has the
  size), and on a pipeline stage the sets of the micro-batches it holds (``pooled_sets``); none
  in recomputed blocks, under any tp (``Recompute`` makes every layer inside its block
  transient, the tensor-parallel ones swapped in after wrapping too).
- **activations_peak**: each piece's measured activations at the micro-batch (on a
  tensor-parallel rank as ``workspace``), times the micro-batches a stage holds at once (1F1B:
  ``min(m, pp - stage)``, GPipe: ``m``; without a pipeline one). With recompute a wrapped block
  keeps only its input, and its full activations exist again while it runs backward, after the
  pieces behind it freed theirs (``stage_activations``).

The loss's own arrays (the cross-entropy's probabilities) are not counted: a few per cent of a
small-vocabulary model's activations (``benchmarks/plan_memory_check.py`` prints each category
predicted against the trainer's ``memory_summary``).
"""

from __future__ import annotations

from typing import Any

from .plan_costs import Costs, PieceCost
from .zero_scatter import GradScatter

GIB = 1 << 30


def in_flight(schedule: str, stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches stage ``stage`` holds activations for at its peak (the schedule's own count:
    ``pipeline_schedules.peak_activations`` of its action list)."""
    from .pipeline_schedules import get_schedule, peak_activations

    if stages == 1:
        return 1
    return peak_activations(list(get_schedule(schedule)(stages, stage, microbatches)))


def stage_activations(pieces: list[PieceCost], samples: float, tp: int, recompute: bool) -> tuple[float, float]:
    """``(kept, extra)``: bytes one micro-batch of ``samples`` leaves in a stage of ``pieces`` for
    its backward, and how far a recomputed block's backward rises above that. Backward runs from
    the last piece: when block ``b`` re-creates its activations (its input among them: the one
    array it kept), the pieces after it have already freed theirs, so the peak there is the
    pieces before ``b`` plus ``b``'s full activations (what the ``MemoryMeter`` samples inside
    the block)."""
    kept, top = 0.0, 0.0
    for p in pieces:
        full = p.activations(samples, tp)
        if recompute and p.recomputable:
            top = max(top, kept + full)
            kept += p.input_per_sample * samples
        else:
            kept += full
    return kept, max(0.0, top - kept)


#: ZeRO 2/3's reductions of unit gradients in flight at once (``GradScatter.MAX_INFLIGHT``), and
#: the one that starts before the oldest is waited on.
INFLIGHT = GradScatter.MAX_INFLIGHT + 1


def scatter_peak(unit: int, dp: int) -> int:
    """Bytes ZeRO 2/3's local unit gradients reach in one backward without micro-batches (units
    of at most ``unit`` bytes, over ``dp`` ranks): ``INFLIGHT`` reductions, each with its unit's
    gradient and, over a power-of-two ``dp`` above 2 (``comm.pieces.PairTree``), its first
    round's regrouped copy and half-size receive buffer; and the next unit's gradient, allocated
    before its backward. With micro-batches every unit's gradient lives through the step."""
    rounds = 1.5 if dp > 2 and dp & (dp - 1) == 0 else 0.0
    return int((INFLIGHT * (1 + rounds) + 1) * unit)


def pooled_sets(pp: int, held: int, recompute: bool = False) -> float:
    """Micro-batches' activation sets a pipeline stage's ``workspace`` counts (``MemoryMeter``:
    what the reuse pools hold beyond the activations its own sample at a backward's start saw).

    The pools hand an array out again only once nobody holds it, so the graphs of the ``held``
    micro-batches keep one set of arrays each in them, which the trainer's activation peak counts
    too (``peak_activation_bytes``). Less what the meter's sample saw of the micro-batch whose
    backward starts: all of it inside a recomputed block (it samples there again); otherwise it
    varies from none to all of it, step to step and stage to stage (0 bytes on ``dp=1 tp=2 pp=2
    m=2`` stage 0 of ``plan_check``'s GPT; 3.75 to 7.01 MiB of a 7.01 MiB set on ``dp=2 pp=2 m=2``
    stage 0 of the GPT at the longer block), so half of it counts."""
    if pp == 1:
        return 0.0
    return held - (1.0 if recompute else 0.5)


def memory(layout: Any, costs: Costs, stages: list[list[PieceCost]], samples: float,
           schedule: str = "1f1b") -> tuple[int, dict[str, int]]:
    """``(peak bytes of the rank that holds most, {category: bytes} of that rank)``."""
    best: tuple[int, dict[str, int]] = (-1, {})
    dp, tp, z = layout.dp, layout.tp, layout.zero
    for s, pieces in enumerate(stages):
        local = sum(p.local_params(tp, layout.ep) for p in pieces)
        # A unit's share on this tp rank: the piece's split applies to its units alike.
        big = max((p.largest_unit * p.local_params(tp, layout.ep) // p.params for p in pieces if p.params), default=0)
        # Parameters in the compute dtype, gradients in the reduce dtype (mixed precision: 2 and 4 bytes).
        nbytes, gbytes = local * costs.itemsize, local * costs.grad_bytes
        shard, gshard = -(-nbytes // dp), -(-gbytes // dp)
        # ZeRO 2, 3's unit gradients and ZeRO 3's two gathered units: with micro-batches every
        # unit's gradient lives through the step; without, the reductions' window and the gathered
        # units beside it, or every unit's gradient once backward ended (nothing gathered then).
        gathered = 2 * big * costs.itemsize if z == 3 else 0
        units = (gbytes + gathered if layout.microbatches > 1
                 else min(gbytes, scatter_peak(big * costs.grad_bytes, dp) + gathered))
        out = {"params": shard if z == 3 else nbytes,
               "grads": gshard if z >= 2 else gbytes,
               "optimizer": int(local * costs.optimizer_bytes_per_param / (dp if z else 1)),
               "buffers": {0: 0, 1: gshard}.get(z, units) if dp > 1 or z == 1 else 0}
        kept, redo = stage_activations(pieces, samples, tp, layout.recompute)
        held = in_flight(schedule, layout.pp, s, layout.microbatches)
        out["activations_peak"] = int(held * kept + redo)
        out["workspace"] = int(sum(p.workspace(samples, tp) for p in pieces
                                   if not (layout.recompute and p.recomputable))
                               + pooled_sets(layout.pp, held, layout.recompute) * kept)
        total = sum(out.values())
        if total > best[0]:
            best = (total, out)
    return best


def gib(nbytes: float) -> str:
    """``31.2`` for a number of bytes in GiB (one decimal; integers without one)."""
    v = nbytes / GIB
    return f"{v:.0f}" if abs(v - round(v)) < 0.05 else f"{v:.1f}"
