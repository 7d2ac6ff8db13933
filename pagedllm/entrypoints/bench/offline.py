"""``pagedllm bench throughput`` and ``bench latency``: the engine without a server.

throughput: every request is queued at once and the engine runs until all are done (the batch
scheduler at full occupancy); reported as requests/s and tokens/s.
latency: one batch of ``--batch-size`` requests end to end, repeated ``--num-iters`` times after
warm-up runs; reported as the distribution of those batch latencies.
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm.entrypoints.bench.datasets import BenchRequest
from pagedllm.entrypoints.bench.stats import PERCENTILES, percentile, summarize


def run_batch(
    engine: Any,
    requests: list[BenchRequest],
    *,
    ignore_eos: bool = True,
    tag: str = "bench",
    bar: Any = None,
) -> tuple[float, int, int]:
    """Queue ``requests``, step until all finish; returns (seconds, prompt, output tokens)."""
    from pagedllm import SamplingParams

    start = time.perf_counter()
    for i, req in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=ignore_eos)
        prompt = {"prompt_token_ids": req.prompt} if isinstance(req.prompt, list) else req.prompt
        engine.add_request(f"{tag}-{i}", prompt, params)
    prompt_tokens = output_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                if out.error:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                prompt_tokens += len(out.prompt_token_ids)
                output_tokens += sum(len(c.token_ids) for c in out.outputs)
                if bar is not None:
                    bar.update(1)
    return time.perf_counter() - start, prompt_tokens, output_tokens


def throughput(
    engine: Any, requests: list[BenchRequest], *, ignore_eos: bool = True, progress: bool = False
) -> dict[str, Any]:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req")
    try:
        elapsed, prompt_tokens, output_tokens = run_batch(
            engine, requests, ignore_eos=ignore_eos, bar=bar
        )
    finally:
        if bar is not None:
            bar.close()
    return {
        "num_requests": len(requests),
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }


def latency(
    engine: Any,
    requests: list[BenchRequest],
    *,
    num_iters: int,
    warmup: int,
    progress: bool = False,
) -> dict[str, Any]:
    if num_iters < 1 or warmup < 0:
        raise ValueError("num_iters: must be >= 1 (and num_iters_warmup >= 0)")
    for i in range(warmup):
        run_batch(engine, requests, tag=f"warmup{i}")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_iters, desc="iterations", unit="it")
    times = []
    try:
        for i in range(num_iters):
            times.append(run_batch(engine, requests, tag=f"iter{i}")[0])
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    ordered = sorted(times)
    return {
        "batch_size": len(requests),
        "num_iters": num_iters,
        "avg_latency_s": sum(times) / len(times),
        "latencies_s": times,
        "percentiles_s": {f"p{p}": percentile(ordered, p) for p in (10, 25, *PERCENTILES)},
        "latency_ms": summarize(times),
    }
