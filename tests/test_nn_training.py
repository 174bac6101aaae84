"""Micro-batch cache swapping (what pipelines rely on) and a GPT that overfits a small batch."""

from __future__ import annotations

import numpy as np

from hpctrain import nn, optim


def _grads(model):
    return {n: p.grad.copy() for n, p in model.named_parameters()}


def _interleaved_equals_sequential(make, xs, rng):
    """forward A, forward B, backward A, backward B (caches swapped) == A then B one after the other."""
    probe = make()  # output shapes from a separate instance, so RNG draws (Dropout) stay aligned
    gs = [rng.standard_normal(probe.forward(x).shape) for x in xs]
    seq = make()
    seq.zero_grad()
    gx_seq = []
    for x, g in zip(xs, gs):
        seq.forward(x)
        gx_seq.append(seq.backward(g))

    inter = make()
    inter.zero_grad()
    caches = []
    for x in xs:
        inter.forward(x)
        caches.append(inter.get_cache())
    gx_inter = []
    for c, g in zip(caches, gs):
        inter.set_cache(c)
        gx_inter.append(inter.backward(g))
    for a, b in zip(gx_seq, gx_inter):
        if a is None:
            assert b is None
        else:
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)
    ref = _grads(seq)
    for n, p in inter.named_parameters():
        np.testing.assert_allclose(p.grad, ref[n], rtol=1e-12, atol=1e-14, err_msg=n)
    # and it really did matter: backward on the last micro-batch's cache gives other gradients
    inter.zero_grad()
    inter.set_cache(caches[1])
    inter.backward(gs[0])
    assert any(not np.allclose(p.grad, ref[n]) for n, p in inter.named_parameters())


def test_two_interleaved_microbatches_gpt(rng):
    def make():
        return nn.GPT(vocab_size=9, block_size=6, d_model=8, n_heads=2, n_layers=2, rng=5, dtype=np.float64)

    xs = [rng.integers(0, 9, (3, 6)), rng.integers(0, 9, (3, 6))]
    _interleaved_equals_sequential(make, xs, rng)


def test_two_interleaved_microbatches_sequential_with_dropout(rng):
    def make():
        return nn.Sequential(
            nn.Linear(6, 10, rng=0, dtype=np.float64), nn.GELU(), nn.Dropout(0.3, rng=1),
            nn.LayerNorm(10, dtype=np.float64), nn.Tanh(), nn.ReLU(),
            nn.TransformerBlock(10, 2, 16, rng=2, dtype=np.float64),
        )

    xs = [rng.standard_normal((2, 4, 6)), rng.standard_normal((2, 4, 6))]
    _interleaved_equals_sequential(make, xs, rng)


def test_gpt_with_two_blocks_overfits_a_small_batch():
    data = np.random.default_rng(0)
    idx = data.integers(0, 16, (4, 9))
    x, y = idx[:, :-1], idx[:, 1:]
    model = nn.GPT(vocab_size=16, block_size=8, d_model=32, n_heads=4, n_layers=2, rng=1)
    loss = nn.CrossEntropyLoss()
    opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(60):
        value = loss.forward(model.forward(x), y)
        first = value if first is None else first
        opt.zero_grad()
        model.backward(loss.backward())
        opt.step()
    final = loss.forward(model.forward(x), y)
    assert first > 2.0  # about log(16) at the start
    assert final < first / 10, (first, final)
