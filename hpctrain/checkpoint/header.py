"""The index file of a checkpoint: opened only once its seal verifies, its header checked.

Rank 0 checks the index file (format, header checksum, no links or foreign storage, the piece
table well formed) before a load broadcasts it with the small state arrays; ``ckpt inspect``
and :func:`.loading.load_weights` read it the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..files.h5safe import check_stored_here, check_tree, regular_file
from . import format as fmt
from . import seal

_PARTS = fmt.PARTS_NAME


# -- the index file --------------------------------------------------------------------------


def read_header(path: str, *, with_state: bool = True, tree: bool = True) -> dict[str, Any]:
    """Open and check the index file ``path``; returns the header (``layout``, ``config``,
    ``trainer_state``, ``optimizer``, ``index``, ``parts``, ``state_arrays``, ...).

    ``tree=False`` leaves out the walk over every object of the file (:func:`check_index_tree`;
    ``load`` runs it while the slabs are read): the state arrays read here are then checked one
    by one to be stored in the file.

    Raises ``FileNotFoundError`` or a ``CheckpointError`` naming the file and what is wrong.
    """
    with _index_file(path) as (f, manifest):
        header = _header(f, path, with_state, tree)
    if manifest is not None and manifest["parts_dir"] != header["parts_dir"]:
        raise CheckpointError(f"checkpoint {path} is corrupt: its seal and its header name different part "
                              f"directories")
    header["seal"] = manifest
    return header


def check_index_tree(path: str, header: dict[str, Any]) -> None:
    """Refuse an index file holding a soft or external link, external storage or a virtual
    dataset other than its own index over its part files (``CheckpointError``)."""
    with _index_file(path) as (f, _):
        _check_tree(f, path, header["parts_dir"])


@contextlib.contextmanager
def _index_file(path: str) -> Iterator[tuple[Any, dict[str, Any] | None]]:
    """The index file opened by h5py once its seal and whole-file digest are verified, with
    its manifest (``None``: a checkpoint written before seals)."""
    import h5py

    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    regular_file(path, f"checkpoint {path}", CheckpointError)
    manifest = seal.read(path)  # every byte verified before HDF5 parses one
    try:
        f = h5py.File(path, "r")
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is not a readable HDF5 file ({exc})") from None
    try:
        with f:
            yield f, manifest
    except CheckpointError:
        raise
    except Exception as exc:  # damaged HDF5 metadata surfaces as KeyError, OSError, RuntimeError...
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__}: {exc})") from None


def _check_tree(f: Any, path: str, parts: str | None) -> None:
    check_tree(f, path, CheckpointError, allow_virtual=lambda name, dcpl: _own_sources(dcpl, parts, name))


def _header(f: Any, path: str, with_state: bool, tree: bool) -> dict[str, Any]:
    import h5py

    if f.attrs.get("format") != fmt.FORMAT:
        raise CheckpointError(f"{path} is not an hpctrain checkpoint (no '{fmt.FORMAT}' marker)")
    try:
        version = int(f.attrs.get("format_version", -1))
    except (TypeError, ValueError):
        version = -1
    if not 1 <= version <= fmt.FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {version}; this hpctrain reads 1 to {fmt.FORMAT_VERSION}")
    if "header_" + fmt.CHECKSUM not in f.attrs or fmt.header_digest(f.attrs) != str(f.attrs["header_" + fmt.CHECKSUM]):
        raise CheckpointError(f"checkpoint {path} is corrupt: checksum mismatch in its header attributes")
    try:
        header = {k: json.loads(f.attrs[k]) for k in ("layout", "config", "trainer_state", "optimizer")}
        if version >= 2:
            header["index"] = json.loads(f.attrs["index"])
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path} has a damaged header ({type(exc).__name__}: {exc})") from None
    if version == 1:  # one file, full tensors, one checksum each: each tensor is one slab of itself
        header["index"] = _v1_index(f)
    _check_index(header["index"], path)
    parts = None
    if version >= 2:
        parts = str(f.attrs.get("parts", ""))
        if not _PARTS.fullmatch(parts):
            raise CheckpointError(f"checkpoint {path} names part directory {parts!r}; refused (not beside it)")
    header["parts_dir"] = parts
    if tree:
        _check_tree(f, path, parts)
    header["hpctrain_version"] = str(f.attrs.get("hpctrain_version"))
    header["version"] = version
    arrays: dict[str, np.ndarray] = {}
    if with_state and "state" in f:
        bad: list[str] = []

        def grab(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                # (visititems reaches objects through hard links only; the storage is checked
                # here when the whole tree is not)
                check_stored_here(obj, f"checkpoint {path}: state/{name}", CheckpointError)
                _check_state_storage(obj, f"checkpoint {path}: state/{name}")
                data = obj[()]
                if fmt.digest(np.asarray(data)) != str(obj.attrs.get(fmt.CHECKSUM)):
                    bad.append(f"checksum mismatch in state/{name}")
                arrays["/" + name] = data

        f["state"].visititems(grab)
        if bad:
            raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(bad[:5])}")
    header["state_arrays"] = arrays
    return header


def _check_state_storage(dset: Any, where: str) -> None:
    """Refuse a state array not stored as hpctrain writes them (numbers, in one uncompressed
    block of exactly their size) before it is read: a compressed dataset of a few kilobytes can
    declare gigabytes, which reading would allocate and inflate (tried: 19 KB took 15 GB and 32 s
    before the checksum refused it)."""
    from h5py import h5d

    dtype = dset.dtype
    nbytes = fmt.numel(dset.shape) * dtype.itemsize
    dcpl = dset.id.get_create_plist()
    layout = dcpl.get_layout()
    if dtype.kind not in "biufcS" or dtype.fields is not None or dtype.subdtype is not None:
        why = f"holds {dtype}"
    elif layout not in (h5d.CONTIGUOUS, h5d.COMPACT) or dcpl.get_nfilters():
        why = "is stored chunked or filtered"
    elif layout == h5d.CONTIGUOUS and dset.id.get_storage_size() != nbytes:
        why = f"declares {nbytes:,} bytes but stores {dset.id.get_storage_size():,}"
    else:
        return
    raise CheckpointError(f"{where} {why}: refused (state arrays are written as numbers, uncompressed, in one block)")


def _v1_index(f: Any) -> dict[str, Any]:
    import h5py

    out: dict[str, Any] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and name.startswith(("model/", "optim/")):
            box = [[0, int(n)] for n in obj.shape]
            out[name] = {"shape": list(obj.shape), "dtype": str(obj.dtype),
                         "slabs": [[None, name, box, str(obj.attrs.get(fmt.CHECKSUM))]]}

    f.visititems(visit)
    return out


def _check_index(index: Any, path: str) -> None:
    """Validate the piece table's structure (a hostile file may hold anything)."""
    if not isinstance(index, dict):
        raise CheckpointError(f"checkpoint {path}: damaged piece table")
    for key, entry in index.items():
        try:
            shape = tuple(int(n) for n in entry["shape"])
            np.dtype(entry["dtype"])
            if any(n < 0 for n in shape) or not key.startswith(("model/", "optim/")):
                raise ValueError
            covered = 0
            for writer, name, box, digest in entry["slabs"]:
                if writer is not None:
                    if not (isinstance(writer, int) and writer >= 0):
                        raise ValueError
                    if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/"):
                        raise ValueError
                if len(box) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, shape)):
                    raise ValueError
                if not isinstance(digest, str):
                    raise ValueError
                covered += fmt.volume(tuple(map(tuple, box)))
            if covered != fmt.numel(shape):
                raise CheckpointError(f"checkpoint {path}: the slabs of {key} do not cover its shape {shape}")
        except CheckpointError:
            raise
        except Exception:
            raise CheckpointError(f"checkpoint {path}: damaged piece table entry for {key}") from None


def _own_sources(plist: Any, parts: str | None, name: str) -> str | None:
    """``None`` if the virtual dataset ``name`` (``plist``: its creation property list, which
    names the mapped files without building their selections) reads only the checkpoint's own
    part files."""
    for i in range(plist.get_virtual_count()):
        file_name = plist.get_virtual_filename(i)
        d, _, file = file_name.partition("/")
        own = parts is not None and d == parts and re.fullmatch(r"w\d{5}\.h5", file)
        if not own or not name.startswith(("model/", "optim/")):
            return f"it reads {file_name}, outside the checkpoint's own part files"
    return None


def part_path(path: str, header: dict[str, Any], writer: int | None) -> str:
    """Where the slabs of ``writer`` live (``None``: the index file itself, format 1)."""
    if writer is None:
        return path
    return os.path.join(os.path.dirname(os.path.abspath(path)), header["parts_dir"], fmt.part_file(writer))
