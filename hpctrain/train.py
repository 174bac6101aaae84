"""``hpctrain train``: the main job, top to bottom in one file.

    mpiexec -n 2 hpctrain train                                 # MLP classifier, data parallel
    mpiexec -n 4 hpctrain train --strategy hybrid --tp 2        # tp=2 x dp=2
    mpiexec -n 4 hpctrain train --model gpt --strategy pp --pp 2 --epochs 1
    hpctrain train --config run.toml --lr 1e-3                  # flags override the file

The job: read the configuration (defaults < TOML file < flags), refuse anything impossible on
every rank before any training, open the data (the built-in HDF5 sets unless ``--data``), build
the serial model with the same seed on every rank, hand it to the chosen strategy, ``fit`` with
checkpoints and metrics in the run directory, evaluate the trained weights on held-out data, and
print a summary. The run directory holds ``metrics.jsonl`` (one line per step), ``trace.json``
(per-rank timeline of the steps for https://ui.perfetto.dev), ``checkpoints/`` and
``summary.json``; ``hpctrain plot RUN`` draws the curves.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import nn
from .errors import CheckpointError, ConfigError, DatasetError, HpctrainError

# -- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One setting: a TOML key ``name`` and the flag ``--name`` (underscores as dashes)."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None


OPTIONS: tuple[Option, ...] = (
    Option("strategy", str, None, "how the job is split across ranks [dp; hybrid when --tp or --pp is given]",
           ("dp", "tp", "pp", "ps", "hybrid")),
    Option("tp", int, None, "tensor-parallel group size (tp: all ranks; hybrid: 1)"),
    Option("pp", int, None, "pipeline stages (pp: all ranks; hybrid: 1)"),
    Option("model", str, "mlp", "mlp: classifier on the built-in set; gpt: character-level GPT", ("mlp", "gpt")),
    Option("data", str, None, "HDF5 file (mlp: keys x, y; gpt: key tokens); default: the built-in set"),
    Option("epochs", int, 3, "passes over the training data"),
    Option("batch_size", int, 64, "global batch: samples per optimizer step over the whole job"),
    Option("lr", float, None, "learning rate (default: 3e-3 adam/adamw; sgd: 0.1, 0.3 without momentum)"),
    Option("optimizer", str, None, "default: adamw (sgd for --strategy ps)", ("sgd", "adam", "adamw")),
    Option("momentum", float, None, "SGD momentum (default: 0.9; 0 for ps async/ssp, which take none)"),
    Option("weight_decay", float, 0.0, "weight decay (decoupled for adamw)"),
    Option("seed", int, 0, "seed of the model's initial weights and of the data order"),
    Option("run_dir", str, None, "where metrics, trace, checkpoints go (default: runs/<date-time>)"),
    Option("checkpoint_dir", str, None, "default: RUN_DIR/checkpoints"),
    Option("checkpoint_every", int, None, "steps between checkpoints (default: once per epoch)"),
    Option("resume", bool, False, "continue from the newest checkpoint in the checkpoint directory"),
    Option("d_model", int, 64, "model width"),
    Option("n_layers", int, 2, "hidden blocks (mlp) or transformer blocks (gpt)"),
    Option("n_heads", int, 4, "attention heads (gpt)"),
    Option("block_size", int, 32, "context length in characters (gpt)"),
    Option("microbatches", int, 4, "micro-batches per step (pp)"),
    Option("schedule", str, "1f1b", "pipeline schedule (pp)", ("1f1b", "gpipe")),
    Option("ps_mode", str, "sync", "parameter-server mode (ps)", ("sync", "async", "ssp")),
    Option("staleness", int, 2, "bound on how far a worker may run ahead (ps, ssp)"),
    Option("max_samples", int, None, "train on only the first N samples (quick runs, tests)"),
    Option("val_fraction", float, 0.1, "share of the data held out for the final evaluation"),
    Option("log_every", int, 20, "steps between progress lines"),
)
_BY_NAME = {o.name: o for o in OPTIONS}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``hpctrain train``: ``--config FILE`` plus one per option (unset unless given)."""
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with the same keys as the flags")
    for o in OPTIONS:
        flag = "--" + o.name.replace("_", "-")
        default = "" if o.default is None else f" [{o.default}]"
        if o.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=o.help + default)
        else:
            p.add_argument(flag, type=o.type, choices=o.choices, default=argparse.SUPPRESS,
                           metavar=o.name.upper() if o.choices is None else None, help=o.help + default)


