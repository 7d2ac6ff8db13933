"""Screenshots of the web chat and of the dashboard under load, for docs/serving.md.

    python tools/web_screenshots.py            # writes docs/images/web-chat.png, web-dashboard.png

Serves the bundled demo model (it writes Python-like code; a chat template that passes the
messages through unchanged lets it "answer"), drives the system's headless Chromium through
Selenium, and runs `pagedllm bench serve` as the load while the dashboard is captured.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.entrypoints.browser import chromium, wait_for  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    out_dir = REPO / "docs" / "images"
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--chat-template",
            TEMPLATE,
            "--max-num-seqs",
            "16",
            "--kv-cache-space",
            "0.02",
            "--enable-prefix-caching",
            "--disable-log-stats",
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
    )
    load = None
    try:
        wait_for(
            lambda: httpx.get(base + "/health", timeout=2).status_code == 200,
            timeout=300,
            what="the server",
        )
        with chromium(1280, 1000) as driver:
            driver.get(base + "/")
            driver.execute_script("localStorage.clear()")
            driver.execute_script(
                "localStorage.setItem('pagedllm.settings', arguments[0])",
                json.dumps({"temperature": "0.3", "max-tokens": "64"}),
            )
            driver.refresh()
            wait_for(
                lambda: driver.execute_script(
                    "return document.querySelectorAll('#model option').length"
                )
            )
            for prompt in ("def fibonacci(n):", "class LRUCache:\n    def __init__(self, size):"):
                box = driver.find_element("id", "prompt")
                driver.execute_script("arguments[0].value = arguments[1]", box, prompt)
                driver.find_element("id", "send").click()
                wait_for(
                    lambda: driver.execute_script(
                        "const m = document.querySelectorAll('#messages .msg.assistant');"
                        "return m.length && m[m.length - 1].dataset.state === 'done'"
                    ),
                    timeout=120,
                )
            driver.find_element("id", "toggle-settings").click()
            driver.execute_script("document.getElementById('messages').scrollTop = 0")
            driver.save_screenshot(str(out_dir / "web-chat.png"))
            load = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pagedllm.entrypoints.cli",
                    "bench",
                    "serve",
                    "--url",
                    base,
                    "--num-prompts",
                    "400",
                    "--request-rate",
                    "6",
                    "--max-concurrency",
                    "12",
                    "--input-len",
                    "48",
                    "--output-len",
                    "96",
                    "--no-progress",
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
            )
            driver.set_window_size(1400, 1320)
            driver.get(base + "/dashboard")
            time.sleep(40)
            driver.save_screenshot(str(out_dir / "web-dashboard.png"))
    finally:
        for proc in (load, server):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(60)
    print("wrote", out_dir / "web-chat.png", "and", out_dir / "web-dashboard.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
