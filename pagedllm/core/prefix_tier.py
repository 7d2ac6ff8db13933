"""The block manager's side of the lower KV tiers (host memory, then disk).

The tiers hold tensors and files (``pagedllm/kv_tiers/``); the core sees only *keys* and device
block ids. A key is a full block's prefix hash (``block_hash`` chained from the sequence's cache
root), so one key names the block's tokens and every token before it: the same key always means
the same keys and values, in any process of the same model (the hash is stable, not Python's).

What crosses from the core to the worker is a :class:`TierTransfer` per step, built here:

* ``saves``: device blocks evicted from the prefix cache while this step was planned, with their
  keys. The worker copies them out *first* in the step, before swaps, copy-on-write, loads or the
  forward pass can overwrite a block that was just handed to another sequence;
* ``loads``: keys found in a lower tier and the fresh device blocks they go into; the worker
  fills them before the forward pass, which then reads them as computed tokens.

Reads from disk never stall a step: a prompt whose next blocks are on disk asks the tier to read
them into host memory and waits in the queue (other requests run) until the read is done, at
most once; what is not in host memory when it is admitted is recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# A prompt waits at most this long for its blocks to come from disk (a stalled network disk);
# then it is admitted with what is in memory, and the rest is recomputed.
MAX_READ_WAIT_S = 30.0


@dataclass(frozen=True)
class TierProbe:
    """Where a run of keys is, from its start.

    ``resident``: leading keys in host memory (loadable in this step); ``on_disk``: the keys
    after those that a read from disk would bring in; ``reading``: some of those are being read
    now.
    """

    resident: int = 0
    on_disk: int = 0
    reading: bool = False


class PrefixTier(Protocol):
    """What the block manager asks a lower tier (``kv_tiers.TieredBlockStore`` implements it)."""

    def probe(self, keys: list[int]) -> TierProbe:
        """Where ``keys`` are (a prefix walk: stops at the first key in no tier)."""
        ...

    def prefetch(self, keys: list[int]) -> None:
        """Start reading ``keys`` from disk into host memory (in the background)."""
        ...

    def acquire(self, keys: list[int]) -> int:
        """Pin the leading keys that are in host memory; how many were pinned.

        A pinned key stays in host memory until the worker loads it (or it is released).
        """
        ...

    def release(self, keys: list[int]) -> None:
        """Unpin keys acquired but not loaded (the request was not admitted after all)."""
        ...


@dataclass(frozen=True)
class TierTransfer:
    """One step's traffic between the device pool and the lower tiers (see the module doc).

    ``step`` numbers transfers, so a worker that runs a step twice (failure containment retries
    a step on parts of its batch) applies each one once: a second copy-out would read blocks
    the first attempt's forward pass may have overwritten.
    """

    step: int
    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, key)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (key, device block)


@dataclass
class TierStats:
    blocks_loaded: int = 0  # blocks admitted as computed from a lower tier
    waits: int = 0  # prompts held back for a read from disk


class TierLink:
    """The block manager's bookkeeping of tier traffic: evictions to save, pinned hits to load,
    prompts that already waited for a read."""

    def __init__(self, tier: PrefixTier, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.tier = tier
        self.clock = clock
        self.stats = TierStats()
        self._saves: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._pinned: dict[int, list[int]] = {}  # seq_id -> keys acquired for its admission
        self._waited: dict[int, float] = {}  # seq_id -> when it began waiting for reads
        self._prefetched: set[int] = set()  # seq_ids whose own read was asked for (once)
        self._step = 0

    def on_evict(self, block: int, key: int) -> None:
        """The allocator reuses a cached block: its contents go down a tier before the step."""
        self._saves.append((block, key))

    def should_wait(self, seq_id: int, keys: list[int]) -> bool:
        """True while the sequence's next blocks are being read from disk (hold it back).

        The first time its blocks are found on disk the read starts; a sequence waits for one
        read only, so blocks that another read evicts from host memory before admission are
        recomputed rather than read again, and for ``MAX_READ_WAIT_S`` at most.
        """
        if not keys:
            return False
        now = self.clock()
        started = self._waited.get(seq_id)
        if started is not None and now - started > MAX_READ_WAIT_S:
            return False
        probe = self.tier.probe(keys)
        if probe.reading:  # its blocks, or a shared prefix another prompt asked for
            self._waited.setdefault(seq_id, now)
            return True
        if probe.on_disk and seq_id not in self._prefetched:
            self._prefetched.add(seq_id)
            self._waited.setdefault(seq_id, now)
            self.tier.prefetch(keys[probe.resident : probe.resident + probe.on_disk])
            self.stats.waits += 1
            return True
        return False

    def acquire(self, seq_id: int, keys: list[int]) -> int:
        """Pin the leading resident keys for the sequence's admission; how many."""
        self.release(seq_id)
        count = self.tier.acquire(keys) if keys else 0
        if count:
            self._pinned[seq_id] = keys[:count]
        return count

    def pinned(self, seq_id: int) -> list[int]:
        return self._pinned.get(seq_id, [])

    def take_pinned(self, seq_id: int) -> list[int]:
        """The sequence is admitted: its pinned keys become this step's loads (unpinned by the
        worker once loaded)."""
        self._waited.pop(seq_id, None)
        self._prefetched.discard(seq_id)
        return self._pinned.pop(seq_id, [])

    def add_load(self, key: int, block: int) -> None:
        self._loads.append((key, block))
        self.stats.blocks_loaded += 1

    def release(self, seq_id: int) -> None:
        keys = self._pinned.pop(seq_id, None)
        if keys:
            self.tier.release(keys)

    def forget(self, seq_id: int) -> None:
        """The sequence's blocks are freed (finished, aborted, preempted)."""
        self.release(seq_id)
        self._waited.pop(seq_id, None)
        self._prefetched.discard(seq_id)

    def take_transfer(self) -> TierTransfer | None:
        """This step's saves and loads, or None when there are none."""
        if not self._saves and not self._loads:
            return None
        self._step += 1
        transfer = TierTransfer(self._step, self._saves, self._loads)
        self._saves, self._loads = [], []
        return transfer
