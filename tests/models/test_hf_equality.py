"""Greedy generation equals Hugging Face transformers token for token, on a mixed batch."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedllm import Engine, SamplingParams
from tests.conftest import PROMPTS, TEST_DEVICE, TEST_DTYPE
from tests.hf_reference import HFGreedy, assert_first_logprobs_close, assert_greedy_match, hf_greedy

MAX_NEW = 16
HALF = TEST_DTYPE != "float32"
# Half precision (tools/gpu_check.sh on a GPU) rounds differently from transformers' kernels.
TIE = 2e-2 if HALF else 1e-4
LOGPROB_ATOL = 5e-2 if HALF else 1e-4


@pytest.fixture(scope="module")
def references(tiny_models: dict[str, Path]) -> dict[str, tuple[list[list[int]], list[HFGreedy]]]:
    from transformers import AutoTokenizer

    refs = {}
    for name, path in tiny_models.items():
        tok = AutoTokenizer.from_pretrained(str(path))
        ids = [tok.encode(p) for p in PROMPTS]
        refs[name] = (ids, hf_greedy(path, ids, MAX_NEW, device=TEST_DEVICE, dtype=TEST_DTYPE))
    return refs


@pytest.fixture(autouse=True)
def release_device_memory() -> Iterator[None]:
    """On a GPU each engine takes ``gpu_memory_utilization`` of the whole card for its KV cache,
    counting what earlier engines still hold: a finished test's engine (kept alive by reference
    cycles) must be collected and its blocks handed back, or the next engine gets 0 blocks."""
    yield
    if TEST_DEVICE != "cpu":
        gc.collect()
        torch.cuda.empty_cache()


def run_engine(path: Path, ids: list[list[int]], **kwargs: object) -> tuple[Engine, list]:
    if TEST_DEVICE != "cpu":
        kwargs.setdefault("gpu_memory_utilization", 0.3)
    engine = Engine(str(path), device=TEST_DEVICE, dtype=TEST_DTYPE, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
    outs = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    return engine, outs


def check(outs: list, refs: list[HFGreedy], label: str) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        comp = out.outputs[0]
        assert_greedy_match(comp.token_ids, ref, f"{label} prompt {i}", tie_margin=TIE)
        assert_first_logprobs_close(comp.logprobs[0], ref, f"{label} prompt {i}", LOGPROB_ATOL)


@pytest.mark.parametrize("model", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_matches_transformers(
    tiny_models: dict[str, Path], references: dict, model: str, block_size: int
) -> None:
    ids, refs = references[model]
    engine, outs = run_engine(tiny_models[model], ids, block_size=block_size)
    check(outs, refs, f"{model}/bs{block_size}")
    assert (
        engine.block_manager.get_num_free_device_blocks() == engine.block_manager.num_device_blocks
    )


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_same_tokens(
    tiny_models: dict[str, Path], references: dict, mode: str
) -> None:
    ids, refs = references["llama"]
    # 9 prompts of up to ~30 tokens plus 16 new ones cannot all fit in 14 blocks of 8 tokens.
    engine, outs = run_engine(
        tiny_models["llama"], ids, block_size=8, num_kv_blocks=14, preemption_mode=mode
    )
    check(outs, refs, f"preempt-{mode}")
    stats = engine.get_stats()
    key = "num_preemptions_swap" if mode == "swap" else "num_preemptions_recompute"
    assert stats[key] > 0, f"no {mode} preemption happened: {stats}"
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    assert bm.get_num_free_host_blocks() == bm.num_host_blocks
