"""From a resolved :class:`Config` to objects: the serial model, its optimizer, the trainer.

Model code lives in :mod:`hpctrain.nn`; here the job's settings pick and size it.
"""

from __future__ import annotations

from typing import Any

from .. import nn
from ..protocols import Comm
from . import models
from .options import Config


def load_factory(spec: str) -> Any:
    """The callable named by ``package.module:factory`` or ``path/to/file.py:factory`` (the file's
    directory goes first on ``sys.path``, as ``python path/to/file.py`` puts it: its neighbours import)."""
    import importlib
    import importlib.util
    import os
    import sys

    from ..errors import ConfigError

    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise ConfigError(f"--model {spec}: {where} does not exist")
            # Its neighbours import as under `python file.py`, whose directory is sys.path[0].
            home = os.path.dirname(os.path.abspath(where))
            if home not in sys.path:
                sys.path.insert(0, home)
            mod_name = "hpctrain_user_" + os.path.splitext(os.path.basename(where))[0]
            module = sys.modules.get(mod_name)
            if module is None or getattr(module, "__file__", None) != os.path.abspath(where):
                spec_ = importlib.util.spec_from_file_location(mod_name, os.path.abspath(where))
                module = importlib.util.module_from_spec(spec_)
                sys.modules[mod_name] = module
                spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except ImportError as exc:
        raise ConfigError(f"--model {spec}: cannot import {where} ({exc})") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ConfigError(f"--model {spec}: {where} has no callable {name!r}")
    return factory


def build_model(c: Config, meta: dict[str, Any]) -> Any:
    """The serial model, identical on every rank (same seed): strategies shard it from here.

    A user's ``--model module:factory`` is called with the Config, its ``info`` filled with
    ``meta`` (the data's facts), and must return a Module (``forward``, ``backward``,
    ``parameters``, ``named_parameters``, ...; see docs/own-model.md).
    """
    if c.model not in models.BUILTIN:
        from ..errors import ConfigError

        model = load_factory(c.model)(c.replace(info=dict(meta)))
        missing = [m for m in ("forward", "backward", "parameters", "named_parameters", "zero_grad")
                   if not callable(getattr(model, m, None))]
        if missing:
            raise ConfigError(f"--model {c.model} returned a {type(model).__name__} without "
                              f"{', '.join(missing)}: a factory must return an hpctrain Module")
        return model
    build = {"gpt": models.build_gpt, "cnn": models.build_cnn}.get(c.model, models.build_classifier)
    return build(c, meta)


def build_loss(c: Config) -> Any:
    """The training loss of ``--loss`` (mean over the global batch)."""
    return nn.MSELoss() if c.loss == "mse" else nn.CrossEntropyLoss()


def build_schedule(c: Config, total_steps: int) -> Any:
    """The learning-rate multiplier of ``--lr-schedule`` with ``--warmup`` over ``total_steps`` steps."""
    from ..optim import schedules

    if c.lr_schedule == "cosine":
        # Reaches --min-lr at the last step (index total_steps - 1); at least one step after the warm-up.
        total = max(total_steps - 1, c.warmup + 1)
        return schedules.cosine(total, warmup_steps=c.warmup, min_ratio=c.min_lr / c.lr)
    return schedules.linear_warmup(c.warmup) if c.warmup else None


def build_optimizer(c: Config, params: list[Any], total_steps: int = 1) -> Any:
    """The optimizer of ``c.optimizer`` over ``params`` (this rank's part of the model)."""
    from .. import optim

    schedule = build_schedule(c, total_steps)
    if c.optimizer == "sgd":
        return optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay, schedule=schedule)
    cls = optim.AdamW if c.optimizer == "adamw" else optim.Adam
    return cls(params, lr=c.lr, weight_decay=c.weight_decay, schedule=schedule)


def trainer_options(c: Config) -> dict[str, Any]:
    """The keyword arguments every data- and model-parallel trainer of the job takes alike (the
    layout's own, ZeRO and the grid, apart): what ``build_trainer`` builds with and what the
    planner's calibration steps run with (``planning.calibrated_costs``), so that the steps it
    times are the steps the job will take. A fresh loss scaler each call."""
    out: dict[str, Any] = {"on_nonfinite": c.on_nonfinite, "timeout": c.timeout, "clip_norm": c.clip_norm,
                           "compression": c.compression}
    if c.backend != "mpi":
        out["backend"] = c.backend
    if c.precision != "fp32":
        from ..training.precision import Precision
        from .sections import loss_scaler

        scaler = loss_scaler(c) if c.precision == "fp16-mixed" else None
        out["precision"] = Precision(c.precision, c.grad_reduce_dtype, scaler=scaler)
    return out


