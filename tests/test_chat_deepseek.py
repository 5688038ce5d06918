"""DeepSeek-V4/V4.1 encoder behaviour beyond the golden table."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from mlxserve.chat import PromptError, encode_request

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

ARGS: dict[str, Any] = {
    "city": "Zürich",
    "days": 3,
    "opts": {"unit": "celsius", "hourly": [1, 2.5, None, True]},
    "note": '{"looks": "like json"}',
}


def _conversation(arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "reasoning_content": "Call the tool.",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


def _request(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"messages": messages, "tools": TOOLS, "thinking": True, **extra}


@pytest.mark.parametrize("variant", ["v4", "v41"])
@pytest.mark.parametrize(
    "as_string",
    [
        json.dumps(ARGS),
        json.dumps(ARGS, ensure_ascii=False),
        json.dumps(ARGS, indent=2),
        json.dumps(ARGS, separators=(",", ":")),
    ],
)
def test_string_and_decoded_arguments_render_identically(variant: Any, as_string: str) -> None:
    from_dict = encode_request(_request(_conversation(copy.deepcopy(ARGS))), variant)
    from_string = encode_request(_request(_conversation(as_string)), variant)
    assert from_dict == from_string
    # Strings are written verbatim with string="true", everything else as JSON.
    assert 'name="city" string="true">Zürich<' in from_dict
    assert 'name="days" string="false">3<' in from_dict
    assert 'string="false">{"unit": "celsius", "hourly": [1, 2.5, null, true]}<' in from_dict
    assert 'name="note" string="true">{"looks": "like json"}<' in from_dict


@pytest.mark.parametrize("empty", ["", None, "{}", {}])
def test_v4_empty_arguments_mean_no_parameters(empty: Any) -> None:
    prompt = encode_request(_request(_conversation(empty)), "v4")
    assert '<｜DSML｜invoke name="get_weather">\n\n</｜DSML｜invoke>' in prompt


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", "42", '"text"'])
def test_v4_rejects_arguments_that_are_not_a_json_object(bad: str) -> None:
    with pytest.raises(PromptError, match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments"):
        encode_request(_request(_conversation(bad)), "v4")


def test_v41_renders_unparseable_arguments_verbatim() -> None:
    # The V4.1 reference does not reject them (golden enc-pub-0051).
    prompt = encode_request(_request(_conversation("{not json")), "v41")
    assert '<｜DSML｜ parameter name="arguments" string="true">{not json</' in prompt


def test_null_arguments_are_empty_for_v4_and_a_value_for_v41() -> None:
    """V4's wrapper turns `arguments: null` into {}; V4.1's hands null to the encoder,
    which writes a non-object value as one `arguments` parameter, as JSON."""
    v4 = encode_request(_request(_conversation(None)), "v4")
    assert v4 == encode_request(_request(_conversation("{}")), "v4")
    assert '<｜DSML｜invoke name="get_weather">\n\n</｜DSML｜invoke>' in v4
    v41 = encode_request(_request(_conversation(None)), "v41")
    assert '<｜DSML｜ parameter name="arguments" string="false">null</｜DSML｜ parameter>' in v41
    # A call without the key has no arguments in both.
    calls = _conversation("{}")
    del calls[2]["tool_calls"][0]["function"]["arguments"]
    assert encode_request(_request(calls), "v41") == encode_request(
        _request(_conversation("{}")), "v41"
    )


def test_decoded_arguments_must_be_an_object() -> None:
    with pytest.raises(PromptError, match="JSON object"):
        encode_request(_request(_conversation([1, 2])), "v4")


def test_tool_results_follow_the_call_order_not_the_message_order() -> None:
    messages = _conversation("{}")
    messages[2]["tool_calls"] = [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": {}}}
        for i in ("a", "b", "c")
    ]
    messages[3:] = [
        {"role": "tool", "tool_call_id": "c", "content": "C"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "user", "content": "thanks"},
    ]
    prompt = encode_request(_request(messages), "v4")
    expected = (
        "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\n"
        "<tool_result>C</tool_result>\n\nthanks<｜Assistant｜><think>"
    )
    assert prompt.endswith(expected)


def test_empty_tool_list_is_no_tools() -> None:
    messages = [{"role": "user", "content": "hi"}]
    with_empty = encode_request({"messages": messages, "tools": []})
    assert with_empty == encode_request({"messages": messages, "tools": None})
    assert "## Tools" not in with_empty


@pytest.mark.parametrize("effort", ["medium", "minimal", "ultra", 0, 101, True, 2.5])
def test_v41_rejects_unknown_efforts(effort: Any) -> None:
    req = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": effort}
    with pytest.raises(PromptError, match="reasoning_effort"):
        encode_request(req, "v41")


@pytest.mark.parametrize(("effort", "level"), [(1, 1), (100, 100), ("xhigh", 75), (None, 50)])
def test_v41_effort_levels(effort: Any, level: int) -> None:
    req = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": effort}
    assert f"<｜System｜>Reasoning Effort: {level} (range 1-100" in encode_request(req, "v41")


def test_v4_effort_must_be_a_string() -> None:
    req = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": 50}
    with pytest.raises(PromptError, match="reasoning_effort"):
        encode_request(req, "v4")


def test_effort_none_switches_to_chat_mode() -> None:
    req = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"}
    for variant in ("v4", "v41"):
        assert encode_request(req, variant).endswith("<｜Assistant｜></think>")


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": "hi"}, "must be a list"),
        ({"messages": [{"role": "function", "content": "x"}]}, "unknown role 'function'"),
        ({"messages": [{"content": "x"}]}, "unknown role None"),
        ({"messages": [{"role": "user", "content": 5}]}, "content must be"),
        ({"messages": [{"role": "user", "content": "x"}], "thinking": "yes"}, "'thinking'"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, "'tools'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "only text blocks",
        ),
    ],
)
def test_invalid_requests_raise_prompt_error(request_: dict[str, Any], match: str) -> None:
    with pytest.raises(PromptError, match=match):
        encode_request(request_)


def test_unknown_variant() -> None:
    with pytest.raises(PromptError, match="variant"):
        encode_request({"messages": [{"role": "user", "content": "x"}]}, "v5")  # type: ignore[arg-type]


def test_content_list_join_differs_by_variant() -> None:
    blocks = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = {"messages": [{"role": "user", "content": blocks}], "thinking": False}
    assert "<｜User｜>a\nb<｜Assistant｜>" in encode_request(req, "v4")
    assert "<｜User｜>a\n\nb<｜Assistant｜>" in encode_request(req, "v41")


def test_reasoning_alias_and_drop_thinking_false() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning": "Greet back.", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    kept = encode_request({"messages": messages, "drop_thinking": False})
    assert "<｜Assistant｜><think>Greet back.</think>Hello!<｜end▁of▁sentence｜>" in kept
    dropped = encode_request({"messages": messages})
    assert "Greet back." not in dropped
    # Tools force drop-thinking off.
    with_tools = encode_request({"messages": messages, "tools": TOOLS})
    assert "<think>Greet back.</think>Hello!" in with_tools
