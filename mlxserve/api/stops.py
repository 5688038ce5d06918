"""Stop strings matched across token boundaries.

The matcher withholds the tail of the text that could still become a stop
string, so a stop string is never emitted, even in part. Work per delta is
proportional to the delta plus the longest stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed decoded text; get back what is safe to emit and whether a stop matched."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str) -> str:
        """Text safe to emit. After a match, `matched` is set and the rest is dropped."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        first: tuple[int, str] | None = None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos >= 0 and (first is None or pos < first[0]):
                first = (pos, stop)
        if first is not None:
            self.matched = first[1]
            self._held = ""
            return buf[: first[0]]
        hold = self._partial_len(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """The withheld tail, at the end of the output (no stop string can match now)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            limit = min(len(stop) - 1, len(buf))
            for n in range(limit, best, -1):
                if stop.startswith(buf[len(buf) - n :]):
                    best = n
                    break
        return best
