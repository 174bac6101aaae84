"""A link probe kept in a file: ``hpctrain info --probe --save FILE`` writes it, ``hpctrain plan
--probe-file FILE`` (and ``train --layout auto --probe-file FILE``) plans from it without probing.

The file is JSON: ``format`` (:data:`FORMAT`), ``version``, ``date`` (UTC, ISO 8601),
``hpctrain`` (its version), ``mpi`` (the MPI library's first version line), ``nodes`` (each
rank's node name, in rank order), ``ranks_per_node`` (``{node: count}``) and ``links``: for each
link class of :data:`~hpctrain.comm.linkprobe.CLASSES`, ``null`` (no such link in that layout) or
``{"ranks": [a, b], "alpha": s, "beta": bytes/s or null (unbounded), "meet": s (what a blocking
collective costs ranks arriving from compute, ``Link.meet``), "samples": [[bytes, s], ...]}``.
:func:`load` reads it as the run directory's own files are read (a regular file of bounded size,
:func:`hpctrain.files.rundir.read_record`) and refuses anything else, a damaged field or another
program's JSON with a ``ConfigError`` that names the file and what is wrong.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..files import rundir
from .linkprobe import CLASSES, Link

FORMAT = "hpctrain link probe"
VERSION = 1
#: The largest probe file read: one is a few KiB (a node name per rank), so 4 MiB is not ours.
MAX_PROBE = 4 << 20


@dataclass(frozen=True)
class Probe:
    """A saved probe: the fitted links of each class and the layout they were measured on."""

    links: dict[str, Link | None]
    nodes: tuple[str, ...]  # each rank's node, in rank order
    mpi: str
    date: str
    hpctrain: str

    @property
    def ranks_per_node(self) -> dict[str, int]:
        """``{node: ranks on it}`` of the probed job."""
        return dict(Counter(self.nodes))


def record(links: dict[str, Link | None], nodes: list[str], mpi: str) -> dict[str, Any]:
    """The JSON object of a probe (what :func:`save` writes)."""
    from .. import __version__

    def link(x: Link | None) -> dict[str, Any] | None:
        if x is None:
            return None
        return {"ranks": list(x.ranks), "alpha": x.alpha, "beta": None if math.isinf(x.beta) else x.beta,
                "meet": x.meet, "samples": [[int(n), float(t)] for n, t in x.samples]}

    return {"format": FORMAT, "version": VERSION, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "hpctrain": __version__, "mpi": mpi, "nodes": list(nodes), "ranks_per_node": dict(Counter(nodes)),
            "links": {cls: link(links.get(cls)) for cls in CLASSES}}


def save(path: str, links: dict[str, Link | None], nodes: list[str], mpi: str) -> None:
    """Write the probe to ``path`` atomically (a temporary renamed over it); a ``ConfigError``
    naming the file when it cannot be written."""
    try:
        rundir.write_exclusive(path, json.dumps(record(links, nodes, mpi), indent=1, allow_nan=False) + "\n")
    except OSError as exc:
        raise ConfigError(f"cannot write the probe to {path}: {exc.strerror or exc}") from None


def load(path: str) -> Probe:
    """The probe saved in ``path``; a ``ConfigError`` naming the file and the fault when it is
    missing, not a regular file, larger than :data:`MAX_PROBE`, not JSON, another program's, or
    damaged (a field missing or out of range)."""
    try:
        raw = rundir.read_record(path, MAX_PROBE)
    except ConfigError as exc:
        raise ConfigError(f"probe file: {exc}") from None
    if raw is None:
        raise ConfigError(f"probe file {path} does not exist (write one with `hpctrain info --probe --save {path}`)")
    if raw.get("format") != FORMAT:
        raise ConfigError(f"probe file {path} is not an hpctrain link probe (its 'format' is {raw.get('format')!r}, "
                          f"not {FORMAT!r}): write one with `hpctrain info --probe --save FILE`")
    if raw.get("version") != VERSION:
        raise ConfigError(f"probe file {path} has version {raw.get('version')!r}; this hpctrain reads version "
                          f"{VERSION}: probe again with `hpctrain info --probe --save {path}`")
    try:
        return _parse(raw)
    except KeyError as exc:
        raise ConfigError(f"probe file {path} is damaged: its field {exc} is missing") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"probe file {path} is damaged: {exc}") from None


def _parse(raw: dict[str, Any]) -> Probe:
    nodes = raw["nodes"]
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) and n for n in nodes):
        raise ValueError("'nodes' must be a non-empty list of node names, one per rank")
    for key in ("mpi", "date", "hpctrain"):
        if not isinstance(raw[key], str):
            raise ValueError(f"{key!r} must be a string")
    links = raw["links"]
    if not isinstance(links, dict) or set(links) != set(CLASSES):
        raise ValueError(f"'links' must hold exactly the link classes {', '.join(CLASSES)}")
    parsed = {cls: None if links[cls] is None else _link(cls, links[cls], len(nodes)) for cls in CLASSES}
    if all(x is None for x in parsed.values()) and len(nodes) > 1:
        raise ValueError(f"no link measured between its {len(nodes)} ranks")
    return Probe(parsed, tuple(nodes), raw["mpi"], raw["date"], raw["hpctrain"])


def _number(x: Any, what: str, positive: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise ValueError(f"{what} must be a finite {'positive' if positive else 'non-negative'} number, got {x!r}")
    return float(x)


def _link(cls: str, x: Any, world: int) -> Link:
    if not isinstance(x, dict):
        raise TypeError(f"links[{cls!r}] must be an object or null")
    ranks = x["ranks"]
    if (not isinstance(ranks, list) or len(ranks) != 2 or not all(type(r) is int and 0 <= r < world for r in ranks)
            or ranks[0] == ranks[1]):
        raise ValueError(f"links[{cls!r}]['ranks'] must be two different ranks below {world}, got {ranks!r}")
    samples = x["samples"]
    if not isinstance(samples, list) or not all(isinstance(s, list) and len(s) == 2 for s in samples):
        raise ValueError(f"links[{cls!r}]['samples'] must be a list of [bytes, seconds] pairs")
    pairs = tuple((int(_number(n, f"a sample's size in {cls}")), _number(t, f"a sample's time in {cls}", True))
                  for n, t in samples)
    beta = math.inf if x["beta"] is None else _number(x["beta"], f"links[{cls!r}]['beta']", positive=True)
    return Link((ranks[0], ranks[1]), _number(x["alpha"], f"links[{cls!r}]['alpha']"), beta, pairs,
                _number(x["meet"], f"links[{cls!r}]['meet']"))
