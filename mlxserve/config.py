"""Engine and server settings: frozen dataclasses validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mlxserve.kv_quant import DEFAULT_GROUP_SIZE, DEFAULT_QUANTIZE_AFTER, KVQuant, kv_quant_of


def default_prefix_cache_bytes() -> int:
    """A quarter of physical memory (falls back to 4 GiB where it cannot be read)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 1024**3
    return int(total) // 4


SPECULATIVE_MODES = ("off", "ngram", "mtp", "auto")
# What an image sent to a model without a vision tower gets (--images-for-text-models).
IMAGES_FOR_TEXT_MODELS = ("refuse", "placeholder")
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
# Anthropic's API takes up to 100 images a request, and agents re-send a session's
# images with every turn: a lower cap would end a long session with screenshots.
DEFAULT_MAX_IMAGES_PER_REQUEST = 100
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8
    # Tokens one step feeds: one per decoding request plus the prefill chunks.
    max_num_batched_tokens: int = 512
    # The former name of the same budget; when given it sets max_num_batched_tokens.
    max_prefill_tokens: int | None = None
    # While other requests decode or wait, a long prompt's chunk is sized so a
    # step takes about this long (from this model's measured speed). None:
    # STEP_TIME_FACTOR times the measured decode step, so streams keep flowing.
    max_step_ms: float | None = None
    max_waiting: int = 256
    max_model_len: int | None = None
    prefix_cache: bool = True
    prefix_cache_bytes: int | None = None
    prefix_cache_entries: int = 64
    # The prefix cache's disk tier (None: off), its byte budget, and how many
    # tokens an entry grows by before it is written again.
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: int = 64 * 1024**3
    prefix_cache_disk_every: int = 4096
    # One byte budget for running caches, prefix-cache hit copies and the prefix
    # cache; None derives it from the device at load (see engine/budget.py).
    kv_memory_bytes: int | None = None
    # Tokens of growth a request must have room for to be admitted.
    kv_reserve_tokens: int = 64
    # Fail a request that runs longer than this (None: no limit).
    request_timeout_s: float | None = None
    # A step running longer than this is engine death (None: no watchdog).
    step_timeout_s: float | None = 300.0
    # Speculative decoding: "off", "ngram" (prompt lookup), "mtp" or "auto"; up to
    # `num_draft_tokens` drafts per row, matched on n-grams of up to `ngram_size`.
    speculative: str = "off"
    num_draft_tokens: int = 4
    ngram_size: int = 3
    # Distributed serving over mx.distributed: None, "tensor" or "pipeline".
    distributed: str | None = None
    # A quantized KV cache: 8 or 4 bits (None or 0: full precision), its group
    # size, and the tokens each request keeps in full precision first.
    kv_cache_bits: int | None = None
    kv_cache_group_size: int = DEFAULT_GROUP_SIZE
    kv_quantize_after: int = DEFAULT_QUANTIZE_AFTER

    def __post_init__(self) -> None:
        self.kv_quant  # noqa: B018 (validates the three settings; raises ValueError)
        self._check_distributed()
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 1:
            raise ValueError("kv_memory_bytes must be positive")
        if self.kv_reserve_tokens < 0:
            raise ValueError("kv_reserve_tokens must be >= 0")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be positive")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError("step_timeout_s must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]")
        if self.ngram_size < 1:
            raise ValueError("ngram_size must be at least 1")
        if self.max_prefill_tokens is not None:
            if self.max_prefill_tokens < 1:
                raise ValueError("max_prefill_tokens must be at least 1")
            object.__setattr__(self, "max_num_batched_tokens", self.max_prefill_tokens)
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")

    def _check_distributed(self) -> None:
        if self.distributed is None:
            return
        if self.distributed not in ("tensor", "pipeline"):
            raise ValueError("distributed must be tensor or pipeline")
        if self.speculative != "off":
            raise ValueError("speculative decoding is not supported with --distributed yet")
        if self.kv_cache_bits:
            # Ranks holding different shares of the layers would cut prefill pieces differently.
            raise ValueError("--kv-cache-bits is not supported with --distributed yet")
        if self.prefix_cache_dir is not None:
            # Each rank would need its own shard's files, written and read in step.
            raise ValueError("--prefix-cache-dir is not supported with --distributed yet")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError("max_step_ms must be positive")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError("prefix_cache_bytes must be >= 0")
        if self.prefix_cache_entries < 0:
            raise ValueError("prefix_cache_entries must be >= 0")
        if self.prefix_cache_disk_bytes < 0:
            raise ValueError("prefix_cache_disk_bytes must be >= 0")
        if self.prefix_cache_disk_every < 1:
            raise ValueError("prefix_cache_disk_every must be at least 1")

    @property
    def kv_quant(self) -> KVQuant | None:
        return kv_quant_of(self.kv_cache_bits, self.kv_cache_group_size, self.kv_quantize_after)

    @property
    def prefix_cache_budget(self) -> int:
        if self.prefix_cache_bytes is None:
            return default_prefix_cache_bytes()
        return self.prefix_cache_bytes


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    chat_encoder: str = "auto"
    log_level: str = "info"
    max_body_bytes: int = 16 * 1024 * 1024
    # Seconds of silence (a long prefill) after which a stream sends a keep-alive.
    keepalive_interval_s: float = 10.0
    # Responses kept in memory for `previous_response_id` (LRU); 0 keeps none.
    responses_store: int = 256
    # ... and at most this many bytes of them (each counted as its whole conversation).
    responses_store_bytes: int = 512 * 1024 * 1024
    exit_on_engine_failure: bool = True
    # The operator page at /dashboard (--no-dashboard turns it off; /v1/status stays).
    dashboard: bool = True
    # An image to a text-only model: a 400 ("refuse") or a short note in its place.
    images_for_text_models: str = "refuse"
    # Limits on the images of one request (checked before any pixel is decoded).
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST

    def __post_init__(self) -> None:
        if self.images_for_text_models not in IMAGES_FOR_TEXT_MODELS:
            raise ValueError(
                f"images_for_text_models must be one of {', '.join(IMAGES_FOR_TEXT_MODELS)}"
            )
        if self.max_image_pixels < 1:
            raise ValueError("max_image_pixels must be at least 1")
        if self.max_images_per_request < 0:
            raise ValueError("max_images_per_request must be >= 0")
        if not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        if not self.keepalive_interval_s > 0:
            raise ValueError("keepalive_interval_s must be positive")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.responses_store < 0:
            raise ValueError("responses_store must be >= 0")
        if self.responses_store_bytes < 0:
            raise ValueError("responses_store_bytes must be >= 0")
