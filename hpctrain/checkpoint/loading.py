"""Loading is a transaction: read and verify everything into temporaries, agree, then commit.

Rank 0 checks the index file (format, header checksum, no links or foreign storage, the piece
table well formed) and broadcasts it with the small state arrays. Every rank then checks the
shape and dtype the checkpoint declares for each tensor it holds against the model *before
reading*, reads the slabs that intersect its pieces from the part files, and verifies each slab's
checksum as it is read. The ranks agree (one small allgather); only then is the trainer changed.
If its ``load_state_dict`` fails on any rank, every rank puts everything back: the parameters
from their backups, the rest through the trainer's ``snapshot()``/``restore()``
(``hpctrain.protocols.Stateful``; the trainer composes those of the objects it owns). Any failure
leaves parameters, optimizer state, counters, RNG states and the sampler position bitwise as they
were. The index file is read by :mod:`.header`, the slabs by :mod:`.reader`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from ..errors import CheckpointError
from ..protocols import Checkpointable, Comm
from . import format as fmt
from . import rawio
from .checkpointer import checkpointer_of
from .header import check_index_tree, read_header
from .reader import Reader

__all__ = ["commit", "load", "load_weights", "read_header", "stage"]


def _agreed_header(path: str, comm: Comm) -> dict[str, Any]:
    verdict: Any = None
    if comm.rank == 0:
        try:
            verdict = ("ok", read_header(path, tree=False))
        except FileNotFoundError as exc:
            verdict = ("missing", str(exc))
        except CheckpointError as exc:
            verdict = ("bad", str(exc))
        except Exception as exc:  # anything h5py raises on a damaged file, reported on every rank
            verdict = ("bad", f"checkpoint {path} is unreadable ({type(exc).__name__}: {exc})")
    verdict = comm.bcast_obj(verdict)
    if verdict[0] == "missing":
        raise FileNotFoundError(verdict[1])
    if verdict[0] == "bad":
        raise CheckpointError(verdict[1])
    return verdict[1]


def _wanted(trainer: Checkpointable, stored: dict[str, Any]) -> dict[str, tuple[Any, tuple, tuple]]:
    """{key: (parameter, full shape, index)} for what this rank holds (parameters and the
    optimizer's state keys). An optimizer whose ``state_keys`` is ``None`` declares none (a torch
    optimizer makes its state at its first step): it takes the keys ``stored`` holds for each
    parameter."""
    opt = trainer.optimizer
    keys = opt.state_keys if opt is not None else ()
    by_param: dict[str, list[str]] = {}
    if keys is None:
        for k in stored:
            if k.startswith("optim/"):
                name, key = k[len("optim/"):].rsplit("/", 1)
                by_param.setdefault(name, []).append(key)
    out: dict[str, tuple[Any, tuple, tuple]] = {}
    for name, (param, full_shape, index) in trainer.shards().items():
        full_shape = tuple(int(n) for n in full_shape)
        index = fmt.norm_index(index, full_shape)
        out[f"model/{name}"] = (param, full_shape, index)
        for key in keys if keys is not None else by_param.get(name, ()):
            out[f"optim/{name}/{key}"] = (param, full_shape, index)
    return out


def _whole(shape: tuple) -> tuple:
    return tuple(slice(0, n) for n in shape)


def tied_in(header: dict[str, Any]) -> dict[str, str]:
    """``{alias: owner}`` of the weights the checkpoint's model tied (stored once, as the owner)."""
    config = header.get("config")
    tied = config.get("tied", {}) if isinstance(config, dict) else {}
    return {str(a): str(o) for a, o in tied.items()} if isinstance(tied, dict) else {}


