"""End to end: the official `openai` client against a real uvicorn server (tiny llama)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from api_fixtures import ServerThread, chat_body, post, serve_args

from mlxserve.models import load
from mlxserve.models.tiny.synthetic import make_model

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path = make_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)
    args = serve_args(
        "--served-model-name",
        MODEL,
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "512",
        model=str(path),
    )
    with ServerThread(args, lambda: load(Path(path))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


MESSAGES: Any = [{"role": "user", "content": "Tell me a story about a fox."}]


def _stream_chat(client: openai.OpenAI, **kw: Any) -> tuple[str, str | None, list[Any]]:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next(
        (c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason),
        None,
    )
    return text, finish, chunks


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}])
def test_chat_stream_equals_non_stream(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **sampling)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.prompt_tokens > 0
    assert 0 < full.usage.completion_tokens <= 12
    assert full.usage.prompt_tokens_details is not None
    assert full.usage.prompt_tokens_details.cached_tokens is not None
    text, finish, chunks = _stream_chat(client, max_tokens=12, **sampling)
    assert text == choice.message.content
    assert finish == choice.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0
    )
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.completion_tokens > 0
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    with_lp = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2
    )
    lp = with_lp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == with_lp.choices[0].text
    ids = [3001, 4002, 5003, 6004]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)


def test_stop_string_across_tokens_is_never_emitted(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0
    )
    text = full.choices[0].message.content or ""
    assert len(text) > 12
    stop = text[5:11]
    expected = text[: text.index(stop)]
    cut = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == expected
    assert cut.choices[0].finish_reason == "stop"
    streamed, finish, _ = _stream_chat(client, max_tokens=24, temperature=0, stop=stop)
    assert streamed == expected and finish == "stop"


def test_include_usage_and_logprobs(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5
    lps = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.content or []
    ]
    assert len(lps) == 5 and all(len(lp.top_logprobs) == 2 for lp in lps)
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True
    )
    assert full.choices[0].logprobs is not None
    assert [lp.token for lp in full.choices[0].logprobs.content or []] == [lp.token for lp in lps]


def test_sampling_fields_accepted(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=4,
        temperature=0.7,
        top_p=0.9,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"1": -100},
        user="u1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert out.usage is not None and out.usage.completion_tokens <= 4


def test_models_health_cache_metrics(server: ServerThread, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL) == models.data[0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/no-such-model")
    assert missing.value.code == "model_not_found"
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/health").json() == {"status": "ok"}
        stats = http.get("/v1/cache/stats")
        assert stats.status_code == 200 and "hits" in stats.json()
        metrics = http.get("/metrics").text
    for name in (
        "mlxserve_requests_running",
        "mlxserve_requests_waiting",
        "mlxserve_generation_tokens_total",
        "mlxserve_time_to_first_token_seconds_bucket",
        "mlxserve_prefix_cache_hits_total",
        "mlxserve_prefix_cache_hit_ratio",
        "mlxserve_kv_cache_bytes",
        "mlxserve_inter_token_latency_seconds_bucket",
        "mlxserve_e2e_request_latency_seconds_count",
    ):
        assert name in metrics


def test_prefix_cache_reports_cached_tokens(client: openai.OpenAI) -> None:
    """A prompt that extends an earlier one reuses its cached prefix."""
    first = [(7 * i) % 5000 + 100 for i in range(96)]
    client.completions.create(model=MODEL, prompt=first, max_tokens=2, temperature=0)
    again = client.completions.create(
        model=MODEL, prompt=first + [42, 43, 44], max_tokens=2, temperature=0
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_health_answers_while_eight_streams_decode(server: ServerThread) -> None:
    """The event loop is never blocked by generation (soft bound; the oracle is 'answers')."""
    import threading

    started = threading.Barrier(9)
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            with httpx.Client(base_url=server.base_url, timeout=60) as http:
                body = chat_body(max_tokens=64, stream=True, model=MODEL)
                with http.stream("POST", "/chat/completions", json=body) as r:
                    first = True
                    for _ in r.iter_lines():
                        if first:
                            started.wait(timeout=30)
                            first = False
        except (httpx.HTTPError, threading.BrokenBarrierError) as e:
            errors.append(e)

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait(timeout=30)
    latencies = []
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for _ in range(5):
            t0 = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
    for t in threads:
        t.join(timeout=60)
    assert not errors
    print(f"health latency while 8 streams decode: max={max(latencies) * 1000:.1f} ms")
    assert max(latencies) < 2.0


def test_normal_request_after_everything(server: ServerThread) -> None:
    r = post(server.url, "/v1/chat/completions", chat_body(model=MODEL))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_metrics_show_kv_bytes_while_a_request_decodes(
    server: ServerThread, client: openai.OpenAI
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def kv_bytes(http: httpx.Client) -> float:
        families = text_string_to_metric_families(http.get("/metrics").text)
        family = next(f for f in families if f.name == "mlxserve_kv_cache_bytes")
        return float(family.samples[0].value)

    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0, stream=True
    )
    with httpx.Client(base_url=server.url, timeout=10) as http:
        # The role chunk goes out before any token; the second chunk carries one.
        during = [kv_bytes(http) for n, _ in enumerate(stream) if n == 1]
    assert during and during[0] > 0, during
