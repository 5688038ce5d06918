"""The error a request that cannot be rendered into a prompt raises."""

from __future__ import annotations


class PromptError(ValueError):
    """A request cannot be rendered into a prompt; the message tells the client why.

    The server answers it with HTTP 400 (`invalid_request_error`).
    """
