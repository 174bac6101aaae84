"""A ``fit`` callback that records every step's wall-clock span for a Chrome/Perfetto trace."""

from __future__ import annotations

import json
import time
from typing import Any


class Timeline:
    """Wall-clock span of every step on this rank, written as one Chrome trace for all ranks.

    Attach with ``trainer.fit(..., callbacks=[timeline])``. A step's span ends when
    ``on_step_end`` runs and lasts ``stats.seconds``. The communication span is drawn at the end
    of the step (its total, not its true position: strategies report only the sum).
    """

    def __init__(self, rank: int) -> None:
        self.events: list[dict[str, Any]] = []
        self.rank = rank

    def on_step_end(self, trainer: Any, stats: Any) -> None:
        t1 = time.time()
        self._add(f"step {trainer.global_step}", t1 - stats.seconds, stats.seconds, {"loss": stats.loss})
        if stats.comm_seconds:
            self._add("communication", t1 - stats.comm_seconds, stats.comm_seconds, {}, tid=1)

    def _add(self, name: str, start: float, dur: float, args: dict, tid: int = 0) -> None:
        self.events.append({"name": name, "ph": "X", "ts": start * 1e6, "dur": dur * 1e6, "pid": self.rank,
                            "tid": tid, "args": args})

    def write(self, comm: Any, path: str) -> None:
        """Collective: rank 0 writes every rank's events (one process lane per rank)."""
        lanes = comm.gather_obj(self.events)
        if comm.rank != 0:
            return
        events = []
        for rank, evs in enumerate(lanes):
            events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
            events += evs
        from ..rundir import write_exclusive

        write_exclusive(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
