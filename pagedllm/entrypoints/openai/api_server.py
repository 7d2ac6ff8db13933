"""The OpenAI-compatible HTTP server: FastAPI routes over an :class:`AsyncEngine`.

``build_app`` makes the ASGI app (tests run it in-process); ``run_server`` serves it with uvicorn,
whose signal handling gives the graceful shutdown: on SIGTERM/SIGINT it stops accepting, lets
requests in flight finish for ``shutdown_timeout`` seconds, cancels the rest (which aborts them in
the engine), and then the app's lifespan stops the engine thread.
"""

from __future__ import annotations

import hmac
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

import pagedllm
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.errors import APIError, from_validation_error, install_handlers
from pagedllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.serving_base import ModelInfo
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=BaseModel)


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    chat_template: str | None = None  # the template text (already loaded from a file)
    max_body_bytes: int = 32 << 20
    max_logprobs: int = 20
    shutdown_timeout: float = 30.0


def model_info(engine: AsyncEngine, served_names: list[str] | None = None) -> ModelInfo:
    llm = engine.engine
    root = llm.config.model.model
    names = tuple(served_names or [llm.config.model.served_model_name or root])
    return ModelInfo(names=names, root=root, max_model_len=llm.config.scheduler.max_model_len,
                     vocab_size=int(llm.vocab_size), created=int(time.time()))


async def read_body(request: Request, model: type[B], limit: int) -> B:
    """Parse the JSON body into ``model``; 413 past ``limit`` bytes, 400 when it is invalid."""
    declared = request.headers.get("content-length")
    too_big = APIError(f"request body larger than {limit} bytes", status=413,
                       code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _auth_dependency(api_key: str | None) -> Any:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError("invalid or missing API key (send 'Authorization: Bearer <key>')",
                           status=401, type="authentication_error", code="invalid_api_key")

    return Depends(check)


def build_app(engine: AsyncEngine, model: ModelInfo, settings: ServerSettings | None = None, *,
              owns_engine: bool = True) -> FastAPI:
    """The app; with ``owns_engine`` its shutdown also stops the engine."""
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            await engine.shutdown(timeout=min(settings.shutdown_timeout, 5.0))

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__,
                  lifespan=lifespan)
    install_handlers(app)
    completion = OpenAIServingCompletion(engine, model, max_logprobs=settings.max_logprobs)
    chat = OpenAIServingChat(engine, model, chat_template=settings.chat_template,
                             max_logprobs=settings.max_logprobs)
    metrics = ServerMetrics(engine)
    app.state.engine, app.state.metrics = engine, metrics
    auth = _auth_dependency(settings.api_key)
    limit = settings.max_body_bytes

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            raise APIError(f"engine unhealthy: {engine.dead_error}", status=503,
                           type="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedllm.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1", dependencies=[auth])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": model.created, "owned_by": "pagedllm",
                 "root": model.root, "parent": None, "max_model_len": model.max_model_len}
                for name in model.names]
        return {"object": "list", "data": data}

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        req = await read_body(request, CompletionRequest, limit)
        return await completion.create(req, request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = await read_body(request, ChatCompletionRequest, limit)
        return await chat.create(req, request)

    app.include_router(v1)
    extra = APIRouter(dependencies=[auth])

    @extra.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await read_body(request, TokenizeRequest, limit)
        if req.model is not None:
            completion.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            ids = chat.render(req.messages,
                              add_generation_prompt=req.add_generation_prompt).token_ids
        else:
            ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": model.max_model_len}

    @extra.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await read_body(request, DetokenizeRequest, limit)
        if req.model is not None:
            completion.check_model(req.model)
        if req.tokens:
            completion.check_token_ids(req.tokens, "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    app.include_router(extra)
    return app


def run_server(engine: AsyncEngine, model: ModelInfo, settings: ServerSettings, *,
               host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully (see the module docstring)."""
    import uvicorn

    app = build_app(engine, model, settings)
    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises a handled SIGTERM/SIGINT once it has shut down, so the process
        would die by the signal; after a graceful shutdown we exit normally (status 0)."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for requests
            else:
                self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout)),
                            log_config=None,  # uvicorn logs through our root logger
                            access_log=log_level == "debug")
    server = GracefulServer(config)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", model.name, host, port)
    try:
        server.run()
    finally:
        engine.stop()
        logger.info("server stopped")
