"""The process's own memory, as the operating system counts it (for /metrics and
/v1/cache/stats): what an operator watches to see growth before it hurts."""

from __future__ import annotations

import os
import resource
import sys

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """Resident set size now (Linux: /proc/self/statm); None where the system has no such file."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


def peak_resident_bytes() -> int:
    """The largest resident set size so far (macOS counts it in bytes, Linux in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def process_memory() -> dict[str, int]:
    figures = {"process_peak_resident_bytes": peak_resident_bytes()}
    now = resident_bytes()
    if now is not None:
        figures["process_resident_bytes"] = now
    return figures
