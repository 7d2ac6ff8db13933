"""Property-based: random add / step / abort sequences never break the block accounting."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.core.scheduler import Scheduler
from tests.core.helpers import fake_step, make_group, make_scheduler

actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


def check_invariants(s: Scheduler) -> None:
    bm = s.block_manager
    live = [g for q in (s.waiting, s.running, s.swapped) for g in q]
    device_refs: Counter[int] = Counter()
    host_refs: Counter[int] = Counter()
    for g in live:
        for seq in g.seqs:
            if seq.seq_id not in bm.block_tables:
                continue
            (host_refs if g in s.swapped else device_refs).update(bm._live(seq.seq_id))
    # Every reference a sequence holds is counted once, and no free block is owned.
    for pool, refs in ((bm.device, device_refs), (bm.host, host_refs)):
        for block in range(pool.num_blocks):
            assert pool.ref_counts[block] == refs.get(block, 0), (block, pool.ref_counts[block])
        used = sum(1 for b in range(pool.num_blocks) if pool.ref_counts[b] > 0)
        assert used + pool.num_free == pool.num_blocks
    assert len(s.running) <= s.config.max_num_seqs
    names = [g.request_id for g in live]
    assert len(names) == len(set(names))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=actions,
    mode=st.sampled_from(["recompute", "swap", None]),
    chunked=st.booleans(),
    caching=st.booleans(),
    window=st.sampled_from([None, 6]),
)
def test_random_traffic_keeps_invariants(
    actions: list[tuple[str, int, int]],
    mode: str | None,
    chunked: bool,
    caching: bool,
    window: int | None,
) -> None:
    s = make_scheduler(
        num_blocks=12,
        num_host_blocks=12,
        block_size=4,
        preemption_mode=mode,
        enable_chunked_prefill=chunked,
        enable_caching=caching,
        max_num_seqs=6,
        max_num_batched_tokens=64 if not chunked else 16,
        max_model_len=64,
    )
    counter = 0
    for kind, a, b in actions:
        if kind == "add":
            s.add(
                make_group(f"r{counter}", a, max_tokens=b, tokens=[(i % 5) + 3 for i in range(a)])
            )
            counter += 1
        elif kind == "step":
            for _ in range(a):
                out = fake_step(s)
                assert out.num_batched_tokens <= s.config.token_budget or out.num_prefill_seqs == 1
        else:
            s.abort([f"r{a}"])
        check_invariants(s)
    for _ in range(500):
        if not s.has_unfinished():
            break
        fake_step(s)
        check_invariants(s)
    assert not s.has_unfinished()
    bm = s.block_manager
    assert bm.get_num_free_device_blocks() == 12
    assert bm.get_num_free_host_blocks() == 12
