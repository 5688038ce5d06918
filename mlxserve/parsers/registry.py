"""Parser selection: by name, or `auto` from the model type and tokenizer vocabulary."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from mlxserve.parsers.blocks import BlockToolParser
from mlxserve.parsers.chain import OutputParser
from mlxserve.parsers.dsml import DSML_V4, DSML_V41, DsmlToolParser
from mlxserve.parsers.events import StreamParser
from mlxserve.parsers.json_tools import HermesToolParser
from mlxserve.parsers.reasoning import Handoff, PassthroughParser, ThinkReasoningParser

REASONING_PARSERS = ("deepseek_v4", "deepseek_v41", "qwen3", "deepseek_r1", "none")
TOOL_PARSERS = ("deepseek_v4", "deepseek_v41", "hermes", "none")

DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"
QWEN_EOS = ("<|im_end|>", "<|endoftext|>")

# End-of-sequence text that is never content, by parser name.
_STRIP: dict[str, tuple[str, ...]] = {
    "deepseek_v4": (DEEPSEEK_EOS,),
    "deepseek_v41": (DEEPSEEK_EOS,),
    "deepseek_r1": (DEEPSEEK_EOS,),
    "qwen3": QWEN_EOS,
    "hermes": QWEN_EOS,
}

# parse_stream()'s `parser` names: (reasoning parser, tool parser).
PRESETS: dict[str, tuple[str, str]] = {
    "deepseek_v4": ("deepseek_v4", "deepseek_v4"),
    "deepseek_v41": ("deepseek_v41", "deepseek_v41"),
    "qwen3": ("qwen3", "hermes"),
    "deepseek_r1": ("deepseek_r1", "none"),
    "hermes": ("none", "hermes"),
    "none": ("none", "none"),
}


def make_tool_parser(name: str) -> BlockToolParser | None:
    """A fresh tool parser by name (None for `none`)."""
    if name == "deepseek_v4":
        return DsmlToolParser((DSML_V4,))
    if name == "deepseek_v41":
        return DsmlToolParser((DSML_V41, DSML_V4))
    if name == "hermes":
        return HermesToolParser()
    if name == "none":
        return None
    raise ValueError(f"unknown tool parser {name!r}; choose from {TOOL_PARSERS}")


@dataclass(frozen=True, slots=True)
class ParserSpec:
    """Which parsers a model uses; `create()` makes one request's parser chain."""

    reasoning: str = "none"
    tool: str = "none"

    def __post_init__(self) -> None:
        if self.reasoning not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {self.reasoning!r}; choose from {REASONING_PARSERS}"
            )
        if self.tool not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {self.tool!r}; choose from {TOOL_PARSERS}")

    @property
    def strip(self) -> tuple[str, ...]:
        """Text removed from the output before parsing (end-of-sequence markers)."""
        out: list[str] = []
        for name in (self.reasoning, self.tool):
            out += [s for s in _STRIP.get(name, ()) if s not in out]
        return tuple(out)

    def create(self, thinking: bool, tools_given: bool) -> OutputParser:
        """A new parser chain for one request."""
        tool = make_tool_parser(self.tool) if tools_given else None
        reasoning: StreamParser
        if thinking and self.reasoning != "none":
            handoff = Handoff(tool.openers, tool.lead) if tool is not None else None
            reasoning = ThinkReasoningParser(thinking=True, handoff=handoff)
        else:
            reasoning = PassthroughParser()
        return OutputParser(reasoning, tool, strip=self.strip)


def preset(name: str) -> ParserSpec:
    """The spec behind a single parser name (`deepseek_v4`, `qwen3`, `hermes`, ...)."""
    try:
        reasoning, tool = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown parser {name!r}; choose from {tuple(PRESETS)}") from None
    return ParserSpec(reasoning, tool)


def _family(model_type: str) -> str | None:
    mt = model_type.lower().replace("-", "_")
    if mt.startswith(("deepseek_v41", "deepseek_v4_1")):
        return "deepseek_v41"
    if mt.startswith("deepseek_v4"):
        return "deepseek_v4"
    if mt.startswith("qwen3"):
        return "qwen3"
    return None


def _auto_reasoning(model_type: str, vocab: Container[str] | None) -> str:
    family = _family(model_type)
    if family is not None:
        return family
    if vocab is not None and "</think>" in vocab:
        return "deepseek_r1" if model_type.lower().startswith("deepseek") else "qwen3"
    if vocab is not None and "｜DSML｜" in vocab:
        return "deepseek_v4"
    return "none"


def _auto_tool(model_type: str, vocab: Container[str] | None) -> str:
    family = _family(model_type)
    if family is not None:
        return "hermes" if family == "qwen3" else family
    if vocab is not None and "｜DSML｜" in vocab:
        return "deepseek_v4"
    if vocab is not None and "<tool_call>" in vocab:
        return "hermes"
    return "none"


class TokenNames:
    """`name in TokenNames(tokenizer)`: whether the tokenizer has a token spelled `name`,
    by one lookup and its reverse (`get_vocab()` builds a dict of every token: 0.1 s of
    CPU for DeepSeek's 129k, each time)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        token_id = self._tokenizer.convert_tokens_to_ids(name)
        # An unknown name may come back as the unknown token's id: only a round trip is sure.
        return isinstance(token_id, int) and self._tokenizer.convert_ids_to_tokens(token_id) == name


def resolve_parsers(
    model_type: str,
    vocab: Container[str] | None,
    reasoning: str = "auto",
    tool: str = "auto",
) -> ParserSpec:
    """Pick parsers: explicit names win; `auto` looks at `model_type`, then the vocabulary.

    deepseek_v4 -> DSML V4 + reasoning; deepseek_v41 -> DSML V4.1 (spaced
    tags; V4 spelling accepted too) + reasoning; qwen3* -> `<think>` reasoning
    + Hermes `<tool_call>` JSON; otherwise a vocabulary with `</think>` gets
    think-tag reasoning, one with `｜DSML｜` DSML, one with `<tool_call>` Hermes.
    """
    model_type = model_type or ""
    r = _auto_reasoning(model_type, vocab) if reasoning == "auto" else reasoning
    t = _auto_tool(model_type, vocab) if tool == "auto" else tool
    return ParserSpec(reasoning=r, tool=t)
