"""``hpctrain train --dry-run``: everything a run needs, tried once, then what the full run would do.

The data opened and checked, the model and the trainer built under the layout, one training step
on the first batch, one evaluation on a batch of held-out rows (of a model loaded from a
checkpoint, as the final evaluation does), and a checkpoint written and loaded back (in a
temporary directory beside the run directory, removed afterwards; the parameters must come back
bitwise). With ``--resume`` the run's newest checkpoint is loaded first. Nothing is written to the
run directory: no lock, no config.json, no metrics. Like Lightning's ``fast_dev_run``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .options import Config


def dry_run(c: Config, comm: Any, setup: Any, everywhere: Any) -> dict[str, Any]:
    """Try once the run ``c`` describes, built as ``setup`` (the runner's build phase), collective;
    returns and prints (rank 0) what happened. ``everywhere`` is the runner's: a call on some ranks
    whose failure every rank raises."""
    from .. import checkpoint

    trainer, loader = setup.trainer, setup.loader
    run_dir = c.run_dir or os.path.join("runs", "<date>-<time>")
    ckpt_dir = c.checkpoint_dir or os.path.join(run_dir, "checkpoints")
    resumed = None
    if c.resume and c.run_dir is not None and os.path.isdir(ckpt_dir):
        resumed = checkpoint.load_latest(ckpt_dir, trainer)
    start = trainer.global_step
    batch = next(iter(loader))
    t0 = time.perf_counter()
    stats = trainer.step(*batch)
    step_s = time.perf_counter() - t0
    scratch = comm.bcast_obj(everywhere(comm, lambda: _scratch(run_dir) if comm.rank == 0 else None))
    try:
        size, held_out, again_s = _round_trip(c, comm, setup,
                                              checkpoint.checkpoint_path(scratch, trainer.global_step), batch, scratch)
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    report = {"step_loss": float(stats.loss), "step_seconds": step_s, "second_step_seconds": again_s,
              "checkpoint_bytes": size, "val_loss": held_out["loss"], "val_samples": held_out["samples"],
              "resumed_from": resumed, "steps_per_epoch": len(loader), "start": start,
              "set_aside": len(checkpoint.list_checkpoints(ckpt_dir)) if c.run_dir is not None else 0}
    if comm.rank == 0:
        print(_text(c, setup, report, run_dir, ckpt_dir), flush=True)
    trainer.close()
    return {"dry_run": report}


def _round_trip(c: Config, comm: Any, setup: Any, path: str, batch: tuple, scratch: str) -> tuple[int, dict, float]:
    """Save the trainer, take another step, load it back: the parameters must be the saved ones,
    bitwise. Then the final evaluation's path on one batch of held-out rows. Returns the
    checkpoint's bytes, the evaluation and the seconds of that second step (warmed up)."""
    from .. import checkpoint
    from ..backend import to_host
    from ..comm.validate import raise_if_any

    trainer = setup.trainer
    saved = [to_host(p.data).copy() for p in trainer.params]
    checkpoint.save(path, trainer)
    t0 = time.perf_counter()
    trainer.step(*batch)  # moves the parameters: the load must put the saved ones back
    again_s = time.perf_counter() - t0
    checkpoint.load(path, trainer)
    same = all(np.array_equal(a, to_host(p.data)) for a, p in zip(saved, trainer.params))
    raise_if_any(comm, None if same else CheckpointError(
        f"a checkpoint written and loaded back ({path}) did not restore the parameters"))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(scratch) for f in files)
    return size, _evaluate_one_batch(c, comm, setup, path), again_s


def _scratch(run_dir: str) -> str:
    """A temporary directory beside the run directory (the file system the run will write to)."""
    parent = os.path.dirname(os.path.abspath(run_dir))
    base = parent if os.path.isdir(parent) else os.getcwd()
    return tempfile.mkdtemp(prefix=".hpctrain-dry-run-", dir=base)


def _evaluate_one_batch(c: Config, comm: Any, setup: Any, path: str) -> dict[str, Any]:
    """The final evaluation's path on one batch of held-out rows: a fresh serial model loads the
    checkpoint (checksums verified) and evaluates them (collective)."""
    from .. import checkpoint
    from ..data.checks import Rows
    from ..training.evaluation import evaluate
    from .builders import build_loss, build_model

    fresh = build_model(c, setup.meta)
    checkpoint.load_weights(path, fresh)
    rows = Rows(setup.val_set, 0, min(len(setup.val_set), c.batch_size))
    return evaluate(fresh, rows, build_loss(c), comm=comm)


def _text(c: Config, setup: Any, r: dict[str, Any], run_dir: str, ckpt_dir: str) -> str:
    from ..training.trainer import planned_steps

    total = planned_steps(setup.loader, c.epochs, c.max_steps)
    left = max(0, total - r["start"])
    start = f"resume from {r['resumed_from']} (it loads) at step {r['start']}" if r["resumed_from"] else "start fresh"
    if c.restart and r["set_aside"]:  # (without --restart, checkpoints there were refused before the dry run)
        start = f"start over ({r['set_aside']} checkpoint(s) in {ckpt_dir} moved aside with metrics.jsonl)"
    every = c.checkpoint_every or r["steps_per_epoch"]
    return "\n".join([
        "dry run: the data, the model and the trainer build; one step, one evaluation and a checkpoint round trip "
        "work; nothing was written to the run directory",
        f"  one step        loss {r['step_loss']:.4f} in {r['step_seconds'] * 1e3:.0f} ms (it warms up; a second "
        f"step took {r['second_step_seconds'] * 1e3:.0f} ms)",
        f"  one evaluation  loss {r['val_loss']:.4f} on {r['val_samples']} held-out samples (of "
        f"{len(setup.val_set):,}) of a model loaded from the checkpoint",
        f"  checkpoint      {r['checkpoint_bytes'] / 2**20:.1f} MiB written and loaded back bitwise",
        f"a full run would: {start}, train {left:,} step(s) to step {total:,} ({c.epochs} epoch(s) of "
        f"{r['steps_per_epoch']:,} steps" + (f", --max-steps {c.max_steps}" if c.max_steps else "") + "), "
        f"about {left * r['second_step_seconds']:.0f} s at the second step's time",
        f"  write           {run_dir}: config.json, metrics.jsonl, trace.json, summary.json; checkpoints every "
        f"{every} steps in {ckpt_dir} (keep {c.keep or 'all'})",
        f"  evaluate        the final checkpoint on {len(setup.val_set):,} held-out samples",
        "  run it          the same command without --dry-run",
    ])
