"""The server's own table of requests in flight, for the dashboard.

Why here and not in the engine: the server sees every request it hands to the engine client and
every output it streams back, which is all the dashboard shows (id, state, tokens so far, age).
Keeping the table in the serving layer means it needs nothing from the scheduler, so it works the
same whether the engine loop runs on a thread or in its own process. Aborting goes through the
engine client's ``abort(request_id)``.

``TrackingEngine`` wraps the engine client that the OpenAI handlers use: ``add_request`` and
``generate`` are recorded, everything else is passed through untouched.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# States as the server sees them: added but no token yet (waiting or in prefill), tokens
# flowing, or ended (finished, aborted or failed).
QUEUED, STREAMING, FINISHED = "queued", "streaming", "finished"


@dataclass
class TrackedRequest:
    request_id: str
    arrival: float  # time.time() when the server added it
    prompt_tokens: int = 0
    max_tokens: int | None = None
    state: str = QUEUED
    tokens: int = 0  # generated so far, over all choices
    finish_reason: str | None = None
    ended: float | None = None
    last_token: float | None = None  # time.time() of the latest output that added tokens

    def as_dict(self, now: float) -> dict[str, Any]:
        end = self.ended if self.ended is not None else now
        return {
            "id": self.request_id,
            "state": self.state,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "age_s": round(max(0.0, end - self.arrival), 3),
            "finish_reason": self.finish_reason,
        }


class RequestTracker:
    """In-flight requests plus the last few that ended (kept ``keep_finished_s`` seconds).

    Touched only from the event loop, so no lock is needed.
    """

    def __init__(self, *, keep_finished: int = 20, keep_finished_s: float = 30.0) -> None:
        self.live: OrderedDict[str, TrackedRequest] = OrderedDict()
        self.ended: deque[TrackedRequest] = deque(maxlen=keep_finished)
        self.keep_finished_s = keep_finished_s

    def add(self, request_id: str, prompt: Any, params: Any) -> TrackedRequest:
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        entry = TrackedRequest(
            request_id,
            time.time(),
            prompt_tokens=len(ids or ()),
            max_tokens=getattr(params, "max_tokens", None),
        )
        self.live[request_id] = entry
        return entry

    def update(self, entry: TrackedRequest, out: Any) -> None:
        tokens = sum(len(c.token_ids) for c in out.outputs)
        if tokens > entry.tokens:
            entry.last_token = time.time()
        entry.tokens = tokens
        if entry.tokens and entry.state == QUEUED:
            entry.state = STREAMING
        if out.finished:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            self.finish(entry, "error" if out.error else (reasons[0] if reasons else None))

    def finish(self, entry: TrackedRequest, reason: str | None) -> None:
        if entry.state == FINISHED:
            return
        entry.state, entry.finish_reason, entry.ended = FINISHED, reason, time.time()
        self.live.pop(entry.request_id, None)
        self.ended.append(entry)

    def waits(self, now: float) -> tuple[list[float], list[float]]:
        """How long each live request has waited so far: for its first token (those with none
        yet), and since its last token (those streaming). A stalled server shows here at once,
        long before its requests finish and are counted in the latency histograms."""
        first, since_last = [], []
        for e in list(self.live.values()):
            if e.last_token is None:
                first.append(max(0.0, now - e.arrival))
            else:
                since_last.append(max(0.0, now - e.last_token))
        return first, since_last

    def get(self, request_id: str) -> TrackedRequest | None:
        return self.live.get(request_id)

    def rows(self) -> list[dict[str, Any]]:
        """Live requests oldest first, then those that ended recently, newest first."""
        now = time.time()
        recent = [
            e
            for e in reversed(self.ended)
            if e.ended is not None and now - e.ended <= self.keep_finished_s
        ]
        return [e.as_dict(now) for e in (*self.live.values(), *recent)]


class TrackedStream:
    """A request stream that reports each output it yields to the tracker."""

    def __init__(self, inner: Any, entry: TrackedRequest, tracker: RequestTracker) -> None:
        self._inner, self._entry, self._tracker = inner, entry, tracker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __aiter__(self) -> TrackedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            out = await self._inner.__anext__()
        except StopAsyncIteration:
            self._tracker.finish(self._entry, self._entry.finish_reason)
            raise
        except BaseException:
            self._tracker.finish(self._entry, "error")
            raise
        self._tracker.update(self._entry, out)
        return out

    def abort(self) -> None:
        self._inner.abort()
        self._tracker.finish(self._entry, "abort")


class TrackingEngine:
    """The engine client as the handlers see it, with every request recorded in ``tracker``."""

    def __init__(self, engine: Any, tracker: RequestTracker) -> None:
        self._engine, self.tracker = engine, tracker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def add_request(
        self, request_id: str, prompt: Any, params: Any, **kwargs: Any
    ) -> TrackedStream:
        stream = await self._engine.add_request(request_id, prompt, params, **kwargs)
        return TrackedStream(stream, self.tracker.add(request_id, prompt, params), self.tracker)

    async def generate(
        self, prompt: Any, params: Any, request_id: str, **kwargs: Any
    ) -> AsyncIterator[Any]:
        entry = self.tracker.add(request_id, prompt, params)
        reason = "abort"
        try:
            async for out in self._engine.generate(prompt, params, request_id, **kwargs):
                self.tracker.update(entry, out)
                yield out
            reason = entry.finish_reason or "stop"
        finally:
            self.tracker.finish(entry, reason)
