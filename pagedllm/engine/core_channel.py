"""The transport under ``EngineCoreClient``: the core's process and the two ZeroMQ sockets to it.

Kept apart from the client so that the client deals in requests and streams only, and
everything that must be released in order (the process stopped, the sockets closed before the
context is terminated, the private socket folder removed) is owned by one object. ZeroMQ is
imported here only, and only once a channel is opened.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from pagedllm.engine import core_wire as wire
from pagedllm.engine.client import EngineDeadError
from pagedllm.engine.core_launch import CoreLauncher, CoreSpec
from pagedllm.engine.cpu_binding import CpuBinding


class CoreChannel:
    """Bind this side's two sockets and start the core, which connects to them.

    ``proc`` is the launcher's handle (shaped like ``multiprocessing.Process``): its
    ``sentinel`` is polled next to ``out`` so that the core's death is seen at once.
    """

    def __init__(
        self,
        launcher: CoreLauncher,
        model: str,
        device: str,
        *,
        engine_args: dict[str, Any],
        cpu_binding: CpuBinding | None,
    ) -> None:
        import zmq

        self._send_lock = threading.RLock()  # reentrant: a signal handler may send mid-send
        self._dir = tempfile.mkdtemp(prefix="pagedllm-core-")  # mode 0700: this user only
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self.out = self._ctx.socket(zmq.PULL)
        self.out.setsockopt(zmq.RCVHWM, 0)
        try:
            in_addr, out_addr = launcher.bind(self._in, self.out, self._dir)
            log_level = logging.getLogger().getEffectiveLevel()
            self.proc: Any = launcher.start(
                CoreSpec(model, device, engine_args, in_addr, out_addr, log_level, cpu_binding)
            )
        except BaseException:
            # A core that could not be launched (a Ray placement group gone, say): the sockets
            # and context go now; left to the garbage collector, term() can block forever.
            self.close()
            raise

    def poller(self) -> Any:
        """A poller over the core's output and its process's sentinel (one per thread)."""
        import zmq

        poller = zmq.Poller()
        poller.register(self.out, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        return poller

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """The core's READY payload; its start-up error raised here (ValueError stays one)."""
        poller = self.poller()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = dict(poller.poll(500))
            if self.out in events:
                kind, payload = wire.decode_out(self.out.recv())
                if kind == wire.READY:
                    return payload
                if kind == wire.DEAD:  # [exception type, message]: ValueError stays one
                    name, message = payload
                    if name == "ValueError":
                        raise ValueError(message)
                    raise RuntimeError(f"the engine core failed to start: {name}: {message}")
            elif events:
                self.proc.join(1)
                raise RuntimeError(
                    f"the engine core exited while starting (exit code {self.proc.exitcode})"
                )
        raise RuntimeError(f"the engine core did not start within {timeout:.0f} s")

    def drain(self) -> Iterator[tuple[str, Any]]:
        """Every message waiting on ``out``, decoded, without blocking."""
        import zmq

        while True:
            try:
                data = self.out.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            yield wire.decode_out(data.buffer)

    def send(self, message: tuple[Any, ...]) -> None:
        """Never blocks: with the core connected the queue is unbounded; without, it is gone."""
        import zmq

        data = wire.encode_in(message)
        with self._send_lock:
            try:
                self._in.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise EngineDeadError("the engine core is not connected") from None

    def stop_core(self, join_timeout: float) -> None:
        """Ask the core to stop (what runs is aborted), wait for it, then make sure it is gone."""
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.send((wire.STOP,))
            self.proc.join(join_timeout)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def close(self) -> None:
        with self._send_lock:
            self._in.close(linger=0)
        self.out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
