"""Lower KV tiers (disk under the prefix cache) against recompute-only, side by side in one run.

Two measurements on the 56M random Llama (float32, CPU), where prefill dominates:

* chat: ``--conversations`` conversations of ``--turns`` turns (a 96-token system prompt, then
  per turn a 96-token user message and a 32-token answer; each turn's prompt is the whole
  conversation so far), taken round-robin, one request at a time, over a device pool of
  ``--pool-blocks`` blocks: the conversations' final contexts add up to 4x the pool, so a
  conversation's earlier turns have left the pool when it comes back. Mean TTFT with prefix
  caching alone (recompute) and with a disk tier (``kv_cache_dir``);
* restart: a request on a known 2,048-token prefix is served and the engine shut down; a new
  engine on the same folder serves the first request on that prefix with another question.
  Its TTFT against a cold engine's (prefix caching, nothing on disk).

The block files sit in the OS page cache (written moments before), as after a process restart
on a running machine; a cold disk read would cost more. Prints JSON with the ratios.

    python benchmarks/kv_tiers.py
    python benchmarks/kv_tiers.py --smoke
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
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import FULL_MODEL, SMOKE_MODEL, build_model

from pagedllm import Engine, SamplingParams

SYSTEM, USER, ANSWER = 96, 96, 32


def engine(model: Path, pool_blocks: int, kv_dir: Path | None) -> Engine:
    extra: dict[str, Any] = {} if kv_dir is None else {"kv_cache_dir": str(kv_dir)}
    return Engine(
        str(model),
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        num_kv_blocks=pool_blocks,  # max_model_len is lowered to what the pool holds
        **extra,
    )


def timed(eng: Engine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One request alone: its time to first token, and its tokens (greedy)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    eng.add_request(f"r{start}", {"prompt_token_ids": prompt}, params)
    ttft, tokens = None, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    assert ttft is not None
    return ttft, tokens


def chat(model: Path, args: argparse.Namespace, vocab: int, kv_dir: Path | None) -> dict:
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(SYSTEM)]
    history = [list(system) for _ in range(args.conversations)]
    eng = engine(model, args.pool_blocks, kv_dir)
    ttfts: list[float] = []
    outputs: list[list[int]] = []
    for _turn in range(args.turns):
        for conv in history:
            conv += [rng.randrange(3, vocab) for _ in range(USER)]
            ttft, answer = timed(eng, conv, ANSWER)
            ttfts.append(ttft)
            outputs.append(answer)
            conv += answer
    stats = eng.get_stats()
    eng.shutdown()
    result = {
        "kv_cache_dir": kv_dir is not None,
        "requests": len(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "prompt_tokens_computed": stats["prompt_tokens_total"],
        "prefix_cache_hits": stats["prefix_cache_hits"],
    }
    if kv_dir is not None:
        result.update(tier_numbers(stats))
    return {**result, "_outputs": outputs, "_context": max(len(c) for c in history)}


def tier_numbers(stats: dict[str, float]) -> dict[str, float]:
    reads, stores = stats["kv_tier_reads"], stats["kv_tier_stores"]
    return {
        "disk_hits": stats["kv_tier_disk_hits"],
        "blocks_written": stores,
        "blocks_read": reads,
        "disk_gib": stats["kv_tier_disk_bytes"] / (1 << 30),
        "read_latency_ms": 1e3 * stats["kv_tier_read_seconds"] / reads if reads else None,
        "store_latency_ms": 1e3 * stats["kv_tier_store_seconds"] / stores if stores else None,
    }


def restart(model: Path, prefix_len: int, vocab: int, root: Path) -> dict:
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    questions = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(2)]
    blocks = 2 * (prefix_len // 16 + 8)
    first = engine(model, blocks, root / "kv")
    timed(first, prefix + questions[0], 8)
    first.shutdown()  # the pool's cached blocks are written to disk
    warm = engine(model, blocks, root / "kv")
    warm_ttft, warm_tokens = timed(warm, prefix + questions[1], 8)
    warm_stats = tier_numbers(warm.get_stats())
    warm.shutdown()
    cold = engine(model, blocks, None)
    cold_ttft, cold_tokens = timed(cold, prefix + questions[1], 8)
    cold.shutdown()
    return {
        "prefix_tokens": prefix_len,
        "cold_ttft_s": cold_ttft,
        "after_restart_ttft_s": warm_ttft,
        "ttft_ratio": cold_ttft / warm_ttft,
        "same_tokens": warm_tokens == cold_tokens,
        "after_restart": warm_stats,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--pool-blocks", type=int, default=112)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    if args.smoke:
        args.conversations, args.turns, args.pool_blocks, args.prefix_len = 4, 2, 24, 256
    vocab = spec["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root / "model", spec, max_positions=4096)
        off = chat(model, args, vocab, None)
        on = chat(model, args, vocab, root / "chat-kv")
        after = restart(model, args.prefix_len, vocab, root)
    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa

    working_set = off["_context"] * args.conversations
    same = off.pop("_outputs") == on.pop("_outputs")
    print(
        json.dumps(
            {
                "benchmark": "kv_tiers",
                "date": time.strftime("%Y-%m-%d"),
                "processor": cpu_model_name(),
                "isa": resolve_isa(),
                "torch_threads": torch.get_num_threads(),
                "model": "smoke" if args.smoke else "56m float32",
                "chat": {
                    "conversations": args.conversations,
                    "turns": args.turns,
                    "pool_tokens": args.pool_blocks * 16,
                    "working_set_tokens": working_set,
                    "working_set_over_pool": working_set / (args.pool_blocks * 16),
                    "recompute": {k: v for k, v in off.items() if not k.startswith("_")},
                    "disk_tier": {k: v for k, v in on.items() if not k.startswith("_")},
                    "same_tokens": same,
                    "ttft_mean_ratio": off["ttft_mean_s"] / on["ttft_mean_s"],
                },
                "restart": after,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
