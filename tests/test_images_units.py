"""Images without a server: URL and base64 parsing, the checks, the note, each dialect's
conversion, and `settle_images` (limits, refusal, placeholders, the metrics' tally)."""

from __future__ import annotations

from typing import Any

import pytest
from image_helpers import (
    anthropic_image,
    b64,
    data_url,
    encoded,
    openai_image,
    png,
    png_header,
    responses_image,
    truncated_png,
)

from mlxserve.api.anthropic.convert import prompt_request
from mlxserve.api.anthropic.protocol import CountTokensRequest
from mlxserve.api.errors import APIError
from mlxserve.api.images import ImagePolicy, settle_images
from mlxserve.api.openai.convert import chat_messages
from mlxserve.api.responses.convert import chat_messages as responses_messages
from mlxserve.chat import PromptRequest
from mlxserve.chat.images import (
    ImageError,
    ImageInput,
    ImageLimits,
    ImagePart,
    check_image,
    data_url_parts,
)
from mlxserve.chat.messages import PromptError, normalise_messages

LIMITS = ImageLimits(max_pixels=10_000, max_images=2)


@pytest.mark.parametrize(
    ("fmt", "media_type"),
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")],
)
def test_each_kind_is_read_with_its_size_and_hash(fmt: str, media_type: str) -> None:
    data = encoded(fmt, (7, 5))
    part = check_image(ImageInput("m[0]", url=data_url(data, media_type)), LIMITS)
    assert (part.media_type, part.width, part.height) == (media_type, 7, 5)
    assert part.data == data and len(part.sha256) == 64 and part.where == "m[0]"


def test_an_undeclared_type_is_read_from_the_bytes() -> None:
    part = check_image(ImageInput("x", url="data:;base64," + b64(png())), LIMITS)
    assert part.media_type == "image/png"
    assert data_url_parts("data:image/jpg;base64,AAAA", "x") == ("AAAA", "image/jpeg")


def test_the_note_is_the_image_facts_only() -> None:
    first = check_image(
        ImageInput("a", data=b64(png((640, 480))), media_type="image/png"), ImageLimits()
    )
    again = check_image(ImageInput("b", data=b64(png((640, 480), (1, 2, 3)))), ImageLimits())
    expected = "[image: image/png, 640x480, not shown: this model reads text only]"
    assert first.note() == again.note() == expected
    assert first.sha256 != again.sha256


BAD_URLS = [
    ("", "empty"),
    ("   ", "empty"),
    ("https://example.com/cat.png", "not fetched"),
    ("HTTP://10.0.0.1/x.png", "not fetched"),
    ("file:///etc/passwd", "scheme 'file'"),
    ("ftp://host/x.png", "scheme 'ftp'"),
    ("cat.png", "scheme"),
    ("data:image/png,abc", "base64"),
    ("data:image/png;base64,", "no image data"),
    ("data:image/bmp;base64,AAAA", "unsupported image media type"),
    ("data:application/pdf;base64,AAAA", "unsupported image media type"),
]


@pytest.mark.parametrize(("url", "match"), BAD_URLS)
def test_bad_urls_are_refused_before_any_decoding(url: str, match: str) -> None:
    with pytest.raises(ImageError, match=match) as info:
        data_url_parts(url, "messages[1].content[2]")
    assert info.value.where == "messages[1].content[2]"
    assert str(info.value).startswith("messages[1].content[2]: ")


BAD_BYTES = [
    ("not base64", "@@@not base64@@@", "image/png", "base64"),
    ("not an image", b64(b"hello, this is text"), "image/png", "not a readable"),
    ("an SVG", b64(b"<svg xmlns='http://www.w3.org/2000/svg'/>"), None, "not a readable"),
    ("a BMP", b64(encoded("BMP")), None, "not a readable"),
    ("truncated", b64(truncated_png()), "image/png", "truncated"),
    ("zero-sized", b64(png_header(0, 5)), "image/png", "not a readable"),
    ("a bomb", b64(png_header(100_000, 100_000)), "image/png", "too large"),
    ("over the limit", b64(png((200, 200))), "image/png", "40000 pixels"),
    ("type disagrees", b64(encoded("JPEG")), "image/png", "declared image/png"),
    ("zero bytes", "====", "image/png", "base64|empty"),
    ("no data", "", "image/png", "non-empty base64"),
    ("data not a string", 5, "image/png", "non-empty base64"),
    ("type not a string", b64(png()), 3, "must be a string"),
]


