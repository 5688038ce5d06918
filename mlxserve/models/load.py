"""Load a model directory: mlx-lm for most families, mlx-vlm for DeepSeek-V4."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxserve.models.adapter import ModelAdapter
from mlxserve.models.loaded import LoadedModel, ModelLoadError
from mlxserve.models.progress import LoadProgress
from mlxserve.models.prompt_format import check_renderable, choose_encoder
from mlxserve.models.tiny.scripted import is_scripted, load_checkpoint
from mlxserve.models.tokenizer import load_tokenizer
from mlxserve.models.vision import (
    VISION_TYPES,
    VisionTower,
    has_vision_tower,
    load_tower,
    load_vision,
)

logger = logging.getLogger(__name__)

VLM_TYPES = frozenset({"deepseek_v4"})


def read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory")
    if not config_file.is_file():
        raise ModelLoadError(f"{config_file} is missing")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file} must hold a JSON object")
    if not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"{config_file} has no model_type")
    return config


def _check_files(path: Path) -> None:
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"no *.safetensors weight files in {path}")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise ModelLoadError(f"no tokenizer.json or tokenizer.model in {path}")


def _check_supported(path: Path, config: dict[str, Any]) -> None:
    """Fail now, not minutes into a load, when no library has a module for this family."""
    model_type = config["model_type"]
    if model_type in VLM_TYPES | VISION_TYPES or config.get("model_file"):
        return  # mlx-vlm's module, or one the checkpoint ships (mlx-lm checks it at load)
    import importlib.util

    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

    # The module names mlx-lm would try: by architecture first, then by model_type.
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    modules = [MODEL_ARCHITECTURE_REMAPPING.get((model_type, str(a))) for a in architectures]
    modules.append(MODEL_REMAPPING.get(model_type, model_type))
    names = [m for m in modules if m and m.isidentifier()]
    if not any(importlib.util.find_spec(f"mlx_lm.models.{m}") for m in names):
        raise ModelLoadError(
            f"model_type {model_type!r} in {path / 'config.json'} is not supported by mlx-lm "
            f"(nor mlx-vlm's {', '.join(sorted(VLM_TYPES | VISION_TYPES))})"
        )


def check_model_dir(path: str | Path, chat_encoder: str = "auto") -> dict[str, Any]:
    """What can be checked without loading: config, files, family and prompt encoder.

    `serve` runs it before it binds its port, so a model that cannot load stops the
    process with the reason instead of leaving a server that can never answer.
    Returns the config.
    """
    path = Path(path)
    config = read_config(path)
    try:
        choose_encoder(config["model_type"], chat_encoder)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    if not is_scripted(config):
        _check_files(path)
        _check_supported(path, config)
    return config


# Called on the lazily built module before its weights are read (`models/shard.py`).
ShardFn = Callable[[Any, str], None]


def _load_module(
    path: Path, config: dict[str, Any], progress: LoadProgress, shard: ShardFn | None = None
) -> tuple[Any, Any]:
    """The language module and, for a vision checkpoint, mlx-vlm's whole model (else
    None), their weights materialised slice by slice (progress by bytes).

    `shard` (distributed serving) cuts the module to this rank's part first, so
    only that part's weights are read."""
    model_type = config["model_type"]
    progress.enter("module")
    vlm: Any = None
    # DeepSeek-V4 sharded across ranks is served as before, reading text only.
    blind = shard is not None and model_type in VLM_TYPES
    if has_vision_tower(config) and not blind:
        if shard is not None:
            raise ModelLoadError(f"{model_type} vision checkpoints cannot be served distributed")
        module, vlm = _load_vision_module(path, config)
    elif model_type in VLM_TYPES:
        from mlx_vlm.utils import load_model as vlm_load_model

        module = vlm_load_model(path, lazy=True).language_model
    else:
        from mlx_lm.utils import load_model

        try:
            module, _ = load_model(path, lazy=True)
        except ValueError as e:  # mlx-lm has no module for this model_type
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported by mlx-lm: {e}"
            ) from e
    if shard is not None:
        shard(module, model_type)
    _materialise(_loaded_modules(model_type, module, vlm), progress)
    return module, vlm


def _loaded_modules(model_type: str, module: Any, vlm: Any) -> list[Any]:
    """What a load evaluates: mlx-vlm's whole model where it holds the language module
    (LLaVA's arrays are shared, DeepSeek-V4's is it); V4.1's holds the tower alone."""
    if vlm is None:
        return [module]
    return [module, vlm] if model_type == "deepseek_v41" else [vlm]


def _load_vision_module(path: Path, config: dict[str, Any]) -> tuple[Any, Any]:
    if config["model_type"] != "deepseek_v41":
        return load_vision(path, config)
    from mlxserve.models.deepseek_v4 import v41_image_route
    from mlxserve.models.deepseek_v4.v41_vision import load_v41_vision

    module, vlm, bias_vl = load_v41_vision(path)
    v41_image_route.install(module, bias_vl, int(vlm.config.image_token_id))
    return module, vlm


