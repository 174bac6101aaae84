"""hpctrain.torch.ZeroRedundancyOptimizer (ZeRO-1 for torch optimizers) under real mpiexec: the run of
one process with the whole optimizer, each rank holding only its piece of the state (issue 39)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import hpctrain.torch as htt  # noqa: E402
from hpctrain.errors import MismatchError  # noqa: E402
from torchkit import batches, max_diff, mlp, train  # noqa: E402


def _groups(model):
    """Two groups: weight decay on the matrices only (what GPT recipes do)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_zero1_equals_one_process_with_its_state_sharded(comm, kind):
    klass, kw = ((torch.optim.AdamW, {"lr": 0.05}) if kind == "adamw"
                 else (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
    data = batches(4)
    model = mlp(seed=comm.rank)
    ddp = htt.DistributedDataParallel(model, comm)
    opt = htt.ZeroRedundancyOptimizer(_groups(model), klass, comm, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # read by the pieces at each step
    ref = mlp(seed=0)
    ref_opt = klass(_groups(ref), **kw)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for x, y in data:
        train(ddp, opt, [(x, y)], comm.rank, comm.size)
        train(ref, ref_opt, [(x, y)])
        sched.step()
        ref_sched.step()
    assert max_diff(model, ref) < 1e-12
    # Only this rank's piece of the state is here: about 1/size of the model's elements per key.
    total = sum(p.numel() for p in model.parameters())
    held = sum(v.numel() for st in opt.local.state.values() for k, v in st.items() if k != "step")
    keys = 2 if kind == "adamw" else 1
    assert held == keys * opt.layout.counts[comm.rank] and held <= keys * (total // comm.size + 1)
    # The full state (collective) is the one process's.
    full, want = opt.state_dict(), ref_opt.state_dict()
    assert full["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(full["state"][i][k], v, rtol=0, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_zero1_state_dict_loads_into_any_dp_size(comm):
    data = batches(3)
    model = mlp()
    opt = htt.ZeroRedundancyOptimizer(htt.DistributedDataParallel(model, comm).parameters(), torch.optim.AdamW, comm,
                                      lr=0.05)
    train(model, opt, data[:2], comm.rank, comm.size)
    full = opt.state_dict()
    # Alone (dp=1, every rank for itself) from the full state dict: the same next step.
    alone = comm.split(comm.rank)
    m1 = mlp()
    m1.load_state_dict(model.state_dict())
    o1 = htt.ZeroRedundancyOptimizer(m1.parameters(), torch.optim.AdamW, alone, lr=0.05)
    o1.load_state_dict(full)
    plain = mlp()
    plain.load_state_dict(model.state_dict())
    o2 = torch.optim.AdamW(plain.parameters(), lr=0.05)
    o2.load_state_dict(copy.deepcopy(full))  # torch's load keeps the tensors it is given
    train(m1, o1, data[2:])
    train(plain, o2, data[2:])
    assert max_diff(m1, plain) < 1e-12


@pytest.mark.mpi(min_size=2)
def test_zero1_refuses_what_a_flat_buffer_cannot_hold(comm):
    mixed = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="need one dtype and device"):
        htt.ZeroRedundancyOptimizer(mixed, torch.optim.SGD, comm, lr=0.1)
    with pytest.raises(MismatchError, match="ZeroRedundancyOptimizer's parameter groups"):
        htt.ZeroRedundancyOptimizer(mlp(width=8 + comm.rank).parameters(), torch.optim.SGD, comm, lr=0.1)
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer class"):
        htt.ZeroRedundancyOptimizer(mlp().parameters(), "adam", comm)
    opt = htt.ZeroRedundancyOptimizer(mlp().parameters(), torch.optim.SGD, comm, lr=0.1)
    with pytest.raises(NotImplementedError, match="after construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})


@pytest.mark.mpi(min_size=2)
def test_zero1_refuses_optimizers_that_are_not_elementwise(comm):
    # On a piece of the flattened parameters they compute something else (Adafactor's factored
    # moments, Muon's orthogonalisation) or cannot run at all (LBFGS): refused, saying why.
    for klass in (torch.optim.LBFGS, torch.optim.Adafactor, getattr(torch.optim, "Muon", torch.optim.LBFGS)):
        with pytest.raises(ValueError, match=rf"torch.optim.*{klass.__name__} is not one of torch's elementwise "
                                             r"optimizers \(SGD, Adam, AdamW.*\): use it without ZeRO, or"):
            htt.ZeroRedundancyOptimizer(mlp().parameters(), klass, comm, lr=0.1)

    class MySGD(torch.optim.SGD):  # a subclass may change the rule: it must say it is elementwise
        pass

    with pytest.raises(ValueError, match="MySGD is not one of torch's elementwise optimizers"):
        htt.ZeroRedundancyOptimizer(mlp().parameters(), MySGD, comm, lr=0.1)
    model, ref = mlp(), mlp()
    ddp = htt.DistributedDataParallel(model, comm)
    opt = htt.ZeroRedundancyOptimizer(ddp.parameters(), MySGD, comm, elementwise=True, lr=0.1)
    data = batches(2)
    train(ddp, opt, data, comm.rank, comm.size)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data)
    assert max_diff(model, ref) < 1e-12
