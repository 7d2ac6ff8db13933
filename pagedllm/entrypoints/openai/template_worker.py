"""The chat-template worker: a process of its own, so that a render can be stopped by killing it.

A chat template comes with the model file, from whoever published it. Jinja's sandbox keeps it
from reading files or reaching Python's internals, but not from looping for hours or computing
``3**(3**16)`` (one C-level operation that holds the interpreter lock for about a minute, which
no thread-based timeout can interrupt). Here it runs in a process that the server kills when the
bound passes (``template_render.py``); the worker also caps its own memory, and refuses output
longer than the bound it was given.

Frames on stdin/stdout: an 8-byte big-endian length, then the payload. The first frame from the
server is a pickle (trusted: it comes from the parent) of ``(tokenizer, max_chars,
memory_bytes)`` (for pagedllm's own tokenizer class its ``ChatRenderer``: the templates and
special tokens, no vocabulary and no transformers to import); every later frame is a JSON
request, answered with ``{"text": ...}`` or ``{"error": ..., "kind": ...}``. Replies are ASCII
JSON, so any text (lone surrogates included) crosses the pipe.
"""

from __future__ import annotations

import ctypes
import json
import pickle
import resource
import signal
import struct
import sys
from typing import IO, Any

_HEADER = struct.Struct(">Q")
_PR_SET_PDEATHSIG = 1
_MAX_ERROR_CHARS = 400  # an exception's text can quote the whole rendered chat


def read_frame(stream: IO[bytes]) -> bytes | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    body = stream.read(size)
    return body if len(body) == size else None


def write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _die_with_parent() -> None:
    """A server killed outright (SIGKILL) takes its workers with it (Linux; elsewhere the
    closed stdin ends an idle worker). Linux sends it when the *thread* that started the worker
    ends: the server starts them from its main and offload threads, which live as long as it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _limit_memory(extra: int) -> None:
    """Address space capped at what the worker holds now plus ``extra`` bytes: a template that
    builds a giant string gets a ``MemoryError``, not the host's memory."""
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = size + extra
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except (OSError, ValueError, StopIteration):
        pass


def render(tokenizer: Any, request: dict[str, Any], max_chars: int) -> dict[str, Any]:
    tools = request.get("tools")
    try:
        text = tokenizer.apply_chat_template(
            request["messages"],
            chat_template=request.get("template"),
            tokenize=False,
            **({"tools": tools} if tools else {}),
            **request.get("kwargs", {}),
        )
    except MemoryError:
        return {"kind": "memory", "error": "it needed more memory than a render is allowed"}
    except RecursionError:
        return {"kind": "error", "error": "RecursionError: it recursed too deeply"}
    except Exception as exc:  # jinja errors, raise_exception() in templates, bad kwargs
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return {"kind": "error", "error": first[:_MAX_ERROR_CHARS]}
    if not isinstance(text, str):
        return {"kind": "error", "error": f"it rendered a {type(text).__name__}, not text"}
    if len(text) > max_chars:
        return {"kind": "size", "error": f"its output has {len(text)} characters"}
    return {"text": text}


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server handles Ctrl-C and ends us
    _die_with_parent()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the frames
    if "--preload" in sys.argv[2:]:  # a spare, started before its setup exists: import now
        import pagedllm.tokenization.chat_template  # noqa: F401  (jinja2: pagedllm's renderer)
    setup = read_frame(inp)  # read whole before the imports: the server's write returns at once
    if setup is None:
        return
    tokenizer, max_chars, memory_bytes = pickle.loads(setup)
    del setup
    _limit_memory(memory_bytes)
    write_frame(out, b'{"ready": true}')
    while (frame := read_frame(inp)) is not None:
        try:
            reply = render(tokenizer, json.loads(frame), max_chars)
            payload = json.dumps(reply).encode()
        except MemoryError:
            payload = b'{"kind": "memory", "error": "it needed more memory than allowed"}'
        write_frame(out, payload)


if __name__ == "__main__":
    main()
