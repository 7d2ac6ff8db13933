"""EngineCoreClient: the ``EngineClient`` protocol (``client.py``) with the engine in a process
of its own.

The server calls the same methods as on the in-process :class:`AsyncEngine` (``add_request``,
``generate``, ``abort``, ``call``, ``get_stats``, ``is_healthy``, ``shutdown``,
``cut_in_flight``, ...), so the routes do not change. Underneath: a spawned core process
(``core_process.py``) and two ZeroMQ sockets (``core_wire.py``), both held by a
``CoreChannel`` (``core_channel.py``). Requests are sent from the caller's thread (a send is a
non-blocking copy into ZeroMQ's queue); one thread here receives the core's per-step messages,
folds the deltas into cumulative outputs and hands each event loop its batch in one wake-up.

The core's death is seen at once: that thread polls the process's sentinel next to the socket,
so every stream fails with ``EngineDeadError`` and ``is_healthy`` turns false (the server's
/health answers 503 and the server exits non-zero), never a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pagedllm.core.pooling_params import RequestParams
from pagedllm.engine import core_wire as wire
from pagedllm.engine.client import (
    EngineClientBase,
    EngineDeadError,
    EngineStepError,
    RequestStream,
    deliver_batch,
)
from pagedllm.engine.core_channel import CoreChannel
from pagedllm.engine.core_launch import CoreLauncher, ProcessLauncher
from pagedllm.engine.cpu_binding import CpuBinding
from pagedllm.engine.early_tokenizer import TokenizerLoad, load_tokenizer_early, tokenizer_of
from pagedllm.engine.stat_logger import StatLogger
from pagedllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

_POLL_MS = 100  # the receiving thread's wake-up to notice a stop
_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": ValueError}


class EngineCoreClient(EngineClientBase):
    """Start the core for ``model`` and talk to it; see the module docstring.

    ``while_starting`` runs in this process once the core is launched, before waiting for it
    to be ready (``pagedllm serve`` imports its HTTP stack and checks its flags there, ~1 CPU
    second that the core's own imports and load then hide); if it raises, the core is stopped
    and the exception passes on.

    ``on_request_finished`` callbacks get each final RequestOutput; ``on_timing`` callbacks get
    ``(kind, seconds)`` with kind ``server_queue`` (the request's arrival, as the server stamps
    it when the HTTP request comes in, to its arrival in the core),
    ``core_queue`` (arrival in the core to first scheduled) or ``step``. Both run on the
    receiving thread: keep them quick and thread-safe.

    ``cpu_binding`` (see ``cpu_binding.py``) is applied by the core to its own threads; where
    this process's threads run is the caller's to decide (``pagedllm serve`` binds them).
    """

    def __init__(
        self,
        model: str,
        device: str = "auto",
        *,
        log_stats_interval: float | None = 5.0,
        startup_timeout: float = 900.0,
        cpu_binding: CpuBinding | None = None,
        launcher: CoreLauncher | None = None,
        name: str | None = None,
        while_starting: Callable[[], None] | None = None,
        tokenizer_load: TokenizerLoad | None = None,
        **engine_args: Any,
    ) -> None:
        self.name = name  # a data-parallel replica's name, put before its errors
        self.on_request_finished: list[Callable[[RequestOutput], None]] = []
        self.on_timing: list[Callable[[str, float], None]] = []
        # Called with the id of every request that leaves this client (finished, failed, cut).
        self.on_request_done: Callable[[str], None] | None = None
        self.num_cut = 0
        self._streams: dict[str, RequestStream] = {}
        self._accs: dict[str, wire.OutputAccumulator] = {}
        self._arrivals: dict[str, float] = {}
        self._adds: dict[str, concurrent.futures.Future[None]] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._dead: BaseException | None = None
        self._accepting = True
        self._stopping = False
        self._stopped = False
        self._core_in_flight = 0
        self._stat_logger = StatLogger(log_stats_interval) if log_stats_interval else None
        self._channel = CoreChannel(
            launcher or ProcessLauncher(),
            model,
            device,
            engine_args=engine_args,
            cpu_binding=cpu_binding,
        )
        self.proc = self._channel.proc
        early = None
        try:
            if while_starting is not None:  # this process's own start, beside the core's
                while_starting()
            early = tokenizer_load or load_tokenizer_early(model, engine_args)
            self.info = self._channel.wait_ready(startup_timeout)
        except BaseException:
            self._channel.kill()
            self._channel.close()
            raise
        self._stats: dict[str, float] = dict(self.info["stats"])
        self.tokenizer: Any = tokenizer_of(self.info, early)
        self._thread = threading.Thread(target=self._receive, name="pagedllm-core-out", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(
        cls,
        model: str,
        device: str = "auto",
        *,
        log_stats_interval: float | None = 5.0,
        cpu_binding: CpuBinding | None = None,
        **engine_args: Any,
    ) -> EngineCoreClient:
        """``engine_args`` may also hold ``launcher``, ``name``, ``startup_timeout`` and
        ``while_starting``."""
        return cls(
            model,
            device,
            log_stats_interval=log_stats_interval,
            cpu_binding=cpu_binding,
            **engine_args,
        )

    # -- what the server reads -----------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self._dead is None and not self._stopped and self.proc.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def get_stats(self) -> dict[str, float]:
        return dict(self._stats)

    def describe(self) -> dict[str, Any]:
        """The served model: ``model``, ``served_model_name``, ``max_model_len``, ``vocab_size``,
        ``sampling_defaults``."""
        keys = ("model", "served_model_name", "max_model_len", "vocab_size", "sampling_defaults")
        return {k: self.info[k] for k in keys} | {
            "task": self.info.get("task", "generate"),
            "model_task": self.info.get("model_task", "generate"),
        }

    # -- requests ----------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: RequestParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> RequestStream:
        """Send a request and return its stream once the core took it (ValueError if not).

        ``arrival_time`` (``time.monotonic()``, one clock for both processes; default now) is
        where its TTFT starts: the server passes the moment the HTTP request came in.
        """
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        stream = RequestStream(request_id, asyncio.get_running_loop(), self.request_abort)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._streams[request_id] = stream
        self._accs[request_id] = wire.OutputAccumulator(request_id)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._arrivals[request_id] = arrival
        self._adds[request_id] = done
        try:
            self._channel.send(
                (wire.ADD, request_id, prompt, params, priority, arrival, lora_request)
            )
        except BaseException:
            self._drop(request_id)
            self._adds.pop(request_id, None)
            raise
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            stream.abort()  # queued behind the add, so the core sees both in order
            raise
        return stream

    def request_abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self._dead is None and not self._stopped:
            with contextlib.suppress(Exception):
                self._channel.send((wire.ABORT, ids))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(engine, *args)`` in the core between steps; ``fn`` must pickle (no lambda)."""
        self._check_alive()
        call_id = next(self._call_ids)
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls[call_id] = done
        try:
            self._channel.send((wire.CALL, call_id, fn, args))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        return await asyncio.wrap_future(done)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        if not self._accepting or self._stopped:
            raise EngineDeadError("the engine is shutting down")

    def _drop(self, request_id: str) -> RequestStream | None:
        self._accs.pop(request_id, None)
        self._arrivals.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        if stream is not None and self.on_request_done is not None:
            try:
                self.on_request_done(request_id)
            except Exception:
                logger.exception("on_request_done callback failed")
        return stream

    # -- shutdown ------------------------------------------------------------------------------
    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let those in flight finish for ``timeout`` s, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.warning("shutdown: aborting %d requests still in flight", len(self._streams))
        await asyncio.to_thread(self.stop)

    def stop_accepting(self) -> None:
        self._accepting = False

    def cut_in_flight(self, reason: str) -> None:
        """End every request in flight now with EngineDeadError(reason); thread-safe."""
        self._accepting = False
        streams = list(self._streams.items())
        for rid, _ in streams:
            self._drop(rid)
        self.num_cut += len(streams)
        if streams:
            logger.warning("cutting %d requests still in flight: %s", len(streams), reason)
            self.request_abort([rid for rid, _ in streams])
        deliver_batch([(s, EngineDeadError(reason)) for _, s in streams])

    def stop(self, join_timeout: float = 30.0) -> None:
        """Ask the core to stop (what runs is aborted), wait for it, release everything."""
        self._accepting = False
        if self._stopped:
            return
        self._stopping = True
        self._channel.stop_core(join_timeout)
        if self._thread.is_alive():
            self._thread.join(5)
        self._stopped = True
        self._fail_all(EngineDeadError("the engine shut down before the request finished"))
        self._channel.close()

    # -- the receiving thread ------------------------------------------------------------------
    def _receive(self) -> None:
        poller = self._channel.poller()
        try:
            while True:
                events = dict(poller.poll(_POLL_MS))
                if self._channel.out in events:
                    for kind, payload in self._channel.drain():
                        self._handle(kind, payload)
                elif events:  # the sentinel: the core is gone
                    self.proc.join(1)
                    if not self._stopping and self._dead is None:
                        self._on_dead(
                            EngineDeadError(
                                f"the engine core process died (exit code {self.proc.exitcode})"
                            )
                        )
                    return
                if self._stopping and not self.proc.is_alive():
                    return
        except Exception as exc:  # never let the thread vanish silently
            logger.exception("the engine client's receiving thread failed")
            self._on_dead(EngineDeadError(f"the engine client failed: {exc!r}"))

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == wire.STEP:
            self._on_step(*payload)
        elif kind == wire.ACKS:
            for rid, error_type, message, received in payload:
                done = self._adds.pop(rid, None)
                sent = self._arrivals.get(rid)
                if sent is not None and error_type is None:
                    self._timing("server_queue", max(0.0, received - sent))
                    self._arrivals[rid] = received  # from now on: its arrival in the core
                if error_type is not None:
                    self._drop(rid)
                    error = _ERRORS.get(error_type, EngineStepError)(message)
                    if done is not None and done.set_running_or_notify_cancel():
                        done.set_exception(error)
                elif done is not None and done.set_running_or_notify_cancel():
                    done.set_result(None)
        elif kind == wire.REPLY:
            call_id, blob = payload
            done = self._calls.pop(call_id, None)
            result, error = wire.decode_in(blob)
            if done is not None and done.set_running_or_notify_cancel():
                if error is not None:
                    done.set_exception(error)
                else:
                    done.set_result(result)
        elif kind == wire.FAILED:
            ids, text = payload
            error = EngineStepError(text)
            deliver_batch([(s, error) for s in (self._drop(r) for r in ids) if s is not None])
        elif kind == wire.DEAD:
            self._on_dead(EngineStepError(str(payload)))

    def _on_step(
        self,
        entries: list[Any],
        step_s: float | None,
        stats: dict[str, float] | None,
        core_in_flight: int,
    ) -> None:
        items: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for entry in entries:
            rid = entry[0]
            acc = self._accs.get(rid)
            if acc is None:  # cut or failed here already; the core's late output is moot
                continue
            out = acc.apply(entry)
            self._time_first(rid, out)
            stream = self._streams.get(rid)
            if out.finished:
                # Counted (metrics) before it leaves the requests in flight: whoever sees the
                # engine idle sees its finish counted too.
                self._report_finished(out)
                self._drop(rid)
            if stream is not None:
                failed = out.failed and out.finished
                items.append((stream, EngineStepError(out.error or "") if failed else out))
        deliver_batch(items)
        self._core_in_flight = core_in_flight
        if step_s is not None:
            self._timing("step", step_s)
        if stats is not None:
            self._stats = stats
            if self._stat_logger is not None:
                self._stat_logger.maybe_log(stats)

    def _time_first(self, rid: str, out: RequestOutput) -> None:
        received = self._arrivals.pop(rid, None)  # its arrival in the core (set by the ack)
        m = out.metrics
        if received is not None and m is not None and m.first_scheduled_time is not None:
            self._timing("core_queue", max(0.0, m.first_scheduled_time - received))

    def _on_dead(self, error: BaseException) -> None:
        if self.name is not None:
            error = EngineDeadError(f"{self.name}: {error}")
        logger.error("the engine core is dead: %s", error)
        self._dead = error
        self._fail_all(EngineDeadError(str(error)))

    def _fail_all(self, error: BaseException) -> None:
        streams = [s for s in (self._drop(r) for r in list(self._streams)) if s is not None]
        deliver_batch([(s, error) for s in streams])
        for pending in (self._adds, self._calls):
            for key in list(pending):
                fut = pending.pop(key, None)
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_exception(EngineDeadError(str(error)))
