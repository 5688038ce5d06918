"""DSML: DeepSeek's markup for tools in the prompt (schemas and past tool calls).

V4 writes `<｜DSML｜tool_calls>`, `<｜DSML｜invoke ...>`; V4.1 puts a space
after the DSML marker and shortens the block name: `<｜DSML｜ calls>`,
`<｜DSML｜ invoke ...>`. Everything else is shared.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlxserve.chat.messages import PromptError, ToolCall


@dataclass(frozen=True)
class Dsml:
    """The spelling of DSML tags in one format version."""

    marker: str  # "｜DSML｜" (V4) or "｜DSML｜ " (V4.1)
    block: str  # "tool_calls" (V4) or "calls" (V4.1)

    def tag(self, name: str) -> str:
        return f"<{self.marker}{name}"

    def close(self, name: str) -> str:
        return f"</{self.marker}{name}>"


V4_DSML = Dsml(marker="｜DSML｜", block="tool_calls")
V41_DSML = Dsml(marker="｜DSML｜ ", block="calls")

_TOOLS_INTRO = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. "
    'You can invoke tools by writing a "{open}" block like the following:\n\n'
)
_TOOLS_RULES = (
    'String parameters should be specified as is and set `string="true"`. '
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON "
    'format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_OUTRO = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas "
    "to invoke tool calls.\n"
)


def to_json(value: Any) -> str:
    """JSON as the reference writes it: `", "`/`": "` separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def tool_schemas(tools: Sequence[Any]) -> list[Mapping[str, Any]]:
    """The function objects of an OpenAI tool list (`{"type", "function"}` or bare)."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise PromptError("'tools' must be a list of tool objects")
    schemas: list[Mapping[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise PromptError(f"tools[{i}] must be an object")
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise PromptError(f"tools[{i}].function must be an object with a string 'name'")
        schemas.append(fn)
    return schemas


def render_tools(dsml: Dsml, schemas: Sequence[Mapping[str, Any]]) -> str:
    """The `## Tools` section (without the blank line that separates it)."""
    example = "\n".join(
        [
            dsml.tag(dsml.block) + ">",
            dsml.tag('invoke name="$TOOL_NAME">'),
            dsml.tag('parameter name="$PARAMETER_NAME" string="true|false">')
            + "$PARAMETER_VALUE"
            + dsml.close("parameter"),
            "...",
            dsml.close("invoke"),
            dsml.tag('invoke name="$TOOL_NAME2">'),
            "...",
            dsml.close("invoke"),
            dsml.close(dsml.block),
        ]
    )
    lines = "\n".join(to_json(dict(s)) for s in schemas)
    intro = _TOOLS_INTRO.format(open=dsml.tag(dsml.block) + ">")
    return intro + example + "\n\n" + _TOOLS_RULES + lines + _TOOLS_OUTRO


def render_tool_calls(dsml: Dsml, calls: Sequence[ToolCall]) -> str:
    """A past assistant's tool calls as one DSML block (no leading blank line)."""
    m = dsml.marker
    invokes = [_render_invoke(m, call) for call in calls]
    return f"<{m}{dsml.block}>\n" + "\n".join(invokes) + f"\n</{m}{dsml.block}>"


def _render_invoke(m: str, call: ToolCall) -> str:
    if call.arguments is not None:
        items = list(call.arguments.items())
    elif call.arguments_text is not None:
        # Arguments that are not a JSON object (V4.1 only): one string parameter.
        items = [("arguments", call.arguments_text)]
    else:
        raise PromptError(f"tool call {call.name!r} has no usable arguments")
    params = "\n".join(
        f'<{m}parameter name="{key}" string="true">{value}</{m}parameter>'
        if isinstance(value, str)
        else f'<{m}parameter name="{key}" string="false">{to_json(value)}</{m}parameter>'
        for key, value in items
    )
    return f'<{m}invoke name="{call.name}">\n{params}\n</{m}invoke>'
