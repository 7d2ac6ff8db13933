"""Paged KV-cache bookkeeping: which physical blocks each sequence's tokens live in.

Blocks are plain integers; an allocator (``block_allocator.py``) keeps their reference counts,
so forked sequences share blocks until one of them writes (copy-on-write). With prefix caching,
every *full* block is keyed by ``block_hash(parent_hash, its token ids)``; a freed keyed block
stays reusable until the pool needs room, and then the least recently freed one is evicted
first. With a lower tier (``core/prefix_tier.py``) an evicted block's contents go down to it,
and a prompt's next blocks found there are loaded instead of computed.
"""

from __future__ import annotations

from pagedllm.core.block_allocator import (
    AllocStatus,
    BlockAllocator,
    OutOfBlocksError,
    PrefixCacheStats,
    block_hash,
)
from pagedllm.core.prefix_tier import PrefixTier, TierLink, TierTransfer
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
        self.prefix_stats = PrefixCacheStats()
        # A lower tier (host memory, disk) under the prefix cache: evictions go down, hits load.
        self.tier = TierLink(tier) if tier is not None and enable_caching else None
        if self.tier is not None:
            self.device.on_evict = self.tier.on_evict

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
        needed -= sum(self._shared_live_blocks(s) for s in seqs)
        if self.device.num_free - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Computed cached blocks for the sequence's leading full blocks.

        The block holding the last token is never reused: that token is recomputed (it yields
        the logits) and writing it into a shared block would need a copy.
        """
        if not self.enable_caching:
            return []
        bs, parent, hits = self.block_size, seq.cache_root, []
        for i in range((seq.get_len() - 1) // bs):
            chunk = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            parent = block_hash(parent, chunk)
            block = self.device.peek(parent, chunk)
            if block is None or not self.device.computed[block]:
                break
            hits.append(block)
        return hits

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of a waiting sequence that a prefix-cache hit would spare computing (with the
        lower-tier blocks pinned for it, which are loaded instead)."""
        pinned = len(self.tier.pinned(seq.seq_id)) if self.tier is not None else 0
        return (len(self._cached_prefix(seq)) + pinned) * self.block_size

    # -- lower tiers -----------------------------------------------------------------------------
    def _tier_keys(self, group: SequenceGroup) -> tuple[Sequence | None, list[int]]:
        """A lone waiting prompt and the keys of its skippable blocks past the device hits."""
        if self.tier is None:
            return None, []
        seqs = self._distinct_waiting(group)
        if len(seqs) != 1:
            return None, []  # recomputed forks are prefilled whole
        seq, bs = seqs[0], self.block_size
        hits = self._cached_prefix(seq)
        parent = self.device.hashes[hits[-1]] if hits else seq.cache_root
        keys = []
        for i in range(len(hits), (seq.get_len() - 1) // bs):
            parent = block_hash(parent, seq.token_slice(i * bs, (i + 1) * bs))
            keys.append(parent)
        return seq, keys

    def tier_should_wait(self, group: SequenceGroup) -> bool:
        """True while the prompt's next blocks are being read from disk (see TierLink)."""
        seq, keys = self._tier_keys(group)
        return seq is not None and self.tier is not None and self.tier.should_wait(seq.seq_id, keys)

    def acquire_tier_hits(self, group: SequenceGroup) -> None:
        """Pin the prompt's next blocks that a lower tier holds in memory, for its admission."""
        seq, keys = self._tier_keys(group)
        if seq is not None and self.tier is not None:
            self.tier.acquire(seq.seq_id, keys)

    def release_tier_hits(self, group: SequenceGroup) -> None:
        """The group was not admitted after all: unpin what ``acquire_tier_hits`` pinned."""
        if self.tier is not None:
            for seq in group.seqs:
                self.tier.release(seq.seq_id)

    def take_transfer(self) -> TierTransfer | None:
        """The step's saves and loads for the worker (None without a tier or traffic)."""
        return self.tier.take_transfer() if self.tier is not None else None

    def flush_transfer(self) -> TierTransfer | None:
        """Every computed keyed device block as a save (at shutdown, so the disk tier keeps
        what the device pool held), with whatever the last step left."""
        if self.tier is None:
            return None
        d = self.device
        for block in range(d.num_blocks):
            key = d.hashes[block]
            if key is not None and d.computed[block]:
                self.tier.on_evict(block, key)
        return self.tier.take_transfer()

    def _shared_live_blocks(self, seq: Sequence) -> int:
        """Prefix hits on blocks other sequences hold: they cost no free block."""
        return sum(1 for b in self._cached_prefix(seq) if self.device.ref_counts[b] > 0)

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
            table, cached = self._allocate_seq(seqs[0])
            for block in table:
                for _ in range(len(seqs) - 1):
                    self.device.incref(block)
            for s in seqs:
                self._set_table(s, list(table), cached)
        else:
            for s in seqs:
                self._set_table(s, *self._allocate_seq(s, lazy=False))

    def _set_table(self, seq: Sequence, table: list[int], cached_blocks: int) -> None:
        self.block_tables[seq.seq_id] = table
        self._num_marked[seq.seq_id] = cached_blocks
        seq.num_computed_tokens = min(cached_blocks * self.block_size, seq.get_len() - 1)

    def _allocate_seq(self, seq: Sequence, *, lazy: bool = True) -> tuple[list[int], int]:
        hits = self._cached_prefix(seq)
        loaded = self.tier.take_pinned(seq.seq_id) if self.tier is not None else []
        if self.enable_caching:
            self.prefix_stats.queries += seq.get_len() // self.block_size
            self.prefix_stats.hits += len(hits)
        bs = self.block_size
        table: list[int] = []
        parent = seq.cache_root
        for i in range(self._initial_blocks(seq, lazy=lazy)):
            chunk = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            if i < len(hits):
                parent = block_hash(parent, chunk)
                block = self.device.lookup(parent, chunk)
                assert block == hits[i]
            elif i < len(hits) + len(loaded):
                # A lower tier's block: a fresh device block, filled by the worker before the
                # forward pass, so it is computed (a hit) for every prompt planned after this.
                parent = block_hash(parent, chunk)
                assert parent == loaded[i - len(hits)]
                block = self.device.allocate()
                self.device.register(block, parent, chunk)
                self.device.computed[block] = True
                assert self.tier is not None
                self.tier.add_load(parent, block)
            else:
                block = self.device.allocate()
                if self.enable_caching and len(chunk) == bs:
                    # Keyed now so that prompts admitted later find it once it is computed.
                    parent = block_hash(parent, chunk)
                    self.device.register(block, parent, chunk)
            table.append(block)
        return table, len(hits) + len(loaded)

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
        bs = self.block_size
        dead = self._dead.get(seq.seq_id, 0)
        done = max(self._num_marked.get(seq.seq_id, 0), dead)
        full = min(seq.num_computed_tokens // bs, len(table))
        for idx in range(done, full):
            block = table[idx]
            if self.enable_caching and self.device.hashes[block] is None:
                if idx > dead:
                    parent = self.device.hashes[table[idx - 1]]
                else:
                    parent = seq.cache_root if idx == 0 else None
                if idx == 0 or parent is not None:
                    chunk = tuple(seq.token_slice(idx * bs, (idx + 1) * bs))
                    self.device.register(block, block_hash(parent, chunk), chunk)
            self.device.computed[block] = True
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
