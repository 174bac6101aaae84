"""Opening HDF5 files that came from someone else: nothing outside the file is followed.

An HDF5 file can point elsewhere: soft links (to another object of the file, possibly a cycle),
external links (to an object in another file), datasets whose raw data lives in external files,
and virtual datasets (whose data is read from other files). A checkpoint or a ``--data`` file
handed over by another user must not make hpctrain read files it was not given, so each of these
is refused with an error naming the object. Checkpoints allow virtual datasets only over their
own part files (``allow_virtual``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check_untrusted(
    f: Any,
    path: str,
    *,
    error: type[Exception] = ValueError,
    allow_virtual: Callable[[str, Any], str | None] | None = None,
) -> None:
    """Walk the open ``h5py.File`` ``f`` and raise ``error`` on the first soft or external
    link, dataset with external raw storage, or virtual dataset.

    ``allow_virtual(name, dataset)`` may accept a virtual dataset: it returns ``None`` to accept
    or a reason to refuse. Messages read ``"<path>: <object> is ..."``.
    """
    import h5py

    def walk(group: Any, prefix: str) -> None:
        for name in group:
            where = f"{prefix}{name}"
            link = group.get(name, getlink=True)
            if isinstance(link, h5py.SoftLink):
                raise error(f"{path}: {where} is a soft link (to {link.path}); links are refused")
            if isinstance(link, h5py.ExternalLink):
                raise error(f"{path}: {where} is an external link (to {link.filename}:{link.path}); links are refused")
            obj = group.get(name)
            if isinstance(obj, h5py.Group):
                walk(obj, where + "/")
            elif isinstance(obj, h5py.Dataset):
                if obj.is_virtual:
                    why = "virtual datasets are refused" if allow_virtual is None else allow_virtual(where, obj)
                    if why is not None:
                        raise error(f"{path}: {where} is a virtual dataset ({why})")
                elif obj.external:
                    raise error(f"{path}: {where} keeps its data in external files; refused")
            elif obj is not None and not isinstance(obj, h5py.Datatype):
                raise error(f"{path}: {where} is an unexpected object ({type(obj).__name__})")

    walk(f, "")


def open_untrusted(path: str, *, error: type[Exception] = ValueError) -> Any:
    """``h5py.File(path, "r")`` after :func:`check_untrusted` (closed again when refused);
    an unreadable file raises ``error`` naming it."""
    import h5py

    try:
        f = h5py.File(path, "r")
    except Exception as exc:
        raise error(f"{path} is not a readable HDF5 file ({exc})") from None
    try:
        check_untrusted(f, path, error=error)
    except BaseException:
        f.close()
        raise
    return f
