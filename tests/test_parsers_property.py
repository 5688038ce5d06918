"""Property: random valid DSML tool calls round-trip through the chain at random split points."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mlxserve.parsers import ToolCallArgs, ToolCallEnd, ToolCallStart, accumulate, preset
from mlxserve.parsers.dsml import DSML_V4, DSML_V41, DsmlDialect

EOS = "<｜end▁of▁sentence｜>"
FRAGMENTS = [
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    '<｜DSML｜invoke name="x">',
    "</｜DSML｜invoke>",
    '<｜DSML｜parameter name="a" string="true">',
    "</｜DSML｜parameter>",
    "<｜DSML｜ calls>",
    "</｜DSML｜ parameter>",
    "｜DSML｜",
    "<｜DSML｜",
    "</think>",
    "<think>",
    "<tool_call>",
    '{"k": [1, "v"]}',
    '"',
    "'",
    "<",
    ">",
    "\n",
    "\n\n",
    "&amp;",
    "\\",
    "<｜end▁of",
]
PLAIN = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
MARKUPISH = st.lists(st.one_of(PLAIN, st.sampled_from(FRAGMENTS)), max_size=6).map("".join)
NAMES = st.text(
    alphabet=st.characters(
        codec="utf-8", exclude_categories=["Cs", "Cc"], exclude_characters='"<>'
    ),
    min_size=1,
    max_size=16,
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | MARKUPISH,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(MARKUPISH, inner, max_size=3),
    max_leaves=6,
)
PARAM = st.one_of(
    st.tuples(st.just(True), MARKUPISH),
    st.tuples(st.just(False), JSON_VALUES),
)
CALL = st.tuples(NAMES, st.dictionaries(NAMES, PARAM, max_size=4))
BLOCK = st.lists(CALL, min_size=1, max_size=3)


def value_end(d: DsmlDialect) -> re.Pattern[str]:
    """A parameter close followed by what really ends a value (ambiguous inside a value)."""
    close, nxt, inv = (re.escape(t) for t in (d.param_close, d.param_open, d.invoke_close))
    return re.compile(f"{close}[ \t\r\n]*({nxt}|{inv})")


def render_param(d: DsmlDialect, key: str, param: tuple[bool, Any]) -> str:
    is_string, value = param
    text = value if is_string else json.dumps(value, ensure_ascii=False)
    flag = "true" if is_string else "false"
    return f'{d.param_open}{key}" string="{flag}">{text}{d.param_close}'


def render_block(d: DsmlDialect, calls: list[tuple[str, dict[str, Any]]]) -> str:
    invokes = []
    for name, params in calls:
        body = "\n".join(render_param(d, k, p) for k, p in params.items())
        invokes.append(f'{d.invoke_open}{name}">\n{body}\n{d.invoke_close}')
    return f"\n\n{d.open}\n" + "\n".join(invokes) + f"\n{d.close}"


def values_clean(d: DsmlDialect, calls: list[tuple[str, dict[str, Any]]]) -> bool:
    """No rendered value holds text that would end it early (or the EOS text)."""
    pattern = value_end(d)
    for _, params in calls:
        for is_string, value in params.values():
            text = value if is_string else json.dumps(value, ensure_ascii=False)
            if EOS in text or pattern.search(text):
                return False
    return True


def cuts(text: str, points: list[int]) -> list[str]:
    marks = sorted({min(p, len(text)) for p in points} | {0, len(text)})
    return [text[a:b] for a, b in zip(marks, marks[1:], strict=False)]


def run(parser: str, text: str, points: list[int], thinking: bool) -> dict[str, Any]:
    chain = preset(parser).create(thinking=thinking, tools_given=True)
    events = []
    for delta in cuts(text, points):
        events += chain.feed(delta)
    events += chain.finish()
    for end in (e for e in events if isinstance(e, ToolCallEnd)):
        args = "".join(
            e.arguments for e in events if isinstance(e, ToolCallArgs) and e.index == end.index
        )
        assert args == end.arguments_json and json.loads(args) == end.arguments
    assert len({e.id for e in events if isinstance(e, ToolCallStart)}) == sum(
        isinstance(e, ToolCallStart) for e in events
    )
    return accumulate(events)


def expected_calls(blocks: list[list[tuple[str, dict[str, Any]]]]) -> list[dict[str, Any]]:
    return [
        {"name": name, "arguments": {k: v for k, (_, v) in params.items()}}
        for block in blocks
        for name, params in block
    ]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dialect=st.sampled_from([("deepseek_v4", DSML_V4), ("deepseek_v41", DSML_V41)]),
    texts=st.lists(MARKUPISH, min_size=1, max_size=3),
    blocks=st.lists(BLOCK, min_size=1, max_size=2),
    points=st.lists(st.integers(0, 4000), max_size=40),
    data=st.data(),
)
def test_chat_mode_round_trip(
    dialect: tuple[str, DsmlDialect],
    texts: list[str],
    blocks: list[list[tuple[str, dict[str, Any]]]],
    points: list[int],
    data: st.DataObject,
) -> None:
    parser, d = dialect
    rendered = [render_block(d, block) for block in blocks]
    contents = (texts + [""] * len(blocks))[: len(blocks) + 1]
    text = contents[0] + "".join(r + c for r, c in zip(rendered, contents[1:], strict=True))
    assume(all(values_clean(d, block) for block in blocks))
    assume(all(d.open not in part and EOS not in part for part in contents))
    if data.draw(st.booleans(), label="eos"):
        text += EOS
    got = run(parser, text, points, thinking=False)
    assert got == {
        "reasoning_content": None,
        "content": "".join(contents) or None,
        "tool_calls": expected_calls(blocks),
    }


REASONING = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40
).filter(lambda s: "</think>" not in s and "｜" not in s and not s.startswith("<think"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reasoning=REASONING,
    think_end=st.booleans(),
    leading_think=st.booleans(),
    block=BLOCK,
    points=st.lists(st.integers(0, 3000), max_size=40),
)
def test_thinking_mode_round_trip(
    reasoning: str,
    think_end: bool,
    leading_think: bool,
    block: list[tuple[str, dict[str, Any]]],
    points: list[int],
) -> None:
    rendered = render_block(DSML_V4, block)
    assume(values_clean(DSML_V4, block))
    text = ("<think>" if leading_think else "") + reasoning
    text += ("</think>" if think_end else "") + rendered
    got = run("deepseek_v4", text, points, thinking=True)
    assert got == {
        "reasoning_content": reasoning or None,
        "content": None,
        "tool_calls": expected_calls([block]),
    }


@settings(max_examples=60, deadline=None)
@given(
    text=st.lists(st.one_of(PLAIN, st.sampled_from([*FRAGMENTS, EOS])), max_size=30).map("".join),
    thinking=st.booleans(),
    points=st.lists(st.integers(0, 500), max_size=30),
)
def test_arbitrary_text_is_split_invariant_and_lossless(
    text: str, thinking: bool, points: list[int]
) -> None:
    whole = run("deepseek_v4", text, [], thinking=thinking)
    assert run("deepseek_v4", text, points, thinking=thinking) == whole
    if not whole["tool_calls"]:
        kept = (whole["reasoning_content"] or "") + (whole["content"] or "")
        assert kept.replace("<think>", "").replace("</think>", "") == text.replace(EOS, "").replace(
            "<think>", ""
        ).replace("</think>", "")
