"""Chunked prefill and prefix caching change speed, never tokens; stats show they happened."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams
from tests.conftest import PROMPTS

SHARED = (
    "System: you are a helpful assistant that answers questions about paged attention, "
    "KV caches and continuous batching in great detail.\n"
)
SHARED_PROMPTS = [SHARED + p for p in PROMPTS]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run(path: Path, prompts: list[str], **kwargs: object) -> tuple[Engine, list[list[int]]]:
    engine = Engine(str(path), device="cpu", block_size=8, **kwargs)
    outs = engine.generate(prompts, PARAMS, use_tqdm=False)
    return engine, [o.outputs[0].token_ids for o in outs]


def assert_all_free(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    assert bm.get_num_free_host_blocks() == bm.num_host_blocks


@pytest.fixture(scope="module")
def baseline(llama_path: Path) -> list[list[int]]:
    return run(llama_path, SHARED_PROMPTS, num_kv_blocks=256)[1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_prefix_caching": True},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 24},
        {
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 24,
            "enable_prefix_caching": True,
        },
        {"enable_prefix_caching": True, "num_kv_blocks": 24, "preemption_mode": "recompute"},
        {
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 64,
            "num_kv_blocks": 18,
            "preemption_mode": "swap",
            "enable_prefix_caching": True,
        },
    ],
    ids=["prefix", "chunked", "both", "prefix-preempt", "both-preempt-swap"],
)
def test_same_tokens_as_plain_scheduling(
    llama_path: Path, baseline: list[list[int]], kwargs: dict
) -> None:
    engine, tokens = run(llama_path, SHARED_PROMPTS, **kwargs)
    assert tokens == baseline
    # A second pass over the same prompts must hit the prefix cache.
    again = engine.generate(SHARED_PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == baseline
    stats = engine.get_stats()
    if kwargs.get("enable_prefix_caching"):
        assert stats["prefix_cache_hits"] > 0, stats
    if kwargs.get("enable_chunked_prefill"):
        assert stats["chunked_prefill_steps"] > 0, stats
    if "num_kv_blocks" in kwargs:
        assert stats["num_preemptions_total"] > 0, stats
    assert_all_free(engine)


def test_prefix_hit_skips_computation(llama_path: Path) -> None:
    engine = Engine(
        str(llama_path), device="cpu", block_size=8, num_kv_blocks=128, enable_prefix_caching=True
    )
    engine.generate([SHARED_PROMPTS[0]], PARAMS, use_tqdm=False)
    prompt_tokens_before = engine.counters.prompt_tokens
    engine.generate([SHARED_PROMPTS[1]], PARAMS, use_tqdm=False)
    computed = engine.counters.prompt_tokens - prompt_tokens_before
    full = len(engine.tokenizer.encode(SHARED_PROMPTS[1]))
    shared_blocks = len(engine.tokenizer.encode(SHARED)) // 8
    assert computed <= full - (shared_blocks - 1) * 8, (computed, full)
