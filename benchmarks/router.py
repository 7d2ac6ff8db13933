"""Data-parallel routing: prefix-aware vs round robin vs least loaded over 4 replicas, one run.

Workload: 16 sessions, each a ``--system``-token system prompt followed by turns; turn k's
prompt is the whole session so far (system prompt, earlier user messages and answers, the new
``--user``-token message). Sessions are interleaved: each round takes every session once, in a
random order, all 16 arriving together; the next round starts when the answers are in (a user
answers after reading). Each replica's KV pool (``--pool-blocks``) holds about a third of the
sessions' contexts, so where a session's turns go decides whether its prefix is still cached.

Two measurements of the same policies:

* steps: the replicas are ``LLMEngine``s in this process stepped in lockstep (one tick = one step
  of every replica with work, as replicas on their own machines would run), with chunked prefill
  and a ``--step-tokens`` budget per step, so an uncached prefix costs steps. TTFT is counted in
  ticks: the engines' own step counts, which two shared cores cannot distort.
* wall: ``DataParallelClient`` with 4 local replica processes (one thread each) on this machine,
  TTFT in seconds. On a 2-core machine the 4 replicas share 2 cores, so the wall figures show
  the direction, the step figures the size.

Cache-hit rate: prefix-cache hits over lookups, summed over the replicas. The single engine runs
the same trace with the 4 pools together (the best any routing can do).

    python benchmarks/router.py
    python benchmarks/router.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import FULL_MODEL, SMOKE_MODEL, build_model

from pagedllm import Engine, SamplingParams
from pagedllm.engine.router import Router

POLICIES = ("prefix", "round_robin", "least_loaded")
BLOCK = 16


def make_trace(args: argparse.Namespace, vocab: int, seed: int) -> list[list[list[int]]]:
    """Rounds of prompts: ``trace[round][i]`` is one session's next turn (shuffled order)."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    sessions = [words(args.system) for _ in range(args.sessions)]
    rounds = []
    for _ in range(args.turns):
        order = list(range(args.sessions))
        rng.shuffle(order)
        turn = []
        for s in order:
            sessions[s] = sessions[s] + words(args.user)
            turn.append(list(sessions[s]))
            sessions[s] = sessions[s] + words(args.answer)  # the answer joins the history
        rounds.append(turn)
    return rounds


def engine_args(args: argparse.Namespace, pool_blocks: int) -> dict[str, Any]:
    return dict(
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=args.step_tokens,
        num_kv_blocks=pool_blocks,
        block_size=BLOCK,
        cpu_threads=1,
    )


def hit_rate(stats: list[dict[str, float]]) -> float:
    hits = sum(s["prefix_cache_hits"] for s in stats)
    return hits / max(1.0, sum(s["prefix_cache_queries"] for s in stats))


