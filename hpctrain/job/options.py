"""The schema of ``hpctrain train``'s configuration: the :class:`Config` dataclass, one field per
setting, and its :data:`OPTIONS` (a TOML key and a flag each).

Every field that is not derived is a TOML key and a flag (``batch_size`` is ``batch_size`` or
``batch-size`` in the file and ``--batch-size`` on the command line). A field's metadata also
declares its plain bounds (``at_least``, ``finite``), checked by the section that owns the field
(:mod:`.sections`); reading files and flags is :mod:`.config`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..training.guard import POLICIES
from ..training.precision import PRECISIONS, REDUCE_DTYPES


def _opt(help: str, choices: tuple[str, ...] | None = None, *, at_least: int | None = None,
         finite: bool = False) -> dict[str, Any]:
    """A field's metadata: ``at_least``: the smallest value allowed (``None`` stays allowed for an
    optional field); ``finite``: NaN and infinities are refused (they parse as floats)."""
    return {"help": help, "choices": choices, "at_least": at_least, "finite": finite}

def _derived(help: str) -> dict[str, Any]:
    return {"help": help, "derived": True}


@dataclass
class Config:
    """Settings of one training job. ``resolve`` fills the derived fields and refuses bad values."""

    strategy: str | None = field(default=None, metadata=_opt("how the job is split across ranks [dp; hybrid when "
                                                             "--tp, --pp or --cp is given]",
                                                             ("dp", "tp", "pp", "ps", "hybrid")))
    tp: int | None = field(default=None, metadata=_opt("tensor-parallel group size (tp: all ranks; hybrid: 1)",
                                                         at_least=1))
    pp: int | None = field(default=None, metadata=_opt("pipeline stages (pp: all ranks; hybrid: 1)", at_least=1))
    cp: int = field(default=1, metadata=_opt("context-parallel group size: each rank of a group holds 1/cp of every "
                                             "sequence's tokens (gpt; --block-size splits into 2 x cp chunks)",
                                             at_least=1))
    cp_mode: str = field(default="ring", metadata=_opt("context parallelism's attention: ring (key/value blocks "
                                                       "travel the cp ring) or ulysses (all-to-all to a split of "
                                                       "the heads: --n-heads divisible by tp x cp)",
                                                       ("ring", "ulysses")))
    model: str = field(default="mlp", metadata=_opt("mlp: an MLP (a classifier; a regressor with --loss mse); "
                                                     "gpt: character-level GPT; cnn: convolutions on the built-in "
                                                     "fields; or your own, package.module:factory or "
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
    epochs: int = field(default=3, metadata=_opt("passes over the training data in all: a --resume trains up to "
                                                 "this many, not this many more", at_least=1))
    batch_size: int = field(default=64, metadata=_opt("global batch: samples per optimizer step over the whole job",
                                                          at_least=1))
    lr: float | None = field(default=None, metadata=_opt("learning rate (default: 3e-3 adam/adamw; sgd: 0.1, "
                                                         "0.3 without momentum)", finite=True))
    optimizer: str | None = field(default=None, metadata=_opt("default: adamw (sgd for --strategy ps)",
                                                              ("sgd", "adam", "adamw")))
    momentum: float | None = field(default=None, metadata=_opt("SGD momentum (default: 0.9; 0 for ps async/ssp, "
                                                               "which take none)", at_least=0, finite=True))
    weight_decay: float = field(default=0.0, metadata=_opt("weight decay (decoupled for adamw)", at_least=0,
                                                           finite=True))
    seed: int = field(default=0, metadata=_opt("seed of the model's initial weights and of the data order",
                                                at_least=0))
    run_dir: str | None = field(default=None, metadata=_opt("where metrics, trace, checkpoints go "
                                                            "(default: runs/<date-time>)"))
    checkpoint_dir: str | None = field(default=None, metadata=_opt("default: RUN_DIR/checkpoints"))
    checkpoint_every: int | None = field(default=None, metadata=_opt("steps between checkpoints "
                                                                     "(default: once per epoch)", at_least=1))
    resume: bool = field(default=False, metadata=_opt("continue from the newest checkpoint in the checkpoint "
                                                      "directory (a missing or empty one: start fresh)"))
    dry_run: bool = field(default=False, metadata=_opt("build everything, take one step, one evaluation and a "
                                                       "checkpoint round trip, say what a full run would do, and "
                                                       "stop (nothing is written to the run directory)"))
    restart: bool = field(default=False, metadata=_opt("start over in a run directory that holds checkpoints "
                                                       "(they and metrics.jsonl are moved aside, not deleted)"))
    d_model: int = field(default=64, metadata=_opt("model width (cnn: channels)", at_least=1))
    n_layers: int = field(default=2, metadata=_opt("hidden blocks (mlp), transformer blocks (gpt) or convolution "
                                                   "blocks (cnn)", at_least=1))
    n_heads: int = field(default=4, metadata=_opt("attention heads (gpt)", at_least=1))
    block_size: int = field(default=32, metadata=_opt("context length in characters (gpt)", at_least=1))
    moe_experts: int = field(default=0, metadata=_opt("--model gpt: a mixture of this many expert MLPs in every "
                                                      "--moe-every-th block (0: a dense GPT)", at_least=0))
    moe_top_k: int = field(default=2, metadata=_opt("experts each token visits (MoE)", at_least=1))
    moe_every: int = field(default=1, metadata=_opt("every M-th block's MLP is a mixture of experts (MoE)",
                                                    at_least=1))
    moe_capacity: float = field(default=0.0, metadata=_opt("capacity factor: an expert takes at most F x its even "
                                                           "share of a batch's tokens, the rest pass by on the "
                                                           "residual (0: dropless)", at_least=0, finite=True))
    moe_aux_loss: float = field(default=0.01, metadata=_opt("weight of the load-balancing loss added to the "
                                                            "training loss (Switch's 0.01)", at_least=0,
                                                            finite=True))
    ep: int = field(default=1, metadata=_opt("expert-parallel group size: the MoE experts spread over ep of the "
                                             "dp replicas (ep divides dp)", at_least=1))
    microbatches: int = field(default=4, metadata=_opt("micro-batches per step (pp)", at_least=1))
    zero: int = field(default=0, metadata=_opt("ZeRO over the dp group: 1 optimizer state, 2 + gradients, "
                                               "3 + parameters sharded (dp, tp, pp, hybrid)"))
    recompute: bool = field(default=False, metadata=_opt("recompute activations in backward (each transformer "
                                                         "block / MLP block keeps only its input)"))
    layout: str | None = field(default=None, metadata=_opt("auto: plan first (as `hpctrain plan`) and train with "
                                                           "the best layout it predicts: dp, tp, pp, --zero, "
                                                           "--recompute and --microbatches chosen; those of them "
                                                           "given (and --strategy) are kept", ("auto",)))
    probe_file: str | None = field(default=None, metadata=_opt("--layout auto and `hpctrain plan`: price the links "
                                                               "from this saved probe (`hpctrain info --probe "
                                                               "--save FILE`) instead of probing them"))
    calibrate: bool = field(default=True, metadata=_opt("--layout auto and `hpctrain plan`: time a few real steps "
                                                        "of up to nine layouts (seconds) and fit what steps make of "
                                                        "the measured costs (the engine's own work, compute, "
                                                        "recomputation and bubble scales, each blocking call's "
                                                        "price); --no-calibrate skips it: faster, less accurate "
                                                        "(calls priced at the link probe's meeting time)"))
    schedule: str = field(default="1f1b", metadata=_opt("pipeline schedule (pp)", ("1f1b", "gpipe")))
    pp_cut: str | None = field(default=None, metadata=_opt("where pipeline stages 1.. begin: piece names or "
                                                           "indices, comma-separated (--pp 2: one, e.g. 5); "
                                                           "default (auto): balanced by each piece's measured "
                                                           "time"))
    ps_mode: str = field(default="sync", metadata=_opt("parameter-server mode (ps)", ("sync", "async", "ssp")))
    staleness: int = field(default=2, metadata=_opt("bound on how far a worker may run ahead (ps, ssp)"))
    max_samples: int | None = field(default=None, metadata=_opt("train on only the first N samples "
                                                                "(quick runs, tests)", at_least=1))
    val_fraction: float = field(default=0.1, metadata=_opt("share of the data held out for the final evaluation",
                                                           finite=True))
    log_every: int = field(default=20, metadata=_opt("steps between progress lines", at_least=1))
    logger: str = field(default="jsonl", metadata=_opt("jsonl: the metrics in RUN_DIR/metrics.jsonl; tensorboard: "
                                                       "also TensorBoard event files in RUN_DIR/tensorboard, from "
                                                       "rank 0 (needs tensorboardX)", ("jsonl", "tensorboard")))
    # Training controls.
    max_steps: int | None = field(default=None, metadata=_opt("stop after this many steps in all (the epochs "
                                                              "stay an upper bound)", at_least=1))
    lr_schedule: str = field(default="constant", metadata=_opt("learning-rate schedule after the warm-up "
                                                               "(cosine: down to --min-lr at the last step)",
                                                               ("constant", "cosine")))
    warmup: int = field(default=0, metadata=_opt("steps of linear learning-rate warm-up", at_least=0))
    min_lr: float = field(default=0.0, metadata=_opt("learning rate the cosine schedule ends at", at_least=0,
                                                     finite=True))
    clip_norm: float | None = field(default=None, metadata=_opt("clip the global gradient norm to this value"))
    accum_steps: int = field(default=1, metadata=_opt("split each replica's batch into this many micro-batches "
                                                      "whose gradients accumulate (same update, less memory)",
                                                      at_least=1))
    eval_every: int | None = field(default=None, metadata=_opt("steps between validation losses during "
                                                               "training (metrics.jsonl, progress line)", at_least=1))
    keep: int = field(default=3, metadata=_opt("checkpoints to keep (the newest)", at_least=0))
    async_checkpoint: bool = field(default=False, metadata=_opt("write checkpoints in a background thread: "
                                                                "training waits only for a host copy of each "
                                                                "rank's share (the last one and a preemption's "
                                                                "are finished before the job ends)"))
    compression: str | None = field(default=None, metadata=_opt("16-bit gradient all-reduce (dp)",
                                                                ("fp16", "bf16")))
    precision: str = field(default="fp32", metadata=_opt("compute in bf16/fp16 with float32 master weights and "
                                                         "optimizer state (fp16: dynamic loss scaling); fp64: "
                                                         "everything in float64, to tell rounding from a bug",
                                                         PRECISIONS))
    grad_reduce_dtype: str = field(default="fp32", metadata=_opt("dtype gradients accumulate and are all-reduced "
                                                                 "in under mixed precision (bf16/fp16 halve the "
                                                                 "bytes)", REDUCE_DTYPES))
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
                                                                 "dp, ZeRO, dp x tp x pp). Default: shrink where "
                                                                 "possible, else abort", ("abort", "shrink")))
    on_nonfinite: str = field(default="raise", metadata=_opt("a step with a non-finite loss or gradient: raise, "
                                                             "or skip it (nothing changes)", POLICIES))
    dropout: float = field(default=0.0, metadata=_opt("dropout probability in the model (training only)"))
    tie_embeddings: bool = field(default=False, metadata=_opt("--model gpt: the output layer is the token embedding "
                                                              "transposed (nanoGPT's tied head; one weight, stored "
                                                              "once in checkpoints)"))
    device: str = field(default="auto", metadata=_opt("where the model, batches and optimizer state live: cuda "
                                                      "(each rank the GPU of its local rank), cpu, or auto (cuda "
                                                      "when every rank sees a GPU)", ("auto", "cpu", "cuda")))
    backend: str = field(default="mpi", metadata=_opt("gradient all-reduce: MPI (CUDA-aware or staged), "
                                                      "hierarchical (MPI by node: reduce inside each node, "
                                                      "all-reduce across nodes, broadcast back) or NCCL "
                                                      "(needs --device cuda)", ("mpi", "hierarchical", "nccl")))

    # Derived by resolve(): never read from flags or files.
    dp: int | None = field(default=None, metadata=_derived("data-parallel replicas: world / (tp x pp x cp)"))
    local_batch: int | None = field(default=None, metadata=_derived("samples per step on one replica"))
    #: Facts of the opened data a model factory may need (``n_in``, ``x_shape``, ``n_classes`` or
    #: ``n_out``, ``vocab_size``, ``path``): filled by the job before it calls the factory.
    info: dict | None = field(default=None, metadata=_derived("facts of the opened data"))
    #: The settings ``resolve`` filled in because none was given (the layout, the optimizer's
    #: defaults, what ends the job on a lost rank): a resume derives them again for its own launch.
    unset: list | None = field(default=None, compare=False, metadata=_derived("settings resolve filled in"))
    #: A resumed job whose layout is not the run's: the run's and why (``read_settings``), said in the header.
    layout_note: str | None = field(default=None, compare=False, metadata=_derived("how the run's layout changed"))
    #: ``--layout auto``'s choice as the header says it (``auto -> dp=2 tp=1 pp=2 zero=1 (planned: ...)``).
    planned: str | None = field(default=None, compare=False, metadata=_derived("the layout --layout auto chose"))
    #: The settings of ``PLANNED`` the plan chose (those not given): filled in, so a resume plans them again.
    chosen: list | None = field(default=None, compare=False, metadata=_derived("the settings the plan chose"))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what ``config.json`` holds and ranks compare)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    @property
    def cut_points(self) -> tuple[str, ...] | None:
        """``--pp-cut``'s points (piece names or indices where stages 1.. begin); ``None`` when it
        is not given or ``auto`` (the stages balanced): the one reading of it (train, plan, checks)."""
        if self.pp_cut in (None, "", "auto"):
            return None
        return tuple(s.strip() for s in self.pp_cut.split(","))


@dataclass(frozen=True)
class Option:
    """One setting: a TOML key ``name`` and the flag ``--name`` (underscores as dashes)."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    at_least: int | None = None
    finite: bool = False


