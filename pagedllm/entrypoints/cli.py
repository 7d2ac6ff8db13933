"""The ``pagedllm`` command: ``serve`` an OpenAI-compatible API, or ``generate`` offline.

Importing this module is cheap (no torch): ``pagedllm --help`` and ``--version`` answer at once,
and the engine is loaded only by the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import logging
import math
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pagedllm
from pagedllm.engine.cpu_binding import CpuBinding, bind_threads
from pagedllm.entrypoints.cli_args import UsageError, build_parser, engine_kwargs, model_from_args

if TYPE_CHECKING:  # the CLI starts without importing the engine
    from pagedllm.engine.client import EngineClient

logger = logging.getLogger("pagedllm.cli")

DEMO_SERVED_NAME = "pagedllm-demo"


def _setup_logging(level: str = "info") -> None:
    from pagedllm.log_setup import setup_logging

    setup_logging(level)


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads so that a busy port fails in a second
    instead of after minutes of loading; uvicorn starts listening on it once the app is ready
    (until then a connection is refused, as with no server)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise SystemExit(
            f"pagedllm serve: cannot listen on {host}:{port}: {reason.lower()} "
            "(is another server running there? choose another with --port)"
        ) from None
    return sock


def check_serve_settings(args: argparse.Namespace, template: str | None) -> None:
    """The server's own settings, checked before the model loads (``ValueError`` naming it)."""
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port: must be in 1..65535, got {args.port}")
    if args.max_logprobs < 0:
        raise ValueError(f"--max-logprobs: must be >= 0, got {args.max_logprobs}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout: must be >= 0, got {args.shutdown_timeout}")
    if not 0 < args.chat_template_timeout < math.inf:  # nan and inf too: the bound is a guard
        raise ValueError(
            "--chat-template-timeout: must be a number of seconds > 0 (a bound on each render; "
            f"there is no unlimited setting, give a large one), got {args.chat_template_timeout}"
        )
    if template is not None:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            ImmutableSandboxedEnvironment().parse(template)
        except TemplateSyntaxError as exc:
            raise ValueError(
                f"--chat-template: does not parse: {exc.message} (line {exc.lineno})"
            ) from None


def check_engine_settings(args: argparse.Namespace) -> None:
    """Engine settings that fail only after minutes of loading, checked first."""
    import os

    from pagedllm.backends.registry import backend_class, resolve_device

    # "auto" is the engine's to resolve (its core process imports the backends anyway); asking
    # here imported torch into the server's front (~1.5 CPU s of its start) to answer nothing.
    # The CPU is always there: only an accelerator named explicitly is asked for.
    if args.device not in ("auto", "cpu"):
        device = resolve_device(args.device)  # an unknown name: ValueError
        try:  # is_available() never raises and starts nothing (no device context)
            available = backend_class(device).is_available()
        except ImportError:
            available = False
        if not available:
            raise ValueError(
                f"--device: {device!r} was requested but is not available on this machine"
            )
    space = args.kv_cache_space
    if space is not None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
        if not 0 < space < total:
            raise ValueError(
                f"--kv-cache-space: {space} GiB is not in (0, {total:.1f}) (the machine's memory)"
            )
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")


def resolve_model(model: str | None, *, demo_chat: bool = False) -> tuple[str, str | None]:
    """The model to load, and a default served name (the demos have their own)."""
    from pagedllm.entrypoints import demo

    if demo_chat:
        if model is not None:
            raise UsageError("pagedllm serve: give MODEL or --demo, not both")
        path, chat = demo.resolve_demo_model()
        return path, demo.NAME if chat else DEMO_SERVED_NAME
    if model is not None:
        return model, None

    path = Path(demo.DEMO_MODEL)
    if not (path / "config.json").exists():
        raise SystemExit(
            f"pagedllm serve: no MODEL given and the demo model is not at {path} yet "
            "(it is built separately); pass a model folder: pagedllm serve PATH"
        )
    return str(path), DEMO_SERVED_NAME


def serve_cpu_binding(args: argparse.Namespace) -> CpuBinding | None:
    """The ``--cpu-bind`` plan for ``pagedllm serve``: only with an engine-core process of one
    rank (tensor- and pipeline-parallel workers are processes of their own, placed by the
    kernel)."""
    if args.engine_in_process or (args.tensor_parallel_size or 1) > 1:
        return None
    if (args.data_parallel_size or 1) > 1:
        return None
    if (getattr(args, "pipeline_parallel_size", None) or 1) > 1:
        return None
    return CpuBinding.plan(args.cpu_bind)


