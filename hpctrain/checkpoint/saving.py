"""Saving: every rank writes the slabs it owns to its own part file, in parallel, optionally in
the background.

The plan is computed identically on every rank from one ``allgather`` of what each holds: each
distinct piece of a tensor is written once; a piece held by several ranks (data-parallel
replicas) is split along its first axis among them, so every rank writes a share and save
bandwidth grows with the job. Rank 0 then writes the index file (header, piece table with one
checksum per slab, small state arrays, virtual datasets) under a temporary name and renames it
into place: that rename is the commit. A failure anywhere removes the part files and the
temporary and raises the same ``CheckpointError`` on every rank; earlier checkpoints are untouched.

``asynchronous=True`` takes a host snapshot of this rank's slabs at the call (the only stall) and
writes this rank's part file in a background thread while training goes on; the thread makes no
MPI call (MPI's lock would hold up the training's collectives). The next save, load or ``wait``
(collective) joins the thread and commits: the ranks agree on a private duplicate communicator
(made once, when the trainer's :class:`~.checkpointer.Checkpointer` is set up) and rank 0 writes
the index. So an asynchronous checkpoint appears on disk at that next call. Every wait of a save is watched by the stall
watchdog with the job's timeout: a rank that stops while it saves ends the job with a report
naming it, and the previous checkpoint stays as it was (the timeout must exceed the slowest
rank's write).
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import __version__
from ..errors import CheckpointError
from ..log import get_logger
from ..protocols import Checkpointable, Comm
from . import format as fmt
from . import rawio, seal

_log = get_logger("checkpoint")

#: Pieces held by several ranks are split among them when at least this large.
SPLIT_BYTES = 1 << 20


# -- what this rank holds --------------------------------------------------------------------


def local_pieces(trainer: Checkpointable) -> dict[str, tuple[Any, tuple, tuple]]:
    """{tensor key: (local array, full shape, normalized index)} for parameters and optimizer state."""
    opt = trainer.optimizer
    pieces: dict[str, tuple[Any, tuple, tuple]] = {}
    for name, (param, full_shape, index) in trainer.shards().items():
        full_shape = tuple(int(n) for n in full_shape)
        index = fmt.norm_index(index, full_shape)
        if tuple(param.data.shape) != fmt.local_shape(index, full_shape):
            raise CheckpointError(f"shards(): {name} holds shape {tuple(param.data.shape)}, its index "
                                  f"describes {fmt.local_shape(index, full_shape)}")
        pieces[f"model/{name}"] = (param.data, full_shape, index)
        state = opt.state.get(param.name, {}) if opt is not None else {}
        for key, value in sorted(state.items()):
            if hasattr(value, "shape") and tuple(value.shape) == tuple(param.data.shape):
                pieces[f"optim/{name}/{key}"] = (value, full_shape, index)
    return pieces


def _config(trainer: Checkpointable) -> dict[str, Any]:
    """The trainer's ``config()`` and, when its model ties weights, ``tied`` (``{alias: owner}``:
    a tied weight is stored once, as its owner; ``loading`` reads an untied model's alias from it)."""
    cfg = trainer.config()
    tied = trainer.tied_weights() if callable(getattr(trainer, "tied_weights", None)) else {}
    return {**cfg, "tied": dict(tied)} if tied else cfg


# -- the plan --------------------------------------------------------------------------------


def make_plan(everyone: list[dict[str, tuple]]) -> tuple[dict[str, tuple], dict[str, list]]:
    """From every rank's ``{key: (full shape, dtype, [boxes])}``: ``shapes {key: (full, dtype)}``
    and ``slabs {key: [(box, writer rank), ...]}`` (the same on every rank)."""
    shapes: dict[str, tuple] = {}
    holders: dict[str, dict[tuple, list[int]]] = {}
    for rank, mine in enumerate(everyone):
        for key, (full, dtype, bxs) in mine.items():
            have = shapes.setdefault(key, (tuple(full), dtype))
            if have != (tuple(full), dtype):
                raise CheckpointError(f"ranks disagree on {key}: {have} vs {(tuple(full), dtype)}")
            for box in bxs:
                holders.setdefault(key, {}).setdefault(tuple(map(tuple, box)), []).append(rank)
    load = [0] * len(everyone)
    slabs: dict[str, list] = {}
    for key in sorted(holders):
        full, dtype = shapes[key]
        item = np.dtype(dtype).itemsize
        covered = sum(fmt.volume(b) for b in holders[key])
        if covered != fmt.numel(full):
            raise CheckpointError(f"the ranks' shards of {key} do not cover its full shape {full} exactly")
        out = slabs.setdefault(key, [])
        for box, ranks in sorted(holders[key].items()):
            nbytes = fmt.volume(box) * item
            rows = box[0][1] - box[0][0] if box else 0
            if len(ranks) > 1 and rows >= len(ranks) and nbytes >= SPLIT_BYTES:
                # Replicas share the writing: a run of rows each, least-loaded rank first.
                order = sorted(ranks, key=lambda r: (load[r], r))
                edges = np.linspace(box[0][0], box[0][1], len(ranks) + 1).astype(int)
                for r, lo, hi in zip(order, edges[:-1], edges[1:]):
                    sub = ((int(lo), int(hi)), *box[1:])
                    out.append((sub, r))
                    load[r] += fmt.volume(sub) * item
            else:
                r = min(ranks, key=lambda r: (load[r], r))
                out.append((box, r))
                load[r] += nbytes
    return shapes, slabs


