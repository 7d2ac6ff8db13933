"""Scheduler: FCFS order, budgets, prefill/decode separation, preemption, swap-in priority."""

from __future__ import annotations

from pagedllm.core.sequence import SequenceStatus
from tests.core.helpers import fake_step, make_group, make_scheduler


def ids(out) -> list[str]:
    return [s.request_id for s in out.seqs]


def test_fcfs_prefill_then_decode_steps() -> None:
    s = make_scheduler(num_blocks=32)
    for name in "abc":
        s.add(make_group(name, 5))
    out = fake_step(s)
    assert ids(out) == ["a", "b", "c"] and out.num_prefill_seqs == 3
    assert all(x.is_prompt for x in out.seqs)
    out = fake_step(s)
    assert ids(out) == ["a", "b", "c"] and out.num_prefill_seqs == 0
    assert all(len(x.token_ids) == 1 and not x.is_prompt for x in out.seqs)


def test_new_prompt_waits_for_a_prefill_step_not_mixed_with_decodes() -> None:
    s = make_scheduler(num_blocks=32)
    s.add(make_group("a", 5, max_tokens=3))
    fake_step(s)
    s.add(make_group("b", 5))
    out = fake_step(s)
    assert ids(out) == ["b"] and out.num_prefill_seqs == 1  # all-prefill step
    out = fake_step(s)
    assert ids(out) == ["a", "b"] and out.num_prefill_seqs == 0


def test_max_num_seqs_budget() -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=2)
    for name in "abcd":
        s.add(make_group(name, 3, max_tokens=1))
    assert ids(fake_step(s)) == ["a", "b"]
    assert ids(fake_step(s)) == ["c", "d"]


def test_max_num_batched_tokens_budget() -> None:
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=64, max_model_len=64)
    for name in "abc":
        s.add(make_group(name, 30, max_tokens=1))
    out = fake_step(s)
    assert ids(out) == ["a", "b"] and out.num_batched_tokens == 60
    assert ids(fake_step(s)) == ["c"]


def test_too_long_prompt_is_ignored_without_blocking_queue() -> None:
    s = make_scheduler(num_blocks=64, max_model_len=16)
    s.add(make_group("long", 20))
    s.add(make_group("ok", 4))
    out = fake_step(s)
    assert ids(out) == ["ok"]
    ignored = s.take_ignored()
    assert [g.request_id for g in ignored] == ["long"]
    assert ignored[0].seqs[0].status is SequenceStatus.FINISHED_IGNORED


def test_prompt_larger_than_cache_is_ignored() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    s.add(make_group("huge", 20))
    s.add(make_group("ok", 4))
    assert ids(fake_step(s)) == ["ok"]
    assert [g.request_id for g in s.take_ignored()] == ["huge"]


def _fill(s, n: int, prompt: int = 4, max_tokens: int = 20):
    groups = [make_group(f"r{i}", prompt, max_tokens=max_tokens) for i in range(n)]
    for g in groups:
        s.add(g)
    fake_step(s)  # prefill all
    return groups


def test_recompute_preempts_newest_to_front_of_waiting() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, preemption_mode="recompute")
    groups = _fill(s, 4)  # each prompt fills one block exactly
    out = fake_step(s)  # each needs a 2nd block: only the oldest runs
    assert s.stats.preemptions_recompute >= 1
    assert ids(out)[0] == "r0"
    waiting = [g.request_id for g in s.waiting]
    assert waiting == sorted(waiting)  # newest preempted first, re-queued in arrival order
    assert groups[3].seqs[0].status is SequenceStatus.WAITING
    assert groups[3].seqs[0].num_computed_tokens == 0