def _materialise(modules: list[Any], progress: LoadProgress) -> None:
    """Evaluate the lazily loaded parameters in slices of about 1/50 of their bytes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    flat: Any = [kv for module in modules for kv in tree_flatten(module.parameters())]
    arrays = [a for _, a in flat if isinstance(a, mx.array)]
    total = sum(int(a.nbytes) for a in arrays)
    logger.info("reading %.2f GB of weights", total / 1e9)
    progress.enter("weights")
    step = max(total // 50, 1)
    done = pending = 0
    group: list[Any] = []
    for array in arrays:
        group.append(array)
        pending += int(array.nbytes)
        if pending >= step:
            mx.eval(group)
            done, pending, group = done + pending, 0, []
            progress.weights(done, total)
    if group:
        mx.eval(group)
    progress.weights(total, total)


def min_prefill_chunk(model_type: str) -> int:
    """The shortest prefill chunk worth cutting for this family.

    mlx-vlm's DeepSeek-V4 runs blocks of up to `DECODE_BLOCK_SIZE` (8) positions
    through decode-equivalent projections, one position at a time, and longer
    ones as one matrix product: on the tiny checkpoint a 4-token chunk costs
    15.8 ms, an 8-token one 23.5 ms, a 9-token one 11.0 ms.
    """
    if model_type in VLM_TYPES:
        from mlx_vlm.models.linear import DECODE_BLOCK_SIZE

        return int(DECODE_BLOCK_SIZE) + 1
    return 1


def _vocab_size(tokenizer: Any, config: dict[str, Any]) -> int:
    size = config.get("vocab_size")
    if size or tokenizer is None:
        return int(size or 0)
    return len(tokenizer.get_vocab())


def _eos_ids(tokenizer: Any, config: dict[str, Any]) -> frozenset[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    configured = config.get("eos_token_id")
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, list):
        ids.update(int(i) for i in configured)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def load(
    path: str | Path,
    chat_encoder: str = "auto",
    progress: LoadProgress | None = None,
    shard: ShardFn | None = None,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load weights, tokenizer and cache factory; raise ModelLoadError on any problem.

    `progress` (if given) follows the load: stage and fraction of weight bytes.
    `shard`: load only this rank's shard (`models/shard.Sharding`).
    `with_tokenizer=False` (a distributed follower, which only runs forwards) skips
    the tokenizer and the prompt-format check: `tokenizer` is None.
    """
    progress = progress or LoadProgress(bar=False)
    path = Path(path)
    config = check_model_dir(path, chat_encoder)
    encoder = choose_encoder(config["model_type"], chat_encoder)
    model_type = config["model_type"]
    if is_scripted(config):
        if shard is not None:
            raise ModelLoadError("scripted test checkpoints cannot be served distributed")
        return _load_scripted(path, config, encoder)
    logger.info("loading %s model from %s", model_type, path)
    try:
        module, vlm = _load_module(path, config, progress, shard)
        progress.enter("tokenizer")
        tokenizer = load_tokenizer(path, config.get("eos_token_id")) if with_tokenizer else None
        tower = (
            _load_tower(path, module, vlm, config) if vlm is not None and with_tokenizer else None
        )
    except (ValueError, KeyError, TypeError, FileNotFoundError, OSError) as e:
        raise ModelLoadError(f"cannot load {path}: {type(e).__name__}: {e}") from e
    # A vision checkpoint's language model runs as its own family does alone.
    adapter = ModelAdapter(module, _language_type(config))
    loaded = LoadedModel(
        model=adapter,
        tokenizer=tokenizer,
        model_type=model_type,
        path=path,
        config=config,
        make_cache=adapter.make_cache,
        eos_token_ids=_eos_ids(tokenizer, config),
        chat_encoder=encoder,
        vocab_size=_vocab_size(tokenizer, config),
        min_prefill_chunk=min_prefill_chunk(model_type),
        reads_images=tower is not None,
        vision=tower,
    )
    if shard is not None:
        # What this rank holds (its measured cache cost differs from another rank's).
        loaded.extra["shard"] = repr(shard)
        if not getattr(shard, "batchable", lambda _: True)(model_type):
            loaded.extra["batchable"] = False
    if tokenizer is not None:
        _check_renderable(loaded)
    progress.enter("ready")
    logger.info("loaded %s (%s, chat encoder %s)", path, model_type, loaded.chat_encoder)
    return loaded


def _load_tower(path: Path, module: Any, vlm: Any, config: dict[str, Any]) -> VisionTower:
    if config["model_type"] == "deepseek_v41":
        from mlx_vlm.utils import load_processor

        from mlxserve.models.deepseek_v4.v41_vision import DeepseekV41Tower

        processor = load_processor(path, add_detokenizer=False)
        return DeepseekV41Tower(vlm, processor, module.model.embed_tokens.inner)
    if config["model_type"] == "deepseek_v4":
        from mlx_vlm.utils import load_processor

        from mlxserve.models.deepseek_v4.vision import DeepseekV4Tower

        processor = load_processor(path, add_detokenizer=False)
        return DeepseekV4Tower(vlm, processor, int(config["vocab_size"]))
    return load_tower(path, vlm, config)


def _language_type(config: dict[str, Any]) -> str:
    if config["model_type"] in VISION_TYPES:
        return str(config["text_config"]["model_type"])
    return str(config["model_type"])


def _load_scripted(path: Path, config: dict[str, Any], encoder: str) -> LoadedModel:
    logger.info("loading a scripted test checkpoint from %s", path)
    try:
        loaded = load_checkpoint(path, config, encoder)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot load {path}: {e}") from e
    _check_renderable(loaded)
    return loaded


def _check_renderable(model: LoadedModel) -> None:
    check_renderable(model)
