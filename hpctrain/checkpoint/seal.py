"""Whole-file digests: every byte of a checkpoint's files is verified before HDF5 parses any of it.

HDF5 trusts its own metadata: one flipped byte in it can crash the process inside the library (a
segfault no Python code can catch), make it misread a name, or surface as an arbitrary Python
error. The per-slab checksums (:mod:`.format`) cover the data only, and only once HDF5 has parsed
the file. So the index file starts with a *seal* in its HDF5 user block (bytes HDF5 sets aside
and never reads; plain h5py opens the file as before)::

    b"HPCTSEAL" | manifest length (u64 LE) | XXH3-64 of the manifest (u64 LE) | manifest (JSON)

then zeros to the end of the user block. The manifest records the user block's size, the index
file's size and the XXH3-64 digest of its bytes after the user block, the part directory's name
and each part file's size and digest: every byte of every file is covered.
Readers check the seal and the index file's digest before h5py opens the index, and a part file's
size and digest before h5py opens that part file: any damage is then a ``CheckpointError`` naming
the file.

A checkpoint written before seals existed has HDF5's signature at byte 0 (no user block): it
loads, with a warning, as before (unprotected against damaged HDF5 metadata); a new save seals.

XXH3 catches damage, not forgery: anyone can change a file and seal it again. With a key of the
user's (``HPCTRAIN_CHECKPOINT_KEY`` or ``HPCTRAIN_CHECKPOINT_KEY_FILE``, ``settings.checkpoint_key``)
saves also *sign*: the manifest gains ``keyed`` = ``{"alg": "hmac-sha256", "key_id", "files":
{"index": HMAC of the index file's bytes after the user block, part file: HMAC of its bytes},
"mac": HMAC of the manifest with these}``, each part's HMAC computed by the rank that wrote it in
the same pass as its XXH3 digest. With a key set, readers accept only files signed with it: the
manifest's MAC, then each file's bytes, are verified before HDF5 opens that file, so a file from
elsewhere that was not signed with the key is refused before HDF5 parses a byte of it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from .. import settings
from ..errors import CheckpointError
from ..files.h5safe import regular_mode
from ..log import get_logger
from . import format as fmt

MAGIC = b"HPCTSEAL"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_HEAD = struct.Struct("<8sQQ")
_PART_FILE = re.compile(r"w\d{5,}\.h5")
#: The largest manifest read (a part entry is ~50 bytes: room for ~300,000 writers).
MAX_MANIFEST = 16 << 20
#: Bytes per read while hashing a file.
BLOCK = 8 << 20

#: The signature's algorithm (``keyed["alg"]``).
MAC_ALG = "hmac-sha256"
_MAC_HEX = 64

_log = get_logger("checkpoint")
_warned: set[str] = set()


def new_mac(key: bytes) -> Any:
    """An HMAC-SHA256 of ``key``, fed a file's bytes as they are hashed (hashlib drops the GIL)."""
    return hmac.new(key, digestmod=hashlib.sha256)


def key_id(key: bytes) -> str:
    """A short name of ``key`` that does not reveal it: which key signed a file
    (``settings.key_id``, which the ranks also compare at start)."""
    return settings.key_id(key)


