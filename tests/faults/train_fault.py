"""``hpctrain train`` with a fault injected on one rank, launched like the command itself.

    mpiexec -n 2 python tests/faults/train_fault.py stop  RANK STEP -- <hpctrain train args>
    mpiexec -n 2 python tests/faults/train_fault.py raise RANK STEP -- <hpctrain train args>
    mpiexec -n 2 python tests/faults/train_fault.py none  0 0 -- <hpctrain train args>
    mpiexec -n 2 python tests/faults/train_fault.py stop-save RANK STEP -- <hpctrain train args>
    mpiexec -n 3 python tests/faults/train_fault.py kill-save RANK STEP -- <hpctrain train args>
    mpiexec -n 2 python tests/faults/train_fault.py ctrl-c-twice RANK STEP -- <hpctrain train args>
    mpiexec -n 3 python tests/faults/train_fault.py kill RANKS STEPS -- <hpctrain train args>
    mpiexec -n 3 python tests/faults/train_fault.py kill-reduce RANKS STEPS -- <hpctrain train args>
    mpiexec -n 4 python tests/faults/train_fault.py kill-recover RANKS STEPS -- <hpctrain train args>
    mpiexec -n 4 python tests/faults/train_fault.py kill-buddy RANKS STEPS -- <hpctrain train args>
    mpiexec -n 3 python tests/faults/train_fault.py kill-end RANK 0|1 -- <hpctrain train args>
    mpiexec -n 4 python tests/faults/train_fault.py kill-round RANK STEP -- <hpctrain train args>
    mpiexec -n 4 python tests/faults/train_fault.py kill-within RANK STEP -- <hpctrain train args>
    mpiexec -n 4 python tests/faults/train_fault.py kill-commit RANK STEP -- <hpctrain train args>
    mpiexec -n 2 python tests/faults/train_fault.py ctrl-c-exit 0 STEP -- <hpctrain train args>
    mpiexec -n 2 python tests/faults/train_fault.py exit RANK STEP,STATUS -- <hpctrain train args>
    mpiexec -n 2 python tests/faults/train_fault.py readonly DIR STEP -- <hpctrain train args>

stop: rank RANK stops itself (SIGSTOP) when it reaches step STEP: a rank that neither computes
nor answers, as a frozen node looks to the others (STEP -1: the first epoch's last step). raise:
rank RANK raises ``StallError`` at step STEP, an error on that rank only (as one trainer's own
wait timing out). ctrl-c-twice: rank RANK (-1: every rank) sends itself SIGINT twice at step
STEP, an impatient user's Ctrl-C pressed again. These three go into the parameter-server
trainer's ``step``, so use ``--strategy ps``. stop-save: rank RANK stops itself while it writes
its part of the checkpoint of step STEP (any strategy); kill-save: kills itself (SIGKILL) there,
as a node that dies mid-save. kill: each rank of RANKS kills itself
(SIGKILL) as its step of STEPS begins (lists: ``kill 2,3 3,8``), as a node that dies; for the
synchronous strategies. kill-reduce: the same while its gradient all-reduces are in flight (dp).
kill-recover: the same, except that the last rank of RANKS dies as it starts to recover from the
others' loss (a second loss during the shrink). kill-buddy: the same, just before the victim sends
its ZeRO pieces of that step to its buddy (its dp neighbours then hold its pieces of the step
before, the other dp groups those of this step). kill-end: RANK dies after the training, just after
its final checkpoint: as the memory figures are gathered (0) or as the final evaluation starts (1).
kill-round: RANK dies as it starts the second round of a ZeRO reduce-scatter in step STEP (4 dp
ranks: ``comm.pieces.PairTree``'s rounds); kill-within: at a random moment of step STEP.
kill-commit: RANK dies once the ranks agreed on what they wrote of step STEP's checkpoint, as
rank 0 commits it and shares the outcome (a broadcast the others may get before the loss or not).

ctrl-c-exit: every rank sends itself SIGINT at step STEP (a stop: checkpoint, status 75); the
last rank is then 3 s late to finalize MPI, and every rank gets a second SIGINT 1.5 s into its
end of the program, the others while they wait for that rank (Ctrl-C pressed again as the job
exits; the program as ``hpctrain`` runs it: ``cli.command``).
exit: rank RANK ends its process with ``os._exit(STATUS)`` as its step STEP begins: no word, no
exception, nothing flushed (a library that exits, say). readonly: as step STEP begins, rank 0
makes DIR read-only: remounted (``mount -o remount,ro``) when it is a mount point and this is
root, else its write permissions taken away (``chmod``: refused to a user that is not root).

With ``FAULT_SLOW_SAY=S`` in the environment, world rank 0 waits S seconds before each line it
reports through ``hpctrain.comm.failure`` (a loaded node): the others must not end the job first.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from typing import Any

from mpi4py import MPI

from hpctrain import cli
from hpctrain.errors import StallError
from hpctrain.parallel import param_server, reducer
from hpctrain.training.trainer import Trainer


def _kill(mode: str, ranks: str, steps: str) -> None:
    """kill / kill-reduce: this rank SIGKILLs itself at its step, if it is one of ``ranks``."""
    rank = MPI.COMM_WORLD.Get_rank()
    at = dict(zip(map(int, ranks.split(",")), map(int, steps.split(",")))).get(rank)
    if at is None:
        return

    def die() -> None:
        print(f"rank {rank}: injected {mode} at step {at}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "kill-recover" and rank == int(ranks.split(",")[-1]):  # the last victim: in the recovery
        from hpctrain.comm import ulfm

        def dying_shrink(comm):
            die()

        ulfm.shrink = dying_shrink
        return
    if mode == "kill-end":  # after fit: ``at`` 0 as the memory figures are gathered, 1 as the final evaluation starts
        from hpctrain.job import runner

        if at == 0:
            summary = Trainer.memory_summary

            def dying_summary(self):
                die()
                return summary(self)

            Trainer.memory_summary = dying_summary
        else:
            evaluate = runner._evaluate_final

            def dying_evaluation(*args, **kwargs):
                die()
                return evaluate(*args, **kwargs)

            runner._evaluate_final = dying_evaluation
        return
    if mode == "kill-commit":  # as the outcome of step ``at``'s checkpoint is shared (rank 0 committed it)
        from hpctrain.checkpoint import format as fmt
        from hpctrain.checkpoint import saving

        gather = saving.Job.gather

        def dying_gather(self):
            gather(self)
            if os.path.basename(self.path) == os.path.basename(fmt.checkpoint_path("", at)):
                die()

        saving.Job.gather = dying_gather
        return
    if mode in ("kill-round", "kill-within"):
        _kill_within_step(mode, at, die)
        return
    if mode == "kill-buddy":  # before its ZeRO pieces go to its buddy for step ``at``
        from hpctrain.resilience import buddies

        refresh = buddies.Buddies.refresh

        def dying_refresh(self, trainer, step):
            if step == at:
                die()
            return refresh(self, trainer, step)

        buddies.Buddies.refresh = dying_refresh
        return
    if mode == "kill-reduce":  # one reduction per step (no --accum-steps): the (at+1)-th
        finish, calls = reducer.AllReduceReducer.finish, [0]

        def dying(self):
            calls[0] += 1
            if calls[0] == at + 1:
                die()
            return finish(self)

        reducer.AllReduceReducer.finish = dying
        return
    step = Trainer.step

    def killed(self, *args, **kwargs):
        if self.global_step == at:
            die()
        return step(self, *args, **kwargs)

    Trainer.step = killed


def _kill_within_step(mode: str, at: int, die: Any) -> None:
    """kill-round: ``die`` as this rank starts the second round of a ZeRO reduce-scatter in step
    ``at`` (``comm.pieces.PairTree``, 4 or 8 dp ranks: its partner of the first round has moved on
    to the next reduction); kill-within: at a random moment of step ``at`` (a timer started as the
    step begins, up to the previous step's duration: a SIGKILL from outside, wherever it lands)."""
    import random
    import threading
    import time

    from hpctrain.comm import pieces

    step, now, took = Trainer.step, [-1], [0.05]

    def stepping(self, *args, **kwargs):
        now[0] = self.global_step
        if mode == "kill-within" and now[0] == at:
            threading.Timer(random.uniform(0, took[0]), die).start()
        t0 = time.monotonic()
        try:
            return step(self, *args, **kwargs)
        finally:
            took[0] = time.monotonic() - t0

    Trainer.step = stepping
    if mode == "kill-round":
        start_round = pieces._Chain._round

        def dying_round(self):
            if self.j == 1 and now[0] == at:
                die()
            return start_round(self)

        pieces._Chain._round = dying_round


def _slow_say(seconds: float) -> None:
    """World rank 0 reports its errors ``seconds`` late (``FAULT_SLOW_SAY``)."""
    import time

    from hpctrain.comm import failure

    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    write = failure.write_lines

    def slow(text: str) -> None:
        time.sleep(seconds)
        write(text)

    failure.write_lines = slow


def _ctrl_c_exit(at: int) -> Any:
    """ctrl-c-exit: a stop at step ``at``, then a second Ctrl-C while rank 0 waits for a late rank."""
    import subprocess
    import time

    from hpctrain.comm import failure

    rank, last = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size() - 1
    step, end = Trainer.step, getattr(failure, "end_program", lambda status: status)  # (before issue 38: none)

    def stopping(self, *args, **kwargs):
        if self.global_step == at:
            print(f"rank {rank}: injected SIGINT at step {at}", flush=True)
            os.kill(os.getpid(), signal.SIGINT)
        return step(self, *args, **kwargs)

    def late_end(status: int) -> int:
        import atexit

        if rank == last:  # runs inside the end, before MPI_Finalize: the others wait there for it
            atexit.register(time.sleep, 3)
        subprocess.Popen(["sh", "-c", f"sleep 1.5; kill -INT {os.getpid()}"])  # Ctrl-C again, every rank
        return end(status)

    Trainer.step = stopping
    failure.end_program = late_end
    return late_end


def _exit_at(rank: int, at: int, status: int) -> None:
    """exit: ``os._exit(status)`` on ``rank`` as its step ``at`` begins."""
    step = Trainer.step

    def exiting(self, *args, **kwargs):
        if self.global_step == at and MPI.COMM_WORLD.Get_rank() == rank:
            os._exit(status)
        return step(self, *args, **kwargs)

    Trainer.step = exiting


def _readonly_at(directory: str, at: int) -> None:
    """readonly: rank 0 makes ``directory`` read-only as step ``at`` begins."""
    import subprocess

    step = Trainer.step

    def freezing(self, *args, **kwargs):
        if self.global_step == at and MPI.COMM_WORLD.Get_rank() == 0:
            if os.path.ismount(directory) and os.geteuid() == 0:
                subprocess.run(["mount", "-o", "remount,ro", directory], check=True)
            else:
                for where, _, _ in os.walk(directory):
                    os.chmod(where, 0o555)
            print(f"rank 0: made {directory} read-only at step {at}", flush=True)
        return step(self, *args, **kwargs)

    Trainer.step = freezing


def _command(argv: list[str], end=None) -> None:
    """The program as ``hpctrain`` runs it (``cli.command``; before it existed, main then exit)."""
    if hasattr(cli, "command"):
        cli.command(argv)
    status = cli.main(argv)
    sys.exit(end(status) if end is not None else status)


def main() -> int:
    if os.environ.get("FAULT_SLOW_SAY"):
        _slow_say(float(os.environ["FAULT_SLOW_SAY"]))
    if sys.argv[1] in ("kill", "kill-reduce", "kill-recover", "kill-buddy", "kill-end", "kill-round", "kill-within",
                       "kill-commit"):
        assert sys.argv[4] == "--", sys.argv
        _kill(*sys.argv[1:4])
        return cli.main(["train", *sys.argv[5:]])
    if sys.argv[1] == "ctrl-c-exit":
        _command(["train", *sys.argv[5:]], _ctrl_c_exit(int(sys.argv[3])))
    if sys.argv[1] == "readonly":
        _readonly_at(sys.argv[2], int(sys.argv[3]))
        _command(["train", *sys.argv[5:]])
    if sys.argv[1] == "exit":
        _exit_at(int(sys.argv[2]), *map(int, sys.argv[3].split(",")))
        _command(["train", *sys.argv[5:]])
    mode, rank, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    assert sys.argv[4] == "--", sys.argv
    if mode in ("stop-save", "kill-save") and MPI.COMM_WORLD.Get_rank() == rank:
        from hpctrain.checkpoint import format as fmt
        from hpctrain.checkpoint import saving

        write = saving.Job.write

        def stopping(self):
            if os.path.basename(self.path) == os.path.basename(fmt.checkpoint_path("", at)):
                print(f"rank {rank}: injected {mode[:4]} while saving step {at}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP if mode == "stop-save" else signal.SIGKILL)
            return write(self)

        saving.Job.write = stopping
    elif mode != "none" and rank in (MPI.COMM_WORLD.Get_rank(), -1):
        step = param_server.ParameterServerTrainer.step

        def faulty(self, *args, **kwargs):
            # STEP -1: the first epoch's last step (counted from its first batch, a full one).
            if not hasattr(self, "_fault_at"):
                self._fault_at = at if at >= 0 else math.ceil(len(self.state.sampler) / len(args[0])) - 1
            when = self._fault_at
            if self.global_step == when:
                print(f"rank {MPI.COMM_WORLD.Get_rank()}: injected {mode} at step {when}", flush=True)
                if mode == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif mode == "ctrl-c-twice":
                    os.kill(os.getpid(), signal.SIGINT)  # the first asks for a stop at the next step
                    os.kill(os.getpid(), signal.SIGINT)  # the second: out now
                else:
                    raise StallError(f"injected on rank {rank} at step {at}")
            return step(self, *args, **kwargs)

        param_server.ParameterServerTrainer.step = faulty
    return cli.main(["train", *sys.argv[5:]])


if __name__ == "__main__":
    sys.exit(main())
