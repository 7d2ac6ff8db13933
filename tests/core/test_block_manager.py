"""Block manager: exact block ids, reference counts, copy-on-write, swapping, prefix caching."""

from __future__ import annotations

import pytest

from pagedllm.core.block_manager import AllocStatus, BlockAllocator, BlockSpaceManager
from pagedllm.core.sequence import SequenceStatus
from tests.core.helpers import make_group


def test_allocator_free_list_and_refcounts() -> None:
    a = BlockAllocator(3)
    assert [a.allocate(), a.allocate()] == [0, 1]
    a.incref(1)
    a.free(1)
    assert a.ref_counts[1] == 1 and a.num_free == 1
    a.free(1)
    a.free(0)
    assert a.num_free == 3
    assert [a.allocate(), a.allocate(), a.allocate()] == [2, 1, 0]  # FIFO reuse
    with pytest.raises(RuntimeError):
        a.allocate()


def test_allocate_shares_prompt_blocks_and_frees_all() -> None:
    bm = BlockSpaceManager(4, 8, 4, watermark=0.0)
    g = make_group("a", 10)
    assert bm.can_allocate(g) is AllocStatus.OK
    bm.allocate(g)
    seq = g.seqs[0]
    assert bm.get_block_table(seq) == [0, 1, 2]
    assert bm.get_num_free_device_blocks() == 5
    bm.free(seq)
    assert bm.get_num_free_device_blocks() == 8


def test_can_allocate_never_and_later() -> None:
    bm = BlockSpaceManager(4, 4, 0, watermark=0.0)
    assert bm.can_allocate(make_group("big", 17)) is AllocStatus.NEVER
    g = make_group("a", 12)
    bm.allocate(g)
    assert bm.can_allocate(make_group("b", 8)) is AllocStatus.LATER
    assert bm.can_allocate(make_group("c", 4)) is AllocStatus.OK


def test_watermark_keeps_blocks_back() -> None:
    bm = BlockSpaceManager(4, 100, 0, watermark=0.05)
    assert bm.watermark_blocks == 5
    assert bm.can_allocate(make_group("a", 4 * 96)) is AllocStatus.NEVER
    assert bm.can_allocate(make_group("b", 4 * 95)) is AllocStatus.OK


def test_fork_then_append_copies_on_write() -> None:
    bm = BlockSpaceManager(4, 8, 0, watermark=0.0)
    g = make_group("a", 6)
    bm.allocate(g)
    parent = g.seqs[0]
    parent.num_computed_tokens = 6
    parent.output_token_ids.append(9)  # 7 tokens: the 7th goes into block 1, shared after fork
    child = parent.fork(100)
    bm.fork(parent, child)
    assert bm.device.ref_counts[0] == 2 and bm.device.ref_counts[1] == 2
    pairs = bm.append_slots(child)
    assert pairs == [(1, 2)]
    assert bm.get_block_table(child) == [0, 2]
    assert bm.device.ref_counts[1] == 1
    assert bm.append_slots(parent) == []  # now the sole owner of block 1
    bm.free(parent)
    bm.free(child)
    assert bm.get_num_free_device_blocks() == 8


def test_swap_out_and_in_map_shared_blocks_once() -> None:
    bm = BlockSpaceManager(4, 6, 6, watermark=0.0)
    g = make_group("a", 8)
    bm.allocate(g)
    parent = g.seqs[0]
    child = parent.fork(200)
    g.add_seq(child)
    bm.fork(parent, child)
    for s in g.seqs:
        s.status = SequenceStatus.RUNNING
    assert bm.can_swap_out(g)
    out = bm.swap_out(g)
    assert out == [(0, 0), (1, 1)]
    assert bm.get_num_free_device_blocks() == 6 and bm.host.ref_counts[:2] == [2, 2]
    for s in g.seqs:
        s.status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(g) is AllocStatus.OK
    back = bm.swap_in(g)
    assert back == [(0, 2), (1, 3)]  # freed device blocks go to the back of the free list
    assert bm.get_num_free_host_blocks() == 6
    assert bm.device.ref_counts[2:4] == [2, 2]


def _computed(bm: BlockSpaceManager, group) -> None:
    seq = group.seqs[0]
    seq.num_computed_tokens = seq.get_len()
    bm.mark_computed(seq)


