"""DeepSeek-V4's MTP drafter: the checkpoint's head, its drafts, and exact output.

The head's drafts are checked against mlx-vlm's own MTP session (the wrapper
runs the drafter's layers over a cache of ours), including after the head has
been fed step by step and across its sliding window. Engine runs with
`--speculative mtp` must give the tokens of plain runs: random-weight MTP
drafts are mostly wrong, so these runs check rejection and the head's cache
bookkeeping, and the oracle tests in `test_speculative.py` check acceptance.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_helpers import started_engine, tokens_and_stats

from mlxserve.config import EngineConfig
from mlxserve.engine import core as engine_core
from mlxserve.engine.request import Constraint, EngineNotReady, SamplingParams
from mlxserve.engine.spec.mtp_drafter import MtpDrafter
from mlxserve.models.deepseek_v4.mtp import MtpHead, has_mtp_weights, load_mtp_head
from mlxserve.models.load import load
from mlxserve.models.loaded import LoadedModel

Job = tuple[list[int], SamplingParams]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxserve.models.tiny.synthetic import make_model

    return make_model(tmp_path_factory.mktemp("v4-mtp"), "deepseek_v4", mtp_layers=1)


@pytest.fixture(scope="module")
def mtp_model(mtp_dir: Path) -> tuple[LoadedModel, MtpHead]:
    model = load(mtp_dir)
    head = load_mtp_head(model)
    assert head is not None
    return model, head


def _prompt(length: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 500 + 10 for i in range(length)]


def test_the_mtp_layer_leaves_the_main_model_as_it_was(mtp_dir, model_dir_factory) -> None:
    plain_dir = model_dir_factory("deepseek_v4")
    with_mtp, plain = (
        mx.load(str(mtp_dir / "model.safetensors")),
        mx.load(str(plain_dir / "model.safetensors")),
    )
    extra = sorted(set(with_mtp) - set(plain))
    assert extra and all(name.startswith("mtp.") for name in extra)
    assert all(mx.array_equal(with_mtp[name], plain[name]).item() for name in plain)
    config = load(plain_dir).config
    assert has_mtp_weights(mtp_dir, config) and not has_mtp_weights(plain_dir, config)


def test_a_sharded_checkpoint_names_its_mtp_weights_in_its_index(tmp_path: Path) -> None:
    import json

    config = {"model_type": "deepseek_v4"}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"layers.0.attn.wkv.weight": "a.safetensors"}}))
    assert not has_mtp_weights(tmp_path, config)
    index.write_text(json.dumps({"weight_map": {"mtp.0.e_proj.weight": "b.safetensors"}}))
    assert has_mtp_weights(tmp_path, config)
    assert not has_mtp_weights(tmp_path, {"model_type": "llama"})


def _session_drafts(model: LoadedModel, head: MtpHead, context: list[int], k: int) -> list[int]:
    """mlx-vlm's own MTP session, fresh: prefill over the context, then a draft block."""
    sink: list[mx.array] = []
    model.model(mx.array([context[:-1]]), model.make_cache(), sink)
    hidden = sink[0]
    session = head.drafter
    session.reset(model.model.module)
    inputs = mx.array([context[:-1]], dtype=mx.int32)
    session.prefill_from_target_hidden(inputs, hidden, context[-1], None, greedy=True)
    block = session.draft_block(context[-1], hidden[:, -1:], None, k + 1, None, greedy=True)
    return [int(t) for t in block[0].tolist()]


def test_drafts_equal_mlx_vlms_mtp_session(mtp_model) -> None:
    model, head = mtp_model
    for length in (6, 30):  # within the head's window (16) and past it
        context = _prompt(length, length)
        sink: list[mx.array] = []
        model.model(mx.array([context[:-1]]), model.make_cache(), sink)
        drafter = MtpDrafter(head)
        drafter.observe("r", 0, sink[0][0])
        assert drafter.propose("r", context, 3) == _session_drafts(model, head, context, 3)


def test_drafts_fed_step_by_step_equal_a_fresh_session(mtp_model) -> None:
    """States observed one decode step at a time (with proposals in between, and a
    stretch with none, longer than the window) give a fresh session's drafts."""
    model, head = mtp_model
    context = _prompt(9, 3)
    cache, sink = model.make_cache(), []
    logits = model.model.last_logits(mx.array([context]), cache, sink)
    drafter = MtpDrafter(head)
    drafter.observe("r", 0, sink[0][0])
    checked = 0
    for step in range(34):
        context.append(int(mx.argmax(logits, axis=-1).item()))
        if step < 6 or step >= 30:
            assert drafter.propose("r", context, 2) == _session_drafts(model, head, context, 2)
            checked += 1
        sink = []
        logits = model.model.last_logits(mx.array([context[-1:]]), cache, sink)
        drafter.observe("r", len(context) - 1, sink[0][0])
    assert checked == 10


def _run(path: Path, jobs: list[Job], config: EngineConfig, stagger: bool = False) -> Any:
    """Tokens, and the drafts' stats with the engine's preemptions."""
    tokens, stats = tokens_and_stats(config, lambda: load(path), jobs, stagger)
    return tokens, dict(stats["speculative"] or {}, preemptions=stats["preemptions"])


def _check_parity(
    path: Path, jobs: list[Job], config: EngineConfig | None = None, stagger: bool = False
) -> dict[str, Any]:
    config = config or EngineConfig()
    plain, _ = _run(path, jobs, config, stagger)
    spec_config = EngineConfig(**{**config.__dict__, "speculative": "mtp"})
    drafted, stats = _run(path, jobs, spec_config, stagger)
    assert drafted == plain
    assert stats["drafter"] == "mtp" and stats["draft_tokens"] > 0
    return stats


