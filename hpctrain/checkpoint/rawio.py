"""Part files' bulk bytes moved with ``pwrite``/``preadv`` at known offsets, hashed on the way.

A part file is an ordinary HDF5 file (plain h5py reads it) whose datasets are *contiguous*,
unfiltered and allocated when created. h5py creates that skeleton (metadata only, a few
milliseconds); the data bytes then go straight between the arrays and the file at each dataset's
offset, and XXH3 (tens of GB/s) hashes each slab in one call. ``pwrite``, ``preadv`` and XXH3
release the GIL (h5py holds it, and its own lock, for a whole read or write), and they are made
with whole slabs, not small chunks: every return from a call must take the GIL back, and a
thread waiting for it waits up to the interpreter's switch interval (5 ms) while the training
thread runs Python. The whole pages of slabs of :data:`DIRECT_MIN` or more are written by direct
I/O (no copy into the page cache). So a background save leaves the training thread its GIL and
most of its CPU.

Reading goes through the raw path only for a dataset whose storage the reader has checked: a
hard-linked dataset of the file itself, contiguous, no filters, no external storage, the declared
shape and a native-byte-order dtype equal to the index's, and storage of exactly its size. Anything
else (format 1 files, a part file someone rewrote with h5py options) is read by h5py as before;
both paths verify the same checksum.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..files.h5safe import regular_mode
from . import format as fmt
from . import seal

#: Most bytes per ``pwrite``/``preadv`` call (Linux moves at most 2 GiB per call).
CHUNK = 1 << 30
#: Bytes HDF5 sets aside for a part file's metadata at its start.
META_BLOCK = 1 << 20


def byte_view(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, no copy."""
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")


def _chunks(n: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, CHUNK):
        yield lo, min(n, lo + CHUNK)


# -- writing ---------------------------------------------------------------------------------


#: The key of :func:`write_part`'s result that holds ``[size, digest]`` of the whole file (no
#: dataset has an empty name).
WHOLE_FILE = ""


def write_part(path: str, items: list[tuple[str, np.ndarray]]) -> dict[str, Any]:
    """Write ``items`` (C-contiguous arrays) as contiguous datasets of a new file ``path``
    (created exclusively: never overwrites or follows a link), fsync it; returns
    ``{dataset: XXH3-64 hex digest}`` and under :data:`WHOLE_FILE` the file's size and digest."""
    import h5py
    from h5py import h5d, h5p, h5s, h5t

    placed: list[tuple[str, np.ndarray, int | None]] = []
    # All metadata in one block at the start (not between the data blocks: a cold open reads it
    # in one go), large datasets page-aligned.
    with h5py.File(path, "x", meta_block_size=META_BLOCK, alignment_threshold=64 << 10,
                   alignment_interval=4096) as f:
        # HDF5's low-level calls: h5py's create_dataset (and a create_group per tensor) cost
        # 0.15 ms per slab, a third of a save of many small tensors.
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)  # the offset is known now, no fill written
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        lcpl = h5p.create(h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        for name, arr in items:
            space = h5s.create_simple(arr.shape) if arr.ndim else h5s.create(h5s.SCALAR)
            d = h5d.create(f.id, name.encode(), h5t.py_create(arr.dtype, logical=True), space, dcpl=dcpl, lcpl=lcpl)
            offset = d.get_offset() if arr.size else None
            if arr.size and offset is None:  # not contiguous storage (a scalar): tiny, through HDF5
                d.write(h5s.ALL, h5s.ALL, np.ascontiguousarray(arr))
            d.close()
            placed.append((name, arr, offset))
    digests: dict[str, Any] = {}
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    direct = _direct_fd(path) if any(_direct_ok(arr, off) for _, arr, off in placed) else None
    bounce: np.ndarray | None = None
    try:
        for name, arr, offset in placed:
            src = byte_view(arr)
            done = 0
            if direct is not None and _direct_ok(arr, offset):
                # Straight to the disk by DMA: no copy into the page cache (a CPU the training
                # needs) and no dirty pages for the fsync to flush. A page-aligned buffer (an
                # asynchronous snapshot) is written as it is; anything else through a small
                # aligned bounce buffer. The unaligned tail is buffered.
                if arr.ctypes.data % ALIGN and bounce is None:
                    bounce = aligned_empty((BOUNCE,), np.uint8)
                done = _write_direct(direct, src, offset, None if arr.ctypes.data % ALIGN == 0 else bounce)
            for lo, hi in _chunks(len(src) - done):
                _pwrite_all(fd, src[done + lo : done + hi], offset + done + lo)
            digests[name] = fmt.digest(arr)
        os.fsync(fd)
        # The whole file's digest for the index's seal: the slabs hashed from memory, only the
        # bytes between them (HDF5 metadata, padding) read back.
        size = os.fstat(fd).st_size
        extents = [(off, byte_view(arr)) for _, arr, off in placed if off is not None and arr.size]
        digests[WHOLE_FILE] = [size, *seal.pieces_digest(fd, size, extents)]  # (+ HMAC, key id: signed)
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)
    return digests