@pytest.mark.parametrize(
    ("data", "media_type", "match"), [c[1:] for c in BAD_BYTES], ids=[c[0] for c in BAD_BYTES]
)
def test_bad_bytes_are_refused(data: Any, media_type: Any, match: str) -> None:
    with pytest.raises(ImageError, match=match):
        check_image(ImageInput("p", data=data, media_type=media_type), LIMITS)


def test_the_chat_stage_never_renders_an_image_it_was_handed() -> None:
    image = ImageInput("x", data=b64(png()), media_type="image/png")
    with pytest.raises(PromptError, match="cannot hold images"):
        normalise_messages([{"role": "user", "content": [image]}])


def _prompt(*parts: Any) -> PromptRequest:
    return PromptRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        + [{"role": "user", "content": list(parts)}]
    )


def _settle(prompt: PromptRequest, mode: str = "placeholder") -> tuple[Any, list[Any]]:
    tally: list[tuple[str, int]] = []
    policy = ImagePolicy(LIMITS, mode)

    def count(outcome: str, n: int) -> None:
        tally.append((outcome, n))

    try:
        out: Any = settle_images(
            prompt, model_name="m", reads_images=False, policy=policy, count=count
        )
    except APIError as e:
        out = e
    return out, tally


def test_placeholder_mode_puts_each_note_in_place() -> None:
    image = ImageInput("messages[1].content[0]", data=b64(png((3, 2))), media_type="image/png")
    out, tally = _settle(_prompt(image, {"type": "text", "text": "what is it?"}))
    assert out.messages[1]["content"] == [
        {"type": "text", "text": "[image: image/png, 3x2, not shown: this model reads text only]"},
        {"type": "text", "text": "what is it?"},
    ]
    assert tally == [("placeholder", 1)]
    plain = _prompt({"type": "text", "text": "x"})
    assert _settle(plain)[0] is plain


def test_refuse_mode_names_the_model_and_the_part_after_checking() -> None:
    good = ImageInput("messages[1].content[0]", data=b64(png()), media_type="image/png")
    err, tally = _settle(_prompt(good), mode="refuse")
    assert isinstance(err, APIError) and err.status == 400
    assert err.code == "model_reads_text_only" and err.param == "messages[1].content[0]"
    assert "'m' reads text only" in err.message and "--images-for-text-models" in err.message
    assert tally == [("refused", 1)]
    bad = ImageInput("messages[1].content[0]", data="AAAA", media_type="image/png")
    err, tally = _settle(_prompt(bad, good), mode="refuse")
    assert err.code == "invalid_image" and tally == [("invalid", 1), ("skipped", 1)]


def test_too_many_images_names_the_first_one_past_the_limit() -> None:
    parts = [ImageInput(f"messages[1].content[{j}]", data=b64(png())) for j in range(3)]
    err, tally = _settle(_prompt(*parts))
    assert err.code == "too_many_images" and err.param == "messages[1].content[2]"
    assert "holds 3, the limit is 2" in err.message and tally == [("over_limit", 3)]


def test_openai_image_url_parts_become_image_inputs_in_user_and_tool_turns() -> None:
    url = data_url(png())
    messages = chat_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, openai_image(url)]},
            {"role": "user", "content": [{"type": "image_url", "image_url": url}]},
        ]
    )
    first, second = messages[0]["content"][1], messages[1]["content"][0]
    assert isinstance(first, ImageInput) and first.where == "messages[0].content[1]"
    assert isinstance(second, ImageInput) and second.url == url
    with pytest.raises(APIError, match="only a user or tool message"):
        chat_messages([{"role": "assistant", "content": [openai_image(url)]}])
    with pytest.raises(APIError, match="needs image_url.url") as info:
        chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert info.value.param == "messages[0].content[0]"


def _anthropic(messages: list[dict[str, Any]], settle: bool = False) -> list[Any]:
    req = CountTokensRequest.model_validate({"model": "m", "messages": messages})
    prompt = prompt_request(req)
    if settle:
        prompt = settle_images(prompt, model_name="m", reads_images=False, policy=ImagePolicy())
    return list(prompt.messages)


