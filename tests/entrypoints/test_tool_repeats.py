"""A constrained list of tool calls ends at its first repeated call (``tool_repeats``), on
hand-written replies: where the cut falls, what a stream of growing outputs becomes (also for a
reader that skips outputs), and that a stream never sends the repeat."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedllm.entrypoints.openai.serving_tools import ToolPlan, tool_message
from pagedllm.entrypoints.openai.tool_auto import FallbackToolParser
from pagedllm.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    MistralToolParser,
    RequiredCallsParser,
)
from pagedllm.entrypoints.openai.tool_repeats import RepeatStop, repeat_cut
from pagedllm.outputs import CompletionOutput, RequestOutput
from tests.entrypoints.test_tool_parsers import stream

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


@pytest.mark.parametrize(
    ("calls", "kept"),
    [
        ([PARIS, PARIS], [PARIS]),
        ([PARIS, OSLO, ADD, OSLO, PARIS], [PARIS, OSLO, ADD]),
        # The same JSON values with other spacing and key order are a repeat too.
        ([ADD, '{"arguments":{"b":2,"a":1},"name":"add"}'], [ADD]),
        ([PARIS, OSLO, ADD], None),  # no repeat
        ([PARIS, '{"name": "add", "arguments": {"a": 1, "b": 2}}'], None),
    ],
)
def test_the_cut_keeps_the_calls_before_the_first_repeat(
    calls: list[str], kept: list[str] | None
) -> None:
    for parser, head, tail in [
        (RequiredCallsParser(), "[", "]"),
        (FallbackToolParser(), '{"tool_calls": [', "]}"),
    ]:
        text = head + ", ".join(calls)  # the reply as far as the repeat (not yet closed)
        found = repeat_cut(parser, text)
        if kept is None:
            assert found is None
            continue
        assert found is not None
        cut, end = found
        assert cut == head + ", ".join(kept) + tail
        assert json.loads(cut)  # a well-formed reply
        # The index past the repeated call: the first repeat is complete there, not before.
        assert repeat_cut(parser, text[:end]) == found
        assert repeat_cut(parser, text[: end - 1]) is None


def test_only_constrained_lists_of_calls_are_cut() -> None:
    hermes = f"<tool_call>{PARIS}</tool_call><tool_call>{PARIS}</tool_call>"
    assert repeat_cut(HermesToolParser(), hermes) is None
    assert repeat_cut(MistralToolParser(), f"[TOOL_CALLS][{PARIS}, {PARIS}]") is None
    # The fallback's single call and its answer are no list.
    assert repeat_cut(FallbackToolParser(), f'{{"tool_call": {PARIS}}}') is None
    assert repeat_cut(FallbackToolParser(), '{"response": "[1, 1]"}') is None


class FakeStream:
    """``RequestStream``'s interface over prepared outputs; records aborts."""

    def __init__(self, outs: list[RequestOutput]) -> None:
        self.outs = list(outs)
        self.aborted = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.outs or self.aborted:
            raise StopAsyncIteration
        return self.outs.pop(0)

    def abort(self) -> None:
        self.aborted = True


def _outputs(text: str, every: int) -> list[RequestOutput]:
    """The request's outputs as ``text`` grows (one token per character), every ``every``
    characters, the last one finished by max_tokens."""
    ends = [*range(1, len(text), every), len(text)]
    return [
        RequestOutput(
            "r",
            None,
            [1],
            [
                CompletionOutput(
                    0,
                    text[:end],
                    list(range(end)),
                    logprobs=[{i: -0.5} for i in range(end)],
                    finish_reason="length" if end == len(text) else None,
                )
            ],
            finished=end == len(text),
        )
        for end in ends
    ]


async def _read_all(stop: RepeatStop, first: RequestOutput) -> list[RequestOutput]:
    seen = [stop.first(first)]
    async for out in stop:
        seen.append(out)
    return seen


