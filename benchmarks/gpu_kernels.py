"""Each GPU kernel against its NumPy twin on the device (issue 40): the same layer, loss or optimizer
run on NumPy arrays and on CuPy arrays (the kernels' path), largest error relative to the twin's
largest value. Prints one JSON object per case (``gpu_check.py`` tables them).

    python benchmarks/gpu_kernels.py [--cpu | --emulate]   (dry runs: --cpu the structure on NumPy only;
                                                             --emulate the device branch, kernels emulated)
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import numpy as np

import hpctrain as ht
from hpctrain import backend
from hpctrain.backend import BF16

CPU = "--cpu" in sys.argv
if "--emulate" in sys.argv:  # the device branch on the CPU: the tests' stand-in, the kernels emulated
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpt_gpu import emulation

    emulation()
TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def dev(a):
    return a if CPU else backend.get_xp("gpu").asarray(a)


def host(a):
    return backend.to_host(a) if a is not None else None


def rel(a, b) -> float:
    a, b = np.asarray(host(a), np.float64), np.asarray(host(b), np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def layer_case(name, make, shape, dtype, extra_grads=()):
    g = np.random.default_rng(0)
    x = g.standard_normal(shape).astype(np.float32).astype(dtype)
    go = g.standard_normal(shape).astype(np.float32).astype(dtype)
    ref = make()
    ref_y = ref.forward(x)
    ref_g = ref.backward(go)
    m = make() if CPU else make().to("gpu")
    y = m.forward(dev(x))
    gx = m.backward(dev(go))
    errs = {"forward": rel(y, ref_y), "backward": rel(gx, ref_g)}
    for pname in extra_grads:
        errs[pname] = rel(dict(m.named_parameters())[pname].grad, dict(ref.named_parameters())[pname].grad)
    return name, np.dtype(dtype).name, errs


def cases():
    for dt in (np.float32, BF16):
        yield lambda dt=dt: layer_case("gelu", ht.nn.GELU, (64, 96), dt)
        yield lambda dt=dt: layer_case("mlp (bias+gelu)", lambda: _cast(ht.nn.MLP(32, 128, rng=0), dt), (4, 16, 32),
                                       dt, ("fc1.bias", "fc1.weight"))
        yield lambda dt=dt: layer_case("layernorm", lambda: _cast(ht.nn.LayerNorm(96), dt), (64, 96), dt,
                                       ("weight", "bias"))
        yield lambda dt=dt: layer_case("attention", lambda: _cast(ht.nn.CausalSelfAttention(64, 4, rng=0), dt),
                                       (2, 48, 64), dt, ("qkv.weight",))
        yield lambda dt=dt: loss_case(dt)
    # 600 tokens: the causal blocks of the attention's products (gpu.causal_blocks: 2 here)
    yield lambda: layer_case("attention, 600 tokens", lambda: ht.nn.CausalSelfAttention(64, 2, rng=0), (1, 600, 64),
                             np.float32, ("qkv.weight",))
    yield sumsq_case
    yield dropout_case
    yield embedding_case
    for opt in ("AdamW", "SGD"):
        yield lambda opt=opt: optimizer_case(opt)


def _cast(m, dt):
    for p in m.parameters():
        p.data = p.data.astype(dt)
        p.grad = np.zeros(p.shape, dt)
    return m


def loss_case(dt):
    g = np.random.default_rng(1)
    logits = (g.standard_normal((4, 8, 301)) * 3).astype(np.float32).astype(dt)
    target = g.integers(0, 301, (4, 8))
    ref = ht.nn.CrossEntropyLoss()
    lr_, gr = ref.forward(logits, target), ref.backward(2.0)
    loss = ht.nn.CrossEntropyLoss()
    lv = loss.forward(dev(logits), dev(target))
    gv = loss.backward(2.0)
    return "cross-entropy", np.dtype(dt).name, {"forward": rel(np.asarray(float(lv)), np.asarray(lr_)),
                                                "backward": rel(gv, gr)}


def sumsq_case():
    """The trainer's squared gradient norm over many tensors (optim.multi_tensor.sumsq)."""
    from hpctrain.optim import multi_tensor

    g = np.random.default_rng(4)
    host_arrays = [g.standard_normal(n).astype(dt) for n, dt in ((5, np.float32), (40000, np.float32),
                                                                 (70000, BF16), (3, BF16))]
    ref = sum(float((a.astype(np.float64) ** 2).sum()) for a in host_arrays)
    got = ref if CPU else float(host(multi_tensor.sumsq([dev(a) for a in host_arrays]))[0])
    return "squared norm (multi-tensor)", "float32", {"sum": abs(got - ref) / ref}


def dropout_case():
    x = np.ones((33, 257), np.float32)
    ref, d = ht.nn.Dropout(0.3, rng=3), ht.nn.Dropout(0.3, rng=3)
    if not CPU:
        d.to("gpu")
    y_ref, y = ref.forward(x), d.forward(dev(x))
    same = float(np.mean((host(y) != 0) == (y_ref != 0)))
    return "dropout (philox)", "float32", {"mask mismatch": 1.0 - same, "forward": rel(y, y_ref)}


def embedding_case():
    g = np.random.default_rng(2)
    ref = ht.nn.Embedding(50, 24, rng=0)
    m = copy.deepcopy(ref) if CPU else copy.deepcopy(ref).to("gpu")
    idx, go = g.integers(0, 50, (8, 16)), g.standard_normal((8, 16, 24)).astype(np.float32)
    ref.forward(idx), ref.backward(go)
    m.forward(dev(idx)), m.backward(dev(go))
    return "embedding backward", "float32", {"backward": rel(m.weight.grad, ref.weight.grad)}


def optimizer_case(kind):
    g = np.random.default_rng(3)
    ref_m = ht.nn.MLP(48, 96, rng=0)
    m = copy.deepcopy(ref_m) if CPU else copy.deepcopy(ref_m).to("gpu")
    make = {"AdamW": lambda ps: ht.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            "SGD": lambda ps: ht.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)}[kind]
    ro, o = make(ref_m.parameters()), make(m.parameters())
    for _ in range(3):
        for p, q in zip(ref_m.parameters(), m.parameters()):
            gr = g.standard_normal(p.shape).astype(np.float32)
            p.grad[...] = gr
            q.grad[...] = dev(gr)
        ro.step(), o.step()
    err = max(rel(q.data, p.data) for p, q in zip(ref_m.parameters(), m.parameters()))
    return f"{kind} (multi-tensor)", "float32", {"params after 3 steps": err}


def main() -> int:
    if not CPU and backend.cupy() is None:
        print(json.dumps({"case": "kernels", "skip": "no CuPy/GPU"}))
        return 0
    worst = 0
    for case in cases():
        t0 = time.perf_counter()
        try:
            name, dtype, errs = case()
            tol = TOL[dtype] if "mask" not in str(errs) else 0.0
            ok = all(v <= (0.0 if k == "mask mismatch" else TOL[dtype]) for k, v in errs.items())
            print(json.dumps({"case": name, "dtype": dtype, "errors": errs, "ok": ok, "tol": tol,
                              "seconds": round(time.perf_counter() - t0, 2)}), flush=True)  # fmt: skip
            worst |= not ok
        except Exception as exc:  # noqa: BLE001 - one failing kernel must not hide the others
            print(json.dumps({"case": getattr(case, "__name__", "case"), "error": f"{type(exc).__name__}: {exc}"[:300],
                              "ok": False}), flush=True)  # fmt: skip
            worst = 1
    return worst


if __name__ == "__main__":
    sys.exit(main())
