"""Limits that always exist, and model names any client may send.

The context limit comes from the checkpoint's config (nested text configs
included), else the tokenizer, else --max-model-len, else a logged default;
--max-model-len caps it. `max_tokens` past it is a 400 on the OpenAI routes
for the demo model and every synthetic family. Any model name is served
unless --strict-model-name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from api_fixtures import ServerThread, assert_error_shape, serve_args

from mlxserve.api.errors import APIError
from mlxserve.api.generation import Sampling
from mlxserve.api.models import ServedModels
from mlxserve.api.state import DEFAULT_CONTEXT_LIMIT, ServerState, model_context_length
from mlxserve.config import ServerConfig
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.tiny.synthetic import FAMILIES, build_config

HUGE = 10**9


class _Tokenizer:
    def __init__(self, limit: int | None = None) -> None:
        if limit is not None:
            self.model_max_length = limit


def _model(config: dict[str, Any], tokenizer: Any = None) -> LoadedModel:
    return LoadedModel(
        model=None,
        tokenizer=tokenizer or _Tokenizer(),
        model_type=str(config.get("model_type", "llama")),
        path=Path("."),
        config=config,
        make_cache=list,
        eos_token_ids=frozenset(),
        chat_encoder="template",
        vocab_size=100,
    )


def _state(**kw: Any) -> ServerState:
    return ServerState(engine=None, config=ServerConfig(), model_name="served", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"max_position_embeddings": 4096}, ("max_position_embeddings", 4096)),
        ({"max_seq_len": 2048, "sliding_window": 128}, ("max_seq_len", 2048)),
        ({"seq_length": 1000}, ("seq_length", 1000)),
        ({"n_positions": 1024}, ("n_positions", 1024)),
        ({"model_max_length": 777}, ("model_max_length", 777)),
        (
            {"text_config": {"max_position_embeddings": 131072}},
            ("text_config.max_position_embeddings", 131072),
        ),
        ({"language_config": {"max_seq_len": 8192}}, ("language_config.max_seq_len", 8192)),
        ({"sliding_window": 4096}, None),
        ({"max_position_embeddings": True}, None),
        ({"max_position_embeddings": 0, "text_config": "x"}, None),
    ],
)
def test_context_length_from_config_fields(config: dict[str, Any], expected: Any) -> None:
    assert model_context_length(config) == expected


def test_context_length_falls_back_to_the_tokenizer() -> None:
    assert model_context_length({}, _Tokenizer(16384)) == ("tokenizer model_max_length", 16384)
    assert model_context_length({}, _Tokenizer(int(1e30))) is None
    assert model_context_length({"n_positions": 5}, _Tokenizer(16384)) == ("n_positions", 5)


def test_context_limit_always_exists(caplog: pytest.LogCaptureFixture) -> None:
    assert _state().context_limit(_model({"max_position_embeddings": 4096})) == 4096
    assert (
        _state(max_model_len=1024).context_limit(_model({"max_position_embeddings": 4096})) == 1024
    )
    # --max-model-len above what the model supports is capped to the model's limit.
    assert (
        _state(max_model_len=9999).context_limit(_model({"max_position_embeddings": 4096})) == 4096
    )
    assert _state(max_model_len=300).context_limit(_model({})) == 300
    with caplog.at_level(logging.WARNING, logger="mlxserve.api.state"):
        assert _state().context_limit(_model({})) == DEFAULT_CONTEXT_LIMIT
    assert "names no context length" in caplog.text


def test_max_tokens_budget_and_clamp() -> None:
    state = _state()
    model = _model({"max_position_embeddings": 100})
    assert state.max_tokens(model, Sampling(), 10) == 90
    assert state.max_tokens(model, Sampling(max_tokens=90), 10) == 90
    with pytest.raises(APIError) as e:
        state.max_tokens(model, Sampling(max_tokens=91), 10)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert e.value.param == "max_tokens"
    clamped = Sampling(max_tokens=128000, clamp_max_tokens=True)
    assert state.max_tokens(model, clamped, 10) == 90
    with pytest.raises(APIError) as e:
        state.max_tokens(model, Sampling(max_tokens=5, clamp_max_tokens=True), 100)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


def test_an_overflow_names_the_routes_own_fields() -> None:
    """Completions send a `prompt`, Responses an `input` and a `max_output_tokens`."""
    state = _state()
    model = _model({"max_position_embeddings": 100})
    with pytest.raises(APIError) as e:
        state.max_tokens(model, Sampling(prompt_param="prompt"), 100)
    assert e.value.param == "prompt"
    responses = Sampling(max_tokens=95, prompt_param="input", max_tokens_param="max_output_tokens")
    with pytest.raises(APIError) as e:
        state.max_tokens(model, responses, 10)
    assert e.value.param == "max_output_tokens" and "max_output_tokens (95)" in e.value.message
    with pytest.raises(APIError) as e:
        state.max_tokens(model, replace(responses, max_tokens=0), 10)
    assert e.value.param == "max_output_tokens"


def test_model_names(caplog: pytest.LogCaptureFixture) -> None:
    state = _state(aliases=("served", "deepseek-v4"))
    assert state.served_names == ("served", "deepseek-v4")
    server = ServedModels.one(state)
    with caplog.at_level(logging.INFO, logger="mlxserve.api.models"):
        for name in ("served", "deepseek-v4", None, "", "claude-sonnet-4-5", "claude-sonnet-4-5"):
            assert server.route(name) is state
    assert caplog.text.count("claude-sonnet-4-5") == 1
    strict = ServedModels.one(_state(aliases=("served", "alias")), strict=True)
    strict.route("alias")
    with pytest.raises(APIError) as e:
        strict.route("claude-sonnet-4-5")
    assert e.value.status == 404 and e.value.code == "model_not_found"


def test_synthetic_configs_carry_a_context_length() -> None:
    for family in FAMILIES:
        assert model_context_length(build_config(family)) is not None, family
    assert build_config("deepseek_v4")["max_position_embeddings"] == 1048576
    assert build_config("deepseek_v41")["max_position_embeddings"] == 1048576


def _assert_limits(url: str, limit: int) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        models = http.get("/v1/models").json()["data"]
        assert [m["max_model_len"] for m in models] == [limit] * len(models)
        chat = {"model": "any-name", "messages": [{"role": "user", "content": "Hi"}]}
        for path, body in (
            ("/v1/chat/completions", chat),
            ("/v1/completions", {"model": "any-name", "prompt": "Hi"}),
        ):
            for max_tokens in (HUGE, limit):
                response = http.post(path, json={**body, "max_tokens": max_tokens})
                err = assert_error_shape(response, 400)
                assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_max_tokens_past_the_context_is_a_400(
    family: str, model_dir_factory: Callable[..., Path]
) -> None:
    from mlxserve.models import load

    path = model_dir_factory(family)
    holder: list[LoadedModel] = []

    def loader() -> LoadedModel:
        # Loaded on the engine thread: MLX state belongs to the thread that runs the model.
        holder.append(load(path))
        return holder[0]

    args = serve_args(model=f"tiny-{family}")
    with ServerThread(args, loader) as server:
        model = holder[0]
        limit = model_context_length(model.config, model.tokenizer)
        assert limit is not None
        _assert_limits(server.url, limit[1])


@pytest.fixture(scope="module")
def demo_server(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[ServerThread]:
    monkeypatch_module.setenv("MLXSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    args = serve_args(
        "--demo", "deepseek-v4", "--served-model-name", "mlxserve-demo", "deepseek-v4"
    )
    args.model = None
    with ServerThread(args, None) as server:  # type: ignore[arg-type]
        yield server


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.slow
def test_demo_model_limits_and_names(demo_server: ServerThread) -> None:
    _assert_limits(demo_server.url, 1048576)
    client = openai.OpenAI(base_url=demo_server.base_url, api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["mlxserve-demo", "deepseek-v4"]
    for name in ("claude-sonnet-4-5", "deepseek-v4"):
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert reply.model == "mlxserve-demo"
        assert reply.usage is not None and reply.usage.completion_tokens >= 1


@pytest.mark.slow
def test_strict_model_name_restores_the_404(model_dir_factory: Callable[..., Path]) -> None:
    from mlxserve.models import load

    path = model_dir_factory("llama")
    args = serve_args("--served-model-name", "a", "b", "--strict-model-name")
    with (
        ServerThread(args, lambda: load(path)) as server,
        httpx.Client(base_url=server.url) as http,
    ):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        for name in ("a", "b"):
            response = http.post("/v1/chat/completions", json={**body, "model": name}, timeout=60)
            assert response.status_code == 200 and response.json()["model"] == "a"
        err = assert_error_shape(
            http.post("/v1/chat/completions", json={**body, "model": "c"}, timeout=60), 404
        )
        assert err["code"] == "model_not_found"


def test_model_dir_after_the_names_is_pointed_out(tmp_path: Path) -> None:
    from mlxserve.api.serve import model_path
    from mlxserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--served-model-name", "a", str(tmp_path)])
    with pytest.raises(ValueError, match="give MODEL_DIR before --served-model-name"):
        model_path(args)
    args = build_parser().parse_args(["serve", str(tmp_path), "--served-model-name", "a", "b"])
    assert model_path(args) == tmp_path and args.served_model_name == ["a", "b"]
