"""DeepSeek-V4 output goldens through the streaming parser chain at many split sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxserve.parsers import (
    ContentDelta,
    ParserEvent,
    ReasoningDelta,
    ToolCallArgs,
    ToolCallDiscard,
    ToolCallEnd,
    ToolCallStart,
    accumulate,
    parse_stream,
    preset,
)

DATA = Path(__file__).parent / "data" / "dsv4_outputs_public.jsonl"
CASES = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line]
SIZES = [*range(1, 17), 32, 64, 128]
MARKUP = ("｜DSML｜", "</think>")


def split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def run_events(case: dict[str, Any], deltas: list[str]) -> list[ParserEvent]:
    chain = preset("deepseek_v4").create(thinking=case["thinking"], tools_given=case["tools_given"])
    events: list[ParserEvent] = []
    for delta in deltas:
        events += chain.feed(delta)
    return events + chain.finish()


def check_events(case: dict[str, Any], events: list[ParserEvent]) -> None:
    expected_content = case["expected"]["content"] or ""
    for event in events:
        if isinstance(event, ReasoningDelta):
            assert event.text
            assert not any(m in event.text for m in MARKUP), event
        elif isinstance(event, ContentDelta):
            assert event.text
            for marker in MARKUP:
                if marker not in expected_content:
                    assert marker not in event.text, event
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = {e.index: e for e in events if isinstance(e, ToolCallEnd)}
    discarded = [e.index for e in events if isinstance(e, ToolCallDiscard)]
    assert [s.index for s in starts] == list(range(len(starts)))
    assert len({s.id for s in starts}) == len(starts)
    # Every streamed call is either completed or discarded, never both.
    assert sorted([*ends, *discarded]) == [s.index for s in starts]
    for start in starts:
        assert start.id.startswith("call_") and len(start.id) > 10
        args = "".join(
            e.arguments for e in events if isinstance(e, ToolCallArgs) and e.index == start.index
        )
        if start.index in discarded:
            continue
        end = ends[start.index]
        assert args == end.arguments_json and json.loads(args) == end.arguments
        assert end.id == start.id and end.name == start.name


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_golden_every_split(case: dict[str, Any]) -> None:
    text = case["text"]
    for size in [*SIZES, max(1, len(text))]:
        events = run_events(case, split(text, size))
        assert accumulate(events) == case["expected"], f"split size {size}"
        check_events(case, events)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_golden_parse_stream_whole_text(case: dict[str, Any]) -> None:
    got = parse_stream([case["text"]], thinking=case["thinking"], tools_given=case["tools_given"])
    assert got == case["expected"]


def test_goldens_cover_the_interesting_kinds() -> None:
    tags = {t for c in CASES for t in c["tags"]}
    assert {"malformed_block", "truncated_block", "no_think_end_then_tool"} <= tags
    assert len(CASES) == 60


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c["tools_given"] and c["expected"]["tool_calls"]],
    ids=lambda c: c["id"],
)
def test_golden_without_tools_keeps_block_as_text(case: dict[str, Any]) -> None:
    got = parse_stream(split(case["text"], 3), thinking=case["thinking"], tools_given=False)
    assert got["tool_calls"] == []
    joined = (got["reasoning_content"] or "") + (got["content"] or "")
    assert "<｜DSML｜tool_calls>" in joined
    assert "<｜end▁of▁sentence｜>" not in joined
