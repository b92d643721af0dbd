"""The Responses API's store, under `responses` in the YAML
(services/gateway/responses_store.py; README "Responses API"). Bounds are
checked at load by `validation.py`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ResponsesConfig"]


@dataclass
class ResponsesConfig:
    """What a gateway keeps of the responses created with `store: true`, so a
    later request can continue one with `previous_response_id`. The store is
    in the gateway's own memory: a restart keeps nothing, and replicas do not
    share it."""

    # How long a stored response can be continued or read, in seconds, from
    # when it was created. > 0. One hour: an agent's turns follow each other
    # within seconds to minutes; a longer-lived conversation resends its items.
    ttl_seconds: float = 3600.0
    # Most responses kept at once; the oldest goes first. >= 0 (0 = store
    # nothing: `store: true` is then refused with a 400).
    max_entries: int = 10000
    # Most bytes (JSON of the input and output items) kept at once; the
    # oldest goes first. > 0. 64 MiB: 10,000 agent turns of ~6 KiB each.
    max_bytes: int = 64 * 1024 * 1024
