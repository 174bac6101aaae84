"""The run of ``hpctrain train``: configuration in, a trained checkpoint and a summary out.

Steps: resolve the configuration (refused on every rank before any training), open the data,
build the serial model with the same seed on every rank, hand it to the strategy's trainer, ``fit``
with a timeline callback, checkpoints and metrics in the run directory, evaluate the final
checkpoint on held-out data, and write ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..errors import CheckpointError, ConfigError, HpctrainError, Preempted, ReplicaLeft
from ..files import rundir
from ..log import get_logger
from ..protocols import Comm, Fittable
from ..training.evaluation import evaluate
from . import ending
from . import summary as _report
from .builders import build_loss, build_model, build_trainer, data_rank
from .callbacks import LearningRate, Validation
from .config import _BY_NAME, Config, as_config, layout_text, read_settings, resolve
from .inputs import data_path, on_builtin, open_data
from .resume import AfterResume, check_claim, claim, describe_changes, resume_command
from .sections import nccl_problem
from .summary import finite_or_none, format_summary
from .trace import Timeline

T = TypeVar("T")
_log = get_logger("train")


def everywhere(comm: Comm, fn: Callable[[], T], what: str = "") -> T:
    """Run ``fn()`` on every rank; if it fails on any rank, raise a ``ConfigError`` on every rank.

    Setting up (reading files, checking shapes) has no collectives, so one rank failing alone
    would leave the others waiting in the first collective of training.
    """
    from ..comm.failure import first_traceback, user_traceback
    from ..comm.validate import raise_if_any

    result: Any = None
    problem: BaseException | None = None
    trace: str | None = None
    try:
        result = fn()
    except HpctrainError as exc:
        problem = exc
    except (ValueError, OSError, KeyError) as exc:  # said as a configuration problem: exit status 2
        # Raised in user code (a model factory): named with its type, its traceback shown once.
        trace = user_traceback(exc)
        problem = ConfigError(f"{type(exc).__name__}: {exc}" if trace else str(exc))
    try:
        raise_if_any(comm, problem, what=what)
    except HpctrainError:
        first_traceback(comm, trace)
        raise
    return result


def limit_blas_threads(comm: Comm) -> int | None:
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


def pick_device(c: Config, comm: Comm) -> str:
    """``"cuda"`` or ``"cpu"`` for ``--device`` (collective: the same answer on every rank).

    ``cuda`` makes the GPU of this rank's local rank current; it is refused on every rank, naming
    the ranks that see no GPU, when any rank has none. ``auto`` is cuda only when every rank has one.
    """
    from .. import backend

    has_gpu = backend.gpu_available()
    if c.device == "auto":
        seen = comm.allgather_obj((has_gpu, backend.gpus_allocated(), None if has_gpu else backend.gpu_missing()))
        if not all(gpu for gpu, _, _ in seen):
            problem = nccl_problem(c, gpus_everywhere=False)
            if problem is not None:
                raise ConfigError(problem)
            if comm.rank == 0 and unused_gpus(seen):
                _log.warning("%s", unused_gpus(seen))
            return "cpu"
    elif c.device == "cpu":
        return "cpu"
    problem = None if has_gpu else ConfigError(
        "--device cuda: no usable GPU here (CuPy is not installed or sees no NVIDIA GPU); "
        "run on a GPU node, or use --device cpu")
    def check() -> None:
        if problem is not None:
            raise problem

    everywhere(comm, check)  # every rank raises, naming the ranks without a GPU
    backend.select_device(comm.local_rank)
    return "cuda"


def unused_gpus(seen: Sequence[tuple[bool, str | None, str | None]]) -> str | None:
    """The warning for a job whose Slurm allocation has GPUs that its ranks cannot use (``seen``:
    by rank, whether it has a GPU, the Slurm variable that gave it some, why it has none); ``None``
    when no rank without a GPU was given one."""
    from ..comm.failure import rank_ranges

    blind = [r for r, (gpu, given, _) in enumerate(seen) if given and not gpu]
    if not blind:
        return None
    given, why = seen[blind[0]][1], seen[blind[0]][2]
    return (f"WARNING: GPUs allocated but not used: the Slurm allocation gives this job GPUs ({given} on rank "
            f"{blind[0]}), but rank(s) {rank_ranges(blind)} see none ({why}): TRAINING ON THE CPU, many times "
            "slower. Check the node "
            "with `make gpu-check` (or `hpctrain info`); --device cuda refuses instead of falling back")


def run(cfg: Config | dict[str, Any], comm: Comm | None = None, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train as ``cfg`` says (a Config, or a dict of options over the defaults).

    Collective. ``callbacks`` are extra ``fit`` callbacks (called before the job's own).
    Returns the summary, the same on every rank.
    """
    from ..comm import Communicator, ulfm
    from ..comm.validate import agree
    from ..log import world_rank

    comm = comm if comm is not None else Communicator()
    if as_config(cfg).layout == "auto":  # planned on rank 0's measured costs, shared: one choice on every rank
        from .planning import choose_layout

        limit_blas_threads(comm)  # before the plan's timings, as before training's
        write_builtin(as_config(cfg), comm)  # the plan's timed steps read it on every node
        cfg = choose_layout(as_config(cfg), comm, pick_device, everywhere)
    c = everywhere(comm, lambda: resolve(cfg, comm.size))
    agree(comm, "hpctrain train configuration", c.to_dict())
    device = pick_device(c, comm)
    limit_blas_threads(comm)
    if c.dry_run:  # one of everything, nothing written to the run directory
        from .dryrun import dry_run

        # What the run itself would refuse in its directory, refused here too (nothing touched).
        ckpts = c.checkpoint_dir or (os.path.join(c.run_dir, "checkpoints") if c.run_dir else None)
        everywhere(comm, lambda: check_claim(c.replace(checkpoint_dir=ckpts), c.to_dict()) if comm.rank == 0 else None)
        setup = _build(c, comm, device)
        if comm.rank == 0:
            _announce(c, setup, device)
        return dry_run(c, comm, setup, everywhere)
    if c.run_dir is None:  # a new directory nobody else can get, even starting in the same second
        c.run_dir = comm.bcast_obj(everywhere(comm, lambda: rundir.new_run_dir("runs") if comm.rank == 0 else None))
    # config.json keeps the setting as given, so a run started from it with another --run-dir
    # writes its checkpoints there, not into this run's.
    given = c.to_dict()
    c.checkpoint_dir = c.checkpoint_dir or os.path.join(c.run_dir, "checkpoints")
    # One job per run directory and per checkpoint directory (wherever it is: two jobs writing one
    # would overwrite each other's files): rank 0 holds the locks until the job ends (or is refused).
    locks = [rundir.RunLock(c.run_dir)]
    if os.path.realpath(c.checkpoint_dir) != os.path.realpath(c.run_dir):
        locks.append(rundir.RunLock(c.checkpoint_dir, "checkpoint directory", "--checkpoint-dir"))
    everywhere(comm, lambda: _acquire(locks) if comm.rank == 0 else None)
    try:
        with ending.recorded(c.run_dir, lambda: world_rank() == ulfm.leader()):
            return _run_locked(c, given, comm, callbacks, device, locks[1] if len(locks) > 1 else None)
    except ReplicaLeft:  # rank 0's replica left (--on-rank-loss shrink): the job goes on in this directory
        locks = []
        raise
    except Preempted as stop:  # the command says how to continue: in this run directory
        stop.run_dir = c.run_dir
        raise
    finally:
        if comm.rank == 0:
            for lock in reversed(locks):
                lock.release()


