"""Run directories: one job at a time, names nobody else gets, files nobody else owns.

* :class:`RunLock` is a lock file (``.hpctrain.lock``: host, pid, process start time, Slurm job)
  created exclusively in the run directory. A second job on the same directory is refused with
  the owner's identity; a lock left by a dead job (same host and its process gone, or the same
  Slurm job requeued) is taken over and said so.
* :func:`new_run_dir` creates a fresh default directory with ``mkdir`` (atomic): two jobs starting
  in the same second get different names.
* :func:`write_exclusive` writes a file through a temporary created with ``O_EXCL | O_NOFOLLOW``
  and renamed over the target: it never follows a symlink planted at either name and never
  truncates a file someone else has open; readers see the old or the new file, never half.
* :func:`clean_stale_temporaries` removes what dead jobs left half-written (``*.tmp.*``) in a
  directory the caller holds the lock of.
* The directory's own files are read as checkpoints are (:func:`open_regular`, :func:`read_record`,
  :func:`check_files`): a regular file only, opened without blocking and checked with ``fstat``, of
  a bounded size, or a ``ConfigError`` naming the file and what is wrong. A FIFO planted at
  ``job.json`` or ``metrics.jsonl`` would otherwise hang the job in ``open``, and ``/dev/zero``
  would be read forever.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import socket
import stat
import time
from typing import Any

from ..errors import ConfigError
from ..log import get_logger
from .h5safe import file_kind

log = get_logger("rundir")

LOCK_NAME = ".hpctrain.lock"
TMP_MARK = ".tmp."
#: The largest run-directory file read whole (``job.json``, ``config.json``, ``summary.json``):
#: hpctrain's own are a few KiB, so a larger one is not one it wrote, refused before it is read.
MAX_RECORD = 16 << 20
#: The largest lock file read (its record is one line).
MAX_LOCK = 64 << 10
#: The longest ``metrics.jsonl`` line read (a step's record is a few hundred bytes).
MAX_LINE = 1 << 20


class RunDirBusy(ConfigError):
    """Another live job holds the run directory's lock."""


def _host() -> str:
    return socket.gethostname()


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux ``/proc``), to tell a reused pid from its owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    now = _start_time(pid)
    return started is None or now is None or now == started


