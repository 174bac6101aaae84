"""The planner's peak memory per rank: the engine's own accounting (``training.memory``, the
``memory`` block of ``summary.json``: params, grads, optimizer, buffers, activations_peak),
counted from the measured pieces instead of from arrays that exist.

- **params**: this rank's pieces (its pipeline stage), the split layers' share ``1/tp``; ZeRO-3
  keeps ``1/dp`` of them (the rest is gathered per unit: two units at once, a buffer).
- **grads**: as many as the parameters (they live in the dp buckets); ZeRO 2 and 3 keep the
  reduced ``1/dp`` piece (a unit's local gradient is a transient buffer).
- **optimizer**: ``Costs.optimizer_bytes_per_param`` per local parameter (AdamW: two float32
  moments), ``1/dp`` of it under any ZeRO stage.
- **buffers**: ZeRO 1's reduced piece of the gradients (``1/dp``); ZeRO 2's unit gradients,
  which backward makes faster than their reduce-scatters finish (their peak is near all of
  them: ``benchmarks/plan_check.py``); ZeRO 3's the same and two gathered units.
- **workspace**: what the layers' reuse pools keep beyond the activations (measured per piece
  by the ``MemoryMeter``), growing by half a set per micro-batch a pipeline stage holds beyond
  one; none in recomputed blocks, under any tp (``Recompute`` makes every layer inside its block
  transient, the tensor-parallel ones swapped in after wrapping too).
- **activations_peak**: each piece's measured activations at the micro-batch, times the
  micro-batches a stage holds at once (1F1B: ``min(m, pp - stage)``, GPipe: ``m``; without a
  pipeline one). With recompute a wrapped block keeps only its input, and one block's full
  activations exist again while it runs backward.
"""

from __future__ import annotations

from typing import Any

from .plan_costs import Costs, PieceCost

GIB = 1 << 30


def in_flight(schedule: str, stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches stage ``stage`` holds activations for at its peak (the schedule's own count:
    ``pipeline_schedules.peak_activations`` of its action list)."""
    from .pipeline_schedules import get_schedule, peak_activations

    if stages == 1:
        return 1
    return peak_activations(list(get_schedule(schedule)(stages, stage, microbatches)))


def stage_activations(pieces: list[PieceCost], samples: float, tp: int, recompute: bool) -> float:
    """Bytes one micro-batch of ``samples`` leaves in a stage of ``pieces`` for its backward, and
    the extra a recomputed block's backward re-creates (``(kept, transient)`` summed as the peak)."""
    kept, redo = 0.0, 0.0
    for p in pieces:
        full = p.activations(samples, tp)
        if recompute and p.recomputable:
            kept += p.input_per_sample * samples
            redo = max(redo, full)
        else:
            kept += full
    return kept, redo


def memory(layout: Any, costs: Costs, stages: list[list[PieceCost]], samples: float,
           schedule: str = "1f1b") -> tuple[int, dict[str, int]]:
    """``(peak bytes of the rank that holds most, {category: bytes} of that rank)``."""
    best: tuple[int, dict[str, int]] = (-1, {})
    dp, tp, z = layout.dp, layout.tp, layout.zero
    for s, pieces in enumerate(stages):
        local = sum(p.local_params(tp, layout.ep) for p in pieces)
        # A unit's share on this tp rank: the piece's split applies to its units alike.
        big = max((p.largest_unit * p.local_params(tp, layout.ep) // p.params * costs.itemsize
                   for p in pieces if p.params), default=0)
        nbytes = local * costs.itemsize
        shard = -(-nbytes // dp)
        out = {"params": shard if z == 3 else nbytes,
               "grads": shard if z >= 2 else nbytes,
               "optimizer": int(local * costs.optimizer_bytes_per_param / (dp if z else 1)),
               "buffers": {0: 0, 1: shard, 2: nbytes, 3: nbytes + 2 * big}[z] if dp > 1 or z == 1 else 0}
        kept, redo = stage_activations(pieces, samples, tp, layout.recompute)
        held = in_flight(schedule, layout.pp, s, layout.microbatches)
        out["activations_peak"] = int(held * kept + redo)
        # The reuse pools are per layer: micro-batches in flight keep some of their arrays out of
        # them, so a pipeline stage's pools grow with the micro-batches it holds (by about half a
        # set each: plan_check measured 1.8-3x at 2-4 held, the MLP less than the GPT). A
        # recomputed block keeps none (nn.buffers.transient), its tensor-parallel layers included.
        out["workspace"] = int((held + 1) / 2 * sum(p.workspace(samples, tp) for p in pieces
                                                    if not (layout.recompute and p.recomputable)))
        total = sum(out.values())
        if total > best[0]:
            best = (total, out)
    return best


def gib(nbytes: float) -> str:
    """``31.2`` for a number of bytes in GiB (one decimal; integers without one)."""
    v = nbytes / GIB
    return f"{v:.0f}" if abs(v - round(v)) < 0.05 else f"{v:.1f}"
