"""The one error type of configuration, raised at load and at start-up."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A setting is missing, unknown, of the wrong type or out of bounds, or
    names a file or plugin that is not there. The message starts with the
    setting's full path ("scheduler.aging.p2_seconds")."""
