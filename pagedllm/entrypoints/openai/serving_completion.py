"""POST /v1/completions: prompts in (text, texts, token ids, lists of token ids), text out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from pagedllm.engine.client import RequestStream
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.running import error_event, merge_streams
from pagedllm.entrypoints.openai.serving_base import PromptInput, ServingBase, usage
from pagedllm.entrypoints.openai.serving_structured import guided_from_request
from pagedllm.entrypoints.openai.sse import DONE, EventStreamResponse, sse_event
from pagedllm.outputs import CompletionOutput, RequestOutput

_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token id lists"


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class OpenAIServingCompletion(ServingBase):
    prompt_param = "prompt"

    def parse_prompts(self, prompt: Any) -> list[PromptInput]:
        """The four prompt shapes OpenAI accepts, tokenized and checked against the vocabulary."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and _is_ids(prompt):
            items = [prompt]
        elif (
            isinstance(prompt, list)
            and prompt
            and (all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt))
        ):
            items = prompt
        else:
            raise APIError(f"prompt: must be {_PROMPT_SHAPES} (and not empty)", param="prompt")
        self.limits.check_chars(sum(len(i) for i in items if isinstance(i, str)), "prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenizer.encode(item)
                out.append(PromptInput(item, ids))
            else:
                out.append(PromptInput(None, list(item)))
            self.check_token_ids(out[-1].token_ids, "prompt")
        return out

    async def create(
        self, req: CompletionRequest, raw_request: Request | None
    ) -> dict[str, Any] | EventStreamResponse:
        lora = self.check_model(req.model)
        if req.suffix is not None:
            raise APIError(
                "suffix: is not supported by this server",
                param="suffix",
                code="unsupported_parameter",
            )
        self.check_stream_flags(req)
        prompts = await self.offload.run(self.parse_prompts, req.prompt)
        self.offload.trim_later(sum(len(p.token_ids) for p in prompts))
        logprobs = req.logprobs
        guided, guided_param = guided_from_request(req)
        for p in prompts:
            self.check_prompt_fits(len(p.token_ids))
        params = self.sampling_params(
            req,
            max_tokens=req.max_tokens,
            logprobs=logprobs,
            prompt_logprobs=logprobs if req.echo and logprobs is not None else None,
            guided_decoding=guided,
        )
        await self.guided_validator.check(guided, guided_param)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        pairs = await self.start(
            request_id,
            prompts,
            [params] * len(prompts),
            priority=req.priority,
            raw_request=raw_request,
            lora_request=lora,
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(
                self._stream(req, pairs, prompts, request_id, created, include_usage)
            )
        finals = await self.collect(pairs, raw_request)
        return self._response(req, finals, prompts, request_id, created)

    # -- non-streaming ---------------------------------------------------------------------------
    def _response(
        self,
        req: CompletionRequest,
        finals: list[RequestOutput],
        prompts: list[PromptInput],
        request_id: str,
        created: int,
    ) -> dict[str, Any]:
        choices = []
        completion_tokens = 0
        for i, (final, prompt) in enumerate(zip(finals, prompts, strict=True)):
            for c in final.outputs:
                completion_tokens += len(c.token_ids)
                text, lp = c.text, None
                if req.logprobs is not None:
                    lp = self._logprobs(c.token_ids, c.logprobs or [], 0)
                if req.echo:
                    prompt_text = self._prompt_text(prompt)
                    if lp is not None:
                        lp = self._merge_echo(prompt, final, lp, len(prompt_text))
                    text = prompt_text + text
                choices.append(
                    {
                        "index": i * req.n + c.index,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.response_model(req.model),
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def _prompt_text(self, prompt: PromptInput) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids)

    def _logprobs(
        self, token_ids: list[int], entries: list[dict[int, float]], offset: int
    ) -> dict[str, Any]:
        """OpenAI's legacy logprobs object for generated tokens, text offsets from ``offset``."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for token, entry in zip(token_ids, entries, strict=False):
            text = self.token_text(token)
            tokens.append(text)
            token_lps.append(entry.get(token))
            tops.append({self.token_text(t): v for t, v in self.top_entries(entry)})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _merge_echo(
        self, prompt: PromptInput, final: RequestOutput, lp: dict[str, Any], prompt_chars: int
    ) -> dict[str, Any]:
        """Prepend the prompt tokens (and their logprobs, first one None) for ``echo``."""
        entries = list(final.prompt_logprobs or [])
        entries += [None] * (len(prompt.token_ids) - len(entries))
        tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
        for token, entry in zip(prompt.token_ids, entries, strict=False):
            text = self.token_text(token)
            tokens.append(text)
            token_lps.append(None if entry is None else entry.get(token))
            tops.append(
                None
                if entry is None
                else {self.token_text(t): v for t, v in self.top_entries(entry)}
            )
            offsets.append(offset)
            offset += len(text)
        shift = prompt_chars
        return {
            "tokens": tokens + lp["tokens"],
            "token_logprobs": token_lps + lp["token_logprobs"],
            "top_logprobs": tops + lp["top_logprobs"],
            "text_offset": offsets + [o + shift for o in lp["text_offset"]],
        }

    # -- streaming -------------------------------------------------------------------------------
    async def _stream(
        self,
        req: CompletionRequest,
        pairs: list[tuple[RequestStream, RequestOutput]],
        prompts: list[PromptInput],
        request_id: str,
        created: int,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        head = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.response_model(req.model),
        }
        try:
            async for i, out in merge_streams(pairs):
                for c in out.outputs:
                    index = i * req.n + c.index
                    chunk = self._delta(req, prompts[i], out, c, index, sent_text, sent_tokens)
                    completion_tokens[index] = len(c.token_ids)
                    if chunk is not None:
                        body = {**head, "choices": [chunk]}
                        if include_usage:
                            body["usage"] = None
                        yield sse_event(body)
            if include_usage:
                prompt_tokens = sum(len(p.token_ids) for p in prompts)
                body = {
                    **head,
                    "choices": [],
                    "usage": usage(prompt_tokens, sum(completion_tokens.values())),
                }
                yield sse_event(body)
        except Exception as exc:  # the stream has begun: report in-band, then end it
            yield error_event(exc).sse_event()
        finally:
            for stream, _ in pairs:
                stream.abort()
        yield DONE

    def _delta(
        self,
        req: CompletionRequest,
        prompt: PromptInput,
        out: RequestOutput,
        c: CompletionOutput,
        index: int,
        sent_text: dict[int, int],
        sent_tokens: dict[int, int],
    ) -> dict[str, Any] | None:
        first = index not in sent_text
        text_from, tokens_from = sent_text.get(index, 0), sent_tokens.get(index, 0)
        delta = c.text[text_from:]
        new_tokens = c.token_ids[tokens_from:]
        wants_tokens = req.logprobs is not None and new_tokens
        if not delta and c.finish_reason is None and not wants_tokens and not (first and req.echo):
            return None
        sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
        lp = None
        if req.logprobs is not None:
            lp = self._logprobs(new_tokens, (c.logprobs or [])[tokens_from:], text_from)
        if req.echo:
            prompt_text = self._prompt_text(prompt)
            if first:
                delta = prompt_text + delta
                if lp is not None:
                    lp = self._merge_echo(prompt, out, lp, len(prompt_text))
            elif lp is not None:
                lp["text_offset"] = [o + len(prompt_text) for o in lp["text_offset"]]
        return {
            "index": index,
            "text": delta,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
