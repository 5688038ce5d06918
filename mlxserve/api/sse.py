"""Server-sent events: the one framer every dialect writes with, and keep-alive.

`sse` frames one event: a JSON object (or a literal such as OpenAI's
`[DONE]`), under an event name when the dialect names its events.

While a long prompt prefills, a stream has nothing to send for seconds or
minutes; proxies and clients close idle connections. `with_keepalive` wraps
a source iterator and yields `None` whenever `interval_s` passes without an
item, so each wire format can send its own keep-alive (an SSE comment for
OpenAI, a `ping` event for Anthropic) without a second copy of the timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

SSE_COMMENT = b": keep-alive\n\n"


def sse(data: Mapping[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event: `data` as compact JSON (a str is sent as is)."""
    if isinstance(data, str):
        payload = data
    else:
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {payload}\n\n".encode()


async def with_keepalive(source: AsyncIterator[T], interval_s: float) -> AsyncIterator[T | None]:
    """The items of `source`, with `None` after every `interval_s` of silence.

    Closing this iterator cancels the pending read and closes `source`, so a
    source's own cleanup (aborting its engine request) runs however it ends.
    """
    if interval_s <= 0:
        raise ValueError("interval_s must be positive")
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        closer = getattr(source, "aclose", None)
        if closer is not None:
            await closer()
