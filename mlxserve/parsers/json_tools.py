"""Hermes / Qwen style JSON tool calls: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.

The scanner follows the JSON object's structure (strings, escapes, nesting)
so a `</tool_call>` inside a string value does not end the call. The
object must be followed, after optional whitespace, by `</tool_call>`;
`arguments` may be an object or a JSON string holding one. Anything else
is malformed and stays content (see `blocks.py`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlxserve.parsers.blocks import BlockScanner, BlockToolParser, Status
from mlxserve.parsers.textscan import WHITESPACE

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
HERMES_LEAD = "\n"

_OUTSIDE = re.compile(r'["{}\[\]]')
_INSIDE = re.compile(r'["\\]')


def _decode_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) from a call object's JSON text, or None when invalid."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return name, args


class JsonCallScanner(BlockScanner):
    """Scans one `<tool_call>` body: whitespace, a JSON object, whitespace, close tag."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "pre"
        self._obj: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> Status:
        self._take(text)
        if self._state == "pre":
            match = WHITESPACE.match(self._buf, self._pos)
            self._pos = match.end() if match is not None else self._pos
            if self._pos == len(self._buf):
                return Status.MORE
            if self._buf[self._pos] != "{":
                return Status.BAD
            self._state = "object"
        if self._state == "object" and not self._scan_object():
            return Status.MORE
        return self._close()

    def _scan_object(self) -> bool:
        """Advance through the object; True once its closing brace was consumed."""
        buf, pos, start = self._buf, self._pos, self._pos
        while pos < len(buf):
            if self._escape:
                self._escape, pos = False, pos + 1
                continue
            pattern = _INSIDE if self._in_string else _OUTSIDE
            match = pattern.search(buf, pos)
            if match is None:
                pos = len(buf)
                break
            char, pos = match.group(), match.end()
            if char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = not self._in_string
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._obj.append(buf[start:pos])
                    self._pos, self._state = pos, "post"
                    return True
        self._obj.append(buf[start:pos])
        self._pos = pos
        return False

    def _close(self) -> Status:
        buf = self._buf
        match = WHITESPACE.match(buf, self._pos)
        pos = match.end() if match is not None else self._pos
        tail = buf[pos : pos + len(TOOL_CALL_CLOSE)]
        if tail != TOOL_CALL_CLOSE:
            return Status.MORE if TOOL_CALL_CLOSE.startswith(tail) else Status.BAD
        call = _decode_call("".join(self._obj))
        if call is None:
            return Status.BAD
        self.calls.append(call)
        self._pos = pos + len(TOOL_CALL_CLOSE)
        return Status.DONE


class HermesToolParser(BlockToolParser):
    """`<tool_call>` JSON tool-call parser (Hermes, Qwen2.5/Qwen3)."""

    def __init__(self) -> None:
        super().__init__([TOOL_CALL_OPEN], lead=HERMES_LEAD)

    def _new_scanner(self, opener: str) -> BlockScanner:
        return JsonCallScanner()
