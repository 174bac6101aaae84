"""``hpctrain train --device auto|cpu|cuda --backend mpi|nccl``: the CPU path, and cuda refused on
every rank with a clear message where there is no GPU (the GPU path runs in the gpu tests)."""

from __future__ import annotations

import os

import pytest

from hpctrain import backend, errors
from hpctrain.cli import main
from hpctrain.job import resolve, run

SMALL = {"epochs": 1, "d_model": 16, "log_every": 1000}


def small(comm) -> dict:
    """4 steps of a global batch that splits over any world size."""
    return {**SMALL, "batch_size": 8 * comm.size, "max_samples": 32 * comm.size}
no_gpu = pytest.mark.skipif(backend.gpu_available(), reason="this machine has a GPU: the refusal cannot happen")
needs_gpu = pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and an NVIDIA GPU")


def test_backend_nccl_needs_cuda():
    with pytest.raises(errors.ConfigError, match="--backend nccl reduces on GPUs: it needs --device cuda"):
        resolve({"device": "cpu", "backend": "nccl"}, world=2)
    with pytest.raises(errors.ConfigError, match="--strategy ps talks through MPI windows"):
        resolve({"strategy": "ps", "backend": "nccl"}, world=2)


@no_gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_cuda_refused_on_every_rank_without_a_gpu(comm, shared_dir, capsys):
    with pytest.raises(errors.ConfigError, match="--device cuda: no usable GPU here") as exc:
        run({**small(comm), "device": "cuda", "run_dir": os.path.join(shared_dir, "c")}, comm)
    assert f"ranks 0-{comm.size - 1}" in str(exc.value)  # every rank said why, none is left waiting
    argv = ["train", "--device", "cuda", "--batch-size", str(8 * comm.size), "--run-dir", os.path.join(shared_dir, "d")]
    assert main(argv) == errors.ExitStatus.CONFIG
    err = capsys.readouterr().err
    assert comm.rank != 0 or "--device cuda: no usable GPU here" in err  # said once, by rank 0
    assert not os.path.exists(os.path.join(shared_dir, "c", "checkpoints"))  # refused before training
    with pytest.raises(errors.ConfigError, match="--backend nccl needs a GPU on every rank"):
        run({**small(comm), "backend": "nccl", "run_dir": os.path.join(shared_dir, "n")}, comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cpu_path(comm, shared_dir, device):
    s = run({**small(comm), "device": device, "run_dir": os.path.join(shared_dir, device)}, comm)
    assert s["device"] == ("cuda" if device == "auto" and backend.gpu_available() else "cpu")
    assert s["steps"] == 4


@needs_gpu
@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nccl", [False, True], ids=["mpi", "nccl"])
def test_cuda_matches_cpu(comm, shared_dir, nccl):
    gpus = backend.cupy().cuda.runtime.getDeviceCount()
    if nccl and gpus < comm.size:
        pytest.skip(f"NCCL needs one GPU per rank: {comm.size} ranks, {gpus} GPU(s)")
    extra = {"backend": "nccl"} if nccl else {}
    gpu = run({**small(comm), "device": "cuda", **extra, "run_dir": os.path.join(shared_dir, f"gpu{nccl}")}, comm)
    cpu = run({**small(comm), "device": "cpu", "run_dir": os.path.join(shared_dir, f"cpu{nccl}")}, comm)
    assert gpu["device"] == "cuda"
    assert gpu["val_loss"] == pytest.approx(cpu["val_loss"], rel=1e-3)