def describe(trainer: Checkpointable, comm: Comm) -> tuple[dict[str, tuple], dict[str, tuple], dict[str, str],
                                              dict[str, np.ndarray], BaseException | None]:
    """What this rank saves: ``(pieces, meta {key: (full shape, dtype, boxes)}, header attributes,
    state arrays, this rank's problem or None)``. Calls the trainer's ``state_dict()`` (collective:
    RNG states are gathered) on every rank, even after a problem, so no rank is left waiting."""
    pieces: dict[str, tuple[Any, tuple, tuple]] = {}
    meta: dict[str, tuple] = {}
    extra: dict[str, np.ndarray] = {}
    attrs: dict[str, str] = {}
    problem: BaseException | None = None
    try:
        pieces = local_pieces(trainer)
        meta = {k: (full, str(np.dtype(a.dtype)), [b for b, _ in fmt.boxes(idx, full)])
                for k, (a, full, idx) in pieces.items()}
        opt = trainer.optimizer
        opt_sd = {} if opt is None else opt.state_dict()  # references only: step, config, state
        attrs = {
            "format": fmt.FORMAT,
            "format_version": str(fmt.FORMAT_VERSION),
            "hpctrain_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "layout": fmt.dumps(trainer.layout),
            "config": fmt.dumps(_config(trainer)),
            "trainer_state": "",
            "optimizer": fmt.dumps({} if opt is None else {"step": opt_sd["step"], "config": opt_sd["config"]}),
        }
    except Exception as exc:
        problem = CheckpointError(f"{type(exc).__name__}: {exc}") if not isinstance(exc, CheckpointError) else exc
    try:
        attrs["trainer_state"] = fmt.dumps(fmt.to_json(trainer.state_dict(), extra))
    except Exception as exc:
        problem = problem or CheckpointError(f"state_dict(): {type(exc).__name__}: {exc}")
    return pieces, meta, attrs, extra, problem


def agree(path: str, comm: Comm, problem: BaseException | None,
          meta: dict[str, tuple]) -> tuple[dict[str, tuple], dict[str, list], str]:
    """One exchange: every rank's problem (raised on every rank), file name and pieces, and rank
    0's token for the part directory. Returns the plan (``make_plan``) and the token."""
    from ..comm.validate import raise_if_any

    token = f"{time.time_ns():x}{uuid.uuid4().hex[:6]}" if comm.rank == 0 else None
    everyone = raise_if_any(comm, problem, what=f"cannot save checkpoint {path}",
                            payload=(os.path.abspath(path), meta, token))
    paths = sorted({p for p, _, _ in everyone})
    if len(paths) > 1:  # e.g. asynchronous workers stopping at different steps: never half a checkpoint
        raise CheckpointError(f"cannot save checkpoint: the ranks name different files ({', '.join(paths[:4])})")
    shapes, slabs = make_plan([m for _, m, _ in everyone])
    return shapes, slabs, everyone[0][2]


# -- writing ---------------------------------------------------------------------------------


#: What a rank whose part file was cut short by ``KeyboardInterrupt`` tells the others.
INTERRUPTED = "interrupted (Ctrl-C again)"


def why(exc: BaseException) -> str:
    """A one-line cause for a file-system error, e.g. 'No space left on device'."""
    if isinstance(exc, OSError) and exc.errno:
        name = f" ({exc.filename})" if exc.filename else ""
        return f"{os.strerror(exc.errno)}{name}"
    text = str(exc)
    for code in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM, errno.EIO, errno.ENOENT):
        if os.strerror(code) in text or os.strerror(code).lower() in text.lower():
            return os.strerror(code)
    return f"{type(exc).__name__}: {text}"


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fsync_file(os.path.dirname(os.path.abspath(path)) or ".")


