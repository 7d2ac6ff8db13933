"""The scheduler's ledger: which queue each request is in and which blocks it holds.

Planning a step (:mod:`.scheduler`) changes with every scheduling feature (chunking, budgets,
lookahead, LoRA slots, admission delay); the bookkeeping it relies on does not, and is where the
invariants live that ``tests/core`` checks after every step: a group sits in exactly one of
``waiting``, ``running`` and ``swapped``, and a sequence holds blocks exactly while its status
says so. Every move between queues (added, aborted, forked or freed, preempted, ignored, a
step's results recorded, finished and released) is made here, so the planner decides only who
runs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.core.interfaces import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.policy import POLICIES, sort_groups
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.speculation import LookaheadPlanner, accept_run
from pagedllm.core.step_plan import SchedulerStats, StepPlan, holds_blocks

logger = logging.getLogger(__name__)


class RequestQueues:
    """The waiting, running and swapped queues and the block tables; :class:`Scheduler`'s base."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockSpaceManager,
        *,
        clock: Callable[[], float] = time.monotonic,
        next_seq_id: Callable[[], int] | None = None,
        lookahead: LookaheadPlanner | None = None,
    ) -> None:
        self.config = config
        self.lookahead = lookahead  # speculative decoding: lookahead slots for decodes
        self._next_seq_id = next_seq_id or itertools.count(1 << 40).__next__
        self.block_manager = block_manager
        self.clock = clock
        self.sort_key = POLICIES[config.policy]
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.stats = SchedulerStats()
        self._ignored: list[SequenceGroup] = []

    # -- queue management ------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)
        if self.config.policy != "fcfs":
            self.waiting = sort_groups(self.waiting, self.sort_key)

    def abort(self, request_ids: Iterable[str]) -> list[SequenceGroup]:
        """Finish the named requests wherever they are; their blocks are freed at once."""
        ids = set(request_ids)
        aborted: list[SequenceGroup] = []
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in ids]:
                queue.remove(group)
                on_host = queue is self.swapped
                for seq in group.get_unfinished_seqs():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                group.metrics.finished_time = self.clock()
                for seq in group.seqs:
                    self.block_manager.free(seq, on_host=on_host)
                aborted.append(group)
        return aborted

    # -- the block tables' owner: forks and frees for beams and parallel samples ---------------
    def next_seq_id(self) -> int:
        return self._next_seq_id()

    def fork(self, group: SequenceGroup, parent: Sequence, *, index: int | None = None) -> Sequence:
        """A new sequence in ``group`` sharing ``parent``'s tokens and KV blocks (copy-on-write)."""
        child = parent.fork(self._next_seq_id(), index=index)
        self.block_manager.fork(parent, child)
        group.add_seq(child)
        return child

    def free(self, group: SequenceGroup, seq: Sequence) -> None:
        """Drop ``seq`` from its group and release its blocks (a beam that was not picked)."""
        self.block_manager.free(seq)
        group.remove_seq(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def take_ignored(self) -> list[SequenceGroup]:
        """Groups that finished without running (prompt too long for the context or cache)."""
        ignored, self._ignored = self._ignored, []
        return ignored

    # -- moves the planner decides on ----------------------------------------------------------
    def _preempt(self, group: SequenceGroup, step: StepPlan, mode: str | None = None) -> None:
        mode = mode or self.config.preemption_mode
        if mode is None:
            mode = "swap" if group.get_max_num_running_seqs() > 1 else "recompute"
        if mode == "swap" and not self.block_manager.can_swap_out(group):
            logger.warning("swap space full; preempting %s by recompute", group.request_id)
            mode = "recompute"
        group.num_preemptions += 1
        step.preempted += 1
        running = group.get_seqs(SequenceStatus.RUNNING)
        if mode == "swap":
            step.swap_out.extend(self.block_manager.swap_out(group))
            for seq in running:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.stats.preemptions_swap += 1
        else:
            for seq in running:
                self.block_manager.free(seq)
                seq.status = SequenceStatus.WAITING
                seq.reset_for_recompute()
            self.waiting.appendleft(group)
            self.stats.preemptions_recompute += 1
        logger.debug("preempted %s by %s", group.request_id, mode)

    def _ignore(self, group: SequenceGroup, why: str, *, host: bool = False) -> None:
        logger.warning("request %s cannot run: %s", group.request_id, why)
        if self.waiting and self.waiting[0] is group:
            self.waiting.popleft()
        for seq in group.seqs:
            self.block_manager.free(seq, on_host=host)
            if not seq.is_finished():
                seq.status = SequenceStatus.FINISHED_IGNORED
        self._ignored.append(group)

    # -- after the forward pass ----------------------------------------------------------------
    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[SequenceGroup]:
        """Record computed tokens and sampled tokens; returns the groups that got a token.

        What ran is read from ``sched_out`` itself: a sequence aborted while the step ran (no
        longer running, or finished) is skipped.
        """
        now = self.clock()
        touched: dict[str, SequenceGroup] = {}
        running = {g.request_id: g for g in self.running}
        for item in sched_out.seqs:
            group = running.get(item.request_id)
            seq = group.seqs_dict.get(item.seq_id) if group is not None else None
            if group is None or seq is None or seq.is_finished():
                continue  # aborted while the step ran
            if item.num_spec_tokens and self.lookahead is not None:
                accepted = accept_run(self.block_manager, seq, item, runner_out)  # appends
                self.lookahead.record(seq, accepted)
            else:
                seq.update_num_computed_tokens(len(item.token_ids))
                if holds_blocks(group):
                    self.block_manager.mark_computed(seq)
                    self.block_manager.reclaim_out_of_window(seq)
            if seq.seq_id in runner_out.prompt_logprobs:
                self._record_prompt_logprobs(group, runner_out.prompt_logprobs[seq.seq_id])
            if not item.do_sample:
                continue
            if item.pooling_params is not None:  # prefill-only: done, its blocks freed next
                group.pooled = runner_out.pooled[seq.seq_id]
                seq.status = SequenceStatus.FINISHED_STOPPED
                touched[group.request_id] = group
                continue
            sampled = runner_out.sampled[seq.seq_id]
            if group.sampling_params.use_beam_search:
                group.beam_candidates[seq.seq_id] = sampled.candidates or []
            elif not item.num_spec_tokens:
                for i, sib in enumerate(sampled.siblings or [], start=1):
                    child = self.fork(group, seq, index=i)
                    child.append_token(sib.token_id, sib.logprob, sib.top_logprobs)
                seq.append_token(sampled.token_id, sampled.logprob, sampled.top_logprobs)
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            group.metrics.last_token_time = now
            touched[group.request_id] = group
        return list(touched.values())

    @staticmethod
    def _record_prompt_logprobs(
        group: SequenceGroup, entries: list[dict[int, float] | None]
    ) -> None:
        if group.prompt_logprobs is None:
            group.prompt_logprobs = []
        group.prompt_logprobs.extend(entries)

    def free_finished(self) -> list[SequenceGroup]:
        """Release finished sequences' blocks; drop groups whose every sequence finished."""
        finished: list[SequenceGroup] = []
        kept: deque[SequenceGroup] = deque()
        for group in self.running:
            for seq in group.seqs:
                if seq.is_finished() and self.block_manager.has_table(seq):
                    self.block_manager.free(seq)
            if group.is_finished():
                group.metrics.finished_time = self.clock()
                finished.append(group)
            else:
                kept.append(group)
        self.running = kept
        return finished
