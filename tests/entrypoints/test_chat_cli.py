"""``pagedllm chat`` in a pseudo-terminal (pexpect) against the session's test server."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import httpx
import pytest

from tests.entrypoints.browser import wait_for
from tests.entrypoints.conftest import API_KEY, MODEL_NAME
from tests.entrypoints.test_cli import REPO
from tests.entrypoints.test_concurrency import finish_counts
from tests.entrypoints.test_web import slowed

pexpect = pytest.importorskip(
    "pexpect", reason="pexpect is a dev dependency (pip install -e .[dev])"
)

PROMPT = "The quick brown fox"


def _spawn(server: Any, *extra: str) -> Any:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PAGEDLLM_API_KEY": API_KEY,
        "PYTHONUNBUFFERED": "1",
        "TERM": "dumb",
    }
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "pagedllm.entrypoints.cli",
            "chat",
            "--url",
            server.base_url,
            "--temperature",
            "0",
            *extra,
        ],
        cwd=str(REPO),
        env=env,
        encoding="utf-8",
        timeout=60,
        dimensions=(50, 400),
        # Ctrl-C must reach the chat as SIGINT even when the test runner was started with it
        # ignored (a shell's background job ignores SIGINT, and children inherit that).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    child.expect(f"chatting with {MODEL_NAME}")
    child.expect("> ")
    return child


def _reply(child: Any) -> str:
    """Everything printed up to the stats line, with the terminal's CRLF undone."""
    child.expect(r"\r?\n\[(\d+) tokens[^\]]*\]\r?\n")
    text = child.before.replace("\r\n", "\n")
    return text[1:] if text.startswith("\n") else text  # the end of the echoed line


def test_chat_streams_keeps_history_and_ctrl_c_stops_a_reply(server: Any, client: Any) -> None:
    child = _spawn(server, "--max-tokens", "12")
    try:
        child.sendline(PROMPT)
        child.expect_exact(PROMPT)  # the echo of the typed line
        text = _reply(child)
        first = client.chat.completions.create(
            model=MODEL_NAME,
            max_tokens=12,
            temperature=0,
            messages=[{"role": "user", "content": PROMPT}],
        )
        expected = first.choices[0].message.content
        assert text == expected
        assert int(child.match.group(1)) == first.usage.completion_tokens
        child.expect("> ")
        # The second turn carries the history: the server sees both turns.
        history = [
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": expected},
            {"role": "user", "content": "Paged attention"},
        ]
        child.sendline("Paged attention")
        child.expect_exact("Paged attention")
        second = client.chat.completions.create(
            model=MODEL_NAME, max_tokens=12, temperature=0, messages=history
        )
        assert _reply(child) == second.choices[0].message.content
        child.expect("> ")
        # Ctrl-C while a long reply streams: the request is aborted, the session goes on.
        child.sendline("/clear")
        child.expect_exact("[conversation cleared]")
        before = finish_counts(server).get("abort", 0.0)
        with slowed(server, 0.05):
            child.sendline("/system -")
            child.expect_exact("[system prompt cleared]")
            child.sendline(PROMPT + " jumps")
            child.expect_exact(PROMPT + " jumps")

            def streaming() -> bool:
                rows = httpx.get(
                    server.v1 + "/dashboard", headers={"Authorization": f"Bearer {API_KEY}"}
                ).json()
                return any(r["state"] == "streaming" and r["tokens"] >= 2 for r in rows["requests"])

            wait_for(streaming, what="the reply to stream")
            child.sendintr()
            child.expect_exact("[stopped]")
            child.expect("> ")
            wait_for(
                lambda: finish_counts(server).get("abort", 0.0) == before + 1,
                what="the server to abort the reply",
            )
        server.assert_all_blocks_free()
        child.sendline("/system You are terse.")
        child.expect_exact("[system prompt set]")
        child.sendline("def fibonacci(n):")
        child.expect_exact("def fibonacci(n):")
        _reply(child)
        child.expect("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_chat_reports_the_servers_error(server: Any) -> None:
    child = _spawn(server, "--max-tokens", "100000")
    try:
        child.sendline(PROMPT)
        child.expect(r"\[error: max_tokens: this model's maximum context length is 128[^\]]*\]")
        child.expect("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_loads_a_model_itself(llama_path: Any, client: Any) -> None:
    from tests.entrypoints.conftest import CHAT_TEMPLATE

    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "TERM": "dumb"}
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "pagedllm.entrypoints.cli",
            "chat",
            str(llama_path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "64",
            "--block-size",
            "8",
            "--max-model-len",
            "128",
            "--chat-template",
            CHAT_TEMPLATE,
            "--temperature",
            "0",
            "--max-tokens",
            "10",
        ],
        cwd=str(REPO),
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(50, 400),
    )
    try:
        child.expect("chatting with ")
        child.expect("> ")
        child.sendline(PROMPT)
        child.expect_exact(PROMPT)
        expected = client.chat.completions.create(
            model=MODEL_NAME,
            max_tokens=10,
            temperature=0,
            messages=[{"role": "user", "content": PROMPT}],
        )
        assert _reply(child) == expected.choices[0].message.content
        child.expect("> ")
        child.sendeof()
        child.expect(pexpect.EOF, timeout=60)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
