"""The engine service's request errors, one class per answer a client gets.
gRPC (grpc_api.py) and HTTP (http_api.py) each map them at their boundary:
InvalidRequest -> INVALID_ARGUMENT / 400, DuplicateRequest -> ALREADY_EXISTS /
409, NotAccepting -> UNAVAILABLE / 503. The runtime raises all three;
backends raise InvalidRequest (declared with their contract, backend.py)
and, when they fail as a whole, EngineDead: no client sees that one as
such -- the runtime fails the engine, which hands every live generation
over (UNAVAILABLE mid-stream: continue elsewhere) and refuses new ones
(NotAccepting)."""

from __future__ import annotations

from services.engine.backend import EngineDead, InvalidRequest

__all__ = ["DuplicateRequest", "EngineDead", "EngineError", "InvalidRequest", "NotAccepting"]


class EngineError(Exception):
    """Base of the runtime's refusals that are not about the request's content."""


class DuplicateRequest(EngineError):
    """A generation with this request id is already live here -> ALREADY_EXISTS."""


class NotAccepting(EngineError):
    """Starting, draining, stopping or failed: try another engine -> UNAVAILABLE."""
