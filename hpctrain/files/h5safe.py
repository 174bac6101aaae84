"""Opening objects of an HDF5 file that is not trusted: only what the file itself stores.

HDF5 can make a name in one file read bytes from elsewhere: a soft link points at another
name, an external link at another file, *external storage* keeps a dataset's raw bytes in
arbitrary files (``/etc/shadow`` as an int8 column), and a *virtual dataset* maps other
files' datasets. hpctrain reads ``--data`` files and checkpoints that may come from anyone, so
it follows none of these: every name must be a chain of hard links to a dataset stored in the
file. Shared by the dataset loaders and the checkpoint reader; each passes its own error class
(``DatasetError``, ``CheckpointError``) so the message reaches the user as that kind of error.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any

from ..errors import DatasetError


def regular_file(path: str | os.PathLike, where: str, error: type[Exception] = DatasetError) -> None:
    """Refuse anything at ``path`` but a regular file (after symbolic links): opening a FIFO
    for reading blocks until someone writes to it, so a FIFO planted under a checkpoint's or a
    data file's name would hang the job instead of failing it. ``FileNotFoundError`` when
    nothing is there."""
    regular_mode(os.stat(path).st_mode, where, error)  # stat opens nothing: no blocking


def regular_mode(mode: int, where: str, error: type[Exception] = DatasetError) -> None:
    """:func:`regular_file` for a mode already known (``fstat`` of a descriptor opened with
    ``O_NONBLOCK``, which checks the very file that will be read)."""
    if not stat.S_ISREG(mode):
        raise error(f"{where} is {file_kind(mode)}, not a regular file: refused")


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words (``a FIFO``, ``a device``, ...), for messages."""
    return ("a regular file" if stat.S_ISREG(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a directory" if stat.S_ISDIR(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a file")


def open_file(path: str | os.PathLike, where: str, error: type[Exception] = DatasetError) -> Any:
    """``h5py.File(path, "r")`` for a file that may come from anyone: a regular file only
    (:func:`regular_file`), and an HDF5 error raised as ``error`` naming ``where``."""
    import h5py

    regular_file(path, where, error)
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise error(f"{where}: cannot open as HDF5 ({exc})") from None


def _link_text(link: Any) -> str:
    import h5py

    if isinstance(link, h5py.SoftLink):
        return f"a soft link to {link.path!r}"
    if isinstance(link, h5py.ExternalLink):
        return f"an external link to {link.path!r} in file {link.filename!r}"
    return f"a link of type {type(link).__name__}"


def check_stored_here(dset: Any, where: str, error: type[Exception] = DatasetError) -> None:
    """Refuse a dataset whose bytes live outside its file (external storage, virtual dataset)."""
    if getattr(dset, "is_virtual", False):
        raise error(f"{where} is a virtual dataset (it maps other files' data): refused, store the data in the file")
    external = getattr(dset, "external", None)
    if external:
        files = sorted({str(e[0]) for e in external})
        raise error(f"{where} keeps its bytes in external file(s) {files}: refused, store the data in the file")


def hard_object(group: Any, name: str, where: str, error: type[Exception] = DatasetError) -> Any:
    """``group[name]`` reached through hard links only (each component of a ``/`` path checked
    before it is opened, so an external link never opens its target file). ``KeyError`` when a
    component is missing; ``error`` naming ``where`` and the link for a soft or external link.

    Uses h5py's low-level calls (a checkpoint load opens one dataset per slab; the high-level
    path costs several times more per component)."""
    import h5py
    from h5py import h5d, h5g, h5l, h5o

    gid = group.id
    obj = group
    for part in [p for p in name.split("/") if p]:
        key = part.encode()
        if not isinstance(gid, h5g.GroupID) or not gid.links.exists(key):
            raise KeyError(name)
        if gid.links.get_info(key).type != h5l.TYPE_HARD:
            link = obj.get(part, getlink=True)
            raise error(f"{where} is {_link_text(link)}: refused, only data stored in the file is read")
        gid = h5o.open(gid, key)
        obj = h5py.Group(gid) if isinstance(gid, h5g.GroupID) else None
    if isinstance(gid, h5d.DatasetID):
        return h5py.Dataset(gid)
    if isinstance(gid, h5g.GroupID):
        return h5py.Group(gid)
    return h5py.Datatype(gid)


def hard_dataset(group: Any, name: str, where: str, error: type[Exception] = DatasetError) -> Any:
    """:func:`hard_object` that must be a dataset stored in the file (:func:`check_stored_here`);
    ``None`` when it is not a dataset (the caller says what it wanted)."""
    import h5py

    obj = hard_object(group, name, where, error)
    if not isinstance(obj, h5py.Dataset):
        return None
    check_stored_here(obj, where, error)
    return obj


def _links(group: Any, where: str, error: type[Exception], limit: int) -> list[tuple[bytes, int]]:
    """Every link under ``group`` as ``(path, link type)``, in one walk of HDF5's own link
    iteration, which does not descend through soft or external links (so a path reported as a
    hard link has hard links for every component). More than ``limit`` links raise ``error``."""
    links: list[tuple[bytes, int]] = []

    def visit(name: bytes, info: Any) -> int | None:
        links.append((name, info.type))
        return 1 if len(links) > limit else None  # non-None stops the iteration

    group.id.links.visit(visit, info=True)
    if len(links) > limit:
        raise error(f"{where} holds more than {limit} objects: refused as not a file hpctrain wrote")
    return links


def hard_names(group: Any, where: str, error: type[Exception] = DatasetError, limit: int = 100_000) -> set[bytes]:
    """Every name under ``group`` reached through hard links only (see :func:`_links`).

    Opening a name from this set by its whole path cannot leave the file; a checkpoint reader
    checks a part file once this way instead of each component of each slab's name (which
    cost ~0.5 ms per slab: 85 ms to load 256 small tensors)."""
    from h5py import h5l

    return {name for name, kind in _links(group, where, error, limit) if kind == h5l.TYPE_HARD}


def open_stored(group: Any, name: str, hard: set[bytes], where: str,
                error: type[Exception] = DatasetError) -> tuple[Any, Any] | None:
    """``(low-level dataset id, its creation property list)`` for ``group[name]`` when ``name``
    is in ``hard`` (from :func:`hard_names`): opened by its whole path with HDF5's low-level
    calls and refused like :func:`check_stored_here` if its bytes live elsewhere. ``None`` when
    the name is not a dataset. A name not in ``hard`` goes through :func:`hard_dataset` (which
    says which link is refused, or raises ``KeyError``). (No high-level ``h5py.Dataset``: a load
    of many small tensors opens one per slab, and the wrapper cost a tenth of it.)"""
    import h5py
    from h5py import h5d, h5o

    if name.encode() not in hard:
        obj = hard_dataset(group, name, where, error)
        return None if obj is None else (obj.id, obj.id.get_create_plist())
    oid = h5o.open(group.id, name.encode())
    if not isinstance(oid, h5d.DatasetID):
        return None
    dcpl = oid.get_create_plist()
    if dcpl.get_layout() == h5d.VIRTUAL or dcpl.get_external_count():
        check_stored_here(h5py.Dataset(oid), where, error)  # raises, naming the files
    return oid, dcpl


def check_tree(
    group: Any,
    where: str,
    error: type[Exception] = DatasetError,
    limit: int = 100_000,
    allow_virtual: Callable[[str, Any], str | None] | None = None,
) -> int:
    """Refuse if anything under ``group`` is a soft/external link, external storage or virtual
    (for files read whole, like checkpoints). Visits at most ``limit`` names; returns the count.
    ``allow_virtual(name, dcpl)`` may accept a virtual dataset (a checkpoint's index over its
    own part files) from its creation property list (which names the files it maps): it returns
    ``None`` to accept, else the reason to refuse."""
    import h5py
    from h5py import h5d, h5l, h5o

    links = _links(group, where, error, limit)
    prefix = where.rstrip("/")
    for raw, kind in links:
        name = raw.decode()
        here = f"{prefix}/{name}"
        if kind != h5l.TYPE_HARD:
            raise error(f"{here} is {_link_text(group.get(name, getlink=True))}: refused, only data stored in "
                        "the file is read")
        oid = h5o.open(group.id, raw)
        if not isinstance(oid, h5d.DatasetID):
            continue
        dcpl = oid.get_create_plist()
        virtual = dcpl.get_layout() == h5d.VIRTUAL
        if virtual and allow_virtual is not None:
            why = allow_virtual(name, dcpl)
            if why is not None:
                raise error(f"{here} is a virtual dataset ({why}): refused")
        elif virtual or dcpl.get_external_count():
            check_stored_here(h5py.Dataset(oid), here, error)  # raises, naming what it maps
    return len(links)
