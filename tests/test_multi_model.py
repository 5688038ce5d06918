"""Several models in one server: naming, routing, one shared KV budget, per-model figures."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from api_fixtures import ServerThread, free_port, metric, serve_args
from engine_helpers import collect, tokens_of

from mlxserve.api.model_specs import ModelSpec, model_specs, parse_model_option
from mlxserve.cli import build_parser
from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.budget import KVPool
from mlxserve.engine.request import SamplingParams
from mlxserve.engine.runner import Runner
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load
from mlxserve.models.tiny.scripted import write_checkpoint

ANSWER = "The big model answers: all tests pass."
SCRIPT = f"Thinking it over.</think>{ANSWER}"


def _serve(*argv: str) -> Any:
    return build_parser().parse_args(["serve", *argv, "--port", str(free_port())])


# -- naming the models ---------------------------------------------------------------


def test_model_options_name_aliases_and_sources() -> None:
    spec = parse_model_option("v4, claude-opus =mlx-community/DeepSeek-V4-Flash-4bit@main")
    assert spec == ModelSpec("v4", "mlx-community/DeepSeek-V4-Flash-4bit@main", ("claude-opus",))
    assert spec.names == ("v4", "claude-opus")
    for bad in ("no-source", "=path", "a,,b=path", "name="):
        with pytest.raises(ValueError):
            parse_model_option(bad)


def test_models_config_file(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text(
        'default = "small"\n'
        '[[model]]\nname = "v4"\npath = "/models/v4"\naliases = ["claude-opus"]\n'
        '[[model]]\nname = "small"\npath = "org/qwen"\ntool_call_parser = "hermes"\n'
    )
    specs, default = model_specs(_serve("--models-config", str(config)))
    assert default == "small"
    assert [s.names for s in specs] == [("v4", "claude-opus"), ("small",)]
    assert specs[1].tool_call_parser == "hermes" and specs[0].tool_call_parser is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[[model]]\nname = 'a'\n", "needs a name and a path"),
        ("[[model]]\nname = 'a'\npath = 'p'\nsize = 3\n", "unknown keys"),
        ("model = 3\n", "no [[model]] tables"),
        ("[[model\n", "--models-config"),
    ],
)
def test_a_bad_models_config_is_a_clear_error(tmp_path: Path, text: str, reason: str) -> None:
    config = tmp_path / "models.toml"
    config.write_text(text)
    with pytest.raises(ValueError, match=reason.replace("[", r"\[")):
        model_specs(_serve("--models-config", str(config)))


def test_conflicting_model_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="given twice"):
        model_specs(_serve("--model", "a,b=p1", "--model", "b=p2"))
    with pytest.raises(ValueError, match="not both"):
        model_specs(_serve("dir", "--model", "a=p"))
    with pytest.raises(ValueError, match="none of the served"):
        model_specs(_serve("--model", "a=p", "--default-model", "zzz"))
    specs, default = model_specs(_serve("dir", "--served-model-name", "x", "y"))
    assert default is None and [s.names for s in specs] == [("x", "y")]


def test_serve_exits_before_binding_when_one_model_is_missing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    model_dir_factory: Callable[..., Path],
) -> None:
    from mlxserve.api import serve

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    def must_not_bind(*args: Any, **kw: Any) -> int:
        raise AssertionError("bound the port")

    monkeypatch.setattr(serve, "serve_app", must_not_bind)
    llama = model_dir_factory("llama")
    args = _serve("--model", f"a={llama}", "--model", "b=nobody/no-such-model")
    assert serve.run(args) == 2
    assert "nobody/no-such-model" in capsys.readouterr().err


# -- one KV budget for every engine ----------------------------------------------------


def test_the_pool_claims_atomically_and_wakes_waiters() -> None:
    woken: list[str] = []
    pool = KVPool(1000)
    pool.join("a", 0, lambda: woken.append("a"))
    pool.join("b", 0, lambda: woken.append("b"))
    assert pool.claim("a", 700)
    assert not pool.claim("b", 400) and pool.room("b") == 300
    pool.want("b", 400)
    assert woken == ["a"]  # a is asked to shrink its prefix cache
    assert pool.prefix_room("a") == 600
    pool.hold("a", 500)
    assert woken == ["a", "b"]  # a's drop wakes b, which waits
    assert pool.claim("b", 400) and pool.room("a") == 600
    pool.measured("a", 500)
    pool.measured("b", 400)
    assert pool.stats()["peak_cache_bytes"] == 900


def test_an_idle_models_prefix_cache_gives_way_to_another_model(
    model_dir_factory: Callable[..., Path],
) -> None:
    """Engine A's cached prefix fills the shared budget; B's request still runs, and
    nothing ever holds more than the budget."""
    path = model_dir_factory("llama")
    first = [(i * 7 + 3) % 200 + 5 for i in range(64)]
    second = [(i * 11 + 1) % 200 + 5 for i in range(600)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    config = EngineConfig(kv_reserve_tokens=0, prefix_cache_bytes=1 << 30)
    cost = Runner(load(path)).probe_cost()

    async def cached_bytes() -> int:
        engine = AsyncEngine(config, lambda: load(path))
        engine.start()
        await engine.wait_ready(timeout=120)
        try:
            await collect(engine.submit(first, params))
            return int(engine.stats()["prefix_cache"]["bytes"])
        finally:
            await engine.shutdown()

    async def main() -> tuple[list[int], dict[str, Any], dict[str, Any]]:
        held = await cached_bytes()
        need = cost.row(len(second) + 1)
        budget = need + held // 2
        # A's request and its cached prefix fit; B's fits only once that prefix is gone.
        assert cost.row(len(first) + 8) + held <= budget < held + need
        pool = KVPool(budget)
        a = AsyncEngine(config, lambda: load(path), pool=pool, member="a")
        b = AsyncEngine(config, lambda: load(path), pool=pool, member="b")
        for engine in (a, b):
            engine.start()
            await engine.wait_ready(timeout=120)
        try:
            await collect(a.submit(first, params))
            assert a.stats()["prefix_cache"]["entries"] == 1
            events = await asyncio.wait_for(collect(b.submit(second, params)), 120)
            return tokens_of(events), a.stats(), pool.stats()
        finally:
            await asyncio.gather(a.shutdown(), b.shutdown())

    tokens, a_stats, pool_stats = asyncio.run(main())
    assert tokens == greedy_generate(load(path), second, 8)
    assert a_stats["prefix_cache"]["entries"] == 0
    assert pool_stats["peak_cache_bytes"] <= pool_stats["budget_bytes"]


# -- two models behind one server --------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(
    model_dir_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    scripted = write_checkpoint(tmp_path_factory.mktemp("scripted-v4"), [SCRIPT])
    return scripted, model_dir_factory("qwen3")


def _budget(qwen: Path) -> int:
    """Room for about two of the small model's requests at once (so admission matters)."""
    return 2 * Runner(load(qwen)).probe_cost().row(200) + (1 << 20)


