"""A rank > 0 of `mlxserve serve --distributed`: load this rank's shard, then run plans.

It has no HTTP server and no scheduler: it joins rank 0's startup collectives
(the memory probe's forwards and the shared KV budget) and then executes
each plan rank 0 sends (`distributed.Follower`) until rank 0 stops. A peer
that is gone ends it with status 1, so a supervisor (or mlx.launch) sees it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from mlxserve.config import EngineConfig
from mlxserve.engine.budget import default_kv_budget, weights_nbytes
from mlxserve.engine.distributed.codec import PlanDecodeError
from mlxserve.engine.distributed.follower import Follower, PlanDesync
from mlxserve.engine.distributed.group import PeerLost, PlanGroup, shared_budget
from mlxserve.models.loaded import ModelLoadError
from mlxserve.models.shard import Sharding

logger = logging.getLogger("mlxserve.follower")

# Past the step timeout, how long a follower waits for rank 0's idle heartbeat.
HEARTBEAT_GRACE_S = 5.0


def run_follower(
    locate: Callable[[], Path],
    chat_encoder: str,
    group: PlanGroup,
    config: EngineConfig,
    sharding: Sharding | None,
) -> int:
    """Load this rank's shard of the model `locate` finds (resolved and checked, as rank 0
    does) and execute rank 0's plans until it stops; exits the process with the status."""
    status = _serve(locate, chat_encoder, group, config, sharding)
    # The peers may be gone: leave without tearing the group down at interpreter exit.
    logging.shutdown()
    os._exit(status)


def _serve(
    locate: Callable[[], Path],
    chat_encoder: str,
    group: PlanGroup,
    config: EngineConfig,
    sharding: Sharding | None,
) -> int:
    from mlxserve.models import load
    from mlxserve.versions import check_versions

    started = time.monotonic()
    try:
        # Every rank runs the same forwards: each must have the pinned libraries.
        check_versions()
        path = locate()
        logger.info("loading this rank's shard of %s", path)
        model = load(path, chat_encoder=chat_encoder, shard=sharding, with_tokenizer=False)
    except (ModelLoadError, ValueError, RuntimeError) as e:
        logger.critical("loading failed: %s", e)
        return 1
    weights = weights_nbytes(getattr(model.model, "module", model.model))
    logger.info("loaded %.3f GB of weights in %.1f s", weights / 1e9, time.monotonic() - started)
    timeout = None
    if config.step_timeout_s is not None:
        timeout = config.step_timeout_s + HEARTBEAT_GRACE_S
    follower = Follower(model, group, timeout)
    try:
        group.meet()  # asleep until rank 0 has loaded and runs the probe's forwards too
        cost = follower.runner.probe_cost()
        budget = config.kv_memory_bytes or default_kv_budget(weights)
        shared_budget(group, budget, cost.bytes_per_token)
        logger.info("ready; executing rank 0's plans")
        return follower.serve()
    except PeerLost as e:
        logger.critical("exiting: %s", e)
        return 1
    except (PlanDesync, PlanDecodeError, KeyError) as e:  # KeyError: an unknown handle
        # This rank no longer holds what rank 0 thinks it does: its forwards would
        # be wrong, so it leaves, and rank 0's next collective fails (engine death).
        logger.critical("exiting: out of step with rank 0: %s", e)
        return 1
