"""The server's routes: status (open), the OpenAI API under /v1 and the token routes (behind
the API key), and the API's own docs. ``api_server.build_app`` assembles them into the app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

import pagedllm
from pagedllm.engine.client import EngineClient
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.entrypoints.openai.offload import Offloader, RequestLimits
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.request_body import B, read_body
from pagedllm.entrypoints.openai.serving_base import ModelInfo
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_lora import adapter_entries, add_lora_routes
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling, check_route


@dataclass
class Routes:
    """What the route handlers share: the engine, the model, the serving classes and how a
    body is read."""

    engine: EngineClient
    model: ModelInfo
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    offload: Offloader
    limits: RequestLimits
    max_body_bytes: int
    pooling: OpenAIServingPooling

    async def body(self, request: Request, model: type[B]) -> B:
        return await read_body(request, model, self.max_body_bytes, self.offload)


def add_status_routes(app: FastAPI, engine: EngineClient, metrics: ServerMetrics) -> None:
    """/health, /version and /metrics: open to anyone, as load balancers and scrapers expect."""

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            raise APIError(
                f"engine unhealthy: {engine.dead_error}", status=503, type="service_unavailable"
            )
        return JSONResponse(engine.health())  # data-parallel: "degraded" while one is down

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedllm.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def api_routes(routes: Routes, auth: Any, runtime_updates: bool) -> APIRouter:
    """The OpenAI API under /v1: models, completions, chat completions, adapters."""
    v1 = APIRouter(prefix="/v1", dependencies=[auth])
    model = routes.model

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        data = [
            {
                "id": name,
                "object": "model",
                "created": model.created,
                "owned_by": "pagedllm",
                "root": model.root,
                "parent": None,
                "max_model_len": model.max_model_len,
                # pagedllm's extra: what a request's unset sampling fields become.
                "sampling_defaults": dict(model.sampling_defaults),
            }
            for name in model.names
        ]
        return {"object": "list", "data": data + adapter_entries(model)}

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        check_route("/v1/completions", model)
        req = await routes.body(request, CompletionRequest)
        return await routes.completion.create(req, request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        check_route("/v1/chat/completions", model)
        req = await routes.body(request, ChatCompletionRequest)
        return await routes.chat.create(req, request)

    @v1.post("/embeddings")
    async def embeddings(request: Request) -> Any:
        req = await routes.body(request, EmbeddingRequest)
        return await routes.pooling.embeddings(req, request)

    @v1.post("/score")
    async def score(request: Request) -> Any:
        req = await routes.body(request, ScoreRequest)
        return await routes.pooling.score(req, request)

    @v1.post("/rerank")
    async def rerank(request: Request) -> Any:
        req = await routes.body(request, RerankRequest)
        return await routes.pooling.rerank(req, request)

    add_lora_routes(v1, routes.engine, model, runtime_updates=runtime_updates, body=routes.body)
    return v1


def token_routes(routes: Routes, auth: Any) -> APIRouter:
    """/tokenize and /detokenize with the served model's tokenizer (vLLM's extra routes)."""
    extra = APIRouter(dependencies=[auth])
    completion, offload, limits = routes.completion, routes.offload, routes.limits
    engine = routes.engine

    @extra.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await routes.body(request, TokenizeRequest)
        if req.model is not None:
            completion.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            ids = (
                await offload.run(
                    routes.chat.render,
                    req.messages,
                    add_generation_prompt=req.add_generation_prompt,
                )
            ).token_ids
        else:
            limits.check_chars(len(req.prompt), "prompt")
            ids = await offload.run(
                engine.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens
            )
        offload.trim_later(len(ids))
        return {"tokens": ids, "count": len(ids), "max_model_len": routes.model.max_model_len}

    @extra.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await routes.body(request, DetokenizeRequest)
        if req.model is not None:
            completion.check_model(req.model)
        limits.check_detokenize(len(req.tokens))
        if req.tokens:
            completion.check_token_ids(req.tokens, "tokens")
        text = await offload.run(engine.tokenizer.decode, req.tokens)
        offload.trim_later(len(req.tokens))
        return {"prompt": text}

    return extra


def add_docs(app: FastAPI, auth: Any) -> None:
    """/docs, /redoc and /openapi.json, behind the API key like every other route."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

    docs = APIRouter(dependencies=[auth], include_in_schema=False)

    @docs.get("/openapi.json")
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @docs.get("/docs")
    async def swagger() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @docs.get("/redoc")
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title=app.title)

    app.include_router(docs)