def _acquire(locks: list[rundir.RunLock]) -> None:
    """Take every lock in order, or none: those taken are released when a later one is refused."""
    taken: list[rundir.RunLock] = []
    try:
        for lock in locks:
            taken.append(lock.acquire())
    except BaseException:
        for lock in reversed(taken):
            lock.release()
        raise


@dataclass
class _Setup:
    """What the build phase hands to the others: the data, the model's size, the trainer."""

    train_set: Any
    val_set: Any
    meta: dict[str, Any]
    n_params: int
    loader: Any
    trainer: Fittable


def write_builtin(c: Config, comm: Comm) -> None:
    """Write the built-in data set before any rank opens it, by one rank of each node at most:
    rank 0 first, then the first rank of every other node, which finds rank 0's file where the
    cache is shared and writes its node's copy where it is node-local (``$HPCTRAIN_DATA`` on
    scratch) while its node's other ranks wait. Collective; a failure is raised on every rank.
    Nothing to write for ``--data FILE``."""
    from ..comm.nodes import local_ranks, node_names

    if not on_builtin(c):
        return

    first_of_node = local_ranks(node_names(comm))[comm.rank] == 0
    everywhere(comm, lambda: data_path(c) if comm.rank == 0 else None)
    everywhere(comm, lambda: data_path(c) if first_of_node and comm.rank != 0 else None)


