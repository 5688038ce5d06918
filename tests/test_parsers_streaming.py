"""Tool-call arguments stream as they are generated, and the fragments add up exactly.

The DSML parsers convert parameters to JSON piece by piece (a string value
as it arrives, other values when complete); the Hermes parser passes the
arguments object's text on as it comes. At every split of the text the
fragments of a call concatenate to its final `arguments_json`, and a call
streamed from a block that turns out malformed is discarded, its text given
back as content.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxserve.parsers import (
    ContentDelta,
    ParserEvent,
    ToolCallArgs,
    ToolCallDiscard,
    ToolCallEnd,
    ToolCallStart,
    accumulate,
    preset,
)
from mlxserve.parsers.dsml import DSML_V4, DSML_V41, DsmlDialect

LONG = 'line "one"\n\tback\\slash </tag> ｜DSML｜ ' * 20


def dsml_call(d: DsmlDialect, name: str, params: list[tuple[str, bool, str]]) -> str:
    body = "".join(
        f'{d.param_open}{k}" string="{"true" if s else "false"}">{v}{d.param_close}\n'
        for k, s, v in params
    )
    return f'{d.invoke_open}{name}">\n{body}{d.invoke_close}\n'


def dsml_block(d: DsmlDialect, *invokes: str) -> str:
    return f"\n\n{d.open}\n" + "".join(invokes) + d.close


def feed(parser: str, pieces: list[str], tools: bool = True) -> list[list[ParserEvent]]:
    chain = preset(parser).create(thinking=False, tools_given=tools)
    return [chain.feed(p) for p in pieces] + [chain.finish()]


def flat(batches: list[list[ParserEvent]]) -> list[ParserEvent]:
    return [e for batch in batches for e in batch]


def args_of(events: list[ParserEvent], index: int) -> str:
    return "".join(e.arguments for e in events if isinstance(e, ToolCallArgs) and e.index == index)


def check_fragments(events: list[ParserEvent]) -> None:
    """Each completed call's fragments are its arguments text, byte for byte."""
    for end in (e for e in events if isinstance(e, ToolCallEnd)):
        assert args_of(events, end.index) == end.arguments_json
        assert json.loads(end.arguments_json) == end.arguments


def test_a_long_string_argument_streams_in_pieces_before_the_block_closes() -> None:
    for parser, d in (("deepseek_v4", DSML_V4), ("deepseek_v41", DSML_V41)):
        call = dsml_call(d, "write", [("path", True, "a.txt"), ("text", True, LONG)])
        text = "Writing." + dsml_block(d, call)
        batches = feed(parser, [text[i : i + 7] for i in range(0, len(text), 7)])
        closing = next(
            i for i, b in enumerate(batches) if any(isinstance(e, ToolCallEnd) for e in b)
        )
        early = [e for b in batches[:closing] for e in b if isinstance(e, ToolCallArgs)]
        assert len(early) >= 10
        events = flat(batches)
        check_fragments(events)
        end = next(e for e in events if isinstance(e, ToolCallEnd))
        assert end.arguments == {"path": "a.txt", "text": LONG}
        assert end.arguments_json == json.dumps(end.arguments, ensure_ascii=False)
        # The first event of the call names it, before any of its arguments.
        start = next(i for i, e in enumerate(events) if isinstance(e, ToolCallStart))
        assert events[start] == ToolCallStart(0, end.id, "write")
        assert all(not isinstance(e, ToolCallArgs) for e in events[:start])
        assert accumulate(events)["content"] == "Writing."


def test_json_values_stream_when_complete_and_keys_keep_their_order() -> None:
    d = DSML_V4
    call = dsml_call(
        d, "f", [("z", False, ' {"k": [1, 2.5, null]} '), ("a", True, ""), ("m", False, "true")]
    )
    events = flat(feed("deepseek_v4", list(dsml_block(d, call))))
    check_fragments(events)
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.arguments_json == '{"z": {"k": [1, 2.5, null]}, "a": "", "m": true}'


def test_an_invoke_without_parameters_has_empty_object_arguments() -> None:
    events = flat(feed("deepseek_v4", list(dsml_block(DSML_V4, dsml_call(DSML_V4, "noop", [])))))
    assert args_of(events, 0) == "{}"
    check_fragments(events)


