"""TieredBlockStore: the host slab and the disk tier under the device pool, and their threads.

Two sides, both on the engine thread of a single in-process worker:

* the block manager's (``core.prefix_tier.PrefixTier``): ``probe``, ``prefetch``, ``acquire``,
  ``release``, asking where a prompt's next blocks are and pinning those it will load;
* the worker's, inside ``execute_model``: ``save`` copies the step's evicted device blocks into
  slots first thing (they are reused, and written, later in the same step), ``load`` copies the
  pinned slots into their fresh device blocks before the forward pass.

Disk I/O never runs on the engine thread: a writer thread writes saved slots to files, a reader
thread fills slots from files; both only take the store's lock to change a slot's state. A
block whose write is queued is still in the slab, so it is a hit from memory; a block being read
is a miss until the read is done (the prompt waits once, in the queue, for it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedllm.core.prefix_tier import TierProbe, TierTransfer
from pagedllm.kv_tiers.disk import DiskTier
from pagedllm.kv_tiers.host import HostSlab, Slot, SlotState

logger = logging.getLogger(__name__)


@dataclass
class TierCounters:
    host_hits: int = 0  # blocks loaded from a slot a save filled (the host tier)
    disk_hits: int = 0  # blocks loaded from a slot a disk read filled
    saves: int = 0  # evicted blocks copied into the slab
    saves_dropped: int = 0  # evicted blocks that found no free slot
    stores: int = 0  # blocks written to disk
    store_seconds: float = 0.0  # from the copy-out to the file in place, summed
    reads: int = 0  # blocks read from disk intact
    read_seconds: float = 0.0  # from the prefetch request to the slot filled, summed
    load_seconds: float = 0.0  # slot -> device copies inside steps, summed


def _bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache as bytes ``[2, num_blocks, ..., last * itemsize]`` (any dtype, fp8 too)."""
    return cache.view(torch.uint8)