def _write_direct(fd: int, src: memoryview, offset: int, bounce: np.ndarray | None) -> int:
    """Write the whole pages of ``src`` at ``offset`` through the direct descriptor; returns how
    many bytes were written (0 when the file system refuses direct I/O for it)."""
    bulk = len(src) // ALIGN * ALIGN
    try:
        if bounce is None:
            for lo, hi in _chunks(bulk):
                _pwrite_all(fd, src[lo:hi], offset + lo)
            return bulk
        view = memoryview(bounce)
        for lo in range(0, bulk, len(bounce)):
            n = min(len(bounce), bulk - lo)
            np.copyto(bounce[:n], np.frombuffer(src[lo : lo + n], np.uint8))
            _pwrite_all(fd, view[:n], offset + lo)
        return bulk
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return 0  # direct I/O refused here (alignment rules of this file system): buffered instead


#: Alignment of buffers, offsets and lengths for direct I/O (a page: what Linux file systems ask).
ALIGN = 4096


#: Bytes of the bounce buffer that takes unaligned arrays to direct I/O.
BOUNCE = 8 << 20


#: Slabs smaller than this are written through the page cache: a direct write waits for the
#: device, and 256 of them (256 KiB each) took 3x as long as buffered writes and one fsync.
DIRECT_MIN = 1 << 20


def _direct_ok(arr: np.ndarray, offset: int | None) -> bool:
    """Whether the slab's whole pages go by direct I/O: its file offset page-aligned, at least
    :data:`DIRECT_MIN` bytes."""
    return offset is not None and offset % ALIGN == 0 and arr.nbytes >= max(ALIGN, DIRECT_MIN)


