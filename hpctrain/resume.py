"""Which checkpoint a resumed run continues from, and what it says about it.

``load_newest(directory, trainer)`` tries the checkpoints of ``directory`` newest first:

* none there (or no directory): returns ``None`` and logs that the run starts fresh;
* the newest loads: returns its path;
* the newest fails, an older one loads: logs, naming the bad file(s) and why, which one it fell
  back to, and returns that path;
* all fail: raises ``CheckpointError`` naming every file and why. Nothing is deleted: starting
  over is a decision the user makes (``hpctrain train --restart``), never a silent fallback.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import CheckpointError
from .log import get_logger

log = get_logger("resume")


def load_newest(directory: str, trainer: Any) -> str | None:
    """Load the newest checkpoint of ``directory`` that loads (collective); see the module doc."""
    from . import checkpoint

    comm = trainer.comm
    found = comm.bcast_obj(checkpoint.list_checkpoints(directory) if comm.rank == 0 else None)
    if not found:
        if comm.rank == 0:
            what = "is empty" if os.path.isdir(directory) else "does not exist"
            log.info("no checkpoint to resume from (%s %s): starting fresh", directory, what)
        return None
    failed: list[tuple[str, str]] = []
    for path in reversed(found):
        try:
            checkpoint.load(path, trainer)
        except (CheckpointError, FileNotFoundError) as exc:  # the same verdict on every rank
            failed.append((path, str(exc)))
            continue
        if failed and comm.rank == 0:
            log.warning("%s; resuming from the previous good checkpoint %s instead",
                        "; ".join(f"cannot resume from {p}: {why}" for p, why in failed), path)
        return path
    lines = "\n".join(f"  {os.path.basename(p)}: {why}" for p, why in failed)
    raise CheckpointError(
        f"cannot resume: none of the {len(found)} checkpoint(s) in {directory} loads:\n{lines}\n"
        f"(nothing was changed or deleted; pass --restart to start over in this run directory)"
    )