def lockstep(model: Path, rounds: list[list[list[int]]], policy: str, n: int, args: Any) -> dict:
    """The trace over ``n`` in-process engines stepped together; TTFT in ticks."""
    engines = [
        Engine(str(model), **engine_args(args, args.pool_blocks * (4 // n))) for _ in range(n)
    ]
    router = Router(n, policy, block_size=BLOCK, capacity_blocks=args.pool_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
    tick, ttft, ids = 0, [], iter(range(1 << 30))
    for turn in rounds:
        arrival: dict[str, int] = {}
        for prompt in turn:
            rid = f"r{next(ids)}"
            decision = router.choose(prompt)
            router.sent(rid, decision, tokens=len(prompt) + args.answer)
            engines[decision.replica].add_request(rid, {"prompt_token_ids": prompt}, params)
            arrival[rid] = tick
        while any(e.has_unfinished_requests() for e in engines):
            tick += 1
            for e in engines:
                for out in e.step() if e.has_unfinished_requests() else []:
                    if out.outputs[0].token_ids and out.request_id in arrival:
                        ttft.append(tick - arrival.pop(out.request_id))
                    if out.finished:
                        router.finished(out.request_id)
    stats = [e.get_stats() for e in engines]
    for e in engines:
        e.shutdown()
    return {
        "cache_hit_rate": hit_rate(stats),
        "ttft_mean_steps": statistics.mean(ttft),
        "total_steps": tick,
        "prefill_tokens_computed": int(sum(s["prompt_tokens_total"] for s in stats)),
        "requests_per_replica": per_replica(router),
    }


def per_replica(router: Router) -> list[int]:
    counts = [0] * router.num_replicas
    for (replica, _), count in router.stats.decisions.items():
        counts[replica] += count
    return counts


async def wall_policy(client: Any, rounds: list[list[list[int]]], args: Any) -> dict:
    """One policy's trace through the replicas' processes; TTFT from the requests' metrics."""
    params = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
    before = [r.get_stats() for r in client.replicas]
    ttft, ids, start = [], iter(range(1 << 30)), time.perf_counter()

    async def one(prompt: list[int]) -> None:
        rid = f"{client.router.policy}-{next(ids)}"
        stream = await client.add_request(rid, {"prompt_token_ids": prompt}, params)
        async for out in stream:
            last = out
        m = last.metrics
        ttft.append(m.first_token_time - m.arrival_time)

    for turn in rounds:
        await asyncio.gather(*(one(p) for p in turn))
    await asyncio.sleep(0.2)  # the replicas' last stats arrive
    after = [r.get_stats() for r in client.replicas]
    delta = [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before, strict=True)]
    return {
        "cache_hit_rate": hit_rate(delta),
        "ttft_mean_s": statistics.mean(ttft),
        "wall_s": time.perf_counter() - start,
        "requests_per_replica": per_replica(client.router),
    }


def wall(model: Path, args: Any, vocab: int) -> dict[str, dict]:
    """One set of 4 replica processes; each policy gets its own router and a fresh trace of
    the same shape (other token ids), so no policy reuses another's cached blocks."""
    from pagedllm.engine.dp_client import DataParallelClient

    client = DataParallelClient(
        str(model),
        "cpu",
        data_parallel_size=4,
        distributed_executor_backend="mp",
        log_stats_interval=None,
        **{k: v for k, v in engine_args(args, args.pool_blocks).items() if k != "device"},
    )
    results = {}
    try:
        for seed, policy in enumerate(POLICIES, start=1):
            client.router = Router(4, policy, block_size=BLOCK, capacity_blocks=args.pool_blocks)
            results[policy] = asyncio.run(wall_policy(client, make_trace(args, vocab, seed), args))
    finally:
        client.stop()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=512, help="system prompt tokens")
    parser.add_argument("--user", type=int, default=32, help="tokens of each user message")
    parser.add_argument("--answer", type=int, default=16, help="tokens of each answer")
    parser.add_argument("--pool-blocks", type=int, default=256, help="KV blocks per replica")
    parser.add_argument("--step-tokens", type=int, default=256, help="token budget per step")
    parser.add_argument("--no-wall", action="store_true", help="the step counts only")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    if args.smoke:
        args.turns, args.system, args.user, args.answer = 3, 64, 16, 4
        args.pool_blocks, args.step_tokens = 24, 64
    vocab = spec["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", spec, max_positions=2048)
        rounds = make_trace(args, vocab, 0)
        steps = {p: lockstep(model, rounds, p, 4, args) for p in POLICIES}
        steps["single_engine"] = lockstep(model, rounds, "round_robin", 1, args)
        walls = None if args.no_wall else wall(model, args, vocab)
    report(args, steps, walls)


def report(args: Any, steps: dict[str, dict], walls: dict[str, dict] | None) -> None:
    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa

    prefix, rr = steps["prefix"], steps["round_robin"]
    single_rate = steps["single_engine"]["cache_hit_rate"]
    out: dict[str, Any] = {
        "benchmark": "router",
        "date": time.strftime("%Y-%m-%d"),
        "processor": cpu_model_name(),
        "isa": resolve_isa(),
        "model": "smoke" if args.smoke else "56m float32",
        "workload": {
            k: getattr(args, k) for k in ("sessions", "turns", "system", "user", "answer")
        },
        "replicas": 4,
        "pool_blocks_per_replica": args.pool_blocks,
        "steps": steps,
        "steps_ratios": {
            "prefix_hit_rate_over_single_engine": prefix["cache_hit_rate"] / single_rate,
            "round_robin_hit_rate_over_single_engine": rr["cache_hit_rate"] / single_rate,
            "ttft_round_robin_over_prefix": rr["ttft_mean_steps"] / prefix["ttft_mean_steps"],
        },
    }
    if walls is not None:
        out["wall"] = walls
        out["wall_ratios"] = {
            "prefix_hit_rate_over_single_engine": walls["prefix"]["cache_hit_rate"] / single_rate,
            "ttft_round_robin_over_prefix": walls["round_robin"]["ttft_mean_s"]
            / walls["prefix"]["ttft_mean_s"],
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