def owner_record() -> dict[str, Any]:
    """Who this process is, as a lock records it."""
    pid = os.getpid()
    return {"host": _host(), "pid": pid, "started": _start_time(pid), "job": os.environ.get("SLURM_JOB_ID"),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _describe(o: dict[str, Any]) -> str:
    job = f"Slurm job {o['job']}, " if o.get("job") else ""
    return f"{job}host {o.get('host')}, pid {o.get('pid')}, since {o.get('since')}"


def _stale_reason(o: dict[str, Any]) -> str | None:
    """Why the owner ``o`` of a lock is certainly gone, or ``None`` when it may still run."""
    me = owner_record()
    if o.get("job") and o.get("job") == me["job"]:
        return f"it is this Slurm job's own lock from before a requeue ({_describe(o)})"
    if o.get("host") == me["host"] and isinstance(o.get("pid"), int) and not _alive(o["pid"], o.get("started")):
        return f"its owner ({_describe(o)}) is no longer running"
    return None


class RunLock:
    """The lock of one run directory, held by one process (rank 0 of the job).

    ``acquire()`` raises :class:`RunDirBusy` naming the owner when a live job holds it;
    ``release()`` removes the lock file only if it is still this process's. ``what`` and ``flag``
    name the directory in messages (a job locks its ``--checkpoint-dir`` the same way).
    """

    def __init__(self, run_dir: str, what: str = "run directory", flag: str = "--run-dir") -> None:
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.record: dict[str, Any] | None = None
        self.what, self.flag = what, flag

    def acquire(self) -> RunLock:
        os.makedirs(self.run_dir, exist_ok=True)
        for _ in range(3):  # a stale lock removed, then raced: try again a little
            record = owner_record()
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                owner = self._read()
                if owner is None:  # being written this instant, or garbage
                    time.sleep(0.2)
                    owner = self._read()
                    if owner is None:
                        raise RunDirBusy(f"{self.what} {self.run_dir} has an unreadable lock {self.path}: if no "
                                         f"job uses this directory, delete that file") from None
                why = _stale_reason(owner)
                if why is None:
                    raise RunDirBusy(f"{self.what} {self.run_dir} is in use by another job ({_describe(owner)}): "
                                     f"choose another {self.flag}, or wait for that job; if it is gone (crashed "
                                     f"on another node), delete {self.path}") from None
                log.warning("taking over the lock of %s: %s", self.run_dir, why)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            self.record = record
            return self
        raise RunDirBusy(f"{self.what} {self.run_dir}: could not take its lock {self.path} (other jobs keep "
                         f"taking it)")

    def owner(self) -> dict[str, Any] | None:
        """The record of the live job that holds this lock (``None``: nobody, or a job gone)."""
        o = self._read()
        return o if o is not None and _stale_reason(o) is None else None

    def _read(self) -> dict[str, Any] | None:
        try:  # (never a plain open: a FIFO planted here would block it)
            return read_record(self.path, MAX_LOCK)
        except ConfigError:  # not a lock hpctrain wrote: the callers say "unreadable lock"
            return None

    def release(self) -> None:
        """Remove the lock if it is still ours (a taken-over lock is left to its new owner). A
        directory that can no longer be written (remounted read-only) keeps it, said in a line:
        the next job on this host takes it over, as any lock of a process gone."""
        if self.record is not None and self._read() == self.record:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove the lock %s (%s): the next job on %s takes it over; elsewhere, "
                            "delete it once no job uses %s", self.path, exc.strerror, self.record.get("host"),
                            self.run_dir)
        self.record = None

    def moved(self, old_dir: str) -> None:
        """The locked directory was renamed to ``old_dir`` (set aside by ``--restart``): drop the
        lock file that went with it (ours) and lock the directory now at the original name."""
        moved = os.path.join(old_dir, LOCK_NAME)
        try:
            ours = read_record(moved, MAX_LOCK) == self.record
        except ConfigError:  # not a lock this process wrote
            ours = False
        if ours:
            os.remove(moved)
        self.record = None
        self.acquire()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def new_run_dir(parent: str = "runs") -> str:
    """A new, empty directory ``parent/<date>-<time>[-job<id>]``, suffixed ``-2``, ``-3`` ... when a
    job that started in the same second already took the name (``mkdir`` decides, atomically)."""
    os.makedirs(parent, exist_ok=True)
    base = time.strftime("%Y%m%d-%H%M%S")
    job = os.environ.get("SLURM_JOB_ID")
    if job and job.isdigit():
        base += f"-job{job}"
    for n in range(1, 10_000):
        path = os.path.join(parent, base if n == 1 else f"{base}-{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"cannot create a new run directory under {parent}: 10,000 names for {base} are taken")


def temporary_name(path: str) -> str:
    """``path`` + ``.tmp.<host>.<pid>``: unique per process, recognized by the cleanup."""
    return f"{path}{TMP_MARK}{_host()}.{os.getpid()}"


def create_exclusive(path: str, mode: int = 0o644) -> int:
    """A file descriptor of a new file at ``path`` (``O_EXCL``: never an existing file or a symlink)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def write_exclusive(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a fresh temporary, fsynced, renamed over ``path``.

    A symlink at ``path`` is replaced, not followed; a stale temporary of this process's name is
    removed first (a dead job with our pid), never written through.
    """
    tmp = temporary_name(path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    fd = create_exclusive(tmp)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def open_append(path: str) -> Any:
    """``open(path, "a")`` that refuses to follow a symlink at ``path`` (``O_NOFOLLOW``) and
    anything but a regular file there (:func:`open_regular`: a FIFO would block the open)."""
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW)
    assert fd is not None  # (O_CREAT: a missing file is created)
    return os.fdopen(fd, "a")


def open_regular(path: str, flags: int = os.O_RDONLY, limit: int | None = None) -> int | None:
    """A descriptor of the regular file at ``path`` opened with ``flags``; ``None`` when nothing
    is there (and ``flags`` has no ``O_CREAT``).

    ``stat`` first (it opens nothing: a device is never opened), then the open with ``O_NONBLOCK``
    (a FIFO's open would otherwise wait for a writer, or a reader) and ``fstat`` of the very file
    opened. Anything else (a FIFO, a device such as a link to ``/dev/zero``, a directory, a
    symlink under ``O_NOFOLLOW``), or a file over ``limit`` bytes, is a ``ConfigError`` naming
    the file and what it is. (``O_NONBLOCK`` changes nothing for a regular file.)
    """
    try:
        _check_mode(path, os.stat(path), limit)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            return None
    except OSError as exc:  # a symlink loop, no permission
        raise ConfigError(f"{path} cannot be read ({exc.strerror}): refused") from None
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "it is a symbolic link, never followed here" if exc.errno == errno.ELOOP else exc.strerror
        raise ConfigError(f"{path} cannot be opened ({why}): refused") from None
    try:
        _check_mode(path, os.fstat(fd), limit)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_mode(path: str, st: os.stat_result, limit: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path} is {file_kind(st.st_mode)}, not a regular file: refused")
    if limit is not None and st.st_size > limit:  # (the descriptor's own size: the file that is read)
        raise _too_large(path, st.st_size, limit)


def _too_large(what: str, size: int, limit: int) -> ConfigError:
    return ConfigError(f"{what} has {size:,} bytes, more than the {limit:,} of any such file hpctrain writes: refused")


def check_size(path: str, limit: int, what: str) -> None:
    """Refuse (``ConfigError``) the file at ``path`` when it has more than ``limit`` bytes: a
    record read whole is never read into memory at any size."""
    size = os.stat(path).st_size
    if size > limit:
        raise _too_large(what, size, limit)


def read_record(path: str, limit: int = MAX_RECORD) -> dict[str, Any] | None:
    """The JSON object in the run-directory file ``path`` (``None``: no file there); a
    ``ConfigError`` naming the file when it is not a regular file of at most ``limit`` bytes
    (:func:`open_regular`) or does not hold a JSON object."""
    fd = open_regular(path, limit=limit)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    try:
        record = json.loads(data)
    except (ValueError, RecursionError) as exc:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise ConfigError(f"{path} is not a record hpctrain wrote: not JSON ({type(exc).__name__}: "
                          f"{str(exc)[:200]})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path} is not a record hpctrain wrote: it holds a JSON {type(record).__name__}, not "
                          "an object")
    return record


def check_files(run_dir: str, limits: dict[str, int | None]) -> None:
    """Refuse the files of ``run_dir`` named in ``limits`` that are there but are not regular
    files, or are larger than their limit (``None``: any size), in one ``ConfigError`` naming each:
    before a job reads or appends to any of them (nothing is changed)."""
    problems = []
    for name, limit in limits.items():
        try:
            fd = open_regular(os.path.join(run_dir, name), limit=limit)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if fd is not None:
            os.close(fd)
    if problems:
        them = ("these files", "them") if len(problems) > 1 else ("this file", "it")
        raise ConfigError("; ".join(problems) + f" (hpctrain writes {them[0]} itself: move {them[1]} away, or choose "
                          "another --run-dir)")


def clean_stale_temporaries(*directories: str) -> list[str]:
    """Remove the half-written temporaries (``*.tmp.*``) in ``directories`` and return them.

    Only for directories whose lock the caller holds: then no live job writes there, and every
    temporary is what a dead job left. Symlinks and directories are left alone.
    """
    removed = []
    for d in directories:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if TMP_MARK not in name:
                continue
            p = os.path.join(d, name)
            if os.path.isfile(p) and not os.path.islink(p):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p)
                    removed.append(p)
    if removed:
        log.info("removed %d temporary file(s) that earlier jobs left half-written: %s", len(removed),
                 ", ".join(os.path.basename(p) for p in removed[:5]))
    return removed


