"""The checkpoint format: file names, index of pieces, checksums, header.

A checkpoint ``ckpt-<step>.h5`` is an *index file* plus a directory of *part files*, one per
writing rank::

    ckpt-00000012.h5                      index: header attributes, the piece table, small state
    ckpt-00000012.h5.<token>.parts/w00003.h5   the slabs rank 3 wrote (``model/<name>/<i>``, ...)

Every tensor (``model/<name>``, ``optim/<name>/<key>``) is stored as non-overlapping N-d slabs of
the full tensor, each in one part file with its own XXH3-64 checksum (kept in the index, which the
header checksum covers). A loading rank reads the slabs that intersect what it holds and verifies
each one it reads: no whole-tensor hash, no second pass. The index file also holds each tensor as
an HDF5 virtual dataset over its slabs, so plain h5py reads full tensors under serial names; the
virtual datasets' sources must be the checkpoint's own part files (checked on load).

Indices: ``shards()`` gives a tuple of slices (an N-d slab), possibly with integer ids on one axis
(tensor-parallel fused columns), or ``("flat", start, stop)`` over the C-order raveled tensor
(ZeRO). Each is split into boxes (tuples of ``(start, stop)`` per axis) with a view of the local
array per box, the same way for saving and loading.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from ..backend import to_host
from ..errors import CheckpointError

FORMAT = "hpctrain-checkpoint"
FORMAT_VERSION = 2
CHECKSUM = "xxh3_64"
HEADER = ("layout", "config", "trainer_state", "optimizer", "index", "parts")
_NAME = re.compile(r"ckpt-(\d{8,})\.h5$")
PARTS_SUFFIX = ".parts"
#: What a part directory's name may be (beside its index file, nothing else).
PARTS_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*\.parts")

Box = tuple[tuple[int, int], ...]


# -- names -----------------------------------------------------------------------------------


#: The largest counter a checkpoint's state may hold (a step, an epoch, a position): far beyond
#: any run, well inside int64 and the 8+ digits of a checkpoint's name. A seal proves a file is
#: whole, not that its values are sane: loads refuse anything outside ``[least, MAX_COUNT]``.
MAX_COUNT = 10**12


def whole(value: Any, what: str, least: int = 0) -> int:
    """``value`` when it is a whole number in ``[least, MAX_COUNT]``, else ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_COUNT:
        raise ValueError(f"its {what} is {value!r}, not a whole number from {least} to {MAX_COUNT:,}")
    return value


def checkpoint_path(directory: str, step: int) -> str:
    """``directory/ckpt-<step, 8 digits>.h5``."""
    return os.path.join(directory, f"ckpt-{step:08d}.h5")


def step_of(path: str) -> int | None:
    """The step a checkpoint's name ``ckpt-<step>.h5`` says (``None`` for another name)."""
    named = _NAME.fullmatch(os.path.basename(path))
    return int(named.group(1)) if named else None


