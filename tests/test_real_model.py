"""A trained model through a real `mlxserve serve FILE.gguf`: SmolLM2-135M-Instruct.

One server (with `--speculative ngram`, which must not change a token) serves
every test; mlx-lm's own greedy `stream_generate` on the same converted
checkpoint is the oracle. Every real token costs about 0.1-0.2 s on the CPU
backend, so prompts are short, `max_tokens` small, and a prompt the tests
send more than once is prefilled once (the prefix cache serves the rest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from api_fixtures import ServeProcess, metric
from real_model import real_model_cache, smollm2_checkpoint, smollm2_gguf_path

pytestmark = pytest.mark.slow

CAPITAL = "What is the capital of France? Answer in one sentence."
PROMPTS = (CAPITAL, "Name the three primary colors.", "Say hello in Spanish.")
MAX_TOKENS = 8
COPY_TASK = "Repeat this code exactly:\ndef area(width, height):\n    return width * height\n"


@dataclass(frozen=True)
class Reference:
    """mlx-lm's greedy answer: its tokens (EOS included when it ends the answer), its text."""

    tokens: tuple[int, ...]
    text: str
    ended: bool


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    return smollm2_checkpoint()


MULTIBYTE = "Repeat exactly: café, naïve, 東京, 北京"
# Every answer the tests compare with, in the order they first need them.
REFERENCES = [
    *((prompt, MAX_TOKENS) for prompt in PROMPTS),
    (CAPITAL, 16),
    (MULTIBYTE, 20),
    (COPY_TASK, 20),
]


@pytest.fixture(scope="session")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`reference(prompt, max_tokens)` -> Reference: mlx-lm's own greedy answer, computed
    in a process of its own (`real_reference.py`), started before the server, so the
    oracle and the server under test share the machine's cores instead of taking turns."""
    folder = tmp_path_factory.mktemp("reference")
    (folder / "requests.json").write_text(json.dumps(REFERENCES))
    script = Path(__file__).with_name("real_reference.py")
    argv = [sys.executable, str(script), str(checkpoint), str(folder / "requests.json")]
    log = (folder / "log.txt").open("w")
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    answers: dict[str, Any] = {}

    def get(prompt: str, max_tokens: int) -> Reference:
        key = f"{prompt}\n{max_tokens}"
        while key not in answers:  # each line arrives as soon as its answer is computed
            line = process.stdout.readline() if process.stdout else ""
            assert line, (folder / "log.txt").read_text()[-3000:]
            found = json.loads(line)
            answers[found["key"]] = found
        found = answers[key]
        return Reference(tuple(found["tokens"]), found["text"], found["ended"])

    yield get
    if process.poll() is None:
        process.kill()
    process.wait()
    log.close()


@pytest.fixture(scope="session")
def server(checkpoint: Path, reference: Any) -> Iterator[ServeProcess]:
    """`mlxserve serve SmolLM2-135M-Instruct.Q4_1.gguf`: the GGUF file itself, whose
    conversion (`checkpoint`, in the same cache) the server finds and reuses."""
    env = {**os.environ, "MLXSERVE_CACHE_DIR": str(real_model_cache())}
    argv = (str(smollm2_gguf_path()), "--served-model-name", "smollm2", "--speculative", "ngram")
    with ServeProcess(*argv, env=env) as process:
        yield process


