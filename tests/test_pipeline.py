"""Pipeline parallelism under MPI: equivalence with one process, shapes, errors, timeline."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from pipeline_models import batches, make, serial_run, share

from hpctrain import ProcessGrid
from hpctrain.optim import Adam
from hpctrain.parallel import PipelineParallelTrainer, pipeline_stage


def _trainer(comm, kind, pp, schedule, m, **kw):
    grid = ProcessGrid(comm, pp=pp)
    model, loss = make(kind)
    stage = pipeline_stage(model, grid.pp)
    opt = Adam(stage.parameters(), lr=0.01)
    return PipelineParallelTrainer(stage=stage, loss=loss, optimizer=opt, grid=grid, microbatches=m,
                                   schedule=schedule, **kw)  # fmt: skip


def _run_and_compare(comm, kind, pp, schedule, m, sizes, masked=False):
    if comm.size % pp:
        pytest.skip(f"pp={pp} does not divide a world of {comm.size}")
    data = batches(kind, sizes, masked=masked)
    ref_losses, ref_params, ref_opt = serial_run(kind, data)
    tr = _trainer(comm, kind, pp, schedule, m)
    dp, d = tr.dp.size, tr.dp.rank
    stats = [tr.step(share(x, d, dp), share(y, d, dp), share(w, d, dp)) for x, y, w in data]
    np.testing.assert_allclose([s.loss for s in stats], ref_losses, rtol=1e-10, atol=1e-12)
    for p in tr.stage.parameters():
        np.testing.assert_allclose(p.data, ref_params[p.name], rtol=1e-9, atol=1e-11, err_msg=p.name)
        np.testing.assert_allclose(tr.optimizer.state[p.name]["exp_avg"], ref_opt.state[p.name]["exp_avg"],
                                   rtol=1e-9, atol=1e-12, err_msg=p.name)  # fmt: skip
    real = sum(int((w > 0).sum()) if w is not None else x.shape[0] for x, _, w in data)
    assert sum(s.samples for s in stats) == real
    return tr, stats


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_pp_over_world_matches_serial(comm, kind, schedule):
    # Batch sizes vary (and 10 is not a multiple of 4): micro-batch shapes change and are re-agreed.
    tr, stats = _run_and_compare(comm, kind, comm.size, schedule, 4, [12, 10, 12, 7])
    p = comm.size
    held = [s.extra["peak_activations_per_stage"] for s in stats]
    want = [min(p - s, 4) for s in range(p)] if schedule == "1f1b" else [4] * p
    assert all(h == want for h in held), held
    assert all(0.0 <= s.extra["bubble"] < 1.0 for s in stats)


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_pp2_x_dp_matches_serial_with_masks(comm, kind, schedule):
    _run_and_compare(comm, kind, 2, schedule, 3, [16, 16, 12], masked=True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_short_last_batch_takes_fewer_microbatches(comm, schedule):
    # An epoch's last batch of 3 samples with microbatches=4: that step cuts it into 3 (one
    # sample each) and still equals the one-process step on the same samples.
    tr, stats = _run_and_compare(comm, "mlp", comm.size, schedule, 4, [12, 3])
    assert [s.extra["microbatches"] for s in stats] == [4, 3]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_single_microbatch_and_many(comm):
    _run_and_compare(comm, "mlp", comm.size, "1f1b", 1, [5, 5])
    _run_and_compare(comm, "mlp", comm.size, "1f1b", 9, [9, 13])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_errors_on_every_rank(comm):
    from hpctrain.errors import MismatchError

    grid = ProcessGrid(comm, pp=comm.size)
    model, loss = make("mlp")
    with pytest.raises(ValueError, match="cannot cut 7 layers into 8 pipeline stages"):
        pipeline_stage(model, _FakeSize(comm, 8))
    stage = pipeline_stage(model, grid.pp)
    opt = Adam(stage.parameters(), lr=0.01)
    # Only rank 1 asks for a bad schedule: every rank raises, naming it.
    with pytest.raises(ValueError, match="rank 1: unknown pipeline schedule 'zigzag'"):
        PipelineParallelTrainer(stage=stage, loss=loss, optimizer=opt, grid=grid,
                                schedule="zigzag" if comm.rank == 1 else "1f1b")  # fmt: skip
    with pytest.raises(ValueError, match="clip_norm"):
        PipelineParallelTrainer(stage=stage, loss=loss, optimizer=opt, grid=grid, clip_norm=0.0)
    # Ranks asking for different micro-batch counts are refused everywhere, before any p2p traffic.
    with pytest.raises(MismatchError, match="microbatches"):
        PipelineParallelTrainer(stage=stage, loss=loss, optimizer=opt, grid=grid, microbatches=2 + comm.rank % 2)
    tr = PipelineParallelTrainer(stage=stage, loss=loss, optimizer=opt, grid=grid, microbatches=4)
    x, y, _ = batches("mlp", [3])[0]
    with pytest.raises(ValueError, match="a batch of 0 samples cannot be cut into micro-batches"):
        tr.step(x[:0], y[:0])


class _FakeSize:
    """Stands in for a pp communicator of another size (pipeline_stage reads only rank/size)."""

    def __init__(self, comm, size):
        self.rank, self.size = 0, size


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_timeline_written(comm):
    from hpctrain.parallel.timeline import have_matplotlib

    tr = _trainer(comm, "mlp", comm.size, "1f1b", 4)
    x, y, _ = batches("mlp", [8])[0]
    tr.step(x, y)
    directory = comm.bcast_obj(os.path.abspath(f"pipeline-timeline-{os.getpid()}") if comm.rank == 0 else None)
    paths = tr.save_timeline(directory)
    try:
        with open(os.path.join(directory, "timeline.json")) as fh:
            trace = json.load(fh)["traceEvents"]
        names = {(e["pid"], e["name"]) for e in trace if e["ph"] == "X"}
        for r in range(comm.size):
            for i in range(4):
                assert (r, f"F{i}") in names and (r, f"B{i}") in names
        if have_matplotlib():
            assert os.path.getsize(os.path.join(directory, "timeline.png")) > 1000
        else:
            assert not any(p.endswith(".png") for p in paths)
    finally:
        comm.barrier()
        if comm.rank == 0:
            for p in paths:
                if os.path.exists(p):
                    os.remove(p)
            os.rmdir(directory)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp", ["world", 2])
def test_clipping_matches_serial(comm, pp):
    from hpctrain.optim import clip_grad_norm

    pp = comm.size if pp == "world" else pp
    if comm.size % pp:
        pytest.skip(f"pp={pp} does not divide a world of {comm.size}")
    data = batches("mlp", [12, 12, 12])
    model, loss = make("mlp")
    opt = Adam(model.parameters(), lr=0.01)
    ref_norms = []
    for x, y, w in data:
        loss.forward(model.forward(x), y, w)
        model.backward(loss.backward())
        ref_norms.append(clip_grad_norm(model.parameters(), 0.05))
        opt.step()
        opt.zero_grad()
    tr = _trainer(comm, "mlp", pp, "1f1b", 3, clip_norm=0.05)
    dp, d = tr.dp.size, tr.dp.rank
    norms = [tr.step(share(x, d, dp), share(y, d, dp)).grad_norm for x, y, _ in data]
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-10)
    assert min(norms) > 0.05  # clipping really happened
    ref = dict(model.named_parameters())
    for p in tr.stage.parameters():
        np.testing.assert_allclose(p.data, ref[p.name].data, rtol=1e-9, atol=1e-11, err_msg=p.name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_nonfinite_skip_and_raise_on_every_rank(comm):
    from hpctrain.errors import NonFiniteError

    x, y, _ = batches("mlp", [8])[0]
    bad = x.copy()
    bad[3, 0] = np.nan  # only stage 0 reads x; the NaN reaches the loss on the last stage
    tr = _trainer(comm, "mlp", comm.size, "1f1b", 4, on_nonfinite="skip")
    before = {p.name: p.data.copy() for p in tr.stage.parameters()}
    st = tr.step(bad, y)
    # A skipped step still counts as a step (the one global-step rule), not as an update.
    assert st.skipped and not np.isfinite(st.loss) and tr.global_step == 1 and tr.optimizer.step_count == 0
    assert all(np.array_equal(p.data, before[p.name]) for p in tr.stage.parameters())
    assert not tr.step(x, y).skipped and tr.optimizer.step_count == 1  # gradients were cleared after the skip
    # A batch of padding only (all weights 0) is no data: no update on any rank.
    st = tr.step(x, y, np.zeros(8))
    assert st.skipped and st.samples == 0 and st.loss == 0.0 and tr.optimizer.step_count == 1
    tr = _trainer(comm, "mlp", comm.size, "gpipe", 4)
    with pytest.raises(NonFiniteError):
        tr.step(bad, y)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_fit_with_loader_matches_serial(comm):
    from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler

    g = np.random.default_rng(3)
    xs, ys = g.standard_normal((40, 6)), g.standard_normal((40, 3))
    tr = _trainer(comm, "mlp", comm.size, "1f1b", 2, timeout=60.0)  # waits poll against the timeout
    # One pipeline (dp = 1): every stage reads the same batches.
    loader = DataLoader(ArrayDataset(xs, ys), batch_size=8, sampler=ShardedSampler(40, 0, 1, seed=4))
    history = tr.fit(loader, epochs=2)
    ref_loader = DataLoader(ArrayDataset(xs, ys), batch_size=8, sampler=ShardedSampler(40, 0, 1, seed=4))
    model, loss = make("mlp")
    opt = Adam(model.parameters(), lr=0.01)
    ref = []
    for epoch in range(2):
        ref_loader.sampler.set_epoch(epoch)
        for x, y in ref_loader:
            ref.append(loss.forward(model.forward(x), y))
            model.backward(loss.backward())
            opt.step()
            opt.zero_grad()
    np.testing.assert_allclose([s.loss for s in history], ref, rtol=1e-10)
    assert tr.global_step == 10 and tr.epoch == 2
