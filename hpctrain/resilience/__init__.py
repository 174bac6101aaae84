"""Going on without a lost rank (``--on-rank-loss shrink``, issue 30): the trainer's side.

Under ULFM (``hpctrain.comm.ulfm``) a collective with a dead member fails on the survivors with
``MPI_ERR_PROC_FAILED`` (or ``MPI_ERR_REVOKED``). ``RankLoss.recover`` then, on every survivor:

1. shrinks the trainer's communicator to the survivors (revoke, shrink) and agrees on the step to
   redo: the earliest any survivor was in. MPI does not promise that a failed collective fails on
   every rank, so a survivor may have finished that step and failed in the next one; it keeps
   the state from before each of its last two steps for this;
2. puts back the state from before that step (parameters, optimizer state, counters, RNG states,
   sampler position): all or nothing, as a checkpoint load;
3. rebuilds what depends on the communicator (process grid, gradient buckets and their hooks, the
   watchdog's and the error handling's channels) and hands the rest of the epoch's order to the
   survivors: the global batch stays the same (each survivor takes a larger share), so the run
   stays the same run, and the data order goes on without repeats or gaps;
4. records the loss: ``events`` (``{"step", "ranks", "seconds"}``, the seconds from the failure to
   the next finished step), a log line, and ``rank_loss`` in that step's metrics.

The trainer's ``fit`` then redoes the step (the loader redraws the interrupted global batch for
the new layout). Under pure data parallelism every survivor holds the whole model, so nothing is
lost with a rank and no checkpoint is read. Under ZeRO the lost rank's pieces come back from the
copy its buddy (the next dp rank) holds (``buddies.Buddies``, refreshed before each
step and at each save), and the reducer is built anew over the survivors; pieces lost with their
buddy come from the last checkpoint, which the survivors read. Under dp x tp x pp a replica that
lost a member leaves (``groups``) and the whole ones go on (with ZeRO, each tp x pp
part's dp group puts its pieces together on its own); when none is whole, the survivors write the
state from before the step if one of them holds each tp x pp part, and the job ends (exit 75).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ..backend import xp_of
from ..comm import Communicator, failure, ulfm
from ..errors import Preempted, RankLossError, ReplicaLeft, Say, as_argument
from ..log import get_logger
from ..protocols import Checkpointable, Recoverable
from . import buddies, groups
from .buddies import Buddies

_log = get_logger("resilience")
#: Pre-step states kept: the step a survivor is in and the one before (see the module docstring).
KEEP = 2
#: The strategies whose data-parallel replicas go on without a lost rank (the job's ``strategy``).
SHRINKS = ("dp", "hybrid")
#: A trainer's strategy, as the job names it, by its ``config()["type"]``.
_STRATEGY_OF = {"DataParallelTrainer": "dp", "ParallelTrainer": "hybrid", "TensorParallelTrainer": "tp",
                "PipelineParallelTrainer": "pp", "ParameterServerTrainer": "ps"}


def shrink_problem(strategy: str, backend: str = "mpi", precision: str = "fp32", say: Say = as_argument,
                   cp: int = 1, zero: int = 0, ep: int = 1) -> str | None:
    """Why a job cannot go on without a lost rank (``None``: it can), in ``say``'s names: the one
    place of this rule (``RankLoss`` asks it of the trainer it is handed, ``hpctrain train`` with
    its flags). Data-parallel replicas go on (``strategy`` ``"dp"`` or ``"hybrid"``: dp x tp x
    pp, ZeRO 0-3); a parameter server's windows do not, nor a reduction by node or over NCCL, nor
    mixed precision (its float32 masters and loss scale are not kept across a loss yet), nor
    experts spread over ``ep > 1`` ranks (their groups are not rebuilt); float64 is full precision
    like float32 (no masters, no loss scale) and goes on alike. Under context
    parallelism (``cp`` > 1) a replica is its tp x pp x cp ranks: a lost rank's replica leaves and
    the whole ones go on, their cp groups (held by the attention layers) rebuilt over the
    survivors; with ZeRO it does not go on (its buddy copies pair dp ranks, and under cp the
    pieces are cut over dp x cp), so that is refused before the job trains."""
    if cp > 1 and zero and strategy in SHRINKS:
        return (f"{say('on_rank_loss', 'shrink')} does not go on under context parallelism ({say('cp', cp)}) with "
                f"{say('zero', zero)}: ZeRO's buddy copies pair data-parallel ranks, and under cp its pieces are "
                f"cut over dp x cp; use {say('zero', 0)}, or {say('on_rank_loss', 'abort')} (and resume from a "
                "checkpoint)")
    if strategy not in SHRINKS:
        what = say("strategy", strategy)
    elif backend != "mpi":
        what = say("backend", backend)
    elif precision not in ("fp32", "fp64"):
        what = say("precision", precision)
    elif ep > 1:  # a lost rank's expert slice has replicas only where dp > ep, and the survivors' dp
        # must again split into ep groups: rebuilding the expert groups is not built yet.
        return (f"{say('on_rank_loss', 'shrink')} cannot regroup experts spread over {say('ep', ep)} ranks after a "
                f"lost rank (the expert groups of the survivors are not rebuilt); use {say('on_rank_loss', 'abort')}")
    else:
        return None
    return (f"{say('on_rank_loss', 'shrink')} continues data-parallel replicas only ({say('strategy', 'dp')} or "
            f"hybrid: dp x tp x pp, with {say('zero', '0-3')}; {say('backend', 'mpi')}, "
            f"{say('precision', 'fp32')} or fp64), "
            f"not {what}; use {say('on_rank_loss', 'abort')}")


def check_shrinkable(trainer: Checkpointable) -> None:
    """``ValueError`` (the same on every rank: a local check of settings the ranks agreed on)
    unless ``RankLoss`` can go on with ``trainer`` after a lost rank (``shrink_problem``)."""
    cfg = trainer.config()
    strategy = _STRATEGY_OF.get(cfg["type"], cfg["type"])
    problem = shrink_problem(strategy, cfg.get("backend", "mpi"), cfg.get("precision", "fp32"), cp=cfg.get("cp", 1),
                             zero=cfg.get("zero", 0), ep=cfg.get("ep", 1))
    if problem is not None:
        raise ValueError(problem)


class _Snapshot:
    """What a step changes on this rank, copied before it: parameters, optimizer state, and the
    rest of its state (``trainer.snapshot()``, the ``Stateful`` one a checkpoint load uses)."""

    def __init__(self, trainer: Recoverable, handed: int, sharded: bool) -> None:
        # The loader counts a batch as consumed when it hands it out, before the step: the
        # position to go back to is that many samples earlier.
        self.handed = handed
        # ZeRO: the parameters and the optimizer state are in its pieces, which ``Buddies`` copies
        # and puts back into a new reducer (the old one, over the lost rank, is not restored).
        self.sharded = sharded
        self.params = [] if sharded else [p.data.copy() for p in trainer.params]
        opt = trainer.optimizer
        self.opt_state = copy.deepcopy(opt.state) if opt is not None and not sharded else None
        self.opt_step = getattr(opt, "step_count", None)
        self.small = trainer.snapshot()  # its optimizer part holds references: the copies above count
        if sharded:
            self.small["reducer"] = None

    def restore(self, trainer: Recoverable, sampler: Any) -> None:
        """Put the state back on ``trainer`` and ``sampler`` (the loader's) back before the step."""
        trainer.restore(self.small)
        for p, data in zip(trainer.params, self.params):
            p.data[...] = data
            p.grad.fill(0)
        opt = trainer.optimizer
        if opt is not None and not self.sharded:
            opt.state = copy.deepcopy(self.opt_state)
            opt.step_count = self.opt_step
        sampler.position -= self.handed


def _drop_reducer(trainer: Recoverable) -> None:
    """ZeRO 2, 3: the old reducer's hooks off the model before a new reducer's go on."""
    try:
        trainer.reducer.remove()
    except ulfm.Error:  # its sub-communicators include the lost rank
        pass


class RankLoss:
    """Survive lost ranks in ``Trainer.fit`` over ``loader`` (pure data parallelism).

    ``fit`` calls ``before_step`` before each step and ``recover`` with what a step raised; as
    a ``fit`` callback it times and marks the first step finished after a loss.
    """

    def __init__(self, loader: Any, checkpoint_dir: str | None = None) -> None:
        self.loader = loader
        # Where the job's checkpoints go: when no whole replica is left, the survivors write the
        # state from before the interrupted step there if they hold all of it between them.
        self.checkpoint_dir = checkpoint_dir
        sampler = loader.sampler
        self.global_batch = loader.batch_size * sampler.size
        self.events: list[dict[str, Any]] = []
        self._snapshots: dict[int, _Snapshot] = {}
        self._pending: dict[str, Any] | None = None  # the loss waiting for its next finished step
        self.buddies: Buddies | None = None  # ZeRO's redundant pieces (made at the first step)
        self._fallback: str | None = None  # why the last checkpoint is read (a piece lost with its buddy)
        self._checked: Any = None  # the trainer check_shrinkable passed (asked again of another one)
        self._finished = False  # a recovery found another survivor past fit: the save in hand is committed
        ulfm.set_shrinking()  # a loss this hook cannot go on from says so, not "use shrink"

    def before_step(self, trainer: Recoverable, batch: Any) -> None:
        """Keep the state from before the step on ``batch`` (and the one before it). The first
        time for ``trainer``: ``ValueError`` on every rank when it cannot go on without a lost
        rank (``check_shrinkable``)."""
        if self._checked is not trainer:
            check_shrinkable(trainer)
            self._checked = trainer
        step = trainer.global_step
        sharded = bool(trainer.zero)
        self._snapshots[step] = _Snapshot(trainer, len(batch[0]), sharded)
        for old in [s for s in self._snapshots if s <= step - KEEP]:
            del self._snapshots[old]
        if sharded:
            self.buddies = self.buddies or Buddies()
            if step not in self.buddies.mine:  # (a save at this step refreshed them already)
                self.buddies.refresh(trainer, step)  # collective: a loss here is recovered from as in the step

    def save(self, trainer: Recoverable, write: Callable[[], str]) -> str:
        """``write()`` a checkpoint (collective); when ranks are lost meanwhile, the survivors go on
        without them and write it again. A checkpoint is committed only once every rank wrote its
        part, so the interrupted one never is: the last committed one stays what a resume reads."""
        while True:
            try:
                if self.buddies is not None:  # ZeRO: copies of the pieces at this step, for a loss mid-save
                    self.buddies.refresh(trainer, trainer.global_step)
                return write()
            except Exception as exc:
                if not self.recover(trainer, exc):
                    raise
                if self._finished:  # committed: a survivor that left fit had rank 0's word on it
                    from .. import checkpoint

                    self._finished = False
                    return checkpoint.checkpoint_path(self.checkpoint_dir, trainer.global_step)

    def memory_arrays(self) -> list[Any]:
        """The redundant copies kept to survive a loss (ZeRO's pieces; none for pure dp)."""
        return self.buddies.arrays() if self.buddies is not None else []

    def recover(self, trainer: Recoverable, exc: BaseException) -> bool:
        """Go on with the survivors after ``exc`` if it is a lost rank (collective over them);
        ``False`` when it is not, and the caller raises it. Raises ``RankLossError`` on every
        survivor when the job cannot go on (the global batch does not split over them, say)."""
        if not ulfm.is_rank_loss(exc):
            return False
        t0 = time.monotonic()
        ulfm.revoke_held(trainer.comm.mpi)  # (done already where an hpctrain wait saw the loss)
        try:
            trainer.abandon_step()
        except ulfm.Error:  # its in-flight buckets fail with the loss: the reducer is replaced below
            pass
        old_dp, old_world = trainer.dp.mpi, ulfm.world_ranks(trainer.comm.mpi)
        agreed = self._shrink(trainer)
        if agreed.finished:  # another survivor had the last save's outcome and left fit: so does this one
            self._finished = True
            self._finish_with(trainer, agreed, t0)
            return True
        comm, lost, step = Communicator(agreed.comm), agreed.lost, agreed.redo
        replica, whole = groups.replicas(trainer.grid, old_world, lost)
        if not whole:
            self._end_without_replica(trainer, comm, lost, step, old_world)
        missing: list[tuple[int, int]] = []
        if self.buddies is not None and step >= 0:  # ZeRO: a step whose pieces every part's group holds
            step, missing = self._pieces_step(trainer, comm, step, old_world, {w for w, d in replica.items()
                                                                                   if d in whole})
        self._check(trainer, comm, lost, step, whole)
        if step in self._snapshots:  # else this survivor was between steps, at exactly that boundary
            self._snapshots[step].restore(trainer, self.loader.sampler)
            self._snapshots = {step: self._snapshots[step]}
        comm = self._leave_broken(trainer, comm, lost, replica[ulfm.world_rank()] in whole, len(whole))
        read = self._rebind(trainer, comm, old_dp, lost, step, missing)
        ulfm.set_leader(comm.mpi)
        if not lost:  # a communicator of an earlier loss raised, nobody new died: no loss to record
            return True
        event = {"step": step + 1, "ranks": lost, "seconds": None}  # numbered as in metrics.jsonl
        self.events.append(event)
        self._pending = {"event": event, "t0": t0}
        if comm.rank == 0:
            dp = trainer.dp.size
            each = "each" if dp == comm.size else f"each of the {dp} whole replica(s)"
            start = ("the state before that step" if read is None
                     else f"the last checkpoint (step {trainer.global_step})")
            _log.warning("lost rank(s) %s in step %d: going on with %d rank(s), %d sample(s) %s per step, from %s",
                         lost, step + 1, comm.size, self.global_batch // dp, each, start)
        return True

    def _pieces_step(self, trainer: Recoverable, comm: Communicator, step: int, old_world: list[int],
                     whole_members: set[int]) -> tuple[int, list[tuple[int, int]]]:
        """ZeRO: the step to redo, agreed by every survivor (one allgather over them): ``step`` or
        the one before, the newest every survivor going on can go back to and whose pieces every
        tp x pp part's dp group holds; and the ``(dp rank, world rank)`` pieces missing when
        neither is (then every survivor reads the last checkpoint, or ends). Decided per dp group
        alone, a part whose buddy copy of this step was lost with the rank read the checkpoint
        while the others went on, and their collectives no longer matched (issue 38)."""
        mine, left = self.buddies.steps()
        held = comm.allgather_obj((ulfm.world_rank(), mine, left, sorted(self._snapshots), trainer.global_step))
        goes_on = {w for w, *_ in held} & whole_members
        grid = trainer.grid
        return buddies.common_step([step, step - 1], held, old_world, grid.tp_size, grid.pp_size, goes_on)

    def _shrink(self, trainer: Recoverable) -> ulfm.Agreed:
        """The survivors, every world rank lost, the step to redo, and whether one of them had
        finished training. More ranks may die meanwhile: then the survivors shrink again."""
        # Every survivor must hold the state from before the step to redo (see the docstring), or
        # be at that step's start: the loss was seen between two steps (a callback's wait).
        return ulfm.shrink_and_agree(trainer.comm.mpi, trainer.global_step,
                                     lambda s: s in self._snapshots or trainer.global_step == s)

    def _end_without_replica(self, trainer: Recoverable, comm: Communicator, lost: list[int], step: int,
                             old_world: list[int]) -> NoReturn:
        """No whole dp replica is left (each lost a tensor- or pipeline-parallel member): end the job
        as a preempted one (exit 75) on every survivor, with a checkpoint of the state from before
        the interrupted step when the survivors hold all of it between them, else with the last
        committed one; the exit line says which."""
        failure.rebind(comm.mpi)  # an error now ends the survivors normally, said once
        ulfm.set_leader(comm.mpi)
        path, missing = self._save_parts(trainer, comm, step, old_world)
        trainer.comm = comm  # the survivors: what the job's closing collectives run over
        if path is not None:
            trainer.last_checkpoint = path
            how = f"the state before step {step + 1} saved from the survivors' parts"
        else:
            how = f"{missing}: the last committed checkpoint is kept"
        if comm.rank == 0:
            _log.warning("lost rank(s) %s in step %d: no whole dp replica is left (each lost a tensor- or "
                         "pipeline-parallel member); %s: %s", lost, step + 1, how,
                         trainer.last_checkpoint or "(none written)")
        raise Preempted(step, trainer.last_checkpoint, f"lost rank(s) {lost}: no whole dp replica left, {how}")

    def _save_parts(self, trainer: Recoverable, comm: Communicator, step: int,
                    old_world: list[int]) -> tuple[str | None, str | None]:
        """Write the state from before ``step`` from one survivor of each tp x pp part (collective
        over the survivors): ``(its path, None)``, or ``(None, why not)``, the same on every survivor."""
        if self.checkpoint_dir is None:
            return None, "no checkpoint directory"
        if step < 0:
            return None, "the survivors do not all hold the state from before the interrupted step"
        part, lead, missing = groups.cover(comm, trainer.grid, old_world)
        if missing:
            return None, f"no survivor holds the (tp, pp) part(s) {missing} of the model"
        result = None
        if part is not None:
            try:
                result = self._write_part(trainer, part, step)
            except Exception as exc:  # said in the exit line; the last committed checkpoint stays
                result = (None, f"writing the survivors' checkpoint failed ({type(exc).__name__}: {exc})")
        return comm.bcast_obj(result, root=lead)

    def _write_part(self, trainer: Recoverable, part: Communicator, step: int) -> tuple[str | None, str | None]:
        """On one survivor of each tp x pp part (collective over them, ``part``): the state from
        before ``step`` as one replica (dp=1) over ``part``, written as a checkpoint; under ZeRO
        with the pieces put together from this survivor's own and its buddy copies."""
        from .. import checkpoint

        old_dp = trainer.dp.mpi
        if step in self._snapshots:  # else this survivor is at that step's start already
            self._snapshots[step].restore(trainer, self.loader.sampler)
        grid = groups.regrid(trainer.grid, part, cp=1)  # one survivor of each tp x pp part: no cp group
        self.loader.sampler.reshard(0, 1)  # one replica now: it consumed what all of them did
        full = None
        if self.buddies is not None:
            _drop_reducer(trainer)
            full, problem = self.buddies.assemble(old_dp, grid.dp, step)
            problem = next((p for p in part.allgather_obj(problem) if p is not None), None)  # one verdict
            if problem is not None:
                return None, problem
        trainer.rebind(grid, full)
        return checkpoint.save_in(self.checkpoint_dir, trainer, keep=0), None

    def _check(self, trainer: Recoverable, comm: Communicator, lost: list[int], step: int, whole: list[int]) -> None:
        """Refuse, on every survivor alike, what this job cannot go on from. A lost rank 0 is no
        problem: the survivors' rank 0 writes the metrics and the summary on."""
        failure.rebind(comm.mpi)  # an error now ends the survivors normally, said once
        problem = None
        if step < 0:
            problem = "the survivors do not all hold the state from before the interrupted step"
        elif self.global_batch % len(whole):
            problem = (f"the global batch {self.global_batch} does not split over the {len(whole)} "
                       f"{'ranks' if len(whole) == comm.size else 'whole dp replicas'} left; "
                       f"a global batch that is a multiple of every survivor count goes on")
        if problem is not None:
            raise failure.mark_everywhere(RankLossError(f"lost rank(s) {lost}; cannot go on: {problem}"), comm)

    def _leave_broken(self, trainer: Recoverable, comm: Communicator, lost: list[int], whole: bool,
                      n: int) -> Communicator:
        """The communicator of the whole replicas' members (collective over the survivors); on
        the members of a broken replica, ``ReplicaLeft`` after a log line."""
        if trainer.grid.tp_size * trainer.grid.pp_size * trainer.grid.cp_size == 1:
            return comm
        mine = groups.whole_replicas(comm, whole)
        if mine is None:
            _log.warning("rank %d leaves the job: its tensor/pipeline-parallel group lost rank(s) %s; %d whole "
                         "replica(s) go on", ulfm.world_rank(), lost, n)
            raise ReplicaLeft(f"its dp replica lost rank(s) {lost}; {n} whole replica(s) go on")
        failure.rebind(mine.mpi)
        return mine

    def _rebind(self, trainer: Recoverable, comm: Communicator, old_dp: ulfm.Handle, lost: list[int],
                step: int, missing: list[tuple[int, int]]) -> str | None:
        """Point the trainer, its gradient reduction and its data at the survivors' communicator
        (``trainer.rebind``; ZeRO: with the state from before ``step`` put together from the
        pieces, see ``Buddies``; the checkpoint read instead, when pieces were lost with their
        buddy, is returned)."""
        grid = groups.regrid(trainer.grid, comm)
        full = None
        if self.buddies is not None:
            _drop_reducer(trainer)
            full, problem = None, None
            if missing:  # (the same on every survivor: agreed in _pieces_step)
                problem = (f"no copy of the ZeRO pieces of dp rank(s) {sorted({d for d, _ in missing})} (world "
                           f"{sorted(w for _, w in missing)}) survived: a rank and its buddy (the next dp rank) "
                           "were lost together")
            else:
                full, problem = self.buddies.assemble(old_dp, grid.dp, step)
            if problem is not None:
                if trainer.last_checkpoint is None:
                    raise failure.mark_everywhere(RankLossError(f"lost rank(s) {lost}; cannot go on: {problem}; "
                                                                "no checkpoint was written yet"), comm)
                self._fallback = problem  # read the last checkpoint once the rest is rebuilt (below)
                xp = xp_of(trainer.params[0].data)
                for p in trainer.params:  # zeros the load then fills (zero 3: read-only placeholders now)
                    p.data = xp.zeros(p.shape, dtype=p.dtype)
        trainer.rebind(grid, full)
        sampler = self.loader.sampler
        sampler.reshard(grid.dp.rank, grid.dp.size)  # tp and pp ranks of a replica share its batches
        self.loader.batch_size = self.global_batch // grid.dp.size
        return self._read_last(trainer, comm, lost) if self._fallback is not None else None

    def _read_last(self, trainer: Recoverable, comm: Communicator, lost: list[int]) -> str:
        """ZeRO pieces lost with their buddy: the survivors read the last checkpoint (collective;
        the loader then goes on from its position, in the same epoch) or end naming it. Its path."""
        from .. import checkpoint

        path, epoch, problem, self._fallback = trainer.last_checkpoint, trainer.epoch, self._fallback, None
        if comm.rank == 0:
            _log.warning("lost rank(s) %s: %s; reading the last checkpoint %s", lost, problem, path)
        checkpoint.load(path, trainer)
        self._snapshots, self.buddies = {}, None
        if trainer.epoch != epoch:
            raise failure.mark_everywhere(RankLossError(
                f"lost rank(s) {lost}; cannot go on: {problem}; the last checkpoint {path} is of an earlier "
                f"epoch: resume from it with --resume"), comm)
        return path

    def closing(self, trainer: Recoverable, fn: Callable[[], Any]) -> Any:
        """``fn()``, the job's closing collectives after ``fit`` (the memory figures, the final
        evaluation, the summary); when ranks are lost meanwhile the survivors shrink to themselves
        and run it again (collective over them). Training is done: nothing is restored or redone,
        and the loss is recorded at the last step."""
        while True:
            try:
                return fn()
            except Exception as exc:
                if not ulfm.is_rank_loss(exc):
                    raise
                t0 = time.monotonic()
                # The agreement the survivors still in fit make too (one that saw the loss in the
                # last checkpoint's save, after this one had its outcome): their collectives match.
                agreed = ulfm.shrink_and_agree(trainer.comm.mpi, trainer.global_step, lambda s: True, done=True)
                if not agreed.lost:  # nothing new died: a communicator of an earlier loss, still in use
                    raise
                self._finish_with(trainer, agreed, t0)

    def _finish_with(self, trainer: Recoverable, agreed: ulfm.Agreed, t0: float) -> None:
        """Training is done: the survivors ``agreed.comm`` finish the job (its closing collectives)
        without restoring or redoing anything; the loss is recorded at the last step."""
        comm = Communicator(agreed.comm)
        trainer.comm = comm
        failure.rebind(agreed.comm)
        ulfm.set_leader(agreed.comm)
        if not agreed.lost:
            return
        self.events.append({"step": trainer.global_step, "ranks": agreed.lost, "seconds": time.monotonic() - t0})
        if comm.rank == 0:
            _log.warning("lost rank(s) %s after the last step (%d): the %d survivor(s) finish the job", agreed.lost,
                         trainer.global_step, comm.size)

    # -- as a fit callback -------------------------------------------------------------------------

    def on_step_end(self, trainer: Recoverable, stats: Any) -> None:
        """The first step finished after a loss: its time, its mark in the metrics."""
        if self._pending is None:
            return
        event = self._pending["event"]
        event["seconds"] = time.monotonic() - self._pending["t0"]
        self._pending = None
        stats.extra["rank_loss"] = list(event["ranks"])
        if trainer.comm.rank == 0:
            _log.warning("step %d finished %.2f s after losing rank(s) %s", trainer.global_step,
                         event["seconds"], event["ranks"])

