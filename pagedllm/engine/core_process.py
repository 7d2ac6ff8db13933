"""The engine core: an ``LLMEngine`` stepping in a process of its own (vLLM V1's shape).

Why a process: one step is Python scheduling plus a forward pass; sharing an interpreter with the
HTTP server means sharing its GIL, and measured served throughput was half of offline. Here the
loop owns its interpreter and the threads the backend configures; the server does HTTP,
tokenization and streaming. The loop, between steps: apply every queued request, abort and call,
acknowledge the adds, step once, and send one message with every request's new output.

Detokenization and stop strings stay here, in the ``LLMEngine``'s output processor, and only the
new text crosses: a stop string must end its sequence in the step that produced it (checked in the
front-end, the core would run one or more steps more per stopped sequence and free its blocks
late), and the offline ``Engine`` shares exactly this code, so both paths give the same text.

The core lives as long as its parent: it exits when the server process is gone (its parent id
changes), so a killed server never leaves a model in memory.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import core_wire as wire
from pagedllm.engine.cpu_binding import CoreThreadBinder, CpuBinding
from pagedllm.log_setup import setup_logging

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 200  # idle wait on the input socket between checks that the parent lives
_STATS_INTERVAL_S = 0.02  # stats go out at most this often while busy (and always when idle)
_MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass(frozen=True)
class CoreSpec:
    """What a launcher (``core_launch.py``) needs to start a core: the engine to build and the
    client's addresses to connect to."""

    model: str
    device: str
    engine_args: dict[str, Any]
    in_addr: str
    out_addr: str
    log_level: int
    cpu_binding: CpuBinding | None = None


class EngineCore:
    """The loop; ``run`` returns the process exit status (0 after a stop, 1 when broken)."""

    def __init__(
        self,
        engine: Any,
        in_sock: Any,
        out_sock: Any,
        parent_pid: int | None,
        binder: CoreThreadBinder | None = None,
    ) -> None:
        self.engine = engine
        self.binder = binder
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.live: set[str] = set()
        self.reorders: dict[str, bool] = {}
        self.delta = wire.DeltaEncoder()
        self.failures = 0
        self.stopping = False
        self.last_stats = 0.0

    def send(self, kind: str, payload: Any) -> None:
        self.out_sock.send(wire.encode_out(kind, payload), copy=False)

    def run(self) -> int:
        import zmq

        poller = zmq.Poller()
        poller.register(self.in_sock, zmq.POLLIN)
        while not self.stopping:
            if self.binder is not None:
                self.binder.maybe_rebind(time.monotonic())
            busy = self.engine.has_unfinished_requests()
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("the server process is gone; the engine core exits")
                return 0
            if poller.poll(0 if busy else _IDLE_POLL_MS):
                self.drain()
            if self.stopping:
                break
            if self.engine.has_unfinished_requests():
                broken = self.step()
                if broken is not None:
                    self.send(wire.DEAD, broken)
                    return 1
            elif time.monotonic() - self.last_stats > 0.5:
                self.send_stats()
        self.finish_all()
        return 0

    # -- commands -------------------------------------------------------------------------------
    def drain(self) -> None:
        import zmq

        acks: list[list[Any]] = []
        while True:
            try:
                data = self.in_sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            message = wire.decode_in(data.buffer)
            self.apply(message, acks)
            if self.stopping:
                break
        if acks:
            self.send(wire.ACKS, acks)

    def apply(self, message: tuple[Any, ...], acks: list[list[Any]]) -> None:
        kind = message[0]
        if kind == wire.ADD:
            _, rid, prompt, params, priority, arrival, lora = message
            received = time.monotonic()  # the request's TTFT starts at ``arrival`` (the server's)
            extra = {} if lora is None else {"lora_request": lora}
            try:
                self.engine.add_request(
                    rid, prompt, params, priority=priority, arrival_time=arrival, **extra
                )
            except Exception as exc:  # the request alone is refused
                acks.append([rid, type(exc).__name__, str(exc), received])
                return
            self.live.add(rid)
            self.reorders[rid] = isinstance(params, SamplingParams) and bool(
                params.use_beam_search or (params.best_of or 1) > params.n
            )
            acks.append([rid, None, None, received])
        elif kind == wire.ABORT:
            ids = [r for r in message[1] if r in self.live]
            if ids:
                self.engine.abort_request(ids)
        elif kind == wire.CALL:
            self.call(message[1], message[2], message[3])
        elif kind == wire.CUT:
            ids = sorted(self.live)
            if ids:
                self.engine.abort_request(ids)
        elif kind == wire.STOP:
            self.stopping = True

    def call(self, call_id: int, fn: Any, args: tuple[Any, ...]) -> None:
        try:
            result, error = fn(self.engine, *args), None
        except BaseException as exc:
            result, error = None, exc
        try:
            blob = wire.encode_in((result, error))
        except Exception as exc:  # an unpicklable result is reported, not fatal
            blob = wire.encode_in((None, TypeError(f"call result cannot be pickled: {exc}")))
        self.send(wire.REPLY, [call_id, blob])

    # -- steps ------------------------------------------------------------------------------------
    def step(self) -> str | None:
        """One step and its message; the error text when the engine is broken, else None."""
        from pagedllm.engine.containment import EngineBrokenError

        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.failures += 1
            logger.error("engine step failed; failing %d requests", len(self.live), exc_info=exc)
            text = f"engine step failed: {type(exc).__name__}: {exc}"
            ids, self.live = sorted(self.live), set()
            for rid in ids:
                self.delta.forget(rid)
                self.reorders.pop(rid, None)
            try:  # the aborts' outputs come from the next step, for nobody: the blocks return
                self.engine.abort_request(ids)
            except Exception:
                logger.exception("could not abort requests after a failed step")
                return text
            self.send(wire.FAILED, [ids, text])
            broken = self.failures >= _MAX_CONSECUTIVE_STEP_FAILURES or isinstance(
                exc, EngineBrokenError
            )
            self.send_stats()
            return text if broken else None
        self.failures = 0
        step_s = time.monotonic() - start
        entries = []
        for out in outputs:
            rid = out.request_id
            if rid not in self.live:
                continue
            entries.append(self.delta.encode(out, reorders=self.reorders.get(rid, False)))
            if out.finished:
                self.live.discard(rid)
                self.reorders.pop(rid, None)
        now = time.monotonic()
        stats = None
        if now - self.last_stats > _STATS_INTERVAL_S or not self.engine.has_unfinished_requests():
            stats, self.last_stats = self.engine.get_stats(), now
        self.send(wire.STEP, [entries, step_s, stats, len(self.live)])
        return None

    def send_stats(self) -> None:
        self.last_stats = time.monotonic()
        self.send(wire.STEP, [[], None, self.engine.get_stats(), len(self.live)])

    def finish_all(self) -> None:
        """At a stop: abort what is left so its streams end with finish_reason "abort"."""
        if self.live:
            try:
                self.engine.abort_request(sorted(self.live))
                while self.live and self.engine.has_unfinished_requests():
                    if self.step() is not None:
                        break
            except Exception:
                logger.exception("abort at shutdown failed")
        self.send_stats()


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (torch, transformers, the model's modules: a few
    hundred thousand objects) out of the cyclic collector's reach. A full collection walks all
    of them, about 150 ms here, and in a serving process it lands in the middle of a step or a
    stream; what start-up built lives until the process exits anyway. The collection first
    walks only what is not frozen yet: called again, it costs what was built since."""
    gc.collect()
    gc.freeze()


def core_main(spec: CoreSpec, parent_pid: int) -> None:
    """The spawned process's entry point: the core's exit status is the process's."""
    from pagedllm.config import core_openmp_env

    os.environ.update(core_openmp_env())  # before torch loads its OpenMP runtime
    setup_logging(spec.log_level)
    sys.exit(run_core(spec, parent_pid))


