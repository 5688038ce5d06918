"""A JSON schema's string keywords as one Lark terminal over the raw text.

DeepSeek-V4/V4.1 write every string parameter raw (`string="true"`), never as
JSON; a grammar that pushed constrained strings into JSON would push a real
model off its own format (and stream the value in one piece). So a string
schema's `minLength` / `maxLength` / `pattern` / `format` / `enum` / `const`
become one terminal that the raw value must match, intersected with "does not
contain the parameter's closing tag" (the tag ends the value).

Pure functions; a schema that cannot be enforced raises `ValueError` with the
reason (the grammar builder names the parameter).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import llguidance

ANY = "(?s:.*)"
# llguidance checks that a terminal can match at all by a bounded search, which a
# longer minimum under an intersection exhausts (the matcher then fails at the
# first token): measured to fail from about 4000.
MAX_MIN_LENGTH = 2048
# Keywords that combine schemas: such a string is left to the JSON path.
_APPLICATORS = frozenset(
    ("anyOf", "allOf", "oneOf", "not", "$ref", "$dynamicRef", "if", "then", "else")
)

_DATE = (
    r"[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_TIME = (
    r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"
    r"(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
_HOST = rf"{_LABEL}(?:\.{_LABEL})*"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_H16 = r"[0-9a-fA-F]{1,4}"
_URI_CHAR = r"(?:[a-zA-Z0-9\-._~!$&'()*+,;=:@/]|%[0-9a-fA-F]{2})"
_DUR_TIME = r"T(?:[0-9]+H(?:[0-9]+M)?(?:[0-9]+S)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)"
# The formats llguidance enforces in JSON, as regexes of (a safe subset of)
# their valid texts: every text they match is valid, not every valid one matches.
FORMATS: dict[str, str] = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[tT]{_TIME}",
    "duration": (
        rf"P(?:(?:[0-9]+D|[0-9]+M(?:[0-9]+D)?|[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?)(?:{_DUR_TIME})?"
        rf"|{_DUR_TIME}|[0-9]+W)"
    ),
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    "ipv6": (
        rf"(?:{_H16}:){{7}}{_H16}|(?:{_H16}:){{1,7}}:|(?:{_H16}:){{1,6}}:{_H16}"
        rf"|(?:{_H16}:){{1,5}}(?::{_H16}){{1,2}}|(?:{_H16}:){{1,4}}(?::{_H16}){{1,3}}"
        rf"|(?:{_H16}:){{1,3}}(?::{_H16}){{1,4}}|(?:{_H16}:){{1,2}}(?::{_H16}){{1,5}}"
        rf"|{_H16}:(?::{_H16}){{1,6}}|:(?:(?::{_H16}){{1,7}}|:)"
    ),
    "hostname": _HOST,
    "email": rf"[a-zA-Z0-9!#$%&'*+/=?^_`{{|}}~-]+(?:\.[a-zA-Z0-9!#$%&'*+/=?^_`{{|}}~-]+)*@{_HOST}",
    "uri": (
        rf"[a-zA-Z][a-zA-Z0-9+.\-]*:{_URI_CHAR}*(?:\?(?:{_URI_CHAR}|\?)*)?"
        rf"(?:#(?:{_URI_CHAR}|\?)*)?"
    ),
}


def literal(text: str) -> str:
    """A Lark string literal of `text` (JSON escaping is valid Lark escaping)."""
    return json.dumps(text, ensure_ascii=False)


def regex_literal(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join("\\" + c if c in r"\/.^$|?*+()[]{}-" else c for c in text)


def is_raw_string(schema: Mapping[str, Any]) -> bool:
    """Whether a value under `schema` is always a string, written raw in DSML.

    `type: "string"`, or an `enum` / `const` of strings alone; a schema that
    combines others (`anyOf`, `$ref`, ...) or also admits other types is JSON.
    """
    if not _APPLICATORS.isdisjoint(schema):
        return False
    kind = schema.get("type")
    if kind is not None:
        return kind == "string" or kind == ["string"]
    if "const" in schema:
        return isinstance(schema["const"], str)
    values = schema.get("enum")
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)


def raw_terminal(schema: Mapping[str, Any], close: str) -> str | None:
    """A Lark terminal of a raw value valid under a string `schema`, then `close`.

    The value cannot contain `close`, and `close` (a DSML closing tag) has no
    border (its one `<` comes first), so the value ends at the first closing
    tag, as the DSML parser reads it. One terminal, not a lazy one: that
    masks several times faster. None when the schema constrains nothing.
    """
    parts = [p for p in (_length(schema), _choices(schema, close), _pattern(schema)) if p]
    if "format" in schema:
        parts.append(_format(schema["format"]))
    if not parts:
        return None
    parts.append(f"~/{ANY}{regex_literal(close)}{ANY}/")
    return f"({' & '.join(parts)}) {literal(close)}"


def _count(schema: Mapping[str, Any], key: str) -> int | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _length(schema: Mapping[str, Any]) -> str:
    """JSON Schema counts code points; so does `.` in a Lark regex."""
    low, high = _count(schema, "minLength"), _count(schema, "maxLength")
    if low is None and high is None:
        return ""
    if low is not None and high is not None and low > high:
        raise ValueError(f"minLength {low} is above maxLength {high}")
    if low is not None and low > MAX_MIN_LENGTH:
        raise ValueError(f"minLength above {MAX_MIN_LENGTH} is not supported, got {low}")
    return f"/(?s:.{{{low or 0},{'' if high is None else high}}})/"


def _choices(schema: Mapping[str, Any], close: str) -> str:
    if "const" in schema:
        values = [schema["const"]]
    elif "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list):
            raise ValueError("enum must be a list")
    else:
        return ""
    # Other values can never be written: not strings, or holding the closing tag.
    strings = [v for v in values if isinstance(v, str) and close not in v]
    if not strings:
        raise ValueError("no value of its enum/const is a string without the closing tag")
    return "(" + " | ".join(literal(v) for v in strings) + ")"


def _pattern(schema: Mapping[str, Any]) -> str:
    pattern = schema.get("pattern")
    if pattern is None:
        return ""
    if not isinstance(pattern, str):
        raise ValueError("pattern must be a string")
    return "/" + llguidance.regex_to_lark(search_regex(pattern), "dw") + "/"


def _format(name: Any) -> str:
    regex = FORMATS.get(name) if isinstance(name, str) else None
    if regex is None:
        known = ", ".join(sorted(FORMATS))
        raise ValueError(f"format {name!r} is not one of {known}")
    return "/" + llguidance.regex_to_lark(regex, "") + "/"


def search_regex(pattern: str) -> str:
    """The texts a JSON Schema `pattern` accepts: it matches anywhere unless anchored.

    Each top-level alternative is anchored on its own (`^a|b$`); an anchor
    anywhere else is left in, and the grammar library reports it.
    """
    out = []
    for branch in _branches(pattern):
        start = branch.startswith("^")
        end = branch.endswith("$") and not _escaped(branch, len(branch) - 1)
        body = branch[int(start) : len(branch) - int(end)]
        out.append(("" if start else ANY) + f"(?:{body})" + ("" if end else ANY))
    return "|".join(out)


def _escaped(text: str, index: int) -> bool:
    slashes = 0
    while index - slashes - 1 >= 0 and text[index - slashes - 1] == "\\":
        slashes += 1
    return slashes % 2 == 1


def _branches(pattern: str) -> list[str]:
    """`pattern` split at the `|`s outside groups, classes and escapes."""
    branches, start, depth, in_class, i = [], 0, 0, False, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            # A `]` right after `[` or `[^` is a member, not the end.
            if pattern.startswith("]", i + 1) or pattern.startswith("^]", i + 1):
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "|" and depth == 0:
            branches.append(pattern[start:i])
            start = i + 1
        i += 1
    branches.append(pattern[start:])
    return branches
