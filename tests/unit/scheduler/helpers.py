"""Builders shared by the scheduler tests (a fake clock, engines, requests)."""

from __future__ import annotations

import dataclasses
from typing import Any

from services.common.clock import FakeClock
from services.common.config import MeshConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.records import AdmitOptions
from services.scheduler.registry import EngineInfo, EngineLoad

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
    base = dict(model=MODEL, prompt_tokens=32, max_tokens=16)
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
    token = core.engine_hello(EngineInfo(
        engine_id=engine_id, address=f"{engine_id}:1", model=model, block_size=block_size,
        total_blocks=total_blocks, max_running=max_running, weight=weight, max_model_len=0,
    ))
    if report:
        report_load(core, engine_id, token, **load)
    return token


def report_load(core: SchedulerCore, engine_id: str, token: int, **load: Any):
    base = dict(serving=True, blocks_total=core.engines.get(engine_id).info.total_blocks)
    base.update(load)
    if "request_ids" in base:
        base["request_ids"] = frozenset(base["request_ids"])
    return core.engine_load(engine_id, token, EngineLoad(**base))


def placed_engine(deliveries, request_id: str) -> str | None:
    for rid, notice in deliveries:
        if rid == request_id and hasattr(notice, "engine_id"):
            return notice.engine_id
    return None


def replace_options(o: AdmitOptions, **kw: Any) -> AdmitOptions:
    return dataclasses.replace(o, **kw)
