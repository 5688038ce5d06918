"""Tiny GGUF files written the way llama.cpp writes them, with the checkpoint they came from.

`write_tiny_gguf` draws seeded float32 weights under Hugging Face names, writes
them as a GGUF (llama.cpp's tensor names, its q/k permutation for llama, its
metadata keys, a small byte-level BPE vocabulary with ChatML special tokens)
and returns the weights too, so a test can build the same model from them
directly and compare.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (what byte-level vocabularies store)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


TOKENS = [*SPECIALS, *_byte_alphabet(), "Ġt", "he"]
MERGES = ["Ġ t", "h e"]
# A sentencepiece vocabulary (`tokenizer.ggml.model` "llama", as Llama-2 and Mistral files
# have): byte-fallback tokens, pieces with scores and no merges, as long as TOKENS.
SPM_PIECES = ["▁", "▁t", "he", "▁the", "h", "e", "t", "l", "o", "▁hello", "ll", "▁he"]
SPM_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
SPM_TOKENS += [f"<extra_{i}>" for i in range(len(TOKENS) - len(SPM_TOKENS))]


@dataclass
class TinyGGUF:
    path: Path
    config: dict[str, Any]  # the Hugging Face config of the weights
    weights: dict[str, np.ndarray]  # float32, Hugging Face names, unpermuted


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation: rotate-half pairs to interleaved pairs."""
    pairs = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)


def _weights(arch: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def draw(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {"model.embed_tokens.weight": draw(len(TOKENS), HIDDEN, scale=1.0)}
    w["model.norm.weight"] = 1 + draw(HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + draw(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = 1 + draw(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = draw(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = draw(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = draw(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = draw(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = draw(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = draw(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = draw(HIDDEN, FFN)
        if arch == "qwen2":
            for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w[p + f"self_attn.{name}_proj.bias"] = draw(rows * HEAD_DIM)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = 1 + draw(HEAD_DIM)
            w[p + "self_attn.k_norm.weight"] = 1 + draw(HEAD_DIM)
    return w


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
    module, _, suffix = name.rpartition(".")
    if module in top:
        return f"{top[module]}.{suffix}"
    _, _, index, rest = module.split(".", 3)
    return f"blk.{index}.{_GGUF_NAMES[rest]}.{suffix}"


def hf_config(arch: str) -> dict[str, Any]:
    return {
        "model_type": arch,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": len(TOKENS),
        "tie_word_embeddings": True,
    }


def _sentencepiece_vocab(writer: Any) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPM_TOKENS)
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_TOKENS) - 259)]
    writer.add_token_scores(scores)
    kinds = [2, 3, 3, *([6] * 256), *([1] * (len(SPM_TOKENS) - 259))]  # unk, control, byte
    writer.add_token_types(kinds)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def _byte_level_vocab(writer: Any) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in TOKENS])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    types: dict[str, str] | None = None,
    seed: int = 0,
    sentencepiece: bool = False,
) -> TinyGGUF:
    """A tiny GGUF of `arch`; `types` maps a GGUF tensor suffix such as "attn_q.weight" or
    "token_embd.weight" to a ggml type name (default F32 everywhere); a byte-level BPE
    vocabulary, or with `sentencepiece` a sentencepiece one."""
    import gguf

    weights = _weights(arch, seed)
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (
        ("embedding_length", HIDDEN),
        ("block_count", LAYERS),
        ("feed_forward_length", FFN),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV_HEADS),
        ("attention.key_length", HEAD_DIM),
        ("context_length", 2048),
    ):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    (_sentencepiece_vocab if sentencepiece else _byte_level_vocab)(writer)
    writer.add_chat_template(CHATML)
    for name, array in weights.items():
        gguf_name = _gguf_name(name)
        permuted = arch in ("llama", "mistral")
        if permuted and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = HEADS if "attn_q" in gguf_name else KV_HEADS
            array = _permute(array, heads)
        kind = next((t for s, t in (types or {}).items() if gguf_name.endswith(s)), "F32")
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, hf_config(arch), weights)


def write_reference(tiny: TinyGGUF, out: Path) -> Path:
    """The same weights as an MLX checkpoint under Hugging Face names (no GGUF involved)."""
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(tiny.config))
    arrays = {k: mx.array(v) for k, v in tiny.weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), arrays)
    return out
