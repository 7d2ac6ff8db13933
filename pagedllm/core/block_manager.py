"""Paged KV-cache bookkeeping: which physical blocks each sequence's tokens live in.

Blocks are plain integers; an allocator (``block_allocator.py``) keeps their reference counts,
so forked sequences share blocks until one of them writes (copy-on-write). With prefix caching,
every *full* block is keyed by ``block_hash(parent_hash, its token ids)``; a freed keyed block
stays reusable until the pool needs room, and then the least recently freed one is evicted
first. With a lower tier (``core/prefix_tier.py``) an evicted block's contents go down to it,
and a prompt's next blocks found there are loaded instead of computed. The keys, hits and tier
traffic are :class:`~pagedllm.core.prefix_cache.PrefixCache`'s; the tables here hold block ids.
"""

from __future__ import annotations

from pagedllm.core.block_allocator import (
    AllocStatus,
    BlockAllocator,
    OutOfBlocksError,
    PrefixCacheStats,
    block_hash,
)
from pagedllm.core.prefix_cache import PrefixCache
from pagedllm.core.prefix_tier import PrefixTier, TierTransfer
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = [
    "AllocStatus",
    "BlockAllocator",
    "BlockSpaceManager",
    "OutOfBlocksError",
    "PrefixCacheStats",
    "block_hash",
    "window_block_count",
]


