"""POST /v1/chat/completions: messages rendered with the chat template, then one completion.

The request flow: checks, the tool plan and its constraint, rendering in a worker, the engine's
streams, the reply whole or as events. What a message becomes for the template is in
``chat_messages``; what each streamed output adds, in ``chat_stream``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import Request

from pagedllm.core.guided_params import GuidedDecodingParams
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.client import EngineClient, RequestStream
from pagedllm.entrypoints.openai.chat_messages import message_chars, message_dicts
from pagedllm.entrypoints.openai.chat_stream import ChatChunks
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.running import error_event, merge_streams
from pagedllm.entrypoints.openai.serving_base import ModelInfo, PromptInput, ServingBase, usage
from pagedllm.entrypoints.openai.serving_structured import guided_from_request
from pagedllm.entrypoints.openai.serving_tools import ToolPlan, plan_tools, tool_message
from pagedllm.entrypoints.openai.sse import DONE, EventStreamResponse, sse_event
from pagedllm.entrypoints.openai.template_render import (
    ChatTemplateError,
    TemplateLimits,
    TemplateRenderer,
)
from pagedllm.entrypoints.openai.tool_auto import detect_auto_tools, with_system_text
from pagedllm.entrypoints.openai.tool_repeats import stop_at_repeats
from pagedllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


def _constraint(
    req: ChatCompletionRequest, plan: ToolPlan
) -> tuple[GuidedDecodingParams | None, str | None]:
    """The one constraint on the reply, and the parameter that set it: the request's own
    (``response_format``, ``guided_*``) or the one its tool choice implies."""
    guided, guided_param = guided_from_request(req)
    if plan.guided is None:
        return guided, guided_param
    if plan.answer_param is not None:  # the fallback's answer took the request's constraint
        return plan.guided, plan.answer_param
    if guided is not None:  # "required" or a named call: the reply is the calls' JSON
        raise APIError(
            f"{guided_param}: cannot be combined with tool_choice {req.tool_choice!r}",
            param=guided_param,
        )
    return plan.guided, "tools"


class OpenAIServingChat(ServingBase):
    prompt_param = "messages"

    def __init__(
        self,
        engine: EngineClient,
        model: ModelInfo,
        *,
        chat_template: str | None = None,
        chat_template_name: str | None = None,
        template_limits: TemplateLimits | None = None,
        max_logprobs: int = 20,
        tool_call_parser: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(engine, model, max_logprobs=max_logprobs, **kwargs)
        self.chat_template = chat_template
        name = chat_template_name or (
            "--chat-template" if chat_template else f"{Path(model.root).name}'s chat template"
        )
        # Renders run in killable workers (template_render.py); the first one is the start-up
        # check: a template that cannot render one message within the bounds is refused here.
        self.renderer = TemplateRenderer(
            self.tokenizer, f"the chat template ({name})", template_limits
        )
        if self._template():
            try:
                self.renderer.check_startup(self.chat_template)
            except Exception:
                self.renderer.close()
                raise
        self.auto_tools = detect_auto_tools(self._template(), self._render_text, tool_call_parser)

    def _template(self) -> str | None:
        return self.chat_template or getattr(self.tokenizer, "chat_template", None)

    def _render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The chat template applied to message dicts (``tools`` passed only when given), in a
        worker within the render bounds."""
        return self.renderer.render(messages, self._template(), tools, **kwargs)

    def render(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        system_text: str | None = None,
    ) -> PromptInput:
        """The conversation as prompt text and token ids, via the chat template;
        ``system_text`` goes first in the system message (the tool fallback's description)."""
        if not messages:
            raise APIError("messages: must not be empty", param="messages")
        self.limits.check_chars(sum(message_chars(m.content) for m in messages), "messages")
        if not self._template():
            raise APIError(
                "this model has no chat template; start the server with --chat-template "
                "(a file or a Jinja string) or use /v1/completions",
                param="messages",
                code="chat_template_missing",
            )
        try:
            dicts = message_dicts(messages)
            if system_text:
                dicts = with_system_text(dicts, system_text)
            text = self._render_text(
                dicts,
                tools,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except APIError:
            raise
        except ChatTemplateError as exc:  # failed, or stopped at a bound: the text names it
            code = "chat_template_error" if exc.kind == "error" else "chat_template_limit"
            raise APIError(f"messages: {exc}", param="messages", code=code) from None
        except Exception as exc:  # jinja errors, raise_exception() in templates
            raise APIError(f"messages: the chat template failed: {exc}", param="messages") from exc
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.check_token_ids(ids, "messages")
        return PromptInput(text, ids)

    async def create(
        self, req: ChatCompletionRequest, raw_request: Request | None
    ) -> dict[str, Any] | EventStreamResponse:
        lora = self.check_model(req.model)
        plan = plan_tools(req, self.auto_tools)
        guided, guided_param = _constraint(req, plan)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs: requires logprobs to be true", param="top_logprobs")
        self.check_stream_flags(req)
        prompt = await self.offload.run(
            self.render,
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs,
            tools=plan.tools,
            system_text=plan.system_text,
        )
        self.check_prompt_fits(len(prompt.token_ids))
        params = self.sampling_params(
            req,
            max_tokens=(
                req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
            ),
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            logprobs_param="top_logprobs",
            guided_decoding=guided,
        )
        for schema in plan.schemas.values():  # a malformed parameters schema is a 400 on tools
            await self.guided_validator.check(GuidedDecodingParams(json=schema), "tools")
        await self.guided_validator.check(guided, guided_param)
        self.offload.trim_later(len(prompt.token_ids))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        pairs = await self.start(
            request_id,
            [prompt],
            [params],
            priority=req.priority,
            raw_request=raw_request,
            lora_request=lora,
        )
        if plan.parser is not None and params.best_of == params.n and not params.use_beam_search:
            pairs = stop_at_repeats(pairs, plan.parser, self._decoder(params))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(
                self._stream(req, pairs, prompt, request_id, created, include_usage, plan)
            )
        (final,) = await self.collect(pairs, raw_request)
        return self._response(req, final, prompt, request_id, created, plan)

    def _decoder(self, params: SamplingParams) -> Callable[[list[int]], str]:
        """Token ids to text as the engine's detokenizer writes a reply (for ``tool_repeats``)."""
        skip = params.skip_special_tokens
        return lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip)

    def _response(
        self,
        req: ChatCompletionRequest,
        final: RequestOutput,
        prompt: PromptInput,
        request_id: str,
        created: int,
        plan: ToolPlan,
    ) -> dict[str, Any]:
        choices = []
        for c in final.outputs:
            message, reason = ({"role": "assistant", "content": c.text}, c.finish_reason)
            if plan.active:
                message, reason = tool_message(plan, c)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(req, c.token_ids, c.logprobs)
                    if req.logprobs
                    else None,
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.response_model(req.model),
            "choices": choices,
            "usage": usage(len(prompt.token_ids), completion_tokens),
        }

    def _logprobs(
        self,
        req: ChatCompletionRequest,
        token_ids: list[int],
        entries: list[dict[int, float]] | None,
    ) -> dict[str, Any]:
        def item(token: int, logprob: float | None) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for token, entry in zip(token_ids, entries or [], strict=False):
            top = [item(t, v) for t, v in self.top_entries(entry, req.top_logprobs or 0)]
            content.append({**item(token, entry.get(token)), "top_logprobs": top})
        return {"content": content}

    async def _stream(
        self,
        req: ChatCompletionRequest,
        pairs: list[tuple[RequestStream, RequestOutput]],
        prompt: PromptInput,
        request_id: str,
        created: int,
        include_usage: bool,
        plan: ToolPlan,
    ) -> AsyncIterator[bytes]:
        head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.response_model(req.model),
        }

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            body = {**head, "choices": choices, **extra}
            if include_usage and "usage" not in extra:
                body["usage"] = None
            return sse_event(body)

        chunks = ChatChunks(req, plan, self._logprobs)
        completion_tokens: dict[int, int] = {}
        try:
            async for _, out in merge_streams(pairs):
                for c in out.outputs:
                    for choice in chunks.choices(c):
                        yield event([choice])
                    completion_tokens[c.index] = len(c.token_ids)
            if include_usage:
                total = sum(completion_tokens.values())
                yield event([], usage=usage(len(prompt.token_ids), total))
        except Exception as exc:  # the stream has begun: report in-band, then end it
            yield error_event(exc).sse_event()
        finally:
            for stream, _ in pairs:
                stream.abort()
        yield DONE
