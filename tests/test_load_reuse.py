"""What a process read from a checkpoint directory is reused only while what it was
read from is unchanged: the tokenizer (by its files' contents), and an engine's
measured cache cost."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from mlxserve.engine import cost_probe
from mlxserve.engine.budget import CacheCost
from mlxserve.engine.cost_store import CostStore
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
    # The same files in another folder, touched, or beside other weights: the same one.
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    for weights in copy.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:-1] + b" ")
    os.utime(copy / "tokenizer.json", ns=(1, 1))
    assert load_tokenizer(copy) is first
    # Other contents (here the chat template): read again.
    config = path / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["chat_template"] = "{{ messages[0]['content'] }}"
    config.write_text(json.dumps(settings))
    again = load_tokenizer(path)
    assert again is not first
    assert again.encode("hello") == first.encode("hello")
    assert again.chat_template != first.chat_template


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


def test_a_cost_measured_by_another_process_is_read_from_disk(
    model_dir_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = load(model_dir_factory("llama"))
    measured = CacheCost(1234, 56.5)
    calls: list[int] = []

    def measure() -> CacheCost:
        calls.append(1)
        return measured

    def in_a_new_process() -> CacheCost:
        monkeypatch.setattr(cost_probe, "_MEASURED", {})
        return cost_probe.measured_once(model, True, measure)

    assert in_a_new_process() == measured and len(calls) == 1
    assert in_a_new_process() == measured and len(calls) == 1  # read, not measured
    files = list((tmp_path / "cache" / "costs").iterdir())
    assert len(files) == 1
    # Another setting is another file; a distributed shard never reads or writes one.
    assert cost_probe.measured_once(model, False, measure) == measured and len(calls) == 2
    model.extra["shard"] = "rank 0 of 2"
    in_a_new_process()
    in_a_new_process()
    assert len(calls) == 4 and len(list(files[0].parent.iterdir())) == 2


def test_a_stored_cost_in_doubt_is_a_miss_and_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CostStore(tmp_path)
    key = ("ckpt", (("model.safetensors", 10, 1),), "{}", True)
    cost = CacheCost(100, 8.0)
    store.write(key, cost)
    assert store.read(key) == cost
    assert store.read((*key[:-1], False)) is None  # another key: no file
    other = CostStore(tmp_path)
    other.versions = {**other.versions, "mlx": "0.0.0"}
    assert other.read(key) is None  # other code: its own file name
    path = store.path(key)
    good = json.loads(path.read_text())
    for bad in (
        b"{not json",
        b"\xff\xfe",
        b"[]",
        json.dumps({**good, "key": "another checkpoint"}).encode(),
        json.dumps({**good, "versions": {**good["versions"], "mlx-lm": "9"}}).encode(),
        json.dumps({**good, "format": 0}).encode(),
        json.dumps({**good, "fixed_bytes": -1}).encode(),
        json.dumps({**good, "fixed_bytes": 1.5}).encode(),
        json.dumps({**good, "bytes_per_token": "8"}).encode(),
        json.dumps({**good, "bytes_per_token": float("nan")}).encode(),
    ):
        path.write_bytes(bad)
        caplog.clear()
        assert store.read(key) is None
        assert not path.exists()
        assert "removed" in caplog.text
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_folder_that_cannot_be_written_only_costs_a_measurement(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    store = CostStore(blocked / "costs")  # its parent is a file
    store.write(("k",), CacheCost(1, 1.0))
    assert "cannot store" in caplog.text
    assert store.read(("k",)) is None
