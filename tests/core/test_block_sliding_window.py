"""Block sliding window in the block manager and scheduler, without a model: a prompt far longer
than the pool is prefilled chunk by chunk in a window's worth of blocks, and blocks behind the
window go back to the pool as the sequence advances."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import AllocStatus, BlockSpaceManager
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