class _SteeredDrafter(MtpDrafter):
    """The head drafts as usual (its proposals are recorded), but the engine gets a
    plain run's tokens in their place, every third one wrong: so verifies keep
    several positions, and the head is fed blocks of kept states."""

    expected: list[int] = []
    prompt_len = 0
    made: list[tuple[list[int], list[int]]] = []

    def propose(self, request_id: str, context: Sequence[int], k: int) -> list[int]:
        drafts = super().propose(request_id, context, k)
        if not drafts:
            return []
        self.made.append((list(context), drafts))
        done = len(context) - self.prompt_len
        steered = list(self.expected[done : done + len(drafts)])
        return [t + 1 if (done + j) % 3 == 2 else t for j, t in enumerate(steered)]


def test_head_drafts_stay_a_fresh_sessions_while_verifies_keep_blocks(
    mtp_dir, mtp_model, monkeypatch
) -> None:
    prompt = _prompt(12, 0)
    jobs = [(prompt, SamplingParams(max_tokens=40, temperature=0.0))]
    plain, _ = _run(mtp_dir, jobs, EngineConfig())
    monkeypatch.setattr(_SteeredDrafter, "expected", plain[0])
    monkeypatch.setattr(_SteeredDrafter, "prompt_len", len(prompt))
    monkeypatch.setattr(_SteeredDrafter, "made", [])
    monkeypatch.setattr(engine_core, "MtpDrafter", _SteeredDrafter)
    drafted, stats = _run(mtp_dir, jobs, EngineConfig(speculative="mtp"))
    assert drafted == plain
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    model, head = mtp_model
    made = _SteeredDrafter.made
    assert len(made) >= 8
    for context, drafts in made:
        assert drafts == _session_drafts(model, head, context, len(drafts))


def test_mtp_parity_alone_in_a_batch_and_under_temperature(mtp_dir) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    _check_parity(mtp_dir, [(_prompt(12, 0), greedy)])
    # Four rows decode without drafts (V4 verifies one row at a time) until the
    # longest is alone; a seeded row under temperature draws the same tokens.
    jobs = [(_prompt(8 + 3 * i, i), SamplingParams(max_tokens=6 + 4 * i)) for i in range(3)]
    jobs.append((_prompt(10, 7), SamplingParams(max_tokens=36, temperature=1.0, seed=3)))
    _check_parity(mtp_dir, jobs)


def test_mtp_parity_after_a_prefix_hit_under_a_grammar_and_beside_a_chunked_prefill(
    mtp_dir,
) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0)
    shared = _prompt(40, 4)
    _check_parity(mtp_dir, [(shared, params), (shared + _prompt(6, 5), params)], stagger=True)
    grammar = Constraint('%llguidance {}\nstart: "ab" /[0-9]{3,6}/ "cd"')
    constrained = SamplingParams(max_tokens=16, temperature=0.0, constraint=grammar)
    # A long prompt prefills in chunks while the other row decodes (alone) with drafts.
    small_steps = EngineConfig(max_num_batched_tokens=16)
    jobs = [(_prompt(8, 6), constrained), (_prompt(90, 7), params)]
    _check_parity(mtp_dir, jobs, small_steps)


def test_mtp_parity_across_a_preemption(mtp_dir) -> None:
    from mlxserve.engine.runner import Runner

    cost = Runner(load(mtp_dir)).probe_cost(reuse=True)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    jobs = [(_prompt(24, 8 + i), params) for i in range(3)]
    # Room for about two of the three: the newest is preempted, resumes, and its
    # head's states are those of its first run up to there.
    budget = cost.total([50, 50], batched=True)
    tight = EngineConfig(kv_memory_bytes=budget, kv_reserve_tokens=4, prefix_cache=False)
    stats = _check_parity(mtp_dir, jobs, tight)
    assert stats["preemptions"] >= 1


class _BrokenHead:
    window = 16

    def make_cache(self) -> list[Any]:
        return []

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("boom")


def test_a_failing_head_drafts_nothing_and_starts_afresh(caplog) -> None:
    drafter = MtpDrafter(_BrokenHead())  # type: ignore[arg-type]
    drafter.observe("r", 0, mx.zeros((5, 2, 8)))
    assert drafter.propose("r", [1, 2, 3, 4, 5, 6], 3) == []
    assert "MTP drafting failed" in caplog.text
    assert drafter.propose("r", [1, 2, 3, 4, 5, 6], 3) == []  # no state: nothing to draft from


def test_auto_drafts_with_the_head_where_there_is_one(mtp_dir, model_dir_factory) -> None:
    job = [(_prompt(6, 1), SamplingParams(max_tokens=8, temperature=0.0))]
    _, stats = _run(mtp_dir, job, EngineConfig(speculative="auto"))
    assert stats["drafter"] == "mtp"
    _, stats = _run(model_dir_factory("deepseek_v4"), job, EngineConfig(speculative="auto"))
    assert stats["drafter"] == "ngram"


def test_mtp_without_a_head_is_refused_at_start(model_dir_factory) -> None:
    plain_dir = model_dir_factory("deepseek_v4")

    async def start() -> None:
        engine = await started_engine(EngineConfig(speculative="mtp"), lambda: load(plain_dir))
        await engine.shutdown()

    with pytest.raises(EngineNotReady, match="no MTP head"):
        asyncio.run(start())
    # `serve` says so before it binds its port.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        argv = [sys.executable, "-m", "mlxserve.cli", "serve", str(plain_dir)]
        argv += ["--port", str(port), "--speculative", "mtp"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "no MTP head" in done.stderr and "Traceback" not in done.stderr
