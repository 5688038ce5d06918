"""`--kv-cache-bits` at the edges: bad settings stop `serve` before it binds its port,
per-model settings, the disk tier's signature, the memory probe, and peak memory."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from api_fixtures import free_port, serve_args

from mlxserve.api import serve
from mlxserve.cache.arrays import cache_nbytes
from mlxserve.cache.signature import model_signature
from mlxserve.engine.cost_probe import probe_cost
from mlxserve.engine.decode_batch import DecodeBatch
from mlxserve.kv_quant import KVQuant
from mlxserve.models.load import load
from mlxserve.models.quantized_cache import apply_kv_quant

HIDDEN = 128  # head size 32: MLX quantizes groups of at least 32 values


@pytest.fixture()
def no_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_bind(*_: Any, **__: Any) -> int:
        raise AssertionError("serve bound its port")

    monkeypatch.setattr(serve, "serve_app", must_not_bind)


@pytest.mark.parametrize(
    ("flags", "family", "reason"),
    [
        (["--kv-cache-bits", "3"], "llama", "--kv-cache-bits must be 8 or 4, not 3"),
        (["--kv-cache-bits", "8", "--kv-cache-group-size", "48"], "llama", "group-size must be"),
        (["--kv-cache-bits", "8", "--kv-quantize-after", "-1"], "llama", "must be >= 0"),
        (["--kv-cache-bits", "4"], "llama", "does not divide the head size 16"),
        (["--kv-cache-bits", "8"], "deepseek_v4", "pooled (compressed) caches"),
        (["--kv-cache-bits", "8"], "deepseek_v41", "LayerCache caches have no quantized form"),
    ],
    ids=["bits-3", "group-48", "negative-after", "head-16", "deepseek-v4", "deepseek-v41"],
)
def test_bad_settings_stop_serve_before_it_binds(
    flags: list[str],
    family: str,
    reason: str,
    model_dir_factory: Callable[..., Path],
    no_bind: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = model_dir_factory(family)
    assert serve.run(serve_args(*flags, model=str(path))) == 2
    err = capsys.readouterr().err
    assert reason in err
    if family.startswith("deepseek"):
        assert path.name in err and family in err  # names the model


def test_the_command_exits_non_zero_with_the_reason_and_the_port_free(
    model_dir_factory: Callable[..., Path],
) -> None:
    port = free_port()
    path = model_dir_factory("llama", layers=2, hidden=HIDDEN)
    command = [sys.executable, "-m", "mlxserve.cli", "serve", str(path), "--port", str(port)]
    done = subprocess.run(
        [*command, "--kv-cache-bits", "3"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "--kv-cache-bits must be 8 or 4" in done.stderr
    with socket.socket() as probe:  # nothing was listening on it
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_each_model_of_a_config_file_has_its_own_setting(
    model_dir_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = model_dir_factory("llama", layers=2, hidden=HIDDEN)
    toml = tmp_path / "models.toml"
    toml.write_text(
        f'[[model]]\nname = "quant"\npath = "{path}"\nkv_cache_bits = 4\n'
        f'kv_cache_group_size = 32\n\n[[model]]\nname = "full"\npath = "{path}"\n'
        "kv_cache_bits = 0\n"
    )
    args = serve_args("--models-config", str(toml), "--kv-cache-bits", "8", model="")
    args.model = None
    _, served = serve.build_app(args)
    configs = {state.model_name: state.engine.config for state in served.models}
    assert configs["quant"].kv_quant == KVQuant(4, 32)
    assert configs["full"].kv_quant is None


def test_the_signature_names_bits_and_group_size(tiny_llama: Path) -> None:
    model = load(tiny_llama)
    config = model.config

    def signature(spec: KVQuant | None) -> str:
        quantized = apply_kv_quant(model, spec)
        return model_signature(tiny_llama, config, quantized.make_cache(), spec)

    seen = {
        signature(spec)
        for spec in (None, KVQuant(8), KVQuant(4), KVQuant(8, 32), KVQuant(8, 64, 100))
    }
    assert len(seen) == 5  # each mode's disk entries are another mode's misses
    # The 4-bit layout is named: entries of the per-position 4-bit layout an earlier
    # version wrote are misses too.
    assert KVQuant(4).described()["layout"] != KVQuant(8).described()["layout"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bfloat16 weights (so a bfloat16 cache) and head size 64 (the default group size)."""
    from mlxserve.bench.kv_quant import tiny_head64_model

    return tiny_head64_model(tmp_path_factory.mktemp("llama-h64"), layers=4)


