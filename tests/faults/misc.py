"""Small jobs for the fault tests, launched without ``-m mpi4py`` like a user's own script.

    mpiexec -n 2 python tests/faults/misc.py crash        # last rank raises; the others wait in allreduce
    mpiexec -n 2 python tests/faults/misc.py recv-stall   # rank 0 waits in recv from a rank that sleeps
    mpiexec -n 2 python tests/faults/misc.py model        # last rank builds another model -> refused
    mpiexec -n 2 python tests/faults/misc.py debug-shape  # HPCTRAIN_DEBUG=1: allreduce of different shapes
    mpiexec -n 2 python tests/faults/misc.py crash-all    # every rank raises the same error, unhandled
    mpiexec -n 2 python tests/faults/misc.py lines        # every rank writes many error lines at once
    mpiexec -n 2 python tests/faults/misc.py ps-no-close  # a parameter server never closed: windows freed at exit
    mpiexec -n 2 python tests/faults/misc.py raise-all    # every rank raises the same untagged error, unhandled
    mpiexec -n 2 python tests/faults/misc.py fail-all     # every rank ends with failure.fail of the same error
    mpiexec -n 2 python tests/faults/misc.py node-stop    # each rank claims a node; the last freezes (SIGSTOP)
    mpiexec -n 2 python tests/faults/misc.py fit-again    # a callback raises on the last rank; caught; fit again
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import hpctrain as ht
from hpctrain.errors import HpctrainError
from hpctrain.nn import Linear, ReLU, Sequential
from hpctrain.parallel import DataParallelTrainer


def main(mode: str) -> int:
    if mode == "node-stop":  # a node of its own per rank, claimed before the first Communicator
        from mpi4py import MPI

        os.environ["HPCTRAIN_NODE_NAME"] = f"claimed{MPI.COMM_WORLD.Get_rank()}"
    comm = ht.Communicator()
    last = comm.size - 1
    comm.allreduce(np.ones(2))
    if mode == "crash":
        if comm.rank == last:
            raise RuntimeError("injected failure on the last rank")
        comm.allreduce(np.ones(2))  # would wait forever without the abort hook
    elif mode == "recv-stall":
        comm.set_timeout(3)
        if comm.rank == 0:
            comm.recv(np.empty(4), source=1, tag=5)
        elif comm.rank == 1:
            time.sleep(600)
    elif mode == "model":
        hidden = 9 if comm.rank == last else 8
        r = np.random.default_rng(0)
        model = Sequential(Linear(5, hidden, rng=r), ReLU(), Linear(hidden, 3, rng=r))
        opt = ht.optim.SGD(model.parameters(), lr=0.1)
        try:
            DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), optimizer=opt, comm=comm)
        except HpctrainError as exc:
            print(f"rank {comm.rank} refused: {type(exc).__name__}: {exc}", flush=True)
            return 2
    elif mode == "crash-all":
        from hpctrain.comm.validate import raise_if_any

        raise_if_any(comm, "injected on the last rank" if comm.rank == last else None, what="checking")
    elif mode == "lines":
        from hpctrain.comm.failure import write_lines

        comm.barrier()
        for i in range(300):
            write_lines(f"line {i} " + "x" * 300 + f"\nline {i} second part")
    elif mode == "debug-shape":
        try:
            comm.allreduce(np.ones(5 if comm.rank == last else 4))
        except HpctrainError as exc:
            print(f"rank {comm.rank} refused: {type(exc).__name__}: {exc}", flush=True)
            return 2
    elif mode == "ps-no-close":
        import atexit

        from hpctrain.parallel import ParameterServerTrainer

        ps: list = []
        # Registered before the trainer makes its windows, so it runs after their exit-time free.
        atexit.register(lambda: print(f"rank {comm.rank} windows freed at exit: "
                                      f"{ps[0]._win.freed and ps[0].clocks.window.freed}", flush=True))
        model = Sequential(Linear(5, 3, rng=np.random.default_rng(0)))
        ps.append(ParameterServerTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), lr=0.1, comm=comm, mode="async"))
        ps[0].step(np.ones((4, 5)), np.zeros(4, dtype=np.int64))
    elif mode == "raise-all":
        raise RuntimeError("injected on every rank")
    elif mode == "node-stop":
        comm.set_timeout(3)
        if comm.rank == last:  # neither computes nor answers: a node that hangs or is cut off
            os.kill(os.getpid(), signal.SIGSTOP)
        comm.allreduce(np.ones(2))
    elif mode == "fit-again":
        return _fit_again(comm)
    elif mode == "fail-all":
        from hpctrain.comm.failure import fail

        return fail(HpctrainError("injected on every rank"), what="misc")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(f"rank {comm.rank} finished", flush=True)
    return 0


def _fit_again(comm) -> int:
    """A callback raises on the last rank only at step 3; the script catches it there and calls
    fit again, while the other ranks go on with their first fit."""
    from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler

    last = comm.size - 1
    g = np.random.default_rng(0)
    rows = ArrayDataset(g.normal(size=(64 * comm.size, 5)), g.integers(0, 3, 64 * comm.size))
    loader = DataLoader(rows, 4, ShardedSampler(len(rows), comm.rank, comm.size, seed=0))
    model = Sequential(Linear(5, 8, rng=np.random.default_rng(1)), ReLU(), Linear(8, 3, rng=np.random.default_rng(2)))
    trainer = DataParallelTrainer(model=model, loss=ht.nn.CrossEntropyLoss(), comm=comm,
                                  optimizer=ht.optim.SGD(model.parameters(), lr=0.1))

    class Flaky:
        fired = False

        def on_step_end(self, tr, stats):
            if comm.rank == last and tr.global_step == 3 and not Flaky.fired:
                Flaky.fired = True
                raise RuntimeError("injected in a callback on the last rank")

    for attempt in (1, 2):
        try:
            trainer.fit(loader, epochs=2, callbacks=[Flaky()], log_every=1000)
            print(f"rank {comm.rank} fit {attempt} finished at step {trainer.global_step}", flush=True)
            return 0
        except (RuntimeError, HpctrainError) as exc:
            print(f"rank {comm.rank} fit {attempt}: {type(exc).__name__}: {exc}", flush=True)
            if not str(exc).startswith("injected"):
                return 2
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
