"""Block sliding window: blocks behind every layer's window are freed, and with chunked prefill a
prompt gets its blocks chunk by chunk, so a sequence longer than the whole KV cache runs in a
window's worth of blocks. Checked end to end against transformers (which masks the same window)
with a cache too small to hold the sequence."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams
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
