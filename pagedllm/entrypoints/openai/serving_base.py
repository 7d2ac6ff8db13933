"""What completions and chat share: validation, sampling parameters, running requests.

Every check that can fail happens before a response starts: the requests are added to the engine
and their first output is awaited before a 200 (or the first byte of a stream) goes out, so a
client never sees a 200 followed by an error for anything it sent.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pagedllm.core.guided_params import GuidedDecodingParams
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.admission import CONTEXT_LENGTH
from pagedllm.engine.client import (
    EngineClient,
    RequestStream,
)
from pagedllm.entrypoints.openai.errors import APIError, from_value_error, model_not_found
from pagedllm.entrypoints.openai.offload import Offloader, RequestLimits
from pagedllm.entrypoints.openai.protocol import SamplingFields
from pagedllm.entrypoints.openai.running import (
    arrival_time,
    engine_errors,
    last_output,
    until_disconnected,
)
from pagedllm.entrypoints.openai.serving_structured import GuidedValidator
from pagedllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

MAX_LOGIT_BIAS = 100.0
# OpenAI fields that change nothing about the output, so ignoring them is honest; any other
# unknown field (functions, function_call, audio, ...) is refused by name.
IGNORED_FIELDS = frozenset({"store", "metadata", "service_tier"})


@dataclass(frozen=True)
class ModelInfo:
    """What the API reports about the one model it serves."""

    names: tuple[str, ...]  # served names; the first is used in responses
    root: str  # the path the weights came from
    max_model_len: int
    vocab_size: int
    created: int
    # LoRA adapters served over the base: name -> pagedllm.lora.LoRARequest (changes at run
    # time through /v1/load_lora_adapter and /v1/unload_lora_adapter).
    adapters: dict[str, Any] = field(default_factory=dict)
    # The model's defaults of the sampling fields a request leaves out (SamplingParams names;
    # engine/sampling_defaults.py), shown by /v1/models.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # What the engine serves ("generate", "embed" or "score") and what the checkpoint is
    # ("generate", "embed" or "classify"): which routes answer (serving_pooling.ROUTE_TASKS).
    task: str = "generate"
    model_task: str = "generate"

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class PromptInput:
    text: str | None
    token_ids: list[int]


class ServingBase:
    """Shared by the completion and chat handlers; one instance per app."""

    prompt_param = "prompt"

    def __init__(
        self,
        engine: EngineClient,
        model: ModelInfo,
        *,
        max_logprobs: int = 20,
        offload: Offloader | None = None,
        limits: RequestLimits | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.max_logprobs = max_logprobs
        # Tokenizer work runs in this pool, never on the event loop (see offload.py).
        self.offload = offload or Offloader()
        self.limits = limits or RequestLimits()
        self.guided_validator = GuidedValidator(engine.tokenizer, model.vocab_size)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # -- validation ------------------------------------------------------------------------
    def check_model(self, name: str | None) -> Any:
        """The adapter (a LoRARequest) the ``model`` field names; None for the base model."""
        if name in self.model.names:
            return None
        adapter = self.model.adapters.get(name) if isinstance(name, str) else None
        if adapter is None:
            raise model_not_found(name, [*self.model.names, *self.model.adapters])
        return adapter

    def response_model(self, name: str) -> str:
        """The ``model`` of a reply: the adapter's name when one ran, else the served name."""
        return name if name in self.model.adapters else self.model.name

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(f"{param}: the prompt is empty", param=param)
        self.limits.check_tokens(len(ids), param)
        vocab = self.model.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise APIError(
                    f"{param}: token id {t!r} is outside the vocabulary [0, {vocab})",
                    param=param,
                    code="invalid_token_id",
                )

    def check_prompt_fits(self, prompt_len: int) -> None:
        """A prompt that leaves no room for output is refused before it reaches the engine.

        ``max_tokens`` is the engine's to default and check (``add_request``); the server only
        maps the field, so Python and HTTP callers get one answer.
        """
        limit = self.model.max_model_len
        if prompt_len >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{prompt_len} tokens, leaving no room for output",
                param=self.prompt_param,
                code="context_length_exceeded",
            )

    def check_stream_flags(self, req: SamplingFields) -> None:
        if req.stream_options is not None and not req.stream:
            raise APIError(
                "stream_options: only allowed when stream is true", param="stream_options"
            )
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            raise APIError(
                "stream_options: continuous_usage_stats is not supported",
                param="stream_options",
                code="unsupported_parameter",
            )
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise APIError("best_of: streaming is not supported when best_of > n", param="best_of")
        unknown = [f for f in req.unknown_fields() if f not in IGNORED_FIELDS]
        if unknown:  # a field we would ignore could change what the client expects back
            raise APIError(
                f"{unknown[0]}: is not a supported field of this endpoint",
                param=unknown[0],
                code="unsupported_parameter",
            )

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(
                    f"logit_bias: key {key!r} is not a token id", param="logit_bias"
                ) from None
            if not 0 <= token < self.model.vocab_size:
                raise APIError(
                    f"logit_bias: token id {token} is outside the vocabulary "
                    f"[0, {self.model.vocab_size})",
                    param="logit_bias",
                )
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise APIError(
                    f"logit_bias: values must be in [-100, 100], got {value}", param="logit_bias"
                )
            out[token] = value
        return out

    def sampling_params(
        self,
        req: SamplingFields,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        logprobs_param: str = "logprobs",
        guided_decoding: GuidedDecodingParams | None = None,
    ) -> SamplingParams:
        """The request's sampling fields as validated SamplingParams (400 naming the field).

        A field the request leaves out takes the model's default (``ModelInfo.sampling_defaults``),
        else SamplingParams' own; ``max_tokens`` None is filled in ``start`` (the model's
        default, at most the room left).
        """
        if logprobs is not None and logprobs > self.max_logprobs:
            raise APIError(
                f"{logprobs_param}: at most {self.max_logprobs} are supported, got {logprobs}",
                param=logprobs_param,
            )
        stop_ids = list(req.stop_token_ids or [])
        bad = [t for t in stop_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise APIError(
                f"stop_token_ids: token id {bad[0]} is outside the vocabulary",
                param="stop_token_ids",
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])

        defaults = self.model.sampling_defaults

        def pick(value: Any, default: Any, name: str = "") -> Any:
            return defaults.get(name, default) if value is None else value

        try:
            return SamplingParams(
                n=req.n,
                best_of=req.best_of,
                temperature=pick(req.temperature, 1.0, "temperature"),
                top_p=pick(req.top_p, 1.0, "top_p"),
                top_k=pick(req.top_k, -1, "top_k"),
                min_p=pick(req.min_p, 0.0, "min_p"),
                seed=req.seed,
                presence_penalty=pick(req.presence_penalty, 0.0),
                frequency_penalty=pick(req.frequency_penalty, 0.0),
                repetition_penalty=pick(req.repetition_penalty, 1.0, "repetition_penalty"),
                logit_bias=self._logit_bias(req.logit_bias),
                stop=stop,
                stop_token_ids=stop_ids,
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                guided_decoding=guided_decoding,
            )
        except ValueError as exc:
            raise from_value_error(exc) from exc

    # -- running -------------------------------------------------------------------------------
    async def start(
        self,
        request_id: str,
        prompts: list[PromptInput],
        params: list[SamplingParams],
        *,
        priority: int,
        raw_request: Request | None,
        lora_request: Any = None,
    ) -> list[tuple[RequestStream, RequestOutput]]:
        """Add every prompt and wait for each one's first output; any failure aborts them all."""
        streams: list[RequestStream] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                sp = self._default_length(sp, len(prompt.token_ids))
                engine_prompt = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
                try:
                    with engine_errors():
                        streams.append(
                            await self.engine.add_request(
                                f"{request_id}-{i}",
                                engine_prompt,
                                sp,
                                priority=priority,
                                arrival_time=arrival_time(raw_request),
                                lora_request=lora_request,
                            )
                        )
                except ValueError as exc:
                    raise self._refusal(exc) from exc
            with engine_errors():
                firsts = await until_disconnected(
                    raw_request, asyncio.gather(*(anext(s) for s in streams))
                )
            for first in firsts:
                if first.error:
                    raise APIError(
                        first.error, param=self.prompt_param, code="context_length_exceeded"
                    )
            return list(zip(streams, firsts, strict=True))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise

    def _default_length(self, sp: SamplingParams, prompt_len: int) -> SamplingParams:
        """No ``max_tokens``: the model's default length where it has one, at most the room the
        prompt leaves (the engine gives the whole room otherwise)."""
        cap = self.model.sampling_defaults.get("max_tokens")
        if sp.max_tokens is not None or cap is None:
            return sp
        return sp.clone(max_tokens=max(1, min(cap, self.model.max_model_len - prompt_len)))

    def _refusal(self, exc: ValueError) -> APIError:
        """The engine's ``ValueError("field: ...")`` at ``add_request`` as a 400 naming the field
        (the prompt under this endpoint's name)."""
        error = from_value_error(
            exc,
            default_param=self.prompt_param,
            aliases={"prompt": self.prompt_param, "prompt_token_ids": self.prompt_param},
        )
        if CONTEXT_LENGTH in error.message:
            error.code = "context_length_exceeded"
        return error

    async def collect(
        self, pairs: list[tuple[RequestStream, RequestOutput]], raw_request: Request | None
    ) -> list[RequestOutput]:
        """Run every request to the end (non-streaming); aborts them if the client leaves."""
        try:
            with engine_errors():
                return await until_disconnected(
                    raw_request, asyncio.gather(*(last_output(s, f) for s, f in pairs))
                )
        finally:
            for stream, _ in pairs:
                stream.abort()

    # -- output helpers ------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def top_entries(
        self, entry: dict[int, float] | None, limit: int | None = None
    ) -> list[tuple[int, float]]:
        """A logprob dict as (token, logprob), most likely first."""
        items = sorted((entry or {}).items(), key=lambda kv: kv[1], reverse=True)
        return items if limit is None else items[:limit]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
