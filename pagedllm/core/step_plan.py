"""The scheduler's working parts: step budgets, step plans, stats, the wire items it emits, and
what a request's kind asks of a step (whole prompts, no KV blocks), shared by the planner and
the queues."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.interfaces import ScheduledSeq
from pagedllm.core.sequence import Sequence, SequenceGroup


@dataclass
class SchedulerStats:
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    chunked_prefill_steps: int = 0
    steps: int = 0

    @property
    def preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap


@dataclass
class Budget:
    token_budget: int
    max_num_seqs: int
    num_tokens: int = 0
    num_seqs: int = 0

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return (
            self.num_tokens + num_tokens <= self.token_budget
            and self.num_seqs + num_seqs <= self.max_num_seqs
        )

    @property
    def tokens_left(self) -> int:
        return self.token_budget - self.num_tokens


@dataclass
class StepPlan:
    """What one ``schedule`` call decided, before it becomes a SchedulerOutput."""

    prefills: list[tuple[SequenceGroup, int]] = field(default_factory=list)  # (group, chunk)
    decodes: list[SequenceGroup] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: int = 0
    # Speculative decoding: seq_id -> (lookahead slots reserved, n-gram proposals or None).
    lookahead: dict[int, tuple[int, list[int] | None]] = field(default_factory=dict)


def build_scheduled_seq(
    group: SequenceGroup,
    seq: Sequence,
    num_tokens: int,
    is_prompt: bool,
    block_table: list[int],
) -> ScheduledSeq:
    """One sequence's share of a step, as the worker sees it."""
    start = seq.num_computed_tokens
    end = start + num_tokens
    do_sample = end >= seq.get_len()
    params = group.sampling_params
    history = (seq.prompt_token_ids, seq.output_token_ids) if params.needs_token_history else None
    wants_prompt_lp = (
        is_prompt
        and params.prompt_logprobs is not None
        and seq.get_output_len() == 0
        and start < seq.get_prompt_len()
    )
    num_samples = 1
    if (
        do_sample
        and seq.get_output_len() == 0
        and len(group.seqs) == 1
        and not params.use_beam_search
    ):
        num_samples = params.best_of or 1
    return ScheduledSeq(
        request_id=group.request_id,
        seq_id=seq.seq_id,
        is_prompt=is_prompt,
        token_ids=seq.token_slice(start, end),
        start_pos=start,
        block_table=block_table,
        do_sample=do_sample,
        sampling_params=params,
        output_len=seq.get_output_len(),
        prompt_len=seq.get_prompt_len(),
        history=history,
        next_token_ids=seq.token_slice(start + 1, end + 1) if wants_prompt_lp else None,
        num_samples=num_samples,
        sample_index=seq.index,
        eos_token_ids=group.eos_token_ids,
        lora_request=group.lora_request,
        pooling_params=group.pooling_params,
    )


def whole_prompt(group: SequenceGroup) -> bool:
    """Every prompt position is computed (no prefix-cache skip): prompt log-probabilities, or
    a model that pools over every position."""
    return group.sampling_params.prompt_logprobs is not None or unchunked(group)


def unchunked(group: SequenceGroup) -> bool:
    """A prompt pooled over every position runs in one step: no chunk holds its hidden states."""
    pooling = group.pooling_params
    return pooling is not None and (pooling.whole_prompt or not pooling.uses_kv_cache)


def holds_blocks(group: SequenceGroup) -> bool:
    """False for a bidirectional encoder's request, which runs without a KV cache."""
    return group.pooling_params is None or group.pooling_params.uses_kv_cache
