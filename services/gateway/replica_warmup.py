"""Whether a scheduler replica that came back has its engines yet (README
"Several schedulers").

A replica's channel turns READY as soon as a restarted process listens, but
its engines reconnect only within their own backoff (capped at 2 s,
engine/scheduler_link.py) and then send hello and a report: until they
have, a request admitted there waits for them, however idle the fleet is.
So each time a replica's channel turns READY again -- not the first time: a
gateway starting finds its replicas as they are -- the replica is *warming*:
`SchedulerReplicas.healthy` says no (it is ranked after the healthy
replicas) until its GetState lists as many engines with a fresh report as
the most any other ready, warm replica lists, or `WARMUP_MAX_SECONDS`
passed: a replica that never sees the whole fleet is used anyway rather
than never. With no other replica ready and warm it is not held back (it is
the only choice); one scheduler is never followed at all.

Ownership: one `follow` task per replica, started by
`SchedulerReplicas.start` and cancelled by its `close`; it alone writes its
`Warmup.warming`, which `SchedulerReplicas.healthy` reads, on the same loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from services.common.clock import Clock
from services.gateway.scheduler_client import SchedulerClient

__all__ = ["WARMUP_MAX_SECONDS", "Warmup", "fresh_engines", "follow"]

# Engines reconnect within 2 s of a replica's return (their backoff cap) and
# report at once; 10 s leaves a loaded machine room and still bounds the
# time a replica that never gets the whole fleet is passed over.
WARMUP_MAX_SECONDS = 10.0
# How often a warming replica and its peers are asked (GetState, only while warming).
_POLL_SECONDS = 0.05
_STATE_TIMEOUT_SECONDS = 1.0

_READY = grpc.ChannelConnectivity.READY

log = logging.getLogger(__name__)


@dataclass
class Warmup:
    """One replica's warm-up, as its `follow` task sees it: `warming` from
    the moment the replica is seen gone until its engines report to it
    after its return."""

    warming: bool = False


async def fresh_engines(client: SchedulerClient) -> int | None:
    """Engines the replica lists with a fresh report (placeable); None when
    it does not answer."""
    state = await client.get_state(_STATE_TIMEOUT_SECONDS)
    return None if state is None else sum(1 for e in state.engines if e.fresh)


async def _has_fleet(client: SchedulerClient, peers: Callable[[], list[SchedulerClient]],
                     count: Callable[[SchedulerClient], Awaitable[int | None]]) -> bool:
    """It lists as many fresh engines as any ready, warm peer (or has no such peer)."""
    others = [n for p in peers() if (n := await count(p)) is not None]
    if not others:
        return True
    mine = await count(client)
    return mine is not None and mine >= max(others)


async def _warm(client: SchedulerClient, peers: Callable[[], list[SchedulerClient]], warmup: Warmup,
                clock: Clock, count: Callable[[SchedulerClient], Awaitable[int | None]]) -> None:
    warmup.warming = True
    began = clock.monotonic()
    deadline = began + WARMUP_MAX_SECONDS
    why = f"not every engine reported to it within {WARMUP_MAX_SECONDS:g} s; taking requests anyway"
    try:
        # Polled: the engines' reconnects are seen only in the replica's state.
        for _ in range(int(WARMUP_MAX_SECONDS / _POLL_SECONDS)):
            if clock.monotonic() >= deadline:
                break
            if await _has_fleet(client, peers, count):
                why = "its engines report to it"
                break
            await asyncio.sleep(_POLL_SECONDS)
    finally:
        warmup.warming = False
    log.info("scheduler replica %s is back: passed over for %.2f s (%s)", client.address, clock.monotonic() - began,
             why)


async def follow(client: SchedulerClient, peers: Callable[[], list[SchedulerClient]], warmup: Warmup,
                 clock: Clock, count: Callable[[SchedulerClient], Awaitable[int | None]] = fresh_engines) -> None:
    """For ever: each time `client`'s channel turns READY again, warm up
    (module docstring). Not the first time: a gateway starting finds its
    replicas with their engines, or a mesh starting all of them without.
    `peers`: the other replicas ready and warm right now."""
    state = client.channel.get_state(try_to_connect=True)
    seen = False
    while True:
        if state == _READY:
            if seen:
                await _warm(client, peers, warmup, clock, count)
            seen = True
            state = client.channel.get_state(try_to_connect=True)
            if state != _READY:
                continue        # gone again meanwhile: wait for its next return
        elif seen:
            # Gone: held back from now on, so a request that finds its channel
            # READY again before this task has seen it is not admitted there.
            warmup.warming = True
        state = await client.wait_ready_change(state)