def check_resume_compatible(config_file: str, wanted: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Refuse (``ConfigError``) to resume the run whose ``config.json`` is ``config_file`` with
    settings that differ in any of ``keys`` (the model, the data, ...); a missing file passes."""
    try:
        before = read_record(config_file)
    except ConfigError as exc:
        raise ConfigError(f"--resume: cannot read the run's configuration: {exc}") from None
    if before is None:
        return
    diff = [f"{k}={before.get(k)!r}, not {wanted.get(k)!r}" for k in keys if k in before and before[k] != wanted.get(k)]
    if diff:
        run_dir = os.path.dirname(config_file) or "."
        raise ConfigError(f"--resume: the run in {run_dir} was made with " + "; ".join(diff)
                          + ": its checkpoints cannot continue this configuration (nothing was changed). To "
                          f"continue the run as it was: hpctrain train --run-dir {shlex.quote(run_dir)} --resume; "
                          "or use another --run-dir, or add --restart to start over there")


def set_aside(*paths: str) -> list[tuple[str, str]]:
    """Rename each existing path to ``<path>.replaced-<date>-<time>`` (nothing is deleted);
    returns ``(old, new)`` pairs."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for p in paths:
        if not os.path.lexists(p):
            continue
        target, n = f"{p}.replaced-{stamp}", 1
        while os.path.lexists(target):
            n += 1
            target = f"{p}.replaced-{stamp}-{n}"
        os.rename(p, target)
        moved.append((p, target))
    return moved


def trim_metrics(path: str, step: int) -> int:
    """Drop the lines of ``metrics.jsonl`` after ``step`` (steps an interrupted job made after its
    last checkpoint, which the resumed job makes again), in place; returns how many were dropped.

    Truncates the same file rather than replacing it, so a handle already open for appending
    keeps writing to it. A torn last line (the job died mid-write) goes too.
    """
    fd = open_regular(path, os.O_RDWR | os.O_NOFOLLOW)
    if fd is None:
        return 0
    with os.fdopen(fd, "rb+") as f:
        keep_bytes, dropped = 0, 0
        for line in iter(lambda: f.readline(MAX_LINE + 1), b""):  # a line that long is not ours: dropped
            try:
                ok = line.endswith(b"\n") and int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                ok = False
            if ok and not dropped:
                keep_bytes += len(line)
            else:
                dropped += 1
        if dropped:
            f.truncate(keep_bytes)
            f.flush()
            os.fsync(f.fileno())
    return dropped
