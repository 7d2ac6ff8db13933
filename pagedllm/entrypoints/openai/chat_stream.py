"""The choices of a streamed chat completion: what each engine output adds to the client's view.

A stream sends, per choice, an opening role chunk, then only what is new since the last chunk:
text or tool-call deltas, with the logprobs of the new tokens. That bookkeeping is one stream's
state, kept apart from the request flow in ``serving_chat`` (rendering, limits, starting the
engine, framing the events), which hands each output here and sends what comes back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_tools import ToolPlan, ToolStreamer
from pagedllm.outputs import CompletionOutput

# (request, token ids, their logprob entries) -> the response's ``logprobs`` object
LogprobsOf = Callable[
    [ChatCompletionRequest, list[int], list[dict[int, float]] | None], dict[str, Any]
]


class ChatChunks:
    """What one chat stream has sent so far, per choice index, and the chunk choices each new
    output of a choice adds to it."""

    def __init__(self, req: ChatCompletionRequest, plan: ToolPlan, logprobs: LogprobsOf) -> None:
        self.req, self.plan, self._logprobs = req, plan, logprobs
        self.text: dict[int, int] = {}  # characters of content
        self.tokens: dict[int, int] = {}
        self.tools: dict[int, ToolStreamer] = {}  # under tools: each its own

    def choices(self, c: CompletionOutput) -> list[dict[str, Any]]:
        """The chunks one output of choice ``c`` adds: the opening role chunk the first time,
        then its new text or tool-call deltas (none when nothing is new)."""
        chunks = []
        if c.index not in self.text:
            self.text[c.index], self.tokens[c.index] = 0, 0
            opening = {"role": "assistant", "content": ""}
            chunks.append(
                {"index": c.index, "delta": opening, "logprobs": None, "finish_reason": None}
            )
        if self.plan.active:
            streamer = self.tools.setdefault(c.index, ToolStreamer(self.plan))
            choice = self._tool_delta(c, streamer)
        else:
            choice = self._delta(c)
        return chunks if choice is None else [*chunks, choice]

    def _delta(self, c: CompletionOutput) -> dict[str, Any] | None:
        req = self.req
        text_from, tokens_from = self.text[c.index], self.tokens[c.index]
        delta = c.text[text_from:]
        new_tokens = c.token_ids[tokens_from:]
        if not delta and c.finish_reason is None and not (req.logprobs and new_tokens):
            return None
        self.text[c.index], self.tokens[c.index] = len(c.text), len(c.token_ids)
        lp = None
        if req.logprobs:
            lp = self._logprobs(req, new_tokens, (c.logprobs or [])[tokens_from:])
        return {
            "index": c.index,
            "delta": {"content": delta} if delta else {},
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def _tool_delta(self, c: CompletionOutput, streamer: ToolStreamer) -> dict[str, Any] | None:
        """One chunk's choice when tools are in play: content or tool-call deltas."""
        req = self.req
        delta, reason = streamer.delta(c)
        tokens_from = self.tokens[c.index]
        new_tokens = c.token_ids[tokens_from:]
        if delta is None and reason is None and not (req.logprobs and new_tokens):
            return None
        self.tokens[c.index] = len(c.token_ids)
        lp = None
        if req.logprobs:
            lp = self._logprobs(req, new_tokens, (c.logprobs or [])[tokens_from:])
        return {
            "index": c.index,
            "delta": delta or {},
            "logprobs": lp,
            "finish_reason": reason,
            "stop_reason": c.stop_reason,
        }
