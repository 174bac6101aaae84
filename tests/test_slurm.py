"""slurm/train.sbatch in a real Slurm: a single-node cluster started on this machine.

Run by ``make test-slurm`` (which installs Debian's ``slurmctld slurmd munge`` when missing and
sets HPCTRAIN_TEST_SLURM=1). The test writes a slurm.conf for this host, starts munged,
slurmctld and slurmd with every state file in a temporary directory, ``sbatch``es the
repository's slurm/train.sbatch with 2 tasks (``srun --mpi=pmi2`` launching the venv's MPICH),
waits for the job and checks its output and checkpoint. The daemons it started are always
stopped. Without the binaries or without root (slurmd must run as root to launch jobs) it skips.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

REPO = Path(__file__).resolve().parents[1]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "srun")

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.environ.get("HPCTRAIN_TEST_SLURM") != "1",
        reason="starts a real Slurm cluster: run it with `make test-slurm` (sets HPCTRAIN_TEST_SLURM=1)",
    ),
]


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / name).exists()), None
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(tmp: Path, host: str, cpus: int) -> str:
    # linuxproc/none: no cgroups needed, so it runs in containers; cons_tres allocates cores.
    return f"""\
ClusterName=hpctrain-test
FirstJobId={_first_job_id()}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={tmp}/munge/munge.socket
StateSaveLocation={tmp}/ctld
SlurmdSpoolDir={tmp}/slurmd
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
GresTypes=gpu
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


#: GPUs the test node declares (gres.conf over empty files standing in for devices): a job can ask for them, as
#: hybrid.sbatch does, and gets Slurm's GPU variables but no GPU: what a GPU job sees when CuPy or
#: the driver is missing on its nodes.
GPUS = 4


def _first_job_id() -> int:
    """Job ids that no earlier test cluster on this machine used. MPICH under srun names a job
    step's shared memory after its PMI job and step (``/dev/shm/mpich_shm_<hash>_0``) and leaves it
    behind when the step's ranks die; a later cluster counting from job 1 again reached the same
    name and failed in MPI_Init ("MPIDI_POSIX_comm_bootstrap: Out of memory"), every run after."""
    return 1 + int(time.time() * 10) % 60_000_000


