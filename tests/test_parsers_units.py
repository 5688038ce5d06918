"""DSML tool parser, think-tag reasoning parser and their chain: focused cases."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxserve.parsers import (
    ContentDelta,
    OutputParser,
    ParserEvent,
    ReasoningDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    accumulate,
    parse_stream,
    preset,
)
from mlxserve.parsers.dsml import DSML_V4, DSML_V41, DsmlDialect, DsmlToolParser
from mlxserve.parsers.reasoning import Handoff, ThinkReasoningParser

EOS = "<｜end▁of▁sentence｜>"


def block(calls: list[tuple[str, dict[str, tuple[bool, str]]]], d: DsmlDialect = DSML_V4) -> str:
    invokes = []
    for name, params in calls:
        body = "\n".join(
            f'{d.param_open}{k}" string="{"true" if s else "false"}">{v}{d.param_close}'
            for k, (s, v) in params.items()
        )
        invokes.append(f'{d.invoke_open}{name}">\n{body}\n{d.invoke_close}')
    return f"\n\n{d.open}\n" + "\n".join(invokes) + f"\n{d.close}"


WEATHER = block([("get_weather", {"city": (True, "Paris"), "days": (False, "3")})])
WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}


def feed_all(chain: OutputParser, deltas: list[str]) -> list[list[ParserEvent]]:
    """Events per feed() call, then finish()'s events as the last entry."""
    return [chain.feed(d) for d in deltas] + [chain.finish()]


def flat(batches: list[list[ParserEvent]]) -> list[ParserEvent]:
    return [e for batch in batches for e in batch]


def chars(text: str) -> list[str]:
    return list(text)


def test_text_and_whole_block_in_one_delta_emit_content_then_call() -> None:
    chain = preset("deepseek_v4").create(thinking=False, tools_given=True)
    events = chain.feed("Sure." + WEATHER)
    assert isinstance(events[0], ContentDelta) and events[0].text == "Sure."
    assert [type(e) for e in events[1:]] == [ToolCallStart, ToolCallArgs, ToolCallEnd]
    assert chain.finish() == []


def test_marker_tail_is_held_back_and_never_emitted_in_pieces() -> None:
    chain = preset("deepseek_v4").create(thinking=False, tools_given=True)
    assert chain.feed("Hello\n") == [ContentDelta("Hello")]
    assert chain.feed("\n<｜DSML｜tool") == []
    assert chain.feed("_calls>\n<｜DSML｜invoke name=") == []
    rest = WEATHER[len('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="') - 1 :]
    events = chain.feed(rest)
    assert accumulate(events)["tool_calls"] == [WEATHER_CALL]
    assert not any(isinstance(e, ContentDelta) for e in events)


def test_false_alarm_tail_is_released_as_content() -> None:
    chain = preset("deepseek_v4").create(thinking=False, tools_given=True)
    assert chain.feed("a <｜DSML｜") == [ContentDelta("a ")]
    assert chain.feed("x and more") == [ContentDelta("<｜DSML｜x and more")]


def test_truncated_block_comes_back_verbatim_at_finish() -> None:
    text = "Before" + WEATHER[:-5]
    chain = preset("deepseek_v4").create(thinking=False, tools_given=True)
    batches = feed_all(chain, chars(text))
    assert accumulate(flat(batches)) == {
        "reasoning_content": None,
        "content": text,
        "tool_calls": [],
    }
    assert accumulate(flat(batches[:-1]))["content"] == "Before"


@pytest.mark.parametrize(
    "broken",
    [
        WEATHER.replace('string="false">3', 'string="false">NaN'),
        WEATHER.replace('string="false">3', 'string="false">1e400'),
        WEATHER.replace('string="false">3', 'string="false">[-Infinity]'),
        WEATHER.replace('string="false">3', 'string="false">'),
        WEATHER.replace('string="false">3', 'string="maybe">3'),
        WEATHER.replace('name="get_weather"', 'name=""'),
        WEATHER.replace("</｜DSML｜invoke>", "</｜DSML｜invoke>x"),
        "\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>",
        WEATHER.replace('name="days"', 'name="city"'),
    ],
    ids=[
        "nan",
        "overflow",
        "infinity",
        "empty-json",
        "bad-flag",
        "empty-name",
        "junk",
        "no-invoke",
        "dup-param",
    ],
)
def test_malformed_blocks_stay_content(broken: str) -> None:
    for deltas in (chars(broken), [broken]):
        got = parse_stream(deltas, thinking=False, tools_given=True)
        assert got == {"reasoning_content": None, "content": broken, "tool_calls": []}


