"""Environment settings, parsed in one place and refused at startup when malformed.

Every ``HPCTRAIN_*`` variable hpctrain reads goes through this module, so a bad value is one
clear ``ConfigError`` line (naming the variable and what it accepts) instead of being ignored by
one component, refused by another and crashing a third mid-training.
"""

from __future__ import annotations

import math
import os

from .errors import ConfigError

#: Seconds a blocking wait may last before the stall watchdog ends the job.
DEFAULT_TIMEOUT = 300.0


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    """``float(os.environ[name])``, ``default`` when unset or blank; ``ConfigError`` when it is
    not a finite number (or is below ``minimum``)."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} must be a finite number")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum:g}")
    return value


def resolve_timeout(timeout: float | None = None) -> float:
    """The timeout in seconds a wait may last: ``timeout`` if given, else ``HPCTRAIN_TIMEOUT``
    (default 300). ``0`` means *off* everywhere (no watchdog, waits without limit); negative,
    non-finite or non-numeric values raise ``ConfigError``."""
    if timeout is None:
        return env_float("HPCTRAIN_TIMEOUT", DEFAULT_TIMEOUT, minimum=0.0)
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise ConfigError(f"timeout must be a number of seconds (0 = off), got {timeout!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"timeout must be a finite number of seconds >= 0 (0 = off), got {timeout!r}")
    return value


def timeout_deadline_seconds(timeout: float | None = None) -> float | None:
    """``resolve_timeout`` for a polling loop: ``None`` when off (wait forever), else seconds."""
    value = resolve_timeout(timeout)
    return None if value == 0 else value


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_bool(name: str, default: bool | None = False) -> bool | None:
    """A switch: 1/true/yes/on or 0/false/no/off (any case); ``default`` when unset or blank."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} must be 0 or 1 (or true/false, yes/no, on/off)")


