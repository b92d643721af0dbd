"""The Responses API's store: responses created with `store: true`, kept so
a later request can continue one (`previous_response_id`) or read it
(`GET /v1/responses/{id}`). README "Responses API".

`ResponsesStore` is what the API uses (async, so a shared store can sit
behind it); `build_responses_store` picks the one `responses.store` names:

- "embedded" (`EmbeddedResponses` over `ResponseStore`): a dict in this
  gateway's memory. A restart keeps nothing and replicas do not share it --
  right for one gateway.
- "redis" (responses_redis.py): the Redis the response cache uses, seen by
  every gateway, so a continuation may reach any of them.

Bounds (`responses:` in the config): each entry lives `ttl_seconds` from its
creation; past `max_entries` or `max_bytes` the oldest go first (Redis:
`max_entries` per API key, see ResponsesConfig). Entries are scoped to the
API key that created them: another key (even of the same tenant) is told the
id does not exist. Time comes from an injected clock. One owner: the
gateway's event loop (the embedded store has no awaits inside, no locks).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.clock import Clock
from services.common.config import MeshConfig
from services.common.config.responses import ResponsesConfig
from services.common.openai_api.responses_items import normalize_input

__all__ = ["EmbeddedResponses", "ResponseStore", "ResponsesStore", "StoreUnavailable", "StoredResponse",
           "build_responses_store"]


@dataclass(frozen=True)
class StoredResponse:
    owner: str                          # the API key's id that created it
    response: dict[str, Any]            # the Response object as returned
    history: list[dict[str, Any]]       # every input item of the conversation so far, this request's included
    expires_at: float                   # clock.monotonic()
    size: int                           # bytes counted against max_bytes

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a continuation replays: the inputs, then this response's output."""
        return [*self.history, *normalize_input(self.response["output"])]


class StoreUnavailable(Exception):
    """The shared store cannot be asked (down, timed out, breaker open)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ResponsesStore(Protocol):
    """What the Responses API needs of a store. `get`, `put` and `delete`
    raise StoreUnavailable when the store cannot answer (never a silent
    "not found": the response may well exist)."""

    @property
    def enabled(self) -> bool: ...

    async def put(self, owner: str, response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        """Keep `response`; False if it alone is larger than the bound."""
        ...

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The entry, or None when unknown, expired or another key's."""
        ...

    async def delete(self, owner: str, response_id: str) -> bool: ...

    async def aclose(self) -> None: ...


class ResponseStore:
    """The embedded store: one gateway's memory (synchronous)."""

    def __init__(self, config: ResponsesConfig, clock: Clock) -> None:
        self._config = config
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    @property
    def enabled(self) -> bool:
        return self._config.max_entries > 0

    def put(self, owner: str, response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        """Keep `response`; False if it alone is larger than the store."""
        size = len(json.dumps([response, history], separators=(",", ":")).encode())
        if not self.enabled or size > self._config.max_bytes:
            return False
        self.delete(owner, response["id"])
        entry = StoredResponse(owner, response, history, self._clock.monotonic() + self._config.ttl_seconds, size)
        self._entries[response["id"]] = entry
        self._bytes += size
        self._expire()
        while len(self._entries) > self._config.max_entries or self._bytes > self._config.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The entry, or None when unknown, expired or another key's."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        return entry

    def delete(self, owner: str, response_id: str) -> bool:
        entry = self.get(owner, response_id)
        if entry is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        self._bytes -= entry.size

    def _expire(self) -> None:
        """Entries expire in insertion order (one TTL for all), so only the
        front is ever checked."""
        now = self._clock.monotonic()
        while self._entries:
            first_id, first = next(iter(self._entries.items()))
            if first.expires_at > now:
                return
            self._drop(first_id)


class EmbeddedResponses:
    """`ResponsesStore` over this gateway's `ResponseStore`."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    async def put(self, owner: str, response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        return self.store.put(owner, response, history)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return self.store.get(owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return self.store.delete(owner, response_id)

    async def aclose(self) -> None:
        return None


def build_responses_store(config: MeshConfig, clock: Clock) -> ResponsesStore:
    """The store `responses.store` names."""
    if config.responses.store == "redis":
        # Imported only when used: redis-py loads OpenTelemetry's API at import,
        # which a gateway with tracing off must not (tests/unit/common/test_tracing.py).
        from services.gateway.responses_redis import RedisResponses
        return RedisResponses(config.responses, config.gateway.response_cache, clock)
    return EmbeddedResponses(ResponseStore(config.responses, clock))
