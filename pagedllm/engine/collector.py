"""The cyclic garbage collector held off while an engine is built.

Building an engine allocates tens of thousands of container objects that all live on (modules,
parameters, the GGUF metadata, the tokenizer's tables), on top of the few hundred thousand
PyTorch's import left. That churn triggers a full collection (generation 2) in the middle of
the build, which walks every live object to free almost nothing: ~0.15 s of the demo model's
start on a 2-core EPYC, a fifth of ``Engine(...)`` after the imports. The build runs with the
collector paused instead; what it left as garbage is found by the next collection after it.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block; the collector's state (on, or off
    where the caller turned it off) is restored after it, on errors too. Nesting is safe."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def with_collector_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run under :func:`collector_paused` (an engine's ``__init__``)."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with collector_paused():
            return fn(*args, **kwargs)

    return wrapper
