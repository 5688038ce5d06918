"""The tiny DeepSeek-V4.1 with a vision tower (`make-model --family deepseek_v41 --vision`).

Its language model is the text family's tiny V4.1 (`text_config`, seeded); the
checkpoint adds mlx-vlm 0.7.10's V4.1 ViT, aligner and learnt image delimiter rows
(`vision_*` config fields), and a `bias_vl` per MoE gate, drawn apart from `bias` so
that image positions route to other experts than text would.

Both loaders read one file: mlx-lm's `deepseek_v41` (the language model we serve) and
mlx-vlm's (the oracle, with the tower) each rename DeepSeek's own tensor names to
theirs, so the checkpoint is written in those names (`layers.N.attn.wq_a`, `embed`,
`head`, `layers.N.ffn.experts.E.w1`, ...). mlx-lm's sanitize drops the vision tensors
and `bias_vl`; `native_names` is checked to invert it exactly.

The image placeholder `<｜deepseek_image｜>` is the tokenizer's added token 129264,
mlx-vlm's default `image_token_id` (a token id inside the vocabulary: the processor
keeps it at every position of the image's span and the model embeds it before the
merge overwrites it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mlxserve.models.tiny import synthetic

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
IMAGE_TOKEN_ID = 129264
# The vision tensors come from their own stream of random numbers (the text weights stay
# those of the text checkpoint of the same seed).
VISION_SEED_OFFSET = 104729
# A tiny ViT: 14-pixel patches merged 3x3, at most 64 image positions; a 60x40 image
# is padded to 70x42 (5x3 patches), one row of 2 merged features: a span of start, 2
# features, newline, end (5 positions); 120x90 is 9x7 patches, a span of 3 * 4 + 2 = 14.
_VISION = {
    "vision_num_layers": 1,
    "vision_hidden_size": 32,
    "vision_num_heads": 2,
    "vision_intermediate_size": 64,
    "vision_patch_size": 14,
    "vision_downsample_ratio": 3,
    "vision_min_pixels": 42 * 42,
    "vision_max_image_tokens": 64,
    "vision_max_wh_ratio": 8,
}
# mlx-lm's names -> DeepSeek's, the inverse of mlx-lm 0.32.2's `deepseek_v41._rename`.
_NATIVE = (
    (".self_attn.", ".attn."),
    (".mlp.", ".ffn."),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.", ".hc_attn_"),
    (".ffn_hc.", ".hc_ffn_"),
    (".sinks", ".attn_sink"),
    (".q_a_proj.", ".wq_a."),
    (".q_b_proj.", ".wq_b."),
    (".compressor.gate_proj.", ".compressor.wgate."),
    (".kv_proj.", ".wkv."),
    (".o_a_proj.", ".wo_a."),
    (".o_b_proj.", ".wo_b."),
    (".q_a_norm.", ".q_norm."),
    (".compressor.kv_norm.", ".compressor.norm."),
    (".indexer.k_proj.", ".indexer.wk."),
    (".gate.e_score_correction_bias", ".gate.bias"),
    (".shared_experts.gate_proj.", ".shared_experts.w1."),
    (".shared_experts.down_proj.", ".shared_experts.w2."),
    (".shared_experts.up_proj.", ".shared_experts.w3."),
)
_SWITCH = re.compile(r"layers\.(\d+)\.ffn\.experts\.switch_mlp\.(gate|down|up)_proj\.weight")
_EXPERT_W = {"gate": "w1", "down": "w2", "up": "w3"}


def text_config(layers: int | None, hidden: int | None) -> dict[str, Any]:
    """The text family's tiny V4.1 with 32-wide indexer heads: mlx-vlm's fake quantiser
    takes whole blocks of 32 only (mlx-lm's leaves a narrower vector as it is)."""
    return {**synthetic.build_config("deepseek_v41", layers, hidden), "index_head_dim": 32}


def vision_config(layers: int | None, hidden: int | None) -> dict[str, Any]:
    # mlx-vlm's V4.1 defaults to engram layers 1 and 14; mlx-lm's V4.1 refuses them.
    extra = {"image_token_id": IMAGE_TOKEN_ID, "engram_layer_ids": []}
    return {**text_config(layers, hidden), **_VISION, **extra}


def native_names(weights: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's V4.1 parameters under DeepSeek's checkpoint names: routed experts one
    tensor per expert, `wo_a` one matrix over its groups."""
    out: dict[str, Any] = {}
    for key, value in weights.items():
        if key == "lm_head.weight":
            out["head.weight"] = value
            continue
        if key == "model.embed_tokens.weight":
            out["embed.weight"] = value
            continue
        name = key.removeprefix("model.")
        for ours, theirs in _NATIVE:
            name = name.replace(ours, theirs)
        switch = _SWITCH.fullmatch(name)
        if switch is not None:
            layer, proj = switch.groups()
            for expert in range(value.shape[0]):
                out[f"layers.{layer}.ffn.experts.{expert}.{_EXPERT_W[proj]}.weight"] = value[expert]
            continue
        if name.endswith(".wo_a.weight"):  # (groups, rank, in): both sanitizers split it
            value = value.reshape(-1, value.shape[-1])
        out[name] = value
    return out


def _vision_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """mlx-vlm's ViT, aligner and image delimiter rows, seeded (the delimiters start at
    zero in mlx-vlm's module: drawn here, so each is its own row)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.deepseek_v41 import Model, ModelConfig

    mx.random.seed(seed + VISION_SEED_OFFSET)
    model = Model(ModelConfig.from_dict(config))
    flat: Any = tree_flatten(model.parameters())
    weights = {k: v for k, v in flat if k.startswith(("vision.", "aligner."))}
    for name in ("image_start", "image_end", "image_newline"):
        weights[name] = mx.random.normal((config["hidden_size"],))
    return weights


def _bias_vl(weights: dict[str, Any], config: dict[str, Any], seed: int) -> dict[str, Any]:
    """One `bias_vl` per gate, of the scores' own scale (sqrt(softplus(.)) is about 1):
    enough to move an image position's top-2 experts."""
    import mlx.core as mx

    key = mx.random.key(seed + VISION_SEED_OFFSET + 1)
    gates = sorted(k for k in weights if k.endswith(".ffn.gate.bias"))
    keys = mx.random.split(key, len(gates))
    return {
        gate + "_vl": mx.random.normal((config["n_routed_experts"],), key=keys[n])
        for n, gate in enumerate(gates)
    }


def _check_round_trip(config: dict[str, Any], text: dict[str, Any], native: dict[str, Any]) -> None:
    """mlx-lm's own sanitize must give back the text weights exactly (ValueError if not)."""
    import mlx.core as mx
    from mlx_lm.models import deepseek_v41

    model = deepseek_v41.Model(deepseek_v41.ModelArgs.from_dict(config))
    back = model.sanitize(dict(native))
    if set(back) != set(text) or any(not mx.array_equal(back[k], text[k]) for k in text):
        raise ValueError("the V4.1 checkpoint names do not invert mlx-lm's sanitize")


def _write_placeholder_token(out: Path) -> None:
    """The tokenizer's added token IMAGE_TOKEN_ID renamed to the placeholder (special)."""
    path = out / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    for token in tokenizer["added_tokens"]:
        if token["id"] == IMAGE_TOKEN_ID:
            token.update(content=IMAGE_PLACEHOLDER, special=True)
    path.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    decoder = tokenizer_config.get("added_tokens_decoder", {})
    if str(IMAGE_TOKEN_ID) in decoder:
        decoder[str(IMAGE_TOKEN_ID)].update(content=IMAGE_PLACEHOLDER, special=True)
    config_path.write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def make_deepseek_v41(out: Path, seed: int, layers: int | None, hidden: int | None) -> None:
    """Write the checkpoint (see the module docstring) into `out`."""
    import mlx.core as mx

    config = vision_config(layers, hidden)
    text = synthetic.random_weights(text_config(layers, hidden), seed)
    native = native_names(text)
    _check_round_trip(config, text, native)
    weights = {**native, **_bias_vl(native, config, seed), **_vision_weights(config, seed)}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    synthetic.write_tokenizer(out, None)
    _write_placeholder_token(out)
