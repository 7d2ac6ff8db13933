"""/v1/embeddings (OpenAI's shape), /v1/score (vLLM's) and /v1/rerank (Jina's and Cohere's).

Every input is one pooling request to the engine, added together so they share steps; a
request the engine refuses (an empty text, a token id outside the vocabulary, a text longer
than the model's positions) is a 400 naming the field, and the inputs already added are
aborted, so nothing of a refused request stays in the engine. Scores are computed as
``Engine.score`` computes them (``engine/pooling_api.py``).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request

from pagedllm.core.pooling_params import PoolingParams
from pagedllm.engine.client import EngineClient, RequestStream
from pagedllm.engine.pooling_api import MAX_INPUTS, check_inputs, logit_score, pair_prompt
from pagedllm.entrypoints.openai.errors import APIError, from_value_error
from pagedllm.entrypoints.openai.offload import Offloader, RequestLimits
from pagedllm.entrypoints.openai.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from pagedllm.entrypoints.openai.running import arrival_time, engine_errors, until_disconnected
from pagedllm.entrypoints.openai.serving_base import ModelInfo
from pagedllm.outputs import RequestOutput

# Which engine tasks each route serves (a bi-encoder scores by cosine, so "embed" scores too).
ROUTE_TASKS = {
    "/v1/embeddings": ("embed",),
    "/v1/score": ("score", "embed"),
    "/v1/rerank": ("score", "embed"),
    "/v1/completions": ("generate",),
    "/v1/chat/completions": ("generate",),
}


def check_route(route: str, model: ModelInfo) -> None:
    """A route the served model's task does not serve is a 400 naming both."""
    if model.task not in ROUTE_TASKS[route]:
        raise APIError(
            f"{route} is not served by this model: its task is {model.task} "
            f"(start the server with a model whose task is {' or '.join(ROUTE_TASKS[route])})",
            param="model",
            code="wrong_task",
        )


