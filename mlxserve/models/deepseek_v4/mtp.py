"""DeepSeek-V4's multi-token-prediction (MTP) head, from the checkpoint's `mtp.*` weights.

The main model's loader (mlx-vlm's sanitize) drops `mtp.*`; this module loads
them on their own, through mlx-vlm 0.7.10's public drafter loader
(`mlx_vlm.speculative.drafters.load_drafter`: it reads a native checkpoint's
`mtp.*` tensors and maps their names with the drafter's own sanitize), into
its `DeepseekV4MTPDraftModel`. That model's round loop keeps one session for
a whole batch (its seed token and cache cursor); our scheduler drafts per
request, so `MtpHead.forward` runs the drafter's layers itself over a cache
the caller owns, and the target's embedding and lm_head (which the MTP layer
shares with the main model).

One MTP position i reads the main model's last hidden state at position i
(before its hyper-connection head: shape (hc_mult, hidden)) and the embedding
of token i + 1, and its logits predict token i + 2. Its one attention layer
is a sliding window, so a position attends to the `window` positions before it
and no further.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxserve.models.loaded import LoadedModel, ModelLoadError

logger = logging.getLogger(__name__)

MTP_FAMILIES = frozenset({"deepseek_v4"})


def has_mtp_weights(path: Path, config: dict[str, Any]) -> bool:
    """Whether the checkpoint at `path` ships `mtp.*` tensors (headers only, no weights read)."""
    if config.get("model_type") not in MTP_FAMILIES:
        return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{index} is not valid JSON: {e}") from e
        return any(str(name).startswith("mtp.") for name in names)
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy") as f:
                if any(key.startswith("mtp.") for key in f.keys()):  # noqa: SIM118
                    return True
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read the header of {file}: {e}") from e
    return False


def require_mtp_weights(path: Path, config: dict[str, Any]) -> None:
    """`--speculative mtp` refuses, before the port is bound, a checkpoint without an MTP head."""
    if not has_mtp_weights(path, config):
        raise ModelLoadError(
            f"--speculative mtp: {path} has no MTP head (no mtp.* weights; only "
            f"{', '.join(sorted(MTP_FAMILIES))} checkpoints can ship one); "
            "use --speculative ngram or auto"
        )


class MtpHead:
    """The MTP layer over a cache its caller owns; `forward` is one block of positions."""

    def __init__(self, drafter: Any, target: Any) -> None:
        self.drafter = drafter
        self.target = target
        # The head's attention window: a position reads the ones this far back, no further.
        self.window = int(drafter.args.sliding_window)

    def make_cache(self) -> list[Any]:
        return list(self.drafter.make_cache())

    def forward(
        self, tokens: mx.array, hidden: mx.array, cache: list[Any], position: int
    ) -> tuple[mx.array, mx.array]:
        """Feed MTP positions `position ..`: `tokens` (1, L) are each position's next
        token, `hidden` (1, L, hc_mult, hidden) the main model's states there.
        Returns the logits after the last position (1, V) and the layer's output
        states (1, L, hc_mult, hidden), which chain into the next draft position."""
        from mlx_vlm.models.base import create_attention_mask

        d = self.drafter
        batch, length, copies, size = hidden.shape
        h_proj = d.h_proj(d.hnorm(hidden.reshape(batch * length * copies, size)))
        embed = self.target.model.embed_tokens(tokens)
        h = d.e_proj(d.enorm(embed))[:, :, None, :] + h_proj.reshape(hidden.shape)
        mask = create_attention_mask(
            h[:, :, 0, :], cache[0], window_size=self.window, return_array=True
        )
        h = d.decoder(h, mask, cache[0], tokens, position_offset=position)
        logits = self.target.lm_head(d.norm(d.hc_head(h[:, -1:])))
        return logits[:, -1, :], h


def load_mtp_head(model: LoadedModel) -> MtpHead | None:
    """The checkpoint's MTP head for `model` (None when it ships no `mtp.*` weights)."""
    if not has_mtp_weights(model.path, model.config):
        return None
    from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility

    target = model.model.module
    try:
        loaded, kind = load_drafter(str(model.path), kind="mtp")
        drafter: Any = loaded
        validate_drafter_compatibility(target, drafter, kind)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ModelLoadError(f"cannot load the MTP head of {model.path}: {e}") from e
    drafter.eval()
    logger.info("loaded the checkpoint's MTP head (%s)", type(drafter).__name__)
    return MtpHead(drafter, target)
