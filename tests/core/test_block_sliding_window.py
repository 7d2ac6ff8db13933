"""Block sliding window in the block manager and scheduler, without a model: a prompt far longer
than the pool is prefilled chunk by chunk in a window's worth of blocks, and blocks behind the
window go back to the pool as the sequence advances."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import AllocStatus, BlockSpaceManager, window_block_count
from pagedllm.core.scheduler import Scheduler
from tests.core.helpers import fake_step, make_group


def test_long_prompt_runs_in_a_window_of_blocks() -> None:
    window, bs, pool = 8, 4, 6
    bm = BlockSpaceManager(
        bs, pool, 0, watermark=0.0, sliding_window=window, lazy_prompt_blocks=True
    )
    config = SchedulerConfig(
        max_model_len=128, max_num_batched_tokens=8, enable_chunked_prefill=True
    )
    sched = Scheduler(config, bm)
    group = make_group("long", 60, block_size=bs, max_tokens=6)
    assert bm.can_allocate(group) is AllocStatus.OK  # 15 blocks of prompt, 6 in the pool
    sched.add(group)
    seq = group.seqs[0]
    steps = 0
    while sched.has_unfinished():
        out = fake_step(sched)
        steps += 1
        assert all(len(s.token_ids) <= 8 for s in out.seqs)
        assert bm.get_num_free_device_blocks() >= 0
        if seq.is_finished():
            break
        live = len(bm.block_tables[seq.seq_id]) - bm._dead.get(seq.seq_id, 0)
        assert live <= bm.window_blocks() + 2, live  # the window plus one chunk's blocks
    assert seq.get_output_len() == 6 and steps >= 60 // 8
    assert bm.get_num_free_device_blocks() == pool


def test_without_lazy_blocks_the_prompt_needs_them_all() -> None:
    bm = BlockSpaceManager(4, 6, 0, watermark=0.0, sliding_window=8)
    assert bm.can_allocate(make_group("long", 60, block_size=4)) is AllocStatus.NEVER


def _run_alone(window: int, bs: int, pool: int, budget: int, prompt_len: int, new: int) -> int:
    """Step one sequence to its end on ``pool`` blocks; the most blocks it held during a step."""
    bm = BlockSpaceManager(
        bs, pool, 0, watermark=0.0, sliding_window=window, lazy_prompt_blocks=True
    )
    config = SchedulerConfig(
        max_model_len=4096, max_num_batched_tokens=budget, enable_chunked_prefill=True
    )
    sched = Scheduler(config, bm)
    group = make_group("long", prompt_len, block_size=bs, max_tokens=new)
    sched.add(group)
    seq, peak = group.seqs[0], 0
    for _ in range(4 * (prompt_len + new)):
        out = fake_step(sched)
        assert out.seqs, f"stuck at {seq.num_computed_tokens} computed tokens"
        peak = max(peak, pool - bm.get_num_free_device_blocks())
        if seq.is_finished():
            break
    assert seq.get_output_len() == new and bm.get_num_free_device_blocks() == pool
    assert sched.stats.preemptions_recompute == 0, "preempted: the pool was too small"
    return peak


@pytest.mark.parametrize(("window", "bs"), [(24, 8), (17, 8), (25, 8), (5, 4), (1, 4), (8, 16)])
@pytest.mark.parametrize("budget", [1, 7, 512])
def test_window_block_count_is_exactly_enough(window: int, bs: int, budget: int) -> None:
    """With ``window_block_count`` blocks a sequence of any length runs (never stuck, never
    preempted, whatever the chunk budget); with one block fewer a long prompt is refused, so
    admission's cap on max_model_len may count exactly these blocks."""
    need = window_block_count(window, bs)
    # By brute force: the most blocks a sequence keeps after a step with c tokens computed
    # (from position c - window + 1 to c - 1), plus the free block a decode asks for.
    held = max(-(-c // bs) - max(0, c - window + 1) // bs for c in range(window, window + bs))
    assert need == max(2, held + 1)
    prompt_len = 13 * bs + 3
    assert _run_alone(window, bs, need, budget, prompt_len, new=2 * bs + 1) <= need
    bm = BlockSpaceManager(
        bs, need - 1, 0, watermark=0.0, sliding_window=window, lazy_prompt_blocks=True
    )
    if need > 1:
        assert bm.can_allocate(make_group("long", prompt_len, block_size=bs)) is AllocStatus.NEVER
