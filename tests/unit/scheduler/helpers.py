"""Builders shared by the scheduler tests (a fake clock, engines, requests)."""

from __future__ import annotations

import dataclasses
from typing import Any

from services.common.clock import FakeClock
from services.common.config import MeshConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.engine_registry import EngineInfo, EngineLoad
from services.scheduler.events import (
    EngineCommand,
    EngineJoined,
    KvEventsReported,
    LoadReported,
    RequestArrived,
)
from services.scheduler.placement.interfaces import EngineView
from services.scheduler.records import AdmitOptions, Notice

MODEL = "m"


def make_config(**scheduler: Any) -> MeshConfig:
    config = MeshConfig()
    config.scheduler.metrics_port = 0
    for key, value in scheduler.items():
        setattr(config.scheduler, key, value)
    return config


def make_core(clock: FakeClock | None = None, **scheduler: Any) -> tuple[SchedulerCore, FakeClock]:
    clock = clock or FakeClock()
    return SchedulerCore(make_config(**scheduler), clock), clock


def opts(request_id: str, tenant: str = "t", priority: int = 1, **kw: Any) -> AdmitOptions:
    base: dict[str, Any] = dict(model=MODEL, prompt_tokens=32, max_tokens=16)
    base.update(kw)
    return AdmitOptions(request_id=request_id, tenant=tenant, priority=priority, **base)


def add_engine(
    core: SchedulerCore,
    engine_id: str,
    *,
    total_blocks: int = 1000,
    max_running: int = 8,
    weight: float = 1.0,
    block_size: int = 16,
    model: str = MODEL,
    report: bool = True,
    **load: Any,
) -> int:
    token = core.handle(EngineJoined(EngineInfo(
        engine_id=engine_id, address=f"{engine_id}:1", model=model, block_size=block_size,
        total_blocks=total_blocks, max_running=max_running, weight=weight, max_model_len=0,
    ))).token
    if report:
        report_load(core, engine_id, token, **load)
    return token


def report_load(core: SchedulerCore, engine_id: str, token: int, **load: Any):
    base: dict[str, Any] = dict(serving=True, blocks_total=core.fleet.get(engine_id).info.total_blocks)
    base.update(load)
    if "request_ids" in base:
        base["request_ids"] = frozenset(base["request_ids"])
    return core.handle(LoadReported(engine_id, token, EngineLoad(**base))).notices


def admit(core: SchedulerCore, options: AdmitOptions) -> Notice:
    """The arriving request's own first answer (Queued, Placed on re-attach,
    or Rejected); what the dispatch after it did is in the core's state."""
    return core.handle(RequestArrived(options)).notices[0][1]


def asks_resync(core: SchedulerCore, engine_id: str, token: int, seq: int, stored: list[int],
                removed: list[int], cleared: bool) -> bool:
    outbox = core.handle(KvEventsReported(engine_id, token, seq, stored, removed, cleared))
    return (engine_id, EngineCommand.RESYNC) in outbox.commands


def placed_engine(deliveries, request_id: str) -> str | None:
    for rid, notice in deliveries:
        if rid == request_id and hasattr(notice, "engine_id"):
            return notice.engine_id
    return None


def replace_options(o: AdmitOptions, **kw: Any) -> AdmitOptions:
    return dataclasses.replace(o, **kw)


# An idle serving engine of model "m"; tests override what they vary.
_VIEW_DEFAULTS: dict[str, Any] = dict(
    model="m", serving=True, draining=False, fresh=True, block_size=16, blocks_total=100, blocks_used=0,
    blocks_reserved=0, leases=0, lease_limit=10, max_running=8, running=0, waiting=0, queued_tokens=0,
    weight=1.0, max_model_len=0, queue_seconds=0.0,
)


def engine_view(engine_id: str, **fields: Any) -> EngineView:
    """A placement view of one engine: the defaults above, then `fields`."""
    return EngineView(engine_id=engine_id, **{**_VIEW_DEFAULTS, **fields})
