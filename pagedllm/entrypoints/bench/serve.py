"""``pagedllm bench serve``: a load generator against a running OpenAI-style server.

Requests leave at ``--request-rate`` per second (Poisson arrivals, seeded; ``inf`` sends them
all at once), at most ``--max-concurrency`` at a time, each streamed. Measured per request on the
client: time to first token (TTFT), gaps between streamed chunks (ITL), time per output token
after the first (TPOT) and end-to-end latency. The server's /metrics are read before and after,
so the report also shows what the server counted over the same interval.

TTFT ends when the response starts: pagedllm's server answers a stream only once the first
token exists (so that errors come back as a status), and a first token may carry no text (a
special token, or half a UTF-8 character held back), so the first text chunk can come later.
ITL is measured between chunks that carry text, which can hold several tokens; TPOT counts
tokens (from the final usage) and is what the server's ``time_per_output_token`` measures.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from pagedllm.entrypoints.bench.datasets import BenchRequest
from pagedllm.entrypoints.bench.sse_client import StatusError, StreamClient
from pagedllm.entrypoints.bench.stats import latency_rows, print_table, server_side, summarize


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0  # streamed chunks that carried text


def _error_text(body: bytes, status: int) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except Exception:
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"


def request_body(req: BenchRequest, model: str, chat: bool, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


class Progress:
    """The progress bar: a step per finished request, and beside it how many were sent and how
    many are streaming, redrawn on every change. Under load the first requests can take a
    minute to finish; a bar that counted only finished requests (and left tqdm to pace its
    redraws) sat at 0 and then jumped."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.sent = self.streaming = 0

    def on_sent(self) -> None:
        self.sent += 1
        self._show()

    def on_first_token(self) -> None:
        self.streaming += 1
        self._show()

    def on_done(self, streamed: bool) -> None:
        self.streaming -= int(streamed)
        self.bar.update(1)
        self._show()

    def _show(self) -> None:
        self.bar.set_postfix_str(f"sent {self.sent}, streaming {self.streaming}", refresh=True)


async def one_request(
    client: StreamClient,
    body: dict[str, Any],
    chat: bool,
    timeout: float = 600,
    progress: Progress | None = None,
) -> Outcome:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    res = Outcome()
    start = time.perf_counter()
    last = 0.0

    def started() -> None:  # the server answers once the first token exists
        nonlocal last
        last = time.perf_counter()
        res.ttft = last - start
        if progress is not None:
            progress.on_first_token()

    def on_event(event: dict[str, Any]) -> None:
        nonlocal last
        if res.error:
            return
        if "error" in event:
            res.error = event["error"].get("message", "error event")
            return
        choices = event.get("choices") or []
        piece = (
            choices[0].get("delta", {}).get("content")
            if chat and choices
            else (choices[0].get("text") if choices else None)
        )
        if piece:
            now = time.perf_counter()
            if res.chunks:
                res.itl.append(now - last)
            res.chunks += 1
            last = now
        if event.get("usage"):
            res.prompt_tokens = event["usage"]["prompt_tokens"]
            res.output_tokens = event["usage"]["completion_tokens"]

    try:
        await asyncio.wait_for(client.stream(path, body, on_event, started), timeout)
    except StatusError as exc:
        res.error = _error_text(exc.body, exc.status)
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    if res.error:
        return res
    res.e2e = time.perf_counter() - start
    res.ok = res.output_tokens > 0
    if not res.ok:
        res.error = "the stream ended without usage (no tokens)"
    return res


