"""`mlxserve bench distributed`: two ranks (tensor, then pipeline) against one process.

The same greedy batch runs through a single-process engine and through
`mlx.launch --backend ring -n 2 --hosts 127.0.0.1` engines in tensor and
pipeline mode (rank 0 schedules and samples, rank 1 executes its plans).

- `tp2_token_agreement`, `pp2_token_agreement`: the share of generated tokens
  equal to the single process's (1.0: every one).
- `weight_bytes_per_rank_over_single`: the largest rank's weight bytes over
  the single process's, over both modes (about 1/N is the goal).
- `broadcast_ms_per_step`: rank 0's time to send a step's plan (both modes).
- `step_overhead_ratio`: a 2-rank engine step over a single-process step on
  the same model (tensor and pipeline, and the larger). On one 2-core machine
  the ranks share the cores, so this is a cost figure, not a speed-up.

The ranks run this module with `--worker`; each writes its figures to JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mlxserve.bench.launcher import loopback_launch, start_launch
from mlxserve.bench.report import emit
from mlxserve.config import EngineConfig
from mlxserve.engine.distributed.stdin import let_go_of_stdin
from mlxserve.engine.request import SamplingParams

MODES = {"tp2": "tensor", "pp2": "pipeline"}


def bench_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    return [[(i * 131 + j * 977 + 11) % vocab for i in range(length + 3 * j)] for j in range(count)]


async def _generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def one(prompt: list[int]) -> list[int]:
        tokens = []
        async for event in engine.submit(prompt, params):
            if event.token_id is not None:
                tokens.append(event.token_id)
        return tokens

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def _measure(
    engine: Any, args: argparse.Namespace, vocab: int, on_start: Any = None
) -> dict[str, Any]:
    engine.start()
    await engine.wait_ready()
    try:
        prompts = bench_prompts(args.requests, args.prompt_tokens, vocab)
        await _generate(engine, prompts[:1], 2)  # warm-up: the first forwards
        if on_start is not None:
            on_start()
        steps = engine.stats()["steps"]
        started = time.perf_counter()
        tokens = await _generate(engine, prompts, args.max_tokens)
        elapsed = time.perf_counter() - started
        steps = engine.stats()["steps"] - steps
        return {"tokens": tokens, "step_ms": 1000 * elapsed / max(steps, 1), "steps": steps}
    finally:
        await engine.shutdown()


def _weights(model: Any) -> int:
    from mlxserve.engine.budget import weights_nbytes

    return int(weights_nbytes(getattr(model.model, "module", model.model)))


def single(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from mlxserve.engine.async_engine import AsyncEngine
    from mlxserve.models.load import load

    held: dict[str, Any] = {}

    def loader() -> Any:
        held["model"] = load(path)
        return held["model"]

    engine = AsyncEngine(EngineConfig(max_num_seqs=args.requests), loader)
    figures = asyncio.run(_measure(engine, args, args.vocab))
    figures["weight_bytes"] = _weights(held["model"])
    return figures


def worker(args: argparse.Namespace) -> int:
    """One rank of a distributed run (started by mlx.launch)."""
    from mlxserve.engine.distributed.group import join_group
    from mlxserve.engine.distributed.publisher import PlanPublisher
    from mlxserve.models.load import load
    from mlxserve.models.shard import Sharding

    group = join_group()
    out = Path(args.out)
    sharding = Sharding(args.mode, group.group)
    config = EngineConfig(max_num_seqs=args.requests, distributed=args.mode)
    if group.rank > 0:
        from mlxserve.engine.budget import default_kv_budget
        from mlxserve.engine.distributed.follower import Follower
        from mlxserve.engine.distributed.group import shared_budget

        model = load(args.model, shard=sharding, with_tokenizer=False)
        follower = Follower(model, group, None)
        group.meet()  # asleep until rank 0's engine runs the probe's forwards too
        cost = follower.runner.probe_cost()
        shared_budget(group, default_kv_budget(_weights(model)), cost.bytes_per_token)
        status = follower.serve()
        out.with_suffix(f".rank{group.rank}.json").write_text(
            json.dumps({"weight_bytes": _weights(model)})
        )
        return status
    from mlxserve.engine.async_engine import AsyncEngine

    publisher = PlanPublisher(group)
    held: dict[str, Any] = {}

    def loader() -> Any:
        held["model"] = load(args.model, shard=sharding)
        return held["model"]

    engine = AsyncEngine(config, loader, publisher=publisher)
    figures = asyncio.run(_measure_published(engine, publisher, args))
    figures["weight_bytes"] = _weights(held["model"])
    out.with_suffix(".rank0.json").write_text(json.dumps(figures))
    return 0


async def _measure_published(engine: Any, publisher: Any, args: argparse.Namespace) -> Any:
    sent = {"s": 0.0, "n": 0}

    def mark() -> None:
        # The broadcast figure covers the measured run only (not the warm-up).
        sent["s"], sent["n"] = publisher.broadcast_s, publisher.steps

    figures = await _measure(engine, args, args.vocab, mark)
    steps = max(publisher.steps - sent["n"], 1)
    figures["broadcast_ms_per_step"] = 1000 * (publisher.broadcast_s - sent["s"]) / steps
    return figures


def launch(path: Path, mode: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """Run the worker on two local ranks; each rank's figures."""
    command = loopback_launch(
        sys.executable,
        "-m",
        "mlxserve.bench.distributed",
        "--worker",
        "--mode",
        mode,
        "--model",
        str(path),
        "--out",
        str(out),
        "--requests",
        str(args.requests),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--max-tokens",
        str(args.max_tokens),
        "--vocab",
        str(args.vocab),
    )
    log = out.with_suffix(".log")
    with log.open("wb") as sink:
        proc = start_launch(command, stdout=sink, stderr=subprocess.STDOUT)
        returncode = proc.wait()
    if returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"mlx.launch {mode} failed ({returncode}): {tail}")
    return [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]


