"""Serve GGUF files: a llama-family `.gguf` converted once into an MLX model directory.

What LM Studio and Ollama users keep on disk is GGUF. MLX reads it itself
(`mx.load(path, return_metadata=True)`): Q4_0, Q4_1 and Q8_0 tensors come
back as MLX affine quantization with group size 32 (`weight`, `scales`,
`biases`), F16, BF16 and F32 as they are. So a conversion renames tensors,
never requantizes them: `convert_gguf` writes `model.safetensors`,
`config.json` (the `{arch}.*` hyper-parameters, with a per-layer
`quantization` entry where a layer's bits differ, e.g. a Q8_0 embedding in
a Q4_1 file) and the tokenizer files (`gguf_tokenizer.py`) into a folder of
the user's cache, named by the file's path, size and modification time, and
every later start reuses it.

MLX casts every other tensor type (the K-quants, IQ types, Q5_0, ...) to
float16, which would silently grow a 4-bit file four times. Those are refused
with their types named, unless the caller asks for `requantize_bits`: then
their float16 values are quantized again to MLX affine 4 or 8-bit.

llama.cpp stores llama's (and Mistral's) q/k projections permuted for
interleaved rotary embeddings; mlx-lm's llama serves them as they are with
`rope_traditional: true`. Qwen2/Qwen3 files are not permuted.

The header (architecture, tensor names and types, a file cut short) is read
with the `gguf` package, llama.cpp's own reader, before anything is
converted, so a file that cannot be served stops `serve` before it binds its
port.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxserve.models.gguf_tokenizer import plain, write_tokenizer
from mlxserve.models.loaded import ModelLoadError

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> mlx-lm model_type.
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# Architectures whose q/k llama.cpp permutes for interleaved (GPT-J style) rotary embeddings.
INTERLEAVED_ROPE = frozenset({"llama", "mistral"})
# Tensor types mx.load keeps as they are (quantized ones as MLX affine, group 32).
QUANTIZED_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
NATIVE_TYPES = frozenset({"F32", "F16", "BF16", *QUANTIZED_BITS})
GROUP_SIZE = 32
REQUANTIZE_BITS = (4, 8)
# Bumped when the converted folder's layout changes, so older conversions are not reused.
FORMAT_VERSION = 1

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# `bias` is a layer's own bias (Qwen2's q/k/v); `scales`/`biases` are MLX quantization's.
_SUFFIXES = ("weight", "bias", "scales", "biases")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file holds, read without its tensor data."""

    path: Path
    architecture: str
    tensors: tuple[GGUFTensorInfo, ...]

    def types(self) -> Counter[str]:
        return Counter(t.type_name for t in self.tensors)


def mlx_name(gguf_name: str) -> str | None:
    """mlx-lm's parameter name for a GGUF tensor name (None: no counterpart)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if stem in _TOP_LEVEL:
        return f"{_TOP_LEVEL[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.{suffix}"
    return None


def read_header(path: Path) -> GGUFHeader:
    """The file's architecture and tensor table; ModelLoadError if it is not a whole GGUF."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.fields.get("general.architecture")
        architecture = str(field.contents()) if field is not None else ""
        tensors = tuple(
            GGUFTensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape))
            for t in reader.tensors
        )
    except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError, struct.error) as e:
        # The reader maps each tensor's bytes: a file cut short fails here.
        raise ModelLoadError(
            f"{path} is not a complete GGUF file (truncated or corrupt): {e}"
        ) from e
    if not architecture:
        raise ModelLoadError(f"{path} has no general.architecture")
    return GGUFHeader(path, architecture, tensors)


def check_header(header: GGUFHeader, requantize_bits: int | None = None) -> None:
    """Refuse, naming why, a file this converter cannot serve as it is."""
    if header.architecture not in ARCHITECTURES:
        raise ModelLoadError(
            f"{header.path}: GGUF architecture {header.architecture!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    unknown = [t.name for t in header.tensors if mlx_name(t.name) is None]
    if unknown:
        raise ModelLoadError(
            f"{header.path}: tensors without a {header.architecture} counterpart in mlx-lm: "
            f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
        )
    foreign = {k: n for k, n in header.types().items() if k not in NATIVE_TYPES}
    if foreign and requantize_bits is None:
        listed = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(foreign.items()))
        raise ModelLoadError(
            f"{header.path}: GGUF tensor types {listed} are not read natively by MLX "
            f"(it reads {', '.join(sorted(NATIVE_TYPES))}); pass --gguf-requantize 4 or 8 to "
            "dequantize them and requantize to MLX affine 4- or 8-bit"
        )
    if requantize_bits is not None and requantize_bits not in REQUANTIZE_BITS:
        raise ModelLoadError(f"--gguf-requantize takes 4 or 8, not {requantize_bits}")


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one `.gguf` in a folder without config.json."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ModelLoadError(f"{path} holds several GGUF files ({names}): name one of them")
    return files[0] if files else None


