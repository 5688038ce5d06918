"""`mlxserve bench encoder` runs and writes its figures (no timing assertions)."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import pytest

from mlxserve.bench import encoder
from mlxserve.chat import encode_request


def test_conversations_have_the_advertised_shape() -> None:
    for n in (4, 130):
        request = encoder.conversation(n)
        assert len(request["messages"]) == n and request["tools"]
        roles = {m["role"] for m in request["messages"]}
        assert {"system", "user", "assistant", "tool"} <= roles
        assert "<tool_result>" in encode_request(request)


def test_run_writes_the_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = functools.partial(encoder.time_ms, repeats=1, min_seconds=0.0)
    monkeypatch.setattr(encoder, "time_ms", fast)
    out = tmp_path / "encoder.json"
    assert encoder.run(argparse.Namespace(json=str(out))) == 0
    figures = json.loads(out.read_text(encoding="utf-8"))["figures"]
    assert figures["ms_4_messages"] > 0 and figures["ms_130_messages"] > 0
    assert figures["reference_ms_4_messages"] == 0.022
    assert figures["reference_ms_130_messages"] == 0.335
