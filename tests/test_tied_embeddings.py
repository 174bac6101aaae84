"""The GPT's tied head (``--tie-embeddings``, nanoGPT's) under tensor and pipeline parallelism, and
in checkpoints (issue 36, item 5).

Tensor parallel: the head is the vocab-parallel embedding's own weight (``VocabParallelTiedHead``),
its logits split over the vocabulary. Pipeline parallel: the first stage (embedding) and the last
(head) each hold the weight; it starts equal, its gradient is summed over the two and it is
counted once in the norm, as Megatron does. Every layout equals one process. A checkpoint stores
the weight once (``tok_emb.weight``): it loads into a tied model of any layout, and into an untied
one as the documented starting point (``head.weight`` = ``tok_emb.weight`` transposed); a
checkpoint of an untied model is refused by a tied one."""

from __future__ import annotations

import numpy as np
import pytest

import hpctrain as ht
from hpctrain import ProcessGrid
from hpctrain.errors import CheckpointError
from hpctrain.nn import GPT, CrossEntropyLoss
from hpctrain.parallel import ParallelTrainer, parallelize

V, T = 16, 8


def gpt(tied: bool = True) -> GPT:
    return GPT(vocab_size=V, block_size=T, d_model=8, n_heads=2, n_layers=2, rng=1, dtype=np.float64,
               tie_embeddings=tied)  # fmt: skip


def batch(seed: int, n: int):
    g = np.random.default_rng(seed)
    return g.integers(0, V, (n, T)), g.integers(0, V, (n, T))


def serial(steps: int, n: int, clip=None):
    """One process, the explicit protocol: losses, grad norms and the final weights."""
    model, loss = gpt(), CrossEntropyLoss()
    opt = ht.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for s in range(steps):
        x, y = batch(s, n)
        opt.zero_grad()
        value = loss.forward(model.forward(x), y)
        model.backward(loss.backward())
        norm = ht.optim.clip_grad_norm(model.parameters(), clip or np.inf)
        opt.step()
        out.append((value, norm))
    return out, {n: p.data.copy() for n, p in model.named_parameters()}


def trainer(comm, tp: int, pp: int, tied: bool = True, clip=None) -> ParallelTrainer:
    grid = ProcessGrid(comm, tp=tp, pp=pp)
    part = parallelize(gpt(tied), grid)
    return ParallelTrainer(model=part, loss=CrossEntropyLoss(), optimizer=ht.optim.AdamW(part.parameters(), lr=1e-2),
                           grid=grid, microbatches=2 if pp > 1 else 1, clip_norm=clip)  # fmt: skip


def run(tr, steps: int):
    d, nd = tr.grid.dp.rank, tr.grid.dp.size
    out = []
    for s in range(steps):
        x, y = batch(s, 4 * nd)
        st = tr.step(x[d::nd], y[d::nd])
        out.append((st.loss, st.grad_norm))
    return out


def full(tr) -> dict[str, np.ndarray]:
    """Every full tensor by serial name (collective over the world)."""
    mine = {n: (p.data.copy(), f, i) for n, (p, f, i) in tr.shards().items()}
    out: dict[str, np.ndarray] = {}
    for part in tr.comm.allgather_obj(mine):
        for n, (a, f, i) in part.items():
            out.setdefault(n, np.zeros(f))[i] = a
    return out


def test_the_tied_model_lists_its_weight_once():
    m = gpt()
    names = [n for n, _ in m.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names
    assert m.tied_weights() == {"head.weight": "tok_emb.weight"}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_tied_head_equals_one_process(comm, tp, pp):
    if comm.size % (tp * pp):
        pytest.skip(f"tp={tp} x pp={pp} needs a multiple of {tp * pp} ranks")
    tr = trainer(comm, tp, pp, clip=0.5)
    got = run(tr, 3)
    dp = tr.grid.dp.size
    want, weights = serial(3, 4 * dp, clip=0.5)
    np.testing.assert_allclose(got, want, rtol=1e-10)
    have = full(tr)
    assert "head.weight" not in have  # stored once, under the owner's name
    for n, w in weights.items():
        np.testing.assert_allclose(have[n], w, rtol=1e-10, atol=1e-12, err_msg=n)
    if pp > 1:  # both stages' copies stayed equal
        ties = tr.strategy._ties.groups
        assert (tr.grid.pp.rank in (0, pp - 1)) == bool(ties)
    tr.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_tied_checkpoint_loads_tied_and_untied_an_untied_one_is_refused_by_a_tied_model(comm, shared_dir):
    from hpctrain import checkpoint as ckpt
    from hpctrain.checkpoint.loading import read_header

    if comm.size % 2:
        pytest.skip("a pipeline of 2 stages")
    path = f"{shared_dir}/tied.h5"
    tr = trainer(comm, 1, 2)
    run(tr, 2)
    ckpt.save(path, tr)
    saved = full(tr)
    keys = set(read_header(path, with_state=False)["index"])
    assert "model/tok_emb.weight" in keys and "model/head.weight" not in keys
    for tied in (True, False):  # into a tied model of another layout, and into an untied one
        other = trainer(comm, 1, 1, tied=tied)
        ckpt.load(path, other)
        loaded = full(other)
        np.testing.assert_array_equal(loaded["tok_emb.weight"], saved["tok_emb.weight"])
        if not tied:
            np.testing.assert_array_equal(loaded["head.weight"], saved["tok_emb.weight"].T)
        run(other, 1)  # and trains on
        other.close()
    untied = trainer(comm, 1, 1, tied=False)
    run(untied, 1)
    ckpt.save(f"{shared_dir}/untied.h5", untied)
    before = full(tr)
    with pytest.raises(CheckpointError, match="head.weight is in the checkpoint but not in the model .this model "
                                              "ties it to tok_emb.weight"):
        ckpt.load(f"{shared_dir}/untied.h5", tr)
    after = full(tr)
    assert all(np.array_equal(before[n], after[n]) for n in before)  # all or nothing
    untied.close()
    tr.close()


def test_the_flag_builds_the_tied_gpt():
    """``hpctrain train --model gpt --tie-embeddings``: the built-in builder ties the head."""
    from hpctrain.job.models import build_gpt
    from hpctrain.job.options import Config

    meta = {"vocab_size": V}
    for flag in (False, True):
        c = Config(model="gpt", d_model=8, n_heads=2, n_layers=1, block_size=T, tie_embeddings=flag)
        m = build_gpt(c, meta)
        assert m.tied_weights() == ({"head.weight": "tok_emb.weight"} if flag else {})
        assert ("head.weight" in dict(m.named_parameters())) is not flag