def test_prefix_cache_reuses_full_blocks_only() -> None:
    bm = BlockSpaceManager(4, 10, 0, watermark=0.0, enable_caching=True)
    shared = list(range(10, 18))  # two full blocks
    a = make_group("a", 0, tokens=[*shared, 1, 2])
    bm.allocate(a)
    assert a.seqs[0].num_computed_tokens == 0
    _computed(bm, a)
    b = make_group("b", 0, tokens=[*shared, 3])
    bm.allocate(b)
    assert bm.get_block_table(b.seqs[0])[:2] == bm.get_block_table(a.seqs[0])[:2]
    assert bm.get_block_table(b.seqs[0])[2] != bm.get_block_table(a.seqs[0])[2]
    assert b.seqs[0].num_computed_tokens == 8
    assert bm.device.ref_counts[0] == 2
    assert (bm.prefix_stats.queries, bm.prefix_stats.hits) == (4, 2)


def test_fully_cached_prompt_recomputes_last_token() -> None:
    bm = BlockSpaceManager(4, 10, 0, watermark=0.0, enable_caching=True)
    toks = list(range(20, 28))
    a = make_group("a", 0, tokens=toks)
    bm.allocate(a)
    _computed(bm, a)
    b = make_group("b", 0, tokens=toks)
    bm.allocate(b)
    # The block with the last token is recomputed in a fresh block (no copy-on-write needed).
    assert b.seqs[0].num_computed_tokens == 4
    ta, tb = bm.get_block_table(a.seqs[0]), bm.get_block_table(b.seqs[0])
    assert ta[0] == tb[0] and ta[1] != tb[1]


def test_freed_cached_blocks_evicted_lru_tail_first() -> None:
    bm = BlockSpaceManager(4, 4, 0, watermark=0.0, enable_caching=True)
    a = make_group("a", 0, tokens=list(range(100, 108)))
    bm.allocate(a)
    _computed(bm, a)
    bm.free(a.seqs[0])
    assert bm.device.evictable_blocks() == [1, 0]  # tail block goes first
    b = make_group("b", 0, tokens=list(range(200, 212)))
    bm.allocate(b)  # needs 3: 2 free + evicts block 1
    assert bm.device.evictable_blocks() == [0]
    bm.free(b.seqs[0])  # b's blocks were never computed: plain free blocks again
    assert bm.device.evictable_blocks() == [0]
    c = make_group("c", 0, tokens=[*range(100, 104), 5])
    bm.allocate(c)
    assert c.seqs[0].num_computed_tokens == 4  # block 0 survived and is hit


def test_hash_collision_is_not_served(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedllm.core.prefix_cache as prefix_cache

    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, toks: 42)
    bm = BlockSpaceManager(4, 6, 0, watermark=0.0, enable_caching=True)
    a = make_group("a", 0, tokens=[1, 2, 3, 4, 9])
    bm.allocate(a)
    _computed(bm, a)
    b = make_group("b", 0, tokens=[5, 6, 7, 8, 9])
    bm.allocate(b)
    assert b.seqs[0].num_computed_tokens == 0
    assert bm.get_block_table(b.seqs[0])[0] != bm.get_block_table(a.seqs[0])[0]


def test_sliding_window_releases_blocks_out_of_reach() -> None:
    bm = BlockSpaceManager(4, 8, 4, watermark=0.0, sliding_window=6)
    g = make_group("a", 10)
    bm.allocate(g)
    seq = g.seqs[0]
    seq.update_num_computed_tokens(10)
    assert bm.reclaim_out_of_window(seq) == 1  # next query at 9 reads 4..9: block 0 is dead
    assert bm.get_num_free_device_blocks() == 6
    for t in range(6):  # decode up to 16 tokens
        seq.output_token_ids.append(t)
        bm.append_slots(seq)
        seq.update_num_computed_tokens(1)
        bm.reclaim_out_of_window(seq)
    table = bm.get_block_table(seq)
    assert len(table) == 4  # positions still map to table[pos // block_size]
    assert bm.get_num_free_device_blocks() == 8 - 2  # only the last two blocks are live
    bm.free(seq)
    assert bm.get_num_free_device_blocks() == 8