class Job:
    """One save: what this rank writes and what rank 0 needs to finish it."""

    def __init__(self, path: str, comm: Comm, raw: Any, token: str) -> None:
        self.path, self.comm, self.raw, self.token = path, comm, raw, token
        self.parts = fmt.parts_dir_name(path, token)
        self.parts_path = os.path.join(os.path.dirname(os.path.abspath(path)), self.parts)
        self.items: list[tuple[str, np.ndarray]] = []
        self.index: dict[str, Any] = {}
        self.attrs: dict[str, str] = {}
        self.state_arrays: dict[str, np.ndarray] = {}
        self.after: Callable[[], None] | None = None  # run on rank 0 after the commit (keep=)
        self.error: str | None = None
        self.result: str | None = None
        self.thread: threading.Thread | None = None
        self.written: Any = None
        self.everyone: list[Any] | None = None
        self.previous: Job | None = None  # rank 0: an earlier job whose commit this job's thread runs

    def start(self, previous: Job | None) -> None:
        """Write this rank's part in a background thread, which first commits ``previous`` (rank
        0's handed-over save, see :meth:`.checkpointer.Checkpointer.save`)."""
        self.previous = previous
        _IN_FLIGHT.add(self.parts_path)
        self.thread = threading.Thread(target=self.run, name="hpctrain-checkpoint", daemon=False)
        self.thread.start()

    def join(self) -> str | None:
        """Join the writer thread and exchange what every rank wrote (collective). Returns the
        agreed failure of the save whose commit that thread ran (rank 0's), if any."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        older = self.previous.error if self.previous is not None else None
        self.previous = None
        return self.exchange(older)

    def run(self) -> None:
        """The background thread: commit the previous save (rank 0), then write this rank's part."""
        try:
            if self.previous is not None:
                self.previous.commit()
        finally:
            self.write()

    def write(self) -> None:
        """Write this rank's part file (no communication: safe in a background thread, where an
        MPI call would hold MPI's lock against the training thread's collectives)."""
        mine: Any = None
        try:
            if self.items:
                os.makedirs(self.parts_path, exist_ok=True)
                mine = write_part(os.path.join(self.parts_path, fmt.part_file(self.comm.rank)), self.items)
        except KeyboardInterrupt:  # Ctrl-C again while a stop's checkpoint is written: the whole job is
            mine = ("error", INTERRUPTED)  # interrupted (130), once every rank knows (not "cannot write", 5)
        except BaseException as exc:
            mine = ("error", why(exc))
        self.items = []  # the snapshot is on disk (or lost); its buffers stay with the checkpointer
        self.written = mine

    def gather(self) -> None:
        """Collect every rank's written digests (or errors) on rank 0 (collective, on the
        private communicator; every rank takes part whatever failed)."""
        self._collected(self.raw.gather_obj(self.written, root=0))

    def exchange(self, older: str | None) -> str | None:
        """:meth:`gather` that also shares rank 0's ``older`` (the outcome of the commit its
        writer thread ran) with every rank: one allgather for both."""
        everyone = self.raw.allgather_obj((self.written, older))
        self._collected([w for w, _ in everyone])
        if self.raw.rank != 0:
            _IN_FLIGHT.discard(self.parts_path)  # rank 0 commits (and cleans) it
        return everyone[0][1]

    def _collected(self, everyone: list[Any] | None) -> None:
        if self.raw.rank == 0:
            by_why: dict[str, list[int]] = {}  # one reason said once, with the ranks it stopped
            for rank, m in enumerate(everyone):
                if isinstance(m, tuple):
                    by_why.setdefault(m[1], []).append(rank)
            if by_why:
                from ..comm.failure import rank_ranges

                self.error = f"cannot write checkpoint {self.path}: " + "; ".join(
                    f"rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)}: {w}" for w, rs in list(by_why.items())[:4])
            self.everyone = everyone
        self.result = self.path

    def commit(self) -> None:
        """Rank 0: write the index (the commit) and run ``after``; on failure remove the parts.
        No communication: may run in rank 0's background thread. Sets ``error``."""
        if self.error is None:
            try:
                self._commit(self.everyone)
            except BaseException as exc:
                self.error = f"cannot write checkpoint {self.path}: {why(exc)}"
        if self.error is not None:
            shutil.rmtree(self.parts_path, ignore_errors=True)
        elif self.after is not None:
            try:
                self.after()
            except Exception as exc:  # the checkpoint is safe; cleaning older ones failed
                self.error = f"checkpoint {self.path} written, but removing older ones failed: {why(exc)}"
        self.everyone = None
        _IN_FLIGHT.discard(self.parts_path)

    def finish(self) -> None:
        """Agree on the parts, commit (rank 0) and share the outcome (collective)."""
        self.gather()
        if self.raw.rank == 0:
            self.commit()
        self.error = self.raw.bcast_obj(self.error, root=0)

    def _commit(self, everyone: list[Any]) -> None:
        import h5py

        for entry in self.index.values():
            for slab in entry["slabs"]:
                slab[3] = everyone[slab[0]][slab[1]]
        self.attrs["index"] = fmt.dumps(self.index)
        parts = {fmt.part_file(r): w[rawio.WHOLE_FILE] for r, w in enumerate(everyone) if isinstance(w, dict)}
        block = seal.block_size(self.parts, parts)
        from ..files.rundir import temporary_name

        tmp = temporary_name(self.path)  # this host and process: recognized and cleaned if the job dies
        if os.path.lexists(tmp):  # our own name: left by a dead process that had our pid
            os.remove(tmp)
        try:
            # exclusive: never truncates or follows what is at that name; the user block holds the seal
            with h5py.File(tmp, "x", userblock_size=block) as f:
                for k, v in self.attrs.items():
                    f.attrs[k] = v
                f.attrs["header_" + fmt.CHECKSUM] = fmt.header_digest(f.attrs)
                for key, arr in self.state_arrays.items():
                    d = f.create_dataset(f"state{key}", data=arr)
                    d.attrs[fmt.CHECKSUM] = fmt.digest(arr)
                for key, entry in self.index.items():
                    _virtual(f, key, entry, self.parts)
            seal.write(tmp, block, self.parts, parts)  # before the fsync and the rename: the commit
            fsync_file(tmp)
            if os.path.isdir(self.parts_path):
                fsync_file(self.parts_path)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise
        fsync_dir(self.path)
        remove_parts(self.path, keep=self.parts)


