"""Small text-scanning helpers shared by the streaming parsers.

All of them look only at a bounded window (a held-back tail plus the new
delta), so a parser's work per delta stays proportional to the delta.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

WHITESPACE = re.compile(r"[ \t\r\n]*")


def partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker.

    That suffix could still grow into the marker, so it must be held back.
    """
    if not text or not markers:
        return 0
    longest = max(len(m) for m in markers) - 1
    start = max(0, len(text) - longest)
    firsts = {m[0] for m in markers if m}
    best = 0
    for i in range(start, len(text)):
        if text[i] not in firsts:
            continue
        tail = text[i:]
        if any(len(m) > len(tail) and m.startswith(tail) for m in markers):
            best = len(tail)
            break
    return best


def held_tail_len(text: str, markers: Sequence[str], lead: str = "") -> int:
    """How many trailing characters to hold back: a possible marker start plus,
    before it, whatever could be the `lead` that belongs to the marker."""
    hold = partial_marker_len(text, markers)
    if lead:
        head = text[: len(text) - hold]
        for k in range(len(lead), 0, -1):
            if head.endswith(lead[:k]):
                hold += k
                break
    return hold


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence of any marker at or after `start`, as (position, marker)."""
    found: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (found is None or i < found[0]):
            found = (i, marker)
    return found


def lead_start(text: str, end: int, lead: str) -> int:
    """Where a marker found at `end` really starts: before `lead` when `lead` precedes it."""
    if lead and end >= len(lead) and text.startswith(lead, end - len(lead)):
        return end - len(lead)
    return end


class StringStripper:
    """Removes fixed strings (e.g. an EOS token's text) from a delta stream.

    A tail that could still grow into one of the strings is held back until
    the next delta or `finish()`.
    """

    def __init__(self, strings: Sequence[str]) -> None:
        self._strings = tuple(s for s in strings if s)
        self._buf = ""

    def feed(self, delta: str) -> str:
        if not self._strings:
            return delta
        text = self._buf + delta
        while any(s in text for s in self._strings):
            for s in self._strings:
                text = text.replace(s, "")
        hold = partial_marker_len(text, self._strings)
        self._buf = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def finish(self) -> str:
        text, self._buf = self._buf, ""
        return text
