"""logprobs on every route, end to end with the official `openai` client (tiny llama).

Chat completions, text completions and Responses (`include:
["message.output_text.logprobs"]`) return the same values, streamed and not;
greedy top-1 is the output token; alternatives come sorted; and the values
are a log-softmax of the model's logits, computed here apart with mlx-lm.
All three routes are given the same prompt tokens (completions takes the ids
the chat route rendered), so they generate the same tokens. A token that
holds part of a character (a scripted DeepSeek-V4 model) sends its own bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from api_fixtures import ServerThread, scripted_server, serve_args

from mlxserve.models import load

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
MESSAGES: Any = [{"role": "user", "content": "Tell me a story about a fox."}]
TOKENS = 4
TOP = 5
TOLERANCE = 1e-3  # the server decodes with a KV cache; the reference recomputes the prompt


@dataclass
class Served:
    server: ServerThread
    path: Path
    prompts: list[list[int]]


@dataclass(frozen=True)
class Lp:
    """One output token's log-probability and its alternatives, whatever the route."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@pytest.fixture(scope="module")
def served(model_dir_factory: Any) -> Iterator[Served]:
    path = model_dir_factory("llama")
    args = serve_args("--served-model-name", MODEL, "--max-model-len", "512", model=str(path))
    prompts: list[list[int]] = []
    with ServerThread(args, lambda: load(path)) as srv:
        srv.state.on_submit = lambda _rid, ids: prompts.append(list(ids))
        yield Served(srv, path, prompts)


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=served.server.base_url, api_key="unused", max_retries=0, timeout=60
    )


def _pairs(items: Any) -> tuple[tuple[str, float], ...]:
    return tuple((t.token, t.logprob) for t in items or ())


def chat_logprobs(client: openai.OpenAI, stream: bool) -> list[Lp]:
    kw: Any = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": TOP,
    }
    if not stream:
        reply = client.chat.completions.create(**kw)
        content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
        return [Lp(c.token, c.logprob, _pairs(c.top_logprobs)) for c in content or ()]
    out: list[Lp] = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            content = chunk.choices[0].logprobs.content or []
            out += [Lp(c.token, c.logprob, _pairs(c.top_logprobs)) for c in content]
    return out


def _text_lps(logprobs: Any) -> list[Lp]:
    if logprobs is None:
        return []
    tops = logprobs.top_logprobs or []
    return [
        Lp(token, value, tuple((top or {}).items()))
        for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, tops, strict=True)
    ]


def completion_logprobs(client: openai.OpenAI, prompt: list[int], stream: bool) -> list[Lp]:
    kw: Any = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "logprobs": TOP,
    }
    if not stream:
        return _text_lps(client.completions.create(**kw).choices[0].logprobs)
    out: list[Lp] = []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices:
            out += _text_lps(chunk.choices[0].logprobs)
    return out


def _response_lps(items: Any) -> list[Lp]:
    return [Lp(lp.token, lp.logprob, _pairs(lp.top_logprobs)) for lp in items or ()]


def _output_text_parts(response: Any) -> list[Any]:
    return [
        part
        for item in response.output
        if item.type == "message"
        for part in item.content
        if part.type == "output_text"
    ]


def responses_logprobs(client: openai.OpenAI, stream: bool) -> list[Lp]:
    kw: Any = {
        "model": MODEL,
        "input": MESSAGES,
        "max_output_tokens": TOKENS,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": TOP,
    }
    if not stream:
        response = client.responses.create(**kw)
        return [lp for part in _output_text_parts(response) for lp in _response_lps(part.logprobs)]
    deltas: list[Lp] = []
    done: list[Lp] = []
    final: Any = None
    for event in client.responses.create(stream=True, **kw):
        if event.type == "response.output_text.delta":
            deltas += _response_lps(event.logprobs)
        elif event.type == "response.output_text.done":
            done += _response_lps(event.logprobs)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None
    parts = [lp for part in _output_text_parts(final) for lp in _response_lps(part.logprobs)]
    # The deltas, the done events and the final parts all say the same.
    assert deltas == done == parts
    return deltas


def reference(path: Path, prompt: list[int], count: int) -> list[tuple[str, float, list[float]]]:
    """(greedy token, its log-prob, the TOP best log-probs) per step, from mlx-lm itself:
    a log-softmax of the logits of a fresh forward over the prompt and the tokens so far."""
    import mlx.core as mx
    from mlx_lm import load as mlx_lm_load

    model, tokenizer = mlx_lm_load(str(path))
    ids = list(prompt)
    steps: list[tuple[str, float, list[float]]] = []
    for _ in range(count):
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        order = mx.argsort(-logprobs)[:TOP]
        best = int(order[0].item())
        top = [float(v) for v in logprobs[order].tolist()]  # type: ignore[union-attr]
        steps.append((tokenizer.decode([best]), float(logprobs[best].item()), top))
        ids.append(best)
    return steps