@pytest.fixture(scope="module")
def two_models(checkpoints: tuple[Path, Path]) -> Any:
    scripted, qwen = checkpoints
    args = _serve(
        "--model",
        f"v4,claude-opus={scripted}",
        "--model",
        f"small,claude-haiku={qwen}",
        "--kv-memory-bytes",
        str(_budget(qwen)),
    )
    with ServerThread(args, loader=None) as srv:
        yield srv


def _single(path: Path, name: str) -> ServerThread:
    return ServerThread(serve_args("--served-model-name", name, model=str(path)), loader=None)


PROMPTS = ["Write a haiku about caches", "Name three rivers", "Count to five", "Say hi"]


def _chat(base_url: str, model: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _concurrently(jobs: list[Callable[[], str]]) -> list[str]:
    with ThreadPoolExecutor(len(jobs)) as workers:
        return list(workers.map(lambda job: job(), jobs))


def test_two_models_stream_at_once_as_each_alone_would(
    two_models: ServerThread, checkpoints: tuple[Path, Path]
) -> None:
    url = two_models.base_url
    jobs = [lambda p=p: _chat(url, "small", p) for p in PROMPTS]  # type: ignore[misc]
    jobs += [lambda p=p: _chat(url, "claude-opus", p) for p in PROMPTS[:2]]  # type: ignore[misc]
    together = _concurrently(jobs)
    scripted, qwen = checkpoints
    with _single(qwen, "small") as alone:
        expected_small = [_chat(alone.base_url, "small", p) for p in PROMPTS]
    assert together[: len(PROMPTS)] == expected_small
    assert together[len(PROMPTS) :] == [ANSWER, ANSWER]
    with httpx.Client(base_url=two_models.url, timeout=30) as http:
        stats = http.get("/v1/cache/stats").json()
    pool = stats["kv_pool"]
    assert 0 < pool["peak_cache_bytes"] <= pool["budget_bytes"]
    assert set(stats["models"]) == {"v4", "small"}


def test_requests_are_routed_by_name_alias_and_default(two_models: ServerThread) -> None:
    claude = anthropic.Anthropic(base_url=two_models.url, api_key="x", max_retries=0)

    def ask(model: str) -> Any:
        return claude.messages.create(
            model=model,
            max_tokens=16,
            messages=[{"role": "user", "content": "Say hi"}],
        )

    big = ask("claude-opus")
    assert big.model == "v4" and big.content[-1].text == ANSWER  # type: ignore[union-attr]
    assert ask("claude-haiku").model == "small"
    assert ask("small").model == "small"
    assert ask("some-other-model").model == "v4"  # the default (the first model)
    with httpx.Client(base_url=two_models.url, timeout=30) as http:
        listed = {m["id"]: m["root"] for m in http.get("/v1/models").json()["data"]}
        assert listed == {
            "v4": "v4",
            "claude-opus": "v4",
            "small": "small",
            "claude-haiku": "small",
        }
        assert http.get("/v1/models/claude-haiku").json()["root"] == "small"
        health = http.get("/health")
        assert health.status_code == 200
        assert health.json()["models"] == {"v4": {"status": "ok"}, "small": {"status": "ok"}}
        text = http.get("/metrics").text
    per_model = {
        name: metric(text, "mlxserve_requests_total", endpoint="messages", model_name=name)
        for name in ("v4", "small")
    }
    assert per_model["v4"] is not None and per_model["v4"] >= 2
    assert per_model["small"] is not None and per_model["small"] >= 2
    assert metric(text, "mlxserve_model_ready", model_name="small") == 1


def test_strict_names_and_a_chosen_default(checkpoints: tuple[Path, Path]) -> None:
    scripted, qwen = checkpoints
    args = _serve(
        "--model",
        f"v4={scripted}",
        "--model",
        f"small,haiku={qwen}",
        "--default-model",
        "haiku",
    )
    with ServerThread(args, loader=None) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.model == "small"
    args = _serve("--model", f"v4={scripted}", "--model", f"small={qwen}", "--strict-model-name")
    with ServerThread(args, loader=None) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert "'v4'" in str(missing.value) and "'small'" in str(missing.value)
