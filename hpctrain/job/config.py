"""The configuration of ``hpctrain train``: read from defaults < file < flags, then resolved.

The schema (the :class:`Config` dataclass, one TOML key and one flag per field) is
:mod:`.options`; the rules, one section per concern (model, data, parallel, optim, precision,
checkpoint, and runtime here), are :mod:`.sections`. A run writes its resolved configuration to
``RUN_DIR/config.json``; ``--config config.json`` reads it back (the derived fields are
recomputed, not trusted).
"""

from __future__ import annotations

import argparse
import difflib
import json
from typing import Any

from ..errors import ConfigError
from .options import _BY_NAME, DERIVED, OPTIONS, Config, Option, as_flag, flag
from .sections import SECTIONS, Section, loss_scaler

__all__ = ["DERIVED", "OPTIONS", "SECTIONS", "Config", "Option", "Section", "add_arguments", "as_config", "flag",
           "loss_scaler", "merge", "read_config", "read_settings", "read_toml", "resolve"]


#: ``hpctrain train --help``: the sections' flags under these headings, in this order.
HELP_SECTIONS = {
    "model": "model: what is trained",
    "data": "data: what it trains on (--data FILE.h5, or the built-in sets)",
    "parallel": "parallel layout: how the job is split over the ranks (dp is what tp x pp x cp leaves)",
    "optim": "optimizer and learning rate",
    "runtime": "length, device, progress and failures",
    "checkpoint": "run directory, checkpoints, resume",
    "precision": "precision (mixed 16-bit training)",
    "reduction": "gradient all-reduce",
}

