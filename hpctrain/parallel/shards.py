"""Where each local array sits in the full tensor: the shard map of a split model.

Written by the transforms (``tensor_parallel`` sets each split layer's ``shard_index``), read by
the runtime (``ParallelTrainer.shards()``, checkpoints) and by ``full_state_dict``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import to_host


def shard_map(model: Any) -> dict[str, tuple[Any, tuple, tuple]]:
    """``{serial name: (Parameter, full shape, index)}``; parameters without a ``shard_index``
    entry in their module are whole (full slices)."""
    info: dict[str, tuple[tuple, tuple]] = {}
    for mod_name, m in model.named_modules():
        for pname, (full, index) in getattr(m, "shard_index", {}).items():
            info[f"{mod_name}.{pname}" if mod_name else pname] = (tuple(full), tuple(index))
    out = {}
    for name, p in model.named_parameters():
        full, index = info.get(name, (p.shape, tuple(slice(0, n) for n in p.shape)))
        out[name] = (p, full, index)
    return out


def full_state_dict(model: Any, tp_comm: Any) -> dict[str, np.ndarray]:
    """The full (unsharded) weights of a tensor-parallel model on every rank of ``tp_comm``.

    For evaluation or export: ``serial_model.load_state_dict(full_state_dict(tp_model, grid.tp))``.
    One parameter at a time is gathered (collective over ``tp_comm``).
    """
    out = {}
    for name, (p, full, index) in sorted(shard_map(model).items()):
        if tuple(full) == p.shape:
            out[name] = to_host(p.data).copy()
            continue
        whole = np.empty(full, dtype=p.dtype)
        for idx, piece in tp_comm.allgather_obj((index, to_host(p.data))):
            whole[idx] = piece
        out[name] = whole
    return out