def test_malformed_block_then_valid_block() -> None:
    bad = WEATHER.replace("\n<｜DSML｜invoke", "\njunk<｜DSML｜invoke")
    text = "A" + bad + " B" + WEATHER + "C" + EOS
    for size in (1, 2, 7, len(text)):
        deltas = [text[i : i + size] for i in range(0, len(text), size)]
        got = parse_stream(deltas, thinking=False, tools_given=True)
        assert got == {
            "reasoning_content": None,
            "content": "A" + bad + " BC",
            "tool_calls": [WEATHER_CALL],
        }


def test_indices_and_ids_across_blocks() -> None:
    text = WEATHER + "between" + WEATHER
    events = flat(
        feed_all(preset("deepseek_v4").create(thinking=False, tools_given=True), chars(text))
    )
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [s.index for s in starts] == [0, 1] == [e.index for e in ends]
    assert [s.id for s in starts] == [e.id for e in ends] and starts[0].id != starts[1].id
    assert accumulate(events)["content"] == "between"


def test_string_values_may_hold_markup_and_closing_tags() -> None:
    tricky = (
        'x</｜DSML｜parameter>y <｜DSML｜tool_calls> </｜DSML｜tool_calls>\n</think> "q" <a>\n'
        '</｜DSML｜parameter></｜DSML｜invoke {"k": 1}'
    )
    text = block([("edit", {"new": (True, tricky), "obj": (False, '{"a": "</｜DSML｜invoke>"}')})])
    for deltas in (chars(text), [text]):
        got = parse_stream(deltas, thinking=False, tools_given=True)
        args = got["tool_calls"][0]["arguments"]
        assert args == {"new": tricky, "obj": {"a": "</｜DSML｜invoke>"}}
        assert got["content"] is None


def test_whitespace_between_tags_is_free() -> None:
    text = WEATHER.replace("\n<｜DSML｜parameter", " \t\r\n  <｜DSML｜parameter")
    assert parse_stream([text], thinking=False, tools_given=True)["tool_calls"] == [WEATHER_CALL]


def test_v41_dialect_and_v4_spelling() -> None:
    v41 = block([("get_weather", {"city": (True, "Paris"), "days": (False, "3")})], DSML_V41)
    for parser in ("deepseek_v41",):
        for text in (v41, WEATHER):
            got = parse_stream(chars(text), parser=parser, thinking=False, tools_given=True)
            assert got["tool_calls"] == [WEATHER_CALL] and got["content"] is None
    got = parse_stream([v41], parser="deepseek_v4", thinking=False, tools_given=True)
    assert got == {"reasoning_content": None, "content": v41, "tool_calls": []}


def test_v41_thinking_handoff_without_think_end() -> None:
    v41 = block([("get_weather", {"city": (True, "Paris"), "days": (False, "3")})], DSML_V41)
    got = parse_stream(
        chars("Need weather." + v41), parser="deepseek_v41", thinking=True, tools_given=True
    )
    assert got == {
        "reasoning_content": "Need weather.",
        "content": None,
        "tool_calls": [WEATHER_CALL],
    }


def test_tool_parser_alone_matches_chain() -> None:
    parser = DsmlToolParser()
    events: list[ParserEvent] = []
    for c in "Hi" + WEATHER:
        events += parser.feed(c)
    events += parser.finish()
    assert accumulate(events) == {
        "reasoning_content": None,
        "content": "Hi",
        "tool_calls": [WEATHER_CALL],
    }


