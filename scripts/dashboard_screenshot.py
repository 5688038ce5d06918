"""Regenerate docs/dashboard.png: the operator page of a live server under load.

    .venv/bin/python scripts/dashboard_screenshot.py docs/dashboard.png   (or `make screenshot`)

A real server (uvicorn on 127.0.0.1, the real engine) serves the scripted test
model, paced like a slow device; five agents stream conversations in a loop
(each resends its conversation, so the prefix cache hits), a long prompt arrives every
20 seconds, and now and then a client sends a bad request. After `--seconds`
of that, once a long prompt is part way through its prefill, headless Chromium
(the test suite's, `scripts/install-browser.sh`) takes the picture.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from api_fixtures import ServerThread, serve_args  # noqa: E402
from browser_helpers import Browser, Load, browser_missing  # noqa: E402
from status_helpers import Paced, fetch_status, wait_for, wrapped_scripted  # noqa: E402

MODEL = "scripted-v4"
SCRIPT = " ".join(f"step {i}," for i in range(40))
LONG_PROMPT = "Please review this repository. " + " ".join(f"file{i}.py" for i in range(2000))
AGENTS = ("claude-cli/2.1.3", "codex_cli_rs/0.77.0", "opencode/1.0.9", "OpenAI/Python 3.51.0")


def bad_requests(url: str, stop: threading.Event) -> None:
    """A client that sometimes sends what the server must refuse."""
    bodies = [
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
        {"model": MODEL, "messages": [], "max_tokens": 8},
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7},
    ]
    i = 0
    while not stop.wait(17.0):
        httpx.post(f"{url}/v1/chat/completions", json=bodies[i % len(bodies)], timeout=30)
        i += 1


def long_prompts(load: Load, stop: threading.Event) -> None:
    """A new long prompt every 20 s (each its own, so none is a prefix-cache hit)."""
    n = 0
    while not stop.is_set():
        n += 1
        load.once(f"Review {n}. {LONG_PROMPT}").join()
        stop.wait(20.0)


def prefilling(url: str) -> bool:
    for r in fetch_status(url)["requests"]:
        prefill = r["prefill"]
        if r["state"] == "prefilling" and prefill and 0.3 < prefill["fraction"] < 0.8:
            return True
    return False


def capture(url: str, out: Path, width: int) -> None:
    browser = Browser(width, 900)
    try:
        driver = browser.driver
        driver.get(url + "/dashboard")
        wait_for(lambda: driver.find_element("id", "main").is_displayed(), what="the page")
        wait_for(lambda: prefilling(url), timeout=120, what="a long prefill under way")
        time.sleep(1.2)  # the page's next poll shows it
        # The window as tall as the page (the browser's own bars take some of it).
        script = "return [document.documentElement.scrollHeight, window.innerHeight]"
        for _ in range(3):
            page, inner = driver.execute_script(script)
            if page <= inner:
                break
            driver.set_window_size(width, driver.get_window_size()["height"] + page - inner)
        driver.save_screenshot(str(out))
    finally:
        browser.quit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", default=str(ROOT / "docs" / "dashboard.png"))
    parser.add_argument("--seconds", type=float, default=120.0, help="load before the picture")
    parser.add_argument("--width", type=int, default=1280)
    args = parser.parse_args()
    missing = browser_missing()
    if missing is not None:
        print(f"dashboard_screenshot: {missing}", file=sys.stderr)
        return 1
    server_args = serve_args(
        "--served-model-name", MODEL, "claude-sonnet-4-5",
        "--max-num-batched-tokens", "256", "--max-step-ms", "150",
        "--tool-call-parser", "none", "--reasoning-parser", "none",
    )  # fmt: skip
    model = lambda: wrapped_scripted(SCRIPT, lambda inner: Paced(inner, 0.02, 0.0008))  # noqa: E731
    stop = threading.Event()
    with ServerThread(server_args, model) as server:
        loads = [Load(server.url, MODEL, agent).start(1, words=40 + 30 * i) for i, agent in
                 enumerate(AGENTS)]  # fmt: skip
        helpers = [
            threading.Thread(target=bad_requests, args=(server.url, stop), daemon=True),
            threading.Thread(target=long_prompts, args=(loads[0], stop), daemon=True),
        ]
        for thread in helpers:
            thread.start()
        time.sleep(args.seconds)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        capture(server.url, out, args.width)
        stop.set()
        for load in loads:
            load.stop()
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