def env_int(name: str, *, minimum: int = 0) -> int | None:
    """A whole number >= ``minimum``, ``None`` when unset or blank."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum}")
    return value


def debug() -> bool:
    """``HPCTRAIN_DEBUG``: fingerprint every communication call and compare it across ranks."""
    return bool(env_bool("HPCTRAIN_DEBUG", False))


def cuda_aware() -> bool | None:
    """``HPCTRAIN_CUDA_AWARE``: force (1) or forbid (0) handing device buffers to MPI; ``None``
    lets hpctrain find out."""
    return env_bool("HPCTRAIN_CUDA_AWARE", None)


def device() -> int | None:
    """``HPCTRAIN_DEVICE``: the GPU this process uses (``None``: local rank modulo the GPUs)."""
    return env_int("HPCTRAIN_DEVICE")


def local_rank() -> int | None:
    """``HPCTRAIN_LOCAL_RANK``: this process's rank on its node, overriding the launcher's."""
    return env_int("HPCTRAIN_LOCAL_RANK")


def data_dir() -> str | None:
    """``HPCTRAIN_DATA``: where the built-in data sets are written (``None``: the default)."""
    raw = os.environ.get("HPCTRAIN_DATA", "")
    return raw if raw.strip() else None


def node_name() -> str | None:
    """``HPCTRAIN_NODE_NAME``: the node this rank claims to be on, overriding the host name (tests
    of multi-node layouts on one machine; ``None``: the host's name)."""
    raw = os.environ.get("HPCTRAIN_NODE_NAME", "").strip()
    if raw and not raw.isprintable():
        raise ConfigError(f"HPCTRAIN_NODE_NAME={raw!r} must be a printable name")
    return raw or None


#: The ways gradient buckets in flight progress (``hpctrain.comm.progress`` implements them; the
#: names live here so that settings, which every layer reads, knows nothing of comm).
PROGRESS = ("poll", "thread", "none")


def progress() -> str:
    """How gradient buckets in flight progress during backward: ``HPCTRAIN_PROGRESS`` (``poll``,
    ``thread`` or ``none``; default ``poll``), see ``hpctrain.comm.progress``."""
    raw = os.environ.get("HPCTRAIN_PROGRESS", "").strip().lower()
    if not raw:
        return "poll"
    if raw not in PROGRESS:
        raise ConfigError(f"HPCTRAIN_PROGRESS={raw!r} must be one of {', '.join(PROGRESS)}")
    return raw


def fused() -> bool | None:
    """``HPCTRAIN_FUSED``: use the fused CPU kernels (1; needs Numba), never (0), or when Numba is
    importable (unset, the default); see ``hpctrain.nn.fused``."""
    return env_bool("HPCTRAIN_FUSED", None)


def cuda_kernels() -> bool | None:
    """``HPCTRAIN_CUDA_KERNELS``: use hpctrain's CUDA kernels on CuPy arrays (1; needs a GPU),
    never (0: CuPy's generic operations), or whenever CuPy has a GPU (unset, the default); see
    ``hpctrain.nn.gpu``."""
    return env_bool("HPCTRAIN_CUDA_KERNELS", None)


#: The shortest checkpoint key accepted (bytes): an HMAC key shorter than this is guessable.
MIN_KEY_BYTES = 16


KEY_VARIABLES = ("HPCTRAIN_CHECKPOINT_KEY", "HPCTRAIN_CHECKPOINT_KEY_FILE")


def checkpoint_key() -> bytes | None:
    """The key checkpoints are signed and verified with (an HMAC over every byte of their files,
    see ``hpctrain.checkpoint.seal``): ``HPCTRAIN_CHECKPOINT_KEY`` (the key itself) or
    ``HPCTRAIN_CHECKPOINT_KEY_FILE`` (a file holding it; a trailing newline is not part of it).
    ``None`` when neither is set: checkpoints are then sealed against damage, not signed.

    A variable set but empty, or a key of blanks only, is refused (``ConfigError``): it would
    otherwise turn signing off (or sign with a guessable key) without a word. The ranks of a job
    compare :func:`key_id` at start (the world ``Communicator``), never the key itself."""
    for name in KEY_VARIABLES:
        if name in os.environ and not os.environ[name].strip():
            raise ConfigError(f"{name} is set but empty: that would turn checkpoint signing off without a word; "
                              "unset it to write unsigned checkpoints, or give a key (e.g. `openssl rand -hex 32`)")
    raw = os.environ.get("HPCTRAIN_CHECKPOINT_KEY", "")
    path = os.environ.get("HPCTRAIN_CHECKPOINT_KEY_FILE", "").strip()
    if raw and path:
        raise ConfigError("HPCTRAIN_CHECKPOINT_KEY and HPCTRAIN_CHECKPOINT_KEY_FILE are both set: give one")
    if not raw and not path:
        return None
    key = raw.encode()
    if path:
        if not os.path.isfile(path):  # (not a FIFO either: its open would block)
            raise ConfigError(f"HPCTRAIN_CHECKPOINT_KEY_FILE={path!r} is not a readable file")
        try:
            with open(path, "rb") as f:
                key = f.read(1 << 16).rstrip(b"\r\n")
        except OSError as exc:
            raise ConfigError(f"HPCTRAIN_CHECKPOINT_KEY_FILE={path!r} cannot be read ({exc.strerror})") from None
    where = "HPCTRAIN_CHECKPOINT_KEY_FILE's file" if path else "HPCTRAIN_CHECKPOINT_KEY"
    if not key.strip():
        raise ConfigError(f"{where} is empty or holds only blanks: a checkpoint key has at least {MIN_KEY_BYTES} "
                          "bytes that are not all blanks (e.g. `openssl rand -hex 32`)")
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{where} holds a {len(key)}-byte key: a checkpoint key has at least {MIN_KEY_BYTES} "
                          "bytes (e.g. `openssl rand -hex 32`)")
    return key


def key_id(key: bytes) -> str:
    """A short name of ``key`` that does not reveal it: which key signed a checkpoint (its
    manifest records it), and what the ranks of a job compare to agree on one key."""
    import hashlib
    import hmac

    return hmac.new(key, b"hpctrain checkpoint key", hashlib.sha256).hexdigest()[:16]