def read_toml(path: str) -> dict[str, Any]:
    """The settings of a TOML file, keys checked against the options (top level or ``[train]``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
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
        out[name] = _coerce(_BY_NAME[name], value, f"{path}: {key}")
    return out


def _coerce(o: Option, value: Any, where: str) -> Any:
    ok = (isinstance(value, bool) if o.type is bool
          else isinstance(value, (int, float)) and not isinstance(value, bool) if o.type is float
          else isinstance(value, o.type) and not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{where} must be {o.type.__name__}, got {value!r}")
    if o.choices and value not in o.choices:
        raise ConfigError(f"{where} must be one of {', '.join(o.choices)}, got {value!r}")
    return o.type(value)


def merge(file_values: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """Defaults, overridden by the file, overridden by the flags given on the command line."""
    cfg = {o.name: o.default for o in OPTIONS}
    cfg.update(file_values)
    cfg.update({k: v for k, v in flags.items() if k in _BY_NAME})
    return cfg


def resolve(cfg: dict[str, Any], world: int) -> dict[str, Any]:
    """Fill the derived settings (layout, per-rank batch, optimizer, lr) and refuse bad ones.

    Pure function of its arguments, so every rank reaches the same verdict without talking.
    Raises ConfigError naming the setting and what would work instead.
    """
    c = dict(cfg)
    if c["strategy"] is None:  # --tp T --pp P alone: dp is what is left of the world
        c["strategy"] = "hybrid" if (c["tp"] or 1) > 1 or (c["pp"] or 1) > 1 else "dp"
    strategy = c["strategy"]
    for key in ("epochs", "batch_size", "d_model", "n_layers", "n_heads", "block_size", "microbatches",
                "log_every"):
        if c[key] < 1:
            raise ConfigError(f"--{key.replace('_', '-')} must be >= 1, got {c[key]}")
    for key in ("tp", "pp", "checkpoint_every", "max_samples"):
        if c[key] is not None and c[key] < 1:
            raise ConfigError(f"--{key.replace('_', '-')} must be >= 1, got {c[key]}")
    if c["staleness"] < 0:
        raise ConfigError(f"--staleness must be >= 0, got {c['staleness']}")
    if not 0.0 < c["val_fraction"] < 1.0:
        raise ConfigError(f"--val-fraction must be between 0 and 1, got {c['val_fraction']}")

    # Layout: world = dp x tp x pp. Each strategy fixes the sizes it does not use to 1.
    given = {k: c[k] for k in ("tp", "pp") if c[k] is not None}
    if strategy in ("dp", "ps") and any(v > 1 for v in given.values()):
        flags = " ".join(f"--{k} {v}" for k, v in given.items())
        raise ConfigError(f"--strategy {strategy} does not use {flags}: use --strategy hybrid for tp x pp x dp")
    if strategy == "tp":
        if c["pp"] not in (None, 1):
            raise ConfigError("--strategy tp does not use --pp: use --strategy hybrid for tp x pp x dp")
        tp, pp = c["tp"] or world, 1
    elif strategy == "pp":
        if c["tp"] not in (None, 1):
            raise ConfigError("--strategy pp does not use --tp: use --strategy hybrid for tp x pp x dp")
        tp, pp = 1, c["pp"] or world
    elif strategy == "hybrid":
        tp, pp = c["tp"] or 1, c["pp"] or 1
    else:
        tp, pp = 1, 1
    if world % (tp * pp):
        raise ConfigError(f"{world} ranks do not factor into tp={tp} x pp={pp} x dp: "
                          f"the world size must be a multiple of {tp * pp}")
    dp = world // (tp * pp)
    c.update(tp=tp, pp=pp, dp=dp)

    # The global batch is split over the data-parallel replicas (the ps workers are all ranks).
    if c["batch_size"] % dp:
        raise ConfigError(f"--batch-size {c['batch_size']} does not split over dp={dp} replicas: "
                          f"use a multiple of {dp}")
    c["local_batch"] = c["batch_size"] // dp
    if pp > 1 and c["local_batch"] % c["microbatches"]:
        raise ConfigError(f"the per-replica batch {c['local_batch']} does not split into "
                          f"--microbatches {c['microbatches']}")

    # Model shapes the layout must divide.
    if c["model"] == "gpt" and c["d_model"] % c["n_heads"]:
        raise ConfigError(f"--n-heads {c['n_heads']} must divide --d-model {c['d_model']}")
    if tp > 1:
        if c["model"] == "gpt" and c["n_heads"] % tp:
            raise ConfigError(f"tp={tp} must divide --n-heads {c['n_heads']} (heads are split across ranks)")
        if (4 * c["d_model"]) % tp:
            raise ConfigError(f"tp={tp} must divide the hidden width 4 x d_model = {4 * c['d_model']}")
    if pp > 1 and pp > _n_stages_possible(c):
        raise ConfigError(f"pp={pp} stages but the {c['model']} model has only {_n_stages_possible(c)} layers "
                          f"to cut: use fewer stages or more --n-layers")

    # Optimizer: the parameter server applies plain SGD on its shards.
    if c["optimizer"] is None:
        c["optimizer"] = "sgd" if strategy == "ps" else "adamw"
    if strategy == "ps" and c["optimizer"] != "sgd":
        raise ConfigError(f"--strategy ps applies SGD on the servers: --optimizer {c['optimizer']} is not possible")
    if strategy == "ps" and c["weight_decay"]:
        raise ConfigError("--strategy ps applies plain SGD (with --momentum): --weight-decay is not possible")
    # Server-side momentum needs every worker's gradient of a step: only the sync mode has that.
    plain = strategy == "ps" and c["ps_mode"] != "sync"
    if plain and c["momentum"]:
        raise ConfigError(f"--ps-mode {c['ps_mode']} applies plain SGD: --momentum {c['momentum']} "
                          "needs --ps-mode sync")
    if c["momentum"] is None:
        c["momentum"] = 0.0 if plain else 0.9
    if c["momentum"] < 0:
        raise ConfigError(f"--momentum must be >= 0, got {c['momentum']}")
    if c["lr"] is None:
        # Plain SGD on this data wants a larger step than SGD with momentum 0.9.
        c["lr"] = 3e-3 if c["optimizer"] != "sgd" else 0.3 if c["momentum"] == 0 else 0.1
    if c["lr"] <= 0:
        raise ConfigError(f"--lr must be > 0, got {c['lr']}")
    if c["resume"] and c["run_dir"] is None and c["checkpoint_dir"] is None:
        raise ConfigError("--resume needs the --run-dir (or --checkpoint-dir) of the run to continue")
    return c


def _n_stages_possible(c: dict[str, Any]) -> int:
    """Layers a pipeline can be cut between (see build_model)."""
    return 3 + 2 * c["n_layers"] if c["model"] == "mlp" else c["n_layers"] + 3


# -- data ------------------------------------------------------------------------------------


class _Rows:
    """Rows ``[start, stop)`` of a dataset, itself a dataset (train/validation split)."""

    def __init__(self, dataset: Any, start: int, stop: int) -> None:
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, idx: Any) -> tuple[np.ndarray, ...]:
        return self.dataset[np.asarray(idx, dtype=np.int64) + self.start]


def open_data(c: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(train set, validation set, facts the model needs) from the HDF5 file of the run."""
    from .data import ArrayDataset, HDF5Dataset

    if c["model"] == "mlp":
        path = c["data"] or _builtin("classification")
        ds = HDF5Dataset(path, ("x", "y"))
        shapes = ds.shapes
        if len(shapes["x"]) != 2 or len(shapes["y"]) != 1:
            raise DatasetError(f"{path}: mlp needs x of shape (N, D) and y of shape (N,), got {shapes}")
        with HDF5Dataset(path, ("y",)) as labels:  # the class count: read the labels, not x
            y_all = labels[np.arange(len(labels))][0]
        if y_all.dtype.kind not in "iu" or y_all.min() < 0:
            raise DatasetError(f"{path}: y must hold class indices >= 0, got dtype {y_all.dtype}")
        meta = {"n_in": int(shapes["x"][1]), "n_classes": int(y_all.max()) + 1}
    else:
        path = c["data"] or _builtin("corpus")
        with HDF5Dataset(path, ("tokens",)) as tok:
            tokens = tok[np.arange(len(tok))][0].astype(np.int64)
            vocab = tok.attrs.get("vocab")
        n = (len(tokens) - 1) // c["block_size"]
        if n < 2:
            raise DatasetError(f"{path}: {len(tokens)} tokens make fewer than 2 windows of --block-size "
                               f"{c['block_size']}")
        # Non-overlapping windows; the target is the window shifted by one character.
        x = tokens[: n * c["block_size"]].reshape(n, c["block_size"])
        y = tokens[1 : n * c["block_size"] + 1].reshape(n, c["block_size"])
        ds = ArrayDataset(x, y)
        vocab_size = len(vocab) if isinstance(vocab, (str, bytes, list, np.ndarray)) else int(vocab or 0)
        meta = {"vocab_size": max(vocab_size, int(tokens.max()) + 1)}
    n_val = max(1, int(len(ds) * c["val_fraction"]))
    n_train = len(ds) - n_val
    if c["max_samples"] is not None:
        n_train = min(n_train, c["max_samples"])
    if n_train < c["batch_size"]:
        raise DatasetError(f"{path}: {n_train} training samples are fewer than one --batch-size {c['batch_size']}")
    meta["path"] = path
    return _Rows(ds, 0, n_train), _Rows(ds, len(ds) - n_val, len(ds)), meta


