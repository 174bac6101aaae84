"""slurm/train.sbatch in a real Slurm: a single-node cluster started on this machine.

Run by ``make test-slurm`` (which installs Debian's ``slurmctld slurmd munge`` when missing and
sets HPCTRAIN_TEST_SLURM=1). The test writes a slurm.conf for this host, starts munged,
slurmctld and slurmd with every state file in a temporary directory, ``sbatch``es the
repository's slurm/train.sbatch with 2 tasks (``srun --mpi=pmi2`` launching the venv's MPICH),
waits for the job and checks its output and checkpoint. The daemons it started are always
stopped. Without the binaries or without root (slurmd must run as root to launch jobs) it skips.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class Cluster:
    """The daemons of a one-node Slurm; ``stop()`` ends exactly the processes it started."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.env = dict(os.environ, SLURM_CONF=str(tmp / "slurm.conf"))
        self.host = socket.gethostname().split(".")[0]

    def start(self) -> None:
        munge = self.tmp / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.tmp / "ctld").mkdir()
        (self.tmp / "slurmd").mkdir()
        (self.tmp / "slurm.conf").write_text(_slurm_conf(self.tmp, self.host, os.cpu_count() or 1))
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                               f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"])
        self._wait(lambda: (munge / "munge.socket").exists(), 20, "munged to open its socket")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.tmp / "slurm.conf")])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 60, "slurmctld to answer")
        self._spawn("slurmd", [_which("slurmd"), "-D", "-N", self.host, "-f", str(self.tmp / "slurm.conf")])
        self._wait(lambda: self.node_state().startswith("idle"), 90, "the node to become idle")

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
        yield c
    finally:
        c.stop()


def _sbatch_and_wait(cluster: Cluster, workdir: Path, script: Path, *args: str, ntasks: int = 2,
                     timeout: float = 400) -> tuple[str, str]:
    """Submit ``script`` and wait for it to leave the queue; return (final state, job output)."""
    out_file = workdir / "job.out"
    env_venv = os.environ.get("HPCTRAIN_VENV", str(Path(sys.executable).parents[1]))
    cluster.env["HPCTRAIN_VENV"] = env_venv
    sub = cluster.run("sbatch", "--parsable", f"--ntasks={ntasks}", "--nodes=1", f"--chdir={workdir}",
                      f"--output={out_file}", "--time=10", str(script), *args)
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
    return state, text


def test_train_sbatch_two_tasks(cluster, tmp_path):
    """train.sbatch on 2 tasks: both ranks in one MPI world, training ends with a checkpoint."""
    state, out = _sbatch_and_wait(cluster, tmp_path, REPO / "slurm" / "train.sbatch")
    assert state == "COMPLETED", f"job ended {state}\n--- job output\n{out}\n{cluster.logs()}"
    # `hpctrain info` under srun: one MPI world of 2 ranks (not two singletons).
    assert "world size       : 2" in out, out
