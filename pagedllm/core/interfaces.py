"""The wire types between the scheduler and the workers: plain, picklable, torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.pooling_params import PoolingParams
from pagedllm.core.prefix_tier import TierTransfer
from pagedllm.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step.

    ``token_ids`` are the tokens whose KV is computed now, at positions ``start_pos ..``.
    ``do_sample`` is False for a prompt chunk that is not the prompt's last. ``history`` holds
    references to the prompt and output token lists when penalties need them (else None); the
    worker treats them as read-only.
    """

    request_id: str
    seq_id: int
    is_prompt: bool
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    do_sample: bool
    sampling_params: SamplingParams
    output_len: int
    prompt_len: int
    history: tuple[list[int], list[int]] | None = None
    # For prompt_logprobs: the tokens that follow each computed position (None otherwise).
    next_token_ids: list[int] | None = None
    # Parallel sampling: a prompt's last row is sampled best_of times (seeds keyed by index).
    num_samples: int = 1
    sample_index: int = 0
    # The request's end-of-sequence ids, which min_tokens keeps from being sampled.
    eos_token_ids: frozenset[int] = frozenset()
    # Speculative decoding (a decode only): slots are reserved for ``num_spec_tokens`` proposed
    # tokens after ``token_ids``; n-gram proposals come with the step (``spec_token_ids``), a
    # draft model's are made by the worker (None here). ``prev_token_id`` is the token before
    # ``token_ids``, which a draft model re-reads so that its cache never misses a position.
    num_spec_tokens: int = 0
    spec_token_ids: list[int] | None = None
    prev_token_id: int | None = None
    # Multi-LoRA: the request's adapter (a pagedllm.lora.LoRARequest, opaque here), None: base.
    lora_request: Any = None
    # A pooling request: its last prefill step (``do_sample``) yields a vector, not a token.
    pooling_params: PoolingParams | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything a worker needs for one forward pass, prefills first then decodes."""

    seqs: list[ScheduledSeq]
    num_prefill_seqs: int
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_preempted: int = 0
    # Structured output: one packed allowed-token bitmask row per guided sequence sampled this
    # step (an int32 tensor [rows, ceil(vocab / 32)], opaque here) and seq_id -> its row.
    token_bitmask: Any = None
    bitmask_rows: dict[int, int] = field(default_factory=dict)
    # Lower KV tiers: blocks to copy out before anything writes, and blocks to load (see
    # core/prefix_tier.py); None without tiers or traffic.
    kv_transfer: TierTransfer | None = None
    # Pipeline parallelism: which scheduler planned the step, i.e. whose KV cache it runs on.
    virtual_engine: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.blocks_to_swap_in and not self.blocks_to_swap_out


@dataclass(frozen=True)
class SampledToken:
    """One sampled token with its log-probability under the model's raw distribution."""

    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None = None
    # Beam search: extra (token, logprob) candidates ranked best first.
    candidates: list[tuple[int, float]] | None = None
    # Parallel sampling: the other samples drawn from the same row (indices 1 .. best_of-1).
    siblings: list[SampledToken] | None = None


@dataclass(frozen=True)
class SpecStepStats:
    """What speculation did in one step (seconds are the worker's wall time)."""

    num_seqs: int = 0  # sequences that verified proposals
    num_proposed: int = 0
    num_accepted: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled: dict[int, SampledToken]
    # seq_id -> one entry per prompt position computed this step (None for the first token).
    prompt_logprobs: dict[int, list[dict[int, float] | None]] = field(default_factory=dict)
    # Speculative decoding: seq_id -> the tokens accepted after ``sampled[seq_id]``, in order.
    spec_tokens: dict[int, list[SampledToken]] = field(default_factory=dict)
    spec_stats: SpecStepStats | None = None
    # Pooling requests: seq_id -> the finished vector (embedding, or a classifier's logits).
    pooled: dict[int, list[float]] = field(default_factory=dict)
