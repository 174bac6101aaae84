"""An epoch's short last batch (issue #26) under the README's layouts, end to end through
``hpctrain.job.run`` under mpiexec: it takes fewer micro-batches and the run equals one process.

The shapes of ``mpiexec -n 2 hpctrain train --accum-steps 2``, ``mpiexec -n 4 hpctrain train
--model gpt --pp 2`` and ``mpiexec -n 8 hpctrain train --model gpt --tp 2 --pp 2`` with tiny
models: each data set leaves a last global batch of a few samples, fewer per replica than the
step's micro-batches. The layout derives from the world size (skipped where it does not divide);
``make test`` runs the README's -n 8 case at 8 ranks too (dp=2 x tp=2 x pp=2).
"""

from __future__ import annotations

import json
import os

import pytest

from hpctrain.job import run

GPT = {"model": "gpt", "d_model": 16, "n_layers": 2, "n_heads": 2, "block_size": 16}


def _cfg(layout: dict, per_replica: int, dp: int, tail: int) -> dict:
    """One epoch of two full global batches and a last one of ``tail`` samples."""
    batch = per_replica * dp
    return {"batch_size": batch, "max_samples": 2 * batch + tail, "epochs": 1, "log_every": 1000, **layout}


def _losses(summary: dict) -> list[tuple[int, float, int]]:
    with open(summary["metrics"]) as f:
        return [(r["step"], r["loss"], r["samples"]) for r in map(json.loads, f)]


def _one_process(comm, cfg: dict, where: str) -> dict:
    """The same job on one process (rank 0's; its result on every rank)."""
    alone = comm.split(0 if comm.rank == 0 else 1)
    try:
        mine = None
        if comm.rank == 0:
            serial = {k: v for k, v in cfg.items() if k not in ("strategy", "tp", "pp")}
            s = run({**serial, "run_dir": os.path.join(where, "one")}, alone)
            mine = (s["val_loss"], _losses(s))
        return comm.bcast_obj(mine)
    finally:
        alone.free()


CASES = {
    # mpiexec -n N hpctrain train --accum-steps 2: 1 sample left, on one replica (the others pad).
    "dp-accum2": ({"accum_steps": 2}, 4, 1),
    # The same rule under ZeRO's sharded reduction and with tp=2 inside each replica.
    "zero1-accum2": ({"zero": 1, "accum_steps": 2}, 4, 1),
    "tp2-accum2": ({"tp": 2, "accum_steps": 2}, 4, 1),
    # mpiexec -n N hpctrain train --model gpt --pp 2 (4 micro-batches): 3 samples left.
    "gpt-pp2": ({**GPT, "pp": 2}, 8, 3),
    # The README's mpiexec -n 8 hpctrain train --model gpt --tp 2 --pp 2 (dp = N / 4): 3 left.
    "gpt-tp2-pp2": ({**GPT, "tp": 2, "pp": 2}, 8, 3),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_short_last_batch_trains_like_one_process(comm, shared_dir, case):
    layout, per_replica, tail = CASES[case]
    cells = layout.get("tp", 1) * layout.get("pp", 1)
    if comm.size % cells:
        pytest.skip(f"tp x pp = {cells} does not divide a world of {comm.size}")
    cfg = _cfg(layout, per_replica, comm.size // cells, tail)
    s = run({**cfg, "run_dir": os.path.join(shared_dir, "job")}, comm)
    assert s["steps"] == 3 and s["layout"]["dp"] == comm.size // cells
    ref_val, ref = _one_process(comm, cfg, shared_dir)
    if comm.rank == 0:
        got = _losses(s)
        # Every step, the short ones included, took the same samples with the same result.
        assert [(st, n) for st, _, n in got] == [(st, n) for st, _, n in ref]
        assert [n for _, _, n in got] == [cfg["batch_size"]] * 2 + [tail]
        assert [v for _, v, _ in got] == pytest.approx([v for _, v, _ in ref], rel=2e-5)
        assert s["val_loss"] == pytest.approx(ref_val, rel=2e-5)
    comm.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_resume_across_the_short_batch_is_exact(comm, shared_dir):
    # Stopped just before the short step and resumed: the same steps, bitwise, as one run.
    cfg = _cfg({"accum_steps": 2}, 4, comm.size, 1)
    whole = run({**cfg, "run_dir": os.path.join(shared_dir, "whole")}, comm)
    where = os.path.join(shared_dir, "parts")
    run({**cfg, "run_dir": where, "max_steps": 2}, comm)
    resumed = run({**cfg, "run_dir": where, "resume": True}, comm)
    if comm.rank == 0:
        assert _losses(resumed) == _losses(whole)
    assert resumed["val_loss"] == whole["val_loss"]
