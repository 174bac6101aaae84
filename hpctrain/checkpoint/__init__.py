"""HDF5 checkpoints of a whole training state: parallel, optionally asynchronous writes,
transactional loads, loadable under another layout, verified before use.

``save(path, trainer)`` writes parameters and optimizer state as full tensors under their serial
names (every rank writes the pieces it owns to its own part file; see :mod:`.format`), with the
trainer's own state (counters, RNG states, sampler position), configuration and layout.
``load(path, trainer)`` restores it under any layout (dp, tp, pp, tp x pp, flat ZeRO ranges) or
changes nothing. ``save_in``/``load_latest`` manage a directory of ``ckpt-<step>.h5`` files.

Each trainer holds a :class:`Checkpointer` (``trainer.checkpointer``): its background save in
flight, its snapshot buffers and its private communicator. The trainer's state is saved and
restored only through the ``hpctrain.protocols.Stateful`` protocol.

Modules: :mod:`.format` (names, index, checksums), :mod:`.checkpointer` (``save``, ``wait``),
:mod:`.saving` (the plan and the parallel, asynchronous writes), :mod:`.header` (the index file),
:mod:`.reader` (verified slab reads), :mod:`.loading` (the transaction), :mod:`.inspection`
(``inspect``), :mod:`.seal` (whole-file digests, verified before HDF5 reads a file).
"""

from __future__ import annotations

import os
import re

from ..errors import CheckpointError
from ..log import get_logger
from ..protocols import Checkpointable
from . import seal
from .checkpointer import Checkpointer, checkpointer_of, save, wait
from .format import (
    _NAME,
    FORMAT,
    FORMAT_VERSION,
    checkpoint_path,
    checkpoints_of,
    list_checkpoints,
    norm_index,
    step_of,
)
from .header import read_header
from .inspection import inspect, verify
from .loading import load, load_weights
from .saving import busy, remove

__all__ = [
    "Checkpointer", "FORMAT", "FORMAT_VERSION", "beyond_keep", "checkpoint_path", "checkpointer_of", "checkpoints_of",
    "copy", "inspect",
    "list_checkpoints", "load", "load_latest", "load_weights", "read_header", "remove", "save", "save_in", "set_aside",
    "step_of", "verify", "wait",
]

_log = get_logger("checkpoint")
_norm_index = norm_index  # the name tests and older callers use


def save_in(directory: str, trainer: Checkpointable, keep: int = 3, *, asynchronous: bool = False) -> str:
    """Save as ``ckpt-<step>.h5`` in ``directory``; once it is committed (for an asynchronous save:
    when a later call commits it), delete what :func:`beyond_keep` names and the part files of
    interrupted saves. A checkpoint :func:`load_latest` skipped at that name (damaged, another
    run's) is first moved aside, whole, into ``<name>.skipped-<date>-<time>/`` beside it: never
    written over. Collective."""
    from ..comm.validate import raise_if_any

    path = checkpoint_path(directory, trainer.global_step)
    skipped = checkpointer_of(trainer).skipped
    if path in skipped:
        comm, moved, problem = trainer.comm, None, None
        if comm.rank == 0:
            try:
                moved = set_aside(path)
            except OSError as exc:
                problem = CheckpointError(f"cannot move {path}, which the resume skipped, aside before writing "
                                          f"step {trainer.global_step} over its name: {exc}")
        raise_if_any(comm, problem)
        del skipped[path]
        if moved is not None and comm.rank == 0:
            _log.warning("moved %s, which the resume skipped, aside to %s/ before writing step %d at its name "
                         "(nothing was deleted)", path, moved, trainer.global_step)

    def clean() -> None:
        for old in beyond_keep(directory, path, keep):
            remove(old)
        _remove_orphans(directory)

    return save(path, trainer, asynchronous=asynchronous, after=clean)


def set_aside(path: str) -> str | None:
    """Move the checkpoint ``path`` (its index file and every part directory of its name) into a
    new directory ``<path>.skipped-<date>-<time>`` beside it, where it stays loadable; returns
    that directory (``None`` when nothing is at ``path`` any more). Not collective."""
    import time

    from .format import PARTS_SUFFIX

    if not os.path.lexists(path):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = f"{path}.skipped-{stamp}", 1
    while True:
        try:
            os.mkdir(target)
            break
        except FileExistsError:
            n += 1
            target = f"{path}.skipped-{stamp}-{n}"
    where, base = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    for name in os.listdir(where):
        if name.startswith(base + ".") and name.endswith(PARTS_SUFFIX) and not busy(os.path.join(where, name)):
            os.rename(os.path.join(where, name), os.path.join(target, name))
    os.rename(path, os.path.join(target, base))
    return target


