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

from collections.abc import Callable
from typing import Any

from .errors import DatasetError


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


def check_tree(
    group: Any,
    where: str,
    error: type[Exception] = DatasetError,
    limit: int = 100_000,
    allow_virtual: Callable[[str, Any], str | None] | None = None,
) -> int:
    """Refuse if anything under ``group`` is a soft/external link, external storage or virtual
    (for files read whole, like checkpoints). Visits at most ``limit`` names; returns the count.
    ``allow_virtual(name, dataset)`` may accept a virtual dataset (a checkpoint's index over its
    own part files): it returns ``None`` to accept, else the reason to refuse."""
    import h5py

    seen = 0
    stack = [(group, where.rstrip("/"))]
    while stack:
        grp, prefix = stack.pop()
        for name in grp:
            seen += 1
            if seen > limit:
                raise error(f"{where} holds more than {limit} objects: refused as not a file hpctrain wrote")
            here = f"{prefix}/{name}"
            link = grp.get(name, getlink=True)
            if not isinstance(link, h5py.HardLink):
                raise error(f"{here} is {_link_text(link)}: refused, only data stored in the file is read")
            obj = grp[name]
            if isinstance(obj, h5py.Group):
                stack.append((obj, here))
            elif isinstance(obj, h5py.Dataset):
                if allow_virtual is not None and obj.is_virtual:
                    why = allow_virtual(here[len(where.rstrip("/")) + 1 :], obj)
                    if why is not None:
                        raise error(f"{here} is a virtual dataset ({why}): refused")
                    continue
                check_stored_here(obj, here, error)
    return seen
