"""``hpctrain train``: the main job.

    mpiexec -n 2 hpctrain train                                 # MLP classifier, data parallel
    mpiexec -n 4 hpctrain train --strategy hybrid --tp 2        # tp=2 x dp=2
    mpiexec -n 4 hpctrain train --model gpt --strategy pp --pp 2 --epochs 1
    hpctrain train --config run.toml --lr 1e-3                  # flags override the file

The pieces: :mod:`.options` (the :class:`Config` dataclass), :mod:`.config` (flags, TOML/JSON
files, ``resolve``), :mod:`.sections` (the rules, one section per concern), :mod:`.models` (the
built-in models), :mod:`.inputs` (opening the HDF5 data), :mod:`.builders` (model, optimizer,
trainer), :mod:`.runner` (the run itself) and :mod:`.summary` (its closing report). The run
directory holds ``config.json`` (accepted back by ``--config``), ``metrics.jsonl`` (one line per
step), ``trace.json`` (per-rank timeline of the steps for https://ui.perfetto.dev),
``checkpoints/`` and ``summary.json``; ``hpctrain plot RUN`` draws the curves.
"""

from .builders import build_model, build_optimizer, build_trainer, data_rank
from .config import OPTIONS, Config, Option, add_arguments, merge, read_config, read_toml, resolve
from .inputs import open_data
from .runner import evaluate, everywhere, format_summary, limit_blas_threads, main, run
from .trace import Timeline
from .trained import load_model

__all__ = [
    "OPTIONS", "Config", "Option", "Timeline", "add_arguments", "build_model", "build_optimizer", "build_trainer",
    "data_rank", "evaluate", "everywhere", "format_summary", "limit_blas_threads", "load_model", "main", "merge",
    "open_data",
    "read_config", "read_toml", "resolve", "run",
]  # fmt: skip
