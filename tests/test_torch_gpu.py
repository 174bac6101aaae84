"""hpctrain.torch on CUDA tensors (the ``gpu`` set): the gradients reduced through hpctrain's device
path (direct when the MPI is CUDA-aware, staged through pinned host buffers otherwise), ZeRO-1 and
checkpoints, each equal to the same run on the CPU. Skipped without a GPU, torch's CUDA and CuPy."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import hpctrain.torch as htt  # noqa: E402
from hpctrain import backend  # noqa: E402
from torchkit import batches, mlp, share, train  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available() or backend.cupy() is None,
                                 reason="needs an NVIDIA GPU, torch's CUDA build and CuPy")]


def _device(comm) -> torch.device:
    return torch.device("cuda", comm.local_rank % torch.cuda.device_count())


@pytest.mark.parametrize("staged", [True, False])
def test_cuda_gradients_equal_the_cpu_run(comm, staged):
    dev = _device(comm)
    data = batches(3)
    model = mlp().to(dev)
    ddp = htt.DistributedDataParallel(model, comm, bucket_mb=16 * 16 * 8 / 2**20)
    if staged:  # what a non-CUDA-aware MPI does: copies through pinned host buffers
        comm._force_staging = True
    try:
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.05)
        train(ddp, opt, [(x.to(dev), y.to(dev)) for x, y in data], comm.rank, comm.size)
    finally:
        comm._force_staging = False
    ref = mlp()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=0.05), data)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=0, atol=1e-10)
    g = next(model.parameters()).grad
    assert g.is_cuda and any(b.flat.data.ptr <= g.data_ptr() < b.flat.data.ptr + b.flat.nbytes
                             for b in ddp.buckets.buckets)  # the gradient is the bucket, on the GPU


def test_cuda_zero1_and_checkpoint_round_trip(comm, shared_dir):
    dev = _device(comm)
    data = batches(3)
    model = mlp().to(dev)
    ddp = htt.DistributedDataParallel(model, comm)
    opt = htt.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, comm, lr=0.05)
    for x, y in data[:2]:
        train(ddp, opt, [(x.to(dev), y.to(dev))], comm.rank, comm.size)
    path = htt.save(shared_dir, step=2, model=ddp, optimizer=opt)
    cpu = mlp(seed=3)
    cpu_opt = torch.optim.AdamW(cpu.parameters(), lr=0.05)
    htt.load(path, comm=comm.split(comm.rank), model=cpu, optimizer=cpu_opt)
    for p, q in zip(model.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=0, atol=0)
    x, y = data[2]
    train(ddp, opt, [(x.to(dev), y.to(dev))], comm.rank, comm.size)
    train(cpu, cpu_opt, [(x, y)])
    for p, q in zip(model.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=0, atol=1e-10)


def test_cuda_buckets_reach_the_host_only_when_mpi_is_not_cuda_aware(comm):
    dev = _device(comm)
    model = mlp().to(dev)
    ddp = htt.DistributedDataParallel(model, comm)
    before = dict(backend.transfer_counts)
    x, y = batches(1)[0]
    torch.nn.functional.mse_loss(ddp(share(x, comm.rank, comm.size).to(dev)),
                                 share(y, comm.rank, comm.size).to(dev)).backward()
    moved = backend.transfer_counts["to_host"] - before["to_host"]
    assert moved == (0 if comm.cuda_aware else len(ddp.buckets.buckets))