def serve_replicas(args: argparse.Namespace, model: str, kwargs: dict[str, Any]) -> EngineClient:
    """``--data-parallel-size N``: N engine cores behind the router (engine/dp_client.py)."""
    from pagedllm.engine.dp_client import DataParallelClient

    if args.engine_in_process:
        raise UsageError("pagedllm serve: --engine-in-process runs one engine, not replicas")
    return DataParallelClient.from_engine_args(
        model,
        args.device,
        log_stats_interval=None if args.disable_log_stats else 5.0,
        **kwargs,
    )


def serve_settings(args: argparse.Namespace) -> Any:
    """The server's ``ServerSettings``, every flag checked before the model loads (a
    ``UsageError`` naming the flag)."""
    from pagedllm.config import env_api_key
    from pagedllm.entrypoints.openai.api_server import ServerSettings
    from pagedllm.entrypoints.openai.chat_messages import load_chat_template
    from pagedllm.entrypoints.openai.offload import RequestLimits
    from pagedllm.entrypoints.openai.template_render import TemplateLimits
    from pagedllm.lora import parse_lora_module

    try:
        template = load_chat_template(args.chat_template)
        limits = RequestLimits(
            max_prompt_chars=args.max_prompt_chars,
            max_prompt_tokens=args.max_prompt_tokens,
            max_detokenize_tokens=args.max_detokenize_tokens,
        )
        check_serve_settings(args, template)
        template_limits = TemplateLimits(seconds=args.chat_template_timeout)
        check_engine_settings(args)
        lora_modules = tuple(parse_lora_module(m) for m in args.lora_modules)
        if (lora_modules or args.enable_lora_runtime_updates) and not args.enable_lora:
            raise ValueError("--lora-modules and --enable-lora-runtime-updates need --enable-lora")
    except ValueError as exc:
        raise UsageError(f"pagedllm serve: {exc}") from None
    return ServerSettings(
        api_key=args.api_key or env_api_key(),
        chat_template=template,
        chat_template_name=args.chat_template if template != args.chat_template else None,
        template_limits=template_limits,
        max_logprobs=args.max_logprobs,
        shutdown_timeout=args.shutdown_timeout,
        disable_docs=args.disable_docs,
        tool_call_parser=args.tool_call_parser,
        limits=limits,
        lora_modules=lora_modules,
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
    )


def start_serve_engine(
    args: argparse.Namespace,
    model: str,
    served_name: str,
    binding: CpuBinding | None,
    while_starting: Callable[[], None] | None = None,
) -> EngineClient:
    """What the server talks to: replicas, an engine-core process, or (``--engine-in-process``)
    an engine thread in this process. ``while_starting`` runs once an engine-core process is
    launched, beside its start (before the engine otherwise)."""
    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.engine.core_client import EngineCoreClient

    kwargs = engine_kwargs(args)
    kwargs["served_model_name"] = served_name
    kwargs["max_logprobs"] = args.max_logprobs
    in_core = (args.data_parallel_size or 1) == 1 and not args.engine_in_process
    if while_starting is not None and not in_core:
        while_starting()
    try:
        if (args.data_parallel_size or 1) > 1:
            return serve_replicas(args, model, kwargs)
        if args.engine_in_process:
            return AsyncEngine.from_engine_args(
                model,
                args.device,
                log_stats_interval=None if args.disable_log_stats else 5.0,
                **kwargs,
            )
        return EngineCoreClient.from_engine_args(
            model,
            args.device,
            log_stats_interval=None if args.disable_log_stats else 5.0,
            cpu_binding=binding,
            while_starting=while_starting,
            **kwargs,
        )
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"pagedllm serve: {exc}") from None


def cmd_serve(args: argparse.Namespace, started: float) -> int:
    _setup_logging(args.log_level)  # the first line comes before any heavy import
    logger.info(
        "pagedllm %s serve: starting (%s)",
        pagedllm.__version__,
        "--demo" if args.demo else args.model or "the bundled demo model",
    )
    sock = listen_socket(args.host, args.port) if 1 <= args.port <= 65535 else None
    try:
        return _serve_on(args, sock, started)
    finally:
        if sock is not None:
            sock.close()