def _builtin(name: str) -> str:
    from .data import builtin

    return str(getattr(builtin, name)())


# -- model and strategy ----------------------------------------------------------------------


def build_model(c: dict[str, Any], meta: dict[str, Any]) -> Any:
    """The serial model, identical on every rank (same seed): strategies shard it from here."""
    rng = np.random.default_rng(c["seed"])
    d = c["d_model"]
    if c["model"] == "gpt":
        # Pipelined as it is (parallelize cuts a GPT between its pieces): one set of names everywhere.
        return nn.GPT(meta["vocab_size"], c["block_size"], d, c["n_heads"], c["n_layers"], rng=rng)
    # A flat Sequential so a pipeline can cut it anywhere; MLP blocks so tensor parallelism
    # has something to shard (fc1 column-wise, fc2 row-wise).
    layers: list[Any] = [nn.Linear(meta["n_in"], d, rng=rng), nn.GELU()]
    for _ in range(c["n_layers"]):
        layers += [nn.MLP(d, 4 * d, rng=rng), nn.GELU()]
    layers.append(nn.Linear(d, meta["n_classes"], rng=rng))
    return nn.Sequential(*layers)


def _optimizer(c: dict[str, Any], params: list[Any]) -> Any:
    from . import optim

    if c["optimizer"] == "sgd":
        return optim.SGD(params, lr=c["lr"], momentum=c["momentum"], weight_decay=c["weight_decay"])
    cls = optim.AdamW if c["optimizer"] == "adamw" else optim.Adam
    return cls(params, lr=c["lr"], weight_decay=c["weight_decay"])