def _run_locked(c: Config, given: dict[str, Any], comm: Comm, callbacks: Sequence[Any], device: str,
                ckpt_lock: rundir.RunLock | None) -> dict[str, Any]:
    """The job once its directories are locked: claim them, build, train (resuming inside
    ``fit``), evaluate the final checkpoint, write the summary."""
    metrics = os.path.join(c.run_dir, "metrics.jsonl")
    everywhere(comm, lambda: claim(c, given, metrics, ckpt_lock) if comm.rank == 0 else None)
    setup = _build(c, comm, device)
    if comm.rank == 0:
        _announce(c, setup, device)
    timeline = Timeline(comm.rank)
    hooks = _hooks(c, given, comm, setup, callbacks, metrics, timeline)
    trace = os.path.join(c.run_dir, "trace.json")
    history, wall = _fit(c, comm, setup, hooks, metrics, timeline, trace)

    def closing() -> dict[str, Any]:
        return _close(c, setup, device, history, wall, metrics, timeline, trace)

    loss = setup.trainer.rank_loss  # a rank lost now: the survivors finish the job (--on-rank-loss shrink)
    return loss.closing(setup.trainer, closing) if loss is not None else closing()


def _close(c: Config, setup: _Setup, device: str, history: Sequence[Any], wall: float, metrics: str,
           timeline: Timeline, trace: str) -> dict[str, Any]:
    """After ``fit`` (collective over the trainer's ranks: the survivors, when ranks were lost):
    the memory figures, the trace, the final evaluation, the summary (written by rank 0)."""
    comm = setup.trainer.comm
    memory = setup.trainer.memory_summary()  # bytes on the rank that holds most (collective)
    _finish_training(c, setup.trainer, comm, timeline, trace)
    result = _evaluate_final(c, comm, setup)
    summary = _report.build(c, setup.trainer, setup.n_params, device, history, result, wall, memory, metrics, trace,
                            comm)
    if comm.rank == 0:
        # Valid JSON: null for a non-finite value (a NaN validation loss), never a bare NaN.
        rundir.write_exclusive(os.path.join(c.run_dir, "summary.json"),
                               json.dumps(finite_or_none(summary), indent=1, allow_nan=False))
        print(format_summary(summary), flush=True)
    return summary


