"""The pool of KV blocks on one device (or in host swap space): free list, reference counts,
and, with prefix caching, the blocks keyed by their content and kept after they are freed.

Blocks are plain integers. A freed keyed block stays reusable (a prefix-cache hit) until the pool
needs room; then the least recently freed one is evicted first, and ``on_evict`` hears of it
(the lower tiers save its contents before the step reuses it).
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class AllocStatus(enum.Enum):
    OK = "ok"
    LATER = "later"  # does not fit now; may once other requests finish
    NEVER = "never"  # larger than the whole cache


class OutOfBlocksError(RuntimeError):
    """The scheduler asked for more blocks than are free: a bookkeeping bug, never user input."""


@dataclass
class PrefixCacheStats:
    queries: int = 0  # full prompt blocks looked up
    hits: int = 0  # of those, found computed in the cache


class BlockAllocator:
    """A pool of ``num_blocks`` blocks on one device (or in host swap space)."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.computed = [False] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest-freed first
        self._by_hash: dict[int, int] = {}
        # Called with (block, key) when a cached block is evicted for reuse (a lower tier).
        self.on_evict: Callable[[int, int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int:
        """A fresh block with reference count 1, evicting a cached one if none is free."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            key = self.hashes[block]
            if self.on_evict is not None and key is not None:
                self.on_evict(block, key)
            self._forget(block)
        else:
            raise OutOfBlocksError("no free KV blocks left")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        count = self.ref_counts[block] - 1
        if count < 0:
            raise OutOfBlocksError(f"double free of block {block}")
        self.ref_counts[block] = count
        if count:
            return
        if self.hashes[block] is not None and self.computed[block]:
            self._evictable[block] = None
        else:
            self._forget(block)
            self._free.append(block)

    def lookup(self, content_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """Take a reference on the cached block holding exactly these tokens, if any.

        The stored token ids are compared, so a hash collision can never serve another
        prompt's keys and values.
        """
        block = self._by_hash.get(content_hash)
        if block is None or self.block_tokens[block] != token_ids:
            return None
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1
        return block

    def peek(self, content_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block with these tokens, without taking a reference."""
        block = self._by_hash.get(content_hash)
        if block is None or self.block_tokens[block] != token_ids:
            return None
        return block

    def register(self, block: int, content_hash: int, token_ids: tuple[int, ...]) -> None:
        """Key a full block by its content; the first block with a given content wins."""
        if content_hash in self._by_hash or self.hashes[block] is not None:
            return
        self._by_hash[content_hash] = block
        self.hashes[block] = content_hash
        self.block_tokens[block] = token_ids

    def _forget(self, block: int) -> None:
        h = self.hashes[block]
        if h is not None and self._by_hash.get(h) == block:
            del self._by_hash[h]
        self.hashes[block] = None
        self.block_tokens[block] = None
        self.computed[block] = False

    def evictable_blocks(self) -> list[int]:
        """Cached free blocks in eviction order (next evicted first)."""
        return list(self._evictable)


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """The key of a full block: its tokens and, through ``parent``, every token before it.

    A 128-bit BLAKE2b digest, the same in every process (Python's ``hash`` is 64 bits and salted
    per process for strings), so the disk tier can name blocks by it across restarts.
    """
    head = b"\x00" if parent is None else b"\x01" + parent.to_bytes(17, "little", signed=True)
    digest = hashlib.blake2b(head + array("q", token_ids).tobytes(), digest_size=16).digest()
    return int.from_bytes(digest, "little")
