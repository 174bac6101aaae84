"""The configuration of ``hpctrain train``: one typed dataclass, read from defaults < file < flags.

Every field of :class:`Config` that is not derived is a TOML key and a flag (``batch_size`` is
``batch_size`` or ``batch-size`` in the file and ``--batch-size`` on the command line). A run
writes its resolved configuration to ``RUN_DIR/config.json``; ``--config config.json`` reads it
back (the derived fields are recomputed, not trusted).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..nn.transformer import GPT


def _opt(help: str, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    return {"help": help, "choices": choices}


def _derived(help: str) -> dict[str, Any]:
    return {"help": help, "derived": True}


@dataclass
class Config:
    """Settings of one training job. ``resolve`` fills the derived fields and refuses bad values."""

    strategy: str | None = field(default=None, metadata=_opt("how the job is split across ranks [dp; hybrid when "
                                                             "--tp or --pp is given]",
                                                             ("dp", "tp", "pp", "ps", "hybrid")))
    tp: int | None = field(default=None, metadata=_opt("tensor-parallel group size (tp: all ranks; hybrid: 1)"))
    pp: int | None = field(default=None, metadata=_opt("pipeline stages (pp: all ranks; hybrid: 1)"))
    model: str = field(default="mlp", metadata=_opt("mlp: classifier on the built-in set; gpt: character-level "
                                                     "GPT; or your own, package.module:factory or "
                                                     "path/to/file.py:factory (a callable taking this Config "
                                                     "and returning a Module)"))
    data: str | None = field(default=None, metadata=_opt("HDF5 file (keys --x-key/--y-key, or --tokens-key for "
                                                         "token windows; a token file may add val_tokens) or "
                                                         "'shakespeare' (gpt: the corpus of `hpctrain data make`); "
                                                         "default: the built-in set"))
    x_key: str = field(default="x", metadata=_opt("the --data file's inputs (N, ...)"))
    y_key: str = field(default="y", metadata=_opt("the --data file's targets (N,) or (N, ...)"))
    tokens_key: str | None = field(default=None, metadata=_opt("the --data file's 1-d token stream: windows of "
                                                               "--block-size (default for --model gpt: tokens)"))
    loss: str = field(default="ce", metadata=_opt("ce: cross-entropy on class indices; mse: mean squared error "
                                                  "on float targets", ("ce", "mse")))
    epochs: int = field(default=3, metadata=_opt("passes over the training data"))
    batch_size: int = field(default=64, metadata=_opt("global batch: samples per optimizer step over the whole job"))
    lr: float | None = field(default=None, metadata=_opt("learning rate (default: 3e-3 adam/adamw; sgd: 0.1, "
                                                         "0.3 without momentum)"))
    optimizer: str | None = field(default=None, metadata=_opt("default: adamw (sgd for --strategy ps)",
                                                              ("sgd", "adam", "adamw")))
    momentum: float | None = field(default=None, metadata=_opt("SGD momentum (default: 0.9; 0 for ps async/ssp, "
                                                               "which take none)"))
    weight_decay: float = field(default=0.0, metadata=_opt("weight decay (decoupled for adamw)"))
    seed: int = field(default=0, metadata=_opt("seed of the model's initial weights and of the data order"))
    run_dir: str | None = field(default=None, metadata=_opt("where metrics, trace, checkpoints go "
                                                            "(default: runs/<date-time>)"))
    checkpoint_dir: str | None = field(default=None, metadata=_opt("default: RUN_DIR/checkpoints"))
    checkpoint_every: int | None = field(default=None, metadata=_opt("steps between checkpoints "
                                                                     "(default: once per epoch)"))
    resume: bool = field(default=False, metadata=_opt("continue from the newest checkpoint in the checkpoint "
                                                      "directory (a missing or empty one: start fresh)"))
    restart: bool = field(default=False, metadata=_opt("start over in a run directory that holds checkpoints "
                                                       "(they and metrics.jsonl are moved aside, not deleted)"))
    d_model: int = field(default=64, metadata=_opt("model width"))
    n_layers: int = field(default=2, metadata=_opt("hidden blocks (mlp) or transformer blocks (gpt)"))
    n_heads: int = field(default=4, metadata=_opt("attention heads (gpt)"))
    block_size: int = field(default=32, metadata=_opt("context length in characters (gpt)"))
    microbatches: int = field(default=4, metadata=_opt("micro-batches per step (pp)"))
    zero: int = field(default=0, metadata=_opt("ZeRO over the dp group: 1 optimizer state, 2 + gradients, "
                                               "3 + parameters sharded (dp, tp, pp, hybrid)"))
    recompute: bool = field(default=False, metadata=_opt("recompute activations in backward (each transformer "
                                                         "block / MLP block keeps only its input)"))
    schedule: str = field(default="1f1b", metadata=_opt("pipeline schedule (pp)", ("1f1b", "gpipe")))
    ps_mode: str = field(default="sync", metadata=_opt("parameter-server mode (ps)", ("sync", "async", "ssp")))
    staleness: int = field(default=2, metadata=_opt("bound on how far a worker may run ahead (ps, ssp)"))
    max_samples: int | None = field(default=None, metadata=_opt("train on only the first N samples "
                                                                "(quick runs, tests)"))
    val_fraction: float = field(default=0.1, metadata=_opt("share of the data held out for the final evaluation"))
    log_every: int = field(default=20, metadata=_opt("steps between progress lines"))
    # Training controls.
    max_steps: int | None = field(default=None, metadata=_opt("stop after this many steps in all (the epochs "
                                                              "stay an upper bound)"))
    lr_schedule: str = field(default="constant", metadata=_opt("learning-rate schedule after the warm-up "
                                                               "(cosine: down to --min-lr at the last step)",
                                                               ("constant", "cosine")))
    warmup: int = field(default=0, metadata=_opt("steps of linear learning-rate warm-up"))
    min_lr: float = field(default=0.0, metadata=_opt("learning rate the cosine schedule ends at"))
    clip_norm: float | None = field(default=None, metadata=_opt("clip the global gradient norm to this value"))
    accum_steps: int = field(default=1, metadata=_opt("split each replica's batch into this many micro-batches "
                                                      "whose gradients accumulate (same update, less memory)"))
    eval_every: int | None = field(default=None, metadata=_opt("steps between validation losses during "
                                                               "training (metrics.jsonl, progress line)"))
    keep: int = field(default=3, metadata=_opt("checkpoints to keep (the newest)"))
    async_checkpoint: bool = field(default=False, metadata=_opt("write checkpoints in a background thread: "
                                                                "training waits only for a host copy of each "
                                                                "rank's share (the last one and a preemption's "
                                                                "are finished before the job ends)"))
    compression: str | None = field(default=None, metadata=_opt("16-bit gradient all-reduce (dp)",
                                                                ("fp16", "bf16")))
    precision: str = field(default="fp32", metadata=_opt("compute in bf16/fp16 with float32 master weights and "
                                                         "optimizer state (fp16: dynamic loss scaling)",
                                                         ("fp32", "bf16-mixed", "fp16-mixed")))
    grad_reduce_dtype: str = field(default="fp32", metadata=_opt("dtype gradients accumulate and are all-reduced "
                                                                 "in under mixed precision (bf16/fp16 halve the "
                                                                 "bytes)", ("fp32", "bf16", "fp16")))
    loss_scale_init: float | None = field(default=None, metadata=_opt("--precision fp16-mixed: the first loss scale, "
                                                                      "a power of two (default 65536)"))
    loss_scale_interval: int | None = field(default=None, metadata=_opt("--precision fp16-mixed: clean steps in a "
                                                                        "row before the loss scale doubles "
                                                                        "(default 2000)"))
    timeout: float | None = field(default=None, metadata=_opt("seconds a wait may last before the job ends "
                                                              "(0 = off; default $HPCTRAIN_TIMEOUT or 300)"))
    on_rank_loss: str | None = field(default=None, metadata=_opt("a rank lost (killed, its node gone): abort the "
                                                                 "job, or shrink to the survivors and go on "
                                                                 "(needs ULFM: Open MPI, mpiexec --with-ft ulfm; "
                                                                 "pure dp). Default: shrink where possible, "
                                                                 "else abort", ("abort", "shrink")))
    on_nonfinite: str = field(default="raise", metadata=_opt("a step with a non-finite loss or gradient: raise, "
                                                             "or skip it (nothing changes)", ("raise", "skip")))
    dropout: float = field(default=0.0, metadata=_opt("dropout probability in the model (training only)"))
    device: str = field(default="auto", metadata=_opt("where the model, batches and optimizer state live: cuda "
                                                      "(each rank the GPU of its local rank), cpu, or auto (cuda "
                                                      "when every rank sees a GPU)", ("auto", "cpu", "cuda")))
    backend: str = field(default="mpi", metadata=_opt("gradient all-reduce: MPI (CUDA-aware or staged), "
                                                      "hierarchical (MPI by node: reduce inside each node, "
                                                      "all-reduce across nodes, broadcast back) or NCCL "
                                                      "(needs --device cuda)", ("mpi", "hierarchical", "nccl")))

    # Derived by resolve(): never read from flags or files.
    dp: int | None = field(default=None, metadata=_derived("data-parallel replicas: world / (tp x pp)"))
    local_batch: int | None = field(default=None, metadata=_derived("samples per step on one replica"))
    #: Facts of the opened data a model factory may need (``n_in``, ``x_shape``, ``n_classes`` or
    #: ``n_out``, ``vocab_size``, ``path``): filled by the job before it calls the factory.
    info: dict | None = field(default=None, metadata=_derived("facts of the opened data"))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what ``config.json`` holds and ranks compare)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Option:
    """One setting: a TOML key ``name`` and the flag ``--name`` (underscores as dashes)."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None