class TieredBlockStore:
    def __init__(
        self,
        slab: HostSlab,
        disk: DiskTier | None,
        *,
        keep_saved: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.slab = slab
        self.disk = disk if disk is not None and disk.readable else None
        self.keep_saved = keep_saved  # the slab is a host tier (GPU/XPU), not only staging
        self.clock = clock
        self.counters = TierCounters()
        self.closing = threading.Event()  # stops a background hash of the weights, too
        self._lock = threading.Lock()
        self._writing: set[int] = set()
        self._applied = (0, 0)  # last transfer step whose saves / loads ran
        self._writes: queue.Queue[tuple[int, float] | None] = queue.Queue()
        self._reads: queue.Queue[tuple[int, float] | None] = queue.Queue()
        self._reads_idle = threading.Event()  # set while no read is queued or running
        self._reads_idle.set()
        self._threads = [
            threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True),
            threading.Thread(target=self._read_loop, name="kv-tier-reader", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def attach_disk(self, disk: DiskTier) -> bool:
        """Switch the disk tier on once its fingerprint is known (a background hash of the
        weights); False when the store is closing. ``self.disk`` only ever goes from None to a
        tier, so the threads that read it without the lock see one or the other, both sound."""
        with self._lock:
            if self.closing.is_set() or not disk.readable:
                return False
            self.disk = disk
        return True

    # -- the block manager's side (core.prefix_tier.PrefixTier) -----------------------------------
    def probe(self, keys: list[int]) -> TierProbe:
        with self._lock:
            resident = 0
            while resident < len(keys) and self.slab.is_resident(keys[resident]):
                resident += 1
            on_disk, reading = 0, False
            for key in keys[resident:]:
                slot = self.slab.get(key)
                if slot is not None and slot.state is SlotState.READING:
                    reading = True
                elif self.disk is None or not self.disk.contains(key):
                    break
                on_disk += 1
        return TierProbe(resident, on_disk, reading)

    def prefetch(self, keys: list[int]) -> None:
        if self.disk is None:
            return
        now = self.clock()
        with self._lock:
            for key in keys:
                if self.slab.get(key) is not None:
                    continue
                if self.slab.take(key, SlotState.READING, from_disk=True) is None:
                    break  # the slab is full of blocks in use: the rest is recomputed
                self._reads_idle.clear()
                self._reads.put((key, now))

    def acquire(self, keys: list[int]) -> int:
        with self._lock:
            count = 0
            for key in keys:
                slot = self.slab.get(key)
                if slot is None or slot.state is SlotState.READING:
                    break
                slot.pins += 1
                self.slab.touch(key)
                count += 1
        return count

    def release(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                self._unpin(key)

    def _unpin(self, key: int) -> None:
        slot = self.slab.get(key)
        if slot is not None and slot.pins > 0:
            slot.pins -= 1
            if slot.pins == 0 and slot.state is SlotState.READY and not self._keeps(slot):
                self.slab.drop(key)

    def _keeps(self, slot: Slot) -> bool:
        """Whether a ready, unpinned slot stays (until evicted): always in a host tier; on the
        CPU a block read from disk, so later prompts on the same prefix load it without another
        read (a saved block's slot is freed once written)."""
        return self.keep_saved or slot.from_disk

    # -- the worker's side -------------------------------------------------------------------------
    def apply_saves(self, transfer: TierTransfer, kv_caches: Sequence[torch.Tensor]) -> None:
        """Copy the step's evicted blocks out, before anything in the step writes blocks."""
        if transfer.step <= self._applied[0]:
            return  # a retried step (failure containment): its blocks may be overwritten now
        if transfer.saves:
            self.save(kv_caches, transfer.saves)
        self._applied = (transfer.step, self._applied[1])  # (a failed copy is retried)

    def apply_loads(self, transfer: TierTransfer, kv_caches: Sequence[torch.Tensor]) -> None:
        """Fill the step's loaded blocks, before the forward pass reads them."""
        if transfer.step <= self._applied[1]:
            return
        if transfer.loads:
            self.load(kv_caches, transfer.loads)
        self._applied = (self._applied[0], transfer.step)

    def save(self, kv_caches: Sequence[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Device blocks -> free slots, then the writer's queue. ``pairs``: (block, key)."""
        blocks, slots, fresh = [], [], []
        with self._lock:
            for block, key in pairs:
                if self.slab.get(key) is not None:
                    self.slab.touch(key)  # already below (the same key: the same contents)
                    continue
                to_disk = self.disk is not None and self.disk.writable
                if not to_disk and not self.keep_saved:
                    continue  # no tier would keep it
                on_disk = self.disk is not None and self.disk.contains(key)
                if on_disk:
                    self.disk.touch(key)  # type: ignore[union-attr]
                    if not self.keep_saved:
                        continue
                state = SlotState.SAVING if to_disk and not on_disk else SlotState.READY
                slot = self.slab.take(key, state, from_disk=False)
                if slot is None:
                    self.counters.saves_dropped += 1
                    continue
                blocks.append(block)
                slots.append(slot.index)
                if state is SlotState.SAVING:
                    self._writing.add(key)
                    fresh.append(key)
            self.counters.saves += len(blocks)
        if not blocks:
            return
        try:
            self._copy_out(kv_caches, blocks, slots)
        except BaseException:
            with self._lock:  # nothing half-copied stays behind as a block
                for _block, key in pairs:
                    slot = self.slab.get(key)
                    if slot is not None and slot.index in slots:
                        self._writing.discard(key)
                        self.slab.drop(key)
            raise
        now = self.clock()
        for key in fresh:
            self._writes.put((key, now))

    def save_all(
        self, kv_caches: Sequence[torch.Tensor], pairs: list[tuple[int, int]], timeout: float
    ) -> None:
        """Save many blocks (the pool at shutdown) through the slab in rounds, waiting for the
        writes of each round, so that no more are dropped than the disk cannot take."""
        deadline = time.monotonic() + timeout
        step = max(1, self.slab.num_slots // 2)
        for i in range(0, len(pairs), step):
            self.save(kv_caches, pairs[i : i + step])
            if not self.drain(max(0.0, deadline - time.monotonic())):
                return

    def load(self, kv_caches: Sequence[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Pinned slots -> their device blocks; unpins them. ``pairs``: (key, block)."""
        start = self.clock()
        with self._lock:
            found = [(self.slab.get(key), block) for key, block in pairs]
        if any(slot is None for slot, _ in found):
            raise RuntimeError("kv tiers: a pinned block left host memory (bookkeeping bug)")
        slots = [slot.index for slot, _ in found]  # type: ignore[union-attr]
        self._copy_in(kv_caches, slots, [block for _, block in found])
        with self._lock:
            for (slot, _), (key, _) in zip(found, pairs, strict=True):
                if slot.from_disk:  # type: ignore[union-attr]
                    self.counters.disk_hits += 1
                else:
                    self.counters.host_hits += 1
                self._unpin(key)
            self.counters.load_seconds += self.clock() - start

    def _copy_out(
        self, kv_caches: Sequence[torch.Tensor], blocks: list[int], slots: list[int]
    ) -> None:
        rows = self.slab.data.view(self.slab.num_slots, len(kv_caches), -1)
        dst = torch.tensor(slots, dtype=torch.int64)
        for layer, cache in enumerate(kv_caches):
            data = _bytes_view(cache)
            src = torch.tensor(blocks, dtype=torch.int64, device=data.device)
            # [2, n, ...] -> [n, 2 * ...]: one block's layer is one contiguous row part
            part = data.index_select(1, src).transpose(0, 1).reshape(len(blocks), -1)
            rows[dst, layer] = part.to("cpu")

    def _copy_in(
        self, kv_caches: Sequence[torch.Tensor], slots: list[int], blocks: list[int]
    ) -> None:
        rows = self.slab.data.view(self.slab.num_slots, len(kv_caches), -1)
        src = torch.tensor(slots, dtype=torch.int64)
        for layer, cache in enumerate(kv_caches):
            data = _bytes_view(cache)
            dst = torch.tensor(blocks, dtype=torch.int64, device=data.device)
            shape = (len(blocks), 2, *data.shape[2:])
            part = rows[src, layer].to(data.device).view(shape).transpose(0, 1)
            data.index_copy_(1, dst, part)

    # -- threads -----------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            try:
                self._write_one(*job)
            except Exception:  # never let the thread die: the block is simply not stored
                logger.exception("kv tiers: writing a block failed")
                with self._lock:
                    self._writing.discard(job[0])
                    self._settle(job[0], SlotState.SAVING)
            finally:
                self._writes.task_done()

    def _settle(self, key: int, state: SlotState) -> None:
        """A slot left in ``state`` by a failed job: saved data stays loadable, a read is gone."""
        slot = self.slab.get(key)
        if slot is None or slot.state is not state:
            return
        if state is SlotState.SAVING:
            slot.state = SlotState.READY
            if slot.pins == 0 and not self._keeps(slot):
                self.slab.drop(key)
        else:
            self.slab.drop(key)

    def _write_one(self, key: int, queued: float) -> None:
        with self._lock:
            slot = self.slab.get(key)
        ok = (
            slot is not None
            and self.disk is not None
            and self.disk.write(key, self.slab.view(slot))
        )
        with self._lock:
            self._writing.discard(key)
            slot = self.slab.get(key)
            if slot is not None and slot.state is SlotState.SAVING:
                slot.state = SlotState.READY
                if slot.pins == 0 and not self._keeps(slot):
                    self.slab.drop(key)
            if ok:
                self.counters.stores += 1
                self.counters.store_seconds += self.clock() - queued

    def _read_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            try:
                self._read_one(*job)
            except Exception:
                logger.exception("kv tiers: reading a block failed")
                with self._lock:
                    self._settle(job[0], SlotState.READING)
            finally:
                self._reads.task_done()
                if self._reads.empty():
                    self._reads_idle.set()

    def wait_for_reads(self, timeout: float) -> None:
        """Nap until the queued reads are done (or ``timeout``): an engine with nothing to run
        but prompts waiting for their blocks. Spinning instead would keep the GIL from the
        reader thread, which needs it between its system calls."""
        self._reads_idle.wait(timeout)

    def _read_one(self, key: int, queued: float) -> None:
        with self._lock:
            slot = self.slab.get(key)
        ok = slot is not None and self.disk is not None
        if ok:
            ok = self.disk.read_into(key, self.slab.view(slot))  # type: ignore[union-attr,arg-type]
        with self._lock:
            if not ok:
                self.slab.drop(key)
                return
            slot.state = SlotState.READY  # type: ignore[union-attr]
            self.counters.reads += 1
            self.counters.read_seconds += self.clock() - queued

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until queued writes and reads are done; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._writes.unfinished_tasks == 0 and self._reads.unfinished_tasks == 0:
                return True
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued writes (so the disk keeps them), then stop the threads."""
        with self._lock:
            self.closing.set()
        if not self.drain(timeout):
            logger.warning("kv tiers: writes still queued after %.0f s; dropped", timeout)
        for q in (self._writes, self._reads):
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)

    # -- numbers -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        c, disk = self.counters, self.disk
        with self._lock:
            host_bytes = self.slab.used_bytes
        return {
            "kv_tier_host_hits": c.host_hits,
            "kv_tier_disk_hits": c.disk_hits,
            "kv_tier_host_bytes": host_bytes,
            "kv_tier_host_capacity_bytes": self.slab.num_slots * self.slab.payload_nbytes,
            "kv_tier_disk_bytes": disk.used_bytes if disk is not None else 0,
            "kv_tier_disk_capacity_bytes": disk.capacity_bytes if disk is not None else 0,
            "kv_tier_disk_blocks": len(disk) if disk is not None else 0,
            "kv_tier_saves": c.saves,
            "kv_tier_saves_dropped": c.saves_dropped,
            "kv_tier_stores": c.stores,
            "kv_tier_store_seconds": c.store_seconds,
            "kv_tier_reads": c.reads,
            "kv_tier_read_seconds": c.read_seconds,
            "kv_tier_load_seconds": c.load_seconds,
            "kv_tier_corrupt": disk.corrupt if disk is not None else 0,
        }
