"""Where the serving processes' threads run (``pagedllm serve --cpu-bind``).

The engine core's main thread is the step's critical path: it runs the scheduler, the input
preparation and the output processing in Python, and it is the OpenMP master of every parallel
region. Whatever the kernel runs in its place (the API server answering a stream, a load
generator, one of the core's own helper threads) delays the whole step; whatever runs in place
of an OpenMP worker only costs while that worker has a share of a parallel region to do, and
most of a small model's step is the master's Python. Left to itself, the kernel parks either
one. With ``auto`` the main thread gets the first CPU the process may use, alone, and every
other thread of both processes (OpenMP workers, the server's event loop and pools, ZeroMQ's I/O
threads) the remaining ones. Measured on 2 cores with 16 and 64 streaming clients (docs/serving.md):
the server and the client spent about a third less CPU per token, and served throughput rose
towards offline.

The plan is made from the CPUs the server process may use (``taskset`` and cgroups are
respected), and only when there are at least two. It is applied by the processes themselves,
thread by thread (``sched_setaffinity`` on each thread id): threads started later inherit the
mask of the thread that starts them, so the core re-applies its plan when its thread count
changes (a grammar-compilation pool, say, started by the main thread).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

BIND_MODES = ("auto", "off")


@dataclass(frozen=True)
class CpuBinding:
    """``core_main``: the engine core's main thread; ``rest``: every other thread."""

    core_main: tuple[int, ...]
    rest: tuple[int, ...]

    @classmethod
    def plan(cls, mode: str, allowed: Iterable[int] | None = None) -> CpuBinding | None:
        """The binding for ``mode`` over ``allowed`` CPUs (default: this process's); None
        when there is nothing to separate (``off``, or fewer than two CPUs)."""
        if mode not in BIND_MODES:
            raise ValueError(f"cpu_bind: must be one of {', '.join(BIND_MODES)}, got {mode!r}")
        if mode == "off":
            return None
        cpus = sorted(set(allowed) if allowed is not None else available_cpus())
        if len(cpus) < 2:
            return None
        return cls(core_main=(cpus[0],), rest=tuple(cpus[1:]))

    def describe(self) -> str:
        return f"engine core main thread on CPU {_cpu_list(self.core_main)}, " + (
            f"every other thread on CPU {_cpu_list(self.rest)}"
        )


def available_cpus() -> set[int]:
    """The CPUs this process may run on (empty where the platform cannot say)."""
    getter = getattr(os, "sched_getaffinity", None)
    return set(getter(0)) if getter is not None else set()


def thread_ids() -> list[int]:
    """Every thread of this process, native ids (Linux: /proc/self/task)."""
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return []


def bind_threads(cpus: Iterable[int], *, main: Iterable[int] | None = None) -> int:
    """Every thread of this process to ``cpus``, the main thread to ``main`` when given;
    returns how many threads were bound (threads that end meanwhile are skipped)."""
    rest, main_cpus = set(cpus), set(main) if main is not None else set(cpus)
    main_tid = os.getpid()
    bound = 0
    for tid in thread_ids():
        try:
            os.sched_setaffinity(tid, main_cpus if tid == main_tid else rest)
        except (ProcessLookupError, PermissionError):
            continue
        bound += 1
    return bound


class CoreThreadBinder:
    """The engine core's side: binds its threads now and again whenever their number changes
    (checked at most every ``interval`` seconds of the core loop's clock)."""

    def __init__(self, binding: CpuBinding, interval: float = 1.0) -> None:
        self.binding = binding
        self.interval = interval
        self._count = -1
        self._checked = float("-inf")

    def bind(self) -> None:
        self._count = len(thread_ids())
        bound = bind_threads(self.binding.rest, main=self.binding.core_main)
        logger.debug("bound %d engine-core threads: %s", bound, self.binding.describe())

    def maybe_rebind(self, now: float) -> None:
        if now - self._checked < self.interval:
            return
        self._checked = now
        if len(thread_ids()) != self._count:
            self.bind()


def _cpu_list(cpus: tuple[int, ...]) -> str:
    """``0`` / ``1-15`` / ``1,3,5``: the shortest of the usual spellings."""
    if len(cpus) > 2 and cpus == tuple(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(c) for c in cpus)
