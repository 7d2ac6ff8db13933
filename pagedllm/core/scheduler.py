"""Iteration-level scheduling over the waiting, running and swapped queues.

Default (as vLLM's): a step is all prefill or all decode. Prompts are admitted from ``waiting``
only while nothing is swapped out; otherwise the running groups decode, and when blocks run out
the group at the back of ``running`` is preempted (recompute: back to the front of ``waiting``;
swap: its blocks to host memory, the group to ``swapped``). Swapped groups come back, in order,
once a step has preempted nobody and blocks allow.

Chunked prefill: one token budget per step; running decodes first, then swapped groups, then
prompt chunks, so decodes never starve behind a long prompt.

This module decides who runs; the queues, the block tables and every move between them
(preemption's included) are :mod:`.queues`'s.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import AllocStatus, BlockSpaceManager
from pagedllm.core.interfaces import ScheduledSeq, SchedulerOutput
from pagedllm.core.policy import sort_groups
from pagedllm.core.queues import RequestQueues
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.speculation import LookaheadPlanner
from pagedllm.core.step_plan import (
    Budget,
    StepPlan,
    build_scheduled_seq,
    holds_blocks,
    unchunked,
    whole_prompt,
)


class Scheduler(RequestQueues):
    """Plans each step over the queues and block tables that :class:`RequestQueues` keeps."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockSpaceManager,
        *,
        clock: Callable[[], float] = time.monotonic,
        next_seq_id: Callable[[], int] | None = None,
        lookahead: LookaheadPlanner | None = None,
        max_loras: int | None = None,
    ) -> None:
        super().__init__(
            config, block_manager, clock=clock, next_seq_id=next_seq_id, lookahead=lookahead
        )
        # Multi-LoRA: distinct adapters running (or swapped) at once, the device slots.
        self.max_loras = max_loras
        # Admission delay state (vLLM's scheduler_delay_factor).
        self.prev_time = 0.0
        self.prev_prompt = False
        self.last_prompt_latency = 0.0

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self.stats.steps += 1
        if self.config.enable_chunked_prefill:
            step = self._schedule_chunked(now)
        else:
            step = self._schedule_default(now)
        return self._build_output(step, now)

    def _schedule_default(self, now: float) -> StepPlan:
        step = StepPlan()
        budget = Budget(self.config.token_budget, self.config.max_num_seqs)
        budget.num_seqs = sum(g.get_max_num_running_seqs() for g in self.running)
        if not self.swapped and self._passed_delay(now):
            self._schedule_prefills(budget, step, chunked=False)
        if not step.prefills:
            self._schedule_running(budget, step, chunked=False)
            if step.preempted == 0:
                self._schedule_swapped(budget, step)
        if self.lookahead is not None:
            self.lookahead.reserve(step, budget, self.block_manager)
        self.prev_prompt = bool(step.prefills)
        return step

    def _schedule_chunked(self, now: float) -> StepPlan:
        step = StepPlan()
        budget = Budget(self.config.token_budget, self.config.max_num_seqs)
        budget.num_seqs = sum(g.get_max_num_running_seqs() for g in self.running)
        self._schedule_running(budget, step, chunked=True)
        if step.preempted == 0:
            self._schedule_swapped(budget, step)
        # Decodes come first, their lookahead included: reserved after the prompt chunks, a
        # step that filled its budget with a prompt speculated for no one while prompts arrived.
        if self.lookahead is not None:
            self.lookahead.reserve(step, budget, self.block_manager)
        if not self.swapped:
            self._schedule_prefills(budget, step, chunked=True)
        if step.prefills and any(
            chunk < g.seqs[0].get_num_uncomputed_tokens() for g, chunk in step.prefills
        ):
            self.stats.chunked_prefill_steps += 1
        self.prev_prompt = bool(step.prefills)
        return step

    def _passed_delay(self, now: float) -> bool:
        """Hold prompts back a little after a prompt step, so that more share the next one."""
        if self.prev_prompt:
            self.last_prompt_latency = now - self.prev_time
        self.prev_time, self.prev_prompt = now, False
        if self.config.delay_factor <= 0 or not self.waiting:
            return True
        earliest = min(g.arrival_time for g in self.waiting)
        return (
            now - earliest > self.config.delay_factor * self.last_prompt_latency or not self.running
        )

    def _schedule_prefills(self, budget: Budget, step: StepPlan, *, chunked: bool) -> None:
        if not self.waiting:
            return
        bm = self.block_manager
        if self.config.policy != "fcfs":
            self.waiting = sort_groups(self.waiting, self.sort_key)
        loras = self._active_loras()
        skipped: list[SequenceGroup] = []  # their adapter finds no free slot this step
        while self.waiting:
            group = self.waiting[0]
            if loras is not None and self._no_slot_for(group, loras):
                skipped.append(self.waiting.popleft())
                continue
            seqs = group.get_seqs(SequenceStatus.WAITING)
            if seqs[0].get_prompt_len() > self._prompt_limit(chunked):
                self._ignore(group, f"prompt of {seqs[0].get_prompt_len()} tokens is too long")
                continue
            whole = whole_prompt(group)
            if not holds_blocks(group):
                if not self._admit_without_blocks(group, budget, step):
                    break
                continue
            # Prompt log-probabilities need every position computed: no lower-tier loads.
            tiers = not whole
            if tiers and bm.tier_should_wait(group):
                skipped.append(self.waiting.popleft())  # its next blocks are read from disk
                continue
            status = bm.can_allocate(group)
            if status is AllocStatus.NEVER:
                self._ignore(group, "prompt needs more KV blocks than the whole cache holds")
                continue
            if status is AllocStatus.LATER:
                if self._preempt_lower_priority(group, budget, step):
                    continue
                break
            if tiers:
                bm.acquire_tier_hits(group)
            # Cached prefix tokens are not computed, so they do not count against the budget.
            num_tokens = sum(s.get_len() - bm.num_cached_prefix_tokens(s) for s in seqs)
            if whole:
                num_tokens = sum(s.get_len() for s in seqs)
            num_new_seqs = group.get_max_num_running_seqs()
            if chunked and unchunked(group) and not budget.fits(num_tokens, num_new_seqs):
                bm.release_tier_hits(group)
                break  # a prompt pooled whole is never chunked: it waits for a roomier step
            if chunked:
                num_tokens = min(num_tokens, budget.tokens_left)
                if num_tokens <= 0 or not budget.fits(num_tokens, num_new_seqs):
                    bm.release_tier_hits(group)
                    break
            elif not budget.fits(num_tokens, num_new_seqs) and (
                budget.num_tokens or num_tokens <= budget.token_budget
            ):
                bm.release_tier_hits(group)
                break
            self.waiting.popleft()
            bm.allocate(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                if whole:
                    seq.num_computed_tokens = 0  # every prompt position is read
            chunk = self._prefill_chunk(group, budget, step, chunked)
            self.running.append(group)
            step.prefills.append((group, chunk))
            if loras is not None and group.lora_id:
                loras.add(group.lora_id)
        self.waiting.extendleft(reversed(skipped))

    def _admit_without_blocks(self, group: SequenceGroup, budget: Budget, step: StepPlan) -> bool:
        """A bidirectional encoder's prompt: no KV blocks, the whole prompt in this step."""
        seq = group.seqs[0]
        if not budget.fits(seq.get_len(), 1):
            return False
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        budget.num_tokens += seq.get_len()
        budget.num_seqs += 1
        self.running.append(group)
        step.prefills.append((group, seq.get_len()))
        return True

    def _no_slot_for(self, group: SequenceGroup, loras: set[int]) -> bool:
        """The group's adapter would be one more than ``max_loras`` running at once."""
        lora = group.lora_id
        return bool(lora) and lora not in loras and len(loras) >= (self.max_loras or 0)

    def _active_loras(self) -> set[int] | None:
        """Adapters of running and swapped groups (None: no LoRA limit to keep)."""
        if self.max_loras is None:
            return None
        return {g.lora_id for q in (self.running, self.swapped) for g in q if g.lora_id}

    def _prefill_chunk(
        self,
        group: SequenceGroup,
        budget: Budget,
        step: StepPlan,
        chunked: bool,
        *,
        new: bool = True,
    ) -> int:
        """Tokens to compute now for a (possibly partly cached) prompt; reserves its slots."""
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        if chunked and len(seqs) == 1:
            bm, seq = self.block_manager, seqs[0]
            chunk = min(seq.get_num_uncomputed_tokens(), budget.tokens_left)
            chunk = min(chunk, bm.placeable_tokens(seq))  # block sliding window: blocks free now
            if chunk > 0:
                self._copies_into(step, seq, seq.num_computed_tokens + chunk)
        else:
            # Several sequences (recomputed forks) are prefilled whole, each its own length.
            chunk = 0
            for seq in seqs:
                chunk += seq.get_num_uncomputed_tokens()
                self._copies_into(step, seq, seq.get_len())
        budget.num_tokens += chunk
        if new:
            budget.num_seqs += group.get_max_num_running_seqs()
        return chunk

    def _copies_into(self, step: StepPlan, seq: Sequence, num_tokens: int) -> None:
        """Slots for the sequence's first ``num_tokens`` tokens; copy-on-write goes in the plan."""
        step.copies.extend(self.block_manager.append_slots(seq, num_tokens))

    def _schedule_running(self, budget: Budget, step: StepPlan, *, chunked: bool) -> None:
        """Decodes first (preempting from the back when blocks run out), then prompt chunks."""
        running = self.running
        # (one group needs no ordering: a sort and its key calls every step of a lone stream)
        queue = sort_groups(running, self.sort_key) if len(running) > 1 else deque(running)
        kept: deque[SequenceGroup] = deque()
        partial_prompts: list[SequenceGroup] = []
        while queue:
            group = queue.popleft()
            if group.is_prefill():
                # Part-way through chunked prefill: its blocks are allocated already.
                kept.append(group)
                partial_prompts.append(group)
                continue
            num_seqs = group.num_seqs(SequenceStatus.RUNNING)
            if chunked and budget.tokens_left < num_seqs:
                kept.append(group)  # out of tokens this step; decodes again next step
                continue
            while not self.block_manager.can_append_slots(group):
                victim = queue.pop() if queue else group
                self._preempt(victim, step)
                if victim is group:
                    break
            else:
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    self._copies_into(step, seq, seq.get_len())
                budget.num_tokens += num_seqs
                step.decodes.append(group)
                kept.append(group)
        self.running = kept
        for group in partial_prompts:
            if chunked and budget.tokens_left > 0:
                chunk = self._prefill_chunk(group, budget, step, True, new=False)
                if chunk > 0:
                    step.prefills.append((group, chunk))

    def _schedule_swapped(self, budget: Budget, step: StepPlan) -> None:
        bm = self.block_manager
        while self.swapped:
            group = self.swapped[0]
            status = bm.can_swap_in(group)
            if status is AllocStatus.LATER:
                break
            if status is AllocStatus.NEVER:
                self.swapped.popleft()
                self._ignore(group, "swapped group no longer fits in the KV cache", host=True)
                continue
            num_seqs = group.get_max_num_running_seqs()
            if not budget.fits(num_seqs, num_seqs):
                break
            self.swapped.popleft()
            step.swap_in.extend(bm.swap_in(group))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
                self._copies_into(step, seq, seq.get_len())
            budget.num_tokens += num_seqs
            budget.num_seqs += num_seqs
            self.running.append(group)
            step.decodes.append(group)

    def _preempt_lower_priority(self, group: SequenceGroup, budget: Budget, step: StepPlan) -> bool:
        """Priority policy: make room for ``group`` by recomputing a lower-priority group later.

        Victims go back to ``waiting`` (not to ``swapped``, which would hold every prompt back).
        """
        if self.config.policy != "priority":
            return False
        key = self.sort_key(group)
        lower = [g for g in self.running if self.sort_key(g) > key and g not in step.decodes]
        lower = [g for g in lower if all(g is not p for p, _ in step.prefills)]
        if not lower:
            return False
        victim = max(lower, key=self.sort_key)
        self.running.remove(victim)
        budget.num_seqs -= victim.get_max_num_running_seqs()
        self._preempt(victim, step, mode="recompute")
        self.waiting = sort_groups(self.waiting, self.sort_key)
        return True

    def _prompt_limit(self, chunked: bool) -> int:
        if chunked:
            return self.config.max_model_len
        return min(self.config.max_model_len, self.config.token_budget)

    # -- building the wire type ---------------------------------------------------------------
    def _build_output(self, step: StepPlan, now: float) -> SchedulerOutput:
        scheduled: list[ScheduledSeq] = []
        for group, chunk in step.prefills:
            group.set_first_scheduled(now)
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            for seq in seqs:
                n = chunk if len(seqs) == 1 else seq.get_num_uncomputed_tokens()
                scheduled.append(self._scheduled_seq(group, seq, n, True))
        num_prefill_seqs = len(scheduled)
        for group in step.decodes:
            group.set_first_scheduled(now)
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                item = self._scheduled_seq(group, seq, 1, False)
                if self.lookahead is not None:
                    item = self.lookahead.decorate(item, seq, step)
                scheduled.append(item)
        return SchedulerOutput(
            seqs=scheduled,
            num_prefill_seqs=num_prefill_seqs,
            blocks_to_swap_in=step.swap_in,
            blocks_to_swap_out=step.swap_out,
            blocks_to_copy=step.copies,
            num_batched_tokens=sum(len(s.token_ids) + s.num_spec_tokens for s in scheduled),
            num_preempted=step.preempted,
            kv_transfer=self.block_manager.take_transfer(),
        )

    def _scheduled_seq(
        self, group: SequenceGroup, seq: Sequence, num_tokens: int, is_prompt: bool
    ) -> ScheduledSeq:
        table = self.block_manager.get_block_table(seq) if holds_blocks(group) else []
        return build_scheduled_seq(group, seq, num_tokens, is_prompt, table)
