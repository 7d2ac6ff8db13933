"""Request bodies of the OpenAI-compatible API, as pydantic models.

Fields follow OpenAI's names and defaults; vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ...) are accepted as
well. Unknown fields are ignored (and logged) the way vLLM does, so clients that send newer
OpenAI fields keep working. Range checks live in :class:`SamplingParams`, not here, so the server
and the offline engine reject the same values with the same messages.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Body):
    """What completions and chat share."""

    model: str
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    # Structured output: OpenAI's response_format and vLLM's guided_* extras (one at most).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    # str | list[str] | list[int] | list[list[int]]; checked by hand for a clearer message.
    prompt: Any = Field(...)
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Tool calling history: an assistant's calls, and a tool message's answer to one of them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    # None (left out): OpenAI's default, true (several calls per reply; a repeated call ends a
    # constrained reply: tool_repeats).
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Body):
    """OpenAI's embeddings body (``truncate_prompt_tokens`` and ``normalize`` are vLLM's)."""

    model: str
    # str | list[str] | list[int] | list[list[int]]; checked by hand for a clearer message.
    input: Any = Field(...)
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None


class ScoreRequest(_Body):
    """vLLM's /score: ``text_1`` (one query, or one per pair) against each of ``text_2``."""

    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class RerankRequest(_Body):
    """Jina's and Cohere's rerank body, as vLLM serves it."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