def build_trainer(c: dict[str, Any], model: Any, comm: Any) -> Any:
    """The trainer of ``c['strategy']`` around ``model`` (collective: trainers agree on configs)."""
    from . import parallel
    from .comm import ProcessGrid

    loss = nn.CrossEntropyLoss()
    if c["strategy"] == "dp":
        return parallel.DataParallelTrainer(model=model, loss=loss, optimizer=_optimizer(c, model.parameters()),
                                            comm=comm)
    if c["strategy"] == "ps":
        return parallel.ParameterServerTrainer(model=model, loss=loss, lr=c["lr"], comm=comm, mode=c["ps_mode"],
                                               staleness=c["staleness"], momentum=c["momentum"])
    grid = ProcessGrid(comm, tp=c["tp"], pp=c["pp"])
    part = parallel.parallelize(model, grid)  # this rank's pipeline stage, split over tp
    opt = _optimizer(c, part.parameters())
    if c["pp"] > 1 and c["tp"] > 1:
        return parallel.ParallelTrainer(model=part, loss=loss, optimizer=opt, grid=grid,
                                        microbatches=c["microbatches"], schedule=c["schedule"])
    if c["pp"] > 1:
        return parallel.PipelineParallelTrainer(stage=part, loss=loss, optimizer=opt, grid=grid,
                                                microbatches=c["microbatches"], schedule=c["schedule"])
    return parallel.TensorParallelTrainer(model=part, loss=loss, optimizer=opt, grid=grid)