def agreement(reference: list[list[int]], got: list[list[int]]) -> float:
    total = sum(len(r) for r in reference)
    same = sum(
        sum(a == b for a, b in zip(r, g, strict=False)) for r, g in zip(reference, got, strict=True)
    )
    return same / total if total else 1.0


def measure(path: Path, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    base = single(path, args)
    figures: dict[str, Any] = {}
    ratios, broadcast, overheads = [], [], []
    for name, mode in MODES.items():
        ranks = launch(path, mode, args, tmp / f"{name}.json")
        figures[f"{name}_token_agreement"] = agreement(base["tokens"], ranks[0]["tokens"])
        ratios.append(max(r["weight_bytes"] for r in ranks) / base["weight_bytes"])
        broadcast.append(ranks[0]["broadcast_ms_per_step"])
        overheads.append(ranks[0]["step_ms"] / base["step_ms"])
        figures[f"{name}_step_overhead_ratio"] = overheads[-1]
        figures[f"{name}_weight_bytes_per_rank_over_single"] = ratios[-1]
    figures["weight_bytes_per_rank_over_single"] = max(ratios)
    figures["broadcast_ms_per_step"] = max(broadcast)
    figures["step_overhead_ratio"] = max(overheads)
    figures["single_step_ms"] = base["step_ms"]
    return figures


def run(args: argparse.Namespace) -> int:
    from mlxserve.models.tiny.synthetic import VOCAB_SIZE, make_model

    args.vocab = VOCAB_SIZE
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = Path(args.model)
        else:
            path = make_model(
                Path(tmp) / "model", args.family, seed=0, layers=args.layers, hidden=args.hidden
            )
        figures = {"family": args.family, **measure(path, args, Path(tmp))}
    emit("distributed", figures, args.json)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=24)


def _worker_main() -> int:
    let_go_of_stdin()
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, required=True)
    add_arguments(p)
    args = p.parse_args()
    status = worker(args)
    sys.stdout.flush()
    # The peer may be gone already: leave without tearing the group down.
    os._exit(status)


if __name__ == "__main__":
    sys.exit(_worker_main())