def _from_owner(key: str, full: tuple, idx: tuple, index: dict[str, Any], tied: dict[str, str]) -> Any:
    """Where an untied model's ``key`` (``model/head.weight``, ``optim/head.weight/m``) comes
    from in a checkpoint that tied it: ``(owner key, owner index, transpose)``; ``None`` if not."""
    head, _, rest = key.partition("/")  # model/<name> or optim/<name>/<state key>
    for alias, owner in tied.items():
        if rest != alias and not rest.startswith(alias + "/"):
            continue
        src = f"{head}/{owner}{rest[len(alias):]}"
        entry = index.get(src)
        if entry is None:
            return None
        stored = tuple(entry["shape"])
        if stored == tuple(full):
            return src, idx, False
        if len(full) == 2 and stored == tuple(full)[::-1]:  # an untied head is the embedding transposed
            return src, tuple(idx)[::-1], True
    return None


def stage(path: str, trainer: Checkpointable, header: dict[str, Any],
          tree: bool = False) -> tuple[dict[str, Any], list[str], set[str]]:
    """Read and verify everything this rank needs into temporaries; changes nothing.

    ``tree``: also walk the index file (:func:`check_index_tree`), while the reads go on (the
    part files are found from the header, not through the index's virtual datasets, so what is
    read does not depend on it; nothing is committed before every check has passed).

    Returns ``(staged {key: array on the parameter's device}, problems, wanted model keys)``.
    """
    staged: dict[str, Any] = {}
    problems: list[str] = []
    wanted: set[str] = set()
    index = header["index"]
    reader = Reader(path, header)
    tied = tied_in(header)
    try:
        pieces = _wanted(trainer, index)
        wanted = {k for k in pieces if k.startswith("model/")}
        # A weight the checkpoint's model tied (stored once, as its owner) for an untied model.
        sources = {k: src for k, (_, full, idx) in pieces.items() if k not in index
                   for src in [_from_owner(k, full, idx, index, tied)] if src is not None}  # fmt: skip
        wanted |= {src[0] for k, src in sources.items() if k.startswith("model/")}
        # Shapes and dtypes first: nothing is read for a model the checkpoint does not fit.
        for key, (param, full_shape, _) in pieces.items():
            entry = index.get(key)
            if entry is None:
                if key.startswith("model/") and key not in sources:
                    problems.append(f"{key[6:]} is not in the checkpoint")
                continue
            if tuple(entry["shape"]) != tuple(full_shape):
                problems.append(f"{key}: checkpoint declares shape {tuple(entry['shape'])}, model needs {full_shape}")
            elif np.dtype(entry["dtype"]).kind != np.dtype(param.dtype).kind:
                problems.append(f"{key}: checkpoint declares dtype {entry['dtype']}, model needs {param.dtype}")
        if problems:
            return staged, problems + (_tree_problems(path, header) if tree else []), wanted
        # In the part files' order (their datasets were written sorted by key): sequential reads.
        outs = []
        with _quick_handoffs():
            for key in sorted(k for k in pieces if k in index or k in sources):
                param, full_shape, idx = pieces[key]
                src, src_idx, flip = sources.get(key, (key, idx, False))
                src_full = tuple(index[src]["shape"])
                out = rawio.staging_empty(fmt.local_shape(src_idx, src_full), np.dtype(index[src]["dtype"]))
                reader.prefault(out)
                reader.fill(src, out, src_idx, defer=True)
                outs.append((key, param, out.T if flip else out))
            if tree:  # (on a thread of its own, its HDF5 calls and the slabs' checks took turns: 1.7x slower)
                problems += _tree_problems(path, header)
            reader.finish()
        for key, param, out in outs:
            staged[key] = to_device(np.ascontiguousarray(out), xp_of(param.data)).astype(param.dtype, copy=False)
    except CheckpointError as exc:
        problems.append(str(exc))
    except Exception as exc:  # reported on every rank by the caller instead of leaving others waiting
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        reader.close()
    return staged, problems, wanted


def _tree_problems(path: str, header: dict[str, Any]) -> list[str]:
    """:func:`check_index_tree`'s refusal as a problem that fails the load on every rank."""
    try:
        check_index_tree(path, header)
    except (CheckpointError, FileNotFoundError) as exc:
        why = str(exc)
        return [why if why.startswith("checkpoint ") else f"checkpoint {path}: {why}"]
    return []