def data_rank(c: dict[str, Any], comm: Any) -> tuple[int, int]:
    """(rank, size) the sampler shards by: the dp coordinate; tp and pp groups share batches."""
    if c["strategy"] == "ps":
        return comm.rank, comm.size
    return (comm.rank // c["tp"]) % c["dp"], c["dp"]


# -- evaluation ------------------------------------------------------------------------------


def load_weights(model: Any, path: str) -> Any:
    """Read a checkpoint's full tensors (``model/<dotted name>``) into a serial ``model``."""
    import h5py

    with h5py.File(path, "r") as f:
        for name, p in model.named_parameters():
            p.data[...] = f["model"][name][()]
    return model


def evaluate(model: Any, data: Any, batch: int = 256) -> dict[str, float]:
    """Loss and accuracy of ``model`` on all of ``data`` (one process)."""
    model.eval()
    loss = nn.CrossEntropyLoss()
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(data), batch):
        x, y = data[np.arange(start, min(start + batch, len(data)))]
        logits = model.forward(x)
        total_loss += loss.forward(logits, y) * y.size
        correct += int((logits.argmax(axis=-1) == y).sum())
        count += y.size
    return {"loss": total_loss / count, "accuracy": correct / count, "samples": len(data)}


# -- timeline --------------------------------------------------------------------------------


