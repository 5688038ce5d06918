"""The operator page in a real headless Chromium, against a server under load.

One server for the module: a scripted model whose calls cost time like a slow
device's (so a long prompt prefills in many chunks over several seconds), four
streams (three short conversations in a loop and one long prompt), and a
served name that is markup. Waits are on what the page shows, with generous
deadlines; nothing asserts a duration.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_fixtures import ServerThread, serve_args
from browser_helpers import Browser, Load, require_browser
from status_helpers import Paced, wait_for, wrapped_scripted

pytestmark = pytest.mark.slow

MARKUP = "<img src=x onerror=alert(1)>"
AGENT = "<script>window.pwned = 1</script> load/1.0"
SCRIPT = " ".join(f"step {i}," for i in range(30))
LONG_PROMPT = "Please read all of this. " + " ".join(f"paragraph{i}" for i in range(1200))
KEY = "page-key"
# What the page's rows say (read in the page, as text).
ROWS_JS = """
return [...document.querySelectorAll('#requests tbody tr')].map((tr) => {
  const bar = tr.querySelector('progress');
  return {id: tr.dataset.id, state: tr.dataset.state, progress: bar ? bar.value : null};
});
"""


class Served:
    def __init__(self, server: ServerThread) -> None:
        self.server = server
        self.url = server.url
        self.prompt_lengths: dict[str, int] = {}
        server.state.on_submit = lambda rid, ids: self.prompt_lengths.__setitem__(rid, len(ids))


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    require_browser()
    args = serve_args(
        "--served-model-name",
        MARKUP,
        "--max-num-batched-tokens",
        "256",
        "--max-step-ms",
        "150",
        "--tool-call-parser",
        "none",
        "--reasoning-parser",
        "none",
    )
    # A call costs 25 ms plus 1 ms per input token; steps of about 150 ms while others
    # decode: the long prompt (about 2.7k tokens) prefills in some 20 chunks.
    model = lambda: wrapped_scripted(SCRIPT, lambda inner: Paced(inner, 0.025, 0.001))  # noqa: E731
    with ServerThread(args, model) as server:
        load = Load(server.url, MARKUP, AGENT).start(3)
        try:
            yield Served(server)
        finally:
            load.stop()
        assert not load.failures, load.failures


@pytest.fixture(scope="module")
def browser(served: Served) -> Iterator[Browser]:
    browser = Browser()
    try:
        browser.driver.get(served.url + "/dashboard")
        yield browser
    finally:
        browser.quit()


def text_of(browser: Browser, css: str) -> str:
    """The element's text, or "" while the page has not (re)drawn it: a poll may land between
    the page clearing a list and filling it again."""
    script = f"const found = document.querySelector({css!r}); return found ? found.textContent : ''"
    return str(browser.driver.execute_script(script))


def test_page_loads_with_model_and_health_and_no_console_errors(
    served: Served, browser: Browser
) -> None:
    wait_for(lambda: text_of(browser, "#health") == "ok", what="health ok on the page")
    assert text_of(browser, "#models .name") == MARKUP
    assert browser.driver.find_element("id", "main").is_displayed()
    assert not browser.driver.find_element("id", "key-form").is_displayed()
    assert browser.console_errors() == []
    headers = httpx.get(served.url + "/dashboard", timeout=30).headers
    assert "default-src 'none'" in headers["content-security-policy"]


def test_long_prefill_shows_progress_then_decoding_then_leaves(
    served: Served, browser: Browser
) -> None:
    load = Load(served.url, MARKUP, AGENT)
    client = load.once(LONG_PROMPT)
    long_id = wait_for(
        lambda: next((r for r, n in served.prompt_lengths.items() if n > 1000), None),
        what="the long request submitted",
    )

    def row() -> dict[str, Any] | None:
        rows = browser.driver.execute_script(ROWS_JS)
        return next((r for r in rows if r["id"] == long_id), None)

    first = wait_for(
        lambda: (r := row()) and r["state"] == "prefilling" and r["progress"] is not None and r,
        what="the long request prefilling",
    )
    wait_for(
        lambda: (r := row()) and r["state"] == "prefilling" and r["progress"] > first["progress"],
        what="its prefill progress advancing",
    )
    wait_for(lambda: (r := row()) and r["state"] == "decoding", what="it decoding")
    client.join(120)
    wait_for(lambda: row() is None, what="it leaving the table")
    assert not load.failures


def test_tokens_per_second_plot_grows(browser: Browser) -> None:
    def points() -> int:
        return int(browser.driver.find_element("id", "c-rate").get_attribute("data-points") or 0)

    seen = wait_for(points, what="points on the tokens/s plot")
    wait_for(lambda: points() > seen, what="the tokens/s plot growing")
    values = browser.driver.execute_script(
        "return document.querySelectorAll('#c-rate polyline').length"
    )
    assert values >= 1


def test_failing_request_appears_among_errors(served: Served, browser: Browser) -> None:
    body = {"model": MARKUP, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}
    response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    message = response.json()["error"]["message"]

    def shown() -> bool:
        cells = browser.driver.execute_script(
            "return [...document.querySelectorAll('#errors tbody tr')]"
            ".map((tr) => [...tr.cells].map((td) => td.textContent))"
        )
        return any(
            c[1] == "/v1/chat/completions" and c[2] == "400" and c[3] == message for c in cells
        )

    wait_for(shown, timeout=30, what="the error on the page")


def test_markup_from_the_server_is_text(served: Served, browser: Browser) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    wait_for(lambda: text_of(browser, "#models .name") == MARKUP, what="the model name")
    agents = wait_for(
        lambda: browser.driver.execute_script(
            "return [...document.querySelectorAll('#requests td.agent')]"
            ".map((td) => td.textContent)"
        ),
        what="a request's user agent",
    )
    assert AGENT in agents
    driver = browser.driver
    assert driver.execute_script("return document.querySelectorAll('img, main script').length") == 0
    assert driver.execute_script("return window.pwned === undefined")
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018
    assert browser.console_errors() == []


def test_api_key_page_shows_only_the_prompt(served: Served) -> None:
    args = serve_args("--api-key", KEY, "--served-model-name", "keyed")
    with ServerThread(args, lambda: wrapped_scripted(SCRIPT, lambda m: Paced(m, 0, 0))) as server:
        assert httpx.get(server.url + "/v1/status", timeout=30).status_code == 401
        browser = Browser(480, 900)
        try:
            driver = browser.driver
            driver.get(server.url + "/dashboard")
            form = driver.find_element("id", "key-form")
            wait_for(form.is_displayed, what="the key prompt")
            assert not driver.find_element("id", "main").is_displayed()
            assert driver.find_element("id", "models").text == ""
            field = driver.find_element("id", "key-input")
            field.send_keys(KEY)
            field.submit()
            wait_for(lambda: text_of(browser, "#models .name") == "keyed", what="the page, keyed")
            assert driver.find_element("id", "main").is_displayed() and not form.is_displayed()
        finally:
            browser.quit()