async def run(
    base_url: str,
    requests: list[BenchRequest],
    *,
    model: str | None = None,
    api_key: str | None = None,
    chat: bool = False,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    ignore_eos: bool = True,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Send ``requests`` and return the report (also the server's view from /metrics)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    bar = shown = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req", miniters=1)
        shown = Progress(bar)
    streams = StreamClient(base_url, headers)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(600, connect=10)
    ) as client:
        if model is None:
            r = await client.get("/v1/models", headers=headers)
            if r.status_code != 200:
                raise RuntimeError(f"cannot list models: {_error_text(r.content, r.status_code)}")
            model = str(r.json()["data"][0]["id"])
        gate = asyncio.Semaphore(limit)
        rng = random.Random(seed)

        async def limited(req: BenchRequest) -> Outcome:
            async with gate:
                if shown is not None:
                    shown.on_sent()
                body = request_body(req, model, chat, ignore_eos)
                out = await one_request(streams, body, chat, progress=shown)
            if shown is not None:
                shown.on_done(streamed=out.ttft > 0)
            return out

        metrics_before = (await client.get("/metrics")).text
        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.ensure_future(limited(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        metrics_after = (await client.get("/metrics")).text
    await streams.aclose()
    if bar is not None:
        bar.close()
    report = _report(results, duration, model, request_rate, limit)
    report["server"] = server_side(metrics_before, metrics_after)
    return report


def _report(
    results: list[Outcome], duration: float, model: str, rate: float, concurrency: int
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "model": model,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "request_rate": None if rate == float("inf") else rate,
        "max_concurrency": concurrency,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        # Chunks that carried text; fewer than output tokens where the server sent a lagging
        # reader several tokens at once (its stream coalesces): ITL has one sample per chunk
        # after each request's first, so it may be empty when every answer came in one chunk.
        "text_chunks": sum(r.chunks for r in ok),
        "ttft_ms": summarize([r.ttft for r in ok]),
        "tpot_ms": summarize(tpot),
        "itl_ms": summarize([t for r in ok for t in r.itl]),
        "e2e_ms": summarize([r.e2e for r in ok]),
        # Per request, in seconds, for whoever wants other statistics than the ones above.
        "ttfts_s": [r.ttft for r in ok],
        "tpots_s": tpot,
    }


def print_report(report: dict[str, Any], out: TextIO) -> None:
    server = report.get("server", {})
    rows: list[tuple[str, Any]] = [
        ("Successful requests", report["completed"]),
        ("Failed requests", report["failed"]),
        ("Benchmark duration (s)", report["duration_s"]),
        ("Total input tokens", report["prompt_tokens"]),
        ("Total generated tokens", report["output_tokens"]),
        ("Request throughput (req/s)", report["request_throughput"]),
        ("Output token throughput (tok/s)", report["output_throughput"]),
        ("Total token throughput (tok/s)", report["total_token_throughput"]),
    ]
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        rows += latency_rows(name, report[key])
    if server:
        rows += [
            ("Server /metrics over the run", None),
            ("Requests finished", int(server["requests"])),
            ("Generated tokens", int(server["generation_tokens"])),
        ]
        for key, name in (("ttft", "TTFT"), ("tpot", "TPOT")):
            if "mean_ms" in server[key]:
                rows.append((f"Mean {name} (ms)", server[key]["mean_ms"]))
    print_table("Serving Benchmark Result", rows, out)
    for error in report["errors"]:
        out.write(f"error: {error}\n")


def compare(arrivals: dict[str, Any], all_at_once: dict[str, Any]) -> dict[str, Any]:
    """Both runs of the same requests and the ratios of their latencies (arrivals over burst).

    A burst admits every prompt before decoding settles, so its TPOT is what decoding costs at
    that batch; under arrivals each step also computes the prompts that keep coming, and the
    TPOT ratio says how much a scheduler lets those prompts slow the decodes.
    """
    ratios = {}
    for key in ("tpot_ms", "ttft_ms"):
        a, b = arrivals[key], all_at_once[key]
        for p in ("median", "p99"):
            if a.get(p) and b.get(p):
                ratios[f"{key[:-3]}_{p}"] = a[p] / b[p]
    return {"arrivals": arrivals, "all_at_once": all_at_once, "ratios": ratios}


def print_comparison(report: dict[str, Any], out: TextIO) -> None:
    a, b = report["arrivals"], report["all_at_once"]
    rows: list[tuple[str, Any]] = [(f"arrivals at {a['request_rate']} req/s / all at once", None)]
    for key, name in (("tpot_ms", "TPOT"), ("ttft_ms", "TTFT")):
        for p, label in (("median", "p50"), ("p99", "p99")):
            rows.append(
                (f"{name} {label} (ms)", f"{a[key].get(p, 0):.1f} / {b[key].get(p, 0):.1f}")
            )
    for key, value in report["ratios"].items():
        rows.append((f"Ratio {key.replace('_', ' ').replace('median', 'p50')}", value))
    print_table("Arrivals vs All at Once", rows, out)
