"""Where an engine core runs: a spawned local process, or (``dp_ray.py``) a Ray actor.

``EngineCoreClient``'s ``CoreChannel`` (``core_channel.py``) binds its two sockets through the
launcher (which picks the transport: ``ipc://`` in a private folder locally, TCP for a core on
another machine) and holds the handle ``start`` returns, shaped like ``multiprocessing.Process``:
its ``sentinel`` is polled next to the socket, so a core's death is seen at once wherever it ran.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any, Protocol

from pagedllm.engine.core_process import CoreSpec, core_main

__all__ = ["CoreLauncher", "CoreSpec", "ProcessLauncher"]


class CoreLauncher(Protocol):
    """Where a core runs. ``bind`` binds the client's two sockets and returns the addresses
    the core connects to; ``start`` returns a handle shaped like ``multiprocessing.Process``
    (``sentinel``, ``is_alive``, ``join``, ``terminate``, ``kill``, ``exitcode``, ``pid``)."""

    def bind(self, in_sock: Any, out_sock: Any, folder: str) -> tuple[str, str]: ...

    def start(self, spec: CoreSpec) -> Any: ...


class ProcessLauncher:
    """A spawned process on this machine over ``ipc://`` sockets in a private folder."""

    def bind(self, in_sock: Any, out_sock: Any, folder: str) -> tuple[str, str]:
        in_sock.bind(f"ipc://{folder}/in")
        out_sock.bind(f"ipc://{folder}/out")
        return f"ipc://{folder}/in", f"ipc://{folder}/out"

    def start(self, spec: CoreSpec) -> Any:
        proc = mp.get_context("spawn").Process(
            target=core_main,
            name="pagedllm-core",
            daemon=False,
            args=(spec, os.getpid()),
        )
        proc.start()
        return proc
