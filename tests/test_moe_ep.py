"""Expert parallelism under real MPI: an ``nn.MoE`` (and a GPT with MoE blocks) spread over every
rank of the world by ``expert_parallel`` computes what the one-process layer computes on all
ranks' tokens (float64 to 1e-10): outputs, the loss with its load-balancing term, the input and
router gradients (summed over the ranks: they are dp replicas) and each rank's expert slice of
the serial gradients. Dropless, at any world size that divides the experts (make test: -n 2, -n 4)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain import Communicator, ProcessGrid
from hpctrain.errors import MismatchError
from hpctrain.nn import GPT, MoE, recompute_blocks
from hpctrain.nn.moe import moe_layers, set_aux_group, set_aux_weight
from hpctrain.parallel import expert_parallel
from hpctrain.parallel.shards import full_state_dict, shard_map

F64 = np.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}
AUX = 0.05  # the aux weight each rank uses; the one process over all ranks' tokens uses AUX * size


def _world():
    return Communicator(MPI.COMM_WORLD)


def _check_params(serial, par, comm):
    """Expert parameters: this rank's slice of the serial gradient; the rest summed over the ranks."""
    ser = dict(serial.named_parameters())
    for name, (p, full, index) in shard_map(par).items():
        assert tuple(full) == ser[name].shape, name
        np.testing.assert_array_equal(p.data, ser[name].data[index], err_msg=f"{name} data")
        if p.shape != tuple(full):  # an expert slice: every rank's tokens are already in it
            np.testing.assert_allclose(p.grad, ser[name].grad[index], **TOL, err_msg=f"{name} grad")
        else:  # replicated (router, dense): each rank has its own tokens' share
            np.testing.assert_allclose(comm.allreduce(p.grad.copy()), ser[name].grad, **TOL, err_msg=f"{name} grad")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("ep", ["2", "world"])
