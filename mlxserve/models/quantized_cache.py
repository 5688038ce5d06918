"""A loaded model's caches, quantized (`--kv-cache-bits`): which layers, and the check.

Plain KV layers (mlx-lm's `KVCache`, which grow with the context) become, at
8 bits, mlx-lm's `QuantizedKVCache` (each position quantized on its own); in
a decode batch they merge into our `BatchQuantizedKVCache`
(`models/quantized_batch.py`). At 4 bits they become our
`ChannelQuantizedKVCache` (`models/channel_cache.py`: keys quantized per
channel along the positions, values per position after a Hadamard rotation),
which kept the greedy token at 94% of teacher-forced positions of
SmolLM2-135M where mlx-lm's 4-bit cache kept 78% (`mlxserve bench
kv-quant`); 8 bits per position keep 98.5%. Sliding-window layers
(`RotatingKVCache`) hold at most their window whatever the context, and
mlx-lm has no quantized form of them (`RotatingKVCache.to_quantized` raises),
so they stay in full precision, and the start-up log says so. Any other cache
(DeepSeek-V4's pooled caches, V4.1's layer caches, recurrent state) has no
quantized form: such a model is refused with the reason, never served with
its cache silently left in full precision; so is a model with no plain KV
layer at all, which would gain nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from mlxserve.kv_quant import KVQuant
from mlxserve.models.channel_cache import ChannelQuantizedKVCache
from mlxserve.models.loaded import LoadedModel, ModelLoadError

logger = logging.getLogger(__name__)

# Cache classes whose whole model is refused without looking further: mlx-vlm's
# DeepSeek-V4 keeps its sliding windows and pooled (compressed) caches in CacheLists.
_REFUSED_TYPES = {
    "deepseek_v4": "its sliding-window and pooled (compressed) caches have no quantized form",
}


def _name(cache: Any) -> str:
    return type(cache).__name__


def check_quantizable(caches: list[Any], model: str) -> tuple[int, int]:
    """(plain KV layers to quantize, sliding-window layers kept in full precision).

    Raises ModelLoadError naming the model and the reason when its caches
    cannot be quantized."""
    other = sorted({_name(c) for c in caches if type(c) not in _LAYER_TYPES})
    if other:
        raise ModelLoadError(
            f"--kv-cache-bits: the caches of {model} cannot be quantized: its "
            f"{', '.join(other)} caches have no quantized form (serve it without --kv-cache-bits)"
        )
    growing = sum(1 for c in caches if type(c) in _GROWING_TYPES)
    if growing == 0:
        raise ModelLoadError(
            f"--kv-cache-bits: {model} has only sliding-window caches, which hold a bounded "
            "window and have no quantized form: there is nothing to quantize"
        )
    return growing, len(caches) - growing


_GROWING_TYPES = (KVCache, QuantizedKVCache, ChannelQuantizedKVCache)
_LAYER_TYPES = (*_GROWING_TYPES, RotatingKVCache)


def head_dims(config: dict[str, Any]) -> list[int]:
    """The key/value head sizes a config names (nested text configs included)."""
    text = config.get("text_config") or config.get("language_config") or {}
    dims = []
    for source in (config, text):
        if not isinstance(source, dict):
            continue
        dim = source.get("head_dim")
        heads, hidden = source.get("num_attention_heads"), source.get("hidden_size")
        if not isinstance(dim, int) and isinstance(heads, int) and isinstance(hidden, int):
            dim = hidden // heads if heads else None
        if isinstance(dim, int) and dim > 0:
            dims.append(dim)
    return dims


def query_heads(config: dict[str, Any]) -> int:
    """The attention's query heads a config names (nested text configs included; 1 if none)."""
    text = config.get("text_config") or config.get("language_config") or {}
    for source in (config, text):
        heads = source.get("num_attention_heads") if isinstance(source, dict) else None
        if isinstance(heads, int) and heads > 0:
            return heads
    return 1


def check_group_size(config: dict[str, Any], spec: KVQuant, model: str) -> None:
    for dim in head_dims(config):
        if dim % spec.group_size:
            raise ModelLoadError(
                f"--kv-cache-group-size {spec.group_size} does not divide the head size "
                f"{dim} of {model}: pick one that does (MLX quantizes groups of 32, 64 or "
                "128 values, so a head size that is not a multiple of 32 cannot be quantized)"
            )


def quantize_layers(caches: list[Any], spec: KVQuant) -> list[Any]:
    """Each plain KV layer as a quantized one (what it holds is quantized now);
    other layers as they are."""
    return [quantized_layer(c, spec) if type(c) is KVCache else c for c in caches]


def quantized_layer(cache: KVCache, spec: KVQuant) -> Any:
    if spec.per_channel_keys:
        return ChannelQuantizedKVCache.from_full(
            cache.keys, cache.values, cache.offset, spec.group_size, spec.bits
        )
    return cache.to_quantized(group_size=spec.group_size, bits=spec.bits)


def apply_kv_quant(model: LoadedModel, spec: KVQuant | None) -> LoadedModel:
    """`model` with quantized caches (a new object: a loaded model may be shared).

    Its `extra["kv_quant"]` is the setting; `make_cache` gives quantized layers
    from the start, or, with `quantize_after`, full-precision ones the runner
    quantizes later (`engine/kv_quantize.py`). Raises ModelLoadError where the
    caches cannot be quantized."""
    if spec is None:
        return model
    name = f"{model.path.name} ({model.model_type})"
    if model.model_type in _REFUSED_TYPES:
        raise ModelLoadError(
            f"--kv-cache-bits: the caches of {name} cannot be quantized: "
            f"{_REFUSED_TYPES[model.model_type]}"
        )
    full = model.make_cache
    quantized, windows = check_quantizable(full(), name)
    check_group_size(model.config, spec, name)
    make_cache: Callable[[], list[Any]] = full
    if spec.quantize_after == 0:

        def make_cache() -> list[Any]:
            return quantize_layers(full(), spec)

    logger.info(
        "KV cache of %s: %s in %d layer(s)%s",
        name,
        spec,
        quantized,
        f"; {windows} sliding-window layer(s) stay in full precision (bounded by their window)"
        if windows
        else "",
    )
    extra = {**model.extra, "kv_quant": spec, "full_precision_cache": full}
    return replace(model, make_cache=make_cache, extra=extra)


def check_model_quantizable(path: Path, config: dict[str, Any], spec: KVQuant | None) -> None:
    """Before the port is bound: refuse a model whose caches cannot be quantized.

    Builds the module with lazy weights (nothing is read but the files' headers)
    to see its cache classes. Raises ModelLoadError with the reason."""
    if spec is None:
        return
    model_type = str(config.get("model_type"))
    name = f"{path.name} ({model_type})"
    if model_type in _REFUSED_TYPES:
        raise ModelLoadError(
            f"--kv-cache-bits: the caches of {name} cannot be quantized: "
            f"{_REFUSED_TYPES[model_type]}"
        )
    from mlxserve.models.tiny.scripted import is_scripted

    if is_scripted(config):
        return  # no mlx-lm module: its caches are checked when it loads
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    try:
        module, _ = load_model(path, lazy=True)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot build {name} to check its caches: {e}") from e
    caches = module.make_cache() if hasattr(module, "make_cache") else make_prompt_cache(module)
    check_quantizable(list(caches), name)
    check_group_size(config, spec, name)
