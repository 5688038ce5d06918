"""Grammars for structured output: a JSON schema, or tool calls in the model's own syntax.

Pure functions from what a request asks for (`OutputConstraint`) to an
llguidance grammar (its serialized form, a string the engine's matcher takes):

- `json_schema`: the answer is one JSON value valid under the schema.
- tool calls: one or more calls (one with `parallel=False`) of the allowed
  tools, written in DSML for DeepSeek-V4/V4.1 or as Hermes `<tool_call>` JSON,
  each call's arguments valid under that tool's `parameters` schema.
- optional calls (`tool_choice: auto` with `strict` functions): free text, and
  once the model opens a call block the grammar takes over (a lazy grammar:
  text up to the block's opening marker is free). Strict functions' arguments
  follow their schema; other functions may be called with any parameters.

A schema the library cannot compile is a `StructuredOutputError` naming the
problem (the API answers 400).

`answer_constraint` is the one mapping from a request's `tool_choice` (each
dialect spells it its own way and converts it to `ToolChoice`) and JSON
format to the `OutputConstraint` the grammar is built from.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from mlxserve.api.errors import APIError
from mlxserve.api.raw_strings import is_raw_string, literal, raw_terminal, regex_literal
from mlxserve.parsers.dsml import DSML_LEAD, DSML_V4, DSML_V41, DsmlDialect

MAX_SCHEMA_BYTES = 64 * 1024
# The DSML spelling the tool parsers read, by tool parser name.
_DSML = {"deepseek_v4": DSML_V4, "deepseek_v41": DSML_V41}
_REF_KEYS = ("$defs", "definitions")
# Compact JSON as `json.dumps` writes it: no free whitespace, which a weak model
# would otherwise fill forever.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` wherever an object leaves it open.

    Every output valid under the closed schema is valid under the original; the
    closed one keeps a model from inventing keys forever. Branches of `allOf` are
    left alone (closing them would exclude each other's keys).
    """
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {
        k: (v if k in ("allOf", "enum", "const", "default", "examples") else _closed(v))
        for k, v in schema.items()
    }
    if "properties" in out and "additionalProperties" not in out and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def _compact(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**_closed(schema), "x-guidance": _JSON_OPTIONS}


class StructuredOutputError(ValueError):
    """The requested structure cannot be enforced; the message says why."""


@dataclass(frozen=True)
class OutputConstraint:
    """What a request's answer must be: JSON under `json_schema`, or calls of `tools`.

    `optional`: calls may be made or not (free text until a call block opens).
    """

    json_schema: Mapping[str, Any] | None = None
    tools: tuple[Mapping[str, Any], ...] = ()  # OpenAI function objects allowed
    parallel: bool = True
    optional: bool = False


def forced_calls(
    tools: Sequence[Mapping[str, Any]] | None, name: str | None, parallel: bool
) -> OutputConstraint:
    """A constraint to call one of `tools` (OpenAI tool dicts), or only the one named."""
    functions = [t.get("function", t) for t in tools or ()]
    if name is not None:
        functions = [f for f in functions if f.get("name") == name]
    return OutputConstraint(tools=tuple(functions), parallel=parallel)


def strict_calls(
    tools: Sequence[Mapping[str, Any]] | None, parallel: bool
) -> OutputConstraint | None:
    """For `tool_choice: auto`: calls stay optional, strict functions' arguments are enforced.

    None when no function asks for `strict` (nothing to enforce).
    """
    functions = tuple(t.get("function", t) for t in tools or ())
    if not any(f.get("strict") is True for f in functions):
        return None
    return OutputConstraint(tools=functions, parallel=parallel, optional=True)


@dataclass(frozen=True)
class ToolChoice:
    """A request's `tool_choice` in this server's terms, whatever dialect sent it.

    `mode`: "auto" (calls allowed), "none" (no calls parsed), "required" (at
    least one call of any tool; exactly one without `parallel`) or "named"
    (exactly one call of the tool `name`).
    `label` is how the client wrote the mode, for the 400 that names it.
    """

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True
    label: str = ""

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def parallel_calls(self) -> bool:
        """Whether an answer may hold more than one call.

        A named choice is exactly one call of that tool, whatever `parallel`
        says (OpenAI and vLLM serve it so; Anthropic's `tool` choice is used
        the same way): the grammar and the output pipeline both follow this.
        """
        return self.parallel and self.mode != "named"


def check_tool_choice(tools: Sequence[Mapping[str, Any]] | None, choice: ToolChoice) -> None:
    """400 for a choice that forces a call no tool can make."""
    if not choice.forces_call:
        return
    names = {t.get("function", t).get("name") for t in tools or ()}
    if not names:
        label = choice.label or choice.mode
        message = f"tool_choice {label!r} forces a tool call but no tools are given"
        raise APIError(400, message, param="tool_choice")
    if choice.mode == "named" and choice.name not in names:
        message = f"tool_choice names {choice.name!r}, which is not among the tools"
        raise APIError(400, message, param="tool_choice")


