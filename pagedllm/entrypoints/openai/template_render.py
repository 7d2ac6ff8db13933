"""Chat templates rendered within bounds: in worker processes that are killed when a render
runs past its time, so a hostile template costs its request a 4xx and nothing more.

Why a process and not a step-counting sandbox: measured on this server, ``{{ 3**(3**16) }}`` is
one C-level power that holds the interpreter lock for about a minute (no thread, deadline or
Jinja hook runs meanwhile), and a loop over a plain iterable calls no sandbox hook per step. A
sandbox would also have to re-implement transformers' rendering (message normalisation,
``continue_final_message``, the special-token variables) to give the same prompts. A worker runs
the tokenizer's own ``apply_chat_template``; killing it stops any render, and its memory is
capped (``template_worker.py``). The cost is a pipe round trip per render (docs/models.md) and
a worker start after each kill: jinja2 and the templates alone where the model's tokenizer is
pagedllm's own (``tokenization/``: its ``ChatRenderer`` is sent, no vocabulary), transformers'
import (a few seconds of CPU) where it is transformers' class.

``TemplateRenderer.render`` blocks (the server calls it from its offload threads, where waiting
on the pipe holds no lock); ``check_startup`` renders a one-message conversation so that a
template that cannot is refused before the server answers anything.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.entrypoints.openai.template_worker import _HEADER

logger = logging.getLogger(__name__)

_ROOT = str(Path(__file__).resolve().parents[3])  # the folder that holds the pagedllm package
_WORKER = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from pagedllm.entrypoints.openai.template_worker import main; main()"
)
STARTUP_MESSAGES = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds per render; the defaults leave a normal template (well under 10 ms) far inside."""

    seconds: float = 5.0
    max_chars: int = 4 << 20  # characters of rendered prompt
    memory_bytes: int = 1 << 30  # a worker's memory beyond what it holds after loading
    workers: int = 2
    start_seconds: float = 120.0  # a worker's start (maybe importing transformers), busy host

    def __post_init__(self) -> None:
        for name in ("seconds", "max_chars", "memory_bytes", "workers", "start_seconds"):
            if not 0 < getattr(self, name) < math.inf:  # a bound, never none
                raise ValueError(f"{name}: must be finite and > 0, got {getattr(self, name)!r}")


