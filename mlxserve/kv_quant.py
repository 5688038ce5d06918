"""The quantized KV cache setting of one served model (`--kv-cache-bits` and friends).

Plain data, no MLX: the command line and `config.py` validate it before
anything loads. What it does to a model's caches is in `models/quantized_cache.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The widths whose quality is measured (`mlxserve bench kv-quant`, README).
KV_CACHE_BITS = (8, 4)
# The group sizes MLX's affine quantization kernels take.
KV_CACHE_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
# Tokens of each request kept in full precision before its cache is quantized.
# 0, unlike mlx-lm's `--quantized-kv-start` 5000: rows of one decode batch share
# one cache type, so a request is quantized by the time it decodes anyway, and
# with 0 every prefix-cache entry and every row is in one form, so a cold run,
# a batch, a hit and a disk restore give the same tokens whatever the chunking.
DEFAULT_QUANTIZE_AFTER = 0


# The widths whose keys are quantized per channel, in groups of `group_size`
# positions (`models/channel_cache.py`); the others per position, as mlx-lm does.
PER_CHANNEL_KEY_BITS = (4,)


@dataclass(frozen=True)
class KVQuant:
    """Keys and values stored as `bits`-bit affine codes, one scale and bias per group
    of `group_size` numbers: at 8 bits the channels of one position (mlx-lm's
    `QuantizedKVCache`); at 4 bits, for keys, the positions of one channel, and
    for values the channels of one position after a Hadamard rotation."""

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE
    quantize_after: int = DEFAULT_QUANTIZE_AFTER

    def __post_init__(self) -> None:
        if self.bits not in KV_CACHE_BITS:
            raise ValueError(
                f"--kv-cache-bits must be 8 or 4, not {self.bits} (only those widths "
                "are measured for quality; leave it out for a full-precision cache)"
            )
        if self.group_size not in KV_CACHE_GROUP_SIZES:
            sizes = ", ".join(str(s) for s in KV_CACHE_GROUP_SIZES)
            raise ValueError(
                f"--kv-cache-group-size must be one of {sizes} (what MLX's quantization "
                f"kernels take), not {self.group_size}"
            )
        if self.quantize_after < 0:
            raise ValueError(f"--kv-quantize-after must be >= 0, not {self.quantize_after}")

    @property
    def per_channel_keys(self) -> bool:
        return self.bits in PER_CHANNEL_KEY_BITS

    def described(self) -> dict[str, Any]:
        """What a stored cache entry depends on (the disk tier's model signature).

        The layout is named, so entries of a layout an older version wrote (4-bit
        keys per position) never restore into this one."""
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "quantize_after": self.quantize_after,
            "layout": "keys per channel, values rotated"
            if self.per_channel_keys
            else "per position",
        }

    def __str__(self) -> str:
        after = f", after {self.quantize_after} tokens" if self.quantize_after else ""
        keys = ", keys per channel" if self.per_channel_keys else ""
        return f"{self.bits}-bit, group {self.group_size}{keys}{after}"


def kv_quant_of(bits: int | None, group_size: int, quantize_after: int) -> KVQuant | None:
    """The setting these flags give (None: a full-precision cache; bits 0 means off too)."""
    if bits is None or bits == 0:
        if group_size not in KV_CACHE_GROUP_SIZES or quantize_after < 0:
            KVQuant(KV_CACHE_BITS[0], group_size, quantize_after)  # raises with the reason
        return None
    return KVQuant(bits, group_size, quantize_after)
