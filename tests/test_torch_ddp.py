"""hpctrain.torch.DistributedDataParallel under real mpiexec: the mean over the global batch, as one
process and as torch's DDP over gloo compute it; overlap, no copies, no_sync; bad input refused
with one error on every rank (issue 39)."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

import hpctrain.torch as htt  # noqa: E402
from hpctrain.errors import MismatchError  # noqa: E402
from torchkit import batches, gloo, max_diff, mlp, share, train  # noqa: E402

SMALL = 16 * 16 * 8 / 2**20  # bytes of the middle weight: several buckets for the MLP


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_equals_one_process_on_the_global_batch(comm, opt):
    def make(params):
        return (torch.optim.SGD(params, lr=0.1, momentum=0.9) if opt == "sgd"
                else torch.optim.AdamW(params, lr=0.05, weight_decay=0.1))

    data = batches(4)
    model = mlp(seed=comm.rank)  # rank 0's initial values reach every rank
    ddp = htt.DistributedDataParallel(model, comm, bucket_mb=SMALL)
    train(ddp, make(ddp.parameters()), data, comm.rank, comm.size)
    ref = mlp(seed=0)
    train(ref, make(ref.parameters()), data)
    assert max_diff(model, ref) < 1e-12
    assert len(ddp.buckets.buckets) >= 3
    assert ddp.overlapped >= 1  # a bucket's all-reduce started from a hook while backward went on


@pytest.mark.mpi(min_size=2)
def test_buckets_in_reverse_registration_order_and_grads_in_them(comm):
    model = mlp()
    ddp = htt.DistributedDataParallel(model, comm, bucket_mb=SMALL)
    names = [n for n, _ in model.named_parameters()]
    packed = [p.name for p in ddp.buckets.params]
    assert packed == names  # packed as registered, started in reverse (the last layer's first)
    x, y = batches(1)[0]
    torch.nn.functional.mse_loss(ddp(share(x, comm.rank, comm.size)), share(y, comm.rank, comm.size)).backward()
    assert ddp.buckets.adopt_order() == sorted(range(len(ddp.buckets.buckets)), reverse=True)
    for b in ddp.buckets.buckets:  # the gradients torch sees are the buffers MPI reduced: no copy
        lo, hi = b.flat.ctypes.data, b.flat.ctypes.data + b.flat.nbytes
        for p in b.params:
            assert lo <= p.param.grad.data_ptr() < hi


@pytest.mark.mpi(min_size=2)
def test_no_sync_accumulates_and_the_next_backward_reduces_the_sum(comm):
    (x1, y1), (x2, y2) = batches(2)
    model = mlp()
    ddp = htt.DistributedDataParallel(model, comm, bucket_mb=SMALL)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.no_sync():
        torch.nn.functional.mse_loss(ddp(share(x1, comm.rank, comm.size)), share(y1, comm.rank, comm.size)).backward()
    assert ddp.buckets.buckets[0].request is None  # nothing was communicated
    torch.nn.functional.mse_loss(ddp(share(x2, comm.rank, comm.size)), share(y2, comm.rank, comm.size)).backward()
    opt.step()
    ref = mlp()
    (torch.nn.functional.mse_loss(ref(x1), y1) + torch.nn.functional.mse_loss(ref(x2), y2)).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert max_diff(model, ref) < 1e-12


@pytest.mark.mpi(min_size=2)
def test_set_to_none_and_in_place_zeroing_give_the_same(comm):
    data = batches(3)
    runs = []
    for set_to_none in (True, False):
        model = mlp()
        ddp = htt.DistributedDataParallel(model, comm, bucket_mb=SMALL)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad(set_to_none=set_to_none)
            torch.nn.functional.mse_loss(ddp(share(x, comm.rank, comm.size)), share(y, comm.rank, comm.size)).backward()
            opt.step()
        runs.append(model)
    assert max_diff(*runs) == 0.0


class _Branches(torch.nn.Module):
    """Two heads; ``forward(x, which)`` uses one: the other gets no gradient on this rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
        self.double()

    def forward(self, x, which):
        return (self.a if which == "a" else self.b)(torch.tanh(self.body(x)))