def list_checkpoints(directory: str) -> list[str]:
    """Complete checkpoints (index files) in ``directory``, oldest first; temporaries and part
    directories never count. The directory name is taken literally (no globbing)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [os.path.join(directory, n) for n in names if _NAME.fullmatch(n)]
    return sorted(found, key=step_of)


def checkpoints_of(run: str) -> list[str]:
    """The checkpoint files ``run`` names, newest first: those of a run directory
    (``RUN/checkpoints``) or of a directory of checkpoints, or ``run`` itself when it is a file
    (what ``--resume``, ``ckpt inspect``, ``generate`` and ``load_weights`` take).
    ``CheckpointError`` for a directory without any, ``ConfigError`` for no such path."""
    from ..errors import CheckpointError, ConfigError

    run = os.fspath(run)
    if os.path.isdir(run):
        ckpt_dir = os.path.join(run, "checkpoints") if os.path.isdir(os.path.join(run, "checkpoints")) else run
        found = list_checkpoints(ckpt_dir)
        if not found:
            raise CheckpointError(f"no checkpoints in {ckpt_dir}")
        return found[::-1]
    if os.path.isfile(run):
        return [run]
    raise ConfigError(f"{run} is neither a run directory nor a checkpoint file")


def parts_dir_name(path: str, token: str) -> str:
    """The part directory's name (relative to the index file's directory) for one save."""
    return f"{os.path.basename(path)}.{token}{PARTS_SUFFIX}"


def part_file(rank: int) -> str:
    return f"w{rank:05d}.h5"


# -- checksums -------------------------------------------------------------------------------


def numel(shape: Any) -> int:
    """The number of elements of ``shape`` (Python integers: exact, and ~20x cheaper than
    ``np.prod`` on the few dimensions of a slab, which a load of many tensors does thousands of
    times)."""
    return math.prod(int(n) for n in shape)


def as_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def digest(a: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(as_bytes(a))


def header_digest(attrs: Any) -> str:
    """Checksum of the JSON header attributes: a flipped bit there would otherwise load silently."""
    h = xxhash.xxh3_64()
    for k in HEADER:
        if k in attrs:
            v = attrs[k]
            h.update(v.encode() if isinstance(v, str) else bytes(v))
    return h.hexdigest()


# -- indices and boxes -----------------------------------------------------------------------


def norm_index(index: Any, shape: tuple) -> tuple[Any, ...]:
    """Concrete (start, stop, 1) slices, strictly increasing ids on at most one axis, or
    ``("flat", start, stop)``; refused with ``CheckpointError`` otherwise."""
    if isinstance(index, tuple) and len(index) == 3 and isinstance(index[0], str):
        if index[0] != "flat":
            raise CheckpointError(f"shards() index {index!r}: the only tagged form is ('flat', start, stop)")
        start, stop = int(index[1]), int(index[2])
        if not 0 <= start <= stop <= numel(shape):
            raise CheckpointError(f"shards() flat range [{start}, {stop}) outside a tensor of shape {shape}")
        return ("flat", start, stop)
    index = tuple(index)
    if len(index) != len(shape):
        raise CheckpointError(f"shards() index {index!r} has {len(index)} axes, the tensor {len(shape)}")
    out: list[Any] = []
    for s, n in zip(index, shape):
        if not isinstance(s, slice):
            ids = np.asarray(to_host(s), dtype=np.int64).reshape(-1)
            if ids.size and (ids[0] < 0 or ids[-1] >= n or (ids.size > 1 and np.any(np.diff(ids) <= 0))):
                raise CheckpointError(f"shards() index ids must be strictly increasing in [0, {n})")
            out.append(ids)
            continue
        start, stop, step = s.indices(n)
        if step != 1:
            raise CheckpointError(f"shards() must use unit-step slices, got {s}")
        out.append(slice(start, max(start, stop), 1))
    if sum(not isinstance(s, slice) for s in out) > 1:
        raise CheckpointError("shards() index may hold integer ids on one axis only")
    return tuple(out)


def local_shape(index: tuple, full: tuple) -> tuple[int, ...]:
    """The shape of the local array an index describes."""
    if index and isinstance(index[0], str):
        return (index[2] - index[1],)
    return tuple(len(s) if not isinstance(s, slice) else s.stop - s.start for s in index)


def _runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Positions [a, b) of maximal runs of consecutive ids."""
    if ids.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    edges = [0, *cuts.tolist(), int(ids.size)]
    return list(zip(edges[:-1], edges[1:]))


def _flat_boxes(start: int, stop: int, shape: tuple) -> list[tuple[Box, int]]:
    """The C-order range [start, stop) of a tensor of ``shape`` as boxes, with each box's offset
    in the range (at most 2 * ndim - 1 boxes)."""
    if start >= stop:
        return []
    if len(shape) == 0:
        return [((), 0)]
    if len(shape) == 1:
        return [(((start, stop),), 0)]
    inner = numel(shape[1:])
    out: list[tuple[Box, int]] = []
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:  # within one row of the first axis
        return [(((r0, r0 + 1), *b), off) for b, off in _flat_boxes(c0, c1, shape[1:])]
    pos = 0
    if c0:
        out += [(((r0, r0 + 1), *b), off) for b, off in _flat_boxes(c0, inner, shape[1:])]
        pos = inner - c0
        r0 += 1
    if r1 > r0:
        out.append((((r0, r1), *((0, n) for n in shape[1:])), pos))
        pos += (r1 - r0) * inner
    if c1:
        out += [(((r1, r1 + 1), *b), pos + off) for b, off in _flat_boxes(0, c1, shape[1:])]
    return out


