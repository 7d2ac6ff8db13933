"""Chat templates rendered within bounds (issue 58): a hostile template costs its request one
400 naming the template, never the server.

The renderer itself on the tiny model's tokenizer (each bound, and equal output to the
tokenizer's own rendering), then a real ``pagedllm serve`` with a template that loops 10^10 times
or computes ``3**(3**16)`` on a trigger message: ``/health`` answers within 1 s throughout, a
normal request still works, and SIGTERM ends it within the shutdown timeout. A template that
cannot render one message within the bound is refused at start-up in one line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedllm.entrypoints.openai.template_render import (
    ChatTemplateError,
    TemplateLimits,
    TemplateRenderer,
)
from tests.entrypoints.conftest import free_port
from tests.entrypoints.test_cli import REPO, _wait_healthy

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
POW = "{% set n = 16 %}{{ 3**(3**n) }}"  # not folded at compile: computed when rendered
HOSTILE = (
    "{% for m in messages %}"
    "{% if m['content'] == 'loop' %}" + LOOP + "{% endif %}"
    "{% if m['content'] == 'pow' %}" + POW + "{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hello there"}]
TIMEOUT = 1.5  # the render bound these tests run under


@pytest.fixture(scope="module", params=["transformers", "pagedllm"])
def renderer(llama_path: Path, request: pytest.FixtureRequest) -> Any:
    """The renderer over transformers' tokenizer, and over pagedllm's own (what the server
    holds for a plain tokenizer.json: its workers import no transformers)."""
    from transformers import AutoTokenizer

    from pagedllm.tokenization.loading import load_plain_tokenizer

    if request.param == "transformers":
        tokenizer = AutoTokenizer.from_pretrained(llama_path)
    else:
        tokenizer = load_plain_tokenizer(llama_path)
    r = TemplateRenderer(tokenizer, "the chat template (t.jinja)", TemplateLimits(TIMEOUT))
    yield tokenizer, r
    r.close()


def _refused(r: TemplateRenderer, template: str, kind: str) -> str:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        r.render(MESSAGES, template, add_generation_prompt=True)
    assert info.value.kind == kind, info.value
    assert "the chat template (t.jinja)" in str(info.value)
    assert "\n" not in str(info.value)
    # A killed worker's successor may still be importing: its start is not in the bound.
    assert time.monotonic() - start < TIMEOUT + r.limits.start_seconds
    return str(info.value)


def test_renders_as_the_tokenizer_does(renderer: Any) -> None:
    tokenizer, r = renderer
    kwargs = {"add_generation_prompt": True}
    expected = tokenizer.apply_chat_template(
        MESSAGES, chat_template=HOSTILE, tokenize=False, **kwargs
    )
    assert r.render(MESSAGES, HOSTILE, **kwargs) == expected == "user: Hello there\nassistant:"


@pytest.mark.parametrize("template", [LOOP, POW, "{{ 3**(3**16) }}"], ids=["loop", "pow", "const"])
def test_a_render_past_its_time_is_stopped(renderer: Any, template: str) -> None:
    _, r = renderer
    message = _refused(r, template, "time")
    assert f"within {TIMEOUT:g} s" in message
    assert r.render(MESSAGES, HOSTILE) == "user: Hello there\n"  # the pool works on


def test_output_and_memory_bounds(renderer: Any) -> None:
    _, r = renderer
    assert "characters" in _refused(r, "{{ 'x' * 5000000 }}", "size")
    _refused(r, "{{ 'x' * 3000000000 }}", "memory")
    message = _refused(r, "{{ raise_exception('no system role here') }}", "error")
    assert message.endswith("failed: no system role here")


def test_startup_check_refuses_with_jinjas_message(renderer: Any) -> None:
    _, r = renderer
    with pytest.raises(
        ChatTemplateError, match=r"t\.jinja\) failed: 'str object' has no attribute 'nope'"
    ):
        r.check_startup("{{ messages[0].content.nope() }}")
    r.check_startup(HOSTILE)


def test_a_worker_killed_from_outside_is_replaced(renderer: Any) -> None:
    _, r = renderer
    assert r.render(MESSAGES, HOSTILE) == "user: Hello there\n"
    for worker in list(r._all):
        worker.proc.kill()
        worker.proc.wait()
    assert r.render(MESSAGES, HOSTILE) == "user: Hello there\n"


def test_a_spare_started_ahead_serves_the_first_renders(renderer: Any) -> None:
    """Workers started before their renderer (``pagedllm serve`` starts one while its engine
    loads) are the ones a new renderer's first renders run on, and render as the tokenizer
    does; one never taken is ended when the process exits."""
    from pagedllm.entrypoints.openai import template_render

    tokenizer, _ = renderer
    template_render.start_spare_workers(2)
    spares = list(template_render._spares)
    r = TemplateRenderer(tokenizer, "the chat template (t.jinja)", TemplateLimits(TIMEOUT))
    try:
        r.check_startup(HOSTILE)
        assert r.render(MESSAGES, HOSTILE) == "user: Hello there\n"
        assert [w.proc for w in r._all] == spares[:1]  # one render at a time: one worker
        assert template_render._spares == spares[1:]
    finally:
        r.close()
    template_render._end_spares()  # what exiting runs (atexit)
    assert template_render._spares == [] and spares[1].poll() is not None


class _Unpicklable:
    """A tokenizer the worker cannot be given (a lambda inside): rendered in the thread."""

    def __init__(self) -> None:
        self.hook = lambda: None

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        return "".join(m["content"] for m in messages) + kw["chat_template"]


def test_a_tokenizer_that_does_not_pickle_renders_in_the_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING"):
        r = TemplateRenderer(_Unpicklable(), "the chat template (x)")
    assert "cannot be copied to a worker process" in caplog.text
    assert r.render(MESSAGES, "!") == "Hello there!"
    assert not r._all


def _serve(model: Path, template: Path, tmp_path: Path, port: int) -> tuple[Any, Path]:
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(model),
        "--port", str(port), "--device", "cpu", "--dtype", "float32",
        "--num-kv-blocks", "256", "--block-size", "8", "--max-model-len", "256",
        "--served-model-name", "tiny", "--chat-template", str(template),
        "--chat-template-timeout", str(TIMEOUT), "--shutdown-timeout", "5",
        "--disable-log-stats",
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    return proc, log


class _HealthWatch(threading.Thread):
    """Polls /health while the hostile requests run; records the slowest answer."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.stop, self.slowest, self.failures = base, threading.Event(), 0.0, []

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                status = httpx.get(self.base + "/health", timeout=5).status_code
                if status != 200:
                    self.failures.append(status)
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
            self.slowest = max(self.slowest, time.monotonic() - start)
            time.sleep(0.1)