#: The end of ``hpctrain train --help`` (tests/test_train_config.py parses each line).
EXAMPLES = """examples:
  mpiexec -n 2 hpctrain train                                    # MLP classifier on the built-in set, dp=2
  mpiexec -n 2 hpctrain train --dry-run                          # try everything once, say what a run would do
  mpiexec -n 4 hpctrain train --strategy hybrid --tp 2           # tensor parallel x data parallel
  mpiexec -n 4 hpctrain train --model gpt --pp 2 --epochs 1      # a GPT in 2 pipeline stages x 2 replicas
  mpiexec -n 4 hpctrain train --model gpt --cp 2 --block-size 256   # long sequences: half of each per rank, dp=2
  mpiexec -n 4 hpctrain train --model gpt --moe-experts 8 --ep 2 # MoE GPT: 8 experts, 4 per rank, dp=4
  mpiexec -n 2 hpctrain train --data mine.h5 --x-key inputs --y-key targets --loss mse   # your regression
  mpiexec -n 2 hpctrain train --model examples/custom_model.py:build                     # your model
  mpiexec -n 4 hpctrain train --model gpt --layout auto          # plan first (hpctrain plan), train the best
  mpiexec -n 2 hpctrain train --config recipes/gpt_shakespeare.toml --lr 1e-3            # a file; flags win
  mpiexec -n 2 hpctrain train --run-dir runs/a --resume          # continue runs/a as its config.json says
  mpiexec -n 2 hpctrain train --run-dir runs/a --resume --epochs 6   # ... to 6 epochs in all (kept)
more: docs/tutorials/first-run.md and docs/reference/training-controls.md"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``hpctrain train``: ``--config FILE`` plus one per option (unset unless given),
    grouped by the configuration's sections, then examples."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the examples keep their lines
    p.epilog = EXAMPLES
    p.usage = "%(prog)s [-h] [--config FILE] [--FLAG VALUE ...]   (flags by section below)"
    p.add_argument("--config", metavar="FILE",
                   help="TOML file with the same keys as the flags, or the config.json a run wrote "
                        "(--resume reads the run's config.json itself)")
    section_of = {name: s.name for s in ALL_SECTIONS for name in s.fields}
    groups = {name: p.add_argument_group(title) for name, title in HELP_SECTIONS.items()}
    for o in OPTIONS:
        g = groups[section_of[o.name]]
        default = "" if o.default is None else f" [{o.default}]"
        if o.type is bool:
            g.add_argument(flag(o.name), action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=o.help + default)
        else:
            g.add_argument(flag(o.name), type=o.type, choices=o.choices, default=argparse.SUPPRESS,
                           metavar=o.name.upper() if o.choices is None else None, help=o.help + default)


def read_config(path: str) -> dict[str, Any]:
    """The settings of a TOML file (top level or ``[train]``) or of a run's ``config.json``.

    Keys are checked against the options (a misspelt key is refused with the closest name);
    a JSON file may also hold the derived fields a run wrote, which are dropped, and so are the
    settings it lists as filled in by ``resolve`` (``unset``): they are derived again.
    """
    from ..files.h5safe import regular_file

    is_json = path.endswith(".json")
    try:
        regular_file(path, f"config file {path} cannot be read: it", ConfigError)  # a FIFO's open blocks
        if is_json:
            from ..files.rundir import MAX_RECORD, check_size

            check_size(path, MAX_RECORD, f"config file {path}")  # (a run's config.json is a few KiB)
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            if not isinstance(raw, dict):
                raise ConfigError(f"config file {path} must hold a JSON object, got {type(raw).__name__}")
            # What that run's resolve filled in (its layout, the optimizer's defaults) is derived
            # again for this job, as if not given: a run's settings, not its launch's.
            unset = raw.get("unset") if isinstance(raw.get("unset"), list) else []
            raw = {k: v for k, v in raw.items() if k not in DERIVED and k not in unset}
        else:
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            with open(path, "rb") as f:
                raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except ConfigError:  # regular_file's, said as it is (a ValueError too)
        raise
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"config file {path} is not valid {'JSON' if is_json else 'TOML'}: {exc}") from None
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    items = list(raw.items())
    if isinstance(raw.get("train"), dict):
        items = [(k, v) for k, v in items if k != "train"] + [(f"train.{k}", v) for k, v in raw["train"].items()]
    out: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for key, value in items:
        name = key.removeprefix("train.").replace("-", "_")
        if name not in _BY_NAME:
            close = difflib.get_close_matches(name, _BY_NAME, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}")
        if name in keys:  # 'batch-size' and 'batch_size', or a key at the top and in [train]: which one?
            raise ConfigError(f"{path}: {keys[name]!r} and {key!r} both set {name}: keep one")
        keys[name] = key
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


#: Settings of a run's config.json a resume does not take over: what this job itself asks.
NOT_INHERITED = ("resume", "restart")


#: How a job is split over its ranks: the job's, not the run's (a checkpoint holds full tensors and
#: loads under any layout). A resume keeps the run's where they still fit this job's world size and
#: flags; ``LAYOUT_SHAPE`` goes first, then the rest, derived again as for a fresh run.
LAYOUT_KEYS = ("strategy", "tp", "pp", "cp", "cp_mode", "ep", "microbatches", "schedule", "zero")
LAYOUT_SHAPE = ("strategy", "tp", "pp", "cp", "ep")


def read_settings(config_file: str | None, flags: dict[str, Any],
                  world: int | None = None) -> tuple[Config, dict[str, tuple[Any, Any]] | None]:
    """The job's settings: defaults < the run's ``config.json`` < ``--config FILE`` < the flags.

    The run's ``config.json`` counts only for ``--resume`` with a run directory that has one: a
    resume continues the run as it was last configured, and what this job changes (listed in the
    returned ``{name: (run's value, this job's value)}``; ``None`` when not resuming) is written
    back to ``config.json`` by the job, so the next resume keeps it. The layout is the job's
    (``LAYOUT_KEYS``): with ``world``, the run's is kept only where it fits ``world`` ranks and this
    job's layout flags, and the returned Config's ``layout_note`` says what this job does instead.
    A run directory with checkpoints but no ``config.json`` is refused (its settings are unknown)
    unless ``--config`` or flags give them.
    """
    import os

    file_values = read_config(config_file) if config_file else {}
    given = {**file_values, **{k: v for k, v in flags.items() if k in _BY_NAME}}
    saved = os.path.join(given["run_dir"], "config.json") if given.get("resume") and given.get("run_dir") else None
    if saved is None or not os.path.exists(saved):
        if saved is not None and config_file is None:
            _refuse_unknown_run(saved, given)
        return merge(file_values, flags), None
    run = read_config(saved)
    base = {k: v for k, v in run.items() if k not in NOT_INHERITED}
    ran = _run_record(saved)
    cfg, note = _fitting_layout(base, file_values, flags, given, world, ran) if world else \
        (merge({**base, **file_values}, flags), None)
    # What the run's resolve filled in is said as it was (--strategy 'hybrid' -> 'dp', not None -> 'dp').
    filled = {k: ran[k] for k in ran.get("unset") or () if k in _BY_NAME and k in ran}
    before, now = {**merge(base, {}).to_dict(), **filled}, cfg.to_dict()
    changed = {k: (before[k], now[k]) for k in given if k not in NOT_INHERITED and now[k] != before[k]}
    cfg.layout_note = note
    return cfg, changed


def _refuse_unknown_run(saved: str, given: dict[str, Any]) -> None:
    """``--resume`` into a run directory whose own checkpoints have no ``config.json`` beside them
    and no setting of the run given instead: the model they hold is unknown (the defaults would
    be built and the load refused), so say so. Flags naming the run's settings, or checkpoints of
    another directory (``--checkpoint-dir``), are a resume the user describes: not refused."""
    import os

    from ..checkpoint import list_checkpoints
    from .resume import RESUME_KEYS

    if given.get("checkpoint_dir") or any(k in given for k in RESUME_KEYS):
        return
    ckpt_dir = os.path.join(given["run_dir"], "checkpoints")
    if list_checkpoints(ckpt_dir):
        raise ConfigError(f"--resume: {saved} is missing, so the settings of the run whose checkpoints are in "
                          f"{ckpt_dir} (its model, data, optimizer) are unknown; put the run's config.json back, or "
                          "give its settings with --config FILE (a TOML file, or a copy of its config.json) or as "
                          "flags (--model, --d-model, ...)")


def _run_record(saved: str) -> dict[str, Any]:
    """The run's ``config.json`` as written: its settings resolved (the layout it last ran under,
    the derived ``dp``) and the list of those its resolve filled in (``unset``)."""
    try:
        with open(saved, encoding="utf-8") as f:
            raw = json.load(f)  # read_config has read it already: a JSON object
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _fitting_layout(base: dict[str, Any], file_values: dict[str, Any], flags: dict[str, Any],
                    given: dict[str, Any], world: int, run: dict[str, Any]) -> tuple[Config, str | None]:
    """The resumed job's Config: the run's settings under this job's, with the run's layout
    settings that this job does not give kept as long as the layout resolves on ``world`` ranks
    (the shape dropped first, then the rest); and what the header says of the layout, ``None``
    when it is the run's."""
    mine = [k for k in LAYOUT_KEYS if k in given]
    attempts = [(), tuple(k for k in LAYOUT_SHAPE if k not in mine), tuple(k for k in LAYOUT_KEYS if k not in mine)]
    for dropped in dict.fromkeys(attempts):  # (without repeats, in order)
        cfg = merge({**{k: v for k, v in base.items() if k not in dropped}, **file_values}, flags)
        try:
            c = resolve(cfg, world)
        except ConfigError:
            continue
        return cfg, _layout_note(c, run, world, dropped, mine)
    # Not even this job's own layout resolves: the refusal of the run's settings as this job gives them.
    return merge({**base, **file_values}, flags), None