def _serve_on(args: argparse.Namespace, sock: socket.socket | None, started: float) -> int:
    from pagedllm.engine.core_process import freeze_startup_objects
    from pagedllm.entrypoints.openai.template_render import ChatTemplateError

    model, demo_name = resolve_model(args.model, demo_chat=args.demo)
    names = args.served_model_name or ([demo_name] if demo_name else [args.model])
    binding = serve_cpu_binding(args)
    settings_of: list[Any] = []

    def server_side() -> None:
        # The HTTP stack's imports (~1 CPU s) and every flag's check, while an engine core
        # starts (its own imports take longer): a bad flag stops that core, in one line.
        settings_of.append(serve_settings(args))  # a bad --port is reported here
        import pagedllm.entrypoints.openai.api_server
        import pagedllm.tokenization.chat_template  # noqa: F401  (jinja2: the workers' copy)
        from pagedllm.entrypoints.openai.template_render import start_spare_workers

        start_spare_workers(1)  # the chat template's start-up check renders on it

        # The imports' objects frozen now, while this side waits on the core: the freeze after
        # the engine is up then walks only what was built since (not ~0.1-0.2 s after READY).
        freeze_startup_objects()
        logger.info("loading %s", model)

    loading = time.perf_counter()  # the rest is the load (this side's imports overlap it)
    engine = start_serve_engine(args, model, names[0], binding, server_side)
    settings = settings_of[0]
    from pagedllm.entrypoints.openai.api_server import model_info, run_server

    if binding is not None:  # the engine core logs the plan once
        bind_threads(binding.rest)  # this process: every thread, and those it starts later
    try:
        freeze_startup_objects()  # this process serves until it exits
        return run_server(
            engine,
            model_info(engine, names),
            settings,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            sock=sock,
            started=started,
            loading=loading,
        )
    except ChatTemplateError as exc:  # refused at start-up: one line naming the template
        raise SystemExit(f"pagedllm serve: {exc}") from None
    finally:
        engine.stop()  # idempotent; also when the server could not be built


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm import Engine, SamplingParams
    from pagedllm.lora import LoRARequest, parse_lora_module

    _setup_logging(args.log_level)
    try:
        check_engine_settings(args)
        lora = None
        kwargs = engine_kwargs(args)
        if args.lora:
            name, path = parse_lora_module(args.lora)
            lora = LoRARequest(name, 1, path)
            kwargs["enable_lora"] = True
            kwargs.setdefault("max_lora_rank", 64)
    except ValueError as exc:
        raise UsageError(f"pagedllm generate: {exc}") from None
    try:
        engine = Engine(model_from_args(args, "generate"), args.device, **kwargs)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            stop=args.stop or [],
        )
    except ValueError as exc:
        raise SystemExit(f"pagedllm generate: {exc}") from None
    out = sys.stdout
    total_tokens, start = 0, time.perf_counter()
    for i, prompt in enumerate(args.prompt):
        if i:
            out.write("\n" + "-" * 40 + "\n")
        out.write(prompt)
        out.flush()
        try:
            engine.add_request(f"cli-{i}", prompt, params, lora_request=lora)
        except ValueError as exc:
            raise SystemExit(f"pagedllm generate: {exc}") from None
        shown = 0
        while engine.has_unfinished_requests():
            for result in engine.step():
                if result.error:
                    raise SystemExit(f"pagedllm generate: {result.error}")
                text = result.outputs[0].text
                out.write(text[shown:])
                out.flush()
                shown = len(text)
                if result.finished:
                    total_tokens += len(result.outputs[0].token_ids)
        out.write("\n")
    elapsed = time.perf_counter() - start
    print(
        f"[{total_tokens} tokens in {elapsed:.2f}s, {total_tokens / elapsed:.1f} tokens/s]",
        file=sys.stderr,
    )
    engine.shutdown()
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """``pagedllm inspect FILE``: 0 and what the file holds, or 1 and its first problem."""
    from pagedllm.models.gguf.summary import describe

    try:
        lines = describe(Path(args.file), verify_sha256=args.verify_sha256)
    except ValueError as exc:  # GGUFFileError, and CheckpointError from the name checks
        print(" ".join(str(exc).split()), file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command not in ("serve", "generate") and not hasattr(args, "handler"):
        parser.print_help()
        return 2
    try:
        if hasattr(args, "handler"):  # chat, bench: their modules run them
            return int(args.handler(args))
        return cmd_serve(args, started) if args.command == "serve" else cmd_generate(args)
    except UsageError as exc:  # a setting that can never work: one line, before any loading
        print(exc, file=sys.stderr)
        return 2
    except (Exception, KeyboardInterrupt) as exc:
        if getattr(args, "log_level", "info") == "debug":
            raise
        message = str(exc).splitlines()[0] if str(exc) else ""
        print(
            f"pagedllm {args.command}: {type(exc).__name__}: {message} "
            "(--log-level debug shows the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
