"""`with_keepalive`: silence becomes None items; closing it closes the source."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from mlxserve.api.sse import with_keepalive


def test_items_pass_through_with_none_during_silence() -> None:
    release = asyncio.Event()

    async def source() -> AsyncIterator[int]:
        yield 1
        await release.wait()
        yield 2

    async def main() -> list[int | None]:
        out: list[int | None] = []
        async for item in with_keepalive(source(), 0.01):
            out.append(item)
            if out.count(None) == 3:
                release.set()
        return out

    out = asyncio.run(main())
    assert out[0] == 1 and out[-1] == 2
    assert out[1:-1] == [None, None, None]


def test_closing_cancels_the_pending_read_and_closes_the_source() -> None:
    state = {"closed": False}

    async def source() -> AsyncIterator[int]:
        try:
            yield 1
            await asyncio.Event().wait()
            yield 2
        finally:
            state["closed"] = True

    async def main() -> None:
        stream = with_keepalive(source(), 0.01)
        assert await anext(stream) == 1
        assert await anext(stream) is None
        await stream.aclose()

    asyncio.run(main())
    assert state["closed"]


def test_source_errors_propagate() -> None:
    async def source() -> AsyncIterator[int]:
        yield 1
        raise RuntimeError("engine failed")

    async def main() -> list[int | None]:
        return [item async for item in with_keepalive(source(), 1.0)]

    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(main())


def test_interval_must_be_positive() -> None:
    async def main() -> None:
        async def source() -> AsyncIterator[int]:
            yield 1

        await anext(with_keepalive(source(), 0))

    with pytest.raises(ValueError):
        asyncio.run(main())
