"""`mlxserve serve`: build the engine and the app, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI

from mlxserve.api.app import create_app
from mlxserve.api.metrics import Metrics
from mlxserve.api.model_specs import ModelSpec, model_specs
from mlxserve.api.models import ServedModels
from mlxserve.api.state import ServerState
from mlxserve.config import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    EngineConfig,
    ServerConfig,
)
from mlxserve.engine.budget import KVPool
from mlxserve.kv_quant import KVQuant
from mlxserve.models.loaded import LoadedModel
from mlxserve.models.progress import LoadProgress
from mlxserve.models.resolve import resolve_model
from mlxserve.versions import check_versions

if TYPE_CHECKING:
    from mlxserve.engine.distributed.group import PlanGroup
    from mlxserve.models.shard import Sharding

logger = logging.getLogger("mlxserve.serve")

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_step_ms=args.max_step_ms,
        max_waiting=args.max_waiting,
        max_model_len=args.max_model_len,
        prefix_cache=not args.no_prefix_cache,
        prefix_cache_bytes=args.prefix_cache_bytes,
        prefix_cache_entries=args.prefix_cache_entries,
        prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_disk_bytes=args.prefix_cache_disk_bytes,
        prefix_cache_disk_every=args.prefix_cache_disk_every,
        kv_memory_bytes=args.kv_memory_bytes,
        request_timeout_s=args.request_timeout,
        step_timeout_s=args.step_timeout or None,
        speculative=args.speculative,
        num_draft_tokens=args.num_draft_tokens,
        ngram_size=args.ngram_size,
        distributed=getattr(args, "distributed", None),
        kv_cache_bits=getattr(args, "kv_cache_bits", None),
        kv_cache_group_size=getattr(args, "kv_cache_group_size", 64),
        kv_quantize_after=getattr(args, "kv_quantize_after", 0),
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        api_key=args.api_key,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_encoder=args.chat_encoder,
        log_level=args.log_level,
        max_body_bytes=args.max_body_bytes,
        keepalive_interval_s=args.keepalive_interval,
        responses_store=args.responses_store,
        responses_store_bytes=args.responses_store_bytes,
        exit_on_engine_failure=args.exit_on_engine_failure,
        dashboard=not getattr(args, "no_dashboard", False),
        images_for_text_models=getattr(args, "images_for_text_models", "refuse"),
        max_image_pixels=getattr(args, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS),
        max_images_per_request=getattr(
            args, "max_images_per_request", DEFAULT_MAX_IMAGES_PER_REQUEST
        ),
    )


def model_path(args: argparse.Namespace) -> Path:
    if args.demo:
        from mlxserve.models.tiny.demo import demo_model_path

        return demo_model_path(args.demo)
    if not args.model:
        names = args.served_model_name or []
        if len(names) > 1 and Path(names[-1]).is_dir():
            raise ValueError(
                "give MODEL_DIR before --served-model-name (which takes several names): "
                f"mlxserve serve {names[-1]} --served-model-name {' '.join(names[:-1])}"
            )
        raise ValueError("give a MODEL (a directory or a Hugging Face ORG/NAME) or --demo")
    return resolve_model(args.model, getattr(args, "gguf_requantize", None))


def checked_model_path(
    args: argparse.Namespace,
    source: str | None = None,
    chat_encoder: str | None = None,
    kv_quant: KVQuant | None = None,
) -> Path:
    """The model's directory, checked as far as it can be without loading it.

    Runs before the port is bound: a Hugging Face id is resolved (downloaded if
    need be) and a model that cannot load (no such name, a missing file, an
    unsupported family, caches `kv_quant` cannot quantize) raises ModelLoadError
    with the reason. `source` is one of several models' PATH_OR_ID (else the
    positional MODEL, or --demo).
    """
    from mlxserve.models.deepseek_v4.mtp import require_mtp_weights
    from mlxserve.models.load import check_model_dir
    from mlxserve.models.quantized_cache import check_model_quantizable

    requantize = getattr(args, "gguf_requantize", None)
    path = model_path(args) if source is None else resolve_model(source, requantize)
    config = check_model_dir(path, chat_encoder or args.chat_encoder)
    if args.speculative == "mtp":
        require_mtp_weights(path, config)
    check_model_quantizable(path, config, kv_quant)
    return path


Loader = Callable[[], LoadedModel]


def build_app(
    args: argparse.Namespace,
    loader: Loader | None = None,
    loaders: Mapping[str, Loader] | None = None,
    group: PlanGroup | None = None,
) -> tuple[FastAPI, ServedModels]:
    """The app for these CLI arguments. `loader` (one model) or `loaders` (by model name)
    override loading from disk, for tests. `group`: rank 0 of a distributed run
    (`--distributed`), which loads its shard and sends each step's plan to the others."""
    specs, default = model_specs(args)
    several = len(specs) > 1
    if several and group is not None:
        raise ValueError("--distributed serves one model; several models are not supported")
    pool = KVPool(args.kv_memory_bytes) if several else None
    metrics = Metrics()
    states = []
    for spec in specs:
        chosen = loader if not several else (loaders or {}).get(spec.name)
        states.append(_model_state(args, spec, several, chosen, pool, metrics, group))
    served = ServedModels(
        tuple(states),
        metrics,
        default_name=default,
        strict=bool(getattr(args, "strict_model_name", False)),
    )
    return create_app(served), served