def answer_constraint(
    tools: Sequence[Mapping[str, Any]] | None,
    choice: ToolChoice,
    json_schema: Mapping[str, Any] | None = None,
) -> OutputConstraint | None:
    """What the answer must be: forced calls, JSON under a schema, or strict optional calls.

    A forced call and a JSON format exclude each other (400); with calls
    allowed, functions marked `strict` have their arguments enforced.
    """
    check_tool_choice(tools, choice)
    if choice.forces_call:
        if json_schema is not None:
            message = "a forced tool_choice and a JSON response format exclude each other"
            raise APIError(400, message, param="tool_choice")
        name = choice.name if choice.mode == "named" else None
        return forced_calls(tools, name, choice.parallel_calls)
    if json_schema is not None:
        return OutputConstraint(json_schema=json_schema)
    if choice.mode == "auto":
        return strict_calls(tools, choice.parallel_calls)
    return None


def with_response_format(
    messages: list[dict[str, Any]], shown: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Messages whose leading system turn asks for `shown` (DeepSeek renders it there)."""
    out = list(messages)
    if out and out[0].get("role") in ("system", "developer"):
        out[0] = {**out[0], "response_format": dict(shown)}
    else:
        out.insert(0, {"role": "system", "content": "", "response_format": dict(shown)})
    return out


def _checked(grammar: str, what: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(f"{what} cannot be enforced: {error}")
    return grammar


def _check_size(schema: Any, what: str) -> str:
    if not isinstance(schema, Mapping):
        raise StructuredOutputError(f"{what} must be a JSON schema object")
    text = json.dumps(schema, ensure_ascii=False)
    if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
        raise StructuredOutputError(f"{what} is larger than {MAX_SCHEMA_BYTES} bytes")
    return text


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    _check_size(schema, "the JSON schema")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_compact(schema))
    except (ValueError, TypeError) as e:
        raise StructuredOutputError(f"the JSON schema cannot be enforced: {e}") from e
    return _checked(grammar, "the JSON schema")


def _with_defs(schema: Mapping[str, Any], root: Mapping[str, Any]) -> dict[str, Any]:
    """A property's schema with the root's definitions, so its `$ref`s still resolve."""
    out = dict(schema)
    for key in _REF_KEYS:
        if key in root and key not in out:
            out[key] = root[key]
    return out


def _dsml_param(
    rule: str, name: str, schema: Mapping[str, Any], root: Mapping[str, Any], d: DsmlDialect
) -> list[str]:
    """One parameter: a string raw (`string="true"`, as the model writes it), else JSON."""
    close = literal(d.param_close)
    if not is_raw_string(schema):
        head = literal(f'{d.param_open}{name}" string="false">')
        value = json.dumps(_compact(_with_defs(schema, root)), ensure_ascii=False)
        return [f'{rule}: {head} %json{value} {close} "\\n"']
    head = literal(f'{d.param_open}{name}" string="true">')
    try:
        terminal = raw_terminal(schema, d.param_close)
    except ValueError as e:
        raise StructuredOutputError(f"parameter {name!r} cannot be enforced: {e}") from e
    if terminal is None:
        # Any text, lazily: the value ends at the first closing tag.
        return [f'{rule}: {head} {rule}_v "\\n"', f"{rule}_v[suffix={close}]: /(.|\\n)*/"]
    upper = f"{rule.upper()}_V"
    return [f'{rule}: {head} {upper} "\\n"', f"{upper}: {terminal}"]


def _free_text(opener: str) -> list[str]:
    """`free`: text without `opener`; `lead`: text up to and including its first `opener`."""
    marker = literal(opener)
    without = f"/(.|\\n)*/ & ~/(.|\\n)*{regex_literal(opener)}(.|\\n)*/"
    return ["free: FREE", f"FREE: {without}", f"lead[suffix={marker}]: {without}"]


def _dsml_free_invoke(index: int, function: Mapping[str, Any], d: DsmlDialect) -> list[str]:
    """An invoke of a non-strict function: any parameters, well formed."""
    head = literal(f'{d.invoke_open}{function["name"]}">\n')
    tail = literal(f"{d.invoke_close}\n")
    open_param = literal(d.param_open)
    kind = literal('" string="')
    end_attrs = literal('">')
    close = literal(d.param_close)
    return [
        f"invoke{index}: {head} any_param{index}* {tail}",
        f'any_param{index}: {open_param} PNAME {kind} ("true" | "false") {end_attrs} '
        f'any_value{index} "\\n"',
        f"any_value{index}[suffix={close}]: /(.|\\n)*/",
    ]


def _dsml_invoke(index: int, function: Mapping[str, Any], d: DsmlDialect) -> list[str]:
    name = function["name"]
    params = function.get("parameters") or {"type": "object", "properties": {}}
    properties = params.get("properties") or {}
    required = set(params.get("required") or ())
    rules: list[str] = []
    parts: list[str] = []
    for j, (key, schema) in enumerate(properties.items()):
        rule = f"p{index}_{j}"
        rules += _dsml_param(rule, key, schema if isinstance(schema, Mapping) else {}, params, d)
        parts.append(rule if key in required else f"{rule}?")
    missing = required - set(properties)
    if missing:
        raise StructuredOutputError(
            f"tool {name!r}: required parameters {sorted(missing)} have no schema in 'properties'"
        )
    head = literal(f'{d.invoke_open}{name}">\n')
    tail = literal(f"{d.invoke_close}\n")
    rules.insert(0, f"invoke{index}: {head} {' '.join(parts)} {tail}")
    return rules


def dsml_grammar(
    tools: Sequence[Mapping[str, Any]], dialect: str, parallel: bool, optional: bool = False
) -> str:
    """DSML tool calls (`dialect` "deepseek_v4" or "deepseek_v41") of the given tools."""
    d = _DSML[dialect]
    rules: list[str] = []
    for i, function in enumerate(tools):
        _check_size(function.get("parameters") or {}, f"tool {function['name']!r} parameters")
        if optional and function.get("strict") is not True:
            rules += _dsml_free_invoke(i, function, d)
        else:
            rules += _dsml_invoke(i, function, d)
    choice = " | ".join(f"invoke{i}" for i in range(len(tools)))
    repeat = "+" if parallel else ""
    calls = f"({choice}){repeat} {literal(d.close)}"
    if optional:
        # The lead text is free; its first opening marker starts the block.
        rules += _free_text(d.open)
        rules.append('PNAME: /[^"<>\\n]+/')
        start = f'start: free | lead "\\n" {calls} free'
    else:
        start = f"start: {literal(DSML_LEAD + d.open + chr(10))} {calls}"
    lark = "\n".join([start, *rules])
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), "the tools' parameters")


def hermes_grammar(
    tools: Sequence[Mapping[str, Any]], parallel: bool, optional: bool = False
) -> str:
    """Hermes `<tool_call>{"name", "arguments"}</tool_call>` calls of the given tools."""
    calls = []
    for function in tools:
        params = function.get("parameters") or {"type": "object"}
        _check_size(params, f"tool {function['name']!r} parameters")
        if optional and function.get("strict") is not True:
            params = {"type": "object"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = _compact(calls[0] if len(calls) == 1 else {"anyOf": calls})
    body = f'"\\n" %json{json.dumps(schema, ensure_ascii=False)} "\\n</tool_call>"'
    more = '("\\n<tool_call>" body)*' if parallel else ""
    if optional:
        rules = [f"start: free | lead body {more} free", *_free_text("<tool_call>")]
    else:
        rules = [f'start: "<tool_call>" body {more}']
    lark = "\n".join([*rules, f"body: {body}"])
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), "the tools' parameters")


def constraint_grammar(constraint: OutputConstraint, tool_syntax: str) -> str:
    """The grammar for `constraint`; `tool_syntax` is the model's tool parser name.

    Built once per distinct constraint (agents repeat the same tools every turn).
    """
    # Not sorted: the grammar writes properties in the schema's order.
    key = json.dumps(
        [constraint.json_schema, list(constraint.tools), constraint.parallel, constraint.optional],
        ensure_ascii=False,
    )
    return _cached_grammar(key, tool_syntax)


@functools.lru_cache(maxsize=128)
def _cached_grammar(key: str, tool_syntax: str) -> str:
    schema, tools, parallel, optional = json.loads(key)
    return _build_grammar(OutputConstraint(schema, tuple(tools), parallel, optional), tool_syntax)


def _build_grammar(constraint: OutputConstraint, tool_syntax: str) -> str:
    if constraint.json_schema is not None:
        return json_schema_grammar(constraint.json_schema)
    if not constraint.tools:
        raise StructuredOutputError("a tool-call constraint needs at least one tool")
    if tool_syntax in _DSML:
        return dsml_grammar(constraint.tools, tool_syntax, constraint.parallel, constraint.optional)
    if tool_syntax == "hermes":
        return hermes_grammar(constraint.tools, constraint.parallel, constraint.optional)
    raise StructuredOutputError(
        f"this model's tool-call syntax ({tool_syntax!r}) cannot be enforced; "
        "use tool_choice 'auto'"
    )
