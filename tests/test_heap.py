"""The heap trimmer: glibc's malloc_trim, rate-limited, and nothing where it is absent."""

from __future__ import annotations

import sys

import pytest

from mlxserve.engine.heap import HeapTrimmer


def test_it_trims_when_due_and_not_before() -> None:
    due = HeapTrimmer(every_s=0.0)
    if not due.available:
        pytest.skip("no glibc malloc_trim on this platform")
    due.maybe_trim()
    due.maybe_trim()
    assert due.trims == 2
    later = HeapTrimmer(every_s=3600.0)
    later.maybe_trim()
    assert later.trims == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc is Linux-only")
def test_glibc_linux_has_the_trimmer() -> None:
    assert HeapTrimmer().available
