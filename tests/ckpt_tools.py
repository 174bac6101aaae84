"""Helpers for damaging checkpoints in tests: copy one with its part files, find and flip a slab,
reseal one after a deliberate edit."""

from __future__ import annotations

import os

import h5py

from hpctrain import checkpoint
from hpctrain.checkpoint import seal


def copy_checkpoint(src: str, dst_dir: str, name: str | None = None) -> str:
    """Copy the checkpoint ``src`` (index file and part directory) into ``dst_dir``."""
    os.makedirs(dst_dir, exist_ok=True)
    return checkpoint.copy(src, os.path.join(dst_dir, name or os.path.basename(src)))


def slab_of(path: str, key: str) -> tuple[str, str]:
    """(part file, dataset) holding the first slab of tensor ``key`` (through its virtual dataset)."""
    with h5py.File(path, "r") as f:
        src = f[key].virtual_sources()[0]
    return os.path.join(os.path.dirname(path), src.file_name), src.dset_name


def reseal(path: str) -> None:
    """Recompute the whole-file digests in the seal of checkpoint ``path`` after a deliberate edit
    (anyone can: XXH3 is no signature), so that the test meets the checks behind the seal (slab
    checksums, link and layout checks) instead of the seal's own refusal."""
    m = seal.read(path, verify=False)
    parts = {}
    for name in m["parts"]:
        part = os.path.join(os.path.dirname(path), m["parts_dir"], name)
        if os.path.isfile(part):
            fd = os.open(part, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                parts[name] = [size, seal.fd_digest(fd, 0, size)]
            finally:
                os.close(fd)
    seal.write(path, m["block"], m["parts_dir"], parts)


def flip(path: str, key: str, at: int = 5, *, resealed: bool = True) -> str:
    """Flip one bit of one value of tensor ``key`` in its part file; returns that file. Resealed
    (by default): the slab's own checksum is what catches it."""
    file, dset = slab_of(path, key)
    with h5py.File(file, "r") as f:
        offset = f[dset].id.get_offset()
    with open(file, "r+b") as fh:
        fh.seek(offset + at)
        b = fh.read(1)
        fh.seek(offset + at)
        fh.write(bytes([b[0] ^ 0x40]))
    if resealed:
        reseal(path)
    return file
