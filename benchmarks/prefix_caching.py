"""Automatic prefix caching, on vs off in one run: time to first token and total time.

32 requests share a 1,024-token prefix and differ in a 32-token suffix; all arrive at once.
Prints JSON with mean/p50/p99 TTFT and wall time for each setting and the ratios.

    python benchmarks/prefix_caching.py
    python benchmarks/prefix_caching.py --smoke
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import FULL_MODEL, SMOKE_MODEL, build_model

from pagedllm import Engine, SamplingParams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(model: Path, prompts: list[list[int]], max_tokens: int, caching: bool) -> dict:
    engine = Engine(
        str(model),
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        enable_prefix_caching=caching,
        max_num_seqs=len(prompts),
        kv_cache_space=2,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate([{"prompt_token_ids": [5, 6, 7]}], params.clone(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
    total = time.perf_counter() - start
    ttft = list(first.values())
    stats = engine.get_stats()
    return {
        "prefix_caching": caching,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "total_s": total,
        "prompt_tokens_computed": stats["prompt_tokens_total"],
        "prefix_cache_hits": stats["prefix_cache_hits"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    n, prefix_len, suffix_len = (
        (4, 64, 8) if args.smoke else (args.num_requests, args.prefix_len, args.suffix_len)
    )
    rng = random.Random(0)
    vocab = spec["vocab_size"]
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(suffix_len)] for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", spec, max_positions=2048)
        off = run(model, prompts, args.max_tokens, caching=False)
        on = run(model, prompts, args.max_tokens, caching=True)
    print(
        json.dumps(
            {
                "benchmark": "prefix_caching",
                "num_requests": n,
                "prefix_len": prefix_len,
                "suffix_len": suffix_len,
                "off": off,
                "on": on,
                "ttft_mean_speedup": off["ttft_mean_s"] / on["ttft_mean_s"],
                "total_time_speedup": off["total_s"] / on["total_s"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
