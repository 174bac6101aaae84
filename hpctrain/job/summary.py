"""The closing report of ``hpctrain train``: the figures of ``summary.json`` read from the run's
metrics and history, written as valid JSON, and said in a few aligned lines."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

from ..protocols import Comm, Fittable
from .config import layout_text


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON has no NaN or inf)."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


#: Steps the summary's final training loss averages: recent enough to say where training ended,
#: long enough to smooth one batch's noise.
FINAL_LOSS_STEPS = 50


def final_loss(path: str) -> tuple[float | None, int]:
    """Mean training loss of the last ``FINAL_LOSS_STEPS`` steps in ``metrics.jsonl`` (skipped
    steps left out), and how many it averaged: over the whole run (this job and the ones it
    resumed), so a resumed job that made only a few steps itself still reports a full window."""
    from ..files.rundir import open_regular

    recent: list[float] = []
    fd = open_regular(path)  # (checked when the job claimed its directory: never a FIFO's blocking open)
    if fd is None:
        return None, 0
    with os.fdopen(fd) as f:
        for line in f:
            rec = json.loads(line)
            if not rec.get("skipped"):
                recent = [*recent[1 - FINAL_LOSS_STEPS :], rec["loss"]]
    return (sum(recent) / len(recent) if recent else None), len(recent)


def steady_rates(history: Sequence[Any]) -> tuple[float | None, float | None]:
    """Samples per second and the communication share of step time over this job's steps after
    its first (the warm-up: first calls, buffers, connections); ``None`` without such steps."""
    steady = history[1:]
    seconds = sum(s.seconds for s in steady)
    if seconds <= 0:
        return None, None
    return sum(s.samples for s in steady) / seconds, sum(s.comm_seconds for s in steady) / seconds


def build(c: Any, trainer: Fittable, n_params: int, device: str, history: Sequence[Any], result: dict[str, Any],
          wall: float, memory: Any, metrics: str, trace: str, comm: Comm) -> dict[str, Any]:
    """The run's summary (``summary.json``) of the job configured by ``c``, the same on every rank."""
    rate, share = steady_rates(history)
    # The recent loss from the metrics of the whole run: a resumed job made only part of those
    # steps itself. One reader, one value for every rank.
    loss, loss_steps = comm.bcast_obj(final_loss(metrics) if comm.rank == 0 else None)
    return {
        "model": c.model, "parameters": n_params, "strategy": c.strategy, "device": device,
        # cp and ep where they are not 1 (as grid.sizes: a layout without them reads as before)
        "layout": {"dp": c.dp, "tp": c.tp, "pp": c.pp, **({"cp": c.cp, "cp_mode": c.cp_mode} if c.cp > 1 else {}),
                   **({"ep": c.ep} if c.ep > 1 else {})},
        "zero": c.zero, "steps": trainer.global_step,
        "steps_this_run": len(history), "epochs": c.epochs,
        "final_loss": loss, "final_loss_steps": loss_steps,
        "val_loss": result["loss"], "val_accuracy": result["accuracy"], "val_samples": result["samples"],
        "samples_per_s": rate, "comm_share": share,
        "wall_seconds": wall, "checkpoint": trainer.last_checkpoint,
        "run_dir": c.run_dir, "metrics": metrics, "trace": trace, "memory": memory,
        "rank_loss": trainer.rank_loss.events if trainer.rank_loss is not None else [],
        **({"moe": moe_figures(history)} if c.moe_experts else {}),
    }


def moe_figures(history: Sequence[Any]) -> dict[str, Any]:
    """The MoE layers' figures of this job's last step (``None`` before any): the load-balancing
    term and the busiest expert's share of the tokens over the mean (1: balanced)."""
    extra = history[-1].extra if history else {}
    return {"aux_loss": extra.get("moe_aux_loss"), "max_share": extra.get("moe_max_share")}


def format_summary(s: dict[str, Any]) -> str:
    """The closing report of a run, a few aligned lines."""
    lay = s["layout"]
    layout = layout_text(lay["dp"], lay["tp"], lay["pp"], s.get("zero"), lay.get("cp", 1), lay.get("cp_mode", "ring"),
                         lay.get("ep", 1))
    final = "-" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
    rate = "-" if s["samples_per_s"] is None else f"{s['samples_per_s']:,.0f} samples/s"
    share = "-" if s["comm_share"] is None else f"{100 * s['comm_share']:.0f}% of step time"
    lines = [
        f"done: {s['steps_this_run']} steps ({s['steps']} in total) in {s['wall_seconds']:.1f} s, "
        f"{s['strategy']} {layout}",
        f"  final loss      {final} (training, mean of the last {s.get('final_loss_steps', 0)} steps)",
        f"  validation      loss {s['val_loss']:.4f}"
        + ("" if s["val_accuracy"] is None else f", accuracy {100 * s['val_accuracy']:.1f}%")
        + f" ({s['val_samples']:,} held-out samples)",
        f"  throughput      {rate} (the first step, a warm-up, left out)",
        f"  communication   {share}",
        *([f"  memory          {s['memory']['total'] / 2**20:,.1f} MiB per rank at most (params "
           f"{s['memory']['params'] / 2**20:,.1f}, grads {s['memory']['grads'] / 2**20:,.1f}, optimizer "
           f"{s['memory']['optimizer'] / 2**20:,.1f}, activations {s['memory']['activations_peak'] / 2**20:,.1f}; "
           f"peak RSS {s['memory']['rss_peak'] / 2**20:,.0f}"
           + (f"; GPU pool peak {s['memory']['device_pool_peak'] / 2**20:,.0f}"
              if s["memory"].get("device_pool_peak") else "") + ")"] if s.get("memory") else []),
        *([f"  experts         busiest {s['moe']['max_share']:.2f}x the mean share of tokens, load-balancing term "
           f"{s['moe']['aux_loss']:.4f} (last step)"] if (s.get("moe") or {}).get("max_share") is not None else []),
        f"  checkpoint      {s['checkpoint'] or '-'}",
        f"  metrics         {s['metrics']}  (hpctrain plot {s['run_dir']})",
        f"  trace           {s['trace']}  (open in https://ui.perfetto.dev)",
    ]
    return "\n".join(lines)