def _virtual(f: Any, key: str, entry: dict[str, Any], parts: str) -> None:
    """``key`` as a virtual dataset over its slabs, so plain h5py reads the full tensor.

    Made with HDF5's low-level calls: h5py's ``VirtualLayout`` cost 0.3 ms per tensor, most of
    a save of many small tensors."""
    from h5py import h5d, h5p, h5s, h5t

    shape = tuple(int(n) for n in entry["shape"])
    if not shape or not all(shape):
        return
    dcpl = h5p.create(h5p.DATASET_CREATE)
    where = h5s.create_simple(shape)
    for writer, name, box, _ in entry["slabs"]:
        sub = tuple(b - a for a, b in box)
        where.select_hyperslab(tuple(a for a, _ in box), sub)
        dcpl.set_virtual(where, f"{parts}/{fmt.part_file(writer)}".encode(), name.encode(), h5s.create_simple(sub))
    lcpl = h5p.create(h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    h5d.create(f.id, key.encode(), h5t.py_create(np.dtype(entry["dtype"]), logical=True), h5s.create_simple(shape),
               dcpl=dcpl, lcpl=lcpl).close()


def remove_parts(path: str, keep: str | None = None) -> None:
    """Remove the part directories of the checkpoint ``path`` (all but ``keep`` and those a
    background save of this process is writing)."""
    d = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path) + "."
    try:
        names = os.listdir(d)
    except OSError:
        return
    for n in names:
        if n.startswith(base) and n.endswith(fmt.PARTS_SUFFIX) and n != keep and not busy(os.path.join(d, n)):
            shutil.rmtree(os.path.join(d, n), ignore_errors=True)


#: Part directories (absolute paths) that background saves of this process are writing: cleaning
#: (``keep=``, orphans) runs in rank 0's writer thread while the next save is written.
_IN_FLIGHT: set[str] = set()


def busy(parts_path: str) -> bool:
    """Whether a background save of this process is writing ``parts_path``."""
    return os.path.abspath(parts_path) in _IN_FLIGHT


def write_part(path: str, items: list[tuple[str, np.ndarray]]) -> dict[str, str]:
    """Write this rank's part file (see :func:`.rawio.write_part`); ``{dataset: checksum}``."""
    return rawio.write_part(path, items)


def remove(path: str) -> None:
    """Delete the checkpoint ``path``: its index file first (then it no longer counts), then its
    part files. Not collective."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    remove_parts(path)
