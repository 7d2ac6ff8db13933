"""A constrained reply of several tool calls ends at its first repeated call.

The JSON schema of a list of calls (``tool_choice: "required"``, or the fallback's
``{"tool_calls": [...]}``) lets a model add calls for as long as ``max_tokens`` allows, and no
JSON schema can forbid a call equal to an earlier one. Small models take that way: the demo model,
free to add calls, wrote the same ``get_weather`` call again and again until ``max_tokens`` in 3
replies of 8. So a repeat ends the reply: the first complete call with the same name and the same
arguments (as JSON values: spacing and key order aside) as an earlier one is dropped with all
after it, the array and the reply are closed after the calls before it, and the choice finishes
as if the model had stopped there (``finish_reason`` "tool_calls"); the request is aborted once
every choice has finished, so the engine stops too.

This runs on the server's side of the engine, on each output before the streamed or unstreamed
reply is built from it, so both see the same cut reply. Outputs are cumulative and a slow reader
may skip some, so the cut is a function of the text alone (the first repeat, wherever the reader
catches up), and the tokens kept are the fewest whose text covers the repeated call: usage and
logprobs agree too. While streaming, a call to a tool already called is held back until it is
complete (it may turn out to be a repeat, which is never sent); ``ToolStreamer`` does that.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from pagedllm.engine.client import RequestStream
from pagedllm.entrypoints.openai.tool_json import ParsedCall, array_calls
from pagedllm.entrypoints.openai.tool_parsers import ToolParser
from pagedllm.outputs import CompletionOutput, RequestOutput


def _key(call: ParsedCall) -> tuple[str, str]:
    try:
        args = json.dumps(json.loads(call.arguments), sort_keys=True)
    except ValueError:
        args = call.arguments
    return call.name, args


def repeat_cut(parser: ToolParser, text: str) -> tuple[str, int] | None:
    """The reply closed after the calls before its first repeated call, and the index past the
    repeated call in ``text``; None when the text so far repeats no call."""
    found = parser.calls_array(text)
    if found is None:
        return None
    pos, closing = found
    seen: set[tuple[str, str]] = set()
    before = pos + 1  # past the last call kept (the array's "[" when none is)
    for call, end in array_calls(text, pos, parser.ARGS_KEYS):
        key = _key(call)
        if key in seen:
            return text[:before] + closing, end
        seen.add(key)
        before = end
    return None


def _tokens_covering(token_ids: list[int], chars: int, decode: Callable[[list[int]], str]) -> int:
    """The fewest leading tokens whose text is at least ``chars`` long (binary search)."""
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return hi


class RepeatStop:
    """One request's outputs (``RequestStream``'s interface), each choice ended at its first
    repeated call; ``decode`` turns token ids into text as the engine's detokenizer does."""

    def __init__(
        self, stream: RequestStream, parser: ToolParser, decode: Callable[[list[int]], str]
    ) -> None:
        self.stream = stream
        self.parser = parser
        self.decode = decode
        self._cut: dict[int, CompletionOutput] = {}  # choice index -> its cut, final output
        self._done = False

    def first(self, out: RequestOutput) -> RequestOutput:
        """The request's first output (``ServingBase.start`` reads it before the stream)."""
        return self._apply(out)

    def __aiter__(self) -> RepeatStop:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        return self._apply(await self.stream.__anext__())

    def abort(self) -> None:
        self.stream.abort()

    def _choice(self, c: CompletionOutput) -> CompletionOutput:
        if c.index in self._cut:
            return self._cut[c.index]
        found = repeat_cut(self.parser, c.text)
        if found is None:
            return c
        text, repeat_end = found
        keep = _tokens_covering(c.token_ids, repeat_end, self.decode)
        cut = dataclasses.replace(
            c,
            text=text,
            token_ids=c.token_ids[:keep],
            logprobs=None if c.logprobs is None else c.logprobs[:keep],
            finish_reason="stop",
            stop_reason=None,
        )
        self._cut[c.index] = cut
        return cut

    def _apply(self, out: RequestOutput) -> RequestOutput:
        outputs = [self._choice(c) for c in out.outputs]
        if not self._cut:
            self._done = out.finished
            return out
        finished = out.finished or all(c.finish_reason is not None for c in outputs)
        if finished and not out.finished:
            self.stream.abort()  # every choice has ended: the engine need not go on
        self._done = finished
        return dataclasses.replace(out, outputs=outputs, finished=finished)


def stop_at_repeats(
    pairs: list[tuple[RequestStream, RequestOutput]],
    parser: ToolParser,
    decode: Callable[[list[int]], str],
) -> list[tuple[Any, RequestOutput]]:
    """``ServingBase.start``'s pairs with each stream's choices ended at their first repeat."""
    wrapped = []
    for stream, first in pairs:
        stop = RepeatStop(stream, parser, decode)
        wrapped.append((stop, stop.first(first)))
    return wrapped
