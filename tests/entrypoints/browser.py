"""A real headless Chromium (the system's package) driven through Selenium and chromedriver.

The browser and its driver come from the operating system (``apt-get install chromium
chromium-driver``, done by ci/cpu.sh); nothing is downloaded at test time. Where they are
missing the browser tests skip, saying so.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> tuple[str, str] | None:
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@contextlib.contextmanager
def chromium(width: int = 1280, height: int = 860) -> Iterator[Any]:
    found = find_browser()
    if found is None:
        pytest.skip(
            "no chromium + chromedriver on PATH (apt-get install chromium "
            "chromium-driver); ci/cpu.sh installs them"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    options = Options()
    options.binary_location = found[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy (exceptions count as not yet)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the page may be mid-render
            last = exc
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last})")


def browser_fetch(driver: Any, path: str, key: str | None = None) -> dict[str, Any]:
    """``fetch(path)`` from inside the page: the status and the body text."""
    return driver.execute_async_script(
        """const [path, key, done] = arguments;
        const headers = key ? {Authorization: 'Bearer ' + key} : {};
        fetch(path, {headers}).then(async r => done({status: r.status, text: await r.text()}))
          .catch(e => done({status: -1, text: String(e)}));""",
        path,
        key,
    )
