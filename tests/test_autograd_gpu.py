"""The autograd engine on a real GPU (the ``gpu`` set; CI has none and skips): every
``nn.functional`` operation gradchecked in float64 on CuPy arrays, and the built-in GPT's
gradients through the engine equal to its hand-written backward on the GPU, in float64 (CuPy's
generic path) and in float32 (the fused kernels' path). The device stand-in runs the same cases in
``make test``; this is the proof on the hardware."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import autograd as ag
from hpctrain import backend
from hpctrain.backend import to_host

cp = backend.cupy()
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(cp is None, reason="needs CuPy and an NVIDIA GPU")]

from test_autograd_layers import _gpt, explicit_and_engine_grads  # noqa: E402
from test_functional import CASES  # noqa: E402


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_op_passes_gradcheck_on_the_gpu(name):
    fn, arrays, constants = CASES[name]

    def put(a):
        return cp.asarray(a) if isinstance(a, np.ndarray) else a

    consts = [put(c) for c in constants]
    tensors = [ag.Tensor(put(a), requires_grad=True) for a in arrays]
    assert ag.gradcheck(lambda *t: fn(*consts, *t), tensors)
    assert isinstance(fn(*consts, *tensors).data, cp.ndarray)  # computed on the GPU


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("variant", ["plain", "dropout", "tied"])
def test_gpt_through_the_engine_equals_its_hand_written_backward_on_the_gpu(variant, dtype):
    kw = {"dropout": dict(dropout=0.3), "tied": dict(tie_embeddings=True)}.get(variant, {})
    model = _gpt(dtype=dtype, **kw)
    model.to("gpu")
    g = np.random.default_rng(1)
    x, y = cp.asarray(g.integers(0, 11, (3, 6))), cp.asarray(g.integers(0, 11, (3, 6)))
    (want_v, want), (got_v, got) = explicit_and_engine_grads(model, x, y)
    assert isinstance(next(iter(got.values())), cp.ndarray)
    # The same kernels in the same order: equal up to the order of a few reductions.
    rtol, atol = (1e-10, 1e-14) if dtype == np.float64 else (2e-5, 1e-7)
    assert float(to_host(got_v)) == pytest.approx(float(to_host(want_v)), rel=rtol)
    assert got.keys() == want.keys()
    for n in want:
        np.testing.assert_allclose(to_host(got[n]), to_host(want[n]), rtol=rtol, atol=atol, err_msg=n)
