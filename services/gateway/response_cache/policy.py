"""Which requests the response cache may answer, and what a request asks of it.

A request uses the cache when its key's `response_cache` is "on", or
"request" and the request sends `X-Kvmesh-Cache: on` (HTTP header or gRPC
metadata). `Cache-Control: no-cache` skips the lookup but stores the fresh
answer; `no-store` neither reads nor stores (also `X-Kvmesh-Cache: off`).

Only an answer that is determined may be cached: temperature 0 (greedy) or
a fixed `seed`. Excluded, and why:
- no temperature and no seed: the engine's default temperature (vLLM: the
  model's generation_config, usually > 0) samples, so two answers differ;
- a resumed stream (Last-Event-ID / resume): it continues a generation in
  flight, whose events are the engine's, not a new answer.
Everything else that shapes the output -- n, logprobs, stop, logit_bias,
tools, structured output, echo -- is part of the key (key.py), so it is
replayed exactly as first produced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from services.common.openai_api.requests import GenerationInput

__all__ = ["HEADER", "CacheDirective", "CacheStatus", "directive_for", "uncacheable_reason"]

HEADER = "x-kvmesh-cache"


class CacheStatus(StrEnum):
    """What the cache did for one request (the `X-Kvmesh-Cache` answer)."""

    OFF = "off"          # the key does not use the cache: no header is sent
    HIT = "hit"          # replayed from the cache; no engine involved
    MISS = "miss"        # looked up, not found: generated (and stored)
    BYPASS = "bypass"    # not looked up: Cache-Control, or not cacheable


@dataclass(frozen=True)
class CacheDirective:
    read: bool
    write: bool


_OFF = CacheDirective(read=False, write=False)


def directive_for(mode: str, headers: Mapping[str, str]) -> CacheDirective | None:
    """What the request may do with the cache; None = the cache plays no
    part (the key's mode is off, or "request" without the header)."""
    asked = (headers.get(HEADER) or "").strip().lower()
    if mode == "off" or (mode == "request" and asked != "on"):
        return None
    if asked == "off":
        return _OFF
    controls = {part.strip().lower() for part in (headers.get("cache-control") or "").split(",")}
    if "no-store" in controls:
        return _OFF
    return CacheDirective(read="no-cache" not in controls, write=True)


def uncacheable_reason(request: GenerationInput, resumed: bool) -> str | None:
    """Why this request's answer cannot come from the cache; None = it can."""
    if resumed:
        return "resume"
    sampling = request.sampling
    if sampling.seed is None and (sampling.temperature is None or sampling.temperature > 0):
        return "sampled"
    return None
