"""DeepSeek-V4 / V4.1 DSML tool calls: a streaming scanner, not a regex.

A block, as the reference encoder writes it (V4 shown; V4.1 writes
`｜DSML｜ ` with a space and names the block `calls` instead of `tool_calls`)::

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Whitespace between tags is free; anything else out of place makes the block
malformed (it then stays content, see `blocks.py`). `string="true"` values
are raw text and may contain anything; a value ends at the first
`</｜DSML｜parameter>` that is followed (after optional whitespace) by the
next parameter or by `</｜DSML｜invoke>`, so even that closing text can
appear inside a value. `string="false"` values are JSON. A block needs at
least one invoke, non-empty names and distinct parameter names per invoke.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlxserve.parsers.blocks import BlockScanner, BlockToolParser, Status, strict_json_loads
from mlxserve.parsers.textscan import WHITESPACE, partial_marker_len

MAX_NAME = 256
_BAD_NAME_CHARS = frozenset('<>\n"')


@dataclass(frozen=True, slots=True)
class DsmlDialect:
    """The tag spelling of one DSML version."""

    prefix: str
    block: str

    @property
    def open(self) -> str:
        return f"<{self.prefix}{self.block}>"

    @property
    def close(self) -> str:
        return f"</{self.prefix}{self.block}>"

    @property
    def invoke_open(self) -> str:
        return f'<{self.prefix}invoke name="'

    @property
    def invoke_close(self) -> str:
        return f"</{self.prefix}invoke>"

    @property
    def param_open(self) -> str:
        return f'<{self.prefix}parameter name="'

    @property
    def param_close(self) -> str:
        return f"</{self.prefix}parameter>"


DSML_V4 = DsmlDialect(prefix="｜DSML｜", block="tool_calls")
DSML_V41 = DsmlDialect(prefix="｜DSML｜ ", block="calls")
DSML_LEAD = "\n\n"

_INVOKE_END = '">'
_STRING_ATTRS = ('" string="true">', '" string="false">')


def _json(value: Any) -> str:
    # As the whole arguments object is written: JSON escaping is per character,
    # so a string's pieces escape to the pieces of its escaped form.
    return json.dumps(value, ensure_ascii=False)


class DsmlScanner(BlockScanner):
    """Scans the text of one DSML block after its opening tag."""

    def __init__(self, dialect: DsmlDialect) -> None:
        super().__init__()
        self._d = dialect
        self._state = "between"
        self._name = ""
        self._args: dict[str, Any] = {}
        self._key = ""
        self._is_string = True
        self._value: list[str] = []
        self._params = 0  # parameters of the open invoke, for the streamed JSON
        self._value_ends = (dialect.param_open, dialect.invoke_close)
        self._look = max(len(end) for end in self._value_ends)

    def feed(self, text: str) -> Status:
        self._take(text)
        while True:
            status = self._step()
            if status is not None:
                return status

    def _step(self) -> Status | None:
        if self._state == "between":
            return self._between()
        if self._state == "invoke":
            return self._invoke()
        if self._state == "invoke_name":
            return self._invoke_name()
        if self._state == "param_name":
            return self._param_name()
        return self._param_value()

    def _expect(self, choices: tuple[str, ...]) -> int | Status:
        """Match one of `choices` at the scan position: its index, MORE or BAD."""
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail == 0:
            return Status.MORE
        for i, choice in enumerate(choices):
            if buf.startswith(choice, pos):
                self._pos = pos + len(choice)
                return i
        tail = buf[pos:]
        if any(len(c) > avail and c.startswith(tail) for c in choices):
            return Status.MORE
        return Status.BAD

    def _skip_ws(self) -> None:
        match = WHITESPACE.match(self._buf, self._pos)
        if match is not None:
            self._pos = match.end()

    def _read_name(self) -> str | Status:
        """A name up to (not including) the closing quote."""
        buf, pos = self._buf, self._pos
        end = buf.find('"', pos)
        name = buf[pos:] if end < 0 else buf[pos:end]
        if len(name) > MAX_NAME or not _BAD_NAME_CHARS.isdisjoint(name):
            return Status.BAD
        if end < 0:
            return Status.MORE
        if not name:
            return Status.BAD
        self._pos = end
        return name

    def _between(self) -> Status | None:
        self._skip_ws()
        got = self._expect((self._d.invoke_open, self._d.close))
        if isinstance(got, Status):
            return got
        if got == 1:
            return Status.DONE if self.calls else Status.BAD
        self._state = "invoke_name"
        return None

    def _invoke_name(self) -> Status | None:
        name = self._read_name()
        if isinstance(name, Status):
            return name
        got = self._expect((_INVOKE_END,))
        if isinstance(got, Status):
            if got is Status.MORE:
                self._pos -= len(name)  # read the name again with more text
            return got
        self._name, self._args, self._state = name, {}, "invoke"
        self._params = 0
        self._start_call(name)
        return None

    def _invoke(self) -> Status | None:
        self._skip_ws()
        got = self._expect((self._d.param_open, self._d.invoke_close))
        if isinstance(got, Status):
            return got
        if got == 1:
            self.calls.append((self._name, self._args))
            self._fragment("}" if self._params else "{}")
            self._state = "between"
        else:
            self._state = "param_name"
        return None

    def _param_name(self) -> Status | None:
        key = self._read_name()
        if isinstance(key, Status):
            return key
        if key in self._args:
            return Status.BAD
        got = self._expect(_STRING_ATTRS)
        if isinstance(got, Status):
            if got is Status.MORE:
                self._pos -= len(key)  # read the name again with more text
            return got
        self._key, self._is_string, self._value = key, got == 0, []
        self._state = "value"
        opening = "{" if self._params == 0 else ", "
        self._params += 1
        self._fragment(f"{opening}{_json(key)}: " + ('"' if self._is_string else ""))
        return None

    def _param_value(self) -> Status | None:
        buf, pos, close = self._buf, self._pos, self._d.param_close
        at = buf.find(close, pos)
        while at >= 0:
            nxt = WHITESPACE.match(buf, at + len(close))
            after = nxt.end() if nxt is not None else at + len(close)
            tail = buf[after : after + self._look]
            if any(tail.startswith(end) for end in self._value_ends):
                self._add_value(buf[pos:at])
                self._pos = at + len(close)
                return self._end_value()
            if after == len(buf) or any(end.startswith(tail) for end in self._value_ends):
                break  # undecided until more text arrives
            at = buf.find(close, at + 1)
        if at < 0:
            at = len(buf) - partial_marker_len(buf[pos:], (close,))
        self._add_value(buf[pos:at])
        self._pos = at
        return Status.MORE

    def _add_value(self, text: str) -> None:
        """Text that is certainly part of the value (a string streams as it comes)."""
        if text:
            self._value.append(text)
            if self._is_string:
                self._fragment(_json(text)[1:-1])

    def _end_value(self) -> Status | None:
        text = "".join(self._value)
        self._value = []
        if self._is_string:
            self._args[self._key] = text
            self._fragment('"')
        else:
            try:
                value = strict_json_loads(text)
            except (ValueError, RecursionError):
                return Status.BAD
            self._args[self._key] = value
            self._fragment(_json(value))
        self._state = "invoke"
        return None


class DsmlToolParser(BlockToolParser):
    """DSML tool-call parser for the given dialects (V4, V4.1, or both)."""

    def __init__(self, dialects: tuple[DsmlDialect, ...] = (DSML_V4,)) -> None:
        super().__init__([d.open for d in dialects], lead=DSML_LEAD)
        self._dialects = {d.open: d for d in dialects}

    def _new_scanner(self, opener: str) -> BlockScanner:
        return DsmlScanner(self._dialects[opener])
