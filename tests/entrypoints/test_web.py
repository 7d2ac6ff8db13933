"""The web face: the chat page and the dashboard in a real headless Chromium, and their routes.

The page talks to the session's test server (tiny random Llama, API key set). Where an answer
must last long enough to be stopped, the engine's step is slowed for that test only.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.entrypoints.browser import browser_fetch, chromium, wait_for
from tests.entrypoints.conftest import API_KEY, MODEL_NAME
from tests.entrypoints.test_concurrency import finish_counts

PROMPT = "The quick brown fox"


class _SlowStep:
    """The engine's step, ``delay`` seconds longer (lives in the engine core process)."""

    def __init__(self, step: Any, delay: float) -> None:
        self.step, self.delay = step, delay

    def __call__(self) -> Any:
        time.sleep(self.delay)
        return self.step()


def _slow_down(engine: Any, delay: float) -> None:
    engine.step = _SlowStep(engine.step, delay)


def _speed_up(engine: Any) -> None:
    engine.__dict__.pop("step", None)  # the class's method again


@contextlib.contextmanager
def slowed(server: Any, delay: float) -> Iterator[None]:
    """Every engine step takes ``delay`` seconds longer (in the engine core, between steps)."""
    server.in_core(_slow_down, delay)
    try:
        yield
    finally:
        server.in_core(_speed_up)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


def by_id(driver: Any, element_id: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def open_page(
    driver: Any, server: Any, path: str = "/", *, key: str | None = API_KEY, clear: bool = False
) -> None:
    driver.get(server.base_url + path)
    if clear:
        driver.execute_script("localStorage.clear()")
    if key is not None:
        driver.execute_script("localStorage.setItem('pagedllm.apiKey', arguments[0])", key)
    driver.refresh()


def set_field(driver: Any, element_id: str, value: str) -> None:
    """Set an input's value as a user would (the page saves it on 'change')."""
    driver.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event('change')); e.dispatchEvent(new Event('input'));",
        element_id,
        value,
    )


def send(driver: Any, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = by_id(driver, "prompt")
    box.clear()
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def last_answer(driver: Any) -> dict[str, Any]:
    return driver.execute_script(
        "const els = document.querySelectorAll('#messages .msg.assistant');"
        "const el = els[els.length - 1]; if (!el) return null;"
        "return {state: el.dataset.state, chars: Number(el.dataset.chars),"
        " text: el.querySelector('.content').textContent,"
        " html: el.querySelector('.content').innerHTML,"
        " error: el.querySelector('.error').textContent,"
        " meta: el.querySelector('.meta').textContent};"
    )


def stored(driver: Any) -> list[dict[str, Any]]:
    return json.loads(
        driver.execute_script("return localStorage.getItem('pagedllm.conversations')") or "[]"
    )


def wait_streaming(driver: Any, server: Any) -> None:
    """Until the page shows part of an answer and the server has streamed a few tokens."""
    wait_for(lambda: last_answer(driver)["chars"] > 0, what="the first text on the page")

    def streaming() -> bool:
        rows = httpx.get(
            server.v1 + "/dashboard", headers={"Authorization": f"Bearer {API_KEY}"}
        ).json()["requests"]
        return any(r["state"] == "streaming" and r["tokens"] >= 3 for r in rows)

    wait_for(streaming, what="a request streaming on the server")


def wait_models(driver: Any) -> list[str]:
    return wait_for(
        lambda: driver.execute_script(
            "return Array.from(document.querySelectorAll('#model option')).map(o => o.value)"
        ),
        what="the model picker",
    )


# -- routes, without a browser ---------------------------------------------------------------
def test_pages_and_assets_are_served_without_the_key(server: Any) -> None:
    for path, kind in (
        ("/", "text/html"),
        ("/dashboard", "text/html"),
        ("/static/chat.js", "javascript"),
        ("/static/style.css", "text/css"),
    ):
        r = httpx.get(server.base_url + path)
        assert r.status_code == 200 and kind in r.headers["content-type"], (path, r.text[:200])
    page = httpx.get(server.base_url + "/").text
    assert "http://" not in page and "https://" not in page  # nothing loaded from elsewhere
    r = httpx.get(server.base_url + "/v1/dashboard")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.base_url + "/v1/dashboard/requests/x/abort")
    assert r.status_code == 401