# --- reasoning ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>abc</think>x", "abc", "x"),
        ("abc</think>x", "abc", "x"),
        ("<thinking is fun", "<thinking is fun", None),
        ("<th", "<th", None),
        ("a</thi", "a</thi", None),
        ("</think></think>", None, "</think>"),
        ("r\n\n</think>\n\nc\n", "r\n\n", "\n\nc\n"),
    ],
)
def test_think_tags(text: str, reasoning: str | None, content: str | None) -> None:
    for parser in ("deepseek_v4", "qwen3", "deepseek_r1"):
        for deltas in (chars(text), [text]):
            got = parse_stream(deltas, parser=parser, thinking=True, tools_given=False)
            assert (got["reasoning_content"], got["content"]) == (reasoning, content)


def test_chat_mode_is_all_content() -> None:
    text = "<think>a</think>b"
    got = parse_stream(chars(text), thinking=False, tools_given=False)
    assert got == {"reasoning_content": None, "content": text, "tool_calls": []}


def test_dsml_in_reasoning_without_tools_stays_reasoning() -> None:
    got = parse_stream(chars("r" + WEATHER), thinking=True, tools_given=False)
    assert got == {"reasoning_content": "r" + WEATHER, "content": None, "tool_calls": []}


def test_handoff_to_a_malformed_block_keeps_it_as_content() -> None:
    bad = WEATHER.replace("\n<｜DSML｜invoke", "\njunk<｜DSML｜invoke")
    got = parse_stream(chars("r" + bad), thinking=True, tools_given=True)
    assert got == {"reasoning_content": "r", "content": bad, "tool_calls": []}


def test_reasoning_parser_holds_only_possible_markers() -> None:
    parser = ThinkReasoningParser(handoff=Handoff(("<｜DSML｜tool_calls>",), "\n\n"))
    assert parser.feed("abc <") == [ReasoningDelta("abc ")]
    assert parser.feed("b> \n") == [ReasoningDelta("<b> ")]
    assert parser.feed("\n<｜DSML｜tool_calls>x") == [ContentDelta("\n\n<｜DSML｜tool_calls>x")]
    assert parser.feed("y") == [ContentDelta("y")]


def test_eos_is_stripped_even_split() -> None:
    got = parse_stream(["Hi<｜end▁of", "▁sentence｜>"], thinking=False, tools_given=True)
    assert got["content"] == "Hi"
    got = parse_stream(["r<｜end", "▁of▁sentence｜>"], thinking=True, tools_given=False)
    assert got["reasoning_content"] == "r"
    got = parse_stream(["Hi<｜end▁of"], thinking=False, tools_given=True)
    assert got["content"] == "Hi<｜end▁of"


def test_each_request_owns_its_state() -> None:
    spec = preset("deepseek_v4")
    a = spec.create(thinking=True, tools_given=True)
    b = spec.create(thinking=False, tools_given=True)
    assert a.feed("thought") == [ReasoningDelta("thought")]
    assert b.feed("words") == [ContentDelta("words")]
    assert a.feed("</think>x") == [ContentDelta("x")]


def test_feed_after_finish_is_an_error() -> None:
    chain = preset("deepseek_v4").create(thinking=False, tools_given=False)
    chain.finish()
    with pytest.raises(RuntimeError):
        chain.feed("x")
    assert chain.finish() == []


# --- work per delta ---------------------------------------------------------


def _pending(chain: OutputParser) -> int:
    """Characters the chain's stages hold in their working buffers (test-only peek)."""
    total = len(chain._stripper._buf) + len(getattr(chain._reasoning, "_buf", ""))
    tool: Any = chain._tool
    if tool is not None:
        total += len(tool._buf)
        if tool._scanner is not None:
            total += len(tool._scanner._buf) - tool._scanner._pos
    return total


def test_working_buffers_stay_small_on_long_streams() -> None:
    long_value = ("line with <tags> and </｜DSML｜parameter text \n" * 400)[:12000]
    text = (
        "reasoning " * 800
        + "</think>"
        + "content words\n" * 500
        + block(
            [("write", {"body": (True, long_value), "n": (False, json.dumps(list(range(500))))})]
        )
    )
    chain = preset("deepseek_v4").create(thinking=True, tools_given=True)
    worst = 0
    events: list[ParserEvent] = []
    for i in range(0, len(text), 3):
        events += chain.feed(text[i : i + 3])
        worst = max(worst, _pending(chain))
    events += chain.finish()
    assert worst < 64
    got = accumulate(events)
    assert got["tool_calls"][0]["arguments"]["body"] == long_value