class ChatTemplateError(ValueError):
    """A render that failed, ran out of its bounds or was stopped; the text names the template.
    ``kind``: "error" (the template raised), "time", "size" or "memory"."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class _WorkerDied(RuntimeError):
    pass


def _spawn(*, preload: bool = False) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, _ROOT, *(["--preload"] if preload else [])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        close_fds=True,
    )


# Workers started before any renderer exists (start_spare_workers), taken by the first ones.
_spares: list[subprocess.Popen[bytes]] = []
_spares_lock = threading.Lock()


def start_spare_workers(count: int) -> None:
    """Start ``count`` workers ahead of the renderer that will use them: ``pagedllm serve``
    calls this while its engine loads, so the interpreter's start and the template imports of
    the start-up check's worker (~0.1-0.25 s on a 2-core host) are not on the way to the
    first ``/health``. A spare waits for its setup (the tokenizer's templates) like any
    worker; one never taken is ended when this process exits (or dies: ``template_worker``)."""
    with _spares_lock:
        if not _spares:
            atexit.register(_end_spares)
        _spares.extend(_spawn(preload=True) for _ in range(count))


def _take_spare() -> subprocess.Popen[bytes] | None:
    with _spares_lock:
        while _spares:
            proc = _spares.pop(0)
            if proc.poll() is None:
                return proc
    return None


def _end_spares() -> None:
    with _spares_lock:
        spares, _spares[:] = list(_spares), []
    for proc in spares:
        proc.kill()
        proc.wait()


class _Worker:
    """One worker process and its pipes; used by one render at a time."""

    def __init__(self, setup: bytes) -> None:
        self.proc = _take_spare() or _spawn()
        self.ready = False
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out = self.proc.stdout.fileno()
        self._send(setup)

    def _send(self, payload: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise _WorkerDied("the template worker exited") from exc

    def _read(self, size: int, deadline: float) -> bytes | None:
        """``size`` bytes, or None when the deadline passes first."""
        parts, got = [], 0
        while got < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                return None
            chunk = os.read(self._out, min(size - got, 1 << 20))
            if not chunk:
                raise _WorkerDied("the template worker exited")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def receive(self, deadline: float) -> dict[str, Any] | None:
        head = self._read(_HEADER.size, deadline)
        if head is None:
            return None
        body = self._read(_HEADER.unpack(head)[0], deadline)
        return None if body is None else json.loads(body)

    def call(self, request: bytes, limits: TemplateLimits) -> dict[str, Any] | None:
        """The worker's reply, or None when the render ran past ``limits.seconds``."""
        if not self.ready:
            if self.receive(time.monotonic() + limits.start_seconds) is None:
                raise _WorkerDied(f"the template worker did not start in {limits.start_seconds} s")
            self.ready = True
        self._send(request)
        return self.receive(time.monotonic() + limits.seconds)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a request left in the buffer: dropped
                    pipe.close()


def _worker_copy(tokenizer: Any) -> Any:
    """What a worker renders with: pagedllm's tokenizer sends its templates and special tokens
    alone (a worker then starts without loading the vocabulary: ~0.1-0.3 s less per start);
    another tokenizer goes whole."""
    from pagedllm.tokenization.tokenizer import Tokenizer

    return tokenizer.chat_renderer() if isinstance(tokenizer, Tokenizer) else tokenizer


class TemplateRenderer:
    """``tokenizer.apply_chat_template(..., tokenize=False)`` in a small pool of killable
    workers; ``name`` says which template it is in every error (the file or the flag)."""

    def __init__(self, tokenizer: Any, name: str, limits: TemplateLimits | None = None) -> None:
        self.name = name
        self.limits = limits or TemplateLimits()
        self._tokenizer = tokenizer
        try:
            setup = (_worker_copy(tokenizer), self.limits.max_chars, self.limits.memory_bytes)
            self._setup: bytes | None = pickle.dumps(setup)
        except Exception as exc:  # a tokenizer class that does not pickle: unbounded, said once
            logger.warning(
                "%s: the tokenizer cannot be copied to a worker process (%s); templates render "
                "in the server's threads, without the time and memory bounds",
                name,
                exc,
            )
            self._setup = None
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    def _acquire(self) -> _Worker:
        assert self._setup is not None
        with self._lock:
            if self._closed:
                raise RuntimeError("the chat template renderer is closed")
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                if len(self._all) < self.limits.workers:
                    worker = _Worker(self._setup)
                    self._all.add(worker)
                    return worker
        wait = self.limits.start_seconds + self.limits.seconds
        try:
            return self._idle.get(timeout=wait)
        except queue.Empty:
            raise RuntimeError(f"no chat template worker came free in {wait} s") from None

    def _release(self, worker: _Worker, *, broken: bool) -> None:
        """Back to the pool; a killed worker's replacement starts now (its import runs while
        nothing waits on it), so the next request does not pay for it."""
        with self._lock:
            if not (broken or self._closed):
                self._idle.put(worker)
                return
            self._all.discard(worker)
            worker.kill()
            if self._closed:
                return
            try:
                assert self._setup is not None
                fresh = _Worker(self._setup)
            except (OSError, _WorkerDied) as exc:
                logger.warning("%s: cannot start a template worker (%s)", self.name, exc)
                return
            self._all.add(fresh)
            self._idle.put(fresh)

    def render(
        self,
        messages: list[dict[str, Any]],
        template: str | None,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The rendered prompt; a ``ChatTemplateError`` naming the template when it fails or
        runs past a bound (the render is then stopped: its worker killed)."""
        request = {"messages": messages, "template": template, "tools": tools, "kwargs": kwargs}
        reply = self._in_thread(request) if self._setup is None else self._exchange(request)
        if reply is None:
            logger.warning(
                "%s: a render ran past %s s and was stopped", self.name, self.limits.seconds
            )
            raise ChatTemplateError(
                f"{self.name} did not finish rendering within {self.limits.seconds:g} s; "
                "the render was stopped",
                "time",
            )
        if "text" in reply:
            return str(reply["text"])
        kind = str(reply.get("kind", "error"))
        if kind == "size":
            why = f"{reply['error']}, more than the {self.limits.max_chars} a render may produce"
            raise ChatTemplateError(f"{self.name}: {why}", kind)
        raise ChatTemplateError(f"{self.name} failed: {reply.get('error')}", kind)

    def _exchange(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The worker's reply; None when the render ran past its time (its worker killed). A
        worker found dead (killed from outside) is replaced and the render tried once more."""
        payload = json.dumps(request).encode()
        for attempt in (1, 2):
            worker = self._acquire()
            broken = True
            try:
                reply = worker.call(payload, self.limits)
                broken = reply is None
                return reply
            except _WorkerDied as exc:
                if attempt == 2:
                    raise RuntimeError(f"{self.name}: {exc}") from None
            finally:
                self._release(worker, broken=broken)
        return None  # not reached

    def _in_thread(self, request: dict[str, Any]) -> dict[str, Any]:
        from pagedllm.entrypoints.openai.template_worker import render

        return render(self._tokenizer, request, self.limits.max_chars)

    def check_startup(self, template: str | None) -> None:
        """Refuse (``ChatTemplateError``, one line) a template that cannot render a one-message
        conversation within the bounds."""
        self.render(STARTUP_MESSAGES, template, add_generation_prompt=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()
