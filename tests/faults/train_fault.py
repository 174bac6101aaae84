"""``hpctrain train`` with a fault injected on one rank, launched like the command itself.

    mpiexec -n 2 python tests/faults/train_fault.py stop  RANK STEP -- <hpctrain train args>
    mpiexec -n 2 python tests/faults/train_fault.py raise RANK STEP -- <hpctrain train args>
    mpiexec -n 2 python tests/faults/train_fault.py kill  RANK STEP -- <hpctrain train args>
    mpiexec -n 2 python tests/faults/train_fault.py none  0 0 -- <hpctrain train args>

stop: rank RANK stops itself (SIGSTOP) when it reaches step STEP: a rank that neither computes
nor answers, as a frozen node looks to the others. raise: rank RANK raises ``StallError`` at step
STEP, an error on that rank only (as one trainer's own wait timing out). The fault goes into the
parameter-server trainer's ``step``, so use ``--strategy ps``. kill: rank RANK kills itself
(SIGKILL) as its step STEP begins, as a node that dies; for the synchronous strategies.
kill-reduce: the same while its gradient all-reduces of step STEP are in flight (dp).
"""

from __future__ import annotations

import os
import signal
import sys

from mpi4py import MPI

from hpctrain import cli
from hpctrain.errors import StallError
from hpctrain.parallel import param_server, reducer
from hpctrain.trainer import Trainer


def _kill_in_reduction(rank: int, at: int) -> None:
    """SIGKILL this rank as its gradient buckets of step ``at`` are in flight (one reduction per
    step: no --accum-steps)."""
    finish, calls = reducer.AllReduceReducer.finish, [0]

    def dying(self):
        calls[0] += 1
        if calls[0] == at + 1:
            print(f"rank {rank}: injected kill-reduce at step {at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return finish(self)

    reducer.AllReduceReducer.finish = dying


def main() -> int:
    # RANK and STEP may be lists (kill 2,3 3,8: rank 2 at step 3, rank 3 at step 8).
    mode, ranks, steps = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
    assert sys.argv[4] == "--", sys.argv
    me = MPI.COMM_WORLD.Get_rank()
    rank, at = me, dict(zip(map(int, ranks), map(int, steps))).get(me, -1)
    if mode == "kill-reduce" and at >= 0:
        _kill_in_reduction(rank, at)
    elif mode != "none" and at >= 0:
        owner = Trainer if mode == "kill" else param_server.ParameterServerTrainer
        step = owner.step

        def faulty(self, *args, **kwargs):
            if self.global_step == at:
                print(f"rank {rank}: injected {mode} at step {at}", flush=True)
                if mode == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                else:
                    raise StallError(f"injected on rank {rank} at step {at}")
            return step(self, *args, **kwargs)

        owner.step = faulty
    return cli.main(["train", *sys.argv[5:]])


if __name__ == "__main__":
    sys.exit(main())
