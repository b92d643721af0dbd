"""What `/v1/models` and gRPC `ListModels` list: the models some engine can
serve NOW, each with its context length and how many engines serve it.

A model is listed when it is configured here (its tokenizer loaded), the
caller's key may use it, and at least one engine registered with the
scheduler serves it (serving, not draining). The fleet comes from the
scheduler's `GetState`, cached for `CACHE_SECONDS` and fetched by one
caller at a time, so a client polling the list costs the scheduler at most
one call per second or two. If the scheduler cannot be reached the list is
empty: no engine can be placed on then either. The context length is the
smallest `max_model_len` the serving engines report (what every one of them
takes), else the gateway's own for the model.

A configured model no engine serves is not listed; a request for it still
gets the scheduler's clear 503 (`no_engine`), and `GET /v1/models/{id}` a 404
saying it is configured but not served now.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.common.clock import Clock
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.errors import ErrorKind, GatewayError

__all__ = ["CACHE_SECONDS", "ServedModel", "ServedModels", "served_from_state"]

# Long enough that a page or SDK polling /v1/models costs the scheduler
# nothing much; short enough that an engine gone (or new) shows within ~2 s.
CACHE_SECONDS = 1.5


@dataclass(frozen=True)
class ServedModel:
    engines: int
    max_model_len: int  # 0 = no engine reported one
    # The model revisions its serving engines report (EngineHello
    # model_revision; the response cache keys by it); empty = none sent.
    revisions: frozenset[str] = frozenset()


def served_from_state(state: scheduler_pb2.SchedulerState | None) -> dict[str, ServedModel]:
    """model -> how it is served, from a scheduler state (None: nothing)."""
    engines: dict[str, int] = {}
    lengths: dict[str, int] = {}
    revisions: dict[str, set[str]] = {}
    for engine in state.engines if state is not None else ():
        if not engine.serving or engine.draining:
            continue
        engines[engine.model] = engines.get(engine.model, 0) + 1
        if engine.model_revision:
            revisions.setdefault(engine.model, set()).add(engine.model_revision)
        if engine.max_model_len:
            known = lengths.get(engine.model, 0)
            lengths[engine.model] = engine.max_model_len if not known else min(known, engine.max_model_len)
    return {model: ServedModel(count, lengths.get(model, 0), frozenset(revisions.get(model, ())))
            for model, count in engines.items()}


class ServedModels:
    """The cached view of which models are served (see the module doc)."""

    def __init__(
        self, get_state: Callable[[], Awaitable[scheduler_pb2.SchedulerState | None]], clock: Clock,
        cache_seconds: float = CACHE_SECONDS,
    ) -> None:
        self._get_state = get_state
        self._clock = clock
        self._cache_seconds = cache_seconds
        self._served: dict[str, ServedModel] = {}
        self._at: float | None = None
        self._lock = asyncio.Lock()

    async def current(self) -> dict[str, ServedModel]:
        if self._fresh():
            return self._served
        async with self._lock:
            if not self._fresh():  # another caller may have fetched it meanwhile
                self._served = served_from_state(await self._get_state())
                self._at = self._clock.monotonic()
        return self._served

    def _fresh(self) -> bool:
        return self._at is not None and self._clock.monotonic() - self._at < self._cache_seconds

    async def listed(self, configured: list[str], allows: Callable[[str], bool],
                     own_length: Callable[[str], int]) -> list[tuple[str, int, int]]:
        """(model, context length, engines) for each listed model, by name."""
        served = await self.current()
        out = []
        for name in configured:
            model = served.get(name)
            if model is not None and allows(name):
                out.append((name, model.max_model_len or own_length(name), model.engines))
        return out

    async def require(self, name: str) -> ServedModel:
        """The model's serving view, or a 404 saying it is not served now."""
        model = (await self.current()).get(name)
        if model is None:
            raise GatewayError(
                ErrorKind.NOT_FOUND, f"the model {name!r} is configured but no engine serves it now",
                param="model", code="model_not_served")
        return model
