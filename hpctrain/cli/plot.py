"""``hpctrain plot RUN``: loss (training and validation), throughput and, for a pipeline, its
schedule timeline, as PNG files.

RUN is a run directory of ``hpctrain train`` (or its ``metrics.jsonl``); without RUN the newest
directory under ``runs/`` is used. matplotlib is optional (``pip install matplotlib``, the extra ``plot``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help="run directory or metrics.jsonl (default: newest under runs/)")
    p.add_argument("--out", help="directory for the PNGs (default: the run directory)")


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The per-step records of a metrics JSON-lines file (lines without a step are skipped)."""
    from ..files.rundir import open_regular

    rows = []
    fd = open_regular(path)  # a FIFO or a device is refused (ConfigError, a ValueError), never opened to block
    if fd is None:
        raise FileNotFoundError(f"no metrics file at {path}")
    with os.fdopen(fd) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line: {exc}") from None
            if "step" in rec and "loss" in rec:
                rows.append(rec)
    return rows


def _smooth(values: list[float], width: int) -> list[float]:
    """Trailing moving average: per-step values are noisy (each is one batch)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= width:
            acc -= values[i - width]
        out.append(acc / min(i + 1, width))
    return out


def plot(run: str, out: str | None = None) -> list[str]:
    """Write ``loss.png`` (training loss, and the validation loss of ``--eval-every``),
    ``throughput.png`` and, when the run has a ``timeline.json`` (pipelines), ``timeline.png``
    for ``run``; return their paths."""
    metrics = run if os.path.isfile(run) else os.path.join(run, "metrics.jsonl")
    if not os.path.exists(metrics):
        raise FileNotFoundError(f"no metrics file at {metrics}: is {run} a run directory of hpctrain train?")
    rows = read_metrics(metrics)
    if not rows:
        raise ValueError(f"{metrics} holds no step records")
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display, on login and compute nodes
    import matplotlib.pyplot as plt

    out = out or os.path.dirname(os.path.abspath(metrics))
    os.makedirs(out, exist_ok=True)
    steps = [r["step"] for r in rows]
    width = max(1, len(rows) // 50)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    loss = [r["loss"] for r in rows]
    ax.plot(steps, loss, color="0.75", lw=0.8, label="per step")
    ax.plot(steps, _smooth(loss, width), color="C0", lw=1.8, label=f"training, mean of {width} steps")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:  # --eval-every: the held-out loss on the same axes
        ax.plot([v[0] for v in val], [v[1] for v in val], color="C3", lw=1.8, marker="o", ms=3, label="validation")
    ax.set(xlabel="step", ylabel="loss", title=f"loss: {os.path.basename(out)}")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out, "loss.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    rate = [r.get("samples_per_s") or 0.0 for r in rows]
    share = [100 * r["comm_seconds"] / r["seconds"] if r.get("seconds") else 0.0 for r in rows]
    ax.plot(steps, _smooth(rate, width), color="C1", lw=1.8)
    ax.set(xlabel="step", ylabel="samples/s", title=f"throughput: {os.path.basename(out)}")
    ax2 = ax.twinx()
    ax2.plot(steps, _smooth(share, width), color="C2", lw=1.2, ls="--")
    ax2.set_ylabel("communication, % of step time", color="C2")
    ax2.set_ylim(0, 100)
    fig.tight_layout()
    paths.append(os.path.join(out, "throughput.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    trace = os.path.join(os.path.dirname(os.path.abspath(metrics)), "timeline.json")
    if os.path.exists(trace):  # a pipeline run: its last step's executed schedule
        paths.append(plot_timeline(trace, os.path.join(out, "timeline.png")))
    return paths


def plot_timeline(trace: str, png: str) -> str:
    """Draw a pipeline's ``timeline.json`` (Chrome trace of forward/backward/wait per rank) to ``png``."""
    from ..parallel import timeline

    try:
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{trace} is not a schedule timeline: {exc}") from None
    by_rank: dict[int, list] = {}
    labels: dict[int, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            labels[int(e["pid"])] = str(e["args"]["name"])
        elif e.get("ph") == "X":
            t0 = float(e["ts"]) / 1e6
            by_rank.setdefault(int(e["pid"]), []).append((e["name"], e.get("cat", ""), t0, t0 + float(e["dur"]) / 1e6))
    if not by_rank:
        raise ValueError(f"{trace} holds no schedule events")
    return timeline.write_png(png, by_rank, labels)


def main(args: argparse.Namespace) -> int:
    run = args.run
    if run is None:
        runs = sorted(glob.glob(os.path.join("runs", "*", "metrics.jsonl")), key=os.path.getmtime)
        if not runs:
            print("hpctrain plot: no run given and no runs/*/metrics.jsonl here", file=sys.stderr)
            return 2
        run = os.path.dirname(runs[-1])
    try:
        for path in plot(run, args.out):
            print(path)
    except ImportError:
        print("hpctrain plot needs matplotlib: pip install matplotlib",
              file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"hpctrain plot: error: {exc}", file=sys.stderr)
        return 2
    return 0