def _close(a: list[Lp], b: list[Lp]) -> bool:
    if [lp.token for lp in a] != [lp.token for lp in b]:
        return False
    for x, y in zip(a, b, strict=True):
        if abs(x.logprob - y.logprob) > TOLERANCE or len(x.top) != len(y.top):
            return False
        if any(abs(u[1] - v[1]) > TOLERANCE for u, v in zip(x.top, y.top, strict=True)):
            return False
    return True


def test_every_route_returns_the_models_log_probs(client: openai.OpenAI, served: Served) -> None:
    chat = chat_logprobs(client, stream=False)
    prompt = served.prompts[-1]
    assert chat, "the model produced no tokens"
    routes = {
        "chat streamed": chat_logprobs(client, stream=True),
        "completions": completion_logprobs(client, prompt, stream=False),
        "completions streamed": completion_logprobs(client, prompt, stream=True),
        "responses": responses_logprobs(client, stream=False),
        "responses streamed": responses_logprobs(client, stream=True),
    }
    assert all(p == prompt for p in served.prompts[-len(routes) :])  # one prompt for all
    for name, lps in routes.items():
        assert _close(lps, chat), (name, lps, chat)
    for lp in chat:
        values = [v for _, v in lp.top]
        assert len(lp.top) == TOP and values == sorted(values, reverse=True)
        assert lp.top[0] == (lp.token, lp.logprob)  # greedy: the output token is the top one
    for lp, (token, logprob, top) in zip(
        chat, reference(served.path, prompt, len(chat)), strict=True
    ):
        assert lp.token == token
        assert lp.logprob == pytest.approx(logprob, abs=TOLERANCE)
        assert [v for _, v in lp.top] == pytest.approx(top, abs=TOLERANCE)


def test_responses_without_include_send_no_logprobs(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=2, temperature=0, top_logprobs=3
    )
    assert all(not part.logprobs for part in _output_text_parts(response))
    assert response.top_logprobs == 3


def test_masked_alternatives_are_floored_not_infinite(client: openai.OpenAI) -> None:
    """Under a grammar most tokens are masked (log-prob -inf, which JSON cannot carry):
    they come back as -9999.0, as vLLM sends them."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content
    values = [t.logprob for lp in content for t in lp.top_logprobs]
    assert -9999.0 in values and min(values) == -9999.0


@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
def test_more_than_twenty_alternatives_is_a_400(client: openai.OpenAI, route: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=1, logprobs=True, top_logprobs=21
            )
        elif route == "completions":
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=21)
        else:
            client.responses.create(
                model=MODEL,
                input="Hi",
                max_output_tokens=1,
                include=["message.output_text.logprobs"],
                top_logprobs=21,
            )
    error = caught.value.body
    assert isinstance(error, dict) and "20" in error["message"]
    assert error["param"] in ("top_logprobs", "logprobs")


SPLIT_TEXT = "饕餮 and 😀 naïve"  # 饕, 餮 and 😀 each split across two byte-level tokens
SPLIT_SCRIPT = f"Plan.</think>{SPLIT_TEXT}"


def test_a_split_characters_tokens_carry_their_own_bytes() -> None:
    """A token holding part of a character: its `token` text shows U+FFFD, its `bytes`
    are its own part, so the bytes of the tokens join to the text (chat and Responses)."""
    with scripted_server(SPLIT_SCRIPT, model="scripted") as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="scripted", messages=MESSAGES, max_tokens=32, logprobs=True, top_logprobs=2
        )
        assert reply.choices[0].message.content == SPLIT_TEXT
        content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
        assert content and any("\ufffd" in c.token for c in content)
        # Every generated token, the reasoning and `</think>` (spelled as its text) too.
        assert bytes(b for c in content for b in c.bytes or ()) == SPLIT_SCRIPT.encode("utf-8")
        assert all(c.top_logprobs[0].bytes == c.bytes for c in content)  # the scripted token
        response = client.responses.create(
            model="scripted",
            input=MESSAGES,
            max_output_tokens=32,
            include=["message.output_text.logprobs"],
            top_logprobs=2,
        )
        lps = [lp for part in _output_text_parts(response) for lp in part.logprobs or ()]
        # The text's tokens, `</think>` counted with the text after it.
        joined = bytes(b for lp in lps for b in lp.bytes)
        assert joined == f"</think>{SPLIT_TEXT}".encode()