def _chat(base: str, content: str) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)


def test_server_survives_hostile_templates(llama_path: Path, tmp_path: Path) -> None:
    template = tmp_path / "hostile.jinja"
    template.write_text(HOSTILE)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc, log = _serve(llama_path, template, tmp_path, port)
    try:
        _wait_healthy(base, proc, log)
        watch = _HealthWatch(base)
        watch.start()
        replies: list[tuple[str, httpx.Response]] = []
        workers = [
            threading.Thread(target=lambda c=c: replies.append((c, _chat(base, c))))
            for c in ("loop", "pow", "loop")
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=120)
        watch.stop.set()
        watch.join()
        assert len(replies) == 3
        for content, r in replies:
            assert r.status_code == 400, (content, r.text)
            error = r.json()["error"]
            assert error["code"] == "chat_template_limit" and error["param"] == "messages"
            assert "hostile.jinja" in error["message"] and "stopped" in error["message"]
        assert not watch.failures and watch.slowest < 1.0, (watch.failures, watch.slowest)
        ok = _chat(base, "hi")
        assert ok.status_code == 200, ok.text
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5 + 10)
        assert time.monotonic() - start < 5 + 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()


def test_template_that_cannot_render_is_refused_at_startup(
    llama_path: Path, tmp_path: Path
) -> None:
    template = tmp_path / "pow.jinja"
    template.write_text("{{ 3**(3**16) }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    proc, log = _serve(llama_path, template, tmp_path, free_port())
    try:
        assert proc.wait(timeout=180) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("pagedllm serve: ")]
    assert lines == [
        f"pagedllm serve: the chat template ({template}) did not finish rendering within "
        f"{TIMEOUT:g} s; the render was stopped"
    ], text[-2000:]
    assert "Traceback" not in text
