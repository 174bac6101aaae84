"""The rules of ``hpctrain train``'s configuration, in sections.

Each :class:`Section` owns some settings (every option belongs to exactly one section), fills
their defaults and derived values, and checks their rules: each rule in one place, the section of
the setting it refuses. ``resolve`` (:mod:`.config`) checks every section's values, then runs
their rules in order, each on the config the earlier ones settled: the layout (``strategy``,
``tp``, ``pp``, ``dp``) first, then the model's sizes against it, the optimizer's defaults (which
depend on the strategy), and so on.

A section's check is a pure function of the config and the world size, so every rank reaches
the same verdict without talking.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..nn.layers import dropout_problem
from ..nn.transformer import heads_problem
from ..optim.clip import clip_norm_problem
from ..training.precision import precision_problem
from . import models
from .options import Config, as_flag, check_bounds, flag


@dataclass(frozen=True)
class Section:
    """Settings that belong together and the functions that check them.

    ``check_values`` refuses a setting that is wrong on its own (the bounds its field declares,
    then ``values``); ``rules`` checks the settings against each other and fills the section's
    defaults and derived values (in place). ``resolve`` checks every section's values before any
    rules, so a plain bad value is reported before a combination it takes part in.
    """

    name: str
    fields: tuple[str, ...]
    rules: Callable[[Config, int], None]
    values: Callable[[Config], None] | None = None

    def check_values(self, c: Config) -> None:
        """Refuse a value of this section's settings that is wrong whatever the others are."""
        check_bounds(c, self.fields)
        if self.values is not None:
            self.values(c)


def _no_rules(c: Config, world: int) -> None:
    """A section whose settings need no other."""


def _refuse(problem: str | None) -> None:
    """A library rule's refusal (asked with the flags' names, ``as_flag``) as the command line's."""
    if problem is not None:
        raise ConfigError(problem)


# -- model -------------------------------------------------------------------------------------


def _model_values(c: Config) -> None:
    _refuse(dropout_problem(c.dropout, as_flag))


def _model(c: Config, world: int) -> None:
    """The model's name and sizes, and what the layout (settled by the parallel section) must divide."""
    if c.recompute and c.strategy == "ps":
        raise ConfigError("--recompute is for the synchronous strategies, not --strategy ps")
    if c.model not in models.BUILTIN and ":" not in c.model:
        raise ConfigError(f"--model {c.model!r} is neither mlp, gpt nor package.module:factory "
                          f"(or path/to/file.py:factory); the built-in models are {', '.join(models.BUILTIN)}")
    if c.model == "gpt" and c.loss != "ce":
        raise ConfigError("--model gpt predicts the next token: it trains with --loss ce")
    if c.loss != "ce" and not c.data:
        raise ConfigError(f"--loss {c.loss} trains on float targets, and the built-in data sets hold class indices: "
                          "train them with --loss ce, or give --data FILE whose --y-key holds float values")
    if c.model == "gpt":
        _refuse(heads_problem(c.d_model, c.n_heads, as_flag))
    elif c.tie_embeddings:
        raise ConfigError(f"--tie-embeddings ties the GPT's head to its token embedding; --model {c.model} has none "
                          "(a model of your own ties its weights itself)")
    _model_experts(c)
    _model_splits(c)


def _model_experts(c: Config) -> None:
    """The GPT's mixture of experts (``--moe-*``, ``nn.MoE``'s rules) and their spread over ``--ep`` ranks."""
    from ..nn.moe import ep_problem, moe_problem

    if c.model != "gpt" and c.moe_experts:
        raise ConfigError(f"--moe-experts makes the GPT's MLPs mixtures of experts; --model {c.model} has none "
                          "(a model of your own puts nn.MoE layers in itself)")
    if c.moe_experts:
        _refuse(moe_problem(c.moe_experts, c.moe_top_k, c.moe_capacity, as_flag))
        _refuse(ep_problem(c.moe_experts, c.ep, as_flag))
    elif c.ep > 1 and c.model in models.BUILTIN:  # (a model of your own: expert_parallel finds its MoE layers)
        raise ConfigError(f"--ep {c.ep} spreads the experts of a mixture-of-experts model, and --model {c.model} has "
                          "none: give --moe-experts (gpt)")