def run_core(spec: CoreSpec, parent_pid: int | None) -> int:
    """Build the engine, say READY, run the loop; the exit status. Also the body of a Ray
    replica's actor (``dp_ray.py``), where ``parent_pid`` is None: Ray ends an actor whose
    owner is gone. With ``spec.cpu_binding`` the core's threads are bound once the engine (and
    so its OpenMP pool) exists, before READY (see ``cpu_binding.py``)."""
    import zmq

    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.setsockopt(zmq.SNDHWM, 0)
    out_sock.connect(spec.out_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.RCVHWM, 0)
    in_sock.connect(spec.in_addr)
    cpu_binding = spec.cpu_binding
    try:
        from pagedllm.engine.llm_engine import LLMEngine

        # What the imports built (torch's few hundred thousand objects) lives until the process
        # exits: out of the collector's walks from here on (a freeze alone, no collection: the
        # imports leave next to no garbage), so the collection after READY walks only what the
        # engine's build added.
        gc.freeze()
        engine = LLMEngine(spec.model, spec.device, **spec.engine_args)
    except BaseException as exc:
        logger.debug("engine start failed:\n%s", traceback.format_exc())
        out_sock.send(wire.encode_out(wire.DEAD, [type(exc).__name__, str(exc)]))
        out_sock.close(linger=2000)
        in_sock.close(linger=0)
        ctx.term()
        return 1
    binder = None
    if cpu_binding is not None:
        binder = CoreThreadBinder(cpu_binding)
        binder.bind()
        logger.info("CPU binding: %s", cpu_binding.describe())
    out_sock.send(wire.encode_out(wire.READY, ready_info(engine)))
    # After READY, not before: the collection runs while the server's front builds its app,
    # not on the way to /health.
    freeze_startup_objects()
    status = 1
    try:
        status = EngineCore(engine, in_sock, out_sock, parent_pid, binder).run()
    except BaseException as exc:
        logger.exception("the engine core crashed")
        out_sock.send(wire.encode_out(wire.DEAD, f"engine core crashed: {exc!r}"))
    finally:
        try:
            engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")
        out_sock.close(linger=2000)
        in_sock.close(linger=0)
        ctx.term()
    return status


def ready_info(engine: Any) -> dict[str, Any]:
    cfg = engine.config
    return {
        "model": cfg.model.model,
        "served_model_name": cfg.model.served_model_name,
        "tokenizer": cfg.model.tokenizer,
        "has_tokenizer": engine.tokenizer is not None,
        "max_model_len": cfg.scheduler.max_model_len,
        "vocab_size": int(engine.vocab_size),
        "sampling_defaults": dict(engine.sampling_defaults),
        "task": engine.pooling.task,
        "model_task": engine.pooling.model_task,
        "stats": engine.get_stats(),
    }