def _base_type(hint: Any) -> type:
    """``int`` for ``int | None`` and ``int``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _check_loss_scale(c: Config) -> None:
    """The loss scaler's settings: fp16-mixed only (bf16 and fp32 keep float32's range and scale
    nothing), and values ``DynamicLossScaler`` takes."""
    given = [k for k in ("loss_scale_init", "loss_scale_interval") if getattr(c, k) is not None]
    if not given:
        return
    if c.precision != "fp16-mixed":
        raise ConfigError(f"{', '.join(flag(k) for k in given)}: only --precision fp16-mixed scales the loss "
                          f"(this run has --precision {c.precision})")
    try:
        loss_scaler(c)
    except ValueError as exc:
        raise ConfigError(f"{', '.join(flag(k) for k in given)}: {exc}") from None


def loss_scaler(c: Config) -> Any:
    """fp16-mixed's ``DynamicLossScaler`` with the run's settings (defaults where not given)."""
    from ..precision import DynamicLossScaler

    kw = {"init_scale": c.loss_scale_init, "interval": c.loss_scale_interval}
    return DynamicLossScaler(**{k: v for k, v in kw.items() if v is not None})


def _options() -> tuple[Option, ...]:
    hints = typing.get_type_hints(Config)
    return tuple(
        Option(f.name, _base_type(hints[f.name]), f.default, f.metadata["help"], f.metadata.get("choices"))
        for f in dataclasses.fields(Config) if not f.metadata.get("derived")
    )


OPTIONS: tuple[Option, ...] = _options()
_BY_NAME = {o.name: o for o in OPTIONS}
DERIVED = frozenset(f.name for f in dataclasses.fields(Config) if f.metadata.get("derived"))


def flag(name: str) -> str:
    """``--batch-size`` for ``batch_size``."""
    return "--" + name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``hpctrain train``: ``--config FILE`` plus one per option (unset unless given)."""
    p.add_argument("--config", metavar="FILE",
                   help="TOML file with the same keys as the flags, or the config.json a run wrote")
    for o in OPTIONS:
        default = "" if o.default is None else f" [{o.default}]"
        if o.type is bool:
            p.add_argument(flag(o.name), action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=o.help + default)
        else:
            p.add_argument(flag(o.name), type=o.type, choices=o.choices, default=argparse.SUPPRESS,
                           metavar=o.name.upper() if o.choices is None else None, help=o.help + default)