def test_the_probe_measures_the_quantized_cost(tiny_llama: Path) -> None:
    model = load(tiny_llama)
    full = probe_cost(model, batchable=True).bytes_per_token
    eight = probe_cost(apply_kv_quant(model, KVQuant(8)), batchable=True).bytes_per_token
    four = probe_cost(apply_kv_quant(model, KVQuant(4, 32)), batchable=True).bytes_per_token
    # 8 bits: 64 codes and a bf16 scale and bias per 64 values (68 / 128 bytes);
    # 4 bits in groups of 32: 32 bytes of codes and two scales and biases per 64 values.
    assert eight / full == pytest.approx(68 / 128, rel=0.02)
    assert four / full == pytest.approx(40 / 128, rel=0.02)


@pytest.mark.parametrize(("bits", "share"), [(8, 0.56), (4, 0.31)])
def test_decoding_at_8k_never_holds_a_full_precision_copy(
    tiny_llama: Path, bits: int, share: float
) -> None:
    """A decode step over 8k quantized tokens peaks below the size of the bf16 cache:
    attention reads the codes and never dequantizes the cache into a full copy.
    (On this backend the quantized attention does copy each layer's codes once per
    step for a model whose query heads share KV heads: it broadcasts them.) At 4 bits
    the cache holds at most 127 positions of a layer in full precision (its window).

    The cache is filled by its own writes (what a prefill's attention calls), in
    place of 8k tokens of prefill, which take minutes on this backend."""
    model = apply_kv_quant(load(tiny_llama), KVQuant(bits))
    tokens = 8000  # (not a multiple of 256: the step's write fits the buffer)
    config = model.config
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    cache = model.make_cache()
    mx.random.seed(0)
    for layer in cache:
        shape = (1, kv_heads, tokens, head_dim)
        keys, values = (mx.random.normal(shape).astype(mx.bfloat16) for _ in range(2))
        layer.update_and_fetch(keys, values)
    batch = DecodeBatch()
    batch.add("long", cache)
    del cache, keys, values
    mx.eval([layer.state for layer in batch.cache])
    mx.eval(model.model.last_logits(mx.array([[4]]), batch.cache))  # grows the buffer once
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(model.model.last_logits(mx.array([[5]]), batch.cache))
    transient = mx.get_peak_memory() - held
    bf16_cache = config["num_hidden_layers"] * 2 * kv_heads * head_dim * tokens * 2
    assert batch.cache[0].size() == tokens + 2
    assert cache_nbytes(batch.cache) < share * bf16_cache
    assert 0 < transient < bf16_cache


def test_prefill_pieces_bound_the_scores_by_the_cache() -> None:
    """At long contexts a piece's scores take at most half the quantized cache's bytes;
    at short ones the floor keeps pieces long (an extra forward costs more there)."""
    from mlxserve.engine.kv_quantize import SCORE_BYTES, SCORE_FLOOR_BYTES, prefill_rows

    heads, per_token = 32, 52_000.0  # Qwen3-30B-A3B's cache at 8 bits
    for context in (100_000, 256_000):
        rows = prefill_rows(heads, per_token, context)
        assert rows * heads * context * SCORE_BYTES <= 0.5 * per_token * context
        assert rows >= 16
    assert prefill_rows(heads, per_token, 1024) * heads * 1024 * SCORE_BYTES <= SCORE_FLOOR_BYTES
    assert prefill_rows(heads, per_token, 1024) >= 512


def test_distributed_serving_refuses_a_quantized_cache_for_now() -> None:
    from mlxserve.config import EngineConfig

    with pytest.raises(ValueError, match="not supported with --distributed"):
        EngineConfig(kv_cache_bits=8, distributed="pipeline")