def test_dashboard_data_tracks_and_aborts_a_request(server: Any, http: Any) -> None:
    before = finish_counts(server).get("abort", 0.0)
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 100,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    finishes: list[str | None] = []
    with slowed(server, 0.05), http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        engine_id = json.loads(first[6:])["id"] + "-0"
        data = http.get("/v1/dashboard").json()
        row = next(r for r in data["requests"] if r["id"] == engine_id)
        assert row["state"] in ("queued", "streaming") and row["max_tokens"] == 100
        assert row["prompt_tokens"] > 0 and row["age_s"] >= 0
        assert set(data["series"]) >= {"running", "kv_device", "gen_tps", "ttft_p50"}
        assert len(data["t"]) == len(data["series"]["running"])
        assert data["series"]["running"][-1] + data["series"]["waiting"][-1] >= 1
        r2 = http.post(f"/v1/dashboard/requests/{engine_id}/abort")
        assert r2.status_code == 200 and r2.json() == {"id": engine_id, "aborted": True}
        for line in lines:
            if line.startswith("data: {"):
                finishes.append(json.loads(line[6:])["choices"][0]["finish_reason"])
    assert finishes[-1] == "abort"
    server.assert_all_blocks_free()
    assert finish_counts(server).get("abort", 0.0) == before + 1
    rows = {r["id"]: r for r in http.get("/v1/dashboard").json()["requests"]}
    assert rows[engine_id]["state"] == "finished"
    assert rows[engine_id]["finish_reason"] == "abort"
    r = http.post("/v1/dashboard/requests/nope/abort")
    assert r.status_code == 404 and r.json()["error"]["param"] == "request_id"


# -- the chat page ---------------------------------------------------------------------------
def test_chat_asks_for_the_key_then_streams_and_keeps_the_conversation(
    server: Any, browser: Any, client: Any
) -> None:
    open_page(browser, server, key=None, clear=True)
    wait_for(lambda: by_id(browser, "key-dialog").is_displayed(), what="the API key dialog")
    assert "invalid or missing API key" in by_id(browser, "key-reason").text
    assert browser_fetch(browser, "/v1/models")["status"] == 401  # the server refuses
    by_id(browser, "key-input").send_keys(API_KEY)
    by_id(browser, "key-save").click()
    assert wait_models(browser) == [MODEL_NAME, "alias"]
    by_id(browser, "toggle-settings").click()
    set_field(browser, "system", "You are terse.")
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "16")
    browser.execute_script(
        "window.__updates = 0; new MutationObserver(() => window.__updates++).observe("
        "document.getElementById('messages'), {subtree: true, childList: true,"
        " characterData: true});"
    )
    send(browser, PROMPT)
    answer = wait_for(
        lambda: (a := last_answer(browser)) and a["state"] == "done" and a,
        what="the streamed answer",
    )
    expected = client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=16,
        temperature=0,
        top_p=1,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": PROMPT},
        ],
    )
    conv = stored(browser)[0]
    assert conv["messages"][-1]["content"] == expected.choices[0].message.content
    n = expected.usage.completion_tokens
    assert f"{n} tokens" in answer["meta"] and "TTFT" in answer["meta"], answer["meta"]
    assert "tok/s" in answer["meta"] or n < 2
    assert browser.execute_script("return window.__updates") >= min(n, 4)  # it streamed
    assert conv["title"] == PROMPT and conv["system"] == "You are terse."
    # A reload finds the conversation, its answer and its system prompt again.
    browser.refresh()
    wait_models(browser)
    titles = [e.text for e in browser.find_elements("css selector", "#conversations li span")]
    assert PROMPT in titles
    again = last_answer(browser)
    assert again["state"] == "done" and again["meta"] == answer["meta"]
    assert by_id(browser, "system").get_attribute("value") == "You are terse."
    server.assert_all_blocks_free()


def test_regenerate_replaces_the_last_answer(server: Any, browser: Any) -> None:
    open_page(browser, server)
    wait_models(browser)
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "8")
    by_id(browser, "new-chat").click()
    send(browser, "def fibonacci(n):")
    first = wait_for(lambda: (a := last_answer(browser)) and a["state"] == "done" and a)
    by_id(browser, "regenerate").click()
    wait_for(
        lambda: (
            last_answer(browser)["state"] == "streaming" or len(stored(browser)[0]["messages"]) == 2
        )
    )
    second = wait_for(lambda: (a := last_answer(browser)) and a["state"] == "done" and a)
    messages = wait_for(lambda: stored(browser)[0]["messages"])
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert second["text"] == first["text"]  # greedy: the same answer again


def test_stop_aborts_the_request_and_frees_its_blocks(server: Any, browser: Any) -> None:
    open_page(browser, server)
    wait_models(browser)
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "96")
    by_id(browser, "new-chat").click()
    set_field(browser, "system", "")
    before = finish_counts(server).get("abort", 0.0)
    with slowed(server, 0.05):
        send(browser, PROMPT)
        wait_streaming(browser, server)
        assert last_answer(browser)["state"] == "streaming"
        by_id(browser, "stop-btn").click()
        answer = wait_for(lambda: (a := last_answer(browser)) and a["state"] == "stopped" and a)
        wait_for(
            lambda: finish_counts(server).get("abort", 0.0) == before + 1,
            what="the server to abort the request",
        )
    assert "stopped" in answer["meta"]
    server.assert_all_blocks_free()
    assert by_id(browser, "send").is_enabled()