def _openai(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(server: ServeProcess, prompt: str, stream: bool, **kw: Any) -> tuple[str, str | None]:
    client = _openai(server)
    messages: Any = [{"role": "user", "content": prompt}]
    kw = {"model": "smollm2", "messages": messages, "temperature": 0, **kw}
    if not stream:
        reply = client.chat.completions.create(**kw)
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _messages(server: ServeProcess, prompt: str, stream: bool, max_tokens: int) -> str:
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    kw: Any = {
        "model": "smollm2",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
        "extra_body": {"temperature": 0},  # (this SDK no longer sends it itself)
    }
    if not stream:
        reply = client.messages.create(**kw)
        return "".join(b.text for b in reply.content if b.type == "text")
    with client.messages.stream(**kw) as events:
        return "".join(events.text_stream)


def _responses(server: ServeProcess, prompt: str, stream: bool, max_tokens: int) -> str:
    client = _openai(server)
    kw: Any = {
        "model": "smollm2",
        "input": prompt,
        "max_output_tokens": max_tokens,
        "temperature": 0,
    }
    if not stream:
        return client.responses.create(**kw).output_text
    text = ""
    for event in client.responses.create(stream=True, **kw):
        if event.type == "response.output_text.delta":
            text += event.delta
    return text


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_answers_equal_mlx_lm_on_every_dialect(server, reference, index: int) -> None:
    """Each prompt over chat, Messages and Responses; streamed and not, alternating."""
    prompt = PROMPTS[index]
    stream = index % 2 == 0
    chat, _ = _chat(server, prompt, stream, max_tokens=MAX_TOKENS)
    messages = _messages(server, prompt, not stream, MAX_TOKENS)
    responses = _responses(server, prompt, stream, MAX_TOKENS)
    expected = reference(prompt, MAX_TOKENS)
    assert (chat, messages, responses) == (expected.text,) * 3
    if index == 0:
        assert "Paris" in expected.text


def test_end_of_turn_stop_string_and_length(server, reference) -> None:
    whole = _chat(server, CAPITAL, stream=False, max_tokens=16)
    cut = _chat(server, CAPITAL, stream=True, max_tokens=16, stop=["Paris"])
    short, finish = _chat(server, CAPITAL, stream=False, max_tokens=3)
    expected = reference(CAPITAL, 16)
    assert expected.ended  # the model's own <|im_end|>, well before 16 tokens
    assert whole == (expected.text, "stop")
    assert cut == (expected.text.split("Paris")[0], "stop")
    assert finish == "length" and expected.text.startswith(short) and short != expected.text


def test_multibyte_text_streams_whole_and_logprobs_name_the_token(server, reference) -> None:
    prompt = MULTIBYTE
    client = _openai(server)
    deltas: list[str] = []
    logprobs: list[Any] = []
    for chunk in client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=20,
        stream=True,
        logprobs=True,
        top_logprobs=3,
    ):
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                logprobs.extend(chunk.choices[0].logprobs.content)
    expected = reference(prompt, 20)
    assert expected.ended  # a whole answer: no character cut by max_tokens
    assert any(ord(c) > 0x3000 for c in expected.text) and "é" in expected.text
    assert "".join(deltas) == expected.text
    assert all("\ufffd" not in d for d in deltas)  # no character split across deltas
    # One entry per token chosen (the end-of-turn token has no text and no entry), whose
    # best alternative is the token itself.
    assert len(logprobs) == len(expected.tokens) - 1
    for entry in logprobs:
        best = max(entry.top_logprobs, key=lambda t: t.logprob)
        assert (best.token, best.logprob) == (entry.token, entry.logprob)


def test_second_turn_of_a_conversation_hits_the_prefix_cache(server) -> None:
    first, _ = _chat(server, CAPITAL, stream=False, max_tokens=MAX_TOKENS)
    turn2 = [
        {"role": "user", "content": CAPITAL},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And of Italy?"},
    ]
    reply = _openai(server).chat.completions.create(
        model="smollm2", messages=turn2, temperature=0, max_tokens=2
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    turn1 = httpx.post(
        server.url + "/v1/messages/count_tokens",
        json={"model": "smollm2", "messages": [{"role": "user", "content": CAPITAL}]},
        timeout=30,
    ).json()["input_tokens"]
    assert reply.usage.prompt_tokens_details.cached_tokens >= turn1


def test_ngram_drafts_on_a_copy_task_keep_the_tokens(server, reference) -> None:
    before = _spec_accepted(server)
    text, _ = _chat(server, COPY_TASK, stream=True, max_tokens=20)
    expected = reference(COPY_TASK, 20)
    assert "return width * height" in expected.text
    assert text == expected.text
    assert _spec_accepted(server) > before


def _spec_accepted(server: ServeProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return metric(text, "mlxserve_spec_accepted_tokens_total", model_name="smollm2") or 0.0


def test_the_converted_checkpoint_names_its_source(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    source = json.loads((checkpoint / "gguf_source.json").read_text())
    assert source["gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