def layout_text(dp: Any, tp: Any, pp: Any, zero: Any = 0, cp: Any = 1, cp_mode: Any = "ring", ep: Any = 1) -> str:
    """``dp=2 tp=2 pp=1`` (`` cp=2`` with context parallelism, `` cp=2 ulysses`` in that mode;
    `` ep=2`` where experts spread; ``, ZeRO-3``): a layout as the header, the closing line and a
    resumed job's note say it."""
    cp_text = "" if not cp or cp == 1 else f" cp={cp}" + (f" {cp_mode}" if cp_mode != "ring" else "")
    ep_text = "" if not ep or ep == 1 else f" ep={ep}"
    return f"dp={dp} tp={tp} pp={pp}{cp_text}{ep_text}" + (f", ZeRO-{zero}" if zero else "")


def _layout_note(c: Config, run: dict[str, Any], world: int, dropped: tuple[str, ...], mine: list[str]) -> str | None:
    """What the header adds to a resumed job's layout when it is not the run's: the run's, and why
    it changed (the run's layout not fitting ``world`` ranks, or this job's flags)."""
    now = {"dp": c.dp, "tp": c.tp, "pp": c.pp, "cp": c.cp, "cp_mode": c.cp_mode, "ep": c.ep, "zero": c.zero}
    old = {"cp": 1, "cp_mode": "ring", "ep": 1}  # a run from before context/expert parallelism had none
    if not run.get("dp") or all(run.get(k, old.get(k)) == v for k, v in now.items()):
        return None
    was = layout_text(run.get("dp"), run.get("tp"), run.get("pp"), run.get("zero") if run.get("zero") != c.zero else 0,
                      run.get("cp", 1), run.get("cp_mode", "ring"), run.get("ep", 1))
    if dropped and not mine:  # nothing asked: the run's layout could not be kept
        why = f"the run's {was} does not fit {world} rank{'s' if world > 1 else ''}"
    elif dropped:
        why = f"the run's {was} does not go with this job's " + " ".join(f"{flag(k)} {getattr(c, k)}" for k in mine)
    else:
        why = f"the run's layout was {was}"
    return f"{why}; resharded from the checkpoint"