def test_closing_the_page_aborts_the_request(server: Any, browser: Any) -> None:
    open_page(browser, server)
    wait_models(browser)
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "96")
    by_id(browser, "new-chat").click()
    set_field(browser, "system", "")
    before = finish_counts(server).get("abort", 0.0)
    with slowed(server, 0.05):
        send(browser, PROMPT)
        wait_streaming(browser, server)
        browser.get("about:blank")
        wait_for(
            lambda: finish_counts(server).get("abort", 0.0) == before + 1,
            what="the server to abort the request",
        )
    server.assert_all_blocks_free()


def test_chat_shows_the_servers_error_text(server: Any, browser: Any) -> None:
    open_page(browser, server)
    wait_models(browser)
    set_field(browser, "max-tokens", "100000")
    by_id(browser, "new-chat").click()
    send(browser, PROMPT)
    answer = wait_for(lambda: (a := last_answer(browser)) and a["state"] == "error" and a)
    assert answer["error"].startswith("max_tokens: this model's maximum context length is 128")
    assert "max_tokens asks for 100000" in answer["error"] and answer["text"] == ""
    set_field(browser, "max-tokens", "256")


def test_markdown_is_rendered_and_escaped(server: Any, browser: Any) -> None:
    open_page(browser, server)
    html = browser.execute_script(
        "return PagedMarkdown.render(arguments[0])",
        "# Title\nSome **bold** and `x<y` <script>alert(1)</script>\n\n- a\n- b\n\n"
        "```python\nprint('<hi>')\n```\n[link](https://example.org) [bad](javascript:alert(1))",
    )
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html
    assert "<code>x&lt;y</code>" in html and "&lt;script&gt;" in html and "<script>" not in html
    assert "<ul><li>a</li><li>b</li></ul>" in html
    assert 'class="lang-python"' in html and "print(&#39;&lt;hi&gt;&#39;)" in html
    assert 'href="https://example.org"' in html and "javascript:" not in html.split("bad")[0]
    assert 'href="javascript' not in html
    # An unfinished fence (mid-stream) is already a code block.
    assert "codeblock" in browser.execute_script("return PagedMarkdown.render('```\\nx = 1')")


# -- the dashboard ---------------------------------------------------------------------------
def _load(server: Any, n: int, max_tokens: int) -> threading.Thread:
    def run() -> None:
        import openai

        client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=60)
        threads = [
            threading.Thread(
                target=lambda i=i: client.completions.create(
                    model=MODEL_NAME,
                    prompt=f"{PROMPT} {i}",
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )
            for i in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def plot_state(driver: Any, canvas: str) -> tuple[int, dict[str, float], str]:
    return driver.execute_script(
        "const c = document.getElementById(arguments[0]);"
        "return [Number(c.dataset.points || 0), JSON.parse(c.dataset.last || '{}'),"
        " c.toDataURL()];",
        canvas,
    )


def test_dashboard_plots_move_under_load_and_abort_works(server: Any, browser: Any) -> None:
    open_page(browser, server, "/dashboard", key=None, clear=True)
    wait_for(lambda: by_id(browser, "key-dialog").is_displayed(), what="the API key dialog")
    assert plot_state(browser, "plot-tps")[0] == 0  # no data without the key
    by_id(browser, "key-input").send_keys(API_KEY)
    by_id(browser, "key-save").click()
    wait_for(lambda: plot_state(browser, "plot-tps")[0] > 0, what="the first sample")
    server.wait_idle()
    time.sleep(1.2)  # one idle sample
    _, _, idle_image = plot_state(browser, "plot-tps")
    with slowed(server, 0.03):
        load = _load(server, 8, 80)
        wait_for(
            lambda: plot_state(browser, "plot-tps")[1].get("generation", 0) > 0,
            what="generation tokens/s on the plot",
        )
        wait_for(
            lambda: plot_state(browser, "plot-requests")[1].get("running", 0) > 0,
            what="running requests on the plot",
        )
        assert plot_state(browser, "plot-tps")[2] != idle_image
        assert plot_state(browser, "plot-kv")[1].get("device", 0) > 0
        rows = wait_for(
            lambda: browser.execute_script(
                "return Array.from(document.querySelectorAll('#requests tr.streaming'))"
                ".map(r => r.dataset.id)"
            ),
            what="streaming rows in the table",
        )
        victim = rows[0]
        before = finish_counts(server).get("abort", 0.0)
        browser.execute_script(
            'document.querySelector(`#requests tr[data-id="${arguments[0]}"] .abort`).click()',
            victim,
        )
        wait_for(
            lambda: finish_counts(server).get("abort", 0.0) == before + 1,
            what="the dashboard's abort",
        )
        load.join(60)
    assert not load.is_alive()
    server.assert_all_blocks_free()
    wait_for(lambda: plot_state(browser, "plot-ttft")[1].get("p50", 0) > 0, what="TTFT p50")
    assert browser.execute_script("return document.getElementById('tile-ttft').textContent") != "–"
