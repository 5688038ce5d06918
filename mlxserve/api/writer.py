"""The one streaming path and the one collecting path, for every dialect.

A dialect supplies a `DialectWriter`: its event machine (start, delta,
finish, fail), its keep-alive and framing, and its non-streaming body.
`stream_run` drives a run's deltas through the writer as SSE; `collect_run`
folds them and asks the writer for the body; `respond` picks one and makes
sure the engine request ends with the response, however the response ends
(a client that goes away aborts at once: streaming, Starlette closes the
body; non-streaming, a watcher on the ASGI receive channel).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mlxserve.api.pipeline import Accumulator, EngineRequestFailed, OutputDelta, Usage
from mlxserve.api.run import GenerationRun
from mlxserve.api.sse import with_keepalive

E = TypeVar("E")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
UNFINISHED = "the engine ended the request without finishing it"


@dataclass(frozen=True)
class RunEnd:
    """How a run ended: the pipeline's finish reason, the stop string that matched, usage."""

    finish_reason: str
    stop_string: str | None
    usage: Usage


class DialectWriter(Protocol[E]):
    """One response in one dialect: its events, their framing, and its whole body."""

    def start(self, usage: Usage) -> list[E]: ...

    def delta(self, delta: OutputDelta) -> list[E]: ...

    def finish(self, end: RunEnd) -> list[E]: ...

    def fail(self, message: str, usage: Usage) -> list[E]: ...

    def keepalive(self) -> bytes: ...

    def frame(self, event: E) -> bytes: ...

    def body(self, acc: Accumulator, end: RunEnd) -> dict[str, Any]: ...


class ClientGone(Exception):
    """The client disconnected before its non-streaming answer was ready."""


def _end(run: GenerationRun, finish_reason: str | None) -> RunEnd:
    pipeline = run.pipeline
    return RunEnd(finish_reason or "stop", pipeline.stop_string, pipeline.usage)


async def stream_run(
    run: GenerationRun, writer: DialectWriter[Any], keepalive_s: float | None = None
) -> AsyncIterator[bytes]:
    """The run as SSE: start, one frame per event, keep-alives while nothing comes, the end."""
    interval = run.state.config.keepalive_interval_s if keepalive_s is None else keepalive_s
    for event in writer.start(run.pipeline.usage):
        yield writer.frame(event)
    ended = False
    try:
        ticking = with_keepalive(run.deltas(), interval)
        closing = cast(AsyncGenerator[OutputDelta | None, None], ticking)
        async with contextlib.aclosing(closing) as deltas:
            async for delta in deltas:
                if delta is None:
                    yield writer.keepalive()
                    continue
                events = writer.delta(delta)
                if delta.finish_reason is not None:
                    ended = True
                    events += writer.finish(_end(run, delta.finish_reason))
                for event in events:
                    yield writer.frame(event)
    except EngineRequestFailed as e:
        ended = True
        run.report_failure(f"generation failed: {e}")
        for event in writer.fail(f"generation failed: {e}", run.pipeline.usage):
            yield writer.frame(event)
    if not ended:
        run.report_failure(UNFINISHED)
        for event in writer.fail(UNFINISHED, run.pipeline.usage):
            yield writer.frame(event)


async def collect_run(run: GenerationRun, writer: DialectWriter[Any]) -> dict[str, Any]:
    """The whole output as the writer's body; APIError 500 if the engine failed it."""
    acc = await run.accumulate()
    return writer.body(acc, _end(run, acc.finish_reason))


class _GuardedStream(StreamingResponse):
    """A streaming response that aborts its engine request however it ends.

    Starlette never starts the body generator when the client is gone before
    the response starts; the guard still frees the engine slot then.
    """

    def __init__(self, run: GenerationRun, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.abort_if_running()


async def respond(
    request: Request, run: GenerationRun, writer: DialectWriter[Any], stream: bool
) -> Response:
    """The run's answer in the writer's dialect: an SSE stream or one JSON body."""
    if stream:
        return _GuardedStream(run, stream_run(run, writer))
    return JSONResponse(await _until_disconnect(request, collect_run(run, writer)))


async def _until_disconnect(
    request: Request, work: Coroutine[Any, Any, dict[str, Any]]
) -> dict[str, Any]:
    """Run `work`; cancel it (aborting the engine request) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