@pytest.mark.mpi(min_size=2)
def test_unused_parameters_count_as_zero_or_stay_none_everywhere(comm):
    x = torch.ones(2, 4, dtype=torch.float64)
    for find in (False, True):
        model = _Branches()
        ddp = htt.DistributedDataParallel(model, comm, find_unused_parameters=find)
        ddp(x, "a").sum().backward()  # b unused on every rank
        assert (model.b.weight.grad is None) == find
        if not find:
            assert float(model.b.weight.grad.abs().sum()) == 0.0
        ddp2 = htt.DistributedDataParallel(_Branches(), comm, find_unused_parameters=find)
        ddp2(x, "a" if comm.rank == 0 else "b").sum().backward()  # each head used on some rank
        assert ddp2.module.b.weight.grad is not None
        ref = _Branches()
        (ref(x, "a").sum() / comm.size + (ref(x, "b").sum() * (comm.size - 1) / comm.size)).backward()
        for p, q in zip(ddp2.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)


@pytest.mark.mpi(min_size=1)
def test_a_parameter_frozen_mid_run_stops_moving_as_in_one_process(comm):
    # Frozen after two steps (fine-tuning): no gradient from then on, so AdamW (weight decay, moments)
    # leaves it alone, as it does in one process; the reduction still pairs (it sends a zero).
    data = batches(4)
    model = mlp()
    ddp = htt.DistributedDataParallel(model, comm, bucket_mb=SMALL)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.05, weight_decay=0.1)
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    train(ddp, opt, data[:2], comm.rank, comm.size)
    train(ref, ref_opt, data[:2])
    model[0].weight.requires_grad_(False)
    ref[0].weight.requires_grad_(False)
    before = model[0].weight.detach().clone()
    train(ddp, opt, data[2:], comm.rank, comm.size)
    train(ref, ref_opt, data[2:])
    assert model[0].weight.grad is None and ref[0].weight.grad is None
    assert torch.equal(model[0].weight, before)
    assert max_diff(model, ref) < 1e-12


@pytest.mark.mpi(min_size=2)
def test_no_sync_on_some_ranks_only_is_one_error_on_every_rank_at_once(comm):
    # Rank 0 accumulates one micro-batch more than the others: its reduction would pair with their
    # next one, a hang until the stall watchdog. Every rank raises at the end of the paired backward.
    import time

    comm.set_timeout(60)  # before the check: the watchdog's report after 60 s, not an error
    (x1, y1), (x2, y2) = batches(2)
    ddp = htt.DistributedDataParallel(mlp(), comm, bucket_mb=SMALL)
    t0 = time.monotonic()
    with pytest.raises(MismatchError, match=r"ranks ran different numbers of backwards under ddp.no_sync\(\) before "
                                            r"this synchronised one \(0 to 1; this rank [01]\)"):
        for i, (x, y) in enumerate([(x1, y1), (x2, y2)]):
            ctx = ddp.no_sync() if comm.rank == 0 and i == 0 else contextlib.nullcontext()
            with ctx:
                torch.nn.functional.mse_loss(ddp(share(x, comm.rank, comm.size)), share(y, comm.rank, comm.size)
                                             ).backward()
    assert time.monotonic() - t0 < 30
    # The wrapper goes on once the ranks agree again.
    torch.nn.functional.mse_loss(ddp(share(x1, comm.rank, comm.size)), share(y1, comm.rank, comm.size)).backward()


@pytest.mark.mpi(min_size=2)
def test_parameters_frozen_on_some_ranks_only_are_refused_on_every_rank(comm):
    model = mlp()
    ddp = htt.DistributedDataParallel(model, comm, bucket_mb=SMALL)
    model[2].bias.requires_grad_(comm.rank != 0)
    x, y = batches(1)[0]
    with pytest.raises(MismatchError, match="the ranks froze different parameters"):
        torch.nn.functional.mse_loss(ddp(share(x, comm.rank, comm.size)), share(y, comm.rank, comm.size)).backward()


@pytest.mark.mpi(min_size=2)
def test_buffers_are_rank_0s_at_each_training_forward(comm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).double()
    ddp = htt.DistributedDataParallel(model, comm)
    x = torch.randn(8, 4, dtype=torch.float64) + comm.rank  # each rank's own statistics
    ddp(x).sum().backward()
    mean0 = comm.bcast_obj(model[1].running_mean.clone())
    ddp(x)  # broadcast first: every rank starts from rank 0's, then adds its own batch
    expect = 0.9 * mean0 + 0.1 * model[0](x).detach().mean(0)
    torch.testing.assert_close(model[1].running_mean, expect, rtol=0, atol=1e-12)


