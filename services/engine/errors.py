"""The engine service's request errors, one class per answer a client gets.
gRPC (grpc_api.py) and HTTP (http_api.py) each map them at their boundary."""

from __future__ import annotations

from services.engine.backend import InvalidRequest

__all__ = ["DuplicateRequest", "EngineError", "InvalidRequest", "NotAccepting"]


class EngineError(Exception):
    """Base of the engine's own refusals (InvalidRequest is the backend's)."""


class DuplicateRequest(EngineError):
    """A generation with this request id is already live here -> ALREADY_EXISTS."""


class NotAccepting(EngineError):
    """Starting, draining or stopping: try another engine -> UNAVAILABLE."""
