"""Reading the slabs of a checkpoint: every slab read whole and verified against its checksum,
bulk bytes read raw where the dataset's storage allows it (see :mod:`.rawio`)."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..files.h5safe import hard_names, open_stored, regular_file
from . import format as fmt
from . import rawio, seal
from .header import part_path


def _read(raw: rawio.RawFile, offset: int, out: np.ndarray, what: str, faulted: Future | None) -> None:
    if faulted is not None:
        faulted.result()  # the pages of ``out`` are in (the faulting thread works in order)
    raw.read(offset, out, what)


def _digest(read: Future, out: np.ndarray) -> str:
    read.result()  # raises what the read raised
    return fmt.digest(out)


class Reader:
    """Reads and verifies slabs of one checkpoint (part files opened once each; bulk bytes read
    raw where the dataset's storage allows it, see :mod:`.rawio`).

    Deferred reads run as a pipeline of four threads, each in file order: this thread checks
    the next slab's dataset and allocates its array; a faulting thread brings that array's pages
    in (:func:`rawio.prefault`: the kernel zeroes new pages, as costly as the copy); the reader
    thread reads each slab once its pages are in; the hashing thread hashes each slab once it is
    read, while the next is read. Measured on a warm page cache (16 slabs of 16 MiB), zeroing on
    the loading thread made it the bottleneck (2.6 ms per slab against the reader's 1.7), and
    hashing on the reader thread cost 8% of the load. Reads stay on one thread, sequential: two
    readers halved the speed from a cold cache (read-ahead broken) and gained nothing warm, and
    a second reader for cached pieces only (``RWF_NOWAIT``) was 1.5x slower warm and cold in
    ``benchmarks/checkpoint.py``."""

    def __init__(self, path: str, header: dict[str, Any]) -> None:
        self.path, self.header = path, header
        self.files: dict[Any, Any] = {}
        self.raw: dict[Any, rawio.RawFile] = {}
        self.located: dict[tuple[Any, str], tuple[Any, int | None]] = {}
        self.hard: dict[Any, set[bytes]] = {}  # per part file: its names reached by hard links only
        self.paths: dict[Any, str] = {}
        self.reads: ThreadPoolExecutor | None = None
        self.hashes: ThreadPoolExecutor | None = None
        self.faults: ThreadPoolExecutor | None = None
        self.faulted: Future | None = None
        self.pending: list[tuple[Any, str, str, str, str]] = []

    def close(self) -> None:
        for pool in (self.reads, self.hashes, self.faults):
            if pool is not None:  # no read may still be writing into an array or using a descriptor
                pool.shutdown(wait=True, cancel_futures=True)
        self.reads = self.hashes = self.faults = self.faulted = None
        self.pending = []
        for f in self.files.values():
            f.close()
        for r in self.raw.values():
            r.close()
        self.files.clear()
        self.raw.clear()
        self.located.clear()
        self.hard.clear()

    def _where(self, writer: int | None) -> str:
        if writer not in self.paths:
            self.paths[writer] = part_path(self.path, self.header, writer)
        return self.paths[writer]

    def _file(self, writer: int | None) -> Any:
        import h5py

        if writer not in self.files:
            p = self._where(writer)
            if writer is not None:
                d = os.path.dirname(p)
                if os.path.islink(d) or os.path.islink(p):
                    raise CheckpointError(f"checkpoint {self.path}: {p} is a symbolic link; refused")
                if not os.path.exists(p):
                    raise CheckpointError(f"checkpoint {self.path}: part file {p} is missing")
                regular_file(p, f"checkpoint {self.path}: part file {p}", CheckpointError)
                seal.check_part(self.path, self.header.get("seal"), p)  # before HDF5 parses it
            try:
                self.files[writer] = h5py.File(p, "r")
            except Exception as exc:
                raise CheckpointError(f"checkpoint {self.path}: part file {p} is unreadable ({exc})") from None
        return self.files[writer]

    def _raw(self, writer: int | None) -> rawio.RawFile:
        if writer not in self.raw:
            p = self._where(writer)
            try:
                self.raw[writer] = rawio.RawFile(p)
            except OSError as exc:
                raise CheckpointError(f"checkpoint {self.path}: part file {p} is unreadable ({exc})") from None
        return self.raw[writer]

    def locate(self, entry: dict[str, Any], slab: list) -> tuple[Any, int | None]:
        """Check the slab's dataset (hard links only, stored in its file, the shape and dtype the
        index declares); ``(None, offset of its bytes)`` when they may be read raw, else
        ``(its low-level dataset id, None)``."""
        writer, name, box, _ = slab
        if (writer, name) in self.located:
            return self.located[(writer, name)]
        f = self._file(writer)
        where = self._where(writer)
        if writer not in self.hard:
            self.hard[writer] = hard_names(f, f"checkpoint {self.path}: {where}", CheckpointError)
        try:
            found = open_stored(f, name, self.hard[writer], f"checkpoint {self.path}: {name} in {where}",
                                CheckpointError)
        except KeyError:
            found = None
        if found is None:
            raise CheckpointError(f"checkpoint {self.path}: {name} is missing from {where} (or not a dataset)")
        did, dcpl = found
        shape = tuple(b - a for a, b in box)
        dtype = np.dtype(entry["dtype"])
        if tuple(did.shape) != shape or did.dtype != dtype:
            raise CheckpointError(f"checkpoint {self.path}: {name} in {where} has shape {did.shape} {did.dtype}, "
                                  f"the index declares {shape} {dtype}")
        volume = fmt.volume(tuple(map(tuple, box)))
        offset = rawio.raw_extent(did, dcpl, shape, dtype) if volume else None
        if volume and offset is None and did.get_storage_size() == 0:
            # HDF5 would hand back fill values: never what was saved, and a hostile file could
            # declare gigabytes of them for `ckpt inspect` (which has no model to bound them).
            raise CheckpointError(f"checkpoint {self.path}: {name} in {where} stores no data "
                                  f"(it declares {volume * dtype.itemsize:,} bytes)")
        # A slab read raw needs only its offset: its dataset is closed now (h5py's File.close
        # walks every object still open in the file, ~20 us each).
        self.located[(writer, name)] = (None if offset is not None else did, offset)
        return self.located[(writer, name)]

    def slab(self, key: str, entry: dict[str, Any], slab: list, out: np.ndarray | None = None,
             defer: bool = False) -> np.ndarray:
        """The whole slab, verified against its checksum (read into ``out`` when given: a
        C-contiguous array of the slab's shape and dtype).

        ``defer=True`` (with ``out``): a raw read of 1 MiB or more is handed to the reader thread
        and verified by :meth:`finish`; ``out`` must not be used before that. The calling thread
        meanwhile opens and checks the next slabs (h5py work that needs the GIL the read does
        not). Smaller slabs are read here: handing each to a thread cost more (GIL handoffs)
        than its read."""

        writer, name, box, digest = slab
        obj, offset = self.locate(entry, slab)
        where = self._where(writer)
        shape = tuple(b - a for a, b in box)
        dtype = np.dtype(entry["dtype"])
        if out is None:
            out = np.empty(shape, dtype)
        what = f"checkpoint {self.path}: {name} in {os.path.basename(where)}"
        if defer and offset is not None and out.nbytes >= rawio.PREFAULT_MIN:
            if self.reads is None:
                self.reads = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-ckpt-read")
                self.hashes = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-ckpt-hash")
            read = self.reads.submit(_read, self._raw(writer), offset, out, what, self.faulted)
            fut = self.hashes.submit(_digest, read, out)
            self.pending.append((fut, digest, key, name, where))
            return out
        try:
            if offset is not None:
                self._raw(writer).read(offset, out, what)
            elif out.size:
                import h5py

                h5py.Dataset(obj).read_direct(out)
            got = fmt.digest(out)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"checkpoint {self.path}: cannot read {name} from {where} "
                                  f"({type(exc).__name__}: {exc})") from None
        self._verify(got, digest, key, name, where)
        return out

    def _verify(self, got: str, digest: str, key: str, name: str, where: str) -> None:
        if got != digest:
            raise CheckpointError(f"checkpoint {self.path} is corrupt: checksum mismatch in {key} "
                                  f"(slab {name} of {os.path.basename(where)})")

    def prefault(self, out: np.ndarray) -> None:
        """Have the faulting thread bring ``out``'s pages in; deferred reads submitted after this
        wait for it."""
        if out.nbytes < rawio.PREFAULT_MIN:
            return
        if self.faults is None:
            self.faults = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-ckpt-fault")
        self.faulted = self.faults.submit(rawio.prefault, out)

    def finish(self) -> None:
        """Wait for the deferred reads and verify each (the first failure is raised)."""
        pending, self.pending = self.pending, []
        problem: BaseException | None = None
        for fut, digest, key, name, where in pending:
            try:
                got = fut.result()
                if problem is None:
                    self._verify(got, digest, key, name, where)
            except CheckpointError as exc:
                problem = problem or exc
            except Exception as exc:
                problem = problem or CheckpointError(f"checkpoint {self.path}: cannot read {name} from {where} "
                                                     f"({type(exc).__name__}: {exc})")
        if problem is not None:
            raise problem

    def fill(self, key: str, out: np.ndarray, index: tuple, defer: bool = False) -> None:
        """Fill ``out`` (the local array of ``index``) from the slabs of ``key``; every slab read is
        read whole and verified, once (``defer``: see :meth:`slab`; call :meth:`finish`)."""
        entry = self.header["index"][key]
        full = tuple(entry["shape"])
        covered = 0
        cache: dict[int, np.ndarray] = {}
        for box, view in fmt.boxes(index, full):
            dest = view(out)
            for i, slab in enumerate(entry["slabs"]):
                sbox = tuple(map(tuple, slab[2]))
                common = fmt.intersect(box, sbox)
                if common is None:
                    continue
                covered += fmt.volume(common)
                if common == sbox == box and dest.flags.c_contiguous and dest.dtype == np.dtype(entry["dtype"]):
                    self.slab(key, entry, slab, out=dest, defer=defer)  # straight into place: no second copy
                    continue
                if i not in cache:
                    cache[i] = self.slab(key, entry, slab)
                dest[fmt.rel(common, box)] = cache[i][fmt.rel(common, sbox)]
        if covered != out.size:
            raise CheckpointError(f"checkpoint {self.path}: {key} is not fully covered by its slabs")