def test_a_cut_off_block_discards_its_streamed_calls_and_gives_back_the_text() -> None:
    d = DSML_V4
    text = dsml_block(
        d, dsml_call(d, "a", [("x", True, "1")]), dsml_call(d, "b", [("y", True, "2")])
    )
    cut = text[: text.index("</｜DSML｜invoke>", text.index('name="b"'))]
    events = flat(feed("deepseek_v4", list(cut)))
    starts = [e.index for e in events if isinstance(e, ToolCallStart)]
    assert starts == [0, 1]
    assert [e.index for e in events if isinstance(e, ToolCallDiscard)] == [0, 1]
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    assert accumulate(events) == {"reasoning_content": None, "content": cut, "tool_calls": []}


def test_indices_are_not_reused_after_a_discard() -> None:
    d = DSML_V4
    bad = f"\n\n{d.open}\n" + dsml_call(d, "a", [("x", True, "1")]) + "oops"
    good = dsml_block(d, dsml_call(d, "b", [("y", False, "2")]))
    events = flat(feed("deepseek_v4", list(bad + good)))
    assert [e.index for e in events if isinstance(e, ToolCallDiscard)] == [0]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [(e.index, e.name) for e in ends] == [(1, "b")]
    check_fragments(events)
    assert accumulate(events)["content"] == bad


# -- Hermes ---------------------------------------------------------------------

KEYS = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)
ARGS = st.dictionaries(KEYS, VALUES, max_size=4)
STYLES = [
    {},
    {"indent": 2},
    {"separators": (",", ":")},
    {"ensure_ascii": False},
]


def hermes_call(name: str, args: dict[str, Any], style: dict[str, Any], key: str) -> str:
    name_part = json.dumps(name)
    return (
        f'<tool_call>\n{{"name": {name_part}, "{key}": {json.dumps(args, **style)}}}\n</tool_call>'
    )


@settings(max_examples=80, deadline=None)
@given(
    args=ARGS,
    style=st.sampled_from(STYLES),
    key=st.sampled_from(["arguments", "parameters"]),
    points=st.lists(st.integers(0, 600), max_size=30),
)
def test_hermes_arguments_stream_verbatim_at_every_split(
    args: dict[str, Any], style: dict[str, Any], key: str, points: list[int]
) -> None:
    text = (
        "Hi." + hermes_call("get_weather", args, style, key) + "\n" + hermes_call("f", {}, {}, key)
    )
    marks = sorted({min(p, len(text)) for p in points} | {0, len(text)})
    batches = feed("hermes", [text[a:b] for a, b in zip(marks, marks[1:], strict=False)])
    events = flat(batches)
    check_fragments(events)
    got = accumulate(events)
    assert got["tool_calls"] == [
        {"name": "get_weather", "arguments": args},
        {"name": "f", "arguments": {}},
    ]
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert end.arguments_json == json.dumps(args, **style)
    assert not any(isinstance(e, ToolCallDiscard) for e in events)


def test_hermes_call_streams_before_it_closes() -> None:
    text = hermes_call("write", {"text": LONG}, {}, "arguments")
    batches = feed("hermes", [text[i : i + 5] for i in range(0, len(text), 5)])
    closing = next(i for i, b in enumerate(batches) if any(isinstance(e, ToolCallEnd) for e in b))
    early = [e for b in batches[:closing] for e in b if isinstance(e, ToolCallArgs)]
    assert len(early) >= 10
    check_fragments(flat(batches))


def test_hermes_other_shapes_are_emitted_whole() -> None:
    for body in (
        '{"arguments": {"a": 1}, "name": "f"}',
        '{"name": "f", "arguments": "{\\"a\\": 1}"}',
    ):
        events = flat(feed("hermes", list(f"<tool_call>{body}</tool_call>")))
        check_fragments(events)
        assert accumulate(events)["tool_calls"] == [{"name": "f", "arguments": {"a": 1}}]


def test_hermes_malformed_call_after_streaming_is_discarded() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing</tool_call>'
    events = flat(feed("hermes", list(text)))
    assert [e.index for e in events if isinstance(e, ToolCallDiscard)] == [0]
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == text