def window_block_count(sliding_window: int, block_size: int) -> int:
    """The fewest usable device blocks in which one sequence runs to any length, never
    preempted, under a block sliding window (prompts given blocks chunk by chunk); a lazy prompt
    is admitted with this many, so with one fewer a long prompt is never admitted.

    After each step ``reclaim_out_of_window`` keeps the blocks from position
    ``computed - window + 1`` up to the newest token: ``ceil(computed / block_size) -
    floor((computed - window + 1) / block_size)`` blocks, at most ``ceil((window - 2) /
    block_size) + 1`` (the window, plus one block where it straddles a boundary). A decode then
    asks for one free block (``can_append_slots``: the worst case, even when the newest block
    has room), hence one more. A prompt chunk is sized by ``placeable_tokens`` to the blocks
    free at the time, so prefill never needs more than a decode.
    """
    return max(2, -(-(sliding_window - 2) // block_size) + 2)


class BlockSpaceManager:
    """Block tables of all sequences over a device pool and a host swap pool."""

    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        watermark: float = 0.01,
        enable_caching: bool = False,
        sliding_window: int | None = None,
        lazy_prompt_blocks: bool = False,
        tier: PrefixTier | None = None,
    ) -> None:
        self.block_size = block_size
        # With a sliding window on every layer, blocks that fell out of it are released early;
        # their ids stay in the table as placeholders the kernels mask out and never write.
        self.sliding_window = sliding_window
        # Block sliding window for prompts (chunked prefill): a prompt gets blocks chunk by
        # chunk, so one longer than the whole cache runs in a window's worth of blocks.
        self.lazy_prompt_blocks = lazy_prompt_blocks and sliding_window is not None
        self._dead: dict[int, int] = {}  # seq_id -> leading table entries already released
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.enable_caching = enable_caching
        self.device = BlockAllocator(num_device_blocks, enable_caching=enable_caching)
        self.host = BlockAllocator(num_host_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self._num_marked: dict[int, int] = {}  # seq_id -> leading blocks marked computed
        self.prefix = PrefixCache(self.device, block_size, enabled=enable_caching, tier=tier)
        self.prefix_stats = self.prefix.stats  # the same objects, read by the engine and tests
        self.tier = self.prefix.tier

    # -- admission ---------------------------------------------------------------------------
    def window_blocks(self) -> int | None:
        """The blocks that let one sequence run to any length under a block sliding window.

        See :func:`window_block_count`; ``None`` without a window.
        """
        if self.sliding_window is None:
            return None
        return window_block_count(self.sliding_window, self.block_size)

    def _initial_blocks(self, seq: Sequence, *, lazy: bool = True) -> int:
        """Blocks a waiting sequence gets at admission (all of them, or a window's worth).

        Only a lone prompt is chunked; recomputed forks are prefilled whole (``lazy=False``).
        """
        needed = seq.num_blocks_needed()
        if self.lazy_prompt_blocks and lazy:
            return min(needed, self.window_blocks() or needed)
        return needed

    def placeable_tokens(self, seq: Sequence) -> int:
        """Tokens past the computed ones that can get slots now (lazy prompts wait for blocks)."""
        if not self.lazy_prompt_blocks:
            return seq.get_num_uncomputed_tokens()
        table = self.block_tables[seq.seq_id]
        spare = max(0, self.device.num_free - self.watermark_blocks)
        return max(0, (len(table) + spare) * self.block_size - seq.num_computed_tokens)

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        seqs = self._distinct_waiting(group)
        needed = sum(self._initial_blocks(s, lazy=len(seqs) == 1) for s in seqs)
        if self.num_device_blocks - needed < self.watermark_blocks:
            return AllocStatus.NEVER
        # Prefix-cache hits on blocks other sequences hold cost no free block.
        needed -= sum(self.prefix.num_shared_live(s) for s in seqs)
        if self.device.num_free - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of a waiting sequence that a prefix-cache hit would spare computing."""
        return self.prefix.num_cached_tokens(seq)

    # -- lower tiers -----------------------------------------------------------------------------
    def _tier_prompt(self, group: SequenceGroup) -> Sequence | None:
        """The group's lone waiting prompt, the one a lower tier serves (None without a tier)."""
        if self.tier is None:
            return None
        seqs = self._distinct_waiting(group)
        if len(seqs) != 1:
            return None  # recomputed forks are prefilled whole
        return seqs[0]

    def tier_should_wait(self, group: SequenceGroup) -> bool:
        """True while the prompt's next blocks are being read from disk (see TierLink)."""
        seq = self._tier_prompt(group)
        return seq is not None and self.prefix.tier_should_wait(seq)

    def acquire_tier_hits(self, group: SequenceGroup) -> None:
        """Pin the prompt's next blocks that a lower tier holds in memory, for its admission."""
        seq = self._tier_prompt(group)
        if seq is not None:
            self.prefix.acquire_tier_hits(seq)

    def release_tier_hits(self, group: SequenceGroup) -> None:
        """The group was not admitted after all: unpin what ``acquire_tier_hits`` pinned."""
        if self.tier is not None:
            for seq in group.seqs:
                self.tier.release(seq.seq_id)

    def take_transfer(self) -> TierTransfer | None:
        """The step's saves and loads for the worker (None without a tier or traffic)."""
        return self.prefix.take_transfer()

    def flush_transfer(self) -> TierTransfer | None:
        """Every computed keyed device block as a save, at shutdown (see PrefixCache)."""
        return self.prefix.flush_transfer()

    @staticmethod
    def _distinct_waiting(group: SequenceGroup) -> list[Sequence]:
        """A new prompt has one sequence; forks preempted by recompute each need their own."""
        seqs = group.get_seqs(SequenceStatus.WAITING)
        first = seqs[0].get_token_ids()
        if all(s.get_len() == len(first) and s.get_token_ids() == first for s in seqs[1:]):
            return seqs[:1]
        return seqs

    def allocate(self, group: SequenceGroup) -> None:
        """Give the waiting sequences block tables covering all their tokens.

        Sequences with identical tokens (a fresh prompt) share one table. With prefix caching,
        each sequence's ``num_computed_tokens`` is set to the cached prefix it can skip (at
        most all tokens but the last, which yields logits).
        """
        seqs = group.get_seqs(SequenceStatus.WAITING)
        distinct = self._distinct_waiting(group)
        if len(distinct) == 1:
            table, cached = self.prefix.fill_table(seqs[0], self._initial_blocks(seqs[0]))
            for block in table:
                for _ in range(len(seqs) - 1):
                    self.device.incref(block)
            for s in seqs:
                self._set_table(s, list(table), cached)
        else:
            for s in seqs:
                self._set_table(s, *self.prefix.fill_table(s, self._initial_blocks(s, lazy=False)))

    def _set_table(self, seq: Sequence, table: list[int], cached_blocks: int) -> None:
        self.block_tables[seq.seq_id] = table
        self._num_marked[seq.seq_id] = cached_blocks
        seq.num_computed_tokens = min(cached_blocks * self.block_size, seq.get_len() - 1)

    # -- growth --------------------------------------------------------------------------------
    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Worst case every running sequence needs one new (or copied) block."""
        return group.num_seqs(SequenceStatus.RUNNING) <= self.device.num_free

    def append_slots(self, seq: Sequence, num_tokens: int | None = None) -> list[tuple[int, int]]:
        """Make room for the sequence's tokens; returns copy-on-write ``(src, dst)`` pairs.

        ``num_tokens`` is how many tokens must have slots (default: all of them).
        """
        table = self.block_tables[seq.seq_id]
        total = seq.get_len() if num_tokens is None else num_tokens
        while len(table) < seq.num_blocks_needed(total):
            table.append(self.device.allocate())
        # Only the block that receives the newest tokens can be written; copy it if shared.
        first_written = seq.num_computed_tokens // self.block_size
        pairs: list[tuple[int, int]] = []
        for idx in range(first_written, len(table)):
            block = table[idx]
            if self.device.ref_counts[block] > 1:
                new = self.device.allocate()
                self.device.free(block)
                table[idx] = new
                pairs.append((block, new))
        return pairs

    def trim(self, seq: Sequence) -> None:
        """Free trailing blocks past the sequence's tokens: the lookahead slots of rejected
        speculative tokens (never registered in the prefix cache: their tokens never counted
        as computed)."""
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            return
        keep = max(seq.num_blocks_needed(), self._dead.get(seq.seq_id, 0) + 1)
        while len(table) > keep:
            self.device.free(table.pop())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        table = self.block_tables[parent.seq_id]
        for block in self._live(parent.seq_id):
            self.device.incref(block)
        self.block_tables[child.seq_id] = list(table)
        self._num_marked[child.seq_id] = self._num_marked.get(parent.seq_id, 0)
        if parent.seq_id in self._dead:
            self._dead[child.seq_id] = self._dead[parent.seq_id]

    def _live(self, seq_id: int) -> list[int]:
        return self.block_tables[seq_id][self._dead.get(seq_id, 0) :]

    def reclaim_out_of_window(self, seq: Sequence) -> int:
        """Release blocks no future token can attend to; returns how many were released."""
        if self.sliding_window is None or seq.seq_id not in self.block_tables:
            return 0
        table = self.block_tables[seq.seq_id]
        dead = self._dead.get(seq.seq_id, 0)
        # The next query sits at the first uncomputed position p and reads positions
        # > p - window (a decode: p = len - 1; a prompt chunk: where the last one ended).
        first_needed = max(0, seq.num_computed_tokens - self.sliding_window + 1)
        new_dead = min(first_needed // self.block_size, len(table) - 1)
        for idx in range(dead, new_dead):
            self.device.free(table[idx])
        if new_dead > dead:
            self._dead[seq.seq_id] = new_dead
            self._num_marked[seq.seq_id] = max(self._num_marked.get(seq.seq_id, 0), new_dead)
        return max(0, new_dead - dead)

    def mark_computed(self, seq: Sequence) -> None:
        """Blocks whose every token now has KV become hits for later prompts."""
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            return
        dead = self._dead.get(seq.seq_id, 0)
        done = max(self._num_marked.get(seq.seq_id, 0), dead)
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        self.prefix.mark_computed(seq, table, range(done, full), dead=dead)
        self._num_marked[seq.seq_id] = max(done, full)

    # -- swapping ------------------------------------------------------------------------------
    def _unique_blocks(self, group: SequenceGroup, status: SequenceStatus) -> set[int]:
        return {b for s in group.get_seqs(status) for b in self._live(s.seq_id)}

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        needed = len(self._unique_blocks(group, SequenceStatus.SWAPPED))
        needed += group.num_seqs(SequenceStatus.SWAPPED)  # room for each one's next token
        if self.num_device_blocks < needed:
            return AllocStatus.NEVER
        if self.device.num_free - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return len(self._unique_blocks(group, SequenceStatus.RUNNING)) <= self.host.num_free

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Host -> device for every swapped sequence; returns ``(host, device)`` pairs."""
        return self._move(group, SequenceStatus.SWAPPED, self.host, self.device)

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Device -> host for every running sequence; returns ``(device, host)`` pairs."""
        return self._move(group, SequenceStatus.RUNNING, self.device, self.host)

    def _move(
        self,
        group: SequenceGroup,
        status: SequenceStatus,
        src: BlockAllocator,
        dst: BlockAllocator,
    ) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for seq in group.get_seqs(status):
            dead = self._dead.get(seq.seq_id, 0)
            new_table = self.block_tables[seq.seq_id][:dead]  # placeholders stay device ids
            for block in self._live(seq.seq_id):
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                src.free(block)
                new_table.append(mapping[block])
            self.block_tables[seq.seq_id] = new_table
            self._num_marked[seq.seq_id] = dead
        return list(mapping.items())

    # -- release -------------------------------------------------------------------------------
    def free(self, seq: Sequence, *, on_host: bool = False) -> None:
        """Release a sequence's blocks, last first, so cached chains are evicted from the tail."""
        if self.tier is not None:
            self.tier.forget(seq.seq_id)
        if seq.seq_id not in self.block_tables:
            return
        live = self._live(seq.seq_id)
        del self.block_tables[seq.seq_id]
        self._num_marked.pop(seq.seq_id, None)
        self._dead.pop(seq.seq_id, None)
        pool = self.host if on_host else self.device
        for block in reversed(live):
            pool.free(block)

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables[seq.seq_id]

    def has_table(self, seq: Sequence) -> bool:
        return seq.seq_id in self.block_tables

    def get_num_free_device_blocks(self) -> int:
        return self.device.num_free

    def get_num_free_host_blocks(self) -> int:
        return self.host.num_free

    def usage(self) -> float:
        """Share of device blocks held by live sequences (cached free blocks count as free)."""
        if not self.num_device_blocks:
            return 0.0
        return 1.0 - self.device.num_free / self.num_device_blocks