def _model_splits(c: Config) -> None:
    """The layout against the built-in model's sizes, as the model states them (``models.splits``)."""
    s = models.splits(c)
    if s is None:  # a user's model: its trainer checks the split when it is built
        return
    if c.tp > 1 and not s.tp_sizes:
        raise ConfigError(f"--model {c.model} has no layer that splits over tensor-parallel ranks (tp={c.tp}): "
                          "use data parallelism, --pp or --zero")
    if c.tp > 1:
        from ..parallel.tensor_layers import tp_heads_problem, tp_hidden_problem  # (see _parallel_values)

        if "n_heads" in s.tp_sizes:
            _refuse(tp_heads_problem(s.tp_sizes["n_heads"], c.tp, as_flag))
        _refuse(tp_hidden_problem(s.tp_sizes["hidden"], c.tp))
    if c.cp > 1:
        _cp_splits(c, s)
    if c.pp > 1 and c.pp > s.pipeline_pieces:
        raise ConfigError(f"pp={c.pp} stages but the {c.model} model has only {s.pipeline_pieces} layers "
                          f"to cut: use fewer stages or more --n-layers")


def _cp_splits(c: Config, s: models.Splits) -> None:
    """Context parallelism splits sequences: a built-in model without attention has none to split,
    and the GPT's block and heads must split as ``parallel.cp_split.cp_problem`` says."""
    if "n_heads" not in s.tp_sizes:
        raise ConfigError(f"--cp {c.cp} splits each sequence's tokens over the ranks, but --model {c.model} has no "
                          "attention (no sequence to split): use data parallelism, --tp, --pp or --zero")
    from ..parallel.cp_split import cp_problem  # (see _parallel_values)

    _refuse(cp_problem(c.cp, c.cp_mode, c.block_size, s.tp_sizes["n_heads"], c.tp, as_flag))


# -- data --------------------------------------------------------------------------------------


def _data_values(c: Config) -> None:
    """How much of the data trains and how much is held out."""
    if not 0.0 < c.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be between 0 and 1, got {c.val_fraction}")


# -- parallel: layout and batch split; reduction: how gradients cross the replicas --------------


def _layout(c: Config, world: int) -> tuple[int, int]:
    """``(tp, pp)`` of the strategy: world = dp x tp x pp, each strategy fixes the sizes it does
    not use to 1."""
    strategy = c.strategy
    given = {k: v for k, v in (("tp", c.tp), ("pp", c.pp), ("ep", c.ep if c.ep > 1 else None)) if v is not None}
    if strategy in ("dp", "ps") and any(v > 1 for v in given.values()):
        flags = " ".join(f"--{k} {v}" for k, v in given.items())
        raise ConfigError(f"--strategy {strategy} does not use {flags}: use --strategy hybrid for tp x pp x dp")
    if strategy in ("tp", "pp") and c.ep > 1:
        raise ConfigError(f"--strategy {strategy} does not use --ep {c.ep}: use --strategy hybrid for "
                          "tp x pp x dp with ep")
    if c.cp > 1 and strategy != "hybrid":  # the one runtime that splits sequences (ParallelTrainer's)
        what = "the parameter server has no replicas that share a sequence" if strategy == "ps" else \
            "use --strategy hybrid (or leave --strategy out) for cp x tp x pp x dp"
        raise ConfigError(f"--strategy {strategy} does not use --cp {c.cp}: {what}")
    if strategy == "tp":
        if c.pp not in (None, 1):
            raise ConfigError("--strategy tp does not use --pp: use --strategy hybrid for tp x pp x dp")
        return c.tp or world, 1
    if strategy == "pp":
        if c.tp not in (None, 1):
            raise ConfigError("--strategy pp does not use --tp: use --strategy hybrid for tp x pp x dp")
        return 1, c.pp or world
    if strategy == "hybrid":
        return c.tp or 1, c.pp or 1
    return 1, 1


def _batch(c: Config) -> None:
    """The global batch split over the data-parallel replicas (the ps workers are all ranks),
    then into accumulation steps and pipeline micro-batches."""
    if c.batch_size % c.dp:
        raise ConfigError(f"--batch-size {c.batch_size} does not split over dp={c.dp} replicas: "
                          f"use a multiple of {c.dp}")
    c.local_batch = c.batch_size // c.dp
    if c.local_batch % c.accum_steps:
        raise ConfigError(f"the per-replica batch {c.local_batch} does not split into --accum-steps {c.accum_steps}")
    if c.pp > 1 and c.local_batch % (c.microbatches * c.accum_steps):
        raise ConfigError(f"the per-replica batch {c.local_batch} does not split into "
                          f"--microbatches {c.microbatches}" + (f" x --accum-steps {c.accum_steps}"
                                                                 if c.accum_steps > 1 else ""))


def nccl_problem(c: Config, gpus_everywhere: bool | None = None) -> str | None:
    """Why ``--backend nccl`` cannot run (``None``: it can): NCCL reduces on GPUs.

    ``gpus_everywhere``: whether every rank sees a GPU, known only once the job runs (the job's
    device choice asks again with it); before, only ``--device cpu`` is refused.
    """
    if c.backend != "nccl":
        return None
    if c.device == "cpu":
        return "--backend nccl reduces on GPUs: it needs --device cuda (or auto on GPU nodes)"
    if c.device == "auto" and gpus_everywhere is False:
        return "--backend nccl needs a GPU on every rank; --device auto found ranks without"
    return None


