"""Loader, synthetic checkpoints and greedy parity with mlx-lm / mlx-vlm."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from mlxserve.cli import main as cli_main
from mlxserve.models.generate import greedy_generate
from mlxserve.models.load import load
from mlxserve.models.loaded import ModelLoadError
from mlxserve.models.tiny.synthetic import FAMILIES, make_model

PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a story about it."


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("family", FAMILIES)
def test_loader_on_every_family(family: str, loaded_factory) -> None:
    model = loaded_factory(family)
    assert model.model_type == family
    assert model.vocab_size == 129280
    assert 1 in model.eos_token_ids
    expected_encoder = family if family.startswith("deepseek") else "template"
    assert model.chat_encoder == expected_encoder
    caches = model.make_cache()
    assert len(caches) == model.config["num_hidden_layers"]
    ids = model.tokenizer.encode("hello world")
    logits = model.model(mx.array([ids]), caches)
    assert logits.shape == (1, len(ids), 129280)


@pytest.mark.parametrize("family", FAMILIES)
def test_last_logits_match_full_logits(family: str, loaded_factory) -> None:
    model = loaded_factory(family)
    ids = model.tokenizer.encode(PROMPT)
    full = model.model(mx.array([ids]), model.make_cache())[:, -1, :]
    last = model.model.last_logits(mx.array([ids]), model.make_cache())
    assert last.shape == (1, 129280)
    assert mx.allclose(full, last, atol=1e-3).item()


def test_make_model_is_deterministic(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", "deepseek_v4", seed=3)
    b = make_model(tmp_path / "b", "deepseek_v4", seed=3)
    c = make_model(tmp_path / "c", "deepseek_v4", seed=4)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]
    assert set(_digest(a)) == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_make_model_cli_sizes(tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert cli_main(["make-model", str(out), "--family", "llama", "--layers", "1"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert config["hidden_size"] == 64


def test_deepseek_v4_config_covers_every_layer_kind(model_dir_factory) -> None:
    config = json.loads((model_dir_factory("deepseek_v4") / "config.json").read_text())
    assert set(config["compress_ratios"]) == {0, 4, 128}
    assert config["hc_mult"] > 1
    assert 0 < config["num_hash_layers"] < config["num_hidden_layers"]
    model = load(model_dir_factory("deepseek_v4"))
    kinds = {type(c).__name__ for c in model.make_cache()}
    assert kinds == {"RotatingKVCache", "CacheList"}


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v41"])
def test_greedy_parity_with_mlx_lm(family: str, loaded_factory) -> None:
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model = loaded_factory(family)
    ids = model.tokenizer.encode(PROMPT)
    ours = greedy_generate(model, ids, 12, stop_at_eos=False)
    module = model.model.module
    theirs = [
        int(tok)
        for tok, _ in generate_step(
            mx.array(ids), module, max_tokens=12, prompt_cache=make_prompt_cache(module)
        )
    ]
    assert ours == theirs


def test_greedy_parity_with_mlx_vlm_deepseek_v4(model_dir_factory, loaded_factory) -> None:
    """Same tokens as mlx-vlm's own generate until a decode step closes a pooling window.

    From there on mlx-vlm pools that window without the previous one (see
    dsv4_overlap); ours carries it, as a whole-prompt prefill does.
    """
    from mlx_vlm.generate import generate_step
    from mlx_vlm.utils import load_model

    model = loaded_factory("deepseek_v4")
    vlm = load_model(model_dir_factory("deepseek_v4"))
    ids = model.tokenizer.encode(PROMPT)
    for length in (8, 13, len(ids)):
        prompt = ids[:length]
        steps_before_window_closes = 4 - length % 4
        ours = greedy_generate(model, prompt, steps_before_window_closes, stop_at_eos=False)
        theirs = [
            int(tok)
            for tok, _ in generate_step(
                mx.array([prompt]),
                vlm,
                None,
                None,
                max_tokens=steps_before_window_closes,
                temperature=0.0,
            )
        ]
        assert ours == theirs


def test_deepseek_v4_chunked_prefill_equals_whole_prompt(loaded_factory) -> None:
    """The upstream compressor loses its overlap window at every call boundary; ours not."""
    model = loaded_factory("deepseek_v4")
    ids = (model.tokenizer.encode(PROMPT) * 12)[:150]

    def logits_after(splits: list[int]) -> mx.array:
        cache = model.make_cache()
        start = 0
        for size in splits:
            logits = model.model.last_logits(mx.array([ids[start : start + size]]), cache)
            start += size
        assert start == len(ids)
        return logits

    whole = logits_after([150])
    for splits in ([16] * 9 + [6], [7, 13, 130], [1] * 150):
        assert mx.allclose(whole, logits_after(splits), atol=1e-4).item(), splits


def test_load_errors_name_the_problem(tmp_path: Path, model_dir_factory) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        load(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load(empty)
    broken = tmp_path / "broken"
    shutil.copytree(model_dir_factory("llama"), broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load(broken)
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    with pytest.raises(ModelLoadError, match="no_such_arch"):
        load(broken)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(model_dir_factory("llama"), no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load(no_weights)


def test_model_without_template_or_encoder_is_rejected(tmp_path: Path, model_dir_factory) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(model_dir_factory("llama"), plain)
    config_path = plain / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("chat_template")
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelLoadError, match="chat template"):
        load(plain)


def test_generate_cli(model_dir_factory, capsys: pytest.CaptureFixture[str]) -> None:
    path = model_dir_factory("llama")
    assert cli_main(["generate", str(path), "--prompt", "hi", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def test_last_logits_with_tied_embeddings(tmp_path: Path, model_dir_factory) -> None:
    tied = tmp_path / "tied"
    shutil.copytree(model_dir_factory("qwen3"), tied)
    config = json.loads((tied / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(config))
    model = load(tied)
    ids = model.tokenizer.encode(PROMPT)
    full = model.model(mx.array([ids]), model.make_cache())[:, -1, :]
    last = model.model.last_logits(mx.array([ids]), model.make_cache())
    assert mx.allclose(full, last, atol=1e-3).item()


def test_dependency_pins_match_what_serve_checks() -> None:
    """pyproject pins exactly the versions `mlxserve serve` checks at start."""
    import re
    from pathlib import Path

    from mlxserve.versions import PINNED, version_problems

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    for package, wanted in PINNED.items():
        pins = re.findall(rf'"{re.escape(package)}(?:\[cpu\])?==([^;"]+)', text)
        assert pins and set(pins) == {wanted}, (package, pins)
    assert version_problems() == []  # this environment is what the tests ran against


def test_serve_refuses_other_dependency_versions(monkeypatch) -> None:
    from mlxserve import versions

    monkeypatch.setitem(versions.PINNED, "mlx-lm", "0.0.1")
    problems = versions.version_problems()
    assert len(problems) == 1 and "mlx-lm 0.32.2" in problems[0] and "0.0.1" in problems[0]
    with pytest.raises(RuntimeError, match="mlx-lm"):
        versions.check_versions()


def test_an_unknown_model_type_is_a_clear_load_error(model_dir_factory, tmp_path) -> None:
    import json
    import shutil

    from mlxserve.models.load import load
    from mlxserve.models.loaded import ModelLoadError

    bogus = tmp_path / "bogus"
    shutil.copytree(model_dir_factory("llama"), bogus)
    config = json.loads((bogus / "config.json").read_text())
    config["model_type"] = "no_such_family"
    (bogus / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no_such_family"):
        load(bogus)
