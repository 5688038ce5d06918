"""`mlxserve bench speculative --real`: prompt-lookup drafts on a trained model's edit.

The model is the demo's SmolLM2-135M-Instruct (a real GGUF, fetched and
converted once, see `models/tiny/demo.py`), asked for an agent's everyday edit:
add a line to a short file and give the whole file back. Its reply
re-emits the file, which is what prompt lookup drafts from. The same greedy
request runs without drafts and with `--speculative ngram`; the figures are
what the drafts earn per verify forward, which is the speed-up on Metal (a
forward over a few positions costs about as much as over one there), not on
the CPU backend (where each position costs its own compute):

- `tokens_per_forward_real_copy`: tokens each verify forward kept (1 = none),
- `acceptance_real_copy`: the share of drafted tokens kept,
- `parity_real_copy`: 1 when the tokens equal the plain run's (they must).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from mlxserve.config import EngineConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.engine.request import SamplingParams
from mlxserve.models.load import load

EDIT_FILE = """def area(width, height):
    return width * height

def perimeter(width, height):
    return 2 * (width + height)

def diagonal(width, height):
    return (width**2 + height**2) ** 0.5

def describe(width, height):
    print("area", area(width, height))
    print("perimeter", perimeter(width, height))
    print("diagonal", diagonal(width, height))
"""
EDIT_TASK = (
    "Add the comment `# shapes.py` as the first line of this file and write the whole "
    "file:\n\n```python\n" + EDIT_FILE + "```"
)
REPLY_TOKENS = 160


async def _run(path: Path, speculative: str, k: int) -> tuple[list[int], dict[str, Any]]:
    """Greedy tokens of the edit request on one engine, and its drafts' stats."""
    config = EngineConfig(prefix_cache=False, speculative=speculative, num_draft_tokens=k)
    engine = AsyncEngine(config, lambda: load(path))
    engine.start()
    try:
        await engine.wait_ready(timeout=600)
        model = engine.core.model
        assert model is not None
        messages = [{"role": "user", "content": EDIT_TASK}]
        prompt = list(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        params = SamplingParams(max_tokens=REPLY_TOKENS, temperature=0.0)
        events = [e async for e in engine.submit(prompt, params)]
        tokens = [e.token_id for e in events if e.token_id is not None]
        return tokens, dict(engine.stats()["speculative"] or {})
    finally:
        await engine.shutdown()


def measure_real(k: int) -> dict[str, Any]:
    """The figures on the real model (fetched and converted on first use)."""
    from mlxserve.models.tiny.demo import demo_model_path

    path = demo_model_path("smollm2")
    plain, _ = asyncio.run(_run(path, "off", k))
    drafted, stats = asyncio.run(_run(path, "ngram", k))
    proposed = stats.get("draft_tokens", 0)
    return {
        "tokens_per_forward_real_copy": stats.get("tokens_per_forward", 0.0),
        "acceptance_real_copy": stats.get("accepted_tokens", 0) / proposed if proposed else 0.0,
        "parity_real_copy": int(plain == drafted),
        "reply_tokens_real_copy": len(plain),
        "num_draft_tokens": k,
    }
