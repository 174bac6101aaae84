"""The executed pipeline schedule as a picture: Chrome trace JSON (Perfetto) and a PNG.

Events are ``(name, category, start_seconds, end_seconds)`` tuples relative to the start of a
step's schedule; ``category`` is "forward", "backward" or "wait". PNG output needs matplotlib
(the optional ``plot`` extra); JSON needs nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

Event = tuple[str, str, float, float]

_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "wait": "#d0d0d0"}


def chrome_trace(events_by_rank: dict[int, list[Event]], labels: dict[int, str] | None = None) -> dict[str, Any]:
    """A Chrome trace (``{"traceEvents": [...]}``, open it in https://ui.perfetto.dev).

    One process row per rank; complete ("X") events with microsecond times.
    """
    out: list[dict[str, Any]] = []
    for rank, events in sorted(events_by_rank.items()):
        label = (labels or {}).get(rank, f"rank {rank}")
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": label}})
        for name, cat, t0, t1 in events:
            out.append({
                "name": name, "cat": cat, "ph": "X", "pid": rank, "tid": 0,
                "ts": round(t0 * 1e6, 3), "dur": round(max(t1 - t0, 0.0) * 1e6, 3),
            })  # fmt: skip
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_json(path: str, events_by_rank: dict[int, list[Event]], labels: dict[int, str] | None = None) -> str:
    """Write ``chrome_trace(...)`` to ``path``; returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(chrome_trace(events_by_rank, labels), fh)
    return path


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_png(path: str, events_by_rank: dict[int, list[Event]], labels: dict[int, str] | None = None) -> str:
    """Draw one row per rank (forward blue, backward orange, waiting grey) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(events_by_rank)
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.2))
    for row, rank in enumerate(ranks):
        for name, cat, t0, t1 in events_by_rank[rank]:
            ax.barh(row, (t1 - t0) * 1e3, left=t0 * 1e3, color=_COLORS.get(cat, "#888888"), edgecolor="white")
            if cat != "wait" and (t1 - t0) > 0:
                ax.text((t0 + t1) / 2 * 1e3, row, name, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)), [(labels or {}).get(r, f"rank {r}") for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's schedule started")
    ax.set_title("pipeline schedule as executed (blue: forward, orange: backward, grey: waiting)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