def _reduction(c: Config, world: int) -> None:
    """How gradients are reduced across the replicas: ZeRO, compression, the backend."""
    if c.compression is not None and c.dp == 1:
        raise ConfigError(f"--compression {c.compression} compresses the data-parallel all-reduce, but dp=1")
    problem = nccl_problem(c)
    if problem is not None:
        raise ConfigError(problem)
    if c.backend != "mpi" and c.strategy == "ps":
        raise ConfigError(f"--backend {c.backend} is for the gradient all-reduce; --strategy ps talks through MPI "
                          "windows")
    from ..parallel.engine import compression_problem  # (see _parallel_values)
    from ..parallel.zero import zero_reducer_problem

    _refuse(compression_problem(c.compression, c.backend, as_flag))
    _refuse(zero_reducer_problem(c.zero, c.compression, c.backend, say=as_flag))


def _parallel_values(c: Config) -> None:
    # The parallel package's rules are imported when a config is checked, not with this module:
    # importing parallel starts MPI, which `hpctrain --help` and the tools that need none must not.
    from ..parallel.ps_args import staleness_problem
    from ..parallel.zero import zero_problem

    _refuse(zero_problem(c.zero, as_flag))
    _refuse(staleness_problem(c.staleness, as_flag))


def _auto_layout(c: Config) -> None:
    """``--layout auto`` plans the synchronous layouts (the layout settings given beside it
    constrain the plan); ``--probe-file`` prices its links, ``--no-calibrate`` skips its timed steps."""
    if c.layout != "auto":
        if c.probe_file is not None:
            raise ConfigError(f"--probe-file {c.probe_file} prices the links of --layout auto's plan: give --layout "
                              "auto too (or use it with `hpctrain plan`)")
        if not c.calibrate:
            raise ConfigError("--no-calibrate skips the timed steps of --layout auto's plan: give --layout auto too "
                              "(or use it with `hpctrain plan`)")
        return
    if c.strategy == "ps":
        raise ConfigError("--layout auto plans the synchronous layouts (dp, tp, pp, ZeRO); --strategy ps is not one: "
                          "drop one of them")


def _parallel(c: Config, world: int) -> None:
    """The strategy and layout (fills ``strategy``, ``tp``, ``pp``, ``dp``, ``local_batch``)."""
    _auto_layout(c)
    if c.strategy is None:  # --tp T --pp P --cp C (--ep E) alone: dp is what is left of the world
        c.strategy = "hybrid" if (c.tp or 1) > 1 or (c.pp or 1) > 1 or c.cp > 1 or c.ep > 1 else "dp"
    if c.zero and c.strategy == "ps":
        raise ConfigError("--zero shards over data-parallel replicas; the parameter server (--strategy ps) has none")
    tp, pp = _layout(c, world)
    cp = f" x cp={c.cp}" if c.cp > 1 else ""
    if world % (tp * pp * c.cp):
        raise ConfigError(f"{world} ranks do not factor into tp={tp} x pp={pp}{cp} x dp: "
                          f"the world size must be a multiple of {tp * pp * c.cp}")
    c.tp, c.pp, c.dp = tp, pp, world // (tp * pp * c.cp)
    from ..parallel.expert_grads import ep_dp_problem  # (see _parallel_values)

    _refuse(ep_dp_problem(c.ep, c.dp, as_flag))
    if c.cut_points and c.pp == 1:  # (auto: a run's stored cut dropped, e.g. on a resume)
        raise ConfigError(f"--pp-cut {c.pp_cut} says where pipeline stages begin, but pp=1: give --pp 2 or more "
                          "(or --pp-cut auto)")
    _batch(c)


# -- optim -------------------------------------------------------------------------------------

#: Settings the parameter server's plain SGD steps cannot take, at their neutral values.
_NOT_ON_PS = (("clip_norm", None), ("accum_steps", 1), ("compression", None), ("lr_schedule", "constant"),
              ("warmup", 0))


def _ps_optimizer(c: Config) -> None:
    """The parameter server applies plain SGD on its shards (momentum in sync mode only: server-side
    momentum needs every worker's gradient of a step)."""
    if c.optimizer != "sgd":
        raise ConfigError(f"--strategy ps applies SGD on the servers: --optimizer {c.optimizer} is not possible")
    if c.weight_decay:
        raise ConfigError("--strategy ps applies plain SGD (with --momentum): --weight-decay is not possible")
    from ..parallel.ps_args import momentum_problem  # (see _parallel_values)

    _refuse(momentum_problem(c.ps_mode, c.momentum or 0.0, as_flag))  # (None: its default, filled below)
    for key, neutral in _NOT_ON_PS:
        if getattr(c, key) != neutral:
            raise ConfigError(f"--strategy ps applies plain SGD steps on the servers: {flag(key)} is not possible")