def as_config(cfg: Config | dict[str, Any]) -> Config:
    """``cfg`` itself, or a dict of options (refused if it names no option) over the defaults."""
    if isinstance(cfg, Config):
        return cfg
    unknown = sorted(set(cfg) - set(_BY_NAME) - DERIVED)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}")
    return merge({}, {k: v for k, v in cfg.items() if k not in DERIVED})

def _runtime_values(c: Config) -> None:
    if c.logger == "tensorboard":
        from ..training.tensorboard import missing

        if missing() is not None:  # refused before training, not at the first step
            raise ConfigError(f"--logger tensorboard: {missing()}")
    if c.timeout is not None:
        from ..settings import resolve_timeout

        resolve_timeout(c.timeout)  # ConfigError for a negative or non-finite value


def _runtime(c: Config, world: int) -> None:
    """How long the job runs and reports, its timeouts, and what ends it (``--on-rank-loss``
    resolved: a local check, the same verdict on every rank)."""
    c.on_rank_loss = _on_rank_loss(c)


#: Every section in the order ``resolve`` runs them: each may read what the earlier ones settled.
ALL_SECTIONS: tuple[Section, ...] = (
    *SECTIONS,
    Section("runtime", ("epochs", "max_steps", "log_every", "logger", "eval_every", "timeout", "on_rank_loss",
                        "on_nonfinite", "device", "dry_run"), _runtime, _runtime_values),
)


def resolve(cfg: Config | dict[str, Any], world: int) -> Config:
    """Fill the derived settings (layout, per-rank batch, optimizer, lr) and refuse bad ones.

    Pure function of its arguments, so every rank reaches the same verdict without talking.
    Raises ConfigError naming the setting and what would work instead: each section of
    ``ALL_SECTIONS`` checks its own settings: first every value alone, then the rules between them.
    """
    c = as_config(cfg).replace()  # a copy: the caller's config stays as given
    empty = [o.name for o in OPTIONS if getattr(c, o.name) is None]
    for section in ALL_SECTIONS:
        section.check_values(c)
    for section in ALL_SECTIONS:
        section.rules(c, world)
    c.unset = [name for name in empty if getattr(c, name) is not None]
    if c.chosen:  # --layout auto's choices are filled in too: a resume plans them again, as a fresh job does
        c.unset += [k for k in c.chosen if k not in c.unset]
    return c


def _on_rank_loss(c: Config) -> str:
    """``--on-rank-loss`` resolved: ``shrink`` where the layout can continue without a lost rank
    (``resilience.shrink_problem``, the library's rule, in flags) and this launch detects lost
    ranks (ULFM), else ``abort``; an explicit ``shrink`` that cannot work is refused here, before
    anything starts (the same verdict on every rank: a local check)."""
    from ..comm import ulfm
    from ..resilience import shrink_problem  # (here: importing it starts MPI, which the tools must not)

    unsupported = shrink_problem(c.strategy, c.backend, c.precision, say=as_flag, cp=c.cp, zero=c.zero, ep=c.ep)
    if c.on_rank_loss is None:
        return "shrink" if unsupported is None and ulfm.available() else "abort"
    if c.on_rank_loss == "shrink":
        if unsupported is not None:
            raise ConfigError(unsupported)
        if not ulfm.available():
            raise ConfigError(f"--on-rank-loss shrink: this job cannot survive a lost rank: {ulfm.missing()}; "
                              "use --on-rank-loss abort")
    return c.on_rank_loss

