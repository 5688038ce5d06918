"""Speculative decoding end to end: a reply that re-emits its prompt, drafted by prompt
lookup, streams the same reasoning and tool calls as without drafts.

The scripted DeepSeek-V4 model writes reasoning and two parallel DSML tool calls;
the user message quotes that very text, as an agent's context quotes the code it
re-emits, so the drafts are mostly kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from api_fixtures import ServerThread, scripted_server

pytestmark = pytest.mark.slow

MODEL = "scripted-v4"
CASE = next(
    case
    for case in map(
        json.loads,
        (Path(__file__).parent / "data" / "dsv4_outputs_public.jsonl").read_text().splitlines(),
    )
    if case["id"] == "out-pub-0004"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {}, "additionalProperties": True},
        },
    }
    for name in ("get_weather", "get_time")
]


def _answer(srv: ServerThread) -> dict[str, Any]:
    client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Do this again:\n" + CASE["text"]}],
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0,
        stream=True,
    )
    reasoning, content, calls = "", "", {}
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            if call.function is not None:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return {"reasoning": reasoning, "content": content, "calls": calls}


def test_drafted_reply_streams_the_same_answer() -> None:
    with scripted_server(CASE["text"], model=MODEL) as plain:
        expected = _answer(plain)
    with scripted_server(CASE["text"], "--speculative", "ngram", model=MODEL) as drafted:
        got = _answer(drafted)
        metrics = httpx.get(drafted.url + "/metrics", timeout=10).text
    assert got == expected
    assert len(expected["calls"]) == 2
    accepted = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("mlxserve_spec_accepted_tokens_total{")
    ]
    assert accepted and accepted[0] > 0


def _chat(srv: ServerThread) -> str:
    client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "Write something long."}],
        temperature=0,
        max_tokens=24,
        stream=True,
    )
    text = ""
    for chunk in stream:
        if chunk.choices:  # the tiny model's noise may land in reasoning or content
            delta = chunk.choices[0].delta
            text += (getattr(delta, "reasoning_content", None) or "") + (delta.content or "")
    return text


def test_mtp_drafted_reply_streams_the_same_text(tmp_path: Path) -> None:
    """`serve --speculative mtp` on a DeepSeek-V4 checkpoint with its MTP layer."""
    from api_fixtures import serve_args

    from mlxserve.models.load import load
    from mlxserve.models.tiny.synthetic import make_model

    path = make_model(tmp_path / "v4-mtp", "deepseek_v4", mtp_layers=1)
    with ServerThread(serve_args(), lambda: load(path)) as plain:
        expected = _chat(plain)
    with ServerThread(serve_args("--speculative", "mtp"), lambda: load(path)) as drafted:
        got = _chat(drafted)
        metrics = httpx.get(drafted.url + "/metrics", timeout=10).text
    assert got == expected and expected
    assert 'mlxserve_spec_draft_tokens_total{drafter="mtp",model_name="test-model"}' in metrics