class Cluster:
    """The daemons of a one-node Slurm; ``stop()`` ends exactly the processes it started."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.env = dict(os.environ, SLURM_CONF=str(tmp / "slurm.conf"))
        self.host = socket.gethostname().split(".")[0]

    def start(self) -> None:
        (self.tmp / "slurmd").mkdir()
        (self.tmp / "slurm.conf").write_text(_slurm_conf(self.tmp, self.host, os.cpu_count() or 1))
        for i in range(GPUS):  # (a gres without device files is counted 0: the node would be drained)
            (self.tmp / f"gpu{i}").touch()
        (self.tmp / "gres.conf").write_text(f"AutoDetect=off\nNodeName={self.host} Name=gpu "
                                            f"File={self.tmp}/gpu[0-{GPUS - 1}]\n")
        self._start_munge()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.tmp / "slurm.conf")])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 60, "slurmctld to answer")
        self._spawn("slurmd", [_which("slurmd"), "-D", "-N", self.host, "-f", str(self.tmp / "slurm.conf")])
        self._wait(lambda: self.node_state().startswith("idle"), 90, "the node to become idle")

    def _start_munge(self) -> None:
        """A munged of this cluster's own (a fresh key, its own socket) and slurmctld's state
        directory: what every Slurm daemon of the cluster needs before it starts."""
        munge = self.tmp / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.tmp / "ctld").mkdir()
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                               f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"])
        self._wait(lambda: (munge / "munge.socket").exists(), 20, "munged to open its socket")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.tmp / f"{name}.stdout", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc))

    def _wait(self, ready, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {seconds:.0f} s waiting for {what}\n{self.logs()}")

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def node_state(self) -> str:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        return out.stdout.strip() if out.returncode == 0 else ""

    def logs(self) -> str:
        parts = []
        for f in sorted(self.tmp.glob("*.log")) + sorted(self.tmp.glob("*.stdout")) + [self.tmp / "munge/munged.log"]:
            if f.exists():
                parts.append(f"--- {f.name} (tail)\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(parts)

    def stop(self) -> None:
        # Reverse order: slurmd before slurmctld before munged; each gets SIGTERM, then SIGKILL.
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=15)
        self.procs.clear()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [d for d in DAEMONS if _which(d) is None]
    if missing:
        pytest.skip(f"Slurm/munge not installed (missing {', '.join(missing)}): `make test-slurm` installs them")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to launch jobs; run `make test-slurm` as root")
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        _warm_up(c)
        yield c
    finally:
        c.stop()


def _warm_up(cluster: Cluster, seconds: float = 60) -> None:
    """Run (and if need be cancel) one MPI job step before the tests.

    On this single-node test cluster the first MPI job step after slurmd starts fails in
    MPI_Init (MPICH 5.0.2 over srun --mpi=pmi2: UCX "failed to unpack address, invalid bandwidth
    0.00" on one rank while the other hangs in init), whatever the script; every later step is
    fine. That is the test cluster's start-up, not what the tests check, so it is taken here.
    """
    sub = cluster.run("sbatch", "--parsable", "--ntasks=2", "--time=2", "--output=/dev/null", "--wrap",
                      f"srun --mpi=pmi2 {sys.executable} -c 'from mpi4py import MPI'", check=False)
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + seconds
    while job and time.monotonic() < deadline:
        q = cluster.run("scontrol", "show", "job", job, check=False).stdout
        state = next((w.split("=", 1)[1] for w in q.split() if w.startswith("JobState=")), "")
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return
        time.sleep(1)
    if job:
        cluster.run("scancel", job, check=False)
        time.sleep(5)


def _sbatch_and_wait(cluster: Cluster, workdir: Path, script: Path, *args: str, options: tuple[str, ...] = (),
                     timeout: float = 400) -> tuple[str, str]:
    """Submit ``script`` on 2 tasks of the node and wait for it to leave the queue.

    Returns (final state, job output). ``options`` are extra sbatch options; ``args`` go to the
    script. The venv is this interpreter's (the repository's .venv under ``make test-slurm``).
    """
    out_file = workdir / "job.out"
    cluster.env["HPCTRAIN_VENV"] = os.environ.get("HPCTRAIN_VENV", str(Path(sys.executable).parents[1]))
    sub = cluster.run("sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                      f"--chdir={workdir}", f"--output={out_file}", "--time=10", *options, str(script), *args)
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        q = cluster.run("scontrol", "show", "job", job, check=False).stdout
        state = next((w.split("=", 1)[1] for w in q.split() if w.startswith("JobState=")), "")
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            break
        time.sleep(1)
    else:
        cluster.run("scancel", job, check=False)
        pytest.fail(f"job {job} still {state} after {timeout:.0f} s\n{cluster.logs()}")
    text = out_file.read_text(errors="replace") if out_file.exists() else "(no output file)"
    # A broken line in the script does not fail the job when a later line succeeds: look for it.
    assert "command not found" not in text and "syntax error" not in text, text
    return state, text


def test_train_sbatch_two_tasks(cluster, tmp_path):
    """train.sbatch on 2 tasks: one MPI world of 2 ranks trains and leaves a checkpoint."""
    run_dir = tmp_path / "run"
    cluster.env["HPCTRAIN_RUN_DIR"] = str(run_dir)
    state, out = _sbatch_and_wait(cluster, tmp_path, REPO / "slurm" / "train.sbatch", "--epochs", "2")
    assert state == "COMPLETED", f"job ended {state}\n--- job output\n{out}\n{cluster.logs()}"
    # `hpctrain info` under srun: one MPI world of 2 ranks (not two singletons).
    assert "world size       : 2" in out, out
    assert "2 ranks, 1 thread(s) each, GPUs per node: none asked" in out, out  # OMP_NUM_THREADS = --cpus-per-task
    assert "GPUs allocated but not used" not in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == {"dp": 2, "tp": 1, "pp": 1}, summary
    assert summary["steps"] > 0 and summary["val_accuracy"] > 0.5, summary
    ckpt = Path(summary["checkpoint"])
    assert ckpt.parent == run_dir / "checkpoints" and ckpt.exists(), summary
    assert f"checkpoint      {ckpt}" in out, out  # the job's own summary names it
    with h5py.File(ckpt, "r") as f:
        assert json.loads(f.attrs["layout"])["dp"] == 2
        assert f.attrs["format"] == "hpctrain-checkpoint"


def test_hybrid_sbatch_tp2(cluster, tmp_path):
    """hybrid.sbatch with TP=2 on the 2 tasks: a (small) GPT trains tensor parallel under srun. It
    asks for a GPU per rank; the test node's are declared only, so the job says loudly that it
    trains on the CPU with GPUs allocated (issue 45, item 11)."""
    run_dir = tmp_path / "run"
    cluster.env.update(HPCTRAIN_RUN_DIR=str(run_dir), TP="2", PP="1")
    small = ("--n-layers", "1", "--d-model", "32", "--n-heads", "4", "--block-size", "16", "--batch-size", "16",
             "--max-samples", "128", "--epochs", "1")
    state, out = _sbatch_and_wait(cluster, tmp_path, REPO / "slurm" / "hybrid.sbatch", *small,
                                  options=("--gpus-per-node=2",))
    assert state == "COMPLETED", f"job ended {state}\n--- job output\n{out}\n{cluster.logs()}"
    assert "2 ranks = tp 2 x pp 1 x dp 1, 1 thread(s) each, GPUs per node: 2" in out, out
    assert re.search(r"WARNING: GPUs allocated but not used: the Slurm allocation gives this job GPUs "
                     r"\(SLURM_\w+=\S+ on rank 0\), but rank\(s\) 0-1 see none .*TRAINING ON THE CPU", out), out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["model"], summary["layout"]) == ("gpt", {"dp": 1, "tp": 2, "pp": 1}), summary
    assert Path(summary["checkpoint"]).exists()


def test_test_sbatch_runs_pytest_under_srun(cluster, tmp_path):
    """test.sbatch: pytest --with-mpi on 2 ranks (one test file, from the repository)."""
    cluster.env.pop("TP", None)
    state, out = _sbatch_and_wait(cluster, tmp_path, REPO / "slurm" / "test.sbatch", "tests/test_grid.py",
                                  options=(f"--chdir={REPO}",))
    assert state == "COMPLETED", f"job ended {state}\n--- job output\n{out}\n{cluster.logs()}"
    # One world of 2 ranks (hpctrain info says so; the pytest plugin agreed over both), one report.
    assert "world size       : 2" in out and "MPI: 2 ranks" in out, out
    assert out.count(" passed") == 1, out


def test_example_sbatch_runs_the_array_script_under_srun(cluster, tmp_path):
    """examples/train_arrays.sbatch: the library example (examples/train_arrays.py) on 2 ranks."""
    cluster.env.pop("TP", None)
    state, out = _sbatch_and_wait(cluster, tmp_path, REPO / "examples" / "train_arrays.sbatch", "2",
                                  options=(f"--chdir={REPO}",))
    assert state == "COMPLETED", f"job ended {state}\n--- job output\n{out}\n{cluster.logs()}"
    assert "on 2 rank(s), 32 steps per epoch of 64 samples" in out, out


def _job_state(cluster: Cluster, job: str) -> tuple[str, int]:
    q = cluster.run("scontrol", "show", "job", job, check=False).stdout
    fields = dict(w.split("=", 1) for w in q.split() if "=" in w)
    return fields.get("JobState", ""), int(fields.get("Restarts", "0") or 0)


def _steps_logged(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


# A small GPT on the built-in corpus: 912 steps, 4-10 s of training on 2-4 ranks here, long enough to
# interrupt even on a quiet machine (4 epochs once ended in 0.8 s, before the USR1 reached it).
_SMALL_GPT = ("--model", "gpt", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--block-size", "32",
              "--batch-size", "16", "--epochs", "16", "--max-samples", "1600", "--checkpoint-every", "25",
              "--log-every", "50")


def test_preempted_job_is_requeued_and_ends_where_an_uninterrupted_run_ends(cluster, tmp_path):
    """``scancel --batch --signal=USR1`` (what ``--signal=B:USR1@N`` sends at the time limit) mid-run:
    the script forwards it, the ranks stop with a checkpoint (exit 75), the script requeues the job,
    and the requeued job resumes and finishes with the loss an uninterrupted run ends with."""
    preempt_and_requeue(cluster, tmp_path)


def preempt_and_requeue(cluster: Cluster, tmp_path: Path, nodes: int = 1, per_node: int = 2) -> None:
    """The preemption test on ``nodes`` x ``per_node`` tasks (test_two_nodes runs it on two nodes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPIR_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1")  # the same BLAS threading in both runs: bitwise comparable
    ref_dir = tmp_path / "ref"
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    ref = subprocess.run([mpiexec, "-n", str(nodes * per_node), sys.executable, "-m", "hpctrain", "train",
                          "--strategy", "dp", *_SMALL_GPT, "--run-dir", str(ref_dir)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    want = json.loads((ref_dir / "summary.json").read_text())

    run_dir = tmp_path / "run"
    cluster.env.update(HPCTRAIN_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1")
    cluster.env["HPCTRAIN_VENV"] = os.environ.get("HPCTRAIN_VENV", str(Path(sys.executable).parents[1]))
    out_file = tmp_path / "job.out"
    sub = cluster.run("sbatch", "--parsable", f"--nodes={nodes}", f"--ntasks-per-node={per_node}",
                      "--cpus-per-task=1", f"--chdir={tmp_path}", f"--output={out_file}", "--time=10",
                      str(REPO / "slurm" / "train.sbatch"), *_SMALL_GPT)
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 400
    signalled = False
    state, restarts = "", 0
    while time.monotonic() < deadline:
        state, restarts = _job_state(cluster, job)
        if not signalled and state == "RUNNING" and _steps_logged(run_dir) >= 10:
            cluster.run("scancel", "--batch", "--signal=USR1", job)
            signalled = True
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.1)
    else:
        cluster.run("scancel", job, check=False)
        pytest.fail(f"job {job} still {state} after 400 s\n{cluster.logs()}")
    out = out_file.read_text(errors="replace") if out_file.exists() else "(no output file)"
    assert signalled, f"the job ended ({state}) before it logged 10 steps\n{out}"
    assert state == "COMPLETED" and restarts == 1, f"job {job}: {state}, {restarts} restarts\n{out}\n{cluster.logs()}"
    # --open-mode=append: both runs of the job in one output file.
    assert "job " + job + " (restart 0)" in out and "job " + job + " (restart 1)" in out, out
    assert "got SIGUSR1; asking the ranks to stop" in out and "requeueing it to resume" in out, out
    stopped = re.search(r"preempted on SIGUSR1: stopped at step (\d+); checkpoint (\S+?);", out)
    assert stopped, out
    step = int(stopped.group(1))
    assert f"resumed from {stopped.group(2)} at step {step}" in out, out
    got = json.loads((run_dir / "summary.json").read_text())
    assert got["steps"] == want["steps"] and 0 < step < want["steps"], (got, want, step)
    assert got["final_loss"] == want["final_loss"] and got["val_loss"] == want["val_loss"], (got, want)
    with h5py.File(got["checkpoint"], "r") as a, h5py.File(want["checkpoint"], "r") as b:
        for name in b["model"]:
            assert (a["model"][name][()] == b["model"][name][()]).all(), name  # bitwise
    # The metrics of the whole run: one line per step, none twice after the resume.
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, want["steps"] + 1))