def _model_state(
    args: argparse.Namespace,
    spec: ModelSpec,
    several: bool,
    loader: Loader | None,
    pool: KVPool | None,
    metrics: Metrics,
    group: PlanGroup | None = None,
) -> ServerState:
    """One served model: its engine (with its own owner thread), settings and names."""
    from mlxserve.engine.async_engine import AsyncEngine

    ecfg = engine_config(args)
    kv_overrides = {
        key: value
        for key in ("kv_cache_bits", "kv_cache_group_size", "kv_quantize_after")
        if (value := getattr(spec, key)) is not None
    }
    ecfg = replace(ecfg, **kv_overrides)
    if several and ecfg.prefix_cache_dir is not None:
        # Each model keeps its own disk tier (a tier removes another model's files).
        ecfg = replace(ecfg, prefix_cache_dir=str(Path(ecfg.prefix_cache_dir) / _dir_name(spec)))
    scfg = server_config(args)
    overrides = {
        key: value
        for key in (
            "tool_call_parser",
            "reasoning_parser",
            "chat_encoder",
            "images_for_text_models",
        )
        if (value := getattr(spec, key)) is not None
    }
    scfg = replace(scfg, served_model_name=spec.name, **overrides)
    progress = LoadProgress(bar=None if loader is None else False)
    publisher = None
    if group is not None:
        from mlxserve.engine.distributed.publisher import PlanPublisher

        publisher = PlanPublisher(group)
    if loader is None:
        from mlxserve.models import load

        encoder = scfg.chat_encoder
        path = checked_model_path(args, spec.source if several else None, encoder, ecfg.kv_quant)
        sharding = sharding_for(args, group)

        def load_from_disk() -> LoadedModel:
            return load(path, chat_encoder=encoder, progress=progress, shard=sharding)

        loader = load_from_disk
    engine = AsyncEngine(ecfg, loader, pool=pool, member=spec.name, publisher=publisher)
    return ServerState(
        engine=engine,
        config=scfg,
        model_name=spec.name,
        max_model_len=ecfg.max_model_len,
        metrics=metrics.for_model(spec.name),
        aliases=spec.names,
        load_progress=progress,
    )


def _dir_name(spec: ModelSpec) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name)


def sharding_for(args: argparse.Namespace, group: PlanGroup | None) -> Sharding | None:
    if group is None:
        return None
    from mlxserve.models.shard import Sharding

    return Sharding(args.distributed, group.group)


def run(args: argparse.Namespace) -> int:
    group = None
    if getattr(args, "distributed", None):
        from mlxserve.engine.distributed.group import join_group

        try:
            group = join_group()
        except RuntimeError as e:
            print(f"mlxserve serve: {e}", file=sys.stderr)
            return 2
    rank = f" rank {group.rank}" if group is not None else ""
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format=f"%(asctime)s %(levelname)s{rank} %(name)s: %(message)s",
    )
    if group is not None and group.rank > 0:
        from mlxserve.engine.distributed.launch import run_follower

        return run_follower(
            lambda: checked_model_path(args),
            args.chat_encoder,
            group,
            engine_config(args),
            sharding_for(args, group),
        )
    try:
        check_versions()
        app, served = build_app(args, group=group)
    except (ValueError, RuntimeError) as e:
        print(f"mlxserve serve: {e}", file=sys.stderr)
        return 2
    if args.host not in LOOPBACK and args.api_key is None:
        logger.warning(
            "listening on %s without --api-key: anyone on the network can use it", args.host
        )
    names = ", ".join(repr(s.model_name) for s in served.models)
    logger.info("serving %s on http://%s:%d/v1", names, args.host, args.port)
    log_level = str(args.log_level).lower()
    status = serve_app(app, served, args.host, args.port, log_level, distributed=group is not None)
    if any(s.engine.stats().get("stalled") for s in served.models) or group is not None:
        # (Distributed: the other ranks may be gone, and tearing the group down
        # at interpreter exit could wait on them.)
        # The engine thread is stuck inside MLX: interpreter shutdown could wait on it or
        # abort in a C++ destructor, so the process leaves now, with its status.
        logging.shutdown()
        os._exit(status)
    return status


def serve_app(
    app: FastAPI,
    served: ServedModels,
    host: str,
    port: int,
    log_level: str,
    distributed: bool = False,
) -> int:
    """Run uvicorn until it stops; 1 if a model failed to load (that ends the server at
    once: it could never answer) or an engine thread died (with `--exit-on-engine-failure`
    that ends it at once too, for a supervisor). Distributed, an engine that died ends
    the server at once, without a graceful wait: its peers are gone or will not step
    again, so it could never answer, and `mlx.launch` ends the launch when rank 0 does."""
    import uvicorn

    # Distributed, open streams get a second to end at shutdown, not five: when a rank
    # died, mlx.launch stops rank 0 and every rank must be gone within seconds.
    graceful = 1 if distributed else 5
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful
    )
    server = uvicorn.Server(config)

    def on_engine_failure(reason: str) -> None:
        if served.config.exit_on_engine_failure or distributed:
            logger.critical("exiting: the engine failed (%s)", reason)
            server.should_exit = True
            server.force_exit = distributed

    def on_load_failure(reason: str) -> None:
        logger.critical("exiting: the model failed to load (%s)", reason)
        server.should_exit = True

    for state in served.models:
        state.on_engine_failure = on_engine_failure
        state.on_load_failure = on_load_failure
    server.run()
    engines = [s.engine for s in served.models]
    failed = any(e.failure is not None or e.load_error is not None for e in engines)
    return 1 if failed else 0