def test_the_stream_of_outputs_ends_at_the_repeat_for_any_reader() -> None:
    """Cut once the repeat is complete: finished with "stop", the tokens that cover the repeat
    (not those generated after it), the engine request aborted; the same for a reader that
    catches up every 7 characters as for one that reads every output."""
    text = '{"tool_calls": [' + ", ".join([PARIS, OSLO, PARIS, ADD, ADD])
    want = '{"tool_calls": [' + f"{PARIS}, {OSLO}" + "]}"
    repeat_end = text.index(PARIS, len('{"tool_calls": [') + len(PARIS)) + len(PARIS)
    finals = []
    for every in (1, 7):
        outs = _outputs(text, every)
        fake = FakeStream(outs[1:])
        stop = RepeatStop(fake, FallbackToolParser(), lambda ids: text[: len(ids)])
        seen = asyncio.run(_read_all(stop, outs[0]))
        last = seen[-1]
        assert last.finished and fake.aborted and fake.outs  # stopped early
        (c,) = last.outputs
        assert c.text == want and c.finish_reason == "stop"
        assert len(c.token_ids) == repeat_end and len(c.logprobs or []) == repeat_end
        assert all(not o.finished for o in seen[:-1])
        finals.append(c)
        message, reason = tool_message(ToolPlan("auto", parser=FallbackToolParser()), c)
        assert reason == "tool_calls" and message["content"] is None
        assert [t["function"]["arguments"] for t in message["tool_calls"]] == [
            '{"city": "Paris"}',
            '{"city": "Oslo"}',
        ]
    assert finals[0] == finals[1]


def test_a_reply_without_repeats_passes_unchanged() -> None:
    text = f"[{PARIS}, {OSLO}, {ADD}]"
    outs = _outputs(text, 5)
    fake = FakeStream(outs[1:])
    stop = RepeatStop(fake, RequiredCallsParser(), lambda ids: text[: len(ids)])
    assert asyncio.run(_read_all(stop, outs[0])) == outs and not fake.aborted


def test_a_stream_never_sends_the_repeated_call() -> None:
    """A call to a tool already called is held until complete; a repeat is then cut away (as
    ``RepeatStop`` does before the streamer sees it), and a different one goes out whole."""
    plan = ToolPlan("required", parser=RequiredCallsParser())
    # The reply the streamer sees: it grows up to the repeat, then comes back cut.
    _, calls, reason = stream(plan, f"[{PARIS}, {OSLO}]")
    assert reason == "tool_calls" and [c["arguments"] for c in calls] == [
        '{"city": "Paris"}',
        '{"city": "Oslo"}',
    ]
    assert len(calls[0]["pieces"]) > 1  # the first call streamed its arguments as they grew
    assert calls[1]["pieces"] == ['{"city": "Oslo"}']  # the second went out once complete
    # Cut by max_tokens inside a held call: it goes out with its arguments so far, as unstreamed.
    cut = f'[{PARIS}, {{"name": "get_weather", "arguments": {{"city": "Pa'
    _, calls, reason = stream(plan, cut, "length")
    message, unstreamed_reason = tool_message(plan, _outputs(cut, len(cut))[-1].outputs[0])
    assert reason == unstreamed_reason == "length"
    assert [c["arguments"] for c in calls] == [
        t["function"]["arguments"] for t in message["tool_calls"]
    ]
    assert calls[1]["arguments"] == '{"city": "Pa'


def test_each_choice_ends_at_its_own_repeat() -> None:
    """``n`` = 2: a choice cut at its repeat stays cut in every later output while the other
    goes on; the request ends (and is aborted) once both have ended."""
    texts = ["[" + ", ".join([PARIS, PARIS, OSLO, ADD]), "[" + ", ".join([OSLO, ADD, PARIS, OSLO])]
    longest = max(map(len, texts))

    def output(end: int) -> RequestOutput:
        return RequestOutput(
            "r",
            None,
            [1],
            [
                CompletionOutput(i, t[:end], list(range(min(end, len(t)))))
                for i, t in enumerate(texts)
            ],
            finished=False,
        )

    outs = [output(end) for end in range(1, longest + 1, 3)]
    fake = FakeStream(outs[1:])
    stop = RepeatStop(fake, RequiredCallsParser(), lambda ids: texts[0][: len(ids)])
    seen = asyncio.run(_read_all(stop, outs[0]))
    assert seen[-1].finished and fake.aborted
    first, second = seen[-1].outputs
    assert first.text == f"[{PARIS}]" and second.text == f"[{OSLO}, {ADD}, {PARIS}]"
    cut_at = next(i for i, o in enumerate(seen) if o.outputs[0].finish_reason == "stop")
    assert all(o.outputs[0] == first for o in seen[cut_at:])
    assert all(o.outputs[1].finish_reason is None for o in seen[:-1])