def read_config(path: str) -> dict[str, Any]:
    """The settings of a TOML file (top level or ``[train]``) or of a run's ``config.json``.

    Keys are checked against the options (a misspelt key is refused with the closest name);
    a JSON file may also hold the derived fields a run wrote, which are dropped.
    """
    is_json = path.endswith(".json")
    try:
        if is_json:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            if not isinstance(raw, dict):
                raise ConfigError(f"config file {path} must hold a JSON object, got {type(raw).__name__}")
            raw = {k: v for k, v in raw.items() if k not in DERIVED}
        else:
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            with open(path, "rb") as f:
                raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"config file {path} is not valid {'JSON' if is_json else 'TOML'}: {exc}") from None
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    if isinstance(raw.get("train"), dict):
        raw = {**{k: v for k, v in raw.items() if k != "train"}, **raw["train"]}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in _BY_NAME:
            close = difflib.get_close_matches(name, _BY_NAME, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}")
        out[name] = _coerce(_BY_NAME[name], value, f"{path}: {key}", allow_none=is_json)
    return out


read_toml = read_config  # the name of the first round


def _coerce(o: Option, value: Any, where: str, allow_none: bool = False) -> Any:
    if value is None and allow_none and o.default is None:  # JSON null: "not set"
        return None
    ok = (isinstance(value, bool) if o.type is bool
          else isinstance(value, (int, float)) and not isinstance(value, bool) if o.type is float
          else isinstance(value, o.type) and not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{where} must be {o.type.__name__}, got {value!r}")
    if o.choices and value not in o.choices:
        raise ConfigError(f"{where} must be one of {', '.join(o.choices)}, got {value!r}")
    return o.type(value)


def merge(file_values: dict[str, Any], flags: dict[str, Any]) -> Config:
    """Defaults, overridden by the file, overridden by the flags given on the command line.

    Keys that are not options (argparse's ``command``, ``config``) are ignored; values are
    checked like a file's.
    """
    values = dict(file_values)
    for k, v in flags.items():
        if k in _BY_NAME:
            values[k] = _coerce(_BY_NAME[k], v, flag(k), allow_none=True)
    return Config(**values)


def as_config(cfg: Config | dict[str, Any]) -> Config:
    """``cfg`` itself, or a dict of options (refused if it names no option) over the defaults."""
    if isinstance(cfg, Config):
        return cfg
    unknown = sorted(set(cfg) - set(_BY_NAME) - DERIVED)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}")
    return merge({}, {k: v for k, v in cfg.items() if k not in DERIVED})
