"""Reasoning text sealed into an opaque token the client sends back.

Anthropic thinking blocks carry it as their `signature`, OpenAI Responses
reasoning items as their `encrypted_content`: the text compressed and
base64-encoded (not encrypted: it is the client's own data). A client that
keeps only the token still re-sends the exact reasoning, so the next turn
renders the same prompt bytes and the prefix cache hits.
"""

from __future__ import annotations

import base64
import binascii
import zlib

SEAL_PREFIX = "mlxserve-v1."
MAX_SEALED_TEXT = 16 * 1024 * 1024


def seal_reasoning(text: str) -> str:
    """The opaque token for a reasoning text: compressed, base64, with our prefix."""
    packed = base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"), 6)).decode("ascii")
    return SEAL_PREFIX + packed


def unseal_reasoning(token: str) -> str | None:
    """The text a token of ours holds; None for anyone else's token (or a damaged one)."""
    if not token.startswith(SEAL_PREFIX):
        return None
    try:
        packed = base64.b64decode(token[len(SEAL_PREFIX) :], altchars=b"-_", validate=True)
        inflater = zlib.decompressobj()
        raw = inflater.decompress(packed, MAX_SEALED_TEXT)
        if inflater.unconsumed_tail or not inflater.eof:
            return None
        return raw.decode("utf-8")
    except (binascii.Error, zlib.error, UnicodeDecodeError, ValueError):
        return None