def test_swap_preemption_and_swapped_return_before_new_prompts() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, num_host_blocks=8, preemption_mode="swap")
    _fill(s, 4, max_tokens=6)
    out = fake_step(s)
    assert s.stats.preemptions_swap >= 1 and len(s.swapped) >= 1
    assert out.blocks_to_swap_out
    s.add(make_group("late", 2, max_tokens=1))
    seen_swap_in = False
    for _ in range(40):
        out = fake_step(s)
        if out.blocks_to_swap_in:
            seen_swap_in = True
        if "late" in ids(out):
            # the newcomer is admitted only once nothing is swapped out
            assert not s.swapped
            break
    assert seen_swap_in
    while s.has_unfinished():
        fake_step(s)
    bm = s.block_manager
    assert bm.get_num_free_device_blocks() == 4 and bm.get_num_free_host_blocks() == 8


def test_abort_frees_blocks_everywhere() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, num_host_blocks=8, preemption_mode="swap")
    _fill(s, 4, max_tokens=10)
    fake_step(s)
    s.add(make_group("w", 3))
    aborted = s.abort([g.request_id for g in [*s.running, *s.swapped, *s.waiting]])
    assert aborted and all(g.is_finished() for g in aborted)
    assert not s.has_unfinished()
    assert s.block_manager.get_num_free_device_blocks() == 4
    assert s.block_manager.get_num_free_host_blocks() == 8


def test_delay_factor_holds_prompts_with_fake_clock() -> None:
    now = [0.0]
    s = make_scheduler(num_blocks=64, delay_factor=1.0, clock=lambda: now[0])
    s.add(make_group("a", 4, max_tokens=10, arrival=0.0))
    fake_step(s)  # nothing running: admitted at once
    now[0] = 1.0
    fake_step(s)  # decode step; last prompt step took 1.0
    s.add(make_group("b", 4, arrival=1.0))
    now[0] = 1.5
    out = fake_step(s)
    assert "b" not in ids(out)  # only 0.5 s waited, less than 1.0 x latency
    now[0] = 2.2
    out = fake_step(s)
    assert ids(out) == ["b"]


def test_chunked_prefill_budget_and_decodes_first() -> None:
    s = make_scheduler(
        num_blocks=64, enable_chunked_prefill=True, max_num_batched_tokens=8, max_model_len=64
    )
    s.add(make_group("short", 3, max_tokens=20))
    out = fake_step(s)
    assert ids(out) == ["short"]
    s.add(make_group("long", 30, max_tokens=2))
    chunks = []
    while True:
        out = fake_step(s)
        assert out.num_batched_tokens <= 8
        # the running decode is always in the step, first in line for the budget
        assert "short" in ids(out)
        long_part = [x for x in out.seqs if x.request_id == "long"]
        if long_part and long_part[0].is_prompt:
            chunks.append(len(long_part[0].token_ids))
        else:
            break
    assert sum(chunks) == 30 and max(chunks) == 7 and len(chunks) == 5
    assert s.stats.chunked_prefill_steps >= 4


def test_chunked_prefill_lists_prompt_chunks_before_decodes() -> None:
    s = make_scheduler(num_blocks=64, enable_chunked_prefill=True, max_num_batched_tokens=16)
    s.add(make_group("a", 3, max_tokens=10))
    fake_step(s)
    s.add(make_group("b", 20, max_tokens=2))
    out = fake_step(s)
    assert [x.request_id for x in out.seqs] == ["b", "a"] and out.num_prefill_seqs == 1
    assert not out.seqs[0].do_sample  # a middle chunk samples nothing


def test_priority_policy_orders_and_preempts_lower_priority() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, policy="priority", max_model_len=64)
    s.add(make_group("low", 12, max_tokens=30, priority=5, arrival=0.0))
    fake_step(s)
    assert [g.request_id for g in s.running] == ["low"]
    s.add(make_group("mid", 4, max_tokens=2, priority=3, arrival=1.0))
    s.add(make_group("high", 8, max_tokens=2, priority=1, arrival=2.0))
    out = fake_step(s)
    assert ids(out)[0] == "high"  # admitted first, by preempting the low-priority group
    assert s.stats.preemptions_recompute == 1
    assert [g.request_id for g in s.waiting][-1] == "low"
    while s.has_unfinished():
        fake_step(s)
    assert s.block_manager.get_num_free_device_blocks() == 4