def cache_root() -> Path:
    """The user's mlxserve cache folder (`MLXSERVE_CACHE_DIR`, else ~/.cache/mlxserve)."""
    return Path(os.environ.get("MLXSERVE_CACHE_DIR") or Path.home() / ".cache" / "mlxserve")


def converted_dir(path: Path, requantize_bits: int | None = None, root: Path | None = None) -> Path:
    """Where the conversion of this file (as it is now on disk) lives in the cache."""
    real = path.resolve()
    stat = real.stat()
    key = f"{real}|{stat.st_size}|{stat.st_mtime_ns}|{requantize_bits}|{FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return (root or cache_root()) / "gguf" / f"{real.stem}-{digest}"


def convert_gguf(
    path: str | Path, requantize_bits: int | None = None, root: Path | None = None
) -> Path:
    """An MLX model directory for this GGUF file: converted on first use, then reused."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    out = converted_dir(path, requantize_bits, root)
    if (out / "config.json").is_file():
        return out
    header = read_header(path)
    check_header(header, requantize_bits)
    logger.info("converting %s into %s", path, out)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_checkpoint(header, requantize_bits, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same conversion first
            logger.debug("conversion already present at %s", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_checkpoint(header: GGUFHeader, requantize_bits: int | None, out: Path) -> None:
    import mlx.core as mx

    try:
        loaded: Any = mx.load(str(header.path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read {header.path}: {e}") from e
    raw, metadata = loaded
    types = {t.name: t.type_name for t in header.tensors}
    weights, bits = _mlx_weights(raw, types, requantize_bits)
    tokenizer = write_tokenizer(metadata, header.architecture, out)
    config = _config(metadata, header, bits, tokenizer)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    source = {"gguf": str(header.path.resolve()), "format_version": FORMAT_VERSION}
    (out / "gguf_source.json").write_text(json.dumps(source, indent=2), encoding="utf-8")


def _mlx_weights(
    raw: dict[str, Any], types: dict[str, str], requantize_bits: int | None
) -> tuple[dict[str, Any], dict[str, int]]:
    """Weights under mlx-lm's names, and the bits of each quantized module."""
    import mlx.core as mx

    weights: dict[str, Any] = {}
    bits: dict[str, int] = {}
    for name, array in raw.items():
        target = mlx_name(name)
        if target is None:
            raise ModelLoadError(f"GGUF tensor {name} has no counterpart in mlx-lm")
        weights[target] = array
        stem, _, suffix = name.rpartition(".")
        module = target.rpartition(".")[0]
        type_name = types.get(f"{stem}.weight", "F32")
        if suffix == "weight" and type_name in QUANTIZED_BITS:
            bits[module] = QUANTIZED_BITS[type_name]
        elif suffix == "weight" and type_name not in NATIVE_TYPES and array.ndim == 2:
            # mx.load gave float16 values; quantize them as MLX does (requantize_bits is set,
            # check_header refused the file otherwise).
            assert requantize_bits is not None
            wq, scales, biases = mx.quantize(array, group_size=GROUP_SIZE, bits=requantize_bits)
            weights.update({target: wq, f"{module}.scales": scales, f"{module}.biases": biases})
            bits[module] = requantize_bits
    return weights, bits


def _quantization(bits: dict[str, int]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` entry: the common bits, and each layer that differs by name."""
    if not bits:
        return None
    common = Counter(bits.values()).most_common(1)[0][0]
    entry: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
    for module, module_bits in sorted(bits.items()):
        if module_bits != common:
            entry[module] = {"group_size": GROUP_SIZE, "bits": module_bits, "mode": "affine"}
    return entry


def _float32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99e-06)."""
    return float(f"{float(value):.7g}")


def _config(
    metadata: dict[str, Any],
    header: GGUFHeader,
    bits: dict[str, int],
    tokenizer: dict[str, Any],
) -> dict[str, Any]:
    arch = header.architecture

    def field(key: str, default: Any = None) -> Any:
        value = plain(metadata.get(f"{arch}.{key}", default))
        if value is None:
            raise ModelLoadError(f"{header.path}: GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):
            raise ModelLoadError(f"{header.path}: per-layer {arch}.{key} is not supported")
        return value

    hidden = int(field("embedding_length"))
    heads = int(field("attention.head_count"))
    vocab = plain(metadata.get(f"{arch}.vocab_size")) or len(metadata["tokenizer.ggml.tokens"])
    names = {t.name for t in header.tensors}
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(field("block_count")),
        "intermediate_size": int(field("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": int(field("attention.key_length", hidden // heads)),
        "rms_norm_eps": _float32(field("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(field("rope.freq_base", 10000.0)),
        "rope_traditional": arch in INTERLEAVED_ROPE,
        "max_position_embeddings": int(field("context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
    }
    for name in ("bos_token_id", "eos_token_id"):
        value = plain(metadata.get(f"tokenizer.ggml.{name}"))
        if isinstance(value, int):
            config[name] = value
    quantization = _quantization(bits)
    if quantization is not None:
        config["quantization"] = quantization
    if "chat_template" not in tokenizer:
        logger.warning("%s has no chat template (tokenizer.chat_template)", header.path)
    return config