class Timeline:
    """Wall-clock span of every step on this rank, written as one Chrome trace for all ranks.

    It wraps ``trainer.step`` (the loop in ``fit`` calls it) rather than asking every strategy
    to record spans. The communication span is drawn at the end of the step (its total, not
    its true position: strategies report only the sum). A pipeline additionally writes its
    last step's schedule (``timeline.json``, forward/backward per micro-batch).
    """

    def __init__(self, trainer: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self.rank = trainer.comm.rank
        step = trainer.step

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.time()
            stats = step(*args, **kwargs)
            t1 = time.time()
            self._add(f"step {trainer.global_step}", t0, t1 - t0, {"loss": stats.loss})
            if stats.comm_seconds:
                self._add("communication", t1 - stats.comm_seconds, stats.comm_seconds, {}, tid=1)
            return stats

        trainer.step = timed

    def _add(self, name: str, start: float, dur: float, args: dict, tid: int = 0) -> None:
        self.events.append({"name": name, "ph": "X", "ts": start * 1e6, "dur": dur * 1e6, "pid": self.rank,
                            "tid": tid, "args": args})

    def write(self, comm: Any, path: str) -> None:
        """Collective: rank 0 writes every rank's events (one process lane per rank)."""
        lanes = comm.gather_obj(self.events)
        if comm.rank != 0:
            return
        events = []
        for rank, evs in enumerate(lanes):
            events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
            events += evs
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


# -- the job ---------------------------------------------------------------------------------


def _all_or_none(comm: Any, fn: Any) -> Any:
    """Run ``fn()`` on every rank; if it fails on any rank, raise that error on every rank.

    Setting up (reading files, checking shapes) has no collectives, so one rank failing alone
    would leave the others waiting in the first collective of training.
    """
    try:
        result, error = fn(), None
    except (HpctrainError, ValueError, OSError, KeyError) as exc:
        result, error = None, f"{exc}"
    errors = comm.allgather_obj(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, msg = failed[0]
        where = "" if len(failed) == comm.size else f" (on rank {rank})"
        raise ConfigError(f"{msg}{where}")
    return result


def limit_blas_threads(comm: Any) -> int | None:
    """Size each rank's BLAS thread pool to its share of the node's cores; return the size.

    NumPy's OpenBLAS starts one thread per core in every process, so N ranks on a node run N
    times too many threads and the small matrix products of a step slow down many-fold. Left
    alone when the user set OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or MKL_NUM_THREADS.
    """
    if any(v in os.environ for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")):
        return None
    hosts = comm.allgather_obj(comm.hostname())
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # Bound to fewer cores than the node has (srun --cpu-bind, taskset): those cores are ours.
    n = mine if mine < (os.cpu_count() or mine) else max(1, mine // hosts.count(hosts[comm.rank]))
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=n, user_api="blas")
    return n


def run(cfg: dict[str, Any], comm: Any = None) -> dict[str, Any]:
    """Train as ``cfg`` (merged options) says; return the summary (the same on every rank)."""
    from . import checkpoint
    from .comm import Communicator
    from .comm.validate import agree

    comm = comm if comm is not None else Communicator()
    c = _all_or_none(comm, lambda: resolve(cfg, comm.size))
    agree(comm, "hpctrain train configuration", c)
    limit_blas_threads(comm)
    if c["run_dir"] is None:
        c["run_dir"] = comm.bcast_obj(os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))
    c["checkpoint_dir"] = c["checkpoint_dir"] or os.path.join(c["run_dir"], "checkpoints")

    if c["data"] is None:
        # Rank 0 writes the built-in set first; the others then find it (or, on node-local
        # disks, write their own identical copy) instead of all writing at once.
        name = "classification" if c["model"] == "mlp" else "corpus"
        _all_or_none(comm, lambda: _builtin(name) if comm.rank == 0 else None)

    def prepare() -> tuple:
        if not c["resume"] and checkpoint.list_checkpoints(c["checkpoint_dir"]):
            raise ConfigError(f"{c['checkpoint_dir']} already holds checkpoints: pass --resume to continue "
                              f"that run, or choose another --run-dir")
        train, val, meta = open_data(c)
        return train, val, meta, build_model(c, meta)

    train_set, val_set, meta, model = _all_or_none(comm, prepare)
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    try:
        trainer = build_trainer(c, model, comm)
    except (ValueError, TypeError) as exc:  # trainers check their arguments alike on every rank
        raise ConfigError(f"the {c['strategy']} trainer refuses this setup: {exc}") from exc

    from .data import DataLoader, ShardedSampler

    rank, size = data_rank(c, comm)
    sampler = ShardedSampler(len(train_set), rank, size, shuffle=True, seed=c["seed"], pad="mask")
    loader = DataLoader(train_set, batch_size=c["local_batch"], sampler=sampler)
    every = c["checkpoint_every"] or len(loader)
    if comm.rank == 0:
        os.makedirs(c["run_dir"], exist_ok=True)
        with open(os.path.join(c["run_dir"], "config.json"), "w") as f:
            json.dump({k: v for k, v in c.items()}, f, indent=1)
        print(f"hpctrain train: {c['model']} ({n_params:,} parameters) on {meta['path']}: "
              f"{len(train_set):,} training samples, {_layout_text(c)}, "
              f"global batch {c['batch_size']}, {c['optimizer']} lr={c['lr']:g}, {c['epochs']} epoch(s), "
              f"{len(loader)} steps each; run dir {c['run_dir']}", flush=True)

    timeline = Timeline(trainer)
    metrics = os.path.join(c["run_dir"], "metrics.jsonl")
    t0 = time.perf_counter()
    history = trainer.fit(loader, epochs=c["epochs"], checkpoint_dir=c["checkpoint_dir"], checkpoint_every=every,
                          resume=c["resume"], log_every=c["log_every"], metrics_file=metrics)
    wall = time.perf_counter() - t0
    memory = trainer.memory_summary()  # bytes on the rank that holds most (collective)
    trace = os.path.join(c["run_dir"], "trace.json")
    timeline.write(comm, trace)
    if hasattr(trainer, "save_timeline"):  # the pipeline's executed schedule of its last step
        trainer.save_timeline(c["run_dir"], png=False)
    if hasattr(trainer, "close"):  # the parameter server: final pull, windows freed on every rank
        trainer.close()

    # Evaluate what the run leaves behind: rank 0 loads the final checkpoint (full tensors,
    # whatever the layout) into a fresh serial model. The strategies' own models may be
    # sharded or rebuilt in place into parallel layers that need the other ranks.
    latest = comm.bcast_obj(checkpoint.list_checkpoints(c["checkpoint_dir"]) if comm.rank == 0 else None)
    result = error = None
    if comm.rank == 0:
        try:
            result = evaluate(load_weights(build_model(c, meta), latest[-1]), val_set)
        except (OSError, KeyError, ValueError) as exc:  # shared below: no rank waits for a dead one
            error = f"cannot evaluate the final checkpoint {latest[-1]}: {exc}"
    result, error = comm.bcast_obj((result, error))
    if error:
        raise CheckpointError(error)

    seconds = sum(s.seconds for s in history)
    tail = history[-len(loader):] if history else []
    summary = {
        "model": c["model"], "parameters": n_params, "strategy": c["strategy"],
        "layout": {"dp": c["dp"], "tp": c["tp"], "pp": c["pp"]}, "steps": trainer.global_step,
        "steps_this_run": len(history), "epochs": c["epochs"],
        "final_loss": (sum(s.loss for s in tail) / len(tail)) if tail else None,
        "val_loss": result["loss"], "val_accuracy": result["accuracy"], "val_samples": result["samples"],
        "samples_per_s": sum(s.samples for s in history) / seconds if seconds > 0 else None,
        "comm_share": sum(s.comm_seconds for s in history) / seconds if seconds > 0 else None,
        "wall_seconds": wall, "checkpoint": latest[-1] if latest else None,
        "run_dir": c["run_dir"], "metrics": metrics, "trace": trace, "memory": memory,
    }
    if comm.rank == 0:
        with open(os.path.join(c["run_dir"], "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(format_summary(summary), flush=True)
    return summary


def _layout_text(c: dict[str, Any]) -> str:
    if c["strategy"] == "ps":
        return f"parameter server ({c['ps_mode']}) with {c['dp']} workers"
    return f"{c['strategy']} with dp={c['dp']} tp={c['tp']} pp={c['pp']}"


def format_summary(s: dict[str, Any]) -> str:
    """The closing report of a run, a few aligned lines."""
    lay = s["layout"]
    final = "-" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
    rate = "-" if s["samples_per_s"] is None else f"{s['samples_per_s']:,.0f} samples/s"
    share = "-" if s["comm_share"] is None else f"{100 * s['comm_share']:.0f}% of step time"
    lines = [
        f"done: {s['steps_this_run']} steps ({s['steps']} in total) in {s['wall_seconds']:.1f} s, "
        f"{s['strategy']} dp={lay['dp']} tp={lay['tp']} pp={lay['pp']}",
        f"  final loss      {final} (training, mean of the last epoch)",
        f"  validation      loss {s['val_loss']:.4f}, accuracy {100 * s['val_accuracy']:.1f}% "
        f"({s['val_samples']:,} held-out samples)",
        f"  throughput      {rate}",
        f"  communication   {share}",
        *([f"  memory          {s['memory']['total'] / 2**20:,.1f} MiB per rank at most (params "
           f"{s['memory']['params'] / 2**20:,.1f}, grads {s['memory']['grads'] / 2**20:,.1f}, optimizer "
           f"{s['memory']['optimizer'] / 2**20:,.1f}, activations {s['memory']['activations_peak'] / 2**20:,.1f}; "
           f"peak RSS {s['memory']['rss_peak'] / 2**20:,.0f})"] if s.get("memory") else []),
        f"  checkpoint      {s['checkpoint'] or '-'}",
        f"  metrics         {s['metrics']}  (hpctrain plot {s['run_dir']})",
        f"  trace           {s['trace']}  (open in https://ui.perfetto.dev)",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Entry of ``hpctrain train``: merge file and flags, then run; errors end with exit code 2."""
    from .comm import Communicator

    flags = {k: v for k, v in vars(args).items() if k in _BY_NAME}
    try:
        comm = Communicator()
        # Read on every rank, verdict shared: a file missing on one node fails the whole job.
        cfg = _all_or_none(comm, lambda: merge(read_toml(args.config) if args.config else {}, flags))
        run(cfg, comm)
    except HpctrainError as exc:
        print(f"hpctrain train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
