"""The `sim` backend: a simulated GPU behind the real engine service."""

from services.engine.sim.backend import SimBackend

__all__ = ["SimBackend"]
