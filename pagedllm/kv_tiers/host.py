"""Host memory for KV blocks below the device pool: a fixed slab of block-sized slots.

Every block that goes down or comes up passes through a slot: a save copies a device block into
one and the writer thread writes it to disk from there; a read from disk fills one and the next
step copies it into a device block. On a device with memory of its own (GPU, XPU) the slab is
also the host tier: saved blocks stay after their write, least recently used first out, so a
hit is a host-to-device copy. On the CPU, where the device pool already is host memory, a saved
block's slot is freed once written, and the slab only stages blocks in flight.

A fixed slab bounds the memory (nothing is allocated per block; on CUDA it is pinned once, which
makes the copies DMA) and bounds the write queue: a save that finds no free slot is dropped.

Slot states: ``SAVING`` (holds a block the writer has yet to write), ``READING`` (being filled
from disk; not loadable yet: a block in flight is a miss), ``READY``. Saving and ready blocks
are *resident* (loadable now). Only ready, unpinned slots are evicted. Not thread-safe: the
store holds its lock around every call.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

import torch


class SlotState(enum.Enum):
    SAVING = "saving"
    READING = "reading"
    READY = "ready"


@dataclass
class Slot:
    index: int
    state: SlotState
    from_disk: bool  # filled by a read (a disk hit when loaded), else by a save (a host hit)
    pins: int = 0


class HostSlab:
    def __init__(self, num_slots: int, payload_nbytes: int, *, pin_memory: bool = False) -> None:
        self.num_slots = num_slots
        self.payload_nbytes = payload_nbytes
        # torch.empty: pages are touched only when slots are used.
        self.data = torch.empty(
            (num_slots, payload_nbytes), dtype=torch.uint8, pin_memory=pin_memory
        )
        self._slots: OrderedDict[int, Slot] = OrderedDict()  # key -> slot, least recent first
        self._free = list(range(num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def used_bytes(self) -> int:
        return len(self._slots) * self.payload_nbytes

    def get(self, key: int) -> Slot | None:
        return self._slots.get(key)

    def is_resident(self, key: int) -> bool:
        slot = self._slots.get(key)
        return slot is not None and slot.state is not SlotState.READING

    def take(self, key: int, state: SlotState, *, from_disk: bool) -> Slot | None:
        """A slot for ``key`` (a free one, else the least recently used evictable one)."""
        if self._free:
            index = self._free.pop()
        else:
            victim = next(
                (k for k, s in self._slots.items() if s.state is SlotState.READY and s.pins == 0),
                None,
            )
            if victim is None:
                return None
            index = self._slots.pop(victim).index
        slot = Slot(index, state, from_disk)
        self._slots[key] = slot
        return slot

    def touch(self, key: int) -> None:
        if key in self._slots:
            self._slots.move_to_end(key)

    def drop(self, key: int) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot.index)

    def view(self, slot: Slot) -> memoryview:
        """The slot's bytes, for file I/O (shares memory with the slab)."""
        return memoryview(self.data[slot.index].numpy())
