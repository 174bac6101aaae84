"""Finite-difference gradient checks for modules and losses (float64, central differences)."""

from __future__ import annotations

import numpy as np

from hpctrain.autograd.gradcheck import numeric_gradient


def numeric_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d f() / d x by central differences, perturbing ``x`` (C-contiguous) in place."""
    return numeric_gradient(f, x, eps)


def check_module(module, x: np.ndarray, rng: np.random.Generator, atol: float = 1e-6, before=None) -> None:
    """Compare backward's input and parameter gradients with finite differences.

    The scalar is ``sum(forward(x) * r)`` for a fixed random ``r``, so every output element
    contributes with a different weight. Integer inputs (token ids) get no input check, and
    backward must return ``None`` for them. ``before()`` runs before every forward (e.g. to reset
    an RNG so Dropout draws the same mask each time).
    """
    before = before or (lambda: None)
    before()
    out = module.forward(x)
    r = rng.standard_normal(out.shape)

    def f() -> float:
        before()
        return float((module.forward(x) * r).sum())

    module.zero_grad()
    before()
    module.forward(x)
    gx = module.backward(r.copy())
    if x.dtype.kind in "iu":
        assert gx is None, "backward of integer inputs must return None"
    else:
        np.testing.assert_allclose(gx, numeric_grad(f, x), atol=atol, rtol=1e-5, err_msg="input")
    for name, p in module.named_parameters():
        np.testing.assert_allclose(
            p.grad, numeric_grad(f, p.data), atol=atol, rtol=1e-5, err_msg=name
        )


def check_loss(loss, pred: np.ndarray, target, weight=None, atol: float = 1e-7) -> None:
    def f() -> float:
        return loss.forward(pred, target, weight)

    f()
    g = loss.backward()
    np.testing.assert_allclose(g, numeric_grad(f, pred), atol=atol, rtol=1e-5)
