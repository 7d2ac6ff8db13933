"""Virtual engines: under pipeline parallelism, one scheduler per micro-batch in flight.

With P stages and one scheduler, a step runs through stage 0, then stage 1, ... and each stage
idles (P - 1) / P of the time, because the next step cannot be planned before this one's tokens
are back. As in vLLM's v0 design, the engine instead keeps V (= P by default) virtual engines:
each has its own ``Scheduler`` and ``BlockSpaceManager`` over a KV cache of its own on every
worker (``SchedulerOutput.virtual_engine`` says which), a request lives in one of them from
``add_request`` to its end (the least loaded takes it), and the engine submits virtual engine
v's next micro-batch while the others' are still in the pipeline. A virtual engine waits only
for its own previous micro-batch, which is what its next plan depends on.

The engine's request bookkeeping (abort, forks and frees of beams, stats) sees the V schedulers
and block managers as one through :class:`VirtualSchedulers` and :class:`VirtualBlockManagers`;
the step itself (``step_loop.py``) drives each scheduler in turn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.core.step_plan import SchedulerStats


class VirtualSchedulers:
    """The V schedulers as the engine's one ``scheduler`` for everything but the step itself."""

    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.schedulers = schedulers

    def add(self, group: SequenceGroup) -> None:
        """To the virtual engine with the fewest unfinished requests (the first on a tie)."""
        loads = [s.num_unfinished() for s in self.schedulers]
        self.schedulers[loads.index(min(loads))].add(group)

    def abort(self, request_ids: Iterable[str]) -> list[SequenceGroup]:
        ids = list(request_ids)
        return [group for s in self.schedulers for group in s.abort(ids)]

    def _holder(self, seq: Sequence) -> Scheduler:
        for s in self.schedulers:
            if s.block_manager.has_table(seq):
                return s
        raise KeyError(f"sequence {seq.seq_id} holds no blocks in any virtual engine")

    def next_seq_id(self) -> int:
        return self.schedulers[0].next_seq_id()  # one id counter shared by all

    def fork(self, group: SequenceGroup, parent: Sequence, *, index: int | None = None) -> Sequence:
        return self._holder(parent).fork(group, parent, index=index)

    def free(self, group: SequenceGroup, seq: Sequence) -> None:
        self._holder(seq).free(group, seq)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    def num_unfinished(self) -> int:
        return sum(s.num_unfinished() for s in self.schedulers)

    def take_ignored(self) -> list[SequenceGroup]:
        return [group for s in self.schedulers for group in s.take_ignored()]

    @property
    def running(self) -> list[SequenceGroup]:
        return [g for s in self.schedulers for g in s.running]

    @property
    def waiting(self) -> list[SequenceGroup]:
        return [g for s in self.schedulers for g in s.waiting]

    @property
    def swapped(self) -> list[SequenceGroup]:
        return [g for s in self.schedulers for g in s.swapped]

    @property
    def stats(self) -> SchedulerStats:
        total = SchedulerStats()
        for s in self.schedulers:
            for f in dataclasses.fields(SchedulerStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(s.stats, f.name))
        return total


class VirtualBlockManagers:
    """The V block managers' counts summed, for ``get_stats`` and leak checks."""

    def __init__(self, managers: list[BlockSpaceManager]) -> None:
        self.managers = managers
        self.num_device_blocks = sum(m.num_device_blocks for m in managers)
        self.num_host_blocks = sum(m.num_host_blocks for m in managers)
        self.watermark_blocks = managers[0].watermark_blocks  # what one request must leave

    def get_num_free_device_blocks(self) -> int:
        return sum(m.get_num_free_device_blocks() for m in self.managers)

    def get_num_free_host_blocks(self) -> int:
        return sum(m.get_num_free_host_blocks() for m in self.managers)

    def usage(self) -> float:
        used = self.num_device_blocks - self.get_num_free_device_blocks()
        return used / self.num_device_blocks if self.num_device_blocks else 0.0

    @property
    def prefix_stats(self) -> Any:
        from pagedllm.core.block_allocator import PrefixCacheStats

        return PrefixCacheStats(
            queries=sum(m.prefix_stats.queries for m in self.managers),
            hits=sum(m.prefix_stats.hits for m in self.managers),
        )
