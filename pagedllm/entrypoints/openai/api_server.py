"""The OpenAI-compatible HTTP server: FastAPI routes over an :class:`AsyncEngine`.

``build_app`` makes the ASGI app (tests run it in-process); ``run_server`` serves it with uvicorn,
whose signal handling gives the graceful shutdown: on SIGTERM/SIGINT it stops accepting, lets
requests in flight finish for ``shutdown_timeout`` seconds, cancels the rest (which aborts them in
the engine), and then the app's lifespan stops the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

import pagedllm
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.errors import APIError, from_validation_error, install_handlers
from pagedllm.entrypoints.openai.http_limits import limited_protocol
from pagedllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.entrypoints.openai.offload import Offloader, RequestLimits
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.serving_base import ModelInfo
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_lora import adapter_entries, add_lora_routes, load_adapter
from pagedllm.entrypoints.openai.sse import ServerApp
from pagedllm.entrypoints.web import RequestTracker, TrackingEngine, mount_web

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=BaseModel)


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    chat_template: str | None = None  # the template text (already loaded from a file)
    max_body_bytes: int = 32 << 20
    max_logprobs: int = 20
    tool_call_parser: str | None = None  # "hermes" | "llama3_json": tool_choice "auto" on
    shutdown_timeout: float = 30.0
    disable_docs: bool = False
    # Connection limits: idle keep-alive connections, and clients that stall while sending a
    # request (see http_limits), are closed after these many seconds; request heads are bounded.
    timeout_keep_alive: float = 5.0
    read_timeout: float = 10.0
    max_head_bytes: int = 64 * 1024
    # Per-request sizes (see offload.py): prompt characters, prompt token ids, /detokenize ids.
    limits: RequestLimits = field(default_factory=RequestLimits)
    # LoRA adapters served from the start (name, folder); run-time load/unload routes allowed.
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora_runtime_updates: bool = False


def is_json_content_type(value: str | None) -> bool:
    """``application/json`` or ``application/<x>+json``, parameters (charset) allowed."""
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def model_info(engine: AsyncEngine, served_names: list[str] | None = None) -> ModelInfo:
    info = engine.describe()  # AsyncEngine in-process, or EngineCoreClient (core process)
    root = info["model"]
    names = tuple(served_names or [info["served_model_name"] or root])
    return ModelInfo(
        names=names,
        root=root,
        max_model_len=info["max_model_len"],
        vocab_size=int(info["vocab_size"]),
        created=int(time.time()),
    )


_PARSE_IN_POOL_BYTES = 1 << 20  # bodies this large are parsed off the event loop


async def read_body(
    request: Request, model: type[B], limit: int, offload: Offloader | None = None
) -> B:
    """Parse the JSON body into ``model``; 413 past ``limit`` bytes, 400 when it is invalid.

    Only a JSON content type is read (415 otherwise): a web page on another origin can send
    text/plain, form or multipart bodies without a CORS preflight, never application/json.
    """
    if not is_json_content_type(request.headers.get("content-type")):
        raise APIError(
            "request bodies must be JSON, sent with 'Content-Type: application/json'",
            status=415,
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length")
    too_big = APIError(
        f"request body larger than {limit} bytes", status=413, code="request_too_large"
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError("client disconnected", status=499, code="client_closed_request") from None
    body = b"".join(chunks)
    try:
        if offload is not None and size >= _PARSE_IN_POOL_BYTES:
            return await offload.run(model.model_validate_json, body)
        return model.model_validate_json(body)
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
            raise APIError(
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                status=401,
                type="authentication_error",
                code="invalid_api_key",
            )

    return Depends(check)


def build_app(
    engine: AsyncEngine,
    model: ModelInfo,
    settings: ServerSettings | None = None,
    *,
    owns_engine: bool = True,
) -> FastAPI:
    """The app; with ``owns_engine`` its shutdown also stops the engine."""
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for name, path in settings.lora_modules:  # a bad adapter stops the start-up
            await load_adapter(engine, model, name, path)
        watcher = asyncio.ensure_future(_watch_engine(app, engine))
        yield
        watcher.cancel()
        if owns_engine:
            await engine.shutdown(timeout=min(settings.shutdown_timeout, 5.0))
        offload.shutdown()

    app = ServerApp(
        title="pagedllm OpenAI-compatible server",
        version=pagedllm.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.on_engine_dead = None
    install_handlers(app)
    tracker = RequestTracker()  # the dashboard's table of requests in flight
    served = TrackingEngine(engine, tracker)
    offload, limits = Offloader(), settings.limits
    completion = OpenAIServingCompletion(
        served, model, max_logprobs=settings.max_logprobs, offload=offload, limits=limits
    )
    chat = OpenAIServingChat(
        served,
        model,
        chat_template=settings.chat_template,
        max_logprobs=settings.max_logprobs,
        tool_call_parser=settings.tool_call_parser,
        offload=offload,
        limits=limits,
    )
    metrics = ServerMetrics(engine)
    app.state.engine, app.state.metrics = engine, metrics
    auth = _auth_dependency(settings.api_key)
    limit = settings.max_body_bytes

    async def body(request: Request, model: type[B]) -> B:
        return await read_body(request, model, limit, offload)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            raise APIError(
                f"engine unhealthy: {engine.dead_error}", status=503, type="service_unavailable"
            )
        replicas = getattr(engine, "health", None)  # data-parallel: "degraded" while one is down
        return JSONResponse(replicas() if replicas is not None else {"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedllm.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1", dependencies=[auth])

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
            }
            for name in model.names
        ]
        return {"object": "list", "data": data + adapter_entries(model)}

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        req = await body(request, CompletionRequest)
        return await completion.create(req, request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = await body(request, ChatCompletionRequest)
        return await chat.create(req, request)

    add_lora_routes(
        v1, engine, model, runtime_updates=settings.enable_lora_runtime_updates, body=body
    )
    app.include_router(v1)
    extra = APIRouter(dependencies=[auth])

    @extra.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await body(request, TokenizeRequest)
        if req.model is not None:
            completion.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            ids = (
                await offload.run(
                    chat.render, req.messages, add_generation_prompt=req.add_generation_prompt
                )
            ).token_ids
        else:
            limits.check_chars(len(req.prompt), "prompt")
            ids = await offload.run(
                engine.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens
            )
        offload.trim_later(len(ids))
        return {"tokens": ids, "count": len(ids), "max_model_len": model.max_model_len}

    @extra.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await body(request, DetokenizeRequest)
        if req.model is not None:
            completion.check_model(req.model)
        limits.check_detokenize(len(req.tokens))
        if req.tokens:
            completion.check_token_ids(req.tokens, "tokens")
        text = await offload.run(engine.tokenizer.decode, req.tokens)
        offload.trim_later(len(req.tokens))
        return {"prompt": text}

    app.include_router(extra)
    mount_web(app, engine=engine, metrics=metrics, tracker=tracker, auth=auth)
    if not settings.disable_docs:
        _add_docs(app, auth)
    return app


def _add_docs(app: FastAPI, auth: Any) -> None:
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


async def _watch_engine(
    app: FastAPI, engine: AsyncEngine, interval: float = 0.2, grace: float = 2.0
) -> None:
    """A broken engine (a step failing whatever it runs) ends the server: /health answers 503
    for ``grace`` seconds (for whoever watches it), then ``run_server`` exits non-zero."""
    while engine.is_healthy:
        await asyncio.sleep(interval)
    logger.error("the engine has failed (%s); stopping the server", engine.dead_error)
    await asyncio.sleep(grace)
    callback = app.state.on_engine_dead
    if callback is not None:
        with contextlib.suppress(Exception):
            callback()


class GracefulServer:
    """uvicorn's server with the shutdown this project promises (see ``run_server``).

    First SIGTERM/SIGINT: the engine stops admitting (new requests get a 503), uvicorn closes
    its listening socket, and requests in flight get ``shutdown_timeout`` seconds; then every
    one left is cut by the engine, so each stream ends with an error event and ``[DONE]`` and
    each other request with a JSON 503. A second SIGINT cuts at once. The exit status is 1
    when anything was cut or the engine died, else 0.
    """

    def __init__(self, config: Any, engine: AsyncEngine, shutdown_timeout: float) -> None:
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                outer.on_signal(sig)

        self.server = _Server(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.forced = False
        self._timer: threading.Timer | None = None

    def on_signal(self, sig: int) -> None:
        """Runs in the main thread between bytecodes: only flags, a timer and a queue put."""
        if not self.server.should_exit:
            self.server.should_exit = True
            self.engine.stop_accepting()
            self._timer = threading.Timer(
                self.shutdown_timeout,
                self.engine.cut_in_flight,
                args=("the server is shutting down",),
            )
            self._timer.daemon = True
            self._timer.start()
        elif sig == signal.SIGINT and not self.forced:
            # Cut now: the requests end with their error events, their connections close and
            # uvicorn's shutdown completes on its own; force it only if a client hangs on.
            self.forced = True
            self.engine.cut_in_flight("the server was stopped")
            force = threading.Timer(2.0, setattr, args=(self.server, "force_exit", True))
            force.daemon = True
            force.start()

    def request_exit(self) -> None:
        self.server.should_exit = True

    def run(self) -> int:
        self.server.run()
        if self._timer is not None:
            self._timer.cancel()
        cut = self.engine.num_cut
        if cut:
            logger.error("shutdown cut %d requests that had not finished", cut)
        failed = self.forced or cut > 0 or self.engine.dead_error is not None
        return 1 if failed else 0


def uvicorn_config(
    app: FastAPI, settings: ServerSettings, *, host: str, port: int, log_level: str
) -> Any:
    """uvicorn's settings for this app: its connection limits and shutdown wait."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=limited_protocol(settings.read_timeout, settings.max_head_bytes),
        # uvicorn's own wait outlasts ours: we cut the requests first, they then end cleanly.
        timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout) + 10),
        timeout_keep_alive=max(1, int(settings.timeout_keep_alive)),
        log_config=None,  # uvicorn logs through our root logger
        access_log=log_level == "debug",
    )


def run_server(
    engine: AsyncEngine,
    model: ModelInfo,
    settings: ServerSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
) -> int:
    """Serve until SIGTERM/SIGINT (see :class:`GracefulServer`); returns the exit status."""

    # Whatever fails from here on, the engine is stopped: a core process left running would
    # hold its memory and keep this process from exiting.
    try:
        app = build_app(engine, model, settings)
        config = uvicorn_config(app, settings, host=host, port=port, log_level=log_level)
        server = GracefulServer(config, engine, settings.shutdown_timeout)
        app.state.on_engine_dead = server.request_exit
        logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", model.name, host, port)
        status = server.run()
    finally:
        engine.stop()
        logger.info("server stopped")
    return status