def _direct_fd(path: str) -> int | None:
    """A second descriptor of ``path`` for direct I/O, or ``None`` where there is none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flag)
    except OSError:  # e.g. tmpfs: no direct I/O
        return None


def aligned_empty(shape: tuple, dtype: Any, align: int = ALIGN) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an ``align`` boundary, with room
    after it up to the next boundary (the allocation's unused head and tail are never touched,
    so they take no memory)."""
    dtype = np.dtype(dtype)
    n = fmt.numel(shape) * dtype.itemsize
    raw = np.empty(-(-n // align) * align + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + n].view(dtype).reshape(shape)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(f"short write at offset {offset}")
        data, offset = data[n:], offset + n


# -- reading ---------------------------------------------------------------------------------


def raw_extent(did: Any, dcpl: Any, shape: tuple, dtype: np.dtype) -> int | None:
    """The file offset of the bytes of dataset ``did`` (low-level id; ``dcpl`` its creation
    property list) if they may be read raw (see the module docstring), else ``None`` (read it
    through h5py)."""
    from h5py import h5d

    try:
        if dcpl.get_layout() != h5d.CONTIGUOUS or dcpl.get_nfilters() or dcpl.get_external_count():
            return None
        got = did.dtype
        if tuple(did.shape) != tuple(shape) or got != dtype or not got.isnative:
            return None
        if got.hasobject or got.fields is not None:
            return None
        offset = did.get_offset()
        nbytes = fmt.numel(shape) * dtype.itemsize
        if offset is None or did.get_storage_size() != nbytes:
            return None
        return int(offset)
    except Exception:  # anything odd about the object: h5py reads it (and says what is wrong)
        return None


class RawFile:
    """One part file opened for raw reads (no symlink followed; the size known up front)."""

    def __init__(self, path: str) -> None:
        self.path = path
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (no effect on
        # reads of a regular file, which is all this accepts).
        self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        st = os.fstat(self.fd)
        try:
            regular_mode(st.st_mode, path, CheckpointError)
        except CheckpointError:
            self.close()
            raise
        self.size = st.st_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read(self, offset: int, out: np.ndarray, what: str) -> None:
        """Read ``out.nbytes`` bytes at ``offset`` into ``out`` (C-contiguous) with one call.
        (One sequential read per slab, in file order, keeps the kernel's read-ahead going from a
        cold cache; splitting a slab among threads measured no faster warm and slower cold.)"""
        dst = byte_view(out)
        n = len(dst)
        if offset < 0 or offset + n > self.size:
            raise CheckpointError(f"{what}: its bytes [{offset}, {offset + n}) lie beyond the end of "
                                  f"{self.path} ({self.size} bytes): the file is truncated")
        for lo, hi in _chunks(n):
            buf, at = dst[lo:hi], offset + lo
            while len(buf):
                got = os.preadv(self.fd, [buf], at)
                if got <= 0:
                    raise CheckpointError(f"{what}: {self.path} ends early (truncated)")
                buf, at = buf[got:], at + got


#: Huge page size (x86-64 and most Linux): staging arrays this large or larger are aligned to it.
HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23


def staging_empty(shape: tuple, dtype: Any) -> np.ndarray:
    """A new uninitialized C-contiguous array for a load to read into (it becomes the parameter
    when the load commits, swapped in without a copy).

    An array of :data:`HUGE` bytes or more starts on a huge-page boundary and its range is advised
    ``MADV_HUGEPAGE``: the kernel then maps it with 2 MiB pages, one fault per 2 MiB instead of
    one per 4 KiB. Measured on a warm page cache (256 MiB, Linux 6.18, THP in ``madvise`` mode):
    reading into new 4 KiB-paged memory ran at 0.76x the speed of reading into preallocated
    memory, into new huge pages at 1.10x (fewer TLB misses than the preallocated 4 KiB pages).
    The unaligned head and tail of the allocation are never touched, so they take no memory.
    Where huge pages are off the advice does nothing."""
    dtype = np.dtype(dtype)
    n = fmt.numel(shape) * dtype.itemsize
    if n < HUGE:
        return np.empty(shape, dtype)
    a = aligned_empty(shape, dtype, HUGE)
    _advise(a.ctypes.data, -(-n // HUGE) * HUGE, _MADV_HUGEPAGE)
    return a


_madvise: Any = None


def _advise(addr: int, length: int, advice: int) -> bool:
    """``madvise(addr, length, advice)`` (``addr`` page-aligned; the GIL is released); False where
    it is not available or refused."""
    global _madvise
    if _madvise is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    return bool(_madvise) and _madvise(addr, length, advice) == 0


_populate = True
#: Arrays smaller than this are not worth a prefault (the reader's own faults are few).
PREFAULT_MIN = 1 << 20


def prefault(a: np.ndarray) -> None:
    """Fault in a new array's pages now (``MADV_POPULATE_WRITE``, Linux 5.14+; the GIL is
    released), so a read into it copies instead of faulting: the kernel's zeroing of new pages
    then runs on another thread than the read (see ``loading.Reader``). Advice only: nothing
    happens where it is not supported."""
    global _populate
    if a.nbytes < PREFAULT_MIN or not _populate:
        return
    start = a.ctypes.data // ALIGN * ALIGN
    if not _advise(start, a.ctypes.data + a.nbytes - start, _MADV_POPULATE_WRITE):
        _populate = False  # an older kernel: do not ask again