def _optim_values(c: Config) -> None:
    _refuse(clip_norm_problem(c.clip_norm, as_flag))


def _optim(c: Config, world: int) -> None:
    """The optimizer and its schedule (fills ``optimizer``, ``momentum`` and ``lr`` defaults)."""
    ps = c.strategy == "ps"
    if c.optimizer is None:
        c.optimizer = "sgd" if ps else "adamw"
    if ps:
        _ps_optimizer(c)
    if c.momentum is None:
        c.momentum = 0.0 if ps and c.ps_mode != "sync" else 0.9
    if c.lr is None:
        # Plain SGD on this data wants a larger step than SGD with momentum 0.9.
        c.lr = 3e-3 if c.optimizer != "sgd" else 0.3 if c.momentum == 0 else 0.1
    if c.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {c.lr}")
    if c.lr_schedule == "cosine" and c.min_lr > c.lr:
        raise ConfigError(f"--min-lr {c.min_lr:g} must not exceed --lr {c.lr:g}")


# -- precision ---------------------------------------------------------------------------------


def loss_scaler(c: Config) -> Any:
    """fp16-mixed's ``DynamicLossScaler`` with the run's settings (defaults where not given)."""
    from ..training.precision import DynamicLossScaler

    kw = {"init_scale": c.loss_scale_init, "interval": c.loss_scale_interval}
    return DynamicLossScaler(**{k: v for k, v in kw.items() if v is not None})


def _loss_scale(c: Config) -> None:
    """The loss scaler's settings: fp16-mixed only (bf16 and fp32 keep float32's range and scale
    nothing), and values ``DynamicLossScaler`` takes (it says which: one check, its own)."""
    given = [k for k, v in (("loss_scale_init", c.loss_scale_init), ("loss_scale_interval", c.loss_scale_interval))
             if v is not None]
    if not given:
        return
    if c.precision != "fp16-mixed":
        raise ConfigError(f"{', '.join(flag(k) for k in given)}: only --precision fp16-mixed scales the loss "
                          f"(this run has --precision {c.precision})")
    try:
        loss_scaler(c)
    except ValueError as exc:
        raise ConfigError(f"{', '.join(flag(k) for k in given)}: {exc}") from None


def _precision(c: Config, world: int) -> None:
    """Mixed precision: what the gradients reduce in, the loss scale, the strategies it works with."""
    _refuse(precision_problem(c.precision, c.grad_reduce_dtype, as_flag))
    _loss_scale(c)
    if c.precision != "fp32" and c.strategy == "ps":
        raise ConfigError(f"--precision {c.precision} works with --strategy dp/tp/pp/hybrid, not --strategy ps")
    from ..parallel.engine import mixed_reduce_problem  # (see _parallel_values)

    _refuse(mixed_reduce_problem(c.precision, c.compression, c.backend, as_flag))


# -- checkpoint --------------------------------------------------------------------------------


def _checkpoint(c: Config, world: int) -> None:
    """Where checkpoints go, how often, and whether the run continues or starts over."""
    if c.resume and c.restart:
        raise ConfigError("--resume continues the run and --restart starts it over: give one of them")
    if c.resume and c.run_dir is None and c.checkpoint_dir is None:
        raise ConfigError("--resume needs the --run-dir (or --checkpoint-dir) of the run to continue")


SECTIONS: tuple[Section, ...] = (
    Section("parallel", ("strategy", "tp", "pp", "cp", "cp_mode", "ep", "batch_size", "accum_steps",
                         "microbatches", "schedule", "pp_cut", "zero", "ps_mode", "staleness", "layout", "probe_file",
                         "calibrate"),
            _parallel,
            _parallel_values),
    Section("model", ("model", "loss", "d_model", "n_layers", "n_heads", "block_size", "dropout", "recompute",
                      "tie_embeddings", "seed", "moe_experts", "moe_top_k", "moe_every", "moe_capacity",
                      "moe_aux_loss"), _model, _model_values),
    Section("data", ("data", "x_key", "y_key", "tokens_key", "max_samples", "val_fraction"), _no_rules, _data_values),
    Section("optim", ("optimizer", "lr", "momentum", "weight_decay", "lr_schedule", "warmup", "min_lr",
                      "clip_norm"), _optim, _optim_values),
    Section("checkpoint", ("run_dir", "checkpoint_dir", "checkpoint_every", "resume", "restart", "keep",
                           "async_checkpoint"), _checkpoint),
    Section("precision", ("precision", "grad_reduce_dtype", "loss_scale_init", "loss_scale_interval"), _precision),
    Section("reduction", ("compression", "backend"), _reduction),
)
