"""A job whose Slurm allocation has GPUs that its ranks cannot use says so loudly (issue 45, item
11): it trained on the CPU with only "on cpu" in its header. The allocation is read from Slurm's
variables (``backend.gpus_allocated``); the job is a real ``mpiexec -n 2 hpctrain train`` given
``SLURM_GPUS_ON_NODE`` on a machine whose ranks see no GPU (``slurm/`` and tests/test_slurm.py run
it under a real Slurm allocation of declared GPUs).
"""

from __future__ import annotations

import pytest

from hpctrain import backend
from hpctrain.job.runner import unused_gpus
from jobs import REPO, clean_env, hpctrain

TINY = ("--max-samples", "128", "--batch-size", "16", "--epochs", "1", "--d-model", "16", "--n-layers", "1",
        "--log-every", "1000")
no_gpu = pytest.mark.skipif(backend.gpu_available(), reason="this machine's ranks see a GPU: nothing to warn of")


@pytest.mark.parametrize("env,said", [
    ({}, None),
    ({"SLURM_GPUS_ON_NODE": "0"}, None),
    ({"SLURM_GPUS_ON_NODE": "4"}, "SLURM_GPUS_ON_NODE=4"),
    ({"SLURM_JOB_GPUS": "0"}, "SLURM_JOB_GPUS=0"),  # GPU index 0: one GPU
    ({"SLURM_STEP_GPUS": "2,3"}, "SLURM_STEP_GPUS=2,3"),
    ({"SLURM_GPUS_PER_NODE": "a100:2"}, "SLURM_GPUS_PER_NODE=a100:2"),
    ({"SLURM_GPUS_PER_NODE": "h100:0"}, None),
    ({"SLURM_GPUS_PER_TASK": "gpu:a100:1"}, "SLURM_GPUS_PER_TASK=gpu:a100:1"),
    ({"SLURM_GPUS": " "}, None),
])
def test_the_allocation_is_read_from_slurms_variables(monkeypatch, env, said):
    for name in backend.SLURM_GPU_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert backend.gpus_allocated() == said


def test_the_warning_names_the_variable_and_the_ranks_without_a_gpu():
    assert unused_gpus([(False, None, "no CuPy")] * 3) is None  # nothing asked for: a CPU job
    assert unused_gpus([(True, "SLURM_GPUS_ON_NODE=2", None)] * 2) is None  # asked and seen
    said = unused_gpus([(True, "SLURM_GPUS_ON_NODE=2", None), (False, None, "no CuPy"),
                        (False, "SLURM_GPUS_ON_NODE=2", "CuPy sees no GPU"), (False, "SLURM_GPUS_ON_NODE=2", "x")])
    assert said.startswith("WARNING: GPUs allocated but not used: the Slurm allocation gives this job GPUs "
                           "(SLURM_GPUS_ON_NODE=2 on rank 2), but rank(s) 2-3 see none (CuPy sees no GPU): "
                           "TRAINING ON THE CPU"), said
    assert "make gpu-check" in said and "--device cuda refuses" in said


@no_gpu
@pytest.mark.jobs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("allocated", [True, False])
def test_a_job_given_gpus_it_cannot_use_says_so_before_its_header(serial, tmp_path, allocated):
    env = clean_env(HPCTRAIN_DATA=str(tmp_path / "data"), **({"SLURM_GPUS_ON_NODE": "1"} if allocated else {}))
    p = hpctrain("train", *TINY, "--run-dir", str(tmp_path / "run"), n=2, cwd=REPO, timeout=200, env=env)
    assert p.returncode == 0, p.stderr
    warned = [line for line in (p.stdout + p.stderr).splitlines() if "GPUs allocated but not used" in line]
    if not allocated:
        assert warned == [], warned
        return
    assert len(warned) == 1, p.stdout + p.stderr  # rank 0's, once
    assert "(SLURM_GPUS_ON_NODE=1 on rank 0), but rank(s) 0-1 see none (" in warned[0], warned
    assert "on cpu" in p.stdout  # the header still says where it trains
