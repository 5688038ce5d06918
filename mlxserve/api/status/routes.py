"""`GET /v1/status` and the operator page (`/dashboard`, its script and style sheet).

The page is static: plain HTML, CSS and a small script shipped in the package
(`static/`), no build step and nothing fetched from elsewhere. It reads
`/v1/status` once a second. With `--api-key` the status route needs the key;
the page itself holds no data, so it is served to anyone and asks for the key
(kept in the tab's sessionStorage). A strict Content-Security-Policy allows
only its own script, style sheet and requests.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from mlxserve.api.errors import check_api_key
from mlxserve.api.models import ServedModels
from mlxserve.api.status.board import StatusBoard
from mlxserve.api.status.document import status_document
from mlxserve.api.status.history import History

STATUS_PATH = "/v1/status"
DASHBOARD_PATH = "/dashboard"
# Paths whose own errors (a page polling without its key) are not the operator's news.
QUIET_PATHS = (STATUS_PATH, DASHBOARD_PATH)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
_FILES = {
    "": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


def static_file(name: str) -> bytes:
    return resources.files("mlxserve.api.status").joinpath("static", name).read_bytes()


def add_status_routes(
    app: FastAPI, server: ServedModels, board: StatusBoard, history: History, dashboard: bool
) -> None:
    api_key = server.config.api_key

    @app.get(STATUS_PATH)
    async def _status(
        request: Request, since: float | None = Query(default=None, ge=0)
    ) -> JSONResponse:
        check_api_key(request, api_key)
        started = time.perf_counter()
        response = JSONResponse(status_document(server, board, history, since))
        # What building the answer cost the event loop (`bench status` reports it).
        spent_ms = (time.perf_counter() - started) * 1000.0
        response.headers["Server-Timing"] = f"status;dur={spent_ms:.3f}"
        response.headers["Cache-Control"] = "no-store"
        return response

    if not dashboard:
        return
    for suffix, (name, media_type) in _FILES.items():
        app.add_api_route(
            DASHBOARD_PATH + suffix,
            _serve(static_file(name), media_type),
            methods=["GET", "HEAD"],
            include_in_schema=False,
        )


def _serve(content: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def page() -> Response:
        return Response(content, media_type=media_type, headers=PAGE_HEADERS)

    return page


def wants_page(request: Request) -> bool:
    """A browser opening the base URL (it asks for HTML); API clients' probes get JSON."""
    return "text/html" in request.headers.get("accept", "")
