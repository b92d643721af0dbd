"""The engine service's request errors, one class per answer a client gets.
gRPC (grpc_api.py) and HTTP (http_api.py) each map them at their boundary:
InvalidRequest -> INVALID_ARGUMENT / 400, DuplicateRequest -> ALREADY_EXISTS /
409, NotAccepting -> UNAVAILABLE / 503. The runtime raises all three;
backends raise only InvalidRequest (declared with their contract, backend.py)."""

from __future__ import annotations

from services.engine.backend import InvalidRequest

__all__ = ["DuplicateRequest", "EngineError", "InvalidRequest", "NotAccepting"]


class EngineError(Exception):
    """Base of the runtime's refusals that are not about the request's content."""


class DuplicateRequest(EngineError):
    """A generation with this request id is already live here -> ALREADY_EXISTS."""


class NotAccepting(EngineError):
    """Starting, draining or stopping: try another engine -> UNAVAILABLE."""
