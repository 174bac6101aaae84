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
        """Collective: rank 0 adds every rank's events (one process lane per rank) to the trace at
        ``path``, after those of the run's earlier jobs (a resumed run shows all its jobs)."""
        lanes = comm.gather_obj(self.events)
        if comm.rank != 0:
            return
        events = earlier_events(path)
        named = {e.get("pid") for e in events if e.get("name") == "process_name"}
        for rank, evs in enumerate(lanes):
            if rank not in named:
                events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
            events += evs
        from ..files.rundir import write_exclusive

        write_exclusive(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def earlier_events(path: str) -> list[dict[str, Any]]:
    """The events of the trace at ``path`` (none when there is no file). A file that is not such a
    trace is moved aside, said so, and not continued: it is never overwritten."""
    from ..files import rundir
    from ..log import get_logger

    try:
        with open(path) as f:
            events = json.load(f).get("traceEvents")
        if isinstance(events, list) and all(isinstance(e, dict) for e in events):
            return events
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError):
        pass
    moved = rundir.set_aside(path)
    get_logger("train").warning("%s is not a trace this run wrote: moved to %s; starting a new one", path,
                                moved[0][1] if moved else "(gone)")
    return []
