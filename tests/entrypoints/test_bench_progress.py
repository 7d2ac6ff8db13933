"""``bench serve``'s progress moves as requests are sent, start streaming and finish."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pagedllm.entrypoints.bench.serve import Progress, one_request


class FakeBar:
    def __init__(self) -> None:
        self.n = 0
        self.postfix = ""
        self.draws = 0

    def update(self, k: int) -> None:
        self.n += k

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text
        self.draws += int(refresh)


class SlowStreams:
    """Answers each stream's first token at once and its end only when ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def stream(
        self,
        path: str,
        body: dict[str, Any],
        on_event: Callable[[dict[str, Any]], None],
        started: Callable[[], None],
    ) -> None:
        started()
        on_event({"choices": [{"text": "a"}]})
        await self.release.wait()
        on_event(
            {"choices": [{"text": "b"}], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
        )


def test_progress_advances_before_any_request_finishes() -> None:
    async def scenario() -> tuple[list[str], list[int], int]:
        bar, streams = FakeBar(), SlowStreams()
        progress = Progress(bar)
        seen, counts = [], []

        async def send() -> None:
            progress.on_sent()
            out = await one_request(streams, {}, chat=False, progress=progress)  # type: ignore[arg-type]
            progress.on_done(streamed=out.ttft > 0)

        tasks = [asyncio.ensure_future(send()) for _ in range(3)]
        await asyncio.sleep(0.05)
        seen.append(bar.postfix)
        counts.append(bar.n)
        streams.release.set()
        await asyncio.gather(*tasks)
        seen.append(bar.postfix)
        counts.append(bar.n)
        return seen, counts, bar.draws

    seen, counts, draws = asyncio.run(scenario())
    assert seen == ["sent 3, streaming 3", "sent 3, streaming 0"]
    assert counts == [0, 3]
    assert draws == 9  # every send, first token and finish is drawn at once
