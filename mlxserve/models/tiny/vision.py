"""Tiny seeded random-weight vision checkpoints (`mlxserve make-model --vision`).

`--family llama --vision` writes a LLaVA checkpoint (mlx-vlm's `llava`): a llama
language model, the family our text tests already run, behind a CLIP vision tower
and a two-layer projector. LLaVA is the simplest VLM mlx-vlm serves: the image's
features replace its placeholder tokens one for one, positions stay plain 1-D
(no multimodal rope to carry into decoding) and attention stays causal, so the
engine runs its language model exactly as it runs a text llama. Its processor is
mlx-vlm's `LlavaProcessor` over a CLIP image processor, both written here as
plain JSON so mlx-vlm loads the checkpoint offline.

The image is 56x56 pixels in 14-pixel patches: 16 image tokens per image.

`--family deepseek_v4 --vision` writes the tiny DeepSeek-V4 of the text family with
mlx-vlm's DeepSeek ViT and aligner (`vision_*` config fields) and the tokenizer's
`<｜deepseek_image｜>` placeholder; mlx-vlm's processor for it needs no file of its own.
`--family deepseek_v41 --vision` is V4.1's (`vision_v41.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mlxserve.models.tiny import synthetic

# The DeepSeek tokenizer's own `<｜image｜>` special token stands for an image.
IMAGE_TOKEN = "<｜image｜>"
IMAGE_TOKEN_ID = 129279
IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
VISION_FAMILIES = ("llama", "deepseek_v4", "deepseek_v41")
# DeepSeek-V4's image placeholder (mlx-vlm's processor), added to the tokenizer past the
# image sentinels (vocab_size + 0..4) the processor writes in its place.
DEEPSEEK_IMAGE_TOKEN = "<｜deepseek_image｜>"
DEEPSEEK_IMAGE_TOKEN_ID = synthetic.VOCAB_SIZE + 10
# A tiny DeepSeek ViT: 14-pixel patches merged 3x3, at most 64 image positions; a
# 60x40 image is 5x3 patches, 2x1 merged features, 10 to 13 positions with its padding.
_DEEPSEEK_VISION = {
    "vision_n_layers": 1,
    "vision_dim": 32,
    "vision_n_heads": 2,
    "vision_inter_dim": 64,
    "vision_patch_size": PATCH_SIZE,
    "vision_downsample_ratio": 3,
    "vision_max_n_token": 64,
    "vision_min_pixels": 42 * 42,
    "vision_max_wh_ratio": 8,
}
# CLIP's normalisation constants (what a real LLaVA's preprocessor_config.json holds).
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def llava_config(layers: int, hidden: int) -> dict[str, Any]:
    text = synthetic.build_config("llama", layers, hidden)
    return {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
            "projection_dim": 32,
            "layer_norm_eps": 1e-5,
        },
        "image_token_index": IMAGE_TOKEN_ID,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": synthetic.VOCAB_SIZE,
        "bos_token_id": synthetic.BOS_ID,
        "eos_token_id": synthetic.EOS_ID,
    }


def _processor_files() -> dict[str, dict[str, Any]]:
    image_processor = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": IMAGE_SIZE},
        "do_center_crop": True,
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "do_convert_rgb": True,
        "resample": 3,
    }
    processor = {
        "processor_class": "LlavaProcessor",
        "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
        "image_token": IMAGE_TOKEN,
    }
    return {"preprocessor_config.json": image_processor, "processor_config.json": processor}


def _write_deepseek_image_token(out: Path) -> None:
    """The tokenizer's files with `DEEPSEEK_IMAGE_TOKEN` as a special token."""
    path = out / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    tokenizer["added_tokens"].append(
        {
            "id": DEEPSEEK_IMAGE_TOKEN_ID,
            "content": DEEPSEEK_IMAGE_TOKEN,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    path.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")


def _make_deepseek_v4(out: Path, seed: int, layers: int | None, hidden: int | None) -> None:
    """mlx-vlm's DeepSeek-V4 with its vision tower: the text family's config with the
    `vision_*` fields; mlx-vlm's processor reads them from config.json."""
    import mlx.core as mx

    config = {**synthetic.build_config("deepseek_v4", layers, hidden), **_DEEPSEEK_VISION}
    weights = synthetic.random_weights(config, seed)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    synthetic.write_tokenizer(out, None)
    _write_deepseek_image_token(out)


def make_vision_model(
    out_dir: str | Path,
    family: str,
    seed: int = 0,
    layers: int | None = None,
    hidden: int | None = None,
) -> Path:
    """Write a vision checkpoint for `family`'s language model (see the module docstring)."""
    import mlx.core as mx

    if family not in VISION_FAMILIES:
        raise ValueError(f"--vision: choose --family {' or '.join(VISION_FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if family == "deepseek_v4":
        _make_deepseek_v4(out, seed, layers, hidden)
        return out
    if family == "deepseek_v41":
        from mlxserve.models.tiny.vision_v41 import make_deepseek_v41

        make_deepseek_v41(out, seed, layers, hidden)
        return out
    default_layers, default_hidden = 2, 64
    config = llava_config(layers or default_layers, hidden or default_hidden)
    weights = synthetic.random_weights(config, seed)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    synthetic.write_tokenizer(out, synthetic.LLAMA_TEMPLATE)
    for name, content in _processor_files().items():
        (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return out


def run(args: argparse.Namespace) -> int:
    """`mlxserve make-model`: a vision checkpoint with --vision, else the text families'."""
    if not args.vision:
        return synthetic.run(args)
    if args.mtp_layers or args.script:
        print("mlxserve make-model: --vision takes no --mtp-layers or --script", file=sys.stderr)
        return 2
    try:
        path = make_vision_model(
            args.out, args.family, seed=args.seed, layers=args.layers, hidden=args.hidden
        )
    except ValueError as e:
        print(f"mlxserve make-model: {e}", file=sys.stderr)
        return 2
    print(f"wrote a random-weight {args.family} checkpoint with a vision tower to {path}")
    return 0