class OpenAIServingPooling:
    def __init__(
        self,
        engine: EngineClient,
        model: ModelInfo,
        *,
        offload: Offloader,
        limits: RequestLimits,
    ) -> None:
        self.engine = engine
        self.model = model
        self.offload = offload
        self.limits = limits

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model.names:
            raise APIError(
                f"The model '{name}' does not exist; this server serves {list(self.model.names)}",
                status=404,
                param="model",
                code="model_not_found",
            )

    # -- the routes ------------------------------------------------------------------------
    async def embeddings(self, req: EmbeddingRequest, raw: Request | None) -> dict[str, Any]:
        check_route("/v1/embeddings", self.model)
        self._check_model(req.model)
        if req.encoding_format not in ("float", "base64"):
            raise APIError("encoding_format: must be float or base64", param="encoding_format")
        prompts = await self._prompts(_embedding_inputs(req.input))
        try:
            params = PoolingParams(
                dimensions=req.dimensions,
                normalize=req.normalize,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
            )
        except ValueError as exc:
            raise from_value_error(exc) from exc
        outs = await self._run(prompts, params, raw, "embd")
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(out.pooled, req)}
            for i, out in enumerate(outs)
        ]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {
            "object": "list",
            "data": data,
            "model": self.model.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def score(self, req: ScoreRequest, raw: Request | None) -> dict[str, Any]:
        check_route("/v1/score", self.model)
        self._check_model(req.model)
        queries = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
        docs = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
        _check(queries, "text_1")
        _check(docs, "text_2")
        if len(queries) == 1:
            queries = queries * len(docs)
        elif len(queries) != len(docs):
            raise APIError("text_1: one text, or as many as text_2", param="text_1")
        scores, tokens = await self._scores(queries, docs, req.truncate_prompt_tokens, raw)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self.model.name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def rerank(self, req: RerankRequest, raw: Request | None) -> dict[str, Any]:
        check_route("/v1/rerank", self.model)
        self._check_model(req.model)
        if not req.query:
            raise APIError("query: must be a non-empty string", param="query")
        _check(req.documents, "documents")
        if req.top_n is not None and req.top_n < 1:
            raise APIError("top_n: must be a positive integer", param="top_n")
        queries = [req.query] * len(req.documents)
        scores, tokens = await self._scores(queries, req.documents, req.truncate_prompt_tokens, raw)
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        results = []
        for i in order[: req.top_n or len(order)]:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                item["document"] = {"text": req.documents[i]}
            results.append(item)
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": self.model.name,
            "usage": {"total_tokens": tokens},
            "results": results,
        }

    # -- running ---------------------------------------------------------------------------
    async def _scores(
        self, queries: list[str], docs: list[str], truncate: int | None, raw: Request | None
    ) -> tuple[list[float], int]:
        if self.model.model_task == "classify":  # a cross-encoder reads each pair as one input
            tok = self.engine.tokenizer
            pairs = list(zip(queries, docs, strict=True))
            prompts = await self.offload.run(
                lambda: [pair_prompt(tok, q, d, truncate) for q, d in pairs]
            )
            outs = await self._run(prompts, PoolingParams(task="classify"), raw, "score")
            scores = [logit_score(o.pooled or []) for o in outs]
            return scores, sum(len(o.prompt_token_ids) for o in outs)
        distinct = list(dict.fromkeys(queries))
        texts = await self._prompts(distinct + docs)
        params = PoolingParams(normalize=True, truncate_prompt_tokens=truncate)
        outs = await self._run(texts, params, raw, "score")
        vecs = {q: np.asarray(o.pooled) for q, o in zip(distinct, outs, strict=False)}
        doc_vecs = [np.asarray(o.pooled) for o in outs[len(distinct) :]]
        scores = [float(vecs[q] @ d) for q, d in zip(queries, doc_vecs, strict=True)]
        return scores, sum(len(o.prompt_token_ids) for o in outs)

    async def _prompts(self, inputs: list[Any]) -> list[dict[str, Any]]:
        """Texts tokenized in the offload pool (never on the event loop); token ids as given."""
        for item in inputs:
            if isinstance(item, str):
                self.limits.check_chars(len(item), "input")
            else:
                self.limits.check_tokens(len(item), "input")
        tok = self.engine.tokenizer

        def tokenize() -> list[dict[str, Any]]:
            return [
                {"prompt": x, "prompt_token_ids": tok.encode(x)}
                if isinstance(x, str)
                else {"prompt_token_ids": x}
                for x in inputs
            ]

        prompts = await self.offload.run(tokenize)
        self.offload.trim_later(sum(len(p["prompt_token_ids"]) for p in prompts))
        return prompts

    async def _run(
        self, prompts: list[dict[str, Any]], params: PoolingParams, raw: Request | None, kind: str
    ) -> list[RequestOutput]:
        """Add every input, then wait for every vector; any refusal aborts them all."""
        base = f"{kind}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for i, prompt in zip(itertools.count(), prompts):
                try:
                    with engine_errors():
                        streams.append(
                            await self.engine.add_request(
                                f"{base}-{i}", prompt, params, arrival_time=arrival_time(raw)
                            )
                        )
                except ValueError as exc:
                    aliases = {"prompt": "input", "prompt_token_ids": "input"}
                    raise from_value_error(exc, default_param="input", aliases=aliases) from exc
            with engine_errors():
                outs = await until_disconnected(raw, asyncio.gather(*map(_last, streams)))
        finally:
            for stream in streams:
                stream.abort()
        for out in outs:
            if out.pooled is None:
                status = 500 if out.failed else 400
                raise APIError(out.error or "the request ended without a vector", status=status)
        return outs


async def _last(stream: RequestStream) -> RequestOutput:
    last: RequestOutput | None = None
    async for out in stream:
        last = out
    assert last is not None
    return last


def _check(inputs: list[Any], field: str) -> None:
    try:
        check_inputs(inputs, field)
    except ValueError as exc:
        raise APIError(str(exc), param=field) from exc


def _embedding_inputs(value: Any) -> list[Any]:
    """OpenAI's ``input``: a string, a list of strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_id(v) for v in value):
        items = [value]
    elif isinstance(value, list) and all(
        isinstance(v, str) or (isinstance(v, list) and all(_is_id(t) for t in v)) for v in value
    ):
        items = list(value)
    else:
        raise APIError(
            "input: must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
            param="input",
        )
    if len(items) > MAX_INPUTS:
        raise APIError(f"input: at most {MAX_INPUTS} inputs per request, got {len(items)}",
                       param="input")  # fmt: skip
    _check(items, "input")
    return items


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _encode(vec: list[float] | None, req: EmbeddingRequest) -> list[float] | str:
    """Floats, or OpenAI's base64: the little-endian float32 bytes."""
    assert vec is not None
    if req.encoding_format == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec
