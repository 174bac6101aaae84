"""Using a trained model: :func:`load_model` rebuilds the model of a run (the built-in one or the
user's factory, from the run's ``config.json``) and loads its trained weights, ready for
inference, as Lightning's ``load_from_checkpoint`` does. No MPI: one process.

Checkpoints hold full tensors under the serial model's names whatever layout wrote them (dp, tp,
pp, ZeRO: :mod:`hpctrain.checkpoint`), so the serial model loads them as they are.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ConfigError

__all__ = ["load_model", "run_config"]


def run_config(checkpoint_file: str, why: str = "load_model rebuilds the model from the run's settings") -> str:
    """The ``config.json`` of the run a checkpoint file belongs to (``RUN/checkpoints/ckpt-*.h5``
    or ``RUN/ckpt-*.h5``); ``ConfigError`` saying ``why`` it is needed when there is none."""
    here = os.path.dirname(os.path.abspath(checkpoint_file))
    for d in (here, os.path.dirname(here)):
        if os.path.isfile(os.path.join(d, "config.json")):
            return os.path.join(d, "config.json")
    raise ConfigError(f"no config.json next to {checkpoint_file} or in its run directory: {why}")


def load_model(run: str | os.PathLike, *, device: str = "cpu") -> Any:
    """The model of a training run with its trained weights, in eval mode, ready for inference.

    ``run``: a run directory of ``hpctrain train`` (its newest checkpoint that loads, as
    ``--resume`` takes it) or one of its checkpoint files. The model is built as the run built it
    (``--model mlp``/``cnn``/``gpt`` or the user's ``module:factory``, which must be importable
    here as it was there: a ``path/to/file.py:factory`` is relative to the directory the run
    started in), from the run's ``config.json`` and the data's facts it recorded (``info``: no data
    file is opened), then the weights are loaded with every checksum verified, whatever layout
    wrote them. ``device="cuda"`` moves it to this process's GPU.

        model = hpctrain.load_model("runs/cnn")
        with hpctrain.autograd.no_grad():
            classes = model(x).data.argmax(axis=1)      # or model.forward(x) on arrays

    ``ConfigError`` for a path that holds no run, ``CheckpointError`` when no checkpoint fits
    the rebuilt model (each one's reason said).
    """
    from .. import checkpoint
    from .builders import build_model
    from .config import merge, read_config

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    found = checkpoint.checkpoints_of(os.fspath(run))
    cfg_path = run_config(found[0])
    with open(cfg_path, encoding="utf-8") as f:
        info = (json.load(f) or {}).get("info") or {}
    if not info:
        raise ConfigError(f"{cfg_path} records no facts of the run's data ('info'): the model cannot be sized "
                          "without them (a run of an older hpctrain: train it again, or build the model and "
                          "call hpctrain.checkpoint.load_weights)")
    c = merge(read_config(cfg_path), {})
    model = build_model(c, info)
    if device == "cuda":
        model.to("gpu")
    checkpoint.load_weights(os.fspath(run), model)
    model.eval()
    return model