def resolve(cfg: Config | dict[str, Any], world: int) -> Config:
    """Fill the derived settings (layout, per-rank batch, optimizer, lr) and refuse bad ones.

    Pure function of its arguments, so every rank reaches the same verdict without talking.
    Raises ConfigError naming the setting and what would work instead.
    """
    c = as_config(cfg).replace()  # a copy: the caller's config stays as given
    if c.strategy is None:  # --tp T --pp P alone: dp is what is left of the world
        c.strategy = "hybrid" if (c.tp or 1) > 1 or (c.pp or 1) > 1 else "dp"
    strategy = c.strategy
    for key in ("epochs", "batch_size", "d_model", "n_layers", "n_heads", "block_size", "microbatches",
                "log_every"):
        if getattr(c, key) < 1:
            raise ConfigError(f"{flag(key)} must be >= 1, got {getattr(c, key)}")
    for key in ("tp", "pp", "checkpoint_every", "max_samples", "max_steps", "eval_every"):
        if getattr(c, key) is not None and getattr(c, key) < 1:
            raise ConfigError(f"{flag(key)} must be >= 1, got {getattr(c, key)}")
    for key in ("accum_steps",):
        if getattr(c, key) < 1:
            raise ConfigError(f"{flag(key)} must be >= 1, got {getattr(c, key)}")
    for key in ("warmup", "keep", "min_lr"):
        if getattr(c, key) < 0:
            raise ConfigError(f"{flag(key)} must be >= 0, got {getattr(c, key)}")
    if c.clip_norm is not None and not c.clip_norm > 0:
        raise ConfigError(f"--clip-norm must be > 0, got {c.clip_norm}")
    if not 0.0 <= c.dropout < 1.0:
        raise ConfigError(f"--dropout must be in [0, 1), got {c.dropout}")
    if c.timeout is not None:
        from ..settings import resolve_timeout

        resolve_timeout(c.timeout)  # ConfigError for a negative or non-finite value
    if c.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {c.zero}")
    if c.zero and c.strategy == "ps":
        raise ConfigError("--zero shards over data-parallel replicas; the parameter server (--strategy ps) has none")
    if c.recompute and c.strategy == "ps":
        raise ConfigError("--recompute is for the synchronous strategies, not --strategy ps")
    if c.staleness < 0:
        raise ConfigError(f"--staleness must be >= 0, got {c.staleness}")
    # float("nan") and float("inf") parse as numbers: an lr of nan would surface steps later as a
    # NonFiniteError blaming the gradients.
    for key in ("lr", "momentum", "weight_decay", "val_fraction"):
        value = getattr(c, key)
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{flag(key)} {value} is not a finite number")
    if c.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be >= 0, got {c.weight_decay}")
    if not 0.0 < c.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be between 0 and 1, got {c.val_fraction}")

    # Layout: world = dp x tp x pp. Each strategy fixes the sizes it does not use to 1.
    given = {k: getattr(c, k) for k in ("tp", "pp") if getattr(c, k) is not None}
    if strategy in ("dp", "ps") and any(v > 1 for v in given.values()):
        flags = " ".join(f"--{k} {v}" for k, v in given.items())
        raise ConfigError(f"--strategy {strategy} does not use {flags}: use --strategy hybrid for tp x pp x dp")
    if strategy == "tp":
        if c.pp not in (None, 1):
            raise ConfigError("--strategy tp does not use --pp: use --strategy hybrid for tp x pp x dp")
        tp, pp = c.tp or world, 1
    elif strategy == "pp":
        if c.tp not in (None, 1):
            raise ConfigError("--strategy pp does not use --tp: use --strategy hybrid for tp x pp x dp")
        tp, pp = 1, c.pp or world
    elif strategy == "hybrid":
        tp, pp = c.tp or 1, c.pp or 1
    else:
        tp, pp = 1, 1
    if world % (tp * pp):
        raise ConfigError(f"{world} ranks do not factor into tp={tp} x pp={pp} x dp: "
                          f"the world size must be a multiple of {tp * pp}")
    dp = world // (tp * pp)
    c = c.replace(tp=tp, pp=pp, dp=dp)

    # The global batch is split over the data-parallel replicas (the ps workers are all ranks).
    if c.batch_size % dp:
        raise ConfigError(f"--batch-size {c.batch_size} does not split over dp={dp} replicas: "
                          f"use a multiple of {dp}")
    c = c.replace(local_batch=c.batch_size // dp)
    if c.local_batch % c.accum_steps:
        raise ConfigError(f"the per-replica batch {c.local_batch} does not split into --accum-steps {c.accum_steps}")
    if pp > 1 and c.local_batch % (c.microbatches * c.accum_steps):
        raise ConfigError(f"the per-replica batch {c.local_batch} does not split into "
                          f"--microbatches {c.microbatches}" + (f" x --accum-steps {c.accum_steps}"
                                                                 if c.accum_steps > 1 else ""))

    # Model shapes the layout must divide.
    if c.model not in ("mlp", "gpt") and ":" not in c.model:
        raise ConfigError(f"--model {c.model!r} is neither mlp, gpt nor package.module:factory "
                          f"(or path/to/file.py:factory)")
    if c.model == "gpt" and c.loss != "ce":
        raise ConfigError("--model gpt predicts the next token: it trains with --loss ce")
    if c.model == "gpt" and c.d_model % c.n_heads:
        raise ConfigError(f"--n-heads {c.n_heads} must divide --d-model {c.d_model}")
    if tp > 1:
        if c.model == "gpt" and c.n_heads % tp:
            raise ConfigError(f"tp={tp} must divide --n-heads {c.n_heads} (heads are split across ranks)")
        if c.model in ("mlp", "gpt") and (4 * c.d_model) % tp:
            raise ConfigError(f"tp={tp} must divide the hidden width 4 x d_model = {4 * c.d_model}")
    if pp > 1 and c.model in ("mlp", "gpt") and pp > _n_stages_possible(c):
        raise ConfigError(f"pp={pp} stages but the {c.model} model has only {_n_stages_possible(c)} layers "
                          f"to cut: use fewer stages or more --n-layers")

    # Optimizer: the parameter server applies plain SGD on its shards.
    if c.optimizer is None:
        c.optimizer = "sgd" if strategy == "ps" else "adamw"
    if strategy == "ps" and c.optimizer != "sgd":
        raise ConfigError(f"--strategy ps applies SGD on the servers: --optimizer {c.optimizer} is not possible")
    if strategy == "ps" and c.weight_decay:
        raise ConfigError("--strategy ps applies plain SGD (with --momentum): --weight-decay is not possible")
    # Server-side momentum needs every worker's gradient of a step: only the sync mode has that.
    plain = strategy == "ps" and c.ps_mode != "sync"
    if plain and c.momentum:
        raise ConfigError(f"--ps-mode {c.ps_mode} applies plain SGD: --momentum {c.momentum} "
                          "needs --ps-mode sync")
    if c.momentum is None:
        c.momentum = 0.0 if plain else 0.9
    if c.momentum < 0:
        raise ConfigError(f"--momentum must be >= 0, got {c.momentum}")
    if c.lr is None:
        # Plain SGD on this data wants a larger step than SGD with momentum 0.9.
        c.lr = 3e-3 if c.optimizer != "sgd" else 0.3 if c.momentum == 0 else 0.1
    if c.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {c.lr}")
    if c.resume and c.restart:
        raise ConfigError("--resume continues the run and --restart starts it over: give one of them")
    if strategy == "ps":
        for key, default in (("clip_norm", None), ("accum_steps", 1), ("compression", None),
                             ("lr_schedule", "constant"), ("warmup", 0)):
            if getattr(c, key) != default:
                raise ConfigError(f"--strategy ps applies plain SGD steps on the servers: {flag(key)} is not possible")
    if c.grad_reduce_dtype != "fp32" and c.precision == "fp32":
        raise ConfigError(f"--grad-reduce-dtype {c.grad_reduce_dtype} needs --precision bf16-mixed or fp16-mixed")
    if c.precision == "bf16-mixed" and c.grad_reduce_dtype == "fp16":
        raise ConfigError("--precision bf16-mixed gradients can overflow fp16: --grad-reduce-dtype fp32 or bf16")
    _check_loss_scale(c)
    if c.precision != "fp32" and (strategy == "ps" or c.compression is not None):
        raise ConfigError(f"--precision {c.precision} works with --strategy dp/tp/pp/hybrid and reduces in "
                          "--grad-reduce-dtype (not --compression)")
    if c.compression is not None and dp == 1:
        raise ConfigError(f"--compression {c.compression} compresses the data-parallel all-reduce, but dp=1")
    if c.lr_schedule == "cosine" and c.min_lr > c.lr:
        raise ConfigError(f"--min-lr {c.min_lr:g} must not exceed --lr {c.lr:g}")
    if c.backend == "nccl" and c.device == "cpu":
        raise ConfigError("--backend nccl reduces on GPUs: it needs --device cuda (or auto on GPU nodes)")
    if c.backend != "mpi" and strategy == "ps":
        raise ConfigError(f"--backend {c.backend} is for the gradient all-reduce; --strategy ps talks through MPI "
                          "windows")
    if c.backend == "hierarchical" and c.compression is not None:
        raise ConfigError("--compression is for the flat all-reduce (--backend mpi), not --backend hierarchical")
    c.on_rank_loss = _on_rank_loss(c)
    if c.resume and c.run_dir is None and c.checkpoint_dir is None:
        raise ConfigError("--resume needs the --run-dir (or --checkpoint-dir) of the run to continue")
    return c


def _shrink_unsupported(c: Config) -> str | None:
    """Why this layout cannot go on without a lost rank yet (``None``: it can)."""
    if c.strategy not in ("dp", "hybrid") or (c.zero and c.strategy != "dp"):
        # (dp x tp x pp: a broken replica leaves, the whole ones go on; ZeRO's buddies are over dp)
        return f"--strategy {c.strategy}" + (f" --zero {c.zero}" if c.zero else "")
    if c.backend != "mpi":
        return f"--backend {c.backend}"
    if c.precision != "fp32":  # its float32 masters and loss scale are not kept across a loss yet
        return f"--precision {c.precision}"
    return None


def _on_rank_loss(c: Config) -> str:
    """``--on-rank-loss`` resolved: ``shrink`` where this launch detects lost ranks (ULFM) and the
    layout can continue without one, else ``abort``; an explicit ``shrink`` that cannot work is
    refused here, before anything starts (the same verdict on every rank: a local check)."""
    from ..comm import ulfm

    unsupported = _shrink_unsupported(c)
    if c.on_rank_loss is None:
        return "shrink" if ulfm.available() and unsupported is None else "abort"
    if c.on_rank_loss == "shrink":
        if not ulfm.available():
            raise ConfigError(f"--on-rank-loss shrink: this job cannot survive a lost rank: {ulfm.missing()}; "
                              "use --on-rank-loss abort")
        if unsupported is not None:
            raise ConfigError(f"--on-rank-loss shrink continues data-parallel replicas only (--strategy dp "
                              f"with --zero 0-3, or hybrid: dp x tp x pp; --backend mpi, --precision fp32), "
                              f"not {unsupported}; use --on-rank-loss abort")
    return c.on_rank_loss


def _n_stages_possible(c: Config) -> int:
    """Layers a pipeline can be cut between (see build_model; the GPT says how many it has)."""
    return 3 + 2 * c.n_layers if c.model == "mlp" else GPT.pipeline_cut_count(c.n_layers)


