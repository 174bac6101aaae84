"""``hpctrain plot RUN``: loss and throughput curves of a run as PNG files.

RUN is a run directory of ``hpctrain train`` (or its ``metrics.jsonl``); without RUN the newest
directory under ``runs/`` is used. matplotlib is optional (``pip install 'hpctrain[plot]'``).
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
    rows = []
    with open(path) as f:
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
    """Write ``loss.png`` and ``throughput.png`` for ``run``; return their paths."""
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
    ax.plot(steps, _smooth(loss, width), color="C0", lw=1.8, label=f"mean of {width} steps")
    ax.set(xlabel="step", ylabel="training loss (global batch)", title=f"loss: {os.path.basename(out)}")
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
    return paths


def main(args: argparse.Namespace) -> int:
    run = args.run
    if run is None:
        runs = sorted(glob.glob(os.path.join("runs", "*", "metrics.jsonl")), key=os.path.getmtime)
        if not runs:
            print("hpctrain plot: no run given and no runs/*/metrics.jsonl here", file=sys.stderr)
            return 2
        run = os.path.dirname(runs[-1])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("hpctrain plot needs matplotlib: pip install matplotlib (or the extra: pip install 'hpctrain[plot]')",
              file=sys.stderr)
        return 1
    try:
        for path in plot(run, args.out):
            print(path)
    except (OSError, ValueError) as exc:
        print(f"hpctrain plot: error: {exc}", file=sys.stderr)
        return 2
    return 0