def boxes(index: tuple, full: tuple) -> list[tuple[Box, Callable[[Any], Any]]]:
    """Split a normalized index into boxes of the full tensor, each with a function that maps
    the local array to the view of it that the box covers (same shape as the box)."""
    full = tuple(int(n) for n in full)
    if index and isinstance(index[0], str):
        _, start, stop = index
        out = []
        for box, off in _flat_boxes(start, stop, full):
            n = numel([b - a for a, b in box])
            shape = tuple(b - a for a, b in box)
            out.append((box, lambda a, o=off, n=n, s=shape: a.reshape(-1)[o : o + n].reshape(s)))
        return out
    axis = next((i for i, s in enumerate(index) if not isinstance(s, slice)), None)
    base = [(s.start, s.stop) if isinstance(s, slice) else None for s in index]
    if axis is None:
        return [(tuple(base), lambda a: a)]
    ids = index[axis]
    out = []
    for a, b in _runs(ids):
        box = list(base)
        box[axis] = (int(ids[a]), int(ids[b - 1]) + 1)
        sel = tuple(slice(a, b) if i == axis else slice(None) for i in range(len(index)))
        out.append((tuple(box), lambda arr, sel=sel: arr[sel]))
    return out


def volume(box: Box) -> int:
    return numel([b - a for a, b in box])


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) or not out else None


def rel(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices selecting ``inner`` within an array that holds ``outer``."""
    return tuple(slice(lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(inner, outer))


# -- JSON with arrays ------------------------------------------------------------------------


def to_json(obj: Any, arrays: dict[str, np.ndarray], path: str = "") -> Any:
    """JSON-able copy of ``obj``; arrays are moved to ``arrays`` and left as references."""
    if isinstance(obj, dict):
        return {str(k): to_json(v, arrays, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v, arrays, f"{path}/{i}") for i, v in enumerate(obj)]
    if hasattr(obj, "__array__") and not np.isscalar(obj):
        arrays[path] = np.array(to_host(obj))
        return {"__array__": path}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def check_saveable(obj: Any, where: str, path: str = "") -> bool:
    """Refuse (``TypeError`` naming ``where`` and the path in ``obj``) what :func:`to_json` and
    :func:`from_json` would not give back as it was: a key that is not a string (JSON would turn
    it into one), a dict whose only key is ``"__array__"`` (read back as an array reference), a
    value JSON cannot hold (a set, bytes, an object), an array HDF5 cannot (strings, objects) and
    a key on the way to an array that is no HDF5 name (``""``, ``"."``, one holding ``/``: the
    array is stored under its path of keys). Tuples come back as lists. True if ``obj`` holds an
    array."""
    at = f"{where}{' at ' + path if path else ''}"
    if isinstance(obj, dict):
        if set(obj) == {"__array__"}:
            raise TypeError(f"{at}: a dict whose only key is '__array__' is reserved (an array's reference)")
        holds = False
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{at}: key {k!r} is {type(k).__name__}; only string keys are saved (JSON)")
            if check_saveable(v, where, f"{path}/{k}"):
                if k in ("", ".") or "/" in k:
                    raise TypeError(f"{at}: key {k!r} leads to an array, which is stored under its path of "
                                    "keys: such a key must be a name (not empty, not '.', no '/')")
                holds = True
        return holds
    if isinstance(obj, (list, tuple)):
        return any([check_saveable(v, where, f"{path}/{i}") for i, v in enumerate(obj)])
    if hasattr(obj, "__array__") and not np.isscalar(obj):
        if np.dtype(getattr(obj, "dtype", object)).kind not in "biufc":
            raise TypeError(f"{at}: an array of dtype {getattr(obj, 'dtype', '?')} is not saved (numbers only)")
        return True
    if not (obj is None or isinstance(obj, (str, bool, int, float))
            or isinstance(obj, np.generic) and np.dtype(obj.dtype).kind in "biuf"):
        raise TypeError(f"{at}: a value of type {type(obj).__name__!r} is not saved (JSON values, dicts with "
                        "string keys, lists and numeric arrays are)")
    return False


def state_digest(obj: Any) -> str:
    """A checksum of ``obj`` as :func:`to_json` saves it (its arrays' bytes, dtypes and shapes included)."""
    arrays: dict[str, np.ndarray] = {}
    h = xxhash.xxh3_64(dumps(to_json(obj, arrays)).encode())
    for key in sorted(arrays):
        a = arrays[key]
        h.update(f"{key}:{a.dtype.str}:{a.shape}".encode())
        h.update(as_bytes(a))
    return h.hexdigest()


def from_json(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__array__"}:
            return arrays[obj["__array__"]]
        return {k: from_json(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v, arrays) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
