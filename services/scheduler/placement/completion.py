"""Engine views completed for one request: the fields placement's filters,
scorers and pickers read that depend on the request -- prefix blocks held,
cached tokens, blocks it would newly take, the queueing its class sees, the
live blocks it could evict.

Why apart and written flat: a decision completes every candidate's view
(~20 at the default placement_candidates, more warm ones on a large fleet),
so the per-request figures (tokens to place, P0 or not) are worked out once
and each view is a copy of the engine's field dict with five entries set --
not `dataclasses.replace`, whose frozen __init__ took ~9 us a view.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .interfaces import EngineView, PlacementRequest

__all__ = ["complete"]


def complete(
    request: PlacementRequest, engines: Sequence[EngineView], matches: Mapping[str, int],
    live: Mapping[str, int] | None, hash_block_tokens: int, headroom_tokens: int,
) -> list[EngineView]:
    """`engines` with the request's fields: `matches` = leading prefix hashes
    each holds, `live` = live hashes placed on each (None: not tracked).
    Blocks needed as reservations.blocks_needed counts them."""
    prompt = request.prompt_tokens
    total_tokens = prompt + min(request.max_tokens, headroom_tokens)   # prompt + decode room
    p0 = request.priority == 0
    matched, live_hashes = matches.get, (live or {}).get
    new, set_attr = object.__new__, object.__setattr__
    views = []
    for e in engines:
        block_size, engine_id = e.block_size, e.engine_id
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        prefix_blocks = matched(engine_id, 0)
        # min / max written out (integers: same values): per candidate per decision.
        cached = prefix_blocks * hash_block_tokens
        cached = cached if cached < prompt else prompt
        needed = -(-total_tokens // block_size) - cached // block_size
        live_blocks = 0
        if live:
            live_blocks = -(-(live_hashes(engine_id, 0) * hash_block_tokens) // block_size)
            live_blocks = live_blocks if live_blocks > e.blocks_used else e.blocks_used
        queue_seconds = e.p0_queue_seconds if p0 and e.p0_queue_seconds is not None else e.queue_seconds
        state: dict[str, Any] | None = getattr(e, "__dict__", None)
        if state is None:   # a slotted subclass: the slow, general path
            views.append(dataclasses.replace(
                e, prefix_blocks=prefix_blocks, cached_tokens=cached, blocks_needed=needed if needed > 0 else 0,
                queue_seconds=queue_seconds, live_blocks=live_blocks))
            continue
        # `dataclasses.replace` without re-running the frozen __init__: an
        # equal, still-frozen view whose field dict is a copy.
        state = state.copy()
        state["prefix_blocks"], state["cached_tokens"] = prefix_blocks, cached
        state["blocks_needed"] = needed if needed > 0 else 0
        state["queue_seconds"], state["live_blocks"] = queue_seconds, live_blocks
        view = new(type(e))
        set_attr(view, "__dict__", state)
        views.append(view)
    return views
