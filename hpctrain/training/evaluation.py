"""Loss and accuracy of a model on held-out data, one process or data parallel.

``evaluate(model, data, comm=comm)`` splits the evaluation batches (``batch`` rows each, counted
from the start of ``data``) into one contiguous share per rank; each rank evaluates its share
and one all-reduce of three numbers (loss sum, correct, count) combines them. Each batch is the
batch a single process would evaluate, so the result is the serial one up to the order of the
float64 sums. Every rank works about as long as every other, so no rank waits in a collective
while another evaluates alone; a failure on any rank is raised on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..protocols import Comm


def predict(model: Any, x: Any) -> Any:
    """``model``'s output on the array ``x`` as an array, recording nothing: a module's call (a
    forward-only module computes with tensors, an explicit one runs its forward on arrays), or
    the ``forward`` of a model that keeps the protocol without being an ``nn.Module``."""
    from ..autograd import is_tensor, no_grad
    from ..nn import Module

    with no_grad():
        out = model(x) if isinstance(model, Module) else model.forward(x)
    return out.data if is_tensor(out) else out


def _share(n_batches: int, rank: int, size: int) -> range:
    return range(n_batches * rank // size, n_batches * (rank + 1) // size)


def evaluate(model: Any, data: Any, loss: Any = None, batch: int = 256, comm: Comm | None = None) -> dict[str, float]:
    """``{"loss", "accuracy", "samples"}`` of ``model`` (a serial model, in eval mode afterwards)
    on all of ``data`` (``data[idx] -> (x, y, ...)``, integer class targets); collective with
    ``comm``. ``loss`` (default cross-entropy) gives the mean over every target (every token for
    a language model)."""
    from ..nn import CrossEntropyLoss

    model.eval()
    loss = CrossEntropyLoss() if loss is None else loss
    classes = isinstance(loss, CrossEntropyLoss)  # accuracy only for class targets
    n = len(data)
    n_batches = -(-n // batch)
    mine = _share(n_batches, comm.rank, comm.size) if comm is not None else range(n_batches)
    sums = np.zeros(4, dtype=np.float64)  # loss * rows, correct, rows, target positions
    problem = None
    try:
        for b in mine:
            x, y = data[np.arange(b * batch, min((b + 1) * batch, n))][:2]
            logits = predict(model, x)
            rows = len(y)  # the mean over samples: each batch weighted by its rows
            right = int((logits.argmax(axis=-1) == y).sum()) if classes else 0
            sums += (float(loss.forward(logits, y)) * rows, right, rows, y.size)
    except Exception as exc:  # said on every rank below instead of leaving the others in the reduce
        if comm is None:
            raise
        problem = exc
    if comm is not None:
        from ..comm.validate import raise_if_any

        raise_if_any(comm, problem, what="evaluation")
        sums = comm.allreduce(sums)
    total_loss, correct, count, positions = (float(v) for v in sums)
    if not count:
        return {"loss": math.nan, "accuracy": math.nan if classes else None, "samples": n}
    # The accuracy is over every target position (every token of a language model).
    return {"loss": total_loss / count, "accuracy": correct / positions if classes else None, "samples": n}
