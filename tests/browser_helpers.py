"""The system's headless Chromium (Debian `chromium` + `chromium-driver`) through Selenium,
and a load of streaming clients for the operator page's tests and its screenshot.

`make test` installs the two packages first (`scripts/install-browser.sh`); the tests
skip without them, unless MLXSERVE_REQUIRE_BROWSER=1 (set by `make test`) makes that
a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
)


def browser_missing() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


class Browser:
    """One headless Chromium with a fresh profile; `quit` removes the profile."""

    def __init__(self, width: int = 1280, height: int = 1000) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="mlxserve-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (*FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)

    def console_errors(self) -> list[dict[str, Any]]:
        """The console's errors since the last call."""
        return [e for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]

    def quit(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)


class Load:
    """Streaming chat clients in threads, each sending requests one after another until
    `stop`; `once` sends one more (a long prompt, say) and returns its thread."""

    def __init__(self, url: str, model: str, user_agent: str = "load/1.0") -> None:
        self.url = url
        self.model = model
        self.user_agent = user_agent
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.completed = 0
        self.failures: list[str] = []

    def start(self, streams: int, words: int = 12) -> Load:
        for i in range(streams):
            prompt = f"Client {i} asks: " + " ".join(f"topic{i}-{w}" for w in range(words))
            thread = threading.Thread(target=self._loop, args=(prompt,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def _loop(self, prompt: str) -> None:
        while not self.stopping.is_set():
            self.request(prompt)

    def once(self, prompt: str) -> threading.Thread:
        thread = threading.Thread(target=self.request, args=(prompt,), daemon=True)
        thread.start()
        return thread

    def request(self, prompt: str) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 512,
            "temperature": 0,
            "stream": True,
        }
        headers = {"User-Agent": self.user_agent}
        try:
            with (
                httpx.Client(timeout=300) as client,
                client.stream(
                    "POST", f"{self.url}/v1/chat/completions", json=body, headers=headers
                ) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        json.loads(line[6:])
            self.completed += 1
        except httpx.HTTPError as e:
            if not self.stopping.is_set():
                self.failures.append(f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)


def require_browser() -> None:
    """Skip (or fail, under MLXSERVE_REQUIRE_BROWSER=1) where no browser can run."""
    import pytest

    missing = browser_missing()
    if missing is None:
        return
    if os.environ.get("MLXSERVE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"the browser tests must run here: {missing}")
    pytest.skip(missing)