def checkpoint_key_id() -> str | None:
    """:func:`key_id` of :func:`checkpoint_key` (``None``: no key set)."""
    key = checkpoint_key()
    return None if key is None else key_id(key)


#: Every HPCTRAIN_* variable the library reads, with its parser (``check_environment`` runs them).
PARSERS = {
    "HPCTRAIN_TIMEOUT": resolve_timeout,
    "HPCTRAIN_DEBUG": debug,
    "HPCTRAIN_CUDA_AWARE": cuda_aware,
    "HPCTRAIN_DEVICE": device,
    "HPCTRAIN_LOCAL_RANK": local_rank,
    "HPCTRAIN_NODE_NAME": node_name,
    "HPCTRAIN_DATA": data_dir,
    "HPCTRAIN_PROGRESS": progress,
    "HPCTRAIN_FUSED": fused,
    "HPCTRAIN_CUDA_KERNELS": cuda_kernels,
    "HPCTRAIN_CHECKPOINT_KEY": checkpoint_key,
    "HPCTRAIN_CHECKPOINT_KEY_FILE": checkpoint_key,
}


def check_environment() -> None:
    """Parse every ``HPCTRAIN_*`` variable hpctrain reads; the first bad one raises ``ConfigError``.

    Called when the world ``Communicator`` is created (and by ``hpctrain train`` before anything
    else), so a malformed setting stops the job at startup, on every rank alike, not mid-training.
    """
    for parse in PARSERS.values():
        parse()


#: ``--hdf5-locking`` / ``HPCTRAIN_HDF5_LOCKING`` values -> HDF5's own ``HDF5_USE_FILE_LOCKING``.
HDF5_LOCKING = {"on": "TRUE", "off": "FALSE", "best-effort": "BEST_EFFORT"}


def hdf5_locking_env() -> str | None:
    """``HPCTRAIN_HDF5_LOCKING`` (on, off, best-effort; ``None`` when unset), checked only:
    ``hdf5_locking`` applies it."""
    value = os.environ.get("HPCTRAIN_HDF5_LOCKING", "").strip().lower() or None
    if value is not None and value not in HDF5_LOCKING:
        raise ConfigError(f"HPCTRAIN_HDF5_LOCKING={value!r}: must be one of {', '.join(HDF5_LOCKING)}")
    return value


PARSERS["HPCTRAIN_HDF5_LOCKING"] = hdf5_locking_env


def hdf5_locking(value: str | None = None) -> str | None:
    """Set HDF5's file locking for this process: ``"on"``, ``"off"`` (file systems without locks,
    where opening any HDF5 file fails with "unable to lock file") or ``"best-effort"``.

    ``None`` reads ``HPCTRAIN_HDF5_LOCKING`` (unset: HDF5's default, which honours its own
    ``HDF5_USE_FILE_LOCKING``). HDF5 reads the setting once, when h5py is first imported, so this
    must run before that: afterwards a different setting is a ``ConfigError`` instead of being
    silently ignored. Returns the value applied (``None``: left to HDF5).
    """
    import sys

    if value is None:
        value = hdf5_locking_env()
        where = "HPCTRAIN_HDF5_LOCKING"
    else:
        where = "--hdf5-locking"
    if value is None:
        return None
    if value not in HDF5_LOCKING:
        raise ConfigError(f"{where}={value!r}: must be one of {', '.join(HDF5_LOCKING)}")
    want = HDF5_LOCKING[value]
    if "h5py" in sys.modules and os.environ.get("HDF5_USE_FILE_LOCKING", "").upper() != want:
        raise ConfigError(f"{where}={value}: HDF5 was already loaded in this process; set it (or "
                          f"HDF5_USE_FILE_LOCKING={want}) before h5py is imported")
    os.environ["HDF5_USE_FILE_LOCKING"] = want
    return value
