"""What a process read from a checkpoint directory is reused only while the
directory's files are unchanged: the tokenizer, and an engine's measured cache cost."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from mlxserve.engine.runner import Runner
from mlxserve.models.load import load
from mlxserve.models.tokenizer import load_tokenizer


def test_a_tokenizer_is_read_again_only_when_its_files_change(
    model_dir_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(model_dir_factory("llama"), path)
    first = load_tokenizer(path)
    assert load_tokenizer(path) is first
    assert load_tokenizer(path, eos_token_id=[1]) is not first
    config = path / "tokenizer_config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    again = load_tokenizer(path)
    assert again is not first
    assert again.encode("hello") == first.encode("hello")


def test_an_engine_reuses_a_cost_measured_for_the_same_checkpoint(
    model_dir_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(model_dir_factory("llama"), path)
    measured = Runner(load(path)).probe_cost(reuse=True)
    # The same object, not an equal one measured again.
    assert Runner(load(path)).probe_cost(reuse=True) is measured
    assert Runner(load(path)).probe_cost() is not measured
    weights = next(path.glob("*.safetensors"))
    weights.touch()
    assert Runner(load(path)).probe_cost(reuse=True) is not measured
