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
:class:`PipelineLoop` is ``LLMEngine.step`` when V > 1.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.core.interfaces import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.core.step_plan import SchedulerStats
from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.executors.base import StepFuture

logger = logging.getLogger(__name__)


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


class PipelineLoop:
    """``LLMEngine.step`` with V virtual engines: each call finishes one virtual engine's
    micro-batch (if it has one in flight) and submits its next, round robin, so up to V
    micro-batches are in the pipeline while the engine processes one.
    """

    def __init__(self, engine: LLMEngine, schedulers: VirtualSchedulers) -> None:
        self.engine = engine
        self.schedulers = schedulers.schedulers
        self.in_flight: list[tuple[SchedulerOutput, StepFuture] | None] = [None] * len(
            self.schedulers
        )
        self._next = 0

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        outputs, engine._pending_outputs = engine._pending_outputs, []
        engine._admit_compiled(outputs)
        v = self._next
        self._next = (v + 1) % len(self.schedulers)
        scheduler = self.schedulers[v]
        pending = self.in_flight[v]
        if pending is not None:
            self.in_flight[v] = None
            sched_out, future = pending
            try:
                runner_out = future.result()
            except Exception as exc:
                self._fail_in_flight(sched_out, exc)
                raise
            engine._process_step(scheduler, sched_out, runner_out, outputs)
        self._submit(v, scheduler, outputs)
        return outputs

    def _submit(self, v: int, scheduler: Scheduler, outputs: list[RequestOutput]) -> None:
        engine = self.engine
        sched_out = scheduler.schedule()
        engine._report_ignored(scheduler, outputs)
        if sched_out.is_empty:
            if not any(self.in_flight):  # nothing to wait for but grammars compiling
                engine.guided.wait(timeout=0.005)
            return
        sched_out = dataclasses.replace(engine.guided.with_bitmask(sched_out), virtual_engine=v)
        self.in_flight[v] = (sched_out, engine.executor.execute_model_async(sched_out))

    def _fail_in_flight(self, failed: SchedulerOutput, exc: Exception) -> None:
        """A stage died (or failed) under a micro-batch: every micro-batch in the pipeline is
        lost. Their requests end now with the executor's error (which names the stage), their
        blocks freed; the error then reaches the caller of ``step``."""
        engine = self.engine
        steps = [failed] + [p[0] for p in self.in_flight if p is not None]
        self.in_flight = [None] * len(self.schedulers)
        ids = sorted({s.request_id for step in steps for s in step.seqs})
        message = f"{type(exc).__name__}: {exc}"
        for group in engine.scheduler.abort(ids):
            engine._requests.pop(group.request_id, None)
            engine.guided.release(group.request_id)
            engine._pending_outputs.append(
                engine.output_processor.make_output(group, error=message, failed=True)
            )
        logger.error("pipeline step failed; ended %d in-flight requests: %s", len(ids), exc)
