"""Speculation in the scheduler: n-gram lookup, lookahead slots, and giving back rejected ones."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.core.interfaces import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import SequenceStatus
from pagedllm.core.speculation import LookaheadPlanner, propose_ngram
from pagedllm.spec_decode.config import SpeculativeConfig
from tests.core.helpers import make_group


@pytest.mark.parametrize(
    ("tokens", "k", "n_max", "n_min", "expected"),
    [
        ([1, 2, 3, 9, 1, 2], 2, 3, 1, [3, 9]),  # trailing [1, 2] seen before
        ([1, 2, 3, 9, 1, 2], 5, 3, 1, [3, 9, 1, 2]),  # fewer than k follow
        ([5, 1, 7, 4, 2, 1, 8, 3, 2, 1], 2, 2, 1, [8, 3]),  # longest [2, 1] beats later [1]
        ([1, 7, 1, 8, 1], 1, 3, 1, [8]),  # most recent of equal matches
        ([1, 2, 3, 4], 3, 3, 1, []),  # last token never seen before
        ([4, 1, 2, 5, 2], 3, 3, 2, []),  # only a 1-gram, below n_min
        ([3], 3, 3, 1, []),
    ],
)
def test_propose_ngram(
    tokens: list[int], k: int, n_max: int, n_min: int, expected: list[int]
) -> None:
    assert propose_ngram(tokens, k, n_max, n_min) == expected


def make(num_blocks: int, k: int = 3, block_size: int = 4) -> Scheduler:
    bm = BlockSpaceManager(block_size, num_blocks, 8, watermark=0.0)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=2)
    return Scheduler(
        SchedulerConfig(max_model_len=64, enable_chunked_prefill=False),  # whole-prompt steps
        bm,
        lookahead=LookaheadPlanner(spec, max_model_len=64),
    )


def run_step(s: Scheduler, accept: int | None = None) -> SchedulerOutput:
    """One step; a speculating sequence accepts ``accept`` of its proposals (all if None)."""
    out = s.schedule()
    sampled, extra = {}, {}
    for item in out.seqs:
        if not item.do_sample:
            continue
        props = item.spec_token_ids or []
        a = len(props) if accept is None else min(accept, len(props))
        run = [*props[:a], 99]
        sampled[item.seq_id] = SampledToken(item.seq_id, run[0], -0.5)
        if item.num_spec_tokens:
            extra[item.seq_id] = [SampledToken(item.seq_id, t, -0.5) for t in run[1:]]
    s.update_from_output(out, ModelRunnerOutput(sampled=sampled, spec_tokens=extra))
    for group in s.running:  # what the output processor does with the pending run
        for seq in group.seqs:
            while seq.pending_tokens:
                seq.append_token(*seq.pending_tokens.pop(0))
    return out


def test_lookahead_slots_reserved_and_rejected_ones_given_back() -> None:
    s = make(num_blocks=16)
    group = make_group("a", 6, max_tokens=20, tokens=[5, 6, 7, 8, 5, 6])
    s.add(group)
    run_step(s)  # prefill samples 99
    seq = group.seqs[0]
    assert seq.get_token_ids() == [5, 6, 7, 8, 5, 6, 99]
    # [6, 99] and [99] never occurred before: nothing to propose, a plain decode.
    out = run_step(s)
    assert out.seqs[0].num_spec_tokens == 0
    assert seq.get_token_ids()[-2:] == [99, 99]
    # The trailing [99, 99] never occurred, but [99] did (followed by 99): one proposal.
    out = run_step(s, accept=0)
    item = out.seqs[0]
    assert item.num_spec_tokens == 1 and item.spec_token_ids == [99]
    assert out.num_batched_tokens == 2
    # Rejected: one token emitted, the computed count excludes the rejected slot.
    assert seq.get_len() == 9 and seq.num_computed_tokens == 8
    assert len(s.block_manager.get_block_table(seq)) == 3


def test_accepted_run_advances_computed_tokens() -> None:
    s = make(num_blocks=16, k=3)
    group = make_group("a", 8, max_tokens=30, tokens=[1, 2, 3, 4, 5, 6, 7, 1])
    s.add(group)
    run_step(s)  # prefill; 99 appended -> [.., 1, 99]
    seq = group.seqs[0]
    seq.output_token_ids[-1] = 2  # make the lookup hit: trailing [1, 2] -> [3, 4, 5]
    out = run_step(s)
    item = out.seqs[0]
    assert item.spec_token_ids == [3, 4, 5] and item.token_ids == [2]
    # Slots for positions 8 .. 11 (the fed token and three proposals): 3 blocks of 4.
    assert out.num_batched_tokens == 4 and len(item.block_table) == 3
    assert seq.get_token_ids()[-4:] == [3, 4, 5, 99]
    assert seq.num_computed_tokens == seq.get_len() - 1 == 12
    # The bonus token (position 12) gets its slot when it is fed, next step.
    assert len(s.block_manager.get_block_table(seq)) == 3


def test_rejected_slots_blocks_are_freed() -> None:
    s = make(num_blocks=16, k=5)
    group = make_group("a", 8, max_tokens=30, tokens=[1, 2, 3, 4, 5, 6, 7, 1])
    s.add(group)
    run_step(s)
    seq = group.seqs[0]
    seq.output_token_ids[-1] = 2  # trailing [1, 2] -> [3, 4, 5, 6, 7]
    out = run_step(s, accept=0)
    # Positions 8 .. 13 were reserved: a fourth block; all rejected, it is given back.
    assert out.seqs[0].num_spec_tokens == 5 and len(out.seqs[0].block_table) == 3
    assert seq.get_len() == 10 and seq.num_computed_tokens == 9
    assert s.block_manager.get_num_free_device_blocks() == 16 - 3


def test_lookahead_in_a_tight_cache_leaves_the_pool_whole() -> None:
    # 5 blocks of 4 tokens: two sequences fill them; lookahead only takes what is spare.
    s = make(num_blocks=5, k=3)
    groups = [make_group(n, 7, max_tokens=6, tokens=[1, 2, 1, 2, 1, 2, 1]) for n in "ab"]
    for g in groups:
        s.add(g)
    steps = 0
    while s.has_unfinished() and steps < 30:
        run_step(s)
        bm = s.block_manager
        for g in s.running:  # nothing of a lookahead outlives its step
            for seq in g.seqs:
                assert len(bm.get_block_table(seq)) <= seq.num_blocks_needed()
        for g in list(s.running):
            for seq in g.seqs:
                if seq.get_output_len() >= 6:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        s.free_finished()
        steps += 1
    assert not s.has_unfinished()
    assert s.stats.preemptions > 0  # the cache was tight enough to matter
    assert s.block_manager.get_num_free_device_blocks() == 5


def test_max_tokens_caps_the_lookahead() -> None:
    s = make(num_blocks=16, k=5)
    group = make_group("a", 6, max_tokens=3, tokens=[1, 2, 3, 1, 2, 3])
    s.add(group)
    run_step(s)
    group.seqs[0].output_token_ids[-1] = 1  # trailing [3, 1] -> proposals [2, 3, 1, ...]
    out = run_step(s)
    # Two tokens exist; the third is the last one allowed, so one proposal at most.
    assert out.seqs[0].num_spec_tokens == 1 and out.seqs[0].spec_token_ids == [2]


def test_rejected_runs_back_off() -> None:
    """All proposals rejected: the sequence waits 2, then 4 steps before speculating again."""
    s = make(num_blocks=32, k=2)
    group = make_group("a", 6, max_tokens=40, tokens=[7, 7, 7, 7, 7, 7])
    s.add(group)
    run_step(s)  # prefill: 99 appended; after the next step every step could propose [99, ..]
    pattern = [run_step(s, accept=0).seqs[0].num_spec_tokens > 0 for _ in range(12)]
    assert pattern == [False, True, False, False, True] + [False] * 4 + [True] + [False] * 2
    out = run_step(s)  # the third rejection's wait of 8 steps is still running
    assert out.seqs[0].num_spec_tokens == 0
    pattern = [run_step(s, accept=None).seqs[0].num_spec_tokens > 0 for _ in range(8)]
    assert pattern == [False] * 5 + [True] * 3  # an accepted run resets the wait
