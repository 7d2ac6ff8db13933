"""AsyncEngine: the synchronous LLMEngine driven from a background thread for asyncio servers.

Why a thread: one ``step()`` is a model forward pass that may take tens of milliseconds or more;
running it on the event loop would freeze every other connection (health checks, new requests,
streams). The engine object is touched only by its own thread. Coroutines talk to it through a
thread-safe command queue that the thread drains between steps, and outputs travel back through
``loop.call_soon_threadsafe`` into one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.core.pooling_params import RequestParams
from pagedllm.engine.client import (
    EngineClientBase,
    EngineDeadError,
    EngineStepError,
    RequestStream,
)
from pagedllm.engine.containment import EngineBrokenError
from pagedllm.engine.stat_logger import StatLogger
from pagedllm.outputs import RequestOutput

# The errors and the stream are client.py's; named here too for callers that import them with
# the in-process engine.
__all__ = ["AsyncEngine", "EngineDeadError", "EngineStepError", "RequestStream", "StatLogger"]

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long the idle thread sleeps on the command queue between stat checks
_MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class _Add:
    stream: RequestStream
    prompt: Any
    params: RequestParams
    priority: int
    done: concurrent.futures.Future[None]
    # When the caller asked (monotonic): the request's TTFT and latency start here, not when
    # the engine thread gets to it after the step in progress.
    arrival_time: float = 0.0
    lora_request: Any = None  # a pagedllm.lora.LoRARequest, or None for the base model


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: concurrent.futures.Future[Any]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Stop:
    pass


@dataclass
class _Cut:
    reason: str


class AsyncEngine(EngineClientBase):
    """Serve an :class:`LLMEngine` to coroutines; see the module docstring for the threading.

    ``on_request_finished`` callbacks run on the engine thread with each final RequestOutput
    (the server's Prometheus histograms use it); they must be quick and thread-safe.
    """

    def __init__(self, engine: Any, *, log_stats_interval: float | None = 5.0) -> None:
        self.engine = engine
        self.on_request_finished: list[Callable[[RequestOutput], None]] = []
        # (kind, seconds): "step" per step and "core_queue" per request (see EngineCoreClient).
        self.on_timing: list[Callable[[str, float], None]] = []
        self._commands: queue.SimpleQueue[_Add | _Call | _Abort | _Stop | _Cut] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._timed: set[str] = set()  # requests whose core_queue time was reported
        self._stats: dict[str, float] = dict(engine.get_stats())
        self._stat_logger = StatLogger(log_stats_interval) if log_stats_interval else None
        self._failures = 0
        self._dead: BaseException | None = None
        self._accepting = True
        self._stopped = False
        self.num_cut = 0  # requests ended by cut_in_flight (a shutdown past its timeout)
        self._num_in_flight = 0  # updated on the engine thread, read anywhere (an int is atomic)
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(
        cls,
        model: str,
        device: str = "auto",
        *,
        log_stats_interval: float | None = 5.0,
        **engine_args: Any,
    ) -> AsyncEngine:
        from pagedllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine(model, device, **engine_args), log_stats_interval=log_stats_interval)

    # -- properties read from the event loop ----------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def get_stats(self) -> dict[str, float]:
        """The engine's stats as of the end of the latest loop iteration (a copy)."""
        return dict(self._stats)

    def describe(self) -> dict[str, Any]:
        """The served model: ``model``, ``served_model_name``, ``max_model_len``, ``vocab_size``,
        ``sampling_defaults``."""
        cfg = self.engine.config
        return {
            "model": cfg.model.model,
            "served_model_name": cfg.model.served_model_name,
            "max_model_len": cfg.scheduler.max_model_len,
            "vocab_size": int(self.engine.vocab_size),
            "sampling_defaults": dict(self.engine.sampling_defaults),
            "task": self.engine.pooling.task,
            "model_task": self.engine.pooling.model_task,
        }

    # -- requests --------------------------------------------------------------------------------
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
        """Queue a request and return its stream; ValueError ("field: msg") if it is invalid.

        ``arrival_time`` (``time.monotonic()``; default now) is where its TTFT starts: the
        server passes the moment the HTTP request came in.
        """
        self._check_alive()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, asyncio.get_running_loop(), self.request_abort)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add(stream, prompt, params, priority, done, arrival, lora_request))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The engine may already hold it; the abort is queued behind the add, so it wins.
            stream.abort()
            raise
        return stream

    def request_abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._commands.put(_Abort(ids))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(engine, *args)`` on the engine thread between steps; its result."""
        self._check_alive()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(_Call(fn, args, done))
        return await asyncio.wrap_future(done)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        if not self._accepting:
            raise EngineDeadError("the engine is shutting down")

    # -- shutdown ------------------------------------------------------------------------------
    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let those in flight finish for ``timeout`` s, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._num_in_flight and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.05)
        if self._num_in_flight:
            logger.warning("shutdown: aborting %d requests still in flight", self._num_in_flight)
        await asyncio.to_thread(self.stop)

    def stop_accepting(self) -> None:
        """New requests are refused (EngineDeadError, a 503) while those in flight go on."""
        self._accepting = False

    def cut_in_flight(self, reason: str) -> None:
        """End every request in flight now: each stream raises EngineDeadError(reason).

        Thread-safe (a signal handler or a timer may call it); the server turns the error into
        an error event and ``[DONE]`` for streams and a JSON 503 for the others.
        """
        self._accepting = False
        self._commands.put(_Cut(reason))

    def stop(self, join_timeout: float = 30.0) -> None:
        """Abort whatever is left, end the thread and release the executor (blocking)."""
        self._accepting = False
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(join_timeout)
        if self._stopped:
            return
        self._stopped = True
        try:
            self.engine.shutdown()
        except Exception:  # best effort at exit
            logger.exception("engine shutdown failed")

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._drain_commands(block=not busy):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._stats = dict(self.engine.get_stats())
                self._num_in_flight = len(self._streams)
                if self._stat_logger is not None:
                    self._stat_logger.maybe_log(self._stats)
                if self._dead is not None:
                    break
        except BaseException as exc:  # never let the thread vanish silently
            logger.exception("engine thread crashed")
            self._dead = exc
        finally:
            self._shutdown_streams()

    def _drain_commands(self, *, block: bool) -> bool:
        """Apply queued commands; False once a stop was asked for."""
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: _Add | _Call | _Abort | _Cut) -> None:
        if isinstance(cmd, _Cut):
            streams, self._streams = self._streams, {}
            self._num_in_flight = 0
            self.num_cut += len(streams)
            if streams:
                logger.warning("cutting %d requests still in flight: %s", len(streams), cmd.reason)
                self.engine.abort_request(list(streams))
            for stream in streams.values():
                self._deliver(stream, EngineDeadError(cmd.reason))
        elif isinstance(cmd, _Abort):
            live = [r for r in cmd.request_ids if r in self._streams]
            if live:
                self.engine.abort_request(live)
        elif isinstance(cmd, _Add):
            if not cmd.done.set_running_or_notify_cancel():
                return
            lora = {} if cmd.lora_request is None else {"lora_request": cmd.lora_request}
            try:
                self.engine.add_request(
                    cmd.stream.request_id,
                    cmd.prompt,
                    cmd.params,
                    priority=cmd.priority,
                    arrival_time=cmd.arrival_time,
                    **lora,
                )
            except BaseException as exc:
                cmd.done.set_exception(exc)
                return
            self._streams[cmd.stream.request_id] = cmd.stream
            self._num_in_flight = len(self._streams)
            cmd.done.set_result(None)
        elif cmd.done.set_running_or_notify_cancel():
            try:
                cmd.done.set_result(cmd.fn(self.engine, *cmd.args))
            except BaseException as exc:
                cmd.done.set_exception(exc)

    def _step(self) -> None:
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._on_step_failure(exc)
            return
        self._failures = 0
        self._timing("step", time.monotonic() - start)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            m = out.metrics
            if (
                m is not None
                and m.first_scheduled_time is not None
                and out.request_id not in (self._timed)
            ):
                self._timed.add(out.request_id)
                self._timing("core_queue", max(0.0, m.first_scheduled_time - m.arrival_time))
            if out.finished:
                # Counted before it leaves the requests in flight (see EngineCoreClient).
                self._report_finished(out)
                self._streams.pop(out.request_id, None)
                self._timed.discard(out.request_id)
            if stream is not None:
                # A request ended by containment hears of it as a failed step (a 500).
                failed = out.failed and out.finished
                self._deliver(stream, EngineStepError(out.error or "") if failed else out)

    def _on_step_failure(self, exc: Exception) -> None:
        """Fail every request in flight, drop them from the engine, and keep serving."""
        self._failures += 1
        logger.error("engine step failed; failing %d requests", len(self._streams), exc_info=exc)
        error = EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}")
        streams, self._streams = self._streams, {}
        try:  # free their blocks before anyone hears of the failure
            self.engine.abort_request(list(streams))
        except Exception as abort_exc:
            logger.exception("could not abort requests after a failed step")
            self._dead = abort_exc
        if self._failures >= _MAX_CONSECUTIVE_STEP_FAILURES or isinstance(exc, EngineBrokenError):
            self._dead = error
        self._num_in_flight = 0
        for stream in streams.values():
            self._deliver(stream, error)

    def _shutdown_streams(self) -> None:
        """On exit: abort whatever is still running so its blocks are freed and callers wake."""
        streams, self._streams = self._streams, {}
        self._num_in_flight = 0
        if streams and self._dead is None:
            try:  # the aborts' final outputs (finish_reason "abort") end the streams normally
                self.engine.abort_request(list(streams))
                for out in self.engine.step():
                    if out.finished and out.request_id in streams:
                        self._deliver(streams.pop(out.request_id), out)
                self._stats = dict(self.engine.get_stats())
            except Exception:
                logger.exception("abort at shutdown failed")
        error = EngineDeadError("the engine shut down before the request finished")
        for stream in streams.values():
            self._deliver(stream, error)
        while True:  # wake anyone still waiting for an add or a call
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, (_Add, _Call)) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(EngineDeadError("the engine has stopped"))

    @staticmethod
    def _deliver(stream: RequestStream, item: RequestOutput | BaseException) -> None:
        # A RuntimeError means the caller's loop is closed: nobody is listening.
        with contextlib.suppress(RuntimeError):
            stream.loop.call_soon_threadsafe(stream.put, item)
