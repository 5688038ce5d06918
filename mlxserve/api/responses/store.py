"""Stored responses for `previous_response_id`: a bounded in-memory LRU.

A stored response keeps its response object (for `GET /v1/responses/{id}`)
and its whole conversation as Responses items: the items its request
resolved to (the previous response's conversation, then its input) and its
output. A follow-up request that names it continues that conversation.
Items are shared, never copied, between the entries of one chain, so a
long session costs one reference per item per turn, not a copy.
Instructions are not part of it: the API does not carry them over.

The store is bounded in entries and in bytes (`--responses-store-bytes`): an
entry counts its body and its whole conversation as JSON, as if nothing were
shared, so the bound holds whatever the chains share.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxserve.api.errors import APIError

DEFAULT_CAPACITY = 256
DEFAULT_MAX_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    body: Mapping[str, Any]
    items: tuple[Mapping[str, Any], ...]  # the conversation: input items, then output
    nbytes: int = 0


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str).encode())


class ResponseStore:
    """At most `capacity` responses and `max_bytes` bytes; least recently used first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES):
        if capacity < 0 or max_bytes < 0:
            raise ValueError("the responses store capacity and bytes must be >= 0")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: Mapping[str, Any], items: tuple[Mapping[str, Any], ...]) -> bool:
        """Keep a finished response; False when it is not kept (the store is off, or
        this one alone is larger than the byte bound)."""
        if self.capacity == 0:
            return False
        nbytes = _json_bytes(body) + sum(_json_bytes(item) for item in items)
        if nbytes > self.max_bytes:
            return False
        key = str(body["id"])
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = StoredResponse(body, items, nbytes)
            self._bytes += nbytes
            while len(self._entries) > self.capacity or self._bytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse:
        """The stored response (now the most recently used); 404 if unknown or evicted."""
        entry = self._find(response_id)
        if entry is None:
            raise not_found(response_id)
        return entry

    def previous(self, response_id: str) -> StoredResponse:
        """The response a request continues; 400 if unknown or evicted, as OpenAI answers
        (clients take that 400 as their cue to resend the whole conversation)."""
        entry = self._find(response_id)
        if entry is None:
            raise APIError(
                400,
                f"Previous response with id {response_id!r} not found (responses are kept "
                f"in memory, the {self.capacity} most recent only, and only when stored)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return entry

    def _find(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        with self._lock:
            gone = self._entries.pop(response_id, None)
            if gone is None:
                raise not_found(response_id)
            self._bytes -= gone.nbytes


def not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"no response found with id {response_id!r} (responses are kept in memory, "
        "the most recent ones only, and only when stored)",
        code="response_not_found",
    )
