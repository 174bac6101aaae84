"""``inspect``: what a checkpoint holds, after verifying every slab (no MPI needed)."""

from __future__ import annotations

import json
from typing import Any

from ..errors import CheckpointError
from . import format as fmt
from .header import read_header
from .reader import Reader


def verify(path: str) -> dict[str, Any]:
    """Check the header and read every slab of every tensor against its checksum; returns the
    header. Raises ``FileNotFoundError`` / ``CheckpointError`` naming what is wrong."""
    header = read_header(path)
    reader = Reader(path, header)
    try:
        for key, entry in sorted(header["index"].items()):
            for slab in entry["slabs"]:
                reader.slab(key, entry, slab)
    finally:
        reader.close()
    return header


def inspect(path: str) -> str:
    """A human-readable summary of what a checkpoint holds, every checksum verified first."""
    header = verify(path)
    try:
        return _summary(path, header)
    except Exception as exc:  # verified but not laid out as hpctrain writes it
        raise CheckpointError(f"checkpoint {path} has an unexpected layout ({type(exc).__name__}: {exc})") from None


def _summary(path: str, header: dict[str, Any]) -> str:
    index = header["index"]
    lines = [f"checkpoint {path}"]
    lines.append(f"  hpctrain {header['hpctrain_version']}, format {header['version']}, "
                 f"saved from layout {header['layout']}")
    state = header["trainer_state"]
    lines.append(f"  step {state.get('global_step')}, epoch {state.get('epoch')}")
    lines.append(f"  trainer: {json.dumps(header['config'])}")
    if header["optimizer"]:
        lines.append(f"  optimizer: {json.dumps(header['optimizer']['config'])} at step {header['optimizer']['step']}")
    total = slabs = 0
    writers: set[Any] = set()
    for key, entry in sorted(index.items()):
        slabs += len(entry["slabs"])
        writers |= {s[0] for s in entry["slabs"]}
        if not key.startswith("model/"):
            continue
        name = key[6:]
        total += fmt.numel(entry["shape"])
        prefix = f"optim/{name}/"
        states = sorted(k[len(prefix):] for k in index if k.startswith(prefix) and "/" not in k[len(prefix):])
        lines.append(f"  {name:<40} {str(tuple(entry['shape'])):<18} {entry['dtype']}  {' '.join(states)}")
    lines.append(f"  {total:,} parameters in {slabs} slabs from {len(writers)} writer(s); all checksums verified")
    keyed = (header.get("seal") or {}).get("keyed")
    if keyed is not None:
        from .. import settings

        verified = "verified with your key" if settings.checkpoint_key() else "not verified: no key set"
        lines.append(f"  signed with key id {keyed['key_id']} ({verified})")
    return "\n".join(lines)
