"""Chunked prefill, on vs off in one run: inter-token latency of running decodes while long
prompts arrive.

Eight requests decode steadily; every few steps a 2,048-token prompt arrives. Without chunking a
prompt's whole prefill is one step that every decode waits for; with chunking each step carries
at most ``--chunk`` prompt tokens beside the decodes. Prints JSON with ITL p50/p99 per setting.

    python benchmarks/chunked_prefill.py
    python benchmarks/chunked_prefill.py --smoke
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_caching import percentile
from throughput import FULL_MODEL, SMOKE_MODEL, build_model

from pagedllm import Engine, SamplingParams


def run(model: Path, args: argparse.Namespace, vocab: int, chunked: bool) -> dict:
    extra = (
        {"enable_chunked_prefill": True, "max_num_batched_tokens": args.chunk}
        if chunked
        else {"enable_chunked_prefill": False, "max_num_batched_tokens": args.long_len + 64}
    )
    engine = Engine(
        str(model),
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=args.long_len + 64,
        kv_cache_space=2,
        **extra,
    )
    rng = random.Random(0)
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i in range(args.num_decodes):
        engine.add_request(
            f"d{i}", {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(16)]}, decode
        )
    last: dict[str, float] = {}
    gaps: list[float] = []
    arrived, step = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if arrived < args.num_long and step >= 4 + arrived * args.long_every:
            prompt = [rng.randrange(3, vocab) for _ in range(args.long_len)]
            engine.add_request(
                f"long{arrived}",
                {"prompt_token_ids": prompt},
                SamplingParams(max_tokens=4, ignore_eos=True),
            )
            arrived += 1
        for out in engine.step():
            if not out.request_id.startswith("d"):
                continue
            now = time.perf_counter()
            if out.request_id in last:
                gaps.append(now - last[out.request_id])
            last[out.request_id] = now
        step += 1
    return {
        "chunked_prefill": chunked,
        "itl_p50_ms": percentile(gaps, 0.5) * 1e3,
        "itl_p99_ms": percentile(gaps, 0.99) * 1e3,
        "itl_max_ms": max(gaps) * 1e3,
        "total_s": time.perf_counter() - start,
        "steps": step,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-decodes", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--num-long", type=int, default=3)
    parser.add_argument("--long-len", type=int, default=2048)
    parser.add_argument("--long-every", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    if args.smoke:
        args.num_decodes, args.decode_tokens, args.num_long = 2, 12, 1
        args.long_len, args.chunk, args.long_every = 96, 32, 4
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", spec, max_positions=args.long_len + 128)
        off = run(model, args, spec["vocab_size"], chunked=False)
        on = run(model, args, spec["vocab_size"], chunked=True)
    print(
        json.dumps(
            {
                "benchmark": "chunked_prefill",
                "num_decodes": args.num_decodes,
                "long_prompt_len": args.long_len,
                "num_long_prompts": args.num_long,
                "chunk_tokens": args.chunk,
                "off": off,
                "on": on,
                "itl_p99_speedup": off["itl_p99_ms"] / on["itl_p99_ms"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