def test_moe_layer_under_ep_equals_one_process(top_k, ep):
    world = _world()
    if ep == "world" and world.size == 2:
        pytest.skip("ep=2 is the world at 2 ranks")
    ep = world.size if ep == "world" else int(ep)
    if world.size % ep:
        pytest.skip(f"ep={ep} does not divide {world.size} ranks")
    comm = ProcessGrid(world, ep=ep).ep  # the ranks of one dp group carved into ep groups
    rank, size = comm.rank, comm.size
    assert size == ep
    experts, n = 2 * size, 6
    serial = MoE(8, 10, experts=experts, top_k=top_k, rng=3, dtype=F64)
    par = expert_parallel(serial, comm)
    assert par.w1.shape == (2, 8, 10) and list(par.local_experts()) == [2 * rank, 2 * rank + 1]
    rng = np.random.default_rng(7 + world.rank // ep)  # one batch per ep group, drawn alike on its ranks
    x_all = rng.standard_normal((size * n, 8))
    r_all = rng.standard_normal((size * n, 8))
    mine = slice(rank * n, (rank + 1) * n)
    serial.aux_weight, par.aux_weight = AUX * size, AUX
    serial.zero_grad()
    par.zero_grad()
    out_all = serial.forward(x_all)
    gx_all = serial.backward(r_all.copy())
    out = par.forward(x_all[mine])
    np.testing.assert_allclose(out, out_all[mine], **TOL)
    np.testing.assert_array_equal(par.tokens_per_expert, serial.tokens_per_expert)
    loss = float((out * r_all[mine]).sum()) + par.aux_weight * par.aux_loss
    total = sum(comm.allgather_obj(loss))
    assert total == pytest.approx(float((out_all * r_all).sum()) + serial.aux_weight * serial.aux_loss, rel=1e-10)
    gx = par.backward(r_all[mine].copy())
    np.testing.assert_allclose(gx, gx_all[mine], **TOL)
    _check_params(serial, par, comm)


@pytest.mark.mpi(min_size=2)
def test_the_aux_term_over_dp_x_ep_is_the_one_process_term_and_its_gradient():
    # set_aux_group(grid.dp_cp): f_e and P_e over every replica's tokens (ranks of unequal token
    # counts here), so each rank's aux_loss is the term of all tokens together; each rank weighs
    # its backward by its share of the tokens (what the engine's aux_weight does), so the router
    # gradients summed over the ranks are the one-process term's, which a float64 finite
    # difference of the (all-reduced) term checks too.
    world = _world()
    grid = ProcessGrid(world, ep=2 if world.size % 2 == 0 else 1)  # dp x ep: several ep groups at -n 4
    sizes = [4 + r for r in range(world.size)]
    total, mine = sum(sizes), slice(sum(sizes[: world.rank]), sum(sizes[: world.rank + 1]))
    serial = MoE(8, 10, experts=4, top_k=2, rng=3, dtype=F64)
    par = expert_parallel(serial, grid.ep)
    set_aux_group(par, grid.dp_cp)
    x_all = np.random.default_rng(5).standard_normal((total, 8))
    serial.aux_weight, par.aux_weight = 1.0, sizes[world.rank] / total
    serial.forward(x_all)
    serial.backward(np.zeros((total, 8)))
    par.forward(x_all[mine])
    assert par.aux_loss == pytest.approx(serial.aux_loss, rel=1e-12)
    np.testing.assert_array_equal(world.allgather_obj(par.aux_loss), [par.aux_loss] * world.size)
    par.backward(np.zeros((sizes[world.rank], 8)))
    got = world.allreduce(par.router.weight.grad.copy())
    np.testing.assert_allclose(got, serial.router.weight.grad, **TOL)
    w, eps = par.router.weight.data, 1e-6
    for i, j in [(0, 0), (3, 1), (7, 3)]:  # every rank perturbs the same (replicated) entry
        terms = []
        for d in (eps, -eps):
            w[i, j] += d
            par.forward(x_all[mine])
            terms.append(par.aux_loss)
            w[i, j] -= d
        assert (terms[0] - terms[1]) / (2 * eps) == pytest.approx(got[i, j], rel=1e-6, abs=1e-9)
    assert abs(got).max() > 1e-3  # a gradient that is there to check


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("recompute", [False, True])
def test_gpt_with_moe_blocks_under_ep_equals_one_process_in_the_graph(recompute):
    comm = _world()
    rank, size = comm.rank, comm.size

    def build():
        model = GPT(13, 5, 8, 2, 2, d_hidden=12, rng=1, dtype=F64, moe_experts=2 * size, moe_top_k=2, moe_every=1)
        return recompute_blocks(model)[0] if recompute else model  # the exchanges rerun inside backward

    serial = build()
    par = expert_parallel(build(), comm)
    full = full_state_dict(par, comm)  # the experts gathered back: the serial weights, whole
    assert sorted(full) == sorted(serial.state_dict())
    for name, w in serial.state_dict().items():
        np.testing.assert_array_equal(full[name], w, err_msg=name)
    assert len(moe_layers(par)) == 2 and all(m.group is comm for m in moe_layers(par))
    set_aux_weight(serial, AUX * size)
    set_aux_weight(par, AUX)
    rng = np.random.default_rng(11)
    idx_all = rng.integers(0, 13, (2 * size, 5))
    r_all = rng.standard_normal((2 * size, 5, 13))
    mine = slice(2 * rank, 2 * rank + 2)
    got = {}
    for model, idx, r in ((serial, idx_all, r_all), (par, idx_all[mine], r_all[mine])):
        model.zero_grad()
        y = model(idx)  # through the graph: each MoE one node whose backward is its own
        loss = (y * r).sum()
        loss.backward()
        got[id(model)] = y.data, float(loss.data) + sum(m.aux_weight * m.aux_loss for m in moe_layers(model))
    np.testing.assert_allclose(got[id(par)][0], got[id(serial)][0][mine], **TOL)
    assert sum(comm.allgather_obj(got[id(par)][1])) == pytest.approx(got[id(serial)][1], rel=1e-10)
    _check_params(serial, par, comm)


@pytest.mark.mpi(min_size=2)
def test_expert_parallel_refuses_experts_not_divisible_on_every_rank():
    comm = _world()
    serial = MoE(4, 4, experts=comm.size + 1, top_k=1)
    with pytest.raises(ValueError, match=f"experts={comm.size + 1} must be divisible by ep={comm.size}"):
        expert_parallel(serial, comm)
    par = expert_parallel(MoE(4, 4, experts=comm.size, top_k=1), comm)
    with pytest.raises(ValueError, match="already expert-parallel"):
        expert_parallel(par, comm)
    # Ranks handed different models (rank 0's refusable, the others' not) all refuse, none waits.
    odd = MoE(4, 4, experts=comm.size + 1 if comm.rank == 0 else comm.size, top_k=1)
    with pytest.raises(MismatchError, match="expert_parallel"):
        expert_parallel(odd, comm)


@pytest.mark.mpi(min_size=2)
def test_gpt_with_moe_blocks_under_tp_keeps_the_moe_whole_and_equals_one_process():
    """tensor_parallel splits the attention and the dense MLPs; each tp rank computes the MoE whole
    (its input is replicated there), so the model still equals the serial one."""
    from hpctrain.parallel import tensor_parallel

    comm = _world()
    heads = 2 * comm.size

    def build():
        return GPT(13, 5, 4 * heads, heads, 2, d_hidden=4 * comm.size, rng=2, dtype=F64, moe_experts=4, moe_every=2)

    serial, par = build(), tensor_parallel(build(), comm)
    assert [type(b.mlp).__name__ for b in par.blocks] == ["ParallelMLP", "MoE"]
    set_aux_weight(serial, AUX)
    set_aux_weight(par, AUX)
    idx = np.random.default_rng(3).integers(0, 13, (2, 5))
    serial.zero_grad()
    par.zero_grad()
    full = serial.forward(idx)
    mine = par.forward(idx)  # this rank's vocabulary columns of the logits
    assert par.aux_loss == pytest.approx(serial.aux_loss, rel=1e-12)
    cols = slice(par.vocab_parallel[0], par.vocab_parallel[0] + mine.shape[-1])
    np.testing.assert_allclose(mine, full[..., cols], **TOL)
    r = np.random.default_rng(4).standard_normal(full.shape)
    serial.backward(r.copy())
    par.backward(r[..., cols].copy())
    ser = dict(serial.named_parameters())
    for name, (p, _, index) in shard_map(par).items():
        np.testing.assert_allclose(p.grad, ser[name].grad[index], **TOL, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp,zero,recompute", [(2, 0, True), (1, 3, False), (1, 2, True)])
def test_gpt_with_moe_blocks_trains_in_the_engine_as_one_process(pp, zero, recompute):
    """Without ep the MoE is a per-token function of replicated parameters: dp, a pipeline cut
    between blocks, ZeRO and recompute train it to the one-process losses and weights."""
    from hpctrain.nn import CrossEntropyLoss
    from hpctrain.optim import AdamW
    from hpctrain.parallel import ParallelTrainer, parallelize

    comm = _world()
    if comm.size % pp:
        pytest.skip(f"pp={pp} does not divide {comm.size} ranks")

    def make():
        return GPT(11, 5, 8, 2, 3, d_hidden=12, rng=0, dtype=F64, moe_experts=4, moe_every=2)

    grid = ProcessGrid(comm, pp=pp)
    dp, d, per = grid.dp_size, grid.dp.rank, 4
    part = parallelize(make(), grid, recompute=recompute)
    tr = ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=AdamW(part.parameters(), lr=1e-2),
                         grid=grid, microbatches=2, zero=zero)
    ref, ce = make(), CrossEntropyLoss()
    opt = AdamW(ref.parameters(), lr=1e-2)
    for s in range(3):
        g = np.random.default_rng(100 + s)
        x, y = g.integers(0, 11, (per * dp, 5)), g.integers(0, 11, (per * dp, 5))
        got = tr.step(x[d * per:(d + 1) * per], y[d * per:(d + 1) * per]).loss
        opt.zero_grad()
        want = ce.forward(ref.forward(x), y)
        ref.backward(ce.backward())
        opt.step()
        assert got == pytest.approx(want, rel=1e-10)
    full = dict(ref.named_parameters())
    for name, (p, _, index) in tr.shards().items():
        np.testing.assert_allclose(p.data, full[name].data[index], rtol=1e-9, atol=1e-12, err_msg=name)
