"""Block sliding window: blocks behind every layer's window are freed, and with chunked prefill a
prompt gets its blocks chunk by chunk, so a sequence longer than the whole KV cache runs in a
window's worth of blocks. Checked end to end against transformers (which masks the same window)
with a cache too small to hold the sequence; and admission's cap on max_model_len counts those
blocks (a model with some full-attention layers is still capped by them)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams
from pagedllm.core.block_manager import window_block_count
from tests.conftest import build_model
from tests.hf_reference import assert_greedy_match, hf_greedy

WINDOW, BLOCK, NUM_BLOCKS, PROMPT_LEN, NEW = 24, 8, 10, 200, 8


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mistral-window")
    return build_model(folder, "mistral", sliding_window=WINDOW)


def test_long_prompt_runs_in_a_cache_smaller_than_the_sequence(windowed_mistral: Path) -> None:
    engine = Engine(
        str(windowed_mistral),
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    assert PROMPT_LEN + NEW > NUM_BLOCKS * BLOCK  # the whole sequence cannot be held
    vocab = engine.vocab_size
    ids = [[3 + (i * 37) % (vocab - 3) for i in range(PROMPT_LEN)]]
    peak = 0
    engine.add_request(
        "long", {"prompt_token_ids": ids[0]}, SamplingParams(temperature=0.0, max_tokens=NEW)
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        used = NUM_BLOCKS - engine.block_manager.get_num_free_device_blocks()
        peak = max(peak, used)
    assert len(outs) == 1 and outs[0].error is None, outs
    assert_greedy_match(outs[0].outputs[0].token_ids, hf_greedy(windowed_mistral, ids, NEW)[0], "")
    assert peak <= NUM_BLOCKS and engine.get_stats()["num_free_device_blocks"] == NUM_BLOCKS


def _run_long_prompt(engine: Engine, model: Path) -> None:
    """The 200-token prompt to its end, greedy equal to transformers, within the 10 blocks."""
    vocab = engine.vocab_size
    ids = [3 + (i * 37) % (vocab - 3) for i in range(PROMPT_LEN)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW)
    engine.add_request("long", {"prompt_token_ids": ids}, params)
    outs, peak = [], 0
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        peak = max(peak, NUM_BLOCKS - engine.block_manager.get_num_free_device_blocks())
    assert len(outs) == 1 and outs[0].error is None, outs
    assert_greedy_match(outs[0].outputs[0].token_ids, hf_greedy(model, [ids], NEW)[0], "")
    assert peak <= NUM_BLOCKS and engine.get_stats()["num_free_device_blocks"] == NUM_BLOCKS


def test_window_cache_keeps_the_context_at_the_default_chunk_budget(
    windowed_mistral: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """10 blocks of 8 hold more than the 5 a 24-token window needs: max_model_len stays the
    model's (it was lowered to 80, counting a whole 512-token chunk as held), and an explicit
    max_model_len past the cache is accepted and served."""
    common = dict(
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        enable_chunked_prefill=True,  # default budget: 512 tokens a step
    )
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        derived = Engine(str(windowed_mistral), **common)
    assert derived.config.scheduler.max_model_len == 512, caplog.text
    assert "lowered" not in caplog.text
    del derived
    engine = Engine(str(windowed_mistral), max_model_len=PROMPT_LEN + NEW, **common)
    assert engine.config.scheduler.max_model_len == PROMPT_LEN + NEW
    _run_long_prompt(engine, windowed_mistral)


def test_the_cap_counts_exactly_the_window_blocks(windowed_mistral: Path) -> None:
    """A 24-token window over blocks of 8 needs 5 blocks (4 it may span, one free for a
    decode): with 5 the context stays the model's, with 4 it is what the cache holds."""
    need = window_block_count(WINDOW, BLOCK)
    assert need == 5
    for blocks, expected in ((need, 512), (need - 1, (need - 1) * BLOCK)):
        engine = Engine(
            str(windowed_mistral),
            device="cpu",
            dtype="float32",
            block_size=BLOCK,
            num_kv_blocks=blocks,
            enable_chunked_prefill=True,
        )
        assert engine.config.scheduler.max_model_len == expected, blocks


def test_full_attention_layers_still_cap_the_context(tmp_path: Path) -> None:
    """A Qwen2-style model whose first layer attends to everything holds every block of a
    sequence: the cache caps max_model_len, and an explicit one past it is refused."""
    model = build_model(
        tmp_path / "qwen2-mixed",
        "qwen2",
        sliding_window=WINDOW,
        use_sliding_window=True,
        max_window_layers=1,  # layer 0 full attention, layer 1 sliding
    )
    common = dict(
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        enable_chunked_prefill=True,
    )
    assert Engine(str(model), **common).config.scheduler.max_model_len == NUM_BLOCKS * BLOCK
    with pytest.raises(ValueError, match=r"^max_model_len: the KV cache holds 80 tokens"):
        Engine(str(model), max_model_len=PROMPT_LEN + NEW, **common)