# -- the same run as torch's own DDP over gloo -------------------------------------------------------


@pytest.fixture(scope="module")
def gloo_group():
    import torch.distributed as dist

    from hpctrain import Communicator

    gloo(Communicator())
    yield
    dist.destroy_process_group()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero_grad", ["none", "zeros"])
def test_equals_torch_ddp_over_gloo(comm, gloo_group, zero_grad):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    data = batches(4)
    runs = []
    for wrap in (lambda m: htt.DistributedDataParallel(m, comm, bucket_mb=SMALL),
                 lambda m: TorchDDP(m, bucket_cap_mb=SMALL)):
        model = mlp(seed=comm.rank)
        ddp = wrap(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.05)
        for x, y in data:
            opt.zero_grad(set_to_none=zero_grad == "none")
            torch.nn.functional.mse_loss(ddp(share(x, comm.rank, comm.size)), share(y, comm.rank, comm.size)).backward()
            opt.step()
        runs.append(model)
    assert max_diff(*runs) < 1e-12


# -- bad input: one clear error on every rank -----------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_parameters_differing_in_shape_are_refused_on_every_rank(comm):
    model = mlp(width=16 if comm.rank == 0 else 17)
    with pytest.raises(MismatchError, match=r"ranks disagree on DistributedDataParallel's module .*first "
                                            r"difference \(rank 0 vs rank 1\): parameters\[0\]"):
        htt.DistributedDataParallel(model, comm)


@pytest.mark.mpi(min_size=2)
def test_parameters_in_another_order_are_refused_on_every_rank(comm):
    class Two(torch.nn.Module):
        def __init__(self, first: str) -> None:
            super().__init__()
            for name in (first, "v" if first == "u" else "u"):
                setattr(self, name, torch.nn.Linear(4, 4))

    with pytest.raises(MismatchError, match=r"parameters\[0\]\[0\]: 'u.weight' != 'v.weight'"):
        htt.DistributedDataParallel(Two("u" if comm.rank == 0 else "v"), comm)


@pytest.mark.mpi(min_size=2)
def test_a_module_without_trainable_parameters_is_refused_on_every_rank(comm):
    frozen = mlp()
    for p in frozen.parameters():
        p.requires_grad_(comm.rank != 0)  # rank 0 alone: every rank must still say it
    with pytest.raises(ValueError, match=r"DistributedDataParallel: rank 0: the module has no trainable parameters"):
        htt.DistributedDataParallel(frozen, comm)
    with pytest.raises(ValueError, match="ranks 0-.*: the module has no trainable parameters"):
        htt.DistributedDataParallel(torch.nn.ReLU(), comm)


def test_bad_arguments_are_refused_before_any_communication():
    with pytest.raises(TypeError, match="wraps a torch.nn.Module"):
        htt.DistributedDataParallel(lambda x: x)
    with pytest.raises(ValueError, match="bucket_mb must be a number > 0"):
        htt.DistributedDataParallel(mlp(), bucket_mb=0)
    model = torch.nn.Embedding(4, 2, sparse=True).double()
    ddp = htt.DistributedDataParallel(model)
    with pytest.raises(RuntimeError, match="sparse gradient"):
        ddp(torch.tensor([1, 2])).sum().backward()



@pytest.mark.mpi(min_size=2)
def test_settings_differing_across_ranks_are_refused_on_every_rank(comm):
    # Another bucket size packs other buckets (their all-reduces would not match): refused.
    with pytest.raises(MismatchError, match=r"and settings: .*first difference .*: bucket_mb: 1.0 != 2.0"):
        htt.DistributedDataParallel(mlp(), comm, bucket_mb=1.0 if comm.rank == 0 else 2.0)
    with pytest.raises(MismatchError, match="find_unused_parameters: False != True"):
        htt.DistributedDataParallel(mlp(), comm, find_unused_parameters=comm.rank != 0)


def test_a_module_cast_after_wrapping_is_said():
    model = mlp()
    ddp = htt.DistributedDataParallel(model)
    model.float()
    with pytest.raises(RuntimeError, match=r"parameter 4.bias has a torch.float32 gradient on cpu, its bucket is "
                                           r"torch.float64 on cpu: move or cast the module before wrapping it"):
        ddp(torch.ones(2, 6)).sum().backward()