@contextlib.contextmanager
def _quick_handoffs(seconds: float = 1e-4) -> Iterator[None]:
    """Shorten the interpreter's GIL switch interval (5 ms) while the loading thread runs Python
    (h5py checks of the next datasets) and the faulting, reading and hashing threads, which need
    the GIL only for a moment between their long GIL-free calls, wait for it: measured, they otherwise
    stood idle up to 5 ms per slab. Put back afterwards."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def load(path: str, trainer: Checkpointable) -> dict[str, Any]:
    """Restore ``trainer`` from ``path`` (collective). Returns the checkpoint's header.

    The saved layout may differ from the trainer's: every rank reads the slices it holds now.
    A missing file raises ``FileNotFoundError`` and a corrupt, truncated, foreign or ill-fitting
    one a ``CheckpointError``, on every rank, with the trainer exactly as it was.

    Tied weights (a GPT's ``--tie-embeddings`` head): a checkpoint stores a tied weight once,
    under its owner's name (``tok_emb.weight``). It loads into a tied model as it is, and into an
    untied one too: the untied alias (``head.weight``) starts as the owner, transposed where the
    untied layer holds it transposed (its optimizer state likewise). A checkpoint of an untied
    model does not load into a tied one (its head would be dropped): refused, saying so.
    """
    from ..comm.validate import raise_if_any

    checkpointer_of(trainer).wait()
    comm = trainer.comm
    header = _agreed_header(path, comm)
    state, refused = _checked_state(path, header, trainer)
    if refused is None:
        staged, problems, wanted = stage(path, trainer, header, tree=comm.rank == 0)
    else:  # nothing read: the ranks still meet below, whatever each found
        staged, problems, wanted = {}, [refused], set()
    everyone = comm.allgather_obj((problems, sorted(wanted)))
    all_problems = list(dict.fromkeys(p for ps, _ in everyone for p in ps))
    corrupt = [p for p in all_problems if "fit this model" not in p and p.startswith("checkpoint ")]
    if corrupt:
        raise CheckpointError("; ".join(corrupt[:4]))
    stored = {k for k in header["index"] if k.startswith("model/")}
    all_wanted = set().union(*(set(w) for _, w in everyone))
    ties = trainer.tied_weights() if callable(getattr(trainer, "tied_weights", None)) else {}
    all_problems += [f"{k[6:]} is in the checkpoint but not in the model" + (
        f" (this model ties it to {ties[k[6:]]}: a checkpoint of an untied model loads into untied ones only)"
        if k[6:] in ties else "") for k in sorted(stored - all_wanted)]
    if all_problems:
        raise CheckpointError(f"checkpoint {path} does not fit this model: " + "; ".join(all_problems[:6]))
    problem = commit(trainer, staged, state, header)
    raise_if_any(comm, problem, what=f"checkpoint {path}: cannot restore the trainer state (nothing was changed)")
    header.pop("state_arrays", None)
    return header


def _checked_state(path: str, header: dict[str, Any], trainer: Checkpointable) -> tuple[Any, str | None]:
    """The trainer state of the checkpoint ``path`` and why it is refused before anything is read
    (``None``: it is not): damaged JSON, a step that is not the one its name says, a value out
    of range or that this trainer cannot take (its optional ``state_problem``; see
    ``training.state``). The same verdict on every rank (the header is rank 0's)."""
    try:
        state = fmt.from_json(header["trainer_state"], header["state_arrays"])
    except Exception as exc:
        return None, f"checkpoint {path}: damaged trainer state ({type(exc).__name__}: {exc})"
    if not isinstance(state, dict):
        return None, f"checkpoint {path}: damaged trainer state (a {type(state).__name__}, not a dict)"
    opt = header.get("optimizer") or {}
    check = getattr(trainer, "state_problem", None)  # optional in the trainer interface
    try:
        fmt.whole(opt.get("step", 0) if isinstance(opt, dict) else None, "optimizer step")
        why = check(state) if check is not None else None
    except ValueError as exc:
        why = str(exc)
    named = fmt.step_of(path)
    if why is None and named is not None and state.get("global_step") != named:
        why = f"holds step {state.get('global_step')!r}, not the step {named} its name says (renamed?)"
    return state, (f"checkpoint {path}: {why}" if why else None)


def commit(trainer: Checkpointable, staged: dict[str, Any], state: Any, header: dict[str, Any]) -> BaseException | None:
    """Put verified temporaries into ``trainer``; if anything fails on any rank (its
    ``load_state_dict``, say), every rank puts everything back: the parameters from their
    backups, the rest through the trainer's ``restore`` of the ``snapshot`` taken first.
    Returns this rank's problem (``None`` when all is well)."""
    shards = trainer.shards()
    snap: Any = None
    backups: dict[str, Any] = {}
    problem = None
    try:
        snap = trainer.snapshot()
        _put(trainer, shards, staged, header, backups)
        trainer.load_state_dict(state)
    except Exception as exc:
        problem = CheckpointError(f"{type(exc).__name__}: {exc}")
    failed = trainer.comm.allgather_obj(problem is not None)
    if not any(failed):
        return None
    for name, old in backups.items():
        param = shards[name][0]
        if param.data is staged[f"model/{name}"]:
            param.data = old
        else:
            param.data[...] = old
    problem = problem if problem is not None else CheckpointError("another rank failed")
    if snap is not None:
        try:
            trainer.restore(snap)
        except Exception as exc:  # a user's object refusing its own old state: say so, never leave alone
            problem = CheckpointError(f"{problem}; putting the trainer back failed too on this rank, which "
                                      f"keeps part of the checkpoint's state ({type(exc).__name__}: {exc})")
    return problem


def _put(trainer: Checkpointable, shards: dict[str, tuple], staged: dict[str, Any], header: dict[str, Any],
         backups: dict[str, Any]) -> None:
    """The staged parameters into place (each one's old array into ``backups`` first) and the
    staged optimizer state into the trainer's optimizer, with the saved step count."""
    # Parameters are copied in place (their arrays may be views into flat buffers); a parameter's
    # optimizer state is replaced as a whole dict (the optimizer's snapshot keeps the old one).
    new_opt: dict[str, dict[str, Any]] = {}
    for key, data in staged.items():
        kind, name = key.split("/", 1)
        if kind == "model":
            param = shards[name][0]
            if _swappable(param.data, data):
                backups[name] = param.data  # the old array is the backup: no copy at all
                param.data = data
            else:
                backups[name] = param.data.copy()
                param.data[...] = data
        else:
            pname, skey = name.rsplit("/", 1)
            new_opt.setdefault(shards[pname][0].name, {})[skey] = data
    opt = trainer.optimizer
    if opt is not None:
        for pname, entries in new_opt.items():
            opt.state[pname] = {**(opt.state.get(pname) or {}), **entries}
        if header["optimizer"]:
            opt.step_count = int(header["optimizer"]["step"])


def _swappable(current: Any, new: Any) -> bool:
    """Whether a parameter's array may be replaced by ``new`` instead of copied into: NumPy
    arrays that own their memory (see :func:`_owns`), ``current`` held by nothing but its
    parameter (no other holder; a view of it would show in :func:`_owns`), of the same shape,
    dtype and layout."""
    return (
        type(current) is np.ndarray
        and type(new) is np.ndarray
        and _owns(current)
        and _owns(new)
        and sys.getrefcount(current) <= _SOLE_OWNER_REFS
        and current.shape == new.shape
        and current.dtype == new.dtype
        and current.flags.c_contiguous
        and new.flags.c_contiguous
        and new.flags.writeable
    )


def _owns(a: np.ndarray) -> bool:
    """Whether nothing else can see ``a``'s memory: ``a`` owns it, or ``a`` is the one view of a
    private byte buffer (:func:`rawio.staging_empty`'s aligned arrays, swapped in by an earlier
    load). NumPy points every view's ``base`` at the array that owns the memory, so another view
    of either kind shows as a reference more to ``a`` or to its buffer."""
    base = a.base
    if base is None:
        return True
    if not (type(base) is np.ndarray and base.base is None and base.dtype == np.uint8 and base.ndim == 1):
        return False
    del base  # our own reference would count
    return _base_refs(a) <= _SOLE_BASE_REFS


def _refs(current: Any) -> int:
    return sys.getrefcount(current)


def _base_refs(a: np.ndarray) -> int:
    return sys.getrefcount(a.base)


class _Probe:
    data: Any = None


_probe = _Probe()
_probe.data = np.zeros(1)
#: What ``sys.getrefcount`` says inside ``_swappable`` for an array only its parameter holds
#: (measured, not assumed: it differs between Python versions).
_SOLE_OWNER_REFS = _refs(_probe.data)
#: What :func:`_base_refs` says for the one view of a private buffer (measured likewise).
_SOLE_BASE_REFS = _base_refs(np.zeros(8, np.uint8)[:8].view(np.float64))
del _probe


def load_weights(path: str, model: Any) -> dict[str, Any]:
    """Read the parameters of a checkpoint into a whole (serial) ``model``; no MPI, no trainer.

    ``path``: a checkpoint file, or a run directory (or a directory of checkpoints): its newest
    checkpoint that loads, as ``--resume`` takes it (a damaged or misfitting newer one is skipped,
    with a warning; ``CheckpointError`` naming each when none loads).

    For evaluation and sampling: the header and every slab read are checked against their
    checksums, and the names and shapes must match the model's exactly (a ``CheckpointError``
    lists what differs; the model is unchanged then), tied weights as ``load`` says. Returns the
    header (its ``"path"``: the file read).
    """
    import os

    if os.path.isdir(path):
        return _load_newest(fmt.checkpoints_of(path), model)
    header = read_header(path, with_state=False)
    params = dict(model.named_parameters())
    index = header["index"]
    stored = {k[len("model/"):] for k in index if k.startswith("model/")}
    tied = tied_in(header)
    sources = {n: src for n, p in params.items() if n not in stored
               for src in [_from_owner(f"model/{n}", p.data.shape, _whole(p.data.shape), index, tied)]
               if src is not None}  # fmt: skip
    ties = model.tied_weights() if callable(getattr(model, "tied_weights", None)) else {}
    used = set(params) | {src[len("model/"):] for src, _, _ in sources.values()}
    problems = [f"{n} is not in the checkpoint" for n in sorted(set(params) - stored - set(sources))]
    problems += [f"{n} is in the checkpoint but not in the model" + (
        f" (this model ties it to {ties[n]}: a checkpoint of an untied model loads into untied ones only)"
        if n in ties else "") for n in sorted(stored - used)]
    for name in sorted(set(params) & stored):
        shape = tuple(index[f"model/{name}"]["shape"])
        if shape != tuple(params[name].data.shape):
            problems.append(f"{name}: checkpoint has shape {shape}, model needs {tuple(params[name].data.shape)}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this model: " + "; ".join(problems[:6]))
    arrays: dict[str, np.ndarray] = {}
    reader = Reader(path, header)
    try:
        for name in sorted(params):
            src, _, flip = sources.get(name, (f"model/{name}", None, False))
            entry = index[src]
            out = np.empty(tuple(entry["shape"]), np.dtype(entry["dtype"]))
            reader.fill(src, out, _whole(out.shape))
            arrays[name] = np.ascontiguousarray(out.T) if flip else out
    finally:
        reader.close()
    for name, data in arrays.items():
        p = params[name]
        p.data[...] = to_device(data.astype(p.data.dtype, copy=False), xp_of(p.data))
    return {**header, "path": path}


def _load_newest(paths: list[str], model: Any) -> dict[str, Any]:
    """:func:`load_weights` of the first of ``paths`` (newest first) that loads; the model is
    unchanged by each one skipped."""
    from ..log import get_logger

    failures = []
    for path in paths:
        try:
            return load_weights(path, model)
        except (CheckpointError, OSError) as exc:
            failures.append(f"{path}: {exc}")
            get_logger("checkpoint").warning("skipping checkpoint %s: %s", path, exc)
    raise CheckpointError("no checkpoint loads: " + "; ".join(failures))