def beyond_keep(directory: str, committed: str, keep: int) -> list[str]:
    """The checkpoints ``keep`` removes from ``directory`` once ``committed`` is on disk: the older
    ones beyond the newest ``keep`` (``committed`` included; 0 keeps all).

    Only committed checkpoints count (index files renamed into place; the temporaries and part
    directories of saves in flight never do), whichever job wrote them, so a resumed or requeued
    run keeps ``keep`` in all. Newer ones than ``committed`` are left alone and not counted: a
    resume skipped them (damaged, or not this run's), so deleting them is not this save's call.
    """
    if keep <= 0:
        return []
    step = step_of(committed)
    older = [p for p in list_checkpoints(directory) if step_of(p) < step]
    return older[:max(0, len(older) - (keep - 1))]


def _remove_orphans(directory: str) -> None:
    """Part directories no index file in ``directory`` refers to (a save killed before its
    commit, or a checkpoint deleted by hand). Called right after this job committed a save, when
    none of its own is in flight."""
    import shutil

    from .format import PARTS_SUFFIX

    used = set()
    for p in list_checkpoints(directory):
        try:
            used.add(seal.parts_dir(p))  # from the seal: no HDF5 read of a file that may be damaged
        except Exception:  # unreadable: keep whatever it might refer to
            return
    for n in os.listdir(directory):
        if busy(os.path.join(directory, n)):  # a background save is writing it
            continue
        if n.endswith(PARTS_SUFFIX) and _NAME.fullmatch(n.split(".h5.", 1)[0] + ".h5") and n not in used:
            shutil.rmtree(os.path.join(directory, n), ignore_errors=True)


def copy(src: str, dst: str) -> str:
    """Copy the checkpoint ``src`` (its index file and part files) to ``dst``, a directory or a
    file name; returns the new index file's path. Not collective."""
    import shutil

    if os.path.isdir(dst):
        dst = os.path.join(dst, os.path.basename(src))
    parts = seal.parts_dir(src)
    if parts:
        target = os.path.join(os.path.dirname(os.path.abspath(dst)), str(parts))
        if os.path.abspath(target) != os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(src)), parts)):
            shutil.copytree(os.path.join(os.path.dirname(os.path.abspath(src)), str(parts)), target)
    shutil.copy(src, dst)
    return dst


def _as_it(text: str, path: str) -> str:
    """``text`` with the checkpoint ``path`` said as "it" where it names that file, not where it
    begins a longer path (its part directory ``PATH.<token>.parts/...``, kept whole)."""
    whole = rf"(?<![\w./-]){re.escape(path)}(?![\w/-]|\.\w)"
    text = re.sub(rf"checkpoint {whole}: ", "", text)
    return re.sub(whole, "it", re.sub(rf"checkpoint {whole}", "it", text))


def load_latest(directory: str, trainer: Checkpointable) -> str | None:
    """Load the newest checkpoint in ``directory`` that loads; ``None`` if there is none at all.

    A newest file that fails (say, the job died while the disk was failing) is skipped, logged on
    rank 0 with the reason, and the one before it is tried; the trainer is unchanged by every
    failed attempt. When checkpoints exist and none loads, a ``CheckpointError`` names each file
    and why; its ``failures`` attribute holds ``[(path, reason), ...]``, newest first.
    """
    comm = trainer.comm
    candidates = comm.bcast_obj(list_checkpoints(directory) if comm.rank == 0 else None)
    failures: list[tuple[str, str]] = []
    skipped = checkpointer_of(trainer).skipped
    skipped.clear()
    for path in reversed(candidates):
        try:
            load(path, trainer)
        except (CheckpointError, FileNotFoundError) as exc:
            failures.append((path, str(exc)))
            skipped[path] = str(exc)
            if comm.rank == 0:
                _log.warning("skipping checkpoint %s: %s", path, exc)
            continue
        if failures and comm.rank == 0:
            _log.warning("fell back to checkpoint %s (%d newer one(s) failed)", path, len(failures))
        return path
    if not failures:
        return None
    # One reason said once for every file it refuses (another seed, another model), naming them.
    by_why: dict[str, list[str]] = {}
    for p, why in failures:
        why = _as_it(why, p)
        by_why.setdefault(why, []).append(os.path.basename(p))
    err = CheckpointError(f"no checkpoint in {directory} loads: "
                          + "; ".join(f"{', '.join(names)}: {why}" for why, names in by_why.items()))
    err.failures = failures  # type: ignore[attr-defined]
    raise err