def _build(c: Config, comm: Comm, device: str) -> _Setup:
    """Open the data (checked on every rank, one verdict), build the serial model with the same
    seed everywhere, and the strategy's trainer around it (collective)."""
    write_builtin(c, comm)

    # Collective from here: every rank checks its share of the data and all get one verdict.
    train_set, val_set, meta = open_data(c, comm, everywhere(comm, lambda: data_path(c)))
    model = everywhere(comm, lambda: build_model(c, meta))
    c.info = meta
    if device == "cuda":
        model.to("gpu")  # parameters and gradients in CuPy; the optimizer state follows them
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters())

    from ..data import DataLoader, ShardedSampler
    from ..training.trainer import planned_steps

    rank, size = data_rank(c, comm)
    sampler = ShardedSampler(len(train_set), rank, size, shuffle=True, seed=c.seed, pad="mask")
    loader = DataLoader(train_set, batch_size=c.local_batch, sampler=sampler,
                        device="gpu" if device == "cuda" else "cpu")
    total_steps = planned_steps(loader, c.epochs, c.max_steps)
    # A pipeline's pieces are timed on one micro-batch of the training rows (the cut's balance).
    sample = None
    if c.pp > 1:
        from ..backend import to_device

        sample = to_device(train_set[np.arange(c.local_batch // (c.microbatches * c.accum_steps))][0], loader.xp)
    try:
        trainer = build_trainer(c, model, comm, total_steps, sample)
    except ConfigError:
        raise  # already in the command's words (--pp-cut)
    except (ValueError, TypeError) as exc:  # trainers check their arguments alike on every rank
        raise ConfigError(f"the {c.strategy} trainer refuses this setup: {exc}") from exc
    return _Setup(train_set, val_set, meta, n_params, loader, trainer)


def _announce(c: Config, setup: _Setup, device: str) -> None:
    """Rank 0's opening line: the model, the data, the layout, the optimizer, the run directory."""
    from ..data.shakespeare import fallback_source

    on = setup.meta["path"]
    if fallback_source(on) is not None:  # a shakespeare.h5 made without network
        on += " (fallback corpus: the shipped act of Coriolanus; `hpctrain data make` with network replaces it)"
    print(f"hpctrain train: {c.model} ({setup.n_params:,} parameters) on {on}: "
          f"{len(setup.train_set):,} training samples, {_layout_text(c)} on {device}, "
          f"global batch {c.batch_size}, {c.optimizer} lr={c.lr:g}, {c.epochs} epoch(s), "
          f"{len(setup.loader)} steps each; run dir {c.run_dir or 'runs/<date>-<time>'}", flush=True)
    if c.planned:
        print(f"layout: {c.planned}", flush=True)
    plan = (getattr(setup.trainer.model, "pipeline", None) or {}).get("plan")
    if plan:
        print(f"stages: {plan}", flush=True)
    if c.moe_experts:
        print(f"moe: {moe_text(c)}", flush=True)
    shape = setup.meta.get("x_shape") or []
    if c.model == "mlp" and len(shape) > 1:  # build_classifier's leading Flatten, said once
        print(f"mlp: each input of shape {tuple(shape)} is flattened to {setup.meta['n_in']:,} features (its first "
              "layer is nn.Flatten); --model cnn or a model of yours takes the images as they are", flush=True)


def _hooks(c: Config, given: dict[str, Any], comm: Comm, setup: _Setup, callbacks: Sequence[Any], metrics: str,
           timeline: Timeline) -> list[Any]:
    """The ``fit`` callbacks of the job, in order: the resume bookkeeping first, the user's, the
    validation loss, the learning rate, the timeline, and the rank-loss recovery last."""
    hooks: list[Any] = [
        AfterResume(comm.rank, os.path.join(c.run_dir, "config.json"),
                    {**given, "dp": c.dp, "local_batch": c.local_batch, "info": setup.meta}, metrics, comm.size),
        *callbacks, LearningRate(), timeline,
    ]
    if c.eval_every:
        hooks.insert(1 + len(callbacks), Validation(c, setup.meta, setup.val_set, comm, c.eval_every))
    if c.logger == "tensorboard":  # after the callbacks that add the lr and the validation loss
        from ..training.tensorboard import TensorBoardLogger, logdir_problem

        logdir = os.path.join(c.run_dir, "tensorboard")
        # Refused on every rank before training (exit 4), not on rank 0 alone at its first step.
        def check() -> None:
            problem = logdir_problem(logdir) if comm.rank == 0 else None  # (rank 0 writes them)
            if problem is not None:
                raise ConfigError(f"--logger tensorboard: {problem}")

        everywhere(comm, check)
        hooks.append(TensorBoardLogger(logdir))
    if c.on_rank_loss == "shrink" and comm.size > 1:
        from ..resilience import RankLoss

        setup.trainer.rank_loss = RankLoss(setup.loader, c.checkpoint_dir)
        hooks.append(setup.trainer.rank_loss)  # times and marks the first step after a loss
    return hooks


def _fit(c: Config, comm: Comm, setup: _Setup, hooks: list[Any], metrics: str, timeline: Timeline,
         trace: str) -> tuple[Any, float]:
    """Train (``fit`` resumes from the checkpoint directory with ``--resume``); the history of
    this job's steps and its wall time. A preempted job still writes its part of the trace."""
    trainer, loader = setup.trainer, setup.loader
    t0 = time.perf_counter()
    try:
        history = trainer.fit(loader, epochs=c.epochs, checkpoint_dir=c.checkpoint_dir,
                              checkpoint_every=c.checkpoint_every or len(loader), keep=c.keep, resume=c.resume,
                              log_every=c.log_every, metrics_file=metrics, callbacks=hooks, max_steps=c.max_steps,
                              async_checkpoint=c.async_checkpoint)
    except Preempted:  # every rank stopped at the same step: the trace keeps this job's part too
        timeline.write(trainer.comm, trace)  # (after lost ranks: the survivors')
        raise
    return history, time.perf_counter() - t0


def _finish_training(c: Config, trainer: Fittable, comm: Comm, timeline: Timeline, trace: str) -> None:
    """After ``fit`` (collective): the trace, the pipeline's executed schedule (not after lost
    ranks: the pipeline's groups hold the dead), the trainer closed."""
    from ..comm import ulfm

    timeline.write(comm, trace)
    lost = bool(ulfm.lost_ranks())
    if getattr(trainer, "runs_schedule", False) and not lost:  # optional: a pipeline's executed schedule
        trainer.save_timeline(c.run_dir, png=False)
    try:
        trainer.close()  # hooks removed; the parameter server: final pull, windows freed on every rank
    except ulfm.Error:
        if not lost:
            raise  # (after lost ranks: sub-communicators that hold the dead cannot be freed; nothing to do)


def _evaluate_final(c: Config, comm: Comm, setup: _Setup) -> dict[str, Any]:
    """Evaluate what the run leaves behind: every rank loads the final checkpoint (full tensors,
    whatever the layout, checksums verified) into a fresh serial model and evaluates its share of
    the held-out rows; one all-reduce combines them (no rank evaluates while others wait). The
    strategies' own models may be sharded or rebuilt into layers that need the other ranks."""
    from .. import checkpoint
    from ..comm.validate import raise_if_any

    # The checkpoint this run wrote (or resumed from), not the newest name in the directory: a
    # newer file the resume skipped (damaged, another run's) is not what this run leaves.
    final = setup.trainer.last_checkpoint
    if comm.rank == 0 and final:  # it can take a while on a large held-out set: said before
        print(f"evaluating {final} on {len(setup.val_set):,} held-out samples", flush=True)
    fresh = problem = None
    try:
        fresh = build_model(c, setup.meta)
        if final is None:
            raise CheckpointError("the run wrote none")
        checkpoint.load_weights(final, fresh)
    except (HpctrainError, OSError, KeyError, ValueError, IndexError) as exc:
        problem = CheckpointError(f"cannot evaluate the final checkpoint {final or '(none)'}: {exc}")
    raise_if_any(comm, problem)
    return evaluate(fresh, setup.val_set, build_loss(c), comm=comm)


def moe_text(c: Config) -> str:
    """The header's ``moe:`` line: the GPT's mixture of experts and how the experts spread."""
    capacity = "dropless" if not c.moe_capacity else f"capacity factor {c.moe_capacity:g}"
    blocks = "every block" if c.moe_every == 1 else f"every {c.moe_every}th block"
    spread = f"{c.moe_experts // c.ep} experts per rank over ep={c.ep}" if c.ep > 1 else "every rank holds all experts"
    return (f"{c.moe_experts} experts, top-{c.moe_top_k}, in {blocks}, {capacity}, load-balancing loss weight "
            f"{c.moe_aux_loss:g}; {spread}")


def _layout_text(c: Config) -> str:
    if c.strategy == "ps":
        return f"parameter server ({c.ps_mode}) with {c.dp} workers"
    note = f" ({c.layout_note})" if c.layout_note else ""
    return f"{c.strategy} with {layout_text(c.dp, c.tp, c.pp, c.zero, c.cp, c.cp_mode, c.ep)}{note}"


def main(args: argparse.Namespace) -> int:
    """Entry of ``hpctrain train``: merge file and flags, then run; returns an ``ExitStatus``:
    75 stopped by SIGTERM/SIGUSR1/SIGINT at a step with a checkpoint; 4 a refusal (configuration,
    data, checkpoints, run directory); 1 any other hpctrain error. A job that went on without lost
    ranks (``--on-rank-loss shrink``) ends its processes here."""
    from ..comm import failure, ulfm

    status = _main(args)
    if ulfm.lost_ranks():
        if status != 0:  # the survivors' rank 0 says why before any survivor ends the job (leavers exit 0)
            failure.settle()
        ulfm.end_process(status)  # MPI_Finalize could wait for the dead
    return status


def _main(args: argparse.Namespace) -> int:
    from .. import preempt
    from ..comm import Communicator, ulfm
    from ..errors import ExitStatus
    from ..log import world_rank

    flags = {k: v for k, v in vars(args).items() if k in _BY_NAME}
    try:
        preempt.install()  # before the first collective: a signal from now on ends at a step boundary
    except ValueError:  # not the main thread (an embedding program): its own handlers stay
        _log.warning("not in the main thread: SIGTERM/SIGUSR1/SIGINT are not turned into a stop at a step")
    try:
        comm = Communicator()
        # Read on every rank, verdict shared: a file missing on one node fails the whole job.
        cfg, changed = everywhere(comm, lambda: read_settings(args.config, flags, comm.size))
        if changed is not None and comm.rank == 0:
            _log.info("resuming the run in %s as its config.json says%s", cfg.run_dir, describe_changes(changed))
        run(cfg, comm)
    except ReplicaLeft as left:  # its tp/pp group lost a member: the whole replicas go on without it
        print(f"[rank {world_rank()}] hpctrain train: this rank leaves the job: {left}", flush=True)
        return ExitStatus.OK
    except Preempted as stop:
        if world_rank() == ulfm.leader():  # rank 0, or the survivors' rank 0 if it was lost
            print(f"hpctrain train: {stop}; to continue: {resume_command(stop.run_dir, comm.size)}", flush=True)
        return ExitStatus.PREEMPTED
    except HpctrainError as exc:
        # Raised on every rank: said once. On some ranks only (a rank's own wait timed out, say):
        # that rank's traceback, and the whole job ends instead of the others waiting.
        from ..comm.failure import fail

        if getattr(exc, "failures", None):  # --resume found checkpoints and none loads
            exc.args = (f"{exc}\n(nothing was changed or deleted; --restart starts over in this run directory, "
                        "moving its checkpoints aside)",)
        return fail(exc, code=ending.exit_status(exc), what="hpctrain train")
    finally:
        preempt.uninstall()
        preempt.clear()
    return ExitStatus.OK
