"""The OpenAI-compatible HTTP server: FastAPI routes over an :class:`EngineClient`.

``build_app`` makes the ASGI app (tests run it in-process); ``run_server`` serves it with uvicorn,
whose signal handling gives the graceful shutdown: on SIGTERM/SIGINT it stops accepting, lets
requests in flight finish for ``shutdown_timeout`` seconds, cancels the rest (which aborts them in
the engine), and then the app's lifespan stops the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from fastapi import FastAPI

import pagedllm
from pagedllm.engine.client import EngineClient
from pagedllm.entrypoints.openai.errors import install_handlers
from pagedllm.entrypoints.openai.http_limits import limited_protocol
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.offload import Offloader, RequestLimits
from pagedllm.entrypoints.openai.request_body import auth_dependency
from pagedllm.entrypoints.openai.routes import (
    Routes,
    add_docs,
    add_status_routes,
    api_routes,
    token_routes,
)
from pagedllm.entrypoints.openai.serving_base import ModelInfo
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_lora import load_adapter
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedllm.entrypoints.openai.sse import ServerApp
from pagedllm.entrypoints.openai.template_render import TemplateLimits
from pagedllm.entrypoints.web import RequestTracker, TrackingEngine, mount_web

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    chat_template: str | None = None  # the template text (already loaded from a file)
    chat_template_name: str | None = None  # how errors name it (its file); None: the flag/model
    template_limits: TemplateLimits = field(default_factory=TemplateLimits)  # per render
    max_body_bytes: int = 32 << 20
    max_logprobs: int = 20
    tool_call_parser: str | None = None  # tool_choice "auto"'s format; None: from the template
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


def model_info(engine: EngineClient, served_names: list[str] | None = None) -> ModelInfo:
    info = engine.describe()  # EngineClient in-process, or EngineCoreClient (core process)
    root = info["model"]
    names = tuple(served_names or [info["served_model_name"] or root])
    return ModelInfo(
        names=names,
        root=root,
        max_model_len=info["max_model_len"],
        vocab_size=int(info["vocab_size"]),
        created=int(time.time()),
        sampling_defaults=dict(info.get("sampling_defaults") or {}),
        task=str(info.get("task", "generate")),
        model_task=str(info.get("model_task", "generate")),
    )


def build_app(
    engine: EngineClient,
    model: ModelInfo,
    settings: ServerSettings | None = None,
    *,
    owns_engine: bool = True,
) -> FastAPI:
    """The app; with ``owns_engine`` its shutdown also stops the engine."""
    settings = settings or ServerSettings()
    offload = Offloader()

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
        routes.chat.renderer.close()

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
    routes = _routes(engine, model, settings, offload, TrackingEngine(engine, tracker))
    metrics = ServerMetrics(engine)
    app.state.engine, app.state.metrics = engine, metrics
    auth = auth_dependency(settings.api_key)
    add_status_routes(app, engine, metrics)
    app.include_router(api_routes(routes, auth, settings.enable_lora_runtime_updates))
    app.include_router(token_routes(routes, auth))
    mount_web(app, engine=engine, metrics=metrics, tracker=tracker, auth=auth)
    if not settings.disable_docs:
        add_docs(app, auth)
    return app


def _routes(
    engine: EngineClient,
    model: ModelInfo,
    settings: ServerSettings,
    offload: Offloader,
    served: TrackingEngine,
) -> Routes:
    """What the handlers share; ``served`` is the engine the completion handlers use (their
    requests are tracked for the dashboard)."""
    limits = settings.limits
    completion = OpenAIServingCompletion(
        served, model, max_logprobs=settings.max_logprobs, offload=offload, limits=limits
    )
    chat = OpenAIServingChat(
        served,
        model,
        chat_template=settings.chat_template,
        chat_template_name=settings.chat_template_name,
        template_limits=settings.template_limits,
        max_logprobs=settings.max_logprobs,
        tool_call_parser=settings.tool_call_parser,
        offload=offload,
        limits=limits,
    )
    pooling = OpenAIServingPooling(served, model, offload=offload, limits=limits)
    return Routes(
        engine, model, completion, chat, offload, limits, settings.max_body_bytes, pooling
    )


async def _watch_engine(
    app: FastAPI, engine: EngineClient, interval: float = 0.2, grace: float = 2.0
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

    def __init__(self, config: Any, engine: EngineClient, shutdown_timeout: float) -> None:
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                outer.on_signal(sig)

            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets=sockets)
                if not self.should_exit and outer.on_ready is not None:
                    outer.on_ready()

        self.server = _Server(config)
        self.on_ready: Callable[[], None] | None = None
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

    def run(self, sockets: list[socket.socket] | None = None) -> int:
        try:
            self.server.run(sockets=sockets)
        except SystemExit as exc:  # uvicorn's start-up failure (its status 3): ours is 1
            logger.error("the server did not start (status %s from uvicorn)", exc.code)
            self.engine.stop()
            return 1
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


def ready_line(
    name: str, host: str, port: int, started: float, loading: float | None = None
) -> str:
    """The one line that says the server answers, and where: the API, chat page, dashboard.
    ``loading``: when the engine began to load, which splits the time into this process's
    imports before it and the load after (the engine's own imports included)."""
    shown = "localhost" if host in ("", "0.0.0.0", "::") else host
    base = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
    now = time.perf_counter()
    split = (
        ""
        if loading is None
        else f" (imports {loading - started:.1f} s, load {now - loading:.1f} s)"
    )
    return (
        f"ready in {now - started:.1f} s{split}: {name} | API {base}/v1 | "
        f"chat {base}/ | dashboard {base}/dashboard"
    )


def run_server(
    engine: EngineClient,
    model: ModelInfo,
    settings: ServerSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    sock: socket.socket | None = None,
    started: float | None = None,
    loading: float | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (see :class:`GracefulServer`); returns the exit status.

    ``sock`` is the listening socket bound before the model loaded (``pagedllm serve``);
    ``started`` the ``perf_counter`` of the command's start, for the "ready in" line, and
    ``loading`` that of the engine's start (after the imports)."""

    # Whatever fails from here on, the engine is stopped: a core process left running would
    # hold its memory and keep this process from exiting.
    try:
        app = build_app(engine, model, settings)
        config = uvicorn_config(app, settings, host=host, port=port, log_level=log_level)
        server = GracefulServer(config, engine, settings.shutdown_timeout)
        app.state.on_engine_dead = server.request_exit
        begun = time.perf_counter() if started is None else started
        server.on_ready = lambda: logger.info(ready_line(model.name, host, port, begun, loading))
        status = server.run([sock] if sock is not None else None)
    finally:
        engine.stop()
        logger.info("server stopped")
    return status
