"""The prefix cache's side of the block manager: which device blocks a prompt may reuse.

The block manager (:mod:`.block_manager`) keeps each sequence's table: which blocks it holds,
shares with its forks, swaps, releases behind a sliding window. Whether a block outlives its
sequence is another question, answered by its key (``block_hash(parent_hash, its token ids)``
of a full block) and by the lower tier (:mod:`.prefix_tier`) that keeps evicted keys. Every key is
computed and looked up here, so the tables deal in block ids only, and a prompt's reuse (device
hits shared, lower-tier hits loaded into fresh blocks, fresh full blocks keyed for the prompts
admitted after it) is decided in one place.
"""

from __future__ import annotations

from pagedllm.core.block_allocator import BlockAllocator, PrefixCacheStats, block_hash
from pagedllm.core.prefix_tier import PrefixTier, TierLink, TierTransfer
from pagedllm.core.sequence import Sequence


class PrefixCache:
    """Keys, hits and lower-tier traffic over one device pool; with caching off, no block is
    keyed and a new table is all fresh blocks."""

    def __init__(
        self,
        device: BlockAllocator,
        block_size: int,
        *,
        enabled: bool,
        tier: PrefixTier | None = None,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.enabled = enabled
        self.stats = PrefixCacheStats()
        # A lower tier (host memory, disk) under the prefix cache: evictions go down, hits load.
        self.tier = TierLink(tier) if tier is not None and enabled else None
        if self.tier is not None:
            self.device.on_evict = self.tier.on_evict

    # -- hits ----------------------------------------------------------------------------------
    def hits(self, seq: Sequence) -> list[int]:
        """Computed cached blocks for the sequence's leading full blocks.

        The block holding the last token is never reused: that token is recomputed (it yields
        the logits) and writing it into a shared block would need a copy.
        """
        if not self.enabled:
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

    def num_shared_live(self, seq: Sequence) -> int:
        """Prefix hits on blocks other sequences hold: they cost no free block."""
        return sum(1 for b in self.hits(seq) if self.device.ref_counts[b] > 0)

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of a waiting sequence that a hit would spare computing (with the lower-tier
        blocks pinned for it, which are loaded instead)."""
        pinned = len(self.tier.pinned(seq.seq_id)) if self.tier is not None else 0
        return (len(self.hits(seq)) + pinned) * self.block_size

    # -- lower tiers -----------------------------------------------------------------------------
    def tier_keys(self, seq: Sequence) -> list[int]:
        """The keys of a prompt's skippable blocks past its device hits."""
        bs = self.block_size
        hits = self.hits(seq)
        parent = self.device.hashes[hits[-1]] if hits else seq.cache_root
        keys = []
        for i in range(len(hits), (seq.get_len() - 1) // bs):
            parent = block_hash(parent, seq.token_slice(i * bs, (i + 1) * bs))
            keys.append(parent)
        return keys

    def tier_should_wait(self, seq: Sequence) -> bool:
        """True while the prompt's next blocks are being read from disk (see TierLink)."""
        keys = self.tier_keys(seq)
        return self.tier is not None and self.tier.should_wait(seq.seq_id, keys)

    def acquire_tier_hits(self, seq: Sequence) -> None:
        """Pin the prompt's next blocks that a lower tier holds in memory, for its admission."""
        keys = self.tier_keys(seq)
        if self.tier is not None:
            self.tier.acquire(seq.seq_id, keys)

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

    # -- tables --------------------------------------------------------------------------------
    def fill_table(self, seq: Sequence, num_blocks: int) -> tuple[list[int], int]:
        """The sequence's first ``num_blocks`` blocks, and how many of them hold computed KV:
        device hits first, then the lower tier's pinned hits, then fresh blocks."""
        hits = self.hits(seq)
        loaded = self.tier.take_pinned(seq.seq_id) if self.tier is not None else []
        if self.enabled:
            self.stats.queries += seq.get_len() // self.block_size
            self.stats.hits += len(hits)
        bs = self.block_size
        table: list[int] = []
        parent = seq.cache_root
        for i in range(num_blocks):
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
                if self.enabled and len(chunk) == bs:
                    # Keyed now so that prompts admitted later find it once it is computed.
                    parent = block_hash(parent, chunk)
                    self.device.register(block, parent, chunk)
            table.append(block)
        return table, len(hits) + len(loaded)

    def mark_computed(self, seq: Sequence, table: list[int], indices: range, *, dead: int) -> None:
        """Mark ``table[indices]`` computed, so they become hits for later prompts. A block not
        keyed at allocation (a decode's) is keyed from its predecessor's key, and left unkeyed
        where that predecessor is among the ``dead`` ones released behind a sliding window."""
        bs = self.block_size
        for idx in indices:
            block = table[idx]
            if self.enabled and self.device.hashes[block] is None:
                if idx > dead:
                    parent = self.device.hashes[table[idx - 1]]
                else:
                    parent = seq.cache_root if idx == 0 else None
                if idx == 0 or parent is not None:
                    chunk = tuple(seq.token_slice(idx * bs, (idx + 1) * bs))
                    self.device.register(block, block_hash(parent, chunk), chunk)
            self.device.computed[block] = True
