"""``hpctrain train`` with a lost rank and/or a stop injected: the first job of a matrix row.

    mpiexec -n 4 python tests/matrix/driver.py EVENT VICTIM AT STOP -- <hpctrain train args>

EVENT ``none``; ``kill``: world rank VICTIM SIGKILLs itself as the step after AT completed steps
begins; ``kill-end``: VICTIM dies right after the final checkpoint, as the closing memory figures
are gathered (both tests/faults/train_fault.py's, reused). STOP 0, or the completed steps at which
the lowest surviving world rank asks for a stop (``preempt.request``, what a SIGTERM does): the job
writes a checkpoint and exits 75, for the row's resume to continue.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "faults"))

import train_fault  # noqa: E402 (tests/faults: the kill injections, one place)
from mpi4py import MPI  # noqa: E402

from hpctrain import cli, preempt  # noqa: E402
from hpctrain.training.trainer import Trainer  # noqa: E402


def _stop_at(at: int, asker: int) -> None:
    """World rank ``asker`` asks for a stop as the step after ``at`` completed steps begins."""
    step = Trainer.step

    def stopping(self, *args, **kwargs):
        if self.global_step == at and MPI.COMM_WORLD.Get_rank() == asker:
            print(f"rank {asker}: asked for a stop at step {at}", flush=True)
            preempt.request("the matrix's stop")
        return step(self, *args, **kwargs)

    Trainer.step = stopping


def main(argv: list[str]) -> int:
    event, victim, at, stop = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    assert argv[4] == "--", argv
    if event == "kill":
        train_fault._kill("kill", str(victim), str(at))
    elif event == "kill-end":
        train_fault._kill("kill-end", str(victim), "0")
    else:
        assert event == "none", event
    if stop:
        _stop_at(stop, 1 if victim == 0 and event != "none" else 0)
    return cli.main(["train", *argv[5:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
