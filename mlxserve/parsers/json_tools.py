"""Hermes / Qwen style JSON tool calls: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.

The scanner follows the JSON object's structure (strings, escapes, nesting)
so a `</tool_call>` inside a string value does not end the call. The
object must be followed, after optional whitespace, by `</tool_call>`;
`arguments` may be an object or a JSON string holding one. Anything else
is malformed and stays content (see `blocks.py`).

A call written the usual way, `{"name": "…", "arguments": {…}}`, streams as
it arrives: its start once the name is read, then the arguments object's
text verbatim, which is also its final `arguments` string. Other shapes are
emitted whole when the call closes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlxserve.parsers.blocks import BlockScanner, BlockToolParser, Status, strict_json_loads
from mlxserve.parsers.textscan import WHITESPACE

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
HERMES_LEAD = "\n"

_OUTSIDE = re.compile(r'["{}\[\]]')
_INSIDE = re.compile(r'["\\]')
# The head of a call that can stream: name first, then an arguments object.
_STREAM_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
# A head longer than this is not looked for (the call is emitted whole).
_MAX_HEAD = 1024


def _decode_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) from a call object's JSON text, or None when invalid."""
    try:
        obj = strict_json_loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = strict_json_loads(args) if args.strip() else {}
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
        self._scanned = 0  # characters of the object scanned so far
        self._args_start: int | None = None  # where the streamed arguments begin
        self._args_end: int | None = None  # where the first nested value closed
        self._name = ""

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
        if self._state == "object":
            closed = self._scan_object()
            self._stream()
            if not closed:
                return Status.MORE
        return self._close()

    def _stream(self) -> None:
        """Find the streamable head once, then pass on the arguments text as it comes."""
        start = self._args_start
        piece_start = self._scanned - len(self._obj[-1])
        if start is None:
            if self._scanned > _MAX_HEAD + len(self._obj[-1]):
                return
            head = _STREAM_HEAD.match("".join(self._obj))
            if head is None:
                return
            try:
                name = json.loads(head.group(1))
            except ValueError:
                return
            if not name:
                return
            self._name = name
            start = self._args_start = head.end()
            self._start_call(self._name)
            piece_start = 0
            text = "".join(self._obj)
        else:
            text = self._obj[-1]
        end = self._scanned if self._args_end is None else self._args_end
        lo, hi = max(start, piece_start) - piece_start, end - piece_start
        if hi > lo:
            self._fragment(text[lo:hi])

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
                if self._depth == 1 and self._args_end is None:
                    self._args_end = self._scanned + pos - start
                if self._depth == 0:
                    self._add_scanned(buf[start:pos])
                    self._pos, self._state = pos, "post"
                    return True
        self._add_scanned(buf[start:pos])
        self._pos = pos
        return False

    def _add_scanned(self, text: str) -> None:
        self._obj.append(text)
        self._scanned += len(text)

    def _close(self) -> Status:
        buf = self._buf
        match = WHITESPACE.match(buf, self._pos)
        pos = match.end() if match is not None else self._pos
        tail = buf[pos : pos + len(TOOL_CALL_CLOSE)]
        if tail != TOOL_CALL_CLOSE:
            return Status.MORE if TOOL_CALL_CLOSE.startswith(tail) else Status.BAD
        call = _decode_call("".join(self._obj))
        if call is None or (self.streamed and not self._streamed_matches(call)):
            return Status.BAD
        self.calls.append(call)
        self._pos = pos + len(TOOL_CALL_CLOSE)
        return Status.DONE

    def _streamed_matches(self, call: tuple[str, dict[str, Any]]) -> bool:
        """The streamed name and arguments text are what the whole object says."""
        try:
            streamed = strict_json_loads("".join(self.streamed[0]))
        except (ValueError, RecursionError):
            return False
        return call == (self._name, streamed)


class HermesToolParser(BlockToolParser):
    """`<tool_call>` JSON tool-call parser (Hermes, Qwen2.5/Qwen3)."""

    def __init__(self) -> None:
        super().__init__([TOOL_CALL_OPEN], lead=HERMES_LEAD)

    def _new_scanner(self, opener: str) -> BlockScanner:
        return JsonCallScanner()
