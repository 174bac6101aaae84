"""Memory the job reports: measured from the arrays that exist."""

from __future__ import annotations

import numpy as np
import pytest

import hpctrain as ht
from hpctrain.data import ArrayDataset, DataLoader, ShardedSampler
from hpctrain.nn import GPT, CrossEntropyLoss, recompute
from hpctrain.training.memory import activation_bytes, owned_bytes


def test_owned_bytes_counts_buffers_once():
    flat = np.zeros(100)
    views = [flat[:40].reshape(4, 10), flat[40:]]
    assert owned_bytes(views) == 800
    assert owned_bytes(views + [flat, np.ones(3)]) == 824
    placeholder = np.broadcast_to(np.zeros(1), (1000, 1000))
    assert owned_bytes([placeholder]) == 8
    seen: set[int] = set()
    assert owned_bytes([flat], seen) == 800 and owned_bytes(views, seen) == 0


def _gpt(layers=4):
    return GPT(vocab_size=13, block_size=16, d_model=16, n_heads=2, n_layers=layers, rng=0, dtype=np.float64)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_fit_reports_memory_per_step():
    comm = ht.Communicator()
    g = np.random.default_rng(0)
    x, y = g.integers(0, 13, (32, 16)), g.integers(0, 13, (32, 16))
    peaks, works = {}, {}
    for wrap in (False, True):
        model = _gpt()
        if wrap:
            model = recompute(model)
        opt = ht.optim.Adam(model.parameters(), lr=1e-3)
        tr = ht.parallel.DataParallelTrainer(model=model, loss=CrossEntropyLoss(), optimizer=opt, comm=comm)
        sampler = ShardedSampler(32, comm.rank, comm.size, shuffle=False)
        hist = tr.fit(DataLoader(ArrayDataset(x, y), batch_size=4, sampler=sampler), epochs=1, log_every=100)
        m = hist[-1].memory
        nbytes = sum(p.data.nbytes for p in model.parameters())
        assert m["params"] == nbytes
        assert m["grads"] == nbytes  # the gradient buckets are exactly the gradients
        assert m["optimizer"] == 2 * nbytes  # Adam: exp_avg and exp_avg_sq
        assert m["activations_peak"] > 0
        assert m["total"] == sum(m[k] for k in ("params", "grads", "optimizer", "buffers", "activations_peak",
                                                "workspace"))
        assert m["rss_peak"] > m["total"]
        peaks[wrap] = m["activations_peak"]
        works[wrap] = m["workspace"]
        summary = tr.memory_summary()
        assert summary["params"] == nbytes and summary["activations_peak"] >= m["activations_peak"]
        tr.close()
    assert peaks[True] < peaks[False]
    # The layers' reuse pools count too; recomputed blocks keep none between steps.
    assert works[True] < works[False] and works[False] > 0


def test_activation_bytes_of_a_forward():
    model = _gpt(2)
    assert activation_bytes(model) == 0
    model.forward(np.zeros((2, 16), dtype=np.int64))
    assert activation_bytes(model) > 2 * 16 * 16 * 8