def test_anthropic_images_in_a_user_turn_and_inside_a_tool_result() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.png"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "a.png"}, anthropic_image(png())],
    }
    messages = _anthropic(
        [
            {"role": "user", "content": [anthropic_image(png()), {"type": "text", "text": "q"}]},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]
    )
    user, _, tool = messages
    assert isinstance(user["content"][0], ImageInput)
    assert user["content"][0].where == "messages[0].content[0]"
    assert tool["role"] == "tool" and tool["content"][0] == {"type": "text", "text": "a.png"}
    assert tool["content"][1].where == "messages[2].content[0].content[1]"
    text_only = {
        **result,
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    messages = _anthropic([*_pair(call), {"role": "user", "content": [text_only]}])
    assert messages[-1]["content"] == "a\nb"  # text-only results render as before


def _pair(call: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": [call]}]


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ({"type": "url", "url": "https://x/y.png"}, "not fetched"),
        ({"type": "file", "file_id": "file_1"}, "Files API"),
        ({"type": "base64", "media_type": "image/png", "data": ""}, "non-empty base64"),
        ({"type": "base64", "media_type": "image/tiff", "data": "AAAA"}, "unsupported"),
        ({"type": "weird"}, "unknown image source"),
        ({}, "source must be an object"),
    ],
)
def test_anthropic_bad_image_sources(source: dict[str, Any], match: str) -> None:
    with pytest.raises(APIError, match=match) as info:
        _anthropic([{"role": "user", "content": [{"type": "image", "source": source}]}], True)
    assert info.value.status == 400 and info.value.param == "messages[0].content[0]"


def test_responses_input_image_parts() -> None:
    url = data_url(png())
    messages = responses_messages(
        [],
        [{"role": "user", "content": [{"type": "input_text", "text": "a"}, responses_image(url)]}],
    )
    assert isinstance(messages[0]["content"][1], ImageInput)
    call = {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": [responses_image(url)]}
    messages = responses_messages([], [{"role": "user", "content": "q"}, call, output])
    assert messages[-1]["role"] == "tool" and isinstance(messages[-1]["content"][0], ImageInput)
    cases = [
        ({"type": "input_image", "file_id": "file_1"}, "file_id is not supported"),
        ({"type": "input_image"}, "needs image_url"),
        (responses_image("http://169.254.169.254/latest"), "not fetched"),
    ]
    for part, match in cases:
        with pytest.raises(APIError, match=match) as info:
            messages = responses_messages([], [{"role": "user", "content": [part]}])
            prompt = PromptRequest(messages=messages)
            settle_images(prompt, model_name="m", reads_images=False, policy=ImagePolicy())
        assert info.value.param == "input[0].content[0]"
    with pytest.raises(APIError, match="assistant message cannot hold an image"):
        responses_messages([], [{"role": "assistant", "content": [responses_image(url)]}])


def test_limits_are_checked_on_construction() -> None:
    with pytest.raises(ValueError):
        ImageLimits(max_pixels=0)
    assert isinstance(ImagePart(b"", "image/png", 1, 1, "h").note(), str)


def test_an_image_read_before_is_not_decoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-sent history: the same bytes are read from the header and decoded once; later
    checks still hold them to the limits and to the type declared this time."""
    from mlxserve.chat import images

    opened: list[int] = []
    real_open = images.Image.open

    def counting_open(*args: object, **kwargs: object) -> object:
        opened.append(1)
        return real_open(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(images.Image, "open", counting_open)
    monkeypatch.setattr(images, "_READ", images._ReadImages(capacity=4))
    url = data_url(png((3, 2)))
    first = check_image(ImageInput("a", url=url), LIMITS)
    again = check_image(ImageInput("b", url=url), LIMITS)
    assert (first.width, first.height, first.sha256) == (again.width, again.height, again.sha256)
    assert len(opened) == 1
    with pytest.raises(ImageError, match="declared image/jpeg"):
        check_image(ImageInput("c", url=url.replace("image/png", "image/jpeg")), LIMITS)
    with pytest.raises(ImageError, match="too large"):
        check_image(ImageInput("d", url=url), ImageLimits(max_pixels=5, max_images=2))
    assert len(opened) == 1