def _base_type(hint: Any) -> type:
    """``int`` for ``int | None`` and ``int``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _options() -> tuple[Option, ...]:
    hints = typing.get_type_hints(Config)
    return tuple(
        Option(f.name, _base_type(hints[f.name]), f.default, f.metadata["help"], f.metadata.get("choices"),
               f.metadata.get("at_least"), f.metadata.get("finite", False))
        for f in dataclasses.fields(Config) if not f.metadata.get("derived")
    )


OPTIONS: tuple[Option, ...] = _options()
_BY_NAME = {o.name: o for o in OPTIONS}
DERIVED = frozenset(f.name for f in dataclasses.fields(Config) if f.metadata.get("derived"))


#: The settings ``--layout auto`` chooses; those given beside it (a ZeRO stage, ``--recompute``:
#: ``--zero 0``/``--no-recompute`` are the defaults, so they leave the choice open) constrain it.
PLANNED = ("strategy", "tp", "pp", "cp", "ep", "zero", "recompute", "microbatches")


def flag(name: str) -> str:
    """``--batch-size`` for ``batch_size``."""
    return "--" + name.replace("_", "-")


#: Library argument names whose flag is named otherwise (``ParameterServerTrainer(mode=)``: ``--ps-mode``).
_FLAG_OF = {"mode": "ps_mode", "experts": "moe_experts", "top_k": "moe_top_k", "capacity": "moe_capacity"}


def as_flag(name: str, value: Any = ...) -> str:
    """A library argument as the command line names it: ``--zero``, or with its value ``--zero 1``.
    The ``say`` the configuration passes to the library's rule functions (``errors.Say``), so a
    rule refused by the library and by a flag reads the same but for the names."""
    f = flag(_FLAG_OF.get(name, name))
    return f if value is ... else f"{f} {value}"


def check_bounds(c: Config, names: tuple[str, ...]) -> None:
    """Refuse a value of ``names`` outside its field's declared bounds (``None`` passes): first
    not finite, then below ``at_least``. The one place these plain bounds are checked."""
    for name in names:
        o, value = _BY_NAME[name], getattr(c, name)
        if value is None:
            continue
        if o.finite and not math.isfinite(value):
            raise ConfigError(f"{flag(name)} {value} is not a finite number")
        if o.at_least is not None and value < o.at_least:
            raise ConfigError(f"{flag(name)} must be >= {o.at_least}, got {value}")
