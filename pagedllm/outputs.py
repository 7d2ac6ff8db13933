"""What the engine hands back to callers, one RequestOutput per request per step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetricsView:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetricsView | None = None
    # Why a request finished without running (prompt too long for the context or the cache).
    error: str | None = None
    # True when the engine ended the request because its step failed (``error`` says how):
    # the server's fault, not the client's input.
    failed: bool = False
    num_cached_tokens: int = 0
    # A pooling request's vector (an embedding, or a classifier's logits) once it finished.
    pooled: list[float] | None = None


@dataclass
class EmbeddingRequestOutput:
    """One input's embedding (``Engine.embed``): float32 values, normalised unless asked not."""

    request_id: str
    embedding: list[float]
    prompt_token_ids: list[int]


@dataclass
class ScoringRequestOutput:
    """One document's relevance to the query (``Engine.score``); ``num_tokens`` it read."""

    request_id: str
    score: float
    num_tokens: int
