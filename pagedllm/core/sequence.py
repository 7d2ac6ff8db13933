"""Sequences and the request-level groups that own them: pure data plus small helpers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.pooling_params import PoolingParams
from pagedllm.core.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    def is_finished(self) -> bool:
        return self >= _FIRST_FINISHED

    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# Plain ints and one table, not enum lookups: these are asked several times a step per
# sequence, on a path whose Python runs with caches a decode kernel has just flushed.
_FIRST_FINISHED = int(SequenceStatus.FINISHED_STOPPED)
_FINISH_REASONS: dict[int, str] = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    # A prompt that can never run finishes without tokens; OpenAI calls that "length".
    SequenceStatus.FINISHED_IGNORED: "length",
}


@dataclass
class DetokenizerState:
    """Where incremental detokenization stands; owned by the engine's detokenizer."""

    tokens: list[str] | None = None
    prefix_offset: int = 0
    read_offset: int = 0
    decoded_outputs: int = 0  # output tokens already turned into text


class Sequence:
    """One token stream: the prompt plus what has been generated for it so far.

    ``num_computed_tokens`` counts tokens whose keys and values are in the KV cache; it is what
    makes chunked prefill, prefix caching and recompute preemption the same mechanism.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        block_size: int,
    ) -> None:
        self.seq_id = seq_id
        self.index = 0  # position among the group's samples (seeds and output order)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, float]] = []
        self.output_text = ""
        self.stop_reason: int | str | None = None
        self.detok = DetokenizerState()
        self._prefill_done = False
        # Speculative decoding: accepted tokens after the newest one, not yet appended; the
        # output processor appends them one at a time so that stop conditions see each.
        self.pending_tokens: list[tuple[int, float, dict[int, float] | None]] = []
        # Parent key of the first KV block in the prefix cache: the adapter's, so that the same
        # prompt under two adapters (or the base) never shares blocks. None: the base model.
        self.cache_root: int | None = None

    # -- lengths ---------------------------------------------------------------------------
    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        if self.output_token_ids:
            return self.output_token_ids[-1]
        return self.prompt_token_ids[-1]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without concatenating both lists."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def num_blocks_needed(self, num_tokens: int | None = None) -> int:
        n = self.get_len() if num_tokens is None else num_tokens
        return (n + self.block_size - 1) // self.block_size

    # -- stage -----------------------------------------------------------------------------
    def is_prefill(self) -> bool:
        """True until every token but the newest sampled one has been computed once."""
        return not self._prefill_done

    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED

    def update_num_computed_tokens(self, num_new: int) -> None:
        self.num_computed_tokens += num_new
        if self.num_computed_tokens >= self.get_len():
            self._prefill_done = True

    def reset_for_recompute(self) -> None:
        """Preempted by recompute: its KV is gone, so prompt and output are prefilled again."""
        self.num_computed_tokens = 0
        self._prefill_done = False

    def append_token(self, token_id: int, logprob: float, top: dict[int, float] | None) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top is not None:
            self.output_logprobs.append(top)

    def fork(self, new_seq_id: int, index: int | None = None) -> Sequence:
        child = Sequence(new_seq_id, self.prompt_token_ids, self.block_size)
        child.index = self.index if index is None else index
        child.output_token_ids = list(self.output_token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.cumulative_logprob = self.cumulative_logprob
        child.output_logprobs = list(self.output_logprobs)
        child.output_text = self.output_text
        child.detok = DetokenizerState(
            None if self.detok.tokens is None else list(self.detok.tokens),
            self.detok.prefix_offset,
            self.detok.read_offset,
            self.detok.decoded_outputs,
        )
        child._prefill_done = self._prefill_done
        child.cache_root = self.cache_root
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, len={self.get_len()}, "
            f"computed={self.num_computed_tokens})"
        )


@dataclass
class RequestMetrics:
    """Timestamps the scheduler and the metrics endpoint read (seconds, monotonic clock)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None


@dataclass
class SequenceGroup:
    """All sequences generated from one prompt (n > 1, best_of and beams fork from the first)."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    priority: int = 0
    # The model's end-of-sequence ids (generation_config): ends a sequence unless ignore_eos,
    # and min_tokens bans every one of them, not only one.
    eos_token_ids: frozenset[int] = frozenset()
    metrics: RequestMetrics = field(init=False)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_preemptions: int = 0
    # Beam search: candidates per running beam from the last step, and the search's own state.
    beam_candidates: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    beam_state: Any = None
    # Multi-LoRA: the adapter (opaque here); ``lora_id`` 0 is the base model.
    lora_request: Any = None
    # A pooling request (embedding, score): prefill-only; its vector lands in ``pooled``.
    pooling_params: PoolingParams | None = None
    pooled: list[float] | None = None

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.seqs_dict: dict[int, Sequence] = {s.seq_id: s for s in self.seqs}
        self.prompt_token_ids: list[int] = self.seqs[0].prompt_token_ids

    @property
    def lora_id(self) -> int:
        return int(getattr(self.lora_request, "lora_int_id", 0) or 0)

    def add_seq(self, seq: Sequence) -> None:
        self.seqs.append(seq)
        self.seqs_dict[seq.seq_id] = seq

    def remove_seq(self, seq_id: int) -> None:
        seq = self.seqs_dict.pop(seq_id)
        self.seqs.remove(seq)

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        if status is None:
            return len(self.seqs)
        return sum(s.status == status for s in self.seqs)

    def get_max_num_running_seqs(self) -> int:
        """How many sequences this group may run at once for the rest of its life.

        During the prompt phase a group that will fork (best_of, beams) counts all its future
        sequences, so that admitting it now cannot overrun ``max_num_seqs`` later.
        """
        if not self.seqs[0]._prefill_done:
            return self.sampling_params.best_of or 1
        return sum(s.status < _FIRST_FINISHED for s in self.seqs)

    def is_prefill(self) -> bool:
        return self.seqs[0].is_prefill()

    def is_finished(self) -> bool:
        return all(s.status >= _FIRST_FINISHED for s in self.seqs)

    def set_first_scheduled(self, now: float) -> None:
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now
            self.metrics.time_in_queue = now - self.metrics.arrival_time
