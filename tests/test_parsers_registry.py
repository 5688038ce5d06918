"""Parser registry (`resolve_parsers`, presets) and the Hermes/Qwen JSON tool-call parser."""

from __future__ import annotations

import json

import pytest

from mlxserve.parsers import ParserSpec, ToolCallStart, parse_stream, preset, resolve_parsers
from mlxserve.parsers.dsml import DsmlToolParser
from mlxserve.parsers.json_tools import HermesToolParser
from mlxserve.parsers.reasoning import PassthroughParser, ThinkReasoningParser
from mlxserve.parsers.registry import TokenNames


def test_token_names_agree_with_the_whole_vocabulary(loaded_factory) -> None:
    tokenizer = loaded_factory("llama").tokenizer
    vocab = tokenizer.get_vocab()
    names = TokenNames(tokenizer)
    probes = ["</think>", "｜DSML｜", "<tool_call>", "hello", "Ġthe", "<｜begin▁of▁sentence｜>"]
    probes += ["no-such-token-anywhere", ""]
    assert [p in names for p in probes] == [p in vocab for p in probes]
    assert any(p in names for p in probes) and not all(p in names for p in probes)
    assert 5 not in names


@pytest.mark.parametrize(
    ("model_type", "vocab", "expected"),
    [
        ("deepseek_v4", None, ("deepseek_v4", "deepseek_v4")),
        ("deepseek_v41", None, ("deepseek_v41", "deepseek_v41")),
        ("qwen3", None, ("qwen3", "hermes")),
        ("qwen3_moe", {"<think>": 1}, ("qwen3", "hermes")),
        ("deepseek_v3", {"<think>": 1, "</think>": 2}, ("deepseek_r1", "none")),
        ("qwen2", {"<tool_call>": 5, "</tool_call>": 6}, ("none", "hermes")),
        ("llama", {"<think>": 1, "</think>": 2, "<tool_call>": 3}, ("qwen3", "hermes")),
        ("mystery", {"｜DSML｜": 128825}, ("deepseek_v4", "deepseek_v4")),
        ("llama", None, ("none", "none")),
        ("", {}, ("none", "none")),
    ],
)
def test_auto_resolution(
    model_type: str, vocab: dict[str, int] | None, expected: tuple[str, str]
) -> None:
    spec = resolve_parsers(model_type, vocab)
    assert (spec.reasoning, spec.tool) == expected


def test_explicit_names_win_and_unknown_names_fail() -> None:
    spec = resolve_parsers("deepseek_v4", None, reasoning="none", tool="hermes")
    assert (spec.reasoning, spec.tool) == ("none", "hermes")
    with pytest.raises(ValueError):
        resolve_parsers("llama", None, tool="xml")
    with pytest.raises(ValueError):
        ParserSpec(reasoning="bogus")
    with pytest.raises(ValueError):
        preset("bogus")


def test_create_builds_the_right_chain() -> None:
    spec = preset("deepseek_v4")
    chain = spec.create(thinking=True, tools_given=True)
    assert isinstance(chain._reasoning, ThinkReasoningParser)
    assert isinstance(chain._tool, DsmlToolParser)
    chain = spec.create(thinking=False, tools_given=False)
    assert isinstance(chain._reasoning, PassthroughParser) and chain._tool is None
    assert isinstance(
        preset("qwen3").create(thinking=True, tools_given=True)._tool, HermesToolParser
    )
    assert spec.strip == ("<｜end▁of▁sentence｜>",)


# --- Hermes / Qwen JSON tool calls ------------------------------------------

CALL = (
    '<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris </tool_call> \\"x\\" {"}}\n</tool_call>'
)
CALL_PARSED = {"name": "get_weather", "arguments": {"city": 'Paris </tool_call> "x" {'}}


def sweep(text: str, **kwargs: object) -> dict[str, object]:
    results = []
    for size in (1, 2, 3, 5, 8, 13, len(text) or 1):
        deltas = [text[i : i + size] for i in range(0, len(text), size)]
        results.append(parse_stream(deltas, **kwargs))  # type: ignore[arg-type]
    assert all(r == results[0] for r in results)
    return results[0]


def test_qwen3_reasoning_content_and_calls() -> None:
    text = "<think>plan</think>\n\nLooking it up.\n" + CALL + "\n" + CALL + "<|im_end|>"
    got = sweep(text, parser="qwen3", thinking=True, tools_given=True)
    assert got == {
        "reasoning_content": "plan",
        "content": "\n\nLooking it up.",
        "tool_calls": [CALL_PARSED, CALL_PARSED],
    }


def test_hermes_arguments_as_json_string_and_missing() -> None:
    args = json.dumps(json.dumps({"q": 1}))
    text = f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>'
    text += '<tool_call>{"name": "g"}</tool_call>'
    got = sweep(text, parser="hermes", thinking=False, tools_given=True)
    assert got["tool_calls"] == [
        {"name": "f", "arguments": {"q": 1}},
        {"name": "g", "arguments": {}},
    ]
    assert got["content"] is None


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": 1}',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"y": 1e999}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{\\"z\\": -Infinity}"}</tool_call>',
    ],
)
def test_hermes_malformed_stays_content(bad: str) -> None:
    text = "Hi\n" + bad
    got = sweep(text, parser="hermes", thinking=False, tools_given=True)
    assert got == {"reasoning_content": None, "content": text, "tool_calls": []}


def test_hermes_malformed_then_valid() -> None:
    text = "<tool_call>oops</tool_call> then\n" + CALL
    got = sweep(text, parser="hermes", thinking=False, tools_given=True)
    assert got["content"] == "<tool_call>oops</tool_call> then"
    assert got["tool_calls"] == [CALL_PARSED]


def test_qwen3_reasoning_hands_off_to_tool_call() -> None:
    got = sweep("thinking\n" + CALL, parser="qwen3", thinking=True, tools_given=True)
    assert got == {"reasoning_content": "thinking", "content": None, "tool_calls": [CALL_PARSED]}


def test_hermes_call_ids_and_indices() -> None:
    chain = preset("hermes").create(thinking=False, tools_given=True)
    events = chain.feed(CALL + CALL) + chain.finish()
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == [0, 1] and starts[0].id != starts[1].id


def test_none_preset_is_plain_text() -> None:
    text = "<think>a</think>" + CALL
    got = parse_stream([text], parser="none", thinking=True, tools_given=True)
    assert got == {"reasoning_content": None, "content": text, "tool_calls": []}
