"""The models one server serves, and which of them a request's `model` names."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass, field

from mlxserve.api.errors import APIError
from mlxserve.api.metrics import Metrics
from mlxserve.api.state import ServerState
from mlxserve.api.status.board import StatusBoard
from mlxserve.config import ServerConfig

logger = logging.getLogger(__name__)

# Unknown names are logged once each, up to this many (clients could send endless names).
MAX_LOGGED_NAMES = 64
# The model the current HTTP request was routed to (its errors are counted for that model).
ROUTED: ContextVar[ServerState | None] = ContextVar("mlxserve_routed_model", default=None)


@dataclass
class ServedModels:
    """Every served model (the first, or `default`, takes names nobody answers to).

    Each model has its own engine, parsers, prefix cache and limits
    (`ServerState`); the server's settings, metrics registry and routes are
    shared. A request is routed by its `model` field: a model's name or one
    of its aliases; any other name goes to the default model (logged once),
    or is a 404 with `strict`.
    """

    models: tuple[ServerState, ...]
    metrics: Metrics
    default_name: str | None = None
    strict: bool = False
    # Runs in flight and recent errors, for /v1/status and the operator page.
    board: StatusBoard = field(default_factory=StatusBoard)
    _by_name: dict[str, ServerState] = field(default_factory=dict)
    _names_seen: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("no model to serve")
        for state in self.models:
            for name in state.served_names:
                other = self._by_name.setdefault(name, state)
                if other is not state:
                    raise ValueError(
                        f"the name {name!r} is given to two models "
                        f"({other.model_name!r} and {state.model_name!r})"
                    )
        if self.default_name is not None and self.default_name not in self._by_name:
            raise ValueError(
                f"--default-model {self.default_name!r} is none of the served models "
                f"({', '.join(self._by_name)})"
            )

    @classmethod
    def one(cls, state: ServerState, strict: bool = False) -> ServedModels:
        return cls((state,), state.metrics.metrics, strict=strict)

    @property
    def default(self) -> ServerState:
        if self.default_name is None:
            return self.models[0]
        return self._by_name[self.default_name]

    @property
    def config(self) -> ServerConfig:
        """The server-wide settings (auth, body limit, keep-alive, Responses store)."""
        return self.default.config

    @property
    def served_names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def route(self, name: str | None) -> ServerState:
        """The model a request names, the default for an empty or unknown name, or 404."""
        state = self._by_name.get(name) if name else self.default
        if state is None:
            state = self._unknown(str(name))
        ROUTED.set(state)
        return state

    def _unknown(self, name: str) -> ServerState:
        if self.strict:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.served_names)}",
                param="model",
                code="model_not_found",
            )
        if name not in self._names_seen and len(self._names_seen) < MAX_LOGGED_NAMES:
            self._names_seen.add(name)
            logger.info(
                "a request names the model %r; serving %r (--strict-model-name refuses "
                "other names)",
                name,
                self.default.model_name,
            )
        return self.default
