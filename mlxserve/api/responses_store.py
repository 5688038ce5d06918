"""Stored responses for `previous_response_id`: a bounded in-memory LRU.

A stored response keeps its response object (for `GET /v1/responses/{id}`)
and its whole conversation as Responses items: the items its request
resolved to (the previous response's conversation, then its input) and its
output. A follow-up request that names it continues that conversation.
Items are shared, never copied, between the entries of one chain, so a
long session costs one reference per item per turn, not a copy.
Instructions are not part of it: the API does not carry them over.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxserve.api.errors import APIError

DEFAULT_CAPACITY = 256


@dataclass(frozen=True)
class StoredResponse:
    body: Mapping[str, Any]
    items: tuple[Mapping[str, Any], ...]  # the conversation: input items, then output


class ResponseStore:
    """At most `capacity` responses; the least recently used goes first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError("the responses store capacity must be >= 0")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: Mapping[str, Any], items: tuple[Mapping[str, Any], ...]) -> bool:
        """Keep a finished response; False when the store is disabled (capacity 0)."""
        if self.capacity == 0:
            return False
        with self._lock:
            self._entries[str(body["id"])] = StoredResponse(body, items)
            self._entries.move_to_end(str(body["id"]))
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
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
            if self._entries.pop(response_id, None) is None:
                raise not_found(response_id)


def not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"no response found with id {response_id!r} (responses are kept in memory, "
        "the most recent ones only, and only when stored)",
        code="response_not_found",
    )
