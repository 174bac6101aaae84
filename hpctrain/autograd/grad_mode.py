"""Whether operations record the graph: ``no_grad`` / ``enable_grad`` (context managers and
decorators) and ``is_grad_enabled``.

The switch is per thread (as PyTorch's): a communication thread never turns recording off for the
thread that computes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class _State(threading.local):
    enabled = True  # every new thread starts recording
    # ids of leaves whose post-accumulate hooks stay silent in the backwards run now (a node that
    # runs a backward of its own inside its backward: its outer edges signal those leaves once)
    quiet: frozenset | None = None
    runs: list | None = None  # the backwards running now, innermost last (backprop._Backward)


state = _State()


def is_grad_enabled() -> bool:
    """Whether operations on tensors that require a gradient record the graph now."""
    return state.enabled


class _GradMode:
    """A context manager (and decorator) that sets recording for its block, then puts back what
    was there (nesting works: ``enable_grad`` inside ``no_grad`` records)."""

    _mode = True

    def __init__(self) -> None:
        self._prev: list[bool] = []

    def __enter__(self) -> None:
        self._prev.append(state.enabled)
        state.enabled = self._mode

    def __exit__(self, *exc: Any) -> None:
        state.enabled = self._prev.pop()

    def __call__(self, fn: F) -> F:
        mode = type(self)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with mode():
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class quiet_post_hooks:  # noqa: N801 - a context manager, used as ``with``
    """Inside this block, backwards do not call the post-accumulate hooks of ``leaves`` (their
    gradients still accumulate). For a node whose backward runs a backward of its own (an
    explicit module's, a recomputation): the leaves are edges of that node too, so the outer
    backward signals them once, when their last contribution is in."""

    __slots__ = ("ids", "_prev")

    def __init__(self, leaves: Any) -> None:
        self.ids = frozenset(id(t) for t in leaves)

    def __enter__(self) -> None:
        self._prev = state.quiet
        state.quiet = self.ids if self._prev is None else self._prev | self.ids

    def __exit__(self, *exc: Any) -> None:
        state.quiet = self._prev


class no_grad(_GradMode):  # noqa: N801 - PyTorch's name, used the same way
    """Operations in this block record nothing: outputs do not require a gradient and no array is
    kept for a backward (evaluation, parameter updates by hand). As a decorator: the whole call."""

    _mode = False


class enable_grad(_GradMode):  # noqa: N801 - PyTorch's name
    """Recording on for this block, also inside ``no_grad`` (a recomputation in a backward)."""

    _mode = True
