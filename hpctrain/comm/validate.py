"""Cross-rank agreement checks: one gather of a digest, details only when ranks differ.

Trainers call ``agree`` before their first collective so that a rank with another model, another
optimizer setting or another data length is refused with a message naming the ranks and the
first difference, on every rank, instead of hanging or silently training something else.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..errors import ConfigError, MismatchError
from ..protocols import Comm
from .failure import mark_everywhere, rank_ranges


def _canonical(value: Any) -> str:
    """A stable text form of plain data (dicts sorted by key, tuples as lists)."""
    return json.dumps(value, sort_keys=True, default=repr, separators=(",", ":"))


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where ``a`` and ``b`` first differ, as ``path: a != b``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            where = f"{path}.{k}" if path else str(k)
            if k not in a:
                return f"{where}: missing != {b[k]!r}"
            if k not in b:
                return f"{where}: {a[k]!r} != missing"
            if _canonical(a[k]) != _canonical(b[k]):
                return _first_difference(a[k], b[k], where)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        for i, (x, y) in enumerate(zip(a, b)):
            if _canonical(x) != _canonical(y):
                return _first_difference(x, y, f"{path}[{i}]")
        if len(a) != len(b):
            return f"{path or 'value'}: length {len(a)} != {len(b)}"
    return f"{path or 'value'}: {a!r} != {b!r}"


def digest(value: Any) -> str:
    """A short hash of plain data (what ``agree`` compares across ranks)."""
    return hashlib.sha1(_canonical(value).encode()).hexdigest()[:16]


def agree(comm: Comm, what: str, value: Any) -> None:
    """Check that every rank of ``comm`` holds the same ``value`` (plain, JSON-able data).

    Collective. Costs one ``allgather_obj`` of a 16-character digest; only when the digests
    differ are the values themselves gathered to build the message. Raises ``MismatchError`` on
    every rank, naming ``what``, the ranks on each side and the first difference.
    """
    digests = comm.allgather_obj(digest(value))
    if len(set(digests)) == 1:
        return
    values = comm.allgather_obj(value)
    groups: dict[str, list[int]] = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    ref = digests[0]
    odd = next(r for r, d in enumerate(digests) if d != ref)
    ranks_ref, ranks_odd = groups[ref], groups[digests[odd]]
    diff = _first_difference(values[0], values[odd])
    raise mark_everywhere(MismatchError(
        f"ranks disagree on {what}: ranks {rank_ranges(ranks_ref)} differ from ranks "
        f"{rank_ranges(ranks_odd)}{' (and others)' if len(groups) > 2 else ''}; first difference "
        f"(rank {ranks_ref[0]} vs rank {odd}): {diff}"
    ), comm)


def describe_model(model: Any) -> list[list[Any]]:
    """[[name, shape, dtype], ...] of a model's parameters, sorted by name."""
    return sorted(
        [name, list(p.data.shape), str(p.data.dtype)] for name, p in model.named_parameters()
    )


def raise_if_any(comm: Comm, problem: BaseException | str | None, *, what: str = "", payload: Any = None) -> list[Any]:
    """Raise the same error on every rank of ``comm`` if any rank has a ``problem`` (collective).

    The one place where "a check failed on some ranks" becomes "every rank raises": each rank
    passes its own finding (``None`` when all is well, a message, or an exception it caught).
    Costs one ``allgather_obj`` of a small tuple. The error raised everywhere has the type of the
    first failing rank's exception (``ValueError`` for a plain message; a type that cannot be
    rebuilt from a message falls back to ``RuntimeError``) and a message naming each failing
    rank, prefixed by ``what``.

    ``payload``: plain data that rides on the same exchange; when nothing is raised, returns
    every rank's payload (by rank), so a check and the exchange after it cost one collective.
    """
    mine = None
    if isinstance(problem, BaseException):
        mine = (type(problem), str(problem))
    elif problem is not None:
        mine = (ValueError, str(problem))
    gathered = comm.allgather_obj((mine, payload))
    everyone = [m for m, _ in gathered]
    bad = [(r, p) for r, p in enumerate(everyone) if p is not None]
    if not bad:
        return [x for _, x in gathered]
    # Identical messages from many ranks are said once, with the ranks' ranges.
    by_text: dict[str, list[int]] = {}
    for r, (_, text) in bad:
        by_text.setdefault(text, []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)}: {text}" for text, rs in by_text.items()]
    message = (f"{what}: " if what else "") + "; ".join(parts)
    kind = bad[0][1][0]
    try:
        exc = kind(message)
    except Exception:
        exc = RuntimeError(message)
    raise mark_everywhere(exc, comm)


def key_mismatch(ids: list[str | None]) -> ConfigError | None:
    """The problem when the ranks' checkpoint key ids (``settings.checkpoint_key_id``, by rank)
    differ, naming which ranks have which key (by its id) or none; ``None`` when they agree. The
    same verdict on every rank from the same list: each raises it, no rank waits at a first save
    that one rank's missing key would refuse."""
    if len(set(ids)) <= 1:
        return None
    ranks: dict[str | None, list[int]] = {}
    for r, k in enumerate(ids):
        ranks.setdefault(k, []).append(r)
    said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)}: {'key id ' + k if k else 'no key'}"
                     for k, rs in ranks.items())
    return ConfigError(f"the checkpoint key (HPCTRAIN_CHECKPOINT_KEY[_FILE]) is not the same on every rank ({said}): "
                       "set the same key on every rank (exported before mpiexec/srun, or passed by the launcher: "
                       "mpiexec -genv, -x; srun --export), or none")


def agree_environment(comm: Comm, problem: BaseException | None) -> None:
    """The world's first check (collective): ``problem`` (this rank's bad ``HPCTRAIN_*`` setting,
    or ``None``) raised on every rank if any rank has one; and the checkpoint key's id riding on
    the same exchange (a digest, never the key): a key set on some ranks only, or different keys,
    refused now on every rank (:func:`key_mismatch`: one verdict from one list), not at the first
    save."""
    from .. import settings

    ids = raise_if_any(comm, problem, what="hpctrain environment",
                       payload=settings.checkpoint_key_id() if problem is None else None)
    mismatch = key_mismatch(ids)
    if mismatch is not None:
        raise mark_everywhere(ConfigError(f"hpctrain environment: {mismatch}"), comm)


class Agreeing:
    """:func:`raise_if_any` and :func:`agree` as methods of a communicator (``Communicator`` has
    them): layers that know no ``comm`` (``data``) reach one verdict on every rank through the
    object they are handed (``protocols.Agreement``), not by importing this module."""

    def raise_if_any(self: Any, problem: BaseException | str | None, *, what: str = "",
                     payload: Any = None) -> list[Any]:
        """:func:`raise_if_any` over this communicator (collective)."""
        return raise_if_any(self, problem, what=what, payload=payload)

    def agree(self: Any, what: str, value: Any) -> None:
        """:func:`agree` over this communicator (collective)."""
        agree(self, what, value)
