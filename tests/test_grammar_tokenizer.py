"""The grammar tokenizer: built as the engine loads, once per distinct tokenizer file."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from engine_helpers import started_engine

from mlxserve.config import EngineConfig
from mlxserve.engine.constraint import ConstraintError, GrammarTokenizer
from mlxserve.models.loaded import LoadedModel

VOCAB = 129280


def test_tokenizer_files_with_the_same_bytes_share_one_build(
    model_dir_factory: Callable[..., Path], tmp_path: Path
) -> None:
    source = model_dir_factory("qwen3") / "tokenizer.json"
    copy = tmp_path / "tokenizer.json"
    shutil.copyfile(source, copy)
    first = GrammarTokenizer(source, VOCAB, 1)
    first.prepare()
    first.prepare()  # once
    second = GrammarTokenizer(copy, VOCAB, 1)
    assert second.get() is first.get()
    assert GrammarTokenizer(copy, VOCAB, 2).get() is not first.get()  # another end token


def test_a_missing_or_broken_tokenizer_fails_its_requests_without_hanging(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConstraintError, match="needs tokenizer.json"):
        GrammarTokenizer(tmp_path / "tokenizer.json", VOCAB, 1).get()
    broken = tmp_path / "broken.json"
    broken.write_text("{not json", encoding="utf-8")
    with pytest.raises(ConstraintError, match="could not be built"):
        GrammarTokenizer(broken, VOCAB, 1).get()


def test_an_engine_is_ready_with_its_grammar_tokenizer_built(
    loaded_factory: Callable[[str], LoadedModel],
) -> None:
    async def main() -> None:
        engine = await started_engine(EngineConfig(), lambda: loaded_factory("llama"))
        try:
            runner = engine._core.runner
            assert runner is not None
            build = runner.grammar._build
            assert build is not None and build.done() and build.exception() is None
        finally:
            await engine.shutdown()

    asyncio.run(main())
