"""Built-in filters. Each keeps the engines that pass one test."""

from __future__ import annotations

from collections.abc import Sequence

from .interfaces import EngineView, PlacementRequest

__all__ = [
    "FitsContextFilter",
    "FreshFilter",
    "HasRoomFilter",
    "LeaseSlotsFilter",
    "ModelFilter",
    "NotDrainingFilter",
    "NotExcludedFilter",
    "ServingFilter",
]


class ModelFilter:
    name = "model"

    def filter(self, request: PlacementRequest, engines: Sequence[EngineView]) -> list[EngineView]:
        return [e for e in engines if e.model == request.model]


class ServingFilter:
    """The engine's last report says it serves."""

    name = "serving"

    def filter(self, request: PlacementRequest, engines: Sequence[EngineView]) -> list[EngineView]:
        return [e for e in engines if e.serving]


class FreshFilter:
    """A load report within scheduler.stale_report_seconds."""

    name = "fresh"

    def filter(self, request: PlacementRequest, engines: Sequence[EngineView]) -> list[EngineView]:
        return [e for e in engines if e.fresh]


class NotDrainingFilter:
    name = "not_draining"

    def filter(self, request: PlacementRequest, engines: Sequence[EngineView]) -> list[EngineView]:
        return [e for e in engines if not e.draining]


class NotExcludedFilter:
    """Engines a Replace asked to avoid (they just failed this request)."""

    name = "not_excluded"

    def filter(self, request: PlacementRequest, engines: Sequence[EngineView]) -> list[EngineView]:
        return [e for e in engines if e.engine_id not in request.exclude]


class FitsContextFilter:
    """prompt + max_tokens within the engine's max_model_len (0 = unknown)."""

    name = "fits_context"

    def filter(self, request: PlacementRequest, engines: Sequence[EngineView]) -> list[EngineView]:
        need = request.prompt_tokens + request.max_tokens
        return [e for e in engines if e.max_model_len <= 0 or need <= e.max_model_len]


class HasRoomFilter:
    """Free blocks (total - used - reserved) cover the blocks the request
    would newly take: uncached prompt blocks plus decode headroom."""

    name = "has_room"

    def filter(self, request: PlacementRequest, engines: Sequence[EngineView]) -> list[EngineView]:
        # free_blocks written out (same integers): per candidate per decision.
        return [e for e in engines if e.blocks_needed <= e.blocks_total - e.blocks_used - e.blocks_reserved]


class LeaseSlotsFilter:
    """Fewer leases than max_running + engine_queue_slack: enough in flight
    to keep the batch full between reports, the rest waits here. The last
    `p0_reserved_leases` slots are P0's alone."""

    name = "lease_slots"

    def filter(self, request: PlacementRequest, engines: Sequence[EngineView]) -> list[EngineView]:
        slot_priority = request.slot_priority   # once, not per engine
        return [e for e in engines if e.leases < e.lease_limit_for(slot_priority)]
