"""Loading is a transaction: read and verify everything into temporaries, agree, then commit.

Rank 0 checks the index file (format, header checksum, no links or foreign storage, the piece
table well formed) and broadcasts it with the small state arrays. Every rank then checks the
shape and dtype the checkpoint declares for each tensor it holds against the model *before
reading*, reads the slabs that intersect its pieces from the part files, and verifies each slab's
checksum as it is read. The ranks agree (one small allgather); only then is the trainer changed.
If its ``load_state_dict`` fails on any rank, every rank puts everything back. Any failure leaves
parameters, optimizer state, counters, RNG states and the sampler position bitwise as they were.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..backend import to_device, xp_of
from ..errors import CheckpointError
from ..h5safe import check_stored_here, check_tree, hard_names, open_stored, regular_file
from . import format as fmt
from . import rawio, seal
from .saving import optimizer_of, wait

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


# -- reading slabs ---------------------------------------------------------------------------


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


# -- load ------------------------------------------------------------------------------------


def _agreed_header(path: str, comm: Any) -> dict[str, Any]:
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


def _wanted(trainer: Any) -> dict[str, tuple[Any, tuple, tuple]]:
    """{key: (parameter, full shape, index)} for what this rank holds (parameters and the
    optimizer's state keys)."""
    opt = optimizer_of(trainer)
    keys = getattr(opt, "state_keys", ()) if opt is not None else ()
    out: dict[str, tuple[Any, tuple, tuple]] = {}
    for name, (param, full_shape, index) in trainer.shards().items():
        full_shape = tuple(int(n) for n in full_shape)
        index = fmt.norm_index(index, full_shape)
        out[f"model/{name}"] = (param, full_shape, index)
        for key in keys:
            out[f"optim/{name}/{key}"] = (param, full_shape, index)
    return out


def stage(path: str, trainer: Any, header: dict[str, Any],
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
    try:
        pieces = _wanted(trainer)
        wanted = {k for k in pieces if k.startswith("model/")}
        # Shapes and dtypes first: nothing is read for a model the checkpoint does not fit.
        for key, (param, full_shape, _) in pieces.items():
            entry = index.get(key)
            if entry is None:
                if key.startswith("model/"):
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
            for key in sorted(k for k in pieces if k in index):
                param, full_shape, idx = pieces[key]
                out = rawio.staging_empty(fmt.local_shape(idx, full_shape), np.dtype(index[key]["dtype"]))
                reader.prefault(out)
                reader.fill(key, out, idx, defer=True)
                outs.append((key, param, out))
            if tree:  # (on a thread of its own, its HDF5 calls and the slabs' checks took turns: 1.7x slower)
                problems += _tree_problems(path, header)
            reader.finish()
        for key, param, out in outs:
            staged[key] = to_device(out, xp_of(param.data)).astype(param.dtype, copy=False)
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


def load(path: str, trainer: Any) -> dict[str, Any]:
    """Restore ``trainer`` from ``path`` (collective). Returns the checkpoint's header.

    The saved layout may differ from the trainer's: every rank reads the slices it holds now.
    A missing file raises ``FileNotFoundError`` and a corrupt, truncated, foreign or ill-fitting
    one a ``CheckpointError``, on every rank, with the trainer exactly as it was.
    """
    from ..comm.validate import raise_if_any

    wait(trainer)
    comm = trainer.comm
    header = _agreed_header(path, comm)
    staged, problems, wanted = stage(path, trainer, header, tree=comm.rank == 0)
    everyone = comm.allgather_obj((problems, sorted(wanted)))
    all_problems = list(dict.fromkeys(p for ps, _ in everyone for p in ps))
    corrupt = [p for p in all_problems if "fit this model" not in p and p.startswith("checkpoint ")]
    if corrupt:
        raise CheckpointError("; ".join(corrupt[:4]))
    stored = {k for k in header["index"] if k.startswith("model/")}
    all_wanted = set().union(*(set(w) for _, w in everyone))
    all_problems += [f"{k[6:]} is in the checkpoint but not in the model" for k in sorted(stored - all_wanted)]
    if all_problems:
        raise CheckpointError(f"checkpoint {path} does not fit this model: " + "; ".join(all_problems[:6]))
    try:
        state = fmt.from_json(header["trainer_state"], header["state_arrays"])
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: damaged trainer state ({type(exc).__name__}: {exc})") from None
    problem = commit(trainer, staged, state, header)
    raise_if_any(comm, problem, what=f"checkpoint {path}: cannot restore the trainer state (nothing was changed)")
    header.pop("state_arrays", None)
    return header


def commit(trainer: Any, staged: dict[str, Any], state: Any, header: dict[str, Any]) -> BaseException | None:
    """Put verified temporaries into ``trainer``; if its ``load_state_dict`` fails on any rank,
    every rank puts everything back. Returns this rank's problem (``None`` when all is well)."""
    opt = optimizer_of(trainer)
    shards = trainer.shards()
    restore_small = _small_state(trainer)
    backup_params: dict[str, Any] = {}
    backup_opt: dict[str, Any] = {}
    old_step = getattr(opt, "step_count", None)
    # Parameters are copied in place (their arrays may be views into flat buffers); a parameter's
    # optimizer state is replaced as a whole dict, so the old dict is its own backup.
    new_opt: dict[str, dict[str, Any]] = {}
    for key, data in staged.items():
        kind, name = key.split("/", 1)
        if kind == "model":
            param = shards[name][0]
            if _swappable(param.data, data):
                backup_params[name] = param.data  # the old array is the backup: no copy at all
                param.data = data
            else:
                backup_params[name] = param.data.copy()
                param.data[...] = data
        else:
            pname, skey = name.rsplit("/", 1)
            new_opt.setdefault(shards[pname][0].name, {})[skey] = data
    if opt is not None:
        for pname, entries in new_opt.items():
            backup_opt[pname] = opt.state.get(pname)
            opt.state[pname] = {**(opt.state.get(pname) or {}), **entries}
        if header["optimizer"]:
            opt.step_count = int(header["optimizer"]["step"])
    problem = None
    try:
        trainer.load_state_dict(state)
    except Exception as exc:
        problem = CheckpointError(f"{type(exc).__name__}: {exc}")
    failed = trainer.comm.allgather_obj(problem is not None)
    if not any(failed):
        return None
    for name, old in backup_params.items():
        param = shards[name][0]
        if param.data is staged[f"model/{name}"]:
            param.data = old
        else:
            param.data[...] = old
    if opt is not None:
        for pname, old in backup_opt.items():
            if old is None:
                opt.state.pop(pname, None)
            else:
                opt.state[pname] = old
        opt.step_count = old_step
    restore_small()
    return problem if problem is not None else CheckpointError("another rank failed")


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


def _small_state(trainer: Any) -> Any:
    """A closure that puts back what ``load_state_dict`` may change besides the arrays: counters,
    module RNG states, the sampler's position and the state a strategy keeps of its own."""
    names = ("global_step", "epoch", "_pending_sampler", "clock", "_seen")
    attrs = {k: copy.deepcopy(getattr(trainer, k)) for k in names if hasattr(trainer, k)}
    velocity = getattr(trainer, "_velocity", None)
    velocity = None if velocity is None else velocity.copy()
    modules: list[Any] = []
    for attr in ("model", "stage"):
        m = getattr(trainer, attr, None)
        if m is not None and hasattr(m, "named_modules"):
            modules += [mod for _, mod in m.named_modules()]
    rngs = [(m, copy.deepcopy(m.rng.bit_generator.state)) for m in modules
            if isinstance(getattr(m, "rng", None), np.random.Generator)]
    sampler = getattr(trainer, "_sampler", None)
    sampler_state = copy.deepcopy(sampler.state_dict()) if hasattr(sampler, "state_dict") else None
    scaler = getattr(getattr(trainer, "precision", None), "scaler", None)  # fp16's loss scale
    scaler_snap = scaler.snapshot() if scaler is not None else None
    pieces = getattr(getattr(trainer, "reducer", None), "snapshot", None)  # ZeRO's sharded pieces
    put_pieces_back = pieces() if pieces is not None else None

    def restore() -> None:
        for k, v in attrs.items():
            setattr(trainer, k, v)
        if velocity is not None:
            trainer._velocity[...] = velocity
        for m, st in rngs:
            m.rng.bit_generator.state = st
        if sampler_state is not None:
            sampler.load_state_dict(sampler_state)
        if scaler_snap is not None:
            scaler.restore(scaler_snap)
        if put_pieces_back is not None:
            put_pieces_back()
        sync = getattr(trainer, "sync_params", None)
        if sync is not None:  # mixed precision: the compute copy from the masters just put back
            sync()

    return restore


def load_weights(path: str, model: Any) -> dict[str, Any]:
    """Read the parameters of a checkpoint into a whole (serial) ``model``; no MPI, no trainer.

    For evaluation and sampling: the header and every slab read are checked against their
    checksums, and the names and shapes must match the model's exactly (a ``CheckpointError``
    lists what differs; the model is unchanged then). Returns the header.
    """
    header = read_header(path, with_state=False)
    params = dict(model.named_parameters())
    stored = {k[len("model/"):] for k in header["index"] if k.startswith("model/")}
    problems = [f"{n} is not in the checkpoint" for n in sorted(set(params) - stored)]
    problems += [f"{n} is in the checkpoint but not in the model" for n in sorted(stored - set(params))]
    for name in sorted(set(params) & stored):
        shape = tuple(header["index"][f"model/{name}"]["shape"])
        if shape != tuple(params[name].data.shape):
            problems.append(f"{name}: checkpoint has shape {shape}, model needs {tuple(params[name].data.shape)}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this model: " + "; ".join(problems[:6]))
    arrays: dict[str, np.ndarray] = {}
    reader = Reader(path, header)
    try:
        for name in sorted(params):
            entry = header["index"][f"model/{name}"]
            out = np.empty(tuple(entry["shape"]), np.dtype(entry["dtype"]))
            reader.fill(f"model/{name}", out, tuple(slice(0, n) for n in out.shape))
            arrays[name] = out
    finally:
        reader.close()
    for name, data in arrays.items():
        p = params[name]
        p.data[...] = to_device(data.astype(p.data.dtype, copy=False), xp_of(p.data))
    return header
