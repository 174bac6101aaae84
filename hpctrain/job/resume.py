"""What a run directory holds decides what a job may do there, and a resume continues the run it
finds: the settings it must share (:data:`RESUME_KEYS`), rank 0's claim on the directory before
anything is written (:func:`claim`), ``config.json`` written back once the state is settled
(:class:`AfterResume`: what a resume changed stays for the next one), and the command that
continues a run (:func:`resume_command`), which every message suggesting one prints.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ConfigError
from ..files import rundir
from ..log import get_logger
from ..protocols import TrainerView
from .options import Config, flag

_log = get_logger("train")


def resume_command(run_dir: str, ranks: int = 1) -> str:
    """The command that continues the run in ``run_dir`` (its config.json has every setting)."""
    import shlex

    launch = f"mpiexec -n {ranks} " if ranks > 1 else ""
    return f"{launch}hpctrain train --run-dir {shlex.quote(run_dir)} --resume"


def describe_changes(changed: dict[str, tuple[Any, Any]]) -> str:
    """``; this job changes --lr 0.003 -> 0.001, ...`` (kept in config.json for the next resume)."""
    if not changed:
        return " (no setting changed)"
    return "; this job changes " + ", ".join(f"{flag(k)} {a!r} -> {b!r}" for k, (a, b) in changed.items()) \
        + " (kept for the next resume)"


#: Settings a resumed run must share with the run it continues (the model, its data, its optimizer
#: state, the data order): anything else (epochs, layout, cadence) may change across a resume.
RESUME_KEYS = ("model", "data", "d_model", "n_layers", "n_heads", "block_size", "optimizer", "seed",
               "max_samples", "val_fraction", "moe_experts", "moe_top_k", "moe_every")


def claim(c: Config, given: dict[str, Any], metrics: str, ckpt_lock: rundir.RunLock | None) -> None:
    """Rank 0, holding the locks: clean up after dead jobs and decide what may happen to the files
    already in the run directory, before anything is written there."""
    from . import ending

    rundir.clean_stale_temporaries(c.run_dir, c.checkpoint_dir)
    # The directory's own files, before anything reads, appends to or moves them: a FIFO or a
    # device there would hang rank 0 in an open (or read forever) while the others wait.
    rundir.check_files(c.run_dir, {ending.RECORD: rundir.MAX_RECORD, "config.json": rundir.MAX_RECORD,
                                   ending.SUMMARY: rundir.MAX_RECORD, os.path.basename(metrics): None,
                                   "trace.json": None})
    if c.restart:
        moved = rundir.set_aside(c.checkpoint_dir, metrics, os.path.join(c.run_dir, "trace.json"))
        for old, new in moved:
            if ckpt_lock is not None and old == c.checkpoint_dir:  # its lock file went along
                ckpt_lock.moved(new)
        if moved:
            _log.info("started over (--restart): moved %s", ", ".join(f"{a} to {b}" for a, b in moved))
    else:
        check_claim(c, given)


def check_claim(c: Config, given: dict[str, Any]) -> None:
    """What :func:`claim` refuses in a run directory, checked without touching anything (a dry
    run asks it too): a resume of a run made with other settings (``RESUME_KEYS``), or a fresh
    start where checkpoints already are. ``c.checkpoint_dir`` is the job's (filled in)."""
    from .. import checkpoint

    if c.restart or c.run_dir is None:
        return
    if c.resume:
        rundir.check_resume_compatible(os.path.join(c.run_dir, "config.json"), given, RESUME_KEYS)
    elif checkpoint.list_checkpoints(c.checkpoint_dir):
        raise ConfigError(f"{c.checkpoint_dir} already holds checkpoints: pass --resume to continue that run ("
                          f"{resume_command(c.run_dir)} continues it as it was); to start it over, add --restart to "
                          f"this command (its files are moved aside); or choose another --run-dir")


class AfterResume:
    """A ``fit`` callback for the moment the run's state is settled (resumed, or fresh): rank 0
    says how the last job in the run directory ended and records this one as running
    (``job.ending``), writes ``config.json`` and drops the metrics lines an interrupted job wrote
    after its last checkpoint (the resumed job makes those steps again). A refused resume leaves
    all of them as they were."""

    def __init__(self, rank: int, config_file: str, config: dict[str, Any], metrics: str, size: int = 1) -> None:
        self.rank, self.config_file, self.config, self.metrics = rank, config_file, config, metrics
        self.size = size

    def on_fit_start(self, trainer: TrainerView) -> None:
        from . import ending

        run_dir = os.path.dirname(self.config_file) or "."
        ending.started(run_dir)  # (every rank: whoever speaks for the job at its end records how)
        if self.rank == 0:
            ending.start(run_dir, self.size)
            rundir.write_exclusive(self.config_file, json.dumps(self.config, indent=1))
            rundir.trim_metrics(self.metrics, trainer.global_step)
