"""Warnings about what clients send, logged once per process (not once per request).

Agents repeat the same request shape every turn; one line in the log says
what the server did with an unservable field, without flooding it.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("mlxserve.api")
_seen: set[str] = set()


def warn_once(key: str, message: str, *args: Any) -> None:
    """Log `message % args` the first time `key` is seen."""
    if key not in _seen:
        _seen.add(key)
        logger.warning(message, *args)