def build_trainer(c: Config, model: Any, comm: Comm, total_steps: int = 1, sample: Any = None) -> Any:
    """The trainer of ``c.strategy`` around ``model`` (collective: trainers agree on configs).

    ``total_steps``: the steps the run will take (the cosine schedule's length). ``sample``: a
    micro-batch of inputs, on which a pipeline's pieces are timed to balance its stages
    (:func:`pipeline_cut`; without it, by parameter count).
    """
    from .. import parallel
    from ..comm import ProcessGrid

    loss = build_loss(c)
    if c.recompute:
        model = with_recompute(model)
    if c.strategy == "ps":
        return parallel.ParameterServerTrainer(model=model, loss=loss, lr=c.lr, comm=comm, mode=c.ps_mode,
                                               staleness=c.staleness, momentum=c.momentum,
                                               on_nonfinite=c.on_nonfinite, timeout=c.timeout)
    common = trainer_options(c)
    if c.zero:
        common["zero"] = c.zero
    if c.strategy == "dp":
        opt = build_optimizer(c, model.parameters(), total_steps)
        return parallel.DataParallelTrainer(model=model, loss=loss, optimizer=opt, comm=comm,
                                            accum_steps=c.accum_steps, **common)
    _check_tp_splits(c, model)
    _check_cp_attention(c, model)
    grid = ProcessGrid(comm, tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep)
    counts, plan = pipeline_cut(c, model, comm, sample) if c.pp > 1 else (None, "")
    # This rank's pipeline stage, split over tp, its attention over the cp group (--cp-mode).
    part = parallel.parallelize(model, grid, balance=counts, cp_mode=c.cp_mode)
    if plan:
        part.pipeline["plan"] = plan  # the header's "stages:" line
    opt = build_optimizer(c, part.parameters(), total_steps)
    # A pipeline's micro-batches already accumulate: --accum-steps multiplies them.
    microbatches = c.microbatches * c.accum_steps if c.pp > 1 else c.accum_steps
    return parallel.ParallelTrainer(model=part, loss=loss, optimizer=opt, grid=grid, microbatches=microbatches,
                                    schedule=c.schedule, **common)


def pipeline_cut(c: Config, model: Any, comm: Comm, sample: Any = None) -> tuple[list[int], str]:
    """(pieces per stage, the header's description) of ``c.pp`` stages of ``model``: where
    ``--pp-cut`` says, else balanced by each piece's forward and backward time on ``sample``,
    measured on rank 0 and broadcast so that every rank cuts alike (by parameter count without a
    sample). Collective; a bad ``--pp-cut`` is the same ``ConfigError`` on every rank."""
    from ..errors import ConfigError
    from ..parallel import cut

    pieces = cut.pipeline_pieces(model)
    times: Any = None
    if sample is not None:
        if comm.rank == 0:
            try:
                times = cut.piece_times(pieces, sample)
            except Exception as exc:  # every rank learns it from the broadcast, none waits
                times = f"{type(exc).__name__}: {exc}"
        times = comm.bcast_obj(times, root=0)
        if isinstance(times, str):
            raise ConfigError(f"timing the model's pieces on a micro-batch to cut the pipeline failed: {times}")
    # Every stage needs parameters (its optimizer takes them): the same verdict on every rank.
    holds = [cut.holds_parameters(p) for p in pieces]
    given = c.cut_points is not None
    try:
        if given:
            counts, how = cut.counts_at(list(c.cut_points), [p.name for p in pieces], c.pp), "as --pp-cut says"
            problem = cut.empty_stage(pieces, counts)
            if problem:
                raise ValueError(f"{problem}: every stage needs a layer with parameters")
        else:
            costs = times if times is not None else [cut.piece_cost(p) for p in pieces]
            counts = cut.balance_stages(costs, c.pp, holds)
            how = "balanced by measured time" if times is not None else "balanced by parameter count"
    except ValueError as exc:
        raise ConfigError(f"--pp-cut {c.pp_cut}: {exc}" if given else f"--pp {c.pp}: {exc}") from None
    return counts, f"{cut.describe_stages(pieces, counts, times)} ({how})"


def _check_tp_splits(c: Config, model: Any) -> None:
    """Refuse ``--tp`` > 1 for a model with no layer that splits over the tensor-parallel ranks:
    each would hold and train the whole model, replicated, for nothing (the same verdict on every
    rank: the model is built alike everywhere). The built-in models are checked from their sizes."""
    from ..errors import ConfigError
    from ..parallel.tensor import tp_split_layers

    if c.tp > 1 and not tp_split_layers(model):
        raise ConfigError(f"--tp {c.tp}: --model {c.model} has no layer that splits over tensor-parallel ranks "
                          "(the layers that split: nn.MLP, nn.CausalSelfAttention, or what the model's tp_plan() "
                          "names), so every tp rank would train the whole model, replicated: use data parallelism, "
                          "--pp or --zero, or build the model from those layers")


def _check_cp_attention(c: Config, model: Any) -> None:
    """Refuse ``--cp`` > 1 for a model with no attention: its sequence cannot be split over the
    context-parallel ranks (the same verdict on every rank; the built-in models are checked from
    their sizes when the configuration resolves)."""
    from ..errors import ConfigError
    from ..nn.transformer import SelfAttentionBase
    from ..parallel.context import context_targets

    if c.cp > 1 and not any(isinstance(m, SelfAttentionBase) for m in context_targets(model)):
        raise ConfigError(f"--cp {c.cp}: --model {c.model} has no attention layer (nn.CausalSelfAttention, an "
                          "nn.TransformerBlock's) whose sequence splits over context-parallel ranks: use data "
                          "parallelism, --tp, --pp or --zero, or build the model from those layers")


def with_recompute(model: Any) -> Any:
    """``model`` with activation recomputation on its blocks, names unchanged (in place): a GPT's
    transformer blocks, an MLP classifier's MLP blocks (so pipelines still cut it layer by layer)."""
    return nn.recompute_blocks(model)[0]


def data_rank(c: Config, comm: Comm) -> tuple[int, int]:
    """(rank, size) the sampler shards by: the dp coordinate; tp, pp and cp groups share batches."""
    if c.strategy == "ps":
        return comm.rank, comm.size
    from ..comm.grid import coords

    return coords(comm.rank, comm.size, c.tp, c.pp, cp=c.cp).dp, c.dp
