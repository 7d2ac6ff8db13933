"""The engine's one step loop, for one scheduler and for pipeline virtual engines alike.

A step takes the outputs left over from aborts, admits requests whose grammar compiled, lets one
scheduler plan, runs the plan and reports every request it touched. With V virtual engines
(pipeline parallelism, see ``virtual_engines.py``) the schedulers take turns, round robin, and a
plan is submitted without waiting (``execute_model_async``): a call first finishes this virtual
engine's micro-batch in flight, if any, so up to V micro-batches are in the pipeline while the
engine processes one. With one scheduler the plan runs at once, and a failing step is bisected
down to the requests that make it fail (``containment.py``). Both are this one loop; the
request table (which requests live, the outputs an abort left for the next step) is here too,
because every way a request ends passes through it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pagedllm.core.interfaces import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import SequenceGroup
from pagedllm.engine.containment import EngineBrokenError, execute_contained, without
from pagedllm.engine.guided import GuidedRequests
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.executors.base import Executor, StepFuture
from pagedllm.outputs import RequestOutput
from pagedllm.spec_decode.metrics import SpecDecodeMetrics

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.005  # an empty step waits this long for a grammar or a disk read


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    kv_slots_allocated: int = 0  # summed over steps, for KV waste
    kv_slots_used: int = 0
    # Pooling requests finished, by task ("embed", "classify").
    embed_requests: int = 0
    classify_requests: int = 0


@dataclass
class StepParts:
    """What the loop drives; the engine builds them and keeps its own references."""

    executor: Executor
    guided: GuidedRequests
    output_processor: OutputProcessor
    counters: EngineCounters
    spec_metrics: SpecDecodeMetrics
    kv_tiers: Any  # the worker's KV tier store, or None
    block_size: int
    max_model_len: int


class StepLoop:
    """``LLMEngine.step`` and the table of live requests (see the module docstring).

    ``scheduler`` is the one view the engine's bookkeeping uses (adds, aborts, forks, stats);
    ``schedulers`` the ones that plan, one per virtual engine.
    """

    def __init__(self, scheduler: Any, schedulers: list[Scheduler], parts: StepParts) -> None:
        self.scheduler = scheduler
        self.schedulers = schedulers
        self.parts = parts
        self.pipelined = len(schedulers) > 1
        self.requests: dict[str, SequenceGroup] = {}
        self.pending: list[RequestOutput] = []  # outputs for the next step (aborts, failures)
        self.in_flight: list[tuple[SchedulerOutput, StepFuture] | None] = [None] * len(schedulers)
        self._next = 0

    # -- the request table --------------------------------------------------------------
    def admit(self, group: SequenceGroup, *, schedulable: bool) -> None:
        """A new request; ``schedulable`` False while its grammar still compiles."""
        self.requests[group.request_id] = group
        if schedulable:
            self.scheduler.add(group)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop requests wherever they are; their blocks are freed now, an output follows."""
        ids = list(request_ids)
        for group in self.scheduler.abort(ids) + self.parts.guided.abort(ids):
            self._end(group)
            self.pending.append(self.parts.output_processor.make_output(group))

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self.pending)
            or self.parts.guided.num_waiting() > 0
        )

    def _end(self, group: SequenceGroup) -> None:
        self.requests.pop(group.request_id, None)
        self.parts.guided.release(group.request_id)

    def _fail(self, group: SequenceGroup, error: str, outputs: list[RequestOutput]) -> None:
        self._end(group)
        outputs.append(self.parts.output_processor.make_output(group, error=error, failed=True))

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass (or submit one micro-batch), report what changed."""
        outputs, self.pending = self.pending, []
        self._admit_compiled(outputs)
        v = self._next
        self._next = (v + 1) % len(self.schedulers)
        scheduler = self.schedulers[v]
        self._finish_in_flight(v, scheduler, outputs)
        sched_out = scheduler.schedule()
        self._report_ignored(scheduler, outputs)
        if sched_out.is_empty:
            self._idle(sched_out)
            return outputs
        sched_out = self.parts.guided.with_bitmask(sched_out)
        if self.pipelined:
            sched_out = dataclasses.replace(sched_out, virtual_engine=v)
            self.in_flight[v] = (sched_out, self.parts.executor.execute_model_async(sched_out))
        else:
            runner_out, ran = self._execute(sched_out, outputs)
            self._process_step(scheduler, ran, runner_out, outputs)
        return outputs

    def _admit_compiled(self, outputs: list[RequestOutput]) -> None:
        """Requests whose grammar finished compiling go to the scheduler (or end with its error)."""
        for group, error in self.parts.guided.ready():
            if error is None:
                self.scheduler.add(group)
                continue
            self.requests.pop(group.request_id, None)
            outputs.append(self.parts.output_processor.make_output(group, error=error, failed=True))

    def _report_ignored(self, scheduler: Scheduler, outputs: list[RequestOutput]) -> None:
        for group in scheduler.take_ignored():
            self._end(group)
            outputs.append(self.parts.output_processor.make_output(group, error=self._why(group)))

    def _idle(self, sched_out: SchedulerOutput) -> None:
        """Nothing to run: apply the tiers' block moves, and wait a little for what may come
        (a grammar compiling, a read from disk) unless a micro-batch is on its way back."""
        parts = self.parts
        if sched_out.kv_transfer is not None:
            parts.executor.collective_rpc("apply_kv_transfer", sched_out.kv_transfer)
        if any(self.in_flight):
            return
        if parts.kv_tiers is not None:
            parts.kv_tiers.wait_for_reads(timeout=_IDLE_WAIT_S)
        parts.guided.wait(timeout=_IDLE_WAIT_S)

    def _execute(
        self, sched_out: SchedulerOutput, outputs: list[RequestOutput]
    ) -> tuple[ModelRunnerOutput, SchedulerOutput]:
        """Run the step; if it fails, end only the requests that make it fail (containment).

        Returns the runner's output and the step as it finally ran (without any culprits).
        """
        execute = self.parts.executor.execute_model
        try:
            return execute(sched_out), sched_out
        except Exception as exc:
            try:
                runner_out, culprits = execute_contained(execute, sched_out, exc)
            except EngineBrokenError:
                # Not one request's fault: end the step's requests (their blocks are freed and
                # an "abort" output follows) and let the caller see the error.
                self.abort(sorted({s.request_id for s in sched_out.seqs}))
                raise
        for group in self.scheduler.abort(list(culprits)):
            self._fail(group, culprits[group.request_id], outputs)
        return runner_out, without(sched_out, set(culprits))

    def _finish_in_flight(self, v: int, scheduler: Scheduler, outputs: list[RequestOutput]) -> None:
        """Virtual engine ``v``'s micro-batch in flight, if any: wait for it and report it."""
        pending = self.in_flight[v]
        if pending is None:
            return
        self.in_flight[v] = None
        sched_out, future = pending
        try:
            runner_out = future.result()
        except Exception as exc:
            self._fail_in_flight(sched_out, exc)
            raise
        self._process_step(scheduler, sched_out, runner_out, outputs)

    def _fail_in_flight(self, failed: SchedulerOutput, exc: Exception) -> None:
        """A stage died (or failed) under a micro-batch: every micro-batch in the pipeline is
        lost. Their requests end now with the executor's error (which names the stage), their
        blocks freed; the error then reaches the caller of ``step``."""
        steps = [failed] + [p[0] for p in self.in_flight if p is not None]
        self.in_flight = [None] * len(self.schedulers)
        ids = sorted({s.request_id for step in steps for s in step.seqs})
        message = f"{type(exc).__name__}: {exc}"
        for group in self.scheduler.abort(ids):
            self._fail(group, message, self.pending)
        logger.error("pipeline step failed; ended %d in-flight requests: %s", len(ids), exc)

    def _process_step(
        self,
        scheduler: Scheduler,
        ran: SchedulerOutput,
        runner_out: ModelRunnerOutput,
        outputs: list[RequestOutput],
    ) -> None:
        """Record what step ``ran`` (planned by ``scheduler``) produced, and report it."""
        parts, counters = self.parts, self.parts.counters
        self._count(ran)
        parts.spec_metrics.observe(runner_out.spec_stats)
        if runner_out.spec_tokens:
            counters.generation_tokens += sum(len(t) for t in runner_out.spec_tokens.values())
        touched = scheduler.update_from_output(ran, runner_out)
        for group in touched:
            counters.generation_tokens -= parts.output_processor.process(group)
            parts.guided.advance(group)
        finished = {g.request_id for g in scheduler.free_finished()}
        for group in touched:
            outputs.append(parts.output_processor.make_output(group))
            if group.request_id in finished:
                self._end(group)
                counters.requests_finished += 1
                if group.pooling_params is not None:
                    task = group.pooling_params.task
                    counters.embed_requests += task == "embed"
                    counters.classify_requests += task == "classify"

    def _why(self, group: SequenceGroup) -> str:
        n = len(group.prompt_token_ids)
        limit = self.parts.max_model_len
        if n > limit:
            return f"prompt has {n} tokens, more than max_model_len ({limit})"
        return f"prompt of {n} tokens needs more KV blocks than the cache holds"

    def _count(self, sched_out: SchedulerOutput) -> None:
        c = self.parts.counters
        blocks = used = 0
        for s in sched_out.seqs:
            if s.is_prompt:
                c.prompt_tokens += len(s.token_ids)
            if s.do_sample and s.pooling_params is None:
                c.generation_tokens += 1
            blocks += len(s.block_table)
            used += s.start_pos + len(s.token_ids)
        c.kv_slots_allocated += blocks * self.parts.block_size
        c.kv_slots_used += used
