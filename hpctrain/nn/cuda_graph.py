"""A training step captured once into a CUDA graph and replayed: one launch instead of ~1,000.

What the step must do for that (``gpu.capturing`` is ``True`` while it is captured), each checked
on the CPU by running the step on the device stand-in with the kernels emulated
(``tests/test_cuda_graph.py``: the stand-in raises on any of it during a capture and replays what
was recorded):

* read nothing from the device (the embedding's range check and the loss's target check were made
  in the warm-up step; nothing else reads);
* allocate nothing: every array comes from a layer's or the shared ``Buffers``, so each replay
  writes the same addresses the capture recorded. On the GPU a capture allocates from a private
  memory pool all the same (``pool_bytes`` says how much: 0 when the rule holds), so an array made
  during the capture is never handed to anything else, as PyTorch's graph pools do;
* call cuBLAS only through ``hpctrain.nn.cublas`` (CuPy's wrappers refuse a capturing stream);
* copy nothing host->device: the optimizer's per-step scalars live on the device and ``replay``
  uploads them before each launch (``optim.multi_tensor.advance``); a new batch is copied into the
  captured input arrays by the caller before ``replay``.

Dropout draws a host seed per step: it refuses to be captured (the step then runs eagerly).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from .. import backend
from . import gpu


class CapturedStep:
    """``replay()`` runs the captured step again (after ``before_replay``, e.g. the optimizer's
    host side); ``result`` is what the captured call returned (device arrays the replays rewrite)."""

    def __init__(self, graph: Any, stream: Any, pool: Any, result: Any, before_replay: Callable[[], None] | None
                 ) -> None:  # fmt: skip
        self.graph, self.stream, self.pool, self.result = graph, stream, pool, result
        self.before_replay = before_replay

    @property
    def pool_bytes(self) -> int:
        """Bytes the capture allocated (its private pool's size: 0 when the step allocates nothing)."""
        return int(self.pool.total_bytes()) if self.pool is not None else 0

    def replay(self) -> Any:
        """One replay, ordered like any operation on the caller's current stream: after what was
        queued there (a new batch copied in), and before what comes next (a read of ``result``)."""
        caller = backend.cupy().cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        with self.stream:  # the optimizer's uploads in stream order with the graph's launches
            if self.before_replay is not None:
                self.before_replay()
            self.graph.launch(stream=self.stream)
        caller.wait_event(self.stream.record())
        return self.result


def capture(step: Callable[[], Any], warmup: int = 1, before_replay: Callable[[], None] | None = None,
            undo: Callable[[], None] | None = None) -> CapturedStep:
    """Run ``step`` ``warmup`` times on a stream of its own (kernels compile, buffers and cuBLAS's
    handle are made), then capture one more call of it. ``undo`` runs after the capture to take
    back what the captured call did on the host (the optimizer's step count: each replay
    advances it). Raises what the capture raised (``RuntimeError``/``NotImplementedError``):
    the caller falls back to the eager step."""
    cp = backend.cupy()
    if cp is None:
        raise RuntimeError("a CUDA graph needs CuPy and a GPU")
    stream = _stream(cp)
    real = backend.is_real_cupy(cp)
    caller = cp.cuda.get_current_stream()
    stream.wait_event(caller.record())  # after what the caller queued (its batch copied in)
    with stream:
        for _ in range(warmup):
            step()
        stream.synchronize()
        pool = cp.cuda.MemoryPool() if real else None
        allocator = cp.cuda.using_allocator(pool.malloc) if real else nullcontext()
        gpu.capturing = True
        try:
            with allocator:
                stream.begin_capture()
                try:
                    result = step()
                except BaseException:
                    _end_quietly(stream)
                    raise
                graph = stream.end_capture()
        finally:
            gpu.capturing = False
    caller.wait_event(stream.record())  # the warm-up's writes before what the caller does next
    if undo is not None:
        undo()
    return CapturedStep(graph, stream, pool, result, before_replay)


_streams: dict[Any, Any] = {}


def _stream(cp: Any) -> Any:
    """The one stream captures run on (per array module and device): each stream has a cuBLAS
    handle with its own workspace (``hpctrain.nn.cublas``), made once."""
    key = (cp, getattr(cp.cuda.Device(), "id", 0))
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = cp.cuda.Stream(non_blocking=True)
    return stream


def _end_quietly(stream: Any) -> None:
    """End a capture that failed (the step's own error is the one to report)."""
    try:
        stream.end_capture()
    except Exception:  # noqa: BLE001 - an invalidated capture also fails to end: the first error stands
        pass