def _manifest_mac(key: bytes, manifest: dict[str, Any]) -> str:
    """The HMAC of ``manifest`` with its ``keyed`` entries but the MAC itself (canonical JSON)."""
    keyed = {k: v for k, v in manifest["keyed"].items() if k != "mac"}
    body = json.dumps({**manifest, "keyed": keyed}, separators=(",", ":"), sort_keys=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def _open(path: str, where: str) -> int:
    """A read descriptor of the regular file ``path`` (``O_NONBLOCK``: a FIFO never blocks)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        regular_mode(os.fstat(fd).st_mode, where, CheckpointError)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = os.pread(fd, n - len(out), offset + len(out))
        if not got:
            break
        out += got
    return bytes(out)


def fd_digest(fd: int, start: int, stop: int, where: str = "the file", mac: Any = None) -> str:
    """XXH3-64 hex digest of the bytes ``[start, stop)`` of an open file, streamed (the same
    digest :func:`.format.digest` gives those bytes held in memory); ``mac`` (an HMAC) is fed the
    same bytes in the same pass. A second thread reads the next block while this one hashes the
    last (both release the GIL): from a cold cache the pass then costs about the read alone."""
    h = xxhash.xxh3_64()
    hashers = (h,) if mac is None else (h, mac)
    if stop - start <= BLOCK:
        block = _read_block(fd, bytearray(stop - start), start, where)
        for x in hashers:
            x.update(block)
        return h.hexdigest()
    bufs = (bytearray(BLOCK), bytearray(BLOCK))
    with ThreadPoolExecutor(1, thread_name_prefix="hpctrain-ckpt-seal") as pool:
        pending = pool.submit(_read_block, fd, bufs[0], start, where)
        at, i = start, 0
        while pending is not None:
            block = pending.result()
            at += len(block)
            i = 1 - i
            pending = (pool.submit(_read_block, fd, memoryview(bufs[i])[: min(BLOCK, stop - at)], at, where)
                       if at < stop else None)
            for x in hashers:  # while the other buffer fills
                x.update(block)
    return h.hexdigest()


def _read_block(fd: int, buf: Any, at: int, where: str) -> memoryview:
    """Fill ``buf`` from the file at ``at``; a short file is a ``CheckpointError``."""
    view = memoryview(buf)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], at + done)
        if n <= 0:
            raise CheckpointError(f"{where} ended at byte {at + done} while it was hashed (truncated meanwhile)")
        done += n
    return view


def pieces_digest(fd: int, size: int, extents: list[tuple[int, Any]]) -> list[str]:
    """``[XXH3-64]`` of a whole file of ``size`` bytes whose ``extents`` ``(offset, bytes-like)``
    are known in memory (what was just written there): only the bytes between them are read back
    (HDF5 metadata, padding), so a save hashes its data without reading it from the disk. With a
    checkpoint key set, ``[XXH3-64, HMAC, key id]`` (the part's signature, in the same pass)."""
    key = settings.checkpoint_key()
    h = xxhash.xxh3_64()
    hashers = (h,) if key is None else (h, new_mac(key))
    at = 0

    def feed(data: Any) -> None:
        for x in hashers:
            x.update(data)

    for offset, data in sorted(extents, key=lambda e: e[0]):
        if offset > at:
            feed(_pread(fd, offset - at, at))
        feed(data)
        at = offset + len(data)
    if size > at:
        feed(_pread(fd, size - at, at))
    return [h.hexdigest()] if key is None else [h.hexdigest(), hashers[1].hexdigest(), key_id(key)]


# -- writing ---------------------------------------------------------------------------------


def block_size(parts_dir: str, parts: dict[str, list]) -> int:
    """The user block the index file needs for its seal (a power of two, at least 512, as HDF5
    requires), from the manifest's size with the largest digests and sizes it may hold (and the
    signature's entries, with a checkpoint key set)."""
    keyed = None
    if settings.checkpoint_key() is not None:
        files = {name: "f" * _MAC_HEX for name in ["index", *parts]}
        keyed = {"alg": MAC_ALG, "key_id": "f" * 16, "files": files, "mac": "f" * _MAC_HEX}
    longest = _manifest(parts_dir, {k: v[:2] for k, v in parts.items()}, 1 << 62, 1 << 62, "f" * 16, keyed)
    n = 512
    while n < _HEAD.size + len(longest):
        n *= 2
    return n


def _manifest(parts_dir: str, parts: dict[str, list], block: int, size: int, digest: str,
              keyed: dict[str, Any] | None = None) -> bytes:
    m: dict[str, Any] = {"block": block, "size": size, "digest": digest, "parts_dir": parts_dir, "parts": parts}
    if keyed is not None:
        m["keyed"] = keyed
    return json.dumps(m, separators=(",", ":"), sort_keys=True).encode()


def write(path: str, block: int, parts_dir: str, parts: dict[str, list]) -> None:
    """Seal the index file ``path`` (written by h5py with ``userblock_size=block``, closed):
    hash its bytes after the user block and write the seal into it; with a checkpoint key, sign
    it (``parts``' entries then carry each part's HMAC and key id, :func:`pieces_digest`).
    The caller fsyncs."""
    key = settings.checkpoint_key()
    plain = {name: list(v[:2]) for name, v in parts.items()}
    if key is not None:
        unsigned = sorted(name for name, v in parts.items() if len(v) < 4 or v[3] != key_id(key))
        if unsigned:
            raise CheckpointError(f"{path}: part file(s) {', '.join(unsigned[:4])} were not signed with this "
                                  "rank's checkpoint key (HPCTRAIN_CHECKPOINT_KEY[_FILE] must be the same on every "
                                  "rank)")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        mac = new_mac(key) if key is not None else None
        digest = fd_digest(fd, block, size, mac=mac)
        keyed = None
        if key is not None:
            files = {"index": mac.hexdigest(), **{name: v[2] for name, v in parts.items()}}
            keyed = {"alg": MAC_ALG, "key_id": key_id(key), "files": files}
            keyed["mac"] = _manifest_mac(key, {"block": block, "size": size, "digest": digest,
                                               "parts_dir": parts_dir, "parts": plain, "keyed": keyed})
        body = _manifest(parts_dir, plain, block, size, digest, keyed)
        head = _HEAD.pack(MAGIC, len(body), xxhash.xxh3_64_intdigest(body)) + body
        if len(head) > block:  # block_size() allows for the longest numbers: never happens
            raise CheckpointError(f"{path}: the seal ({len(head)} bytes) does not fit the user block ({block})")
        os.pwrite(fd, head + bytes(block - len(head)), 0)  # the rest of the block zeros (checked)
    finally:
        os.close(fd)


# -- checking --------------------------------------------------------------------------------


def read(path: str, *, verify: bool = True) -> dict[str, Any] | None:
    """The manifest of the index file ``path``, its seal checked (and with ``verify`` the file's
    size and every byte of it against it, and with a checkpoint key its signature); ``None`` for
    a checkpoint written before seals (logged once; refused with a key set). Reads no HDF5.
    ``CheckpointError`` naming the file for any damage or a missing or wrong signature."""
    key = settings.checkpoint_key() if verify else None
    fd = _open(path, f"checkpoint {path}")
    try:
        size = os.fstat(fd).st_size
        first = _pread(fd, _HEAD.size, 0)
        if first[: len(HDF5_SIGNATURE)] == HDF5_SIGNATURE:
            if key is not None:
                raise CheckpointError(f"checkpoint {path} is not signed (written before seals existed): with a "
                                      "checkpoint key set (HPCTRAIN_CHECKPOINT_KEY[_FILE]) only checkpoints signed "
                                      "with it load")
            if path not in _warned:
                _warned.add(path)
                _log.warning("checkpoint %s has no whole-file digest (written by an older hpctrain): its "
                             "HDF5 metadata cannot be verified before it is read; a new save adds one", path)
            return None
        manifest = _manifest_of(fd, first, size if verify else None, path)
        mac = _signed_manifest(manifest, key, path) if key is not None else None
        if verify and fd_digest(fd, manifest["block"], size, f"checkpoint {path}", mac) != manifest["digest"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: its bytes do not match its whole-file digest")
        if mac is not None and not hmac.compare_digest(mac.hexdigest(), manifest["keyed"]["files"]["index"]):
            raise CheckpointError(f"checkpoint {path} is forged: its bytes do not match its signature")
        return manifest
    except OSError as exc:  # a read error (EIO): the file is unreadable, said as such
        raise CheckpointError(f"checkpoint {path} is unreadable ({exc})") from None
    finally:
        os.close(fd)


def _signed_manifest(manifest: dict[str, Any], key: bytes, path: str) -> Any:
    """Check that ``manifest`` is signed with ``key`` (its own MAC); returns the HMAC to feed the
    index file's bytes to. ``CheckpointError`` when unsigned, signed with another key, or forged."""
    keyed = manifest.get("keyed")
    if keyed is None:
        raise CheckpointError(f"checkpoint {path} is not signed: with a checkpoint key set "
                              "(HPCTRAIN_CHECKPOINT_KEY[_FILE]) only checkpoints signed with it load")
    if not hmac.compare_digest(keyed["key_id"], key_id(key)):
        raise CheckpointError(f"checkpoint {path} is signed with another key (key id {keyed['key_id']}, yours is "
                              f"{key_id(key)})")
    if not hmac.compare_digest(keyed["mac"], _manifest_mac(key, manifest)):
        raise CheckpointError(f"checkpoint {path} is forged: its seal does not match its signature")
    return new_mac(key)


def _manifest_of(fd: int, first: bytes, size: int | None, path: str) -> dict[str, Any]:
    """Parse and check the seal whose first bytes are ``first`` (and the file's ``size``, if
    given, against the size it records)."""
    bad = f"checkpoint {path} is damaged or not a readable HDF5 file"
    if len(first) < _HEAD.size:
        raise CheckpointError(f"{bad}: {len(first)} bytes, too short for a checkpoint")
    magic, n, want = _HEAD.unpack(first)
    if magic != MAGIC:
        raise CheckpointError(f"{bad}: no seal at its start (neither {MAGIC.decode()} nor HDF5's signature)")
    if n > MAX_MANIFEST:
        raise CheckpointError(f"{bad}: its seal declares a {n:,}-byte manifest")
    body = _pread(fd, n, _HEAD.size)
    if len(body) < n:
        raise CheckpointError(f"{bad}: it ends inside its seal (truncated)")
    if xxhash.xxh3_64_intdigest(body) != want:
        raise CheckpointError(f"checkpoint {path} is corrupt: checksum mismatch in its seal")
    try:
        m = json.loads(body)
        block, declared = int(m["block"]), int(m["size"])
        parts = {str(k): (int(v[0]), str(v[1])) for k, v in m["parts"].items()}
        keyed = m.get("keyed")
        m = {"block": block, "size": declared, "digest": str(m["digest"]), "parts_dir": str(m["parts_dir"]),
             "parts": parts}
        if keyed is not None:
            m["keyed"] = {"alg": str(keyed["alg"]), "key_id": str(keyed["key_id"]), "mac": str(keyed["mac"]),
                          "files": {str(k): str(v) for k, v in keyed["files"].items()}}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"{bad}: damaged seal ({type(exc).__name__}: {exc})") from None
    if size is not None and declared != size:
        raise CheckpointError(f"checkpoint {path} is corrupt: {size:,} bytes, its seal records {declared:,} "
                              f"({'truncated' if size < declared else 'bytes added'})")
    if block < _HEAD.size + n or block > declared or block & (block - 1):
        raise CheckpointError(f"{bad}: its seal declares a {block}-byte user block")
    if not fmt.PARTS_NAME.fullmatch(m["parts_dir"]) or any(not _PART_FILE.fullmatch(k) for k in parts):
        raise CheckpointError(f"{bad}: its seal names part files outside its own part directory")
    keyed = m.get("keyed")
    if keyed is not None and (keyed["alg"] != MAC_ALG or set(keyed["files"]) != {"index", *parts}):
        raise CheckpointError(f"{bad}: its signature is not one this hpctrain writes ({keyed['alg']}, files "
                              f"{sorted(keyed['files'])[:4]})")
    if size is not None and any(_pread(fd, block - _HEAD.size - n, _HEAD.size + n)):
        # (the digest covers the bytes after the block; these are covered by being zeros)
        raise CheckpointError(f"checkpoint {path} is corrupt: damaged bytes after its seal")
    return m


def check_part(index: str, manifest: dict[str, Any] | None, part: str) -> None:
    """Verify the part file ``part`` of the checkpoint ``index`` against the size and digest its
    seal records, before HDF5 opens it (nothing to check for a checkpoint without a seal)."""
    if manifest is None:
        return
    name = os.path.basename(part)
    if os.path.basename(os.path.dirname(part)) != manifest["parts_dir"] or name not in manifest["parts"]:
        raise CheckpointError(f"checkpoint {index}: part file {part} is not one its seal lists")
    want_size, want = manifest["parts"][name]
    key = settings.checkpoint_key()
    if key is not None and "keyed" not in manifest:  # (read() refused it already, unless the key came since)
        raise CheckpointError(f"checkpoint {index} is not signed: with a checkpoint key set only checkpoints "
                              "signed with it load")
    mac = new_mac(key) if key is not None else None
    fd = _open(part, f"checkpoint {index}: part file {part}")
    try:
        size = os.fstat(fd).st_size
        if size != want_size:
            raise CheckpointError(f"checkpoint {index} is corrupt: part file {part} has {size:,} bytes, its "
                                  f"seal records {want_size:,} ({'truncated' if size < want_size else 'bytes added'})")
        if fd_digest(fd, 0, size, f"checkpoint {index}: part file {part}", mac) != want:
            raise CheckpointError(f"checkpoint {index} is corrupt: part file {part} does not match its "
                                  f"whole-file digest")
        if mac is not None and not hmac.compare_digest(mac.hexdigest(), manifest["keyed"]["files"][name]):
            raise CheckpointError(f"checkpoint {index} is forged: part file {part} does not match its signature")
    except OSError as exc:
        raise CheckpointError(f"checkpoint {index}: part file {part} is unreadable ({exc})") from None
    finally:
        os.close(fd)


def parts_dir(path: str) -> str:
    """The part directory an index file names: from its seal (no HDF5 read), or for a checkpoint
    without one from its ``parts`` attribute."""
    manifest = read(path, verify=False)
    if manifest is not None:
        return manifest["parts_dir"]
    from ..files.h5safe import open_file

    with open_file(path, f"checkpoint {path}", CheckpointError) as f:
        return str(f.attrs.get("parts", ""))
